//! `.forge-download.json`: where a directory came from, so that a rerun resumes the same commit
//! and `forge check-update` knows what to compare.

use anyhow::{bail, Context, Result};
use forge_core::release::{FileEntry, DOWNLOAD_FILE};
use serde::{Deserialize, Serialize};
use std::path::Path;
use std::time::{SystemTime, UNIX_EPOCH};

pub const RECORD_FORMAT: &str = "forge-download/1";

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct DownloadRecord {
    pub format: String,
    pub endpoint: String,
    pub repo: String,
    /// As requested: a branch, tag or commit.
    pub revision: String,
    /// What `revision` resolved to when the download started.
    pub commit: String,
    /// The `--include` patterns; empty for the whole repository.
    #[serde(default)]
    pub include: Vec<String>,
    /// False while a download is under way or after one failed: the directory then holds
    /// files of this commit only, some of them missing or partial.
    pub complete: bool,
    /// RFC 3339, UTC.
    pub time: String,
    /// Every file downloaded and checked, with the SHA-256 computed while it arrived.
    pub files: Vec<FileEntry>,
}

impl DownloadRecord {
    /// `Ok(None)` when the directory has no record.
    pub fn read(dir: &Path) -> Result<Option<DownloadRecord>> {
        let path = dir.join(DOWNLOAD_FILE);
        let text = match std::fs::read_to_string(&path) {
            Ok(t) => t,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(e).with_context(|| format!("{}: cannot read", path.display())),
        };
        let r: DownloadRecord =
            serde_json::from_str(&text).with_context(|| format!("{}: not a download record", path.display()))?;
        if r.format != RECORD_FORMAT {
            bail!("{}: format '{}', expected '{RECORD_FORMAT}'", path.display(), r.format);
        }
        Ok(Some(r))
    }

    pub fn write(&self, dir: &Path) -> Result<()> {
        let text = serde_json::to_string_pretty(self).expect("record serializes") + "\n";
        forge_core::fsutil::write_atomic(&dir.join(DOWNLOAD_FILE), text.as_bytes())
    }
}

pub fn now_rfc3339() -> String {
    rfc3339(SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs()))
}

/// Seconds since the epoch as `YYYY-MM-DDTHH:MM:SSZ` (days to civil date after Howard Hinnant).
pub fn rfc3339(secs: u64) -> String {
    let days = (secs / 86_400) as i64;
    let rem = secs % 86_400;
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1_460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!("{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}Z", rem / 3600, rem / 60 % 60, rem % 60)
}

#[cfg(test)]
mod tests {
    #[test]
    fn formats_dates() {
        assert_eq!(super::rfc3339(0), "1970-01-01T00:00:00Z");
        assert_eq!(super::rfc3339(951_782_400), "2000-02-29T00:00:00Z");
        assert_eq!(super::rfc3339(1_700_000_000), "2023-11-14T22:13:20Z");
    }
}
