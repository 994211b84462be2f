//! The holder table: sequence hash → the workers (and tiers) that hold that prefix.
//!
//! A multimap stored as open addressing with linear probing: one slot per (prefix, worker) pair,
//! all pairs of one prefix in the same probe run. A slot is 12 bytes of atomics (8-byte
//! key, 4-byte holder), so a pair costs 12 bytes divided by the load factor (0.77 on average).
//!
//! Concurrency: the table is split into a few shards by the key's top bits (few, so that each
//! shard's array is large enough for huge pages). Writers take the shard's mutex; readers take no
//! lock and never wait or spin: a slot's key is written before its holder is published
//! (release/acquire) and never changes while the slot is in that table, and pairs never move
//! inside a table. A removed pair leaves a tombstone that keeps its key (only a pair of the same
//! key may take it again), so a probe run never breaks under a reader. Growing, shrinking or
//! clearing tombstones builds a new table while readers keep reading the old one (the writer
//! holds the mutex, so the old one no longer changes), then publishes it through an
//! epoch-managed pointer; the old table is freed once no reader can hold it, and the writer
//! drives that reclamation itself, so retired tables do not wait for some other thread's
//! activity. A reader therefore sees, for each key, the holders of one moment during its lookup.
//!
//! Widely held keys (every worker holds a system prompt's first blocks): once a key has
//! [`WIDE_MIN`] holders (and at least as many as its bitset has words), its pairs move into one
//! [`Wide`] record, two bitsets over worker slots (device, offload), referenced by one slot
//! whose holder value has no tier bits. A query then reads a few words for such a block instead
//! of one slot per holder, the key's probe run shrinks to one slot (a run of hundreds of slots
//! would also lengthen every lookup that lands in it), and 256 holders cost 64 bytes of bits
//! instead of 256 slots. A record whose holders fall to a quarter of the threshold moves back
//! into slots. Moving either way publishes the new form before retiring the old, so a reader
//! meanwhile may see a pair twice (never not at all); readers take the union. A reader that
//! meets a reference to a record retired meanwhile (its own table may be an older one, which
//! still has the reference but not the slots the holders moved to) looks for the key again in
//! the shard's current table: the one retry a reader makes, and only after a writer finished.
//!
//! Invariants: a holder value of 0 marks an empty slot and [`TOMBSTONE`] a removed pair, so
//! tiers are never 0 in a stored holder, and a non-empty holder without tier bits refers to a
//! [`Wide`] record; outside a writer's critical section a key has either slots or one record,
//! with at most one live slot per (key, worker slot); a slot's key never changes while it is
//! non-empty; every table keeps at least one empty slot.

use std::convert::Infallible;
use std::ops::ControlFlow;
use std::sync::atomic::{AtomicU32, AtomicU64, AtomicUsize, Ordering};

use crossbeam_epoch::{self as epoch, Atomic, Guard, Owned};
use parking_lot::Mutex;

use crate::hashing::SequenceHash;

/// Number of shards; a power of two. The key's top bits pick the shard.
pub const SHARDS: usize = 8;
const SHARD_BITS: u32 = SHARDS.trailing_zeros();
const MIN_CAPACITY: usize = 64;
/// Most slots (live or tombstone) a table may fill, as a fraction. A lookup that must read a
/// whole probe run (to the first empty slot: writers, a key nobody holds) reads about
/// (1 + 1/(1 - load)²)/2 slots, ~10 at 0.77 and ~32 at 7/8; a reader finding a key held once
/// stops at its pair ([`MORE`]), ~3–4 slots. Tables grow by 30% (not double), so they sit
/// between 0.67 and 0.875 full (0.77 on average: see [`first_capacity`]). (Growing by a quarter
/// saved ~0.5 byte a pair and cost a fifth more moves: each pair is moved ~1/0.3 times over its
/// life.)
const MAX_LOAD: (usize, usize) = (7, 8);

/// A full table's next capacity.
fn grown(cap: usize) -> usize {
    cap * 13 / 10
}

/// Shard `s`'s first (and smallest) capacity: [`MIN_CAPACITY`] × 1.3^(s / SHARDS). Keys spread
/// evenly over the shards, so shards of equal capacities would all grow at the same moment and
/// the whole table's load would swing with them (0.67 to 0.875, by where the count of pairs
/// falls); staggered, they grow one after another and the load stays near its average.
fn first_capacity(s: usize) -> usize {
    (MIN_CAPACITY as f64 * 1.3f64.powf(s as f64 / SHARDS as f64)).round() as usize
}
/// The holder value of a removed pair: its key stays, so probe runs stay whole for readers.
pub const TOMBSTONE: u32 = u32::MAX;
/// Worker slots a holder can carry (the all-ones slot is the tombstone's).
pub const MAX_SLOTS: u32 = (1 << 29) - 1;
/// Holder bit: more live slots of this key may follow in its probe run. A reader stops at a
/// live slot of its key without it, so a key held once costs a successful search (~2 slots)
/// rather than a scan to the end of the run. Set on a key's earlier live slots after a later
/// one is written (so a reader that stops early only misses a pair being added), never
/// cleared in a table (a stale bit only means a longer scan); a rebuild sets it afresh.
/// Invariant: every live slot of a key but the last in its run carries it.
const MORE: u32 = 0b100;

/// Rescans a reader makes when a key's wide record was retired under it (see
/// [`Snapshot::visit`]).
const RESCANS: usize = 8;

/// How many blocks ahead of a lookup a query prefetches the home slot.
pub const PREFETCH_DISTANCE: usize = 8;

/// Holders at which a key's pairs move into a [`Wide`] record (when its bitset is no larger).
pub const WIDE_MIN: usize = 16;

/// A stored holder: worker slot in the high 29 bits, then [`MORE`], then the tier mask in the
/// low 2.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Holder(pub u32);

impl Holder {
    /// Packs a worker slot and a non-empty tier mask.
    pub fn new(slot: u32, tiers: u8) -> Holder {
        debug_assert!(tiers & 0b11 != 0 && slot < MAX_SLOTS);
        Holder((slot << 3) | u32::from(tiers & 0b11))
    }
    /// The worker slot.
    pub fn slot(self) -> u32 {
        self.0 >> 3
    }
    /// The tier mask (bit 0: device, bit 1: offload).
    pub fn tiers(self) -> u8 {
        (self.0 & 0b11) as u8
    }
}

/// The holders of a widely held key: a device bitset and an offload bitset over worker slots.
/// Readers load its words without waiting; only the shard's writer changes them.
pub struct Wide {
    key: u64,
    words: usize,
    /// Device words, then offload words.
    bits: Box<[AtomicU64]>,
    /// Holders (changed only under the shard's writer lock).
    count: AtomicU32,
}

impl Wide {
    fn new(key: u64, words: usize) -> Wide {
        Wide {
            key,
            words,
            bits: (0..2 * words).map(|_| AtomicU64::new(0)).collect(),
            count: AtomicU32::new(0),
        }
    }

    fn bytes(&self) -> usize {
        std::mem::size_of::<Wide>() + self.bits.len() * 8
    }

    /// Words per bitset: slots `0..64 * words()` can be held.
    #[inline]
    pub fn words(&self) -> usize {
        self.words
    }

    /// Device holders among slots `64 * w .. 64 * w + 64` (0 beyond the record).
    #[inline]
    pub fn device(&self, w: usize) -> u64 {
        if w < self.words {
            self.bits[w].load(Ordering::Acquire)
        } else {
            0
        }
    }

    /// Offload holders among slots `64 * w .. 64 * w + 64` (0 beyond the record).
    #[inline]
    pub fn offload(&self, w: usize) -> u64 {
        if w < self.words {
            self.bits[self.words + w].load(Ordering::Acquire)
        } else {
            0
        }
    }

    /// The tiers worker `slot` holds the key in (0: not a holder). Device is read first: a
    /// writer adds a tier before it removes another, so a moving pair is never missed.
    #[inline]
    pub fn tiers(&self, slot: u32) -> u8 {
        let (w, b) = (slot as usize / 64, slot % 64);
        let d = (self.device(w) >> b) & 1;
        let o = (self.offload(w) >> b) & 1;
        (d | (o << 1)) as u8
    }

    /// Every holder: (slot, tiers).
    fn holders(&self) -> impl Iterator<Item = Holder> + '_ {
        (0..self.words).flat_map(move |w| {
            let (d, o) = (self.device(w), self.offload(w));
            let mut any = d | o;
            std::iter::from_fn(move || {
                if any == 0 {
                    return None;
                }
                let b = any.trailing_zeros();
                any &= any - 1;
                let tiers = (((d >> b) & 1) | (((o >> b) & 1) << 1)) as u8;
                Some(Holder::new((w * 64) as u32 + b, tiers))
            })
        })
    }

    /// Adds tiers (writer only).
    fn add(&self, slot: u32, tiers: u8) {
        let (w, bit) = (slot as usize / 64, 1u64 << (slot % 64));
        if tiers & 0b01 != 0 {
            self.bits[w].fetch_or(bit, Ordering::Release);
        }
        if tiers & 0b10 != 0 {
            self.bits[self.words + w].fetch_or(bit, Ordering::Release);
        }
    }

    /// Clears tiers (writer only).
    fn clear(&self, slot: u32, tiers: u8) {
        let (w, bit) = (slot as usize / 64, 1u64 << (slot % 64));
        if tiers & 0b01 != 0 {
            self.bits[w].fetch_and(!bit, Ordering::Release);
        }
        if tiers & 0b10 != 0 {
            self.bits[self.words + w].fetch_and(!bit, Ordering::Release);
        }
    }
}

/// Words of a bitset holding slot `slot`.
fn words_for(slot: u32) -> usize {
    slot as usize / 64 + 1
}

/// When keys move between slots and wide records.
#[derive(Clone, Copy, Debug)]
pub(crate) struct WideRule {
    /// Fewest holders at which a key moves into a record.
    pub(crate) min: usize,
    /// A record whose holders fall below this (or a quarter of its words) moves back.
    pub(crate) keep: usize,
}

impl Default for WideRule {
    fn default() -> Self {
        WideRule {
            min: WIDE_MIN,
            keep: WIDE_MIN / 4,
        }
    }
}

impl WideRule {
    /// Holders at which a key moves into a record of `words` words per bitset (never a record
    /// larger than the slots it replaces would be).
    fn promote_at(self, words: usize) -> usize {
        self.min.max(words)
    }

    /// Whether a record of `words` words with `count` holders stays a record.
    fn stays(self, words: usize, count: usize) -> bool {
        count > 0 && count >= self.keep.max(words / 4)
    }
}

/// The holder value referring to wide record `id`.
fn wide_ref(id: u32) -> u32 {
    id << 3
}

/// Whether a live holder value refers to a wide record.
#[inline]
fn is_wide(h: u32) -> bool {
    h & 0b11 == 0
}

/// One slot: a 64-bit key split in two halves and a holder, 12 bytes with 4-byte alignment, so
/// a lookup touches one cache line (two at most) instead of one per parallel array. Laid out in
/// this order (`repr(C)`): [`WindowWords`] reads a window of slots as 4-byte words.
#[repr(C)]
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
    /// Whether the slot's key is `key`, comparing the low half first (writer scans: most
    /// slots of a run differ there, so one load decides).
    #[inline]
    fn is_key(&self, key: u64) -> bool {
        self.key_lo.load(Ordering::Relaxed) == key as u32
            && self.key_hi.load(Ordering::Relaxed) == (key >> 32) as u32
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

/// Slots [`Snapshot::tiers_of`] compares at once from a key's home.
const WINDOW: usize = 8;

/// The tiers of worker `slot`'s pair of `key` when one lies in `win` (0 when none does): the
/// keys' low halves of all of its slots compared at once, instead of a branch per slot. No run
/// needs checking: a live slot holding `key` is always one of that key's pairs wherever it lies
/// (a slot's key never changes while it is non-empty).
#[inline]
fn window_tiers(win: &[Slot; WINDOW], key: u64, slot: u32) -> u8 {
    let mut keys = key_lanes(win, key as u32);
    while keys != 0 {
        let Some(s) = win.get(keys.trailing_zeros() as usize / 3) else {
            break;
        };
        keys &= keys - 1;
        // The holder first, as a scan reads it: it publishes the key. A tombstone's slot bits
        // are all ones, a wide record's reference has no tier bits, an empty slot is 0.
        // The whole key is compared again after it: the hint's low half was read unordered.
        let h = s.holder();
        if h & !(MORE | 0b11) == slot << 3 && h & 0b11 != 0 && s.is_key(key) {
            return (h & 0b11) as u8;
        }
    }
    0
}

/// Bit `3j` set when slot `j` of `win` holds a key whose low half is `x` (bit `n` names the
/// window's `n`th 4-byte word: `3j` is slot `j`'s low key half, `3j + 2` its holder), without a
/// branch per slot: which slot matches changes with every key, so such a branch is mispredicted.
/// A hint (a slot written meanwhile may be seen either way), which callers confirm with acquire
/// loads.
#[inline]
fn key_lanes(win: &[Slot; WINDOW], x: u32) -> u32 {
    #[cfg(target_arch = "x86_64")]
    {
        WindowWords::read(win).equal(x) & KEY_LANES
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        win.iter().enumerate().fold(0, |bits, (j, s)| {
            bits | u32::from(s.key_lo.load(Ordering::Relaxed) == x) << (3 * j)
        })
    }
}

/// [`key_lanes`] of `x`, and bit `3j + 2` set when slot `j` of `win` is empty, from one read.
#[inline]
fn key_and_empty_lanes(win: &[Slot; WINDOW], x: u32) -> (u32, u32) {
    #[cfg(target_arch = "x86_64")]
    {
        let w = WindowWords::read(win);
        (w.equal(x) & KEY_LANES, w.equal(0) & HOLDER_LANES)
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let empty = win.iter().enumerate().fold(0, |bits, (j, s)| {
            bits | u32::from(s.holder.load(Ordering::Relaxed) == 0) << (3 * j + 2)
        });
        (key_lanes(win, x), empty)
    }
}

/// Bits of [`WindowWords::equal`] for the slots' low key halves, and for their holders.
#[cfg(target_arch = "x86_64")]
const KEY_LANES: u32 = 0o1111_1111;
#[cfg(target_arch = "x86_64")]
const HOLDER_LANES: u32 = 0o4444_4444;

/// A window's 24 words, read with six 16-byte vector loads (a quarter of the instructions of
/// 24 atomic loads; alternated on the peers bench, the one-worker query's p99 ~0.8× of the
/// scalar loads').
#[cfg(target_arch = "x86_64")]
struct WindowWords([std::arch::x86_64::__m128i; 6]);

#[cfg(target_arch = "x86_64")]
impl WindowWords {
    /// Reads `win` whole.
    #[inline(always)]
    fn read(win: &[Slot; WINDOW]) -> WindowWords {
        use std::arch::x86_64::__m128i;
        const _: () = assert!(WINDOW == 8 && std::mem::size_of::<[Slot; WINDOW]>() == 6 * 16);
        let p = win.as_ptr();
        let (a, b, c, d, e, f): (__m128i, __m128i, __m128i, __m128i, __m128i, __m128i);
        // SAFETY: `win` is 96 readable bytes: 8 `repr(C)` slots of three `AtomicU32`s, no
        // padding, read as six unaligned vectors (SSE2 is part of x86-64). Writers may store to
        // these atomics meanwhile. A plain Rust load (`_mm_loadu_si128`) would then be a data
        // race, undefined behaviour whatever the hardware does; inline assembly is opaque to
        // the compiler and means what it does on the machine. There each aligned 4-byte word
        // lies in one cache line, and x86 processors read it whole, as a relaxed atomic load
        // would. (An assumption about the processors, not an architectural rule: the manuals
        // allow a vector access as several accesses without saying how wide. Were a word ever
        // torn, the harm is bounded: callers use the words as hints and confirm a hit with
        // atomic loads, so a torn word could only hide a hit, one lower overlap for one query.)
        unsafe {
            std::arch::asm!(
                "movdqu {a}, xmmword ptr [{p}]",
                "movdqu {b}, xmmword ptr [{p} + 16]",
                "movdqu {c}, xmmword ptr [{p} + 32]",
                "movdqu {d}, xmmword ptr [{p} + 48]",
                "movdqu {e}, xmmword ptr [{p} + 64]",
                "movdqu {f}, xmmword ptr [{p} + 80]",
                p = in(reg) p,
                a = out(xmm_reg) a,
                b = out(xmm_reg) b,
                c = out(xmm_reg) c,
                d = out(xmm_reg) d,
                e = out(xmm_reg) e,
                f = out(xmm_reg) f,
                options(nostack, preserves_flags, readonly),
            );
        }
        WindowWords([a, b, c, d, e, f])
    }

    /// Bit `n` set when word `n` equals `x` (word `3j` is slot `j`'s low key half, `3j + 2`
    /// its holder).
    #[inline(always)]
    fn equal(&self, x: u32) -> u32 {
        use std::arch::x86_64::{
            _mm_cmpeq_epi32, _mm_movemask_epi8, _mm_packs_epi16, _mm_packs_epi32, _mm_set1_epi32,
        };
        // SAFETY: register operations of SSE2, which every x86-64 processor has.
        unsafe {
            let k = _mm_set1_epi32(x as i32);
            let eq = |j: usize| _mm_cmpeq_epi32(self.0[j], k);
            // Each word's result narrowed to a byte, in order (0 or -1 survives saturation).
            let low = _mm_packs_epi16(_mm_packs_epi32(eq(0), eq(1)), _mm_packs_epi32(eq(2), eq(3)));
            let high = _mm_packs_epi16(_mm_packs_epi32(eq(4), eq(5)), k);
            (_mm_movemask_epi8(low) as u32) | ((_mm_movemask_epi8(high) as u32 & 0xff) << 16)
        }
    }
}

/// The writer's scan of `key`'s probe run (from its home, hashed to `m`, to the run's first
/// empty slot): calls `visit` with the index and holder of each non-empty slot whose key is
/// `key`, in probe order, and returns the index of the empty slot that ends the run, unless
/// `visit` breaks first. Slot by slot: a writer's runs are short (a few slots at the table's
/// load), and comparing a [`WINDOW`] at once, as readers do, made applying events ~6% slower
/// on the peers bench. Writer side: the caller holds the shard's lock, or the table is not
/// yet published.
#[inline]
fn scan_run<B>(
    table: &Table,
    key: u64,
    m: u64,
    mut visit: impl FnMut(usize, u32) -> ControlFlow<B>,
) -> ControlFlow<B, usize> {
    let mut i = table.home(m);
    // Every table keeps an empty slot, so the run ends within one lap.
    loop {
        let h = table.slots[i].holder();
        if h == 0 {
            return ControlFlow::Continue(i);
        }
        if table.slots[i].is_key(key) {
            visit(i, h)?;
        }
        i = table.next(i);
    }
}

/// Hints the CPU to fetch a window's first and last cache lines.
#[inline]
fn prefetch_window(win: &[Slot; WINDOW]) {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{_MM_HINT_T0, _mm_prefetch};
        let first = win.as_ptr().cast::<i8>();
        let last = first.wrapping_add(std::mem::size_of_val(win) - 1);
        // SAFETY: prefetch is a hint with no memory-safety requirements.
        unsafe {
            _mm_prefetch(first, _MM_HINT_T0);
            _mm_prefetch(last, _MM_HINT_T0);
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = win;
    }
}

struct Table {
    slots: SlotArray,
    cap: usize,
}

impl Table {
    fn with_capacity(cap: usize) -> Table {
        Table {
            slots: SlotArray::zeroed(cap),
            cap,
        }
    }

    /// The home slot of a key hashed to `m`: the bits below the shard's, scaled to the
    /// capacity (any capacity, not only powers of two).
    #[inline]
    fn home(&self, m: u64) -> usize {
        ((u128::from(m << SHARD_BITS) * self.cap as u128) >> 64) as usize
    }

    /// The slot after `i` in probe order.
    #[inline]
    fn next(&self, i: usize) -> usize {
        if i + 1 == self.cap { 0 } else { i + 1 }
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
    /// Mapped by [`huge::map`] (else allocated by [`super::pages::zeroed`]): how it is freed.
    /// An array of huge-page size whose mapping failed is allocated, so the size cannot say.
    mapped: bool,
}

// SAFETY: the array owns its slots, which are atomics.
unsafe impl Send for SlotArray {}
// SAFETY: shared access only goes through atomics.
unsafe impl Sync for SlotArray {}

impl SlotArray {
    fn bytes(len: usize) -> usize {
        (len * std::mem::size_of::<Slot>()).max(1)
    }

    /// A zeroed array whose pages are written, not merely zero (see `pages.rs`): a rebuild reads
    /// a slot before it writes it, and the kernel's `tlb:tlb_flush` trace put every TLB
    /// shootdown of the peers bench's full-rate writer windows (~100–400 each, a reader's p99 at
    /// 3–5× its idle one) at `rebuild`'s stores into zero-page-mapped memory. (A kernel that
    /// splits all-zero huge pages under memory pressure, remapping them to the zero page, would
    /// bring some back for tables still empty then; this cannot prevent that.)
    fn zeroed(len: usize) -> SlotArray {
        let bytes = Self::bytes(len);
        #[cfg(target_os = "linux")]
        if bytes >= HUGE_PAGE
            && let Some(ptr) = huge::map(bytes)
        {
            // SAFETY: `bytes` writable bytes, just mapped and not yet shared.
            unsafe { super::pages::fault_in(ptr.as_ptr().cast(), bytes) };
            MAPPED_BYTES.fetch_add(bytes, Ordering::Relaxed);
            return SlotArray {
                ptr,
                len,
                mapped: true,
            };
        }
        Self::allocated(len)
    }

    /// A zeroed array from the allocator (small ones, and any whose mapping failed).
    fn allocated(len: usize) -> SlotArray {
        // SAFETY: an all-zero Slot is three zero atomics, a valid value.
        let slots = unsafe { super::pages::zeroed::<Slot>(len) };
        SlotArray {
            ptr: std::ptr::NonNull::from(Box::leak(slots)).cast(),
            len,
            mapped: false,
        }
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
        if self.mapped {
            let bytes = Self::bytes(self.len);
            #[cfg(target_os = "linux")]
            huge::unmap(self.ptr, bytes);
            MAPPED_BYTES.fetch_sub(bytes, Ordering::Relaxed);
            return;
        }
        // SAFETY: the `len` slots `zeroed` leaked from a box; owned here, freed once.
        drop(unsafe {
            Box::from_raw(std::ptr::slice_from_raw_parts_mut(
                self.ptr.as_ptr(),
                self.len,
            ))
        });
    }
}

struct ShardState {
    /// Live slots: pairs held in slots and references to wide records.
    len: usize,
    /// Non-empty slots: live ones and tombstones.
    used: usize,
    /// Live (prefix, worker) pairs, in slots or in wide records.
    pairs: usize,
    /// Wide record ids free for reuse, and the next never used (ids start at 1).
    wide_free: Vec<u32>,
    wide_next: u32,
    /// Bytes of live wide records and of the directory.
    wide_bytes: usize,
}

/// Wide record id → record. Grown by copying the pointers into a larger directory.
struct WideDir {
    entries: Box<[Atomic<Wide>]>,
}

struct Shard {
    /// The smallest capacity (see [`first_capacity`]).
    first_cap: usize,
    writer: Mutex<ShardState>,
    table: Atomic<Table>,
    wides: Atomic<WideDir>,
}

/// Tables and wide records replaced but not yet freed (all holder tables of the process).
static RETIRED: AtomicUsize = AtomicUsize::new(0);

/// A table for `live` pairs half full (the size a shrinking table takes).
fn capacity_for(live: usize) -> usize {
    (live * 2).max(MIN_CAPACITY)
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

/// Tables and wide records replaced and not yet freed, process-wide.
pub fn retired_tables() -> usize {
    RETIRED.load(Ordering::Acquire)
}

/// The sharded holder multimap of one model.
pub struct HolderTable {
    shards: Box<[Shard]>,
    /// Mixed into every key before choosing a slot, so crafted prompts cannot aim at one probe run.
    secret: u64,
    wide: WideRule,
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
        Self::with_rule(WideRule::default())
    }

    /// An empty table moving keys to wide records by `wide` (tests use low thresholds).
    pub(crate) fn with_rule(wide: WideRule) -> Self {
        let shards = (0..SHARDS)
            .map(|s| Shard {
                first_cap: first_capacity(s),
                writer: Mutex::new(ShardState {
                    len: 0,
                    used: 0,
                    pairs: 0,
                    wide_free: Vec::new(),
                    wide_next: 1,
                    wide_bytes: 0,
                }),
                table: Atomic::new(Table::with_capacity(first_capacity(s))),
                wides: Atomic::null(),
            })
            .collect();
        HolderTable {
            shards,
            secret: rand::random(),
            wide,
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
        let (inserted, rebuilt) = {
            let mut state = shard.writer.lock();
            let guard = epoch::pin();
            // SAFETY: only writers holding `writer` replace the table, and we hold it.
            let mut table = unsafe { shard.table.load(Ordering::Relaxed, &guard).deref() };
            let mut moved_back = false;
            // What the scan of the key's run found: its tombstones, its other holders, and
            // the run's first empty slot.
            enum Found {
                Own(usize, u32),
                Wide(u32),
            }
            let (reusable, same_key, top, last_live, i) = loop {
                let mut reusable = None;
                let mut same_key = 0usize;
                let mut top = slot;
                let mut last_live = None;
                let scan = scan_run(table, key, m, |i, h| {
                    if h == TOMBSTONE {
                        reusable.get_or_insert(i);
                    } else if is_wide(h) {
                        return ControlFlow::Break(Found::Wide(h >> 3));
                    } else if Holder(h).slot() == slot {
                        return ControlFlow::Break(Found::Own(i, h));
                    } else {
                        same_key += 1;
                        top = top.max(Holder(h).slot());
                        last_live = Some(i);
                    }
                    ControlFlow::Continue(())
                });
                match scan {
                    ControlFlow::Continue(end) => break (reusable, same_key, top, last_live, end),
                    ControlFlow::Break(Found::Own(i, h)) => {
                        let merged = Holder::new(slot, Holder(h).tiers() | tiers).0 | (h & MORE);
                        table.slots[i].holder.store(merged, Ordering::Release);
                        return Inserted::Merged;
                    }
                    ControlFlow::Break(Found::Wide(id)) => {
                        if let Some(r) =
                            self.wide_insert(shard, &mut state, id, slot, tiers, &guard)
                        {
                            return r;
                        }
                        let rec = Self::wide_of(shard, id, &guard);
                        let count = rec.count.load(Ordering::Relaxed) as usize;
                        moved_back |=
                            self.demote(shard, &mut state, table, key, m, id, rec, count, &guard);
                        // Scan the key's run again, now in slots.
                        // SAFETY: as above.
                        table = unsafe { shard.table.load(Ordering::Relaxed, &guard).deref() };
                    }
                }
            };
            let holder = Holder::new(slot, tiers).0;
            state.len += 1;
            state.pairs += 1;
            let mut rebuilt = false;
            if let Some(t) = reusable {
                // A tombstone of the same key: its key is already right for any reader.
                Self::reuse(table, key, m, holder, t);
            } else {
                if (state.used + 1) * MAX_LOAD.1 > table.slots.len() * MAX_LOAD.0 {
                    table = self.grow(shard, &mut state, table, &guard);
                    rebuilt = true;
                    Self::append(table, key, m, holder);
                } else {
                    // The scan stopped at the run's first empty slot. Every live slot of the
                    // key but its last already carries MORE; the last gets it once the new
                    // slot is visible.
                    table.slots[i].set(key, holder);
                    if let Some(p) = last_live {
                        let h = table.slots[p].holder();
                        if h & MORE == 0 {
                            table.slots[p].holder.store(h | MORE, Ordering::Release);
                        }
                    }
                }
                state.used += 1;
            }
            if same_key + 1 >= self.wide.promote_at(words_for(top)) {
                rebuilt |= self.promote(shard, &mut state, key, m, words_for(top), &guard);
            }
            rebuilt |= moved_back;
            (Inserted::NewPair, rebuilt)
        };
        if rebuilt {
            reclaim_retired();
        }
        inserted
    }

    /// Makes room for one more slot: grows by 30% when 5/8 of the slots are live, else only
    /// drops tombstones (the size then depends on the peak held, not on the order of past
    /// writes).
    fn grow<'g>(
        &self,
        shard: &Shard,
        state: &mut ShardState,
        table: &Table,
        guard: &'g Guard,
    ) -> &'g Table {
        let cap = table.slots.len();
        let cap = if state.len * 8 >= cap * 5 {
            grown(cap)
        } else {
            cap
        };
        self.rebuild(shard, state, table, cap, guard)
    }

    /// Writes a live slot of `key` (`holder` without [`MORE`]) at the first empty slot of its
    /// run, in one pass: every live slot of the key but its last already carries `MORE` (the
    /// invariant), and the last gets it once the new slot is visible. Writer only.
    fn append(table: &Table, key: u64, m: u64, holder: u32) {
        let mut last = None;
        let ControlFlow::<Infallible, _>::Continue(i) = scan_run(table, key, m, |i, h| {
            if h != TOMBSTONE {
                last = Some(i);
            }
            ControlFlow::Continue(())
        });
        table.slots[i].set(key, holder);
        if let Some(p) = last {
            let h = table.slots[p].holder();
            if h & MORE == 0 {
                table.slots[p].holder.store(h | MORE, Ordering::Release);
            }
        }
    }

    /// Writes a live slot of `key` (`holder` without [`MORE`]) into `t`, a tombstone of the same
    /// key. The slot carries `MORE` when a live slot of the key follows it; then every earlier
    /// live slot of the key gets `MORE`, once the new one is visible. Writer only.
    fn reuse(table: &Table, key: u64, m: u64, holder: u32, t: usize) {
        // Whether a live slot of the key follows `t` in its run.
        let mut past = false;
        let later = scan_run(table, key, m, |i, h| {
            if past && h != TOMBSTONE {
                return ControlFlow::Break(());
            }
            past |= i == t;
            ControlFlow::Continue(())
        })
        .is_break();
        let value = holder | if later { MORE } else { 0 };
        table.slots[t].holder.store(value, Ordering::Release);
        let _ = scan_run(table, key, m, |i, h| {
            if i == t {
                return ControlFlow::Break(());
            }
            if h != TOMBSTONE && h & MORE == 0 {
                table.slots[i].holder.store(h | MORE, Ordering::Release);
            }
            ControlFlow::Continue(())
        });
    }

    /// The wide record `id` of a shard (writer side: it exists).
    fn wide_of<'g>(shard: &Shard, id: u32, guard: &'g Guard) -> &'g Wide {
        // SAFETY: the writer holds the lock; records and the directory are replaced only under
        // it and freed only after an epoch grace period.
        unsafe {
            let dir = shard.wides.load(Ordering::Acquire, guard).deref();
            dir.entries[id as usize]
                .load(Ordering::Acquire, guard)
                .deref()
        }
    }

    /// Adds a pair to the wide record `id`, growing its bitsets to cover `slot`.
    fn wide_insert(
        &self,
        shard: &Shard,
        state: &mut ShardState,
        id: u32,
        slot: u32,
        tiers: u8,
        guard: &Guard,
    ) -> Option<Inserted> {
        let mut rec = Self::wide_of(shard, id, guard);
        if slot as usize >= rec.words * 64 {
            let count = rec.count.load(Ordering::Relaxed) as usize;
            if count + 1 < self.wide.promote_at(words_for(slot)) {
                // Bits for a far slot would outweigh the slots of these holders: the caller
                // moves them back into slots first.
                return None;
            }
            let bigger = Wide::new(rec.key, words_for(slot));
            for (w, b) in rec.bits[..rec.words].iter().enumerate() {
                bigger.bits[w].store(b.load(Ordering::Relaxed), Ordering::Relaxed);
                let o = rec.bits[rec.words + w].load(Ordering::Relaxed);
                bigger.bits[bigger.words + w].store(o, Ordering::Relaxed);
            }
            bigger
                .count
                .store(rec.count.load(Ordering::Relaxed), Ordering::Relaxed);
            state.wide_bytes += bigger.bytes() - rec.bytes();
            // SAFETY: as in `wide_of`.
            let dir = unsafe { shard.wides.load(Ordering::Acquire, guard).deref() };
            let old = dir.entries[id as usize].swap(Owned::new(bigger), Ordering::AcqRel, guard);
            Self::retire(old, guard);
            rec = Self::wide_of(shard, id, guard);
        }
        let had = rec.tiers(slot);
        rec.add(slot, tiers);
        if had != 0 {
            return Some(Inserted::Merged);
        }
        rec.count.fetch_add(1, Ordering::Relaxed);
        state.pairs += 1;
        Some(Inserted::NewPair)
    }

    /// Frees a replaced record once no reader can hold it.
    fn retire<T: Send + 'static>(old: epoch::Shared<'_, T>, guard: &Guard) {
        if old.is_null() {
            return;
        }
        RETIRED.fetch_add(1, Ordering::AcqRel);
        // SAFETY: unlinked by the caller; pinned readers keep it alive until they unpin.
        unsafe {
            let owned = old.into_owned();
            guard.defer_unchecked(move || {
                drop(owned);
                RETIRED.fetch_sub(1, Ordering::AcqRel);
            });
        }
        guard.flush();
    }

    /// Moves the slots of `key` into a new wide record: the record and its reference are
    /// published before the slots become tombstones. Returns whether the table was rebuilt.
    fn promote(
        &self,
        shard: &Shard,
        state: &mut ShardState,
        key: u64,
        m: u64,
        words: usize,
        guard: &Guard,
    ) -> bool {
        let rec = Wide::new(key, words);
        // SAFETY: we hold the writer lock.
        let mut table = unsafe { shard.table.load(Ordering::Relaxed, guard).deref() };
        let mut n = 0u32;
        Self::for_each_slot(table, key, m, |h| {
            if !is_wide(h) {
                rec.add(Holder(h).slot(), Holder(h).tiers());
                n += 1;
            }
        });
        rec.count.store(n, Ordering::Relaxed);
        state.wide_bytes += rec.bytes();
        let id = self.wide_id(shard, state, guard);
        // SAFETY: as in `wide_of`.
        let dir = unsafe { shard.wides.load(Ordering::Acquire, guard).deref() };
        dir.entries[id as usize].store(Owned::new(rec), Ordering::Release);
        let mut rebuilt = false;
        if (state.used + 1) * MAX_LOAD.1 > table.slots.len() * MAX_LOAD.0 {
            table = self.grow(shard, state, table, guard);
            rebuilt = true;
        }
        Self::append(table, key, m, wide_ref(id));
        state.used += 1;
        state.len += 1;
        let ControlFlow::<Infallible, _>::Continue(_) = scan_run(table, key, m, |i, h| {
            if h != TOMBSTONE && !is_wide(h) {
                table.slots[i].holder.store(TOMBSTONE, Ordering::Release);
                state.len -= 1;
            }
            ControlFlow::Continue(())
        });
        rebuilt
    }

    /// A free wide record id, growing the directory when every id is taken.
    fn wide_id(&self, shard: &Shard, state: &mut ShardState, guard: &Guard) -> u32 {
        if let Some(id) = state.wide_free.pop() {
            return id;
        }
        let id = state.wide_next;
        state.wide_next += 1;
        let dir = shard.wides.load(Ordering::Acquire, guard);
        // SAFETY: as in `wide_of`.
        let len = unsafe { dir.as_ref() }.map_or(0, |d| d.entries.len());
        if id as usize >= len {
            let new_len = (len * 2).max(8);
            let entries: Box<[Atomic<Wide>]> = (0..new_len)
                .map(|e| {
                    // SAFETY: as in `wide_of`.
                    unsafe { dir.as_ref() }
                        .and_then(|d| d.entries.get(e))
                        .map_or(Atomic::null(), |a| {
                            Atomic::from(a.load(Ordering::Relaxed, guard))
                        })
                })
                .collect();
            state.wide_bytes += (new_len - len) * std::mem::size_of::<Atomic<Wide>>();
            let old = shard
                .wides
                .swap(Owned::new(WideDir { entries }), Ordering::AcqRel, guard);
            // The old directory's pointers are shared with the new one: only the array goes.
            Self::retire(old, guard);
        }
        id
    }

    /// Calls `f` with every live holder value of `key` in `table` (writer side).
    fn for_each_slot(table: &Table, key: u64, m: u64, mut f: impl FnMut(u32)) {
        let ControlFlow::<Infallible, _>::Continue(_) = scan_run(table, key, m, |_, h| {
            if h != TOMBSTONE {
                f(h);
            }
            ControlFlow::Continue(())
        });
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
            Self::append(&new, k, mix(k ^ self.secret), h & !MORE);
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
        let (left, rebuilt) = {
            let mut state = shard.writer.lock();
            let guard = epoch::pin();
            // SAFETY: see `insert`.
            let table = unsafe { shard.table.load(Ordering::Relaxed, &guard).deref() };
            let found = scan_run(table, key, m, |i, h| {
                if h != TOMBSTONE && (is_wide(h) || Holder(h).slot() == slot) {
                    return ControlFlow::Break((i, h));
                }
                ControlFlow::Continue(())
            });
            let ControlFlow::Break((i, h)) = found else {
                return None;
            };
            if is_wide(h) {
                self.wide_remove(shard, &mut state, table, i, key, m, slot, tiers, &guard)?
            } else {
                let left = Holder(h).tiers() & !tiers;
                if left != 0 {
                    table.slots[i]
                        .holder
                        .store(Holder::new(slot, left).0 | (h & MORE), Ordering::Release);
                    return Some(left);
                }
                table.slots[i].holder.store(TOMBSTONE, Ordering::Release);
                state.len -= 1;
                state.pairs -= 1;
                (0, self.maybe_shrink(shard, &mut state, &guard))
            }
        };
        if rebuilt {
            reclaim_retired();
        }
        Some(left)
    }

    /// Memory follows what is held: a table a quarter of its useful size shrinks.
    fn maybe_shrink(&self, shard: &Shard, state: &mut ShardState, guard: &Guard) -> bool {
        // SAFETY: see `insert`.
        let table = unsafe { shard.table.load(Ordering::Relaxed, guard).deref() };
        let cap = table.slots.len();
        let shrink = cap > shard.first_cap && state.len * 8 < cap;
        if shrink {
            let cap = capacity_for(state.len).max(shard.first_cap);
            self.rebuild(shard, state, table, cap, guard);
        }
        shrink
    }

    /// Removes tiers of a pair held in the wide record referenced from slot `at`; a record left
    /// with few holders moves back into slots, an empty one goes.
    #[allow(clippy::too_many_arguments)]
    fn wide_remove(
        &self,
        shard: &Shard,
        state: &mut ShardState,
        table: &Table,
        at: usize,
        key: u64,
        m: u64,
        slot: u32,
        tiers: u8,
        guard: &Guard,
    ) -> Option<(u8, bool)> {
        let id = table.slots[at].holder() >> 3;
        let rec = Self::wide_of(shard, id, guard);
        let had = rec.tiers(slot);
        if had == 0 {
            return None;
        }
        let left = had & !tiers;
        rec.clear(slot, had & tiers);
        if left != 0 {
            return Some((left, false));
        }
        state.pairs -= 1;
        let count = rec.count.fetch_sub(1, Ordering::Relaxed) as usize - 1;
        if self.wide.stays(rec.words, count) {
            return Some((0, false));
        }
        Some((
            0,
            self.demote(shard, state, table, key, m, id, rec, count, guard),
        ))
    }

    /// Moves the `count` holders of wide record `id` back into slots of `table`, published
    /// before the reference becomes a tombstone, and retires the record. Returns whether a
    /// table was rebuilt.
    #[allow(clippy::too_many_arguments)]
    fn demote(
        &self,
        shard: &Shard,
        state: &mut ShardState,
        table: &Table,
        key: u64,
        m: u64,
        id: u32,
        rec: &Wide,
        count: usize,
        guard: &Guard,
    ) -> bool {
        let mut table = table;
        let mut rebuilt = false;
        if (state.used + count) * MAX_LOAD.1 > table.slots.len() * MAX_LOAD.0 {
            // A rebuild copies the reference too; find it again afterwards.
            let cap = capacity_for(state.len + count).max(table.slots.len());
            table = self.rebuild(shard, state, table, cap, guard);
            rebuilt = true;
        }
        for h in rec.holders() {
            Self::append(table, key, m, h.0);
            state.used += 1;
            state.len += 1;
        }
        let reference = scan_run(table, key, m, |i, h| {
            if h & !MORE == wide_ref(id) {
                return ControlFlow::Break(i);
            }
            ControlFlow::Continue(())
        });
        if let ControlFlow::Break(i) = reference {
            table.slots[i].holder.store(TOMBSTONE, Ordering::Release);
            state.len -= 1;
        }
        state.wide_bytes -= rec.bytes();
        // SAFETY: as in `wide_of`.
        let dir = unsafe { shard.wides.load(Ordering::Acquire, guard).deref() };
        let old = dir.entries[id as usize].swap(epoch::Shared::null(), Ordering::AcqRel, guard);
        Self::retire(old, guard);
        state.wide_free.push(id);
        rebuilt |= self.maybe_shrink(shard, state, guard);
        rebuilt
    }

    /// Appends every holder of `key` to `out`: each pair as it stood at one moment of the
    /// lookup. Never waits for a writer.
    #[inline]
    pub fn lookup(&self, key: u64, guard: &Guard, out: &mut Vec<Holder>) {
        self.for_each(key, guard, |h| out.push(h));
    }

    /// Calls `f` with every holder of `key`, as [`HolderTable::lookup`] finds them (a pair
    /// moving between slots and a wide record meanwhile may come twice).
    #[inline]
    pub fn for_each(&self, key: u64, guard: &Guard, mut f: impl FnMut(Holder)) {
        if let Some(wide) = self.visit(key, guard, &mut f) {
            wide.holders().for_each(f);
        }
    }

    /// Calls `f` with every holder of `key` kept in slots, and returns its wide record when it
    /// has one: the key's holders are the union of both (normally one of them is empty; both
    /// only while a writer moves the key between them). Never waits for a writer.
    #[inline]
    pub fn visit<'g>(
        &'g self,
        key: u64,
        guard: &'g Guard,
        f: impl FnMut(Holder),
    ) -> Option<&'g Wide> {
        let snap = self.snapshot(guard);
        snap.visit(key, snap.hash(key), f)
    }

    /// Every shard's table as a reader finds it now, so a query resolves them once rather than
    /// per block. A table replaced meanwhile no longer changes: the query reads the holders of
    /// that moment.
    #[inline]
    pub fn snapshot<'g>(&'g self, guard: &'g Guard) -> Snapshot<'g> {
        Snapshot {
            owner: self,
            // SAFETY: the pointers are always valid while pinned (replaced tables are deferred).
            tables: std::array::from_fn(|s| unsafe {
                self.shards[s].table.load(Ordering::Acquire, guard).deref()
            }),
            guard,
        }
    }

    /// The wide record `id` of `key`, if it is still that key's (an id whose record was
    /// retired, or reused for another key since the slot was read, yields none: the key's
    /// holders were then moved into slots before, and the reader finds them further on).
    #[inline]
    fn wide_for_reader<'g>(shard: &Shard, id: u32, key: u64, guard: &'g Guard) -> Option<&'g Wide> {
        // SAFETY: valid while pinned: directories and records are freed after a grace period.
        let dir = unsafe { shard.wides.load(Ordering::Acquire, guard).as_ref() }?;
        let rec = unsafe {
            dir.entries
                .get(id as usize)?
                .load(Ordering::Acquire, guard)
                .as_ref()
        }?;
        (rec.key == key).then_some(rec)
    }

    /// Heap bytes held by the slot arrays and wide records (all shards).
    pub fn table_bytes(&self) -> usize {
        let guard = epoch::pin();
        self.shards
            .iter()
            .map(|s| {
                let state = s.writer.lock();
                // SAFETY: valid while pinned.
                unsafe { s.table.load(Ordering::Acquire, &guard).deref() }.bytes()
                    + state.wide_bytes
            })
            .sum()
    }

    /// The number of (prefix, worker) pairs.
    pub fn len(&self) -> usize {
        self.shards.iter().map(|s| s.writer.lock().pairs).sum()
    }

    /// Whether no pair is stored.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// A reader's view of a [`HolderTable`]: every shard's table, resolved once.
pub struct Snapshot<'g> {
    owner: &'g HolderTable,
    tables: [&'g Table; SHARDS],
    guard: &'g Guard,
}

impl<'g> Snapshot<'g> {
    /// The mixed hash of `key` that picks its shard and home slot (for `prefetch` and `visit`).
    #[inline]
    pub fn hash(&self, key: u64) -> u64 {
        mix(key ^ self.owner.secret)
    }

    /// Hints the CPU to fetch the home slot of the key hashed to `m`, so a later lookup finds
    /// it in cache.
    #[inline]
    pub fn prefetch(&self, m: u64) {
        #[cfg(target_arch = "x86_64")]
        {
            let table = self.tables[(m >> (64 - SHARD_BITS)) as usize];
            let i = table.home(m);
            use std::arch::x86_64::{_MM_HINT_T0, _mm_prefetch};
            // SAFETY: prefetch is a hint with no memory-safety requirements; `i` is in bounds.
            unsafe {
                _mm_prefetch(table.slots.as_ptr().add(i).cast::<i8>(), _MM_HINT_T0);
            }
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            let _ = m;
        }
    }

    /// [`HolderTable::visit`] for `key`, hashed to `m` by [`Snapshot::hash`].
    #[inline]
    pub fn visit(&self, key: u64, m: u64, mut f: impl FnMut(Holder)) -> Option<&'g Wide> {
        let s = (m >> (64 - SHARD_BITS)) as usize;
        let shard = &self.owner.shards[s];
        let (mut wide, mut moved) = Self::scan(self.tables[s], shard, key, m, self.guard, &mut f);
        // A record retired since its reference was read had its holders moved into slots of
        // the shard's current table first (which may be newer than this snapshot's, and where
        // the reference read without MORE may now be followed by them): look there. Each
        // further round needs a writer to have moved the key again meanwhile; the bound keeps
        // a reader from chasing a writer that does so without pause.
        for _ in 0..RESCANS {
            if !moved {
                break;
            }
            // SAFETY: as in `snapshot`.
            let table = unsafe { shard.table.load(Ordering::Acquire, self.guard).deref() };
            let (w, again) = Self::scan(table, shard, key, m, self.guard, &mut f);
            (wide, moved) = (w.or(wide), again);
        }
        wide
    }

    /// How far worker `slot` holds a prompt from block `from` on: the first block it does not
    /// hold (or the prompt's length), and, when `device` (its device run is whole so far), the
    /// first block it holds only offloaded. `seqs` are the prompt's prefix hashes and `hashes`
    /// them hashed by [`Snapshot::hash`]. One [`Snapshot::tiers_of`] per block, the home slot
    /// prefetched [`PREFETCH_DISTANCE`] blocks ahead.
    pub fn run_of(
        &self,
        seqs: &[SequenceHash],
        hashes: &[u64],
        from: usize,
        slot: u32,
        mut device: bool,
    ) -> (usize, Option<usize>) {
        const D: usize = PREFETCH_DISTANCE;
        let mut offload_from = None;
        let n = seqs.len().min(hashes.len());
        // The windows of the next D blocks, each found (and prefetched) once, D blocks ahead.
        let mut ring: [Option<&'g [Slot; WINDOW]>; D] = [None; D];
        for pos in from..n.min(from + D) {
            ring[pos % D] = self.window(hashes[pos]);
        }
        for pos in from..n {
            let win = ring[pos % D];
            if let Some(&ahead) = hashes.get(pos + D) {
                let next = self.window(ahead);
                if let Some(w) = next {
                    prefetch_window(w);
                }
                ring[pos % D] = next;
            }
            let tiers = self.tiers_from(win, seqs[pos].0, hashes[pos], slot);
            if tiers == 0 {
                return (pos, offload_from);
            }
            if device && tiers & 0b01 == 0 {
                offload_from = Some(pos);
                device = false;
            }
        }
        (n, offload_from)
    }

    /// The [`WINDOW`] slots from the home of the key hashed to `m` (none when they would pass
    /// the end of its table).
    #[inline]
    fn window(&self, m: u64) -> Option<&'g [Slot; WINDOW]> {
        let table = self.tables[(m >> (64 - SHARD_BITS)) as usize];
        let i = table.home(m);
        table.slots.get(i..i + WINDOW)?.try_into().ok()
    }

    /// The tiers worker `slot` holds `key` in (0: not a holder), `key` hashed to `m` by
    /// [`Snapshot::hash`]: [`Snapshot::visit`] narrowed to one worker. The first [`WINDOW`]
    /// slots from the key's home are compared at once, without a branch per slot; the pair is
    /// nearly always there. Otherwise the key's run is scanned, stopping at that worker's pair;
    /// a key met as a wide record takes the general path.
    #[inline]
    pub fn tiers_of(&self, key: u64, m: u64, slot: u32) -> u8 {
        self.tiers_from(self.window(m), key, m, slot)
    }

    /// [`Snapshot::tiers_of`] with the key's first window already found.
    #[inline]
    fn tiers_from(&self, win: Option<&[Slot; WINDOW]>, key: u64, m: u64, slot: u32) -> u8 {
        match win.map_or(0, |w| window_tiers(w, key, slot)) {
            0 => self.tiers_past(key, m, slot),
            t => t,
        }
    }

    /// [`Snapshot::tiers_of`] when the first window held no pair of `slot`: the key's run
    /// window by window (a key's pairs all lie in its run, which ends at the first empty slot
    /// from its home), then slot by slot where a window would pass the table's end.
    #[inline(never)]
    fn tiers_past(&self, key: u64, m: u64, slot: u32) -> u8 {
        let table = self.tables[(m >> (64 - SHARD_BITS)) as usize];
        let slots: &[Slot] = &table.slots;
        let mut i = table.home(m);
        for _ in 0..slots.len() / WINDOW + 1 {
            let Some(win) = slots.get(i..i + WINDOW).and_then(|w| w.try_into().ok()) else {
                break;
            };
            let (keys, empty) = key_and_empty_lanes(win, key as u32);
            let run = if empty == 0 {
                u32::MAX
            } else {
                (1 << empty.trailing_zeros()) - 1
            };
            let mut keys = keys & run;
            while keys != 0 {
                let Some(s) = win.get(keys.trailing_zeros() as usize / 3) else {
                    break;
                };
                keys &= keys - 1;
                let h = s.holder();
                if h == 0 || h == TOMBSTONE || !s.is_key(key) {
                    continue;
                }
                if is_wide(h) {
                    return self.tiers_in_visit(key, m, slot);
                }
                if Holder(h).slot() == slot {
                    return Holder(h).tiers();
                }
                if h & MORE == 0 {
                    return 0;
                }
            }
            if empty != 0 {
                return 0;
            }
            i += WINDOW;
        }
        self.tiers_in_run(table, i, key, m, slot)
    }

    /// [`Snapshot::tiers_of`] by a scan of the key's run from slot `i` on.
    fn tiers_in_run(&self, table: &Table, mut i: usize, key: u64, m: u64, slot: u32) -> u8 {
        let slots: &[Slot] = &table.slots;
        let (lo, hi) = (key as u32, (key >> 32) as u32);
        if i >= slots.len() {
            i = 0;
        }
        // Every table keeps an empty slot; the bound is belt and braces.
        for _ in 0..slots.len() {
            let Some(s) = slots.get(i) else { break };
            let h = s.holder();
            if h == 0 {
                break;
            }
            if s.key_lo.load(Ordering::Relaxed) == lo
                && s.key_hi.load(Ordering::Relaxed) == hi
                && h != TOMBSTONE
            {
                if is_wide(h) {
                    return self.tiers_in_visit(key, m, slot);
                }
                if Holder(h).slot() == slot {
                    return Holder(h).tiers();
                }
                if h & MORE == 0 {
                    break;
                }
            }
            i += 1;
            if i == slots.len() {
                i = 0;
            }
        }
        0
    }

    /// [`Snapshot::tiers_of`] through the general lookup (slots and wide record).
    #[cold]
    fn tiers_in_visit(&self, key: u64, m: u64, slot: u32) -> u8 {
        let mut tiers = 0;
        let wide = self.visit(key, m, |h| {
            if h.slot() == slot {
                tiers |= h.tiers();
            }
        });
        tiers | wide.map_or(0, |w| w.tiers(slot))
    }

    /// One scan of `key`'s probe run in `table`: calls `f` with its holders in slots and
    /// returns its wide record, and whether a reference to a retired record was met.
    #[inline]
    fn scan(
        table: &'g Table,
        shard: &Shard,
        key: u64,
        m: u64,
        guard: &'g Guard,
        f: &mut impl FnMut(Holder),
    ) -> (Option<&'g Wide>, bool) {
        let slots: &[Slot] = &table.slots;
        let (lo, hi) = (key as u32, (key >> 32) as u32);
        let mut i = table.home(m);
        let mut wide = None;
        let mut moved = false;
        // Every table keeps an empty slot; the bound is belt and braces.
        for _ in 0..slots.len() {
            let Some(slot) = slots.get(i) else { break };
            let h = slot.holder();
            if h == 0 {
                break;
            }
            // Most slots met belong to other keys: the low half of the key tells them apart.
            if slot.key_lo.load(Ordering::Relaxed) == lo
                && slot.key_hi.load(Ordering::Relaxed) == hi
                && h != TOMBSTONE
            {
                let mut last = h & MORE == 0;
                if is_wide(h) {
                    match HolderTable::wide_for_reader(shard, h >> 3, key, guard) {
                        Some(w) => wide = Some(w),
                        None => {
                            moved = true;
                            last = false;
                        }
                    }
                } else {
                    f(Holder(h));
                }
                if last {
                    break;
                }
            }
            i += 1;
            if i == slots.len() {
                i = 0;
            }
        }
        (wide, moved)
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
                let dir = shard
                    .wides
                    .swap(epoch::Shared::null(), Ordering::Relaxed, guard);
                if !dir.is_null() {
                    let dir = dir.into_owned();
                    for e in dir.entries.iter() {
                        let w = e.swap(epoch::Shared::null(), Ordering::Relaxed, guard);
                        if !w.is_null() {
                            drop(w.into_owned());
                        }
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The vector compare of a window agrees with word-by-word compares, for every pattern of
    /// matching slots and for values whose halves saturate when narrowed.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn the_vector_window_compare_equals_the_scalar_one() {
        let values = [
            0u32,
            1,
            0x7fff,
            0x8000,
            0xffff,
            0x1_0000,
            0x8000_0000,
            u32::MAX,
        ];
        for x in values {
            for pattern in 0u32..1 << WINDOW {
                for other in values.iter().filter(|&&v| v != x) {
                    let win: [Slot; WINDOW] = std::array::from_fn(|j| {
                        let hit = pattern >> j & 1 != 0;
                        let word = |k: u32| AtomicU32::new(if hit { x } else { other ^ k });
                        Slot {
                            key_lo: word(0),
                            key_hi: word(0),
                            holder: word(0),
                        }
                    });
                    let mut scalar = 0u32;
                    for (j, s) in win.iter().enumerate() {
                        for (w, word) in [&s.key_lo, &s.key_hi, &s.holder].into_iter().enumerate() {
                            if word.load(Ordering::Relaxed) == x {
                                scalar |= 1 << (3 * j + w);
                            }
                        }
                    }
                    assert_eq!(
                        WindowWords::read(&win).equal(x),
                        scalar,
                        "{x:#x} {pattern:#b}"
                    );
                    assert_eq!(key_lanes(&win, x), scalar & KEY_LANES);
                }
            }
        }
    }

    /// Every page of a new slot array is backed by its own frame before a rebuild first reads
    /// it (not the shared zero page, which a later write would replace with a TLB shootdown
    /// on every core running the process: an interrupt under a query), for an array large
    /// enough to be mapped fresh.
    /// An array of huge-page size whose mapping failed comes from the allocator, and is given
    /// back to it (once the size decided how to free it, and such an array was unmapped).
    #[test]
    fn a_large_array_that_was_not_mapped_is_freed_as_allocated() {
        let len = (3 * HUGE_PAGE).div_ceil(std::mem::size_of::<Slot>());
        for _ in 0..4 {
            let array = SlotArray::allocated(len);
            assert!(!array.mapped, "freed by the allocator, not unmapped");
            array[len - 1].set(7, Holder::new(1, 1).0);
            assert_eq!(array[len - 1].key(), 7);
            // Dropped here: unmapping the allocator's memory would corrupt the heap.
        }
        assert!(SlotArray::zeroed(len).mapped || cfg!(not(target_os = "linux")));
    }

    #[cfg(target_os = "linux")]
    #[test]
    fn a_new_table_is_faulted_in_by_writes() {
        let len = (3 * HUGE_PAGE).div_ceil(std::mem::size_of::<Slot>());
        let array = SlotArray::zeroed(len);
        let bytes = SlotArray::bytes(len);
        let missing = super::super::pages::unwritten_pages(array.as_ptr() as usize, bytes);
        assert_eq!(
            missing, 0,
            "pages of a new {bytes}-byte table not faulted in"
        );
        assert!(array.iter().all(|s| s.holder() == 0 && s.key() == 0));
    }

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
            (0..SHARDS).map(first_capacity).sum::<usize>() * 12,
            "from {grown} bytes"
        );
        // A removed pair comes back, on its tombstone or elsewhere, exactly once.
        assert_eq!(t.insert(5, 1, 1), Inserted::NewPair);
        assert_eq!(t.remove(5, 1, 1), Some(0));
        assert_eq!(t.insert(5, 2, 1), Inserted::NewPair);
        assert_eq!(t.insert(5, 1, 2), Inserted::NewPair);
        assert_eq!(holders(&t, 5), vec![(1, 2), (2, 1)]);
    }

    /// The tiers worker `slot` holds `key` in, by the general lookup.
    fn tiers_by_visit(t: &HolderTable, key: u64, slot: u32) -> u8 {
        let guard = epoch::pin();
        let mut tiers = 0;
        t.for_each(key, &guard, |h| {
            if h.slot() == slot {
                tiers |= h.tiers();
            }
        });
        tiers
    }

    #[test]
    fn one_worker_lookups_agree_with_the_general_lookup() {
        // Keys sharing their low half (the window compares it first), keys held by one to
        // twenty workers (wide records from 16), tombstones, and tables near their fill limit,
        // so that runs are long, windows miss, and some pass the end of a table.
        let t = HolderTable::new();
        let key = |k: u64| (k % 500) | (k / 500) << 32;
        let holders_of = |k: u64| 1 + (k % 7) * (k % 3) + if k.is_multiple_of(97) { 19 } else { 0 };
        let n = 6_000u64;
        for k in 0..n {
            for w in 0..holders_of(k) {
                t.insert(key(k), ((k + w * 5) % 40) as u32, 1 + (k + w) as u8 % 3);
            }
        }
        for k in (0..n).step_by(4) {
            t.remove(key(k), (k % 40) as u32, 3);
        }
        let guard = epoch::pin();
        let snap = t.snapshot(&guard);
        for k in 0..n + 50 {
            let m = snap.hash(key(k));
            for w in [k % 40, (k + 5) % 40, (k + 17) % 40] {
                let w = w as u32;
                assert_eq!(
                    snap.tiers_of(key(k), m, w),
                    tiers_by_visit(&t, key(k), w),
                    "key {k} worker {w}"
                );
            }
        }
        // A run over a "prompt" of keys: where the worker stops holding, and where its device
        // run breaks.
        let seqs: Vec<SequenceHash> = (0..n).map(|k| SequenceHash(key(k))).collect();
        let hashes: Vec<u64> = seqs.iter().map(|s| snap.hash(s.0)).collect();
        for from in [0, 1, 7, 300] {
            for w in [0u32, 1, 13] {
                let mut end = seqs.len();
                let mut offload = None;
                for (pos, s) in seqs.iter().enumerate().skip(from) {
                    let tiers = tiers_by_visit(&t, s.0, w);
                    if tiers == 0 {
                        end = pos;
                        break;
                    }
                    if offload.is_none() && tiers & 1 == 0 {
                        offload = Some(pos);
                    }
                }
                assert_eq!(snap.run_of(&seqs, &hashes, from, w, true), (end, offload));
                assert_eq!(snap.run_of(&seqs, &hashes, from, w, false), (end, None));
            }
        }
    }

    /// The writer's invariants in every shard's current table: at most one live slot per
    /// (key, worker slot), never slots and a wide record for one key at once, and every live
    /// slot of a key but the last in its run carries [`MORE`] (a reader stops at a slot without
    /// it).
    fn check_runs(t: &HolderTable) {
        let guard = epoch::pin();
        for shard in t.shards.iter() {
            // SAFETY: test only; no writer runs meanwhile.
            let table = unsafe { shard.table.load(Ordering::Acquire, &guard).deref() };
            let live = |i: usize| {
                let h = table.slots[i].holder();
                (h != 0 && h != TOMBSTONE).then_some(h)
            };
            for i in 0..table.cap {
                let Some(h) = live(i) else { continue };
                let key = table.slots[i].key();
                let mut j = table.next(i);
                let mut later = false;
                while table.slots[j].holder() != 0 {
                    if let Some(g) = live(j).filter(|_| table.slots[j].is_key(key)) {
                        later = true;
                        assert!(
                            is_wide(h) == is_wide(g) && !is_wide(h),
                            "key {key:#x}: a wide record and slots, or two records"
                        );
                        assert_ne!(Holder(h).slot(), Holder(g).slot(), "a pair twice");
                    }
                    j = table.next(j);
                }
                if later {
                    assert!(h & MORE != 0, "key {key:#x} slot {i}: MORE missing");
                }
            }
        }
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(128))]
        /// Any sequence of inserts and removes: each answer, and every key's holders by both
        /// lookups, agree with a map of pairs, and the runs keep their invariants. Keys share
        /// their low halves (the writer's window compares those first), one key gathers
        /// enough holders to move into a wide record and back (low thresholds), worker slots
        /// pass 64 (a record's second word), and tables stay small, so runs are long, pass the
        /// end of a table, and hold tombstones.
        #[test]
        fn writes_agree_with_a_map_of_pairs(
            ops in proptest::collection::vec(
                (0u64..16, 0u32..70, 1u8..4, proptest::bool::weighted(0.6)),
                1..600,
            ),
        ) {
            use std::collections::BTreeMap;
            let t = HolderTable::with_rule(WideRule { min: 5, keep: 2 });
            let key = |k: u64| (k % 4) | (k / 4) << 32;
            let mut model: BTreeMap<(u64, u32), u8> = BTreeMap::new();
            for (k, slot, tiers, add) in ops {
                // Key 0 takes a fifth of the pairs: it moves into a record and back.
                let k = if slot % 5 == 0 { 0 } else { key(k) };
                let had = model.get(&(k, slot)).copied().unwrap_or(0);
                if add {
                    let want = if had == 0 { Inserted::NewPair } else { Inserted::Merged };
                    proptest::prop_assert_eq!(t.insert(k, slot, tiers), want);
                    model.insert((k, slot), had | tiers);
                } else {
                    let left = had & !tiers;
                    let want = (had != 0).then_some(left);
                    proptest::prop_assert_eq!(t.remove(k, slot, tiers), want, "{} {}", k, slot);
                    if left == 0 {
                        model.remove(&(k, slot));
                    } else {
                        model.insert((k, slot), left);
                    }
                }
                let mut want: Vec<(u32, u8)> =
                    model.range((k, 0)..(k, u32::MAX)).map(|(&(_, w), &t)| (w, t)).collect();
                want.sort();
                proptest::prop_assert_eq!(holders(&t, k), want);
                check_runs(&t);
            }
            proptest::prop_assert_eq!(t.len(), model.len());
            let guard = epoch::pin();
            let snap = t.snapshot(&guard);
            for k in (0..16).map(key).chain([0]) {
                for slot in 0..70 {
                    let want = model.get(&(k, slot)).copied().unwrap_or(0);
                    proptest::prop_assert_eq!(snap.tiers_of(k, snap.hash(k), slot), want);
                    proptest::prop_assert_eq!(tiers_by_visit(&t, k, slot), want);
                }
            }
        }
    }

    #[test]
    fn keys_move_into_wide_records_and_back() {
        let t = HolderTable::new();
        for w in 0..40 {
            assert_eq!(
                t.insert(9, w, if w % 2 == 0 { 1 } else { 2 }),
                Inserted::NewPair
            );
        }
        assert_eq!(t.insert(9, 3, 1), Inserted::Merged);
        let want: Vec<(u32, u8)> = (0..40)
            .map(|w| {
                (
                    w,
                    if w == 3 {
                        3
                    } else if w % 2 == 0 {
                        1
                    } else {
                        2
                    },
                )
            })
            .collect();
        assert_eq!(holders(&t, 9), want);
        // A slot far beyond the record's words grows it.
        assert_eq!(t.insert(9, 1_000, 1), Inserted::NewPair);
        assert_eq!(t.len(), 41);
        assert_eq!(t.remove(9, 1_000, 1), Some(0));
        assert_eq!(t.remove(9, 3, 1), Some(2));
        assert_eq!(t.remove(9, 77, 1), None);
        // Down to a few holders: back into slots, still exact.
        for w in 3..40 {
            assert_eq!(t.remove(9, w, 3), Some(0));
        }
        assert_eq!(holders(&t, 9), vec![(0, 1), (1, 2), (2, 1)]);
        assert_eq!(t.len(), 3);
        for w in 0..3 {
            t.remove(9, w, 3);
        }
        assert!(t.is_empty());
        assert_eq!(
            t.table_bytes()
                - t.shards
                    .iter()
                    .map(|s| s.writer.lock().wide_bytes)
                    .sum::<usize>(),
            (0..SHARDS).map(first_capacity).sum::<usize>() * 12
        );
    }

    #[test]
    fn a_far_worker_slot_moves_a_sparse_record_back_into_slots() {
        let t = HolderTable::new();
        for w in 0..17 {
            t.insert(4, w, 1);
        }
        let records = |t: &HolderTable| -> usize {
            t.shards
                .iter()
                .map(|s| {
                    let guard = epoch::pin();
                    let dir = s.wides.load(Ordering::Acquire, &guard);
                    // SAFETY: pinned.
                    unsafe { dir.as_ref() }.map_or(0, |d| {
                        d.entries
                            .iter()
                            .filter(|e| !e.load(Ordering::Acquire, &guard).is_null())
                            .count()
                    })
                })
                .sum()
        };
        assert_eq!(records(&t), 1, "17 holders: one wide record");
        // Slot 5,000 would need 79 words for 18 holders: they go back into slots instead.
        assert_eq!(t.insert(4, 5_000, 2), Inserted::NewPair);
        assert_eq!(records(&t), 0);
        let mut want: Vec<(u32, u8)> = (0..17).map(|w| (w, 1)).collect();
        want.push((5_000, 2));
        assert_eq!(holders(&t, 4), want);
        assert_eq!(t.len(), 18);
    }

    #[test]
    fn readers_never_miss_a_pair_while_its_key_moves_between_slots_and_a_record() {
        use std::sync::Arc;
        let t = Arc::new(HolderTable::new());
        // Key 5 always has holders 0..3; a writer adds and removes 3..40 around them, so the key
        // moves into a wide record and back, over and over.
        for w in 0..3 {
            t.insert(5, w, 1);
        }
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let writer = {
            let (t, stop) = (t.clone(), stop.clone());
            std::thread::spawn(move || {
                let mut rounds = 0u32;
                while !stop.load(Ordering::Relaxed) || rounds < 3 {
                    for w in 3..40 {
                        t.insert(5, w, 1);
                    }
                    for w in 3..40 {
                        t.remove(5, w, 1);
                    }
                    rounds += 1;
                }
            })
        };
        for _ in 0..20_000 {
            let seen = holders(&t, 5);
            for w in 0..3 {
                assert!(seen.contains(&(w, 1)), "holder {w} missing from {seen:?}");
            }
        }
        stop.store(true, Ordering::Relaxed);
        writer.join().unwrap();
        assert_eq!(holders(&t, 5), vec![(0, 1), (1, 1), (2, 1)]);
    }

    #[test]
    fn one_worker_runs_stay_whole_while_writers_churn() {
        use std::sync::Arc;
        let t = Arc::new(HolderTable::new());
        // Keys 0..200 are always held by worker 7; a writer churns other keys (growth,
        // tombstones, shrinking) and moves some of the steady keys into wide records and back.
        let steady: Vec<SequenceHash> = (0..200u64).map(|k| SequenceHash(k << 40 | k)).collect();
        for s in &steady {
            t.insert(s.0, 7, 1);
        }
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let rounds = Arc::new(AtomicUsize::new(0));
        let writer = {
            let (t, stop, rounds, steady) =
                (t.clone(), stop.clone(), rounds.clone(), steady.clone());
            std::thread::spawn(move || {
                let mut k = 1u64 << 50;
                while !stop.load(Ordering::Relaxed) {
                    for _ in 0..64 {
                        t.insert(k, (k % 5) as u32, 1);
                        if k >= (1 << 50) + 3_000 {
                            t.remove(k - 3_000, ((k - 3_000) % 5) as u32, 1);
                        }
                        k += 1;
                    }
                    let s = steady[(k / 64) as usize % steady.len()].0;
                    for w in 8..40 {
                        t.insert(s, w, 2);
                    }
                    for w in 8..40 {
                        t.remove(s, w, 2);
                    }
                    rounds.fetch_add(1, Ordering::Relaxed);
                }
            })
        };
        // Until the writer has grown the table and moved keys many times over.
        let mut reads = 0;
        while reads < 2_000 || rounds.load(Ordering::Relaxed) < 200 {
            reads += 1;
            let guard = epoch::pin();
            let snap = t.snapshot(&guard);
            let hashes: Vec<u64> = steady.iter().map(|s| snap.hash(s.0)).collect();
            assert_eq!(
                snap.run_of(&steady, &hashes, 0, 7, true),
                (steady.len(), None)
            );
            let s = steady[17].0;
            assert_eq!(snap.tiers_of(s, snap.hash(s), 7), 1);
        }
        stop.store(true, Ordering::Relaxed);
        writer.join().unwrap();
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
