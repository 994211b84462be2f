//! The holder table: sequence hash → the workers (and tiers) that hold that prefix.
//!
//! A multimap stored as open addressing with linear probing: one slot per (prefix, worker) pair,
//! all pairs of one prefix in the same probe run. A slot is 12 bytes of atomics (8-byte
//! key, 4-byte holder), so a pair costs 12 bytes divided by the load factor.
//!
//! Concurrency: the table is split into a few shards by the key's top bits (few, so that each
//! shard's array is large enough for huge pages). Writers take the shard's mutex; readers take no
//! lock and never wait, retry or spin: a slot's key is written before its holder is published
//! (release/acquire) and never changes while the slot is in that table, and pairs never move
//! inside a table. A removed pair leaves a tombstone that keeps its key (only a pair of the same
//! key may take it again), so a probe run never breaks under a reader. Growing, shrinking or
//! clearing tombstones builds a new table while readers keep reading the old one (the writer
//! holds the mutex, so the old one no longer changes), then publishes it through an
//! epoch-managed pointer; the old table is freed once no reader can hold it, and the writer
//! drives that reclamation itself, so retired tables do not wait for some other thread's
//! activity. A reader therefore sees, for each key, the holders of one moment during its lookup.
//!
//! Invariants: a holder value of 0 marks an empty slot and [`TOMBSTONE`] a removed pair, so
//! tiers are never 0 in a stored holder; at most one live slot per (key, worker slot); a slot's
//! key never changes while it is non-empty; every table keeps at least one empty slot.

use std::sync::atomic::{AtomicU32, AtomicUsize, Ordering};

use crossbeam_epoch::{self as epoch, Atomic, Guard, Owned};
use parking_lot::Mutex;

/// Number of shards; a power of two. The key's top bits pick the shard.
pub const SHARDS: usize = 8;
const SHARD_BITS: u32 = SHARDS.trailing_zeros();
const MIN_CAPACITY: usize = 64;
/// Most slots (live or tombstone) a table may fill, as a fraction. A lookup of a multimap reads
/// its whole probe run (to the first empty slot), whose expected length grows as
/// 1/(1 - load)²: ~32 slots at 7/8, ~8 at 3/4.
const MAX_LOAD: (usize, usize) = (3, 4);
/// The holder value of a removed pair: its key stays, so probe runs stay whole for readers.
pub const TOMBSTONE: u32 = u32::MAX;
/// Worker slots a holder can carry (the all-ones slot is the tombstone's).
pub const MAX_SLOTS: u32 = (1 << 30) - 1;

/// A stored holder: worker slot in the high 30 bits, tier mask in the low 2.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Holder(pub u32);

impl Holder {
    /// Packs a worker slot and a non-empty tier mask.
    pub fn new(slot: u32, tiers: u8) -> Holder {
        debug_assert!(tiers & 0b11 != 0 && slot < MAX_SLOTS);
        Holder((slot << 2) | u32::from(tiers & 0b11))
    }
    /// The worker slot.
    pub fn slot(self) -> u32 {
        self.0 >> 2
    }
    /// The tier mask (bit 0: device, bit 1: offload).
    pub fn tiers(self) -> u8 {
        (self.0 & 0b11) as u8
    }
}

/// One slot: a 64-bit key split in two halves and a holder, 12 bytes with 4-byte alignment, so
/// a lookup touches one cache line (two at most) instead of one per parallel array.
struct Slot {
    key_lo: AtomicU32,
    key_hi: AtomicU32,
    holder: AtomicU32,
}

impl Slot {
    #[inline]
    fn key(&self) -> u64 {
        u64::from(self.key_lo.load(Ordering::Relaxed))
            | (u64::from(self.key_hi.load(Ordering::Relaxed)) << 32)
    }
    #[inline]
    fn holder(&self) -> u32 {
        self.holder.load(Ordering::Acquire)
    }
    /// Fills an empty slot: the key first, then the holder that publishes it.
    #[inline]
    fn set(&self, key: u64, holder: u32) {
        self.key_lo.store(key as u32, Ordering::Relaxed);
        self.key_hi.store((key >> 32) as u32, Ordering::Relaxed);
        self.holder.store(holder, Ordering::Release);
    }
}

struct Table {
    slots: SlotArray,
    mask: usize,
}

impl Table {
    fn with_capacity(cap: usize) -> Table {
        Table {
            slots: SlotArray::zeroed(cap),
            mask: cap - 1,
        }
    }

    fn bytes(&self) -> usize {
        self.slots.len() * std::mem::size_of::<Slot>()
    }
}

/// Size of a transparent huge page on x86-64 and aarch64 Linux.
const HUGE_PAGE: usize = 2 << 20;

/// A zeroed slot array. Arrays of 2 MiB or more are aligned to 2 MiB and advised for transparent
/// huge pages: a query touches one random slot per prompt block, so with 4 KiB pages nearly every
/// lookup is a TLB miss (and a two-level page walk under virtualization), which costs more than
/// the cache miss itself.
struct SlotArray {
    ptr: std::ptr::NonNull<Slot>,
    len: usize,
}

// SAFETY: the array owns its slots, which are atomics.
unsafe impl Send for SlotArray {}
// SAFETY: shared access only goes through atomics.
unsafe impl Sync for SlotArray {}

impl SlotArray {
    fn bytes(len: usize) -> usize {
        (len * std::mem::size_of::<Slot>()).max(1)
    }

    fn zeroed(len: usize) -> SlotArray {
        let bytes = Self::bytes(len);
        #[cfg(target_os = "linux")]
        if bytes >= HUGE_PAGE
            && let Some(ptr) = huge::map(bytes)
        {
            MAPPED_BYTES.fetch_add(bytes, Ordering::Relaxed);
            return SlotArray { ptr, len };
        }
        let layout = Self::small_layout(bytes);
        // SAFETY: non-zero size; an all-zero Slot is three zero atomics, a valid value.
        let raw = unsafe { std::alloc::alloc_zeroed(layout) };
        let Some(ptr) = std::ptr::NonNull::new(raw.cast::<Slot>()) else {
            std::alloc::handle_alloc_error(layout)
        };
        SlotArray { ptr, len }
    }

    fn small_layout(bytes: usize) -> std::alloc::Layout {
        std::alloc::Layout::from_size_align(bytes, std::mem::align_of::<Slot>())
            .expect("slot array layout")
    }

    fn len(&self) -> usize {
        self.len
    }

    fn as_ptr(&self) -> *const Slot {
        self.ptr.as_ptr()
    }
}

/// Bytes of slot arrays mapped directly (outside the global allocator), for memory accounting.
pub static MAPPED_BYTES: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

#[cfg(target_os = "linux")]
mod huge {
    use super::{HUGE_PAGE, Slot};
    use std::ptr::NonNull;

    /// Maps `bytes` of zeroed memory aligned to a huge page and advised for huge pages.
    pub(super) fn map(bytes: usize) -> Option<NonNull<Slot>> {
        let len = bytes + HUGE_PAGE;
        // SAFETY: a fresh private anonymous mapping; we own it entirely.
        let raw = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if raw == libc::MAP_FAILED {
            return None;
        }
        let start = raw as usize;
        let aligned = start.next_multiple_of(HUGE_PAGE);
        let end = aligned + bytes;
        // SAFETY: trimming unused head and tail pages of our own mapping.
        unsafe {
            if aligned > start {
                libc::munmap(raw, aligned - start);
            }
            let tail = start + len - end.next_multiple_of(4096);
            if tail > 0 {
                libc::munmap(end.next_multiple_of(4096) as *mut libc::c_void, tail);
            }
            libc::madvise(aligned as *mut libc::c_void, bytes, libc::MADV_HUGEPAGE);
        }
        NonNull::new(aligned as *mut Slot)
    }

    /// Unmaps an array from [`map`].
    pub(super) fn unmap(ptr: NonNull<Slot>, bytes: usize) {
        // SAFETY: `ptr..ptr+bytes` is exactly what `map` kept.
        unsafe { libc::munmap(ptr.as_ptr().cast(), bytes) };
    }
}

impl std::ops::Deref for SlotArray {
    type Target = [Slot];
    fn deref(&self) -> &[Slot] {
        // SAFETY: `len` initialised slots live at `ptr` for as long as `self`.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }
}

impl Drop for SlotArray {
    fn drop(&mut self) {
        let bytes = Self::bytes(self.len);
        #[cfg(target_os = "linux")]
        if bytes >= HUGE_PAGE {
            huge::unmap(self.ptr, bytes);
            MAPPED_BYTES.fetch_sub(bytes, Ordering::Relaxed);
            return;
        }
        // SAFETY: allocated in `zeroed` with this same layout.
        unsafe { std::alloc::dealloc(self.ptr.as_ptr().cast(), Self::small_layout(bytes)) };
    }
}

struct ShardState {
    /// Live pairs.
    len: usize,
    /// Non-empty slots: live pairs and tombstones.
    used: usize,
}

struct Shard {
    writer: Mutex<ShardState>,
    table: Atomic<Table>,
}

/// Tables replaced but not yet freed (all holder tables of the process).
static RETIRED: AtomicUsize = AtomicUsize::new(0);

/// The smallest table for `live` pairs at most half full (the size a shrinking table takes).
fn capacity_for(live: usize) -> usize {
    (live * 2).next_power_of_two().max(MIN_CAPACITY)
}

/// Frees retired tables that no reader can hold any more. Each round publishes this thread's
/// deferred frees and tries to advance the epoch; a reader pinned in a query (microseconds)
/// holds it back, so a few rounds suffice; the bound keeps a writer from waiting on a reader
/// that was descheduled mid-query (the next round, on any thread, frees them then).
pub fn reclaim_retired() {
    for round in 0..256 {
        if RETIRED.load(Ordering::Acquire) == 0 {
            return;
        }
        epoch::pin().flush();
        if round >= 8 {
            std::thread::yield_now();
        }
    }
}

/// Tables replaced and not yet freed, process-wide.
pub fn retired_tables() -> usize {
    RETIRED.load(Ordering::Acquire)
}

/// The sharded holder multimap of one model.
pub struct HolderTable {
    shards: Box<[Shard]>,
    /// Mixed into every key before choosing a slot, so crafted prompts cannot aim at one probe run.
    secret: u64,
}

/// What a [`HolderTable::insert`] changed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Inserted {
    /// A new (prefix, worker) pair.
    NewPair,
    /// The pair existed; its tiers were merged.
    Merged,
}

#[inline]
fn mix(x: u64) -> u64 {
    // splitmix64 finalizer: full avalanche, three multiplies' worth of work.
    let mut z = x;
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

impl HolderTable {
    /// An empty table.
    pub fn new() -> Self {
        let shards = (0..SHARDS)
            .map(|_| Shard {
                writer: Mutex::new(ShardState { len: 0, used: 0 }),
                table: Atomic::new(Table::with_capacity(MIN_CAPACITY)),
            })
            .collect();
        HolderTable {
            shards,
            secret: rand::random(),
        }
    }

    #[inline]
    fn locate(&self, key: u64) -> (&Shard, u64) {
        let m = mix(key ^ self.secret);
        (&self.shards[(m >> (64 - SHARD_BITS)) as usize], m)
    }

    /// Adds `tiers` for worker `slot` under `key`.
    pub fn insert(&self, key: u64, slot: u32, tiers: u8) -> Inserted {
        let (shard, m) = self.locate(key);
        let rebuilt = {
            let mut state = shard.writer.lock();
            let guard = epoch::pin();
            // SAFETY: only writers holding `writer` replace the table, and we hold it.
            let mut table = unsafe { shard.table.load(Ordering::Relaxed, &guard).deref() };
            let mut i = m as usize & table.mask;
            let mut reusable = None;
            loop {
                let h = table.slots[i].holder();
                if h == 0 {
                    break;
                }
                if table.slots[i].key() == key {
                    if h == TOMBSTONE {
                        reusable.get_or_insert(i);
                    } else if Holder(h).slot() == slot {
                        let merged = Holder::new(slot, Holder(h).tiers() | tiers);
                        table.slots[i].holder.store(merged.0, Ordering::Release);
                        return Inserted::Merged;
                    }
                }
                i = (i + 1) & table.mask;
            }
            let holder = Holder::new(slot, tiers).0;
            state.len += 1;
            if let Some(t) = reusable {
                // A tombstone of the same key: its key is already right for any reader.
                table.slots[t].holder.store(holder, Ordering::Release);
                return Inserted::NewPair;
            }
            let mut rebuilt = false;
            if (state.used + 1) * MAX_LOAD.1 > table.slots.len() * MAX_LOAD.0 {
                // Doubles when at least half the slots are live, else only drops tombstones:
                // the size then depends on the peak held, not on the order of past writes.
                let cap = table.slots.len();
                let cap = if state.len * 2 >= cap { cap * 2 } else { cap };
                table = self.rebuild(shard, &mut state, table, cap, &guard);
                rebuilt = true;
                i = m as usize & table.mask;
                while table.slots[i].holder() != 0 {
                    i = (i + 1) & table.mask;
                }
            }
            table.slots[i].set(key, holder);
            state.used += 1;
            rebuilt
        };
        if rebuilt {
            reclaim_retired();
        }
        Inserted::NewPair
    }

    /// Copies the live pairs into a new table of `cap` slots (dropping tombstones) and publishes
    /// it. Readers keep reading the old table meanwhile; it no longer changes (the caller holds
    /// the shard's writer lock) and is freed once no reader can hold it.
    fn rebuild<'g>(
        &self,
        shard: &Shard,
        state: &mut ShardState,
        old: &Table,
        cap: usize,
        guard: &'g Guard,
    ) -> &'g Table {
        let new = Table::with_capacity(cap);
        for slot in old.slots.iter() {
            let h = slot.holder();
            if h == 0 || h == TOMBSTONE {
                continue;
            }
            let k = slot.key();
            let mut i = mix(k ^ self.secret) as usize & new.mask;
            while new.slots[i].holder() != 0 {
                i = (i + 1) & new.mask;
            }
            new.slots[i].set(k, h);
        }
        state.used = state.len;
        let old_ptr = shard.table.swap(Owned::new(new), Ordering::AcqRel, guard);
        RETIRED.fetch_add(1, Ordering::AcqRel);
        // SAFETY: the old table is unlinked; readers that still see it are pinned, so it is freed
        // only after they unpin.
        unsafe {
            guard.defer_unchecked(move || {
                drop(old_ptr.into_owned());
                RETIRED.fetch_sub(1, Ordering::AcqRel);
            });
        }
        guard.flush();
        // SAFETY: just stored; only writers (holding the lock) replace it.
        unsafe { shard.table.load(Ordering::Relaxed, guard).deref() }
    }

    /// Clears `tiers` of worker `slot` under `key`. Returns the tiers that remain for that pair
    /// (`None` when the pair was not present; `Some(0)` when the pair is now gone).
    pub fn remove(&self, key: u64, slot: u32, tiers: u8) -> Option<u8> {
        let (shard, m) = self.locate(key);
        let shrunk = {
            let mut state = shard.writer.lock();
            let guard = epoch::pin();
            // SAFETY: see `insert`.
            let table = unsafe { shard.table.load(Ordering::Relaxed, &guard).deref() };
            let mut i = m as usize & table.mask;
            loop {
                let h = table.slots[i].holder();
                if h == 0 {
                    return None;
                }
                if h != TOMBSTONE && table.slots[i].key() == key && Holder(h).slot() == slot {
                    break;
                }
                i = (i + 1) & table.mask;
            }
            let left = Holder(table.slots[i].holder()).tiers() & !tiers;
            if left != 0 {
                table.slots[i]
                    .holder
                    .store(Holder::new(slot, left).0, Ordering::Release);
                return Some(left);
            }
            table.slots[i].holder.store(TOMBSTONE, Ordering::Release);
            state.len -= 1;
            // Memory follows what is held: a table a quarter of its useful size shrinks.
            let cap = table.slots.len();
            let shrink = cap > MIN_CAPACITY && state.len * 8 < cap;
            if shrink {
                let cap = capacity_for(state.len);
                self.rebuild(shard, &mut state, table, cap, &guard);
            }
            shrink
        };
        if shrunk {
            reclaim_retired();
        }
        Some(0)
    }

    /// Appends every holder of `key` to `out`: each pair as it stood at one moment of the
    /// lookup. Never waits for a writer.
    #[inline]
    pub fn lookup(&self, key: u64, guard: &Guard, out: &mut Vec<Holder>) {
        self.for_each(key, guard, |h| out.push(h));
    }

    /// Calls `f` with every holder of `key`, as [`HolderTable::lookup`] finds them.
    #[inline]
    pub fn for_each(&self, key: u64, guard: &Guard, mut f: impl FnMut(Holder)) {
        let (shard, m) = self.locate(key);
        // SAFETY: the pointer is always valid while pinned (replaced tables are deferred).
        let table = unsafe { shard.table.load(Ordering::Acquire, guard).deref() };
        let mut i = m as usize & table.mask;
        // Every table keeps an empty slot; the bound is belt and braces.
        for _ in 0..=table.mask {
            let h = table.slots[i].holder();
            if h == 0 {
                break;
            }
            if h != TOMBSTONE && table.slots[i].key() == key {
                f(Holder(h));
            }
            i = (i + 1) & table.mask;
        }
    }

    /// Hints the CPU to fetch the home slot of `key`, so a later lookup finds it in cache.
    #[inline]
    pub fn prefetch(&self, key: u64, guard: &Guard) {
        #[cfg(target_arch = "x86_64")]
        {
            let (shard, m) = self.locate(key);
            // SAFETY: valid while pinned; prefetching never faults even on a stale address.
            let table = unsafe { shard.table.load(Ordering::Acquire, guard).deref() };
            let i = m as usize & table.mask;
            use std::arch::x86_64::{_MM_HINT_T0, _mm_prefetch};
            // SAFETY: prefetch is a hint with no memory-safety requirements.
            unsafe {
                _mm_prefetch(table.slots.as_ptr().add(i).cast::<i8>(), _MM_HINT_T0);
            }
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            let _ = (key, guard);
        }
    }

    /// Heap bytes held by the slot arrays (all shards).
    pub fn table_bytes(&self) -> usize {
        let guard = epoch::pin();
        self.shards
            .iter()
            .map(|s| {
                let _lock = s.writer.lock();
                // SAFETY: valid while pinned.
                unsafe { s.table.load(Ordering::Acquire, &guard).deref() }.bytes()
            })
            .sum()
    }

    /// Occupied slots: the number of (prefix, worker) pairs.
    pub fn len(&self) -> usize {
        self.shards.iter().map(|s| s.writer.lock().len).sum()
    }

    /// Whether no pair is stored.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl Default for HolderTable {
    fn default() -> Self {
        Self::new()
    }
}

impl Drop for HolderTable {
    fn drop(&mut self) {
        // SAFETY: we have exclusive access; no reader can hold these tables any more.
        unsafe {
            let guard = epoch::unprotected();
            for shard in self.shards.iter() {
                let t = shard
                    .table
                    .swap(epoch::Shared::null(), Ordering::Relaxed, guard);
                if !t.is_null() {
                    drop(t.into_owned());
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn holders(t: &HolderTable, key: u64) -> Vec<(u32, u8)> {
        let guard = epoch::pin();
        let mut out = Vec::new();
        t.lookup(key, &guard, &mut out);
        let mut v: Vec<_> = out.into_iter().map(|h| (h.slot(), h.tiers())).collect();
        v.sort();
        v
    }

    #[test]
    fn large_arrays_are_zeroed_mapped_and_released() {
        let before = MAPPED_BYTES.load(Ordering::Relaxed);
        let a = SlotArray::zeroed(300_000);
        assert!(a.iter().all(|s| s.holder() == 0 && s.key() == 0));
        a[299_999].set(u64::MAX, 5);
        assert_eq!((a[299_999].key(), a[299_999].holder()), (u64::MAX, 5));
        #[cfg(target_os = "linux")]
        assert!(MAPPED_BYTES.load(Ordering::Relaxed) >= before + 300_000 * 12);
        drop(a);
        let small = SlotArray::zeroed(10);
        assert_eq!(small.len(), 10);
    }

    #[test]
    fn insert_merge_remove() {
        let t = HolderTable::new();
        assert_eq!(t.insert(7, 1, 1), Inserted::NewPair);
        assert_eq!(t.insert(7, 2, 2), Inserted::NewPair);
        assert_eq!(t.insert(7, 1, 2), Inserted::Merged);
        assert_eq!(holders(&t, 7), vec![(1, 3), (2, 2)]);
        assert_eq!(t.remove(7, 1, 1), Some(2));
        assert_eq!(t.remove(7, 1, 2), Some(0));
        assert_eq!(t.remove(7, 1, 2), None);
        assert_eq!(holders(&t, 7), vec![(2, 2)]);
        assert_eq!(t.len(), 1);
    }

    #[test]
    fn growth_tombstones_and_shrinking_keep_every_pair_findable() {
        let t = HolderTable::new();
        let n = 20_000u64;
        for k in 0..n {
            t.insert(k, (k % 5) as u32, 1);
            t.insert(k, 9, 2);
        }
        for k in (0..n).step_by(3) {
            assert_eq!(t.remove(k, 9, 2), Some(0));
        }
        for k in 0..n {
            let want = if k % 3 == 0 {
                vec![((k % 5) as u32, 1)]
            } else {
                vec![((k % 5) as u32, 1), (9, 2)]
            };
            assert_eq!(holders(&t, k), want, "key {k}");
        }
        assert_eq!(t.len(), (n + n - n.div_ceil(3)) as usize);
        // Removing everything leaves the smallest tables: memory follows what is held.
        let grown = t.table_bytes();
        for k in 0..n {
            t.remove(k, (k % 5) as u32, 1);
            t.remove(k, 9, 2);
        }
        assert!(t.is_empty());
        assert_eq!(
            t.table_bytes(),
            SHARDS * MIN_CAPACITY * 12,
            "from {grown} bytes"
        );
        // A removed pair comes back, on its tombstone or elsewhere, exactly once.
        assert_eq!(t.insert(5, 1, 1), Inserted::NewPair);
        assert_eq!(t.remove(5, 1, 1), Some(0));
        assert_eq!(t.insert(5, 2, 1), Inserted::NewPair);
        assert_eq!(t.insert(5, 1, 2), Inserted::NewPair);
        assert_eq!(holders(&t, 5), vec![(1, 2), (2, 1)]);
    }

    #[test]
    fn readers_see_consistent_holders_while_writers_churn() {
        use std::sync::Arc;
        let t = Arc::new(HolderTable::new());
        // Key 1 always has holders {100, 101}; writers churn other keys around it.
        t.insert(1, 100, 1);
        t.insert(1, 101, 1);
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let writer = {
            let (t, stop) = (t.clone(), stop.clone());
            std::thread::spawn(move || {
                let mut k = 2u64;
                while !stop.load(Ordering::Relaxed) {
                    t.insert(k, 3, 1);
                    if k > 500 {
                        t.remove(k - 500, 3, 1);
                    }
                    k += 1;
                }
            })
        };
        for _ in 0..20_000 {
            assert_eq!(holders(&t, 1), vec![(100, 1), (101, 1)]);
        }
        stop.store(true, Ordering::Relaxed);
        writer.join().unwrap();
    }
}
