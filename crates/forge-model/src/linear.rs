//! `Linear`: the one abstraction every projection goes through, so the reference, the
//! calibration pass and the quantized runtime share the model code. A linear layer is dense
//! (f32/BF16/F16), LUT, INT8 or a GGUF block-quantized matrix, and may carry an online rotation
//! of its input and a low-rank branch `A(Bx)`.

use anyhow::Result;
use forge_core::gguf::BlockMatrix;
use forge_core::tensor::HostTensor;
use forge_kernels::lut::{Int8Matrix, LutMatrix};
use forge_kernels::lutmm::dense::{matmul_half, MAX_DENSE_T};
use forge_kernels::lutmm::{fast_path, PackedMatrix, MAX_SHARED};
use forge_kernels::matmul::{matmul_rows, matmul_xwt, RowSource};
use forge_kernels::scratch::Buf;
use std::sync::{Arc, Mutex, OnceLock};

/// Matrices on the float tile kernels (codebooks off the 8-bit grid) run them below this many
/// input rows; from here on the rows are decoded to f32 blocks and multiplied with the blocked
/// GEMM. Integer-dot matrices take their kernels at every row count: on SmolLM2 lut4 they run
/// a 64-token prefill about 1.8× as fast as decode + GEMM.
pub const PACKED_MAX_T: usize = 16;

/// Stored weight of a linear layer.
#[derive(Clone)]
pub enum Weight {
    /// Row-major `[out, in]` f32/BF16/F16 (possibly memory-mapped).
    Dense(HostTensor),
    Lut(Arc<LutMatrix>),
    Int8(Arc<Int8Matrix>),
    /// Already in kernel layout (a compiled cache, memory-mapped): no plain form in memory.
    Packed(Arc<PackedMatrix>),
    /// A GGUF file's block-quantized matrix (Q4_0, Q4_K, Q6_K, IQ4_NL, ...) in the file's
    /// memory mapping, rows decoded on the fly: a quantized GGUF runs without an f32 copy.
    Gguf(Arc<BlockMatrix>),
}

/// A [`BlockMatrix`] as a row source of the float kernels: each task decodes its block of
/// output rows into a small f32 buffer and takes dot products with the input rows.
struct GgufRows<'a>(&'a BlockMatrix);

impl RowSource for GgufRows<'_> {
    fn n_in(&self) -> usize {
        self.0.cols
    }
    fn n_out(&self) -> usize {
        self.0.rows
    }
    fn decode(&self, r0: usize, n: usize, buf: &mut [f32]) {
        // The kernels ask only for rows inside the matrix, into buffers of their size.
        let ok = self.0.decode_rows(r0, n, buf);
        debug_assert!(ok.is_ok(), "{ok:?}");
    }
}

/// The kernel layout of a LUT/INT8 weight, built on first use and shared by clones of the layer.
/// It remembers the stored weight it was built from, so a layer whose `weight` was replaced
/// afterwards never uses a stale layout.
#[derive(Clone, Default)]
pub struct PackedCache(Arc<OnceLock<(Weight, Arc<PackedMatrix>)>>);

impl PackedCache {
    /// The packed form of `w` (None for dense weights).
    pub fn get(&self, w: &Weight) -> Option<Arc<PackedMatrix>> {
        let pack = |w: &Weight| match w {
            Weight::Lut(m) => Some(PackedMatrix::from_lut(m)),
            Weight::Int8(m) => Some(PackedMatrix::from_int8(m)),
            Weight::Dense(_) | Weight::Packed(_) | Weight::Gguf(_) => None,
        };
        match w {
            Weight::Dense(_) | Weight::Gguf(_) => return None,
            Weight::Packed(p) => return Some(p.clone()),
            _ => {}
        }
        let (src, p) = self.0.get_or_init(|| (w.clone(), Arc::new(pack(w).expect("quantized weight"))));
        let same = match (src, w) {
            (Weight::Lut(a), Weight::Lut(b)) => Arc::ptr_eq(a, b),
            (Weight::Int8(a), Weight::Int8(b)) => Arc::ptr_eq(a, b),
            _ => false,
        };
        if same {
            Some(p.clone())
        } else {
            pack(w).map(Arc::new)
        }
    }
}

/// Low-rank correction `A (out × r)`, `B (r × in)`, applied to the unrotated input. The factors
/// are held as FP16 bits, as exports store them: a decode reads them whole every token (the
/// 27B's 208 rank-64 pairs are 0.32 GB a token in FP16, twice that in f32). `A` is held in tiles
/// of 16 rows ([`forge_kernels::f16tiles`]): its rows are only `r` long.
#[derive(Clone, Debug)]
pub struct LowRank {
    pub rank: usize,
    /// Rows of `A` (the layer's outputs).
    pub out: usize,
    /// `A` in tiles of 16 rows.
    pub a_tiles: Vec<u16>,
    /// `B`, row-major.
    pub b: Vec<u16>,
}

impl LowRank {
    /// The factors (row-major `A`, then `B`) rounded to FP16 (to nearest).
    pub fn from_f32(rank: usize, a: &[f32], b: &[f32]) -> LowRank {
        let bits = |v: &[f32]| v.iter().map(|&x| half::f16::from_f32(x).to_bits()).collect::<Vec<u16>>();
        Self::from_bits(rank, bits(a), bits(b))
    }

    /// Factors as stored: FP16 bits copied as they are, other float types rounded to FP16.
    pub fn from_stored(rank: usize, a: forge_core::tensor::FloatSlice, b: forge_core::tensor::FloatSlice) -> LowRank {
        use forge_core::tensor::FloatSlice;
        let bits = |v: FloatSlice| match v {
            FloatSlice::F16(h) => h.to_vec(),
            other => {
                let mut f = vec![0f32; other.len()];
                other.read_into(0, &mut f);
                f.iter().map(|&x| half::f16::from_f32(x).to_bits()).collect()
            }
        };
        Self::from_bits(rank, bits(a), bits(b))
    }

    fn from_bits(rank: usize, a: Vec<u16>, b: Vec<u16>) -> LowRank {
        let out = a.len() / rank.max(1);
        LowRank { rank, out, a_tiles: forge_kernels::f16tiles::pack(&a, out, rank), b }
    }

    /// `A` (row-major) and `B` as f32.
    pub fn factors_f32(&self) -> (Vec<f32>, Vec<f32>) {
        let f = |v: &[u16]| v.iter().map(|&x| half::f16::from_bits(x).to_f32()).collect();
        (f(&forge_kernels::f16tiles::unpack(&self.a_tiles, self.out, self.rank)), f(&self.b))
    }

    /// Bytes the factors take.
    pub fn bytes(&self) -> usize {
        2 * (self.out * self.rank + self.b.len())
    }
}

/// An orthogonal transform of a layer's input, applied online (e.g. block Hadamard).
pub trait InputRotation: Send + Sync {
    /// `x ← x M` for rows of `x`.
    fn apply_rows(&self, x: &mut [f32]);
    /// `out = x M` (the same bits as `apply_rows` on a copy of `x`).
    fn apply_rows_into(&self, x: &[f32], out: &mut [f32]) {
        out.copy_from_slice(x);
        self.apply_rows(out);
    }
    /// `W ← W Mᵀ` (back to the original basis) for a `cout × in` weight.
    fn unrotate_weight(&self, w: &mut [f32], cout: usize);
    /// Description recorded in reports, e.g. `hadamard(block=64, seed=1003)`.
    fn describe(&self) -> String;
    /// Equal for two rotations exactly when they are the same transform (what `describe` says,
    /// without formatting a string on the hot path).
    fn key(&self) -> [u64; 3];
}

/// Whether two layers rotate their input the same way.
fn same_rotation(a: &Option<Arc<dyn InputRotation>>, b: &Option<Arc<dyn InputRotation>>) -> bool {
    match (a, b) {
        (None, None) => true,
        (Some(x), Some(y)) => Arc::ptr_eq(x, y) || x.key() == y.key(),
        _ => false,
    }
}

/// Receives the input rows of a linear layer (calibration statistics).
pub trait Observer: Send {
    fn observe(&mut self, name: &str, x: &[f32], t: usize);
}

#[derive(Clone)]
pub struct Linear {
    /// Canonical name without `.weight`, e.g. `layers.3.mlp.down_proj`.
    pub name: String,
    pub out_f: usize,
    pub in_f: usize,
    pub weight: Weight,
    pub bias: Option<Vec<f32>>,
    /// Online input rotation; the stored weight is in the rotated basis.
    pub rotation: Option<Arc<dyn InputRotation>>,
    pub lowrank: Option<LowRank>,
    /// Calibration hook: sees the (unrotated) input of every forward call.
    pub observer: Option<Arc<Mutex<dyn Observer>>>,
    /// Kernel layout of a LUT/INT8 `weight` (lazily built; see [`Linear::prepare`]).
    pub packed: PackedCache,
}

impl Linear {
    pub fn dense(name: impl Into<String>, w: HostTensor, bias: Option<Vec<f32>>) -> Self {
        let (out_f, in_f) = (w.shape[0], w.shape[1]);
        Linear {
            name: name.into(),
            out_f,
            in_f,
            weight: Weight::Dense(w),
            bias,
            rotation: None,
            lowrank: None,
            observer: None,
            packed: PackedCache::default(),
        }
    }

    pub fn with_weight(name: impl Into<String>, out_f: usize, in_f: usize, weight: Weight) -> Self {
        Linear {
            name: name.into(),
            out_f,
            in_f,
            weight,
            bias: None,
            rotation: None,
            lowrank: None,
            observer: None,
            packed: PackedCache::default(),
        }
    }

    /// Build the packed kernel layout now instead of on the first forward call.
    pub fn prepare(&self) {
        self.packed.get(&self.weight);
    }

    /// Weight bytes one forward call reads: the packed form for LUT/INT8, the stored elements
    /// for dense weights, the stored blocks for GGUF matrices (low-rank factors included).
    pub fn weight_bytes(&self) -> usize {
        let main = match &self.weight {
            Weight::Dense(w) => w.numel() * w.dtype().size(),
            Weight::Gguf(m) => m.stored_bytes(),
            _ => self.packed.get(&self.weight).map_or(0, |p| p.packed_bytes()),
        };
        main + self.lowrank.as_ref().map_or(0, LowRank::bytes)
    }

    /// `y = rot(x) Wᵀ + A(B x) + b` for `t` rows of `x`.
    pub fn forward(&self, x: &[f32], t: usize) -> Result<Vec<f32>> {
        let mut y = vec![0f32; t * self.out_f];
        self.forward_into(x, t, &mut y)?;
        Ok(y)
    }

    /// [`Linear::forward`] into a pooled buffer (no allocation in a warm decode loop).
    pub fn forward_buf(&self, x: &[f32], t: usize) -> Result<Buf> {
        let mut y = Buf::for_overwrite(t * self.out_f);
        self.forward_into(x, t, &mut y)?;
        Ok(y)
    }

    /// [`Linear::forward`] into `y` (`t × out` values).
    pub fn forward_into(&self, x: &[f32], t: usize, y: &mut [f32]) -> Result<()> {
        anyhow::ensure!(
            x.len() == t * self.in_f && y.len() == t * self.out_f,
            "{}: {} inputs and {} outputs for {t} rows of {} → {}",
            self.name,
            x.len(),
            y.len(),
            self.in_f,
            self.out_f
        );
        if let Some(obs) = &self.observer {
            obs.lock().map_err(|_| anyhow::anyhow!("observer poisoned"))?.observe(&self.name, x, t);
        }
        let rotated = self.rotated_input(x);
        let xin = rotated.as_deref().unwrap_or(x);
        match &self.weight {
            Weight::Dense(w) => {
                let ws = w.floats()?;
                if !(fast_path() && dense_half(xin, t, ws, self.out_f, self.in_f, y)) {
                    matmul_xwt(xin, t, ws, self.out_f, self.in_f, y)
                }
            }
            Weight::Gguf(m) => matmul_rows(xin, t, &GgufRows(m), y),
            w => match self.packed.get(w).filter(|p| fast_path() && (t < PACKED_MAX_T || p.is_int_dot())) {
                Some(p) => p.matmul(xin, t, y),
                None => match w {
                    Weight::Lut(m) => matmul_rows(xin, t, m.as_ref(), y),
                    Weight::Int8(m) => matmul_rows(xin, t, m.as_ref(), y),
                    Weight::Packed(p) => matmul_rows(xin, t, p.as_ref(), y),
                    Weight::Dense(_) | Weight::Gguf(_) => unreachable!("handled above"),
                },
            },
        }
        self.finish(x, t, y);
        Ok(())
    }

    /// Forward several layers that read the same input (q/k/v, gate/up): the rotation and the
    /// activation quantization are done once and the integer-dot kernels go out in one parallel
    /// dispatch when the layers allow it (at least two integer-dot weights without observers
    /// and with the same rotation; the other layers then run one `forward` each, whatever their
    /// rotation); otherwise one `forward` each. Same results either way.
    pub fn forward_shared(ls: &[&Linear], x: &[f32], t: usize) -> Result<Vec<Vec<f32>>> {
        let mut ys: Vec<Vec<f32>> = ls.iter().map(|l| vec![0f32; t * l.out_f]).collect();
        let mut outs: Vec<&mut [f32]> = ys.iter_mut().map(|y| y.as_mut_slice()).collect();
        Self::forward_shared_into(ls, x, t, &mut outs)?;
        Ok(ys)
    }

    /// [`Linear::forward_shared`] into `ys` (`t × out` values each).
    pub fn forward_shared_into(ls: &[&Linear], x: &[f32], t: usize, ys: &mut [&mut [f32]]) -> Result<()> {
        anyhow::ensure!(ls.len() == ys.len(), "{} layers for {} outputs", ls.len(), ys.len());
        // The packed matrices on the stack: this runs several times per layer and token. The
        // integer-dot ones with the first one's input (width and rotation) go out in one
        // dispatch on one rotated and quantized input; the others (a DeltaNet's dense
        // `in_b`/`in_a`, unrotated, next to its packed `in_qkv`/`in_z`) one call each.
        let shareable = fast_path() && ls.len() <= MAX_SHARED;
        let mut packed: [Option<Arc<PackedMatrix>>; MAX_SHARED] = std::array::from_fn(|i| match ls.get(i) {
            Some(l) if shareable && l.observer.is_none() => l.packed.get(&l.weight).filter(|p| p.is_int_dot()),
            _ => None,
        });
        let first = packed.iter().position(Option::is_some);
        if let Some(f) = first {
            for (p, l) in packed.iter_mut().zip(ls) {
                if l.in_f != ls[f].in_f || !same_rotation(&l.rotation, &ls[f].rotation) {
                    *p = None;
                }
            }
        }
        if packed[..ls.len().min(MAX_SHARED)].iter().filter(|p| p.is_some()).count() < 2 {
            for (l, y) in ls.iter().zip(ys.iter_mut()) {
                l.forward_into(x, t, y)?;
            }
            return Ok(());
        }
        for (l, y) in ls.iter().zip(ys.iter()) {
            anyhow::ensure!(
                x.len() == t * l.in_f && y.len() == t * l.out_f,
                "{}: {} inputs and {} outputs for {t} rows of {} → {}",
                l.name,
                x.len(),
                y.len(),
                l.in_f,
                l.out_f
            );
        }
        let rotated = ls[first.expect("two integer-dot matrices")].rotated_input(x);
        let xin = rotated.as_deref().unwrap_or(x);
        {
            let first = packed.iter().flatten().next().expect("checked above");
            let mut refs: [&PackedMatrix; MAX_SHARED] = [first; MAX_SHARED];
            let mut outs: [&mut [f32]; MAX_SHARED] = Default::default();
            let mut n = 0;
            for (p, y) in packed.iter().zip(ys.iter_mut()) {
                if let Some(p) = p {
                    (refs[n], outs[n]) = (p, &mut **y);
                    n += 1;
                }
            }
            forge_kernels::lutmm::matmul_shared(&refs[..n], xin, t, &mut outs[..n]);
        }
        for ((l, p), y) in ls.iter().zip(&packed).zip(ys.iter_mut()) {
            if p.is_some() {
                l.finish(x, t, y);
            } else {
                l.forward_into(x, t, y)?;
            }
        }
        Ok(())
    }

    /// The kernel input when it is not `x` itself: its rotation, in a pooled buffer.
    fn rotated_input(&self, x: &[f32]) -> Option<Buf> {
        self.rotation.as_ref().map(|r| {
            let mut b = Buf::for_overwrite(x.len());
            r.apply_rows_into(x, &mut b);
            b
        })
    }

    /// Add the low-rank branch (on the unrotated input `x`) and the bias to `y`.
    fn finish(&self, x: &[f32], t: usize, y: &mut [f32]) {
        if let Some(lr) = &self.lowrank {
            let mut bx = Buf::for_overwrite(t * lr.rank);
            forge_kernels::matmul::matmul_xwt(
                x,
                t,
                forge_core::tensor::FloatSlice::F16(&lr.b),
                lr.rank,
                self.in_f,
                &mut bx,
            );
            forge_kernels::f16tiles::gemm_add(&bx, t, &lr.a_tiles, self.out_f, lr.rank, y);
        }
        if let Some(b) = &self.bias {
            for row in y.chunks_mut(self.out_f) {
                for (o, &bb) in row.iter_mut().zip(b) {
                    *o += bb;
                }
            }
        }
    }

    /// Decode weight rows `r0..r0+n` in the stored basis (`n × in`), e.g. for embedding lookups
    /// through a tied quantized head.
    pub fn decode_rows(&self, r0: usize, n: usize, out: &mut [f32]) -> Result<()> {
        match &self.weight {
            Weight::Dense(w) => w.floats()?.read_into(r0 * self.in_f, &mut out[..n * self.in_f]),
            Weight::Lut(m) => {
                // LUT decoding works on whole vector groups.
                let d = m.format.vec_dim();
                let g0 = r0 / d * d;
                let g1 = (r0 + n).div_ceil(d) * d;
                let mut buf = vec![0f32; (g1 - g0) * self.in_f];
                m.decode(g0, g1 - g0, &mut buf);
                out[..n * self.in_f].copy_from_slice(&buf[(r0 - g0) * self.in_f..(r0 - g0 + n) * self.in_f]);
            }
            Weight::Int8(m) => m.decode(r0, n, out),
            Weight::Packed(p) => forge_kernels::matmul::RowSource::decode(p.as_ref(), r0, n, out),
            Weight::Gguf(m) => m.decode_rows(r0, n, out).map_err(|e| anyhow::anyhow!("{}: {e:#}", self.name))?,
        }
        Ok(())
    }

    /// The effective dense weight in the original (unrotated) basis, low-rank branch included.
    pub fn effective_weight(&self) -> Result<Vec<f32>> {
        let mut w = vec![0f32; self.out_f * self.in_f];
        self.decode_rows(0, self.out_f, &mut w)?;
        if let Some(r) = &self.rotation {
            r.unrotate_weight(&mut w, self.out_f);
        }
        if let Some(lr) = &self.lowrank {
            let (fa, fb) = lr.factors_f32();
            for o in 0..self.out_f {
                for k in 0..lr.rank {
                    let a = fa[o * lr.rank + k];
                    forge_kernels::simd::axpy(
                        a,
                        &fb[k * self.in_f..(k + 1) * self.in_f],
                        &mut w[o * self.in_f..(o + 1) * self.in_f],
                    );
                }
            }
        }
        Ok(w)
    }

    /// Number of weights (for bits/weight accounting).
    pub fn numel(&self) -> usize {
        self.out_f * self.in_f
    }
}

impl InputRotation for forge_kernels::rotation::Rotation {
    fn apply_rows(&self, x: &mut [f32]) {
        forge_kernels::rotation::Rotation::apply_rows(self, x)
    }
    fn apply_rows_into(&self, x: &[f32], out: &mut [f32]) {
        forge_kernels::rotation::Rotation::apply_rows_into(self, x, out)
    }
    fn unrotate_weight(&self, w: &mut [f32], cout: usize) {
        forge_kernels::rotation::Rotation::unrotate_weight(self, w, cout)
    }
    fn describe(&self) -> String {
        format!("hadamard(block={}, seed={})", self.block, self.seed)
    }
    fn key(&self) -> [u64; 3] {
        [self.dim as u64, self.block as u64, self.seed]
    }
}

/// [`matmul_half`] for up to [`crate::model::VERIFY_MAX_ROWS`] rows in pieces of the few rows it
/// takes at once, whose rows it computes each alone: a verify pass's rows then get the bits
/// decoding gives them. False where the kernel does not run (the caller falls back).
fn dense_half(
    x: &[f32],
    t: usize,
    w: forge_core::tensor::FloatSlice,
    n_out: usize,
    n_in: usize,
    y: &mut [f32],
) -> bool {
    if t <= MAX_DENSE_T || t > crate::model::VERIFY_MAX_ROWS {
        return matmul_half(x, t, w, n_out, n_in, y);
    }
    let mut r0 = 0;
    while r0 < t {
        let n = (t - r0).min(MAX_DENSE_T);
        if !matmul_half(&x[r0 * n_in..(r0 + n) * n_in], n, w, n_out, n_in, &mut y[r0 * n_out..(r0 + n) * n_out]) {
            // Only the first piece can refuse (the kernel's checks do not depend on the rows).
            return false;
        }
        r0 += n;
    }
    true
}

#[cfg(test)]
mod tests {
    use super::*;
    use forge_kernels::lut::Format;

    fn rnd(n: usize, seed: u64) -> Vec<f32> {
        let mut s = seed;
        (0..n)
            .map(|_| {
                s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                ((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
            })
            .collect()
    }

    /// The packed fast path equals the decode-to-f32 reference path for every quantized format
    /// and every row count (packed below `PACKED_MAX_T`, GEMM above).
    #[test]
    fn packed_forward_equals_reference_path() {
        let (out_f, in_f) = (70, 45);
        let mut weights = Vec::new();
        for (i, f) in
            [Format::Lut4, Format::Lut3, Format::Lut2, Format::Vec2x16, Format::Vec2x64].into_iter().enumerate()
        {
            let (d, k) = (f.vec_dim(), f.entries());
            let m = LutMatrix {
                format: f,
                cout: out_f,
                cin: in_f,
                codebook: rnd(k * d, i as u64).iter().map(|&v| half::f16::from_f32(v).to_f32()).collect(),
                idx: rnd(out_f / d * in_f, 10 + i as u64)
                    .iter()
                    .map(|&v| ((v + 1.0) * 1000.0) as u8 % k as u8)
                    .collect(),
                scale: rnd(out_f, 20 + i as u64).iter().map(|&v| half::f16::from_f32(0.5 + v.abs()).to_f32()).collect(),
            };
            m.validate().unwrap();
            weights.push(Weight::Lut(Arc::new(m)));
        }
        let q = rnd(out_f * in_f, 99).iter().map(|&v| (v * 127.0) as i8).collect();
        weights.push(Weight::Int8(Arc::new(Int8Matrix { cout: out_f, cin: in_f, q, scale: vec![0.01; out_f] })));
        for w in weights {
            let l = Linear::with_weight("t", out_f, in_f, w.clone());
            for t in [1, 2, 5, 8, 9, 15, 16, 20] {
                let x = rnd(t * in_f, t as u64);
                let y = l.forward(&x, t).unwrap();
                let mut r = vec![0f32; t * out_f];
                match &w {
                    Weight::Lut(m) => matmul_rows(&x, t, m.as_ref(), &mut r),
                    Weight::Int8(m) => matmul_rows(&x, t, m.as_ref(), &mut r),
                    Weight::Dense(_) | Weight::Packed(_) | Weight::Gguf(_) => unreachable!(),
                }
                for (a, b) in y.iter().zip(&r) {
                    assert!((a - b).abs() <= 1e-4 * (1.0 + b.abs()), "t={t}: {a} vs {b}");
                }
            }
            // A clone whose weight is replaced must not reuse the original's packed layout.
            let mut c = l.clone();
            let zero = Int8Matrix { cout: out_f, cin: in_f, q: vec![0; out_f * in_f], scale: vec![1.0; out_f] };
            c.weight = Weight::Int8(Arc::new(zero));
            assert!(c.forward(&rnd(in_f, 5), 1).unwrap().iter().all(|&v| v == 0.0));
        }
    }

    /// Layers sharing an input run fused (one rotation, one activation quantization, one
    /// dispatch) with the same results as one forward each; a layer off the integer-dot kernels
    /// (float codebook) runs alone, the group's other layers fused or not, still with the same
    /// results.
    #[test]
    fn forward_shared_equals_separate_forwards() {
        let in_f = 300;
        let grid =
            |n: usize, seed: u64| -> Vec<f32> { rnd(n, seed).iter().map(|&v| (v * 100.0).round() / 64.0).collect() };
        let lut = |f: Format, out_f: usize, seed: u64, cb: Vec<f32>| {
            let (d, k) = (f.vec_dim(), f.entries());
            let m = LutMatrix {
                format: f,
                cout: out_f,
                cin: in_f,
                codebook: cb,
                idx: rnd(out_f / d * in_f, seed).iter().map(|&v| ((v + 1.0) * 1000.0) as u8 % k as u8).collect(),
                scale: rnd(out_f, seed + 1).iter().map(|&v| half::f16::from_f32(0.5 + v.abs()).to_f32()).collect(),
            };
            Weight::Lut(Arc::new(m))
        };
        let rot: Arc<dyn InputRotation> = Arc::new(forge_kernels::rotation::Rotation::new(in_f, 3007));
        let q = (0..40 * in_f).map(|i| ((i * 37) % 255) as u8 as i8).collect();
        let weights = [
            lut(Format::Lut4, 64, 1, grid(16, 2)),
            lut(Format::Vec2x64, 34, 3, grid(128, 4)),
            Weight::Int8(Arc::new(Int8Matrix { cout: 40, cin: in_f, q, scale: vec![0.01; 40] })),
        ];
        let mut layers: Vec<Linear> = weights
            .iter()
            .enumerate()
            .map(|(i, w)| {
                let out_f = match w {
                    Weight::Lut(m) => m.cout,
                    _ => 40,
                };
                let mut l = Linear::with_weight(format!("l{i}"), out_f, in_f, w.clone());
                l.rotation = Some(rot.clone());
                l.bias = Some(rnd(out_f, 50 + i as u64));
                l
            })
            .collect();
        layers[1].lowrank = Some(LowRank::from_f32(2, &rnd(34 * 2, 60), &rnd(2 * in_f, 61)));
        assert!(layers.iter().all(|l| l.packed.get(&l.weight).is_some_and(|p| p.is_int_dot())), "fused path taken");
        for t in [1, 3, 9] {
            let x = rnd(t * in_f, 70 + t as u64);
            let refs: Vec<&Linear> = layers.iter().collect();
            let fused = Linear::forward_shared(&refs, &x, t).unwrap();
            for (l, y) in layers.iter().zip(&fused) {
                assert_eq!(*y, l.forward(&x, t).unwrap(), "{} t={t}", l.name);
            }
        }
        // A float codebook in the group: separate forwards.
        let odd = Linear::with_weight("odd", 16, in_f, lut(Format::Lut4, 16, 9, rnd(16, 10)));
        let x = rnd(in_f, 80);
        let out = Linear::forward_shared(&[&layers[0], &odd], &x, 1).unwrap();
        assert_eq!(out[1], odd.forward(&x, 1).unwrap());
        assert_eq!(out[0], layers[0].forward(&x, 1).unwrap());
        // With the same rotation, the integer-dot layers of a group go out fused and the float
        // codebook's alone, each output where its layer is (a DeltaNet's packed and dense inputs).
        let mut odd = odd;
        odd.rotation = Some(rot.clone());
        let group = [&layers[0], &odd, &layers[1], &layers[2]];
        for t in [1, 3] {
            let x = rnd(t * in_f, 90 + t as u64);
            let out = Linear::forward_shared(&group, &x, t).unwrap();
            for (l, y) in group.iter().zip(&out) {
                assert_eq!(*y, l.forward(&x, t).unwrap(), "{} t={t}", l.name);
            }
        }
        // An unrotated dense layer first (a DeltaNet's `in_b` beside its rotated packed inputs):
        // the rotated integer-dot layers still go out fused, on their own rotation.
        let plain = Linear::dense("plain", HostTensor::from_f32(vec![16, in_f], rnd(16 * in_f, 11)), None);
        let group = [&plain, &layers[0], &layers[1], &odd];
        for t in [1, 3] {
            let x = rnd(t * in_f, 95 + t as u64);
            let out = Linear::forward_shared(&group, &x, t).unwrap();
            for (l, y) in group.iter().zip(&out) {
                assert_eq!(*y, l.forward(&x, t).unwrap(), "{} t={t}", l.name);
            }
        }
    }

    /// A GGUF block-quantized weight runs from its blocks as dequantize-then-matmul does, for
    /// every block type, at decode and prefill row counts; with a rotation, a low-rank branch
    /// and a bias it equals the dense f32 layer with the same extras.
    #[test]
    fn gguf_block_forward_equals_dequantized_matmul() {
        use forge_core::gguf::{dequantize, sample_blocks, GgmlType::*};
        let (out_f, in_f) = (70, 512);
        let mut worst = 0f64;
        for (i, ty) in
            [Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2K, Q3K, Q4K, Q5K, Q6K, IQ4NL, IQ4XS, TQ1_0, TQ2_0].into_iter().enumerate()
        {
            let data = sample_blocks(ty, out_f * in_f, 0.002, 7 + i as u64).unwrap();
            let mut w = vec![0f32; out_f * in_f];
            dequantize(ty, &data, &mut w).unwrap();
            let m = BlockMatrix::new("w", ty, out_f, in_f, data.into(), None).unwrap();
            let l = Linear::with_weight("w", out_f, in_f, Weight::Gguf(Arc::new(m)));
            assert_eq!(l.weight_bytes(), ty.row_bytes(in_f).unwrap() * out_f);
            let mut row = vec![0f32; 2 * in_f];
            l.decode_rows(68, 2, &mut row).unwrap();
            assert_eq!(row, w[68 * in_f..]);
            assert!(l.decode_rows(69, 2, &mut row).is_err());
            for t in [1, 3, 9, 20] {
                let x = rnd(t * in_f, 100 + t as u64);
                let y = l.forward(&x, t).unwrap();
                for tt in 0..t {
                    for o in 0..out_f {
                        let xr = &x[tt * in_f..(tt + 1) * in_f];
                        let r: f64 = xr.iter().zip(&w[o * in_f..]).map(|(&a, &b)| a as f64 * b as f64).sum();
                        let scale: f64 =
                            xr.iter().zip(&w[o * in_f..]).map(|(&a, &b)| (a as f64 * b as f64).abs()).sum();
                        worst = worst.max((y[tt * out_f + o] as f64 - r).abs() / (1.0 + scale));
                    }
                }
            }
            // Rotation, low-rank branch and bias go through the same path as a dense layer's.
            let rot: Arc<dyn InputRotation> = Arc::new(forge_kernels::rotation::Rotation::new(in_f, 11));
            let mut dense = Linear::dense("d", HostTensor::from_f32(vec![out_f, in_f], w.clone()), Some(rnd(out_f, 3)));
            dense.rotation = Some(rot.clone());
            dense.lowrank = Some(LowRank::from_f32(2, &rnd(out_f * 2, 4), &rnd(2 * in_f, 5)));
            let mut q = l.clone();
            (q.rotation, q.lowrank, q.bias) = (dense.rotation.clone(), dense.lowrank.clone(), dense.bias.clone());
            for t in [1, 12] {
                let x = rnd(t * in_f, 200 + t as u64);
                let (a, b) = (q.forward(&x, t).unwrap(), dense.forward(&x, t).unwrap());
                for (u, v) in a.iter().zip(&b) {
                    assert!((u - v).abs() <= 1e-4 * (1.0 + v.abs()), "{ty} t={t}: {u} vs {v}");
                }
            }
            let (ea, eb) = (q.effective_weight().unwrap(), dense.effective_weight().unwrap());
            assert!(ea.iter().zip(&eb).all(|(u, v)| (u - v).abs() <= 1e-5), "{ty}: effective weights");
        }
        // f32 accumulation over 512 products: measured 2.0e-7 of (1 + the sum of magnitudes).
        println!("gguf block forward: worst error {worst:.2e} of (1 + Σ|x·w|)");
        assert!(worst < 1e-6, "{worst}");
    }
}
