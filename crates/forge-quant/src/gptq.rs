//! GPTQ with the formats' LUT rounders (the ANEMLL Forge quantization guide, §4): columns in descending
//! `diag(H)` order, damping 1 % of the mean diagonal, blocks of 128, an FP64 Cholesky factor of
//! `H⁻¹`, and error feedback inside and after each block. Vector groups (two output rows at one
//! input column) are rounded jointly, so the column-wise feedback is the scalar one.
//!
//! Runs on row-normalized weights `W/s`: a per-row scale multiplies each row's error by a
//! constant, which changes neither the update nor the rounding decision of that row.

use crate::quantize_matrix::Rounder;
use anyhow::{bail, Result};
use forge_kernels::matmul::gemm_f32;
use rayon::prelude::*;

pub const BLOCK: usize = 128;
pub const DAMP: f64 = 0.01;

/// Accumulates `H = XᵀX / N` over the rows seen (f64).
#[derive(Clone, Debug)]
pub struct Hessian {
    pub dim: usize,
    pub h: Vec<f64>,
    pub rows: usize,
}

impl Hessian {
    pub fn new(dim: usize) -> Self {
        Hessian { dim, h: vec![0.0; dim * dim], rows: 0 }
    }

    pub fn add(&mut self, x: &[f32], t: usize) {
        let n = self.dim;
        // XᵀX for this batch in f32 (one GEMM), accumulated across batches in f64.
        let mut xt = vec![0f32; n * t];
        for r in 0..t {
            for i in 0..n {
                xt[i * t + r] = x[r * n + i];
            }
        }
        let mut g = vec![0f32; n * n];
        forge_kernels::matmul::gemm_f32_par(&xt, n, &xt, n, t, &mut g);
        self.h.par_iter_mut().zip(g.par_iter()).for_each(|(h, &v)| *h += v as f64);
        self.rows += t;
    }

    /// `XᵀX / N`, symmetric.
    pub fn finish(&self) -> Vec<f64> {
        let n = self.dim;
        let inv = 1.0 / self.rows.max(1) as f64;
        let mut h = vec![0f64; n * n];
        // Symmetrize (the f32 GEMM may differ in the last bit between (i, j) and (j, i)).
        for i in 0..n {
            for j in i..n {
                let v = 0.5 * (self.h[i * n + j] + self.h[j * n + i]) * inv;
                h[i * n + j] = v;
                h[j * n + i] = v;
            }
        }
        h
    }
}

/// In-place lower Cholesky factor of a symmetric positive definite matrix.
///
/// The dot products run four rows at a time, each row's in its own order (`k` ascending, as a
/// one-row loop would), so the rows keep each other's latency hidden without any change to the
/// arithmetic.
fn cholesky_lower(a: &mut [f64], n: usize) -> Result<()> {
    for j in 0..n {
        let mut d = a[j * n + j];
        for k in 0..j {
            d -= a[j * n + k] * a[j * n + k];
        }
        if d <= 0.0 || !d.is_finite() {
            bail!("Hessian is not positive definite at column {j} (pivot {d})");
        }
        let d = d.sqrt();
        a[j * n + j] = d;
        let (head, tail) = a.split_at_mut((j + 1) * n);
        let rowj = &head[j * n..j * n + j];
        tail.par_chunks_mut(4 * n).for_each(|rows| {
            if rows.len() == 4 * n {
                let (r0, rest) = rows.split_at_mut(n);
                let (r1, rest) = rest.split_at_mut(n);
                let (r2, r3) = rest.split_at_mut(n);
                let mut s = [r0[j], r1[j], r2[j], r3[j]];
                for (k, &b) in rowj.iter().enumerate() {
                    s[0] -= r0[k] * b;
                    s[1] -= r1[k] * b;
                    s[2] -= r2[k] * b;
                    s[3] -= r3[k] * b;
                }
                r0[j] = s[0] / d;
                r1[j] = s[1] / d;
                r2[j] = s[2] / d;
                r3[j] = s[3] / d;
            } else {
                for ri in rows.chunks_mut(n) {
                    let mut s = ri[j];
                    for k in 0..j {
                        s -= ri[k] * rowj[k];
                    }
                    ri[j] = s / d;
                }
            }
        });
    }
    for i in 0..n {
        for j in i + 1..n {
            a[i * n + j] = 0.0;
        }
    }
    Ok(())
}

/// Inverse of a lower-triangular matrix (lower-triangular).
///
/// Column `j` of `L⁻¹` solves `L x = e_j`; columns are independent and go four at a time, each
/// with its own sums in its own order (as a one-column loop would).
fn lower_inverse(l: &[f64], n: usize) -> Vec<f64> {
    let groups: Vec<Vec<Vec<f64>>> = (0..n.div_ceil(4))
        .into_par_iter()
        .map(|g| {
            let j0 = 4 * g;
            let m = (n - j0).min(4);
            let mut xs = vec![vec![0f64; n]; m];
            for (c, x) in xs.iter_mut().enumerate() {
                x[j0 + c] = 1.0 / l[(j0 + c) * n + j0 + c];
            }
            for i in j0 + 1..n {
                let li = &l[i * n..(i + 1) * n];
                let mut s = [0f64; 4];
                // The terms k < j0 + m − 1 that only some columns have, then the common ones.
                let common = (j0 + m - 1).min(i);
                for (c, x) in xs.iter().enumerate() {
                    for k in j0 + c..common {
                        s[c] += li[k] * x[k];
                    }
                }
                if m == 4 {
                    let (x0, x1, x2, x3) = (&xs[0], &xs[1], &xs[2], &xs[3]);
                    for k in common..i {
                        s[0] += li[k] * x0[k];
                        s[1] += li[k] * x1[k];
                        s[2] += li[k] * x2[k];
                        s[3] += li[k] * x3[k];
                    }
                } else {
                    for (c, x) in xs.iter().enumerate() {
                        for k in common.max(j0 + c)..i {
                            s[c] += li[k] * x[k];
                        }
                    }
                }
                for (c, x) in xs.iter_mut().enumerate() {
                    if i > j0 + c {
                        x[i] = -s[c] / li[i];
                    }
                }
            }
            xs
        })
        .collect();
    let mut inv = vec![0f64; n * n];
    for (g, xs) in groups.iter().enumerate() {
        for (c, x) in xs.iter().enumerate() {
            let j = 4 * g + c;
            for i in j..n {
                inv[i * n + j] = x[i];
            }
        }
    }
    inv
}

/// Upper-triangular `U` with `UᵀU = H⁻¹`.
///
/// With `J` the reversal permutation, `JHJ = MMᵀ` (lower Cholesky) gives `H = RRᵀ` for the
/// upper-triangular `R = JMJ`, so `H⁻¹ = (R⁻¹)ᵀR⁻¹` and `U = R⁻¹ = J M⁻¹ J`.
pub fn inverse_cholesky_upper(h: &[f64], n: usize) -> Result<Vec<f64>> {
    let mut k = vec![0f64; n * n];
    for i in 0..n {
        for j in 0..n {
            k[i * n + j] = h[(n - 1 - i) * n + (n - 1 - j)];
        }
    }
    cholesky_lower(&mut k, n)?;
    let minv = lower_inverse(&k, n);
    let mut u = vec![0f64; n * n];
    for i in 0..n {
        for j in 0..n {
            u[i * n + j] = minv[(n - 1 - i) * n + (n - 1 - j)];
        }
    }
    Ok(u)
}

/// Quantize normalized weights `wn` (`out × cin`, modified in place as GPTQ propagates error)
/// to codebook indices, minimizing `‖X(W − Q)ᵀ‖²` for `H = XᵀX/N`.
pub fn gptq(wn: &mut [f32], out: usize, cin: usize, hess: &[f64], codebook: &[f32], d: usize) -> Result<Vec<u8>> {
    let n = cin;
    let mut h = hess.to_vec();
    // Dead inputs carry no information: pin them so the factorization exists.
    for i in 0..n {
        if h[i * n + i] <= 0.0 {
            h[i * n + i] = 1.0;
            for r in 0..out {
                wn[r * cin + i] = 0.0;
            }
        }
    }
    let mean_diag = (0..n).map(|i| h[i * n + i]).sum::<f64>() / n as f64;
    for i in 0..n {
        h[i * n + i] += DAMP * mean_diag;
    }
    // Act order: most active input columns first.
    let mut perm: Vec<usize> = (0..n).collect();
    perm.sort_by(|&a, &b| h[b * n + b].total_cmp(&h[a * n + a]).then(a.cmp(&b)));
    let mut hp = vec![0f64; n * n];
    for i in 0..n {
        for j in 0..n {
            hp[i * n + j] = h[perm[i] * n + perm[j]];
        }
    }
    let u64s = inverse_cholesky_upper(&hp, n)?;
    let u: Vec<f32> = u64s.iter().map(|&v| v as f32).collect();
    let mut w = vec![0f32; out * n];
    for r in 0..out {
        for (j, &p) in perm.iter().enumerate() {
            w[r * n + j] = wn[r * cin + p];
        }
    }
    let groups = out / d;
    let rounder = Rounder::new(codebook, d);
    let mut idx_p = vec![0u8; groups * n];
    let mut i1 = 0;
    while i1 < n {
        let i2 = (i1 + BLOCK).min(n);
        let b = i2 - i1;
        let mut err = vec![0f32; out * b];
        // Rows are independent given the column order; groups of d rows share a rounding.
        w.par_chunks_mut(d * n).zip(err.par_chunks_mut(d * b)).zip(idx_p.par_chunks_mut(n)).for_each(
            |((wg, eg), ig)| {
                let mut p = [0f32; 2];
                for i in i1..i2 {
                    let diag = u[i * n + i];
                    for t in 0..d {
                        p[t] = wg[t * n + i];
                    }
                    let q = rounder.round(&p[..d]);
                    ig[i] = q as u8;
                    for t in 0..d {
                        let e = (p[t] - codebook[q * d + t]) / diag;
                        eg[t * b + (i - i1)] = e;
                        let urow = &u[i * n + i + 1..i * n + i2];
                        let wrow = &mut wg[t * n + i + 1..t * n + i2];
                        for (wv, &uv) in wrow.iter_mut().zip(urow) {
                            *wv -= e * uv;
                        }
                    }
                }
            },
        );
        // Propagate the block's error to the later columns: W[:, i2:] −= E · U[i1:i2, i2:].
        let rest = n - i2;
        if rest > 0 {
            let mut ut = vec![0f32; rest * b];
            for k in 0..b {
                for j in 0..rest {
                    ut[j * b + k] = u[(i1 + k) * n + i2 + j];
                }
            }
            let mut delta = vec![0f32; out * rest];
            gemm_f32(&err, out, &ut, rest, b, &mut delta);
            w.par_chunks_mut(n).zip(delta.par_chunks(rest)).for_each(|(wr, dr)| {
                for (wv, &dv) in wr[i2..].iter_mut().zip(dr) {
                    *wv -= dv;
                }
            });
        }
        i1 = i2;
    }
    let mut idx = vec![0u8; groups * cin];
    for g in 0..groups {
        for (j, &p) in perm.iter().enumerate() {
            idx[g * cin + p] = idx_p[g * n + j];
        }
    }
    Ok(idx)
}

/// `tr((W − Q) H (W − Q)ᵀ)`: the calibration loss `‖X(W − Q)ᵀ‖²/N`.
pub fn calib_loss(w: &[f32], q: &[f32], out: usize, cin: usize, h: &[f64]) -> f64 {
    let e: Vec<f32> = w.iter().zip(q).map(|(a, b)| a - b).collect();
    let hf: Vec<f32> = h.iter().map(|&v| v as f32).collect();
    // (E H) row by row against E; H is symmetric so H itself serves as the transposed operand.
    let mut eh = vec![0f32; out * cin];
    forge_kernels::matmul::gemm_f32_par(&e, out, &hf, cin, cin, &mut eh);
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
    fn inverse_cholesky_factor_is_exact() {
        let mut r = Rng::new(1);
        let n = 37;
        let x = gaussian(3 * n * n, &mut r);
        let mut hs = Hessian::new(n);
        hs.add(&x, 3 * n);
        let h = hs.finish();
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
                    s += utu * h[k * n + j];
                }
                assert!((s - if i == j { 1.0 } else { 0.0 }).abs() < 1e-8, "({i},{j}): {s}");
                if j < i {
                    assert_eq!(u[i * n + j], 0.0);
                }
            }
        }
    }

    fn setup(format: Format, out: usize, cin: usize, seed: u64) -> (Vec<f32>, Vec<f32>, Vec<f32>, Vec<f64>) {
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
        let h = hs.finish();
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

    #[test]
    fn gptq_with_identity_hessian_is_rtn() {
        for format in [Format::Lut4, Format::Vec2x16] {
            let (out, cin) = (32, 64);
            let (w, scale, cb, _) = setup(format, out, cin, 5);
            let mut eye = vec![0f64; cin * cin];
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
