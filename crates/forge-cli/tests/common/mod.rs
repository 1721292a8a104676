//! Helpers shared by the tests that run the `forge` binary.
#![allow(dead_code)] // each test binary uses its own subset

use std::path::PathBuf;
use std::process::Command;

/// Run the binary: (success, stdout, stderr).
pub fn forge(args: &[&str]) -> (bool, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_forge")).args(args).output().unwrap();
    (out.status.success(), String::from_utf8_lossy(&out.stdout).into(), String::from_utf8_lossy(&out.stderr).into())
}

/// A fresh, empty directory under the temp dir, unique to this process.
pub fn tmpdir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("forge-cli-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// Fails with exactly one stderr line containing every `needle`, and no panic.
pub fn expect_error(args: &[&str], needles: &[&str]) {
    let (ok, _, err) = forge(args);
    assert!(!ok, "expected failure for {args:?}");
    assert!(!err.contains("panicked"), "panic for {args:?}: {err}");
    let lines: Vec<&str> = err.lines().filter(|l| !l.trim().is_empty()).collect();
    assert_eq!(lines.len(), 1, "expected one error line for {args:?}, got: {err}");
    for n in needles {
        assert!(err.contains(n), "error for {args:?} lacks '{n}': {err}");
    }
}
