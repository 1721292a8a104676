use anyhow::{bail, Result};
use forge_kernels::lut::Format;
use forge_quant::plan::{Basis, Part, Plan};
use forge_quant::quantize::{quantize, Method, Options};
use std::path::PathBuf;

#[derive(clap::Args)]
pub struct Args {
    /// Source model: Hugging Face directory, GGUF file, or a short name (smollm2).
    #[arg(long)]
    model: String,
    /// Plan JSON (ANEMLL Forge's format: "<layer>.gate|up|down|mixer|basis" → format).
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
    /// Online Hadamard rotations: none, or a list of mlp, mixer, head.
    #[arg(long, default_value = "none")]
    rotate: String,
    /// rtn or gptq.
    #[arg(long, default_value = "rtn")]
    method: String,
    /// A tuned recipe (q4, q3, q2): sets plan, rotations, method, calibration and low-rank; explicit flags
    /// given with it override its formats.
    #[arg(long)]
    preset: Option<String>,
    /// Calibration rows as file:rows,file:rows (files relative to data/calib; ids=FILE reads token ids, e.g.
    /// from `forge calib generate`; no :rows = every row); default: half prose, half code.
    #[arg(long)]
    calib: Option<String>,
    /// Calibration rows in total when --calib is not given.
    #[arg(long, default_value_t = 32)]
    ncal: usize,
    /// Tokens per calibration row.
    #[arg(long, default_value_t = 512)]
    seq: usize,
    /// Calibration rows held out of the Hessians (for held-out SNR).
    #[arg(long, default_value_t = 4)]
    holdout: usize,
    /// Weight codebook fits by the activation energy diag(H) (ANEMLL Forge's AW=1).
    #[arg(long)]
    aw: bool,
    /// Rank of low-rank corrections (0 = none).
    #[arg(long, default_value_t = 0)]
    lowrank: usize,
    /// Parts that get low-rank corrections: gdn, attn, mlp, head.
    #[arg(long, default_value = "gdn,attn")]
    lowrank_parts: String,
    /// Fit the low-rank factors before GPTQ and quantize W − AB (release 0.2), instead of after.
    #[arg(long)]
    lowrank_inside: bool,
    /// Seed for every random choice (recorded in the export).
    #[arg(long, default_value_t = 0)]
    seed: u64,
    #[arg(long)]
    output: PathBuf,
    /// Continue an interrupted run in OUTPUT.
    #[arg(long)]
    resume: bool,
}

pub fn run(mut a: Args) -> Result<()> {
    let source = crate::cmd_bundle::resolve(&a.model)?;
    let preset = a.preset.as_deref().map(forge_quant::preset::Preset::get).transpose()?;
    if let Some(p) = &preset {
        a.method = "gptq".into();
        a.aw |= p.aw;
        if a.lowrank == 0 {
            a.lowrank = p.lowrank;
            a.lowrank_parts = p.lowrank_parts.into();
        }
        if a.rotate == "none" {
            a.rotate = p.rotate.into();
        }
    }
    let base = a.format.as_deref().map(Format::parse).transpose()?.unwrap_or(Format::Lut4);
    let mut plan = match &preset {
        Some(p) if a.format.is_none() => p.plan.clone(),
        _ => Plan::uniform(base),
    };
    if let Some(m) = &a.mixer {
        plan.mixer = Format::parse(m)?;
    }
    if preset.is_none() || a.format.is_some() {
        plan.kv = Format::parse(&a.kv)?;
        plan.head = Format::parse(&a.head)?;
    }
    for part in a.rotate.split(',').filter(|s| !s.is_empty() && *s != "none") {
        match part {
            "mlp" => plan.mlp_basis = Basis::Online,
            "mixer" => plan.mixer_basis = Basis::Online,
            "head" => plan.head_basis = Basis::Online,
            _ => bail!("--rotate: unknown part '{part}' (none, mlp, mixer, head)"),
        }
    }
    if let Some(p) = &a.plan {
        plan = Plan::from_file(p, plan)?;
    } else if a.format.is_none() && preset.is_none() {
        bail!("give --preset q4|q3|q2, --plan PLAN.json or --format FMT");
    }
    let method = Method::parse(&a.method)?;
    let calib = (method == Method::Gptq).then(|| forge_quant::calib::CalibConfig {
        spec: a.calib.clone().unwrap_or_else(|| forge_quant::calib::default_spec(a.ncal)),
        seq: a.seq,
        holdout: a.holdout,
    });
    let lowrank = (a.lowrank > 0)
        .then(|| -> Result<_> {
            let parts = a
                .lowrank_parts
                .split(',')
                .filter(|s| !s.is_empty())
                .map(|p| match p {
                    "mlp" => Ok(Part::Mlp),
                    "gdn" => Ok(Part::Gdn),
                    "attn" => Ok(Part::Attn),
                    "head" => Ok(Part::Head),
                    _ => bail!("--lowrank-parts: unknown part '{p}' (gdn, attn, mlp, head)"),
                })
                .collect::<Result<Vec<_>>>()?;
            Ok(forge_quant::quantize::LowRankConfig { rank: a.lowrank, parts, inside: a.lowrank_inside })
        })
        .transpose()?;
    let opts = Options {
        source_arg: a.model.clone(),
        source,
        plan,
        method,
        seed: a.seed,
        output: a.output.clone(),
        resume: a.resume,
        stop_before_layer: None,
        calib,
        aw: a.aw,
        lowrank,
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
