//! `make bench` (decision lanes): does a short chat request wait behind huge ones?
//!
//! Starts kv-epp in-process with the committed small BPE tokenizer and measures, through a real
//! gRPC client, the decision latency of ≈1k-token chat requests (request headers sent → the
//! routing decision received), first alone, then while 4 clients keep sending multi-MiB chat
//! bodies that must be tokenized, and prints p50/p99 of both and the loaded/alone ratio in one
//! run. Every prompt is unique, so the tokenizer's segment cache does not hide the work.
//! The goal of the two lanes is a ratio of at most 3×, p50 and p99.

#[path = "../tests/common/mod.rs"]
mod common;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Instant;

use envoy_types::pb::envoy::service::ext_proc::v3::ProcessingRequest;
use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_client::ExternalProcessorClient;
use envoy_types::pb::envoy::service::ext_proc::v3::processing_response::Response;
use envoy_types::pb::google::protobuf::value::Kind;
use tonic::transport::Channel;

use common::kv_epp_config;
use kv_epp::server::Server;

/// Small requests measured alone, and at least as many under load (which goes on until the big
/// clients are done, ~2,000-2,800 requests): with 200, the p99 alone was their second-highest,
/// too few to divide by.
const SMALL_REQUESTS: usize = 2_000;
const WARMUP: usize = 20;
const BIG_CLIENTS: usize = 4;
const BIG_BODY_BYTES: usize = 4 << 20;

fn pct(v: &mut [f64], q: f64) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    let rank = ((q * v.len() as f64).ceil() as usize).clamp(1, v.len());
    v[rank - 1]
}

/// Lowers the calling thread's CPU priority to the lowest (Linux: nice is per thread).
fn lowest_priority() {
    // SAFETY: gettid has no preconditions; setpriority on our own thread id only changes its
    // scheduling priority, and a failure (its return value) leaves it as it was.
    unsafe {
        libc::setpriority(libc::PRIO_PROCESS, libc::gettid() as libc::id_t, 19);
    }
}

/// A chat body whose user message is `words` pseudo-random words, unique per `seed`.
fn chat(seed: u64, words: usize) -> Vec<u8> {
    const VOCAB: [&str; 16] = [
        "cache", "prefix", "token", "worker", "route", "engine", "block", "salt", "index", "pick",
        "load", "queue", "model", "prompt", "reply", "stream",
    ];
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut text = format!("request {seed}:");
    for _ in 0..words {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        text.push(' ');
        text.push_str(VOCAB[(x % 16) as usize]);
    }
    serde_json::json!({
        "model": "m",
        "messages": [
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": text}
        ],
        "max_tokens": 8
    })
    .to_string()
    .into_bytes()
}

/// A FULL_DUPLEX_STREAMED chat request: headers, then the whole body.
fn messages(body: Vec<u8>) -> Vec<ProcessingRequest> {
    vec![
        common::extproc::request_headers("/v1/chat/completions", 4, 4, &[]),
        common::extproc::request_body(body, true),
    ]
}

/// Sends one request and waits for the decision; returns (seconds, prompt tokens).
async fn decide(client: &mut ExternalProcessorClient<Channel>, body: Vec<u8>) -> (f64, u64) {
    let started = Instant::now();
    let mut answers = client
        .process(tokio_stream::iter(messages(body)))
        .await
        .expect("ext_proc stream")
        .into_inner();
    let first = answers
        .message()
        .await
        .expect("an answer")
        .expect("an answer");
    let elapsed = started.elapsed().as_secs_f64();
    // Read the stream to its end, as Envoy does: a client that drops it early resets it, and
    // thousands of resets on one connection make the HTTP/2 server send GOAWAY.
    while let Ok(Some(_)) = answers.message().await {}
    assert!(
        matches!(first.response, Some(Response::RequestHeaders(_))),
        "expected the routing decision, got {first:?}"
    );
    let tokens = first
        .dynamic_metadata
        .as_ref()
        .and_then(|m| m.fields.get("kv-epp"))
        .and_then(|v| match &v.kind {
            Some(Kind::StructValue(s)) => s.fields.get("prompt_tokens"),
            _ => None,
        })
        .and_then(|v| match &v.kind {
            Some(Kind::NumberValue(n)) => Some(*n as u64),
            Some(Kind::StringValue(s)) => s.parse().ok(),
            _ => None,
        })
        .unwrap_or(0);
    (elapsed, tokens)
}

async fn small_run(
    client: &mut ExternalProcessorClient<Channel>,
    seed0: u64,
    words: usize,
    n: usize,
    until: impl Fn() -> bool,
) -> (Vec<f64>, u64) {
    let mut ms = Vec::with_capacity(n);
    let mut tokens = 0;
    let mut i = 0u64;
    // At least `n` measured requests, and on until `until()` holds.
    while ms.len() < n || !until() {
        let (s, t) = decide(client, chat(seed0 + i, words)).await;
        if i >= WARMUP as u64 {
            ms.push(s * 1e3);
            tokens = t;
        }
        i += 1;
    }
    (ms, tokens)
}

#[tokio::main(flavor = "multi_thread")]
async fn main() {
    let tokenizer =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tokenizer/small-bpe");
    let workers: Vec<SocketAddr> = vec![
        "127.0.0.1:18101".parse().unwrap(),
        "127.0.0.1:18102".parse().unwrap(),
    ];
    // The big bodies must be tokenized whole: with the small BPE a 4 MiB body is ~1.2M tokens,
    // over the production default of `max_prompt_tokens` (1,048,576), which would refuse it early.
    let extra = format!(
        "models: [{{name: m, block_size: 16, max_prompt_tokens: 4194304, tokenizer: {{path: '{}'}}}}]\n",
        tokenizer.display()
    );
    let server = Server::start(&kv_epp_config(&workers, &extra))
        .await
        .expect("kv-epp starts");
    let url = format!("http://{}", server.grpc_addr);
    let mut client = ExternalProcessorClient::connect(url.clone())
        .await
        .expect("connect");

    // ≈1k tokens: calibrate the word count on one request.
    let (_, t) = decide(&mut client, chat(0, 500)).await;
    let words = (500 * 1000 / t.max(1)) as usize;
    // `cargo test --all-targets` runs this binary without `--bench`: a short smoke run then.
    let full = std::env::args().any(|a| a == "--bench");
    let (n, big_bytes) = if full {
        (SMALL_REQUESTS, BIG_BODY_BYTES)
    } else {
        (10, 256 << 10)
    };
    let (mut alone, tokens) = small_run(&mut client, 1_000, words, n, || true).await;

    let stop = Arc::new(AtomicBool::new(false));
    let big_done = Arc::new(AtomicUsize::new(0));
    let big_words = big_bytes / 7;
    // The big clients are the load generator, which stands in for Envoy, another process on
    // another machine in a deployment: they run on a runtime of their own at the lowest CPU
    // priority, so the 2 cores measure kv-epp's own work (receiving, decoding and tokenizing the
    // big bodies at its normal priority) rather than this process's generator.
    let generator = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .on_thread_start(lowest_priority)
        .enable_all()
        .build()
        .expect("generator runtime");
    let mut big = Vec::new();
    for c in 0..BIG_CLIENTS as u64 {
        let (stop, done, url) = (stop.clone(), big_done.clone(), url.clone());
        big.push(generator.spawn(async move {
            let mut client = ExternalProcessorClient::connect(url)
                .await
                .expect("connect")
                .max_decoding_message_size(64 << 20);
            let mut i = 0;
            while !stop.load(Ordering::Relaxed) {
                // Built off the runtime's threads: they serve kv-epp's streams in this process,
                // and a 4 MiB body built inline would stall them (the generator's cost, not kv-epp's).
                let seed = 1_000_000 * (c + 1) + i;
                let body = tokio::task::spawn_blocking(move || chat(seed, big_words))
                    .await
                    .expect("body");
                let (_, t) = decide(&mut client, body).await;
                assert!(t > 0, "a big request was decided without its tokens");
                done.fetch_add(1, Ordering::Relaxed);
                i += 1;
            }
        }));
    }
    // Measure while the big bodies are being tokenized: on until every big client has had at
    // least two decisions (so the small requests overlapped whole big ones), not for a fixed time.
    let done = big_done.clone();
    let (mut loaded, _) = small_run(&mut client, 10_000, words, n, move || {
        done.load(Ordering::Relaxed) >= 2 * BIG_CLIENTS
    })
    .await;
    stop.store(true, Ordering::Relaxed);
    let big_finished = big_done.load(Ordering::Relaxed);
    for b in big {
        b.await.expect("a big client failed");
    }
    generator.shutdown_background();

    let (a50, a99, l50, l99) = (
        pct(&mut alone, 0.5),
        pct(&mut alone, 0.99),
        pct(&mut loaded, 0.5),
        pct(&mut loaded, 0.99),
    );
    println!(
        "decision latency, {tokens}-token chat requests (small BPE), {} alone, {} loaded, {} cores",
        alone.len(),
        loaded.len(),
        std::thread::available_parallelism().map_or(1, |n| n.get())
    );
    println!("{:>34} | {:>9} {:>9}", "", "p50", "p99");
    println!("{:>34} | {a50:>7.2}ms {a99:>7.2}ms", "alone");
    println!(
        "{:>34} | {l50:>7.2}ms {l99:>7.2}ms",
        format!("with {BIG_CLIENTS} × {} KiB bodies", big_bytes >> 10)
    );
    println!(
        "{:>34} | {:>8.2}x {:>8.2}x   (goal: ≤ 3x; {big_finished} big decisions meanwhile)",
        "ratio",
        l50 / a50,
        l99 / a99
    );
    server.stop().await;
}
