//! Engine-reported load reaches the scorer: a worker whose `/metrics` shows a long queue loses
//! traffic to an idle one, and figures that go stale are withdrawn.

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use common::eventually;
use kv_epp::config::Config;
use kv_epp::decide::{RequestParts, decide};
use kv_epp::server::Server;
use tokio::net::TcpListener;

/// A worker whose /metrics reports `waiting` queued requests (until `up` is cleared).
async fn metrics_worker(waiting: f64, up: Arc<AtomicBool>) -> std::net::SocketAddr {
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    let app = axum::Router::new().route(
        "/metrics",
        axum::routing::get(move || {
            let up = up.clone();
            async move {
                if !up.load(Ordering::Relaxed) {
                    return (axum::http::StatusCode::SERVICE_UNAVAILABLE, String::new());
                }
                (
                    axum::http::StatusCode::OK,
                    format!(
                        "vllm:num_requests_running{{model_name=\"m\",engine=\"0\"}} 2.0\nvllm:num_requests_waiting{{model_name=\"m\",engine=\"0\"}} {waiting}\nvllm:kv_cache_usage_perc{{model_name=\"m\",engine=\"0\"}} 0.9\n"
                    ),
                )
            }
        }),
    );
    tokio::spawn(async move {
        let _ = axum::serve(l, app).await;
    });
    addr
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn busy_engines_lose_traffic_and_stale_figures_are_dropped() {
    let busy_up = Arc::new(AtomicBool::new(true));
    let busy = metrics_worker(40.0, busy_up.clone()).await;
    let idle = metrics_worker(0.0, Arc::new(AtomicBool::new(true))).await;
    let yaml = format!(
        "server: {{bind_address: 127.0.0.1, grpc_port: 0, grpc_health_port: 0, metrics_port: 0, admin_port: 0}}\n\
         events: {{engine: none}}\nengine_metrics: {{interval_ms: 50, stale_after_ms: 300}}\n\
         models: [{{name: m, block_size: 4}}]\nworkers: [{{endpoint: '{busy}', model: m}}, {{endpoint: '{idle}', model: m}}]"
    );
    let c = Config::from_yaml(&yaml).unwrap();
    c.validate().unwrap();
    let server = Server::start(&c).await.unwrap();
    let loaded = |addr| {
        server
            .picker
            .workers
            .all()
            .iter()
            .any(|w| w.id.endpoint == addr && w.engine_load().is_some())
    };
    assert!(
        eventually(5, || loaded(busy) && loaded(idle)).await,
        "figures scraped"
    );
    for _ in 0..20 {
        let d = decide(&server.picker, &RequestParts::default()).unwrap();
        assert_eq!(d.pick.endpoint, idle, "the queued engine is avoided");
    }
    busy_up.store(false, Ordering::Relaxed);
    assert!(
        eventually(5, || !loaded(busy)).await,
        "stale figures withdrawn"
    );
    server.stop().await;
    tokio::time::sleep(Duration::from_millis(10)).await;
}
