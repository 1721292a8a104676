//! Reused per-thread buffers, so that a warm decode loop makes no heap allocations.
//!
//! A forward pass needs a few dozen short-lived buffers per layer (normalized rows, projections,
//! attention scores). Allocating them each token would cost SmolLM2 ~1800 `malloc`/`free` pairs per
//! token and, for the larger ones, fresh pages from the kernel on every call. A [`Buf`] instead
//! takes a buffer from its thread's pool and gives it back when dropped. Every token asks for the
//! same sizes in the same order, so after the first token or two every request is served from
//! the pool.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::RefCell;
use std::ops::{Deref, DerefMut};
use std::sync::atomic::{AtomicIsize, AtomicU64, AtomicUsize, Ordering};

/// Buffers a thread keeps; more are freed as usual.
const KEEP: usize = 48;

thread_local! {
    static POOL: RefCell<Vec<Vec<f32>>> = RefCell::new(Vec::with_capacity(KEEP));
}

/// Bytes of scratch buffers alive in all threads, lent out or pooled.
static HELD: AtomicIsize = AtomicIsize::new(0);

/// Bytes held as scratch by all threads (pooled or in use): `forge bench`'s "scratch" memory.
pub fn held_bytes() -> usize {
    HELD.load(Ordering::Relaxed).max(0) as usize
}

/// Record a change in the capacity held as scratch (`f32` buffers here, and other kept
/// structures such as the quantized activations).
pub fn note_held(before_bytes: usize, after_bytes: usize) {
    HELD.fetch_add(after_bytes as isize - before_bytes as isize, Ordering::Relaxed);
}

/// `buf` (a kept buffer) at least `n` values long, its growth counted as held scratch. Values
/// already there stay; new ones are zero.
pub fn grow(buf: &mut Vec<f32>, n: usize) {
    if buf.len() < n {
        let before = 4 * buf.capacity();
        buf.resize(n, 0.0);
        note_held(before, 4 * buf.capacity());
    }
}

/// An `f32` buffer from the thread's pool, returned to the pool of the thread that drops it.
/// Its first `n` values are the buffer; the vector's length only grows (what lies past `n` was
/// written before and stays initialized), so that taking it for overwriting writes nothing.
#[derive(Debug, Default)]
pub struct Buf {
    v: Vec<f32>,
    n: usize,
}

/// The pooled buffer that fits `n` most tightly, or else the largest one (which the caller grows).
fn take(n: usize) -> Vec<f32> {
    POOL.try_with(|p| {
        let mut p = p.try_borrow_mut().ok()?;
        let fits = |v: &Vec<f32>| v.capacity() >= n;
        let best = p.iter().enumerate().min_by_key(|(_, v)| {
            // Fitting buffers first, smallest capacity among them; then the largest misfit.
            if fits(v) {
                (0, v.capacity())
            } else {
                (1, usize::MAX - v.capacity())
            }
        })?;
        let i = best.0;
        Some(p.swap_remove(i))
    })
    .ok()
    .flatten()
    .unwrap_or_default()
}

impl Buf {
    /// A pooled buffer of `n` values as they were left (zeros where the vector grows).
    fn of_len(n: usize) -> Buf {
        let mut v = take(n);
        let before = v.capacity();
        if v.len() < n {
            v.resize(n, 0.0);
        }
        note_held(4 * before, 4 * v.capacity());
        Buf { v, n }
    }

    /// `n` zeros.
    pub fn zeros(n: usize) -> Buf {
        let mut b = Buf::of_len(n);
        b.fill(0.0);
        b
    }

    /// `n` values left as the pooled buffer had them (zeros where it grows): for outputs the
    /// caller writes in full before reading. Zeroing buffers that are then overwritten would
    /// cost SmolLM2's decode about 1.5 % of its time, most of it cache misses on lines the
    /// weight stream has evicted; truncating a pooled vector and growing it again would zero the
    /// same values, so the vector is never shortened.
    pub fn for_overwrite(n: usize) -> Buf {
        Buf::of_len(n)
    }

    /// The values as a plain vector, leaving the pool.
    pub fn into_vec(mut self) -> Vec<f32> {
        note_held(4 * self.v.capacity(), 0);
        let mut v = std::mem::take(&mut self.v);
        v.truncate(self.n);
        v
    }
}

impl Drop for Buf {
    fn drop(&mut self) {
        if self.v.capacity() == 0 {
            return;
        }
        let v = std::mem::take(&mut self.v);
        let bytes = 4 * v.capacity();
        // During thread teardown, or with the pool full, the buffer is simply freed.
        let kept = POOL
            .try_with(|p| match p.try_borrow_mut() {
                Ok(mut p) if p.len() < KEEP => {
                    p.push(v);
                    true
                }
                _ => false,
            })
            .unwrap_or(false);
        if !kept {
            note_held(bytes, 0);
        }
    }
}

impl Deref for Buf {
    type Target = [f32];
    fn deref(&self) -> &[f32] {
        &self.v[..self.n]
    }
}

impl DerefMut for Buf {
    fn deref_mut(&mut self) -> &mut [f32] {
        &mut self.v[..self.n]
    }
}

/// `f(&mut value)` with this thread's value kept under `key` (`Default` the first time): for
/// scratch structures other than plain `f32` buffers (quantized activations, task lists).
/// Re-entrant calls get a fresh value rather than a borrow error.
pub fn with_kept<T: Default + 'static, R>(
    key: &'static std::thread::LocalKey<RefCell<Option<T>>>,
    f: impl FnOnce(&mut T) -> R,
) -> R {
    let mut v = key.try_with(|c| c.borrow_mut().take()).ok().flatten().unwrap_or_default();
    let r = f(&mut v);
    let _ = key.try_with(|c| *c.borrow_mut() = Some(v));
    r
}

/// Heap allocations made in this process so far, when [`CountingAlloc`] is the global
/// allocator (0 otherwise).
pub fn allocations() -> u64 {
    ALLOCATIONS.load(Ordering::Relaxed)
}

static ALLOCATIONS: AtomicU64 = AtomicU64::new(0);
static LIVE: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);

/// Heap bytes held now, when [`CountingAlloc`] is the global allocator (0 otherwise).
pub fn live_bytes() -> usize {
    LIVE.load(Ordering::Relaxed)
}

/// The most heap bytes held at once since the last [`reset_peak`] (or the start).
pub fn peak_bytes() -> usize {
    PEAK.load(Ordering::Relaxed)
}

/// Starts a new peak from the bytes held now.
pub fn reset_peak() {
    PEAK.store(LIVE.load(Ordering::Relaxed), Ordering::Relaxed);
}

fn note_alloc(bytes: usize) {
    ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
    let live = LIVE.fetch_add(bytes, Ordering::Relaxed) + bytes;
    PEAK.fetch_max(live, Ordering::Relaxed);
}

/// The system allocator, counting allocations (`forge bench` reports them per decoded token;
/// the allocation test asserts there are none). Install with `#[global_allocator]`.
pub struct CountingAlloc;

// SAFETY: every call forwards to the system allocator with the caller's arguments unchanged;
// the counters are a side effect that never touches the memory.
unsafe impl GlobalAlloc for CountingAlloc {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        // SAFETY: the caller's contract for `alloc` is passed on as it is.
        let p = unsafe { System.alloc(l) };
        if !p.is_null() {
            note_alloc(l.size());
        }
        p
    }
    unsafe fn alloc_zeroed(&self, l: Layout) -> *mut u8 {
        // SAFETY: as above, for `alloc_zeroed`.
        let p = unsafe { System.alloc_zeroed(l) };
        if !p.is_null() {
            note_alloc(l.size());
        }
        p
    }
    unsafe fn realloc(&self, p: *mut u8, l: Layout, n: usize) -> *mut u8 {
        // SAFETY: as above, for `realloc` (`p` came from this allocator, i.e. from `System`).
        let q = unsafe { System.realloc(p, l, n) };
        if !q.is_null() {
            LIVE.fetch_sub(l.size(), Ordering::Relaxed);
            note_alloc(n);
        }
        q
    }
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        LIVE.fetch_sub(l.size(), Ordering::Relaxed);
        // SAFETY: as above, for `dealloc`.
        unsafe { System.dealloc(p, l) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buffers_are_zeroed_sized_and_reused() {
        let p = {
            let mut a = Buf::zeros(100);
            a.iter_mut().for_each(|v| *v = 7.0);
            a.as_ptr()
        };
        // The same request gets the same (now dirty) buffer back, zeroed again.
        let b = Buf::zeros(100);
        assert_eq!(b.as_ptr(), p);
        assert!(b.len() == 100 && b.iter().all(|&v| v == 0.0));
        // Two live buffers are distinct; a larger request than any pooled buffer still works.
        let c = Buf::zeros(10_000);
        assert_ne!(c.as_ptr(), b.as_ptr());
        assert_eq!(c.len(), 10_000);
        // Left as it was, at the asked length: a shorter use leaves the rest as it was
        // written, and only growth past anything the vector held adds zeros.
        let e = {
            let mut e = Buf::for_overwrite(8);
            e.copy_from_slice(&[4.0; 8]);
            e.as_ptr()
        };
        let f = Buf::for_overwrite(3);
        assert_eq!((f.as_ptr(), &f[..]), (e, &[4.0; 3][..]));
        drop(f);
        let g = Buf::for_overwrite(8);
        assert_eq!((g.as_ptr(), &g[..]), (e, &[4.0; 8][..]));
        drop(g);
        let h = Buf::for_overwrite(10);
        assert_eq!((&h[..8], &h[8..]), (&[4.0; 8][..], &[0.0, 0.0][..]));
        drop(h);
        let mut d = Buf::for_overwrite(3);
        d.copy_from_slice(&[1.0, 2.0, 3.0]);
        assert_eq!(d.into_vec(), vec![1.0, 2.0, 3.0]);
    }

    #[test]
    fn the_tightest_fitting_buffer_is_taken() {
        let (small, big) = (Buf::zeros(64), Buf::zeros(4096));
        let (ps, pb) = (small.as_ptr(), big.as_ptr());
        drop(small);
        drop(big);
        let a = Buf::zeros(60);
        let b = Buf::zeros(1000);
        assert_eq!((a.as_ptr(), b.as_ptr()), (ps, pb));
    }

    thread_local! {
        static K: RefCell<Option<Vec<u8>>> = const { RefCell::new(None) };
    }

    #[test]
    fn kept_values_persist_and_nest() {
        with_kept(&K, |v: &mut Vec<u8>| v.push(1));
        with_kept(&K, |v: &mut Vec<u8>| {
            assert_eq!(v, &[1]);
            // A nested use sees a fresh value, and the outer one is kept afterwards.
            with_kept(&K, |w: &mut Vec<u8>| assert!(w.is_empty()));
            v.push(2);
        });
        with_kept(&K, |v: &mut Vec<u8>| assert_eq!(v, &[1, 2]));
    }
}
