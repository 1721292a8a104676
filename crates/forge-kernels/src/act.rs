//! Elementwise activations, written as transformers computes them in f32.

#[inline]
pub fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

#[inline]
pub fn silu(x: f32) -> f32 {
    x * sigmoid(x)
}

/// softplus with PyTorch's threshold (x > 20 returns x), overflow-safe.
#[inline]
pub fn softplus(x: f32) -> f32 {
    if x > 20.0 {
        x
    } else {
        x.max(0.0) + (-x.abs()).exp().ln_1p()
    }
}

/// `gate[i] = silu(gate[i]) * up[i]` (SwiGLU), in place on `gate`. With AVX2, eight at a time
/// through a vector `exp` within 2 ulp of libm's (tested), the rest as [`silu`].
pub fn swiglu(gate: &mut [f32], up: &[f32]) {
    assert_eq!(gate.len(), up.len(), "swiglu: gate and up differ in length");
    #[cfg(target_arch = "x86_64")]
    let done = if crate::simd::has_avx2_fma() {
        // SAFETY: AVX2/FMA present; both slices hold `gate.len()` values.
        unsafe { avx2::swiglu(gate, up) }
    } else {
        0
    };
    #[cfg(not(target_arch = "x86_64"))]
    let done = 0;
    for (g, &u) in gate[done..].iter_mut().zip(&up[done..]) {
        *g = silu(*g) * u;
    }
}

/// `s_j ← e^(s_j − m)` for every value, returning `Σ_j e^(s_j − m)` (attention's softmax
/// weights before normalizing). With AVX2 all of them through the vector `exp` (a ragged
/// tail padded with −∞), summed in eight lanes; else libm's `exp`, summed in order.
pub fn exp_shifted_sum(s: &mut [f32], m: f32) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if crate::simd::has_avx2_fma() {
        // SAFETY: AVX2/FMA present.
        return unsafe { avx2::exp_shifted_sum(s, m) };
    }
    let mut l = 0f32;
    for v in s.iter_mut() {
        *v = (*v - m).exp();
        l += *v;
    }
    l
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

    /// [`super::exp_shifted_sum`], eight values at a time.
    ///
    /// # Safety
    /// AVX2/FMA must be present.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn exp_shifted_sum(s: &mut [f32], m: f32) -> f32 {
        let mv = _mm256_set1_ps(m);
        let mut acc = _mm256_setzero_ps();
        let mut chunks = s.chunks_exact_mut(8);
        for c in &mut chunks {
            let e = exp(_mm256_sub_ps(_mm256_loadu_ps(c.as_ptr()), mv));
            _mm256_storeu_ps(c.as_mut_ptr(), e);
            acc = _mm256_add_ps(acc, e);
        }
        let tail = chunks.into_remainder();
        if !tail.is_empty() {
            let mut t = [f32::NEG_INFINITY; 8];
            t[..tail.len()].copy_from_slice(tail);
            let e = exp(_mm256_sub_ps(_mm256_loadu_ps(t.as_ptr()), mv));
            _mm256_storeu_ps(t.as_mut_ptr(), e);
            tail.copy_from_slice(&t[..tail.len()]);
            acc = _mm256_add_ps(acc, e);
        }
        let mut l = [0f32; 8];
        _mm256_storeu_ps(l.as_mut_ptr(), acc);
        ((l[0] + l[1]) + (l[2] + l[3])) + ((l[4] + l[5]) + (l[6] + l[7]))
    }

    /// `exp(x)` for eight lanes: Cody–Waite reduction by `ln 2` and Cephes' degree-6
    /// polynomial (as in `expf`), 0 below −87.34, ∞ above 88.72, NaN kept.
    #[inline(always)]
    pub(super) unsafe fn exp(x: __m256) -> __m256 {
        let hi = _mm256_set1_ps(88.722_83);
        let lo = _mm256_set1_ps(-87.336_55);
        let xc = _mm256_min_ps(_mm256_max_ps(x, lo), hi);
        let n = _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(_mm256_mul_ps(
            xc,
            _mm256_set1_ps(std::f32::consts::LOG2_E),
        ));
        let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693_359_4), xc);
        let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.121_944_4e-4), r);
        let mut p = _mm256_set1_ps(1.987_569_1e-4);
        for c in [1.398_199_9e-3, 8.333_452e-3, 4.166_579_6e-2, 0.166_666_65, 0.5] {
            p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(c));
        }
        let y = _mm256_add_ps(_mm256_fmadd_ps(p, _mm256_mul_ps(r, r), r), _mm256_set1_ps(1.0));
        // 2ⁿ in two halves so that n = 128 (x near the top) does not overflow the exponent.
        let ni = _mm256_cvtps_epi32(n);
        let h = _mm256_srai_epi32::<1>(ni);
        let pow =
            |k: __m256i| _mm256_castsi256_ps(_mm256_slli_epi32::<23>(_mm256_add_epi32(k, _mm256_set1_epi32(127))));
        let v = _mm256_mul_ps(_mm256_mul_ps(y, pow(h)), pow(_mm256_sub_epi32(ni, h)));
        let v = _mm256_blendv_ps(v, _mm256_setzero_ps(), _mm256_cmp_ps::<_CMP_LT_OQ>(x, lo));
        let v = _mm256_blendv_ps(v, _mm256_set1_ps(f32::INFINITY), _mm256_cmp_ps::<_CMP_GT_OQ>(x, hi));
        // NaN in, NaN out (min/max above would have replaced it).
        _mm256_blendv_ps(v, x, _mm256_cmp_ps::<_CMP_UNORD_Q>(x, x))
    }

    /// SwiGLU over the whole multiples of eight; returns how many values it did.
    ///
    /// # Safety
    /// AVX2/FMA must be present and `up` at least as long as `gate`.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn swiglu(gate: &mut [f32], up: &[f32]) -> usize {
        let n = gate.len() / 8 * 8;
        let one = _mm256_set1_ps(1.0);
        for i in (0..n).step_by(8) {
            let g = _mm256_loadu_ps(gate.as_ptr().add(i));
            let u = _mm256_loadu_ps(up.as_ptr().add(i));
            // sigmoid(g) = 1 / (1 + exp(−g)), then g · sigmoid(g) · u, as the scalar path.
            let e = exp(_mm256_sub_ps(_mm256_setzero_ps(), g));
            let sg = _mm256_div_ps(one, _mm256_add_ps(one, e));
            _mm256_storeu_ps(gate.as_mut_ptr().add(i), _mm256_mul_ps(_mm256_mul_ps(g, sg), u));
        }
        n
    }
}

/// In-place softmax; returns nothing, handles -inf entries.
pub fn softmax(x: &mut [f32]) {
    let m = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    if m == f32::NEG_INFINITY {
        return;
    }
    let mut s = 0f32;
    for v in x.iter_mut() {
        *v = (*v - m).exp();
        s += *v;
    }
    let inv = 1.0 / s;
    for v in x.iter_mut() {
        *v *= inv;
    }
}

/// log-softmax into `out` (f64 accumulation of the normalizer for stable KL).
pub fn log_softmax(x: &[f32], out: &mut [f32]) {
    let m = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let s: f64 = x.iter().map(|&v| ((v - m) as f64).exp()).sum();
    let lse = m as f64 + s.ln();
    for (o, &v) in out.iter_mut().zip(x) {
        *o = (v as f64 - lse) as f32;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    #[test]
    fn closed_forms() {
        assert!((sigmoid(0.0) - 0.5).abs() < 1e-7);
        assert!((silu(1.0) - 1.0 / (1.0 + (-1f32).exp())).abs() < 1e-7);
        assert!((softplus(0.0) - 2f32.ln()).abs() < 1e-7);
        assert_eq!(softplus(30.0), 30.0);
        assert!(softplus(-100.0) >= 0.0 && softplus(-100.0) < 1e-40);
        let mut v = vec![1.0, 2.0, 3.0, f32::NEG_INFINITY];
        softmax(&mut v);
        let z = 1f32.exp() + 2f32.exp() + 3f32.exp();
        assert!((v[2] - 3f32.exp() / z).abs() < 1e-6 && v[3] == 0.0);
        let mut l = vec![0f32; 3];
        log_softmax(&[1.0, 2.0, 3.0], &mut l);
        assert!((l[0] - (1.0 - z.ln())).abs() < 1e-6);
    }

    /// `|a − b|` in units in the last place of `b`.
    #[cfg(target_arch = "x86_64")]
    fn ulps(a: f32, b: f32) -> f32 {
        if a == b {
            return 0.0;
        }
        (a - b).abs() / (b.abs().max(f32::MIN_POSITIVE) * f32::EPSILON)
    }

    #[test]
    #[cfg(target_arch = "x86_64")]
    fn vector_exp_is_within_two_ulp_of_libm() {
        if !crate::simd::has_avx2_fma() {
            return;
        }
        use std::arch::x86_64::*;
        let mut worst = 0f32;
        let mut xs: Vec<f32> = (0..200_001).map(|i| -87.0 + 175.5 * i as f32 / 200_000.0).collect();
        xs.extend([0.0, -0.0, 1e-30, -1e-30, 88.7, 88.72, 88.73, 100.0, -87.3, -87.4, -100.0, f32::INFINITY]);
        xs.extend([f32::NEG_INFINITY, f32::NAN]);
        for c in xs.chunks(8) {
            let mut v = [0f32; 8];
            v[..c.len()].copy_from_slice(c);
            let mut out = [0f32; 8];
            // SAFETY: AVX2/FMA checked above; 8-value arrays.
            unsafe { _mm256_storeu_ps(out.as_mut_ptr(), avx2::exp(_mm256_loadu_ps(v.as_ptr()))) };
            for (&x, &y) in v.iter().zip(&out).take(c.len()) {
                let want = x.exp();
                if want.is_nan() {
                    assert!(y.is_nan(), "exp({x}) = {y}");
                } else if want == 0.0 || want.is_infinite() || want < 1e-37 {
                    // Underflow and overflow edges: zero/denormal and ∞ as libm (to 1e-37).
                    assert!((y - want).abs() <= 1e-37 || y == want, "exp({x}) = {y}, libm {want}");
                } else {
                    worst = worst.max(ulps(y, want));
                }
            }
        }
        assert!(worst <= 2.0, "worst {worst} ulp");
    }

    #[test]
    fn shifted_exp_sum_matches_libm() {
        // Every length through the eight-wide steps and a padded tail: each weight within
        // 2 ulp of libm's e^(s − m) (0 for −∞), the sum within f32 rounding of the f64 sum.
        for n in [0usize, 1, 7, 8, 9, 31, 64, 515] {
            let s: Vec<f32> =
                (0..n).map(|i| if i % 13 == 5 { f32::NEG_INFINITY } else { ((i * 37) % 101) as f32 * -0.9 }).collect();
            let m = s.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let mut v = s.clone();
            let l = exp_shifted_sum(&mut v, m);
            let mut want = 0f64;
            for (&x, &y) in s.iter().zip(&v) {
                let e = (x - m).exp();
                want += e as f64;
                let ulp = (e.abs() * f32::EPSILON).max(1e-45);
                assert!((y - e).abs() <= 2.0 * ulp || (y - e).abs() <= 1e-37, "e^({x} − {m}) = {y}, libm {e}");
            }
            assert!((l as f64 - want).abs() <= 1e-6 * want.max(1e-30), "n {n}: sum {l} vs {want}");
        }
    }

    /// Finite inputs at the edges of f32: SwiGLU (eight-wide and scalar) within a few ulps of
    /// its f64 definition, and finite wherever that is; the softmax weights of scores whose
    /// differences overflow f32 are 0 and 1, as in f64.
    #[test]
    fn activations_are_total_over_finite_inputs() {
        let edges = [f32::MAX, 1e30, 1e10, 88.0, 1.0, 1e-30, 1e-40, f32::from_bits(1), 0.0];
        // 18 values: two eight-wide steps and a scalar tail.
        let g: Vec<f32> = edges.iter().flat_map(|&v| [v, -v]).collect();
        for u in [1.0f32, 1e-30, 1e30] {
            let up = vec![u; g.len()];
            let mut y = g.clone();
            swiglu(&mut y, &up);
            for (&a, &x) in y.iter().zip(&g) {
                let want = x as f64 / (1.0 + (-(x as f64)).exp()) * u as f64;
                if want.abs() <= f32::MAX as f64 {
                    // `silu(g)` rounds to the subnormal grid before it is multiplied by `u`, as
                    // in transformers' f32.
                    let tol = 4.0 * f32::EPSILON as f64 * want.abs() + f32::from_bits(1) as f64 * u.max(1.0) as f64;
                    assert!(a.is_finite() && (a as f64 - want).abs() <= tol, "swiglu({x}, {u}) = {a}, want {want}");
                }
            }
        }
        let mut s = vec![f32::MAX, -f32::MAX, 0.0, f32::MAX, -1e-40];
        let l = exp_shifted_sum(&mut s, f32::MAX);
        assert_eq!((s, l), (vec![1.0, 0.0, 0.0, 1.0, 0.0], 2.0));
        let mut p = vec![f32::MAX, -f32::MAX, 1e30, -1e-40];
        softmax(&mut p);
        assert_eq!(p, [1.0, 0.0, 0.0, 0.0]);
    }

    #[test]
    fn swiglu_matches_the_scalar_formula() {
        let g: Vec<f32> = (0..1003).map(|i| (i as f32 - 500.0) * 0.05).chain([f32::NAN, 90.0, -90.0]).collect();
        let u: Vec<f32> = (0..g.len()).map(|i| 1.0 + (i % 7) as f32 * 0.25).collect();
        let mut y = g.clone();
        swiglu(&mut y, &u);
        for ((&a, &x), &uu) in y.iter().zip(&g).zip(&u) {
            let want = silu(x) * uu;
            if want.is_nan() {
                assert!(a.is_nan());
            } else {
                assert!(
                    (a - want).abs() <= 4.0 * f32::EPSILON * want.abs() + 1e-30,
                    "swiglu({x}, {uu}) = {a}, want {want}"
                );
            }
        }
    }
}
