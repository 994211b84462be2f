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
    LocalBlockHash(with_le_bytes(block, |bytes| xxh3_64(bytes, seed.0)))
}

/// `xxh3_64_with_seed`, bit for bit, with inputs over 240 bytes (blocks of more than 60 tokens:
/// SGLang's and TensorRT-LLM's pages of 64 tokens and up, the 512-token blocks of long-context
/// deployments) hashed by [`long`]'s AVX2 loop when the CPU has AVX2: `xxhash-rust` is built
/// for the target's baseline (SSE2 on x86-64), whose long-input loop does half the work per
/// instruction.
#[inline]
pub fn xxh3_64(bytes: &[u8], seed: u64) -> u64 {
    #[cfg(target_arch = "x86_64")]
    if bytes.len() > long::MIN_LEN && std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: AVX2 is present (checked just above); the input is long enough.
        return unsafe { long::xxh3_64_avx2(bytes, seed) };
    }
    xxh3_64_with_seed(bytes, seed)
}

/// XXH3-64's path for inputs over 240 bytes, written for AVX2 from the XXH3 specification.
///
/// The input is read in 64-byte stripes; each stripe is mixed into eight 64-bit accumulators
/// (two AVX2 registers) against the secret, moving 8 bytes along the secret per stripe; every
/// 16 stripes (a 1 KiB block) the accumulators are scrambled with the secret's last 64 bytes.
/// The tail's whole stripes follow, then the input's last 64 bytes (overlapping), then the eight
/// accumulators are merged to one word and avalanched. The secret is XXH3's default one with the
/// seed added to its low and subtracted from its high words, as `xxh3_64_with_seed` derives it.
#[cfg(target_arch = "x86_64")]
mod long {
    use std::arch::x86_64::{
        __m256i, _mm256_add_epi64, _mm256_loadu_si256, _mm256_mul_epu32, _mm256_set_epi64x,
        _mm256_set1_epi32, _mm256_shuffle_epi32, _mm256_slli_epi64, _mm256_srli_epi64,
        _mm256_storeu_si256, _mm256_xor_si256,
    };

    /// Longest input XXH3 hashes by its short and mid-size paths.
    pub(super) const MIN_LEN: usize = 240;
    const STRIPE: usize = 64;
    const SECRET_LEN: usize = 192;
    /// Stripes per block: the secret advances 8 bytes per stripe within its first 128 bytes.
    const STRIPES_PER_BLOCK: usize = (SECRET_LEN - STRIPE) / 8;
    const BLOCK_LEN: usize = STRIPE * STRIPES_PER_BLOCK;
    /// Where the last stripe's secret starts, counted back from the end of the secret.
    const LAST_STRIPE_BACK: usize = STRIPE + 7;
    /// Where the merge's secret starts.
    const MERGE_AT: usize = 11;

    const PRIME32_1: u64 = 0x9e37_79b1;
    const PRIME32_2: u64 = 0x85eb_ca77;
    const PRIME32_3: u64 = 0xc2b2_ae3d;
    const PRIME64_1: u64 = 0x9e37_79b1_85eb_ca87;
    const PRIME64_2: u64 = 0xc2b2_ae3d_27d4_eb4f;
    const PRIME64_3: u64 = 0x1656_67b1_9e37_79f9;
    const PRIME64_4: u64 = 0x85eb_ca77_c2b2_ae63;
    const PRIME64_5: u64 = 0x27d4_eb2f_1656_67c5;

    /// XXH3's default secret (`kSecret`), 192 bytes.
    const DEFAULT_SECRET: [u8; SECRET_LEN] = [
        0xb8, 0xfe, 0x6c, 0x39, 0x23, 0xa4, 0x4b, 0xbe, 0x7c, 0x01, 0x81, 0x2c, 0xf7, 0x21, 0xad,
        0x1c, 0xde, 0xd4, 0x6d, 0xe9, 0x83, 0x90, 0x97, 0xdb, 0x72, 0x40, 0xa4, 0xa4, 0xb7, 0xb3,
        0x67, 0x1f, 0xcb, 0x79, 0xe6, 0x4e, 0xcc, 0xc0, 0xe5, 0x78, 0x82, 0x5a, 0xd0, 0x7d, 0xcc,
        0xff, 0x72, 0x21, 0xb8, 0x08, 0x46, 0x74, 0xf7, 0x43, 0x24, 0x8e, 0xe0, 0x35, 0x90, 0xe6,
        0x81, 0x3a, 0x26, 0x4c, 0x3c, 0x28, 0x52, 0xbb, 0x91, 0xc3, 0x00, 0xcb, 0x88, 0xd0, 0x65,
        0x8b, 0x1b, 0x53, 0x2e, 0xa3, 0x71, 0x64, 0x48, 0x97, 0xa2, 0x0d, 0xf9, 0x4e, 0x38, 0x19,
        0xef, 0x46, 0xa9, 0xde, 0xac, 0xd8, 0xa8, 0xfa, 0x76, 0x3f, 0xe3, 0x9c, 0x34, 0x3f, 0xf9,
        0xdc, 0xbb, 0xc7, 0xc7, 0x0b, 0x4f, 0x1d, 0x8a, 0x51, 0xe0, 0x4b, 0xcd, 0xb4, 0x59, 0x31,
        0xc8, 0x9f, 0x7e, 0xc9, 0xd9, 0x78, 0x73, 0x64, 0xea, 0xc5, 0xac, 0x83, 0x34, 0xd3, 0xeb,
        0xc3, 0xc5, 0x81, 0xa0, 0xff, 0xfa, 0x13, 0x63, 0xeb, 0x17, 0x0d, 0xdd, 0x51, 0xb7, 0xf0,
        0xda, 0x49, 0xd3, 0x16, 0x55, 0x26, 0x29, 0xd4, 0x68, 0x9e, 0x2b, 0x16, 0xbe, 0x58, 0x7d,
        0x47, 0xa1, 0xfc, 0x8f, 0xf8, 0xb8, 0xd1, 0x7a, 0xd0, 0x31, 0xce, 0x45, 0xcb, 0x3a, 0x8f,
        0x95, 0x16, 0x04, 0x28, 0xaf, 0xd7, 0xfb, 0xca, 0xbb, 0x4b, 0x40, 0x7e,
    ];

    /// XXH3-64 of `input` (longer than [`MIN_LEN`]) under `seed`.
    ///
    /// # Safety
    /// The CPU must support AVX2.
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn xxh3_64_avx2(input: &[u8], seed: u64) -> u64 {
        let len = input.len();
        assert!(len > MIN_LEN, "the long path needs more than 240 bytes");
        // The seeded secret: + seed on each 16 bytes' low word, - seed on the high one.
        let mut secret = [0u8; SECRET_LEN];
        let seeds = _mm256_set_epi64x(
            seed.wrapping_neg() as i64,
            seed as i64,
            seed.wrapping_neg() as i64,
            seed as i64,
        );
        for i in (0..SECRET_LEN).step_by(32) {
            // SAFETY: i + 32 <= SECRET_LEN for both arrays; unaligned loads and stores.
            unsafe {
                let k = _mm256_loadu_si256(DEFAULT_SECRET.as_ptr().add(i).cast());
                _mm256_storeu_si256(
                    secret.as_mut_ptr().add(i).cast(),
                    _mm256_add_epi64(k, seeds),
                );
            }
        }
        let mut acc = [
            _mm256_set_epi64x(
                PRIME64_3 as i64,
                PRIME64_2 as i64,
                PRIME64_1 as i64,
                PRIME32_3 as i64,
            ),
            _mm256_set_epi64x(
                PRIME32_1 as i64,
                PRIME64_5 as i64,
                PRIME32_2 as i64,
                PRIME64_4 as i64,
            ),
        ];
        let blocks = (len - 1) / BLOCK_LEN;
        for b in 0..blocks {
            for s in 0..STRIPES_PER_BLOCK {
                accumulate(
                    &mut acc,
                    &input[b * BLOCK_LEN + s * STRIPE..][..STRIPE],
                    &secret[s * 8..][..STRIPE],
                );
            }
            scramble(&mut acc, &secret[SECRET_LEN - STRIPE..]);
        }
        let tail_stripes = (len - 1 - blocks * BLOCK_LEN) / STRIPE;
        for s in 0..tail_stripes {
            accumulate(
                &mut acc,
                &input[blocks * BLOCK_LEN + s * STRIPE..][..STRIPE],
                &secret[s * 8..][..STRIPE],
            );
        }
        accumulate(
            &mut acc,
            &input[len - STRIPE..],
            &secret[SECRET_LEN - LAST_STRIPE_BACK..][..STRIPE],
        );
        let mut words = [0u64; 8];
        // SAFETY: `words` is 64 bytes: two unaligned 32-byte stores.
        unsafe {
            _mm256_storeu_si256(words.as_mut_ptr().cast(), acc[0]);
            _mm256_storeu_si256(words.as_mut_ptr().add(4).cast(), acc[1]);
        }
        let key = |i: usize| {
            let at = MERGE_AT + 8 * i;
            u64::from_le_bytes(secret[at..at + 8].try_into().expect("8 bytes"))
        };
        let mut h = (len as u64).wrapping_mul(PRIME64_1);
        for i in 0..4 {
            let p = u128::from(words[2 * i] ^ key(2 * i))
                * u128::from(words[2 * i + 1] ^ key(2 * i + 1));
            h = h.wrapping_add((p as u64) ^ ((p >> 64) as u64));
        }
        super::avalanche(h)
    }

    /// Mixes one 64-byte stripe into the accumulators: lane `i` gains the product of the low
    /// and high halves of `input[i] ^ secret[i]`, and lane `i ^ 1` gains `input[i]`.
    #[inline]
    #[target_feature(enable = "avx2")]
    fn accumulate(acc: &mut [__m256i; 2], input: &[u8], secret: &[u8]) {
        assert!(input.len() >= STRIPE && secret.len() >= STRIPE);
        for (j, a) in acc.iter_mut().enumerate() {
            // SAFETY: bytes 32j..32j+32 of both slices are in bounds (checked above).
            let (data, key) = unsafe {
                (
                    _mm256_loadu_si256(input.as_ptr().add(32 * j).cast()),
                    _mm256_loadu_si256(secret.as_ptr().add(32 * j).cast()),
                )
            };
            let mixed = _mm256_xor_si256(data, key);
            // Each lane's high half moved down (a shift, not a shuffle: shuffles have one
            // port, which the swap below already uses), so one 32x32->64 multiply per lane.
            let high = _mm256_srli_epi64(mixed, 32);
            let product = _mm256_mul_epu32(mixed, high);
            // Lanes swapped in pairs: lane i gets input lane i ^ 1.
            let swapped = _mm256_shuffle_epi32(data, 0b01_00_11_10);
            *a = _mm256_add_epi64(*a, _mm256_add_epi64(swapped, product));
        }
    }

    /// The accumulators after each block: `((a ^ (a >> 47)) ^ secret) * PRIME32_1` per lane.
    #[inline]
    #[target_feature(enable = "avx2")]
    fn scramble(acc: &mut [__m256i; 2], secret: &[u8]) {
        assert!(secret.len() >= STRIPE);
        let prime = _mm256_set1_epi32(PRIME32_1 as i32);
        for (j, a) in acc.iter_mut().enumerate() {
            // SAFETY: bytes 32j..32j+32 of `secret` are in bounds (checked above).
            let key = unsafe { _mm256_loadu_si256(secret.as_ptr().add(32 * j).cast()) };
            let mixed = _mm256_xor_si256(_mm256_xor_si256(*a, _mm256_srli_epi64(*a, 47)), key);
            // A 64x32-bit multiply from two 32x32->64 ones: low half, plus high half shifted.
            let low = _mm256_mul_epu32(mixed, prime);
            let high = _mm256_mul_epu32(_mm256_srli_epi64(mixed, 32), prime);
            *a = _mm256_add_epi64(low, _mm256_slli_epi64(high, 32));
        }
    }
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

/// XXH3's avalanche multiplier.
const AVALANCHE: u64 = 0x1656_6791_9e37_79f9;

/// XXH3's avalanche.
#[inline(always)]
fn avalanche(acc: u64) -> u64 {
    let h = (acc ^ (acc >> 37)).wrapping_mul(AVALANCHE);
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
/// the block's local hash ([`Chainer::new`]) is done off the critical path; what remains on it
/// per block is one xor, one 64×64→128 multiply, its fold, one add and the avalanche (see
/// `Chainer::step`). The value is XXH3's
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
        self.step(parent.0 ^ FLIP1).0
    }

    /// One chain step from `lo`, the parent's prefix hash xor [`FLIP1`] (XXH3's low input
    /// word): this block's prefix hash, and the next step's `lo`.
    ///
    /// Written for the latency of the serial chain: the dependent path is xor, multiply, xor,
    /// one add, shift, xor, multiply, and the next step's xor. Two rewrites keep it that short,
    /// each made opaque to the compiler ([`opaque`]), which would otherwise undo it:
    /// `base + bswap(lo)` is summed before the product is ready, so only one add follows the
    /// multiply (LLVM moves the constant in `base` after it); and the next `lo` xors [`FLIP1`]
    /// into the multiply's result beside the avalanche's last shift instead of after its last
    /// xor. Measured in `benches/peers`: see the README's hashing figures.
    #[inline(always)]
    fn step(self, lo: u64) -> (SequenceHash, u64) {
        let product = u128::from(lo) * u128::from(self.hi);
        let folded = (product as u64) ^ ((product >> 64) as u64);
        let early = opaque(self.base.wrapping_add(lo.swap_bytes()));
        let acc = early.wrapping_add(folded);
        let h = (acc ^ (acc >> 37)).wrapping_mul(AVALANCHE);
        let next = opaque(h ^ FLIP1) ^ (h >> 32);
        (SequenceHash(h ^ (h >> 32)), next)
    }
}

/// `x`, with the compiler unable to see how it was computed, so it cannot reassociate the
/// arithmetic around it (an empty assembly block: no instruction, the value stays in its
/// register).
#[inline(always)]
fn opaque(mut x: u64) -> u64 {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: the template is a comment: no instruction runs, no memory, stack or flag is
    // touched, and the register leaves with the value it came in with.
    unsafe {
        std::arch::asm!("/* {0} */", inout(reg) x, options(pure, nomem, nostack, preserves_flags));
    }
    x
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
    let prev = match parent {
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
    let mut lo = prev.0 ^ FLIP1;
    for &local in rest {
        let seq;
        (seq, lo) = Chainer::new(local).step(lo);
        out.push(seq);
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
        LocalBlockHash(with_le_bytes(b, |bytes| xxh3_64(bytes, seed.0)))
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
    seqs[0] = SequenceHash(local.0);
    let mut lo = local.0 ^ FLIP1;
    let (groups, tail) = rest.as_chunks::<K>();
    let (local_groups, local_tail) = locals[1..].as_chunks_mut::<K>();
    let (seq_groups, seq_tail) = seqs[1..].as_chunks_mut::<K>();
    for ((group, ls), ss) in groups.iter().zip(local_groups).zip(seq_groups) {
        for (l, b) in ls.iter_mut().zip(group) {
            *l = keys.hash(b);
        }
        for (s, l) in ss.iter_mut().zip(ls.iter()) {
            (*s, lo) = Chainer::new(*l).step(lo);
        }
    }
    for ((b, l), s) in tail.iter().zip(local_tail).zip(seq_tail) {
        *l = keys.hash(b);
        (*s, lo) = Chainer::new(*l).step(lo);
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
    seqs[0] = SequenceHash(local.0);
    let mut lo = local.0 ^ FLIP1;
    for ((block, l), s) in blocks.zip(&mut locals[1..]).zip(&mut seqs[1..]) {
        let local = hash(block);
        *l = local;
        (*s, lo) = Chainer::new(local).step(lo);
    }
    (locals, seqs)
}

/// XXH3-64 with `seed` over the tokens' little-endian bytes (the form every block hash reads),
/// without copying them on little-endian targets.
pub fn xxh3_64_tokens(tokens: &[u32], seed: u64) -> u64 {
    with_le_bytes(tokens, |b| xxh3_64(b, seed))
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

    /// The dispatching hash (AVX2 for long inputs where the CPU has it) is XXH3-64, bit for bit:
    /// every length around the path and block boundaries, then random lengths and seeds.
    #[test]
    fn the_long_input_path_is_xxh3() {
        let mut x = 0x2545_f491_4f6c_dd1du64;
        let mut next = || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        let bytes: Vec<u8> = (0..8192 + 128).map(|_| next() as u8).collect();
        let seeds = [
            0,
            1,
            BASE_SEED,
            u64::MAX,
            HashSeed::new(Some("a"), Some("t")).0,
        ];
        let mut lengths: Vec<usize> = (0..=300).collect();
        for edge in [1024usize, 2048, 3072, 4096, 8192] {
            lengths.extend(edge - 65..=edge + 65);
        }
        for &len in &lengths {
            for &seed in &seeds {
                assert_eq!(
                    xxh3_64(&bytes[..len], seed),
                    xxh3_64_with_seed(&bytes[..len], seed),
                    "length {len}, seed {seed:#x}"
                );
            }
        }
        // Unaligned starts too.
        for start in 1..8 {
            let b = &bytes[start..start + 2048];
            assert_eq!(xxh3_64(b, 7), xxh3_64_with_seed(b, 7));
        }
        #[cfg(target_arch = "x86_64")]
        if std::arch::is_x86_feature_detected!("avx2") {
            // The AVX2 loop itself, whatever the dispatch decides.
            for len in [241, 1024, 1025, 2048, 5000, 8192] {
                // SAFETY: AVX2 is present; len > 240.
                let got = unsafe { long::xxh3_64_avx2(&bytes[..len], BASE_SEED) };
                assert_eq!(got, xxh3_64_with_seed(&bytes[..len], BASE_SEED));
            }
        }
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig {
            cases: 256,
            rng_seed: proptest::test_runner::RngSeed::Fixed(0x7878_6833),
            failure_persistence: None,
            ..proptest::prelude::ProptestConfig::default()
        })]
        #[test]
        fn any_input_hashes_as_xxh3(
            bytes in proptest::collection::vec(proptest::num::u8::ANY, 0..8192),
            seed in proptest::num::u64::ANY,
        ) {
            proptest::prop_assert_eq!(xxh3_64(&bytes, seed), xxh3_64_with_seed(&bytes, seed));
        }

        #[test]
        fn long_blocks_hash_as_xxh3_of_their_bytes(
            tokens in proptest::collection::vec(proptest::num::u32::ANY, 61..2048),
            seed in proptest::num::u64::ANY,
        ) {
            let bytes: Vec<u8> = tokens.iter().flat_map(|t| t.to_le_bytes()).collect();
            let want = xxh3_64_with_seed(&bytes, seed);
            proptest::prop_assert_eq!(hash_block(&tokens, HashSeed(seed)).0, want);
            let (locals, _) = prompt_hashes(&tokens, tokens.len(), HashSeed(seed));
            proptest::prop_assert_eq!(locals, vec![LocalBlockHash(want)]);
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
