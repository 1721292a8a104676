//! `forge calib generate`: calibration rows from the teacher's own answers to chat prompts.

use anyhow::{Context, Result};
use forge_quant::calib_gen::{self, GenOptions};
use indicatif::{ProgressBar, ProgressStyle};
use std::io::IsTerminal;
use std::path::PathBuf;
use std::time::Instant;

#[derive(clap::Args)]
pub struct Args {
    #[command(subcommand)]
    cmd: Sub,
}

#[derive(clap::Subcommand)]
enum Sub {
    /// Self-generated chats: the model answers each prompt with its chat template; every
    /// conversation (templated prompt + answer + stop token) becomes one row of token ids, written
    /// as an ids rows file for `forge quantize --calib ids=FILE:ROWS` (rows longer than --seq are
    /// cut, shorter ones kept as they are), plus a JSON sidecar FILE.json with the settings.
    Generate(GenArgs),
}

#[derive(clap::Args)]
struct GenArgs {
    /// Teacher: Hugging Face directory, GGUF file, Forge export, or a short name (smollm2).
    #[arg(long, default_value = "smollm2")]
    model: String,
    /// Prompts: FILE.json = JSON array of strings, FILE.jsonl = one {"prompt": "..."} per line,
    /// anything else = one prompt per line (blank lines and lines starting with # skipped).
    /// tools/calib_prompts.txt is a default list.
    #[arg(long)]
    prompts: PathBuf,
    /// Output ids rows file (its settings go to FILE.json).
    #[arg(long)]
    out: PathBuf,
    /// Most tokens per answer.
    #[arg(long, default_value_t = 256)]
    max_tokens: usize,
    /// 0 = greedy.
    #[arg(long, default_value_t = 0.7)]
    temperature: f32,
    #[arg(long, default_value_t = 0.95)]
    top_p: f32,
    /// Prompt i is sampled with its own RNG seeded from (seed, i).
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Only the first N prompts.
    #[arg(long)]
    limit: Option<usize>,
}

pub fn run(a: Args) -> Result<()> {
    match a.cmd {
        Sub::Generate(g) => generate(g),
    }
}

fn generate(a: GenArgs) -> Result<()> {
    let mut prompts = calib_gen::read_prompts(&a.prompts)?;
    let prompts_bytes = std::fs::read(&a.prompts).with_context(|| format!("{}: cannot read", a.prompts.display()))?;
    if let Some(n) = a.limit {
        prompts.truncate(n);
    }
    let path = crate::cmd_bundle::resolve(&a.model)?;
    let mut loaded = forge_model::load::load(&path)?;
    crate::configure(&mut loaded.model);
    calib_gen::chat_parts(&loaded)?;
    let opts = GenOptions { max_tokens: a.max_tokens, temperature: a.temperature, top_p: a.top_p, seed: a.seed };

    let pb =
        if std::io::stderr().is_terminal() { ProgressBar::new(prompts.len() as u64) } else { ProgressBar::hidden() };
    if let Ok(style) =
        ProgressStyle::with_template("calib [{bar:30}] {pos}/{len} prompts, {elapsed} elapsed, ETA {eta} {msg}")
    {
        pb.set_style(style.progress_chars("=> "));
    }
    let t0 = Instant::now();
    let (mut rows, mut prompt_tokens, mut stopped) = (Vec::new(), 0usize, 0usize);
    for (i, p) in prompts.iter().enumerate() {
        let row = calib_gen::generate_row(&loaded, p, i, &opts)?;
        prompt_tokens += row.prompt_tokens;
        stopped += row.stopped as usize;
        rows.push(row.ids);
        pb.inc(1);
        pb.set_message(format!("{} tokens", rows.iter().map(Vec::len).sum::<usize>()));
    }
    pb.finish_and_clear();
    let secs = t0.elapsed().as_secs_f64();
    let tokens: usize = rows.iter().map(Vec::len).sum();

    forge_core::fsutil::write_atomic(&a.out, calib_gen::rows_file_text(&rows).as_bytes())?;
    let model = forge_quant::eval::model_id(&path)?;
    let side = serde_json::json!({
        "tool": format!("forge {} calib generate", env!("CARGO_PKG_VERSION")),
        "format": "ids rows file: a '#rows' line, then one conversation per line (whitespace-separated token ids)",
        "model": a.model,
        "model_path": model.path,
        "model_sha256": model.sha256,
        "model_sha256_of": model.sha256_of,
        "prompts": a.prompts.display().to_string(),
        "prompts_sha256": forge_quant::eval::text::sha256_hex(&prompts_bytes),
        "template": "one user turn, add_generation_prompt, model's chat template",
        "limit": a.limit,
        "seed": a.seed,
        "temperature": shortest(a.temperature),
        "top_p": shortest(a.top_p),
        "top_k": 0,
        "max_tokens": a.max_tokens,
        "rows": rows.len(),
        "tokens": tokens,
        "prompt_tokens": prompt_tokens,
        "generated_tokens": tokens - prompt_tokens,
        "rows_ended_by_stop_token": stopped,
        "seconds": (secs * 10.0).round() / 10.0,
    });
    let mut side_path = a.out.clone().into_os_string();
    side_path.push(".json");
    let side_path = PathBuf::from(side_path);
    let text = serde_json::to_string_pretty(&side)? + "\n";
    forge_core::fsutil::write_atomic(&side_path, text.as_bytes())?;
    eprintln!(
        "calib generate: {} rows, {tokens} tokens ({prompt_tokens} prompt + {} generated, {stopped} rows ended by a \
         stop token) in {secs:.1} s -> {} (+ .json)",
        rows.len(),
        tokens - prompt_tokens,
        a.out.display()
    );
    Ok(())
}

/// An f32 option as the decimal it was given as (0.7, not 0.699999988079071).
fn shortest(x: f32) -> f64 {
    x.to_string().parse().unwrap_or(x as f64)
}
