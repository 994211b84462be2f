//! The network demo: real sockets end to end. Four simulated vLLM workers (HTTP + ZeroMQ KV
//! events), kv-epp (ext_proc + event subscribers) and a real Envoy, all on loopback. The same
//! workload runs twice from empty caches: round-robin over the workers, then through Envoy and
//! kv-epp. Hit rates come from the workers' own `usage.prompt_tokens_details.cached_tokens`; TTFT
//! is measured by the client (time to the first streamed token; the workers' latency model makes
//! it grow with uncached prompt tokens and queueing). Nothing printed is computed rather than
//! measured. Then the other engines' event forms (SGLang's two salt encodings, TensorRT-LLM's
//! ZeroMQ publisher) go through kv-epp one prompt each (`demo_engines.rs`).

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use kv_epp::config::Config;
use kv_epp::extproc::usage::UsageScanner;
use kv_epp::httpc;
use kv_epp::server::Server;
use kv_epp_core::namespace::Namespace;
use kv_epp_core::salt::{CacheSalt, SaltSource};
use kv_epp_sim::latency::LatencyModel;
use kv_epp_sim::server::{SimWorker, SimWorkerConfig, start};
use kv_epp_sim::workload::WorkloadRequest;

const ENVOY_YAML: &str = include_str!("../../../../deploy/envoy/envoy.yaml");
const MODEL: &str = "demo-model";
/// A streamed completion: far more than the workload's longest answer, and a deadline only a
/// stuck path reaches.
const STREAM_LIMITS: httpc::Limits = httpc::Limits {
    deadline: Duration::from_secs(120),
    max_body: 16 << 20,
};

/// Kills Envoy however the demo ends (error, success or Ctrl-C unwinding the task).
struct EnvoyProcess(Child);

impl Drop for EnvoyProcess {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn free_port() -> Result<u16, String> {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .map_err(|e| format!("no free port: {e}"))
}

/// One request's outcome.
#[derive(Clone, Debug, Default)]
struct Outcome {
    ttft_ms: f64,
    prompt_tokens: u64,
    cached_tokens: u64,
}

/// Per-tenant results of one run.
#[derive(Default)]
struct RunStats {
    by_tenant: BTreeMap<String, Vec<Outcome>>,
    failures: usize,
}

/// Sends one streaming completion and measures the time to the first token.
async fn stream_request(
    addr: SocketAddr,
    headers: &[(String, String)],
    body: &[u8],
) -> Result<Outcome, String> {
    let started = Instant::now();
    let mut req = httpc::Request::post("/v1/completions")
        .header(httpc::header::HOST, "demo")
        .header(httpc::header::CONTENT_TYPE, "application/json");
    for (k, v) in headers {
        req = req.header(k.as_str(), v.as_str());
    }
    let req = req
        .body(bytes::Bytes::copy_from_slice(body))
        .map_err(|e| e.to_string())?;
    // The first token is the first SSE `data:` field; the tail of the previous piece is kept so a
    // field split across two pieces is still seen when it completes.
    let mut ttft = None;
    let mut tail = Vec::new();
    let r = httpc::send_observed(addr, req, STREAM_LIMITS, |piece| {
        if ttft.is_none() {
            tail.extend_from_slice(piece);
            if tail.windows(5).any(|w| w == b"data:") {
                ttft = Some(started.elapsed());
            }
            tail.drain(..tail.len().saturating_sub(4));
        }
    })
    .await
    .map_err(|e| format!("{addr}: {e}"))?;
    if r.status() != httpc::StatusCode::OK {
        let body = r.body();
        return Err(format!(
            "status {}: {}",
            r.status(),
            String::from_utf8_lossy(&body[..body.len().min(300)])
        ));
    }
    let mut scanner = UsageScanner::new("text/event-stream");
    scanner.feed(r.body());
    let usage = scanner.finish().ok_or("response carried no usage")?;
    Ok(Outcome {
        ttft_ms: ttft.ok_or("no token streamed")?.as_secs_f64() * 1000.0,
        prompt_tokens: usage.prompt_tokens,
        cached_tokens: usage.cached_tokens,
    })
}

fn body(req: &WorkloadRequest, salt: Option<&str>) -> Vec<u8> {
    let mut v = serde_json::json!({
        "model": MODEL,
        "prompt": req.tokens,
        "max_tokens": req.output_tokens.clamp(1, 64),
        "stream": true,
        "stream_options": {"include_usage": true},
    });
    if let Some(s) = salt {
        v["cache_salt"] = serde_json::json!(s);
    }
    serde_json::to_vec(&v).unwrap_or_default()
}

/// Replays the workload (open loop, arrival times as given) with `route` choosing the target.
async fn replay(
    work: &[WorkloadRequest],
    route: impl Fn(usize, &WorkloadRequest) -> (SocketAddr, Vec<(String, String)>, Vec<u8>),
) -> RunStats {
    let start = Instant::now();
    let mut tasks = Vec::new();
    for (i, req) in work.iter().enumerate() {
        let due = start + Duration::from_millis(req.at_ms);
        tokio::time::sleep_until(due.into()).await;
        let (addr, headers, body) = route(i, req);
        let tenant = req.tenant.clone().unwrap_or_default();
        tasks.push(tokio::spawn(async move {
            (tenant, stream_request(addr, &headers, &body).await)
        }));
    }
    let mut stats = RunStats::default();
    for t in tasks {
        match t.await {
            Ok((tenant, Ok(o))) => stats.by_tenant.entry(tenant).or_default().push(o),
            Ok((_, Err(e))) => {
                eprintln!("demo request failed: {e}");
                stats.failures += 1;
            }
            Err(_) => stats.failures += 1,
        }
    }
    stats
}

fn summarize(outcomes: &[Outcome]) -> (usize, f64, f64, f64) {
    let prompt: u64 = outcomes.iter().map(|o| o.prompt_tokens).sum();
    let cached: u64 = outcomes.iter().map(|o| o.cached_tokens).sum();
    let mut t: Vec<f64> = outcomes.iter().map(|o| o.ttft_ms).collect();
    t.sort_by(f64::total_cmp);
    let mean = t.iter().sum::<f64>() / t.len().max(1) as f64;
    let p90 = t
        .get(((t.len() as f64 * 0.9).ceil() as usize).clamp(1, t.len().max(1)) - 1)
        .copied()
        .unwrap_or(0.0);
    let rate = if prompt == 0 {
        0.0
    } else {
        cached as f64 / prompt as f64
    };
    (outcomes.len(), rate, mean, p90)
}

async fn start_workers(
    n: usize,
    block_size: usize,
    num_blocks: usize,
) -> Result<Vec<SimWorker>, String> {
    let mut out = Vec::new();
    for _ in 0..n {
        let mut cfg = SimWorkerConfig::loopback(block_size, num_blocks);
        cfg.served.model = MODEL.into();
        // ~10k prompt tokens/s of prefill per worker, as a mid-size model on one GPU.
        cfg.engine.latency = LatencyModel {
            base_us: 2_000,
            prefill_us_per_token: 100.0,
            decode_us_per_token: 10_000,
        };
        cfg.publisher.events_endpoint = format!("tcp://127.0.0.1:{}", free_port()?);
        cfg.publisher.replay_endpoint = Some(format!("tcp://127.0.0.1:{}", free_port()?));
        out.push(start(cfg, None).await?);
    }
    Ok(out)
}

async fn post(addr: SocketAddr, path: &str) -> Result<(), String> {
    let limits = httpc::Limits {
        deadline: Duration::from_secs(5),
        max_body: 1 << 20,
    };
    let r = httpc::post_json(addr, path, &b"{}"[..], limits)
        .await
        .map_err(|e| format!("{addr}{path}: {e}"))?;
    (r.status().as_u16() < 300)
        .then_some(())
        .ok_or_else(|| format!("{addr}{path}: status {}", r.status()))
}

/// Runs the network demo; returns the report text (Err when anything failed).
pub(crate) async fn run(
    envoy: &Path,
    work: Vec<WorkloadRequest>,
    workers: usize,
    block_size: usize,
    num_blocks: usize,
) -> Result<String, String> {
    let sims = start_workers(workers, block_size, num_blocks).await?;
    let list: Vec<String> = sims
        .iter()
        .map(|w| {
            format!(
                "{{endpoint: '{}', model: {MODEL}, events_endpoint: '{}', replay_endpoint: '{}'}}",
                w.http_addr,
                w.events.events_endpoint,
                w.events.replay_endpoint.clone().unwrap_or_default()
            )
        })
        .collect();
    let yaml = format!(
        "server: {{bind_address: 127.0.0.1, grpc_port: 0, grpc_health_port: 0, metrics_port: 0, admin_port: 0}}\n\
         engine_metrics: {{interval_ms: 100, stale_after_ms: 1000}}\n\
         models: [{{name: {MODEL}, block_size: {block_size}}}]\nworkers: [{}]\n",
        list.join(", ")
    );
    let config = Config::from_yaml(&yaml).map_err(|e| e.to_string())?;
    config.validate().map_err(|e| e.to_string())?;
    let server = Server::start(&config).await.map_err(|e| e.to_string())?;
    let (listen, admin) = (free_port()?, free_port()?);
    let envoy_yaml = ENVOY_YAML
        .replace(
            "address: 0.0.0.0, port_value: 10000",
            &format!("address: 127.0.0.1, port_value: {listen}"),
        )
        .replace(
            "port_value: 9002",
            &format!("port_value: {}", server.grpc_addr.port()),
        )
        .replace("port_value: 9901", &format!("port_value: {admin}"));
    let cfg_path = std::env::temp_dir().join(format!("kv-epp-demo-envoy-{listen}.yaml"));
    std::fs::write(&cfg_path, envoy_yaml).map_err(|e| e.to_string())?;
    let child = Command::new(envoy)
        .args([
            "-c",
            &cfg_path.to_string_lossy(),
            "--use-dynamic-base-id",
            "--concurrency",
            "2",
            "-l",
            "error",
        ])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .map_err(|e| format!("starting Envoy {}: {e}", envoy.display()))?;
    let _envoy = EnvoyProcess(child);
    let admin_addr: SocketAddr = ([127, 0, 0, 1], admin).into();
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let limits = httpc::Limits {
            deadline: Duration::from_secs(1),
            max_body: 4096,
        };
        let ready = httpc::get(admin_addr, "/ready", limits).await;
        if matches!(ready, Ok(r) if r.status() == httpc::StatusCode::OK) {
            break;
        }
        if Instant::now() > deadline {
            return Err("Envoy did not become ready".into());
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // Let every subscriber connect before traffic starts (PUB drops what no one receives).
    let deadline = Instant::now() + Duration::from_secs(10);
    while server
        .feeds
        .statuses()
        .iter()
        .any(|(_, _, s)| !s.connected.load(std::sync::atomic::Ordering::Relaxed))
    {
        if Instant::now() > deadline {
            return Err("kv-epp could not subscribe to every worker".into());
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    tokio::time::sleep(Duration::from_millis(300)).await;

    let salt_of = |t: &Option<String>| {
        t.as_deref()
            .and_then(|t| CacheSalt::new(t, SaltSource::Header).ok().flatten())
            .map(|s| Namespace::of(&s).forwarded())
    };
    let addrs: Vec<SocketAddr> = sims.iter().map(|w| w.http_addr).collect();
    let rr = replay(&work, |i, req| {
        (
            addrs[i % addrs.len()],
            Vec::new(),
            body(req, salt_of(&req.tenant).as_deref()),
        )
    })
    .await;
    // Fresh caches for the second run (kv-epp sees the restarts in the event streams).
    for a in &addrs {
        post(*a, "/admin/restart").await?;
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    let envoy_addr: SocketAddr = ([127, 0, 0, 1], listen).into();
    let kv = replay(&work, |_, req| {
        let headers = req
            .tenant
            .iter()
            .map(|t| ("x-tenant-id".to_string(), t.clone()))
            .collect();
        (envoy_addr, headers, body(req, None))
    })
    .await;

    // Isolation: one identical prompt under two salts, through Envoy and kv-epp.
    let probe = WorkloadRequest {
        at_ms: 0,
        tenant: None,
        tokens: (0..(block_size as u32 * 8)).map(|t| 7 + t * 13).collect(),
        output_tokens: 1,
    };
    let via = |tenant: &str| {
        let h = vec![("x-tenant-id".to_string(), tenant.to_string())];
        let b = body(&probe, None);
        async move { stream_request(envoy_addr, &h, &b).await }
    };
    let first_a = via("isolation-a").await?;
    let again_a = via("isolation-a").await?;
    let then_b = via("isolation-b").await?;
    let isolated =
        then_b.cached_tokens == 0 && again_a.cached_tokens > 0 && first_a.cached_tokens == 0;

    let mut out = format!(
        "kv-epp demo: {} requests, {} simulated vLLM workers ({} blocks of {} tokens), real Envoy + kv-epp on loopback\n\
         hit = prompt tokens the worker served from its prefix cache (its own usage report); TTFT measured by the client\n\
         round-robin (rr) requests go straight to the workers: no Envoy or kv-epp in their path\n\n",
        work.len(),
        workers,
        num_blocks,
        block_size
    );
    out.push_str(&format!(
        "{:<10} {:>5} | {:>8} {:>8} | {:>9} {:>9} | {:>9} {:>9}\n{}\n",
        "tenant",
        "reqs",
        "hit kv",
        "hit rr",
        "mean kv",
        "mean rr",
        "p90 kv",
        "p90 rr",
        "-".repeat(84)
    ));
    let mut tenants: Vec<&String> = kv.by_tenant.keys().collect();
    tenants.dedup();
    let all_kv: Vec<Outcome> = kv.by_tenant.values().flatten().cloned().collect();
    let all_rr: Vec<Outcome> = rr.by_tenant.values().flatten().cloned().collect();
    let mut rows: Vec<(String, Vec<Outcome>, Vec<Outcome>)> = tenants
        .iter()
        .map(|t| {
            (
                (*t).clone(),
                kv.by_tenant.get(*t).cloned().unwrap_or_default(),
                rr.by_tenant.get(*t).cloned().unwrap_or_default(),
            )
        })
        .collect();
    rows.push(("all".into(), all_kv.clone(), all_rr.clone()));
    for (t, k, r) in rows {
        let (n, hk, mk, pk) = summarize(&k);
        let (_, hr, mr, pr) = summarize(&r);
        out.push_str(&format!(
            "{:<10} {:>5} | {:>7.1}% {:>7.1}% | {:>7.1}ms {:>7.1}ms | {:>7.1}ms {:>7.1}ms\n",
            if t.is_empty() { "(none)".into() } else { t },
            n,
            hk * 100.0,
            hr * 100.0,
            mk,
            mr,
            pk,
            pr
        ));
    }
    out.push_str(&format!(
        "\nisolation: one prompt, two tenants through Envoy: tenant A first {} then {} cached tokens; tenant B {} cached tokens -> {}\n",
        first_a.cached_tokens,
        again_a.cached_tokens,
        then_b.cached_tokens,
        if isolated { "no cross-tenant sharing" } else { "SHARED ACROSS TENANTS" }
    ));
    server.stop().await;
    let (engines, engines_ok) = super::demo_engines::run(block_size).await?;
    out.push_str(&engines);
    let failures = rr.failures + kv.failures;
    if failures > 0 || !isolated || !engines_ok {
        return Err(format!(
            "{out}\ndemo FAILED: {failures} failed requests, isolation {isolated}, other engines {engines_ok}"
        ));
    }
    Ok(out)
}
