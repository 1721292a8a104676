//! Throughput of the prefill matmul (the f32 path, `t` activation rows, one call as `forge`
//! makes it: decode, tiles, both transposes) on SmolLM2's shapes: billions of multiply-adds per
//! second, best of `rounds`, and its share of this thread's FMA peak, measured in the
//! same rounds (the machine's speed drifts within minutes): 512-bit FMAs where the CPU has
//! AVX-512, else 256-bit ones.
//!
//! `RAYON_NUM_THREADS=1 cargo run --release -p forge-kernels --example prefill_gemm -- [rounds] [t]`

use forge_kernels::lut::Format;
use std::time::Instant;

mod common;

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let rounds: usize = args.get(1).map(|s| s.parse().expect("rounds")).unwrap_or(10);
    let t: usize = args.get(2).map(|s| s.parse().expect("t")).unwrap_or(64);
    let mut rng = common::Rng::new();
    println!("t = {t}, {} thread(s)", rayon::current_num_threads());
    for format in [Format::Vec2x64, Format::Lut4] {
        for (cout, cin) in [(1536, 576), (576, 1536), (576, 576), (192, 576), (1536, 64), (1536, 128)] {
            let d = rng.lut_matrix(format, cout, cin);
            let x = rng.activations(t * cin);
            let mut y = vec![0f32; t * cout];
            let macs = (t * cout * cin) as f64;
            let reps = ((2e9 / macs) as usize).max(1);
            let (mut best, mut peak) = (f64::MAX, 0f64);
            for _ in 0..rounds {
                peak = peak.max(fma_peak());
                let t0 = Instant::now();
                for _ in 0..reps {
                    d.matmul_with(true, &x, t, &mut y);
                }
                best = best.min(t0.elapsed().as_secs_f64() / reps as f64);
            }
            let share = if peak > 0.0 {
                format!(" ({:.0} % of the FMA peak, {:.1})", 100.0 * macs / best / peak, peak / 1e9)
            } else {
                String::new()
            };
            println!("{format:?} {cout}x{cin}: {:.1} Gmac/s{share}", macs / best / 1e9);
        }
    }
}

/// Multiply-adds per second of independent FMA chains on this thread: 512-bit with AVX-512,
/// 256-bit with AVX2 and FMA (0 without either).
fn fma_peak() -> f64 {
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("avx512f") {
            // SAFETY: AVX-512 F detected just above.
            return unsafe { chains() };
        }
        if std::arch::is_x86_feature_detected!("fma") {
            // SAFETY: FMA (and so AVX) detected just above.
            return unsafe { chains256() };
        }
    }
    0.0
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn chains256() -> f64 {
    use std::arch::x86_64::*;
    let n = std::hint::black_box(2_000_000usize);
    let mut a = [_mm256_set1_ps(1.0); 12];
    let b = _mm256_set1_ps(std::hint::black_box(0.999));
    let c = _mm256_set1_ps(std::hint::black_box(0.001));
    let t0 = Instant::now();
    for _ in 0..n {
        for x in a.iter_mut() {
            *x = _mm256_fmadd_ps(*x, b, c);
        }
    }
    let dt = t0.elapsed().as_secs_f64();
    std::hint::black_box(a);
    (n * 12 * 8) as f64 / dt
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn chains() -> f64 {
    use std::arch::x86_64::*;
    let n = std::hint::black_box(2_000_000usize);
    let mut a = [_mm512_set1_ps(1.0); 24];
    let b = _mm512_set1_ps(std::hint::black_box(0.999));
    let c = _mm512_set1_ps(std::hint::black_box(0.001));
    let t0 = Instant::now();
    for _ in 0..n {
        for x in a.iter_mut() {
            *x = _mm512_fmadd_ps(*x, b, c);
        }
    }
    let dt = t0.elapsed().as_secs_f64();
    std::hint::black_box(a);
    (n * 24 * 16) as f64 / dt
}
