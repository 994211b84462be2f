//! `make bench` (end to end): the latency kv-epp adds in front of a model server, measured through
//! a real Envoy 1.40 on loopback: client → Envoy → kv-epp (ext_proc, FULL_DUPLEX_STREAMED) →
//! upstream, against client → Envoy → upstream directly, in the same run, at a fixed request rate,
//! for 1k, 8k and 32k-token prompts (token-ID prompts, so tokenization is not included here).

#[path = "../tests/common/mod.rs"]
mod common;

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use common::{Envoy, EnvoyShape, Upstream, free_port, http, kv_epp_config};
use kv_epp::server::Server;

const REQUESTS: usize = 200;
const RATE_PER_S: f64 = 50.0;

fn pct(v: &mut [f64], q: f64) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    let rank = ((q * v.len() as f64).ceil() as usize).clamp(1, v.len());
    v[rank - 1]
}

/// One table row: direct and via-kv-epp percentiles, the added p50 and the ratio.
fn print_row(tokens: usize, direct: &mut [f64], via: &mut [f64]) {
    let (d50, d99, k50, k99) = (
        pct(direct, 0.5),
        pct(direct, 0.99),
        pct(via, 0.5),
        pct(via, 0.99),
    );
    println!(
        "{:>7}t | {:>8.2}ms {:>8.2}ms | {:>8.2}ms {:>8.2}ms | {:>8.2}ms {:>9.2}x",
        tokens,
        d50,
        d99,
        k50,
        k99,
        k50 - d50,
        k50 / d50
    );
}

/// Envoy straight to one upstream (no ext_proc): the baseline.
async fn direct_envoy(bin: &std::path::Path, upstream: SocketAddr) -> Envoy {
    let (port, admin) = (free_port(), free_port());
    let yaml = format!(
        r#"static_resources:
  listeners:
  - name: direct
    address: {{socket_address: {{address: 127.0.0.1, port_value: {port}}}}}
    per_connection_buffer_limit_bytes: 33554432
    filter_chains:
    - filters:
      - name: envoy.filters.network.http_connection_manager
        typed_config:
          "@type": type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager
          stat_prefix: direct
          route_config:
            virtual_hosts:
            - name: all
              domains: ["*"]
              routes:
              - match: {{prefix: "/"}}
                route: {{cluster: up, timeout: 60s}}
          http_filters:
          - name: envoy.filters.http.router
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.router.v3.Router
  clusters:
  - name: up
    type: STATIC
    connect_timeout: 2s
    load_assignment:
      cluster_name: up
      endpoints: [{{lb_endpoints: [{{endpoint: {{address: {{socket_address: {{address: 127.0.0.1, port_value: {}}}}}}}}}]}}]
admin:
  address: {{socket_address: {{address: 127.0.0.1, port_value: {admin}}}}}
"#,
        upstream.port()
    );
    Envoy::run(bin, port, admin, &yaml).await
}

/// Sends REQUESTS requests at RATE_PER_S (open loop) to `/v1/completions` and returns latencies.
async fn run(port: u16, body: &[u8]) -> Vec<f64> {
    run_at(port, "/v1/completions", body, REQUESTS, RATE_PER_S).await
}

/// Sends `n` requests at `rate` per second (open loop) and returns latencies in ms.
async fn run_at(port: u16, path: &'static str, body: &[u8], n: usize, rate: f64) -> Vec<f64> {
    let body = std::sync::Arc::new(body.to_vec());
    let gap = Duration::from_secs_f64(1.0 / rate);
    let start = Instant::now();
    let mut tasks = Vec::new();
    for i in 0..n {
        let due = start + gap * i as u32;
        tokio::time::sleep_until(due.into()).await;
        let body = body.clone();
        tasks.push(tokio::spawn(async move {
            let t = Instant::now();
            let r = http(
                ("127.0.0.1", port),
                "POST",
                path,
                &[("content-type", "application/json")],
                &body,
            )
            .await
            .expect("request");
            assert_eq!(r.status, 200, "{}", r.text());
            t.elapsed().as_secs_f64() * 1000.0
        }));
    }
    let mut out = Vec::new();
    for t in tasks {
        out.push(t.await.unwrap());
    }
    out
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    if !std::env::args().any(|a| a == "--bench") {
        // `cargo test --all-targets` runs benches without `--bench`; tests/envoy_e2e.rs covers
        // this path functionally.
        println!("e2e benchmark: skipped outside `cargo bench` (run `make bench`)");
        return;
    }
    let Some(bin) = common::envoy_binary() else {
        eprintln!("e2e bench needs Envoy in .venv (run `make tools`)");
        std::process::exit(1);
    };
    let up = Upstream::start().await;
    let tokenizer = format!(
        "{}/tests/fixtures/tokenizer/small-bpe",
        env!("CARGO_MANIFEST_DIR")
    );
    let cfg = kv_epp_config(
        &[up.addr],
        &format!("models: [{{name: m, block_size: 16, tokenizer: {{path: '{tokenizer}'}}}}]"),
    );
    let server = Server::start(&cfg).await.unwrap();
    let via = Envoy::start(&bin, EnvoyShape::FullDuplex, server.grpc_addr.port()).await;
    let direct = direct_envoy(&bin, up.addr).await;
    let direct_port = direct.port;
    println!(
        "end-to-end latency added by kv-epp (Envoy 1.40, loopback, {REQUESTS} requests at {RATE_PER_S} req/s, token-ID prompts)\n"
    );
    println!(
        "{:>8} | {:>10} {:>10} | {:>10} {:>10} | {:>10} {:>10}",
        "prompt", "direct p50", "p99", "kv-epp p50", "p99", "added p50", "ratio p50"
    );
    for tokens in [1024usize, 8192, 32768] {
        let ids: Vec<u32> = (0..tokens as u32).map(|i| (i * 7919) % 128_000).collect();
        let body = format!(
            r#"{{"model":"m","prompt":{},"max_tokens":1}}"#,
            serde_json::to_string(&ids).unwrap()
        );
        // Warm both paths.
        let _ = run(direct_port, body.as_bytes()).await;
        let _ = run(via.port, body.as_bytes()).await;
        let mut d = run(direct_port, body.as_bytes()).await;
        let mut k = run(via.port, body.as_bytes()).await;
        print_row(tokens, &mut d, &mut k);
    }
    // Chat prompts: tokenized in process by kv-epp (small BPE from the fixtures, chat template),
    // at a lower rate, since encoding dominates (see `cargo bench --bench tokenize`).
    const CHAT_REQUESTS: usize = 40;
    const CHAT_RATE: f64 = 5.0;
    println!(
        "\nchat prompts ({CHAT_REQUESTS} requests at {CHAT_RATE} req/s, tokenized by kv-epp; the same prompt repeats, so later requests hit the tokenizer's segment cache)"
    );
    println!(
        "{:>8} | {:>10} {:>10} | {:>10} {:>10} | {:>10} {:>10}",
        "prompt", "direct p50", "p99", "kv-epp p50", "p99", "added p50", "ratio p50"
    );
    let words = [
        "cache", "router", "tenant", "prefix", "block", "worker", "token", "envoy", "salt", "index",
    ];
    for target in [1024usize, 8192, 32768] {
        let mut text = String::new();
        let mut i = 0usize;
        while text.len() < target * 5 {
            text.push_str(words[(i * 7 + i / 3) % words.len()]);
            text.push(if i.is_multiple_of(13) { '.' } else { ' ' });
            i += 1;
        }
        let body = serde_json::json!({"model": "m", "max_tokens": 1, "messages": [{"role": "user", "content": text}]})
            .to_string();
        let tokens = server
            .picker
            .models
            .resolve("m")
            .and_then(|r| r.model.tokenize("/v1/chat/completions", body.as_bytes()))
            .and_then(Result::ok)
            .map_or(0, |t| t.len());
        let path = "/v1/chat/completions";
        let _ = run_at(direct_port, path, body.as_bytes(), 5, CHAT_RATE).await;
        let _ = run_at(via.port, path, body.as_bytes(), 5, CHAT_RATE).await;
        let mut d = run_at(direct_port, path, body.as_bytes(), CHAT_REQUESTS, CHAT_RATE).await;
        let mut k = run_at(via.port, path, body.as_bytes(), CHAT_REQUESTS, CHAT_RATE).await;
        print_row(tokens, &mut d, &mut k);
    }
    let m = http(server.metrics_addr, "GET", "/metrics", &[], b"")
        .await
        .unwrap()
        .text();
    if let (Some(sum), Some(count)) = (
        m.lines()
            .find(|l| l.starts_with("kv_epp_decision_seconds_sum"))
            .and_then(|l| l.rsplit(' ').next()?.parse::<f64>().ok()),
        m.lines()
            .find(|l| l.starts_with("kv_epp_decision_seconds_count"))
            .and_then(|l| l.rsplit(' ').next()?.parse::<f64>().ok()),
    ) {
        println!(
            "\nkv-epp decision time (parse + hash + query + pick), mean over all requests: {:.3} ms",
            sum / count * 1000.0
        );
    }
    server.stop().await;
}
