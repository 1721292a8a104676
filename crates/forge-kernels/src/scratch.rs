//! Reused per-thread buffers, so that a warm decode loop makes no heap allocations.
//!
//! A forward pass needs a few dozen short-lived buffers per layer (normalized rows, projections,
//! attention scores). Allocating them each token cost SmolLM2 ~1800 `malloc`/`free` pairs per
//! token and, for the larger ones, fresh pages from the kernel on every call. A [`Buf`] instead
//! takes a buffer from its thread's pool and gives it back when dropped. Every token asks for the
//! same sizes in the same order, so after the first token or two every request is served from
//! the pool.

use std::cell::RefCell;
use std::ops::{Deref, DerefMut};

/// Buffers a thread keeps; more are freed as usual.
const KEEP: usize = 48;

thread_local! {
    static POOL: RefCell<Vec<Vec<f32>>> = RefCell::new(Vec::with_capacity(KEEP));
}

/// An `f32` buffer from the thread's pool, returned to the pool of the thread that drops it.
#[derive(Debug, Default)]
pub struct Buf {
    v: Vec<f32>,
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
    /// `n` zeros.
    pub fn zeros(n: usize) -> Buf {
        let mut v = take(n);
        v.clear();
        v.resize(n, 0.0);
        Buf { v }
    }

    /// A copy of `x`.
    pub fn copy_of(x: &[f32]) -> Buf {
        let mut v = take(x.len());
        v.clear();
        v.extend_from_slice(x);
        Buf { v }
    }

    /// The values as a plain vector, leaving the pool.
    pub fn into_vec(mut self) -> Vec<f32> {
        std::mem::take(&mut self.v)
    }
}

impl Drop for Buf {
    fn drop(&mut self) {
        if self.v.capacity() == 0 {
            return;
        }
        let v = std::mem::take(&mut self.v);
        // During thread teardown, or with the pool full, the buffer is simply freed.
        let _ = POOL.try_with(|p| {
            if let Ok(mut p) = p.try_borrow_mut() {
                if p.len() < KEEP {
                    p.push(v);
                }
            }
        });
    }
}

impl Deref for Buf {
    type Target = [f32];
    fn deref(&self) -> &[f32] {
        &self.v
    }
}

impl DerefMut for Buf {
    fn deref_mut(&mut self) -> &mut [f32] {
        &mut self.v
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
        let d = Buf::copy_of(&[1.0, 2.0, 3.0]);
        assert_eq!(&d[..], &[1.0, 2.0, 3.0]);
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
