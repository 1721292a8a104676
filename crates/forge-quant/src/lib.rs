//! Forge quantization: codebook fitting, quantization methods, plans, exports, evaluation.
pub mod eval;
pub mod export;
pub mod fit;
pub mod inspect;
pub mod plan;
pub mod quantize;
pub mod quantize_matrix;
