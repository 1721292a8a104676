//! Causal attention of one query head over a contiguous key/value history.
//!
//! The AVX2 path scores eight keys at a time (eight accumulators reduced together with
//! horizontal adds, instead of one horizontal sum per key) and keeps the output in registers
//! while it walks the values (64 columns at a time). The query heads that share a key/value head
//! (GQA) go together, so each key and value row is read from memory once per group. A long
//! history is cut into parts that workers take separately and that are merged afterwards
//! (as in flash-decoding), so that decode's few key/value heads still give every worker work.

use crate::act::softmax;
use crate::simd::{axpy, dot, dot_ref};
use half::f16;

/// An element of a key/value cache: f32, or f16 (half the bytes to read per token, converted to
/// f32 exactly as it is loaded; every product and sum stays f32).
pub trait KvElem: Copy + Send + Sync + 'static {
    fn to_f32(self) -> f32;
    fn from_f32(v: f32) -> Self;
    /// `q · row`.
    fn dot(q: &[f32], row: &[Self]) -> f32;
    /// `out += a · row`.
    fn axpy(a: f32, row: &[Self], out: &mut [f32]);
    /// Eight elements at `p` as f32 lanes.
    ///
    /// # Safety
    /// AVX2 and F16C must be present and eight elements readable at `p`.
    #[cfg(target_arch = "x86_64")]
    unsafe fn load8(p: *const Self) -> std::arch::x86_64::__m256;
}

impl KvElem for f32 {
    #[inline(always)]
    fn to_f32(self) -> f32 {
        self
    }
    #[inline(always)]
    fn from_f32(v: f32) -> f32 {
        v
    }
    fn dot(q: &[f32], row: &[f32]) -> f32 {
        dot(q, row)
    }
    fn axpy(a: f32, row: &[f32], out: &mut [f32]) {
        axpy(a, row, out)
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load8(p: *const f32) -> std::arch::x86_64::__m256 {
        // SAFETY: eight f32 are readable at `p` (the caller's contract).
        unsafe { std::arch::x86_64::_mm256_loadu_ps(p) }
    }
}

impl KvElem for f16 {
    #[inline(always)]
    fn to_f32(self) -> f32 {
        f16::to_f32(self)
    }
    #[inline(always)]
    fn from_f32(v: f32) -> f16 {
        f16::from_f32(v)
    }
    fn dot(q: &[f32], row: &[f16]) -> f32 {
        use half::slice::HalfFloatSliceExt;
        crate::simd::dot_f16(q, row.reinterpret_cast())
    }
    fn axpy(a: f32, row: &[f16], out: &mut [f32]) {
        out.iter_mut().zip(row).for_each(|(o, &v)| *o += a * v.to_f32());
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load8(p: *const f16) -> std::arch::x86_64::__m256 {
        use std::arch::x86_64::*;
        // SAFETY: eight f16 (16 bytes) are readable at `p`, and F16C is present (the caller's
        // contract).
        unsafe { _mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i)) }
    }
}

impl KvElem for i8 {
    #[inline(always)]
    fn to_f32(self) -> f32 {
        self as f32
    }
    /// The nearest code in ±127 (the caller divides by the row's scale first).
    #[inline(always)]
    fn from_f32(v: f32) -> i8 {
        v.round().clamp(-127.0, 127.0) as i8
    }
    fn dot(q: &[f32], row: &[i8]) -> f32 {
        q.iter().zip(row).map(|(&a, &b)| a * b as f32).sum()
    }
    fn axpy(a: f32, row: &[i8], out: &mut [f32]) {
        out.iter_mut().zip(row).for_each(|(o, &v)| *o += a * v as f32);
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load8(p: *const i8) -> std::arch::x86_64::__m256 {
        use std::arch::x86_64::*;
        // SAFETY: eight bytes are readable at `p` and AVX2 is present (the caller's contract).
        unsafe { _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(p as *const __m128i))) }
    }
}

/// One scale per history row of integer codes (row `j` stands for `scale_j · code_j`): none
/// for float rows, f32 (the V8 cache's values) or f16 (the KV8 cache's keys and values).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub enum RowScales<'a> {
    #[default]
    None,
    F32(&'a [f32]),
    F16(&'a [f16]),
}

impl<'a> RowScales<'a> {
    pub fn is_none(&self) -> bool {
        matches!(self, RowScales::None)
    }

    /// Scales held (0 for none).
    pub fn len(&self) -> usize {
        match self {
            RowScales::None => 0,
            RowScales::F32(s) => s.len(),
            RowScales::F16(s) => s.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Row `j`'s scale (1 for float rows).
    #[inline]
    pub fn get(&self, j: usize) -> f32 {
        match self {
            RowScales::None => 1.0,
            RowScales::F32(s) => s[j],
            RowScales::F16(s) => s[j].to_f32(),
        }
    }

    /// The scales from row `j0` on.
    fn skip(&self, j0: usize) -> RowScales<'a> {
        match *self {
            RowScales::None => RowScales::None,
            RowScales::F32(s) => RowScales::F32(&s[j0.min(s.len())..]),
            RowScales::F16(s) => RowScales::F16(&s[j0.min(s.len())..]),
        }
    }

    /// `x[j] *= scale_j` for the first `x.len()` rows (nothing for float rows). f16 scales are
    /// widened 64 at a time through the slice conversion (F16C where present), not one by one.
    fn apply(&self, x: &mut [f32]) {
        match *self {
            RowScales::None => {}
            RowScales::F32(s) => x.iter_mut().zip(s).for_each(|(v, &c)| *v *= c),
            RowScales::F16(s) => {
                use half::slice::HalfFloatSliceExt;
                let mut buf = [0f32; 64];
                for (xs, ss) in x.chunks_mut(64).zip(s.chunks(64)) {
                    let b = &mut buf[..ss.len()];
                    ss.convert_to_f32_slice(b);
                    xs.iter_mut().zip(b.iter()).for_each(|(v, &c)| *v *= c);
                }
            }
        }
    }
}

impl<'a> From<&'a [f32]> for RowScales<'a> {
    fn from(s: &'a [f32]) -> Self {
        RowScales::F32(s)
    }
}

impl<'a> From<&'a [f16]> for RowScales<'a> {
    fn from(s: &'a [f16]) -> Self {
        RowScales::F16(s)
    }
}

/// The cached keys and values one key/value head attends over: the first `n` rows of
/// `stride` elements each, this head's vectors starting at `offset` in every row.
///
/// Keys and values may be integer codes with one scale per row (ANEMLL Forge's V8 cache: f16
/// keys, int8 values with f32 scales; its KV8 cache: int8 keys and values, f16 scales): row
/// `j`'s values are `value_scales[j] · values[j]`, its key `key_scales[j] · keys[j]`. The codes
/// are read as they are stored, widened to f32 as they are loaded. A key's scale goes onto its
/// score (`(q · code_j) · s_j`) before the softmax; a value's onto the row's attention weight
/// (`p_j · s_j`) after the softmax statistics are taken, so the value sweep is the float one.
pub struct History<'a, K: KvElem = f32, V: KvElem = K> {
    pub keys: &'a [K],
    pub values: &'a [V],
    pub key_scales: RowScales<'a>,
    pub value_scales: RowScales<'a>,
    pub n: usize,
    pub stride: usize,
    pub offset: usize,
}

/// Fewest history rows in a part (see [`part_len`]).
const MIN_PART: usize = 32;
/// Most parts a history is cut into.
const MAX_PARTS: usize = 16;

impl<K: KvElem, V: KvElem> Clone for History<'_, K, V> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<K: KvElem, V: KvElem> Copy for History<'_, K, V> {}

/// Rows per part when attention over a history of `n` rows is cut into parts that workers take
/// separately ([`attend_part`], then [`merge_parts`]): a multiple of eight (the keys are scored
/// eight at a time), at least 32, at most 16 parts. It depends on `n` alone, so a query gives
/// the same bits however the work is spread (decode, verify or prefill, any thread count).
pub fn part_len(n: usize) -> usize {
    n.div_ceil(MAX_PARTS).next_multiple_of(8).max(MIN_PART)
}

/// How many parts a history of `n` rows is cut into (one for an empty history).
pub fn n_parts(n: usize) -> usize {
    n.max(1).div_ceil(part_len(n))
}

/// `out_h = softmax(q_h·Kᵀ·scale) V` over the first `n` rows of the history, for the
/// `g = q.len() / d` query heads that share one key/value head (grouped-query attention; `g = 1`
/// for plain attention), `q` and `out` holding them one after the other: each key and value row
/// is read from memory once for the whole group. The history is taken in [`n_parts`] parts and
/// merged, as the model's parallel paths do, so this gives their bits.
///
/// `scores` is scratch of at least `g · n` floats.
pub fn attend_group<K: KvElem, V: KvElem>(
    q: &[f32],
    d: usize,
    kv: History<K, V>,
    scale: f32,
    scores: &mut [f32],
    out: &mut [f32],
) {
    assert!(d > 0 && q.len().is_multiple_of(d), "{} query values are not whole heads of {d}", q.len());
    let g = q.len() / d;
    assert!(out.len().is_multiple_of(g), "output of {} values for {g} heads", out.len());
    assert!(scores.len() >= g * kv.n, "scores has {} slots for {g}×{}", scores.len(), kv.n);
    let (parts, slot) = (n_parts(kv.n), out.len() + 2 * g);
    // Every part writes its whole slot (an empty one zeros and `(−∞, 0)`).
    let mut slots = crate::scratch::Buf::for_overwrite(parts * slot);
    for (p, sl) in slots.chunks_mut(slot).enumerate() {
        let (o, st) = sl.split_at_mut(out.len());
        attend_part(q, d, kv.part(p), scale, scores, o, st, false);
    }
    merge_parts(g, &slots, out);
}

impl<'a, K: KvElem, V: KvElem> History<'a, K, V> {
    /// Part `p` of [`n_parts`]`(self.n)`: its rows as a history of their own.
    pub fn part(&self, p: usize) -> History<'a, K, V> {
        let len = part_len(self.n);
        let j0 = (p * len).min(self.n);
        let skip = j0 * self.stride;
        History {
            keys: &self.keys[skip.min(self.keys.len())..],
            values: &self.values[skip.min(self.values.len())..],
            key_scales: self.key_scales.skip(j0),
            value_scales: self.value_scales.skip(j0),
            n: len.min(self.n - j0),
            ..*self
        }
    }
}

/// One part of [`attend_group`]: for each of the `g` heads, `out_h = Σ_j e^(s_hj − m_h) V_j`
/// over the part's rows (not yet normalized) and `stats[2h..2h + 2] = (m_h, Σ_j e^(s_hj − m_h))`,
/// `m_h` the largest score. An empty part gives zeros and `(−∞, 0)`.
///
/// With `ahead` (decode and verify, whose history comes from L3 or memory once a token; x86-64
/// only) the key rows are asked for a block ahead and the value rows while their scores are
/// taken. The longer the history, the more it pays: SmolLM2's decode after 1024 tokens runs
/// about 1.14× as fast with it, after 64 no faster. Prefill, whose consecutive tokens find the
/// history in L2, gains nothing from it, so [`attend_group`] does not ask.
///
/// `scores` is scratch of at least `g · kv.n` floats, `stats` holds `2g`.
///
/// Finite inputs give finite outputs wherever the products `q·k` and the scores are finite and
/// `n · max|v|` is (the values are summed before they are normalized): tiny and subnormal
/// inputs included; any f16 or int8 cache.
#[allow(clippy::too_many_arguments)]
#[cfg_attr(not(target_arch = "x86_64"), allow(unused_variables))]
pub fn attend_part<K: KvElem, V: KvElem>(
    q: &[f32],
    d: usize,
    kv: History<K, V>,
    scale: f32,
    scores: &mut [f32],
    out: &mut [f32],
    stats: &mut [f32],
    ahead: bool,
) {
    let History { keys, values, key_scales, value_scales, n, stride, offset } = kv;
    assert!(d > 0 && q.len().is_multiple_of(d), "{} query values are not whole heads of {d}", q.len());
    let g = q.len() / d;
    assert!(out.len().is_multiple_of(g), "output of {} values for {g} heads", out.len());
    let dv = out.len() / g;
    assert!(scores.len() >= g * n, "scores has {} slots for {g}×{n}", scores.len());
    assert!(stats.len() >= 2 * g, "stats has {} slots for {g} heads", stats.len());
    if n > 0 {
        let last = (n - 1) * stride + offset;
        assert!(keys.len() >= last + d && values.len() >= last + dv, "history shorter than {n} rows");
    }
    assert!(value_scales.is_none() || value_scales.len() >= n, "{} value scales for {n} rows", value_scales.len());
    assert!(key_scales.is_none() || key_scales.len() >= n, "{} key scales for {n} rows", key_scales.len());
    // Key scales onto the scores, before the statistics.
    let scale_keys = |scores: &mut [f32]| {
        if !key_scales.is_none() {
            scores.chunks_mut(n.max(1)).for_each(|sh| key_scales.apply(sh));
        }
    };
    // Value scales onto the weights, after the statistics (which are of the weights alone).
    let scale_rows = |scores: &mut [f32]| {
        if !value_scales.is_none() {
            scores.chunks_mut(n.max(1)).for_each(|sh| value_scales.apply(sh));
        }
    };
    let scores = &mut scores[..g * n];
    #[cfg(target_arch = "x86_64")]
    if crate::simd::has_f16c() && d.is_multiple_of(8) && dv.is_multiple_of(8) {
        // SAFETY: AVX2/FMA/F16C are present; the asserts above bound every row read and every
        // row asked for ahead (n rows of `stride`, `d` / `dv` values at `offset`), `scores`
        // holds g·n values and `out` g·dv.
        unsafe {
            scores_avx2(q, d, keys, n, stride, offset, scale, scores, ahead.then_some((values, dv)));
            scale_keys(scores);
            for h in 0..g {
                (stats[2 * h], stats[2 * h + 1]) = exp_shifted(&mut scores[h * n..(h + 1) * n]);
            }
            scale_rows(scores);
            values_avx2(scores, n, values, stride, offset, out);
        }
        return;
    }
    for h in 0..g {
        let (qh, sh) = (&q[h * d..(h + 1) * d], &mut scores[h * n..(h + 1) * n]);
        for (j, s) in sh.iter_mut().enumerate() {
            *s = K::dot(qh, &keys[j * stride + offset..j * stride + offset + d]) * scale;
        }
        scale_keys(sh);
        (stats[2 * h], stats[2 * h + 1]) = exp_shifted(sh);
        scale_rows(sh);
        let oh = &mut out[h * dv..(h + 1) * dv];
        oh.iter_mut().for_each(|o| *o = 0.0);
        for (j, &p) in sh.iter().enumerate() {
            V::axpy(p, &values[j * stride + offset..j * stride + offset + dv], oh);
        }
    }
}

/// `s_j ← e^(s_j − m)` with `m = max s`; returns `(m, Σ_j e^(s_j − m))`. All −∞ (or none):
/// `(−∞, 0)` with the weights zero.
fn exp_shifted(s: &mut [f32]) -> (f32, f32) {
    let m = s.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    if m == f32::NEG_INFINITY {
        s.iter_mut().for_each(|v| *v = 0.0);
        return (m, 0.0);
    }
    // Through the vector `exp` (within 2 ulp of libm's), which makes SmolLM2's 512-token
    // prefill about 6 % faster than libm's `exp` one value at a time.
    (m, crate::act::exp_shifted_sum(s, m))
}

/// The parts of [`attend_part`] made one. `slots` holds each part's outputs (`out.len()`
/// values) then its `2g` stats; `out_h = Σ_p e^(m_ph − M_h) o_ph / Σ_p e^(m_ph − M_h) l_ph`,
/// `M_h` the largest `m_ph`, parts added in order. A head whose every score was −∞ gets zeros.
pub fn merge_parts(g: usize, slots: &[f32], out: &mut [f32]) {
    let w = out.len();
    assert!(g > 0 && w.is_multiple_of(g), "output of {w} values for {g} heads");
    let slot = w + 2 * g;
    assert!(slots.len().is_multiple_of(slot), "{} values are not whole parts of {slot}", slots.len());
    let dv = w / g;
    for h in 0..g {
        let st = |p: usize| (slots[p * slot + w + 2 * h], slots[p * slot + w + 2 * h + 1]);
        let parts = slots.len() / slot;
        let m = (0..parts).map(|p| st(p).0).fold(f32::NEG_INFINITY, f32::max);
        let oh = &mut out[h * dv..(h + 1) * dv];
        oh.iter_mut().for_each(|o| *o = 0.0);
        if m == f32::NEG_INFINITY {
            continue;
        }
        let mut l = 0f32;
        for p in 0..parts {
            let (mp, lp) = st(p);
            if lp == 0.0 {
                continue;
            }
            let c = (mp - m).exp();
            l += c * lp;
            axpy(c, &slots[p * slot + h * dv..p * slot + (h + 1) * dv], oh);
        }
        let inv = 1.0 / l;
        oh.iter_mut().for_each(|o| *o *= inv);
    }
}

/// The definition for one query head, in plain sequential f32 (the oracle for the SIMD path).
pub fn attend_ref<K: KvElem, V: KvElem>(q: &[f32], kv: History<K, V>, scale: f32, out: &mut [f32]) {
    let History { keys, values, key_scales, value_scales, n, stride, offset } = kv;
    let d = q.len();
    // Dequantize, then attend.
    let row = |j: usize| {
        keys[j * stride + offset..j * stride + offset + d]
            .iter()
            .map(|v| key_scales.get(j) * v.to_f32())
            .collect::<Vec<_>>()
    };
    let mut s: Vec<f32> = (0..n).map(|j| dot_ref(q, &row(j)) * scale).collect();
    softmax(&mut s);
    for (c, o) in out.iter_mut().enumerate() {
        *o = (0..n).map(|j| s[j] * (value_scales.get(j) * values[j * stride + offset + c].to_f32())).sum();
    }
}

/// Scores of every head of the group, eight keys at a time (the eight key rows stay in L1
/// while each head uses them). With `ahead` (the values and their row length) each block asks
/// for the next block's key rows and its own value rows.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
#[allow(clippy::too_many_arguments)]
unsafe fn scores_avx2<T: KvElem, V: KvElem>(
    q: &[f32],
    d: usize,
    keys: &[T],
    n: usize,
    stride: usize,
    offset: usize,
    scale: f32,
    s: &mut [f32],
    ahead: Option<(&[V], usize)>,
) {
    use std::arch::x86_64::*;
    let g = q.len() / d;
    let kp = keys.as_ptr().add(offset);
    let mut j = 0;
    while j + 8 <= n {
        if let Some((values, dv)) = ahead {
            let vp = values.as_ptr().add(offset) as *const i8;
            for r in j + 8..(j + 16).min(n) {
                let k = kp.add(r * stride) as *const i8;
                for b in (0..d * size_of::<T>()).step_by(64) {
                    _mm_prefetch::<_MM_HINT_T0>(k.add(b));
                }
            }
            for r in j..j + 8 {
                let v = vp.add(r * stride * size_of::<V>());
                for b in (0..dv * size_of::<V>()).step_by(64) {
                    _mm_prefetch::<_MM_HINT_T0>(v.add(b));
                }
            }
        }
        for h in 0..g {
            let qp = q.as_ptr().add(h * d);
            let mut acc = [_mm256_setzero_ps(); 8];
            for c in (0..d).step_by(8) {
                let qv = _mm256_loadu_ps(qp.add(c));
                for (r, a) in acc.iter_mut().enumerate() {
                    *a = _mm256_fmadd_ps(qv, T::load8(kp.add((j + r) * stride + c)), *a);
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
    // The last keys one at a time, in the same f32 arithmetic for either element type.
    for jj in j..n {
        for h in 0..g {
            let mut acc = _mm256_setzero_ps();
            for c in (0..d).step_by(8) {
                acc =
                    _mm256_fmadd_ps(_mm256_loadu_ps(q.as_ptr().add(h * d + c)), T::load8(kp.add(jj * stride + c)), acc);
            }
            let v = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps::<1>(acc));
            let v = _mm_add_ps(v, _mm_movehl_ps(v, v));
            s[h * n + jj] = _mm_cvtss_f32(_mm_add_ss(v, _mm_shuffle_ps::<1>(v, v))) * scale;
        }
    }
}

/// `out_h = Σ_j p_h[j] V_j` for every head of the group: 64 output columns (eight registers) per
/// sweep; with several heads the keys go in blocks of 32 whose value rows stay in L1 while each
/// head adds its share.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn values_avx2<T: KvElem>(p: &[f32], n: usize, values: &[T], stride: usize, offset: usize, out: &mut [f32]) {
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
                        *a = _mm256_fmadd_ps(pv, T::load8(row.add(8 * k)), *a);
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
        History { keys, values, key_scales: RowScales::None, value_scales: RowScales::None, n, stride, offset }
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
                    // One head on its own gives the same bits as inside the group.
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
    fn parts_cover_the_history_once() {
        for n in (0..600).chain([1000, 4095, 4096, 4097, 100_000]) {
            let (len, parts) = (part_len(n), n_parts(n));
            assert!(
                len % 8 == 0 && len >= MIN_PART && (1..=MAX_PARTS).contains(&parts),
                "n={n}: {parts} parts of {len}"
            );
            let (keys, values) = (vec![0f32; n.max(1)], vec![0f32; n.max(1)]);
            let kv = hist(&keys, &values, n, 1, 0);
            let rows: Vec<usize> = (0..parts).map(|p| kv.part(p).n).collect();
            assert_eq!(rows.iter().sum::<usize>(), n, "n={n}: {rows:?}");
            assert!(rows.iter().all(|&r| r > 0 || n == 0), "n={n}: an empty part {rows:?}");
        }
    }

    #[test]
    fn merged_parts_match_the_definition_in_any_order_of_work() {
        // A long history in many parts; the parts computed last to first give the same bits,
        // and an empty part (as verify's earlier tokens leave) changes nothing: prefill's items
        // (`attend_group`) and decode's or verify's (parts, then `merge_parts`, asking for rows
        // ahead) agree. Heads alone in their rows, and at an offset in rows of two heads.
        let (d, g, n) = (64usize, 3usize, 517usize);
        assert!(n_parts(n) > 4);
        for (stride, offset) in [(d, 0), (2 * d, d)] {
            let keys = data(n * stride, 11);
            let values = data(n * stride, 12);
            let q = data(g * d, 13);
            let mut scores = vec![0f32; g * n];
            let mut got = vec![0f32; g * d];
            attend_group(&q, d, hist(&keys, &values, n, stride, offset), 0.125, &mut scores, &mut got);
            let slot = g * d + 2 * g;
            let parts = n_parts(n);
            let mut slots = vec![0f32; (parts + 1) * slot];
            for p in (0..parts).rev() {
                let (o, st) = slots[p * slot..(p + 1) * slot].split_at_mut(g * d);
                attend_part(&q, d, hist(&keys, &values, n, stride, offset).part(p), 0.125, &mut scores, o, st, true);
            }
            let (o, st) = slots[parts * slot..].split_at_mut(g * d);
            attend_part(&q, d, hist(&keys, &values, 0, stride, offset), 0.125, &mut scores, o, st, true);
            assert_eq!(st, [f32::NEG_INFINITY, 0.0].repeat(g));
            let mut again = vec![0f32; g * d];
            merge_parts(g, &slots, &mut again);
            assert_eq!(again, got);
            for h in 0..g {
                let mut want = vec![0f32; d];
                attend_ref(&q[h * d..(h + 1) * d], hist(&keys, &values, n, stride, offset), 0.125, &mut want);
                for (a, b) in got[h * d..(h + 1) * d].iter().zip(&want) {
                    assert!((a - b).abs() <= 1e-5 * (1.0 + b.abs()), "stride {stride} head {h}: {a} vs {b}");
                }
            }
        }
    }

    #[test]
    fn an_f16_history_gives_the_attention_of_its_values_in_f32() {
        // Converting f16 to f32 is exact, so an f16 cache attends exactly as an f32 cache
        // holding the same (rounded) values: the same bits where the AVX2 path runs it.
        for (d, g, n) in [(64usize, 3usize, 1usize), (64, 3, 77), (128, 2, 300), (256, 1, 9)] {
            let k16: Vec<f16> = data(n * d, 21).iter().map(|&v| f16::from_f32(v)).collect();
            let v16: Vec<f16> = data(n * d, 22).iter().map(|&v| f16::from_f32(v)).collect();
            let (k32, v32): (Vec<f32>, Vec<f32>) =
                (k16.iter().map(|v| v.to_f32()).collect(), v16.iter().map(|v| v.to_f32()).collect());
            let q = data(g * d, 23);
            let mut s = vec![0f32; g * n];
            let (mut a, mut b) = (vec![0f32; g * d], vec![0f32; g * d]);
            attend_group(
                &q,
                d,
                History {
                    keys: &k16,
                    values: &v16,
                    key_scales: RowScales::None,
                    value_scales: RowScales::None,
                    n,
                    stride: d,
                    offset: 0,
                },
                0.1,
                &mut s,
                &mut a,
            );
            attend_group(&q, d, hist(&k32, &v32, n, d, 0), 0.1, &mut s, &mut b);
            if crate::simd::has_f16c() {
                assert_eq!(a, b, "d={d} g={g} n={n}");
            }
            for (x, y) in a.iter().zip(&b) {
                assert!((x - y).abs() <= 1e-5 * (1.0 + y.abs()), "d={d} g={g} n={n}: {x} vs {y}");
            }
            for h in 0..g {
                let mut want = vec![0f32; d];
                attend_ref(
                    &q[h * d..(h + 1) * d],
                    History {
                        keys: &k16,
                        values: &v16,
                        key_scales: RowScales::None,
                        value_scales: RowScales::None,
                        n,
                        stride: d,
                        offset: 0,
                    },
                    0.1,
                    &mut want,
                );
                for (x, y) in a[h * d..(h + 1) * d].iter().zip(&want) {
                    assert!((x - y).abs() <= 1e-5 * (1.0 + y.abs()), "d={d} g={g} n={n} head {h}: {x} vs {y}");
                }
            }
        }
    }

    #[test]
    fn int8_values_with_row_scales_attend_as_their_dequantized_values() {
        // f16 keys, int8 value codes with one scale per row (the V8 cache): the attention of
        // the f32 history holding `scale_j · code_j`, on the SIMD and the scalar path, over
        // one part and several (the scales must follow each part's rows).
        for (d, g, n) in [(64usize, 3usize, 1usize), (64, 3, 77), (128, 2, 300), (256, 1, 9), (8, 1, 700)] {
            let k16: Vec<f16> = data(n * d, 31).iter().map(|&v| f16::from_f32(v)).collect();
            let raw = data(n * d, 32);
            let scales: Vec<f32> = (0..n).map(|j| 0.002 + 0.01 * (j % 7) as f32).collect();
            let codes: Vec<i8> = raw.iter().enumerate().map(|(i, &v)| i8::from_f32(v / scales[i / d] * 40.0)).collect();
            let deq: Vec<f32> = codes.iter().enumerate().map(|(i, &c)| scales[i / d] * c as f32).collect();
            let k32: Vec<f32> = k16.iter().map(|v| v.to_f32()).collect();
            let q = data(g * d, 33);
            let mut s = vec![0f32; g * n];
            let (mut a, mut b) = (vec![0f32; g * d], vec![0f32; g * d]);
            let v8 = History {
                keys: &k16[..],
                values: &codes[..],
                key_scales: RowScales::None,
                value_scales: RowScales::F32(&scales),
                n,
                stride: d,
                offset: 0,
            };
            attend_group(&q, d, v8, 0.1, &mut s, &mut a);
            attend_group(&q, d, hist(&k32, &deq, n, d, 0), 0.1, &mut s, &mut b);
            for (x, y) in a.iter().zip(&b) {
                assert!((x - y).abs() <= 1e-5 * (1.0 + y.abs()), "d={d} g={g} n={n}: {x} vs {y}");
            }
            for h in 0..g {
                let mut want = vec![0f32; d];
                attend_ref(&q[h * d..(h + 1) * d], v8, 0.1, &mut want);
                for (x, y) in a[h * d..(h + 1) * d].iter().zip(&want) {
                    assert!((x - y).abs() <= 1e-5 * (1.0 + y.abs()), "d={d} g={g} n={n} head {h}: {x} vs {y}");
                }
            }
        }
        // A wrong scale (one row's scale dropped) is seen.
        let (d, n) = (64, 40);
        let k: Vec<f32> = data(n * d, 34);
        let codes: Vec<i8> = data(n * d, 35).iter().map(|&v| i8::from_f32(v * 100.0)).collect();
        let mut scales = vec![0.01f32; n];
        let q: Vec<f32> = vec![0.0; d];
        let (mut s, mut a, mut b) = (vec![0f32; n], vec![0f32; d], vec![0f32; d]);
        attend_group(
            &q,
            d,
            History {
                keys: &k[..],
                values: &codes[..],
                key_scales: RowScales::None,
                value_scales: RowScales::F32(&scales),
                n,
                stride: d,
                offset: 0,
            },
            1.0,
            &mut s,
            &mut a,
        );
        scales[n / 2] = 0.0;
        attend_group(
            &q,
            d,
            History {
                keys: &k[..],
                values: &codes[..],
                key_scales: RowScales::None,
                value_scales: RowScales::F32(&scales),
                n,
                stride: d,
                offset: 0,
            },
            1.0,
            &mut s,
            &mut b,
        );
        assert!(a.iter().zip(&b).any(|(x, y)| (x - y).abs() > 1e-4));
    }

    /// How far float rounding of the scores may move each output channel: to first order,
    /// d out_c / d s_j = p_j (v_jc − out_c), with each score off by up to 2ε·scale·Σ_i |q_i k_ji|
    /// between two summation orders (the kernels' lanes against the reference's; the measured
    /// difference stays under half that). Large keys (KV8 rows with big scales) make sharp
    /// softmaxes whose outputs differ between summation orders by more than a fixed tolerance.
    fn score_rounding_sensitivity(
        q: &[f32],
        keys: &[f32],
        values: &[f32],
        n: usize,
        stride: usize,
        offset: usize,
        scale: f32,
    ) -> Vec<f32> {
        let d = q.len();
        let at = |j: usize| j * stride + offset..j * stride + offset + d;
        let (mut s, mut mag) = (vec![0f64; n], vec![0f64; n]);
        for j in 0..n {
            for (a, b) in q.iter().zip(&keys[at(j)]) {
                s[j] += (*a as f64) * (*b as f64) * scale as f64;
                mag[j] += ((*a as f64) * (*b as f64)).abs() * scale as f64;
            }
        }
        let top = s.iter().cloned().fold(f64::MIN, f64::max);
        let e: Vec<f64> = s.iter().map(|x| (x - top).exp()).collect();
        let z: f64 = e.iter().sum();
        let eps = 2.0 * f32::EPSILON as f64;
        (0..d)
            .map(|c| {
                let out: f64 = (0..n).map(|j| e[j] / z * values[at(j)][c] as f64).sum();
                let t: f64 = (0..n).map(|j| e[j] / z * (values[at(j)][c] as f64 - out).abs() * eps * mag[j]).sum();
                t as f32
            })
            .collect()
    }

    #[test]
    fn kv8_history_attends_as_its_dequantized_keys_and_values() {
        // int8 keys and values with one f16 scale per row each (the KV8 cache), read as codes:
        // the attention of the f32 history holding `scale_j · code_j` (dequantize, then attend)
        // within float rounding, on the SIMD and the scalar path (d = 36), over one part and
        // several, a head alone in its rows and at an offset in rows of two heads; decode's
        // parts (rows asked for ahead) merged give the same bits as one call.
        for (d, g, n) in [(64usize, 3usize, 1usize), (64, 3, 77), (128, 2, 300), (256, 1, 9), (8, 1, 700), (36, 2, 50)]
        {
            for (stride, offset) in [(d, 0), (2 * d, d)] {
                let codes = |seed: u32| -> Vec<i8> {
                    data(n * stride, seed).iter().map(|&v| i8::from_f32(v * 127.0)).collect()
                };
                let (kc, vc) = (codes(41), codes(42));
                // Scales over two orders of magnitude, and an all-zero row (scale 0).
                let scales = |a: f32| -> Vec<f16> {
                    (0..n)
                        .map(|j| {
                            f16::from_f32(if j == n / 2 && n > 1 { 0.0 } else { a * (1.0 + (j % 11) as f32 * 9.0) })
                        })
                        .collect()
                };
                let (ks, vs) = (scales(0.004), scales(0.003));
                let deq = |c: &[i8], s: &[f16]| -> Vec<f32> {
                    c.iter().enumerate().map(|(i, &x)| s[i / stride].to_f32() * x as f32).collect()
                };
                let (kf, vf) = (deq(&kc, &ks), deq(&vc, &vs));
                let q = data(g * d, 43);
                let scale = 1.0 / (d as f32).sqrt();
                let kv8 = History {
                    keys: &kc[..],
                    values: &vc[..],
                    key_scales: RowScales::F16(&ks),
                    value_scales: RowScales::F16(&vs),
                    n,
                    stride,
                    offset,
                };
                let mut s = vec![0f32; g * n];
                let (mut a, mut b) = (vec![0f32; g * d], vec![0f32; g * d]);
                attend_group(&q, d, kv8, scale, &mut s, &mut a);
                attend_group(&q, d, hist(&kf, &vf, n, stride, offset), scale, &mut s, &mut b);
                for h in 0..g {
                    let qh = &q[h * d..(h + 1) * d];
                    let mut want = vec![0f32; d];
                    attend_ref(qh, hist(&kf, &vf, n, stride, offset), scale, &mut want);
                    let mut want8 = vec![0f32; d];
                    attend_ref(qh, kv8, scale, &mut want8);
                    let sensitivity = score_rounding_sensitivity(qh, &kf, &vf, n, stride, offset, scale);
                    for c in 0..d {
                        let (x, y, z, w) = (a[h * d + c], b[h * d + c], want[c], want8[c]);
                        let tol = 2e-5 * (1.0 + y.abs()) + sensitivity[c];
                        for (other, what) in [(y, "f32 history"), (z, "definition"), (w, "definition on codes")] {
                            assert!(
                                (x - other).abs() <= tol,
                                "d={d} g={g} n={n} stride {stride} head {h} [{c}]: {x} vs {other} ({what})"
                            );
                        }
                    }
                }
                let parts = n_parts(n);
                let slot = g * d + 2 * g;
                let mut slots = vec![0f32; parts * slot];
                for p in (0..parts).rev() {
                    let (o, st) = slots[p * slot..(p + 1) * slot].split_at_mut(g * d);
                    attend_part(&q, d, kv8.part(p), scale, &mut s, o, st, true);
                }
                let mut merged = vec![0f32; g * d];
                merge_parts(g, &slots, &mut merged);
                assert_eq!(merged, a, "d={d} g={g} n={n} stride {stride}: parts");
            }
        }
        // A key's scale is applied: one row's scale changed moves the output.
        let (d, n) = (64, 40);
        let kc: Vec<i8> = data(n * d, 44).iter().map(|&v| i8::from_f32(v * 127.0)).collect();
        let vc: Vec<i8> = data(n * d, 45).iter().map(|&v| i8::from_f32(v * 127.0)).collect();
        let vs = vec![f16::from_f32(0.01); n];
        let mut ks = vec![f16::from_f32(0.01); n];
        let q = data(d, 46);
        let (mut s, mut a, mut b) = (vec![0f32; n], vec![0f32; d], vec![0f32; d]);
        let run = |ks: &[f16], s: &mut [f32], out: &mut [f32]| {
            let kv = History {
                keys: &kc[..],
                values: &vc[..],
                key_scales: ks.into(),
                value_scales: RowScales::F16(&vs),
                n,
                stride: d,
                offset: 0,
            };
            attend_group(&q, d, kv, 1.0, s, out)
        };
        run(&ks, &mut s, &mut a);
        ks[n / 2] = f16::from_f32(0.5);
        run(&ks, &mut s, &mut b);
        assert!(a.iter().zip(&b).any(|(x, y)| (x - y).abs() > 1e-4));
    }

    /// Inputs at the edges of f32 within the domain `attend_part` states: finite outputs within
    /// rounding of the f64 definition, on the AVX2 path (head size a multiple of 8) and the
    /// portable one (not), in one part and in several merged.
    #[test]
    fn attention_is_finite_at_the_edges_of_f32() {
        for d in [64usize, 36] {
            for n in [20usize, 100] {
                let (bq, bk, bv) = (data(d, 3), data(n * d, 1), data(n * d, 2));
                let times = |v: &[f32], s: f32| v.iter().map(|x| x * s).collect::<Vec<f32>>();
                let mixed: Vec<f32> =
                    bv.iter().enumerate().map(|(i, v)| v * 10f32.powi((i % 77) as i32 - 38)).collect();
                // (name, q, keys, values)
                let cases: Vec<(&str, [Vec<f32>; 3])> = vec![
                    ("subnormal values", [bq.clone(), bk.clone(), times(&bv, 1e-40)]),
                    ("tiny scores and values", [times(&bq, 1e-20), times(&bk, 1e-20), times(&bv, 1e-38)]),
                    ("huge scores", [times(&bq, 1e15), times(&bk, 1e15), bv.clone()]),
                    ("huge values", [bq.clone(), bk.clone(), times(&bv, f32::MAX / (4 * n) as f32)]),
                    ("mixed values", [bq.clone(), bk.clone(), mixed]),
                ];
                for (name, [q, k, v]) in &cases {
                    let scale = 0.125f32;
                    let s: Vec<f64> = (0..n)
                        .map(|j| {
                            let dot: f64 =
                                q.iter().zip(&k[j * d..(j + 1) * d]).map(|(&a, &b)| a as f64 * b as f64).sum();
                            dot * scale as f64
                        })
                        .collect();
                    let m = s.iter().fold(f64::NEG_INFINITY, |a, &b| a.max(b));
                    let p: Vec<f64> = s.iter().map(|&x| (x - m).exp()).collect();
                    let l: f64 = p.iter().sum();
                    let mut sc = vec![0f32; n];
                    let mut got = vec![f32::NAN; d];
                    attend_group(q, d, hist(k, v, n, d, 0), scale, &mut sc, &mut got);
                    for (c, &g) in got.iter().enumerate() {
                        let want: f64 = (0..n).map(|j| p[j] / l * v[j * d + c] as f64).sum();
                        let mag: f64 = (0..n).map(|j| p[j] / l * (v[j * d + c] as f64).abs()).sum();
                        // f32 rounding of the weights and sums, and of subnormal products.
                        let tol = 1e-5 * mag + n as f64 * f32::from_bits(1) as f64;
                        assert!(
                            g.is_finite() && (g as f64 - want).abs() <= tol,
                            "{name} d={d} n={n} [{c}]: {g} vs {want}"
                        );
                    }
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
