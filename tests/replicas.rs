//! Replicas as separate `kv-epp serve` processes on loopback, with real sockets throughout:
//! simulated vLLM workers publish over ZeroMQ to every replica; replicas find each other from a
//! static list, authenticate with a shared token (and mutual TLS), bootstrap from a peer, and
//! relay TensorRT-LLM drains; without a token they refuse to start. Checked from outside:
//! `/debug/digest`, `/query` against what each worker really holds, `/debug/replica`, and
//! ext_proc decisions.

mod common;

use std::net::SocketAddr;
use std::process::Command;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use common::http;
use common::replicas::{BS, Cutter, DrainEngine, Replica, TOKEN, converge, dir, ports, round};
use common::sim::{SimSpec, send, sim_worker, truth};
use kv_epp_sim::server::SimWorker;
use kv_epp_sim::workload::{GeneratorSpec, generate};
use serde_json::Value;

async fn sim(drop: f64, seed: u64) -> SimWorker {
    sim_worker(SimSpec {
        block_size: BS,
        num_blocks: 400,
        drop,
        seed,
        ..SimSpec::default()
    })
    .await
}

/// A replica's overlap for (prompt, tenant) on worker `w`, in tokens.
async fn believed(r: &Replica, w: &SimWorker, tokens: &[u32], tenant: &str) -> u64 {
    common::sim::believed(r.admin, w.http_addr, tokens, Some(tenant)).await
}

/// Every replica credits exactly what each worker holds, for every probe.
async fn matches_workers(
    replicas: &[&Replica],
    workers: &[&SimWorker],
    probes: &[(Vec<u32>, String)],
) {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let mut mismatch = None;
        'outer: for r in replicas {
            for w in workers {
                for (tokens, tenant) in probes {
                    let (b, t) = (
                        believed(r, w, tokens, tenant).await,
                        truth(w, tokens, tenant),
                    );
                    assert!(
                        b <= t,
                        "replica {} credits worker {} with {b} tokens it does not hold ({t})",
                        r.name,
                        w.http_addr
                    );
                    if b != t {
                        mismatch = Some(format!("replica {}: {b} vs {t}", r.name));
                        break 'outer;
                    }
                }
            }
        }
        match mismatch {
            None => return,
            Some(m) if Instant::now() > deadline => panic!("{m}"),
            Some(_) => tokio::time::sleep(Duration::from_millis(300)).await,
        }
    }
}

/// The destination kv-epp's ext_proc picks for a completion request (BUFFERED body).
async fn decision(r: &Replica, tokens: &[u32], tenant: &str) -> String {
    let channel = common::extproc::plain_channel(r.grpc).await;
    common::extproc::destination(channel, tokens, tenant)
        .await
        .unwrap_or_else(|| panic!("no decision from {}", r.name))
}

fn workers_yaml(workers: &[(&SimWorker, String)]) -> String {
    let list: Vec<String> = workers
        .iter()
        .map(|(w, events)| {
            format!(
                "{{endpoint: '{}', model: m, events_endpoint: '{events}', replay_endpoint: '{}'}}",
                w.http_addr,
                w.events.replay_endpoint.as_ref().unwrap()
            )
        })
        .collect();
    format!("workers: [{}]\n", list.join(", "))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replicas_converge_bootstrap_from_a_peer_and_survive_faults() {
    let ws = [
        sim(0.0, 1).await,
        sim(0.2, 2).await,
        sim(0.0, 3).await,
        sim(0.0, 4).await,
    ];
    // Replica C reaches worker 3 through a relay the test can cut.
    let cutter = Cutter::start(ws[3].events.events_endpoint.clone()).await;
    let direct: Vec<(&SimWorker, String)> = ws
        .iter()
        .map(|w| (w, w.events.events_endpoint.clone()))
        .collect();
    let mut via_cutter = direct.clone();
    via_cutter[3].1 = format!("tcp://{}", cutter.addr);

    let ps = [ports(), ports(), ports(), ports()];
    let peer_ports: Vec<u16> = ps.iter().map(|p| p.peer).collect();
    let mut a = Replica::spawn("a", &ps[0], &workers_yaml(&direct), &peer_ports);
    let mut b = Replica::spawn("b", &ps[1], &workers_yaml(&direct), &peer_ports);
    let c = Replica::spawn("c", &ps[2], &workers_yaml(&via_cutter), &peer_ports);
    for r in [&a, &b, &c] {
        r.wait_ready(30).await;
    }
    let _ = &mut a;

    let work = generate(&GeneratorSpec {
        tenants: 4,
        shared_prompt_tenants: 2,
        sessions_per_tenant: 3,
        turns: 3,
        system_prompt_tokens: 256,
        user_tokens: 48,
        output_tokens: 8,
        ..GeneratorSpec::default()
    });
    let (first, second) = work.split_at(work.len() / 2);
    let mut probes = Vec::new();
    for (i, req) in first.iter().enumerate() {
        let tenant = req.tenant.clone().unwrap();
        send(&ws[i % 4], &req.tokens, &tenant).await;
        probes.push((req.tokens.clone(), tenant));
    }
    let (digest, blocks) = converge(&[&a, &b, &c], 1, 30).await;
    assert!(blocks > 50, "the workload stored blocks: {blocks}");
    let all: Vec<&SimWorker> = ws.iter().collect();
    matches_workers(&[&a, &b, &c], &all, &probes).await;

    // A replica started last bootstraps from a peer and agrees at once (no new events).
    let d = Replica::spawn("d", &ps[3], &workers_yaml(&direct), &peer_ports);
    d.wait_ready(30).await;
    assert!(
        d.counter("blocks_restored").await > 0,
        "d restored from a snapshot"
    );
    assert_eq!(
        d.digest().await.unwrap(),
        (digest, blocks),
        "d equals its peers"
    );
    // A replica serves at most two snapshots at once (each holds a copy while it streams): two
    // readers that stall (a tiny flow-control window, nothing read) keep both slots, a third is
    // told to ask elsewhere, and a slot is free again once a reader is gone.
    {
        use kv_epp::replica::pb;
        let channel = tonic::transport::Endpoint::from_shared(format!("http://{}", a.peer))
            .unwrap()
            .initial_stream_window_size(Some(64))
            .connect()
            .await
            .unwrap();
        let ask = || {
            let mut client = pb::replica_client::ReplicaClient::new(channel.clone());
            async move {
                let mut req = tonic::Request::new(pb::SnapshotRequest {
                    max_blocks_per_chunk: 1,
                });
                req.metadata_mut()
                    .insert("authorization", format!("Bearer {TOKEN}").parse().unwrap());
                client.snapshot(req).await
            }
        };
        let first = ask().await.expect("a first snapshot");
        let second = ask().await.expect("a second snapshot");
        let third = ask().await.map(|_| ()).unwrap_err();
        assert_eq!(third.code(), tonic::Code::ResourceExhausted, "{third:?}");
        drop(first);
        let again = common::eventually_async(30, || async { ask().await.is_ok() }).await;
        assert!(again, "a slot is free once a reader is gone");
        drop(second);
    }

    // Faults while the second half runs: b killed and restarted, worker 2 restarted, c cut off
    // from worker 3 for a while (worker 1 drops 20% of its batches throughout).
    for (i, req) in second.iter().enumerate() {
        let tenant = req.tenant.clone().unwrap();
        if i == 2 {
            b.kill();
            cutter.set_cut(true);
        }
        if i == second.len() / 2 {
            let r = http(ws[2].http_addr, "POST", "/admin/restart", &[], b"")
                .await
                .unwrap();
            assert!(r.status < 300);
            b.restart();
        }
        if i == second.len() * 3 / 4 {
            cutter.set_cut(false);
        }
        send(&ws[i % 4], &req.tokens, &tenant).await;
        probes.push((req.tokens.clone(), tenant));
    }
    b.wait_ready(30).await;
    // Fresh traffic on every worker after the faults, so every feed sees its stream move on.
    for (i, w) in ws.iter().enumerate() {
        let t: Vec<u32> = (0..64).map(|k| 50_000 + i as u32 * 100 + k).collect();
        send(w, &t, "tenant-late").await;
        probes.push((t, "tenant-late".into()));
    }
    let (_, blocks) = converge(&[&a, &b, &c, &d], 1, 60).await;
    assert!(blocks > 0);
    matches_workers(&[&a, &b, &c, &d], &all, &probes).await;
    // The faults happened: c lost worker 3's stream and filled the gap by replay; worker 2's
    // restart was seen (sequence down) by the replicas that were running throughout.
    let feed = |v: &Value, w: &SimWorker| {
        v["workers"]
            .as_array()
            .unwrap()
            .iter()
            .find(|x| x["worker"] == w.http_addr.to_string())
            .unwrap()["events"]
            .clone()
    };
    let cw = c.get("/workers").await.unwrap();
    let f3 = feed(&cw, &ws[3]);
    assert!(
        f3["gaps"].as_u64().unwrap() >= 1 && f3["replayed"] == f3["gaps"],
        "c: {f3}"
    );
    for r in [&a, &c, &d] {
        let f2 = feed(&r.get("/workers").await.unwrap(), &ws[2]);
        assert!(f2["restarts"].as_u64().unwrap() >= 1, "{}: {f2}", r.name);
    }

    // The same request gets the same decision from every replica.
    for (tokens, tenant) in probes.iter().step_by(3) {
        let want = decision(&a, tokens, tenant).await;
        for r in [&b, &c, &d] {
            assert_eq!(
                decision(r, tokens, tenant).await,
                want,
                "replica {} decides alike",
                r.name
            );
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_peer_api_refuses_a_wrong_token() {
    use kv_epp::replica::pb;
    let p = ports();
    let r = Replica::spawn("auth", &p, "workers: []\n", &[p.peer]);
    r.wait_ready(30).await;
    let mut client = pb::replica_client::ReplicaClient::connect(format!("http://{}", r.peer))
        .await
        .unwrap();
    let err = client.hello(pb::HelloRequest {}).await.unwrap_err();
    assert_eq!(err.code(), tonic::Code::Unauthenticated);
    let mut req = tonic::Request::new(pb::SnapshotRequest::default());
    req.metadata_mut()
        .insert("authorization", "Bearer wrong".parse().unwrap());
    assert_eq!(
        client.snapshot(req).await.unwrap_err().code(),
        tonic::Code::Unauthenticated
    );
    let mut req = tonic::Request::new(pb::HelloRequest {});
    req.metadata_mut()
        .insert("authorization", format!("Bearer {TOKEN}").parse().unwrap());
    assert!(client.hello(req).await.unwrap().into_inner().ready);
    assert!(r.counter("unauthenticated").await >= 2);
}

/// Replicas that speak mutual TLS on the peer API, each with its own certificate from the
/// peers' CA: the second copies the first one's index over TLS. A client without a
/// certificate, or with one from another CA, does not get past the handshake, and plaintext gets
/// no answer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replicas_bootstrap_over_mutual_tls() {
    use common::certs::{TestCa, client_config, handshake};
    let ca = TestCa::new("kv-epp peers");
    let tls_dir = || {
        let d = dir().join("peer-tls");
        ca.leaf(&["kv-epp-peers"]).write_to(&d);
        common::write_file(&d.join("ca.crt"), ca.pem());
        format!(", cert_path: '{}', server_name: kv-epp-peers", d.display())
    };
    let w = sim(0.0, 21).await;
    let body = workers_yaml(&[(&w, w.events.events_endpoint.clone())]);
    let ps = [ports(), ports()];
    let peer_ports: Vec<u16> = ps.iter().map(|p| p.peer).collect();
    let a = Replica::spawn_with("tls-a", &ps[0], &body, &peer_ports, &tls_dir());
    a.wait_ready(30).await;
    let tokens: Vec<u32> = (0..128).collect();
    send(&w, &tokens, "tenant-tls").await;
    converge(&[&a], 8, 30).await;

    let b = Replica::spawn_with("tls-b", &ps[1], &body, &peer_ports, &tls_dir());
    b.wait_ready(30).await;
    assert!(
        b.counter("blocks_restored").await > 0,
        "b copied a's index over mutual TLS:\n{}",
        b.log_tail()
    );
    converge(&[&a, &b], 8, 30).await;
    assert_eq!(b.counter("unauthenticated").await, 0);

    // From outside: only a certificate from the peers' CA gets through the handshake.
    let trusting = |id| client_config(&[&ca.pem()], id);
    let ours = ca.leaf(&["someone"]);
    let presented = handshake(a.peer, "kv-epp-peers", trusting(Some(&ours)))
        .await
        .unwrap();
    assert!(!presented.is_empty());
    let e = handshake(a.peer, "kv-epp-peers", trusting(None))
        .await
        .unwrap_err();
    assert!(
        e.contains("CertificateRequired"),
        "no client certificate: {e}"
    );
    let stranger = TestCa::new("another CA").leaf(&["kv-epp-peers"]);
    let e = handshake(a.peer, "kv-epp-peers", trusting(Some(&stranger)))
        .await
        .unwrap_err();
    assert!(
        e.contains("UnknownCA"),
        "a certificate from another CA: {e}"
    );
    let plain = tonic::transport::Channel::from_shared(format!("http://{}", a.peer))
        .unwrap()
        .connect_lazy();
    let mut req = tonic::Request::new(kv_epp::replica::pb::HelloRequest {});
    req.metadata_mut()
        .insert("authorization", format!("Bearer {TOKEN}").parse().unwrap());
    let hello = kv_epp::replica::pb::replica_client::ReplicaClient::new(plain)
        .hello(req)
        .await;
    assert!(hello.is_err(), "plaintext is not answered: {hello:?}");
}

/// With peers and no token, `kv-epp serve` stops at start-up and says which fields to set;
/// the explicit switch lets it run unauthenticated.
#[test]
fn replication_without_a_token_refuses_to_start() {
    let d = dir();
    let serve = |yaml: &str| {
        let config = d.join("anonymous.yaml");
        common::write_file(&config, yaml);
        Command::new(env!("CARGO_BIN_EXE_kv-epp"))
            .args(["serve", "--validate-only", "--config-file"])
            .arg(&config)
            .output()
            .unwrap()
    };
    let base = "server: {bind_address: 127.0.0.1, grpc_port: 0, grpc_health_port: 0, metrics_port: 0, admin_port: 0}\n";
    let out = serve(&format!("{base}peers: {{static_peers: ['127.0.0.1:9']}}\n"));
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    for field in [
        "peers.token_file",
        "--peer-token-file",
        "peers.insecure_allow_anonymous",
    ] {
        assert!(err.contains(field), "the error names {field}: {err}");
    }
    let out = serve(&format!(
        "{base}peers: {{static_peers: ['127.0.0.1:9'], insecure_allow_anonymous: true}}\n"
    ));
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

fn refs(rs: &[Replica]) -> Vec<&Replica> {
    rs.iter().collect()
}

/// Which replica polls `worker` (exactly one must).
async fn poller_of(replicas: &[&Replica], worker: SocketAddr) -> Vec<String> {
    let mut out = Vec::new();
    for r in replicas {
        let s = r.status().await.unwrap();
        for src in s["single_reader_sources"].as_array().unwrap() {
            if src["worker"] == worker.to_string() && src["polling"] == true {
                out.push(r.name.clone());
            }
        }
    }
    out
}

/// Each replica applied every relayed batch exactly once: its own plus those applied from
/// peers equal all batches originated (`total`).
async fn exactly_once(replicas: &[&Replica], total: u64) {
    // Relay streams may still be delivering: wait for the counts to settle.
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let mut done = true;
        for r in replicas {
            done &= r.counter("relay_originated").await + r.counter("relay_applied").await >= total;
        }
        if done || Instant::now() > deadline {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    for r in replicas {
        let own = r.counter("relay_originated").await;
        let applied = r.counter("relay_applied").await;
        assert_eq!(
            own + applied,
            total,
            "replica {} applied {applied} relayed + {own} own batches of {total}",
            r.name
        );
        assert_eq!(r.counter("relay_resets").await, 0);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn single_reader_sources_are_polled_once_relayed_once_and_fail_over() {
    let engines = [DrainEngine::default(), DrainEngine::default()];
    let addrs = [engines[0].start().await, engines[1].start().await];
    let body = format!(
        "events: {{engine: trtllm, trtllm: {{poll_interval_ms: 50}}}}\nworkers: [{{endpoint: '{}', model: m}}, {{endpoint: '{}', model: m}}]\n",
        addrs[0], addrs[1]
    );
    let ps = [ports(), ports(), ports()];
    let peer_ports: Vec<u16> = ps.iter().map(|p| p.peer).collect();
    let mut rs: Vec<Replica> = ["p", "q", "r"]
        .iter()
        .zip(&ps)
        .map(|(n, p)| Replica::spawn(n, p, &body, &peer_ports))
        .collect();
    for r in &rs {
        r.wait_ready(30).await;
    }
    // Each source gets exactly one poller once ownership settles.
    for a in addrs {
        let deadline = Instant::now() + Duration::from_secs(15);
        while poller_of(&refs(&rs), a).await.len() != 1 {
            assert!(Instant::now() < deadline, "one poller for {a}");
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }
    let mut next = 1_000u64;
    let mut want = 0u64;
    for _ in 0..5 {
        want += round(&engines, &mut next);
        tokio::time::sleep(Duration::from_millis(120)).await;
    }
    assert!(common::eventually(10, || engines.iter().all(|e| e.is_drained())).await);
    let (_, blocks) = converge(&refs(&rs), want, 30).await;
    assert_eq!(
        blocks, want,
        "every drained block is on every replica, once"
    );
    let mut total = 0;
    for r in &rs {
        total += r.counter("relay_originated").await;
    }
    assert!(total >= 2, "drains were relayed");
    exactly_once(&refs(&rs), total).await;

    // Kill the owner of engine 0 while events keep coming; another replica takes over within
    // seconds, and the survivors end up agreeing on everything anyone received.
    let owner = poller_of(&refs(&rs), addrs[0]).await.remove(0);
    let pos = rs.iter().position(|r| r.name == owner).unwrap();
    let dead_instance = rs[pos].status().await.unwrap()["instance"]
        .as_str()
        .unwrap()
        .to_owned();
    let pushing = Arc::new(AtomicBool::new(true));
    let pusher = {
        let (engines, pushing) = (engines.clone(), pushing.clone());
        tokio::spawn(async move {
            let mut next = 500_000u64;
            let mut pushed = 0u64;
            while pushing.load(Ordering::SeqCst) {
                pushed += round(&engines, &mut next);
                tokio::time::sleep(Duration::from_millis(60)).await;
            }
            pushed
        })
    };
    tokio::time::sleep(Duration::from_millis(400)).await;
    rs[pos].kill();
    let dead = rs.remove(pos);
    let killed = Instant::now();
    let deadline = killed + Duration::from_secs(5);
    loop {
        let p = poller_of(&refs(&rs), addrs[0]).await;
        if p.len() == 1 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "ownership of {} moved within 5 s: {p:?}",
            addrs[0]
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    eprintln!(
        "ownership moved {:?} after the owner was killed",
        killed.elapsed()
    );
    tokio::time::sleep(Duration::from_millis(600)).await;
    pushing.store(false, Ordering::SeqCst);
    want += pusher.await.unwrap();
    assert!(common::eventually(10, || engines.iter().all(|e| e.is_drained())).await);
    let (_, blocks) = converge(&refs(&rs), 1, 30).await;
    // Only what the dead owner drained and relayed to nobody can be missing.
    assert!(blocks <= want, "{blocks} blocks, {want} pushed");
    // Exactly once: every survivor applied all the dead origin's batches it or its peer got,
    // plus every batch the survivors originated.
    let mut total = 0;
    let mut dead_pos = Vec::new();
    for r in &rs {
        total += r.counter("relay_originated").await;
        let s = r.status().await.unwrap();
        dead_pos.push(s["relay_positions"][&dead_instance].as_u64().unwrap_or(0));
    }
    assert!(
        dead_pos.iter().all(|p| *p == dead_pos[0]),
        "survivors evened out: {dead_pos:?}"
    );
    exactly_once(&refs(&rs), total + dead_pos[0]).await;
    // After the failover, nothing is lost: a final round arrives whole on every survivor.
    let before = blocks;
    let added = round(&engines, &mut next);
    assert!(common::eventually(10, || engines.iter().all(|e| e.is_drained())).await);
    let (_, blocks) = converge(&refs(&rs), before + added, 30).await;
    assert_eq!(blocks, before + added);
    drop(dead);
}

/// A peer that answers `Hello` as a ready replica under `instance`, serves an empty snapshot, and
/// streams `batches` to every relay subscriber, then holds the stream open: a misbehaving peer,
/// speaking the real peer API.
#[derive(Clone)]
struct FakePeer {
    instance: u64,
    /// Shown in every `Hello`.
    claims: Vec<kv_epp::replica::pb::Claim>,
    batches: Vec<kv_epp::replica::pb::RelayBatch>,
}

type PeerStream<T> =
    std::pin::Pin<Box<dyn futures_util::Stream<Item = Result<T, tonic::Status>> + Send>>;

#[tonic::async_trait]
impl kv_epp::replica::pb::replica_server::Replica for FakePeer {
    async fn hello(
        &self,
        _: tonic::Request<kv_epp::replica::pb::HelloRequest>,
    ) -> Result<tonic::Response<kv_epp::replica::pb::HelloReply>, tonic::Status> {
        Ok(tonic::Response::new(kv_epp::replica::pb::HelloReply {
            instance: self.instance,
            ready: true,
            version: "fake".into(),
            relay_next: self.batches.len() as u64,
            claims: self.claims.clone(),
            ..Default::default()
        }))
    }

    type SnapshotStream = PeerStream<kv_epp::replica::pb::SnapshotChunk>;

    async fn snapshot(
        &self,
        _: tonic::Request<kv_epp::replica::pb::SnapshotRequest>,
    ) -> Result<tonic::Response<Self::SnapshotStream>, tonic::Status> {
        use kv_epp::replica::pb::{SnapshotChunk, SnapshotEnd, snapshot_chunk::Item};
        let end = SnapshotChunk {
            item: Some(Item::End(SnapshotEnd::default())),
        };
        Ok(tonic::Response::new(Box::pin(futures_util::stream::iter(
            [Ok(end)],
        ))))
    }

    type RelayStream = PeerStream<kv_epp::replica::pb::RelayBatch>;

    async fn relay(
        &self,
        _: tonic::Request<kv_epp::replica::pb::RelayRequest>,
    ) -> Result<tonic::Response<Self::RelayStream>, tonic::Status> {
        use futures_util::StreamExt;
        let batches = futures_util::stream::iter(self.batches.clone().into_iter().map(Ok));
        Ok(tonic::Response::new(Box::pin(
            batches.chain(futures_util::stream::pending()),
        )))
    }
}

impl FakePeer {
    /// Serves on a free loopback port; returns the port.
    async fn start(self) -> u16 {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        tokio::spawn(
            tonic::transport::Server::builder()
                .add_service(kv_epp::replica::pb::replica_server::ReplicaServer::new(
                    self,
                ))
                .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener)),
        );
        port
    }

    /// Serves, and starts a replica named `name` running `worker` with this peer as its only
    /// peer; returns once the replica has applied a batch of the peer's stream. The last batch
    /// the tests stream is a normal one, so by then every batch before it was read.
    async fn feed_replica(self, name: &str, worker: SocketAddr) -> Replica {
        let peer_port = self.start().await;
        let p = ports();
        let body = format!("workers: [{{endpoint: '{worker}', model: m}}]\n");
        let r = Replica::spawn(name, &p, &body, &[peer_port]);
        r.wait_ready(30).await;
        wait_counter(&r, "relay_applied", 1).await;
        r
    }
}

/// Waits (60 s at most) until `/debug/replica`'s counter `name` reaches `at_least`.
async fn wait_counter(r: &Replica, name: &str, at_least: u64) {
    let deadline = Instant::now() + Duration::from_secs(60);
    while r.counter(name).await < at_least {
        assert!(
            Instant::now() < deadline,
            "{name} did not reach {at_least} in 60 s:\n{}",
            r.log_tail()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Tokens of `tokens` the replica credits to `worker` for an unsalted prompt.
async fn credited(r: &Replica, worker: SocketAddr, tokens: &[u32]) -> u64 {
    common::sim::believed(r.admin, worker, tokens, None).await
}

/// A relayed batch of `origin` at `seq` under `epoch`: `tokens` stored on `worker` as a new
/// unsalted sequence, engine hashes counting up from `first_hash`.
fn relayed_store(
    worker: SocketAddr,
    origin: u64,
    seq: u64,
    epoch: u64,
    first_hash: u64,
    tokens: &[u32],
) -> kv_epp::replica::pb::RelayBatch {
    use kv_epp::replica::pb;
    use kv_epp_core::hashing::HashSeed;
    pb::RelayBatch {
        origin,
        seq,
        epoch,
        model: "m".into(),
        endpoint: worker.to_string(),
        events: vec![pb::RelayEvent {
            kind: Some(pb::relay_event::Kind::Stored(pb::StoredEvent {
                parent: None,
                root_seed: Some(HashSeed::new(None, None).0),
                engine_hashes: (first_hash..).take(tokens.len() / BS).collect(),
                tokens: tokens.to_vec(),
                offload: false,
            })),
        }],
        ..Default::default()
    }
}

/// A peer's relay stream carries its own log only: a batch it streams under another origin (a
/// replica it made up, or the receiver itself) is dropped and counted, and its blocks are never
/// credited; the batch under its own origin is applied as usual.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_streaming_batches_of_another_origin_is_not_believed() {
    let worker: SocketAddr = format!("127.0.0.1:{}", common::free_port())
        .parse()
        .unwrap();
    let own: Vec<u32> = (0..4 * BS as u32).collect();
    let made_up: Vec<u32> = (1000..1000 + 4 * BS as u32).collect();
    let peer_instance = 0x0fee_d0fe_ed00_0001;
    let r = FakePeer {
        instance: peer_instance,
        claims: Vec::new(),
        batches: vec![
            relayed_store(worker, 0x0bad_0bad_0bad_0bad, 0, 0, 100, &made_up),
            relayed_store(worker, peer_instance, 0, 0, 200, &own),
        ],
    }
    .feed_replica("lied-to", worker)
    .await;
    assert_eq!(
        credited(&r, worker, &own).await,
        own.len() as u64,
        "the peer's own batch is applied"
    );
    assert_eq!(
        credited(&r, worker, &made_up).await,
        0,
        "a batch under a made-up origin is not"
    );
    assert!(r.counter("relay_foreign").await >= 1, "and it is counted");
}

/// Ownership epochs no replica can reach, from a peer: its claims in every `Hello` and a relayed
/// batch under such an epoch are refused and counted, the batch's blocks never credited, and the
/// replica goes on answering and applying the peer's next batch.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ownership_epochs_no_replica_can_reach_are_refused() {
    use kv_epp::replica::pb;
    let worker: SocketAddr = format!("127.0.0.1:{}", common::free_port())
        .parse()
        .unwrap();
    let wild: Vec<u32> = (0..4 * BS as u32).collect();
    let fine: Vec<u32> = (500..500 + 4 * BS as u32).collect();
    let peer_instance = 0x0fee_d0fe_ed00_0002;
    let r = FakePeer {
        instance: peer_instance,
        claims: vec![pb::Claim {
            worker: worker.to_string(),
            epoch: u64::MAX,
            active: true,
            ..Default::default()
        }],
        batches: vec![
            relayed_store(worker, peer_instance, 0, u64::MAX, 100, &wild),
            relayed_store(worker, peer_instance, 1, 0, 200, &fine),
        ],
    }
    .feed_replica("wild-epochs", worker)
    .await;
    assert_eq!(credited(&r, worker, &fine).await, fine.len() as u64);
    assert_eq!(
        credited(&r, worker, &wild).await,
        0,
        "a batch under an unreachable epoch is not applied"
    );
    // The claim, in every `Hello`, and the batch; the refused batch is not counted as applied.
    wait_counter(&r, "epochs_refused", 2).await;
    assert_eq!(r.counter("relay_applied").await, 1);
}
