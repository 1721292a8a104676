//! `forge synth`: a **random-weight** export with a real model's shapes and the release-0.2 plan,
//! for speed and memory benchmarks only. It is not a model: every index, codebook, scale, INT8
//! code and low-rank factor is drawn at random, so its outputs are meaningless.
//!
//! What it writes is an ordinary export (docs/export.md) that `--model DIR` loads: per-layer
//! safetensors, `lm_head.safetensors`, and `forge.json` last, plus the minimal source checkpoint
//! under `DIR/source/` holding what an export does not (norms, DeltaNet conv1d / `A_log` /
//! `dt_bias`, q/k norms and the untied BF16 embedding), with `config.json` in the real Hugging
//! Face `qwen3_5` layout (`text_config` nested). One file at a time is generated (rayon-parallel,
//! in fixed chunks with their own seeds, so the bytes do not depend on the thread count) and
//! written atomically; the embedding is streamed, so memory stays at one layer's tensors (the
//! head, the largest single matrix, at most).

use crate::export::{file_and_key, write_file, write_streaming, MatrixEntry, TensorSpec};
use crate::fit::{f16_round, normal_samples, snap_codebook};
use crate::inspect::{inspect, Report};
use crate::plan::{role_of, Basis, Part, Plan};
use crate::quantize::{matrix_seed, source_fingerprint, TOOL_VERSION};
use crate::quantize_matrix::QuantMatrix;
use anyhow::{bail, Context, Result};
use forge_core::config::{LayerKind, ModelConfig};
use forge_core::fsutil::write_atomic;
use forge_kernels::lut::{Format, Int8Matrix, LutMatrix};
use forge_kernels::rotation::Rotation;
use forge_model::sampling::Rng;
use half::bf16;
use indicatif::{ProgressBar, ProgressStyle};
use rayon::prelude::*;
use safetensors::tensor::Dtype;
use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// The shapes `--shape` accepts.
pub const SHAPES: [&str; 2] = ["qwen3.8-27b", "tiny"];

/// Said in `--help`, in `forge.json`, in every file's metadata and in the printed summary.
pub const WARNING: &str = "SYNTHETIC RANDOM WEIGHTS: not a model (its outputs are meaningless); \
                           for speed and memory benchmarks only";

/// ANEMLL Forge's release 0.2 (release notes, "Release 0.2" table; quantization guide §8): rank-64 FP16 factors on
/// the token-mixer projections (DeltaNet qkv/z/out, attention q/k/v/o: the 208 matrices of the
/// 27B), none on the MLP.
pub const LOWRANK_RANK: usize = 64;

/// Subdirectory of the export holding the minimal source checkpoint.
pub const SOURCE_DIR: &str = "source";

/// Typical row scale (RMS of a row of a trained 5120-wide projection); rows get ±25 % around it.
pub(crate) const ROW_SCALE: f32 = 0.02;
/// The low-rank correction `AB` is about this fraction of the weight RMS.
const LOWRANK_FRACTION: f32 = 0.1;

/// A model shape: its Hugging Face config and where release 0.2 switches mixer formats.
pub struct Shape {
    pub name: &'static str,
    /// `config.json` of the source checkpoint (the real `qwen3_5` layout).
    pub config: Value,
    /// First layer whose token mixer is LUT4 (vector 2x16 before it).
    pub mixer_lut4_from: usize,
}

/// Special token ids of the real checkpoint; `tiny` keeps their distance from the end of its
/// vocabulary.
const TOK_EOS_TEXT: usize = 248044;
const TOK_EOS: usize = 248046;
const TOK_VISION_START: usize = 248053;
const TOK_VISION_END: usize = 248054;
const TOK_IMAGE: usize = 248056;
const TOK_VIDEO: usize = 248057;
const VOCAB_27B: usize = 248320;

struct Dims {
    vocab: usize,
    hidden: usize,
    intermediate: usize,
    layers: usize,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    lin_k_heads: usize,
    lin_v_heads: usize,
    lin_k_dim: usize,
    lin_v_dim: usize,
    mrope_section: [usize; 3],
    max_pos: usize,
    vision: Value,
}

impl Shape {
    pub fn get(name: &str) -> Result<Shape> {
        match name {
            "qwen3.8-27b" => Ok(qwen38_27b()),
            "tiny" => Ok(tiny()),
            _ => bail!("unknown --shape '{name}' (known: {})", SHAPES.join(", ")),
        }
    }

    pub fn model_config(&self) -> Result<ModelConfig> {
        ModelConfig::from_hf_json(&self.config).with_context(|| format!("shape {}", self.name))
    }

    /// The same shape with only its first `n` layers (the layer pattern kept), for measurements
    /// that scale per layer.
    pub fn with_layers(mut self, n: usize) -> Result<Shape> {
        let t = &mut self.config["text_config"];
        let full = t["num_hidden_layers"].as_u64().unwrap_or(0) as usize;
        if n == 0 || n > full {
            bail!("--layers {n}: the {} shape has 1 to {full} layers", self.name);
        }
        t["num_hidden_layers"] = json!(n);
        if let Some(types) = t["layer_types"].as_array_mut() {
            types.truncate(n);
        }
        Ok(self)
    }

    /// The release-0.2 plan for this shape (see [`release_02_plan`]).
    pub fn plan(&self) -> Result<Plan> {
        Ok(release_02_plan(self.model_config()?.num_layers, self.mixer_lut4_from))
    }
}

/// Qwen3.8-27B: the public Qwen3.5-27B / Qwen3.6-27B text model (HF `model_type` `qwen3_5`).
///
/// Where each number comes from:
/// - 64 layers as 16 × (3 Gated DeltaNet + 1 gated full attention), full attention at layers
///   3, 7, …, 63 (`layer_types`, `full_attention_interval` 4); hidden 5120; MLP intermediate
///   17408; vocabulary 248320 (padded); attention 24 query / 4 KV heads of dim 256 with a 64-dim
///   rotary part; Gated DeltaNet 48 value / 16 query-key heads of dim 128: the Qwen3.6-27B model
///   card, "Model Overview" (huggingface.co/Qwen/Qwen3.6-27B; mirrored at
///   shilu.ai/articles/qwen-hf/qwen-qwen3.6-27b-fp8 and ai.gitcode.com/openharmony-models/
///   Qwen3.6-27B-GGUF), and ANEMLL Forge's research notes (§1: 48 + 16 layers at 3, 7, …, 63, hidden 5120,
///   MLP 17408, 24 q / 4 kv heads, head_dim 256, vocab 248320, untied head; in_proj_qkv
///   10240×5120, in_proj_z 6144×5120, out_proj 5120×6144, which these head counts reproduce).
/// - `rms_norm_eps` 1e-6, `partial_rotary_factor` 0.25, `rope_theta` 1e7, untied embeddings:
///   THUDM/slime `scripts/models/qwen3.5-27B.sh` (`--norm-epsilon 1e-6 --rotary-percent 0.25
///   --rotary-base 10000000 --untie-embeddings-and-output-weights --vocab-size 248320`); the
///   theta and the 262144 context also in eadst.com/blog/325 (quoting the Qwen3.6-27B
///   config.json).
/// - `linear_conv_kernel_dim` 4, `attn_output_gate` true, `max_position_embeddings` 262144,
///   `mrope_section` [11, 11, 10] interleaved, `mamba_ssm_dtype` float32, `mtp_num_hidden_layers`
///   1, the special token ids (eos 248044 in `text_config`, 248046 at the top, vision/image/video
///   248053/248054/248056/248057) and `vision_config`: a transcription of the 27B's
///   `Qwen3_5Config` in public code (its repository is not recorded), which agrees with the
///   sources above on every field they share; kernel 4 also in
///   public Qwen3.8-27B metadata tests (`linear_conv_kernel_dim: 4`).
/// - Without a source: `bos_token_id` (null in that transcription, kept null) and the checkpoint's
///   `transformers_version` (the fixtures' 5.24.0 is written, the most plausible choice). The
///   real checkpoint also holds the vision tower and one MTP layer; Forge runs neither, so the
///   source checkpoint written here has no tensors for them.
fn qwen38_27b() -> Shape {
    let dims = Dims {
        vocab: VOCAB_27B,
        hidden: 5120,
        intermediate: 17408,
        layers: 64,
        heads: 24,
        kv_heads: 4,
        head_dim: 256,
        lin_k_heads: 16,
        lin_v_heads: 48,
        lin_k_dim: 128,
        lin_v_dim: 128,
        mrope_section: [11, 11, 10],
        max_pos: 262144,
        vision: json!({
            "deepstack_visual_indexes": [], "depth": 27, "hidden_act": "gelu_pytorch_tanh", "hidden_size": 1152,
            "in_channels": 3, "initializer_range": 0.02, "intermediate_size": 4304, "model_type": "qwen3_5",
            "num_heads": 16, "num_position_embeddings": 2304, "out_hidden_size": 5120, "patch_size": 16,
            "spatial_merge_size": 2, "temporal_patch_size": 2
        }),
    };
    // Release 0.2 (ANEMLL Forge release notes): vector 2x16 token mixers in layers 0–23, LUT4 from 24 on.
    Shape { name: "qwen3.8-27b", config: hf_config(&dims), mixer_lut4_from: 24 }
}

/// The same structure at a test size: 2 × (3 DeltaNet + 1 attention) layers, hidden 256,
/// intermediate 512, vocabulary 1024; grouped DeltaNet heads (3 value heads per key head, as the
/// 27B) and GQA attention. The mixer switches to LUT4 at layer 4, so both mixer kinds appear in
/// both mixer formats.
fn tiny() -> Shape {
    let dims = Dims {
        vocab: 1024,
        hidden: 256,
        intermediate: 512,
        layers: 8,
        heads: 4,
        kv_heads: 2,
        head_dim: 64,
        lin_k_heads: 2,
        lin_v_heads: 6,
        lin_k_dim: 32,
        lin_v_dim: 32,
        mrope_section: [3, 3, 2],
        max_pos: 4096,
        vision: json!({
            "deepstack_visual_indexes": [], "depth": 1, "hidden_act": "gelu_pytorch_tanh", "hidden_size": 32,
            "in_channels": 3, "initializer_range": 0.02, "intermediate_size": 64, "model_type": "qwen3_5",
            "num_heads": 2, "num_position_embeddings": 16, "out_hidden_size": 256, "patch_size": 4,
            "spatial_merge_size": 2, "temporal_patch_size": 2
        }),
    };
    Shape { name: "tiny", config: hf_config(&dims), mixer_lut4_from: 4 }
}

/// `config.json` in the layout of the real `Qwen3_5ForConditionalGeneration` checkpoint.
fn hf_config(d: &Dims) -> Value {
    let tok = |id: usize| d.vocab - (VOCAB_27B - id);
    let layer_types: Vec<&str> =
        (0..d.layers).map(|l| if (l + 1) % 4 == 0 { "full_attention" } else { "linear_attention" }).collect();
    let text_config = json!({
        "attention_bias": false,
        "attention_dropout": 0.0,
        "attn_output_gate": true,
        "bos_token_id": null,
        "dtype": "bfloat16",
        "eos_token_id": tok(TOK_EOS_TEXT),
        "full_attention_interval": 4,
        "head_dim": d.head_dim,
        "hidden_act": "silu",
        "hidden_size": d.hidden,
        "initializer_range": 0.02,
        "intermediate_size": d.intermediate,
        "layer_types": layer_types,
        "linear_conv_kernel_dim": 4,
        "linear_key_head_dim": d.lin_k_dim,
        "linear_num_key_heads": d.lin_k_heads,
        "linear_num_value_heads": d.lin_v_heads,
        "linear_value_head_dim": d.lin_v_dim,
        "mamba_ssm_dtype": "float32",
        "max_position_embeddings": d.max_pos,
        "mlp_only_layers": [],
        "model_type": "qwen3_5_text",
        "mtp_num_hidden_layers": 1,
        "mtp_use_dedicated_embeddings": false,
        "num_attention_heads": d.heads,
        "num_hidden_layers": d.layers,
        "num_key_value_heads": d.kv_heads,
        "pad_token_id": null,
        "partial_rotary_factor": 0.25,
        "rms_norm_eps": 1e-6,
        "rope_parameters": {
            "mrope_interleaved": true,
            "mrope_section": d.mrope_section,
            "partial_rotary_factor": 0.25,
            "rope_theta": 10000000.0,
            "rope_type": "default"
        },
        "tie_word_embeddings": false,
        "use_cache": true,
        "vocab_size": d.vocab
    });
    json!({
        "architectures": ["Qwen3_5ForConditionalGeneration"],
        "forge_synthetic": WARNING,
        "dtype": "bfloat16",
        "eos_token_id": tok(TOK_EOS),
        "image_token_id": tok(TOK_IMAGE),
        "model_type": "qwen3_5",
        "pad_token_id": tok(TOK_EOS_TEXT),
        "text_config": text_config,
        "tie_word_embeddings": false,
        "transformers_version": "5.24.0",
        "use_cache": true,
        "video_token_id": tok(TOK_VIDEO),
        "vision_config": d.vision,
        "vision_end_token_id": tok(TOK_VISION_END),
        "vision_start_token_id": tok(TOK_VISION_START)
    })
}

/// Release 0.2 (ANEMLL Forge release notes, "Release 0.2" table and notes): vector 2x64 for every MLP
/// matrix; token mixers vector 2x16 before layer `mixer_lut4_from` (ANEMLL Forge's 24 per-layer
/// `"<l>.mixer"` overrides) and LUT4 from there on, attention K/V INT8 per channel, DeltaNet's
/// tiny `in_proj_a`/`in_proj_b` in BF16, a LUT4 head; online 1024-wide block-Hadamard rotations
/// of the MLP inputs and of the mixer projections' inputs (DeltaNet qkv/z/out, attention
/// q/k/v/o), none on the head.
pub fn release_02_plan(num_layers: usize, mixer_lut4_from: usize) -> Plan {
    let mut p = Plan::uniform(Format::Vec2x64);
    p.mixer = Format::Lut4;
    p.kv = Format::Int8;
    p.head = Format::Lut4;
    p.mlp_basis = Basis::Online;
    p.mixer_basis = Basis::Online;
    p.head_basis = Basis::Plain;
    for l in 0..mixer_lut4_from.min(num_layers) {
        p.entries.insert(format!("{l}.mixer"), Format::Vec2x16.long_name().to_string());
    }
    p
}

/// Whether the release-0.2 recipe gives this matrix rank-64 factors (the mixer projections that
/// are quantized: not the BF16 `in_proj_a`/`in_proj_b`).
pub fn has_lowrank(name: &str, format: Format) -> bool {
    role_of(name).is_ok_and(|r| matches!(r.part, Part::Gdn | Part::Attn))
        && !matches!(format, Format::Bf16 | Format::F16)
}

/// The linear layers of layer `l` (canonical name, out, in), token mixer first, in the order
/// `forge quantize` writes them.
pub fn layer_matrices(cfg: &ModelConfig, l: usize) -> Vec<(String, usize, usize)> {
    let h = cfg.hidden_size;
    let mut v = match cfg.layer_kinds[l] {
        LayerKind::Attention => {
            let kv = cfg.num_kv_heads * cfg.head_dim;
            vec![
                ("self_attn.q_proj", cfg.q_proj_dim(), h),
                ("self_attn.k_proj", kv, h),
                ("self_attn.v_proj", kv, h),
                ("self_attn.o_proj", h, cfg.num_heads * cfg.head_dim),
            ]
        }
        LayerKind::DeltaNet => {
            let d = cfg.deltanet.as_ref().expect("DeltaNet layer without DeltaNet config");
            vec![
                ("linear_attn.in_proj_qkv", d.conv_dim(), h),
                ("linear_attn.in_proj_z", d.value_dim(), h),
                ("linear_attn.in_proj_b", d.num_v_heads, h),
                ("linear_attn.in_proj_a", d.num_v_heads, h),
                ("linear_attn.out_proj", h, d.value_dim()),
            ]
        }
    };
    let f = cfg.intermediate_size;
    v.extend([("mlp.gate_proj", f, h), ("mlp.up_proj", f, h), ("mlp.down_proj", h, f)]);
    v.into_iter().map(|(k, o, i)| (format!("layers.{l}.{k}"), o, i)).collect()
}

// ---- seeded random content ---------------------------------------------------------------

/// Values per independently seeded chunk (fixed, so the output does not depend on threads).
const CHUNK: usize = 1 << 16;

pub(crate) fn chunk_rng(seed: u64, name: &str, tag: &str, chunk: usize) -> Rng {
    let base = matrix_seed(seed, &format!("{name}#{tag}"));
    Rng::new(base ^ (chunk as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15))
}

/// `n` normal samples of standard deviation `std`.
pub(crate) fn normals(seed: u64, name: &str, tag: &str, n: usize, std: f32) -> Vec<f32> {
    let mut v = vec![0f32; n];
    v.par_chunks_mut(CHUNK).enumerate().for_each(|(c, out)| {
        let z = normal_samples(&mut chunk_rng(seed, name, tag, c), out.len());
        out.iter_mut().zip(z).for_each(|(o, z)| *o = z * std);
    });
    v
}

/// `n` indices uniform over `0..k` (`k` a power of two).
fn uniform_indices(seed: u64, name: &str, n: usize, k: usize) -> Vec<u8> {
    debug_assert!(k.is_power_of_two() && k <= 256);
    let mask = (k - 1) as u8;
    let mut v = vec![0u8; n];
    v.par_chunks_mut(CHUNK * 16).enumerate().for_each(|(c, out)| {
        let mut rng = chunk_rng(seed, name, "idx", c);
        for w in out.chunks_mut(8) {
            let r = rng.next_u64().to_le_bytes();
            w.iter_mut().zip(r).for_each(|(o, b)| *o = b & mask);
        }
    });
    v
}

/// Per-row scales `base · (1 ± 25 %)`, FP16-exact.
fn row_scales(seed: u64, name: &str, rows: usize, base: f32) -> Vec<f32> {
    let mut rng = chunk_rng(seed, name, "scale", 0);
    (0..rows).map(|_| f16_round(base * (1.0 + 0.25 * (2.0 * rng.next_f64() as f32 - 1.0)))).collect()
}

/// One matrix of the plan with random content.
fn synth_matrix(seed: u64, plan: &Plan, name: &str, cout: usize, cin: usize) -> Result<MatrixEntry> {
    let format = plan.format_for(name)?;
    // As `forge quantize`: LUT and INT8 matrices in an online basis carry a rotation.
    let rotated = (format.is_lut() || format == Format::Int8) && plan.basis_for(name)? == Basis::Online;
    let rotation = if rotated { Some((Plan::rotation_seed(name)?, Rotation::block_for(cin))) } else { None };
    let q = match format {
        f if f.is_lut() => {
            let (k, d) = (f.entries(), f.vec_dim());
            // A random normal codebook on the 8-bit grid f·q, so the integer-dot kernels apply.
            let mut codebook = normal_samples(&mut chunk_rng(seed, name, "lut", 0), k * d);
            snap_codebook(&mut codebook);
            if d == 1 {
                codebook.sort_by(|a, b| a.total_cmp(b));
            }
            QuantMatrix::Lut(LutMatrix {
                format: f,
                cout,
                cin,
                codebook,
                idx: uniform_indices(seed, name, cout / d * cin, k).into(),
                scale: row_scales(seed, name, cout, ROW_SCALE),
            })
        }
        Format::Int8 => {
            // Codes of a Gaussian row with max|w| ≈ 4σ mapped to 127 (s = max|w|/127).
            let sigma = 127.0 / 4.0;
            let q: Vec<i8> = normals(seed, name, "int8", cout * cin, sigma)
                .into_iter()
                .map(|v| v.round().clamp(-127.0, 127.0) as i8)
                .collect();
            let scale = row_scales(seed, name, cout, ROW_SCALE / sigma);
            QuantMatrix::Int8(Int8Matrix { cout, cin, q, scale })
        }
        Format::F16 | Format::Bf16 => {
            let data: Vec<f32> = normals(seed, name, "weight", cout * cin, ROW_SCALE)
                .into_iter()
                .map(|v| if format == Format::F16 { f16_round(v) } else { bf16::from_f32(v).to_f32() })
                .collect();
            QuantMatrix::Float { format, cout, cin, data }
        }
        _ => bail!("{name}: format {} cannot be synthesized", format.name()),
    };
    // A(Bx): B with unit-gain rows, A sized so that AB is ~10 % of the weight RMS.
    let lowrank = has_lowrank(name, format).then(|| {
        let r = LOWRANK_RANK;
        let a_std = LOWRANK_FRACTION * ROW_SCALE * (cin as f32 / r as f32).sqrt();
        let a: Vec<f32> = normals(seed, name, "lr_a", cout * r, a_std).into_iter().map(f16_round).collect();
        let b: Vec<f32> =
            normals(seed, name, "lr_b", r * cin, 1.0 / (cin as f32).sqrt()).into_iter().map(f16_round).collect();
        (r, a, b)
    });
    let (_, key) = file_and_key(name)?;
    Ok(MatrixEntry { key, q, rotation, lowrank, stats: BTreeMap::new() })
}

// ---- the source checkpoint ---------------------------------------------------------------

pub(crate) const SOURCE_PREFIX: &str = "model.language_model.";

/// What the export does not hold, named as in the real checkpoint: (canonical name, dtype, shape).
pub(crate) fn source_tensors(cfg: &ModelConfig) -> Vec<(String, Dtype, Vec<usize>)> {
    let h = cfg.hidden_size;
    let mut v = vec![
        ("embed_tokens.weight".to_string(), Dtype::BF16, vec![cfg.vocab_size, h]),
        ("norm.weight".to_string(), Dtype::BF16, vec![h]),
    ];
    for (l, kind) in cfg.layer_kinds.iter().enumerate() {
        let p = format!("layers.{l}");
        v.push((format!("{p}.input_layernorm.weight"), Dtype::BF16, vec![h]));
        v.push((format!("{p}.post_attention_layernorm.weight"), Dtype::BF16, vec![h]));
        match kind {
            LayerKind::Attention => {
                v.push((format!("{p}.self_attn.q_norm.weight"), Dtype::BF16, vec![cfg.head_dim]));
                v.push((format!("{p}.self_attn.k_norm.weight"), Dtype::BF16, vec![cfg.head_dim]));
            }
            LayerKind::DeltaNet => {
                let d = cfg.deltanet.as_ref().expect("DeltaNet config");
                let a = format!("{p}.linear_attn");
                v.push((format!("{a}.conv1d.weight"), Dtype::BF16, vec![d.conv_dim(), 1, d.conv_kernel]));
                v.push((format!("{a}.dt_bias"), Dtype::BF16, vec![d.num_v_heads]));
                // The real checkpoint keeps these two in F32.
                v.push((format!("{a}.A_log"), Dtype::F32, vec![d.num_v_heads]));
                v.push((format!("{a}.norm.weight"), Dtype::F32, vec![d.v_head_dim]));
            }
        }
    }
    v
}

/// Values of a small source tensor, drawn as the Qwen3.5 fixtures draw them (zero-centred norms
/// near 0, the gated norm's plain weight near 1, `A_log` in [log 0.5, log 8]).
pub(crate) fn small_source_values(seed: u64, name: &str, n: usize) -> Vec<f32> {
    if name.ends_with("A_log") {
        let mut rng = chunk_rng(seed, name, "src", 0);
        let (lo, hi) = (0.5f64.ln(), 8f64.ln());
        return (0..n).map(|_| (lo + (hi - lo) * rng.next_f64()) as f32).collect();
    }
    let std = if name.ends_with("dt_bias") {
        1.0
    } else if name.contains("conv1d") {
        0.3
    } else {
        0.05
    };
    let mut v = normals(seed, name, "src", n, std);
    if name.ends_with("linear_attn.norm.weight") {
        v.iter_mut().for_each(|x| *x += 1.0);
    }
    v
}

pub(crate) fn bf16_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|&x| bf16::from_f32(x).to_le_bytes()).collect()
}

/// Embedding rows generated (and written) per step.
const EMBED_ROWS: usize = 2048;

fn write_source(dir: &Path, shape: &Shape, cfg: &ModelConfig, seed: u64, pb: &ProgressBar) -> Result<()> {
    std::fs::create_dir_all(dir).with_context(|| format!("{}: cannot create", dir.display()))?;
    write_atomic(&dir.join("config.json"), serde_json::to_string_pretty(&shape.config)?.as_bytes())?;
    let tensors = source_tensors(cfg);
    let specs: Vec<TensorSpec> = tensors
        .iter()
        .map(|(n, d, s)| TensorSpec { name: format!("{SOURCE_PREFIX}{n}"), dtype: *d, shape: s.clone() })
        .collect();
    let meta: BTreeMap<String, String> =
        [("format".to_string(), "pt".to_string()), ("forge_synthetic".to_string(), WARNING.to_string())].into();
    let h = cfg.hidden_size;
    write_streaming(&dir.join("model.safetensors"), &specs, &meta, |i, w| {
        let (name, dtype, shape) = &tensors[i];
        if name == "embed_tokens.weight" {
            pb.set_message("source: embed_tokens");
            for (c, r0) in (0..cfg.vocab_size).step_by(EMBED_ROWS).enumerate() {
                let rows = EMBED_ROWS.min(cfg.vocab_size - r0);
                let v = normals(seed, name, &format!("rows{c}"), rows * h, ROW_SCALE);
                w.write_all(&bf16_bytes(&v))?;
                pb.inc((rows * h) as u64);
            }
            return Ok(());
        }
        let v = small_source_values(seed, name, shape.iter().product());
        match dtype {
            Dtype::F32 => w.write_all(&v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>())?,
            _ => w.write_all(&bf16_bytes(&v))?,
        }
        Ok(())
    })
}

/// The progress bar of a synthesis run, counting weights (hidden when `show` is false).
pub(crate) fn weights_bar(show: bool, weights: usize) -> ProgressBar {
    let pb = if show { ProgressBar::new(weights as u64) } else { ProgressBar::hidden() };
    pb.set_style(
        ProgressStyle::with_template(
            "{prefix} [{bar:30}] {human_pos}/{human_len} weights, {elapsed} elapsed, ETA {eta} {msg}",
        )
        .unwrap()
        .progress_chars("=> "),
    );
    pb.set_prefix("synth");
    pb
}

// ---- the run --------------------------------------------------------------------------------

pub struct Options {
    pub shape: String,
    pub output: PathBuf,
    pub seed: u64,
    /// Draw an indicatif progress bar (hidden anyway when stderr is not a terminal).
    pub progress: bool,
}

/// What a run wrote, and what it costs as `forge inspect` counts it.
pub struct Summary {
    pub shape: &'static str,
    pub seed: u64,
    pub output: PathBuf,
    /// Every file written, relative to the output directory, with its size.
    pub files: Vec<(String, u64)>,
    /// Bytes on disk of the export's own files (the source checkpoint excluded).
    pub export_bytes: u64,
    /// Bytes on disk of `source/`.
    pub source_bytes: u64,
    /// `forge inspect`'s report of the export.
    pub report: Report,
    pub elapsed: Duration,
    pub threads: usize,
}

impl Summary {
    /// Packed bytes of the low-rank factors (FP16), inside `report.packed_bytes`.
    pub fn lowrank_bytes(&self) -> usize {
        self.report.matrices.iter().map(|m| 2 * m.lowrank * (m.cout + m.cin)).sum()
    }

    /// Bits per weight of the linear layers and the head without the low-rank factors (the
    /// ANEMLL Forge's "3.17 bits per weight" figure).
    pub fn bits_per_weight_without_factors(&self) -> f64 {
        let n: usize = self.report.matrices.iter().map(|m| m.cout * m.cin).sum();
        (self.report.packed_bytes - self.lowrank_bytes()) as f64 * 8.0 / n.max(1) as f64
    }

    pub fn to_text(&self) -> String {
        let size = |b: f64| {
            if b >= (1u64 << 30) as f64 {
                format!("{:.2} GiB", b / (1u64 << 30) as f64)
            } else {
                format!("{:.2} MiB", b / (1u64 << 20) as f64)
            }
        };
        let r = &self.report;
        let n_export = self.files.iter().filter(|(f, _)| !f.starts_with(SOURCE_DIR)).count();
        let lr = self.lowrank_bytes();
        let mut s = format!("forge synth: {WARNING}\n");
        s += &format!(
            "shape {}, seed {}, {} thread(s), {:.1} s → {}\n",
            self.shape,
            self.seed,
            self.threads,
            self.elapsed.as_secs_f64(),
            self.output.display()
        );
        s += &format!(
            "files: {} export files, {} bytes ({}) on disk; source checkpoint {SOURCE_DIR}/: {} files, {} bytes ({})\n",
            n_export,
            self.export_bytes,
            size(self.export_bytes as f64),
            self.files.len() - n_export,
            self.source_bytes,
            size(self.source_bytes as f64)
        );
        s += &format!(
            "packed (as `forge inspect --json` counts): {} bytes ({}), {:.3} bits/weight (linear layers + head); \
             without the rank-{LOWRANK_RANK} factors ({}): {}, {:.3} bits/weight; body only {:.3}; with embedding and \
             everything else {:.3} ({} parameters)\n",
            r.packed_bytes,
            size(r.packed_bytes as f64),
            r.bits_per_weight,
            size(lr as f64),
            size((r.packed_bytes - lr) as f64),
            self.bits_per_weight_without_factors(),
            r.body_bits_per_weight,
            r.bits_per_weight_with_embedding,
            r.params_total
        );
        s
    }
}

/// Write the synthetic export (see the module documentation).
pub fn synth(o: &Options) -> Result<Summary> {
    let start = Instant::now();
    let shape = Shape::get(&o.shape)?;
    let cfg = shape.model_config()?;
    let plan = shape.plan()?;
    let out = &o.output;
    if out.join(forge_model::export::MANIFEST).exists() {
        bail!("{}: already a complete export (remove it to synthesize again)", out.display());
    }
    if out.exists() && std::fs::read_dir(out)?.next().is_some() {
        bail!("{}: output directory is not empty (remove it, or choose another)", out.display());
    }
    std::fs::create_dir_all(out).with_context(|| format!("{}: cannot create", out.display()))?;

    let n_layers = cfg.num_layers;
    let total: usize = (0..n_layers).flat_map(|l| layer_matrices(&cfg, l)).map(|(_, o, i)| o * i).sum::<usize>()
        + 2 * cfg.vocab_size * cfg.hidden_size; // head + embedding
    let pb = weights_bar(o.progress, total);

    let source = out.join(SOURCE_DIR);
    write_source(&source, &shape, &cfg, o.seed, &pb)?;

    let synthetic = ("synthetic".to_string(), WARNING.to_string());
    for l in 0..n_layers {
        let (mut mixer, mut mlp) = (Vec::new(), Vec::new());
        for (name, cout, cin) in layer_matrices(&cfg, l) {
            pb.set_message(name.clone());
            let e = synth_matrix(o.seed, &plan, &name, cout, cin)?;
            pb.inc((cout * cin) as u64);
            if e.key.starts_with("mlp.") {
                mlp.push(e)
            } else {
                mixer.push(e)
            }
        }
        // File-level metadata exactly as `forge quantize` writes it.
        let mut meta: BTreeMap<String, String> = [synthetic.clone()].into();
        meta.insert("format".to_string(), mixer[0].q.format().long_name().to_string());
        meta.insert("kv_format".to_string(), plan.kv.long_name().to_string());
        write_file(&out.join(format!("layer_{l:02}_mixer.safetensors")), "mixer", &mixer, &meta)?;
        drop(mixer);
        let mut meta: BTreeMap<String, String> = [synthetic.clone()].into();
        meta.insert("format".to_string(), mlp[0].q.format().long_name().to_string());
        meta.insert("basis".to_string(), if mlp[0].rotation.is_some() { "online" } else { "plain" }.to_string());
        meta.insert("seed_in".to_string(), (1000 + l).to_string());
        meta.insert("seed_mid".to_string(), (2000 + l).to_string());
        meta.insert("block".to_string(), mlp[0].rotation.map_or(0, |r| r.1).to_string());
        write_file(&out.join(format!("layer_{l:02}.safetensors")), "mlp", &mlp, &meta)?;
    }
    pb.set_message("lm_head");
    let head = synth_matrix(o.seed, &plan, "lm_head", cfg.vocab_size, cfg.hidden_size)?;
    let mut meta: BTreeMap<String, String> = [synthetic.clone()].into();
    meta.insert("format".to_string(), head.q.format().long_name().to_string());
    write_file(&out.join("lm_head.safetensors"), "head", std::slice::from_ref(&head), &meta)?;
    drop(head);
    pb.inc((cfg.vocab_size * cfg.hidden_size) as u64);
    pb.finish_and_clear();

    // forge.json last, in `forge quantize`'s shape; the source path is relative to the export,
    // so the directory can move and two runs with one seed are byte-identical.
    let manifest = json!({
        "forge_version": TOOL_VERSION,
        "export_format": 1,
        "synthetic": {
            "warning": WARNING,
            "shape": shape.name,
            "seed": o.seed,
            "content": "indices uniform over each codebook; codebooks N(0,1) snapped to the 8-bit grid f·q \
                        (forge_quant::fit::snap_codebook); row scales 0.02·(1±25%); INT8 codes N(0, 31.75²) clipped \
                        to ±127; BF16 in_proj_a/b N(0, 0.02²); rank-64 factors with AB ≈ 10% of the weight RMS; \
                        every tensor from --seed and its name",
        },
        "source": {
            "path": SOURCE_DIR,
            "name": Value::Null,
            "fingerprint": source_fingerprint(&source)?,
            "model_type": cfg.model_type,
        },
        "options": {
            "source": format!("{SOURCE_DIR} (synthetic)"),
            "plan": plan.to_json(),
            "method": "synthetic",
            "seed": o.seed,
            "calibration": Value::Null,
            "aw": false,
            "lowrank": {"rank": LOWRANK_RANK, "parts": ["gdn", "attn"], "inside_gptq": true},
        },
        "tied_embeddings": cfg.tie_embeddings,
        "embedding": format!("{SOURCE_DIR}/model.safetensors (BF16 embed_tokens.weight)"),
    });
    write_atomic(&out.join(forge_model::export::MANIFEST), serde_json::to_string_pretty(&manifest)?.as_bytes())?;

    let mut files = Vec::new();
    let (mut export_bytes, mut source_bytes) = (0u64, 0u64);
    for (d, rel) in [(out.clone(), ""), (source.clone(), SOURCE_DIR)] {
        let mut names: Vec<(String, u64)> = std::fs::read_dir(&d)?
            .filter_map(|e| e.ok())
            .filter(|e| e.metadata().is_ok_and(|m| m.is_file()))
            .map(|e| (e.file_name().to_string_lossy().to_string(), e.metadata().map_or(0, |m| m.len())))
            .collect();
        names.sort();
        for (n, len) in names {
            if rel.is_empty() {
                export_bytes += len;
                files.push((n, len));
            } else {
                source_bytes += len;
                files.push((format!("{rel}/{n}"), len));
            }
        }
    }
    let report = inspect(out)?;
    Ok(Summary {
        shape: shape.name,
        seed: o.seed,
        output: out.clone(),
        files,
        export_bytes,
        source_bytes,
        report,
        elapsed: start.elapsed(),
        threads: rayon::current_num_threads(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shapes_parse_and_match_anemll_forge() {
        let s = Shape::get("qwen3.8-27b").unwrap();
        let c = s.model_config().unwrap();
        assert_eq!((c.num_layers, c.hidden_size, c.intermediate_size, c.vocab_size), (64, 5120, 17408, 248320));
        assert_eq!(c.layer_kinds.iter().filter(|k| **k == LayerKind::DeltaNet).count(), 48);
        assert!((0..64).all(|l| (c.layer_kinds[l] == LayerKind::Attention) == (l % 4 == 3)));
        let d = c.deltanet.as_ref().unwrap();
        // The shapes of ANEMLL Forge's research notes, §1.
        assert_eq!((d.conv_dim(), d.value_dim()), (10240, 6144));
        assert_eq!((c.q_proj_dim(), c.num_kv_heads * c.head_dim, c.rotary_dim), (12288, 1024, 64));
        assert!(!c.tie_embeddings);
        let t = Shape::get("tiny").unwrap().model_config().unwrap();
        assert_eq!((t.num_layers, t.hidden_size, t.vocab_size), (8, 256, 1024));
        let e = Shape::get("qwen3-27b").err().unwrap().to_string();
        assert!(e.contains("qwen3-27b") && e.contains("qwen3.8-27b") && e.contains("tiny"), "{e}");
    }

    /// The 27B plan's packed size is ANEMLL Forge's "9.44 GiB (9.74 with the FP16 factors)".
    #[test]
    fn plan_size_matches_release_02() {
        let s = Shape::get("qwen3.8-27b").unwrap();
        let (c, p) = (s.model_config().unwrap(), s.plan().unwrap());
        let (mut bytes, mut lr, mut n, mut lr_mats) = (0usize, 0usize, 0usize, 0usize);
        let mut all: Vec<(String, usize, usize)> = (0..64).flat_map(|l| layer_matrices(&c, l)).collect();
        all.push(("lm_head".into(), c.vocab_size, c.hidden_size));
        for (name, o, i) in all {
            let f = p.format_for(&name).unwrap();
            bytes += f.packed_bytes(o, i);
            n += o * i;
            if has_lowrank(&name, f) {
                lr += 2 * LOWRANK_RANK * (o + i);
                lr_mats += 1;
            }
        }
        let gib = |b: usize| b as f64 / (1u64 << 30) as f64;
        assert_eq!(lr_mats, 208, "ANEMLL Forge's 208 factored mixer matrices");
        assert!((gib(bytes) - 9.44).abs() < 0.1, "{} GiB", gib(bytes));
        assert!((gib(bytes + lr) - 9.74).abs() < 0.1, "{} GiB", gib(bytes + lr));
        assert!((bytes as f64 * 8.0 / n as f64 - 3.17).abs() < 0.05);
    }
}
