//! The decode loop every caller shares (`generate`, `chat`, `bench`, the server): a [`Drafter`]
//! proposes tokens, the target scores the last decided token and the drafts in one forward of
//! up to [`VERIFY_MAX_ROWS`] rows, and the longest acceptable prefix is kept, with one more token
//! from the target after it.
//!
//! Exactness. A forward of up to `VERIFY_MAX_ROWS` rows gives each row the bits a one-row decode
//! step would, so greedy decoding with any drafter returns the ids plain greedy decoding does.
//! When sampling, a draft `d` drawn from the drafter's `q` is kept with probability
//! `min(1, p(d)/q(d))`, `p` being the distribution plain sampling would draw from at that row
//! (temperature, top-k/p, min-p and the logit hook, penalties included); a rejected row draws
//! from `normalize(max(0, p − q))`. Every token is then distributed exactly as plain sampling
//! draws it (Leviathan et al., Chen et al. 2023). A drafter without a distribution (prompt
//! lookup) is a one-hot `q`.
//!
//! Rollback. The target's pass stays open ([`Session::begin_speculation`]) while its tokens are
//! handed out one by one, and is committed when the next one is needed, keeping the fed tokens
//! the caller took (a caller that stops at a stop token, or forces a token, keeps fewer).

use crate::model::{Logits, Model, VERIFY_MAX_ROWS};
use crate::runner::Runner;
use crate::sampling::{argmax, Dist, Sampler};
use crate::session::{KvDtype, Session};
use anyhow::{bail, Result};
use std::collections::VecDeque;
use std::time::Instant;

/// What a drafter proposes: tokens, and for a drafter that samples, the distribution each was
/// drawn from (empty for a drafter without one: one-hot).
#[derive(Clone, Debug, Default)]
pub struct Draft {
    pub tokens: Vec<u32>,
    pub dists: Vec<Dist>,
}

/// Proposes tokens for the target to verify. Implemented by prompt lookup and by draft models;
/// a hidden-state block drafter (ANEMLL Forge's DFlash) would implement it too, given the
/// target's last hidden rows through its context (see docs/speculative.md).
pub trait Drafter {
    /// Up to `k` tokens to follow `context` (the prompt and every token decided so far), into
    /// `draft` (cleared first). Proposing none is allowed: the loop then decodes one token.
    fn propose(&mut self, context: &[u32], k: usize, draft: &mut Draft) -> Result<()>;
    fn name(&self) -> String;
}

/// How the loop drafts.
#[derive(Clone, Debug)]
pub struct SpecConfig {
    /// Most tokens drafted per verify (at most `VERIFY_MAX_ROWS − 1`).
    pub max_draft: usize,
    /// Adapt each draft's length. Greedy: from measurements, the forward time per row count and
    /// the acceptance rate so far, drafting only when the expected tokens per second beat one
    /// plain step's (a model whose verify costs several decode steps, as a small model in
    /// cache, is then not slowed down). Sampling (whose seeded runs repeat exactly): shrink to
    /// one past the accepted run after a rejection, grow by one after a full acceptance.
    pub adaptive: bool,
}

impl Default for SpecConfig {
    fn default() -> Self {
        SpecConfig { max_draft: VERIFY_MAX_ROWS - 1, adaptive: true }
    }
}

/// What speculation did.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct SpecStats {
    /// Target forwards that verified at least one draft.
    pub verifies: usize,
    /// Target forwards of one new token (no draft proposed).
    pub plain_steps: usize,
    pub drafted: usize,
    pub accepted: usize,
    /// Seconds in the drafter, in verifying forwards and in one-token forwards.
    pub draft_s: f64,
    pub verify_s: f64,
    pub plain_s: f64,
}

impl SpecStats {
    /// Accepted drafts over drafted ones.
    pub fn acceptance_rate(&self) -> f64 {
        self.accepted as f64 / self.drafted.max(1) as f64
    }
    /// Tokens decided per verifying forward (accepted drafts plus the target's own).
    pub fn tokens_per_verify(&self) -> f64 {
        (self.accepted + self.verifies) as f64 / self.verifies.max(1) as f64
    }
}

/// Adjusts a row's logits before sampling given the context so far (penalties).
pub type LogitsHook<'a> = Box<dyn FnMut(&mut [f32], &[u32]) + 'a>;

/// Where the logits of the token last handed out are.
#[derive(Clone, Copy, Debug)]
enum Cur {
    Last,
    Row(usize),
}

/// The decode loop over one session. The session has been fed `context` (the prompt) and
/// `logits` are its output after it; [`Decoder::next_token`] hands out one token at a time.
pub struct Decoder<'a> {
    run: &'a dyn Runner,
    model: &'a Model,
    session: &'a mut Session,
    drafter: Option<Box<dyn Drafter + 'a>>,
    pub sampler: Sampler,
    hook: Option<LogitsHook<'a>>,
    sample_vocab: usize,
    cfg: SpecConfig,
    k: usize,
    context: Vec<u32>,
    /// Logits after every token the session was fed, when no pass is open.
    last: Vec<f32>,
    /// The rows of the open pass, and the tokens it fed.
    rows: Vec<f32>,
    pass_fed: Vec<u32>,
    /// Decided, not yet handed out: token and its row.
    ready: VecDeque<(u32, usize)>,
    cur: Cur,
    /// Tokens that may still be handed out (drafts beyond them are not worth verifying).
    budget: usize,
    draft: Draft,
    scratch: Vec<f32>,
    dist: Dist,
    cost: Costs,
    pub stats: SpecStats,
}

/// What [`SpecConfig::adaptive`] decides from: forward seconds by row count, drafting seconds
/// per drafted token, and accepted and rejected drafts (both decaying, so the estimate follows
/// the text).
#[derive(Clone, Debug, Default)]
struct Costs {
    rows: [f64; VERIFY_MAX_ROWS + 1],
    draft_tok: f64,
    accepted: f64,
    rejected: f64,
}

impl Costs {
    fn observe(v: &mut f64, x: f64) {
        *v = if *v == 0.0 { x } else { 0.7 * *v + 0.3 * x };
    }

    /// Seconds for a forward of `t` rows: measured, or (not yet seen) a line through one row's
    /// time with the mean slope of the row counts seen (a tenth of a row's time per row before
    /// any: a guess that leans to trying).
    fn forward(&self, t: usize) -> f64 {
        if self.rows[t] > 0.0 {
            return self.rows[t];
        }
        let one = self.rows[1];
        let seen: Vec<f64> = (2..=VERIFY_MAX_ROWS)
            .filter(|&u| self.rows[u] > 0.0)
            .map(|u| (self.rows[u] - one) / (u - 1) as f64)
            .collect();
        let slope = if seen.is_empty() { 0.1 * one } else { seen.iter().sum::<f64>() / seen.len() as f64 };
        one + slope.max(0.0) * (t - 1) as f64
    }

    /// The draft length (0: none) with the most expected tokens per second, up to `room`.
    fn choose(&self, room: usize) -> usize {
        if self.rows[1] == 0.0 {
            return room;
        }
        // Probability a draft is accepted given the previous one was (a prior of one each way).
        let a = (self.accepted + 1.0) / (self.accepted + self.rejected + 2.0);
        let mut best = (1.0 / self.rows[1], 0);
        for k in 1..=room {
            let tokens = (1.0 - a.powi(k as i32 + 1)) / (1.0 - a).max(1e-9);
            let rate = tokens / (self.forward(k + 1) + k as f64 * self.draft_tok);
            if rate > best.0 {
                best = (rate, k);
            }
        }
        best.1
    }
}

impl<'a> Decoder<'a> {
    /// `run` is where the forwards go: the model itself (`&model`), or a batching scheduler.
    pub fn new(
        run: &'a dyn Runner,
        session: &'a mut Session,
        context: Vec<u32>,
        logits: Vec<f32>,
        sampler: Sampler,
    ) -> Self {
        let cfg = SpecConfig::default();
        let model = run.model();
        Decoder {
            run,
            model,
            session,
            drafter: None,
            sampler,
            hook: None,
            sample_vocab: model.cfg.vocab_size,
            k: cfg.max_draft,
            cfg,
            context,
            last: logits,
            rows: Vec::new(),
            pass_fed: Vec::new(),
            ready: VecDeque::new(),
            cur: Cur::Last,
            budget: usize::MAX,
            draft: Draft::default(),
            scratch: Vec::new(),
            dist: Dist::new(),
            cost: Costs::default(),
            stats: SpecStats::default(),
        }
    }

    pub fn with_drafter(mut self, d: Option<Box<dyn Drafter + 'a>>, cfg: SpecConfig) -> Self {
        self.drafter = d;
        self.k = cfg.max_draft.clamp(1, VERIFY_MAX_ROWS - 1);
        self.cfg = cfg;
        self
    }

    pub fn with_hook(mut self, hook: Option<LogitsHook<'a>>) -> Self {
        self.hook = hook;
        self
    }

    /// Samples only among the first `n` ids (a vocabulary padded past its tokenizer).
    pub fn with_sample_vocab(mut self, n: usize) -> Self {
        self.sample_vocab = n.clamp(1, self.model.cfg.vocab_size);
        self
    }

    /// At most `n` more tokens will be taken.
    pub fn with_budget(mut self, n: usize) -> Self {
        self.budget = n;
        self
    }

    /// Prompt and tokens handed out so far.
    pub fn context(&self) -> &[u32] {
        &self.context
    }

    /// The raw logits the last handed-out token was chosen from.
    pub fn logits(&self) -> &[f32] {
        let v = self.model.cfg.vocab_size;
        match self.cur {
            Cur::Last => &self.last,
            Cur::Row(r) => &self.rows[r * v..(r + 1) * v],
        }
    }

    /// The next token.
    pub fn next_token(&mut self) -> Result<u32> {
        self.take(None)
    }

    /// Hands out `tok` as the next token instead of choosing one (scripted or forced output);
    /// [`Decoder::logits`] then gives the logits of its position.
    pub fn next_forced(&mut self, tok: u32) -> Result<()> {
        self.take(Some(tok)).map(|_| ())
    }

    /// Takes back the token last handed out (a stop token the caller does not keep): the
    /// session will not hold it, as plain decoding never feeds a stop token.
    pub fn unread(&mut self) {
        if self.context.len() > self.session.spec_start.unwrap_or(self.session.pos) {
            self.context.pop();
            self.ready.clear();
        }
    }

    /// Commits the open pass and returns the tokens the session holds (a prefix of the
    /// context: the last token handed out is not fed) and the logits after them.
    pub fn finish(mut self) -> Result<(Vec<u32>, Vec<f32>)> {
        self.close_pass()?;
        let fed = self.session.pos.min(self.context.len());
        self.context.truncate(fed);
        Ok((self.context, self.last))
    }

    fn take(&mut self, forced: Option<u32>) -> Result<u32> {
        self.budget = self.budget.saturating_sub(1);
        if let Some((tok, row)) = self.ready.pop_front() {
            self.cur = Cur::Row(row);
            let tok = match forced {
                Some(f) if f != tok => {
                    self.ready.clear();
                    f
                }
                _ => tok,
            };
            self.context.push(tok);
            return Ok(tok);
        }
        self.close_pass()?;
        let pending = self.context.len() - self.session.pos.min(self.context.len());
        if pending > 0 {
            let mut room = VERIFY_MAX_ROWS.saturating_sub(pending).min(self.k).min(self.budget);
            // Greedy output does not depend on the draft lengths, so they may follow measured
            // times; a seeded sampled run must repeat exactly, so there they follow acceptance
            // alone.
            if self.cfg.adaptive && self.drafter.is_some() && self.sampler.is_greedy() {
                room = self.cost.choose(room);
            }
            if forced.is_none() && room > 0 && self.propose(room)? {
                return self.verify(pending);
            }
            let t0 = Instant::now();
            let fed = self.session.pos;
            self.run.forward_into(self.session, &self.context[fed..], Logits::Last, &mut self.last)?;
            self.stats.plain_steps += 1;
            let dt = t0.elapsed().as_secs_f64();
            self.stats.plain_s += dt;
            Costs::observe(&mut self.cost.rows[pending.min(VERIFY_MAX_ROWS)], dt);
        }
        self.cur = Cur::Last;
        let tok = match forced {
            Some(f) => f,
            None => self.sample_last(),
        };
        self.context.push(tok);
        Ok(tok)
    }

    /// Asks the drafter for up to `k` tokens; whether it proposed any.
    fn propose(&mut self, k: usize) -> Result<bool> {
        let Some(d) = self.drafter.as_mut() else { return Ok(false) };
        let t0 = Instant::now();
        d.propose(&self.context, k, &mut self.draft)?;
        let dt = t0.elapsed().as_secs_f64();
        self.stats.draft_s += dt;
        if !self.draft.tokens.is_empty() {
            Costs::observe(&mut self.cost.draft_tok, dt / self.draft.tokens.len() as f64);
        }
        let v = self.model.cfg.vocab_size as u32;
        if let Some(bad) = self.draft.tokens.iter().position(|&t| t >= v) {
            self.draft.tokens.truncate(bad);
        }
        self.draft.tokens.truncate(k);
        if !self.draft.dists.is_empty() && self.draft.dists.len() < self.draft.tokens.len() {
            bail!(
                "drafter {} gave {} distributions for {} tokens",
                d.name(),
                self.draft.dists.len(),
                self.draft.tokens.len()
            );
        }
        Ok(!self.draft.tokens.is_empty())
    }

    /// One verifying forward over the pending tokens and the draft; queues the decided tokens
    /// and hands out the first.
    fn verify(&mut self, pending: usize) -> Result<u32> {
        let t0 = Instant::now();
        let start = self.session.pos;
        self.pass_fed.clear();
        self.pass_fed.extend_from_slice(&self.context[start..]);
        self.pass_fed.extend_from_slice(&self.draft.tokens);
        self.session.begin_speculation();
        self.run.forward_into(self.session, &self.pass_fed, Logits::All, &mut self.rows)?;
        let dt = t0.elapsed().as_secs_f64();
        self.stats.verify_s += dt;
        Costs::observe(&mut self.cost.rows[self.pass_fed.len()], dt);
        self.stats.verifies += 1;
        let n = self.draft.tokens.len();
        self.stats.drafted += n;
        let r0 = pending - 1;
        let mut accepted = 0;
        let mut extra = None;
        for i in 0..n {
            let d = self.draft.tokens[i];
            let q = self.draft.dists.get(i).map(|q| q.iter().find(|e| e.0 == d).map_or(0.0, |e| e.1)).unwrap_or(1.0);
            self.row_dist(r0 + i, i);
            let p = self.dist.iter().find(|e| e.0 == d).map_or(0.0, |e| e.1);
            let keep = p >= q || (q > 0.0 && self.sampler.uniform() * q < p);
            if keep {
                accepted += 1;
                continue;
            }
            // The residual max(0, p − q): a one-hot q removes `d`.
            let residual: Dist = match self.draft.dists.get(i) {
                Some(qd) => self
                    .dist
                    .iter()
                    .map(|&(t, pt)| (t, (pt - qd.iter().find(|e| e.0 == t).map_or(0.0, |e| e.1)).max(0.0)))
                    .collect(),
                None => self.dist.iter().map(|&(t, pt)| (t, if t == d { 0.0 } else { pt })).collect(),
            };
            let x = if residual.iter().any(|e| e.1 > 0.0) {
                self.sampler.draw(&residual)
            } else {
                self.sampler.draw(&self.dist)
            };
            extra = Some((x, r0 + i));
            break;
        }
        self.stats.accepted += accepted;
        let extra = match extra {
            Some(e) => e,
            None => {
                self.row_dist(r0 + n, n);
                let dist = std::mem::take(&mut self.dist);
                let x = self.sampler.draw(&dist);
                self.dist = dist;
                (x, r0 + n)
            }
        };
        if self.cfg.adaptive {
            self.k = if accepted == n { (self.k + 1).min(self.cfg.max_draft) } else { (accepted + 1).min(self.k) };
        }
        let c = &mut self.cost;
        (c.accepted, c.rejected) = (0.9 * c.accepted + accepted as f64, 0.9 * c.rejected + (accepted < n) as u8 as f64);
        self.ready.clear();
        self.ready.extend(self.draft.tokens[..accepted].iter().enumerate().map(|(i, &t)| (t, r0 + i)));
        self.ready.push_back(extra);
        let (tok, row) = self.ready.pop_front().expect("one token at least");
        self.cur = Cur::Row(row);
        self.context.push(tok);
        Ok(tok)
    }

    /// The distribution plain sampling draws from at pass row `row`, whose context is the
    /// decided tokens and the first `drafts` drafts, into `self.dist`.
    fn row_dist(&mut self, row: usize, drafts: usize) {
        let v = self.model.cfg.vocab_size;
        let raw = &self.rows[row * v..row * v + self.sample_vocab];
        match self.hook.as_mut() {
            Some(h) => {
                self.scratch.clear();
                self.scratch.extend_from_slice(raw);
                let mut ctx = self.context.clone();
                ctx.extend_from_slice(&self.draft.tokens[..drafts]);
                h(&mut self.scratch, &ctx);
                self.sampler.dist_into(&self.scratch, &mut self.dist);
            }
            None if self.sampler.is_greedy() => {
                self.dist.clear();
                self.dist.push((argmax(raw), 1.0));
            }
            None => self.sampler.dist_into(raw, &mut self.dist),
        }
    }

    /// Plain sampling from the logits after every fed token (the hook applied).
    fn sample_last(&mut self) -> u32 {
        let raw = &self.last[..self.sample_vocab.min(self.last.len())];
        match self.hook.as_mut() {
            Some(h) => {
                self.scratch.clear();
                self.scratch.extend_from_slice(raw);
                h(&mut self.scratch, &self.context);
                self.sampler.sample(&self.scratch)
            }
            None => self.sampler.sample(raw),
        }
    }

    /// Commits the open pass, keeping the fed tokens the context still agrees with.
    fn close_pass(&mut self) -> Result<()> {
        let Some(start) = self.session.spec_start else { return Ok(()) };
        self.ready.clear();
        let have = &self.context[start.min(self.context.len())..];
        let keep = have.iter().zip(&self.pass_fed).take_while(|(a, b)| a == b).count();
        self.run.commit(self.session, keep)?;
        if keep > 0 {
            let v = self.model.cfg.vocab_size;
            self.last.clear();
            self.last.extend_from_slice(&self.rows[(keep - 1) * v..keep * v]);
        }
        Ok(())
    }
}

/// Prompt lookup: the continuation of the latest earlier occurrence of the context's last
/// `n` tokens, for `n` from `max_n` down to `min_n` (llama.cpp's lookup decoding, vLLM's ngram
/// speculator). Costs no forward; pays where the output quotes its input (code edits,
/// summaries, agent turns over files).
#[derive(Clone, Debug)]
pub struct LookupDrafter {
    pub min_n: usize,
    pub max_n: usize,
}

impl Default for LookupDrafter {
    fn default() -> Self {
        LookupDrafter { min_n: 2, max_n: 4 }
    }
}

impl Drafter for LookupDrafter {
    fn propose(&mut self, context: &[u32], k: usize, draft: &mut Draft) -> Result<()> {
        draft.tokens.clear();
        draft.dists.clear();
        let len = context.len();
        for n in (self.min_n.max(1)..=self.max_n).rev() {
            if len <= n {
                continue;
            }
            let pat = &context[len - n..];
            // Latest match first: recent text predicts the next tokens best.
            if let Some(j) = (0..len - n).rev().find(|&j| &context[j..j + n] == pat) {
                let from = j + n;
                draft.tokens.extend_from_slice(&context[from..(from + k).min(len)]);
                return Ok(());
            }
        }
        Ok(())
    }

    fn name(&self) -> String {
        format!("lookup {}..{}", self.min_n, self.max_n)
    }
}

/// A smaller model with the target's tokenizer, decoding ahead in its own session (which rolls
/// back too). Greedy when the target is; otherwise it samples with the target's settings and
/// reports its distributions.
pub struct ModelDrafter<'a> {
    run: &'a dyn Runner,
    session: Session,
    kv: KvDtype,
    /// The tokens its session holds.
    fed: Vec<u32>,
    sampler: Sampler,
    vocab: usize,
    logits: Vec<f32>,
}

impl<'a> ModelDrafter<'a> {
    /// `sampler` is the drafter's own (its seed apart from the target's); ids at or past
    /// `vocab` (the target's) are never proposed.
    pub fn new(run: &'a dyn Runner, kv: KvDtype, sampler: Sampler, vocab: usize) -> Self {
        let model = run.model();
        ModelDrafter {
            run,
            session: model.new_session_with_kv(kv),
            kv,
            fed: Vec::new(),
            sampler,
            vocab: vocab.min(model.cfg.vocab_size),
            logits: Vec::new(),
        }
    }

    /// Brings the session to a prefix of `context` it can continue from.
    fn sync(&mut self, context: &[u32]) -> Result<()> {
        let common = self.fed.iter().zip(context).take_while(|(a, b)| a == b).count();
        // Leave one token to feed: its logits start the draft.
        let target = common.min(context.len().saturating_sub(1));
        match self.session.spec_start {
            Some(start) if target >= start => {
                self.run.commit(&mut self.session, target - start)?;
                self.fed.truncate(target);
            }
            _ if self.session.spec_start.is_none() && target == self.fed.len() => {}
            _ => {
                self.session = self.run.model().new_session_with_kv(self.kv);
                self.fed.clear();
            }
        }
        Ok(())
    }
}

impl Drafter for ModelDrafter<'_> {
    fn propose(&mut self, context: &[u32], k: usize, draft: &mut Draft) -> Result<()> {
        draft.tokens.clear();
        draft.dists.clear();
        if context.is_empty() || k == 0 {
            return Ok(());
        }
        self.sync(context)?;
        let from = self.fed.len();
        self.run.forward_into(&mut self.session, &context[from..], Logits::Last, &mut self.logits)?;
        self.fed.extend_from_slice(&context[from..]);
        self.session.begin_speculation();
        let greedy = self.sampler.is_greedy();
        for i in 0..k {
            let row = &self.logits[..self.vocab];
            let tok = if greedy {
                argmax(row)
            } else {
                let mut q = Dist::new();
                self.sampler.dist_into(row, &mut q);
                let t = self.sampler.draw(&q);
                draft.dists.push(q);
                t
            };
            draft.tokens.push(tok);
            if i + 1 < k {
                self.run.forward_into(&mut self.session, &[tok], Logits::Last, &mut self.logits)?;
                self.fed.push(tok);
            }
        }
        Ok(())
    }

    fn name(&self) -> String {
        "draft model".into()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn costs(per_row: impl Fn(usize) -> f64, accepted: f64, rejected: f64) -> Costs {
        let mut c = Costs { accepted, rejected, ..Default::default() };
        for t in 1..=VERIFY_MAX_ROWS {
            c.rows[t] = per_row(t);
        }
        c
    }

    #[test]
    fn draft_length_maximizes_expected_tokens_per_second() {
        // Rows as dear as whole steps (compute-bound): no draft pays, whatever the acceptance.
        assert_eq!(costs(|t| t as f64, 90.0, 10.0).choose(7), 0);
        // Nearly free rows (memory-bound) and high acceptance: the longest draft.
        assert_eq!(costs(|t| 1.0 + 0.02 * (t - 1) as f64, 90.0, 10.0).choose(7), 7);
        assert_eq!(costs(|t| 1.0 + 0.02 * (t - 1) as f64, 90.0, 10.0).choose(3), 3);
        // Closed form at acceptance a = 0.5 (one of each plus the prior), rows 1 + 0.25 (t − 1):
        // k = 1: 1.5 / 1.25 = 1.2, k = 2: 1.75 / 1.5 = 1.167, so one token.
        assert_eq!(costs(|t| 1.0 + 0.25 * (t - 1) as f64, 0.0, 0.0).choose(7), 1);
        // Nothing measured yet: try the whole room.
        assert_eq!(Costs::default().choose(5), 5);
        // One row count measured dear: the others are judged by its slope, not tried one by one.
        let mut c = costs(|_| 0.0, 90.0, 10.0);
        (c.rows[1], c.rows[8]) = (1.0, 8.0);
        assert_eq!(c.choose(7), 0);
        // A drafter costing a whole step per token never pays.
        let mut c = costs(|t| 1.0 + 0.02 * (t - 1) as f64, 90.0, 10.0);
        c.draft_tok = 1.0;
        assert_eq!(c.choose(7), 0);
    }

    #[test]
    fn lookup_proposes_the_continuation_of_the_latest_longest_match() {
        let mut d = LookupDrafter { min_n: 1, max_n: 3 };
        let mut out = Draft::default();
        // "5 6 7" occurs twice; the later occurrence continues with 9 9.
        d.propose(&[5, 6, 7, 8, 1, 5, 6, 7, 9, 9, 2, 5, 6, 7], 4, &mut out).unwrap();
        assert_eq!(out.tokens, [9, 9, 2, 5]);
        // Only a 1-gram matches; the continuation stops at the end of the context.
        d.propose(&[4, 3, 1, 2, 3], 5, &mut out).unwrap();
        assert_eq!(out.tokens, [1, 2, 3]);
        d.propose(&[1, 2, 3], 5, &mut out).unwrap();
        assert!(out.tokens.is_empty());
        d.propose(&[], 5, &mut out).unwrap();
        assert!(out.tokens.is_empty());
    }
}
