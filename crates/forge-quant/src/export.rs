//! Writing exports in the seeds' layout (see docs/export.md): per-layer safetensors
//! (`layer_NN.safetensors` for the MLP, `layer_NN_mixer.safetensors` for the token mixer,
//! `lm_head.safetensors`, `embed.safetensors` for an untied embedding) plus `forge.json`, which
//! is written last: an export directory without it is incomplete.

use crate::quantize_matrix::QuantMatrix;
use anyhow::{anyhow, Context, Result};
use forge_core::fsutil::write_atomic;
use half::{bf16, f16};
use safetensors::tensor::Dtype;
use std::collections::BTreeMap;
use std::path::Path;

/// One matrix of an export file.
pub struct MatrixEntry {
    /// Key inside the file: the module path within the layer (`mlp.gate_proj`,
    /// `self_attn.k_proj`, `linear_attn.in_proj_qkv`) or `lm_head`.
    pub key: String,
    pub q: QuantMatrix,
    /// Online input rotation: (seed, block).
    pub rotation: Option<(u64, usize)>,
    /// Low-rank factors `A (cout × r)`, `B (r × cin)`, stored as FP16.
    pub lowrank: Option<(usize, Vec<f32>, Vec<f32>)>,
    /// Extra per-matrix metadata (`snr_db`, `heldout_snr_db`, …).
    pub stats: BTreeMap<String, String>,
}

fn f16_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|&x| f16::from_f32(x).to_le_bytes()).collect()
}

/// File name for a canonical matrix name (`layers.3.mlp.up_proj` → (`layer_03.safetensors`,
/// `mlp.up_proj`)).
pub fn file_and_key(canonical: &str) -> Result<(String, String)> {
    forge_model::export::file_and_key(canonical).ok_or_else(|| anyhow!("no export file for matrix {canonical}"))
}

/// Serialize entries into one safetensors file (atomically).
pub fn write_file(path: &Path, kind: &str, entries: &[MatrixEntry], extra: &BTreeMap<String, String>) -> Result<()> {
    let mut owned: Vec<(String, Dtype, Vec<usize>, Vec<u8>)> = Vec::new();
    let mut meta: BTreeMap<String, String> = BTreeMap::new();
    meta.insert("kind".into(), kind.into());
    for (k, v) in extra {
        meta.insert(k.clone(), v.clone());
    }
    for e in entries {
        let key = &e.key;
        let (cout, cin) = e.q.shape();
        meta.insert(format!("{key}.format"), e.q.format().long_name().into());
        match &e.q {
            QuantMatrix::Lut(m) => {
                let d = m.format.vec_dim();
                owned.push((format!("{key}.lut"), Dtype::F16, vec![m.format.entries(), d], f16_bytes(&m.codebook)));
                owned.push((format!("{key}.idx"), Dtype::U8, vec![cout / d, cin], m.idx.clone()));
                owned.push((format!("{key}.scale"), Dtype::F16, vec![cout], f16_bytes(&m.scale)));
            }
            QuantMatrix::Int8(m) => {
                owned.push((format!("{key}.int8"), Dtype::I8, vec![cout, cin], m.q.iter().map(|&v| v as u8).collect()));
                owned.push((format!("{key}.scale"), Dtype::F16, vec![cout], f16_bytes(&m.scale)));
            }
            QuantMatrix::Float { format, data, .. } => {
                let (dt, bytes) = match format {
                    forge_kernels::lut::Format::F16 => (Dtype::F16, f16_bytes(data)),
                    _ => (Dtype::BF16, data.iter().flat_map(|&x| bf16::from_f32(x).to_le_bytes()).collect()),
                };
                owned.push((format!("{key}.weight"), dt, vec![cout, cin], bytes));
            }
        }
        if let Some((seed, block)) = e.rotation {
            meta.insert(format!("{key}.rotation_seed"), seed.to_string());
            meta.insert(format!("{key}.rotation_block"), block.to_string());
        }
        if let Some((r, a, b)) = &e.lowrank {
            owned.push((format!("{key}.lr_a"), Dtype::F16, vec![cout, *r], f16_bytes(a)));
            owned.push((format!("{key}.lr_b"), Dtype::F16, vec![*r, cin], f16_bytes(b)));
        }
        for (k, v) in &e.stats {
            meta.insert(format!("{key}.{k}"), v.clone());
        }
    }
    let meta: BTreeMap<String, String> = meta.into_iter().collect();
    write_atomic(path, &serialize(&owned, &meta)).with_context(|| format!("writing {}", path.display()))
}

/// safetensors bytes with a deterministic header (tensors and metadata in sorted order, header
/// padded to 8 bytes), so that the same quantization always produces the same file.
fn serialize(tensors: &[(String, Dtype, Vec<usize>, Vec<u8>)], meta: &BTreeMap<String, String>) -> Vec<u8> {
    let mut order: Vec<usize> = (0..tensors.len()).collect();
    order.sort_by(|&a, &b| tensors[a].0.cmp(&tensors[b].0));
    let mut header = serde_json::Map::new();
    header.insert("__metadata__".into(), serde_json::to_value(meta).unwrap());
    let mut offset = 0usize;
    for &i in &order {
        let (name, dt, shape, bytes) = &tensors[i];
        let dtype = match dt {
            Dtype::F16 => "F16",
            Dtype::BF16 => "BF16",
            Dtype::U8 => "U8",
            Dtype::I8 => "I8",
            _ => "F32",
        };
        header.insert(
            name.clone(),
            serde_json::json!({"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + bytes.len()]}),
        );
        offset += bytes.len();
    }
    let mut h = serde_json::to_string(&serde_json::Value::Object(header)).unwrap().into_bytes();
    while !h.len().is_multiple_of(8) {
        h.push(b' ');
    }
    let mut out = Vec::with_capacity(8 + h.len() + offset);
    out.extend_from_slice(&(h.len() as u64).to_le_bytes());
    out.extend_from_slice(&h);
    for &i in &order {
        out.extend_from_slice(&tensors[i].3);
    }
    out
}

/// Write an FP16 embedding table (untied models).
pub fn write_embedding(path: &Path, table: &[f32], vocab: usize, hidden: usize) -> Result<()> {
    let t = [("embed_tokens.weight".to_string(), Dtype::F16, vec![vocab, hidden], f16_bytes(table))];
    let meta: BTreeMap<String, String> = [("kind".to_string(), "embed".to_string())].into();
    write_atomic(path, &serialize(&t, &meta))
}
