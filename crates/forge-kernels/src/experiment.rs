//! A process-wide switch for in-process A/B timing of kernel changes. On shared 2-core
//! machines a run's speed drifts by ±15 % within minutes, more than most kernel changes are
//! worth, so two builds timed one after the other decide nothing. A change under test reads
//! [`variant`] and the `ab` example of `forge-model` alternates it between 0 and 1 call by call,
//! so both variants see the same machine. Nothing in the released paths reads it; with nothing
//! reading it the example measures the noise itself (an A/A test).

use std::sync::atomic::{AtomicUsize, Ordering};

static VARIANT: AtomicUsize = AtomicUsize::new(0);

/// The variant under test (0 unless [`set`] changed it).
pub fn variant() -> usize {
    VARIANT.load(Ordering::Relaxed)
}

pub fn set(v: usize) {
    VARIANT.store(v, Ordering::Relaxed)
}
