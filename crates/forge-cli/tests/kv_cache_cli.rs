//! `--kv-cache-dtype` reaches the sessions of every command that runs a model: `logits` with
//! each type against the transformers fixture (f32 within rounding, the others moved by their
//! rounding, so the type took effect), `generate`, and `bench --context N --fill random`.

mod common;

use common::{forge, tmpdir};
use std::path::PathBuf;

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../../tests/fixtures")).join(name)
}

#[test]
fn every_cache_type_reaches_logits_and_generate() {
    let dir = fixture("qwen35_tiny_mm");
    let tmp = tmpdir("kv-types");
    let tokens = dir.join("tokens.txt");
    let (_, want) = forge_core::npy::read_npy(&dir.join("logits.npy")).unwrap();
    for (dtype, lo, hi) in [("f32", 0.0, 1.5e-4), ("f16", 1e-7, 2e-2), ("v8", 1e-6, 0.1), ("kv8", 1e-6, 0.25)] {
        let out = tmp.join(format!("{dtype}.npy"));
        let (ok, _, err) = forge(&[
            "--kv-cache-dtype",
            dtype,
            "logits",
            "--model",
            dir.to_str().unwrap(),
            "--tokens",
            tokens.to_str().unwrap(),
            "--output",
            out.to_str().unwrap(),
        ]);
        assert!(ok, "{dtype}: {err}");
        let (_, got) = forge_core::npy::read_npy(&out).unwrap();
        let e = got.iter().zip(&want).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
        eprintln!("{dtype}: max |Δlogit| {e:.2e} against transformers");
        assert!(e >= lo && e < hi, "{dtype}: {e} outside [{lo}, {hi})");
    }
    let ids = tmp.join("ids.txt");
    let (ok, _, err) = forge(&[
        "--kv-cache-dtype",
        "kv8",
        "generate",
        "--model",
        dir.to_str().unwrap(),
        "--prompt-ids",
        tokens.to_str().unwrap(),
        "--max-tokens",
        "4",
        "--temperature",
        "0",
        "--output-ids",
        ids.to_str().unwrap(),
    ]);
    assert!(ok, "generate with kv8: {err}");
    assert_eq!(std::fs::read_to_string(&ids).unwrap().split_whitespace().count(), 4);
    let _ = std::fs::remove_dir_all(&tmp);
}

#[test]
fn bench_times_decode_after_a_filled_context() {
    // The hybrid fixture: an attention cache and DeltaNet states both filled.
    let dir = fixture("qwen35_tiny");
    let bench = |dtype: &str, context: &str| -> serde_json::Value {
        let (ok, out, err) = forge(&[
            "--threads",
            "2",
            "--kv-cache-dtype",
            dtype,
            "bench",
            "--model",
            dir.to_str().unwrap(),
            "--context",
            context,
            "--fill",
            "random",
            "--gen-tokens",
            "4",
            "--repeats",
            "1",
            "--bandwidth-gib",
            "0.01",
            "--json",
        ]);
        assert!(ok, "bench --context {context} --fill random ({dtype}): {err}");
        serde_json::from_str(&out).unwrap()
    };
    let j = bench("kv8", "300");
    assert_eq!((j["kv_cache_dtype"].as_str(), j["context"].as_u64()), (Some("kv8"), Some(300)), "{j}");
    assert!(j["decode_tok_s"].as_f64().unwrap() > 0.0, "{j}");
    assert!(j["peak_rss_bytes"].as_f64().unwrap() > 0.0, "{j}");
    let kv = |j: &serde_json::Value| j["memory_bytes"]["kv_cache_used"].as_f64().unwrap();
    // Pages held cover the positions stored, less than a page (256 positions) more.
    let held = j["memory_bytes"]["kv_cache"].as_f64().unwrap();
    assert!(held >= kv(&j) && held < kv(&j) * (300.0 + 256.0) / 300.0, "{j}");
    assert!(j["memory_bytes"]["recurrent_state"].as_f64().unwrap() > 0.0, "{j}");
    // The caches hold the context: twice the positions, about twice the bytes used; f32 about
    // four times kv8's.
    let (j2, j32) = (bench("kv8", "600"), bench("f32", "300"));
    assert!(kv(&j2) > 1.8 * kv(&j) && kv(&j2) < 2.2 * kv(&j), "{j} {j2}");
    assert!(kv(&j32) > 3.0 * kv(&j) && kv(&j32) < 4.0 * kv(&j), "{j} {j32}");
    // Each flag needs the other; `random` is the only fill (clap's usage errors).
    let d = dir.to_str().unwrap();
    for (args, needle) in [
        (&["bench", "--model", d, "--fill", "random"][..], "--context"),
        (&["bench", "--model", d, "--context", "64"][..], "--fill"),
        (&["bench", "--model", d, "--context", "64", "--fill", "zeros"][..], "zeros"),
    ] {
        let (ok, _, err) = forge(args);
        assert!(!ok && err.contains(needle) && !err.contains("panicked"), "{args:?}: {err}");
    }
}
