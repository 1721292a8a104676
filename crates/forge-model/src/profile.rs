//! Optional time split of forward passes by part (`forge bench`): off by default, and then one
//! relaxed atomic load per part.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Instant;

/// The parts a forward pass is split into.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Part {
    Embed,
    /// Norm + attention mixer's projections (the time of the whole mixer less its core).
    Attention,
    /// The attention mixer's core: q/k norms, RoPE, the KV cache, attention, output gate.
    AttentionCore,
    /// Norm + Gated DeltaNet mixer's projections (the whole mixer less its core).
    DeltaNet,
    /// The DeltaNet mixer's core: conv, the delta rule over the recurrent state, gated norm.
    DeltaNetCore,
    /// Norm + MLP.
    Mlp,
    /// Final norm + LM head.
    Head,
}

pub const PARTS: [Part; 7] =
    [Part::Embed, Part::Attention, Part::AttentionCore, Part::DeltaNet, Part::DeltaNetCore, Part::Mlp, Part::Head];

impl Part {
    pub fn name(self) -> &'static str {
        match self {
            Part::Embed => "embed",
            Part::Attention => "attention",
            Part::AttentionCore => "attention_core",
            Part::DeltaNet => "deltanet",
            Part::DeltaNetCore => "deltanet_core",
            Part::Mlp => "mlp",
            Part::Head => "head",
        }
    }
}

static ON: AtomicBool = AtomicBool::new(false);
static NANOS: [AtomicU64; PARTS.len()] = [const { AtomicU64::new(0) }; PARTS.len()];

/// Start (clearing the counters) or stop collecting.
pub fn enable(on: bool) {
    if on {
        NANOS.iter().for_each(|n| n.store(0, Ordering::Relaxed));
    }
    ON.store(on, Ordering::Relaxed)
}

impl Part {
    /// The part whose timer runs around this one's: a core is timed inside its mixer, and
    /// [`totals`] takes it out of the mixer's time.
    fn within(self) -> Option<Part> {
        match self {
            Part::AttentionCore => Some(Part::Attention),
            Part::DeltaNetCore => Some(Part::DeltaNet),
            _ => None,
        }
    }
}

/// Seconds spent per part since the last `enable(true)`; the parts do not overlap.
pub fn totals() -> Vec<(Part, f64)> {
    let nanos: Vec<u64> = NANOS.iter().map(|n| n.load(Ordering::Relaxed)).collect();
    let mut own = nanos.clone();
    for &p in &PARTS {
        if let Some(outer) = p.within() {
            own[outer as usize] = own[outer as usize].saturating_sub(nanos[p as usize]);
        }
    }
    PARTS.iter().map(|&p| (p, own[p as usize] as f64 * 1e-9)).collect()
}

/// A running measurement (no-op when collection is off).
pub struct Timer(Option<Instant>);

pub fn start() -> Timer {
    Timer(ON.load(Ordering::Relaxed).then(Instant::now))
}

impl Timer {
    /// Add the time since `start` (or the last `stop`) to `part` and restart.
    pub fn stop(&mut self, part: Part) {
        if let Some(t) = self.0 {
            let now = Instant::now();
            NANOS[part as usize].fetch_add((now - t).as_nanos() as u64, Ordering::Relaxed);
            self.0 = Some(now);
        }
    }
}
