//! TensorRT-LLM events over real HTTP on loopback: a fake engine whose `POST /kv_cache_events`
//! drains destructively; kv-epp polls it, applies events exactly once, and survives garbage.

mod common;

use std::sync::{Arc, Mutex};

use common::{eventually, http, wait_worker_blocks};
use kv_epp::config::Config;
use kv_epp::server::Server;
use kv_epp_core::namespace::Namespace;
use kv_epp_core::salt::{CacheSalt, SaltSource};
use serde_json::{Value, json};
use tokio::net::TcpListener;

/// Queued responses: each drain returns (and forgets) the next one; then `[]`.
type Queue = Arc<Mutex<Vec<String>>>;

async fn fake_engine(queue: Queue) -> std::net::SocketAddr {
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    let app = axum::Router::new().route(
        "/kv_cache_events",
        axum::routing::post(move || {
            let q = queue.clone();
            async move {
                let mut q = q.lock().unwrap();
                if q.is_empty() {
                    "[]".to_string()
                } else {
                    q.remove(0)
                }
            }
        }),
    );
    tokio::spawn(async move {
        let _ = axum::serve(l, app).await;
    });
    addr
}

fn block(h: u64, toks: &[u32], salt: &str) -> Value {
    json!({"type": "stored_block", "block_hash": h, "tokens": toks.iter().map(|t| json!({"token_id": t, "token_extra_id": 0})).collect::<Vec<_>>(), "lora_id": null, "cache_level": 0, "priority": 35, "cache_salt": salt})
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn polls_apply_once_and_survive_garbage() {
    let salt = Namespace::of(
        &CacheSalt::new("tenant-a", SaltSource::Body)
            .unwrap()
            .unwrap(),
    )
    .forwarded();
    let stored = json!([{"event_id": 0, "data": {"type": "created", "num_blocks_per_cache_level": [100, 0]}},
        {"event_id": 1, "data": {"type": "stored", "parent_hash": null, "blocks": [block(11, &[1, 2, 3, 4], &salt), block(12, &[5, 6, 7, 8], &salt)]}}]);
    let queue: Queue = Arc::new(Mutex::new(vec![
        "not json at all".into(),
        stored.to_string(),
        "{\"an\": \"object\"}".into(),
        json!([{"event_id": 2, "data": {"type": "stored", "blocks": "garbage"}}, {"event_id": 3, "data": {"type": "removed", "block_hashes": [12]}}]).to_string(),
    ]));
    let engine = fake_engine(queue.clone()).await;
    let yaml = format!(
        "server: {{bind_address: 127.0.0.1, grpc_port: 0, grpc_health_port: 0, metrics_port: 0, admin_port: 0}}\n\
         events: {{engine: trtllm, trtllm: {{poll_interval_ms: 20}}}}\nengine_metrics: {{interval_ms: 0}}\n\
         models: [{{name: m, block_size: 4}}]\nworkers: [{{endpoint: '{engine}', model: m}}]"
    );
    let c = Config::from_yaml(&yaml).unwrap();
    c.validate().unwrap();
    let server = Server::start(&c).await.unwrap();
    assert!(
        eventually(5, || queue.lock().unwrap().is_empty()).await,
        "all drained"
    );
    assert!(wait_worker_blocks(&server, engine, 1).await);
    let tokens = [1, 2, 3, 4, 5, 6, 7, 8];
    assert_eq!(
        common::sim::believed(server.admin_addr, engine, &tokens, Some("tenant-a")).await,
        4
    );
    let w = http(server.admin_addr, "GET", "/workers", &[], b"")
        .await
        .unwrap();
    let v: Value = serde_json::from_slice(&w.body).unwrap();
    assert_eq!(v["workers"][0]["events"]["engine"], "trtllm");
    assert!(
        v["workers"][0]["events"]["failures"].as_u64().unwrap() >= 2,
        "{v}"
    );
    assert_eq!(v["workers"][0]["blocks"], 1);
    server.stop().await;
}
