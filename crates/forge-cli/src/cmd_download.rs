//! `forge download` and `forge check-update`: flags to forge_hub options.

use anyhow::Result;
use std::path::PathBuf;
use std::time::Duration;

#[derive(clap::Args)]
pub struct DownloadArgs {
    /// Repository, optionally at a revision: `org/name`, `org/name@BRANCH`, `@TAG` or `@COMMIT`
    /// (default branch: main). Files are fetched at the commit the revision resolves to.
    pub repo: String,
    /// Directory to download into (created if missing).
    #[arg(long)]
    pub dir: PathBuf,
    /// Only files matching this glob (repeatable): `*` and `?` within a path component, `**`
    /// across directories, a directory name for everything under it.
    #[arg(long = "include", value_name = "GLOB")]
    pub include: Vec<String>,
    /// Hub URL (default: $HF_ENDPOINT, else https://huggingface.co). $HF_TOKEN, when set, is
    /// sent as a bearer token.
    #[arg(long)]
    pub endpoint: Option<String>,
    /// Files transferred at once.
    #[arg(long, default_value_t = 4)]
    pub jobs: usize,
    /// Retries per file after a connection error or a server error (waits 1 s, doubling).
    #[arg(long, default_value_t = 5)]
    pub retries: u32,
    /// Reuse a directory that holds another repository's or commit's download: files that
    /// match the new commit's hashes are kept, the rest fetched again.
    #[arg(long)]
    pub force: bool,
}

#[derive(clap::Args)]
pub struct CheckUpdateArgs {
    /// A directory made by `forge download` (or a bundle with a release.json, with --repo).
    pub dir: PathBuf,
    /// Print the report as JSON.
    #[arg(long)]
    pub json: bool,
    /// Repository to compare with (default: the one recorded by `forge download`).
    #[arg(long)]
    pub repo: Option<String>,
    /// Branch or tag to compare with (default: the revision the download asked for, else main).
    #[arg(long)]
    pub revision: Option<String>,
    /// Hub URL (default: the recorded one, else $HF_ENDPOINT, else https://huggingface.co).
    #[arg(long)]
    pub endpoint: Option<String>,
}

pub fn run_download(a: DownloadArgs) -> Result<()> {
    let (repo, rev) = forge_hub::parse_repo_arg(&a.repo)?;
    let rev = rev.unwrap_or_else(|| "main".to_string());
    let mut o = forge_hub::Options::new(&repo, &rev, &a.dir);
    o.endpoint = forge_hub::endpoint_from_env(a.endpoint.as_deref());
    o.token = forge_hub::token_from_env();
    o.include = a.include;
    o.jobs = a.jobs;
    o.retries = a.retries;
    o.force = a.force;
    o.progress = true;
    let s = forge_hub::download(&o)?;
    let mb = s.bytes as f64 / 1e6;
    println!(
        "{repo}@{rev} (commit {}) in {}: {} file(s) downloaded ({mb:.1} MB), {} already present{}",
        s.commit,
        a.dir.display(),
        s.downloaded,
        s.present,
        if s.bundle_verified { "; bundle verified against release.json" } else { "" }
    );
    Ok(())
}

pub fn run_check_update(a: CheckUpdateArgs) -> Result<()> {
    let mut o = forge_hub::CheckOptions::new(&a.dir);
    o.endpoint = a.endpoint;
    o.default_endpoint = forge_hub::endpoint_from_env(None);
    o.token = forge_hub::token_from_env();
    o.repo = a.repo;
    o.revision = a.revision;
    o.backoff = Duration::from_secs(1);
    let r = forge_hub::check_update(&o)?;
    if a.json {
        print!("{}", r.to_json());
    } else {
        print!("{}", r.render());
    }
    Ok(())
}
