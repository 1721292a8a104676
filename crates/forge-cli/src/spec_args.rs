//! Speculative decoding options shared by `generate`, `bench` and `serve`.

use anyhow::{bail, Result};
use forge_model::load::Loaded;
use forge_model::sampling::{Sampler, SamplingParams};
use forge_model::session::KvDtype;
use forge_model::speculative::{Drafter, LookupDrafter, ModelDrafter, SpecConfig};
use forge_model::Model;
use std::path::Path;

#[derive(clap::Args, Clone, Debug, Default)]
pub struct SpecArgs {
    /// Speculative decoding with a draft model of the same tokenizer (a directory, GGUF file,
    /// export, bundle or short name), e.g. a 2-bit export of the target.
    #[arg(long, value_name = "MODEL", conflicts_with = "lookup")]
    pub draft: Option<String>,
    /// Speculative decoding by prompt lookup: drafts are the continuation of the latest earlier
    /// match of the last tokens in the prompt and output.
    #[arg(long)]
    pub lookup: bool,
    /// Shortest n-gram prompt lookup matches.
    #[arg(long, default_value_t = 2, value_name = "N")]
    pub lookup_min: usize,
    /// Longest n-gram prompt lookup tries first.
    #[arg(long, default_value_t = 4, value_name = "N")]
    pub lookup_max: usize,
    /// Most tokens drafted per verification (1–7: a verify scores at most 8 rows).
    #[arg(long, default_value_t = 7, value_name = "K")]
    pub draft_tokens: usize,
    /// Keep the draft length fixed (by default it shrinks after rejections and grows after
    /// full acceptances).
    #[arg(long)]
    pub fixed_draft: bool,
}

impl SpecArgs {
    pub fn enabled(&self) -> bool {
        self.lookup || self.draft.is_some()
    }

    pub fn config(&self) -> Result<SpecConfig> {
        if !(1..=7).contains(&self.draft_tokens) {
            bail!("--draft-tokens {}: must be 1 to 7 (a verification scores at most 8 rows)", self.draft_tokens);
        }
        if self.lookup_min == 0 || self.lookup_min > self.lookup_max {
            bail!("--lookup-min {} --lookup-max {}: need 1 ≤ min ≤ max", self.lookup_min, self.lookup_max);
        }
        Ok(SpecConfig { max_draft: self.draft_tokens, adaptive: !self.fixed_draft })
    }

    /// The draft model, checked to share `target`'s tokenizer.
    pub fn load_draft(&self, target: &Path) -> Result<Option<Loaded>> {
        let Some(d) = &self.draft else { return Ok(None) };
        let path = crate::cmd_bundle::resolve(d)?;
        check_same_tokenizer(target, &path)?;
        Ok(Some(forge_model::load::load(&path)?))
    }

    /// The drafter for one generation: prompt lookup, the draft model, or none. A draft
    /// model samples with the target's settings from its own stream (`seed + 1`).
    pub fn drafter<'a>(
        &self,
        draft: Option<&'a Model>,
        params: &SamplingParams,
        vocab: usize,
        kv: KvDtype,
    ) -> Option<Box<dyn Drafter + 'a>> {
        if self.lookup {
            return Some(Box::new(LookupDrafter { min_n: self.lookup_min, max_n: self.lookup_max }));
        }
        let m = draft?;
        let p = SamplingParams { seed: params.seed.wrapping_add(1), ..params.clone() };
        Some(Box::new(ModelDrafter::new(m, kv, Sampler::new(p), vocab)))
    }
}

/// A drafter must number its tokens as the target does: the same vocabulary, token by token,
/// and the same special ids.
pub fn check_same_tokenizer(target: &Path, draft: &Path) -> Result<()> {
    let (t, d) = (crate::cmd_bundle::tokenizer_fingerprint(target)?, crate::cmd_bundle::tokenizer_fingerprint(draft)?);
    if t.vocab != d.vocab {
        bail!(
            "{}: the draft model's tokenizer has {} tokens, the target's ({}) {}: a drafter needs the target's tokenizer",
            draft.display(),
            d.vocab,
            target.display(),
            t.vocab
        );
    }
    if t.specials != d.specials {
        bail!(
            "{}: the draft model's special token ids {:?} differ from the target's {:?}",
            draft.display(),
            d.specials,
            t.specials
        );
    }
    if t.sha256 != d.sha256 {
        bail!(
            "{}: the draft model's tokenizer differs from the target's ({}) in its tokens: a drafter needs the target's tokenizer",
            draft.display(),
            target.display()
        );
    }
    Ok(())
}
