//! Engines' JSON is read typed as it arrives, never into a JSON tree (a `serde_json::Value` per
//! element, ~17x the bytes): a hostile engine's response must not cost memory in proportion to
//! its bytes. A TensorRT-LLM drain (16 MiB here) is read one event at a time, whether it is 8
//! million tiny elements (`[0,0,0,...]`, each refused as read) or one huge event; an SGLang
//! `/server_info` answer (up to 1 MiB) keeps only its `kv_events` fields. This binary's
//! allocator tracks the peak of live heap bytes while each body is read.

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

/// The peak of live heap bytes, over what was live before, while `read` reads `body`.
fn peak_of(read: fn(&[u8]), body: &[u8]) -> usize {
    let before = LIVE.load(Ordering::Relaxed);
    PEAK.store(before, Ordering::Relaxed);
    read(body);
    PEAK.load(Ordering::Relaxed) - before
}

/// One JSON array of `n` copies of `element`, inside `open` and `close`.
fn repeated(open: &str, element: &str, n: usize, close: &str) -> Vec<u8> {
    let mut body = Vec::with_capacity(open.len() + n * (element.len() + 1) + close.len());
    body.extend_from_slice(open.as_bytes());
    for i in 0..n {
        if i > 0 {
            body.push(b',');
        }
        body.extend_from_slice(element.as_bytes());
    }
    body.extend_from_slice(close.as_bytes());
    body
}

// One test (the allocator's counters are the process's): each hostile body in turn, made just
// before it is read (a few at once would crowd the machine).
#[test]
fn hostile_bodies_are_read_in_bounded_memory() {
    use kv_epp::fuzzing::{server_info, trtllm_drain};
    type Case = (&'static str, fn(&[u8]), fn() -> Vec<u8>, fn(usize) -> usize);
    let cases: [Case; 5] = [
        // 8 million tiny elements: a tree of the body would be ~8M values of 32 bytes (256
        // MiB); one event at a time needs the reader's own state only.
        (
            "a drain of tiny elements",
            trtllm_drain,
            || repeated("[", "0", 8 << 20, "]"),
            |_| 1 << 20,
        ),
        // One event of 16 MiB, a `removed` of 8 million hashes: as a tree, ~17x its bytes;
        // read typed, it is dropped at the 65,536 hashes an event may carry (512 KiB decoded).
        (
            "one removal",
            trtllm_drain,
            || {
                repeated(
                    r#"[{"data": {"type": "removed", "block_hashes": ["#,
                    "0",
                    8 << 20,
                    "]}}]",
                )
            },
            |_| 1 << 20,
        ),
        // One `stored` event of ~16 MiB of full 4-token blocks (the block size the fuzzing
        // entry point reads with): dropped past the 65,536 blocks an event may carry, so its
        // decoded blocks (24 bytes each, 1.5 MiB at the cap) are the peak, not a tree of it.
        (
            "one stored event",
            trtllm_drain,
            || {
                repeated(
                    r#"[{"data": {"type": "stored", "blocks": ["#,
                    BLOCK,
                    (16 << 20) / BLOCK.len(),
                    "]}}]",
                )
            },
            |_| 4 << 20,
        ),
        // 16 MiB of the smallest events that are kept (a removal of one hash, ~47 bytes each,
        // ~150 bytes decoded): kept up to the body's size, the rest dropped and counted, so
        // the events kept (and their list's spare room) stay under twice the body; all of
        // them, ~6x.
        (
            "tiny kept events",
            trtllm_drain,
            || repeated("[", TINY, (16 << 20) / TINY.len(), "]"),
            |len| 2 * len,
        ),
        // A 1 MiB `/server_info` of tiny elements beside a valid `kv_events`: as a tree, ~24
        // MiB; read typed, the topic is all it keeps.
        (
            "a /server_info",
            server_info,
            || {
                repeated(
                    r#"{"kv_events": {"publisher": "zmq", "endpoint_port_base": 5557, "topic": "kv"}, "x": ["#,
                    "0",
                    (1 << 20) / 2 - 64,
                    "]}",
                )
            },
            |_| 64 << 10,
        ),
    ];
    for (what, read, body, limit) in cases {
        let body = body();
        let extra = peak_of(read, &body);
        assert!(
            extra < limit(body.len()),
            "reading {what} of {} KiB allocated {extra} bytes at its peak",
            body.len() >> 10
        );
    }
}

/// A full 4-token block.
const BLOCK: &str =
    r#"{"tokens":[{"token_id":1},{"token_id":2},{"token_id":3},{"token_id":4}],"block_hash":7}"#;
/// The smallest event a drain keeps.
const TINY: &str = r#"{"data":{"type":"removed","block_hashes":[1]}}"#;
