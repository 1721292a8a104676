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

With --checkpoint it writes instead the Hugging Face checkpoint `forge quantize` would receive (config.json with \
`text_config` nested, BF16 safetensors shards with the published tensor names and their index, random ids for \
calibration in calibration.ids): rows of spread scales and a few outlier input channels, so quantization's memory \
and time can be measured at the real size (`--layers N` keeps the first N layers, pattern 3 DeltaNet : 1 attention).

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
    /// Write a BF16 Hugging Face checkpoint (the input of `forge quantize`) instead of an export.
    #[arg(long)]
    checkpoint: bool,
    /// Keep only the first N layers (with --checkpoint).
    #[arg(long, value_name = "N", requires = "checkpoint")]
    layers: Option<usize>,
    /// Largest shard file in bytes (with --checkpoint; Hugging Face's default 5 GB).
    #[arg(long, value_name = "BYTES", requires = "checkpoint", default_value_t = forge_quant::synth_checkpoint::SHARD_BYTES)]
    shard_bytes: usize,
}

pub fn run(a: Args) -> Result<()> {
    if a.checkpoint {
        let s = forge_quant::synth_checkpoint::synth_checkpoint(&forge_quant::synth_checkpoint::Options {
            shape: a.shape,
            layers: a.layers,
            output: a.output,
            seed: a.seed,
            shard_bytes: a.shard_bytes,
            progress: std::io::IsTerminal::is_terminal(&std::io::stderr()),
        })?;
        print!("{}", s.to_text());
        return Ok(());
    }
    let s = forge_quant::synth::synth(&forge_quant::synth::Options {
        shape: a.shape,
        output: a.output,
        seed: a.seed,
        progress: std::io::IsTerminal::is_terminal(&std::io::stderr()),
    })?;
    print!("{}", s.to_text());
    Ok(())
}
