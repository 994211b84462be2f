//! Event ingestion over real ZeroMQ sockets on loopback: a fake engine publishes vLLM-format
//! batches (PUB, 3 frames, big-endian sequence, msgpack) and serves replays (ROUTER) in vLLM
//! 0.33's form (`[b"", topic, seq, payload]`, end marker `[b"", b"", u64::MAX, b""]`) or, in one
//! case, the older three-frame form; kv-epp's subscriber feeds the index; the admin `/query` API
//! shows what kv-epp believes.

mod common;

use std::net::SocketAddr;
use std::time::Duration;

use bytes::Bytes;
use common::{eventually, free_port, http, metric, post_json, wait_worker_blocks};
use kv_epp::config::Config;
use kv_epp::server::Server;
use kv_epp_core::namespace::Namespace;
use kv_epp_core::salt::{CacheSalt, SaltSource};
use rmpv::Value;
use zeromq::{PubSocket, RouterSocket, Socket, SocketRecv, SocketSend, ZmqMessage};

/// Every batch published so far, by sequence (the replay buffer).
type Sent = std::sync::Arc<std::sync::Mutex<Vec<(u64, Vec<u8>)>>>;

/// How the fake engine's ROUTER frames a replay answer (after the requester's identity).
#[derive(Clone, Copy)]
enum ReplayForm {
    /// vLLM 0.33: `[b"", topic, seq, payload]`, end marker `[b"", b"", u64::MAX, b""]`.
    Vllm033,
    /// Older engines: `[b"", seq, payload]`, end marker `[b"", u64::MAX, b""]`.
    ThreeFrame,
}

/// A fake engine: numbered batches published on PUB, all kept for replay on ROUTER.
struct FakeEngine {
    publisher: PubSocket,
    sent: Sent,
    /// Replay requests served so far.
    replays: std::sync::Arc<std::sync::atomic::AtomicUsize>,
    next: u64,
    map_layout: bool,
    bytes_hashes: bool,
}

/// A msgpack batch `[ts, events, (dp_rank)]`, with the legacy two-element form when `rank` is
/// absent.
fn encode_batch(events: Vec<Value>, rank: Option<Value>) -> Vec<u8> {
    let mut batch = vec![Value::F64(0.0), Value::Array(events)];
    batch.extend(rank);
    let mut p = Vec::new();
    rmpv::encode::write_value(&mut p, &Value::Array(batch)).unwrap();
    p
}

fn s(x: &str) -> Value {
    Value::from(x)
}

impl FakeEngine {
    async fn start(
        pub_port: u16,
        replay_port: Option<u16>,
        form: ReplayForm,
        map_layout: bool,
        bytes_hashes: bool,
    ) -> FakeEngine {
        let mut publisher = PubSocket::new();
        publisher
            .bind(&format!("tcp://127.0.0.1:{pub_port}"))
            .await
            .unwrap();
        let sent: Sent = Default::default();
        let replays = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
        if let Some(port) = replay_port {
            let mut router = RouterSocket::new();
            router
                .bind(&format!("tcp://127.0.0.1:{port}"))
                .await
                .unwrap();
            let sent = sent.clone();
            let replays = replays.clone();
            tokio::spawn(async move {
                while let Ok(msg) = router.recv().await {
                    let frames = msg.into_vec();
                    let identity = frames[0].clone();
                    let start =
                        u64::from_be_bytes(frames.last().unwrap().as_ref().try_into().unwrap());
                    let batches: Vec<(u64, Vec<u8>)> = sent
                        .lock()
                        .unwrap()
                        .iter()
                        .filter(|(q, _)| *q >= start)
                        .cloned()
                        .collect();
                    for (seq, payload) in batches.into_iter().chain([(u64::MAX, Vec::new())]) {
                        let mut m = ZmqMessage::from(identity.clone());
                        m.push_back(Bytes::new());
                        if let ReplayForm::Vllm033 = form {
                            // The publisher's topic ("" here); vLLM's end marker has "" too.
                            m.push_back(Bytes::new());
                        }
                        m.push_back(Bytes::copy_from_slice(&seq.to_be_bytes()));
                        m.push_back(Bytes::from(payload));
                        if router.send(m).await.is_err() {
                            break;
                        }
                    }
                    replays.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                }
            });
        }
        FakeEngine {
            publisher,
            sent,
            replays,
            next: 0,
            map_layout,
            bytes_hashes,
        }
    }

    fn hash(&self, h: u64) -> Value {
        if self.bytes_hashes {
            let mut b = vec![0u8; 32];
            b[24..].copy_from_slice(&h.to_be_bytes());
            Value::Binary(b)
        } else {
            Value::from(h)
        }
    }

    fn stored(
        &self,
        hashes: &[u64],
        parent: Option<u64>,
        tokens: &[u32],
        salt: Option<&str>,
    ) -> Value {
        let hashes = Value::Array(hashes.iter().map(|h| self.hash(*h)).collect());
        let parent = parent.map_or(Value::Nil, |p| self.hash(p));
        let tokens = Value::Array(tokens.iter().map(|t| Value::from(*t)).collect());
        let n = tokens.as_array().unwrap().len() / 4;
        let extra = Value::Array(
            (0..n)
                .map(|i| match (i, salt) {
                    (0, Some(s)) => Value::Array(vec![Value::from(s)]),
                    _ => Value::Nil,
                })
                .collect(),
        );
        if self.map_layout {
            Value::Map(vec![
                (s("type"), s("BlockStored")),
                (s("block_hashes"), hashes),
                (s("parent_block_hash"), parent),
                (s("token_ids"), tokens),
                (s("block_size"), Value::from(4)),
                (s("medium"), s("GPU")),
                (s("extra_keys"), extra),
            ])
        } else {
            Value::Array(vec![
                s("BlockStored"),
                hashes,
                parent,
                tokens,
                Value::from(4),
                Value::Nil,
                s("GPU"),
                Value::Nil,
                extra,
                Value::from(0),
            ])
        }
    }

    fn removed(&self, hashes: &[u64]) -> Value {
        let hashes = Value::Array(hashes.iter().map(|h| self.hash(*h)).collect());
        if self.map_layout {
            Value::Map(vec![
                (s("type"), s("BlockRemoved")),
                (s("block_hashes"), hashes),
                (s("medium"), s("GPU")),
            ])
        } else {
            Value::Array(vec![s("BlockRemoved"), hashes, s("GPU")])
        }
    }

    /// Publishes a batch (or only records it for replay when `drop`).
    async fn publish(&mut self, events: Vec<Value>, drop: bool) {
        self.publish_raw(encode_batch(events, Some(Value::Nil)), drop)
            .await;
    }

    async fn publish_raw(&mut self, payload: Vec<u8>, drop: bool) {
        let seq = self.next;
        self.next += 1;
        self.sent.lock().unwrap().push((seq, payload.clone()));
        if !drop {
            let mut m = ZmqMessage::from(Bytes::new());
            m.push_back(Bytes::copy_from_slice(&seq.to_be_bytes()));
            m.push_back(Bytes::from(payload));
            self.publisher.send(m).await.unwrap();
        }
    }

    fn restart(&mut self) {
        self.next = 0;
        self.sent.lock().unwrap().clear();
    }
}

async fn kv_epp(worker: SocketAddr, pub_port: u16, replay_port: Option<u16>) -> Server {
    let replay = replay_port.map_or(String::new(), |p| {
        format!(", replay_endpoint: 'tcp://127.0.0.1:{p}'")
    });
    let yaml = format!(
        "server: {{bind_address: 127.0.0.1, grpc_port: 0, grpc_health_port: 0, metrics_port: 0, admin_port: 0}}\n\
         models: [{{name: m, block_size: 4}}]\n\
         workers: [{{endpoint: '{worker}', model: m, events_endpoint: 'tcp://127.0.0.1:{pub_port}'{replay}}}]"
    );
    let c = Config::from_yaml(&yaml).unwrap();
    c.validate().unwrap();
    Server::start(&c).await.unwrap()
}

/// Overlap in tokens that `/query` reports for the worker.
async fn overlap(server: &Server, tokens: &[u32], salt: Option<&str>) -> u64 {
    let mut body = serde_json::json!({"model": "m", "token_ids": tokens});
    if let Some(s) = salt {
        body["cache_salt"] = serde_json::json!(s);
    }
    best_overlap(server, "/query", &body).await
}

/// The best overlap in tokens an admin query (`/query` or `/query_by_hash`) answers.
async fn best_overlap(server: &Server, path: &str, body: &serde_json::Value) -> u64 {
    let r = post_json(server.admin_addr, path, &[], body.to_string().as_bytes())
        .await
        .unwrap();
    assert_eq!(r.status, 200, "{}", r.text());
    let v: serde_json::Value = serde_json::from_slice(&r.body).unwrap();
    v["instances"]
        .as_array()
        .unwrap()
        .iter()
        .map(|i| i["overlap_tokens"].as_u64().unwrap())
        .max()
        .unwrap_or(0)
}

fn fwd(salt: &str) -> String {
    Namespace::of(&CacheSalt::new(salt, SaltSource::Body).unwrap().unwrap()).forwarded()
}

async fn wait_subscribed(server: &Server) {
    assert!(
        eventually(15, || server.feeds.statuses().iter().all(|(_, _, st)| st
            .connected
            .load(std::sync::atomic::Ordering::Relaxed)))
        .await
    );
    // A PUB socket drops messages until the subscription has propagated.
    tokio::time::sleep(Duration::from_millis(300)).await;
}

/// A fake engine on free ports (with a replay socket when `replay`) and a kv-epp with one
/// worker, `worker`, subscribed to it.
async fn subscribed(
    worker: &str,
    replay: Option<ReplayForm>,
    map_layout: bool,
    bytes_hashes: bool,
) -> (FakeEngine, Server, SocketAddr) {
    let pub_port = free_port();
    let replay_port = replay.map(|_| free_port());
    let form = replay.unwrap_or(ReplayForm::Vllm033);
    let engine = FakeEngine::start(pub_port, replay_port, form, map_layout, bytes_hashes).await;
    let worker: SocketAddr = worker.parse().unwrap();
    let server = kv_epp(worker, pub_port, replay_port).await;
    wait_subscribed(&server).await;
    (engine, server, worker)
}

async fn end_to_end(form: ReplayForm, map_layout: bool, bytes_hashes: bool) {
    let (mut engine, server, worker) =
        subscribed("127.0.0.1:18001", Some(form), map_layout, bytes_hashes).await;
    let t: Vec<u32> = (0..16).collect();
    let a = fwd("tenant-a");
    // Seq 0: tenant-a stores 2 blocks; seq 1: a continuation (no salt) of 2 more.
    engine
        .publish(
            vec![engine.stored(&[11, 12], None, &t[..8], Some(&a))],
            false,
        )
        .await;
    engine
        .publish(
            vec![engine.stored(&[13, 14], Some(12), &t[8..16], None)],
            false,
        )
        .await;
    assert!(
        wait_worker_blocks(&server, worker, 4).await,
        "events applied"
    );
    assert_eq!(
        overlap(&server, &t, Some("tenant-a")).await,
        16,
        "continuation inherits tenant-a"
    );
    assert_eq!(
        overlap(&server, &t, Some("tenant-b")).await,
        0,
        "other tenant gets nothing"
    );
    assert_eq!(overlap(&server, &t, None).await, 0, "unsalted gets nothing");
    // /explain shows the tenant's credit and, beside it, the worker's event feed: what an operator
    // checks first when a prefix does not hit.
    let body = serde_json::json!({
        "path": "/v1/completions",
        "headers": {"x-tenant-id": "tenant-a"},
        "body": {"model": "m", "prompt": t},
    });
    let r = post_json(
        server.admin_addr,
        "/explain",
        &[],
        body.to_string().as_bytes(),
    )
    .await
    .unwrap();
    let v: serde_json::Value = serde_json::from_slice(&r.body).unwrap();
    let c = &v["candidates"][0];
    assert_eq!(c["overlap"]["total_tokens"], 16, "{v}");
    assert_eq!(c["events"]["connected"], true, "{v}");
    assert_eq!(c["events"]["cold"], false, "{v}");
    assert_eq!(c["events"]["last_sequence"], 1, "{v}");
    // Seq 2 is lost (dropped at the publisher) and seq 3 reveals the gap: replay fills it.
    engine.publish(vec![engine.removed(&[14])], true).await;
    engine
        .publish(vec![engine.stored(&[21], None, &[7, 7, 7, 7], None)], false)
        .await;
    let mut seen = false;
    for _ in 0..100 {
        if overlap(&server, &[7, 7, 7, 7], None).await == 4 {
            seen = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(seen, "the batch after the gap applied");
    assert_eq!(
        overlap(&server, &t, Some("tenant-a")).await,
        12,
        "the replayed removal applied"
    );
    assert_eq!(overlap(&server, &[7, 7, 7, 7], None).await, 4);
    // Engine restart: the sequence goes back to 0, the old state must not be credited.
    engine.restart();
    engine
        .publish(vec![engine.stored(&[31], None, &[9, 9, 9, 9], None)], false)
        .await;
    assert!(wait_worker_blocks(&server, worker, 1).await);
    assert_eq!(
        overlap(&server, &t, Some("tenant-a")).await,
        0,
        "no stale credit after restart"
    );
    assert_eq!(overlap(&server, &[9, 9, 9, 9], None).await, 4);
    let st = &server.feeds.statuses()[0].2;
    use std::sync::atomic::Ordering::Relaxed;
    assert_eq!(
        (
            st.gaps.load(Relaxed),
            st.replayed.load(Relaxed),
            st.restarts.load(Relaxed)
        ),
        (1, 1, 1)
    );
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn array_layout_int_hashes() {
    end_to_end(ReplayForm::Vllm033, false, false).await;
}

/// Also proves the older three-frame replay answers are still accepted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn map_layout_byte_hashes_with_three_frame_replay() {
    end_to_end(ReplayForm::ThreeFrame, true, true).await;
}

/// kv-epp started against a running engine that publishes nothing more: the join replay at
/// connect recovers the buffered history, and the next live batch is applied once, in order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn joining_an_idle_engine_recovers_its_buffered_history() {
    let pub_port = free_port();
    let replay_port = free_port();
    let mut engine = FakeEngine::start(
        pub_port,
        Some(replay_port),
        ReplayForm::Vllm033,
        true,
        false,
    )
    .await;
    let t: Vec<u32> = (100..116).collect();
    let a = fwd("tenant-a");
    // Published before kv-epp exists: nobody receives them; only the replay buffer has them.
    engine
        .publish(vec![engine.stored(&[1, 2], None, &t[..8], Some(&a))], false)
        .await;
    engine
        .publish(vec![engine.stored(&[3, 4], Some(2), &t[8..], None)], false)
        .await;
    let worker: SocketAddr = "127.0.0.1:18005".parse().unwrap();
    let server = kv_epp(worker, pub_port, Some(replay_port)).await;
    assert!(
        wait_worker_blocks(&server, worker, 4).await,
        "the idle engine's history is recovered without a new publish"
    );
    assert_eq!(overlap(&server, &t, Some("tenant-a")).await, 16);
    assert_eq!(overlap(&server, &t, Some("tenant-b")).await, 0);
    wait_subscribed(&server).await;
    engine
        .publish(vec![engine.stored(&[9], None, &[9, 9, 9, 9], None)], false)
        .await;
    assert!(wait_worker_blocks(&server, worker, 5).await);
    let st = &server.feeds.statuses()[0].2;
    use std::sync::atomic::Ordering::Relaxed;
    assert_eq!(
        (
            st.batches.load(Relaxed),
            st.gaps.load(Relaxed),
            st.restarts.load(Relaxed),
            st.unfillable.load(Relaxed)
        ),
        (3, 0, 0, 0),
        "each batch applied once, no gap or restart seen"
    );
    assert_eq!(overlap(&server, &t, Some("tenant-a")).await, 16);
    server.stop().await;
}

/// A feed cut off from an engine that then goes idle: the batches published meanwhile (which
/// the PUB drops for a subscriber that is away) are caught up by replay as soon as the feed
/// reconnects, without waiting for a new publish to reveal the gap.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reconnect_to_an_idle_engine_catches_up_on_what_it_missed() {
    cut_publish_twice_restore("127.0.0.1:18006", false).await;
}

/// A PUB drops what it publishes before a new subscriber's subscription has taken effect, and the
/// join replay may already have been served by then: an idle engine would never reveal that
/// batch. Simulated by a batch the engine buffers for replay but never sends live, published
/// after kv-epp's join replay: kv-epp's re-check of the join (while the connection is silent)
/// finds it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_dropped_before_the_subscription_took_effect_is_found_by_replay() {
    use std::sync::atomic::Ordering::Relaxed;
    let pub_port = free_port();
    let replay_port = free_port();
    let mut engine = FakeEngine::start(
        pub_port,
        Some(replay_port),
        ReplayForm::Vllm033,
        true,
        false,
    )
    .await;
    let worker: SocketAddr = "127.0.0.1:18008".parse().unwrap();
    let server = kv_epp(worker, pub_port, Some(replay_port)).await;
    let replays = engine.replays.clone();
    assert!(
        eventually(15, || replays.load(Relaxed) >= 1).await,
        "kv-epp joins by replay"
    );
    let t: Vec<u32> = (400..408).collect();
    engine
        .publish(vec![engine.stored(&[41, 42], None, &t, None)], true)
        .await;
    assert!(
        wait_worker_blocks(&server, worker, 2).await,
        "the dropped batch is found without another publish"
    );
}

/// As `a_reconnect_to_an_idle_engine_catches_up_on_what_it_missed`, but the engine no longer buffers the first missed batch: the worker's state is
/// dropped (the gap counted as unfillable) and rebuilt from what the engine still buffers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reconnect_past_the_engine_buffer_drops_state_and_rejoins() {
    cut_publish_twice_restore("127.0.0.1:18007", true).await;
}

/// One stored batch received live, then kv-epp's PUB link is cut, two batches are published
/// (with `evict`, the first is then forgotten by the replay buffer), the link is restored and
/// the engine publishes nothing more.
async fn cut_publish_twice_restore(worker: &str, evict: bool) {
    use std::sync::atomic::Ordering::Relaxed;
    let pub_port = free_port();
    let replay_port = free_port();
    let mut engine = FakeEngine::start(
        pub_port,
        Some(replay_port),
        ReplayForm::Vllm033,
        true,
        false,
    )
    .await;
    // kv-epp reaches the PUB through a relay the test can cut (the replay socket directly).
    let relay = common::replicas::Cutter::start(format!("tcp://127.0.0.1:{pub_port}")).await;
    let worker: SocketAddr = worker.parse().unwrap();
    let server = kv_epp(worker, relay.addr.port(), Some(replay_port)).await;
    wait_subscribed(&server).await;
    let t: Vec<u32> = (200..224).collect();
    engine
        .publish(vec![engine.stored(&[1, 2], None, &t[..8], None)], false)
        .await;
    assert!(wait_worker_blocks(&server, worker, 2).await);

    relay.set_cut(true);
    let st = server.feeds.statuses()[0].2.clone();
    assert!(
        eventually(15, || !st.connected.load(Relaxed)).await,
        "the feed sees the cut"
    );
    engine
        .publish(
            vec![engine.stored(&[3, 4], Some(2), &t[8..16], None)],
            false,
        )
        .await;
    let u: Vec<u32> = (300..308).collect();
    engine
        .publish(vec![engine.stored(&[5, 6], None, &u, None)], false)
        .await;
    if evict {
        engine.sent.lock().unwrap().retain(|(seq, _)| *seq != 1);
    }
    relay.set_cut(false);
    // The engine publishes nothing more.
    if evict {
        assert!(
            eventually(15, || st.unfillable.load(Relaxed) == 1
                && st.batches.load(Relaxed) == 2)
            .await,
            "the unrecoverable gap dropped the state; the buffered batch was rejoined"
        );
        assert!(wait_worker_blocks(&server, worker, 2).await);
        assert_eq!(overlap(&server, &t, None).await, 0, "no stale credit");
        assert_eq!(overlap(&server, &u, None).await, 8);
    } else {
        assert!(
            wait_worker_blocks(&server, worker, 6).await,
            "what was published while away is caught up on reconnect"
        );
        assert_eq!(overlap(&server, &t[..16], None).await, 16);
        assert_eq!(overlap(&server, &u, None).await, 8);
    }
    let want = if evict { (2, 1, 0, 1) } else { (3, 1, 1, 0) };
    assert_eq!(
        (
            st.batches.load(Relaxed),
            st.gaps.load(Relaxed),
            st.replayed.load(Relaxed),
            st.unfillable.load(Relaxed),
        ),
        want,
        "(batches, gaps, replayed, unfillable): each batch applied once, the gap counted once"
    );
    assert_eq!(st.restarts.load(Relaxed), 0);
    // The live stream goes on from there, each batch applied once.
    wait_subscribed(&server).await;
    engine
        .publish(vec![engine.stored(&[9], None, &[9, 9, 9, 9], None)], false)
        .await;
    let blocks = if evict { 3 } else { 7 };
    assert!(wait_worker_blocks(&server, worker, blocks).await);
    assert_eq!(
        (st.batches.load(Relaxed), st.gaps.load(Relaxed)),
        (want.0 + 1, 1)
    );
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_replay_a_gap_drops_state_and_fresh_events_recover() {
    let (mut engine, server, worker) = subscribed("127.0.0.1:18002", None, true, false).await;
    engine
        .publish(
            vec![engine.stored(&[1, 2], None, &[1, 1, 1, 1, 2, 2, 2, 2], None)],
            false,
        )
        .await;
    assert!(wait_worker_blocks(&server, worker, 2).await);
    engine.publish(vec![engine.removed(&[2])], true).await; // lost
    engine
        .publish(vec![engine.stored(&[5], None, &[5, 5, 5, 5], None)], false)
        .await;
    use std::sync::atomic::Ordering::Relaxed;
    assert!(
        eventually(15, || server.feeds.statuses()[0].2.unfillable.load(Relaxed)
            == 1)
        .await
    );
    assert_eq!(
        overlap(&server, &[1, 1, 1, 1, 2, 2, 2, 2], None).await,
        0,
        "state dropped, nothing stale credited"
    );
    assert_eq!(
        overlap(&server, &[5, 5, 5, 5], None).await,
        4,
        "the fresh event is in"
    );
    assert!(
        !server.feeds.statuses()[0].2.cold.load(Relaxed),
        "warm again after fresh events"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_frames_leave_the_subscriber_running_and_the_index_unchanged() {
    let (mut engine, server, worker) = subscribed("127.0.0.1:18003", None, false, false).await;
    engine
        .publish(vec![engine.stored(&[1], None, &[1, 2, 3, 4], None)], false)
        .await;
    assert!(wait_worker_blocks(&server, worker, 1).await);
    let mut rng = 12345u64;
    let mut next = || {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        rng
    };
    let valid = encode_batch(
        vec![engine.stored(&[9], None, &[9, 9, 9, 9], None)],
        Some(Value::Nil),
    );
    for i in 0..2000 {
        let payload: Vec<u8> = match i % 8 {
            0 => valid[..(next() as usize % valid.len())].to_vec(), // truncated
            1 => (0..(next() % 64)).map(|_| next() as u8).collect(), // garbage
            2 => {
                // Wrong types, beyond-u32 token IDs, negative hashes, odd-length byte hashes.
                let ev = Value::Array(vec![
                    s("BlockStored"),
                    Value::Array(vec![Value::from(-1), Value::Binary(vec![1, 2, 3])]),
                    Value::from("parent"),
                    Value::Array(vec![Value::from(1u64 << 33); 4]),
                    Value::from(4),
                ]);
                encode_batch(vec![ev], Some(Value::Nil))
            }
            3 => {
                // A huge array header with no elements behind it.
                let mut p = vec![0x93, 0xcb];
                p.extend_from_slice(&1.0f64.to_be_bytes());
                p.extend_from_slice(&[0xdd, 0xff, 0xff, 0xff, 0xff]);
                p
            }
            4 => {
                let ev = Value::Map(vec![
                    (s("type"), s("BlockStored")),
                    (s("block_hashes"), Value::from("x")),
                    (s("block_size"), Value::from(u64::MAX)),
                ]);
                encode_batch(vec![ev], None)
            }
            5 => {
                // Block size other than the model's: rejected with a counted warning.
                let ev = Value::Array(vec![
                    s("BlockStored"),
                    Value::Array(vec![Value::from(77u64)]),
                    Value::Nil,
                    Value::Array((0..8).map(Value::from).collect()),
                    Value::from(8),
                ]);
                encode_batch(vec![ev], None)
            }
            6 => {
                // Token count that does not match the blocks.
                let ev = Value::Array(vec![
                    s("BlockStored"),
                    Value::Array(vec![Value::from(78u64), Value::from(79u64)]),
                    Value::Nil,
                    Value::Array((0..5).map(Value::from).collect()),
                    Value::from(4),
                ]);
                encode_batch(vec![ev], None)
            }
            _ => Vec::new(),
        };
        engine.publish_raw(payload, false).await;
        if i % 200 == 0 {
            tokio::task::yield_now().await;
        }
    }
    // More events than one batch may carry (65,536): dropped whole, before any is decoded.
    engine
        .publish_raw(encode_batch(vec![Value::Nil; 65_537], None), false)
        .await;
    // Frames with the wrong number of parts.
    let mut m = ZmqMessage::from(Bytes::new());
    m.push_back(Bytes::from_static(b"short-seq"));
    engine.publisher.send(m).await.unwrap();
    // Still alive: a valid event afterwards is applied.
    engine
        .publish(vec![engine.stored(&[50], None, &[5, 6, 7, 8], None)], false)
        .await;
    assert!(
        wait_worker_blocks(&server, worker, 2).await,
        "subscriber still applies events"
    );
    assert_eq!(
        overlap(&server, &[1, 2, 3, 4], None).await,
        4,
        "earlier state intact"
    );
    assert_eq!(
        overlap(&server, &[9, 9, 9, 9], None).await,
        0,
        "no malformed block was indexed"
    );
    // Every reason is visible per worker, on /metrics and in /workers alike.
    let text = http(server.metrics_addr, "GET", "/metrics", &[], b"")
        .await
        .unwrap()
        .text();
    let w = worker.to_string();
    let dropped = |reason: &str| {
        metric(
            &text,
            &format!("kv_epp_event_dropped_total{{worker=\"{w}\",reason=\"{reason}\"}}"),
        )
    };
    assert!(dropped("block_size_mismatch") >= 200.0, "{text}");
    assert!(
        dropped("malformed_event") >= 500.0,
        "malformed events inside good batches: {text}"
    );
    assert!(dropped("malformed_frame") >= 800.0, "{text}");
    assert_eq!(dropped("oversize_batch"), 1.0, "{text}");
    let applied = metric(
        &text,
        &format!("kv_epp_event_events_total{{worker=\"{w}\",outcome=\"applied\"}}"),
    );
    assert!(applied >= 2.0, "{text}");
    let workers = http(server.admin_addr, "GET", "/workers", &[], b"")
        .await
        .unwrap();
    let workers: serde_json::Value = serde_json::from_slice(&workers.body).unwrap();
    let counts = &workers["workers"][0]["events"]["counts"];
    assert_eq!(
        counts["dropped"]["block_size_mismatch"].as_f64(),
        Some(dropped("block_size_mismatch")),
        "{counts}"
    );
    assert_eq!(
        counts["dropped"]["malformed_event"].as_f64(),
        Some(dropped("malformed_event")),
        "{counts}"
    );
    assert_eq!(
        workers["workers"][0]["events"]["failing"]["decoding"],
        serde_json::Value::Null,
        "the last batch was clean"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn query_by_hash_contract() {
    let server = kv_epp("127.0.0.1:18004".parse().unwrap(), free_port(), None).await;
    let post = |body: &'static str| {
        let addr = server.admin_addr;
        async move {
            post_json(addr, "/query_by_hash", &[], body.as_bytes())
                .await
                .unwrap()
        }
    };
    assert_eq!(
        post(r#"{"model":"m","block_hashes":[-1,2],"cache_salt":""}"#)
            .await
            .status,
        400
    );
    assert_eq!(
        post(r#"{"model":"m","block_hashes":[-1,2],"cache_salt":"t"}"#)
            .await
            .status,
        400
    );
    assert_eq!(
        post(r#"{"model":"m","block_hashes":[-1,2],"cache_salt":null}"#)
            .await
            .status,
        200
    );
    assert_eq!(
        post(r#"{"model":"m","block_hashes":[-1,2]}"#).await.status,
        200
    );
    // /explain and `kv-epp tokenize` print u64: the same bits are accepted in either form.
    let signed = post(r#"{"model":"m","block_hashes":[-1,2]}"#).await;
    let unsigned = post(r#"{"model":"m","block_hashes":[18446744073709551615,2]}"#).await;
    assert_eq!(unsigned.status, 200, "{}", unsigned.text());
    assert_eq!(unsigned.body, signed.body);
    assert_eq!(
        post(r#"{"model":"m","block_hashes":[18446744073709551616]}"#)
            .await
            .status,
        400,
        "beyond 64 bits"
    );
    assert_eq!(
        post(r#"{"model":"zz","block_hashes":[1]}"#).await.status,
        404
    );
    assert_eq!(
        post(r#"{"model":"m","block_hashes":"x"}"#).await.status,
        400
    );
    let r = http(
        server.admin_addr,
        "POST",
        "/query",
        &[],
        br#"{"model":"m","token_ids":[1,2],"cache_salt":""}"#,
    )
    .await
    .unwrap();
    assert_eq!(r.status, 200, "an empty salt is simply absent on /query");
    let big = vec![b'1'; kv_epp::admin::MAX_BODY + 10];
    let r = http(server.admin_addr, "POST", "/query", &[], &big)
        .await
        .unwrap();
    assert_eq!(r.status, 413);
}

/// The README's "checking by hand" path: `kv-epp hash --salt S` hashes under the same namespace
/// rule as routing, so its `local` output pasted into `/query_by_hash` finds the tenant's blocks,
/// for a salt too long to forward verbatim as much as for a short one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kv_epp_hash_output_pastes_into_query_by_hash() {
    let (mut engine, server, worker) = subscribed("127.0.0.1:18005", None, false, false).await;
    let long = "L".repeat(300);
    let t: Vec<u32> = (100..108).collect();
    for (i, salt) in ["tenant-a", long.as_str()].into_iter().enumerate() {
        let h = 10 * i as u64;
        engine
            .publish(
                vec![engine.stored(&[h + 1, h + 2], None, &t, Some(&fwd(salt)))],
                false,
            )
            .await;
        assert!(wait_worker_blocks(&server, worker, 2 * (i + 1)).await);
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_kv-epp"))
            .args(["hash", "--block-size", "4", "--salt", salt])
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .spawn()
            .and_then(|mut c| {
                use std::io::Write;
                c.stdin
                    .take()
                    .unwrap()
                    .write_all(serde_json::to_string(&t).unwrap().as_bytes())?;
                c.wait_with_output()
            })
            .unwrap();
        assert!(out.status.success());
        let hashes: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        // Pasted as is: u64 values, with no cache_salt field (the hashes already carry it).
        let body = serde_json::json!({"model": "m", "block_hashes": hashes["local"]});
        let best = best_overlap(&server, "/query_by_hash", &body).await;
        assert_eq!(best, 8, "salt of {} chars", salt.len());
    }
}
