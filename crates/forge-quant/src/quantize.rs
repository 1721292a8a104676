//! `forge quantize`: a model through a plan, layer by layer, into an export.
//!
//! Layers are written one file at a time (atomically), so a killed run restarted with
//! `--resume` continues at the first unfinished layer; `forge.json`, written last, marks the
//! export complete. Every random choice derives from the recorded `--seed`.

use crate::export::{write_embedding, write_file, MatrixEntry};
use crate::plan::{Basis, Plan};
use crate::quantize_matrix::{quantize_rtn, snr_db};
use anyhow::{bail, Context, Result};
use forge_core::checkpoint::Checkpoint;
use forge_core::fsutil::write_atomic;
use forge_kernels::rotation::Rotation;
use forge_model::model::{Embedding, Mixer, Model};
use forge_model::Linear;
use indicatif::{ProgressBar, ProgressStyle};
use serde_json::{json, Value};
use sha2::{Digest, Sha256};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

pub const TOOL_VERSION: &str = env!("CARGO_PKG_VERSION");

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Method {
    Rtn,
}

impl Method {
    pub fn parse(s: &str) -> Result<Method> {
        match s {
            "rtn" => Ok(Method::Rtn),
            _ => bail!("unknown method '{s}' (known: rtn)"),
        }
    }
    pub fn name(self) -> &'static str {
        match self {
            Method::Rtn => "rtn",
        }
    }
}

pub struct Options {
    /// The `--model` argument as given (a path or a short name, recorded in forge.json).
    pub source_arg: String,
    pub source: PathBuf,
    pub plan: Plan,
    pub method: Method,
    pub seed: u64,
    pub output: PathBuf,
    pub resume: bool,
    /// Testing aid: fail (as a crash would) before quantizing this layer.
    pub stop_before_layer: Option<usize>,
}

/// Linear layers of layer `l`, token mixer first (execution order).
pub fn layer_linears(m: &Model, l: usize) -> Vec<&Linear> {
    let layer = &m.layers[l];
    let mut v: Vec<&Linear> = match &layer.mixer {
        Mixer::Attention(a) => vec![&a.q, &a.k, &a.v, &a.o],
        Mixer::DeltaNet(d) => vec![&d.in_qkv, &d.in_z, &d.in_b, &d.in_a, &d.out],
    };
    v.extend([&layer.mlp.gate, &layer.mlp.up, &layer.mlp.down]);
    v
}

/// A stable per-matrix seed from the run seed and the matrix name.
pub fn matrix_seed(seed: u64, name: &str) -> u64 {
    let mut h = 0xcbf29ce484222325u64 ^ seed;
    for b in name.bytes() {
        h = (h ^ b as u64).wrapping_mul(0x100000001b3);
    }
    h
}

/// Fingerprint of the source checkpoint: SHA-256 of a GGUF file, or of a directory's
/// config.json plus its weight files' names and sizes (hashing 50 GB of shards is not useful).
pub fn source_fingerprint(path: &Path) -> Result<String> {
    let mut h = Sha256::new();
    if path.is_dir() {
        let mut names: Vec<PathBuf> = std::fs::read_dir(path)?.filter_map(|e| e.ok().map(|e| e.path())).collect();
        names.sort();
        for p in names {
            let n = p.file_name().unwrap().to_string_lossy().to_string();
            if n == "config.json" {
                h.update(std::fs::read(&p)?);
            } else if n.ends_with(".safetensors") {
                h.update(n.as_bytes());
                h.update(std::fs::metadata(&p)?.len().to_le_bytes());
            }
        }
    } else {
        let mut f = std::fs::File::open(path).with_context(|| format!("{}: cannot open", path.display()))?;
        std::io::copy(&mut f, &mut h)?;
    }
    Ok(format!("{:x}", h.finalize()))
}

fn quantize_linear(lin: &Linear, plan: &Plan, seed: u64) -> Result<MatrixEntry> {
    let name = &lin.name;
    let format = plan.format_for(name)?;
    let mut w = lin.effective_weight()?;
    let rotation = if plan.basis_for(name)? == Basis::Online {
        let r = Rotation::new(lin.in_f, Plan::rotation_seed(name)?);
        r.rotate_weight(&mut w, lin.out_f);
        Some((r.seed, r.block))
    } else {
        None
    };
    let q = quantize_rtn(&w, lin.out_f, lin.in_f, format, None, matrix_seed(seed, name))
        .with_context(|| format!("quantizing {name}"))?;
    let snr = snr_db(&w, &q.reconstruct());
    let (_, key) = crate::export::file_and_key(name)?;
    let mut stats = BTreeMap::new();
    stats.insert("snr_db".to_string(), format!("{snr:.4}"));
    Ok(MatrixEntry { key, q, rotation, lowrank: None, stats })
}

/// Run the quantization; returns the export's manifest.
pub fn quantize(o: &Options) -> Result<Value> {
    let out = &o.output;
    if out.join(forge_model::export::MANIFEST).exists() {
        bail!("{}: already a complete export (remove it to quantize again)", out.display());
    }
    let partial = out.join(".forge-partial.json");
    let opts_json = json!({
        "source": o.source_arg, "plan": o.plan.to_json(), "method": o.method.name(), "seed": o.seed,
    });
    if out.exists() && std::fs::read_dir(out)?.next().is_some() {
        if !o.resume {
            bail!("{}: output directory is not empty (use --resume to continue an interrupted run)", out.display());
        }
        let prev: Value = serde_json::from_str(
            &std::fs::read_to_string(&partial)
                .with_context(|| format!("{}: no interrupted run to resume", partial.display()))?,
        )?;
        if prev != opts_json {
            bail!("{}: the interrupted run used different options: {prev}", partial.display());
        }
    } else {
        std::fs::create_dir_all(out).with_context(|| format!("{}: cannot create", out.display()))?;
        write_atomic(&partial, serde_json::to_string_pretty(&opts_json)?.as_bytes())?;
    }
    let (ck, cfg) = Checkpoint::open(&o.source)?;
    o.plan.check_layers(cfg.num_layers)?;
    let model = Model::load(&ck, cfg)?;
    let n_mats: usize = (0..model.layers.len()).map(|l| layer_linears(&model, l).len()).sum::<usize>() + 1;
    let pb = ProgressBar::new(n_mats as u64);
    pb.set_style(
        ProgressStyle::with_template("{prefix:>10} [{bar:30}] {pos}/{len} matrices, {elapsed} elapsed, ETA {eta} {msg}")
            .unwrap()
            .progress_chars("=> "),
    );
    pb.set_prefix("quantize");
    for l in 0..model.layers.len() {
        if o.stop_before_layer == Some(l) {
            bail!("stopped before layer {l} (stop_before_layer)");
        }
        let mlp_file = out.join(format!("layer_{l:02}.safetensors"));
        let mixer_file = out.join(format!("layer_{l:02}_mixer.safetensors"));
        let lins = layer_linears(&model, l);
        if o.resume && mlp_file.exists() && mixer_file.exists() {
            pb.inc(lins.len() as u64);
            continue;
        }
        let mut mixer = Vec::new();
        let mut mlp = Vec::new();
        for lin in lins {
            pb.set_message(lin.name.clone());
            let e = quantize_linear(lin, &o.plan, o.seed)?;
            if e.key.starts_with("mlp.") {
                mlp.push(e);
            } else {
                mixer.push(e);
            }
            pb.inc(1);
        }
        let mut meta = BTreeMap::new();
        meta.insert("format".to_string(), mixer[0].q.format().long_name().to_string());
        meta.insert("kv_format".to_string(), o.plan.kv.long_name().to_string());
        write_file(&mixer_file, "mixer", &mixer, &meta)?;
        // The seeds' file-level rotation metadata (per-matrix keys carry the same facts).
        let mut meta = BTreeMap::new();
        meta.insert("format".to_string(), mlp[0].q.format().long_name().to_string());
        let rotated = mlp[0].rotation.is_some();
        meta.insert("basis".to_string(), if rotated { "online" } else { "plain" }.to_string());
        meta.insert("seed_in".to_string(), (1000 + l).to_string());
        meta.insert("seed_mid".to_string(), (2000 + l).to_string());
        meta.insert("block".to_string(), mlp[0].rotation.map_or(0, |r| r.1).to_string());
        write_file(&mlp_file, "mlp", &mlp, &meta)?;
    }
    let head_file = out.join("lm_head.safetensors");
    if !(o.resume && head_file.exists()) {
        pb.set_message("lm_head");
        let e = quantize_linear(&model.head, &o.plan, o.seed)?;
        let meta = [("format".to_string(), e.q.format().long_name().to_string())].into();
        write_file(&head_file, "head", &[e], &meta)?;
    }
    pb.inc(1);
    pb.finish_and_clear();
    let tied = model.cfg.tie_embeddings;
    if !tied {
        if let Embedding::Table(t) = &model.embed {
            let (v, h) = (model.cfg.vocab_size, model.cfg.hidden_size);
            let mut table = vec![0f32; v * h];
            t.floats()?.read_into(0, &mut table);
            write_embedding(&out.join("embed.safetensors"), &table, v, h)?;
        }
    }
    let manifest = json!({
        "forge_version": TOOL_VERSION,
        "export_format": 1,
        "source": {
            "path": o.source.to_string_lossy(),
            "name": if o.source_arg.contains('/') || o.source_arg.contains('.') { Value::Null } else { json!(o.source_arg) },
            "fingerprint": source_fingerprint(&o.source)?,
            "model_type": model.cfg.model_type,
        },
        "method": o.method.name(),
        "seed": o.seed,
        "plan": o.plan.to_json(),
        "tied_embeddings": tied,
        "embedding": if tied { "tied to lm_head" } else { "embed.safetensors (FP16)" },
    });
    write_atomic(&out.join(forge_model::export::MANIFEST), serde_json::to_string_pretty(&manifest)?.as_bytes())?;
    let _ = std::fs::remove_file(&partial);
    Ok(manifest)
}
