//! Causal attention of one query head over a contiguous key/value history.
//!
//! The AVX2 path scores eight keys at a time (eight accumulators reduced together with
//! horizontal adds, instead of one horizontal sum per key) and keeps the output in registers
//! while it walks the values (64 columns at a time). The query heads that share a key/value head
//! (GQA) go together, so each key and value row is read from memory once per group.

use crate::act::softmax;
use crate::simd::{axpy, dot, dot_ref};

/// The cached keys and values one key/value head attends over: the first `n` rows of
/// `stride` floats each, this head's vectors starting at `offset` in every row.
#[derive(Clone, Copy)]
pub struct History<'a> {
    pub keys: &'a [f32],
    pub values: &'a [f32],
    pub n: usize,
    pub stride: usize,
    pub offset: usize,
}

/// `out_h = softmax(q_h·Kᵀ·scale) V` over the first `n` rows of the history, for the
/// `g = q.len() / d` query heads that share one key/value head (grouped-query attention; `g = 1`
/// for plain attention), `q` and `out` holding them one after the other: each key and value row
/// is read from memory once for the whole group.
///
/// `scores` is scratch of at least `g · n` floats.
pub fn attend_group(q: &[f32], d: usize, kv: History, scale: f32, scores: &mut [f32], out: &mut [f32]) {
    let History { keys, values, n, stride, offset } = kv;
    assert!(d > 0 && q.len().is_multiple_of(d), "{} query values are not whole heads of {d}", q.len());
    let g = q.len() / d;
    assert!(out.len().is_multiple_of(g), "output of {} values for {g} heads", out.len());
    let dv = out.len() / g;
    assert!(scores.len() >= g * n, "scores has {} slots for {g}×{n}", scores.len());
    if n > 0 {
        let last = (n - 1) * stride + offset;
        assert!(keys.len() >= last + d && values.len() >= last + dv, "history shorter than {n} rows");
    }
    #[cfg(target_arch = "x86_64")]
    if crate::simd::has_avx2_fma() && d.is_multiple_of(8) && dv.is_multiple_of(8) {
        // SAFETY: AVX2/FMA are present; the asserts above bound every row read (n rows of
        // `stride`, `d` / `dv` values at `offset`), `scores` holds g·n values and `out` g·dv.
        unsafe {
            scores_avx2(q, d, keys, n, stride, offset, scale, scores);
            for h in 0..g {
                softmax(&mut scores[h * n..(h + 1) * n]);
            }
            values_avx2(&scores[..g * n], n, values, stride, offset, out);
        }
        return;
    }
    for h in 0..g {
        let (qh, sh) = (&q[h * d..(h + 1) * d], &mut scores[h * n..(h + 1) * n]);
        for (j, s) in sh.iter_mut().enumerate() {
            *s = dot(qh, &keys[j * stride + offset..j * stride + offset + d]) * scale;
        }
        softmax(sh);
        let oh = &mut out[h * dv..(h + 1) * dv];
        oh.iter_mut().for_each(|o| *o = 0.0);
        for (j, &p) in sh.iter().enumerate() {
            axpy(p, &values[j * stride + offset..j * stride + offset + dv], oh);
        }
    }
}

/// The definition for one query head, in plain sequential f32 (the oracle for the SIMD path).
pub fn attend_ref(q: &[f32], kv: History, scale: f32, out: &mut [f32]) {
    let History { keys, values, n, stride, offset } = kv;
    let d = q.len();
    let mut s: Vec<f32> =
        (0..n).map(|j| dot_ref(q, &keys[j * stride + offset..j * stride + offset + d]) * scale).collect();
    softmax(&mut s);
    for (c, o) in out.iter_mut().enumerate() {
        *o = (0..n).map(|j| s[j] * values[j * stride + offset + c]).sum();
    }
}

/// Scores of every head of the group, eight keys at a time (the eight key rows stay in L1
/// while each head uses them).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
#[allow(clippy::too_many_arguments)]
unsafe fn scores_avx2(
    q: &[f32],
    d: usize,
    keys: &[f32],
    n: usize,
    stride: usize,
    offset: usize,
    scale: f32,
    s: &mut [f32],
) {
    use std::arch::x86_64::*;
    let g = q.len() / d;
    let kp = keys.as_ptr().add(offset);
    let mut j = 0;
    while j + 8 <= n {
        for h in 0..g {
            let qp = q.as_ptr().add(h * d);
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
            _mm256_storeu_ps(s.as_mut_ptr().add(h * n + j), _mm256_mul_ps(sum, _mm256_set1_ps(scale)));
        }
        j += 8;
    }
    for jj in j..n {
        let k = std::slice::from_raw_parts(kp.add(jj * stride), d);
        for h in 0..g {
            s[h * n + jj] = dot(&q[h * d..(h + 1) * d], k) * scale;
        }
    }
}

/// `out_h = Σ_j p_h[j] V_j` for every head of the group: 64 output columns (eight registers) per
/// sweep; with several heads the keys go in blocks of 32 whose value rows stay in L1 while each
/// head adds its share.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn values_avx2(p: &[f32], n: usize, values: &[f32], stride: usize, offset: usize, out: &mut [f32]) {
    use std::arch::x86_64::*;
    let g = p.len() / n.max(1);
    let dv = out.len() / g.max(1);
    let vp = values.as_ptr().add(offset);
    let block = if g == 1 { n.max(1) } else { 32 };
    for c0 in (0..dv).step_by(64) {
        let w = (dv - c0).min(64) / 8;
        for j0 in (0..n.max(1)).step_by(block) {
            let j1 = (j0 + block).min(n);
            for h in 0..g {
                let o = out.as_mut_ptr().add(h * dv + c0);
                let mut acc = [_mm256_setzero_ps(); 8];
                if j0 > 0 {
                    for (k, a) in acc.iter_mut().enumerate().take(w) {
                        *a = _mm256_loadu_ps(o.add(8 * k));
                    }
                }
                for j in j0..j1 {
                    let pv = _mm256_set1_ps(p[h * n + j]);
                    let row = vp.add(j * stride + c0);
                    for (k, a) in acc.iter_mut().enumerate().take(w) {
                        *a = _mm256_fmadd_ps(pv, _mm256_loadu_ps(row.add(8 * k)), *a);
                    }
                }
                for (k, a) in acc.iter().enumerate().take(w) {
                    _mm256_storeu_ps(o.add(8 * k), *a);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testutil::data;

    fn hist<'a>(keys: &'a [f32], values: &'a [f32], n: usize, stride: usize, offset: usize) -> History<'a> {
        History { keys, values, n, stride, offset }
    }

    #[test]
    fn single_key_returns_its_value_and_uniform_scores_average() {
        let q = [1.0f32, 0.0];
        let keys = [0.5f32, 0.5, 9.0, 9.0];
        let values = [1.0f32, 2.0, 7.0, 7.0];
        let mut s = [0f32; 2];
        let mut out = [0f32; 2];
        attend_group(&q, 2, hist(&keys, &values, 1, 4, 0), 1.0, &mut s, &mut out);
        assert_eq!(out, [1.0, 2.0]);
        let keys2 = [0.0f32, 1.0, 0.0, 0.0, 0.0, 3.0, 0.0, 0.0];
        let values2 = [2.0f32, 0.0, 0.0, 0.0, 4.0, 0.0, 0.0, 0.0];
        attend_group(&q, 2, hist(&keys2, &values2, 2, 4, 0), 1.0, &mut s, &mut out);
        assert!((out[0] - 3.0).abs() < 1e-6); // q·k = 0 for both: mean of values
    }

    #[test]
    fn grouped_heads_match_one_head_at_a_time() {
        for (d, g) in [(8usize, 2usize), (64, 3), (128, 8), (256, 2)] {
            let kvh = 2;
            let stride = d * kvh;
            for n in [1usize, 5, 8, 33, 70] {
                let keys = data(n * stride, (d + g + n) as u32);
                let values = data(n * stride, (7 * d + n) as u32);
                let q = data(g * d, (g + n) as u32);
                let mut s = vec![0f32; g * n];
                let mut got = vec![0f32; g * d];
                attend_group(&q, d, hist(&keys, &values, n, stride, d), 0.3, &mut s, &mut got);
                for h in 0..g {
                    let mut want = vec![0f32; d];
                    attend_ref(&q[h * d..(h + 1) * d], hist(&keys, &values, n, stride, d), 0.3, &mut want);
                    for (a, b) in got[h * d..(h + 1) * d].iter().zip(&want) {
                        assert!((a - b).abs() <= 1e-5 * (1.0 + b.abs()), "d={d} g={g} n={n} head {h}: {a} vs {b}");
                    }
                    // One head on its own gives the same bits as inside the group (the model
                    // splits decode attention per query head, verify and prefill per group).
                    let mut alone = vec![0f32; d];
                    let mut s1 = vec![0f32; n];
                    attend_group(
                        &q[h * d..(h + 1) * d],
                        d,
                        hist(&keys, &values, n, stride, d),
                        0.3,
                        &mut s1,
                        &mut alone,
                    );
                    assert_eq!(alone, got[h * d..(h + 1) * d], "d={d} g={g} n={n} head {h} alone");
                }
            }
        }
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
                    attend_group(&q, d, hist(&keys, &values, n, stride, h * d), 0.125, &mut s, &mut got);
                    attend_ref(&q, hist(&keys, &values, n, stride, h * d), 0.125, &mut want);
                    for (a, b) in got.iter().zip(&want) {
                        assert!((a - b).abs() <= 1e-5 * (1.0 + b.abs()), "d={d} n={n} head {h}: {a} vs {b}");
                    }
                }
            }
        }
    }
}
