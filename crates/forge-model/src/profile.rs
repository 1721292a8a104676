//! Optional time split of forward passes by part (`forge bench`): off by default, and then one
//! relaxed atomic load per part.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Instant;

/// The parts a forward pass is split into.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Part {
    Embed,
    /// Norm + attention mixer (projections, RoPE, KV cache, attention).
    Attention,
    /// Norm + Gated DeltaNet mixer (projections, conv, recurrence).
    DeltaNet,
    /// Norm + MLP.
    Mlp,
    /// Final norm + LM head.
    Head,
}

pub const PARTS: [Part; 5] = [Part::Embed, Part::Attention, Part::DeltaNet, Part::Mlp, Part::Head];

impl Part {
    pub fn name(self) -> &'static str {
        match self {
            Part::Embed => "embed",
            Part::Attention => "attention",
            Part::DeltaNet => "deltanet",
            Part::Mlp => "mlp",
            Part::Head => "head",
        }
    }
}

static ON: AtomicBool = AtomicBool::new(false);
static NANOS: [AtomicU64; 5] = [const { AtomicU64::new(0) }; 5];

/// Start (clearing the counters) or stop collecting.
pub fn enable(on: bool) {
    if on {
        NANOS.iter().for_each(|n| n.store(0, Ordering::Relaxed));
    }
    ON.store(on, Ordering::Relaxed)
}

/// Seconds spent per part since the last `enable(true)`.
pub fn totals() -> Vec<(Part, f64)> {
    PARTS.iter().map(|&p| (p, NANOS[p as usize].load(Ordering::Relaxed) as f64 * 1e-9)).collect()
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
