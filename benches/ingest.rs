//! `make bench`: KV event ingestion over real ZeroMQ sockets on loopback, against applying the
//! same events straight to the index, in one run.
//!
//! Load: 256 simulated vLLM workers (the simulator's prefix cache and its batch encoder, whose
//! bytes are checked against vLLM's own code in tests/sim and tests/vllm: map layout, integer
//! hashes), each admitting salted requests of 4 tenants (a 1,024-token system prompt per tenant
//! plus 512–1,536 tokens of its own; blocks of 16; evictions once a worker's 4,096 blocks are
//! full), 4 requests per published batch. Every message of a worker is framed as ZMTP 3 frames
//! `[topic, seq, payload]` before the clock starts; each worker's publisher is a minimal ZMTP
//! PUB (greeting, READY, reads the subscription, then writes its messages), so the load source
//! costs one socket write per worker, not an encoder.
//!
//! Measured: kv-epp's real feed path (`events::Feeds`: one subscriber task per worker over our
//! ZMTP client, sequence tracking, msgpack decoding, the salt's namespace, `engine_event::apply`)
//! on a one-thread Tokio runtime (one core; the publishers write from another thread), timed from
//! the first write until every batch is applied. Baseline: the same events, decoded beforehand,
//! applied by one thread through the same `engine_event::apply`. Both indexes must end with the
//! same blocks per worker (checked), and no event may be dropped. Printed twice: by wall time, and
//! by the CPU time of the thread doing the work (the direct thread; the runtime's one worker),
//! which other load on a shared machine does not move.
//!
//! `cargo test --all-targets` runs this binary without `--bench`: a smoke run with 4 workers.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

use kv_epp::events::Feeds;
use kv_epp::events::subscriber::{Dropped, FeedEndpoints};
use kv_epp::events::vllm::Dialect;
use kv_epp::events::zmtp::Limits;
use kv_epp_core::engine_event::{self, EngineEvent, EventCounters, StoredRun, tier_bit};
use kv_epp_core::index::{EngineBlockHash, IndexLimits, KvIndex, Medium};
use kv_epp_core::namespace::{self, ExtraKey as CoreKey, Namespace};
use kv_epp_core::salt::{CacheSalt, SaltSource};
use kv_epp_core::worker::WorkerId;
use kv_epp_sim::events::{BatchEncoder, EventLayout, HashForm, SimEngine};
use kv_epp_sim::prefix_cache::{CacheEvent, CacheRequest, EngineDigest, PrefixCache};

const BLOCK: usize = 16;
const TENANTS: usize = 4;
const SYSTEM_TOKENS: usize = 1024;
const CACHE_BLOCKS: usize = 4096;

/// The size of one run.
#[derive(Clone, Copy)]
struct Shape {
    workers: usize,
    batches: usize,
    requests_per_batch: usize,
    /// Batches of decode-time stores after each prefill batch: one single-block `BlockStored`
    /// per request of the prefill batch, continuing it (what generation publishes every 16
    /// tokens).
    decode_batches: usize,
}

/// One worker's load: its ZMTP byte stream and the same events, decoded.
struct WorkerLoad {
    wire: Vec<u8>,
    events: Vec<EngineEvent>,
    batches: u64,
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let full = args.iter().any(|a| a == "--bench");
    // `--workers N --batches M`: another size (for profiling under callgrind).
    let arg = |name: &str| {
        args.iter()
            .position(|a| a == name)
            .and_then(|i| args.get(i + 1))
            .and_then(|v| v.parse::<usize>().ok())
    };
    println!(
        "kv-epp ingestion benchmark (block size {BLOCK}; one process, same run for every ratio)\n"
    );
    let (workers, batches) = if full { (256, 24) } else { (4, 3) };
    let workers = arg("--workers").unwrap_or(workers);
    let batches = arg("--batches").unwrap_or(batches);
    println!("prefill: 4 new salted requests per batch (~48 blocks per event)");
    run(
        Shape {
            workers,
            batches,
            requests_per_batch: 4,
            decode_batches: 0,
        },
        full,
    );
    println!(
        "prefill then decode: 32 requests per prefill batch, then 4 batches of one 1-block store per request"
    );
    run(
        Shape {
            workers,
            batches: (batches / 4).max(1),
            requests_per_batch: 32,
            decode_batches: 4,
        },
        full,
    );
    if !full {
        println!("(smoke run; `make bench` runs the full benchmark)");
    }
}

/// Generates one mix, applies it both ways, checks both indexes agree and prints the figures.
fn run(shape: Shape, full: bool) {
    let loads = generate(shape);
    let batches: u64 = loads.iter().map(|l| l.batches).sum();
    let events: usize = loads.iter().map(|l| l.events.len()).sum();
    let stored_blocks: usize = loads
        .iter()
        .flat_map(|l| &l.events)
        .map(|e| match e {
            EngineEvent::Stored(run) => run.engine_hashes.len(),
            _ => 0,
        })
        .sum();
    let wire: usize = loads.iter().map(|l| l.wire.len()).sum();
    println!(
        "{} workers, {batches} batches, {events} events, {stored_blocks} stored blocks, {:.1} MB on the wire",
        shape.workers,
        wire as f64 / 1e6
    );

    let ids: Vec<WorkerId> = (0..shape.workers)
        .map(|i| {
            WorkerId::new(
                format!("127.0.0.{}:{}", 1 + i / 250, 8000 + i % 250)
                    .parse()
                    .expect("addr"),
            )
        })
        .collect();

    // Baseline: best of 3, a fresh index each time.
    let mut direct = Timing {
        wall: Duration::MAX,
        cpu: Duration::MAX,
    };
    let mut direct_index = None;
    for _ in 0..if full { 3 } else { 1 } {
        let (t, index) = apply_direct(&ids, &loads);
        direct.wall = direct.wall.min(t.wall);
        direct.cpu = direct.cpu.min(t.cpu);
        direct_index = Some(index);
    }
    let direct_index = direct_index.expect("one run");

    let (fed, fed_index) = apply_over_zmq(&ids, &loads, batches);
    for w in &ids {
        assert_eq!(
            fed_index.worker_blocks(w).expect("worker"),
            direct_index.worker_blocks(w).expect("worker"),
            "the fed index must hold what direct apply holds"
        );
    }
    let rate = |t: Duration| {
        (
            events as f64 / t.as_secs_f64(),
            stored_blocks as f64 / t.as_secs_f64() / 1e6,
        )
    };
    for (what, d, f) in [
        ("wall", direct.wall, fed.wall),
        ("CPU ", direct.cpu, fed.cpu),
    ] {
        let (de, db) = rate(d);
        let (fe, fb) = rate(f);
        println!(
            "  {what}  direct index apply (1 thread)      {de:>10.0} events/s   {db:>6.2} M blocks/s   (baseline)"
        );
        println!(
            "  {what}  from ZeroMQ: decoded + applied     {fe:>10.0} events/s   {fb:>6.2} M blocks/s   {:.2}x of direct apply",
            d.as_secs_f64() / f.as_secs_f64()
        );
    }
    println!();
}

/// Simulated workers' batches: wire bytes and decoded events.
fn generate(shape: Shape) -> Vec<WorkerLoad> {
    let mut rng = SmallRng::seed_from_u64(23);
    let systems: Vec<Vec<u32>> = (0..TENANTS)
        .map(|_| {
            (0..SYSTEM_TOKENS)
                .map(|_| rng.random_range(0..128_000))
                .collect()
        })
        .collect();
    let salts: Vec<String> = (0..TENANTS)
        .map(|t| {
            let salt = CacheSalt::new(&format!("tenant-{t}"), SaltSource::Header)
                .expect("salt")
                .expect("non-empty");
            Namespace::of(&salt).forwarded()
        })
        .collect();
    let encoder = BatchEncoder {
        engine: SimEngine::Vllm,
        layout: EventLayout::Map,
        hash_form: HashForm::Int,
        block_size: BLOCK,
        lora_modules: Vec::new(),
        data_parallel_rank: None,
    };
    (0..shape.workers)
        .map(|_| {
            let mut cache = PrefixCache::new(CACHE_BLOCKS, BLOCK);
            let mut wire = Vec::new();
            let mut events = Vec::new();
            let mut batches: Vec<Vec<CacheEvent>> = Vec::new();
            // The last block of each request of the current prefill batch.
            let mut running: Vec<EngineDigest> = Vec::new();
            for _ in 0..shape.batches {
                for _ in 0..shape.requests_per_batch {
                    let t = rng.random_range(0..TENANTS);
                    let mut tokens = systems[t].clone();
                    let own = rng.random_range(512..1536);
                    tokens.extend((0..own).map(|_| rng.random_range(0..128_000u32)));
                    let req = CacheRequest {
                        tokens: &tokens,
                        salt: Some(&salts[t]),
                        lora_name: None,
                    };
                    let admitted = cache.admit(&req).expect("cache holds a request");
                    cache.release(&admitted.blocks);
                    running.extend(cache.digests_of(&req).last().copied());
                }
                batches.push(cache.take_events());
                for _ in 0..shape.decode_batches {
                    let batch = running
                        .iter_mut()
                        .map(|last| {
                            let mut d = [0u8; 32];
                            rng.fill(&mut d[..]);
                            let parent = std::mem::replace(last, EngineDigest(d));
                            CacheEvent::Stored {
                                parent: Some(parent),
                                hashes: vec![EngineDigest(d)],
                                tokens: (0..BLOCK).map(|_| rng.random_range(0..128_000)).collect(),
                                extra_keys: vec![Vec::new()],
                                lora_name: None,
                                salt: None,
                            }
                        })
                        .collect();
                    batches.push(batch);
                }
                running.clear();
            }
            for (seq, batch) in batches.iter().enumerate() {
                let payload = encoder.encode_batch(1.0 + seq as f64, batch);
                frame(&mut wire, true, b"");
                frame(&mut wire, true, &(seq as u64).to_be_bytes());
                frame(&mut wire, false, &payload);
                events.extend(batch.iter().map(decoded));
            }
            WorkerLoad {
                wire,
                events,
                batches: batches.len() as u64,
            }
        })
        .collect()
}

/// A simulator event as kv-epp's decoder turns it into an engine-neutral one.
fn decoded(e: &CacheEvent) -> EngineEvent {
    match e {
        CacheEvent::Stored {
            parent,
            hashes,
            tokens,
            extra_keys,
            lora_name,
            ..
        } => {
            let root_seed = if parent.is_some() {
                None
            } else {
                let keys: Vec<CoreKey> = extra_keys
                    .first()
                    .into_iter()
                    .flatten()
                    .map(|k| match k {
                        kv_epp_sim::prefix_cache::ExtraKey::Str(s) => CoreKey::Str(s.clone()),
                    })
                    .collect();
                namespace::root_seed(lora_name.as_deref(), &keys)
            };
            EngineEvent::Stored(StoredRun {
                parent: parent.map(|p| EngineBlockHash(p.as_u64())),
                root_seed,
                engine_hashes: hashes.iter().map(|h| EngineBlockHash(h.as_u64())).collect(),
                tokens: tokens.clone(),
                medium: Medium::Device,
                block_size: Some(BLOCK),
                session_id: None,
            })
        }
        CacheEvent::Removed { hashes } => EngineEvent::Removed {
            engine_hashes: hashes.iter().map(|h| EngineBlockHash(h.as_u64())).collect(),
            tiers: tier_bit(Medium::Device),
        },
        CacheEvent::Cleared => EngineEvent::Cleared,
    }
}

/// Appends one ZMTP 3 message frame.
fn frame(out: &mut Vec<u8>, more: bool, body: &[u8]) {
    let more = u8::from(more);
    if let Ok(short) = u8::try_from(body.len()) {
        out.extend_from_slice(&[more, short]);
    } else {
        out.push(more | 0x02);
        out.extend_from_slice(&(body.len() as u64).to_be_bytes());
    }
    out.extend_from_slice(body);
}

fn fresh_index(ids: &[WorkerId]) -> Arc<KvIndex> {
    let index = Arc::new(KvIndex::new(BLOCK, IndexLimits::default()));
    for w in ids {
        index.add_worker(*w);
    }
    index
}

/// Applies every worker's events on this thread, one batch round at a time across workers.
fn apply_direct(ids: &[WorkerId], loads: &[WorkerLoad]) -> (Timing, Arc<KvIndex>) {
    let index = fresh_index(ids);
    let counters = EventCounters::default();
    let mut cursors: Vec<std::slice::Iter<'_, EngineEvent>> =
        loads.iter().map(|l| l.events.iter()).collect();
    let per_round = loads
        .iter()
        .map(|l| l.events.len().div_ceil(l.batches.max(1) as usize))
        .max()
        .unwrap_or(1);
    let t = Instant::now();
    let cpu = thread_cpu();
    loop {
        let mut any = false;
        for (w, events) in ids.iter().zip(cursors.iter_mut()) {
            for ev in events.by_ref().take(per_round) {
                any = true;
                engine_event::apply(&index, w, ev, &counters).expect("apply");
            }
        }
        if !any {
            break;
        }
    }
    (
        Timing {
            wall: t.elapsed(),
            cpu: thread_cpu() - cpu,
        },
        index,
    )
}

/// Wall time, and CPU time of the thread(s) doing the work (robust to other load on the machine).
#[derive(Clone, Copy)]
struct Timing {
    wall: Duration,
    cpu: Duration,
}

/// CPU time the calling thread has used.
fn thread_cpu() -> Duration {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid, writable timespec; CLOCK_THREAD_CPUTIME_ID needs nothing else.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    assert_eq!(rc, 0, "clock_gettime");
    Duration::new(ts.tv_sec as u64, ts.tv_nsec as u32)
}

/// The feed path: a minimal ZMTP PUB per worker on loopback, kv-epp's feeds subscribed to them.
fn apply_over_zmq(ids: &[WorkerId], loads: &[WorkerLoad], batches: u64) -> (Timing, Arc<KvIndex>) {
    let index = fresh_index(ids);
    let publishers = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let kv_epp = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .expect("runtime");
    // Bind every publisher first, so the feeds find them.
    let listeners: Vec<std::net::TcpListener> = ids
        .iter()
        .map(|_| std::net::TcpListener::bind("127.0.0.1:0").expect("bind"))
        .collect();
    let subscribed = Arc::new(AtomicUsize::new(0));
    let (go_tx, go_rx) = tokio::sync::watch::channel(false);
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let feeds = Feeds::new(Limits::default());
    {
        let _g = kv_epp.enter();
        for (w, l) in ids.iter().zip(&listeners) {
            let port = l.local_addr().expect("addr").port();
            feeds.start(
                *w,
                index.clone(),
                FeedEndpoints {
                    events: format!("tcp://127.0.0.1:{port}"),
                    replay: None,
                    topic: String::new(),
                    dialect: Dialect::Vllm,
                },
            );
        }
    }
    let publisher_thread = {
        let wires: Vec<Vec<u8>> = loads.iter().map(|l| l.wire.clone()).collect();
        let subscribed = subscribed.clone();
        std::thread::spawn(move || {
            publishers.block_on(async move {
                let mut tasks = Vec::new();
                for (l, wire) in listeners.into_iter().zip(wires) {
                    l.set_nonblocking(true).expect("nonblocking");
                    let l = TcpListener::from_std(l).expect("listener");
                    tasks.push(tokio::spawn(publish(
                        l,
                        wire,
                        subscribed.clone(),
                        go_rx.clone(),
                        stop_rx.clone(),
                    )));
                }
                for t in tasks {
                    t.await.expect("publisher");
                }
            })
        })
    };
    let deadline = Instant::now() + Duration::from_secs(60);
    while subscribed.load(Ordering::Acquire) < ids.len() {
        assert!(Instant::now() < deadline, "subscribers did not connect");
        std::thread::sleep(Duration::from_millis(5));
    }
    let statuses: Vec<_> = feeds.statuses().into_iter().map(|(_, _, s)| s).collect();
    // The runtime has one worker thread: every feed task runs there.
    let cpu_on_worker = || {
        kv_epp
            .block_on(kv_epp.spawn(async { thread_cpu() }))
            .expect("cpu")
    };
    let cpu = cpu_on_worker();
    let t = Instant::now();
    go_tx.send(true).expect("go");
    let applied = || {
        statuses
            .iter()
            .map(|s| s.batches.load(Ordering::Relaxed))
            .sum::<u64>()
    };
    let deadline = Instant::now() + Duration::from_secs(300);
    while applied() < batches {
        assert!(Instant::now() < deadline, "feeds did not apply every batch");
        std::thread::sleep(Duration::from_micros(500));
    }
    let elapsed = Timing {
        wall: t.elapsed(),
        cpu: cpu_on_worker() - cpu,
    };
    for s in &statuses {
        for why in Dropped::ALL {
            assert_eq!(s.drop_count(why), 0, "dropped {}", why.label());
        }
    }
    stop_tx.send(true).expect("stop");
    publisher_thread.join().expect("publishers");
    drop(feeds);
    kv_epp.shutdown_timeout(Duration::from_secs(5));
    (elapsed, index)
}

/// One worker's publisher: accepts the feed, does the ZMTP 3 PUB handshake, waits for its
/// subscription, then, on `go`, writes every message at once and holds the connection until
/// `stop`.
async fn publish(
    listener: TcpListener,
    wire: Vec<u8>,
    subscribed: Arc<AtomicUsize>,
    mut go: tokio::sync::watch::Receiver<bool>,
    mut stop: tokio::sync::watch::Receiver<bool>,
) {
    let (mut s, _) = listener.accept().await.expect("accept");
    let _ = s.set_nodelay(true);
    let mut hello = vec![0u8; 64];
    hello[0] = 0xFF;
    hello[8] = 0x01;
    hello[9] = 0x7F;
    hello[10] = 3;
    hello[12..16].copy_from_slice(b"NULL");
    let mut ready = vec![5];
    ready.extend_from_slice(b"READY");
    ready.push(11);
    ready.extend_from_slice(b"Socket-Type");
    ready.extend_from_slice(&3u32.to_be_bytes());
    ready.extend_from_slice(b"PUB");
    hello.extend_from_slice(&[0x04, ready.len() as u8]);
    hello.extend_from_slice(&ready);
    s.write_all(&hello).await.expect("greet");
    let mut greeting = [0u8; 64];
    s.read_exact(&mut greeting).await.expect("greeting");
    // The peer's READY command, then its subscription (a message `0x01 ++ topic`).
    loop {
        let (flags, body) = read_frame(&mut s).await;
        if flags & 0x04 == 0 {
            assert_eq!(body.first(), Some(&1), "a subscription");
            break;
        }
    }
    subscribed.fetch_add(1, Ordering::Release);
    let _ = go.wait_for(|g| *g).await;
    s.write_all(&wire).await.expect("publish");
    let _ = stop.wait_for(|s| *s).await;
}

async fn read_frame(s: &mut TcpStream) -> (u8, Vec<u8>) {
    let flags = s.read_u8().await.expect("flags");
    let size = if flags & 0x02 != 0 {
        s.read_u64().await.expect("size")
    } else {
        u64::from(s.read_u8().await.expect("size"))
    };
    let mut body = vec![0u8; usize::try_from(size).expect("size").min(4096)];
    s.read_exact(&mut body).await.expect("body");
    (flags, body)
}
