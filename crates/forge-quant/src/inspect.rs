//! `forge inspect`: what an export holds and what it costs, per matrix and in total.

use anyhow::{anyhow, Context, Result};
use forge_core::checkpoint::Checkpoint;
use forge_core::config::{LayerKind, ModelConfig};
use forge_core::safetensors_dir::SafetensorsSet;
use forge_kernels::lut::Format;
use serde_json::{json, Value};
use std::path::Path;

#[derive(Debug, Clone)]
pub struct MatrixInfo {
    pub name: String,
    pub format: Format,
    pub cout: usize,
    pub cin: usize,
    pub lowrank: usize,
    pub rotation: Option<String>,
    pub packed_bytes: usize,
    pub snr_db: Option<f64>,
}

impl MatrixInfo {
    pub fn bits_per_weight(&self) -> f64 {
        self.packed_bytes as f64 * 8.0 / (self.cout * self.cin) as f64
    }
}

#[derive(Debug, Clone)]
pub struct Report {
    pub matrices: Vec<MatrixInfo>,
    pub packed_bytes: usize,
    pub export_bytes: u64,
    /// Quantized linear layers and the head (codebooks, scales, factors included), embedding excluded.
    pub bits_per_weight: f64,
    /// Everything needed to run (tied matrix once, norms and small tensors as f32) over all parameters.
    pub bits_per_weight_with_embedding: f64,
    /// Decoder layers only (no head, no embedding) — llama.cpp's "body" figure.
    pub body_bits_per_weight: f64,
    pub params_total: usize,
}

/// Number of non-matrix parameters kept in floating point (norms, conv, decay parameters).
fn small_params(cfg: &ModelConfig) -> usize {
    let h = cfg.hidden_size;
    let mut n = h; // final norm
    for k in &cfg.layer_kinds {
        n += 2 * h;
        match k {
            LayerKind::Attention => {
                if cfg.qk_norm {
                    n += 2 * cfg.head_dim
                }
            }
            LayerKind::DeltaNet => {
                let d = cfg.deltanet.as_ref().unwrap();
                n += d.conv_dim() * d.conv_kernel + 2 * d.num_v_heads + d.v_head_dim;
            }
        }
    }
    n
}

pub fn inspect(dir: &Path) -> Result<Report> {
    let ex = forge_model::export::Export::open(dir)?;
    let (_, cfg) = Checkpoint::open(&ex.source()?)?;
    let mut names: Vec<String> = std::fs::read_dir(dir)?
        .filter_map(|e| e.ok().map(|e| e.file_name().to_string_lossy().to_string()))
        .filter(|n| n.ends_with(".safetensors") && !n.starts_with('.'))
        .collect();
    names.sort();
    let mut matrices = Vec::new();
    let mut export_bytes = 0u64;
    let mut embed_bytes = 0usize;
    for e in std::fs::read_dir(dir)? {
        // Files only: a subdirectory (e.g. `forge synth`'s `source/`) is not export bytes.
        let m = e?.metadata()?;
        if m.is_file() {
            export_bytes += m.len();
        }
    }
    for file in &names {
        let path = dir.join(file);
        let set = SafetensorsSet::open_files(std::slice::from_ref(&path))?;
        if file == "embed.safetensors" {
            embed_bytes = set.shape("embed_tokens.weight").map(|s| s.iter().product::<usize>() * 2).unwrap_or(0);
            continue;
        }
        let prefix = if file == "lm_head.safetensors" {
            String::new()
        } else {
            let l: usize =
                file.trim_start_matches("layer_").split(['_', '.']).next().unwrap_or("").parse().unwrap_or(0);
            format!("layers.{l}.")
        };
        let mut keys: Vec<&String> = set.metadata.keys().filter(|k| k.ends_with(".format")).collect();
        keys.sort();
        for k in keys {
            let key = k.trim_end_matches(".format");
            let format =
                Format::parse(&set.metadata[k]).with_context(|| format!("{}: metadata '{k}'", path.display()))?;
            let shape_of = |s: &str| set.shape(&format!("{key}.{s}")).map(|v| v.to_vec());
            let (cout, cin) = if let Some(s) = shape_of("idx") {
                (s[0] * format.vec_dim(), s[1])
            } else if let Some(s) = shape_of("int8").or_else(|| shape_of("weight")) {
                (s[0], s[1])
            } else {
                return Err(anyhow!("{}: matrix '{key}' has no .idx, .int8 or .weight tensor", path.display()));
            };
            let lowrank = shape_of("lr_a").map(|s| s[1]).unwrap_or(0);
            let packed = format.packed_bytes(cout, cin) + 2 * lowrank * (cout + cin);
            let rotation = set.metadata.get(&format!("{key}.rotation_seed")).map(|s| {
                format!(
                    "seed {s}, block {}",
                    set.metadata.get(&format!("{key}.rotation_block")).cloned().unwrap_or_default()
                )
            });
            matrices.push(MatrixInfo {
                name: format!("{prefix}{key}"),
                format,
                cout,
                cin,
                lowrank,
                rotation,
                packed_bytes: packed,
                snr_db: set.metadata.get(&format!("{key}.snr_db")).and_then(|s| s.parse().ok()),
            });
        }
    }
    let packed_bytes: usize = matrices.iter().map(|m| m.packed_bytes).sum();
    let n_lin: usize = matrices.iter().map(|m| m.cout * m.cin).sum();
    let body: Vec<&MatrixInfo> = matrices.iter().filter(|m| m.name != "lm_head").collect();
    let body_bytes: usize = body.iter().map(|m| m.packed_bytes).sum();
    let body_n: usize = body.iter().map(|m| m.cout * m.cin).sum();
    let small = small_params(&cfg);
    let (emb_params, emb_bytes) = if cfg.tie_embeddings {
        (0, 0)
    } else {
        let n = cfg.vocab_size * cfg.hidden_size;
        (n, if embed_bytes > 0 { embed_bytes } else { 2 * n })
    };
    let params_total = n_lin + small + emb_params;
    let all_bytes = packed_bytes + 4 * small + emb_bytes;
    Ok(Report {
        bits_per_weight: packed_bytes as f64 * 8.0 / n_lin.max(1) as f64,
        bits_per_weight_with_embedding: all_bytes as f64 * 8.0 / params_total.max(1) as f64,
        body_bits_per_weight: body_bytes as f64 * 8.0 / body_n.max(1) as f64,
        matrices,
        packed_bytes,
        export_bytes,
        params_total,
    })
}

impl Report {
    pub fn to_json(&self) -> Value {
        json!({
            "bits_per_weight": self.bits_per_weight,
            "bits_per_weight_with_embedding": self.bits_per_weight_with_embedding,
            "body_bits_per_weight": self.body_bits_per_weight,
            "packed_bytes": self.packed_bytes,
            "export_bytes": self.export_bytes,
            "params_total": self.params_total,
            "matrices": self.matrices.iter().map(|m| json!({
                "name": m.name, "format": m.format.name(), "shape": [m.cout, m.cin],
                "bits_per_weight": m.bits_per_weight(), "packed_bytes": m.packed_bytes,
                "lowrank": m.lowrank, "rotation": m.rotation, "snr_db": m.snr_db,
            })).collect::<Vec<_>>(),
        })
    }

    pub fn to_table(&self) -> String {
        let mut s = format!(
            "{:<36} {:>8} {:>14} {:>6} {:>9} {:>5} {}\n",
            "matrix", "format", "shape", "bpw", "SNR dB", "rank", "rotation"
        );
        for m in &self.matrices {
            s += &format!(
                "{:<36} {:>8} {:>14} {:>6.3} {:>9} {:>5} {}\n",
                m.name,
                m.format.name(),
                format!("{}x{}", m.cout, m.cin),
                m.bits_per_weight(),
                m.snr_db.map_or("-".into(), |v| format!("{v:.2}")),
                if m.lowrank > 0 { m.lowrank.to_string() } else { "-".into() },
                m.rotation.clone().unwrap_or_else(|| "-".into())
            );
        }
        s += &format!(
            "\npacked bytes: {} ({:.2} MiB), export bytes on disk: {} ({:.2} MiB)\n",
            self.packed_bytes,
            self.packed_bytes as f64 / 1048576.0,
            self.export_bytes,
            self.export_bytes as f64 / 1048576.0
        );
        s += &format!(
            "bits/weight: {:.3} (linear layers + head), {:.3} body only, {:.3} with embedding and everything else ({} parameters)\n",
            self.bits_per_weight, self.body_bits_per_weight, self.bits_per_weight_with_embedding, self.params_total
        );
        s
    }
}
