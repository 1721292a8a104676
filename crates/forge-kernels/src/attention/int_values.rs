//! The weighted sum of int8 value codes (the KV8 cache) in integer arithmetic: a part's weights
//! `w_j = p_j · s_j` (softmax weight times the row's value scale) are written as 16-bit
//! integers with one scale per head and [`BLOCK`] rows (`w ≈ step · c`, within `step / 2`,
//! `step = max |w| / 32767` over the block), and each block's `Σ_j c_j v_j` is an exact 32-bit
//! integer per column, added to the f32 output once per block (`out = fma(Σ, step, out)`).
//! Integer sums are exact and the blocks are rows of the part, not of its runs, so every ISA
//! and every cut of the history into pages gives the bits of the scalar reference. AVX2 takes
//! two rows a `vpmaddwd` (their codes interleaved), AVX-512 VNNI two a `vpdpwssd`, against two
//! f32 multiply-adds of widened codes a row.
//!
//! Where a block's weights are far apart, the small ones lose relative precision: a weight
//! under `step / 2` counts as zero. The block's largest weight keeps 15 bits, and what the rest
//! lose is at most `BLOCK · step / 2` of the block's weight, against KV8's own rounding of every
//! value to 1/254 of its row's largest.

/// Rows of a part sharing one weight scale, summed in integers before they reach f32. A
/// column's block sum is at most `BLOCK · 32767 · 128 < 2³¹`.
pub(super) const BLOCK: usize = 256;

/// A part's weights as 16-bit codes with a scale per head and block, and each head's integer
/// sums of the current block (kept from run to run). Held per thread and reused, so that
/// decode allocates nothing once warm.
#[derive(Default)]
pub(super) struct IntValues {
    codes: Vec<i16>,
    scales: Vec<f32>,
    acc: Vec<i32>,
    g: usize,
    n: usize,
    lanes: Option<Lanes>,
}

thread_local! {
    static KEPT: std::cell::RefCell<Option<IntValues>> = const { std::cell::RefCell::new(None) };
}

/// `f` with this thread's [`IntValues`].
pub(super) fn with_int_values<R>(f: impl FnOnce(&mut IntValues) -> R) -> R {
    crate::scratch::with_kept(&KEPT, f)
}

impl IntValues {
    /// Room for `g` heads of parts up to the longest and of `dv` values, so that the first
    /// part a thread attends allocates nothing.
    pub(super) fn reserve(&mut self, g: usize, dv: usize) {
        self.codes.reserve(g * super::MAX_PART);
        self.scales.reserve(g * super::MAX_PART.div_ceil(BLOCK));
        self.acc.reserve(g * dv);
    }

    /// Takes the `g` rows of `n` weights in `p` as codes for heads of `dv` values, with the
    /// sums cleared; false where this path does not apply: a weight that is not finite, or a
    /// block whose largest weight is so small that its step would be subnormal.
    pub(super) fn prepare(&mut self, p: &[f32], g: usize, n: usize, dv: usize, lanes: Lanes) -> bool {
        let blocks = n.div_ceil(BLOCK);
        // Room for the longest part up front, so that a history that grows does not grow these.
        self.codes.clear();
        self.codes.reserve(g * n.max(super::MAX_PART));
        self.codes.resize(g * n, 0);
        self.scales.clear();
        self.scales.resize(g * blocks.max(super::MAX_PART.div_ceil(BLOCK)), 0.0);
        self.acc.clear();
        self.acc.resize(g * dv, 0);
        (self.g, self.n, self.lanes) = (g, n, Some(lanes));
        for h in 0..g {
            for b in 0..blocks {
                let rows = h * n + b * BLOCK..h * n + ((b + 1) * BLOCK).min(n);
                let w = &p[rows.clone()];
                let (m, total) = max_and_sum_abs(w);
                // A NaN or infinite weight makes the sum so (and a sum past f32 is refused too).
                if !total.is_finite() {
                    return false;
                }
                if m == 0.0 {
                    continue;
                }
                let step = m / 32767.0;
                if step < f32::MIN_POSITIVE {
                    return false;
                }
                let inv = 32767.0 / m;
                for (c, &v) in self.codes[rows].iter_mut().zip(w) {
                    // Half away from zero, then truncated: `round` without a call into libm.
                    let x = (v * inv).clamp(-32767.0, 32767.0);
                    *c = (x + 0.5f32.copysign(x)) as i16;
                }
                self.scales[h * blocks + b] = step;
            }
        }
        true
    }

    fn scale(&self, h: usize, block: usize) -> f32 {
        self.scales[h * self.n.div_ceil(BLOCK) + block]
    }

    fn lanes(&self) -> Lanes {
        self.lanes.unwrap_or(Lanes::Plain)
    }
}

/// `(max |w|, Σ |w|)`, in eight lanes so that it runs on vectors.
fn max_and_sum_abs(w: &[f32]) -> (f32, f32) {
    let (mut mx, mut sum) = ([0f32; 8], [0f32; 8]);
    let chunks = w.chunks_exact(8);
    let rest = chunks.remainder();
    for ch in chunks {
        for i in 0..8 {
            let a = ch[i].abs();
            mx[i] = if a > mx[i] { a } else { mx[i] };
            sum[i] += a;
        }
    }
    for (i, &v) in rest.iter().enumerate() {
        let a = v.abs();
        mx[i] = if a > mx[i] { a } else { mx[i] };
        sum[i] += a;
    }
    (mx.iter().fold(0f32, |m, &v| m.max(v)), sum.iter().sum())
}

/// Which column of a head each position of the integer accumulators holds: the SIMD kernels
/// keep two rows' codes interleaved, so their lanes come out of column order.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(super) enum Lanes {
    /// Column order (the scalar reference).
    Plain,
    /// Groups of 16 columns as `vpmaddwd` on 256-bit vectors leaves them.
    Avx2,
    /// Groups of 32 columns as `vpdpwssd` on 512-bit vectors leaves them.
    Avx512,
}

impl Lanes {
    /// The column of accumulator position `i`.
    fn column(self, i: usize) -> usize {
        match self {
            Lanes::Plain => i,
            // Unpacking two rows' 16 codes gives, per 128-bit half, four columns from the
            // lower eight and four from the upper: [0–3, 8–11 | 4–7, 12–15].
            Lanes::Avx2 => {
                let (base, r) = (i / 16 * 16, i % 16);
                base + [0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 12, 13, 14, 15][r]
            }
            // Per 128-bit lane L of 32 codes: columns 8L..8L + 4 in the first vector, 8L + 4..
            // 8L + 8 in the second.
            Lanes::Avx512 => {
                let (base, r) = (i / 32 * 32, i % 32);
                let (half, lane, k) = (r / 16, r % 16 / 4, r % 4);
                base + 8 * lane + 4 * half + k
            }
        }
    }
}

/// Adds the block sums into `out` (`g` heads of `dv` columns) and clears them.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "fma")]
fn flush_fma(iv: &mut IntValues, block: usize, dv: usize, out: &mut [f32]) {
    flush_body(iv, block, dv, out)
}

#[inline(always)]
fn flush_body(iv: &mut IntValues, block: usize, dv: usize, out: &mut [f32]) {
    let lanes = iv.lanes();
    for h in 0..iv.g {
        let s = iv.scale(h, block);
        let (acc, o) = (&mut iv.acc[h * dv..(h + 1) * dv], &mut out[h * dv..(h + 1) * dv]);
        for (i, a) in acc.iter_mut().enumerate() {
            let c = lanes.column(i);
            o[c] = (*a as f32).mul_add(s, o[c]);
            *a = 0;
        }
    }
}

fn flush(iv: &mut IntValues, block: usize, dv: usize, out: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if crate::simd::has_avx2_fma() {
        // SAFETY: FMA is present.
        return unsafe { flush_fma(iv, block, dv, out) };
    }
    flush_body(iv, block, dv, out)
}

/// The rows `col..col + rn` of the part (a run: `rn` value rows `stride` codes apart, this
/// head's `dv` at `offset`) into the sums, flushing each block into `out` as it ends (the
/// part's last row ends the last block).
pub(super) fn add_run(
    iv: &mut IntValues,
    col: usize,
    rn: usize,
    values: &[i8],
    stride: usize,
    offset: usize,
    out: &mut [f32],
) {
    let (g, n) = (iv.g, iv.n);
    let dv = out.len() / g;
    assert!(iv.acc.len() == g * dv && col + rn <= n, "rows {col}..{} of a part of {n}", col + rn);
    if rn > 0 {
        assert!(values.len() >= (rn - 1) * stride + offset + dv, "value codes shorter than their rows");
    }
    #[cfg(target_arch = "x86_64")]
    {
        let width = match iv.lanes() {
            Lanes::Plain => 1,
            Lanes::Avx2 => 16,
            Lanes::Avx512 => 32,
        };
        assert!(width == 1 || (dv.is_multiple_of(width) && 2 * dv <= STAGE16), "{dv} values for lanes of {width}");
    }
    let mut j = 0;
    while j < rn {
        // Up to the end of the block (or of the run).
        let block = (col + j) / BLOCK;
        let end = ((block + 1) * BLOCK - col).min(rn);
        let rows = &values[j * stride..];
        match iv.lanes() {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: the kernels' lanes are chosen only where their features are present
            // ([`lanes`]) and `dv` suits them; rows j..end lie in `values`, their weights in
            // the codes.
            Lanes::Avx512 => unsafe { sum_avx512(iv, col + j, end - j, rows, stride, offset, dv) },
            #[cfg(target_arch = "x86_64")]
            // SAFETY: as above.
            Lanes::Avx2 => unsafe { sum_avx2(iv, col + j, end - j, rows, stride, offset, dv) },
            _ => sum_ref(iv, col + j, end - j, rows, stride, offset, dv),
        }
        if (col + end).is_multiple_of(BLOCK) || col + end == n {
            flush(iv, block, dv, out);
        }
        j = end;
    }
}

/// The lanes of the fastest kernel here for head size `dv`.
pub(super) fn lanes(dv: usize) -> Lanes {
    #[cfg(target_arch = "x86_64")]
    if 2 * dv <= STAGE16 {
        if dv.is_multiple_of(32) && crate::simd::has_avx512_kernels() {
            return Lanes::Avx512;
        }
        if dv.is_multiple_of(16) && crate::simd::has_avx2_fma() {
            return Lanes::Avx2;
        }
    }
    let _ = dv;
    Lanes::Plain
}

/// The definition: `acc_h[c] += Σ_j code_hj · v_jc` over `rn` rows from part row `j0`.
fn sum_ref(iv: &mut IntValues, j0: usize, rn: usize, values: &[i8], stride: usize, offset: usize, dv: usize) {
    let lanes = iv.lanes();
    for h in 0..iv.g {
        for j in 0..rn {
            let w = iv.codes[h * iv.n + j0 + j] as i32;
            let v = &values[j * stride + offset..j * stride + offset + dv];
            for (i, a) in iv.acc[h * dv..(h + 1) * dv].iter_mut().enumerate() {
                *a += w * v[lanes.column(i)] as i32;
            }
        }
    }
}

/// Head `h`'s weights of the `np` row pairs from part row `j0` (`rn` rows in all), a pair as one
/// 32-bit lane (first row low; a missing second row weighs zero).
#[cfg(target_arch = "x86_64")]
#[inline(always)]
fn pairs_of(iv: &IntValues, h: usize, j0: usize, rn: usize, wp: &mut [i32]) {
    let c = &iv.codes[h * iv.n + j0..h * iv.n + j0 + rn];
    for (k, w) in wp.iter_mut().enumerate() {
        let lo = c[2 * k] as u16 as u32;
        let hi = c.get(2 * k + 1).map_or(0, |&x| x as u16 as u32);
        *w = (lo | hi << 16) as i32;
    }
}

/// Value rows interleaved two by two once for every head of a group (8 KiB of codes).
#[cfg(target_arch = "x86_64")]
const STAGE16: usize = 4096;

/// Generates [`sum_ref`] for one vector width `W`: rows two at a time, their codes widened to
/// i16 and interleaved once into the stage (shared by the heads; each row read from memory
/// once), then per head a sweep of up to `G` groups of `W` columns whose `2G` sums stay in
/// registers while the row pairs go by (independent chains: a multiply-add waits on its own
/// sum only every `2G` instructions).
macro_rules! int_value_kernel {
    ($name:ident, $sweep:ident, $features:literal, $vec:ty, $w:literal, $g:literal, $widen:path,
     $unlo:path, $unhi:path, $load:path, $store:path, $bcast:path, $madd:path) => {
        /// [`sum_ref`] on the lanes of its vector width.
        ///
        /// # Safety
        /// The CPU features named present; `dv` a multiple of the width; the `rn` rows from
        /// part row `j0` inside `values` (`stride` apart, `dv` codes at `offset`) and their
        /// weights inside the codes; `g · dv` sums.
        #[cfg(target_arch = "x86_64")]
        #[target_feature(enable = $features)]
        #[allow(clippy::too_many_arguments)]
        unsafe fn $name(
            iv: &mut IntValues,
            j0: usize,
            rn: usize,
            values: &[i8],
            stride: usize,
            offset: usize,
            dv: usize,
        ) {
            use std::arch::x86_64::*;
            const W: usize = $w;
            // SAFETY: `offset` is inside the values (checked by the caller).
            let vp = unsafe { values.as_ptr().add(offset) };
            let pairs = (STAGE16 / (2 * dv)).clamp(1, 64);
            let mut staged = [0i16; STAGE16];
            let sp = staged.as_mut_ptr() as *mut $vec;
            let mut wp = [0i32; 64];
            let mut j = 0;
            while j < rn {
                let jn = (j + 2 * pairs).min(rn);
                let np = (jn - j).div_ceil(2);
                for k in 0..np {
                    let (r0, r1) = (j + 2 * k, j + 2 * k + 1);
                    for c in (0..dv).step_by(W) {
                        // SAFETY: rows below rn, columns c..c + W ≤ dv; pair k's 2·dv codes
                        // inside the stage when staged (np · 2dv ≤ STAGE16), else one pair
                        // of W columns at a time (see the sweep).
                        unsafe {
                            let a = $widen(vp.add(r0 * stride + c));
                            let b = if r1 < rn { $widen(vp.add(r1 * stride + c)) } else { $widen(std::ptr::null()) };
                            let at = (k * dv + c) * 2 / W;
                            $store(sp.add(at), $unlo(a, b));
                            $store(sp.add(at + 1), $unhi(a, b));
                        }
                    }
                }
                for h in 0..iv.g {
                    pairs_of(iv, h, j0 + j, jn - j, &mut wp[..np]);
                    let acc = iv.acc.as_mut_ptr() as *mut $vec;
                    let mut c = 0;
                    while c < dv {
                        let left = (dv - c) / W;
                        // SAFETY: head h's sums and the staged pairs of columns c.. (as above).
                        let done = unsafe {
                            let a = acc.add((h * dv + c) * 2 / W);
                            let st = sp.add(c * 2 / W);
                            if left >= $g {
                                $sweep::<$g>(a, st, dv * 2 / W, &wp[..np]);
                                $g
                            } else if left >= 4 {
                                $sweep::<4>(a, st, dv * 2 / W, &wp[..np]);
                                4
                            } else if left >= 2 {
                                $sweep::<2>(a, st, dv * 2 / W, &wp[..np]);
                                2
                            } else {
                                $sweep::<1>(a, st, dv * 2 / W, &wp[..np]);
                                1
                            }
                        };
                        c += done * W;
                    }
                }
                j = jn;
            }
        }

        /// `G` groups of `W` columns of one head: sums at `acc` (two vectors a group), the
        /// staged pairs at `st` (two vectors a group, `pitch` vectors from pair to pair), the
        /// pairs' weights `wp`.
        ///
        /// # Safety
        /// The CPU features named present; `2G` vectors at `acc` and, for every pair, at
        /// `st + k · pitch`.
        #[cfg(target_arch = "x86_64")]
        #[target_feature(enable = $features)]
        unsafe fn $sweep<const G: usize>(acc: *mut $vec, st: *const $vec, pitch: usize, wp: &[i32]) {
            use std::arch::x86_64::*;
            let mut sum = [[unsafe { std::mem::zeroed::<$vec>() }; 2]; G];
            for (i, s) in sum.iter_mut().enumerate() {
                // SAFETY: 2G vectors at acc (the caller's contract).
                unsafe { *s = [$load(acc.add(2 * i)), $load(acc.add(2 * i + 1))] };
            }
            for (k, &w) in wp.iter().enumerate() {
                let w = $bcast(w);
                for (i, s) in sum.iter_mut().enumerate() {
                    // SAFETY: pair k's vectors of group i (the caller's contract).
                    let (x, y) = unsafe { ($load(st.add(k * pitch + 2 * i)), $load(st.add(k * pitch + 2 * i + 1))) };
                    s[0] = $madd(s[0], w, x);
                    s[1] = $madd(s[1], w, y);
                }
            }
            for (i, s) in sum.iter().enumerate() {
                // SAFETY: as for the loads.
                unsafe {
                    $store(acc.add(2 * i), s[0]);
                    $store(acc.add(2 * i + 1), s[1]);
                }
            }
        }
    };
}

/// 16 codes at `p` as i16 lanes (zeros for a null `p`).
///
/// # Safety
/// AVX2 present; 16 bytes readable at a non-null `p`.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn widen16(p: *const i8) -> std::arch::x86_64::__m256i {
    use std::arch::x86_64::*;
    if p.is_null() {
        return _mm256_setzero_si256();
    }
    // SAFETY: 16 bytes readable at p (the caller's contract).
    unsafe { _mm256_cvtepi8_epi16(_mm_loadu_si128(p as *const __m128i)) }
}

/// 32 codes at `p` as i16 lanes (zeros for a null `p`).
///
/// # Safety
/// AVX-512 BW present; 32 bytes readable at a non-null `p`.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn widen32(p: *const i8) -> std::arch::x86_64::__m512i {
    use std::arch::x86_64::*;
    if p.is_null() {
        return _mm512_setzero_si512();
    }
    // SAFETY: 32 bytes readable at p (the caller's contract).
    unsafe { _mm512_cvtepi8_epi16(_mm256_loadu_si256(p as *const __m256i)) }
}

/// `a + w · x` over pairs of i16 (AVX2 has no fused form).
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn madd256(
    a: std::arch::x86_64::__m256i,
    w: std::arch::x86_64::__m256i,
    x: std::arch::x86_64::__m256i,
) -> std::arch::x86_64::__m256i {
    use std::arch::x86_64::*;
    // SAFETY: AVX2 present (the caller's contract).
    unsafe { _mm256_add_epi32(a, _mm256_madd_epi16(w, x)) }
}

int_value_kernel!(
    sum_avx2,
    sweep_avx2,
    "avx2",
    std::arch::x86_64::__m256i,
    16,
    4,
    widen16,
    _mm256_unpacklo_epi16,
    _mm256_unpackhi_epi16,
    _mm256_loadu_si256,
    _mm256_storeu_si256,
    _mm256_set1_epi32,
    madd256
);

int_value_kernel!(
    sum_avx512,
    sweep_avx512,
    "avx2,avx512f,avx512bw,avx512vnni",
    std::arch::x86_64::__m512i,
    32,
    8,
    widen32,
    _mm512_unpacklo_epi16,
    _mm512_unpackhi_epi16,
    _mm512_loadu_si512,
    _mm512_storeu_si512,
    _mm512_set1_epi32,
    _mm512_dpwssd_epi32
);

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testutil::data;

    /// Codes over the whole i8 range, −128 and ±127 included.
    fn codes(len: usize, seed: u32) -> Vec<i8> {
        data(len, seed).iter().enumerate().map(|(i, &v)| if i % 89 == 3 { -128 } else { (v * 127.5) as i8 }).collect()
    }

    /// Weights as attention makes them: positive, spread over orders of magnitude, some zero,
    /// one block all zero, and the largest at the code limit.
    fn weights(g: usize, n: usize, seed: u32) -> Vec<f32> {
        data(g * n, seed)
            .iter()
            .enumerate()
            .map(|(i, &v)| match i % n {
                j if (BLOCK..BLOCK + 40).contains(&j) && n > 2 * BLOCK => 0.0,
                j if j % 13 == 0 => 0.0,
                j => (v.abs() + 0.01) * 10f32.powi(-((j % 7) as i32)),
            })
            .collect()
    }

    /// The part's sums through `lanes`, its rows cut into runs of `run` rows.
    #[allow(clippy::too_many_arguments)]
    fn sum(
        p: &[f32],
        g: usize,
        n: usize,
        values: &[i8],
        stride: usize,
        offset: usize,
        dv: usize,
        lanes: Lanes,
        run: usize,
    ) -> Vec<f32> {
        let mut out = vec![0f32; g * dv];
        let mut iv = IntValues::default();
        assert!(iv.prepare(p, g, n, dv, lanes));
        let mut j = 0;
        while j < n {
            let rn = run.min(n - j);
            add_run(&mut iv, j, rn, &values[j * stride..], stride, offset, &mut out);
            j += rn;
        }
        out
    }

    #[test]
    fn every_kernel_and_every_cut_into_runs_give_the_scalar_references_bits() {
        for (dv, g) in [(16usize, 1usize), (32, 3), (64, 3), (64, 1), (256, 6), (96, 2), (2048, 1)] {
            for n in [1usize, 2, 7, 8, 9, 255, 256, 257, 600, 1024] {
                for (stride, offset) in [(dv, 0), (2 * dv, dv)] {
                    let values = codes(n * stride, (dv + n + offset) as u32);
                    let p = weights(g, n, n as u32 + 1);
                    let want = sum(&p, g, n, &values, stride, offset, dv, Lanes::Plain, n);
                    let same = |a: &[f32]| a.iter().zip(&want).all(|(x, y)| x.to_bits() == y.to_bits());
                    for run in [8usize, 24, 256, n] {
                        let got = sum(&p, g, n, &values, stride, offset, dv, Lanes::Plain, run);
                        assert!(same(&got), "dv={dv} g={g} n={n}: scalar, runs of {run}");
                        #[cfg(target_arch = "x86_64")]
                        {
                            if dv.is_multiple_of(16) && crate::simd::has_avx2_fma() {
                                let got = sum(&p, g, n, &values, stride, offset, dv, Lanes::Avx2, run);
                                assert!(same(&got), "dv={dv} g={g} n={n}: AVX2, runs of {run}");
                            }
                            if dv.is_multiple_of(32) && crate::testutil::avx512_kernels("int8 value sums") {
                                let got = sum(&p, g, n, &values, stride, offset, dv, Lanes::Avx512, run);
                                assert!(same(&got), "dv={dv} g={g} n={n}: AVX-512, runs of {run}");
                            }
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn sums_are_within_half_a_step_of_each_weight() {
        // Against the f64 sum of the exact weights: each weight off by at most half its
        // block's step (and the rounding of its scaling), each block's sum rounded once to
        // f32 (and added once).
        let (dv, g, n) = (64usize, 2usize, 700usize);
        let values = codes(n * dv, 5);
        let p = weights(g, n, 6);
        let got = sum(&p, g, n, &values, dv, 0, dv, lanes(dv), n);
        for h in 0..g {
            for c in 0..dv {
                let (mut want, mut bound) = (0f64, 0f64);
                for b in 0..n.div_ceil(BLOCK) {
                    let rows = b * BLOCK..((b + 1) * BLOCK).min(n);
                    let step = rows.clone().map(|j| p[h * n + j]).fold(0f32, f32::max) as f64 / 32767.0;
                    let mut part = 0f64;
                    for j in rows {
                        let v = values[j * dv + c] as f64;
                        part += p[h * n + j] as f64 * v;
                        bound += step * 0.5001 * v.abs();
                    }
                    want += part;
                    bound += (part.abs() + want.abs()) * f32::EPSILON as f64;
                }
                let x = got[h * dv + c] as f64;
                assert!((x - want).abs() <= bound, "head {h} [{c}]: {x} vs {want} (bound {bound})");
            }
        }
    }

    #[test]
    fn weights_that_codes_cannot_hold_are_left_to_the_float_path() {
        let mut iv = IntValues::default();
        assert!(!iv.prepare(&[1.0, f32::NAN], 1, 2, 16, Lanes::Plain));
        assert!(!iv.prepare(&[f32::MAX, f32::MAX], 1, 2, 16, Lanes::Plain));
        assert!(!iv.prepare(&[1e-40, 0.0], 1, 2, 16, Lanes::Plain));
        assert!(!iv.prepare(&[f32::INFINITY], 1, 1, 16, Lanes::Plain));
        assert!(iv.prepare(&[0.0, 0.0], 1, 2, 16, Lanes::Plain));
    }

    #[test]
    fn lanes_name_every_column_once() {
        for lanes in [Lanes::Plain, Lanes::Avx2, Lanes::Avx512] {
            let mut seen: Vec<usize> = (0..64).map(|i| lanes.column(i)).collect();
            seen.sort();
            assert_eq!(seen, (0..64).collect::<Vec<_>>(), "{lanes:?}");
        }
    }
}
