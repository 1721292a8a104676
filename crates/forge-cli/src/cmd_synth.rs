//! `forge synth`: a random-weight export with real model shapes, for speed and memory benchmarks.

use anyhow::Result;
use std::path::PathBuf;

/// `forge synth --help`.
pub const LONG_ABOUT: &str = "Write a RANDOM-WEIGHT export in Forge's export layout (docs/export.md) with the exact \
release-0.2 plan (vec2x64 MLP; vec2x16 token mixers in layers 0-23, lut4 from 24 on; INT8 attention K/V; lut4 head; \
rank-64 factors on the token-mixer projections; online Hadamard rotations of the MLP and mixer inputs) and the real \
shapes of Qwen3.8-27B (qwen3_5: 64 layers = 48 Gated DeltaNet + 16 gated attention, hidden 5120, MLP 17408, vocab \
248320), plus the minimal source checkpoint it needs under OUTPUT/source/. Files are generated and written one \
layer at a time (atomically); forge.json last.

NOT A MODEL: every index, codebook, scale and factor is random, so its outputs are meaningless. It exists for \
speed and memory benchmarks only (--model OUTPUT).";

#[derive(clap::Args)]
pub struct Args {
    /// Model shape: qwen3.8-27b (the real text-model shapes; ~16 GB export + 2.5 GB source) or tiny (tests).
    #[arg(long)]
    shape: String,
    /// Output directory (must be absent or empty).
    #[arg(long)]
    output: PathBuf,
    /// Seed of every random tensor (recorded in forge.json; the same seed writes identical files).
    #[arg(long, default_value_t = 0)]
    seed: u64,
}

pub fn run(a: Args) -> Result<()> {
    let s = forge_quant::synth::synth(&forge_quant::synth::Options {
        shape: a.shape,
        output: a.output,
        seed: a.seed,
        progress: std::io::IsTerminal::is_terminal(&std::io::stderr()),
    })?;
    print!("{}", s.to_text());
    Ok(())
}
