//! RMS norms.

/// `Σ x²` in eight interleaved partial sums, added in a fixed order at the end: the same bits on
/// every target, and a chain eight times shorter than a running sum (SmolLM2's 576-wide norm
/// runs four times as fast in eight lanes as in one chain).
fn sum_squares(x: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    let mut it = x.chunks_exact(8);
    for c in &mut it {
        for k in 0..8 {
            acc[k] += c[k] * c[k];
        }
    }
    for (a, &v) in acc.iter_mut().zip(it.remainder()) {
        *a += v * v;
    }
    ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]))
}

/// `1 / √(Σx² / n + eps)`, in f32 where that sum is sound, else in f64.
#[derive(Clone, Copy)]
enum InvRms {
    F32(f32),
    /// `Σx²` overflowed f32 (`|x|` beyond ~1e19), or is so small that its underflowed squares
    /// could show next to `eps` (`Σx²/n + eps < 2⁻¹⁰⁰`): in f64 neither can happen for f32
    /// inputs, and the normalized values (of magnitude up to `√n`) are finite again.
    F64(f64),
}

/// The inverse RMS of `x` with divisor `n` (its length, or 1 for the L2 norm). The f32 path is
/// every ordinary input's; the f64 one costs a second pass, for inputs at the edges of f32
/// alone. An all-zero `x` with `eps = 0` gives 0 (its outputs are zero), a NaN in `x` NaN.
fn inv_rms(x: &[f32], n: f32, eps: f32) -> InvRms {
    const SOUND: f32 = f32::from_bits(27 << 23); // 2⁻¹⁰⁰
    let ms = sum_squares(x) / n;
    if ms.is_finite() && ms + eps >= SOUND {
        return InvRms::F32(1.0 / (ms + eps).sqrt());
    }
    let ms: f64 = x.iter().map(|&v| v as f64 * v as f64).sum::<f64>() / n as f64 + eps as f64;
    InvRms::F64(if ms == 0.0 { 0.0 } else { 1.0 / ms.sqrt() })
}

/// `out = x / rms(x) * w` (or `* (1 + w)` when `zero_centered`, as in Qwen3.5).
pub fn rmsnorm(x: &[f32], w: &[f32], eps: f32, zero_centered: bool, out: &mut [f32]) {
    match inv_rms(x, x.len() as f32, eps) {
        InvRms::F32(inv) if zero_centered => {
            for ((o, &v), &g) in out.iter_mut().zip(x).zip(w) {
                *o = v * inv * (1.0 + g);
            }
        }
        InvRms::F32(inv) => {
            for ((o, &v), &g) in out.iter_mut().zip(x).zip(w) {
                *o = v * inv * g;
            }
        }
        InvRms::F64(inv) => {
            for ((o, &v), &g) in out.iter_mut().zip(x).zip(w) {
                *o = (v as f64 * inv) as f32 * if zero_centered { 1.0 + g } else { g };
            }
        }
    }
}

/// In-place variant.
pub fn rmsnorm_inplace(x: &mut [f32], w: &[f32], eps: f32, zero_centered: bool) {
    let inv = inv_rms(x, x.len() as f32, eps);
    for (v, &g) in x.iter_mut().zip(w) {
        let g = if zero_centered { 1.0 + g } else { g };
        *v = match inv {
            InvRms::F32(inv) => *v * (inv * g),
            InvRms::F64(inv) => (*v as f64 * inv) as f32 * g,
        };
    }
}

/// Gated RMSNorm of Gated DeltaNet: `w * norm(x) * silu(z)`, in place on `x`.
pub fn rmsnorm_gated(x: &mut [f32], z: &[f32], w: &[f32], eps: f32) {
    let inv = inv_rms(x, x.len() as f32, eps);
    for ((v, &g), &zz) in x.iter_mut().zip(w).zip(z) {
        let normed = match inv {
            InvRms::F32(inv) => *v * inv,
            InvRms::F64(inv) => (*v as f64 * inv) as f32,
        };
        *v = g * normed * crate::act::silu(zz);
    }
}

/// L2 normalization as in FLA / transformers: `x * rsqrt(sum(x²) + eps)`.
pub fn l2norm_inplace(x: &mut [f32], eps: f32) {
    match inv_rms(x, 1.0, eps) {
        InvRms::F32(inv) => x.iter_mut().for_each(|v| *v *= inv),
        InvRms::F64(inv) => x.iter_mut().for_each(|v| *v = (*v as f64 * inv) as f32),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    #[test]
    fn sum_of_squares_in_lanes_is_the_sum() {
        // Integers small enough that every partial sum is exact: any order gives the same.
        for n in [0, 1, 7, 8, 9, 576, 1001] {
            let x: Vec<f32> = (0..n).map(|i| (i % 13) as f32 - 6.0).collect();
            let want: f64 = x.iter().map(|&v| (v as f64) * (v as f64)).sum();
            assert_eq!(sum_squares(&x) as f64, want, "n={n}");
        }
    }

    /// Each norm at the edges of f32 (tiny, subnormal, huge, mixed magnitudes, and zero with
    /// `eps = 0`) within a few f32 roundings of its f64 definition: `(n/8 + 8)` units of the
    /// result (the eight-lane sum of squares, the square root, the products), plus one of the
    /// smallest subnormal.
    #[test]
    fn norms_are_total_over_finite_inputs() {
        let base = crate::testutil::data(576, 5);
        let cases: Vec<(&str, Vec<f32>)> = vec![
            ("ordinary", base.clone()),
            ("tiny", base.iter().map(|v| v * 1e-30).collect()),
            ("subnormal", base.iter().map(|v| v * 1e-40).collect()),
            ("huge", base.iter().map(|v| v * 1e30).collect()),
            ("f32::MAX", base.iter().enumerate().map(|(i, &v)| if i == 7 { f32::MAX } else { v }).collect()),
            ("mixed", base.iter().enumerate().map(|(i, v)| v * 10f32.powi((i % 77) as i32 - 38)).collect()),
            ("zero", vec![0.0; 576]),
        ];
        let w = crate::testutil::data(576, 6);
        let z = crate::testutil::data(576, 7);
        for (name, x) in &cases {
            let n = x.len();
            for eps in [0.0f32, 1e-6] {
                let ss: f64 = x.iter().map(|&v| v as f64 * v as f64).sum();
                let inv = |d: f64| {
                    let m = ss / d + eps as f64;
                    if m == 0.0 {
                        0.0
                    } else {
                        1.0 / m.sqrt()
                    }
                };
                let tol = |want: f64| (n as f64 / 8.0 + 8.0) * f32::EPSILON as f64 * want.abs() + 1.5e-45;
                let check = |what: &str, got: &[f32], want: &dyn Fn(usize) -> f64| {
                    for (i, &g) in got.iter().enumerate() {
                        let want = want(i);
                        assert!(
                            g.is_finite() && (g as f64 - want).abs() <= tol(want),
                            "{what} {name} eps={eps} [{i}]: {g} vs {want}"
                        );
                    }
                };
                let (inv_n, inv_1) = (inv(n as f64), inv(1.0));
                for zero_centered in [false, true] {
                    let gain = |i: usize| if zero_centered { 1.0 + w[i] } else { w[i] } as f64;
                    let mut out = vec![f32::NAN; n];
                    rmsnorm(x, &w, eps, zero_centered, &mut out);
                    check("rmsnorm", &out, &|i| x[i] as f64 * inv_n * gain(i));
                    let mut v = x.clone();
                    rmsnorm_inplace(&mut v, &w, eps, zero_centered);
                    check("rmsnorm_inplace", &v, &|i| x[i] as f64 * inv_n * gain(i));
                }
                let mut v = x.clone();
                rmsnorm_gated(&mut v, &z, &w, eps);
                check("rmsnorm_gated", &v, &|i| w[i] as f64 * (x[i] as f64 * inv_n) * crate::act::silu(z[i]) as f64);
                let mut v = x.clone();
                l2norm_inplace(&mut v, eps);
                check("l2norm", &v, &|i| x[i] as f64 * inv_1);
            }
        }
    }

    #[test]
    fn rmsnorm_closed_form() {
        let x = [3.0f32, 4.0];
        let mut o = [0f32; 2];
        rmsnorm(&x, &[1.0, 2.0], 0.0, false, &mut o);
        let rms = (12.5f32).sqrt();
        assert!((o[0] - 3.0 / rms).abs() < 1e-6 && (o[1] - 8.0 / rms).abs() < 1e-6);
        rmsnorm(&x, &[0.0, 1.0], 0.0, true, &mut o);
        assert!((o[0] - 3.0 / rms).abs() < 1e-6 && (o[1] - 8.0 / rms).abs() < 1e-6);
        let mut v = [3.0f32, 4.0];
        l2norm_inplace(&mut v, 0.0);
        assert!((v[0] - 0.6).abs() < 1e-6 && (v[1] - 0.8).abs() < 1e-6);
    }
}
