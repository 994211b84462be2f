//! Finding peers and knowing which are ready.
//!
//! Addresses come from `peers.static_peers`, the addresses `peers.dns` resolves to (a headless
//! Service lists every replica, ready or not), or Kubernetes EndpointSlices of `peers.service`.
//! Every probe interval each address gets a `Hello`; the reply says which instance answers
//! there (this replica recognises itself and skips its own address) and whether it is ready. A
//! peer that has not answered for three intervals is gone: it owns nothing any more.

use std::collections::{HashMap, HashSet};
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use tokio::sync::watch;
use tonic::transport::{Channel, Endpoint};

use super::ReplicaState;
use super::pb;
use super::{PeerTls, PeersConfig};
use crate::discovery::ServiceEndpoints;
use crate::metrics::Metrics;

/// A peer as last probed.
#[derive(Clone, Debug)]
pub struct Member {
    /// Its peer API address.
    pub addr: SocketAddr,
    /// Its instance id.
    pub instance: u64,
    /// Whether its index is complete.
    pub ready: bool,
    /// When it last answered.
    pub last_ok: Instant,
    /// The single-reader sources it polls (as `ip:port#rank` strings).
    pub polling: Vec<String>,
    /// The relay sequence of its next own batch.
    pub relay_next: u64,
}

/// The peer table.
pub struct Members {
    own: u64,
    static_peers: Vec<String>,
    dns: Option<String>,
    discovered: Mutex<Option<watch::Receiver<ServiceEndpoints>>>,
    table: Mutex<HashMap<SocketAddr, Member>>,
    own_addrs: Mutex<HashSet<SocketAddr>>,
    channels: Mutex<HashMap<SocketAddr, Channel>>,
    rounds: AtomicU64,
    stale_after: Duration,
    max_message: usize,
    tls: Option<PeerTls>,
}

impl Members {
    /// An empty table for this replica; peers are dialled over `tls` when given.
    pub fn new(own: u64, config: &PeersConfig, tls: Option<PeerTls>) -> Members {
        Members {
            own,
            static_peers: config.static_peers.clone(),
            dns: config.dns.clone(),
            discovered: Mutex::new(None),
            table: Mutex::new(HashMap::new()),
            own_addrs: Mutex::new(HashSet::new()),
            channels: Mutex::new(HashMap::new()),
            rounds: AtomicU64::new(0),
            stale_after: Duration::from_millis(config.probe_interval_ms * 3),
            max_message: config.max_message_bytes,
            tls,
        }
    }

    /// Adds a live list of peer addresses: the EndpointSlices of kv-epp's own Service, ready or
    /// not (a bootstrapping replica is not ready yet must be seen).
    pub(crate) fn set_discovered(&self, rx: watch::Receiver<ServiceEndpoints>) {
        *self.discovered.lock() = Some(rx);
    }

    /// Peers that answered recently (never this replica).
    pub fn view(&self) -> Vec<Member> {
        let now = Instant::now();
        let mut v: Vec<Member> = self
            .table
            .lock()
            .values()
            .filter(|m| now.duration_since(m.last_ok) <= self.stale_after)
            .cloned()
            .collect();
        v.sort_by_key(|m| m.addr);
        v
    }

    /// Instances of the ready peers.
    pub(crate) fn ready_instances(&self) -> Vec<u64> {
        self.view()
            .into_iter()
            .filter(|m| m.ready)
            .map(|m| m.instance)
            .collect()
    }

    /// The address a peer instance answers on.
    pub fn addr_of(&self, instance: u64) -> Option<SocketAddr> {
        self.view()
            .into_iter()
            .find(|m| m.instance == instance)
            .map(|m| m.addr)
    }

    /// Whether the live address list (if any) has been listed at least once.
    pub(crate) fn discovery_listed(&self) -> bool {
        self.discovered
            .lock()
            .as_ref()
            .is_none_or(|rx| rx.borrow().listed)
    }

    /// Completed probe rounds.
    pub(crate) fn rounds(&self) -> u64 {
        self.rounds.load(Ordering::Relaxed)
    }

    /// A client for a peer (connections are made lazily and kept).
    pub fn client(&self, addr: SocketAddr) -> pb::replica_client::ReplicaClient<Channel> {
        let channel = self
            .channels
            .lock()
            .entry(addr)
            .or_insert_with(|| {
                // http:// even with TLS: the connector below tonic does the handshake.
                let endpoint = Endpoint::from_shared(format!("http://{addr}"))
                    .expect("a socket address makes a valid URI")
                    .connect_timeout(Duration::from_secs(1))
                    .tcp_nodelay(true)
                    .http2_keep_alive_interval(Duration::from_secs(5))
                    .keep_alive_timeout(Duration::from_secs(5));
                match &self.tls {
                    Some(tls) => endpoint.connect_with_connector_lazy(
                        crate::tls::connect::Connector::new(tls.configs.clone(), tls.name.clone()),
                    ),
                    None => endpoint.connect_lazy(),
                }
            })
            .clone();
        pb::replica_client::ReplicaClient::new(channel)
            .max_decoding_message_size(self.max_message)
            .max_encoding_message_size(self.max_message)
    }

    async fn addresses(&self) -> Vec<SocketAddr> {
        let mut out = HashSet::new();
        // Resolved together and with a deadline: one slow name must not stall the probe round
        // (every peer would look gone and this replica would take over every source).
        let lookups = self
            .static_peers
            .iter()
            .chain(self.dns.iter())
            .map(|name| async move {
                let r = tokio::time::timeout(
                    Duration::from_secs(1),
                    tokio::net::lookup_host(name.as_str()),
                )
                .await;
                (name, r)
            });
        for (name, r) in futures_util::future::join_all(lookups).await {
            match r {
                Ok(Ok(addrs)) => out.extend(addrs),
                Ok(Err(e)) => {
                    tracing::debug!(peer = %name, error = %e, "peer address did not resolve")
                }
                Err(_) => tracing::debug!(peer = %name, "peer address lookup timed out"),
            }
        }
        if let Some(rx) = self.discovered.lock().as_ref() {
            let eps = rx.borrow();
            out.extend(eps.ready.iter().chain(&eps.not_ready).copied());
        }
        let own = self.own_addrs.lock();
        out.retain(|a| !own.contains(a));
        out.into_iter().collect()
    }
}

/// A request carrying the peer token.
pub(crate) fn authed<T>(state: &ReplicaState, msg: T) -> tonic::Request<T> {
    let mut req = tonic::Request::new(msg);
    if let Some(t) = state.token() {
        req.metadata_mut().insert("authorization", t.clone());
    }
    req
}

/// Probes every known address each interval until the task is dropped.
pub(crate) async fn probe_loop(state: Arc<ReplicaState>) {
    let interval = state.probe_interval();
    let mut tick = tokio::time::interval(interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let addrs = state.members.addresses().await;
        let probes = addrs.iter().map(|&addr| {
            let state = state.clone();
            async move {
                let mut client = state.members.client(addr);
                let req = authed(&state, pb::HelloRequest {});
                let r = tokio::time::timeout(interval * 2, client.hello(req)).await;
                (addr, r)
            }
        });
        let results = futures_util::future::join_all(probes).await;
        let m = &state.members;
        let now = Instant::now();
        let mut table = m.table.lock();
        table.retain(|a, _| addrs.contains(a));
        for (addr, r) in results {
            match r {
                Ok(Ok(reply)) => {
                    let reply = reply.into_inner();
                    if reply.instance == m.own {
                        m.own_addrs.lock().insert(addr);
                        table.remove(&addr);
                        continue;
                    }
                    let prev = table.insert(
                        addr,
                        Member {
                            addr,
                            instance: reply.instance,
                            ready: reply.ready,
                            last_ok: now,
                            polling: reply.polling,
                            relay_next: reply.relay_next,
                        },
                    );
                    if prev.as_ref().map(|p| (p.instance, p.ready))
                        != Some((reply.instance, reply.ready))
                    {
                        tracing::info!(peer = %addr, ready = reply.ready, "peer state");
                    }
                }
                Ok(Err(status)) if status.code() == tonic::Code::Unauthenticated => {
                    tracing::warn!(peer = %addr, "peer refused our token");
                }
                _ => {}
            }
        }
        let ready = table.values().filter(|p| p.ready).count() as i64;
        let starting = table.len() as i64 - ready;
        drop(table);
        let g = &state.metrics.replica_peers;
        g.get_or_create(&Metrics::labels(&[("state", "ready")]))
            .set(ready);
        g.get_or_create(&Metrics::labels(&[("state", "starting")]))
            .set(starting);
        m.rounds.fetch_add(1, Ordering::Relaxed);
    }
}
