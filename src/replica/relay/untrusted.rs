//! `RelayHub::apply_relayed` against an untrusted peer: a peer is authenticated, but a buggy or
//! compromised one may send any batch (any origin, sequence, reset flag, model, endpoint, rank,
//! epoch and cut, keepalive flag, and any events, in any order, repeated, with gaps). For any
//! sequence of batches, mostly well-formed ones for the hub's real workers mixed with hostile
//! ones, applying them one after another never panics and, after every batch, agrees with a
//! plain model of the relay's rules:
//!
//! - a batch below its origin's position is a duplicate and changes nothing; one that does not
//!   continue its origin's stream (a gap, a restart, the reset flag) first drops what that origin
//!   relayed for workers this replica does not poll itself;
//! - only a worker the hub's `Workers` runs, named with the model it serves, receives events,
//!   and its index ends up exactly as a shadow index given the same events directly;
//! - an epoch above `MAX_EPOCH` is refused, counted in `replica_epochs_refused`, and raises no
//!   fence;
//! - the tail kept per origin holds its last `RELAYED_TAIL` kept batches, for at most
//!   `RELAYED_ORIGINS` origins;
//! - every index is consistent on its own: its pair count is the holders a query of each stored
//!   prefix finds, and those holders are workers of that model holding that prefix.
//!
//! The fencing rules themselves are tested in `fence.rs`; here the model asks a `Fencing` of its
//! own the same questions, and checks that the hub asked its own alike (their fences agree).

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet, VecDeque};

use proptest::collection::vec;
use proptest::prelude::*;
use proptest::sample::select;

use super::*;
use crate::replica::fence::{Fence, MAX_EPOCH};
use kv_epp_core::hashing::SequenceHash;
use kv_epp_core::index::{IndexLimits, KvIndex};

/// This replica.
const ME: u64 = 1;
/// The peers that originate most batches.
const ORIGINS: [u64; 3] = [11, 12, 13];
/// Small limits, so that capacity rejections and per-worker resets happen.
const LIMITS: IndexLimits = IndexLimits {
    capacity: 6,
    max_blocks_per_worker: 6,
};

fn worker(host: u8, rank: u32) -> WorkerId {
    WorkerId::with_rank(format!("10.0.0.{host}:8000").parse().unwrap(), rank)
}

/// The workers the hub's `Workers` runs with an index, and their models: two ranks of one
/// endpoint and another endpoint under `m4` (4-token blocks), one under `m2` (2-token blocks).
fn placeable() -> [(WorkerId, &'static str); 4] {
    [
        (worker(1, 0), "m4"),
        (worker(1, 1), "m4"),
        (worker(2, 0), "m4"),
        (worker(3, 0), "m2"),
    ]
}

/// Run by `Workers` without an index (nothing to place).
fn indexless() -> WorkerId {
    worker(4, 0)
}

/// Registered in `m4`'s index but not run by `Workers` (a batch for it is not placed).
fn unrun() -> WorkerId {
    worker(5, 0)
}

/// The single-reader source this replica polls itself: a reset never drops it.
fn mine() -> Vec<WorkerId> {
    vec![worker(1, 0)]
}

fn block_size(model: &str) -> usize {
    if model == "m2" { 2 } else { 4 }
}

/// Where a batch's sequence lands relative to what its origin is expected to send next.
#[derive(Debug, Clone)]
enum SeqPick {
    Next,
    Behind(u64),
    Ahead(u64),
    Exactly(u64),
}

#[derive(Debug, Clone)]
enum Op {
    /// One batch (its `seq` is resolved from the pick when it is sent).
    Batch(SeqPick, pb::RelayBatch),
    /// An origin's stream continues with this many empty batches for a real worker: enough to
    /// fill the tail kept for catch-up.
    Flood(u64, usize),
    /// This many new origins, from the first given on, each send their first (empty) batch:
    /// enough to evict the oldest tails.
    Crowd(u64, usize),
}

/// An engine hash: mostly from a small pool, so that events of one case interact.
fn engine_hash() -> impl Strategy<Value = u64> {
    prop_oneof![8 => 1u64..8, 1 => any::<u64>()]
}

/// An event for a model of `bs`-token blocks: stored runs with whole blocks of a two-token
/// alphabet (so prefixes collide) under one of two seeds, removals of any tiers, clears, and
/// the malformed (token counts that make no blocks, an event with no kind).
fn event(bs: usize) -> impl Strategy<Value = pb::RelayEvent> {
    use pb::relay_event::Kind;
    let stored = (
        prop::option::weighted(0.5, engine_hash()),
        prop::option::weighted(0.8, prop_oneof![4 => 1u64..3, 1 => any::<u64>()]),
        vec(engine_hash(), 0..4),
        prop_oneof![8 => Just(0usize), 1 => 1usize..4],
        vec(0u32..2, 16),
        any::<bool>(),
    )
        .prop_map(
            move |(parent, root_seed, engine_hashes, extra, pool, offload)| {
                let tokens = pool
                    .into_iter()
                    .cycle()
                    .take(engine_hashes.len() * bs + extra)
                    .collect();
                Kind::Stored(pb::StoredEvent {
                    parent,
                    root_seed,
                    engine_hashes,
                    tokens,
                    offload,
                })
            },
        );
    let removed = (
        vec(engine_hash(), 0..4),
        prop_oneof![4 => 0u32..4, 1 => any::<u32>()],
    )
        .prop_map(|(engine_hashes, tiers)| {
            Kind::Removed(pb::RemovedEvent {
                engine_hashes,
                tiers,
            })
        });
    let kind = prop_oneof![
        8 => stored,
        4 => removed,
        1 => Just(Kind::Cleared(pb::ClearedEvent {})),
    ];
    prop::option::weighted(0.95, kind).prop_map(|kind| pb::RelayEvent { kind })
}

/// Model, endpoint and rank: mostly a placeable worker under its model, else anything (another
/// model, a worker this replica does not run, an address that does not parse).
fn target() -> impl Strategy<Value = (String, String, u32)> {
    let real = select(placeable().to_vec())
        .prop_map(|(w, model)| (model.to_owned(), w.endpoint.to_string(), w.dp_rank));
    let model = prop_oneof![
        4 => select(vec!["m4", "m2", "", "M4"]).prop_map(String::from),
        1 => any::<String>(),
    ];
    let endpoint = prop_oneof![
        4 => select(vec![
            "10.0.0.1:8000", "10.0.0.3:8000", "10.0.0.4:8000", "10.0.0.5:8000", "10.0.0.9:8000",
            "10.0.0.1:08000", "10.0.0.1", "[::1]:8000", "",
        ])
        .prop_map(String::from),
        1 => any::<String>(),
    ];
    let hostile = (
        model,
        endpoint,
        prop_oneof![4 => 0u32..2, 1 => any::<u32>()],
    );
    prop_oneof![6 => real, 1 => hostile]
}

/// Epoch, previous origin and its cut: mostly none (no fencing), else small epochs that raise
/// and consult fences, the largest reachable epoch and beyond, or anything.
fn ticket() -> impl Strategy<Value = (u64, u64, u64)> {
    prop_oneof![
        8 => Just((0, 0, 0)),
        3 => (1u64..4, select(vec![0, ME, 11, 12, 13]), 0u64..6),
        1 => (select(vec![MAX_EPOCH, MAX_EPOCH + 1, u64::MAX]), select(vec![0, 11]), 0u64..6),
        1 => any::<(u64, u64, u64)>(),
    ]
}

fn op() -> impl Strategy<Value = Op> {
    let origin = prop_oneof![8 => select(ORIGINS.to_vec()), 1 => Just(ME), 1 => any::<u64>()];
    let seq = prop_oneof![
        12 => Just(SeqPick::Next),
        2 => (1u64..4).prop_map(SeqPick::Behind),
        2 => (1u64..4).prop_map(SeqPick::Ahead),
        1 => prop_oneof![Just(u64::MAX), any::<u64>()].prop_map(SeqPick::Exactly),
    ];
    let body = target().prop_flat_map(|(model, endpoint, rank)| {
        let bs = block_size(&model);
        (Just((model, endpoint, rank)), vec(event(bs), 0..4))
    });
    let batch = (
        origin,
        seq,
        prop::bool::weighted(0.05),
        body,
        ticket(),
        prop::bool::weighted(0.05),
    )
        .prop_map(
            |(origin, seq, reset, ((model, endpoint, dp_rank), events), t, keepalive)| {
                let (epoch, prev_origin, prev_seq) = t;
                let b = pb::RelayBatch {
                    origin,
                    seq: 0,
                    reset,
                    model,
                    endpoint,
                    dp_rank,
                    events,
                    keepalive,
                    epoch,
                    prev_origin,
                    prev_seq,
                };
                Op::Batch(seq, b)
            },
        );
    let flood = (select(ORIGINS.to_vec()), RELAYED_TAIL..RELAYED_TAIL + 40)
        .prop_map(|(origin, n)| Op::Flood(origin, n));
    let crowd = (1000u64..2000, RELAYED_ORIGINS..RELAYED_ORIGINS + 4)
        .prop_map(|(first, n)| Op::Crowd(first, n));
    prop_oneof![40 => batch, 1 => flood, 1 => crowd]
}

/// The hub under test, its metrics, and each model's index.
struct Rig {
    hub: RelayHub,
    metrics: Arc<Metrics>,
    indexes: BTreeMap<&'static str, Arc<KvIndex>>,
}

/// Each model's index with the workers `Workers` registers (and the unrun one).
fn indexes() -> BTreeMap<&'static str, Arc<KvIndex>> {
    let mut out = BTreeMap::new();
    for model in ["m4", "m2"] {
        out.insert(model, Arc::new(KvIndex::new(block_size(model), LIMITS)));
    }
    out["m4"].add_worker(unrun());
    out
}

fn rig() -> Rig {
    let metrics = Arc::new(Metrics::new());
    let workers = Arc::new(Workers::new(metrics.clone()));
    let indexes = indexes();
    for (w, model) in placeable() {
        workers.add(w, model, Some(indexes[model].clone()));
    }
    workers.add(indexless(), "m4", None);
    let events = Arc::new(EventCounters::default());
    let hub = RelayHub::new(ME, workers, &metrics, events, 64, 1 << 20, 1 << 20);
    Rig {
        hub,
        metrics,
        indexes,
    }
}

/// What the hub should have done, by the rules in the module doc.
#[derive(Default, Debug, PartialEq, Eq)]
struct Counts {
    applied: u64,
    duplicates: u64,
    resets: u64,
    unplaced: u64,
    fenced: u64,
    refused: u64,
}

struct Model {
    positions: HashMap<u64, u64>,
    origin_workers: HashMap<u64, HashSet<WorkerId>>,
    /// Sequences of the batches kept per origin, and the origins in the order their tails began.
    tails: HashMap<u64, VecDeque<u64>>,
    tail_order: VecDeque<u64>,
    /// Every origin a batch named.
    seen: HashSet<u64>,
    fencing: Fencing,
    /// The same workers' indexes, given the placed events directly.
    shadow: BTreeMap<&'static str, Arc<KvIndex>>,
    events: EventCounters,
    counts: Counts,
}

impl Model {
    fn new() -> Model {
        let shadow = indexes();
        for (w, model) in placeable() {
            shadow[model].add_worker(w);
        }
        Model {
            positions: HashMap::new(),
            origin_workers: HashMap::new(),
            tails: HashMap::new(),
            tail_order: VecDeque::new(),
            seen: HashSet::new(),
            fencing: Fencing::new(ME, Counter::default(), Counter::default()),
            shadow,
            events: EventCounters::default(),
            counts: Counts::default(),
        }
    }

    fn seq(&self, origin: u64, pick: &SeqPick) -> u64 {
        let next = self.positions.get(&origin).copied().unwrap_or(0);
        match *pick {
            SeqPick::Next => next,
            SeqPick::Behind(k) => next.saturating_sub(k),
            SeqPick::Ahead(k) => next.saturating_add(k),
            SeqPick::Exactly(s) => s,
        }
    }

    /// The worker a batch is for, by the test's own table of what `Workers` runs.
    fn place(b: &pb::RelayBatch) -> Option<(WorkerId, &'static str)> {
        let endpoint: SocketAddr = b.endpoint.parse().ok()?;
        let w = WorkerId::with_rank(endpoint, b.dp_rank);
        placeable()
            .into_iter()
            .find(|(p, model)| *p == w && *model == b.model)
    }

    fn apply(&mut self, b: &pb::RelayBatch) -> Applied {
        self.seen.insert(b.origin);
        let pos = self.positions.get(&b.origin).copied();
        // A position at the end of the range admits nothing more.
        if pos.is_some_and(|p| b.seq < p || p == u64::MAX) {
            self.counts.duplicates += 1;
            return Applied::Duplicate;
        }
        let outcome = if !b.reset && b.seq == pos.unwrap_or(0) {
            Applied::Applied
        } else {
            self.counts.resets += 1;
            let mine = mine();
            for w in self.origin_workers.remove(&b.origin).unwrap_or_default() {
                if !mine.contains(&w) {
                    let (_, model) = placeable().into_iter().find(|(p, _)| *p == w).unwrap();
                    self.shadow[model].clear_worker(&w).unwrap();
                }
            }
            Applied::AfterReset
        };
        self.positions.insert(b.origin, b.seq.saturating_add(1));
        match Self::place(b) {
            None => self.counts.unplaced += 1,
            Some(_) if b.epoch > MAX_EPOCH => {
                self.counts.refused += 1;
                return outcome;
            }
            Some((w, model)) => {
                let ticket = Ticket {
                    epoch: b.epoch,
                    prev: (b.prev_origin != 0).then_some((b.prev_origin, b.prev_seq)),
                };
                if !self.fencing.accept_batch(w, b.origin, b.seq, ticket) {
                    self.counts.fenced += 1;
                    return outcome;
                }
                self.origin_workers.entry(b.origin).or_default().insert(w);
                if b.events
                    .iter()
                    .any(|e| matches!(e.kind, Some(pb::relay_event::Kind::Cleared(_))))
                {
                    self.fencing.note_cleared(w, b.epoch, b.origin);
                }
                for ev in &b.events {
                    match from_pb(ev) {
                        Some(ev) => {
                            let _ = engine_event::apply(&self.shadow[model], &w, &ev, &self.events);
                        }
                        None => self.counts.unplaced += 1,
                    }
                }
            }
        }
        if !self.tails.contains_key(&b.origin) {
            self.tail_order.push_back(b.origin);
            if self.tail_order.len() > RELAYED_ORIGINS
                && let Some(old) = self.tail_order.pop_front()
            {
                self.tails.remove(&old);
            }
        }
        let tail = self.tails.entry(b.origin).or_default();
        tail.push_back(b.seq);
        if tail.len() > RELAYED_TAIL {
            tail.pop_front();
        }
        self.counts.applied += 1;
        outcome
    }
}

fn counts(rig: &Rig) -> Counts {
    let c = &rig.hub.counters;
    Counts {
        applied: c.applied.get(),
        duplicates: c.duplicates.get(),
        resets: c.resets.get(),
        unplaced: c.unplaced.get(),
        fenced: c.fenced.get(),
        refused: rig.metrics.replica_epochs_refused.get(),
    }
}

fn fences(f: &Fencing) -> BTreeMap<WorkerId, Fence> {
    f.fences().into_iter().collect()
}

/// Checks the hub against the model, and each index on its own.
fn check(rig: &Rig, model: &Model) -> Result<(), TestCaseError> {
    prop_assert_eq!(&counts(rig), &model.counts);
    for &origin in &model.seen {
        prop_assert_eq!(
            rig.hub.position(origin),
            model.positions.get(&origin).copied()
        );
        prop_assert_eq!(
            rig.hub.origin_workers(origin),
            model
                .origin_workers
                .get(&origin)
                .cloned()
                .unwrap_or_default()
        );
        let kept: Vec<u64> = rig
            .hub
            .read_origin(origin, 0)
            .iter()
            .map(|b| b.seq)
            .collect();
        prop_assert!(kept.len() <= RELAYED_TAIL);
        let expected: Vec<u64> = model
            .tails
            .get(&origin)
            .map(|t| t.iter().copied().collect())
            .unwrap_or_default();
        prop_assert_eq!(kept, expected, "tail of origin {}", origin);
    }
    let tails = model
        .seen
        .iter()
        .filter(|o| !rig.hub.read_origin(**o, 0).is_empty())
        .count();
    prop_assert!(tails <= RELAYED_ORIGINS, "{} tails kept", tails);
    let hub_fences = fences(&rig.hub.fencing);
    prop_assert!(hub_fences.values().all(|f| f.epoch <= MAX_EPOCH));
    prop_assert_eq!(hub_fences, fences(&model.fencing));
    for (name, index) in &rig.indexes {
        let shadow = &model.shadow[name];
        prop_assert_eq!(index.digest(), shadow.digest(), "index of {}", name);
        prop_assert_eq!(index.pairs(), shadow.pairs(), "pairs of {}", name);
        consistent(name, index)?;
    }
    Ok(())
}

/// One index on its own: only its model's placeable workers hold blocks, and its pair count is
/// exactly the (worker, prefix) pairs a query finds, each backed by a block of that worker.
fn consistent(model: &str, index: &KvIndex) -> Result<(), TestCaseError> {
    let runs: BTreeSet<WorkerId> = placeable()
        .into_iter()
        .filter(|(_, m)| *m == model)
        .map(|(w, _)| w)
        .collect();
    let mut held: BTreeMap<SequenceHash, BTreeSet<WorkerId>> = BTreeMap::new();
    let mut holders_of_blocks = BTreeSet::new();
    index.for_each_block(|w, _, seq, _, tiers| {
        holders_of_blocks.insert(*w);
        if let Some(seq) = seq
            && tiers != 0
        {
            held.entry(seq).or_default().insert(*w);
        }
    });
    prop_assert!(
        holders_of_blocks.is_subset(&runs),
        "blocks of {:?} in {}",
        holders_of_blocks,
        model
    );
    let mut pairs = 0;
    for (seq, workers) in &held {
        for o in index.query(&[*seq]) {
            prop_assert!(
                workers.contains(&o.worker),
                "{} credited for {:?}",
                o.worker,
                seq
            );
            pairs += 1;
        }
    }
    prop_assert_eq!(index.pairs(), pairs, "pairs of {}", model);
    Ok(())
}

/// Sends the next batch of `origin`'s stream, with no events, for a real worker.
fn empty(rig: &Rig, model: &mut Model, origin: u64) -> Result<(), TestCaseError> {
    let (w, m) = placeable()[2];
    let b = pb::RelayBatch {
        origin,
        seq: model.seq(origin, &SeqPick::Next),
        model: m.to_owned(),
        endpoint: w.endpoint.to_string(),
        ..Default::default()
    };
    prop_assert_eq!(rig.hub.apply_relayed(&b, &mine()), model.apply(&b));
    Ok(())
}

fn run(ops: Vec<Op>) -> Result<(), TestCaseError> {
    let rig = rig();
    let mut model = Model::new();
    for op in ops {
        match op {
            Op::Batch(pick, mut b) => {
                b.seq = model.seq(b.origin, &pick);
                let got = rig.hub.apply_relayed(&b, &mine());
                prop_assert_eq!(got, model.apply(&b), "{:?}", b);
            }
            Op::Flood(origin, n) => {
                for _ in 0..n {
                    empty(&rig, &mut model, origin)?;
                }
            }
            Op::Crowd(first, n) => {
                for origin in first..first + n as u64 {
                    empty(&rig, &mut model, origin)?;
                }
            }
        }
        check(&rig, &model)?;
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn any_relayed_batches_apply_by_the_relay_rules(ops in vec(op(), 1..40)) {
        run(ops)?;
    }
}

#[test]
fn origins_gone_for_a_while_are_forgotten_and_a_return_is_a_first_contact() {
    let rig = rig();
    let mut model = Model::new();
    // Three origins stream to this replica; 1 and 2 will be gone, 3 stays live.
    for origin in [1, 2, 3] {
        for _ in 0..3 {
            empty(&rig, &mut model, origin).expect("applied");
        }
    }
    let hub = &rig.hub;
    let live = |o: u64| o == 3;
    let now = Instant::now();
    // Recently heard: nothing is forgotten yet.
    assert_eq!(hub.forget_origins(live, now, FORGET_AFTER), 0);
    assert_eq!(hub.position(1), Some(3));
    // Past the quiet period, every origin but the live one goes, with all it left behind.
    let later = now + FORGET_AFTER + Duration::from_secs(1);
    assert_eq!(hub.forget_origins(live, later, FORGET_AFTER), 2);
    for gone in [1, 2] {
        assert_eq!(hub.position(gone), None);
        assert!(hub.origin_workers(gone).is_empty());
        assert!(hub.read_origin(gone, 0).is_empty());
    }
    assert_eq!(hub.position(3), Some(3));
    assert!(!hub.origin_workers(3).is_empty());
    assert_eq!(hub.read_origin(3, 0).len(), 3);
    {
        let st = hub.state.lock();
        assert_eq!(st.heard.len(), 1);
        assert_eq!(st.relayed_order, VecDeque::from([3]));
    }
    // A forgotten origin streaming again mid-sequence is a first contact: applied after a
    // reset that has nothing left to drop.
    let (w, m) = placeable()[2];
    let b = pb::RelayBatch {
        origin: 1,
        seq: 7,
        model: m.to_owned(),
        endpoint: w.endpoint.to_string(),
        ..Default::default()
    };
    assert_eq!(hub.apply_relayed(&b, &mine()), Applied::AfterReset);
    assert_eq!(hub.position(1), Some(8));
}
