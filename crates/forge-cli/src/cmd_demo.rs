//! `forge demo`: the main job on the embedded default model, end to end.

use anyhow::Result;

#[derive(clap::Args)]
pub struct Args {
    /// The question for the chat step.
    #[arg(long, default_value = "What is the capital of France? Answer in one sentence.")]
    prompt: String,
}

pub fn run(a: Args) -> Result<()> {
    let model = forge_core::hub::resolve_model("smollm2", true)?;
    eprintln!("== chat with {} ==", model.display());
    crate::cmd_generate::run(crate::cmd_generate::Args::chat(model.to_string_lossy().into(), a.prompt))
}
