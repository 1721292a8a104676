//! `forge sensitivity` and `forge plan` end to end on the tiny hybrid fixture: the sweep covers
//! every part in every format, a coarser format costs more KL than a finer one, a killed sweep
//! resumes to the same file, and the plan keeps to its budget and quantizes into an export whose
//! matrices have the planned formats.

mod common;
use common::{forge, tmpdir};
use serde_json::Value;
use std::path::{Path, PathBuf};

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures").join(name)
}

fn read(p: &Path) -> Value {
    serde_json::from_str(&std::fs::read_to_string(p).unwrap()).unwrap()
}

#[test]
fn sweep_then_plan_then_quantize() {
    let dir = tmpdir("sens");
    let model = fixture("qwen35_tiny");
    let base = dir.join("base");
    let s = |p: &Path| p.to_str().unwrap().to_string();
    let (ok, _, err) = forge(&[
        "quantize",
        "--model",
        &s(&model),
        "--format",
        "lut4",
        "--kv",
        "lut4",
        "--head",
        "lut4",
        "--output",
        &s(&base),
    ]);
    assert!(ok, "{err}");
    let out = dir.join("sens.json");
    let (bs, os) = (s(&base), s(&out));
    let sweep = || forge(&["sensitivity", "--base", &bs, "--formats", "lut2,int8", "--tokens", "64", "--out", &os]);
    let (ok, stdout, err) = sweep();
    assert!(ok, "{err}");
    assert!(stdout.contains("parts × 2 formats"), "{stdout}");
    let sens = read(&out);
    let parts = sens["parts"].as_array().unwrap();
    let cfg = read(&model.join("config.json"));
    let text = if cfg.get("text_config").is_some() { &cfg["text_config"] } else { &cfg };
    let types = text["layer_types"].as_array().unwrap();
    let (layers, attention) = (types.len(), types.iter().filter(|t| *t == "full_attention").count());
    // mixer, mlp_in, down per layer, K/V per attention layer, and the head.
    assert_eq!(parts.len(), 3 * layers + attention + 1);
    let (mut lut2, mut int8) = (0.0, 0.0);
    for p in parts {
        let o = p["options"].as_object().unwrap();
        assert_eq!(o.len(), 3, "{p}");
        assert_eq!(o["lut4"]["dkl"], 0.0, "the base's own format costs nothing: {p}");
        assert!(
            o["lut2"]["bpw"].as_f64() < o["lut4"]["bpw"].as_f64()
                && o["lut4"]["bpw"].as_f64() < o["int8"]["bpw"].as_f64()
        );
        lut2 += o["lut2"]["dkl"].as_f64().unwrap();
        int8 += o["int8"]["dkl"].as_f64().unwrap();
    }
    assert!(lut2 > 0.0 && lut2 > int8, "lut2 {lut2}, int8 {int8}");
    assert!(std::fs::read_to_string(out.with_extension("svg")).unwrap().starts_with("<svg"));
    // A sweep cut short after five parts (its partial file, keyed by the arguments as the
    // command writes it) resumes to the same file.
    let key = serde_json::json!({"base": s(&base), "formats": ["lut2", "int8"], "tokens": 64, "text": sens["text"]});
    let partial = serde_json::json!({"key": key, "parts": parts[..5].to_vec()});
    let partial_path = PathBuf::from(format!("{}.partial", out.display()));
    std::fs::write(&partial_path, serde_json::to_string(&partial).unwrap()).unwrap();
    let first = std::fs::read(&out).unwrap();
    let (ok, _, err) = sweep();
    assert!(ok, "{err}");
    assert!(std::fs::read(&out).unwrap() == first, "the resumed sweep differs");
    assert!(!partial_path.exists());

    // A budget between all-lut2 and all-int8.
    let plan = dir.join("plan.json");
    let (ok, stdout, err) = forge(&["plan", "--sensitivity", &s(&out), "--bpw", "4.5", "--out", &s(&plan)]);
    assert!(ok, "{err}");
    let bpw: f64 = stdout.split("plan: ").nth(1).unwrap().split(' ').next().unwrap().parse().unwrap();
    assert!(bpw <= 4.5, "{stdout}");
    let (ok, _, err) = forge(&["plan", "--sensitivity", &s(&out), "--bpw", "1", "--out", &s(&plan)]);
    assert!(!ok && err.contains("below the cheapest plan"), "{err}");
    let p = read(&plan);
    let mixed = dir.join("mixed");
    let (ok, _, err) =
        forge(&["quantize", "--model", &s(&model), "--plan", &s(&plan), "--check-tokens", "0", "--output", &s(&mixed)]);
    assert!(ok, "{err}");
    let m = read(&mixed.join("forge.json"));
    let recorded = &m["options"]["plan"];
    for (k, v) in p.as_object().unwrap() {
        if k.contains('.') && !k.ends_with("basis") {
            assert_eq!(recorded[k], *v, "plan key {k}");
        }
    }
}
