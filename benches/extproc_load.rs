//! `make bench` (ext_proc throughput): how many routing decisions kv-epp makes per second of its
//! own CPU, and at what latency, beside a trivial echo ext_proc server driven by the same load
//! generator in the same run, so the ratio shows kv-epp's own cost on top of gRPC and HTTP/2.
//!
//! - kv-epp runs as a child process (the real `kv-epp serve` binary) and the echo server as a
//!   second child (this bench re-executed with `--echo-server`, benches/support/); each one's CPU
//!   time comes from its threads' `/proc` run times before and after every step, so the
//!   generator's own work is never counted.
//! - The generator (this process) opens one HTTP/2 connection per concurrent client and sends
//!   each request as Envoy's FULL_DUPLEX_STREAMED mode does: request headers, the body in 16 KiB
//!   chunks (the HTTP/2 frame size Envoy reads a downstream body in), the last with
//!   end_of_stream. Latency runs from the first message to the decision (the header response
//!   naming `x-gateway-destination-endpoint`); the stream then stays open until the whole body
//!   came back, so both servers do the whole request's work.
//! - Workload: `/v1/completions` with token-ID prompts of 2k and 8k tokens (tokenization is
//!   measured by `benches/tokenize.rs`), 8 tenants (`x-tenant-id`) whose prompts share their
//!   first three quarters, 4 simulated vLLM workers (in this process) that publish KV events to
//!   kv-epp. Before each prompt size every tenant's prefix is cached on one worker through a
//!   real engine event, so each decision queries an index that holds its prefix; no events flow
//!   during the measured steps.
//! - Concurrency 1, 4, 16, 64; each step runs for a fixed wall time, the two servers in turn
//!   (kv-epp, then echo, at each concurrency) so load from other processes hits both alike.
//!
//! Under `cargo test --all-targets` (no `--bench` argument), or with `--quick`, it is a smoke
//! run: a few requests per step, checking only that every stream got a decision and its body
//! back and that nothing failed.

#[path = "../tests/common/mod.rs"]
mod common;

#[path = "support/child.rs"]
mod child;
#[path = "support/echo.rs"]
mod echo;

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_client::ExternalProcessorClient;
use envoy_types::pb::envoy::service::ext_proc::v3::{
    HttpBody, ProcessingRequest, ProtocolConfiguration, body_mutation, processing_request::Request,
    processing_response::Response,
};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::transport::{Channel, Endpoint};

use child::{Target, cpu_seconds};
use common::sim::{SimSpec, sim_worker};
use echo::DESTINATION;
use kv_epp_sim::server::SimWorker;

/// The echo server's fixed pick.
const ECHO_PICK: &str = "127.0.0.1:8000";
/// Body chunk the generator sends (what Envoy reads a downstream HTTP/2 body in).
const SEND_CHUNK: usize = 16 * 1024;
/// envoy.extensions.filters.http.ext_proc.v3.ProcessingMode.BodySendMode.FULL_DUPLEX_STREAMED
const FULL_DUPLEX: i32 = 4;
const TENANTS: usize = 8;
const WORKERS: usize = 4;
const BLOCK: usize = 16;
/// Distinct prompts per tenant, cycled.
const VARIANTS: usize = 16;

/// How much load one run puts on each server.
struct Plan {
    prompt_tokens: &'static [usize],
    concurrency: &'static [usize],
    /// Wall time of one measured step.
    step: Duration,
    /// Requests one step stops after, whichever comes first.
    step_requests: usize,
}

const FULL: Plan = Plan {
    prompt_tokens: &[2048, 8192],
    concurrency: &[1, 4, 16, 64],
    step: Duration::from_secs(3),
    step_requests: usize::MAX,
};

const QUICK: Plan = Plan {
    prompt_tokens: &[2048, 8192],
    concurrency: &[1, 4],
    step: Duration::from_secs(5),
    step_requests: 8,
};

fn main() {
    if echo::run_if_asked() {
        return;
    }
    let args: Vec<String> = std::env::args().collect();
    // `cargo test --all-targets` runs this binary without `--bench`: a smoke run then.
    let full = args.iter().any(|a| a == "--bench") && !args.iter().any(|a| a == "--quick");
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime")
        .block_on(run(if full { &FULL } else { &QUICK }, full));
}

// ---------------------------------------------------------------------------------------------
// The servers under load, as child processes (benches/support/child.rs).
// ---------------------------------------------------------------------------------------------

/// The real `kv-epp serve` for `workers`, ephemeral ports, logs at warn.
fn start_kv_epp(workers: &[SimWorker]) -> Target {
    let list: Vec<String> = workers
        .iter()
        .map(|w| {
            format!(
                "{{endpoint: '{}', model: m, events_endpoint: '{}'}}",
                w.http_addr, w.events.events_endpoint
            )
        })
        .collect();
    let tokenizer = format!(
        "{}/tests/fixtures/tokenizer/small-bpe",
        env!("CARGO_MANIFEST_DIR")
    );
    let yaml = format!(
        "server: {{bind_address: 127.0.0.1, grpc_port: 0, grpc_health_port: 0, metrics_port: 0, admin_port: 0}}\n\
         engine_metrics: {{interval_ms: 0}}\n\
         events: {{engine: vllm, zmq: {{replay_port: 0}}}}\n\
         models: [{{name: m, block_size: {BLOCK}, tokenizer: {{path: '{tokenizer}'}}}}]\n\
         workers: [{}]\n",
        list.join(", ")
    );
    child::start_kv_epp(&child::this_kv_epp(), &yaml)
}

// ---------------------------------------------------------------------------------------------
// The workload.
// ---------------------------------------------------------------------------------------------

/// A token ID derived from a seed and a position, below the small BPE's special tokens.
fn token(seed: u64, i: usize) -> u32 {
    let x = seed
        .wrapping_mul(0x9E37_79B9_7F4A_7C15)
        .wrapping_add((i as u64).wrapping_mul(0xBF58_476D_1CE4_E5B9));
    ((x ^ (x >> 31)) % 1900) as u32
}

/// Tenant `tenant`'s prompt `variant`: three quarters shared by all the tenant's prompts, the
/// rest its own.
fn prompt(tokens: usize, tenant: usize, variant: usize) -> Vec<u32> {
    let shared = tokens * 3 / 4;
    let own = 1000 + (tenant * VARIANTS + variant) as u64;
    (0..tokens)
        .map(|i| {
            if i < shared {
                token(tenant as u64 + 1, i)
            } else {
                token(own, i)
            }
        })
        .collect()
}

fn tenant_name(t: usize) -> String {
    format!("tenant-{t}")
}

/// One request as Envoy sends it in FULL_DUPLEX_STREAMED: headers, then the body in chunks.
fn full_duplex(tokens: &[u32], tenant: &str) -> Vec<ProcessingRequest> {
    // The shared client's BUFFERED completion, re-cut the way FULL_DUPLEX sends it.
    let [mut head, whole] = common::extproc::completion(tokens, tenant);
    head.protocol_config = Some(ProtocolConfiguration {
        request_body_mode: FULL_DUPLEX,
        response_body_mode: FULL_DUPLEX,
        ..ProtocolConfiguration::default()
    });
    let Some(Request::RequestBody(body)) = whole.request else {
        unreachable!("the second message is the body")
    };
    let chunks: Vec<&[u8]> = body.body.chunks(SEND_CHUNK).collect();
    let last = chunks.len() - 1;
    let mut msgs = vec![head];
    msgs.extend(
        chunks
            .into_iter()
            .enumerate()
            .map(|(i, c)| ProcessingRequest {
                request: Some(Request::RequestBody(HttpBody {
                    body: c.to_vec(),
                    end_of_stream: i == last,
                    ..HttpBody::default()
                })),
                ..ProcessingRequest::default()
            }),
    );
    msgs
}

/// A prepared request and the worker holding its tenant's prefix.
struct Prepared {
    messages: Vec<ProcessingRequest>,
    holder: String,
}

/// Every tenant's variants, interleaved so consecutive requests come from different tenants.
fn prepare(tokens: usize, workers: &[SimWorker]) -> Arc<Vec<Prepared>> {
    let mut out = Vec::new();
    for v in 0..VARIANTS {
        for t in 0..TENANTS {
            out.push(Prepared {
                messages: full_duplex(&prompt(tokens, t, v), &tenant_name(t)),
                holder: workers[t % WORKERS].http_addr.to_string(),
            });
        }
    }
    Arc::new(out)
}

/// Waits until kv-epp applies `worker`'s events: probe prompts go straight to the worker until
/// kv-epp's admin API credits one (PUB/SUB drops what was published before the subscription).
async fn wait_subscribed(admin: SocketAddr, worker: &SimWorker) {
    let deadline = Instant::now() + Duration::from_secs(20);
    for probe in 0u64.. {
        let tokens: Vec<u32> = (0..BLOCK * 2).map(|i| token(u64::MAX - probe, i)).collect();
        common::sim::send(worker, &tokens, "probe").await;
        let seen = common::eventually_async(1, || async {
            common::sim::believed(admin, worker.http_addr, &tokens, Some("probe")).await > 0
        })
        .await;
        if seen {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "kv-epp never applied events from {}",
            worker.http_addr
        );
    }
}

/// Caches every tenant's first prompt on its worker (tenant t on worker t mod 4) and waits until
/// kv-epp's index credits it.
async fn seed_index(admin: SocketAddr, workers: &[SimWorker], tokens: usize) {
    for t in 0..TENANTS {
        let (w, p, name) = (&workers[t % WORKERS], prompt(tokens, t, 0), tenant_name(t));
        common::sim::send(w, &p, &name).await;
        let credited = common::eventually_async(15, || async {
            common::sim::believed(admin, w.http_addr, &p, Some(&name)).await >= (tokens / 2) as u64
        })
        .await;
        assert!(credited, "kv-epp's index never held {name}'s prompt");
    }
}

// ---------------------------------------------------------------------------------------------
// The load generator.
// ---------------------------------------------------------------------------------------------

/// One request: time to the decision and the destination, once the body came back whole.
async fn one(
    client: &mut ExternalProcessorClient<Channel>,
    messages: &[ProcessingRequest],
) -> Result<(Duration, String), String> {
    let (tx, rx) = mpsc::channel(messages.len());
    let start = Instant::now();
    for m in messages {
        // The channel holds them all: this never waits.
        tx.send(m.clone())
            .await
            .map_err(|_| "request channel closed")?;
    }
    let mut responses = client
        .process(ReceiverStream::new(rx))
        .await
        .map_err(|s| format!("open: {s}"))?
        .into_inner();
    let mut decision = None;
    loop {
        let Some(resp) = responses
            .message()
            .await
            .map_err(|s| format!("read: {s}"))?
        else {
            return Err("stream ended before the body came back".into());
        };
        match resp.response {
            Some(Response::RequestHeaders(h)) => {
                let dest = h
                    .response
                    .and_then(|c| c.header_mutation)
                    .into_iter()
                    .flat_map(|m| m.set_headers)
                    .filter_map(|h| h.header)
                    .find(|h| h.key == DESTINATION)
                    .ok_or("header response without a destination")?;
                decision = Some((
                    start.elapsed(),
                    String::from_utf8_lossy(&dest.raw_value).into_owned(),
                ));
            }
            Some(Response::RequestBody(b)) => {
                let ends = matches!(
                    b.response.and_then(|c| c.body_mutation).and_then(|m| m.mutation),
                    Some(body_mutation::Mutation::StreamedResponse(s)) if s.end_of_stream
                );
                if ends {
                    break;
                }
            }
            Some(Response::ImmediateResponse(r)) => {
                return Err(format!("local reply {:?}: {}", r.status, r.details));
            }
            other => return Err(format!("unexpected response {other:?}")),
        }
    }
    drop(tx);
    decision.ok_or_else(|| "body came back without a decision".into())
}

/// What one step measured.
struct Step {
    latencies_ms: Vec<f64>,
    errors: Vec<String>,
    /// Decisions naming the worker that holds the tenant's prefix.
    on_holder: usize,
    wall: Duration,
    server_cpu: f64,
    generator_cpu: f64,
}

impl Step {
    fn decisions(&self) -> usize {
        self.latencies_ms.len()
    }
    fn per_second(&self) -> f64 {
        self.decisions() as f64 / self.wall.as_secs_f64()
    }
    /// Decisions per CPU-second; NaN when the step used less than the clock's resolution.
    fn per_cpu_second(&self) -> f64 {
        if self.server_cpu > 0.0 {
            self.decisions() as f64 / self.server_cpu
        } else {
            f64::NAN
        }
    }
    fn pct(&self, q: f64) -> f64 {
        let mut v = self.latencies_ms.clone();
        v.sort_by(f64::total_cmp);
        let rank = ((q * v.len() as f64).ceil() as usize).clamp(1, v.len().max(1));
        v.get(rank - 1).copied().unwrap_or(f64::NAN)
    }
}

/// Runs `concurrency` clients, each on its own HTTP/2 connection, against `target` until the
/// plan's wall time or request count is reached.
async fn step(
    target: &Target,
    prepared: &Arc<Vec<Prepared>>,
    concurrency: usize,
    plan: &Plan,
) -> Step {
    let mut clients = Vec::with_capacity(concurrency);
    for _ in 0..concurrency {
        let channel = Endpoint::from_shared(format!("http://{}", target.grpc))
            .expect("uri")
            .tcp_nodelay(true)
            .connect()
            .await
            .expect("connect");
        clients.push(ExternalProcessorClient::new(channel));
    }
    let next = Arc::new(AtomicUsize::new(0));
    let (server0, generator0) = (cpu_seconds(target.pid), cpu_seconds(std::process::id()));
    let started = Instant::now();
    let deadline = started + plan.step;
    let limit = plan.step_requests;
    let tasks: Vec<_> = clients
        .into_iter()
        .map(|mut client| {
            let (next, prepared) = (next.clone(), prepared.clone());
            tokio::spawn(async move {
                let (mut lat, mut errors, mut on_holder) = (Vec::new(), Vec::new(), 0);
                loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    if i >= limit || Instant::now() >= deadline {
                        break;
                    }
                    let p = &prepared[i % prepared.len()];
                    match one(&mut client, &p.messages).await {
                        Ok((took, dest)) => {
                            lat.push(took.as_secs_f64() * 1000.0);
                            on_holder += usize::from(dest == p.holder);
                        }
                        Err(e) => errors.push(e),
                    }
                }
                (lat, errors, on_holder)
            })
        })
        .collect();
    let mut out = Step {
        latencies_ms: Vec::new(),
        errors: Vec::new(),
        on_holder: 0,
        wall: Duration::ZERO,
        server_cpu: 0.0,
        generator_cpu: 0.0,
    };
    for t in tasks {
        let (lat, errors, on_holder) = t.await.expect("client task");
        out.latencies_ms.extend(lat);
        out.errors.extend(errors);
        out.on_holder += on_holder;
    }
    out.wall = started.elapsed();
    out.server_cpu = cpu_seconds(target.pid) - server0;
    out.generator_cpu = cpu_seconds(std::process::id()) - generator0;
    out
}

fn print_header(tokens: usize) {
    println!(
        "\n{tokens}-token prompts ({TENANTS} tenants, {WORKERS} simulated workers holding each tenant's 3/4 prefix)"
    );
    println!(
        "{:>4} | {:>33} {:>16} | {:>33} {:>16} | {:>22} | {:>9} {:>6}",
        "", "kv-epp", "", "echo ext_proc", "", "kv-epp / echo", "generator", ""
    );
    println!(
        "{:>4} | {:>7} {:>8} {:>8} {:>7} {:>8} {:>7} | {:>7} {:>8} {:>8} {:>7} {:>8} {:>7} | {:>8} {:>6} {:>6} | {:>9} {:>6}",
        "conc",
        "dec/s",
        "p50 ms",
        "p99 ms",
        "CPU-s",
        "dec/CPUs",
        "holder",
        "dec/s",
        "p50 ms",
        "p99 ms",
        "CPU-s",
        "dec/CPUs",
        "",
        "CPU/dec",
        "p50",
        "p99",
        "CPU-s",
        "errors"
    );
}

fn print_row(concurrency: usize, k: &Step, e: &Step) {
    let holder = k.on_holder as f64 / k.decisions().max(1) as f64 * 100.0;
    println!(
        "{:>4} | {:>7.0} {:>8.2} {:>8.2} {:>7.2} {:>8.0} {:>6.0}% | {:>7.0} {:>8.2} {:>8.2} {:>7.2} {:>8.0} {:>7} | {:>7.2}x {:>5.2}x {:>5.2}x | {:>9.2} {:>6}",
        concurrency,
        k.per_second(),
        k.pct(0.5),
        k.pct(0.99),
        k.server_cpu,
        k.per_cpu_second(),
        holder,
        e.per_second(),
        e.pct(0.5),
        e.pct(0.99),
        e.server_cpu,
        e.per_cpu_second(),
        "",
        e.per_cpu_second() / k.per_cpu_second(),
        k.pct(0.5) / e.pct(0.5),
        k.pct(0.99) / e.pct(0.99),
        k.generator_cpu + e.generator_cpu,
        k.errors.len() + e.errors.len()
    );
}

async fn run(plan: &Plan, full: bool) {
    if !full {
        println!("(smoke run; `cargo bench --bench extproc_load` measures)");
    }
    let mut workers = Vec::new();
    for seed in 0..WORKERS as u64 {
        workers.push(
            sim_worker(SimSpec {
                block_size: BLOCK,
                num_blocks: 8192,
                replay: false,
                seed,
                ..SimSpec::default()
            })
            .await,
        );
    }
    let kv_epp = start_kv_epp(&workers);
    let echo = child::start_echo(ECHO_PICK);
    let admin = kv_epp.admin.expect("kv-epp has an admin API");
    for w in &workers {
        wait_subscribed(admin, w).await;
    }
    println!(
        "ext_proc throughput: FULL_DUPLEX_STREAMED streams ({} KiB body chunks), one HTTP/2 connection per client, \
         {:.0} s per step; CPU from each server process's threads in /proc; ratios from the same run",
        SEND_CHUNK / 1024,
        plan.step.as_secs_f64()
    );
    let mut failures = Vec::new();
    for &tokens in plan.prompt_tokens {
        seed_index(admin, &workers, tokens).await;
        let prepared = prepare(tokens, &workers);
        // Warm both servers and both connection paths; not measured.
        let warm = Plan {
            step: Duration::from_millis(500),
            step_requests: 2 * TENANTS,
            ..*plan
        };
        for target in [&kv_epp, &echo] {
            let w = step(target, &prepared, 4, &warm).await;
            failures.extend(w.errors);
        }
        print_header(tokens);
        for &c in plan.concurrency {
            let k = step(&kv_epp, &prepared, c, plan).await;
            let e = step(&echo, &prepared, c, plan).await;
            print_row(c, &k, &e);
            for s in [&k, &e] {
                if s.decisions() == 0 {
                    failures.push(format!("no decision at concurrency {c}"));
                }
            }
            failures.extend(k.errors);
            failures.extend(e.errors);
        }
    }
    println!(
        "\ndec/CPUs: decisions per CPU-second of that server's process; holder: kv-epp's picks naming \
         the worker that holds the tenant's prefix; CPU/dec: kv-epp's CPU per decision over echo's"
    );
    assert!(
        failures.is_empty(),
        "{} failed streams, first: {}",
        failures.len(),
        failures[0]
    );
}
