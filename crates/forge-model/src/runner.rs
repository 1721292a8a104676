//! Where a sequence's forward passes run: the model itself, or a scheduler that runs them
//! together with other sequences' (the server's continuous batching). The decode loop
//! ([`crate::speculative::Decoder`]) and the model drafter take a [`Runner`], so one loop serves
//! a lone session and a batched one alike.

use crate::model::{Logits, Model};
use crate::session::Session;
use anyhow::Result;

pub trait Runner {
    /// The model the passes run through (its configuration, new sessions).
    fn model(&self) -> &Model;

    /// As [`Model::forward_into`]: `tokens` fed to `s`, the logits `want` asks for in `out`.
    fn forward_into(&self, s: &mut Session, tokens: &[u32], want: Logits, out: &mut Vec<f32>) -> Result<()>;

    /// As [`Model::commit`]: ends `s`'s open speculative pass keeping `keep` tokens.
    fn commit(&self, s: &mut Session, keep: usize) -> Result<()>;
}

impl Runner for Model {
    fn model(&self) -> &Model {
        self
    }

    fn forward_into(&self, s: &mut Session, tokens: &[u32], want: Logits, out: &mut Vec<f32>) -> Result<()> {
        Model::forward_into(self, s, tokens, want, out)
    }

    fn commit(&self, s: &mut Session, keep: usize) -> Result<()> {
        Model::commit(self, s, keep)
    }
}
