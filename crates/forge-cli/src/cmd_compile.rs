//! `forge compile`: write an export's packed kernel layout next to it (`packed.forgecache`), so
//! later starts map it instead of re-packing (the CPU counterpart of ANEMLL Forge's ANE compile).

use anyhow::{bail, Result};
use indicatif::{ProgressBar, ProgressStyle};
use std::io::IsTerminal;
use std::path::PathBuf;
use std::time::Instant;

#[derive(clap::Args)]
pub struct Args {
    /// Forge export directory
    #[arg(long)]
    model: PathBuf,
    /// Rebuild even when a cache built from these weights exists
    #[arg(long)]
    force: bool,
}

pub fn run(a: Args) -> Result<()> {
    if !forge_model::export::is_export(&a.model) {
        bail!(
            "{}: not a Forge export (no forge.json); `forge compile` takes `forge quantize` output",
            a.model.display()
        );
    }
    let pb = if std::io::stderr().is_terminal() { ProgressBar::new(0) } else { ProgressBar::hidden() };
    pb.set_style(
        ProgressStyle::with_template("compile [{bar:30}] {pos}/{len} matrices, {elapsed} elapsed, ETA {eta}")
            .expect("valid template"),
    );
    let t0 = Instant::now();
    let r = forge_model::compiled::compile(&a.model, a.force, &|done, total| {
        pb.set_length(total as u64);
        pb.set_position(done as u64);
    })?;
    pb.finish_and_clear();
    let path = a.model.join(forge_model::compiled::CACHE_FILE);
    if r.reused {
        println!(
            "{}: up to date ({} matrices, {:.1} MiB; --force rebuilds)",
            path.display(),
            r.matrices,
            r.bytes as f64 / (1 << 20) as f64
        );
    } else {
        println!(
            "wrote {} in {:.1} s: {} matrices in the integer-dot layout, {:.1} MiB{}",
            path.display(),
            t0.elapsed().as_secs_f64(),
            r.matrices,
            r.bytes as f64 / (1 << 20) as f64,
            if r.tiles > 0 {
                format!("; {} keep the float tile kernels, packed at load (codebooks off the 8-bit grid)", r.tiles)
            } else {
                String::new()
            }
        );
    }
    Ok(())
}
