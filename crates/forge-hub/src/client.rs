//! The Hub's HTTP protocol: the revision API (`/api/models/{repo}/revision/{rev}?blobs=true`)
//! and resolve URLs (`/{repo}/resolve/{commit}/{path}`), with bounded retries.

use anyhow::{anyhow, bail, Context, Result};
use serde_json::Value;
use std::time::Duration;
use ureq::http::Response;
use ureq::Body;

pub const DEFAULT_ENDPOINT: &str = "https://huggingface.co";
/// A revision listing is a few hundred bytes per file; this bounds a hostile or broken server.
const API_LIMIT: u64 = 64 << 20;
/// Far above any real repository, low enough that a listing cannot exhaust memory or time.
pub const MAX_FILES: usize = 100_000;

/// One file of a revision as the Hub lists it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RemoteFile {
    /// Relative, `/`-separated, checked to stay inside a directory.
    pub path: String,
    pub size: Option<u64>,
    /// Lower-case hex SHA-256 of the contents: the Hub knows it for LFS files only.
    pub sha256: Option<String>,
}

/// A revision resolved to its commit, with its files.
#[derive(Clone, Debug)]
pub struct RepoInfo {
    pub commit: String,
    pub files: Vec<RemoteFile>,
}

/// Why an attempt failed, and whether trying again may help.
pub(crate) struct Fail {
    pub err: anyhow::Error,
    pub transient: bool,
    /// The attempt moved data forward, so the retry budget starts over.
    pub progressed: bool,
}

impl Fail {
    pub fn fatal(err: anyhow::Error) -> Fail {
        Fail { err, transient: false, progressed: false }
    }
    pub fn transient(err: anyhow::Error) -> Fail {
        Fail { err, transient: true, progressed: false }
    }
}

impl From<anyhow::Error> for Fail {
    fn from(err: anyhow::Error) -> Fail {
        Fail::fatal(err)
    }
}

/// What a request was for, so that an HTTP error names the repository, revision or file.
pub(crate) enum Target<'a> {
    Revision { repo: &'a str, rev: &'a str },
    File { repo: &'a str, commit: &'a str, path: &'a str },
}

#[derive(Clone)]
pub struct Client {
    agent: ureq::Agent,
    endpoint: String,
    token: Option<String>,
    retries: u32,
    backoff: Duration,
}

impl Client {
    /// `retries`: further attempts after a connection error or a 5xx, with `backoff` doubling
    /// between them (capped at 30 s).
    pub fn new(endpoint: &str, token: Option<&str>, retries: u32, backoff: Duration) -> Result<Client> {
        let endpoint = normalize_endpoint(endpoint)?;
        let mut cfg = ureq::Agent::config_builder()
            .http_status_as_error(false)
            .user_agent(format!("forge/{}", env!("CARGO_PKG_VERSION")))
            .redirect_auth_headers(ureq::config::RedirectAuthHeaders::SameHost)
            .max_redirects(10)
            .timeout_connect(Some(Duration::from_secs(30)))
            .timeout_recv_response(Some(Duration::from_secs(120)))
            .timeout_per_read(Some(Duration::from_secs(120)));
        if is_loopback(&endpoint) {
            // A proxy from the environment cannot reach this machine's loopback.
            cfg = cfg.proxy(None);
        }
        let token = token.map(str::trim).filter(|t| !t.is_empty()).map(str::to_string);
        Ok(Client { agent: cfg.build().into(), endpoint, token, retries, backoff })
    }

    pub fn endpoint(&self) -> &str {
        &self.endpoint
    }

    pub fn has_token(&self) -> bool {
        self.token.is_some()
    }

    /// Resolve `rev` (branch, tag or commit) and list the commit's files with sizes and hashes.
    pub fn repo_info(&self, repo: &str, rev: &str, note: &dyn Fn(String)) -> Result<RepoInfo> {
        let url = format!("{}/api/models/{}/revision/{}?blobs=true", self.endpoint, encode_path(repo), encode(rev));
        let target = Target::Revision { repo, rev };
        self.retry(note, &format!("{repo}@{rev}"), &mut || {
            let mut resp = self.get(&url, None)?;
            if resp.status().as_u16() != 200 {
                return Err(self.status_fail(&resp, &target, &url));
            }
            let body = resp.body_mut().with_config().limit(API_LIMIT).read_to_vec().map_err(|e| match e {
                ureq::Error::BodyExceedsLimit(_) => {
                    Fail::fatal(anyhow!("{url}: the revision listing is larger than {} MiB", API_LIMIT >> 20))
                }
                e => transport_fail(e, &url),
            })?;
            parse_repo_info(&body).with_context(|| format!("{url}: not a revision listing")).map_err(Fail::fatal)
        })
    }

    /// A whole small file at a commit (at most `limit` bytes).
    pub fn fetch_small(
        &self,
        repo: &str,
        commit: &str,
        path: &str,
        limit: u64,
        note: &dyn Fn(String),
    ) -> Result<Vec<u8>> {
        let url = self.resolve_url(repo, commit, path);
        let target = Target::File { repo, commit, path };
        self.retry(note, path, &mut || {
            let mut resp = self.get(&url, None)?;
            if resp.status().as_u16() != 200 {
                return Err(self.status_fail(&resp, &target, &url));
            }
            resp.body_mut().with_config().limit(limit).read_to_vec().map_err(|e| match e {
                ureq::Error::BodyExceedsLimit(_) => Fail::fatal(anyhow!("{url}: larger than {limit} bytes")),
                e => transport_fail(e, &url),
            })
        })
    }

    /// The file's URL, pinned to a commit so that a branch moving mid-download cannot mix
    /// revisions.
    pub(crate) fn resolve_url(&self, repo: &str, commit: &str, path: &str) -> String {
        format!("{}/{}/resolve/{}/{}", self.endpoint, encode_path(repo), encode(commit), encode_path(path))
    }

    pub(crate) fn get(&self, url: &str, range_from: Option<u64>) -> Result<Response<Body>, Fail> {
        let mut req = self.agent.get(url);
        if let Some(t) = &self.token {
            req = req.header("Authorization", format!("Bearer {t}"));
        }
        if let Some(n) = range_from {
            req = req.header("Range", format!("bytes={n}-"));
        }
        req.call().map_err(|e| transport_fail(e, url))
    }

    /// Run `attempt` until it succeeds, fails for good, or fails `retries + 1` times in a row
    /// without moving data forward.
    pub(crate) fn retry<T>(
        &self,
        note: &dyn Fn(String),
        what: &str,
        attempt: &mut dyn FnMut() -> Result<T, Fail>,
    ) -> Result<T> {
        let mut failures = 0u32;
        loop {
            match attempt() {
                Ok(v) => return Ok(v),
                Err(f) => {
                    if f.progressed {
                        failures = 0;
                    }
                    if !f.transient {
                        return Err(f.err);
                    }
                    if failures >= self.retries {
                        let tries = if failures > 0 {
                            format!(" (gave up after {} attempts)", failures + 1)
                        } else {
                            String::new()
                        };
                        return Err(f.err.context(format!("{what}{tries}")));
                    }
                    failures += 1;
                    let wait = self.backoff.saturating_mul(1 << (failures - 1).min(16)).min(Duration::from_secs(30));
                    note(format!(
                        "{what}: {:#}; retrying in {:.1} s ({failures}/{})",
                        f.err,
                        wait.as_secs_f64(),
                        self.retries
                    ));
                    std::thread::sleep(wait);
                }
            }
        }
    }

    pub(crate) fn status_fail(&self, resp: &Response<Body>, target: &Target, url: &str) -> Fail {
        let status = resp.status().as_u16();
        let header = |name: &str| resp.headers().get(name).and_then(|v| v.to_str().ok()).map(sanitize);
        let code = header("x-error-code").unwrap_or_default();
        let detail = header("x-error-message").map(|m| format!(": {m}")).unwrap_or_default();
        let ep = &self.endpoint;
        let token_hint = if self.token.is_some() {
            "HF_TOKEN was sent and not accepted: check that it is valid and can read this repository"
        } else {
            "if the repository is private or gated, set HF_TOKEN to a token that can read it"
        };
        let msg = match (status, target) {
            (401, Target::Revision { repo, .. }) | (401, Target::File { repo, .. }) => {
                format!("repository '{repo}' at {ep}: not found or not accessible (HTTP 401{detail}); {token_hint}")
            }
            (403, Target::Revision { repo, .. }) | (403, Target::File { repo, .. }) => format!(
                "repository '{repo}' at {ep}: access forbidden (HTTP 403{detail}); a gated repository needs its terms \
                 accepted on the hub and HF_TOKEN set to a token of that account"
            ),
            (404, Target::Revision { repo, rev }) => match code.as_str() {
                "RevisionNotFound" => {
                    format!("revision '{rev}' not found in repository '{repo}' at {ep} (HTTP 404{detail})")
                }
                "RepoNotFound" => format!("repository '{repo}' not found at {ep} (HTTP 404{detail}); {token_hint}"),
                _ => format!("repository '{repo}' or its revision '{rev}' not found at {ep} (HTTP 404{detail})"),
            },
            (404, Target::File { repo, commit, path }) => {
                format!("file '{path}' not found in repository '{repo}' at commit {commit} (HTTP 404{detail})")
            }
            _ => format!("{url}: HTTP {status}{detail}"),
        };
        let err = anyhow!(msg);
        if status >= 500 || status == 429 || status == 408 {
            Fail::transient(err)
        } else {
            Fail::fatal(err)
        }
    }
}

pub(crate) fn transport_fail(e: ureq::Error, url: &str) -> Fail {
    // Name resolution fails as an I/O error; only a temporary failure is worth waiting for.
    let text = e.to_string();
    if text.contains("failed to lookup address") && !text.contains("Temporary failure") {
        return Fail::fatal(anyhow!("{url}: cannot resolve the host name ({text})"));
    }
    match e {
        ureq::Error::Io(_) | ureq::Error::Timeout(_) | ureq::Error::ConnectionFailed | ureq::Error::Protocol(_) => {
            Fail::transient(anyhow!("{url}: {e}"))
        }
        ureq::Error::HostNotFound => Fail::fatal(anyhow!("{url}: cannot resolve the host name")),
        e => Fail::fatal(anyhow!("{url}: {e}")),
    }
}

/// Server-provided text for an error message: one line, printable, short.
fn sanitize(s: &str) -> String {
    let t: String = s.chars().map(|c| if c.is_control() { ' ' } else { c }).take(200).collect();
    t.trim().to_string()
}

fn normalize_endpoint(e: &str) -> Result<String> {
    let e = e.trim().trim_end_matches('/');
    let rest = e.strip_prefix("https://").or_else(|| e.strip_prefix("http://"));
    match rest {
        Some(r) if !r.is_empty() && !r.starts_with('/') && !r.chars().any(|c| c.is_whitespace() || c.is_control()) => {
            Ok(e.to_string())
        }
        _ => bail!("endpoint '{e}': expected an http:// or https:// URL"),
    }
}

fn is_loopback(endpoint: &str) -> bool {
    let rest = endpoint.split_once("://").map_or(endpoint, |(_, r)| r);
    let authority = rest.split('/').next().unwrap_or("");
    let host = authority.rsplit_once('@').map_or(authority, |(_, h)| h);
    let host = if host.starts_with('[') {
        host.split(']').next().unwrap_or("").trim_start_matches('[')
    } else {
        host.split(':').next().unwrap_or("")
    };
    host.eq_ignore_ascii_case("localhost") || host.parse::<std::net::IpAddr>().is_ok_and(|ip| ip.is_loopback())
}

/// Percent-encode one URL path segment (revision names like `refs/pr/1` included).
pub(crate) fn encode(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_' | b'~') {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// Percent-encode each `/`-separated segment.
pub(crate) fn encode_path(s: &str) -> String {
    s.split('/').map(encode).collect::<Vec<_>>().join("/")
}

/// A path from the server, before it names anything on disk: relative, no `.` or `..`
/// components, no backslashes or control characters, bounded length and depth.
pub fn check_remote_path(p: &str) -> Result<()> {
    let bad = p.is_empty()
        || p.len() > 1024
        || p.starts_with('/')
        || p.contains('\\')
        || p.chars().any(|c| c.is_control())
        || p.split('/').count() > 32
        || p.split('/').any(|c| c.is_empty() || c == "." || c == "..");
    if bad {
        bail!("the hub lists '{}', which is not a relative path inside the directory", sanitize(p));
    }
    Ok(())
}

/// Commit ids are hex; checking it keeps them safe in URLs, paths and messages.
pub fn check_commit(c: &str) -> Result<()> {
    if !(7..=128).contains(&c.len()) || !c.bytes().all(|b| b.is_ascii_hexdigit()) {
        bail!("the hub returned '{}' as the commit, which is not a hex commit id", sanitize(c));
    }
    Ok(())
}

fn parse_sha256(v: &Value) -> Option<String> {
    let s = v.get("sha256").or_else(|| v.get("oid"))?.as_str()?;
    let s = s.strip_prefix("sha256:").unwrap_or(s);
    (s.len() == 64 && s.bytes().all(|b| b.is_ascii_hexdigit())).then(|| s.to_ascii_lowercase())
}

pub(crate) fn parse_repo_info(body: &[u8]) -> Result<RepoInfo> {
    let v: Value = serde_json::from_slice(body).context("malformed JSON")?;
    let commit = v.get("sha").and_then(Value::as_str).context("no 'sha' (the resolved commit)")?.to_string();
    check_commit(&commit)?;
    let siblings = v.get("siblings").and_then(Value::as_array).context("no 'siblings' (the file list)")?;
    if siblings.len() > MAX_FILES {
        bail!("{} files listed, more than the {MAX_FILES} accepted", siblings.len());
    }
    let mut seen = std::collections::HashSet::new();
    let mut files = Vec::with_capacity(siblings.len());
    for (i, s) in siblings.iter().enumerate() {
        let path =
            s.get("rfilename").and_then(Value::as_str).with_context(|| format!("siblings[{i}]: no 'rfilename'"))?;
        check_remote_path(path)?;
        if !seen.insert(path) {
            bail!("'{path}' listed twice");
        }
        let lfs = s.get("lfs").filter(|l| l.is_object());
        let sha256 = match lfs {
            Some(l) => Some(parse_sha256(l).with_context(|| format!("'{path}': LFS entry without a SHA-256"))?),
            None => None,
        };
        // For LFS files the pointer's `size` is the real file's.
        let size =
            lfs.and_then(|l| l.get("size")).and_then(Value::as_u64).or_else(|| s.get("size").and_then(Value::as_u64));
        files.push(RemoteFile { path: path.to_string(), size, sha256 });
    }
    files.sort_by(|a, b| a.path.cmp(&b.path));
    Ok(RepoInfo { commit, files })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_a_listing() {
        let body = br#"{"id":"o/m","sha":"0123456789abcdef0123456789abcdef01234567","siblings":[
            {"rfilename":"config.json","size":12,"blobId":"aa"},
            {"rfilename":"w/model.safetensors","size":99,"blobId":"bb",
             "lfs":{"sha256":"ABCDEF0123456789abcdef0123456789abcdef0123456789abcdef0123456789","size":99,"pointerSize":134}},
            {"rfilename":"x.bin","lfs":{"oid":"sha256:abcdef0123456789abcdef0123456789abcdef0123456789abcdef0123456789","size":7}}]}"#;
        let r = parse_repo_info(body).unwrap();
        assert_eq!(r.commit, "0123456789abcdef0123456789abcdef01234567");
        assert_eq!(r.files[0], RemoteFile { path: "config.json".into(), size: Some(12), sha256: None });
        assert_eq!(
            r.files[1].sha256.as_deref(),
            Some("abcdef0123456789abcdef0123456789abcdef0123456789abcdef0123456789")
        );
        assert_eq!(r.files[2].size, Some(7));
        assert!(r.files[2].sha256.is_some());
    }

    #[test]
    fn refuses_paths_outside() {
        for p in ["../x", "/etc/passwd", "a/../../b", "a//b", "a\\b", "./a", ""] {
            let body = format!(r#"{{"sha":"0123456789abcdef","siblings":[{{"rfilename":{}}}]}}"#, serde_json::json!(p));
            assert!(parse_repo_info(body.as_bytes()).is_err(), "{p}");
        }
        let body = br#"{"sha":"../../x","siblings":[]}"#;
        assert!(parse_repo_info(body).is_err());
    }

    #[test]
    fn encodes_and_detects_loopback() {
        assert_eq!(encode("refs/pr/1"), "refs%2Fpr%2F1");
        assert_eq!(encode_path("org/my model"), "org/my%20model");
        assert!(is_loopback("http://127.0.0.1:8080"));
        assert!(is_loopback("http://localhost"));
        assert!(is_loopback("http://[::1]:9/x"));
        assert!(!is_loopback("https://huggingface.co"));
        assert!(normalize_endpoint("ftp://x").is_err());
        assert_eq!(normalize_endpoint("https://hf.co/").unwrap(), "https://hf.co");
    }
}
