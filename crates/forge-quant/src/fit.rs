//! Codebook fitting: weighted 1-D Lloyd for scalar LUTs, k-means for vector LUTs, and
//! round-to-nearest assignment. Every random choice (sampling, k-means++ seeding) comes from an
//! explicit seed.
//!
//! Inputs are the row-normalized weights `W/s`. For a vector format of length `d`, a "vector"
//! is the `d` values of consecutive output rows `d·g .. d·g+d` at one input column `j`.
//! Optional per-input-column weights (`diag(H)` from calibration, "AW") make errors in active
//! input directions count more.

use forge_model::sampling::Rng;
use half::f16;
use rayon::prelude::*;
use std::collections::HashMap;
use std::sync::{Mutex, OnceLock};

/// Scalar fits use at most this many sampled values.
pub const SCALAR_SAMPLES: usize = 65_536;
/// Vector fits choose among their starts on at most this many sampled vectors (1,000 per
/// centroid of a 64-entry codebook).
pub const VECTOR_SAMPLES: usize = 65_536;
/// Scalar Lloyd iterations, at most.
pub const MAX_ITERS: usize = 200;

pub fn f16_round(x: f32) -> f32 {
    f16::from_f32(x).to_f32()
}

/// Snap a fitted codebook onto the grid `f · q` (`f` a power of two, `q` integers in
/// `[-127, 127]`, `f` as fine as the largest magnitude allows). The runtime's integer-dot kernels
/// look such codebooks up as 8-bit integers with `pshufb` and stay exact; the grid step is at most
/// 1/64 of the largest entry, well under the spacing of a 64-entry codebook, and the values
/// remain FP16-exact.
pub fn snap_codebook(codebook: &mut [f32]) {
    let m = codebook.iter().fold(0f32, |a, v| a.max(v.abs()));
    if m == 0.0 || !m.is_finite() {
        return;
    }
    let f = 2f32.powi((m / 127.0).log2().ceil() as i32);
    for c in codebook.iter_mut() {
        *c = (*c / f).round().clamp(-127.0, 127.0) * f;
    }
}

/// `n` standard normal samples (Box–Muller), for seeded random projections and tests.
pub fn normal_samples(r: &mut Rng, n: usize) -> Vec<f32> {
    (0..n)
        .map(|_| {
            let (u1, u2) = (r.next_f64().max(1e-300), r.next_f64());
            ((-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()) as f32
        })
        .collect()
}

/// Sample `n` distinct-ish indices in `0..total` (all of them when `total ≤ n`), seeded.
fn sample_indices(total: usize, n: usize, rng: &mut Rng) -> Vec<usize> {
    if total <= n {
        return (0..total).collect();
    }
    (0..n).map(|_| (rng.next_u64() % total as u64) as usize).collect()
}

/// Weighted 1-D Lloyd with quantile initialization; returns `k` sorted FP16-exact centroids.
pub fn fit_scalar(values: &[f32], weights: Option<&[f32]>, k: usize, seed: u64) -> Vec<f32> {
    let mut rng = Rng::new(seed);
    let idx = sample_indices(values.len(), SCALAR_SAMPLES, &mut rng);
    let mut pts: Vec<(f32, f32)> = idx.iter().map(|&i| (values[i], weights.map_or(1.0, |w| w[i]))).collect();
    pts.sort_by(|a, b| a.0.total_cmp(&b.0));
    let total_w: f64 = pts.iter().map(|p| p.1 as f64).sum();
    // Quantile init by cumulative weight.
    let mut c = Vec::with_capacity(k);
    let mut acc = 0f64;
    let mut j = 0;
    for q in 0..k {
        let target = (q as f64 + 0.5) / k as f64 * total_w;
        while j + 1 < pts.len() && acc + (pts[j].1 as f64) < target {
            acc += pts[j].1 as f64;
            j += 1;
        }
        c.push(pts[j].0);
    }
    c.dedup();
    while c.len() < k {
        // Degenerate data (few distinct values): spread the extra centroids.
        let last = *c.last().unwrap_or(&0.0);
        c.push(last + 1e-3 * (c.len() as f32 + 1.0));
    }
    for _ in 0..MAX_ITERS {
        let mut sum = vec![0f64; k];
        let mut wsum = vec![0f64; k];
        let mut b = 0;
        for &(v, w) in &pts {
            // Points are sorted, so the nearest centroid index never decreases.
            while b + 1 < k && (v - c[b + 1]).abs() <= (v - c[b]).abs() {
                b += 1;
            }
            sum[b] += v as f64 * w as f64;
            wsum[b] += w as f64;
        }
        let mut moved = 0f32;
        for q in 0..k {
            if wsum[q] > 0.0 {
                let n = (sum[q] / wsum[q]) as f32;
                moved = moved.max((n - c[q]).abs());
                c[q] = n;
            }
        }
        c.sort_by(|a, b| a.total_cmp(b));
        if moved < 1e-7 {
            break;
        }
    }
    let mut c: Vec<f32> = c.into_iter().map(f16_round).collect();
    c.sort_by(|a, b| a.total_cmp(b));
    c
}

/// Weighted k-means in `d` dimensions; returns `k × d` FP16-exact centroids (the caller assigns
/// every vector to them).
///
/// [`STARTS`] starts on a seeded sample of at most [`VECTOR_SAMPLES`] vectors, each followed by
/// at most [`START_STEPS`] Lloyd steps: the Lloyd-optimal codebook of a standard Gaussian scaled
/// to the sample (rotated, row-normalized weights are close to Gaussian, so this start is nearly
/// converged already) and greedy k-means++ seedings (for data that is not, and for the local
/// optima a 16-entry codebook has). The start with the lowest weighted inertia then takes at most
/// [`REFINE_STEPS`] more steps on a larger sample of at most [`REFINE_SAMPLES`] vectors (every
/// vector of most matrices), so that the codebook fits the matrix rather than the first sample.
/// Every reduction runs over fixed chunks in a fixed order: the result does not depend on the
/// thread count.
pub fn fit_vector(vectors: &[f32], d: usize, weights: Option<&[f32]>, k: usize, seed: u64) -> Vec<f32> {
    let n_all = vectors.len() / d;
    let mut rng = Rng::new(seed);
    let gather = |idx: &[usize]| -> (Vec<f32>, Vec<f32>) {
        let pts = idx.iter().flat_map(|&i| vectors[i * d..(i + 1) * d].iter().copied()).collect();
        let w = idx.iter().map(|&i| weights.map_or(1.0, |w| w[i])).collect();
        (pts, w)
    };
    let (pts, w) = gather(&sample_indices(n_all, VECTOR_SAMPLES, &mut rng));
    let n = w.len();
    let (mean, std) = moments(&pts, d);
    let var_total = std.iter().map(|s| s * s).sum::<f64>() / d as f64;
    let template: Vec<f32> = gaussian_codebook(d, k)
        .chunks_exact(d)
        .flat_map(|c| (0..d).map(|t| (mean[t] + std[t] * c[t] as f64) as f32).collect::<Vec<_>>())
        .collect();
    let mut starts = vec![template];
    for s in 1..STARTS {
        let mut pp_rng = Rng::new(seed.wrapping_add(s as u64).wrapping_mul(0x9E3779B97F4A7C15));
        // Seeding needs far fewer points than fitting: a prefix of the (random) sample.
        let m = n.min(PP_SAMPLES);
        starts.push(kmeans_pp(&pts[..m * d], &w[..m], d, k.min(m), &mut pp_rng));
    }
    let mut best: Option<(f64, Vec<f32>)> = None;
    for c in starts {
        let c = pad_centers(c, d, k, &pts);
        let c = lloyd(&pts, &w, d, c, START_STEPS, START_TOL * var_total);
        let e = inertia(&pts, &w, d, &c);
        if best.as_ref().is_none_or(|b| e < b.0) {
            best = Some((e, c));
        }
    }
    let c = best.unwrap().1;
    let (pts, w) = if n_all > n { gather(&sample_indices(n_all, REFINE_SAMPLES, &mut rng)) } else { (pts, w) };
    let c = lloyd(&pts, &w, d, c, REFINE_STEPS, REFINE_TOL * var_total);
    c.iter().map(|&x| f16_round(x)).collect()
}

/// Starts: the Gaussian template and greedy k-means++ seedings.
pub const STARTS: usize = 3;
/// k-means++ seeds from at most this many of the sampled vectors.
pub const PP_SAMPLES: usize = 16_384;
/// Lloyd steps per start, at most, and the convergence threshold (total squared centroid move
/// relative to the data's variance, as scikit-learn's `tol`).
pub const START_STEPS: usize = 50;
pub const START_TOL: f64 = 1e-5;
/// The refinement: at most this many vectors and steps, to a finer threshold.
pub const REFINE_SAMPLES: usize = 1 << 20;
pub const REFINE_STEPS: usize = 30;
pub const REFINE_TOL: f64 = 1e-6;

/// Per-dimension mean and standard deviation of `n × d` points.
fn moments(pts: &[f32], d: usize) -> (Vec<f64>, Vec<f64>) {
    let n = (pts.len() / d).max(1);
    let mean: Vec<f64> =
        (0..d).map(|t| pts.iter().skip(t).step_by(d).map(|&v| v as f64).sum::<f64>() / n as f64).collect();
    let std = (0..d)
        .map(|t| (pts.iter().skip(t).step_by(d).map(|&v| (v as f64 - mean[t]).powi(2)).sum::<f64>() / n as f64).sqrt())
        .collect();
    (mean, std)
}

/// Fewer points than centroids (a tiny matrix): fill the codebook up with copies of points;
/// Lloyd moves the copies that stay empty onto the worst-served points.
fn pad_centers(mut c: Vec<f32>, d: usize, k: usize, pts: &[f32]) -> Vec<f32> {
    let n = pts.len() / d;
    let mut i = 0;
    while c.len() < k * d {
        if n == 0 {
            c.push(0.0);
        } else {
            c.extend_from_slice(&pts[(i % n) * d..(i % n + 1) * d]);
            i += 1;
        }
    }
    c
}

/// The Lloyd-optimal `k`-point codebook of the standard `d`-dimensional Gaussian, from k-means++
/// and Lloyd run to convergence on a fixed seeded sample; computed once per process.
pub fn gaussian_codebook(d: usize, k: usize) -> Vec<f32> {
    type Cache = Mutex<HashMap<(usize, usize), Vec<f32>>>;
    static CACHE: OnceLock<Cache> = OnceLock::new();
    let cache = CACHE.get_or_init(|| Mutex::new(HashMap::new()));
    if let Some(c) = cache.lock().unwrap().get(&(d, k)) {
        return c.clone();
    }
    let mut rng = Rng::new(0x6A05_5C0D);
    let pts = normal_samples(&mut rng, VECTOR_SAMPLES * d);
    let w = vec![1f32; VECTOR_SAMPLES];
    let c = kmeans_pp(&pts, &w, d, k, &mut rng);
    let c = lloyd(&pts, &w, d, c, 1000, 0.0);
    cache.lock().unwrap().insert((d, k), c.clone());
    c
}

/// Points per parallel chunk; reductions combine the chunks in index order.
const CHUNK: usize = 4096;

/// Centroids laid out for nearest-centroid queries: structure-of-arrays, padded to a multiple of
/// [`LANES`] with far-away dummies for the vectorized scan, and for two dimensions a grid whose
/// cells list the only centroids that can be nearest to a point inside them.
pub struct Centers {
    d: usize,
    kp: usize,
    soa: Vec<f32>,
    grid: Option<Grid>,
}

const LANES: usize = 8;
/// Coordinate of the padding centroids: no point is ever nearer to one of them.
const FAR: f32 = 1e15;

/// Uniform grid over the centroids' bounding box (widened by a quarter of its extent each side).
/// A cell's candidates are the centroids whose distance to the cell is at most the smallest
/// distance from any centroid to the cell's farthest corner: every point in the cell has its
/// nearest centroid among them (ties included), so a scan over them in index order gives the
/// full scan's answer, and a cell with one candidate needs no distance at all. Points outside
/// the grid take the full scan.
struct Grid {
    x0: f32,
    y0: f32,
    inv: [f32; 2],
    g: usize,
    /// Candidates of cell `c`: `cand[start[c]..start[c + 1]]`, as (x, y, index).
    start: Vec<u32>,
    /// Per cell, a lower bound on the distance from any of its points to any centroid that is
    /// not a candidate.
    beyond: Vec<f32>,
    cand: Vec<Cand>,
}

/// A grid cell's candidate centroid: its coordinates and index.
type Cand = (f32, f32, u32);

impl Grid {
    fn new(codebook: &[f32]) -> Option<Grid> {
        let k = codebook.len() / 2;
        if k < 2 * LANES || k > u16::MAX as usize {
            return None;
        }
        let cx: Vec<f32> = codebook.iter().step_by(2).copied().collect();
        let cy: Vec<f32> = codebook.iter().skip(1).step_by(2).copied().collect();
        let bounds = |v: &[f32]| {
            let (lo, hi) = v.iter().fold((f32::MAX, f32::MIN), |(a, b), &x| (a.min(x), b.max(x)));
            let pad = 0.25 * (hi - lo);
            (lo - pad, hi + pad)
        };
        let ((xl, xh), (yl, yh)) = (bounds(&cx), bounds(&cy));
        if !(xh > xl && yh > yl && (xh - xl).is_finite() && (yh - yl).is_finite()) {
            return None;
        }
        let g = Grid::side(k);
        let (wx, wy) = ((xh - xl) / g as f32, (yh - yl) / g as f32);
        // Squared distances split by axis: per column (row) of cells, the nearest and farthest
        // offsets of every centroid's coordinate from the cell's interval, each interval widened
        // slightly so that a cell holds every point whose rounded cell index lands in it.
        let axis = |c: &[f32], lo: f32, wd: f32| -> (Vec<f32>, Vec<f32>) {
            let (mut near, mut far) = (vec![0f32; g * k], vec![0f32; g * k]);
            for i in 0..g {
                let (a, b) = (lo + i as f32 * wd - 1e-3 * wd, lo + (i + 1) as f32 * wd + 1e-3 * wd);
                for (q, &x) in c.iter().enumerate() {
                    let n = (a - x).max(0.0).max(x - b);
                    let f = (x - a).abs().max((x - b).abs());
                    near[i * k + q] = n * n;
                    far[i * k + q] = f * f;
                }
            }
            (near, far)
        };
        let (nx, fx) = axis(&cx, xl, wx);
        let (ny, fy) = axis(&cy, yl, wy);
        let mut start = Vec::with_capacity(g * g + 1);
        let mut beyond = Vec::with_capacity(g * g);
        let mut cand = Vec::new();
        let mut far = vec![0f32; k];
        for iy in 0..g {
            let (nyr, fyr) = (&ny[iy * k..(iy + 1) * k], &fy[iy * k..(iy + 1) * k]);
            for ix in 0..g {
                let (nxr, fxr) = (&nx[ix * k..(ix + 1) * k], &fx[ix * k..(ix + 1) * k]);
                for ((f, a), b) in far.iter_mut().zip(fxr).zip(fyr) {
                    *f = a + b;
                }
                let u = far.iter().fold(f32::INFINITY, |m, &v| m.min(v)) * (1.0 + 1e-4);
                start.push(cand.len() as u32);
                beyond.push(u.sqrt() * (1.0 - 1e-5));
                for q in 0..k {
                    if nxr[q] + nyr[q] <= u {
                        cand.push((cx[q], cy[q], q as u32));
                    }
                }
            }
        }
        start.push(cand.len() as u32);
        Some(Grid { x0: xl, y0: yl, inv: [1.0 / wx, 1.0 / wy], g, start, beyond, cand })
    }

    /// Cells per side for `k` centroids: 16 cells per centroid, so that most cells hold one or two
    /// candidates.
    fn side(k: usize) -> usize {
        4 * (k as f64).sqrt().ceil() as usize
    }

    fn cells(k: usize) -> usize {
        Grid::side(k) * Grid::side(k)
    }

    /// The candidates of the cell holding `(x, y)` and the cell's bound on the distance to any
    /// other centroid; `None` outside the grid.
    #[inline]
    fn cell_bound(&self, x: f32, y: f32) -> Option<(&[Cand], f32)> {
        let fx = (x - self.x0) * self.inv[0];
        let fy = (y - self.y0) * self.inv[1];
        let g = self.g as f32;
        if !(fx >= 0.0 && fx < g && fy >= 0.0 && fy < g) {
            return None;
        }
        let c = (fy as usize).min(self.g - 1) * self.g + (fx as usize).min(self.g - 1);
        Some((&self.cand[self.start[c] as usize..self.start[c + 1] as usize], self.beyond[c]))
    }

    /// The candidates of the cell holding `(x, y)`; `None` outside the grid.
    #[inline]
    fn cell(&self, x: f32, y: f32) -> Option<&[Cand]> {
        self.cell_bound(x, y).map(|c| c.0)
    }
}

#[inline]
fn nearest_of(cands: &[Cand], x: f32, y: f32) -> (usize, f32) {
    let mut best = (0usize, f32::INFINITY);
    for &(cx, cy, q) in cands {
        let (dx, dy) = (x - cx, y - cy);
        let e = dx * dx + dy * dy;
        if e < best.1 {
            best = (q as usize, e);
        }
    }
    best
}

impl Centers {
    pub fn new(codebook: &[f32], d: usize) -> Centers {
        Centers::build(codebook, d, true)
    }

    /// Without the grid when few queries will follow: building it costs about as much as
    /// [`Grid::cells`]`(k)` full scans.
    fn build(codebook: &[f32], d: usize, grid: bool) -> Centers {
        let k = codebook.len() / d;
        let kp = k.div_ceil(LANES) * LANES;
        let mut soa = vec![FAR; d * kp];
        for (q, c) in codebook.chunks_exact(d).enumerate() {
            for t in 0..d {
                soa[t * kp + q] = c[t];
            }
        }
        let grid = if d == 2 && grid { Grid::new(codebook) } else { None };
        Centers { d, kp, soa, grid }
    }

    /// Index of the nearest centroid (ties → lowest index) and its squared distance.
    #[inline]
    pub fn nearest(&self, p: &[f32]) -> (usize, f32) {
        match self.grid.as_ref().and_then(|g| g.cell(p[0], p[1])) {
            Some(c) => nearest_of(c, p[0], p[1]),
            None => self.scan(p),
        }
    }

    /// Index of the nearest centroid (ties → lowest index), without its distance when the grid
    /// leaves a single candidate.
    #[inline]
    pub fn index(&self, p: &[f32]) -> usize {
        match self.grid.as_ref().and_then(|g| g.cell(p[0], p[1])) {
            Some([(_, _, q)]) => *q as usize,
            Some(c) => nearest_of(c, p[0], p[1]).0,
            None => self.scan(p).0,
        }
    }

    /// Nearest centroid, its squared distance, and a lower bound on the distance to every other
    /// centroid (0 when the point lies outside the grid).
    #[inline]
    fn nearest_bounded(&self, p: &[f32]) -> (usize, f32, f32) {
        match self.grid.as_ref().and_then(|g| g.cell_bound(p[0], p[1])) {
            Some((cands, beyond)) => {
                let (mut b, mut e1, mut e2) = (0usize, f32::INFINITY, f32::INFINITY);
                for &(cx, cy, q) in cands {
                    let (dx, dy) = (p[0] - cx, p[1] - cy);
                    let e = dx * dx + dy * dy;
                    if e < e1 {
                        e2 = e1;
                        e1 = e;
                        b = q as usize;
                    } else if e < e2 {
                        e2 = e;
                    }
                }
                (b, e1, beyond.min(e2.sqrt() * (1.0 - 1e-5)))
            }
            None => {
                let (b, e) = self.scan(p);
                (b, e, 0.0)
            }
        }
    }

    /// [`Centers::nearest`] by scanning every centroid.
    #[inline]
    pub fn scan(&self, p: &[f32]) -> (usize, f32) {
        let (mut bd, mut bi) = ([f32::INFINITY; LANES], [0u32; LANES]);
        let kp = self.kp;
        for blk in 0..kp / LANES {
            let mut dist = [0f32; LANES];
            for (t, &x) in p.iter().enumerate().take(self.d) {
                let c: &[f32; LANES] = self.soa[t * kp + blk * LANES..][..LANES].try_into().unwrap();
                for l in 0..LANES {
                    let e = x - c[l];
                    dist[l] += e * e;
                }
            }
            for l in 0..LANES {
                if dist[l] < bd[l] {
                    bd[l] = dist[l];
                    bi[l] = (blk * LANES + l) as u32;
                }
            }
        }
        let mut best = (bi[0], bd[0]);
        for l in 1..LANES {
            if bd[l] < best.1 || (bd[l] == best.1 && bi[l] < best.0) {
                best = (bi[l], bd[l]);
            }
        }
        (best.0 as usize, best.1)
    }
}

/// Weighted Lloyd from `c` for at most `steps` steps, stopping early when no point changes its
/// centroid or the centroids move by at most `tol` (squared, summed). A centroid left without
/// points moves onto the point the codebook serves worst.
///
/// A point keeps its centroid unexamined while an upper bound on its distance to it (the last
/// exact distance plus the centroid's moves since) is under half the distance from that centroid
/// to the nearest other one: no other centroid can then be nearer (Elkan's first lemma). Late
/// steps, where few points change, cost little more than the centroid sums.
fn lloyd(pts: &[f32], w: &[f32], d: usize, c: Vec<f32>, steps: usize, tol: f64) -> Vec<f32> {
    match d {
        1 => lloyd_d::<1>(pts, w, c, steps, tol),
        2 => lloyd_d::<2>(pts, w, c, steps, tol),
        3 => lloyd_d::<3>(pts, w, c, steps, tol),
        4 => lloyd_d::<4>(pts, w, c, steps, tol),
        _ => panic!("vector codebooks of dimension {d} are not supported"),
    }
}

fn lloyd_d<const D: usize>(pts: &[f32], w: &[f32], mut c: Vec<f32>, steps: usize, tol: f64) -> Vec<f32> {
    let d = D;
    let n = w.len();
    let k = c.len() / d;
    if n == 0 || k == 0 {
        return c;
    }
    let mut assign = vec![u32::MAX; n];
    let mut upper = vec![f32::INFINITY; n];
    let mut lower = vec![0f32; n];
    let mut moved = vec![0f32; k];
    let mut max_moved = 0f32;
    // Cluster sums (d weighted coordinates, then the weight) and sizes, updated by the points that
    // change cluster only.
    let mut sums = vec![0f64; k * (d + 1)];
    let mut sizes = vec![0i64; k];
    let mut queries = n;
    for _ in 0..steps {
        let centers = Centers::build(&c, d, queries > Grid::cells(k));
        let cq = |q: usize| -> &[f32; D] { c[q * D..(q + 1) * D].try_into().unwrap() };
        // Half the distance from each centroid to its nearest other one, less a margin for the
        // rounding of the bounds.
        let half: Vec<f32> = (0..k)
            .map(|q| {
                let m = (0..k).filter(|&r| r != q).map(|r| sq_d(cq(q), cq(r))).fold(f32::INFINITY, f32::min);
                0.5 * m.sqrt() * (1.0 - 1e-5)
            })
            .collect();
        let parts: Vec<(usize, usize, Vec<f64>, Vec<i64>)> = assign
            .par_chunks_mut(CHUNK)
            .zip(upper.par_chunks_mut(CHUNK))
            .zip(lower.par_chunks_mut(CHUNK))
            .enumerate()
            .map(|(ci, ((a, u), l))| {
                let (mut changed, mut queries) = (0, 0);
                let mut delta = vec![0f64; k * (d + 1)];
                let mut dsize = vec![0i64; k];
                for o in 0..a.len() {
                    let q = a[o] as usize;
                    let mut bound = 0f32;
                    if q < k {
                        u[o] += moved[q];
                        l[o] -= max_moved;
                        bound = half[q].max(l[o]);
                        if u[o] <= bound {
                            continue;
                        }
                    }
                    let i = ci * CHUNK + o;
                    let p: &[f32; D] = pts[i * D..(i + 1) * D].try_into().unwrap();
                    if q < k {
                        u[o] = sq_d(p, cq(q)).sqrt();
                        if u[o] <= bound {
                            continue;
                        }
                    }
                    queries += 1;
                    let (b, e, lo) = if D == 2 {
                        centers.nearest_bounded(p)
                    } else {
                        let (b, e) = centers.nearest(p);
                        (b, e, 0.0)
                    };
                    u[o] = e.sqrt();
                    l[o] = lo;
                    if b != q {
                        changed += 1;
                        a[o] = b as u32;
                        let wi = w[i] as f64;
                        if q < k {
                            for t in 0..d {
                                delta[q * (d + 1) + t] -= p[t] as f64 * wi;
                            }
                            delta[q * (d + 1) + d] -= wi;
                            dsize[q] -= 1;
                        }
                        for t in 0..d {
                            delta[b * (d + 1) + t] += p[t] as f64 * wi;
                        }
                        delta[b * (d + 1) + d] += wi;
                        dsize[b] += 1;
                    }
                }
                (changed, queries, delta, dsize)
            })
            .collect();
        let changed: usize = parts.iter().map(|p| p.0).sum();
        queries = parts.iter().map(|p| p.1).sum();
        for (_, _, delta, dsize) in &parts {
            sums.iter_mut().zip(delta).for_each(|(x, y)| *x += y);
            sizes.iter_mut().zip(dsize).for_each(|(x, y)| *x += y);
        }
        let old = c.clone();
        let mut err: Option<Vec<f32>> = None;
        for q in 0..k {
            let ws = sums[q * (d + 1) + d];
            if sizes[q] > 0 {
                if ws > 0.0 {
                    for t in 0..d {
                        c[q * d + t] = (sums[q * (d + 1) + t] / ws) as f32;
                    }
                }
                continue;
            }
            let err = err.get_or_insert_with(|| {
                pts.par_chunks(d).zip(w.par_iter()).map(|(p, &wi)| centers.nearest(p).1 * wi).collect()
            });
            if let Some(far) = worst(err) {
                c[q * d..(q + 1) * d].copy_from_slice(&pts[far * d..(far + 1) * d]);
                err[far] = 0.0;
            }
        }
        for (q, m) in moved.iter_mut().enumerate() {
            *m = sq(&c[q * D..(q + 1) * D], &old[q * D..(q + 1) * D]).sqrt() * (1.0 + 1e-5);
        }
        max_moved = moved.iter().fold(0f32, |a, &b| a.max(b));
        let shift: f64 = c.iter().zip(&old).map(|(a, b)| ((a - b) as f64).powi(2)).sum();
        if changed == 0 || shift <= tol {
            break;
        }
    }
    c
}

/// The point with the largest positive weighted error (first on ties).
fn worst(err: &[f32]) -> Option<usize> {
    let mut best: Option<(usize, f32)> = None;
    for (i, &e) in err.iter().enumerate() {
        if e > 0.0 && best.is_none_or(|b| e > b.1) {
            best = Some((i, e));
        }
    }
    best.map(|b| b.0)
}

/// Weighted sum of squared distances to the nearest centroid.
fn inertia(pts: &[f32], w: &[f32], d: usize, c: &[f32]) -> f64 {
    let centers = Centers::new(c, d);
    let parts: Vec<f64> = pts
        .par_chunks(CHUNK * d)
        .zip(w.par_chunks(CHUNK))
        .map(|(p, w)| p.chunks_exact(d).zip(w).map(|(p, &wi)| centers.nearest(p).1 as f64 * wi as f64).sum())
        .collect();
    parts.iter().sum()
}

/// Greedy k-means++ (scikit-learn's seeding): each new centroid is the best of `2 + ln k`
/// candidates drawn with probability proportional to the weighted squared distance to the
/// centroids so far, "best" meaning the lowest total weighted distance once it is added.
fn kmeans_pp(pts: &[f32], w: &[f32], d: usize, k: usize, rng: &mut Rng) -> Vec<f32> {
    let n = w.len();
    let mut c = Vec::with_capacity(k * d);
    if n == 0 {
        return c;
    }
    let trials = 2 + (k as f64).ln().floor().max(0.0) as usize;
    let first = (rng.next_u64() % n as u64) as usize;
    c.extend_from_slice(&pts[first * d..(first + 1) * d]);
    let mut dist: Vec<f64> = (0..n).map(|i| sq(&pts[i * d..(i + 1) * d], &c[0..d]) as f64 * w[i] as f64).collect();
    // The potential with a candidate added, summed over fixed chunks in order.
    let potential = |dist: &[f64], cand: &[f32]| -> f64 {
        let parts: Vec<f64> = dist
            .par_chunks(CHUNK)
            .enumerate()
            .map(|(ci, dc)| {
                let mut s = 0f64;
                for (o, &di) in dc.iter().enumerate() {
                    let i = ci * CHUNK + o;
                    s += di.min(sq(&pts[i * d..(i + 1) * d], cand) as f64 * w[i] as f64);
                }
                s
            })
            .collect();
        parts.iter().sum()
    };
    for _ in 1..k {
        let sum: f64 = dist.par_chunks(CHUNK).map(|c| c.iter().sum::<f64>()).collect::<Vec<_>>().iter().sum();
        let mut best: Option<(f64, usize)> = None;
        for _ in 0..trials {
            let mut r = rng.next_f64() * sum;
            let mut pick = n - 1;
            for (i, &di) in dist.iter().enumerate() {
                r -= di;
                if r <= 0.0 {
                    pick = i;
                    break;
                }
            }
            let pot = potential(&dist, &pts[pick * d..(pick + 1) * d]);
            if best.is_none_or(|b| pot < b.0) {
                best = Some((pot, pick));
            }
        }
        let pick = best.unwrap().1;
        let cand = &pts[pick * d..(pick + 1) * d];
        c.extend_from_slice(cand);
        dist.par_iter_mut().enumerate().for_each(|(i, di)| {
            *di = di.min(sq(&pts[i * d..(i + 1) * d], cand) as f64 * w[i] as f64);
        });
    }
    c
}

#[inline]
fn sq_d<const D: usize>(a: &[f32; D], b: &[f32; D]) -> f32 {
    let mut e = 0f32;
    for t in 0..D {
        e += (a[t] - b[t]) * (a[t] - b[t]);
    }
    e
}

#[inline]
fn sq(a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).map(|(x, y)| (x - y) * (x - y)).sum()
}

/// Index of the nearest centroid (ties → lowest index) and its squared distance.
pub fn nearest(codebook: &[f32], d: usize, p: &[f32]) -> (usize, f32) {
    Centers::new(codebook, d).nearest(p)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gaussian(n: usize, seed: u64) -> Vec<f32> {
        normal_samples(&mut Rng::new(seed), n)
    }

    #[test]
    fn lloyd_max_gaussian_levels() {
        // Lloyd–Max 2-bit quantizer for N(0,1): ±0.4528, ±1.510 (Max, 1960).
        let v = gaussian(200_000, 3);
        let c = fit_scalar(&v, None, 4, 1);
        let want = [-1.510, -0.4528, 0.4528, 1.510];
        for (a, b) in c.iter().zip(want) {
            assert!((a - b).abs() < 0.02, "{c:?}");
        }
        assert!(c.iter().all(|&x| f16_round(x) == x));
    }

    #[test]
    fn weights_pull_centroids() {
        // Two clusters; weighting the right one heavily with k=1 moves the centroid to it.
        let v = [0.0f32, 0.0, 1.0, 1.0];
        let c = fit_scalar(&v, Some(&[1.0, 1.0, 9.0, 9.0]), 1, 0);
        assert!((c[0] - 0.9).abs() < 1e-3, "{c:?}");
    }

    #[test]
    fn kmeans_finds_planted_clusters() {
        let centers = [(-2.0f32, 1.0f32), (3.0, 3.0), (0.5, -4.0)];
        let noise = gaussian(6000, 9);
        let mut pts = Vec::new();
        for i in 0..3000 {
            let (x, y) = centers[i % 3];
            pts.push(x + 0.05 * noise[2 * i]);
            pts.push(y + 0.05 * noise[2 * i + 1]);
        }
        let c = fit_vector(&pts, 2, None, 3, 5);
        for (x, y) in centers {
            let (q, e) = nearest(&c, 2, &[x, y]);
            assert!(e < 0.01, "center {x},{y} → centroid {q} at distance² {e}: {c:?}");
        }
        assert_eq!(fit_vector(&pts, 2, None, 3, 5), c, "same seed, same result");
    }

    #[test]
    fn kmeans_recovers_a_planted_mixture_of_64() {
        // 64 well-separated centers on a jittered 8 × 8 lattice, unequal cluster sizes and
        // weights: every center is found within the noise of its cluster mean.
        let mut r = Rng::new(17);
        let centers: Vec<(f32, f32)> = (0..64)
            .map(|i| {
                ((i % 8) as f32 * 2.0 + 0.3 * r.next_f64() as f32, (i / 8) as f32 * 2.0 + 0.3 * r.next_f64() as f32)
            })
            .collect();
        let noise = gaussian(400_000, 23);
        let (mut pts, mut w) = (Vec::new(), Vec::new());
        for i in 0..200_000 {
            let (x, y) = centers[(i * 7 + i / 3) % 64];
            pts.push(x + 0.1 * noise[2 * i]);
            pts.push(y + 0.1 * noise[2 * i + 1]);
            w.push(1.0 + (i % 5) as f32);
        }
        for weights in [None, Some(&w[..])] {
            let c = fit_vector(&pts, 2, weights, 64, 5);
            for &(x, y) in &centers {
                let (q, e) = nearest(&c, 2, &[x, y]);
                assert!(e < 1e-3, "center {x},{y} → centroid {q} at distance² {e}");
            }
        }
    }

    #[test]
    fn kmeans_is_deterministic_and_thread_count_independent() {
        let v = gaussian(2 * 300_000, 4);
        let fit = |threads: usize| {
            rayon::ThreadPoolBuilder::new()
                .num_threads(threads)
                .build()
                .unwrap()
                .install(|| fit_vector(&v, 2, None, 64, 9))
        };
        let a = fit(1);
        assert_eq!(fit(2), a);
        assert_eq!(fit(3), a);
        assert!(a.iter().all(|&x| f16_round(x) == x));
        assert_ne!(fit_vector(&v, 2, None, 64, 10), a, "the seed matters");
    }

    #[test]
    fn grid_lookup_is_the_full_scan() {
        // Random codebooks (some with duplicated and coincident centroids), points inside, on
        // the edges of and far outside the grid: the same index as the scan, ties included.
        let mut r = Rng::new(8);
        for (k, spread) in [(16usize, 1.0f32), (64, 1.0), (64, 0.01), (256, 3.0)] {
            let mut cb = normal_samples(&mut r, 2 * k);
            cb.iter_mut().for_each(|x| *x = f16_round(*x * spread));
            cb[2] = cb[0];
            cb[3] = cb[1];
            let c = Centers::new(&cb, 2);
            assert!(c.grid.is_some());
            let mut pts = normal_samples(&mut r, 200_000);
            pts.iter_mut().enumerate().for_each(|(i, x)| *x *= spread * if i % 1000 == 0 { 50.0 } else { 1.5 });
            // Points exactly at centroids and halfway between two of them (ties).
            for q in 0..k {
                pts.extend_from_slice(&cb[2 * q..2 * q + 2]);
                let o = (q + 1) % k;
                pts.push(0.5 * (cb[2 * q] + cb[2 * o]));
                pts.push(0.5 * (cb[2 * q + 1] + cb[2 * o + 1]));
            }
            for p in pts.chunks_exact(2) {
                let want = c.scan(p);
                assert_eq!(c.nearest(p), want, "k {k}, point {p:?}");
                assert_eq!(c.index(p), want.0, "k {k}, point {p:?}");
                let (b, e, lower) = c.nearest_bounded(p);
                assert_eq!((b, e), want);
                for (q, cq) in cb.chunks_exact(2).enumerate() {
                    if q != b && cq != &cb[2 * b..2 * b + 2] {
                        assert!(sq(p, cq).sqrt() >= lower, "k {k}: bound {lower} above centroid {q}");
                    }
                }
            }
        }
    }
}
