//! `forge bench --quantize-stages`: the FLOP rate of each heavy stage of `forge quantize` on one
//! matrix shape, against the machine's FMA peak measured in the same run on every thread.
//!
//! The stages run the quantizer's own code on random data of the shape: the calibration
//! forward (BF16 weights, as a checkpoint holds them), the Hessian `XᵀX` of the matrix's input,
//! the factor of `H⁻¹` (f64 Cholesky and triangular inverse) and GPTQ's column sweep.

use anyhow::{bail, Result};
use forge_core::tensor::FloatSlice;
use forge_quant::gptq::{gptq_factored, Factor, Hessian};
use serde_json::json;
use std::time::Instant;

/// Tokens per calibration row, as `forge quantize` passes them.
const TOKENS: usize = 512;

pub struct StageBench {
    pub cout: usize,
    pub cin: usize,
    pub repeats: usize,
    pub json: bool,
}

struct Stage {
    name: &'static str,
    flops: f64,
    secs: f64,
    /// Peak FLOP/s of the precision the stage runs in.
    peak: f64,
}

fn best_of<T>(repeats: usize, mut f: impl FnMut() -> T) -> (f64, T) {
    let mut best = f64::INFINITY;
    let mut out = None;
    for _ in 0..repeats.max(1) {
        let t = Instant::now();
        let r = f();
        best = best.min(t.elapsed().as_secs_f64());
        out = Some(r);
    }
    (best, out.unwrap())
}

/// Uniform values in [−1, 1) from a fixed seed.
fn uniform(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed;
    (0..n)
        .map(|_| {
            s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            (s >> 40) as f32 / (1u64 << 23) as f32 - 1.0
        })
        .collect()
}

pub fn run(b: &StageBench) -> Result<()> {
    let (out, n) = (b.cout, b.cin);
    let threads = rayon::current_num_threads();
    // Every thread at once, as the stages run.
    let per_thread = rayon::broadcast(|_| forge_kernels::simd::fma_peak());
    let Some(fma) = per_thread.iter().copied().sum::<Option<f64>>() else {
        bail!("--quantize-stages: this CPU has no FMA units to measure a peak against");
    };
    let (peak32, peak64) = (2.0 * fma, fma);
    let mut stages = Vec::new();

    let x = uniform(TOKENS * n, 1);
    // BF16 is the top half of an f32: truncation is rounding enough for timing.
    let w: Vec<u16> = uniform(out * n, 2).iter().map(|&v| ((0.02 * v).to_bits() >> 16) as u16).collect();
    let mut y = vec![0f32; TOKENS * out];
    let (secs, _) =
        best_of(b.repeats, || forge_kernels::matmul::matmul_xwt(&x, TOKENS, FloatSlice::BF16(&w), out, n, &mut y));
    let flops = 2.0 * (TOKENS * out * n) as f64;
    stages.push(Stage { name: "calibration forward (BF16 weights)", flops, secs, peak: peak32 });
    drop((w, y));

    // A Hessian gathers many calibration rows: time one row's addition to a warm accumulator.
    let mut hess = Hessian::new(n);
    hess.add(&x, TOKENS);
    let (secs, _) = best_of(b.repeats, || hess.add(&x, TOKENS));
    // XᵀX is symmetric: n(n+1)/2 dot products of TOKENS terms are all it needs.
    let flops = (TOKENS * n * (n + 1)) as f64;
    stages.push(Stage { name: "Hessian XᵀX", flops, secs, peak: peak32 });
    drop(x);

    // The factor as GPTQ makes it: damped, in act order.
    hess.finish();
    let (secs, factor) = best_of(b.repeats, || Factor::new(hess.matrix(), n));
    let factor = factor?;
    drop(hess);
    let flops = 2.0 * (n as f64).powi(3) / 3.0;
    stages.push(Stage { name: "H⁻¹ factor (f64 Cholesky + inverse)", flops, secs, peak: peak64 });

    let wn = uniform(out * n, 3);
    let codebook: Vec<f32> = (0..16).map(|i| (i as f32 - 7.5) / 7.5).collect();
    let mut secs = f64::INFINITY;
    for _ in 0..b.repeats.max(1) {
        let mut wq = wn.clone();
        let t = Instant::now();
        gptq_factored(&mut wq, out, &factor, &codebook, 1)?;
        secs = secs.min(t.elapsed().as_secs_f64());
    }
    // The sweep feeds each column's error to the columns after it: out · n²/2 multiply-adds.
    stages.push(Stage { name: "GPTQ column sweep", flops: (out * n) as f64 * n as f64, secs, peak: peak32 });

    if b.json {
        let j = json!({
            "shape": [out, n],
            "tokens": TOKENS,
            "threads": threads,
            "fma_peak_gflop_s": { "f32": peak32 / 1e9, "f64": peak64 / 1e9 },
            "stages": stages.iter().map(|s| json!({
                "stage": s.name,
                "seconds": s.secs,
                "gflop": s.flops / 1e9,
                "gflop_s": s.flops / s.secs / 1e9,
                "fraction_of_peak": s.flops / s.secs / s.peak,
            })).collect::<Vec<_>>(),
        });
        println!("{}", serde_json::to_string_pretty(&j)?);
        return Ok(());
    }
    println!("shape            {out}x{n} (out x in), {TOKENS} tokens, {threads} threads, best of {}", b.repeats);
    println!(
        "FMA peak         f32 {:.0} GFLOP/s, f64 {:.0} GFLOP/s (every thread at once)",
        peak32 / 1e9,
        peak64 / 1e9
    );
    println!("{:<38} {:>9} {:>9} {:>10} {:>8}", "stage", "seconds", "GFLOP", "GFLOP/s", "of peak");
    for s in &stages {
        let rate = s.flops / s.secs;
        println!(
            "{:<38} {:>9.3} {:>9.1} {:>10.1} {:>7.0} %",
            s.name,
            s.secs,
            s.flops / 1e9,
            rate / 1e9,
            100.0 * rate / s.peak
        );
    }
    Ok(())
}
