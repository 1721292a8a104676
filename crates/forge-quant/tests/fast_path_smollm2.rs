//! The fast path on a quantized real model: SmolLM2-135M-Instruct (tools/setup.sh fetches it)
//! quantized RTN with online rotations — lut4 layers, vec2x64 and vec2x16 MLPs in two layers,
//! INT8 K/V, lut4 head — decoded token by token through the packed integer-dot kernels, against
//! the reference path (weights decoded to f32, f32 GEMM) on the same export.
//! Its own test binary: it flips the process-wide fast-path switch.

mod common;

use forge_kernels::lut::Format;
use forge_kernels::lutmm;
use forge_model::load::load;
use forge_model::sampling::argmax;
use forge_model::Logits;
use forge_quant::plan::{Basis, Plan};
use forge_quant::quantize::quantize;

#[test]
fn quantized_smollm2_fast_path_equals_reference_path() {
    let src = forge_core::hub::resolve_model("smollm2", false).expect("SmolLM2 missing: run tools/setup.sh");
    let out = std::env::temp_dir().join(format!("forge-fastpath-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&out);
    let mut plan = Plan::uniform(Format::Lut4);
    plan.kv = Format::Int8;
    plan.mlp_basis = Basis::Online;
    plan.mixer_basis = Basis::Online;
    plan.head_basis = Basis::Online;
    for (k, v) in [
        ("0.gate", "vec2x64"),
        ("0.up", "vec2x64"),
        ("0.down", "vec2x64"),
        ("1.down", "vec2x16"),
        ("1.gate", "lut3"),
        ("1.up", "lut2"),
        ("2.q", "lut3"),
    ] {
        plan.entries.insert(k.into(), v.into());
    }
    let opts = common::rtn_options("smollm2", src, plan, 0, &out);
    quantize(&opts).unwrap();
    let q = load(&out).unwrap();
    // Every quantized matrix takes the integer-dot kernels (the quantizer snaps its codebooks).
    for l in q.model.linears() {
        l.prepare();
        let p = l.packed.get(&l.weight).expect("quantized");
        assert!(p.is_int_dot(), "{} ({}) is not on the integer-dot kernels", l.name, p.format.name());
    }
    let text = "The capital of France is Paris, and the capital of Italy is Rome. def add(a, b):\n    return a + b\n";
    let tok = q.tokenizer.as_ref().expect("tokenizer");
    let toks: Vec<u32> = tok.encode(text, false).unwrap();
    // The prefill block must be long enough for the f32 path.
    assert!(toks.len() >= lutmm::intdot::GEMM_MIN_T + 5, "{} tokens", toks.len());
    let v = q.model.cfg.vocab_size;
    // Bounds |Δlogit| between the packed kernels and the reference path: the activations'
    // quantization (within ~2⁻²³ of each block's largest magnitude) and f32 rounding in another
    // order, a few times what it comes to on any kernel path (the 512-bit decode's pair layout
    // or the plain one, byte-plane prefill, f32 tiles 16 or 8 wide).
    const TOL: f32 = 4e-4;

    lutmm::set_fast_path(false);
    let reference = q.model.forward(&mut q.model.new_session(), &toks, Logits::All).unwrap();
    lutmm::set_fast_path(true);
    let mut s = q.model.new_session();
    let mut worst = 0f32;
    for (i, &t) in toks.iter().enumerate() {
        let row = q.model.forward(&mut s, &[t], Logits::Last).unwrap();
        let want = &reference[i * v..(i + 1) * v];
        let e = row.iter().zip(want).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
        worst = worst.max(e);
        assert!(e < TOL, "token {i}: max |Δlogit| {e}");
        assert_eq!(argmax(&row), argmax(want), "argmax at token {i}");
    }
    // A prefill block (T ≥ GEMM_MIN_T) and a verify-sized block (T = 5), through each prefill
    // kernel: byte planes through `vpdpbusd` (where the CPU has AVX-512 VNNI; f32 elsewhere)
    // and weights decoded to f32 with FMA tiles.
    let mut block_worst = Vec::new();
    for p in [lutmm::intdot::Prefill::Int, lutmm::intdot::Prefill::F32] {
        lutmm::intdot::set_prefill(p);
        let mut s = q.model.new_session();
        let head = q.model.forward(&mut s, &toks[..toks.len() - 5], Logits::All).unwrap();
        let tail = q.model.forward(&mut s, &toks[toks.len() - 5..], Logits::All).unwrap();
        let mut w = 0f32;
        for (i, (a, b)) in head.iter().chain(&tail).zip(&reference).enumerate() {
            assert!((a - b).abs() < TOL, "{p:?} block forward, logit {i}: {a} vs {b}");
            w = w.max((a - b).abs());
        }
        block_worst.push((p, lutmm::intdot::prefill_isa(), w));
    }
    lutmm::intdot::set_prefill(lutmm::intdot::Prefill::Auto);
    eprintln!("{} tokens, worst decode |Δlogit| {worst:.2e}, blocks {block_worst:?}", toks.len());
    let _ = std::fs::remove_dir_all(&out);
}
