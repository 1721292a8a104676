//! `forge quantize` from a GGUF file whose linear weights are block-quantized: the source's
//! matrices stay in their blocks at load and are decoded one at a time, and the export equals
//! a quantization of the same file dequantized at load.

mod common;

use forge_core::checkpoint::Checkpoint;
use forge_core::gguf::{sample_blocks, write_gguf, GgmlType, GgufValue};
use forge_kernels::lut::Format;
use forge_model::linear::Weight;
use forge_model::load::{load, model_with_options, LoadOptions};
use forge_quant::plan::{Basis, Plan};
use forge_quant::quantize::{matrix_seed, quantize};
use forge_quant::quantize_matrix::quantize_rtn;
use std::path::Path;

/// A one-layer llama GGUF (hidden 256, tied Q6_K embedding) with block-quantized linears and
/// a small vocabulary.
fn write_source(path: &Path) {
    let (h, ffn, vocab, heads) = (256usize, 512usize, 64usize, 4usize);
    let u = |v: usize| GgufValue::U32(v as u32);
    let s = |v: &str| GgufValue::String(v.into());
    let tokens = (0..vocab).map(|i| s(&format!("t{i}"))).collect();
    let meta = vec![
        ("general.architecture".to_string(), s("llama")),
        ("llama.embedding_length".into(), u(h)),
        ("llama.attention.head_count".into(), u(heads)),
        ("llama.block_count".into(), u(1)),
        ("llama.feed_forward_length".into(), u(ffn)),
        ("tokenizer.ggml.model".into(), s("llama")),
        ("tokenizer.ggml.tokens".into(), GgufValue::Array(tokens)),
        ("tokenizer.ggml.scores".into(), GgufValue::Array(vec![GgufValue::F32(0.0); vocab])),
    ];
    let mut seed = 0;
    let mut mat = |name: &str, ty: GgmlType, out_f: usize, in_f: usize, scale: f32| {
        seed += 1;
        (name.to_string(), vec![in_f as u64, out_f as u64], ty, sample_blocks(ty, out_f * in_f, scale, seed).unwrap())
    };
    let ones =
        |name: &str| (name.to_string(), vec![h as u64], GgmlType::F32, [1f32; 256].map(f32::to_le_bytes).concat());
    let tensors = vec![
        mat("token_embd.weight", GgmlType::Q6K, vocab, h, 0.0005),
        ones("output_norm.weight"),
        ones("blk.0.attn_norm.weight"),
        ones("blk.0.ffn_norm.weight"),
        mat("blk.0.attn_q.weight", GgmlType::Q4K, h, h, 0.0003),
        mat("blk.0.attn_k.weight", GgmlType::Q8_0, h, h, 0.001),
        mat("blk.0.attn_v.weight", GgmlType::Q5K, h, h, 0.0003),
        mat("blk.0.attn_output.weight", GgmlType::Q4_0, h, h, 0.01),
        mat("blk.0.ffn_gate.weight", GgmlType::IQ4NL, ffn, h, 0.001),
        mat("blk.0.ffn_up.weight", GgmlType::Q4_1, ffn, h, 0.01),
        mat("blk.0.ffn_down.weight", GgmlType::Q6K, h, ffn, 0.0003),
    ];
    write_gguf(path, &meta, &tensors).unwrap();
}

/// `forge quantize` of `src` (RTN, lut4) gives, for each of its `matrices`, the quantization of
/// the matrix that the file dequantized at load holds.
fn check_quantized_from(src: &Path, out: &Path, matrices: usize) {
    let plan = Plan::uniform(Format::Lut4);
    let name = src.file_name().unwrap().to_str().unwrap();
    quantize(&common::rtn_options(name, src.to_path_buf(), plan.clone(), 7, out)).unwrap_or_else(|e| panic!("{e:#}"));

    // The source as the quantizer loads it: every matrix in its blocks.
    let (ck, cfg) = Checkpoint::open(src).unwrap();
    let blocks = model_with_options(&ck, cfg.clone(), &|_, _, _| Ok(None), LoadOptions::default()).unwrap();
    assert!(blocks.linears().iter().all(|l| matches!(l.weight, Weight::Gguf(_))));
    let reference = model_with_options(&ck, cfg, &|_, _, _| Ok(None), LoadOptions { dequantize_gguf: true }).unwrap();
    let q = load(out).unwrap_or_else(|e| panic!("{e:#}"));
    let mut n = 0;
    for (lq, ld) in q.model.linears().iter().zip(reference.linears()) {
        assert_eq!(lq.name, ld.name);
        let mut w = ld.effective_weight().unwrap();
        if plan.basis_for(&ld.name).unwrap() == Basis::Online {
            let r = forge_kernels::rotation::Rotation::new(ld.in_f, Plan::rotation_seed(&ld.name).unwrap());
            r.rotate_weight(&mut w, ld.out_f);
        }
        let format = plan.format_for(&ld.name).unwrap();
        let want = quantize_rtn(&w, ld.out_f, ld.in_f, format, None, matrix_seed(7, &ld.name)).unwrap().reconstruct();
        let mut got = vec![0f32; ld.out_f * ld.in_f];
        lq.decode_rows(0, ld.out_f, &mut got).unwrap();
        assert!(got == want, "{} differs from a quantization of the dequantized source", ld.name);
        n += 1;
    }
    assert_eq!(n, matrices, "{name}");
}

#[test]
fn quantize_from_a_block_quantized_gguf() {
    let dir = std::env::temp_dir().join(format!("forge-gguf-source-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let src = dir.join("src.gguf");
    write_source(&src);
    // Seven layer matrices and the tied head.
    check_quantized_from(&src, &dir.join("export"), 8);
    // llama.cpp's Q8_0 conversion of the hybrid fixture: value heads tiled in the file (the
    // DeltaNet's output projection through a column map), read back in Hugging Face order.
    let hybrid = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/qwen35_gguf/tiny-q8_0.gguf");
    check_quantized_from(&hybrid, &dir.join("export-qwen35"), 3 * 5 + 2 * 4 + 5 * 3 + 1);
    let _ = std::fs::remove_dir_all(&dir);
}
