//! The float tile kernels on aarch64 NEON: per column, the tile's 8 or 16 weights looked up in
//! registers and FMA'd with each activation row's broadcast input. Small tables are looked up
//! with a four-register `tbl` on their bytes (a 16-entry f32 table is 64 bytes: byte `4·i + b`
//! of entry `i`); vec2x64's 128-value table is too large for `tbl` and is read as one 8-byte
//! `(component 0, component 1)` pair per lane.

use super::Kind;
use std::arch::aarch64::*;

/// Unscaled sums of one tile, `out[t · rows + row]` (`rows` = 8, or 16 for the vector formats).
///
/// # Safety
/// `data` holds the tile's `cin · bytes_per_col` bytes plus 8 bytes of padding, `table` what the
/// kind reads (16 values for lut, 32 for vec2x16, 128 for vec2x64), `x` `tc · cin` values,
/// `out` `tc · rows`, and `1 ≤ tc ≤ 8`.
pub(super) unsafe fn tile(kind: Kind, table: &[f32], data: &[u8], cin: usize, x: &[f32], tc: usize, out: &mut [f32]) {
    let rows = if matches!(kind, Kind::Vec2x16 | Kind::Vec2x64) { 16 } else { 8 };
    debug_assert!(x.len() >= tc * cin && out.len() >= tc * rows && (1..=8).contains(&tc));
    let (d, xp, o) = (data.as_ptr(), x.as_ptr(), out.as_mut_ptr());
    let tb = table.as_ptr();
    macro_rules! go {
        ($nv:literal, $bpc:expr, |$p:ident| $decode:expr) => {
            match tc {
                1 => tile_loop::<1, $nv>(d, $bpc, cin, xp, o, |$p| $decode),
                2 => tile_loop::<2, $nv>(d, $bpc, cin, xp, o, |$p| $decode),
                3 => tile_loop::<3, $nv>(d, $bpc, cin, xp, o, |$p| $decode),
                4 => tile_loop::<4, $nv>(d, $bpc, cin, xp, o, |$p| $decode),
                5 => tile_loop::<5, $nv>(d, $bpc, cin, xp, o, |$p| $decode),
                6 => tile_loop::<6, $nv>(d, $bpc, cin, xp, o, |$p| $decode),
                7 => tile_loop::<7, $nv>(d, $bpc, cin, xp, o, |$p| $decode),
                _ => tile_loop::<8, $nv>(d, $bpc, cin, xp, o, |$p| $decode),
            }
        };
    }
    match kind {
        Kind::Lut(bits) => {
            debug_assert!(table.len() >= 16);
            let t = vld1q_u8_x4(tb as *const u8);
            let b = bits as usize;
            let (s0, s1) = (lane_shifts(b, 0), lane_shifts(b, 4));
            go!(2, b, |p| {
                let (i0, i1) = indices(p, s0, s1, (1 << b) - 1);
                [look16(t, i0), look16(t, i1)]
            })
        }
        Kind::Vec2x16 => {
            debug_assert!(table.len() >= 32);
            let t0 = vld1q_u8_x4(tb as *const u8);
            let t1 = vld1q_u8_x4(tb.add(16) as *const u8);
            let (s0, s1) = (lane_shifts(4, 0), lane_shifts(4, 4));
            go!(4, 4, |p| {
                let (i0, i1) = indices(p, s0, s1, 15);
                // Rows 2k (component 0) and 2k + 1 (component 1) of pair k, interleaved.
                let (a0, a1) = (look16(t0, i0), look16(t1, i0));
                let (b0, b1) = (look16(t0, i1), look16(t1, i1));
                [vzip1q_f32(a0, a1), vzip2q_f32(a0, a1), vzip1q_f32(b0, b1), vzip2q_f32(b0, b1)]
            })
        }
        Kind::Vec2x64 => {
            debug_assert!(table.len() >= 128);
            go!(4, 6, |p| {
                // Pair k's index is bits 6k..6k + 6 of the column's 48 bits.
                let word = (p as *const u64).read_unaligned();
                let pair = |k: usize| vld1_f32(tb.add(2 * ((word >> (6 * k)) & 63) as usize));
                std::array::from_fn(|v| vcombine_f32(pair(2 * v), pair(2 * v + 1)))
            })
        }
        Kind::Int8 => go!(2, 8, |p| {
            let w = vmovl_s8(vld1_s8(p as *const i8));
            [vcvtq_f32_s32(vmovl_s16(vget_low_s16(w))), vcvtq_f32_s32(vmovl_high_s16(w))]
        }),
    }
}

/// Right shifts (negative left shifts) that bring lanes `k0..k0 + 4` of `bits`-bit indices to
/// the bottom of their 32-bit lanes.
#[inline(always)]
unsafe fn lane_shifts(bits: usize, k0: usize) -> int32x4_t {
    let s: [i32; 4] = std::array::from_fn(|i| -(((k0 + i) * bits) as i32));
    vld1q_s32(s.as_ptr())
}

/// The 8 lanes' indices of the column at `p` (the first 4 bytes hold them all for ≤ 4 bits).
#[inline(always)]
unsafe fn indices(p: *const u8, s0: int32x4_t, s1: int32x4_t, mask: u32) -> (uint32x4_t, uint32x4_t) {
    let v = vdupq_n_u32((p as *const u32).read_unaligned());
    let m = vdupq_n_u32(mask);
    (vandq_u32(vshlq_u32(v, s0), m), vandq_u32(vshlq_u32(v, s1), m))
}

/// Four entries of a 16-entry f32 table held as 64 bytes: byte `4·i + b` of entry `i`.
#[inline(always)]
unsafe fn look16(t: uint8x16x4_t, i: uint32x4_t) -> float32x4_t {
    let bytes = vmlaq_n_u32(vdupq_n_u32(0x0302_0100), i, 0x0404_0404);
    vreinterpretq_f32_u8(vqtbl4q_u8(t, vreinterpretq_u8_u32(bytes)))
}

/// Every column `j` of the tile: its `4 · NV` weights (row order) times `x[t, j]` added into
/// row `t`'s accumulators; stored as `out[t · 4·NV + row]`.
#[inline(always)]
unsafe fn tile_loop<const T: usize, const NV: usize>(
    data: *const u8,
    bpc: usize,
    cin: usize,
    x: *const f32,
    out: *mut f32,
    decode: impl Fn(*const u8) -> [float32x4_t; NV],
) {
    let mut acc = [[vdupq_n_f32(0.0); NV]; T];
    for j in 0..cin {
        let w = decode(data.add(j * bpc));
        for (t, at) in acc.iter_mut().enumerate() {
            let xv = *x.add(t * cin + j);
            for (a, &wv) in at.iter_mut().zip(&w) {
                *a = vfmaq_n_f32(*a, wv, xv);
            }
        }
    }
    for (t, at) in acc.iter().enumerate() {
        for (v, &a) in at.iter().enumerate() {
            vst1q_f32(out.add((t * NV + v) * 4), a);
        }
    }
}
