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
//! Applying charges every system the same work: a stored event carries tokens, and each system's
//! time includes computing the blocks' local hashes from them (kv-epp's `store` does it itself;
//! for the peers the loop does it with the same function, which equals Dynamo's block hash).
//! Queries are timed on prehashed prompts for every system (local hashes for the peers, sequence
//! hashes for kv-epp).
//!
//! Exact answers are a precondition: every system's answer to every prompt is compared with a
//! naive model (per worker, the set of prefixes it holds) before any figure is printed; a system
//! that differs is reported as inexact and its figures are not printed.
//!
//! Figures (all as ratios to the peers, same run): query p50/p99, memory per (worker, block) from
//! a counting allocator (plus kv-epp's directly mapped tables) after reclamation, apply rate on
//! one core, and query throughput with two reader threads over one.

use std::collections::{HashMap, HashSet};
use std::hint::black_box;
use std::net::SocketAddr;
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
static ALLOC: peak_alloc::Counting = peak_alloc::Counting;

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
    /// `--only NAME`: measure only that system (for profiling under callgrind); no ratios.
    only: Option<String>,
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    // `cargo test` runs bench targets without `--bench`: a quick smoke run then.
    let smoke = !args.iter().any(|a| a == "--bench");
    let trace_arg = args
        .iter()
        .position(|a| a == "--trace")
        .and_then(|i| args.get(i + 1))
        .cloned();
    let settings = Settings {
        query_rounds: if smoke { 200 } else { 20_000 },
        reader_window: Duration::from_millis(if smoke { 20 } else { 400 }),
        only: args
            .iter()
            .position(|a| a == "--only")
            .and_then(|i| args.get(i + 1))
            .cloned(),
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
    }
    let shapes: &[(usize, usize)] = if smoke {
        &[(8, 2)]
    } else if args.iter().any(|a| a == "--quick") {
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
/// (goal: >= 0.6x of raw), for 16- and 512-token blocks.
fn hashing(smoke: bool) {
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
            black_box(prompt_hashes(&tokens, block, seed));
        });
        let ratio = raw.as_secs_f64() / full.as_secs_f64();
        println!(
            "hashing, {block}-token blocks: local + chained {:.0} MB/s vs raw xxh3_64 {:.0} MB/s: {ratio:.2}x of raw (goal >= 0.6: {})",
            bytes.len() as f64 / full.as_secs_f64() / 1e6,
            bytes.len() as f64 / raw.as_secs_f64() / 1e6,
            if ratio >= 0.6 { "met" } else { "NOT met" }
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
    /// Applies every event; single-threaded systems on this thread.
    fn apply_all(&mut self, stream: &Stream, seeds: &[HashSeed]);
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

fn local_hashes(ev: &StoreEvent, seed: HashSeed) -> impl Iterator<Item = u64> + '_ {
    ev.tokens
        .chunks_exact(BLOCK)
        .map(move |b| hash_block(b, seed).0)
}

struct KvEpp {
    index: KvIndex,
    ids: Vec<WorkerId>,
    by_id: HashMap<WorkerId, usize>,
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
        KvEpp { index, ids, by_id }
    }
}

impl Index for KvEpp {
    fn name(&self) -> &'static str {
        "kv-epp"
    }
    fn apply_all(&mut self, stream: &Stream, seeds: &[HashSeed]) {
        let mut hashes = Vec::new();
        for ev in &stream.events {
            hashes.clear();
            hashes.extend(ev.engine_hashes.iter().map(|&h| EngineBlockHash(h)));
            self.index
                .store(
                    &self.ids[ev.worker],
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
        }
    }
}

impl Index for Smg {
    fn name(&self) -> &'static str {
        "smg-radix-tree"
    }
    fn apply_all(&mut self, stream: &Stream, seeds: &[HashSeed]) {
        let mut blocks = Vec::new();
        for ev in &stream.events {
            blocks.clear();
            blocks.extend(
                ev.engine_hashes
                    .iter()
                    .copied()
                    .zip(local_hashes(ev, seeds[ev.tenant])),
            );
            self.tree
                .store(self.holders[ev.worker], ev.parent, &blocks)
                .expect("smg store");
        }
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

fn dynamo_event(ev: &StoreEvent, seed: HashSeed, id: u64) -> RouterEvent {
    let blocks = ev
        .engine_hashes
        .iter()
        .zip(local_hashes(ev, seed))
        .map(|(&h, l)| KvCacheStoredBlockData {
            block_hash: ExternalSequenceBlockHash(h),
            tokens_hash: LocalBlockHash(l),
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

fn dynamo_locals(p: &Prompt) -> Vec<LocalBlockHash> {
    p.locals.iter().map(|&l| LocalBlockHash(l)).collect()
}

/// Dynamo's single-threaded tree (not `Sync`: it lives on one thread, as in Dynamo's indexer
/// task). Wrapped so it can sit beside the others; it is never shared across threads.
struct DynamoSingle(DynamoTree);
// SAFETY: only ever used from the thread that built it (`shared_reads` is false).
unsafe impl Sync for DynamoSingle {}
// SAFETY: as above; it never leaves the building thread.
unsafe impl Send for DynamoSingle {}

impl Index for DynamoSingle {
    fn name(&self) -> &'static str {
        "dynamo RadixTree"
    }
    fn apply_all(&mut self, stream: &Stream, seeds: &[HashSeed]) {
        for (i, ev) in stream.events.iter().enumerate() {
            self.0
                .apply_event(dynamo_event(ev, seeds[ev.tenant], i as u64))
                .expect("dynamo store");
        }
    }
    fn answer(&self, p: &Prompt) -> Vec<(usize, u32)> {
        dynamo_answer(&self.0.find_matches(dynamo_locals(p), false))
    }
    fn query(&self, p: &Prompt, _reuse: &mut Reuse) {
        black_box(self.0.find_matches(dynamo_locals(p), false));
    }
    fn shared_reads(&self) -> bool {
        false
    }
}

struct DynamoConcurrent(std::sync::Arc<ConcurrentRadixTreeCompressed>);

impl Index for DynamoConcurrent {
    fn name(&self) -> &'static str {
        "dynamo ConcurrentRadixTree"
    }
    fn apply_all(&mut self, stream: &Stream, seeds: &[HashSeed]) {
        // Its writes go through its own worker loop, fed by a channel, as in Dynamo.
        let (tx, rx) = flume::unbounded();
        let tree = self.0.clone();
        let worker = std::thread::spawn(move || tree.worker(rx, None));
        for (i, ev) in stream.events.iter().enumerate() {
            tx.send(WorkerTask::Event(dynamo_event(
                ev,
                seeds[ev.tenant],
                i as u64,
            )))
            .expect("send");
        }
        drop(tx);
        worker.join().expect("worker").expect("worker loop");
    }
    fn answer(&self, p: &Prompt) -> Vec<(usize, u32)> {
        dynamo_answer(&self.0.find_matches(&dynamo_locals(p), false))
    }
    fn query(&self, p: &Prompt, _reuse: &mut Reuse) {
        black_box(self.0.find_matches(&dynamo_locals(p), false));
    }
}

/// What one system measured in one shape.
#[derive(Clone, Copy, Default)]
struct Figures {
    exact: bool,
    apply_blocks_per_s: f64,
    bytes_per_pair: f64,
    p50_ns: f64,
    p99_ns: f64,
    one_reader_qps: f64,
    two_reader_qps: f64,
}

fn percentile(sorted: &[u64], q: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    sorted[((sorted.len() - 1) as f64 * q).round() as usize] as f64
}

fn measure(mut sys: Box<dyn Index>, stream: &Stream, seeds: &[HashSeed], s: &Settings) -> Figures {
    let mut f = Figures::default();
    settle();
    let before = live_bytes();
    let blocks: usize = stream.events.iter().map(|e| e.engine_hashes.len()).sum();
    let t = Instant::now();
    sys.apply_all(stream, seeds);
    f.apply_blocks_per_s = blocks as f64 / t.elapsed().as_secs_f64();
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
            "  {:<28} NOT EXACT: {wrong} of {} answers differ from the naive model (figures withheld)",
            sys.name(),
            stream.prompts.len()
        );
        return f;
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
    lat.sort_unstable();
    f.p50_ns = percentile(&lat, 0.50);
    f.p99_ns = percentile(&lat, 0.99);
    if sys.shared_reads() {
        f.one_reader_qps = readers(&*sys, stream, 1, s.reader_window);
        f.two_reader_qps = readers(&*sys, stream, 2, s.reader_window);
    }
    drop(sys);
    f
}

/// Queries per second over `threads` reader threads (best of three windows).
fn readers(sys: &dyn Index, stream: &Stream, threads: usize, window: Duration) -> f64 {
    (0..3)
        .map(|_| {
            let stop = AtomicBool::new(false);
            let done = AtomicUsize::new(0);
            std::thread::scope(|scope| {
                for t in 0..threads {
                    let (stop, done) = (&stop, &done);
                    scope.spawn(move || {
                        let mut reuse = Reuse::default();
                        let mut i = t * 104_729;
                        let mut n = 0;
                        while !stop.load(Ordering::Relaxed) {
                            sys.query(&stream.prompts[i % stream.prompts.len()], &mut reuse);
                            i += 7919;
                            n += 1;
                        }
                        done.fetch_add(n, Ordering::Relaxed);
                    });
                }
                std::thread::sleep(window);
                stop.store(true, Ordering::Relaxed);
            });
            done.load(Ordering::Relaxed) as f64 / window.as_secs_f64()
        })
        .fold(0.0, f64::max)
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
        Box::new(|| Box::new(DynamoSingle(DynamoTree::new()))),
        Box::new(|| {
            Box::new(DynamoConcurrent(std::sync::Arc::new(
                ConcurrentRadixTreeCompressed::new(),
            )))
        }),
    ];
    let mut all = Vec::new();
    for make in &systems {
        let sys = make();
        let name = sys.name();
        if s.only.as_deref().is_some_and(|o| o != name) {
            continue;
        }
        let f = measure(sys, &stream, &seeds, s);
        if f.exact {
            let two = if f.one_reader_qps > 0.0 {
                format!("{:>5.2}x", f.two_reader_qps / f.one_reader_qps)
            } else {
                "   n/a".to_string()
            };
            println!(
                "  {name:<28} query p50 {:>7.2} µs  p99 {:>7.2} µs   memory {:>7.1} B/(worker,block)   apply {:>6.2} M blocks/s   two readers {two}",
                f.p50_ns / 1e3,
                f.p99_ns / 1e3,
                f.bytes_per_pair,
                f.apply_blocks_per_s / 1e6,
            );
        }
        all.push((name, f));
    }
    if s.only.is_some() {
        return; // profiling one system: no ratios, no writer or churn figures
    }
    let kv = all[0].1;
    let smg = all[1].1;
    let fastest_apply = all[1..]
        .iter()
        .filter(|(_, f)| f.exact)
        .map(|(_, f)| f.apply_blocks_per_s)
        .fold(0.0, f64::max);
    if kv.exact && smg.exact {
        let check = |ok: bool| if ok { "met" } else { "NOT met" };
        let (p50, p99, mem) = (
            kv.p50_ns / smg.p50_ns,
            kv.p99_ns / smg.p99_ns,
            kv.bytes_per_pair / smg.bytes_per_pair,
        );
        let apply = kv.apply_blocks_per_s / fastest_apply;
        let two = kv.two_reader_qps / kv.one_reader_qps;
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
            "    apply per core / fastest peer  {apply:>5.2}x   (goal >= 1.2: {})",
            check(apply >= 1.2)
        );
        println!(
            "    two readers / one              {two:>5.2}x   (goal >= 1.6: {})",
            check(two >= 1.6)
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

/// kv-epp's query latency with and without a writer thread applying events flat out meanwhile:
/// a second set of workers stores the whole stream (the tables grow) and is cleared (the tables
/// drop their tombstones or shrink), over and over.
fn writer_figures(stream: &Stream, seeds: &[HashSeed], workers: usize, s: &Settings) {
    let kv = KvEpp::new(workers * 2);
    for ev in &stream.events {
        apply_kv(&kv, ev, ev.worker, seeds);
    }
    let lat = |kv: &KvEpp| {
        let mut answer = QueryAnswer::default();
        let mut lat = Vec::with_capacity(s.query_rounds);
        for i in 0..s.query_rounds {
            let p = &stream.prompts[(i * 7919) % stream.prompts.len()];
            let t = Instant::now();
            kv.index.query_compact(&p.seqs, &mut answer);
            lat.push(t.elapsed().as_nanos() as u64);
            black_box(&answer);
        }
        lat.sort_unstable();
        lat
    };
    let idle = lat(&kv);
    let stop = AtomicBool::new(false);
    let ops = AtomicUsize::new(0);
    let (busy, elapsed) = std::thread::scope(|scope| {
        scope.spawn(|| {
            while !stop.load(Ordering::Relaxed) {
                for ev in &stream.events {
                    apply_kv(&kv, ev, ev.worker + workers, seeds);
                    ops.fetch_add(ev.engine_hashes.len(), Ordering::Relaxed);
                    if stop.load(Ordering::Relaxed) {
                        break;
                    }
                }
                for w in workers..workers * 2 {
                    let n = kv.index.clear_worker(&kv.ids[w]).expect("registered");
                    ops.fetch_add(n, Ordering::Relaxed);
                }
            }
        });
        let t = Instant::now();
        let busy = lat(&kv);
        let elapsed = t.elapsed();
        stop.store(true, Ordering::Relaxed);
        (busy, elapsed)
    });
    println!(
        "  kv-epp under a full-rate writer ({:.2} M block ops/s meanwhile): query p50 {:.2} µs (idle {:.2}), p99 {:.2} µs (idle {:.2}): p99 {:.2}x of idle (goal <= 2.0: {})",
        ops.load(Ordering::Relaxed) as f64 / elapsed.as_secs_f64() / 1e6,
        percentile(&busy, 0.5) / 1e3,
        percentile(&idle, 0.5) / 1e3,
        percentile(&busy, 0.99) / 1e3,
        percentile(&idle, 0.99) / 1e3,
        percentile(&busy, 0.99) / percentile(&idle, 0.99),
        if percentile(&busy, 0.99) <= 2.0 * percentile(&idle, 0.99) {
            "met"
        } else {
            "NOT met"
        }
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
