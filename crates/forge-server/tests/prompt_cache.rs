//! Prompt-cache correctness: the logits a request gets from a restored snapshot (or a continued or
//! truncated state) equal a cold run over the same tokens. On the tiny qwen3_5 fixture, whose
//! DeltaNet layers carry recurrent state that cannot be rewound, and on an attention-only Llama
//! fixture, where truncation of the KV rows is used instead of snapshots.

mod common;

use forge_model::session::KvDtype;
use forge_model::{Logits, Model};
use forge_server::cache::{PrefillResult, Prefilled, PromptCache};
use std::sync::atomic::AtomicBool;
use std::sync::Mutex;

fn tokens(fixture: &str) -> Vec<u32> {
    let text = std::fs::read_to_string(common::fixtures().join(fixture).join("tokens.txt")).unwrap();
    text.split(|c: char| c.is_whitespace() || c == ',').filter(|s| !s.is_empty()).map(|s| s.parse().unwrap()).collect()
}

fn load(fixture: &str) -> Model {
    forge_model::load::load(&common::fixtures().join(fixture)).expect("fixture").model
}

fn cold(model: &Model, toks: &[u32]) -> Vec<f32> {
    model.forward(&mut model.new_session(), toks, Logits::Last).unwrap()
}

/// A cold run split at the same positions as a cached one: bit-identical arithmetic.
fn cold_split(model: &Model, toks: &[u32], at: &[usize]) -> Vec<f32> {
    let mut s = model.new_session();
    let mut prev = 0;
    let mut l = Vec::new();
    for &p in at.iter().chain(std::iter::once(&toks.len())) {
        if p > prev {
            l = model.forward(&mut s, &toks[prev..p], Logits::Last).unwrap();
            prev = p;
        }
    }
    l
}

/// Bounds a cached run against a cold one over the same tokens where the two cut the prompt into
/// different blocks: f32 rounding in another order, a few times what it comes to on the fixtures.
const SPLIT_TOL: f32 = 2e-5;

fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max)
}

fn prefill(cache: &Mutex<PromptCache>, model: &Model, prompt: &[u32], snaps: &[usize]) -> Prefilled {
    match PromptCache::prefill(cache, model, prompt, snaps, 512, &AtomicBool::new(false)).unwrap() {
        PrefillResult::Done(p) => p,
        PrefillResult::Cancelled => panic!("not cancelled"),
    }
}

/// Generates `n` greedy tokens after a prefill and stores the final state, as the engine does.
fn generate_and_store(cache: &Mutex<PromptCache>, model: &Model, prompt: &[u32], p: Prefilled, n: usize) -> Vec<u32> {
    let (mut s, mut l) = (p.session, p.logits);
    let mut all = prompt.to_vec();
    for _ in 0..n {
        let t = forge_model::sampling::argmax(&l);
        all.push(t);
        l = model.forward(&mut s, &[t], Logits::Last).unwrap();
    }
    cache.lock().unwrap().insert(all.clone(), s, l, false);
    all
}

/// The cache types the restore tests run with, and how far a cached run may be from a cold one
/// that cut the prompt into other blocks: f32 rounding in another order, and for kv8 a key or
/// value moved by that rounding across a code's boundary (none does on these fixtures: within
/// `SPLIT_TOL` here, but the blocks' rounding differs between CPUs).
const TYPES: [(KvDtype, f32); 2] = [(KvDtype::F32, SPLIT_TOL), (KvDtype::Kv8, 1e-3)];

#[test]
fn hybrid_model_restores_snapshots_exactly() {
    for (dtype, tol) in TYPES {
        hybrid_model_restores_snapshots(dtype, tol);
    }
}

fn hybrid_model_restores_snapshots(dtype: KvDtype, tol: f32) {
    let model = load("qwen35_tiny").with_kv_dtype(dtype);
    assert!(model.is_hybrid());
    let toks = tokens("qwen35_tiny");
    assert!(toks.len() >= 40);
    let cache = Mutex::new(PromptCache::new(&model, 1 << 30, 16));

    // Request A: "system prompt" of 12 tokens, a first turn up to 24; snapshots at both.
    let a = &toks[..24];
    let pa = prefill(&cache, &model, a, &[12, 24]);
    assert_eq!(pa.cached, 0);
    assert!(max_diff(&pa.logits, &cold_split(&model, a, &[12])) == 0.0);
    assert!(max_diff(&pa.logits, &cold(&model, a)) < tol);
    let a_full = generate_and_store(&cache, &model, a, pa, 4);

    // Request B continues A's conversation (prompt + generated + more): the final state is reused.
    let mut b = a_full.clone();
    b.extend_from_slice(&toks[30..36]);
    let pb = prefill(&cache, &model, &b, &[]);
    assert_eq!(pb.cached, a_full.len());
    assert!(max_diff(&pb.logits, &cold_split(&model, &b, &[12, 24, 25, 26, 27, 28])) == 0.0);
    assert!(max_diff(&pb.logits, &cold(&model, &b)) < tol, "{}", max_diff(&pb.logits, &cold(&model, &b)));
    generate_and_store(&cache, &model, &b, pb, 2);

    // Request C shares only the system prompt: the snapshot at 12 is restored (no truncation is
    // possible with recurrent state).
    let mut c = toks[..12].to_vec();
    c.extend_from_slice(&toks[40..50]);
    let pc = prefill(&cache, &model, &c, &[12]);
    assert_eq!(pc.cached, 12);
    assert!(max_diff(&pc.logits, &cold_split(&model, &c, &[12])) == 0.0);
    assert!(max_diff(&pc.logits, &cold(&model, &c)) < tol);

    // Request D repeats A's prompt exactly: the snapshot at its end supplies the logits, no forward.
    let pd = prefill(&cache, &model, a, &[]);
    assert_eq!(pd.cached, a.len());
    assert!(max_diff(&pd.logits, &cold_split(&model, a, &[12])) == 0.0);
    // ... and generating from the restored state equals generating from a cold state.
    let from_cache = generate_and_store(&cache, &model, a, pd, 5);
    let cold_cache = Mutex::new(PromptCache::new(&model, 1 << 30, 16));
    let fresh = prefill(&cold_cache, &model, a, &[12]);
    assert_eq!(generate_and_store(&cold_cache, &model, a, fresh, 5), from_cache);

    // A prompt sharing a prefix with no snapshot boundary gets nothing it cannot use exactly.
    let mut e = toks[..18].to_vec();
    e.push(toks[60]);
    let pe = prefill(&cache, &model, &e, &[]);
    assert_eq!(pe.cached, 12, "only the snapshot at 12 is a usable prefix");
    assert!(max_diff(&pe.logits, &cold(&model, &e)) < tol);
}

#[test]
fn cancelled_prefill_leaves_a_usable_cache() {
    let model = load("qwen35_tiny");
    let toks = tokens("qwen35_tiny");
    let cache = Mutex::new(PromptCache::new(&model, 1 << 30, 16));
    let p = prefill(&cache, &model, &toks[..16], &[8]);
    generate_and_store(&cache, &model, &toks[..16], p, 1);
    let cancel = AtomicBool::new(true);
    let r = PromptCache::prefill(&cache, &model, &toks[..40], &[], 4, &cancel).unwrap();
    assert!(matches!(r, PrefillResult::Cancelled));
    let p = prefill(&cache, &model, &toks[..40], &[]);
    assert!(p.cached >= 8);
    assert!(max_diff(&p.logits, &cold(&model, &toks[..40])) < SPLIT_TOL);
}

#[test]
fn attention_only_model_truncates_to_the_common_prefix() {
    for (dtype, tol) in TYPES {
        attention_only_model_truncates(dtype, tol);
    }
}

fn attention_only_model_truncates(dtype: KvDtype, tol: f32) {
    let model = load("llama_tiny").with_kv_dtype(dtype);
    assert!(!model.is_hybrid());
    let toks = tokens("llama_tiny");
    let n = toks.len().min(32);
    let cache = Mutex::new(PromptCache::new(&model, 1 << 30, 16));
    let a = &toks[..n];
    let pa = prefill(&cache, &model, a, &[]);
    generate_and_store(&cache, &model, a, pa, 3);
    // Diverges from A after 10 tokens: A's state is cut back to 10 rows.
    let mut b = toks[..10].to_vec();
    b.extend(toks[..5].iter().rev());
    let pb = prefill(&cache, &model, &b, &[]);
    assert_eq!(pb.cached, 10);
    // Rows 0..10 were computed inside a 32-row block, so equal to tolerance (not bit for bit).
    assert!(max_diff(&pb.logits, &cold(&model, &b)) < tol);
    // A is still there (it was cloned, not consumed): its prompt again reuses all but one token.
    let pa2 = prefill(&cache, &model, a, &[]);
    assert_eq!(pa2.cached, n - 1);
    assert!(max_diff(&pa2.logits, &cold(&model, a)) < tol);
}

#[test]
fn eviction_respects_the_budgets() {
    let model = load("llama_tiny");
    let toks = tokens("llama_tiny");
    let cache = Mutex::new(PromptCache::new(&model, 1 << 30, 3));
    for i in 0..6 {
        let mut p = vec![toks[i]];
        p.extend_from_slice(&toks[..8]);
        let pp = prefill(&cache, &model, &p, &[]);
        generate_and_store(&cache, &model, &p, pp, 1);
        assert!(cache.lock().unwrap().len() <= 3);
    }
    let tiny = Mutex::new(PromptCache::new(&model, 1, 8));
    let pp = prefill(&tiny, &model, &toks[..8], &[]);
    generate_and_store(&tiny, &model, &toks[..8], pp, 1);
    assert!(tiny.lock().unwrap().is_empty(), "an entry over the byte budget is not kept");
}
