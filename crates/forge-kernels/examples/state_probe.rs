//! The recurrent-state half of a Gated DeltaNet decode step at the 27B shape: one token's
//! `deltanet::recurrent_step` over 48 layers × 48 value heads of 128×128 f32 (150 MiB, read
//! from memory and written back), each layer's heads split into one run of neighbours per
//! worker as the model does. Prints the median time per token and the state's read-and-write
//! rate.
//!
//! `cargo run --release -p forge-kernels --example state_probe -- [rounds]` (threads from
//! `RAYON_NUM_THREADS`).

use rayon::prelude::*;
use std::time::Instant;

fn main() {
    let rounds: usize = std::env::args().nth(1).map(|s| s.parse().expect("rounds")).unwrap_or(15);
    let (layers, heads, dk, dv) = (48usize, 48usize, 128usize, 128usize);
    let mut state = vec![0.01f32; layers * heads * dk * dv];
    let q: Vec<f32> = (0..dk).map(|i| ((i * 7 % 13) as f32 - 6.0) / 100.0).collect();
    let v: Vec<f32> = (0..dv).map(|i| ((i * 5 % 11) as f32 - 5.0) / 10.0).collect();
    let threads = rayon::current_num_threads();
    let hpt = heads.div_ceil(threads);
    let mut ms = Vec::with_capacity(rounds);
    for _ in 0..rounds {
        let t0 = Instant::now();
        for layer in state.chunks_mut(heads * dk * dv) {
            layer.par_chunks_mut(hpt * dk * dv).for_each(|run| {
                let mut out = vec![0f32; dv];
                for s in run.chunks_mut(dk * dv) {
                    forge_kernels::deltanet::recurrent_step(s, &q, &q, &v, -0.01, 0.5, &mut out);
                }
            });
        }
        ms.push(t0.elapsed().as_secs_f64() * 1e3);
    }
    ms.sort_by(|a, b| a.total_cmp(b));
    let med = ms[ms.len() / 2];
    let bytes = 2.0 * (state.len() * 4) as f64;
    println!(
        "{layers}×{heads} heads of {dk}×{dv}, {threads} thread(s): {med:.2} ms a token (median of {rounds}), state read and written at {:.1} GB/s",
        bytes / med / 1e6
    );
}
