//! Dense BF16/F16 weights for few input rows (decode, verify): the rows stay in their 16-bit
//! storage (often a memory map) and are widened in registers (F16C `vcvtph2ps`, BF16 by a
//! shift) right before the FMA, instead of being decoded into an f32 buffer first.

use forge_core::tensor::FloatSlice;

/// Most input rows the fast path takes (more go to the blocked GEMM).
pub const MAX_DENSE_T: usize = 4;
/// Weight rows per parallel task.
#[cfg(target_arch = "x86_64")]
const ROW_BLOCK: usize = 64;

/// AVX2 + FMA + F16C, detected once.
pub fn has_avx2_f16c() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        use std::sync::OnceLock;
        static HAS: OnceLock<bool> = OnceLock::new();
        *HAS.get_or_init(|| crate::simd::has_avx2_fma() && is_x86_feature_detected!("f16c"))
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// `y = x Wᵀ` for BF16/F16 `w` (`n_out × n_in`) and `t ≤ MAX_DENSE_T` rows. Returns `false`
/// (and leaves `y` alone) when the fast path does not apply: f32 weights, more rows, or a CPU
/// without AVX2/FMA/F16C.
pub fn matmul_half(x: &[f32], t: usize, w: FloatSlice, n_out: usize, n_in: usize, y: &mut [f32]) -> bool {
    let (bits, bf16) = match w {
        FloatSlice::F16(s) => (s, false),
        FloatSlice::BF16(s) => (s, true),
        FloatSlice::F32(_) => return false,
    };
    if t == 0 || t > MAX_DENSE_T || !has_avx2_f16c() || n_out == 0 {
        return false;
    }
    assert_eq!(bits.len(), n_out * n_in);
    assert_eq!(x.len(), t * n_in);
    assert_eq!(y.len(), t * n_out);
    #[cfg(target_arch = "x86_64")]
    {
        let mut yt = crate::scratch::Buf::zeros(n_out * t);
        let block = |b: usize, out: &mut [f32]| {
            let r0 = b * ROW_BLOCK;
            let rows = out.len() / t;
            let w = &bits[r0 * n_in..(r0 + rows) * n_in];
            // SAFETY: AVX2/FMA/F16C detected above; `w` holds rows·n_in values, x t·n_in and
            // out rows·t.
            unsafe { rows_avx2(w, rows, n_in, x, t, out, bf16) }
        };
        if n_out * n_in < 64 * 1024 || rayon::current_num_threads() == 1 {
            yt.chunks_mut(ROW_BLOCK * t).enumerate().for_each(|(b, o)| block(b, o));
        } else {
            crate::team::par_chunks_mut(&mut yt, ROW_BLOCK * t, &block);
        }
        for o in 0..n_out {
            for tt in 0..t {
                y[tt * n_out + o] = yt[o * t + tt];
            }
        }
        true
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = bf16;
        false
    }
}

/// Rows `0..rows` of `w` against `t` input rows; `out` is `[row][t]`.
///
/// # Safety
/// AVX2, FMA and F16C must be available; slices as documented at the call.
#[cfg(target_arch = "x86_64")]
#[allow(clippy::int_plus_one)]
unsafe fn rows_avx2(w: &[u16], rows: usize, n_in: usize, x: &[f32], t: usize, out: &mut [f32], bf16: bool) {
    let (wp, xp, op) = (w.as_ptr(), x.as_ptr(), out.as_mut_ptr());
    let mut r = 0;
    macro_rules! go {
        ($t:literal, $r:literal) => {{
            while r + $r <= rows {
                if bf16 {
                    kernel::<$t, $r, true>(wp.add(r * n_in), n_in, xp, op.add(r * $t));
                } else {
                    kernel::<$t, $r, false>(wp.add(r * n_in), n_in, xp, op.add(r * $t));
                }
                r += $r;
            }
            while r < rows {
                if bf16 {
                    kernel::<$t, 1, true>(wp.add(r * n_in), n_in, xp, op.add(r * $t));
                } else {
                    kernel::<$t, 1, false>(wp.add(r * n_in), n_in, xp, op.add(r * $t));
                }
                r += 1;
            }
        }};
    }
    match t {
        1 => go!(1, 4),
        2 => go!(2, 2),
        3 => go!(3, 1),
        4 => go!(4, 1),
        _ => unreachable!(),
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn load8(p: *const u16, bf16: bool) -> std::arch::x86_64::__m256 {
    use std::arch::x86_64::*;
    let h = _mm_loadu_si128(p as *const __m128i);
    if bf16 {
        _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(h)))
    } else {
        _mm256_cvtph_ps(h)
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn hsum(v: std::arch::x86_64::__m256) -> f32 {
    use std::arch::x86_64::*;
    let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    _mm_cvtss_f32(_mm_add_ss(s, _mm_shuffle_ps::<1>(s, s)))
}

/// `R` weight rows at `w` (row stride `n_in`) against `T` input rows; writes `out[r·T + t]`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn kernel<const T: usize, const R: usize, const BF: bool>(
    w: *const u16,
    n_in: usize,
    x: *const f32,
    out: *mut f32,
) {
    use std::arch::x86_64::*;
    let mut acc = [[_mm256_setzero_ps(); T]; R];
    let main = n_in / 8 * 8;
    let mut j = 0;
    while j < main {
        let mut xv = [_mm256_setzero_ps(); T];
        for (t, v) in xv.iter_mut().enumerate() {
            *v = _mm256_loadu_ps(x.add(t * n_in + j));
        }
        for (r, a) in acc.iter_mut().enumerate() {
            let wv = load8(w.add(r * n_in + j), BF);
            for (at, xt) in a.iter_mut().zip(&xv) {
                *at = _mm256_fmadd_ps(wv, *xt, *at);
            }
        }
        j += 8;
    }
    for (r, a) in acc.iter().enumerate() {
        for (t, &at) in a.iter().enumerate() {
            let mut s = hsum(at);
            for jj in main..n_in {
                let b = *w.add(r * n_in + jj);
                let wf = if BF { f32::from_bits((b as u32) << 16) } else { half::f16::from_bits(b).to_f32() };
                s += wf * *x.add(t * n_in + jj);
            }
            *out.add(r * T + t) = s;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::matmul::matmul_ref;

    #[test]
    fn half_gemv_matches_reference_on_ragged_shapes() {
        if !has_avx2_f16c() {
            eprintln!("no AVX2/F16C: skipped");
            return;
        }
        let mut s = 7u64;
        let mut rnd = || {
            s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            ((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        };
        for &(n_out, n_in) in &[(1, 1), (3, 7), (67, 33), (130, 17), (300, 64), (513, 250), (700, 129)] {
            let w: Vec<f32> = (0..n_out * n_in).map(|_| rnd()).collect();
            for t in 1..=MAX_DENSE_T {
                let x: Vec<f32> = (0..t * n_in).map(|_| rnd()).collect();
                for bf in [false, true] {
                    let bits: Vec<u16> = w
                        .iter()
                        .map(|&v| if bf { half::bf16::from_f32(v).to_bits() } else { half::f16::from_f32(v).to_bits() })
                        .collect();
                    let fs = if bf { FloatSlice::BF16(&bits) } else { FloatSlice::F16(&bits) };
                    let mut wf = vec![0f32; n_out * n_in];
                    fs.read_into(0, &mut wf);
                    let r = matmul_ref(&x, t, &wf, n_out, n_in);
                    let mut y = vec![0f32; t * n_out];
                    assert!(matmul_half(&x, t, fs, n_out, n_in, &mut y));
                    for (i, (a, b)) in y.iter().zip(&r).enumerate() {
                        let (tt, o) = (i / n_out, i % n_out);
                        let l1: f32 = (0..n_in).map(|j| (x[tt * n_in + j] * wf[o * n_in + j]).abs()).sum();
                        assert!(
                            (a - b).abs() <= 1e-5 * (l1 + b.abs()) + 1e-30,
                            "bf16={bf} {n_out}x{n_in} t={t}: {a} vs {b}"
                        );
                    }
                }
            }
        }
    }
}
