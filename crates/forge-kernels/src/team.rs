//! A spinning fork-join team for decode.
//!
//! Decoding one token makes about five parallel calls per layer, each a few tens of
//! microseconds of work. Rayon's idle workers go to sleep between them, and waking one costs a
//! futex round trip and a reschedule each time (on 2 cores about a sixth of SmolLM2's decode
//! time would go to the scheduler). Inside [`with_team`] the other workers instead spin on one
//! atomic word and take tasks the moment [`parallel_for`] posts them. They spin only for the
//! length of that call (one forward pass) and then return to rayon.
//!
//! A task is claimed by a compare-and-swap on `epoch << 32 | next index`: a worker that still
//! holds an older epoch can never claim a task of a newer call, and a call does not return
//! before every claimed task has finished, so the borrowed closure outlives every use.

use std::cell::Cell;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};

struct Team {
    /// `epoch << 32 | next unclaimed task`.
    state: AtomicU64,
    /// Tasks in the current epoch.
    n: AtomicUsize,
    /// Address of the current call's `&(dyn Fn(usize) + Sync)` (on the caller's stack).
    job: AtomicUsize,
    done: AtomicUsize,
    stop: AtomicBool,
    /// A task of the current call panicked.
    panicked: AtomicBool,
}

type Job<'a> = &'a (dyn Fn(usize) + Sync);

thread_local! {
    /// The team this thread leads, while inside `with_team`.
    static LEADING: Cell<*const Team> = const { Cell::new(std::ptr::null()) };
    /// Whether this thread has had the pool's workers set up their scratch.
    static PREPARED: Cell<bool> = const { Cell::new(false) };
}

/// Run `f` with the pool's other workers spinning as a team for [`parallel_for`] calls made
/// from this thread. Without a second worker (or when already leading a team) just runs `f`.
pub fn with_team<R: Send>(f: impl FnOnce() -> R + Send) -> R {
    let helpers = rayon::current_num_threads().saturating_sub(1);
    if helpers == 0 || !LEADING.with(|l| l.get().is_null()) {
        return f();
    }
    let team = Team {
        state: AtomicU64::new(0),
        n: AtomicUsize::new(0),
        job: AtomicUsize::new(0),
        done: AtomicUsize::new(0),
        stop: AtomicBool::new(false),
        panicked: AtomicBool::new(false),
    };
    let team = &team;
    // Helpers go out through `rayon::join` (a job on this thread's stack that an idle worker
    // steals) rather than `scope.spawn` (a boxed job): a forward pass then allocates nothing.
    // Every worker of the pool sets up its thread's kernel scratch the first time this thread
    // leads a team (the first forward pass, a warm-up), so that a worker whose first task comes
    // late, in a pass whose allocations are counted, allocates nothing then.
    if !PREPARED.with(Cell::get) {
        rayon::broadcast(|_| crate::attention::prepare_thread());
        PREPARED.with(|p| p.set(true));
    }
    let lead = || {
        LEADING.with(|l| l.set(team as *const Team));
        // Stop the helpers and leave the team even if `f` panics.
        struct Leave<'a>(&'a Team);
        impl Drop for Leave<'_> {
            fn drop(&mut self) {
                LEADING.with(|l| l.set(std::ptr::null()));
                self.0.stop.store(true, Ordering::Release);
            }
        }
        let _leave = Leave(team);
        f()
    };
    with_helpers(team, helpers, lead)
}

/// `lead()` on this thread with `n` helper loops offered to the pool's other workers. A helper
/// not stolen before `lead` returns runs here afterwards and sees `stop` at once.
fn with_helpers<R: Send>(team: &Team, n: usize, lead: impl FnOnce() -> R + Send) -> R {
    if n == 0 {
        return lead();
    }
    rayon::join(|| with_helpers(team, n - 1, lead), || work(team)).0
}

/// A helper's loop: wait for a new epoch, take its tasks, until told to stop.
fn work(team: &Team) {
    let mut seen = 0u64;
    let mut idle = 0u32;
    loop {
        let s = team.state.load(Ordering::Acquire);
        if s >> 32 == seen {
            if team.stop.load(Ordering::Acquire) {
                return;
            }
            idle = idle.saturating_add(1);
            if idle < 1 << 16 {
                std::hint::spin_loop();
            } else {
                // A long serial stretch (or a stalled caller): stop burning the core.
                std::thread::yield_now();
            }
            continue;
        }
        idle = 0;
        seen = s >> 32;
        run_tasks(team, seen);
    }
}

/// Claim and run tasks of `epoch` until none is left.
fn run_tasks(team: &Team, epoch: u64) {
    loop {
        let s = team.state.load(Ordering::Acquire);
        let n = team.n.load(Ordering::Acquire) as u64;
        if s >> 32 != epoch || (s & 0xffff_ffff) >= n {
            return;
        }
        if team.state.compare_exchange_weak(s, s + 1, Ordering::AcqRel, Ordering::Relaxed).is_ok() {
            // SAFETY: the claim succeeded in `epoch`, whose caller is still waiting for this
            // task (it returns only when `done` reaches `n`), so its closure is alive and
            // `job` still points at it.
            let f: Job = unsafe { *(team.job.load(Ordering::Acquire) as *const Job) };
            // A panicking task still counts as done (the caller would otherwise wait forever);
            // the caller re-raises it.
            let i = (s & 0xffff_ffff) as usize;
            if std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| f(i))).is_err() {
                team.panicked.store(true, Ordering::Release);
            }
            team.done.fetch_add(1, Ordering::AcqRel);
        }
    }
}

/// `f(i)` for `i in 0..n`, spread over the team this thread leads, or over rayon otherwise.
/// Tasks must be independent; the order is unspecified.
pub fn parallel_for(n: usize, f: &(dyn Fn(usize) + Sync)) {
    let team = LEADING.with(|l| l.get());
    if team.is_null() {
        use rayon::prelude::*;
        (0..n).into_par_iter().for_each(f);
        return;
    }
    if n <= 1 {
        (0..n).for_each(f);
        return;
    }
    // SAFETY: `LEADING` is set only inside `with_team`, which outlives this call.
    let team = unsafe { &*team };
    let job: Job = f;
    let epoch = (team.state.load(Ordering::Relaxed) >> 32) + 1;
    team.job.store(&job as *const Job as usize, Ordering::Release);
    team.n.store(n, Ordering::Release);
    team.done.store(0, Ordering::Release);
    team.state.store(epoch << 32, Ordering::Release);
    run_tasks(team, epoch);
    while team.done.load(Ordering::Acquire) < n {
        std::hint::spin_loop();
    }
    if team.panicked.swap(false, Ordering::AcqRel) {
        panic!("a parallel task panicked");
    }
}

/// A raw pointer that tasks may share; each task touches its own disjoint range.
struct SharedPtr<T>(*mut T);
// SAFETY: used only by `par_chunks_mut`, whose tasks write disjoint chunks of a slice that is
// exclusively borrowed for the whole call.
unsafe impl<T: Send> Sync for SharedPtr<T> {}
impl<T> SharedPtr<T> {
    fn get(&self) -> *mut T {
        self.0
    }
}

/// `f(i, chunk)` for the `chunk`-sized pieces of `data` (the last may be shorter), through
/// [`parallel_for`].
pub fn par_chunks_mut<T: Send>(data: &mut [T], chunk: usize, f: &(dyn Fn(usize, &mut [T]) + Sync)) {
    assert!(chunk > 0, "chunk size 0");
    let len = data.len();
    let ptr = SharedPtr(data.as_mut_ptr());
    parallel_for(len.div_ceil(chunk), &|i| {
        let start = i * chunk;
        let end = (start + chunk).min(len);
        // SAFETY: distinct `i` give disjoint ranges inside `data`, which this call borrows
        // exclusively until every task has returned.
        let piece = unsafe { std::slice::from_raw_parts_mut(ptr.get().add(start), end - start) };
        f(i, piece)
    });
}

/// `f(row)` for every row of `width` values in `data`, in two even tasks of whole rows per
/// worker, through [`parallel_for`].
pub fn par_rows<T: Send>(data: &mut [T], width: usize, f: &(dyn Fn(&mut [T]) + Sync)) {
    assert!(width > 0, "row width 0");
    let per = (data.len() / width).div_ceil(2 * rayon::current_num_threads()).max(1);
    par_chunks_mut(data, per * width, &|_, c| c.chunks_exact_mut(width).for_each(f));
}

/// A task over matching chunks of two slices.
pub type PairTask<'a, A, B> = &'a (dyn Fn(usize, &mut [A], &mut [B]) + Sync);

/// `f(i, a_chunk, b_chunk)` over the matching pieces of two slices cut into the same number
/// of chunks (`ca` and `cb` long), through [`parallel_for`].
pub fn par_chunks2_mut<A: Send, B: Send>(a: &mut [A], ca: usize, b: &mut [B], cb: usize, f: PairTask<A, B>) {
    assert!(ca > 0 && cb > 0, "chunk size 0");
    let n = a.len().div_ceil(ca);
    assert_eq!(n, b.len().div_ceil(cb), "{} chunks of {ca} against {} of {cb}", n, b.len().div_ceil(cb));
    let (la, lb) = (a.len(), b.len());
    let (pa, pb) = (SharedPtr(a.as_mut_ptr()), SharedPtr(b.as_mut_ptr()));
    parallel_for(n, &|i| {
        let (sa, sb) = (i * ca, i * cb);
        // SAFETY: distinct `i` give disjoint ranges inside each slice, both borrowed
        // exclusively until every task has returned.
        let (x, y) = unsafe {
            (
                std::slice::from_raw_parts_mut(pa.get().add(sa), (sa + ca).min(la) - sa),
                std::slice::from_raw_parts_mut(pb.get().add(sb), (sb + cb).min(lb) - sb),
            )
        };
        f(i, x, y)
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicU32;

    #[test]
    fn every_task_runs_once_inside_and_outside_a_team() {
        let pool = rayon::ThreadPoolBuilder::new().num_threads(3).build().unwrap();
        pool.install(|| {
            for inside in [false, true] {
                let body = || {
                    for n in [0usize, 1, 2, 7, 100, 1000] {
                        let hits: Vec<AtomicU32> = (0..n).map(|_| AtomicU32::new(0)).collect();
                        parallel_for(n, &|i| {
                            hits[i].fetch_add(1, Ordering::Relaxed);
                        });
                        assert!(hits.iter().all(|h| h.load(Ordering::Relaxed) == 1), "n={n} inside={inside}");
                    }
                };
                if inside {
                    with_team(body)
                } else {
                    body()
                }
            }
        });
    }

    #[test]
    fn every_call_of_a_long_run_sees_its_own_tasks() {
        // Back-to-back calls: a helper still finishing one epoch must never run a task of the
        // next with the old closure (each round writes round-specific values).
        let pool = rayon::ThreadPoolBuilder::new().num_threads(2).build().unwrap();
        pool.install(|| {
            with_team(|| {
                let out: Vec<AtomicU64> = (0..64).map(|_| AtomicU64::new(0)).collect();
                for round in 0..5000u64 {
                    parallel_for(64, &|i| out[i].store(i as u64 * 1000 + round, Ordering::Relaxed));
                    for (i, v) in out.iter().enumerate() {
                        assert_eq!(v.load(Ordering::Relaxed), i as u64 * 1000 + round, "round {round}");
                    }
                }
            })
        });
    }

    #[test]
    fn chunks_cover_the_slice_once() {
        let pool = rayon::ThreadPoolBuilder::new().num_threads(2).build().unwrap();
        pool.install(|| {
            with_team(|| {
                for (len, chunk) in [(0usize, 3usize), (10, 3), (9, 3), (1, 5), (1000, 7)] {
                    let mut v = vec![0usize; len];
                    par_chunks_mut(&mut v, chunk, &|i, c| c.iter_mut().for_each(|x| *x += i + 1));
                    let want: Vec<usize> = (0..len).map(|j| j / chunk + 1).collect();
                    assert_eq!(v, want, "len {len} chunk {chunk}");
                }
            })
        });
    }

    #[test]
    fn paired_chunks_match_up() {
        let pool = rayon::ThreadPoolBuilder::new().num_threads(2).build().unwrap();
        pool.install(|| {
            with_team(|| {
                let (mut a, mut b) = (vec![0usize; 10], vec![0usize; 7]);
                par_chunks2_mut(&mut a, 3, &mut b, 2, &|i, x, y| {
                    x.iter_mut().for_each(|v| *v = i + 1);
                    y.iter_mut().for_each(|v| *v = 10 * (i + 1) + x.len());
                });
                assert_eq!(a, [1, 1, 1, 2, 2, 2, 3, 3, 3, 4]);
                assert_eq!(b, [13, 13, 23, 23, 33, 33, 41]);
            })
        });
    }

    #[test]
    fn a_panicking_task_panics_the_caller_instead_of_hanging() {
        let pool = rayon::ThreadPoolBuilder::new().num_threads(2).build().unwrap();
        for bad in [0usize, 5, 63] {
            let r = pool.install(|| {
                std::panic::catch_unwind(|| {
                    with_team(|| {
                        parallel_for(64, &|i| {
                            if i == bad {
                                panic!("task {i}");
                            }
                        })
                    })
                })
            });
            assert!(r.is_err(), "task {bad}");
            // The team is usable afterwards.
            let n = AtomicU32::new(0);
            pool.install(|| {
                with_team(|| {
                    parallel_for(10, &|_| {
                        n.fetch_add(1, Ordering::Relaxed);
                    })
                })
            });
            assert_eq!(n.load(Ordering::Relaxed), 10);
        }
    }

    #[test]
    fn a_panicking_body_releases_the_helpers() {
        let pool = rayon::ThreadPoolBuilder::new().num_threads(2).build().unwrap();
        let r = pool.install(|| std::panic::catch_unwind(|| with_team(|| panic!("boom"))));
        assert!(r.is_err());
        // The pool is usable afterwards (the helper left).
        assert_eq!(pool.install(|| with_team(|| 5)), 5);
    }
}
