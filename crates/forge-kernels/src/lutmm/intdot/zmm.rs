//! Decode (one activation row) on 512-bit vectors: each instruction covers two chunks, and
//! every product is a `vpdpbusd` of the weight bytes as they come out of the lookup.
//!
//! The two chunks `A = 2p` and `B = 2p + 1` of a pair sit in the four 128-bit lanes as
//! `[A 0–15 | B 0–15 | A 16–31 | B 16–31]` (by column). That order costs the lookup kinds
//! nothing: one 256-bit broadcast load gives `[A | B | A | B]` nibble bytes and a per-lane shift
//! picks low or high nibbles. [`QuantX`](super::QuantX) stores a decode row's activations in the
//! matching order when this path is on (`paired`), so every load is a plain one.
//!
//! The 16-bit plane goes in as two signed bytes, `q₁ = 256·h + l` (codes within ±32639 so that
//! `h` fits): `vpdpbusd` multiplies the unsigned weight bytes by `h` and by `l`, four
//! consecutive columns per 32-bit lane, and the lane sums combine as `256·Σh + Σl`, with no
//! widening of the weights to 16 bits at all (3 multiply-adds per 64 weights and output for
//! both planes, where widening takes 2 unpacks, 2 `vpdpwssd` and a `vpdpbusd`). Every sum is
//! exact in wrapping 32-bit arithmetic (the true lane sum of a block fits, see `XBLOCK`). In
//! whole pairs the 16-bit plane's lanes are therefore `vpdpbusd`'s, not `pmaddwd`'s
//! (`QuantX::lane1`); the scalar reference follows the same mapping and the same f32 steps, so
//! the kernels equal it bit for bit, and the 256-bit kernels' results within the activations'
//! two-plane bound.
//!
//! Lanes `0–3` and `4–7` of each chunk lie in 128-bit lanes `0, 2` (A) and `1, 3` (B); at the
//! end of a block the pair's halves are added into eight lanes and the block closes with the
//! 256-bit kernels' f32 step. A last chunk without a partner (odd chunk count) goes through the
//! 256-bit code, on the plain layout (and lanes) that `QuantX` keeps for it.

use super::avx2::{
    chunk_bytes, chunks_in_registers, close_block, decode_f32_from, nw, prefetch_l2, reduce, reduce8, six_shifts256,
    tabs, three_shifts256, Tabs, INT8X, LUT2S, LUT2X, LUT3S, LUT3X, LUT4S, LUT4X, PER_BLOCK, VEC16S, VEC16X, VEC64S,
    VEC64X,
};
use super::{Args, DecodeArgs, CHUNK, LANES};
use std::arch::x86_64::*;
use std::mem::MaybeUninit;

/// Pairs in flight per row, each with its own accumulators: a pair's multiply-adds go
/// straight into them (no separate add), and two chains of them keep the units busy.
const U: usize = 2;

/// The tables of a kind for 512-bit lookups, as signed weights or as unsigned `w + 128` (the
/// dot kernels; INT8 bytes are flipped likewise): lut4 and vec2x16 broadcast to the four
/// 128-bit lanes (a 64-entry `vpermb` table whose 16 entries repeat), vec2x64 one 64-entry
/// table per component (`vpermb` reads six index bits), lut2's four-pair groups the entries
/// repeated every 4, 16 and 64 bytes ([`quad_pair`]), lut3's entries 0–7 repeated and each
/// repeated eight times ([`group_pair`]).
struct Tabs512 {
    t: [__m512i; 3],
    flip: __m512i,
}

#[inline(always)]
unsafe fn tabs512(k: u8, tables: *const i8, unsigned: bool) -> Tabs512 {
    let flip = if unsigned { _mm512_set1_epi8(-128) } else { _mm512_setzero_si512() };
    let z = _mm512_setzero_si512();
    let b16 = |i: usize| {
        _mm512_xor_si512(_mm512_broadcast_i32x4(_mm_loadu_si128(tables.add(16 * i) as *const __m128i)), flip)
    };
    let t = match k {
        LUT4X | LUT4S | LUT2X => [b16(0), z, z],
        VEC16X | VEC16S | LUT3X => [b16(0), b16(1), z],
        // Entry `i & 3` (lut2's table repeats every four), `(i >> 2) & 3` and `(i >> 4) & 3`.
        LUT2S => {
            let t = b16(0);
            [t, _mm512_permutexvar_epi8(quad_ctrl::<2>(), t), _mm512_permutexvar_epi8(quad_ctrl::<4>(), t)]
        }
        // Entries 0–7 repeated (bytes 4–7 of every eight from the table of entries 4–7), and
        // each entry eight times: a group's six-bit slot holds two pairs (`group_pair`).
        LUT3S => {
            let t = _mm512_mask_blend_epi8(0xF0F0_F0F0_F0F0_F0F0, b16(0), b16(1));
            [t, _mm512_permutexvar_epi8(octet_ctrl(), t), z]
        }
        VEC64X | VEC64S => {
            let t64 = |v: usize| _mm512_xor_si512(_mm512_loadu_si512(tables.add(64 * v) as *const _), flip);
            [t64(0), t64(1), z]
        }
        _ => [z, z, z],
    };
    Tabs512 { t, flip }
}

/// A `vpermb` control whose byte `i` is `(i >> S) & 3`: lut2's table of four entries
/// repeated every `4 << S` bytes, from the one repeated every four.
#[inline(always)]
unsafe fn quad_ctrl<const S: u32>() -> __m512i {
    _mm512_and_si512(_mm512_srli_epi16::<S>(_mm512_loadu_si512(IOTA.as_ptr() as *const _)), _mm512_set1_epi8(3))
}

/// A `vpermb` control whose byte `i` is `i >> 3`: each of the first eight entries eight times.
#[inline(always)]
unsafe fn octet_ctrl() -> __m512i {
    _mm512_srli_epi16::<3>(_mm512_and_si512(_mm512_loadu_si512(IOTA.as_ptr() as *const _), _mm512_set1_epi8(0x38)))
}

/// Bytes 0, 1, …, 63.
const IOTA: [u8; 64] = {
    let mut c = [0u8; 64];
    let mut i = 0;
    while i < 64 {
        c[i] = i as u8;
        i += 1;
    }
    c
};

/// Chunk pairs per group of a kind's AVX-512 layout (`super::group_field`), 0 without one.
const fn group_pairs(k: u8) -> usize {
    super::avx2::group_chunks(k) / 2
}

/// The most pairs a group holds (lut3's).
const MAX_GROUP: usize = 8;

/// Pair `u` of lut2's group whose 64 bytes are `v`, as 64 unsigned weights in pair order:
/// pairs 0–2 by tables that read their own two bits of each byte, pair 3 by the first table
/// after a shift: one instruction a pair (two for pair 3) where a plain pair takes three (a
/// `vpermb` spread, a shift and a lookup), about 1.2× as fast in L2 and from memory alike.
#[inline(always)]
unsafe fn quad_pair(v: __m512i, u: usize, tb: &Tabs512) -> __m512i {
    match u {
        0 => _mm512_permutexvar_epi8(v, tb.t[0]),
        1 => _mm512_permutexvar_epi8(v, tb.t[1]),
        2 => _mm512_permutexvar_epi8(v, tb.t[2]),
        _ => _mm512_permutexvar_epi8(_mm512_srli_epi16::<6>(v), tb.t[0]),
    }
}

/// The six-bit slots of the group at `p`: lut2's one plane; lut3's and vec2x64's three planes
/// and the fourth slot gathered from their top bits (`avx2::top_slot256`'s steps).
#[inline(always)]
unsafe fn group_slots<const K: u8>(p: *const u8) -> [__m512i; 4] {
    let z = _mm512_setzero_si512();
    let plane = |i: usize| _mm512_loadu_si512(p.add(64 * i) as *const _);
    if K == LUT2S || K == LUT4S || K == VEC16S {
        return [plane(0), z, z, z];
    }
    let (p0, p1, p2) = (plane(0), plane(1), plane(2));
    let (a, b, c) = (_mm512_srli_epi16::<6>(p0), _mm512_srli_epi16::<4>(p1), _mm512_srli_epi16::<2>(p2));
    // `C ? A : B`, bitwise.
    let ab = _mm512_ternarylogic_epi32::<0xE4>(a, b, _mm512_set1_epi8(0x03));
    [p0, p1, p2, _mm512_ternarylogic_epi32::<0xE4>(ab, c, _mm512_set1_epi8(0x0F))]
}

/// Pair `u` of a group from its slots, as `nw(K)` vectors of 64 unsigned weights in pair
/// order: one `vpermb` per output (lut2's pair 3 after a shift).
#[inline(always)]
unsafe fn group_pair<const K: u8>(s: &[__m512i; 4], u: usize, tb: &Tabs512) -> [__m512i; 2] {
    let z = _mm512_setzero_si512();
    match K {
        LUT2S => [quad_pair(s[0], u, tb), z],
        // Pair 0 in the low nibbles, pair 1 in the high (`vpermb` reads six bits: the 16-entry
        // tables repeat in every 128-bit lane, so the two above the nibble only pick a copy).
        LUT4S | VEC16S => {
            let idx = if u == 0 { s[0] } else { _mm512_srli_epi16::<4>(s[0]) };
            let w1 = if K == VEC16S { _mm512_permutexvar_epi8(idx, tb.t[1]) } else { z };
            [_mm512_permutexvar_epi8(idx, tb.t[0]), w1]
        }
        // Pair `2i` in bits 0–2 of slot `i`, pair `2i + 1` in bits 3–5.
        LUT3S => [_mm512_permutexvar_epi8(s[u / 2], tb.t[u % 2]), z],
        _ => [_mm512_permutexvar_epi8(s[u], tb.t[0]), _mm512_permutexvar_epi8(s[u], tb.t[1])],
    }
}

/// Pairs of the block from chunk `c` (`n` chunks) that lie in whole groups of the kind's
/// AVX-512 layout, a multiple of [`group_pairs`] (none for the kinds without one).
#[inline(always)]
fn grouped_pairs<const K: u8>(nchunks: usize, c: usize, n: usize) -> usize {
    super::avx2::grouped_chunks(K, nchunks).saturating_sub(c).min(n) / 2
}

/// The pair of chunks at `p` (chunk `A` at `p`, `B` one chunk on) as `nw(K)` vectors of 64
/// unsigned weights in pair order.
#[inline(always)]
unsafe fn weights2<const K: u8>(p: *const u8, tb: &Tabs512) -> [__m512i; 2] {
    // A pair after the row's last whole group: the plain layout (lut3 and vec2x64: their
    // stream layouts, below).
    match K {
        LUT2S => return weights2::<LUT2X>(p, tb),
        LUT4S => return weights2::<LUT4X>(p, tb),
        VEC16S => return weights2::<VEC16X>(p, tb),
        _ => {}
    }
    let z = _mm512_setzero_si512();
    // Low nibbles in lanes 0 and 1, high nibbles in lanes 2 and 3.
    let nib_shift = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 4, 4, 4, 4, 4, 4, 4, 4);
    match K {
        LUT4X | VEC16X => {
            // [A | B | A | B]: the 32 index bytes of the pair, one broadcast load.
            let v = _mm512_broadcast_i64x4(_mm256_loadu_si256(p as *const __m256i));
            // No mask: bits 4–5 of each byte carry the other nibble, but `vpermb` reads bits
            // 0–5 and the 16-entry table repeats in every 128-bit lane, so they only pick
            // which copy (one instruction fewer than `vpshufb`, which needs bit 7 clear).
            let idx = _mm512_srlv_epi32(v, nib_shift);
            let w1 = if K == VEC16X { _mm512_permutexvar_epi8(idx, tb.t[1]) } else { z };
            [_mm512_permutexvar_epi8(idx, tb.t[0]), w1]
        }
        LUT3S => {
            // Three-bit fields, A at 0 and B at 12 in one 32-byte load (8 bytes past B: the
            // next pair or `SLACK`): word j of the pair order takes the bytes of its eight
            // columns (columns 8q..8q + 8 of a chunk start at byte 3q), byte i of each word the
            // eight bits from bit 3i, and the eight-entry table repeated is read by its low
            // three (`vpermb` reads six bits).
            let v = _mm512_castsi256_si512(_mm256_loadu_si256(p as *const __m256i));
            let shifts = _mm512_broadcast_i64x4(three_shifts256());
            let idx = _mm512_multishift_epi64_epi8(shifts, _mm512_permutexvar_epi8(three_spread(), v));
            [_mm512_permutexvar_epi8(idx, tb.t[0]), z]
        }
        LUT2X | LUT3X => {
            // One 32-byte load holds both chunks (lut2: A at 0, B at 8; lut3: A at 0, B at
            // 12, each eight bytes of two-bit fields and then the word of bit 2; the bytes past
            // B are the next pair or `SLACK`). One `vpermb` gives chunk A's field bytes to the
            // 64-bit words of lanes 0 and 2 and B's to lanes 1 and 3, and shifting word `j`
            // right by `2·(j % 2)` (lanes 0, 1: columns 0–15) or `4 + 2·(j % 2)` (lanes 2, 3)
            // brings each column's field to bits 0–1 of its byte; `vpermb` reads no more of it
            // (the tables repeat every four entries). This runs about 1.2× as fast as two
            // 8-byte broadcasts merged, in L2 and from memory alike.
            let v = _mm512_castsi256_si512(_mm256_loadu_si256(p as *const __m256i));
            let shifts = _mm512_setr_epi64(0, 2, 0, 2, 4, 6, 4, 6);
            let idx = _mm512_srlv_epi64(_mm512_permutexvar_epi8(field_spread::<K>(), v), shifts);
            let w0 = _mm512_permutexvar_epi8(idx, tb.t[0]);
            if K == LUT2X {
                return [w0, z];
            }
            // lut3: the 32-bit words of lane `L` take chunk A's (`L` even) or B's word of bit 2,
            // and word `d` of the lane (columns 4d..4d + 4 of its half) shifted left by `d`
            // puts bit 2 of those indices at the tops of its bytes (`hi_bit`); where it is set,
            // entries 4–7.
            let h = _mm512_permutexvar_epi8(bit2_spread(), v);
            let counts = _mm512_setr_epi32(0, 1, 2, 3, 0, 1, 2, 3, 4, 5, 6, 7, 4, 5, 6, 7);
            let k = _mm512_movepi8_mask(_mm512_sllv_epi32(h, counts));
            [_mm512_mask_permutexvar_epi8(w0, k, idx, tb.t[1]), z]
        }
        VEC64S => {
            // One 64-byte load holds both chunks' six-bit streams (A at 0, B at 24; 16 bytes
            // past B: the next pair or `SLACK`). Word j of the pair order takes the six bytes
            // of its eight columns, and byte i of each word the eight bits from bit 6i
            // (`vpermb` reads the low six).
            let v = _mm512_loadu_si512(p as *const _);
            let shifts = _mm512_broadcast_i64x4(six_shifts256());
            let idx = _mm512_multishift_epi64_epi8(shifts, _mm512_permutexvar_epi8(six_spread(), v));
            [_mm512_permutexvar_epi8(idx, tb.t[0]), _mm512_permutexvar_epi8(idx, tb.t[1])]
        }
        VEC64X => {
            // A's 16 nibble bytes at p, B's 24 bytes on: [A | B | A | B] by a merging broadcast.
            let a = _mm512_broadcast_i32x4(_mm_loadu_si128(p as *const __m128i));
            let v = _mm512_mask_broadcast_i32x4(a, 0xF0F0, _mm_loadu_si128(p.add(24) as *const __m128i));
            // The top two index bits: 8 bytes per chunk, 64-bit word `j` of the vector covering
            // columns `8q..8q + 8` of A or B (q = 0, 1, 0, 1, 2, 3, 2, 3), shifted by `2q` to
            // bring bits 5 and 4 to the top of each byte, then down to bits 5 and 4.
            // One 32-byte load from p + 16 holds A's high bits (word 0) and B's (word 3); words
            // 0 and 3 go to the words covering A and B.
            let hab = _mm512_castsi256_si512(_mm256_loadu_si256(p.add(16) as *const __m256i));
            let h = _mm512_permutexvar_epi64(_mm512_setr_epi64(0, 0, 3, 3, 0, 0, 3, 3), hab);
            // Byte i of word j takes the 8 bits from bit 8i + 2 − 2q on (rotating; `q` as
            // above), which puts bits 5 and 4 of column 8q + i's index at its bits 5 and 4.
            let b54 = _mm512_multishift_epi64_epi8(multishift_ctrl(), h);
            // Low four bits from the nibble, the rest from b54 (`vpermb` reads bits 0–5 only).
            let idx = _mm512_ternarylogic_epi32::<0xD8>(b54, _mm512_srlv_epi32(v, nib_shift), _mm512_set1_epi8(15));
            [_mm512_permutexvar_epi8(idx, tb.t[0]), _mm512_permutexvar_epi8(idx, tb.t[1])]
        }
        _ => {
            // INT8: [A 0–15 | A 16–31 | B 0–15 | B 16–31] in memory; lanes 1 and 2 swap.
            let v = _mm512_loadu_si512(p as *const _);
            [_mm512_xor_si512(_mm512_shuffle_i64x2::<0xD8>(v, v), tb.flip), z]
        }
    }
}

/// A `vpermb` control giving 64-bit word `j` the eight bytes from `start[j]` on.
const fn word_spread(start: [usize; 8]) -> [u8; 64] {
    let mut c = [0u8; 64];
    let mut k = 0;
    while k < 64 {
        c[k] = (start[k / 8] + k % 8) as u8;
        k += 1;
    }
    c
}

/// `vpermb` control for [`weights2`]'s lut2 and lut3 pairs: 64-bit words 0, 1, 4, 5 (lanes 0
/// and 2) get chunk A's eight field bytes, words 2, 3, 6, 7 chunk B's (`chunk_bytes(K)` on).
#[inline(always)]
unsafe fn field_spread<const K: u8>() -> __m512i {
    const fn spread(b: usize) -> [u8; 64] {
        word_spread([0, 0, b, b, 0, 0, b, b])
    }
    const LUT2: [u8; 64] = spread(chunk_bytes(LUT2X));
    const LUT3: [u8; 64] = spread(chunk_bytes(LUT3X));
    _mm512_loadu_si512(if K == LUT2X { LUT2.as_ptr() } else { LUT3.as_ptr() } as *const _)
}

/// `vpermb` control for lut3's words of bit 2: every 32-bit word of lanes 0 and 2 gets chunk
/// A's (bytes 8–11), of lanes 1 and 3 chunk B's (bytes 20–23).
#[inline(always)]
unsafe fn bit2_spread() -> __m512i {
    const C: [u8; 64] = {
        let mut c = [0u8; 64];
        let mut k = 0;
        while k < 64 {
            c[k] = (if (k / 16) % 2 == 1 { 20 } else { 8 } + k % 4) as u8;
            k += 1;
        }
        c
    };
    _mm512_loadu_si512(C.as_ptr() as *const _)
}

/// `vpermb` control for [`weights2`]'s three-bit lut3 pairs: word `j` of the pair order
/// (`[A 0–15 | B 0–15 | A 16–31 | B 16–31]`, eight columns a word) gets eight bytes from the
/// first of its columns: columns `8q..8q + 8` of a chunk start at byte `3q`, chunk B at byte 12.
#[inline(always)]
unsafe fn three_spread() -> __m512i {
    const C: [u8; 64] = word_spread([0, 3, 12, 15, 6, 9, 18, 21]);
    _mm512_loadu_si512(C.as_ptr() as *const _)
}

/// `vpermb` control for [`weights2`]'s six-bit pairs: word `j` of the pair order
/// (`[A 0–15 | B 0–15 | A 16–31 | B 16–31]`, eight columns a word) gets the bytes of its columns:
/// columns `8q..8q + 8` of a chunk start at byte `6q`, chunk B at byte 24.
#[inline(always)]
unsafe fn six_spread() -> __m512i {
    const C: [u8; 64] = word_spread([0, 6, 24, 30, 12, 18, 36, 42]);
    _mm512_loadu_si512(C.as_ptr() as *const _)
}

/// The bit offsets of [`weights2`]'s `vpmultishiftqb` for vec2x64's top index bits: byte `i`
/// of word `j` reads from bit `8i + 2 − 2q` (mod 64), `q = 0, 1, 0, 1, 2, 3, 2, 3` by word.
#[inline(always)]
unsafe fn multishift_ctrl() -> __m512i {
    const CTRL: [u8; 64] = {
        let q = [0usize, 1, 0, 1, 2, 3, 2, 3];
        let mut c = [0u8; 64];
        let mut k = 0;
        while k < 64 {
            c[k] = ((8 * (k % 8) + 64 + 2 - 2 * q[k / 8]) % 64) as u8;
            k += 1;
        }
        c
    };
    _mm512_loadu_si512(CTRL.as_ptr() as *const _)
}

/// Both planes of one output for a pair, all through `vpdpbusd` (the unsigned weight bytes
/// times signed bytes, four consecutive columns per lane): `acc[0] += Σ w·h` and
/// `acc[1] += Σ w·l` for the 16-bit plane's bytes `q₁ = 256·h + l` at `xhl` (64 bytes each),
/// `acc[2] += Σ w·q₂` at `x2`. Three instructions per 64 weights where widening to 16 bits
/// takes five.
#[inline(always)]
unsafe fn mac_pair<const P: usize>(acc: &mut [__m512i; 3], w: __m512i, xhl: *const i8, x2: *const __m512i) {
    acc[0] = _mm512_dpbusd_epi32(acc[0], w, _mm512_loadu_si512(xhl as *const _));
    acc[1] = _mm512_dpbusd_epi32(acc[1], w, _mm512_loadu_si512(xhl.add(64) as *const _));
    if P == 2 {
        acc[2] = _mm512_dpbusd_epi32(acc[2], w, _mm512_loadu_si512(x2 as *const _));
    }
}

/// Prefetches the weights `PREFETCH` bytes past the `span` bytes at `p` into L2, one request
/// per cache line: a request per pair of chunks would ask for lut4's and vec2x16's lines
/// twice, and the duplicates cost vec2x16 about a tenth of its speed from memory.
#[inline(always)]
unsafe fn prefetch_lines(p: *const u8, span: usize) {
    let mut o = 0;
    while o < span {
        prefetch_l2(p.wrapping_add(o));
        o += 64;
    }
}

/// [`prefetch_lines`] `ahead` bytes past `p` instead of `PREFETCH`.
#[inline(always)]
unsafe fn prefetch_lines_ahead(p: *const u8, span: usize, ahead: usize) {
    let mut o = 0;
    while o < span {
        _mm_prefetch::<_MM_HINT_T1>(p.wrapping_add(ahead + o) as *const i8);
        o += 64;
    }
}

/// Pair `u`'s share of the requests for a group's lines (at `offset` in each of the `R` rows,
/// `ahead` bytes on): line `k` of the `R · lines` goes with pair `k mod pairs`, so they go out
/// one or two between the pairs' multiply-adds instead of all at the group's start. On the
/// Xeon a software request holds one of the core's few line-fill buffers until memory
/// answers, and a burst of them keeps the loads that would hit L2 waiting for one: spread out,
/// the requests let vec2x64 and lut3 read up to 1.1× as fast from memory. The same requests
/// all in one place per group (one linear stream over the rows, which lie together) read
/// slower still.
///
/// With `near` (tasks that come from memory, [`STREAMED`]) each line is also asked into L1
/// [`NEAR`] bytes ahead, from L2 where the first request has brought it by then, so that the
/// loads do not wait for a fill buffer themselves (worth a few percent from memory, lut2
/// most); in L2, where the lines are at hand, the extra requests cost 2–7 %, so tasks in
/// cache go without them.
#[inline(always)]
unsafe fn prefetch_spread<const K: u8, const R: usize>(
    rows: &[*const u8; R],
    offset: usize,
    u: usize,
    ahead: usize,
    near: bool,
) {
    let per_row = 2 * group_pairs(K) * chunk_bytes(K) / 64;
    let mut k = u;
    while k < R * per_row {
        let p = rows[k / per_row].wrapping_add(offset + (k % per_row) * 64);
        _mm_prefetch::<_MM_HINT_T1>(p.wrapping_add(ahead) as *const i8);
        if near {
            _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(NEAR) as *const i8);
        }
        k += group_pairs(K);
    }
}

/// How far ahead `R` index rows read together ask for their lines: the same place in the rows
/// whole groups later, about `PREFETCH` on. A stream's own `PREFETCH` bytes ahead lands in a
/// row that another stream of the group is reading already once rows are longer than
/// `PREFETCH / R`, and leaves the following group's last rows unasked for. Taken for groups of
/// long rows where four rows go together (lut2, lut3, lut4) and for INT8: on long rows read
/// from memory lut4 reads up to 1.3× as fast with it, lut3 and INT8 somewhat less (lut2, bound
/// by its multiply-adds, gains nothing); on shorter rows, where both distances land in the
/// same rows, it makes no difference. The two-row vector kinds read about 0.9× as fast with
/// it, so they keep their own `PREFETCH` ahead.
#[inline(always)]
fn group_ahead(row_bytes: usize, rows: usize) -> usize {
    let group = (row_bytes * rows).max(1);
    group * ((super::avx2::PREFETCH + group / 2) / group).max(1)
}

/// A pair's lanes `[A 0–3 | B 0–3 | A 4–7 | B 4–7]` as the 256-bit kernels' eight lanes of the
/// two chunks together.
#[inline(always)]
unsafe fn fold(acc: __m512i) -> __m256i {
    let (lo, hi) = (_mm512_castsi512_si256(acc), _mm512_extracti64x4_epi64::<1>(acc));
    _mm256_add_epi32(_mm256_permute2x128_si256::<0x20>(lo, hi), _mm256_permute2x128_si256::<0x31>(lo, hi))
}

/// A pair's `h, l, q₂` sums as the two planes' eight lanes: `256·Σ w·h + Σ w·l` (wrapping
/// adds, exact once the unsigned offset is taken out) and `Σ w·q₂`, each folded.
#[inline(always)]
unsafe fn planes(acc: [__m512i; 3]) -> [__m256i; 2] {
    [fold(_mm512_add_epi32(_mm512_slli_epi32::<8>(acc[0]), acc[1])), fold(acc[2])]
}

/// The f32 lanes of index row `r` (one activation row, paired layout), per output (not the
/// kinds with groups: [`rows_lanes`] reads those).
#[inline(always)]
unsafe fn row_lanes<const K: u8, const P: usize>(
    a: &Args,
    tb: &Tabs512,
    tb256: &super::avx2::Tabs,
    r: usize,
) -> [__m256; 2] {
    debug_assert!(group_pairs(K) == 0, "groups go through rows_lanes");
    let cb = chunk_bytes(K);
    let z = _mm512_setzero_si512();
    let mut lanes = [_mm256_setzero_ps(); 2];
    let mut c = 0usize;
    for b in 0..a.nblocks {
        let n = PER_BLOCK.min(a.nchunks - c);
        let mut acc = [[[z; 3]; 2]; U];
        let row = a.row.add(r * a.row_bytes + c * cb);
        // Pair `i` of this block: its `h, l` bytes and its second-plane codes.
        let xhl = a.xhl.add(c / 2 * 4 * CHUNK);
        let x2 = a.xq2.add(c * CHUNK) as *const __m512i;
        let np = n / 2;
        let mut i = 0;
        while i + U <= np {
            prefetch_lines(row.add(2 * i * cb), 2 * U * cb);
            for (u, au) in acc.iter_mut().enumerate() {
                let p = row.add(2 * (i + u) * cb);
                let w = weights2::<K>(p, tb);
                for (v, &wv) in w.iter().enumerate().take(nw(K)) {
                    mac_pair::<P>(&mut au[v], wv, xhl.add((i + u) * 4 * CHUNK), x2.add(i + u));
                }
            }
            i += U;
        }
        while i < np {
            let p = row.add(2 * i * cb);
            prefetch_l2(p);
            let w = weights2::<K>(p, tb);
            for (v, &wv) in w.iter().enumerate().take(nw(K)) {
                mac_pair::<P>(&mut acc[0][v], wv, xhl.add(i * 4 * CHUNK), x2.add(i));
            }
            i += 1;
        }
        let mut acc256 = [[[_mm256_setzero_si256(); 2]; 2]; 1];
        for v in 0..nw(K) {
            let sum = |p: usize| acc[1..].iter().fold(acc[0][v][p], |s, au| _mm512_add_epi32(s, au[v][p]));
            acc256[0][v] = planes([sum(0), sum(1), sum(2)]);
        }
        if n % 2 == 1 {
            // The last chunk of the row, unpaired, in the plain layout.
            chunks_in_registers::<K, P, 1>(a, tb256, r, 0, c + n - 1, 1, &mut acc256);
        }
        let blk = b * 2;
        for (l, av) in lanes.iter_mut().zip(acc256[0]).take(nw(K)) {
            for (p, &ap) in av.iter().enumerate().take(P) {
                *l = close_block(*l, ap, a.corr.add((blk + p) * LANES), a.xs.add(blk + p));
            }
        }
        c += n;
    }
    lanes
}

/// Index rows `r, r + stride, …, r + (R − 1)·stride` together (`stride` 1: side by side; more:
/// one row from each of `R` streams, [`decode_rows`]) over activation `blocks`, their lanes
/// carried on from `lanes`, each pair's activations loaded once for all rows: over all blocks
/// from zero lanes the same sums as `R` [`row_lanes`] (the integer sums are exact in any order,
/// and the f32 steps are the same, block after block, however the blocks are split). Two rows,
/// halving the activation loads and reading two weight streams at once, make decode up to
/// 1.2× as fast as one, from memory (where wide rows' activations outgrow L1) and on
/// SmolLM2's shapes in cache alike. Four rows pay only where a kind's groups need few
/// instructions per weight (lut2, lut3 and lut4 in their grouped layouts, see
/// [`decode_rows`]); INT8 gains nothing from them.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn rows_lanes<const K: u8, const P: usize, const R: usize>(
    a: &Args,
    tb: &Tabs512,
    tb256: &super::avx2::Tabs,
    r: usize,
    stride: usize,
    near: bool,
    blocks: std::ops::Range<usize>,
    mut lanes: [[__m256; 2]; R],
) -> [[__m256; 2]; R] {
    let cb = chunk_bytes(K);
    let z = _mm512_setzero_si512();
    let mut c = blocks.start * PER_BLOCK;
    // Otherwise each stream `PREFETCH` ahead of itself (where a group's rows are short the two
    // land in the same rows).
    let long = a.row_bytes * R > super::avx2::PREFETCH / 2;
    let ahead = if stride > 1 {
        if a.row_bytes > super::avx2::PREFETCH / 2 {
            group_ahead(a.row_bytes, 1)
        } else {
            super::avx2::PREFETCH
        }
    } else if (R == 4 || K == INT8X) && long {
        group_ahead(a.row_bytes, R)
    } else {
        super::avx2::PREFETCH
    };
    for b in blocks {
        let n = PER_BLOCK.min(a.nchunks - c);
        let mut acc = [[[z; 3]; 2]; R];
        let rows: [*const u8; R] = std::array::from_fn(|i| a.row.add((r + i * stride) * a.row_bytes + c * cb));
        let xhl = a.xhl.add(c / 2 * 4 * CHUNK);
        let x2 = a.xq2.add(c * CHUNK) as *const __m512i;
        let nq = grouped_pairs::<K>(a.nchunks, c, n);
        // Whole groups pair by pair, each pair's activations loaded once for the rows.
        for i in (0..nq).step_by(group_pairs(K).max(1)) {
            let mut v = [[z; 4]; R];
            for (vr, row) in v.iter_mut().zip(rows) {
                *vr = group_slots::<K>(row.add(2 * i * cb));
            }
            for u in 0..group_pairs(K) {
                prefetch_spread::<K, R>(&rows, 2 * i * cb, u, ahead, near);
                let xp = xhl.add((i + u) * 4 * CHUNK);
                let (h, l) = (_mm512_loadu_si512(xp as *const _), _mm512_loadu_si512(xp.add(64) as *const _));
                let x2v = if P == 2 { _mm512_loadu_si512(x2.add(i + u) as *const _) } else { z };
                for (ar, vr) in acc.iter_mut().zip(&v) {
                    for (av, &w) in ar.iter_mut().zip(&group_pair::<K>(vr, u, tb)).take(nw(K)) {
                        av[0] = _mm512_dpbusd_epi32(av[0], w, h);
                        av[1] = _mm512_dpbusd_epi32(av[1], w, l);
                        if P == 2 {
                            av[2] = _mm512_dpbusd_epi32(av[2], w, x2v);
                        }
                    }
                }
            }
        }
        for i in nq..n / 2 {
            for (ar, row) in acc.iter_mut().zip(rows) {
                let p = row.add(2 * i * cb);
                if i % 2 == 0 {
                    // This pair and the next, one request per line.
                    prefetch_lines_ahead(p, 4 * cb, ahead);
                }
                let w = weights2::<K>(p, tb);
                for (v, &wv) in w.iter().enumerate().take(nw(K)) {
                    mac_pair::<P>(&mut ar[v], wv, xhl.add(i * 4 * CHUNK), x2.add(i));
                }
            }
        }
        for (rr, (ar, lr)) in acc.iter().zip(lanes.iter_mut()).enumerate() {
            let mut acc256 = [[[_mm256_setzero_si256(); 2]; 2]; 1];
            for v in 0..nw(K) {
                acc256[0][v] = planes(ar[v]);
            }
            if n % 2 == 1 {
                // The last chunk of the row, unpaired, in the plain layout.
                chunks_in_registers::<K, P, 1>(a, tb256, r + rr * stride, 0, c + n - 1, 1, &mut acc256);
            }
            let blk = b * 2;
            for (l, av) in lr.iter_mut().zip(acc256[0]).take(nw(K)) {
                for (p, &ap) in av.iter().enumerate().take(P) {
                    *l = close_block(*l, ap, a.corr.add((blk + p) * LANES), a.xs.add(blk + p));
                }
            }
        }
        c += n;
    }
    lanes
}

/// Bytes of index rows in one task from which [`decode_rows`] takes them to come from memory
/// (a Zen 4 core's L2; the Xeon's holds 2 MiB).
const STREAMED: usize = 1 << 20;

/// How far ahead [`prefetch_spread`] asks for lines into L1 in tasks that come from memory.
const NEAR: usize = 2048;

/// One activation row in the paired layout: eight outputs reduced and stored together, as the
/// 256-bit `decode_rows`.
///
/// # Safety
/// The CPU must have AVX-512 F/BW/VL/VBMI/VNNI, `a` describe valid buffers (see
/// `DotMatrix::rows`) with `a.t == 1` and the activations in the paired layout.
#[target_feature(enable = "avx2,fma,avx512f,avx512bw,avx512vl,avx512vbmi,avx512vnni")]
pub(super) unsafe fn decode_rows<const K: u8, const P: usize>(a: &Args) {
    let tb = tabs512(K, a.tables, true);
    let tb256 = tabs(K, a.tables, true);
    let per = 8 / nw(K);
    let streamed = a.n_rows * a.row_bytes >= STREAMED;
    // lut3's four rows hold sixteen six-bit slots, more than the registers left beside their
    // twelve accumulators, and yet read 1.05–1.15× as fast as two: in cache, on long rows from
    // memory and, as four streams, on short ones from memory.
    let four = matches!(K, LUT2S | LUT3S | LUT4S);
    let zero = [_mm256_setzero_ps(); 2];
    let mut r = 0;
    // Eight outputs from the lanes of the `per` index rows from `r0` on.
    let store = |lanes: &[[__m256; 2]], r0: usize| {
        let mut v = [_mm256_setzero_ps(); 8];
        for (i, l) in lanes.iter().enumerate().take(per) {
            v[i * nw(K)] = l[0];
            if nw(K) == 2 {
                v[i * 2 + 1] = l[1];
            }
        }
        let o0 = r0 * nw(K);
        _mm256_storeu_ps(a.out.add(o0), _mm256_mul_ps(reduce8(&v), _mm256_loadu_ps(a.scale.add(o0))));
    };
    if streamed {
        // A large task's rows as four streams: the rows read together come from four equal
        // parts of the task, each part read front to back; the two-row kinds take two pairs of
        // streams block by block in turn. From memory the rows of a group side by side read as
        // one stream, and a core needs several far apart to draw the bandwidth (`forge bench`'s
        // probe: on the Xeon one stream a core draws about two thirds of what four do). So the
        // streams read up to 1.2× as fast from memory as the rows side by side (lut2 most), and
        // faster in L3 too (SmolLM2's head). The pairs go block by block because a
        // whole row each at a time is slower; eight streams gain nothing over four.
        let part = a.n_rows / (per * 4) * per;
        for j in (0..part).step_by(per) {
            let mut lanes = [[[_mm256_setzero_ps(); 2]; 8]; 4];
            for i in 0..per {
                if four {
                    let l = rows_lanes::<K, P, 4>(a, &tb, &tb256, j + i, part, streamed, 0..a.nblocks, [zero; 4]);
                    for (ls, l) in lanes.iter_mut().zip(l) {
                        ls[i] = l;
                    }
                } else if a.nblocks == 1 {
                    // One block: the same reads, a pair after the other in lighter code (a few
                    // percent faster in L3 on SmolLM2's head).
                    let l0 = rows_lanes::<K, P, 2>(a, &tb, &tb256, j + i, part, streamed, 0..a.nblocks, [zero; 2]);
                    let l1 = rows_lanes::<K, P, 2>(
                        a,
                        &tb,
                        &tb256,
                        2 * part + j + i,
                        part,
                        streamed,
                        0..a.nblocks,
                        [zero; 2],
                    );
                    [lanes[0][i], lanes[1][i]] = l0;
                    [lanes[2][i], lanes[3][i]] = l1;
                } else {
                    let (mut l0, mut l1) = ([zero; 2], [zero; 2]);
                    for b in 0..a.nblocks {
                        l0 = rows_lanes::<K, P, 2>(a, &tb, &tb256, j + i, part, streamed, b..b + 1, l0);
                        l1 = rows_lanes::<K, P, 2>(a, &tb, &tb256, 2 * part + j + i, part, streamed, b..b + 1, l1);
                    }
                    [lanes[0][i], lanes[1][i]] = l0;
                    [lanes[2][i], lanes[3][i]] = l1;
                }
            }
            for (s, l) in lanes.iter().enumerate() {
                store(l, s * part + j);
            }
        }
        r = 4 * part;
    }
    while r + per <= a.n_rows {
        let mut lanes = [[_mm256_setzero_ps(); 2]; 8];
        if four {
            // lut2's, lut3's and lut4's groups take four rows at a time (the vector kinds' two,
            // whose accumulators would not fit): in cache about 1.1× as fast as two rows, and
            // no slower from memory.
            for i in (0..per).step_by(4) {
                lanes[i..i + 4].copy_from_slice(&rows_lanes::<K, P, 4>(
                    a,
                    &tb,
                    &tb256,
                    r + i,
                    1,
                    streamed,
                    0..a.nblocks,
                    [zero; 4],
                ));
            }
        } else {
            for i in (0..per).step_by(2) {
                [lanes[i], lanes[i + 1]] =
                    rows_lanes::<K, P, 2>(a, &tb, &tb256, r + i, 1, streamed, 0..a.nblocks, [zero; 2]);
            }
        }
        store(&lanes, r);
        r += per;
    }
    while r < a.n_rows {
        // Groups go through `rows_lanes` alone (`row_lanes` reads pairs).
        let l = if group_pairs(K) > 0 {
            rows_lanes::<K, P, 1>(a, &tb, &tb256, r, 1, streamed, 0..a.nblocks, [zero; 1])[0]
        } else {
            row_lanes::<K, P>(a, &tb, &tb256, r)
        };
        let o0 = r * nw(K);
        for (v, &lv) in l.iter().enumerate().take(nw(K)) {
            *a.out.add(o0 + v) = reduce(lv) * *a.scale.add(o0 + v);
        }
        r += 1;
    }
}

/// Which kernel a kind runs in the paired layout.
///
/// # Safety
/// As [`decode_rows`].
pub(super) unsafe fn rows(kind: super::Kind, a: &Args) {
    use super::Kind;
    if a.t > MAX_ROWS {
        for t0 in (0..a.t).step_by(MAX_ROWS) {
            rows(kind, &a.rows_from(t0, MAX_ROWS.min(a.t - t0)));
        }
        return;
    }
    macro_rules! by_kind {
        ($f:ident) => {
            match (kind, a.planes) {
                (Kind::Lut4, 2) if a.six => $f::<LUT4S, 2>(a),
                (Kind::Lut4, _) if a.six => $f::<LUT4S, 1>(a),
                (Kind::Lut4, 2) => $f::<LUT4X, 2>(a),
                (Kind::Lut4, _) => $f::<LUT4X, 1>(a),
                (Kind::Lut3, 2) if a.six => $f::<LUT3S, 2>(a),
                (Kind::Lut3, _) if a.six => $f::<LUT3S, 1>(a),
                (Kind::Lut3, 2) => $f::<LUT3X, 2>(a),
                (Kind::Lut3, _) => $f::<LUT3X, 1>(a),
                (Kind::Lut2, 2) if a.six => $f::<LUT2S, 2>(a),
                (Kind::Lut2, _) if a.six => $f::<LUT2S, 1>(a),
                (Kind::Lut2, 2) => $f::<LUT2X, 2>(a),
                (Kind::Lut2, _) => $f::<LUT2X, 1>(a),
                (Kind::Vec2x16, 2) if a.six => $f::<VEC16S, 2>(a),
                (Kind::Vec2x16, _) if a.six => $f::<VEC16S, 1>(a),
                (Kind::Vec2x16, 2) => $f::<VEC16X, 2>(a),
                (Kind::Vec2x16, _) => $f::<VEC16X, 1>(a),
                (Kind::Vec2x64, 2) if a.six => $f::<VEC64S, 2>(a),
                (Kind::Vec2x64, _) if a.six => $f::<VEC64S, 1>(a),
                (Kind::Vec2x64, 2) => $f::<VEC64X, 2>(a),
                (Kind::Vec2x64, _) => $f::<VEC64X, 1>(a),
                (Kind::Int8, 2) => $f::<INT8X, 2>(a),
                (Kind::Int8, _) => $f::<INT8X, 1>(a),
            }
        };
    }
    if a.t > 1 {
        by_kind!(block_rows)
    } else {
        by_kind!(decode_rows)
    }
}

/// Index rows decoded to f32 rows (`scale[o] · q`, exact): whole pairs of chunks 512 bits at a
/// time, the rest (a last chunk, a partial pair) by the 256-bit code. The same values as the
/// scalar decode (an integer to f32 is exact, then one rounding multiply).
///
/// # Safety
/// As `avx2::decode_f32`, and the CPU must have AVX-512 F/BW/VL/VBMI/VNNI.
#[target_feature(enable = "avx2,fma,avx512f,avx512bw,avx512vl,avx512vbmi,avx512vnni")]
pub(super) unsafe fn decode_f32<const K: u8>(a: &DecodeArgs) {
    let DecodeArgs { tables, row, row_bytes, n_idx, cin, scale, out, .. } = *a;
    let tb = tabs512(K, tables, false);
    let cb = chunk_bytes(K);
    let pairs = cin / (2 * CHUNK);
    let f32s = |b: __m128i, s: __m512| _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b)), s);
    let nq = grouped_pairs::<K>(row_bytes / cb, 0, cin.div_ceil(CHUNK));
    for g in 0..n_idx {
        let p = row.add(g * row_bytes);
        let mut i = 0;
        while i < pairs {
            // A whole group of the kind's AVX-512 layout, or one pair.
            let mut ws = [[_mm512_setzero_si512(); 2]; MAX_GROUP];
            let m = if i < nq {
                let slots = group_slots::<K>(p.add(2 * i * cb));
                for (u, w) in ws.iter_mut().enumerate().take(group_pairs(K)) {
                    *w = group_pair::<K>(&slots, u, &tb);
                }
                group_pairs(K).min(pairs - i)
            } else {
                ws[0] = weights2::<K>(p.add(2 * i * cb), &tb);
                1
            };
            for (u, w) in ws.iter().enumerate().take(m) {
                for (v, &wv) in w.iter().enumerate().take(nw(K)) {
                    let o = g * nw(K) + v;
                    let s = _mm512_set1_ps(*scale.add(o));
                    let dst = out.add(o * cin + 2 * (i + u) * CHUNK);
                    // Lanes [A 0–15 | B 0–15 | A 16–31 | B 16–31] to columns 0, 32, 16, 48.
                    _mm512_storeu_ps(dst, f32s(_mm512_castsi512_si128(wv), s));
                    _mm512_storeu_ps(dst.add(32), f32s(_mm512_extracti32x4_epi32::<1>(wv), s));
                    _mm512_storeu_ps(dst.add(16), f32s(_mm512_extracti32x4_epi32::<2>(wv), s));
                    _mm512_storeu_ps(dst.add(48), f32s(_mm512_extracti32x4_epi32::<3>(wv), s));
                }
            }
            i += m;
        }
    }
    decode_f32_from::<K>(a, 2 * pairs);
}

/// Activation rows per call of [`block_rows`] (more are split): the weights of a group are looked
/// up once per this many rows.
const MAX_ROWS: usize = 64;

/// Several activation rows (`2 ≤ t ≤ MAX_ROWS`, more split into such calls) in the pair layout:
/// each block of a group of four output rows is looked up once into weight bytes (8 KiB, in
/// L1), then every activation row streams past it, each pair taking one load per plane and
/// three `vpdpbusd` per output.
///
/// # Safety
/// As [`decode_rows`], with `a.t ≤ MAX_ROWS`.
#[target_feature(enable = "avx2,fma,avx512f,avx512bw,avx512vl,avx512vbmi,avx512vnni")]
pub(super) unsafe fn block_rows<const K: u8, const P: usize>(a: &Args) {
    let tb = tabs512(K, a.tables, true);
    let tb256 = tabs(K, a.tables, true);
    let per_group = 4 / nw(K);
    let mut r = 0;
    while r < a.n_rows {
        let n = per_group.min(a.n_rows - r);
        match n * nw(K) {
            4 => block_group::<K, P, 4>(a, &tb, &tb256, r),
            3 => block_group::<K, P, 3>(a, &tb, &tb256, r),
            2 => block_group::<K, P, 2>(a, &tb, &tb256, r),
            _ => block_group::<K, P, 1>(a, &tb, &tb256, r),
        }
        r += n;
    }
}

/// `NO` output rows from index row `r0` on, for every activation row.
#[allow(clippy::needless_range_loop)] // outputs and their index rows are counted together
#[inline(always)]
unsafe fn block_group<const K: u8, const P: usize, const NO: usize>(a: &Args, tb: &Tabs512, tb256: &Tabs, r0: usize) {
    const PAIRS: usize = PER_BLOCK / 2;
    let cb = chunk_bytes(K);
    let z = _mm512_setzero_si512();
    let o0 = r0 * nw(K);
    let row_hl = a.nchunks / 2 * 4 * CHUNK;
    // Neither buffer is zeroed whole: together they are 16 KiB, and clearing them for every
    // four output rows cost more than the products at two activation rows. Each block writes
    // every weight slot it reads (`o < NO`, `q < np`) before the rows read it, and only the
    // first `a.t` rows of lanes are set and read.
    let mut wbuf = [MaybeUninit::<__m512i>::uninit(); 4 * PAIRS];
    let mut lanes = [[MaybeUninit::<__m256>::uninit(); NO]; MAX_ROWS];
    for lt in lanes.iter_mut().take(a.t) {
        lt.iter_mut().for_each(|l| *l = MaybeUninit::new(_mm256_setzero_ps()));
    }
    let mut c0 = 0usize;
    for b in 0..a.nblocks {
        let nc = (c0 + PER_BLOCK).min(a.nchunks) - c0;
        let np = nc / 2;
        for i in 0..NO.div_ceil(nw(K)) {
            let row = a.row.add((r0 + i) * a.row_bytes + c0 * cb);
            let nq = grouped_pairs::<K>(a.nchunks, c0, nc);
            for q in (0..nq).step_by(group_pairs(K).max(1)) {
                let slots = group_slots::<K>(row.add(2 * q * cb));
                for u in 0..group_pairs(K) {
                    let w = group_pair::<K>(&slots, u, tb);
                    for (v, &wv) in w.iter().enumerate().take(nw(K)) {
                        let o = i * nw(K) + v;
                        if o < NO {
                            wbuf[o * PAIRS + q + u] = MaybeUninit::new(wv);
                        }
                    }
                }
            }
            for q in nq..np {
                let w = weights2::<K>(row.add(2 * q * cb), tb);
                for (v, &wv) in w.iter().enumerate().take(nw(K)) {
                    let o = i * nw(K) + v;
                    if o < NO {
                        wbuf[o * PAIRS + q] = MaybeUninit::new(wv);
                    }
                }
            }
        }
        for (t, lt) in lanes.iter_mut().enumerate().take(a.t) {
            let mut acc = [[z; 3]; NO];
            let xhl = a.xhl.add(t * row_hl + c0 / 2 * 4 * CHUNK);
            let x2 = a.xq2.add(t * a.cin_pad + c0 * CHUNK) as *const __m512i;
            for q in 0..np {
                let h = _mm512_loadu_si512(xhl.add(q * 4 * CHUNK) as *const _);
                let l = _mm512_loadu_si512(xhl.add(q * 4 * CHUNK + 2 * CHUNK) as *const _);
                let x2v = if P == 2 { _mm512_loadu_si512(x2.add(q) as *const _) } else { z };
                for (o, ao) in acc.iter_mut().enumerate() {
                    // SAFETY: slot (o, q) was written by this block's lookup above.
                    let w = wbuf[o * PAIRS + q].assume_init();
                    ao[0] = _mm512_dpbusd_epi32(ao[0], w, h);
                    ao[1] = _mm512_dpbusd_epi32(ao[1], w, l);
                    if P == 2 {
                        ao[2] = _mm512_dpbusd_epi32(ao[2], w, x2v);
                    }
                }
            }
            let blk = (t * a.nblocks + b) * 2;
            for i in 0..NO.div_ceil(nw(K)) {
                let mut acc256 = [[[_mm256_setzero_si256(); 2]; 2]; 1];
                for v in 0..nw(K) {
                    let o = i * nw(K) + v;
                    if o < NO {
                        acc256[0][v] = planes(acc[o]);
                    }
                }
                if nc % 2 == 1 {
                    // The last chunk of the row, unpaired, in the plain layout.
                    chunks_in_registers::<K, P, 1>(a, tb256, r0 + i, t, c0 + nc - 1, 1, &mut acc256);
                }
                for v in 0..nw(K) {
                    let o = i * nw(K) + v;
                    if o < NO {
                        for (p, &ap) in acc256[0][v].iter().enumerate().take(P) {
                            // SAFETY: row t < a.t: set to zero before the first block.
                            let l = lt[o].assume_init();
                            lt[o] =
                                MaybeUninit::new(close_block(l, ap, a.corr.add((blk + p) * LANES), a.xs.add(blk + p)));
                        }
                    }
                }
            }
        }
        c0 += nc;
    }
    for (t, lt) in lanes.iter().enumerate().take(a.t) {
        for (o, &l) in lt.iter().enumerate() {
            // SAFETY: as above, rows below a.t are set.
            *a.out.add(t * a.out_t_stride + o0 + o) = reduce(l.assume_init()) * *a.scale.add(o0 + o);
        }
    }
}
