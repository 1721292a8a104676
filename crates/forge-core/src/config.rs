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

/// A `config.json` larger than this is not a configuration (real ones are a few KiB).
pub const MAX_CONFIG_BYTES: u64 = 16 << 20;
/// Bounds on a configuration's sizes, far above every published model (hidden sizes reach
/// 16 Ki, vocabularies 256 Ki, depths a few hundred layers). They are checked before anything is
/// sized from the configuration, so a corrupt or hostile file fails with the field's name
/// instead of an allocation of terabytes; the weights are then checked against the shapes the
/// configuration implies.
pub const MAX_DIM: usize = 1 << 20;
pub const MAX_VOCAB: usize = 1 << 24;
pub const MAX_LAYERS: usize = 1 << 14;
pub const MAX_HEADS: usize = 1 << 14;
pub const MAX_HEAD_DIM: usize = 1 << 14;
pub const MAX_CONV_KERNEL: usize = 1 << 10;
pub const MAX_POSITIONS: usize = 1 << 30;

/// `value` of `field` within `lo..=hi`.
pub(crate) fn check_range(field: &str, value: usize, lo: usize, hi: usize) -> Result<()> {
    if value < lo || value > hi {
        bail!("{field} {value} is out of range (expected {lo} to {hi})");
    }
    Ok(())
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
        let size = std::fs::metadata(&path).with_context(|| format!("{}: cannot read", path.display()))?.len();
        if size > MAX_CONFIG_BYTES {
            bail!("{}: {size} bytes is too large for a configuration (at most {MAX_CONFIG_BYTES})", path.display());
        }
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
        // Sizes the layer list below: checked before it is built.
        check_range("num_hidden_layers", num_layers, 0, MAX_LAYERS)?;
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
        let cfg = ModelConfig {
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
        };
        cfg.validate()?;
        Ok(cfg)
    }

    /// Every size within the bounds above (named by its `config.json` field), the products the
    /// model sizes its projections with representable, and the floats finite.
    pub fn validate(&self) -> Result<()> {
        check_range("vocab_size", self.vocab_size, 1, MAX_VOCAB)?;
        check_range("hidden_size", self.hidden_size, 1, MAX_DIM)?;
        check_range("intermediate_size", self.intermediate_size, 1, MAX_DIM)?;
        check_range("num_hidden_layers", self.num_layers, 0, MAX_LAYERS)?;
        check_range("num_attention_heads", self.num_heads, 1, MAX_HEADS)?;
        check_range("num_key_value_heads", self.num_kv_heads, 1, self.num_heads)?;
        check_range("head_dim", self.head_dim, 1, MAX_HEAD_DIM)?;
        check_range("rotary dimensions", self.rotary_dim, 0, self.head_dim)?;
        check_range("max_position_embeddings", self.max_position_embeddings, 0, MAX_POSITIONS)?;
        // With the bounds above none of these products overflows; their size is bounded too.
        check_range("num_attention_heads × head_dim", self.num_heads * self.head_dim, 1, MAX_DIM)?;
        if self.layer_kinds.len() != self.num_layers {
            bail!("{} layer kinds for {} layers", self.layer_kinds.len(), self.num_layers);
        }
        if let Some(d) = &self.deltanet {
            check_range("linear_num_key_heads", d.num_k_heads, 1, MAX_HEADS)?;
            check_range("linear_num_value_heads", d.num_v_heads, 1, MAX_HEADS)?;
            check_range("linear_key_head_dim", d.k_head_dim, 1, MAX_HEAD_DIM)?;
            check_range("linear_value_head_dim", d.v_head_dim, 1, MAX_HEAD_DIM)?;
            check_range("linear_conv_kernel_dim", d.conv_kernel, 1, MAX_CONV_KERNEL)?;
            check_range("linear_num_key_heads × linear_key_head_dim", d.key_dim(), 1, MAX_DIM)?;
            check_range("linear_num_value_heads × linear_value_head_dim", d.value_dim(), 1, MAX_DIM)?;
        }
        let finite_positive = |name: &str, x: f32| {
            if x.is_finite() && x > 0.0 {
                Ok(())
            } else {
                Err(anyhow!("{name} {x} must be a finite positive number"))
            }
        };
        finite_positive("rope_theta", self.rope_theta)?;
        if !(self.rms_eps.is_finite() && self.rms_eps >= 0.0) {
            bail!("rms_norm_eps {} must be a finite number ≥ 0", self.rms_eps);
        }
        match &self.rope_scaling {
            Some(RopeScaling::Linear { factor }) => finite_positive("rope scaling factor", *factor)?,
            Some(RopeScaling::Llama3 { factor, low_freq_factor, high_freq_factor, original_max_position }) => {
                finite_positive("rope scaling factor", *factor)?;
                finite_positive("low_freq_factor", *low_freq_factor)?;
                finite_positive("high_freq_factor", *high_freq_factor)?;
                finite_positive("original_max_position_embeddings", *original_max_position)?;
            }
            None => {}
        }
        Ok(())
    }

    /// Per-head dimension of the query projection output (doubled when the output gate rides along).
    pub fn q_proj_dim(&self) -> usize {
        self.num_heads * self.head_dim * if self.attn_output_gate { 2 } else { 1 }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fixture(name: &str) -> Value {
        let path = format!("{}/../../tests/fixtures/{name}/config.json", env!("CARGO_MANIFEST_DIR"));
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap()
    }

    fn refused(v: &Value) -> String {
        let e = ModelConfig::from_hf_json(v).expect_err(&v.to_string());
        e.to_string()
    }

    #[test]
    fn config_absurd_sizes_are_refused_naming_the_field() {
        for name in ["qwen35_tiny", "qwen35_tiny_mm", "llama_tiny", "llama3_tiny", "qwen2_tiny", "qwen3_tiny"] {
            ModelConfig::from_hf_json(&fixture(name)).unwrap();
        }
        let base = fixture("qwen35_tiny");
        let with = |key: &str, value: Value| {
            let mut v = base.clone();
            v[key] = value;
            v
        };
        let cases = [
            ("hidden_size", Value::from(1_000_000_000_000u64), "hidden_size 1000000000000 is out of range"),
            ("vocab_size", Value::from(u64::MAX), "vocab_size"),
            ("intermediate_size", Value::from(1u64 << 40), "intermediate_size"),
            ("head_dim", Value::from(1u64 << 40), "head_dim"),
            ("num_attention_heads", Value::from(1u64 << 31), "num_attention_heads"),
            ("linear_num_value_heads", Value::from(1u64 << 32), "linear_num_value_heads"),
            ("linear_conv_kernel_dim", Value::from(1u64 << 40), "linear_conv_kernel_dim"),
            ("max_position_embeddings", Value::from(1u64 << 62), "max_position_embeddings"),
            ("rms_norm_eps", Value::from(-1.0), "rms_norm_eps"),
        ];
        for (key, value, needle) in cases {
            let e = refused(&with(key, value));
            assert!(e.contains(needle), "{key}: {e}");
        }
        // The layer list is sized from num_hidden_layers: refused before it is built.
        let mut v = with("num_hidden_layers", Value::from(1_000_000_000_000u64));
        v.as_object_mut().unwrap().remove("layer_types");
        assert!(refused(&v).contains("num_hidden_layers 1000000000000 is out of range"));
        let mut v = base.clone();
        v["rope_parameters"]["partial_rotary_factor"] = Value::from(1e30);
        assert!(refused(&v).contains("rotary dimensions"));
        v["rope_parameters"]["partial_rotary_factor"] = Value::from(0.25);
        v["rope_parameters"]["rope_theta"] = Value::from(-5.0);
        assert!(refused(&v).contains("rope_theta"));
        // A config.json too large to be one is not read.
        let dir = std::env::temp_dir().join(format!("forge-config-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("config.json"), vec![b' '; MAX_CONFIG_BYTES as usize + 1]).unwrap();
        let e = format!("{:#}", ModelConfig::from_hf_dir(&dir).unwrap_err());
        std::fs::remove_dir_all(&dir).unwrap();
        assert!(e.contains("config.json") && e.contains("too large"), "{e}");
    }
}
