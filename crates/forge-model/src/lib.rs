//! Forge models: one graph per architecture family written over [`linear::Linear`], explicit
//! session state, sampling and generation.
pub mod compiled;
pub mod export;
pub mod generate;
pub mod linear;
pub mod load;
pub mod model;
pub mod profile;
pub mod runner;
pub mod sampling;
pub mod session;
pub mod speculative;

pub use linear::Linear;
pub use model::{Logits, Model, Step};
pub use runner::Runner;
pub use session::Session;
