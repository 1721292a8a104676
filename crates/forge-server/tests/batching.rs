//! Continuous batching in the engine: requests served side by side (`parallel` slots, their
//! passes batched by the scheduler) get exactly what they get served one at a time, and a long
//! prompt never holds a running stream back for more than one prompt chunk.
//!
//! Models: SmolLM2-135M-Instruct (GGUF blocks), and the hybrid `qwen3_5` fixture (48/16-style
//! DeltaNet and attention layers, tiny) dense with f32 caches and with every projection on the
//! INT8 integer-dot kernels and KV8 caches. The fixture has no tokenizer: SmolLM2's decodes its
//! ids (text is only compared, never read).

mod common;

#[path = "../../forge-model/tests/support/int8.rs"]
mod support;

use common::*;
use forge_core::tokenizer::Tokenizer;
use forge_model::sampling::{Rng, SamplingParams};
use forge_model::session::KvDtype;
use forge_model::Model;
use forge_server::engine::{Engine, EngineConfig, Event, GenParams, Job};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

fn tokenizer() -> Arc<Tokenizer> {
    Arc::new(forge_model::load::load(&smollm2()).expect("load SmolLM2").tokenizer.expect("SmolLM2's tokenizer"))
}

/// What a job returned: per token its text and log-prob (bit-equal log-probs mean equal logits
/// in practice), then the finish reason.
type Answer = (Vec<(String, u32)>, String);

fn engine(model: Model, tok: &Arc<Tokenizer>, parallel: usize, chunk: usize) -> Engine {
    // No prompt cache: a request's prefill must not depend on what ran before it.
    let cfg = EngineConfig { ctx: 1024, cache_bytes: 0, prefill_chunk: chunk, parallel, ..EngineConfig::default() };
    Engine::start(model, tok.clone(), cfg).expect("engine")
}

/// Submits every job at once; the answers in submission order.
fn serve(e: &Engine, jobs: &[(Vec<u32>, usize, u64)]) -> Vec<Answer> {
    let rxs: Vec<_> = jobs
        .iter()
        .map(|(prompt, max_tokens, seed)| {
            let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
            // Even seeds greedy, odd ones sampled (seeded: the draws repeat).
            let sampling = if seed % 2 == 0 {
                SamplingParams { temperature: 0.0, seed: *seed, ..SamplingParams::default() }
            } else {
                SamplingParams { temperature: 0.9, top_p: 0.95, seed: *seed, ..SamplingParams::default() }
            };
            let params = GenParams { max_tokens: *max_tokens, sampling, logprobs: Some(0), ..GenParams::default() };
            let job = Job::new(prompt.clone(), Vec::new(), params, Arc::new(AtomicBool::new(false)), tx);
            assert!(e.submit(job).is_ok());
            rx
        })
        .collect();
    rxs.into_iter()
        .map(|mut rx| {
            let mut toks = Vec::new();
            loop {
                match rx.blocking_recv().expect("the job ended without Done") {
                    Event::Token { text, logprob } => toks.push((text, logprob.expect("logprob").logprob.to_bits())),
                    Event::Done(st) => return (toks, st.finish.as_str().to_string()),
                    Event::Error(e) => panic!("job failed: {e}"),
                    Event::Started | Event::Text(_) => {}
                }
            }
        })
        .collect()
}

/// Ten requests with prompts of 1–40 tokens (the short ones prefilled inside decode batches,
/// the long ones as chunks between them) and 3–40 new tokens, so they join and leave at
/// different steps.
fn jobs(vocab: usize, seed: u64) -> Vec<(Vec<u32>, usize, u64)> {
    let mut rng = Rng::new(seed);
    // Ids from 3 on: 0–2 are SmolLM2's special tokens, and a stop id in a prompt is legal but
    // makes nothing interesting.
    (0..10)
        .map(|i| {
            let n = [1, 3, 5, 8, 12, 40][rng.next_u64() as usize % 6];
            let prompt = (0..n).map(|_| 3 + (rng.next_u64() % (vocab as u64 - 3)) as u32).collect();
            (prompt, 3 + (rng.next_u64() % 38) as usize, i)
        })
        .collect()
}

fn fixture(name: &str) -> Model {
    forge_model::load::load(&fixtures().join(name)).expect("fixture").model
}

fn batched_equals_solo(name: &str, model: impl Fn() -> Model, tok: &Arc<Tokenizer>) {
    let vocab = model().cfg.vocab_size.min(tok.vocab_size());
    let jobs = jobs(vocab, 7);
    let solo = serve(&engine(model(), tok, 1, 16), &jobs);
    let e = engine(model(), tok, 4, 16);
    let batched = serve(&e, &jobs);
    for (i, (s, b)) in solo.iter().zip(&batched).enumerate() {
        assert_eq!(s, b, "{name}: request {i} beside others differs from its solo run");
    }
    let st = &e.scheduler.stats;
    let (batched, passes) = (st.batched.load(Ordering::SeqCst), st.passes.load(Ordering::SeqCst));
    assert!(batched >= passes / 4, "{name}: only {batched} of the passes ran batched ({passes} forwards)");
    assert!(st.rows.load(Ordering::SeqCst) > 0);
}

#[test]
fn requests_side_by_side_get_what_they_get_alone() {
    let tok = tokenizer();
    batched_equals_solo("SmolLM2", || forge_model::load::load(&smollm2()).unwrap().model, &tok);
    batched_equals_solo("qwen35_tiny", || fixture("qwen35_tiny"), &tok);
    batched_equals_solo(
        "qwen35_tiny INT8 + KV8",
        || support::int8(fixture("qwen35_tiny")).with_kv_dtype(KvDtype::Kv8),
        &tok,
    );
}

#[test]
fn a_long_prompt_holds_running_streams_back_one_chunk_at_most() {
    let tok = tokenizer();
    let model = fixture("qwen35_tiny");
    let vocab = model.cfg.vocab_size;
    let e = engine(model, &tok, 4, 16);
    let mut rng = Rng::new(11);
    let mut ids = |n: usize| (0..n).map(|_| 3 + (rng.next_u64() % (vocab as u64 - 3)) as u32).collect::<Vec<_>>();
    // Three streams decoding 200 tokens each, then a 600-token prompt (38 chunks of 16).
    let mut jobs: Vec<(Vec<u32>, usize, u64)> = (0..3).map(|i| (ids(4), 200, 2 * i)).collect();
    jobs.push((ids(600), 4, 8));
    let answers = serve(&e, &jobs);
    assert!(answers.iter().all(|(t, _)| !t.is_empty()));
    let st = &e.scheduler.stats;
    assert!(st.long.load(Ordering::SeqCst) >= 600 / 16, "the prompt ran in chunks");
    assert!(st.long_beside_short.load(Ordering::SeqCst) >= 1, "prompt chunks ran between decode steps");
    let waited = st.long_waits.load(Ordering::SeqCst);
    assert!(waited <= 1, "a decode step waited for {waited} prompt chunks");
    // Decode steps of the streams went together.
    assert!(st.batched.load(Ordering::SeqCst) > 0);
}
