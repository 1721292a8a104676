//! A warm decode loop makes no heap allocations: counted by a global allocator over decode steps
//! of the synthetic hybrid export (`forge synth --shape tiny`: attention with output gate and
//! q/k norms, Gated DeltaNet, vec2x64/vec2x16/lut4/INT8/BF16 matrices, rotations, low-rank
//! branches) and of the real SmolLM2 (Llama family, dense weights from the GGUF), on one thread
//! and on a two-worker team.
//!
//! This file holds a single test so that no other test thread allocates while it counts.

use forge_kernels::scratch::{allocations, CountingAlloc};
use forge_model::session::KvDtype;
use forge_model::Logits;

mod common;

#[global_allocator]
static GLOBAL: CountingAlloc = CountingAlloc;

/// Allocations made by `steps` greedy decode steps after `warm` untimed ones, with the loop as a
/// server or `forge bench` runs it (logits buffer and session kept, KV room reserved).
fn decode_allocations(model: &forge_model::model::Model, kv: KvDtype, warm: usize, steps: usize) -> usize {
    let mut s = model.new_session_with_kv(kv);
    let mut logits = model.forward(&mut s, &[1, 2, 3, 4, 5, 6, 7], Logits::Last).unwrap();
    s.reserve(warm + steps);
    let mut tok = forge_model::sampling::argmax(&logits);
    for _ in 0..warm {
        model.forward_into(&mut s, &[tok], Logits::Last, &mut logits).unwrap();
        tok = forge_model::sampling::argmax(&logits);
    }
    let before = allocations();
    for _ in 0..steps {
        model.forward_into(&mut s, &[tok], Logits::Last, &mut logits).unwrap();
        tok = forge_model::sampling::argmax(&logits);
    }
    let n = allocations() - before;
    assert!(logits.iter().all(|v| v.is_finite()));
    n as usize
}

#[test]
fn warm_decode_steps_allocate_nothing() {
    let dir = common::tmpdir("alloc");
    let (ok, _, err) = common::forge(&["synth", "--shape", "tiny", "--output", dir.to_str().unwrap(), "--seed", "3"]);
    assert!(ok, "forge synth failed: {err}");
    let hybrid = forge_model::load::load(&dir).unwrap();
    let smollm2 = forge_core::hub::resolve_model("smollm2", false).expect("SmolLM2 missing: run tools/setup.sh");
    let smollm2 = forge_model::load::load(&smollm2).unwrap();

    // The test harness runs this on a thread outside any pool: decode then goes through a
    // pool as a caller outside it would (`install` once, the loop inside it).
    for threads in [1, 2] {
        let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap();
        for (name, m) in [("synthetic hybrid", &hybrid.model), ("SmolLM2", &smollm2.model)] {
            // Every cache type: KV8's rotation of the keys reuses its buffer.
            for kv in [KvDtype::F32, KvDtype::F16, KvDtype::V8, KvDtype::Kv8] {
                // A worker joins a decode step's team only when it is scheduled in time to take
                // the team's job; on a loaded machine its first step may come after the warm-up,
                // and that step sets up its thread's scratch pools (a couple of allocations,
                // once per thread). A second window of 40 steps then shows the steady state.
                let counts: Vec<usize> = (0..2).map(|_| pool.install(|| decode_allocations(m, kv, 6, 40))).collect();
                let n = *counts.iter().min().unwrap();
                assert_eq!(
                    n, 0,
                    "{name}, {kv:?}, {threads} threads: {counts:?} allocations in two windows of 40 warm decode steps"
                );
            }
        }
    }
    // The counter counts: the same loop without a kept logits buffer allocates every step.
    let pool = rayon::ThreadPoolBuilder::new().num_threads(1).build().unwrap();
    let n = pool.install(|| {
        let mut s = hybrid.model.new_session();
        s.reserve(8);
        let before = allocations();
        for _ in 0..4 {
            hybrid.model.forward(&mut s, &[5], Logits::Last).unwrap();
        }
        allocations() - before
    });
    assert!(n >= 4, "a fresh logits vector per step must show up: {n}");
    let _ = std::fs::remove_dir_all(&dir);
}
