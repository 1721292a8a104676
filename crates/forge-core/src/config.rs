//! One model configuration for every supported architecture, read from a Hugging Face
//! `config.json` or from GGUF metadata.

use anyhow::{anyhow, bail, Context, Result};
use serde_json::Value;
use std::path::Path;

/// Architecture family: decides which graph runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Arch {
    /// Llama, Mistral, Qwen2, Qwen3, SmolLM: dense pre-norm transformer.
    Llama,
    /// Qwen3.5 hybrid: Gated DeltaNet + gated full attention.
    Qwen35,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LayerKind {
    Attention,
    DeltaNet,
}

/// Llama-3 style frequency scaling of RoPE.
#[derive(Debug, Clone, PartialEq)]
pub enum RopeScaling {
    Llama3 { factor: f32, low_freq_factor: f32, high_freq_factor: f32, original_max_position: f32 },
    Linear { factor: f32 },
}

#[derive(Debug, Clone, PartialEq)]
pub struct DeltaNetConfig {
    pub num_k_heads: usize,
    pub num_v_heads: usize,
    pub k_head_dim: usize,
    pub v_head_dim: usize,
    pub conv_kernel: usize,
}

impl DeltaNetConfig {
    pub fn key_dim(&self) -> usize {
        self.num_k_heads * self.k_head_dim
    }
    pub fn value_dim(&self) -> usize {
        self.num_v_heads * self.v_head_dim
    }
    pub fn conv_dim(&self) -> usize {
        2 * self.key_dim() + self.value_dim()
    }
}

#[derive(Debug, Clone, PartialEq)]
pub struct ModelConfig {
    pub arch: Arch,
    pub model_type: String,
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_layers: usize,
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub rms_eps: f32,
    pub rope_theta: f32,
    /// Number of leading head dims that RoPE rotates (partial rotary).
    pub rotary_dim: usize,
    pub rope_scaling: Option<RopeScaling>,
    pub tie_embeddings: bool,
    pub attention_bias: bool,
    /// Per-head RMSNorm on q and k (Qwen3, Qwen3.5).
    pub qk_norm: bool,
    /// Sigmoid output gate from a doubled q_proj (Qwen3.5).
    pub attn_output_gate: bool,
    /// RMSNorm computes `x̂·(1+w)` (Qwen3.5) instead of `x̂·w`.
    pub norm_zero_centered: bool,
    pub layer_kinds: Vec<LayerKind>,
    pub deltanet: Option<DeltaNetConfig>,
    pub max_position_embeddings: usize,
    pub bos_token_id: Option<u32>,
    pub eos_token_ids: Vec<u32>,
}

fn get_usize(v: &Value, key: &str) -> Option<usize> {
    v.get(key).and_then(|x| x.as_u64()).map(|x| x as usize)
}
fn get_f32(v: &Value, key: &str) -> Option<f32> {
    v.get(key).and_then(|x| x.as_f64()).map(|x| x as f32)
}

impl ModelConfig {
    /// Read `config.json` in a Hugging Face model directory.
    pub fn from_hf_dir(dir: &Path) -> Result<Self> {
        let path = dir.join("config.json");
        let text = std::fs::read_to_string(&path).with_context(|| format!("{}: cannot read", path.display()))?;
        let v: Value = serde_json::from_str(&text).with_context(|| format!("{}: malformed JSON", path.display()))?;
        Self::from_hf_json(&v).with_context(|| format!("{}", path.display()))
    }

    pub fn from_hf_json(root: &Value) -> Result<Self> {
        let model_type = root
            .get("model_type")
            .and_then(|m| m.as_str())
            .ok_or_else(|| anyhow!("missing string field 'model_type'"))?
            .to_string();
        // Multimodal wrappers keep the language model under `text_config`.
        let (v, arch) = match model_type.as_str() {
            "qwen3_5" => (
                root.get("text_config").ok_or_else(|| anyhow!("model_type qwen3_5 without 'text_config'"))?,
                Arch::Qwen35,
            ),
            "qwen3_5_text" => (root, Arch::Qwen35),
            "llama" | "mistral" | "qwen2" | "qwen3" | "smollm" | "smollm2" => (root, Arch::Llama),
            other => {
                bail!("unknown model_type '{other}' (supported: qwen3_5, qwen3_5_text, llama, mistral, qwen2, qwen3)")
            }
        };
        let need = |key: &str| get_usize(v, key).ok_or_else(|| anyhow!("missing integer field '{key}'"));
        let hidden_size = need("hidden_size")?;
        let num_heads = need("num_attention_heads")?;
        let num_layers = need("num_hidden_layers")?;
        let num_kv_heads = get_usize(v, "num_key_value_heads").unwrap_or(num_heads);
        let head_dim = match v.get("head_dim") {
            Some(Value::Number(n)) => n.as_u64().unwrap_or(0) as usize,
            _ => hidden_size / num_heads.max(1),
        };
        if head_dim == 0 || num_heads == 0 || num_kv_heads == 0 || num_heads % num_kv_heads != 0 {
            bail!("invalid head configuration: {num_heads} heads, {num_kv_heads} kv heads, head_dim {head_dim}");
        }
        // RoPE: transformers 5 keeps it in `rope_parameters`, older configs use `rope_theta` +
        // `rope_scaling` + `partial_rotary_factor` at the top level.
        let rp = v.get("rope_parameters").filter(|x| x.is_object());
        let rs = v.get("rope_scaling").filter(|x| x.is_object());
        let theta = rp
            .and_then(|r| get_f32(r, "rope_theta"))
            .or_else(|| get_f32(v, "rope_theta"))
            .ok_or_else(|| anyhow!("missing 'rope_theta' (in rope_parameters or top level)"))?;
        let partial = rp
            .and_then(|r| get_f32(r, "partial_rotary_factor"))
            .or_else(|| get_f32(v, "partial_rotary_factor"))
            .unwrap_or(if arch == Arch::Qwen35 { 0.25 } else { 1.0 });
        let rotary_dim = ((head_dim as f32 * partial) as usize) & !1;
        let scaling_src = rp.or(rs);
        let rope_type = scaling_src
            .and_then(|r| r.get("rope_type").or_else(|| r.get("type")))
            .and_then(|t| t.as_str())
            .unwrap_or("default");
        let rope_scaling = match rope_type {
            "default" | "mrope" => None,
            "llama3" => {
                let r = scaling_src.unwrap();
                let f = |k: &str| get_f32(r, k).ok_or_else(|| anyhow!("llama3 rope scaling without '{k}'"));
                Some(RopeScaling::Llama3 {
                    factor: f("factor")?,
                    low_freq_factor: f("low_freq_factor")?,
                    high_freq_factor: f("high_freq_factor")?,
                    original_max_position: f("original_max_position_embeddings")?,
                })
            }
            "linear" => Some(RopeScaling::Linear {
                factor: get_f32(scaling_src.unwrap(), "factor")
                    .ok_or_else(|| anyhow!("linear rope without 'factor'"))?,
            }),
            other => bail!("unsupported rope type '{other}'"),
        };
        let tie = root
            .get("tie_word_embeddings")
            .or_else(|| v.get("tie_word_embeddings"))
            .and_then(|t| t.as_bool())
            .unwrap_or(false);
        let (layer_kinds, deltanet) = if arch == Arch::Qwen35 {
            let kinds = match v.get("layer_types").and_then(|l| l.as_array()) {
                Some(list) => list
                    .iter()
                    .enumerate()
                    .map(|(i, t)| match t.as_str() {
                        Some("linear_attention") => Ok(LayerKind::DeltaNet),
                        Some("full_attention") => Ok(LayerKind::Attention),
                        _ => Err(anyhow!("layer_types[{i}] = {t} is not linear_attention/full_attention")),
                    })
                    .collect::<Result<Vec<_>>>()?,
                None => {
                    let interval = get_usize(v, "full_attention_interval").unwrap_or(4).max(1);
                    (0..num_layers)
                        .map(|i| if (i + 1) % interval == 0 { LayerKind::Attention } else { LayerKind::DeltaNet })
                        .collect()
                }
            };
            if kinds.len() != num_layers {
                bail!("layer_types has {} entries for {num_layers} layers", kinds.len());
            }
            let dn = DeltaNetConfig {
                num_k_heads: get_usize(v, "linear_num_key_heads").unwrap_or(16),
                num_v_heads: get_usize(v, "linear_num_value_heads").unwrap_or(32),
                k_head_dim: get_usize(v, "linear_key_head_dim").unwrap_or(128),
                v_head_dim: get_usize(v, "linear_value_head_dim").unwrap_or(128),
                conv_kernel: get_usize(v, "linear_conv_kernel_dim").unwrap_or(4),
            };
            if dn.num_k_heads == 0 || !dn.num_v_heads.is_multiple_of(dn.num_k_heads) {
                bail!(
                    "linear_num_value_heads {} is not a multiple of linear_num_key_heads {}",
                    dn.num_v_heads,
                    dn.num_k_heads
                );
            }
            (kinds, Some(dn))
        } else {
            (vec![LayerKind::Attention; num_layers], None)
        };
        let eos_token_ids = match v.get("eos_token_id").or_else(|| root.get("eos_token_id")) {
            Some(Value::Number(n)) => n.as_u64().map(|x| vec![x as u32]).unwrap_or_default(),
            Some(Value::Array(a)) => a.iter().filter_map(|x| x.as_u64().map(|x| x as u32)).collect(),
            _ => vec![],
        };
        Ok(ModelConfig {
            arch,
            vocab_size: need("vocab_size")?,
            hidden_size,
            intermediate_size: need("intermediate_size")?,
            num_layers,
            num_heads,
            num_kv_heads,
            head_dim,
            rms_eps: get_f32(v, "rms_norm_eps").unwrap_or(1e-6),
            rope_theta: theta,
            rotary_dim,
            rope_scaling,
            tie_embeddings: tie,
            attention_bias: v.get("attention_bias").and_then(|b| b.as_bool()).unwrap_or(model_type == "qwen2"),
            qk_norm: arch == Arch::Qwen35 || model_type == "qwen3",
            attn_output_gate: arch == Arch::Qwen35
                && v.get("attn_output_gate").and_then(|b| b.as_bool()).unwrap_or(true),
            norm_zero_centered: arch == Arch::Qwen35,
            layer_kinds,
            deltanet,
            max_position_embeddings: get_usize(v, "max_position_embeddings").unwrap_or(4096),
            bos_token_id: v.get("bos_token_id").and_then(|x| x.as_u64()).map(|x| x as u32),
            eos_token_ids,
            model_type,
        })
    }

    /// Per-head dimension of the query projection output (doubled when the output gate rides along).
    pub fn q_proj_dim(&self) -> usize {
        self.num_heads * self.head_dim * if self.attn_output_gate { 2 } else { 1 }
    }
}
