//! Forge's OpenAI-compatible server and terminal chat, both over one [`engine::Engine`]: slots
//! that serve requests side by side in arrival order, their forward passes batched by one
//! scheduler ([`batch`]), sharing one prompt cache.
//!
//! Flow of a request: `server` (HTTP, auth, errors) → `request` (field checks) → `prompt`
//! (template, tokens, defaults) → `engine` (queue, a slot: prefill from `cache`, sampling with
//! `penalties`, stop strings; passes through `batch`) → events → `parser` (reasoning, tool
//! calls) → JSON or SSE.

pub mod batch;
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
