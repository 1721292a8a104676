//! `forge quantize`'s defaults and its end-of-run check, on the tiny transformers fixtures: a run
//! with only a format rotates every MLP, token-mixer and head input (`--rotate none` rotates
//! nothing); the check records a working export as such and flags a broken one.

use forge_core::checkpoint::Checkpoint;
use forge_kernels::lut::Format;
use forge_model::load::load;
use forge_quant::check::{Check, Teacher};
use forge_quant::quantize::{quantize, Method, Outcome};
use forge_quant::recipe::{resolve, Choices};
use safetensors::tensor::TensorView;
use safetensors::{Dtype, SafeTensors};
use std::path::{Path, PathBuf};

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../../tests/fixtures")).join(name)
}

fn tmp(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("forge-dc-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    d
}

/// Quantize `src` with the command line's choices `f` applied to `--format FORMAT`.
fn run(src: &Path, format: &str, out: &Path, f: impl FnOnce(&mut Choices)) -> Outcome {
    let mut c = Choices::new();
    c.format = Some(format.into());
    f(&mut c);
    let o = resolve(&c).unwrap().options(&src.to_string_lossy(), src.to_path_buf(), out.to_path_buf(), 0);
    quantize(&o).unwrap_or_else(|e| panic!("{}: {e:#}", out.display()))
}

fn manifest(out: &Path) -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(out.join("forge.json")).unwrap()).unwrap()
}

#[test]
fn a_default_run_rotates_every_input_and_rotate_none_none() {
    for src in ["llama_tiny", "qwen35_tiny"] {
        let out = tmp(&format!("default-{src}"));
        run(&fixture(src), "lut4", &out, |_| {});
        let q = load(&out).unwrap();
        let mut rotated = 0;
        for l in q.model.linears() {
            // DeltaNet's tiny a/b projections stay BF16, which is never rotated.
            if l.name.ends_with("in_proj_a") || l.name.ends_with("in_proj_b") {
                continue;
            }
            assert!(l.rotation.is_some(), "{src}: {} is not rotated by default", l.name);
            rotated += 1;
        }
        assert!(rotated > 8, "{src}: {rotated} matrices");
        let plan = &manifest(&out)["options"]["plan"];
        assert_eq!(
            (&plan["basis"], &plan["mixer_basis"], &plan["head_basis"]),
            (&"online".into(), &"online".into(), &"online".into())
        );

        let out = tmp(&format!("none-{src}"));
        run(&fixture(src), "lut4", &out, |c| c.rotate = Some("none".into()));
        let q = load(&out).unwrap();
        for l in q.model.linears() {
            assert!(l.rotation.is_none(), "{src}: {} is rotated under --rotate none", l.name);
        }
    }
}

/// A copy of the llama fixture whose layers' weights carry two huge input columns each: a
/// per-row INT8 scale then spends its range on them, and without rotations the rest of each row
/// rounds to zero.
fn nonsense_fixture() -> PathBuf {
    let dir = tmp("nonsense-src");
    std::fs::create_dir_all(&dir).unwrap();
    for f in ["config.json", "generation_config.json"] {
        std::fs::copy(fixture("llama_tiny").join(f), dir.join(f)).unwrap();
    }
    let bytes = std::fs::read(fixture("llama_tiny").join("model.safetensors")).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let mut tensors: Vec<(String, Dtype, Vec<usize>, Vec<u8>)> = Vec::new();
    for (name, v) in st.tensors() {
        let mut data = v.data().to_vec();
        let linear = name.ends_with("proj.weight");
        if linear && v.dtype() == Dtype::F32 && v.shape().len() == 2 {
            let cin = v.shape()[1];
            for (i, b) in data.chunks_exact_mut(4).enumerate() {
                if i % cin == 3 || i % cin == 17 {
                    let x = f32::from_le_bytes(b.try_into().unwrap()) * 3000.0;
                    b.copy_from_slice(&x.to_le_bytes());
                }
            }
        }
        tensors.push((name, v.dtype(), v.shape().to_vec(), data));
    }
    let views: Vec<(String, TensorView)> =
        tensors.iter().map(|(n, dt, s, d)| (n.clone(), TensorView::new(*dt, s.clone(), d).unwrap())).collect();
    std::fs::write(dir.join("model.safetensors"), safetensors::serialize(views, None).unwrap()).unwrap();
    dir
}

#[test]
fn the_check_passes_a_working_export_and_flags_a_broken_one() {
    // INT8 with the default rotations: far inside its expectation.
    let out = tmp("good");
    let good = run(&fixture("llama_tiny"), "int8", &out, |c| {
        c.kv = Some("int8".into());
        c.head = Some("int8".into());
    });
    let c = good.check.as_ref().expect("the check runs by default");
    assert!(!c.broken(), "{:?}", c.problems);
    assert!(c.kl < 0.01 && c.positions > 200, "{c:?}");
    assert_eq!(manifest(&out)["check"]["verdict"], "ok");
    assert!(c.warning().is_none());

    // Nonsense: weights with planted outlier columns, no rotations.
    let src = nonsense_fixture();
    let out = tmp("broken");
    let bad = run(&src, "int8", &out, |c| {
        c.rotate = Some("none".into());
        c.head = Some("int8".into());
    });
    let c = bad.check.as_ref().unwrap();
    assert!(c.broken(), "KL {} against limit {}", c.kl, c.limit);
    assert!(c.warning().unwrap().contains("looks broken"));
    let m = manifest(&out);
    assert_eq!(m["check"]["verdict"], "broken");
    assert!(m["check"]["problems"][0].as_str().unwrap().contains("quick KL"));

    // The same measurement through the library: the source against a copy whose head is negated
    // is far off INT8's expectation, and the source against itself is not.
    let (ck, cfg) = Checkpoint::open(&fixture("llama_tiny")).unwrap();
    let teacher_model = forge_model::Model::load(&ck, cfg.clone()).unwrap();
    let (rows, text) = forge_quant::check::check_rows(None, cfg.vocab_size, 128);
    let t = Teacher::new(&teacher_model, rows, text.clone()).unwrap();
    let (kl, top1, n) = t.measure(&teacher_model).unwrap();
    assert_eq!((kl, top1, n), (0.0, 1.0, 128));
    let mut garbled = forge_model::Model::load(&ck, cfg).unwrap();
    let w: Vec<f32> = garbled.head.effective_weight().unwrap().iter().map(|v| -v).collect();
    garbled.head = forge_model::Linear::dense(
        "lm_head".to_string(),
        forge_core::tensor::HostTensor::from_f32(vec![garbled.head.out_f, garbled.head.in_f], w),
        None,
    );
    let (kl, top1, n) = t.measure(&garbled).unwrap();
    let expected = forge_quant::check::expected_kl(Format::Int8, Method::Rtn);
    assert!(Check::judge(kl, top1, n, text, expected, vec![]).broken(), "KL {kl}");
}

/// An untied model's check is carried through the run layer by layer while each layer leaves
/// memory once written; it gives the bits of the whole-model check: the source's forward
/// against the export's, both loaded whole (the export with the source's embedding, as the run
/// holds it: the export stores it in FP16).
#[test]
fn the_streamed_check_equals_the_whole_model_check() {
    for src in ["llama_tiny", "qwen35_tiny"] {
        let out = tmp(&format!("streamed-{src}"));
        let o = run(&fixture(src), "lut4", &out, |c| c.head = Some("lut4".into()));
        let streamed = o.check.as_ref().unwrap();
        let (ck, cfg) = Checkpoint::open(&fixture(src)).unwrap();
        assert!(!cfg.tie_embeddings, "{src}: the streamed path is the untied one");
        let source = forge_model::Model::load(&ck, cfg.clone()).unwrap();
        let (rows, text) = forge_quant::check::check_rows(None, cfg.vocab_size, forge_quant::check::DEFAULT_TOKENS);
        let t = Teacher::new(&source, rows, text).unwrap();
        let mut export = load(&out).unwrap().model;
        export.embed = source.embed.clone();
        let (kl, top1, n) = t.measure(&export).unwrap();
        assert_eq!((streamed.kl, streamed.top1, streamed.positions), (kl, top1, n), "{src}");
        assert!(kl > 1e-4, "{src}: a lut4 export differs from its source (KL {kl})");
        let _ = std::fs::remove_dir_all(out);
    }
}
