//! The read-bandwidth probe's inner loop: a wrapping sum of several sequential streams read in
//! lockstep, one 64-byte line of each at a time, each prefetched as the decode kernels prefetch
//! their weights. The probe is the yardstick for the kernels' share of the bandwidth, so it has
//! to read as fast as the machine allows: the portable loop (eight scalar adds a line) falls
//! about 10 % short of 512-bit loads, hence the vector variants.

/// How far ahead of each stream lines are prefetched into L2, bytes (the decode kernels'
/// distance and cache, so that the probe reads as they do). Requests into L1 hold the core's
/// few line-fill buffers until memory answers: with four streams a worker they read about
/// 10 % slower than requests into L2.
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
const AHEAD: usize = 16384;

/// Wrapping sum of `streams` segments of `buf`, each `seg` values long (`seg` a multiple of 8,
/// `streams · seg ≤ buf.len()`), read line by line in lockstep.
pub fn sum_streams(buf: &[u64], streams: usize, seg: usize) -> u64 {
    assert!(seg.is_multiple_of(8) && streams * seg <= buf.len(), "{streams} streams of {seg} in {}", buf.len());
    #[cfg(target_arch = "x86_64")]
    {
        if crate::simd::has_avx512f() {
            // SAFETY: AVX-512 F is present (checked at run time); the bounds are asserted above.
            return unsafe { sum_streams_avx512(buf, streams, seg) };
        }
        if crate::simd::has_avx2_fma() {
            // SAFETY: AVX2 is present (checked at run time); the bounds are asserted above.
            return unsafe { sum_streams_avx2(buf, streams, seg) };
        }
    }
    sum_streams_portable(buf, streams, seg)
}

/// Wrapping sum of the whole 64-byte lines of the 8-byte-aligned part of `bytes`, read as
/// `streams` segments ([`sum_streams`]), and the bytes it read: the probe over a model's own
/// packed weights, wherever they lie.
pub fn sum_bytes(bytes: &[u8], streams: usize) -> (u64, usize) {
    // SAFETY: every bit pattern is a valid `u64`; `align_to` hands out only aligned whole
    // elements of the slice.
    let (_, words, _) = unsafe { bytes.align_to::<u64>() };
    let seg = (words.len() / streams.max(1)) & !7;
    if seg == 0 {
        return (0, 0);
    }
    (sum_streams(words, streams, seg), streams * seg * 8)
}

/// The scalar reference.
pub fn sum_streams_portable(buf: &[u64], streams: usize, seg: usize) -> u64 {
    let mut acc = [0u64; 8];
    for i in (0..seg).step_by(8) {
        for s in 0..streams {
            let line = &buf[s * seg + i..s * seg + i + 8];
            for k in 0..8 {
                acc[k] = acc[k].wrapping_add(line[k]);
            }
        }
    }
    acc.iter().fold(0, |a, &b| a.wrapping_add(b))
}

/// # Safety
/// AVX-512 F must be present and `streams · seg ≤ buf.len()` with `seg % 8 == 0`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn sum_streams_avx512(buf: &[u64], streams: usize, seg: usize) -> u64 {
    use std::arch::x86_64::*;
    let p = buf.as_ptr();
    // One accumulator per stream (up to eight), so that the adds do not chain.
    let mut acc = [_mm512_setzero_si512(); 8];
    for i in (0..seg).step_by(8) {
        for s in 0..streams {
            let line = p.add(s * seg + i);
            // A prefetch is only a hint; the address need not be valid.
            _mm_prefetch::<_MM_HINT_T1>((line as *const i8).wrapping_add(AHEAD));
            acc[s % 8] = _mm512_add_epi64(acc[s % 8], _mm512_loadu_si512(line as *const _));
        }
    }
    let mut out = [0u64; 8];
    for a in acc {
        let mut l = [0u64; 8];
        _mm512_storeu_si512(l.as_mut_ptr() as *mut _, a);
        for k in 0..8 {
            out[k] = out[k].wrapping_add(l[k]);
        }
    }
    out.iter().fold(0, |a, &b| a.wrapping_add(b))
}

/// # Safety
/// AVX2 must be present and `streams · seg ≤ buf.len()` with `seg % 8 == 0`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn sum_streams_avx2(buf: &[u64], streams: usize, seg: usize) -> u64 {
    use std::arch::x86_64::*;
    let p = buf.as_ptr();
    let mut acc = [_mm256_setzero_si256(); 8];
    for i in (0..seg).step_by(8) {
        for s in 0..streams {
            let line = p.add(s * seg + i);
            // A prefetch is only a hint; the address need not be valid.
            _mm_prefetch::<_MM_HINT_T1>((line as *const i8).wrapping_add(AHEAD));
            let a = _mm256_loadu_si256(line as *const __m256i);
            let b = _mm256_loadu_si256(line.add(4) as *const __m256i);
            acc[s % 8] = _mm256_add_epi64(acc[s % 8], _mm256_add_epi64(a, b));
        }
    }
    let mut out = [0u64; 4];
    for a in acc {
        let mut l = [0u64; 4];
        _mm256_storeu_si256(l.as_mut_ptr() as *mut __m256i, a);
        for k in 0..4 {
            out[k] = out[k].wrapping_add(l[k]);
        }
    }
    out.iter().fold(0, |a, &b| a.wrapping_add(b))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every path gives the scalar sum (wrapping adds commute, so exactly), on values that
    /// overflow and on stream counts past the eight accumulators.
    #[test]
    fn stream_sums_equal_the_scalar_reference() {
        crate::testutil::avx512f("the AVX-512 stream sums");
        let mut s = 0x9e37_79b9_7f4a_7c15u64;
        let buf: Vec<u64> = (0..8 * 9 * 40 + 5)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                s
            })
            .collect();
        for streams in [1, 2, 4, 8, 9] {
            for seg in [0, 8, 16, 320] {
                let want = sum_streams_portable(&buf, streams, seg);
                let plain: u64 = buf[..streams * seg].iter().fold(0, |a, &b| a.wrapping_add(b));
                assert_eq!(want, plain, "reference, {streams} streams of {seg}");
                assert_eq!(sum_streams(&buf, streams, seg), want, "{streams} streams of {seg}");
                #[cfg(target_arch = "x86_64")]
                if crate::simd::has_avx2_fma() {
                    // SAFETY: AVX2 checked; bounds as asserted by `sum_streams`.
                    assert_eq!(unsafe { sum_streams_avx2(&buf, streams, seg) }, want, "AVX2");
                }
            }
        }
    }

    /// The byte form reads whole lines of the aligned words, from any starting byte: its sum
    /// is the plain sum of exactly the words it says it read.
    #[test]
    fn byte_sums_read_the_aligned_words_they_report() {
        let words: Vec<u64> = (0..1000u64).map(|i| i.wrapping_mul(0x9e37_79b9_7f4a_7c15)).collect();
        let bytes: Vec<u8> = words.iter().flat_map(|w| w.to_le_bytes()).collect();
        for skip in [0usize, 1, 7, 8, 13] {
            let b = &bytes[skip..];
            let (sum, read) = sum_bytes(b, 4);
            let first = (8 - b.as_ptr() as usize % 8) % 8;
            assert_eq!(read % (4 * 64), 0, "whole lines of each stream");
            assert!(first + read <= b.len() && read + 4 * 64 + 16 > b.len(), "skip {skip}: read {read}");
            let plain = b[first..first + read]
                .chunks_exact(8)
                .fold(0u64, |a, c| a.wrapping_add(u64::from_le_bytes(c.try_into().unwrap())));
            assert_eq!(sum, plain, "skip {skip}");
        }
        assert_eq!(sum_bytes(&bytes[..100], 4), (0, 0), "no whole line per stream");
    }
}
