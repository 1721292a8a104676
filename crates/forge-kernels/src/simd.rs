//! Vector primitives with runtime dispatch (AVX2+FMA when present, else portable code).
//!
//! The portable bodies are written with 8 independent accumulators so LLVM vectorizes them;
//! the AVX2 variants compile the same bodies with `target_feature` enabled and `mul_add`
//! (which only becomes a single instruction when FMA is enabled — on the portable path it
//! would be a libm call, so the portable path uses `a * b + c`).

macro_rules! dot_body {
    ($a:expr, $b:expr, $fma:expr) => {{
        let a: &[f32] = $a;
        let b: &[f32] = $b;
        let n = a.len().min(b.len());
        let mut acc = [0f32; 16];
        let chunks = n / 16;
        for c in 0..chunks {
            let (xa, xb) = (&a[c * 16..c * 16 + 16], &b[c * 16..c * 16 + 16]);
            for l in 0..16 {
                acc[l] = $fma(xa[l], xb[l], acc[l]);
            }
        }
        let mut s = 0f32;
        for i in chunks * 16..n {
            s = $fma(a[i], b[i], s);
        }
        // Pairwise reduction keeps rounding error small for long rows.
        for w in [8, 4, 2, 1] {
            for l in 0..w {
                acc[l] += acc[l + w];
            }
        }
        acc[0] + s
    }};
}

macro_rules! axpy_body {
    ($alpha:expr, $x:expr, $y:expr, $fma:expr) => {{
        let alpha: f32 = $alpha;
        let x: &[f32] = $x;
        let y: &mut [f32] = $y;
        for (yi, &xi) in y.iter_mut().zip(x) {
            *yi = $fma(alpha, xi, *yi);
        }
    }};
}

#[inline(always)]
fn mul_add_plain(a: f32, b: f32, c: f32) -> f32 {
    a * b + c
}
#[inline(always)]
fn mul_add_fused(a: f32, b: f32, c: f32) -> f32 {
    a.mul_add(b, c)
}

/// Scalar reference dot product (sequential f32 accumulation).
pub fn dot_ref(a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}

fn dot_portable(a: &[f32], b: &[f32]) -> f32 {
    dot_body!(a, b, mul_add_plain)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn dot_avx2(a: &[f32], b: &[f32]) -> f32 {
    dot_body!(a, b, mul_add_fused)
}

fn axpy_portable(alpha: f32, x: &[f32], y: &mut [f32]) {
    axpy_body!(alpha, x, y, mul_add_plain)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn axpy_avx2(alpha: f32, x: &[f32], y: &mut [f32]) {
    axpy_body!(alpha, x, y, mul_add_fused)
}

#[inline]
pub fn has_avx2_fma() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        use std::sync::OnceLock;
        static HAS: OnceLock<bool> = OnceLock::new();
        *HAS.get_or_init(|| is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma"))
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// AVX-512 F with AVX2/FMA (prefill's 16-wide f32 tiles).
#[inline]
pub fn has_avx512f() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        use std::sync::OnceLock;
        static HAS: OnceLock<bool> = OnceLock::new();
        *HAS.get_or_init(|| has_avx2_fma() && is_x86_feature_detected!("avx512f"))
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// AVX-512 F, BW, VL, VBMI (byte permutes over 64-entry tables) and VNNI (multiply-accumulate
/// of bytes and words), as the integer kernels' AVX-512 variants use them.
#[inline]
pub fn has_avx512_kernels() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        use std::sync::OnceLock;
        static HAS: OnceLock<bool> = OnceLock::new();
        *HAS.get_or_init(|| {
            has_avx512f()
                && is_x86_feature_detected!("avx512bw")
                && is_x86_feature_detected!("avx512vl")
                && is_x86_feature_detected!("avx512vbmi")
                && is_x86_feature_detected!("avx512vnni")
        })
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// Dot product of the common prefix of `a` and `b`.
#[inline]
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if has_avx2_fma() {
        // SAFETY: the CPU supports AVX2 and FMA (checked at run time above).
        return unsafe { dot_avx2(a, b) };
    }
    dot_portable(a, b)
}

/// `y += alpha * x`.
#[inline]
pub fn axpy(alpha: f32, x: &[f32], y: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if has_avx2_fma() {
        // SAFETY: the CPU supports AVX2 and FMA (checked at run time above).
        return unsafe { axpy_avx2(alpha, x, y) };
    }
    axpy_portable(alpha, x, y)
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::testutil::data;

    #[test]
    fn dot_matches_reference_on_ragged_lengths() {
        for n in [0, 1, 7, 15, 16, 17, 100, 1023, 4099] {
            let (a, b) = (data(n, 1), data(n, 2));
            let r = dot_ref(&a, &b) as f64;
            let d = dot(&a, &b) as f64;
            let p = dot_portable(&a, &b) as f64;
            let tol = 1e-5 * (1.0 + a.iter().zip(&b).map(|(x, y)| (x * y).abs() as f64).sum::<f64>());
            assert!((d - r).abs() <= tol, "n={n}: {d} vs {r}");
            assert!((p - r).abs() <= tol, "n={n}: {p} vs {r}");
        }
    }

    #[test]
    fn axpy_matches_reference() {
        for n in [0, 3, 16, 33, 257] {
            let x = data(n, 3);
            let y0 = data(n, 4);
            let mut y = y0.clone();
            axpy(0.75, &x, &mut y);
            for i in 0..n {
                assert!((y[i] - (y0[i] + 0.75 * x[i])).abs() <= 1e-6 * (1.0 + y[i].abs()));
            }
        }
    }
}
