//! Calibration rows: `SEQ`-token windows cut from text files, mixed by a spec like ANEMLL Forge's
//! `CAL_MIX` (`file:rows,file:rows`). Files named relatively are looked up in the calibration
//! directory (the repository's `data/calib` by default). The evaluation split is refused: a figure
//! measured on text that shaped the model is not a measurement.
//!
//! `ids=FILE` entries read token ids instead of text, in one of two layouts:
//! * a stream: whitespace-separated ids, cut into consecutive `SEQ`-token windows like text;
//! * rows: a first line starting with [`ROWS_HEADER`], then one row per line (blank lines and
//!   further `#` lines skipped), as `forge calib generate` writes them. Each line is one row of its
//!   own length, cut to its first `SEQ` tokens when longer: a conversation is never joined to the
//!   next one, and a short one simply contributes fewer positions to the Hessians.

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

/// The default calibration directory (the repository's `data/calib`).
pub fn calib_dir() -> Option<PathBuf> {
    crate::eval::find_data_dir().map(|d| d.join("calib"))
}

/// Default spec: half prose, half code, `rows` in total.
pub fn default_spec(rows: usize) -> String {
    format!("prose.txt:{},code.txt:{}", rows.div_ceil(2), rows / 2)
}

/// First line of an ids file that holds one row per line.
pub const ROWS_HEADER: &str = "#rows";

/// Refuses a path inside the evaluation split (a `data/eval` directory).
pub fn refuse_eval_split(path: &Path) -> Result<PathBuf> {
    let canon = std::fs::canonicalize(path).unwrap_or(path.to_path_buf());
    if canon.components().any(|c| c.as_os_str() == "eval") {
        bail!("{}: refusing to calibrate on the evaluation split (data/eval)", canon.display());
    }
    Ok(canon)
}

fn resolve(file: &str) -> Result<PathBuf> {
    let p = Path::new(file);
    let p = if p.exists() {
        p.to_path_buf()
    } else {
        let dir =
            calib_dir().context("cannot find data/calib (in the Forge repository); give calibration files by path")?;
        dir.join(file)
    };
    if !p.exists() {
        bail!("calibration file '{file}' not found");
    }
    refuse_eval_split(&p)
}

/// Calibration rows, in spec order: the first `rows` consecutive `seq`-token windows of each text
/// file or ids stream, or the first `rows` lines (each cut to `seq` tokens) of an ids rows file.
/// An entry without `:rows` takes every row its file gives.
pub fn load_rows(tok: Option<&Tokenizer>, spec: &str, seq: usize) -> Result<Vec<Vec<u32>>> {
    if seq == 0 {
        bail!("calibration rows of 0 tokens");
    }
    let mut out = Vec::new();
    for part in spec.split(',').filter(|s| !s.trim().is_empty()) {
        let (file, n) = match part.rsplit_once(':') {
            Some((file, n)) => {
                let n: usize =
                    n.trim().parse().with_context(|| format!("calibration spec entry '{part}': bad row count"))?;
                (file, Some(n))
            }
            None => (part, None),
        };
        let (is_ids, file) = match file.trim().strip_prefix("ids=") {
            Some(f) => (true, f),
            None => (false, file.trim()),
        };
        let path = resolve(file)?;
        let text = std::fs::read_to_string(&path).with_context(|| format!("{}: cannot read", path.display()))?;
        let parse = |s: &str| -> Result<Vec<u32>> {
            s.split_whitespace()
                .map(|w| w.parse::<u32>().with_context(|| format!("{}: '{w}' is not a token id", path.display())))
                .collect()
        };
        if is_ids && text.starts_with(ROWS_HEADER) {
            let lines = text.lines().skip(1).map(str::trim).filter(|l| !l.is_empty() && !l.starts_with('#'));
            let rows = lines.map(|l| parse(l).map(|ids| ids[..ids.len().min(seq)].to_vec()));
            let rows: Vec<Vec<u32>> = rows.take(n.unwrap_or(usize::MAX)).collect::<Result<_>>()?;
            if let Some(n) = n.filter(|&n| rows.len() < n) {
                bail!("{}: {} rows, {n} requested", path.display(), rows.len());
            }
            out.extend(rows);
            continue;
        }
        let ids: Vec<u32> = if is_ids {
            parse(&text)?
        } else {
            let tok = tok.with_context(|| format!("{}: the model has no tokenizer; use ids=FILE", path.display()))?;
            tok.encode(&text, false).with_context(|| format!("{}: tokenizing", path.display()))?
        };
        let avail = ids.len() / seq;
        let n = n.unwrap_or(avail);
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

#[cfg(test)]
mod tests {
    use super::*;

    fn tmp(name: &str, text: &str) -> String {
        let d = std::env::temp_dir().join(format!("forge-calib-{}", std::process::id()));
        std::fs::create_dir_all(&d).unwrap();
        let p = d.join(name);
        std::fs::write(&p, text).unwrap();
        p.display().to_string()
    }

    #[test]
    fn calib_ids_stream_is_cut_into_windows() {
        let f = tmp("stream.txt", "1 2 3\n4 5\n6 7 8 9");
        assert_eq!(load_rows(None, &format!("ids={f}:2"), 4).unwrap(), vec![vec![1, 2, 3, 4], vec![5, 6, 7, 8]]);
        // Without a count: every full window.
        assert_eq!(load_rows(None, &format!("ids={f}"), 3).unwrap().len(), 3);
        let e = load_rows(None, &format!("ids={f}:3"), 4).unwrap_err().to_string();
        assert!(e.contains("9 tokens make only 2 rows of 4, 3 requested"), "{e}");
        let bad = tmp("bad.txt", "1 2 x");
        let e = load_rows(None, &format!("ids={bad}:1"), 2).unwrap_err().to_string();
        assert!(e.contains("'x' is not a token id"), "{e}");
        let e = load_rows(None, &format!("{f}:1"), 2).unwrap_err().to_string();
        assert!(e.contains("no tokenizer; use ids=FILE"), "{e}");
    }

    #[test]
    fn calib_ids_rows_file_keeps_one_row_per_line() {
        let f = tmp("rows.txt", &format!("{ROWS_HEADER} test\n1 2 3 4 5 6\n\n# note\n7 8\n9 10 11\n"));
        let rows = load_rows(None, &format!("ids={f}"), 4).unwrap();
        assert_eq!(rows, vec![vec![1, 2, 3, 4], vec![7, 8], vec![9, 10, 11]]);
        assert_eq!(load_rows(None, &format!("ids={f}:2"), 8).unwrap(), vec![vec![1, 2, 3, 4, 5, 6], vec![7, 8]]);
        let e = load_rows(None, &format!("ids={f}:4"), 4).unwrap_err().to_string();
        assert!(e.contains("3 rows, 4 requested"), "{e}");
        // Mixed with a stream, in spec order.
        let s = tmp("stream2.txt", "20 21 22 23");
        let rows = load_rows(None, &format!("ids={s}:1,ids={f}:1"), 4).unwrap();
        assert_eq!(rows, vec![vec![20, 21, 22, 23], vec![1, 2, 3, 4]]);
    }
}
