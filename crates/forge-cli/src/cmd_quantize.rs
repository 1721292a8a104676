use anyhow::Result;
use forge_quant::quantize::quantize;
use forge_quant::recipe::{resolve, Choices};
use serde_json::json;
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
    /// Attention K/V projections [default: int8, or the preset's].
    #[arg(long)]
    kv: Option<String>,
    /// LM head [default: lut4, or the preset's].
    #[arg(long)]
    head: Option<String>,
    /// Online Hadamard rotations: a list of mlp, mixer, head, or none [default: mlp,mixer,head].
    #[arg(long)]
    rotate: Option<String>,
    /// rtn or gptq [default: rtn; gptq with a preset].
    #[arg(long)]
    method: Option<String>,
    /// A tuned recipe (q4, q3, q2): sets plan, rotations, method, calibration and low-rank; explicit flags
    /// given with it override its choices.
    #[arg(long)]
    preset: Option<String>,
    /// Calibration rows as file:rows,file:rows (files relative to data/calib; ids=FILE reads token ids, e.g.
    /// from `forge calib generate`; no :rows = every row); default: half prose, half code. Given with RTN, the
    /// codebooks are fitted activation-weighted on it.
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
    /// Weight codebook fits by the activation energy diag(H) (ANEMLL Forge's AW=1); the default whenever
    /// calibration is loaded.
    #[arg(long, conflicts_with = "no_aw")]
    aw: bool,
    /// Fit codebooks on the weights alone even with calibration.
    #[arg(long)]
    no_aw: bool,
    /// Rank of low-rank corrections (0 = none).
    #[arg(long, default_value_t = 0)]
    lowrank: usize,
    /// Parts that get low-rank corrections: gdn, attn, mlp, head [default: gdn,attn].
    #[arg(long)]
    lowrank_parts: Option<String>,
    /// Fit the low-rank factors before GPTQ and quantize W − AB (release 0.2), instead of after.
    #[arg(long)]
    lowrank_inside: bool,
    /// Block reconstruction: after each LUT matrix's fit, refit its codebook values and per-row
    /// scales (indices frozen) to the calibration activations in closed form, in up to ROUNDS
    /// alternations; kept only where it lowers the held-out error. Needs calibration.
    #[arg(long, value_name = "ROUNDS", num_args = 0..=1, default_missing_value = "4", default_value_t = 0)]
    reconstruct: usize,
    /// Seed for every random choice (recorded in the export).
    #[arg(long, default_value_t = 0)]
    seed: u64,
    #[arg(long, required_unless_present = "dry_run")]
    output: Option<PathBuf>,
    /// Print the projected time and peak memory of this run instead of making the export:
    /// measured on the first layers that hold one of each layer kind and the head, with at most 8
    /// calibration rows, in a temporary directory, then scaled to every layer and row.
    #[arg(long)]
    dry_run: bool,
    /// Continue an interrupted run in OUTPUT.
    #[arg(long)]
    resume: bool,
    /// Tokens of the end-of-run check (KL against the source on held-out calibration text); 0 skips it.
    #[arg(long, default_value_t = forge_quant::check::DEFAULT_TOKENS)]
    check_tokens: usize,
    /// Print the JSON report (sizes, check, seconds per stage) on stdout.
    #[arg(long)]
    json: bool,
    /// Write the JSON report here.
    #[arg(long, value_name = "PATH")]
    json_out: Option<PathBuf>,
}

pub fn run(a: Args) -> Result<()> {
    let source = crate::cmd_bundle::resolve(&a.model)?;
    let choices = Choices {
        preset: a.preset.clone(),
        plan_file: a.plan.clone(),
        format: a.format.clone(),
        mixer: a.mixer.clone(),
        kv: a.kv.clone(),
        head: a.head.clone(),
        rotate: a.rotate.clone(),
        method: a.method.clone(),
        calib: a.calib.clone(),
        ncal: a.ncal,
        seq: a.seq,
        holdout: a.holdout,
        aw: if a.aw {
            Some(true)
        } else if a.no_aw {
            Some(false)
        } else {
            None
        },
        lowrank: a.lowrank,
        lowrank_parts: a.lowrank_parts.clone(),
        lowrank_inside: a.lowrank_inside,
        reconstruct: a.reconstruct,
    };
    if a.dry_run {
        return dry_run(&a, choices, source);
    }
    let output = a.output.clone().expect("clap requires --output without --dry-run");
    let mut opts = resolve(&choices)?.options(&a.model, source, output.clone(), a.seed);
    opts.resume = a.resume;
    opts.check_tokens = a.check_tokens;
    let outcome = quantize(&opts)?;
    let report = forge_quant::inspect::inspect(&output)?;
    eprintln!(
        "wrote {} in {:.1} s: {:.3} bits/weight ({:.3} with embedding), {:.2} MiB packed",
        output.display(),
        outcome.total_seconds,
        report.bits_per_weight,
        report.bits_per_weight_with_embedding,
        report.packed_bytes as f64 / 1048576.0
    );
    eprint!("{}", outcome.stages_table());
    if let Some(c) = &outcome.check {
        eprintln!(
            "check: KL {:.4} nats, top-1 {:.1} % over {} positions ({}); expected about {:.3}, limit {:.3}",
            c.kl,
            100.0 * c.top1,
            c.positions,
            c.text,
            c.expected_kl,
            c.limit
        );
        if let Some(w) = c.warning() {
            eprintln!("\n{w}\n");
        }
    }
    let json = json!({
        "output": output.display().to_string(),
        "bits_per_weight": report.bits_per_weight,
        "bits_per_weight_with_embedding": report.bits_per_weight_with_embedding,
        "packed_bytes": report.packed_bytes,
        "options": outcome.manifest["options"],
        "check": outcome.check.as_ref().map(|c| c.to_json()),
        "seconds": outcome.stages_json(),
        "threads": rayon::current_num_threads(),
    });
    if let Some(p) = &a.json_out {
        forge_core::fsutil::write_atomic(p, &serde_json::to_vec_pretty(&json)?)?;
    }
    if a.json {
        println!("{}", serde_json::to_string_pretty(&json)?);
    }
    Ok(())
}

/// `--dry-run`: quantize the first layers of each kind and the head into a temporary directory
/// with a few calibration rows, and project the whole run from it.
fn dry_run(a: &Args, choices: Choices, source: PathBuf) -> Result<()> {
    let (_, cfg) = forge_core::checkpoint::Checkpoint::open(&source)?;
    let layers = forge_quant::dry_run::probe_layers(&cfg);
    let tmp = std::env::temp_dir().join(format!("forge-dry-run-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&tmp);
    let mut opts = resolve(&choices)?.options(&a.model, source, tmp.clone(), a.seed);
    let rows = match &opts.calib {
        Some(c) => forge_quant::calib::load_rows(None, &c.spec, c.seq).map(|r| r.len()).unwrap_or(a.ncal),
        None => 0,
    };
    opts.check_tokens = a.check_tokens;
    opts.probe = Some(forge_quant::quantize::Probe { layers, calib_rows: forge_quant::dry_run::PROBE_ROWS });
    eprintln!(
        "dry run: quantizing layers 0-{} and the head with at most {} calibration rows in {}",
        layers - 1,
        forge_quant::dry_run::PROBE_ROWS,
        tmp.display()
    );
    let outcome = quantize(&opts);
    let _ = std::fs::remove_dir_all(&tmp);
    let outcome = outcome?;
    let peak = crate::cmd_bench::peak_rss().unwrap_or(0);
    let p = forge_quant::dry_run::project(&outcome, &cfg, rows, peak);
    eprintln!(
        "measured {:.0} s for {} layers and the head; projected for {} layers{}:",
        outcome.total_seconds,
        layers,
        cfg.num_layers,
        if rows > 0 { format!(" and {rows} calibration rows of {} tokens", outcome.calib_seq) } else { String::new() }
    );
    eprint!("{}", p.to_text());
    let json = json!({"projection": p.to_json(), "measured": outcome.stages_json(), "probe_layers": layers});
    if let Some(path) = &a.json_out {
        forge_core::fsutil::write_atomic(path, &serde_json::to_vec_pretty(&json)?)?;
    }
    if a.json {
        println!("{}", serde_json::to_string_pretty(&json)?);
    }
    Ok(())
}
