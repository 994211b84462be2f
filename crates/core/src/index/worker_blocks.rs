//! One worker's blocks as the engine names them: engine block hash → our prefix hash, namespace
//! and tiers.
//!
//! The engine's hashes are opaque identifiers; we keep them only to apply removals and to find the
//! parent of a continuation event. Each entry also remembers its namespace (the local-hash seed of
//! its tenant and adapter), interned per worker, because a continuation event carries no salt and
//! must inherit its parent's.
//!
//! Invariant: an entry with [`UNKNOWN_NS`] has no prefix hash in the holder table and is never
//! credited to anyone (fail closed); its descendants inherit the unknown namespace. The index
//! may later re-key such an entry under a trusted namespace (an orphan repaired by a
//! re-announcement), never the other way round, and never from one trusted namespace to another.

use std::collections::HashMap;
use std::hash::{BuildHasher, Hasher};

use crate::hashing::{HashSeed, SequenceHash};

/// The namespace id of blocks whose tenant cannot be known (parent never seen).
pub const UNKNOWN_NS: u32 = (1 << 30) - 1;

/// An engine's identifier for one block (vLLM's u64 form, or a digest folded to 64 bits).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct EngineBlockHash(pub u64);

/// What the index remembers of one engine block. 12 bytes, 4-byte aligned, so a map entry with
/// its key is 20 bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BlockEntry {
    seq: [u32; 2],
    ns_tiers: u32,
}

impl BlockEntry {
    /// Packs a prefix hash, a namespace id and a tier mask.
    pub fn new(seq: SequenceHash, ns: u32, tiers: u8) -> Self {
        BlockEntry {
            seq: [seq.0 as u32, (seq.0 >> 32) as u32],
            ns_tiers: (ns << 2) | u32::from(tiers & 0b11),
        }
    }
    /// The prefix hash (meaningless when the namespace is unknown).
    pub fn seq(&self) -> SequenceHash {
        SequenceHash(u64::from(self.seq[0]) | (u64::from(self.seq[1]) << 32))
    }
    /// The interned namespace id.
    pub fn ns(&self) -> u32 {
        self.ns_tiers >> 2
    }
    /// Tiers the worker holds the block in.
    pub fn tiers(&self) -> u8 {
        (self.ns_tiers & 0b11) as u8
    }
    /// Replaces the tier mask.
    pub fn set_tiers(&mut self, tiers: u8) {
        self.ns_tiers = (self.ns_tiers & !0b11) | u32::from(tiers & 0b11);
    }
}

/// Map key with 4-byte alignment (keeps entries at 20 bytes).
#[derive(Clone, Copy, PartialEq, Eq)]
struct Key([u32; 2]);

impl std::hash::Hash for Key {
    fn hash<H: Hasher>(&self, state: &mut H) {
        // One u64, so the hasher's finalizer sees every bit (engines may number blocks 1, 2, 3).
        state.write_u64(u64::from(self.0[0]) | (u64::from(self.0[1]) << 32));
    }
}

impl From<EngineBlockHash> for Key {
    fn from(h: EngineBlockHash) -> Self {
        Key([h.0 as u32, (h.0 >> 32) as u32])
    }
}

/// A fast hasher for keys that are already hashes; the finalizer still mixes, so sequential test
/// ids spread too.
#[derive(Clone, Copy, Default)]
pub struct MixHasher(u64);

impl Hasher for MixHasher {
    fn finish(&self) -> u64 {
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    fn write(&mut self, bytes: &[u8]) {
        self.0 = xxhash_rust::xxh3::xxh3_64_with_seed(bytes, self.0);
    }
    fn write_u32(&mut self, v: u32) {
        self.write_u64(u64::from(v));
    }
    fn write_u64(&mut self, v: u64) {
        // Absorb then mix, so several writes do not cancel out.
        self.0 = (self.0 ^ v)
            .wrapping_mul(0x9e37_79b9_7f4a_7c15)
            .rotate_left(29);
    }
}

/// Builds [`MixHasher`]s.
#[derive(Clone, Copy, Default)]
pub struct MixBuild;

impl BuildHasher for MixBuild {
    type Hasher = MixHasher;
    fn build_hasher(&self) -> MixHasher {
        MixHasher(0)
    }
}

/// Per-worker namespace interning with exact reference counts.
#[derive(Default)]
struct Namespaces {
    seeds: Vec<HashSeed>,
    refs: Vec<u32>,
    by_seed: HashMap<HashSeed, u32>,
    free: Vec<u32>,
}

impl Namespaces {
    fn acquire(&mut self, seed: HashSeed, count: u32) -> u32 {
        let id = match self.by_seed.get(&seed) {
            Some(&id) => id,
            None => {
                let id = match self.free.pop() {
                    Some(id) => {
                        self.seeds[id as usize] = seed;
                        id
                    }
                    None => {
                        self.seeds.push(seed);
                        self.refs.push(0);
                        (self.seeds.len() - 1) as u32
                    }
                };
                self.by_seed.insert(seed, id);
                id
            }
        };
        self.refs[id as usize] += count;
        id
    }

    fn release(&mut self, id: u32) {
        if id == UNKNOWN_NS {
            return;
        }
        let r = &mut self.refs[id as usize];
        *r -= 1;
        if *r == 0 {
            self.by_seed.remove(&self.seeds[id as usize]);
            self.free.push(id);
        }
    }

    fn seed(&self, id: u32) -> Option<HashSeed> {
        (id != UNKNOWN_NS).then(|| self.seeds[id as usize])
    }
}

/// One worker's engine hash → entry map: open addressing with linear probing and
/// backward-shift deletion (no tombstones), 20-byte slots without control bytes, filled up to 7/8
/// and grown by half rather than doubled (shrunk below a quarter), so its memory stays near what
/// it holds (~0.6–0.875 full where a doubling map sits at 0.44–0.875). Used only under the
/// worker's lock. Keys are mixed with a per-map secret, so an engine cannot aim its hashes at
/// one probe run.
#[derive(Default)]
struct BlockMap {
    slots: Box<[Slot]>,
    len: usize,
    secret: u64,
}

/// A map slot: an engine hash and its entry; empty while the entry's word is 0 (a stored entry
/// always has a tier).
#[derive(Clone, Copy)]
struct Slot {
    key: Key,
    entry: BlockEntry,
}

const EMPTY: Slot = Slot {
    key: Key([0, 0]),
    entry: BlockEntry {
        seq: [0, 0],
        ns_tiers: 0,
    },
};

/// Smallest non-empty map.
const MAP_MIN: usize = 8;

impl Slot {
    fn is_empty(&self) -> bool {
        self.entry.ns_tiers == 0
    }
}

impl BlockMap {
    fn home(&self, key: Key) -> usize {
        let k = u64::from(key.0[0]) | (u64::from(key.0[1]) << 32);
        let mut h = MixHasher(self.secret);
        h.write_u64(k);
        // Range reduction for any capacity (not only powers of two).
        ((u128::from(h.finish()) * self.slots.len() as u128) >> 64) as usize
    }

    fn find(&self, key: Key) -> Option<usize> {
        if self.slots.is_empty() {
            return None;
        }
        let mut i = self.home(key);
        loop {
            let s = &self.slots[i];
            if s.is_empty() {
                return None;
            }
            if s.key == key {
                return Some(i);
            }
            i += 1;
            if i == self.slots.len() {
                i = 0;
            }
        }
    }

    fn get(&self, key: Key) -> Option<&BlockEntry> {
        self.find(key).map(|i| &self.slots[i].entry)
    }

    fn get_mut(&mut self, key: Key) -> Option<&mut BlockEntry> {
        self.find(key).map(|i| &mut self.slots[i].entry)
    }

    /// Inserts or replaces.
    fn insert(&mut self, key: Key, entry: BlockEntry) {
        debug_assert!(entry.ns_tiers != 0, "a stored entry has a tier");
        if (self.len + 1) * 8 > self.slots.len() * 7 {
            let cap = (self.slots.len() * 3 / 2).max(MAP_MIN);
            self.resize(cap);
        }
        let mut i = self.home(key);
        loop {
            let s = &mut self.slots[i];
            if s.is_empty() {
                *s = Slot { key, entry };
                self.len += 1;
                return;
            }
            if s.key == key {
                s.entry = entry;
                return;
            }
            i += 1;
            if i == self.slots.len() {
                i = 0;
            }
        }
    }

    fn remove(&mut self, key: Key) -> Option<BlockEntry> {
        let mut gap = self.find(key)?;
        let removed = self.slots[gap].entry;
        let cap = self.slots.len();
        // Backward shift: pull later members of the run into the gap when that keeps them at
        // or after their home, so every key stays reachable without tombstones.
        let mut j = gap;
        loop {
            j += 1;
            if j == cap {
                j = 0;
            }
            if self.slots[j].is_empty() {
                break;
            }
            let home = self.home(self.slots[j].key);
            let from_home = (j + cap - home) % cap;
            let from_gap = (j + cap - gap) % cap;
            if from_home >= from_gap {
                self.slots[gap] = self.slots[j];
                gap = j;
            }
        }
        self.slots[gap] = EMPTY;
        self.len -= 1;
        if self.len == 0 {
            self.slots = Box::default();
        } else if cap > MAP_MIN && self.len * 4 < cap {
            self.resize((self.len * 2).max(MAP_MIN));
        }
        Some(removed)
    }

    fn resize(&mut self, cap: usize) {
        let old = std::mem::replace(&mut self.slots, vec![EMPTY; cap].into_boxed_slice());
        if self.secret == 0 {
            self.secret = rand::random::<u64>() | 1;
        }
        self.len = 0;
        for s in old.iter().filter(|s| !s.is_empty()) {
            self.insert(s.key, s.entry);
        }
    }

    fn iter(&self) -> impl Iterator<Item = (Key, &BlockEntry)> {
        self.slots
            .iter()
            .filter(|s| !s.is_empty())
            .map(|s| (s.key, &s.entry))
    }
}

/// The blocks of one worker.
#[derive(Default)]
pub struct WorkerBlocks {
    map: BlockMap,
    namespaces: Namespaces,
}

/// A parent block as a continuation event sees it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ParentState {
    /// Known, with its namespace and prefix hash.
    Known {
        /// The namespace's local-hash seed.
        seed: HashSeed,
        /// The parent prefix's hash.
        seq: SequenceHash,
    },
    /// Known to this worker, but its namespace is unknown.
    UnknownNamespace,
    /// Never seen (or already removed).
    Missing,
}

impl WorkerBlocks {
    /// Number of blocks held (any tier, any namespace).
    pub fn len(&self) -> usize {
        self.map.len
    }

    /// Whether the worker holds no blocks.
    pub fn is_empty(&self) -> bool {
        self.map.len == 0
    }

    /// How a continuation of `parent` must be decoded.
    pub fn parent(&self, parent: EngineBlockHash) -> ParentState {
        match self.map.get(Key::from(parent)) {
            None => ParentState::Missing,
            Some(e) => match self.namespaces.seed(e.ns()) {
                Some(seed) => ParentState::Known { seed, seq: e.seq() },
                None => ParentState::UnknownNamespace,
            },
        }
    }

    /// Interns a namespace for `count` new entries.
    pub fn acquire_namespace(&mut self, seed: HashSeed, count: u32) -> u32 {
        self.namespaces.acquire(seed, count)
    }

    /// The entry of an engine block.
    pub fn get_mut(&mut self, hash: EngineBlockHash) -> Option<&mut BlockEntry> {
        self.map.get_mut(Key::from(hash))
    }

    /// Adds a new entry. The namespace reference must already be acquired.
    pub fn insert(&mut self, hash: EngineBlockHash, entry: BlockEntry) {
        self.map.insert(Key::from(hash), entry);
    }

    /// Drops an entry and its namespace reference.
    pub fn remove(&mut self, hash: EngineBlockHash) -> Option<BlockEntry> {
        let e = self.map.remove(Key::from(hash))?;
        self.namespaces.release(e.ns());
        Some(e)
    }

    /// Releases a namespace reference acquired for an entry that was not inserted after all.
    pub fn release_namespace(&mut self, ns: u32) {
        self.namespaces.release(ns);
    }

    /// Empties the worker, returning every entry so the caller can unindex them.
    pub fn drain(&mut self) -> Vec<BlockEntry> {
        let out = std::mem::take(&mut self.map)
            .iter()
            .map(|(_, e)| *e)
            .collect();
        self.namespaces = Namespaces::default();
        out
    }

    /// Every (engine hash, entry), for snapshots and digests.
    pub fn entries(&self) -> impl Iterator<Item = (EngineBlockHash, &BlockEntry)> {
        self.map.iter().map(|(k, e)| {
            (
                EngineBlockHash(u64::from(k.0[0]) | (u64::from(k.0[1]) << 32)),
                e,
            )
        })
    }

    /// The seed of an interned namespace id (`None` for [`UNKNOWN_NS`]).
    pub fn seed_of(&self, ns: u32) -> Option<HashSeed> {
        self.namespaces.seed(ns)
    }

    /// Approximate heap bytes: the map's slots plus the namespace tables.
    pub fn heap_bytes(&self) -> usize {
        self.map.slots.len() * std::mem::size_of::<Slot>() + self.namespaces.seeds.capacity() * 12
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entry_packing_round_trips() {
        let e = BlockEntry::new(SequenceHash(u64::MAX - 5), 12345, 3);
        assert_eq!(e.seq(), SequenceHash(u64::MAX - 5));
        assert_eq!(e.ns(), 12345);
        assert_eq!(e.tiers(), 3);
        assert_eq!(std::mem::size_of::<(Key, BlockEntry)>(), 20);
        assert_eq!(std::mem::size_of::<Slot>(), 20);
    }

    #[test]
    fn sequential_engine_hashes_spread() {
        use std::hash::BuildHasher;
        let b = MixBuild;
        let mut seen = std::collections::HashSet::new();
        for i in 0..10_000u64 {
            seen.insert(b.hash_one(Key::from(EngineBlockHash(i))) >> 50);
        }
        // 10,000 keys into 16,384 buckets: a random function fills about 7,490.
        assert!(seen.len() > 7200, "top bits spread: {}", seen.len());
    }

    #[test]
    fn block_map_matches_a_hash_map_through_growth_removal_and_shrinking() {
        let mut map = BlockMap::default();
        let mut model: HashMap<u64, BlockEntry> = HashMap::new();
        let mut rng = 0x1234_5678u64;
        let mut next = || {
            rng = rng.wrapping_add(0x9e37_79b9_7f4a_7c15);
            let mut z = rng;
            z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            z ^ (z >> 27)
        };
        for round in 0..3u64 {
            // Keys from a small range (many collisions of runs), some sequential.
            for _ in 0..20_000 {
                let r = next();
                let key = if r % 3 == 0 {
                    r % 64
                } else {
                    r % 5_000 + round
                };
                let e = BlockEntry::new(SequenceHash(r), (r % 7) as u32, 1 + (r % 3) as u8);
                if r % 5 < 3 {
                    map.insert(Key::from(EngineBlockHash(key)), e);
                    model.insert(key, e);
                } else {
                    assert_eq!(
                        map.remove(Key::from(EngineBlockHash(key))),
                        model.remove(&key)
                    );
                }
                assert_eq!(map.len, model.len());
            }
            for (&k, e) in &model {
                assert_eq!(map.get(Key::from(EngineBlockHash(k))), Some(e));
            }
            assert_eq!(map.iter().count(), model.len());
            assert!(map.len * 8 <= map.slots.len() * 7);
            // Empty it: the slots go.
            let keys: Vec<u64> = model.keys().copied().collect();
            for k in keys {
                assert!(map.remove(Key::from(EngineBlockHash(k))).is_some());
                model.remove(&k);
                assert!(map.slots.is_empty() || map.len * 4 >= map.slots.len() / 2);
            }
            assert_eq!((map.len, map.slots.len()), (0, 0));
        }
    }

    #[test]
    fn namespaces_are_refcounted_and_reused() {
        let mut w = WorkerBlocks::default();
        let a = w.acquire_namespace(HashSeed(1), 2);
        w.insert(EngineBlockHash(1), BlockEntry::new(SequenceHash(10), a, 1));
        w.insert(EngineBlockHash(2), BlockEntry::new(SequenceHash(11), a, 1));
        assert_eq!(
            w.parent(EngineBlockHash(2)),
            ParentState::Known {
                seed: HashSeed(1),
                seq: SequenceHash(11)
            }
        );
        w.remove(EngineBlockHash(1));
        w.remove(EngineBlockHash(2));
        let b = w.acquire_namespace(HashSeed(2), 1);
        assert_eq!(a, b, "freed id is reused");
        assert_eq!(w.parent(EngineBlockHash(9)), ParentState::Missing);
    }
}
