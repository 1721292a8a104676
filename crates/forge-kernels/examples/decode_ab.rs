//! A/B timing of the decode kernels (one activation row) on 512-bit against 256-bit vectors,
//! interleaved in one process so that both see the same machine: for each format, rounds of
//! `reps` calls alternate between the two layouts and the best round of each is reported.
//!
//! `cargo run --release -p forge-kernels --example decode_ab -- [COUTxCIN] [rounds] [rows]`
//! (`rows` activation rows, default 1: decode; 2–15 time the verify kernels; the matrix rows
//! are split across the pool's threads as in `forge`, `RAYON_NUM_THREADS` sets them).

use forge_kernels::lutmm::intdot::{self, matmul_many, QuantX};
use std::time::Instant;

mod common;

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let (cout, cin) = common::shape_arg(&args, 1, (1536, 576));
    let rounds: usize = args.get(2).map(|s| s.parse().expect("rounds")).unwrap_or(15);
    let t: usize = args.get(3).map(|s| s.parse().expect("rows")).unwrap_or(1);
    let mut rng = common::Rng::new();
    let x = rng.activations(t * cin);
    intdot::set_wide(false);
    let plain = QuantX::new(&x, t, cin);
    intdot::set_wide(true);
    let paired = QuantX::new(&x, t, cin);
    println!("{cout}x{cin}, {} thread(s), paired layout: {}", rayon::current_num_threads(), paired.paired);
    println!("{:8} {:>10} {:>10} {:>7}", "format", "256 GB/s", "512 GB/s", "ratio");
    for format in common::formats() {
        let d = rng.dot_matrix(format, cout, cin);
        let bytes = d.packed_bytes() as f64;
        let mut y = vec![0f32; t * cout];
        // About 0.1 s of work per round at 10 GB/s.
        let reps = ((1e9 / bytes) as usize).clamp(1, 10_000);
        let mut best = [f64::MAX; 2];
        for _ in 0..rounds {
            for (i, qx) in [&plain, &paired].into_iter().enumerate() {
                let t0 = Instant::now();
                for _ in 0..reps {
                    matmul_many(true, &[&d], qx, &mut [&mut y]);
                }
                best[i] = best[i].min(t0.elapsed().as_secs_f64() / reps as f64);
            }
        }
        let gb = |t: f64| bytes / t / 1e9;
        println!("{:8} {:>10.2} {:>10.2} {:>7.2}", format!("{format:?}"), gb(best[0]), gb(best[1]), best[0] / best[1]);
    }
}
