//! Per-sequence state: KV caches of attention layers, conv and recurrent states of DeltaNet
//! layers. Cloning a session is an exact snapshot (used for rollback and prompt caching).

use forge_core::config::{LayerKind, ModelConfig};

#[derive(Clone, Debug)]
pub struct KvCache {
    /// Post-RoPE keys, one row of `kv_heads × head_dim` floats per position.
    pub k: Vec<f32>,
    pub v: Vec<f32>,
    pub row: usize,
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
                LayerKind::Attention => {
                    LayerState::Attn(KvCache { k: Vec::new(), v: Vec::new(), row: cfg.num_kv_heads * cfg.head_dim })
                }
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
                for cache in [&mut c.k, &mut c.v] {
                    cache.reserve(more * c.row);
                    // Touch the room now (as llama.cpp maps its context when it is made), not
                    // on the first page faults of a prefill or decode.
                    cache.spare_capacity_mut().iter_mut().for_each(|v| {
                        v.write(0.0);
                    });
                }
            }
        }
    }

    /// Bytes held by caches and states.
    pub fn state_bytes(&self) -> usize {
        self.layers
            .iter()
            .map(|l| match l {
                LayerState::Attn(c) => (c.k.capacity() + c.v.capacity()) * 4,
                LayerState::Delta(d) => (d.conv.len() + d.rec.len()) * 4,
            })
            .sum()
    }
}
