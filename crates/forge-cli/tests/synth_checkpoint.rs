//! `forge synth --checkpoint` into `forge quantize`: the release-0.2 plan applied to a synthetic
//! checkpoint gives an export with every matrix in the format and size of the release layout
//! (`forge synth`'s export of the same shape), which loads and runs; `--dry-run` measures the
//! first layer of each kind and projects the rest; `--resume` continues a streamed run.

use std::path::{Path, PathBuf};

mod common;

use common::{expect_error, forge};

fn tmp(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("forge-synthck-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    d
}

fn run(args: &[&str]) -> String {
    let (ok, out, err) = forge(args);
    assert!(ok, "forge {args:?} failed: {err}");
    out
}

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

#[test]
fn the_release_plan_on_a_synthetic_checkpoint_gives_the_release_layout() {
    let ck = tmp("ck");
    run(&["synth", "--checkpoint", "--shape", "tiny", "--output", s(&ck)]);
    let plan = tmp("plan.json");
    let p = forge_quant::synth::Shape::get("tiny").unwrap().plan().unwrap();
    std::fs::write(&plan, serde_json::to_string(&p.to_json()).unwrap()).unwrap();
    let q = tmp("q");
    let calib = format!("ids={}:6", ck.join("calibration.ids").display());
    // Release 0.2 rotates the MLP and mixer inputs, not the head's.
    let common = [
        "--model",
        s(&ck),
        "--plan",
        s(&plan),
        "--rotate",
        "mlp,mixer",
        "--lowrank",
        "64",
        "--calib",
        &calib,
        "--seq",
        "32",
    ];
    run(&[&["quantize"][..], &common[..], &["--holdout", "2", "--output", s(&q)]].concat());

    // The layout `forge synth` writes for the release: same matrices, formats, ranks, sizes.
    let r = tmp("release");
    run(&["synth", "--shape", "tiny", "--output", s(&r)]);
    let (got, want) = (forge_quant::inspect::inspect(&q).unwrap(), forge_quant::inspect::inspect(&r).unwrap());
    assert_eq!(got.matrices.len(), want.matrices.len());
    for (a, b) in got.matrices.iter().zip(&want.matrices) {
        assert_eq!(
            (&a.name, a.format, a.lowrank, a.packed_bytes, &a.rotation),
            (&b.name, b.format, b.lowrank, b.packed_bytes, &b.rotation)
        );
    }
    assert_eq!(got.packed_bytes, want.packed_bytes);
    let m = forge_model::load::load(&q).unwrap().model;
    let mut sess = m.new_session();
    let z = m.forward(&mut sess, &[1, 2, 3], forge_model::Logits::Last).unwrap();
    assert!(z.iter().all(|v| v.is_finite()));

    // A run stopped after its third layer resumes into the same bytes.
    let q2 = tmp("q2");
    let (ok, _, _) = forge(&[&["quantize"][..], &common[..], &["--holdout", "2", "--output", s(&q2)]].concat());
    assert!(ok);
    for l in 3..8 {
        for f in [format!("layer_{l:02}.safetensors"), format!("layer_{l:02}_mixer.safetensors")] {
            std::fs::remove_file(q2.join(f)).unwrap();
        }
    }
    for f in ["forge.json", "lm_head.safetensors", "embed.safetensors"] {
        std::fs::remove_file(q2.join(f)).unwrap();
    }
    let opts: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(q.join("forge.json")).unwrap()).unwrap();
    std::fs::write(q2.join(".forge-partial.json"), serde_json::to_string_pretty(&opts["options"]).unwrap()).unwrap();
    run(&[&["quantize"][..], &common[..], &["--holdout", "2", "--output", s(&q2), "--resume"]].concat());
    for l in 0..8 {
        let f = format!("layer_{l:02}.safetensors");
        assert_eq!(std::fs::read(q.join(&f)).unwrap(), std::fs::read(q2.join(&f)).unwrap(), "{f}");
    }
    assert_eq!(
        std::fs::read(q.join("lm_head.safetensors")).unwrap(),
        std::fs::read(q2.join("lm_head.safetensors")).unwrap()
    );

    // The dry run: the first four layers (three DeltaNet, one attention) and the head, projected
    // to all eight layers and six rows.
    let out = run(&[&["quantize"][..], &common[..], &["--holdout", "2", "--dry-run", "--json"]].concat());
    let j: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(j["probe_layers"], 4);
    let per: Vec<(String, u64)> = j["projection"]["per_layer"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| (x["kind"].as_str().unwrap().to_string(), x["count"].as_u64().unwrap()))
        .collect();
    assert_eq!(per, [("Attention".to_string(), 2), ("DeltaNet".to_string(), 6)]);
    assert!(j["projection"]["seconds"].as_f64().unwrap() > 0.0);
    assert!(
        j["projection"]["peak_bytes"].as_u64().unwrap() >= j["projection"]["measured_peak_bytes"].as_u64().unwrap()
    );
    for d in [ck, q, q2, r] {
        let _ = std::fs::remove_dir_all(d);
    }
    let _ = std::fs::remove_file(plan);
}

#[test]
fn synth_checkpoint_bad_arguments_fail_with_one_clear_line() {
    let d = tmp("bad");
    expect_error(
        &["synth", "--checkpoint", "--shape", "tiny", "--layers", "9", "--output", s(&d)],
        &["--layers 9", "1 to 8"],
    );
    expect_error(&["synth", "--checkpoint", "--shape", "tiny", "--layers", "0", "--output", s(&d)], &["--layers 0"]);
    let _ = std::fs::remove_dir_all(d);
}
