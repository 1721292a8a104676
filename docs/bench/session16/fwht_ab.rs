//! Sixteenth session: the AVX2 FWHT before (356b4c6, one pass over memory per stage from h = 8)
//! against the one in `forge_kernels::fwht` (stages three at a time through eight registers),
//! alternated round by round in one process, best of 30 rounds each, 24 blocks per call.
//! Run: `cp docs/bench/session16/fwht_ab.rs crates/forge-kernels/examples/ &&
//! cargo run --release -p forge-kernels --example fwht_ab` (output: `fwht_ab.txt`).

use std::time::Instant;

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
fn old_fwht(x: &mut [f32]) {
    use std::arch::x86_64::*;
    let n = x.len();
    if n < 8 {
        unreachable!("n >= 64 here");
    }
    let s1 = _mm256_setr_ps(1.0, -1.0, 1.0, -1.0, 1.0, -1.0, 1.0, -1.0);
    let s2 = _mm256_setr_ps(1.0, 1.0, -1.0, -1.0, 1.0, 1.0, -1.0, -1.0);
    let s4 = _mm256_setr_ps(1.0, 1.0, 1.0, 1.0, -1.0, -1.0, -1.0, -1.0);
    for c in x.chunks_exact_mut(8) {
        // SAFETY: `c` is exactly 8 contiguous f32s; unaligned load/store are used.
        let mut v = unsafe { _mm256_loadu_ps(c.as_ptr()) };
        // Multiplying by ±1 is exact, so the fused multiply-add is exactly the add/subtract of the portable path.
        v = _mm256_fmadd_ps(v, s1, _mm256_permute_ps::<0b1011_0001>(v));
        v = _mm256_fmadd_ps(v, s2, _mm256_permute_ps::<0b0100_1110>(v));
        v = _mm256_fmadd_ps(v, s4, _mm256_permute2f128_ps::<0x01>(v, v));
        // SAFETY: as for the load above.
        unsafe { _mm256_storeu_ps(c.as_mut_ptr(), v) };
    }
    let mut h = 8;
    while h < n {
        for pair in x.chunks_exact_mut(2 * h) {
            let (a, b) = pair.split_at_mut(h);
            for (ca, cb) in a.chunks_exact_mut(8).zip(b.chunks_exact_mut(8)) {
                // SAFETY: `ca` and `cb` are disjoint chunks of exactly 8 f32s (h is a multiple of 8).
                unsafe {
                    let u = _mm256_loadu_ps(ca.as_ptr());
                    let w = _mm256_loadu_ps(cb.as_ptr());
                    _mm256_storeu_ps(ca.as_mut_ptr(), _mm256_add_ps(u, w));
                    _mm256_storeu_ps(cb.as_mut_ptr(), _mm256_sub_ps(u, w));
                }
            }
        }
        h *= 2;
    }
}


fn main() {
    for n in [64usize, 512, 1024] {
        let mut x: Vec<f32> = (0..n * 24).map(|i| (i as f32 * 0.37).sin()).collect();
        let reps = 200_000 / n * 50;
        let mut best = [f64::MAX; 2];
        for r in 0..30 {
            for k in 0..2 {
                let v = (r + k) % 2;
                let t0 = Instant::now();
                for _ in 0..reps {
                    for c in x.chunks_exact_mut(n) {
                        if v == 0 {
                            // SAFETY: this machine has AVX2 and FMA (the sessions' Zen 3).
                            unsafe { old_fwht(c) }
                        } else {
                            forge_kernels::fwht::fwht(c)
                        }
                    }
                    std::hint::black_box(&mut x);
                }
                best[v] = best[v].min(t0.elapsed().as_secs_f64() / reps as f64);
            }
        }
        println!(
            "block {n} (24 blocks): old {:.2} us, new {:.2} us, new/old speed {:.2}",
            best[0] * 1e6,
            best[1] * 1e6,
            best[0] / best[1]
        );
    }
}
