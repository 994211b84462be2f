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

/// The blocks of one worker.
#[derive(Default)]
pub struct WorkerBlocks {
    map: HashMap<Key, BlockEntry, MixBuild>,
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
        self.map.len()
    }

    /// Whether the worker holds no blocks.
    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }

    /// How a continuation of `parent` must be decoded.
    pub fn parent(&self, parent: EngineBlockHash) -> ParentState {
        match self.map.get(&Key::from(parent)) {
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
        self.map.get_mut(&Key::from(hash))
    }

    /// Adds a new entry. The namespace reference must already be acquired.
    pub fn insert(&mut self, hash: EngineBlockHash, entry: BlockEntry) {
        self.map.insert(Key::from(hash), entry);
    }

    /// Drops an entry and its namespace reference.
    pub fn remove(&mut self, hash: EngineBlockHash) -> Option<BlockEntry> {
        let e = self.map.remove(&Key::from(hash))?;
        self.namespaces.release(e.ns());
        Some(e)
    }

    /// Releases a namespace reference acquired for an entry that was not inserted after all.
    pub fn release_namespace(&mut self, ns: u32) {
        self.namespaces.release(ns);
    }

    /// Empties the worker, returning every entry so the caller can unindex them.
    pub fn drain(&mut self) -> Vec<BlockEntry> {
        let out = std::mem::take(&mut self.map).into_values().collect();
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

    /// Approximate heap bytes: the map's buckets plus the namespace tables.
    pub fn heap_bytes(&self) -> usize {
        let bucket = std::mem::size_of::<(Key, BlockEntry)>() + 1;
        self.map.capacity() * bucket + self.namespaces.seeds.capacity() * 12
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
