//! Per-sequence state: KV caches of attention layers, conv and recurrent states of DeltaNet
//! layers. Cloning a session is an exact snapshot (used for rollback and prompt caching).

use forge_core::config::{LayerKind, ModelConfig};
use forge_kernels::attention::KvElem;
use half::f16;
use std::sync::atomic::{AtomicU8, Ordering};

/// How a KV cache stores its keys and values. f16 halves the bytes attention reads per token
/// (and the cache's memory); every product and sum stays f32, the stored values are rounded to
/// f16 once (as llama.cpp's default cache, and the seeds' FP16 history buffers).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KvDtype {
    F32,
    F16,
}

impl KvDtype {
    pub fn name(self) -> &'static str {
        match self {
            KvDtype::F32 => "f32",
            KvDtype::F16 => "f16",
        }
    }

    pub fn parse(s: &str) -> anyhow::Result<KvDtype> {
        match s {
            "f32" => Ok(KvDtype::F32),
            "f16" => Ok(KvDtype::F16),
            _ => anyhow::bail!("unknown KV cache type `{s}` (f32 or f16)"),
        }
    }

    fn bytes(self) -> usize {
        match self {
            KvDtype::F32 => 4,
            KvDtype::F16 => 2,
        }
    }
}

/// 0: f32, 1: f16 (see [`set_kv_dtype`]).
static KV_DTYPE: AtomicU8 = AtomicU8::new(0);

/// The cache type of sessions made from now on in this process (f32 unless set: the library's
/// tests and the measuring commands compare against f32 oracles).
pub fn set_kv_dtype(d: KvDtype) {
    KV_DTYPE.store(d as u8, Ordering::Relaxed)
}

pub fn kv_dtype() -> KvDtype {
    if KV_DTYPE.load(Ordering::Relaxed) == 1 {
        KvDtype::F16
    } else {
        KvDtype::F32
    }
}

/// One key/value head's cached rows, in the cache's element type.
#[derive(Clone, Copy, Debug)]
pub enum KvRows<'a> {
    F32(&'a [f32]),
    F16(&'a [f16]),
}

/// Per key/value head, one contiguous run of `head_dim` elements per position.
#[derive(Clone, Debug)]
struct Store<T> {
    k: Vec<Vec<T>>,
    v: Vec<Vec<T>>,
}

impl<T: KvElem> Store<T> {
    fn push(&mut self, k: &[f32], v: &[f32], h: usize, d: usize) {
        for (rk, rv) in k.chunks_exact(h * d).zip(v.chunks_exact(h * d)) {
            for (head, (ck, cv)) in self.k.iter_mut().zip(&mut self.v).enumerate() {
                ck.extend(rk[head * d..(head + 1) * d].iter().map(|&x| T::from_f32(x)));
                cv.extend(rv[head * d..(head + 1) * d].iter().map(|&x| T::from_f32(x)));
            }
        }
    }

    fn reserve(&mut self, n: usize) {
        for c in self.k.iter_mut().chain(&mut self.v) {
            c.reserve(n);
            c.spare_capacity_mut().iter_mut().for_each(|v| {
                v.write(T::from_f32(0.0));
            });
        }
    }

    fn rows_f32(&self, h: usize) -> (Vec<f32>, Vec<f32>) {
        (self.k[h].iter().map(|x| x.to_f32()).collect(), self.v[h].iter().map(|x| x.to_f32()).collect())
    }
}

#[derive(Clone, Debug)]
enum Heads {
    F32(Store<f32>),
    F16(Store<f16>),
}

/// Post-RoPE keys and values of one attention layer: per key/value head, one contiguous run of
/// `head_dim` values per position (transformers' `(heads, positions, head_dim)` order). Decode
/// reads each head's history as one sequential stream; with the heads interleaved per position
/// (a row of `heads × head_dim`) every row was a short strided piece, which the hardware
/// prefetchers follow worse.
#[derive(Clone, Debug)]
pub struct KvCache {
    heads: Heads,
    n_heads: usize,
    head_dim: usize,
}

/// `$body` with `$st` bound to the cache's store, whatever its element type.
macro_rules! with_store {
    ($self:expr, $st:ident => $body:expr) => {
        match $self {
            Heads::F32($st) => $body,
            Heads::F16($st) => $body,
        }
    };
}

impl KvCache {
    /// An f32 cache.
    pub fn new(heads: usize, head_dim: usize) -> KvCache {
        KvCache::with_dtype(heads, head_dim, KvDtype::F32)
    }

    pub fn with_dtype(heads: usize, head_dim: usize, dtype: KvDtype) -> KvCache {
        let heads_of = |n| match dtype {
            KvDtype::F32 => Heads::F32(Store { k: vec![Vec::new(); n], v: vec![Vec::new(); n] }),
            KvDtype::F16 => Heads::F16(Store { k: vec![Vec::new(); n], v: vec![Vec::new(); n] }),
        };
        KvCache { heads: heads_of(heads), n_heads: heads, head_dim }
    }

    pub fn dtype(&self) -> KvDtype {
        match self.heads {
            Heads::F32(_) => KvDtype::F32,
            Heads::F16(_) => KvDtype::F16,
        }
    }

    /// Cached positions.
    pub fn len(&self) -> usize {
        with_store!(&self.heads, st => st.k.first().map_or(0, |k| k.len() / self.head_dim.max(1)))
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn heads(&self) -> usize {
        self.n_heads
    }

    /// Appends positions given as rows of `heads × head_dim` keys and values (the projections'
    /// output order), rounded to the cache's type.
    pub fn push(&mut self, k: &[f32], v: &[f32]) {
        let (h, d) = (self.n_heads, self.head_dim);
        assert!(
            k.len() == v.len() && k.len().is_multiple_of(h * d),
            "{} keys, {} values for rows of {h}×{d}",
            k.len(),
            v.len()
        );
        with_store!(&mut self.heads, st => st.push(k, v, h, d))
    }

    /// Keys of head `h`, `head_dim` values per position.
    pub fn keys(&self, h: usize) -> KvRows<'_> {
        match &self.heads {
            Heads::F32(st) => KvRows::F32(&st.k[h]),
            Heads::F16(st) => KvRows::F16(&st.k[h]),
        }
    }

    pub fn values(&self, h: usize) -> KvRows<'_> {
        match &self.heads {
            Heads::F32(st) => KvRows::F32(&st.v[h]),
            Heads::F16(st) => KvRows::F16(&st.v[h]),
        }
    }

    /// Keys and values of head `h` as f32 (tests and inspection).
    pub fn rows_f32(&self, h: usize) -> (Vec<f32>, Vec<f32>) {
        with_store!(&self.heads, st => st.rows_f32(h))
    }

    /// Keeps the first `n` positions.
    pub fn truncate(&mut self, n: usize) {
        let d = self.head_dim;
        with_store!(&mut self.heads, st => {
            for c in st.k.iter_mut().chain(&mut st.v) {
                c.truncate(n * d);
            }
        })
    }

    /// Room for `more` positions past the current ones, touched now (as llama.cpp maps its
    /// context when it is made) rather than on the first page faults of a prefill or decode.
    pub fn reserve(&mut self, more: usize) {
        let d = self.head_dim;
        with_store!(&mut self.heads, st => st.reserve(more * d))
    }

    /// Bytes held, reserved room included.
    pub fn capacity_bytes(&self) -> usize {
        let b = self.dtype().bytes();
        with_store!(&self.heads, st => st.k.iter().chain(&st.v).map(|c| c.capacity() * b).sum())
    }
}

#[derive(Clone, Debug)]
pub struct DeltaState {
    /// The last `kernel − 1` conv inputs, oldest first, `conv_dim` floats each.
    pub conv: Vec<f32>,
    /// `num_v_heads × k_head_dim × v_head_dim` recurrent state.
    pub rec: Vec<f32>,
}

#[derive(Clone, Debug)]
pub enum LayerState {
    Attn(KvCache),
    Delta(DeltaState),
}

#[derive(Clone, Debug)]
pub struct Session {
    /// Number of tokens already processed.
    pub pos: usize,
    pub layers: Vec<LayerState>,
}

impl Session {
    /// A session whose KV caches are of the process-wide type ([`set_kv_dtype`]).
    pub fn new(cfg: &ModelConfig) -> Self {
        Self::with_kv_dtype(cfg, kv_dtype())
    }

    pub fn with_kv_dtype(cfg: &ModelConfig, dtype: KvDtype) -> Self {
        let layers = cfg
            .layer_kinds
            .iter()
            .map(|k| match k {
                LayerKind::Attention => LayerState::Attn(KvCache::with_dtype(cfg.num_kv_heads, cfg.head_dim, dtype)),
                LayerKind::DeltaNet => {
                    let d = cfg.deltanet.as_ref().expect("DeltaNet layer without deltanet config");
                    LayerState::Delta(DeltaState {
                        conv: vec![0.0; (d.conv_kernel - 1) * d.conv_dim()],
                        rec: vec![0.0; d.num_v_heads * d.k_head_dim * d.v_head_dim],
                    })
                }
            })
            .collect();
        Session { pos: 0, layers }
    }

    /// Set aside KV cache room for `more` positions past the current ones, so that decoding up
    /// to there never grows (reallocates) a cache.
    pub fn reserve(&mut self, more: usize) {
        for l in &mut self.layers {
            if let LayerState::Attn(c) = l {
                c.reserve(more);
            }
        }
    }

    /// Bytes held by caches and states.
    pub fn state_bytes(&self) -> usize {
        self.layers
            .iter()
            .map(|l| match l {
                LayerState::Attn(c) => c.capacity_bytes(),
                LayerState::Delta(d) => (d.conv.len() + d.rec.len()) * 4,
            })
            .sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kv_cache_keeps_each_head_as_one_stream_in_position_order() {
        let (heads, d) = (3, 2);
        let mut c = KvCache::new(heads, d);
        // Two positions of heads × d projections, then one more: value = 100·pos + 10·head + i.
        let row = |p: usize| -> Vec<f32> { (0..heads * d).map(|j| (100 * p + 10 * (j / d) + j % d) as f32).collect() };
        let (r0, r1, r2) = (row(0), row(1), row(2));
        c.push(&[r0.clone(), r1.clone()].concat(), &[r0, r1].concat().iter().map(|x| -x).collect::<Vec<_>>());
        c.push(&r2, &r2.iter().map(|x| -x).collect::<Vec<_>>());
        assert_eq!(c.len(), 3);
        for h in 0..heads {
            let want: Vec<f32> = (0..3).flat_map(|p| (0..d).map(move |i| (100 * p + 10 * h + i) as f32)).collect();
            let (k, v) = c.rows_f32(h);
            assert_eq!(k, want);
            assert_eq!(v, want.iter().map(|x| -x).collect::<Vec<_>>());
        }
        c.reserve(10);
        assert!(c.capacity_bytes() >= 2 * heads * 13 * d * 4);
        c.truncate(1);
        assert_eq!((c.len(), c.rows_f32(2).0), (1, vec![20.0, 21.0]));
        // An f16 cache: values rounded once, half the bytes.
        let mut h = KvCache::with_dtype(1, 2, KvDtype::F16);
        h.push(&[1.0, 1.0 + 1.0 / 4096.0], &[65504.0, -3.0e-8]);
        h.reserve(7);
        assert_eq!(h.rows_f32(0), (vec![1.0, 1.0], vec![65504.0, f16::from_f32(-3.0e-8).to_f32()]));
        assert!(matches!(h.keys(0), KvRows::F16(_)));
        assert!(h.capacity_bytes() >= 2 * 8 * 2);
    }
}
