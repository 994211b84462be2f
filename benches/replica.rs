//! `make bench`, replicas: what bootstrapping a replica from a peer costs, and whether three
//! active-active replicas route as well as one.
//!
//! - Snapshot: a replica holding 1M and 10M (worker, block) entries serves its index over the
//!   real peer API on loopback to a second replica; reported: bytes on the wire (and per entry),
//!   bootstrap time, and, as the baseline measured in the same run, the time the same blocks take
//!   to apply from engine events; plus the largest transient allocation during the transfer
//!   (from a counting allocator), which must stay bounded by one worker's share, not the index.
//! - Hit rate: the in-process fleet with one kv-epp vs three replicas on the same workload
//!   (target: equal within 1%).

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use kv_epp::config::{Config, PeersConfig};
use kv_epp::decide::Picker;
use kv_epp::events::Feeds;
use kv_epp::metrics::Metrics;
use kv_epp::readiness::Readiness;
use kv_epp::replica::{self, ReplicaState};
use kv_epp_core::hashing::HashSeed;
use kv_epp_core::index::holders::MAPPED_BYTES;
use kv_epp_core::index::{EngineBlockHash, Medium, StoreBlocks};
use kv_epp_core::scoring::ScoringConfig;
use kv_epp_sim::fleet::{FleetSpec, Policy, one_and_replicas, simulate};
use kv_epp_sim::workload::{GeneratorSpec, generate};

#[path = "support/peak_alloc.rs"]
mod peak_alloc;

#[global_allocator]
static ALLOC: peak_alloc::Counting = peak_alloc::Counting;

const BS: usize = 16;
const WORKERS: usize = 64;

fn live() -> usize {
    peak_alloc::live() + MAPPED_BYTES.load(Ordering::Relaxed)
}

fn main() {
    let full = std::env::args().any(|a| a == "--bench");
    println!("kv-epp replica benchmarks (one process, same run for every ratio)\n");
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    let sizes: &[usize] = if full {
        &[1_000_000, 10_000_000]
    } else {
        &[20_000]
    };
    for &n in sizes {
        rt.block_on(bench_snapshot(n));
    }
    bench_hit_rate(full);
    if !full {
        println!("(smoke run; `make bench` runs the full benchmarks)");
    }
}

fn config() -> Config {
    let workers: Vec<String> = (0..WORKERS)
        .map(|i| {
            format!(
                "{{endpoint: '10.1.{}.{}:8000', model: m}}",
                i / 200,
                i % 200
            )
        })
        .collect();
    let yaml = format!(
        "models: [{{name: m, block_size: {BS}}}]\nindex: {{capacity: 100000000, max_blocks_per_worker: 10000000}}\nevents: {{engine: none}}\nworkers: [{}]\n",
        workers.join(", ")
    );
    let c = Config::from_yaml(&yaml).expect("config");
    c.validate().expect("valid");
    c
}

async fn replica(
    picker: Arc<Picker>,
    peers: Vec<String>,
    stop: tokio::sync::watch::Receiver<bool>,
) -> (Arc<ReplicaState>, std::net::SocketAddr) {
    let cfg = PeersConfig {
        static_peers: peers,
        probe_interval_ms: 50,
        ..PeersConfig::default()
    };
    let state = ReplicaState::new(
        picker.workers.clone(),
        Arc::new(Metrics::new()),
        Arc::new(Feeds::default()),
        cfg,
        Some("bench-token".into()),
        None,
        Readiness::default(),
    )
    .expect("replica");
    let l = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = l.local_addr().expect("addr");
    replica::start(state.clone(), l, stop);
    (state, addr)
}

async fn wait_ready(s: &ReplicaState) {
    while !s.is_ready() {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// Fills `n` entries over the workers as 64-block chains of a few tenants, through the same
/// store path engine events take. Returns the time it took.
fn fill(picker: &Picker, n: usize) -> Duration {
    let index = picker.models.index("m").expect("model");
    let ids: Vec<_> = picker.workers.all().iter().map(|w| w.id).collect();
    let chain = 64;
    let mut tokens = vec![0u32; chain * BS];
    let mut hashes = vec![EngineBlockHash(0); chain];
    let started = Instant::now();
    let mut done = 0usize;
    let mut c = 0u64;
    while done < n {
        let w = &ids[c as usize % ids.len()];
        for (i, t) in tokens.iter_mut().enumerate() {
            *t = (c as u32)
                .wrapping_mul(2_654_435_761)
                .wrapping_add(i as u32)
                % 100_000;
        }
        for (i, h) in hashes.iter_mut().enumerate() {
            *h = EngineBlockHash(c << 8 | i as u64);
        }
        let tenant = format!("tenant-{}", c % 7);
        let k = chain.min(n - done);
        index
            .store(
                w,
                &StoreBlocks {
                    parent: None,
                    root_seed: Some(HashSeed::new(None, Some(&tenant))),
                    engine_hashes: &hashes[..k],
                    tokens: &tokens[..k * BS],
                    medium: Medium::Device,
                },
            )
            .expect("store");
        done += k;
        c += 1;
    }
    started.elapsed()
}

async fn bench_snapshot(n: usize) {
    let (stop_tx, stop) = tokio::sync::watch::channel(false);
    let cfg = config();
    let src_picker = Arc::new(cfg.picker(Arc::new(Metrics::new())).expect("picker"));
    let apply = fill(&src_picker, n);
    let (src, src_addr) = replica(src_picker.clone(), vec![], stop.clone()).await;
    wait_ready(&src).await;
    let dst_picker = Arc::new(cfg.picker(Arc::new(Metrics::new())).expect("picker"));
    let before = live();
    let started = Instant::now();
    let (dst, _) = replica(dst_picker.clone(), vec![src_addr.to_string()], stop).await;
    wait_ready(&dst).await;
    let took = started.elapsed();
    let after = live();
    let (a, b) = (
        src_picker.models.index("m").expect("m").digest(),
        dst_picker.models.index("m").expect("m").digest(),
    );
    assert_eq!(a, b, "the bootstrapped index equals its source");
    let bytes = dst.counters.snapshot_bytes.get();
    // The transfer itself (sender copies, chunks in flight, decoding), without the receiver's
    // index growing: stream the snapshot again into a reader that drops each chunk.
    let mut client =
        kv_epp::replica::pb::replica_client::ReplicaClient::connect(format!("http://{src_addr}"))
            .await
            .expect("connect")
            .max_decoding_message_size(4 << 20);
    let mut req = tonic::Request::new(kv_epp::replica::pb::SnapshotRequest::default());
    req.metadata_mut().insert(
        "authorization",
        "Bearer bench-token".parse().expect("ascii"),
    );
    // PEAK follows the allocator alone (the index's mapped arrays do not change here).
    let base = peak_alloc::start_peak();
    let mut stream = client.snapshot(req).await.expect("snapshot").into_inner();
    let mut chunks = 0usize;
    while let Some(m) = stream.message().await.expect("chunk") {
        chunks += 1;
        std::hint::black_box(m);
    }
    let transient = peak_alloc::peak_above(base);
    println!("snapshot of {n} entries over {WORKERS} workers (loopback, token auth):");
    println!(
        "  size {:.1} MB ({:.1} B/entry); bootstrap {:.2} s = {:.2}x the time to apply the same blocks from events ({:.2} s)",
        bytes as f64 / 1e6,
        bytes as f64 / n as f64,
        took.as_secs_f64(),
        took.as_secs_f64() / apply.as_secs_f64(),
        apply.as_secs_f64()
    );
    println!(
        "  peak memory of a transfer ({chunks} chunks) {:.1} MB = {:.3}x the index it copies ({:.1} MB); one worker's 24 B/entry copy is {:.1} MB",
        transient as f64 / 1e6,
        transient as f64 / (after - before).max(1) as f64,
        (after - before) as f64 / 1e6,
        (n / WORKERS * 24) as f64 / 1e6
    );
    let _ = stop_tx.send(true);
}

fn bench_hit_rate(full: bool) {
    let sessions = if full { 24 } else { 3 };
    // The default multi-turn mix, and a load-heavy one (many tenants with their own prompts
    // arriving fast) where in-flight counts decide more placements.
    let mixes = [
        (
            "multi-turn, 20 req/s",
            GeneratorSpec {
                tenants: 8,
                sessions_per_tenant: sessions,
                ..GeneratorSpec::default()
            },
        ),
        (
            "32 tenants, 200 req/s",
            GeneratorSpec {
                tenants: 32,
                shared_prompt_tenants: 0,
                sessions_per_tenant: sessions / 2 + 1,
                rate_per_s: 200.0,
                ..GeneratorSpec::default()
            },
        ),
    ];
    for (name, mix) in mixes {
        let work = generate(&mix);
        let spec = FleetSpec::new(8, 4096, BS);
        let policy = Policy::KvAware(ScoringConfig::default());
        let (one, three) = one_and_replicas(&spec, 3, &policy, &work);
        let rr = simulate(&spec, &Policy::RoundRobin, &work).total();
        let (h1, h3) = (one.total().hit_rate(), three.total().hit_rate());
        println!(
            "routing, {name}, {} requests over 8 workers: hit rate 1 replica {:.2}%, 3 replicas {:.2}% (ratio {:.4}; target within 1%); mean TTFT {:.1} vs {:.1} ms; {} of the 3-replica decisions saw partial in-flight counts; round-robin {:.2}%",
            work.len(),
            h1 * 100.0,
            h3 * 100.0,
            h3 / h1,
            one.total().mean_ttft_ms(),
            three.total().mean_ttft_ms(),
            three.partial_load_views,
            rr.hit_rate() * 100.0
        );
    }
}
