//! `forge download`: a revision's files into a directory, each one complete and checked before
//! it appears under its final name.

use crate::client::{Client, Fail, RemoteFile, Target};
use crate::glob::{any_match, Glob};
use crate::record::{now_rfc3339, DownloadRecord, RECORD_FORMAT};
use anyhow::{anyhow, bail, Context, Result};
use forge_core::release::{self, Depth, FileEntry, Release, RELEASE_FILE};
use indicatif::{MultiProgress, ProgressBar, ProgressDrawTarget, ProgressStyle};
use sha2::{Digest, Sha256};
use std::collections::BTreeMap;
use std::fs::{File, OpenOptions};
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::Duration;

/// Where unfinished files live, inside the target directory so that the final rename never
/// crosses file systems.
pub const PARTIAL_DIR: &str = ".forge-partial";
/// Bounds a file whose size the Hub does not list.
const UNKNOWN_SIZE_LIMIT: u64 = 1 << 40;
/// release.json is small; comparing it needs it whole in memory.
const RELEASE_LIMIT: u64 = 64 << 20;

#[derive(Clone, Debug)]
pub struct Options {
    /// `https://huggingface.co` or any server speaking the same protocol.
    pub endpoint: String,
    /// Sent as `Authorization: Bearer` on every request.
    pub token: Option<String>,
    /// `org/name`.
    pub repo: String,
    /// Branch, tag or commit.
    pub revision: String,
    pub dir: PathBuf,
    /// Glob patterns; empty selects every file.
    pub include: Vec<String>,
    /// Files transferred at once.
    pub jobs: usize,
    /// Reuse a directory holding another repository's or commit's files.
    pub force: bool,
    /// Draw progress bars on stderr (when it is a terminal).
    pub progress: bool,
    /// Further attempts after a connection error or a 5xx, per file and for the listing.
    pub retries: u32,
    /// Wait before the first retry; doubles with each.
    pub backoff: Duration,
}

impl Options {
    pub fn new(repo: &str, revision: &str, dir: impl Into<PathBuf>) -> Options {
        Options {
            endpoint: crate::client::DEFAULT_ENDPOINT.to_string(),
            token: None,
            repo: repo.to_string(),
            revision: revision.to_string(),
            dir: dir.into(),
            include: Vec::new(),
            jobs: 4,
            force: false,
            progress: false,
            retries: 5,
            backoff: Duration::from_secs(1),
        }
    }
}

/// What a download did.
#[derive(Clone, Debug)]
pub struct Summary {
    pub commit: String,
    /// Every selected file, as now on disk.
    pub files: Vec<FileEntry>,
    /// Files transferred (wholly or in part) in this run.
    pub downloaded: usize,
    /// Files already present with the expected contents.
    pub present: usize,
    /// Bytes received in this run.
    pub bytes: u64,
    /// The directory has a release.json and passed verification against it.
    pub bundle_verified: bool,
}

/// Files the Hub lists that a download takes: never Forge's own bookkeeping names, and not
/// `.gitattributes` (git metadata every Hub repository carries, absent from bundle inventories)
/// unless a pattern asks for it.
pub(crate) fn selected(path: &str, globs: &[Glob]) -> bool {
    if release::is_bookkeeping(path) && path != RELEASE_FILE {
        return false;
    }
    if globs.is_empty() {
        path != ".gitattributes"
    } else {
        any_match(globs, path)
    }
}

pub(crate) fn short(commit: &str) -> &str {
    &commit[..commit.len().min(7)]
}

/// A sibling directory named after the commit, for messages that suggest where to download.
pub(crate) fn suggest_dir(dir: &Path, commit: &str) -> String {
    let d = dir.display().to_string();
    format!("{}-{}", d.trim_end_matches('/'), short(commit))
}

pub fn download(opts: &Options) -> Result<Summary> {
    crate::check_repo(&opts.repo)?;
    crate::check_revision(&opts.revision)?;
    let globs = opts.include.iter().map(|g| Glob::new(g)).collect::<Result<Vec<_>>>()?;
    let jobs = opts.jobs.clamp(1, 64);
    let client = Client::new(&opts.endpoint, opts.token.as_deref(), opts.retries, opts.backoff)?;
    let dir = opts.dir.as_path();
    let mp = MultiProgress::with_draw_target(if opts.progress {
        ProgressDrawTarget::stderr()
    } else {
        ProgressDrawTarget::hidden()
    });
    let note = |m: String| mp.suspend(|| eprintln!("forge: {m}"));

    if dir.exists() && !dir.is_dir() {
        bail!("{}: exists and is not a directory", dir.display());
    }
    let previous = DownloadRecord::read(dir);
    let info = client.repo_info(&opts.repo, &opts.revision, &note)?;
    let commit = info.commit.clone();
    let same = check_dir(&client, opts, &previous, &info, &note)?;
    std::fs::create_dir_all(dir).with_context(|| format!("{}: cannot create", dir.display()))?;
    if !same {
        // Partial files of another commit (or of unknown origin) must not be resumed.
        remove_partials(dir)?;
    }
    // Hashes recorded earlier for this very commit: they let a rerun skip small files the Hub
    // gives no hash for.
    let known: BTreeMap<String, FileEntry> = match (&previous, same) {
        (Ok(Some(r)), true) => r.files.iter().map(|f| (f.path.clone(), f.clone())).collect(),
        _ => BTreeMap::new(),
    };

    let files: Vec<&RemoteFile> = info.files.iter().filter(|f| selected(&f.path, &globs)).collect();
    if files.is_empty() {
        if globs.is_empty() {
            bail!("{}@{} (commit {commit}) has no files to download", opts.repo, opts.revision);
        }
        bail!(
            "no file of {}@{} (commit {commit}) matches --include {}",
            opts.repo,
            opts.revision,
            opts.include.join(" --include ")
        );
    }

    // What the directory holds after this run: a finished earlier download of this commit
    // adds its own selection (an empty list is the whole repository).
    let include = match (&previous, same) {
        (Ok(Some(r)), true) if r.complete => {
            if r.include.is_empty() || opts.include.is_empty() {
                Vec::new()
            } else {
                let mut v = r.include.clone();
                v.extend(opts.include.iter().filter(|g| !r.include.contains(g)).cloned());
                v
            }
        }
        _ => opts.include.clone(),
    };
    let mut record = DownloadRecord {
        format: RECORD_FORMAT.to_string(),
        endpoint: client.endpoint().to_string(),
        repo: opts.repo.clone(),
        revision: opts.revision.clone(),
        commit: commit.clone(),
        include,
        complete: false,
        time: now_rfc3339(),
        files: known.values().cloned().collect(),
    };
    // Written first, so that an interrupted download still claims the directory for this commit.
    record.write(dir)?;

    let total_bytes: u64 = files.iter().filter_map(|f| f.size).sum();
    let total = mp.add(ProgressBar::new(total_bytes));
    total.set_style(
        ProgressStyle::with_template(
            "{prefix:>11} [{bar:30}] {binary_bytes}/{binary_total_bytes} {binary_bytes_per_sec} ETA {eta}",
        )
        .expect("valid template")
        .progress_chars("=> "),
    );
    total.set_prefix("total");
    let ctx = Ctx { client: &client, repo: &opts.repo, commit: &commit, dir, known: &known, mp: &mp, total: &total };

    let next = AtomicUsize::new(0);
    let stop = AtomicBool::new(false);
    let results: Mutex<Vec<Option<Result<Outcome>>>> = Mutex::new((0..files.len()).map(|_| None).collect());
    std::thread::scope(|s| {
        for _ in 0..jobs.min(files.len()) {
            s.spawn(|| loop {
                if stop.load(Ordering::Relaxed) {
                    break;
                }
                let i = next.fetch_add(1, Ordering::Relaxed);
                if i >= files.len() {
                    break;
                }
                let r = ctx.process(files[i], &note);
                if r.is_err() {
                    stop.store(true, Ordering::Relaxed);
                }
                results.lock().expect("no poisoned lock")[i] = Some(r);
            });
        }
    });
    total.finish_and_clear();

    let mut entries: BTreeMap<String, FileEntry> = known
        .into_iter()
        .filter(|(p, f)| std::fs::metadata(dir.join(p)).is_ok_and(|m| m.is_file() && m.len() == f.size))
        .collect();
    let mut errors = Vec::new();
    let (mut downloaded, mut present, mut bytes) = (0, 0, 0);
    for r in results.into_inner().expect("no poisoned lock").into_iter().flatten() {
        match r {
            Ok(o) => {
                if o.fetched {
                    downloaded += 1;
                } else {
                    present += 1;
                }
                bytes += o.bytes;
                entries.insert(o.entry.path.clone(), o.entry);
            }
            Err(e) => errors.push(format!("{e:#}")),
        }
    }
    record.files = entries.values().cloned().collect();
    if !errors.is_empty() {
        record.write(dir)?;
        let again = "rerun the same command to resume";
        if errors.len() == 1 {
            bail!("{} ({again})", errors[0]);
        }
        bail!("{} files failed ({again}):\n  {}", errors.len(), errors.join("\n  "));
    }
    // Every file is in place; what is left in the partial directory is empty directories.
    let _ = std::fs::remove_dir_all(dir.join(PARTIAL_DIR));

    let bundle_verified = verify_bundle(dir, &globs, &mp)?;
    record.complete = true;
    record.time = now_rfc3339();
    record.write(dir)?;
    let files = files.iter().filter_map(|f| entries.get(&f.path).cloned()).collect();
    Ok(Summary { commit, files, downloaded, present, bytes, bundle_verified })
}

/// Whether `dir` may receive this download, and whether it already belongs to this commit.
fn check_dir(
    client: &Client,
    opts: &Options,
    previous: &Result<Option<DownloadRecord>>,
    info: &crate::client::RepoInfo,
    note: &dyn Fn(String),
) -> Result<bool> {
    let dir = &opts.dir;
    let advice = format!(
        "download into a new directory (e.g. --dir {}) or pass --force to reuse this one",
        suggest_dir(dir, &info.commit)
    );
    let this = format!("{}@{} is commit {}", opts.repo, opts.revision, short(&info.commit));
    match previous {
        Ok(Some(r)) if r.repo == opts.repo && r.commit == info.commit => Ok(true),
        Ok(Some(r)) => {
            if opts.force {
                return Ok(false);
            }
            let what = if r.complete { "a download" } else { "an unfinished download" };
            let moved = if r.repo == opts.repo && r.revision == opts.revision {
                format!(" ('{}' has moved since; {}@{} finishes that one)", r.revision, r.repo, r.commit)
            } else {
                String::new()
            };
            bail!(
                "{} holds {what} of {} at commit {}{moved}; {this}: {advice}",
                dir.display(),
                r.repo,
                short(&r.commit)
            )
        }
        Err(e) => {
            if opts.force {
                return Ok(false);
            }
            bail!("{e:#}: {} is not a directory Forge downloaded into; {advice}", dir.display())
        }
        Ok(None) => {
            let local = dir.join(RELEASE_FILE);
            if !local.is_file() || opts.force {
                return Ok(false);
            }
            // A bundle without a record: acceptable only if it is this commit's bundle.
            let ours = std::fs::read(&local).with_context(|| format!("{}: cannot read", local.display()))?;
            let theirs = if info.files.iter().any(|f| f.path == RELEASE_FILE) {
                Some(client.fetch_small(&opts.repo, &info.commit, RELEASE_FILE, RELEASE_LIMIT, note)?)
            } else {
                None
            };
            if theirs.as_deref() != Some(ours.as_slice()) {
                bail!("{} holds a different bundle (its release.json is not {this}'s); {advice}", dir.display());
            }
            Ok(false)
        }
    }
}

fn remove_partials(dir: &Path) -> Result<()> {
    let p = dir.join(PARTIAL_DIR);
    match std::fs::remove_dir_all(&p) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
            Err(e).with_context(|| format!("{}: cannot remove", p.display()))
        }
        _ => Ok(()),
    }
}

/// With --include, files of the inventory that were filtered out are not missing; everything
/// downloaded is hashed against it.
fn verify_bundle(dir: &Path, globs: &[Glob], mp: &MultiProgress) -> Result<bool> {
    if !dir.join(RELEASE_FILE).is_file() {
        return Ok(false);
    }
    let mut rel = Release::read(dir)?;
    if !globs.is_empty() {
        rel.files.retain(|f| any_match(globs, &f.path) || dir.join(&f.path).exists());
    }
    let bar = mp.add(ProgressBar::new(rel.total_bytes()));
    bar.set_style(
        ProgressStyle::with_template("{prefix:>11} [{bar:30}] {binary_bytes}/{binary_total_bytes} ETA {eta}")
            .expect("valid template")
            .progress_chars("=> "),
    );
    bar.set_prefix("verifying");
    let mut report = release::verify(dir, &rel, Depth::Full, &mut |n| bar.inc(n))?;
    bar.finish_and_clear();
    report.extra.retain(|p| p != ".gitattributes");
    if !report.ok() {
        let problems = report.problems(dir);
        bail!(
            "{}: the downloaded bundle fails verification against its release.json ({} problem(s)):\n  {}",
            dir.display(),
            problems.len(),
            problems.join("\n  ")
        );
    }
    Ok(true)
}

struct Outcome {
    entry: FileEntry,
    fetched: bool,
    bytes: u64,
}

struct Ctx<'a> {
    client: &'a Client,
    repo: &'a str,
    commit: &'a str,
    dir: &'a Path,
    known: &'a BTreeMap<String, FileEntry>,
    mp: &'a MultiProgress,
    total: &'a ProgressBar,
}

/// A file's bar, and its share of the total bar kept in step when a transfer starts over.
struct FileProgress<'a> {
    bar: ProgressBar,
    total: &'a ProgressBar,
    counted: u64,
}

impl FileProgress<'_> {
    fn set(&mut self, pos: u64) {
        if pos >= self.counted {
            self.total.inc(pos - self.counted);
        } else {
            self.total.dec(self.counted - pos);
        }
        self.counted = pos;
        self.bar.set_position(pos);
    }
}

impl Ctx<'_> {
    fn file_progress(&self, path: &str, len: u64) -> FileProgress<'_> {
        let bar = self.mp.insert_before(self.total, ProgressBar::new(len));
        bar.set_style(
            ProgressStyle::with_template("{msg:>40!} [{bar:30}] {binary_bytes}/{binary_total_bytes}")
                .expect("valid template")
                .progress_chars("=> "),
        );
        bar.set_message(path.to_string());
        FileProgress { bar, total: self.total, counted: 0 }
    }

    fn process(&self, f: &RemoteFile, note: &dyn Fn(String)) -> Result<Outcome> {
        let final_path = self.dir.join(&f.path);
        check_parents(self.dir, &f.path)?;
        let partial_rel = format!("{PARTIAL_DIR}/{}", f.path);
        check_parents(self.dir, &partial_rel)?;
        let partial = self.dir.join(&partial_rel);

        if let Some(entry) = self.already_present(f, &final_path)? {
            let _ = std::fs::remove_file(&partial);
            return Ok(Outcome { entry, fetched: false, bytes: 0 });
        }
        let (sha256, size, bytes) = self.fetch(f, &partial, note)?;
        if let Some(p) = final_path.parent() {
            std::fs::create_dir_all(p).with_context(|| format!("{}: cannot create", p.display()))?;
        }
        std::fs::rename(&partial, &final_path)
            .with_context(|| format!("{}: cannot move into place", final_path.display()))?;
        Ok(Outcome { entry: FileEntry { path: f.path.clone(), size, sha256 }, fetched: true, bytes })
    }

    /// A file already under its final name is kept when its hash is known and matches: the
    /// Hub's for LFS files, the record's (same commit) for the others.
    fn already_present(&self, f: &RemoteFile, path: &Path) -> Result<Option<FileEntry>> {
        let Ok(m) = std::fs::symlink_metadata(path) else { return Ok(None) };
        if m.is_dir() {
            bail!("{}: a directory is where the file '{}' goes", path.display(), f.path);
        }
        if !m.is_file() || f.size.is_some_and(|s| s != m.len()) {
            return Ok(None);
        }
        let want = match &f.sha256 {
            Some(h) => h.clone(),
            None => match self.known.get(&f.path) {
                Some(k) if k.size == m.len() => k.sha256.clone(),
                _ => return Ok(None),
            },
        };
        let mut prog = self.file_progress(&f.path, m.len());
        let mut pos = 0;
        let got = release::sha256_file(path, &mut |n| {
            pos += n;
            prog.set(pos)
        })?;
        prog.bar.finish_and_clear();
        if got == want {
            return Ok(Some(FileEntry { path: f.path.clone(), size: m.len(), sha256: got }));
        }
        prog.set(0);
        Ok(None)
    }

    /// Download into the partial file until it is complete and matches the Hub's size and
    /// hash: (sha256, size, bytes received).
    fn fetch(&self, f: &RemoteFile, partial: &Path, note: &dyn Fn(String)) -> Result<(String, u64, u64)> {
        if let Some(p) = partial.parent() {
            std::fs::create_dir_all(p).with_context(|| format!("{}: cannot create", p.display()))?;
        }
        let url = self.client.resolve_url(self.repo, self.commit, &f.path);
        let mut prog = self.file_progress(&f.path, f.size.unwrap_or(0));
        let mut received = 0u64;
        // Bytes from an earlier run may be what is wrong; they get one fresh start.
        let mut inherited = std::fs::metadata(partial).is_ok_and(|m| m.len() > 0);
        let mut state: Option<(Sha256, u64)> = None;
        loop {
            let (hasher, len) = self.client.retry(note, &f.path, &mut || {
                self.attempt(f, &url, partial, &mut state, &mut prog, &mut received, note)
            })?;
            let got = hex(&hasher.finalize());
            let size_ok = f.size.is_none_or(|s| s == len);
            let hash_ok = f.sha256.as_ref().is_none_or(|w| *w == got);
            if size_ok && hash_ok {
                prog.bar.finish_and_clear();
                return Ok((got, len, received));
            }
            let _ = std::fs::remove_file(partial);
            prog.set(0);
            state = None;
            if inherited {
                inherited = false;
                note(format!("{}: the partial file from an earlier run does not check out; starting over", f.path));
                continue;
            }
            prog.bar.finish_and_clear();
            if !size_ok {
                bail!("{}: {len} bytes received, the hub lists {}; not kept", f.path, f.size.unwrap_or(0));
            }
            bail!(
                "{}: SHA-256 {got} differs from the hub's {}; the file was deleted and not kept",
                f.path,
                f.sha256.as_deref().unwrap_or("")
            );
        }
    }

    /// One request: resume from the partial file's length when it has one.
    #[allow(clippy::too_many_arguments)]
    fn attempt(
        &self,
        f: &RemoteFile,
        url: &str,
        partial: &Path,
        state: &mut Option<(Sha256, u64)>,
        prog: &mut FileProgress,
        received: &mut u64,
        note: &dyn Fn(String),
    ) -> Result<(Sha256, u64), Fail> {
        let mut have = std::fs::metadata(partial).map_or(0, |m| m.len());
        if f.size.is_some_and(|s| have > s) {
            remove(partial)?;
            have = 0;
        }
        let mut hasher = match state.take() {
            Some((h, n)) if n == have => h,
            _ => hash_prefix(partial, have)?,
        };
        prog.set(have);
        if have > 0 && f.size == Some(have) {
            return Ok((hasher, have));
        }
        let mut resp = self.client.get(url, (have > 0).then_some(have))?;
        let status = resp.status().as_u16();
        let target = Target::File { repo: self.repo, commit: self.commit, path: &f.path };
        let mut file = match status {
            206 if have > 0 => {
                let start = resp
                    .headers()
                    .get("content-range")
                    .and_then(|v| v.to_str().ok())
                    .and_then(|v| v.strip_prefix("bytes "))
                    .and_then(|v| v.split('-').next())
                    .and_then(|v| v.trim().parse::<u64>().ok());
                if start != Some(have) {
                    remove(partial)?;
                    prog.set(0);
                    return Err(Fail::transient(anyhow!(
                        "asked for bytes from {have}, the server sent a range starting at {start:?}; starting over"
                    )));
                }
                OpenOptions::new().append(true).open(partial)
            }
            200 => {
                if have > 0 {
                    note(format!(
                        "{}: the server does not resume (HTTP 200 to a range request); starting over",
                        f.path
                    ));
                }
                hasher = Sha256::new();
                have = 0;
                prog.set(0);
                File::create(partial)
            }
            416 if have > 0 => {
                remove(partial)?;
                prog.set(0);
                return Err(Fail::transient(anyhow!("range from byte {have} not satisfiable; starting over")));
            }
            _ => return Err(self.client.status_fail(&resp, &target, url)),
        }
        .with_context(|| format!("{}: cannot open", partial.display()))?;

        let limit = f.size.unwrap_or(UNKNOWN_SIZE_LIMIT);
        let mut reader = resp.body_mut().as_reader();
        let mut buf = vec![0u8; 256 << 10];
        let mut this_time = 0u64;
        loop {
            let n = match reader.read(&mut buf) {
                Ok(0) => break,
                Ok(n) => n as u64,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(e) => {
                    file.flush().ok();
                    *state = Some((hasher, have));
                    return Err(Fail {
                        err: anyhow!("connection lost after {have} bytes: {e}"),
                        transient: true,
                        progressed: this_time > 0,
                    });
                }
            };
            if have + n > limit {
                drop(file);
                remove(partial)?;
                prog.set(0);
                return Err(Fail::fatal(anyhow!(
                    "the server sent more than the {limit} bytes the hub lists; not kept"
                )));
            }
            let chunk = &buf[..n as usize];
            file.write_all(chunk).with_context(|| format!("{}: write failed", partial.display()))?;
            hasher.update(chunk);
            have += n;
            this_time += n;
            *received += n;
            prog.set(have);
        }
        file.sync_all().with_context(|| format!("{}: write failed", partial.display()))?;
        if let Some(size) = f.size.filter(|&s| have < s) {
            *state = Some((hasher, have));
            return Err(Fail {
                err: anyhow!("connection closed after {have} of {size} bytes"),
                transient: true,
                progressed: this_time > 0,
            });
        }
        Ok((hasher, have))
    }
}

fn remove(p: &Path) -> Result<(), Fail> {
    match std::fs::remove_file(p) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
            Err(Fail::fatal(anyhow!("{}: cannot remove: {e}", p.display())))
        }
        _ => Ok(()),
    }
}

fn hash_prefix(path: &Path, len: u64) -> Result<Sha256, Fail> {
    let mut h = Sha256::new();
    if len == 0 {
        return Ok(h);
    }
    let f = File::open(path).with_context(|| format!("{}: cannot open", path.display()))?;
    let mut r = f.take(len);
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = r.read(&mut buf).with_context(|| format!("{}: read failed", path.display()))?;
        if n == 0 {
            break;
        }
        h.update(&buf[..n]);
    }
    Ok(h)
}

/// Directories on the way to a file must be real directories inside `dir`: a symbolic link
/// there would send the write outside.
fn check_parents(dir: &Path, rel: &str) -> Result<()> {
    let mut p = dir.to_path_buf();
    let parts: Vec<&str> = rel.split('/').collect();
    for c in &parts[..parts.len() - 1] {
        p.push(c);
        match std::fs::symlink_metadata(&p) {
            Ok(m) if m.file_type().is_symlink() => {
                bail!("{}: a symbolic link is on the way to '{rel}'; refusing to write through it", p.display())
            }
            Ok(m) if !m.is_dir() => bail!("{}: a file is where the directory for '{rel}' goes", p.display()),
            _ => {}
        }
    }
    Ok(())
}

fn hex(d: &[u8]) -> String {
    d.iter().map(|b| format!("{b:02x}")).collect()
}
