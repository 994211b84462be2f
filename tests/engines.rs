//! Every engine's events through the real `kv-epp serve` path: simulated SGLang workers (both salt
//! encodings) isolate tenants end to end (each tenant credited exactly what the worker holds for
//! it, continuations included, nobody else credited), an unknown parent fails closed, and
//! TensorRT-LLM's ZeroMQ publisher feeds a subscriber on every replica instead of a drain.

mod common;

use std::sync::atomic::Ordering;

use common::eventually_async;
use common::sim::{SimSpec, believed, send, sim_worker, truth};
use kv_epp::config::Config;
use kv_epp::server::Server;
use kv_epp_sim::events::{EventLayout, SimEngine};
use kv_epp_sim::prefix_cache::CacheRequest;
use kv_epp_sim::server::SimWorker;

const BS: usize = 16;

async fn sim(engine: SimEngine, layout: EventLayout, replay: bool) -> SimWorker {
    sim_worker(SimSpec {
        block_size: BS,
        replay,
        layout,
        engine,
        ..SimSpec::default()
    })
    .await
}

/// A kv-epp with one static worker, `w`, and `events` as its events section.
async fn kv_epp(w: &SimWorker, events: &str) -> Server {
    let replay = w
        .events
        .replay_endpoint
        .as_ref()
        .map(|r| format!(", replay_endpoint: '{r}'"))
        .unwrap_or_default();
    let yaml = format!(
        "server: {{bind_address: 127.0.0.1, grpc_port: 0, grpc_health_port: 0, metrics_port: 0, admin_port: 0}}\n\
         engine_metrics: {{interval_ms: 0}}\nevents: {events}\nmodels: [{{name: m, block_size: {BS}}}]\n\
         workers: [{{endpoint: '{}', model: m, events_endpoint: '{}'{replay}}}]\n",
        w.http_addr, w.events.events_endpoint
    );
    let c = Config::from_yaml(&yaml).unwrap();
    c.validate().unwrap();
    let s = Server::start(&c).await.unwrap();
    let connected = || async {
        s.feeds
            .statuses()
            .iter()
            .all(|(_, _, st)| st.connected.load(Ordering::Relaxed))
    };
    assert!(eventually_async(15, connected).await, "subscribed");
    s
}

/// What the worker holds for an unsalted prompt.
fn truth_unsalted(w: &SimWorker, tokens: &[u32]) -> u64 {
    w.engine.peek_cached_tokens(&CacheRequest {
        tokens,
        salt: None,
        lora_name: None,
    }) as u64
}

fn prompt(first: u32, blocks: usize) -> Vec<u32> {
    (first..first + (blocks * BS) as u32).collect()
}

async fn sglang_isolates_tenants(layout: EventLayout) {
    let w = sim(SimEngine::Sglang, layout, true).await;
    let s = kv_epp(&w, "{engine: sglang}").await;
    let shared = prompt(1_000, 3);
    let mut longer = shared.clone();
    longer.extend(prompt(5_000, 2));
    // The same tokens under two tenants and unsalted; then a's continuation (its stores name a
    // parent and, in SGLang's events, carry the salt again).
    send(&w, &shared, "tenant-a").await;
    send(&w, &shared, "tenant-b").await;
    common::sim::send_as(&w, &prompt(9_000, 2), None).await;
    send(&w, &longer, "tenant-a").await;
    let a = truth(&w, &longer, "tenant-a");
    assert_eq!(a, (5 * BS) as u64, "the worker holds a's whole prompt");
    let agreed = || async {
        believed(s.admin_addr, w.http_addr, &longer, Some("tenant-a")).await == a
            && believed(s.admin_addr, w.http_addr, &shared, Some("tenant-b")).await
                == truth(&w, &shared, "tenant-b")
            && believed(s.admin_addr, w.http_addr, &prompt(9_000, 2), None).await
                == truth_unsalted(&w, &prompt(9_000, 2))
    };
    assert!(
        eventually_async(20, agreed).await,
        "kv-epp agrees with the worker"
    );
    // Nobody else is credited with a tenant's blocks.
    for other in [Some("tenant-c"), None] {
        assert_eq!(
            believed(s.admin_addr, w.http_addr, &longer, other).await,
            0,
            "{other:?}"
        );
    }
    let st = &s.feeds.statuses()[0].2;
    assert_eq!(st.events.foreign_namespace.load(Ordering::Relaxed), 0);
    assert!(
        st.counts()
            .iter()
            .all(|(family, _, n)| *family != "dropped" || *n == 0)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sglang_array_encoding_isolates_tenants_end_to_end() {
    sglang_isolates_tenants(EventLayout::Array).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sglang_map_encoding_isolates_tenants_end_to_end() {
    sglang_isolates_tenants(EventLayout::Map).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sglang_continuation_of_an_unknown_parent_is_never_credited() {
    // No replay socket: what was stored before kv-epp subscribed is lost to it.
    let w = sim(SimEngine::Sglang, EventLayout::Map, false).await;
    let shared = prompt(1_000, 2);
    send(&w, &shared, "tenant-a").await;
    let s = kv_epp(&w, "{engine: sglang}").await;
    let index = s.picker.models.index("m").unwrap().clone();
    let mut longer = shared.clone();
    longer.extend(prompt(7_000, 2));
    // Published until kv-epp has seen the continuation (a PUB socket drops what it sends before
    // the subscription reaches it; each resend after that is a cache hit with nothing to store,
    // so a fresh tail is sent each time).
    let mut tail = 20_000;
    let seen = || index.worker_blocks(&s.feeds.statuses()[0].0).unwrap_or(0) >= 2;
    while !seen() {
        let mut p = longer.clone();
        p.extend(prompt(tail, 1));
        tail += 1_000;
        send(&w, &p, "tenant-a").await;
        assert!(tail < 200_000, "kv-epp never saw a continuation");
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    assert!(truth(&w, &longer, "tenant-a") > 0);
    for tenant in [Some("tenant-a"), Some("tenant-b"), None] {
        assert_eq!(
            believed(s.admin_addr, w.http_addr, &longer, tenant).await,
            0,
            "{tenant:?}: a parent kv-epp never saw leaves the namespace unknown"
        );
    }
    assert!(index.counters().unknown_namespace.load(Ordering::Relaxed) >= 2);
    assert_eq!(
        index.pairs(),
        0,
        "no block of an unknown namespace is creditable at all"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn trtllm_over_zeromq_is_subscribed_not_drained() {
    let w = sim(SimEngine::Trtllm, EventLayout::Map, true).await;
    let s = kv_epp(
        &w,
        "{engine: trtllm, trtllm: {transport: zmq}, salted_events: false}",
    )
    .await;
    // A ZeroMQ feed, like vLLM's: no TensorRT-LLM drain, so nothing for replicas to own.
    assert_eq!(s.feeds.statuses().len(), 1);
    let p = prompt(3_000, 3);
    common::sim::send_as(&w, &p, None).await;
    let want = truth_unsalted(&w, &p);
    assert_eq!(want, (3 * BS) as u64);
    let agreed = || async { believed(s.admin_addr, w.http_addr, &p, None).await == want };
    assert!(
        eventually_async(20, agreed).await,
        "signed hashes decoded and applied"
    );
    // TensorRT-LLM's publisher carries no salt: a salted request's blocks are indexed as the
    // engine publishes them, without a namespace (prefix routing without isolation: README's
    // backend table), and a salted query is never credited with them.
    send(&w, &prompt(4_000, 2), "tenant-a").await;
    let stored =
        || async { believed(s.admin_addr, w.http_addr, &prompt(4_000, 2), None).await > 0 };
    assert!(eventually_async(20, stored).await);
    assert_eq!(
        believed(
            s.admin_addr,
            w.http_addr,
            &prompt(4_000, 2),
            Some("tenant-a")
        )
        .await,
        0
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sglang_workers_are_asked_where_they_publish() {
    let w = sim(SimEngine::Sglang, EventLayout::Map, false).await;
    // The worker names no endpoint and the configured convention points at a closed port: the
    // feed follows what the worker's /server_info advertises.
    let yaml = format!(
        "server: {{bind_address: 127.0.0.1, grpc_port: 0, grpc_health_port: 0, metrics_port: 0, admin_port: 0}}\n\
         engine_metrics: {{interval_ms: 0}}\nevents: {{engine: sglang, zmq: {{port: {}, replay_port: 0}}}}\n\
         models: [{{name: m, block_size: {BS}}}]\nworkers: [{{endpoint: '{}', model: m}}]\n",
        common::free_port(),
        w.http_addr
    );
    let c = Config::from_yaml(&yaml).unwrap();
    c.validate().unwrap();
    let s = Server::start(&c).await.unwrap();
    let followed = || async {
        s.feeds.statuses().iter().any(|(_, ep, st)| {
            ep.events == w.events.events_endpoint && st.connected.load(Ordering::Relaxed)
        })
    };
    assert!(
        eventually_async(20, followed).await,
        "{:?}",
        s.feeds.statuses()
    );
    // No replay socket: resend with a fresh tail until a store arrives after the subscription.
    let base = prompt(1_000, 2);
    let mut tail = 10_000;
    let credited = || async {
        believed(s.admin_addr, w.http_addr, &base, Some("tenant-a")).await == (2 * BS) as u64
    };
    while !credited().await {
        let mut p = base.clone();
        p.extend(prompt(tail, 1));
        tail += 1_000;
        assert!(
            tail < 200_000,
            "no event reached kv-epp on the advertised endpoint"
        );
        w.engine.reset_prefix_cache();
        send(&w, &p, "tenant-a").await;
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_salt_kv_epp_forwards_is_accepted_by_sglang_and_comes_back_as_the_tenant() {
    use kv_epp::decide::{RequestParts, understand};
    let w = sim(SimEngine::Sglang, EventLayout::Array, true).await;
    let s = kv_epp(&w, "{engine: sglang}").await;
    // Tenants whose raw ids vLLM would refuse, and one too long to forward verbatim.
    let long = "t".repeat(300);
    for (i, tenant) in ["org/team@x", "plain", long.as_str()]
        .into_iter()
        .enumerate()
    {
        let tokens = prompt(1_000 * (i as u32 + 1), 2);
        let body = serde_json::json!({"model": "m", "prompt": tokens, "max_tokens": 1});
        let body = body.to_string();
        let header = [tenant.as_bytes()];
        let parts = RequestParts {
            path: "/v1/completions",
            tenant: &header,
            body: Some(body.as_bytes()),
            subset: None,
            conformance: None,
        };
        // The body the engine receives, exactly as ext_proc would forward it.
        let forwarded = understand(&s.picker, &parts)
            .unwrap()
            .rewritten_body
            .expect("the salt is forwarded");
        let r = common::post_json(w.http_addr, "/v1/completions", &[], &forwarded)
            .await
            .unwrap();
        assert_eq!(r.status, 200, "SGLang's rule accepts it: {}", r.text());
        let want = truth(&w, &tokens, tenant);
        assert_eq!(want, (2 * BS) as u64);
        let agreed =
            || async { believed(s.admin_addr, w.http_addr, &tokens, Some(tenant)).await == want };
        assert!(eventually_async(20, agreed).await, "{i}");
        assert_eq!(believed(s.admin_addr, w.http_addr, &tokens, None).await, 0);
    }
}
