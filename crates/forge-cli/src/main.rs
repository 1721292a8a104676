//! `forge`: quantize, evaluate and run LLMs on CPUs.

mod bench_batch;
mod bench_fill;
mod bench_quant;
mod bench_spec;
mod cmd_bench;
mod cmd_bundle;
mod cmd_calib;
mod cmd_chat;
mod cmd_compile;
mod cmd_demo;
mod cmd_doctor;
mod cmd_download;
mod cmd_eval;
mod cmd_generate;
mod cmd_inspect;
mod cmd_logits;
mod cmd_plan;
mod cmd_quantize;
mod cmd_serve;
mod cmd_synth;
mod spec_args;

use anyhow::Result;
use clap::{Parser, Subcommand};

/// The system allocator with a counter: `forge bench` reports heap allocations per decoded token.
#[global_allocator]
static ALLOC: forge_kernels::scratch::CountingAlloc = forge_kernels::scratch::CountingAlloc;

#[derive(Parser)]
#[command(name = "forge", version, about = "Quantize, evaluate and run LLMs on CPUs")]
struct Cli {
    /// Worker threads (default: all cores).
    #[arg(long, global = true)]
    threads: Option<usize>,
    /// Integer kernels take activations as one 16-bit plane per block, without the 7-bit plane
    /// for its residual: faster, but logits move by up to ~5e-3 (both planes: within ~1e-4).
    #[arg(long, global = true)]
    act16: bool,
    /// Keep the integer kernels to AVX2 on CPUs with AVX-512 VNNI and VBMI (for speed
    /// comparisons; the same results as `--avx512-256`).
    #[arg(long, global = true)]
    no_avx512: bool,
    /// Keep the AVX-512 integer kernels to 256-bit vectors (decode otherwise runs 512 bits
    /// wide; results within ~2⁻²³ relative; for speed comparisons, or CPUs that slow down on
    /// 512-bit work).
    #[arg(long = "avx512-256", global = true)]
    avx512_256: bool,
    /// Prefill kernels for integer-dot matrices: `int` (byte planes through AVX-512 VNNI,
    /// logits within ~1e-4 of f32), `f32` (FMA tiles), or `auto` (int where the 512-bit integer
    /// kernels run: AVX-512 VNNI and VBMI).
    #[arg(long, global = true, default_value = "auto")]
    prefill: String,
    /// How KV caches store keys and values: kv8 (ANEMLL Forge's KV8 cache: 8-bit keys and
    /// values, each with an f16 scale per position and head; 2 × head_dim + 4 bytes a position
    /// and head; the default of generate, chat, serve, bench and calib: its KL cost over f16 is
    /// 2.4e-4 on SmolLM2), f32 (the default of logits and eval, whose references must carry no
    /// cache rounding), f16 (llama.cpp's default cache), or v8 (ANEMLL Forge's V8 cache: f16
    /// keys, 8-bit values with a scale per position and head).
    #[arg(long = "kv-cache-dtype", global = true, value_parser = ["f32", "f16", "v8", "kv8"])]
    kv_cache_dtype: Option<String>,
    /// Prompts longer than this run through the model this many tokens at a time, so that
    /// their scratch memory stops growing past one chunk (default: as many as keep a chunk's
    /// activations near 64 MiB, 256 to 2048; `serve`: 512, the most a new prompt delays the
    /// other requests' next token).
    #[arg(long, global = true, value_name = "TOKENS")]
    prefill_chunk: Option<usize>,
    /// Load a bundle without checking its files against release.json.
    #[arg(long, global = true)]
    no_verify: bool,
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// The main job on the embedded default model (SmolLM2-135M-Instruct).
    Demo(cmd_demo::Args),
    /// Teacher-forced logits for a token file, written as a [T, vocab] f32 .npy.
    Logits(cmd_logits::Args),
    /// Generate text from a prompt (streams the generated text to stdout).
    Generate(cmd_generate::Args),
    /// Evaluate: teacher reference, KL of a candidate against it, perplexity.
    Eval(cmd_eval::Args),
    /// Calibration data: `calib generate` writes self-generated chats as token-id rows.
    Calib(cmd_calib::Args),
    /// Quantize a model into an export (LUT/INT8 formats, per-matrix plan).
    Quantize(cmd_quantize::Args),
    /// KL cost of each part of a model (mixer, MLP in, MLP down, head) in each candidate format, against a base
    /// export: the planner's input, with a plot.
    Sensitivity(cmd_plan::SensitivityArgs),
    /// Choose a format per part that minimizes the predicted KL within a bits-per-weight budget.
    Plan(cmd_plan::PlanArgs),
    /// Show what an export holds: formats, bits/weight, SNR, sizes.
    Inspect(cmd_inspect::Args),
    /// OpenAI-compatible HTTP server (chat completions, streaming, tools, reasoning, prompt cache).
    Serve(cmd_serve::Args),
    /// Interactive chat in the terminal (/reset, /think, /quit).
    Chat(cmd_chat::Args),
    /// Speed: prefill/decode tok/s, weight GB/s vs measured read bandwidth, memory (--kernels: per-format kernels).
    Bench(cmd_bench::Args),
    /// Write a RANDOM-WEIGHT export with Qwen3.8-27B's shapes and the release-0.2 plan: NOT A MODEL, for speed and
    /// memory benchmarks only.
    #[command(long_about = cmd_synth::LONG_ABOUT)]
    Synth(cmd_synth::Args),
    /// Write an export's packed kernel layout next to it (packed.forgecache), reused on later starts.
    Compile(cmd_compile::Args),
    /// Fetch the embedded default model (SmolLM2-135M-Instruct) into the cache.
    Fetch,
    /// Download a model or bundle from a Hugging Face–compatible hub.
    Download(cmd_download::DownloadArgs),
    /// Compare a downloaded directory with its branch's current commit (metadata or weights changed).
    CheckUpdate(cmd_download::CheckUpdateArgs),
    /// Make a self-contained bundle: the model (and drafter), provenance, a SHA-256 inventory.
    Bundle(cmd_bundle::BundleArgs),
    /// Check this machine and a model: kernels, threads, memory at a context size, disk, port.
    Doctor(cmd_doctor::Args),
    /// Check a bundle's files against its release.json (sizes; --full: every byte).
    Verify(cmd_bundle::VerifyArgs),
}

/// `--no-verify`, set once from the command line before any command runs.
static NO_VERIFY: std::sync::OnceLock<bool> = std::sync::OnceLock::new();

fn no_verify() -> bool {
    NO_VERIFY.get().copied().unwrap_or(false)
}

/// `--kv-cache-dtype` as given, set once from the command line before any command runs: the
/// commands give it to the models they load ([`forge_model::Model::set_kv_dtype`]) and to
/// drafters.
static KV_DTYPE: std::sync::OnceLock<Option<forge_model::session::KvDtype>> = std::sync::OnceLock::new();

/// The KV cache type of the commands that generate (generate, chat, serve, bench, calib): as
/// given, else KV8, whose KL cost over f16 on SmolLM2 at 2048-token windows (2.4e-4,
/// docs/results.md) is far below what a user would notice, at a quarter of f32's memory.
fn kv_dtype() -> forge_model::session::KvDtype {
    KV_DTYPE.get().copied().flatten().unwrap_or(forge_model::session::KvDtype::Kv8)
}

/// The KV cache type of the commands that measure a model (logits, eval): as given, else f32,
/// so that a reference carries no cache rounding.
fn kv_dtype_exact() -> forge_model::session::KvDtype {
    KV_DTYPE.get().copied().flatten().unwrap_or_default()
}

/// `--prefill-chunk`, set once from the command line (`None`: the default of each command).
static PREFILL_CHUNK: std::sync::OnceLock<Option<usize>> = std::sync::OnceLock::new();

fn prefill_chunk() -> Option<usize> {
    PREFILL_CHUNK.get().copied().flatten()
}

/// The session settings of the command line (`--kv-cache-dtype`, `--prefill-chunk`) given to a
/// model the command loaded.
fn configure(m: &mut forge_model::Model) {
    m.set_kv_dtype(kv_dtype());
    m.set_prefill_chunk(prefill_chunk().unwrap_or(0));
}

/// [`configure`] for the commands that measure a model: f32 caches unless told otherwise.
fn configure_exact(m: &mut forge_model::Model) {
    configure(m);
    m.set_kv_dtype(kv_dtype_exact());
}

fn main() {
    let cli = Cli::parse();
    if cli.prefill_chunk == Some(0) {
        eprintln!("forge: --prefill-chunk 0: a chunk needs at least one token");
        std::process::exit(2);
    }
    PREFILL_CHUNK.set(cli.prefill_chunk).expect("set once");
    NO_VERIFY.set(cli.no_verify).expect("set once");
    if let Some(n) = cli.threads {
        if let Err(e) = rayon::ThreadPoolBuilder::new().num_threads(n.max(1)).build_global() {
            eprintln!("forge: warning: cannot set threads: {e}");
        }
    }
    if cli.act16 {
        forge_kernels::lutmm::intdot::set_activation_planes(1);
    }
    if cli.no_avx512 {
        forge_kernels::lutmm::intdot::set_avx512(false);
        forge_kernels::lutmm::intdot::set_wide(false);
    }
    match forge_kernels::lutmm::intdot::Prefill::parse(&cli.prefill) {
        Ok(p) => forge_kernels::lutmm::intdot::set_prefill(p),
        Err(e) => {
            eprintln!("forge: --prefill: {e}");
            std::process::exit(2);
        }
    }
    if cli.avx512_256 {
        forge_kernels::lutmm::intdot::set_wide(false);
    }
    match cli.kv_cache_dtype.as_deref().map(forge_model::session::KvDtype::parse).transpose() {
        Ok(d) => KV_DTYPE.set(d).expect("set once"),
        Err(e) => {
            eprintln!("forge: {e}");
            std::process::exit(2);
        }
    }
    let r: Result<()> = match cli.cmd {
        Cmd::Demo(a) => cmd_demo::run(a),
        Cmd::Logits(a) => cmd_logits::run(a),
        Cmd::Generate(a) => cmd_generate::run(a),
        Cmd::Eval(a) => cmd_eval::run(a),
        Cmd::Calib(a) => cmd_calib::run(a),
        Cmd::Quantize(a) => cmd_quantize::run(a),
        Cmd::Sensitivity(a) => cmd_plan::run_sensitivity(a),
        Cmd::Plan(a) => cmd_plan::run_plan(a),
        Cmd::Inspect(a) => cmd_inspect::run(a),
        Cmd::Serve(a) => cmd_serve::run(a),
        Cmd::Chat(a) => cmd_chat::run(a),
        Cmd::Bench(a) => cmd_bench::run(a),
        Cmd::Synth(a) => cmd_synth::run(a),
        Cmd::Compile(a) => cmd_compile::run(a),
        Cmd::Bundle(a) => cmd_bundle::run_bundle(a),
        Cmd::Verify(a) => cmd_bundle::run_verify(a),
        Cmd::Doctor(a) => cmd_doctor::run(a),
        Cmd::Download(a) => cmd_download::run_download(a),
        Cmd::CheckUpdate(a) => cmd_download::run_check_update(a),
        Cmd::Fetch => forge_core::hub::resolve_model("smollm2", true).map(|p| println!("{}", p.display())),
    };
    if let Err(e) = r {
        eprintln!("forge: error: {e:#}");
        std::process::exit(1);
    }
}
