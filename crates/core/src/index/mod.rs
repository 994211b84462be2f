//! The KV index of one model: which workers hold which prefixes, in which tier.
//!
//! Writes come from engine events (one writer per worker at a time, serialized by that worker's
//! lock); queries come from every routing decision and take no lock at all (see [`holders`]).
//!
//! Data layout, per (worker, block):
//! - the holder table: one 12-byte slot (prefix hash → worker slot + tiers), ~0.78 full;
//! - the worker's own map: engine hash → prefix hash, namespace id, tiers (19 bytes), ~0.84 full.
//!
//! Namespaces: a sequence's first block is stored under the seed of the salt and adapter the
//! caller decoded; a continuation inherits its parent's seed. A continuation whose parent this
//! worker never reported gets the *unknown* namespace: kept (so removals and further
//! continuations resolve) but never entered into the holder table, so it can never be credited to
//! any tenant. Fail closed.
//!
//! Repair of orphans: when a later store event covers a block held under the unknown namespace
//! and resolves a trusted namespace itself (a trusted root, or a parent under a trusted
//! namespace), that block is re-keyed under it and enters the holder table. Engines re-announce
//! a chain from its first block (vLLM does), and each re-announced block is repaired as the
//! event reaches it, so a full re-announcement credits the whole chain. Already-stored
//! descendants that the re-announcement does not cover stay unknown until they are announced
//! again themselves: finding them would need a child link per block and recomputing their
//! prefix hashes would need their tokens, which the index does not keep. A block under a trusted
//! namespace is never re-keyed, whatever the engine sends, so it can never move to another
//! tenant.
//!
//! Capacity (documented policy): `capacity` bounds the (worker, block) pairs of the model; a store
//! beyond it is rejected and counted, because engines report their own evictions and the index
//! only ever grows past the engines' real capacity when removals were lost. `max_blocks_per_worker`
//! catches exactly that: a worker exceeding it has evidently lost removals, so its state is dropped
//! whole (counted as evicted) and rebuilt from its next events.

pub mod holders;
mod pages;
pub mod sessions;
pub mod worker_blocks;

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};

use crossbeam_epoch::{self as epoch, Atomic, Owned};
use parking_lot::Mutex;

use crate::hashing::{HashSeed, SequenceHash, chain, hash_block};
use crate::worker::WorkerId;
use holders::{HolderTable, Inserted, PREFETCH_DISTANCE};
use sessions::SessionTails;
use worker_blocks::{BlockEntry, UNKNOWN_NS, WorkerBlocks};
pub use worker_blocks::{EngineBlockHash, ParentState};

/// Where a worker keeps a block.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Medium {
    /// Accelerator memory: a hit costs nothing to reuse.
    Device,
    /// Any offload tier (CPU memory, local storage, remote store): reuse costs a transfer.
    Offload,
}

impl Medium {
    /// Maps an engine's medium string: `GPU` (or absent) is device; anything else is offload.
    pub fn from_engine(medium: Option<&str>) -> Medium {
        match medium {
            None => Medium::Device,
            Some(m) if m.eq_ignore_ascii_case("gpu") || m.eq_ignore_ascii_case("device") => {
                Medium::Device
            }
            Some(_) => Medium::Offload,
        }
    }

    fn bit(self) -> u8 {
        match self {
            Medium::Device => 0b01,
            Medium::Offload => 0b10,
        }
    }
}

/// How many leading blocks of a prompt one worker holds contiguously.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Overlap {
    /// The worker.
    pub worker: WorkerId,
    /// Leading blocks held in device memory.
    pub device_blocks: u32,
    /// Leading blocks held in any tier (device or offload); always ≥ `device_blocks`.
    pub total_blocks: u32,
}

/// A worker's slot in one index: a compact handle that [`KvIndex::worker_at`] resolves.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct WorkerSlot(pub u32);

/// Device run not broken (yet): the device count equals the total.
const UNBROKEN: u32 = u32::MAX;

/// A query's answer in compact form, reusable across queries (it keeps its buffers).
///
/// Workers are kept in the order their runs ended, cut into groups that ended at the same
/// block, so a worker costs one slot id and a group one entry, whatever the prompt's length.
#[derive(Default)]
pub struct QueryAnswer {
    /// Worker slots, in the order their runs ended (shorter first).
    order: Vec<u32>,
    /// By increasing end in `order`.
    groups: Vec<Group>,
    /// Per slot: leading device blocks when the device run ended first, else [`UNBROKEN`]
    /// (read only for groups without `device_full`).
    device: Vec<u32>,
    /// Per slot: position in `order` (valid where `mark` equals `stamp`).
    pos_of: Vec<u32>,
    mark: Vec<u32>,
    stamp: u32,
    /// The registry version the answer was computed against.
    version: u64,
    /// While every block so far is widely held: the workers still in the running, and those of
    /// them whose device run is unbroken, as bitsets over slots.
    any: Vec<u64>,
    dev: Vec<u64>,
    /// A wide block's holders (its record's bits and any held in slots beside it).
    blk_any: Vec<u64>,
    blk_dev: Vec<u64>,
    /// Holders found in slots for the current block.
    narrow: Vec<holders::Holder>,
    /// Survivors of the block where the walk leaves the bitsets.
    keep: Vec<u32>,
    /// The prompt's blocks hashed for the holder table.
    hashes: Vec<u64>,
    /// Groups that ended while the walk was on bitsets keep them here (`words` per group)
    /// rather than one slot id per worker.
    bit_groups: Vec<u64>,
    words: usize,
    /// Workers in those groups.
    bit_len: usize,
}

/// Workers whose runs ended at the same block.
#[derive(Clone, Copy)]
struct Group {
    /// End of the group in `order`.
    end: u32,
    /// Leading blocks held in any tier.
    total: u32,
    /// Whether every worker of the group held all of those in device memory.
    device_full: bool,
    /// When non-zero, the group is the bitset at `bits - 1` in `bit_groups` (its range of
    /// `order` is then empty).
    bits: u32,
}

/// Closes a group of the workers whose bits `words` yields (if any).
fn close_bits(
    bit_groups: &mut Vec<u64>,
    groups: &mut Vec<Group>,
    bit_len: &mut usize,
    end: usize,
    total: u32,
    device_full: bool,
    words: impl Iterator<Item = u64>,
) {
    let start = bit_groups.len();
    bit_groups.extend(words);
    let n: usize = bit_groups[start..]
        .iter()
        .map(|x| x.count_ones() as usize)
        .sum();
    if n == 0 {
        bit_groups.truncate(start);
        return;
    }
    *bit_len += n;
    groups.push(Group {
        end: end as u32,
        total,
        device_full,
        bits: start as u32 + 1,
    });
}

impl QueryAnswer {
    fn begin(&mut self, slots: usize) {
        self.order.clear();
        self.groups.clear();
        self.bit_groups.clear();
        self.bit_len = 0;
        if self.mark.len() < slots {
            self.mark.resize(slots, 0);
            self.pos_of.resize(slots, 0);
            self.device.resize(slots, 0);
        }
        self.stamp = self.stamp.wrapping_add(1);
        if self.stamp == 0 {
            self.mark.iter_mut().for_each(|m| *m = 0);
            self.stamp = 1;
        }
    }

    /// Number of workers with an overlap.
    pub fn len(&self) -> usize {
        self.order.len() + self.bit_len
    }

    /// Whether no worker holds the prompt's first block.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The most leading blocks any worker holds in any tier (0 when none).
    pub fn best_total_blocks(&self) -> u32 {
        self.groups.iter().map(|g| g.total).max().unwrap_or(0)
    }

    /// Every worker with an overlap: (slot, leading device blocks, leading blocks in any tier).
    pub fn rows(&self) -> impl Iterator<Item = (WorkerSlot, u32, u32)> + '_ {
        let mut start = 0usize;
        self.groups.iter().flat_map(move |g| {
            let range = start..g.end as usize;
            start = g.end as usize;
            let (total, full) = (g.total, g.device_full);
            let set = match g.bits {
                0 => &[][..],
                b => &self.bit_groups[b as usize - 1..b as usize - 1 + self.words],
            };
            let from_bits = set.iter().enumerate().flat_map(|(w, &x)| {
                let mut x = x;
                std::iter::from_fn(move || {
                    if x == 0 {
                        return None;
                    }
                    let b = x.trailing_zeros();
                    x &= x - 1;
                    Some((w * 64) as u32 + b)
                })
            });
            self.order[range]
                .iter()
                .copied()
                .chain(from_bits)
                .map(move |slot| {
                    let d = if full {
                        UNBROKEN
                    } else {
                        self.device[slot as usize]
                    };
                    (
                        WorkerSlot(slot),
                        if d == UNBROKEN { total } else { d },
                        total,
                    )
                })
        })
    }
}

/// Calls `f` with the index of every set bit of `x`.
#[inline]
fn bits(mut x: u64, mut f: impl FnMut(u32)) {
    while x != 0 {
        f(x.trailing_zeros());
        x &= x - 1;
    }
}

/// Limits of one model's index.
#[derive(Clone, Copy, Debug)]
pub struct IndexLimits {
    /// Maximum (worker, block) pairs.
    pub capacity: usize,
    /// Maximum blocks one worker may hold before its state is considered corrupt and dropped.
    pub max_blocks_per_worker: usize,
}

impl Default for IndexLimits {
    fn default() -> Self {
        IndexLimits {
            capacity: 50_000_000,
            max_blocks_per_worker: 4_000_000,
        }
    }
}

/// Counters of what the index did with its input.
#[derive(Default, Debug)]
pub struct IndexCounters {
    /// Blocks newly stored (new engine hashes).
    pub stored: AtomicU64,
    /// Blocks removed.
    pub removed: AtomicU64,
    /// Removals naming an engine hash the worker never stored.
    pub unknown_removals: AtomicU64,
    /// Blocks stored under the unknown namespace (never credited).
    pub unknown_namespace: AtomicU64,
    /// Blocks rejected because the index was at capacity.
    pub rejected_capacity: AtomicU64,
    /// Unknown-namespace blocks re-keyed under a trusted namespace when the engine re-announced
    /// their chain (now credited).
    pub repaired: AtomicU64,
    /// Blocks dropped because their worker exceeded its limit.
    pub evicted: AtomicU64,
    /// Store requests whose token count did not match their block count.
    pub malformed: AtomicU64,
}

/// One event's new blocks, as a worker stored them.
#[derive(Clone, Copy, Debug)]
pub struct StoreBlocks<'a> {
    /// The engine hash of the block before the first new one, or `None` when the first new block
    /// starts a sequence.
    pub parent: Option<EngineBlockHash>,
    /// The namespace seed of a sequence start (salt and adapter decoded from the event), or
    /// `None` when the event's namespace cannot be trusted (its blocks are never credited).
    /// Ignored for continuations, which inherit their parent's.
    pub root_seed: Option<HashSeed>,
    /// The engine's hashes of the new blocks.
    pub engine_hashes: &'a [EngineBlockHash],
    /// The new blocks' tokens, exactly `engine_hashes.len() * block_size` of them.
    pub tokens: &'a [u32],
    /// Where the worker stored them.
    pub medium: Medium,
}

/// What a store did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StoreOutcome {
    /// Blocks newly indexed (or added to a new tier, or repaired).
    pub stored: usize,
    /// Blocks kept under the unknown namespace.
    pub unknown_namespace: usize,
    /// Blocks rejected at capacity.
    pub rejected: usize,
    /// Blocks that were under the unknown namespace and are now re-keyed under this event's
    /// trusted one (also counted in `stored`).
    pub repaired: usize,
    /// Whether the worker's whole state was dropped for exceeding its limit.
    pub worker_reset: bool,
}

/// Errors of index writes.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum IndexError {
    /// The worker is not registered with this model.
    #[error("worker {0} is not registered")]
    UnknownWorker(WorkerId),
    /// Tokens do not cover the blocks exactly.
    #[error("{tokens} tokens do not make {blocks} blocks of {block_size}")]
    TokenCount {
        /// Tokens given.
        tokens: usize,
        /// Blocks given.
        blocks: usize,
        /// The model's block size.
        block_size: usize,
    },
}

struct WorkerEntry {
    id: WorkerId,
    slot: u32,
    blocks: Mutex<WorkerBlocks>,
    /// Set (under `blocks`) when the worker is removed: a write that fetched this entry before
    /// the removal must not put pairs under a slot that another worker may take later.
    retired: AtomicBool,
    /// Each engine session's newest stored block (see [`sessions`]).
    sessions: Mutex<SessionTails>,
}

/// Copy-on-write worker registry, read lock-free by queries.
#[derive(Default, Clone)]
struct Registry {
    by_id: HashMap<WorkerId, Arc<WorkerEntry>>,
    /// Slot → worker. A removed worker's slot is reused only after its pairs left the holder
    /// table and every query that could have seen them has ended (an epoch grace period).
    by_slot: Vec<Option<WorkerId>>,
    /// Per slot, the registry version at which its current worker took it.
    taken_at: Vec<u64>,
    /// Bumped by every change.
    version: u64,
}

/// The index of one model.
pub struct KvIndex {
    block_size: usize,
    limits: IndexLimits,
    holders: HolderTable,
    registry: Atomic<Registry>,
    registry_writer: Mutex<()>,
    /// Slots of removed workers whose grace period has passed, ready for reuse.
    free_slots: Arc<Mutex<Vec<u32>>>,
    pairs: AtomicUsize,
    counters: IndexCounters,
}

thread_local! {
    static ANSWER: std::cell::RefCell<QueryAnswer> = std::cell::RefCell::new(QueryAnswer::default());
}

impl KvIndex {
    /// An empty index for a model with this block size.
    pub fn new(block_size: usize, limits: IndexLimits) -> Self {
        Self::with_holders(block_size, limits, HolderTable::new())
    }

    fn with_holders(block_size: usize, limits: IndexLimits, holders: HolderTable) -> Self {
        KvIndex {
            block_size,
            limits,
            holders,
            registry: Atomic::new(Registry::default()),
            registry_writer: Mutex::new(()),
            free_slots: Arc::default(),
            pairs: AtomicUsize::new(0),
            counters: IndexCounters::default(),
        }
    }

    /// The model's block size in tokens.
    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// Counters of the index's input.
    pub fn counters(&self) -> &IndexCounters {
        &self.counters
    }

    /// The number of (worker, block-in-tier-set) pairs in the holder table.
    pub fn pairs(&self) -> usize {
        self.pairs.load(Ordering::Relaxed)
    }

    fn with_registry<R>(&self, f: impl FnOnce(&Registry) -> R) -> R {
        let guard = epoch::pin();
        // SAFETY: the registry pointer is never null and replaced ones are deferred.
        let reg = unsafe { self.registry.load(Ordering::Acquire, &guard).deref() };
        f(reg)
    }

    fn update_registry(&self, f: impl FnOnce(&mut Registry)) {
        let _w = self.registry_writer.lock();
        let guard = epoch::pin();
        // SAFETY: as in `with_registry`; we hold the writer lock, so nobody else replaces it.
        let mut next = unsafe { self.registry.load(Ordering::Acquire, &guard).deref() }.clone();
        next.version += 1;
        f(&mut next);
        let old = self
            .registry
            .swap(Owned::new(next), Ordering::AcqRel, &guard);
        // SAFETY: unlinked above; pinned readers keep it alive until they unpin.
        unsafe { guard.defer_destroy(old) };
        // Into the global queue, so an idle writer thread does not keep it in its own bag.
        guard.flush();
    }

    fn entry(&self, worker: &WorkerId) -> Result<Arc<WorkerEntry>, IndexError> {
        self.with_registry(|r| r.by_id.get(worker).cloned())
            .ok_or(IndexError::UnknownWorker(*worker))
    }

    /// Registers a worker. Returns false if it was already registered.
    pub fn add_worker(&self, id: WorkerId) -> bool {
        let mut added = false;
        self.update_registry(|r| {
            if r.by_id.contains_key(&id) {
                return;
            }
            let slot = match self.free_slots.lock().pop() {
                Some(slot) => slot,
                None if r.by_slot.len() < holders::MAX_SLOTS as usize => {
                    r.by_slot.push(None);
                    r.taken_at.push(0);
                    (r.by_slot.len() - 1) as u32
                }
                None => return, // 2^30 - 1 live workers: refuse rather than alias
            };
            r.by_slot[slot as usize] = Some(id);
            r.taken_at[slot as usize] = r.version;
            r.by_id.insert(
                id,
                Arc::new(WorkerEntry {
                    id,
                    slot,
                    blocks: Mutex::new(WorkerBlocks::default()),
                    retired: AtomicBool::new(false),
                    sessions: Mutex::new(SessionTails::default()),
                }),
            );
            added = true;
        });
        added
    }

    /// Removes a worker and all its blocks. Returns the number of blocks dropped.
    pub fn remove_worker(&self, id: &WorkerId) -> usize {
        let Ok(entry) = self.entry(id) else { return 0 };
        self.update_registry(|r| {
            r.by_id.remove(id);
            if let Some(s) = r.by_slot.get_mut(entry.slot as usize) {
                *s = None;
            }
        });
        let dropped = {
            let mut blocks = entry.blocks.lock();
            entry.retired.store(true, Ordering::Relaxed);
            let n = self.drop_blocks(&entry, &mut blocks);
            *blocks = WorkerBlocks::default();
            n
        };
        // Its pairs are gone; once every query that may have read them has ended, the slot can
        // serve another worker.
        let free = self.free_slots.clone();
        let slot = entry.slot;
        let guard = epoch::pin();
        guard.defer(move || free.lock().push(slot));
        guard.flush();
        drop(guard);
        holders::reclaim_retired();
        dropped
    }

    /// The registered workers.
    pub fn workers(&self) -> Vec<WorkerId> {
        self.with_registry(|r| r.by_id.keys().copied().collect())
    }

    /// Drops every block of a worker (e.g. on `AllBlocksCleared` or a lost stream).
    pub fn clear_worker(&self, id: &WorkerId) -> Result<usize, IndexError> {
        let entry = self.entry(id)?;
        let mut blocks = entry.blocks.lock();
        Ok(self.drop_blocks(&entry, &mut blocks))
    }

    fn drop_blocks(&self, entry: &WorkerEntry, blocks: &mut WorkerBlocks) -> usize {
        entry.sessions.lock().clear();
        let drained = blocks.drain();
        for e in &drained {
            if e.ns() != UNKNOWN_NS && self.holders.remove(e.seq().0, entry.slot, 0b11).is_some() {
                self.pairs.fetch_sub(1, Ordering::Relaxed);
            }
        }
        drained.len()
    }

    /// Blocks a worker holds (any tier, including unknown-namespace ones).
    pub fn worker_blocks(&self, id: &WorkerId) -> Result<usize, IndexError> {
        Ok(self.entry(id)?.blocks.lock().len())
    }

    /// Records that an engine session of `worker` last stored the block `tail` (an unknown
    /// worker is ignored: its feed is stopping).
    pub fn note_session(&self, worker: &WorkerId, session: &str, tail: EngineBlockHash) {
        if let Ok(entry) = self.entry(worker) {
            entry.sessions.lock().note(session, tail);
        }
    }

    /// The newest block an engine session stored on `worker`, while the worker still holds it:
    /// where that session's prefix lives (session affinity builds on it).
    pub fn session_tail(&self, worker: &WorkerId, session: &str) -> Option<EngineBlockHash> {
        let entry = self.entry(worker).ok()?;
        let tail = entry.sessions.lock().tail(session)?;
        entry.blocks.lock().get(tail).is_some().then_some(tail)
    }

    /// How a continuation of `parent` on `worker` would be decoded.
    pub fn parent_state(
        &self,
        worker: &WorkerId,
        parent: EngineBlockHash,
    ) -> Result<ParentState, IndexError> {
        Ok(self.entry(worker)?.blocks.lock().parent(parent))
    }

    /// Applies one stored-blocks event of `worker`.
    pub fn store(
        &self,
        worker: &WorkerId,
        ev: &StoreBlocks<'_>,
    ) -> Result<StoreOutcome, IndexError> {
        let n = ev.engine_hashes.len();
        if self.block_size == 0 || ev.tokens.len() != n * self.block_size {
            self.counters.malformed.fetch_add(1, Ordering::Relaxed);
            return Err(IndexError::TokenCount {
                tokens: ev.tokens.len(),
                blocks: n,
                block_size: self.block_size,
            });
        }
        let entry = self.entry(worker)?;
        let mut blocks = entry.blocks.lock();
        if entry.retired.load(Ordering::Relaxed) {
            return Err(IndexError::UnknownWorker(*worker));
        }
        let mut out = StoreOutcome::default();
        if blocks.len() + n > self.limits.max_blocks_per_worker {
            let dropped = self.drop_blocks(&entry, &mut blocks);
            self.counters
                .evicted
                .fetch_add(dropped as u64, Ordering::Relaxed);
            out.worker_reset = true;
            if ev.parent.is_some() {
                // Its parent is gone with the rest: nothing of this event can be placed.
                return Ok(out);
            }
        }
        // Resolve the namespace and the prefix hash the first new block chains from.
        let (seed, mut prev) = match ev.parent {
            None => (ev.root_seed, None),
            Some(p) => match blocks.parent(p) {
                ParentState::Known { seed, seq } => (Some(seed), Some(seq)),
                ParentState::UnknownNamespace | ParentState::Missing => (None, None),
            },
        };
        let ns = seed.map_or(UNKNOWN_NS, |seed| blocks.acquire_namespace(seed, n as u32));
        // A worker out of namespace ids (millions of live namespaces) keeps these blocks
        // uncredited: fail closed.
        let seed = seed.filter(|_| ns != UNKNOWN_NS);
        let bit = ev.medium.bit();
        // The pair count is published once per event.
        let mut added = 0usize;
        for (i, &engine_hash) in ev.engine_hashes.iter().enumerate() {
            let seq = seed.map(|seed| {
                let local = hash_block(
                    &ev.tokens[i * self.block_size..(i + 1) * self.block_size],
                    seed,
                );
                match prev {
                    None => SequenceHash(local.0),
                    Some(p) => chain(p, local),
                }
            });
            prev = seq;
            let at_capacity = || self.pairs.load(Ordering::Relaxed) + added >= self.limits.capacity;
            if let Some(mut existing) = blocks.get(engine_hash) {
                let tiers = existing.tiers() | bit;
                match seq {
                    // An orphan (kept under the unknown namespace because its parent was never
                    // seen, or its root untrusted) that the engine now announces with a trusted
                    // namespace: re-key it under that namespace so it is credited. It had no
                    // holder slot and no namespace reference; it takes this event's reference
                    // instead of releasing it. Only unknown blocks are re-keyed: a block already
                    // under a trusted namespace keeps it (below), whatever the engine sends, so
                    // tenant A's block can never become credited to tenant B.
                    Some(seq) if existing.ns() == UNKNOWN_NS => {
                        if at_capacity() {
                            existing.set_tiers(tiers);
                            blocks.insert(engine_hash, existing);
                            self.reject_rest(&mut blocks, ns, n - i, &mut out);
                            break;
                        }
                        blocks.insert(engine_hash, BlockEntry::new(seq, ns, tiers));
                        for b in [0b01, 0b10] {
                            if tiers & b != 0
                                && self.holders.insert(seq.0, entry.slot, b) == Inserted::NewPair
                            {
                                added += 1;
                            }
                        }
                        out.stored += 1;
                        out.repaired += 1;
                    }
                    // Same engine block again (another tier, or a replayed event): merge tiers.
                    _ => {
                        let changed = tiers != existing.tiers();
                        let trusted = existing.ns() != UNKNOWN_NS;
                        // The pair is new when another engine hash with the same prefix took
                        // it away (`remove` counts it down then): at capacity, refused like
                        // any new pair, and the tier is not recorded.
                        if changed
                            && trusted
                            && at_capacity()
                            && !self.holds_pair(existing.seq(), entry.slot)
                        {
                            out.rejected += 1;
                        } else {
                            if changed {
                                existing.set_tiers(tiers);
                                blocks.insert(engine_hash, existing);
                            }
                            if changed && trusted {
                                if self.holders.insert(existing.seq().0, entry.slot, bit)
                                    == Inserted::NewPair
                                {
                                    added += 1;
                                }
                                out.stored += 1;
                            }
                        }
                        blocks.release_namespace(ns);
                    }
                }
                continue;
            }
            match seq {
                Some(seq) => {
                    if at_capacity() {
                        self.reject_rest(&mut blocks, ns, n - i, &mut out);
                        break;
                    }
                    if self.holders.insert(seq.0, entry.slot, bit) == Inserted::NewPair {
                        added += 1;
                    }
                    blocks.add(engine_hash, BlockEntry::new(seq, ns, bit));
                    out.stored += 1;
                }
                None => {
                    blocks.add(
                        engine_hash,
                        BlockEntry::new(SequenceHash(0), UNKNOWN_NS, bit),
                    );
                    out.unknown_namespace += 1;
                }
            }
        }
        self.pairs.fetch_add(added, Ordering::Relaxed);
        let c = &self.counters;
        c.stored.fetch_add(out.stored as u64, Ordering::Relaxed);
        c.unknown_namespace
            .fetch_add(out.unknown_namespace as u64, Ordering::Relaxed);
        c.rejected_capacity
            .fetch_add(out.rejected as u64, Ordering::Relaxed);
        c.repaired.fetch_add(out.repaired as u64, Ordering::Relaxed);
        Ok(out)
    }

    /// Whether worker `slot` holds the prefix `seq` in the holder table (in any tier).
    fn holds_pair(&self, seq: SequenceHash, slot: u32) -> bool {
        let guard = epoch::pin();
        let snap = self.holders.snapshot(&guard);
        snap.tiers_of(seq.0, snap.hash(seq.0), slot) != 0
    }

    /// At capacity: the current block and the rest of its chain (`left` blocks in all) cannot be
    /// placed; their namespace references, acquired up front, are released.
    fn reject_rest(&self, blocks: &mut WorkerBlocks, ns: u32, left: usize, out: &mut StoreOutcome) {
        for _ in 0..left {
            blocks.release_namespace(ns);
        }
        out.rejected += left;
    }

    /// Applies one removed-blocks event of `worker`: the blocks leave `medium`, and are dropped
    /// once they are in no tier. Returns how many engine hashes were known.
    pub fn remove(
        &self,
        worker: &WorkerId,
        engine_hashes: &[EngineBlockHash],
        medium: Medium,
    ) -> Result<usize, IndexError> {
        let entry = self.entry(worker)?;
        let mut blocks = entry.blocks.lock();
        let bit = medium.bit();
        let mut known = 0;
        for &h in engine_hashes {
            let Some(mut e) = blocks.get(h) else {
                self.counters
                    .unknown_removals
                    .fetch_add(1, Ordering::Relaxed);
                continue;
            };
            known += 1;
            if e.tiers() & bit == 0 {
                continue;
            }
            let left = e.tiers() & !bit;
            let (seq, ns) = (e.seq(), e.ns());
            if left != 0 {
                e.set_tiers(left);
                blocks.insert(h, e);
            } else {
                blocks.remove(h);
                self.counters.removed.fetch_add(1, Ordering::Relaxed);
            }
            if ns != UNKNOWN_NS && self.holders.remove(seq.0, entry.slot, bit) == Some(0) {
                self.pairs.fetch_sub(1, Ordering::Relaxed);
            }
        }
        Ok(known)
    }

    /// For a prompt's prefix hashes, each worker's contiguous leading overlap. Workers with no
    /// overlap are omitted. Cost: see [`KvIndex::query_compact`], plus one row per worker.
    pub fn query(&self, seqs: &[SequenceHash]) -> Vec<Overlap> {
        let mut out = Vec::new();
        self.query_into(seqs, &mut out);
        out
    }

    /// [`KvIndex::query`] into a caller's buffer (cleared first), so a caller that keeps it
    /// between queries allocates nothing once it is large enough.
    pub fn query_into(&self, seqs: &[SequenceHash], results: &mut Vec<Overlap>) {
        results.clear();
        let guard = epoch::pin();
        // SAFETY: see `with_registry`.
        let registry = unsafe { self.registry.load(Ordering::Acquire, &guard).deref() };
        ANSWER.with(|answer| {
            let mut answer = answer.borrow_mut();
            self.walk(seqs, registry, &guard, &mut answer);
            results.extend(answer.rows().filter_map(|(slot, device, total)| {
                let worker = (*registry.by_slot.get(slot.0 as usize)?)?;
                Some(Overlap {
                    worker,
                    device_blocks: device,
                    total_blocks: total,
                })
            }));
        });
    }

    /// The same answer in compact form, into a caller's reusable [`QueryAnswer`]: worker slots
    /// grouped by how many leading blocks they hold, so the cost follows the prompt's blocks and
    /// the holders of each block that are still in the running, not workers × blocks. Resolve a
    /// slot with [`KvIndex::worker_at`]. Takes no lock; never waits for a writer.
    pub fn query_compact(&self, seqs: &[SequenceHash], answer: &mut QueryAnswer) {
        let guard = epoch::pin();
        // SAFETY: see `with_registry`.
        let registry = unsafe { self.registry.load(Ordering::Acquire, &guard).deref() };
        self.walk(seqs, registry, &guard, answer);
    }

    /// The worker of `slot` in `answer` (from [`KvIndex::query_compact`]): `None` when that
    /// worker was removed since, including when its slot now serves another worker.
    pub fn worker_at(&self, answer: &QueryAnswer, slot: WorkerSlot) -> Option<WorkerId> {
        self.with_registry(|r| {
            let i = slot.0 as usize;
            if *r.taken_at.get(i)? > answer.version {
                return None;
            }
            r.by_slot.get(i).copied().flatten()
        })
    }

    fn walk(
        &self,
        seqs: &[SequenceHash],
        registry: &Registry,
        guard: &epoch::Guard,
        a: &mut QueryAnswer,
    ) {
        let slots = registry.by_slot.len();
        a.begin(slots);
        a.version = registry.version;
        let Some(first) = seqs.first() else { return };
        let snap = self.holders.snapshot(guard);
        a.hashes.clear();
        a.hashes.extend(seqs.iter().map(|s| snap.hash(s.0)));
        for &m in a.hashes.iter().take(PREFETCH_DISTANCE) {
            snap.prefetch(m);
        }
        a.narrow.clear();
        let wide = snap.visit(first.0, a.hashes[0], |h| a.narrow.push(h));
        let (start, mut live) = match wide {
            Some(w) => match Self::walk_wide(seqs, w, slots, &snap, a) {
                Some(resume) => resume,
                None => return,
            },
            None => {
                let stamp = a.stamp;
                for &h in &a.narrow {
                    let slot = h.slot() as usize;
                    if slot >= slots || a.mark[slot] == stamp {
                        continue; // registered after this query began
                    }
                    a.mark[slot] = stamp;
                    a.pos_of[slot] = a.order.len() as u32;
                    a.device[slot] = if h.tiers() & 0b01 != 0 { UNBROKEN } else { 0 };
                    a.order.push(slot as u32);
                }
                (1, 0)
            }
        };
        let stamp = a.stamp;
        for (pos, seq) in seqs.iter().enumerate().skip(start) {
            if live == a.order.len() {
                break;
            }
            if live + 1 == a.order.len() {
                // One worker left (the usual tail of a prompt): only its own holding matters.
                Self::walk_one(seqs, pos, &snap, a);
                return;
            }
            if let Some(&ahead) = a.hashes.get(pos + PREFETCH_DISTANCE) {
                snap.prefetch(ahead);
            }
            // Survivors move to the back of the live range; what stays in front ends here.
            let mut back = a.order.len();
            let wide = snap.visit(seq.0, a.hashes[pos], |h| {
                let slot = h.slot() as usize;
                if slot >= slots || a.mark[slot] != stamp {
                    return;
                }
                let i = a.pos_of[slot] as usize;
                if i < live || i >= back {
                    return; // ended earlier (or, defensively, already counted here)
                }
                back -= 1;
                let other = a.order[back];
                a.order.swap(i, back);
                a.pos_of[other as usize] = i as u32;
                a.pos_of[slot] = back as u32;
                if h.tiers() & 0b01 == 0 && a.device[slot] == UNBROKEN {
                    a.device[slot] = pos as u32;
                }
            });
            if let Some(w) = wide {
                // A widely held block after narrow ones: test each worker still running.
                let mut i = live;
                while i < back {
                    let slot = a.order[i];
                    let tiers = w.tiers(slot);
                    if tiers == 0 {
                        i += 1;
                        continue;
                    }
                    back -= 1;
                    let other = a.order[back];
                    a.order.swap(i, back);
                    a.pos_of[other as usize] = i as u32;
                    a.pos_of[slot as usize] = back as u32;
                    if tiers & 0b01 == 0 && a.device[slot as usize] == UNBROKEN {
                        a.device[slot as usize] = pos as u32;
                    }
                }
            }
            if back > live {
                a.groups.push(Group {
                    end: back as u32,
                    total: pos as u32,
                    device_full: false,
                    bits: 0,
                });
            }
            live = back;
        }
        if live < a.order.len() {
            a.groups.push(Group {
                end: a.order.len() as u32,
                total: seqs.len() as u32,
                device_full: false,
                bits: 0,
            });
        }
    }

    /// The rest of the walk from block `from` when one worker is left in the running (the last
    /// of `order`): each block costs one lookup that stops at that worker's pair.
    fn walk_one(
        seqs: &[SequenceHash],
        from: usize,
        snap: &holders::Snapshot<'_>,
        a: &mut QueryAnswer,
    ) {
        let Some(&slot) = a.order.last() else { return };
        let device = &mut a.device[slot as usize];
        let (end, offload_from) = snap.run_of(seqs, &a.hashes, from, slot, *device == UNBROKEN);
        if let Some(pos) = offload_from {
            *device = pos as u32;
        }
        a.groups.push(Group {
            end: a.order.len() as u32,
            total: end as u32,
            device_full: false,
            bits: 0,
        });
    }

    /// The walk while every block so far is widely held: the workers in the running are a
    /// bitset, so a block costs a few words, not one step per holder. At the first block held
    /// in slots only, the survivors (its holders) continue in the list form: returns where the
    /// list walk resumes and where its live range starts; `None` when the answer is complete.
    fn walk_wide(
        seqs: &[SequenceHash],
        first: &holders::Wide,
        slots: usize,
        snap: &holders::Snapshot<'_>,
        a: &mut QueryAnswer,
    ) -> Option<(usize, usize)> {
        let words = slots.div_ceil(64).min(
            first.words().max(
                a.narrow
                    .iter()
                    .map(|h| h.slot() as usize / 64 + 1)
                    .max()
                    .unwrap_or(0),
            ),
        );
        for v in [&mut a.any, &mut a.dev, &mut a.blk_any, &mut a.blk_dev] {
            v.clear();
            v.resize(words, 0);
        }
        a.words = words;
        Self::block_bits(first, &a.narrow, slots, &mut a.any, &mut a.dev);
        // Held at block 0 only offloaded: no leading device block.
        for w in 0..words {
            bits(a.any[w] & !a.dev[w], |b| a.device[w * 64 + b as usize] = 0);
        }
        for (pos, seq) in seqs.iter().enumerate().skip(1) {
            if let Some(&ahead) = a.hashes.get(pos + PREFETCH_DISTANCE) {
                snap.prefetch(ahead);
            }
            a.narrow.clear();
            let narrow = &mut a.narrow;
            let wide = snap.visit(seq.0, a.hashes[pos], |h| narrow.push(h));
            match wide {
                Some(w) => {
                    Self::block_bits(w, &a.narrow, slots, &mut a.blk_any, &mut a.blk_dev);
                    let mut running = 0u64;
                    // Ended here with the device run whole, then the rest of those ended here.
                    for full in [true, false] {
                        let ended = a.any.iter().zip(&a.blk_any).zip(&a.dev);
                        close_bits(
                            &mut a.bit_groups,
                            &mut a.groups,
                            &mut a.bit_len,
                            a.order.len(),
                            pos as u32,
                            full,
                            ended.map(|((&act, &blk), &dev)| {
                                act & !blk & if full { dev } else { !dev }
                            }),
                        );
                    }
                    for wd in 0..words {
                        let keep = a.any[wd] & a.blk_any[wd];
                        // Still running, but the device run breaks here.
                        let broke = a.dev[wd] & keep & !a.blk_dev[wd];
                        bits(broke, |b| a.device[wd * 64 + b as usize] = pos as u32);
                        a.dev[wd] &= keep & !broke;
                        a.any[wd] = keep;
                        running |= keep;
                    }
                    if running == 0 {
                        return None;
                    }
                }
                None => {
                    // Held in slots only: its holders still running survive, in list form.
                    a.keep.clear();
                    for &h in &a.narrow {
                        let s = h.slot() as usize;
                        let (wd, bit) = (s / 64, 1u64 << (s % 64));
                        if s >= slots || wd >= words || a.any[wd] & bit == 0 {
                            continue;
                        }
                        a.any[wd] &= !bit;
                        if a.dev[wd] & bit != 0 {
                            a.dev[wd] &= !bit;
                            a.device[s] = if h.tiers() & 0b01 != 0 {
                                UNBROKEN
                            } else {
                                pos as u32
                            };
                        }
                        a.keep.push(s as u32);
                    }
                    for full in [true, false] {
                        close_bits(
                            &mut a.bit_groups,
                            &mut a.groups,
                            &mut a.bit_len,
                            a.order.len(),
                            pos as u32,
                            full,
                            a.any
                                .iter()
                                .zip(&a.dev)
                                .map(|(&act, &dev)| act & if full { dev } else { !dev }),
                        );
                    }
                    let live = a.order.len();
                    let stamp = a.stamp;
                    for &s in &a.keep {
                        a.mark[s as usize] = stamp;
                        a.pos_of[s as usize] = a.order.len() as u32;
                        a.order.push(s);
                    }
                    return Some((pos + 1, live));
                }
            }
        }
        // Every block held: the workers still running hold the whole prompt.
        for full in [true, false] {
            close_bits(
                &mut a.bit_groups,
                &mut a.groups,
                &mut a.bit_len,
                a.order.len(),
                seqs.len() as u32,
                full,
                a.any
                    .iter()
                    .zip(&a.dev)
                    .map(|(&act, &dev)| act & if full { dev } else { !dev }),
            );
        }
        None
    }

    /// A wide block's holders as bitsets over the first `any.len()` words: its record's bits
    /// and those of holders found in slots beside it, none at or beyond `slots`.
    fn block_bits(
        w: &holders::Wide,
        narrow: &[holders::Holder],
        slots: usize,
        any: &mut [u64],
        dev: &mut [u64],
    ) {
        for (wd, (a, d)) in any.iter_mut().zip(dev.iter_mut()).enumerate() {
            let (dv, of) = (w.device(wd), w.offload(wd));
            *a = dv | of;
            *d = dv;
        }
        for h in narrow {
            let s = h.slot() as usize;
            if let (Some(a), Some(d)) = (any.get_mut(s / 64), dev.get_mut(s / 64)) {
                *a |= 1 << (s % 64);
                if h.tiers() & 0b01 != 0 {
                    *d |= 1 << (s % 64);
                }
            }
        }
        let words = any.len();
        if words > 0 && words * 64 > slots {
            let m = u64::MAX >> (words * 64 - slots);
            any[words - 1] &= m;
            dev[words - 1] &= m;
        }
    }

    /// The most leading blocks of `seqs` any one worker holds, in any tier (0 when none): the
    /// best credit [`KvIndex::query`] can give a prompt. Same cost as `query_compact`.
    pub fn best_total_blocks(&self, seqs: &[SequenceHash]) -> u32 {
        ANSWER.with(|answer| {
            let mut answer = answer.borrow_mut();
            self.query_compact(seqs, &mut answer);
            answer.best_total_blocks()
        })
    }

    /// Heap bytes of the index's tables (holder slots and worker maps), for memory accounting.
    pub fn approx_heap_bytes(&self) -> usize {
        let workers: usize =
            self.with_registry(|r| r.by_id.values().map(|e| e.blocks.lock().heap_bytes()).sum());
        self.holders.table_bytes() + workers
    }

    /// Visits every indexed block of every worker: (worker, engine hash, prefix hash or `None`
    /// when the namespace is unknown, namespace seed, tiers). For digests and snapshots.
    pub fn for_each_block(
        &self,
        mut f: impl FnMut(&WorkerId, EngineBlockHash, Option<SequenceHash>, Option<HashSeed>, u8),
    ) {
        let entries: Vec<Arc<WorkerEntry>> =
            self.with_registry(|r| r.by_id.values().cloned().collect());
        for entry in entries {
            let blocks = entry.blocks.lock();
            for (h, e) in blocks.entries() {
                let seed = blocks.seed_of(e.ns());
                let seq = seed.map(|_| e.seq());
                f(&entry.id, h, seq, seed, e.tiers());
            }
        }
    }
}

/// One block of a worker, as a snapshot carries it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ExportedBlock {
    /// The engine's hash of the block.
    pub engine: EngineBlockHash,
    /// Its prefix hash (meaningless when `ns` is 0).
    pub seq: SequenceHash,
    /// Position + 1 of its namespace seed in the worker's seed list; 0 = unknown namespace.
    pub ns: u32,
    /// Tier bits: 1 device, 2 offload.
    pub tiers: u8,
}

/// One worker's blocks and namespace seeds, copied at one instant.
#[derive(Clone, Debug, Default)]
pub struct WorkerExport {
    /// The namespace seeds its blocks refer to.
    pub seeds: Vec<HashSeed>,
    /// Its blocks.
    pub blocks: Vec<ExportedBlock>,
}

impl KvIndex {
    /// Copies one worker's state (under its write lock, so between two events). The copy is
    /// 24 bytes per block: bounded by one worker's share, never by the whole index.
    pub fn export_worker(&self, id: &WorkerId) -> Result<WorkerExport, IndexError> {
        let entry = self.entry(id)?;
        let blocks = entry.blocks.lock();
        let mut out = WorkerExport {
            seeds: Vec::new(),
            blocks: Vec::with_capacity(blocks.len()),
        };
        let mut positions: HashMap<u32, u32> = HashMap::new();
        for (engine, e) in blocks.entries() {
            let ns = match blocks.seed_of(e.ns()) {
                None => 0,
                Some(seed) => *positions.entry(e.ns()).or_insert_with(|| {
                    out.seeds.push(seed);
                    out.seeds.len() as u32
                }),
            };
            out.blocks.push(ExportedBlock {
                engine,
                seq: e.seq(),
                ns,
                tiers: e.tiers(),
            });
        }
        Ok(out)
    }

    /// Adds exported blocks to a registered worker (a snapshot's chunk). Blocks the worker
    /// already holds and blocks naming a seed outside `seeds` are skipped; returns how many were
    /// restored. The limits apply as for events: a block past the index's capacity or the
    /// worker's `max_blocks_per_worker` is skipped and counted (`rejected_capacity`), whatever
    /// its namespace, so a peer's snapshot cannot make the index outgrow them.
    pub fn restore_blocks(
        &self,
        id: &WorkerId,
        seeds: &[HashSeed],
        run: &[ExportedBlock],
    ) -> Result<usize, IndexError> {
        let entry = self.entry(id)?;
        let mut blocks = entry.blocks.lock();
        if entry.retired.load(Ordering::Relaxed) {
            return Err(IndexError::UnknownWorker(*id));
        }
        let mut restored = 0;
        for b in run {
            let tiers = b.tiers & 0b11;
            if tiers == 0 || blocks.get(b.engine).is_some() {
                continue;
            }
            if blocks.len() >= self.limits.max_blocks_per_worker {
                self.counters
                    .rejected_capacity
                    .fetch_add(1, Ordering::Relaxed);
                continue;
            }
            if b.ns == 0 {
                blocks.insert(
                    b.engine,
                    BlockEntry::new(SequenceHash(0), UNKNOWN_NS, tiers),
                );
                restored += 1;
                continue;
            }
            let Some(&seed) = seeds.get(b.ns as usize - 1) else {
                self.counters.malformed.fetch_add(1, Ordering::Relaxed);
                continue;
            };
            if self.pairs.load(Ordering::Relaxed) >= self.limits.capacity {
                self.counters
                    .rejected_capacity
                    .fetch_add(1, Ordering::Relaxed);
                continue;
            }
            let ns = blocks.acquire_namespace(seed, 1);
            if ns == UNKNOWN_NS {
                // Out of namespace ids: kept uncredited (fail closed), as `store` does.
                blocks.insert(
                    b.engine,
                    BlockEntry::new(SequenceHash(0), UNKNOWN_NS, tiers),
                );
                restored += 1;
                continue;
            }
            blocks.insert(b.engine, BlockEntry::new(b.seq, ns, tiers));
            for bit in [0b01, 0b10] {
                if tiers & bit != 0
                    && self.holders.insert(b.seq.0, entry.slot, bit) == Inserted::NewPair
                {
                    self.pairs.fetch_add(1, Ordering::Relaxed);
                }
            }
            restored += 1;
        }
        Ok(restored)
    }
}

impl KvIndex {
    /// An order-independent digest of everything the index holds (worker, engine hash, prefix
    /// hash, namespace seed, tiers), and the number of blocks. Two replicas that applied the same
    /// events have equal digests, whatever the order they learned them in. Reveals no salt.
    pub fn digest(&self) -> (u64, usize) {
        let mut acc = 0u64;
        let mut n = 0usize;
        self.for_each_block(|w, h, seq, seed, tiers| {
            let mut buf = [0u8; 48];
            buf[..22].copy_from_slice(&w.key_bytes());
            buf[22] = tiers;
            buf[23] = u8::from(seq.is_some());
            buf[24..32].copy_from_slice(&h.0.to_le_bytes());
            buf[32..40].copy_from_slice(&seq.map_or(0, |s| s.0).to_le_bytes());
            buf[40..48].copy_from_slice(&seed.map_or(0, |s| s.0).to_le_bytes());
            acc = acc.wrapping_add(xxhash_rust::xxh3::xxh3_64(&buf));
            n += 1;
        });
        (acc, n)
    }
}

impl Drop for KvIndex {
    fn drop(&mut self) {
        // SAFETY: exclusive access; no reader can hold the registry any more.
        unsafe {
            let guard = epoch::unprotected();
            let r = self
                .registry
                .swap(epoch::Shared::null(), Ordering::Relaxed, guard);
            if !r.is_null() {
                drop(r.into_owned());
            }
        }
    }
}

#[cfg(test)]
mod tests;
