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

/// `out = x / rms(x) * w` (or `* (1 + w)` when `zero_centered`, as in Qwen3.5).
pub fn rmsnorm(x: &[f32], w: &[f32], eps: f32, zero_centered: bool, out: &mut [f32]) {
    let ms = sum_squares(x) / x.len() as f32;
    let inv = 1.0 / (ms + eps).sqrt();
    if zero_centered {
        for ((o, &v), &g) in out.iter_mut().zip(x).zip(w) {
            *o = v * inv * (1.0 + g);
        }
    } else {
        for ((o, &v), &g) in out.iter_mut().zip(x).zip(w) {
            *o = v * inv * g;
        }
    }
}

/// In-place variant.
pub fn rmsnorm_inplace(x: &mut [f32], w: &[f32], eps: f32, zero_centered: bool) {
    let ms = sum_squares(x) / x.len() as f32;
    let inv = 1.0 / (ms + eps).sqrt();
    for (v, &g) in x.iter_mut().zip(w) {
        *v *= inv * if zero_centered { 1.0 + g } else { g };
    }
}

/// Gated RMSNorm of Gated DeltaNet: `w * norm(x) * silu(z)`, in place on `x`.
pub fn rmsnorm_gated(x: &mut [f32], z: &[f32], w: &[f32], eps: f32) {
    let ms = sum_squares(x) / x.len() as f32;
    let inv = 1.0 / (ms + eps).sqrt();
    for ((v, &g), &zz) in x.iter_mut().zip(w).zip(z) {
        *v = g * (*v * inv) * crate::act::silu(zz);
    }
}

/// L2 normalization as in FLA / transformers: `x * rsqrt(sum(x²) + eps)`.
pub fn l2norm_inplace(x: &mut [f32], eps: f32) {
    let ss = sum_squares(x);
    let inv = 1.0 / (ss + eps).sqrt();
    for v in x.iter_mut() {
        *v *= inv;
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
