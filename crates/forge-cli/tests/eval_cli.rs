//! `forge eval` through the binary: reference → kl of the teacher against itself (KL 0, top-1
//! 100 %, the .npy and JSON outputs), ppl, and bad input as one-line errors. Uses the real SmolLM2
//! (tools/setup.sh) on two 64-token windows of `data/eval/prose.txt`.

mod common;

use common::{expect_error, forge};
use std::path::PathBuf;

fn data_dir() -> String {
    concat!(env!("CARGO_MANIFEST_DIR"), "/../../data").to_string()
}

#[test]
fn reference_then_kl_of_the_teacher_against_itself() {
    let d = std::env::temp_dir().join(format!("forge-cli-eval-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    let (refdir, npy, json) = (d.join("ref"), d.join("kl.npy"), d.join("kl.json"));
    let dd = data_dir();
    let win =
        ["--data-dir", &dd, "--text", "eval/prose.txt:3000", "--ctx", "64", "--chunks", "2", "--score-from", "16"];
    let mut args = vec!["--threads", "2", "eval", "reference", "--model", "smollm2", "--top-k", "32", "--json"];
    args.extend(win);
    args.extend(["--out", refdir.to_str().unwrap()]);
    let (ok, out, err) = forge(&args);
    assert!(ok, "{err}");
    let m: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!((m["positions"].as_u64(), m["top_k"].as_u64(), m["windows"].as_u64()), (Some(94), Some(32), Some(2)));
    assert!(err.contains("teacher perplexity"), "{err}");

    let (ok, out, err) = forge(&[
        "eval",
        "kl",
        "--ref",
        refdir.to_str().unwrap(),
        "--model",
        "smollm2",
        "--kl-npy",
        npy.to_str().unwrap(),
        "--json-out",
        json.to_str().unwrap(),
        "--json",
    ]);
    assert!(ok, "{err}");
    let s: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(s["kl"]["mean"].as_f64(), Some(0.0));
    assert_eq!(s["kl"]["max"].as_f64(), Some(0.0));
    assert_eq!(s["top1_agreement"].as_f64(), Some(1.0));
    assert_eq!(s["kl_method"].as_str(), Some("top-32 + tail"));
    let (pc, pt) = (s["ppl_candidate"].as_f64().unwrap(), s["ppl_teacher"].as_f64().unwrap());
    // The same model and windows both ways: what differs is the rounding of the reference's
    // stored log-probabilities against the ones computed now (a few times what it comes to).
    const PPL_TOL: f64 = 2e-8;
    assert!((pc - pt).abs() < PPL_TOL * pt, "{pc} vs {pt}");
    assert_eq!(serde_json::from_slice::<serde_json::Value>(&std::fs::read(&json).unwrap()).unwrap(), s);
    let (shape, kl) = forge_core::npy::read_npy(&npy).unwrap();
    assert_eq!((shape, kl.iter().all(|&x| x == 0.0)), (vec![94], true));
    assert!(err.contains("top-1 agreement 100.000 %"), "{err}");

    // Plain perplexity over the same windows equals the teacher's from the reference.
    let mut args = vec!["eval", "ppl", "--model", "smollm2", "--json"];
    args.extend(win);
    let (ok, out, err) = forge(&args);
    assert!(ok, "{err}");
    let p: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert!((p["ppl"].as_f64().unwrap() - pt).abs() < PPL_TOL * pt);

    let r = refdir.to_str().unwrap();
    expect_error(&["eval", "kl", "--ref", r, "--model", "smollm2", "--parts", "ffn"], &["unknown part 'ffn'"]);
    expect_error(&["eval", "kl", "--ref", r, "--model", "smollm2", "--parts", "mlp", "--layers", "0-3"], &["--parts"]);
    expect_error(&["eval", "kl", "--ref", r, "--model", "smollm2", "--full-vocab"], &["--full-vocab"]);
    let fixture = concat!(env!("CARGO_MANIFEST_DIR"), "/../../tests/fixtures/llama_tiny");
    expect_error(&["eval", "kl", "--ref", r, "--model", fixture], &["vocabulary size"]);
    let mut args = vec!["eval", "reference", "--model", "smollm2", "--out", r];
    args.extend(win);
    expect_error(&args, &["already exists"]);
    std::fs::remove_dir_all(&d).ok();
}

#[test]
fn bad_eval_input_is_one_line_errors() {
    let missing = PathBuf::from("/nonexistent/ref");
    expect_error(&["eval", "kl", "--ref", missing.to_str().unwrap(), "--model", "smollm2"], &["/nonexistent/ref"]);
    let dd = data_dir();
    expect_error(
        &["eval", "ppl", "--model", "smollm2", "--protocol", "llama-perplexity", "--data-dir", &dd, "--ctx", "256"],
        &["--ctx 256 conflicts"],
    );
    expect_error(&["eval", "ppl", "--model", "smollm2", "--protocol", "wikitext"], &["unknown protocol"]);
    expect_error(&["eval", "ppl", "--model", "smollm2", "--text", "/nonexistent/t.txt"], &["/nonexistent/t.txt"]);
    expect_error(
        &["eval", "ppl", "--model", "smollm2", "--data-dir", &dd, "--text", "eval/prose.txt:100"],
        &["fewer than one window"],
    );
    expect_error(&["eval", "ppl", "--model", "smollm2"], &["--text"]);
}

/// `--parts/--layers` ablations on a quantized SmolLM2: selecting no linear at all (SmolLM2 has
/// no DeltaNet) is the teacher exactly (KL 0); selecting every linear is the full export (the
/// same KL as without a filter); one part of a few layers lies strictly in between.
#[test]
fn kl_ablations_select_the_quantized_linears() {
    let d = std::env::temp_dir().join(format!("forge-cli-ablate-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    let (refdir, export) = (d.join("ref"), d.join("q"));
    let (ok, _, err) = forge(&[
        "--threads",
        "2",
        "quantize",
        "--model",
        "smollm2",
        "--format",
        "lut4",
        "--kv",
        "lut4",
        "--head",
        "lut4",
        "--rotate",
        "mlp,mixer,head",
        "--output",
        export.to_str().unwrap(),
    ]);
    assert!(ok, "{err}");
    let dd = data_dir();
    let win =
        ["--data-dir", &dd, "--text", "eval/prose.txt:2000", "--ctx", "64", "--chunks", "1", "--score-from", "16"];
    let mut args = vec!["--threads", "2", "eval", "reference", "--model", "smollm2", "--top-k", "32"];
    args.extend(win);
    args.extend(["--out", refdir.to_str().unwrap()]);
    let (ok, _, err) = forge(&args);
    assert!(ok, "{err}");
    let kl = |extra: &[&str]| -> f64 {
        let npy = d.join("kl.npy");
        let mut args = vec!["--threads", "2", "eval", "kl", "--ref", refdir.to_str().unwrap()];
        args.extend(["--model", export.to_str().unwrap(), "--kl-npy", npy.to_str().unwrap(), "--json"]);
        args.extend(extra);
        let (ok, out, err) = forge(&args);
        assert!(ok, "{extra:?}: {err}");
        let s: serde_json::Value = serde_json::from_str(&out).unwrap();
        s["kl"]["mean"].as_f64().unwrap()
    };
    let full = kl(&[]);
    assert!(full > 0.0);
    assert_eq!(kl(&["--parts", "gdn"]), 0.0, "no DeltaNet linears in SmolLM2: the teacher itself");
    assert_eq!(kl(&["--parts", "mlp,attn,head", "--layers", "0-29"]), full, "everything selected");
    let part = kl(&["--parts", "mlp", "--layers", "0-3"]);
    assert!(part > 0.0 && part < full, "4 layers' MLPs: {part} vs all {full}");
    let _ = std::fs::remove_dir_all(&d);
}
