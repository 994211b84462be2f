//! A TensorRT-LLM drain is read one event at a time: a hostile engine's 16 MiB response of
//! 8 million tiny elements (`[0,0,0,...]`), each refused as read, must not cost memory in
//! proportion to its element count. Read whole into a JSON tree, as the poller once did, it took
//! ~17x its bytes (a `serde_json::Value` per element); this binary's allocator tracks the peak
//! of live heap bytes while the drain is read.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering};

struct Peak;

static LIVE: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);

// SAFETY: every call is forwarded to the system allocator unchanged; only counters are added.
unsafe impl GlobalAlloc for Peak {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let p = unsafe { System.alloc(layout) };
        if !p.is_null() {
            let live = LIVE.fetch_add(layout.size(), Ordering::Relaxed) + layout.size();
            PEAK.fetch_max(live, Ordering::Relaxed);
        }
        p
    }
    unsafe fn dealloc(&self, p: *mut u8, layout: Layout) {
        unsafe { System.dealloc(p, layout) };
        LIVE.fetch_sub(layout.size(), Ordering::Relaxed);
    }
}

#[global_allocator]
static GLOBAL: Peak = Peak;

#[test]
fn a_hostile_drain_of_tiny_elements_is_read_in_bounded_memory() {
    const ELEMENTS: usize = 8 << 20;
    let mut body = Vec::with_capacity(2 * ELEMENTS + 2);
    body.push(b'[');
    for i in 0..ELEMENTS {
        if i > 0 {
            body.push(b',');
        }
        body.push(b'0');
    }
    body.push(b']');
    let before = LIVE.load(Ordering::Relaxed);
    PEAK.store(before, Ordering::Relaxed);
    kv_epp::fuzzing::trtllm_drain(&body);
    let extra = PEAK.load(Ordering::Relaxed) - before;
    // A tree of the body would be ~8M values of 32 bytes (256 MiB); one event at a time needs
    // the reader's own state only.
    assert!(
        extra < 1 << 20,
        "reading a {} MiB drain allocated {extra} bytes at its peak",
        body.len() >> 20
    );
}
