//! Integer-dot kernels: codebooks as 8-bit integers looked up with `pshufb`, activations as
//! 16-bit integers, products summed with `pmaddwd` into 32-bit integers.
//!
//! A LUT codebook qualifies when it is `f · q` with `f` a power of two and `q` 8-bit integers
//! (the quantizer snaps its codebooks to that grid; see `forge_quant::fit::snap_codebook`). Then
//! a weight is exactly `scale[row] · f · q[idx]`, and the kernel's only approximation is the
//! activation: each block of [`XBLOCK`] inputs of a row is written as two 16-bit planes with
//! their own scales (see [`QuantX`]; ~2⁻³¹ of the block's largest magnitude), so an outlier only
//! coarsens its own block. Integer sums are exact (a block cannot overflow 32 bits); the
//! per-block sums are combined in f32.
//!
//! # Layout
//! An index row (one output row, or a row pair for the vector formats, whose index covers both)
//! is stored as chunks of [`CHUNK`] = 32 input columns, column `j0 + m` being byte `m` of the
//! decoded 32-byte vector:
//! - lut4, vec2x16: 16 bytes, byte `b` = index of `m = b` (low nibble) and `m = 16 + b` (high).
//! - vec2x64: those 16 bytes for the low 4 index bits, then 8 bytes for the top 2 bits: bits
//!   `2q, 2q+1` of byte `r` belong to `m = 8q + r` (a broadcast and a 64-bit variable shift put
//!   them in place).
//! - int8: the 32 weights.
//!
//! The 64-entry vec2x64 tables use four 16-entry `pshufb` lookups summed with wrapping byte
//! adds: table `k` holds `T_k − T_{k−1}` and is indexed with `i − 16k`, whose sign bit zeroes
//! the lookup for indices below `16k`, so the sum telescopes to `T_{i/16}[i mod 16]`.
//! Rows past the input width are padded with index 0 against zero activations.

use crate::lut::{Format, Int8Matrix, LutMatrix};
use rayon::prelude::*;

/// Input columns per chunk.
pub const CHUNK: usize = 32;
/// Input columns sharing one activation scale (per plane: `|q| ≤ 32767`, `|w| ≤ 128`, so a
/// 32-bit lane collects at most `XBLOCK / 8 · 128 · 32767 < 2³¹`).
pub const XBLOCK: usize = 1024;
/// Activation rows per kernel pass at most (more rows are processed in passes over an index row
/// that stays in L1).
pub const PASS_T: usize = 4;
static PLANES: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(2);

/// Activation planes for the integer kernels from now on: 2 (default; the fast path equals the
/// f32 reference to ~1e-7 relative) or 1 (one 16-bit plane, ~1.3–1.8× faster kernels; on
/// SmolLM2 the logits move by up to ~2e-3). Process-wide, like llama.cpp's activation type.
pub fn set_activation_planes(n: usize) {
    assert!(n == 1 || n == 2, "1 or 2 activation planes");
    PLANES.store(n, std::sync::atomic::Ordering::Relaxed)
}

/// Largest 16-bit activation magnitude.
const XMAX: f32 = 32767.0;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    Lut4,
    Vec2x16,
    Vec2x64,
    Int8,
}

impl Kind {
    /// The integer-dot kind of a format, if it has one.
    fn of(format: Format) -> Option<Kind> {
        match format {
            Format::Lut4 => Some(Kind::Lut4),
            Format::Vec2x16 => Some(Kind::Vec2x16),
            Format::Vec2x64 => Some(Kind::Vec2x64),
            Format::Int8 => Some(Kind::Int8),
            _ => None,
        }
    }

    fn name(self) -> &'static str {
        match self {
            Kind::Lut4 => "lut4",
            Kind::Vec2x16 => "vec2x16",
            Kind::Vec2x64 => "vec2x64",
            Kind::Int8 => "int8",
        }
    }

    fn parse(s: &str) -> anyhow::Result<Kind> {
        [Kind::Lut4, Kind::Vec2x16, Kind::Vec2x64, Kind::Int8]
            .into_iter()
            .find(|k| k.name() == s)
            .ok_or_else(|| anyhow::anyhow!("unknown integer-dot layout '{s}'"))
    }

    fn n_tables(self) -> usize {
        match self {
            Kind::Lut4 => 1,
            Kind::Vec2x16 => 2,
            Kind::Vec2x64 => 8,
            Kind::Int8 => 0,
        }
    }

    fn chunk_bytes(self) -> usize {
        match self {
            Kind::Lut4 | Kind::Vec2x16 => 16,
            Kind::Vec2x64 => 24,
            Kind::Int8 => 32,
        }
    }

    /// Activation rows per pass: the vector formats keep twice the accumulators per row.
    fn pass_t(self) -> usize {
        PASS_T / self.rows()
    }

    /// Output rows per index row.
    fn rows(self) -> usize {
        match self {
            Kind::Vec2x16 | Kind::Vec2x64 => 2,
            _ => 1,
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
/// `q₁` and `q₂` quantizing the residual `x − s₁·q₁` (so about 31 bits in all: the kernels agree
/// with f32 arithmetic to ~1e-7 relative instead of 16-bit activations' ~1e-5).
pub struct QuantX {
    pub t: usize,
    /// 2 (default), or 1 after [`set_activation_planes`]`(1)`: `q₂` stays zero and the kernels
    /// skip it.
    pub planes: usize,
    /// Input width rounded up to a whole chunk.
    pub cin_pad: usize,
    pub nblocks: usize,
    /// `t × 2·cin_pad`: per chunk, the 32 `q₁` then the 32 `q₂`, each in [`xpos`] order, zero
    /// past the input width.
    pub q: Vec<i16>,
    /// `t × nblocks × 2`: `(s₁, s₂)` per block.
    pub scale: Vec<f32>,
}

/// Round to nearest, ties to even, for `|v| < 2²²` (adding 1.5·2²³ leaves no fraction bits;
/// plain float ops, unlike `f32::round`'s libm call).
#[inline(always)]
fn round_small(v: f32) -> f32 {
    const M: f32 = 12_582_912.0;
    (v + M) - M
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
/// order: columns 0–7 and 24–31 stay, 8–15 and 16–23 swap.
#[inline(always)]
fn quantize_chunk(v: &[f32], inv: f32, out: &mut [i16], codes: &mut [f32; CHUNK]) {
    let mut buf = [0f32; CHUNK];
    buf[..v.len()].copy_from_slice(v);
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
}

impl QuantX {
    /// Quantize `t` rows of `cin` values.
    pub fn new(x: &[f32], t: usize, cin: usize) -> QuantX {
        Self::with_planes(x, t, cin, PLANES.load(std::sync::atomic::Ordering::Relaxed))
    }

    /// Quantize with 1 or 2 planes whatever the process-wide setting.
    pub fn with_planes(x: &[f32], t: usize, cin: usize, planes: usize) -> QuantX {
        assert!(planes == 1 || planes == 2, "1 or 2 activation planes");
        let cin_pad = cin.div_ceil(CHUNK) * CHUNK;
        let nblocks = cin_pad.div_ceil(XBLOCK);
        let mut q = vec![0i16; t * 2 * cin_pad];
        let mut scale = vec![0f32; t * nblocks * 2];
        let mut resid = [0f32; XBLOCK];
        let mut codes = [0f32; CHUNK];
        for r in 0..t {
            let xr = &x[r * cin..(r + 1) * cin];
            let qr = &mut q[r * 2 * cin_pad..(r + 1) * 2 * cin_pad];
            for b in 0..nblocks {
                let (j0, j1) = (b * XBLOCK, ((b + 1) * XBLOCK).min(cin));
                if j0 >= j1 {
                    continue;
                }
                let xb = &xr[j0..j1];
                let sc = &mut scale[(r * nblocks + b) * 2..][..2];
                let (m, finite) = absmax_finite(xb);
                if m == 0.0 || !finite {
                    // A zero block; or a non-finite input, which the scale propagates as NaN.
                    sc[0] = if finite { 0.0 } else { f32::NAN };
                    continue;
                }
                let (s1, inv1) = (m / XMAX, XMAX / m);
                // Blocks start on chunk boundaries (XBLOCK is a multiple of CHUNK).
                for (c, xc) in xb.chunks(CHUNK).enumerate() {
                    let out = &mut qr[(j0 / CHUNK + c) * 2 * CHUNK..][..CHUNK];
                    quantize_chunk(xc, inv1, out, &mut codes);
                    for (k, &v) in xc.iter().enumerate() {
                        resid[c * CHUNK + k] = v - codes[k] * s1;
                    }
                }
                sc[0] = s1;
                if planes == 1 {
                    continue;
                }
                let res = &resid[..xb.len()];
                let (m2, _) = absmax_finite(res);
                if m2 > 0.0 {
                    let inv2 = XMAX / m2;
                    sc[1] = m2 / XMAX;
                    for (c, rc) in res.chunks(CHUNK).enumerate() {
                        let out = &mut qr[(j0 / CHUNK + c) * 2 * CHUNK + CHUNK..][..CHUNK];
                        quantize_chunk(rc, inv2, out, &mut codes);
                    }
                }
            }
        }
        QuantX { t, planes, cin_pad, nblocks, q, scale }
    }
}

/// `ys[i] = x Wᵢᵀ` for matrices sharing one input (e.g. q/k/v, gate/up), `x` quantized once,
/// all rows of all matrices in one parallel dispatch.
pub fn matmul_many(simd: bool, ms: &[&DotMatrix], qx: &QuantX, ys: &mut [&mut [f32]]) {
    assert_eq!(ms.len(), ys.len());
    for (m, y) in ms.iter().zip(ys.iter()) {
        assert_eq!(m.cin_pad, qx.cin_pad, "input width {} does not match the quantized activations", m.cin);
        assert_eq!(y.len(), qx.t * m.cout, "y has {} values, expected {}×{}", y.len(), qx.t, m.cout);
    }
    let simd = simd && crate::simd::has_avx2_fma();
    let outs: Vec<OutPtr> = ys.iter_mut().map(|y| OutPtr(y.as_mut_ptr())).collect();
    let threads = rayon::current_num_threads();
    let work: usize = ms.iter().map(|m| m.groups * m.row_bytes * qx.t.div_ceil(m.kind.pass_t())).sum();
    if threads == 1 || work < 48 * 1024 {
        for (m, &y) in ms.iter().zip(&outs) {
            // SAFETY: `y` holds `t × cout` values, and this is the only writer.
            unsafe { m.rows(simd, 0, m.groups, qx, y) }
        }
        return;
    }
    // Tasks of about equal work: `threads · 2` of them over the rows of all matrices.
    let per = work.div_ceil(threads * 2).max(1);
    let mut tasks = Vec::new();
    for (i, m) in ms.iter().enumerate() {
        let row_work = (m.row_bytes * qx.t.div_ceil(m.kind.pass_t())).max(1);
        let rows = per.div_ceil(row_work).max(1);
        for g0 in (0..m.groups).step_by(rows) {
            tasks.push((i, g0, rows.min(m.groups - g0)));
        }
    }
    tasks.into_par_iter().for_each(|(i, g0, n)| {
        // SAFETY: as above; each task writes only the output rows of its own index rows.
        unsafe { ms[i].rows(simd, g0, n, qx, outs[i]) }
    });
}

/// Kind and shape of a packed matrix, as a compiled cache records them.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DotLayout {
    /// `lut4`, `vec2x16`, `vec2x64` or `int8`.
    pub kind: String,
    pub cout: usize,
    pub cin: usize,
}

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
    /// Pack a LUT matrix whose codebook is 8-bit integers times a power of two (None otherwise,
    /// or for lut2/lut3, which keep the float tile kernels).
    pub fn from_lut(m: &LutMatrix) -> Option<DotMatrix> {
        let kind = Kind::of(m.format).filter(|&k| k != Kind::Int8)?;
        let (f, q) = int8_codebook(&m.codebook)?;
        let d = m.format.vec_dim();
        let comp = |c: usize, k0: usize| -> [i8; 16] { std::array::from_fn(|i| q[(k0 + i) * d + c]) };
        let tables = match kind {
            Kind::Lut4 => vec![comp(0, 0)],
            Kind::Vec2x16 => vec![comp(0, 0), comp(1, 0)],
            _ => (0..2)
                .flat_map(|c| {
                    (0..4).map(move |k| {
                        let cur = comp(c, 16 * k);
                        if k == 0 {
                            cur
                        } else {
                            let prev = comp(c, 16 * (k - 1));
                            std::array::from_fn(|i| cur[i].wrapping_sub(prev[i]))
                        }
                    })
                })
                .collect(),
        };
        let scale = m.scale.iter().map(|&s| s * f).collect();
        let (idx, cin) = (&m.idx, m.cin);
        Some(Self::build(kind, m.cout, cin, tables, scale, |g, j| idx[g * cin + j]))
    }

    /// Pack an INT8 matrix.
    pub fn from_int8(m: &Int8Matrix) -> DotMatrix {
        let (q, cin) = (&m.q, m.cin);
        Self::build(Kind::Int8, m.cout, cin, Vec::new(), m.scale.clone(), |g, j| q[g * cin + j] as u8)
    }

    fn build(
        kind: Kind,
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
        // 8 bytes of slack: the vec2x64 kernel reads its high bits with an 8-byte load.
        let mut data = vec![0u8; groups * row_bytes + 8];
        if row_bytes > 0 {
            data[..groups * row_bytes].par_chunks_mut(row_bytes).enumerate().for_each(|(g, row)| {
                let at = |j: usize| if j < cin { get(g, j) } else { 0 };
                for (c, out) in row.chunks_mut(cb).enumerate() {
                    let j0 = c * CHUNK;
                    match kind {
                        Kind::Int8 => (0..32).for_each(|m| out[m] = at(j0 + m)),
                        _ => {
                            for (b, o) in out[..16].iter_mut().enumerate() {
                                *o = (at(j0 + b) & 15) | (at(j0 + 16 + b) & 15) << 4;
                            }
                            if kind == Kind::Vec2x64 {
                                for m in 0..32 {
                                    out[16 + m % 8] |= (at(j0 + m) >> 4) << (2 * (m / 8));
                                }
                            }
                        }
                    }
                }
            });
        }
        DotMatrix { cout, cin, kind, cin_pad, groups, row_bytes, data: Blob::Owned(data), tables, scale }
    }

    /// The packed form as stored in a compiled cache: `(layout, data, tables, scales)` with the
    /// layout naming the kind and shape.
    pub fn parts(&self) -> (DotLayout, &[u8], Vec<i8>, &[f32]) {
        let layout = DotLayout { kind: self.kind.name().to_string(), cout: self.cout, cin: self.cin };
        (layout, self.data.bytes(), self.tables.iter().flatten().copied().collect(), &self.scale)
    }

    /// Byte sizes of `(data, tables, scales)` for a layout (what [`DotMatrix::parts`] returns).
    pub fn sizes(layout: &DotLayout) -> anyhow::Result<(usize, usize, usize)> {
        let kind = Kind::parse(&layout.kind)?;
        let cin_pad = layout.cin.div_ceil(CHUNK) * CHUNK;
        let data = layout.cout / kind.rows() * (cin_pad / CHUNK * kind.chunk_bytes()) + 8;
        Ok((data, 16 * kind.n_tables(), 4 * layout.cout))
    }

    /// The layout a LUT matrix of this format and codebook packs to, if it takes the
    /// integer-dot kernels (see [`DotMatrix::from_lut`]).
    pub fn layout_for(format: Format, codebook: &[f32], cout: usize, cin: usize) -> Option<DotLayout> {
        let kind = Kind::of(format)?;
        if kind != Kind::Int8 {
            int8_codebook(codebook)?;
        }
        Some(DotLayout { kind: kind.name().into(), cout, cin })
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
        let want = groups * row_bytes + 8;
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
        Ok(DotMatrix { cout, cin, kind, cin_pad, groups, row_bytes, data, tables, scale })
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
        let qx = QuantX::new(x, t, self.cin);
        matmul_many(simd, &[self], &qx, &mut [y]);
    }

    /// Scaled outputs of index rows `g0..g0+n` for every activation row, written to
    /// `y[t·cout + row]`.
    ///
    /// # Safety
    /// `y` must point to `qx.t × cout` values that no one else writes in these rows.
    unsafe fn rows(&self, simd: bool, g0: usize, n: usize, qx: &QuantX, y: OutPtr) {
        let nr = self.kind.rows();
        let pass = self.kind.pass_t();
        let mut tmp = [0f32; 2 * PASS_T];
        for t0 in (0..qx.t).step_by(pass) {
            let tc = pass.min(qx.t - t0);
            let xq = &qx.q[t0 * 2 * qx.cin_pad..(t0 + tc) * 2 * qx.cin_pad];
            let xs = &qx.scale[t0 * 2 * qx.nblocks..(t0 + tc) * 2 * qx.nblocks];
            let out = y.0.add(t0 * self.cout);
            if simd {
                #[cfg(target_arch = "x86_64")]
                {
                    let a = avx2::Args {
                        tables: self.tables.as_ptr() as *const i8,
                        row: self.data.bytes()[g0 * self.row_bytes..].as_ptr(),
                        row_bytes: self.row_bytes,
                        n_rows: n,
                        nchunks: self.cin_pad / CHUNK,
                        cin_pad: self.cin_pad,
                        xq: xq.as_ptr(),
                        xs: xs.as_ptr(),
                        nblocks: qx.nblocks,
                        scale: self.scale[g0 * nr..].as_ptr(),
                        out: out.add(g0 * nr),
                        out_t_stride: self.cout,
                    };
                    // SAFETY: AVX2 was detected by the caller; the index rows g0..g0+n lie in
                    // `data` (plus the 8 bytes of slack the vec2x64 load may touch), `xq` holds
                    // `tc · 2 · cin_pad` values, `xs` `tc · 2 · nblocks`, the tables what the
                    // kind reads, and `out` the rows g0·nr.. of `tc` output rows (caller).
                    avx2::rows(self.kind, tc, qx.planes, &a);
                }
                #[cfg(not(target_arch = "x86_64"))]
                unreachable!("no SIMD backend on this architecture");
            } else {
                for g in g0..g0 + n {
                    let row = &self.data.bytes()[g * self.row_bytes..];
                    self.group_scalar(row, xq, xs, qx.nblocks, tc, &mut tmp);
                    for tt in 0..tc {
                        for v in 0..nr {
                            *out.add(tt * self.cout + g * nr + v) = tmp[tt * nr + v] * self.scale[g * nr + v];
                        }
                    }
                }
            }
        }
    }

    /// The 32 weights of chunk `c` (codebook integers), in column order.
    fn chunk_weights(&self, row: &[u8], c: usize) -> [[i8; 32]; 2] {
        let cb = self.kind.chunk_bytes();
        let p = &row[c * cb..(c + 1) * cb];
        let idx = |m: usize| -> usize {
            let lo = if m < 16 { p[m] & 15 } else { p[m - 16] >> 4 };
            let hi = if self.kind == Kind::Vec2x64 { (p[16 + m % 8] >> (2 * (m / 8))) & 3 } else { 0 };
            (lo | hi << 4) as usize
        };
        let mut w = [[0i8; 32]; 2];
        for m in 0..32 {
            match self.kind {
                Kind::Int8 => w[0][m] = p[m] as i8,
                Kind::Lut4 => w[0][m] = self.tables[0][idx(m)],
                Kind::Vec2x16 => {
                    w[0][m] = self.tables[0][idx(m)];
                    w[1][m] = self.tables[1][idx(m)];
                }
                Kind::Vec2x64 => {
                    let i = idx(m);
                    for (v, wv) in w.iter_mut().enumerate() {
                        // Sum the difference tables up to block i/16.
                        let t = &self.tables[4 * v..4 * v + 4];
                        wv[m] = (0..=i / 16).fold(0i8, |a, k| a.wrapping_add(t[k][i % 16]));
                    }
                }
            }
        }
        w
    }

    /// Reference on the same packed data: exact integer block sums per activation plane,
    /// combined in f32.
    fn group_scalar(&self, row: &[u8], xq: &[i16], xs: &[f32], nblocks: usize, tc: usize, out: &mut [f32]) {
        let nr = self.kind.rows();
        let nchunks = self.cin_pad / CHUNK;
        out[..tc * nr].fill(0.0);
        for b in 0..nblocks {
            let mut acc = [[[0i64; 2]; 2]; PASS_T];
            for c in b * XBLOCK / CHUNK..((b + 1) * XBLOCK / CHUNK).min(nchunks) {
                let w = self.chunk_weights(row, c);
                for (t, a) in acc.iter_mut().enumerate().take(tc) {
                    let x = &xq[t * 2 * self.cin_pad + c * 2 * CHUNK..][..2 * CHUNK];
                    for (v, av) in a.iter_mut().enumerate().take(nr) {
                        for (plane, ap) in av.iter_mut().enumerate() {
                            let xp = &x[plane * CHUNK..];
                            *ap += w[v].iter().enumerate().map(|(m, &wm)| wm as i64 * xp[xpos(m)] as i64).sum::<i64>();
                        }
                    }
                }
            }
            for (t, a) in acc.iter().enumerate().take(tc) {
                let sc = &xs[(t * nblocks + b) * 2..][..2];
                for v in 0..nr {
                    out[t * nr + v] += sc[0] * a[v][0] as f32 + sc[1] * a[v][1] as f32;
                }
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use super::{Kind, CHUNK, XBLOCK};
    use std::arch::x86_64::*;

    /// # Safety
    /// AVX2 must be available and `a` describe valid buffers (see `DotMatrix::rows`).
    pub(super) unsafe fn rows(kind: Kind, tc: usize, planes: usize, a: &Args) {
        macro_rules! by_t {
            ($f:ident) => {
                match (tc, planes) {
                    (1, 2) => $f::<1, 2>(a),
                    (2, 2) => $f::<2, 2>(a),
                    (3, 2) => $f::<3, 2>(a),
                    (4, 2) => $f::<4, 2>(a),
                    (1, 1) => $f::<1, 1>(a),
                    (2, 1) => $f::<2, 1>(a),
                    (3, 1) => $f::<3, 1>(a),
                    (4, 1) => $f::<4, 1>(a),
                    _ => unreachable!("integer kernels take 1..=4 rows and 1 or 2 planes"),
                }
            };
        }
        match kind {
            Kind::Lut4 => by_t!(lut4),
            Kind::Vec2x16 => by_t!(vec2x16),
            Kind::Vec2x64 => by_t!(vec2x64),
            Kind::Int8 => by_t!(int8),
        }
    }

    /// One kernel call: `n_rows` index rows from `row` (`row_bytes` apart), `T` activation rows.
    pub(super) struct Args {
        pub tables: *const i8,
        pub row: *const u8,
        pub row_bytes: usize,
        pub n_rows: usize,
        pub nchunks: usize,
        pub cin_pad: usize,
        pub xq: *const i16,
        pub xs: *const f32,
        pub nblocks: usize,
        /// Scales of the output rows of the first index row on.
        pub scale: *const f32,
        /// Output of the first index row's first output row; activation rows `out_t_stride` apart.
        pub out: *mut f32,
        pub out_t_stride: usize,
    }

    #[inline(always)]
    unsafe fn hsum(v: __m256) -> f32 {
        let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)))
    }

    /// The shared loop: `$decode` turns the chunk at byte pointer `$p` into `NW` vectors of 32
    /// signed weights; each is sign-extended to two 16-lane halves and multiplied with both
    /// activation planes of every row; block sums are scaled into f32 accumulators.
    macro_rules! dot_loop {
        ($nw:literal, $t:ident, $planes:ident, $a:expr, $cb:expr, |$p:ident| $decode:block) => {{
            let a: &Args = $a;
            let zero = _mm256_setzero_si256();
            let per_block = XBLOCK / CHUNK;
            for r in 0..a.n_rows {
                let row = a.row.add(r * a.row_bytes);
                let mut accf = [[_mm256_setzero_ps(); $nw]; $t];
                let mut c = 0usize;
                for b in 0..a.nblocks {
                    let cend = (c + per_block).min(a.nchunks);
                    let mut acc1 = [[zero; $nw]; $t];
                    let mut acc2 = [[zero; $nw]; $t];
                    while c < cend {
                        let $p = row.add(c * $cb);
                        let w: [__m256i; $nw] = $decode;
                        for v in 0..$nw {
                            let s = _mm256_cmpgt_epi8(zero, w[v]);
                            let lo = _mm256_unpacklo_epi8(w[v], s);
                            let hi = _mm256_unpackhi_epi8(w[v], s);
                            for t in 0..$t {
                                let xp = a.xq.add(t * 2 * a.cin_pad + c * 2 * CHUNK) as *const __m256i;
                                let p0 = _mm256_madd_epi16(lo, _mm256_loadu_si256(xp));
                                let p1 = _mm256_madd_epi16(hi, _mm256_loadu_si256(xp.add(1)));
                                acc1[t][v] = _mm256_add_epi32(acc1[t][v], _mm256_add_epi32(p0, p1));
                                let r0 = _mm256_madd_epi16(lo, _mm256_loadu_si256(xp.add(2)));
                                let r1 = _mm256_madd_epi16(hi, _mm256_loadu_si256(xp.add(3)));
                                acc2[t][v] = _mm256_add_epi32(acc2[t][v], _mm256_add_epi32(r0, r1));
                            }
                        }
                        c += 1;
                    }
                    for t in 0..$t {
                        let s1 = _mm256_set1_ps(*a.xs.add((t * a.nblocks + b) * 2));
                        let s2 = _mm256_set1_ps(*a.xs.add((t * a.nblocks + b) * 2 + 1));
                        for v in 0..$nw {
                            let f = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc1[t][v]), s1, accf[t][v]);
                            accf[t][v] =
                                if $planes == 2 { _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc2[t][v]), s2, f) } else { f };
                        }
                    }
                }
                for t in 0..$t {
                    for v in 0..$nw {
                        let o = r * $nw + v;
                        *a.out.add(t * a.out_t_stride + o) = hsum(accf[t][v]) * *a.scale.add(o);
                    }
                }
            }
        }};
    }

    /// Low nibbles then high nibbles of 16 bytes: the 32 4-bit indices in column order.
    #[inline(always)]
    unsafe fn nibbles(p: *const u8) -> __m256i {
        let v = _mm_loadu_si128(p as *const __m128i);
        _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16::<4>(v), v), _mm256_set1_epi8(15))
    }

    #[inline(always)]
    unsafe fn table(t: *const i8) -> __m256i {
        _mm256_broadcastsi128_si256(_mm_loadu_si128(t as *const __m128i))
    }

    #[target_feature(enable = "avx2,fma")]
    unsafe fn lut4<const T: usize, const P: usize>(a: &Args) {
        let tab = table(a.tables);
        dot_loop!(1, T, P, a, 16, |p| { [_mm256_shuffle_epi8(tab, nibbles(p))] })
    }

    #[target_feature(enable = "avx2,fma")]
    unsafe fn vec2x16<const T: usize, const P: usize>(a: &Args) {
        let (t0, t1) = (table(a.tables), table(a.tables.add(16)));
        dot_loop!(2, T, P, a, 16, |p| {
            let i = nibbles(p);
            [_mm256_shuffle_epi8(t0, i), _mm256_shuffle_epi8(t1, i)]
        })
    }

    #[target_feature(enable = "avx2,fma")]
    unsafe fn vec2x64<const T: usize, const P: usize>(a: &Args) {
        let d: [__m256i; 8] = std::array::from_fn(|k| table(a.tables.add(16 * k)));
        let shifts = _mm256_setr_epi64x(0, 2, 4, 6);
        let (three, s16, s32, s48) =
            (_mm256_set1_epi8(3), _mm256_set1_epi8(16), _mm256_set1_epi8(32), _mm256_set1_epi8(48));
        dot_loop!(2, T, P, a, 24, |p| {
            let hi = _mm256_set1_epi64x((p.add(16) as *const i64).read_unaligned());
            let hi = _mm256_and_si256(_mm256_srlv_epi64(hi, shifts), three);
            let i0 = _mm256_or_si256(nibbles(p), _mm256_slli_epi16::<4>(hi));
            let (i1, i2, i3) = (_mm256_sub_epi8(i0, s16), _mm256_sub_epi8(i0, s32), _mm256_sub_epi8(i0, s48));
            [look64(&d[..4], i0, i1, i2, i3), look64(&d[4..], i0, i1, i2, i3)]
        })
    }

    /// Sum of the four difference-table lookups (see the module docs).
    #[inline(always)]
    unsafe fn look64(d: &[__m256i], i0: __m256i, i1: __m256i, i2: __m256i, i3: __m256i) -> __m256i {
        let s01 = _mm256_add_epi8(_mm256_shuffle_epi8(d[0], i0), _mm256_shuffle_epi8(d[1], i1));
        let s23 = _mm256_add_epi8(_mm256_shuffle_epi8(d[2], i2), _mm256_shuffle_epi8(d[3], i3));
        _mm256_add_epi8(s01, s23)
    }

    #[target_feature(enable = "avx2,fma")]
    unsafe fn int8<const T: usize, const P: usize>(a: &Args) {
        dot_loop!(1, T, P, a, 32, |p| { [_mm256_loadu_si256(p as *const __m256i)] })
    }
}
