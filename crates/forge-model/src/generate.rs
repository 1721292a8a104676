//! Autoregressive generation on one session.

use crate::model::{Logits, Model};
use crate::sampling::{Sampler, SamplingParams};
use crate::session::Session;
use crate::speculative::{Decoder, Drafter, SpecConfig, SpecStats};
use anyhow::Result;
use std::time::Instant;

#[derive(Debug, Clone, Default)]
pub struct GenStats {
    pub prompt_tokens: usize,
    pub generated_tokens: usize,
    pub prefill_s: f64,
    pub decode_s: f64,
    /// The stop id that ended the generation (`None`: `max_tokens` reached or `on_token` stopped it).
    pub stop_id: Option<u32>,
    /// Drafting and verification (all zero without a drafter).
    pub spec: SpecStats,
}

impl GenStats {
    pub fn prefill_tok_s(&self) -> f64 {
        self.prompt_tokens as f64 / self.prefill_s.max(1e-9)
    }
    /// Decode rate over the tokens produced after the first (the first comes from prefill).
    pub fn decode_tok_s(&self) -> f64 {
        self.generated_tokens.saturating_sub(1) as f64 / self.decode_s.max(1e-9)
    }
}

/// Prefill `prompt`, then sample up to `max_tokens`, calling `on_token` for each; stops at a
/// stop id (not passed to `on_token`) or when `on_token` returns false.
pub fn generate(
    model: &Model,
    session: &mut Session,
    prompt: &[u32],
    max_tokens: usize,
    sampler: &mut Sampler,
    stop_ids: &[u32],
    on_token: impl FnMut(u32) -> Result<bool>,
) -> Result<GenStats> {
    generate_with(model, session, prompt, max_tokens, sampler, stop_ids, None, SpecConfig::default(), on_token)
}

/// [`generate`] with a drafter: speculative decoding, the same tokens (greedy) or the same
/// distribution (sampling) as without.
#[allow(clippy::too_many_arguments)]
pub fn generate_with<'a>(
    model: &'a Model,
    session: &'a mut Session,
    prompt: &[u32],
    max_tokens: usize,
    sampler: &mut Sampler,
    stop_ids: &[u32],
    drafter: Option<Box<dyn Drafter + 'a>>,
    spec: SpecConfig,
    mut on_token: impl FnMut(u32) -> Result<bool>,
) -> Result<GenStats> {
    let mut st = GenStats { prompt_tokens: prompt.len(), ..Default::default() };
    if max_tokens == 0 {
        return Ok(st);
    }
    let t0 = Instant::now();
    let logits = model.forward(session, prompt, Logits::Last)?;
    st.prefill_s = t0.elapsed().as_secs_f64();
    let t1 = Instant::now();
    let params: SamplingParams = sampler.params.clone();
    let own = std::mem::replace(sampler, Sampler::new(params));
    let mut dec =
        Decoder::new(model, session, prompt.to_vec(), logits, own).with_drafter(drafter, spec).with_budget(max_tokens);
    let r = (|| {
        for i in 0..max_tokens {
            let tok = dec.next_token()?;
            if stop_ids.contains(&tok) {
                dec.unread();
                st.stop_id = Some(tok);
                break;
            }
            st.generated_tokens += 1;
            if !on_token(tok)? || i + 1 == max_tokens {
                break;
            }
        }
        Ok::<_, anyhow::Error>(())
    })();
    st.spec = dec.stats.clone();
    let stats_sampler = std::mem::replace(&mut dec.sampler, Sampler::new(SamplingParams::default()));
    *sampler = stats_sampler;
    dec.finish()?;
    r?;
    st.decode_s = t1.elapsed().as_secs_f64();
    Ok(st)
}

/// `n` token ids below `vocab` from a fixed xorshift stream: the prompt that speed
/// measurements (`forge bench`, the `ab` example) feed, the same on every run.
pub fn synthetic_prompt(vocab: usize, n: usize) -> Vec<u32> {
    let mut s = 0x9E37_79B9_7F4A_7C15u64;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            (s % vocab.max(1) as u64) as u32
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::synthetic_prompt;

    #[test]
    fn synthetic_prompt_is_fixed_in_range_and_not_constant() {
        let a = synthetic_prompt(49152, 64);
        assert_eq!(a, synthetic_prompt(49152, 64));
        assert_eq!(a[..8], synthetic_prompt(49152, 8)[..], "a longer prompt extends a shorter one");
        assert!(a.iter().all(|&t| t < 49152));
        let distinct: std::collections::BTreeSet<_> = a.iter().collect();
        assert!(distinct.len() > 60, "{} distinct ids of 64", distinct.len());
        assert!(synthetic_prompt(1, 5).iter().all(|&t| t == 0));
    }
}
