//! CPU kernels. Nothing here knows about models: matrices, vectors, norms, RoPE, attention and
//! the gated delta rule. Every SIMD path has a scalar reference and a test comparing the two.
pub mod act;
pub mod attention;
pub mod deltanet;
pub mod experiment;
pub mod f16tiles;
pub mod fwht;
pub mod lut;
pub mod lutmm;
pub mod matmul;
pub mod norm;
pub mod numpy_rng;
pub mod rope;
pub mod rotation;
pub mod scratch;
pub mod simd;
pub mod stream;
pub mod team;
pub mod transpose;

/// Deterministic test data shared by the kernel tests.
#[cfg(test)]
pub(crate) mod testutil {
    /// `n` values in [-1, 1) from a seeded xorshift32.
    pub fn data(n: usize, seed: u32) -> Vec<f32> {
        let mut s = seed.wrapping_mul(2654435761).wrapping_add(1);
        (0..n)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 17;
                s ^= s << 5;
                (s as f32 / u32::MAX as f32) * 2.0 - 1.0
            })
            .collect()
    }

    /// Whether this CPU runs the AVX-512 integer kernels (VNNI/VBMI). Where an x86-64 CPU does
    /// not, a test that would have run them says so: CI's CPU may lack them, and a silent pass
    /// would read as if they had been tested.
    pub fn avx512_kernels(what: &str) -> bool {
        let has = crate::simd::has_avx512_kernels();
        if !has {
            skipped(&format!("this CPU lacks AVX-512 VNNI/VBMI, {what} were not tested"));
        }
        has
    }

    /// The same for the kernels that need AVX-512 F alone.
    pub fn avx512f(what: &str) -> bool {
        let has = crate::simd::has_avx512f();
        if !has {
            skipped(&format!("this CPU lacks AVX-512 F, {what} were not tested"));
        }
        has
    }

    /// `skipped: {msg}` on the test's stderr, written to the handle itself, which the test
    /// harness does not capture (it captures `eprintln!`), so that a passing run shows it. On
    /// other architectures the x86 kernels do not exist, and nothing is said.
    fn skipped(msg: &str) {
        if cfg!(target_arch = "x86_64") {
            use std::io::Write;
            let _ = writeln!(std::io::stderr(), "skipped: {msg}");
        }
    }
}
