//! Flow control seen from outside, through a real gRPC ext_proc client against an in-process
//! kv-epp whose one worker takes one request at a time: a saturated request waits (BUFFERED:
//! Envoy's message timer restarted) and goes when a booking frees; a client that leaves the
//! queue leaves it at once with nothing leaked; the queue is fair between tenants; timeouts,
//! queue limits and quotas answer 429 with a reason and Retry-After; `/debug/queues` and the
//! metrics show tenants by fingerprint only. The same through a real Envoy is in `envoy_e2e.rs`.

mod common;

use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_client::ExternalProcessorClient;
use envoy_types::pb::envoy::service::ext_proc::v3::processing_response::Response;
use envoy_types::pb::envoy::service::ext_proc::v3::{ProcessingRequest, ProcessingResponse};
use kv_epp::server::Server;
use serde_json::json;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::Streaming;
use tonic::transport::Channel;

use common::extproc::{plain_channel, request_body, request_headers};
use common::{eventually, http, kv_epp_config, metric};

/// What kv-epp answered a request.
#[derive(Debug, PartialEq)]
enum Answer {
    /// Routed to this endpoint.
    Pick(String),
    /// Envoy's message timer restarted with this many seconds.
    Override(i64),
    /// A local reply: status, dropped reason, Retry-After.
    Refused(u32, String, Option<String>),
}

/// An open ext_proc stream (BUFFERED request body), kept open until dropped.
struct Open {
    _tx: mpsc::Sender<ProcessingRequest>,
    rx: Streaming<ProcessingResponse>,
}

impl Open {
    async fn start(channel: &Channel, tenant: &str, tokens: usize) -> Open {
        let (tx, rx) = mpsc::channel(4);
        let body = json!({"model": "m", "prompt": (0..tokens as u32).collect::<Vec<_>>(), "max_tokens": 1});
        tx.send(request_headers(
            "/v1/completions",
            2,
            0,
            &[("x-tenant-id", tenant)],
        ))
        .await
        .unwrap();
        tx.send(request_body(body.to_string().into_bytes(), true))
            .await
            .unwrap();
        let rx = ExternalProcessorClient::new(channel.clone())
            .process(ReceiverStream::new(rx))
            .await
            .unwrap()
            .into_inner();
        Open { _tx: tx, rx }
    }

    /// As `start`, then the client ends its side (a half-close) and only reads.
    async fn start_then_half_close(channel: &Channel, tenant: &str, tokens: usize) -> Open {
        let mut open = Open::start(channel, tenant, tokens).await;
        let (tx, _) = mpsc::channel(1);
        drop(std::mem::replace(&mut open._tx, tx));
        open
    }

    /// The next answer, skipping the header response BUFFERED mode gets at once.
    async fn next(&mut self) -> Answer {
        loop {
            // Generous: a broken queue fails the test instead of hanging it.
            let resp = tokio::time::timeout(std::time::Duration::from_secs(60), self.rx.message())
                .await
                .expect("an answer within 60 s")
                .unwrap()
                .expect("an answer");
            if let Some(d) = resp.override_message_timeout {
                return Answer::Override(d.seconds);
            }
            match resp.response {
                Some(Response::RequestBody(b)) => {
                    let hm = b.response.unwrap().header_mutation.unwrap();
                    for h in hm.set_headers {
                        let hv = h.header.unwrap();
                        if hv.key == "x-gateway-destination-endpoint" {
                            return Answer::Pick(String::from_utf8(hv.raw_value).unwrap());
                        }
                    }
                    panic!("a body response without a pick");
                }
                Some(Response::ImmediateResponse(i)) => {
                    let mut reason = String::new();
                    let mut retry = None;
                    for h in i.headers.unwrap().set_headers {
                        let hv = h.header.unwrap();
                        let v = String::from_utf8(hv.raw_value).unwrap();
                        match hv.key.as_str() {
                            "x-llm-d-request-dropped-reason" => reason = v,
                            "retry-after" => retry = Some(v),
                            _ => {}
                        }
                    }
                    return Answer::Refused(i.status.unwrap().code as u32, reason, retry);
                }
                _ => continue,
            }
        }
    }
}

const WORKER: &str = "127.0.0.1:18001";

async fn start(flow: &str) -> (Server, Channel) {
    start_with(&[WORKER], flow).await
}

async fn start_with(workers: &[&str], flow: &str) -> (Server, Channel) {
    let workers: Vec<std::net::SocketAddr> = workers.iter().map(|w| w.parse().unwrap()).collect();
    let config = kv_epp_config(
        &workers,
        &format!("routing: {{max_inflight_per_worker: 1, retry_after_seconds: 2}}\n{flow}"),
    );
    let server = Server::start(&config).await.unwrap();
    let channel = plain_channel(server.grpc_addr).await;
    (server, channel)
}

async fn metrics(server: &Server) -> String {
    common::metrics_text(server.metrics_addr).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_saturated_request_waits_and_a_client_that_leaves_is_out_at_once() {
    let (server, ch) = start("").await;
    let mut a = Open::start(&ch, "tenant-a", 8).await;
    assert_eq!(a.next().await, Answer::Pick(WORKER.into()));
    // The worker is full: the next request waits, and Envoy's message timer is restarted for
    // the whole queue timeout (30 s) plus a second.
    let mut b = Open::start(&ch, "tenant-b", 8).await;
    assert_eq!(b.next().await, Answer::Override(31));
    assert!(eventually(10, || server.flow.queued() == 1).await);
    drop(a);
    assert_eq!(b.next().await, Answer::Pick(WORKER.into()));
    assert_eq!(server.picker.workers.total_inflight(), 1);
    // A queued client that goes away leaves the queue at once; nothing stays booked.
    let mut c = Open::start(&ch, "tenant-c", 8).await;
    assert_eq!(c.next().await, Answer::Override(31));
    assert!(eventually(10, || server.flow.queued() == 1).await);
    drop(c);
    assert!(eventually(10, || server.flow.queued() == 0).await);
    drop(b);
    assert!(eventually(10, || server.picker.workers.total_inflight() == 0).await);
    let m = metrics(&server).await;
    assert_eq!(
        metric(
            &m,
            "kv_epp_stream_errors_total{kind=\"reset_while_queued\"}"
        ),
        1.0
    );
    assert_eq!(metric(&m, "kv_epp_flow_queued_bytes"), 0.0);
    assert!(m.contains("kv_epp_flow_wait_seconds"), "{m}");
    assert!(
        !m.contains("tenant-a") && !m.contains("tenant-b"),
        "no raw ids"
    );
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn queued_tenants_are_served_fairly_not_first_come() {
    let (server, ch) = start("").await;
    let mut holder = Open::start(&ch, "flood", 8).await;
    assert_eq!(holder.next().await, Answer::Pick(WORKER.into()));
    // Each queued stream reports when it is routed, then waits to be released.
    let (served_tx, mut served) =
        mpsc::unbounded_channel::<(String, tokio::sync::oneshot::Sender<()>)>();
    let mut queued = 0;
    let mut enqueue = |tenant: &'static str| {
        let ch = ch.clone();
        let served_tx = served_tx.clone();
        queued += 1;
        let n = queued;
        let server = &server;
        async move {
            let mut s = Open::start(&ch, tenant, 8).await;
            assert_eq!(s.next().await, Answer::Override(31));
            assert!(eventually(10, || server.flow.queued() == n).await);
            tokio::spawn(async move {
                assert_eq!(s.next().await, Answer::Pick(WORKER.into()));
                let (done, release) = tokio::sync::oneshot::channel();
                served_tx.send((tenant.to_owned(), done)).unwrap();
                let _ = release.await;
                drop(s);
            });
        }
    };
    for _ in 0..6 {
        enqueue("flood").await;
    }
    enqueue("calm").await;
    drop(holder);
    let mut order = Vec::new();
    for _ in 0..7 {
        let (tenant, release) = served.recv().await.unwrap();
        order.push(tenant);
        let _ = release.send(());
    }
    let calm = order.iter().position(|t| t == "calm").unwrap();
    assert!(
        calm <= 1,
        "the calm tenant's one request goes first or second, not after the flood's six: {order:?}"
    );
    assert!(eventually(10, || server.picker.workers.total_inflight() == 0).await);
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn timeouts_limits_and_quotas_answer_429_with_a_reason() {
    let (server, ch) = start(
        "flow_control: {queue_timeout_ms: 400, max_queued_requests_per_tenant: 1, tenants: [{id: capped, max_inflight: 1}, {id: metered, tokens_per_second: 10}]}",
    )
    .await;
    let mut holder = Open::start(&ch, "capped", 8).await;
    assert_eq!(holder.next().await, Answer::Pick(WORKER.into()));
    // The tenant's in-flight quota.
    let mut over = Open::start(&ch, "capped", 8).await;
    assert_eq!(
        over.next().await,
        Answer::Refused(
            429,
            "rejected-tenant-inflight-limit".into(),
            Some("2".into())
        )
    );
    // The per-tenant queue limit, then the queue timeout.
    let mut waiting = Open::start(&ch, "someone", 8).await;
    assert_eq!(waiting.next().await, Answer::Override(1));
    let mut full = Open::start(&ch, "someone", 8).await;
    assert_eq!(
        full.next().await,
        Answer::Refused(429, "rejected-queue-full".into(), Some("2".into()))
    );
    assert_eq!(
        waiting.next().await,
        Answer::Refused(429, "rejected-queue-timeout".into(), Some("2".into()))
    );
    assert_eq!(server.flow.queued(), 0);
    drop(holder);
    assert!(eventually(10, || server.picker.workers.total_inflight() == 0).await);
    // The token rate: 10 tokens/s; a 30-token request from a full bucket goes, the next waits
    // for the bucket (Retry-After says how long).
    let mut first = Open::start(&ch, "metered", 29).await;
    assert_eq!(first.next().await, Answer::Pick(WORKER.into()));
    drop(first);
    let mut second = Open::start(&ch, "metered", 29).await;
    match second.next().await {
        Answer::Refused(429, reason, Some(retry)) => {
            assert_eq!(reason, "rejected-tenant-rate-limit");
            assert!(retry.parse::<u32>().unwrap() >= 2, "{retry}");
        }
        other => panic!("{other:?}"),
    }
    let m = metrics(&server).await;
    for reason in [
        "rejected_tenant_inflight",
        "rejected_queue_full",
        "rejected_queue_timeout",
        "rejected_tenant_rate",
    ] {
        assert!(
            m.contains(&format!("reason=\"{reason}\"")),
            "{reason} counted per tenant: {m}"
        );
    }
    assert!(
        !m.contains("capped") && !m.contains("metered"),
        "no raw ids"
    );
    server.stop().await;
}

/// A queued client that ends its side of the stream once it has sent everything (a half-close;
/// tonic clients streaming a fixed list do) is still waiting for its answer: it stays queued
/// and gets its pick when capacity frees, and nothing is counted as a reset.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_queued_client_that_half_closes_still_gets_its_answer() {
    let (server, ch) = start("").await;
    let mut holder = Open::start(&ch, "tenant-a", 8).await;
    assert_eq!(holder.next().await, Answer::Pick(WORKER.into()));
    let mut waiting = Open::start_then_half_close(&ch, "tenant-b", 8).await;
    assert_eq!(waiting.next().await, Answer::Override(31));
    assert!(eventually(10, || server.flow.queued() == 1).await);
    drop(holder);
    assert_eq!(waiting.next().await, Answer::Pick(WORKER.into()));
    let m = metrics(&server).await;
    assert!(!m.contains("reset_while_queued"), "{m}");
    drop(waiting);
    server.stop().await;
}

/// A request that is not served costs its tenant no token-rate quota: one that times out in the
/// queue, or whose client leaves while it waits, gets its units back, so a tenant retrying
/// through saturation is not refused for its rate once capacity returns. The bucket holds 100
/// units and refills at 1 a second; each request costs about 30: three unserved ones would
/// leave too little for a fourth.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_that_is_not_served_costs_no_rate_quota() {
    let (server, ch) = start(
        "flow_control: {queue_timeout_ms: 400, tenants: [{id: metered, tokens_per_second: 1, burst_tokens: 100}]}",
    )
    .await;
    let mut holder = Open::start(&ch, "other", 8).await;
    assert_eq!(holder.next().await, Answer::Pick(WORKER.into()));
    for leave in [false, true, false] {
        let mut waiting = Open::start(&ch, "metered", 29).await;
        assert_eq!(waiting.next().await, Answer::Override(1));
        if leave {
            assert!(eventually(10, || server.flow.queued() == 1).await);
            drop(waiting);
            assert!(eventually(10, || server.flow.queued() == 0).await);
        } else {
            assert_eq!(
                waiting.next().await,
                Answer::Refused(429, "rejected-queue-timeout".into(), Some("2".into()))
            );
        }
    }
    drop(holder);
    assert!(eventually(10, || server.picker.workers.total_inflight() == 0).await);
    let mut served = Open::start(&ch, "metered", 29).await;
    assert_eq!(served.next().await, Answer::Pick(WORKER.into()));
    drop(served);
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn debug_queues_shows_queued_tenants_by_fingerprint() {
    let (server, ch) = start(
        "salt: {fingerprint_key: k}\nflow_control: {tenants: [{id: gold-tenant, band: interactive, weight: 4}]}",
    )
    .await;
    let mut holder = Open::start(&ch, "gold-tenant", 8).await;
    assert_eq!(holder.next().await, Answer::Pick(WORKER.into()));
    let mut q = Open::start(&ch, "gold-tenant", 8).await;
    assert_eq!(q.next().await, Answer::Override(31));
    assert!(eventually(10, || server.flow.queued() == 1).await);
    let r = http(server.admin_addr, "GET", "/debug/queues", &[], b"")
        .await
        .unwrap();
    assert_eq!(r.status, 200);
    let text = r.text();
    assert!(!text.contains("gold-tenant"), "{text}");
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    assert_eq!(v["queued"], 1);
    let t = &v["tenants"][0];
    assert_eq!(t["band"], "interactive");
    assert_eq!(t["weight"], 4.0);
    assert_eq!(t["queued"], 1);
    assert_eq!(t["inflight"], 1);
    assert_eq!(
        t["tenant"].as_str().unwrap().len(),
        12,
        "a fingerprint: {t}"
    );
    drop(q);
    drop(holder);
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_queued_request_waits_for_its_cached_worker_while_others_take_the_free_one() {
    use kv_epp_core::hashing::HashSeed;
    use kv_epp_core::index::{EngineBlockHash, Medium, StoreBlocks};
    use kv_epp_core::worker::WorkerId;

    const OTHER: &str = "127.0.0.1:18002";
    // Waiting is worth 1 s per block saved here, so the 16-block prefix is worth waiting for.
    let (server, ch) = start_with(
        &[WORKER, OTHER],
        "flow_control: {affinity_wait_ms_per_block: 1000, max_affinity_wait_ms: 20000}",
    )
    .await;
    let mut h1 = Open::start(&ch, "h1", 8).await;
    let Answer::Pick(cached) = h1.next().await else {
        panic!("routed")
    };
    let mut h2 = Open::start(&ch, "h2", 8).await;
    let Answer::Pick(free) = h2.next().await else {
        panic!("routed")
    };
    assert_ne!(cached, free);
    // The first holder's worker holds the 64-token prompt of tenant `r` (16 blocks of 4).
    let tokens: Vec<u32> = (0..64).collect();
    let hashes: Vec<EngineBlockHash> = (0..16).map(|i| EngineBlockHash(500 + i)).collect();
    server
        .picker
        .models
        .index("m")
        .unwrap()
        .store(
            &WorkerId::new(cached.parse().unwrap()),
            &StoreBlocks {
                parent: None,
                root_seed: Some(HashSeed::new(None, Some("r"))),
                engine_hashes: &hashes,
                tokens: &tokens,
                medium: Medium::Device,
            },
        )
        .unwrap();
    let mut r = Open::start(&ch, "r", 64).await;
    assert_eq!(r.next().await, Answer::Override(31));
    assert!(eventually(10, || server.flow.queued() == 1).await);
    // The uncached worker frees first: `r` keeps waiting for its prefix, and the free worker
    // goes to the next request in the queue instead.
    drop(h2);
    let mut s = Open::start(&ch, "s", 8).await;
    let first = s.next().await;
    let first = if first == Answer::Override(31) {
        // Queued too: it must be routed as soon as the queue is offered the free worker.
        tokio::time::timeout(std::time::Duration::from_secs(20), s.next())
            .await
            .expect("the free worker went to `s`, not to `r`")
    } else {
        first
    };
    assert_eq!(first, Answer::Pick(free.clone()));
    assert_eq!(server.flow.queued(), 1, "r still waits");
    drop(h1);
    assert_eq!(r.next().await, Answer::Pick(cached));
    drop((r, s));
    assert!(eventually(10, || server.picker.workers.total_inflight() == 0).await);
    server.stop().await;
}
