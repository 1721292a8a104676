//! Forge core: dtypes, checkpoint readers, configs, tokenizer and chat templates.
mod backing;
pub mod chat;
pub mod checkpoint;
pub mod config;
pub mod fsutil;
pub mod gguf;
pub mod hub;
pub mod huge;
pub mod npy;
pub mod release;
pub mod safetensors_dir;
pub mod tensor;
pub mod tokenizer;
