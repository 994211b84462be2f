//! Replicas as `kv-epp serve` processes on loopback, shared by the replica tests: one process
//! per replica with its own directory (config, token, log), a TCP relay the test can cut, a
//! TensorRT-LLM-style drain engine that records which process drained it, and convergence
//! checks over `/debug/digest`.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::{Child, Command};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use tokio::net::{TcpListener, TcpStream};

use super::http;
use super::sim::fwd;

/// Block size of the replica tests' model `m`.
pub const BS: usize = 16;
/// The shared peer token.
pub const TOKEN: &str = "s3cret-peer-token";

/// A TCP relay that can cut its connections and refuse new ones for a while: one replica's
/// path to one worker's event stream.
pub struct Cutter {
    pub addr: SocketAddr,
    cut: Arc<AtomicBool>,
    conns: Arc<Mutex<Vec<tokio::task::JoinHandle<()>>>>,
}

impl Cutter {
    pub async fn start(target: String) -> Cutter {
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
                // Checked and registered under the lock `set_cut` takes: a connection accepted
                // as the cut begins is either refused or aborted by it, never left running.
                let mut conns = k2.lock().unwrap();
                if c2.load(Ordering::SeqCst) {
                    drop(inbound);
                    continue;
                }
                let target = target.clone();
                conns.push(tokio::spawn(async move {
                    if let Ok(mut out) = TcpStream::connect(&target).await {
                        let _ = tokio::io::copy_bidirectional(&mut inbound, &mut out).await;
                    }
                }));
            }
        });
        Cutter { addr, cut, conns }
    }

    pub fn set_cut(&self, cut: bool) {
        let mut conns = self.conns.lock().unwrap();
        self.cut.store(cut, Ordering::SeqCst);
        if cut {
            for c in conns.drain(..) {
                c.abort();
            }
        }
    }
}

/// One `kv-epp serve` process.
pub struct Replica {
    pub name: String,
    pub child: Option<Child>,
    pub config: PathBuf,
    pub admin: SocketAddr,
    pub grpc: SocketAddr,
    pub peer: SocketAddr,
    pub log: PathBuf,
    /// Where the token file is (tests rewrite it).
    pub token: PathBuf,
}

pub struct Ports {
    pub grpc: u16,
    pub health: u16,
    pub metrics: u16,
    pub admin: u16,
    pub peer: u16,
}

pub fn ports() -> Ports {
    Ports {
        grpc: super::free_port(),
        health: super::free_port(),
        metrics: super::free_port(),
        admin: super::free_port(),
        peer: super::free_port(),
    }
}

/// A fresh directory for one replica's files: tests run in parallel and reuse replica names,
/// so no two replicas may share a config or token file (a reader could see it half-written).
pub fn dir() -> PathBuf {
    super::test_dir("replicas")
}

impl Replica {
    /// A replica with one model `m` (block size [`BS`]) unless `body` names its own `models:`.
    pub fn spawn(name: &str, p: &Ports, body: &str, peers: &[u16]) -> Replica {
        Replica::spawn_with(name, p, body, peers, "")
    }

    /// As `spawn`, with `peers_extra` (`, key: value` pairs) added to the `peers` section.
    pub fn spawn_with(
        name: &str,
        p: &Ports,
        body: &str,
        peers: &[u16],
        peers_extra: &str,
    ) -> Replica {
        Replica::spawn_full(name, p, body, peers, peers_extra, TOKEN)
    }

    /// As `spawn_with`, with `token` as the token file's content.
    pub fn spawn_full(
        name: &str,
        p: &Ports,
        body: &str,
        peers: &[u16],
        peers_extra: &str,
        token_text: &str,
    ) -> Replica {
        let d = dir();
        let token = d.join("token");
        super::write_file(&token, format!("{token_text}\n"));
        let peer_list: Vec<String> = peers.iter().map(|p| format!("'127.0.0.1:{p}'")).collect();
        // One model `m` unless the body names its own.
        let models = if body.contains("models:") {
            String::new()
        } else {
            format!("models: [{{name: m, block_size: {BS}}}]\n")
        };
        let yaml = format!(
            "server: {{bind_address: 127.0.0.1, grpc_port: {}, grpc_health_port: {}, metrics_port: {}, admin_port: {}}}\n\
             engine_metrics: {{interval_ms: 0}}\n\
             peers: {{static_peers: [{}], port: {}, token_file: '{}', probe_interval_ms: 200, bootstrap_timeout_ms: 30000, snapshot_chunk_blocks: 64{peers_extra}}}\n\
             {models}{body}",
            p.grpc,
            p.health,
            p.metrics,
            p.admin,
            peer_list.join(", "),
            p.peer,
            token.display()
        );
        let config = d.join(format!("{name}.yaml"));
        super::write_file(&config, yaml);
        let mut r = Replica {
            name: name.into(),
            child: None,
            config,
            admin: format!("127.0.0.1:{}", p.admin).parse().unwrap(),
            grpc: format!("127.0.0.1:{}", p.grpc).parse().unwrap(),
            peer: format!("127.0.0.1:{}", p.peer).parse().unwrap(),
            log: d.join(format!("{name}.log")),
            token,
        };
        r.restart();
        r
    }

    pub fn restart(&mut self) {
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

    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// The running process's id.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// Sends `signal` (`STOP`, `CONT`, ...) to the running process.
    pub fn signal(&self, signal: &str) {
        let pid = self.pid().expect("running");
        let ok = Command::new("kill")
            .arg(format!("-{signal}"))
            .arg(pid.to_string())
            .status()
            .unwrap()
            .success();
        assert!(ok, "kill -{signal} {pid}");
    }

    pub fn log_tail(&self) -> String {
        let s = std::fs::read_to_string(&self.log).unwrap_or_default();
        let lines: Vec<&str> = s.lines().collect();
        lines[lines.len().saturating_sub(30)..].join("\n")
    }

    pub async fn get(&self, path: &str) -> Option<Value> {
        let r = http(self.admin, "GET", path, &[], b"").await.ok()?;
        (r.status == 200).then(|| serde_json::from_slice(&r.body).ok())?
    }

    pub async fn status(&self) -> Option<Value> {
        self.get("/debug/replica").await
    }

    pub async fn digest(&self) -> Option<(String, u64)> {
        let v = self.get("/debug/digest").await?;
        Some((
            v["models"]["m"]["digest"].as_str()?.to_owned(),
            v["models"]["m"]["blocks"].as_u64()?,
        ))
    }

    pub async fn wait_ready(&self, secs: u64) {
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

    pub async fn counter(&self, name: &str) -> u64 {
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
pub async fn converge(replicas: &[&Replica], min_blocks: u64, secs: u64) -> (String, u64) {
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
            // What each replica holds per worker, and its feeds' view: which one is short.
            let mut per = String::new();
            for r in replicas {
                if let Some(v) = r.get("/workers").await {
                    for w in v["workers"].as_array().into_iter().flatten() {
                        per += &format!(
                            "\n{} {} blocks={} events={}",
                            r.name, w["worker"], w["blocks"], w["events"]
                        );
                    }
                }
            }
            panic!("digests did not converge: {names:?} {ds:?}{per}");
        }
        tokio::time::sleep(Duration::from_millis(400)).await;
    }
}

/// One drain: when, and the watched process that made it (`None`: not found).
pub type Drain = (Instant, Option<u32>);

/// A TensorRT-LLM-style engine: `POST /kv_cache_events` returns every queued event and forgets
/// them (a destructive read). Each drain is recorded with the time and, among the processes
/// [`DrainEngine::watch`]ed, the one whose socket made it (found through `/proc`).
#[derive(Clone, Default)]
pub struct DrainEngine {
    queue: Arc<Mutex<Vec<Value>>>,
    /// Every drain: when, and which watched process made it.
    pub drains: Arc<Mutex<Vec<Drain>>>,
    pids: Arc<Mutex<Vec<u32>>>,
}

impl DrainEngine {
    pub async fn start(&self) -> SocketAddr {
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        let (q, drains, pids) = (self.queue.clone(), self.drains.clone(), self.pids.clone());
        let app = axum::Router::new().route(
            "/kv_cache_events",
            axum::routing::post(
                move |axum::extract::ConnectInfo(from): axum::extract::ConnectInfo<SocketAddr>| {
                    let (q, drains, pids) = (q.clone(), drains.clone(), pids.clone());
                    async move {
                        let candidates = pids.lock().unwrap().clone();
                        let who = socket_owner(from.port(), addr.port(), &candidates);
                        let drained: Vec<Value> = std::mem::take(&mut *q.lock().unwrap());
                        drains.lock().unwrap().push((Instant::now(), who));
                        Value::Array(drained).to_string()
                    }
                },
            ),
        );
        tokio::spawn(async move {
            let _ = axum::serve(l, app.into_make_service_with_connect_info::<SocketAddr>()).await;
        });
        addr
    }

    /// Attributes drains to these processes from now on.
    pub fn watch(&self, pid: u32) {
        self.pids.lock().unwrap().push(pid);
    }

    pub fn push(&self, ev: Value) {
        self.queue.lock().unwrap().push(ev);
    }

    pub fn is_drained(&self) -> bool {
        self.queue.lock().unwrap().is_empty()
    }

    /// The drains made from `from` until before `to`.
    pub fn drains_between(&self, from: Instant, to: Instant) -> Vec<Drain> {
        self.drains
            .lock()
            .unwrap()
            .iter()
            .filter(|(t, _)| *t >= from && *t < to)
            .copied()
            .collect()
    }
}

/// Names `r`'s running process (`"<name>#<pid>"`, as drains are reported) and has every engine
/// attribute drains to it.
pub fn track(engines: &[DrainEngine], r: &Replica, names: &mut HashMap<u32, String>) {
    let pid = r.pid().expect("running");
    names.insert(pid, format!("{}#{pid}", r.name));
    for e in engines {
        e.watch(pid);
    }
}

/// A stored event of a fresh two-block sequence (hashes `h`, `h + 1`) under `tenant`.
pub fn trt_stored(h: u64, tenant: &str) -> Value {
    let block = |hash: u64| {
        let toks: Vec<Value> = (0..BS as u64)
            .map(|k| json!({"token_id": (hash * 31 + k) % 50_000, "token_extra_id": 0}))
            .collect();
        json!({"type": "stored_block", "block_hash": hash, "tokens": toks, "lora_id": null, "cache_level": 0, "priority": 35, "cache_salt": fwd(tenant)})
    };
    json!({"event_id": h, "data": {"type": "stored", "parent_hash": null, "blocks": [block(h), block(h + 1)]}})
}

pub fn trt_removed(h: u64) -> Value {
    json!({"event_id": h, "data": {"type": "removed", "block_hashes": [h + 1]}})
}

/// Queues eight stored events (every fourth followed by a removal of its second block) over
/// both engines; returns the blocks they leave.
pub fn round(engines: &[DrainEngine; 2], next: &mut u64) -> u64 {
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

/// Keeps both engines busy: a `round` every 60 ms until `stop`, which returns the next event id
/// (so a final round after the faults continues the sequence).
pub struct Pusher {
    on: Arc<AtomicBool>,
    task: tokio::task::JoinHandle<u64>,
}

impl Pusher {
    pub fn start(engines: &[DrainEngine; 2]) -> Pusher {
        let on = Arc::new(AtomicBool::new(true));
        let (engines, flag) = (engines.clone(), on.clone());
        let task = tokio::spawn(async move {
            let mut next = 1_000_000u64;
            while flag.load(Ordering::SeqCst) {
                round(&engines, &mut next);
                tokio::time::sleep(Duration::from_millis(60)).await;
            }
            next
        });
        Pusher { on, task }
    }

    pub async fn stop(self) -> u64 {
        self.on.store(false, Ordering::SeqCst);
        self.task.await.expect("the pusher task ended")
    }
}

/// The process among `pids` holding the loopback TCP socket from `client_port` to
/// `server_port` (Linux `/proc`: the socket's inode in `/proc/net/tcp`, then whose fd it is).
fn socket_owner(client_port: u16, server_port: u16, pids: &[u32]) -> Option<u32> {
    let table = std::fs::read_to_string("/proc/net/tcp").ok()?;
    let want_local = format!(":{client_port:04X}");
    let want_remote = format!(":{server_port:04X}");
    let inode = table.lines().skip(1).find_map(|l| {
        let f: Vec<&str> = l.split_whitespace().collect();
        (f.len() > 9 && f[1].ends_with(&want_local) && f[2].ends_with(&want_remote))
            .then(|| f[9].to_owned())
    })?;
    let link = format!("socket:[{inode}]");
    pids.iter().copied().find(|pid| {
        std::fs::read_dir(format!("/proc/{pid}/fd"))
            .into_iter()
            .flatten()
            .flatten()
            .any(|e| std::fs::read_link(e.path()).is_ok_and(|t| t.to_string_lossy() == link))
    })
}

/// The replica whose process drained `engine` last within the last second, if any.
pub fn recent_poller(engine: &DrainEngine, names: &HashMap<u32, String>) -> Option<String> {
    let d = engine.drains.lock().unwrap();
    let (t, pid) = d.last()?;
    (t.elapsed() < Duration::from_secs(1))
        .then(|| pid.and_then(|p| names.get(&p).cloned()))
        .flatten()
}

pub async fn wait_poller(engine: &DrainEngine, names: &HashMap<u32, String>, secs: u64) -> String {
    wait_poller_among(engine, names, None, secs).await.1
}

/// Waits until one of `rs` (any process if `None`) drains `engine`; its index and name.
pub async fn wait_poller_among(
    engine: &DrainEngine,
    names: &HashMap<u32, String>,
    rs: Option<&[Replica]>,
    secs: u64,
) -> (usize, String) {
    let deadline = Instant::now() + Duration::from_secs(secs);
    loop {
        if let Some(n) = recent_poller(engine, names) {
            let Some(rs) = rs else { return (0, n) };
            // Names are "<replica>#<pid>": only the running process of a replica counts.
            if let Some(i) = rs
                .iter()
                .position(|r| r.pid().is_some_and(|p| n == format!("{}#{p}", r.name)))
            {
                return (i, n);
            }
        }
        assert!(Instant::now() < deadline, "no replica drains the engine");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Checks one engine's drain log: every drain attributed (but one per kill, made by the process
/// as it died: its descriptors were gone before the engine looked), no two processes
/// interleaving (two pollers, `probe` being the replicas' probe interval), no gap longer than
/// `max_gap`. Returns the longest gap.
pub fn check_drains(
    which: &str,
    drains: &[(Instant, Option<u32>)],
    names: &HashMap<u32, String>,
    killed: &[Instant],
    probe: Duration,
    max_gap: Duration,
) -> Duration {
    let unknown: Vec<Instant> = drains
        .iter()
        .filter(|(_, p)| p.is_none())
        .map(|(t, _)| *t)
        .collect();
    let at_a_kill = |t: &Instant| {
        killed.iter().any(|k| {
            t.saturating_duration_since(*k) < Duration::from_secs(1)
                && *t + Duration::from_secs(1) > *k
        })
    };
    assert!(
        unknown.len() <= killed.len() && unknown.iter().all(at_a_kill),
        "{which}: {} drains by an unknown process, not at a kill",
        unknown.len()
    );
    let seq: Vec<(Instant, u32)> = drains
        .iter()
        .filter_map(|(t, p)| Some((*t, (*p)?)))
        .collect();
    // Who drained, as runs: "a#12 x40, b#13 x3, ...".
    let mut runs: Vec<(u32, usize)> = Vec::new();
    for (_, p) in &seq {
        match runs.last_mut() {
            Some((q, n)) if q == p => *n += 1,
            _ => runs.push((*p, 1)),
        }
    }
    let runs: Vec<String> = runs
        .iter()
        .map(|(p, n)| format!("{} x{n}", names[p]))
        .collect();
    eprintln!("{which}: drained by {}", runs.join(", "));
    // a ... b ... a within less than the 3-interval handoff: a cannot have stopped and taken
    // the engine back in that time (a new owner waits the handoff before its first drain), so
    // both were polling.
    let window = probe * 3 - Duration::from_millis(100);
    for (i, (t0, a)) in seq.iter().enumerate() {
        let mut other = None;
        for (t, p) in &seq[i + 1..] {
            if t.duration_since(*t0) > window {
                break;
            }
            match other {
                None if p != a => other = Some(*p),
                Some(b) if p == a => panic!(
                    "{which}: {} and {} drained it at the same time",
                    names[a], names[&b]
                ),
                _ => {}
            }
        }
    }
    let gap = seq
        .windows(2)
        .map(|w| w[1].0.duration_since(w[0].0))
        .max()
        .unwrap_or_default();
    assert!(
        gap <= max_gap,
        "{which}: no poller for {gap:?} (bound {max_gap:?})"
    );
    gap
}
