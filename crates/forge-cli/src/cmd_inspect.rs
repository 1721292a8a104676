use anyhow::Result;
use std::path::PathBuf;

#[derive(clap::Args)]
pub struct Args {
    /// Export directory.
    dir: PathBuf,
    /// Print JSON instead of a table.
    #[arg(long)]
    json: bool,
}

pub fn run(a: Args) -> Result<()> {
    let r = forge_quant::inspect::inspect(&a.dir)?;
    if a.json {
        println!("{}", serde_json::to_string_pretty(&r.to_json())?);
    } else {
        print!("{}", r.to_table());
    }
    Ok(())
}
