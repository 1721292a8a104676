//! Downloads from the Hugging Face Hub or any server speaking its protocol: a revision resolved
//! to its commit and every file URL pinned to it, transfers resumed with HTTP ranges, each file
//! checked against the Hub's SHA-256 and size before it appears under its final name, and
//! bundles verified against their release.json. `check_update` compares a downloaded directory
//! with the commit its branch points to now.
//!
//! Blocking I/O on plain threads: a download is a handful of long transfers, which needs no
//! async runtime.

mod client;
mod download;
mod glob;
mod record;
mod update;

pub use client::{check_commit, check_remote_path, Client, RemoteFile, RepoInfo, DEFAULT_ENDPOINT, MAX_FILES};
pub use download::{download, Options, Summary, PARTIAL_DIR};
pub use glob::Glob;
pub use record::{DownloadRecord, RECORD_FORMAT};
pub use update::{check_update, is_weights, Change, ChangeKind, CheckOptions, UpdateReport, UpdateStatus};

use anyhow::{bail, Result};

/// `flag`, else `$HF_ENDPOINT`, else the Hugging Face Hub.
pub fn endpoint_from_env(flag: Option<&str>) -> String {
    flag.map(str::to_string)
        .or_else(|| std::env::var("HF_ENDPOINT").ok().filter(|e| !e.trim().is_empty()))
        .unwrap_or_else(|| DEFAULT_ENDPOINT.to_string())
}

/// `$HF_TOKEN`, when set and not empty.
pub fn token_from_env() -> Option<String> {
    std::env::var("HF_TOKEN").ok().map(|t| t.trim().to_string()).filter(|t| !t.is_empty())
}

/// `org/name[@revision]` into the repository and the revision, if one is given.
pub fn parse_repo_arg(s: &str) -> Result<(String, Option<String>)> {
    let (repo, rev) = match s.split_once('@') {
        Some((r, v)) => {
            if v.is_empty() {
                bail!("'{s}': nothing after '@' (expected REPO@BRANCH, REPO@TAG or REPO@COMMIT)");
            }
            (r, Some(v.to_string()))
        }
        None => (s, None),
    };
    check_repo(repo)?;
    if let Some(v) = &rev {
        check_revision(v)?;
    }
    Ok((repo.to_string(), rev))
}

/// `name` or `org/name`, each part letters, digits, `-`, `_` and `.`.
pub fn check_repo(repo: &str) -> Result<()> {
    let parts: Vec<&str> = repo.split('/').collect();
    let part_ok = |p: &&str| {
        !p.is_empty()
            && p.len() <= 96
            && !p.contains("..")
            && p.bytes().all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'))
            && !p.starts_with(['.', '-'])
    };
    if parts.len() > 2 || !parts.iter().all(part_ok) {
        bail!("'{repo}' is not a repository name (expected org/name)");
    }
    Ok(())
}

/// Any branch, tag or commit name: it travels percent-encoded.
pub fn check_revision(rev: &str) -> Result<()> {
    if rev.is_empty() || rev.len() > 256 || rev.chars().any(|c| c.is_control() || c.is_whitespace()) {
        bail!("'{rev}' is not a revision name");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_repo_arguments() {
        assert_eq!(parse_repo_arg("org/m").unwrap(), ("org/m".into(), None));
        assert_eq!(parse_repo_arg("org/m@v1.0").unwrap(), ("org/m".into(), Some("v1.0".into())));
        assert_eq!(parse_repo_arg("gpt2@refs/pr/1").unwrap(), ("gpt2".into(), Some("refs/pr/1".into())));
        for bad in ["org/m@", "a/b/c", "../x", "org/..", "", "org/ m", "/m"] {
            assert!(parse_repo_arg(bad).is_err(), "{bad}");
        }
    }
}
