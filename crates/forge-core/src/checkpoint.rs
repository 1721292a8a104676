//! A model checkpoint seen through canonical Hugging Face tensor names.
//!
//! Canonical names are relative to the text model: `embed_tokens.weight`,
//! `layers.3.self_attn.q_proj.weight`, `norm.weight`, `lm_head.weight`. A Hugging Face directory
//! adds its prefix (`model.` or, for the multimodal `qwen3_5` wrapper, `model.language_model.`);
//! a GGUF file maps the names to llama.cpp's (`blk.3.attn_q.weight`) and dequantizes to f32
//! ([`Checkpoint::get`]) or hands out block-quantized matrices as they are stored
//! ([`Checkpoint::gguf_block_matrix`]), undoing the Q/K row permutation that llama.cpp's
//! converter applies to `llama` models either way.

use crate::config::{Arch, ModelConfig};
use crate::gguf::{BlockMatrix, GgufFile};
use crate::safetensors_dir::SafetensorsSet;
use crate::tensor::HostTensor;
use crate::tokenizer::GgufVocab;
use anyhow::{anyhow, bail, Context, Result};
use std::path::{Path, PathBuf};

pub enum Checkpoint {
    Hf { dir: PathBuf, set: SafetensorsSet, prefix: String },
    Gguf { file: Box<GgufFile>, arch: String },
}

impl Checkpoint {
    /// Open a Hugging Face directory or a `.gguf` file and read its configuration.
    pub fn open(path: &Path) -> Result<(Checkpoint, ModelConfig)> {
        if path.is_dir() {
            let cfg = ModelConfig::from_hf_dir(path)?;
            let set = SafetensorsSet::open_dir(path)?;
            let prefix = ["model.language_model.", "model.", ""]
                .into_iter()
                .find(|p| set.contains(&format!("{p}embed_tokens.weight")))
                .ok_or_else(|| {
                    anyhow!(
                        "{}: no embed_tokens.weight under model.language_model., model. or the root",
                        path.display()
                    )
                })?
                .to_string();
            Ok((Checkpoint::Hf { dir: path.to_path_buf(), set, prefix }, cfg))
        } else {
            Self::from_gguf(GgufFile::open(path)?)
        }
    }

    /// A parsed GGUF file as a checkpoint, with the configuration its metadata describes.
    pub fn from_gguf(file: GgufFile) -> Result<(Checkpoint, ModelConfig)> {
        let cfg = config_from_gguf(&file).with_context(|| format!("{}", file.path.display()))?;
        let arch = file.get_str("general.architecture").unwrap_or("").to_string();
        Ok((Checkpoint::Gguf { file: Box::new(file), arch }, cfg))
    }

    pub fn path(&self) -> &Path {
        match self {
            Checkpoint::Hf { dir, .. } => dir,
            Checkpoint::Gguf { file, .. } => &file.path,
        }
    }

    /// Name of `canonical` in the underlying file (for messages).
    pub fn stored_name(&self, canonical: &str) -> String {
        match self {
            Checkpoint::Hf { prefix, .. } => {
                if canonical == "lm_head.weight" {
                    canonical.to_string()
                } else {
                    format!("{prefix}{canonical}")
                }
            }
            Checkpoint::Gguf { .. } => gguf_name(canonical).unwrap_or_else(|| canonical.to_string()),
        }
    }

    /// [`SafetensorsSet::advise_random`] for `canonical` (nothing to advise for a GGUF file).
    pub fn advise_random(&self, canonical: &str) {
        if let Checkpoint::Hf { set, .. } = self {
            set.advise_random(&self.stored_name(canonical));
        }
    }

    /// [`SafetensorsSet::release`] for every tensor whose canonical name starts with
    /// `canonical_prefix` (`layers.3.`, `lm_head.`). A GGUF file's pages are left as they are.
    pub fn release(&self, canonical_prefix: &str) {
        if let Checkpoint::Hf { set, .. } = self {
            let stored = match canonical_prefix.starts_with("lm_head") {
                true => canonical_prefix.to_string(),
                false => self.stored_name(canonical_prefix),
            };
            let names: Vec<String> = set.names().filter(|n| n.starts_with(&stored)).map(str::to_string).collect();
            names.iter().for_each(|n| set.release(n));
        }
    }

    /// The tensor, if present; errors only on unreadable data.
    pub fn get(&self, canonical: &str) -> Result<Option<HostTensor>> {
        match self {
            Checkpoint::Hf { set, .. } => set.get(&self.stored_name(canonical)),
            Checkpoint::Gguf { file, .. } => {
                let Some(name) = gguf_name(canonical) else { return Ok(None) };
                let Some(info) = file.tensor(&name) else { return Ok(None) };
                let shape = info.shape();
                let mut data = file.dequantize(&name)?;
                if let Some(h) = self.llama_heads(canonical) {
                    data = unpermute_rows(&data, &shape, h)
                        .with_context(|| format!("{}: tensor '{name}'", file.path.display()))?;
                }
                Ok(Some(HostTensor::from_f32(shape, data)))
            }
        }
    }

    /// A GGUF tensor of a block-quantized type kept in its blocks over the file's mapping (no
    /// f32 copy), in canonical row order (llama's Q/K permutation undone through a row map).
    /// None for a directory checkpoint, a missing tensor, or a type that is not block-quantized.
    pub fn gguf_block_matrix(&self, canonical: &str) -> Result<Option<BlockMatrix>> {
        let Checkpoint::Gguf { file, .. } = self else { return Ok(None) };
        let Some(name) = gguf_name(canonical) else { return Ok(None) };
        let Some(info) = file.tensor(&name) else { return Ok(None) };
        if !BlockMatrix::supports(info.ty) {
            return Ok(None);
        }
        let heads = self.llama_heads(canonical);
        let row_map = match (heads, &info.shape()[..]) {
            (Some(h), &[rows, _]) => {
                Some(unpermuted_row_map(rows, h).with_context(|| format!("{}: tensor '{name}'", file.path.display()))?)
            }
            _ => None,
        };
        file.block_matrix(&name, row_map)
    }

    /// For a `llama` GGUF's Q/K projection weight, the head count its rows were permuted by.
    fn llama_heads(&self, canonical: &str) -> Option<usize> {
        let Checkpoint::Gguf { file, arch } = self else { return None };
        if arch != "llama" {
            return None;
        }
        let n_head = |k: &str| file.get_u64(&format!("llama.attention.{k}")).map(|v| v as usize);
        if canonical.ends_with("q_proj.weight") {
            n_head("head_count")
        } else if canonical.ends_with("k_proj.weight") {
            n_head("head_count_kv").or_else(|| n_head("head_count"))
        } else {
            None
        }
    }

    /// The tensor, required with an exact shape.
    pub fn require(&self, canonical: &str, shape: &[usize]) -> Result<HostTensor> {
        let t = self
            .get(canonical)?
            .ok_or_else(|| anyhow!("{}: missing tensor '{}'", self.path().display(), self.stored_name(canonical)))?;
        if t.shape != shape {
            bail!(
                "{}: tensor '{}' has shape {:?}, the config implies {:?}",
                self.path().display(),
                self.stored_name(canonical),
                t.shape,
                shape
            );
        }
        Ok(t)
    }

    /// Like `require` but accepts any shape with the same number of elements (e.g. a conv
    /// weight stored as `[C, 1, K]` and read as `[C, K]`).
    pub fn require_numel(&self, canonical: &str, shape: &[usize]) -> Result<HostTensor> {
        let mut t = self
            .get(canonical)?
            .ok_or_else(|| anyhow!("{}: missing tensor '{}'", self.path().display(), self.stored_name(canonical)))?;
        if t.numel() != shape.iter().product::<usize>() {
            bail!(
                "{}: tensor '{}' has shape {:?}, expected {:?}",
                self.path().display(),
                self.stored_name(canonical),
                t.shape,
                shape
            );
        }
        t.shape = shape.to_vec();
        Ok(t)
    }

    /// The GGUF-embedded vocabulary, when this is a GGUF file.
    pub fn gguf_vocab(&self) -> Option<GgufVocab> {
        let Checkpoint::Gguf { file, .. } = self else { return None };
        let u = |k: &str| file.get_u64(k).map(|v| v as u32);
        Some(GgufVocab {
            model: file.get_str("tokenizer.ggml.model").unwrap_or("gpt2").to_string(),
            pre: file.get_str("tokenizer.ggml.pre").map(|s| s.to_string()),
            tokens: file.get_str_array("tokenizer.ggml.tokens")?.into_iter().map(String::from).collect(),
            token_types: file
                .get_i64_array("tokenizer.ggml.token_type")
                .map(|v| v.into_iter().map(|x| x as i32).collect())
                .unwrap_or_default(),
            scores: file.get_f32_array("tokenizer.ggml.scores").unwrap_or_default(),
            merges: file
                .get_str_array("tokenizer.ggml.merges")
                .map(|v| v.into_iter().map(String::from).collect())
                .unwrap_or_default(),
            bos: u("tokenizer.ggml.bos_token_id"),
            eos: u("tokenizer.ggml.eos_token_id"),
            eot: u("tokenizer.ggml.eot_token_id"),
            pad: u("tokenizer.ggml.padding_token_id"),
            add_bos: file.get_bool("tokenizer.ggml.add_bos_token"),
        })
    }

    /// The GGUF-embedded chat template.
    pub fn gguf_chat_template(&self) -> Option<String> {
        match self {
            Checkpoint::Gguf { file, .. } => file.get_str("tokenizer.chat_template").map(String::from),
            _ => None,
        }
    }
}

/// llama.cpp tensor name of a canonical HF name.
fn gguf_name(canonical: &str) -> Option<String> {
    Some(match canonical {
        "embed_tokens.weight" => "token_embd.weight".into(),
        "norm.weight" => "output_norm.weight".into(),
        "lm_head.weight" => "output.weight".into(),
        _ => {
            let rest = canonical.strip_prefix("layers.")?;
            let (idx, tail) = rest.split_once('.')?;
            let mapped = match tail {
                "input_layernorm.weight" => "attn_norm.weight",
                "post_attention_layernorm.weight" => "ffn_norm.weight",
                "self_attn.q_proj.weight" => "attn_q.weight",
                "self_attn.k_proj.weight" => "attn_k.weight",
                "self_attn.v_proj.weight" => "attn_v.weight",
                "self_attn.o_proj.weight" => "attn_output.weight",
                "self_attn.q_proj.bias" => "attn_q.bias",
                "self_attn.k_proj.bias" => "attn_k.bias",
                "self_attn.v_proj.bias" => "attn_v.bias",
                "self_attn.o_proj.bias" => "attn_output.bias",
                "self_attn.q_norm.weight" => "attn_q_norm.weight",
                "self_attn.k_norm.weight" => "attn_k_norm.weight",
                "mlp.gate_proj.weight" => "ffn_gate.weight",
                "mlp.up_proj.weight" => "ffn_up.weight",
                "mlp.down_proj.weight" => "ffn_down.weight",
                _ => return None,
            };
            format!("blk.{idx}.{mapped}")
        }
    })
}

/// The GGUF row each HF row reads under llama.cpp's `permute` (see [`unpermute_rows`]).
fn unpermuted_row_map(rows: usize, n_head: usize) -> Result<Vec<u32>> {
    if n_head == 0 || !rows.is_multiple_of(n_head) || !(rows / n_head).is_multiple_of(2) {
        bail!("{rows} rows do not split into {n_head} heads of even size");
    }
    let hd = rows / n_head;
    let half = hd / 2;
    Ok((0..rows)
        .map(|dst| {
            let (h, w) = (dst / hd, dst % hd);
            (h * hd + 2 * (w % half) + w / half) as u32
        })
        .collect())
}

/// Undo llama.cpp's `permute`: within each head, GGUF row `2j + p` is HF row `p·(d/2) + j`.
fn unpermute_rows(data: &[f32], shape: &[usize], n_head: usize) -> Result<Vec<f32>> {
    let (rows, cols) = match shape {
        [r, c] => (*r, *c),
        [r] => (*r, 1),
        _ => bail!("expected a matrix, found shape {shape:?}"),
    };
    if n_head == 0 || rows % n_head != 0 || !(rows / n_head).is_multiple_of(2) {
        bail!("{rows} rows do not split into {n_head} heads of even size");
    }
    let hd = rows / n_head;
    let half = hd / 2;
    let mut out = vec![0f32; data.len()];
    for h in 0..n_head {
        for j in 0..half {
            for p in 0..2 {
                let src = h * hd + 2 * j + p;
                let dst = h * hd + p * half + j;
                out[dst * cols..(dst + 1) * cols].copy_from_slice(&data[src * cols..(src + 1) * cols]);
            }
        }
    }
    Ok(out)
}

/// The configuration a GGUF file's metadata describes (llama-family architectures).
pub fn config_from_gguf(f: &GgufFile) -> Result<ModelConfig> {
    let arch = f.get_str("general.architecture").ok_or_else(|| anyhow!("missing 'general.architecture'"))?;
    if !matches!(arch, "llama" | "qwen2" | "qwen3" | "mistral") {
        bail!("unsupported GGUF architecture '{arch}' (supported: llama, qwen2, qwen3, mistral)");
    }
    let key = |k: &str| format!("{arch}.{k}");
    // Values beyond usize saturate; the bounds of `ModelConfig::validate` refuse them.
    let int = |k: &str| f.get_u64(k).map(|v| usize::try_from(v).unwrap_or(usize::MAX));
    let need = |k: &str| int(&key(k)).ok_or_else(|| anyhow!("missing '{}'", key(k)));
    let hidden_size = need("embedding_length")?;
    let num_heads = need("attention.head_count")?;
    let num_kv_heads = int(&key("attention.head_count_kv")).unwrap_or(num_heads);
    let head_dim = int(&key("attention.key_length")).unwrap_or(hidden_size / num_heads.max(1));
    if num_heads == 0 || num_kv_heads == 0 || num_heads % num_kv_heads != 0 || head_dim == 0 {
        bail!("invalid head configuration: {num_heads} heads, {num_kv_heads} kv heads");
    }
    let emb = f.tensor("token_embd.weight").ok_or_else(|| anyhow!("missing tensor 'token_embd.weight'"))?;
    let vocab_size = match emb.shape()[..] {
        [vocab, _] => vocab,
        ref other => bail!("tensor 'token_embd.weight' has shape {other:?}, expected [vocab, hidden]"),
    };
    let num_layers = need("block_count")?;
    // Sizes the layer list below: checked before it is built.
    crate::config::check_range(&key("block_count"), num_layers, 0, crate::config::MAX_LAYERS)?;
    let rotary_dim = int(&key("rope.dimension_count")).unwrap_or(head_dim);
    let rope_scaling = match f.get_str(&key("rope.scaling.type")) {
        Some("linear") => {
            Some(crate::config::RopeScaling::Linear { factor: f.get_f32(&key("rope.scaling.factor")).unwrap_or(1.0) })
        }
        _ => None,
    };
    let cfg = ModelConfig {
        arch: Arch::Llama,
        model_type: arch.to_string(),
        vocab_size,
        hidden_size,
        intermediate_size: need("feed_forward_length")?,
        num_layers,
        num_heads,
        num_kv_heads,
        head_dim,
        rms_eps: f.get_f32(&key("attention.layer_norm_rms_epsilon")).unwrap_or(1e-5),
        rope_theta: f.get_f32(&key("rope.freq_base")).unwrap_or(10000.0),
        rotary_dim,
        rope_scaling,
        tie_embeddings: f.tensor("output.weight").is_none(),
        attention_bias: f.tensor("blk.0.attn_q.bias").is_some(),
        qk_norm: f.tensor("blk.0.attn_q_norm.weight").is_some(),
        attn_output_gate: false,
        norm_zero_centered: false,
        layer_kinds: vec![crate::config::LayerKind::Attention; num_layers],
        deltanet: None,
        max_position_embeddings: int(&key("context_length")).unwrap_or(2048),
        bos_token_id: f.get_u64("tokenizer.ggml.bos_token_id").map(|v| v as u32),
        eos_token_ids: f.get_u64("tokenizer.ggml.eos_token_id").map(|v| vec![v as u32]).unwrap_or_default(),
    };
    cfg.validate()?;
    Ok(cfg)
}

#[cfg(test)]
mod tests {
    use super::*;
    #[test]
    fn unpermute_inverts_llama_cpp_permute() {
        // llama.cpp: w.reshape(n_head, 2, hd/2, cols).swapaxes(1, 2).reshape(rows, cols)
        let (n_head, hd, cols) = (2, 6, 3);
        let rows = n_head * hd;
        let hf: Vec<f32> = (0..rows * cols).map(|i| i as f32).collect();
        let mut gg = vec![0f32; hf.len()];
        for h in 0..n_head {
            for p in 0..2 {
                for j in 0..hd / 2 {
                    // source index (h, p, j) lands at (h, j, p)
                    let src = h * hd + p * (hd / 2) + j;
                    let dst = h * hd + j * 2 + p;
                    gg[dst * cols..(dst + 1) * cols].copy_from_slice(&hf[src * cols..(src + 1) * cols]);
                }
            }
        }
        assert_eq!(unpermute_rows(&gg, &[rows, cols], n_head).unwrap(), hf);
        // The row map (what quantized GGUF matrices read through) does the same.
        let map = unpermuted_row_map(rows, n_head).unwrap();
        let mapped: Vec<f32> =
            map.iter().flat_map(|&r| gg[r as usize * cols..(r as usize + 1) * cols].to_vec()).collect();
        assert_eq!(mapped, hf);
        assert!(unpermuted_row_map(rows, 5).is_err());
    }
}
