//! Quantize → export → load, for every format, on the tiny transformers fixtures: the loaded
//! export reproduces the quantizer's matrices bit for bit, runs the same logits as a dense model
//! holding the reconstructed weights, and an interrupted run resumes to identical files.

mod common;

use forge_core::checkpoint::Checkpoint;
use forge_kernels::lut::{Format, ALL_FORMATS};
use forge_model::load::{load, load_with};
use forge_model::{Linear, Logits};
use forge_quant::plan::{Basis, Plan};
use forge_quant::quantize::{matrix_seed, quantize, Method, Options};
use forge_quant::quantize_matrix::quantize_rtn;
use std::path::{Path, PathBuf};

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../../tests/fixtures")).join(name)
}

fn tmp(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("forge-qe-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    d
}

fn tokens(dir: &Path) -> Vec<u32> {
    std::fs::read_to_string(dir.join("tokens.txt")).unwrap().split_whitespace().map(|s| s.parse().unwrap()).collect()
}

fn opts(src: &str, plan: Plan, out: &Path) -> Options {
    common::rtn_options(&fixture(src).to_string_lossy(), fixture(src), plan, 7, out)
}

/// Dense linear holding the export's effective weight (original basis).
fn dense_copy(l: &Linear) -> Linear {
    let w = l.effective_weight().unwrap();
    let mut d = Linear::dense(l.name.clone(), forge_core::tensor::HostTensor::from_f32(vec![l.out_f, l.in_f], w), None);
    d.bias = l.bias.clone();
    d
}

fn check_export(src: &str, plan: Plan, label: &str) {
    let out = tmp(label);
    quantize(&opts(src, plan.clone(), &out)).unwrap_or_else(|e| panic!("{label}: {e:#}"));
    let q = load(&out).unwrap();
    let (ck, cfg) = Checkpoint::open(&fixture(src)).unwrap();
    let dense = forge_model::Model::load(&ck, cfg).unwrap();
    // 1. Every matrix equals an in-memory re-quantization, bit for bit.
    for (lq, ld) in q.model.linears().iter().zip(dense.linears()) {
        assert_eq!(lq.name, ld.name);
        let format = plan.format_for(&ld.name).unwrap();
        let mut w = ld.effective_weight().unwrap();
        if plan.basis_for(&ld.name).unwrap() == Basis::Online {
            let r = forge_kernels::rotation::Rotation::new(ld.in_f, Plan::rotation_seed(&ld.name).unwrap());
            r.rotate_weight(&mut w, ld.out_f);
        }
        let want = quantize_rtn(&w, ld.out_f, ld.in_f, format, None, matrix_seed(7, &ld.name)).unwrap().reconstruct();
        let mut got = vec![0f32; ld.out_f * ld.in_f];
        lq.decode_rows(0, ld.out_f, &mut got).unwrap();
        assert!(got == want, "{label}: {} differs after export/load", ld.name);
    }
    // 2. The runtime (LUT/INT8 kernels, online rotations, tied head lookups) equals a dense model
    //    holding the effective weights.
    let map: std::collections::HashMap<String, Linear> =
        q.model.linears().iter().map(|l| (l.name.clone(), dense_copy(l))).collect();
    let mut fake = load_with(&fixture(src), &|name, _, _| Ok(map.get(name).cloned())).unwrap();
    // Same embedding (an untied export stores it as FP16).
    fake.model.embed = q.model.embed.clone();
    let toks = tokens(&fixture(src));
    let a = q.model.forward(&mut q.model.new_session(), &toks, Logits::All).unwrap();
    let b = fake.model.forward(&mut fake.model.new_session(), &toks, Logits::All).unwrap();
    let err = a.iter().zip(&b).map(|(x, y)| (x - y).abs()).fold(0f32, f32::max);
    // The same weights both ways: what remains is the kernels' activation quantization (the
    // integer-dot formats) and f32 rounding in another order, a few times what it comes to on
    // these fixtures in every format.
    assert!(err < 1.2e-4, "{label}: export runtime vs dense reconstruction: {err}");
    // Token-by-token decode goes through the packed LUT/INT8 kernels: same logits, same argmax.
    let v = q.model.cfg.vocab_size;
    let mut s = q.model.new_session();
    for (i, &tok) in toks.iter().take(24).enumerate() {
        let row = q.model.forward(&mut s, &[tok], Logits::Last).unwrap();
        let want = &b[i * v..(i + 1) * v];
        let e = row.iter().zip(want).map(|(x, y)| (x - y).abs()).fold(0f32, f32::max);
        assert!(e < 1e-4, "{label}: decode step {i}: {e}");
        assert_eq!(forge_model::sampling::argmax(&row), forge_model::sampling::argmax(want), "{label}: argmax at {i}");
    }
}

#[test]
fn every_format_round_trips_on_qwen35() {
    for f in ALL_FORMATS {
        let mut plan = Plan::uniform(f);
        plan.head = if f.is_lut() || f == Format::Int8 { f } else { Format::Lut4 };
        check_export("qwen35_tiny", plan, &format!("qwen35-{}", f.name()));
    }
}

#[test]
fn rotated_and_mixed_plans_round_trip() {
    let mut plan = Plan::uniform(Format::Vec2x64);
    plan.mlp_basis = Basis::Online;
    plan.mixer_basis = Basis::Online;
    plan.entries.insert("1.up".into(), "lut3".into());
    plan.entries.insert("1.mixer".into(), "vector 2x16 + pcs".into());
    check_export("qwen35_tiny_mm", plan.clone(), "qwen35mm-rot");
    check_export("qwen2_tiny", plan, "qwen2-rot");
    check_export("llama_tiny", Plan::uniform(Format::Lut4), "llama-lut4");
}

#[test]
fn interrupted_quantization_resumes_to_identical_files() {
    let mut plan = Plan::uniform(Format::Vec2x16);
    plan.mlp_basis = Basis::Online;
    let a = tmp("resume-a");
    quantize(&opts("qwen35_tiny", plan.clone(), &a)).unwrap();
    let b = tmp("resume-b");
    let mut o = opts("qwen35_tiny", plan.clone(), &b);
    o.stop_before_layer = Some(3);
    let err = quantize(&o).unwrap_err();
    assert!(format!("{err:#}").contains("stopped before layer 3"));
    assert!(!b.join("forge.json").exists(), "an interrupted export must not look complete");
    assert!(load(&b).is_err());
    // Without --resume the non-empty directory is refused.
    let e = quantize(&opts("qwen35_tiny", plan.clone(), &b)).unwrap_err();
    assert!(format!("{e:#}").contains("not empty"), "{e:#}");
    // Layers 0–2 are not redone: their files keep their modification time.
    let before = std::fs::metadata(b.join("layer_00.safetensors")).unwrap().modified().unwrap();
    let mut o = opts("qwen35_tiny", plan.clone(), &b);
    o.resume = true;
    quantize(&o).unwrap();
    assert_eq!(std::fs::metadata(b.join("layer_00.safetensors")).unwrap().modified().unwrap(), before);
    let mut names: Vec<String> =
        std::fs::read_dir(&a).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().to_string()).collect();
    names.sort();
    for n in &names {
        assert!(std::fs::read(a.join(n)).unwrap() == std::fs::read(b.join(n)).unwrap(), "{n} differs after resume");
    }
    // A resume with different options is refused.
    let c = tmp("resume-c");
    let mut o = opts("qwen35_tiny", plan.clone(), &c);
    o.stop_before_layer = Some(1);
    let _ = quantize(&o);
    let mut o = opts("qwen35_tiny", Plan::uniform(Format::Lut4), &c);
    o.resume = true;
    assert!(format!("{:#}", quantize(&o).unwrap_err()).contains("different options"));
}

#[test]
fn inspect_counts_bits_by_the_closed_form() {
    let out = tmp("inspect");
    let mut plan = Plan::uniform(Format::Vec2x16);
    plan.head = Format::Lut4;
    quantize(&opts("qwen35_tiny", plan, &out)).unwrap();
    let r = forge_quant::inspect::inspect(&out).unwrap();
    let (ck, cfg) = Checkpoint::open(&fixture("qwen35_tiny")).unwrap();
    let m = forge_model::Model::load(&ck, cfg.clone()).unwrap();
    let mut bytes = 0usize;
    let mut n = 0usize;
    for l in m.linears() {
        let f = Plan::uniform(Format::Vec2x16).format_for(&l.name).unwrap();
        let f = if l.name == "lm_head" { Format::Lut4 } else { f };
        bytes += f.packed_bytes(l.out_f, l.in_f);
        n += l.out_f * l.in_f;
    }
    assert_eq!(r.packed_bytes, bytes);
    assert!((r.bits_per_weight - bytes as f64 * 8.0 / n as f64).abs() < 1e-9);
    // Untied: the FP16 embedding is in the export and counted at 16 bits.
    assert!(out.join("embed.safetensors").exists());
    assert!(r.bits_per_weight_with_embedding > r.bits_per_weight);
    let disk: u64 = std::fs::read_dir(&out).unwrap().map(|e| e.unwrap().metadata().unwrap().len()).sum();
    assert_eq!(r.export_bytes, disk);
}

#[test]
fn gptq_calibrates_on_ids_rows_of_any_length() {
    let toks = tokens(&fixture("qwen35_tiny_mm"));
    let line = |r: &[u32]| r.iter().map(u32::to_string).collect::<Vec<_>>().join(" ");
    let d = tmp("gptq-rows");
    std::fs::create_dir_all(&d).unwrap();
    let (stream, rows, ragged) = (d.join("stream.txt"), d.join("rows.txt"), d.join("ragged.txt"));
    std::fs::write(&stream, line(&toks[..64])).unwrap();
    let equal: Vec<String> = toks[..64].chunks(16).map(line).collect();
    std::fs::write(&rows, format!("{}\n{}\n", forge_quant::calib::ROWS_HEADER, equal.join("\n"))).unwrap();
    let (a, b, c) = (&toks[..30], &toks[30..37], &toks[10..70]);
    std::fs::write(&ragged, format!("{}\n{}\n{}\n{}\n", forge_quant::calib::ROWS_HEADER, line(a), line(b), line(c)))
        .unwrap();
    let run = |spec: &Path, seq: usize, label: &str| {
        let out = d.join(label);
        // qwen35_tiny_mm has a tied head: the head's and the layers' calibration paths both run.
        let mut o = opts("qwen35_tiny_mm", Plan::uniform(Format::Lut4), &out);
        o.method = Method::Gptq;
        o.calib = Some(forge_quant::calib::CalibConfig { spec: format!("ids={}", spec.display()), seq, holdout: 1 });
        quantize(&o).unwrap_or_else(|e| panic!("{label}: {e:#}"));
        out
    };
    // Equal-length rows read one per line calibrate exactly like the same tokens as a stream.
    let (x, y) = (run(&stream, 16, "stream"), run(&rows, 16, "rows"));
    for e in std::fs::read_dir(&x).unwrap() {
        let n = e.unwrap().file_name();
        if n.to_string_lossy().ends_with(".safetensors") {
            assert!(std::fs::read(x.join(&n)).unwrap() == std::fs::read(y.join(&n)).unwrap(), "{n:?} differs");
        }
    }
    // Rows of 30, 7 and 60 → 40 tokens: each row keeps its own length.
    let z = run(&ragged, 40, "ragged");
    let f = "layer_00.safetensors";
    assert!(std::fs::read(y.join(f)).unwrap() != std::fs::read(z.join(f)).unwrap(), "calibration had no effect");
    let m = load(&z).unwrap();
    let mut s = m.model.new_session();
    let logits = m.model.forward(&mut s, &toks[..8], Logits::Last).unwrap();
    assert!(logits.iter().all(|v| v.is_finite()));
}
