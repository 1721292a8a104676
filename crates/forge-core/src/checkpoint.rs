//! A model checkpoint seen through canonical Hugging Face tensor names.
//!
//! Canonical names are relative to the text model: `embed_tokens.weight`,
//! `layers.3.self_attn.q_proj.weight`, `norm.weight`, `lm_head.weight`. A Hugging Face directory
//! adds its prefix (`model.` or, for the multimodal `qwen3_5` wrapper, `model.language_model.`);
//! a GGUF file maps the names to llama.cpp's (`blk.3.attn_q.weight`, `blk.0.ssm_out.weight`) and
//! dequantizes to f32 ([`Checkpoint::get`]) or hands out matrices in their blocks as they are
//! stored ([`Checkpoint::gguf_block_matrix`]). Either way the tensors come out as the Hugging Face
//! checkpoint holds them: what llama.cpp's converter changed (the Q/K row permutation of `llama`;
//! the tiled value heads, `1 + w` norms and `-exp(A_log)` of `qwen35`) is undone.

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
            Checkpoint::Gguf { arch, .. } => gguf_name(arch, canonical).unwrap_or_else(|| canonical.to_string()),
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
            Checkpoint::Gguf { file, arch } => {
                let Some(name) = gguf_name(arch, canonical) else { return Ok(None) };
                let Some(info) = file.tensor(&name) else { return Ok(None) };
                let shape = info.shape();
                let data = file.dequantize(&name)?;
                let data = self
                    .gguf_layout(canonical, &shape)
                    .and_then(|l| l.apply(data, &shape))
                    .with_context(|| format!("{}: tensor '{name}'", file.path.display()))?;
                Ok(Some(HostTensor::from_f32(shape, data)))
            }
        }
    }

    /// A GGUF matrix of a block-quantized or 16-bit float type kept in its blocks over the file's
    /// mapping (no f32 copy), in canonical order (reordered rows and columns read through maps).
    /// None for a directory checkpoint, a missing tensor, or a type [`BlockMatrix`] does not hold.
    pub fn gguf_block_matrix(&self, canonical: &str) -> Result<Option<BlockMatrix>> {
        let Checkpoint::Gguf { file, arch } = self else { return Ok(None) };
        let Some(name) = gguf_name(arch, canonical) else { return Ok(None) };
        let Some(info) = file.tensor(&name) else { return Ok(None) };
        if !BlockMatrix::supports(info.ty) {
            return Ok(None);
        }
        let shown = || format!("{}: tensor '{name}'", file.path.display());
        let layout = self.gguf_layout(canonical, &info.shape()).with_context(shown)?;
        if layout.fix != Fix::Same {
            bail!("{}: a {} tensor where Forge expects floats", shown(), info.ty);
        }
        let Some(m) = file.block_matrix(&name, layout.rows)? else { return Ok(None) };
        match layout.cols {
            Some(map) => m.with_col_map(map).map(Some).with_context(shown),
            None => Ok(Some(m)),
        }
    }

    /// How the stored tensor of `canonical` (of stored `shape`) differs from the Hugging Face
    /// one: rows or columns that llama.cpp's converter reordered, values it transformed.
    fn gguf_layout(&self, canonical: &str, shape: &[usize]) -> Result<Layout> {
        let Checkpoint::Gguf { file, arch } = self else { return Ok(Layout::default()) };
        let rows = shape.first().copied().unwrap_or(1);
        let meta = |k: &str| file.get_u64(&format!("{arch}.{k}")).map(|v| usize::try_from(v).unwrap_or(usize::MAX));
        match arch.as_str() {
            "llama" => {
                let heads = if canonical.ends_with("q_proj.weight") {
                    meta("attention.head_count")
                } else if canonical.ends_with("k_proj.weight") {
                    meta("attention.head_count_kv").or_else(|| meta("attention.head_count"))
                } else {
                    None
                };
                let rows = heads.map(|h| unpermuted_row_map(rows, h)).transpose()?;
                Ok(Layout { rows, ..Layout::default() })
            }
            // The converter adds one to every `*norm.weight` but the DeltaNet's gated norm, stores
            // `-exp(A_log)`, and (with fewer key than value heads) tiles the value heads.
            "qwen35" => {
                let fix = if canonical.ends_with(".A_log") {
                    Fix::LogOfNegated
                } else if canonical.ends_with("norm.weight") && !canonical.ends_with("linear_attn.norm.weight") {
                    Fix::MinusOne
                } else {
                    Fix::Same
                };
                let Some((_, tail)) = canonical.split_once(".linear_attn.") else {
                    return Ok(Layout { fix, ..Layout::default() });
                };
                let need = |k: &str| meta(k).ok_or_else(|| anyhow!("missing '{arch}.{k}'"));
                let (nk, nv, kd) = (need("ssm.group_count")?, need("ssm.time_step_rank")?, need("ssm.state_size")?);
                if nk == 0 || nv == nk || !nv.is_multiple_of(nk) {
                    return Ok(Layout { fix, ..Layout::default() });
                }
                let vd = need("ssm.inner_size")? / nv;
                let key_channels = nk.saturating_mul(kd).saturating_mul(2);
                let cols = shape.get(1).copied().unwrap_or(1);
                // The map's length is checked against the stored shape before it is built, so
                // metadata that disagrees with the tensors never sizes an allocation.
                let tiled = |head_dim: usize, offset: usize, n: usize, what: &str| {
                    let len = nv.saturating_mul(head_dim).saturating_add(offset);
                    if len != n {
                        bail!("{n} {what}, but {nv} value heads of {head_dim} after {offset} key channels make {len}");
                    }
                    Ok(Some(tiled_value_heads(nk, nv / nk, head_dim, offset)))
                };
                let (row_map, col_map) = match tail {
                    "in_proj_qkv.weight" | "conv1d.weight" => (tiled(vd, key_channels, rows, "rows")?, None),
                    "in_proj_z.weight" => (tiled(vd, 0, rows, "rows")?, None),
                    "in_proj_a.weight" | "in_proj_b.weight" | "dt_bias" | "A_log" => (tiled(1, 0, rows, "rows")?, None),
                    "out_proj.weight" => (None, tiled(vd, 0, cols, "columns")?),
                    _ => (None, None),
                };
                Ok(Layout { rows: row_map, cols: col_map, fix })
            }
            _ => Ok(Layout::default()),
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

/// llama.cpp tensor name of a canonical HF name in a file of architecture `arch`.
fn gguf_name(arch: &str, canonical: &str) -> Option<String> {
    Some(match canonical {
        "embed_tokens.weight" => "token_embd.weight".into(),
        "norm.weight" => "output_norm.weight".into(),
        "lm_head.weight" => "output.weight".into(),
        _ => {
            let rest = canonical.strip_prefix("layers.")?;
            let (idx, tail) = rest.split_once('.')?;
            let mapped = match tail {
                "input_layernorm.weight" => "attn_norm.weight",
                "post_attention_layernorm.weight" if arch == "qwen35" => "post_attention_norm.weight",
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
                "linear_attn.in_proj_qkv.weight" => "attn_qkv.weight",
                "linear_attn.in_proj_z.weight" => "attn_gate.weight",
                "linear_attn.in_proj_a.weight" => "ssm_alpha.weight",
                "linear_attn.in_proj_b.weight" => "ssm_beta.weight",
                "linear_attn.out_proj.weight" => "ssm_out.weight",
                "linear_attn.conv1d.weight" => "ssm_conv1d.weight",
                "linear_attn.norm.weight" => "ssm_norm.weight",
                "linear_attn.dt_bias" => "ssm_dt.bias",
                "linear_attn.A_log" => "ssm_a",
                "mlp.gate_proj.weight" => "ffn_gate.weight",
                "mlp.up_proj.weight" => "ffn_up.weight",
                "mlp.down_proj.weight" => "ffn_down.weight",
                _ => return None,
            };
            format!("blk.{idx}.{mapped}")
        }
    })
}

/// How a GGUF tensor is read back into its Hugging Face form.
#[derive(Debug, Default, PartialEq)]
struct Layout {
    /// Stored row of each row (a permutation).
    rows: Option<Vec<u32>>,
    /// Stored column of each column (a permutation).
    cols: Option<Vec<u32>>,
    fix: Fix,
}

/// A transformation of the values that the converter applied and that is undone here.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
enum Fix {
    #[default]
    Same,
    /// Stored `1 + w`.
    MinusOne,
    /// Stored `-exp(w)`.
    LogOfNegated,
}

impl Layout {
    /// `data` (row-major, `shape`) in the Hugging Face order and values.
    fn apply(&self, data: Vec<f32>, shape: &[usize]) -> Result<Vec<f32>> {
        let rows = shape.first().copied().unwrap_or(1).max(1);
        let cols = data.len() / rows;
        let mut out = match &self.rows {
            Some(map) => {
                if map.len() != rows {
                    bail!("a row map of {} rows for shape {shape:?}", map.len());
                }
                map.iter().flat_map(|&r| &data[r as usize * cols..(r as usize + 1) * cols]).copied().collect()
            }
            None => data,
        };
        if let Some(map) = &self.cols {
            if map.len() != cols {
                bail!("a column map of {} columns for shape {shape:?}", map.len());
            }
            let mut row = vec![0f32; cols];
            for r in out.chunks_exact_mut(cols) {
                row.copy_from_slice(r);
                r.iter_mut().zip(map.iter()).for_each(|(y, &c)| *y = row[c as usize]);
            }
        }
        match self.fix {
            Fix::Same => {}
            Fix::MinusOne => out.iter_mut().for_each(|v| *v -= 1.0),
            Fix::LogOfNegated => {
                if let Some(v) = out.iter().find(|v| v.is_nan() || **v >= 0.0) {
                    bail!("holds {v}, but a stored -exp(A_log) is negative");
                }
                out.iter_mut().for_each(|v| *v = (-*v).ln());
            }
        }
        Ok(out)
    }
}

/// Where each entry of `offset` leading entries and then value heads in Hugging Face order
/// (grouped by key head: `k·r + v`) sits after llama.cpp's converter tiled them (`v·nk + k`), for
/// `nk` key heads of `r` value heads each, `head_dim` entries a head.
fn tiled_value_heads(nk: usize, r: usize, head_dim: usize, offset: usize) -> Vec<u32> {
    let heads = (0..nk * r).flat_map(|h| {
        let (k, v) = (h / r, h % r);
        let stored = v * nk + k;
        (0..head_dim).map(move |e| (offset + stored * head_dim + e) as u32)
    });
    (0..offset as u32).chain(heads).collect()
}

/// The GGUF row each HF row reads under llama.cpp's `permute`: within each head, GGUF row
/// `2j + p` is HF row `p·(d/2) + j`.
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

/// The configuration a GGUF file's metadata describes (llama-family architectures and the
/// `qwen35` hybrid).
pub fn config_from_gguf(f: &GgufFile) -> Result<ModelConfig> {
    let arch = f.get_str("general.architecture").ok_or_else(|| anyhow!("missing 'general.architecture'"))?;
    if !matches!(arch, "llama" | "qwen2" | "qwen3" | "mistral" | "qwen35") {
        bail!("unsupported GGUF architecture '{arch}' (supported: llama, qwen2, qwen3, mistral, qwen35)");
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
    // Multi-token-prediction blocks (`nextn_predict_layers`) follow the model's own layers.
    let num_layers = need("block_count")?.saturating_sub(int(&key("nextn_predict_layers")).unwrap_or(0));
    // Sizes the layer list below: checked before it is built.
    crate::config::check_range(&key("block_count"), num_layers, 0, crate::config::MAX_LAYERS)?;
    let hybrid = arch == "qwen35";
    let (layer_kinds, deltanet) = match hybrid {
        true => qwen35_layers(f, num_layers)?,
        false => (vec![crate::config::LayerKind::Attention; num_layers], None),
    };
    // Qwen3.5's attention doubles `attn_q` to carry its output gate.
    let first_attention = layer_kinds.iter().position(|k| *k == crate::config::LayerKind::Attention);
    let attn_output_gate = hybrid
        && first_attention
            .and_then(|i| f.tensor(&format!("blk.{i}.attn_q.weight")))
            .is_none_or(|t| t.shape().first().copied() == Some(num_heads.saturating_mul(head_dim).saturating_mul(2)));
    let rotary_dim = int(&key("rope.dimension_count")).unwrap_or(head_dim);
    let rope_scaling = match f.get_str(&key("rope.scaling.type")) {
        Some("linear") => {
            Some(crate::config::RopeScaling::Linear { factor: f.get_f32(&key("rope.scaling.factor")).unwrap_or(1.0) })
        }
        _ => None,
    };
    let cfg = ModelConfig {
        arch: if hybrid { Arch::Qwen35 } else { Arch::Llama },
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
        qk_norm: hybrid || f.tensor("blk.0.attn_q_norm.weight").is_some(),
        attn_output_gate,
        // The norms are read back as Hugging Face stores them (see `Checkpoint::gguf_layout`).
        norm_zero_centered: hybrid,
        layer_kinds,
        deltanet,
        max_position_embeddings: int(&key("context_length")).unwrap_or(2048),
        bos_token_id: f.get_u64("tokenizer.ggml.bos_token_id").map(|v| v as u32),
        eos_token_ids: f.get_u64("tokenizer.ggml.eos_token_id").map(|v| vec![v as u32]).unwrap_or_default(),
    };
    cfg.validate()?;
    Ok(cfg)
}

/// A `qwen35` file's layer kinds (`attention.recurrent_layers`, else every
/// `full_attention_interval`-th layer attends) and DeltaNet sizes (llama.cpp's `ssm.*` keys).
fn qwen35_layers(
    f: &GgufFile,
    num_layers: usize,
) -> Result<(Vec<crate::config::LayerKind>, Option<crate::config::DeltaNetConfig>)> {
    use crate::config::LayerKind;
    let int = |k: &str| f.get_u64(&format!("qwen35.{k}")).map(|v| usize::try_from(v).unwrap_or(usize::MAX));
    let need = |k: &str| int(k).ok_or_else(|| anyhow!("missing 'qwen35.{k}'"));
    let kinds: Vec<LayerKind> = match f.get_bool_array("qwen35.attention.recurrent_layers") {
        Some(rec) => {
            if rec.len() < num_layers {
                bail!("'qwen35.attention.recurrent_layers' has {} entries for {num_layers} layers", rec.len());
            }
            rec[..num_layers].iter().map(|&r| if r { LayerKind::DeltaNet } else { LayerKind::Attention }).collect()
        }
        None => {
            let interval = int("full_attention_interval").unwrap_or(4).max(1);
            (0..num_layers)
                .map(|i| if (i + 1) % interval == 0 { LayerKind::Attention } else { LayerKind::DeltaNet })
                .collect()
        }
    };
    let num_v_heads = need("ssm.time_step_rank")?;
    let inner = need("ssm.inner_size")?;
    if num_v_heads == 0 || !inner.is_multiple_of(num_v_heads) {
        bail!("'qwen35.ssm.inner_size' {inner} does not split into {num_v_heads} value heads");
    }
    let dn = crate::config::DeltaNetConfig {
        num_k_heads: need("ssm.group_count")?,
        num_v_heads,
        k_head_dim: need("ssm.state_size")?,
        v_head_dim: inner / num_v_heads,
        conv_kernel: need("ssm.conv_kernel")?,
    };
    if dn.num_k_heads == 0 || !dn.num_v_heads.is_multiple_of(dn.num_k_heads) {
        bail!(
            "{} value heads ('ssm.time_step_rank') are not a multiple of {} key heads ('ssm.group_count')",
            dn.num_v_heads,
            dn.num_k_heads
        );
    }
    Ok((kinds, Some(dn)))
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
        let map = unpermuted_row_map(rows, n_head).unwrap();
        let layout = Layout { rows: Some(map.clone()), ..Layout::default() };
        assert_eq!(layout.apply(gg.clone(), &[rows, cols]).unwrap(), hf);
        // Quantized GGUF matrices read through the same map.
        let mapped: Vec<f32> =
            map.iter().flat_map(|&r| gg[r as usize * cols..(r as usize + 1) * cols].to_vec()).collect();
        assert_eq!(mapped, hf);
        assert!(unpermuted_row_map(rows, 5).is_err());
    }
}
