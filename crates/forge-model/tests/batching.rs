//! Continuous batching against solo runs on the tiny `transformers` fixtures, dense and with
//! every projection on the INT8 integer-dot kernels: sequences that join (prefill inside the
//! batch) and leave at seeded random steps get, at every step, the logits they get alone.

use forge_model::load::load;
use forge_model::sampling::Rng;
use forge_model::session::KvDtype;
use forge_model::{Logits, Model, Session, Step};
use std::path::PathBuf;

#[path = "support/int8.rs"]
mod support;
use support::int8;

fn fixture(name: &str) -> Model {
    let dir = PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../../tests/fixtures")).join(name);
    load(&dir).unwrap_or_else(|e| panic!("{name}: {e:#}")).model
}

fn argmax(l: &[f32]) -> u32 {
    l.iter().enumerate().fold((0, f32::MIN), |b, (i, &v)| if v > b.1 { (i, v) } else { b }).0 as u32
}

/// A sequence's solo run: the logits after its prompt and after each of `n` greedy tokens.
fn solo(m: &Model, kv: KvDtype, prompt: &[u32], n: usize) -> Vec<Vec<f32>> {
    let mut s = m.new_session_with_kv(kv);
    let mut out = vec![m.forward(&mut s, prompt, Logits::Last).unwrap()];
    for _ in 0..n {
        let t = argmax(out.last().unwrap());
        out.push(m.forward(&mut s, &[t], Logits::Last).unwrap());
    }
    out
}

struct Live {
    seq: usize,
    session: Session,
    next: Vec<u32>,
    step: usize,
}

#[test]
fn batched_sequences_get_their_solo_logits_bit_for_bit() {
    for name in ["qwen35_tiny", "llama_tiny", "qwen35_tiny_mm"] {
        for quantized in [false, true] {
            let m = if quantized { int8(fixture(name)) } else { fixture(name) };
            let v = m.cfg.vocab_size;
            for kv in [KvDtype::F32, KvDtype::Kv8] {
                let steps = 12;
                // Prompts of 1..=6 tokens: a batch with a prefill and two decodes stays within the rows that give
                // every row its solo bits.
                let prompts: Vec<Vec<u32>> = (0..6)
                    .map(|i| forge_model::generate::synthetic_prompt(v, 40 + i)[..1 + (i * 3) % 6].to_vec())
                    .collect();
                let want: Vec<Vec<Vec<f32>>> = prompts.iter().map(|p| solo(&m, kv, p, steps)).collect();
                let mut rng = Rng::new(7);
                let (mut waiting, mut live, mut done): (Vec<usize>, Vec<Live>, usize) =
                    ((0..prompts.len()).rev().collect(), Vec::new(), 0);
                let mut rounds = 0;
                while done < prompts.len() {
                    rounds += 1;
                    assert!(rounds < 1000, "the schedule does not finish");
                    // Join with probability 1/2 while fewer than three run.
                    if !waiting.is_empty() && (live.is_empty() || (live.len() < 3 && rng.next_f64() < 0.5)) {
                        let seq = waiting.pop().unwrap();
                        let next = prompts[seq].clone();
                        live.push(Live { seq, session: m.new_session_with_kv(kv), next, step: 0 });
                    }
                    let mut batch: Vec<Step> = live
                        .iter_mut()
                        .map(|l| Step { session: &mut l.session, tokens: &l.next, want: Logits::Last })
                        .collect();
                    let rows: usize = batch.iter().map(|s| s.tokens.len()).sum();
                    let mut outs = vec![Vec::new(); batch.len()];
                    m.forward_batch(&mut batch, &mut outs).unwrap();
                    drop(batch);
                    for (l, out) in live.iter_mut().zip(&outs) {
                        let w = &want[l.seq][l.step];
                        assert!(
                            out == w,
                            "{name} int8={quantized} {kv:?} sequence {} step {} ({rows} rows): batched logits differ \
                             from solo (max |Δ| {})",
                            l.seq,
                            l.step,
                            out.iter().zip(w).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max)
                        );
                        l.next = vec![argmax(out)];
                        l.step += 1;
                    }
                    // Leave when finished, or early at random (a cancelled request).
                    let before = live.len();
                    live.retain(|l| l.step <= steps && !(l.step > 3 && rng.next_f64() < 0.05));
                    done += before - live.len();
                }
            }
        }
    }
}

/// Many decode rows at once, past the rows that keep every row's bits: each sequence's logits
/// are its solo logits within float rounding (measured up to 1e-5 on these fixtures), and its
/// greedy tokens are its solo tokens.
#[test]
fn wide_decode_batches_match_solo_runs() {
    for name in ["qwen35_tiny", "llama_tiny"] {
        for quantized in [false, true] {
            let m = if quantized { int8(fixture(name)) } else { fixture(name) };
            let v = m.cfg.vocab_size;
            let n = 16;
            let prompts: Vec<Vec<u32>> =
                (0..n).map(|i| forge_model::generate::synthetic_prompt(v, 60 + i)[..2 + i % 5].to_vec()).collect();
            let want: Vec<Vec<Vec<f32>>> = prompts.iter().map(|p| solo(&m, KvDtype::F32, p, 6)).collect();
            let mut sessions: Vec<Session> = Vec::new();
            let mut next: Vec<Vec<u32>> = Vec::new();
            for (p, w) in prompts.iter().zip(&want) {
                let mut s = m.new_session();
                m.forward(&mut s, p, Logits::None).unwrap();
                sessions.push(s);
                next.push(vec![argmax(&w[0])]);
            }
            for step in 1..=6 {
                let mut batch: Vec<Step> = sessions
                    .iter_mut()
                    .zip(&next)
                    .map(|(s, t)| Step { session: s, tokens: t, want: Logits::Last })
                    .collect();
                let mut outs = vec![Vec::new(); n];
                m.forward_batch(&mut batch, &mut outs).unwrap();
                for (i, (out, w)) in outs.iter().zip(&want).enumerate() {
                    let w = &w[step];
                    for (a, b) in out.iter().zip(w) {
                        assert!(
                            (a - b).abs() <= 3e-5 * (1.0 + b.abs()),
                            "{name} int8={quantized} sequence {i} step {step}: {a} vs solo {b}"
                        );
                    }
                    assert_eq!(argmax(out), argmax(w), "{name} int8={quantized} sequence {i} step {step}");
                    next[i] = vec![argmax(out)];
                }
            }
        }
    }
}
