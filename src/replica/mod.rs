//! Replicas: active-active kv-epp processes that hold the same index.
//!
//! - Every replica subscribes to every worker's ZeroMQ stream itself (PUB fans out), so they all
//!   apply the same ordered events; `/debug/digest` shows they agree.
//! - A starting replica is not ready until it has copied the index from a ready peer
//!   ([`snapshot`]): per worker, the blocks and the sequence they reflect; its feeds then resume
//!   from those sequences (engine replay fills the gap, or the worker goes cold).
//! - Single-reader sources (TensorRT-LLM's destructive drain) are polled by exactly one ready
//!   replica, chosen by rendezvous hashing over the ready replicas; it relays the normalized
//!   events to its peers ([`relay`]), which apply each batch once, in order.
//! - Peers are found from a static list, DNS, or Kubernetes ([`members`]) and probed with
//!   `Hello`; the API is token-authenticated and size-limited ([`service`]), and speaks mutual
//!   TLS when `peers.cert_path` is set (`crate::tls`, on both the server and the client side).
//! - With `peers.coordination: lease` the drains' owner is the holder of a Kubernetes Lease
//!   ([`lease`]) instead of the rendezvous choice among the replicas the probes see.

pub mod fence;
pub mod lease;
pub mod members;
pub mod relay;
pub mod service;
pub mod snapshot;

/// Generated messages, client and server of `proto/kvepp/replica/v1/replica.proto`.
pub mod pb {
    #![allow(missing_docs, clippy::all, clippy::pedantic)]
    tonic::include_proto!("kvepp.replica.v1");
}

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use prometheus_client::metrics::counter::Counter;
use serde::{Deserialize, Serialize};
use tonic::metadata::MetadataValue;

use crate::auth::TokenFile;

use crate::events::Feeds;
use crate::metrics::Metrics;
use crate::readiness::Readiness;
use crate::workers::Workers;
use kv_epp_core::worker::WorkerId;
use members::Members;
use relay::RelayHub;

/// Other replicas of this picker (see `ARCHITECTURE.md`, "Replicas"). Every replica subscribes
/// to every worker's event stream itself; peers serve a joining replica a snapshot of the index
/// and relay the events of single-reader sources (TensorRT-LLM) that only one replica polls.
/// Replication is on when any of `static_peers`, `dns` or `service` is set.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct PeersConfig {
    /// The Kubernetes Service whose EndpointSlices list the replicas (in `pool.namespace`).
    pub service: Option<String>,
    /// Peer API addresses (`host:port`), this replica's own included or not.
    pub static_peers: Vec<String>,
    /// A DNS name (`host:port`, e.g. a headless Service) whose addresses are the replicas.
    pub dns: Option<String>,
    /// The peer API port (`--peer-port`).
    pub port: u16,
    /// File holding the shared token peers present (`--peer-token-file`). Required when
    /// replication is on, unless `insecure_allow_anonymous` is set.
    pub token_file: Option<PathBuf>,
    /// Run the peer API without a token: anyone who reaches `port` can read the whole index
    /// (every tenant's prefixes) and feed relayed events. Off by default; start-up is refused
    /// without a token unless this is set.
    pub insecure_allow_anonymous: bool,
    /// Directory with `tls.crt`, `tls.key` and `ca.crt` (`--peer-cert-path`; the layout of a
    /// cert-manager Secret). When set the peer API speaks mutual TLS: a replica accepts only
    /// clients presenting a certificate `ca.crt` signed, and dials peers presenting its own
    /// while checking theirs against `ca.crt` and `server_name`. The files are re-read when
    /// they change.
    pub cert_path: Option<PathBuf>,
    /// The name peers' certificates must be valid for (replicas are dialled by IP). Default:
    /// `<service>.<pool.namespace>.svc` with `service`, else the host of `dns`; required with
    /// `cert_path` when peers come from `static_peers` alone.
    pub server_name: Option<String>,
    /// How long a starting replica waits for a ready peer to bootstrap from before it starts
    /// with an empty index.
    pub bootstrap_timeout_ms: u64,
    /// How often peers are probed; a peer that answered none of the last four probes is gone.
    pub probe_interval_ms: u64,
    /// Largest peer API message accepted or sent.
    pub max_message_bytes: usize,
    /// Block entries per snapshot chunk.
    pub snapshot_chunk_blocks: u32,
    /// Relayed batches a replica keeps for peers that reconnect.
    pub relay_log_batches: usize,
    /// ...and at most this many encoded bytes of them.
    pub relay_log_bytes: usize,
    /// Who decides which replica drains single-reader sources (TensorRT-LLM's HTTP drain):
    /// `lease` (a `coordination.k8s.io/v1` Lease per replica set, on Kubernetes), `probes` (the
    /// replicas' own probes and fencing), or `auto` (default): `lease` when the replicas run on
    /// Kubernetes (`peers.service` set, or InferencePool discovery on), else `probes`.
    pub coordination: Coordination,
    /// The drain Lease's name (in the pod's namespace, `pool.namespace`). Default:
    /// `<peers.service>-drains`, else `kv-epp-drains`.
    pub lease_name: Option<String>,
    /// `leaseDurationSeconds` of the drain Lease: a holder that stops renewing is replaced this
    /// long after its last renewal was seen.
    pub lease_duration_seconds: u32,
    /// How often the holder renews the drain Lease and the others read it (at most a third of
    /// the duration).
    pub lease_renew_ms: u64,
}

/// How drain ownership is decided (`peers.coordination`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Coordination {
    /// `lease` on Kubernetes (`peers.service` or pool discovery), else `probes`.
    #[default]
    Auto,
    /// A Kubernetes Lease per replica set.
    Lease,
    /// Peer probes and fencing alone.
    Probes,
}

impl Default for PeersConfig {
    fn default() -> Self {
        PeersConfig {
            service: None,
            static_peers: Vec::new(),
            dns: None,
            port: 9004,
            token_file: None,
            insecure_allow_anonymous: false,
            cert_path: None,
            server_name: None,
            bootstrap_timeout_ms: 30_000,
            probe_interval_ms: 300,
            max_message_bytes: 4 << 20,
            snapshot_chunk_blocks: 16_384,
            relay_log_batches: 65_536,
            relay_log_bytes: 256 << 20,
            coordination: Coordination::Auto,
            lease_name: None,
            lease_duration_seconds: 10,
            lease_renew_ms: 2_000,
        }
    }
}

impl PeersConfig {
    /// Whether this replica has peers to find.
    pub fn enabled(&self) -> bool {
        !self.static_peers.is_empty() || self.dns.is_some() || self.service.is_some()
    }
}

/// TLS on the peer API (`peers.cert_path`): the material, re-read when it changes, and the name
/// peers' certificates must be valid for.
#[derive(Clone, Debug)]
pub struct PeerTls {
    pub(crate) configs: Arc<crate::tls::Reloading>,
    pub(crate) name: tokio_rustls::rustls::pki_types::ServerName<'static>,
}

/// The shared peer token: fixed (tests, benches), or a file followed as it rotates (one token
/// per line, any accepted, the first presented; see [`TokenFile`]).
#[derive(Debug, Clone)]
pub enum PeerToken {
    /// One token that never changes.
    Fixed(String),
    /// `peers.token_file`.
    File(Arc<TokenFile>),
}

impl From<&str> for PeerToken {
    fn from(t: &str) -> Self {
        PeerToken::Fixed(t.to_owned())
    }
}

impl PeerToken {
    /// Whether `presented` (the token, without `Bearer `) is accepted; constant time.
    pub fn accepts(&self, presented: &str) -> bool {
        match self {
            PeerToken::Fixed(t) => {
                crate::auth::constant_time_eq(presented.as_bytes(), t.as_bytes())
            }
            PeerToken::File(f) => f.matches(presented),
        }
    }

    /// The token this replica presents.
    pub fn current(&self) -> String {
        match self {
            PeerToken::Fixed(t) => t.clone(),
            PeerToken::File(f) => f.current(),
        }
    }

    /// The `authorization` value this replica presents, or `None` if the token cannot be sent
    /// as a header (a fixed token with spaces or control bytes; token files refuse those).
    pub(crate) fn header(&self) -> Option<MetadataValue<tonic::metadata::Ascii>> {
        format!("Bearer {}", self.current()).parse().ok()
    }
}

/// Readiness condition name of the bootstrap.
pub(crate) const BOOTSTRAP: &str = "bootstrap";
/// Readiness condition name of the peer token check.
pub(crate) const PEER_TOKEN: &str = "peer_token";

/// Counters of the replica machinery: Prometheus counters (`kv_epp_replica_*`), also shown by
/// `/debug/replica`.
#[derive(Debug)]
pub struct ReplicaCounters {
    /// Snapshots served to peers.
    pub snapshots_served: Counter,
    /// Block entries restored from a peer's snapshot.
    pub blocks_restored: Counter,
    /// Encoded bytes of the snapshot messages received.
    pub snapshot_bytes: Counter,
    /// Peer calls refused for a missing or wrong token.
    pub unauthenticated: Counter,
}

impl ReplicaCounters {
    fn new(m: &Metrics) -> Self {
        ReplicaCounters {
            snapshots_served: m.replica_snapshots_served.clone(),
            blocks_restored: m.replica_blocks_restored.clone(),
            snapshot_bytes: m.replica_snapshot_bytes.clone(),
            unauthenticated: m.replica_unauthenticated.clone(),
        }
    }
}

/// This replica's side of replication.
pub struct ReplicaState {
    /// Random per process.
    pub instance: u64,
    /// The index is complete: bootstrapped, or started empty on purpose.
    ready: AtomicBool,
    /// Peers refuse this replica's token and none accepts it.
    token_refused: AtomicBool,
    /// The live workers, whose indexes are replicated.
    pub workers: Arc<Workers>,
    /// Where replication is counted.
    pub metrics: Arc<Metrics>,
    /// The event feeds.
    pub feeds: Arc<Feeds>,
    /// Settings.
    pub config: PeersConfig,
    /// The shared peer token, when one is configured.
    token: Option<PeerToken>,
    /// Mutual TLS on the peer API, server and client side, when configured.
    pub(crate) tls: Option<PeerTls>,
    /// Known peers.
    pub members: Members,
    /// The relay of single-reader sources.
    pub hub: Arc<RelayHub>,
    /// Counters.
    pub counters: ReplicaCounters,
    readiness: Readiness,
    started: Instant,
    /// The drain Lease, with `peers.coordination: lease`.
    lease: std::sync::OnceLock<Arc<lease::DrainLease>>,
    /// As the Lease's holder: the sources its pool lacks and the peer each is delegated to
    /// (set by each drain round, sent in `Hello`).
    delegations: parking_lot::Mutex<Vec<(String, u64)>>,
}

impl ReplicaState {
    /// New replica state. `token`: the shared peer token, if any; `tls`: mutual TLS for the peer
    /// API and the peer client, if any. Call before any feed starts: it holds feeds back until
    /// the bootstrap and leaves single-reader sources to their owner.
    pub fn new(
        workers: Arc<Workers>,
        metrics: Arc<Metrics>,
        feeds: Arc<Feeds>,
        config: PeersConfig,
        token: Option<PeerToken>,
        tls: Option<PeerTls>,
        readiness: Readiness,
    ) -> Result<Arc<ReplicaState>, String> {
        let instance = loop {
            let i: u64 = rand::random();
            if i != 0 {
                break i;
            }
        };
        let token = match token {
            Some(t) if t.header().is_none() || t.current().is_empty() => {
                return Err("the peer token must be printable ASCII without spaces".into());
            }
            Some(t) => Some(t),
            None => {
                tracing::warn!(
                    "no peer token configured (peers.insecure_allow_anonymous): the peer API accepts unauthenticated calls"
                );
                None
            }
        };
        readiness.set(BOOTSTRAP, false, "copying the index from a peer");
        feeds.hold();
        feeds.set_owned_elsewhere();
        let counters = ReplicaCounters::new(&metrics);
        let hub = Arc::new(RelayHub::new(
            instance,
            workers.clone(),
            &metrics,
            feeds.counters().clone(),
            config.relay_log_batches,
            config.relay_log_bytes,
            config.max_message_bytes / 2,
        ));
        Ok(Arc::new(ReplicaState {
            instance,
            ready: AtomicBool::new(false),
            token_refused: AtomicBool::new(false),
            workers,
            metrics,
            feeds,
            members: Members::new(instance, &config, tls.clone()),
            delegations: parking_lot::Mutex::new(Vec::new()),
            config,
            token,
            tls,
            hub,
            counters,
            readiness,
            started: Instant::now(),
            lease: std::sync::OnceLock::new(),
        }))
    }

    /// Whether this replica's index is complete and its peers accept it: only then does it
    /// serve, own single-reader sources, or count as ready to its peers.
    pub fn is_ready(&self) -> bool {
        self.ready.load(Ordering::Acquire) && !self.token_refused.load(Ordering::Acquire)
    }

    /// Whether peers refuse this replica's token and none accepts it.
    pub fn is_token_refused(&self) -> bool {
        self.token_refused.load(Ordering::Acquire)
    }

    fn set_ready(&self) {
        self.ready.store(true, Ordering::Release);
        self.update_ready_gauge();
        self.readiness.set(BOOTSTRAP, true, "");
    }

    fn update_ready_gauge(&self) {
        self.metrics.replica_ready.set(i64::from(self.is_ready()));
    }

    /// Records whether peers refuse this replica's token (and none accepts it); logged once per
    /// change, held in the readiness condition `peer_token`.
    pub(crate) fn set_token_refused(&self, refused: bool) {
        self.token_refused.store(refused, Ordering::Release);
        if refused {
            tracing::error!(
                "every peer that answers refuses this replica's token: not ready, and owning no single-reader source, until peers.token_file matches theirs"
            );
            self.readiness.set(
                PEER_TOKEN,
                false,
                "peers refuse this replica's token (peers.token_file)",
            );
        } else {
            tracing::info!("peers accept this replica's token again");
            self.readiness.set(PEER_TOKEN, true, "");
        }
        self.update_ready_gauge();
    }

    /// The peer token, if one is configured.
    pub fn token(&self) -> Option<&PeerToken> {
        self.token.as_ref()
    }

    /// The probe interval.
    pub(crate) fn probe_interval(&self) -> Duration {
        Duration::from_millis(self.config.probe_interval_ms)
    }

    /// Decides drain ownership through `lease` (a Kubernetes Lease) from now on instead of the
    /// probes; call before [`start`]. A second call is ignored.
    pub fn use_lease(&self, lease: Arc<lease::DrainLease>) {
        let _ = self.lease.set(lease);
    }

    /// The drain Lease, when ownership is decided by one.
    pub(crate) fn lease(&self) -> Option<&Arc<lease::DrainLease>> {
        self.lease.get()
    }

    /// The drain Lease when its holder decides who drains `worker` by draining it itself:
    /// always, unless the holder is another replica whose pool (by its last `Hello`) lacks the
    /// worker, as while a rollout changes a static `workers` list. Such a worker is drained by
    /// the peer the holder delegates it to ([`ReplicaState::delegated_until`]).
    pub(crate) fn lease_for(&self, worker: &WorkerId) -> Option<&Arc<lease::DrainLease>> {
        let l = self.lease()?;
        match l.holder() {
            Some(h) if h != self.instance && self.members.lacks(h, &worker.to_string()) => None,
            _ => Some(l),
        }
    }

    /// For a worker the Lease's holder lacks and delegates to this replica: until when at the
    /// latest this replica may drain it (the holding the holder reported in its answer to the
    /// last completed probe round, and no more than a claim lease past that round's start).
    /// `None`: the holder does not (or no longer) delegates it here, did not answer that round,
    /// or there is no such holder.
    pub(crate) fn delegated_until(&self, worker: &WorkerId) -> Option<Instant> {
        let holder = self.lease()?.holder()?;
        match self.members.delegate(holder, &worker.to_string(), true) {
            Some((d, until)) if d == self.instance => Some(until),
            _ => None,
        }
    }

    /// What this replica, as the Lease's holder, delegates (`Hello`, `/debug/replica`).
    pub(crate) fn delegations(&self) -> Vec<(String, u64)> {
        self.delegations.lock().clone()
    }

    /// Sets what this replica, as the Lease's holder, delegates.
    pub(crate) fn set_delegations(&self, d: Vec<(String, u64)>) {
        *self.delegations.lock() = d;
    }

    /// Until when a claim on `worker` activated now may drain: the drain Lease's confirmed
    /// holding; for a worker the holder delegated here, the holding it reported, and no longer
    /// than the last completed probe round confirms; without a Lease, what that round confirms.
    /// `None`: not now.
    pub(crate) fn drain_lease_until(&self, worker: &WorkerId) -> Option<Instant> {
        match (self.lease(), self.lease_for(worker)) {
            (_, Some(l)) => l.held_until(Instant::now()),
            (Some(_), None) => self.delegated_until(worker),
            (None, None) => Some(self.members.lease_until()),
        }
    }

    /// The replica that owns a single-reader source: under the drain Lease, its holder (this
    /// one only while ready and its holding is confirmed), or for a worker the holder lacks,
    /// the peer its last answer delegates it to while its holding runs (none otherwise);
    /// without a Lease, the highest rendezvous weight among the ready replicas that have the
    /// source in their pool (this one included when ready: it is only asked about its own
    /// sources). `None` when no replica is known to.
    pub(crate) fn owner_of(&self, worker: &WorkerId) -> Option<u64> {
        if let Some(l) = self.lease() {
            if self.lease_for(worker).is_none() {
                let holder = l.holder()?;
                return self
                    .members
                    .delegate(holder, &worker.to_string(), false)
                    .map(|(d, _)| d)
                    .filter(|&d| d != self.instance || self.is_ready());
            }
            if self.is_ready() && l.held_until(Instant::now()).is_some() {
                return Some(self.instance);
            }
            return l.holder().filter(|&h| h != self.instance);
        }
        // Only replicas whose pool has the worker: one without it would never drain it.
        let mut ready = self.members.ready_instances(&worker.to_string());
        if self.is_ready() {
            ready.push(self.instance);
        }
        ready
            .into_iter()
            .max_by_key(|&i| (rendezvous(i, worker), i))
    }
}

/// Rendezvous weight of a replica for a worker.
pub(crate) fn rendezvous(instance: u64, worker: &WorkerId) -> u64 {
    let mut buf = [0u8; 30];
    buf[..8].copy_from_slice(&instance.to_le_bytes());
    buf[8..].copy_from_slice(&worker.key_bytes());
    xxhash_rust::xxh3::xxh3_64(&buf)
}

/// Starts replication: holds feeds back, serves the peer API on `listener`, probes peers,
/// bootstraps, then relays and polls owned single-reader sources; re-reads the peer TLS files
/// when they change. Tasks end when `stop` fires.
pub fn start(
    state: Arc<ReplicaState>,
    listener: tokio::net::TcpListener,
    stop: tokio::sync::watch::Receiver<bool>,
) -> Vec<tokio::task::JoinHandle<()>> {
    let mut tasks = vec![
        tokio::spawn(service::serve(state.clone(), listener, stop.clone())),
        tokio::spawn(until_stopped(
            members::probe_loop(state.clone()),
            stop.clone(),
        )),
    ];
    if let Some(lease) = state.lease().cloned() {
        tasks.push(tokio::spawn(lease::run_until_stopped(
            state.clone(),
            lease,
            stop.clone(),
        )));
    }
    if let Some(tls) = &state.tls {
        tasks.push(tokio::spawn(crate::tls::watch(
            tls.configs.clone(),
            stop.clone(),
        )));
    }
    tasks.push(tokio::spawn(until_stopped(run(state), stop)));
    tasks
}

async fn until_stopped(
    f: impl std::future::Future<Output = ()>,
    mut stop: tokio::sync::watch::Receiver<bool>,
) {
    tokio::select! {
        _ = f => {}
        _ = stop.wait_for(|s| *s) => {}
    }
}

/// Bootstraps, then keeps ownership and relay subscriptions current.
async fn run(state: Arc<ReplicaState>) {
    bootstrap(&state).await;
    relay::maintain(state).await;
}

/// Copies the index from a ready peer, or decides to start empty; releases the feeds either way.
async fn bootstrap(state: &Arc<ReplicaState>) {
    let deadline = state.started + Duration::from_millis(state.config.bootstrap_timeout_ms);
    let interval = state.probe_interval();
    // Give discovery and the first probes a moment before concluding there is nobody.
    let settle = state.started + interval * 4;
    loop {
        // With Kubernetes discovery, the workers must be known before their state is copied
        // (a snapshot's workers this replica does not run are skipped).
        let discovering = state
            .readiness
            .unmet()
            .iter()
            .any(|(n, _)| *n == crate::discovery::READINESS_CONDITION);
        if discovering && Instant::now() < deadline {
            tokio::time::sleep(interval).await;
            continue;
        }
        let view = state.members.view();
        for peer in view.iter().filter(|p| p.ready) {
            match snapshot::fetch(state, peer.addr).await {
                Ok(done) => {
                    tracing::info!(
                        peer = %peer.addr,
                        workers = done.workers,
                        blocks = done.blocks,
                        "bootstrapped the index from a peer"
                    );
                    state.hub.set_positions(&done.relay_positions);
                    state.feeds.release(&done.next_seqs);
                    state.set_ready();
                    return;
                }
                Err(e) => {
                    tracing::warn!(peer = %peer.addr, error = %e, "bootstrap from peer failed");
                }
            }
        }
        let now = Instant::now();
        let reachable: Vec<u64> = view.iter().map(|p| p.instance).collect();
        let why = if now >= deadline {
            Some("no ready peer before peers.bootstrap_timeout_ms; starting with an empty index")
        } else if now >= settle
            && reachable.is_empty()
            && state.members.refused().is_empty()
            && view_settled(state)
        {
            Some("no peer reachable: first replica, starting with an empty index")
        } else if now >= settle
            && !reachable.is_empty()
            && view.iter().all(|p| !p.ready)
            && reachable.iter().all(|&i| state.instance < i)
        {
            Some("no peer is ready yet and this replica is first among them: starting empty")
        } else {
            None
        };
        if let Some(why) = why {
            if now >= deadline {
                tracing::warn!("{why}");
            } else {
                tracing::info!("{why}");
            }
            state.feeds.release(&HashMap::new());
            state.set_ready();
            return;
        }
        tokio::time::sleep(interval).await;
    }
}

/// Whether peer discovery has listed its sources and probed them twice.
fn view_settled(state: &ReplicaState) -> bool {
    state.members.discovery_listed() && state.members.rounds() >= 2
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rendezvous_moves_only_the_lost_replicas_workers() {
        let workers: Vec<WorkerId> = (0..200)
            .map(|i| {
                WorkerId::new(
                    format!("10.0.{}.{}:8000", i / 250, i % 250)
                        .parse()
                        .unwrap(),
                )
            })
            .collect();
        let owner = |set: &[u64], w: &WorkerId| {
            *set.iter().max_by_key(|&&i| (rendezvous(i, w), i)).unwrap()
        };
        let three = [11u64, 22, 33];
        let two = [11u64, 33];
        let mut per = HashMap::new();
        for w in &workers {
            let before = owner(&three, w);
            *per.entry(before).or_insert(0) += 1;
            let after = owner(&two, w);
            if before != 22 {
                assert_eq!(before, after, "a surviving owner keeps its workers");
            } else {
                assert_ne!(after, 22);
            }
        }
        // Spread: every replica owns a fair share.
        assert!(per.values().all(|&n| n > 40), "{per:?}");
    }
}
