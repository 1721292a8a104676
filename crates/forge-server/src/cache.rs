//! Prompt cache: model states kept for reuse by later requests that share a token prefix.
//!
//! Each entry is an exact snapshot (a `Session` clone) with the token ids it has consumed and the
//! logits for the next token, so a request whose prompt equals an entry needs no forward at all.
//! A request starts from the entry that covers the longest prefix of its prompt:
//! * an entry whose tokens are all a prefix of the prompt is continued as is;
//! * for attention-only models an entry that diverges can be cut back to the common prefix by
//!   truncating its KV rows; hybrid models (DeltaNet states cannot be rewound) can only use
//!   entries that are entirely a prefix, which is why the engine takes snapshots at the points
//!   later requests are likely to return to (end of the system prompt, start of the last turn,
//!   end of the prompt).
//!
//! Entries are evicted least-recently-used beyond a byte budget and an entry count, so an agent's
//! occasional summary request adds its own entries without discarding the conversation's.

use anyhow::{bail, Result};
use forge_model::session::{LayerState, Session};
use forge_model::{Logits, Model, Runner};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;

struct Entry {
    tokens: Vec<u32>,
    session: Session,
    logits: Vec<f32>,
    /// Snapshots are cloned when used (they stay for the next request); the state a generation
    /// ended in is moved into the next request that extends it.
    snapshot: bool,
    last_used: u64,
}

impl Entry {
    fn bytes(&self) -> usize {
        self.session.state_bytes() + self.logits.len() * 4 + self.tokens.len() * 4
    }
}

pub struct PromptCache {
    entries: Vec<Entry>,
    max_bytes: usize,
    max_entries: usize,
    /// KV rows can be cut back (no recurrent state in the model).
    truncatable: bool,
    clock: u64,
}

/// A session positioned after the whole prompt, with the logits for the next token.
pub struct Prefilled {
    pub session: Session,
    pub logits: Vec<f32>,
    /// Prompt tokens that came from the cache (not computed by this request).
    pub cached: usize,
}

/// Outcome of a prefill that may be cancelled between chunks.
pub enum PrefillResult {
    Done(Prefilled),
    /// Cancelled: the partial state was kept in the cache.
    Cancelled,
}

fn common_prefix(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

/// Cuts an attention-only session back to its first `n` positions.
fn truncate(s: &mut Session, n: usize) -> Result<()> {
    for l in &mut s.layers {
        match l {
            LayerState::Attn(c) => c.truncate(n),
            LayerState::Delta(_) => bail!("cannot truncate a session with recurrent state"),
        }
    }
    s.pos = n;
    Ok(())
}

impl PromptCache {
    pub fn new(model: &Model, max_bytes: usize, max_entries: usize) -> Self {
        let truncatable = model.new_session().layers.iter().all(|l| matches!(l, LayerState::Attn(_)));
        PromptCache { entries: Vec::new(), max_bytes, max_entries: max_entries.max(1), truncatable, clock: 0 }
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    pub fn bytes(&self) -> usize {
        self.entries.iter().map(Entry::bytes).sum()
    }

    pub fn clear(&mut self) {
        self.entries.clear();
    }

    /// How many of `prompt`'s tokens entry `e` can supply.
    fn usable(&self, e: &Entry, prompt: &[u32]) -> usize {
        let lcp = common_prefix(&e.tokens, prompt);
        if lcp == e.tokens.len() {
            lcp
        } else if self.truncatable {
            // Cut back inside the entry: its logits are not for that position, so at least one
            // prompt token must still be run to get logits.
            lcp.min(prompt.len().saturating_sub(1))
        } else {
            0
        }
    }

    /// The state `prompt` starts from: the best entry's session (moved, or cloned from a
    /// snapshot, cut back where needed), its logits when it covers a whole prefix, and how many
    /// prompt tokens it holds; or a new session.
    fn start(&mut self, model: &Model, prompt: &[u32]) -> Result<(Session, Vec<f32>, usize)> {
        self.clock += 1;
        let best = (0..self.entries.len())
            .map(|i| (self.usable(&self.entries[i], prompt), i))
            .filter(|&(u, _)| u > 0)
            // Longest reuse; among equals prefer moving an entry over cloning a snapshot.
            .max_by_key(|&(u, i)| (u, !self.entries[i].snapshot, self.entries[i].last_used));
        Ok(match best {
            None => (model.new_session(), Vec::new(), 0),
            Some((u, i)) => {
                let exact_prefix = u == self.entries[i].tokens.len();
                let (mut s, l) = if exact_prefix && !self.entries[i].snapshot {
                    let e = self.entries.swap_remove(i);
                    (e.session, e.logits)
                } else {
                    let e = &mut self.entries[i];
                    e.last_used = self.clock;
                    (e.session.clone(), if exact_prefix { e.logits.clone() } else { Vec::new() })
                };
                if !exact_prefix {
                    truncate(&mut s, u)?;
                }
                (s, l, u)
            }
        })
    }

    /// Runs `prompt` from the best entry of `cache` through `run`, in chunks of at most `chunk`
    /// tokens, storing snapshots at the positions in `snapshots` (hybrid models only;
    /// attention-only models can reach any prefix by truncation). Checks `cancel` between
    /// chunks. The cache is locked only to look up and to store, never while a chunk runs, so
    /// the slots of a batching server share it.
    pub fn prefill(
        cache: &Mutex<PromptCache>,
        run: &dyn Runner,
        prompt: &[u32],
        snapshots: &[usize],
        chunk: usize,
        cancel: &AtomicBool,
    ) -> Result<PrefillResult> {
        if prompt.is_empty() {
            bail!("empty prompt");
        }
        let lock = || cache.lock().unwrap_or_else(|e| e.into_inner());
        let (mut session, mut logits, cached, truncatable) = {
            let mut c = lock();
            let (s, l, u) = c.start(run.model(), prompt)?;
            (s, l, u, c.truncatable)
        };
        let mut done = cached;
        let mut stops: Vec<usize> = if truncatable {
            Vec::new()
        } else {
            snapshots.iter().copied().filter(|&b| b > done && b <= prompt.len()).collect()
        };
        stops.push(prompt.len());
        stops.sort_unstable();
        stops.dedup();
        for stop in stops {
            while done < stop {
                if cancel.load(Ordering::Relaxed) {
                    if done > 0 {
                        lock().insert(prompt[..done].to_vec(), session, logits, false);
                    }
                    return Ok(PrefillResult::Cancelled);
                }
                let end = (done + chunk.max(1)).min(stop);
                // Logits for every chunk (one head row, cheap next to the chunk) keep the state
                // and its logits in step, so a cancelled prefill still leaves a usable entry.
                run.forward_into(&mut session, &prompt[done..end], Logits::Last, &mut logits)?;
                done = end;
            }
            if !truncatable && snapshots.contains(&stop) {
                lock().insert(prompt[..stop].to_vec(), session.clone(), logits.clone(), true);
            }
        }
        Ok(PrefillResult::Done(Prefilled { session, logits, cached }))
    }

    /// Keeps the state after `tokens` (the state a generation ended in, or a snapshot).
    pub fn insert(&mut self, tokens: Vec<u32>, session: Session, logits: Vec<f32>, snapshot: bool) {
        if tokens.is_empty() || session.pos != tokens.len() || logits.is_empty() {
            return;
        }
        self.clock += 1;
        // Equal tokens mean an equal state: keep the entry we have (as a snapshot if either is).
        if let Some(e) = self.entries.iter_mut().find(|e| e.tokens == tokens) {
            e.last_used = self.clock;
            e.snapshot |= snapshot;
            return;
        }
        self.entries.push(Entry { tokens, session, logits, snapshot, last_used: self.clock });
        self.evict();
    }

    fn evict(&mut self) {
        while self.entries.len() > self.max_entries || (self.entries.len() > 1 && self.bytes() > self.max_bytes) {
            let Some(i) = (0..self.entries.len()).min_by_key(|&i| self.entries[i].last_used) else { break };
            self.entries.swap_remove(i);
        }
        if self.entries.len() == 1 && self.bytes() > self.max_bytes {
            self.entries.clear();
        }
    }
}
