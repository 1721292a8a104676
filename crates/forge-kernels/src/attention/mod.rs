//! Causal attention of one query head over a key/value history.
//!
//! The AVX2 path scores eight keys at a time (eight accumulators reduced together with
//! horizontal adds, instead of one horizontal sum per key) and keeps the output in registers
//! while it walks the values (64 columns at a time). The query heads that share a key/value head
//! (GQA) go together, so each key and value row is read from memory once per group. A long
//! history is cut into parts that workers take separately and that are merged afterwards
//! (as in flash-decoding), so that decode's few key/value heads still give every worker work.
//! A history may lie in pages ([`PagedHistory`]): a part is then taken page by page, with the
//! bits of the same rows held in one piece. Int8 keys (the KV8 cache) are scored in integers
//! (`int_keys`); values are summed in f32 (AVX2, and 512-bit sums where AVX-512 is present).

mod int_keys;
mod paged;
mod tile;
#[cfg(target_arch = "x86_64")]
mod values512;
pub use paged::{PagedHistory, PagedScales};
pub use tile::attend_tokens;

use crate::act::softmax;
use crate::simd::{axpy, dot, dot_ref};
use half::f16;

/// An element of a key/value cache: f32, or f16 (half the bytes to read per token, converted to
/// f32 exactly as it is loaded; every product and sum stays f32).
pub trait KvElem: Copy + Send + Sync + 'static {
    /// Stored as f32 already: nothing to widen, rows are read in place.
    const IS_F32: bool = false;
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
    /// Sixteen elements at `p` as f32 lanes.
    ///
    /// # Safety
    /// AVX-512 F must be present and sixteen elements readable at `p`.
    #[cfg(target_arch = "x86_64")]
    unsafe fn load16(p: *const Self) -> std::arch::x86_64::__m512;
    /// The elements as int8 codes, where they are (the KV8 cache's keys, scored in integers).
    fn codes(x: &[Self]) -> Option<&[i8]> {
        let _ = x;
        None
    }
}

impl KvElem for f32 {
    const IS_F32: bool = true;
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
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load16(p: *const f32) -> std::arch::x86_64::__m512 {
        // SAFETY: sixteen f32 are readable at `p` and AVX-512 F is present (the caller's contract).
        unsafe { std::arch::x86_64::_mm512_loadu_ps(p) }
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
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load16(p: *const f16) -> std::arch::x86_64::__m512 {
        use std::arch::x86_64::*;
        // SAFETY: sixteen f16 (32 bytes) are readable at `p` and AVX-512 F is present (the
        // caller's contract).
        unsafe { _mm512_cvtph_ps(_mm256_loadu_si256(p as *const __m256i)) }
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
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load16(p: *const i8) -> std::arch::x86_64::__m512 {
        use std::arch::x86_64::*;
        // SAFETY: sixteen bytes are readable at `p` and AVX-512 F is present (the caller's
        // contract).
        unsafe { _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(p as *const __m128i))) }
    }
    fn codes(x: &[i8]) -> Option<&[i8]> {
        Some(x)
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

/// Floats of the L1 buffer the AVX2 kernels widen a block of f16 or int8 rows into (8 KiB: eight
/// key rows of up to 256 values, or 32 value rows of 64 columns).
#[cfg(target_arch = "x86_64")]
const STAGE: usize = 2048;

/// Sets up this thread's scratch for integer attention (KV8), room for groups of up to 16
/// heads of 256: every worker of a pool runs it when a team first forms there
/// ([`crate::team::with_team`]), so that decode allocates nothing once warm, whichever worker
/// takes its first attention item late (a thread-local's first use allocates).
pub fn prepare_thread() {
    int_keys::with_kept_codes(|qc| qc.reserve(16 * 256, 16));
}

/// How many of a run's `rn` weights (from column `col` of its row) row `h` sums: all, or those
/// before column `lim[h]` (prefill's tiles, each token's rows ending at its own position).
fn run_end(lim: Option<&[usize]>, h: usize, col: usize, rn: usize) -> usize {
    lim.map_or(rn, |l| l[h].saturating_sub(col).min(rn))
}

/// Fewest history rows in a part (see [`part_len`]).
const MIN_PART: usize = 32;
/// Most rows in a part: a part's value rows, asked for while its keys are scored, are still in
/// L2 when they are summed (1,024 rows of the 27B shape's KV8 heads are 256 KiB of values).
const MAX_PART: usize = 1024;
/// Parts a history is cut into up to `MAX_PARTS · MAX_PART` rows.
const MAX_PARTS: usize = 16;

impl<K: KvElem, V: KvElem> Clone for History<'_, K, V> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<K: KvElem, V: KvElem> Copy for History<'_, K, V> {}

/// Rows per part when attention over a history of `n` rows is cut into parts that workers take
/// separately ([`attend_part`], then [`merge_parts`]): a multiple of eight (the keys are scored
/// eight at a time), at least 32 and at most 1,024 rows, at most 16 parts up to 16,384 rows. It
/// depends on `n` alone, so a query gives the same bits however the work is spread (decode,
/// verify or prefill, any thread count).
pub fn part_len(n: usize) -> usize {
    n.div_ceil(MAX_PARTS).next_multiple_of(8).clamp(MIN_PART, MAX_PART)
}

/// How many parts a history of `n` rows is cut into (one for an empty history).
pub fn n_parts(n: usize) -> usize {
    n.max(1).div_ceil(part_len(n))
}

/// A history whose rows lie in runs of contiguous memory: one run for a [`History`], a page
/// each for a paged cache ([`PagedHistory`]). Attention walks a part of it run by run; as long
/// as every run starts at a multiple of eight rows (the keys are scored eight at a time) the
/// result has the same bits however the rows are cut into runs.
pub trait Runs<'a, K: KvElem, V: KvElem>: Copy {
    /// Rows in the history.
    fn rows(&self) -> usize;
    /// Rows `j0..` as a contiguous history of their own: as many as lie together, at most
    /// `j1 − j0` (and at least one, for `j0 < j1 ≤ rows`).
    fn run(&self, j0: usize, j1: usize) -> History<'a, K, V>;
}

impl<'a, K: KvElem, V: KvElem> Runs<'a, K, V> for History<'a, K, V> {
    fn rows(&self) -> usize {
        self.n
    }

    fn run(&self, j0: usize, j1: usize) -> History<'a, K, V> {
        let j0 = j0.min(self.n);
        let skip = j0 * self.stride;
        History {
            keys: &self.keys[skip.min(self.keys.len())..],
            values: &self.values[skip.min(self.values.len())..],
            key_scales: self.key_scales.skip(j0),
            value_scales: self.value_scales.skip(j0),
            n: j1.min(self.n).saturating_sub(j0),
            ..*self
        }
    }
}

/// Rows of part `p` of a history of `n` rows (see [`part_len`]); empty past the last part.
pub fn part_rows(n: usize, p: usize) -> std::ops::Range<usize> {
    let len = part_len(n);
    (p * len).min(n)..((p + 1) * len).min(n)
}

/// `out_h = softmax(q_h·Kᵀ·scale) V` over the rows of the history, for the `g = q.len() / d`
/// query heads that share one key/value head (grouped-query attention; `g = 1` for plain
/// attention), `q` and `out` holding them one after the other: each key and value row is read
/// from memory once for the whole group. The history is taken in [`n_parts`] parts and merged,
/// as the model's parallel paths do, so this gives their bits.
///
/// `scores` is scratch of at least `g · part_len(n)` floats.
pub fn attend_group<'a, K: KvElem, V: KvElem>(
    q: &[f32],
    d: usize,
    kv: impl Runs<'a, K, V>,
    scale: f32,
    scores: &mut [f32],
    out: &mut [f32],
) {
    assert!(d > 0 && q.len().is_multiple_of(d), "{} query values are not whole heads of {d}", q.len());
    let g = q.len() / d;
    assert!(out.len().is_multiple_of(g), "output of {} values for {g} heads", out.len());
    let n = kv.rows();
    let (parts, slot) = (n_parts(n), out.len() + 2 * g);
    // Every part writes its whole slot (an empty one zeros and `(−∞, 0)`).
    let mut slots = crate::scratch::Buf::for_overwrite(parts * slot);
    for (p, sl) in slots.chunks_mut(slot).enumerate() {
        let (o, st) = sl.split_at_mut(out.len());
        attend_rows(q, d, kv, part_rows(n, p), scale, scores, o, st, false);
    }
    merge_parts(g, &slots, out);
}

impl<'a, K: KvElem, V: KvElem> History<'a, K, V> {
    /// Part `p` of [`n_parts`]`(self.n)`: its rows as a history of their own.
    pub fn part(&self, p: usize) -> History<'a, K, V> {
        let r = part_rows(self.n, p);
        self.run(r.start, r.end)
    }
}

/// [`attend_rows`] over the whole of a contiguous history.
#[allow(clippy::too_many_arguments)]
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
    attend_rows(q, d, kv, 0..kv.n, scale, scores, out, stats, ahead)
}

/// One part of [`attend_group`], rows `rows` of the history: for each of the `g` heads,
/// `out_h = Σ_j e^(s_hj − m_h) V_j` over those rows (not yet normalized) and
/// `stats[2h..2h + 2] = (m_h, Σ_j e^(s_hj − m_h))`, `m_h` the largest score. No rows give zeros
/// and `(−∞, 0)`. The rows are taken run by run ([`Runs`]); the softmax statistics are of the
/// whole part.
///
/// With `ahead` (decode and verify, whose history comes from L3 or memory once a token; x86-64
/// only) the key rows are asked for a block ahead and the value rows while their scores are
/// taken. The longer the history, the more it pays: SmolLM2's decode after 1024 tokens runs
/// about 1.14× as fast with it, after 64 no faster. Prefill, whose consecutive tokens find the
/// history in L2, gains nothing from it, so [`attend_group`] does not ask.
///
/// `scores` is scratch of at least `g · rows.len()` floats, `stats` holds `2g`.
///
/// Finite inputs give finite outputs wherever the products `q·k` and the scores are finite and
/// `n · max|v|` is (the values are summed before they are normalized): tiny and subnormal
/// inputs included; any f16 or int8 cache.
#[allow(clippy::too_many_arguments)]
pub fn attend_rows<'a, K: KvElem, V: KvElem>(
    q: &[f32],
    d: usize,
    kv: impl Runs<'a, K, V>,
    rows: std::ops::Range<usize>,
    scale: f32,
    scores: &mut [f32],
    out: &mut [f32],
    stats: &mut [f32],
    ahead: bool,
) {
    assert!(d > 0 && q.len().is_multiple_of(d), "{} query values are not whole heads of {d}", q.len());
    let g = q.len() / d;
    assert!(out.len().is_multiple_of(g), "output of {} values for {g} heads", out.len());
    let dv = out.len() / g;
    assert!(rows.start <= rows.end && rows.end <= kv.rows(), "rows {rows:?} of a history of {}", kv.rows());
    let n = rows.len();
    assert!(scores.len() >= g * n, "scores has {} slots for {g}×{n}", scores.len());
    assert!(stats.len() >= 2 * g, "stats has {} slots for {g} heads", stats.len());
    let scores = &mut scores[..g * n];
    let part = Part { d, dv, j0: rows.start, j1: rows.end, s_stride: n };
    if K::codes(&[]).is_some() {
        int_keys::with_query_codes(q, d, scale, |qc| part.scores(q, qc, kv, scale, scores, ahead));
    } else {
        part.scores(q, None, kv, scale, scores, ahead);
    }
    for h in 0..g {
        (stats[2 * h], stats[2 * h + 1]) = exp_shifted(&mut scores[h * n..(h + 1) * n]);
    }
    out.iter_mut().for_each(|o| *o = 0.0);
    part.values(kv, scores, out, None);
}

/// Rows `j0..j1` of a history attended by the rows of `q` (heads of `d`, values of `dv`), their
/// scores `s_stride` apart: the steps of [`attend_rows`], shared with prefill's tiles.
#[derive(Clone, Copy)]
struct Part {
    d: usize,
    dv: usize,
    j0: usize,
    j1: usize,
    s_stride: usize,
}

impl Part {
    /// Whether the AVX2 kernels apply (x86-64 with F16C, heads a multiple of eight).
    fn simd(&self) -> bool {
        #[cfg(target_arch = "x86_64")]
        return crate::simd::has_f16c() && self.d.is_multiple_of(8) && self.dv.is_multiple_of(8);
        #[cfg(not(target_arch = "x86_64"))]
        false
    }

    /// The runs of the part, each checked against the rows it claims, with its first row's
    /// column in the scores.
    fn runs<'a, K: KvElem, V: KvElem>(
        &self,
        kv: impl Runs<'a, K, V>,
    ) -> impl Iterator<Item = (History<'a, K, V>, usize)> {
        let Part { d, dv, j0, j1, .. } = *self;
        let mut j = j0;
        std::iter::from_fn(move || {
            (j < j1).then(|| {
                let r = kv.run(j, j1);
                assert!(r.n > 0 && r.n <= j1 - j, "a run of {} rows at row {j} of {j0}..{j1}", r.n);
                let last = (r.n - 1) * r.stride + r.offset;
                assert!(r.keys.len() >= last + d && r.values.len() >= last + dv, "history shorter than its rows");
                assert!(r.value_scales.is_none() || r.value_scales.len() >= r.n, "value scales short of the rows");
                assert!(r.key_scales.is_none() || r.key_scales.len() >= r.n, "key scales short of the rows");
                let col = j - j0;
                j += r.n;
                (r, col)
            })
        })
    }

    /// Every row of `q`'s score of every history row of the part, its key's scale on it. Int8
    /// keys are scored in integers against the query as 16-bit codes (`qc`, see `int_keys`).
    /// With `ahead` (x86-64), the next key rows and this block's value rows are asked for.
    #[allow(clippy::too_many_arguments)]
    #[cfg_attr(not(target_arch = "x86_64"), allow(unused_variables))]
    fn scores<'a, K: KvElem, V: KvElem>(
        &self,
        q: &[f32],
        qc: Option<&int_keys::QueryCodes>,
        kv: impl Runs<'a, K, V>,
        scale: f32,
        scores: &mut [f32],
        ahead: bool,
    ) {
        let Part { d, dv, s_stride, .. } = *self;
        let g = q.len() / d;
        let simd = self.simd();
        for (r, col) in self.runs(kv) {
            if let (Some(qc), Some(codes)) = (qc, K::codes(r.keys)) {
                let vals = &r.values[r.offset..];
                let ahead = (cfg!(target_arch = "x86_64") && ahead)
                    .then(|| (vals.as_ptr() as *const u8, r.stride * size_of::<V>(), dv * size_of::<V>()));
                int_keys::scores(qc, codes, r.n, r.stride, r.offset, scores, s_stride, col, ahead);
            } else if simd {
                #[cfg(target_arch = "x86_64")]
                // SAFETY: AVX2/FMA/F16C are present; the run's rows were checked by `runs` (r.n
                // rows of `stride`, `d` / `dv` values at `offset`, also those asked for ahead),
                // and the run writes columns col..col + r.n of each row's `s_stride` scores.
                unsafe {
                    assert!(scores.len() >= (g - 1) * s_stride + col + r.n, "scores shorter than their rows");
                    scores_avx2(
                        q,
                        d,
                        r.keys,
                        r.n,
                        r.stride,
                        r.offset,
                        scale,
                        scores,
                        s_stride,
                        col,
                        ahead.then_some((r.values, dv)),
                    )
                };
            } else {
                for h in 0..g {
                    let qh = &q[h * d..(h + 1) * d];
                    let row = &mut scores[h * s_stride + col..h * s_stride + col + r.n];
                    for (jj, s) in row.iter_mut().enumerate() {
                        let k0 = jj * r.stride + r.offset;
                        *s = K::dot(qh, &r.keys[k0..k0 + d]) * scale;
                    }
                }
            }
            if !r.key_scales.is_none() {
                for h in 0..g {
                    r.key_scales.apply(&mut scores[h * s_stride + col..h * s_stride + col + r.n]);
                }
            }
        }
    }

    /// `out_h += Σ_j w_hj s_j V_j` over the part's rows for each of the `out.len() / dv` rows of
    /// weights `w` (`s_stride` apart; row `h` only up to column `lim[h]` where given), `s_j` the
    /// value scales, which go onto the weights here (after the softmax statistics, which are of
    /// the weights alone): run after run, into one sum per column.
    fn values<'a, K: KvElem, V: KvElem>(
        &self,
        kv: impl Runs<'a, K, V>,
        w: &mut [f32],
        out: &mut [f32],
        lim: Option<&[usize]>,
    ) {
        let Part { dv, s_stride, .. } = *self;
        let g = out.len() / dv;
        let simd = self.simd();
        for (r, col) in self.runs(kv) {
            if !r.value_scales.is_none() {
                for h in 0..g {
                    r.value_scales.apply(&mut w[h * s_stride + col..h * s_stride + col + r.n]);
                }
            }
        }
        for (r, col) in self.runs(kv) {
            if simd {
                #[cfg(target_arch = "x86_64")]
                {
                    assert!(w.len() >= (g - 1) * s_stride + col + r.n, "weights shorter than their rows");
                    if dv.is_multiple_of(16) && crate::simd::has_avx512f() {
                        // SAFETY: as for the scores, with AVX-512 F present and `dv` a multiple
                        // of 16.
                        unsafe {
                            values512::values_avx512(w, g, s_stride, col, r.n, r.values, r.stride, r.offset, out, lim)
                        };
                    } else {
                        // SAFETY: as for the scores: AVX2/FMA/F16C present, the run's value rows
                        // checked, `w` holds g rows of s_stride weights and `out` g·dv values.
                        unsafe { values_avx2(w, g, s_stride, col, r.n, r.values, r.stride, r.offset, out, lim) };
                    }
                }
            } else {
                for h in 0..g {
                    let oh = &mut out[h * dv..(h + 1) * dv];
                    let end = run_end(lim, h, col, r.n);
                    for (jj, &p) in w[h * s_stride + col..h * s_stride + col + end].iter().enumerate() {
                        let v0 = jj * r.stride + r.offset;
                        V::axpy(p, &r.values[v0..v0 + dv], oh);
                    }
                }
            }
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
/// for the next block's key rows and its own value rows. Head `h`'s score of row `j` goes to
/// `s[h · s_stride + col + j]`.
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
    s_stride: usize,
    col: usize,
    ahead: Option<(&[V], usize)>,
) {
    use std::arch::x86_64::*;
    let g = q.len() / d;
    let kp = keys.as_ptr().add(offset);
    // With several heads, eight widened key rows are written once to an L1 buffer that every
    // head then reads, instead of each head widening them again (at the 27B shape's six heads
    // a group, widening was most of the work). The products are the same f32 ones either way.
    let mut staged = [std::mem::MaybeUninit::<f32>::uninit(); STAGE];
    let stage = g > 1 && !T::IS_F32 && 8 * d <= STAGE;
    let sp = staged.as_mut_ptr() as *mut f32;
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
        if stage {
            for r in 0..8 {
                for c in (0..d).step_by(8) {
                    _mm256_storeu_ps(sp.add(r * d + c), T::load8(kp.add((j + r) * stride + c)));
                }
            }
        }
        for h in 0..g {
            let qp = q.as_ptr().add(h * d);
            let mut acc = [_mm256_setzero_ps(); 8];
            for c in (0..d).step_by(8) {
                let qv = _mm256_loadu_ps(qp.add(c));
                for (r, a) in acc.iter_mut().enumerate() {
                    let k =
                        if stage { _mm256_loadu_ps(sp.add(r * d + c)) } else { T::load8(kp.add((j + r) * stride + c)) };
                    *a = _mm256_fmadd_ps(qv, k, *a);
                }
            }
            // Horizontal sums of the eight accumulators: lane r of the result is key j + r.
            let u0 = _mm256_hadd_ps(_mm256_hadd_ps(acc[0], acc[1]), _mm256_hadd_ps(acc[2], acc[3]));
            let u1 = _mm256_hadd_ps(_mm256_hadd_ps(acc[4], acc[5]), _mm256_hadd_ps(acc[6], acc[7]));
            let sum = _mm256_add_ps(_mm256_permute2f128_ps::<0x20>(u0, u1), _mm256_permute2f128_ps::<0x31>(u0, u1));
            _mm256_storeu_ps(s.as_mut_ptr().add(h * s_stride + col + j), _mm256_mul_ps(sum, _mm256_set1_ps(scale)));
        }
        j += 8;
    }
    // The last keys one at a time, each lane's products and the sum of the lanes in the order
    // of a block's (so a key's score has the same bits wherever it lies in a run: prefill's
    // tiles score past a token's last row what decode scores as its last).
    for jj in j..n {
        for h in 0..g {
            let mut acc = _mm256_setzero_ps();
            for c in (0..d).step_by(8) {
                acc =
                    _mm256_fmadd_ps(_mm256_loadu_ps(q.as_ptr().add(h * d + c)), T::load8(kp.add(jj * stride + c)), acc);
            }
            let mut l = [0f32; 8];
            _mm256_storeu_ps(l.as_mut_ptr(), acc);
            s[h * s_stride + col + jj] = (((l[0] + l[1]) + (l[2] + l[3])) + ((l[4] + l[5]) + (l[6] + l[7]))) * scale;
        }
    }
}

/// `out_h += Σ_j p_h[col + j] V_j` over the run's `rn` rows, for every head of the group
/// (`p` holds `g` rows of `n` weights): 64 output columns (eight registers) per sweep; with
/// several heads the keys go in blocks of 32 whose value rows stay in L1 while each head adds
/// its share. The sums go on from what `out` holds, one row after the other, so a history
/// taken in runs gives the bits of one taken whole. With `lim`, head `h` stops before weight
/// `lim[h]` of its `n` (prefill's tiles: each token's rows end at its own position).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
#[allow(clippy::too_many_arguments)]
unsafe fn values_avx2<T: KvElem>(
    p: &[f32],
    g: usize,
    n: usize,
    col: usize,
    rn: usize,
    values: &[T],
    stride: usize,
    offset: usize,
    out: &mut [f32],
    lim: Option<&[usize]>,
) {
    use std::arch::x86_64::*;
    let dv = out.len() / g.max(1);
    let vp = values.as_ptr().add(offset);
    let block = if g == 1 { rn.max(1) } else { 32 };
    // As for the keys: a block's widened value columns written once for all heads.
    let mut staged = [std::mem::MaybeUninit::<f32>::uninit(); STAGE];
    let stage = g > 1 && !T::IS_F32 && 32 * 64 <= STAGE;
    let sp = staged.as_mut_ptr() as *mut f32;
    for c0 in (0..dv).step_by(64) {
        let w = (dv - c0).min(64) / 8;
        for j0 in (0..rn).step_by(block) {
            let j1 = (j0 + block).min(rn);
            if stage {
                for j in j0..j1 {
                    for k in 0..w {
                        _mm256_storeu_ps(sp.add((j - j0) * 64 + 8 * k), T::load8(vp.add(j * stride + c0 + 8 * k)));
                    }
                }
            }
            for h in 0..g {
                let j1 = j1.min(run_end(lim, h, col, rn));
                if j1 <= j0 {
                    continue;
                }
                let o = out.as_mut_ptr().add(h * dv + c0);
                let mut acc = [_mm256_setzero_ps(); 8];
                for (k, a) in acc.iter_mut().enumerate().take(w) {
                    *a = _mm256_loadu_ps(o.add(8 * k));
                }
                for j in j0..j1 {
                    let pv = _mm256_set1_ps(p[h * n + col + j]);
                    let row = vp.add(j * stride + c0);
                    for (k, a) in acc.iter_mut().enumerate().take(w) {
                        let v = if stage {
                            _mm256_loadu_ps(sp.add((j - j0) * 64 + 8 * k))
                        } else {
                            T::load8(row.add(8 * k))
                        };
                        *a = _mm256_fmadd_ps(pv, v, *a);
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
mod tests;
