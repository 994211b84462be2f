//! InferencePool discovery against a fake Kubernetes API server that speaks the real list/watch
//! protocol over real sockets (`common/kube_api.rs`). kv-epp runs in-process (and once as the
//! real binary); every assertion polls with a deadline and reads the server's own state: the
//! router's workers, the event feeds' endpoints, routing decisions, the admin `/workers` page
//! and the gRPC health `readiness` service.

mod common;
#[path = "common/kube_api.rs"]
mod kube_api;

use std::collections::BTreeSet;
use std::path::PathBuf;
use std::time::Duration;

use common::sim::SimSpec;
use kube_api::{FakeKube, Res, endpoint_slice, pod, pool_v1, pool_v1alpha2};
use kv_epp::config::Config;
use kv_epp::decide::{RequestParts, decide};
use kv_epp::server::Server;
use kv_epp_sim::server::SimWorker;
use serde_json::json;
use tonic_health::pb::HealthCheckRequest;
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;

const NS: &str = "ai";
const POOL: &str = "llama";
const DEADLINE_SECS: u64 = 20;

fn tmp_dir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("kv-epp-discovery-{}-{name}", std::process::id()));
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// A discovery config for the fake API (`extra_pool`: more `pool:` keys; `rest`: more sections).
fn config(fake: &FakeKube, name: &str, extra_pool: &str, rest: &str) -> Config {
    let kubeconfig = fake.kubeconfig(&tmp_dir(name));
    let models = if rest.contains("models:") {
        ""
    } else {
        "models: [{name: m, block_size: 4}]\n"
    };
    let events = if rest.contains("events:") {
        ""
    } else {
        "events: {engine: vllm, zmq: {port: 5557, replay_port: 6557}}\n"
    };
    let yaml = format!(
        "server: {{bind_address: 127.0.0.1, grpc_port: 0, grpc_health_port: 0, metrics_port: 0, admin_port: 0}}\n\
         engine_metrics: {{interval_ms: 0}}\n\
         {events}\
         {models}\
         pool: {{name: {POOL}, namespace: {NS}, kubeconfig: '{}', api_unreachable_timeout_ms: 1000{extra_pool}}}\n{rest}",
        kubeconfig.display()
    );
    let c = Config::from_yaml(&yaml).unwrap();
    c.validate().unwrap();
    assert!(c.discovers_workers());
    c
}

/// The router's workers as sorted `ip:port#rank` strings.
fn workers(s: &Server) -> Vec<String> {
    let mut v: Vec<String> = s
        .picker
        .workers
        .all()
        .iter()
        .map(|w| w.id.to_string())
        .collect();
    v.sort();
    v
}

/// The feeds' (worker, events endpoint, replay endpoint), sorted.
fn feeds(s: &Server) -> Vec<(String, String, Option<String>)> {
    let mut v: Vec<_> = s
        .feeds
        .statuses()
        .into_iter()
        .map(|(w, e, _)| (w.to_string(), e.events, e.replay))
        .collect();
    v.sort();
    v
}

fn strings(v: &[&str]) -> Vec<String> {
    v.iter().map(|s| (*s).to_owned()).collect()
}

/// Waits until the router's workers are exactly `want`.
async fn expect_workers(s: &Server, want: &[&str]) {
    let want = strings(want);
    let ok = common::eventually(DEADLINE_SECS, || workers(s) == want).await;
    assert!(ok, "workers {:?}, expected {want:?}", workers(s));
}

/// Routes a few requests and returns the endpoints picked.
fn picks(s: &Server) -> BTreeSet<String> {
    (0..8u32)
        .filter_map(|i| {
            let tokens = [i, i + 1, i + 2, i + 3, i + 4, i + 5, i + 6, i + 7];
            let body = serde_json::json!({"model": "m", "prompt": tokens}).to_string();
            let parts = RequestParts {
                path: "/v1/completions",
                body: Some(body.as_bytes()),
                ..RequestParts::default()
            };
            let d = decide(&s.picker, &parts).ok()?;
            Some(d.pick.to_string())
        })
        .collect()
}

/// What the gRPC health service says of `service` (`readiness` or `liveness`).
async fn health(s: &Server, service: &str) -> Option<ServingStatus> {
    let url = format!("http://{}", s.health_addr);
    let ch = tonic::transport::Endpoint::from_shared(url)
        .ok()?
        .connect()
        .await
        .ok()?;
    let r = HealthClient::new(ch)
        .check(HealthCheckRequest {
            service: service.into(),
        })
        .await
        .ok()?;
    ServingStatus::try_from(r.into_inner().status).ok()
}

async fn readiness(s: &Server) -> Option<ServingStatus> {
    health(s, "readiness").await
}

async fn expect_readiness(s: &Server, want: ServingStatus) {
    let deadline = std::time::Instant::now() + Duration::from_secs(DEADLINE_SECS);
    loop {
        let got = readiness(s).await;
        if got == Some(want) {
            return;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "readiness {got:?}, expected {want:?} (unmet: {:?})",
            s.readiness.unmet()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The admin `/workers` page's worker ids.
async fn admin_workers(s: &Server) -> Vec<String> {
    let r = common::http(s.admin_addr, "GET", "/workers", &[], b"")
        .await
        .unwrap();
    assert_eq!(r.status, 200);
    worker_ids(&r.body)
}

/// `ip:port#rank` of every worker on a `/workers` page, sorted.
fn worker_ids(body: &[u8]) -> Vec<String> {
    let v: serde_json::Value = serde_json::from_slice(body).unwrap();
    let mut out: Vec<String> = v["workers"]
        .as_array()
        .unwrap()
        .iter()
        .map(|w| format!("{}#{}", w["worker"].as_str().unwrap(), w["dp_rank"]))
        .collect();
    out.sort();
    out
}

fn app(name: &str) -> serde_json::Value {
    json!({ "app": name })
}

/// Puts the pool (pods labelled `app: vllm`, target port 8000) and a ready pod for each
/// `(name, ip)` into `fake`, starts kv-epp discovering it (`config` named `name`), and waits
/// until its workers are exactly those pods.
async fn discovering(fake: &FakeKube, name: &str, pods: &[(&str, &str)]) -> Server {
    fake.put(Res::PoolV1, NS, pool_v1(POOL, app("vllm"), &[8000]));
    for (pod_name, ip) in pods {
        fake.put(Res::Pods, NS, pod(pod_name, ip, true, app("vllm")));
    }
    let server = Server::start(&config(fake, name, "", "")).await.unwrap();
    let want: Vec<String> = pods.iter().map(|(_, ip)| format!("{ip}:8000")).collect();
    let want: Vec<&str> = want.iter().map(String::as_str).collect();
    expect_workers(&server, &want).await;
    server
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn workers_follow_pod_readiness_deletion_selector_and_target_ports() {
    let fake = FakeKube::start().await;
    fake.put(Res::PoolV1, NS, pool_v1(POOL, app("vllm"), &[8000]));
    fake.put(Res::Pods, NS, pod("a", "127.0.0.11", true, app("vllm")));
    fake.put(Res::Pods, NS, pod("b", "127.0.0.12", false, app("vllm")));
    fake.put(Res::Pods, NS, pod("c", "127.0.0.13", true, app("other")));
    // A pool in another namespace and a pod of it are not ours.
    fake.put(
        Res::Pods,
        "elsewhere",
        pod("x", "127.0.0.99", true, app("vllm")),
    );
    let server = Server::start(&config(&fake, "follow", "", ""))
        .await
        .unwrap();

    // 1. Only the ready pod matching the selector is a worker; its feed uses the pod IP.
    expect_workers(&server, &["127.0.0.11:8000"]).await;
    expect_readiness(&server, ServingStatus::Serving).await;
    assert_eq!(
        feeds(&server),
        vec![(
            "127.0.0.11:8000".into(),
            "tcp://127.0.0.11:5557".into(),
            Some("tcp://127.0.0.11:6557".into())
        )]
    );
    assert_eq!(
        picks(&server),
        BTreeSet::from(["127.0.0.11:8000".to_owned()])
    );

    // 2. b becomes ready: two workers, both routable and both in the index.
    fake.put(Res::Pods, NS, pod("b", "127.0.0.12", true, app("vllm")));
    expect_workers(&server, &["127.0.0.11:8000", "127.0.0.12:8000"]).await;
    assert_eq!(server.picker.models.index("m").unwrap().workers().len(), 2);

    // 3. a starts terminating: gone from router, index, feeds and routing.
    let mut terminating = pod("a", "127.0.0.11", true, app("vllm"));
    terminating["metadata"]["deletionTimestamp"] = json!("2026-12-02T00:00:00Z");
    fake.put(Res::Pods, NS, terminating);
    expect_workers(&server, &["127.0.0.12:8000"]).await;
    let index_workers: Vec<String> = server
        .picker
        .models
        .index("m")
        .unwrap()
        .workers()
        .iter()
        .map(|w| w.to_string())
        .collect();
    assert_eq!(index_workers, vec!["127.0.0.12:8000"]);
    assert_eq!(feeds(&server).len(), 1);
    assert_eq!(
        picks(&server),
        BTreeSet::from(["127.0.0.12:8000".to_owned()])
    );

    // 4. b becomes unready, then a is deleted: no workers left, no route.
    fake.put(Res::Pods, NS, pod("b", "127.0.0.12", false, app("vllm")));
    fake.delete(Res::Pods, NS, "a");
    expect_workers(&server, &[]).await;
    assert!(picks(&server).is_empty());
    assert!(feeds(&server).is_empty());

    // 5. Two target ports: each ready pod is two data-parallel ranks, rank r on events port+r.
    fake.put(Res::Pods, NS, pod("b", "127.0.0.12", true, app("vllm")));
    fake.put(Res::PoolV1, NS, pool_v1(POOL, app("vllm"), &[8000, 8001]));
    expect_workers(&server, &["127.0.0.12:8000", "127.0.0.12:8001#1"]).await;
    assert_eq!(
        feeds(&server),
        vec![
            (
                "127.0.0.12:8000".into(),
                "tcp://127.0.0.12:5557".into(),
                Some("tcp://127.0.0.12:6557".into())
            ),
            (
                "127.0.0.12:8001#1".into(),
                "tcp://127.0.0.12:5558".into(),
                Some("tcp://127.0.0.12:6558".into())
            ),
        ]
    );
    assert_eq!(
        admin_workers(&server).await,
        strings(&["127.0.0.12:8000#0", "127.0.0.12:8001#1"])
    );

    // 6. The selector changes: the pod watch follows it (c matches now, b no longer).
    let lists_before = fake.lists(Res::Pods);
    fake.put(Res::PoolV1, NS, pool_v1(POOL, app("other"), &[9000]));
    expect_workers(&server, &["127.0.0.13:9000"]).await;
    assert!(
        fake.lists(Res::Pods) > lists_before,
        "a new pod list for the new selector"
    );
    assert_eq!(
        picks(&server),
        BTreeSet::from(["127.0.0.13:9000".to_owned()])
    );

    // 7. Bad API data is skipped: an invalid pool update keeps the last valid pool, and pods
    //    with nonsense status never become workers; pods of the selector keep being followed.
    let mut invalid = pool_v1(POOL, app("other"), &[9000]);
    invalid["spec"]["targetPorts"] = json!("all of them");
    fake.put(Res::PoolV1, NS, invalid);
    let mut weird = pod("weird", "127.0.0.15", true, app("other"));
    weird["status"] = json!({"podIP": 7, "conditions": "Ready"});
    fake.put(Res::Pods, NS, weird);
    fake.put(
        Res::Pods,
        NS,
        pod("bad-ip", "not-an-ip", true, app("other")),
    );
    fake.put(Res::Pods, NS, pod("d", "127.0.0.14", true, app("other")));
    expect_workers(&server, &["127.0.0.13:9000", "127.0.0.14:9000"]).await;
    expect_readiness(&server, ServingStatus::Serving).await;

    // 8. The pool is deleted: no workers, not ready.
    fake.delete(Res::PoolV1, NS, POOL);
    expect_workers(&server, &[]).await;
    expect_readiness(&server, ServingStatus::NotServing).await;
    server.stop().await;
}

/// A simulated vLLM worker on 127.0.0.1: HTTP on an ephemeral port, KV events on `events_port`.
async fn sim_worker(events_port: u16) -> SimWorker {
    common::sim::sim_worker(SimSpec {
        block_size: 4,
        num_blocks: 256,
        max_num_seqs: 8,
        replay: false,
        buffer_steps: 1000,
        events_port: Some(events_port),
        ..SimSpec::default()
    })
    .await
}

/// A fake API with the pool and one Ready pod at 127.0.0.1 whose target port is a running
/// simulated worker's HTTP port; the worker publishes events on the returned port.
async fn pool_of_one_sim_worker() -> (SimWorker, FakeKube, u16) {
    let events_port = common::free_port();
    let sim = sim_worker(events_port).await;
    let fake = FakeKube::start().await;
    fake.put(
        Res::PoolV1,
        NS,
        pool_v1(POOL, app("vllm"), &[sim.http_addr.port()]),
    );
    fake.put(Res::Pods, NS, pod("sim", "127.0.0.1", true, app("vllm")));
    (sim, fake, events_port)
}

/// kv-epp's overlap in tokens for an unsalted token prompt on `worker`, from the admin `/query`.
async fn believed(server: &Server, worker: std::net::SocketAddr, tokens: &[u32]) -> u64 {
    common::sim::believed(server.admin_addr, worker, tokens, None).await
}

/// Sends unsalted prompts straight to the worker until `server` credits one (its subscription
/// is live); returns that prompt.
async fn send_until_credited(server: &Server, sim: &SimWorker) -> Vec<u32> {
    let deadline = std::time::Instant::now() + Duration::from_secs(DEADLINE_SECS);
    for i in 0u32.. {
        let tokens: Vec<u32> = (0..16).map(|t| 1000 * (i + 1) + t).collect();
        let body = json!({"model": "m", "prompt": tokens, "max_tokens": 1}).to_string();
        let r = common::http(
            sim.http_addr,
            "POST",
            "/v1/completions",
            &[],
            body.as_bytes(),
        )
        .await
        .unwrap();
        assert_eq!(r.status, 200, "{}", r.text());
        let settle = std::time::Instant::now() + Duration::from_secs(1);
        while std::time::Instant::now() < settle {
            if believed(server, sim.http_addr, &tokens).await >= 12 {
                return tokens;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "no event of the worker was applied"
        );
    }
    unreachable!("the loop returns or fails")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_discovered_workers_events_feed_the_index_until_its_pod_goes() {
    // A real simulated vLLM worker publishes KV events on tcp://127.0.0.1:P; its pod has IP
    // 127.0.0.1 and the pool's target port is its HTTP port, so kv-epp derives the event
    // endpoint from the pod IP and events.zmq.port, subscribes, and credits its blocks.
    let (sim, fake, events_port) = pool_of_one_sim_worker().await;
    let rest = format!("events: {{engine: vllm, zmq: {{port: {events_port}, replay_port: 0}}}}\n");
    let server = Server::start(&config(&fake, "sim", "", &rest))
        .await
        .unwrap();
    let worker = sim.http_addr.to_string();
    expect_workers(&server, &[&worker]).await;
    assert_eq!(
        feeds(&server),
        vec![(
            worker.clone(),
            format!("tcp://127.0.0.1:{events_port}"),
            None
        )]
    );

    // Prompts go straight to the worker until kv-epp credits one (the subscription is live).
    let tokens = send_until_credited(&server, &sim).await;

    // The pod goes: the worker, its feed and its blocks go with it, and when the pod comes back
    // none of the old blocks is credited again (the index forgot them; nothing new was sent).
    fake.delete(Res::Pods, NS, "sim");
    expect_workers(&server, &[]).await;
    assert!(feeds(&server).is_empty());
    assert!(
        server
            .picker
            .models
            .index("m")
            .unwrap()
            .workers()
            .is_empty()
    );
    assert_eq!(believed(&server, sim.http_addr, &tokens).await, 0);
    fake.put(Res::Pods, NS, pod("sim", "127.0.0.1", true, app("vllm")));
    expect_workers(&server, &[&worker]).await;
    assert_eq!(believed(&server, sim.http_addr, &tokens).await, 0);
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_410_gone_relists_and_the_state_is_exact() {
    let fake = FakeKube::start().await;
    let server = discovering(&fake, "gone", &[("a", "127.0.0.21"), ("b", "127.0.0.22")]).await;
    let ok = common::eventually(DEADLINE_SECS, || fake.watches(Res::Pods) >= 1).await;
    assert!(ok, "kv-epp watches the pods after listing them");
    let (pool_lists, pod_lists) = (fake.lists(Res::PoolV1), fake.lists(Res::Pods));

    // Changes whose events never reach kv-epp, then every watch ends with 410 Gone: a is
    // deleted, b turns unready, e appears. Only a relist can show them.
    fake.lose_events_then_expire(|api| {
        api.delete(Res::Pods, NS, "a");
        api.put(Res::Pods, NS, pod("b", "127.0.0.22", false, app("vllm")));
        api.put(Res::Pods, NS, pod("e", "127.0.0.25", true, app("vllm")));
    });
    expect_workers(&server, &["127.0.0.25:8000"]).await;
    assert!(fake.lists(Res::Pods) > pod_lists && fake.lists(Res::PoolV1) > pool_lists);
    assert_eq!(server.picker.workers.all().len(), 1, "no duplicate workers");
    assert_eq!(server.picker.models.index("m").unwrap().workers().len(), 1);
    assert_eq!(feeds(&server).len(), 1);

    // Watching resumes after the relist: live events are applied again.
    fake.put(Res::Pods, NS, pod("b", "127.0.0.22", true, app("vllm")));
    expect_workers(&server, &["127.0.0.22:8000", "127.0.0.25:8000"]).await;
    // A second 410 with nothing lost changes nothing and duplicates nothing.
    fake.lose_events_then_expire(|_| {});
    let lists = fake.lists(Res::Pods);
    let ok = common::eventually(DEADLINE_SECS, || fake.lists(Res::Pods) > lists).await;
    assert!(ok, "relisted after the second 410");
    expect_workers(&server, &["127.0.0.22:8000", "127.0.0.25:8000"]).await;
    expect_readiness(&server, ServingStatus::Serving).await;
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_api_outage_keeps_workers_and_flips_readiness_until_recovery() {
    let fake = FakeKube::start().await;
    let server = discovering(&fake, "outage", &[("a", "127.0.0.31")]).await;
    expect_readiness(&server, ServingStatus::Serving).await;

    // Outage: after the configured timeout (1 s here) readiness goes NotServing; the last known
    // workers stay and are still routed to.
    fake.stop().await;
    expect_readiness(&server, ServingStatus::NotServing).await;
    let unmet = server.readiness.unmet();
    assert!(
        unmet
            .iter()
            .any(|(n, why)| *n == "discovery" && why.contains("unreachable")),
        "{unmet:?}"
    );
    assert_eq!(
        admin_workers(&server).await,
        strings(&["127.0.0.31:8000#0"])
    );
    assert_eq!(
        picks(&server),
        BTreeSet::from(["127.0.0.31:8000".to_owned()])
    );
    // Liveness does not depend on discovery.
    assert_eq!(
        health(&server, "liveness").await,
        Some(ServingStatus::Serving)
    );

    // Recovery, with a change made while kv-epp could not see it.
    fake.put(Res::Pods, NS, pod("b", "127.0.0.32", true, app("vllm")));
    fake.restart().await;
    expect_workers(&server, &["127.0.0.31:8000", "127.0.0.32:8000"]).await;
    expect_readiness(&server, ServingStatus::Serving).await;
    assert_eq!(
        admin_workers(&server).await,
        strings(&["127.0.0.31:8000#0", "127.0.0.32:8000#0"])
    );
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn falls_back_to_v1alpha2_when_v1_is_not_served() {
    let fake = FakeKube::start().await;
    fake.set_served(Res::PoolV1, false);
    fake.put(
        Res::PoolV1alpha2,
        NS,
        pool_v1alpha2(POOL, app("vllm"), 8000),
    );
    fake.put(Res::Pods, NS, pod("a", "127.0.0.41", true, app("vllm")));
    let server = Server::start(&config(&fake, "alpha", "", ""))
        .await
        .unwrap();
    expect_workers(&server, &["127.0.0.41:8000"]).await;
    expect_readiness(&server, ServingStatus::Serving).await;
    assert!(fake.lists(Res::PoolV1alpha2) >= 1);
    fake.put(
        Res::PoolV1alpha2,
        NS,
        pool_v1alpha2(POOL, app("vllm"), 8100),
    );
    expect_workers(&server, &["127.0.0.41:8100"]).await;
    server.stop().await;

    // Pinned to v1, the same cluster yields nothing and readiness says why.
    let server = Server::start(&config(&fake, "alpha-pinned", ", api_version: v1", ""))
        .await
        .unwrap();
    expect_readiness(&server, ServingStatus::NotServing).await;
    assert!(workers(&server).is_empty());
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn several_models_are_told_apart_by_a_pod_label() {
    let fake = FakeKube::start().await;
    fake.put(Res::PoolV1, NS, pool_v1(POOL, app("vllm"), &[8000]));
    let with = |model: &str| json!({"app": "vllm", "kv-epp.io/model": model});
    fake.put(Res::Pods, NS, pod("a", "127.0.0.51", true, with("llama")));
    fake.put(Res::Pods, NS, pod("b", "127.0.0.52", true, with("qwen")));
    fake.put(Res::Pods, NS, pod("c", "127.0.0.53", true, with("unknown")));
    fake.put(Res::Pods, NS, pod("d", "127.0.0.54", true, app("vllm")));
    let rest = "models: [{name: llama, block_size: 4}, {name: qwen, block_size: 4}]\n";
    let server = Server::start(&config(&fake, "models", "", rest))
        .await
        .unwrap();
    expect_workers(&server, &["127.0.0.51:8000", "127.0.0.52:8000"]).await;
    let by_model: Vec<(String, String)> = {
        let mut v: Vec<_> = server
            .picker
            .workers
            .all()
            .iter()
            .map(|w| (w.id.to_string(), w.model.clone()))
            .collect();
        v.sort();
        v
    };
    assert_eq!(
        by_model,
        vec![
            ("127.0.0.51:8000".into(), "llama".into()),
            ("127.0.0.52:8000".into(), "qwen".into())
        ]
    );
    let r = common::http(server.metrics_addr, "GET", "/metrics", &[], b"")
        .await
        .unwrap();
    let text = r.text();
    for reason in ["unknown_model", "no_model_label"] {
        let line = format!("kv_epp_discovery_skipped_pods{{reason=\"{reason}\"}} 1");
        assert!(text.contains(&line), "missing `{line}` in:\n{text}");
    }
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn peer_addresses_follow_the_services_endpoint_slices() {
    let fake = FakeKube::start().await;
    // A slice of `service`'s port `peer` (9004) listing (ip, ready) endpoints.
    let put_slice = |name: &str, service: &str, eps: &[(&str, bool)]| {
        fake.put(
            Res::EndpointSlices,
            NS,
            endpoint_slice(name, service, ("peer", 9004), eps),
        )
    };
    put_slice("peers-1", "kv-epp-peers", &[("127.0.0.61", true)]);
    put_slice("other", "another-svc", &[("127.0.0.69", true)]);
    let kubeconfig = fake.kubeconfig(&tmp_dir("peers"));
    let client = kv_epp::discovery::client_for(Some(&kubeconfig))
        .await
        .unwrap();
    let rx = kv_epp::discovery::watch_service_endpoints(client, NS, "kv-epp-peers", "peer").await;
    wait_endpoints(&rx, &["127.0.0.61:9004"], &[]).await;

    // A bootstrapping replica appears not ready, then becomes ready.
    put_slice(
        "peers-1",
        "kv-epp-peers",
        &[("127.0.0.61", true), ("127.0.0.62", false)],
    );
    wait_endpoints(&rx, &["127.0.0.61:9004"], &["127.0.0.62:9004"]).await;
    put_slice("peers-2", "kv-epp-peers", &[("127.0.0.62", true)]);
    put_slice("peers-1", "kv-epp-peers", &[("127.0.0.61", true)]);
    wait_endpoints(&rx, &["127.0.0.61:9004", "127.0.0.62:9004"], &[]).await;

    // A 410 with a lost deletion: the relist drops the vanished slice.
    fake.lose_events_then_expire(|api| api.delete(Res::EndpointSlices, NS, "peers-1"));
    wait_endpoints(&rx, &["127.0.0.62:9004"], &[]).await;
    fake.delete(Res::EndpointSlices, NS, "peers-2");
    wait_endpoints(&rx, &[], &[]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn static_workers_need_no_kubernetes() {
    // pool.name is set but workers are listed: no discovery, no API, ready at once.
    let addr: std::net::SocketAddr = "127.0.0.71:8000".parse().unwrap();
    let c = common::kv_epp_config(&[addr], "pool: {name: llama}\n");
    assert!(!c.discovers_workers());
    let server = Server::start(&c).await.unwrap();
    expect_readiness(&server, ServingStatus::Serving).await;
    assert_eq!(workers(&server), vec!["127.0.0.71:8000"]);
    assert!(server.readiness.unmet().is_empty());
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_binary_discovers_through_kubeconfig_and_namespace_from_the_environment() {
    let fake = FakeKube::start().await;
    fake.put(Res::PoolV1, NS, pool_v1(POOL, app("vllm"), &[8000, 8001]));
    fake.put(Res::Pods, NS, pod("a", "127.0.0.81", true, app("vllm")));
    let dir = tmp_dir("binary");
    let kubeconfig = fake.kubeconfig(&dir);
    let cfg = dir.join("kv-epp.yaml");
    std::fs::write(
        &cfg,
        "server: {bind_address: 127.0.0.1}\nengine_metrics: {interval_ms: 0}\nmodels: [{name: m, block_size: 4}]\n",
    )
    .unwrap();
    let ports: Vec<u16> = (0..4).map(|_| common::free_port()).collect();
    let child = std::process::Command::new(env!("CARGO_BIN_EXE_kv-epp"))
        .args([
            "serve",
            "--config-file",
            cfg.to_str().unwrap(),
            "--pool-name",
            POOL,
        ])
        .args(["--grpc-port", &ports[0].to_string()])
        .args(["--grpc-health-port", &ports[1].to_string()])
        .args(["--metrics-port", &ports[2].to_string()])
        .args(["--admin-port", &ports[3].to_string()])
        .env("KUBECONFIG", &kubeconfig)
        .env("NAMESPACE", NS)
        .env_remove("KUBERNETES_SERVICE_HOST")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("start kv-epp serve");
    let _guard = common::ChildGuard(child);
    let admin = std::net::SocketAddr::from(([127, 0, 0, 1], ports[3]));
    let want = strings(&["127.0.0.81:8000#0", "127.0.0.81:8001#1"]);
    let deadline = std::time::Instant::now() + Duration::from_secs(DEADLINE_SECS);
    loop {
        let got = match common::http(admin, "GET", "/workers", &[], b"").await {
            Ok(r) if r.status == 200 => worker_ids(&r.body),
            _ => Vec::new(),
        };
        if got == want {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "workers {got:?}, expected {want:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Waits until the published peer endpoints are exactly `ready` and `not_ready`.
async fn wait_endpoints(
    rx: &tokio::sync::watch::Receiver<kv_epp::discovery::ServiceEndpoints>,
    ready: &[&str],
    not_ready: &[&str],
) {
    let addrs = |v: &[&str]| -> Vec<std::net::SocketAddr> {
        v.iter().map(|s| s.parse().unwrap()).collect()
    };
    let (ready, not_ready) = (addrs(ready), addrs(not_ready));
    let mut rx = rx.clone();
    let ok = tokio::time::timeout(
        Duration::from_secs(DEADLINE_SECS),
        rx.wait_for(|e| e.listed && e.ready == ready && e.not_ready == not_ready),
    )
    .await
    .is_ok_and(|r| r.is_ok());
    assert!(ok, "endpoints {:?}", *rx.borrow());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn discovery_works_over_https_with_the_clusters_ca() {
    // The in-cluster API is HTTPS under the service account's CA: rustls with ring verifies the
    // fake's self-signed certificate from the kubeconfig's certificate-authority file.
    let fake = FakeKube::start_tls().await;
    let server = discovering(&fake, "https", &[("a", "127.0.0.91")]).await;
    fake.put(Res::Pods, NS, pod("b", "127.0.0.92", true, app("vllm")));
    expect_workers(&server, &["127.0.0.91:8000", "127.0.0.92:8000"]).await;
    expect_readiness(&server, ServingStatus::Serving).await;
    server.stop().await;

    // A client that does not trust the certificate gets nothing (and does not panic).
    let untrusting = tmp_dir("https-untrusted").join("kubeconfig");
    let text = format!(
        "apiVersion: v1\nkind: Config\nclusters:\n- name: c\n  cluster:\n    server: https://{}\nusers:\n- name: u\n  user: {{}}\ncontexts:\n- name: c\n  context: {{cluster: c, user: u}}\ncurrent-context: c\n",
        fake.addr
    );
    std::fs::write(&untrusting, text).unwrap();
    let client = kv_epp::discovery::client_for(Some(&untrusting))
        .await
        .unwrap();
    assert!(client.apiserver_version().await.is_err());
}

/// Two replicas on Kubernetes: workers come from the InferencePool, peers from the EndpointSlices
/// of kv-epp's own Service (the joining replica is listed not-ready). The second replica copies
/// the first one's index and agrees with it; its readiness waits for that.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_finds_its_peer_through_endpoint_slices_and_bootstraps() {
    let (sim, fake, events_port) = pool_of_one_sim_worker().await;
    let peer_port = common::free_port();
    let rest = format!(
        "events: {{engine: vllm, zmq: {{port: {events_port}, replay_port: 0}}}}\n\
         peers: {{service: kv-epp-peers, port: {peer_port}, probe_interval_ms: 100, insecure_allow_anonymous: true}}\n"
    );
    // Each replica has its own loopback address; both listen on the same peer port, as pods do.
    let slice = |b_ready: Option<bool>| {
        let mut eps = vec![("127.0.0.71", true)];
        if let Some(r) = b_ready {
            eps.push(("127.0.0.72", r));
        }
        endpoint_slice("kv-epp-peers-x", "kv-epp-peers", ("peer", peer_port), &eps)
    };
    fake.put(Res::EndpointSlices, NS, slice(None));
    let mut ca = config(&fake, "peer-a", "", &rest);
    ca.server.bind_address = "127.0.0.71".parse().unwrap();
    let a = Server::start(&ca).await.unwrap();
    let ra = a.replica.clone().unwrap();
    assert!(
        common::eventually(DEADLINE_SECS, || ra.is_ready()).await,
        "a starts alone"
    );
    let worker = sim.http_addr.to_string();
    expect_workers(&a, &[&worker]).await;
    // Traffic until a credits the worker's blocks.
    send_until_credited(&a, &sim).await;
    let index_a = a.picker.models.index("m").unwrap().clone();
    assert!(index_a.digest().1 > 0);

    fake.put(Res::EndpointSlices, NS, slice(Some(false)));
    let mut cb = config(&fake, "peer-b", "", &rest);
    cb.server.bind_address = "127.0.0.72".parse().unwrap();
    let b = Server::start(&cb).await.unwrap();
    let rb = b.replica.clone().unwrap();
    assert!(
        common::eventually(DEADLINE_SECS, || rb.is_ready()).await,
        "b bootstraps"
    );
    assert!(rb.counters.blocks_restored.get() > 0, "b copied a's index");
    assert_eq!(ra.counters.snapshots_served.get(), 1);
    let index_b = b.picker.models.index("m").unwrap().clone();
    assert!(
        common::eventually(DEADLINE_SECS, || index_a.digest() == index_b.digest()).await,
        "digests agree: {:?} vs {:?}",
        index_a.digest(),
        index_b.digest()
    );
    // Operators see the same on the metrics port.
    let m = common::http(b.metrics_addr, "GET", "/metrics", &[], b"")
        .await
        .unwrap()
        .text();
    assert!(m.contains("kv_epp_replica_ready 1"), "{m}");
    let restored = m
        .lines()
        .find_map(|l| l.strip_prefix("kv_epp_replica_blocks_restored_total "))
        .and_then(|v| v.trim().parse::<u64>().ok())
        .unwrap_or(0);
    assert!(restored > 0, "{m}");
    assert!(m.contains("kv_epp_replica_peers{state=\"ready\"} 1"), "{m}");
    b.stop().await;
    a.stop().await;
}

/// The drain Lease's API edge against the fake API server's Lease rules: 404 before it exists,
/// 201 on create and 409 on a second create, an update naming a stale resourceVersion refused
/// with 409, the current one accepted; an answer that is not a Lease, or one larger than the cap,
/// is an error (never a panic, never read whole); an unreachable server is `Unreachable`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_lease_api_follows_optimistic_concurrency_and_bounds_what_it_reads() {
    use kv_epp::discovery::{LeaseApi, LeaseError, LeaseSpec, client_for};
    let fake = FakeKube::start().await;
    let client = client_for(Some(&fake.kubeconfig(&tmp_dir("lease-api"))))
        .await
        .unwrap();
    let api = LeaseApi::new(client.clone(), NS, "drains", Duration::from_secs(5));
    let spec = |holder: &str, transitions: u64| LeaseSpec {
        holder: Some(holder.to_owned()),
        duration_seconds: 10,
        transitions,
        acquire_time: None,
        renew_time: kv_epp::discovery::micro_time_now(),
    };
    assert_eq!(api.get().await, Err(LeaseError::NotFound));
    assert_eq!(
        api.update(&spec("a", 0), "1").await,
        Err(LeaseError::NotFound)
    );
    let created = api.create(&spec("a", 0)).await.unwrap();
    assert_eq!(created.holder.as_deref(), Some("a"));
    assert_eq!(api.create(&spec("b", 0)).await, Err(LeaseError::Conflict));
    let read = api.get().await.unwrap();
    assert_eq!(read, created);
    // a renews; b, which read before that, cannot take over with what it read.
    let renewed = api
        .update(&spec("a", 0), &read.resource_version)
        .await
        .unwrap();
    assert_ne!(renewed.resource_version, read.resource_version);
    assert_eq!(
        api.update(&spec("b", 1), &read.resource_version).await,
        Err(LeaseError::Conflict)
    );
    let taken = api
        .update(&spec("b", 1), &renewed.resource_version)
        .await
        .unwrap();
    assert_eq!((taken.holder.as_deref(), taken.transitions), (Some("b"), 1));
    let stored = fake.get(Res::Leases, NS, "drains").unwrap();
    assert_eq!(stored["spec"]["holderIdentity"], "b");
    assert_eq!(fake.lease_writes(), (3, 2));
    fake.stop().await;
    assert!(matches!(api.get().await, Err(LeaseError::Unreachable(_))));

    // A hostile server: a Status where a Lease should be, then a body beyond the cap.
    let big = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let app = {
        let big = big.clone();
        axum::Router::new().fallback(move || {
            let big = big.load(std::sync::atomic::Ordering::SeqCst);
            async move {
                if big {
                    format!(
                        "{{\"kind\":\"Lease\",\"metadata\":{{\"resourceVersion\":\"1\",\"x\":\"{}\"}}}}",
                        "x".repeat(1 << 20)
                    )
                } else {
                    "{\"kind\":\"Status\",\"code\":200}".to_owned()
                }
            }
        })
    };
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(l, app).await });
    let kubeconfig = tmp_dir("lease-hostile").join("kubeconfig");
    std::fs::write(
        &kubeconfig,
        format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: c\n  cluster:\n    server: http://{addr}\nusers:\n- name: u\n  user: {{}}\ncontexts:\n- name: c\n  context: {{cluster: c, user: u}}\ncurrent-context: c\n"
        ),
    )
    .unwrap();
    let hostile = LeaseApi::new(
        client_for(Some(&kubeconfig)).await.unwrap(),
        NS,
        "drains",
        Duration::from_secs(5),
    );
    assert!(matches!(hostile.get().await, Err(LeaseError::Malformed(_))));
    big.store(true, std::sync::atomic::Ordering::SeqCst);
    assert!(matches!(hostile.get().await, Err(LeaseError::Malformed(_))));
}
