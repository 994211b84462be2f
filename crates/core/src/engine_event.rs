//! Engine KV events in kv-epp's own, engine-neutral form, and the one function that writes them
//! into a [`KvIndex`].
//!
//! Every decoder (vLLM's msgpack, TensorRT-LLM's JSON drain, the peer relay's protobuf, the
//! simulator's fleet) turns what it reads into an [`EngineEvent`] — with the namespace rule of
//! [`crate::namespace`] already run on sequence starts — and hands it to [`apply`]. Keeping a
//! single writer is what makes the block-size check, the fail-closed handling of untrusted
//! namespaces and the counters the same for every engine and every replica.

use std::sync::atomic::{AtomicU64, Ordering};

use crate::hashing::HashSeed;
use crate::index::{EngineBlockHash, IndexError, KvIndex, Medium, StoreBlocks};
use crate::worker::WorkerId;

/// One engine event, engine-neutral.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum EngineEvent {
    /// New blocks.
    Stored(StoredRun),
    /// Blocks that left some tiers.
    Removed {
        /// The engine's hashes.
        engine_hashes: Vec<EngineBlockHash>,
        /// Tier bits left: [`TIER_DEVICE`], [`TIER_OFFLOAD`], or both.
        tiers: u8,
    },
    /// Everything the worker held is gone.
    Cleared,
}

/// A run of new blocks in one event: the owned form of [`StoreBlocks`], plus the block size the
/// engine announced. A named type (not variant fields) so that the writer, the relay's wire form
/// and its splitter read the fields without each spelling out the whole variant.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StoredRun {
    /// The block before the first new one, if the event continues a sequence.
    pub parent: Option<EngineBlockHash>,
    /// The namespace seed of a sequence start, decoded by the namespace rule; `None` =
    /// untrusted (never credited). Ignored for continuations, which inherit their parent's.
    pub root_seed: Option<HashSeed>,
    /// The engine's hashes of the new blocks.
    pub engine_hashes: Vec<EngineBlockHash>,
    /// Their tokens, `engine_hashes.len() * block_size` of them.
    pub tokens: Vec<u32>,
    /// Where they were stored.
    pub medium: Medium,
    /// Tokens per block, when the engine said (vLLM does); checked against the model's. When it
    /// did not (an offload connector, TensorRT-LLM's drain), the run takes the model's block
    /// size only if its token count proves it.
    pub block_size: Option<usize>,
    /// The session that triggered the store, when the engine said (vLLM, SGLang). Kept with the
    /// sequence by the index ([`KvIndex::session_tail`]); session affinity builds on it.
    pub session_id: Option<String>,
}

impl StoredRun {
    /// The run as the index's store takes it (borrowed; nothing is copied).
    pub fn as_store(&self) -> StoreBlocks<'_> {
        StoreBlocks {
            parent: self.parent,
            root_seed: self.root_seed,
            engine_hashes: &self.engine_hashes,
            tokens: &self.tokens,
            medium: self.medium,
        }
    }
}

/// Tier bit of device memory in [`EngineEvent::Removed`].
pub const TIER_DEVICE: u8 = 0b01;
/// Tier bit of the offload tiers in [`EngineEvent::Removed`].
pub const TIER_OFFLOAD: u8 = 0b10;

/// The tier bit of a medium, for [`EngineEvent::Removed`].
pub fn tier_bit(medium: Medium) -> u8 {
    match medium {
        Medium::Device => TIER_DEVICE,
        Medium::Offload => TIER_OFFLOAD,
    }
}

/// Counters of what happened to engine events, shared by a replica's decoders and the writer.
/// Decoders count what never becomes an [`EngineEvent`] (malformed, other groups, unknown types);
/// [`apply`] counts the rest.
#[derive(Debug, Default)]
pub struct EventCounters {
    /// Events applied to the index.
    pub applied: AtomicU64,
    /// Events that could not be decoded (malformed fields) or written (an index error).
    pub malformed: AtomicU64,
    /// Events whose block size differs from the model's (dropped).
    pub block_size_mismatch: AtomicU64,
    /// vLLM events of KV-cache groups other than 0 (not indexed).
    pub skipped_groups: AtomicU64,
    /// Sequence starts whose namespace could not be trusted (stored, never credited).
    pub foreign_namespace: AtomicU64,
    /// Events of unknown types (ignored).
    pub unknown_types: AtomicU64,
}

/// Why [`apply`] did not write an event.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ApplyError {
    /// The event's block size differs from the model's: its hashes would never match a query.
    #[error("event block size {event} differs from the model's {model}")]
    BlockSize {
        /// The engine's block size.
        event: usize,
        /// The model's.
        model: usize,
    },
    /// The index refused the write.
    #[error(transparent)]
    Index(#[from] IndexError),
}

/// Applies one event of `worker` to `index`: the only writer of engine events into an index.
/// Counts `applied`, `block_size_mismatch` and `foreign_namespace` (an untrusted sequence start
/// is still stored, under the unknown namespace, so its continuations and removals resolve, and
/// a later re-announcement with a trusted namespace repairs it; see [`crate::index`]).
pub fn apply(
    index: &KvIndex,
    worker: &WorkerId,
    event: &EngineEvent,
    counters: &EventCounters,
) -> Result<(), ApplyError> {
    match event {
        EngineEvent::Stored(run) => {
            if let Some(bs) = run.block_size
                && bs != index.block_size()
            {
                counters.block_size_mismatch.fetch_add(1, Ordering::Relaxed);
                return Err(ApplyError::BlockSize {
                    event: bs,
                    model: index.block_size(),
                });
            }
            let blocks = run.engine_hashes.len();
            if run.block_size.is_none() && run.tokens.len() != blocks * index.block_size() {
                // Nothing proves these blocks have the model's size: their hashes could never
                // match a query.
                counters.block_size_mismatch.fetch_add(1, Ordering::Relaxed);
                return Err(ApplyError::BlockSize {
                    event: run.tokens.len().checked_div(blocks).unwrap_or(0),
                    model: index.block_size(),
                });
            }
            if run.parent.is_none() && run.root_seed.is_none() {
                counters.foreign_namespace.fetch_add(1, Ordering::Relaxed);
            }
            index.store(worker, &run.as_store())?;
            if let (Some(session), Some(last)) = (&run.session_id, run.engine_hashes.last()) {
                index.note_session(worker, session, *last);
            }
        }
        EngineEvent::Removed {
            engine_hashes,
            tiers,
        } => {
            for medium in [Medium::Device, Medium::Offload] {
                if tiers & tier_bit(medium) != 0 {
                    index.remove(worker, engine_hashes, medium)?;
                }
            }
        }
        EngineEvent::Cleared => {
            index.clear_worker(worker)?;
        }
    }
    counters.applied.fetch_add(1, Ordering::Relaxed);
    Ok(())
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;
    use crate::hashing::prompt_hashes;
    use crate::index::IndexLimits;
    use crate::namespace::{ExtraKey, Namespace, root_seed, seed_for};
    use crate::salt::{CacheSalt, SaltSource};

    const BS: usize = 2;

    fn setup() -> (KvIndex, WorkerId) {
        let idx = KvIndex::new(BS, IndexLimits::default());
        let w = WorkerId::new("10.0.0.1:8000".parse().unwrap());
        idx.add_worker(w);
        (idx, w)
    }

    fn salt(s: &str) -> CacheSalt {
        CacheSalt::new(s, SaltSource::Header).unwrap().unwrap()
    }

    fn stored(parent: Option<u64>, seed: Option<HashSeed>, hashes: &[u64]) -> EngineEvent {
        EngineEvent::Stored(StoredRun {
            parent: parent.map(EngineBlockHash),
            root_seed: seed,
            engine_hashes: hashes.iter().copied().map(EngineBlockHash).collect(),
            tokens: hashes.iter().flat_map(|&h| [h as u32; BS]).collect(),
            medium: Medium::Device,
            block_size: Some(BS),
            session_id: None,
        })
    }

    fn credit(idx: &KvIndex, tokens: &[u32], seed: HashSeed) -> u32 {
        idx.best_total_blocks(&prompt_hashes(tokens, BS, seed).1)
    }

    #[test]
    fn stores_removes_clears_and_counts() {
        let (idx, w) = setup();
        let c = EventCounters::default();
        let seed = seed_for(Some(&salt("t")), None);
        apply(&idx, &w, &stored(None, Some(seed), &[1, 2]), &c).unwrap();
        assert_eq!(credit(&idx, &[1, 1, 2, 2], seed), 2);
        assert_eq!(credit(&idx, &[1, 1, 2, 2], HashSeed::UNSALTED), 0);
        let rm = EngineEvent::Removed {
            engine_hashes: vec![EngineBlockHash(2)],
            tiers: TIER_DEVICE | TIER_OFFLOAD,
        };
        apply(&idx, &w, &rm, &c).unwrap();
        assert_eq!(credit(&idx, &[1, 1, 2, 2], seed), 1);
        apply(&idx, &w, &EngineEvent::Cleared, &c).unwrap();
        assert_eq!(credit(&idx, &[1, 1, 2, 2], seed), 0);
        assert_eq!(c.applied.load(Ordering::Relaxed), 3);
        assert_eq!(c.foreign_namespace.load(Ordering::Relaxed), 0);
    }

    #[test]
    fn removal_leaves_only_the_named_tiers() {
        let (idx, w) = setup();
        let c = EventCounters::default();
        let seed = HashSeed::UNSALTED;
        apply(&idx, &w, &stored(None, Some(seed), &[1]), &c).unwrap();
        let mut offload = stored(None, Some(seed), &[1]);
        if let EngineEvent::Stored(run) = &mut offload {
            run.medium = Medium::Offload;
        }
        apply(&idx, &w, &offload, &c).unwrap();
        let rm = |tiers| EngineEvent::Removed {
            engine_hashes: vec![EngineBlockHash(1)],
            tiers,
        };
        apply(&idx, &w, &rm(TIER_DEVICE), &c).unwrap();
        let seqs = prompt_hashes(&[1, 1], BS, seed).1;
        let o = idx.query(&seqs);
        assert_eq!((o[0].device_blocks, o[0].total_blocks), (0, 1));
        apply(&idx, &w, &rm(TIER_OFFLOAD), &c).unwrap();
        assert_eq!(credit(&idx, &[1, 1], seed), 0);
    }

    #[test]
    fn wrong_block_size_is_dropped_and_counted() {
        let (idx, w) = setup();
        let c = EventCounters::default();
        let mut ev = stored(None, Some(HashSeed::UNSALTED), &[1]);
        if let EngineEvent::Stored(run) = &mut ev {
            run.block_size = Some(BS + 1);
        }
        assert_eq!(
            apply(&idx, &w, &ev, &c),
            Err(ApplyError::BlockSize {
                event: BS + 1,
                model: BS
            })
        );
        assert_eq!(c.block_size_mismatch.load(Ordering::Relaxed), 1);
        assert_eq!(c.applied.load(Ordering::Relaxed), 0);
        assert_eq!(idx.worker_blocks(&w).unwrap(), 0);
        // An engine that does not say its block size is trusted to use the model's.
        if let EngineEvent::Stored(run) = &mut ev {
            run.block_size = None;
        }
        apply(&idx, &w, &ev, &c).unwrap();
        assert_eq!(idx.worker_blocks(&w).unwrap(), 1);
    }

    #[test]
    fn a_run_without_block_size_needs_its_tokens_to_prove_the_models() {
        let (idx, w) = setup();
        let c = EventCounters::default();
        let mut ev = stored(None, Some(HashSeed::UNSALTED), &[1, 2]);
        if let EngineEvent::Stored(run) = &mut ev {
            run.block_size = None;
            run.medium = Medium::Offload;
            run.tokens.push(9); // 5 tokens for 2 blocks of 2: not the model's size
        }
        assert!(matches!(
            apply(&idx, &w, &ev, &c),
            Err(ApplyError::BlockSize { .. })
        ));
        assert_eq!(c.block_size_mismatch.load(Ordering::Relaxed), 1);
        if let EngineEvent::Stored(run) = &mut ev {
            run.tokens.pop();
        }
        apply(&idx, &w, &ev, &c).unwrap();
        let o = idx.query(&prompt_hashes(&[1, 1, 2, 2], BS, HashSeed::UNSALTED).1);
        assert_eq!(
            (o[0].device_blocks, o[0].total_blocks),
            (0, 2),
            "offload tier"
        );
    }

    #[test]
    fn a_session_is_kept_with_its_newest_block_while_the_worker_holds_it() {
        let (idx, w) = setup();
        let c = EventCounters::default();
        let with_session = |parent, hashes: &[u64]| {
            let mut ev = stored(parent, Some(HashSeed::UNSALTED), hashes);
            if let EngineEvent::Stored(run) = &mut ev {
                run.session_id = Some("s1".into());
            }
            ev
        };
        apply(&idx, &w, &with_session(None, &[1]), &c).unwrap();
        apply(&idx, &w, &with_session(Some(1), &[2, 3]), &c).unwrap();
        assert_eq!(idx.session_tail(&w, "s1"), Some(EngineBlockHash(3)));
        assert_eq!(idx.session_tail(&w, "s2"), None);
        let rm = EngineEvent::Removed {
            engine_hashes: vec![EngineBlockHash(3)],
            tiers: TIER_DEVICE,
        };
        apply(&idx, &w, &rm, &c).unwrap();
        assert_eq!(
            idx.session_tail(&w, "s1"),
            None,
            "the worker no longer holds it"
        );
        apply(&idx, &w, &with_session(Some(2), &[3]), &c).unwrap();
        apply(&idx, &w, &EngineEvent::Cleared, &c).unwrap();
        assert_eq!(idx.session_tail(&w, "s1"), None);
    }

    #[test]
    fn untrusted_start_is_counted_and_its_continuation_inherits_it() {
        let (idx, w) = setup();
        let c = EventCounters::default();
        let raw = root_seed(None, &[ExtraKey::Str("raw-salt".into())]);
        assert_eq!(raw, None);
        apply(&idx, &w, &stored(None, raw, &[1]), &c).unwrap();
        apply(&idx, &w, &stored(Some(1), None, &[2]), &c).unwrap();
        assert_eq!(
            c.foreign_namespace.load(Ordering::Relaxed),
            1,
            "starts only"
        );
        assert_eq!(idx.worker_blocks(&w).unwrap(), 2);
        let raw_salt = salt("raw-salt");
        for seed in [HashSeed::UNSALTED, seed_for(Some(&raw_salt), None)] {
            assert_eq!(credit(&idx, &[1, 1, 2, 2], seed), 0);
        }
    }

    #[test]
    fn a_reannouncement_with_a_forwarded_salt_repairs_orphans() {
        let (idx, w) = setup();
        let c = EventCounters::default();
        let a = salt("tenant-a");
        let fwd = |s: &CacheSalt| ExtraKey::Str(Namespace::of(s).forwarded());
        // Block 2 arrives before its parent (a lost batch); block 1 with a salt kv-epp did not
        // forward: both orphans, never credited.
        apply(&idx, &w, &stored(Some(1), None, &[2]), &c).unwrap();
        let raw = root_seed(None, &[ExtraKey::Str("tenant-a".into())]);
        apply(&idx, &w, &stored(None, raw, &[1]), &c).unwrap();
        let seed_a = seed_for(Some(&a), None);
        assert_eq!(credit(&idx, &[1, 1, 2, 2], seed_a), 0);
        // vLLM re-announces the chain from block 0 with the forwarded salt.
        let reannounced = root_seed(None, &[fwd(&a)]);
        apply(&idx, &w, &stored(None, reannounced, &[1, 2]), &c).unwrap();
        assert_eq!(credit(&idx, &[1, 1, 2, 2], seed_a), 2);
        // Another tenant's re-announcement of the same engine blocks takes nothing from A.
        let b = salt("tenant-b");
        apply(
            &idx,
            &w,
            &stored(None, root_seed(None, &[fwd(&b)]), &[1, 2]),
            &c,
        )
        .unwrap();
        assert_eq!(credit(&idx, &[1, 1, 2, 2], seed_a), 2);
        assert_eq!(credit(&idx, &[1, 1, 2, 2], seed_for(Some(&b), None)), 0);
    }

    #[test]
    fn unregistered_worker_is_an_index_error() {
        let (idx, _) = setup();
        let other = WorkerId::new("10.0.0.2:8000".parse().unwrap());
        let c = EventCounters::default();
        let r = apply(&idx, &other, &EngineEvent::Cleared, &c);
        assert!(matches!(
            r,
            Err(ApplyError::Index(IndexError::UnknownWorker(_)))
        ));
        assert_eq!(c.applied.load(Ordering::Relaxed), 0);
    }

    proptest! {
        #![proptest_config(ProptestConfig {
            cases: 200,
            rng_seed: proptest::test_runner::RngSeed::Fixed(0x6576_656e),
            failure_persistence: None,
            ..ProptestConfig::default()
        })]
        /// A stored sequence whose root is untrusted (and its continuations) never produces credit
        /// for any query, salted or unsalted, with or without an adapter, whatever its tokens.
        #[test]
        fn untrusted_roots_are_never_credited(
            blocks in prop::collection::vec(0u32..4, 1..6),
            split in 0usize..6,
            salts in prop::collection::vec("[a-z%/]{0,6}", 1..4),
            lora in prop::option::of("[a-b]{1,2}"),
        ) {
            let (idx, w) = setup();
            let c = EventCounters::default();
            let tokens: Vec<u32> = blocks.iter().flat_map(|&b| [b; BS]).collect();
            let hashes: Vec<u64> = (1..=blocks.len() as u64).collect();
            let split = split.min(blocks.len());
            let ev = |parent: Option<u64>, range: std::ops::Range<usize>| EngineEvent::Stored(StoredRun {
                parent: parent.map(EngineBlockHash),
                root_seed: None,
                engine_hashes: hashes[range.clone()].iter().copied().map(EngineBlockHash).collect(),
                tokens: tokens[range.start * BS..range.end * BS].to_vec(),
                medium: Medium::Device,
                block_size: Some(BS),
                session_id: None,
            });
            apply(&idx, &w, &ev(None, 0..split.max(1)), &c).unwrap();
            if split >= 1 && split < blocks.len() {
                apply(&idx, &w, &ev(Some(hashes[split - 1]), split..blocks.len()), &c).unwrap();
            }
            let mut seeds = vec![seed_for(None, None), seed_for(None, lora.as_deref())];
            for s in &salts {
                if let Ok(Some(s)) = CacheSalt::new(s, SaltSource::Body) {
                    seeds.push(seed_for(Some(&s), None));
                    seeds.push(seed_for(Some(&s), lora.as_deref()));
                    // Even the raw salt and its forwarded form as namespaces.
                    seeds.push(HashSeed::new(lora.as_deref(), Some(s.expose())));
                    seeds.push(HashSeed::new(None, Some(&Namespace::of(&s).forwarded())));
                }
            }
            for seed in seeds {
                prop_assert_eq!(credit(&idx, &tokens, seed), 0);
            }
        }
    }
}
