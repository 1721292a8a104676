use crate::cmd_serve::EngineArgs;
use anyhow::Result;
use forge_server::chat::{run_chat, ChatOptions};
use std::io::IsTerminal;

#[derive(clap::Args)]
pub struct Args {
    #[command(flatten)]
    engine: EngineArgs,
    /// System message.
    #[arg(long)]
    system: Option<String>,
    #[arg(long)]
    seed: Option<u64>,
}

pub fn run(a: Args) -> Result<()> {
    let app = a.engine.load(None, None, false)?;
    let stdin = std::io::stdin();
    let opts = ChatOptions {
        system: a.system,
        think: a.engine.think.then_some(true),
        max_tokens: a.engine.max_tokens,
        temperature: a.engine.temperature,
        top_p: a.engine.top_p,
        top_k: a.engine.top_k,
        min_p: a.engine.min_p,
        seed: a.seed,
        interactive: stdin.is_terminal(),
    };
    run_chat(&app, stdin.lock(), &mut std::io::stdout(), &mut std::io::stderr(), &opts)
}
