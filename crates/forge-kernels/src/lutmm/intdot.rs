//! Integer-dot kernels: codebooks as 8-bit integers looked up with `pshufb`, activations as a
//! 16-bit plane (multiplied with `pmaddwd`) and a 7-bit plane for its residual (multiplied with
//! `pmaddubsw` on the weight bytes), products summed into 32-bit integers.
//!
//! A LUT codebook qualifies when it is `f · q` with `f` a power of two and `q` 8-bit integers
//! (the quantizer snaps its codebooks to that grid; see `forge_quant::fit::snap_codebook`). Then
//! a weight is exactly `scale[row] · f · q[idx]`, and the kernel's only approximation is the
//! activation: each block of [`XBLOCK`] inputs of a row is written as two planes with their own
//! scales (see [`QuantX`]; within ~2⁻²³ of the block's largest magnitude), so an outlier only
//! coarsens its own block. Integer sums are exact (a lane of a block cannot overflow 32 bits);
//! each block's eight lane sums are fused into f32 lanes, summed in one fixed order per row.
//!
//! # Layout
//! An index row (one output row, or a row pair for the vector formats, whose index covers both)
//! is stored as chunks of [`CHUNK`] = 32 input columns, column `j0 + m` being byte `m` of the
//! decoded 32-byte vector:
//! - lut4, vec2x16: 16 bytes, byte `b` = index of `m = b` (low nibble) and `m = 16 + b` (high).
//! - vec2x64: those 16 bytes for the low 4 index bits, then 8 bytes for the top 2 bits: bit 5
//!   of the index of `m = 8q + r` is bit `7 − 2q` of byte `r`, bit 4 is bit `6 − 2q` (a
//!   broadcast and a 64-bit variable shift by `2q` bring both to the top of byte `m`).
//! - lut2: 8 bytes, byte `b` holding the indices of `m = b, 8 + b, 16 + b, 24 + b` at bits
//!   0–1, 2–3, 4–5, 6–7 (one 64-bit variable shift of a broadcast brings each to its byte).
//!   Where the AVX-512 kernels run, a row's chunks go in groups of eight instead (64 bytes,
//!   see [`group_field`]), and the chunks after its last whole group as above; so do lut4's
//!   and vec2x16's (groups of four chunks), lut3's and vec2x64's (16 and 8 chunks in 192
//!   bytes; after the last group their stream layouts below).
//! - lut3: lut2's 8 bytes for the low two index bits, then a 32-bit word with bit 2 of each
//!   index (bit `8k + 7 − d` for column `4d + k`); where the AVX-512 kernels run, one stream of 3-bit fields instead
//!   (see [`six_bit_layout`]).
//! - int8: the 32 weights.
//!
//! A 64-entry vec2x64 table is four 16-entry tables: four `pshufb` lookups with the low index
//! bits, then two byte blends pick by bit 4 and one by bit 5 (`vpblendvb` reads each byte's
//! top bit, which is where the layout puts them).
//! Rows past the input width are padded with index 0 against zero activations.

use crate::lut::{Format, Int8Matrix, LutMatrix};
use rayon::prelude::*;

/// Input columns per chunk.
pub const CHUNK: usize = 32;
/// Input columns sharing one activation scale. The kernels sum each block in eight 32-bit
/// lanes (wrapping adds, so exact whenever the true sum fits): a lane holds `XBLOCK / 8`
/// products `w · q` with `|w| ≤ 128` and `|q| ≤ 32767`, at most `256 · 128 · 32767 < 2³¹`.
/// Then each lane goes to f32 once per block ([`accumulate`]). SmolLM2's rows (576 and 1536
/// inputs) are one block; the block's loop-exit and lane conversion are paid once per row.
pub const XBLOCK: usize = 2048;
/// Activation rows per pass of the scalar reference.
pub const PASS_T: usize = 4;

/// Adds one block's exact lane sums of one activation plane into a row's f32 lanes,
/// `lanes[l] = fma(a[l] as f32, s, lanes[l])`: the one f32 step per block that the scalar
/// reference and every SIMD kernel share, so that they agree bit for bit.
#[inline(always)]
fn accumulate(lanes: &mut [f32; LANES], a: &[i64; LANES], s: f32) {
    for (l, &v) in lanes.iter_mut().zip(a) {
        // Exact: a lane's block sum fits in 32 bits (see XBLOCK).
        *l = (v as i32 as f32).mul_add(s, *l);
    }
}

static PLANES: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(2);

/// Activation planes for the integer kernels from now on: 2 (default; SmolLM2's logits within
/// ~1e-4 of the f32 reference) or 1 (the 16-bit plane alone: fewer multiplies, logits move by up
/// to ~5e-3). Process-wide, like llama.cpp's activation type.
pub fn set_activation_planes(n: usize) {
    assert!(n == 1 || n == 2, "1 or 2 activation planes");
    PLANES.store(n, std::sync::atomic::Ordering::Relaxed)
}

static AVX512: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(true);

/// Whether the integer kernels may use their AVX-512 variants (VNNI multiply-accumulates,
/// VBMI lookups) where the CPU has them (default), or keep to AVX2 (for tests and
/// comparisons). Both give the same bits.
pub fn set_avx512(on: bool) {
    AVX512.store(on, std::sync::atomic::Ordering::Relaxed)
}

static WIDE: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(true);

/// Whether decode (one activation row) may run the AVX-512 kernels on 512-bit vectors (default)
/// or keep them to 256-bit vectors (for comparisons, or CPUs that slow their clock for 512-bit
/// work). Each equals its own scalar reference bit for bit; the two differ within the
/// activations' two-plane bound (the 512-bit layout's codes end at ±32639, not ±32767).
pub fn set_wide(on: bool) {
    WIDE.store(on, std::sync::atomic::Ordering::Relaxed)
}

/// How prefill (from [`GEMM_MIN_T`] rows) multiplies integer-dot matrices.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Prefill {
    /// Byte planes where the 512-bit integer kernels run, else f32 tiles (default).
    Auto,
    /// Byte planes through `vpdpbusd` (AVX-512 VNNI; elsewhere f32).
    Int,
    /// Weights decoded to f32, FMA tiles.
    F32,
}

impl Prefill {
    pub fn parse(s: &str) -> anyhow::Result<Prefill> {
        match s {
            "auto" => Ok(Prefill::Auto),
            "int" => Ok(Prefill::Int),
            "f32" => Ok(Prefill::F32),
            _ => anyhow::bail!("unknown prefill kernels {s:?} (auto, int or f32)"),
        }
    }
}

static PREFILL: std::sync::atomic::AtomicU8 = std::sync::atomic::AtomicU8::new(0);

/// Which kernels prefill takes from now on (process-wide; [`Prefill::Auto`] by default).
pub fn set_prefill(p: Prefill) {
    PREFILL.store(p as u8, std::sync::atomic::Ordering::Relaxed)
}

/// Whether prefill takes the byte planes ([`prefill::gemm_many_int`]) here. Their three
/// `vpdpbusd` per 64 weights give 21⅓ multiply-adds an instruction against an FMA's 16, and
/// the cores with these kernels (Zen 4, the Xeons) issue `vpdpbusd` at their FMA rate
/// (`forge bench` reports both rates), so auto takes them wherever the kernels run. It is
/// decided from the CPU's features alone, not by a probe timed at start: under load such a
/// probe can choose differently from one process to the next, and the two paths' logits
/// differ in the seventh digit, so results would depend on the machine's load.
fn int_prefill() -> bool {
    if !avx512() {
        return false;
    }
    PREFILL.load(std::sync::atomic::Ordering::Relaxed) != Prefill::F32 as u8
}

/// Prefill's kernels here, for reports.
pub fn prefill_isa() -> &'static str {
    if int_prefill() {
        "byte planes, vpdpbusd"
    } else if simd_f32_wide() {
        "f32 tiles, 16 wide"
    } else {
        "f32 tiles"
    }
}

fn simd_f32_wide() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        avx512_f32()
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// The instruction sets the integer kernels run on here, for reports.
pub fn isa() -> &'static str {
    match (crate::simd::has_avx2_fma(), avx512(), wide()) {
        (true, true, true) => "AVX-512 VNNI/VBMI (512-bit decode)",
        (true, true, false) => "AVX-512 VNNI/VBMI (256-bit)",
        (true, false, true) => "AVX2, AVX-512 decode",
        (true, false, false) => "AVX2",
        _ if cfg!(target_arch = "aarch64") && paired_layout() => "NEON with dot product",
        _ if cfg!(target_arch = "aarch64") => "NEON",
        _ => "portable (no AVX2)",
    }
}

/// Decode rows go through the 512-bit kernels (and their pair layout of the activations, whose
/// codes have a slightly smaller range: so this does not follow [`set_avx512`], which must not
/// change results).
fn wide() -> bool {
    WIDE.load(std::sync::atomic::Ordering::Relaxed) && crate::simd::has_avx512_kernels()
}

/// Whether this CPU has kernels for the pair layout of the activations (`QuantX::paired`): the
/// 512-bit x86 kernels (AVX-512 VBMI/VNNI), or on aarch64 the dot-product extension.
pub fn paired_kernels() -> bool {
    #[cfg(target_arch = "aarch64")]
    {
        neon::has_dotprod()
    }
    #[cfg(not(target_arch = "aarch64"))]
    {
        crate::simd::has_avx2_fma() && crate::simd::has_avx512_kernels()
    }
}

/// Whether activations are quantized in the pair layout: its kernels exist here and
/// [`set_wide`] has not turned it off.
fn paired_layout() -> bool {
    WIDE.load(std::sync::atomic::Ordering::Relaxed) && paired_kernels()
}

/// AVX-512 variants allowed and the CPU has them.
fn avx512() -> bool {
    AVX512.load(std::sync::atomic::Ordering::Relaxed) && crate::simd::has_avx512_kernels()
}

/// Prefill's f32 tiles may run 16 wide: AVX-512 variants allowed and the CPU has AVX-512 F.
#[cfg(target_arch = "x86_64")]
fn avx512_f32() -> bool {
    AVX512.load(std::sync::atomic::Ordering::Relaxed) && crate::simd::has_avx512f()
}

/// Largest 16-bit activation magnitude.
const XMAX: f32 = 32767.0;
/// The same for the pair layout of the 512-bit decode, whose 16-bit codes go in as two signed
/// bytes `q₁ = 256·h + l` (`l` in ±128, `h` in ±127 up to here).
const XMAX_PAIRED: f32 = 32639.0;
/// Largest second-plane code: `pmaddubsw` adds two products of a weight byte (≤ 255) and a
/// code without saturating (2 · 255 · 63 < 2¹⁵).
const XMAX2: f32 = 63.0;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    Lut4,
    Lut3,
    Lut2,
    Vec2x16,
    Vec2x64,
    Int8,
}

impl Kind {
    /// The integer-dot kind of a format, if it has one.
    fn of(format: Format) -> Option<Kind> {
        match format {
            Format::Lut4 => Some(Kind::Lut4),
            Format::Lut3 => Some(Kind::Lut3),
            Format::Lut2 => Some(Kind::Lut2),
            Format::Vec2x16 => Some(Kind::Vec2x16),
            Format::Vec2x64 => Some(Kind::Vec2x64),
            Format::Int8 => Some(Kind::Int8),
            _ => None,
        }
    }

    fn name(self) -> &'static str {
        match self {
            Kind::Lut4 => "lut4",
            Kind::Lut3 => "lut3",
            Kind::Lut2 => "lut2",
            Kind::Vec2x16 => "vec2x16",
            Kind::Vec2x64 => "vec2x64",
            Kind::Int8 => "int8",
        }
    }

    fn parse(s: &str) -> anyhow::Result<Kind> {
        [Kind::Lut4, Kind::Lut3, Kind::Lut2, Kind::Vec2x16, Kind::Vec2x64, Kind::Int8]
            .into_iter()
            .find(|k| k.name() == s)
            .ok_or_else(|| anyhow::anyhow!("unknown integer-dot layout '{s}'"))
    }

    fn n_tables(self) -> usize {
        match self {
            Kind::Lut4 | Kind::Lut2 => 1,
            Kind::Lut3 | Kind::Vec2x16 => 2,
            Kind::Vec2x64 => 8,
            Kind::Int8 => 0,
        }
    }

    fn chunk_bytes(self) -> usize {
        match self {
            Kind::Lut4 | Kind::Vec2x16 => 16,
            Kind::Lut3 => 12,
            Kind::Lut2 => 8,
            Kind::Vec2x64 => 24,
            Kind::Int8 => 32,
        }
    }

    /// Activation rows per pass: the vector formats keep twice the accumulators per row.
    fn pass_t(self) -> usize {
        PASS_T / self.rows()
    }

    /// Whether the kind packs to a layout of its own where the AVX-512 kernels run
    /// ([`six_bit_layout`]): a stream of index fields (vec2x64, lut3), groups of eight chunks
    /// (lut2).
    fn has_stream_layout(self) -> bool {
        self != Kind::Int8
    }

    /// Bits of an index.
    fn index_bits(self) -> usize {
        match self {
            Kind::Lut2 => 2,
            Kind::Lut3 => 3,
            Kind::Lut4 | Kind::Vec2x16 => 4,
            Kind::Vec2x64 => 6,
            Kind::Int8 => 8,
        }
    }

    /// Output rows per index row.
    fn rows(self) -> usize {
        match self {
            Kind::Vec2x16 | Kind::Vec2x64 => 2,
            _ => 1,
        }
    }
}

/// Bit of a lut3 chunk's 32-bit word (bytes 8–11) that holds bit 2 of column `m = 4d + k`'s
/// index: `8k + 7 − d`, so that shifting 32-bit word `d` of a broadcast left by `d` puts it at
/// the top of byte `k` (`vpblendvb` and `vpmovb2m` read that bit).
fn hi_bit(m: usize) -> usize {
    8 * (m % 4) + 7 - m / 4
}

/// Chunks per group of a kind's AVX-512 layout ([`group_field`]): lut2 four pairs in one
/// 64-byte plane, vec2x64 four and lut3 eight pairs in three; 0 for the kinds without one.
const fn group_chunks(kind: Kind) -> usize {
    match kind {
        Kind::Lut4 | Kind::Vec2x16 => 4,
        Kind::Lut2 | Kind::Vec2x64 => 8,
        Kind::Lut3 => 16,
        Kind::Int8 => 0,
    }
}

/// Chunks of a row of `nchunks` in whole groups of the kind's AVX-512 layout (`six`; the rest
/// follow in its stream layout), 0 in the other layouts.
fn grouped_chunks(kind: Kind, six: bool, nchunks: usize) -> usize {
    match group_chunks(kind) {
        g if six && g > 0 => nchunks / g * g,
        _ => 0,
    }
}

/// Where the AVX-512 layout keeps bit `j` of the index of column `m` of chunk `c` (in a whole
/// group): the byte of the group and the bit of that byte.
///
/// A group is one (lut2) or three (vec2x64, lut3) 64-byte planes, and byte `b` of each plane
/// is position `b` of the 512-bit kernels' pair order (`[A 0–15 | B 0–15 | A 16–31 | B 16–31]`,
/// `A`, `B` the chunks of a pair), so a pair's fields sit at the same bits of every byte. `vpermb`
/// reads bits 0–5 of an index byte, and a table that repeats at the right stride reads any field
/// within them, so most pairs need no extraction at all:
/// - lut2: pair `k` at bits `2k..2k + 2` (tables repeating every 4, 16 and 64 entries give pairs
///   0–2, one 16-bit shift brings pair 3 down).
/// - vec2x64: pairs 0–2 in bits 0–5 of planes 0–2; pair 3 in the planes' top two bits (index
///   bits 0–1 in plane 0, 2–3 in plane 1, 4–5 in plane 2), gathered by three 16-bit shifts and
///   two bit selects.
/// - lut3: the same four six-bit slots, each holding two pairs (pair `k` at bits `3(k % 2)` of
///   slot `k / 2`; tables repeating every 8 entries, or each entry eight times, read them).
///
/// The stream and nibble layouts need a `vpermb` spread and a `vpmultishiftqb` per pair (on a
/// Zen 4 the shift takes a `vpdpbusd` slot), or a broadcast and a shift per pair. In L2, where
/// instructions set the pace, the groups save enough of them to run up to 1.4× as fast (lut3
/// most, vec2x16, with the least to extract, least).
fn group_field(kind: Kind, c: usize, m: usize, j: usize) -> (usize, usize) {
    let (k, s) = (c % group_chunks(kind) / 2, c % 2);
    let b = 32 * (m / 16) + 16 * s + m % 16;
    // The six-bit slot and the bit within it.
    let (slot, bit) = match kind {
        Kind::Lut4 | Kind::Vec2x16 => return (b, 4 * k + j),
        Kind::Lut2 => return (b, 2 * k + j),
        Kind::Vec2x64 => (k, j),
        _ => (k / 2, 3 * (k % 2) + j),
    };
    if slot < 3 {
        (64 * slot + b, bit)
    } else {
        (64 * (bit / 2) + b, 6 + bit % 2)
    }
}

/// A chunk's 32 indices as one little-endian stream of `width`-bit fields (index `m` at bits
/// `width·m..width·(m + 1)`), ORed into `out` (zeroed).
fn pack_stream(out: &mut [u8], width: usize, index: impl Fn(usize) -> u8) {
    for m in 0..CHUNK {
        let (bit, i) = (width * m, (index(m) & ((1 << width) - 1) as u8) as u32);
        let v = i << (bit % 8);
        out[bit / 8] |= v as u8;
        if v >> 8 != 0 {
            out[bit / 8 + 1] |= (v >> 8) as u8;
        }
    }
}

/// Position of column `m` of a chunk in the quantized activations: the order in which the
/// in-lane byte unpacks deliver weights (`[0..8, 16..24]` then `[8..16, 24..32]`).
fn xpos(m: usize) -> usize {
    match m / 8 {
        1 => m + 8,
        2 => m - 8,
        _ => m,
    }
}

/// Activations quantized for the integer kernels: per block, `x ≈ s₁·q₁ + s₂·q₂` with 16-bit
/// `q₁` and 7-bit `q₂` quantizing the residual `x − s₁·q₁`: `|x − x̂| ≤ max|x| / (65534 · 126)`,
/// about 2⁻²³. (`q₂` is a byte plane, not a 16-bit one, because bytes go straight into
/// `pmaddubsw` with the weight bytes, where a 16-bit plane costs two more `pmaddwd` and adds
/// per 32 weights; SmolLM2's logits stay within 1e-4 of the f32 reference.)
///
/// Every finite input is quantized within that bound, whatever its magnitude: a row whose
/// largest magnitude `M` lies outside `[2⁻⁶⁴, 2⁶⁴]` is quantized as `x · 2ᵉ` ([`QuantX::shift`]),
/// and a block far below 1 (or below its row's `M`) from an exact power-of-two prescaled copy.
/// Such a block's kept scales may be subnormal; their rounding adds at most `2⁻¹³⁴` (of
/// `x · 2ᵉ`) to the bound, less than `2⁻⁷⁰ · M`.
#[derive(Default)]
pub struct QuantX {
    pub t: usize,
    /// 2 (default), or 1 after [`set_activation_planes`]`(1)`: `q₂` stays zero and the kernels
    /// skip it.
    pub planes: usize,
    /// Input width rounded up to a whole chunk.
    pub cin_pad: usize,
    pub nblocks: usize,
    /// `t × cin_pad`: per chunk, the 32 `q₁` in [`xpos`] order, zero past the input width.
    pub q: Vec<i16>,
    /// `t × cin_pad`: the second plane's codes `q₂` in `[-63, 63]`, in column order (what
    /// `pmaddubsw` multiplies with the unsigned weight bytes directly).
    pub q2: Vec<i8>,
    /// `t × nblocks × 2`: `(s₁, s₂)` per block.
    pub scale: Vec<f32>,
    /// The pair layout, read by the 512-bit x86 kernels and the NEON `sdot` kernel
    /// ([`paired_kernels`]): codes within ±[`XMAX_PAIRED`], each
    /// whole pair of chunks `A, B` (64 columns) also as the bytes of `q₁ = 256·h + l` in
    /// [`QuantX::qhl`], and `q₂` in pair order `[A 0–15, B 0–15, A 16–31, B 16–31]` (read
    /// through [`QuantX::chunk`], which undoes it). In those pairs the 16-bit plane's lanes are
    /// `vpdpbusd`'s, four consecutive columns per lane ([`QuantX::lane1`]). A last unpaired
    /// chunk stays plain.
    pub paired: bool,
    /// With `paired`: per whole pair of chunks, 64 bytes `h` then 64 bytes `l`, both in pair
    /// order.
    pub qhl: Vec<i8>,
    /// `t × nblocks × 2 × LANES`: per block and plane, `128 · Σ q` over the columns of each
    /// accumulator lane ([`lane`] for `q₁`, [`lane2`] for `q₂`). The SIMD kernels multiply unsigned weights `w + 128` (a zero-extend
    /// instead of a sign-extend) and subtract this to recover `Σ w · q` exactly.
    pub corr: Vec<i32>,
    /// Per row, the exponent `e` of the values the codes and scales describe, `x · 2ᵉ`: 0 unless
    /// the row's largest magnitude lies outside `[2⁻⁶⁴, 2⁶⁴]`, where it is brought into `[1, 2)`
    /// (see [`ROW_LO`]); [`matmul_many`] scales such a row's outputs back by `2⁻ᵉ`. Empty
    /// means 0 for every row.
    pub shift: Vec<i32>,
    /// One block's residuals `x − s₁·q₁` (a kept buffer).
    pub(crate) resid: Vec<f32>,
    /// One block scaled by a power of two, for blocks too small or too large to scale directly
    /// (a kept buffer, grown only when such a block occurs).
    pub(crate) scaled: Vec<f32>,
    /// One row's blocks: largest magnitude and whether all are finite (a kept buffer).
    pub(crate) bmax: Vec<(f32, bool)>,
}

/// Accumulator lanes of the kernels: position `k` of a chunk's stored activations (see
/// [`xpos`]) adds into lane `(k mod 16) / 2` (what `pmaddwd` pairs and sums).
const LANES: usize = 8;

/// Accumulator lane of column `m` of a chunk in the second plane: `pmaddubsw` adds byte pairs
/// and `pmaddwd` by ones adds pairs of those, so lane `l` holds columns `4l..4l + 4`.
#[inline(always)]
fn lane2(m: usize) -> usize {
    m / 4
}

#[inline(always)]
fn lane(k: usize) -> usize {
    (k % 16) / 2
}

/// The fixed order in which a row's eight f32 lanes are summed, `((l0+l1)+(l2+l3)) +
/// ((l4+l5)+(l6+l7))`: the order of the AVX2 horizontal-add tree, which reduces eight rows
/// at once.
#[inline(always)]
pub(crate) fn reduce_lanes(l: &[f32; LANES]) -> f32 {
    ((l[0] + l[1]) + (l[2] + l[3])) + ((l[4] + l[5]) + (l[6] + l[7]))
}

/// Round to nearest, ties to even, for `|v| < 2²²` (adding 1.5·2²³ leaves no fraction bits;
/// plain float ops, unlike `f32::round`'s libm call).
#[inline(always)]
fn round_small(v: f32) -> f32 {
    const M: f32 = 12_582_912.0;
    (v + M) - M
}

/// `⌊log₂ m⌋` of a positive finite `m`, subnormals included (from the bits, the same on every
/// target).
pub(crate) fn floor_log2(m: f32) -> i32 {
    let b = m.to_bits() & 0x7fff_ffff;
    match (b >> 23) as i32 {
        0 => 31 - (b.leading_zeros() as i32) - 149,
        e => e - 127,
    }
}

/// `v · 2ᵏ` for any `k`, in steps that each fit an f32 exponent: exact wherever the result is a
/// normal float (or zero), rounded once or twice where it is subnormal.
pub(crate) fn mul_pow2(mut v: f32, mut k: i32) -> f32 {
    while k != 0 {
        let step = k.clamp(-126, 127);
        v *= pow2(step);
        k -= step;
    }
    v
}

/// Rows whose largest magnitude lies in `[ROW_LO, ROW_HI]` are quantized as they are; others as
/// `x · 2ᵉ` with that magnitude brought into `[1, 2)`, their outputs scaled back by `2⁻ᵉ`
/// ([`QuantX::shift`]). Within the range no block sum can overflow f32 (`|Σ w · x| ≤ 128 ·
/// cin · 2⁶⁴`); below it a row's scales would be subnormal, and lose the precision its outputs
/// can still carry.
const ROW_LO: f32 = pow2(-64);
const ROW_HI: f32 = pow2(64);
/// Blocks whose largest magnitude (after the row's shift) is at least this take the direct
/// path: both scales are normal floats and their inverses finite. Smaller ones are quantized
/// from an exact power-of-two prescaled copy.
const BLOCK_LO: f32 = pow2(-80);
/// The second plane is skipped where the residuals all lie within this fraction of the block's
/// largest magnitude (2⁻⁴⁰, far below the two planes' bound of ~2⁻²³), so that its scale stays
/// a normal float with a finite inverse.
const PLANE2_MIN: f32 = pow2(-40);

/// `2ᵏ` for a normal exponent `k` (−126 to 127).
const fn pow2(k: i32) -> f32 {
    f32::from_bits(((k + 127) as u32) << 23)
}

/// Largest magnitude of `v`, and whether all values are finite; in 8 lanes so that it
/// vectorizes (a NaN fails `is_finite` through the `v · 0` sum).
fn absmax_finite(v: &[f32]) -> (f32, bool) {
    let mut m = [0f32; 8];
    let mut z = [0f32; 8];
    let mut it = v.chunks_exact(8);
    for c in &mut it {
        for k in 0..8 {
            let a = c[k].abs();
            m[k] = if a > m[k] { a } else { m[k] };
            z[k] += c[k] * 0.0;
        }
    }
    for &x in it.remainder() {
        let a = x.abs();
        m[0] = if a > m[0] { a } else { m[0] };
        z[0] += x * 0.0;
    }
    let mx = m.iter().fold(0f32, |a, &b| if b > a { b } else { a });
    (mx, z.iter().sum::<f32>() == 0.0)
}

/// Quantize one chunk (≤ 32 values, zero-padded) with `inv`, writing the codes in [`xpos`]
/// order (columns 0–7 and 24–31 stay, 8–15 and 16–23 swap) and the residuals `v − code · s`
/// in column order.
fn quantize_chunk(v: &[f32], inv: f32, s: f32, out: &mut [i16], resid: &mut [f32]) {
    let mut buf = [0f32; CHUNK];
    buf[..v.len()].copy_from_slice(v);
    let mut codes = [0f32; CHUNK];
    for k in 0..CHUNK {
        codes[k] = round_small(buf[k] * inv);
    }
    let mut q = [0i16; CHUNK];
    for k in 0..CHUNK {
        q[k] = codes[k] as i16;
    }
    out[..8].copy_from_slice(&q[..8]);
    out[8..16].copy_from_slice(&q[16..24]);
    out[16..24].copy_from_slice(&q[8..16]);
    out[24..32].copy_from_slice(&q[24..32]);
    for (k, r) in resid.iter_mut().enumerate().take(v.len()) {
        *r = v[k] - codes[k] * s;
    }
}

/// The second plane's codes of a block's residuals `v`: `round(v · inv)` within ±[`XMAX2`].
fn quantize_plane2(v: &[f32], inv: f32, out: &mut [i8]) {
    for (o, &r) in out.iter_mut().zip(v) {
        *o = round_small(r * inv).clamp(-XMAX2, XMAX2) as i8;
    }
}

thread_local! {
    /// This thread's last quantized activations, kept for their buffers.
    static QUANT_X: std::cell::RefCell<Option<QuantX>> = const { std::cell::RefCell::new(None) };
}

/// `f(qx)` with `t` rows of `cin` values of `x` quantized into this thread's kept buffers (no
/// allocation once they are large enough).
pub fn with_quantized<R>(x: &[f32], t: usize, cin: usize, f: impl FnOnce(&QuantX) -> R) -> R {
    crate::scratch::with_kept(&QUANT_X, |qx| {
        let before = qx.capacity_bytes();
        qx.requantize(x, t, cin);
        crate::scratch::note_held(before, qx.capacity_bytes());
        f(qx)
    })
}

impl QuantX {
    /// Quantize `t` rows of `cin` values.
    pub fn new(x: &[f32], t: usize, cin: usize) -> QuantX {
        Self::with_planes(x, t, cin, PLANES.load(std::sync::atomic::Ordering::Relaxed))
    }

    /// Quantize with 1 or 2 planes whatever the process-wide setting.
    pub fn with_planes(x: &[f32], t: usize, cin: usize, planes: usize) -> QuantX {
        let mut q = QuantX::default();
        q.fill(x, t, cin, planes, crate::simd::has_avx2_fma(), paired_layout());
        q
    }

    /// Quantize in the pair layout of the 512-bit kernels (tests).
    #[cfg(test)]
    pub(crate) fn paired(x: &[f32], t: usize, cin: usize, planes: usize) -> QuantX {
        let mut q = QuantX::default();
        q.fill(x, t, cin, planes, false, true);
        q
    }

    /// Bytes of the buffers behind this value.
    fn capacity_bytes(&self) -> usize {
        2 * self.q.capacity()
            + self.q2.capacity()
            + self.qhl.capacity()
            + 4 * (self.scale.capacity() + self.corr.capacity() + self.shift.capacity())
            + 4 * self.scaled.capacity()
            + 8 * self.bmax.capacity()
    }

    /// Quantize into this value's buffers (no allocation once they are large enough).
    pub fn requantize(&mut self, x: &[f32], t: usize, cin: usize) {
        let planes = PLANES.load(std::sync::atomic::Ordering::Relaxed);
        self.fill(x, t, cin, planes, crate::simd::has_avx2_fma(), paired_layout())
    }

    /// [`QuantX::requantize`] with 1 or 2 planes whatever the process-wide setting (tests).
    #[cfg(test)]
    pub(crate) fn fill_with_planes(&mut self, x: &[f32], t: usize, cin: usize, planes: usize) {
        self.fill(x, t, cin, planes, crate::simd::has_avx2_fma(), paired_layout())
    }

    /// The same through the portable code alone (the reference the AVX2 path must equal).
    #[cfg(test)]
    pub(crate) fn with_planes_scalar(x: &[f32], t: usize, cin: usize, planes: usize) -> QuantX {
        let mut q = QuantX::default();
        q.fill(x, t, cin, planes, false, false);
        q
    }

    /// Whether chunk `c` lies in a whole pair of the pair layout.
    #[inline(always)]
    fn paired_chunk(&self, c: usize) -> bool {
        self.paired && (c | 1) < self.cin_pad / CHUNK
    }

    /// The 16-bit plane's accumulator lane of column `m` of chunk `c`: [`lane`] of its position
    /// ([`xpos`]), or in a whole pair of the pair layout four consecutive columns per lane.
    #[inline(always)]
    fn lane1(&self, c: usize, m: usize) -> usize {
        if self.paired_chunk(c) {
            lane2(m)
        } else {
            lane(xpos(m))
        }
    }

    fn fill(&mut self, x: &[f32], t: usize, cin: usize, planes: usize, simd: bool, paired: bool) {
        assert!(planes == 1 || planes == 2, "1 or 2 activation planes");
        assert_eq!(x.len(), t * cin, "x has {} values, expected {t}×{cin}", x.len());
        let cin_pad = cin.div_ceil(CHUNK) * CHUNK;
        let nblocks = cin_pad.div_ceil(XBLOCK);
        #[cfg(target_arch = "x86_64")]
        let simd = simd && crate::simd::has_avx2_fma();
        #[cfg(not(target_arch = "x86_64"))]
        let _ = simd;
        let (q, q2, scale, corr) = (&mut self.q, &mut self.q2, &mut self.scale, &mut self.corr);
        // Every code is written below (the zero ones too), so the kept buffers are only sized,
        // not cleared: at decode sizes clearing them, or zeroing a residual buffer per call,
        // would be most of this function's time.
        q.resize(t * cin_pad, 0);
        q2.resize(t * cin_pad, 0);
        self.resid.resize(XBLOCK, 0.0);
        let resid = &mut self.resid[..];
        scale.clear();
        scale.resize(t * nblocks * 2, 0.0);
        self.shift.clear();
        self.shift.resize(t, 0);
        self.bmax.resize(nblocks, (0.0, true));
        let (shift, bmax, scaled) = (&mut self.shift, &mut self.bmax, &mut self.scaled);
        let chunk: fn(&[f32], f32, f32, &mut [i16], &mut [f32]) = {
            #[cfg(target_arch = "x86_64")]
            {
                if simd {
                    // SAFETY (of the call through this pointer): AVX2 was detected.
                    |v, inv, s, out, res| unsafe { avx2::quantize_chunk(v, inv, s, out, res) }
                } else {
                    quantize_chunk
                }
            }
            #[cfg(not(target_arch = "x86_64"))]
            {
                quantize_chunk
            }
        };
        let plane2: fn(&[f32], f32, &mut [i8]) = {
            #[cfg(target_arch = "x86_64")]
            {
                if simd {
                    // SAFETY (of the call through this pointer): AVX2 was detected.
                    |v, inv, out| unsafe { avx2::quantize_plane2(v, inv, out) }
                } else {
                    quantize_plane2
                }
            }
            #[cfg(not(target_arch = "x86_64"))]
            {
                quantize_plane2
            }
        };
        let xmax = if paired { XMAX_PAIRED } else { XMAX };
        for r in 0..t {
            let xr = &x[r * cin..(r + 1) * cin];
            for (b, bm) in bmax.iter_mut().enumerate() {
                let (j0, j1) = (b * XBLOCK, ((b + 1) * XBLOCK).min(cin));
                *bm = absmax_finite(&xr[j0.min(j1)..j1]);
            }
            let (mrow, frow) = bmax.iter().fold((0f32, true), |(m, f), &(bm, bf)| (m.max(bm), f && bf));
            // A row far from 1 is quantized as x·2ᵉ (see ROW_LO); a non-finite one is not, its
            // NaN scale carries it.
            let e = if !frow || mrow == 0.0 || (ROW_LO..=ROW_HI).contains(&mrow) { 0 } else { -floor_log2(mrow) };
            shift[r] = e;
            for (b, &(m, finite)) in bmax.iter().enumerate() {
                // Columns j0..j1 of the input, j0..jp with the zero padding of the last chunk.
                let (j0, j1, jp) = (b * XBLOCK, ((b + 1) * XBLOCK).min(cin), ((b + 1) * XBLOCK).min(cin_pad));
                let (qb, q2b) =
                    (&mut q[r * cin_pad + j0..r * cin_pad + jp], &mut q2[r * cin_pad + j0..r * cin_pad + jp]);
                let sc = &mut scale[(r * nblocks + b) * 2..][..2];
                let xb = &xr[j0.min(j1)..j1];
                if m == 0.0 || !finite {
                    // A zero block; or a non-finite input, which the scale propagates as NaN.
                    sc[0] = if finite { 0.0 } else { f32::NAN };
                    qb.fill(0);
                    q2b.fill(0);
                    continue;
                }
                // The values quantized, their largest magnitude, and the exponent `d` taking
                // their scales to the row's values x·2ᵉ.
                let (v, mv, d) = if e == 0 && m >= BLOCK_LO {
                    (xb, m, 0)
                } else {
                    // The block as x·2ᵏ, its largest magnitude in [1, 2): exact, but for values
                    // below 2⁻¹²⁶ of a huge block's largest, which may round.
                    let k = -floor_log2(m);
                    scaled.resize(XBLOCK, 0.0);
                    for (o, &xv) in scaled.iter_mut().zip(xb) {
                        *o = mul_pow2(xv, k);
                    }
                    (&scaled[..xb.len()], mul_pow2(m, k), e - k)
                };
                // The kept scale may round where it is subnormal (d < 0): the residuals are
                // taken against the kept value (brought back to `v`'s scale exactly), so the
                // second plane absorbs that rounding.
                let s1 = mul_pow2(mv / xmax, d);
                let (inv1, s1v) = (xmax / mv, mul_pow2(s1, -d));
                // Blocks start on chunk boundaries (XBLOCK is a multiple of CHUNK); a last
                // partial chunk is written whole, zero codes past the input.
                for (c, xc) in v.chunks(CHUNK).enumerate() {
                    chunk(xc, inv1, s1v, &mut qb[c * CHUNK..][..CHUNK], &mut resid[c * CHUNK..(c + 1) * CHUNK]);
                }
                sc[0] = s1;
                let (m2, _) = if planes == 2 { absmax_finite(&resid[..xb.len()]) } else { (0.0, true) };
                if m2 > mv * PLANE2_MIN {
                    sc[1] = mul_pow2(m2 / XMAX2, d);
                    let (codes, pad) = q2b.split_at_mut(xb.len());
                    plane2(&resid[..xb.len()], XMAX2 / m2, codes);
                    pad.fill(0);
                } else {
                    // No residual, or all of them far within the two planes' bound.
                    q2b.fill(0);
                }
            }
        }
        corr.clear();
        corr.resize(t * nblocks * 2 * LANES, 0);
        for (r, cr) in corr.chunks_mut(nblocks * 2 * LANES).enumerate() {
            let qr = &q[r * cin_pad..(r + 1) * cin_pad];
            let q2r = &q2[r * cin_pad..(r + 1) * cin_pad];
            #[cfg(target_arch = "x86_64")]
            if simd && !paired {
                for (b, cb) in cr.chunks_exact_mut(2 * LANES).enumerate() {
                    let cols = b * XBLOCK..((b + 1) * XBLOCK).min(cin_pad);
                    // SAFETY: AVX2 was detected; the slices hold whole chunks.
                    unsafe { avx2::block_corr(&qr[cols.clone()], &q2r[cols], cb) };
                }
                continue;
            }
            for (c, (qc, q2c)) in qr.chunks(CHUNK).zip(q2r.chunks(CHUNK)).enumerate() {
                let b = c * CHUNK / XBLOCK;
                let cl = &mut cr[b * 2 * LANES..][..LANES];
                if paired && (c | 1) < cin_pad / CHUNK {
                    // Lane l holds columns 4l..4l + 4 (position xpos(m) holds column m).
                    for (l, acc) in cl.iter_mut().enumerate() {
                        *acc += 128 * (4 * l..4 * l + 4).map(|m| qc[xpos(m)] as i32).sum::<i32>();
                    }
                } else {
                    // Lane l holds positions 2l, 2l + 1, 16 + 2l and 17 + 2l (see `lane`).
                    for (l, acc) in cl.iter_mut().enumerate() {
                        let (a, b) = (&qc[2 * l..2 * l + 2], &qc[16 + 2 * l..18 + 2 * l]);
                        *acc += 128 * (a[0] as i32 + a[1] as i32 + b[0] as i32 + b[1] as i32);
                    }
                }
                let cl2 = &mut cr[(b * 2 + 1) * LANES..][..LANES];
                // Lane l holds columns 4l..4l + 4 (see `lane2`).
                for (l, acc) in cl2.iter_mut().enumerate() {
                    *acc += 128 * q2c[4 * l..4 * l + 4].iter().map(|&v| v as i32).sum::<i32>();
                }
            }
        }
        (self.t, self.planes, self.cin_pad, self.nblocks) = (t, planes, cin_pad, nblocks);
        self.paired = paired;
        self.qhl.clear();
        if paired {
            let pairs = cin_pad / (2 * CHUNK);
            self.qhl.resize(t * pairs * 4 * CHUNK, 0);
            // Pair order: 16 columns of A, 16 of B, then A's and B's last 16, in runs of eight
            // columns; the plain codes hold columns 0–7, 16–23, 8–15, 24–31 of each chunk (see
            // `xpos`), so run r of the pair starts at position RUNS[r] of the pair's codes.
            const RUNS: [usize; 8] = [0, 16, 32, 48, 8, 24, 40, 56];
            for r in 0..t {
                let hlr = &mut self.qhl[r * pairs * 4 * CHUNK..(r + 1) * pairs * 4 * CHUNK];
                for (p, hl) in hlr.chunks_exact_mut(4 * CHUNK).enumerate() {
                    let qp = &self.q[r * cin_pad + p * 2 * CHUNK..][..2 * CHUNK];
                    let (hs, ls) = hl.split_at_mut(2 * CHUNK);
                    for (k, &src) in RUNS.iter().enumerate() {
                        let codes = &qp[src..src + 8];
                        for ((h, l), &v) in hs[8 * k..8 * k + 8].iter_mut().zip(&mut ls[8 * k..8 * k + 8]).zip(codes) {
                            let hv = (v as i32 + 128) >> 8;
                            *h = hv as i8;
                            *l = (v as i32 - 256 * hv) as i8;
                        }
                    }
                }
                // The second plane is in column order: its runs of 16 start at 0, 32, 16, 48.
                let q2r = &mut self.q2[r * cin_pad..(r + 1) * cin_pad];
                for q2p in q2r.chunks_exact_mut(2 * CHUNK).take(pairs) {
                    let b = <[i8; 64]>::try_from(&*q2p).expect("64");
                    for (k, src) in [0, 32, 16, 48].into_iter().enumerate() {
                        q2p[16 * k..16 * k + 16].copy_from_slice(&b[src..src + 16]);
                    }
                }
            }
        }
    }

    /// Chunk `c` of activation row `t` in the plain layout: `q₁` in [`xpos`] order and `q₂` in
    /// column order, whatever the stored layout.
    pub fn chunk(&self, t: usize, c: usize) -> ([i16; CHUNK], [i8; CHUNK]) {
        let base = t * self.cin_pad;
        let (mut q1, mut q2) = ([0i16; CHUNK], [0i8; CHUNK]);
        q1.copy_from_slice(&self.q[base + c * CHUNK..][..CHUNK]);
        if self.paired_chunk(c) {
            let (p0, e) = (base + (c & !1) * CHUNK, c & 1);
            for h in 0..2 {
                q2[16 * h..16 * h + 16].copy_from_slice(&self.q2[p0 + 32 * h + 16 * e..][..16]);
            }
        } else {
            q2.copy_from_slice(&self.q2[base + c * CHUNK..][..CHUNK]);
        }
        (q1, q2)
    }
}

/// `ys[i] = x Wᵢᵀ` for matrices sharing one input (e.g. q/k/v, gate/up), `x` quantized once,
/// all rows of all matrices in one parallel dispatch.
pub fn matmul_many(simd: bool, ms: &[&DotMatrix], qx: &QuantX, ys: &mut [&mut [f32]]) {
    assert_eq!(ms.len(), ys.len());
    assert!(ms.len() <= super::MAX_SHARED, "{} matrices in one call (at most {})", ms.len(), super::MAX_SHARED);
    for (m, y) in ms.iter().zip(ys.iter()) {
        assert_eq!(m.cin_pad, qx.cin_pad, "input width {} does not match the quantized activations", m.cin);
        assert_eq!(y.len(), qx.t * m.cout, "y has {} values, expected {}×{}", y.len(), qx.t, m.cout);
    }
    matmul_rows(simd, ms, qx, ys);
    // Rows quantized as x·2ᵉ (see `QuantX::shift`) give outputs 2ᵉ too large: exact to undo,
    // but where the true output is subnormal.
    for (t, &e) in qx.shift.iter().enumerate().filter(|&(_, &e)| e != 0) {
        for (m, y) in ms.iter().zip(ys.iter_mut()) {
            y[t * m.cout..(t + 1) * m.cout].iter_mut().for_each(|v| *v = mul_pow2(*v, -e));
        }
    }
}

/// [`matmul_many`]'s products of the codes and scales as they are.
fn matmul_rows(simd: bool, ms: &[&DotMatrix], qx: &QuantX, ys: &mut [&mut [f32]]) {
    let simd = simd && crate::simd::has_int_simd();
    let mut outs = [OutPtr(std::ptr::null_mut()); super::MAX_SHARED];
    outs.iter_mut().zip(ys.iter_mut()).for_each(|(o, y)| *o = OutPtr(y.as_mut_ptr()));
    let outs = &outs[..ms.len()];
    let threads = rayon::current_num_threads();
    let work: usize = ms.iter().map(|m| m.groups * m.row_bytes * qx.t.div_ceil(m.kind.pass_t())).sum();
    if threads == 1 || work < 48 * 1024 {
        for (m, &y) in ms.iter().zip(outs) {
            // SAFETY: `y` holds `t × cout` values, and this is the only writer.
            unsafe { m.rows(simd, 0, m.groups, qx, y) }
        }
        return;
    }
    // Tasks over the rows of all matrices, claimed one at a time in order and largest first
    // (guided scheduling): each worker's first task holds 70 % of its share of the work, the
    // next 20 %, the last 10 %, so a worker that runs ahead (the other started late, or a noisy
    // neighbour slows it) takes the small ones and the two end close together. With two equal
    // tasks per worker the caller waits at the end of each call for the slower worker's whole
    // last half; with the small tasks last that wait is less than half as long.
    let mut bounds = TASK_STAGES.iter().flat_map(|&s| std::iter::repeat_n(s, threads)).scan(0usize, |c, s| {
        *c += s;
        Some(work * *c / (1000 * threads))
    });
    crate::scratch::with_kept(&TASKS, |tasks| {
        tasks.clear();
        let (mut bound, mut done) = (0usize, 0usize);
        for (i, m) in ms.iter().enumerate() {
            let row_work = (m.row_bytes * qx.t.div_ceil(m.kind.pass_t())).max(1);
            let mut g0 = 0;
            while g0 < m.groups {
                while done >= bound {
                    bound = bounds.next().unwrap_or(usize::MAX);
                }
                let rows = (bound - done).div_ceil(row_work).min(m.groups - g0);
                tasks.push((i, g0, rows));
                g0 += rows;
                done += rows * row_work;
            }
        }
        let tasks = &tasks[..];
        crate::team::parallel_for(tasks.len(), &|k| {
            let (i, g0, n) = tasks[k];
            // SAFETY: as above; each task writes only the output rows of its own index rows.
            unsafe { ms[i].rows(simd, g0, n, qx, outs[i]) }
        });
    })
}

/// [`matmul_many`]'s task sizes, per mille of a worker's share: one task of each per worker, in
/// this order.
const TASK_STAGES: [usize; 3] = [700, 200, 100];

thread_local! {
    /// `(matrix, first index row, index rows)` per task of a [`matmul_many`] call, kept for the
    /// buffer.
    static TASKS: std::cell::RefCell<Option<Vec<(usize, usize, usize)>>> = const { std::cell::RefCell::new(None) };
}

/// From this many activation rows on (prefill), the SIMD path multiplies integer-dot matrices as
/// f32: each group of rows is decoded once per call (exactly: `scale · f · q` is an f32) into a
/// small L1 buffer and every activation row is dotted against it with FMA tiles of three
/// activation rows by four weight rows. The activations then need no quantizing at all.
pub const GEMM_MIN_T: usize = 16;

/// Whether `t` activation rows go through the f32 path ([`gemm_many`]). (Not the 512-bit
/// integer block kernel, which takes any number of rows: at T = 64 on SmolLM2's shapes,
/// quantizing the rows and closing each block per row and output cost more than its byte
/// products save, about 0.8× the f32 tiles' speed.)
pub fn f32_path(t: usize) -> bool {
    t >= GEMM_MIN_T
}

/// `ys[i] = x Wᵢᵀ` for `t ≥` [`GEMM_MIN_T`] rows: parallel over groups of output rows, each
/// decoded to f32 and multiplied straight into its columns of `ys[i]`.
pub fn gemm_many(simd: bool, ms: &[&DotMatrix], x: &[f32], t: usize, ys: &mut [&mut [f32]]) {
    assert_eq!(ms.len(), ys.len());
    for (m, y) in ms.iter().zip(ys.iter()) {
        assert_eq!(x.len(), t * m.cin, "x has {} values, expected {t}×{}", x.len(), m.cin);
        assert_eq!(y.len(), t * m.cout, "y has {} values, expected {t}×{}", y.len(), m.cout);
    }
    let simd = simd && crate::simd::has_int_simd();
    #[cfg(target_arch = "x86_64")]
    if simd && int_prefill() && prefill::gemm_many_int(true, ms, x, t, ys) {
        return;
    }
    #[cfg(target_arch = "x86_64")]
    if simd && avx512_f32() {
        return gemm_many_cols(ms, x, t, ys);
    }
    // Rows decoded together: about 16 KiB of f32 (stays in L1 while every activation row
    // streams past it), a multiple of 4 (the tile width, and whole row pairs).
    let rows = |cin: usize| ((4096 / cin.max(1)) & !3).clamp(4, 64);
    for_row_groups(ms, ys, rows, |m, g0, g, out, buf| {
        crate::scratch::grow(buf, g * m.cin);
        let w = &mut buf[..g * m.cin];
        // The decode overwrites the rows it returns: no zeroing.
        m.decode_rows_with(simd, g0, g, w);
        // SAFETY: `x` is t×cin, the decoded rows g×cin, and `out` the destination columns of
        // these rows in the t×cout output (row stride cout), which no other task writes.
        unsafe { dot_rows(simd, x, t, m.cin, w, g, out, m.cout) }
    });
}

/// Tasks per worker in [`for_row_groups`]. Each task streams all activation rows past its
/// weight rows whatever its size, so finer tasks cost nothing but a claim each, and they leave
/// less of a tail when one core runs slower than the other (a noisy neighbour): on SmolLM2's
/// 64-token prefill, 8 a worker run about 3.5 % faster than 2. (Decode's tasks are another
/// matter: more equal tasks per worker run slower there, so [`matmul_many`] cuts three of
/// falling size per worker instead.)
const GROUP_TASKS: usize = 8;

/// Splits the rows of each matrix into groups of `rows(cin)` (whole row pairs) and calls
/// `body(matrix, first row, row count, its first output column in ys, buffer)` for each: in
/// parallel, about [`GROUP_TASKS`] tasks per worker, with the worker's kept buffer for the
/// decoded weights, which the body grows to what it needs (a fresh one per task costs page
/// faults and zeroing).
fn for_row_groups(
    ms: &[&DotMatrix],
    ys: &mut [&mut [f32]],
    rows: impl Fn(usize) -> usize,
    body: impl Fn(&DotMatrix, usize, usize, *mut f32, &mut Vec<f32>) + Sync,
) {
    let outs: Vec<OutPtr> = ys.iter_mut().map(|y| OutPtr(y.as_mut_ptr())).collect();
    let mut tasks = Vec::new();
    for (i, m) in ms.iter().enumerate() {
        let rows = rows(m.cin);
        let per =
            (m.cout.div_ceil(GROUP_TASKS * rayon::current_num_threads()).div_ceil(rows) * rows).clamp(rows, 32 * rows);
        for r0 in (0..m.cout).step_by(per) {
            tasks.push((i, r0, per.min(m.cout - r0), rows));
        }
    }
    let (outs, tasks) = (&outs, &tasks);
    // Through the spinning team when one runs (a prefill makes a few hundred of these calls),
    // else rayon; tasks are claimed one at a time either way.
    crate::team::parallel_for(tasks.len(), &|ti| {
        let (i, r0, n, rows) = tasks[ti];
        let m = ms[i];
        crate::scratch::with_kept(&DECODED, |buf: &mut Vec<f32>| {
            for g0 in (r0..r0 + n).step_by(rows) {
                // (In bounds: g0 < cout, and `ys[i]` holds t × cout values.)
                body(m, g0, rows.min(r0 + n - g0), outs[i].0.wrapping_add(g0), buf);
            }
        })
    });
}

thread_local! {
    /// A worker's decoded weight rows in [`for_row_groups`], kept for the buffer.
    static DECODED: std::cell::RefCell<Option<Vec<f32>>> = const { std::cell::RefCell::new(None) };
}

/// [`gemm_many`] on AVX-512: the activations are transposed once per call (`cin × tp`), and
/// groups of weight rows go through outer-product tiles ([`avx512::dot_cols`]) that broadcast
/// one weight against up to 64 activation rows; each tile's weight rows are decoded just before
/// it (into L1), and a group's sums come out transposed and are turned back in one pass.
#[cfg(target_arch = "x86_64")]
fn gemm_many_cols(ms: &[&DotMatrix], x: &[f32], t: usize, ys: &mut [&mut [f32]]) {
    let cin = ms[0].cin;
    assert!(ms.iter().all(|m| m.cin == cin), "matrices sharing an input have one width");
    let tp = t.div_ceil(64) * 64;
    crate::scratch::with_kept(&XT, |xt: &mut Vec<f32>| {
        crate::scratch::grow(xt, cin * tp);
        // Two slices of inputs per worker. Rows past t up to a multiple of 16 are zeroed (the
        // tiles read whole vectors); those past that are never read.
        let kb = (cin.div_ceil(2 * rayon::current_num_threads()).div_ceil(16) * 16).max(16);
        crate::team::par_chunks_mut(&mut xt[..cin * tp], kb * tp, &|i, chunk| {
            crate::transpose::transpose(&x[i * kb..], t, chunk.len() / tp, cin, chunk, tp, true)
        });
        gemm_cols(ms, xt, tp, t, ys)
    })
}

thread_local! {
    /// The transposed activations of [`gemm_many_cols`], kept for the buffer.
    static XT: std::cell::RefCell<Option<Vec<f32>>> = const { std::cell::RefCell::new(None) };
    /// The tiles' sums of one group of weight rows in [`gemm_cols`], transposed (`g × tp`).
    static YT: std::cell::RefCell<Option<Vec<f32>>> = const { std::cell::RefCell::new(None) };
}

#[cfg(target_arch = "x86_64")]
fn gemm_cols(ms: &[&DotMatrix], xt: &[f32], tp: usize, t: usize, ys: &mut [&mut [f32]]) {
    use avx512::NJ;
    // Groups of 48 rows: whole tiles, and whole 16-row blocks of the transposed sums. Each
    // tile's rows are decoded just before it, into the same 6·cin values (decoding the whole
    // group first leaves it to be read back from L2, a few percent slower).
    for_row_groups(
        ms,
        ys,
        |_| 8 * NJ,
        |m, g0, g, out, buf| {
            crate::scratch::grow(buf, NJ * m.cin);
            crate::scratch::with_kept(&YT, |yt: &mut Vec<f32>| {
                crate::scratch::grow(yt, g * tp);
                for j in (0..g).step_by(NJ) {
                    let n = NJ.min(g - j);
                    let w = &mut buf[..n * m.cin];
                    m.decode_rows_with(true, g0 + j, n, w);
                    // SAFETY: AVX-512 F present (checked by the caller); `xt` is cin×tp, the decoded
                    // rows n×cin, and `yt` holds g×tp values.
                    unsafe { avx512::dot_cols(xt.as_ptr(), tp, t, m.cin, w.as_ptr(), n, yt.as_mut_ptr().add(j * tp)) };
                }
                // SAFETY: `yt` holds g rows of tp ≥ t sums; `out` is the destination columns of
                // these rows in the t×cout output, which no other task writes.
                unsafe { crate::transpose::transpose_ptr(yt.as_ptr(), g, t, tp, out, m.cout, false) };
            })
        },
    );
}

/// `out[i·stride + j] = Σₖ x[i·cin + k] · w[j·cin + k]` for `i < t`, `j < n`: activations
/// against decoded weight rows, both read as they lie (no packing).
///
/// # Safety
/// `out` must point to `t` rows `stride` apart of at least `n` writable values.
#[allow(clippy::too_many_arguments)]
unsafe fn dot_rows(simd: bool, x: &[f32], t: usize, cin: usize, w: &[f32], n: usize, out: *mut f32, stride: usize) {
    assert!(x.len() >= t * cin && w.len() >= n * cin);
    #[cfg(target_arch = "x86_64")]
    if simd && crate::simd::has_avx2_fma() {
        // SAFETY: AVX2/FMA present; the sizes are asserted above, `out` is the caller's.
        return avx2::dot_rows(x.as_ptr(), t, cin, w.as_ptr(), n, out, stride);
    }
    #[cfg(target_arch = "aarch64")]
    if simd {
        // SAFETY: NEON is part of aarch64; the sizes are asserted above, `out` is the caller's.
        return neon::dot_rows(x.as_ptr(), t, cin, w.as_ptr(), n, out, stride);
    }
    let _ = simd;
    for i in 0..t {
        for j in 0..n {
            let d = x[i * cin..(i + 1) * cin].iter().zip(&w[j * cin..(j + 1) * cin]).map(|(a, b)| a * b).sum();
            *out.add(i * stride + j) = d;
        }
    }
}

/// Kind and shape of a packed matrix, as a compiled cache records them.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DotLayout {
    /// `lut4`, `lut3`, `lut2`, `vec2x16`, `vec2x64` or `int8`.
    pub kind: String,
    pub cout: usize,
    pub cin: usize,
    /// vec2x64 in the six-bit, lut3 in the three-bit stream layout (see [`six_bit_layout`]).
    pub six: bool,
}

impl DotLayout {
    /// The layout of a matrix read back from a cache written with the AVX-512 layouts
    /// (`avx512_layouts`, see [`six_bit_layout`]) or without: every kind but INT8 has one.
    pub fn cached(kind: &str, cout: usize, cin: usize, avx512_layouts: bool) -> DotLayout {
        let six = avx512_layouts && Kind::parse(kind).is_ok_and(Kind::has_stream_layout);
        DotLayout { kind: kind.into(), cout, cin, six }
    }
}

/// Whether vec2x64 matrices pack to the six-bit stream layout here: each chunk's 32 indices as
/// one little-endian stream of 6-bit fields (24 bytes), which AVX-512 VBMI spreads and extracts
/// with one `vpermb` and one `vpmultishiftqb` per 64 indices, where the nibble layout (low four
/// bits as nibbles, the top two bits in a byte per eight columns) takes six instructions. AVX2
/// and NEON, without a byte shift per lane, keep the nibble layout. The choice follows
/// [`set_avx512`] at the time of packing; a six-bit matrix met later by other kernels goes
/// through the scalar reference. lut3 follows the same choice with three-bit fields (12 bytes a
/// chunk, as its other layout): one `vpermb`, one `vpmultishiftqb` and the lookup per 64
/// indices, where the two-bit fields and the word of bit 2 take seven instructions. lut2 too:
/// its chunks in groups of eight, and lut4's, vec2x16's, lut3's and vec2x64's whole groups too
/// ([`group_field`]).
pub fn six_bit_layout() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        avx512()
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// Bytes after the last index row: the 512-bit six-bit vec2x64 kernel loads 64 bytes for a
/// pair of chunks' 48.
const SLACK: usize = 16;

/// Packed index bytes: owned, or a range of shared memory (a memory-mapped cache file).
#[derive(Clone)]
pub enum Blob {
    Owned(Vec<u8>),
    Shared { src: std::sync::Arc<dyn AsRef<[u8]> + Send + Sync>, offset: usize, len: usize },
}

impl Blob {
    pub fn bytes(&self) -> &[u8] {
        match self {
            Blob::Owned(v) => v,
            Blob::Shared { src, offset, len } => &(**src).as_ref()[*offset..*offset + *len],
        }
    }
}

impl std::fmt::Debug for Blob {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Blob::Owned(v) => write!(f, "Blob::Owned({} bytes)", v.len()),
            Blob::Shared { len, .. } => write!(f, "Blob::Shared({len} bytes)"),
        }
    }
}

/// The output pointer shared by the tasks of one call (each writes its own rows).
#[derive(Clone, Copy)]
struct OutPtr(*mut f32);
// SAFETY: tasks write disjoint rows through it (see `DotMatrix::rows`).
unsafe impl Send for OutPtr {}
// SAFETY: as above.
unsafe impl Sync for OutPtr {}

/// A LUT or INT8 matrix packed for the integer-dot kernels.
#[derive(Clone, Debug)]
pub struct DotMatrix {
    pub cout: usize,
    pub cin: usize,
    kind: Kind,
    cin_pad: usize,
    /// Index rows (`cout / rows`).
    groups: usize,
    row_bytes: usize,
    data: Blob,
    /// vec2x64 in the six-bit stream layout ([`six_bit_layout`]).
    six: bool,
    /// lut4: one table; vec2x16: one per component; vec2x64: four difference tables per
    /// component; int8: none.
    tables: Vec<[i8; 16]>,
    /// Per output row: row scale × codebook factor.
    scale: Vec<f32>,
}

/// `(f, q)` with `codebook = f · q`, `f` a power of two and `q` in `[-128, 127]`, if it exists.
pub fn int8_codebook(codebook: &[f32]) -> Option<(f32, Vec<i8>)> {
    if codebook.iter().any(|c| !c.is_finite()) {
        return None;
    }
    let m = codebook.iter().fold(0f32, |a, v| a.max(v.abs()));
    if m == 0.0 {
        return Some((1.0, vec![0; codebook.len()]));
    }
    // The finest candidate puts the largest magnitude in (64, 128]; a +128 needs the next one.
    let e = (m / 128.0).log2().ceil() as i32;
    (e..=e + 1).find_map(|e| {
        let f = 2f32.powi(e);
        let q: Option<Vec<i8>> = codebook
            .iter()
            .map(|&c| {
                let v = c / f;
                (v.fract() == 0.0 && (-128.0..=127.0).contains(&v)).then_some(v as i8)
            })
            .collect();
        q.map(|q| (f, q))
    })
}

impl DotMatrix {
    /// Pack a LUT matrix whose codebook is 8-bit integers times a power of two (None otherwise).
    pub fn from_lut(m: &LutMatrix) -> Option<DotMatrix> {
        let kind = Kind::of(m.format).filter(|&k| k != Kind::Int8)?;
        let (f, q) = int8_codebook(&m.codebook)?;
        let d = m.format.vec_dim();
        let comp = |c: usize, k0: usize| -> [i8; 16] { std::array::from_fn(|i| q[(k0 + i) * d + c]) };
        let tables = match kind {
            Kind::Lut4 => vec![comp(0, 0)],
            // Entries 0–3 (and lut3's 4–7) repeated through 16 bytes, so that a lookup may
            // ignore every index bit above the low two.
            Kind::Lut2 | Kind::Lut3 => (0..q.len() / 4).map(|h| std::array::from_fn(|i| q[4 * h + i % 4])).collect(),
            Kind::Vec2x16 => vec![comp(0, 0), comp(1, 0)],
            // Per component, entries 0–15, 16–31, 32–47, 48–63.
            _ => (0..2).flat_map(|c| (0..4).map(move |k| comp(c, 16 * k))).collect(),
        };
        let scale = m.scale.iter().map(|&s| s * f).collect();
        let (idx, cin) = (&m.idx, m.cin);
        let six = kind.has_stream_layout() && six_bit_layout();
        Some(Self::build(kind, six, m.cout, cin, tables, scale, |g, j| idx[g * cin + j]))
    }

    /// Pack an INT8 matrix.
    pub fn from_int8(m: &Int8Matrix) -> DotMatrix {
        let (q, cin) = (&m.q, m.cin);
        Self::build(Kind::Int8, false, m.cout, cin, Vec::new(), m.scale.clone(), |g, j| q[g * cin + j] as u8)
    }

    #[allow(clippy::too_many_arguments)]
    fn build(
        kind: Kind,
        six: bool,
        cout: usize,
        cin: usize,
        tables: Vec<[i8; 16]>,
        scale: Vec<f32>,
        get: impl Fn(usize, usize) -> u8 + Sync,
    ) -> DotMatrix {
        let cin_pad = cin.div_ceil(CHUNK) * CHUNK;
        let groups = cout / kind.rows();
        let cb = kind.chunk_bytes();
        let row_bytes = cin_pad / CHUNK * cb;
        let mut data = vec![0u8; groups * row_bytes + SLACK];
        if row_bytes > 0 {
            let grouped = grouped_chunks(kind, six, cin_pad / CHUNK);
            data[..groups * row_bytes].par_chunks_mut(row_bytes).enumerate().for_each(|(g, row)| {
                let at = |j: usize| if j < cin { get(g, j) } else { 0 };
                for c in 0..grouped {
                    let group = &mut row[c / group_chunks(kind) * group_chunks(kind) * cb..];
                    for m in 0..CHUNK {
                        let i = at(c * CHUNK + m);
                        for j in 0..kind.index_bits() {
                            let (b, bit) = group_field(kind, c, m, j);
                            group[b] |= ((i >> j) & 1) << bit;
                        }
                    }
                }
                for (c, out) in row.chunks_mut(cb).enumerate().skip(grouped) {
                    let j0 = c * CHUNK;
                    match kind {
                        Kind::Int8 => (0..32).for_each(|m| out[m] = at(j0 + m)),
                        Kind::Lut3 if six => pack_stream(out, 3, |m| at(j0 + m)),
                        Kind::Lut2 | Kind::Lut3 => {
                            let mut hi = 0u32;
                            for m in 0..32 {
                                let i = at(j0 + m);
                                out[m % 8] |= (i & 3) << (2 * (m / 8));
                                hi |= ((i >> 2) as u32 & 1) << hi_bit(m);
                            }
                            if kind == Kind::Lut3 {
                                out[8..12].copy_from_slice(&hi.to_le_bytes());
                            }
                        }
                        Kind::Vec2x64 if six => pack_stream(out, 6, |m| at(j0 + m)),
                        _ => {
                            for (b, o) in out[..16].iter_mut().enumerate() {
                                *o = (at(j0 + b) & 15) | (at(j0 + 16 + b) & 15) << 4;
                            }
                            if kind == Kind::Vec2x64 {
                                for m in 0..32 {
                                    let (q, i) = (m / 8, at(j0 + m));
                                    out[16 + m % 8] |= ((i >> 5) & 1) << (7 - 2 * q) | ((i >> 4) & 1) << (6 - 2 * q);
                                }
                            }
                        }
                    }
                }
            });
        }
        DotMatrix { cout, cin, kind, cin_pad, groups, row_bytes, data: Blob::Owned(data), six, tables, scale }
    }

    /// The packed form as stored in a compiled cache: `(layout, data, tables, scales)` with the
    /// layout naming the kind and shape.
    pub fn parts(&self) -> (DotLayout, &[u8], Vec<i8>, &[f32]) {
        let layout = DotLayout { kind: self.kind.name().to_string(), cout: self.cout, cin: self.cin, six: self.six };
        (layout, self.data.bytes(), self.tables.iter().flatten().copied().collect(), &self.scale)
    }

    /// Byte sizes of `(data, tables, scales)` for a layout (what [`DotMatrix::parts`] returns).
    pub fn sizes(layout: &DotLayout) -> anyhow::Result<(usize, usize, usize)> {
        let kind = Kind::parse(&layout.kind)?;
        let cin_pad = layout.cin.div_ceil(CHUNK) * CHUNK;
        let data = layout.cout / kind.rows() * (cin_pad / CHUNK * kind.chunk_bytes()) + SLACK;
        Ok((data, 16 * kind.n_tables(), 4 * layout.cout))
    }

    /// The layout a LUT matrix of this format and codebook packs to, if it takes the
    /// integer-dot kernels (see [`DotMatrix::from_lut`]).
    pub fn layout_for(format: Format, codebook: &[f32], cout: usize, cin: usize) -> Option<DotLayout> {
        let kind = Kind::of(format)?;
        if kind != Kind::Int8 {
            int8_codebook(codebook)?;
        }
        Some(DotLayout { kind: kind.name().into(), cout, cin, six: kind.has_stream_layout() && six_bit_layout() })
    }

    /// Rebuild from [`DotMatrix::parts`], the index data shared (e.g. memory-mapped), checking
    /// every size against the layout.
    pub fn from_parts(layout: &DotLayout, data: Blob, tables: &[i8], scale: Vec<f32>) -> anyhow::Result<DotMatrix> {
        let kind = Kind::parse(&layout.kind)?;
        let (cout, cin) = (layout.cout, layout.cin);
        anyhow::ensure!(cout % kind.rows() == 0, "{cout} rows do not fit the {} layout", layout.kind);
        let cin_pad = cin.div_ceil(CHUNK) * CHUNK;
        let groups = cout / kind.rows();
        let row_bytes = cin_pad / CHUNK * kind.chunk_bytes();
        let want = groups * row_bytes + SLACK;
        anyhow::ensure!(
            !layout.six || kind.has_stream_layout(),
            "the stream layout is vec2x64's and lut3's, not {}'s",
            layout.kind
        );
        anyhow::ensure!(data.bytes().len() == want, "index data has {} bytes, expected {want}", data.bytes().len());
        let n_tables = kind.n_tables();
        anyhow::ensure!(
            tables.len() == 16 * n_tables,
            "tables have {} bytes, expected {}",
            tables.len(),
            16 * n_tables
        );
        anyhow::ensure!(scale.len() == cout, "{} scales, expected {cout}", scale.len());
        let tables = tables.chunks(16).map(|c| std::array::from_fn(|i| c[i])).collect();
        Ok(DotMatrix { cout, cin, kind, cin_pad, groups, row_bytes, data, six: layout.six, tables, scale })
    }

    /// [`DotMatrix::decode_rows`] through the AVX2 lookups when `simd` (same values: both are
    /// exact), for `r0` and `n` even with the vector formats (whole index rows).
    pub fn decode_rows_with(&self, simd: bool, r0: usize, n: usize, out: &mut [f32]) {
        assert!(r0 + n <= self.cout && out.len() >= n * self.cin, "rows {r0}..{} of {}", r0 + n, self.cout);
        let nr = self.kind.rows();
        // A six-bit matrix takes the AVX-512 kernels or the reference.
        let simd = simd && (!self.six || six_bit_layout());
        #[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
        if simd && crate::simd::has_int_simd() && r0.is_multiple_of(nr) && n.is_multiple_of(nr) {
            let a = DecodeArgs {
                six: self.six,
                tables: self.tables.as_ptr() as *const i8,
                row: self.data.bytes()[r0 / nr * self.row_bytes..].as_ptr(),
                row_bytes: self.row_bytes,
                n_idx: n / nr,
                cin: self.cin,
                scale: self.scale[r0..].as_ptr(),
                out: out.as_mut_ptr(),
            };
            // SAFETY: AVX2 was detected (x86-64; NEON is part of aarch64); index rows r0/nr..
            // (n/nr of them) lie in `data`, the scales r0..r0+n exist, and `out` holds n × cin
            // values (asserted above).
            unsafe {
                #[cfg(target_arch = "x86_64")]
                avx2::decode_f32(self.kind, &a);
                #[cfg(target_arch = "aarch64")]
                neon::decode_f32(self.kind, &a);
            }
            return;
        }
        let _ = (simd, nr);
        self.decode_rows(r0, n, out)
    }

    /// Decode output rows `r0..r0+n` to f32 (`n × cin`): exactly `scale · codebook[idx]`.
    pub fn decode_rows(&self, r0: usize, n: usize, out: &mut [f32]) {
        let nr = self.kind.rows();
        let cin = self.cin;
        for (i, o) in out[..n * cin].chunks_mut(cin).enumerate() {
            let r = r0 + i;
            let (g, v) = (r / nr, r % nr);
            let row = &self.data.bytes()[g * self.row_bytes..];
            let s = self.scale[r];
            for (c, oc) in o.chunks_mut(CHUNK).enumerate() {
                let w = self.chunk_weights(row, c);
                for (m, x) in oc.iter_mut().enumerate() {
                    *x = s * w[v][m] as f32;
                }
            }
        }
    }

    /// The packed index rows (and the slack after them).
    pub fn index_bytes(&self) -> &[u8] {
        self.data.bytes()
    }

    /// Bytes the kernels read per call (indices, scales, tables).
    pub fn packed_bytes(&self) -> usize {
        self.data.bytes().len() + 4 * self.scale.len() + 16 * self.tables.len()
    }

    /// `y = x Wᵀ` (`x`: `t × cin`, `y`: `t × cout`).
    pub fn matmul_with(&self, simd: bool, x: &[f32], t: usize, y: &mut [f32]) {
        assert_eq!(x.len(), t * self.cin, "x has {} values, expected {t}×{}", x.len(), self.cin);
        if t == 0 || self.cout == 0 {
            return;
        }
        if simd && f32_path(t) {
            return gemm_many(simd, &[self], x, t, &mut [y]);
        }
        with_quantized(x, t, self.cin, |qx| matmul_many(simd, &[self], qx, &mut [y]));
    }

    /// Scaled outputs of index rows `g0..g0+n` for every activation row, written to
    /// `y[t·cout + row]`.
    ///
    /// # Safety
    /// `y` must point to `qx.t × cout` values that no one else writes in these rows.
    unsafe fn rows(&self, simd: bool, g0: usize, n: usize, qx: &QuantX, y: OutPtr) {
        let nr = self.kind.rows();
        let simd = simd && (!self.six || six_bit_layout());
        #[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
        if simd {
            let a = Args {
                six: self.six,
                tables: self.tables.as_ptr() as *const i8,
                row: self.data.bytes()[g0 * self.row_bytes..].as_ptr(),
                row_bytes: self.row_bytes,
                n_rows: n,
                nchunks: self.cin_pad / CHUNK,
                cin_pad: self.cin_pad,
                t: qx.t,
                planes: qx.planes,
                xq: qx.q.as_ptr(),
                xq2: qx.q2.as_ptr(),
                xs: qx.scale.as_ptr(),
                corr: qx.corr.as_ptr(),
                nblocks: qx.nblocks,
                scale: self.scale[g0 * nr..].as_ptr(),
                out: y.0.add(g0 * nr),
                out_t_stride: self.cout,
                paired: qx.paired,
                xhl: qx.qhl.as_ptr(),
            };
            // SAFETY: the caller checked `has_int_simd`; the index rows g0..g0+n lie in `data`
            // (plus the `SLACK` bytes the x86 vec2x64 loads may touch), `xq` and `xq2` hold
            // `t · cin_pad` values, `xs` `t · 2 · nblocks`, the tables what the kind reads, and
            // `out` the rows g0·nr.. of `t` output rows (caller). Activations are paired only
            // where `paired_kernels` (`QuantX::fill`).
            #[cfg(target_arch = "x86_64")]
            avx2::rows(self.kind, &a);
            #[cfg(target_arch = "aarch64")]
            neon::rows(self.kind, &a);
            return;
        }
        let _ = simd;
        let pass = self.kind.pass_t();
        let mut tmp = [0f32; 2 * PASS_T];
        for t0 in (0..qx.t).step_by(pass) {
            let tc = pass.min(qx.t - t0);
            let out = y.0.add(t0 * self.cout);
            for g in g0..g0 + n {
                let row = &self.data.bytes()[g * self.row_bytes..];
                self.group_scalar(row, qx, t0, tc, &mut tmp);
                for tt in 0..tc {
                    for v in 0..nr {
                        *out.add(tt * self.cout + g * nr + v) = tmp[tt * nr + v] * self.scale[g * nr + v];
                    }
                }
            }
        }
    }

    /// The 32 weights of chunk `c` (codebook integers), in column order.
    fn chunk_weights(&self, row: &[u8], c: usize) -> [[i8; 32]; 2] {
        let cb = self.kind.chunk_bytes();
        let p = &row[c * cb..(c + 1) * cb];
        let grouped = grouped_chunks(self.kind, self.six, self.cin_pad / CHUNK);
        let idx = |m: usize| -> usize {
            if c < grouped {
                let group = &row[c / group_chunks(self.kind) * group_chunks(self.kind) * cb..];
                return (0..self.kind.index_bits())
                    .map(|j| {
                        let (b, bit) = group_field(self.kind, c, m, j);
                        (((group[b] >> bit) & 1) as usize) << j
                    })
                    .sum();
            }
            if self.six && matches!(self.kind, Kind::Lut3 | Kind::Vec2x64) {
                let width = if self.kind == Kind::Lut3 { 3 } else { 6 };
                let bit = width * m;
                let v = p[bit / 8] as usize | (p.get(bit / 8 + 1).copied().unwrap_or(0) as usize) << 8;
                return (v >> (bit % 8)) & ((1 << width) - 1);
            }
            if matches!(self.kind, Kind::Lut2 | Kind::Lut3) {
                let lo = (p[m % 8] >> (2 * (m / 8))) & 3;
                let hi = if self.kind == Kind::Lut3 {
                    (u32::from_le_bytes([p[8], p[9], p[10], p[11]]) >> hi_bit(m)) & 1
                } else {
                    0
                };
                return lo as usize | (hi as usize) << 2;
            }
            let lo = if m < 16 { p[m] & 15 } else { p[m - 16] >> 4 };
            let hi = if self.kind == Kind::Vec2x64 {
                let (b, q) = (p[16 + m % 8], m / 8);
                ((b >> (7 - 2 * q)) & 1) << 1 | ((b >> (6 - 2 * q)) & 1)
            } else {
                0
            };
            (lo | hi << 4) as usize
        };
        let mut w = [[0i8; 32]; 2];
        for m in 0..32 {
            match self.kind {
                Kind::Int8 => w[0][m] = p[m] as i8,
                Kind::Lut4 => w[0][m] = self.tables[0][idx(m)],
                // Table 0 holds entries 0–3 and table 1 entries 4–7, each repeated four times.
                Kind::Lut2 | Kind::Lut3 => w[0][m] = self.tables[idx(m) / 4][idx(m) % 4],
                Kind::Vec2x16 => {
                    w[0][m] = self.tables[0][idx(m)];
                    w[1][m] = self.tables[1][idx(m)];
                }
                Kind::Vec2x64 => {
                    let i = idx(m);
                    for (v, wv) in w.iter_mut().enumerate() {
                        wv[m] = self.tables[4 * v + i / 16][i % 16];
                    }
                }
            }
        }
        w
    }

    /// Reference on the same packed data: per block and activation plane, exact integer sums in
    /// the SIMD kernels' eight lanes, each taken to f32 and fused into the row's lanes by
    /// [`accumulate`]; the lanes summed in [`reduce_lanes`] order at the end.
    fn group_scalar(&self, row: &[u8], qx: &QuantX, t0: usize, tc: usize, out: &mut [f32]) {
        let nr = self.kind.rows();
        let nchunks = self.cin_pad / CHUNK;
        let mut lanes = [[[0f32; LANES]; 2]; PASS_T];
        for b in 0..qx.nblocks {
            let mut acc = [[[[0i64; LANES]; 2]; 2]; PASS_T];
            for c in b * XBLOCK / CHUNK..((b + 1) * XBLOCK / CHUNK).min(nchunks) {
                let w = self.chunk_weights(row, c);
                for (t, a) in acc.iter_mut().enumerate().take(tc) {
                    let (x, x2) = qx.chunk(t0 + t, c);
                    for (v, [a1, a2]) in a.iter_mut().enumerate().take(nr) {
                        for m in 0..CHUNK {
                            // Column m is at position xpos(m).
                            a1[qx.lane1(c, m)] += w[v][m] as i64 * x[xpos(m)] as i64;
                        }
                        for (m, &xm) in x2.iter().enumerate() {
                            a2[lane2(m)] += w[v][m] as i64 * xm as i64;
                        }
                    }
                }
            }
            for (t, a) in acc.iter().enumerate().take(tc) {
                let sc = &qx.scale[((t0 + t) * qx.nblocks + b) * 2..][..2];
                for v in 0..nr {
                    for plane in 0..qx.planes {
                        accumulate(&mut lanes[t][v], &a[v][plane], sc[plane]);
                    }
                }
            }
        }
        for t in 0..tc {
            for v in 0..nr {
                out[t * nr + v] = reduce_lanes(&lanes[t][v]);
            }
        }
    }
}

/// Index rows to decode to f32 rows of `cin` values (`scale[o] · q`, exact).
#[derive(Clone, Copy)]
#[cfg_attr(not(any(target_arch = "x86_64", target_arch = "aarch64")), allow(dead_code))]
struct DecodeArgs {
    /// vec2x64 in the six-bit layout (read by the AVX-512 kernels only; NEON has no six-bit
    /// matrices).
    #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
    six: bool,
    tables: *const i8,
    row: *const u8,
    row_bytes: usize,
    n_idx: usize,
    cin: usize,
    scale: *const f32,
    out: *mut f32,
}

/// One kernel call: `n_rows` index rows from `row` (`row_bytes` apart), `t` activation rows.
#[derive(Clone, Copy)]
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
pub(crate) struct Args {
    /// vec2x64 in the six-bit layout.
    pub six: bool,
    pub tables: *const i8,
    pub row: *const u8,
    pub row_bytes: usize,
    pub n_rows: usize,
    pub nchunks: usize,
    pub cin_pad: usize,
    pub t: usize,
    pub planes: usize,
    pub xq: *const i16,
    /// `QuantX::q2`.
    pub xq2: *const i8,
    pub xs: *const f32,
    /// `QuantX::corr`.
    pub corr: *const i32,
    pub nblocks: usize,
    /// Scales of the output rows of the first index row on.
    pub scale: *const f32,
    /// Output of the first index row's first output row; activation rows `out_t_stride` apart.
    pub out: *mut f32,
    pub out_t_stride: usize,
    /// The activations are one row in the pair layout of the 512-bit decode (`QuantX::paired`).
    pub paired: bool,
    /// `QuantX::qhl`.
    pub xhl: *const i8,
}

#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
impl Args {
    /// The same call for activation rows `t0..t0 + t` alone.
    ///
    /// # Safety
    /// `t0 + t` within this call's rows.
    unsafe fn rows_from(&self, t0: usize, t: usize) -> Args {
        Args {
            t,
            xq: self.xq.add(t0 * self.cin_pad),
            xq2: self.xq2.add(t0 * self.cin_pad),
            xhl: self.xhl.add(if self.paired { t0 * (self.nchunks / 2) * 4 * CHUNK } else { 0 }),
            xs: self.xs.add(t0 * self.nblocks * 2),
            corr: self.corr.add(t0 * self.nblocks * 2 * LANES),
            out: self.out.add(t0 * self.out_t_stride),
            ..*self
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod zmm;

pub(crate) mod prefill;

#[cfg(target_arch = "aarch64")]
mod neon;

#[cfg(target_arch = "x86_64")]
mod avx2 {
    //! Decode (one activation row) and the one-output kinds at a few rows look weights up and
    //! multiply them in registers; the vector formats at a few rows first expand a block of
    //! four output rows to 16-bit weights in an L1 buffer and stream every activation row past
    //! it. Weights are multiplied as unsigned `w + 128` (the lookup tables and INT8 bytes are
    //! flipped by `0x80`, so widening is a zero-extend) and `QuantX::corr` takes the offset
    //! back out. Each block ends with exact 32-bit lane sums fused into f32 lanes
    //! ([`super::accumulate`]'s arithmetic) and each row with [`super::reduce_lanes`]' order,
    //! so the kernels equal the scalar reference bit for bit.
    use super::{Args, DecodeArgs, Kind, CHUNK, LANES, XBLOCK};
    use std::arch::x86_64::*;

    const LUT4: u8 = 0;
    const VEC16: u8 = 1;
    const VEC64: u8 = 2;
    const INT8: u8 = 3;
    const LUT3: u8 = 4;
    const LUT2: u8 = 5;
    /// Added to a kind: its AVX-512 variant (same layout, same results). VNNI's `vpdpwssd` and
    /// `vpdpbusd` multiply and accumulate in one instruction where AVX2 takes two or three, and
    /// vec2x64's 64-entry lookups are one VBMI `vpermi2b` each.
    const X512: u8 = 8;
    /// Added to an AVX-512 variant: the kind's layout of its own (`super::six_bit_layout`).
    const SIX: u8 = 16;

    /// The kind without the instruction-set and layout bits.
    const fn base(k: u8) -> u8 {
        k & !(X512 | SIX)
    }
    pub(super) const LUT4X: u8 = LUT4 | X512;
    pub(super) const LUT3X: u8 = LUT3 | X512;
    pub(super) const LUT2X: u8 = LUT2 | X512;
    pub(super) const VEC16X: u8 = VEC16 | X512;
    pub(super) const VEC64X: u8 = VEC64 | X512;
    pub(super) const VEC64S: u8 = VEC64 | X512 | SIX;
    pub(super) const LUT3S: u8 = LUT3 | X512 | SIX;
    pub(super) const LUT2S: u8 = LUT2 | X512 | SIX;
    pub(super) const LUT4S: u8 = LUT4 | X512 | SIX;
    pub(super) const VEC16S: u8 = VEC16 | X512 | SIX;
    pub(super) const INT8X: u8 = INT8 | X512;
    /// Chunks per activation block.
    pub(super) const PER_BLOCK: usize = XBLOCK / CHUNK;
    /// How far ahead of the weight stream the decode kernels prefetch, bytes, and into which
    /// cache: 16 KiB ahead into L2. A request into L1 holds one of the core's few miss buffers
    /// until the line arrives, so with L1 requests the requests in flight, not the memory, set
    /// the pace; on a Zen 4 the 512-bit kernels read 1.15–1.5× as fast from memory with their
    /// requests into L2. 8 KiB ahead is a little short; 24 or 32 KiB gain nothing, nor does an
    /// extra request into L1 1–2 KiB ahead.
    pub(super) const PREFETCH: usize = 16384;

    /// How far ahead the AVX2 kernels of the vector kinds ask for weights, into L1 (see
    /// `chunk_group`: bound by their instructions, their loads would wait on L2).
    const PREFETCH_L1: usize = 8192;

    /// Asks for the weight line `PREFETCH` bytes past `p` to be brought into L2 (a hint: any
    /// address will do).
    #[inline(always)]
    pub(super) unsafe fn prefetch_l2(p: *const u8) {
        _mm_prefetch::<_MM_HINT_T1>(p.wrapping_add(PREFETCH) as *const i8)
    }

    /// Most activation rows per kernel call (more are split).
    pub(super) const MAX_T: usize = super::GEMM_MIN_T - 1;

    /// # Safety
    /// AVX2 must be available and `a` describe valid buffers (see `DotMatrix::rows`).
    pub(super) unsafe fn rows(kind: Kind, a: &Args) {
        if a.paired {
            // SAFETY: activations are paired only where the CPU has the AVX-512 subsets
            // (`QuantX::fill`).
            return super::zmm::rows(kind, a);
        }
        if a.t > MAX_T {
            // `block_rows` keeps MAX_T rows of lanes: split.
            for t0 in (0..a.t).step_by(MAX_T) {
                rows(kind, &a.rows_from(t0, MAX_T.min(a.t - t0)));
            }
            return;
        }
        // The kernel for a kind, each entry in its AVX2 or AVX-512 build.
        macro_rules! go {
            ($k:expr, $decode:ident, $pass:ident, $block:ident) => {{
                // The vector kinds too look weights up in registers per pass of four rows up
                // to 8 rows: there expanding blocks to 16 bits first costs more than it saves
                // (vec2x64 in L2 runs about twice as fast at 2–3 rows without it), while from
                // 12 rows on the expanded blocks are faster. (This holds for the AVX2 builds;
                // the AVX-512 builds keep the blocks.)
                let in_registers = nw($k) == 1 || (a.t <= 8 && $k & X512 == 0);
                match (a.t, a.planes, in_registers) {
                    (1, 2, _) => $decode::<$k, 2>(a),
                    (1, _, _) => $decode::<$k, 1>(a),
                    (_, 2, true) => $pass::<$k, 2>(a),
                    (_, _, true) => $pass::<$k, 1>(a),
                    (_, 2, false) => $block::<$k, 2>(a),
                    _ => $block::<$k, 1>(a),
                }
            }};
        }
        if super::avx512() {
            // SAFETY: the AVX-512 subsets were checked by `avx512()`; `a` as for this function.
            return match kind {
                Kind::Lut4 if a.six => go!(LUT4S, decode_rows_x512, pass_rows_x512, block_rows_x512),
                Kind::Lut4 => go!(LUT4X, decode_rows_x512, pass_rows_x512, block_rows_x512),
                Kind::Lut3 if a.six => go!(LUT3S, decode_rows_x512, pass_rows_x512, block_rows_x512),
                Kind::Lut3 => go!(LUT3X, decode_rows_x512, pass_rows_x512, block_rows_x512),
                Kind::Lut2 if a.six => go!(LUT2S, decode_rows_x512, pass_rows_x512, block_rows_x512),
                Kind::Lut2 => go!(LUT2X, decode_rows_x512, pass_rows_x512, block_rows_x512),
                Kind::Vec2x16 if a.six => go!(VEC16S, decode_rows_x512, pass_rows_x512, block_rows_x512),
                Kind::Vec2x16 => go!(VEC16X, decode_rows_x512, pass_rows_x512, block_rows_x512),
                Kind::Vec2x64 if a.six => go!(VEC64S, decode_rows_x512, pass_rows_x512, block_rows_x512),
                Kind::Vec2x64 => go!(VEC64X, decode_rows_x512, pass_rows_x512, block_rows_x512),
                Kind::Int8 => go!(INT8X, decode_rows_x512, pass_rows_x512, block_rows_x512),
            };
        }
        match kind {
            Kind::Lut4 => go!(LUT4, decode_rows, pass_rows, block_rows),
            Kind::Lut3 => go!(LUT3, decode_rows, pass_rows, block_rows),
            Kind::Lut2 => go!(LUT2, decode_rows, pass_rows, block_rows),
            Kind::Vec2x16 => go!(VEC16, decode_rows, pass_rows, block_rows),
            Kind::Vec2x64 => go!(VEC64, decode_rows, pass_rows, block_rows),
            Kind::Int8 => go!(INT8, decode_rows, pass_rows, block_rows),
        }
    }

    /// [`decode_rows`] on AVX-512 (`K` with `X512`).
    #[target_feature(enable = "avx2,fma,avx512f,avx512bw,avx512vl,avx512vbmi,avx512vnni")]
    unsafe fn decode_rows_x512<const K: u8, const P: usize>(a: &Args) {
        decode_rows_in::<K, P>(a)
    }

    /// [`pass_rows`] on AVX-512.
    #[target_feature(enable = "avx2,fma,avx512f,avx512bw,avx512vl,avx512vbmi,avx512vnni")]
    unsafe fn pass_rows_x512<const K: u8, const P: usize>(a: &Args) {
        pass_rows_in::<K, P>(a)
    }

    /// [`block_rows`] on AVX-512.
    #[target_feature(enable = "avx2,fma,avx512f,avx512bw,avx512vl,avx512vbmi,avx512vnni")]
    unsafe fn block_rows_x512<const K: u8, const P: usize>(a: &Args) {
        block_rows_in::<K, P>(a)
    }

    /// Output rows per index row.
    pub(super) const fn nw(k: u8) -> usize {
        if base(k) == VEC16 || base(k) == VEC64 {
            2
        } else {
            1
        }
    }

    pub(super) const fn chunk_bytes(k: u8) -> usize {
        match base(k) {
            VEC64 => 24,
            INT8 => 32,
            LUT3 => 12,
            LUT2 => 8,
            _ => 16,
        }
    }

    /// The lookup tables and masks a kind needs, loaded once per call.
    pub(super) struct Tabs {
        t: [__m256i; 8],
        m15: __m256i,
        /// XORed into INT8 weights: `0x80` for the dot kernels' unsigned weights, 0 to decode.
        flip: __m256i,
    }

    /// Tables as signed weights (`unsigned` false) or as `w + 128` (`w ^ 0x80`).
    #[inline(always)]
    pub(super) unsafe fn tabs(k: u8, tables: *const i8, unsigned: bool) -> Tabs {
        let n = match base(k) {
            LUT4 | LUT2 => 1,
            VEC16 | LUT3 => 2,
            VEC64 => 8,
            _ => 0,
        };
        let flip = if unsigned { _mm256_set1_epi8(-128) } else { _mm256_setzero_si256() };
        let mut t = [_mm256_setzero_si256(); 8];
        for (i, v) in t.iter_mut().enumerate().take(n) {
            let tab = _mm256_broadcastsi128_si256(_mm_loadu_si128(tables.add(16 * i) as *const __m128i));
            *v = _mm256_xor_si256(tab, flip);
        }
        Tabs { t, m15: _mm256_set1_epi8(15), flip }
    }

    /// Low nibbles then high nibbles of 16 bytes: the 32 4-bit indices in column order.
    /// (A broadcast load and a per-lane variable shift: no cross-lane insert.)
    #[inline(always)]
    unsafe fn nibbles(p: *const u8, m15: __m256i) -> __m256i {
        let v = _mm256_broadcastsi128_si256(_mm_loadu_si128(p as *const __m128i));
        _mm256_and_si256(_mm256_srlv_epi32(v, _mm256_setr_epi32(0, 0, 0, 0, 4, 4, 4, 4)), m15)
    }

    /// The 32 two-bit fields of 8 bytes (lut2, and lut3's low bits) in column order: byte `m`
    /// holds column `m`'s field in bits 0–1 (above them, other columns' bits: the tables repeat
    /// every four entries, so a lookup reads only those two).
    #[inline(always)]
    unsafe fn crumbs(p: *const u8, m15: __m256i) -> __m256i {
        let v = _mm256_set1_epi64x((p as *const i64).read_unaligned());
        _mm256_and_si256(_mm256_srlv_epi64(v, _mm256_setr_epi64x(0, 2, 4, 6)), m15)
    }

    /// `vpermb` control for [`weights`]' six-bit chunks: 64-bit word `j` gets bytes `6j..6j + 6`.
    #[inline(always)]
    unsafe fn six_spread256() -> __m256i {
        const C: [u8; 32] = {
            let mut c = [0u8; 32];
            let mut k = 0;
            while k < 32 {
                c[k] = (6 * (k / 8) + k % 8) as u8;
                k += 1;
            }
            c
        };
        _mm256_loadu_si256(C.as_ptr() as *const __m256i)
    }

    /// `vpmultishiftqb` control for six-bit fields: byte `i` of each word from bit `6i`.
    #[inline(always)]
    pub(super) unsafe fn six_shifts256() -> __m256i {
        _mm256_set1_epi64x(0x2A24_1E18_120C_0600)
    }

    /// `vpmultishiftqb` control for three-bit fields: byte `i` of each word from bit `3i`.
    #[inline(always)]
    pub(super) unsafe fn three_shifts256() -> __m256i {
        _mm256_set1_epi64x(0x1512_0F0C_0906_0300)
    }

    /// A 64-entry lookup: four 16-entry lookups with the low index bits, picked by bit 4 (top
    /// bit of `b4`) and bit 5 (top bit of `b5`).
    #[inline(always)]
    unsafe fn look64(t: &[__m256i], lo: __m256i, b4: __m256i, b5: __m256i) -> __m256i {
        let v01 = _mm256_blendv_epi8(_mm256_shuffle_epi8(t[0], lo), _mm256_shuffle_epi8(t[1], lo), b4);
        let v23 = _mm256_blendv_epi8(_mm256_shuffle_epi8(t[2], lo), _mm256_shuffle_epi8(t[3], lo), b4);
        _mm256_blendv_epi8(v01, v23, b5)
    }

    /// The chunk at `p` as `nw(K)` vectors of 32 weights in column order (signed, or `w + 128`
    /// with tables from `tabs(.., true)`).
    #[inline(always)]
    pub(super) unsafe fn weights<const K: u8>(p: *const u8, tb: &Tabs) -> [__m256i; 2] {
        let zero = _mm256_setzero_si256();
        match K {
            LUT4 | LUT4X | LUT4S => [_mm256_shuffle_epi8(tb.t[0], nibbles(p, tb.m15)), zero],
            LUT2 | LUT2X | LUT2S => [_mm256_shuffle_epi8(tb.t[0], crumbs(p, tb.m15)), zero],
            LUT3 | LUT3X => {
                let lo = crumbs(p, tb.m15);
                // Bit 2 of each index to the top of its byte (`hi_bit`), then entries 0–3 or 4–7.
                let h = _mm256_set1_epi32((p.add(8) as *const i32).read_unaligned());
                let b2 = _mm256_sllv_epi32(h, _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
                [_mm256_blendv_epi8(_mm256_shuffle_epi8(tb.t[0], lo), _mm256_shuffle_epi8(tb.t[1], lo), b2), zero]
            }
            VEC16 | VEC16X | VEC16S => {
                let i = nibbles(p, tb.m15);
                [_mm256_shuffle_epi8(tb.t[0], i), _mm256_shuffle_epi8(tb.t[1], i)]
            }
            VEC64 => {
                let hi = _mm256_set1_epi64x((p.add(16) as *const i64).read_unaligned());
                // Bit 5 of each index to the top of its byte; one more shift brings bit 4.
                let b5 = _mm256_sllv_epi64(hi, _mm256_setr_epi64x(0, 2, 4, 6));
                let b4 = _mm256_slli_epi16::<1>(b5);
                let lo = nibbles(p, tb.m15);
                [look64(&tb.t[..4], lo, b4, b5), look64(&tb.t[4..], lo, b4, b5)]
            }
            LUT3S => {
                // Word q takes bytes 3q..3q + 8 (a 16-byte load, 4 bytes past the chunk: the
                // next one or `SLACK`), byte i of it the eight bits from bit 3i, and the table
                // of entries 0–7 repeated (`vpermb` reads five bits) the low three.
                let v = _mm256_zextsi128_si256(_mm_loadu_si128(p as *const __m128i));
                let spread = _mm256_setr_epi64x(
                    0x0706_0504_0302_0100,
                    0x0A09_0807_0605_0403,
                    0x0D0C_0B0A_0908_0706,
                    0x100F_0E0D_0C0B_0A09,
                );
                let idx = _mm256_multishift_epi64_epi8(three_shifts256(), _mm256_permutexvar_epi8(spread, v));
                let t8 = _mm256_mask_blend_epi8(0xF0F0_F0F0, tb.t[0], tb.t[1]);
                [_mm256_permutexvar_epi8(idx, t8), zero]
            }
            VEC64S => {
                // Eight indices per 64-bit word: word j takes bytes 6j..6j + 6 (a 32-byte load,
                // 8 bytes past the chunk: the next chunk or `SLACK`), and byte i of each word
                // the eight bits from bit 6i (`vpermi2b` reads the low six).
                let v = _mm256_loadu_si256(p as *const __m256i);
                let idx = _mm256_multishift_epi64_epi8(six_shifts256(), _mm256_permutexvar_epi8(six_spread256(), v));
                let t = |i: usize| _mm256_permute2x128_si256::<0x20>(tb.t[i], tb.t[i + 1]);
                [_mm256_permutex2var_epi8(t(0), idx, t(2)), _mm256_permutex2var_epi8(t(4), idx, t(6))]
            }
            VEC64X => {
                let hi = _mm256_set1_epi64x((p.add(16) as *const i64).read_unaligned());
                // Bits 5 and 4 of each index to bits 7 and 6 of its byte, then down to 5 and 4
                // (the 16-bit shift moves both bytes of a word alike), under the nibble.
                let b54 = _mm256_srli_epi16::<2>(_mm256_sllv_epi64(hi, _mm256_setr_epi64x(0, 2, 4, 6)));
                // (b54 & 0x30) | lo: `lo` has only its low four bits set.
                let idx = _mm256_ternarylogic_epi32::<0xEC>(b54, nibbles(p, tb.m15), _mm256_set1_epi8(0x30));
                // Entries 0–31 and 32–63 of each component's table (`vpermi2b` reads 6 bits).
                let t = |i: usize| _mm256_permute2x128_si256::<0x20>(tb.t[i], tb.t[i + 1]);
                [_mm256_permutex2var_epi8(t(0), idx, t(2)), _mm256_permutex2var_epi8(t(4), idx, t(6))]
            }
            _ => [_mm256_xor_si256(_mm256_loadu_si256(p as *const __m256i), tb.flip), zero],
        }
    }

    /// Chunks per group of the kind's AVX-512 layout (`super::group_field`), 0 without one.
    pub(super) const fn group_chunks(k: u8) -> usize {
        match k {
            LUT4S | VEC16S => 4,
            LUT2S | VEC64S => 8,
            LUT3S => 16,
            _ => 0,
        }
    }

    /// Chunks of a row of `nchunks` in whole groups of the kind's AVX-512 layout.
    #[inline(always)]
    pub(super) const fn grouped_chunks(k: u8, nchunks: usize) -> usize {
        match group_chunks(k) {
            0 => 0,
            g => nchunks / g * g,
        }
    }

    /// The six bits that lut3 and vec2x64 keep in the top two bits of a group's three planes
    /// (`super::group_field`): bits 0–1 from `p0`, 2–3 from `p1`, 4–5 from `p2`. Each 16-bit
    /// shift brings one plane's top bits of both bytes of a word to their place, and the bit
    /// selects keep them (what the high byte shifts into a low one lies outside the kept bits).
    #[inline(always)]
    pub(super) unsafe fn top_slot256(p0: __m256i, p1: __m256i, p2: __m256i) -> __m256i {
        let (a, b, c) = (_mm256_srli_epi16::<6>(p0), _mm256_srli_epi16::<4>(p1), _mm256_srli_epi16::<2>(p2));
        // `C ? A : B`, bitwise.
        let ab = _mm256_ternarylogic_epi32::<0xE4>(a, b, _mm256_set1_epi8(0x03));
        _mm256_ternarylogic_epi32::<0xE4>(ab, c, _mm256_set1_epi8(0x0F))
    }

    /// Chunk `c` of the index row at `row` (`nchunks` chunks) as [`weights`] gives it. In the
    /// groups of the AVX-512 layouts (`super::group_field`) the chunk's columns 0–15 and 16–31
    /// are two 16-byte runs of each plane; its pair's field comes down with one 16-bit shift
    /// (lut2, lut3's second pair of a slot) or is the slot itself.
    #[inline(always)]
    pub(super) unsafe fn weights_at<const K: u8>(row: *const u8, c: usize, nchunks: usize, tb: &Tabs) -> [__m256i; 2] {
        if c < grouped_chunks(K, nchunks) {
            let gc = group_chunks(K);
            let g = row.add(c / gc * gc * chunk_bytes(K));
            let (k, s) = (c % gc / 2, c % 2);
            let plane = |i: usize| {
                let lo = _mm_loadu_si128(g.add(64 * i + 16 * s) as *const __m128i);
                let hi = _mm_loadu_si128(g.add(64 * i + 32 + 16 * s) as *const __m128i);
                _mm256_inserti128_si256::<1>(_mm256_castsi128_si256(lo), hi)
            };
            let slot = |i: usize| if i < 3 { plane(i) } else { top_slot256(plane(0), plane(1), plane(2)) };
            return match K {
                LUT2S | LUT4S | VEC16S => {
                    let bits = if K == LUT2S { 2 } else { 4 };
                    let idx = _mm256_and_si256(_mm256_srl_epi16(plane(0), _mm_cvtsi32_si128(bits * k as i32)), tb.m15);
                    let w1 = if K == VEC16S { _mm256_shuffle_epi8(tb.t[1], idx) } else { _mm256_setzero_si256() };
                    [_mm256_shuffle_epi8(tb.t[0], idx), w1]
                }
                LUT3S => {
                    // Entries 0–7 repeated (`vpermb` reads five bits: the field and two above).
                    let v = slot(k / 2);
                    let idx = if k % 2 == 0 { v } else { _mm256_srli_epi16::<3>(v) };
                    let t8 = _mm256_mask_blend_epi8(0xF0F0_F0F0, tb.t[0], tb.t[1]);
                    [_mm256_permutexvar_epi8(idx, t8), _mm256_setzero_si256()]
                }
                _ => {
                    let idx = slot(k);
                    let t = |i: usize| _mm256_permute2x128_si256::<0x20>(tb.t[i], tb.t[i + 1]);
                    [_mm256_permutex2var_epi8(t(0), idx, t(2)), _mm256_permutex2var_epi8(t(4), idx, t(6))]
                }
            };
        }
        weights::<K>(row.add(c * chunk_bytes(K)), tb)
    }

    /// 32 unsigned bytes as two vectors of 16-bit values, in the in-lane unpack order that the
    /// activations are stored in (see `xpos`).
    #[inline(always)]
    unsafe fn widen(w: __m256i) -> (__m256i, __m256i) {
        let z = _mm256_setzero_si256();
        (_mm256_unpacklo_epi8(w, z), _mm256_unpackhi_epi8(w, z))
    }

    /// Ends a block for one output: the exact lane sums `acc − corr` (the unsigned offset taken
    /// back out) fused into the f32 lanes with the block's scale `s`.
    #[inline(always)]
    pub(super) unsafe fn close_block(lanes: __m256, acc: __m256i, corr: *const i32, s: *const f32) -> __m256 {
        let exact = _mm256_sub_epi32(acc, _mm256_loadu_si256(corr as *const __m256i));
        _mm256_fmadd_ps(_mm256_cvtepi32_ps(exact), _mm256_broadcast_ss(&*s), lanes)
    }

    /// `super::quantize_chunk` in AVX2, with the same f32 operations (multiply, round to nearest
    /// even, multiply and subtract, unfused) so the codes and residuals are identical.
    ///
    /// # Safety
    /// AVX2 must be present; `out` holds 32 codes, `resid` at least `v.len() ≤ 32` values.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn quantize_chunk(v: &[f32], inv: f32, s: f32, out: &mut [i16], resid: &mut [f32]) {
        assert!(v.len() <= CHUNK && out.len() >= CHUNK && resid.len() >= v.len());
        // A whole chunk is read and its residuals written in place; only a last partial one
        // goes through zero-padded copies (two 128-byte `memcpy` calls per chunk would cost
        // 1 % of SmolLM2's decode time).
        let whole = v.len() == CHUNK;
        let mut buf = [0f32; CHUNK];
        let mut res = [0f32; CHUNK];
        let (src, dst) = if whole {
            (v.as_ptr(), resid.as_mut_ptr())
        } else {
            buf[..v.len()].copy_from_slice(v);
            (buf.as_ptr(), res.as_mut_ptr())
        };
        let (vinv, vs) = (_mm256_set1_ps(inv), _mm256_set1_ps(s));
        let mut codes = [_mm256_setzero_si256(); 4];
        for (i, c) in codes.iter_mut().enumerate() {
            let x = _mm256_loadu_ps(src.add(8 * i));
            let r = _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(_mm256_mul_ps(x, vinv));
            *c = _mm256_cvtps_epi32(r);
            _mm256_storeu_ps(dst.add(8 * i), _mm256_sub_ps(x, _mm256_mul_ps(r, vs)));
        }
        // Columns [0–7, 16–23] then [8–15, 24–31]: `packs` interleaves 128-bit halves, the
        // permute puts them back in order.
        let ac = _mm256_permute4x64_epi64::<0xD8>(_mm256_packs_epi32(codes[0], codes[2]));
        let bd = _mm256_permute4x64_epi64::<0xD8>(_mm256_packs_epi32(codes[1], codes[3]));
        _mm256_storeu_si256(out.as_mut_ptr() as *mut __m256i, ac);
        _mm256_storeu_si256(out.as_mut_ptr().add(16) as *mut __m256i, bd);
        if !whole {
            resid[..v.len()].copy_from_slice(&res[..v.len()]);
        }
    }

    /// `super::quantize_plane2` in AVX2: the same multiply and round to nearest even (the
    /// scalar code's `round_small` differs only in the sign of a zero, which the integer
    /// conversion drops), so the codes are identical.
    ///
    /// # Safety
    /// AVX2 must be present; `out` holds at least `v.len()` codes.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn quantize_plane2(v: &[f32], inv: f32, out: &mut [i8]) {
        assert!(out.len() >= v.len());
        let n = v.len() / CHUNK * CHUNK;
        let (vinv, lo, hi) = (_mm256_set1_ps(inv), _mm256_set1_ps(-super::XMAX2), _mm256_set1_ps(super::XMAX2));
        // `packs` leaves four-byte groups [a0–3 b0–3 c0–3 d0–3 | a4–7 b4–7 c4–7 d4–7].
        let order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
        for i in (0..n).step_by(CHUNK) {
            let mut c = [_mm256_setzero_si256(); 4];
            for (k, ck) in c.iter_mut().enumerate() {
                let x = _mm256_mul_ps(_mm256_loadu_ps(v.as_ptr().add(i + 8 * k)), vinv);
                let r = _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(x);
                *ck = _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(r, lo), hi));
            }
            let codes = _mm256_packs_epi16(_mm256_packs_epi32(c[0], c[1]), _mm256_packs_epi32(c[2], c[3]));
            let codes = _mm256_permutevar8x32_epi32(codes, order);
            _mm256_storeu_si256(out.as_mut_ptr().add(i) as *mut __m256i, codes);
        }
        super::quantize_plane2(&v[n..], inv, &mut out[n..]);
    }

    /// A block's `QuantX::corr` in the plain layout: `out[..8]` the 16-bit plane's lanes
    /// (`pmaddwd` pairs of positions), `out[8..16]` the second plane's (columns `4l..4l + 4`),
    /// each `128 · Σ q`. Exact integer sums, so equal to the scalar loop.
    ///
    /// # Safety
    /// AVX2 must be present.
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn block_corr(q: &[i16], q2: &[i8], out: &mut [i32]) {
        assert!(q.len() == q2.len() && q.len().is_multiple_of(CHUNK) && out.len() >= 2 * LANES);
        let (ones16, ones8) = (_mm256_set1_epi16(1), _mm256_set1_epi8(1));
        let (mut a1, mut a2) = (_mm256_setzero_si256(), _mm256_setzero_si256());
        for c in 0..q.len() / CHUNK {
            let p = q.as_ptr().add(c * CHUNK) as *const __m256i;
            let pairs = _mm256_add_epi32(
                _mm256_madd_epi16(_mm256_loadu_si256(p), ones16),
                _mm256_madd_epi16(_mm256_loadu_si256(p.add(1)), ones16),
            );
            a1 = _mm256_add_epi32(a1, pairs);
            let p2 = _mm256_maddubs_epi16(ones8, _mm256_loadu_si256(q2.as_ptr().add(c * CHUNK) as *const __m256i));
            a2 = _mm256_add_epi32(a2, _mm256_madd_epi16(p2, ones16));
        }
        _mm256_storeu_si256(out.as_mut_ptr() as *mut __m256i, _mm256_slli_epi32::<7>(a1));
        _mm256_storeu_si256(out.as_mut_ptr().add(LANES) as *mut __m256i, _mm256_slli_epi32::<7>(a2));
    }

    /// See `super::dot_rows`: tiles of 3 activation rows × 4 weight rows, eight inputs per
    /// step, the tail of a row through masked loads.
    ///
    /// # Safety
    /// AVX2/FMA present; `x` holds `t·cin`, `w` `n·cin` values, `out` `t` rows `stride` apart.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn dot_rows(
        x: *const f32,
        t: usize,
        cin: usize,
        w: *const f32,
        n: usize,
        out: *mut f32,
        stride: usize,
    ) {
        let mut i = 0;
        while i < t {
            let (xi, oi) = (x.add(i * cin), out.add(i * stride));
            match t - i {
                1 => rows_of_tiles::<1>(xi, cin, w, n, oi, stride),
                2 => rows_of_tiles::<2>(xi, cin, w, n, oi, stride),
                _ => {
                    let mut j = 0;
                    while j + 4 <= n {
                        let s = dot_tile::<3, 4>(xi, cin, w.add(j * cin));
                        let g = reduce8(&[s[0][0], s[0][1], s[0][2], s[0][3], s[1][0], s[1][1], s[1][2], s[1][3]]);
                        _mm_storeu_ps(oi.add(j), _mm256_castps256_ps128(g));
                        _mm_storeu_ps(oi.add(stride + j), _mm256_extractf128_ps::<1>(g));
                        for (c, &v) in s[2].iter().enumerate() {
                            *oi.add(2 * stride + j + c) = reduce(v);
                        }
                        j += 4;
                    }
                    if j < n {
                        dot_tile_any::<3>(xi, cin, w.add(j * cin), n - j, oi.add(j), stride);
                    }
                }
            }
            i += 3;
        }
    }

    /// The last one or two activation rows against all `n` weight rows, four at a time.
    #[inline(always)]
    unsafe fn rows_of_tiles<const R: usize>(
        x: *const f32,
        cin: usize,
        w: *const f32,
        n: usize,
        out: *mut f32,
        stride: usize,
    ) {
        for j in (0..n).step_by(4) {
            dot_tile_any::<R>(x, cin, w.add(j * cin), (n - j).min(4), out.add(j), stride);
        }
    }

    /// An edge tile: `R` activation rows against `nw ≤ 4` weight rows.
    #[inline(always)]
    unsafe fn dot_tile_any<const R: usize>(
        x: *const f32,
        cin: usize,
        w: *const f32,
        nw: usize,
        out: *mut f32,
        stride: usize,
    ) {
        let s: [[__m256; 4]; R] = match nw {
            4 => dot_tile::<R, 4>(x, cin, w),
            3 => pad(dot_tile::<R, 3>(x, cin, w)),
            2 => pad(dot_tile::<R, 2>(x, cin, w)),
            _ => pad(dot_tile::<R, 1>(x, cin, w)),
        };
        for (r, sr) in s.iter().enumerate() {
            for (c, &v) in sr.iter().enumerate().take(nw) {
                *out.add(r * stride + c) = reduce(v);
            }
        }
    }

    #[inline(always)]
    fn pad<const R: usize, const C: usize>(s: [[__m256; C]; R]) -> [[__m256; 4]; R] {
        // SAFETY: all-zero bits are a valid __m256.
        let z = unsafe { _mm256_setzero_ps() };
        s.map(|r| std::array::from_fn(|c| if c < C { r[c] } else { z }))
    }

    /// Lane sums of `R × C` dot products over `cin` inputs (rows `cin` apart).
    #[inline(always)]
    #[allow(clippy::needless_range_loop)] // indexing keeps the accumulators in registers
    unsafe fn dot_tile<const R: usize, const C: usize>(x: *const f32, cin: usize, w: *const f32) -> [[__m256; C]; R] {
        let mut acc = [[_mm256_setzero_ps(); C]; R];
        let mut k = 0;
        while k + 8 <= cin {
            let xv: [__m256; R] = std::array::from_fn(|r| _mm256_loadu_ps(x.add(r * cin + k)));
            for c in 0..C {
                let wv = _mm256_loadu_ps(w.add(c * cin + k));
                for r in 0..R {
                    acc[r][c] = _mm256_fmadd_ps(xv[r], wv, acc[r][c]);
                }
            }
            k += 8;
        }
        if k < cin {
            let m = _mm256_cmpgt_epi32(_mm256_set1_epi32((cin - k) as i32), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
            let xv: [__m256; R] = std::array::from_fn(|r| _mm256_maskload_ps(x.add(r * cin + k), m));
            for c in 0..C {
                let wv = _mm256_maskload_ps(w.add(c * cin + k), m);
                for r in 0..R {
                    acc[r][c] = _mm256_fmadd_ps(xv[r], wv, acc[r][c]);
                }
            }
        }
        acc
    }

    /// The eight lanes summed in `reduce_lanes` order.
    #[inline(always)]
    pub(super) unsafe fn reduce(v: __m256) -> f32 {
        let h = _mm256_hadd_ps(v, v);
        let h = _mm256_hadd_ps(h, h);
        _mm_cvtss_f32(_mm_add_ss(_mm256_castps256_ps128(h), _mm256_extractf128_ps::<1>(h)))
    }

    /// Eight rows' lanes summed at once, each in `reduce_lanes` order: row `i` in lane `i`.
    #[inline(always)]
    pub(super) unsafe fn reduce8(v: &[__m256; 8]) -> __m256 {
        let g0 = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
        let g1 = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
        // g0 = [r0..r3 of lanes 0–3 | r0..r3 of lanes 4–7], g1 likewise for rows 4–7.
        _mm256_add_ps(_mm256_permute2f128_ps::<0x20>(g0, g1), _mm256_permute2f128_ps::<0x31>(g0, g1))
    }

    /// `acc + Σ` of the unsigned weight bytes `w` times the signed second-plane codes at `x`,
    /// four columns per lane (`lane2`): `pmaddubsw` (exact: see `XMAX2`), then `pmaddwd` by
    /// ones.
    #[inline(always)]
    unsafe fn mac2<const K: u8>(acc: __m256i, w: __m256i, x: *const __m256i) -> __m256i {
        if K & X512 != 0 {
            // The same four products per lane, summed exactly (no 16-bit step at all). Into
            // zero, not `acc`: the accumulator's chain stays one 1-cycle add per chunk instead
            // of the multiply-add's latency (carrying `acc` through it halves lut4's speed).
            let p = _mm256_dpbusd_epi32(_mm256_setzero_si256(), w, _mm256_loadu_si256(x));
            return _mm256_add_epi32(acc, p);
        }
        let pairs = _mm256_maddubs_epi16(w, _mm256_loadu_si256(x));
        _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)))
    }

    /// `acc + madd(lo, x[0]) + madd(hi, x[1])`.
    #[inline(always)]
    unsafe fn mac<const K: u8>(acc: __m256i, lo: __m256i, hi: __m256i, x: *const __m256i) -> __m256i {
        if K & X512 != 0 {
            // The same pairs as `pmaddwd`, added without saturation: the same lane sums. The
            // second product accumulates onto the first, and only the last add touches `acc`.
            let p0 = _mm256_madd_epi16(lo, _mm256_loadu_si256(x));
            return _mm256_add_epi32(acc, _mm256_dpwssd_epi32(p0, hi, _mm256_loadu_si256(x.add(1))));
        }
        let p0 = _mm256_madd_epi16(lo, _mm256_loadu_si256(x));
        let p1 = _mm256_madd_epi16(hi, _mm256_loadu_si256(x.add(1)));
        _mm256_add_epi32(acc, _mm256_add_epi32(p0, p1))
    }

    /// # Safety
    /// AVX2 must be present, `row` hold `n_idx` index rows `row_bytes` apart, `scale` the
    /// `n_idx · nw` output scales and `out` `n_idx · nw · cin` values.
    pub(super) unsafe fn decode_f32(kind: Kind, a: &DecodeArgs) {
        if super::avx512() {
            // SAFETY: the AVX-512 subsets were checked by `avx512()`; `a` as for this function.
            return match kind {
                Kind::Lut4 if a.six => super::zmm::decode_f32::<LUT4S>(a),
                Kind::Lut4 => super::zmm::decode_f32::<LUT4X>(a),
                Kind::Lut3 if a.six => super::zmm::decode_f32::<LUT3S>(a),
                Kind::Lut2 if a.six => super::zmm::decode_f32::<LUT2S>(a),
                Kind::Lut3 => super::zmm::decode_f32::<LUT3X>(a),
                Kind::Lut2 => super::zmm::decode_f32::<LUT2X>(a),
                Kind::Vec2x16 if a.six => super::zmm::decode_f32::<VEC16S>(a),
                Kind::Vec2x16 => super::zmm::decode_f32::<VEC16X>(a),
                Kind::Vec2x64 if a.six => super::zmm::decode_f32::<VEC64S>(a),
                Kind::Vec2x64 => super::zmm::decode_f32::<VEC64X>(a),
                Kind::Int8 => super::zmm::decode_f32::<INT8X>(a),
            };
        }
        match kind {
            Kind::Lut4 => decode_f32_k::<LUT4>(a),
            Kind::Lut3 => decode_f32_k::<LUT3>(a),
            Kind::Lut2 => decode_f32_k::<LUT2>(a),
            Kind::Vec2x16 => decode_f32_k::<VEC16>(a),
            Kind::Vec2x64 => decode_f32_k::<VEC64>(a),
            Kind::Int8 => decode_f32_k::<INT8>(a),
        }
    }

    #[target_feature(enable = "avx2,fma")]
    unsafe fn decode_f32_k<const K: u8>(a: &DecodeArgs) {
        decode_f32_from::<K>(a, 0)
    }

    /// Columns from chunk `c0` on (the 512-bit decode leaves the last chunks to this).
    #[inline(always)]
    pub(super) unsafe fn decode_f32_from<const K: u8>(a: &DecodeArgs, c0: usize) {
        let DecodeArgs { tables, row, row_bytes, n_idx, cin, scale, out, .. } = *a;
        let tb = tabs(base(K), tables, false);
        let cb = chunk_bytes(K);
        let mut tail = [0f32; CHUNK];
        for g in 0..n_idx {
            let p = row.add(g * row_bytes);
            for c in c0..cin.div_ceil(CHUNK) {
                let w = weights_at::<K>(p, c, row_bytes / cb, &tb);
                let m = (cin - c * CHUNK).min(CHUNK);
                for (v, &wv) in w.iter().enumerate().take(nw(K)) {
                    let o = g * nw(K) + v;
                    let s = _mm256_set1_ps(*scale.add(o));
                    let dst = if m == CHUNK { out.add(o * cin + c * CHUNK) } else { tail.as_mut_ptr() };
                    let (l, h) = (_mm256_castsi256_si128(wv), _mm256_extracti128_si256::<1>(wv));
                    for (k, b) in [l, _mm_unpackhi_epi64(l, l), h, _mm_unpackhi_epi64(h, h)].into_iter().enumerate() {
                        let f = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
                        _mm256_storeu_ps(dst.add(8 * k), _mm256_mul_ps(f, s));
                    }
                    if m < CHUNK {
                        std::ptr::copy_nonoverlapping(tail.as_ptr(), out.add(o * cin + c * CHUNK), m);
                    }
                }
            }
        }
    }

    /// One activation row: lookups and products in registers, eight outputs reduced and stored
    /// together.
    #[target_feature(enable = "avx2,fma")]
    unsafe fn decode_rows<const K: u8, const P: usize>(a: &Args) {
        decode_rows_in::<K, P>(a)
    }

    #[inline(always)]
    unsafe fn decode_rows_in<const K: u8, const P: usize>(a: &Args) {
        let tb = tabs(K, a.tables, true);
        // One index row at a time. Several in flight would share the activation loads, but each
        // is its own stream of weight bytes and the hardware prefetchers fall behind: four lut4
        // or INT8 rows of SmolLM2's 576-wide head run at half the speed of one, and on large
        // matrices no row count beats one by a measurable margin.
        let per = 8 / nw(K);
        let mut r = 0;
        while r + per <= a.n_rows {
            let mut v = [_mm256_setzero_ps(); 8];
            for i in 0..per {
                let l = row_lanes::<K, P, 1>(a, &tb, r + i, 0);
                v[i * nw(K)] = l[0][0];
                if nw(K) == 2 {
                    v[i * 2 + 1] = l[0][1];
                }
            }
            let o0 = r * nw(K);
            _mm256_storeu_ps(a.out.add(o0), _mm256_mul_ps(reduce8(&v), _mm256_loadu_ps(a.scale.add(o0))));
            r += per;
        }
        while r < a.n_rows {
            row_in_registers::<K, P, 1>(a, &tb, r, 0);
            r += 1;
        }
    }

    /// Index row `r` against activation rows `t0..t0+T`, lookups and products in registers
    /// (`nw · T ≤ 4` outputs in flight).
    #[inline(always)]
    unsafe fn row_in_registers<const K: u8, const P: usize, const T: usize>(a: &Args, tb: &Tabs, r: usize, t0: usize) {
        let lanes = row_lanes::<K, P, T>(a, tb, r, t0);
        let o0 = r * nw(K);
        for (t, lt) in lanes.iter().enumerate() {
            for (v, &l) in lt.iter().enumerate().take(nw(K)) {
                *a.out.add((t0 + t) * a.out_t_stride + o0 + v) = reduce(l) * *a.scale.add(o0 + v);
            }
        }
    }

    /// The f32 lanes of index row `r` against activation rows `t0..t0+T`, per output.
    #[inline(always)]
    unsafe fn row_lanes<const K: u8, const P: usize, const T: usize>(
        a: &Args,
        tb: &Tabs,
        r: usize,
        t0: usize,
    ) -> [[__m256; 2]; T] {
        let zero = _mm256_setzero_si256();
        let mut lanes = [[_mm256_setzero_ps(); 2]; T];
        let mut c = 0usize;
        for b in 0..a.nblocks {
            let n = PER_BLOCK.min(a.nchunks - c);
            let mut acc = [[[zero; 2]; 2]; T];
            // A full block with a constant trip count: unrolled, no loop-exit misprediction.
            if n == PER_BLOCK {
                chunks_in_registers::<K, P, T>(a, tb, r, t0, c, PER_BLOCK, &mut acc);
            } else {
                chunks_in_registers::<K, P, T>(a, tb, r, t0, c, n, &mut acc);
            }
            c += n;
            for (t, (at, lt)) in acc.iter().zip(lanes.iter_mut()).enumerate() {
                let blk = ((t0 + t) * a.nblocks + b) * 2;
                for (l, av) in lt.iter_mut().zip(at).take(nw(K)) {
                    for (p, &ap) in av.iter().enumerate().take(P) {
                        *l = close_block(*l, ap, a.corr.add((blk + p) * LANES), a.xs.add(blk + p));
                    }
                }
            }
        }
        lanes
    }

    /// `n` chunks from chunk `c0` of index row `r` into `acc` (per activation row, output,
    /// plane).
    #[inline(always)]
    #[allow(clippy::too_many_arguments)]
    pub(super) unsafe fn chunks_in_registers<const K: u8, const P: usize, const T: usize>(
        a: &Args,
        tb: &Tabs,
        r: usize,
        t0: usize,
        c0: usize,
        n: usize,
        acc: &mut [[[__m256i; 2]; 2]; T],
    ) {
        let row = a.row.add(r * a.row_bytes);
        // Chunks in groups whose weights are all looked up before any is multiplied: the
        // out-of-order core then overlaps one group's lookups with the previous one's products,
        // which makes SmolLM2's decode about 1.1× as fast as one chunk per iteration. The sizes
        // are the largest that still pay: four for the one-output kinds (eight are no faster),
        // three for vec2x64 at few rows, two for vec2x16 (four are slower).
        let mut i = 0;
        if nw(K) == 1 {
            while i + 4 <= n {
                chunk_group::<K, P, T, 4>(a, tb, row, t0, c0 + i, acc);
                i += 4;
            }
        }
        // (Three at up to two activation rows; with four rows, three are slower than two.)
        if base(K) == VEC64 && T <= 2 {
            while i + 3 <= n {
                chunk_group::<K, P, T, 3>(a, tb, row, t0, c0 + i, acc);
                i += 3;
            }
        }
        while i + 2 <= n {
            chunk_group::<K, P, T, 2>(a, tb, row, t0, c0 + i, acc);
            i += 2;
        }
        if i < n {
            chunk_group::<K, P, T, 1>(a, tb, row, t0, c0 + i, acc);
        }
    }

    /// Chunks `c..c + U` of the index row at `row` into `acc`: all `U` chunks' weights first,
    /// then their products.
    #[inline(always)]
    #[allow(clippy::too_many_arguments)]
    unsafe fn chunk_group<const K: u8, const P: usize, const T: usize, const U: usize>(
        a: &Args,
        tb: &Tabs,
        row: *const u8,
        t0: usize,
        c: usize,
        acc: &mut [[[__m256i; 2]; 2]; T],
    ) {
        // One request per cache line of the group (INT8's four chunks span two). The kinds
        // that read faster than they compute (INT8, lut4) ask for L2 as the 512-bit kernels do,
        // which keeps more requests in flight from memory; vec2x16 and vec2x64, bound by their
        // instructions here, would then wait on L2 for their loads (6–20 % slower), so they
        // keep `PREFETCH_L1` into L1.
        for line in (0..U * chunk_bytes(K)).step_by(64) {
            let p = row.wrapping_add(c * chunk_bytes(K) + line);
            if nw(K) == 1 {
                prefetch_l2(p);
            } else {
                _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(PREFETCH_L1) as *const i8);
            }
        }
        let mut ws = [[_mm256_setzero_si256(); 2]; U];
        for (u, w) in ws.iter_mut().enumerate() {
            *w = weights_at::<K>(row, c + u, a.nchunks, tb);
        }
        for (u, w) in ws.iter().enumerate() {
            for (v, &wv) in w.iter().enumerate().take(nw(K)) {
                let (lo, hi) = widen(wv);
                for (t, at) in acc.iter_mut().enumerate() {
                    let x = a.xq.add((t0 + t) * a.cin_pad + (c + u) * CHUNK) as *const __m256i;
                    at[v][0] = mac::<K>(at[v][0], lo, hi, x);
                    if P == 2 {
                        let x2 = a.xq2.add((t0 + t) * a.cin_pad + (c + u) * CHUNK) as *const __m256i;
                        at[v][1] = mac2::<K>(at[v][1], wv, x2);
                    }
                }
            }
        }
    }

    /// A few activation rows with the one-output kinds (and, up to 8 rows, the vector kinds):
    /// one index row at a time against up to four activation rows, weights looked up in
    /// registers once per pass. (Expanding weights to a buffer first, as `block_rows` does,
    /// costs INT8 and lut4 more than it saves, and the vector kinds below 9 rows.)
    #[target_feature(enable = "avx2,fma")]
    unsafe fn pass_rows<const K: u8, const P: usize>(a: &Args) {
        pass_rows_in::<K, P>(a)
    }

    #[inline(always)]
    unsafe fn pass_rows_in<const K: u8, const P: usize>(a: &Args) {
        let tb = tabs(K, a.tables, true);
        for r in 0..a.n_rows {
            let mut t0 = 0;
            while t0 < a.t {
                match a.t - t0 {
                    1 => row_in_registers::<K, P, 1>(a, &tb, r, t0),
                    2 => row_in_registers::<K, P, 2>(a, &tb, r, t0),
                    3 => row_in_registers::<K, P, 3>(a, &tb, r, t0),
                    _ => row_in_registers::<K, P, 4>(a, &tb, r, t0),
                }
                t0 += 4;
            }
        }
    }

    /// Several activation rows (the vector kinds from 9): each block of a group of four output
    /// rows is expanded once to 16-bit weights (8 KiB, stays in L1), then every activation row
    /// streams past it; the four rows share each activation load, so the loop is bound by
    /// `pmaddwd`, not by reading activations from L2.
    #[target_feature(enable = "avx2,fma")]
    unsafe fn block_rows<const K: u8, const P: usize>(a: &Args) {
        block_rows_in::<K, P>(a)
    }

    #[inline(always)]
    unsafe fn block_rows_in<const K: u8, const P: usize>(a: &Args) {
        let tb = tabs(K, a.tables, true);
        let per_group = 4 / nw(K);
        let mut r = 0;
        while r < a.n_rows {
            let n = per_group.min(a.n_rows - r);
            match n * nw(K) {
                4 => block_group::<K, P, 4>(a, &tb, r),
                3 => block_group::<K, P, 3>(a, &tb, r),
                2 => block_group::<K, P, 2>(a, &tb, r),
                _ => block_group::<K, P, 1>(a, &tb, r),
            }
            r += n;
        }
    }

    /// `NO` output rows from index row `r0` on, for every activation row (`t ≤ MAX_T`).
    #[inline(always)]
    unsafe fn block_group<const K: u8, const P: usize, const NO: usize>(a: &Args, tb: &Tabs, r0: usize) {
        let zero = _mm256_setzero_si256();
        let o0 = r0 * nw(K);
        // Per output row, per chunk: the low and high 16-lane halves, and the bytes themselves
        // (for the second plane).
        let mut wbuf = [zero; 4 * 3 * PER_BLOCK];
        let mut lanes = [[_mm256_setzero_ps(); NO]; MAX_T];
        let mut c0 = 0usize;
        for b in 0..a.nblocks {
            let nc = (c0 + PER_BLOCK).min(a.nchunks) - c0;
            for i in 0..NO.div_ceil(nw(K)) {
                let row = a.row.add((r0 + i) * a.row_bytes);
                for c in 0..nc {
                    let w = weights_at::<K>(row, c0 + c, a.nchunks, tb);
                    for (v, &wv) in w.iter().enumerate().take(nw(K)) {
                        let o = i * nw(K) + v;
                        if o < NO {
                            let (lo, hi) = widen(wv);
                            wbuf[(o * PER_BLOCK + c) * 3] = lo;
                            wbuf[(o * PER_BLOCK + c) * 3 + 1] = hi;
                            wbuf[(o * PER_BLOCK + c) * 3 + 2] = wv;
                        }
                    }
                }
            }
            for (t, lt) in lanes.iter_mut().enumerate().take(a.t) {
                let mut acc = [[zero; 2]; NO];
                let xt = a.xq.add(t * a.cin_pad + c0 * CHUNK) as *const __m256i;
                let x2t = a.xq2.add(t * a.cin_pad + c0 * CHUNK) as *const __m256i;
                for c in 0..nc {
                    let x = xt.add(2 * c);
                    for (o, ao) in acc.iter_mut().enumerate() {
                        let w = wbuf.as_ptr().add((o * PER_BLOCK + c) * 3);
                        ao[0] = mac::<K>(ao[0], *w, *w.add(1), x);
                        if P == 2 {
                            ao[1] = mac2::<K>(ao[1], *w.add(2), x2t.add(c));
                        }
                    }
                }
                let blk = (t * a.nblocks + b) * 2;
                for (ao, l) in acc.iter().zip(lt.iter_mut()) {
                    for (p, &ap) in ao.iter().enumerate().take(P) {
                        *l = close_block(*l, ap, a.corr.add((blk + p) * LANES), a.xs.add(blk + p));
                    }
                }
            }
            c0 += nc;
        }
        for (t, lt) in lanes.iter().enumerate().take(a.t) {
            for (o, &l) in lt.iter().enumerate() {
                *a.out.add(t * a.out_t_stride + o0 + o) = reduce(l) * *a.scale.add(o0 + o);
            }
        }
    }
}

/// Prefill's f32 tiles on AVX-512: outer products over transposed activations (see
/// [`gemm_many_cols`]), a float path, equal to the reference within rounding, not bit for bit.
#[cfg(target_arch = "x86_64")]
mod avx512 {
    use std::arch::x86_64::*;

    /// Weight rows per tile of [`dot_cols`]: with four 16-row vectors of activations, 24
    /// accumulators (of 32 registers).
    pub(super) const NJ: usize = 6;

    /// `yt[j·tp + i] = Σₖ x[i, k] · w[j·cin + k]` for `j < n` and `i` below `t` rounded up to
    /// 16, with the activations transposed (`xt[k·tp + i]`, `tp ≥ t` a multiple of 64, zero
    /// from `t` to the next multiple of 16): outer products, each weight broadcast against 64
    /// activation rows at once, so a step of `k` is 4 vector loads and 6 broadcasts for 24
    /// FMAs, with no horizontal sums, and the sums leave as whole vectors. (Two vectors by 12
    /// weight rows take 14 loads per 24 FMAs, and the loads then set the pace; scattering the
    /// sums straight into the `t × cout` output one value at a time costs 10–15 % of prefill.)
    ///
    /// # Safety
    /// AVX-512 F and AVX2/FMA present; `xt` holds `cin·tp` values, `w` `n·cin`, `yt` `n·tp`.
    #[target_feature(enable = "avx2,fma,avx512f")]
    pub(super) unsafe fn dot_cols(
        xt: *const f32,
        tp: usize,
        t: usize,
        cin: usize,
        w: *const f32,
        n: usize,
        yt: *mut f32,
    ) {
        macro_rules! cols {
            ($v:literal, $i:expr, $j:expr, $nj:expr) => {{
                let (xi, wj, oij) = (xt.add($i), w.add($j * cin), yt.add($j * tp + $i));
                match $nj {
                    6 => col_tile::<$v, 6>(xi, tp, cin, wj, oij),
                    5 => col_tile::<$v, 5>(xi, tp, cin, wj, oij),
                    4 => col_tile::<$v, 4>(xi, tp, cin, wj, oij),
                    3 => col_tile::<$v, 3>(xi, tp, cin, wj, oij),
                    2 => col_tile::<$v, 2>(xi, tp, cin, wj, oij),
                    _ => col_tile::<$v, 1>(xi, tp, cin, wj, oij),
                }
            }};
        }
        let mut j = 0;
        while j < n {
            let nj = (n - j).min(NJ);
            let mut i = 0;
            while i < t {
                match (t - i).div_ceil(16) {
                    1 => cols!(1, i, j, nj),
                    2 => cols!(2, i, j, nj),
                    3 => cols!(3, i, j, nj),
                    _ => cols!(4, i, j, nj),
                }
                i += 64;
            }
            j += NJ;
        }
    }

    /// `16·V` activation rows against `N` weight rows.
    #[inline(always)]
    #[allow(clippy::needless_range_loop)] // indexing keeps the accumulators in registers
    unsafe fn col_tile<const V: usize, const N: usize>(
        xt: *const f32,
        tp: usize,
        cin: usize,
        w: *const f32,
        yt: *mut f32,
    ) {
        let mut acc = [[_mm512_setzero_ps(); N]; V];
        for k in 0..cin {
            let xv: [__m512; V] = std::array::from_fn(|v| _mm512_loadu_ps(xt.add(k * tp + 16 * v)));
            for j in 0..N {
                let b = _mm512_set1_ps(*w.add(j * cin + k));
                for v in 0..V {
                    acc[v][j] = _mm512_fmadd_ps(xv[v], b, acc[v][j]);
                }
            }
        }
        for v in 0..V {
            for j in 0..N {
                _mm512_storeu_ps(yt.add(j * tp + 16 * v), acc[v][j]);
            }
        }
    }
}
