//! `make bench`: memory and time of decoding one vLLM KV event frame.
//!
//! For each frame: the PEAK heap growth while decoding it, as a multiple of the frame's size,
//! for kv-epp's streaming decoder (`events::vllm::decode_batch`, every event taken and dropped
//! in turn, as the subscriber does) and, as the baseline measured in the same run, for
//! `rmpv::decode::read_value_with_max_depth` on the same bytes (the value tree the decoder used
//! to build); then the decode time of the first over the second. Peaks come from a counting
//! global allocator. Fails if the streaming decoder's peak exceeds 4× any frame. Under `cargo
//! test --all-targets` (no `--bench` argument) it measures and checks only that peak.

#[path = "support/peak_alloc.rs"]
mod peak_alloc;
use peak_alloc::peak_of;

use std::hint::black_box;
use std::time::{Duration, Instant};

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

use kv_epp::events::vllm::{DecodeError, decode_batch};

#[global_allocator]
static ALLOC: peak_alloc::Counting = peak_alloc::Counting;

/// The decoder's caps this bench builds frames at (checked against the decoder below).
const MAX_BLOCKS_PER_EVENT: usize = 65_536;
const MAX_TOKENS_PER_EVENT: usize = 1_048_576;
/// rmpv's nesting limit, as the decoder used it.
const RMPV_MAX_DEPTH: usize = 16;
/// Wall time spent timing each decoder on each frame.
const TIME_BUDGET: Duration = Duration::from_millis(400);

/// Median time of `f` over repeated runs within [`TIME_BUDGET`] (at least 3 runs).
fn time_of(mut f: impl FnMut()) -> Duration {
    f(); // warm-up
    let mut runs = Vec::new();
    let start = Instant::now();
    while runs.len() < 3 || (start.elapsed() < TIME_BUDGET && runs.len() < 10_000) {
        let t = Instant::now();
        f();
        runs.push(t.elapsed());
    }
    runs.sort();
    runs[runs.len() / 2]
}

/// Decodes `frame` as the subscriber does: the header, then each event taken and dropped.
/// Returns the batch error, or per event whether it decoded.
fn stream(frame: &[u8]) -> Result<Vec<bool>, DecodeError> {
    let batch = decode_batch(frame)?;
    Ok(batch.events.map(|ev| black_box(ev).is_ok()).collect())
}

/// [`stream`] without keeping anything: the events that decoded.
fn drain(frame: &[u8]) -> Result<usize, DecodeError> {
    let batch = decode_batch(frame)?;
    Ok(batch.events.filter(|ev| black_box(ev).is_ok()).count())
}

/// rmpv's value tree of the whole frame.
fn tree(frame: &[u8]) {
    let mut rd = frame;
    let v = rmpv::decode::read_value_with_max_depth(&mut rd, RMPV_MAX_DEPTH);
    black_box(v.is_ok());
}

/// Raw msgpack, written piece by piece.
#[derive(Default)]
struct Frame(Vec<u8>);

impl Frame {
    fn array(&mut self, n: usize) -> &mut Self {
        rmp::encode::write_array_len(&mut self.0, n as u32).expect("encode");
        self
    }
    fn map(&mut self, n: usize) -> &mut Self {
        rmp::encode::write_map_len(&mut self.0, n as u32).expect("encode");
        self
    }
    fn str(&mut self, s: &str) -> &mut Self {
        rmp::encode::write_str(&mut self.0, s).expect("encode");
        self
    }
    fn uint(&mut self, v: u64) -> &mut Self {
        rmp::encode::write_uint(&mut self.0, v).expect("encode");
        self
    }
    fn nil(&mut self) -> &mut Self {
        rmp::encode::write_nil(&mut self.0).expect("encode");
        self
    }
    /// `[ts, [` with `events` to follow.
    fn batch(events: usize) -> Self {
        let mut f = Frame::default();
        f.array(3);
        rmp::encode::write_f64(&mut f.0, 1_700_000_000.25).expect("encode");
        f.array(events);
        f
    }
    /// `], rank]`.
    fn end(mut self) -> Vec<u8> {
        self.uint(0);
        self.0
    }
}

/// A full-width engine block hash (vLLM's are the low 64 bits of a SHA-256: 9 bytes on the wire).
fn engine_hash(rng: &mut SmallRng) -> u64 {
    rng.random::<u64>() | 1 << 63
}

/// 32 `BlockStored` of 64 blocks × 16 tokens, map layout as vLLM 0.33 publishes it (defaults
/// omitted, a salt on the first block of the first event).
fn realistic(rng: &mut SmallRng) -> Vec<u8> {
    const EVENTS: usize = 32;
    const BLOCKS: usize = 64;
    let mut f = Frame::batch(EVENTS);
    for e in 0..EVENTS {
        f.map(7).str("type").str("BlockStored");
        f.str("block_hashes").array(BLOCKS);
        for _ in 0..BLOCKS {
            f.uint(engine_hash(rng));
        }
        f.str("parent_block_hash");
        if e == 0 {
            f.nil()
        } else {
            f.uint(engine_hash(rng))
        };
        f.str("token_ids").array(BLOCKS * 16);
        for _ in 0..BLOCKS * 16 {
            f.uint(rng.random_range(0..152_000));
        }
        f.str("block_size").uint(16);
        f.str("medium").str("GPU");
        f.str("extra_keys").array(BLOCKS);
        if e == 0 {
            f.array(1).str("kvepp:tenant-a");
        } else {
            f.nil();
        }
        for _ in 1..BLOCKS {
            f.nil();
        }
    }
    f.end()
}

/// 4,194,304 nils as events: 4 MiB of junk (over the events cap, so rejected whole).
fn nils() -> Vec<u8> {
    const EVENTS: usize = 4 << 20;
    let mut f = Frame::batch(EVENTS);
    for _ in 0..EVENTS {
        f.nil();
    }
    f.end()
}

/// One event of an unknown type whose extra field holds 4,194,304 nils: 4 MiB the decoder must
/// walk (to validate the frame and reach the rank) and skip.
fn nils_in_one_event() -> Vec<u8> {
    const NILS: usize = 4 << 20;
    let mut f = Frame::batch(1);
    f.array(2).str("SomethingNew").array(NILS);
    for _ in 0..NILS {
        f.nil();
    }
    f.end()
}

/// One legacy-layout `BlockStored` with `tokens` positive fixints over `tokens / 16` blocks.
fn max_tokens(rng: &mut SmallRng, tokens: usize) -> Vec<u8> {
    let mut f = Frame::batch(1);
    f.array(5).str("BlockStored").array(tokens / 16);
    for _ in 0..tokens / 16 {
        f.uint(engine_hash(rng));
    }
    f.nil().array(tokens);
    for t in 0..tokens {
        f.uint(t as u64 % 128);
    }
    f.uint(16);
    f.end()
}

/// One `BlockRemoved` (map layout) with `blocks` full-width hashes.
fn max_blocks(rng: &mut SmallRng, blocks: usize) -> Vec<u8> {
    let mut f = Frame::batch(1);
    f.map(2).str("type").str("BlockRemoved");
    f.str("block_hashes").array(blocks);
    for _ in 0..blocks {
        f.uint(engine_hash(rng));
    }
    f.end()
}

/// One measured frame and what the streaming decoder must make of it.
struct Case {
    name: &'static str,
    frame: Vec<u8>,
    expect: Result<Vec<bool>, DecodeError>,
}

/// A byte count in KiB below 1 MiB, in MiB above.
fn mib(bytes: usize) -> String {
    if bytes < 1 << 20 {
        format!("{:.1} KiB", bytes as f64 / 1024.0)
    } else {
        format!("{:.2} MiB", bytes as f64 / f64::from(1 << 20))
    }
}

fn main() {
    // `cargo test --all-targets` runs this binary without `--bench`: then only the streaming
    // decoder's peaks are measured and checked (no rmpv baseline, no timing).
    let full = std::env::args().any(|a| a == "--bench");
    if !full {
        println!("(smoke run; `cargo bench --bench decode` adds the rmpv baseline and times)");
    }
    let mut rng = SmallRng::seed_from_u64(13);

    // The frames below sit exactly at the decoder's caps: one more is rejected.
    for (frame, what, limit) in [
        (
            max_tokens(&mut rng, MAX_TOKENS_PER_EVENT + 1),
            "token_ids",
            MAX_TOKENS_PER_EVENT,
        ),
        (
            max_blocks(&mut rng, MAX_BLOCKS_PER_EVENT + 1),
            "block_hashes",
            MAX_BLOCKS_PER_EVENT,
        ),
    ] {
        let first = decode_batch(&frame).expect("batch").events.next();
        assert_eq!(first, Some(Err(DecodeError::TooMany { what, limit })));
    }

    let cases = [
        Case {
            name: "realistic: 32 BlockStored × 64 blocks × 16 tokens, map",
            frame: realistic(&mut rng),
            expect: Ok(vec![true; 32]),
        },
        Case {
            name: "4M nils as events (4 MiB)",
            frame: nils(),
            expect: Err(DecodeError::TooMany {
                what: "events",
                limit: 65_536,
            }),
        },
        Case {
            name: "4M nils in one unknown event's field (4 MiB)",
            frame: nils_in_one_event(),
            expect: Ok(vec![true]),
        },
        Case {
            name: "1 BlockStored: 1,048,576 fixint tokens, 65,536 blocks",
            frame: max_tokens(&mut rng, MAX_TOKENS_PER_EVENT),
            expect: Ok(vec![true]),
        },
        Case {
            name: "1 BlockRemoved: 65,536 u64 block hashes",
            frame: max_blocks(&mut rng, MAX_BLOCKS_PER_EVENT),
            expect: Ok(vec![true]),
        },
    ];

    println!("Decoding one vLLM KV event frame: peak heap growth ÷ frame size; time new ÷ rmpv.");
    println!(
        "{:<56} {:>10} {:>20} {:>20} {:>30}",
        "frame", "size", "streaming peak", "rmpv tree peak", "time streaming/rmpv"
    );
    let mut worst = 0.0f64;
    for case in &cases {
        let frame = &case.frame;
        let got = stream(frame);
        assert_eq!(got, case.expect, "{}", case.name);
        drop(got);
        let (new_peak, ()) = peak_of(|| {
            black_box(drain(frame)).ok();
        });
        let size = frame.len() as f64;
        let new_x = new_peak as f64 / size;
        worst = worst.max(new_x);
        let (baseline, time) = if full {
            let (old_peak, _) = peak_of(|| tree(frame));
            let new_time = time_of(|| {
                black_box(drain(frame)).ok();
            });
            let old_time = time_of(|| tree(frame));
            (
                format!("{:.2}× ({})", old_peak as f64 / size, mib(old_peak)),
                format!(
                    "{:.2}× ({:.2?} / {:.2?})",
                    new_time.as_secs_f64() / old_time.as_secs_f64(),
                    new_time,
                    old_time
                ),
            )
        } else {
            ("-".into(), "-".into())
        };
        println!(
            "{:<56} {:>10} {:>20} {:>20} {:>30}",
            case.name,
            mib(frame.len()),
            format!("{new_x:.2}× ({})", mib(new_peak)),
            baseline,
            time,
        );
        assert!(
            new_x <= 4.0,
            "{}: streaming peak {new_x:.2}× the frame, over 4×",
            case.name
        );
    }
    println!("streaming decoder: worst peak {worst:.2}× the frame (bound: 4×)");
}
