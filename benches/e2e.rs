//! `make bench` (end to end): what kv-epp costs in front of a model server, through a real Envoy
//! 1.40 on loopback, in both request body modes (FULL_DUPLEX_STREAMED, `deploy/envoy/envoy.yaml`;
//! BUFFERED, `deploy/envoy/envoy-buffered.yaml`), for 1k, 8k and 32k-token token-ID
//! `/v1/completions` prompts (tokenization is measured by `benches/tokenize.rs`).
//!
//! - Routes, all through Envoy to the same upstream (a fake model server in this process):
//!   direct (no ext_proc: the baseline), via the echo ext_proc server (benches/support/echo.rs:
//!   the floor of gRPC and HTTP/2 stream handling), via kv-epp (the real `kv-epp serve`), and,
//!   when `KV_EPP_BENCH_BIN=/path/to/kv-epp` is set, via that other build too (e.g. the one at
//!   `main`), so old and new are measured in the same run; when `KV_EPP_BENCH_IO_THREADS=N` is
//!   set, via this kv-epp with `server.io_threads: N` too (its "CPU/base" column compares it with
//!   the default, one runtime thread per core).
//! - One client in a closed loop: the next request leaves when the last one was answered. The
//!   routes take turns request by request, so load from other processes hits them alike.
//! - Latency is the client's, request sent to response read. "added" is a route's percentile
//!   less the direct route's. CPU per request is the ext_proc server process's own CPU
//!   (its threads' run times from `/proc`, benches/support/child.rs) over the step, divided by
//!   the requests it served; kv-epp and the echo server are child processes, never this one.
//!
//! Under `cargo test --all-targets` (no `--bench` argument), or with `--quick`, it is a smoke
//! run: a few requests per route, checking only that every one was answered 200.

#[path = "support/child.rs"]
mod child;
#[path = "../tests/common/mod.rs"]
mod common;
#[path = "support/echo.rs"]
mod echo;

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Instant;

use child::{Target, cpu_seconds};
use common::{Envoy, EnvoyShape, Upstream, free_port, post_json};

/// How much one run measures.
struct Plan {
    prompt_tokens: &'static [usize],
    /// Measured requests per route, per prompt size and mode.
    requests: usize,
    /// Unmeasured requests per route first.
    warmup: usize,
}

const FULL: Plan = Plan {
    prompt_tokens: &[1024, 8192, 32768],
    requests: 1000,
    warmup: 30,
};

const QUICK: Plan = Plan {
    prompt_tokens: &[1024, 8192, 32768],
    requests: 3,
    warmup: 1,
};

fn main() {
    if echo::run_if_asked() {
        return;
    }
    let args: Vec<String> = std::env::args().collect();
    // `cargo test --all-targets` runs this binary without `--bench`: a smoke run then.
    let full = args.iter().any(|a| a == "--bench") && !args.iter().any(|a| a == "--quick");
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime")
        .block_on(run(if full { &FULL } else { &QUICK }, full));
}

/// A way from the client to the upstream, and the ext_proc server on it (none for direct).
struct Route<'a> {
    name: String,
    port: u16,
    server: Option<&'a Target>,
}

/// What one route measured in one step.
struct Measured {
    latencies_ms: Vec<f64>,
    cpu_s: f64,
}

impl Measured {
    fn pct(&self, q: f64) -> f64 {
        let mut v = self.latencies_ms.clone();
        v.sort_by(f64::total_cmp);
        let rank = ((q * v.len() as f64).ceil() as usize).clamp(1, v.len().max(1));
        v.get(rank - 1).copied().unwrap_or(f64::NAN)
    }
    fn cpu_per_request_ms(&self) -> f64 {
        self.cpu_s * 1000.0 / self.latencies_ms.len().max(1) as f64
    }
}

/// Envoy straight to the upstream (no ext_proc): the baseline.
async fn direct_envoy(bin: &Path, upstream: SocketAddr) -> Envoy {
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

/// kv-epp serving the one upstream: model `m`, no engine events, ephemeral ports.
fn kv_epp_yaml(upstream: SocketAddr, io_threads: usize) -> String {
    format!(
        "server: {{bind_address: 127.0.0.1, grpc_port: 0, grpc_health_port: 0, metrics_port: 0, admin_port: 0, io_threads: {io_threads}}}\n\
         engine_metrics: {{interval_ms: 0}}\n\
         events: {{engine: none}}\n\
         models: [{{name: m, block_size: 16}}]\n\
         workers: [{{endpoint: '{upstream}', model: m}}]\n"
    )
}

/// One request through `port`; its latency in ms, or what went wrong.
async fn one(port: u16, body: &[u8]) -> Result<f64, String> {
    let t = Instant::now();
    let r = post_json(("127.0.0.1", port), "/v1/completions", &[], body)
        .await
        .map_err(|e| e.to_string())?;
    let took = t.elapsed().as_secs_f64() * 1000.0;
    if r.status != 200 {
        return Err(format!("{}: {}", r.status, r.text()));
    }
    Ok(took)
}

/// A token-ID completion of `tokens` tokens.
fn body(tokens: usize) -> Vec<u8> {
    let ids: Vec<u32> = (0..tokens as u32).map(|i| (i * 7919) % 128_000).collect();
    format!(
        r#"{{"model":"m","prompt":{},"max_tokens":1}}"#,
        serde_json::to_string(&ids).expect("ids")
    )
    .into_bytes()
}

/// Sends `plan.warmup` then `plan.requests` requests per route, the routes taking turns, and
/// returns each route's latencies and its server's CPU over the measured part.
async fn step(
    routes: &[Route<'_>],
    body: &[u8],
    plan: &Plan,
    failures: &mut Vec<String>,
) -> Vec<Measured> {
    for _ in 0..plan.warmup {
        for r in routes {
            if let Err(e) = one(r.port, body).await {
                failures.push(format!("{}: {e}", r.name));
            }
        }
    }
    let cpu = |r: &Route| r.server.map_or(0.0, |s| cpu_seconds(s.pid));
    let before: Vec<f64> = routes.iter().map(cpu).collect();
    let mut latencies = vec![Vec::with_capacity(plan.requests); routes.len()];
    for i in 0..plan.requests {
        // Each round starts at another route, so no route always follows the same one.
        for k in 0..routes.len() {
            let at = (i + k) % routes.len();
            match one(routes[at].port, body).await {
                Ok(ms) => latencies[at].push(ms),
                Err(e) => failures.push(format!("{}: {e}", routes[at].name)),
            }
        }
    }
    routes
        .iter()
        .zip(before)
        .zip(latencies)
        .map(|((r, b), latencies_ms)| Measured {
            latencies_ms,
            cpu_s: cpu(r) - b,
        })
        .collect()
}

fn load_average() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|l| l.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_else(|_| "?".into())
}

/// Prints one prompt size's rows: the direct route first, then each ext_proc route.
fn print_rows(tokens: usize, routes: &[Route<'_>], m: &[Measured]) {
    let direct = &m[0];
    let kv_epp = routes.iter().position(|r| r.name == "kv-epp");
    let base = routes.iter().position(|r| r.name == "kv-epp base");
    for (i, (r, s)) in routes.iter().zip(m).enumerate() {
        let label = if i == 0 {
            format!("{tokens}t")
        } else {
            String::new()
        };
        let (p50, p99) = (s.pct(0.5), s.pct(0.99));
        if r.server.is_none() {
            println!(
                "{label:>7} | {:<12} | {p50:>7.2} {p99:>7.2} | {:>9} {:>9} | {:>7} | {:>10} | {:>8}",
                r.name, "", "", "", "", ""
            );
            continue;
        }
        // kv-epp against the base build; kv-epp with other I/O threads against kv-epp.
        let against = match (Some(i) == kv_epp, base) {
            (true, b) => b,
            (false, _) if r.name.starts_with("kv-epp io") => kv_epp,
            _ => None,
        };
        let vs_base = against
            .map(|b| format!("{:.2}x", s.cpu_per_request_ms() / m[b].cpu_per_request_ms()))
            .unwrap_or_default();
        println!(
            "{label:>7} | {:<12} | {p50:>7.2} {p99:>7.2} | {:>9.2} {:>9.2} | {:>6.2}x | {:>10.3} | {vs_base:>8}",
            r.name,
            p50 - direct.pct(0.5),
            p99 - direct.pct(0.99),
            p99 / p50,
            s.cpu_per_request_ms(),
        );
    }
}

async fn run(plan: &Plan, full: bool) {
    if !full {
        println!("(smoke run; `cargo bench --bench e2e` measures)");
    }
    let Some(envoy) = common::envoy_binary() else {
        if full {
            eprintln!("e2e bench needs Envoy in .venv (run `make tools`)");
            std::process::exit(1);
        }
        return;
    };
    let up = Upstream::start().await;
    let yaml = kv_epp_yaml(up.addr, 0);
    let kv_epp = child::start_kv_epp(&child::this_kv_epp(), &yaml);
    let io_threads: Option<usize> = std::env::var("KV_EPP_BENCH_IO_THREADS")
        .ok()
        .map(|n| n.parse().expect("KV_EPP_BENCH_IO_THREADS: a thread count"));
    let io = io_threads.map(|n| {
        (
            format!("kv-epp io {n}"),
            child::start_kv_epp(&child::this_kv_epp(), &kv_epp_yaml(up.addr, n)),
        )
    });
    let base_bin = std::env::var_os("KV_EPP_BENCH_BIN").map(PathBuf::from);
    let base = base_bin.as_deref().map(|b| child::start_kv_epp(b, &yaml));
    let echo = child::start_echo(&up.addr.to_string());
    let direct = direct_envoy(&envoy, up.addr).await;
    println!(
        "end to end through Envoy 1.40 on loopback: one client, closed loop, {} requests per route and prompt size \
         (after {} unmeasured), routes taking turns; token-ID /v1/completions prompts",
        plan.requests, plan.warmup
    );
    if let Some(b) = &base_bin {
        println!("kv-epp base: {}", b.display());
    }
    if let Some(n) = io_threads {
        println!("kv-epp io {n}: this build with server.io_threads: {n}");
    }
    println!("load average before: {}", load_average());
    let mut failures = Vec::new();
    for (mode, shape) in [
        (
            "FULL_DUPLEX_STREAMED (deploy/envoy/envoy.yaml)",
            EnvoyShape::FullDuplex,
        ),
        (
            "BUFFERED (deploy/envoy/envoy-buffered.yaml)",
            EnvoyShape::Buffered,
        ),
    ] {
        let mut servers: Vec<(&str, &Target)> = vec![("echo", &echo)];
        if let Some(b) = &base {
            servers.push(("kv-epp base", b));
        }
        servers.push(("kv-epp", &kv_epp));
        if let Some((name, t)) = &io {
            servers.push((name.as_str(), t));
        }
        let mut envoys = Vec::new();
        for (_, s) in &servers {
            envoys.push(Envoy::start(&envoy, shape, s.grpc.port()).await);
        }
        let mut routes = vec![Route {
            name: "direct".into(),
            port: direct.port,
            server: None,
        }];
        for ((name, s), e) in servers.iter().zip(&envoys) {
            routes.push(Route {
                name: (*name).into(),
                port: e.port,
                server: Some(s),
            });
        }
        println!("\n{mode}");
        println!(
            "{:>7} | {:<12} | {:>7} {:>7} | {:>9} {:>9} | {:>7} | {:>10} | {:>8}",
            "prompt",
            "route",
            "p50 ms",
            "p99 ms",
            "added p50",
            "added p99",
            "p99/p50",
            "CPU/req ms",
            "CPU/base"
        );
        for &tokens in plan.prompt_tokens {
            let m = step(&routes, &body(tokens), plan, &mut failures).await;
            print_rows(tokens, &routes, &m);
            // The upstream keeps every request it saw; nothing here reads them.
            up.received.lock().expect("upstream log").clear();
        }
    }
    println!("\nload average after: {}", load_average());
    println!(
        "added: the route's percentile less the direct route's; p99/p50: of the route itself (via Envoy and the \
         ext_proc server); CPU/req: the ext_proc server process's CPU over the step per request it served; \
         CPU/base: kv-epp's CPU per request over the base build's (kv-epp io N's over kv-epp's)"
    );
    assert!(
        failures.is_empty(),
        "{} failed requests, first: {}",
        failures.len(),
        failures[0]
    );
}
