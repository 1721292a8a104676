//! `forge check-update`: the local inventory against the remote one at the branch's current
//! commit.

use crate::client::{Client, RemoteFile, DEFAULT_ENDPOINT};
use crate::download::{selected, short, suggest_dir};
use crate::glob::Glob;
use crate::record::DownloadRecord;
use anyhow::{bail, Context, Result};
use forge_core::release::{self, FileEntry, Release, RELEASE_FILE};
use serde::Serialize;
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Duration;

/// Metadata files are fetched to compare them when their size is unchanged (the Hub lists no
/// hash for non-LFS files); larger ones are reported as changed.
const COMPARE_LIMIT: u64 = 64 << 20;

#[derive(Clone, Debug)]
pub struct CheckOptions {
    pub dir: PathBuf,
    /// Overrides the recorded endpoint.
    pub endpoint: Option<String>,
    /// When neither `endpoint` nor a record names one.
    pub default_endpoint: String,
    pub token: Option<String>,
    /// Required when the directory has no download record (only a release.json).
    pub repo: Option<String>,
    /// Default: the recorded requested revision, else `main`.
    pub revision: Option<String>,
    pub retries: u32,
    pub backoff: Duration,
}

impl CheckOptions {
    pub fn new(dir: impl Into<PathBuf>) -> CheckOptions {
        CheckOptions {
            dir: dir.into(),
            endpoint: None,
            default_endpoint: DEFAULT_ENDPOINT.to_string(),
            token: None,
            repo: None,
            revision: None,
            retries: 5,
            backoff: Duration::from_secs(1),
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum UpdateStatus {
    UpToDate,
    /// Only files other than weights: configs, tokenizers, chat templates, cards.
    MetadataChanged,
    WeightsChanged,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum ChangeKind {
    Added,
    Removed,
    Modified,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Change {
    pub path: String,
    pub change: ChangeKind,
    pub weights: bool,
}

#[derive(Clone, Debug, Serialize)]
pub struct UpdateReport {
    pub dir: String,
    pub endpoint: String,
    pub repo: String,
    pub revision: String,
    /// None when the directory has only a release.json.
    pub local_commit: Option<String>,
    pub remote_commit: String,
    /// The recorded download finished.
    pub local_complete: bool,
    pub status: UpdateStatus,
    pub changes: Vec<Change>,
    /// Downloads the new commit into a new directory; None when up to date.
    pub command: Option<String>,
}

/// Files whose change means new weights, not just new metadata.
pub fn is_weights(path: &str) -> bool {
    let ext = path.rsplit('/').next().unwrap_or(path).rsplit_once('.').map(|(_, e)| e.to_ascii_lowercase());
    matches!(ext.as_deref(), Some("safetensors" | "gguf" | "forgecache" | "bin"))
}

pub fn check_update(opts: &CheckOptions) -> Result<UpdateReport> {
    let dir = &opts.dir;
    if !dir.is_dir() {
        bail!("{}: not a directory", dir.display());
    }
    let record = DownloadRecord::read(dir)?;
    let (repo, revision, endpoint, include, local_commit, local_complete, local) = match &record {
        Some(r) => {
            if let Some(want) = opts.repo.as_deref().filter(|w| *w != r.repo) {
                bail!("{} was downloaded from {}, not {want}", dir.display(), r.repo);
            }
            let files: BTreeMap<String, FileEntry> = r.files.iter().map(|f| (f.path.clone(), f.clone())).collect();
            (
                r.repo.clone(),
                opts.revision.clone().unwrap_or_else(|| r.revision.clone()),
                opts.endpoint.clone().unwrap_or_else(|| r.endpoint.clone()),
                r.include.clone(),
                Some(r.commit.clone()),
                r.complete,
                files,
            )
        }
        None => {
            let Some(repo) = opts.repo.clone() else {
                bail!(
                    "{}: no {} (not made by forge download); pass --repo to compare its release.json with a repository",
                    dir.display(),
                    release::DOWNLOAD_FILE
                );
            };
            if !dir.join(RELEASE_FILE).is_file() {
                bail!("{}: neither {} nor {RELEASE_FILE}; nothing to compare", dir.display(), release::DOWNLOAD_FILE);
            }
            let rel = Release::read(dir)?;
            let mut files: BTreeMap<String, FileEntry> =
                rel.files.iter().map(|f| (f.path.clone(), f.clone())).collect();
            let own = dir.join(RELEASE_FILE);
            let size = std::fs::metadata(&own).with_context(|| format!("{}: cannot stat", own.display()))?.len();
            let sha256 = release::sha256_file(&own, &mut |_| {})?;
            files.insert(RELEASE_FILE.to_string(), FileEntry { path: RELEASE_FILE.to_string(), size, sha256 });
            (
                repo,
                opts.revision.clone().unwrap_or_else(|| "main".to_string()),
                opts.endpoint.clone().unwrap_or_else(|| opts.default_endpoint.clone()),
                Vec::new(),
                None,
                true,
                files,
            )
        }
    };
    crate::check_repo(&repo)?;
    crate::check_revision(&revision)?;
    let globs = include.iter().map(|g| Glob::new(g)).collect::<Result<Vec<_>>>()?;
    let client = Client::new(&endpoint, opts.token.as_deref(), opts.retries, opts.backoff)?;
    let note = |m: String| eprintln!("forge: {m}");
    let info = client.repo_info(&repo, &revision, &note)?;

    let mut changes = Vec::new();
    if local_commit.as_deref() != Some(info.commit.as_str()) {
        let remote: Vec<&RemoteFile> = info.files.iter().filter(|f| selected(&f.path, &globs)).collect();
        for r in &remote {
            let kind = match local.get(&r.path) {
                None => Some(ChangeKind::Added),
                Some(l) => differs(&client, &repo, &info.commit, r, l, &note)?.then_some(ChangeKind::Modified),
            };
            if let Some(change) = kind {
                changes.push(Change { path: r.path.clone(), change, weights: is_weights(&r.path) });
            }
        }
        // Files outside the selection were never asked for on either side.
        for path in local.keys().filter(|p| selected(p, &globs)) {
            if !remote.iter().any(|r| r.path == *path) {
                changes.push(Change { path: path.clone(), change: ChangeKind::Removed, weights: is_weights(path) });
            }
        }
        changes.sort_by(|a, b| a.path.cmp(&b.path));
    }
    let status = if changes.iter().any(|c| c.weights) {
        UpdateStatus::WeightsChanged
    } else if !changes.is_empty() {
        UpdateStatus::MetadataChanged
    } else {
        UpdateStatus::UpToDate
    };
    let command = (status != UpdateStatus::UpToDate).then(|| {
        let mut c = format!(
            "forge download {}@{} --dir {}",
            shell_quote(&repo),
            info.commit,
            shell_quote(&suggest_dir(dir, &info.commit))
        );
        for g in &include {
            c.push_str(&format!(" --include {}", shell_quote(g)));
        }
        if client.endpoint() != DEFAULT_ENDPOINT {
            c.push_str(&format!(" --endpoint {}", shell_quote(client.endpoint())));
        }
        c
    });
    Ok(UpdateReport {
        dir: dir.display().to_string(),
        endpoint: client.endpoint().to_string(),
        repo,
        revision,
        local_commit,
        remote_commit: info.commit,
        local_complete,
        status,
        changes,
        command,
    })
}

/// Sizes and the Hub's SHA-256 decide when they can; a small file of unchanged size and no
/// listed hash is fetched and hashed.
fn differs(
    client: &Client,
    repo: &str,
    commit: &str,
    r: &RemoteFile,
    l: &FileEntry,
    note: &dyn Fn(String),
) -> Result<bool> {
    if r.size.is_some_and(|s| s != l.size) {
        return Ok(true);
    }
    if let Some(h) = &r.sha256 {
        return Ok(*h != l.sha256);
    }
    if l.size > COMPARE_LIMIT {
        return Ok(true);
    }
    let body = client.fetch_small(repo, commit, &r.path, COMPARE_LIMIT, note)?;
    Ok(release::sha256_bytes(&body) != l.sha256)
}

fn shell_quote(s: &str) -> String {
    if !s.is_empty() && s.bytes().all(|b| b.is_ascii_alphanumeric() || b"@%+=:,./_-".contains(&b)) {
        s.to_string()
    } else {
        format!("'{}'", s.replace('\'', r"'\''"))
    }
}

impl UpdateReport {
    pub fn to_json(&self) -> String {
        serde_json::to_string_pretty(self).expect("report serializes") + "\n"
    }

    /// The report for a terminal.
    pub fn render(&self) -> String {
        let mut out = String::new();
        let local = self
            .local_commit
            .as_deref()
            .map_or_else(|| "its release.json".to_string(), |c| format!("commit {}", short(c)));
        out.push_str(&format!("{}: {} at {local} (revision '{}')\n", self.dir, self.repo, self.revision));
        if !self.local_complete {
            out.push_str("note: the local download is unfinished (rerun forge download to complete it)\n");
        }
        let remote = short(&self.remote_commit);
        match self.status {
            UpdateStatus::UpToDate if self.local_commit.as_deref() == Some(self.remote_commit.as_str()) => {
                out.push_str(&format!("up to date: '{}' is still at {remote}\n", self.revision));
            }
            UpdateStatus::UpToDate => {
                out.push_str(&format!("up to date: '{}' is at {remote}, with the same files\n", self.revision));
            }
            s => {
                let what = if s == UpdateStatus::WeightsChanged { "weights changed" } else { "only metadata changed" };
                out.push_str(&format!(
                    "update available: '{}' is at {remote}; {what} ({} file(s)):\n",
                    self.revision,
                    self.changes.len()
                ));
                for c in &self.changes {
                    let kind = match c.change {
                        ChangeKind::Added => "added",
                        ChangeKind::Removed => "removed",
                        ChangeKind::Modified => "modified",
                    };
                    out.push_str(&format!("  {kind:<9} {}{}\n", c.path, if c.weights { "  (weights)" } else { "" }));
                }
                if let Some(cmd) = &self.command {
                    out.push_str(&format!("to download it into a new directory:\n  {cmd}\n"));
                }
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn classifies_and_quotes() {
        assert!(super::is_weights("a/model-00001-of-00002.safetensors"));
        assert!(super::is_weights("m.GGUF"));
        assert!(super::is_weights("packed.forgecache"));
        assert!(!super::is_weights("model.safetensors.index.json"));
        assert!(!super::is_weights("tokenizer.json"));
        assert_eq!(super::shell_quote("org/m"), "org/m");
        assert_eq!(super::shell_quote("*.json"), "'*.json'");
        assert_eq!(super::shell_quote("it's"), r"'it'\''s'");
    }
}
