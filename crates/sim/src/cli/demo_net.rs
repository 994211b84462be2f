//! The network demo: real sockets end to end. Four simulated vLLM workers (HTTP + ZeroMQ KV
//! events), kv-epp (ext_proc + event subscribers) and a real Envoy, all on loopback. The same
//! workload runs twice from empty caches: round-robin over the workers, then through Envoy and
//! kv-epp. Hit rates come from the workers' own `usage.prompt_tokens_details.cached_tokens`; TTFT
//! is measured by the client (time to the first streamed token; the workers' latency model makes
//! it grow with uncached prompt tokens and queueing). Nothing printed is computed rather than
//! measured.

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
use kv_epp_sim::api::Served;
use kv_epp_sim::engine::EngineConfig;
use kv_epp_sim::events::{BatchEncoder, EventLayout, HashForm};
use kv_epp_sim::latency::LatencyModel;
use kv_epp_sim::publisher::PublisherConfig;
use kv_epp_sim::server::{SimWorker, SimWorkerConfig, start};
use kv_epp_sim::workload::WorkloadRequest;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

const ENVOY_YAML: &str = include_str!("../../../../deploy/envoy/envoy.yaml");
const MODEL: &str = "demo-model";

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
    let mut s = TcpStream::connect(addr)
        .await
        .map_err(|e| format!("connect {addr}: {e}"))?;
    let mut req = format!(
        "POST /v1/completions HTTP/1.1\r\nhost: demo\r\nconnection: close\r\ncontent-type: application/json\r\ncontent-length: {}\r\n",
        body.len()
    );
    for (k, v) in headers {
        req.push_str(&format!("{k}: {v}\r\n"));
    }
    req.push_str("\r\n");
    s.write_all(req.as_bytes())
        .await
        .map_err(|e| e.to_string())?;
    s.write_all(body).await.map_err(|e| e.to_string())?;
    let mut raw = Vec::new();
    let mut buf = [0u8; 8192];
    let mut ttft = None;
    loop {
        let n = s.read(&mut buf).await.map_err(|e| e.to_string())?;
        if n == 0 {
            break;
        }
        raw.extend_from_slice(&buf[..n]);
        if ttft.is_none() && raw.windows(5).any(|w| w == b"data:") {
            ttft = Some(started.elapsed());
        }
    }
    let status_ok = raw.starts_with(b"HTTP/1.1 200");
    if !status_ok {
        return Err(String::from_utf8_lossy(&raw[..raw.len().min(300)]).into_owned());
    }
    // Chunk framing lines never contain `data:`, so scanning the raw body finds every event.
    let mut scanner = UsageScanner::new("text/event-stream");
    let split = raw.windows(4).position(|w| w == b"\r\n\r\n").unwrap_or(0);
    scanner.feed(&raw[split..]);
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
        let cfg = SimWorkerConfig {
            http_addr: "127.0.0.1:0".parse().map_err(|_| "address")?,
            served: Served {
                model: MODEL.into(),
                lora_modules: Vec::new(),
            },
            engine: EngineConfig {
                num_blocks,
                block_size,
                max_num_seqs: 64,
                // ~10k prompt tokens/s of prefill per worker, as a mid-size model on one GPU.
                latency: LatencyModel {
                    base_us: 2_000,
                    prefill_us_per_token: 100.0,
                    decode_us_per_token: 10_000,
                },
            },
            publisher: PublisherConfig {
                events_endpoint: format!("tcp://127.0.0.1:{}", free_port()?),
                replay_endpoint: Some(format!("tcp://127.0.0.1:{}", free_port()?)),
                topic: String::new(),
                buffer_steps: 10_000,
                drop_fraction: 0.0,
                fault_seed: 0,
                encoder: BatchEncoder {
                    layout: EventLayout::Map,
                    hash_form: HashForm::Int,
                    block_size,
                    lora_modules: Vec::new(),
                    data_parallel_rank: None,
                },
            },
        };
        out.push(start(cfg, None).await?);
    }
    Ok(out)
}

async fn post(addr: SocketAddr, path: &str) -> Result<(), String> {
    let r = httpc::request(addr, "POST", path, b"{}", Duration::from_secs(5), 1 << 20)
        .await
        .map_err(|e| format!("{addr}{path}: {e}"))?;
    (r.status < 300)
        .then_some(())
        .ok_or_else(|| format!("{addr}{path}: status {}", r.status))
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
        let ready = httpc::request(
            admin_addr,
            "GET",
            "/ready",
            b"",
            Duration::from_secs(1),
            4096,
        )
        .await;
        if matches!(ready, Ok(r) if r.status == 200) {
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
    let failures = rr.failures + kv.failures;
    if failures > 0 || !isolated {
        return Err(format!(
            "{out}\ndemo FAILED: {failures} failed requests, isolation {isolated}"
        ));
    }
    Ok(out)
}
