//! Applying decoded engine events to a model's index: the namespace rule lives here.
//!
//! Namespace of a sequence start (an event without a parent), from its first block's extra keys:
//! - skip one leading string equal to the event's `lora_name` (vLLM puts the adapter first);
//! - a string carrying kv-epp's tag is the forwarded salt: decode it (`engine_salt::decode`);
//! - no other string: unsalted;
//! - any other string (a salt kv-epp did not forward, or an older engine's untagged key): the
//!   namespace is *unknown* and the blocks are never credited to anyone (fail closed), counted.
//!
//! A continuation (an event with a parent) inherits its parent's namespace inside the index.
//! Only KV-cache group 0 (full attention) is indexed; other groups are skipped and counted.

use std::sync::atomic::{AtomicU64, Ordering};

use super::vllm::{Event, ExtraKey, Stored};
use crate::engine_salt;
use crate::hashing::HashSeed;
use crate::index::{IndexError, KvIndex, Medium, StoreBlocks};
use crate::worker::WorkerId;

/// Counters of what happened to decoded events.
#[derive(Debug, Default)]
pub struct ApplyCounters {
    /// Events applied.
    pub applied: AtomicU64,
    /// Events that could not be decoded (malformed fields).
    pub malformed: AtomicU64,
    /// Events whose block size differs from the model's.
    pub block_size_mismatch: AtomicU64,
    /// Events of groups other than 0.
    pub skipped_groups: AtomicU64,
    /// Sequence starts whose namespace could not be trusted.
    pub foreign_namespace: AtomicU64,
    /// Events of unknown types.
    pub unknown_types: AtomicU64,
}

/// The namespace seed a sequence start's extra keys give (`None`: untrusted, never credited).
pub fn root_seed(lora_name: Option<&str>, first_keys: &[ExtraKey]) -> Option<HashSeed> {
    let mut keys = first_keys.iter().peekable();
    if let (Some(lora), Some(ExtraKey::Str(first))) = (lora_name, keys.peek())
        && first == lora
    {
        keys.next();
    }
    let mut namespace = None;
    for k in keys {
        if let ExtraKey::Str(s) = k {
            match engine_salt::decode(s) {
                Some(ns) if namespace.is_none() => namespace = Some(ns),
                _ => return None,
            }
        }
    }
    Some(HashSeed::new(lora_name, namespace.as_deref()))
}

/// Applies one decoded event of `worker` to `index`.
pub fn apply(
    index: &KvIndex,
    worker: &WorkerId,
    event: &Event,
    counters: &ApplyCounters,
) -> Result<(), IndexError> {
    match event {
        Event::Stored(st) => store(index, worker, st, counters)?,
        Event::Removed {
            block_hashes,
            medium,
            group_idx,
        } => {
            if *group_idx != 0 {
                counters.skipped_groups.fetch_add(1, Ordering::Relaxed);
                return Ok(());
            }
            index.remove(worker, block_hashes, Medium::from_engine(medium.as_deref()))?;
        }
        Event::AllCleared => {
            index.clear_worker(worker)?;
        }
        Event::Unknown => {
            counters.unknown_types.fetch_add(1, Ordering::Relaxed);
            return Ok(());
        }
    }
    counters.applied.fetch_add(1, Ordering::Relaxed);
    Ok(())
}

fn store(
    index: &KvIndex,
    worker: &WorkerId,
    st: &Stored,
    counters: &ApplyCounters,
) -> Result<(), IndexError> {
    if st.group_idx != 0 {
        counters.skipped_groups.fetch_add(1, Ordering::Relaxed);
        return Ok(());
    }
    if st.block_size != index.block_size() {
        counters.block_size_mismatch.fetch_add(1, Ordering::Relaxed);
        tracing::warn!(
            %worker,
            event_block_size = st.block_size,
            model_block_size = index.block_size(),
            "dropping KV event with a different block size"
        );
        return Ok(());
    }
    let root_seed = if st.parent.is_none() {
        let seed = root_seed(st.lora_name.as_deref(), &st.first_extra_keys);
        if seed.is_none() {
            counters.foreign_namespace.fetch_add(1, Ordering::Relaxed);
        }
        seed
    } else {
        None // inherited from the parent inside the index
    };
    index.store(
        worker,
        &StoreBlocks {
            parent: st.parent,
            root_seed,
            engine_hashes: &st.block_hashes,
            tokens: &st.token_ids,
            medium: Medium::from_engine(st.medium.as_deref()),
        },
    )?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::salt::{CacheSalt, SaltSource, seed_for};

    fn k(s: &str) -> ExtraKey {
        ExtraKey::Str(s.into())
    }

    #[test]
    fn namespace_rule() {
        let salt = |s: &str| CacheSalt::new(s, SaltSource::Header).unwrap().unwrap();
        let fwd = |s: &str| engine_salt::forwarded(&salt(s));
        // Unsalted, with and without an adapter.
        assert_eq!(root_seed(None, &[]), Some(HashSeed::UNSALTED));
        assert_eq!(
            root_seed(Some("ad"), &[k("ad")]),
            Some(HashSeed::new(Some("ad"), None))
        );
        // Salts, including one equal to the adapter's name and one containing the tag.
        for s in ["tenant-a", "ad", "kvepp:x", "a/b@c"] {
            assert_eq!(
                root_seed(None, &[k(&fwd(s))]),
                Some(seed_for(Some(&salt(s)), None)),
                "{s}"
            );
            assert_eq!(
                root_seed(Some("ad"), &[k("ad"), ExtraKey::Other, k(&fwd(s))]),
                Some(seed_for(Some(&salt(s)), Some("ad"))),
                "{s}"
            );
        }
        // Untrusted: a raw salt, two salts, an unexpected string.
        assert_eq!(root_seed(None, &[k("tenant-a")]), None);
        assert_eq!(root_seed(None, &[k(&fwd("a")), k(&fwd("b"))]), None);
        assert_eq!(root_seed(Some("ad"), &[k("other")]), None);
    }
}
