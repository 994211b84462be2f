//! Configuration: one typed YAML file, loaded once at start, overridden by command-line flags, and
//! validated with messages that name the offending field. Nothing else reads the environment.
//!
//! The format is documented in the README; `deploy/examples/kv-epp.yaml` is a complete example.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use std::sync::Arc;
use std::time::Duration;

use crate::decide::{Picker, Policy};
pub use crate::decide::{UnknownModel, UnrenderableRequests};
use crate::discovery::DiscoverySettings;
pub use crate::discovery::{DEFAULT_MODEL_LABEL, PoolApiVersion, PoolConfig};
pub use crate::events::EventEngine;
pub use crate::flow::{FlowControlConfig, TenantConfig, TenantPolicy};
use crate::membership::{DesiredWorker, MembershipSettings};
use crate::metrics::Metrics;
use crate::models::{ModelSettings, ServedModels};
pub use crate::replica::{Coordination, PeersConfig};
use crate::workers::Workers;
use kv_epp_core::fingerprint::FingerprintKey;
use kv_epp_core::index::IndexLimits;
use kv_epp_core::salt::{SaltPolicy, SaltSource};
use kv_epp_core::scoring::ScoringConfig;
use kv_epp_core::worker::WorkerId;

/// The whole configuration.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Config {
    /// Listeners.
    pub server: ServerConfig,
    /// The InferencePool this picker serves (names only; discovery comes from Kubernetes).
    pub pool: PoolConfig,
    /// Request handling limits and protocol options.
    pub routing: RoutingConfig,
    /// Cost function.
    pub scoring: ScoringConfig,
    /// Where salts may come from.
    pub salt: SaltConfig,
    /// KV index limits.
    pub index: IndexConfig,
    /// Served models.
    pub models: Vec<ModelConfig>,
    /// Statically configured workers.
    pub workers: Vec<StaticWorker>,
    /// Where engines publish their KV events.
    pub events: EventsConfig,
    /// Scraping engines' own load metrics.
    pub engine_metrics: EngineMetricsConfig,
    /// Other kv-epp replicas (see `PeersConfig`).
    pub peers: PeersConfig,
    /// Queuing at saturation, fairness between tenants, quotas (see `FlowControlConfig`).
    pub flow_control: FlowControlConfig,
}

/// Scraping each worker's Prometheus `/metrics` for engine-reported load.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct EngineMetricsConfig {
    /// Scrape interval in milliseconds (0 = do not scrape).
    pub interval_ms: u64,
    /// Figures older than this are withdrawn from scoring.
    pub stale_after_ms: u64,
}

impl Default for EngineMetricsConfig {
    fn default() -> Self {
        EngineMetricsConfig {
            interval_ms: 200,
            stale_after_ms: 2000,
        }
    }
}

/// KV event sources.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct EventsConfig {
    /// The protocol.
    pub engine: EventEngine,
    /// Largest event message (all its frames) accepted from an engine's publisher or replay
    /// socket; a longer one is refused before anything is allocated for it, and the connection
    /// is dropped, counted and retried.
    pub max_message_bytes: usize,
    /// vLLM ZeroMQ ports.
    pub zmq: ZmqConfig,
    /// TensorRT-LLM: the transport and polling.
    pub trtllm: TrtllmConfig,
    /// Whether the engines publish the salt of salted stores (vLLM; SGLang since #30827, first
    /// released in 0.5.18; TensorRT-LLM's HTTP drain from 1.3). `false` for engines that do not
    /// (older SGLang, TensorRT-LLM's ZeroMQ publisher): their events still route unsalted
    /// requests by prefix, salted requests get no prefix credit from them (routed on load), and
    /// each salted request routed to them is counted in
    /// `kv_epp_unisolated_salted_requests_total`.
    pub salted_events: bool,
}

impl Default for EventsConfig {
    fn default() -> Self {
        EventsConfig {
            engine: EventEngine::default(),
            max_message_bytes: crate::events::zmtp::Limits::default().max_message_bytes,
            zmq: ZmqConfig::default(),
            trtllm: TrtllmConfig::default(),
            salted_events: true,
        }
    }
}

impl EventsConfig {
    /// What one engine event connection may cost.
    pub fn limits(&self) -> crate::events::zmtp::Limits {
        crate::events::zmtp::Limits {
            max_message_bytes: self.max_message_bytes,
            ..Default::default()
        }
    }
}

/// TensorRT-LLM event polling.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TrtllmConfig {
    /// Milliseconds between drains of `POST /kv_cache_events` (transport `http`).
    pub poll_interval_ms: u64,
    /// How events leave the engine: `http` (the destructive drain, one reader per engine, owned
    /// by one replica) or `zmq` (TensorRT-LLM's ZeroMQ publisher per rank, on the ports of
    /// `events.zmq`; every replica subscribes, as for vLLM).
    pub transport: TrtllmTransport,
}

/// How TensorRT-LLM's KV events are read.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TrtllmTransport {
    /// `POST /kv_cache_events`, polled.
    #[default]
    Http,
    /// The ZeroMQ publisher (TensorRT-LLM PR #17023).
    Zmq,
}

impl Default for TrtllmConfig {
    fn default() -> Self {
        TrtllmConfig {
            poll_interval_ms: 100,
            transport: TrtllmTransport::Http,
        }
    }
}

/// vLLM's publisher conventions: rank `r` publishes on `port + r` and replays on
/// `replay_port + r`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ZmqConfig {
    /// The engine's PUB port for rank 0.
    pub port: u16,
    /// The engine's replay ROUTER port for rank 0 (0 = the engine has no replay socket).
    pub replay_port: u16,
    /// Topic to subscribe to ("" = all).
    pub topic: String,
}

impl Default for ZmqConfig {
    fn default() -> Self {
        ZmqConfig {
            port: 5557,
            replay_port: 5558,
            topic: String::new(),
        }
    }
}

/// Listener settings. Ports follow the reference picker's conventions.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ServerConfig {
    /// Address every listener binds.
    pub bind_address: IpAddr,
    /// ext_proc gRPC port.
    pub grpc_port: u16,
    /// gRPC health port.
    pub grpc_health_port: u16,
    /// Prometheus metrics port.
    pub metrics_port: u16,
    /// Admin HTTP port: the standalone query API and worker status.
    pub admin_port: u16,
    /// A file holding the admin API's bearer token (e.g. a mounted Secret; re-read when it
    /// changes). Without one, the admin API needs no token and listens on loopback only.
    pub admin_token_file: Option<PathBuf>,
    /// Require `Authorization: Bearer <token>` on metrics scrapes: checked against
    /// `metrics_token_file`, or, without one, with the Kubernetes TokenReview and
    /// SubjectAccessReview APIs (`get` on `/metrics`).
    #[serde(default)]
    pub metrics_auth: bool,
    /// A file holding the token scrapers present when `metrics_auth` is on (re-read when it
    /// changes).
    pub metrics_token_file: Option<PathBuf>,
    /// Serve TLS on the ext_proc port.
    pub secure_serving: bool,
    /// Directory with `tls.crt` and `tls.key`; a self-signed certificate is generated when unset.
    /// The files are re-read when they change.
    pub cert_path: Option<PathBuf>,
    /// PEM file of the CA(s) whose client certificates the ext_proc port accepts: with it, a
    /// client that presents no certificate signed by one of them is refused in the handshake
    /// (mutual TLS). Needs `secure_serving`; re-read when it changes.
    pub client_ca_path: Option<PathBuf>,
    /// With `secure_serving` and no `cert_path`: the directory that keeps the self-signed
    /// certificate (`tls.crt`, `tls.key`), generated once when absent and reused at every later
    /// start so a gateway can pin it. Unset: a new certificate in memory at each start.
    pub self_signed_cert_dir: Option<PathBuf>,
    /// Concurrent ext_proc streams (requests) one HTTP/2 connection from Envoy may carry; Envoy
    /// opens another connection beyond it.
    pub max_concurrent_streams: u32,
    /// HTTP/2 PING interval on ext_proc connections, in ms (0 = no keepalive pings).
    pub keepalive_interval_ms: u64,
    /// How long a keepalive PING may go unanswered before the connection is closed, in ms.
    pub keepalive_timeout_ms: u64,
    /// Threads that run every port's connections (the async runtime's workers); 0 = one per
    /// core the process may use (its CPU quota included). Decisions of larger bodies and
    /// tokenization run on the decision lanes' own threads either way.
    pub io_threads: usize,
}

impl Default for ServerConfig {
    fn default() -> Self {
        ServerConfig {
            bind_address: IpAddr::V4(Ipv4Addr::UNSPECIFIED),
            grpc_port: 9002,
            grpc_health_port: 9003,
            metrics_port: 9090,
            admin_port: 9091,
            admin_token_file: None,
            metrics_auth: false,
            metrics_token_file: None,
            secure_serving: false,
            cert_path: None,
            client_ca_path: None,
            self_signed_cert_dir: None,
            max_concurrent_streams: 1024,
            keepalive_interval_ms: 30_000,
            keepalive_timeout_ms: 10_000,
            io_threads: 0,
        }
    }
}

/// Most runtime threads `server.io_threads` may ask for (each has its own stack).
pub const MAX_IO_THREADS: usize = 1024;

/// Request handling.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RoutingConfig {
    /// Largest request body accepted (413 above).
    pub max_body_bytes: usize,
    /// Requests in flight per worker before it counts as saturated (0 = unlimited).
    pub max_inflight_per_worker: u32,
    /// `Retry-After` seconds sent with 429.
    pub retry_after_seconds: u32,
    /// Fallback endpoints listed after the primary (0 = none). Core Envoy's ORIGINAL_DST cluster
    /// rejects lists, so leave this 0 unless the gateway understands them.
    pub fallbacks: usize,
    /// What to do with unknown models.
    pub unknown_model: UnknownModel,
    /// Honour the GIE conformance headers (`test-epp-endpoint-selection`, served-endpoint echo).
    pub conformance_hooks: bool,
    /// Longest wait for Envoy's next message on a stream before its decision, in ms (408 after).
    pub stream_idle_timeout_ms: u64,
    /// Request body bytes buffered across all streams at once (503 for a stream whose next chunk
    /// would exceed it); at least `max_body_bytes`.
    pub max_buffered_body_bytes: usize,
    /// Decisions of bodies under 64 KiB running at once, each on its own blocking thread
    /// (0 = one per available core).
    pub decision_threads: usize,
    /// Decisions of larger bodies running at once (0 = half of `decision_threads`, at least 1),
    /// so huge prompts never take every thread from short requests.
    pub large_body_decision_threads: usize,
    /// Requests kv-epp cannot render exactly as the engine would (template errors, options or
    /// inputs it does not reproduce): `load_only` (default) routes them on load alone and
    /// counts them in `kv_epp_unrenderable_total{reason}`; `reject` answers 400.
    pub unrenderable: UnrenderableRequests,
}

impl Default for RoutingConfig {
    fn default() -> Self {
        RoutingConfig {
            max_body_bytes: 16 << 20,
            max_inflight_per_worker: 256,
            retry_after_seconds: 1,
            fallbacks: 0,
            unknown_model: UnknownModel::LoadOnly,
            conformance_hooks: false,
            stream_idle_timeout_ms: 30_000,
            max_buffered_body_bytes: 256 << 20,
            decision_threads: 0,
            large_body_decision_threads: 0,
            unrenderable: UnrenderableRequests::LoadOnly,
        }
    }
}

/// Salt sources, requirement, and the fingerprint key.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct SaltConfig {
    /// Trusted sources, any of `header`, `nvext`, `body` (precedence is always in that order).
    pub sources: Vec<SaltSource>,
    /// Reject (400) requests without a salt from a trusted source.
    pub required: bool,
    /// Key for salt fingerprints in logs and metrics; set the same value on every replica to make
    /// fingerprints comparable. Random per process when unset.
    pub fingerprint_key: Option<String>,
    /// A file holding the fingerprint key (e.g. mounted from a Secret); read once at start.
    pub fingerprint_key_file: Option<PathBuf>,
}

impl Default for SaltConfig {
    fn default() -> Self {
        let p = SaltPolicy::default();
        SaltConfig {
            sources: p.sources,
            required: p.required,
            fingerprint_key: None,
            fingerprint_key_file: None,
        }
    }
}

impl SaltConfig {
    /// The resolver's policy.
    pub fn policy(&self) -> SaltPolicy {
        SaltPolicy {
            sources: self.sources.clone(),
            required: self.required,
        }
    }
}

/// Index limits.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct IndexConfig {
    /// Maximum (worker, block) pairs per model.
    pub capacity: usize,
    /// Maximum blocks one worker may hold before its state is dropped.
    pub max_blocks_per_worker: usize,
}

impl Default for IndexConfig {
    fn default() -> Self {
        let d = IndexLimits::default();
        IndexConfig {
            capacity: d.capacity,
            max_blocks_per_worker: d.max_blocks_per_worker,
        }
    }
}

impl IndexConfig {
    /// As index limits.
    pub fn limits(&self) -> IndexLimits {
        IndexLimits {
            capacity: self.capacity,
            max_blocks_per_worker: self.max_blocks_per_worker,
        }
    }
}

/// One served model.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelConfig {
    /// The name clients put in `model`.
    pub name: String,
    /// The engine's KV block size in tokens.
    pub block_size: usize,
    /// LoRA adapters served on this base model (clients may name them in `model`).
    #[serde(default)]
    pub lora_adapters: Vec<String>,
    /// The model's tokenizer files (a Hugging Face model directory); without them only token-ID
    /// prompts are routed by prefix, text and chat prompts on load alone.
    #[serde(default)]
    pub tokenizer: Option<TokenizerSource>,
    /// Longest prompt accepted, in tokens (400 above; refused before it is tokenized whole);
    /// [`DEFAULT_MAX_PROMPT_TOKENS`] when unset, unlimited when `null`.
    #[serde(default = "default_max_prompt_tokens")]
    pub max_prompt_tokens: Option<usize>,
}

/// The default prompt limit: 1,048,576 tokens, above the context of nearly every served model
/// (set it to the engine's `max_model_len` to refuse what the engine would refuse anyway), and
/// small enough that an accepted prompt's ids fit in 4 MiB.
pub const DEFAULT_MAX_PROMPT_TOKENS: usize = 1 << 20;

fn default_max_prompt_tokens() -> Option<usize> {
    Some(DEFAULT_MAX_PROMPT_TOKENS)
}

/// Where a model's tokenizer files are.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TokenizerSource {
    /// Directory holding `tokenizer.json`, and optionally `tokenizer_config.json` and
    /// `chat_template.jinja`.
    pub path: PathBuf,
    /// A chat template file that replaces the directory's (like vLLM's `--chat-template`).
    #[serde(default)]
    pub chat_template: Option<PathBuf>,
    /// Extra template variables set server-side (e.g. `date_string`).
    #[serde(default)]
    pub template_vars: std::collections::BTreeMap<String, String>,
    /// The longest pre-tokenizer word (a piece with no split point) tokenized, in bytes (at
    /// least 1); a prompt with a longer one is unrenderable (`long_word`). Default
    /// `kv_epp_tokenize::model::MAX_WORD_BYTES` (64 KiB): BPE working memory is ~20 bytes per
    /// byte of a word.
    #[serde(default = "default_max_word_bytes")]
    pub max_word_bytes: usize,
}

fn default_max_word_bytes() -> usize {
    kv_epp_tokenize::model::MAX_WORD_BYTES
}

impl Config {
    /// The served models, each with its tokenizer loaded when it names one (I/O: call once at
    /// start). Errors name the model.
    pub fn served_models(&self) -> Result<ServedModels, ConfigError> {
        use kv_epp_tokenize::{ModelTokenizer, TokenizerFiles};
        let mut settings = Vec::with_capacity(self.models.len());
        for (i, m) in self.models.iter().enumerate() {
            let tokenizer = match &m.tokenizer {
                None => None,
                Some(src) => {
                    let mut files = TokenizerFiles::in_dir(&src.path);
                    if src.chat_template.is_some() {
                        files.chat_template = src.chat_template.clone();
                    }
                    let mut tok = ModelTokenizer::load(&files).map_err(|e| {
                        ConfigError::Invalid(format!("models[{i}].tokenizer ({}): {e}", m.name))
                    })?;
                    for (k, v) in &src.template_vars {
                        tok.set_template_var(k.clone(), v.clone());
                    }
                    if src.max_word_bytes == 0 {
                        return Err(ConfigError::Invalid(format!(
                            "models[{i}].tokenizer.max_word_bytes ({}): must be at least 1",
                            m.name
                        )));
                    }
                    tok.set_max_word_bytes(src.max_word_bytes);
                    Some(Arc::new(tok))
                }
            };
            settings.push(ModelSettings {
                name: m.name.clone(),
                block_size: m.block_size,
                lora_adapters: m.lora_adapters.clone(),
                max_prompt_tokens: m.max_prompt_tokens,
                tokenizer,
            });
        }
        ServedModels::new(settings, self.index.limits())
            .map_err(|e| ConfigError::Invalid(format!("models: {e}")))
    }

    /// How decisions are made: scoring, the in-flight limit, unknown models, salts.
    pub fn policy(&self) -> Policy {
        Policy {
            scoring: ScoringConfig {
                max_fallbacks: self.routing.fallbacks,
                ..self.scoring.clone()
            },
            max_inflight: (self.routing.max_inflight_per_worker > 0)
                .then_some(self.routing.max_inflight_per_worker),
            unknown_model: self.routing.unknown_model,
            unrenderable: self.routing.unrenderable,
            salt: self.salt.policy(),
            fingerprints: self
                .salt
                .fingerprint_key
                .as_deref()
                .map(FingerprintKey::from_passphrase)
                .unwrap_or_else(FingerprintKey::random),
            salted_events: self.events.salted_events,
        }
    }

    /// Everything the request pipeline reads: the served models (tokenizers loaded), the
    /// statically configured workers (ready at once) and the policy. Bookings are counted in
    /// `metrics`.
    pub fn picker(&self, metrics: Arc<Metrics>) -> Result<Picker, ConfigError> {
        let models = Arc::new(self.served_models()?);
        let workers = Arc::new(Workers::new(metrics));
        for w in &self.workers {
            let index = models.index(&w.model).cloned();
            workers.add(w.id(), &w.model, index);
        }
        Ok(Picker::new(models, workers, self.policy()))
    }

    /// How the membership runs workers' companions: the event protocol, the TensorRT-LLM poll
    /// interval and the engine-metrics scrape.
    pub(crate) fn membership_settings(&self) -> MembershipSettings {
        let em = &self.engine_metrics;
        MembershipSettings {
            engine: self.events.engine,
            trtllm_zmq: self.events.trtllm.transport == TrtllmTransport::Zmq,
            trtllm_interval: Duration::from_millis(self.events.trtllm.poll_interval_ms),
            scrape: (em.interval_ms > 0).then(|| {
                (
                    Duration::from_millis(em.interval_ms),
                    Duration::from_millis(em.stale_after_ms),
                )
            }),
        }
    }

    /// A worker with the event endpoints this configuration derives for it (`overrides`: a
    /// static worker's explicit endpoints).
    pub(crate) fn desired_worker(
        &self,
        id: WorkerId,
        model: &str,
        overrides: Option<&StaticWorker>,
    ) -> DesiredWorker {
        DesiredWorker {
            id,
            model: model.to_owned(),
            feed: self.feed_endpoints(&id, overrides),
            // SGLang says where it publishes: ask it unless the worker names its endpoint.
            probe_server_info: self.events.engine == EventEngine::Sglang
                && overrides.is_none_or(|w| w.events_endpoint.is_none()),
        }
    }

    /// What discovery needs: the pool, the served model names, and how a discovered worker's
    /// event endpoints are derived.
    pub(crate) fn discovery_settings(&self) -> DiscoverySettings {
        let events = self.clone();
        DiscoverySettings {
            pool: self.pool.clone(),
            models: self.models.iter().map(|m| m.name.clone()).collect(),
            worker: Arc::new(move |id, model| events.desired_worker(id, model, None)),
        }
    }

    /// The statically configured workers, as desired workers.
    pub(crate) fn static_workers(&self) -> Vec<DesiredWorker> {
        self.workers
            .iter()
            .map(|w| self.desired_worker(w.id(), &w.model, Some(w)))
            .collect()
    }
}

/// A statically configured worker.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StaticWorker {
    /// `ip:port` Envoy sends traffic to.
    pub endpoint: SocketAddr,
    /// The model it serves.
    pub model: String,
    /// Data-parallel rank behind the endpoint.
    #[serde(default)]
    pub dp_rank: u32,
    /// The worker's KV event publisher (default: `tcp://<ip>:<events.zmq.port + dp_rank>`).
    #[serde(default)]
    pub events_endpoint: Option<String>,
    /// The worker's replay socket (default: from `events.zmq.replay_port`, none when 0).
    #[serde(default)]
    pub replay_endpoint: Option<String>,
}

impl StaticWorker {
    /// The worker's id.
    pub fn id(&self) -> WorkerId {
        WorkerId::with_rank(self.endpoint, self.dp_rank)
    }
}

impl Config {
    /// Whether workers come from the InferencePool (`pool.name` set and no static `workers`)
    /// rather than from the static list.
    pub fn discovers_workers(&self) -> bool {
        !self.pool.name.is_empty() && self.workers.is_empty()
    }

    /// Whether a Kubernetes Lease decides drain ownership (`peers.coordination`, `auto`
    /// resolved: `lease` when the replicas run on Kubernetes).
    pub fn drain_lease(&self) -> bool {
        use crate::replica::Coordination;
        self.peers.enabled()
            && match self.peers.coordination {
                Coordination::Lease => true,
                Coordination::Probes => false,
                Coordination::Auto => self.peers.service.is_some() || self.discovers_workers(),
            }
    }

    /// The drain Lease's settings: its name (`peers.lease_name`, else `<peers.service>-drains`,
    /// else `kv-epp-drains`) in the pod's namespace, and its timing.
    pub fn drain_lease_settings(&self) -> crate::replica::lease::LeaseSettings {
        let p = &self.peers;
        let name = match (&p.lease_name, &p.service) {
            (Some(n), _) => n.clone(),
            (None, Some(svc)) => format!("{svc}-drains"),
            (None, None) => "kv-epp-drains".to_owned(),
        };
        crate::replica::lease::LeaseSettings {
            name,
            namespace: self.peers_namespace().to_owned(),
            duration_seconds: p.lease_duration_seconds,
            renew: Duration::from_millis(p.lease_renew_ms),
        }
    }

    /// The namespace of kv-epp's own peer Service: `pool.namespace`, else `default`.
    pub(crate) fn peers_namespace(&self) -> &str {
        if self.pool.namespace.is_empty() {
            "default"
        } else {
            &self.pool.namespace
        }
    }

    /// The name peers' certificates must be valid for: `peers.server_name`, else the peer
    /// Service's cluster name, else the host of `peers.dns`.
    pub(crate) fn peer_server_name(&self) -> Option<String> {
        let p = &self.peers;
        if let Some(n) = &p.server_name {
            return Some(n.clone());
        }
        if let Some(svc) = &p.service {
            return Some(format!("{svc}.{}.svc", self.peers_namespace()));
        }
        let (host, _) = p.dns.as_deref()?.rsplit_once(':')?;
        Some(
            host.trim_start_matches('[')
                .trim_end_matches(']')
                .to_owned(),
        )
    }

    /// Where a worker publishes KV events (`None` when events are off).
    pub(crate) fn feed_endpoints(
        &self,
        worker: &WorkerId,
        overrides: Option<&StaticWorker>,
    ) -> Option<crate::events::subscriber::FeedEndpoints> {
        let dialect = match (self.events.engine, self.events.trtllm.transport) {
            (EventEngine::Vllm, _) => crate::events::vllm::Dialect::Vllm,
            (EventEngine::Sglang, _) => crate::events::vllm::Dialect::Sglang,
            (EventEngine::Trtllm, TrtllmTransport::Zmq) => crate::events::vllm::Dialect::Trtllm,
            (EventEngine::Trtllm, TrtllmTransport::Http) | (EventEngine::None, _) => return None,
        };
        let z = &self.events.zmq;
        let host = match worker.endpoint.ip() {
            IpAddr::V6(v6) => format!("[{v6}]"),
            IpAddr::V4(v4) => v4.to_string(),
        };
        let rank = u16::try_from(worker.dp_rank).unwrap_or(u16::MAX);
        let events = overrides
            .and_then(|w| w.events_endpoint.clone())
            .unwrap_or_else(|| format!("tcp://{host}:{}", z.port.saturating_add(rank)));
        let replay = overrides
            .and_then(|w| w.replay_endpoint.clone())
            .or_else(|| {
                (z.replay_port != 0)
                    .then(|| format!("tcp://{host}:{}", z.replay_port.saturating_add(rank)))
            });
        Some(crate::events::subscriber::FeedEndpoints {
            events,
            replay,
            topic: z.topic.clone(),
            dialect,
        })
    }
}

/// Why a configuration was refused.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The file could not be read.
    #[error("cannot read config file {path}: {source}")]
    Read {
        /// The path.
        path: String,
        /// The cause.
        source: std::io::Error,
    },
    /// The file is not valid YAML for this schema.
    #[error("config file {path}: {message}")]
    Parse {
        /// The path.
        path: String,
        /// serde's message (names the field and position).
        message: String,
    },
    /// A value is out of range or inconsistent.
    #[error("invalid configuration: {0}")]
    Invalid(String),
    /// A secret file the configuration names could not be read.
    #[error("{field} {path}: {source}")]
    Secret {
        /// The field naming the file.
        field: &'static str,
        /// The path.
        path: String,
        /// The cause.
        source: std::io::Error,
    },
}

impl Config {
    /// Reads and parses a YAML file (not yet validated).
    pub fn from_file(path: &Path) -> Result<Config, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: path.display().to_string(),
            source,
        })?;
        Self::from_yaml(&text).map_err(|e| match e {
            ConfigError::Parse { message, .. } => ConfigError::Parse {
                path: path.display().to_string(),
                message,
            },
            other => other,
        })
    }

    /// Reads the secret files the configuration names into their values (today
    /// `salt.fingerprint_key_file` → `salt.fingerprint_key`, trimmed). Every command that
    /// computes what the server computes (`serve`, `tokenize`) calls this, so fingerprints agree.
    pub fn read_secret_files(&mut self) -> Result<(), ConfigError> {
        if let Some(path) = self.salt.fingerprint_key_file.take() {
            let key = std::fs::read_to_string(&path).map_err(|source| ConfigError::Secret {
                field: "salt.fingerprint_key_file",
                path: path.display().to_string(),
                source,
            })?;
            self.salt.fingerprint_key = Some(key.trim().to_owned());
        }
        Ok(())
    }

    /// Parses YAML text (not yet validated).
    pub fn from_yaml(text: &str) -> Result<Config, ConfigError> {
        serde_yaml::from_str(text).map_err(|e| ConfigError::Parse {
            path: "<inline>".into(),
            message: e.to_string(),
        })
    }

    /// Checks every value; the error names the field.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let bad = |m: String| Err(ConfigError::Invalid(m));
        let s = &self.server;
        let ports = [
            ("server.grpc_port", s.grpc_port),
            ("server.grpc_health_port", s.grpc_health_port),
            ("server.metrics_port", s.metrics_port),
            ("server.admin_port", s.admin_port),
            (
                "peers.port",
                if self.peers.enabled() {
                    self.peers.port
                } else {
                    0
                },
            ),
        ];
        for (i, (a, pa)) in ports.iter().enumerate() {
            for (b, pb) in &ports[i + 1..] {
                if pa == pb && *pa != 0 {
                    return bad(format!("{a} and {b} are both {pa}"));
                }
            }
        }
        if s.metrics_token_file.is_some() && !s.metrics_auth {
            return bad("server.metrics_token_file is set but server.metrics_auth is false".into());
        }
        if s.cert_path.is_some() && !s.secure_serving {
            return bad("server.cert_path is set but server.secure_serving is false".into());
        }
        if s.client_ca_path.is_some() && !s.secure_serving {
            return bad("server.client_ca_path is set but server.secure_serving is false".into());
        }
        if s.self_signed_cert_dir.is_some() {
            if !s.secure_serving {
                return bad(
                    "server.self_signed_cert_dir is set but server.secure_serving is false".into(),
                );
            }
            if s.cert_path.is_some() {
                return bad(
                    "set server.cert_path or server.self_signed_cert_dir, not both (the first serves a mounted certificate, the second keeps a generated one)".into(),
                );
            }
        }
        if self.events.max_message_bytes < 64 << 10 {
            return bad("events.max_message_bytes must be at least 65536".into());
        }
        if self.events.trtllm.poll_interval_ms == 0 {
            return bad("events.trtllm.poll_interval_ms must be > 0".into());
        }
        let em = &self.engine_metrics;
        if em.interval_ms > 0 && em.stale_after_ms < em.interval_ms {
            return bad(
                "engine_metrics.stale_after_ms must be ≥ engine_metrics.interval_ms".into(),
            );
        }
        let p = &self.peers;
        if p.enabled() {
            if p.probe_interval_ms == 0 || p.snapshot_chunk_blocks == 0 || p.relay_log_batches == 0
            {
                return bad(
                    "peers.probe_interval_ms, peers.snapshot_chunk_blocks and peers.relay_log_batches must be > 0"
                        .into(),
                );
            }
            if p.max_message_bytes < 64 << 10 {
                return bad("peers.max_message_bytes must be at least 65536".into());
            }
            // A chunk's entries are ~21 bytes each on the wire.
            if (p.snapshot_chunk_blocks as usize).saturating_mul(24) + 1024 > p.max_message_bytes {
                return bad(format!(
                    "peers.snapshot_chunk_blocks ({}) does not fit in peers.max_message_bytes ({})",
                    p.snapshot_chunk_blocks, p.max_message_bytes
                ));
            }
            if p.token_file.is_none() && !p.insecure_allow_anonymous {
                return bad(
                    "peers: replication is on (peers.static_peers, peers.dns or peers.service is set) but peers.token_file (--peer-token-file) is not, so the peer API would serve the whole index to anyone who reaches peers.port; set peers.token_file to a file holding a shared token, or set peers.insecure_allow_anonymous: true to run it unauthenticated on purpose".into(),
                );
            }
            if p.cert_path.is_some() {
                let Some(name) = self.peer_server_name() else {
                    return bad(
                        "peers.server_name is required with peers.cert_path when peers come from peers.static_peers alone: the name the peers' certificates are issued for (they are dialled by IP)".into(),
                    );
                };
                if let Err(e) = crate::tls::server_name(&name) {
                    return bad(format!("peers.server_name: {e}"));
                }
            }
            if self.drain_lease() {
                if !(1..=300).contains(&p.lease_duration_seconds) {
                    return bad("peers.lease_duration_seconds must be within 1..=300".into());
                }
                if p.lease_renew_ms < 100
                    || p.lease_renew_ms.saturating_mul(3)
                        > u64::from(p.lease_duration_seconds) * 1000
                {
                    return bad(format!(
                        "peers.lease_renew_ms ({}) must be at least 100 and at most a third of peers.lease_duration_seconds ({} s)",
                        p.lease_renew_ms, p.lease_duration_seconds
                    ));
                }
                let name = self.drain_lease_settings().name;
                let ok = !name.is_empty()
                    && name.len() <= 253
                    && name.split('.').all(|l| {
                        !l.is_empty()
                            && l.bytes()
                                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
                            && !l.starts_with('-')
                            && !l.ends_with('-')
                    });
                if !ok {
                    return bad(format!(
                        "peers.lease_name `{name}` is not a Kubernetes object name (lowercase letters, digits, '-' and '.')"
                    ));
                }
            }
            for (i, a) in p.static_peers.iter().chain(p.dns.iter()).enumerate() {
                if a.rsplit_once(':')
                    .and_then(|(_, port)| port.parse::<u16>().ok())
                    .is_none()
                {
                    return bad(format!("peers: `{a}` (entry {i}) must be host:port"));
                }
            }
        }
        if self.routing.max_body_bytes == 0 {
            return bad("routing.max_body_bytes must be > 0".into());
        }
        if let Err(e) = self.flow_control.settings() {
            return bad(e);
        }
        if self.routing.stream_idle_timeout_ms == 0 {
            return bad("routing.stream_idle_timeout_ms must be > 0".into());
        }
        if self.routing.max_buffered_body_bytes < self.routing.max_body_bytes {
            return bad(format!(
                "routing.max_buffered_body_bytes ({}) must be at least routing.max_body_bytes ({})",
                self.routing.max_buffered_body_bytes, self.routing.max_body_bytes
            ));
        }
        if self.server.max_concurrent_streams == 0 {
            return bad("server.max_concurrent_streams must be > 0".into());
        }
        if self.server.io_threads > MAX_IO_THREADS {
            return bad(format!(
                "server.io_threads must be at most {MAX_IO_THREADS} (0 = one per core)"
            ));
        }
        if self.server.keepalive_interval_ms > 0 && self.server.keepalive_timeout_ms == 0 {
            return bad(
                "server.keepalive_timeout_ms must be > 0 when keepalive_interval_ms is set".into(),
            );
        }
        self.scoring.validate().map_err(ConfigError::Invalid)?;
        if self.salt.sources.is_empty() && self.salt.required {
            return bad("salt.required is true but salt.sources is empty".into());
        }
        if self.index.capacity == 0 || self.index.max_blocks_per_worker == 0 {
            return bad("index.capacity and index.max_blocks_per_worker must be > 0".into());
        }
        let mut names = std::collections::HashSet::new();
        for (i, m) in self.models.iter().enumerate() {
            if m.name.is_empty() {
                return bad(format!("models[{i}].name is empty"));
            }
            if m.block_size == 0 {
                return bad(format!("models[{i}].block_size must be > 0"));
            }
            for name in std::iter::once(&m.name).chain(&m.lora_adapters) {
                if !names.insert(name.as_str()) {
                    return bad(format!(
                        "models[{i}]: name `{name}` is configured twice (models and LoRA adapters share one namespace)"
                    ));
                }
            }
        }
        if self.salt.fingerprint_key.is_some() && self.salt.fingerprint_key_file.is_some() {
            return bad("set salt.fingerprint_key or salt.fingerprint_key_file, not both".into());
        }
        if self.discovers_workers() {
            if self.pool.namespace.is_empty() {
                return bad(
                    "pool.namespace is empty: set it, --pool-namespace or $NAMESPACE (pool.name is set and no static workers are listed, so workers are discovered from the pool)".into(),
                );
            }
            if self.pool.api_unreachable_timeout_ms == 0 {
                return bad("pool.api_unreachable_timeout_ms must be > 0".into());
            }
            if self.models.len() > 1 && self.pool.model_label.is_empty() {
                return bad(
                    "pool.model_label is empty but several models are configured: discovered pods need a label naming their model".into(),
                );
            }
        }
        let mut seen = std::collections::HashSet::new();
        for (i, w) in self.workers.iter().enumerate() {
            for (field, ep) in [
                ("events_endpoint", &w.events_endpoint),
                ("replay_endpoint", &w.replay_endpoint),
            ] {
                if let Some(ep) = ep
                    && !ep.starts_with("tcp://")
                {
                    return bad(format!(
                        "workers[{i}].{field} must be tcp://host:port, got `{ep}`"
                    ));
                }
            }
            if !self.models.iter().any(|m| m.name == w.model) {
                return bad(format!(
                    "workers[{i}].model `{}` is not one of models[].name",
                    w.model
                ));
            }
            if !seen.insert(w.id()) {
                return bad(format!("workers[{i}]: {} is listed twice", w.id()));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const EXAMPLE: &str = include_str!("../deploy/examples/kv-epp.yaml");

    #[test]
    fn example_file_parses_and_validates() {
        let c = Config::from_yaml(EXAMPLE).unwrap();
        c.validate().unwrap();
        assert_eq!(c.server.grpc_port, 9002);
        assert!(!c.models.is_empty() && !c.workers.is_empty());
    }

    #[test]
    fn defaults_follow_the_reference_ports() {
        let c = Config::from_yaml("{}").unwrap();
        assert_eq!(
            (
                c.server.grpc_port,
                c.server.grpc_health_port,
                c.server.metrics_port
            ),
            (9002, 9003, 9090)
        );
        assert_eq!(c.routing.fallbacks, 0);
    }

    #[test]
    fn errors_name_the_field() {
        let e = Config::from_yaml("routing: {max_body_byts: 3}").unwrap_err();
        assert!(e.to_string().contains("max_body_byts"), "{e}");
        let c = Config::from_yaml(
            "models: [{name: m, block_size: 16}]\nworkers: [{endpoint: '10.0.0.1:8000', model: x}]",
        )
        .unwrap();
        assert!(
            c.validate()
                .unwrap_err()
                .to_string()
                .contains("workers[0].model")
        );
        let c = Config::from_yaml("models: [{name: m, block_size: 0}]").unwrap();
        assert!(
            c.validate()
                .unwrap_err()
                .to_string()
                .contains("models[0].block_size")
        );
        let c = Config::from_yaml("scoring: {offload_credit: 3}").unwrap();
        assert!(
            c.validate()
                .unwrap_err()
                .to_string()
                .contains("offload_credit")
        );
        let c = Config::from_yaml("server: {grpc_port: 9090}").unwrap();
        assert!(
            c.validate()
                .unwrap_err()
                .to_string()
                .contains("server.grpc_port")
        );
        let c = Config::from_yaml("salt: {sources: [header], required: true, fingerprint_key: k}")
            .unwrap();
        c.validate().unwrap();
        assert!(c.salt.required);
        assert!(Config::from_yaml("salt: {sources: [cookie]}").is_err());
    }

    #[test]
    fn tls_settings_need_tls_and_do_not_contradict() {
        let err = |yaml: &str| {
            Config::from_yaml(yaml)
                .unwrap()
                .validate()
                .unwrap_err()
                .to_string()
        };
        let e = err("server: {client_ca_path: /ca.crt}");
        assert!(
            e.contains("server.client_ca_path") && e.contains("secure_serving"),
            "{e}"
        );
        let e = err("server: {self_signed_cert_dir: /d}");
        assert!(e.contains("server.self_signed_cert_dir"), "{e}");
        let e = err("server: {secure_serving: true, cert_path: /c, self_signed_cert_dir: /d}");
        assert!(e.contains("not both"), "{e}");
        Config::from_yaml("server: {secure_serving: true, cert_path: /c, client_ca_path: /ca.crt}")
            .unwrap()
            .validate()
            .unwrap();
    }

    #[test]
    fn peers_are_never_anonymous_by_accident() {
        let c = Config::from_yaml("peers: {static_peers: ['10.0.0.5:9004']}").unwrap();
        let e = c.validate().unwrap_err().to_string();
        for field in [
            "peers.token_file",
            "--peer-token-file",
            "peers.insecure_allow_anonymous",
        ] {
            assert!(e.contains(field), "{field} in {e}");
        }
        Config::from_yaml(
            "peers: {static_peers: ['10.0.0.5:9004'], insecure_allow_anonymous: true}",
        )
        .unwrap()
        .validate()
        .unwrap();
        Config::from_yaml("peers: {static_peers: ['10.0.0.5:9004'], token_file: /t}")
            .unwrap()
            .validate()
            .unwrap();
        // No peers, no replication: nothing to authenticate.
        Config::from_yaml("{}").unwrap().validate().unwrap();
    }

    #[test]
    fn a_lease_decides_drains_on_kubernetes_and_probes_elsewhere() {
        let on_k8s = Config::from_yaml(
            "pool: {namespace: ai}\npeers: {service: kv-epp-peers, token_file: /t}",
        )
        .unwrap();
        on_k8s.validate().unwrap();
        assert!(on_k8s.drain_lease(), "auto with a peer Service");
        let s = on_k8s.drain_lease_settings();
        assert_eq!(
            (s.name.as_str(), s.namespace.as_str(), s.duration_seconds),
            ("kv-epp-peers-drains", "ai", 10)
        );
        assert_eq!(s.renew, Duration::from_secs(2));
        let static_peers = "peers: {static_peers: ['10.0.0.5:9004'], token_file: /t";
        let c = Config::from_yaml(&format!("{static_peers}}}")).unwrap();
        assert!(!c.drain_lease(), "auto without Kubernetes: probes");
        let c = Config::from_yaml(&format!("{static_peers}, coordination: lease}}")).unwrap();
        assert!(c.drain_lease());
        assert_eq!(c.drain_lease_settings().name, "kv-epp-drains");
        let c = Config::from_yaml(
            "pool: {namespace: ai}\npeers: {service: s, token_file: /t, coordination: probes}",
        )
        .unwrap();
        assert!(!c.drain_lease());
        for (extra, field) in [
            ("lease_duration_seconds: 0", "peers.lease_duration_seconds"),
            ("lease_renew_ms: 4000", "peers.lease_renew_ms"),
            ("lease_renew_ms: 50", "peers.lease_renew_ms"),
            ("lease_name: Drains_1", "peers.lease_name"),
        ] {
            let c = Config::from_yaml(&format!("{static_peers}, coordination: lease, {extra}}}"))
                .unwrap();
            let e = c.validate().unwrap_err().to_string();
            assert!(e.contains(field), "{extra}: {e}");
        }
        assert!(Config::from_yaml("peers: {coordination: raft}").is_err());
    }

    #[test]
    fn peer_certificates_are_checked_against_a_name() {
        let c = Config::from_yaml(
            "pool: {namespace: ai}\npeers: {service: kv-epp-peers, token_file: /t, cert_path: /p}",
        )
        .unwrap();
        c.validate().unwrap();
        assert_eq!(c.peer_server_name().as_deref(), Some("kv-epp-peers.ai.svc"));
        let c =
            Config::from_yaml("peers: {dns: 'peers.example:9004', token_file: /t, cert_path: /p}")
                .unwrap();
        assert_eq!(c.peer_server_name().as_deref(), Some("peers.example"));
        let c = Config::from_yaml(
            "peers: {static_peers: ['10.0.0.5:9004'], token_file: /t, cert_path: /p}",
        )
        .unwrap();
        let e = c.validate().unwrap_err().to_string();
        assert!(e.contains("peers.server_name is required"), "{e}");
        let c = Config::from_yaml(
            "peers: {static_peers: ['10.0.0.5:9004'], token_file: /t, cert_path: /p, server_name: 'not a name'}",
        )
        .unwrap();
        let e = c.validate().unwrap_err().to_string();
        assert!(
            e.contains("peers.server_name") && e.contains("not a name"),
            "{e}"
        );
    }

    #[test]
    fn discovery_runs_only_without_static_workers_and_needs_a_namespace() {
        let c = Config::from_yaml("pool: {name: p}").unwrap();
        assert!(c.discovers_workers());
        let e = c.validate().unwrap_err().to_string();
        assert!(e.contains("pool.namespace"), "{e}");
        let c = Config::from_yaml("pool: {name: p, namespace: n, api_version: v1alpha2}").unwrap();
        c.validate().unwrap();
        assert_eq!(c.pool.api_version, PoolApiVersion::V1alpha2);
        assert_eq!(c.pool.model_label, DEFAULT_MODEL_LABEL);
        let c = Config::from_yaml("pool: {name: p, namespace: n, api_unreachable_timeout_ms: 0}")
            .unwrap();
        let e = c.validate().unwrap_err().to_string();
        assert!(e.contains("pool.api_unreachable_timeout_ms"), "{e}");
        let c = Config::from_yaml(EXAMPLE).unwrap();
        assert!(!c.discovers_workers(), "static workers turn discovery off");
        assert!(Config::from_yaml("pool: {api_version: v2}").is_err());
    }

    #[test]
    fn stream_limits_default_to_production_values_and_are_validated() {
        let c = Config::default();
        assert_eq!(c.routing.stream_idle_timeout_ms, 30_000);
        assert_eq!(c.routing.max_buffered_body_bytes, 256 << 20);
        assert_eq!(c.server.max_concurrent_streams, 1024);
        assert_eq!(c.server.io_threads, 0);
        assert_eq!(
            (
                c.server.keepalive_interval_ms,
                c.server.keepalive_timeout_ms
            ),
            (30_000, 10_000)
        );
        for (yaml, field) in [
            (
                "routing: {stream_idle_timeout_ms: 0}",
                "routing.stream_idle_timeout_ms",
            ),
            (
                "routing: {max_body_bytes: 100, max_buffered_body_bytes: 99}",
                "routing.max_buffered_body_bytes",
            ),
            (
                "server: {max_concurrent_streams: 0}",
                "server.max_concurrent_streams",
            ),
            (
                "server: {keepalive_timeout_ms: 0}",
                "server.keepalive_timeout_ms",
            ),
            ("server: {io_threads: 100000}", "server.io_threads"),
        ] {
            let e = Config::from_yaml(yaml)
                .unwrap()
                .validate()
                .unwrap_err()
                .to_string();
            assert!(e.contains(field), "{yaml}: {e}");
        }
        Config::from_yaml("server: {keepalive_interval_ms: 0, keepalive_timeout_ms: 0}")
            .unwrap()
            .validate()
            .unwrap();
    }
}
