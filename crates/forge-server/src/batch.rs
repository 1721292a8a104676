//! Continuous batching: the slots' forward passes meet on one scheduler thread.
//!
//! Each slot serves one request at a time on its own thread (prompt cache, sampling, stop
//! strings, speculative decoding: all per request); every forward pass and speculative commit it
//! needs goes through a [`SlotRunner`] to the scheduler, which owns the models and runs all
//! model code, one cycle after another. A cycle takes what the active slots have asked for
//! (waiting up to [`GATHER`] for slots still sampling their last token), then
//! - runs the short passes (decode steps and speculative verifies, at most
//!   [`VERIFY_MAX_ROWS`] rows each) of each model together, in batches of at most
//!   `VERIFY_MAX_ROWS` rows: every matrix reads its weights once for the batch, and each row gets
//!   the bits it would get alone (see [`Model::forward_batch`]), so a request's output does not
//!   depend on who it runs beside;
//! - then at most one long pass (a prompt chunk), so a new prompt delays the running streams by
//!   one chunk per cycle, never by the whole prompt. Long passes wait in arrival order.
//!
//! Sessions travel with the requests (moved, not copied) and come back with the reply.

use anyhow::{anyhow, Result};
use forge_model::model::VERIFY_MAX_ROWS;
use forge_model::{Logits, Model, Runner, Session, Step};
use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// How long a cycle waits for active slots that have not yet asked for their next pass (they
/// are sampling or streaming the last token: well under a millisecond on the models served).
pub const GATHER: Duration = Duration::from_millis(2);

enum Work {
    Forward { tokens: Vec<u32>, want: Logits, out: Vec<f32> },
    Commit { keep: usize },
}

struct Msg {
    model: usize,
    session: Session,
    work: Work,
    reply: mpsc::Sender<Reply>,
    /// Long passes the scheduler had run when this arrived (see [`SchedStats::long_waits`]).
    long_at: u64,
}

struct Reply {
    session: Session,
    out: Vec<f32>,
    result: Result<()>,
}

/// What the scheduler has done (for `/health`, benchmarks and the scheduling tests).
#[derive(Default)]
pub struct SchedStats {
    /// Cycles run.
    pub cycles: AtomicU64,
    /// Forward calls, and the rows they ran.
    pub passes: AtomicU64,
    pub rows: AtomicU64,
    /// Short passes that ran in a batch with at least one other.
    pub batched: AtomicU64,
    /// Nanoseconds spent running passes, and waiting for slots to ask (see [`GATHER`]).
    pub run_ns: AtomicU64,
    pub gather_ns: AtomicU64,
    /// Long passes (prompt chunks) run.
    pub long: AtomicU64,
    /// Long passes run in cycles that also ran short ones (prefill interleaved with decoding).
    pub long_beside_short: AtomicU64,
    /// The most long passes any short pass saw run between its arrival and its own run: the
    /// bound on how long a new prompt can stall a stream, in prompt chunks (at most 1).
    pub long_waits: AtomicU64,
}

/// The scheduler: models, the queue of passes, the count of slots serving a request.
pub struct Scheduler {
    tx: Mutex<mpsc::Sender<Msg>>,
    models: Vec<Arc<Model>>,
    /// Slots serving a request now (a cycle waits for each of them to ask, up to [`GATHER`]).
    pub active: Arc<AtomicUsize>,
    pub stats: Arc<SchedStats>,
}

impl Scheduler {
    /// Starts the scheduler thread over `models` (the target first, then a drafter, if any).
    pub fn start(models: Vec<Arc<Model>>) -> Result<Arc<Scheduler>> {
        let (tx, rx) = mpsc::channel::<Msg>();
        let active = Arc::new(AtomicUsize::new(0));
        let stats = Arc::new(SchedStats::default());
        let (ms, act, st) = (models.clone(), active.clone(), stats.clone());
        std::thread::Builder::new()
            .name("forge-scheduler".into())
            .spawn(move || run(&ms, rx, &act, &st))
            .map_err(|e| anyhow!("cannot start the scheduler thread: {e}"))?;
        Ok(Arc::new(Scheduler { tx: Mutex::new(tx), models, active, stats }))
    }

    /// A handle that runs the passes of one slot on model `i`.
    pub fn runner(self: &Arc<Self>, i: usize) -> SlotRunner {
        assert!(i < self.models.len(), "model {i} of {}", self.models.len());
        let (reply_tx, reply_rx) = mpsc::channel();
        let tx = self.tx.lock().unwrap_or_else(|e| e.into_inner()).clone();
        SlotRunner { model: self.models[i].clone(), index: i, tx, reply_tx, reply_rx, stats: self.stats.clone() }
    }
}

/// One slot's way to the scheduler for one model: a [`Runner`], so the decode loop, the model
/// drafter and the prompt cache run through it unchanged.
pub struct SlotRunner {
    model: Arc<Model>,
    index: usize,
    tx: mpsc::Sender<Msg>,
    reply_tx: mpsc::Sender<Reply>,
    reply_rx: mpsc::Receiver<Reply>,
    stats: Arc<SchedStats>,
}

impl SlotRunner {
    fn call(&self, s: &mut Session, work: Work) -> Result<Vec<f32>> {
        let session = std::mem::replace(s, Session { pos: 0, layers: Vec::new(), spec_start: None });
        let long_at = self.stats.long.load(Ordering::SeqCst);
        let msg = Msg { model: self.index, session, work, reply: self.reply_tx.clone(), long_at };
        self.tx.send(msg).map_err(|_| anyhow!("the scheduler has stopped"))?;
        let r = self.reply_rx.recv().map_err(|_| anyhow!("the scheduler has stopped"))?;
        *s = r.session;
        r.result.map(|_| r.out)
    }
}

impl Runner for SlotRunner {
    fn model(&self) -> &Model {
        &self.model
    }

    fn forward_into(&self, s: &mut Session, tokens: &[u32], want: Logits, out: &mut Vec<f32>) -> Result<()> {
        let buf = std::mem::take(out);
        *out = self.call(s, Work::Forward { tokens: tokens.to_vec(), want, out: buf })?;
        Ok(())
    }

    fn commit(&self, s: &mut Session, keep: usize) -> Result<()> {
        self.call(s, Work::Commit { keep }).map(|_| ())
    }
}

fn run(models: &[Arc<Model>], rx: mpsc::Receiver<Msg>, active: &AtomicUsize, stats: &SchedStats) {
    let mut pending: VecDeque<Msg> = VecDeque::new();
    loop {
        if pending.is_empty() {
            match rx.recv() {
                Ok(m) => pending.push_back(m),
                Err(_) => return,
            }
        }
        let t0 = Instant::now();
        let deadline = t0 + GATHER;
        while pending.len() < active.load(Ordering::SeqCst) {
            let left = deadline.saturating_duration_since(Instant::now());
            match rx.recv_timeout(left) {
                Ok(m) => pending.push_back(m),
                Err(_) => break,
            }
        }
        while let Ok(m) = rx.try_recv() {
            pending.push_back(m);
        }
        let t1 = Instant::now();
        cycle(models, &mut pending, stats);
        stats.gather_ns.fetch_add((t1 - t0).as_nanos() as u64, Ordering::Relaxed);
        stats.run_ns.fetch_add(t1.elapsed().as_nanos() as u64, Ordering::Relaxed);
    }
}

/// Whether a pass runs with others (see the module docs).
fn is_short(m: &Msg) -> bool {
    matches!(&m.work, Work::Forward { tokens, .. } if tokens.len() <= VERIFY_MAX_ROWS)
}

fn cycle(models: &[Arc<Model>], pending: &mut VecDeque<Msg>, stats: &SchedStats) {
    stats.cycles.fetch_add(1, Ordering::Relaxed);
    let mut short: Vec<Msg> = Vec::new();
    let mut long: Option<Msg> = None;
    let mut rest = VecDeque::new();
    for m in pending.drain(..) {
        if let Work::Commit { keep } = m.work {
            // Cheap (DeltaNet replays at most the kept rows): done at once.
            let Msg { model, mut session, reply, .. } = m;
            let result = guarded(|| models[model].commit(&mut session, keep));
            let _ = reply.send(Reply { session, out: Vec::new(), result });
        } else if is_short(&m) {
            short.push(m);
        } else if long.is_none() {
            long = Some(m);
        } else {
            rest.push_back(m);
        }
    }
    *pending = rest;
    let long_now = stats.long.load(Ordering::SeqCst);
    for m in &short {
        stats.long_waits.fetch_max(long_now - m.long_at, Ordering::SeqCst);
    }
    let ran_short = !short.is_empty();
    for (mi, model) in models.iter().enumerate() {
        let (mine, others): (Vec<Msg>, Vec<Msg>) = short.into_iter().partition(|m| m.model == mi);
        short = others;
        let mut batch: Vec<Msg> = Vec::new();
        let mut rows = 0;
        for m in mine {
            let n = match &m.work {
                Work::Forward { tokens, .. } => tokens.len(),
                Work::Commit { .. } => 0,
            };
            if rows + n > VERIFY_MAX_ROWS {
                run_batch(model, std::mem::take(&mut batch), stats);
                rows = 0;
            }
            rows += n;
            batch.push(m);
        }
        if !batch.is_empty() {
            run_batch(model, batch, stats);
        }
    }
    if let Some(m) = long {
        stats.long.fetch_add(1, Ordering::SeqCst);
        if ran_short {
            stats.long_beside_short.fetch_add(1, Ordering::Relaxed);
        }
        let model = models[m.model].clone();
        run_batch(&model, vec![m], stats);
    }
}

/// Runs `f`, turning a panic in model code into an error for the requests it served.
fn guarded(f: impl FnOnce() -> Result<()>) -> Result<()> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)).unwrap_or_else(|p| Err(panic_error(p)))
}

/// A caught panic as the error the requests it hit get.
pub(crate) fn panic_error(p: Box<dyn std::any::Any + Send>) -> anyhow::Error {
    let msg = p
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| p.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "unknown panic".into());
    anyhow!("engine panic: {msg}")
}

/// One forward over the passes in `batch` (all on `model`), each answered.
fn run_batch(model: &Model, batch: Vec<Msg>, stats: &SchedStats) {
    // A pass with an id outside the vocabulary fails alone, before any state changes.
    let vocab = model.cfg.vocab_size;
    let (good, bad): (Vec<Msg>, Vec<Msg>) = batch.into_iter().partition(|m| match &m.work {
        Work::Forward { tokens, .. } => !tokens.is_empty() && tokens.iter().all(|&t| (t as usize) < vocab),
        Work::Commit { .. } => false,
    });
    for m in bad {
        let result = Err(anyhow!("a pass with no tokens or a token id outside the vocabulary of {vocab}"));
        let _ = m.reply.send(Reply { session: m.session, out: Vec::new(), result });
    }
    if good.is_empty() {
        return;
    }
    let mut sessions = Vec::with_capacity(good.len());
    let mut inputs = Vec::with_capacity(good.len());
    let mut outs = Vec::with_capacity(good.len());
    let mut replies = Vec::with_capacity(good.len());
    for m in good {
        let Work::Forward { tokens, want, out } = m.work else { unreachable!("partitioned above") };
        sessions.push(m.session);
        inputs.push((tokens, want));
        outs.push(out);
        replies.push(m.reply);
    }
    let rows: usize = inputs.iter().map(|(t, _)| t.len()).sum();
    stats.passes.fetch_add(1, Ordering::Relaxed);
    stats.rows.fetch_add(rows as u64, Ordering::Relaxed);
    if replies.len() > 1 {
        stats.batched.fetch_add(replies.len() as u64, Ordering::Relaxed);
    }
    let result = guarded(|| {
        let mut steps: Vec<Step> = sessions
            .iter_mut()
            .zip(&inputs)
            .map(|(session, (tokens, want))| Step { session, tokens, want: *want })
            .collect();
        model.forward_batch(&mut steps, &mut outs)
    });
    let err = result.as_ref().err().map(|e| format!("{e:#}"));
    for ((session, out), reply) in sessions.into_iter().zip(outs).zip(replies) {
        let result = match &err {
            None => Ok(()),
            Some(e) => Err(anyhow!("{e}")),
        };
        let _ = reply.send(Reply { session, out, result });
    }
}
