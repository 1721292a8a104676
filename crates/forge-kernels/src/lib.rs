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
}
