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

use crate::hashing::{HashSeed, SequenceHash};

/// Bits of an interned namespace id in a map slot.
const NS_BITS: u32 = 22;

/// The namespace id of blocks whose tenant cannot be known (parent never seen). Also what
/// [`WorkerBlocks::acquire_namespace`] returns when the worker has no id left (more than
/// ~4 million live namespaces, which needs as many blocks): those blocks fail closed.
pub const UNKNOWN_NS: u32 = (1 << NS_BITS) - 1;

/// An engine's identifier for one block (vLLM's u64 form, or a digest folded to 64 bits).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct EngineBlockHash(pub u64);

/// What the index remembers of one engine block: its prefix hash, namespace id and tiers. A map
/// slot stores it in 11 bytes beside its engine hash.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BlockEntry {
    seq: SequenceHash,
    ns_tiers: u32,
}

impl BlockEntry {
    /// Packs a prefix hash, a namespace id (below 2^22) and a tier mask.
    pub fn new(seq: SequenceHash, ns: u32, tiers: u8) -> Self {
        debug_assert!(ns <= UNKNOWN_NS);
        BlockEntry {
            seq,
            ns_tiers: ((ns & UNKNOWN_NS) << 2) | u32::from(tiers & 0b11),
        }
    }
    /// The prefix hash (meaningless when the namespace is unknown).
    pub fn seq(&self) -> SequenceHash {
        self.seq
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
                    None if self.seeds.len() >= UNKNOWN_NS as usize => return UNKNOWN_NS,
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

/// One worker's engine hash → entry map: bucketized cuckoo hashing (buckets of [`BUCKET`]
/// slots, each key in one of two buckets), 19-byte slots without control bytes or padding,
/// filled up to 15/16 and grown by a quarter, so a block costs ~19/0.84 bytes where a doubling
/// map sits at 0.44–0.875 full. A lookup reads at most two buckets; an insert into two full
/// buckets first looks for a resident whose other bucket has room and moves it there (one
/// move), and only when none has walks at random (the map grows if the walk does not end).
/// Growing places each entry straight into the emptier of its two buckets of the new table.
/// Used only under the worker's lock, so entries may move. Keys are mixed with two per-map
/// secrets (see [`BlockMap::homes`]), so an engine cannot aim its hashes at one bucket.
#[derive(Default)]
struct BlockMap {
    slots: Box<[Slot]>,
    len: usize,
    /// Secrets of [`BlockMap::homes`]: for each of its two rounds, a value XORed in and an odd
    /// multiplier.
    secret: u64,
    fold: u64,
    secret2: u64,
    fold2: u64,
    /// State of the walk's victim choice (xorshift).
    rng: u64,
}

/// Slots per bucket.
const BUCKET: usize = 4;
/// Most slots filled, as a fraction.
const MAP_LOAD: (usize, usize) = (15, 16);
/// Moves an insert may make before the map grows instead.
const MAX_KICKS: usize = 128;

/// A map slot: the engine hash (8 bytes), the prefix hash (8) and the namespace id with the
/// tiers (3: 22 + 2 bits), little-endian bytes so the slot has no padding; empty while the last
/// three bytes are 0 (a stored entry always has a tier).
#[derive(Clone, Copy)]
struct Slot([u8; SLOT_BYTES]);

const SLOT_BYTES: usize = 19;
const EMPTY: Slot = Slot([0; SLOT_BYTES]);

/// Smallest non-empty map (two buckets).
const MAP_MIN: usize = 2 * BUCKET;

impl Slot {
    fn new(key: u64, entry: BlockEntry) -> Slot {
        let mut b = [0; SLOT_BYTES];
        b[..8].copy_from_slice(&key.to_le_bytes());
        b[8..16].copy_from_slice(&entry.seq.0.to_le_bytes());
        b[16..].copy_from_slice(&entry.ns_tiers.to_le_bytes()[..3]);
        Slot(b)
    }
    fn key(&self) -> u64 {
        u64::from_le_bytes(self.0[..8].try_into().expect("8 bytes"))
    }
    fn entry(&self) -> BlockEntry {
        let [a, b, c] = [self.0[16], self.0[17], self.0[18]];
        BlockEntry {
            seq: SequenceHash(u64::from_le_bytes(
                self.0[8..16].try_into().expect("8 bytes"),
            )),
            ns_tiers: u32::from_le_bytes([a, b, c, 0]),
        }
    }
    /// The tier bits are the low bits of byte 16, and a stored entry has a tier.
    fn is_empty(&self) -> bool {
        self.0[16] & 0b11 == 0
    }
}

impl BlockMap {
    fn buckets(&self) -> usize {
        self.slots.len() / BUCKET
    }

    /// The key's two buckets (distinct when there are two or more).
    fn homes(&self, key: u64) -> [usize; 2] {
        // Two rounds of a folded multiply (the halves of the full 128-bit product XORed) under
        // the map's secrets: two multiplies in a row where the finalizer chain it replaced had
        // three, 4-6% more events applied per second on the peers bench (alternated builds;
        // one round alone was faster still, but put 10,000 sequential or top-bits-only keys in
        // as few as a tenth of 16,384 buckets in the test below, which an engine could use to
        // make the map grow).
        let fold = |x: u64, m: u64| {
            let p = u128::from(x) * u128::from(m);
            (p as u64) ^ ((p >> 64) as u64)
        };
        let h = fold(
            fold(key ^ self.secret, self.fold) ^ self.secret2,
            self.fold2,
        );
        let n = self.buckets();
        // Range reduction for any bucket count (not only powers of two), one half of the
        // hash per bucket.
        let a = ((h & 0xffff_ffff) * n as u64) >> 32;
        let b = ((h >> 32) * n as u64) >> 32;
        let b = if a == b { (b + 1) % n as u64 } else { b };
        [a as usize, b as usize]
    }

    /// The slots of bucket `b`.
    fn bucket(&self, b: usize) -> &[Slot] {
        &self.slots[b * BUCKET..][..BUCKET]
    }

    fn find(&self, key: u64) -> Option<usize> {
        if self.slots.is_empty() {
            return None;
        }
        self.homes(key).into_iter().find_map(|b| {
            let j = self
                .bucket(b)
                .iter()
                .position(|s| !s.is_empty() && s.key() == key)?;
            Some(b * BUCKET + j)
        })
    }

    fn get(&self, key: u64) -> Option<BlockEntry> {
        self.find(key).map(|i| self.slots[i].entry())
    }

    /// Inserts or replaces.
    fn insert(&mut self, key: u64, entry: BlockEntry) {
        match self.find(key) {
            Some(i) => self.slots[i] = Slot::new(key, entry),
            None => self.add(key, entry),
        }
    }

    /// Inserts a key the map does not hold.
    fn add(&mut self, key: u64, entry: BlockEntry) {
        debug_assert!(entry.tiers() != 0, "a stored entry has a tier");
        debug_assert!(self.find(key).is_none());
        if (self.len + 1) * MAP_LOAD.1 > self.slots.len() * MAP_LOAD.0 {
            self.grow();
        }
        let mut carry = Slot::new(key, entry);
        // The walk did not end: grow, then place what it carries now.
        while let Err(left) = self.place(carry) {
            carry = left;
            self.grow();
        }
        self.len += 1;
    }

    /// Puts a slot not in the map into a free slot of one of its buckets, moving residents
    /// to their other bucket when both are full. Returns the bucket that has one more slot
    /// filled, or the slot left over when the walk gives up (the map then holds the others).
    fn place(&mut self, carry: Slot) -> Result<usize, Slot> {
        let homes = self.homes(carry.key());
        for b in homes {
            if let Some(i) = self.free_slot(b) {
                self.slots[i] = carry;
                return Ok(b);
            }
        }
        // Both full: a resident whose other bucket has room moves there (one move, the
        // common case), else a random walk.
        if let Some((i, to)) = self.make_room(homes) {
            self.slots[i] = carry;
            return Ok(to);
        }
        self.walk(carry, homes)
    }

    /// Bucket `b`'s first free slot.
    fn free_slot(&self, b: usize) -> Option<usize> {
        let j = self.bucket(b).iter().position(Slot::is_empty)?;
        Some(b * BUCKET + j)
    }

    /// Moves one resident of the two full buckets `homes` to its other bucket if that one has
    /// room; returns the slot it left and the bucket it went to.
    fn make_room(&mut self, homes: [usize; 2]) -> Option<(usize, usize)> {
        for b in homes {
            for i in b * BUCKET..(b + 1) * BUCKET {
                let [x, y] = self.homes(self.slots[i].key());
                let other = if x == b { y } else { x };
                if let Some(to) = self.free_slot(other) {
                    self.slots[to] = self.slots[i];
                    return Some((i, other));
                }
            }
        }
        None
    }

    /// The random walk for a slot whose buckets and their residents' other buckets are full:
    /// evicts a random resident of the bucket the carried slot did not come from, and so on.
    fn walk(&mut self, mut carry: Slot, mut homes: [usize; 2]) -> Result<usize, Slot> {
        let mut from = usize::MAX;
        for _ in 0..MAX_KICKS {
            let b = if homes[0] == from { homes[1] } else { homes[0] };
            self.rng ^= self.rng << 13;
            self.rng ^= self.rng >> 7;
            self.rng ^= self.rng << 17;
            let i = b * BUCKET + (self.rng % BUCKET as u64) as usize;
            std::mem::swap(&mut self.slots[i], &mut carry);
            from = b;
            homes = self.homes(carry.key());
            for b in homes {
                if let Some(j) = self.free_slot(b) {
                    self.slots[j] = carry;
                    return Ok(b);
                }
            }
        }
        Err(carry)
    }

    fn grow(&mut self) {
        let cap = (self.slots.len() * 5 / 4).max(MAP_MIN);
        self.resize(cap);
    }

    fn remove(&mut self, key: u64) -> Option<BlockEntry> {
        let i = self.find(key)?;
        let removed = self.slots[i].entry();
        self.slots[i] = EMPTY;
        self.len -= 1;
        let cap = self.slots.len();
        if self.len == 0 {
            self.slots = Box::default();
        } else if cap > MAP_MIN && self.len * 4 < cap {
            self.resize(self.len * 2);
        }
        Some(removed)
    }

    /// Moves every entry into a table of at least `cap` slots (more if a walk does not end).
    fn resize(&mut self, cap: usize) {
        if self.secret == 0 {
            self.secret = rand::random::<u64>() | 1;
            self.fold = rand::random::<u64>() | 1;
            self.secret2 = rand::random::<u64>();
            self.fold2 = rand::random::<u64>() | 1;
            self.rng = rand::random::<u64>() | 1;
        }
        let mut cap = cap.max(MAP_MIN).next_multiple_of(BUCKET);
        let old = std::mem::take(&mut self.slots);
        'size: loop {
            // SAFETY: a slot is bytes; all zero is `EMPTY`.
            self.slots = unsafe { super::pages::zeroed::<Slot>(cap) };
            // Slots filled per bucket: nothing is removed meanwhile, so a bucket's free slots
            // are its last ones and an entry goes straight to the emptier of its two buckets
            // (which also leaves fewer full buckets for the inserts that follow).
            // SAFETY: any byte is a valid `u8`.
            let mut fill = unsafe { super::pages::zeroed::<u8>(cap / BUCKET) };
            for s in old.iter().filter(|s| !s.is_empty()) {
                let [x, y] = self.homes(s.key());
                let b = if fill[y] < fill[x] { y } else { x };
                if usize::from(fill[b]) < BUCKET {
                    self.slots[b * BUCKET + usize::from(fill[b])] = *s;
                    fill[b] += 1;
                } else {
                    match self.place(*s) {
                        Ok(b) => fill[b] += 1,
                        Err(_) => {
                            cap = (cap * 5 / 4).next_multiple_of(BUCKET);
                            continue 'size;
                        }
                    }
                }
            }
            return;
        }
    }

    fn iter(&self) -> impl Iterator<Item = (u64, BlockEntry)> + '_ {
        self.slots
            .iter()
            .filter(|s| !s.is_empty())
            .map(|s| (s.key(), s.entry()))
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
        match self.map.get(parent.0) {
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
    pub fn get(&self, hash: EngineBlockHash) -> Option<BlockEntry> {
        self.map.get(hash.0)
    }

    /// Adds a new entry (the namespace reference must already be acquired), or replaces the
    /// entry of a known block (its namespace reference carries over).
    pub fn insert(&mut self, hash: EngineBlockHash, entry: BlockEntry) {
        self.map.insert(hash.0, entry);
    }

    /// Adds the entry of a block the worker does not hold (the namespace reference must
    /// already be acquired); cheaper than [`WorkerBlocks::insert`] when the caller just looked.
    pub fn add(&mut self, hash: EngineBlockHash, entry: BlockEntry) {
        self.map.add(hash.0, entry);
    }

    /// Drops an entry and its namespace reference.
    pub fn remove(&mut self, hash: EngineBlockHash) -> Option<BlockEntry> {
        let e = self.map.remove(hash.0)?;
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
            .map(|(_, e)| e)
            .collect();
        self.namespaces = Namespaces::default();
        out
    }

    /// Every (engine hash, entry), for snapshots and digests.
    pub fn entries(&self) -> impl Iterator<Item = (EngineBlockHash, BlockEntry)> + '_ {
        self.map.iter().map(|(k, e)| (EngineBlockHash(k), e))
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
        assert_eq!(std::mem::size_of::<Slot>(), 19);
        let s = Slot::new(u64::MAX - 1, e);
        assert_eq!((s.key(), s.entry()), (u64::MAX - 1, e));
        assert!(!s.is_empty());
        let unknown = BlockEntry::new(SequenceHash(0), UNKNOWN_NS, 1);
        assert_eq!(Slot::new(0, unknown).entry().ns(), UNKNOWN_NS);
    }

    /// Sequential engine hashes (and hashes differing in their top bits alone) spread over the
    /// buckets like random ones, under any secrets.
    #[test]
    fn sequential_engine_hashes_spread() {
        for _ in 0..8 {
            let mut map = BlockMap::default();
            map.resize(4 * 16_384);
            for keys in [
                (0..10_000u64).collect::<Vec<_>>(),
                (0..10_000u64).map(|i| i << 50).collect(),
            ] {
                let mut first = std::collections::HashSet::new();
                let mut second = std::collections::HashSet::new();
                for &k in &keys {
                    let [a, b] = map.homes(k);
                    assert_ne!(a, b);
                    first.insert(a);
                    second.insert(b);
                }
                // 10,000 keys into 16,384 buckets: a random function fills about 7,490.
                assert!(first.len() > 7200, "first buckets spread: {}", first.len());
                assert!(
                    second.len() > 7200,
                    "second buckets spread: {}",
                    second.len()
                );
            }
        }
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
                    map.insert(key, e);
                    model.insert(key, e);
                } else {
                    assert_eq!(map.remove(key), model.remove(&key));
                }
                assert_eq!(map.len, model.len());
            }
            for (&k, e) in &model {
                assert_eq!(map.get(k), Some(*e));
            }
            assert_eq!(map.iter().count(), model.len());
            assert!(map.len * MAP_LOAD.1 <= map.slots.len() * MAP_LOAD.0);
            // Empty it: the slots go.
            let keys: Vec<u64> = model.keys().copied().collect();
            for k in keys {
                assert!(map.remove(k).is_some());
                model.remove(&k);
                assert!(map.slots.is_empty() || map.len * 4 >= map.slots.len() / 2);
            }
            assert_eq!((map.len, map.slots.len()), (0, 0));
        }
    }

    #[test]
    fn a_worker_out_of_namespace_ids_gets_the_unknown_one() {
        let mut n = Namespaces {
            seeds: vec![HashSeed(0); UNKNOWN_NS as usize - 1],
            refs: vec![1; UNKNOWN_NS as usize - 1],
            ..Namespaces::default()
        };
        // The last id below the unknown one is still given out, then no more.
        assert_eq!(n.acquire(HashSeed(1), 1), UNKNOWN_NS - 1);
        assert_eq!(n.acquire(HashSeed(2), 1), UNKNOWN_NS);
        assert_eq!(
            n.acquire(HashSeed(1), 1),
            UNKNOWN_NS - 1,
            "known seeds keep their id"
        );
        n.release(UNKNOWN_NS);
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
