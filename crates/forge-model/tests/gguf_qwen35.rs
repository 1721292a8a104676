//! `qwen35` GGUF files written by llama.cpp's converter from the transformers fixtures
//! (tools/make_qwen35_gguf_fixtures.py): every tensor reads back as the Hugging Face checkpoint
//! holds it, and a Q8_0 file runs from its blocks with the logits of its dequantized weights.

use forge_core::checkpoint::Checkpoint;
use forge_core::gguf::{write_gguf, GgmlType, GgufFile, GgufValue};
use forge_model::linear::Weight;
use forge_model::load::{load_options, LoadOptions};
use forge_model::{Logits, Model};
use std::path::PathBuf;

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../../tests/fixtures")).join(name)
}

/// Each text tensor of the Hugging Face checkpoint `hf`, read through the GGUF `gguf` by its
/// canonical name, has the checkpoint's values: the converter's reordering of value heads (rows
/// of `in_proj_qkv`, `in_proj_z`, `in_proj_a/b`, `conv1d`, `A_log`, `dt_bias`; columns of
/// `out_proj`) and its value changes (1 + w norms, −exp(A_log)) are undone.
fn check_tensors(hf: &str, gguf: &str) -> usize {
    let (Checkpoint::Hf { set, prefix, .. }, _) = Checkpoint::open(&fixture(hf)).unwrap() else { unreachable!() };
    let (g, _) = Checkpoint::open(&fixture(gguf)).unwrap();
    let mut n = 0;
    for stored in set.names() {
        let canonical = match stored.strip_prefix(prefix.as_str()) {
            Some(c) => c,
            None if stored == "lm_head.weight" => stored,
            None => continue, // the vision tower
        };
        let want = set.get(stored).unwrap().unwrap();
        let got = g.get(canonical).unwrap().unwrap_or_else(|| panic!("{gguf}: no tensor for {canonical}"));
        assert_eq!(got.numel(), want.numel(), "{gguf}: {canonical}");
        let (a, b) = (got.to_f32_vec().unwrap(), want.to_f32_vec().unwrap());
        let err = a.iter().zip(&b).map(|(x, y)| (x - y).abs()).fold(0f32, f32::max);
        // Exact but for the norms' 1 + w − 1 and A_log's ln(exp) in f32: a few ulps of 1.
        let tol = if canonical.ends_with("A_log") || canonical.ends_with("norm.weight") { 4e-7 } else { 0.0 };
        assert!(err <= tol, "{gguf}: {canonical} differs by {err}");
        n += 1;
    }
    n
}

#[test]
fn every_tensor_reads_back_as_the_checkpoint_holds_it() {
    // DeltaNet layers hold 14 tensors, attention layers 11; then embedding, final norm, head.
    assert_eq!(check_tensors("qwen35_tiny", "qwen35_gguf/tiny-f32.gguf"), 3 * 14 + 2 * 11 + 3);
    // Tied: no head; 2 DeltaNet and 2 attention layers.
    assert_eq!(check_tensors("qwen35_tiny_mm", "qwen35_gguf/mm-bf16.gguf"), 2 * 14 + 2 * 11 + 2);
}

fn logits(m: &Model, toks: &[u32]) -> Vec<f32> {
    let mut s = m.new_session();
    let mut out = m.forward(&mut s, &toks[..12], Logits::All).unwrap();
    for &t in &toks[12..16] {
        out.extend(m.forward(&mut s, &[t], Logits::Last).unwrap());
    }
    out
}

/// A Q8_0 file and a BF16 one: every matrix (the DeltaNet's output projection through its
/// column map too; the tied head of the BF16 file) runs from the file's mapping and gives the
/// logits of the same weights dequantized at load.
#[test]
fn quantized_and_bf16_files_run_from_the_mapping() {
    // DeltaNet layers have 5 matrices, attention layers 4, every layer an MLP of 3; the head.
    for (file, matrices) in [("tiny-q8_0.gguf", 3 * 5 + 2 * 4 + 5 * 3 + 1), ("mm-bf16.gguf", 2 * 5 + 2 * 4 + 4 * 3 + 1)]
    {
        let path = fixture(&format!("qwen35_gguf/{file}"));
        let quant = load_options(&path, LoadOptions::default()).unwrap().model;
        let reference = load_options(&path, LoadOptions { dequantize_gguf: true }).unwrap().model;
        let blocks = quant.linears().iter().filter(|l| matches!(l.weight, Weight::Gguf(_))).count();
        assert_eq!(blocks, matrices, "{file}");
        assert!(reference.linears().iter().all(|l| matches!(l.weight, Weight::Dense(_))));
        let toks: Vec<u32> = (0..16).map(|i| (i * 37 + 11) % quant.cfg.vocab_size as u32).collect();
        let (a, b) = (logits(&quant, &toks), logits(&reference, &toks));
        let err = a.iter().zip(&b).map(|(x, y)| (x - y).abs()).fold(0f32, f32::max);
        let top = b.iter().fold(0f32, |m, v| m.max(v.abs()));
        // Measured 0: the same decoded values through the same f32 products.
        println!("{file}: max |logit| {top:.3}, max difference {err:.2e}");
        assert!(top > 0.1 && a.iter().all(|v| v.is_finite()), "{file}: degenerate logits");
        assert!(err <= 1e-5 * (1.0 + top), "{file}: logits differ by {err}");
    }
}

/// The tiny file rewritten with `edit` applied to its metadata and tensors, opened as a model.
fn open_edited(
    tag: &str,
    edit: impl Fn(&mut Vec<(String, GgufValue)>, &mut Vec<(String, Vec<u64>, GgmlType, Vec<u8>)>),
) -> String {
    let f = GgufFile::open(&fixture("qwen35_gguf/tiny-f32.gguf")).unwrap();
    let mut meta: Vec<(String, GgufValue)> = f.metadata.iter().map(|(k, v)| (k.clone(), v.clone())).collect();
    let mut tensors: Vec<_> =
        f.tensors.iter().map(|t| (t.name.clone(), t.dims.clone(), t.ty, f.tensor_data(t).to_vec())).collect();
    edit(&mut meta, &mut tensors);
    let path = std::env::temp_dir().join(format!("forge-qwen35-{}-{tag}.gguf", std::process::id()));
    write_gguf(&path, &meta, &tensors).unwrap();
    let r = load_options(&path, LoadOptions::default()).map(|_| ());
    let _ = std::fs::remove_file(&path);
    let msg = format!("{:#}", r.expect_err(tag));
    assert!(msg.contains(&path.display().to_string()) && !msg.contains('\n'), "{tag}: {msg}");
    msg
}

/// Missing or inconsistent `qwen35` metadata and an impossible stored value are errors naming
/// the file and the key or tensor.
#[test]
fn bad_qwen35_files_are_errors_naming_the_field() {
    // `key` set to `v`, or removed.
    let set = |key: &'static str, v: Option<GgufValue>| {
        move |m: &mut Vec<(String, GgufValue)>, _: &mut Vec<(String, Vec<u64>, GgmlType, Vec<u8>)>| {
            m.retain(|(k, _)| k != key);
            m.extend(v.clone().map(|v| (key.to_string(), v)));
        }
    };
    let msg = open_edited("norank", set("qwen35.ssm.time_step_rank", None));
    assert!(msg.contains("missing 'qwen35.ssm.time_step_rank'"), "{msg}");
    let msg = open_edited("inner", set("qwen35.ssm.inner_size", Some(GgufValue::U32(97))));
    assert!(msg.contains("'qwen35.ssm.inner_size' 97"), "{msg}");
    let short = GgufValue::Array(vec![GgufValue::Bool(true); 3]);
    let msg = open_edited("recurrent", set("qwen35.attention.recurrent_layers", Some(short)));
    assert!(msg.contains("recurrent_layers' has 3 entries for 5 layers"), "{msg}");
    let msg = open_edited("groups", set("qwen35.ssm.group_count", Some(GgufValue::U32(3))));
    assert!(msg.contains("not a multiple of 3 key heads"), "{msg}");
    let msg = open_edited("a", |_, t| {
        let a = t.iter_mut().find(|t| t.0 == "blk.1.ssm_a").unwrap();
        a.3[..4].copy_from_slice(&0.5f32.to_le_bytes());
    });
    assert!(msg.contains("blk.1.ssm_a") && msg.contains("holds 0.5"), "{msg}");
}
