//! The reference engine against Hugging Face `transformers` on tiny random-weight checkpoints
//! (made by tools/make_qwen35_fixtures.py and tools/make_llama_fixtures.py).

use forge_core::npy::read_npy;
use forge_model::load::load;
use forge_model::session::LayerState;
use forge_model::{Logits, Model, Session};
use std::path::PathBuf;

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../../tests/fixtures")).join(name)
}

fn tokens(dir: &std::path::Path) -> Vec<u32> {
    std::fs::read_to_string(dir.join("tokens.txt"))
        .unwrap()
        .split(|c: char| c.is_whitespace() || c == ',')
        .filter(|s| !s.is_empty())
        .map(|s| s.parse().unwrap())
        .collect()
}

fn argmax(x: &[f32]) -> usize {
    x.iter().enumerate().fold(0, |b, (i, &v)| if v > x[b] { i } else { b })
}

/// Max abs error, within `tol`, and every row's argmax identical.
fn compare(name: &str, got: &[f32], want: &[f32], vocab: usize, tol: f32) -> f32 {
    assert_eq!(got.len(), want.len(), "{name}: logits size");
    let err = got.iter().zip(want).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
    for (r, (g, w)) in got.chunks(vocab).zip(want.chunks(vocab)).enumerate() {
        assert_eq!(argmax(g), argmax(w), "{name}: argmax differs at row {r}");
    }
    assert!(err < tol, "{name}: max abs logit error {err} (tolerance {tol})");
    err
}

/// Run `toks` split into the given chunk sizes, returning all logits.
fn run_chunks(m: &Model, toks: &[u32], chunks: &[usize]) -> (Vec<f32>, Session) {
    let mut s = m.new_session();
    let mut out = Vec::new();
    let mut i = 0;
    for &c in chunks.iter().cycle() {
        if i >= toks.len() {
            break;
        }
        let end = (i + c).min(toks.len());
        out.extend(m.forward(&mut s, &toks[i..end], Logits::All).unwrap());
        i = end;
    }
    (out, s)
}

/// `tol` bounds each logit's distance from transformers' f32 logits, which differ from ours only
/// by the order of f32 roundings: a few times what the model shows, whose size depends on its
/// depth and logit scale. The states' bounds below are the same kind.
fn check_model(name: &str, with_states: bool, tol: f32) {
    check_model_file(name, &fixture(name), with_states, tol)
}

/// [`check_model`] of the fixture `name`'s tokens and transformers' outputs on the model at
/// `path` (the fixture itself, or a conversion of it).
fn check_model_file(name: &str, path: &std::path::Path, with_states: bool, tol: f32) {
    let dir = fixture(name);
    let name = &format!("{name} ({})", path.file_name().unwrap().to_string_lossy());
    let loaded = load(path).unwrap_or_else(|e| panic!("{name}: {e:#}"));
    let m = &loaded.model;
    let toks = tokens(&dir);
    let (shape, want) = read_npy(&dir.join("logits.npy")).unwrap();
    assert_eq!(shape, vec![toks.len(), m.cfg.vocab_size]);
    let v = m.cfg.vocab_size;
    let (prefill, s) = run_chunks(m, &toks, &[toks.len()]);
    let e1 = compare(&format!("{name} prefill"), &prefill, &want, v, tol);
    let (decode, _) = run_chunks(m, &toks, &[1]);
    let e2 = compare(&format!("{name} decode"), &decode, &want, v, tol);
    // Prefill then decode, and verify-sized blocks (8) mixed with odd sizes.
    let (mixed, _) = run_chunks(m, &toks, &[37, 1, 8, 1, 1, 3]);
    let e3 = compare(&format!("{name} mixed"), &mixed, &want, v, tol);
    eprintln!("{name}: max abs logit error prefill {e1:.2e}, decode {e2:.2e}, mixed {e3:.2e}");
    if !with_states {
        return;
    }
    let t = toks.len();
    for (i, st) in s.layers.iter().enumerate() {
        match st {
            LayerState::Delta(d) => {
                // transformers keeps `kernel` columns per channel; only the last kernel−1 matter.
                let (cs, conv) = read_npy(&dir.join(format!("conv_state_{i}.npy"))).unwrap();
                let (cd, k) = (cs[0], cs[1]);
                let mut err = 0f32;
                for ch in 0..cd {
                    for j in 1..k {
                        err = err.max((conv[ch * k + j] - d.conv[(j - 1) * cd + ch]).abs());
                    }
                }
                assert!(err < 1e-5, "{name} layer {i}: conv state error {err}");
                let (_, rec) = read_npy(&dir.join(format!("recurrent_state_{i}.npy"))).unwrap();
                let err = rec.iter().zip(&d.rec).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
                assert_eq!(rec.len(), d.rec.len());
                assert!(err < 2e-6, "{name} layer {i}: recurrent state error {err}");
            }
            LayerState::Attn(c) => {
                let (ks, kc) = read_npy(&dir.join(format!("k_cache_{i}.npy"))).unwrap();
                let (_, vc) = read_npy(&dir.join(format!("v_cache_{i}.npy"))).unwrap();
                let (kvh, hd) = (ks[0], ks[2]);
                assert_eq!((ks[1], c.len(), c.heads()), (t, t, kvh));
                let mut err = 0f32;
                for h in 0..kvh {
                    let (keys, values) = c.rows_f32(h);
                    for p in 0..t {
                        for d in 0..hd {
                            let (mine, theirs) = (p * hd + d, (h * t + p) * hd + d);
                            err = err.max((kc[theirs] - keys[mine]).abs()).max((vc[theirs] - values[mine]).abs());
                        }
                    }
                }
                assert!(err < 4e-5, "{name} layer {i}: kv cache error {err}");
            }
        }
    }
}

#[test]
fn qwen35_text_f32() {
    check_model("qwen35_tiny", true, 1e-4);
}

#[test]
fn qwen35_multimodal_sharded_bf16() {
    check_model("qwen35_tiny_mm", true, 1.5e-4);
}

/// llama.cpp's converter's files of the same checkpoints (`qwen35` GGUF: norms stored as
/// 1 + w, `-exp(A_log)`, value heads tiled; tools/make_qwen35_gguf_fixtures.py) give
/// transformers' logits and states: the recurrent and conv states come out in Hugging Face's
/// head order, so the tiling is undone, not merely consistent.
#[test]
fn qwen35_gguf_f32() {
    check_model_file("qwen35_tiny", &fixture("qwen35_gguf/tiny-f32.gguf"), true, 1e-4);
}

#[test]
fn qwen35_gguf_bf16_tied() {
    check_model_file("qwen35_tiny_mm", &fixture("qwen35_gguf/mm-bf16.gguf"), true, 1.5e-4);
}

#[test]
fn llama() {
    check_model("llama_tiny", false, 3e-5);
}

#[test]
fn llama3_rope_scaling() {
    check_model("llama3_tiny", false, 2e-5);
}

#[test]
fn qwen2_bias_tied() {
    check_model("qwen2_tiny", false, 4e-5);
}

#[test]
fn qwen3_qk_norm() {
    check_model("qwen3_tiny", false, 3e-5);
}

#[test]
fn hf_decode_path_agrees_with_prefill_fixture() {
    // transformers' own recurrent decode (logits_decode.npy) agrees with its chunked prefill; our
    // prefill must match both.
    for (name, tol) in [("qwen35_tiny", 1e-4), ("qwen35_tiny_mm", 1.5e-4)] {
        let dir = fixture(name);
        let m = load(&dir).unwrap().model;
        let (_, want) = read_npy(&dir.join("logits_decode.npy")).unwrap();
        let (got, _) = run_chunks(&m, &tokens(&dir), &[70, 1]);
        compare(name, &got, &want, m.cfg.vocab_size, tol);
    }
}
