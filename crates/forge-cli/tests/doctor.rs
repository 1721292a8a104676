//! `forge doctor` on fixtures of each outcome: OK, WARN and FAIL lines with their fixes, exit
//! status 1 exactly when a check fails.

mod common;
use common::{forge, tmpdir};
use std::path::{Path, PathBuf};

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures")
}

/// The line of check `name`.
fn line<'a>(out: &'a str, name: &str) -> &'a str {
    out.lines()
        .find(|l| l.get(5..).is_some_and(|r| r.starts_with(name)))
        .unwrap_or_else(|| panic!("no '{name}' line in:\n{out}"))
}

fn free_port() -> u16 {
    std::net::TcpListener::bind(("127.0.0.1", 0)).unwrap().local_addr().unwrap().port()
}

#[test]
fn a_model_that_fits_passes_every_check() {
    let port = free_port().to_string();
    let export = fixtures().join("qwen35_tiny_upstream_export");
    let (ok, out, err) = forge(&["doctor", "--model", export.to_str().unwrap(), "--ctx-size", "4096", "--port", &port]);
    assert!(ok, "{out}{err}");
    for name in ["cpu", "threads", "model", "memory (kv f32)", "memory (kv v8)", "port"] {
        assert!(line(&out, name).starts_with("OK"), "{name}: {out}");
    }
    // No compiled cache beside the export: a warning with the command that makes one.
    let c = line(&out, "compiled cache");
    assert!(c.starts_with("WARN"), "{out}");
    assert!(out.contains("fix: forge compile --model"), "{out}");
    // The tiny hybrid: 2 attention layers × 2 KV heads × head_dim 16 × (k + v) × 4 bytes.
    let json =
        forge(&["doctor", "--model", export.to_str().unwrap(), "--ctx-size", "1000", "--port", &port, "--json"]).1;
    let v: serde_json::Value = serde_json::from_str(&json).unwrap();
    let f32_line = v.as_array().unwrap().iter().find(|c| c["name"] == "memory (kv f32)").unwrap();
    assert!(f32_line["detail"].as_str().unwrap().contains("at 1000 tokens"), "{f32_line}");
}

#[test]
fn a_context_that_cannot_fit_fails_with_the_fix() {
    let export = fixtures().join("qwen35_tiny_upstream_export");
    let (ok, out, _) = forge(&[
        "doctor",
        "--model",
        export.to_str().unwrap(),
        "--ctx-size",
        "1000000000000",
        "--port",
        &free_port().to_string(),
    ]);
    assert!(!ok);
    let c = line(&out, "memory (kv f32)");
    assert!(c.starts_with("FAIL"), "{out}");
    assert!(out.contains("fix: a smaller --ctx-size"), "{out}");
}

#[test]
fn a_busy_port_a_missing_model_and_a_tampered_bundle_fail() {
    let l = std::net::TcpListener::bind(("127.0.0.1", 0)).unwrap();
    let busy = l.local_addr().unwrap().port().to_string();
    let (ok, out, _) = forge(&["doctor", "--port", &busy]);
    assert!(!ok && line(&out, "port").starts_with("FAIL"), "{out}");
    let (ok, out, _) = forge(&["doctor", "--model", "/nonexistent/model", "--port", &free_port().to_string()]);
    assert!(!ok && line(&out, "model").starts_with("FAIL") && out.contains("/nonexistent/model"), "{out}");
    let dir = tmpdir("doctor-bundle");
    let b = dir.join("b");
    let (ok, _, err) = forge(&[
        "bundle",
        fixtures().join("qwen35_tiny_upstream_export").to_str().unwrap(),
        "--out",
        b.to_str().unwrap(),
    ]);
    assert!(ok, "{err}");
    let (ok, out, _) = forge(&["doctor", "--model", b.to_str().unwrap(), "--port", &free_port().to_string()]);
    assert!(ok && line(&out, "bundle").starts_with("OK"), "{out}");
    std::fs::write(b.join("model/forge.json"), b"{}").unwrap();
    let (ok, out, _) = forge(&["doctor", "--model", b.to_str().unwrap(), "--port", &free_port().to_string()]);
    assert!(!ok && line(&out, "bundle").starts_with("FAIL") && out.contains("forge.json"), "{out}");
}
