//! GPTQ with the formats' LUT rounders (the ANEMLL Forge quantization guide, §4): columns in descending
//! `diag(H)` order, damping 1 % of the mean diagonal, blocks of 128, an FP64 Cholesky factor of
//! `H⁻¹`, and error feedback inside and after each block. Vector groups (two output rows at one
//! input column) are rounded jointly, so the column-wise feedback is the scalar one.
//!
//! Runs on row-normalized weights `W/s`: a per-row scale multiplies each row's error by a
//! constant, which changes neither the update nor the rounding decision of that row.

use crate::cholesky::{cholesky_lower, lower_inverse};
use crate::quantize_matrix::Rounder;
use anyhow::{Context, Result};
use forge_core::huge::HugeBuf;
use forge_kernels::matmul::{gemm_strided, Op};
use forge_kernels::rotation::Rotation;
use rayon::prelude::*;

pub const BLOCK: usize = 128;
pub const DAMP: f64 = 0.01;
/// Rows of `W` per task in the sweep's block updates.
const SWEEP_ROWS: usize = 256;
/// Rows of `W` swept together inside a block, side by side in the lanes of one vector (a
/// multiple of the vector dimension).
const ROW_TILE: usize = 8;

/// Accumulates `H = XᵀX / N` over the rows seen, in f32, then becomes that matrix in place
/// ([`Hessian::finish`]): at a 27B model's 17,408 MLP inputs one such matrix is 1.2 GB, so it
/// is never copied on the way to GPTQ.
#[derive(Clone, Debug)]
pub struct Hessian {
    pub dim: usize,
    /// While accumulating: the lower triangle of `XᵀX` (`H` is symmetric). Finished: `H`.
    h: Vec<f32>,
    pub rows: usize,
    finished: bool,
}

/// Rows of `H` per task when accumulating.
const HESSIAN_ROWS: usize = 256;

impl Hessian {
    pub fn new(dim: usize) -> Self {
        Hessian { dim, h: vec![0.0; dim * dim], rows: 0, finished: false }
    }

    /// Add the `t` rows of `x` (`t × dim`).
    pub fn add(&mut self, x: &[f32], t: usize) {
        let n = self.dim;
        assert!(!self.finished, "Hessian::add after finish");
        assert!(x.len() >= t * n, "Hessian::add: {} values for {t} rows of {n}", x.len());
        // Each task: its rows of H up to the diagonal, accumulating X[:, r0..r1]ᵀ · X[:, ..r1].
        self.h.par_chunks_mut(HESSIAN_ROWS * n).enumerate().for_each(|(blk, rows)| {
            let (r0, m) = (blk * HESSIAN_ROWS, rows.len() / n);
            gemm_strided(rows, n, Op::t(&x[r0..], n), Op::n(x, n), m, r0 + m, t, 1.0, 1.0);
        });
        self.rows += t;
    }

    /// Turn the sums into `XᵀX / N`, symmetric (idempotent).
    pub fn finish(&mut self) {
        if self.finished {
            return;
        }
        let n = self.dim;
        let inv = 1.0 / self.rows.max(1) as f32;
        self.h.par_chunks_mut(n).for_each(|row| row.iter_mut().for_each(|v| *v *= inv));
        // The upper triangle from the lower: the products above the diagonal of each row block
        // (inside its GEMM) are overwritten too, so H is exactly symmetric.
        by_tiles(n, |i, j| self.h[i * n + j] = self.h[j * n + i]);
        self.finished = true;
    }

    /// The finished `H` (`dim × dim`, row-major).
    pub fn matrix(&self) -> &[f32] {
        assert!(self.finished, "Hessian::matrix before finish");
        &self.h
    }

    /// Take the finished `H` into a rotation's basis, `MᵀHM`, in place.
    pub fn rotate(&mut self, r: &Rotation) {
        self.finish();
        let n = self.dim;
        r.rotate_weight(&mut self.h, n); // H M
        transpose_square(&mut self.h, n);
        r.rotate_weight(&mut self.h, n); // Mᵀ (H M), as H is symmetric
    }

    /// A copy of the finished `H` in a rotation's basis.
    pub fn rotated(&self, r: &Rotation) -> Vec<f32> {
        let mut c = Hessian { dim: self.dim, h: self.matrix().to_vec(), rows: self.rows, finished: true };
        c.rotate(r);
        c.h
    }
}

fn transpose_square(a: &mut [f32], n: usize) {
    by_tiles(n, |i, j| a.swap(i * n + j, j * n + i));
}

/// `f(i, j)` for every `i < j < n`, in 32 × 32 tiles so that the column side stays in cache.
fn by_tiles(n: usize, mut f: impl FnMut(usize, usize)) {
    const TILE: usize = 32;
    for i0 in (0..n).step_by(TILE) {
        for j0 in (i0..n).step_by(TILE) {
            for i in i0..(i0 + TILE).min(n) {
                for j in j0.max(i + 1)..(j0 + TILE).min(n) {
                    f(i, j);
                }
            }
        }
    }
}

/// `M⁻¹` for the lower Cholesky factor `M` of `JHJ` (`J` the reversal permutation), with `H`
/// symmetric positive definite and given by `entry(i, j)` (only `j ≤ i` is asked for).
///
/// `JHJ = MMᵀ` gives `H = RRᵀ` for the upper-triangular `R = JMJ`, so `H⁻¹ = (R⁻¹)ᵀR⁻¹`: the
/// upper factor `U` with `UᵀU = H⁻¹` is `R⁻¹ = J M⁻¹ J`, that is `U[i][j] = M⁻¹[n−1−i][n−1−j]`.
fn reversed_inverse_factor(n: usize, entry: impl Fn(usize, usize) -> f64 + Sync) -> Result<HugeBuf<f64>> {
    let mut k = HugeBuf::zeroed(n * n).with_context(|| format!("GPTQ: memory for the {n} × {n} factor"))?;
    // `k[i][j] = entry(n−1−j, n−1−i)`: a row of `k` walks down a column of the caller's matrix,
    // a cache miss per entry. So `k` is filled by columns, eight at a time (one cache line of
    // each row of `k`), while the eight rows of the caller's matrix they read stay in cache;
    // tasks take row ranges of equal area under the diagonal.
    const LINE: usize = 8;
    let parts = 4 * rayon::current_num_threads();
    let mut ranges = Vec::with_capacity(parts);
    let (mut rest, mut i0): (&mut [f64], usize) = (&mut k, 0);
    for p in 1..=parts {
        let i1 = ((n as f64 * (p as f64 / parts as f64).sqrt()) as usize).clamp(i0, n);
        let i1 = if p == parts { n } else { i1 };
        let (rows, tail) = std::mem::take(&mut rest).split_at_mut((i1 - i0) * n);
        ranges.push((i0, rows));
        (rest, i0) = (tail, i1);
    }
    ranges.into_par_iter().for_each(|(i0, rows)| {
        let i1 = i0 + rows.len() / n;
        for j0 in (0..i1).step_by(LINE) {
            for i in i0.max(j0)..i1 {
                let row = &mut rows[(i - i0) * n..];
                for (j, v) in row.iter_mut().enumerate().take((j0 + LINE).min(i + 1)).skip(j0) {
                    *v = entry(n - 1 - j, n - 1 - i);
                }
            }
        }
    });
    cholesky_lower(&mut k, n)?;
    lower_inverse(&mut k, n);
    Ok(k)
}

/// `U = J M⁻¹ J` in f32 from [`reversed_inverse_factor`]'s `M⁻¹`, in that matrix's own buffer
/// (at 17,408 inputs a separate f32 copy would be another 1.2 GB): reversed in place, then
/// narrowed front to back, each f32 landing at or before the bytes of the f64 it comes from,
/// which have been read by then. The f32 matrix is the first half of the buffer's bytes.
fn narrow_upper_factor(k: &mut [f64], n: usize) {
    k.reverse();
    let bytes: &mut [u8] = bytemuck::cast_slice_mut(k);
    for x in 0..n * n {
        let v = f64::from_ne_bytes(bytes[8 * x..8 * x + 8].try_into().unwrap()) as f32;
        bytes[4 * x..4 * x + 4].copy_from_slice(&v.to_ne_bytes());
    }
}

/// What GPTQ needs of a Hessian, computed once for every matrix that reads the same input in the
/// same basis: the act order (most active input columns first), the dead inputs, and the upper
/// factor `U` (`UᵀU = H⁻¹`) of the damped Hessian in that order.
pub struct Factor {
    n: usize,
    perm: Vec<usize>,
    dead: Vec<bool>,
    /// `U` in f32, in the first half of these bytes ([`narrow_upper_factor`]).
    buf: HugeBuf<f64>,
}

impl Factor {
    pub fn new(hess: &[f32], n: usize) -> Result<Factor> {
        assert_eq!(hess.len(), n * n);
        // Dead inputs carry no information: pin them so the factorization exists.
        let dead: Vec<bool> = (0..n).map(|i| hess[i * n + i] <= 0.0).collect();
        let diag = |i: usize| if dead[i] { 1.0 } else { hess[i * n + i] as f64 };
        let damp = DAMP * (0..n).map(diag).sum::<f64>() / n as f64;
        let mut perm: Vec<usize> = (0..n).collect();
        perm.sort_by(|&a, &b| diag(b).total_cmp(&diag(a)).then(a.cmp(&b)));
        // The damped, permuted Hessian is read straight into the factorization's one buffer.
        let mut buf = reversed_inverse_factor(n, |i, j| {
            let (pi, pj) = (perm[i], perm[j]);
            if pi == pj {
                diag(pi) + damp
            } else {
                hess[pi * n + pj] as f64
            }
        })?;
        narrow_upper_factor(&mut buf, n);
        Ok(Factor { n, perm, dead, buf })
    }

    /// `U`, `n × n` row-major, in act order.
    fn u(&self) -> &[f32] {
        let bytes: &[u8] = bytemuck::cast_slice(&self.buf);
        bytemuck::cast_slice(&bytes[..4 * self.n * self.n])
    }
}

/// Quantize normalized weights `wn` (`out × cin`, modified in place as GPTQ propagates error)
/// to codebook indices, minimizing `‖X(W − Q)ᵀ‖²` for `H = XᵀX/N`.
pub fn gptq(wn: &mut [f32], out: usize, cin: usize, hess: &[f32], codebook: &[f32], d: usize) -> Result<Vec<u8>> {
    gptq_factored(wn, out, &Factor::new(hess, cin)?, codebook, d)
}

/// [`gptq`] with the Hessian's [`Factor`] already made.
pub fn gptq_factored(wn: &mut [f32], out: usize, f: &Factor, codebook: &[f32], d: usize) -> Result<Vec<u8>> {
    let (n, cin, perm, u) = (f.n, f.n, &f.perm, f.u());
    anyhow::ensure!(wn.len() == out * cin, "GPTQ: {} weights for {out} × {cin}", wn.len());
    anyhow::ensure!(d == 1 || d == 2, "GPTQ: vector dimension {d} (1 or 2 expected)");
    let mut w = HugeBuf::<f32>::zeroed(out * n).with_context(|| format!("GPTQ: memory for {out} × {n} weights"))?;
    let dead: Vec<usize> = f.dead.iter().enumerate().filter(|d| *d.1).map(|d| d.0).collect();
    wn.par_chunks_mut(cin).zip(w.par_chunks_mut(n)).for_each(|(src, dst)| {
        for &i in &dead {
            src[i] = 0.0;
        }
        for (v, &p) in dst.iter_mut().zip(perm) {
            *v = src[p];
        }
    });
    let rounder = Rounder::new(codebook, d);
    let mut idx_p = vec![0u8; out / d * n];
    let mut err_buf = vec![0f32; out * BLOCK.min(n)];
    let mut i1 = 0;
    while i1 < n {
        let i2 = (i1 + BLOCK).min(n);
        let b = i2 - i1;
        let err = &mut err_buf[..out * b];
        // Rows are independent given the column order; groups of d rows share a rounding.
        w.par_chunks_mut(ROW_TILE * n)
            .zip(err.par_chunks_mut(ROW_TILE * b))
            .zip(idx_p.par_chunks_mut(ROW_TILE / d * n))
            .for_each(|((wt, et), it)| {
                let block = Block { n, i1, b, u, rounder: &rounder, codebook };
                if d == 1 {
                    block.sweep_tile::<1>(wt, et, it)
                } else {
                    block.sweep_tile::<2>(wt, et, it)
                }
            });
        // Propagate the block's error to the later columns: W[:, i2:] −= E · U[i1:i2, i2:],
        // one block of rows per task.
        let rest = n - i2;
        if rest > 0 {
            let ub = Op::n(&u[i1 * n + i2..], n);
            w.par_chunks_mut(SWEEP_ROWS * n).zip(err.par_chunks(SWEEP_ROWS * b)).for_each(|(wr, er)| {
                gemm_strided(&mut wr[i2..], n, Op::n(er, b), ub, er.len() / b, rest, b, 1.0, -1.0);
            });
        }
        i1 = i2;
    }
    let groups = out / d;
    let mut idx = vec![0u8; groups * cin];
    idx.par_chunks_mut(cin).zip(idx_p.par_chunks(n)).for_each(|(dst, src)| {
        for (&q, &p) in src.iter().zip(perm) {
            dst[p] = q;
        }
    });
    Ok(idx)
}

/// One block of columns, `i1..i1 + b` of `n`, as the sweep inside it sees them.
struct Block<'a> {
    n: usize,
    i1: usize,
    b: usize,
    u: &'a [f32],
    rounder: &'a Rounder<'a>,
    codebook: &'a [f32],
}

impl Block<'_> {
    /// Up to [`ROW_TILE`] rows of `W` (`w`, rows `n` apart) through the block: each column rounded,
    /// its error (into `err`, rows `b` apart) fed to the block's later columns. The rows are
    /// copied into lanes side by side, so the rounding and the feedback run on all of them at
    /// once; every value is computed as one row alone would compute it.
    fn sweep_tile<const D: usize>(&self, w: &mut [f32], err: &mut [f32], idx: &mut [u8]) {
        let Block { n, i1, b, u, rounder, codebook } = *self;
        let rows = w.len() / n;
        let mut tile = [[0f32; ROW_TILE]; BLOCK];
        for (k, col) in tile[..b].iter_mut().enumerate() {
            for (r, v) in col[..rows].iter_mut().enumerate() {
                *v = w[r * n + i1 + k];
            }
        }
        for k in 0..b {
            let i = i1 + k;
            let x = tile[k];
            let q = if D == 1 {
                rounder.round8(&x)
            } else {
                let mut q = [0usize; ROW_TILE];
                for g in 0..rows / D {
                    let qg = rounder.round(&x[g * D..(g + 1) * D]);
                    q[g * D..(g + 1) * D].fill(qg);
                }
                q
            };
            let diag = u[i * n + i];
            let mut neg = [0f32; ROW_TILE];
            for r in 0..rows {
                let e = (x[r] - codebook[q[r] * D + r % D]) / diag;
                err[r * b + k] = e;
                neg[r] = -e;
            }
            for g in 0..rows / D {
                idx[g * n + i] = q[g * D] as u8;
            }
            forge_kernels::simd::axpy_lanes8(&neg, &u[i * n + i + 1..i * n + i1 + b], &mut tile[k + 1..b]);
        }
        for (k, col) in tile[..b].iter().enumerate() {
            for (r, &v) in col[..rows].iter().enumerate() {
                w[r * n + i1 + k] = v;
            }
        }
    }
}

/// `tr((W − Q) H (W − Q)ᵀ)`: the calibration loss `‖X(W − Q)ᵀ‖²/N`.
pub fn calib_loss(w: &[f32], q: &[f32], out: usize, cin: usize, h: &[f32]) -> f64 {
    let e: Vec<f32> = w.iter().zip(q).map(|(a, b)| a - b).collect();
    // (E H) row by row against E; H is symmetric so H itself serves as the transposed operand.
    let mut eh = vec![0f32; out * cin];
    forge_kernels::matmul::gemm_f32_par(&e, out, h, cin, cin, &mut eh);
    eh.par_chunks(cin)
        .zip(e.par_chunks(cin))
        .map(|(a, b)| a.iter().zip(b).map(|(x, y)| *x as f64 * *y as f64).sum::<f64>())
        .sum()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quantize_matrix::{assign_rtn, fit_codebook, normalize, row_scales};
    use forge_kernels::lut::{Format, LutMatrix};
    use forge_model::sampling::Rng;

    fn gaussian(n: usize, r: &mut Rng) -> Vec<f32> {
        crate::fit::normal_samples(r, n)
    }

    #[test]
    fn hessian_is_the_mean_outer_product_over_every_batch() {
        let mut r = Rng::new(9);
        // Wider than one block of rows of H, over two batches of different lengths.
        let n = HESSIAN_ROWS + 44;
        let batches = [gaussian(7 * n, &mut r), gaussian(11 * n, &mut r)];
        let mut hs = Hessian::new(n);
        let mut want = vec![0f64; n * n];
        for x in &batches {
            hs.add(x, x.len() / n);
            for row in x.chunks(n) {
                for i in 0..n {
                    for j in 0..n {
                        want[i * n + j] += row[i] as f64 * row[j] as f64 / 18.0;
                    }
                }
            }
        }
        hs.finish();
        let h = hs.matrix().to_vec();
        for i in 0..n {
            for j in 0..n {
                let (g, w) = (h[i * n + j], want[i * n + j]);
                assert!((g as f64 - w).abs() < 2e-6 * (1.0 + w.abs()), "({i},{j}): {g} vs {w}");
                assert_eq!(g, h[j * n + i]);
            }
        }
    }

    /// Upper-triangular `U` with `UᵀU = H⁻¹`.
    fn inverse_cholesky_upper(h: &[f32], n: usize) -> Result<Vec<f64>> {
        let k = reversed_inverse_factor(n, |i, j| h[i * n + j] as f64)?;
        Ok((0..n * n).map(|x| k[n * n - 1 - x]).collect())
    }

    #[test]
    fn inverse_cholesky_factor_is_exact() {
        let mut r = Rng::new(1);
        let n = 37;
        let x = gaussian(3 * n * n, &mut r);
        let mut hs = Hessian::new(n);
        hs.add(&x, 3 * n);
        hs.finish();
        let h = hs.matrix().to_vec();
        let u = inverse_cholesky_upper(&h, n).unwrap();
        // UᵀU H = I
        for i in 0..n {
            for j in 0..n {
                let mut s = 0.0;
                for k in 0..n {
                    let mut utu = 0.0;
                    for m in 0..n {
                        utu += u[m * n + i] * u[m * n + k];
                    }
                    s += utu * h[k * n + j] as f64;
                }
                assert!((s - if i == j { 1.0 } else { 0.0 }).abs() < 1e-8, "({i},{j}): {s}");
                if j < i {
                    assert_eq!(u[i * n + j], 0.0);
                }
            }
        }
        // The in-place f32 narrowing gives the same factor.
        let mut k = reversed_inverse_factor(n, |i, j| h[i * n + j] as f64).unwrap();
        narrow_upper_factor(&mut k, n);
        let bytes: &[u8] = bytemuck::cast_slice(&k);
        let narrow: Vec<f32> = u.iter().map(|&v| v as f32).collect();
        assert_eq!(bytemuck::cast_slice::<u8, f32>(&bytes[..4 * n * n]), &narrow[..]);
    }

    fn setup(format: Format, out: usize, cin: usize, seed: u64) -> (Vec<f32>, Vec<f32>, Vec<f32>, Vec<f32>) {
        let mut r = Rng::new(seed);
        let w = gaussian(out * cin, &mut r);
        // Correlated activations with uneven energy per column, like real ones.
        let t = 4 * cin;
        let base = gaussian(t * cin, &mut r);
        let mix = gaussian(cin * cin, &mut r);
        let mut x = vec![0f32; t * cin];
        for row in 0..t {
            for j in 0..cin {
                let mut v = base[row * cin + j] * (1.0 + 3.0 * (j % 7) as f32);
                for k in 0..4 {
                    v += 0.5 * base[row * cin + (j + k) % cin] * mix[j * cin + k];
                }
                x[row * cin + j] = v;
            }
        }
        let mut hs = Hessian::new(cin);
        hs.add(&x, t);
        hs.finish();
        let h = hs.matrix().to_vec();
        let scale = row_scales(&w, out, cin);
        let wn = normalize(&w, cin, &scale);
        let cb = fit_codebook(&wn, out, cin, format, None, 3);
        (w, scale, cb, h)
    }

    fn recon(format: Format, out: usize, cin: usize, cb: &[f32], idx: Vec<u8>, scale: &[f32]) -> Vec<f32> {
        LutMatrix { format, cout: out, cin, codebook: cb.to_vec(), idx: idx.into(), scale: scale.to_vec() }
            .reconstruct()
    }

    #[test]
    fn gptq_never_loses_to_rtn_with_the_same_codebook() {
        for (k, format) in
            [Format::Lut4, Format::Lut2, Format::Vec2x16, Format::Vec2x64, Format::Lut3].into_iter().enumerate()
        {
            for seed in 0..3u64 {
                let (out, cin) = (64, 96 + 40 * seed as usize);
                let (w, scale, cb, h) = setup(format, out, cin, 100 * k as u64 + seed);
                let d = format.vec_dim();
                let wn = normalize(&w, cin, &scale);
                let rtn = recon(format, out, cin, &cb, assign_rtn(&wn, out, cin, &cb, d), &scale);
                let mut wg = wn.clone();
                let idx = gptq(&mut wg, out, cin, &h, &cb, d).unwrap();
                let gq = recon(format, out, cin, &cb, idx, &scale);
                let (lr, lg) = (calib_loss(&w, &rtn, out, cin, &h), calib_loss(&w, &gq, out, cin, &h));
                assert!(lg <= lr, "{format:?} seed {seed}: GPTQ {lg} > RTN {lr}");
            }
        }
    }

    /// The sweep one row (or vector group) at a time, with `gptq_factored`'s blocks and block
    /// updates: the row tiles must give its bits.
    fn sweep_by_rows(wn: &[f32], out: usize, f: &Factor, cb: &[f32], d: usize) -> Vec<u8> {
        let (n, u) = (f.n, f.u());
        let rounder = Rounder::new(cb, d);
        let mut w = vec![0f32; out * n];
        for r in 0..out {
            for j in 0..n {
                let p = f.perm[j];
                w[r * n + j] = if f.dead[p] { 0.0 } else { wn[r * n + p] };
            }
        }
        let mut idx_p = vec![0u8; out / d * n];
        for i1 in (0..n).step_by(BLOCK) {
            let i2 = (i1 + BLOCK).min(n);
            let b = i2 - i1;
            let mut err = vec![0f32; out * b];
            for g in 0..out / d {
                for i in i1..i2 {
                    let p: Vec<f32> = (0..d).map(|t| w[(g * d + t) * n + i]).collect();
                    let q = rounder.round(&p);
                    idx_p[g * n + i] = q as u8;
                    for (t, &pt) in p.iter().enumerate() {
                        let (e, r) = ((pt - cb[q * d + t]) / u[i * n + i], g * d + t);
                        err[r * b + i - i1] = e;
                        forge_kernels::simd::axpy(-e, &u[i * n + i + 1..i * n + i2], &mut w[r * n + i + 1..r * n + i2]);
                    }
                }
            }
            for r0 in (0..out).step_by(SWEEP_ROWS).filter(|_| i2 < n) {
                let (m, ub) = (SWEEP_ROWS.min(out - r0), Op::n(&u[i1 * n + i2..], n));
                gemm_strided(&mut w[r0 * n + i2..], n, Op::n(&err[r0 * b..], b), ub, m, n - i2, b, 1.0, -1.0);
            }
        }
        let mut idx = vec![0u8; out / d * n];
        for g in 0..out / d {
            for j in 0..n {
                idx[g * n + f.perm[j]] = idx_p[g * n + j];
            }
        }
        idx
    }

    #[test]
    fn row_tiles_sweep_as_single_rows_do() {
        // Row counts that leave a partial tile, widths of one and three blocks, a dead input.
        for (format, out, cin) in [(Format::Lut4, 37, 96), (Format::Lut3, 300, 300), (Format::Vec2x64, 38, 290)] {
            let (w, scale, cb, mut h) = setup(format, out, cin, 11);
            for j in 0..cin {
                h[j * cin + 5] = 0.0;
                h[5 * cin + j] = 0.0;
            }
            let d = format.vec_dim();
            let f = Factor::new(&h, cin).unwrap();
            let wn = normalize(&w, cin, &scale);
            let want = sweep_by_rows(&wn, out, &f, &cb, d);
            let got = gptq_factored(&mut wn.clone(), out, &f, &cb, d).unwrap();
            assert_eq!(got, want, "{format:?} {out} × {cin}");
        }
    }

    #[test]
    fn gptq_with_identity_hessian_is_rtn() {
        for format in [Format::Lut4, Format::Vec2x16] {
            let (out, cin) = (32, 64);
            let (w, scale, cb, _) = setup(format, out, cin, 5);
            let mut eye = vec![0f32; cin * cin];
            for i in 0..cin {
                eye[i * cin + i] = 1.0;
            }
            let wn = normalize(&w, cin, &scale);
            let rtn = assign_rtn(&wn, out, cin, &cb, format.vec_dim());
            let mut wg = wn.clone();
            assert_eq!(gptq(&mut wg, out, cin, &eye, &cb, format.vec_dim()).unwrap(), rtn);
        }
    }
}
