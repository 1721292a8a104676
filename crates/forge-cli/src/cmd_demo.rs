//! `forge demo`: the main job on the embedded default model, end to end — quantize SmolLM2
//! with a preset, measure it against the original (KL, top-1, perplexity), then chat with it.
//! Each step is an ordinary `forge` command, printed before it runs, so the demo is also a
//! recipe.

use anyhow::{bail, Context, Result};
use std::path::PathBuf;
use std::process::Command;

#[derive(clap::Args)]
pub struct Args {
    /// Quantization preset (q4, q3, q2).
    #[arg(long, default_value = "q4")]
    preset: String,
    /// Working directory for the export and the reference (default: $FORGE_HOME/demo).
    #[arg(long)]
    dir: Option<PathBuf>,
    /// Evaluation windows of 512 tokens (the llama.cpp protocol uses 20).
    #[arg(long, default_value_t = 4)]
    windows: usize,
    /// The question for the chat step.
    #[arg(long, default_value = "What is the capital of France? Answer in one sentence.")]
    prompt: String,
}

fn step(title: &str, args: &[String]) -> Result<()> {
    let exe = std::env::current_exe().context("cannot locate the forge executable")?;
    eprintln!("\n== {title} ==\n$ forge {}", args.join(" "));
    let status = Command::new(&exe).args(args).status().with_context(|| format!("cannot run {}", exe.display()))?;
    if !status.success() {
        bail!("step '{title}' failed ({status})");
    }
    Ok(())
}

pub fn run(a: Args) -> Result<()> {
    let model = forge_core::hub::resolve_model("smollm2", true)?;
    let dir = a.dir.clone().unwrap_or_else(|| forge_core::hub::forge_home().join("demo"));
    std::fs::create_dir_all(&dir).with_context(|| format!("{}: cannot create", dir.display()))?;
    let export = dir.join(format!("smollm2-{}", a.preset));
    let reference = dir.join(format!("ref-{}w", a.windows));
    let s = |p: &PathBuf| p.to_string_lossy().to_string();
    eprintln!(
        "forge demo: SmolLM2-135M-Instruct ({}) → preset {} → KL → chat\n\
         (about 4–5 minutes on 2 cores, most of it quantizing; interrupted, it resumes where it stopped)",
        model.display(),
        a.preset
    );
    if !export.join("forge.json").exists() {
        let resume = export.exists();
        let mut args = vec!["quantize".into(), "--model".into(), "smollm2".into(), "--preset".into(), a.preset.clone()];
        args.extend(["--output".into(), s(&export)]);
        if resume {
            args.push("--resume".into());
        }
        step("1/4 quantize", &args)?;
    } else {
        eprintln!("\n== 1/4 quantize == (reusing {})", export.display());
    }
    step("2/4 inspect", &["inspect".into(), s(&export)])?;
    let data = forge_quant::eval::find_data_dir()
        .context("cannot find data/ (the evaluation text) in the Forge repository")?;
    let text = format!(
        "{}:81920,{}:81920",
        data.join("eval").join("prose.txt").display(),
        data.join("eval").join("code.txt").display()
    );
    if !reference.join("manifest.json").exists() {
        step(
            "3/4 evaluate: the original model's distribution (teacher reference)",
            &[
                "eval".into(),
                "reference".into(),
                "--model".into(),
                "smollm2".into(),
                // The llama.cpp protocol's text and scored positions, on fewer windows.
                "--text".into(),
                text,
                "--ctx".into(),
                "512".into(),
                "--score-from".into(),
                "256".into(),
                "--chunks".into(),
                a.windows.to_string(),
                "--full-vocab".into(),
                "--out".into(),
                s(&reference),
            ],
        )?;
    }
    step(
        "3/4 evaluate: KL of the quantized model against the original",
        &[
            "eval".into(),
            "kl".into(),
            "--ref".into(),
            s(&reference),
            "--model".into(),
            s(&export),
            "--full-vocab".into(),
            "--kl-npy".into(),
            s(&dir.join(format!("kl-{}.npy", a.preset))),
        ],
    )?;
    step(
        "4/4 chat with the quantized model",
        &[
            "generate".into(),
            "--model".into(),
            s(&export),
            "--chat".into(),
            "--temperature".into(),
            "0".into(),
            "--max-tokens".into(),
            "64".into(),
            "--prompt".into(),
            a.prompt.clone(),
        ],
    )
}
