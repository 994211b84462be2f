//! Salted block hashing: the contract shared with Dynamo's KV router.
//!
//! A prompt is cut into complete blocks of `block_size` tokens. Each block gets a *local* hash
//! (XXH3-64 over its tokens as little-endian u32, under a seed that mixes in the LoRA adapter and
//! the cache salt), and each prefix gets a *sequence* hash chained over the local hashes. The
//! index is keyed by sequence hashes, so a match always means "the same tokens, in the same
//! place, under the same salt and adapter".
//!
//! Invariants: unsalted, adapter-less hashes are bit-for-bit Dynamo's (seed 1337); a trailing
//! partial block is never hashed; `block_size == 0` yields no hashes.

use xxhash_rust::xxh3::xxh3_64_with_seed;

/// Seed every local hash starts from, and the only seed of the sequence chain.
pub const BASE_SEED: u64 = 1337;
/// Seed used to hash the LoRA name into the local-hash seed.
const LORA_SEED: u64 = 0;
/// Seed used to hash the cache salt into the local-hash seed; distinct from [`LORA_SEED`] so that
/// salt "X" and adapter "X" never collide.
const SALT_SEED: u64 = 1;
/// Seed used to hash a salt *digest* (the namespace of a salt too long to forward) into the
/// local-hash seed; distinct from [`SALT_SEED`], so a digest never hashes like a literal salt
/// whose bytes happen to equal it.
const SALT_DIGEST_SEED: u64 = 2;

/// Hash of one complete block of tokens under a [`HashSeed`]. Position-independent.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct LocalBlockHash(pub u64);

/// Hash identifying a whole prefix: the chain of local hashes up to and including one block.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SequenceHash(pub u64);

/// The seed of a request's local block hashes: 1337, plus the LoRA term, plus the salt term.
///
/// Two requests can share cached blocks only if their seeds are equal, which is what makes tenant
/// isolation structural rather than a filter applied afterwards.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct HashSeed(pub u64);

impl HashSeed {
    /// The seed of an unsalted request without an adapter.
    pub const UNSALTED: HashSeed = HashSeed(BASE_SEED);

    /// Computes the seed for an optional LoRA adapter name and an optional cache salt.
    /// Empty strings count as absent, exactly like `None`.
    pub fn new(lora_name: Option<&str>, salt: Option<&str>) -> HashSeed {
        let mut seed = BASE_SEED;
        if let Some(lora) = lora_name.filter(|l| !l.is_empty()) {
            seed = seed.wrapping_add(xxh3_64_with_seed(lora.as_bytes(), LORA_SEED));
        }
        if let Some(salt) = salt.filter(|s| !s.is_empty()) {
            seed = seed.wrapping_add(xxh3_64_with_seed(salt.as_bytes(), SALT_SEED));
        }
        HashSeed(seed)
    }

    /// The seed for an optional LoRA adapter and a salt known only by its SHA-256 digest (see
    /// `namespace`: salts too long to forward to the engine).
    pub fn with_salt_digest(lora_name: Option<&str>, digest: &[u8; 32]) -> HashSeed {
        let HashSeed(seed) = HashSeed::new(lora_name, None);
        HashSeed(seed.wrapping_add(xxh3_64_with_seed(digest, SALT_DIGEST_SEED)))
    }
}

/// Local hashes of every complete block of `tokens`. Cost: one XXH3 pass over the token bytes.
pub fn local_block_hashes(
    tokens: &[u32],
    block_size: usize,
    seed: HashSeed,
) -> Vec<LocalBlockHash> {
    if block_size == 0 {
        return Vec::new();
    }
    if block_size == 16 {
        let keys = Block16::new(seed);
        let (blocks, _) = tokens.as_chunks::<16>();
        return blocks.iter().map(|b| keys.hash(b)).collect();
    }
    tokens
        .chunks_exact(block_size)
        .map(|block| hash_block(block, seed))
        .collect()
}

/// Local hash of one block (any length; callers pass complete blocks).
pub fn hash_block(block: &[u32], seed: HashSeed) -> LocalBlockHash {
    if let Ok(block) = <&[u32; 16]>::try_from(block) {
        return Block16::new(seed).hash(block);
    }
    LocalBlockHash(with_le_bytes(block, |bytes| {
        xxh3_64_with_seed(bytes, seed.0)
    }))
}

/// XXH3-64 of exactly 64 bytes (one block of 16 tokens) under one seed, written out.
///
/// Why not call `xxh3_64_with_seed`: that is a call per block that dispatches on the length and
/// adds the seed to the secret every time. For 64 bytes XXH3 is four 16-byte mixes (one
/// 64×64→128 multiply each) and the avalanche; here the seeded secret words are computed once per
/// request ([`Block16::new`]) and the rest inlines into the caller's loop, so consecutive blocks
/// overlap. The tokens are read in place as little-endian words (token `2i` in the low half of
/// word `i`), which is the spec's byte layout on every target: no copy. The value is
/// `xxh3_64_with_seed` of the 64 bytes, bit for bit (checked in the tests).
#[derive(Clone, Copy)]
struct Block16 {
    /// `keys[i]`: what input word `i` is xored with (a secret word plus or minus the seed).
    keys: [u64; 8],
}

/// Words 0..64 of XXH3's default secret (`kSecret`), as its 17–128-byte path reads them.
const SECRET_WORDS: [u64; 8] = [
    0xbe4b_a423_396c_feb8,
    0x1cad_21f7_2c81_017c,
    0xdb97_9083_e96d_d4de,
    SECRET_24,
    SECRET_32,
    SECRET_40,
    SECRET_48,
    0x4c26_3a81_e690_35e0,
];

impl Block16 {
    /// The seeded keys. XXH3 for 64 bytes mixes input bytes 0..16 with secret 0..16, 16..32
    /// with 32..48, 32..48 with 48..64 and 48..64 with 16..32; the low word of each pair gets
    /// `secret + seed`, the high word `secret - seed`.
    #[inline(always)]
    fn new(seed: HashSeed) -> Block16 {
        let s = seed.0;
        let lo = |i: usize| SECRET_WORDS[i].wrapping_add(s);
        let hi = |i: usize| SECRET_WORDS[i].wrapping_sub(s);
        Block16 {
            keys: [lo(0), hi(1), lo(4), hi(5), lo(6), hi(7), lo(2), hi(3)],
        }
    }

    #[inline(always)]
    fn hash(&self, t: &[u32; 16]) -> LocalBlockHash {
        /// XXH3's `PRIME64_1` times the input length, 64.
        const LEN_TERM: u64 = 0x9e37_79b1_85eb_ca87u64.wrapping_mul(64);
        let word = |i: usize| u64::from(t[2 * i]) | (u64::from(t[2 * i + 1]) << 32);
        let mix = |i: usize| {
            let p = u128::from(word(i) ^ self.keys[i]) * u128::from(word(i + 1) ^ self.keys[i + 1]);
            (p as u64) ^ ((p >> 64) as u64)
        };
        let acc = LEN_TERM
            .wrapping_add(mix(0))
            .wrapping_add(mix(2))
            .wrapping_add(mix(4).wrapping_add(mix(6)));
        LocalBlockHash(avalanche(acc))
    }
}

/// XXH3's avalanche.
#[inline(always)]
fn avalanche(acc: u64) -> u64 {
    let h = (acc ^ (acc >> 37)).wrapping_mul(0x1656_6791_9e37_79f9);
    h ^ (h >> 32)
}

/// The chained hash of a prefix whose previous prefix hash is `parent`:
/// `xxh3_64_with_seed(le(parent) ++ le(local), 1337)`, computed by [`Chainer`].
#[inline]
pub fn chain(parent: SequenceHash, local: LocalBlockHash) -> SequenceHash {
    Chainer::new(local).after(parent)
}

/// XXH3-64 of exactly 16 bytes under seed [`BASE_SEED`], written out for the chain.
///
/// Why not call `xxh3_64_with_seed`: the chain is a serial dependency (each prefix hash needs
/// the previous one), so its latency, not its throughput, bounds hashing a prompt. This form
/// folds the seed into constants and splits the work so that everything that depends only on
/// the block's local hash ([`Chainer::new`]) is done off the critical path; what remains per
/// block is one xor, one 64×64→128 multiply, two adds and the avalanche. The value is XXH3's
/// for 9–16-byte inputs, bit for bit (checked against `xxh3_64_with_seed` in the tests).
#[derive(Clone, Copy)]
pub struct Chainer {
    /// `le(local) ^ flip2`, XXH3's high input word.
    hi: u64,
    /// `16 + hi`: the terms of the accumulator that do not depend on the parent.
    base: u64,
}

/// Words 24..56 of XXH3's default secret (`kSecret`), as XXH3's 9–16-byte path reads them.
const SECRET_24: u64 = 0x1f67_b3b7_a4a4_4072;
const SECRET_32: u64 = 0x78e5_c0cc_4ee6_79cb;
const SECRET_40: u64 = 0x2172_ffcc_7dd0_5a82;
const SECRET_48: u64 = 0x8e24_43f7_7446_08b8;
const FLIP1: u64 = (SECRET_24 ^ SECRET_32).wrapping_add(BASE_SEED);
const FLIP2: u64 = (SECRET_40 ^ SECRET_48).wrapping_sub(BASE_SEED);

impl Chainer {
    /// The parts of the chain step that depend on the block alone.
    #[inline(always)]
    pub fn new(local: LocalBlockHash) -> Chainer {
        let hi = local.0 ^ FLIP2;
        Chainer {
            hi,
            base: 16u64.wrapping_add(hi),
        }
    }

    /// The prefix hash of this block after the prefix `parent`.
    #[inline(always)]
    pub fn after(self, parent: SequenceHash) -> SequenceHash {
        let lo = parent.0 ^ FLIP1;
        let product = u128::from(lo) * u128::from(self.hi);
        let folded = (product as u64) ^ ((product >> 64) as u64);
        let acc = self.base.wrapping_add(lo.swap_bytes()).wrapping_add(folded);
        SequenceHash(avalanche(acc))
    }
}

/// Sequence hashes of a chain of local hashes that starts a prompt (`seq[0] = local[0]`).
pub fn sequence_hashes(locals: &[LocalBlockHash]) -> Vec<SequenceHash> {
    let mut out = Vec::with_capacity(locals.len());
    extend_sequence(None, locals, &mut out);
    out
}

/// Appends the sequence hashes of `locals`, continuing after the prefix `parent` (or starting a
/// prompt when `parent` is `None`).
pub fn extend_sequence(
    parent: Option<SequenceHash>,
    locals: &[LocalBlockHash],
    out: &mut Vec<SequenceHash>,
) {
    out.reserve(locals.len());
    let mut rest = locals;
    let mut prev = match parent {
        Some(p) => p,
        None => {
            let Some((first, tail)) = locals.split_first() else {
                return;
            };
            out.push(SequenceHash(first.0));
            rest = tail;
            SequenceHash(first.0)
        }
    };
    for &local in rest {
        prev = Chainer::new(local).after(prev);
        out.push(prev);
    }
}

/// Both hash lists of a prompt, as the `kv-epp hash` subcommand and the query path need them.
pub fn prompt_hashes(
    tokens: &[u32],
    block_size: usize,
    seed: HashSeed,
) -> (Vec<LocalBlockHash>, Vec<SequenceHash>) {
    if block_size == 0 {
        return (Vec::new(), Vec::new());
    }
    if block_size == 16 {
        return chained_16(tokens.as_chunks::<16>().0, Block16::new(seed));
    }
    chained(tokens.chunks_exact(block_size), |b| {
        LocalBlockHash(with_le_bytes(b, |bytes| xxh3_64_with_seed(bytes, seed.0)))
    })
}

/// [`chained`] for blocks of 16 tokens, four blocks at a time: the four local hashes (sixteen
/// independent multiplies) are written out before the four serial chain steps, so the CPU
/// overlaps one group's chain with the next group's local hashes with few registers live.
/// Measured (`make bench`, core): about 0.8x of raw XXH3 over the same bytes, against 0.7x for
/// block-by-block interleaving.
fn chained_16(blocks: &[[u32; 16]], keys: Block16) -> (Vec<LocalBlockHash>, Vec<SequenceHash>) {
    const K: usize = 4;
    let n = blocks.len();
    let mut locals = vec![LocalBlockHash(0); n];
    let mut seqs = vec![SequenceHash(0); n];
    let Some((first, rest)) = blocks.split_first() else {
        return (locals, seqs);
    };
    let local = keys.hash(first);
    locals[0] = local;
    let mut prev = SequenceHash(local.0);
    seqs[0] = prev;
    let (groups, tail) = rest.as_chunks::<K>();
    let (local_groups, local_tail) = locals[1..].as_chunks_mut::<K>();
    let (seq_groups, seq_tail) = seqs[1..].as_chunks_mut::<K>();
    for ((group, ls), ss) in groups.iter().zip(local_groups).zip(seq_groups) {
        for (l, b) in ls.iter_mut().zip(group) {
            *l = keys.hash(b);
        }
        for (s, l) in ss.iter_mut().zip(ls.iter()) {
            prev = Chainer::new(*l).after(prev);
            *s = prev;
        }
    }
    for ((b, l), s) in tail.iter().zip(local_tail).zip(seq_tail) {
        *l = keys.hash(b);
        prev = Chainer::new(*l).after(prev);
        *s = prev;
    }
    (locals, seqs)
}

/// Local and sequence hashes of `blocks`, in one pass: each block's local hash (independent of
/// every other block) overlaps the previous block's chain step (serial) in the CPU's pipeline;
/// outputs are written in place, so the loop carries no capacity checks.
#[inline(always)]
fn chained<B>(
    blocks: impl ExactSizeIterator<Item = B>,
    hash: impl Fn(B) -> LocalBlockHash,
) -> (Vec<LocalBlockHash>, Vec<SequenceHash>) {
    let n = blocks.len();
    let mut locals = vec![LocalBlockHash(0); n];
    let mut seqs = vec![SequenceHash(0); n];
    let mut blocks = blocks;
    let Some(first) = blocks.next() else {
        return (locals, seqs);
    };
    let local = hash(first);
    locals[0] = local;
    let mut prev = SequenceHash(local.0);
    seqs[0] = prev;
    for ((block, l), s) in blocks.zip(&mut locals[1..]).zip(&mut seqs[1..]) {
        let local = hash(block);
        *l = local;
        prev = Chainer::new(local).after(prev);
        *s = prev;
    }
    (locals, seqs)
}

/// Runs `f` over the tokens as little-endian bytes, without copying on little-endian targets.
#[inline]
fn with_le_bytes<R>(tokens: &[u32], f: impl FnOnce(&[u8]) -> R) -> R {
    #[cfg(target_endian = "little")]
    {
        // SAFETY: u32 has no padding and u8 has alignment 1, so the token slice is a valid byte
        // slice of 4x the length; on little-endian targets these bytes are exactly the LE form.
        let bytes = unsafe {
            std::slice::from_raw_parts(tokens.as_ptr().cast::<u8>(), std::mem::size_of_val(tokens))
        };
        f(bytes)
    }
    #[cfg(not(target_endian = "little"))]
    {
        let bytes: Vec<u8> = tokens.iter().flat_map(|t| t.to_le_bytes()).collect();
        f(&bytes)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn locals(tokens: &[u32], bs: usize, lora: Option<&str>, salt: Option<&str>) -> Vec<u64> {
        local_block_hashes(tokens, bs, HashSeed::new(lora, salt))
            .into_iter()
            .map(|h| h.0)
            .collect()
    }

    fn seqs(tokens: &[u32], bs: usize, lora: Option<&str>, salt: Option<&str>) -> Vec<u64> {
        let (_, s) = prompt_hashes(tokens, bs, HashSeed::new(lora, salt));
        s.into_iter().map(|h| h.0).collect()
    }

    #[test]
    fn raw_xxh3_vector() {
        assert_eq!(xxh3_64_with_seed(b"test data", 1337), 13226331709069118873);
    }

    #[test]
    fn seed_vectors() {
        assert_eq!(HashSeed::new(None, None).0, 1337);
        assert_eq!(
            HashSeed::new(Some("adapter-a"), None).0,
            8842669519798868182
        );
        assert_eq!(HashSeed::new(None, Some("tenant-a")).0, 1948188790972764086);
        assert_eq!(
            HashSeed::new(Some("adapter-a"), Some("tenant-a")).0,
            10790858310771630931
        );
        assert_eq!(HashSeed::new(Some("tenant-a"), None).0, 7159698576361520314);
        assert_eq!(HashSeed::new(Some(""), Some("")), HashSeed::UNSALTED);
    }

    #[test]
    fn single_block_vectors() {
        let t = [0, 1, 2, 3];
        assert_eq!(locals(&t, 4, None, None), [9143094415614847814]);
        assert_eq!(seqs(&t, 4, None, None), [9143094415614847814]);
        assert_eq!(
            locals(&t, 4, Some("adapter-a"), None),
            [6665157333201000639]
        );
        assert_eq!(
            locals(&t, 4, None, Some("tenant-a")),
            [17009624042690211646]
        );
        assert_eq!(
            locals(&t, 4, Some("adapter-a"), Some("tenant-a")),
            [8269515957840517240]
        );
        assert_eq!(locals(&t, 4, Some("tenant-a"), None), [582854293518545300]);
        assert_eq!(locals(&t, 4, None, Some("")), [9143094415614847814]);
        assert_eq!(locals(&t, 4, Some(""), None), [9143094415614847814]);
    }

    #[test]
    fn chained_vectors_block_4() {
        let t: Vec<u32> = (1..=8).collect();
        assert_eq!(
            locals(&t, 4, None, None),
            [14643705804678351452, 16777012769546811212]
        );
        assert_eq!(
            seqs(&t, 4, None, None),
            [14643705804678351452, 4945711292740353085]
        );
        assert_eq!(
            locals(&t, 4, None, Some("tenant-a")),
            [5738685477468498325, 11202231085456067787]
        );
        assert_eq!(
            seqs(&t, 4, None, Some("tenant-a")),
            [5738685477468498325, 1076233986426276607]
        );
    }

    #[test]
    fn chained_vectors_block_16() {
        let t: Vec<u32> = (1..=48).collect();
        assert_eq!(
            locals(&t, 16, None, None),
            [
                16863443419780771464,
                2287610619914608821,
                12129935312930971799
            ]
        );
        assert_eq!(
            seqs(&t, 16, None, None),
            [
                16863443419780771464,
                12466389667045779788,
                960926348267535642
            ]
        );
        assert_eq!(
            locals(&t, 16, None, Some("tenant-a")),
            [
                8175209796170318505,
                13248293275458056256,
                2876216365566391037
            ]
        );
        assert_eq!(
            seqs(&t, 16, None, Some("tenant-a")),
            [
                8175209796170318505,
                1199464708288223189,
                8909045955271374968
            ]
        );
        assert_eq!(
            locals(&t, 16, Some("lora-a"), None),
            [
                505115133176759089,
                3289525268460731972,
                12345990564547099292
            ]
        );
        assert_eq!(
            seqs(&t, 16, Some("lora-a"), None),
            [505115133176759089, 9189390670180411066, 2091250518290727944]
        );
    }

    #[test]
    fn partial_tail_is_dropped() {
        let t: Vec<u32> = (0..35).collect();
        assert_eq!(
            locals(&t, 16, None, None),
            [15310707395893867146, 15292316782987903195]
        );
    }

    #[test]
    fn zero_block_size_gives_nothing() {
        assert!(locals(&[1, 2, 3], 0, None, None).is_empty());
        assert!(locals(&[], 16, None, None).is_empty());
    }

    #[test]
    fn the_written_out_chain_step_is_xxh3_of_the_16_bytes() {
        let mut x = 0x1234_5678_9abc_def0u64;
        let mut next = || {
            x = x
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            x ^ (x >> 29)
        };
        for i in 0..100_000 {
            let (parent, local) = match i {
                0 => (0, 0),
                1 => (u64::MAX, u64::MAX),
                2 => (BASE_SEED, FLIP1),
                _ => (next(), next()),
            };
            let mut buf = [0u8; 16];
            buf[..8].copy_from_slice(&parent.to_le_bytes());
            buf[8..].copy_from_slice(&local.to_le_bytes());
            assert_eq!(
                chain(SequenceHash(parent), LocalBlockHash(local)).0,
                xxh3_64_with_seed(&buf, BASE_SEED),
                "parent {parent:#x} local {local:#x}"
            );
        }
    }

    #[test]
    fn the_written_out_16_token_block_is_xxh3_of_its_64_bytes() {
        let mut x = 0x0f1e_2d3c_4b5a_6978u64;
        let mut next = || {
            x = x
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            x ^ (x >> 29)
        };
        for i in 0..100_000 {
            let seed = match i {
                0 => 0,
                1 => u64::MAX,
                2 => BASE_SEED,
                _ => next(),
            };
            let mut block = [0u32; 16];
            for t in &mut block {
                *t = match i {
                    0 => 0,
                    1 => u32::MAX,
                    _ => next() as u32,
                };
            }
            let bytes: Vec<u8> = block.iter().flat_map(|t| t.to_le_bytes()).collect();
            let want = xxh3_64_with_seed(&bytes, seed);
            assert_eq!(
                Block16::new(HashSeed(seed)).hash(&block).0,
                want,
                "seed {seed:#x}"
            );
            assert_eq!(hash_block(&block, HashSeed(seed)).0, want);
        }
    }

    #[test]
    fn the_16_token_path_equals_the_generic_one() {
        let mut x = 7u64;
        let tokens: Vec<u32> = (0..16 * 40 + 5)
            .map(|_| {
                x = x.wrapping_mul(6364136223846793005).wrapping_add(1);
                (x >> 33) as u32
            })
            .collect();
        let seed = HashSeed::new(Some("lora"), Some("tenant"));
        let generic: Vec<LocalBlockHash> = tokens
            .chunks_exact(16)
            .map(|b| LocalBlockHash(xxh3_64_with_seed(&with_le_bytes(b, <[u8]>::to_vec), seed.0)))
            .collect();
        let mut want = vec![SequenceHash(generic[0].0)];
        for l in &generic[1..] {
            let mut buf = [0u8; 16];
            buf[..8].copy_from_slice(&want.last().unwrap().0.to_le_bytes());
            buf[8..].copy_from_slice(&l.0.to_le_bytes());
            want.push(SequenceHash(xxh3_64_with_seed(&buf, BASE_SEED)));
        }
        // Every length, so each group-of-four tail shape is covered.
        for blocks in 0..=generic.len() {
            let prompt = &tokens[..blocks * 16 + 5.min(tokens.len() - blocks * 16)];
            let (locals, seqs) = prompt_hashes(prompt, 16, seed);
            assert_eq!(locals, generic[..blocks]);
            assert_eq!(seqs, want[..blocks]);
            assert_eq!(local_block_hashes(prompt, 16, seed), generic[..blocks]);
        }
    }

    #[test]
    fn extending_a_prefix_equals_hashing_the_whole() {
        let t: Vec<u32> = (0..64).collect();
        let seed = HashSeed::new(None, Some("t"));
        let all = prompt_hashes(&t, 16, seed).1;
        let head = prompt_hashes(&t[..32], 16, seed).1;
        let tail_locals = local_block_hashes(&t[32..], 16, seed);
        let mut joined = head.clone();
        extend_sequence(head.last().copied(), &tail_locals, &mut joined);
        assert_eq!(all, joined);
    }
}
