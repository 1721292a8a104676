//! Low-rank residual correction: the leading rank-`r` part of a quantization error `E = W − Ŵ`,
//! by a seeded randomized SVD (range finder with oversampling and power iterations, then an
//! exact eigendecomposition of the small projected matrix). Factors `A = U·Σ (out × r)` and
//! `B = Vᵀ (r × in)` are rounded to FP16, as the export stores them.

use crate::fit::f16_round;
use forge_kernels::matmul::gemm_f32;
use forge_model::sampling::Rng;

pub const OVERSAMPLE: usize = 16;
pub const POWER_ITERS: usize = 4;

/// `a (m×k) · b (k×n)`.
fn mm(a: &[f32], m: usize, k: usize, b: &[f32], n: usize) -> Vec<f32> {
    let mut bt = vec![0f32; n * k];
    for i in 0..k {
        for j in 0..n {
            bt[j * k + i] = b[i * n + j];
        }
    }
    let mut y = vec![0f32; m * n];
    gemm_f32(a, m, &bt, n, k, &mut y);
    y
}

fn transpose(a: &[f32], m: usize, n: usize) -> Vec<f32> {
    let mut t = vec![0f32; m * n];
    for i in 0..m {
        for j in 0..n {
            t[j * m + i] = a[i * n + j];
        }
    }
    t
}

/// Orthonormalize the `k` columns of `y` (`m × k`, row-major) in place (modified Gram–Schmidt, f64).
fn orthonormalize(y: &mut [f32], m: usize, k: usize) {
    let mut cols: Vec<Vec<f64>> = (0..k).map(|j| (0..m).map(|i| y[i * k + j] as f64).collect()).collect();
    for j in 0..k {
        let norm0 = cols[j].iter().map(|a| a * a).sum::<f64>().sqrt();
        // Two passes ("twice is enough") keep the basis orthogonal to working precision.
        for _ in 0..2 {
            for p in 0..j {
                let d: f64 = cols[j].iter().zip(&cols[p]).map(|(a, b)| a * b).sum();
                let (lo, hi) = cols.split_at_mut(j);
                for (a, b) in hi[0].iter_mut().zip(&lo[p]) {
                    *a -= d * b;
                }
            }
        }
        let norm = cols[j].iter().map(|a| a * a).sum::<f64>().sqrt();
        // A column already in the span of the previous ones is rounding noise: drop it.
        let keep = norm > 1e-5 * norm0 && norm > 1e-30;
        cols[j].iter_mut().for_each(|a| *a = if keep { *a / norm } else { 0.0 });
    }
    for j in 0..k {
        for i in 0..m {
            y[i * k + j] = cols[j][i] as f32;
        }
    }
}

/// Eigen-decomposition of a symmetric `k × k` matrix by cyclic Jacobi: (values, vectors as
/// columns of a row-major matrix).
fn jacobi_eigen(a: &[f64], k: usize) -> (Vec<f64>, Vec<f64>) {
    let mut a = a.to_vec();
    let mut v = vec![0f64; k * k];
    for i in 0..k {
        v[i * k + i] = 1.0;
    }
    for _sweep in 0..100 {
        let off: f64 = (0..k)
            .flat_map(|i| (0..k).filter(move |&j| j != i).map(move |j| (i, j)))
            .map(|(i, j)| a[i * k + j].powi(2))
            .sum();
        let diag: f64 = (0..k).map(|i| a[i * k + i].powi(2)).sum();
        if off <= 1e-24 * diag.max(1e-300) {
            break;
        }
        for p in 0..k {
            for q in p + 1..k {
                let apq = a[p * k + q];
                if apq.abs() < 1e-300 {
                    continue;
                }
                let theta = (a[q * k + q] - a[p * k + p]) / (2.0 * apq);
                let t = theta.signum() / (theta.abs() + (theta * theta + 1.0).sqrt());
                let t = if theta == 0.0 { 1.0 } else { t };
                let c = 1.0 / (t * t + 1.0).sqrt();
                let s = t * c;
                for r in 0..k {
                    let (arp, arq) = (a[r * k + p], a[r * k + q]);
                    a[r * k + p] = c * arp - s * arq;
                    a[r * k + q] = s * arp + c * arq;
                }
                for r in 0..k {
                    let (apr, aqr) = (a[p * k + r], a[q * k + r]);
                    a[p * k + r] = c * apr - s * aqr;
                    a[q * k + r] = s * apr + c * aqr;
                }
                for r in 0..k {
                    let (vrp, vrq) = (v[r * k + p], v[r * k + q]);
                    v[r * k + p] = c * vrp - s * vrq;
                    v[r * k + q] = s * vrp + c * vrq;
                }
            }
        }
    }
    ((0..k).map(|i| a[i * k + i]).collect(), v)
}

/// Rank-`r` factors of `e` (`m × n`): `A (m × r)`, `B (r × n)` with `AB ≈ e`, FP16-rounded.
pub fn lowrank_factors(e: &[f32], m: usize, n: usize, r: usize, seed: u64) -> (Vec<f32>, Vec<f32>) {
    let k = (r + OVERSAMPLE).min(m).min(n);
    let r = r.min(k);
    let mut rng = Rng::new(seed);
    let omega = crate::fit::normal_samples(&mut rng, n * k);
    let et = transpose(e, m, n);
    let mut y = mm(e, m, n, &omega, k);
    orthonormalize(&mut y, m, k);
    for _ in 0..POWER_ITERS {
        let mut z = mm(&et, n, m, &y, k);
        orthonormalize(&mut z, n, k);
        y = mm(e, m, n, &z, k);
        orthonormalize(&mut y, m, k);
    }
    // B = Qᵀ E (k × n); C = B Bᵀ = W Λ Wᵀ; singular values √λ, U = Q W, V = Bᵀ W / σ.
    let qt = transpose(&y, m, k);
    let b = mm(&qt, k, m, e, n);
    let mut c = vec![0f64; k * k];
    for i in 0..k {
        for j in 0..k {
            c[i * k + j] = (0..n).map(|t| b[i * n + t] as f64 * b[j * n + t] as f64).sum();
        }
    }
    let (vals, vecs) = jacobi_eigen(&c, k);
    let mut order: Vec<usize> = (0..k).collect();
    order.sort_by(|&a, &b| vals[b].total_cmp(&vals[a]));
    let mut a_out = vec![0f32; m * r];
    let mut b_out = vec![0f32; r * n];
    for (ri, &col) in order[..r].iter().enumerate() {
        let sigma = vals[col].max(0.0).sqrt();
        let w: Vec<f64> = (0..k).map(|i| vecs[i * k + col]).collect();
        // u = Q w (m), A[:, ri] = σ u
        for i in 0..m {
            let u: f64 = (0..k).map(|j| y[i * k + j] as f64 * w[j]).sum();
            a_out[i * r + ri] = f16_round((u * sigma) as f32);
        }
        // v = Bᵀ w / σ (n), B[ri, :] = vᵀ
        for t in 0..n {
            let v: f64 = (0..k).map(|j| b[j * n + t] as f64 * w[j]).sum();
            b_out[ri * n + t] = f16_round(if sigma > 0.0 { (v / sigma) as f32 } else { 0.0 });
        }
    }
    (a_out, b_out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn recovers_a_planted_low_rank_error() {
        let (m, n, r) = (120, 90, 6);
        let mut rng = Rng::new(3);
        let mut g = |len: usize| -> Vec<f32> { (0..len).map(|_| rng.next_f64() as f32 * 2.0 - 1.0).collect() };
        let (u, v) = (g(m * r), g(r * n));
        let planted = mm(&u, m, r, &v, n);
        let noise: Vec<f32> = g(m * n).iter().map(|x| x * 1e-3).collect();
        let e: Vec<f32> = planted.iter().zip(&noise).map(|(a, b)| a + b).collect();
        let (a, b) = lowrank_factors(&e, m, n, r, 11);
        let ab = mm(&a, m, r, &b, n);
        let err: f32 = ab.iter().zip(&planted).map(|(x, y)| (x - y).powi(2)).sum::<f32>().sqrt();
        let norm: f32 = planted.iter().map(|x| x * x).sum::<f32>().sqrt();
        assert!(err / norm < 2e-3, "relative error {}", err / norm);
        // Seeded: identical factors on a second run.
        assert_eq!(lowrank_factors(&e, m, n, r, 11), (a, b));
    }

    #[test]
    fn truncation_is_optimal_on_a_known_spectrum() {
        // E = diag(5, 4, 3, 2, 1) embedded in 8×6: the rank-2 part leaves √(9+4+1) of error.
        let (m, n) = (8, 6);
        let mut e = vec![0f32; m * n];
        for (i, s) in [5.0f32, 4.0, 3.0, 2.0, 1.0].iter().enumerate() {
            e[i * n + i] = *s;
        }
        let (a, b) = lowrank_factors(&e, m, n, 2, 1);
        let ab = mm(&a, m, 2, &b, n);
        let resid: f32 = ab.iter().zip(&e).map(|(x, y)| (x - y).powi(2)).sum::<f32>().sqrt();
        assert!((resid - 14f32.sqrt()).abs() < 1e-2, "{resid}");
    }
}
