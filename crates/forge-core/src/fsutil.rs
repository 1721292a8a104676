//! File helpers: atomic writes.

use anyhow::{Context, Result};
use std::io::Write;
use std::path::Path;

/// Write `data` to `path` through a temporary file in the same directory and a rename, so a
/// crash never leaves a partial file under the final name.
pub fn write_atomic(path: &Path, data: &[u8]) -> Result<()> {
    // Devices and pipes (e.g. /dev/null, /dev/stdout) are written in place: renaming over them
    // would replace the device with a regular file.
    if let Ok(m) = std::fs::metadata(path) {
        if !m.is_file() && !m.is_dir() {
            return std::fs::write(path, data).with_context(|| format!("{}: write failed", path.display()));
        }
    }
    let dir = path.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
    let name = path.file_name().map(|n| n.to_string_lossy().to_string()).unwrap_or_default();
    let tmp = dir.join(format!(".{name}.{}.tmp", std::process::id()));
    let result = (|| -> Result<()> {
        let mut f = std::fs::File::create(&tmp).with_context(|| format!("{}: cannot create", tmp.display()))?;
        f.write_all(data).with_context(|| format!("{}: write failed", tmp.display()))?;
        f.sync_all().ok();
        std::fs::rename(&tmp, path).with_context(|| format!("{}: cannot rename into place", path.display()))
    })();
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    result
}

/// Like [`write_atomic`], for data too large to hold in memory: `fill` streams the contents into
/// a buffered temporary file in the same directory, which is synced and renamed into place only
/// when `fill` succeeds (on error the temporary file is removed).
pub fn write_atomic_with(path: &Path, fill: impl FnOnce(&mut dyn Write) -> Result<()>) -> Result<()> {
    let dir = path.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
    let name = path.file_name().map(|n| n.to_string_lossy().to_string()).unwrap_or_default();
    let tmp = dir.join(format!(".{name}.{}.tmp", std::process::id()));
    let result = (|| -> Result<()> {
        let f = std::fs::File::create(&tmp).with_context(|| format!("{}: cannot create", tmp.display()))?;
        let mut w = std::io::BufWriter::with_capacity(8 << 20, f);
        fill(&mut w)?;
        let f =
            w.into_inner().map_err(|e| e.into_error()).with_context(|| format!("{}: write failed", tmp.display()))?;
        f.sync_all().ok();
        std::fs::rename(&tmp, path).with_context(|| format!("{}: cannot rename into place", path.display()))
    })();
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    result
}
