//! Long inputs in chunks: the logits of a prompt run a chunk at a time equal the one-pass
//! logits (within the rounding of the matrix products' row blocking, and what a rounded cache
//! makes of it) for every chunk size,
//! both model families and every cache type; the heap a prefill needs beyond its KV cache
//! stops growing with the prompt past one chunk; a prompt past the context size is refused
//! with the session unchanged.
//!
//! The checks run in one test: the heap counter is process-wide.

use forge_kernels::scratch::{live_bytes, peak_bytes, reset_peak, CountingAlloc};
use forge_model::load::load;
use forge_model::session::KvDtype;
use forge_model::{Logits, Model};
use std::path::PathBuf;

#[global_allocator]
static GLOBAL: CountingAlloc = CountingAlloc;

fn fixture(name: &str) -> Model {
    let dir = PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../../tests/fixtures")).join(name);
    load(&dir).unwrap_or_else(|e| panic!("{name}: {e:#}")).model
}

fn chunked_prefill_matches_one_pass() {
    for name in ["qwen35_tiny", "llama_tiny"] {
        let prompt = forge_model::generate::synthetic_prompt(fixture(name).cfg.vocab_size, 200);
        for kv in [KvDtype::F32, KvDtype::F16, KvDtype::V8, KvDtype::Kv8] {
            let one = fixture(name).with_kv_dtype(kv).with_prefill_chunk(4096);
            let want = one.forward(&mut one.new_session(), &prompt, Logits::All).unwrap();
            let mut worst = 0f32;
            for chunk in [1usize, 7, 8, 64, 199] {
                let m = fixture(name).with_kv_dtype(kv).with_prefill_chunk(chunk);
                let mut s = m.new_session();
                let got = m.forward(&mut s, &prompt, Logits::All).unwrap();
                assert_eq!((got.len(), s.pos), (want.len(), prompt.len()), "{name} {kv:?} chunk {chunk}");
                let last = m.forward(&mut m.new_session(), &prompt, Logits::Last).unwrap();
                assert_eq!(last, got[got.len() - last.len()..], "{name} {kv:?} chunk {chunk}: last row");
                let w = got.iter().zip(&want).map(|(a, b)| (a - b).abs() / (1.0 + b.abs())).fold(0f32, f32::max);
                worst = worst.max(w);
            }
            // f32 caches: the products' rounding alone (measured up to 1.1e-5, in the hybrid's
            // DeltaNet layers). A rounded cache can turn a last-bit difference of a key or value
            // into the neighbouring f16 value (measured 4.4e-5) or 8-bit code (7e-4).
            let tol = match kv {
                KvDtype::F32 => 2e-5,
                KvDtype::F16 => 1e-4,
                KvDtype::V8 | KvDtype::Kv8 => 1.5e-3,
            };
            assert!(worst <= tol, "{name} {kv:?}: chunked logits {worst:e} from one pass");
        }
    }
}

/// Heap held at the peak of a prefill of `n` tokens, less the session's caches and states.
fn prefill_scratch(m: &Model, n: usize) -> usize {
    let prompt = forge_model::generate::synthetic_prompt(m.cfg.vocab_size, n);
    let mut s = m.new_session();
    s.reserve(n);
    let mut out = Vec::with_capacity(m.cfg.vocab_size);
    let base = live_bytes();
    reset_peak();
    m.forward_into(&mut s, &prompt, Logits::Last, &mut out).unwrap();
    peak_bytes() - base
}

fn prefill_scratch_stops_growing_past_one_chunk() {
    let pool = rayon::ThreadPoolBuilder::new().num_threads(2).build().unwrap();
    for name in ["qwen35_tiny", "llama_tiny"] {
        let chunked = fixture(name).with_prefill_chunk(64);
        let whole = fixture(name).with_prefill_chunk(4096);
        let (c1, c2, w1, w2) = pool.install(|| {
            // Warm the scratch pools first (they keep what they held).
            prefill_scratch(&chunked, 1024);
            prefill_scratch(&whole, 1024);
            (
                prefill_scratch(&chunked, 256),
                prefill_scratch(&chunked, 1024),
                prefill_scratch(&whole, 256),
                prefill_scratch(&whole, 1024),
            )
        });
        // One pass holds activations for every token: its scratch grows with the prompt. In
        // chunks, only attention's scores of one part of a token's history grow (a sixteenth
        // of the history, a few KiB here).
        let (grown_chunked, grown_whole) = (c2.saturating_sub(c1), w2.saturating_sub(w1));
        assert!(grown_whole > 100 * 1024, "{name}: one pass grew by {grown_whole} bytes only");
        assert!(
            grown_chunked * 20 <= grown_whole,
            "{name}: chunked prefill scratch {c1} → {c2} bytes from 256 to 1024 tokens (one pass {w1} → {w2})"
        );
    }
}

fn past_the_context_size_is_refused_with_the_session_unchanged() {
    for name in ["qwen35_tiny", "llama_tiny"] {
        let m = fixture(name).with_ctx_size(100).with_prefill_chunk(16);
        let prompt = forge_model::generate::synthetic_prompt(m.cfg.vocab_size, 101);
        let mut s = m.new_session();
        m.forward(&mut s, &prompt[..60], Logits::Last).unwrap();
        let before = s.clone();
        let e = m.forward(&mut s, &prompt[60..], Logits::Last).unwrap_err().to_string();
        assert!(e.contains("context size of 100"), "{name}: {e}");
        assert_eq!((s.pos, s.state_bytes()), (before.pos, before.state_bytes()), "{name}");
        // The session goes on as if the refused input had never come.
        let a = m.forward(&mut s, &prompt[60..100], Logits::Last).unwrap();
        let b = m.forward(&mut before.clone(), &prompt[60..100], Logits::Last).unwrap();
        assert_eq!(a, b, "{name}");
        let e = m.forward(&mut s, &prompt[100..], Logits::Last).unwrap_err().to_string();
        assert!(e.contains("past its context size"), "{name}: {e}");
    }
}

#[test]
fn prefill_in_chunks() {
    chunked_prefill_matches_one_pass();
    prefill_scratch_stops_growing_past_one_chunk();
    past_the_context_size_is_refused_with_the_session_unchanged();
}
