//! The picker's business logic: from a understood request (model, tokens, salt, constraints) to
//! a booked decision. No I/O; the ext_proc stream and the query API are thin edges around it.
//!
//! Load accounting cannot leak: a decision carries a [`Booking`] that holds one in-flight slot on
//! the chosen worker and gives it back when dropped, exactly once, whatever ends the request.

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};

use parking_lot::RwLock;
use rand::SeedableRng;
use rand::rngs::SmallRng;

use crate::config::{Config, UnknownModel};
use crate::fingerprint::FingerprintKey;
use crate::hashing::{SequenceHash, prompt_hashes};
use crate::index::KvIndex;
use crate::metrics::Metrics;
use crate::namespace::seed_for;
use crate::salt::{CacheSalt, SaltPolicy};
use crate::scoring::{Candidate, EngineLoad, PickError, ScoringConfig, pick};
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

/// What the router needs to know about one request.
#[derive(Clone, Debug, Default)]
pub struct RouteRequest<'a> {
    /// The `model` field.
    pub model: Option<&'a str>,
    /// Prompt token IDs, when the request has them.
    pub tokens: Option<&'a [u32]>,
    /// The resolved salt.
    pub salt: Option<&'a CacheSalt>,
    /// Gateway subset hint: only these endpoints are eligible.
    pub subset: Option<Vec<SocketAddr>>,
    /// Conformance order: only workers on these IPs, preferred in this order.
    pub conformance_ips: Option<Vec<IpAddr>>,
}

/// A booked routing decision.
#[derive(Debug)]
pub struct RouteDecision {
    /// The primary endpoint's booking.
    pub booking: Booking,
    /// Ordered fallbacks.
    pub fallbacks: Vec<WorkerId>,
    /// Prompt blocks.
    pub prompt_blocks: u32,
    /// Blocks credited as cached on the primary.
    pub cached_blocks: f64,
    /// The configured model the request was matched to (`None`: unknown, routed on load).
    pub model: Option<String>,
    /// The LoRA adapter named by the request, if `model` was an adapter.
    pub lora: Option<String>,
}

impl RouteDecision {
    /// The value for `x-gateway-destination-endpoint` and the `envoy.lb` metadata.
    pub fn destination(&self) -> String {
        std::iter::once(self.booking.worker().endpoint.to_string())
            .chain(self.fallbacks.iter().map(|w| w.endpoint.to_string()))
            .collect::<Vec<_>>()
            .join(",")
    }
}

/// Why a request was not routed. Each maps to one HTTP status at the edge.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum RouteError {
    /// No ready endpoint (or none inside the subset): 503.
    #[error("no ready endpoint{0}")]
    NoEndpoints(&'static str),
    /// Every candidate is at its in-flight limit: 429.
    #[error("every candidate endpoint is at its in-flight limit")]
    Saturated,
    /// The model is not served and the policy rejects unknown models: 404.
    #[error("model `{0}` is not served here")]
    UnknownModel(String),
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

/// Why a prompt was refused before routing.
#[derive(Debug, thiserror::Error)]
pub enum PromptError {
    /// The request could not be tokenized (a client error: 400, or 404 for an unknown model).
    #[error(transparent)]
    Tokenize(#[from] TokenizeError),
    /// The prompt is longer than the model allows.
    #[error("prompt is {tokens} tokens; model `{model}` accepts at most {max}")]
    TooLong {
        /// The model.
        model: String,
        /// Prompt tokens.
        tokens: usize,
        /// The limit.
        max: usize,
    },
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

    /// Checks a prompt against its model's `max_prompt_tokens`.
    pub fn check_prompt(&self, model: Option<&str>, tokens: usize) -> Result<(), PromptError> {
        let Some((base, _)) = model.and_then(|m| self.resolve_model(m)) else {
            return Ok(());
        };
        match self.max_prompt_tokens.get(base) {
            Some(&max) if tokens > max => Err(PromptError::TooLong {
                model: base.to_owned(),
                tokens,
                max,
            }),
            _ => Ok(()),
        }
    }

    /// The prefix hashes of a prompt for a model, under a salt and adapter.
    pub fn prompt_hashes(
        &self,
        model: &str,
        tokens: &[u32],
        salt: Option<&CacheSalt>,
        lora: Option<&str>,
    ) -> Option<Vec<SequenceHash>> {
        let m = self.models.get(model)?;
        Some(prompt_hashes(tokens, m.block_size, seed_for(salt, lora)).1)
    }

    /// Decides and books a worker for `req`.
    pub fn route(&self, req: &RouteRequest<'_>) -> Result<RouteDecision, RouteError> {
        let resolved = req.model.and_then(|m| self.resolve_model(m));
        if resolved.is_none() && self.unknown_model == UnknownModel::Reject {
            return Err(RouteError::UnknownModel(
                req.model.unwrap_or_default().to_owned(),
            ));
        }
        let workers = self.workers.read();
        let eligible: Vec<&Arc<WorkerRuntime>> = workers
            .iter()
            .filter(|w| w.is_ready())
            .filter(|w| resolved.is_none_or(|(base, _)| w.model == base))
            .filter(|w| {
                req.subset
                    .as_ref()
                    .is_none_or(|s| s.contains(&w.id.endpoint))
            })
            .filter(|w| {
                req.conformance_ips
                    .as_ref()
                    .is_none_or(|ips| ips.contains(&w.id.endpoint.ip()))
            })
            .collect();
        if eligible.is_empty() {
            let why = if req.subset.is_some() || req.conformance_ips.is_some() {
                " in the requested subset"
            } else {
                ""
            };
            return Err(RouteError::NoEndpoints(why));
        }
        // Conformance: the test picker's order is authoritative.
        if let Some(ips) = &req.conformance_ips {
            let first = ips
                .iter()
                .find_map(|ip| eligible.iter().find(|w| w.id.endpoint.ip() == *ip))
                .copied()
                .ok_or(RouteError::NoEndpoints(" in the requested subset"))?;
            return Ok(RouteDecision {
                booking: Booking::new(first.clone(), self.metrics.clone()),
                fallbacks: Vec::new(),
                prompt_blocks: 0,
                cached_blocks: 0.0,
                model: resolved.map(|(b, _)| b.to_owned()),
                lora: resolved.and_then(|(_, l)| l.map(str::to_owned)),
            });
        }
        let (seqs, overlaps) = match (resolved, req.tokens) {
            (Some((base, lora)), Some(tokens)) => {
                let m = &self.models[base];
                let seqs = prompt_hashes(tokens, m.block_size, seed_for(req.salt, lora)).1;
                let overlaps = m.index.query(&seqs);
                (seqs, overlaps)
            }
            _ => (Vec::new(), Vec::new()),
        };
        let candidates: Vec<Candidate> = eligible
            .iter()
            .map(|w| {
                let o = overlaps.iter().find(|o| o.worker == w.id);
                Candidate {
                    worker: w.id,
                    device_blocks: o.map_or(0, |o| o.device_blocks),
                    total_blocks: o.map_or(0, |o| o.total_blocks),
                    inflight: w.inflight(),
                    max_inflight: self.max_inflight,
                    engine: *w.engine.read(),
                }
            })
            .collect();
        let n = self.decisions.fetch_add(1, Ordering::Relaxed);
        // With no prompt blocks, spread by decision count; otherwise keep identical prefixes together.
        let key = seqs
            .first()
            .map_or(n.wrapping_mul(0x9e37_79b9_7f4a_7c15), |s| s.0);
        let mut rng = SmallRng::seed_from_u64(key ^ n);
        let d = pick(&candidates, seqs.len() as u32, key, &self.scoring, &mut rng).map_err(
            |e| match e {
                PickError::NoCandidates => RouteError::NoEndpoints(""),
                PickError::AllSaturated => RouteError::Saturated,
            },
        )?;
        let chosen = eligible
            .iter()
            .find(|w| w.id == d.primary.candidate.worker)
            .copied()
            .ok_or(RouteError::NoEndpoints(""))?;
        Ok(RouteDecision {
            booking: Booking::new(chosen.clone(), self.metrics.clone()),
            fallbacks: d.fallbacks,
            prompt_blocks: seqs.len() as u32,
            cached_blocks: d.primary.cached_blocks,
            model: resolved.map(|(b, _)| b.to_owned()),
            lora: resolved.and_then(|(_, l)| l.map(str::to_owned)),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::hashing::HashSeed;
    use crate::index::{EngineBlockHash, Medium, StoreBlocks};

    fn config(yaml: &str) -> Config {
        let c = Config::from_yaml(yaml).unwrap();
        c.validate().unwrap();
        c
    }

    const TWO: &str = "models: [{name: m, block_size: 4, lora_adapters: [ad]}]
workers: [{endpoint: '10.0.0.1:8000', model: m}, {endpoint: '10.0.0.2:8000', model: m}]";

    #[test]
    fn bookings_release_exactly_once_on_drop() {
        let r = Router::new(&config(TWO), Arc::new(Metrics::new()));
        let a = r.route(&RouteRequest::default()).unwrap();
        let b = r.route(&RouteRequest::default()).unwrap();
        assert_eq!(r.total_inflight(), 2);
        assert_ne!(a.booking.worker(), b.booking.worker(), "load spreads");
        drop(a);
        assert_eq!(r.total_inflight(), 1);
        drop(b);
        assert_eq!(r.total_inflight(), 0);
    }

    #[test]
    fn routes_to_the_prefix_holder_only_under_the_same_salt() {
        let r = Router::new(&config(TWO), Arc::new(Metrics::new()));
        let holder: WorkerId = "10.0.0.2:8000".parse().unwrap();
        let tokens: Vec<u32> = (0..16).collect();
        let salt = CacheSalt::new("tenant-a", crate::salt::SaltSource::Header)
            .unwrap()
            .unwrap();
        let hashes: Vec<EngineBlockHash> = (1..=4).map(EngineBlockHash).collect();
        r.index("m")
            .unwrap()
            .store(
                &holder,
                &StoreBlocks {
                    parent: None,
                    root_seed: Some(HashSeed::new(None, Some("tenant-a"))),
                    engine_hashes: &hashes,
                    tokens: &tokens,
                    medium: Medium::Device,
                },
            )
            .unwrap();
        for _ in 0..3 {
            let d = r
                .route(&RouteRequest {
                    model: Some("m"),
                    tokens: Some(&tokens),
                    salt: Some(&salt),
                    ..RouteRequest::default()
                })
                .unwrap();
            assert_eq!(*d.booking.worker(), holder);
            assert_eq!(d.cached_blocks, 4.0);
        }
        let other = CacheSalt::new("tenant-b", crate::salt::SaltSource::Header)
            .unwrap()
            .unwrap();
        let d = r
            .route(&RouteRequest {
                model: Some("m"),
                tokens: Some(&tokens),
                salt: Some(&other),
                ..RouteRequest::default()
            })
            .unwrap();
        assert_eq!(d.cached_blocks, 0.0, "another tenant gets no credit");
    }

    #[test]
    fn subset_saturation_and_unknown_models() {
        let yaml = format!("{TWO}\nrouting: {{max_inflight_per_worker: 1, unknown_model: reject}}");
        let r = Router::new(&config(&yaml), Arc::new(Metrics::new()));
        let only2: SocketAddr = "10.0.0.2:8000".parse().unwrap();
        let req = RouteRequest {
            model: Some("m"),
            subset: Some(vec![only2]),
            ..RouteRequest::default()
        };
        let d = r.route(&req).unwrap();
        assert_eq!(d.booking.worker().endpoint, only2);
        assert_eq!(r.route(&req).unwrap_err(), RouteError::Saturated);
        let none = RouteRequest {
            model: Some("m"),
            subset: Some(vec![]),
            ..RouteRequest::default()
        };
        assert!(matches!(
            r.route(&none).unwrap_err(),
            RouteError::NoEndpoints(_)
        ));
        assert_eq!(
            r.route(&RouteRequest {
                model: Some("nope"),
                ..RouteRequest::default()
            })
            .unwrap_err(),
            RouteError::UnknownModel("nope".into())
        );
        let lora = r
            .route(&RouteRequest {
                model: Some("ad"),
                ..RouteRequest::default()
            })
            .unwrap();
        assert_eq!(lora.lora.as_deref(), Some("ad"));
        assert_eq!(lora.model.as_deref(), Some("m"));
    }
}
