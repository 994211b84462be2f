//! `make bench`: kv-epp's KV index beside the peers' published index crates, on one op stream.
//!
//! Systems: kv-epp's `KvIndex`; NVIDIA Dynamo's `dynamo-kv-router` 1.6.1 (`RadixTree`, its
//! single-threaded tree, and `ConcurrentRadixTreeCompressed`, its shared tree); SMG's
//! `smg-radix-tree` 0.1.0 (`RadixTree`). Each is driven through its public API.
//!
//! The op stream comes from the Mooncake trace (`--trace PATH`, default
//! `../shared/data/mooncake_synthetic_trace.jsonl` from the repository root; a small synthetic
//! trace when neither exists, which is also what the smoke run under `cargo test` uses). Each
//! trace hash id becomes a deterministic 512-token block; every prompt starts with one shared
//! system-prompt block, which every worker holds (stored on every worker first), under each
//! tenant's salt. Requests go to the worker holding their longest prefix beyond that block
//! (round-robin when none does), as a KV router would place them; the worker then stores the
//! blocks it did not hold, continuing the prefix it held, as an engine announces them.
//!
//! Applying charges every system the same work outside its index. A stored event carries
//! tokens, and each system's time includes computing the blocks' local hashes from them with the
//! hash it would use: kv-epp's `store` calls its own `hash_block` (its AVX2 loop for these
//! 2 KiB blocks, where the CPU has AVX2); for the peers the loop calls `xxhash-rust`'s XXH3-64
//! over the same bytes in place, which is what Dynamo's block hash computes (smg takes the
//! caller's hashes). Both give the same value. Everything else a system's API wants (kv-epp's engine-hash slice,
//! smg's (engine, local) pairs, Dynamo's `RouterEvent`s) is built before the clock starts, as a
//! decoder would hand it over; the peers' local hashes are written into it inside the timed loop.
//! Dynamo's concurrent tree is written through its public path, its worker loop on a thread of
//! its own fed by a channel (a chunk's events, the last acknowledged).
//!
//! Queries are timed on prehashed prompts for every system (local hashes for the peers, in
//! Dynamo's type for Dynamo, so no conversion is charged to it; sequence hashes for kv-epp).
//!
//! Apply per core: each system is built afresh `apply_reps` times (5; 1 with `--quick` and in
//! the smoke run), with the counting allocator switched off (its shared counters would charge
//! the systems that allocate more; memory is counted on one more, untimed build), and the
//! stream applied in chunks of ~128 KiB of tokens (~64 blocks); each chunk's tokens are read
//! just before its clock starts (in service an event's tokens were just decoded when it is
//! applied, so hashing reads cache, not memory), and the process's CPU time
//! (`CLOCK_PROCESS_CPUTIME_ID`: every thread, Dynamo's worker loop included) and the wall clock
//! are summed over the chunks, less what the same loop costs with nothing to apply (the clock
//! reads, ~0.3 µs each here). The figure is blocks per CPU-second of the build with the least
//! CPU time; blocks per wall-second are printed beside it. The local hashes alone, timed the same
//! way, are printed too (the peers' and kv-epp's): what each system pays before its own work.
//!
//! Readers: one, then two threads query a window (400 ms, best of three), pinned to different
//! CPUs (`--no-pin`: left to the scheduler), each reading its own CPU time
//! (`CLOCK_THREAD_CPUTIME_ID`). Two readers over one is printed as throughput and as throughput
//! per reader-CPU-second: the first needs a free core per reader, the second does not (it drops
//! only with contention between the readers), and the readers' CPU share says which case a run
//! was in. A yardstick with nothing shared (each thread reading random words of its own 16 MiB
//! array) shows what the machine gives two threads at that moment.
//!
//! Exact answers are a precondition: every system's answer to every prompt is compared with a
//! naive model (per worker, the set of prefixes it holds) before any figure is printed; a system
//! that differs is reported as inexact and its figures are not printed.
//!
//! Figures (all as ratios to the peers, same run): query p50/p99, memory per (worker, block) from
//! a counting allocator (plus kv-epp's directly mapped tables) after reclamation, apply per
//! CPU-second, and query throughput with two reader threads over one.

use std::collections::{HashMap, HashSet};
use std::hint::black_box;
use std::net::SocketAddr;
use std::ops::Range;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use dynamo_kv_router::indexer::{SyncIndexer, WorkerTask};
use dynamo_kv_router::protocols::{
    ExternalSequenceBlockHash, KvCacheEvent, KvCacheEventData, KvCacheStoreData,
    KvCacheStoredBlockData, LocalBlockHash, RouterEvent,
};
use dynamo_kv_router::{ConcurrentRadixTreeCompressed, radix_tree::RadixTree as DynamoTree};
use kv_epp_core::hashing::{HashSeed, SequenceHash, chain, hash_block};
use kv_epp_core::index::holders::MAPPED_BYTES;
use kv_epp_core::index::{EngineBlockHash, IndexLimits, KvIndex, Medium, QueryAnswer, StoreBlocks};
use kv_epp_core::worker::WorkerId;
use radix_tree::{Config as SmgConfig, HolderId, OverlapScratch, RadixTree as SmgTree};

#[path = "../../support/peak_alloc.rs"]
mod peak_alloc;

#[global_allocator]
static ALLOC: Alloc = Alloc;

/// Whether allocations are counted now (off while apply is timed, see [`measure`]).
static COUNTING: AtomicBool = AtomicBool::new(true);

/// The counting allocator, which can be switched off: its counters are shared atomics, two
/// updates per allocation, which would charge the systems that allocate more for the bench's
/// bookkeeping (measured: ~7% of Dynamo's `RadixTree` apply, ~2% of kv-epp's).
struct Alloc;

// SAFETY: delegates every call to an allocator that upholds the contract (the system's, or the
// counting one over it); a block is freed by the one that allocated it as long as no block
// allocated uncounted is freed while counting, which `measure` ensures.
unsafe impl std::alloc::GlobalAlloc for Alloc {
    unsafe fn alloc(&self, l: std::alloc::Layout) -> *mut u8 {
        // SAFETY: forwarded unchanged.
        unsafe {
            if COUNTING.load(Ordering::Relaxed) {
                peak_alloc::Counting.alloc(l)
            } else {
                std::alloc::System.alloc(l)
            }
        }
    }
    unsafe fn alloc_zeroed(&self, l: std::alloc::Layout) -> *mut u8 {
        // SAFETY: forwarded unchanged.
        unsafe {
            if COUNTING.load(Ordering::Relaxed) {
                peak_alloc::Counting.alloc_zeroed(l)
            } else {
                std::alloc::System.alloc_zeroed(l)
            }
        }
    }
    unsafe fn dealloc(&self, p: *mut u8, l: std::alloc::Layout) {
        // SAFETY: forwarded unchanged.
        unsafe {
            if COUNTING.load(Ordering::Relaxed) {
                peak_alloc::Counting.dealloc(p, l)
            } else {
                std::alloc::System.dealloc(p, l)
            }
        }
    }
    unsafe fn realloc(&self, p: *mut u8, l: std::alloc::Layout, new: usize) -> *mut u8 {
        // SAFETY: forwarded unchanged.
        unsafe {
            if COUNTING.load(Ordering::Relaxed) {
                peak_alloc::Counting.realloc(p, l, new)
            } else {
                std::alloc::System.realloc(p, l, new)
            }
        }
    }
}

fn live_bytes() -> usize {
    peak_alloc::live() + MAPPED_BYTES.load(Ordering::Relaxed)
}

/// Tokens per block: the Mooncake trace's hash ids each stand for 512 tokens.
const BLOCK: usize = 512;
/// The trace hash id standing for the shared system prompt (outside the trace's id range).
const SYSTEM_BLOCK: u64 = u64::MAX;

struct Settings {
    query_rounds: usize,
    reader_window: Duration,
    /// Fresh builds per system whose apply is timed (the lowest CPU time counts).
    apply_reps: usize,
    /// Reader threads pinned to different cores (`--no-pin`: left to the scheduler).
    pin: bool,
    /// `--apply-only`: apply figures only (to profile apply).
    apply_only: bool,
    /// `--only NAME`: measure only that system (for profiling under callgrind); no ratios.
    only: Option<String>,
    /// `--no-readers`: no reader windows, so a profile's queries are the timed ones alone (a
    /// fixed set, unlike the windows', whose count depends on the speed).
    readers: bool,
    /// `--tail`: what the slowest queries are (each prompt's fastest time, and the shapes of
    /// the prompts slowest at their fastest), to tell a structural tail from noise.
    tail: bool,
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    // `cargo test` runs bench targets without `--bench`: a quick smoke run then.
    let smoke = !args.iter().any(|a| a == "--bench");
    let quick = args.iter().any(|a| a == "--quick");
    let trace_arg = args
        .iter()
        .position(|a| a == "--trace")
        .and_then(|i| args.get(i + 1))
        .cloned();
    let settings = Settings {
        query_rounds: if smoke { 200 } else { 20_000 },
        reader_window: Duration::from_millis(if smoke { 20 } else { 400 }),
        // `--apply-reps N`: more builds (to profile apply under perf or callgrind).
        apply_reps: args
            .iter()
            .position(|a| a == "--apply-reps")
            .and_then(|i| args.get(i + 1)?.parse().ok())
            .unwrap_or(if smoke || quick { 1 } else { 5 }),
        pin: !args.iter().any(|a| a == "--no-pin"),
        apply_only: args.iter().any(|a| a == "--apply-only"),
        only: args
            .iter()
            .position(|a| a == "--only")
            .and_then(|i| args.get(i + 1))
            .cloned(),
        readers: !args.iter().any(|a| a == "--no-readers"),
        tail: args.iter().any(|a| a == "--tail"),
    };
    let default_trace = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../../shared/data/mooncake_synthetic_trace.jsonl"
    );
    let (name, trace) = match (smoke, trace_arg) {
        (true, _) => ("synthetic (smoke run)".to_string(), synthetic_trace(120)),
        (false, Some(p)) => (
            p.clone(),
            read_trace(&p).unwrap_or_else(|e| panic!("{p}: {e}")),
        ),
        (false, None) => match read_trace(default_trace) {
            Ok(t) => ("shared/data/mooncake_synthetic_trace.jsonl".to_string(), t),
            Err(_) => (
                "synthetic (no trace found)".to_string(),
                synthetic_trace(2000),
            ),
        },
    };
    println!(
        "KV index side by side: kv-epp vs dynamo-kv-router 1.6.1 and smg-radix-tree 0.1.0\n\
         trace: {name}, {} requests, {BLOCK}-token blocks, a shared system-prompt block on every worker\n",
        trace.len()
    );
    if settings.only.is_none() {
        hashing(smoke);
        machine_scaling(&settings);
    }
    // `--shape WORKERS,TENANTS`: that shape alone (to profile it).
    let shape = args
        .iter()
        .position(|a| a == "--shape")
        .and_then(|i| args.get(i + 1))
        .and_then(|v| v.split_once(','))
        .and_then(|(w, t)| Some((w.parse().ok()?, t.parse().ok()?)));
    let shapes: &[(usize, usize)] = if smoke {
        &[(8, 2)]
    } else if let Some(shape) = &shape {
        std::slice::from_ref(shape)
    } else if quick {
        &[(256, 1)]
    } else {
        &[(64, 1), (64, 4), (256, 1), (256, 4)]
    };
    for &(workers, tenants) in shapes {
        run_shape(&trace, workers, tenants, &settings);
    }
    if smoke {
        println!("(smoke run; `make bench` runs the full comparison)");
    }
}

/// kv-epp's salted local + chained block hashes against raw XXH3 over the same token bytes
/// (goal: >= 0.6x of raw), for 16- and 512-token blocks, the tokens hashed as prompts of 8,192
/// tokens, as the query path hashes one request's prompt (as `benches/core.rs` does). One
/// 1M-token prompt is printed beside it: its two 512 KB output lists are returned to the kernel
/// after every call, so it also pays page faults, which are not hashing (no request is that long).
fn hashing(smoke: bool) {
    const PROMPT: usize = 8192;
    use kv_epp_core::hashing::prompt_hashes;
    let n = if smoke { 1 << 14 } else { 1 << 20 };
    let mut rng = 1u64;
    let tokens: Vec<u32> = (0..n)
        .map(|_| (splitmix(&mut rng) % 128_000) as u32)
        .collect();
    let bytes: Vec<u8> = tokens.iter().flat_map(|t| t.to_le_bytes()).collect();
    let seed = HashSeed::new(Some("adapter"), Some("tenant-a"));
    let best = |f: &mut dyn FnMut()| {
        (0..if smoke { 1 } else { 15 })
            .map(|_| {
                let t = Instant::now();
                f();
                t.elapsed()
            })
            .min()
            .unwrap_or_default()
    };
    for block in [16usize, 512] {
        let raw = best(&mut || {
            let mut acc = 0u64;
            for chunk in bytes.chunks_exact(block * 4) {
                acc ^= xxhash_rust::xxh3::xxh3_64_with_seed(chunk, seed.0);
            }
            black_box(acc);
        });
        let full = best(&mut || {
            for prompt in tokens.chunks(PROMPT) {
                black_box(prompt_hashes(prompt, block, seed));
            }
        });
        let whole = best(&mut || {
            black_box(prompt_hashes(&tokens, block, seed));
        });
        let ratio = raw.as_secs_f64() / full.as_secs_f64();
        println!(
            "hashing, {block}-token blocks: local + chained {:.0} MB/s vs raw xxh3_64 {:.0} MB/s: {ratio:.2}x of raw (goal >= 0.6: {}); \
             one 1M-token prompt {:.2}x (page faults on its output)",
            bytes.len() as f64 / full.as_secs_f64() / 1e6,
            bytes.len() as f64 / raw.as_secs_f64() / 1e6,
            if ratio >= 0.6 { "met" } else { "NOT met" },
            raw.as_secs_f64() / whole.as_secs_f64(),
        );
    }
    // The long-input XXH3 alone, on blocks in cache (256 KiB, hashed over and over): kv-epp's
    // dispatching `xxh3_64` (AVX2 where the CPU has it) against `xxhash-rust`'s.
    let hot = &bytes[..bytes.len().min(256 * 1024)];
    for block in [256usize, 2048, 8192] {
        let rounds = if smoke { 1 } else { 64 };
        let run = |f: &dyn Fn(&[u8]) -> u64| {
            best(&mut || {
                let mut acc = 0u64;
                for _ in 0..rounds {
                    for chunk in hot.chunks_exact(block) {
                        acc ^= f(black_box(chunk));
                    }
                }
                black_box(acc);
            })
        };
        let ours = run(&|b| kv_epp_core::hashing::xxh3_64(b, seed.0));
        let theirs = run(&|b| xxhash_rust::xxh3::xxh3_64_with_seed(b, seed.0));
        let rate = |t: Duration| (hot.len() * rounds) as f64 / t.as_secs_f64() / 1e9;
        println!(
            "XXH3-64 of {block}-byte inputs in cache: kv-epp's {:.1} GB/s, xxhash-rust's {:.1} GB/s: {:.2}x",
            rate(ours),
            rate(theirs),
            theirs.as_secs_f64() / ours.as_secs_f64()
        );
    }
    println!();
}

/// One request: the trace's hash ids of its prompt.
type Request = Vec<u64>;

fn read_trace(path: &str) -> Result<Vec<Request>, String> {
    let text = std::fs::read_to_string(path).map_err(|e| e.to_string())?;
    let mut out = Vec::new();
    for line in text.lines().filter(|l| !l.trim().is_empty()) {
        let v: serde_json::Value = serde_json::from_str(line).map_err(|e| e.to_string())?;
        let ids = v["hash_ids"]
            .as_array()
            .ok_or("a line without hash_ids")?
            .iter()
            .map(|x| x.as_u64().ok_or("a hash id that is not a u64"))
            .collect::<Result<Vec<_>, _>>()?;
        out.push(ids);
    }
    Ok(out)
}

/// Conversations that share prefixes, shaped like the trace (ids reused by later turns).
fn synthetic_trace(n: usize) -> Vec<Request> {
    let mut rng = 7u64;
    let mut next_id = 0u64;
    let mut sessions: Vec<Vec<u64>> = Vec::new();
    let mut out = Vec::new();
    for _ in 0..n {
        let r = splitmix(&mut rng);
        if !sessions.is_empty() && !r.is_multiple_of(3) {
            let s = (r >> 8) as usize % sessions.len();
            let grow = 1 + (r >> 20) as usize % 4;
            for _ in 0..grow {
                sessions[s].push(next_id);
                next_id += 1;
            }
            out.push(sessions[s].clone());
        } else {
            let len = 2 + (r >> 8) as usize % 12;
            let ids: Vec<u64> = (next_id..next_id + len as u64).collect();
            next_id += len as u64;
            sessions.push(ids.clone());
            out.push(ids);
        }
    }
    out
}

fn splitmix(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// The 512 tokens a trace hash id stands for (deterministic in the id).
fn block_tokens(id: u64, out: &mut Vec<u32>) {
    let mut s = id ^ 0x5bd1_e995;
    out.extend((0..BLOCK).map(|_| (splitmix(&mut s) % 128_000) as u32));
}

/// A stored-blocks event, owned: what every system applies.
struct StoreEvent {
    worker: usize,
    tenant: usize,
    /// Engine hash of the parent block (`None`: the run starts the sequence).
    parent: Option<u64>,
    engine_hashes: Vec<u64>,
    tokens: Vec<u32>,
}

/// A prompt, prehashed for each system.
struct Prompt {
    /// Sequence hashes (kv-epp).
    seqs: Vec<SequenceHash>,
    /// Local hashes (the peers).
    locals: Vec<u64>,
    /// The same, as Dynamo's type (so a Dynamo query does not pay for a conversion).
    dyn_locals: Vec<LocalBlockHash>,
}

/// The op stream of one shape, with the naive model's final state.
struct Stream {
    events: Vec<StoreEvent>,
    prompts: Vec<Prompt>,
    /// Per worker, the sequence hashes it holds (the naive model).
    held: Vec<HashSet<u64>>,
    pairs: usize,
}

fn seeds(tenants: usize) -> Vec<HashSeed> {
    (0..tenants)
        .map(|t| {
            if tenants == 1 {
                HashSeed::UNSALTED
            } else {
                HashSeed::new(None, Some(&format!("tenant-{t}")))
            }
        })
        .collect()
}

/// The engine's opaque hash of a block: a function of its prefix, distinct from ours.
fn engine_hash(seq: u64) -> u64 {
    seq ^ 0xe6e6_e6e6_0000_0001
}

fn build_stream(trace: &[Request], workers: usize, tenants: usize) -> Stream {
    let seeds = seeds(tenants);
    let mut locals_cache: HashMap<(usize, u64), u64> = HashMap::new();
    let mut scratch = Vec::with_capacity(BLOCK);
    let mut local = |tenant: usize, id: u64| -> u64 {
        *locals_cache.entry((tenant, id)).or_insert_with(|| {
            scratch.clear();
            block_tokens(id, &mut scratch);
            hash_block(&scratch, seeds[tenant]).0
        })
    };
    let mut held: Vec<HashSet<u64>> = vec![HashSet::new(); workers];
    let mut events = Vec::new();
    let mut prompts = Vec::new();
    let mut next_rr = 0usize;
    let emit = |w: usize,
                tenant: usize,
                ids: &[u64],
                seqs: &[u64],
                held: &mut Vec<HashSet<u64>>,
                events: &mut Vec<StoreEvent>| {
        let first_new = seqs.iter().position(|s| !held[w].contains(s));
        let Some(b) = first_new else { return };
        let mut tokens = Vec::with_capacity((ids.len() - b) * BLOCK);
        for &id in &ids[b..] {
            block_tokens(id, &mut tokens);
        }
        for &s in &seqs[b..] {
            held[w].insert(s);
        }
        events.push(StoreEvent {
            worker: w,
            tenant,
            parent: (b > 0).then(|| engine_hash(seqs[b - 1])),
            engine_hashes: seqs[b..].iter().map(|&s| engine_hash(s)).collect(),
            tokens,
        });
    };
    // The shared system prompt on every worker, under every tenant.
    for t in 0..tenants {
        let s = local(t, SYSTEM_BLOCK);
        for w in 0..workers {
            emit(w, t, &[SYSTEM_BLOCK], &[s], &mut held, &mut events);
        }
    }
    for (i, req) in trace.iter().enumerate() {
        let tenant = i % tenants;
        let mut ids = Vec::with_capacity(req.len() + 1);
        ids.push(SYSTEM_BLOCK);
        ids.extend_from_slice(req);
        let locals: Vec<u64> = ids.iter().map(|&id| local(tenant, id)).collect();
        let mut seqs = Vec::with_capacity(locals.len());
        let mut prev: Option<SequenceHash> = None;
        for &l in &locals {
            let s = match prev {
                None => SequenceHash(l),
                Some(p) => chain(p, kv_epp_core::hashing::LocalBlockHash(l)),
            };
            seqs.push(s.0);
            prev = Some(s);
        }
        // The worker holding the longest prefix beyond the system block, else round-robin.
        let (best, depth) = (0..workers)
            .map(|w| (w, seqs.iter().take_while(|s| held[w].contains(s)).count()))
            .max_by_key(|&(w, d)| (d, std::cmp::Reverse(w)))
            .unwrap_or((0, 0));
        let w = if depth > 1 {
            best
        } else {
            next_rr = (next_rr + 1) % workers;
            next_rr
        };
        emit(w, tenant, &ids, &seqs, &mut held, &mut events);
        prompts.push(Prompt {
            seqs: seqs.iter().map(|&s| SequenceHash(s)).collect(),
            dyn_locals: locals.iter().map(|&l| LocalBlockHash(l)).collect(),
            locals,
        });
    }
    let pairs = held.iter().map(HashSet::len).sum();
    Stream {
        events,
        prompts,
        held,
        pairs,
    }
}

/// The exact answer: each worker's count of leading prompt blocks held, workers with none omitted.
fn naive(stream: &Stream, p: &Prompt) -> Vec<(usize, u32)> {
    let mut out: Vec<(usize, u32)> = stream
        .held
        .iter()
        .enumerate()
        .map(|(w, h)| {
            (
                w,
                p.seqs.iter().take_while(|s| h.contains(&s.0)).count() as u32,
            )
        })
        .filter(|&(_, d)| d > 0)
        .collect();
    out.sort_unstable();
    out
}

/// One system under test.
trait Index: Sync {
    fn name(&self) -> &'static str;
    /// Builds this system's form of every event, all but the blocks' local hashes (untimed:
    /// what a decoder would hand it).
    fn prepare(&mut self, stream: &Stream);
    /// Applies the prepared events `range` (timed, in order, the whole stream over the calls):
    /// for each event, the local hash of each block's tokens (kv-epp's `store` computes it
    /// itself; for the peers this loop does, with [`local_hashes`]), then the system's own
    /// update.
    fn apply(&mut self, stream: &Stream, range: Range<usize>, seeds: &[HashSeed]);
    /// Frees whatever `prepare` built (untimed).
    fn finish(&mut self) {}
    /// The answer, as (worker index, leading blocks), sorted.
    fn answer(&self, p: &Prompt) -> Vec<(usize, u32)>;
    /// One query, as the hot path runs it (reusing whatever the API lets a caller reuse).
    fn query(&self, p: &Prompt, reuse: &mut Reuse);
    /// Whether two threads may query it at once.
    fn shared_reads(&self) -> bool {
        true
    }
}

/// Per-thread buffers a caller can keep between queries.
#[derive(Default)]
struct Reuse {
    kv: QueryAnswer,
    smg_scratch: OverlapScratch,
    smg_out: Vec<radix_tree::Overlap>,
}

/// The local hashes of an event's blocks, as the peers are charged them: the hash they use,
/// `xxhash-rust`'s XXH3-64 over the tokens' little-endian bytes, read in place (what Dynamo's
/// `compute_block_hash_for_seq` computes; smg takes whatever its caller computes). The value
/// equals kv-epp's `hash_block`, which for blocks over 60 tokens runs its own AVX2 loop.
fn local_hashes(ev: &StoreEvent, seed: HashSeed) -> impl Iterator<Item = u64> + '_ {
    ev.tokens
        .chunks_exact(BLOCK)
        .map(move |b| xxhash_rust::xxh3::xxh3_64_with_seed(le_bytes(b), seed.0))
}

/// The tokens' bytes in place (little-endian targets only, as the peers' hashes read them).
fn le_bytes(tokens: &[u32]) -> &[u8] {
    const { assert!(cfg!(target_endian = "little")) };
    // SAFETY: u32 has no padding and u8 has alignment 1: the same memory, 4x the length.
    unsafe {
        std::slice::from_raw_parts(tokens.as_ptr().cast::<u8>(), std::mem::size_of_val(tokens))
    }
}

struct KvEpp {
    index: KvIndex,
    ids: Vec<WorkerId>,
    by_id: HashMap<WorkerId, usize>,
    /// Prepared: each event's engine hashes in the index's type.
    pending: Vec<Vec<EngineBlockHash>>,
}

impl KvEpp {
    fn new(workers: usize) -> Self {
        let ids: Vec<WorkerId> = (0..workers)
            .map(|i| {
                let addr: SocketAddr = format!("10.0.{}.{}:8000", i / 256, i % 256)
                    .parse()
                    .expect("address");
                WorkerId::new(addr)
            })
            .collect();
        let index = KvIndex::new(BLOCK, IndexLimits::default());
        for id in &ids {
            index.add_worker(*id);
        }
        let by_id = ids.iter().enumerate().map(|(i, w)| (*w, i)).collect();
        KvEpp {
            index,
            ids,
            by_id,
            pending: Vec::new(),
        }
    }
}

impl Index for KvEpp {
    fn name(&self) -> &'static str {
        "kv-epp"
    }
    fn prepare(&mut self, stream: &Stream) {
        self.pending = stream
            .events
            .iter()
            .map(|ev| {
                ev.engine_hashes
                    .iter()
                    .map(|&h| EngineBlockHash(h))
                    .collect()
            })
            .collect();
    }
    fn apply(&mut self, stream: &Stream, range: Range<usize>, seeds: &[HashSeed]) {
        for (ev, hashes) in stream.events[range.clone()]
            .iter()
            .zip(&self.pending[range])
        {
            self.index
                .store(
                    &self.ids[ev.worker],
                    &StoreBlocks {
                        parent: ev.parent.map(EngineBlockHash),
                        root_seed: Some(seeds[ev.tenant]),
                        engine_hashes: hashes,
                        tokens: &ev.tokens,
                        medium: Medium::Device,
                    },
                )
                .expect("store");
        }
    }
    fn finish(&mut self) {
        self.pending = Vec::new();
    }
    fn answer(&self, p: &Prompt) -> Vec<(usize, u32)> {
        // The timed path's answer (compact, slots resolved afterwards) must equal the rows
        // `query` returns, and both the naive model's.
        let mut compact = QueryAnswer::default();
        self.index.query_compact(&p.seqs, &mut compact);
        let mut out: Vec<(usize, u32)> = compact
            .rows()
            .map(|(slot, _, total)| {
                let w = self.index.worker_at(&compact, slot).expect("registered");
                (self.by_id[&w], total)
            })
            .collect();
        out.sort_unstable();
        let mut rows: Vec<(usize, u32)> = self
            .index
            .query(&p.seqs)
            .iter()
            .map(|o| (self.by_id[&o.worker], o.total_blocks))
            .collect();
        rows.sort_unstable();
        assert_eq!(out, rows, "compact and row answers agree");
        out
    }
    fn query(&self, p: &Prompt, reuse: &mut Reuse) {
        self.index.query_compact(&p.seqs, &mut reuse.kv);
        black_box(&reuse.kv);
    }
}

struct Smg {
    tree: SmgTree,
    holders: Vec<HolderId>,
    index_of: HashMap<HolderId, usize>,
    /// Prepared: each event's (engine hash, local hash) pairs, local hashes not yet computed.
    pending: Vec<Vec<(u64, u64)>>,
}

impl Smg {
    fn new(workers: usize) -> Self {
        let mut tree = SmgTree::new(SmgConfig::default());
        let holders: Vec<HolderId> = (0..workers)
            .map(|i| tree.create_holder(&format!("worker-{i}")))
            .collect();
        let index_of = holders.iter().enumerate().map(|(i, h)| (*h, i)).collect();
        Smg {
            tree,
            holders,
            index_of,
            pending: Vec::new(),
        }
    }
}

impl Index for Smg {
    fn name(&self) -> &'static str {
        "smg-radix-tree"
    }
    fn prepare(&mut self, stream: &Stream) {
        self.pending = stream
            .events
            .iter()
            .map(|ev| ev.engine_hashes.iter().map(|&h| (h, 0)).collect())
            .collect();
    }
    fn apply(&mut self, stream: &Stream, range: Range<usize>, seeds: &[HashSeed]) {
        for (ev, blocks) in stream.events[range.clone()]
            .iter()
            .zip(&mut self.pending[range])
        {
            for (b, l) in blocks.iter_mut().zip(local_hashes(ev, seeds[ev.tenant])) {
                b.1 = l;
            }
            self.tree
                .store(self.holders[ev.worker], ev.parent, blocks)
                .expect("smg store");
        }
    }
    fn finish(&mut self) {
        self.pending = Vec::new();
    }
    fn answer(&self, p: &Prompt) -> Vec<(usize, u32)> {
        let mut reuse = Reuse::default();
        self.tree
            .overlap(&p.locals, &mut reuse.smg_scratch, &mut reuse.smg_out);
        let mut out: Vec<(usize, u32)> = reuse
            .smg_out
            .iter()
            .map(|o| (self.index_of[&o.holder], o.depth))
            .filter(|&(_, d)| d > 0)
            .collect();
        out.sort_unstable();
        out
    }
    fn query(&self, p: &Prompt, reuse: &mut Reuse) {
        self.tree
            .overlap(&p.locals, &mut reuse.smg_scratch, &mut reuse.smg_out);
        black_box(&reuse.smg_out);
    }
}

/// Dynamo's form of an event, its local hashes not yet computed (see [`dynamo_hash`]).
fn dynamo_event(ev: &StoreEvent, id: u64) -> RouterEvent {
    let blocks = ev
        .engine_hashes
        .iter()
        .map(|&h| KvCacheStoredBlockData {
            block_hash: ExternalSequenceBlockHash(h),
            tokens_hash: LocalBlockHash(0),
            mm_extra_info: None,
        })
        .collect();
    RouterEvent::new(
        ev.worker as u64,
        KvCacheEvent {
            event_id: id,
            data: KvCacheEventData::Stored(KvCacheStoreData {
                parent_hash: ev.parent.map(ExternalSequenceBlockHash),
                start_position: None,
                blocks,
            }),
            dp_rank: 0,
        },
    )
}

fn dynamo_events(stream: &Stream) -> Vec<RouterEvent> {
    (stream.events.iter().enumerate())
        .map(|(i, ev)| dynamo_event(ev, i as u64))
        .collect()
}

/// Fills in a prepared event's local hashes (the timed part of building it).
fn dynamo_hash(event: &mut RouterEvent, ev: &StoreEvent, seed: HashSeed) {
    if let KvCacheEventData::Stored(store) = &mut event.event.data {
        for (b, l) in store.blocks.iter_mut().zip(local_hashes(ev, seed)) {
            b.tokens_hash = LocalBlockHash(l);
        }
    }
}

fn dynamo_answer(scores: &dynamo_kv_router::protocols::OverlapScores) -> Vec<(usize, u32)> {
    let mut out: Vec<(usize, u32)> = scores
        .scores
        .iter()
        .map(|(w, &d)| (w.worker_id as usize, d))
        .filter(|&(_, d)| d > 0)
        .collect();
    out.sort_unstable();
    out
}

/// Dynamo's single-threaded tree (not `Sync`: it lives on one thread, as in Dynamo's indexer
/// task). Wrapped so it can sit beside the others; it is never shared across threads.
struct DynamoSingle(DynamoTree, std::vec::IntoIter<RouterEvent>);
// SAFETY: only ever used from the thread that built it (`shared_reads` is false).
unsafe impl Sync for DynamoSingle {}
// SAFETY: as above; it never leaves the building thread.
unsafe impl Send for DynamoSingle {}

impl Index for DynamoSingle {
    fn name(&self) -> &'static str {
        "dynamo RadixTree"
    }
    fn prepare(&mut self, stream: &Stream) {
        self.1 = dynamo_events(stream).into_iter();
    }
    fn apply(&mut self, stream: &Stream, range: Range<usize>, seeds: &[HashSeed]) {
        // The slice leads the zip: the prepared events are taken only as far as it goes.
        for (ev, mut event) in stream.events[range].iter().zip(self.1.by_ref()) {
            dynamo_hash(&mut event, ev, seeds[ev.tenant]);
            self.0.apply_event(event).expect("dynamo store");
        }
    }
    fn finish(&mut self) {
        self.1 = Vec::new().into_iter();
    }
    fn answer(&self, p: &Prompt) -> Vec<(usize, u32)> {
        dynamo_answer(&self.0.find_matches(p.dyn_locals.clone(), false))
    }
    fn query(&self, p: &Prompt, _reuse: &mut Reuse) {
        // Its query takes the hashes by value: the copy is the API's.
        black_box(self.0.find_matches(p.dyn_locals.clone(), false));
    }
    fn shared_reads(&self) -> bool {
        false
    }
}

struct DynamoConcurrent {
    tree: std::sync::Arc<ConcurrentRadixTreeCompressed>,
    /// Prepared events, the channel to its worker loop and the loop's thread.
    pending: std::vec::IntoIter<RouterEvent>,
    tx: Option<flume::Sender<WorkerTask>>,
    worker: Option<std::thread::JoinHandle<Result<(), String>>>,
}

impl Index for DynamoConcurrent {
    fn name(&self) -> &'static str {
        "dynamo ConcurrentRadixTree"
    }
    fn prepare(&mut self, stream: &Stream) {
        // Its public write path is its worker loop on a thread of its own, fed by a channel,
        // as in Dynamo; the loop's CPU time counts (the process's).
        self.pending = dynamo_events(stream).into_iter();
        let (tx, rx) = flume::unbounded();
        let tree = self.tree.clone();
        self.worker = Some(std::thread::spawn(move || {
            tree.worker(rx, None).map_err(|e| e.to_string())
        }));
        self.tx = Some(tx);
    }
    fn apply(&mut self, stream: &Stream, range: Range<usize>, seeds: &[HashSeed]) {
        // The range's events, the last one acknowledged: the loop has applied them all when
        // the acknowledgement arrives.
        let tx = self.tx.as_ref().expect("prepared");
        let last = range.end.saturating_sub(1);
        let mut ack = None;
        for (i, (ev, mut event)) in
            (range.start..).zip(stream.events[range].iter().zip(self.pending.by_ref()))
        {
            dynamo_hash(&mut event, ev, seeds[ev.tenant]);
            let task = if i == last {
                let (resp, rx) = tokio::sync::oneshot::channel();
                ack = Some(rx);
                WorkerTask::EventWithAck { event, resp }
            } else {
                WorkerTask::Event(event)
            };
            tx.send(task).expect("send");
        }
        if let Some(ack) = ack {
            assert!(ack.blocking_recv().expect("acknowledged"), "dynamo store");
        }
    }
    fn finish(&mut self) {
        self.pending = Vec::new().into_iter();
        self.tx = None;
        if let Some(w) = self.worker.take() {
            w.join().expect("worker").expect("worker loop");
        }
    }
    fn answer(&self, p: &Prompt) -> Vec<(usize, u32)> {
        dynamo_answer(&self.tree.find_matches(&p.dyn_locals, false))
    }
    fn query(&self, p: &Prompt, _reuse: &mut Reuse) {
        black_box(self.tree.find_matches(&p.dyn_locals, false));
    }
}

/// What one system measured in one shape.
#[derive(Clone, Copy, Default)]
struct Figures {
    exact: bool,
    /// Blocks applied per CPU-second of the whole process (every thread), best build.
    apply_per_cpu_s: f64,
    /// Blocks applied per wall-clock second, best build.
    apply_per_wall_s: f64,
    bytes_per_pair: f64,
    p50_ns: f64,
    p99_ns: f64,
    one: Readers,
    two: Readers,
}

/// `--tail`: each prompt's fastest time over the timed rounds (a prompt is timed about five
/// times), as percentiles, and the prompts slowest at their fastest with their length and the
/// naive model's answer: a tail made of the same prompts every time is the index's structure,
/// not the machine's noise. `lat[i]` is round `i`'s time (rounds take prompt `i * 7919 mod n`).
fn print_tail(name: &str, stream: &Stream, lat: &[u64]) {
    let n = stream.prompts.len();
    let mut fastest = vec![u64::MAX; n];
    for (i, &t) in lat.iter().enumerate() {
        let j = (i * 7919) % n;
        fastest[j] = fastest[j].min(t);
    }
    let mut by_time: Vec<(u64, usize)> = (fastest.iter().copied().zip(0..))
        .filter(|&(t, _)| t != u64::MAX)
        .collect();
    by_time.sort_unstable();
    let times: Vec<u64> = by_time.iter().map(|&(t, _)| t).collect();
    println!(
        "  {name:<28} each prompt's fastest query: p50 {:.2} µs, p99 {:.2} µs, max {:.2} µs",
        percentile(&times, 0.50) / 1e3,
        percentile(&times, 0.99) / 1e3,
        percentile(&times, 1.0) / 1e3,
    );
    for &(t, j) in by_time.iter().rev().take(5) {
        let p = &stream.prompts[j];
        let answer = naive(stream, p);
        let best = answer.iter().map(|&(_, d)| d).max().unwrap_or(0);
        let second = (answer.iter().map(|&(_, d)| d))
            .filter(|&d| d < best)
            .max()
            .unwrap_or(0);
        let at_best = answer.iter().filter(|&&(_, d)| d == best).count();
        println!(
            "    {:.2} µs: {} blocks, {} workers answer, {at_best} hold the longest prefix ({best} \
             blocks), the next longest {second}",
            t as f64 / 1e3,
            p.seqs.len(),
            answer.len()
        );
    }
}

fn percentile(sorted: &[u64], q: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    sorted[((sorted.len() - 1) as f64 * q).round() as usize] as f64
}

fn clock(id: libc::clockid_t) -> Duration {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid out-pointer; the clock ids used are always supported on Linux.
    let rc = unsafe { libc::clock_gettime(id, &mut ts) };
    assert_eq!(rc, 0, "clock_gettime");
    Duration::new(ts.tv_sec as u64, ts.tv_nsec as u32)
}

/// CPU time of the whole process: every thread's, including any a system starts itself.
fn process_cpu() -> Duration {
    clock(libc::CLOCK_PROCESS_CPUTIME_ID)
}

/// CPU time of the calling thread.
fn thread_cpu() -> Duration {
    clock(libc::CLOCK_THREAD_CPUTIME_ID)
}

/// Pins the calling thread to CPU `cpu` (best effort: a failure leaves it to the scheduler).
fn pin_to(cpu: usize) {
    // SAFETY: a zeroed cpu_set_t is a valid empty set; CPU_SET stays within it (cpu is checked).
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        if cpu < libc::CPU_SETSIZE as usize {
            libc::CPU_SET(cpu, &mut set);
            libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set);
        }
    }
}

/// The CPUs this process may run on.
fn allowed_cpus() -> Vec<usize> {
    // SAFETY: a zeroed cpu_set_t is a valid out-buffer of the size passed.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        if libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set) != 0 {
            return Vec::new();
        }
        (0..libc::CPU_SETSIZE as usize)
            .filter(|&c| libc::CPU_ISSET(c, &set))
            .collect()
    }
}

/// Tokens per timed chunk of events: 128 KiB, in a core's L2 cache beside the index's own
/// data (chunks of 512 KiB and 2 MiB made every system's apply 10-30% slower here: the tokens
/// pushed the systems' tables out of the cache; in service one event's tokens are a few KiB).
const CHUNK_TOKENS: usize = 32 * 1024;

/// Runs `apply` over the stream's events in consecutive chunks of about [`CHUNK_TOKENS`]
/// tokens, each chunk's tokens read once just before (untimed): as in service, where an event's
/// tokens were just decoded from the wire when it is applied, so hashing them reads cache, not
/// memory. Returns the process's CPU time and the wall-clock time spent in `apply`.
fn timed_apply(stream: &Stream, mut apply: impl FnMut(Range<usize>)) -> (Duration, Duration) {
    let (mut cpu, mut wall) = (Duration::ZERO, Duration::ZERO);
    let mut start = 0;
    while start < stream.events.len() {
        let mut end = start;
        let mut tokens = 0;
        while end < stream.events.len() && (end == start || tokens < CHUNK_TOKENS) {
            tokens += stream.events[end].tokens.len();
            end += 1;
        }
        let mut sum = 0u32;
        for ev in &stream.events[start..end] {
            sum = ev.tokens.iter().fold(sum, |a, &t| a.wrapping_add(t));
        }
        black_box(sum);
        let (c, w) = (process_cpu(), Instant::now());
        apply(start..end);
        wall += w.elapsed();
        cpu += process_cpu().saturating_sub(c);
        start = end;
    }
    (cpu, wall)
}

/// What [`timed_apply`] itself costs over this stream (its clock reads), best of `reps`.
fn clock_overhead(stream: &Stream, reps: usize) -> (Duration, Duration) {
    (0..reps.max(1))
        .map(|_| {
            timed_apply(stream, |r| {
                black_box(r);
            })
        })
        .min()
        .unwrap_or_default()
}

/// Measures one system: apply (best of `apply_reps` fresh builds, by CPU time, uncounted), then,
/// on one more build, memory after reclamation, exactness, query latency and reader throughput.
fn measure(
    make: &dyn Fn() -> Box<dyn Index>,
    stream: &Stream,
    seeds: &[HashSeed],
    s: &Settings,
    overhead: (Duration, Duration),
) -> (&'static str, Figures) {
    let mut f = Figures::default();
    let blocks: usize = stream.events.iter().map(|e| e.engine_hashes.len()).sum();
    let mut best_cpu = Duration::MAX;
    let mut best_wall = Duration::MAX;
    // The timed builds, uncounted (see `Alloc`); each is dropped and its deferred frees run
    // before counting resumes, so no block allocated uncounted is freed while counting.
    COUNTING.store(false, Ordering::SeqCst);
    for _ in 0..s.apply_reps.max(1) {
        let mut sys = make();
        sys.prepare(stream);
        let (cpu, wall) = timed_apply(stream, |r| sys.apply(stream, r, seeds));
        sys.finish();
        best_cpu = best_cpu.min(cpu.saturating_sub(overhead.0));
        best_wall = best_wall.min(wall.saturating_sub(overhead.1));
        drop(sys);
        settle();
    }
    COUNTING.store(true, Ordering::SeqCst);
    f.apply_per_cpu_s = blocks as f64 / best_cpu.as_secs_f64().max(1e-9);
    f.apply_per_wall_s = blocks as f64 / best_wall.as_secs_f64().max(1e-9);
    let name = make().name();
    if s.apply_only {
        println!(
            "  {name:<28} apply {:>5.2} M blocks/CPU-s ({:>5.2} M/wall-s)",
            f.apply_per_cpu_s / 1e6,
            f.apply_per_wall_s / 1e6
        );
        return (name, f);
    }
    // One more build, counted and untimed: its memory, then its answers and queries. Counted
    // from after its construction: the prepared events are freed (or moved into the index) by
    // `finish`, so what stays is the index's.
    let mut sys = make();
    settle();
    let before = live_bytes();
    sys.prepare(stream);
    timed_apply(stream, |r| sys.apply(stream, r, seeds));
    sys.finish();
    settle();
    f.bytes_per_pair = live_bytes().saturating_sub(before) as f64 / stream.pairs as f64;
    // Exactness first: every prompt of the stream against the naive model.
    let mut wrong = 0;
    for p in &stream.prompts {
        if sys.answer(p) != naive(stream, p) {
            wrong += 1;
        }
    }
    f.exact = wrong == 0;
    if !f.exact {
        println!(
            "  {name:<28} NOT EXACT: {wrong} of {} answers differ from the naive model (figures withheld)",
            stream.prompts.len()
        );
        return (name, f);
    }
    let mut reuse = Reuse::default();
    for p in stream.prompts.iter().take(200) {
        sys.query(p, &mut reuse);
    }
    let mut lat = Vec::with_capacity(s.query_rounds);
    for i in 0..s.query_rounds {
        let p = &stream.prompts[(i * 7919) % stream.prompts.len()];
        let t = Instant::now();
        sys.query(p, &mut reuse);
        lat.push(t.elapsed().as_nanos() as u64);
    }
    if s.tail {
        print_tail(name, stream, &lat);
    }
    lat.sort_unstable();
    f.p50_ns = percentile(&lat, 0.50);
    f.p99_ns = percentile(&lat, 0.99);
    if sys.shared_reads() && s.readers {
        let query = |i: usize, reuse: &mut Reuse| {
            sys.query(&stream.prompts[i % stream.prompts.len()], reuse)
        };
        f.one = readers(&query, 1, s);
        f.two = readers(&query, 2, s);
    }
    drop(sys);
    (name, f)
}

/// Reader threads' throughput over one window (the best of three).
#[derive(Clone, Copy, Default)]
struct Readers {
    /// Queries per wall-clock second, all threads together.
    qps: f64,
    /// Queries per CPU-second the reader threads got (contention lowers it; a busy machine
    /// that gives the readers less CPU does not).
    per_cpu_s: f64,
    /// The readers' CPU time over `threads ×` the window: below 1, they waited for a core.
    cpu_share: f64,
}

impl Readers {
    /// Two readers over one: (throughput, throughput per reader-CPU-second).
    fn ratio(two: Readers, one: Readers) -> (f64, f64) {
        (two.qps / one.qps, two.per_cpu_s / one.per_cpu_s)
    }
}

/// `threads` threads calling `query(i, reuse)` for a window (pinned to different cores unless
/// `--no-pin`), best of three windows for each figure.
fn readers(query: &(dyn Fn(usize, &mut Reuse) + Sync), threads: usize, s: &Settings) -> Readers {
    let cpus = allowed_cpus();
    let mut best = Readers::default();
    for _ in 0..3 {
        let go = AtomicBool::new(false);
        let stop = AtomicBool::new(false);
        let ready = AtomicUsize::new(0);
        let (n, cpu) = std::thread::scope(|scope| {
            let handles: Vec<_> = (0..threads)
                .map(|t| {
                    let (go, stop, ready) = (&go, &stop, &ready);
                    let cpu = (s.pin && !cpus.is_empty()).then(|| cpus[t % cpus.len()]);
                    scope.spawn(move || {
                        if let Some(c) = cpu {
                            pin_to(c);
                        }
                        let mut reuse = Reuse::default();
                        let mut i = t * 104_729;
                        query(i, &mut reuse); // sizes the buffers before the window
                        ready.fetch_add(1, Ordering::Relaxed);
                        while !go.load(Ordering::Acquire) {
                            std::hint::spin_loop();
                        }
                        let c0 = thread_cpu();
                        let mut n = 0usize;
                        while !stop.load(Ordering::Relaxed) {
                            query(i, &mut reuse);
                            i += 7919;
                            n += 1;
                        }
                        (n, thread_cpu().saturating_sub(c0))
                    })
                })
                .collect();
            while ready.load(Ordering::Relaxed) < threads {
                std::thread::yield_now();
            }
            go.store(true, Ordering::Release);
            std::thread::sleep(s.reader_window);
            stop.store(true, Ordering::Relaxed);
            handles
                .into_iter()
                .map(|h| h.join().expect("reader"))
                .fold((0usize, Duration::ZERO), |(n, c), (m, d)| (n + m, c + d))
        });
        let window = s.reader_window.as_secs_f64();
        best.qps = best.qps.max(n as f64 / window);
        best.per_cpu_s = best.per_cpu_s.max(n as f64 / cpu.as_secs_f64().max(1e-9));
        best.cpu_share = best
            .cpu_share
            .max(cpu.as_secs_f64() / (threads as f64 * window));
    }
    best
}

/// The machine's own two-thread scaling, as a yardstick for the readers' figures: each thread
/// reads random words of a private 16 MiB array (no shared line is written). Near 2.0x (and
/// near 1.0x per CPU-second) when two cores are free.
fn machine_scaling(s: &Settings) {
    const WORDS: usize = 1 << 21;
    let arrays: Vec<Vec<u64>> = (0..2)
        .map(|t| {
            let mut r = t as u64 + 11;
            (0..WORDS).map(|_| splitmix(&mut r)).collect()
        })
        .collect();
    let which = AtomicUsize::new(0);
    let query = |i: usize, _: &mut Reuse| {
        // The thread's own array: the first call of each thread takes the next one.
        thread_local!(static MINE: std::cell::Cell<usize> = const { std::cell::Cell::new(usize::MAX) });
        let a = MINE.with(|m| {
            if m.get() == usize::MAX {
                m.set(which.fetch_add(1, Ordering::Relaxed) % arrays.len());
            }
            m.get()
        });
        let arr = &arrays[a];
        let mut x = i as u64;
        for _ in 0..64 {
            x = arr[(x as usize ^ i) % WORDS].wrapping_add(x);
        }
        black_box(x);
    };
    let one = readers(&query, 1, s);
    let two = readers(&query, 2, s);
    let (wall, per_cpu) = Readers::ratio(two, one);
    println!(
        "machine yardstick (private memory, nothing shared): two threads / one {wall:.2}x, per reader-CPU-second {per_cpu:.2}x, readers' CPU share with two {:.2} (1.00: each had a core){}\n",
        two.cpu_share,
        if s.pin { "" } else { ", unpinned" }
    );
}

/// Lets epoch-deferred frees run, so retired tables are not counted.
fn settle() {
    for _ in 0..64 {
        crossbeam_epoch::pin().flush();
    }
    kv_epp_core::index::holders::reclaim_retired();
}

fn run_shape(trace: &[Request], workers: usize, tenants: usize, s: &Settings) {
    let stream = build_stream(trace, workers, tenants);
    let seeds = seeds(tenants);
    let blocks: usize = stream.events.iter().map(|e| e.engine_hashes.len()).sum();
    println!(
        "{workers} workers, {tenants} tenant(s): {} stored events, {blocks} blocks, {} (worker, block) pairs, {} prompts",
        stream.events.len(),
        stream.pairs,
        stream.prompts.len()
    );
    let systems: Vec<Box<dyn Fn() -> Box<dyn Index>>> = vec![
        Box::new(move || Box::new(KvEpp::new(workers))),
        Box::new(move || Box::new(Smg::new(workers))),
        Box::new(|| Box::new(DynamoSingle(DynamoTree::new(), Vec::new().into_iter()))),
        Box::new(|| {
            Box::new(DynamoConcurrent {
                tree: std::sync::Arc::new(ConcurrentRadixTreeCompressed::new()),
                pending: Vec::new().into_iter(),
                tx: None,
                worker: None,
            })
        }),
    ];
    // What every system's apply starts with: the blocks' local hashes alone, timed the same way
    // (the peers' XXH3, and kv-epp's `hash_block`).
    let overhead = clock_overhead(&stream, s.apply_reps);
    let hash_ns = |kv: bool| {
        let cpu = (0..s.apply_reps.max(1))
            .map(|_| {
                timed_apply(&stream, |r| {
                    for ev in &stream.events[r] {
                        if kv {
                            for b in ev.tokens.chunks_exact(BLOCK) {
                                black_box(hash_block(b, seeds[ev.tenant]));
                            }
                        } else {
                            for l in local_hashes(ev, seeds[ev.tenant]) {
                                black_box(l);
                            }
                        }
                    }
                })
                .0
            })
            .min()
            .unwrap_or_default();
        cpu.saturating_sub(overhead.0).as_secs_f64() * 1e9 / blocks as f64
    };
    let (peer_hash_ns, kv_hash_ns) = (hash_ns(false), hash_ns(true));
    println!(
        "  the blocks' local hashes alone: {peer_hash_ns:.0} ns per block of CPU (xxhash-rust, charged to the peers), {kv_hash_ns:.0} ns (kv-epp's hash_block)"
    );
    let mut all = Vec::new();
    for make in &systems {
        let name = make().name();
        if s.only.as_deref().is_some_and(|o| o != name) {
            continue;
        }
        let (name, f) = measure(&**make, &stream, &seeds, s, overhead);
        if f.exact {
            let two = if f.one.qps > 0.0 {
                let (wall, per_cpu) = Readers::ratio(f.two, f.one);
                format!("{wall:>5.2}x ({per_cpu:.2}x per CPU-s)")
            } else {
                "  n/a".to_string()
            };
            println!(
                "  {name:<28} query p50 {:>7.2} µs  p99 {:>7.2} µs   memory {:>7.1} B/(worker,block)   apply {:>5.2} M blocks/CPU-s ({:>5.2} M/wall-s)   two readers {two}",
                f.p50_ns / 1e3,
                f.p99_ns / 1e3,
                f.bytes_per_pair,
                f.apply_per_cpu_s / 1e6,
                f.apply_per_wall_s / 1e6,
            );
        }
        all.push((name, f));
    }
    if s.only.is_some() || s.apply_only {
        return; // profiling one system: no ratios, no writer or churn figures
    }
    let kv = all[0].1;
    let smg = all[1].1;
    let fastest = all[1..]
        .iter()
        .filter(|(_, f)| f.exact)
        .max_by(|a, b| a.1.apply_per_cpu_s.total_cmp(&b.1.apply_per_cpu_s));
    if kv.exact && smg.exact {
        let check = |ok: bool| if ok { "met" } else { "NOT met" };
        let (p50, p99, mem) = (
            kv.p50_ns / smg.p50_ns,
            kv.p99_ns / smg.p99_ns,
            kv.bytes_per_pair / smg.bytes_per_pair,
        );
        let (fastest_name, fastest) =
            fastest.map_or(("none", Figures::default()), |(n, f)| (*n, *f));
        let apply = kv.apply_per_cpu_s / fastest.apply_per_cpu_s;
        let apply_wall = kv.apply_per_wall_s / fastest.apply_per_wall_s;
        let (two, two_cpu) = Readers::ratio(kv.two, kv.one);
        println!("  kv-epp ratios:");
        println!(
            "    query p50 / smg's              {p50:>5.2}x   (goal <= 0.8: {})",
            check(p50 <= 0.8)
        );
        println!(
            "    query p99 / smg's              {p99:>5.2}x   (goal <= 1.0: {})",
            check(p99 <= 1.0)
        );
        println!(
            "    memory per pair / smg's        {mem:>5.2}x   (goal <= 0.8: {})",
            check(mem <= 0.8)
        );
        println!(
            "    apply per core / fastest peer  {apply:>5.2}x   (goal >= 1.2: {}; per CPU-second, against {fastest_name}; by wall clock {apply_wall:.2}x)",
            check(apply >= 1.2)
        );
        println!(
            "      beyond the local hash: kv-epp {:.0} ns per block, {fastest_name} {:.0} ns",
            1e9 / kv.apply_per_cpu_s - kv_hash_ns,
            1e9 / fastest.apply_per_cpu_s - peer_hash_ns,
        );
        println!(
            "    two readers / one              {two:>5.2}x   (goal >= 1.6: {}; per reader-CPU-second {two_cpu:.2}x, readers' CPU share with two {:.2})",
            check(two >= 1.6),
            kv.two.cpu_share
        );
        for (name, f) in &all[2..] {
            if f.exact {
                println!(
                    "    query p50 / {name}'s {:>5.2}x, p99 {:>5.2}x",
                    kv.p50_ns / f.p50_ns,
                    kv.p99_ns / f.p99_ns
                );
            }
        }
    } else if !kv.exact {
        panic!("kv-epp's answers differ from the naive model");
    }
    writer_figures(&stream, &seeds, workers, s);
    churn_figure(
        &stream,
        &seeds,
        workers,
        if s.query_rounds > 1000 { 10_000 } else { 200 },
    );
    println!();
}

/// kv-epp's memory after worker churn: a pool holding the stream, then `cycles` times a worker
/// joins, stores a prompt's blocks, clears, stores again and leaves (a pool whose pods come and
/// go). Figure: live bytes after over before (goal: within 5%).
fn churn_figure(stream: &Stream, seeds: &[HashSeed], workers: usize, cycles: usize) {
    settle();
    let empty = live_bytes();
    let kv = KvEpp::new(workers);
    for ev in &stream.events {
        apply_kv(&kv, ev, ev.worker, seeds);
    }
    let big = stream
        .events
        .iter()
        .filter(|e| e.parent.is_none())
        .max_by_key(|e| e.engine_hashes.len())
        .expect("an event");
    let cycle = |c: usize| {
        let addr: SocketAddr = format!("10.200.{}.{}:9000", (c / 256) % 256, c % 256)
            .parse()
            .expect("address");
        let w = WorkerId::new(addr);
        kv.index.add_worker(w);
        let hashes: Vec<EngineBlockHash> = big
            .engine_hashes
            .iter()
            .map(|&h| EngineBlockHash(h))
            .collect();
        let store = || {
            kv.index
                .store(
                    &w,
                    &StoreBlocks {
                        parent: None,
                        root_seed: Some(seeds[big.tenant]),
                        engine_hashes: &hashes,
                        tokens: &big.tokens,
                        medium: Medium::Device,
                    },
                )
                .expect("store");
        };
        store();
        kv.index.clear_worker(&w).expect("registered");
        store();
        kv.index.remove_worker(&w);
    };
    for c in 0..100 {
        cycle(c);
    }
    settle();
    let before = live_bytes();
    let t = Instant::now();
    for c in 100..100 + cycles {
        cycle(c);
    }
    let elapsed = t.elapsed();
    settle();
    let after = live_bytes();
    // Relative to the index's own footprint (the bench's op stream is not counted).
    let index = before.saturating_sub(empty).max(1);
    let grown = after as f64 - before as f64;
    println!(
        "  kv-epp after {cycles} worker add/store/clear/remove cycles: memory {grown:+.0} bytes = {:.4}x of the index's {index} bytes (goal within 5%: {}), {:.1} µs per cycle",
        1.0 + grown / index as f64,
        if grown.abs() * 20.0 <= index as f64 {
            "met"
        } else {
            "NOT met"
        },
        elapsed.as_secs_f64() * 1e6 / cycles as f64
    );
}

/// TLB shootdown interrupts the machine has taken (`/proc/interrupts`), if it says: each is an
/// interrupt on a core, so a writer that causes them stalls the queries running meanwhile.
fn tlb_shootdowns() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/interrupts").ok()?;
    let line = text.lines().find(|l| l.trim_start().starts_with("TLB:"))?;
    Some(
        line.split_whitespace()
            .skip(1)
            .map_while(|x| x.parse::<u64>().ok())
            .sum(),
    )
}

/// Full store-and-clear cycles the writer completes while the busy latencies are taken.
const WRITER_CYCLES: usize = 3;
/// Queries timed idle, and at least under the writer, per `query_rounds`.
const WRITER_QUERIES: usize = 5;

/// kv-epp's query latency with and without a writer thread applying events flat out meanwhile:
/// a second set of workers stores the whole stream (the tables grow) and is cleared (the tables
/// drop their tombstones or shrink), over and over. Queries are timed from the writer's first
/// event until it has completed [`WRITER_CYCLES`] cycles (and at least as many queries as idle),
/// so the window covers growth, clearing and shrinking alike, however fast either side runs.
/// The idle figure is taken with both sets held, after a warm-up pass.
///
/// Two writers, one after the other:
/// - *other tenants*: the second set stores the stream under other tenants' seeds, so the
///   queries' answers are the same as idle, and their latency shows what the writer's presence
///   costs them (shared tables, their rebuilds, shared caches): the goal's figure;
/// - *the same prefixes*: the second set stores the very prefixes the queries ask for, so each
///   answer meanwhile has between one and two times the holders (the idle figure has two), and
///   the writer writes into the very runs the readers scan.
fn writer_figures(stream: &Stream, seeds: &[HashSeed], workers: usize, s: &Settings) {
    let others: Vec<HashSeed> = (0..seeds.len())
        .map(|t| HashSeed::new(None, Some(&format!("writer-tenant-{t}"))))
        .collect();
    for (name, writer_seeds, goal) in [
        ("other tenants", &others[..], true),
        ("the same prefixes", seeds, false),
    ] {
        writer_figure(stream, seeds, writer_seeds, workers, s, name, goal);
    }
}

fn writer_figure(
    stream: &Stream,
    seeds: &[HashSeed],
    writer_seeds: &[HashSeed],
    workers: usize,
    s: &Settings,
    name: &str,
    goal: bool,
) {
    let kv = KvEpp::new(workers * 2);
    for ev in &stream.events {
        apply_kv(&kv, ev, ev.worker, seeds);
        apply_kv(&kv, ev, ev.worker + workers, writer_seeds);
    }
    let query = |kv: &KvEpp, i: usize, answer: &mut QueryAnswer| {
        let p = &stream.prompts[(i * 7919) % stream.prompts.len()];
        let t = Instant::now();
        kv.index.query_compact(&p.seqs, answer);
        let ns = t.elapsed().as_nanos() as u64;
        black_box(&answer);
        ns
    };
    // Idle: with the writer's set held too, so each answer is the largest it can be under the
    // writer; after a warm-up pass, as many queries as the busy window takes at least.
    let rounds = WRITER_QUERIES * s.query_rounds;
    let mut answer = QueryAnswer::default();
    for i in 0..s.query_rounds {
        query(&kv, i, &mut answer);
    }
    let mut idle: Vec<u64> = (0..rounds).map(|i| query(&kv, i, &mut answer)).collect();
    idle.sort_unstable();
    for w in workers..workers * 2 {
        kv.index.clear_worker(&kv.ids[w]).expect("registered");
    }
    let stop = AtomicBool::new(false);
    let ops = AtomicUsize::new(0);
    let cycles = AtomicUsize::new(0);
    let (busy, elapsed, done_ops, done_cycles, shootdowns) = std::thread::scope(|scope| {
        let writer = scope.spawn(|| {
            while !stop.load(Ordering::Relaxed) {
                for ev in &stream.events {
                    apply_kv(&kv, ev, ev.worker + workers, writer_seeds);
                    ops.fetch_add(ev.engine_hashes.len(), Ordering::Relaxed);
                    if stop.load(Ordering::Relaxed) {
                        return;
                    }
                }
                for w in workers..workers * 2 {
                    let n = kv.index.clear_worker(&kv.ids[w]).expect("registered");
                    ops.fetch_add(n, Ordering::Relaxed);
                }
                cycles.fetch_add(1, Ordering::Relaxed);
            }
        });
        // A writer that panicked stops the waits below (its panic surfaces at the scope's end).
        while ops.load(Ordering::Relaxed) == 0 && !writer.is_finished() {
            std::hint::spin_loop();
        }
        let before = tlb_shootdowns();
        let (ops0, t) = (ops.load(Ordering::Relaxed), Instant::now());
        let mut busy = Vec::with_capacity(rounds);
        let mut answer = QueryAnswer::default();
        let mut i = 0;
        while (busy.len() < rounds || cycles.load(Ordering::Relaxed) < WRITER_CYCLES)
            && !writer.is_finished()
        {
            busy.push(query(&kv, i, &mut answer));
            i += 1;
        }
        // The writer's work within the window, read where the window ends.
        let (elapsed, done_ops, done_cycles) = (
            t.elapsed(),
            ops.load(Ordering::Relaxed) - ops0,
            cycles.load(Ordering::Relaxed),
        );
        let shootdowns = tlb_shootdowns().zip(before).map(|(b, a)| b - a);
        stop.store(true, Ordering::Relaxed);
        (busy, elapsed, done_ops, done_cycles, shootdowns)
    });
    let mut busy = busy;
    busy.sort_unstable();
    let ratio = percentile(&busy, 0.99) / percentile(&idle, 0.99);
    let verdict = if !goal {
        String::new()
    } else if ratio <= 2.0 {
        " (goal <= 2.0: met)".to_string()
    } else {
        " (goal <= 2.0: NOT met)".to_string()
    };
    println!(
        "  kv-epp under a full-rate writer of {name} ({:.2} M block ops/s, {} cycles, {} queries): query p50 {:.2} µs (idle {:.2}), p99 {:.2} µs (idle {:.2}): p99 {ratio:.2}x of idle{verdict}; TLB shootdowns meanwhile: {}",
        done_ops as f64 / elapsed.as_secs_f64() / 1e6,
        done_cycles,
        busy.len(),
        percentile(&busy, 0.5) / 1e3,
        percentile(&idle, 0.5) / 1e3,
        percentile(&busy, 0.99) / 1e3,
        percentile(&idle, 0.99) / 1e3,
        shootdowns.map_or("n/a".to_string(), |n| n.to_string())
    );
}

fn apply_kv(kv: &KvEpp, ev: &StoreEvent, worker: usize, seeds: &[HashSeed]) {
    let hashes: Vec<EngineBlockHash> = ev
        .engine_hashes
        .iter()
        .map(|&h| EngineBlockHash(h))
        .collect();
    kv.index
        .store(
            &kv.ids[worker],
            &StoreBlocks {
                parent: ev.parent.map(EngineBlockHash),
                root_seed: Some(seeds[ev.tenant]),
                engine_hashes: &hashes,
                tokens: &ev.tokens,
                medium: Medium::Device,
            },
        )
        .expect("store");
}
