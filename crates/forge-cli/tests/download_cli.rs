//! `forge download` and `forge check-update` against the mock hub of forge-hub's tests.

mod common;
#[path = "../../forge-hub/tests/common/mock_hub.rs"]
mod mock_hub;

use mock_hub::{noise, MockHub};
use std::process::Command;

/// Run the binary with a clean hub environment plus `env`: (exit code, stdout, stderr).
fn forge(args: &[&str], env: &[(&str, &str)]) -> (i32, String, String) {
    let mut c = Command::new(env!("CARGO_BIN_EXE_forge"));
    c.args(args).env_remove("HF_ENDPOINT").env_remove("HF_TOKEN");
    for (k, v) in env {
        c.env(k, v);
    }
    let out = c.output().unwrap();
    let s = |b: &[u8]| String::from_utf8_lossy(b).into_owned();
    (out.status.code().unwrap_or(-1), s(&out.stdout), s(&out.stderr))
}

#[test]
fn download_and_check_update_through_the_cli() {
    let hub = MockHub::start();
    let w1 = noise(5, 400_000);
    let c1 = hub.commit("org/tiny", &["main"], &[("config.json", br#"{"a": 1}"#, false), ("model.gguf", &w1, true)]);
    hub.with(|s| s.repos.get_mut("org/tiny").unwrap().token = Some("hf_cli".into()));
    let dir = common::tmpdir("download").join("tiny");
    let d = dir.to_str().unwrap();

    let (code, _, err) = forge(&["download", "org/tiny", "--dir", d, "--retries", "0"], &[("HF_ENDPOINT", &hub.url)]);
    assert_eq!(code, 1);
    assert!(err.contains("HF_TOKEN") && !err.contains("panicked"), "{err}");

    let env = [("HF_ENDPOINT", hub.url.as_str()), ("HF_TOKEN", "hf_cli")];
    hub.clear_requests();
    let (code, out, err) = forge(&["download", "org/tiny", "--dir", d, "--jobs", "2"], &env);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains(&c1), "{out}");
    assert_eq!(std::fs::read(dir.join("model.gguf")).unwrap(), w1);
    assert_eq!(std::fs::read(dir.join("config.json")).unwrap(), br#"{"a": 1}"#);
    let reqs = hub.requests();
    assert!(reqs.len() >= 3);
    assert!(reqs
        .iter()
        .filter(|r| !r.path.starts_with("/lfs-cdn/"))
        .all(|r| r.header("authorization") == Some("Bearer hf_cli")));

    // The endpoint comes from the record; the token still from the environment.
    let (code, out, err) = forge(&["check-update", d, "--json"], &[("HF_TOKEN", "hf_cli")]);
    assert_eq!(code, 0, "{err}");
    let j: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(j["status"], "up-to-date");
    assert_eq!(j["remote_commit"], c1.as_str());

    let c2 = hub.commit(
        "org/tiny",
        &["main"],
        &[("config.json", br#"{"a": 1}"#, false), ("model.gguf", &noise(6, 400_000), true)],
    );
    let (code, out, err) = forge(&["check-update", d], &[("HF_TOKEN", "hf_cli")]);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("weights changed") && out.contains("model.gguf"), "{out}");
    assert!(out.contains(&format!("forge download org/tiny@{c2} --dir {d}-{}", &c2[..7])), "{out}");

    let (code, _, err) = forge(&["download", "org/none", "--dir", d], &env);
    assert_eq!(code, 1);
    let lines: Vec<&str> = err.lines().filter(|l| !l.trim().is_empty()).collect();
    assert_eq!(lines.len(), 1, "{err}");
    assert!(lines[0].contains("'org/none'") && lines[0].contains("not found"), "{err}");
}
