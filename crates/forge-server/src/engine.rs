//! The engine: `parallel` slots that take generation jobs from one queue in the order they were
//! submitted (FIFO), each serving one job at a time on its own thread, and one scheduler that
//! runs every slot's forward passes, batched ([`crate::batch`]). The slots share the prompt
//! cache.
//!
//! Callers talk to the engine through channels: a [`Job`] goes in, [`Event`]s come back on the
//! job's own channel. A job stops at the next token when its `cancel` flag is set or its event
//! receiver is dropped (client gone), and its state up to that point stays in the cache,
//! consistent with the tokens it consumed.

use crate::batch::{panic_error, Scheduler, SlotRunner};
use crate::cache::{PrefillResult, PromptCache};
use crate::penalties::{log_softmax, loop_detected, top_n, Penalties};
use anyhow::{Context, Result};
use forge_core::tokenizer::{StreamDecoder, Tokenizer};
use forge_model::sampling::{Sampler, SamplingParams};
use forge_model::session::KvDtype;
use forge_model::speculative::{Decoder, Drafter, LookupDrafter, ModelDrafter, SpecConfig, SpecStats};
use forge_model::Model;
use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::time::Instant;
use tokio::sync::mpsc::UnboundedSender;

#[derive(Clone, Debug)]
pub struct EngineConfig {
    /// Context length: prompt + generated tokens of one request.
    pub ctx: usize,
    pub cache_bytes: usize,
    pub cache_entries: usize,
    /// Prefill runs in chunks of this many tokens (cancellation is checked between chunks).
    pub prefill_chunk: usize,
    /// Jobs waiting beyond this are refused (the client gets 429 and may retry).
    pub max_queue: usize,
    /// How requests decode speculatively (a request may opt out).
    pub speculation: Speculation,
    pub spec: SpecConfig,
    /// Requests served at once, their forward passes batched.
    pub parallel: usize,
}

/// The server's drafter.
#[derive(Clone, Debug, Default, PartialEq)]
pub enum Speculation {
    #[default]
    Off,
    /// Prompt lookup over n-grams of `min_n..=max_n` tokens.
    Lookup { min_n: usize, max_n: usize },
    /// The draft model given to [`Engine::start_with_draft`], its KV cache of this type.
    Draft(KvDtype),
}

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig {
            ctx: 4096,
            cache_bytes: 1 << 30,
            cache_entries: 16,
            prefill_chunk: 512,
            max_queue: 256,
            speculation: Speculation::Off,
            spec: SpecConfig::default(),
            parallel: 1,
        }
    }
}

/// What one generation does besides the prompt.
#[derive(Clone, Debug)]
pub struct GenParams {
    pub max_tokens: usize,
    pub sampling: SamplingParams,
    pub penalties: Penalties,
    /// Stop strings: generation ends before the first occurrence, which is not returned.
    pub stop: Vec<String>,
    /// Return log-probs with this many alternatives (0: only the chosen token's).
    pub logprobs: Option<usize>,
    /// The prompt ends inside `<think>` (the template opened it).
    pub starts_in_reasoning: bool,
    /// Thinking longer than this many tokens is closed by inserting `</think>`.
    pub thinking_budget: Option<usize>,
    /// End generation when the last this-many tokens are one short block repeated (0: off).
    pub loop_guard: usize,
    /// Test hook: emit exactly these tokens (run through the model like sampled ones), then stop.
    pub forced_output: Option<Vec<u32>>,
    /// Decode speculatively when the server has a drafter.
    pub speculative: bool,
    /// End-of-turn tokens do not stop generation (benchmarks).
    pub ignore_eos: bool,
}

impl Default for GenParams {
    fn default() -> Self {
        GenParams {
            max_tokens: 256,
            sampling: SamplingParams::default(),
            penalties: Penalties::default(),
            stop: Vec::new(),
            logprobs: None,
            starts_in_reasoning: false,
            thinking_budget: None,
            loop_guard: 0,
            forced_output: None,
            speculative: true,
            ignore_eos: false,
        }
    }
}

pub struct Job {
    pub prompt: Vec<u32>,
    /// Prompt lengths worth keeping a snapshot at (see `cache`).
    pub snapshots: Vec<usize>,
    pub params: GenParams,
    pub cancel: Arc<AtomicBool>,
    pub events: UnboundedSender<Event>,
    enqueued: Instant,
}

impl Job {
    pub fn new(
        prompt: Vec<u32>,
        snapshots: Vec<usize>,
        params: GenParams,
        cancel: Arc<AtomicBool>,
        events: UnboundedSender<Event>,
    ) -> Self {
        Job { prompt, snapshots, params, cancel, events, enqueued: Instant::now() }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Finish {
    /// End of turn token or a stop string.
    Stop,
    /// `max_tokens` or the context is full.
    Length,
    /// The loop guard saw degenerate repetition.
    Repetition,
    /// The client went away.
    Cancelled,
}

impl Finish {
    pub fn as_str(self) -> &'static str {
        match self {
            Finish::Stop => "stop",
            Finish::Length => "length",
            Finish::Repetition => "repetition",
            Finish::Cancelled => "cancelled",
        }
    }
}

#[derive(Clone, Debug)]
pub struct TokenLogprob {
    pub token: String,
    pub logprob: f32,
    pub top: Vec<(String, f32)>,
}

/// Timing and counts of one finished job.
#[derive(Clone, Debug)]
pub struct RunStats {
    pub prompt_tokens: usize,
    pub cached_tokens: usize,
    pub generated_tokens: usize,
    pub reasoning_tokens: usize,
    pub queue_s: f64,
    pub prefill_s: f64,
    /// From the start of the job to the first generated token.
    pub ttft_s: f64,
    /// From the end of prefill to the end of generation.
    pub decode_s: f64,
    pub finish: Finish,
    /// Drafted tokens the target kept, and those it rejected (OpenAI's names).
    pub accepted_prediction_tokens: usize,
    pub rejected_prediction_tokens: usize,
}

impl RunStats {
    pub fn prefill_tok_s(&self) -> f64 {
        (self.prompt_tokens - self.cached_tokens) as f64 / self.prefill_s.max(1e-9)
    }
    /// Over the tokens after the first, as `forge generate` reports it.
    pub fn decode_tok_s(&self) -> f64 {
        self.generated_tokens.saturating_sub(1) as f64 / self.decode_s.max(1e-9)
    }
}

pub enum Event {
    /// The job left the queue.
    Started,
    /// One generated token and the text it releases (possibly empty: the text may still be an
    /// incomplete character or a possible stop string).
    Token {
        text: String,
        logprob: Option<TokenLogprob>,
    },
    /// Text released at the end that belongs to no single token.
    Text(String),
    Done(RunStats),
    Error(String),
}

/// Engine state visible to request handlers (health, queue accounting).
#[derive(Default)]
pub struct EngineStatus {
    pub queued: AtomicUsize,
    /// Slots serving a request now.
    pub active: AtomicUsize,
    pub served: AtomicU64,
    pub cache_entries: AtomicUsize,
    pub cache_bytes: AtomicUsize,
    pub last: Mutex<Option<RunStats>>,
    /// Positions in each slot's session now (0 when idle).
    pub slot_positions: Box<[AtomicUsize]>,
}

pub enum SubmitError {
    QueueFull,
    Stopped,
}

pub struct Engine {
    tx: mpsc::Sender<Job>,
    pub status: Arc<EngineStatus>,
    pub config: EngineConfig,
    pub scheduler: Arc<Scheduler>,
}

impl Engine {
    /// Starts the scheduler and the slots, which own `model` from now on.
    pub fn start(model: Model, tokenizer: Arc<Tokenizer>, config: EngineConfig) -> Result<Engine> {
        Self::start_with_draft(model, None, tokenizer, config)
    }

    /// [`Engine::start`] with a draft model (used when `config.speculation` is `Draft`).
    pub fn start_with_draft(
        model: Model,
        draft: Option<Model>,
        tokenizer: Arc<Tokenizer>,
        config: EngineConfig,
    ) -> Result<Engine> {
        if matches!(config.speculation, Speculation::Draft(_)) && draft.is_none() {
            anyhow::bail!("speculative decoding with a draft model, but no draft model was given");
        }
        anyhow::ensure!(config.parallel >= 1, "the engine needs at least one slot (parallel = 0)");
        let (tx, rx) = mpsc::channel::<Job>();
        let slot_positions = (0..config.parallel).map(|_| AtomicUsize::new(0)).collect();
        let status = Arc::new(EngineStatus { slot_positions, ..EngineStatus::default() });
        let cache = Arc::new(Mutex::new(PromptCache::new(&model, config.cache_bytes, config.cache_entries)));
        let close_think = tokenizer.encode("\n</think>\n\n", false).context("tokenizing the thinking close")?;
        let has_draft = draft.is_some();
        let scheduler = Scheduler::start(std::iter::once(model).chain(draft).map(Arc::new).collect())?;
        let rx = Arc::new(Mutex::new(rx));
        for i in 0..config.parallel {
            let mut slot = Slot {
                id: i,
                target: scheduler.runner(0),
                draft: has_draft.then(|| scheduler.runner(1)),
                tok: tokenizer.clone(),
                cache: cache.clone(),
                cfg: config.clone(),
                status: status.clone(),
                scheduler: scheduler.clone(),
                close_think: close_think.clone(),
                breakers: HashMap::new(),
            };
            let rx = rx.clone();
            std::thread::Builder::new()
                .name(format!("forge-slot-{i}"))
                .spawn(move || slot.run(&rx))
                .context("cannot start a slot thread")?;
        }
        Ok(Engine { tx, status, config, scheduler })
    }

    /// Queues a job (FIFO).
    pub fn submit(&self, mut job: Job) -> Result<(), SubmitError> {
        job.enqueued = Instant::now();
        let q = self.status.queued.fetch_add(1, Ordering::SeqCst);
        if q >= self.config.max_queue {
            self.status.queued.fetch_sub(1, Ordering::SeqCst);
            return Err(SubmitError::QueueFull);
        }
        self.tx.send(job).map_err(|_| {
            self.status.queued.fetch_sub(1, Ordering::SeqCst);
            SubmitError::Stopped
        })
    }
}

/// One request at a time, its forward passes through the scheduler.
struct Slot {
    id: usize,
    target: SlotRunner,
    draft: Option<SlotRunner>,
    tok: Arc<Tokenizer>,
    cache: Arc<Mutex<PromptCache>>,
    cfg: EngineConfig,
    status: Arc<EngineStatus>,
    scheduler: Arc<Scheduler>,
    close_think: Vec<u32>,
    /// DRY breaker masks over the vocabulary, per breaker set.
    breakers: HashMap<Vec<String>, Arc<Vec<bool>>>,
}

impl Slot {
    fn cache(&self) -> std::sync::MutexGuard<'_, PromptCache> {
        self.cache.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn run(&mut self, rx: &Mutex<mpsc::Receiver<Job>>) {
        loop {
            // Idle slots wait on the lock, the one holding it on the queue.
            let job = match rx.lock().unwrap_or_else(|e| e.into_inner()).recv() {
                Ok(job) => job,
                Err(_) => return,
            };
            self.status.queued.fetch_sub(1, Ordering::SeqCst);
            // A client that left while queued costs nothing.
            if job.cancel.load(Ordering::Relaxed) || job.events.is_closed() {
                continue;
            }
            self.status.active.fetch_add(1, Ordering::SeqCst);
            self.scheduler.active.fetch_add(1, Ordering::SeqCst);
            // A bug in the model code must not take the server down with it; the cache may be
            // half-updated after a panic, so it is dropped.
            let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| self.run_job(&job)));
            self.scheduler.active.fetch_sub(1, Ordering::SeqCst);
            let r = match r {
                Ok(r) => r,
                Err(p) => {
                    self.cache().clear();
                    Err(panic_error(p))
                }
            };
            match r {
                Ok(stats) => {
                    *self.status.last.lock().unwrap_or_else(|e| e.into_inner()) = Some(stats.clone());
                    let _ = job.events.send(Event::Done(stats));
                }
                Err(e) => {
                    eprintln!("forge: engine error: {e:#}");
                    let _ = job.events.send(Event::Error(format!("{e:#}")));
                }
            }
            self.status.served.fetch_add(1, Ordering::SeqCst);
            self.status.slot_positions[self.id].store(0, Ordering::Relaxed);
            let (n, bytes) = {
                let c = self.cache();
                (c.len(), c.bytes())
            };
            self.status.cache_entries.store(n, Ordering::SeqCst);
            self.status.cache_bytes.store(bytes, Ordering::SeqCst);
            self.status.active.fetch_sub(1, Ordering::SeqCst);
        }
    }

    fn breaker_mask(&mut self, breakers: &[String]) -> Arc<Vec<bool>> {
        if let Some(m) = self.breakers.get(breakers) {
            return m.clone();
        }
        let n = self.tok.vocab_size();
        let mask: Vec<bool> = (0..n as u32)
            .map(|id| {
                let t = self.tok.decode(&[id], false).unwrap_or_default();
                breakers.iter().any(|b| !b.is_empty() && t.contains(b.as_str()))
            })
            .collect();
        let m = Arc::new(mask);
        if self.breakers.len() > 8 {
            self.breakers.clear();
        }
        self.breakers.insert(breakers.to_vec(), m.clone());
        m
    }

    fn run_job(&mut self, job: &Job) -> Result<RunStats> {
        let t_start = Instant::now();
        let p = &job.params;
        let prompt = &job.prompt;
        let _ = job.events.send(Event::Started);
        let mut stats = RunStats {
            prompt_tokens: prompt.len(),
            cached_tokens: 0,
            generated_tokens: 0,
            reasoning_tokens: 0,
            queue_s: (t_start - job.enqueued).as_secs_f64(),
            prefill_s: 0.0,
            ttft_s: 0.0,
            decode_s: 0.0,
            finish: Finish::Cancelled,
            accepted_prediction_tokens: 0,
            rejected_prediction_tokens: 0,
        };
        let pre = PromptCache::prefill(
            &self.cache,
            &self.target,
            prompt,
            &job.snapshots,
            self.cfg.prefill_chunk,
            &job.cancel,
        )?;
        let PrefillResult::Done(pre) = pre else {
            return Ok(stats);
        };
        let t_prefilled = Instant::now();
        stats.prefill_s = (t_prefilled - t_start).as_secs_f64();
        stats.cached_tokens = pre.cached;
        let mut session = pre.session;
        self.status.slot_positions[self.id].store(session.pos, Ordering::Relaxed);
        let mask = if p.penalties.dry_active() { Some(self.breaker_mask(&p.penalties.dry_breakers)) } else { None };
        let is_breaker = |t: u32| mask.as_ref().is_some_and(|m| m.get(t as usize).copied().unwrap_or(false));
        let tok = self.tok.clone();
        let n_vocab = tok.vocab_size();
        let hook: Option<forge_model::speculative::LogitsHook> = p.penalties.active().then(|| {
            let n_prompt = prompt.len();
            Box::new(move |l: &mut [f32], ctx: &[u32]| p.penalties.apply(l, ctx, n_prompt, &is_breaker))
                as forge_model::speculative::LogitsHook
        });
        let scripted = p.forced_output.is_some();
        let drafter: Option<Box<dyn Drafter>> = match (&self.cfg.speculation, &self.draft) {
            _ if !p.speculative || scripted => None,
            (Speculation::Lookup { min_n, max_n }, _) => Some(Box::new(LookupDrafter { min_n: *min_n, max_n: *max_n })),
            (Speculation::Draft(kv), Some(m)) => {
                let dp = SamplingParams { seed: p.sampling.seed.wrapping_add(1), ..p.sampling.clone() };
                Some(Box::new(ModelDrafter::new(m, *kv, Sampler::new(dp), n_vocab)))
            }
            _ => None,
        };
        let max_new = p.max_tokens.min(self.cfg.ctx.saturating_sub(prompt.len()));
        let mut dec =
            Decoder::new(&self.target, &mut session, prompt.clone(), pre.logits, Sampler::new(p.sampling.clone()))
                .with_drafter(drafter, self.cfg.spec.clone())
                .with_hook(hook)
                .with_sample_vocab(n_vocab)
                .with_budget(max_new);
        let mut stream = StreamDecoder::new(&tok);
        let mut stopper = StopMatcher::new(&p.stop);
        let mut think = ThinkTracker::new(p.starts_in_reasoning);
        let mut forced: VecDeque<u32> = p.forced_output.clone().unwrap_or_default().into();
        let mut finish = Finish::Length;
        let mut stop_hit = false;
        let token_text = |id: u32| tok.decode(&[id], false).unwrap_or_default();
        for i in 0..max_new {
            if job.cancel.load(Ordering::Relaxed) {
                finish = Finish::Cancelled;
                break;
            }
            // Padded vocabulary rows (beyond the tokenizer) are never sampled: they have no text.
            let (id, was_forced) = match forced.pop_front() {
                Some(t) => {
                    dec.next_forced(t)?;
                    (t, true)
                }
                None if scripted => {
                    finish = Finish::Stop;
                    break;
                }
                None => (dec.next_token()?, false),
            };
            let logprob = p.logprobs.map(|n| {
                let lp = log_softmax(dec.logits());
                TokenLogprob {
                    token: token_text(id),
                    logprob: lp.get(id as usize).copied().unwrap_or(f32::NEG_INFINITY),
                    top: top_n(&lp, n).into_iter().map(|(t, l)| (token_text(t), l)).collect(),
                }
            });
            if !was_forced && !p.ignore_eos && tok.stop_ids().contains(&id) {
                dec.unread();
                finish = Finish::Stop;
                break;
            }
            stats.generated_tokens += 1;
            self.status.slot_positions[self.id].store(dec.context().len(), Ordering::Relaxed);
            let piece = stream.push(id)?;
            if think.observe(&piece) {
                stats.reasoning_tokens += 1;
            }
            let (text, hit) = stopper.push(&piece);
            if stats.generated_tokens == 1 {
                stats.ttft_s = t_start.elapsed().as_secs_f64();
            }
            if job.events.send(Event::Token { text, logprob }).is_err() {
                finish = Finish::Cancelled;
                break;
            }
            if hit {
                finish = Finish::Stop;
                stop_hit = true;
                break;
            }
            if let Some(budget) = p.thinking_budget {
                if think.state == ThinkState::In && think.tokens >= budget && !think.closing {
                    think.closing = true;
                    // Ahead of anything already queued: the close happens now.
                    for &t in self.close_think.iter().rev() {
                        forced.push_front(t);
                    }
                }
            }
            if p.loop_guard > 0 && loop_detected(&dec.context()[prompt.len()..], p.loop_guard) {
                finish = Finish::Repetition;
                break;
            }
            if i + 1 == max_new {
                break;
            }
        }
        let spec: SpecStats = dec.stats.clone();
        stats.accepted_prediction_tokens = spec.accepted;
        stats.rejected_prediction_tokens = spec.drafted - spec.accepted;
        // The state holds exactly the tokens fed so far (a prefix of the context), and the
        // logits are the model's output after them.
        let (fed, logits) = dec.finish()?;
        stats.decode_s = t_prefilled.elapsed().as_secs_f64();
        stats.finish = finish;
        if finish != Finish::Cancelled && !stop_hit {
            let rest = stream.finish()?;
            let (mut text, hit) = stopper.push(&rest);
            if hit {
                stats.finish = Finish::Stop;
            } else {
                text.push_str(&stopper.flush());
            }
            if !text.is_empty() {
                let _ = job.events.send(Event::Text(text));
            }
        }
        self.cache().insert(fed, session, logits, false);
        Ok(stats)
    }
}

/// Holds back generated text that could be the start of a stop string.
struct StopMatcher {
    stops: Vec<String>,
    held: String,
}

impl StopMatcher {
    fn new(stops: &[String]) -> Self {
        StopMatcher { stops: stops.iter().filter(|s| !s.is_empty()).cloned().collect(), held: String::new() }
    }

    /// Adds text; returns what can be released and whether a stop string was reached (the text
    /// from the stop string on is dropped).
    fn push(&mut self, text: &str) -> (String, bool) {
        self.held.push_str(text);
        if self.stops.is_empty() {
            return (std::mem::take(&mut self.held), false);
        }
        if let Some(p) = self.stops.iter().filter_map(|s| self.held.find(s.as_str())).min() {
            let out = self.held[..p].to_string();
            self.held.clear();
            return (out, true);
        }
        let keep = self
            .stops
            .iter()
            .map(|s| {
                let max = self.held.len().min(s.len() - 1);
                (1..=max)
                    .rev()
                    .find(|&k| {
                        self.held.is_char_boundary(self.held.len() - k)
                            && s.starts_with(&self.held[self.held.len() - k..])
                    })
                    .unwrap_or(0)
            })
            .max()
            .unwrap_or(0);
        let out: String = self.held.drain(..self.held.len() - keep).collect();
        (out, false)
    }

    fn flush(&mut self) -> String {
        std::mem::take(&mut self.held)
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum ThinkState {
    Before,
    In,
    Done,
}

/// Follows `<think>…</think>` in the generated text to count reasoning tokens and enforce the
/// thinking budget.
struct ThinkTracker {
    state: ThinkState,
    text: String,
    tokens: usize,
    /// The budget ran out and `</think>` is being inserted.
    closing: bool,
}

impl ThinkTracker {
    fn new(starts_in_reasoning: bool) -> Self {
        let state = if starts_in_reasoning { ThinkState::In } else { ThinkState::Before };
        ThinkTracker { state, text: String::new(), tokens: 0, closing: false }
    }

    /// Adds the text of one token; true when that token belongs to the reasoning.
    fn observe(&mut self, piece: &str) -> bool {
        let was_in = self.state == ThinkState::In;
        if self.state == ThinkState::Before {
            self.text.push_str(piece);
            let t = self.text.trim_start();
            if let Some(rest) = t.strip_prefix("<think>") {
                self.text = rest.to_string();
                self.state = ThinkState::In;
            } else if !"<think>".starts_with(t) {
                self.state = ThinkState::Done;
                self.text.clear();
            }
        } else if self.state == ThinkState::In {
            self.text.push_str(piece);
        }
        if self.state == ThinkState::In {
            if self.text.contains("</think>") {
                self.state = ThinkState::Done;
                self.text.clear();
            } else if self.text.len() > 64 {
                // Only a possible partial `</think>` at the end matters.
                let mut cut = self.text.len() - 16;
                while !self.text.is_char_boundary(cut) {
                    cut -= 1;
                }
                self.text.drain(..cut);
            }
        }
        if was_in || self.state == ThinkState::In {
            self.tokens += 1;
            return true;
        }
        false
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stop_matcher_holds_back_possible_stops() {
        let mut m = StopMatcher::new(&["END".to_string(), "\n\n".to_string()]);
        assert_eq!(m.push("abc E"), ("abc ".to_string(), false));
        assert_eq!(m.push("N"), (String::new(), false));
        assert_eq!(m.push("X"), ("ENX".to_string(), false));
        assert_eq!(m.push("y\n"), ("y".to_string(), false));
        assert_eq!(m.push("\nrest"), (String::new(), true));
        let mut m = StopMatcher::new(&["é!".to_string()]);
        assert_eq!(m.push("ab é"), ("ab ".to_string(), false));
        assert_eq!(m.flush(), "é");
        let mut m = StopMatcher::new(&[]);
        assert_eq!(m.push("x"), ("x".to_string(), false));
    }

    #[test]
    fn think_tracker_counts_reasoning_tokens() {
        let mut t = ThinkTracker::new(false);
        let r: Vec<bool> = ["<think>", "a", "b", "</think>", "answer"].iter().map(|p| t.observe(p)).collect();
        assert_eq!(r, vec![true, true, true, true, false]);
        let mut t = ThinkTracker::new(false);
        assert!(!t.observe("Hello"));
        assert!(!t.observe("<think>"));
        let mut t = ThinkTracker::new(true);
        let r: Vec<bool> = ["x", "</", "think>", "y"].iter().map(|p| t.observe(p)).collect();
        assert_eq!(r, vec![true, true, true, false]);
    }
}
