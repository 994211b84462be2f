//! Single-reader sources shared between replicas.
//!
//! TensorRT-LLM's `/kv_cache_events` forgets what it returns, so only one replica may poll a
//! worker: the owner, chosen by rendezvous hashing over the ready replicas. The owner applies
//! each drain to its own index and appends it, normalized, to its relay log under one lock, with
//! the next number of its own sequence; every peer streams that log (`Relay`) and applies each
//! batch once, in order: a batch below the position it holds for that origin is a duplicate and
//! skipped. Ownership moves when the ready set changes; a new owner waits three probe intervals
//! before its first poll, so the previous owner (which stops as soon as it sees the new one) has
//! relayed its last drain first; on top of that it polls only once no ready peer reports polling
//! the worker and it has applied everything each ready peer had originated at that probe. A
//! poller that loses ownership finishes its drain in flight (the engine already forgot it) and
//! relays it before stopping.
//!
//! When an origin dies, survivors may each have received a different prefix of its stream: every
//! replica keeps the tail of what it applied from each origin, and when an origin disappears each
//! survivor asks its live peers for that origin's batches beyond its own position (`Relay` with
//! `of_origin`), so all survivors end at the longest prefix anyone received. Events the owner
//! drained but relayed to nobody are lost with it, and no survivor applied them.
//!
//! Drains larger than half the peer message limit are split (a long stored sequence continues
//! from its last block through `parent`), so a batch always fits a message. The log is bounded by
//! `peers.relay_log_batches` and `peers.relay_log_bytes`. A peer that falls further behind gets a
//! reset: it drops the state of the workers that origin relayed (they go cold, as with an
//! unfillable gap in a ZeroMQ stream) and continues from the oldest batch kept.

use std::collections::{HashMap, HashSet, VecDeque};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use prost::Message;
use tokio::sync::watch;

use super::ReplicaState;
use super::fence::{FORGET_AFTER, Fencing, Ticket, Verdict};
use super::members::authed;
use super::pb;
use crate::events::SingleReader;
use crate::events::trtllm::EventSink;
use crate::metrics::Metrics;
use crate::workers::Workers;
use kv_epp_core::engine_event::{self, EngineEvent, EventCounters, StoredRun};
use kv_epp_core::hashing::HashSeed;
use kv_epp_core::index::{EngineBlockHash, Medium};
use kv_epp_core::worker::WorkerId;
use prometheus_client::metrics::counter::Counter;

/// Counters of the relay: `kv_epp_replica_relay_batches{kind}`, also shown by `/debug/replica`.
#[derive(Debug)]
pub struct RelayCounters {
    /// Batches this replica originated.
    pub originated: Counter,
    /// Relayed batches applied.
    pub applied: Counter,
    /// Relayed batches skipped as already applied.
    pub duplicates: Counter,
    /// Streams that could not resume where they left off.
    pub resets: Counter,
    /// Relayed batches naming a model or worker this replica cannot place.
    pub unplaced: Counter,
    /// Batches of vanished origins obtained from surviving peers.
    pub caught_up: Counter,
    /// Relayed (or own) batches refused: drained under a superseded ownership epoch.
    pub fenced: Counter,
    /// Batches a peer streamed under another origin than its own (its stream carries only its
    /// own log), dropped.
    pub foreign: Counter,
}

impl RelayCounters {
    fn new(m: &Metrics) -> Self {
        let kind = |k: &str| {
            m.replica_relay_batches
                .get_or_create(&Metrics::labels(&[("kind", k)]))
                .clone()
        };
        RelayCounters {
            originated: kind("originated"),
            applied: kind("applied"),
            duplicates: kind("duplicate"),
            resets: kind("reset"),
            unplaced: kind("unplaced"),
            caught_up: kind("caught_up"),
            fenced: kind("fenced"),
            foreign: kind("foreign"),
        }
    }
}

/// Batches kept per other origin for survivors' catch-up.
const RELAYED_TAIL: usize = 1024;
/// Most batches one catch-up answer carries (and a catch-up reads from one peer).
pub(crate) const CATCH_UP_MAX: usize = 4096;
/// How long one catch-up pass may take over all peers.
const CATCH_UP_DEADLINE: Duration = Duration::from_secs(3);
/// Other origins whose tails are kept.
const RELAYED_ORIGINS: usize = 16;

struct HubState {
    /// Other origins → next relay sequence expected from them.
    positions: HashMap<u64, u64>,
    /// This replica's own batches, oldest first, and their encoded bytes.
    log: VecDeque<Arc<pb::RelayBatch>>,
    log_bytes: usize,
    /// The sequence of this replica's next batch.
    next_seq: u64,
    /// The tail of what was applied from each other origin (oldest origins evicted first).
    relayed: HashMap<u64, VecDeque<Arc<pb::RelayBatch>>>,
    relayed_order: VecDeque<u64>,
    /// The workers each origin relayed: what a reset of that origin drops.
    origin_workers: HashMap<u64, HashSet<WorkerId>>,
    /// When each other origin last gave this replica a position (a batch, or a snapshot's
    /// positions): origins gone for [`FORGET_AFTER`] are forgotten ([`RelayHub::forget_origins`]).
    heard: HashMap<u64, Instant>,
}

/// The relay: this replica's log and what it applied from others.
pub struct RelayHub {
    instance: u64,
    workers: Arc<Workers>,
    cap: usize,
    cap_bytes: usize,
    max_batch_bytes: usize,
    state: Mutex<HubState>,
    /// The next sequence of the log, for streams waiting on new batches.
    tail: watch::Sender<u64>,
    /// Counters.
    pub counters: RelayCounters,
    /// The replica's engine-event counters (shared with its feeds), counted by the writer.
    events: Arc<EventCounters>,
    /// Ownership claims, leases and fences of single-reader sources.
    pub(crate) fencing: Fencing,
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
    /// An empty hub keeping up to `cap` batches and `cap_bytes` bytes of its own, with batches of
    /// at most `max_batch_bytes` encoded. Events it applies are counted in `events`.
    pub fn new(
        instance: u64,
        workers: Arc<Workers>,
        metrics: &Metrics,
        events: Arc<EventCounters>,
        cap: usize,
        cap_bytes: usize,
        max_batch_bytes: usize,
    ) -> RelayHub {
        let counters = RelayCounters::new(metrics);
        RelayHub {
            instance,
            workers,
            cap: cap.max(1),
            cap_bytes,
            max_batch_bytes: max_batch_bytes.max(1024),
            state: Mutex::new(HubState {
                positions: HashMap::new(),
                log: VecDeque::new(),
                log_bytes: 0,
                next_seq: 0,
                relayed: HashMap::new(),
                relayed_order: VecDeque::new(),
                origin_workers: HashMap::new(),
                heard: HashMap::new(),
            }),
            tail: watch::channel(0).0,
            counters,
            events,
            fencing: Fencing::new(
                instance,
                metrics.replica_epochs_refused.clone(),
                metrics.replica_claims_untracked.clone(),
            ),
        }
    }

    /// Runs `f` while no relayed batch is being applied or originated; returns its result and
    /// the relay positions (this replica's own included) that the state `f` saw reflects.
    pub(crate) fn consistent<R>(&self, f: impl FnOnce() -> R) -> (R, Vec<(u64, u64)>) {
        let st = self.state.lock();
        let r = f();
        let mut pos: Vec<(u64, u64)> = st.positions.iter().map(|(o, n)| (*o, *n)).collect();
        pos.push((self.instance, st.next_seq));
        (r, pos)
    }

    /// Adopts the positions a snapshot reflects.
    pub(crate) fn set_positions(&self, positions: &[(u64, u64)]) {
        let mut st = self.state.lock();
        let now = Instant::now();
        for &(origin, next) in positions {
            if origin != self.instance {
                st.positions.insert(origin, next);
                st.heard.insert(origin, now);
            }
        }
    }

    /// Forgets every other origin `keep` does not name (a live peer, or one being caught up
    /// on) that has given nothing since `now - after`: its position, the tail of its batches
    /// and the workers it relayed. Each replica start is a new origin, so without this the
    /// hub would keep an entry per restart of every peer for as long as it runs. Should a
    /// forgotten origin ever stream again, its first batch is a first contact (applied after a
    /// reset that has nothing left to drop), as after a bootstrap. Returns how many it forgot.
    pub(crate) fn forget_origins(
        &self,
        keep: impl Fn(u64) -> bool,
        now: Instant,
        after: Duration,
    ) -> usize {
        let mut st = self.state.lock();
        let st = &mut *st;
        let quiet = |origin: &u64| {
            !keep(*origin)
                && st
                    .heard
                    .get(origin)
                    .is_none_or(|t| now.saturating_duration_since(*t) >= after)
        };
        let gone: HashSet<u64> = st
            .positions
            .keys()
            .chain(st.origin_workers.keys())
            .chain(st.relayed.keys())
            .filter(|o| quiet(o))
            .copied()
            .collect();
        for origin in &gone {
            st.positions.remove(origin);
            st.origin_workers.remove(origin);
            st.relayed.remove(origin);
            st.heard.remove(origin);
        }
        st.relayed_order.retain(|o| !gone.contains(o));
        gone.len()
    }

    /// The next sequence expected from `origin`.
    pub fn position(&self, origin: u64) -> Option<u64> {
        self.state.lock().positions.get(&origin).copied()
    }

    /// Every known position (this replica's own included), for status pages.
    pub(crate) fn positions(&self) -> Vec<(u64, u64)> {
        self.consistent(|| ()).1
    }

    /// Applies one drain of a source this replica owns and appends it to the log (split into
    /// batches that fit a peer message).
    pub(crate) fn originate(&self, worker: &WorkerId, ticket: Ticket, events: Vec<EngineEvent>) {
        let Some((model, index)) = self.workers.worker_index(worker) else {
            self.counters.unplaced.inc();
            return;
        };
        let mut st = self.state.lock();
        // A drain that began just before this replica learned of a successor: every peer refuses
        // it, so this replica does too (the events are lost, but everywhere alike).
        if !self
            .fencing
            .accept_batch(*worker, self.instance, st.next_seq, ticket)
        {
            drop(st);
            self.counters.fenced.inc();
            tracing::warn!(%worker, epoch = ticket.epoch, "a drain under a superseded ownership epoch was dropped");
            return;
        }
        for ev in &events {
            if let Err(e) = engine_event::apply(&index, worker, ev, &self.events) {
                tracing::debug!(%worker, error = %e, "owned KV event not applied");
            }
        }
        if events.iter().any(|e| matches!(e, EngineEvent::Cleared)) {
            self.fencing.set_diverged(*worker, false);
            self.fencing
                .note_cleared(*worker, ticket.epoch, self.instance);
        }
        for events in split(events, self.max_batch_bytes) {
            let batch = pb::RelayBatch {
                origin: self.instance,
                seq: st.next_seq,
                reset: false,
                model: model.clone(),
                endpoint: worker.endpoint.to_string(),
                dp_rank: worker.dp_rank,
                events,
                keepalive: false,
                epoch: ticket.epoch,
                prev_origin: ticket.prev.map_or(0, |p| p.0),
                prev_seq: ticket.prev.map_or(0, |p| p.1),
            };
            st.log_bytes += batch.encoded_len();
            st.log.push_back(Arc::new(batch));
            while st.log.len() > 1 && (st.log.len() > self.cap || st.log_bytes > self.cap_bytes) {
                if let Some(old) = st.log.pop_front() {
                    st.log_bytes -= old.encoded_len();
                }
            }
            st.next_seq += 1;
            self.counters.originated.inc();
        }
        let next = st.next_seq;
        drop(st);
        self.tail.send_replace(next);
    }

    /// The batches of another origin this replica applied, from `from` on (what it keeps).
    pub(crate) fn read_origin(&self, origin: u64, from: u64) -> Vec<Arc<pb::RelayBatch>> {
        let st = self.state.lock();
        st.relayed
            .get(&origin)
            .map(|q| q.iter().filter(|b| b.seq >= from).cloned().collect())
            .unwrap_or_default()
    }

    /// The batches of `origin` this replica holds from `from` on, at most `max`: its own log
    /// when `origin` is this replica, else the tail it applied (a catch-up answer: finite).
    pub(crate) fn read_for_catch_up(
        &self,
        origin: u64,
        from: u64,
        max: usize,
    ) -> Vec<Arc<pb::RelayBatch>> {
        if origin == self.instance {
            return self.read_from(from, max).0;
        }
        let mut v = self.read_origin(origin, from);
        v.truncate(max);
        v
    }

    /// Up to `max` logged batches from `from` on, and the sequence of the oldest kept.
    pub(crate) fn read_from(&self, from: u64, max: usize) -> (Vec<Arc<pb::RelayBatch>>, u64) {
        let st = self.state.lock();
        let oldest = st.next_seq - st.log.len() as u64;
        let skip = from.saturating_sub(oldest) as usize;
        let out = st.log.iter().skip(skip).take(max).cloned().collect();
        (out, oldest)
    }

    /// Whether this replica's log holds a batch of its own for `worker` at or beyond `seq`.
    pub(crate) fn originated_from(&self, worker: &WorkerId, seq: u64) -> bool {
        let (endpoint, rank) = (worker.endpoint.to_string(), worker.dp_rank);
        self.state
            .lock()
            .log
            .iter()
            .rev()
            .take_while(|b| b.seq >= seq)
            .any(|b| b.endpoint == endpoint && b.dp_rank == rank)
    }

    /// The sources `origin` relayed to this replica.
    pub(crate) fn origin_workers(&self, origin: u64) -> HashSet<WorkerId> {
        self.state
            .lock()
            .origin_workers
            .get(&origin)
            .cloned()
            .unwrap_or_default()
    }

    /// The sequence of the next batch this replica will originate.
    pub fn next_seq(&self) -> u64 {
        self.state.lock().next_seq
    }

    /// A watch of [`RelayHub::next_seq`].
    pub(crate) fn watch_tail(&self) -> watch::Receiver<u64> {
        self.tail.subscribe()
    }

    /// Applies a batch relayed by a peer, once. `mine`: the workers this replica polls itself
    /// (a reset never drops them).
    pub(crate) fn apply_relayed(&self, b: &pb::RelayBatch, mine: &[WorkerId]) -> Applied {
        let mut st = self.state.lock();
        let pos = st.positions.get(&b.origin).copied();
        let in_order = match pos {
            // A position at the end of the range (only a hostile peer gets there) admits
            // nothing more: a batch at `u64::MAX` would otherwise match it again and again.
            Some(p) if b.seq < p || p == u64::MAX => {
                drop(st);
                self.counters.duplicates.inc();
                return Applied::Duplicate;
            }
            Some(p) => b.seq == p && !b.reset,
            None => b.seq == 0 && !b.reset,
        };
        let outcome = if in_order {
            Applied::Applied
        } else {
            self.counters.resets.inc();
            tracing::warn!(
                expected = ?pos,
                got = b.seq,
                "relay could not resume where it left off; dropping the state of that origin's workers"
            );
            for w in st.origin_workers.remove(&b.origin).unwrap_or_default() {
                if mine.contains(&w) {
                    continue;
                }
                if let Some((_, index)) = self.workers.worker_index(&w) {
                    let _ = index.clear_worker(&w);
                }
            }
            Applied::AfterReset
        };
        st.positions.insert(b.origin, b.seq.saturating_add(1));
        st.heard.insert(b.origin, Instant::now());
        let placed = self.place(b);
        if let Some((worker, _)) = &placed {
            let ticket = Ticket {
                epoch: b.epoch,
                prev: (b.prev_origin != 0).then_some((b.prev_origin, b.prev_seq)),
            };
            match self.fencing.judge_batch(*worker, b.origin, b.seq, ticket) {
                Verdict::Accepted => {}
                Verdict::Superseded => {
                    drop(st);
                    self.counters.fenced.inc();
                    tracing::debug!(%worker, epoch = b.epoch, "relayed batch of a superseded ownership epoch refused");
                    return outcome;
                }
                // Counted (and logged once) by the fencing.
                Verdict::OutOfRange => return outcome,
            }
        }
        match placed {
            Some((worker, index)) => {
                st.origin_workers
                    .entry(b.origin)
                    .or_default()
                    .insert(worker);
                if b.events
                    .iter()
                    .any(|e| matches!(e.kind, Some(pb::relay_event::Kind::Cleared(_))))
                {
                    self.fencing.set_diverged(worker, false);
                    self.fencing.note_cleared(worker, b.epoch, b.origin);
                }
                for ev in &b.events {
                    match from_pb(ev) {
                        Some(ev) => {
                            if let Err(e) = engine_event::apply(&index, &worker, &ev, &self.events)
                            {
                                tracing::debug!(%worker, error = %e, "relayed KV event not applied");
                            }
                        }
                        None => {
                            self.counters.unplaced.inc();
                        }
                    }
                }
            }
            None => {
                self.counters.unplaced.inc();
            }
        }
        if !st.relayed.contains_key(&b.origin) {
            st.relayed_order.push_back(b.origin);
            while st.relayed_order.len() > RELAYED_ORIGINS {
                if let Some(old) = st.relayed_order.pop_front() {
                    st.relayed.remove(&old);
                }
            }
        }
        let tail = st.relayed.entry(b.origin).or_default();
        tail.push_back(Arc::new(b.clone()));
        if tail.len() > RELAYED_TAIL {
            tail.pop_front();
        }
        drop(st);
        self.counters.applied.inc();
        outcome
    }

    /// The worker and index a relayed batch is for: only workers this replica runs (a batch
    /// for a worker that left, or that discovery has not listed yet, is skipped and counted:
    /// at worst under-credit, never stale credit for a reused address).
    fn place(&self, b: &pb::RelayBatch) -> Option<(WorkerId, Arc<kv_epp_core::index::KvIndex>)> {
        let endpoint: SocketAddr = b.endpoint.parse().ok()?;
        let worker = WorkerId::with_rank(endpoint, b.dp_rank);
        let (model, index) = self.workers.worker_index(&worker)?;
        (model == b.model).then_some((worker, index))
    }
}

/// Drains of owned sources go through the hub.
pub(crate) struct HubSink(pub Arc<RelayHub>);

impl EventSink for HubSink {
    fn admit(&self, worker: &WorkerId) -> Option<Ticket> {
        self.0.fencing.admit(worker, Instant::now())
    }

    fn deliver(&self, worker: &WorkerId, ticket: Ticket, events: Vec<EngineEvent>) {
        self.0.originate(worker, ticket, events);
    }
}

/// Splits a drain into batches of at most about `max` encoded bytes. A stored or removed event
/// too large on its own is cut into runs of blocks; a stored run after the first continues from
/// the previous run's last block (same namespace, by inheritance).
fn split(events: Vec<EngineEvent>, max: usize) -> Vec<Vec<pb::RelayEvent>> {
    let mut batches = Vec::new();
    let mut cur = Vec::new();
    let mut cur_bytes = 0;
    for ev in events {
        for piece in split_event(ev, max) {
            let ev = to_pb(&piece);
            let size = ev.encoded_len() + 8;
            if !cur.is_empty() && cur_bytes + size > max {
                batches.push(std::mem::take(&mut cur));
                cur_bytes = 0;
            }
            cur_bytes += size;
            cur.push(ev);
        }
    }
    if !cur.is_empty() {
        batches.push(cur);
    }
    batches
}

fn split_event(ev: EngineEvent, max: usize) -> Vec<EngineEvent> {
    let size = to_pb(&ev).encoded_len();
    if size <= max {
        return vec![ev];
    }
    match ev {
        EngineEvent::Stored(whole) => {
            let n = whole.engine_hashes.len().max(1);
            let per_block = size.div_ceil(n);
            let run = (max.saturating_sub(64) / per_block.max(1)).max(1);
            let bs = whole.tokens.len() / n;
            let mut out = Vec::new();
            let mut prev = whole.parent;
            for (i, hashes) in whole.engine_hashes.chunks(run).enumerate() {
                let start = i * run * bs;
                out.push(EngineEvent::Stored(StoredRun {
                    parent: prev,
                    root_seed: if i == 0 { whole.root_seed } else { None },
                    engine_hashes: hashes.to_vec(),
                    tokens: whole.tokens[start..start + hashes.len() * bs].to_vec(),
                    medium: whole.medium,
                    block_size: whole.block_size,
                    session_id: None,
                }));
                prev = hashes.last().copied();
            }
            out
        }
        EngineEvent::Removed {
            engine_hashes,
            tiers,
        } => engine_hashes
            .chunks((max / 10).max(1))
            .map(|h| EngineEvent::Removed {
                engine_hashes: h.to_vec(),
                tiers,
            })
            .collect(),
        EngineEvent::Cleared => vec![EngineEvent::Cleared],
    }
}

fn to_pb(ev: &EngineEvent) -> pb::RelayEvent {
    use pb::relay_event::Kind;
    let kind = match ev {
        // `block_size` is not sent: the owner checked it before relaying, and peers share the
        // model's configuration.
        EngineEvent::Stored(run) => Kind::Stored(pb::StoredEvent {
            parent: run.parent.map(|p| p.0),
            root_seed: run.root_seed.map(|s| s.0),
            engine_hashes: run.engine_hashes.iter().map(|h| h.0).collect(),
            tokens: run.tokens.clone(),
            offload: run.medium == Medium::Offload,
        }),
        EngineEvent::Removed {
            engine_hashes,
            tiers,
        } => Kind::Removed(pb::RemovedEvent {
            engine_hashes: engine_hashes.iter().map(|h| h.0).collect(),
            tiers: u32::from(*tiers),
        }),
        EngineEvent::Cleared => Kind::Cleared(pb::ClearedEvent {}),
    };
    pb::RelayEvent { kind: Some(kind) }
}

fn from_pb(ev: &pb::RelayEvent) -> Option<EngineEvent> {
    use pb::relay_event::Kind;
    Some(match ev.kind.as_ref()? {
        Kind::Stored(s) => EngineEvent::Stored(StoredRun {
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
            block_size: None,
            session_id: None,
        }),
        Kind::Removed(r) => EngineEvent::Removed {
            engine_hashes: r
                .engine_hashes
                .iter()
                .copied()
                .map(EngineBlockHash)
                .collect(),
            tiers: (r.tiers & 0b11) as u8,
        },
        Kind::Cleared(_) => EngineEvent::Cleared,
    })
}

/// After bootstrap: keeps ownership of single-reader sources and relay subscriptions current,
/// and evens out what vanished origins relayed.
///
/// Per source, each tick: a replica that is not the rendezvous owner gives its claim up and
/// stops polling; the owner stands down before a higher claim of a peer it sees (and, while
/// draining, before any claim of a peer it sees), does not claim while a peer it sees
/// holds one, else claims (see [`super::fence`]) and activates the claim once
/// the handoff delay has passed, no ready peer still polls the source, it has applied what every
/// ready peer had originated, and no catch-up of an origin that relayed this source is running.
pub(crate) async fn maintain(state: Arc<ReplicaState>) {
    let interval = state.probe_interval();
    let handoff = interval * 3;
    let mut owner_since: HashMap<WorkerId, Instant> = HashMap::new();
    let mut subs: HashMap<u64, tokio::task::JoinHandle<()>> = HashMap::new();
    let mut alive: HashSet<u64> = HashSet::new();
    // As the Lease's holder: the sources a peer has and this pool lacks.
    let mut lacking: HashMap<String, Lacking> = HashMap::new();
    let delegate_after = interval * DELEGATE_AFTER_INTERVALS;
    // Origins being caught up on, and the sources each relayed (only those wait for it).
    let catching: Arc<Mutex<HashMap<u64, HashSet<WorkerId>>>> = Arc::default();
    let mut tick = tokio::time::interval(interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let now = Instant::now();
        let view = state.members.view();
        // Origins that vanished: survivors even out what each of them received.
        let live: HashSet<u64> = view.iter().map(|m| m.instance).collect();
        for gone in alive.difference(&live) {
            if state.hub.position(*gone).is_some() && !catching.lock().contains_key(gone) {
                let relayed = state.hub.origin_workers(*gone);
                catching.lock().insert(*gone, relayed);
                let (state, catching, gone) = (state.clone(), catching.clone(), *gone);
                tokio::spawn(async move {
                    tracing::debug!(
                        origin = format!("{gone:016x}"),
                        "catching up on a vanished origin"
                    );
                    catch_up(&state, gone).await;
                    // Once more, for batches still in flight to peers at the first pass.
                    tokio::time::sleep(state.probe_interval() * 3).await;
                    catch_up(&state, gone).await;
                    catching.lock().remove(&gone);
                    tracing::debug!(origin = format!("{gone:016x}"), "caught up");
                });
            }
        }
        let caught: HashSet<u64> = catching.lock().keys().copied().collect();
        let forgotten = state.hub.forget_origins(
            |o| alive.contains(&o) || live.contains(&o) || caught.contains(&o),
            now,
            FORGET_AFTER,
        );
        if forgotten > 0 {
            tracing::debug!(
                forgotten,
                "forgot the relay positions of replicas gone for a while"
            );
        }
        alive = live;
        let sources = state.feeds.single_readers();
        let fencing = &state.hub.fencing;
        let pool: HashSet<WorkerId> = sources.iter().map(|(w, _)| *w).collect();
        let forgotten = fencing.tend(&pool, now, FORGET_AFTER);
        if forgotten > 0 {
            tracing::debug!(
                forgotten,
                "forgot the fencing of workers no replica has claimed for a while"
            );
        }
        state.set_delegations(delegations(
            &state,
            &view,
            &pool,
            &mut lacking,
            now,
            delegate_after,
        ));
        for (w, sr) in &sources {
            let name = w.to_string();
            if state.owner_of(w) != Some(state.instance) {
                owner_since.remove(w);
                stand_down(
                    &state,
                    w,
                    "another replica owns the worker's event drain now",
                );
                continue;
            }
            // The highest claim a peer this replica sees holds on the source.
            let peer_top = view
                .iter()
                .flat_map(|m| {
                    m.claims
                        .iter()
                        .filter(|c| c.worker == name)
                        .map(move |c| (c.epoch, m.instance))
                })
                .max();
            if fencing.superseded(w) {
                owner_since.remove(w);
                stand_down(
                    &state,
                    w,
                    "a higher claim on the worker's event drain was made",
                );
                continue;
            }
            let ours = fencing.claim_of(w);
            // Under the drain Lease the API server arbitrates: a peer's stale claim (a previous
            // holder that has not yet seen it lost) is no reason to back off.
            let leased = state.lease_for(w).is_some();
            match (&ours, peer_top) {
                // A peer claims the source while we drain it. It never claims while it sees a
                // claim, so it does not see ours (a one-way cut, or our answers reach it too
                // late): it drains, or will after its handoff, whatever the ranks, and only
                // stopping keeps the two drains apart (claims then settle from scratch). An
                // equal or lower rank is no protection: it cannot see that either.
                (Some(c), Some(_)) if c.active && !leased => {
                    let peer_active = view
                        .iter()
                        .any(|m| m.claims.iter().any(|c| c.worker == name && c.active));
                    owner_since.remove(w);
                    stand_down(
                        &state,
                        w,
                        if peer_active {
                            "a peer drains the worker too: backing off"
                        } else {
                            "a peer that does not see this replica's drain claims the worker: handing it over before it starts"
                        },
                    );
                    continue;
                }
                (Some(c), Some(top)) if (c.epoch, state.instance) < top => {
                    owner_since.remove(w);
                    stand_down(
                        &state,
                        w,
                        "a peer holds a higher claim on the worker's event drain",
                    );
                    continue;
                }
                (None, Some(_)) => continue, // it stands down first when it sees us own it
                (None, None) => {
                    let floor = state.lease_for(w).map_or(0, |l| l.epoch_floor());
                    let epoch = fencing.claim_above(*w, floor);
                    tracing::debug!(worker = %w, epoch, "claiming the worker's event drain");
                    owner_since.insert(*w, now);
                    continue;
                }
                (Some(_), _) => {}
            }
            let Some(c) = ours else { continue };
            if c.active && !state.feeds.is_polling(w) {
                // Still ours, but nothing polls it: the worker's feed was restarted (a rollout
                // changed its model) between two rounds, which ends the poller and keeps the
                // claim. Peers defer to the claim, so unless this replica polls again nobody
                // drains the worker. The new feed's block size is the one to read with.
                tracing::info!(worker = %w, epoch = c.epoch, "the worker's feed was restarted: draining it again");
                poll_into_hub(&state, *w, sr);
            }
            if c.active {
                // A replica (this one included) drained beyond a cut (it was paused or cut off
                // while it owned the source): its peers never applied those events, so every
                // replica forgets the source at this point of our stream and it is cold until
                // fresh events; repeated while the report stands (a clear in flight is slow).
                let diverged = fencing.diverged().contains(w)
                    || view.iter().any(|m| m.diverged.contains(&name));
                if diverged
                    && let Some(ticket) = fencing.admit(w, Instant::now())
                    && fencing.may_clear(w, Instant::now(), handoff * 3)
                {
                    tracing::warn!(worker = %w, "a replica holds events of this worker its peers refused: clearing the worker on every replica (it is cold until fresh events)");
                    state.hub.originate(w, ticket, vec![EngineEvent::Cleared]);
                }
                continue;
            }
            let since = *owner_since.entry(*w).or_insert(now);
            let waiting_for_catch_up = catching.lock().values().any(|ws| ws.contains(w));
            if now.duration_since(since) >= handoff
                && !state.feeds.is_polling(w)
                && !waiting_for_catch_up
                && handed_over(&state, &view, w)
            {
                let Some(until) = state.drain_lease_until(w) else {
                    continue;
                };
                let prev = fencing
                    .previous_owner(w)
                    .map(|o| (o, state.hub.position(o).unwrap_or(0)));
                fencing.activate(w, prev, until);
                tracing::info!(worker = %w, epoch = c.epoch, "this replica now owns the worker's event drain");
                poll_into_hub(&state, *w, sr);
            }
        }
        owner_since.retain(|w, _| sources.iter().any(|(s, _)| s == w));
        for (w, _) in fencing.claims() {
            if !sources.iter().any(|(s, _)| *s == w) {
                fencing.release(&w);
            }
        }
        subs.retain(|_, t| !t.is_finished());
        for m in &view {
            subs.entry(m.instance)
                .or_insert_with(|| tokio::spawn(subscribe(state.clone(), m.addr, m.instance)));
        }
    }
}

/// Polls `worker` (a single-reader source this replica owns) into the relay log.
fn poll_into_hub(state: &Arc<ReplicaState>, worker: WorkerId, sr: &SingleReader) {
    state.feeds.poll(
        worker,
        sr.index.block_size(),
        sr.interval,
        Arc::new(HubSink(state.hub.clone())),
    );
}

/// Gives up this replica's claim on `worker` and stops polling it (the drain in flight is
/// finished and relayed first).
fn stand_down(state: &ReplicaState, worker: &WorkerId, why: &'static str) {
    let had = state.hub.fencing.release(worker);
    if state.feeds.is_owned_here(worker) {
        tracing::info!(%worker, "{why}");
        state.feeds.stop_polling(worker);
    } else if had {
        tracing::debug!(%worker, "{why}");
    }
}

/// Whether no ready peer still polls `worker` and this replica has applied everything each ready
/// peer had originated at its last probe: the previous owner's last drain is in.
fn handed_over(state: &ReplicaState, view: &[super::members::Member], worker: &WorkerId) -> bool {
    let name = worker.to_string();
    view.iter().filter(|m| m.ready).all(|m| {
        !m.polling.contains(&name) && state.hub.position(m.instance).unwrap_or(0) >= m.relay_next
    })
}

/// Asks every live peer (the origin too, if it is back) for the batches of `origin` beyond this
/// replica's position. Bounded: [`CATCH_UP_DEADLINE`] in all, [`CATCH_UP_MAX`] batches per peer,
/// and every answer is finite.
async fn catch_up(state: &Arc<ReplicaState>, origin: u64) {
    let deadline = tokio::time::Instant::now() + CATCH_UP_DEADLINE;
    for m in state.members.view() {
        let from = state.hub.position(origin).unwrap_or(0);
        let mut client = state.members.client(m.addr);
        let req = authed(
            state,
            pb::RelayRequest {
                origin: 0,
                from_seq: from,
                of_origin: origin,
            },
        );
        let Ok(Ok(resp)) = tokio::time::timeout_at(deadline, client.relay(req)).await else {
            continue;
        };
        let mut stream = resp.into_inner();
        let mut read = 0;
        while read < CATCH_UP_MAX {
            let Ok(Ok(Some(b))) = tokio::time::timeout_at(deadline, stream.message()).await else {
                break;
            };
            read += 1;
            if b.keepalive || b.origin != origin {
                continue;
            }
            let mine = polled(state);
            if state.hub.apply_relayed(&b, &mine) == Applied::Applied {
                state.hub.counters.caught_up.inc();
            }
        }
    }
}

/// The single-reader sources this replica polls.
fn polled(state: &ReplicaState) -> Vec<WorkerId> {
    state
        .feeds
        .poll_statuses()
        .into_iter()
        .map(|(w, _)| w)
        .collect()
}

impl Drop for RelayHub {
    fn drop(&mut self) {
        self.tail.send_replace(u64::MAX);
    }
}

/// Drain rounds a source must be missing from the Lease holder's pool, while a ready peer has
/// it, before the holder delegates it (a pool that only lags behind a watch by a moment is not
/// worth two handovers); and rounds a delegate may go without an active claim on it before
/// the holder names another (one that does not hear the holder would hold it undrained).
const DELEGATE_AFTER_INTERVALS: u32 = 10;

/// What the Lease's holder keeps about a source its pool lacks and ready peers have.
struct Lacking {
    /// Since when.
    since: Instant,
    /// The peer it is delegated to, and since when it was named or last showed an active
    /// claim on it.
    delegate: Option<(u64, Instant)>,
    /// Peers passed over: named for [`DELEGATE_AFTER_INTERVALS`] without claiming it.
    passed: HashSet<u64>,
}

/// As the confirmed holder of the drain Lease: each source that ready peers have and that this
/// replica's `pool` has lacked for `after`, with the peer it is delegated to. A delegate keeps
/// the source while it stays ready with the source in its pool (no flapping as peers come and
/// go), unless it shows no active claim on it for `after` since it was named or last drained
/// (it cannot hear this replica, or cannot start): it is passed over for the next of highest
/// rendezvous weight. Empty when this replica does not hold the Lease.
fn delegations(
    state: &ReplicaState,
    view: &[super::members::Member],
    pool: &HashSet<WorkerId>,
    lacking: &mut HashMap<String, Lacking>,
    now: Instant,
    after: Duration,
) -> Vec<(String, u64)> {
    let holds = state
        .lease()
        .is_some_and(|l| state.is_ready() && l.held_until(now).is_some());
    if !holds {
        lacking.clear();
        return Vec::new();
    }
    let own: HashSet<String> = pool.iter().map(ToString::to_string).collect();
    let mut have: HashMap<&str, Vec<u64>> = HashMap::new();
    for m in view.iter().filter(|m| m.ready) {
        for w in m.sources.iter().flat_map(|s| s.iter()) {
            if !own.contains(w) {
                have.entry(w.as_str()).or_default().push(m.instance);
            }
        }
    }
    lacking.retain(|w, _| have.contains_key(w.as_str()));
    let draining = |instance: u64, w: &str| {
        view.iter()
            .any(|m| m.instance == instance && m.claims.iter().any(|c| c.worker == w && c.active))
    };
    let mut out = Vec::new();
    for (w, peers) in have {
        let Ok(id) = w.parse::<WorkerId>() else {
            continue;
        };
        let l = lacking.entry(w.to_owned()).or_insert_with(|| Lacking {
            since: now,
            delegate: None,
            passed: HashSet::new(),
        });
        if now.duration_since(l.since) < after {
            continue;
        }
        if let Some((d, seen)) = &mut l.delegate {
            let d = *d;
            if !peers.contains(&d) {
                l.delegate = None;
            } else if draining(d, w) {
                *seen = now;
            } else if now.duration_since(*seen) >= after {
                tracing::info!(
                    worker = w,
                    delegate = format!("{d:016x}"),
                    "the delegate of a worker this replica lacks has not drained it for a while: naming another"
                );
                l.passed.insert(d);
                l.delegate = None;
            }
        }
        if l.delegate.is_none() {
            if peers.iter().all(|p| l.passed.contains(p)) {
                l.passed.clear();
            }
            l.delegate = peers
                .iter()
                .copied()
                .filter(|p| !l.passed.contains(p))
                .max_by_key(|&i| (super::rendezvous(i, &id), i))
                .map(|d| (d, now));
        }
        if let Some((d, _)) = l.delegate {
            out.push((w.to_owned(), d));
        }
    }
    out.sort_unstable();
    out
}

/// Streams one peer's relay log into this replica until the stream breaks.
async fn subscribe(state: Arc<ReplicaState>, addr: SocketAddr, instance: u64) {
    let known = state.hub.position(instance);
    let mut client = state.members.client(addr);
    let req = authed(
        &state,
        pb::RelayRequest {
            origin: if known.is_some() { instance } else { 0 },
            from_seq: known.unwrap_or(0),
            of_origin: 0,
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
        if msg.origin != instance {
            // Its stream is its own log: a batch naming another origin (this replica's own
            // included) could make it apply what it never relayed, or flag its own drains.
            state.hub.counters.foreign.inc();
            tracing::debug!(peer = %addr, "relayed batch naming another origin dropped");
            continue;
        }
        state.hub.apply_relayed(&msg, &polled(&state));
    }
}

#[cfg(test)]
mod untrusted;

#[cfg(test)]
mod tests {
    use super::*;
    use kv_epp_core::index::{IndexLimits, KvIndex};

    #[test]
    fn oversized_drains_split_into_batches_that_apply_alike() {
        let bs = 4;
        let n = 500u64;
        let ev = EngineEvent::Stored(StoredRun {
            parent: None,
            root_seed: Some(HashSeed::new(None, Some("tenant"))),
            engine_hashes: (0..n).map(EngineBlockHash).collect(),
            tokens: (0..n as u32 * bs).collect(),
            medium: Medium::Device,
            block_size: Some(bs as usize),
            session_id: None,
        });
        let rm = EngineEvent::Removed {
            engine_hashes: (0..n).step_by(7).map(EngineBlockHash).collect(),
            tiers: 0b01,
        };
        let max = 2048;
        let batches = split(vec![ev.clone(), rm.clone()], max);
        assert!(batches.len() >= 5, "split into {}", batches.len());
        for b in &batches {
            let size: usize = b.iter().map(|e| e.encoded_len() + 8).sum();
            assert!(size <= max, "batch of {size} bytes");
        }
        let w = WorkerId::new("10.0.0.1:8000".parse().unwrap());
        let whole = KvIndex::new(bs as usize, IndexLimits::default());
        let pieces = KvIndex::new(bs as usize, IndexLimits::default());
        whole.add_worker(w);
        pieces.add_worker(w);
        let c = EventCounters::default();
        engine_event::apply(&whole, &w, &ev, &c).unwrap();
        engine_event::apply(&whole, &w, &rm, &c).unwrap();
        for b in &batches {
            for e in b {
                engine_event::apply(&pieces, &w, &from_pb(e).unwrap(), &c).unwrap();
            }
        }
        assert_eq!(whole.digest(), pieces.digest());
        assert_eq!(whole.digest().1, (n - n.div_ceil(7)) as usize);
    }
}
