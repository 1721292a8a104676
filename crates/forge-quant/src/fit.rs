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

/// Scalar fits use at most this many sampled values.
pub const SCALAR_SAMPLES: usize = 65_536;
/// Vector fits use at most this many sampled vectors.
pub const VECTOR_SAMPLES: usize = 300_000;
pub const KMEANS_INITS: usize = 3;
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

/// Weighted k-means in `d` dimensions (k-means++ init, `KMEANS_INITS` restarts, best inertia);
/// returns `k × d` FP16-exact centroids.
pub fn fit_vector(vectors: &[f32], d: usize, weights: Option<&[f32]>, k: usize, seed: u64) -> Vec<f32> {
    let n_all = vectors.len() / d;
    let mut rng = Rng::new(seed);
    let idx = sample_indices(n_all, VECTOR_SAMPLES, &mut rng);
    let pts: Vec<f32> = idx.iter().flat_map(|&i| vectors[i * d..(i + 1) * d].iter().copied()).collect();
    let w: Vec<f32> = idx.iter().map(|&i| weights.map_or(1.0, |w| w[i])).collect();
    let n = idx.len();
    // Mean per-dimension variance of the sample, scaling the convergence tolerance.
    let var_total: f64 = (0..d)
        .map(|t| {
            let m = (0..n).map(|i| pts[i * d + t] as f64).sum::<f64>() / n as f64;
            (0..n).map(|i| (pts[i * d + t] as f64 - m).powi(2)).sum::<f64>() / n as f64
        })
        .sum::<f64>()
        / d as f64;
    let mut best: Option<(f64, Vec<f32>)> = None;
    for init in 0..KMEANS_INITS {
        let mut rng = Rng::new(seed.wrapping_add(1 + init as u64).wrapping_mul(0x9E3779B97F4A7C15));
        let mut c = kmeans_pp(&pts, &w, d, k, &mut rng);
        let mut assign = vec![0u32; n];
        let mut inertia = f64::MAX;
        for _iter in 0..MAX_ITERS {
            let changed: usize = assign
                .par_chunks_mut(4096)
                .enumerate()
                .map(|(ci, a)| {
                    let mut ch = 0;
                    for (o, slot) in a.iter_mut().enumerate() {
                        let p = &pts[(ci * 4096 + o) * d..(ci * 4096 + o + 1) * d];
                        let (b, _) = nearest(&c, d, p);
                        if *slot != b as u32 {
                            *slot = b as u32;
                            ch += 1;
                        }
                    }
                    ch
                })
                .sum();
            let old = c.clone();
            let mut sum = vec![0f64; k * d];
            let mut ws = vec![0f64; k];
            for i in 0..n {
                let a = assign[i] as usize;
                ws[a] += w[i] as f64;
                for t in 0..d {
                    sum[a * d + t] += pts[i * d + t] as f64 * w[i] as f64;
                }
            }
            for q in 0..k {
                if ws[q] > 0.0 {
                    for t in 0..d {
                        c[q * d + t] = (sum[q * d + t] / ws[q]) as f32;
                    }
                } else {
                    // Empty cluster: restart it at a random sample.
                    let r = (rng.next_u64() % n as u64) as usize;
                    c[q * d..(q + 1) * d].copy_from_slice(&pts[r * d..(r + 1) * d]);
                }
            }
            // Converged (as scikit-learn's tol = 1e-4): the centroids moved by less than 1e-4 of
            // the data's variance, or no point changed cluster.
            let shift: f64 = c.iter().zip(&old).map(|(a, b)| ((a - b) as f64).powi(2)).sum();
            if changed == 0 || shift <= 1e-4 * var_total {
                break;
            }
        }
        let cr: Vec<f32> = c.iter().map(|&x| f16_round(x)).collect();
        let e: f64 =
            (0..n).into_par_iter().map(|i| nearest(&cr, d, &pts[i * d..(i + 1) * d]).1 as f64 * w[i] as f64).sum();
        inertia = inertia.min(e);
        if best.as_ref().is_none_or(|b| inertia < b.0) {
            best = Some((inertia, cr));
        }
    }
    best.unwrap().1
}

fn kmeans_pp(pts: &[f32], w: &[f32], d: usize, k: usize, rng: &mut Rng) -> Vec<f32> {
    let n = w.len();
    let mut c = Vec::with_capacity(k * d);
    let first = (rng.next_u64() % n as u64) as usize;
    c.extend_from_slice(&pts[first * d..(first + 1) * d]);
    let mut dist: Vec<f64> = (0..n).map(|i| sq(&pts[i * d..(i + 1) * d], &c[0..d]) as f64 * w[i] as f64).collect();
    for _ in 1..k {
        let total: f64 = dist.iter().sum();
        let mut r = rng.next_f64() * total;
        let mut pick = n - 1;
        for (i, &di) in dist.iter().enumerate() {
            r -= di;
            if r <= 0.0 {
                pick = i;
                break;
            }
        }
        let start = c.len();
        c.extend_from_slice(&pts[pick * d..(pick + 1) * d]);
        let newc = c[start..start + d].to_vec();
        dist.par_iter_mut().enumerate().for_each(|(i, di)| {
            let e = sq(&pts[i * d..(i + 1) * d], &newc) as f64 * w[i] as f64;
            if e < *di {
                *di = e;
            }
        });
    }
    c
}

#[inline]
fn sq(a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).map(|(x, y)| (x - y) * (x - y)).sum()
}

/// Index of the nearest centroid (ties → lowest index) and its squared distance.
#[inline]
pub fn nearest(codebook: &[f32], d: usize, p: &[f32]) -> (usize, f32) {
    if d == 2 {
        return nearest2(codebook, p[0], p[1]);
    }
    let mut best = (0, f32::MAX);
    for (q, c) in codebook.chunks_exact(d).enumerate() {
        let e = sq(p, c);
        if e < best.1 {
            best = (q, e);
        }
    }
    best
}

/// Two-dimensional case, the hot loop of vector fits and rounders: distances to all
/// centroids first (a loop the compiler vectorizes), then the argmin.
#[inline]
fn nearest2(codebook: &[f32], x: f32, y: f32) -> (usize, f32) {
    let k = codebook.len() / 2;
    // Structure-of-arrays copy so the distance loop vectorizes (K ≤ 256).
    let (mut cx, mut cy, mut dist) = ([0f32; 256], [0f32; 256], [0f32; 256]);
    for (q, c) in codebook.chunks_exact(2).enumerate() {
        cx[q] = c[0];
        cy[q] = c[1];
    }
    for q in 0..k {
        let (dx, dy) = (x - cx[q], y - cy[q]);
        dist[q] = dx * dx + dy * dy;
    }
    let mut best = (0, dist[0]);
    for (q, &e) in dist[..k].iter().enumerate().skip(1) {
        if e < best.1 {
            best = (q, e);
        }
    }
    best
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
}
