//! Simulated vLLM workers for black-box tests, and the checks that compare what kv-epp credits
//! with what a worker really holds.

use std::net::SocketAddr;

use kv_epp_core::namespace::Namespace;
use kv_epp_core::salt::{CacheSalt, SaltSource};
use kv_epp_sim::events::{EventLayout, HashForm, SimEngine};
use kv_epp_sim::prefix_cache::CacheRequest;
use kv_epp_sim::server::{SimWorker, SimWorkerConfig, start};
use serde_json::{Value, json};

/// The shape of a simulated worker serving model `m` with no simulated latency.
#[derive(Clone, Copy, Debug)]
pub struct SimSpec {
    pub block_size: usize,
    pub num_blocks: usize,
    pub max_num_seqs: usize,
    /// Fraction of event batches the publisher drops.
    pub drop: f64,
    /// Whether the worker has a replay socket.
    pub replay: bool,
    pub buffer_steps: usize,
    pub seed: u64,
    pub layout: EventLayout,
    pub hash_form: HashForm,
    /// The event port (a free one when `None`).
    pub events_port: Option<u16>,
    /// Which engine's events (and `cache_salt` rule) the worker simulates.
    pub engine: SimEngine,
}

impl Default for SimSpec {
    fn default() -> Self {
        SimSpec {
            block_size: 16,
            num_blocks: 600,
            max_num_seqs: 64,
            drop: 0.0,
            replay: true,
            buffer_steps: 10_000,
            seed: 1,
            layout: EventLayout::Map,
            hash_form: HashForm::Int,
            events_port: None,
            engine: SimEngine::Vllm,
        }
    }
}

/// Starts a simulated worker on loopback.
pub async fn sim_worker(s: SimSpec) -> SimWorker {
    let events_port = s.events_port.unwrap_or_else(super::free_port);
    let mut config = SimWorkerConfig::loopback(s.block_size, s.num_blocks);
    config.engine.max_num_seqs = s.max_num_seqs;
    let p = &mut config.publisher;
    p.events_endpoint = format!("tcp://127.0.0.1:{events_port}");
    p.replay_endpoint = s
        .replay
        .then(|| format!("tcp://127.0.0.1:{}", super::free_port()));
    p.buffer_steps = s.buffer_steps;
    p.drop_fraction = s.drop;
    p.fault_seed = s.seed;
    p.encoder.layout = s.layout;
    p.encoder.hash_form = s.hash_form;
    p.encoder.engine = s.engine;
    config.served.engine = s.engine;
    start(config, None).await.unwrap()
}

/// A tenant's salt as kv-epp forwards it to the engine.
pub fn fwd(tenant: &str) -> String {
    Namespace::of(&CacheSalt::new(tenant, SaltSource::Body).unwrap().unwrap()).forwarded()
}

/// Sends a completion straight to the worker, salted as kv-epp would forward it.
pub async fn send(w: &SimWorker, tokens: &[u32], tenant: &str) {
    send_as(w, tokens, Some(tenant)).await;
}

/// Sends a completion straight to the worker: salted as kv-epp would forward `tenant`'s, or
/// unsalted (`None`).
pub async fn send_as(w: &SimWorker, tokens: &[u32], tenant: Option<&str>) {
    let mut body = json!({"model": "m", "prompt": tokens, "max_tokens": 1});
    if let Some(tenant) = tenant {
        body["cache_salt"] = fwd(tenant).into();
    }
    let r = super::post_json(
        w.http_addr,
        "/v1/completions",
        &[],
        body.to_string().as_bytes(),
    )
    .await
    .unwrap();
    assert_eq!(r.status, 200, "{}", r.text());
}

/// kv-epp's overlap (tokens) for a prompt on `worker`, from the admin `/query` at `admin`.
pub async fn believed(
    admin: SocketAddr,
    worker: SocketAddr,
    tokens: &[u32],
    tenant: Option<&str>,
) -> u64 {
    let headers: Vec<(&str, &str)> = tenant.map(|t| ("x-tenant-id", t)).into_iter().collect();
    let r = super::http(
        admin,
        "POST",
        "/query",
        &headers,
        json!({"model": "m", "token_ids": tokens})
            .to_string()
            .as_bytes(),
    )
    .await
    .unwrap();
    let v: Value = serde_json::from_slice(&r.body).unwrap();
    v["instances"]
        .as_array()
        .unwrap()
        .iter()
        .find(|i| i["worker"] == worker.to_string())
        .map_or(0, |i| i["overlap_tokens"].as_u64().unwrap_or(0))
}

/// What the worker really holds (tokens) for a prompt under a tenant.
pub fn truth(w: &SimWorker, tokens: &[u32], tenant: &str) -> u64 {
    let salt = fwd(tenant);
    w.engine.peek_cached_tokens(&CacheRequest {
        tokens,
        salt: Some(&salt),
        lora_name: None,
    }) as u64
}
