//! The teacher's reference distribution and KL of a candidate against it.
//!
//! A reference is a directory:
//!
//! | file | dtype, shape | what |
//! | --- | --- | --- |
//! | `text.bin` | bytes | the exact evaluated text (so the tokenizer check needs no other file) |
//! | `tokens.npy` | `<i4` `[windows·ctx]` | the windows' token ids |
//! | `positions.npy` | `<i4` `[N]` | token-stream index of each scored logit row (target = next token) |
//! | `topk_ids.npy` | `<i4` `[N, K]` | teacher's top-K ids, most probable first (ties: lower id first) |
//! | `topk_logp.npy` | `<f4` `[N, K]` | their log-probabilities |
//! | `tail_logp.npy` | `<f4` `[N]` | log of the mass outside the top-K, summed directly (`-inf` if K = vocab) |
//! | `nll.npy` | `<f4` `[N]` | teacher's −log p(next token) |
//! | `full_logp.npy` | `<f4` `[N, vocab]` | with `--full-vocab`: every log-probability |
//! | `manifest.json` | JSON | header (model, text, tokens, windows, K, tool) and every file's size and sha256 |
//!
//! The full-vocabulary file stays f32 (5,100 × 49,152 × 4 B ≈ 1.0 GB for the llama.cpp protocol
//! on SmolLM2): f16 log-probs would carry ~5e-4 absolute error at log p ≈ −1 and break the exact
//! zero of self-KL. It is streamed window by window, never held in memory, and read back the same
//! way (no memory map, which would need `unsafe`).
//!
//! Everything is written into a temporary sibling directory, `manifest.json` last, and the
//! directory is renamed into place; [`Reference::open`] refuses a directory without a manifest
//! or whose files do not match it, so a half-written reference is never used.

use super::kl::{self, Distribution};
use super::npy;
use super::text::{sha256_hex, PartInfo, TextBytes};
use super::{for_each_window, progress_bar, tokenize, tokens_sha256, EvalSetup, EvalText, ModelId, WindowPlan};
use anyhow::{bail, Context, Result};
use forge_model::load::Loaded;
use forge_model::Model;
use rayon::prelude::*;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Instant;

pub const FORMAT: &str = "forge-eval-reference";
pub const FORMAT_VERSION: u32 = 1;
pub const DEFAULT_TOP_K: usize = 256;
const MANIFEST: &str = "manifest.json";
const FULL: &str = "full_logp.npy";

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct TextHeader {
    /// Resolved spec: `--text` with this string reads the same bytes.
    pub spec: String,
    pub parts: Vec<PartInfo>,
    pub bytes: usize,
    pub sha256: String,
    /// Bytes that were not valid UTF-8 (each tokenized as U+FFFD, as llama.cpp does).
    pub invalid_utf8_bytes: usize,
    /// Code points llama.cpp would tokenize differently (see `text::Decoded`).
    pub unrepresentable_code_points: usize,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct TokenHeader {
    /// Tokens in the whole text (the windows use the first `windows · ctx`).
    pub count: usize,
    /// sha256 of all ids as little-endian u32.
    pub sha256: String,
    pub add_bos: bool,
    pub tokenizer_vocab_size: usize,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct TeacherHeader {
    pub nll_mean: f64,
    pub ppl: f64,
    pub forward_seconds: f64,
    pub seconds: f64,
    pub threads: usize,
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct FileEntry {
    pub dtype: String,
    pub shape: Vec<usize>,
    pub bytes: u64,
    pub sha256: String,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Manifest {
    pub format: String,
    pub format_version: u32,
    pub tool: String,
    pub created_unix: u64,
    pub model: ModelId,
    pub model_type: String,
    /// Logit width.
    pub vocab_size: usize,
    pub text: TextHeader,
    pub tokens: TokenHeader,
    pub protocol: String,
    pub ctx: usize,
    pub chunks: Option<usize>,
    pub windows: usize,
    pub score_from: usize,
    pub scored_per_window: usize,
    pub positions: usize,
    pub top_k: usize,
    pub full_vocab: bool,
    pub teacher: TeacherHeader,
    pub files: BTreeMap<String, FileEntry>,
}

impl Manifest {
    pub fn plan(&self) -> WindowPlan {
        WindowPlan { ctx: self.ctx, windows: self.windows, score_from: self.score_from }
    }
}

#[derive(Clone, Debug)]
pub struct ReferenceOptions {
    pub top_k: usize,
    pub full_vocab: bool,
    pub show_progress: bool,
    /// Replace an existing reference directory.
    pub force: bool,
}

impl Default for ReferenceOptions {
    fn default() -> Self {
        ReferenceOptions { top_k: DEFAULT_TOP_K, full_vocab: false, show_progress: false, force: false }
    }
}

/// Per-row teacher output.
struct TeacherRow {
    ids: Vec<u32>,
    logp: Vec<f32>,
    tail: f32,
    nll: f64,
    full: Vec<f32>,
}

fn sibling(out: &Path, tag: &str) -> Result<PathBuf> {
    let name = out.file_name().with_context(|| format!("{}: not a directory name", out.display()))?;
    let parent = out.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
    Ok(parent.join(format!(".{}.{tag}-{}", name.to_string_lossy(), std::process::id())))
}

fn write_file(dir: &Path, name: &str, bytes: &[u8], dtype: &str, shape: &[usize]) -> Result<FileEntry> {
    let p = dir.join(name);
    std::fs::write(&p, bytes).with_context(|| format!("{}: cannot write", p.display()))?;
    Ok(FileEntry { dtype: dtype.into(), shape: shape.to_vec(), bytes: bytes.len() as u64, sha256: sha256_hex(bytes) })
}

/// Runs the teacher over the windows of `text` and writes the reference to `out`.
pub fn build(
    loaded: &Loaded,
    setup: &EvalSetup,
    text: &EvalText,
    out: &Path,
    opts: &ReferenceOptions,
) -> Result<Manifest> {
    let t0 = Instant::now();
    let model = &loaded.model;
    let v = model.cfg.vocab_size;
    let k = opts.top_k;
    if k == 0 || k > v {
        bail!("--top-k {k}: must be between 1 and the vocabulary size {v}");
    }
    if out.exists() {
        if !opts.force {
            bail!("{}: already exists (pass --force to replace it)", out.display());
        }
        // --force replaces a reference, never an arbitrary directory or file.
        let is_reference = std::fs::read(out.join(MANIFEST))
            .ok()
            .and_then(|b| serde_json::from_slice::<serde_json::Value>(&b).ok())
            .is_some_and(|m| m.get("format").and_then(|f| f.as_str()) == Some(FORMAT));
        let is_empty_dir = out.is_dir() && std::fs::read_dir(out).map(|mut d| d.next().is_none()).unwrap_or(false);
        if !is_reference && !is_empty_dir {
            bail!("{}: exists and is not an evaluation reference; --force only replaces references", out.display());
        }
    }
    let plan = WindowPlan::new(text.tokens.len(), setup.ctx, setup.chunks, setup.score_from)?;
    let model_id = super::model_id(&loaded.path)?;
    let tok = loaded.tokenizer()?;

    let tmp = sibling(out, "tmp")?;
    if tmp.exists() {
        std::fs::remove_dir_all(&tmp).with_context(|| format!("{}: cannot remove stale directory", tmp.display()))?;
    }
    std::fs::create_dir_all(&tmp).with_context(|| format!("{}: cannot create", tmp.display()))?;
    let result = (|| -> Result<Manifest> {
        let n = plan.n_positions();
        let mut full = if opts.full_vocab { Some(npy::RowWriter::create(&tmp.join(FULL), &[n, v])?) } else { None };
        let (mut ids, mut logp) = (Vec::with_capacity(n * k), Vec::with_capacity(n * k));
        let (mut tail, mut nll) = (Vec::with_capacity(n), Vec::with_capacity(n));
        let want_full = opts.full_vocab;
        let pb = progress_bar(plan.windows, "reference", opts.show_progress);
        let forward_seconds = for_each_window(model, &text.tokens, &plan, &pb, |_, rows, targets| {
            let out: Vec<TeacherRow> = rows
                .par_chunks(v)
                .zip(targets.par_iter())
                .map_init(
                    || (vec![false; v], Vec::new()),
                    |(mask, idx), (z, &t)| {
                        let top = kl::top_k(z, k, idx);
                        top.iter().for_each(|&i| mask[i as usize] = true);
                        let st = kl::row_stats(z, mask);
                        top.iter().for_each(|&i| mask[i as usize] = false);
                        TeacherRow {
                            logp: top.iter().map(|&i| kl::logp(z, i as usize, &st)).collect(),
                            ids: top,
                            tail: st.log_rest as f32,
                            nll: st.lse - z[t as usize] as f64,
                            full: if want_full { (0..v).map(|j| kl::logp(z, j, &st)).collect() } else { Vec::new() },
                        }
                    },
                )
                .collect();
            for r in &out {
                ids.extend_from_slice(&r.ids);
                logp.extend_from_slice(&r.logp);
                tail.push(r.tail);
                nll.push(r.nll);
            }
            if let Some(w) = full.as_mut() {
                for r in &out {
                    w.write(&r.full)?;
                }
            }
            Ok(())
        })?;

        let mut files = BTreeMap::new();
        files.insert(
            "text.bin".into(),
            write_file(&tmp, "text.bin", &text.bytes.bytes, "u8", &[text.bytes.bytes.len()])?,
        );
        let toks: Vec<i32> = text.tokens[..plan.n_tokens()].iter().map(|&t| t as i32).collect();
        let pos: Vec<i32> = plan.positions().iter().map(|&p| p as i32).collect();
        let ids_i: Vec<i32> = ids.iter().map(|&i| i as i32).collect();
        let nll_f: Vec<f32> = nll.iter().map(|&x| x as f32).collect();
        for (name, bytes, dtype, shape) in [
            ("tokens.npy", npy::to_bytes_i32(&[toks.len()], &toks), "<i4", vec![toks.len()]),
            ("positions.npy", npy::to_bytes_i32(&[n], &pos), "<i4", vec![n]),
            ("topk_ids.npy", npy::to_bytes_i32(&[n, k], &ids_i), "<i4", vec![n, k]),
            ("topk_logp.npy", npy::to_bytes_f32(&[n, k], &logp), "<f4", vec![n, k]),
            ("tail_logp.npy", npy::to_bytes_f32(&[n], &tail), "<f4", vec![n]),
            ("nll.npy", npy::to_bytes_f32(&[n], &nll_f), "<f4", vec![n]),
        ] {
            files.insert(name.to_string(), write_file(&tmp, name, &bytes, dtype, &shape)?);
        }
        if let Some(w) = full {
            let (bytes, sha256) = w.finish()?;
            files.insert(FULL.into(), FileEntry { dtype: "<f4".into(), shape: vec![n, v], bytes, sha256 });
        }
        let nll_mean = nll_f.iter().map(|&x| x as f64).sum::<f64>() / n as f64;
        let manifest = Manifest {
            format: FORMAT.into(),
            format_version: FORMAT_VERSION,
            tool: super::TOOL_VERSION.into(),
            created_unix: std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_secs())
                .unwrap_or(0),
            model: model_id,
            model_type: model.cfg.model_type.clone(),
            vocab_size: v,
            text: TextHeader {
                spec: text.bytes.spec.clone(),
                parts: text.bytes.parts.clone(),
                bytes: text.bytes.bytes.len(),
                sha256: text.bytes.sha256(),
                invalid_utf8_bytes: text.invalid_utf8_bytes,
                unrepresentable_code_points: text.unrepresentable,
            },
            tokens: TokenHeader {
                count: text.tokens.len(),
                sha256: tokens_sha256(&text.tokens),
                add_bos: text.add_bos,
                tokenizer_vocab_size: tok.vocab_size(),
            },
            protocol: setup.protocol_name().into(),
            ctx: plan.ctx,
            chunks: setup.chunks,
            windows: plan.windows,
            score_from: plan.score_from,
            scored_per_window: plan.scored_per_window(),
            positions: n,
            top_k: k,
            full_vocab: opts.full_vocab,
            teacher: TeacherHeader {
                nll_mean,
                ppl: nll_mean.exp(),
                forward_seconds,
                seconds: t0.elapsed().as_secs_f64(),
                threads: rayon::current_num_threads(),
            },
            files,
        };
        let json = serde_json::to_vec_pretty(&manifest)?;
        forge_core::fsutil::write_atomic(&tmp.join(MANIFEST), &json)?;
        Ok(manifest)
    })();
    let manifest = match result {
        Ok(m) => m,
        Err(e) => {
            let _ = std::fs::remove_dir_all(&tmp);
            return Err(e);
        }
    };
    install(&tmp, out)?;
    Ok(manifest)
}

/// Moves the finished directory into place; an existing one (only with `--force`) is moved
/// aside first and removed after.
fn install(tmp: &Path, out: &Path) -> Result<()> {
    if out.exists() {
        let old = sibling(out, "old")?;
        std::fs::rename(out, &old)
            .with_context(|| format!("{}: cannot move the old reference aside", out.display()))?;
        if let Err(e) = std::fs::rename(tmp, out) {
            let _ = std::fs::rename(&old, out);
            let _ = std::fs::remove_dir_all(tmp);
            return Err(e).with_context(|| format!("{}: cannot move the new reference into place", out.display()));
        }
        std::fs::remove_dir_all(&old).with_context(|| format!("{}: cannot remove", old.display()))?;
    } else if let Err(e) = std::fs::rename(tmp, out) {
        let _ = std::fs::remove_dir_all(tmp);
        return Err(e).with_context(|| format!("{}: cannot move the reference into place", out.display()));
    }
    Ok(())
}

/// A reference loaded and verified (every file against the manifest's size and sha256; the
/// full-vocabulary file by size here and by sha256 as it is streamed).
pub struct Reference {
    pub dir: PathBuf,
    pub manifest: Manifest,
    pub text: Vec<u8>,
    /// The windows' tokens.
    pub tokens: Vec<u32>,
    pub topk_ids: Vec<u32>,
    pub topk_logp: Vec<f32>,
    pub tail: Vec<f32>,
    pub nll: Vec<f32>,
}

impl Reference {
    pub fn open(dir: &Path) -> Result<Self> {
        let mp = dir.join(MANIFEST);
        if !dir.is_dir() {
            bail!("{}: no such reference directory", dir.display());
        }
        let raw = std::fs::read(&mp).map_err(|e| {
            anyhow::anyhow!(
                "{}: cannot read ({e}): not a complete reference (`forge eval reference` writes it last)",
                mp.display()
            )
        })?;
        let manifest: Manifest =
            serde_json::from_slice(&raw).with_context(|| format!("{}: malformed manifest", mp.display()))?;
        if manifest.format != FORMAT || manifest.format_version != FORMAT_VERSION {
            bail!(
                "{}: format '{}' version {} (this tool reads '{FORMAT}' version {FORMAT_VERSION})",
                mp.display(),
                manifest.format,
                manifest.format_version
            );
        }
        let (n, k, v) = (manifest.positions, manifest.top_k, manifest.vocab_size);
        let plan = manifest.plan();
        if plan.n_positions() != n || k == 0 || k > v {
            bail!("{}: inconsistent header (positions {n}, top_k {k}, vocab {v})", mp.display());
        }
        let load = |name: &str, shape: &[usize]| -> Result<Vec<u8>> {
            let p = dir.join(name);
            let e = manifest.files.get(name).with_context(|| format!("{}: no entry for {name}", mp.display()))?;
            if e.shape != shape {
                bail!("{}: {name} has shape {:?}, the header implies {shape:?}", mp.display(), e.shape);
            }
            let b = std::fs::read(&p).with_context(|| format!("{}: cannot read", p.display()))?;
            if b.len() as u64 != e.bytes || sha256_hex(&b) != e.sha256 {
                bail!("{}: does not match the manifest (size or sha256): the reference is damaged", p.display());
            }
            Ok(b)
        };
        let arr_i32 = |name: &str, shape: &[usize]| -> Result<Vec<i32>> {
            let b = load(name, shape)?;
            let h = npy::parse_header(&b).with_context(|| format!("{}/{name}", dir.display()))?;
            if h.dtype != npy::Dtype::I32 || h.shape != shape {
                bail!("{}/{name}: {:?} {:?}, expected <i4 {shape:?}", dir.display(), h.dtype, h.shape);
            }
            Ok(b[h.data_offset..].chunks_exact(4).map(|c| i32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect())
        };
        let arr_f32 = |name: &str, shape: &[usize]| -> Result<Vec<f32>> {
            let b = load(name, shape)?;
            let h = npy::parse_header(&b).with_context(|| format!("{}/{name}", dir.display()))?;
            if h.dtype != npy::Dtype::F32 || h.shape != shape {
                bail!("{}/{name}: {:?} {:?}, expected <f4 {shape:?}", dir.display(), h.dtype, h.shape);
            }
            Ok(b[h.data_offset..].chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect())
        };
        let text = load("text.bin", &[manifest.text.bytes])?;
        let ids = |v: Vec<i32>, name: &str| -> Result<Vec<u32>> {
            v.into_iter()
                .map(|x| {
                    u32::try_from(x)
                        .ok()
                        .filter(|&t| (t as usize) < manifest.vocab_size)
                        .with_context(|| format!("{}/{name}: token id {x} outside the vocabulary", dir.display()))
                })
                .collect()
        };
        let tokens = ids(arr_i32("tokens.npy", &[plan.n_tokens()])?, "tokens.npy")?;
        let positions = arr_i32("positions.npy", &[n])?;
        if positions.iter().zip(plan.positions()).any(|(&a, b)| a as usize != b) {
            bail!("{}/positions.npy: does not match ctx {} / score_from {}", dir.display(), plan.ctx, plan.score_from);
        }
        let topk_ids = ids(arr_i32("topk_ids.npy", &[n, k])?, "topk_ids.npy")?;
        let topk_logp = arr_f32("topk_logp.npy", &[n, k])?;
        let tail = arr_f32("tail_logp.npy", &[n])?;
        let nll = arr_f32("nll.npy", &[n])?;
        if manifest.full_vocab {
            let e = manifest.files.get(FULL).with_context(|| format!("{}: no entry for {FULL}", mp.display()))?;
            let p = dir.join(FULL);
            let len = std::fs::metadata(&p).with_context(|| format!("{}: missing", p.display()))?.len();
            if len != e.bytes || e.shape != [n, v] {
                bail!("{}: {len} bytes, the manifest says {} (shape {:?})", p.display(), e.bytes, e.shape);
            }
        }
        Ok(Reference { dir: dir.to_path_buf(), manifest, text, tokens, topk_ids, topk_logp, tail, nll })
    }

    pub fn teacher_ppl(&self) -> f64 {
        kl::perplexity(&self.nll.iter().map(|&x| x as f64).collect::<Vec<_>>())
    }
}

/// Refuses a candidate whose vocabulary or tokenizer differs from the teacher's: the reference
/// text, re-tokenized by the candidate, must give the very token ids the reference recorded.
pub fn check_candidate(r: &Reference, loaded: &Loaded) -> Result<()> {
    let m = &r.manifest;
    let cand = loaded.path.display();
    let teacher = &m.model.path;
    if loaded.model.cfg.vocab_size != m.vocab_size {
        bail!(
            "{cand}: vocabulary size {} differs from the reference's {} (teacher {teacher}); KL needs the same vocabulary",
            loaded.model.cfg.vocab_size,
            m.vocab_size
        );
    }
    let tok =
        loaded.tokenizer().with_context(|| format!("{cand}: cannot check its tokenizer against the reference"))?;
    if tok.vocab_size() != m.tokens.tokenizer_vocab_size {
        bail!(
            "{cand}: tokenizer has {} tokens, the teacher's ({teacher}) has {}",
            tok.vocab_size(),
            m.tokens.tokenizer_vocab_size
        );
    }
    let bytes = TextBytes { spec: m.text.spec.clone(), parts: m.text.parts.clone(), bytes: r.text.clone() };
    let t = tokenize(tok, bytes)?;
    if tokens_sha256(&t.tokens) != m.tokens.sha256 {
        let first = t.tokens.iter().zip(&r.tokens).position(|(a, b)| a != b);
        bail!(
            "{cand}: its tokenizer turns the reference text into different token ids ({} tokens vs the teacher's {}{}, \
             BOS {} vs {}); the candidate must share the teacher's ({teacher}) tokenizer",
            t.tokens.len(),
            m.tokens.count,
            first.map(|i| format!(", first difference at token {i}")).unwrap_or_default(),
            t.add_bos,
            m.tokens.add_bos
        );
    }
    Ok(())
}

#[derive(Clone, Debug)]
pub struct KlOptions {
    /// Exact KL from `full_logp.npy` instead of top-K + tail.
    pub full_vocab: bool,
    pub show_progress: bool,
}

/// Per-position results of a candidate against a reference.
#[derive(Clone, Debug)]
pub struct KlResult {
    pub kl: Vec<f64>,
    pub nll: Vec<f64>,
    pub top1: Vec<bool>,
    pub method: String,
    pub forward_seconds: f64,
    pub seconds: f64,
}

impl KlResult {
    pub fn top1_agreement(&self) -> f64 {
        self.top1.iter().filter(|&&b| b).count() as f64 / self.top1.len().max(1) as f64
    }
}

/// Runs `model` over the reference's windows and compares it position by position. Call
/// [`check_candidate`] first when the model comes with a tokenizer.
pub fn kl_against(r: &Reference, model: &Model, opts: &KlOptions) -> Result<KlResult> {
    let t0 = Instant::now();
    let m = &r.manifest;
    let (v, k, spw) = (m.vocab_size, m.top_k, m.scored_per_window);
    if model.cfg.vocab_size != v {
        bail!("candidate vocabulary size {} differs from the reference's {v}", model.cfg.vocab_size);
    }
    let mut full = if opts.full_vocab {
        if !m.full_vocab {
            bail!(
                "{}: was built without --full-vocab; rebuild it with `forge eval reference --full-vocab` for exact KL",
                r.dir.display()
            );
        }
        Some(npy::RowReader::open(&r.dir.join(FULL))?)
    } else {
        None
    };
    let plan = m.plan();
    let n = plan.n_positions();
    let (mut kls, mut nll, mut top1) = (Vec::with_capacity(n), Vec::with_capacity(n), Vec::with_capacity(n));
    let mut full_rows = Vec::new();
    let pb = progress_bar(plan.windows, "kl", opts.show_progress);
    let forward_seconds = for_each_window(model, &r.tokens, &plan, &pb, |w, rows, targets| {
        let base = w * spw;
        if let Some(reader) = full.as_mut() {
            reader.read_rows(base, spw, &mut full_rows)?;
        }
        let full_rows = &full_rows;
        let use_full = opts.full_vocab;
        let out: Vec<(f64, f64, bool)> = rows
            .par_chunks(v)
            .zip(targets.par_iter())
            .enumerate()
            .map_init(
                || vec![false; v],
                |mask, (i, (z, &t))| {
                    let p = base + i;
                    let ids = &r.topk_ids[p * k..(p + 1) * k];
                    ids.iter().for_each(|&j| mask[j as usize] = true);
                    let st = kl::row_stats(z, mask);
                    ids.iter().for_each(|&j| mask[j as usize] = false);
                    let d = if use_full {
                        kl::kl_full_vs_logits(&full_rows[i * v..(i + 1) * v], z, &st)
                    } else {
                        let lq: Vec<f32> = ids.iter().map(|&j| kl::logp(z, j as usize, &st)).collect();
                        kl::kl_topk_tail(&r.topk_logp[p * k..(p + 1) * k], r.tail[p], &lq, (st.log_rest as f32) as f64)
                    };
                    (d, st.lse - z[t as usize] as f64, kl::argmax(z) == ids[0] as usize)
                },
            )
            .collect();
        for (d, l, t) in out {
            kls.push(d);
            nll.push(l);
            top1.push(t);
        }
        Ok(())
    })?;
    if let (Some(reader), Some(e)) = (full, m.files.get(FULL)) {
        if let Some(sha) = reader.finished_sha256() {
            if sha != e.sha256 {
                bail!("{}/{FULL}: sha256 differs from the manifest: the reference is damaged", r.dir.display());
            }
        }
    }
    let method = if opts.full_vocab { "full vocabulary".to_string() } else { format!("top-{k} + tail") };
    Ok(KlResult { kl: kls, nll, top1, method, forward_seconds, seconds: t0.elapsed().as_secs_f64() })
}

/// The reference a summary was measured against.
#[derive(Clone, Debug, Serialize)]
pub struct ReferenceInfo {
    pub dir: String,
    pub teacher: ModelId,
    pub protocol: String,
    pub text: String,
    pub text_sha256: String,
    pub tokens_sha256: String,
    pub ctx: usize,
    pub windows: usize,
    pub score_from: usize,
    pub scored_positions: usize,
    pub top_k: usize,
}

/// What `forge eval kl` reports.
#[derive(Clone, Debug, Serialize)]
pub struct KlSummary {
    pub tool: String,
    pub reference: ReferenceInfo,
    pub candidate: ModelId,
    /// Which linears keep quantized weights (`all linears` without `--parts`/`--layers`).
    pub ablation: String,
    pub kl_method: String,
    /// KL(teacher ‖ candidate) in nats over the scored positions.
    pub kl: Distribution,
    pub top1_agreement: f64,
    pub ppl_candidate: f64,
    pub ppl_teacher: f64,
    pub nll_mean_candidate: f64,
    pub nll_mean_teacher: f64,
    pub per_position_npy: Option<String>,
    pub forward_seconds: f64,
    pub seconds: f64,
    pub threads: usize,
}

pub fn summarize(r: &Reference, candidate: ModelId, ablation: String, res: &KlResult) -> KlSummary {
    let m = &r.manifest;
    let nll_t: Vec<f64> = r.nll.iter().map(|&x| x as f64).collect();
    let mean = |v: &[f64]| v.iter().sum::<f64>() / v.len().max(1) as f64;
    KlSummary {
        tool: super::TOOL_VERSION.into(),
        reference: ReferenceInfo {
            dir: std::path::absolute(&r.dir).unwrap_or_else(|_| r.dir.clone()).display().to_string(),
            teacher: m.model.clone(),
            protocol: m.protocol.clone(),
            text: m.text.spec.clone(),
            text_sha256: m.text.sha256.clone(),
            tokens_sha256: m.tokens.sha256.clone(),
            ctx: m.ctx,
            windows: m.windows,
            score_from: m.score_from,
            scored_positions: m.positions,
            top_k: m.top_k,
        },
        candidate,
        ablation,
        kl_method: res.method.clone(),
        kl: kl::summarize(&res.kl),
        top1_agreement: res.top1_agreement(),
        ppl_candidate: kl::perplexity(&res.nll),
        ppl_teacher: kl::perplexity(&nll_t),
        nll_mean_candidate: mean(&res.nll),
        nll_mean_teacher: mean(&nll_t),
        per_position_npy: None,
        forward_seconds: res.forward_seconds,
        seconds: res.seconds,
        threads: rayon::current_num_threads(),
    }
}
