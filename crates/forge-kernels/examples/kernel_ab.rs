//! In-process A/B timing of a kernel change: a change under test reads
//! `forge_kernels::experiment::variant()`, and for each format this alternates variant 0 and 1
//! round by round (the order flipped every round) on one matrix held in cache, and reports the
//! best round of each and their ratio (variant 1 ÷ variant 0, as speed). With nothing reading
//! the switch it measures the noise (an A/A test).
//!
//! `cargo run --release -p forge-kernels --example kernel_ab -- [COUTxCIN] [rows] [rounds] [cold]`
//! (`rows` activation rows, default 1: decode; from `GEMM_MIN_T` rows on, the f32 prefill path
//! as the runtime takes it; threads from `RAYON_NUM_THREADS`; `cold`: calls cycle through
//! copies of the matrix adding up to four times the last-level cache, so that the weights come
//! from memory, and each round takes the median of its calls' speeds' inverse, not the best).
//! `EXP=N` sets the switch to N instead of 1 in variant 1's rounds (several experiments in one
//! build); `FORMATS=lut3,lut2` picks the formats (default: every integer-dot one); `NOAVX512=1` keeps the integer kernels to AVX2, as `forge --no-avx512` does.

use forge_kernels::lutmm::intdot::{matmul_many, QuantX};
use std::time::Instant;

mod common;

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let (cout, cin) = common::shape_arg(&args, 1, (1536, 576));
    let t: usize = args.get(2).map(|s| s.parse().expect("rows")).unwrap_or(1);
    let rounds: usize = args.get(3).map(|s| s.parse().expect("rounds")).unwrap_or(30);
    let cold = args.get(4).is_some_and(|s| s == "cold");
    // EXP=N: variant "1" of the switch is the value N (several experiments in one build).
    let exp: usize = std::env::var("EXP").ok().and_then(|s| s.parse().ok()).unwrap_or(1);
    if std::env::var("NOAVX512").is_ok() {
        forge_kernels::lutmm::intdot::set_avx512(false);
        forge_kernels::lutmm::intdot::set_wide(false);
    }
    let mut rng = common::Rng::new();
    let x = rng.activations(t * cin);
    let qx = QuantX::new(&x, t, cin);
    println!(
        "{cout}x{cin}, {t} row(s), {} thread(s), {} of {rounds} rounds{}",
        rayon::current_num_threads(),
        if cold { "median" } else { "best" },
        if cold { format!(", copies through {} MiB", common::cold_bytes() >> 20) } else { String::new() }
    );
    for format in common::formats() {
        let d = rng.dot_matrix(format, cout, cin);
        let bytes = d.packed_bytes() as f64;
        let copies = if cold { (common::cold_bytes() / d.packed_bytes()).max(2) } else { 1 };
        let ds = vec![d; copies];
        let mut y = vec![0f32; t * cout];
        // About 0.03 s of work per round at 10 GB/s.
        let reps = if cold { copies } else { ((3e8 / bytes) as usize).clamp(1, 10_000) };
        let mut best = [f64::MAX; 2];
        let mut rounds_of = [Vec::new(), Vec::new()];
        for r in 0..rounds {
            for k in 0..2 {
                let v = (r + k) % 2;
                forge_kernels::experiment::set(v * exp);
                let t0 = Instant::now();
                for d in ds.iter().cycle().take(reps) {
                    if forge_kernels::lutmm::intdot::f32_path(t) {
                        d.matmul_with(true, &x, t, &mut y);
                    } else {
                        matmul_many(true, &[d], &qx, &mut [&mut y]);
                    }
                }
                let s = t0.elapsed().as_secs_f64() / reps as f64;
                best[v] = best[v].min(s);
                rounds_of[v].push(s);
            }
        }
        forge_kernels::experiment::set(0);
        if cold {
            for (b, r) in best.iter_mut().zip(&mut rounds_of) {
                r.sort_by(f64::total_cmp);
                *b = r[r.len() / 2];
            }
        }
        let gb = |s: f64| bytes / s / 1e9;
        println!(
            "{:8} variant 0 {:6.2} GB/s, variant 1 {:6.2} GB/s, ratio 1/0 {:.3}",
            format!("{format:?}"),
            gb(best[0]),
            gb(best[1]),
            best[0] / best[1]
        );
    }
}
