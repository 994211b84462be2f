//! A prefix cache that behaves like vLLM's: a fixed pool of blocks, block hashes chained over the
//! parent, LRU eviction of unreferenced blocks, full blocks only, and the KV events vLLM would
//! publish for every change.
//!
//! Block hash (the *engine* hash, opaque to the router): SHA-256 over the parent digest, the
//! block's tokens and its extra keys (the LoRA name on every block, the request's cache salt on
//! the first block only), like vLLM's. Two requests share a block only if every earlier block and
//! the salt agree, which is how the engine isolates tenants.
//!
//! Invariants: a block referenced by a running request is never evicted; every stored block is
//! announced once by a `Stored` event and every eviction by a `Removed` event, so a consumer of the
//! events knows exactly what the cache holds.

use std::collections::{HashMap, VecDeque};

use sha2::{Digest, Sha256};

/// A 32-byte engine block digest (vLLM publishes its low 64 bits, or the raw bytes).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct EngineDigest(pub [u8; 32]);

impl EngineDigest {
    /// The low 64 bits, as vLLM's integer form publishes them.
    pub fn as_u64(&self) -> u64 {
        u64::from_be_bytes(self.0[24..32].try_into().expect("8 bytes"))
    }
}

/// One extra key of a block, as vLLM publishes it (untagged).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ExtraKey {
    /// A LoRA adapter name, or a cache salt (first block only) — strings, untagged.
    Str(String),
}

/// A KV event, in the order the engine emits them.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum CacheEvent {
    /// New full blocks cached for one request, continuing `parent` (or starting a sequence).
    Stored {
        /// The block before the first new one.
        parent: Option<EngineDigest>,
        /// The new blocks' digests.
        hashes: Vec<EngineDigest>,
        /// Their tokens, `hashes.len() * block_size`.
        tokens: Vec<u32>,
        /// Extra keys per block.
        extra_keys: Vec<Vec<ExtraKey>>,
        /// The request's LoRA adapter.
        lora_name: Option<String>,
        /// The request's salt, for engines that publish it on every store (SGLang).
        salt: Option<String>,
    },
    /// Blocks evicted.
    Removed {
        /// Their digests.
        hashes: Vec<EngineDigest>,
    },
    /// The whole cache was reset.
    Cleared,
}

/// A request as the cache sees it.
#[derive(Clone, Copy, Debug)]
pub struct CacheRequest<'a> {
    /// Prompt tokens.
    pub tokens: &'a [u32],
    /// Cache salt (already validated by the engine's rules).
    pub salt: Option<&'a str>,
    /// LoRA adapter.
    pub lora_name: Option<&'a str>,
}

/// What admitting a request did.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Admission {
    /// Prompt tokens found in the cache (whole blocks).
    pub cached_tokens: usize,
    /// Full prompt blocks.
    pub prompt_blocks: usize,
    /// The blocks this request references until [`PrefixCache::release`].
    pub blocks: Vec<u32>,
}

/// Why a request could not be admitted.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CacheError {
    /// Not enough free or evictable blocks.
    #[error("prompt needs {needed} blocks but only {available} can be freed")]
    OutOfBlocks {
        /// Blocks needed.
        needed: usize,
        /// Blocks available.
        available: usize,
    },
}

struct Block {
    digest: Option<EngineDigest>,
    refs: u32,
    /// Position in the LRU order when unreferenced (monotonic stamp).
    stamp: u64,
}

/// The simulated cache of one engine.
pub struct PrefixCache {
    block_size: usize,
    blocks: Vec<Block>,
    by_digest: HashMap<EngineDigest, u32>,
    /// Unreferenced blocks, least recently used first, as (stamp, block) — stale pairs skipped.
    lru: VecDeque<(u64, u32)>,
    /// Never-used blocks.
    fresh: Vec<u32>,
    next_stamp: u64,
    events: Vec<CacheEvent>,
    /// Prefix-cache queries (prompt tokens looked up) and hits, like vLLM's counters.
    pub queries_tokens: u64,
    /// Prompt tokens served from cache.
    pub hit_tokens: u64,
}

impl PrefixCache {
    /// A cache of `num_blocks` blocks of `block_size` tokens.
    pub fn new(num_blocks: usize, block_size: usize) -> Self {
        PrefixCache {
            block_size,
            blocks: (0..num_blocks)
                .map(|_| Block {
                    digest: None,
                    refs: 0,
                    stamp: 0,
                })
                .collect(),
            by_digest: HashMap::new(),
            lru: VecDeque::new(),
            fresh: (0..num_blocks as u32).rev().collect(),
            next_stamp: 1,
            events: Vec::new(),
            queries_tokens: 0,
            hit_tokens: 0,
        }
    }

    /// Block size in tokens.
    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// Total blocks.
    pub fn num_blocks(&self) -> usize {
        self.blocks.len()
    }

    /// Blocks currently holding a cached digest.
    pub fn cached_blocks(&self) -> usize {
        self.by_digest.len()
    }

    /// Blocks referenced by running requests.
    pub fn used_blocks(&self) -> usize {
        self.blocks.iter().filter(|b| b.refs > 0).count()
    }

    /// The digests of every cached block (for checking a consumer of the events).
    pub fn digests(&self) -> impl Iterator<Item = &EngineDigest> {
        self.by_digest.keys()
    }

    /// Takes the events produced since the last call.
    pub fn take_events(&mut self) -> Vec<CacheEvent> {
        std::mem::take(&mut self.events)
    }

    /// Prompt tokens a request would find cached right now (whole blocks), without touching the
    /// cache: the ground truth a router's view of this engine is checked against.
    pub fn peek_cached_tokens(&self, req: &CacheRequest<'_>) -> usize {
        let hit = self
            .digests_of(req)
            .iter()
            .take_while(|d| self.by_digest.contains_key(d))
            .count();
        hit * self.block_size
    }

    /// The digest chain of a prompt's full blocks.
    pub fn digests_of(&self, req: &CacheRequest<'_>) -> Vec<EngineDigest> {
        let mut out = Vec::new();
        let mut parent: Option<EngineDigest> = None;
        for (i, block) in req.tokens.chunks_exact(self.block_size).enumerate() {
            let d = block_digest(parent, block, &extra_keys(req, i));
            out.push(d);
            parent = Some(d);
        }
        out
    }

    /// Admits a request: reuses its longest cached prefix, allocates and caches the rest of its
    /// full blocks (emitting `Stored`, and `Removed` for evictions). Blocks stay referenced until
    /// [`PrefixCache::release`].
    pub fn admit(&mut self, req: &CacheRequest<'_>) -> Result<Admission, CacheError> {
        let digests = self.digests_of(req);
        let hit = digests
            .iter()
            .take_while(|d| self.by_digest.contains_key(d))
            .count();
        let needed = digests.len() - hit;
        let available = self.fresh.len() + self.evictable(&digests[..hit]);
        if needed > available {
            return Err(CacheError::OutOfBlocks { needed, available });
        }
        self.queries_tokens += req.tokens.len() as u64;
        self.hit_tokens += (hit * self.block_size) as u64;
        let mut held = Vec::with_capacity(digests.len());
        for d in &digests[..hit] {
            let b = self.by_digest[d];
            self.blocks[b as usize].refs += 1;
            held.push(b);
        }
        let mut removed = Vec::new();
        let mut new_hashes = Vec::new();
        for d in &digests[hit..] {
            let b = self.allocate(&mut removed);
            let block = &mut self.blocks[b as usize];
            block.refs = 1;
            block.digest = Some(*d);
            self.by_digest.insert(*d, b);
            held.push(b);
            new_hashes.push(*d);
        }
        if !removed.is_empty() {
            self.events.push(CacheEvent::Removed { hashes: removed });
        }
        if !new_hashes.is_empty() {
            let bs = self.block_size;
            self.events.push(CacheEvent::Stored {
                parent: hit.checked_sub(1).map(|p| digests[p]),
                hashes: new_hashes,
                tokens: req.tokens[hit * bs..digests.len() * bs].to_vec(),
                extra_keys: (hit..digests.len()).map(|i| extra_keys(req, i)).collect(),
                lora_name: req.lora_name.filter(|l| !l.is_empty()).map(str::to_owned),
                salt: req.salt.filter(|s| !s.is_empty()).map(str::to_owned),
            });
        }
        Ok(Admission {
            cached_tokens: hit * self.block_size,
            prompt_blocks: digests.len(),
            blocks: held,
        })
    }

    /// Releases a finished request's blocks; they become evictable, tail blocks first (vLLM
    /// frees a request's blocks in reverse so its prefix outlives its suffix).
    pub fn release(&mut self, blocks: &[u32]) {
        for &b in blocks.iter().rev() {
            let block = &mut self.blocks[b as usize];
            block.refs -= 1;
            if block.refs == 0 {
                block.stamp = self.next_stamp;
                self.next_stamp += 1;
                self.lru.push_back((block.stamp, b));
            }
        }
    }

    /// Drops every cached block (a prefix-cache reset) and emits `Cleared`.
    pub fn clear(&mut self) {
        self.by_digest.clear();
        // Referenced blocks lose their digest too: once `Cleared` is published, evicting them
        // later must not announce a removal of a hash consumers already forgot.
        for b in &mut self.blocks {
            b.digest = None;
        }
        self.lru.clear();
        self.fresh = (0..self.blocks.len() as u32)
            .filter(|&b| self.blocks[b as usize].refs == 0)
            .rev()
            .collect();
        self.events.push(CacheEvent::Cleared);
    }

    fn evictable(&self, keep: &[EngineDigest]) -> usize {
        let unreferenced = self.blocks.iter().filter(|b| b.refs == 0).count() - self.fresh.len();
        let pinned = keep
            .iter()
            .filter(|d| self.blocks[self.by_digest[*d] as usize].refs == 0)
            .count();
        unreferenced - pinned
    }

    fn allocate(&mut self, removed: &mut Vec<EngineDigest>) -> u32 {
        if let Some(b) = self.fresh.pop() {
            return b;
        }
        while let Some((stamp, b)) = self.lru.pop_front() {
            let block = &mut self.blocks[b as usize];
            if block.refs != 0 || block.stamp != stamp {
                continue; // re-referenced since it was queued
            }
            if let Some(d) = block.digest.take() {
                self.by_digest.remove(&d);
                removed.push(d);
            }
            return b;
        }
        unreachable!("admit checked that enough blocks are free or evictable")
    }
}

fn extra_keys(req: &CacheRequest<'_>, block_index: usize) -> Vec<ExtraKey> {
    let mut keys = Vec::new();
    if let Some(lora) = req.lora_name.filter(|l| !l.is_empty()) {
        keys.push(ExtraKey::Str(lora.to_owned()));
    }
    if block_index == 0
        && let Some(salt) = req.salt.filter(|s| !s.is_empty())
    {
        keys.push(ExtraKey::Str(salt.to_owned()));
    }
    keys
}

fn block_digest(parent: Option<EngineDigest>, tokens: &[u32], extra: &[ExtraKey]) -> EngineDigest {
    let mut h = Sha256::new();
    h.update(parent.map(|p| p.0).unwrap_or([0u8; 32]));
    for t in tokens {
        h.update(t.to_le_bytes());
    }
    for k in extra {
        match k {
            ExtraKey::Str(s) => {
                h.update([1u8]);
                h.update((s.len() as u32).to_le_bytes());
                h.update(s.as_bytes());
            }
        }
    }
    EngineDigest(h.finalize().into())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req<'a>(tokens: &'a [u32], salt: Option<&'a str>) -> CacheRequest<'a> {
        CacheRequest {
            tokens,
            salt,
            lora_name: None,
        }
    }

    #[test]
    fn reuses_prefixes_and_isolates_salts() {
        let mut c = PrefixCache::new(16, 4);
        let t: Vec<u32> = (0..10).collect();
        let a = c.admit(&req(&t, None)).unwrap();
        assert_eq!((a.cached_tokens, a.prompt_blocks), (0, 2));
        c.release(&a.blocks);
        let b = c.admit(&req(&t, None)).unwrap();
        assert_eq!(b.cached_tokens, 8);
        c.release(&b.blocks);
        let s = c.admit(&req(&t, Some("tenant"))).unwrap();
        assert_eq!(
            s.cached_tokens, 0,
            "a salted request shares nothing with unsalted"
        );
        c.release(&s.blocks);
        let events = c.take_events();
        assert_eq!(
            events.len(),
            2,
            "two Stored events, no evictions: {events:?}"
        );
        match &events[1] {
            CacheEvent::Stored {
                extra_keys, parent, ..
            } => {
                assert_eq!(parent, &None);
                assert_eq!(extra_keys[0], vec![ExtraKey::Str("tenant".into())]);
                assert!(extra_keys[1].is_empty(), "salt only on the first block");
            }
            e => panic!("unexpected {e:?}"),
        }
    }

    #[test]
    fn evicts_lru_unreferenced_blocks_and_reports_them() {
        let mut c = PrefixCache::new(4, 2);
        let a: Vec<u32> = vec![1, 1, 2, 2, 3, 3];
        let b: Vec<u32> = vec![9, 9, 8, 8];
        let ra = c.admit(&req(&a, None)).unwrap();
        c.release(&ra.blocks);
        let rb = c.admit(&req(&b, None)).unwrap();
        // 3 + 2 blocks > 4: one of a's blocks (its tail, freed first) was evicted.
        let events = c.take_events();
        let removed: Vec<_> = events
            .iter()
            .filter_map(|e| match e {
                CacheEvent::Removed { hashes } => Some(hashes.clone()),
                _ => None,
            })
            .collect();
        assert_eq!(removed, vec![vec![c.digests_of(&req(&a, None))[2]]]);
        assert_eq!(c.cached_blocks(), 4);
        // Referenced blocks are never evicted.
        let err = c.admit(&req(&[5, 5, 6, 6, 7, 7], None)).unwrap_err();
        assert!(matches!(err, CacheError::OutOfBlocks { .. }));
        c.release(&rb.blocks);
        assert_eq!(c.used_blocks(), 0);
    }
}
