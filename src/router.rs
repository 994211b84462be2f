//! What routing decisions are made from: the served models (index, block size, LoRA adapters,
//! tokenizers, prompt limits), the live workers (readiness, in-flight count, engine load) and the
//! policies (scoring, in-flight limit, unknown models, salts). The decision itself is made in
//! [`crate::decide`]; this module holds the state it reads and the bookings it takes.
//!
//! Load accounting cannot leak: a decision carries a [`Booking`] that holds one in-flight slot on
//! the chosen worker and gives it back when dropped, exactly once, whatever ends the request.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};

use parking_lot::RwLock;

use crate::config::{Config, UnknownModel};
use crate::fingerprint::FingerprintKey;
use crate::index::KvIndex;
use crate::metrics::Metrics;
use crate::salt::SaltPolicy;
use crate::scoring::{EngineLoad, ScoringConfig};
use crate::tokenize::{Endpoint, ModelCatalog, TokenizeError};
use crate::worker::WorkerId;

/// Live state of one worker as the router sees it.
pub struct WorkerRuntime {
    /// The worker.
    pub id: WorkerId,
    /// The model it serves.
    pub model: String,
    inflight: AtomicU32,
    ready: AtomicBool,
    engine: RwLock<Option<EngineLoad>>,
}

impl WorkerRuntime {
    /// Requests kv-epp has in flight on this worker.
    pub fn inflight(&self) -> u32 {
        self.inflight.load(Ordering::Relaxed)
    }
    /// Whether the worker may receive traffic.
    pub fn is_ready(&self) -> bool {
        self.ready.load(Ordering::Relaxed)
    }
    /// Marks the worker ready or not.
    pub fn set_ready(&self, ready: bool) {
        self.ready.store(ready, Ordering::Relaxed);
    }
    /// The engine-reported load in use (`None` when stale or unknown).
    pub fn engine_load(&self) -> Option<EngineLoad> {
        *self.engine.read()
    }
    /// Records fresh engine-reported load (`None` when stale or unknown).
    pub fn set_engine_load(&self, load: Option<EngineLoad>) {
        *self.engine.write() = load;
    }
}

/// One in-flight slot on a worker, released on drop.
pub struct Booking {
    worker: Arc<WorkerRuntime>,
    metrics: Arc<Metrics>,
}

impl Booking {
    fn new(worker: Arc<WorkerRuntime>, metrics: Arc<Metrics>) -> Booking {
        let n = worker.inflight.fetch_add(1, Ordering::Relaxed) + 1;
        metrics
            .inflight
            .get_or_create(&Metrics::labels(&[("worker", &worker.id.to_string())]))
            .set(i64::from(n));
        Booking { worker, metrics }
    }

    /// The booked worker.
    pub fn worker(&self) -> &WorkerId {
        &self.worker.id
    }
}

impl Drop for Booking {
    fn drop(&mut self) {
        let n = self.worker.inflight.fetch_sub(1, Ordering::Relaxed) - 1;
        self.metrics
            .inflight
            .get_or_create(&Metrics::labels(&[("worker", &self.worker.id.to_string())]))
            .set(i64::from(n));
    }
}

impl std::fmt::Debug for Booking {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Booking({})", self.worker.id)
    }
}

/// Served models: each has an index and a block size; LoRA adapters map to their base model.
struct ModelState {
    block_size: usize,
    index: Arc<KvIndex>,
}

/// The router.
pub struct Router {
    models: HashMap<String, ModelState>,
    /// LoRA adapter name → base model name.
    adapters: HashMap<String, String>,
    workers: RwLock<Vec<Arc<WorkerRuntime>>>,
    scoring: ScoringConfig,
    max_inflight: Option<u32>,
    unknown_model: UnknownModel,
    salt_policy: SaltPolicy,
    fingerprints: FingerprintKey,
    metrics: Arc<Metrics>,
    decisions: AtomicU64,
    tokenizers: ModelCatalog,
    max_prompt_tokens: HashMap<String, usize>,
}

impl Router {
    /// Builds the router from a validated configuration, without tokenizers (token-ID prompts
    /// are still routed by prefix).
    pub fn new(config: &Config, metrics: Arc<Metrics>) -> Router {
        Self::with_tokenizers(config, metrics, ModelCatalog::new())
    }

    /// Builds the router with the models' tokenizers (see `Config::load_tokenizers`).
    pub fn with_tokenizers(
        config: &Config,
        metrics: Arc<Metrics>,
        tokenizers: ModelCatalog,
    ) -> Router {
        let mut models = HashMap::new();
        let mut adapters = HashMap::new();
        for m in &config.models {
            models.insert(
                m.name.clone(),
                ModelState {
                    block_size: m.block_size,
                    index: Arc::new(KvIndex::new(m.block_size, config.index.limits())),
                },
            );
            for a in &m.lora_adapters {
                adapters.insert(a.clone(), m.name.clone());
            }
        }
        let scoring = ScoringConfig {
            max_fallbacks: config.routing.fallbacks,
            ..config.scoring.clone()
        };
        let router = Router {
            models,
            adapters,
            workers: RwLock::new(Vec::new()),
            scoring,
            max_inflight: (config.routing.max_inflight_per_worker > 0)
                .then_some(config.routing.max_inflight_per_worker),
            unknown_model: config.routing.unknown_model,
            salt_policy: config.salt.policy(),
            fingerprints: config
                .salt
                .fingerprint_key
                .as_deref()
                .map(FingerprintKey::from_passphrase)
                .unwrap_or_else(FingerprintKey::random),
            metrics,
            decisions: AtomicU64::new(0),
            tokenizers,
            max_prompt_tokens: config
                .models
                .iter()
                .filter_map(|m| Some((m.name.clone(), m.max_prompt_tokens?)))
                .collect(),
        };
        for w in &config.workers {
            router.add_worker(w.id(), &w.model);
        }
        router
    }

    /// The salt policy every entry point resolves salts under.
    pub fn salt_policy(&self) -> &SaltPolicy {
        &self.salt_policy
    }

    /// The key salt fingerprints are computed under.
    pub fn fingerprints(&self) -> &FingerprintKey {
        &self.fingerprints
    }

    /// The metrics.
    pub fn metrics(&self) -> &Arc<Metrics> {
        &self.metrics
    }

    /// The configured model names.
    pub fn model_names(&self) -> Vec<String> {
        let mut v: Vec<String> = self.models.keys().cloned().collect();
        v.sort();
        v
    }

    /// The index of a configured model.
    pub fn index(&self, model: &str) -> Option<&Arc<KvIndex>> {
        self.models.get(model).map(|m| &m.index)
    }

    /// Adds (or re-readies) a worker of `model`; it is ready at once.
    pub fn add_worker(&self, id: WorkerId, model: &str) {
        let mut workers = self.workers.write();
        if let Some(w) = workers.iter().find(|w| w.id == id) {
            w.set_ready(true);
            return;
        }
        if let Some(m) = self.models.get(model) {
            m.index.add_worker(id);
        }
        workers.push(Arc::new(WorkerRuntime {
            id,
            model: model.to_owned(),
            inflight: AtomicU32::new(0),
            ready: AtomicBool::new(true),
            engine: RwLock::new(None),
        }));
    }

    /// Removes a worker from routing and drops its index state. In-flight bookings on it finish
    /// normally.
    pub fn remove_worker(&self, id: &WorkerId) {
        let mut workers = self.workers.write();
        if let Some(pos) = workers.iter().position(|w| w.id == *id) {
            let w = workers.remove(pos);
            if let Some(m) = self.models.get(&w.model) {
                m.index.remove_worker(id);
            }
        }
    }

    /// The model a worker serves, if it is one of this router's workers.
    pub fn model_of(&self, id: &WorkerId) -> Option<String> {
        self.workers
            .read()
            .iter()
            .find(|w| w.id == *id)
            .map(|w| w.model.clone())
    }

    /// A worker's model and that model's index, if it is one of this router's workers.
    pub fn worker_index(&self, id: &WorkerId) -> Option<(String, Arc<KvIndex>)> {
        let model = self.model_of(id)?;
        let index = self.index(&model)?.clone();
        Some((model, index))
    }

    /// The live worker states.
    pub fn workers(&self) -> Vec<Arc<WorkerRuntime>> {
        self.workers.read().clone()
    }

    /// Total in-flight bookings (0 when every stream has ended).
    pub fn total_inflight(&self) -> u64 {
        self.workers
            .read()
            .iter()
            .map(|w| u64::from(w.inflight()))
            .sum()
    }

    /// Resolves a `model` field to (base model, LoRA adapter).
    pub fn resolve_model<'a>(&'a self, model: &'a str) -> Option<(&'a str, Option<&'a str>)> {
        if self.models.contains_key(model) {
            return Some((model, None));
        }
        self.adapters
            .get(model)
            .map(|base| (base.as_str(), Some(model)))
    }

    /// Token IDs of a text or chat request, when its model has a tokenizer and `path` is an
    /// endpoint kv-epp tokenizes (`None` otherwise: route on load alone).
    /// `model` is the body's `model` field, already read by the caller (no second parse).
    pub fn tokenize(
        &self,
        path: &str,
        model: &str,
        body: &[u8],
    ) -> Option<Result<Vec<u32>, TokenizeError>> {
        let endpoint = Endpoint::from_path(path)?;
        self.tokenizers.resolve(model)?;
        Some(
            self.tokenizers
                .tokenize(endpoint, body)
                .map(|t| t.token_ids),
        )
    }

    /// A base model's block size (`None` when the model is not served).
    pub fn block_size(&self, base: &str) -> Option<usize> {
        self.models.get(base).map(|m| m.block_size)
    }

    /// A base model's `max_prompt_tokens`, if it sets one.
    pub fn max_prompt_tokens(&self, base: &str) -> Option<usize> {
        self.max_prompt_tokens.get(base).copied()
    }

    /// The scoring weights and fallback count.
    pub fn scoring(&self) -> &ScoringConfig {
        &self.scoring
    }

    /// The per-worker in-flight limit, if any.
    pub fn max_inflight(&self) -> Option<u32> {
        self.max_inflight
    }

    /// Whether a request naming a model that is not served is refused (else routed on load).
    pub fn rejects_unknown_models(&self) -> bool {
        self.unknown_model == UnknownModel::Reject
    }

    /// Runs `f` over the live workers under the read lock (no copy of the list per request).
    pub fn with_workers<R>(&self, f: impl FnOnce(&[Arc<WorkerRuntime>]) -> R) -> R {
        f(&self.workers.read())
    }

    /// The number of this decision: spreads prompt-less requests and seeds sampling. A decision
    /// that books advances the count; an explanation reads the number the next one would get,
    /// so explaining changes nothing.
    pub fn decision_number(&self, advance: bool) -> u64 {
        if advance {
            self.decisions.fetch_add(1, Ordering::Relaxed)
        } else {
            self.decisions.load(Ordering::Relaxed)
        }
    }

    /// Books one in-flight slot on `worker`, released when the booking drops.
    pub fn book(&self, worker: &Arc<WorkerRuntime>) -> Booking {
        Booking::new(worker.clone(), self.metrics.clone())
    }
}
