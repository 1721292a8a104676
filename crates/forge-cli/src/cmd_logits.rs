use anyhow::{bail, Context, Result};
use forge_model::Logits;
use std::path::PathBuf;

#[derive(clap::Args)]
pub struct Args {
    /// Model: Hugging Face directory, GGUF file, Forge export, or a short name (smollm2).
    #[arg(long)]
    model: String,
    /// File of token ids (whitespace- or comma-separated integers).
    #[arg(long)]
    tokens: PathBuf,
    /// Output .npy path (little-endian f32, shape [T, vocab]).
    #[arg(long)]
    output: PathBuf,
    /// One token per forward call instead of a single prefill.
    #[arg(long)]
    decode: bool,
}

pub fn parse_tokens(text: &str, path: &std::path::Path) -> Result<Vec<u32>> {
    text.split(|c: char| c.is_whitespace() || c == ',')
        .filter(|s| !s.is_empty())
        .map(|s| s.parse::<u32>().with_context(|| format!("{}: '{s}' is not a token id", path.display())))
        .collect()
}

pub fn run(a: Args) -> Result<()> {
    let path = crate::cmd_bundle::resolve(&a.model)?;
    let text = std::fs::read_to_string(&a.tokens).with_context(|| format!("{}: cannot read", a.tokens.display()))?;
    let toks = parse_tokens(&text, &a.tokens)?;
    if toks.is_empty() {
        bail!("{}: no token ids", a.tokens.display());
    }
    let mut model = forge_model::load::load(&path)?.model;
    crate::configure_exact(&mut model);
    let v = model.cfg.vocab_size;
    if let Some(&bad) = toks.iter().find(|&&t| t as usize >= v) {
        bail!("{}: token id {bad} is out of range for vocabulary size {v}", a.tokens.display());
    }
    let mut s = model.new_session();
    let logits = if a.decode {
        let mut out = Vec::with_capacity(toks.len() * v);
        for &t in &toks {
            out.extend(model.forward(&mut s, &[t], Logits::All)?);
        }
        out
    } else {
        model.forward(&mut s, &toks, Logits::All)?
    };
    forge_core::npy::write_npy(&a.output, &[toks.len(), v], &logits)
}
