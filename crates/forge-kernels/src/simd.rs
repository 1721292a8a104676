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

/// `row ← s·row; acc ← acc + alpha·row`, element by element (one pass over `row`).
macro_rules! scale_axpy_body {
    ($s:expr, $row:expr, $alpha:expr, $acc:expr, $fma:expr) => {{
        let (s, alpha): (f32, f32) = ($s, $alpha);
        let (row, acc): (&mut [f32], &mut [f32]) = ($row, $acc);
        for (r, a) in row.iter_mut().zip(acc.iter_mut()) {
            *r *= s;
            *a = $fma(alpha, *r, *a);
        }
    }};
}

/// `row ← row + alpha·x; acc ← acc + beta·row`, element by element (one pass over `row`).
macro_rules! axpy2_body {
    ($alpha:expr, $x:expr, $row:expr, $beta:expr, $acc:expr, $fma:expr) => {{
        let (alpha, beta): (f32, f32) = ($alpha, $beta);
        let (x, row, acc): (&[f32], &mut [f32], &mut [f32]) = ($x, $row, $acc);
        for ((r, &xi), a) in row.iter_mut().zip(x).zip(acc.iter_mut()) {
            *r = $fma(alpha, xi, *r);
            *a = $fma(beta, *r, *a);
        }
    }};
}

#[inline(always)]
fn mul_add_plain(a: f32, b: f32, c: f32) -> f32 {
    a * b + c
}
#[cfg(target_arch = "x86_64")]
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

/// Whether the integer-dot and LUT kernels have a SIMD build on this CPU: AVX2 + FMA on x86-64
/// (detected at run time), NEON on aarch64 (part of the base architecture).
#[inline]
pub fn has_int_simd() -> bool {
    cfg!(target_arch = "aarch64") || has_avx2_fma()
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

/// Multiply-adds per second of this core's 512-bit units, `(f32 FMA, byte vpdpbusd)`, from a
/// probe of independent chains run once per process (about a millisecond); `None` without the
/// AVX-512 kernels. For reports (`forge bench`): a Zen 4 core issues one 512-bit FMA or
/// `vpdpbusd` a cycle (16 or 64 multiply-adds), the Xeons two of each.
pub fn dot_rates() -> Option<(f64, f64)> {
    #[cfg(target_arch = "x86_64")]
    {
        use std::sync::OnceLock;
        static RATES: OnceLock<Option<(f64, f64)>> = OnceLock::new();
        *RATES.get_or_init(|| {
            if !has_avx512_kernels() {
                return None;
            }
            let (mut f, mut d) = (f64::INFINITY, f64::INFINITY);
            let n = 4096;
            for _ in 0..5 {
                let t = std::time::Instant::now();
                // SAFETY: AVX-512 F and VNNI were detected above.
                std::hint::black_box(unsafe { probe_fma(n) });
                f = f.min(t.elapsed().as_secs_f64());
                let t = std::time::Instant::now();
                // SAFETY: as above.
                std::hint::black_box(unsafe { probe_dpbusd(n) });
                d = d.min(t.elapsed().as_secs_f64());
            }
            let ops = (n * PROBE_CHAINS) as f64;
            Some((ops * 16.0 / f.max(1e-9), ops * 64.0 / d.max(1e-9)))
        })
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        None
    }
}

/// f32 multiply-adds per second of one core's widest FMA units (512-bit with the AVX-512
/// kernels, else 256-bit AVX2/FMA), the peak that dense linear algebra is judged against;
/// `None` without FMA. f64 runs at half the f32 rate on the same units. Measured on the calling
/// thread: run it on every thread at once for the machine's peak.
pub fn fma_peak() -> Option<f64> {
    #[cfg(target_arch = "x86_64")]
    {
        if let Some((f, _)) = dot_rates() {
            return Some(f);
        }
        if !has_avx2_fma() {
            return None;
        }
        let n = 1 << 16;
        let mut best = f64::INFINITY;
        for _ in 0..5 {
            let t = std::time::Instant::now();
            // SAFETY: AVX2 and FMA were detected above.
            std::hint::black_box(unsafe { probe_fma256(n) });
            best = best.min(t.elapsed().as_secs_f64());
        }
        Some((n * PROBE_CHAINS * 8) as f64 / best.max(1e-9))
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        None
    }
}

/// `n` rounds of [`PROBE_CHAINS`] independent 256-bit FMAs `a = a·0.999 + 0.001`, chain `i`
/// starting at `i`; returns the sum of every lane, chain by chain.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn probe_fma256(n: usize) -> f32 {
    use std::arch::x86_64::*;
    let (b, c) = (_mm256_set1_ps(0.999), _mm256_set1_ps(1e-3));
    let mut a: [__m256; PROBE_CHAINS] = std::array::from_fn(|i| _mm256_set1_ps(i as f32));
    for _ in 0..n {
        for v in a.iter_mut() {
            *v = _mm256_fmadd_ps(*v, b, c);
        }
    }
    let mut sum = 0f32;
    for v in a {
        let mut lanes = [0f32; 8];
        _mm256_storeu_ps(lanes.as_mut_ptr(), v);
        sum += lanes.iter().sum::<f32>();
    }
    sum
}

/// Independent accumulator chains of the probe: enough to cover latency 4–5 at two a cycle.
#[cfg(target_arch = "x86_64")]
const PROBE_CHAINS: usize = 12;

/// `n` rounds of [`PROBE_CHAINS`] independent 512-bit FMAs.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn probe_fma(n: usize) -> f32 {
    use std::arch::x86_64::*;
    let (b, c) = (_mm512_set1_ps(0.999), _mm512_set1_ps(1e-3));
    let mut a: [__m512; PROBE_CHAINS] = std::array::from_fn(|i| _mm512_set1_ps(i as f32));
    for _ in 0..n {
        for v in a.iter_mut() {
            *v = _mm512_fmadd_ps(*v, b, c);
        }
    }
    a.iter().map(|&v| _mm512_reduce_add_ps(v)).sum()
}

/// `n` rounds of [`PROBE_CHAINS`] independent 512-bit `vpdpbusd`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512vnni")]
unsafe fn probe_dpbusd(n: usize) -> i32 {
    use std::arch::x86_64::*;
    let (b, c) = (_mm512_set1_epi8(3), _mm512_set1_epi8(-2));
    let mut a: [__m512i; PROBE_CHAINS] = std::array::from_fn(|i| _mm512_set1_epi32(i as i32));
    for _ in 0..n {
        for v in a.iter_mut() {
            *v = _mm512_dpbusd_epi32(*v, b, c);
        }
    }
    a.iter().map(|&v| _mm512_reduce_add_epi32(v)).fold(0, i32::wrapping_add)
}

/// F16C with AVX2/FMA (FP16 weights widened in registers).
#[inline]
pub fn has_f16c() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        use std::sync::OnceLock;
        static HAS: OnceLock<bool> = OnceLock::new();
        *HAS.get_or_init(|| has_avx2_fma() && is_x86_feature_detected!("f16c"))
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// Dot product of the common prefix of `a` and the FP16 values (bits) `b`, in f32.
#[inline]
pub fn dot_f16(a: &[f32], b: &[u16]) -> f32 {
    dot16::<false, false>(a, b)
}

/// [`dot_f16`] for rows of a matrix read from memory row after row: it asks for the lines
/// 16 KiB ahead into L2, so that such a matrix (a low-rank branch's `B`, 64 rows of 5120–6144
/// values) streams from memory 1.2–1.5× as fast as on the hardware prefetchers alone
/// (`examples/lowrank_probe.rs` compares the two). The same result.
#[inline]
pub fn dot_f16_stream(a: &[f32], b: &[u16]) -> f32 {
    dot16::<true, false>(a, b)
}

/// Dot product of the common prefix of `a` and the BF16 values (bits) `b`, in f32, asking for
/// `b`'s lines ahead as [`dot_f16_stream`] does (rows of a dense BF16 matrix at decode).
#[inline]
pub fn dot_bf16_stream(a: &[f32], b: &[u16]) -> f32 {
    dot16::<true, true>(a, b)
}

/// A 16-bit value as f32: BF16 is the top half of an f32, FP16 is widened.
#[inline(always)]
fn widen16<const BF16: bool>(w: u16) -> f32 {
    if BF16 {
        f32::from_bits((w as u32) << 16)
    } else {
        half::f16::from_bits(w).to_f32()
    }
}

#[inline]
fn dot16<const STREAM: bool, const BF16: bool>(a: &[f32], b: &[u16]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if has_f16c() {
        // SAFETY: the CPU supports AVX2, FMA and F16C (checked at run time above).
        return unsafe { dot16_avx2::<STREAM, BF16>(a, b) };
    }
    dot16_portable::<BF16>(a, b)
}

fn dot16_portable<const BF16: bool>(a: &[f32], b: &[u16]) -> f32 {
    let mut acc = [0f32; 8];
    let n = a.len().min(b.len());
    for (ca, cb) in a[..n].chunks(8).zip(b[..n].chunks(8)) {
        for ((s, &x), &w) in acc.iter_mut().zip(ca).zip(cb) {
            *s += x * widen16::<BF16>(w);
        }
    }
    acc.iter().sum()
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot16_avx2<const STREAM: bool, const BF16: bool>(a: &[f32], b: &[u16]) -> f32 {
    use std::arch::x86_64::*;
    let n = a.len().min(b.len());
    let (pa, pb) = (a.as_ptr(), b.as_ptr());
    // Eight 16-bit values at `p` as f32 (BF16: zero-extended and shifted into the top half).
    let widen = |p: *const u16| {
        let v = _mm_loadu_si128(p as *const __m128i);
        if BF16 {
            _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(v)))
        } else {
            _mm256_cvtph_ps(v)
        }
    };
    let mut acc = [_mm256_setzero_ps(); 4];
    let mut i = 0;
    // SAFETY (all loads): `i + 8·(u + 1) ≤ n` before each, within both slices; a prefetch
    // reads nothing.
    while i + 32 <= n {
        if STREAM {
            _mm_prefetch::<_MM_HINT_T1>((pb.add(i) as *const i8).wrapping_add(16384));
        }
        for (u, s) in acc.iter_mut().enumerate() {
            *s = _mm256_fmadd_ps(_mm256_loadu_ps(pa.add(i + 8 * u)), widen(pb.add(i + 8 * u)), *s);
        }
        i += 32;
    }
    while i + 8 <= n {
        acc[0] = _mm256_fmadd_ps(_mm256_loadu_ps(pa.add(i)), widen(pb.add(i)), acc[0]);
        i += 8;
    }
    let s = _mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3]));
    let h = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps::<1>(s));
    let h = _mm_add_ps(h, _mm_movehl_ps(h, h));
    let h = _mm_add_ss(h, _mm_shuffle_ps::<1>(h, h));
    let mut r = _mm_cvtss_f32(h);
    for k in i..n {
        r += a[k] * widen16::<BF16>(b[k]);
    }
    r
}

/// Asks for the `span` bytes from `ahead` bytes past `p` to be brought into L2, one request per
/// 64-byte line. A hint: any address will do, nothing is read.
#[inline]
pub fn prefetch_l2(p: *const u8, span: usize, ahead: usize) {
    #[cfg(target_arch = "x86_64")]
    for o in (0..span).step_by(64) {
        // SAFETY: a prefetch never faults and reads nothing into the program; SSE is part of
        // x86-64.
        unsafe {
            std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T1 }>(p.wrapping_add(ahead + o) as *const i8)
        };
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (p, span, ahead);
}

/// `row ← s·row`, then `acc ← acc + alpha·row`, in one pass: the same roundings as a scale
/// followed by [`axpy`].
#[inline]
pub fn scale_axpy(s: f32, row: &mut [f32], alpha: f32, acc: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if has_avx2_fma() {
        // SAFETY: the CPU supports AVX2 and FMA (checked at run time above).
        return unsafe { scale_axpy_avx2(s, row, alpha, acc) };
    }
    scale_axpy_body!(s, row, alpha, acc, mul_add_plain)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn scale_axpy_avx2(s: f32, row: &mut [f32], alpha: f32, acc: &mut [f32]) {
    scale_axpy_body!(s, row, alpha, acc, mul_add_fused)
}

/// `row ← row + alpha·x`, then `acc ← acc + beta·row`, in one pass: the same roundings as two
/// [`axpy`] calls.
#[inline]
pub fn axpy2(alpha: f32, x: &[f32], row: &mut [f32], beta: f32, acc: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if has_avx2_fma() {
        // SAFETY: the CPU supports AVX2 and FMA (checked at run time above).
        return unsafe { axpy2_avx2(alpha, x, row, beta, acc) };
    }
    axpy2_body!(alpha, x, row, beta, acc, mul_add_plain)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn axpy2_avx2(alpha: f32, x: &[f32], row: &mut [f32], beta: f32, acc: &mut [f32]) {
    axpy2_body!(alpha, x, row, beta, acc, mul_add_fused)
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

macro_rules! axpy_lanes_body {
    ($alpha:expr, $x:expr, $tile:expr, $fma:expr) => {{
        let alpha: &[f32; 8] = $alpha;
        let (x, tile): (&[f32], &mut [[f32; 8]]) = ($x, $tile);
        for (col, &xj) in tile.iter_mut().zip(x) {
            for (v, &a) in col.iter_mut().zip(alpha) {
                *v = $fma(a, xj, *v);
            }
        }
    }};
}

fn axpy_lanes8_portable(alpha: &[f32; 8], x: &[f32], tile: &mut [[f32; 8]]) {
    axpy_lanes_body!(alpha, x, tile, mul_add_plain)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn axpy_lanes8_avx2(alpha: &[f32; 8], x: &[f32], tile: &mut [[f32; 8]]) {
    use std::arch::x86_64::*;
    // One vector per column, the eight rows in its lanes (left to itself, the compiler vectorizes
    // along the columns instead and spends its time transposing).
    let a = _mm256_loadu_ps(alpha.as_ptr());
    for (col, &xj) in tile.iter_mut().zip(x) {
        let p = col.as_mut_ptr();
        // SAFETY: `p` points at the column's eight f32.
        unsafe { _mm256_storeu_ps(p, _mm256_fmadd_ps(a, _mm256_set1_ps(xj), _mm256_loadu_ps(p))) };
    }
}

/// `tile[j][r] += alpha[r] · x[j]`: [`axpy`] on eight rows held side by side (lane `r` of
/// each column), every value the same bits as `axpy(alpha[r], x, row r)` would give.
#[inline]
pub fn axpy_lanes8(alpha: &[f32; 8], x: &[f32], tile: &mut [[f32; 8]]) {
    #[cfg(target_arch = "x86_64")]
    if has_avx2_fma() {
        // SAFETY: the CPU supports AVX2 and FMA (checked at run time above).
        return unsafe { axpy_lanes8_avx2(alpha, x, tile) };
    }
    axpy_lanes8_portable(alpha, x, tile)
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

    #[test]
    fn axpy_lanes8_is_axpy_per_row() {
        let mut r = 0x2545f491u32;
        let mut next = || {
            r ^= r << 13;
            r ^= r >> 17;
            r ^= r << 5;
            (r as f32 / u32::MAX as f32) * 2.0 - 1.0
        };
        for len in [0, 1, 7, 8, 9, 127] {
            let alpha: [f32; 8] = std::array::from_fn(|_| next() * 3.0);
            let x: Vec<f32> = (0..len).map(|_| next()).collect();
            let mut tile: Vec<[f32; 8]> = (0..len).map(|_| std::array::from_fn(|_| next())).collect();
            let rows: Vec<Vec<f32>> = (0..8).map(|l| tile.iter().map(|c| c[l]).collect()).collect();
            let mut plain = tile.clone();
            axpy_lanes8(&alpha, &x, &mut tile);
            axpy_lanes8_portable(&alpha, &x, &mut plain);
            for (l, row) in rows.iter().enumerate() {
                let (mut fast, mut slow) = (row.clone(), row.clone());
                axpy(alpha[l], &x, &mut fast);
                axpy_portable(alpha[l], &x, &mut slow);
                let lane = |t: &[[f32; 8]]| t.iter().map(|c| c[l].to_bits()).collect::<Vec<u32>>();
                let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<u32>>();
                assert_eq!(lane(&tile), bits(&fast), "len {len}, lane {l}");
                assert_eq!(lane(&plain), bits(&slow), "len {len}, lane {l}");
            }
        }
    }

    #[cfg(target_arch = "x86_64")]
    #[test]
    fn fma_probe_computes_its_chains() {
        if !has_avx2_fma() {
            eprintln!("fma_probe_computes_its_chains: no AVX2/FMA on this CPU, skipped");
            return;
        }
        let n = 1000;
        // SAFETY: AVX2 and FMA were detected above.
        let got = unsafe { probe_fma256(n) };
        let mut want = 0f32;
        for i in 0..PROBE_CHAINS {
            let mut a = i as f32;
            for _ in 0..n {
                a = a.mul_add(0.999, 1e-3);
            }
            want += (0..8).map(|_| a).sum::<f32>();
        }
        assert_eq!(got, want);
        assert!(fma_peak().unwrap() > 1e8);
    }

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
    fn dot_f16_matches_an_f64_reference_on_ragged_lengths() {
        for n in [0, 1, 7, 8, 9, 31, 32, 33, 100, 1023, 5120] {
            let a = data(n, 5);
            let b: Vec<u16> = data(n, 6).iter().map(|&v| half::f16::from_f32(v).to_bits()).collect();
            let w: Vec<f64> = b.iter().map(|&v| half::f16::from_bits(v).to_f64()).collect();
            let r: f64 = a.iter().zip(&w).map(|(&x, &y)| x as f64 * y).sum();
            let tol = 1e-5 * (1.0 + a.iter().zip(&w).map(|(&x, y)| (x as f64 * y).abs()).sum::<f64>());
            for (name, d) in [("dispatch", dot_f16(&a, &b)), ("portable", dot16_portable::<false>(&a, &b))] {
                assert!((d as f64 - r).abs() <= tol, "{name}, n={n}: {d} vs {r}");
            }
            // The streaming variant only asks for lines ahead: the same bits.
            assert_eq!(dot_f16_stream(&a, &b).to_bits(), dot_f16(&a, &b).to_bits(), "n={n}");
        }
    }

    #[test]
    fn dot_bf16_matches_an_f64_reference_on_ragged_lengths() {
        for n in [0, 1, 7, 8, 9, 31, 32, 33, 100, 1023, 5120] {
            let a = data(n, 7);
            let b: Vec<u16> = data(n, 8).iter().map(|&v| half::bf16::from_f32(v).to_bits()).collect();
            let w: Vec<f64> = b.iter().map(|&v| half::bf16::from_bits(v).to_f64()).collect();
            let r: f64 = a.iter().zip(&w).map(|(&x, &y)| x as f64 * y).sum();
            let tol = 1e-5 * (1.0 + a.iter().zip(&w).map(|(&x, y)| (x as f64 * y).abs()).sum::<f64>());
            for (name, d) in [("dispatch", dot_bf16_stream(&a, &b)), ("portable", dot16_portable::<true>(&a, &b))] {
                assert!((d as f64 - r).abs() <= tol, "{name}, n={n}: {d} vs {r}");
            }
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
