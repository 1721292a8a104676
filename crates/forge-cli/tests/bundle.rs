//! Bundles end to end through the `forge` binary: bundle → verify → load gives the export's own
//! logits; every single-byte alteration, truncation, missing and extra file is reported by
//! `forge verify --full` and refused at load; a malformed release.json is a clear error.

mod common;
use common::{forge, tmpdir};
use std::path::{Path, PathBuf};

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures")
}

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

/// Bundle the tiny hybrid export (its source is a Hugging Face directory, so the stripped
/// source path runs) and return the bundle and a token file.
fn make_bundle(dir: &Path, name: &str) -> (PathBuf, PathBuf) {
    let export = fixtures().join("qwen35_tiny_upstream_export");
    let out = dir.join(name);
    let (ok, _, err) = forge(&["bundle", s(&export), "--out", s(&out)]);
    assert!(ok, "bundle failed: {err}");
    let ids = dir.join("ids.txt");
    std::fs::write(&ids, "1 7 42 3 99 5").unwrap();
    (out, ids)
}

fn logits(model: &Path, ids: &Path, out: &Path, extra: &[&str]) -> (bool, String) {
    let mut args = extra.to_vec();
    args.extend(["logits", "--model", s(model), "--tokens", s(ids), "--output", s(out)]);
    let (ok, _, err) = forge(&args);
    (ok, err)
}

#[test]
fn a_bundle_loads_to_the_exports_own_logits() {
    let dir = tmpdir("bundle-roundtrip");
    let (b, ids) = make_bundle(&dir, "b");
    let (ok, out, err) = forge(&["verify", s(&b), "--full"]);
    assert!(ok && out.contains("OK"), "{out}{err}");
    let (ok, err) = logits(&b, &ids, &dir.join("bundle.npy"), &[]);
    assert!(ok, "{err}");
    let (ok, err) = logits(&fixtures().join("qwen35_tiny_upstream_export"), &ids, &dir.join("export.npy"), &[]);
    assert!(ok, "{err}");
    assert_eq!(std::fs::read(dir.join("bundle.npy")).unwrap(), std::fs::read(dir.join("export.npy")).unwrap());
    // The bundle does not carry the source's quantized matrices a second time.
    let src = std::fs::metadata(fixtures().join("qwen35_tiny/model.safetensors")).unwrap().len();
    let kept = std::fs::metadata(b.join("model/source/model.safetensors")).unwrap().len();
    assert!(kept < src / 2, "stripped source {kept} bytes of {src}");
    let rel: serde_json::Value = serde_json::from_slice(&std::fs::read(b.join("release.json")).unwrap()).unwrap();
    assert_eq!(rel["format"], "forge-release/1");
    assert_eq!(rel["identity"]["seed"], 1234);
    assert!(rel["pairing"]["tokenizer_sha256"].as_str().is_some_and(|h| h.len() == 64));
    // A second bundle into the same place is refused rather than mixed with the first.
    let (ok, _, err) = forge(&["bundle", s(&fixtures().join("qwen35_tiny_upstream_export")), "--out", s(&b)]);
    assert!(!ok && err.contains("already exists"), "{err}");
}

#[test]
fn every_altered_byte_truncation_missing_and_extra_file_is_reported() {
    let dir = tmpdir("bundle-tamper");
    let (b, ids) = make_bundle(&dir, "b");
    let rel: serde_json::Value = serde_json::from_slice(&std::fs::read(b.join("release.json")).unwrap()).unwrap();
    let files: Vec<String> =
        rel["files"].as_array().unwrap().iter().map(|f| f["path"].as_str().unwrap().into()).collect();
    assert!(files.len() > 20);
    for (i, f) in files.iter().enumerate() {
        let p = b.join(f);
        let orig = std::fs::read(&p).unwrap();
        // One byte, at a different place in each file.
        let mut bad = orig.clone();
        let at = (i * 7919) % bad.len();
        bad[at] ^= 0x01;
        std::fs::write(&p, &bad).unwrap();
        let (ok, out, _) = forge(&["verify", s(&b), "--full"]);
        assert!(!ok && out.contains(f.as_str()) && out.contains("altered"), "{f} byte {at}: {out}");
        let (ok, err) = logits(&b, &ids, &dir.join("x.npy"), &[]);
        assert!(!ok && err.contains(f.as_str()), "{f} byte {at} loaded: {err}");
        std::fs::write(&p, &orig).unwrap();
    }
    let victim = b.join(&files[3]);
    let orig = std::fs::read(&victim).unwrap();
    std::fs::write(&victim, &orig[..orig.len() - 1]).unwrap();
    let (ok, out, _) = forge(&["verify", s(&b)]);
    assert!(!ok && out.contains(&files[3]) && out.contains("the inventory says"), "{out}");
    std::fs::remove_file(&victim).unwrap();
    let (ok, out, _) = forge(&["verify", s(&b)]);
    assert!(!ok && out.contains(&files[3]) && out.contains("missing"), "{out}");
    std::fs::write(&victim, &orig).unwrap();
    std::fs::write(b.join("model/stray.bin"), b"x").unwrap();
    let (ok, out, _) = forge(&["verify", s(&b)]);
    assert!(!ok && out.contains("stray.bin") && out.contains("not in the inventory"), "{out}");
    let (ok, err) = logits(&b, &ids, &dir.join("x.npy"), &[]);
    assert!(!ok && err.contains("stray.bin"), "{err}");
    // --no-verify loads it anyway.
    let (ok, err) = logits(&b, &ids, &dir.join("x.npy"), &["--no-verify"]);
    assert!(ok, "{err}");
    std::fs::remove_file(b.join("model/stray.bin")).unwrap();
    let (ok, out, err) = forge(&["verify", s(&b), "--full"]);
    assert!(ok, "{out}{err}");
}

#[test]
fn a_full_verification_is_trusted_while_sizes_and_times_are_unchanged() {
    let dir = tmpdir("bundle-trust");
    let (b, ids) = make_bundle(&dir, "b");
    // Alter NOTICE.md's bytes but keep its size and modification time: the load trusts the
    // recorded verification (no hashing), and only a full verification sees the change.
    let p = b.join("NOTICE.md");
    let mtime = std::fs::metadata(&p).unwrap().modified().unwrap();
    let mut bytes = std::fs::read(&p).unwrap();
    bytes[0] ^= 0x20;
    std::fs::write(&p, &bytes).unwrap();
    std::fs::File::options().write(true).open(&p).unwrap().set_modified(mtime).unwrap();
    let (ok, err) = logits(&b, &ids, &dir.join("x.npy"), &[]);
    assert!(ok, "{err}");
    let (ok, out, _) = forge(&["verify", s(&b), "--full"]);
    assert!(!ok && out.contains("NOTICE.md"), "{out}");
    // Once the modification time moves, the load hashes again and refuses the file.
    std::fs::write(&p, &bytes).unwrap();
    let (ok, err) = logits(&b, &ids, &dir.join("x.npy"), &[]);
    assert!(!ok && err.contains("NOTICE.md"), "{err}");
}

#[test]
fn a_malformed_release_json_is_a_clear_error() {
    let dir = tmpdir("bundle-malformed");
    let (b, ids) = make_bundle(&dir, "b");
    let good = std::fs::read_to_string(b.join("release.json")).unwrap();
    let cases = [
        ("{ not json", "release.json"),
        (&good.replacen("forge-release/1", "forge-release/9", 1), "format"),
        (&good.replacen("\"path\": \"NOTICE.md\"", "\"path\": \"../NOTICE.md\"", 1), "relative path inside the bundle"),
        (&good.replacen("\"model\": \"model\"", "\"model\": \"/etc\"", 1), "field 'model'"),
    ];
    for (text, needle) in cases {
        std::fs::write(b.join("release.json"), text).unwrap();
        for args in
            [vec!["verify", s(&b)], vec!["logits", "--model", s(&b), "--tokens", s(&ids), "--output", "/dev/null"]]
        {
            let (ok, _, err) = forge(&args);
            assert!(!ok && !err.contains("panicked"), "{args:?}: {err}");
            assert!(err.contains("release.json") && err.contains(needle), "{args:?} lacks '{needle}': {err}");
        }
    }
}

#[test]
fn a_drafter_must_share_the_targets_tokenizer() {
    let dir = tmpdir("bundle-drafter");
    let export = fixtures().join("qwen35_tiny_upstream_export");
    // The export's own BF16 source drafts for it: same vocabulary, paired.
    let out = dir.join("paired");
    let (ok, _, err) = forge(&["bundle", s(&export), "--draft", s(&fixtures().join("qwen35_tiny")), "--out", s(&out)]);
    assert!(ok, "{err}");
    let rel: serde_json::Value = serde_json::from_slice(&std::fs::read(out.join("release.json")).unwrap()).unwrap();
    assert_eq!(rel["drafter"], "drafter");
    assert_eq!(rel["pairing"]["drafter"]["kind"], "checkpoint");
    let (ok, out_text, err) = forge(&["verify", s(&out), "--full"]);
    assert!(ok, "{out_text}{err}");
    // A model with another vocabulary is refused, and nothing is left behind.
    let bad = dir.join("unpaired");
    let (ok, _, err) = forge(&["bundle", s(&export), "--draft", s(&fixtures().join("llama_tiny")), "--out", s(&bad)]);
    assert!(!ok && err.contains("tokenizer differs"), "{err}");
    assert!(!bad.exists() && !dir.join(".unpaired.partial").exists());
}
