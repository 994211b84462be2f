//! Engine events in kv-epp's own, engine-neutral form: what a decoder makes of an engine's
//! message once the namespace rule has run. Replicas relay single-reader sources (TensorRT-LLM's
//! destructive drain) in this form, so every replica applies exactly what the owner decoded.

use crate::hashing::HashSeed;
use crate::index::{EngineBlockHash, IndexError, KvIndex, Medium, StoreBlocks};
use crate::worker::WorkerId;

/// One decoded event.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum NormEvent {
    /// New blocks (see [`StoreBlocks`]).
    Stored {
        /// The block before the first new one, if the event continues a sequence.
        parent: Option<EngineBlockHash>,
        /// The namespace of a sequence start; `None` = untrusted (never credited).
        root_seed: Option<HashSeed>,
        /// The engine's hashes of the new blocks.
        engine_hashes: Vec<EngineBlockHash>,
        /// Their tokens.
        tokens: Vec<u32>,
        /// Where they were stored.
        medium: Medium,
    },
    /// Blocks that left some tiers.
    Removed {
        /// The engine's hashes.
        engine_hashes: Vec<EngineBlockHash>,
        /// Tier bits left: 1 device, 2 offload.
        tiers: u8,
    },
    /// Everything the worker held is gone.
    Cleared,
}

impl NormEvent {
    /// Applies the event to `worker`'s state in `index`.
    pub fn apply(&self, index: &KvIndex, worker: &WorkerId) -> Result<(), IndexError> {
        match self {
            NormEvent::Stored {
                parent,
                root_seed,
                engine_hashes,
                tokens,
                medium,
            } => {
                index.store(
                    worker,
                    &StoreBlocks {
                        parent: *parent,
                        root_seed: *root_seed,
                        engine_hashes,
                        tokens,
                        medium: *medium,
                    },
                )?;
            }
            NormEvent::Removed {
                engine_hashes,
                tiers,
            } => {
                for (bit, medium) in [(0b01, Medium::Device), (0b10, Medium::Offload)] {
                    if tiers & bit != 0 {
                        index.remove(worker, engine_hashes, medium)?;
                    }
                }
            }
            NormEvent::Cleared => {
                index.clear_worker(worker)?;
            }
        }
        Ok(())
    }
}
