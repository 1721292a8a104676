//! Scores against int8 key codes (the KV8 cache) in integer arithmetic: each query head is
//! written once as 16-bit integers with one scale (`q ≈ s_q · c`, within `s_q / 2` of every
//! value, `s_q = max|q| / 32767`), and a key's score is the exact integer `Σ c_i k_i` times
//! `s_q · scale` (the key's own scale goes on afterwards, as for any coded key). Integer sums
//! are exact, so every ISA gives the bits of the scalar reference. AVX2 multiplies 16 pairs
//! an instruction (`vpmaddwd`), AVX-512 VNNI 32 with the sum folded in (`vpdpwssd`), against
//! eight f32 multiply-adds on codes widened to f32. At six query heads a KV head (the 27B
//! shape) these instructions, not memory, still set attention's speed on two cores
//! (`examples/attention_probe.rs`).

/// Largest head size whose integer dot cannot overflow: `d · 32767 · 128 < 2³¹`.
const MAX_D: usize = 512;

/// The query heads of a group as 16-bit codes, with `s_q · scale` per head. Held per thread and
/// reused, so that decode allocates nothing once warm.
#[derive(Default)]
pub(super) struct QueryCodes {
    codes: Vec<i16>,
    scales: Vec<f32>,
    d: usize,
    g: usize,
}

thread_local! {
    static KEPT: std::cell::RefCell<Option<QueryCodes>> = const { std::cell::RefCell::new(None) };
}

/// `f` with this thread's [`QueryCodes`] as they are.
pub(super) fn with_kept_codes<R>(f: impl FnOnce(&mut QueryCodes) -> R) -> R {
    crate::scratch::with_kept(&KEPT, f)
}

/// `f` with `q`'s heads of `d` values as this thread's [`QueryCodes`], or with `None` where
/// they cannot be coded (see [`QueryCodes::fill`]).
pub(super) fn with_query_codes<R>(q: &[f32], d: usize, scale: f32, f: impl FnOnce(Option<&QueryCodes>) -> R) -> R {
    crate::scratch::with_kept(&KEPT, |qc| {
        let ok = qc.fill(q, d, scale);
        f(ok.then_some(&*qc))
    })
}

impl QueryCodes {
    /// Room for `n` query values of `g` heads.
    pub(super) fn reserve(&mut self, n: usize, g: usize) {
        self.codes.reserve(n);
        self.scales.reserve(g);
    }

    /// Takes `q`'s heads of `d` values as codes; false where this path does not apply: heads
    /// longer than [`MAX_D`], a value that is not finite, or a head whose largest magnitude is
    /// so small that its step would be subnormal (the float path keeps full precision there).
    pub(super) fn fill(&mut self, q: &[f32], d: usize, scale: f32) -> bool {
        if d > MAX_D || d == 0 {
            return false;
        }
        let g = q.len() / d;
        (self.d, self.g) = (d, g);
        self.codes.clear();
        self.codes.resize(g * d, 0);
        self.scales.clear();
        self.scales.resize(g, 0.0);
        for (h, head) in q.chunks_exact(d).enumerate() {
            if !head.iter().all(|v| v.is_finite()) {
                return false;
            }
            let m = head.iter().fold(0f32, |m, &v| m.max(v.abs()));
            if m == 0.0 {
                continue;
            }
            let step = m / 32767.0;
            if step < f32::MIN_POSITIVE {
                return false;
            }
            let inv = 32767.0 / m;
            for (c, &v) in self.codes[h * d..(h + 1) * d].iter_mut().zip(head) {
                // Half away from zero, then truncated: `round` without a call into libm.
                let x = (v * inv).clamp(-32767.0, 32767.0);
                *c = (x + 0.5f32.copysign(x)) as i16;
            }
            self.scales[h] = step * scale;
        }
        true
    }

    fn head(&self, h: usize) -> &[i16] {
        &self.codes[h * self.d..(h + 1) * self.d]
    }
}

/// The definition: head `h`'s score of row `j` of the `n` key rows (`stride` codes apart, this
/// head's at `offset`) is `(Σ_i c_hi k_ji) as f32 · s_h`, written to `s[h · s_stride + col + j]`.
#[allow(clippy::too_many_arguments)]
pub(super) fn scores_ref(
    qc: &QueryCodes,
    keys: &[i8],
    n: usize,
    stride: usize,
    offset: usize,
    s: &mut [f32],
    s_stride: usize,
    col: usize,
) {
    let d = qc.d;
    for h in 0..qc.g {
        let ch = qc.head(h);
        for j in 0..n {
            let k = &keys[j * stride + offset..j * stride + offset + d];
            let dot: i32 = ch.iter().zip(k).map(|(&a, &b)| a as i32 * b as i32).sum();
            s[h * s_stride + col + j] = dot as f32 * qc.scales[h];
        }
    }
}

/// [`scores_ref`] through the fastest kernel this CPU has (the same bits), asking for the next
/// block's key rows and this block's value rows with `ahead`: the first value row (at this
/// head's offset), the bytes from one row to the next and the bytes of a row.
#[allow(clippy::too_many_arguments)]
pub(super) fn scores(
    qc: &QueryCodes,
    keys: &[i8],
    n: usize,
    stride: usize,
    offset: usize,
    s: &mut [f32],
    s_stride: usize,
    col: usize,
    ahead: Option<(*const u8, usize, usize)>,
) {
    let d = qc.d;
    if n > 0 {
        // The kernels read exactly these rows and write exactly these scores.
        assert!(keys.len() >= (n - 1) * stride + offset + d, "key codes shorter than their rows");
        assert!(s.len() >= (qc.g - 1) * s_stride + col + n, "scores shorter than their heads");
    }
    #[cfg(target_arch = "x86_64")]
    {
        if d.is_multiple_of(32) && crate::simd::has_avx512_kernels() {
            // SAFETY: AVX-512 F/BW/VNNI are present; the rows and scores were checked above,
            // and `ahead` is the caller's promise of readable value rows.
            unsafe { scores_avx512(qc, keys, n, stride, offset, s, s_stride, col, ahead) };
            return;
        }
        if d.is_multiple_of(16) && crate::simd::has_avx2_fma() {
            // SAFETY: AVX2 is present; as above.
            unsafe { scores_avx2(qc, keys, n, stride, offset, s, s_stride, col, ahead) };
            return;
        }
    }
    let _ = ahead;
    scores_ref(qc, keys, n, stride, offset, s, s_stride, col)
}

/// Asks for the key rows of the block after `j` and the value rows of the block at `j`.
///
/// # Safety
/// The rows asked for lie inside the history (prefetches of other addresses are harmless but
/// the pointer arithmetic must stay inside the allocation).
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn prefetch_block(
    kp: *const i8,
    j: usize,
    n: usize,
    stride: usize,
    d: usize,
    ahead: Option<(*const u8, usize, usize)>,
) {
    use std::arch::x86_64::*;
    if let Some((vp, vstride, vbytes)) = ahead {
        for r in j + 8..(j + 16).min(n) {
            // SAFETY: row r < n of the keys (the caller's contract).
            let k = unsafe { kp.add(r * stride) };
            for b in (0..d).step_by(64) {
                // SAFETY: inside row r.
                unsafe { _mm_prefetch::<_MM_HINT_T0>(k.add(b)) };
            }
        }
        for r in j..j + 8 {
            // SAFETY: row r < n of the values (the caller's contract).
            let v = unsafe { vp.add(r * vstride) };
            for b in (0..vbytes).step_by(64) {
                // SAFETY: inside row r.
                unsafe { _mm_prefetch::<_MM_HINT_T0>(v.add(b) as *const i8) };
            }
        }
    }
}

/// Horizontal sums of eight vectors of eight i32 lanes: lane `r` is the sum of `acc[r]`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
fn hsum8_epi32(acc: &[std::arch::x86_64::__m256i; 8]) -> std::arch::x86_64::__m256i {
    use std::arch::x86_64::*;
    let u0 = _mm256_hadd_epi32(_mm256_hadd_epi32(acc[0], acc[1]), _mm256_hadd_epi32(acc[2], acc[3]));
    let u1 = _mm256_hadd_epi32(_mm256_hadd_epi32(acc[4], acc[5]), _mm256_hadd_epi32(acc[6], acc[7]));
    _mm256_add_epi32(_mm256_permute2x128_si256::<0x20>(u0, u1), _mm256_permute2x128_si256::<0x31>(u0, u1))
}

/// Codes of a block widened to i16 once for all heads of a group (8 KiB: eight rows of 512).
#[cfg(target_arch = "x86_64")]
const STAGE16: usize = 8 * MAX_D;

/// Generates [`scores_ref`] for one vector width `W`: eight keys at a time, their codes widened
/// to i16 once into the stage for all heads of the group, each head's `W` codes against `W` of
/// each key per multiply-add into exact 32-bit sums.
macro_rules! int_key_kernel {
    ($name:ident, $features:literal, $vec:ty, $w:literal, $widen:path, $load:path, $store:path,
     $zero:path, $madd:path, $half:path) => {
        /// [`scores_ref`] on the lanes of its vector width.
        ///
        /// # Safety
        /// The CPU features named present; `d` a multiple of the width; the rows, scores and
        /// `ahead` as [`scores`] checks them.
        #[cfg(target_arch = "x86_64")]
        #[target_feature(enable = $features)]
        #[allow(clippy::too_many_arguments)]
        unsafe fn $name(
            qc: &QueryCodes,
            keys: &[i8],
            n: usize,
            stride: usize,
            offset: usize,
            s: &mut [f32],
            s_stride: usize,
            col: usize,
            ahead: Option<(*const u8, usize, usize)>,
        ) {
            use std::arch::x86_64::*;
            const W: usize = $w;
            let (d, g) = (qc.d, qc.g);
            // SAFETY: `offset` is inside the keys (checked by the caller).
            let kp = unsafe { keys.as_ptr().add(offset) };
            let mut staged = [0i16; STAGE16];
            let stage = g > 1;
            let sp = staged.as_mut_ptr();
            let mut j = 0;
            while j + 8 <= n {
                // SAFETY: rows j.. < n of the history.
                unsafe { prefetch_block(kp, j, n, stride, d, ahead) };
                if stage {
                    for r in 0..8 {
                        for c in (0..d).step_by(W) {
                            // SAFETY: row j + r < n, columns c..c + W ≤ d; the stage holds
                            // 8·d ≤ 8·512.
                            unsafe { $store(sp.add(r * d + c) as *mut $vec, $widen(kp.add((j + r) * stride + c))) };
                        }
                    }
                }
                for h in 0..g {
                    let qp = qc.head(h).as_ptr();
                    let mut acc = [$zero(); 8];
                    for c in (0..d).step_by(W) {
                        // SAFETY: W codes of head h at c < d.
                        let qv = unsafe { $load(qp.add(c) as *const $vec) };
                        for (r, a) in acc.iter_mut().enumerate() {
                            // SAFETY: as when staged: row j + r, columns c..c + W.
                            let k = unsafe {
                                if stage {
                                    $load(sp.add(r * d + c) as *const $vec)
                                } else {
                                    $widen(kp.add((j + r) * stride + c))
                                }
                            };
                            *a = $madd(*a, qv, k);
                        }
                    }
                    let sum = _mm256_cvtepi32_ps(hsum8_epi32(&acc.map(|a| $half(a))));
                    // SAFETY: scores h·s_stride + col + j .. + 8 are inside `s` (checked by the
                    // caller).
                    unsafe {
                        _mm256_storeu_ps(
                            s.as_mut_ptr().add(h * s_stride + col + j),
                            _mm256_mul_ps(sum, _mm256_set1_ps(qc.scales[h])),
                        )
                    };
                }
                j += 8;
            }
            scores_ref(qc, &keys[(j * stride).min(keys.len())..], n - j, stride, offset, s, s_stride, col + j);
        }
    };
}

/// 16 codes at `p` as i16 lanes.
///
/// # Safety
/// AVX2 present; 16 bytes readable at `p`.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn widen16(p: *const i8) -> std::arch::x86_64::__m256i {
    use std::arch::x86_64::*;
    // SAFETY: 16 bytes readable at p (the caller's contract).
    unsafe { _mm256_cvtepi8_epi16(_mm_loadu_si128(p as *const __m128i)) }
}

/// 32 codes at `p` as i16 lanes.
///
/// # Safety
/// AVX-512 BW present; 32 bytes readable at `p`.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn widen32(p: *const i8) -> std::arch::x86_64::__m512i {
    use std::arch::x86_64::*;
    // SAFETY: 32 bytes readable at p (the caller's contract).
    unsafe { _mm512_cvtepi8_epi16(_mm256_loadu_si256(p as *const __m256i)) }
}

/// `a + q · k` over pairs of i16 (AVX2 has no fused form).
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn madd256(
    a: std::arch::x86_64::__m256i,
    q: std::arch::x86_64::__m256i,
    k: std::arch::x86_64::__m256i,
) -> std::arch::x86_64::__m256i {
    use std::arch::x86_64::*;
    // SAFETY: AVX2 present (the caller's contract).
    unsafe { _mm256_add_epi32(a, _mm256_madd_epi16(q, k)) }
}

/// The two 256-bit halves of a vector added (a 256-bit vector as it is).
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn fold512(a: std::arch::x86_64::__m512i) -> std::arch::x86_64::__m256i {
    use std::arch::x86_64::*;
    // SAFETY: AVX-512 F present (the caller's contract).
    unsafe { _mm256_add_epi32(_mm512_castsi512_si256(a), _mm512_extracti64x4_epi64::<1>(a)) }
}

#[cfg(target_arch = "x86_64")]
#[inline(always)]
fn same256(a: std::arch::x86_64::__m256i) -> std::arch::x86_64::__m256i {
    a
}

int_key_kernel!(
    scores_avx2,
    "avx2,fma",
    std::arch::x86_64::__m256i,
    16,
    widen16,
    _mm256_loadu_si256,
    _mm256_storeu_si256,
    _mm256_setzero_si256,
    madd256,
    same256
);

int_key_kernel!(
    scores_avx512,
    "avx2,fma,avx512f,avx512bw,avx512vnni",
    std::arch::x86_64::__m512i,
    32,
    widen32,
    _mm512_loadu_si512,
    _mm512_storeu_si512,
    _mm512_setzero_si512,
    _mm512_dpwssd_epi32,
    fold512
);

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testutil::data;

    /// Codes over the whole i8 range, −128 and ±127 included.
    fn codes(len: usize, seed: u32) -> Vec<i8> {
        data(len, seed).iter().enumerate().map(|(i, &v)| if i % 97 == 5 { -128 } else { (v * 127.5) as i8 }).collect()
    }

    #[test]
    fn every_kernel_gives_the_scalar_references_bits() {
        // Head sizes with and without a 16/32-column vector path; groups of one to six heads;
        // lengths around blocks of eight; a head at an offset in wider rows; queries as large
        // as the codes allow (every code at ±32767 against −128 keys: the overflow bound).
        for (d, g) in [(16usize, 1usize), (32, 3), (48, 2), (64, 3), (64, 1), (256, 6), (512, 2), (40, 2)] {
            for n in [1usize, 7, 8, 9, 33, 100] {
                for (stride, offset) in [(d, 0), (2 * d, d)] {
                    let keys = codes(n * stride, (d * n + offset) as u32);
                    for q in [data(g * d, 7 + n as u32), vec![-3.0f32; g * d]] {
                        let mut qc = QueryCodes::default();
                        assert!(qc.fill(&q, d, 0.125));
                        let (cols, col) = (n + 5, 3);
                        let mut want = vec![f32::NAN; g * cols];
                        scores_ref(&qc, &keys, n, stride, offset, &mut want, cols, col);
                        let mut got = vec![f32::NAN; g * cols];
                        scores(&qc, &keys, n, stride, offset, &mut got, cols, col, None);
                        let same = |a: &[f32], b: &[f32]| a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits());
                        assert!(same(&got, &want), "d={d} g={g} n={n} offset {offset}: dispatch");
                        #[cfg(target_arch = "x86_64")]
                        {
                            if d.is_multiple_of(16) && crate::simd::has_avx2_fma() {
                                let mut got = vec![f32::NAN; g * cols];
                                // SAFETY: AVX2 present, d a multiple of 16, rows and scores sized.
                                unsafe { scores_avx2(&qc, &keys, n, stride, offset, &mut got, cols, col, None) };
                                assert!(same(&got, &want), "d={d} g={g} n={n} offset {offset}: AVX2");
                            }
                            if d.is_multiple_of(32) && crate::testutil::avx512_kernels("int8-key scores") {
                                let mut got = vec![f32::NAN; g * cols];
                                // SAFETY: AVX-512 present, d a multiple of 32, rows and scores sized.
                                unsafe { scores_avx512(&qc, &keys, n, stride, offset, &mut got, cols, col, None) };
                                assert!(same(&got, &want), "d={d} g={g} n={n} offset {offset}: AVX-512");
                            }
                        }
                        // Unwritten columns stay as they were.
                        for h in 0..g {
                            assert!(got[h * cols..h * cols + col].iter().all(|v| v.is_nan()));
                            assert!(got[h * cols + col + n..(h + 1) * cols].iter().all(|v| v.is_nan()));
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn query_codes_stay_within_half_a_step_and_refuse_what_they_cannot_hold() {
        let q = data(3 * 64, 9);
        let mut qc = QueryCodes::default();
        assert!(qc.fill(&q, 64, 1.0));
        for h in 0..3 {
            let step = qc.scales[h];
            let m = q[h * 64..(h + 1) * 64].iter().fold(0f32, |m, v| m.max(v.abs()));
            assert_eq!(step, m / 32767.0);
            for (i, &c) in qc.head(h).iter().enumerate() {
                assert!((c as f32 * step - q[h * 64 + i]).abs() <= 0.5001 * step);
            }
        }
        // A zero head scores zero; a non-finite value, a subnormal step or an oversized head
        // leaves the float path to it.
        assert!(qc.fill(&[0.0; 32], 32, 1.0));
        assert!(qc.head(0).iter().all(|&c| c == 0) && qc.scales[0] == 0.0);
        assert!(!qc.fill(&[f32::NAN; 32], 32, 1.0));
        assert!(!qc.fill(&[1e-40; 32], 32, 1.0));
        assert!(!qc.fill(&vec![1.0; 1024], 1024, 1.0));
    }
}
