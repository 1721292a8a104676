//! Loading an export written by an independent Python script in ANEMLL Forge's (upstream) layout.
//!
//! `tests/fixtures/qwen35_tiny_upstream_export/` comes from `tools/make_upstream_export.py` (NumPy only, none of
//! Forge's code): the tiny hybrid `qwen35_tiny` with vector-2x16 MLPs under online block-Hadamard rotations described
//! only by ANEMLL Forge's file-level `basis`/`seed_in`/`seed_mid`/`block` metadata (no per-matrix rotation keys), LUT4
//! token mixers, INT8 attention K/V, BF16 `in_proj_a`/`in_proj_b`, a LUT4 head and rank-4 `lr_a`/`lr_b` factors on
//! two mixer matrices. The script's `logits.npy` is a float64 NumPy forward of the dequantized weights folded back
//! to the original basis; Forge runs the same export with online rotations and LUT/INT8 kernels.
//!
//! Corrupt copies of the export (missing scale, index out of range, wrong codebook shape, truncated file) must fail
//! to load with a one-line error naming the file and the tensor.

use forge_core::tensor::DType;
use forge_model::linear::Weight;
use forge_model::load::load;
use forge_model::model::Mixer;
use forge_model::Logits;
use safetensors::tensor::{Dtype, TensorView};
use safetensors::SafeTensors;
use std::collections::HashMap;
use std::path::{Path, PathBuf};

fn fixtures() -> PathBuf {
    PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../../tests/fixtures"))
}

fn export_dir() -> PathBuf {
    fixtures().join("qwen35_tiny_upstream_export")
}

fn tokens() -> Vec<u32> {
    let text = std::fs::read_to_string(fixtures().join("qwen35_tiny/tokens.txt")).unwrap();
    text.split_whitespace().map(|t| t.parse().unwrap()).collect()
}

/// Run the export at `dir` on tokens.txt; returns (max abs error against the script's logits, rows whose argmax
/// differs).
fn compare_logits(dir: &Path) -> (f32, usize) {
    let loaded = load(dir).unwrap_or_else(|e| panic!("{}: {e:#}", dir.display()));
    let model = &loaded.model;
    let toks = tokens();
    let mut session = model.new_session();
    let got = model.forward(&mut session, &toks, Logits::All).unwrap();
    let (shape, want) = forge_core::npy::read_npy(&export_dir().join("logits.npy")).unwrap();
    let vocab = model.cfg.vocab_size;
    assert_eq!(shape, vec![toks.len(), vocab]);
    assert_eq!(got.len(), want.len());
    let err = got.iter().zip(&want).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
    let argmax = |r: &[f32]| r.iter().enumerate().fold(0, |best, (i, &v)| if v > r[best] { i } else { best });
    let bad = got.chunks(vocab).zip(want.chunks(vocab)).filter(|(g, w)| argmax(g) != argmax(w)).count();
    (err, bad)
}

#[test]
fn upstream_python_export_gives_the_scripts_logits() {
    let dir = export_dir();
    // The fixture must exercise the upstream path: file-level rotation metadata only.
    for l in 0..5 {
        let bytes = std::fs::read(dir.join(format!("layer_{l:02}.safetensors"))).unwrap();
        let (_, md) = SafeTensors::read_metadata(&bytes).unwrap();
        let md = md.metadata().clone().unwrap();
        assert_eq!(md.get("basis").map(String::as_str), Some("online"));
        assert_eq!(md.get("seed_in"), Some(&(1000 + l).to_string()));
        assert_eq!(md.get("seed_mid"), Some(&(2000 + l).to_string()));
        assert_eq!(md.get("block").map(String::as_str), Some("64"));
        assert!(md.keys().all(|k| !k.contains("rotation")), "layer {l}: per-matrix rotation keys {md:?}");
    }

    // What the reader built from the export.
    let loaded = load(&dir).unwrap();
    let m = &loaded.model;
    let mlp = &m.layers[3].mlp;
    let desc = |l: &forge_model::Linear| l.rotation.as_ref().map(|r| r.describe());
    assert_eq!(desc(&mlp.gate).as_deref(), Some("hadamard(block=64, seed=1003)"));
    assert_eq!(desc(&mlp.up).as_deref(), Some("hadamard(block=64, seed=1003)"));
    // The file-level block (64) does not divide down's input (96): the largest power of two dividing it.
    assert_eq!(desc(&mlp.down).as_deref(), Some("hadamard(block=32, seed=2003)"));
    assert!(matches!(&mlp.down.weight, Weight::Lut(q) if q.format == forge_kernels::lut::Format::Vec2x16));
    match &m.layers[0].mixer {
        Mixer::DeltaNet(d) => {
            assert!(d.in_qkv.rotation.is_none());
            assert_eq!(d.in_qkv.lowrank.as_ref().map(|r| r.rank), Some(4));
            assert!(d.in_z.lowrank.is_none());
            assert!(matches!(&d.in_qkv.weight, Weight::Lut(q) if q.format == forge_kernels::lut::Format::Lut4));
            assert!(matches!(&d.in_a.weight, Weight::Dense(t) if t.dtype() == DType::BF16));
            assert!(matches!(&d.in_b.weight, Weight::Dense(t) if t.dtype() == DType::BF16));
        }
        _ => panic!("layer 0 is a DeltaNet layer"),
    }
    match &m.layers[2].mixer {
        Mixer::Attention(a) => {
            assert_eq!(a.q.lowrank.as_ref().map(|r| r.rank), Some(4));
            assert!(matches!(&a.k.weight, Weight::Int8(_)));
            assert!(matches!(&a.v.weight, Weight::Int8(_)));
            assert!(matches!(&a.o.weight, Weight::Lut(_)));
        }
        _ => panic!("layer 2 is an attention layer"),
    }
    assert!(matches!(&m.head.weight, Weight::Lut(q) if q.format == forge_kernels::lut::Format::Lut4));

    let (err, bad) = compare_logits(&dir);
    println!("upstream Python export: max abs logit error vs logits.npy {err:.3e}, argmax mismatches {bad}/80");
    // f32 rounding in another order than the script's (the same weights and rotations), a few
    // times what it comes to here.
    assert!(err < 4e-5, "max abs error {err}");
    assert_eq!(bad, 0, "rows whose argmax differs");
}

#[test]
fn upstream_export_without_its_rotation_metadata_is_far_off() {
    // Negative control: with basis "plain" the rotated MLP weights run unrotated and the logits are wrong, so the
    // agreement above really depends on reproducing the seeded rotations.
    let dir = copy_export("plain-basis");
    for l in 0..5 {
        edit(&dir.join(format!("layer_{l:02}.safetensors")), |_, meta| {
            meta.insert("basis".into(), "plain".into());
        });
    }
    let (err, _) = compare_logits(&dir);
    println!("same export with basis=plain: max abs logit error {err:.3}");
    assert!(err > 0.1, "{err}");
    std::fs::remove_dir_all(&dir).unwrap();
}

// ---------------------------------------------------------------------------------------------------------------
// Corrupt exports
// ---------------------------------------------------------------------------------------------------------------

type Tensors = Vec<(String, Dtype, Vec<usize>, Vec<u8>)>;

/// A copy of the fixture export in a fresh temp dir, its `forge.json` pointing at the source by absolute path.
fn copy_export(name: &str) -> PathBuf {
    let dst = std::env::temp_dir().join(format!("forge-upstream-export-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dst);
    std::fs::create_dir_all(&dst).unwrap();
    for e in std::fs::read_dir(export_dir()).unwrap() {
        let p = e.unwrap().path();
        std::fs::copy(&p, dst.join(p.file_name().unwrap())).unwrap();
    }
    let mpath = dst.join("forge.json");
    let mut manifest: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&mpath).unwrap()).unwrap();
    let src = fixtures().join("qwen35_tiny").canonicalize().unwrap();
    manifest["source"]["path"] = serde_json::json!(src.to_string_lossy());
    std::fs::write(&mpath, serde_json::to_string_pretty(&manifest).unwrap()).unwrap();
    dst
}

/// Rewrite one safetensors file through `f` (tensors and metadata), with the `safetensors` crate.
fn edit(path: &Path, f: impl FnOnce(&mut Tensors, &mut HashMap<String, String>)) {
    let bytes = std::fs::read(path).unwrap();
    let (_, md) = SafeTensors::read_metadata(&bytes).unwrap();
    let mut meta = md.metadata().clone().unwrap_or_default();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let mut tensors: Tensors =
        st.tensors().into_iter().map(|(n, v)| (n, v.dtype(), v.shape().to_vec(), v.data().to_vec())).collect();
    f(&mut tensors, &mut meta);
    let views: Vec<(String, TensorView)> = tensors
        .iter()
        .map(|(n, dt, shape, data)| (n.clone(), TensorView::new(*dt, shape.clone(), data).unwrap()))
        .collect();
    std::fs::write(path, safetensors::serialize(views, Some(meta)).unwrap()).unwrap();
}

/// `load` must fail (not panic) with a one-line message containing every `needle`.
fn expect_error(dir: &Path, needles: &[&str]) -> String {
    let msg = match load(dir) {
        Ok(_) => panic!("{}: a corrupt export loaded", dir.display()),
        Err(e) => format!("{e:#}"),
    };
    println!("{msg}");
    assert!(!msg.contains('\n'), "not one line: {msg}");
    for n in needles {
        assert!(msg.contains(n), "error does not mention '{n}': {msg}");
    }
    std::fs::remove_dir_all(dir).unwrap();
    msg
}

#[test]
fn corrupt_export_missing_scale() {
    let dir = copy_export("no-scale");
    edit(&dir.join("layer_01.safetensors"), |t, _| t.retain(|(n, ..)| n != "mlp.up_proj.scale"));
    expect_error(&dir, &["layer_01.safetensors", "mlp.up_proj.scale", "missing"]);

    // The same for an INT8 matrix.
    let dir = copy_export("no-int8-scale");
    edit(&dir.join("layer_04_mixer.safetensors"), |t, _| t.retain(|(n, ..)| n != "self_attn.v_proj.scale"));
    expect_error(&dir, &["layer_04_mixer.safetensors", "self_attn.v_proj.scale", "missing"]);
}

#[test]
fn corrupt_export_index_out_of_codebook_range() {
    let dir = copy_export("bad-index");
    edit(&dir.join("layer_03_mixer.safetensors"), |t, _| {
        let idx = t.iter_mut().find(|(n, ..)| n == "linear_attn.in_proj_z.idx").unwrap();
        idx.3[777] = 16;
    });
    expect_error(&dir, &["layer_03_mixer.safetensors", "linear_attn.in_proj_z", "index 16", "out of range"]);

    // vec2x16 has 16 entries too.
    let dir = copy_export("bad-vec-index");
    edit(&dir.join("layer_00.safetensors"), |t, _| {
        let idx = t.iter_mut().find(|(n, ..)| n == "mlp.down_proj.idx").unwrap();
        idx.3[5] = 200;
    });
    expect_error(&dir, &["layer_00.safetensors", "mlp.down_proj", "index 200", "out of range"]);
}

#[test]
fn corrupt_export_codebook_of_the_wrong_shape() {
    // A LUT4 table given as (8, 2): same bytes, wrong shape for the format named in the metadata.
    let dir = copy_export("lut-8x2");
    edit(&dir.join("layer_02_mixer.safetensors"), |t, _| {
        t.iter_mut().find(|(n, ..)| n == "self_attn.o_proj.lut").unwrap().2 = vec![8, 2];
    });
    expect_error(&dir, &["layer_02_mixer.safetensors", "self_attn.o_proj.lut", "(8, 2)", "lut4"]);

    // A one-dimensional table.
    let dir = copy_export("lut-1d");
    edit(&dir.join("lm_head.safetensors"), |t, _| {
        t.iter_mut().find(|(n, ..)| n == "lm_head.lut").unwrap().2 = vec![16];
    });
    expect_error(&dir, &["lm_head.safetensors", "lm_head.lut", "(K, d)"]);

    // Without `<key>.format`, a (16, 1) table under a vec2x16 matrix's name is read as LUT4 and its index tensor no
    // longer fits: (48, 64) where (96, 64) is expected.
    let dir = copy_export("lut-16x1-for-vec");
    edit(&dir.join("layer_01.safetensors"), |t, meta| {
        meta.remove("mlp.gate_proj.format");
        let lut = t.iter_mut().find(|(n, ..)| n == "mlp.gate_proj.lut").unwrap();
        lut.2 = vec![16, 1];
        lut.3.truncate(32);
    });
    expect_error(&dir, &["layer_01.safetensors", "mlp.gate_proj.idx", "[96, 64]"]);
}

#[test]
fn corrupt_export_truncated_layer_file() {
    // Cut the tail of the data: the header is intact, the last tensor's bytes are gone.
    let dir = copy_export("truncated");
    let path = dir.join("layer_04.safetensors");
    let bytes = std::fs::read(&path).unwrap();
    std::fs::write(&path, &bytes[..bytes.len() - 50]).unwrap();
    // Tensors are stored in name order; the last is mlp.up_proj.scale (96 × F16 = 192 bytes).
    expect_error(&dir, &["layer_04.safetensors", "mlp.up_proj.scale", "truncated"]);
}

#[test]
fn corrupt_export_zero_rotation_block() {
    let dir = copy_export("block-0");
    edit(&dir.join("layer_00.safetensors"), |_, meta| {
        meta.insert("block".into(), "0".into());
    });
    expect_error(&dir, &["layer_00.safetensors", "block"]);
}
