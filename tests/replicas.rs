//! Replicas as separate `kv-epp serve` processes on loopback, with real sockets throughout:
//! simulated vLLM workers publish over ZeroMQ to every replica; replicas find each other from a
//! static list, authenticate with a shared token (and mutual TLS), bootstrap from a peer, and
//! relay TensorRT-LLM drains; without a token they refuse to start. Checked from outside:
//! `/debug/digest`, `/query` against what each worker really holds, `/debug/replica`, and
//! ext_proc decisions.

mod common;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::{Child, Command};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::http;
use common::sim::{SimSpec, fwd, send, sim_worker, truth};
use kv_epp_sim::server::SimWorker;
use kv_epp_sim::workload::{GeneratorSpec, generate};
use serde_json::{Value, json};
use tokio::net::{TcpListener, TcpStream};

const BS: usize = 16;
const TOKEN: &str = "s3cret-peer-token";

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

/// A TCP relay that can cut its connections and refuse new ones for a while: one replica's
/// path to one worker's event stream.
struct Cutter {
    addr: SocketAddr,
    cut: Arc<AtomicBool>,
    conns: Arc<Mutex<Vec<tokio::task::JoinHandle<()>>>>,
}

impl Cutter {
    async fn start(target: String) -> Cutter {
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        let cut = Arc::new(AtomicBool::new(false));
        let conns: Arc<Mutex<Vec<tokio::task::JoinHandle<()>>>> = Arc::default();
        let target = target.trim_start_matches("tcp://").to_owned();
        let (c2, k2) = (cut.clone(), conns.clone());
        tokio::spawn(async move {
            loop {
                let Ok((mut inbound, _)) = l.accept().await else {
                    return;
                };
                if c2.load(Ordering::SeqCst) {
                    drop(inbound);
                    continue;
                }
                let target = target.clone();
                k2.lock().unwrap().push(tokio::spawn(async move {
                    if let Ok(mut out) = TcpStream::connect(&target).await {
                        let _ = tokio::io::copy_bidirectional(&mut inbound, &mut out).await;
                    }
                }));
            }
        });
        Cutter { addr, cut, conns }
    }

    fn set_cut(&self, cut: bool) {
        self.cut.store(cut, Ordering::SeqCst);
        if cut {
            for c in self.conns.lock().unwrap().drain(..) {
                c.abort();
            }
        }
    }
}

/// One `kv-epp serve` process.
struct Replica {
    name: String,
    child: Option<Child>,
    config: PathBuf,
    admin: SocketAddr,
    grpc: SocketAddr,
    peer: SocketAddr,
    log: PathBuf,
}

struct Ports {
    grpc: u16,
    health: u16,
    metrics: u16,
    admin: u16,
    peer: u16,
}

fn ports() -> Ports {
    Ports {
        grpc: common::free_port(),
        health: common::free_port(),
        metrics: common::free_port(),
        admin: common::free_port(),
        peer: common::free_port(),
    }
}

/// A fresh directory for one replica's files: tests run in parallel and reuse replica names,
/// so no two replicas may share a config or token file (a reader could see it half-written).
fn dir() -> PathBuf {
    common::test_dir("replicas")
}

impl Replica {
    fn spawn(name: &str, p: &Ports, body: &str, peers: &[u16]) -> Replica {
        Replica::spawn_with(name, p, body, peers, "")
    }

    /// As `spawn`, with `peers_extra` (`, key: value` pairs) added to the `peers` section.
    fn spawn_with(name: &str, p: &Ports, body: &str, peers: &[u16], peers_extra: &str) -> Replica {
        let d = dir();
        let token = d.join("token");
        common::write_file(&token, format!("{TOKEN}\n"));
        let peer_list: Vec<String> = peers.iter().map(|p| format!("'127.0.0.1:{p}'")).collect();
        let yaml = format!(
            "server: {{bind_address: 127.0.0.1, grpc_port: {}, grpc_health_port: {}, metrics_port: {}, admin_port: {}}}\n\
             engine_metrics: {{interval_ms: 0}}\n\
             peers: {{static_peers: [{}], port: {}, token_file: '{}', probe_interval_ms: 200, bootstrap_timeout_ms: 30000, snapshot_chunk_blocks: 64{peers_extra}}}\n\
             models: [{{name: m, block_size: {BS}}}]\n{body}",
            p.grpc,
            p.health,
            p.metrics,
            p.admin,
            peer_list.join(", "),
            p.peer,
            token.display()
        );
        let config = d.join(format!("{name}.yaml"));
        common::write_file(&config, yaml);
        let mut r = Replica {
            name: name.into(),
            child: None,
            config,
            admin: format!("127.0.0.1:{}", p.admin).parse().unwrap(),
            grpc: format!("127.0.0.1:{}", p.grpc).parse().unwrap(),
            peer: format!("127.0.0.1:{}", p.peer).parse().unwrap(),
            log: d.join(format!("{name}.log")),
        };
        r.restart();
        r
    }

    fn restart(&mut self) {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log)
            .unwrap();
        let child = Command::new(env!("CARGO_BIN_EXE_kv-epp"))
            .args(["serve", "--config-file"])
            .arg(&self.config)
            .env("KV_EPP_LOG", "info,kv_epp=debug")
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .unwrap();
        self.child = Some(child);
    }

    fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    fn log_tail(&self) -> String {
        let s = std::fs::read_to_string(&self.log).unwrap_or_default();
        let lines: Vec<&str> = s.lines().collect();
        lines[lines.len().saturating_sub(30)..].join("\n")
    }

    async fn get(&self, path: &str) -> Option<Value> {
        let r = http(self.admin, "GET", path, &[], b"").await.ok()?;
        (r.status == 200).then(|| serde_json::from_slice(&r.body).ok())?
    }

    async fn status(&self) -> Option<Value> {
        self.get("/debug/replica").await
    }

    async fn digest(&self) -> Option<(String, u64)> {
        let v = self.get("/debug/digest").await?;
        Some((
            v["models"]["m"]["digest"].as_str()?.to_owned(),
            v["models"]["m"]["blocks"].as_u64()?,
        ))
    }

    async fn wait_ready(&self, secs: u64) {
        let deadline = Instant::now() + Duration::from_secs(secs);
        loop {
            if let Some(s) = self.status().await
                && s["ready"] == true
            {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "replica {} not ready in {secs}s:\n{}",
                self.name,
                self.log_tail()
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    async fn counter(&self, name: &str) -> u64 {
        self.status().await.unwrap()["counters"][name]
            .as_u64()
            .unwrap()
    }
}

impl Drop for Replica {
    fn drop(&mut self) {
        self.kill();
    }
}

/// Waits until every replica reports the same digest twice in a row, with `min_blocks` or more.
async fn converge(replicas: &[&Replica], min_blocks: u64, secs: u64) -> (String, u64) {
    let deadline = Instant::now() + Duration::from_secs(secs);
    let mut last: Option<(String, u64)> = None;
    loop {
        let mut ds = Vec::new();
        for r in replicas {
            ds.push(r.digest().await);
        }
        let first = ds[0].clone();
        let same = first.is_some() && ds.iter().all(|d| *d == first);
        if same && first.as_ref().unwrap().1 >= min_blocks {
            if last == first {
                return first.unwrap();
            }
            last = first;
        } else {
            last = None;
        }
        if Instant::now() > deadline {
            let names: Vec<&str> = replicas.iter().map(|r| r.name.as_str()).collect();
            panic!("digests did not converge: {names:?} {ds:?}");
        }
        tokio::time::sleep(Duration::from_millis(400)).await;
    }
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

/// A TensorRT-LLM-style engine: `POST /kv_cache_events` returns every queued event and forgets
/// them (a destructive read).
#[derive(Clone, Default)]
struct DrainEngine {
    queue: Arc<Mutex<Vec<Value>>>,
}

impl DrainEngine {
    async fn start(&self) -> SocketAddr {
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        let q = self.queue.clone();
        let app = axum::Router::new().route(
            "/kv_cache_events",
            axum::routing::post(move || {
                let q = q.clone();
                async move {
                    let drained: Vec<Value> = std::mem::take(&mut *q.lock().unwrap());
                    Value::Array(drained).to_string()
                }
            }),
        );
        tokio::spawn(async move {
            let _ = axum::serve(l, app).await;
        });
        addr
    }

    fn push(&self, ev: Value) {
        self.queue.lock().unwrap().push(ev);
    }

    fn is_drained(&self) -> bool {
        self.queue.lock().unwrap().is_empty()
    }
}

/// A stored event of a fresh two-block sequence (hashes `h`, `h + 1`) under `tenant`.
fn trt_stored(h: u64, tenant: &str) -> Value {
    let block = |hash: u64| {
        let toks: Vec<Value> = (0..BS as u64)
            .map(|k| json!({"token_id": (hash * 31 + k) % 50_000, "token_extra_id": 0}))
            .collect();
        json!({"type": "stored_block", "block_hash": hash, "tokens": toks, "lora_id": null, "cache_level": 0, "priority": 35, "cache_salt": fwd(tenant)})
    };
    json!({"event_id": h, "data": {"type": "stored", "parent_hash": null, "blocks": [block(h), block(h + 1)]}})
}

fn trt_removed(h: u64) -> Value {
    json!({"event_id": h, "data": {"type": "removed", "block_hashes": [h + 1]}})
}

/// Queues eight stored events (every fourth followed by a removal of its second block) over
/// both engines; returns the blocks they leave.
fn round(engines: &[DrainEngine; 2], next: &mut u64) -> u64 {
    let mut blocks = 0;
    for i in 0..8 {
        let e = &engines[i % 2];
        e.push(trt_stored(*next, &format!("tenant-{}", i % 3)));
        blocks += 2;
        if i % 4 == 3 {
            e.push(trt_removed(*next));
            blocks -= 1;
        }
        *next += 10;
    }
    blocks
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
