//! forge-hub against a mock hub on 127.0.0.1: downloads, pinning, resumption, checks, errors,
//! update checks.

#[path = "common/mock_hub.rs"]
mod mock_hub;

use forge_core::release::{sha256_bytes, FileEntry, Release, DOWNLOAD_FILE, FORMAT, RELEASE_FILE};
use forge_hub::{check_update, download, ChangeKind, CheckOptions, DownloadRecord, Options, UpdateStatus, PARTIAL_DIR};
use mock_hub::{noise, MockHub};
use std::path::{Path, PathBuf};
use std::time::Duration;

const REPO: &str = "org/model";
const WEIGHTS: &str = "model.safetensors";
const WEIGHTS_LEN: usize = 3 << 20;

struct Fixture {
    hub: MockHub,
    /// Tagged `v1`.
    c1: String,
    /// `main`: c1 with config.json changed (same size).
    c2: String,
}

fn files_v1() -> Vec<(&'static str, Vec<u8>, bool)> {
    vec![
        (".gitattributes", b"*.safetensors filter=lfs diff=lfs merge=lfs -text\n".to_vec(), false),
        ("README.md", b"# model\n".to_vec(), false),
        ("config.json", br#"{"hidden_size": 64, "layers": 2}"#.to_vec(), false),
        ("tokenizer.json", br#"{"model": {"vocab": {}}}"#.to_vec(), true),
        (WEIGHTS, noise(1, WEIGHTS_LEN), true),
        ("sub/extra.bin", noise(2, 100_000), true),
    ]
}

fn files_v2() -> Vec<(&'static str, Vec<u8>, bool)> {
    let mut f = files_v1();
    f[2].1 = br#"{"hidden_size": 64, "layers": 3}"#.to_vec();
    f
}

fn refs<'a>(files: &'a [(&'static str, Vec<u8>, bool)]) -> Vec<(&'static str, &'a [u8], bool)> {
    files.iter().map(|(p, d, l)| (*p, d.as_slice(), *l)).collect()
}

fn fixture() -> Fixture {
    let hub = MockHub::start();
    let c1 = hub.commit(REPO, &["v1"], &refs(&files_v1()));
    let c2 = hub.commit(REPO, &["main"], &refs(&files_v2()));
    Fixture { hub, c1, c2 }
}

fn tmpdir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("forge-hub-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    d
}

fn opts(hub: &MockHub, repo: &str, rev: &str, dir: &Path) -> Options {
    let mut o = Options::new(repo, rev, dir);
    o.endpoint = hub.url.clone();
    o.jobs = 3;
    o.retries = 2;
    o.backoff = Duration::from_millis(5);
    o
}

/// Every file of `files` but .gitattributes is in `dir` with identical bytes.
fn assert_same(dir: &Path, files: &[(&'static str, Vec<u8>, bool)]) {
    for (p, d, _) in files {
        if *p == ".gitattributes" {
            assert!(!dir.join(p).exists(), ".gitattributes is not downloaded by default");
            continue;
        }
        let got = std::fs::read(dir.join(p)).unwrap_or_else(|e| panic!("{p}: {e}"));
        assert!(got == *d, "{p} differs");
    }
    assert!(!dir.join(PARTIAL_DIR).exists(), "partial directory left behind");
}

fn resolve_requests(hub: &MockHub) -> Vec<mock_hub::Request> {
    hub.requests().into_iter().filter(|r| r.path.contains("/resolve/")).collect()
}

#[test]
fn branch_download_is_identical_and_records_the_commit() {
    let f = fixture();
    let dir = tmpdir("branch");
    let s = download(&opts(&f.hub, REPO, "main", &dir)).unwrap();
    assert_eq!(s.commit, f.c2);
    assert_eq!(s.downloaded, 5);
    assert!(!s.bundle_verified);
    assert_same(&dir, &files_v2());

    let api: Vec<_> = f.hub.requests().into_iter().filter(|r| r.path.starts_with("/api/")).collect();
    assert_eq!(api.len(), 1);
    assert_eq!(api[0].path, "/api/models/org/model/revision/main?blobs=true");
    let resolves = resolve_requests(&f.hub);
    assert_eq!(resolves.len(), 5);
    for r in &resolves {
        assert!(r.path.starts_with(&format!("/org/model/resolve/{}/", f.c2)), "not pinned: {}", r.path);
    }

    let rec = DownloadRecord::read(&dir).unwrap().unwrap();
    assert_eq!((rec.repo.as_str(), rec.revision.as_str(), rec.commit.as_str()), (REPO, "main", f.c2.as_str()));
    assert_eq!(rec.endpoint, f.hub.url);
    assert!(rec.complete);
    assert!(rec.time.ends_with('Z'));
    let w = rec.files.iter().find(|e| e.path == WEIGHTS).unwrap();
    assert_eq!((w.size, w.sha256.clone()), (WEIGHTS_LEN as u64, sha256_bytes(&files_v2()[4].1)));
    assert_eq!(rec.files.len(), 5);

    // A rerun finds everything in place and transfers nothing.
    f.hub.clear_requests();
    let s = download(&opts(&f.hub, REPO, "main", &dir)).unwrap();
    assert_eq!((s.downloaded, s.present, s.bytes), (0, 5, 0));
    assert!(resolve_requests(&f.hub).is_empty());
}

#[test]
fn revision_pinning_by_commit_and_tag() {
    let f = fixture();
    let dir = tmpdir("pin");
    let s = download(&opts(&f.hub, REPO, &f.c1, &dir)).unwrap();
    assert_eq!(s.commit, f.c1);
    assert_same(&dir, &files_v1());
    let rec = DownloadRecord::read(&dir).unwrap().unwrap();
    assert_eq!((rec.revision.as_str(), rec.commit.as_str()), (f.c1.as_str(), f.c1.as_str()));
    assert!(resolve_requests(&f.hub).iter().all(|r| r.path.contains(&f.c1)));

    let dir2 = tmpdir("pin-tag");
    let mut o = opts(&f.hub, REPO, "v1", &dir2);
    o.include = vec!["*.json".into()];
    let s = download(&o).unwrap();
    assert_eq!(s.commit, f.c1);
    assert_eq!(std::fs::read(dir2.join("config.json")).unwrap(), files_v1()[2].1);
    assert!(!dir2.join(WEIGHTS).exists() && !dir2.join("README.md").exists());
    assert_eq!(s.files.len(), 2);
}

#[test]
fn interrupted_download_resumes_with_a_range_request() {
    let f = fixture();
    let dir = tmpdir("resume");
    let cut = 1_000_000;
    f.hub.with(|s| s.cut.insert(WEIGHTS.into(), cut));
    let mut o = opts(&f.hub, REPO, "main", &dir);
    o.retries = 0;
    let e = download(&o).unwrap_err().to_string();
    assert!(e.contains(WEIGHTS), "{e}");
    assert!(!dir.join(WEIGHTS).exists(), "a partial file under the final name");
    let partial = dir.join(PARTIAL_DIR).join(WEIGHTS);
    let have = std::fs::metadata(&partial).unwrap().len();
    assert!(have > 0 && have <= cut as u64, "{have}");
    let rec = DownloadRecord::read(&dir).unwrap().unwrap();
    assert!(!rec.complete);
    assert_eq!(rec.commit, f.c2);

    f.hub.clear_requests();
    download(&o).unwrap();
    assert_same(&dir, &files_v2());
    // The resolve request and the redirected one both carry the range.
    let ranges: Vec<String> = f.hub.requests().iter().filter_map(|r| r.header("range").map(str::to_string)).collect();
    assert!(!ranges.is_empty() && ranges.iter().all(|r| *r == format!("bytes={have}-")), "{ranges:?}");
}

#[test]
fn a_cut_connection_is_resumed_within_the_run() {
    let f = fixture();
    let dir = tmpdir("resume-retry");
    f.hub.with(|s| {
        s.cut.insert(WEIGHTS.into(), 700_000);
        s.unavailable.insert("config.json".into(), 2);
    });
    download(&opts(&f.hub, REPO, "main", &dir)).unwrap();
    assert_same(&dir, &files_v2());
    let ranges: Vec<String> = f.hub.requests().iter().filter_map(|r| r.header("range").map(str::to_string)).collect();
    assert!(!ranges.is_empty() && ranges.iter().all(|r| r == "bytes=700000-"), "{ranges:?}");
}

#[test]
fn a_server_ignoring_range_restarts_the_file() {
    let f = fixture();
    let dir = tmpdir("norange");
    f.hub.with(|s| s.cut.insert(WEIGHTS.into(), 500_000));
    let mut o = opts(&f.hub, REPO, "main", &dir);
    o.retries = 0;
    assert!(download(&o).is_err());
    f.hub.with(|s| s.ignore_range = true);
    download(&o).unwrap();
    assert_same(&dir, &files_v2());
}

#[test]
fn a_wrong_hash_is_refused_and_nothing_is_kept() {
    let f = fixture();
    let dir = tmpdir("badhash");
    f.hub.with(|s| s.wrong_body.insert(WEIGHTS.into()));
    let mut o = opts(&f.hub, REPO, "main", &dir);
    o.jobs = 1;
    let e = format!("{:#}", download(&o).unwrap_err());
    assert!(e.contains(WEIGHTS) && e.contains("SHA-256"), "{e}");
    assert!(!dir.join(WEIGHTS).exists());
    assert!(!dir.join(PARTIAL_DIR).join(WEIGHTS).exists());
    assert!(!DownloadRecord::read(&dir).unwrap().unwrap().complete);
}

#[test]
fn not_found_errors_name_what_is_missing() {
    let f = fixture();
    let dir = tmpdir("404");
    let e = download(&opts(&f.hub, "org/nothing", "main", &dir)).unwrap_err().to_string();
    assert!(e.contains("'org/nothing'") && e.contains("not found"), "{e}");
    let e = download(&opts(&f.hub, REPO, "nobranch", &dir)).unwrap_err().to_string();
    assert!(e.contains("revision 'nobranch'") && e.contains("'org/model'"), "{e}");
    f.hub.with(|s| s.missing.insert("config.json".into()));
    let e = download(&opts(&f.hub, REPO, "main", &dir)).unwrap_err().to_string();
    assert!(e.contains("file 'config.json'") && e.contains(&f.c2) && e.contains("404"), "{e}");
    assert!(!dir.join("config.json").exists());
    let mut o = opts(&f.hub, REPO, "main", &tmpdir("404-include"));
    o.include = vec!["*.gguf".into()];
    let e = download(&o).unwrap_err().to_string();
    assert!(e.contains("no file") && e.contains("*.gguf"), "{e}");
}

#[test]
fn the_token_is_sent_as_a_bearer() {
    let f = fixture();
    f.hub.commit("org/private", &["main"], &[("config.json", b"{}", false), ("w.gguf", &noise(3, 5000), true)]);
    f.hub.with(|s| s.repos.get_mut("org/private").unwrap().token = Some("hf_secret".into()));
    let dir = tmpdir("token");
    let e = download(&opts(&f.hub, "org/private", "main", &dir)).unwrap_err().to_string();
    assert!(e.contains("HF_TOKEN") && e.contains("401"), "{e}");
    let mut o = opts(&f.hub, "org/private", "main", &dir);
    o.token = Some("hf_wrong".into());
    let e = download(&o).unwrap_err().to_string();
    assert!(e.contains("HF_TOKEN was sent"), "{e}");

    f.hub.clear_requests();
    o.token = Some("hf_secret".into());
    download(&o).unwrap();
    assert_eq!(std::fs::read(dir.join("w.gguf")).unwrap(), noise(3, 5000));
    let reqs = f.hub.requests();
    assert!(reqs.len() >= 3);
    // The redirect to the content host is followed without the token, as from the Hub to its CDN.
    for r in reqs.iter().filter(|r| !r.path.starts_with("/lfs-cdn/")) {
        assert_eq!(r.header("authorization"), Some("Bearer hf_secret"), "{}", r.path);
    }
}

#[test]
fn a_directory_of_another_commit_is_refused_unless_forced() {
    let f = fixture();
    let dir = tmpdir("other");
    download(&opts(&f.hub, REPO, "v1", &dir)).unwrap();
    let e = download(&opts(&f.hub, REPO, "main", &dir)).unwrap_err().to_string();
    assert!(e.contains("--force") && e.contains(&format!("{}-{}", dir.display(), &f.c2[..7])), "{e}");
    let other = f.hub.commit("org/other", &["main"], &[("a.json", b"{}", false)]);
    let e = download(&opts(&f.hub, "org/other", "main", &dir)).unwrap_err().to_string();
    assert!(e.contains("org/model") && e.contains(&other[..7]), "{e}");

    let mut o = opts(&f.hub, REPO, "main", &dir);
    o.force = true;
    f.hub.clear_requests();
    let s = download(&o).unwrap();
    assert_same(&dir, &files_v2());
    // Only config.json changed between the commits; LFS files were kept by their hash.
    let fetched: Vec<String> =
        resolve_requests(&f.hub).iter().map(|r| r.path.rsplit('/').next().unwrap().into()).collect();
    assert!(!fetched.contains(&WEIGHTS.to_string()), "{fetched:?}");
    assert_eq!(s.present, 3);
    assert_eq!(DownloadRecord::read(&dir).unwrap().unwrap().commit, f.c2);
}

#[test]
fn paths_outside_the_directory_are_refused_before_any_write() {
    let hub = MockHub::start();
    hub.commit("org/evil", &["main"], &[("ok.json", b"{}", false), ("../escaped.txt", b"x", false)]);
    let root = tmpdir("evil");
    let dir = root.join("d");
    let e = download(&opts(&hub, "org/evil", "main", &dir)).unwrap_err();
    assert!(format!("{e:#}").contains("not a relative path inside"), "{e:#}");
    assert!(!root.join("escaped.txt").exists());
    assert!(!dir.join("ok.json").exists());
}

fn bundle_files(tamper: bool) -> Vec<(&'static str, Vec<u8>, bool)> {
    let weights = noise(7, 200_000);
    let config = br#"{"arch": "llama"}"#.to_vec();
    let tok = br#"{"vocab": 3}"#.to_vec();
    let entry = |p: &str, d: &[u8]| FileEntry { path: p.into(), size: d.len() as u64, sha256: sha256_bytes(d) };
    let mut listed = vec![
        entry("model/config.json", &config),
        entry("model/tokenizer.json", &tok),
        entry("model/model.safetensors", &weights),
    ];
    if tamper {
        listed[2].sha256 = sha256_bytes(b"something else");
    }
    let rel = Release {
        format: FORMAT.into(),
        forge_version: "0.1.0".into(),
        name: "b".into(),
        model: "model".into(),
        drafter: None,
        identity: serde_json::Value::Null,
        pairing: serde_json::Value::Null,
        quality: serde_json::Value::Null,
        files: listed,
    };
    vec![
        (".gitattributes", b"*.safetensors filter=lfs\n".to_vec(), false),
        (RELEASE_FILE, rel.to_json().into_bytes(), false),
        ("model/config.json", config, false),
        ("model/tokenizer.json", tok, false),
        ("model/model.safetensors", weights, true),
    ]
}

#[test]
fn bundles_are_verified_against_their_release_json() {
    let hub = MockHub::start();
    hub.commit("org/bundle", &["main"], &refs(&bundle_files(false)));
    hub.commit("org/tampered", &["main"], &refs(&bundle_files(true)));

    let dir = tmpdir("bundle-ok");
    let s = download(&opts(&hub, "org/bundle", "main", &dir)).unwrap();
    assert!(s.bundle_verified);
    assert_same(&dir, &bundle_files(false));

    // With --include, the inventory's other files are not missing.
    let dir = tmpdir("bundle-include");
    let mut o = opts(&hub, "org/bundle", "main", &dir);
    o.include = vec![RELEASE_FILE.into(), "model/config.json".into()];
    let s = download(&o).unwrap();
    assert!(s.bundle_verified);
    assert!(!dir.join("model/model.safetensors").exists());

    let bad = tmpdir("bundle-bad");
    let e = format!("{:#}", download(&opts(&hub, "org/tampered", "main", &bad)).unwrap_err());
    assert!(e.contains("fails verification") && e.contains("model.safetensors"), "{e}");
    assert!(!DownloadRecord::read(&bad).unwrap().unwrap().complete);

    // A directory holding another repository's bundle is not overwritten, with or without a
    // download record.
    let e = format!("{:#}", download(&opts(&hub, "org/bundle", "main", &bad)).unwrap_err());
    assert!(e.contains("--force"), "{e}");
    let dir = tmpdir("bundle-norecord");
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join(RELEASE_FILE), &bundle_files(true)[1].1).unwrap();
    let e = format!("{:#}", download(&opts(&hub, "org/bundle", "main", &dir)).unwrap_err());
    assert!(e.contains("different bundle"), "{e}");
    std::fs::write(dir.join(RELEASE_FILE), &bundle_files(false)[1].1).unwrap();
    assert!(download(&opts(&hub, "org/bundle", "main", &dir)).unwrap().bundle_verified);
    assert!(dir.join(DOWNLOAD_FILE).is_file());
}

fn check(hub: &MockHub, dir: &Path) -> CheckOptions {
    let mut c = CheckOptions::new(dir);
    c.default_endpoint = hub.url.clone();
    c.retries = 1;
    c.backoff = Duration::from_millis(5);
    c
}

#[test]
fn check_update_tells_metadata_from_weights() {
    let f = fixture();
    let dir = tmpdir("update");
    download(&opts(&f.hub, REPO, "main", &dir)).unwrap();

    let r = check_update(&check(&f.hub, &dir)).unwrap();
    assert_eq!(r.status, UpdateStatus::UpToDate);
    assert_eq!((r.local_commit.as_deref(), r.remote_commit.as_str()), (Some(f.c2.as_str()), f.c2.as_str()));
    assert!(r.command.is_none());
    assert!(r.render().contains("up to date"));

    // main moves: only the README changes.
    let mut v3 = files_v2();
    v3[1].1 = b"# model, now with a card\n".to_vec();
    let c3 = f.hub.commit(REPO, &["main"], &refs(&v3));
    let r = check_update(&check(&f.hub, &dir)).unwrap();
    assert_eq!(r.status, UpdateStatus::MetadataChanged);
    assert_eq!(r.remote_commit, c3);
    assert_eq!(r.changes.len(), 1);
    assert_eq!((r.changes[0].path.as_str(), r.changes[0].change), ("README.md", ChangeKind::Modified));
    let cmd = r.command.clone().unwrap();
    assert!(cmd.starts_with(&format!("forge download org/model@{c3} --dir {}-{}", dir.display(), &c3[..7])), "{cmd}");
    assert!(cmd.contains(&format!("--endpoint {}", f.hub.url)), "{cmd}");
    let json: serde_json::Value = serde_json::from_str(&r.to_json()).unwrap();
    assert_eq!(json["status"], "metadata-changed");
    assert_eq!(json["changes"][0]["change"], "modified");

    // Then the weights change and a file is added.
    let mut v4 = v3.clone();
    v4[4].1 = noise(9, WEIGHTS_LEN);
    v4.push(("generation_config.json", b"{}".to_vec(), false));
    let c4 = f.hub.commit(REPO, &["main"], &refs(&v4));
    let r = check_update(&check(&f.hub, &dir)).unwrap();
    assert_eq!(r.status, UpdateStatus::WeightsChanged);
    assert_eq!(r.remote_commit, c4);
    let changed: Vec<(&str, ChangeKind, bool)> =
        r.changes.iter().map(|c| (c.path.as_str(), c.change, c.weights)).collect();
    assert_eq!(
        changed,
        vec![
            ("README.md", ChangeKind::Modified, false),
            ("generation_config.json", ChangeKind::Added, false),
            (WEIGHTS, ChangeKind::Modified, true),
        ]
    );
    assert!(r.render().contains("weights changed"));
    assert!(r.command.unwrap().contains(&c4));
}

#[test]
fn check_update_compares_small_files_of_unchanged_size() {
    let f = fixture();
    let dir = tmpdir("update-tag");
    download(&opts(&f.hub, REPO, "v1", &dir)).unwrap();
    assert_eq!(check_update(&check(&f.hub, &dir)).unwrap().status, UpdateStatus::UpToDate);
    let mut c = check(&f.hub, &dir);
    c.revision = Some("main".into());
    let r = check_update(&c).unwrap();
    assert_eq!(r.status, UpdateStatus::MetadataChanged);
    assert_eq!(r.changes.iter().map(|c| c.path.as_str()).collect::<Vec<_>>(), vec!["config.json"]);

    // A subset download compares only its subset.
    let dir = tmpdir("update-subset");
    let mut o = opts(&f.hub, REPO, "v1", &dir);
    o.include = vec!["**/*.bin".into()];
    download(&o).unwrap();
    let mut c = check(&f.hub, &dir);
    c.revision = Some("main".into());
    let r = check_update(&c).unwrap();
    assert_eq!(r.status, UpdateStatus::UpToDate);
    assert_ne!(r.local_commit.as_deref(), Some(r.remote_commit.as_str()));
    assert!(r.render().contains("with the same files"));

    // A second subset into the same directory widens what is compared.
    let mut o = opts(&f.hub, REPO, "v1", &dir);
    o.include = vec!["config.json".into()];
    download(&o).unwrap();
    assert_eq!(DownloadRecord::read(&dir).unwrap().unwrap().include, vec!["**/*.bin", "config.json"]);
    let r = check_update(&c).unwrap();
    assert_eq!(r.status, UpdateStatus::MetadataChanged);
    assert_eq!(r.changes.iter().map(|c| c.path.as_str()).collect::<Vec<_>>(), vec!["config.json"]);
    let cmd = r.command.unwrap();
    assert!(cmd.contains("--include '**/*.bin' --include config.json"), "{cmd}");
}

#[test]
fn check_update_from_a_release_json() {
    let hub = MockHub::start();
    hub.commit("org/bundle", &["main"], &refs(&bundle_files(false)));
    let dir = tmpdir("update-release");
    std::fs::create_dir_all(dir.join("model")).unwrap();
    for (p, d, _) in bundle_files(false).iter().filter(|(p, ..)| *p != ".gitattributes") {
        std::fs::write(dir.join(p), d).unwrap();
    }
    assert!(check_update(&check(&hub, &dir)).unwrap_err().to_string().contains("--repo"));
    let mut c = check(&hub, &dir);
    c.repo = Some("org/bundle".into());
    let r = check_update(&c).unwrap();
    assert_eq!(r.status, UpdateStatus::UpToDate, "{:?}", r.changes);
    assert_eq!(r.local_commit, None);

    let mut v2 = bundle_files(false);
    v2[4].1 = noise(8, 200_000);
    hub.commit("org/bundle", &["main"], &refs(&v2));
    let r = check_update(&c).unwrap();
    assert_eq!(r.status, UpdateStatus::WeightsChanged);
    assert!(r.changes.iter().any(|c| c.path == "model/model.safetensors"));
}
