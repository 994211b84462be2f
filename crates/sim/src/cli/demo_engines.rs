//! The demo's engine round: the other engines' KV events, each through a real `kv-epp serve`
//! (in process) and a simulated worker speaking that engine's wire form over real ZeroMQ:
//! SGLang with the salt as a trailing positional `metadata` map (SGLang #30827) and as a map
//! field (#37482), and TensorRT-LLM's ZeroMQ publisher (no salt). For each, one prompt goes to the
//! worker as kv-epp would forward it, and kv-epp's own `/query` says what it credits to which
//! tenant. Quick: one worker per engine, one prompt each.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use kv_epp::config::Config;
use kv_epp::httpc;
use kv_epp::server::Server;
use kv_epp_core::namespace::Namespace;
use kv_epp_core::salt::{CacheSalt, SaltSource};
use kv_epp_sim::events::{EventLayout, SimEngine};
use kv_epp_sim::server::{SimWorkerConfig, start};

const MODEL: &str = "demo-model";
const LIMITS: httpc::Limits = httpc::Limits {
    deadline: Duration::from_secs(10),
    max_body: 1 << 20,
};

/// One engine of the round.
struct Case {
    label: &'static str,
    engine: SimEngine,
    layout: EventLayout,
    events: &'static str,
    /// Whether the engine's events carry the salt.
    salted: bool,
}

const CASES: [Case; 3] = [
    Case {
        label: "SGLang, salt as positional metadata (#30827)",
        engine: SimEngine::Sglang,
        layout: EventLayout::Array,
        events: "{engine: sglang}",
        salted: true,
    },
    Case {
        label: "SGLang, salt as a map field (#37482)",
        engine: SimEngine::Sglang,
        layout: EventLayout::Map,
        events: "{engine: sglang}",
        salted: true,
    },
    Case {
        label: "TensorRT-LLM over ZeroMQ (no salt published)",
        engine: SimEngine::Trtllm,
        layout: EventLayout::Map,
        events: "{engine: trtllm, trtllm: {transport: zmq}, salted_events: false}",
        salted: false,
    },
];

fn forwarded(tenant: &str) -> Option<String> {
    CacheSalt::new(tenant, SaltSource::Header)
        .ok()
        .flatten()
        .map(|s| Namespace::of(&s).forwarded())
}

/// kv-epp's overlap (tokens) for `tokens` under `tenant` (`None`: unsalted), best over workers.
async fn credited(admin: SocketAddr, tokens: &[u32], tenant: Option<&str>) -> Result<u64, String> {
    let mut body = serde_json::json!({"model": MODEL, "token_ids": tokens});
    if let Some(t) = tenant {
        body["cache_salt"] = serde_json::json!(t);
    }
    let r = httpc::post_json(admin, "/query", body.to_string().into_bytes(), LIMITS)
        .await
        .map_err(|e| format!("/query: {e}"))?;
    let v: serde_json::Value =
        serde_json::from_slice(r.body()).map_err(|e| format!("/query answer: {e}"))?;
    Ok(v["instances"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|i| i["overlap_tokens"].as_u64())
        .max()
        .unwrap_or(0))
}

async fn one(case: &Case, block_size: usize) -> Result<(String, bool), String> {
    let mut cfg = SimWorkerConfig::loopback(block_size, 256);
    cfg.served.model = MODEL.into();
    cfg.served.engine = case.engine;
    cfg.publisher.encoder.engine = case.engine;
    cfg.publisher.encoder.layout = case.layout;
    cfg.publisher.replay_endpoint = Some("tcp://127.0.0.1:0".into());
    let w = start(cfg, None).await?;
    let yaml = format!(
        "server: {{bind_address: 127.0.0.1, grpc_port: 0, grpc_health_port: 0, metrics_port: 0, admin_port: 0}}\n\
         engine_metrics: {{interval_ms: 0}}\nevents: {}\nmodels: [{{name: {MODEL}, block_size: {block_size}}}]\n\
         workers: [{{endpoint: '{}', model: {MODEL}, events_endpoint: '{}', replay_endpoint: '{}'}}]\n",
        case.events,
        w.http_addr,
        w.events.events_endpoint,
        w.events.replay_endpoint.clone().unwrap_or_default()
    );
    let config = Config::from_yaml(&yaml).map_err(|e| e.to_string())?;
    config.validate().map_err(|e| e.to_string())?;
    let server = Server::start(&config).await.map_err(|e| e.to_string())?;
    let tokens: Vec<u32> = (0..(block_size as u32 * 4)).map(|t| 11 + t * 7).collect();
    let n = tokens.len() as u64;
    let mut body = serde_json::json!({"model": MODEL, "prompt": tokens, "max_tokens": 1});
    if case.salted {
        body["cache_salt"] = serde_json::json!(forwarded("engine-a"));
    }
    let r = httpc::post_json(
        w.http_addr,
        "/v1/completions",
        body.to_string().into_bytes(),
        LIMITS,
    )
    .await
    .map_err(|e| format!("{}: {e}", case.label))?;
    if r.status() != httpc::StatusCode::OK {
        return Err(format!(
            "{}: the worker answered {}",
            case.label,
            r.status()
        ));
    }
    // The join replay brings the store even if it was published before the subscription.
    let owner = case.salted.then_some("engine-a");
    let deadline = Instant::now() + Duration::from_secs(15);
    let mut got = credited(server.admin_addr, &tokens, owner).await?;
    while got < n && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(50)).await;
        got = credited(server.admin_addr, &tokens, owner).await?;
    }
    let other = credited(server.admin_addr, &tokens, Some("engine-b")).await?;
    let line = if case.salted {
        let unsalted = credited(server.admin_addr, &tokens, None).await?;
        let ok = got == n && other == 0 && unsalted == 0;
        (
            format!(
                "{:<48} tenant A credited {got}/{n} tokens, tenant B {other}, unsalted {unsalted} -> {}",
                case.label,
                if ok { "isolated" } else { "NOT ISOLATED" }
            ),
            ok,
        )
    } else {
        let ok = got == n && other == 0;
        (
            format!(
                "{:<48} unsalted prefix credited {got}/{n} tokens, a salted query {other} -> {}",
                case.label,
                if ok {
                    "prefix routing, no tenant isolation"
                } else {
                    "NOT APPLIED"
                }
            ),
            ok,
        )
    };
    server.stop().await;
    Ok(line)
}

/// Runs every case; the report lines, and whether each did what its engine promises.
pub(crate) async fn run(block_size: usize) -> Result<(String, bool), String> {
    let mut out =
        String::from("\nother engines' KV events, each through kv-epp serve (admin /query):\n");
    let mut all = true;
    for case in &CASES {
        let (line, ok) = one(case, block_size).await?;
        out.push_str(&line);
        out.push('\n');
        all &= ok;
    }
    Ok((out, all))
}
