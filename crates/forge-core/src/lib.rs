//! Forge core: dtypes, checkpoint readers, configs, tokenizer and chat templates.
pub mod gguf;
