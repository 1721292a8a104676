//! Causal attention of one query head over a contiguous key/value history.
//!
//! The AVX2 path scores eight keys at a time (eight accumulators reduced together with
//! horizontal adds, instead of one horizontal sum per key) and keeps the output in registers
//! while it walks the values (64 columns at a time), so each key and value row is read once and
//! the output is written once.

use crate::act::softmax;
use crate::simd::{axpy, dot, dot_ref};

/// `out = softmax(q·Kᵀ·scale) V` over the first `n` rows of the history.
///
/// `keys`/`values` hold rows of `stride` floats; this head's vector starts at `offset` in each
/// row. `scores` is scratch of at least `n` floats.
#[allow(clippy::too_many_arguments)]
pub fn attend(
    q: &[f32],
    keys: &[f32],
    values: &[f32],
    n: usize,
    stride: usize,
    offset: usize,
    scale: f32,
    scores: &mut [f32],
    out: &mut [f32],
) {
    let d = q.len();
    assert!(scores.len() >= n, "scores has {} slots for {n} keys", scores.len());
    if n > 0 {
        let last = (n - 1) * stride + offset;
        assert!(keys.len() >= last + d && values.len() >= last + out.len(), "history shorter than {n} rows");
    }
    #[cfg(target_arch = "x86_64")]
    if crate::simd::has_avx2_fma() && d.is_multiple_of(8) && out.len().is_multiple_of(8) {
        // SAFETY: AVX2/FMA are present; the asserts above bound every row read (n rows of
        // `stride`, this head's `d` / `out.len()` values at `offset`), `scores` holds n values.
        unsafe {
            scores_avx2(q, keys, n, stride, offset, scale, scores);
            softmax(&mut scores[..n]);
            values_avx2(&scores[..n], values, stride, offset, out);
        }
        return;
    }
    for (j, s) in scores[..n].iter_mut().enumerate() {
        *s = dot(q, &keys[j * stride + offset..j * stride + offset + d]) * scale;
    }
    softmax(&mut scores[..n]);
    out.iter_mut().for_each(|o| *o = 0.0);
    for (j, &p) in scores[..n].iter().enumerate() {
        axpy(p, &values[j * stride + offset..j * stride + offset + out.len()], out);
    }
}

/// The definition, in plain sequential f32 (the oracle for the SIMD path).
#[allow(clippy::too_many_arguments)]
pub fn attend_ref(
    q: &[f32],
    keys: &[f32],
    values: &[f32],
    n: usize,
    stride: usize,
    offset: usize,
    scale: f32,
    out: &mut [f32],
) {
    let d = q.len();
    let mut s: Vec<f32> =
        (0..n).map(|j| dot_ref(q, &keys[j * stride + offset..j * stride + offset + d]) * scale).collect();
    softmax(&mut s);
    for (c, o) in out.iter_mut().enumerate() {
        *o = (0..n).map(|j| s[j] * values[j * stride + offset + c]).sum();
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn scores_avx2(q: &[f32], keys: &[f32], n: usize, stride: usize, offset: usize, scale: f32, s: &mut [f32]) {
    use std::arch::x86_64::*;
    let d = q.len();
    let kp = keys.as_ptr().add(offset);
    let qp = q.as_ptr();
    let mut j = 0;
    while j + 8 <= n {
        let mut acc = [_mm256_setzero_ps(); 8];
        for c in (0..d).step_by(8) {
            let qv = _mm256_loadu_ps(qp.add(c));
            for (r, a) in acc.iter_mut().enumerate() {
                *a = _mm256_fmadd_ps(qv, _mm256_loadu_ps(kp.add((j + r) * stride + c)), *a);
            }
        }
        // Horizontal sums of the eight accumulators: lane r of the result is key j + r.
        let u0 = _mm256_hadd_ps(_mm256_hadd_ps(acc[0], acc[1]), _mm256_hadd_ps(acc[2], acc[3]));
        let u1 = _mm256_hadd_ps(_mm256_hadd_ps(acc[4], acc[5]), _mm256_hadd_ps(acc[6], acc[7]));
        let sum = _mm256_add_ps(_mm256_permute2f128_ps::<0x20>(u0, u1), _mm256_permute2f128_ps::<0x31>(u0, u1));
        _mm256_storeu_ps(s.as_mut_ptr().add(j), _mm256_mul_ps(sum, _mm256_set1_ps(scale)));
        j += 8;
    }
    for (jj, sj) in s.iter_mut().enumerate().take(n).skip(j) {
        *sj = dot(q, std::slice::from_raw_parts(kp.add(jj * stride), d)) * scale;
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn values_avx2(p: &[f32], values: &[f32], stride: usize, offset: usize, out: &mut [f32]) {
    use std::arch::x86_64::*;
    let vp = values.as_ptr().add(offset);
    // 64 output columns (eight registers) per sweep over the history.
    for c0 in (0..out.len()).step_by(64) {
        let w = (out.len() - c0).min(64) / 8;
        let mut acc = [_mm256_setzero_ps(); 8];
        for (j, &pj) in p.iter().enumerate() {
            let pv = _mm256_set1_ps(pj);
            let row = vp.add(j * stride + c0);
            for (k, a) in acc.iter_mut().enumerate().take(w) {
                *a = _mm256_fmadd_ps(pv, _mm256_loadu_ps(row.add(8 * k)), *a);
            }
        }
        for (k, a) in acc.iter().enumerate().take(w) {
            _mm256_storeu_ps(out.as_mut_ptr().add(c0 + 8 * k), *a);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testutil::data;

    #[test]
    fn single_key_returns_its_value_and_uniform_scores_average() {
        let q = [1.0f32, 0.0];
        let keys = [0.5f32, 0.5, 9.0, 9.0];
        let values = [1.0f32, 2.0, 7.0, 7.0];
        let mut s = [0f32; 2];
        let mut out = [0f32; 2];
        attend(&q, &keys, &values, 1, 4, 0, 1.0, &mut s, &mut out);
        assert_eq!(out, [1.0, 2.0]);
        let keys2 = [0.0f32, 1.0, 0.0, 0.0, 0.0, 3.0, 0.0, 0.0];
        let values2 = [2.0f32, 0.0, 0.0, 0.0, 4.0, 0.0, 0.0, 0.0];
        attend(&q, &keys2, &values2, 2, 4, 0, 1.0, &mut s, &mut out);
        assert!((out[0] - 3.0).abs() < 1e-6); // q·k = 0 for both: mean of values
    }

    #[test]
    fn simd_path_matches_the_definition() {
        // Head sizes of SmolLM2 (64), Qwen3 (128) and qwen3_5 (256), ragged history lengths,
        // heads at an offset inside wider rows (GQA layout).
        for (d, heads) in [(8usize, 1usize), (64, 3), (128, 2), (256, 2)] {
            let stride = d * heads;
            for n in [1usize, 7, 8, 9, 17, 100] {
                let keys = data(n * stride, (d + n) as u32);
                let values = data(n * stride, (3 * d + n) as u32);
                let q = data(d, n as u32);
                for h in 0..heads {
                    let (mut s, mut got, mut want) = (vec![0f32; n], vec![0f32; d], vec![0f32; d]);
                    attend(&q, &keys, &values, n, stride, h * d, 0.125, &mut s, &mut got);
                    attend_ref(&q, &keys, &values, n, stride, h * d, 0.125, &mut want);
                    for (a, b) in got.iter().zip(&want) {
                        assert!((a - b).abs() <= 1e-5 * (1.0 + b.abs()), "d={d} n={n} head {h}: {a} vs {b}");
                    }
                }
            }
        }
    }
}
