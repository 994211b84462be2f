//! A counting global allocator for benches that report heap use (`core`, `decode`, `replica`,
//! `tokenize_memory`, the peers bench): it delegates to the system allocator and keeps the live
//! byte count and its peak. A bench includes it with `#[path = "support/peak_alloc.rs"] mod
//! peak_alloc;` and installs [`Counting`] as its `#[global_allocator]`.
#![allow(dead_code)] // each bench uses the part it reports

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering};

pub(crate) struct Counting;
static CURRENT: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);

fn grow(bytes: usize) {
    let now = CURRENT.fetch_add(bytes, Ordering::Relaxed) + bytes;
    PEAK.fetch_max(now, Ordering::Relaxed);
}

// SAFETY: delegates to the system allocator and only counts sizes.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        grow(l.size());
        // SAFETY: forwarded unchanged.
        unsafe { System.alloc(l) }
    }
    unsafe fn alloc_zeroed(&self, l: Layout) -> *mut u8 {
        grow(l.size());
        // SAFETY: forwarded unchanged.
        unsafe { System.alloc_zeroed(l) }
    }
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        CURRENT.fetch_sub(l.size(), Ordering::Relaxed);
        // SAFETY: forwarded unchanged.
        unsafe { System.dealloc(p, l) }
    }
    unsafe fn realloc(&self, p: *mut u8, l: Layout, new: usize) -> *mut u8 {
        // Counted as a copy: both blocks are live while it moves.
        grow(new);
        CURRENT.fetch_sub(l.size(), Ordering::Relaxed);
        // SAFETY: forwarded unchanged.
        unsafe { System.realloc(p, l, new) }
    }
}

/// Bytes the allocator has handed out and not yet got back.
pub(crate) fn live() -> usize {
    CURRENT.load(Ordering::Relaxed)
}

/// Starts a peak measurement: returns the live count, from which [`peak_above`] counts.
pub(crate) fn start_peak() -> usize {
    let base = live();
    PEAK.store(base, Ordering::Relaxed);
    base
}

/// The highest live count since [`start_peak`] returned `base`, above `base`.
pub(crate) fn peak_above(base: usize) -> usize {
    PEAK.load(Ordering::Relaxed).saturating_sub(base)
}

/// Peak heap growth while `f` runs (bytes above the live count at its start), and its result.
pub(crate) fn peak_of<T>(f: impl FnOnce() -> T) -> (usize, T) {
    let base = start_peak();
    let out = f();
    (peak_above(base), out)
}
