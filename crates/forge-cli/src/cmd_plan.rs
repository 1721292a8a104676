//! `forge sensitivity` (the KL cost of each part of a model in each format) and `forge plan`
//! (the formats that minimize the predicted KL within a bit budget).

use anyhow::{bail, Context, Result};
use forge_core::fsutil::write_atomic;
use forge_kernels::lut::Format;
use forge_quant::budget::{plan, plan_json, Sensitivity};
use forge_quant::plan::Plan;
use forge_quant::quantize::{options_from_json, quantize};
use forge_quant::sensitivity::{fixed, measure_part, parts, plot_svg};
use indicatif::{ProgressBar, ProgressStyle};
use serde_json::{json, Value};
use std::path::{Path, PathBuf};

#[derive(clap::Args)]
pub struct SensitivityArgs {
    /// The base export: every part is measured against it, and every candidate format is
    /// quantized with its recipe (method, calibration, rotations, low-rank, seed).
    #[arg(long)]
    base: PathBuf,
    /// Candidate formats, each quantized once for the whole model and cached under --work.
    #[arg(long, value_delimiter = ',', default_value = "lut2,vec2x16,lut3,vec2x64,lut4,int8")]
    formats: Vec<String>,
    /// The source model the KL is taken against [default: the base export's source].
    #[arg(long)]
    model: Option<String>,
    /// Held-out calibration tokens the KL is measured on (the last windows of data/calib's prose
    /// and code, which the default calibration does not use; never the evaluation text).
    #[arg(long, default_value_t = 256)]
    tokens: usize,
    /// Where the candidate exports are kept [default: OUT's directory, `sens-candidates/`].
    #[arg(long)]
    work: Option<PathBuf>,
    /// The sensitivity file (a finished part is kept in OUT.partial and not measured again).
    #[arg(long)]
    out: PathBuf,
    /// The plot of KL per bit saved by layer and part [default: OUT with .svg].
    #[arg(long)]
    plot: Option<PathBuf>,
}

#[derive(clap::Args)]
pub struct PlanArgs {
    /// A sensitivity file from `forge sensitivity`.
    #[arg(long)]
    sensitivity: PathBuf,
    /// Bits per weight for all weights (embedding and head included).
    #[arg(long)]
    bpw: f64,
    /// The plan file, for `forge quantize --plan`.
    #[arg(long)]
    out: PathBuf,
}

/// The export of `format` made with the base's recipe, quantized now unless already there.
fn candidate(base_options: &Value, source: &Path, format: Format, dir: &Path) -> Result<forge_model::Model> {
    if !dir.join(forge_model::export::MANIFEST).exists() {
        let mut o = options_from_json(base_options, source.to_path_buf(), dir.to_path_buf())?;
        let mut plan = o.plan.clone();
        (plan.mlp, plan.mixer, plan.kv, plan.head) = (format, format, format, format);
        plan.entries.retain(|k, _| k.ends_with("basis"));
        o.plan = plan;
        o.resume = dir.exists() && std::fs::read_dir(dir)?.next().is_some();
        eprintln!("sensitivity: quantizing the {} candidate into {}", format.name(), dir.display());
        quantize(&o).with_context(|| format!("quantizing the {} candidate", format.name()))?;
    }
    Ok(forge_model::load::load(dir)?.model)
}

pub fn run_sensitivity(a: SensitivityArgs) -> Result<()> {
    let base_manifest = forge_model::export::Export::open(&a.base)?.manifest;
    let options = base_manifest.get("options").context("the base export records no options")?;
    let source_arg = match &a.model {
        Some(m) => m.clone(),
        None => options["source"].as_str().context("the base export records no source")?.to_string(),
    };
    let source = crate::cmd_bundle::resolve(&source_arg)?;
    let base_plan = Plan::from_json(&options["plan"], Plan::uniform(Format::Lut4))?;
    let formats: Vec<Format> = a.formats.iter().map(|f| Format::parse(f)).collect::<Result<_>>()?;
    if formats.is_empty() {
        bail!("--formats: give at least one format");
    }
    let dir = a.out.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
    let work = a.work.clone().unwrap_or_else(|| dir.join("sens-candidates"));
    let mut candidates = Vec::new();
    for f in &formats {
        candidates.push((f.name().to_string(), candidate(options, &source, *f, &work.join(f.name()))?));
    }
    let loaded = forge_model::load::load(&source)?;
    let tok = loaded.tokenizer().ok();
    let (rows, text) = forge_quant::check::check_rows(tok, loaded.model.cfg.vocab_size, a.tokens);
    let teacher = forge_quant::check::Teacher::new(&loaded.model, rows, text.clone())?;
    drop(loaded);
    let mut base = forge_model::load::load(&a.base)?.model;
    let (base_kl, _, positions) = teacher.measure(&base)?;
    let all = parts(&base)?;
    // What a resumed run must find the same.
    let key = json!({"base": a.base.display().to_string(), "formats": a.formats, "tokens": a.tokens, "text": text});
    let partial_path = PathBuf::from(format!("{}.partial", a.out.display()));
    let mut done: Vec<Value> = match std::fs::read_to_string(&partial_path) {
        Ok(t) => {
            let v: Value =
                serde_json::from_str(&t).with_context(|| format!("{}: malformed", partial_path.display()))?;
            if v["key"] != key {
                bail!(
                    "{}: an interrupted sweep with other arguments (remove it to start over)",
                    partial_path.display()
                );
            }
            v["parts"].as_array().cloned().unwrap_or_default()
        }
        Err(_) => Vec::new(),
    };
    let pb = ProgressBar::new(all.len() as u64);
    pb.set_style(
        ProgressStyle::with_template("sensitivity [{bar:30}] {pos}/{len} parts, {elapsed} elapsed, ETA {eta} {msg}")?
            .progress_chars("=> "),
    );
    pb.set_position(done.len() as u64);
    for part in all.iter().skip(done.len()) {
        pb.set_message(part.name.clone());
        done.push(measure_part(&mut base, &base_plan, base_kl, &candidates, &teacher, part)?);
        write_atomic(&partial_path, serde_json::to_string(&json!({"key": key, "parts": done}))?.as_bytes())?;
        pb.inc(1);
    }
    pb.finish_and_clear();
    let (fixed_weights, fixed_bits) = fixed(&base, &all);
    let sens = json!({
        "base": base_plan.to_json(),
        "base_export": a.base.display().to_string(),
        "base_kl": base_kl,
        "positions": positions,
        "text": text,
        "fixed_weights": fixed_weights,
        "fixed_bits": fixed_bits,
        "parts": done,
    });
    Sensitivity::from_json(&sens).context("the sweep's own output does not read back")?;
    write_atomic(&a.out, serde_json::to_string_pretty(&sens)?.as_bytes())?;
    let plot = a.plot.clone().unwrap_or_else(|| a.out.with_extension("svg"));
    write_atomic(&plot, plot_svg(&sens).as_bytes())?;
    let _ = std::fs::remove_file(&partial_path);
    println!("base KL {base_kl:.4} over {positions} positions ({text})");
    println!("wrote {} ({} parts × {} formats) and {}", a.out.display(), all.len(), formats.len(), plot.display());
    Ok(())
}

pub fn run_plan(a: PlanArgs) -> Result<()> {
    let s = Sensitivity::from_file(&a.sensitivity)?;
    let p = plan(&s, a.bpw)?;
    let v = plan_json(&s, &p)?;
    write_atomic(&a.out, serde_json::to_string_pretty(&v)?.as_bytes())?;
    let mut counts: std::collections::BTreeMap<&str, usize> = Default::default();
    for (part, &k) in s.parts.iter().zip(&p.choice) {
        *counts.entry(part.options[k].format.as_str()).or_default() += 1;
    }
    let mix: Vec<String> = counts.iter().map(|(f, n)| format!("{f} ×{n}")).collect();
    println!(
        "plan: {:.3} bits per weight (budget {}), predicted KL change {:+.4} over the base; parts: {}",
        p.bpw,
        a.bpw,
        p.predicted_dkl,
        mix.join(", ")
    );
    println!("wrote {}", a.out.display());
    Ok(())
}
