//! The integer-dot kernels on aarch64 NEON (the base architecture, ARMv8.0: no dot-product
//! extension needed), on the plain layout of [`QuantX`](super::QuantX) and with the scalar
//! reference's lanes, so that they equal it bit for bit.
//!
//! - **Lookup with `tbl`.** The 16 index bytes of a chunk split into low and high nibbles
//!   (columns 0–15 and 16–31), and one `tbl` on the 16-entry table gives 16 signed weights.
//!   vec2x64's six-bit indices need no blends: a four-register `tbl` reads a 64-entry table
//!   directly, and the top two index bits come down from the layout's eight bytes with one
//!   per-lane shift. INT8 weights are loaded as they are. Weights stay signed (NEON multiplies
//!   signed bytes and halves), so no offset is taken back out.
//! - **16-bit plane.** The codes lie in [`xpos`](super::xpos) order (columns 0–7, 16–23, 8–15,
//!   24–31) and lane `l` of the reference holds columns `2l, 2l + 1, 2l + 8, 2l + 9` (`l < 4`)
//!   and `2l + 8, 2l + 9, 2l + 16, 2l + 17` (`l ≥ 4`). `smlal` multiplies widened weights by
//!   codes into four 32-bit column sums per instruction; columns `i` and `i + 8` share an
//!   accumulator, and at the end of a block one pairwise add (`addp`) forms the eight lanes.
//! - **Second plane.** `smull` multiplies eight weight bytes by eight 7-bit codes into 16-bit
//!   products (at most 128 · 63, so two fit without saturation) and `sadalp` adds adjacent
//!   pairs into 32-bit sums; one `addp` at the end of the block gives the lanes of four
//!   consecutive columns ([`lane2`](super::lane2)).
//!
//! - **Dot-product extension** (`sdot`, ARMv8.2+, detected at run time): with it the activations
//!   come in the pair layout of [`QuantX::paired`](super::QuantX) (the 16-bit plane as two
//!   signed bytes `q₁ = 256·h + l`, four consecutive columns per lane), and every product is an
//!   `sdot` of the looked-up weight bytes: three per 16 weights and output, no widening. The
//!   lanes combine as `256·Σh + Σl`, as the x86 512-bit kernels' do; a last chunk without a
//!   partner goes through the base kernel's code on its plain layout.
//!
//! Every 32-bit sum is exact (a column pair of a block holds at most `2 · 64 · 128 · 32767 <
//! 2³¹`), so the order of the integer adds does not matter: each block's lanes go to f32 and
//! are fused with its scale as [`accumulate`](super::accumulate) does, and each row's lanes are
//! summed in [`reduce_lanes`](super::reduce_lanes) order.

use super::{Args, DecodeArgs, Kind, CHUNK, XBLOCK};
use std::arch::aarch64::*;

/// Chunks per activation block.
const PER_BLOCK: usize = XBLOCK / CHUNK;

const LUT4: u8 = 0;
const VEC16: u8 = 1;
const VEC64: u8 = 2;
const INT8: u8 = 3;
const LUT3: u8 = 4;
const LUT2: u8 = 5;

/// Output rows per index row.
const fn nw(k: u8) -> usize {
    if k == VEC16 || k == VEC64 {
        2
    } else {
        1
    }
}

const fn chunk_bytes(k: u8) -> usize {
    match k {
        VEC64 => 24,
        INT8 => 32,
        LUT3 => 12,
        LUT2 => 8,
        _ => 16,
    }
}

/// Activation rows per pass: the accumulators of `nw · T ≤ 2` outputs (8 registers each) stay
/// in NEON's 32 registers next to the weights and codes.
const fn pass_t(k: u8) -> usize {
    2 / nw(k)
}

/// The lookup tables of a kind, loaded once per call.
struct Tabs {
    /// lut4, lut2: table 0; vec2x16: one table per component; lut3: entries 0–3 and 4–7.
    t16: [int8x16_t; 2],
    /// vec2x64: each component's 64 entries.
    t64: [int8x16x4_t; 2],
}

/// # Safety
/// `tables` holds the kind's tables (`Kind::n_tables` × 16 bytes).
#[inline(always)]
unsafe fn tabs(k: u8, tables: *const i8) -> Tabs {
    let z = vdupq_n_s8(0);
    let mut tb = Tabs { t16: [z; 2], t64: [int8x16x4_t(z, z, z, z); 2] };
    match k {
        LUT4 | LUT2 => tb.t16[0] = vld1q_s8(tables),
        VEC16 | LUT3 => tb.t16 = [vld1q_s8(tables), vld1q_s8(tables.add(16))],
        VEC64 => tb.t64 = [vld1q_s8_x4(tables), vld1q_s8_x4(tables.add(64))],
        _ => {}
    }
    tb
}

/// The chunk at `p` as `nw(K)` outputs' weights, columns 0–15 and 16–31.
///
/// # Safety
/// `p` points to a whole chunk of kind `K`.
#[inline(always)]
unsafe fn weights<const K: u8>(p: *const u8, tb: &Tabs) -> [[int8x16_t; 2]; 2] {
    let z = vdupq_n_s8(0);
    if K == INT8 {
        return [[vld1q_s8(p as *const i8), vld1q_s8(p.add(16) as *const i8)], [z; 2]];
    }
    if K == LUT2 || K == LUT3 {
        // Byte b holds columns b, 8 + b, 16 + b, 24 + b at bits 0–1, 2–3, 4–5, 6–7; the
        // tables repeat every four entries, so only the index's low four bits need clearing.
        let b = vld1_u8(p);
        let m = vdup_n_u8(15);
        let lo = vcombine_u8(vand_u8(b, m), vand_u8(vshr_n_u8::<2>(b), m));
        let hi = vcombine_u8(vand_u8(vshr_n_u8::<4>(b), m), vshr_n_u8::<6>(b));
        let w = [vqtbl1q_s8(tb.t16[0], lo), vqtbl1q_s8(tb.t16[0], hi)];
        if K == LUT2 {
            return [w, [z; 2]];
        }
        // Bit 2 of column 4d + k's index is bit 8k + 7 − d of the word after the fields
        // (`hi_bit`): lane m of the broadcast word holds byte m % 4, tested against 1 << (7 − d).
        const BIT: [[u8; 16]; 2] = {
            let mut v = [[0u8; 16]; 2];
            let mut i = 0;
            while i < 32 {
                v[i / 16][i % 16] = 0x80 >> (i / 4);
                i += 1;
            }
            v
        };
        let h = vreinterpretq_u8_u32(vdupq_n_u32((p.add(8) as *const u32).read_unaligned()));
        let (s0, s1) = (vtstq_u8(h, vld1q_u8(BIT[0].as_ptr())), vtstq_u8(h, vld1q_u8(BIT[1].as_ptr())));
        return [
            [vbslq_s8(s0, vqtbl1q_s8(tb.t16[1], lo), w[0]), vbslq_s8(s1, vqtbl1q_s8(tb.t16[1], hi), w[1])],
            [z; 2],
        ];
    }
    let v = vld1q_u8(p);
    let (lo, hi) = (vandq_u8(v, vdupq_n_u8(15)), vshrq_n_u8::<4>(v));
    match K {
        LUT4 => [[vqtbl1q_s8(tb.t16[0], lo), vqtbl1q_s8(tb.t16[0], hi)], [z; 2]],
        VEC16 => [
            [vqtbl1q_s8(tb.t16[0], lo), vqtbl1q_s8(tb.t16[0], hi)],
            [vqtbl1q_s8(tb.t16[1], lo), vqtbl1q_s8(tb.t16[1], hi)],
        ],
        _ => {
            // Bits 5 and 4 of the index of column 8q + r are bits 7 − 2q and 6 − 2q of byte r:
            // a shift by 2q − 2 puts them at bits 5 and 4 of that column's byte.
            let b = vld1_u8(p.add(16));
            let bb = vcombine_u8(b, b);
            let (s0, s1) = (vcombine_s8(vdup_n_s8(-2), vdup_n_s8(0)), vcombine_s8(vdup_n_s8(2), vdup_n_s8(4)));
            let m = vdupq_n_u8(0x30);
            let i0 = vorrq_u8(lo, vandq_u8(vshlq_u8(bb, s0), m));
            let i1 = vorrq_u8(hi, vandq_u8(vshlq_u8(bb, s1), m));
            [
                [vqtbl4q_s8(tb.t64[0], i0), vqtbl4q_s8(tb.t64[0], i1)],
                [vqtbl4q_s8(tb.t64[1], i0), vqtbl4q_s8(tb.t64[1], i1)],
            ]
        }
    }
}

/// One output's exact sums over a block for one activation row: the 16-bit plane's column
/// pairs `(i, i + 8)` for lanes 0–3 (`a[0]`: columns 0–3 and 8–11, `a[1]`: 4–7 and 12–15) and
/// lanes 4–7 (`a[2]`, `a[3]`: from columns 16–31 alike), and the second plane's adjacent
/// column pairs (`b[0..4]`: columns 0–7, 8–15, 16–23, 24–31).
#[derive(Clone, Copy)]
struct Sums {
    a: [int32x4_t; 4],
    b: [int32x4_t; 4],
}

impl Sums {
    #[inline(always)]
    unsafe fn zero() -> Sums {
        let z = vdupq_n_s32(0);
        Sums { a: [z; 4], b: [z; 4] }
    }

    /// Adds one chunk: weights `w` (columns 0–15, 16–31), codes `x` (32, `xpos` order) and
    /// `x2` (32, column order).
    ///
    /// # Safety
    /// `x` holds 32 values, and `x2` too when `P == 2`.
    #[inline(always)]
    unsafe fn add<const P: usize>(&mut self, w: &[int8x16_t; 2], x: *const i16, x2: *const i8) {
        // Codes of columns 0–7, 16–23, 8–15, 24–31.
        let xs = [vld1q_s16(x), vld1q_s16(x.add(8)), vld1q_s16(x.add(16)), vld1q_s16(x.add(24))];
        for (h, &wh) in w.iter().enumerate() {
            // Columns 16h + 0–7 and 16h + 8–15, widened; their codes are xs[h] and xs[2 + h].
            let (w0, w1) = (vmovl_s8(vget_low_s8(wh)), vmovl_high_s8(wh));
            let (x0, x1) = (xs[h], xs[2 + h]);
            let a = &mut self.a[2 * h..2 * h + 2];
            a[0] = vmlal_s16(a[0], vget_low_s16(w0), vget_low_s16(x0));
            a[0] = vmlal_s16(a[0], vget_low_s16(w1), vget_low_s16(x1));
            a[1] = vmlal_high_s16(a[1], w0, x0);
            a[1] = vmlal_high_s16(a[1], w1, x1);
            if P == 2 {
                let c = vld1q_s8(x2.add(16 * h));
                let b = &mut self.b[2 * h..2 * h + 2];
                b[0] = vpadalq_s16(b[0], vmull_s8(vget_low_s8(wh), vget_low_s8(c)));
                b[1] = vpadalq_s16(b[1], vmull_high_s8(wh, c));
            }
        }
    }

    /// The block's eight exact lanes of each plane (as the reference's `lane` and `lane2`).
    #[inline(always)]
    unsafe fn lanes(&self) -> [[int32x4_t; 2]; 2] {
        [
            [vpaddq_s32(self.a[0], self.a[1]), vpaddq_s32(self.a[2], self.a[3])],
            [vpaddq_s32(self.b[0], self.b[1]), vpaddq_s32(self.b[2], self.b[3])],
        ]
    }
}

/// Ends a block: each plane's exact lanes `e` fused into the f32 `lanes` with the block's scales
/// `s`, plane by plane, as [`accumulate`](super::accumulate).
///
/// # Safety
/// `s` holds the block's `P` scales.
#[inline(always)]
unsafe fn fuse<const P: usize>(lanes: &mut [float32x4_t; 2], e: &[[int32x4_t; 2]; 2], s: *const f32) {
    for (plane, ep) in e.iter().enumerate().take(P) {
        for (l, &v) in lanes.iter_mut().zip(ep) {
            *l = vfmaq_n_f32(*l, vcvtq_f32_s32(v), *s.add(plane));
        }
    }
}

/// The f32 lanes of one output summed in `reduce_lanes` order.
#[inline(always)]
unsafe fn reduce(l: &[float32x4_t; 2]) -> f32 {
    // [l0 + l1, l2 + l3, l4 + l5, l6 + l7], then [(l0 + l1) + (l2 + l3), (l4 + l5) + (l6 + l7)].
    let p = vpaddq_f32(l[0], l[1]);
    let q = vpaddq_f32(p, p);
    vgetq_lane_f32::<0>(q) + vgetq_lane_f32::<1>(q)
}

/// Index row `r` against activation rows `t0..t0 + T`: scaled outputs written.
///
/// # Safety
/// As [`rows`].
#[inline(always)]
unsafe fn row<const K: u8, const P: usize, const T: usize>(a: &Args, tb: &Tabs, r: usize, t0: usize) {
    let z = vdupq_n_f32(0.0);
    let mut lanes = [[[z; 2]; 2]; T];
    let base = a.row.add(r * a.row_bytes);
    let mut c = 0;
    for b in 0..a.nblocks {
        let n = PER_BLOCK.min(a.nchunks - c);
        let mut sums = [[Sums::zero(); 2]; T];
        for i in c..c + n {
            let w = weights::<K>(base.add(i * chunk_bytes(K)), tb);
            for (t, st) in sums.iter_mut().enumerate() {
                let off = (t0 + t) * a.cin_pad + i * CHUNK;
                for (s, wv) in st.iter_mut().zip(&w).take(nw(K)) {
                    s.add::<P>(wv, a.xq.add(off), a.xq2.add(off));
                }
            }
        }
        c += n;
        for (t, (st, lt)) in sums.iter().zip(lanes.iter_mut()).enumerate() {
            let s = a.xs.add(((t0 + t) * a.nblocks + b) * 2);
            for (sv, lv) in st.iter().zip(lt.iter_mut()).take(nw(K)) {
                fuse::<P>(lv, &sv.lanes(), s);
            }
        }
    }
    let o0 = r * nw(K);
    for (t, lt) in lanes.iter().enumerate() {
        for (v, lv) in lt.iter().enumerate().take(nw(K)) {
            *a.out.add((t0 + t) * a.out_t_stride + o0 + v) = reduce(lv) * *a.scale.add(o0 + v);
        }
    }
}

/// `acc + Σ` of the four products of each 32-bit lane's bytes (`sdot`).
///
/// # Safety
/// The CPU has the dot-product extension.
#[inline(always)]
unsafe fn sdot(acc: int32x4_t, a: int8x16_t, b: int8x16_t) -> int32x4_t {
    let mut acc = acc;
    // SAFETY: `sdot` reads and writes registers only; the caller checked the extension.
    std::arch::asm!(
        "sdot {acc:v}.4s, {a:v}.16b, {b:v}.16b",
        acc = inout(vreg) acc,
        a = in(vreg) a,
        b = in(vreg) b,
        options(pure, nomem, nostack, preserves_flags)
    );
    acc
}

/// Index row `r` against activation row `t` in the pair layout: per whole pair of chunks
/// `A, B`, the `h`, `l` and `q₂` bytes lie as `[A 0–15 | B 0–15 | A 16–31 | B 16–31]`, and lane
/// `j` of a 16-column half holds columns `4j..4j + 4` of both chunks. Scaled outputs written.
///
/// # Safety
/// As [`rows`], with `a.paired`; the CPU has the dot-product extension.
#[inline(always)]
unsafe fn row_paired<const K: u8, const P: usize>(a: &Args, tb: &Tabs, r: usize, t: usize) {
    let z = vdupq_n_s32(0);
    let mut lanes = [[vdupq_n_f32(0.0); 2]; 2];
    let base = a.row.add(r * a.row_bytes);
    let pairs = a.nchunks / 2;
    let hl = a.xhl.add(t * pairs * 4 * CHUNK);
    let q2 = a.xq2.add(t * a.cin_pad);
    let mut c = 0;
    for b in 0..a.nblocks {
        let n = PER_BLOCK.min(a.nchunks - c);
        // Per output: Σ w·h, Σ w·l, Σ w·q₂, each for lanes 0–3 and 4–7.
        let mut acc = [[[z; 2]; 3]; 2];
        let mut i = c;
        while i + 2 <= c + n {
            let wa = weights::<K>(base.add(i * chunk_bytes(K)), tb);
            let wb = weights::<K>(base.add((i + 1) * chunk_bytes(K)), tb);
            let xhl = hl.add(i / 2 * 4 * CHUNK);
            let x2 = q2.add(i * CHUNK);
            let xs = [xhl, xhl.add(2 * CHUNK), x2];
            for (plane, &xp) in xs.iter().enumerate().take(P + 1) {
                let x = [vld1q_s8(xp), vld1q_s8(xp.add(16)), vld1q_s8(xp.add(32)), vld1q_s8(xp.add(48))];
                for (v, av) in acc.iter_mut().enumerate().take(nw(K)) {
                    let ap = &mut av[plane];
                    ap[0] = sdot(sdot(ap[0], wa[v][0], x[0]), wb[v][0], x[1]);
                    ap[1] = sdot(sdot(ap[1], wa[v][1], x[2]), wb[v][1], x[3]);
                }
            }
            i += 2;
        }
        // A last chunk without a partner: the base kernel's sums on the plain layout.
        let mut odd = [Sums::zero(); 2];
        if i < c + n {
            let w = weights::<K>(base.add(i * chunk_bytes(K)), tb);
            let off = t * a.cin_pad + i * CHUNK;
            for (s, wv) in odd.iter_mut().zip(&w).take(nw(K)) {
                s.add::<P>(wv, a.xq.add(off), a.xq2.add(off));
            }
        }
        c += n;
        let s = a.xs.add((t * a.nblocks + b) * 2);
        for ((av, lv), ov) in acc.iter().zip(lanes.iter_mut()).zip(&odd).take(nw(K)) {
            let o = ov.lanes();
            // 256·Σh + Σl: wrapping, and exact since the true sum of a block's lane fits.
            let e = [
                [0, 1].map(|h| vaddq_s32(vaddq_s32(vshlq_n_s32::<8>(av[0][h]), av[1][h]), o[0][h])),
                [0, 1].map(|h| vaddq_s32(av[2][h], o[1][h])),
            ];
            fuse::<P>(lv, &e, s);
        }
    }
    let o0 = r * nw(K);
    for (v, lv) in lanes.iter().enumerate().take(nw(K)) {
        *a.out.add(t * a.out_t_stride + o0 + v) = reduce(lv) * *a.scale.add(o0 + v);
    }
}

/// Every index row of the call against every activation row, `pass_t(K)` rows per pass.
#[inline(always)]
unsafe fn rows_k<const K: u8, const P: usize>(a: &Args) {
    let tb = tabs(K, a.tables);
    for r in 0..a.n_rows {
        let mut t0 = 0;
        while t0 < a.t {
            let step = pass_t(K).min(a.t - t0);
            if step == 2 {
                row::<K, P, 2>(a, &tb, r, t0);
            } else {
                row::<K, P, 1>(a, &tb, r, t0);
            }
            t0 += step;
        }
    }
}

/// [`rows_k`] for activations in the pair layout, one activation row at a time.
#[target_feature(enable = "dotprod")]
unsafe fn rows_paired<const K: u8, const P: usize>(a: &Args) {
    let tb = tabs(K, a.tables);
    for r in 0..a.n_rows {
        for t in 0..a.t {
            row_paired::<K, P>(a, &tb, r, t);
        }
    }
}

/// Whether this CPU has the dot-product extension (`sdot`), which the pair layout's kernel
/// needs.
pub(crate) fn has_dotprod() -> bool {
    std::arch::is_aarch64_feature_detected!("dotprod")
}

/// # Safety
/// `a` describes valid buffers (see `DotMatrix::rows`); activations in the pair layout only
/// where [`has_dotprod`].
pub(super) unsafe fn rows(kind: Kind, a: &Args) {
    macro_rules! go {
        ($k:expr) => {
            match (a.paired, a.planes) {
                (true, 2) => rows_paired::<$k, 2>(a),
                (true, _) => rows_paired::<$k, 1>(a),
                (false, 2) => rows_k::<$k, 2>(a),
                _ => rows_k::<$k, 1>(a),
            }
        };
    }
    match kind {
        Kind::Lut4 => go!(LUT4),
        Kind::Lut3 => go!(LUT3),
        Kind::Lut2 => go!(LUT2),
        Kind::Vec2x16 => go!(VEC16),
        Kind::Vec2x64 => go!(VEC64),
        Kind::Int8 => go!(INT8),
    }
}

/// Prefill's decode: index rows `0..n_idx` to f32, `out[(g·nw + v)·cin + j] = scale[g·nw + v] ·
/// w`, exactly the scalar decode's values.
///
/// # Safety
/// `a.row` holds `n_idx` index rows of the kind, `a.scale` `n_idx · nw` values, `a.tables` the
/// kind's tables, and `a.out` `n_idx · nw · cin` values.
pub(super) unsafe fn decode_f32(kind: Kind, a: &DecodeArgs) {
    match kind {
        Kind::Lut4 => decode_f32_k::<LUT4>(a),
        Kind::Lut3 => decode_f32_k::<LUT3>(a),
        Kind::Lut2 => decode_f32_k::<LUT2>(a),
        Kind::Vec2x16 => decode_f32_k::<VEC16>(a),
        Kind::Vec2x64 => decode_f32_k::<VEC64>(a),
        Kind::Int8 => decode_f32_k::<INT8>(a),
    }
}

#[inline(always)]
unsafe fn decode_f32_k<const K: u8>(a: &DecodeArgs) {
    let DecodeArgs { tables, row, row_bytes, n_idx, cin, scale, out, .. } = *a;
    let tb = tabs(K, tables);
    let mut tail = [0f32; CHUNK];
    for g in 0..n_idx {
        for c in 0..cin.div_ceil(CHUNK) {
            let w = weights::<K>(row.add(g * row_bytes + c * chunk_bytes(K)), &tb);
            let m = CHUNK.min(cin - c * CHUNK);
            for (v, wv) in w.iter().enumerate().take(nw(K)) {
                let o = g * nw(K) + v;
                let s = *scale.add(o);
                let dst = out.add(o * cin + c * CHUNK);
                // A whole chunk straight to the output, a ragged last one through `tail`.
                let d = if m == CHUNK { dst } else { tail.as_mut_ptr() };
                for (h, &wh) in wv.iter().enumerate() {
                    for (q, w16) in [vmovl_s8(vget_low_s8(wh)), vmovl_high_s8(wh)].into_iter().enumerate() {
                        let lo = vcvtq_f32_s32(vmovl_s16(vget_low_s16(w16)));
                        let hi = vcvtq_f32_s32(vmovl_high_s16(w16));
                        let p = d.add(16 * h + 8 * q);
                        vst1q_f32(p, vmulq_n_f32(lo, s));
                        vst1q_f32(p.add(4), vmulq_n_f32(hi, s));
                    }
                }
                if m < CHUNK {
                    std::ptr::copy_nonoverlapping(tail.as_ptr(), dst, m);
                }
            }
        }
    }
}

/// Prefill's products: `out[i·stride + j] = Σ x[i, k] · w[j, k]` for `t` activation rows and
/// `n` decoded weight rows of `cin` values, in tiles of up to 4 × 4 with four f32 lanes each.
///
/// # Safety
/// `x` holds `t · cin` values, `w` `n · cin`, and `out` rows `0..t` (`stride` apart) of `n`
/// values that no one else writes.
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
        let r = (t - i).min(4);
        let mut j = 0;
        while j < n {
            let c = (n - j).min(4);
            let (xi, wj, o) = (x.add(i * cin), w.add(j * cin), out.add(i * stride + j));
            match (r, c) {
                (4, 4) => dot_tile::<4, 4>(xi, cin, wj, o, stride),
                (4, 3) => dot_tile::<4, 3>(xi, cin, wj, o, stride),
                (4, 2) => dot_tile::<4, 2>(xi, cin, wj, o, stride),
                (4, _) => dot_tile::<4, 1>(xi, cin, wj, o, stride),
                (3, 4) => dot_tile::<3, 4>(xi, cin, wj, o, stride),
                (2, 4) => dot_tile::<2, 4>(xi, cin, wj, o, stride),
                (1, 4) => dot_tile::<1, 4>(xi, cin, wj, o, stride),
                (3, _) => dot_tile::<3, 1>(xi, cin, wj, o, stride),
                (2, _) => dot_tile::<2, 1>(xi, cin, wj, o, stride),
                _ => dot_tile::<1, 1>(xi, cin, wj, o, stride),
            }
            // The one-column tiles cover one weight row at a time.
            j += if r == 4 || c == 4 { c } else { 1 };
        }
        i += r;
    }
}

/// One tile of `R` activation rows by `C` weight rows.
#[inline(always)]
unsafe fn dot_tile<const R: usize, const C: usize>(
    x: *const f32,
    cin: usize,
    w: *const f32,
    out: *mut f32,
    stride: usize,
) {
    let mut acc = [[vdupq_n_f32(0.0); C]; R];
    let main = cin / 4 * 4;
    let mut k = 0;
    while k < main {
        let wv: [float32x4_t; C] = std::array::from_fn(|c| vld1q_f32(w.add(c * cin + k)));
        for (r, ar) in acc.iter_mut().enumerate() {
            let xv = vld1q_f32(x.add(r * cin + k));
            for (a, &wc) in ar.iter_mut().zip(&wv) {
                *a = vfmaq_f32(*a, xv, wc);
            }
        }
        k += 4;
    }
    for (r, ar) in acc.iter().enumerate() {
        for (c, &a) in ar.iter().enumerate() {
            let mut s = vaddvq_f32(a);
            for kk in main..cin {
                s += *x.add(r * cin + kk) * *w.add(c * cin + kk);
            }
            *out.add(r * stride + c) = s;
        }
    }
}
