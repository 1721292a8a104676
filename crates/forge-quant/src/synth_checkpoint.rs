//! `forge synth --checkpoint`: a **random-weight** Hugging Face checkpoint with a real model's
//! shapes, as `forge quantize` would receive the real one: `config.json` in the multimodal
//! `qwen3_5` layout (`text_config` nested), BF16 safetensors shards with the published tensor names
//! (`model.language_model.layers.N…`, `lm_head.weight` at the root) and
//! `model.safetensors.index.json`. It exists so that quantization's memory and time can be
//! measured at full size; it is not a model.
//!
//! Each projection's rows have their own scale (log-normal around 0.02) and a few input
//! channels (one in 512, the same ones for every matrix reading a space of that width) are
//! eight times larger, as trained checkpoints' outlier channels are: GPTQ, rotations and the
//! low-rank fits then meet the structure they exist for. Tensors are generated in blocks of rows,
//! each block from its own seed (the bytes do not depend on the thread count), and streamed into
//! shard files written atomically, so memory stays at one block.

use crate::export::{write_streaming, TensorSpec};
use crate::synth::{
    bf16_bytes, chunk_rng, layer_matrices, normals, small_source_values, source_tensors, Shape, ROW_SCALE,
    SOURCE_PREFIX, WARNING,
};
use anyhow::{bail, Context, Result};
use forge_core::config::ModelConfig;
use forge_core::fsutil::write_atomic;
use indicatif::ProgressBar;
use safetensors::tensor::Dtype;
use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// Hugging Face's default `max_shard_size` ("5GB").
pub const SHARD_BYTES: usize = 5_000_000_000;
/// One input channel in this many is an outlier channel.
pub const OUTLIER_EVERY: usize = 512;
/// An outlier channel's gain over the others.
pub const OUTLIER_GAIN: f32 = 8.0;
/// Spread of the row scales: `ROW_SCALE · exp(ROW_SPREAD · z)`.
const ROW_SPREAD: f32 = 0.25;
/// Values generated per block of rows (about 16 MiB of f32).
const BLOCK_VALUES: usize = 1 << 22;
/// Random calibration ids written beside the checkpoint (the checkpoint has no tokenizer).
pub const CALIB_FILE: &str = "calibration.ids";
const CALIB_ROWS: usize = 128;
const CALIB_SEQ: usize = 512;

pub struct Options {
    pub shape: String,
    /// Keep the first `layers` layers (the 3 DeltaNet : 1 attention pattern stays).
    pub layers: Option<usize>,
    pub output: PathBuf,
    pub seed: u64,
    pub shard_bytes: usize,
    pub progress: bool,
}

/// What a run wrote.
pub struct Summary {
    pub shape: &'static str,
    pub layers: usize,
    pub output: PathBuf,
    pub shards: usize,
    pub bytes: u64,
    pub elapsed: Duration,
}

impl Summary {
    pub fn to_text(&self) -> String {
        format!(
            "{WARNING}\nwrote a {} checkpoint with {} layers to {}: {} shard(s), {:.2} GB of BF16 weights in {:.1} s\n\
             quantize it with: forge quantize --model {} --calib ids={}/{CALIB_FILE}:ROWS ...\n",
            self.shape,
            self.layers,
            self.output.display(),
            self.shards,
            self.bytes as f64 / 1e9,
            self.elapsed.as_secs_f64(),
            self.output.display(),
            self.output.display(),
        )
    }
}

/// The input channels of a `cin`-wide space that are outliers (the same for every matrix and
/// seed-independent, as a trained model's outlier channels belong to its hidden space).
pub fn outlier_channels(cin: usize) -> Vec<usize> {
    let mut rng = chunk_rng(0, "outliers", &cin.to_string(), 0);
    let mut v: Vec<usize> = (0..cin.div_ceil(OUTLIER_EVERY)).map(|_| (rng.next_u64() % cin as u64) as usize).collect();
    v.sort_unstable();
    v.dedup();
    v
}

/// Every tensor of the checkpoint in file order: (stored name, dtype, shape).
fn tensors(cfg: &ModelConfig) -> Vec<(String, Dtype, Vec<usize>)> {
    let small = source_tensors(cfg);
    let mut out = Vec::new();
    let layer_of = |n: &str| n.strip_prefix("layers.").and_then(|r| r.split('.').next()).and_then(|l| l.parse().ok());
    out.extend(small.iter().filter(|t| layer_of(&t.0).is_none() && t.0 != "norm.weight").cloned());
    for l in 0..cfg.num_layers {
        out.extend(small.iter().filter(|t| layer_of(&t.0) == Some(l)).cloned());
        for (name, o, i) in layer_matrices(cfg, l) {
            out.push((format!("{name}.weight"), Dtype::BF16, vec![o, i]));
        }
    }
    out.extend(small.iter().filter(|t| t.0 == "norm.weight").cloned());
    let mut out: Vec<_> = out.into_iter().map(|(n, d, s)| (format!("{SOURCE_PREFIX}{n}"), d, s)).collect();
    out.push(("lm_head.weight".to_string(), Dtype::BF16, vec![cfg.vocab_size, cfg.hidden_size]));
    out
}

/// Write the rows of projection `name` (`rows × cin`, BF16) block by block.
fn write_projection(seed: u64, name: &str, rows: usize, cin: usize, w: &mut dyn Write, pb: &ProgressBar) -> Result<()> {
    let mut gain = vec![1f32; cin];
    if !name.ends_with("embed_tokens.weight") {
        outlier_channels(cin).into_iter().for_each(|c| gain[c] = OUTLIER_GAIN);
    }
    let block = (BLOCK_VALUES / cin).max(1);
    for (b, r0) in (0..rows).step_by(block).enumerate() {
        let n = block.min(rows - r0);
        let mut v = normals(seed, name, &format!("rows{b}"), n * cin, 1.0);
        let z = normals(seed, name, &format!("scale{b}"), n, 1.0);
        for (row, z) in v.chunks_mut(cin).zip(z) {
            let s = ROW_SCALE * (ROW_SPREAD * z).exp();
            row.iter_mut().zip(&gain).for_each(|(x, g)| *x *= s * g);
        }
        w.write_all(&bf16_bytes(&v))?;
        pb.inc((n * cin) as u64);
    }
    Ok(())
}

fn shard_name(i: usize, n: usize) -> String {
    if n == 1 {
        "model.safetensors".to_string()
    } else {
        format!("model-{:05}-of-{n:05}.safetensors", i + 1)
    }
}

/// Write the checkpoint.
pub fn synth_checkpoint(o: &Options) -> Result<Summary> {
    let start = Instant::now();
    let mut shape = Shape::get(&o.shape)?;
    if let Some(n) = o.layers {
        shape = shape.with_layers(n)?;
    }
    let cfg = shape.model_config()?;
    let out = &o.output;
    if out.exists() && std::fs::read_dir(out)?.next().is_some() {
        bail!("{}: output directory is not empty (remove it, or choose another)", out.display());
    }
    if o.shard_bytes == 0 {
        bail!("shard size of 0 bytes");
    }
    std::fs::create_dir_all(out).with_context(|| format!("{}: cannot create", out.display()))?;
    let all = tensors(&cfg);
    let specs: Vec<TensorSpec> =
        all.iter().map(|(n, d, s)| TensorSpec { name: n.clone(), dtype: *d, shape: s.clone() }).collect();
    // Greedy shards in file order, a new one when the next tensor would pass the limit.
    let mut shards: Vec<Vec<usize>> = vec![vec![]];
    let mut size = 0usize;
    for (i, s) in specs.iter().enumerate() {
        let n = s.byte_len();
        if size > 0 && size + n > o.shard_bytes {
            shards.push(vec![]);
            size = 0;
        }
        shards.last_mut().unwrap().push(i);
        size += n;
    }
    let total: usize = specs.iter().map(|s| s.byte_len()).sum();
    let pb = crate::synth::weights_bar(o.progress, total / 2);
    let meta: BTreeMap<String, String> =
        [("format".to_string(), "pt".to_string()), ("forge_synthetic".to_string(), WARNING.to_string())].into();
    let mut weight_map = serde_json::Map::new();
    for (k, idx) in shards.iter().enumerate() {
        let file = shard_name(k, shards.len());
        let sub: Vec<TensorSpec> = idx.iter().map(|&i| specs[i].clone()).collect();
        write_streaming(&out.join(&file), &sub, &meta, |j, w| {
            let (name, dtype, shape) = &all[idx[j]];
            pb.set_message(name.clone());
            if let [rows, cin] = shape[..] {
                return write_projection(o.seed, name, rows, cin, w, &pb);
            }
            let canonical = name.strip_prefix(SOURCE_PREFIX).unwrap_or(name);
            let v = small_source_values(o.seed, canonical, shape.iter().product());
            match dtype {
                Dtype::F32 => w.write_all(&v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>())?,
                _ => w.write_all(&bf16_bytes(&v))?,
            }
            Ok(())
        })?;
        for &i in idx {
            weight_map.insert(specs[i].name.clone(), json!(file));
        }
    }
    pb.finish_and_clear();
    if shards.len() > 1 {
        let index = json!({"metadata": {"total_size": total}, "weight_map": Value::Object(weight_map)});
        write_atomic(&out.join("model.safetensors.index.json"), serde_json::to_string_pretty(&index)?.as_bytes())?;
    }
    write_calibration(&out.join(CALIB_FILE), cfg.vocab_size, o.seed)?;
    // config.json last: a directory without it is not a checkpoint, so an interrupted run never
    // leaves one that loads.
    write_atomic(&out.join("config.json"), serde_json::to_string_pretty(&shape.config)?.as_bytes())?;
    Ok(Summary {
        shape: shape.name,
        layers: cfg.num_layers,
        output: out.clone(),
        shards: shards.len(),
        bytes: total as u64,
        elapsed: start.elapsed(),
    })
}

/// Seeded random token ids in the `#rows` format of `--calib ids=FILE`.
fn write_calibration(path: &Path, vocab: usize, seed: u64) -> Result<()> {
    let mut rng = chunk_rng(seed, "calibration", "ids", 0);
    let mut s = format!("{}\n", crate::calib::ROWS_HEADER);
    for _ in 0..CALIB_ROWS {
        let ids: Vec<String> = (0..CALIB_SEQ).map(|_| (rng.next_u64() % vocab as u64).to_string()).collect();
        s.push_str(&ids.join(" "));
        s.push('\n');
    }
    write_atomic(path, s.as_bytes())
}

#[cfg(test)]
mod tests {
    use super::*;
    use forge_core::checkpoint::Checkpoint;

    fn tmp(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("forge-synthck-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        d
    }

    fn write(name: &str, layers: Option<usize>, shard_bytes: usize) -> (PathBuf, Summary) {
        let out = tmp(name);
        let o = Options { shape: "tiny".into(), layers, output: out.clone(), seed: 3, shard_bytes, progress: false };
        let s = synth_checkpoint(&o).unwrap();
        (out, s)
    }

    /// Loads as a Hugging Face checkpoint with every tensor the model needs, sharded through the
    /// index, with the requested layers in the 3 : 1 pattern.
    #[test]
    fn sharded_checkpoint_loads_with_the_layer_pattern() {
        let (out, s) = write("sharded", Some(5), 400_000);
        assert!(s.shards > 3, "{} shards", s.shards);
        assert!(out.join("model.safetensors.index.json").exists());
        let (ck, cfg) = Checkpoint::open(&out).unwrap();
        assert_eq!(cfg.num_layers, 5);
        use forge_core::config::LayerKind::*;
        assert_eq!(cfg.layer_kinds, vec![DeltaNet, DeltaNet, DeltaNet, Attention, DeltaNet]);
        assert!(!cfg.tie_embeddings);
        let m = forge_model::load::model_with_options(&ck, cfg, &|_, _, _| Ok(None), Default::default()).unwrap();
        let mut sess = m.new_session();
        let logits = m.forward(&mut sess, &[1, 2, 3], forge_model::model::Logits::Last).unwrap();
        assert!(logits.iter().all(|x| x.is_finite()));
        // Byte-for-byte reproducible from the seed, whatever the sharding.
        let (one, s1) = write("single", Some(5), SHARD_BYTES);
        assert_eq!(s1.shards, 1);
        let (ck1, _) = Checkpoint::open(&one).unwrap();
        for name in ["layers.4.mlp.down_proj.weight", "lm_head.weight", "layers.3.self_attn.q_norm.weight"] {
            let (a, b) = (ck.get(name).unwrap().unwrap(), ck1.get(name).unwrap().unwrap());
            assert_eq!(a.to_f32_vec().unwrap(), b.to_f32_vec().unwrap(), "{name}");
        }
        let _ = std::fs::remove_dir_all(out);
        let _ = std::fs::remove_dir_all(one);
    }

    /// Rows have spread scales around 0.02 and the outlier channels are about eight times the
    /// others (statistics of 256-wide rows: the bounds hold with a wide margin).
    #[test]
    fn projections_have_row_scales_and_outlier_channels() {
        let (out, _) = write("stats", Some(1), SHARD_BYTES);
        let (ck, cfg) = Checkpoint::open(&out).unwrap();
        let w = ck.get("layers.0.mlp.gate_proj.weight").unwrap().unwrap().to_f32_vec().unwrap();
        let cin = cfg.hidden_size;
        let outl = outlier_channels(cin);
        assert!(!outl.is_empty());
        let normal: Vec<usize> = (0..cin).filter(|c| !outl.contains(c)).collect();
        let rms = |cols: &[usize]| {
            let s: f64 = w.chunks(cin).flat_map(|r| cols.iter().map(move |&c| (r[c] as f64).powi(2))).sum();
            (s / (cols.len() * w.len() / cin) as f64).sqrt()
        };
        let ratio = rms(&outl) / rms(&normal);
        assert!((6.5..9.5).contains(&ratio), "outlier gain {ratio}");
        let row_rms: Vec<f64> = w
            .chunks(cin)
            .map(|r| (normal.iter().map(|&c| (r[c] as f64).powi(2)).sum::<f64>() / normal.len() as f64).sqrt())
            .collect();
        let (lo, hi) = row_rms.iter().fold((f64::MAX, 0f64), |(a, b), &x| (a.min(x), b.max(x)));
        assert!(lo > 0.006 && hi < 0.06 && hi / lo > 1.5, "row scales {lo}..{hi}");
        let _ = std::fs::remove_dir_all(out);
    }
}
