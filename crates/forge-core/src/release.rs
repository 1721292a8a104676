//! Bundles: a directory whose `release.json` lists every file with its size and SHA-256, the
//! model's identity and the target/drafter pairing (the inventory of ANEMLL Forge's release
//! bundles). Verification reports missing, extra and altered files; a full verification is
//! recorded in `.verified.json` (each file's size and modification time) so that later loads
//! hash nothing while those are unchanged.

use anyhow::{bail, Context, Result};
use serde::{Deserialize, Serialize};
use serde_json::Value;
use sha2::{Digest, Sha256};
use std::collections::BTreeMap;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::time::UNIX_EPOCH;

/// The inventory's file name at the bundle's root.
pub const RELEASE_FILE: &str = "release.json";
/// The record of the last full verification.
pub const VERIFIED_FILE: &str = ".verified.json";
/// What `forge download` records about where a directory came from.
pub const DOWNLOAD_FILE: &str = ".forge-download.json";
/// The value of `format` in every release.json Forge writes or reads.
pub const FORMAT: &str = "forge-release/1";

/// Files at the bundle's root that are not part of the inventory.
pub fn is_bookkeeping(rel: &str) -> bool {
    rel == RELEASE_FILE || rel == VERIFIED_FILE || rel == DOWNLOAD_FILE || rel.starts_with(".forge-partial/")
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct FileEntry {
    /// Relative to the bundle's root, `/`-separated.
    pub path: String,
    pub size: u64,
    /// Lower-case hex.
    pub sha256: String,
}

/// `release.json`. Fields Forge does not interpret (`model`, `drafter`, `quality`) are kept as
/// JSON values so that a newer writer's additions survive a read and write.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Release {
    pub format: String,
    pub forge_version: String,
    /// Short name of the bundle (directory name by default).
    pub name: String,
    /// Directory of the target model, relative to the root (an export or a checkpoint).
    pub model: String,
    /// Directory of the drafter, when the bundle pairs one with the target.
    #[serde(default)]
    pub drafter: Option<String>,
    /// The model's identity: source checkpoint and its hash, recipe, seed.
    #[serde(default)]
    pub identity: Value,
    /// Target/drafter pairing: tokenizer hash both share, drafter identity.
    #[serde(default)]
    pub pairing: Value,
    /// Quality report (KL, top-1, perplexity and the protocol), when measured.
    #[serde(default)]
    pub quality: Value,
    pub files: Vec<FileEntry>,
}

impl Release {
    /// Read and check `DIR/release.json`: the format, and every path relative and inside.
    pub fn read(dir: &Path) -> Result<Release> {
        let path = dir.join(RELEASE_FILE);
        let text = std::fs::read_to_string(&path).with_context(|| format!("{}: cannot read", path.display()))?;
        Self::parse(&text).with_context(|| format!("{}: not a valid release inventory", path.display()))
    }

    pub fn parse(text: &str) -> Result<Release> {
        let r: Release = serde_json::from_str(text).context("malformed JSON or a missing field")?;
        if r.format != FORMAT {
            bail!("field 'format' is '{}', expected '{FORMAT}'", r.format);
        }
        check_rel("model", &r.model)?;
        if let Some(d) = &r.drafter {
            check_rel("drafter", d)?;
        }
        let mut seen = std::collections::HashSet::new();
        for (i, f) in r.files.iter().enumerate() {
            check_rel(&format!("files[{i}].path"), &f.path)?;
            if is_bookkeeping(&f.path) {
                bail!("field 'files[{i}].path': '{}' is reserved", f.path);
            }
            if f.sha256.len() != 64 || !f.sha256.bytes().all(|b| b.is_ascii_hexdigit()) {
                bail!("field 'files[{i}].sha256' of '{}': not 64 hex digits", f.path);
            }
            if !seen.insert(f.path.as_str()) {
                bail!("field 'files[{i}].path': '{}' listed twice", f.path);
            }
        }
        Ok(r)
    }

    pub fn to_json(&self) -> String {
        serde_json::to_string_pretty(self).expect("release serializes") + "\n"
    }

    /// Total bytes of the listed files.
    pub fn total_bytes(&self) -> u64 {
        self.files.iter().map(|f| f.size).sum()
    }
}

/// A relative `/`-separated path that stays inside the bundle.
fn check_rel(field: &str, p: &str) -> Result<()> {
    let bad = p.is_empty()
        || p.starts_with('/')
        || p.contains('\\')
        || p.contains('\0')
        || p.split('/').any(|c| c.is_empty() || c == "." || c == "..");
    if bad && p != "." {
        bail!("field '{field}': '{p}' is not a relative path inside the bundle");
    }
    Ok(())
}

/// SHA-256 of a file, streamed; `progress` gets the bytes read as they are read.
pub fn sha256_file(path: &Path, progress: &mut dyn FnMut(u64)) -> Result<String> {
    let mut f = std::fs::File::open(path).with_context(|| format!("{}: cannot open", path.display()))?;
    let mut h = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = f.read(&mut buf).with_context(|| format!("{}: read failed", path.display()))?;
        if n == 0 {
            break;
        }
        h.update(&buf[..n]);
        progress(n as u64);
    }
    Ok(hex(&h.finalize()))
}

pub fn sha256_bytes(data: &[u8]) -> String {
    hex(&Sha256::digest(data))
}

fn hex(d: &[u8]) -> String {
    d.iter().map(|b| format!("{b:02x}")).collect()
}

/// Every regular file under `dir` (symbolic links followed), relative `/`-separated paths,
/// sorted, bookkeeping files left out.
pub fn list_files(dir: &Path) -> Result<Vec<String>> {
    fn walk(root: &Path, d: &Path, out: &mut Vec<String>, depth: usize) -> Result<()> {
        if depth > 32 {
            bail!("{}: directories nested more than 32 deep", d.display());
        }
        for e in std::fs::read_dir(d).with_context(|| format!("{}: cannot list", d.display()))? {
            let p = e.with_context(|| format!("{}: cannot list", d.display()))?.path();
            let m = std::fs::metadata(&p).with_context(|| format!("{}: cannot stat", p.display()))?;
            if m.is_dir() {
                walk(root, &p, out, depth + 1)?;
            } else {
                let rel = p.strip_prefix(root).expect("under root");
                let rel: Vec<String> = rel.components().map(|c| c.as_os_str().to_string_lossy().into_owned()).collect();
                out.push(rel.join("/"));
            }
        }
        Ok(())
    }
    let mut out = Vec::new();
    walk(dir, dir, &mut out, 0)?;
    out.retain(|p| !is_bookkeeping(p));
    out.sort();
    Ok(out)
}

/// Inventory entries for the given files of `dir` (hashing each; `progress` gets bytes read).
pub fn inventory(dir: &Path, files: &[String], progress: &mut dyn FnMut(u64)) -> Result<Vec<FileEntry>> {
    files
        .iter()
        .map(|rel| {
            let p = dir.join(rel);
            let size = std::fs::metadata(&p).with_context(|| format!("{}: cannot stat", p.display()))?.len();
            Ok(FileEntry { path: rel.clone(), size, sha256: sha256_file(&p, progress)? })
        })
        .collect()
}

/// What a verification found. Empty lists: the bundle is intact.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct Report {
    pub missing: Vec<String>,
    pub extra: Vec<String>,
    /// (path, size in the inventory, size on disk)
    pub wrong_size: Vec<(String, u64, u64)>,
    /// Same size, different SHA-256 (only a full verification finds these).
    pub altered: Vec<String>,
    /// Whether every hash was checked (or trusted from an unchanged earlier full check).
    pub hashed: bool,
}

impl Report {
    pub fn ok(&self) -> bool {
        self.missing.is_empty() && self.extra.is_empty() && self.wrong_size.is_empty() && self.altered.is_empty()
    }

    /// One line per problem, each naming the file.
    pub fn problems(&self, dir: &Path) -> Vec<String> {
        let d = |p: &str| dir.join(p).display().to_string();
        let mut v = Vec::new();
        v.extend(self.missing.iter().map(|p| format!("{}: missing", d(p))));
        v.extend(
            self.wrong_size.iter().map(|(p, want, got)| format!("{}: {got} bytes, the inventory says {want}", d(p))),
        );
        v.extend(self.altered.iter().map(|p| format!("{}: altered (SHA-256 differs from the inventory)", d(p))));
        v.extend(self.extra.iter().map(|p| format!("{}: not in the inventory", d(p))));
        v
    }
}

/// How much to check.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Depth {
    /// Presence and sizes.
    Sizes,
    /// Every byte, unless `.verified.json` shows an earlier full check of these exact files.
    Trusted,
    /// Every byte, always.
    Full,
}

/// Check `dir` against its inventory. `progress(bytes)` follows the hashing.
pub fn verify(dir: &Path, rel: &Release, depth: Depth, progress: &mut dyn FnMut(u64)) -> Result<Report> {
    let on_disk = list_files(dir)?;
    let listed: std::collections::BTreeSet<&str> = rel.files.iter().map(|f| f.path.as_str()).collect();
    let mut r = Report {
        extra: on_disk.iter().filter(|p| !listed.contains(p.as_str())).cloned().collect(),
        ..Default::default()
    };
    let present: std::collections::BTreeSet<&str> = on_disk.iter().map(|s| s.as_str()).collect();
    let mut stats = BTreeMap::new();
    for f in &rel.files {
        if !present.contains(f.path.as_str()) {
            r.missing.push(f.path.clone());
            continue;
        }
        let st = Stat::of(&dir.join(&f.path))?;
        if st.size != f.size {
            r.wrong_size.push((f.path.clone(), f.size, st.size));
        }
        stats.insert(f.path.clone(), st);
    }
    if !r.ok() || depth == Depth::Sizes {
        return Ok(r);
    }
    let release_sha = sha256_file(&dir.join(RELEASE_FILE), &mut |_| {})?;
    if depth == Depth::Trusted
        && Verified::read(dir).is_some_and(|v| v.release_sha256 == release_sha && v.files == stats)
    {
        r.hashed = true;
        return Ok(r);
    }
    for f in &rel.files {
        if sha256_file(&dir.join(&f.path), progress)? != f.sha256 {
            r.altered.push(f.path.clone());
        }
    }
    r.hashed = true;
    if r.ok() {
        // A read-only bundle is verified again next time; that is all a failed record costs.
        let _ = Verified { release_sha256: release_sha, files: stats }.write(dir);
    }
    Ok(r)
}

/// Record `dir` as fully verified against `rel` without hashing again (its files were hashed
/// as the inventory was made).
pub fn mark_verified(dir: &Path, rel: &Release) -> Result<()> {
    let mut files = BTreeMap::new();
    for f in &rel.files {
        files.insert(f.path.clone(), Stat::of(&dir.join(&f.path))?);
    }
    Verified { release_sha256: sha256_file(&dir.join(RELEASE_FILE), &mut |_| {})?, files }.write(dir)
}

/// A file's size and modification time, as recorded after a full verification.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Stat {
    pub size: u64,
    pub mtime_ns: u128,
}

impl Stat {
    pub fn of(p: &Path) -> Result<Stat> {
        let m = std::fs::metadata(p).with_context(|| format!("{}: cannot stat", p.display()))?;
        let mtime_ns = m.modified().ok().and_then(|t| t.duration_since(UNIX_EPOCH).ok()).map_or(0, |d| d.as_nanos());
        Ok(Stat { size: m.len(), mtime_ns })
    }
}

/// `.verified.json`: the inventory's hash and every file's size and modification time at the
/// last full verification that passed.
#[derive(Debug, Serialize, Deserialize)]
struct Verified {
    release_sha256: String,
    files: BTreeMap<String, Stat>,
}

impl Verified {
    fn read(dir: &Path) -> Option<Verified> {
        serde_json::from_slice(&std::fs::read(dir.join(VERIFIED_FILE)).ok()?).ok()
    }

    fn write(&self, dir: &Path) -> Result<()> {
        crate::fsutil::write_atomic(&dir.join(VERIFIED_FILE), serde_json::to_string(self)?.as_bytes())
    }
}

/// Whether `dir` is a bundle (has a release.json).
pub fn is_bundle(dir: &Path) -> bool {
    dir.is_dir() && dir.join(RELEASE_FILE).is_file()
}

/// The target model inside a bundle, after checking the bundle (unless `check` is false):
/// a tampered bundle is an error naming each problem file.
pub fn open_model(dir: &Path, check: bool) -> Result<PathBuf> {
    let rel = Release::read(dir)?;
    if check {
        let total = rel.total_bytes();
        let trusted = Verified::read(dir).is_some();
        if !trusted && total > (256 << 20) {
            eprintln!(
                "forge: verifying bundle {} ({:.1} GB, once; --no-verify skips)",
                dir.display(),
                total as f64 / 1e9
            );
        }
        let r = verify(dir, &rel, Depth::Trusted, &mut |_| {})?;
        if !r.ok() {
            let problems = r.problems(dir);
            bail!(
                "bundle {} fails verification ({} problem(s)):\n  {}\n(`forge verify {}` for the full report; --no-verify loads it anyway)",
                dir.display(),
                problems.len(),
                problems.join("\n  "),
                dir.display()
            );
        }
    }
    let model = dir.join(&rel.model);
    if !model.exists() {
        bail!("{}: field 'model' names '{}', which does not exist", dir.join(RELEASE_FILE).display(), rel.model);
    }
    Ok(model)
}

/// The drafter paired in a bundle, if any (the bundle itself checked by [`open_model`]).
pub fn drafter_of(dir: &Path) -> Result<Option<PathBuf>> {
    Ok(Release::read(dir)?.drafter.map(|d| dir.join(d)))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn release(files: &str) -> String {
        format!(r#"{{"format":"{FORMAT}","forge_version":"0","name":"b","model":"model","files":[{files}]}}"#)
    }

    const H: &str = "0000000000000000000000000000000000000000000000000000000000000000";

    #[test]
    fn paths_must_stay_inside_the_bundle() {
        for p in ["../x", "/etc/passwd", "a/../b", "a//b", "./a", "a\\\\b", ""] {
            let t = release(&format!(r#"{{"path":"{p}","size":1,"sha256":"{H}"}}"#));
            let e = Release::parse(&t).unwrap_err().to_string();
            assert!(e.contains("files[0].path"), "{p}: {e}");
        }
        assert!(Release::parse(&release(&format!(r#"{{"path":"model/a.bin","size":1,"sha256":"{H}"}}"#))).is_ok());
    }

    #[test]
    fn hashes_duplicates_reserved_names_and_the_format_are_checked() {
        let bad_hash = release(r#"{"path":"a","size":1,"sha256":"xyz"}"#);
        assert!(Release::parse(&bad_hash).unwrap_err().to_string().contains("sha256"));
        let dup = release(&format!(r#"{{"path":"a","size":1,"sha256":"{H}"}},{{"path":"a","size":1,"sha256":"{H}"}}"#));
        assert!(Release::parse(&dup).unwrap_err().to_string().contains("twice"));
        let reserved = release(&format!(r#"{{"path":"{VERIFIED_FILE}","size":1,"sha256":"{H}"}}"#));
        assert!(Release::parse(&reserved).unwrap_err().to_string().contains("reserved"));
        let fmt = release("").replace(FORMAT, "other/1");
        assert!(Release::parse(&fmt).unwrap_err().to_string().contains("format"));
    }

    #[test]
    fn sha256_matches_the_published_test_vector() {
        // FIPS 180-2, "abc".
        assert_eq!(sha256_bytes(b"abc"), "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
    }
}
