//! `make bench`: figures for the routing core, each against a baseline measured in the same run.
//!
//! - hashing: our salted local (and chained) hashes vs raw `xxh3_64` over the same bytes;
//! - index apply: blocks/s on one core, from engine-style stored events;
//! - index query: p50/p99 for an 8,192-token prompt (512 blocks of 16) against 64 and 256
//!   workers holding 1M+ blocks in total, idle and while another thread applies events;
//! - memory: bytes per (worker, block) all-in (holder table + per-worker engine maps), from a
//!   counting allocator, with and without salts.
//!
//! Populations come from the built-in multi-tenant generator, or from a Mooncake trace with
//! `--trace PATH` (never copied into the repository).

use std::collections::HashSet;
use std::hint::black_box;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use xxhash_rust::xxh3::xxh3_64_with_seed;

use kv_epp_core::hashing::{HashSeed, local_block_hashes, prompt_hashes};
use kv_epp_core::index::holders::MAPPED_BYTES;
use kv_epp_core::index::{EngineBlockHash, IndexLimits, KvIndex, Medium, StoreBlocks};
use kv_epp_core::worker::WorkerId;
use kv_epp_sim::fleet::percentile;
use kv_epp_sim::workload::read_mooncake;

#[path = "support/peak_alloc.rs"]
mod peak_alloc;

#[global_allocator]
static ALLOC: peak_alloc::Counting = peak_alloc::Counting;

const BLOCK: usize = 16;
/// Queries timed per measurement.
static QUERY_ROUNDS: AtomicUsize = AtomicUsize::new(20_000);

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let trace = args
        .iter()
        .position(|a| a == "--trace")
        .and_then(|i| args.get(i + 1))
        .cloned();
    println!(
        "kv-epp core benchmarks (block size {BLOCK}; one process, same run for every ratio)\n"
    );
    // `cargo test --all-targets` runs this binary without `--bench`: a quick smoke run then, so
    // the code stays exercised without spending minutes of an unoptimized build.
    if !args.iter().any(|a| a == "--bench") {
        QUERY_ROUNDS.store(100, Ordering::Relaxed);
        let pop = Population::generated(4, 20_000, true);
        bench_index(&pop, 4, true);
        println!("(smoke run; `make bench` runs the full benchmarks)");
        return;
    }
    if args.iter().any(|a| a == "--only-zmq") {
        bench_events_over_zmq();
        return;
    }
    if args.iter().any(|a| a == "--only-hashing") {
        bench_hashing();
        return;
    }
    let only_query = args.iter().any(|a| a == "--quick-query");
    if !only_query {
        bench_hashing();
    }
    let shapes: &[(usize, bool)] = if only_query {
        &[(256, true)]
    } else {
        &[(64, true), (64, false), (256, true), (256, false)]
    };
    for &(workers, salted) in shapes {
        {
            let pop = Population::generated(workers, 1_050_000, salted);
            bench_index(&pop, workers, salted);
        }
    }
    bench_events_over_zmq();
    if let Some(path) = trace {
        let reqs = read_mooncake(std::path::Path::new(&path), 32_000, 8, Some(4000))
            .unwrap_or_else(|e| panic!("{e}"));
        let prompts: Vec<(Option<String>, Vec<u32>)> =
            reqs.into_iter().map(|r| (r.tenant, r.tokens)).collect();
        let pop = Population::from_prompts(64, &prompts);
        println!(
            "Mooncake trace {path}: {} prompts over 64 workers",
            prompts.len()
        );
        bench_index(&pop, 64, true);
    }
}

/// Events decoded and applied end to end: a publisher on a real ZeroMQ socket on loopback sends
/// vLLM-format batches (map layout, u64 hashes) to a running kv-epp server, timed until the index
/// holds every block. Baseline: applying the same blocks straight to an index, in this run.
fn bench_events_over_zmq() {
    use bytes::Bytes;
    use rmpv::Value;
    use zeromq::{PubSocket, Socket, SocketSend, ZmqMessage};
    const BATCHES: u64 = 2_000;
    const EVENTS: usize = 16;
    const BLOCKS: usize = 4;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    let mut rng = SmallRng::seed_from_u64(11);
    // Pre-encode every payload, so the publisher costs as little as possible.
    let mut payloads = Vec::with_capacity(BATCHES as usize);
    let mut direct: Vec<(Vec<EngineBlockHash>, Vec<u32>)> = Vec::new();
    let mut next_hash = 1u64;
    for _ in 0..BATCHES {
        let mut events = Vec::with_capacity(EVENTS);
        for _ in 0..EVENTS {
            let hashes: Vec<u64> = (0..BLOCKS).map(|i| next_hash + i as u64).collect();
            next_hash += BLOCKS as u64;
            let tokens: Vec<u32> = (0..BLOCKS * BLOCK)
                .map(|_| rng.random_range(0..128_000))
                .collect();
            events.push(Value::Map(vec![
                (Value::from("type"), Value::from("BlockStored")),
                (
                    Value::from("block_hashes"),
                    Value::Array(hashes.iter().map(|h| Value::from(*h)).collect()),
                ),
                (Value::from("parent_block_hash"), Value::Nil),
                (
                    Value::from("token_ids"),
                    Value::Array(tokens.iter().map(|t| Value::from(*t)).collect()),
                ),
                (Value::from("block_size"), Value::from(BLOCK as u64)),
                (Value::from("medium"), Value::from("GPU")),
                (
                    Value::from("extra_keys"),
                    Value::Array(vec![Value::Array(vec![Value::from("kvepp:tenant-a")])]),
                ),
            ]));
            direct.push((hashes.into_iter().map(EngineBlockHash).collect(), tokens));
        }
        let mut p = Vec::new();
        rmpv::encode::write_value(
            &mut p,
            &Value::Array(vec![Value::F64(1.0), Value::Array(events), Value::Nil]),
        )
        .expect("encode");
        payloads.push(p);
    }
    let blocks = BATCHES as usize * EVENTS * BLOCKS;
    // Baseline: the same stores straight into an index.
    let index = KvIndex::new(BLOCK, IndexLimits::default());
    let w = WorkerId::new("127.0.0.1:1".parse().expect("addr"));
    index.add_worker(w);
    let seed = HashSeed::new(None, Some("tenant-a"));
    let t = Instant::now();
    for (hashes, tokens) in &direct {
        index
            .store(
                &w,
                &StoreBlocks {
                    parent: None,
                    root_seed: Some(seed),
                    engine_hashes: hashes,
                    tokens,
                    medium: Medium::Device,
                },
            )
            .expect("store");
    }
    let baseline = t.elapsed();
    let elapsed = rt.block_on(async move {
        let port = std::net::TcpListener::bind("127.0.0.1:0").and_then(|l| l.local_addr()).expect("port").port();
        let mut publisher = PubSocket::new();
        publisher.bind(&format!("tcp://127.0.0.1:{port}")).await.expect("bind");
        let yaml = [
            "server: {bind_address: 127.0.0.1, grpc_port: 0, grpc_health_port: 0, metrics_port: 0, admin_port: 0}".to_string(),
            "engine_metrics: {interval_ms: 0}".to_string(),
            format!("models: [{{name: m, block_size: {BLOCK}}}]"),
            format!("workers: [{{endpoint: '127.0.0.1:1', model: m, events_endpoint: 'tcp://127.0.0.1:{port}'}}]"),
        ]
        .join("\n");
        let config = kv_epp::config::Config::from_yaml(&yaml).expect("config");
        let server = kv_epp::server::Server::start(&config).await.expect("server");
        while server.feeds.statuses().iter().any(|(_, _, s)| !s.connected.load(Ordering::Relaxed)) {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        tokio::time::sleep(Duration::from_millis(300)).await;
        let index = server.picker.models.index("m").expect("index").clone();
        let t = Instant::now();
        for (seq, p) in payloads.into_iter().enumerate() {
            let mut m = ZmqMessage::from(Bytes::new());
            m.push_back(Bytes::copy_from_slice(&(seq as u64).to_be_bytes()));
            m.push_back(Bytes::from(p));
            publisher.send(m).await.expect("send");
        }
        while index.worker_blocks(&w).unwrap_or(0) < blocks {
            if t.elapsed() > Duration::from_secs(60) {
                break;
            }
            tokio::time::sleep(Duration::from_micros(200)).await;
        }
        let e = t.elapsed();
        let got = index.worker_blocks(&w).unwrap_or(0);
        server.stop().await;
        (e, got)
    });
    let (elapsed, got) = elapsed;
    println!(
        "events from a real ZeroMQ socket on loopback ({BATCHES} batches x {EVENTS} BlockStored x {BLOCKS} blocks, salted)"
    );
    println!(
        "  decoded + applied          {:>8.0} events/s   {:>6.2} M blocks/s   ({} of {} blocks; {:.2}x of direct apply)",
        (BATCHES as f64 * EVENTS as f64) * (got as f64 / blocks as f64) / elapsed.as_secs_f64(),
        got as f64 / elapsed.as_secs_f64() / 1e6,
        got,
        blocks,
        baseline.as_secs_f64() / elapsed.as_secs_f64()
    );
    println!(
        "  direct index apply         {:>8.0} events/s   {:>6.2} M blocks/s   (baseline)\n",
        (BATCHES as f64 * EVENTS as f64) / baseline.as_secs_f64(),
        blocks as f64 / baseline.as_secs_f64() / 1e6
    );
}

/// All-in live bytes: everything the global allocator has handed out, plus the holder arrays the
/// index maps directly (for huge pages) outside the allocator.
fn live_bytes() -> usize {
    peak_alloc::live() + MAPPED_BYTES.load(Ordering::Relaxed)
}

/// Lets epoch-deferred frees (tables replaced while growing) run, so they are not counted.
fn settle() {
    for _ in 0..64 {
        crossbeam_epoch::pin().flush();
    }
}

/// Best-of-N wall time of `f`.
fn best_of(n: usize, mut f: impl FnMut()) -> Duration {
    (0..n)
        .map(|_| {
            let t = Instant::now();
            f();
            t.elapsed()
        })
        .min()
        .unwrap_or_default()
}

/// Hashing, against raw `xxh3_64` per block over the same token bytes: the 1M tokens as 128
/// prompts of 8,192 tokens (the query path's shape: each prompt's hash lists are allocated per
/// call and stay small), and as one 1M-token prompt, whose two 512 KB output lists glibc returns
/// to the kernel after every call, so each call pays page faults for them (shown for honesty; no
/// request is that long).
fn bench_hashing() {
    const PROMPT: usize = 8192;
    let mut rng = SmallRng::seed_from_u64(1);
    let tokens: Vec<u32> = (0..1 << 20).map(|_| rng.random_range(0..128_000)).collect();
    let bytes: Vec<u8> = tokens.iter().flat_map(|t| t.to_le_bytes()).collect();
    let seed = HashSeed::new(Some("adapter"), Some("tenant-a"));
    let raw = best_of(15, || {
        let mut acc = 0u64;
        for chunk in bytes.chunks_exact(BLOCK * 4) {
            acc ^= xxh3_64_with_seed(chunk, seed.0);
        }
        black_box(acc);
    });
    let local = best_of(15, || {
        for prompt in tokens.chunks(PROMPT) {
            black_box(local_block_hashes(prompt, BLOCK, seed));
        }
    });
    let full = best_of(15, || {
        for prompt in tokens.chunks(PROMPT) {
            black_box(prompt_hashes(prompt, BLOCK, seed));
        }
    });
    let whole = best_of(15, || {
        black_box(prompt_hashes(&tokens, BLOCK, seed));
    });
    let mb = bytes.len() as f64 / 1e6;
    println!("hashing ({:.1} MB of tokens, blocks of {BLOCK})", mb);
    println!(
        "  raw xxh3_64 per block                    {:>8.0} MB/s   (baseline)",
        mb / raw.as_secs_f64()
    );
    println!(
        "  salted local hashes, {PROMPT}-token prompts   {:>8.0} MB/s   {:.2}x of raw",
        mb / local.as_secs_f64(),
        raw.as_secs_f64() / local.as_secs_f64()
    );
    println!(
        "  local + chained, {PROMPT}-token prompts       {:>8.0} MB/s   {:.2}x of raw",
        mb / full.as_secs_f64(),
        raw.as_secs_f64() / full.as_secs_f64()
    );
    println!(
        "  local + chained, one 1M-token prompt     {:>8.0} MB/s   {:.2}x of raw (page faults on its output)\n",
        mb / whole.as_secs_f64(),
        raw.as_secs_f64() / whole.as_secs_f64()
    );
}

/// One stored-blocks event, owned.
struct Event {
    worker: usize,
    parent: Option<u64>,
    seed: HashSeed,
    hashes: Vec<EngineBlockHash>,
    tokens: Vec<u32>,
}

/// Engine events that fill a fleet, plus prompts to query.
struct Population {
    events: Vec<Event>,
    blocks: usize,
    /// (seed, tokens, holder worker) of long prompts some worker holds completely.
    hot_prompts: Vec<(HashSeed, Vec<u32>)>,
}

fn engine_hash(parent: Option<u64>, tokens: &[u32], seed: HashSeed) -> u64 {
    let mut buf = Vec::with_capacity(16 + tokens.len() * 4);
    buf.extend_from_slice(&parent.unwrap_or(0).to_le_bytes());
    buf.extend_from_slice(&seed.0.to_le_bytes());
    for t in tokens {
        buf.extend_from_slice(&t.to_le_bytes());
    }
    xxh3_64_with_seed(&buf, 99)
}

impl Population {
    /// Multi-tenant sessions: 16 tenants, each with a 1,024-token system prompt shared by its
    /// sessions; each session's prompt is 8,192 tokens; sessions are spread over workers with
    /// tenant affinity, so system prompts live on many workers.
    fn generated(workers: usize, target_blocks: usize, salted: bool) -> Population {
        let mut rng = SmallRng::seed_from_u64(7);
        let tenants = 16;
        let systems: Vec<Vec<u32>> = (0..tenants)
            .map(|_| (0..1024).map(|_| rng.random_range(0..128_000)).collect())
            .collect();
        let mut prompts = Vec::new();
        let per_prompt = 8192 / BLOCK;
        let sessions = target_blocks / (per_prompt - 1024 / BLOCK) + 1;
        for s in 0..sessions {
            let t = s % tenants;
            let mut p = systems[t].clone();
            p.extend((0..8192 - 1024).map(|_| rng.random_range(0..128_000u32)));
            let tenant = salted.then(|| format!("tenant-{t}"));
            prompts.push((tenant, p));
        }
        Population::from_prompts(workers, &prompts)
    }

    /// Assigns each prompt to a worker (round-robin) and emits the events the engine would: the
    /// blocks the worker did not already hold, continuing the longest held prefix.
    fn from_prompts(workers: usize, prompts: &[(Option<String>, Vec<u32>)]) -> Population {
        let mut held: Vec<HashSet<u64>> = vec![HashSet::new(); workers];
        let mut events = Vec::new();
        let mut blocks = 0;
        let mut hot = Vec::new();
        for (i, (tenant, tokens)) in prompts.iter().enumerate() {
            let w = i % workers;
            let seed = HashSeed::new(None, tenant.as_deref());
            let mut parent = None;
            let mut start = None;
            let mut hashes = Vec::new();
            for (b, chunk) in tokens.chunks_exact(BLOCK).enumerate() {
                let h = engine_hash(parent, chunk, seed);
                if start.is_none() && !held[w].contains(&h) {
                    start = Some((b, parent));
                }
                if start.is_some() {
                    held[w].insert(h);
                    hashes.push(EngineBlockHash(h));
                }
                parent = Some(h);
            }
            if let Some((b, p)) = start {
                blocks += hashes.len();
                events.push(Event {
                    worker: w,
                    parent: p,
                    seed,
                    tokens: tokens[b * BLOCK..(b + hashes.len()) * BLOCK].to_vec(),
                    hashes,
                });
            }
            if tokens.len() >= 8192 && hot.len() < 64 {
                hot.push((seed, tokens[..8192].to_vec()));
            }
        }
        Population {
            events,
            blocks,
            hot_prompts: hot,
        }
    }
}

fn ids(workers: usize) -> Vec<WorkerId> {
    (0..workers)
        .map(|i| {
            WorkerId::new(
                format!("10.{}.{}.{}:8000", i / 65536, (i / 256) % 256, i % 256)
                    .parse()
                    .unwrap(),
            )
        })
        .collect()
}

fn apply(index: &KvIndex, ids: &[WorkerId], ev: &Event) {
    index
        .store(
            &ids[ev.worker],
            &StoreBlocks {
                parent: ev.parent.map(EngineBlockHash),
                root_seed: Some(ev.seed),
                engine_hashes: &ev.hashes,
                tokens: &ev.tokens,
                medium: Medium::Device,
            },
        )
        .expect("store");
}

fn bench_index(pop: &Population, workers: usize, salted: bool) {
    let ids = ids(workers);
    let limits = IndexLimits::default();
    settle();
    let before = live_bytes();
    let index = KvIndex::new(BLOCK, limits);
    for id in &ids {
        index.add_worker(*id);
    }
    let t = Instant::now();
    for ev in &pop.events {
        apply(&index, &ids, ev);
    }
    let apply_time = t.elapsed();
    settle();
    let bytes = live_bytes() - before;
    let pairs = index.pairs();
    println!(
        "index: {workers} workers, {} (worker, block) pairs, {}",
        pairs,
        if salted {
            "16 salted tenants"
        } else {
            "unsalted"
        }
    );
    println!(
        "  apply (one core)           {:>8.2} M blocks/s",
        pop.blocks as f64 / apply_time.as_secs_f64() / 1e6
    );
    println!(
        "  memory all-in              {:>8.1} bytes per (worker, block)   (tables alone {:.1})",
        bytes as f64 / pop.blocks as f64,
        index.approx_heap_bytes() as f64 / pop.blocks as f64
    );

    let queries: Vec<Vec<_>> = pop
        .hot_prompts
        .iter()
        .map(|(seed, t)| prompt_hashes(t, BLOCK, *seed).1)
        .collect();
    let depth: usize = queries
        .iter()
        .map(|q| index.best_total_blocks(q) as usize)
        .sum::<usize>()
        / queries.len().max(1);
    let lat = measure_queries(&index, &queries, QUERY_ROUNDS.load(Ordering::Relaxed));
    println!(
        "  query 512-block prompt     p50 {:>6.2} µs   p99 {:>6.2} µs   (best worker holds {depth} blocks)",
        percentile(&lat, 0.50) as f64 / 1000.0,
        percentile(&lat, 0.99) as f64 / 1000.0
    );
    let miss: Vec<_> = {
        let mut rng = SmallRng::seed_from_u64(3);
        let t: Vec<u32> = (0..8192).map(|_| rng.random_range(0..128_000)).collect();
        vec![prompt_hashes(&t, BLOCK, HashSeed::UNSALTED).1]
    };
    let lat = measure_queries(&index, &miss, QUERY_ROUNDS.load(Ordering::Relaxed));
    println!(
        "  query 512-block miss       p50 {:>6.2} µs   p99 {:>6.2} µs",
        percentile(&lat, 0.50) as f64 / 1000.0,
        percentile(&lat, 0.99) as f64 / 1000.0
    );
    // Queries while another thread keeps applying events (remove + re-store churn).
    let index = Arc::new(index);
    let stop = Arc::new(AtomicBool::new(false));
    let churned = Arc::new(AtomicUsize::new(0));
    let writer = {
        let (index, stop, churned) = (index.clone(), stop.clone(), churned.clone());
        let ids = ids.clone();
        let evs: Vec<Event> = pop
            .events
            .iter()
            .take(2000)
            .map(|e| Event {
                worker: e.worker,
                parent: e.parent,
                seed: e.seed,
                hashes: e.hashes.clone(),
                tokens: e.tokens.clone(),
            })
            .collect();
        std::thread::spawn(move || {
            while !stop.load(Ordering::Relaxed) {
                for ev in &evs {
                    index
                        .remove(&ids[ev.worker], &ev.hashes, Medium::Device)
                        .expect("remove");
                    apply(&index, &ids, ev);
                    churned.fetch_add(ev.hashes.len() * 2, Ordering::Relaxed);
                    if stop.load(Ordering::Relaxed) {
                        break;
                    }
                }
            }
        })
    };
    let t = Instant::now();
    let lat = measure_queries(&index, &queries, QUERY_ROUNDS.load(Ordering::Relaxed));
    let elapsed = t.elapsed();
    stop.store(true, Ordering::Relaxed);
    writer.join().expect("writer");
    println!(
        "  query under apply churn    p50 {:>6.2} µs   p99 {:>6.2} µs   (writer applied {:.2} M block ops/s meanwhile)\n",
        percentile(&lat, 0.50) as f64 / 1000.0,
        percentile(&lat, 0.99) as f64 / 1000.0,
        churned.load(Ordering::Relaxed) as f64 / elapsed.as_secs_f64() / 1e6
    );
}

fn measure_queries(
    index: &KvIndex,
    queries: &[Vec<kv_epp_core::hashing::SequenceHash>],
    n: usize,
) -> Vec<u64> {
    let mut lat = Vec::with_capacity(n);
    for i in 0..n {
        let q = &queries[i % queries.len()];
        let t = Instant::now();
        black_box(index.query(q));
        lat.push(t.elapsed().as_nanos() as u64);
    }
    lat
}
