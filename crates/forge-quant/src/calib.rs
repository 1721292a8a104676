//! Calibration rows: `SEQ`-token windows cut from text files, mixed by a spec like the seeds'
//! `CAL_MIX` (`file:rows,file:rows`). Files named relatively are looked up in the calibration
//! directory (`../shared/data/calib` by default). The evaluation split is refused: a figure
//! measured on text that shaped the model is not a measurement.

use anyhow::{bail, Context, Result};
use forge_core::tokenizer::Tokenizer;
use std::path::{Path, PathBuf};

#[derive(Clone, Debug)]
pub struct CalibConfig {
    /// `file:rows,file:rows`.
    pub spec: String,
    /// Tokens per row.
    pub seq: usize,
    /// Rows held out of every Hessian (the last ones) for held-out SNR.
    pub holdout: usize,
}

/// The default calibration directory (`../shared/data/calib`).
pub fn calib_dir() -> Option<PathBuf> {
    crate::eval::find_data_dir().map(|d| d.join("calib"))
}

/// Default spec: half prose, half code, `rows` in total.
pub fn default_spec(rows: usize) -> String {
    format!("prose.txt:{},code.txt:{}", rows.div_ceil(2), rows / 2)
}

fn resolve(file: &str) -> Result<PathBuf> {
    let p = Path::new(file);
    let p = if p.exists() {
        p.to_path_buf()
    } else {
        let dir = calib_dir().context("cannot find ../shared/data/calib; give calibration files by path")?;
        dir.join(file)
    };
    if !p.exists() {
        bail!("calibration file '{file}' not found");
    }
    let canon = std::fs::canonicalize(&p).unwrap_or(p.clone());
    if canon.components().any(|c| c.as_os_str() == "eval") {
        bail!("{}: refusing to calibrate on the evaluation split (data/eval)", canon.display());
    }
    Ok(canon)
}

/// Rows of `seq` tokens: the first `rows` consecutive windows of each file, in spec order. An
/// entry `ids=FILE:rows` reads token ids (whitespace-separated) instead of text.
pub fn load_rows(tok: Option<&Tokenizer>, spec: &str, seq: usize) -> Result<Vec<Vec<u32>>> {
    let mut out = Vec::new();
    for part in spec.split(',').filter(|s| !s.trim().is_empty()) {
        let (file, n) =
            part.rsplit_once(':').with_context(|| format!("calibration spec entry '{part}' is not file:rows"))?;
        let n: usize = n.trim().parse().with_context(|| format!("calibration spec entry '{part}': bad row count"))?;
        let (is_ids, file) = match file.trim().strip_prefix("ids=") {
            Some(f) => (true, f),
            None => (false, file.trim()),
        };
        let path = resolve(file)?;
        let text = std::fs::read_to_string(&path).with_context(|| format!("{}: cannot read", path.display()))?;
        let ids: Vec<u32> = if is_ids {
            text.split_whitespace()
                .map(|w| w.parse::<u32>().with_context(|| format!("{}: '{w}' is not a token id", path.display())))
                .collect::<Result<_>>()?
        } else {
            let tok = tok.with_context(|| format!("{}: the model has no tokenizer; use ids=FILE", path.display()))?;
            tok.encode(&text, false).with_context(|| format!("{}: tokenizing", path.display()))?
        };
        let avail = ids.len() / seq;
        if avail < n {
            bail!("{}: {} tokens make only {avail} rows of {seq}, {n} requested", path.display(), ids.len());
        }
        out.extend(ids.chunks_exact(seq).take(n).map(|c| c.to_vec()));
    }
    if out.is_empty() {
        bail!("calibration spec '{spec}' selects no rows");
    }
    Ok(out)
}
