//! Forge quantization: codebook fitting, quantization methods, plans, exports, evaluation.
pub mod calib;
pub mod calib_gen;
pub mod check;
pub mod eval;
pub mod export;
pub mod fit;
pub mod gptq;
pub mod inspect;
pub mod lowrank;
pub mod plan;
pub mod preset;
pub mod quantize;
pub mod quantize_matrix;
pub mod recipe;
pub mod reconstruct;
pub mod synth;
