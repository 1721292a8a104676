//! Packed LUT/INT8 matrices and their fast `y = x Wᵀ` kernels for few input rows (decode T = 1,
//! verify T = 2–8; more rows are processed in chunks of 8).
//!
//! # Layout
//! Output rows are grouped in tiles of 8 *lanes*: a lane is one output row for the scalar formats
//! (lut2/lut3/lut4, int8) and one row pair `(2g, 2g+1)` for the vector formats (vec2x16,
//! vec2x64), so a tile covers 8 or 16 rows. A tile stores, for every input column `j`, the 8 lanes'
//! indices bit-packed into `b` bytes (`b` = bits per index: 2, 3, 4, 4, 6, 8), lane `k` at bits
//! `[k·b, k·b + b)` of the little-endian word: one small load per column gives the 8 indices.
//! Tiles are contiguous (`cin · b` bytes each), followed by 8 bytes of padding so that every
//! column can be read with one unaligned 8-byte load. Rows past `cout` are padded with index 0
//! and scale 0.
//!
//! # Kernels
//! Per tile and column the 8 indices are expanded to 32-bit lanes (broadcast + variable shift),
//! looked up in the codebook held in registers (`vpermps` on 8-entry halves, blended for 16
//! entries; a 64-bit gather for vec2x64; sign extension for int8), and FMA'd with the broadcast
//! input `x[t, j]` for each of the `T` rows: each weight byte is read once per call. The per-row
//! scale is applied once per output at the end. Tiles are spread over rayon threads.
//! `Backend::Scalar` is the portable reference on the same packed data; tests check it equals
//! dequantize-then-matmul, and the AVX2 kernels equal it.

pub mod dense;
mod int8;
pub mod intdot;
mod lut;
#[cfg(target_arch = "aarch64")]
mod tile_neon;
mod vec2;

use crate::lut::{Format, Int8Matrix, LutMatrix};
use rayon::prelude::*;
use std::sync::atomic::{AtomicBool, Ordering};

static FAST_PATH: AtomicBool = AtomicBool::new(true);

/// Whether model code should use the packed/half kernels (default) or the reference
/// decode-to-f32 path (`forge bench --reference`, to compare the kernels against).
pub fn fast_path() -> bool {
    FAST_PATH.load(Ordering::Relaxed)
}

/// Switch between the fast kernels and the reference path process-wide.
pub fn set_fast_path(on: bool) {
    FAST_PATH.store(on, Ordering::Relaxed)
}

static INT_DOT: AtomicBool = AtomicBool::new(true);

/// Whether matrices packed from now on may use the integer-dot layout (default) or always the
/// float tile layout (tests and comparisons).
pub fn set_int_dot(on: bool) {
    INT_DOT.store(on, Ordering::Relaxed)
}

/// Lanes per tile.
pub const LANES: usize = 8;
/// Input rows handled by one kernel call (larger `t` is processed in chunks).
pub const MAX_T: usize = 8;
/// Bytes of padding after the packed data (one unaligned 8-byte load past the last column).
const PAD: usize = 8;

/// Which implementation runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Backend {
    /// Portable reference on the packed layout.
    Scalar,
    /// AVX2 + FMA (x86-64, detected at run time; AVX-512 variants where present).
    Avx2,
    /// NEON (aarch64).
    Neon,
}

impl Backend {
    /// The fastest backend this CPU supports.
    pub fn best() -> Backend {
        if cfg!(target_arch = "aarch64") {
            Backend::Neon
        } else if crate::simd::has_avx2_fma() {
            Backend::Avx2
        } else {
            Backend::Scalar
        }
    }

    /// Whether this backend runs here: a SIMD backend of another architecture, or AVX2 on a
    /// CPU without it, falls back to the scalar reference.
    pub fn available(self) -> bool {
        match self {
            Backend::Scalar => true,
            Backend::Avx2 => crate::simd::has_avx2_fma(),
            Backend::Neon => cfg!(target_arch = "aarch64"),
        }
    }

    /// This backend if it runs here, else the scalar reference.
    fn here(self) -> Backend {
        if self.available() {
            self
        } else {
            Backend::Scalar
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    /// Scalar LUT with `bits`-bit indices (2, 3, 4).
    Lut(u32),
    Vec2x16,
    Vec2x64,
    Int8,
}

/// A LUT or INT8 matrix repacked for the kernels: the integer-dot layout where the codebook
/// allows it (see [`intdot`]), else the float tile layout.
#[derive(Clone, Debug)]
pub struct PackedMatrix {
    pub format: Format,
    pub cout: usize,
    pub cin: usize,
    imp: Imp,
}

#[derive(Clone, Debug)]
enum Imp {
    Dot(intdot::DotMatrix),
    Tiles(TileMatrix),
}

impl PackedMatrix {
    /// Repack a LUT matrix (must be valid: see [`LutMatrix::validate`]).
    pub fn from_lut(m: &LutMatrix) -> PackedMatrix {
        let dot = if INT_DOT.load(Ordering::Relaxed) { intdot::DotMatrix::from_lut(m) } else { None };
        let imp = match dot {
            Some(d) => Imp::Dot(d),
            None => Imp::Tiles(TileMatrix::from_lut(m)),
        };
        PackedMatrix { format: m.format, cout: m.cout, cin: m.cin, imp }
    }

    /// Repack an INT8 matrix.
    pub fn from_int8(m: &Int8Matrix) -> PackedMatrix {
        if !INT_DOT.load(Ordering::Relaxed) {
            return Self::tiles_from_int8(m);
        }
        PackedMatrix { format: Format::Int8, cout: m.cout, cin: m.cin, imp: Imp::Dot(intdot::DotMatrix::from_int8(m)) }
    }

    /// The float tile layout even where the integer-dot one applies (benchmarks, tests).
    pub fn tiles_from_lut(m: &LutMatrix) -> PackedMatrix {
        PackedMatrix { format: m.format, cout: m.cout, cin: m.cin, imp: Imp::Tiles(TileMatrix::from_lut(m)) }
    }

    /// The float tile layout of an INT8 matrix.
    pub fn tiles_from_int8(m: &Int8Matrix) -> PackedMatrix {
        PackedMatrix { format: Format::Int8, cout: m.cout, cin: m.cin, imp: Imp::Tiles(TileMatrix::from_int8(m)) }
    }

    /// A matrix rebuilt from a compiled cache (see [`intdot::DotMatrix::from_parts`]).
    pub fn from_dot(format: Format, d: intdot::DotMatrix) -> PackedMatrix {
        PackedMatrix { format, cout: d.cout, cin: d.cin, imp: Imp::Dot(d) }
    }

    /// The integer-dot form, if this matrix has one (what a compiled cache stores).
    pub fn as_dot(&self) -> Option<&intdot::DotMatrix> {
        match &self.imp {
            Imp::Dot(d) => Some(d),
            Imp::Tiles(_) => None,
        }
    }

    /// Whether the integer-dot kernels run this matrix.
    pub fn is_int_dot(&self) -> bool {
        matches!(self.imp, Imp::Dot(_))
    }

    /// The packed index rows of an integer-dot matrix, as its kernels read them (where they
    /// lie: a memory-mapped cache, or memory of this process).
    pub fn index_bytes(&self) -> Option<&[u8]> {
        self.as_dot().map(|d| d.index_bytes())
    }

    /// Bytes the kernels read per call (indices, scales, codebook).
    pub fn packed_bytes(&self) -> usize {
        match &self.imp {
            Imp::Dot(d) => d.packed_bytes(),
            Imp::Tiles(t) => t.packed_bytes(),
        }
    }

    /// `y = x Wᵀ` (`x`: `t × cin`, `y`: `t × cout`) with the fastest backend.
    pub fn matmul(&self, x: &[f32], t: usize, y: &mut [f32]) {
        self.matmul_with(Backend::best(), x, t, y)
    }

    /// `y = x Wᵀ` with a chosen backend (the scalar reference where that backend does not run).
    pub fn matmul_with(&self, backend: Backend, x: &[f32], t: usize, y: &mut [f32]) {
        match &self.imp {
            Imp::Dot(d) => d.matmul_with(backend.here() != Backend::Scalar, x, t, y),
            Imp::Tiles(m) => m.matmul_with(backend, x, t, y),
        }
    }
}

impl crate::matmul::RowSource for PackedMatrix {
    fn n_in(&self) -> usize {
        self.cin
    }
    fn n_out(&self) -> usize {
        self.cout
    }
    fn decode(&self, r0: usize, n: usize, buf: &mut [f32]) {
        match &self.imp {
            Imp::Dot(d) => d.decode_rows(r0, n, buf),
            Imp::Tiles(t) => t.decode_rows(r0, n, buf),
        }
    }
}

/// `ys[i] = x Wᵢᵀ` for matrices sharing one input: when all are integer-dot matrices the input is
/// quantized once and all rows go out in one parallel dispatch; otherwise one call each.
pub fn matmul_shared(ms: &[&PackedMatrix], x: &[f32], t: usize, ys: &mut [&mut [f32]]) {
    assert_eq!(ms.len(), ys.len(), "{} matrices for {} outputs", ms.len(), ys.len());
    // The integer-dot matrices as an array on the stack: this runs several times per layer and
    // token, and must not allocate (`crate::scratch`).
    let all_dot = !ms.is_empty() && ms.len() <= MAX_SHARED && ms.iter().all(|m| m.as_dot().is_some());
    let same_cin = all_dot && ms.iter().all(|m| m.cin == ms[0].cin);
    if all_dot && same_cin && t > 0 {
        let first = ms[0].as_dot().expect("checked above");
        let dots: [&intdot::DotMatrix; MAX_SHARED] =
            std::array::from_fn(|i| ms.get(i).and_then(|m| m.as_dot()).unwrap_or(first));
        let d = &dots[..ms.len()];
        assert_eq!(x.len(), t * d[0].cin, "x has {} values, expected {t}×{}", x.len(), d[0].cin);
        let simd = Backend::best() != Backend::Scalar;
        if simd && intdot::f32_path(t) {
            return intdot::gemm_many(simd, d, x, t, ys);
        }
        intdot::with_quantized(x, t, d[0].cin, |qx| intdot::matmul_many(simd, d, qx, ys))
    } else {
        for (m, y) in ms.iter().zip(ys.iter_mut()) {
            m.matmul(x, t, y);
        }
    }
}

/// Most matrices [`matmul_shared`] takes in one dispatch (q/k/v, a DeltaNet's four inputs).
pub const MAX_SHARED: usize = 8;

/// The float tile layout (module docs).
#[derive(Clone, Debug)]
struct TileMatrix {
    cout: usize,
    cin: usize,
    kind: Kind,
    /// Output rows per tile (8 or 16).
    rows_per_tile: usize,
    /// Packed bytes per column of one tile.
    bytes_per_col: usize,
    n_tiles: usize,
    data: Vec<u8>,
    /// `n_tiles · rows_per_tile` (zero past `cout`).
    scale: Vec<f32>,
    /// Codebook as the kernels read it: lut: 16 entries (lut3: 8 used; lut2: 4 entries repeated
    /// twice), vec2x16: component 0's 16 values then component 1's, vec2x64: the `64 × 2`
    /// codebook, int8: empty.
    table: Vec<f32>,
}

impl TileMatrix {
    fn from_lut(m: &LutMatrix) -> TileMatrix {
        let (kind, bits) = match m.format {
            Format::Lut4 => (Kind::Lut(4), 4),
            Format::Lut3 => (Kind::Lut(3), 3),
            Format::Lut2 => (Kind::Lut(2), 2),
            Format::Vec2x16 => (Kind::Vec2x16, 4),
            Format::Vec2x64 => (Kind::Vec2x64, 6),
            f => panic!("{} is not a LUT format", f.name()),
        };
        let d = m.format.vec_dim();
        let cb = &m.codebook;
        let table = match kind {
            Kind::Lut(4) => cb.clone(),
            Kind::Lut(3) => {
                let mut t = cb.clone();
                t.resize(16, 0.0);
                t
            }
            Kind::Lut(_) => {
                let mut t: Vec<f32> = cb.iter().chain(cb.iter()).copied().collect();
                t.resize(16, 0.0);
                t
            }
            Kind::Vec2x16 => (0..2).flat_map(|c| (0..16).map(move |k| cb[k * 2 + c])).collect(),
            _ => cb.clone(),
        };
        let idx = &m.idx;
        let cin = m.cin;
        Self::build(kind, m.cout, cin, d, bits, &m.scale, table, |g, j| idx[g * cin + j] as u64)
    }

    fn from_int8(m: &Int8Matrix) -> TileMatrix {
        let (q, cin) = (&m.q, m.cin);
        Self::build(Kind::Int8, m.cout, cin, 1, 8, &m.scale, Vec::new(), |g, j| q[g * cin + j] as u8 as u64)
    }

    #[allow(clippy::too_many_arguments)]
    fn build(
        kind: Kind,
        cout: usize,
        cin: usize,
        d: usize,
        bits: usize,
        scale: &[f32],
        table: Vec<f32>,
        get: impl Fn(usize, usize) -> u64 + Sync,
    ) -> TileMatrix {
        let n_groups = cout / d;
        let n_tiles = n_groups.div_ceil(LANES);
        let bpc = bits; // 8 lanes × bits = bits bytes
        let tile_bytes = cin * bpc;
        let mut data = vec![0u8; n_tiles * tile_bytes + PAD];
        if tile_bytes > 0 {
            data[..n_tiles * tile_bytes].par_chunks_mut(tile_bytes).enumerate().for_each(|(tile, out)| {
                for j in 0..cin {
                    let mut w = 0u64;
                    for k in 0..LANES {
                        let g = tile * LANES + k;
                        if g < n_groups {
                            w |= get(g, j) << (k * bits);
                        }
                    }
                    out[j * bpc..(j + 1) * bpc].copy_from_slice(&w.to_le_bytes()[..bpc]);
                }
            });
        }
        let rows_per_tile = LANES * d;
        let mut sc = scale.to_vec();
        sc.resize(n_tiles * rows_per_tile, 0.0);
        TileMatrix { cout, cin, kind, rows_per_tile, bytes_per_col: bpc, n_tiles, data, scale: sc, table }
    }

    fn packed_bytes(&self) -> usize {
        self.data.len() + 4 * (self.scale.len() + self.table.len())
    }

    fn matmul_with(&self, backend: Backend, x: &[f32], t: usize, y: &mut [f32]) {
        let (cout, cin) = (self.cout, self.cin);
        assert_eq!(x.len(), t * cin, "x has {} values, expected {t}×{cin}", x.len());
        assert_eq!(y.len(), t * cout, "y has {} values, expected {t}×{cout}", y.len());
        let backend = backend.here();
        for t0 in (0..t).step_by(MAX_T) {
            let tc = MAX_T.min(t - t0);
            self.chunk(backend, &x[t0 * cin..(t0 + tc) * cin], tc, &mut y[t0 * cout..(t0 + tc) * cout]);
        }
    }

    /// One call for `tc ≤ MAX_T` rows.
    fn chunk(&self, backend: Backend, x: &[f32], tc: usize, y: &mut [f32]) {
        let rpt = self.rows_per_tile;
        let per_tile = tc * rpt;
        let mut yt = crate::scratch::Buf::zeros(self.n_tiles * per_tile);
        let tile_bytes = self.cin * self.bytes_per_col;
        let run = |tile0: usize, out: &mut [f32]| {
            for (i, o) in out.chunks_mut(per_tile).enumerate() {
                let tile = tile0 + i;
                self.tile(backend, tile, x, tc, o);
                let s = &self.scale[tile * rpt..(tile + 1) * rpt];
                for row in o.chunks_mut(rpt) {
                    row.iter_mut().zip(s).for_each(|(v, &s)| *v *= s);
                }
            }
        };
        // Small matrices run on the calling thread (a rayon round trip costs more).
        let total = self.n_tiles * tile_bytes;
        let threads = rayon::current_num_threads();
        if total < 16 * 1024 || threads == 1 || self.n_tiles < 2 {
            run(0, &mut yt);
        } else {
            let tiles_per_task = self.n_tiles.div_ceil(threads * 4).max(1);
            crate::team::par_chunks_mut(&mut yt, tiles_per_task * per_tile, &|c, out| run(c * tiles_per_task, out));
        }
        let cout = self.cout;
        for tile in 0..self.n_tiles {
            let r0 = tile * rpt;
            let n = rpt.min(cout - r0);
            for t in 0..tc {
                let src = &yt[tile * per_tile + t * rpt..][..n];
                y[t * cout + r0..t * cout + r0 + n].copy_from_slice(src);
            }
        }
    }

    /// Unscaled sums of one tile into `out` (`tc × rows_per_tile`, rows in tile order).
    fn tile(&self, backend: Backend, tile: usize, x: &[f32], tc: usize, out: &mut [f32]) {
        let tile_bytes = self.cin * self.bytes_per_col;
        let data = &self.data[tile * tile_bytes..];
        match backend {
            Backend::Scalar => self.tile_scalar(data, x, tc, out),
            Backend::Avx2 => {
                #[cfg(target_arch = "x86_64")]
                // SAFETY: AVX2+FMA were detected (matmul_with downgrades to Scalar otherwise);
                // `data` holds this tile's cin·bytes_per_col bytes plus at least PAD bytes, x
                // holds tc·cin values and out tc·rows_per_tile.
                unsafe {
                    match self.kind {
                        Kind::Lut(4) => lut::tile_lut4(&self.table, data, self.cin, x, tc, out),
                        Kind::Lut(b) => lut::tile_lut_small(&self.table, b, data, self.cin, x, tc, out),
                        Kind::Vec2x16 => vec2::tile_vec2x16(&self.table, data, self.cin, x, tc, out),
                        Kind::Vec2x64 => vec2::tile_vec2x64(&self.table, data, self.cin, x, tc, out),
                        Kind::Int8 => int8::tile_int8(data, self.cin, x, tc, out),
                    }
                }
                #[cfg(not(target_arch = "x86_64"))]
                self.tile_scalar(data, x, tc, out)
            }
            Backend::Neon => {
                #[cfg(target_arch = "aarch64")]
                // SAFETY: NEON is part of aarch64 (`matmul_with` downgrades to Scalar elsewhere);
                // `data` holds this tile's cin·bytes_per_col bytes plus at least PAD bytes, the
                // table what the kind reads, x tc·cin values and out tc·rows_per_tile, tc ≤ MAX_T.
                unsafe {
                    tile_neon::tile(self.kind, &self.table, data, self.cin, x, tc, out)
                }
                #[cfg(not(target_arch = "aarch64"))]
                self.tile_scalar(data, x, tc, out)
            }
        }
    }

    /// Decode output rows `r0..r0+n` to f32 (`n × cin`), exactly `scale · value`.
    fn decode_rows(&self, r0: usize, n: usize, out: &mut [f32]) {
        let (cin, bits) = (self.cin, self.bytes_per_col);
        let d = self.rows_per_tile / LANES;
        let mask = (1u64 << bits) - 1;
        for (i, o) in out[..n * cin].chunks_mut(cin).enumerate() {
            let r = r0 + i;
            let (g, comp) = (r / d, r % d);
            let (tile, k) = (g / LANES, g % LANES);
            let data = &self.data[tile * cin * bits..];
            for (j, x) in o.iter_mut().enumerate() {
                let word = u64::from_le_bytes(data[j * bits..j * bits + 8].try_into().unwrap());
                let idx = ((word >> (k * bits)) & mask) as usize;
                let v = match self.kind {
                    Kind::Lut(_) => self.table[idx],
                    Kind::Int8 => idx as u8 as i8 as f32,
                    Kind::Vec2x16 => self.table[16 * comp + idx],
                    Kind::Vec2x64 => self.table[2 * idx + comp],
                };
                *x = self.scale[r] * v;
            }
        }
    }

    /// Reference: decode each column's lanes with plain integer ops, accumulate in f32.
    fn tile_scalar(&self, data: &[u8], x: &[f32], tc: usize, out: &mut [f32]) {
        let (cin, bpc, rpt) = (self.cin, self.bytes_per_col, self.rows_per_tile);
        out.fill(0.0);
        let bits = bpc;
        let mask = (1u64 << bits) - 1;
        let mut w = [0f32; 2 * LANES];
        for j in 0..cin {
            let word = u64::from_le_bytes(data[j * bpc..j * bpc + 8].try_into().unwrap());
            for k in 0..LANES {
                let i = ((word >> (k * bits)) & mask) as usize;
                match self.kind {
                    Kind::Lut(_) => w[k] = self.table[i],
                    Kind::Int8 => w[k] = i as u8 as i8 as f32,
                    Kind::Vec2x16 | Kind::Vec2x64 => {
                        let k2 = if self.kind == Kind::Vec2x16 { 16 } else { 1 };
                        let (a, b) = if k2 == 16 {
                            (self.table[i], self.table[16 + i])
                        } else {
                            (self.table[2 * i], self.table[2 * i + 1])
                        };
                        w[2 * k] = a;
                        w[2 * k + 1] = b;
                    }
                }
            }
            for t in 0..tc {
                let xv = x[t * cin + j];
                for (o, &wv) in out[t * rpt..(t + 1) * rpt].iter_mut().zip(&w[..rpt]) {
                    *o += wv * xv;
                }
            }
        }
    }
}

/// Expand the AVX2 tile-kernel body: `$decode` yields `[__m256; NV]` lane vectors for the column
/// at byte pointer `$p`; each is FMA'd with the broadcast input of every row. Accumulators are
/// stored as `out[(t·NV + v)·8 + k]`; the caller maps lanes to rows.
#[cfg(target_arch = "x86_64")]
macro_rules! tile_loop {
    ($nv:literal, $bpc:expr, $data:expr, $cin:expr, $x:expr, $out:expr, $tt:ident, $uu:ident, |$p:ident| $decode:block) => {{
        use std::arch::x86_64::*;
        let data: *const u8 = $data;
        let cin: usize = $cin;
        let x: *const f32 = $x;
        let out: *mut f32 = $out;
        let bpc: usize = $bpc;
        let mut acc = [[[_mm256_setzero_ps(); $nv]; $tt]; $uu];
        let main = cin / $uu * $uu;
        let mut j = 0;
        while j < main {
            for u in 0..$uu {
                let $p = data.add((j + u) * bpc);
                let w: [__m256; $nv] = $decode;
                for t in 0..$tt {
                    let xv = _mm256_set1_ps(*x.add(t * cin + j + u));
                    for v in 0..$nv {
                        acc[u][t][v] = _mm256_fmadd_ps(w[v], xv, acc[u][t][v]);
                    }
                }
            }
            j += $uu;
        }
        while j < cin {
            let $p = data.add(j * bpc);
            let w: [__m256; $nv] = $decode;
            for t in 0..$tt {
                let xv = _mm256_set1_ps(*x.add(t * cin + j));
                for v in 0..$nv {
                    acc[0][t][v] = _mm256_fmadd_ps(w[v], xv, acc[0][t][v]);
                }
            }
            j += 1;
        }
        for t in 0..$tt {
            for v in 0..$nv {
                let mut s = acc[0][t][v];
                for a in acc.iter().skip(1) {
                    s = _mm256_add_ps(s, a[t][v]);
                }
                _mm256_storeu_ps(out.add((t * $nv + v) * 8), s);
            }
        }
    }};
}
#[cfg(target_arch = "x86_64")]
pub(crate) use tile_loop;

/// Dispatch a const-generic tile kernel `$f::<T, U>` on `tc` (1..=8); `U` columns are unrolled
/// so that at least 4 accumulator chains are in flight.
#[cfg(target_arch = "x86_64")]
macro_rules! dispatch_t {
    // Two lane vectors per column (vector formats): half the unroll, to stay within 16 registers.
    (narrow $tc:expr, $f:ident($($arg:expr),*)) => {
        match $tc {
            1 => $f::<1, 2>($($arg),*),
            2 => $f::<2, 1>($($arg),*),
            3 => $f::<3, 1>($($arg),*),
            4 => $f::<4, 1>($($arg),*),
            5 => $f::<5, 1>($($arg),*),
            6 => $f::<6, 1>($($arg),*),
            7 => $f::<7, 1>($($arg),*),
            8 => $f::<8, 1>($($arg),*),
            _ => unreachable!("tile kernels take 1..=8 rows"),
        }
    };
    ($tc:expr, $f:ident($($arg:expr),*)) => {
        match $tc {
            1 => $f::<1, 4>($($arg),*),
            2 => $f::<2, 2>($($arg),*),
            3 => $f::<3, 2>($($arg),*),
            4 => $f::<4, 1>($($arg),*),
            5 => $f::<5, 1>($($arg),*),
            6 => $f::<6, 1>($($arg),*),
            7 => $f::<7, 1>($($arg),*),
            8 => $f::<8, 1>($($arg),*),
            _ => unreachable!("tile kernels take 1..=8 rows"),
        }
    };
}
#[cfg(target_arch = "x86_64")]
pub(crate) use dispatch_t;

#[cfg(test)]
mod tests;
