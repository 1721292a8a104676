//! A global allocator for the fuzz drivers that records, per thread, the largest single request
//! since the last reset, so that a target which sizes an allocation from its input is caught even
//! when the machine could have served it. Requests beyond [`HARD_LIMIT`] fail outright (Rust then
//! aborts with an allocation error) instead of taking the machine's memory.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;

/// No target has a reason to ask for this much at once.
pub const HARD_LIMIT: usize = 4 << 30;

thread_local! {
    static LARGEST: Cell<usize> = const { Cell::new(0) };
}

fn note(size: usize) {
    // `try_with`: the slot may be gone while the thread is being torn down.
    let _ = LARGEST.try_with(|l| {
        if size > l.get() {
            l.set(size);
        }
    });
}

/// The largest single allocation on this thread since the last call (which resets it).
pub fn take_largest() -> usize {
    LARGEST.try_with(|l| l.replace(0)).unwrap_or(0)
}

pub struct LimitAlloc;

// SAFETY: every request is forwarded unchanged to the system allocator, or refused with null.
unsafe impl GlobalAlloc for LimitAlloc {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        note(layout.size());
        if layout.size() > HARD_LIMIT {
            return std::ptr::null_mut();
        }
        unsafe { System.alloc(layout) }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        note(layout.size());
        if layout.size() > HARD_LIMIT {
            return std::ptr::null_mut();
        }
        unsafe { System.alloc_zeroed(layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        note(new_size);
        if new_size > HARD_LIMIT {
            return std::ptr::null_mut();
        }
        unsafe { System.realloc(ptr, layout, new_size) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        unsafe { System.dealloc(ptr, layout) }
    }
}
