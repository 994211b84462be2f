//! What the pipeline decides with: the served models, the live workers and the policy, each
//! owned by its own module and shared here by reference.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use serde::{Deserialize, Serialize};

use crate::models::ServedModels;
use crate::workers::Workers;
use kv_epp_core::fingerprint::FingerprintKey;
use kv_epp_core::salt::SaltPolicy;
use kv_epp_core::scoring::ScoringConfig;

/// What to do with a request for a model that is not configured.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum UnknownModel {
    /// Route on load alone among every ready worker.
    #[default]
    LoadOnly,
    /// Answer 404 with a JSON error.
    Reject,
}

/// What to do with a request kv-epp cannot render exactly as the engine would
/// (`kv_epp_tokenize::TokenizeError::unrenderable`): a template error, an option or input kv-epp
/// does not reproduce. Malformed requests are refused either way.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum UnrenderableRequests {
    /// Route on load alone (no prefix credit), count it by reason and let the engine decide.
    #[default]
    LoadOnly,
    /// Answer 400 with the reason, as for a malformed request.
    Reject,
}

/// How decisions are made, as the operator configured it.
#[derive(Clone)]
pub struct Policy {
    /// Cost weights, temperature and fallback count.
    pub scoring: ScoringConfig,
    /// Requests in flight per worker before it counts as saturated (`None`: unlimited).
    pub max_inflight: Option<u32>,
    /// What to do with a model that is not served.
    pub unknown_model: UnknownModel,
    /// What to do with a request kv-epp cannot render exactly.
    pub unrenderable: UnrenderableRequests,
    /// Which salt sources are trusted, and whether a salt is required.
    pub salt: SaltPolicy,
    /// The key salts are fingerprinted under (the same on every replica makes logs comparable).
    pub fingerprints: FingerprintKey,
    /// Whether the workers' events carry the salt of salted stores (`events.salted_events`):
    /// when not, a salted request is routed without isolation and counted.
    pub salted_events: bool,
}

impl std::fmt::Debug for Policy {
    // The fingerprint key is a secret: never shown.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Policy")
            .field("scoring", &self.scoring)
            .field("max_inflight", &self.max_inflight)
            .field("unknown_model", &self.unknown_model)
            .field("unrenderable", &self.unrenderable)
            .field("salt", &self.salt)
            .field("salted_events", &self.salted_events)
            .finish_non_exhaustive()
    }
}

/// The pipeline's inputs that outlive a request.
pub struct Picker {
    /// The served models.
    pub models: Arc<ServedModels>,
    /// The live workers.
    pub workers: Arc<Workers>,
    /// The policy.
    pub policy: Policy,
    decisions: AtomicU64,
}

impl Picker {
    /// A picker over `models` and `workers` under `policy`.
    pub fn new(models: Arc<ServedModels>, workers: Arc<Workers>, policy: Policy) -> Picker {
        Picker {
            models,
            workers,
            policy,
            decisions: AtomicU64::new(0),
        }
    }

    /// The number of this decision: spreads prompt-less requests and seeds sampling. A decision
    /// that books advances the count; an explanation reads the number the next one would get,
    /// so explaining changes nothing.
    pub(super) fn decision_number(&self, advance: bool) -> u64 {
        if advance {
            self.decisions.fetch_add(1, Ordering::Relaxed)
        } else {
            self.decisions.load(Ordering::Relaxed)
        }
    }
}
