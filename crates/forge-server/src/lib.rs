//! Forge's OpenAI-compatible server and terminal chat, both over one [`engine::Engine`]: a worker
//! thread that owns the model and the prompt cache and runs requests in arrival order.
//!
//! Flow of a request: `server` (HTTP, auth, errors) → `request` (field checks) → `prompt`
//! (template, tokens, defaults) → `engine` (queue, prefill from `cache`, sampling with
//! `penalties`, stop strings) → events → `parser` (reasoning, tool calls) → JSON or SSE.

pub mod cache;
pub mod chat;
pub mod engine;
pub mod error;
pub mod parser;
pub mod penalties;
pub mod prompt;
pub mod request;
pub mod server;

pub use error::ApiError;
pub use server::{spawn_background, App, Background, ServerConfig};
