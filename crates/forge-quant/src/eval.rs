//! Evaluation: perplexity and KL(teacher ‖ candidate) over fixed windows of a fixed text.
//!
//! The text (a [`text::TextSpec`]) is tokenized once with the model's tokenizer (BOS only when the
//! tokenizer's `add_bos` says so), cut into consecutive windows of `ctx` tokens (at most `chunks`
//! of them; a final partial window is dropped, as llama-perplexity does), and each window runs as
//! one fresh sequence: one prefill of `ctx` tokens with logits at every position. In each window
//! the logits at positions `score_from ..= ctx − 2` are scored against the next token.
//!
//! [`Protocol::LlamaPerplexity`] is `llama-perplexity -c 512 --chunks 20` on the first 80 KiB of
//! `data/eval/prose.txt` followed by the first 80 KiB of `data/eval/code.txt`: positions 256–510 of
//! 20 windows, 5,100 scored positions. (At ~4 bytes per token those 10,240 tokens all come from the
//! prose part; the code part is tokenized but never reached.)
//!
//! `forge eval reference` stores the teacher's distribution at every scored position
//! ([`reference`]); `forge eval kl` runs a candidate over the same windows and compares
//! ([`reference::kl_against`]); `forge eval ppl` is plain perplexity ([`perplexity`]).

pub mod kl;
pub mod npy;
pub mod parts;
pub mod reference;
pub mod text;

use anyhow::{bail, Context, Result};
use forge_core::tokenizer::Tokenizer;
use forge_model::{Logits, Model};
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};
use std::time::Instant;

pub use parts::{Part, PartFilter};
pub use text::{TextBytes, TextSpec};

/// Version string recorded in reference headers and summaries.
pub const TOOL_VERSION: &str = concat!("forge-quant ", env!("CARGO_PKG_VERSION"), " eval");

/// A named, fixed evaluation setup.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Protocol {
    /// llama.cpp's `llama-perplexity -c 512 --chunks 20` as in docs/evaluation.md.
    LlamaPerplexity,
}

impl Protocol {
    pub fn parse(s: &str) -> Result<Self> {
        match s {
            "llama-perplexity" | "llama.cpp" => Ok(Protocol::LlamaPerplexity),
            other => bail!("unknown protocol '{other}' (known: llama-perplexity)"),
        }
    }
    pub fn name(self) -> &'static str {
        match self {
            Protocol::LlamaPerplexity => "llama-perplexity",
        }
    }
    pub fn ctx(self) -> usize {
        512
    }
    pub fn chunks(self) -> usize {
        20
    }
    /// llama-perplexity scores the second half of each window: `first = n_ctx / 2`.
    pub fn score_from(self) -> usize {
        self.ctx() / 2
    }
    /// Relative to the data directory (the repository's `data/`).
    pub fn text_spec(self) -> &'static str {
        "eval/prose.txt:81920,eval/code.txt:81920"
    }
}

/// Where scored positions are.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct WindowPlan {
    pub ctx: usize,
    pub windows: usize,
    /// First scored position within a window; positions `score_from ..= ctx − 2` are scored.
    pub score_from: usize,
}

impl WindowPlan {
    /// `chunks` caps the window count; `None` takes every full window.
    pub fn new(n_tokens: usize, ctx: usize, chunks: Option<usize>, score_from: usize) -> Result<Self> {
        if ctx < 2 {
            bail!("--ctx {ctx}: a window needs at least 2 tokens");
        }
        if score_from > ctx - 2 {
            bail!(
                "--score-from {score_from}: must be at most ctx − 2 = {} (the last position has no next token)",
                ctx - 2
            );
        }
        if chunks == Some(0) {
            bail!("--chunks 0: nothing to evaluate");
        }
        let full = n_tokens / ctx;
        if full == 0 {
            bail!("the text has {n_tokens} tokens, fewer than one window of {ctx}");
        }
        let windows = chunks.map_or(full, |c| c.min(full));
        Ok(WindowPlan { ctx, windows, score_from })
    }

    pub fn scored_per_window(&self) -> usize {
        self.ctx - 1 - self.score_from
    }

    pub fn n_positions(&self) -> usize {
        self.windows * self.scored_per_window()
    }

    pub fn n_tokens(&self) -> usize {
        self.windows * self.ctx
    }

    /// Index (into the token stream) of each scored logit position; its target is the next token.
    pub fn positions(&self) -> Vec<usize> {
        (0..self.windows).flat_map(|w| (self.score_from..self.ctx - 1).map(move |i| w * self.ctx + i)).collect()
    }
}

/// The text and how to cut it, before tokenization.
#[derive(Clone, Debug)]
pub struct EvalSetup {
    pub protocol: Option<Protocol>,
    pub text: TextSpec,
    pub ctx: usize,
    pub chunks: Option<usize>,
    pub score_from: usize,
}

/// Window options as given on the command line (unset = default or protocol value).
#[derive(Clone, Debug, Default)]
pub struct WindowArgs {
    pub text: Option<String>,
    pub protocol: Option<String>,
    pub data_dir: Option<PathBuf>,
    pub ctx: Option<usize>,
    pub chunks: Option<usize>,
    pub score_from: Option<usize>,
}

/// Default `--ctx` without a protocol.
pub const DEFAULT_CTX: usize = 512;

impl EvalSetup {
    /// A protocol fixes text, ctx, chunks and scored positions; an explicit value that disagrees
    /// is an error rather than a silently different measurement under the protocol's name.
    pub fn resolve(a: &WindowArgs) -> Result<Self> {
        let data_dir = || -> Result<PathBuf> {
            match &a.data_dir {
                Some(d) => Ok(d.clone()),
                None => find_data_dir()
                    .context("cannot find the data directory (data/ in the Forge repository): pass --data-dir"),
            }
        };
        match a.protocol.as_deref().map(Protocol::parse).transpose()? {
            Some(p) => {
                if let Some(t) = &a.text {
                    bail!(
                        "--text '{t}' conflicts with --protocol {} (its text is {} under the data directory; \
                         use --data-dir to point at another copy)",
                        p.name(),
                        p.text_spec()
                    );
                }
                for (flag, given, fixed) in [
                    ("--ctx", a.ctx, p.ctx()),
                    ("--chunks", a.chunks, p.chunks()),
                    ("--score-from", a.score_from, p.score_from()),
                ] {
                    if let Some(g) = given {
                        if g != fixed {
                            bail!("{flag} {g} conflicts with --protocol {} ({flag} {fixed})", p.name());
                        }
                    }
                }
                let dir = data_dir()?;
                Ok(EvalSetup {
                    protocol: Some(p),
                    text: TextSpec::parse(p.text_spec(), Some(&dir))?,
                    ctx: p.ctx(),
                    chunks: Some(p.chunks()),
                    score_from: p.score_from(),
                })
            }
            None => {
                let t =
                    a.text.as_deref().context("give --text FILE[:MAX_BYTES][,...] or --protocol llama-perplexity")?;
                Ok(EvalSetup {
                    protocol: None,
                    text: TextSpec::parse(t, a.data_dir.as_deref())?,
                    ctx: a.ctx.unwrap_or(DEFAULT_CTX),
                    chunks: a.chunks,
                    score_from: a.score_from.unwrap_or(0),
                })
            }
        }
    }

    pub fn protocol_name(&self) -> &'static str {
        self.protocol.map_or("custom", |p| p.name())
    }
}

/// The repository's `data/` directory (calibration and evaluation text with their licence),
/// found from the current directory, the executable's location, or (last) the source tree
/// this crate was built from.
pub fn find_data_dir() -> Option<PathBuf> {
    let probe = |start: &Path| -> Option<PathBuf> {
        start.ancestors().find_map(|a| {
            let d = a.join("data");
            let ours = d.join("eval").join("prose.txt").is_file() && d.join("LICENSE-PSF.txt").is_file();
            ours.then(|| std::fs::canonicalize(&d).unwrap_or(d))
        })
    };
    let cwd = std::env::current_dir().ok();
    let exe = std::env::current_exe().ok();
    cwd.as_deref()
        .and_then(probe)
        .or_else(|| exe.as_deref().and_then(probe))
        .or_else(|| probe(Path::new(env!("CARGO_MANIFEST_DIR"))))
}

/// The text tokenized.
#[derive(Clone, Debug)]
pub struct EvalText {
    pub bytes: TextBytes,
    pub tokens: Vec<u32>,
    pub add_bos: bool,
    /// See [`text::Decoded`].
    pub invalid_utf8_bytes: usize,
    pub unrepresentable: usize,
}

/// Tokenize exactly as llama-perplexity would: the raw bytes decoded by llama.cpp's rule, BOS
/// per the tokenizer's `add_bos`, special-token text matched as in `common_tokenize(…, true)`.
pub fn tokenize(tok: &Tokenizer, bytes: TextBytes) -> Result<EvalText> {
    let d = text::decode_like_llama_cpp(&bytes.bytes);
    let tokens = tok.encode(&d.text, tok.add_bos()).with_context(|| format!("tokenizing {}", bytes.spec))?;
    Ok(EvalText {
        bytes,
        tokens,
        add_bos: tok.add_bos(),
        invalid_utf8_bytes: d.invalid_bytes,
        unrepresentable: d.unrepresentable,
    })
}

/// sha256 of token ids as little-endian u32.
pub fn tokens_sha256(tokens: &[u32]) -> String {
    let b: Vec<u8> = tokens.iter().flat_map(|t| t.to_le_bytes()).collect();
    text::sha256_hex(&b)
}

/// Identity of a model: sha256 of the file, or for a directory of `config.json` (and
/// `forge.json` when present) plus the names and sizes of its weight files (hashing gigabytes
/// of safetensors on every evaluation would cost more than the evaluation).
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct ModelId {
    pub path: String,
    pub sha256: String,
    /// What was hashed.
    pub sha256_of: String,
}

pub fn model_id(path: &Path) -> Result<ModelId> {
    use sha2::{Digest, Sha256};
    use std::io::Read;
    let abs = std::fs::canonicalize(path).unwrap_or_else(|_| path.to_path_buf());
    let mut h = Sha256::new();
    let what = if path.is_dir() {
        let mut names: Vec<String> = Vec::new();
        for e in std::fs::read_dir(path).with_context(|| format!("{}: cannot list", path.display()))? {
            let e = e.with_context(|| format!("{}: cannot list", path.display()))?;
            names.push(e.file_name().to_string_lossy().into_owned());
        }
        names.sort();
        for meta in ["config.json", "forge.json"] {
            let p = path.join(meta);
            if p.exists() {
                let b = std::fs::read(&p).with_context(|| format!("{}: cannot read", p.display()))?;
                h.update(meta.as_bytes());
                h.update([0]);
                h.update(&b);
            }
        }
        let mut n_weights = 0;
        for n in names.iter().filter(|n| n.ends_with(".safetensors") || n.ends_with(".gguf")) {
            let len = std::fs::metadata(path.join(n)).with_context(|| format!("{}/{n}", path.display()))?.len();
            h.update(format!("{n}\0{len}\n").as_bytes());
            n_weights += 1;
        }
        format!("config.json (+ forge.json) bytes and names/sizes of {n_weights} weight files")
    } else {
        let mut f = std::fs::File::open(path).with_context(|| format!("{}: cannot open", path.display()))?;
        let mut buf = vec![0u8; 1 << 20];
        loop {
            let n = f.read(&mut buf).with_context(|| format!("{}: cannot read", path.display()))?;
            if n == 0 {
                break;
            }
            h.update(&buf[..n]);
        }
        "file".to_string()
    };
    Ok(ModelId { path: abs.display().to_string(), sha256: text::hex(&h.finalize()), sha256_of: what })
}

/// Progress over windows on stderr (drawn only when stderr is a terminal).
pub fn progress_bar(n: usize, label: &str, show: bool) -> indicatif::ProgressBar {
    if !show {
        return indicatif::ProgressBar::hidden();
    }
    let pb = indicatif::ProgressBar::new(n as u64);
    if let Ok(style) = indicatif::ProgressStyle::with_template(
        "{prefix} [{bar:30}] {pos}/{len} windows, {elapsed} elapsed, ETA {eta} ({per_sec})",
    ) {
        pb.set_style(style.progress_chars("=> "));
    }
    pb.set_prefix(label.to_string());
    pb
}

/// Runs every window of `plan` through `model` as a fresh sequence and hands `f` the window
/// index, the logit rows of its scored positions (`scored_per_window × vocab`) and their
/// targets. Returns the seconds spent in the model.
pub fn for_each_window(
    model: &Model,
    tokens: &[u32],
    plan: &WindowPlan,
    pb: &indicatif::ProgressBar,
    mut f: impl FnMut(usize, &[f32], &[u32]) -> Result<()>,
) -> Result<f64> {
    let v = model.cfg.vocab_size;
    if tokens.len() < plan.n_tokens() {
        bail!("{} tokens, the plan needs {}", tokens.len(), plan.n_tokens());
    }
    let mut forward_s = 0f64;
    for w in 0..plan.windows {
        let toks = &tokens[w * plan.ctx..(w + 1) * plan.ctx];
        let mut s = model.new_session();
        let t0 = Instant::now();
        let logits = model.forward(&mut s, toks, Logits::All).with_context(|| format!("window {w}"))?;
        forward_s += t0.elapsed().as_secs_f64();
        if logits.len() != plan.ctx * v {
            bail!("window {w}: the model returned {} logits, expected {} × {v}", logits.len(), plan.ctx);
        }
        let rows = &logits[plan.score_from * v..(plan.ctx - 1) * v];
        f(w, rows, &toks[plan.score_from + 1..])?;
        pb.inc(1);
    }
    pb.finish_and_clear();
    Ok(forward_s)
}

/// Plain perplexity of a model over the windows.
#[derive(Clone, Debug, Serialize)]
pub struct PplReport {
    pub protocol: String,
    pub text: String,
    pub text_sha256: String,
    pub text_tokens: usize,
    pub tokens_sha256: String,
    pub add_bos: bool,
    pub plan: WindowPlan,
    pub positions: usize,
    pub nll_mean: f64,
    pub ppl: f64,
    pub forward_seconds: f64,
    pub seconds: f64,
    pub threads: usize,
    #[serde(skip)]
    pub nll: Vec<f64>,
}

/// Negative log-likelihood of each row's target (f64, log-sum-exp in f64).
pub fn nll_rows(rows: &[f32], targets: &[u32], v: usize) -> Vec<f64> {
    use rayon::prelude::*;
    rows.par_chunks(v)
        .zip(targets.par_iter())
        .map(|(z, &t)| {
            let m = z.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
            let s: f64 = z.iter().map(|&x| (x as f64 - m).exp()).sum();
            m + s.ln() - z[t as usize] as f64
        })
        .collect()
}

pub fn perplexity(model: &Model, setup: &EvalSetup, text: &EvalText, show_progress: bool) -> Result<PplReport> {
    let t0 = Instant::now();
    let plan = WindowPlan::new(text.tokens.len(), setup.ctx, setup.chunks, setup.score_from)?;
    let v = model.cfg.vocab_size;
    let mut nll = Vec::with_capacity(plan.n_positions());
    let pb = progress_bar(plan.windows, "ppl", show_progress);
    let forward_seconds = for_each_window(model, &text.tokens, &plan, &pb, |_, rows, targets| {
        nll.extend(nll_rows(rows, targets, v));
        Ok(())
    })?;
    let nll_mean = nll.iter().sum::<f64>() / nll.len() as f64;
    Ok(PplReport {
        protocol: setup.protocol_name().into(),
        text: text.bytes.spec.clone(),
        text_sha256: text.bytes.sha256(),
        text_tokens: text.tokens.len(),
        tokens_sha256: tokens_sha256(&text.tokens),
        add_bos: text.add_bos,
        plan,
        positions: nll.len(),
        nll_mean,
        ppl: nll_mean.exp(),
        forward_seconds,
        seconds: t0.elapsed().as_secs_f64(),
        threads: rayon::current_num_threads(),
        nll,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn llama_perplexity_positions() {
        let p = Protocol::LlamaPerplexity;
        // 40,000 tokens would allow 78 windows; the protocol takes 20.
        let plan = WindowPlan::new(40_000, p.ctx(), Some(p.chunks()), p.score_from()).unwrap();
        assert_eq!((plan.windows, plan.scored_per_window(), plan.n_positions()), (20, 255, 5100));
        let pos = plan.positions();
        assert_eq!(pos.len(), 5100);
        // Window 0: logits at 256..=510 predict tokens 257..=511; window 1 starts at token 512.
        assert_eq!((pos[0], pos[254], pos[255]), (256, 510, 512 + 256));
        assert_eq!(*pos.last().unwrap(), 19 * 512 + 510);
        assert_eq!(plan.n_tokens(), 10_240);
    }

    #[test]
    fn plans_and_errors() {
        let plan = WindowPlan::new(1000, 128, None, 0).unwrap();
        assert_eq!((plan.windows, plan.scored_per_window(), plan.n_positions()), (7, 127, 889));
        assert_eq!(WindowPlan::new(1000, 128, Some(3), 0).unwrap().windows, 3);
        assert!(WindowPlan::new(100, 128, None, 0).is_err());
        assert!(WindowPlan::new(1000, 128, None, 127).is_err());
        assert_eq!(WindowPlan::new(1000, 128, None, 126).unwrap().scored_per_window(), 1);
        assert!(WindowPlan::new(1000, 1, None, 0).is_err());
        assert!(WindowPlan::new(1000, 128, Some(0), 0).is_err());
    }

    #[test]
    fn setup_resolution() {
        let dir = PathBuf::from("/data");
        let a = WindowArgs {
            protocol: Some("llama-perplexity".into()),
            data_dir: Some(dir.clone()),
            ctx: Some(512),
            ..Default::default()
        };
        let s = EvalSetup::resolve(&a).unwrap();
        assert_eq!((s.ctx, s.chunks, s.score_from), (512, Some(20), 256));
        assert_eq!(s.text.to_spec_string(), "/data/eval/prose.txt:81920,/data/eval/code.txt:81920");
        let bad = WindowArgs { ctx: Some(256), ..a.clone() };
        assert!(EvalSetup::resolve(&bad).unwrap_err().to_string().contains("--ctx 256 conflicts"));
        let bad = WindowArgs { text: Some("x.txt".into()), ..a.clone() };
        assert!(EvalSetup::resolve(&bad).is_err());
        let bad = WindowArgs { protocol: Some("wikitext".into()), ..a };
        assert!(EvalSetup::resolve(&bad).is_err());
        let s = EvalSetup::resolve(&WindowArgs { text: Some("a.txt:10".into()), ..Default::default() }).unwrap();
        assert_eq!((s.ctx, s.chunks, s.score_from, s.protocol_name()), (DEFAULT_CTX, None, 0, "custom"));
        assert!(EvalSetup::resolve(&WindowArgs::default()).is_err());
    }
}
