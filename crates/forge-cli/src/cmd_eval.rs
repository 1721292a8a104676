//! `forge eval reference | kl | ppl`: the measurements every quantization result is judged by.

use anyhow::{bail, Context, Result};
use forge_model::load::Loaded;
use forge_quant::eval::reference::{self, KlOptions, Reference, ReferenceOptions};
use forge_quant::eval::{self, EvalSetup, EvalText, PartFilter, WindowArgs};
use std::io::IsTerminal;
use std::path::{Path, PathBuf};

#[derive(clap::Args)]
pub struct Args {
    #[command(subcommand)]
    cmd: Sub,
}

#[derive(clap::Subcommand)]
enum Sub {
    /// Run the teacher over the evaluation windows and store its top-K distribution per position.
    Reference(RefArgs),
    /// KL(teacher ‖ candidate), top-1 agreement and perplexity of a candidate against a reference.
    Kl(KlArgs),
    /// Perplexity of a model over the evaluation windows.
    Ppl(PplArgs),
}

#[derive(clap::Args, Clone)]
struct Windows {
    /// Text: FILE[:MAX_BYTES][,FILE[:MAX_BYTES]...], concatenated as raw bytes (e.g.
    /// eval/prose.txt:81920,eval/code.txt:81920). Relative paths resolve against --data-dir when given.
    #[arg(long, alias = "text-spec", value_name = "SPEC")]
    text: Option<String>,
    /// A fixed setup. llama-perplexity: ctx 512, 20 windows, positions 256-510 scored, text
    /// eval/prose.txt:81920,eval/code.txt:81920 under the data directory.
    #[arg(long, value_name = "NAME")]
    protocol: Option<String>,
    /// The data directory (default: the repository's data/).
    #[arg(long, value_name = "DIR")]
    data_dir: Option<PathBuf>,
    /// Tokens per window (default 512).
    #[arg(long)]
    ctx: Option<usize>,
    /// At most this many windows (default: every full window).
    #[arg(long)]
    chunks: Option<usize>,
    /// First scored position in each window (default 0: every position that has a next token).
    #[arg(long)]
    score_from: Option<usize>,
}

impl Windows {
    fn setup(&self) -> Result<EvalSetup> {
        EvalSetup::resolve(&WindowArgs {
            text: self.text.clone(),
            protocol: self.protocol.clone(),
            data_dir: self.data_dir.clone(),
            ctx: self.ctx,
            chunks: self.chunks,
            score_from: self.score_from,
        })
    }
}

#[derive(clap::Args)]
struct RefArgs {
    /// Teacher: Hugging Face directory, GGUF file, or a short name (smollm2).
    #[arg(long)]
    model: String,
    #[command(flatten)]
    windows: Windows,
    /// Output directory (written atomically; refuses to replace an existing one without --force).
    #[arg(long)]
    out: PathBuf,
    /// Teacher tokens stored per position.
    #[arg(long, default_value_t = reference::DEFAULT_TOP_K)]
    top_k: usize,
    /// Also store every log-probability (f32, positions × vocab: ~1 GB for the llama.cpp protocol).
    #[arg(long)]
    full_vocab: bool,
    #[arg(long)]
    force: bool,
    /// Print the manifest as JSON on stdout.
    #[arg(long)]
    json: bool,
}

#[derive(clap::Args)]
struct KlArgs {
    /// Reference directory from `forge eval reference`.
    #[arg(long = "ref", value_name = "REF_DIR")]
    reference: PathBuf,
    /// Candidate: Hugging Face directory, GGUF file, or a short name.
    #[arg(long)]
    model: String,
    /// Exact KL from the stored full distribution (the reference needs --full-vocab).
    #[arg(long)]
    full_vocab: bool,
    /// Per-position KL in nats, f32 .npy of shape [positions].
    #[arg(long, default_value = "kl.npy", value_name = "PATH")]
    kl_npy: PathBuf,
    /// Write the JSON summary here.
    #[arg(long, value_name = "PATH")]
    json_out: Option<PathBuf>,
    /// Print the JSON summary on stdout (the table goes to stderr).
    #[arg(long)]
    json: bool,
    /// Ablation: keep quantized weights only in these parts (mlp,gdn,attn,head); the rest run the
    /// teacher's weights. Needs a quantized export as candidate.
    #[arg(long, value_name = "LIST")]
    parts: Option<String>,
    /// Ablation: keep quantized weights only in layers lo-hi (inclusive) or one layer n.
    #[arg(long, value_name = "LO-HI")]
    layers: Option<String>,
}

#[derive(clap::Args)]
struct PplArgs {
    #[arg(long)]
    model: String,
    #[command(flatten)]
    windows: Windows,
    /// Print the result as JSON on stdout.
    #[arg(long)]
    json: bool,
}

pub fn run(a: Args) -> Result<()> {
    match a.cmd {
        Sub::Reference(a) => run_reference(a),
        Sub::Kl(a) => run_kl(a),
        Sub::Ppl(a) => run_ppl(a),
    }
}

fn show_progress() -> bool {
    std::io::stderr().is_terminal()
}

fn load_and_tokenize(model: &str, setup: &EvalSetup) -> Result<(Loaded, EvalText)> {
    let path = crate::cmd_bundle::resolve(model)?;
    // Read the text before the model so a bad spec fails fast.
    let bytes = setup.text.read()?;
    let mut loaded = forge_model::load::load(&path)?;
    crate::configure_exact(&mut loaded.model);
    let text = eval::tokenize(loaded.tokenizer()?, bytes)?;
    if text.unrepresentable > 0 {
        eprintln!(
            "forge: warning: {} code point(s) in the text are surrogates or above U+10FFFF; llama.cpp tokenizes \
             them differently, so figures here are not comparable to llama-perplexity on this text",
            text.unrepresentable
        );
    }
    Ok((loaded, text))
}

fn describe_windows(m: &eval::WindowPlan, protocol: &str, n_tokens: usize) -> String {
    format!(
        "protocol {protocol}: {} windows × {} tokens (of {n_tokens}), positions {}..={} scored ({} per window, {} in all)",
        m.windows,
        m.ctx,
        m.score_from,
        m.ctx - 2,
        m.scored_per_window(),
        m.n_positions()
    )
}

fn run_reference(a: RefArgs) -> Result<()> {
    let setup = a.windows.setup()?;
    let (loaded, text) = load_and_tokenize(&a.model, &setup)?;
    let opts =
        ReferenceOptions { top_k: a.top_k, full_vocab: a.full_vocab, show_progress: show_progress(), force: a.force };
    let m = reference::build(&loaded, &setup, &text, &a.out, &opts)?;
    let mut lines = vec![
        format!("reference {} written", a.out.display()),
        format!("  teacher: {} (sha256 {})", m.model.path, &m.model.sha256[..16]),
        format!(
            "  text: {} ({} bytes, {} tokens, BOS {})",
            m.text.spec, m.text.bytes, m.tokens.count, m.tokens.add_bos
        ),
        format!("  {}", describe_windows(&m.plan(), &m.protocol, m.tokens.count)),
        format!("  stored: top-{} + tail{}", m.top_k, if m.full_vocab { " + full vocabulary (f32)" } else { "" }),
        format!(
            "  teacher perplexity {:.4} (mean NLL {:.5} nats) | {:.1} s ({:.1} s in the model), {} threads",
            m.teacher.ppl, m.teacher.nll_mean, m.teacher.seconds, m.teacher.forward_seconds, m.teacher.threads
        ),
    ];
    if m.text.invalid_utf8_bytes > 0 {
        lines.push(format!(
            "  {} invalid UTF-8 byte(s) tokenized as U+FFFD each (as llama.cpp)",
            m.text.invalid_utf8_bytes
        ));
    }
    emit(&lines, a.json.then(|| serde_json::to_value(&m)).transpose()?)
}

/// Load a candidate; with an ablation filter, only the selected linears of a quantized export
/// keep their quantized weights and the rest run the source checkpoint's dense weights.
fn load_candidate(path: &Path, filter: &PartFilter) -> Result<Loaded> {
    if filter.is_all() {
        let mut loaded = forge_model::load::load(path)?;
        crate::configure_exact(&mut loaded.model);
        return Ok(loaded);
    }
    if !forge_model::export::is_export(path) {
        bail!("--parts/--layers ({filter}) select linears of a quantized export; {} is not one", path.display());
    }
    let ex = forge_model::export::Export::open(path)?;
    let layer_of = |name: &str| -> usize {
        name.strip_prefix("layers.").and_then(|r| r.split('.').next()).and_then(|l| l.parse().ok()).unwrap_or(0)
    };
    let mut loaded = forge_model::load::load_with(&ex.source()?, &|name, o, i| {
        if filter.includes(layer_of(name), name) {
            ex.linear(name, o, i)
        } else {
            Ok(None)
        }
    })?;
    loaded.path = path.to_path_buf();
    crate::configure_exact(&mut loaded.model);
    Ok(loaded)
}

fn run_kl(a: KlArgs) -> Result<()> {
    let filter = PartFilter::parse(a.parts.as_deref(), a.layers.as_deref())?;
    let r = Reference::open(&a.reference)?;
    let path = crate::cmd_bundle::resolve(&a.model)?;
    let loaded = load_candidate(&path, &filter)?;
    if let Some((_, hi)) = filter.layer_range() {
        if hi >= loaded.model.cfg.num_layers {
            bail!("--layers: layer {hi} does not exist ({} layers)", loaded.model.cfg.num_layers);
        }
    }
    reference::check_candidate(&r, &loaded)?;
    let candidate = eval::model_id(&path)?;
    let res = reference::kl_against(
        &r,
        &loaded.model,
        &KlOptions { full_vocab: a.full_vocab, show_progress: show_progress() },
    )?;
    let kl32: Vec<f32> = res.kl.iter().map(|&x| x as f32).collect();
    write_output(&a.kl_npy, &forge_core::npy::to_npy_bytes(&[kl32.len()], &kl32))?;
    let mut s = reference::summarize(&r, candidate, filter.to_string(), &res);
    s.per_position_npy = Some(std::path::absolute(&a.kl_npy).unwrap_or(a.kl_npy.clone()).display().to_string());
    let json = serde_json::to_value(&s)?;
    if let Some(p) = &a.json_out {
        write_output(p, &serde_json::to_vec_pretty(&json)?)?;
    }
    let m = &r.manifest;
    let mut lines = vec![
        format!("forge eval kl: {} against reference {}", s.candidate.path, a.reference.display()),
        format!("  teacher: {}", m.model.path),
        format!("  text: {} ({} tokens)", m.text.spec, m.tokens.count),
        format!("  {}", describe_windows(&m.plan(), &m.protocol, m.tokens.count)),
        format!("  KL(teacher ‖ candidate), {}, nats:", s.kl_method),
        format!(
            "    mean {:.6}  median {:.6}  p90 {:.6}  p99 {:.6}  max {:.6}",
            s.kl.mean, s.kl.median, s.kl.p90, s.kl.p99, s.kl.max
        ),
        format!("  top-1 agreement {:.3} %", 100.0 * s.top1_agreement),
        format!("  perplexity: candidate {:.4}, teacher {:.4}", s.ppl_candidate, s.ppl_teacher),
        format!("  per-position KL: {}", a.kl_npy.display()),
        format!("  {:.1} s ({:.1} s in the model), {} threads", s.seconds, s.forward_seconds, s.threads),
    ];
    if !filter.is_all() {
        lines.insert(1, format!("  ablation: quantized {filter}"));
    }
    emit(&lines, a.json.then_some(json))
}

fn run_ppl(a: PplArgs) -> Result<()> {
    let setup = a.windows.setup()?;
    let (loaded, text) = load_and_tokenize(&a.model, &setup)?;
    let r = eval::perplexity(&loaded.model, &setup, &text, show_progress())?;
    let lines = vec![
        format!("forge eval ppl: {}", loaded.path.display()),
        format!("  text: {} ({} bytes, {} tokens, BOS {})", r.text, text.bytes.bytes.len(), r.text_tokens, r.add_bos),
        format!("  {}", describe_windows(&r.plan, &r.protocol, r.text_tokens)),
        format!("  perplexity {:.4} (mean NLL {:.5} nats over {} positions)", r.ppl, r.nll_mean, r.positions),
        format!("  {:.1} s ({:.1} s in the model), {} threads", r.seconds, r.forward_seconds, r.threads),
    ];
    emit(&lines, a.json.then(|| serde_json::to_value(&r)).transpose()?)
}

/// Atomic (temp + rename) for regular files; written in place when the path is something else
/// that exists (`/dev/null`, a pipe), which a rename would replace with a regular file.
fn write_output(path: &Path, bytes: &[u8]) -> Result<()> {
    match std::fs::metadata(path) {
        Ok(m) if !m.is_file() => {
            std::fs::write(path, bytes).with_context(|| format!("{}: cannot write", path.display()))
        }
        _ => forge_core::fsutil::write_atomic(path, bytes),
    }
}

/// The table on stdout, or with JSON requested the JSON on stdout and the table on stderr.
fn emit(lines: &[String], json: Option<serde_json::Value>) -> Result<()> {
    match json {
        Some(j) => {
            for l in lines {
                eprintln!("{l}");
            }
            println!("{}", serde_json::to_string_pretty(&j).context("serializing the summary")?);
        }
        None => {
            for l in lines {
                println!("{l}");
            }
        }
    }
    Ok(())
}
