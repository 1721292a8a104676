//! CPU kernels. Nothing here knows about models: matrices, vectors, norms, RoPE, attention and
//! the gated delta rule. Every SIMD path has a scalar reference and a test comparing the two.
pub mod act;
pub mod attention;
pub mod deltanet;
pub mod fwht;
pub mod lut;
pub mod lutmm;
pub mod matmul;
pub mod norm;
pub mod numpy_rng;
pub mod rope;
pub mod rotation;
pub mod simd;
