//! Blocked Cholesky factorization and triangular inversion in f64, for GPTQ's `H⁻¹` factor.
//!
//! At the widths of a 27B model's MLP (17,408 inputs) the factor and the inverse are
//! `n³/3` multiply-adds each: one-column-at-a-time loops run them at a few GFLOP/s, minutes per
//! matrix. Both are done here by blocks of [`NB`] columns so that nearly all of the work is
//! `gemm` updates of the rows below a block, one row block per task; only the `NB × NB`
//! diagonal blocks and the panel solves stay scalar.

use anyhow::{bail, Result};
use forge_kernels::matmul::{gemm_strided, Op};
use rayon::prelude::*;

/// Columns per block.
pub const NB: usize = 128;

/// Unblocked lower Cholesky factor of the `b × b` matrix `a`, in place (lower part; the upper
/// part is left as it was). Returns the column whose pivot is not positive, if any.
fn factor_block(a: &mut [f64], b: usize) -> std::result::Result<(), (usize, f64)> {
    for j in 0..b {
        let mut d = a[j * b + j];
        for k in 0..j {
            d -= a[j * b + k] * a[j * b + k];
        }
        if d <= 0.0 || !d.is_finite() {
            return Err((j, d));
        }
        let d = d.sqrt();
        a[j * b + j] = d;
        for i in j + 1..b {
            let mut s = a[i * b + j];
            for k in 0..j {
                s -= a[i * b + k] * a[j * b + k];
            }
            a[i * b + j] = s / d;
        }
    }
    Ok(())
}

/// Inverse of the `b × b` lower-triangular `l` into `x` (lower; upper part zero).
fn invert_block(l: &[f64], b: usize, x: &mut [f64]) {
    x.fill(0.0);
    for j in 0..b {
        x[j * b + j] = 1.0 / l[j * b + j];
        for i in j + 1..b {
            let mut s = 0.0;
            for k in j..i {
                s += l[i * b + k] * x[k * b + j];
            }
            x[i * b + j] = -s / l[i * b + i];
        }
    }
}

/// Copy of columns `c0..c0 + b` of rows `r0..` of the row-major `n × n` matrix `a`.
fn columns(a: &[f64], n: usize, r0: usize, c0: usize, b: usize) -> Vec<f64> {
    let mut p = Vec::with_capacity((n - r0) * b);
    for row in a[r0 * n..].chunks(n) {
        p.extend_from_slice(&row[c0..c0 + b]);
    }
    p
}

/// In-place lower Cholesky factor `L` (`LLᵀ = A`) of a symmetric positive definite row-major
/// `n × n` matrix; the strict upper part is set to zero. Only the lower part of `a` is read.
pub fn cholesky_lower(a: &mut [f64], n: usize) -> Result<()> {
    assert_eq!(a.len(), n * n);
    let (mut diag, mut dinv) = (vec![0f64; NB * NB], vec![0f64; NB * NB]);
    for k0 in (0..n).step_by(NB) {
        let k1 = (k0 + NB).min(n);
        let b = k1 - k0;
        let d = &mut diag[..b * b];
        for i in 0..b {
            d[i * b..(i + 1) * b].copy_from_slice(&a[(k0 + i) * n + k0..(k0 + i) * n + k1]);
        }
        if let Err((j, p)) = factor_block(d, b) {
            bail!("Hessian is not positive definite at column {} (pivot {p})", k0 + j);
        }
        for i in 0..b {
            a[(k0 + i) * n + k0..(k0 + i) * n + k0 + i + 1].copy_from_slice(&d[i * b..i * b + i + 1]);
        }
        if k1 == n {
            break;
        }
        // Panel: the rows below solve P Lᵀ = A[k1.., k0..k1], as P = A[k1.., k0..k1] · (L⁻¹)ᵀ.
        invert_block(&diag[..b * b], b, &mut dinv[..b * b]);
        let raw = columns(a, n, k1, k0, b);
        let mut p = vec![0f64; raw.len()];
        let dinv = &dinv[..b * b];
        p.par_chunks_mut(NB * b).zip(raw.par_chunks(NB * b)).for_each(|(ps, rs)| {
            gemm_strided(ps, b, Op::n(rs, b), Op::t(dinv, b), rs.len() / b, b, b, 0.0, 1.0);
        });
        drop(raw);
        // Trailing update of the lower part: A[k1.., k1..] −= P Pᵀ, one row block per task,
        // each up to its own diagonal.
        a[k1 * n..].par_chunks_mut(NB * n).enumerate().for_each(|(blk, rows)| {
            let (r0, m) = (blk * NB, rows.len() / n);
            let r1 = r0 + m;
            for (i, row) in rows.chunks_mut(n).enumerate() {
                row[k0..k1].copy_from_slice(&p[(r0 + i) * b..(r0 + i + 1) * b]);
            }
            gemm_strided(&mut rows[k1..], n, Op::n(&p[r0 * b..], b), Op::t(&p, b), m, r1, b, 1.0, -1.0);
        });
    }
    for i in 0..n {
        a[i * n + i + 1..(i + 1) * n].fill(0.0);
    }
    Ok(())
}

/// In-place inverse of a lower-triangular row-major `n × n` matrix (its strict upper part must
/// be zero, and stays so).
///
/// Block columns go from last to first: with the blocks below and right of block `j` already
/// inverted, `X[j+1.., j] = −X[j+1.., j+1..] · L[j+1.., j] · L[j, j]⁻¹`.
pub fn lower_inverse(a: &mut [f64], n: usize) {
    assert_eq!(a.len(), n * n);
    let mut l = vec![0f64; NB * NB];
    let mut x = vec![0f64; NB * NB];
    for j0 in (0..n).step_by(NB).rev() {
        let j1 = (j0 + NB).min(n);
        let b = j1 - j0;
        let (l, x) = (&mut l[..b * b], &mut x[..b * b]);
        for i in 0..b {
            l[i * b..(i + 1) * b].copy_from_slice(&a[(j0 + i) * n + j0..(j0 + i) * n + j1]);
        }
        invert_block(l, b, x);
        if j1 < n {
            let p = columns(a, n, j1, j0, b);
            let x = &*x;
            a[j1 * n..].par_chunks_mut(NB * n).enumerate().for_each(|(blk, rows)| {
                let (r0, m) = (blk * NB, rows.len() / n);
                let r1 = r0 + m;
                let mut t = vec![0f64; m * b];
                gemm_strided(&mut t, b, Op::n(&rows[j1..], n), Op::n(&p, b), m, b, r1, 0.0, 1.0);
                gemm_strided(&mut rows[j0..], n, Op::n(&t, b), Op::n(x, b), m, b, b, 0.0, -1.0);
            });
        }
        for i in 0..b {
            a[(j0 + i) * n + j0..(j0 + i) * n + j1].copy_from_slice(&x[i * b..(i + 1) * b]);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use forge_model::sampling::Rng;

    /// `XᵀX/t + 0.1·I` for `t` Gaussian rows: symmetric positive definite, unevenly scaled.
    fn spd(n: usize, seed: u64) -> Vec<f64> {
        let mut r = Rng::new(seed);
        let t = n + 16;
        let x = crate::fit::normal_samples(&mut r, t * n);
        let mut a = vec![0f64; n * n];
        for row in x.chunks(n) {
            for i in 0..n {
                let xi = row[i] as f64 * (1.0 + (i % 5) as f64);
                for j in 0..n {
                    a[i * n + j] += xi * row[j] as f64 * (1.0 + (j % 5) as f64) / t as f64;
                }
            }
        }
        for i in 0..n {
            a[i * n + i] += 0.1;
        }
        a
    }

    #[test]
    fn blocked_factor_reproduces_the_matrix_across_block_edges() {
        // Sizes below one block, at one, and with a ragged last block.
        for n in [5, NB, 2 * NB + 37] {
            let a = spd(n, n as u64);
            let mut l = a.clone();
            cholesky_lower(&mut l, n).unwrap();
            let scale = a.iter().fold(0f64, |m, v| m.max(v.abs()));
            for i in 0..n {
                for j in 0..n {
                    if j > i {
                        assert_eq!(l[i * n + j], 0.0);
                        continue;
                    }
                    let s: f64 = (0..=j).map(|k| l[i * n + k] * l[j * n + k]).sum();
                    assert!((s - a[i * n + j]).abs() < 1e-12 * scale, "n {n} ({i},{j}): {s} vs {}", a[i * n + j]);
                }
            }
        }
    }

    #[test]
    fn blocked_inverse_times_the_matrix_is_the_identity() {
        for n in [7, NB, 2 * NB + 37] {
            let mut l = spd(n, 10 + n as u64);
            cholesky_lower(&mut l, n).unwrap();
            let mut x = l.clone();
            lower_inverse(&mut x, n);
            for i in 0..n {
                for j in 0..n {
                    if j > i {
                        assert_eq!(x[i * n + j], 0.0);
                        continue;
                    }
                    let s: f64 = (j..=i).map(|k| x[i * n + k] * l[k * n + j]).sum();
                    let want = if i == j { 1.0 } else { 0.0 };
                    assert!((s - want).abs() < 1e-10, "n {n} ({i},{j}): {s}");
                }
            }
        }
    }

    #[test]
    fn a_matrix_that_is_not_positive_definite_names_its_column() {
        let n = NB + 10;
        let mut a = spd(n, 3);
        // Row and column NB+4 become a copy of column 2 minus a bit: the pivot there is negative.
        let c = NB + 4;
        for i in 0..n {
            a[c * n + i] = a[2 * n + i];
            a[i * n + c] = a[i * n + 2];
        }
        a[c * n + c] = a[2 * n + 2] - 0.05;
        let e = cholesky_lower(&mut a, n).unwrap_err().to_string();
        assert!(e.contains(&format!("column {c}")), "{e}");
    }
}
