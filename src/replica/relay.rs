//! Single-reader sources shared between replicas.
//!
//! TensorRT-LLM's `/kv_cache_events` forgets what it returns, so only one replica may poll a
//! worker: the owner, chosen by rendezvous hashing over the ready replicas. The owner applies
//! each drain to its own index and appends it, normalized, to its relay log under one lock, with
//! the next number of its own sequence; every peer streams that log (`Relay`) and applies each
//! batch once, in order: a batch below the position it holds for that origin is a duplicate and
//! skipped. Ownership moves when the ready set changes; a new owner waits three probe intervals
//! before its first poll, so the previous owner (which stops as soon as it sees the new one) has
//! relayed its last drain first. Events the owner drained are lost only if it dies before
//! relaying them; then no survivor applied them either, so survivors still agree.
//!
//! A peer that falls further behind than the log keeps (`peers.relay_log_batches`) gets a reset:
//! it drops the state of the relayed workers it does not poll itself (they go cold, as with an
//! unfillable gap in a ZeroMQ stream) and continues from the oldest batch kept.

use std::collections::{HashMap, VecDeque};
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use tokio::sync::watch;

use super::ReplicaState;
use super::members::authed;
use super::pb;
use crate::events::normalized::NormEvent;
use crate::events::trtllm::EventSink;
use crate::hashing::HashSeed;
use crate::index::{EngineBlockHash, Medium};
use crate::router::Router;
use crate::worker::WorkerId;

/// Counters of the relay.
#[derive(Debug, Default)]
pub struct RelayCounters {
    /// Batches this replica originated.
    pub originated: AtomicU64,
    /// Relayed batches applied.
    pub applied: AtomicU64,
    /// Relayed batches skipped as already applied.
    pub duplicates: AtomicU64,
    /// Streams that could not resume where they left off.
    pub resets: AtomicU64,
    /// Relayed batches naming a model or worker this replica cannot place.
    pub unplaced: AtomicU64,
}

struct HubState {
    /// Other origins → next relay sequence expected from them.
    positions: HashMap<u64, u64>,
    /// This replica's own batches, oldest first.
    log: VecDeque<Arc<pb::RelayBatch>>,
    /// The sequence of this replica's next batch.
    next_seq: u64,
}

/// The relay: this replica's log and what it applied from others.
pub struct RelayHub {
    instance: u64,
    router: Arc<Router>,
    cap: usize,
    state: Mutex<HubState>,
    /// The next sequence of the log, for streams waiting on new batches.
    tail: watch::Sender<u64>,
    /// Counters.
    pub counters: RelayCounters,
}

/// Where a relayed batch ended up.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Applied {
    /// Applied in order.
    Applied,
    /// Already applied before.
    Duplicate,
    /// Applied after a reset (state of relayed workers was dropped first).
    AfterReset,
}

impl RelayHub {
    /// An empty hub.
    pub fn new(instance: u64, router: Arc<Router>, cap: usize) -> RelayHub {
        RelayHub {
            instance,
            router,
            cap: cap.max(1),
            state: Mutex::new(HubState {
                positions: HashMap::new(),
                log: VecDeque::new(),
                next_seq: 0,
            }),
            tail: watch::channel(0).0,
            counters: RelayCounters::default(),
        }
    }

    /// Runs `f` while no relayed batch is being applied or originated; returns its result and
    /// the relay positions (this replica's own included) that the state `f` saw reflects.
    pub fn consistent<R>(&self, f: impl FnOnce() -> R) -> (R, Vec<(u64, u64)>) {
        let st = self.state.lock();
        let r = f();
        let mut pos: Vec<(u64, u64)> = st.positions.iter().map(|(o, n)| (*o, *n)).collect();
        pos.push((self.instance, st.next_seq));
        (r, pos)
    }

    /// Adopts the positions a snapshot reflects.
    pub fn set_positions(&self, positions: &[(u64, u64)]) {
        let mut st = self.state.lock();
        for &(origin, next) in positions {
            if origin != self.instance {
                st.positions.insert(origin, next);
            }
        }
    }

    /// The next sequence expected from `origin`.
    pub fn position(&self, origin: u64) -> Option<u64> {
        self.state.lock().positions.get(&origin).copied()
    }

    /// Every known position (this replica's own included), for status pages.
    pub fn positions(&self) -> Vec<(u64, u64)> {
        self.consistent(|| ()).1
    }

    fn model_of(&self, worker: &WorkerId) -> Option<String> {
        self.router
            .workers()
            .into_iter()
            .find(|w| w.id == *worker)
            .map(|w| w.model.clone())
    }

    /// Applies one drain of a source this replica owns and appends it to the log.
    pub fn originate(&self, worker: &WorkerId, events: Vec<NormEvent>) {
        let Some(model) = self.model_of(worker) else {
            self.counters.unplaced.fetch_add(1, Ordering::Relaxed);
            return;
        };
        let Some(index) = self.router.index(&model).cloned() else {
            self.counters.unplaced.fetch_add(1, Ordering::Relaxed);
            return;
        };
        let mut st = self.state.lock();
        for ev in &events {
            if let Err(e) = ev.apply(&index, worker) {
                tracing::debug!(%worker, error = %e, "owned KV event not applied");
            }
        }
        let batch = pb::RelayBatch {
            origin: self.instance,
            seq: st.next_seq,
            reset: false,
            model,
            endpoint: worker.endpoint.to_string(),
            dp_rank: worker.dp_rank,
            events: events.iter().map(to_pb).collect(),
            keepalive: false,
        };
        st.log.push_back(Arc::new(batch));
        if st.log.len() > self.cap {
            st.log.pop_front();
        }
        st.next_seq += 1;
        let next = st.next_seq;
        drop(st);
        self.counters.originated.fetch_add(1, Ordering::Relaxed);
        self.tail.send_replace(next);
    }

    /// Up to `max` logged batches from `from` on, and the sequence of the oldest kept.
    pub fn read_from(&self, from: u64, max: usize) -> (Vec<Arc<pb::RelayBatch>>, u64) {
        let st = self.state.lock();
        let oldest = st.next_seq - st.log.len() as u64;
        let skip = from.saturating_sub(oldest) as usize;
        let out = st.log.iter().skip(skip).take(max).cloned().collect();
        (out, oldest)
    }

    /// The sequence of the next batch this replica will originate.
    pub fn next_seq(&self) -> u64 {
        self.state.lock().next_seq
    }

    /// A watch of [`RelayHub::next_seq`].
    pub fn watch_tail(&self) -> watch::Receiver<u64> {
        self.tail.subscribe()
    }

    /// Applies a batch relayed by a peer, once. `not_mine`: the relayed workers whose state a
    /// reset drops (those this replica does not poll itself).
    pub fn apply_relayed(&self, b: &pb::RelayBatch, not_mine: &[WorkerId]) -> Applied {
        let mut st = self.state.lock();
        let pos = st.positions.get(&b.origin).copied();
        let in_order = match pos {
            Some(p) if b.seq < p => {
                drop(st);
                self.counters.duplicates.fetch_add(1, Ordering::Relaxed);
                return Applied::Duplicate;
            }
            Some(p) => b.seq == p && !b.reset,
            None => b.seq == 0 && !b.reset,
        };
        let outcome = if in_order {
            Applied::Applied
        } else {
            self.counters.resets.fetch_add(1, Ordering::Relaxed);
            tracing::warn!(
                expected = ?pos,
                got = b.seq,
                "relay could not resume where it left off; dropping relayed workers' state"
            );
            for w in not_mine {
                if let Some(m) = self.model_of(w)
                    && let Some(index) = self.router.index(&m)
                {
                    let _ = index.clear_worker(w);
                }
            }
            Applied::AfterReset
        };
        st.positions.insert(b.origin, b.seq + 1);
        match self.place(b) {
            Some((worker, index)) => {
                index.add_worker(worker);
                for ev in &b.events {
                    match from_pb(ev) {
                        Some(ev) => {
                            if let Err(e) = ev.apply(&index, &worker) {
                                tracing::debug!(%worker, error = %e, "relayed KV event not applied");
                            }
                        }
                        None => {
                            self.counters.unplaced.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                }
            }
            None => {
                self.counters.unplaced.fetch_add(1, Ordering::Relaxed);
            }
        }
        drop(st);
        self.counters.applied.fetch_add(1, Ordering::Relaxed);
        outcome
    }

    fn place(&self, b: &pb::RelayBatch) -> Option<(WorkerId, Arc<crate::index::KvIndex>)> {
        let endpoint: SocketAddr = b.endpoint.parse().ok()?;
        let index = self.router.index(&b.model)?.clone();
        Some((WorkerId::with_rank(endpoint, b.dp_rank), index))
    }
}

/// Drains of owned sources go through the hub.
pub struct HubSink(pub Arc<RelayHub>);

impl EventSink for HubSink {
    fn deliver(&self, worker: &WorkerId, events: Vec<NormEvent>) {
        self.0.originate(worker, events);
    }
}

fn to_pb(ev: &NormEvent) -> pb::RelayEvent {
    use pb::relay_event::Kind;
    let kind = match ev {
        NormEvent::Stored {
            parent,
            root_seed,
            engine_hashes,
            tokens,
            medium,
        } => Kind::Stored(pb::StoredEvent {
            parent: parent.map(|p| p.0),
            root_seed: root_seed.map(|s| s.0),
            engine_hashes: engine_hashes.iter().map(|h| h.0).collect(),
            tokens: tokens.clone(),
            offload: *medium == Medium::Offload,
        }),
        NormEvent::Removed {
            engine_hashes,
            tiers,
        } => Kind::Removed(pb::RemovedEvent {
            engine_hashes: engine_hashes.iter().map(|h| h.0).collect(),
            tiers: u32::from(*tiers),
        }),
        NormEvent::Cleared => Kind::Cleared(pb::ClearedEvent {}),
    };
    pb::RelayEvent { kind: Some(kind) }
}

fn from_pb(ev: &pb::RelayEvent) -> Option<NormEvent> {
    use pb::relay_event::Kind;
    Some(match ev.kind.as_ref()? {
        Kind::Stored(s) => NormEvent::Stored {
            parent: s.parent.map(EngineBlockHash),
            root_seed: s.root_seed.map(HashSeed),
            engine_hashes: s
                .engine_hashes
                .iter()
                .copied()
                .map(EngineBlockHash)
                .collect(),
            tokens: s.tokens.clone(),
            medium: if s.offload {
                Medium::Offload
            } else {
                Medium::Device
            },
        },
        Kind::Removed(r) => NormEvent::Removed {
            engine_hashes: r
                .engine_hashes
                .iter()
                .copied()
                .map(EngineBlockHash)
                .collect(),
            tiers: (r.tiers & 0b11) as u8,
        },
        Kind::Cleared(_) => NormEvent::Cleared,
    })
}

/// After bootstrap: keeps ownership of single-reader sources and relay subscriptions current.
pub async fn maintain(state: Arc<ReplicaState>) {
    let interval = state.probe_interval();
    let handoff = interval * 3;
    let mut owner_since: HashMap<WorkerId, Instant> = HashMap::new();
    let mut subs: HashMap<u64, tokio::task::JoinHandle<()>> = HashMap::new();
    let mut tick = tokio::time::interval(interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let now = Instant::now();
        let sources = state.feeds.single_readers();
        for (w, sr) in &sources {
            if state.owner_of(w) == Some(state.instance) {
                let since = *owner_since.entry(*w).or_insert(now);
                if now.duration_since(since) >= handoff && !state.feeds.is_polling(w) {
                    tracing::info!(worker = %w, "this replica now owns the worker's event drain");
                    state.feeds.poll(
                        *w,
                        sr.index.block_size(),
                        sr.interval,
                        Arc::new(HubSink(state.hub.clone())),
                    );
                }
            } else {
                owner_since.remove(w);
                if state.feeds.is_polling(w) {
                    tracing::info!(worker = %w, "another replica owns the worker's event drain now");
                    state.feeds.stop_polling(w);
                }
            }
        }
        owner_since.retain(|w, _| sources.iter().any(|(s, _)| s == w));
        subs.retain(|_, t| !t.is_finished());
        for m in state.members.view() {
            subs.entry(m.instance)
                .or_insert_with(|| tokio::spawn(subscribe(state.clone(), m.addr, m.instance)));
        }
    }
}

impl Drop for RelayHub {
    fn drop(&mut self) {
        self.tail.send_replace(u64::MAX);
    }
}

/// Streams one peer's relay log into this replica until the stream breaks.
async fn subscribe(state: Arc<ReplicaState>, addr: SocketAddr, instance: u64) {
    let from = state.hub.position(instance).unwrap_or(0);
    let mut client = state.members.client(addr);
    let req = authed(
        &state,
        pb::RelayRequest {
            origin: if state.hub.position(instance).is_some() {
                instance
            } else {
                0
            },
            from_seq: from,
        },
    );
    let mut stream = match client.relay(req).await {
        Ok(s) => s.into_inner(),
        Err(e) => {
            tracing::debug!(peer = %addr, error = %e.message(), "relay subscription refused");
            tokio::time::sleep(Duration::from_secs(1)).await;
            return;
        }
    };
    loop {
        let msg = match tokio::time::timeout(Duration::from_secs(5), stream.message()).await {
            Ok(Ok(Some(b))) => b,
            _ => return,
        };
        if msg.keepalive {
            continue;
        }
        let not_mine: Vec<WorkerId> = state
            .feeds
            .single_readers()
            .into_iter()
            .map(|(w, _)| w)
            .filter(|w| !state.feeds.is_polling(w))
            .collect();
        state.hub.apply_relayed(&msg, &not_mine);
    }
}
