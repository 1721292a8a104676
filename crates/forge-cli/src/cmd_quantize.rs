use anyhow::{bail, Result};
use forge_kernels::lut::Format;
use forge_quant::plan::{Basis, Plan};
use forge_quant::quantize::{quantize, Method, Options};
use std::path::PathBuf;

#[derive(clap::Args)]
pub struct Args {
    /// Source model: Hugging Face directory, GGUF file, or a short name (smollm2).
    #[arg(long)]
    model: String,
    /// Plan JSON (the seeds' format: "<layer>.gate|up|down|mixer|basis" → format).
    #[arg(long, conflicts_with = "format")]
    plan: Option<PathBuf>,
    /// Uniform format for MLP and token-mixer matrices (lut4, lut3, lut2, vec2x16, vec2x64, int8, f16, bf16).
    #[arg(long)]
    format: Option<String>,
    /// Token-mixer default (overrides --format for attention / DeltaNet projections).
    #[arg(long)]
    mixer: Option<String>,
    /// Attention K/V projections.
    #[arg(long, default_value = "int8")]
    kv: String,
    /// LM head.
    #[arg(long, default_value = "lut4")]
    head: String,
    /// Online Hadamard rotations: none, mlp, mixer, or mlp,mixer.
    #[arg(long, default_value = "none")]
    rotate: String,
    #[arg(long, default_value = "rtn")]
    method: String,
    /// Seed for every random choice (recorded in the export).
    #[arg(long, default_value_t = 0)]
    seed: u64,
    #[arg(long)]
    output: PathBuf,
    /// Continue an interrupted run in OUTPUT.
    #[arg(long)]
    resume: bool,
}

pub fn run(a: Args) -> Result<()> {
    let source = forge_core::hub::resolve_model(&a.model, true)?;
    let base = a.format.as_deref().map(Format::parse).transpose()?.unwrap_or(Format::Lut4);
    let mut plan = Plan::uniform(base);
    if let Some(m) = &a.mixer {
        plan.mixer = Format::parse(m)?;
    }
    plan.kv = Format::parse(&a.kv)?;
    plan.head = Format::parse(&a.head)?;
    for part in a.rotate.split(',').filter(|s| !s.is_empty() && *s != "none") {
        match part {
            "mlp" => plan.mlp_basis = Basis::Online,
            "mixer" => plan.mixer_basis = Basis::Online,
            _ => bail!("--rotate: unknown part '{part}' (none, mlp, mixer)"),
        }
    }
    if let Some(p) = &a.plan {
        plan = Plan::from_file(p, plan)?;
    } else if a.format.is_none() {
        bail!("give --plan PLAN.json or --format FMT");
    }
    let opts = Options {
        source_arg: a.model.clone(),
        source,
        plan,
        method: Method::parse(&a.method)?,
        seed: a.seed,
        output: a.output.clone(),
        resume: a.resume,
        stop_before_layer: None,
    };
    let t0 = std::time::Instant::now();
    quantize(&opts)?;
    let report = forge_quant::inspect::inspect(&a.output)?;
    eprintln!(
        "wrote {} in {:.1} s: {:.3} bits/weight ({:.3} with embedding), {:.2} MiB packed",
        a.output.display(),
        t0.elapsed().as_secs_f64(),
        report.bits_per_weight,
        report.bits_per_weight_with_embedding,
        report.packed_bytes as f64 / 1048576.0
    );
    Ok(())
}
