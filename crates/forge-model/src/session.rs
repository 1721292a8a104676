//! Per-sequence state: KV caches of attention layers, conv and recurrent states of DeltaNet
//! layers. Cloning a session is an exact snapshot (used for rollback and prompt caching).

use forge_core::config::{LayerKind, ModelConfig};

/// Post-RoPE keys and values of one attention layer: per key/value head, one contiguous run of
/// `head_dim` floats per position (transformers' `(heads, positions, head_dim)` order). Decode
/// reads each head's history as one sequential stream; with the heads interleaved per position
/// (a row of `heads × head_dim`) every row was a short strided piece, which the hardware
/// prefetchers follow worse.
#[derive(Clone, Debug)]
pub struct KvCache {
    k: Vec<Vec<f32>>,
    v: Vec<Vec<f32>>,
    head_dim: usize,
}

impl KvCache {
    pub fn new(heads: usize, head_dim: usize) -> KvCache {
        KvCache { k: vec![Vec::new(); heads], v: vec![Vec::new(); heads], head_dim }
    }

    /// Cached positions.
    pub fn len(&self) -> usize {
        self.k.first().map_or(0, |k| k.len() / self.head_dim.max(1))
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn heads(&self) -> usize {
        self.k.len()
    }

    /// Appends positions given as rows of `heads × head_dim` keys and values (the projections'
    /// output order).
    pub fn push(&mut self, k: &[f32], v: &[f32]) {
        let (h, d) = (self.heads(), self.head_dim);
        assert!(
            k.len() == v.len() && k.len().is_multiple_of(h * d),
            "{} keys, {} values for rows of {h}×{d}",
            k.len(),
            v.len()
        );
        for (rk, rv) in k.chunks_exact(h * d).zip(v.chunks_exact(h * d)) {
            for (head, (ck, cv)) in self.k.iter_mut().zip(&mut self.v).enumerate() {
                ck.extend_from_slice(&rk[head * d..(head + 1) * d]);
                cv.extend_from_slice(&rv[head * d..(head + 1) * d]);
            }
        }
    }

    /// Keys of head `h`, `head_dim` floats per position.
    pub fn keys(&self, h: usize) -> &[f32] {
        &self.k[h]
    }

    pub fn values(&self, h: usize) -> &[f32] {
        &self.v[h]
    }

    /// Keeps the first `n` positions.
    pub fn truncate(&mut self, n: usize) {
        for c in self.k.iter_mut().chain(&mut self.v) {
            c.truncate(n * self.head_dim);
        }
    }

    /// Room for `more` positions past the current ones, touched now (as llama.cpp maps its
    /// context when it is made) rather than on the first page faults of a prefill or decode.
    pub fn reserve(&mut self, more: usize) {
        for c in self.k.iter_mut().chain(&mut self.v) {
            c.reserve(more * self.head_dim);
            c.spare_capacity_mut().iter_mut().for_each(|v| {
                v.write(0.0);
            });
        }
    }

    /// Bytes held, reserved room included.
    pub fn capacity_bytes(&self) -> usize {
        self.k.iter().chain(&self.v).map(|c| c.capacity() * 4).sum()
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
    pub fn new(cfg: &ModelConfig) -> Self {
        let layers = cfg
            .layer_kinds
            .iter()
            .map(|k| match k {
                LayerKind::Attention => LayerState::Attn(KvCache::new(cfg.num_kv_heads, cfg.head_dim)),
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
            assert_eq!(c.keys(h), &want[..]);
            assert_eq!(c.values(h), &want.iter().map(|x| -x).collect::<Vec<_>>()[..]);
        }
        c.reserve(10);
        assert!(c.capacity_bytes() >= 2 * heads * 13 * d * 4);
        c.truncate(1);
        assert_eq!((c.len(), c.keys(2)), (1, &[20.0, 21.0][..]));
    }
}
