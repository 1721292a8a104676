//! Paged KV caches on the tiny `transformers` fixtures: a long sequence's logits have the same
//! bits with any page size as with one page holding the whole history, for both model families
//! and every cache type; a snapshot taken mid-page and restored after the cache grew past
//! several pages gives its sequence's logits again.

use forge_model::load::load;
use forge_model::session::KvDtype;
use forge_model::{Logits, Model};
use std::path::PathBuf;

fn fixture(name: &str) -> Model {
    let dir = PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../../tests/fixtures")).join(name);
    load(&dir).unwrap_or_else(|e| panic!("{name}: {e:#}")).model
}

fn argmax(l: &[f32]) -> u32 {
    l.iter().enumerate().fold((0, f32::MIN), |b, (i, &v)| if v > b.1 { (i, v) } else { b }).0 as u32
}

/// Logits after a prompt of `prompt` tokens fed in uneven chunks, then after each of `decode`
/// greedy tokens.
fn run(m: &Model, prompt: &[u32], decode: usize) -> Vec<Vec<f32>> {
    let mut s = m.new_session();
    let mut out = Vec::new();
    let mut i = 0;
    for n in [37usize, 1, 64, 5, 200].into_iter().cycle() {
        if i >= prompt.len() {
            break;
        }
        let e = (i + n).min(prompt.len());
        out.push(m.forward(&mut s, &prompt[i..e], Logits::Last).unwrap());
        i = e;
    }
    for _ in 0..decode {
        let t = argmax(out.last().unwrap());
        out.push(m.forward(&mut s, &[t], Logits::Last).unwrap());
    }
    out
}

#[test]
fn logits_have_the_same_bits_with_any_page_size() {
    for name in ["qwen35_tiny", "llama_tiny"] {
        let base = fixture(name);
        let prompt = forge_model::generate::synthetic_prompt(base.cfg.vocab_size, 300);
        for kv in [KvDtype::F32, KvDtype::F16, KvDtype::V8, KvDtype::Kv8] {
            let whole = run(&fixture(name).with_kv_dtype(kv).with_kv_pages(4096), &prompt, 24);
            for page in [8usize, 24, 256] {
                let got = run(&fixture(name).with_kv_dtype(kv).with_kv_pages(page), &prompt, 24);
                for (step, (a, b)) in got.iter().zip(&whole).enumerate() {
                    let same = a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits());
                    assert!(same, "{name} {kv:?}: pages of {page} differ from one page at step {step}");
                }
            }
        }
    }
}

#[test]
fn a_snapshot_taken_mid_page_restores_after_the_cache_grew() {
    for name in ["qwen35_tiny", "llama_tiny"] {
        for kv in [KvDtype::F16, KvDtype::Kv8] {
            let m = fixture(name).with_kv_dtype(kv).with_kv_pages(16);
            let prompt = forge_model::generate::synthetic_prompt(m.cfg.vocab_size, 120);
            let mut s = m.new_session();
            m.forward(&mut s, &prompt[..21], Logits::Last).unwrap();
            let snap = s.clone();
            let first = m.forward(&mut s, &prompt[21..], Logits::All).unwrap();
            let grown = s.state_bytes();
            // Restored over the grown session: the pages past the snapshot's are gone and the
            // same tokens give the same bits.
            s = snap.clone();
            assert!(s.state_bytes() < grown, "{name} {kv:?}: the snapshot holds fewer pages");
            let again = m.forward(&mut s, &prompt[21..], Logits::All).unwrap();
            assert!(first.iter().zip(&again).all(|(x, y)| x.to_bits() == y.to_bits()), "{name} {kv:?}");
        }
    }
}
