//! Logit penalties applied before sampling (presence, frequency, repetition, DRY), log-probs, and
//! the loop guard that ends degenerate repetition.
//!
//! Semantics follow the servers clients already tune for: presence/frequency as in the OpenAI API
//! (over generated tokens only), repetition as in Hugging Face (divide positive logits, multiply
//! negative ones, over a window of the whole context), DRY as in koboldcpp/llama.cpp.

use std::collections::HashMap;

#[derive(Clone, Debug, PartialEq)]
pub struct Penalties {
    pub presence: f32,
    pub frequency: f32,
    /// 1.0 = off.
    pub repetition: f32,
    /// Window of the repetition penalty over prompt + output; 0 = the whole context.
    pub repeat_last_n: usize,
    /// 0.0 = DRY off.
    pub dry_multiplier: f32,
    pub dry_base: f32,
    pub dry_allowed_length: usize,
    /// Window DRY searches; 0 = the whole context.
    pub dry_last_n: usize,
    pub dry_breakers: Vec<String>,
}

pub const DEFAULT_DRY_BREAKERS: [&str; 4] = ["\n", ":", "\"", "*"];

impl Default for Penalties {
    fn default() -> Self {
        Penalties {
            presence: 0.0,
            frequency: 0.0,
            repetition: 1.0,
            repeat_last_n: 64,
            dry_multiplier: 0.0,
            dry_base: 1.75,
            dry_allowed_length: 2,
            dry_last_n: 0,
            dry_breakers: DEFAULT_DRY_BREAKERS.iter().map(|s| s.to_string()).collect(),
        }
    }
}

/// Longest match DRY looks for; beyond it the penalty is already prohibitive and the search cost
/// would grow with every repeated token.
const DRY_MAX_MATCH: usize = 64;

impl Penalties {
    pub fn dry_active(&self) -> bool {
        self.dry_multiplier > 0.0
    }

    pub fn active(&self) -> bool {
        self.presence != 0.0 || self.frequency != 0.0 || self.repetition != 1.0 || self.dry_active()
    }

    /// Adjusts `logits` for the next token. `context` is prompt + generated tokens, of which the
    /// first `n_prompt` are the prompt; `is_breaker(id)` says whether a token ends DRY matches.
    pub fn apply(&self, logits: &mut [f32], context: &[u32], n_prompt: usize, is_breaker: &dyn Fn(u32) -> bool) {
        let vocab = logits.len();
        if self.presence != 0.0 || self.frequency != 0.0 {
            let mut counts: HashMap<u32, u32> = HashMap::new();
            for &t in &context[n_prompt.min(context.len())..] {
                *counts.entry(t).or_default() += 1;
            }
            for (t, c) in counts {
                if let Some(l) = logits.get_mut(t as usize) {
                    *l -= self.frequency * c as f32 + self.presence;
                }
            }
        }
        if self.repetition != 1.0 && self.repetition > 0.0 {
            let start = if self.repeat_last_n == 0 { 0 } else { context.len().saturating_sub(self.repeat_last_n) };
            let mut seen = vec![false; vocab];
            for &t in &context[start..] {
                let i = t as usize;
                if i < vocab && !seen[i] {
                    seen[i] = true;
                    let l = &mut logits[i];
                    *l = if *l > 0.0 { *l / self.repetition } else { *l * self.repetition };
                }
            }
        }
        if self.dry_active() {
            let start = if self.dry_last_n == 0 { 0 } else { context.len().saturating_sub(self.dry_last_n) };
            for (t, pen) in dry_penalties(&context[start..], self, is_breaker) {
                if let Some(l) = logits.get_mut(t as usize) {
                    *l -= pen;
                }
            }
        }
    }
}

/// DRY ("don't repeat yourself"): a token that would extend a repeat of an earlier sequence of
/// length n ≥ allowed_length is penalised by `multiplier · base^(n − allowed_length)`. Matches do
/// not cross breaker tokens, so repeated boilerplate such as newlines or quotes is not punished.
pub fn dry_penalties(w: &[u32], p: &Penalties, is_breaker: &dyn Fn(u32) -> bool) -> HashMap<u32, f32> {
    let mut out: HashMap<u32, f32> = HashMap::new();
    let n = w.len();
    if n < 2 || is_breaker(w[n - 1]) {
        return out;
    }
    // The earliest position a match may reach back to: the token after the last breaker.
    let suffix_floor = w.iter().rposition(|&t| is_breaker(t)).map_or(0, |i| i + 1);
    let max_suffix = (n - suffix_floor).min(DRY_MAX_MATCH);
    let mut best: HashMap<u32, usize> = HashMap::new();
    // Candidate i: w[i] followed an earlier occurrence of the current suffix ending at w[i-1].
    for i in 1..n {
        let mut k = 0;
        while k < i && k < max_suffix && w[i - 1 - k] == w[n - 1 - k] && !is_breaker(w[i - 1 - k]) {
            k += 1;
        }
        if k >= p.dry_allowed_length.max(1) {
            let e = best.entry(w[i]).or_default();
            *e = (*e).max(k);
        }
    }
    for (t, k) in best {
        let pen = p.dry_multiplier * p.dry_base.powf((k - p.dry_allowed_length) as f32);
        out.insert(t, pen.min(1e9));
    }
    out
}

/// Whether the generated tokens end in one block of at most 64 tokens repeated back to back over
/// the last `span` tokens (so at least 4 times): the signature of a model stuck in a loop.
pub fn loop_detected(generated: &[u32], span: usize) -> bool {
    if span == 0 || generated.len() < span {
        return false;
    }
    let tail = &generated[generated.len() - span..];
    (1..=64.min(span / 4)).any(|p| (p..tail.len()).all(|i| tail[i] == tail[i - p]))
}

/// Natural log-probabilities of `logits` (log-softmax, computed in f64 for stable tails).
pub fn log_softmax(logits: &[f32]) -> Vec<f32> {
    let m = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let z: f64 = logits.iter().map(|&l| ((l - m) as f64).exp()).sum();
    let lz = z.ln() as f32;
    logits.iter().map(|&l| l - m - lz).collect()
}

/// The `n` most likely ids (ties by lower id) with their log-probs.
pub fn top_n(logprobs: &[f32], n: usize) -> Vec<(u32, f32)> {
    let mut v: Vec<(u32, f32)> = logprobs.iter().enumerate().map(|(i, &l)| (i as u32, l)).collect();
    let n = n.min(v.len());
    if n == 0 {
        return Vec::new();
    }
    let cmp = |a: &(u32, f32), b: &(u32, f32)| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0));
    v.select_nth_unstable_by(n - 1, cmp);
    v.truncate(n);
    v.sort_by(cmp);
    v
}

#[cfg(test)]
mod tests {
    use super::*;

    fn no_breaker(_: u32) -> bool {
        false
    }

    #[test]
    fn presence_and_frequency_count_generated_tokens_only() {
        let p = Penalties { presence: 0.5, frequency: 0.25, ..Default::default() };
        let mut l = vec![0.0f32; 4];
        // Prompt [1, 1], generated [2, 2, 3].
        p.apply(&mut l, &[1, 1, 2, 2, 3], 2, &no_breaker);
        assert_eq!(l, vec![0.0, 0.0, -1.0, -0.75]);
    }

    #[test]
    fn repetition_penalty_is_hf_style_and_windowed() {
        let p = Penalties { repetition: 2.0, repeat_last_n: 2, ..Default::default() };
        let mut l = vec![4.0f32, -4.0, 4.0, 1.0];
        p.apply(&mut l, &[3, 0, 1, 1], 0, &no_breaker);
        // Only tokens 1 (twice, penalised once) is in the window of 2; 0 and 3 fall outside.
        assert_eq!(l, vec![4.0, -8.0, 4.0, 1.0]);
        let p = Penalties { repetition: 2.0, repeat_last_n: 0, ..Default::default() };
        let mut l = vec![4.0f32, -4.0, 4.0, 1.0];
        p.apply(&mut l, &[3, 0, 1, 1], 0, &no_breaker);
        assert_eq!(l, vec![2.0, -8.0, 4.0, 0.5]);
    }

    #[test]
    fn dry_penalises_the_continuation_of_a_repeat() {
        let p = Penalties { dry_multiplier: 1.0, dry_base: 2.0, dry_allowed_length: 2, ..Default::default() };
        // "a b c d ... a b c" → continuing with d repeats a 3-token match: 1·2^(3−2) = 2.
        let w = [1, 2, 3, 4, 9, 1, 2, 3];
        let pens = dry_penalties(&w, &p, &no_breaker);
        assert_eq!(pens.get(&4), Some(&2.0));
        assert_eq!(pens.len(), 1);
        // A breaker (9) inside the suffix stops the match.
        let w = [1, 9, 3, 4, 7, 1, 9, 3];
        let pens = dry_penalties(&w, &p, &|t| t == 9);
        assert!(pens.is_empty(), "{pens:?}");
        // Shorter than allowed_length: nothing.
        let w = [1, 4, 7, 1];
        assert!(dry_penalties(&w, &p, &no_breaker).is_empty());
    }

    #[test]
    fn dry_through_apply_uses_the_window() {
        let p = Penalties {
            dry_multiplier: 0.8,
            dry_base: 1.75,
            dry_allowed_length: 2,
            dry_last_n: 3,
            ..Default::default()
        };
        let mut l = vec![0.0f32; 10];
        p.apply(&mut l, &[1, 2, 3, 4, 1, 2, 3], 0, &no_breaker);
        assert!(l.iter().all(|&x| x == 0.0), "window of 3 cannot see the earlier repeat");
        let p = Penalties { dry_last_n: 0, ..p };
        p.apply(&mut l, &[1, 2, 3, 4, 1, 2, 3], 0, &no_breaker);
        assert!((l[4] + 0.8 * 1.75).abs() < 1e-6, "{l:?}");
    }

    #[test]
    fn loop_guard() {
        let mut g: Vec<u32> = (0..100).collect();
        for _ in 0..40 {
            g.extend([7, 8, 9]);
        }
        assert!(loop_detected(&g, 96));
        assert!(!loop_detected(&g, 256));
        assert!(!loop_detected(&(0..300).collect::<Vec<u32>>(), 256));
        assert!(loop_detected(&[5; 300], 256));
        assert!(!loop_detected(&[5; 300], 0));
    }

    #[test]
    fn log_softmax_and_top_n() {
        let lp = log_softmax(&[0.0, 1.0, 1.0, -1.0]);
        let s: f64 = lp.iter().map(|&x| (x as f64).exp()).sum();
        assert!((s - 1.0).abs() < 1e-6);
        let t = top_n(&lp, 2);
        assert_eq!(t.iter().map(|x| x.0).collect::<Vec<_>>(), vec![1, 2]);
        assert_eq!(top_n(&lp, 10).len(), 4);
        assert!(top_n(&lp, 0).is_empty());
    }
}
