//! Prefill (many activation rows) on integer products, for CPUs whose f32 rate is the limit:
//! a core that issues one 512-bit FMA a cycle (Zen 4) multiplies 16 pairs a cycle in f32, but
//! 64 byte pairs in one `vpdpbusd`. The activations go in as three byte planes of a 24-bit code
//! (`x ≈ s₁·(256·h + l) + s₂·q₂`, within about 2⁻²³ of each block's largest magnitude, as
//! precise as the decode kernels' two planes), so three `vpdpbusd` cover 64 multiply-adds where
//! f32 takes four FMAs.
//!
//! # Layout
//! Each call decodes the weights once, 16 output rows at a time, into a panel of unsigned bytes
//! `w + 128`: quad `q` (input columns `4q..4q + 4`) of the 16 rows is one 64-byte vector, row
//! `j`'s four bytes in its lane `j`, which is how `vpdpbusd` sums them. Every activation row
//! then streams past the panel from L1: each quad of each plane is one 32-bit broadcast, so the
//! 32-bit lanes are output rows and the sums leave as whole vectors of 16 outputs, stored
//! straight into the row-major output (no horizontal sums, no transposes). `128 · Σ code` per
//! block and plane takes the unsigned offset back out.
//!
//! Block sums are exact in 32 bits (at most [`PBLOCK`] products of `255 · 128`); each block is
//! taken to f32 in one fixed order (`(fh·256s₁ + fl·s₁) + f₂·s₂`, then the row scale, then added
//! to the previous blocks), which the scalar reference follows, so SIMD and reference agree bit
//! for bit.

use super::{DotMatrix, CHUNK};

/// Input columns sharing one set of activation scales: `PBLOCK · 255 · 128 < 2³¹`.
pub(crate) const PBLOCK: usize = 2048;
/// Largest code of the 16-bit part, so that `h = (q₁ + 128) >> 8` fits a signed byte.
const XMAX1: f32 = 32639.0;
/// The residual plane: `|x − s₁·q₁| ≤ s₁/2 = 127·s₂`.
const XMAX2: f32 = 127.0;
/// Output rows per panel (the 32-bit lanes of a 512-bit vector).
pub(crate) const PANEL: usize = 16;
/// Activation rows per tile: 8 rows × 3 planes = 24 accumulators of 32 registers.
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
const TILE_T: usize = 8;

/// One block of one activation row: `s = (256·s₁, s₁, s₂)`, and `corr` the `128 · Σ` of each
/// plane's codes over the block.
#[derive(Clone, Copy, Default, Debug, PartialEq)]
pub(crate) struct Block {
    pub s: [f32; 3],
    pub corr: [i32; 3],
}

/// Activations as three byte planes per row (see the module docs).
#[derive(Default)]
pub(crate) struct PlaneX {
    pub t: usize,
    pub cin_pad: usize,
    pub nblocks: usize,
    /// `t × 3 × cin_pad`: per row, the planes `h`, `l`, `q₂` in column order, zero past `cin`.
    pub x: Vec<i8>,
    /// `t × nblocks`.
    pub blocks: Vec<Block>,
}

impl PlaneX {
    fn held_bytes(&self) -> usize {
        self.x.capacity() + std::mem::size_of::<Block>() * self.blocks.capacity()
    }

    /// Quantize `t` rows of `cin` values into this value's buffers (no allocation once large
    /// enough), rows in parallel, with the AVX-512 code where `simd` and the CPU has it (the same
    /// bits). False, with nothing usable, when a value is not finite or a block's largest
    /// magnitude is too small to scale (below ~1e-32) or above 2⁶⁴: the caller multiplies in
    /// f32 instead, which takes any finite input and carries NaN and infinity through as a
    /// dense product would.
    pub fn fill(&mut self, simd: bool, x: &[f32], t: usize, cin: usize, cin_pad: usize) -> bool {
        assert!(x.len() >= t * cin && cin_pad >= cin && cin_pad.is_multiple_of(4));
        let before = self.held_bytes();
        let nb = cin_pad.div_ceil(PBLOCK);
        (self.t, self.cin_pad, self.nblocks) = (t, cin_pad, nb);
        self.x.resize(t * 3 * cin_pad, 0);
        self.blocks.resize(t * nb, Block::default());
        crate::scratch::note_held(before, self.held_bytes());
        if t == 0 {
            return true;
        }
        let finite = std::sync::atomic::AtomicBool::new(true);
        let per = t.div_ceil(2 * rayon::current_num_threads());
        crate::team::par_chunks2_mut(
            &mut self.x[..t * 3 * cin_pad],
            per * 3 * cin_pad,
            &mut self.blocks[..t * nb],
            per * nb,
            &|i, planes, blocks| {
                for (k, (p, b)) in planes.chunks_exact_mut(3 * cin_pad).zip(blocks.chunks_exact_mut(nb)).enumerate() {
                    let r = i * per + k;
                    if !quantize_row(simd, &x[r * cin..(r + 1) * cin], p, b) {
                        finite.store(false, std::sync::atomic::Ordering::Relaxed);
                    }
                }
            },
        );
        finite.into_inner()
    }
}

/// One row into its planes (`3 × cin_pad` bytes) and blocks; false if a value is not finite or
/// a block too small or too large to scale.
fn quantize_row(simd: bool, row: &[f32], planes: &mut [i8], blocks: &mut [Block]) -> bool {
    let (cin, cin_pad) = (row.len(), planes.len() / 3);
    let (hp, rest) = planes.split_at_mut(cin_pad);
    let (lp, qp) = rest.split_at_mut(cin_pad);
    for (b, blk) in blocks.iter_mut().enumerate() {
        let (c0, c1) = (b * PBLOCK, ((b + 1) * PBLOCK).min(cin_pad));
        let v = &row[c0.min(cin)..c1.min(cin)];
        let (m, finite) = super::absmax_finite(v);
        if !finite || m > super::ROW_HI {
            // A block above 2⁶⁴ could overflow f32 in its block sums (`close`) before the row
            // scale brings them down, where the f32 path's products need not.
            return false;
        }
        let (s1, inv) = if m > 0.0 { (m / XMAX1, XMAX1 / m) } else { (0.0, 0.0) };
        let (s2, inv2) = (s1 / (2.0 * XMAX2), inv * (2.0 * XMAX2));
        if !inv2.is_finite() {
            // A block below ~1e-32 has no finite scale: the caller's f32 path keeps it.
            return false;
        }
        let (h, l, q) = (&mut hp[c0..c1], &mut lp[c0..c1], &mut qp[c0..c1]);
        #[cfg(target_arch = "x86_64")]
        let sums = if simd && super::avx512() {
            // SAFETY: the AVX-512 subsets were checked; the planes hold `c1 − c0 ≥ v.len()` bytes.
            unsafe { x86::quantize_block(v, [inv, s1, inv2], h, l, q) }
        } else {
            quantize_block(v, [inv, s1, inv2], h, l, q)
        };
        #[cfg(not(target_arch = "x86_64"))]
        let sums = {
            let _ = simd;
            quantize_block(v, [inv, s1, inv2], h, l, q)
        };
        *blk = Block { s: [256.0 * s1, s1, s2], corr: sums.map(|s| 128 * s) };
    }
    true
}

/// The codes of one block's values `v` into `h`, `l`, `q` (zero past `v.len()`), with
/// `k = (1/s₁, s₁, 1/s₂)`; returns each plane's sum of codes.
fn quantize_block(v: &[f32], k: [f32; 3], h: &mut [i8], l: &mut [i8], q: &mut [i8]) -> [i32; 3] {
    let [inv, s1, inv2] = k;
    let n = v.len();
    for (i, &xv) in v.iter().enumerate() {
        let q1 = super::round_small(xv * inv).clamp(-XMAX1, XMAX1);
        let q2 = super::round_small((xv - q1 * s1) * inv2).clamp(-XMAX2, XMAX2);
        let q1 = q1 as i32;
        let hv = (q1 + 128) >> 8;
        h[i] = hv as i8;
        l[i] = (q1 - 256 * hv) as i8;
        q[i] = q2 as i8;
    }
    h[n..].fill(0);
    l[n..].fill(0);
    q[n..].fill(0);
    let sum = |p: &[i8]| p.iter().map(|&c| c as i32).sum::<i32>();
    [sum(h), sum(l), sum(q)]
}

thread_local! {
    /// The planes of the current call, kept for the buffers.
    static PX: std::cell::RefCell<Option<PlaneX>> = const { std::cell::RefCell::new(None) };
    /// A worker's decoded rows and panel, kept for the buffers.
    /// (Bytes in `f32` vectors: the panel transposes are [`crate::transpose`]'s 32-bit ones.)
    static PANELS: std::cell::RefCell<Option<(Vec<f32>, Vec<f32>)>> = const { std::cell::RefCell::new(None) };
}

/// One block's f32 contribution to an output, from its exact sums `a` (unsigned offset
/// included), the row's corrections and scales: the order every path follows.
#[inline(always)]
fn close(a: [i32; 3], corr: [i32; 3], s: [f32; 3], scale: f32) -> f32 {
    let f = |p: usize| a[p].wrapping_sub(corr[p]) as f32;
    ((f(0) * s[0] + f(1) * s[1]) + f(2) * s[2]) * scale
}

impl DotMatrix {
    /// Output rows `r0..r0 + n` (`n ≤ PANEL`, whole index rows) as unsigned bytes `w + 128`,
    /// row `j` at `rows[j·cin_pad..]`; rows past `n` are 128 (weight 0).
    fn decode_u8(&self, simd: bool, r0: usize, n: usize, rows: &mut [u8]) {
        let cp = self.cin_pad;
        assert!(n <= PANEL && rows.len() >= PANEL * cp && r0 + n <= self.cout);
        rows[n * cp..PANEL * cp].fill(128);
        let nr = self.kind.rows();
        #[cfg(target_arch = "x86_64")]
        if simd && super::avx512() && r0.is_multiple_of(nr) && n.is_multiple_of(nr) {
            // SAFETY: the AVX-512 subsets were checked by `avx512()`; index rows r0/nr.. (n/nr of
            // them) lie in `data`, and `rows` holds n × cin_pad bytes (asserted above).
            unsafe { x86::decode_u8(self, r0 / nr, n / nr, rows.as_mut_ptr()) };
            return;
        }
        let _ = simd;
        for (i, o) in rows[..n * cp].chunks_mut(cp).enumerate() {
            let r = r0 + i;
            let row = &self.data.bytes()[r / nr * self.row_bytes..];
            for (c, oc) in o.chunks_mut(CHUNK).enumerate() {
                let w = self.chunk_weights(row, c);
                for (b, &wv) in oc.iter_mut().zip(&w[r % nr]) {
                    *b = (wv as u8) ^ 0x80;
                }
            }
        }
    }
}

/// `panel[64·q + 4·j + i] = rows[j·cin_pad + 4q + i]` (bytes): the decoded rows regrouped by
/// quad, a transpose of 32-bit words (16 rows × `cin_pad/4` quads; in 16×16 register blocks
/// on AVX-512, about a quarter of the time a gather per quad costs).
fn to_panel(rows: &[f32], cin_pad: usize, panel: &mut [f32]) {
    let quads = cin_pad / 4;
    crate::transpose::transpose(rows, PANEL, quads, quads, panel, PANEL, false)
}

/// The bytes of an `f32` buffer.
fn bytes(v: &[f32]) -> &[u8] {
    // SAFETY: any initialized memory reads as bytes; the length covers the same allocation.
    unsafe { std::slice::from_raw_parts(v.as_ptr() as *const u8, 4 * v.len()) }
}

/// The bytes of an `f32` buffer, writable.
fn bytes_mut(v: &mut [f32]) -> &mut [u8] {
    // SAFETY: as `bytes`; every bit pattern is an `f32`, and the borrow is exclusive.
    unsafe { std::slice::from_raw_parts_mut(v.as_mut_ptr() as *mut u8, 4 * v.len()) }
}

/// Every activation row of `px` against the panel of outputs `r0..r0 + n`, written at
/// `y[t·cout + r0 + j]`: the scalar reference.
///
/// # Safety
/// `y` holds `px.t × cout` values, and no other thread touches columns `r0..r0 + n`.
unsafe fn panel_rows_scalar(m: &DotMatrix, panel: &[u8], px: &PlaneX, r0: usize, n: usize, y: *mut f32) {
    let (cp, nb) = (px.cin_pad, px.nblocks);
    for t in 0..px.t {
        let xr = &px.x[t * 3 * cp..(t + 1) * 3 * cp];
        for j in 0..n {
            let mut acc = 0f32;
            for b in 0..nb {
                let mut a = [0i32; 3];
                for q in b * PBLOCK / 4..((b + 1) * PBLOCK).min(cp) / 4 {
                    for i in 0..4 {
                        let w = panel[64 * q + 4 * j + i] as i32;
                        for (p, ap) in a.iter_mut().enumerate() {
                            *ap = ap.wrapping_add(w * xr[p * cp + 4 * q + i] as i32);
                        }
                    }
                }
                let blk = px.blocks[t * nb + b];
                let v = close(a, blk.corr, blk.s, m.scale[r0 + j]);
                acc = if b == 0 { v } else { acc + v };
            }
            *y.add(t * m.cout + r0 + j) = acc;
        }
    }
}

/// `ys[i] = x Wᵢᵀ` through the byte planes, parallel over panels of [`PANEL`] output rows.
/// False (nothing written) when the activations do not take the byte planes (see
/// [`PlaneX::fill`]).
pub(crate) fn gemm_many_int(simd: bool, ms: &[&DotMatrix], x: &[f32], t: usize, ys: &mut [&mut [f32]]) -> bool {
    let (cin, cin_pad) = (ms[0].cin, ms[0].cin_pad);
    assert!(ms.iter().all(|m| m.cin == cin), "matrices sharing an input have one width");
    for (m, y) in ms.iter().zip(ys.iter()) {
        assert_eq!(y.len(), t * m.cout, "y has {} values, expected {t}×{}", y.len(), m.cout);
    }
    crate::scratch::with_kept(&PX, |px: &mut PlaneX| {
        if !px.fill(simd, x, t, cin, cin_pad) {
            return false;
        }
        let outs: Vec<super::OutPtr> = ys.iter_mut().map(|y| super::OutPtr(y.as_mut_ptr())).collect();
        let tasks: Vec<(usize, usize)> =
            ms.iter().enumerate().flat_map(|(i, m)| (0..m.cout).step_by(PANEL).map(move |r0| (i, r0))).collect();
        let (px, outs, tasks) = (&*px, &outs, &tasks);
        crate::team::parallel_for(tasks.len(), &|k| {
            let (i, r0) = tasks[k];
            let m = ms[i];
            let n = PANEL.min(m.cout - r0);
            crate::scratch::with_kept(&PANELS, |(rows, panel): &mut (Vec<f32>, Vec<f32>)| {
                // 16 rows of cin_pad bytes, and the same bytes regrouped.
                crate::scratch::grow(rows, PANEL * cin_pad / 4);
                crate::scratch::grow(panel, PANEL * cin_pad / 4);
                let (rows, panel) = (&mut rows[..PANEL * cin_pad / 4], &mut panel[..PANEL * cin_pad / 4]);
                m.decode_u8(simd, r0, n, bytes_mut(rows));
                to_panel(rows, cin_pad, panel);
                let panel = bytes(panel);
                #[cfg(target_arch = "x86_64")]
                if simd && super::avx512() {
                    // SAFETY: AVX-512 present; the panel holds cin_pad/4 quads, `px` t rows, and
                    // `outs[i]` t × cout values, of which this task alone writes columns
                    // r0..r0 + n.
                    unsafe {
                        x86::panel_rows(panel.as_ptr(), px, m.scale[r0..].as_ptr(), n, outs[i].0.add(r0), m.cout)
                    };
                    return;
                }
                // SAFETY: `outs[i]` holds t × cout values (asserted above), and this task alone
                // writes columns r0..r0 + n.
                unsafe { panel_rows_scalar(m, panel, px, r0, n, outs[i].0) };
            })
        });
        true
    })
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::super::avx2::{
        nw, tabs, weights_at, INT8X, LUT2S, LUT2X, LUT3S, LUT3X, LUT4S, LUT4X, VEC16S, VEC16X, VEC64S, VEC64X,
    };
    use super::super::Kind;
    use super::{DotMatrix, PlaneX, CHUNK, PANEL, PBLOCK, TILE_T, XMAX1, XMAX2};
    use std::arch::x86_64::*;

    /// # Safety
    /// AVX-512 F/BW/VL/VBMI/VNNI present; index rows `g0..g0 + n_idx` exist, `out` holds
    /// `n_idx · nw · cin_pad` bytes.
    pub(super) unsafe fn decode_u8(m: &DotMatrix, g0: usize, n_idx: usize, out: *mut u8) {
        match m.kind {
            Kind::Lut4 if m.six => decode_u8_k::<LUT4S>(m, g0, n_idx, out),
            Kind::Lut4 => decode_u8_k::<LUT4X>(m, g0, n_idx, out),
            Kind::Lut3 if m.six => decode_u8_k::<LUT3S>(m, g0, n_idx, out),
            Kind::Lut3 => decode_u8_k::<LUT3X>(m, g0, n_idx, out),
            Kind::Lut2 if m.six => decode_u8_k::<LUT2S>(m, g0, n_idx, out),
            Kind::Lut2 => decode_u8_k::<LUT2X>(m, g0, n_idx, out),
            Kind::Vec2x16 if m.six => decode_u8_k::<VEC16S>(m, g0, n_idx, out),
            Kind::Vec2x16 => decode_u8_k::<VEC16X>(m, g0, n_idx, out),
            Kind::Vec2x64 if m.six => decode_u8_k::<VEC64S>(m, g0, n_idx, out),
            Kind::Vec2x64 => decode_u8_k::<VEC64X>(m, g0, n_idx, out),
            Kind::Int8 => decode_u8_k::<INT8X>(m, g0, n_idx, out),
        }
    }

    #[target_feature(enable = "avx2,fma,avx512f,avx512bw,avx512vl,avx512vbmi,avx512vnni")]
    unsafe fn decode_u8_k<const K: u8>(m: &DotMatrix, g0: usize, n_idx: usize, out: *mut u8) {
        let tb = tabs(K, m.tables.as_ptr() as *const i8, true);
        let data = m.data.bytes().as_ptr();
        let nchunks = m.cin_pad / CHUNK;
        for g in 0..n_idx {
            let p = data.add((g0 + g) * m.row_bytes);
            for c in 0..nchunks {
                let w = weights_at::<K>(p, c, nchunks, &tb);
                for (v, wv) in w.iter().enumerate().take(nw(K)) {
                    let dst = out.add((g * nw(K) + v) * m.cin_pad + c * CHUNK);
                    _mm256_storeu_si256(dst as *mut __m256i, *wv);
                }
            }
        }
    }

    /// [`super::quantize_block`] 16 values at a time, the same steps (so the same codes).
    ///
    /// # Safety
    /// AVX-512 F/BW present; `h`, `l`, `q` at least `v.len()` long, equally long.
    #[target_feature(enable = "avx2,avx512f,avx512bw")]
    pub(super) unsafe fn quantize_block(v: &[f32], k: [f32; 3], h: &mut [i8], l: &mut [i8], q: &mut [i8]) -> [i32; 3] {
        let [inv, s1, inv2] = k.map(|c| _mm512_set1_ps(c));
        let (lo1, hi1) = (_mm512_set1_ps(-XMAX1), _mm512_set1_ps(XMAX1));
        let (lo2, hi2) = (_mm512_set1_ps(-XMAX2), _mm512_set1_ps(XMAX2));
        let round = |a: __m512| _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(a);
        let mut sums = [_mm512_setzero_si512(); 3];
        let (n, len) = (v.len(), h.len());
        assert!(l.len() == len && q.len() == len && n <= len);
        for i in (0..len).step_by(16) {
            let m = if i + 16 <= n {
                u16::MAX
            } else if i < n {
                (1u16 << (n - i)) - 1
            } else {
                0
            };
            let xv = _mm512_maskz_loadu_ps(m, v.as_ptr().add(i.min(n)));
            let q1 = _mm512_min_ps(_mm512_max_ps(round(_mm512_mul_ps(xv, inv)), lo1), hi1);
            let r = _mm512_sub_ps(xv, _mm512_mul_ps(q1, s1));
            let q2 = _mm512_min_ps(_mm512_max_ps(round(_mm512_mul_ps(r, inv2)), lo2), hi2);
            let q1 = _mm512_cvtps_epi32(q1);
            let hv = _mm512_srai_epi32::<8>(_mm512_add_epi32(q1, _mm512_set1_epi32(128)));
            let lv = _mm512_sub_epi32(q1, _mm512_slli_epi32::<8>(hv));
            let q2 = _mm512_cvtps_epi32(q2);
            let w = if i + 16 <= len { u16::MAX } else { (1u16 << (len - i)) - 1 };
            for (p, (dst, c)) in [(&mut *h, hv), (&mut *l, lv), (&mut *q, q2)].into_iter().enumerate() {
                _mm512_mask_cvtepi32_storeu_epi8(dst.as_mut_ptr().add(i) as *mut _, w, c);
                sums[p] = _mm512_add_epi32(sums[p], c);
            }
        }
        sums.map(|s| _mm512_reduce_add_epi32(s))
    }

    /// Every activation row of `px` against one panel: outputs `j < n` go to `y[t·stride + j]`.
    ///
    /// # Safety
    /// AVX-512 F/BW/VNNI present; `panel` holds `cin_pad/4` quads, `scale` `n` values, `y` `t`
    /// rows `stride` apart of `n` writable values.
    #[target_feature(enable = "avx2,avx512f,avx512bw,avx512vnni")]
    pub(super) unsafe fn panel_rows(
        panel: *const u8,
        px: &PlaneX,
        scale: *const f32,
        n: usize,
        y: *mut f32,
        stride: usize,
    ) {
        let mask: u16 = if n >= PANEL { u16::MAX } else { (1u16 << n) - 1 };
        let sc = _mm512_maskz_loadu_ps(mask, scale);
        let mut t0 = 0;
        while t0 < px.t {
            let tr = (px.t - t0).min(TILE_T);
            let y0 = y.add(t0 * stride);
            match tr {
                8 => tile::<8>(panel, px, t0, sc, mask, y0, stride),
                7 => tile::<7>(panel, px, t0, sc, mask, y0, stride),
                6 => tile::<6>(panel, px, t0, sc, mask, y0, stride),
                5 => tile::<5>(panel, px, t0, sc, mask, y0, stride),
                4 => tile::<4>(panel, px, t0, sc, mask, y0, stride),
                3 => tile::<3>(panel, px, t0, sc, mask, y0, stride),
                2 => tile::<2>(panel, px, t0, sc, mask, y0, stride),
                _ => tile::<1>(panel, px, t0, sc, mask, y0, stride),
            }
            t0 += tr;
        }
    }

    /// `R` activation rows from `t0`, every block: three `vpdpbusd` per row and quad, each
    /// with a broadcast of the row's four codes of one plane.
    #[inline(always)]
    #[allow(clippy::needless_range_loop)] // indexing keeps the accumulators in registers
    unsafe fn tile<const R: usize>(
        panel: *const u8,
        px: &PlaneX,
        t0: usize,
        sc: __m512,
        mask: u16,
        y: *mut f32,
        stride: usize,
    ) {
        let (cp, nb) = (px.cin_pad, px.nblocks);
        let x = px.x.as_ptr().add(t0 * 3 * cp);
        for b in 0..nb {
            let (q0, q1) = (b * PBLOCK / 4, ((b + 1) * PBLOCK).min(cp) / 4);
            let mut acc = [[_mm512_setzero_si512(); 3]; R];
            for q in q0..q1 {
                let w = _mm512_loadu_si512(panel.add(64 * q) as *const _);
                for r in 0..R {
                    for p in 0..3 {
                        let xb = (x.add(r * 3 * cp + p * cp + 4 * q) as *const i32).read_unaligned();
                        acc[r][p] = _mm512_dpbusd_epi32(acc[r][p], w, _mm512_set1_epi32(xb));
                    }
                }
            }
            // The f32 steps of `super::close`, in its order.
            for r in 0..R {
                let super::Block { s, corr } = px.blocks[(t0 + r) * nb + b];
                let f = |p: usize| _mm512_cvtepi32_ps(_mm512_sub_epi32(acc[r][p], _mm512_set1_epi32(corr[p])));
                let m = |p: usize| _mm512_mul_ps(f(p), _mm512_set1_ps(s[p]));
                let v = _mm512_mul_ps(_mm512_add_ps(_mm512_add_ps(m(0), m(1)), m(2)), sc);
                let dst = y.add(r * stride);
                let v = if b == 0 { v } else { _mm512_add_ps(_mm512_maskz_loadu_ps(mask, dst), v) };
                _mm512_mask_storeu_ps(dst, mask, v);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn close_follows_the_documented_order() {
        // 3·2 + 5·1 + 7·0.5 = 14.5, times 2; the corrections come off first.
        assert_eq!(close([4, 6, 9], [1, 1, 2], [2.0, 1.0, 0.5], 2.0), 29.0);
    }
}
