//! Finding peers and knowing which are ready.
//!
//! Addresses come from `peers.static_peers`, the addresses `peers.dns` resolves to (a headless
//! Service lists every replica, ready or not), or Kubernetes EndpointSlices of `peers.service`.
//! Every probe interval each address gets a `Hello`; the reply says which instance answers
//! there (this replica recognises itself and skips its own address) and whether it is ready. A
//! peer that has not answered for four intervals (a probe waits one) is gone: it owns nothing any more.

use std::collections::{HashMap, HashSet};
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use tokio::sync::watch;
use tonic::transport::{Channel, Endpoint};

use super::ReplicaState;
use super::fence::{Fence, Heard};
use super::pb;
use super::{PeerTls, PeersConfig};
use crate::discovery::ServiceEndpoints;
use crate::metrics::Metrics;
use kv_epp_core::worker::WorkerId;

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
    /// Its claims on single-reader sources.
    pub claims: Vec<pb::Claim>,
    /// Sources it drained beyond the cut their new owner declared.
    pub diverged: Vec<String>,
    /// The single-reader sources in its pool (`None`: it does not say, so it may own any).
    /// Shared, so copying a member (`view`) does not copy the pool.
    pub sources: Option<std::sync::Arc<HashSet<String>>>,
    /// As the drain Lease's holder: until when its confirmed holding runs at the latest
    /// (measured from the start of the probe round that heard it, so never later than the
    /// holder's own bound), and to whom it delegates each source its pool lacks (worker →
    /// instance). `None` when it did not say it holds.
    pub holding: Option<(Instant, std::sync::Arc<HashMap<String, u64>>)>,
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
    /// When the last completed probe round started: leases run from there.
    last_round: Mutex<Option<Instant>>,
    /// Addresses whose replica refused this replica's token, and when it last did.
    refused: Mutex<HashMap<SocketAddr, Instant>>,
    lease: Duration,
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
            last_round: Mutex::new(None),
            refused: Mutex::new(HashMap::new()),
            lease: Duration::from_millis(config.probe_interval_ms * 5 / 2),
            stale_after: Duration::from_millis(config.probe_interval_ms * 4),
            max_message: config.max_message_bytes,
            tls,
        }
    }

    /// Adds a live list of peer addresses: the EndpointSlices of kv-epp's own Service, ready or
    /// not (a bootstrapping replica is not ready yet must be seen).
    pub(crate) fn set_discovered(&self, rx: watch::Receiver<ServiceEndpoints>) {
        *self.discovered.lock() = Some(rx);
    }

    /// Whether `m` answered recently enough, at `now`, to count as present.
    fn answered(&self, m: &Member, now: Instant) -> bool {
        now.duration_since(m.last_ok) <= self.stale_after
    }

    /// Peers that answered recently (never this replica).
    pub fn view(&self) -> Vec<Member> {
        let now = Instant::now();
        let mut v: Vec<Member> = self
            .table
            .lock()
            .values()
            .filter(|m| self.answered(m, now))
            .cloned()
            .collect();
        v.sort_by_key(|m| m.addr);
        v
    }

    /// Addresses whose replica refused this replica's token within the last four probe
    /// intervals: present, but not trusted (and they do not trust us).
    pub fn refused(&self) -> Vec<SocketAddr> {
        let now = Instant::now();
        let mut v: Vec<SocketAddr> = self
            .refused
            .lock()
            .iter()
            .filter(|(_, t)| now.duration_since(**t) <= self.stale_after)
            .map(|(a, _)| *a)
            .collect();
        v.sort();
        v
    }

    /// This replica's token is refused by a peer and accepted by none: it must not serve or own
    /// anything (it cannot tell who else drains or what they relay).
    pub fn token_refused(&self) -> bool {
        !self.refused().is_empty() && self.view().is_empty()
    }

    /// Until when a lease confirmed by the last completed probe round holds (the past if no
    /// round has completed).
    pub(crate) fn lease_until(&self) -> Instant {
        match *self.last_round.lock() {
            Some(t) => t + self.lease,
            None => Instant::now(),
        }
    }

    /// Ready peers (of [`Members::view`]) that have `worker` among their single-reader sources,
    /// or do not say which they have. Read in place under the table's lock rather than through
    /// `view`'s copies: it runs once per source each drain round.
    pub(crate) fn ready_instances(&self, worker: &str) -> Vec<u64> {
        let now = Instant::now();
        self.table
            .lock()
            .values()
            .filter(|m| self.answered(m, now) && m.ready)
            .filter(|m| m.sources.as_ref().is_none_or(|s| s.contains(worker)))
            .map(|m| m.instance)
            .collect()
    }

    /// Whether peer `instance` answered recently and its pool, as its last `Hello` listed it,
    /// lacks `worker` (false when it did not answer or does not list its pool: not known to).
    pub(crate) fn lacks(&self, instance: u64, worker: &str) -> bool {
        self.answered_by(instance, |m| {
            m.sources
                .as_ref()
                .is_some_and(|s| !s.contains(worker))
                .then_some(())
        })
        .is_some()
    }

    /// `f` of peer `instance`'s last answer, if it answered recently.
    fn answered_by<R>(&self, instance: u64, f: impl FnOnce(&Member) -> Option<R>) -> Option<R> {
        let now = Instant::now();
        let table = self.table.lock();
        let m = table
            .values()
            .find(|m| m.instance == instance && self.answered(m, now))?;
        f(m)
    }

    /// The replica to which peer `instance`, as the drain Lease's holder, delegates `worker`,
    /// and until when at the latest (its confirmed holding): from its last answer while that
    /// holding runs. `fresh`: only an answer to the last completed probe round counts (what
    /// renews or starts a delegate's drain: it then ends at most a claim lease after the last
    /// round that heard the holder, before any successor can start); otherwise any recent one
    /// (who owns the worker: one missed answer only lets a delegate's claim lapse).
    pub(crate) fn delegate(
        &self,
        instance: u64,
        worker: &str,
        fresh: bool,
    ) -> Option<(u64, Instant)> {
        let now = Instant::now();
        let last_round = *self.last_round.lock();
        self.answered_by(instance, |m| {
            if fresh && last_round.is_none_or(|r| m.last_ok < r) {
                return None;
            }
            let (until, delegates) = m.holding.as_ref()?;
            // A fresh answer lets a drain run at most a claim lease past that round's start:
            // the same round, read once here, so a round completing meanwhile cannot lend a
            // later start to an earlier answer.
            let until = match last_round {
                Some(r) if fresh => (*until).min(r + self.lease),
                _ => *until,
            };
            (now < until).then_some((*delegates.get(worker)?, until))
        })
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
    if let Some(h) = state.token().and_then(|t| t.header()) {
        req.metadata_mut().insert("authorization", h);
    }
    req
}

/// Probes every known address each interval until the task is dropped.
pub(crate) async fn probe_loop(state: Arc<ReplicaState>) {
    let interval = state.probe_interval();
    let mut tick = tokio::time::interval(interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut was_refused = false;
    loop {
        tick.tick().await;
        let round_start = Instant::now();
        let addrs = state.members.addresses().await;
        let probes = addrs.iter().map(|&addr| {
            let state = state.clone();
            async move {
                let mut client = state.members.client(addr);
                let req = authed(&state, pb::HelloRequest {});
                // One interval: a round ends within it even when a peer hangs (a paused
                // process accepts connections and answers nothing), so leases keep renewing.
                let r = tokio::time::timeout(interval, client.hello(req)).await;
                (addr, r)
            }
        });
        let results = futures_util::future::join_all(probes).await;
        // This replica's single-reader sources: peers' fences on them are always taken in.
        let pool: HashSet<WorkerId> = state.feeds.single_reader_ids().into_iter().collect();
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
                    if m.refused.lock().remove(&addr).is_some() {
                        tracing::info!(peer = %addr, "peer accepts our token again");
                    }
                    let sender_pool: Option<HashSet<String>> = reply
                        .sources_known
                        .then(|| reply.sources.iter().cloned().collect());
                    let direct = reply.claims.iter().map(|c| (Heard::Direct, c));
                    let relayed = reply
                        .fences
                        .iter()
                        .filter(|f| f.owner != 0)
                        .map(|c| (Heard::of_fence(sender_pool.as_ref(), &c.worker), c));
                    for (heard, c) in direct.chain(relayed) {
                        if let Ok(w) = c.worker.parse() {
                            let prev = (c.prev_origin != 0).then_some((c.prev_origin, c.prev_seq));
                            let owner = if c.owner == 0 {
                                reply.instance
                            } else {
                                c.owner
                            };
                            let claim = Fence {
                                epoch: c.epoch,
                                owner,
                                prev,
                            };
                            let in_pool = pool.contains(&w);
                            state
                                .hub
                                .fencing
                                .observe_claim(w, heard, in_pool, claim, c.active, now);
                        }
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
                            claims: reply.claims,
                            diverged: reply.diverged,
                            sources: reply
                                .sources_known
                                .then(|| std::sync::Arc::new(reply.sources.into_iter().collect())),
                            // The holder answered after this round began: its holding ends
                            // no earlier than this.
                            holding: (reply.holding_ms > 0).then(|| {
                                (
                                    round_start + Duration::from_millis(reply.holding_ms),
                                    std::sync::Arc::new(
                                        reply
                                            .delegations
                                            .into_iter()
                                            .map(|d| (d.worker, d.owner))
                                            .collect(),
                                    ),
                                )
                            }),
                        },
                    );
                    if prev.as_ref().map(|p| (p.instance, p.ready))
                        != Some((reply.instance, reply.ready))
                    {
                        tracing::info!(peer = %addr, ready = reply.ready, "peer state");
                    }
                }
                Ok(Err(status)) if status.code() == tonic::Code::Unauthenticated => {
                    // Present, not absent: a refused peer may be draining what we would own.
                    table.remove(&addr);
                    state.metrics.replica_refused_by_peers.inc();
                    if m.refused.lock().insert(addr, now).is_none() {
                        tracing::warn!(peer = %addr, "peer refused our token (peers.token_file differs): this replica owns no drain and is not ready while no peer accepts it");
                    }
                }
                _ => {}
            }
        }
        let g = &state.metrics.replica_peers;
        let ready = table.values().filter(|p| p.ready).count() as i64;
        let starting = table.len() as i64 - ready;
        drop(table);
        m.refused.lock().retain(|a, _| addrs.contains(a));
        // Connections to addresses no longer listed (pods replaced) are dropped, so pod churn
        // does not keep one per address ever seen (clones in use keep theirs until done).
        m.channels.lock().retain(|a, _| addrs.contains(a));
        *m.last_round.lock() = Some(round_start);
        // Leases of claims this replica still holds run from this round's start (just set as
        // the last round, which `drain_lease_until` reads): it saw every peer's claims after
        // that instant (a round that began before a pause confirms nothing).
        let view = m.view();
        for (w, c) in state.hub.fencing.claims() {
            let name = w.to_string();
            // Any peer's claim, whatever its rank: a peer that claims while we drain does not
            // see our claim and starts after its handoff, so our lease must run out before.
            let peer_claims = view
                .iter()
                .any(|p| p.claims.iter().any(|pc| pc.worker == name));
            // Under the drain Lease, its confirmed renewals extend the holder's claims
            // (`lease.rs`); a source the holder delegated is renewed here, as without a Lease,
            // from this round (never past the holding the holder reported).
            let until = match state.lease_for(&w) {
                Some(_) => None,
                None => state.drain_lease_until(&w),
            };
            if let Some(until) = until
                && c.active
                && !peer_claims
                && state.owner_of(&w) == Some(state.instance)
            {
                state.hub.fencing.renew(&w, until);
            }
        }
        // Batches of ours a later owner cut off, that we drained: we hold events nobody else
        // applied, until that owner's clear arrives.
        for (w, cut) in state.hub.fencing.cut_off() {
            if state.hub.originated_from(&w, cut) && state.hub.fencing.flag_diverged_once(w, cut) {
                tracing::warn!(worker = %w, "this replica drained events its peers refused (it was paused or cut off while it owned the worker): asking the owner to clear it");
            }
        }
        // A successor that took over without seeing our drain: peers may have refused our last
        // batches (those that reached them after its fence), so we may hold events they lack.
        for w in state.hub.fencing.flag_unnamed_successors() {
            tracing::warn!(worker = %w, "a replica took this worker's drain over without seeing this replica's (a one-way cut, or claims crossed): peers may have refused its last batches, asking the owner to clear it");
        }
        let refused = m.token_refused();
        if refused != was_refused {
            was_refused = refused;
            state.set_token_refused(refused);
        }
        g.get_or_create(&Metrics::labels(&[("state", "refused")]))
            .set(m.refused().len() as i64);
        g.get_or_create(&Metrics::labels(&[("state", "ready")]))
            .set(ready);
        g.get_or_create(&Metrics::labels(&[("state", "starting")]))
            .set(starting);
        m.rounds.fetch_add(1, Ordering::Relaxed);
    }
}
