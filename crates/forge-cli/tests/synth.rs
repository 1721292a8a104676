//! `forge synth --shape tiny`: the random-weight export loads and runs, every matrix follows the
//! release-0.2 plan, codebooks sit on the integer-dot grid, the bytes depend only on the seed,
//! and bad arguments fail with one clear line.

use forge_kernels::lut::Format;
use forge_kernels::lutmm::intdot::int8_codebook;
use forge_model::linear::Weight;
use forge_model::Logits;
use std::path::{Path, PathBuf};

mod common;

use common::{expect_error, forge};

fn tmp(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("forge-synth-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    d
}

fn synth(dir: &Path, seed: &str, threads: &str) -> String {
    let (ok, out, err) =
        forge(&["--threads", threads, "synth", "--shape", "tiny", "--output", dir.to_str().unwrap(), "--seed", seed]);
    assert!(ok, "forge synth failed: {err}");
    out
}

/// Every file under `dir` (relative path → bytes), recursively.
fn files(dir: &Path) -> Vec<(String, Vec<u8>)> {
    let mut v = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                stack.push(p);
            } else {
                v.push((p.strip_prefix(dir).unwrap().to_string_lossy().to_string(), std::fs::read(&p).unwrap()));
            }
        }
    }
    v.sort();
    v
}

#[test]
fn synth_tiny_loads_runs_and_follows_the_release_02_plan() {
    let dir = tmp("plan");
    let out = synth(&dir, "5", "2");
    assert!(out.contains("not a model") && out.contains("bits/weight"), "{out}");

    // The manifest says what this is, and records the seed, the plan and the relative source.
    let m: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(dir.join("forge.json")).unwrap()).unwrap();
    assert!(m["synthetic"]["warning"].as_str().unwrap().contains("not a model"));
    assert_eq!((m["synthetic"]["seed"].as_u64(), m["options"]["seed"].as_u64()), (Some(5), Some(5)));
    assert_eq!(m["source"]["path"], "source");
    assert_eq!(m["options"]["plan"]["3.mixer"], "vector 2x16 + pcs");
    assert!(m["options"]["plan"].get("4.mixer").is_none());
    assert_eq!(m["options"]["lowrank"]["rank"], 64);
    let cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("source/config.json")).unwrap()).unwrap();
    assert_eq!(cfg["model_type"], "qwen3_5");
    assert_eq!(cfg["text_config"]["model_type"], "qwen3_5_text");
    assert!(!dir.join("embed.safetensors").exists(), "the untied embedding lives in the source checkpoint");

    let loaded = forge_model::load::load(&dir).unwrap();
    let model = &loaded.model;
    let vocab = model.cfg.vocab_size;
    assert_eq!((vocab, model.cfg.num_layers), (1024, 8));

    // A forward pass over a few tokens: finite logits of the vocabulary's size, not constant.
    let tokens = [1u32, 17, 300, 999, 42, 7];
    let logits = model.forward(&mut model.new_session(), &tokens, Logits::All).unwrap();
    assert_eq!(logits.len(), tokens.len() * vocab);
    assert!(logits.iter().all(|v| v.is_finite()), "non-finite logits");
    let mean = logits.iter().sum::<f32>() / logits.len() as f32;
    let var = logits.iter().map(|v| (v - mean) * (v - mean)).sum::<f32>() / logits.len() as f32;
    assert!(var > 1e-6, "constant logits");
    // Decoding one more token through the caches works too.
    let mut s = model.new_session();
    model.forward(&mut s, &tokens[..5], Logits::None).unwrap();
    let last = model.forward(&mut s, &tokens[5..], Logits::Last).unwrap();
    assert!(last.iter().all(|v| v.is_finite()) && last.len() == vocab);

    // Every matrix as release 0.2 has it.
    let mut counts = [0usize; 4]; // lut, int8, dense, lowrank
    for lin in model.linears() {
        let name = lin.name.as_str();
        let layer: Option<usize> =
            name.strip_prefix("layers.").and_then(|r| r.split('.').next()).map(|l| l.parse().unwrap());
        let ab = name.ends_with("in_proj_a") || name.ends_with("in_proj_b");
        let kv = name.ends_with("k_proj") || name.ends_with("v_proj");
        let mixer = name.contains("self_attn.") || name.contains("linear_attn.");
        let want = if name == "lm_head" {
            Some(Format::Lut4)
        } else if name.contains(".mlp.") {
            Some(Format::Vec2x64)
        } else if ab {
            None // BF16, dense
        } else if kv {
            Some(Format::Int8)
        } else if layer.unwrap() < 4 {
            Some(Format::Vec2x16)
        } else {
            Some(Format::Lut4)
        };
        match (&lin.weight, want) {
            (Weight::Lut(m), Some(f)) => {
                assert_eq!(m.format, f, "{name}");
                assert!(int8_codebook(&m.codebook).is_some(), "{name}: codebook off the 8-bit grid: {:?}", m.codebook);
                counts[0] += 1;
            }
            (Weight::Int8(_), Some(Format::Int8)) => counts[1] += 1,
            (Weight::Dense(t), None) => {
                assert_eq!(t.dtype(), forge_core::tensor::DType::BF16, "{name}");
                counts[2] += 1;
            }
            _ => panic!("{name}: unexpected weight kind for {want:?}"),
        }
        // Low-rank rank-64 factors on the quantized mixer projections only.
        let lr = lin.lowrank.as_ref().map(|l| l.rank);
        assert_eq!(lr, (mixer && !ab).then_some(64), "{name}: low-rank");
        counts[3] += lr.is_some() as usize;
        // Online rotations on the MLP and mixer inputs (the quantizer's seeds), not on the head or a/b.
        let rot = lin.rotation.as_ref().map(|r| r.describe());
        match layer {
            Some(l) if !ab => {
                let seed = if name.ends_with("gate_proj") || name.ends_with("up_proj") {
                    1000 + l
                } else if name.ends_with("down_proj") {
                    2000 + l
                } else if name.ends_with("o_proj") || name.ends_with("out_proj") {
                    4000 + l
                } else {
                    3000 + l
                };
                let r = rot.unwrap_or_else(|| panic!("{name}: no rotation"));
                assert!(r.contains(&format!("seed={seed}")), "{name}: {r}");
            }
            _ => assert!(rot.is_none(), "{name}: unexpected rotation {rot:?}"),
        }
    }
    // 8 layers: 6 DeltaNet (qkv, z, out + 3 MLP), 2 attention (q, o + 3 MLP), head.
    assert_eq!(counts, [6 * 6 + 2 * 5 + 1, 2 * 2, 6 * 2, 6 * 3 + 2 * 4]);

    // `forge inspect` reads it (and counts the same matrices).
    let (ok, js, err) = forge(&["inspect", dir.to_str().unwrap(), "--json"]);
    assert!(ok, "{err}");
    let r: serde_json::Value = serde_json::from_str(&js).unwrap();
    assert_eq!(r["matrices"].as_array().unwrap().len(), 8 * 3 + 6 * 5 + 2 * 4 + 1);
    std::fs::remove_dir_all(&dir).unwrap();
}

/// The parallel sections split work by rows, channels and heads, never inside a sum: a prompt
/// and the tokens decoded after it give the same bits on one worker as on two or three (the
/// DeltaNet heads then go in runs of three and two; a 5-token prompt's conv splits mid-row).
#[test]
fn synth_tiny_gives_the_same_bits_on_any_number_of_workers() {
    let dir = tmp("workers");
    synth(&dir, "11", "2");
    let loaded = forge_model::load::load(&dir).unwrap();
    let model = &loaded.model;
    let run = |threads: usize| -> Vec<u32> {
        let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap();
        pool.install(|| {
            let mut s = model.new_session();
            let mut logits = model.forward(&mut s, &[3, 141, 59, 26, 535], Logits::All).unwrap();
            for step in 0..6 {
                let tok = forge_model::sampling::argmax(&logits[logits.len() - model.cfg.vocab_size..]);
                let next = model.forward(&mut s, &[tok], Logits::Last).unwrap();
                assert!(next.iter().all(|v| v.is_finite()), "step {step}");
                logits.extend(next);
            }
            logits.iter().map(|v| v.to_bits()).collect()
        })
    };
    let one = run(1);
    for threads in [2, 3] {
        let got = run(threads);
        let first = one.iter().zip(&got).position(|(a, b)| a != b);
        assert!(first.is_none(), "{threads} workers: first differing logit at {first:?}");
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn synth_same_seed_writes_identical_bytes() {
    let (a, b, c) = (tmp("seed-a"), tmp("seed-b"), tmp("seed-c"));
    synth(&a, "3", "1");
    synth(&b, "3", "2"); // the thread count does not change the bytes
    synth(&c, "4", "2");
    let (fa, fb, fc) = (files(&a), files(&b), files(&c));
    assert_eq!(fa.len(), 1 + 2 * 8 + 1 + 2, "forge.json, 16 layer files, lm_head, source/config.json + weights");
    assert_eq!(fa.iter().map(|f| &f.0).collect::<Vec<_>>(), fb.iter().map(|f| &f.0).collect::<Vec<_>>());
    for ((name, x), (_, y)) in fa.iter().zip(&fb) {
        assert!(x == y, "{name} differs between two runs with seed 3");
    }
    for ((name, x), (_, y)) in fa.iter().zip(&fc) {
        if name.ends_with(".safetensors") {
            assert!(x != y, "{name} is the same for seeds 3 and 4");
        }
    }
    for d in [a, b, c] {
        std::fs::remove_dir_all(&d).unwrap();
    }
}

#[test]
fn synth_bad_arguments_fail_with_one_clear_line() {
    let expect = expect_error;
    let dir = tmp("bad");
    let d = dir.to_str().unwrap();
    expect(&["synth", "--shape", "qwen3-27b", "--output", d], &["unknown --shape 'qwen3-27b'", "qwen3.8-27b", "tiny"]);
    assert!(!dir.exists(), "an unknown shape must not create the output directory");
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("keep.txt"), "x").unwrap();
    expect(&["synth", "--shape", "tiny", "--output", d], &[d, "not empty"]);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn bench_json_on_the_synthetic_export_reports_speed_bandwidth_memory_and_allocations() {
    let dir = tmp("bench");
    synth(&dir, "9", "2");
    let (ok, out, err) = forge(&[
        "--threads",
        "2",
        "bench",
        "--model",
        dir.to_str().unwrap(),
        "--prompt-tokens",
        "16",
        "--gen-tokens",
        "8",
        "--repeats",
        "1",
        "--bandwidth-gib",
        "0.03",
        "--json",
    ]);
    assert!(ok, "forge bench failed: {err}");
    let j: serde_json::Value = serde_json::from_str(&out).unwrap();
    let num = |k: &str| j[k].as_f64().unwrap_or_else(|| panic!("no number '{k}' in {out}"));
    assert!(num("prefill_tok_s") > 0.0 && num("decode_tok_s") > 0.0 && num("bandwidth_gb_s") > 0.0);
    assert_eq!(num("threads"), 2.0);
    // Every matrix of the export is read once per token: at least the packed bytes of the
    // layers, at most those plus the (BF16) dense ones.
    let mem = &j["memory_bytes"];
    let packed = mem["packed"].as_f64().unwrap();
    assert!(packed > 0.0 && num("weight_bytes_per_token") >= packed, "{out}");
    // The hybrid layout has both caches; scratch is held once a pass has run.
    for k in ["kv_cache", "recurrent_state", "scratch"] {
        assert!(mem[k].as_f64().unwrap() > 0.0, "memory category {k}: {out}");
    }
    assert_eq!(num("decode_allocations_per_token"), 0.0, "{out}");
    for part in ["attention", "attention_core", "deltanet", "deltanet_core", "mlp", "head"] {
        assert!(j["decode_split_ms_per_token"][part].as_f64().unwrap() > 0.0, "{part}: {out}");
    }
    // The parts' weight bytes are every matrix's, once.
    let parts: f64 = ["attention", "deltanet", "mlp", "head"]
        .iter()
        .map(|p| j["decode_split_weight_bytes"][p].as_f64().unwrap_or_else(|| panic!("bytes of {p}: {out}")))
        .sum();
    assert_eq!(parts, num("weight_bytes_per_token"), "{out}");
    // Each part's own pages read at a rate (the parts with integer-dot matrices; the MLP has).
    let pages = j["decode_split_pages_gb_s"].as_object().unwrap_or_else(|| panic!("no page rates: {out}"));
    assert!(pages.contains_key("mlp"), "{out}");
    for (p, r) in pages {
        assert!(["attention", "deltanet", "mlp", "head"].contains(&p.as_str()), "{p}: {out}");
        assert!(r.as_f64().is_some_and(|r| r > 0.0), "{p}: {out}");
    }
    // 8 tokens (repeats × generated, at least 8) each timed between passes of both probes.
    assert_eq!(num("bandwidth_paired_tokens"), 8.0, "{out}");
    for k in ["bandwidth_runs_gb_s", "weights_read_runs_gb_s"] {
        let runs = j[k].as_array().unwrap_or_else(|| panic!("no '{k}' in {out}"));
        assert_eq!(runs.len(), 9, "{k}: {out}");
        assert!(runs.iter().all(|v| v.as_f64().unwrap() > 0.0), "{k}: {out}");
    }
    assert!(num("weights_read_gb_s") > 0.0 && num("weights_read_fraction") > 0.0, "{out}");
    // `bench` runs KV8 caches unless told otherwise; an f16 cache holds the same positions in
    // half of f32's bytes.
    assert_eq!(j["kv_cache_dtype"], "kv8", "{out}");
    let d = dir.to_str().unwrap();
    // `forge bench --json` with a KV cache type; it must report that type.
    let bench_kv = |dtype: &str| -> serde_json::Value {
        let args = ["--threads", "2", "--kv-cache-dtype", dtype, "bench", "--model", d, "--prompt-tokens", "16"];
        let (ok, out, err) =
            forge(&[&args[..], &["--gen-tokens", "8", "--repeats", "1", "--bandwidth-gib", "0.03", "--json"]].concat());
        assert!(ok, "forge bench --kv-cache-dtype {dtype} failed: {err}");
        let jd: serde_json::Value = serde_json::from_str(&out).unwrap();
        assert_eq!(jd["kv_cache_dtype"], dtype, "{out}");
        jd
    };
    let (j, j16) = (bench_kv("f32"), bench_kv("f16"));
    let kv = |j: &serde_json::Value| j["memory_bytes"]["kv_cache"].as_f64().unwrap();
    assert_eq!(2.0 * kv(&j16), kv(&j), "{j16}");
    // v8: f16 keys, byte values and a 4-byte scale per position and head: between 3/8 of f32's
    // bytes and f16's.
    let j8 = bench_kv("v8");
    assert!(kv(&j8) > 0.375 * kv(&j) && kv(&j8) < kv(&j16), "{j8}");
    // kv8: byte keys and values, each with a 2-byte scale: between 1/4 of f32's bytes and v8's.
    let jk8 = bench_kv("kv8");
    assert!(kv(&jk8) > 0.25 * kv(&j) && kv(&jk8) < kv(&j8), "{jk8}");
    let (ok, _, err) = forge(&["--kv-cache-dtype", "f8", "bench", "--model", d]);
    assert!(!ok && err.contains("'f8'") && err.contains("f32, f16"), "{err}");
    let _ = std::fs::remove_dir_all(&dir);
}
