//! Prometheus metrics, exposed as text on the metrics port.
//!
//! Label values are model names, worker endpoints, outcomes and salt *fingerprints*; never a raw
//! salt or tenant id.

use std::sync::atomic::AtomicU64;

use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

pub(crate) type Labels = Vec<(String, String)>;

/// Every metric kv-epp exports.
pub struct Metrics {
    registry: Registry,
    /// Requests by model and outcome (`decide::ROUTED`, `decide::TOKENIZE_FAILED`, or a
    /// `decide::Reject::outcome`; the set is listed in README.md).
    pub requests: Family<Labels, Counter>,
    /// Time from the end of the request body (or headers) to the decision, not counting time
    /// spent in flow control's queue (`flow.wait_seconds`).
    pub decision_seconds: Histogram,
    /// Prompt blocks of routed requests, by model.
    pub prompt_blocks: Family<Labels, Counter>,
    /// Prompt blocks the chosen worker already held (device + credited offload), by model.
    pub cached_blocks: Family<Labels, Counter>,
    /// Requests in flight per worker, as booked by kv-epp.
    pub inflight: Family<Labels, Gauge>,
    /// Streams that ended with an error, by kind.
    pub stream_errors: Family<Labels, Counter>,
    /// Request body bytes buffered across all ext_proc streams, waiting for their decision.
    pub buffered_body_bytes: Gauge,
    /// Index holder tables and wide records replaced but not yet freed, process-wide (see
    /// `upkeep`).
    pub index_retired_tables: Gauge,
    /// Threads running the ports' connections (the async runtime's workers; `server.io_threads`).
    pub io_threads: Gauge,
    /// Token usage reported in responses, by model and kind (prompt, completion, cached).
    pub tokens: Family<Labels, Counter>,
    /// Responses whose served endpoint differed from the one picked.
    pub served_mismatch: Counter,
    /// Pods of the InferencePool that would be endpoints but were skipped, by reason.
    pub discovery_skipped_pods: Family<Labels, Gauge>,
    /// 1 once this replica's index is complete (bootstrapped or started empty), else 0.
    pub replica_ready: Gauge,
    /// Peers answering probes, by state (`ready`, `starting`).
    pub replica_peers: Family<Labels, Gauge>,
    /// Relayed batches by kind (`originated`, `applied`, `duplicate`, `reset`, `caught_up`,
    /// `unplaced`, `fenced`, `foreign`).
    pub replica_relay_batches: Family<Labels, Counter>,
    /// Index snapshots served to peers.
    pub replica_snapshots_served: Counter,
    /// Block entries restored from a peer's snapshot.
    pub replica_blocks_restored: Counter,
    /// Encoded bytes of snapshots received.
    pub replica_snapshot_bytes: Counter,
    /// Peer API calls refused for a missing or wrong token.
    pub replica_unauthenticated: Counter,
    /// Probes of this replica that a peer refused for its token.
    pub replica_refused_by_peers: Counter,
    /// Peers' claims and relayed batches refused for an ownership epoch no replica can reach.
    pub replica_epochs_refused: Counter,
    /// Peers' claims on workers outside this replica's pool not tracked (too many such workers).
    pub replica_claims_untracked: Counter,
    /// Admin API requests refused, by reason (`missing`, `malformed`, `invalid_token`).
    pub admin_unauthenticated: Family<Labels, Counter>,
    /// Metrics scrapes refused, by reason (`missing`, `malformed`, `invalid_token`,
    /// `forbidden`, `unavailable`).
    pub metrics_unauthenticated: Family<Labels, Counter>,
    /// TLS material re-read from disk, by listener (`ext_proc`, `peer`) and outcome
    /// (`reloaded`, `failed`: the previous certificate stays).
    pub tls_reloads: Family<Labels, Counter>,
    /// TLS handshakes refused or timed out, by listener (e.g. a client without an accepted
    /// certificate).
    pub tls_handshake_failures: Family<Labels, Counter>,
    /// Requests kv-epp could not render exactly as the engine would, by model and `reason`
    /// (`kv_epp_tokenize::Unrenderable` labels); routed on load alone, or refused under
    /// `routing.unrenderable: reject`.
    pub unrenderable: Family<Labels, Counter>,
    /// (model, reason) pairs already logged: each is logged once per process.
    unrenderable_logged: parking_lot::Mutex<std::collections::HashSet<(String, &'static str)>>,
    /// Salted requests routed to workers whose events carry no salt (`events.salted_events:
    /// false`: older SGLang, TensorRT-LLM over ZeroMQ), by model: routed without isolation.
    pub unisolated_salted_requests: Family<Labels, Counter>,
    /// Flow control: queue length, wait time, admitted and refused by tenant (bounded labels).
    pub flow: std::sync::Arc<crate::flow::FlowMetrics>,
    /// The drain Lease's gauge and events (`peers.coordination: lease`).
    pub replica_lease: std::sync::Arc<crate::replica::lease::LeaseMetrics>,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    /// Registers every family.
    pub fn new() -> Self {
        let mut registry = Registry::with_prefix("kv_epp");
        let requests = Family::<Labels, Counter>::default();
        registry.register(
            "requests",
            "Requests by model and outcome",
            requests.clone(),
        );
        let decision_seconds = Histogram::new(exponential_buckets(0.000_01, 2.0, 20));
        registry.register(
            "decision_seconds",
            "Time to decide a request once its body is complete (not counting time queued by flow control)",
            decision_seconds.clone(),
        );
        let prompt_blocks = Family::<Labels, Counter>::default();
        registry.register(
            "prompt_blocks",
            "Prompt blocks of routed requests",
            prompt_blocks.clone(),
        );
        let cached_blocks = Family::<Labels, Counter>::default();
        registry.register(
            "cached_blocks",
            "Prompt blocks already held by the chosen worker (prefix-hit ratio = cached/prompt)",
            cached_blocks.clone(),
        );
        let inflight = Family::<Labels, Gauge>::default();
        registry.register(
            "inflight_requests",
            "Requests in flight per worker as booked by kv-epp",
            inflight.clone(),
        );
        let stream_errors = Family::<Labels, Counter>::default();
        registry.register(
            "stream_errors",
            "ext_proc streams that ended with an error",
            stream_errors.clone(),
        );
        let buffered_body_bytes = Gauge::default();
        registry.register(
            "buffered_body_bytes",
            "Request body bytes buffered across all ext_proc streams before their decision",
            buffered_body_bytes.clone(),
        );
        let index_retired_tables = Gauge::default();
        registry.register(
            "index_retired_tables",
            "Index tables and wide records replaced and not yet freed (freed once no query can still read them)",
            index_retired_tables.clone(),
        );
        let io_threads = Gauge::default();
        registry.register(
            "io_threads",
            "Threads running the ports' connections (server.io_threads; 0 there means one per core)",
            io_threads.clone(),
        );
        let tokens = Family::<Labels, Counter>::default();
        registry.register(
            "usage_tokens",
            "Token usage reported by engines in responses",
            tokens.clone(),
        );
        let served_mismatch = Counter::<u64, AtomicU64>::default();
        registry.register(
            "served_endpoint_mismatch",
            "Responses served by an endpoint other than the one picked",
            served_mismatch.clone(),
        );
        let discovery_skipped_pods = Family::<Labels, Gauge>::default();
        registry.register(
            "discovery_skipped_pods",
            "Ready pods of the InferencePool skipped by discovery (bad IP, missing or unknown model label)",
            discovery_skipped_pods.clone(),
        );
        let replica_ready = Gauge::default();
        registry.register(
            "replica_ready",
            "1 once this replica's index is complete (bootstrapped from a peer or started empty)",
            replica_ready.clone(),
        );
        let replica_peers = Family::<Labels, Gauge>::default();
        registry.register(
            "replica_peers",
            "Peer replicas answering probes, by state",
            replica_peers.clone(),
        );
        let replica_relay_batches = Family::<Labels, Counter>::default();
        registry.register(
            "replica_relay_batches",
            "Relayed event batches of single-reader sources, by kind",
            replica_relay_batches.clone(),
        );
        let replica_snapshots_served = Counter::default();
        registry.register(
            "replica_snapshots_served",
            "Index snapshots served to peers",
            replica_snapshots_served.clone(),
        );
        let replica_blocks_restored = Counter::default();
        registry.register(
            "replica_blocks_restored",
            "Block entries restored from a peer's snapshot",
            replica_blocks_restored.clone(),
        );
        let replica_snapshot_bytes = Counter::default();
        registry.register(
            "replica_snapshot_bytes",
            "Encoded bytes of index snapshots received from peers",
            replica_snapshot_bytes.clone(),
        );
        let replica_unauthenticated = Counter::default();
        registry.register(
            "replica_unauthenticated",
            "Peer API calls refused for a missing or wrong token",
            replica_unauthenticated.clone(),
        );
        let replica_refused_by_peers = Counter::default();
        registry.register(
            "replica_refused_by_peers",
            "Probes of this replica that a peer refused for a wrong token (peers.token_file differs)",
            replica_refused_by_peers.clone(),
        );
        let replica_epochs_refused = Counter::default();
        registry.register(
            "replica_epochs_refused",
            "Peers' claims and relayed batches refused for an ownership epoch out of range",
            replica_epochs_refused.clone(),
        );
        let replica_claims_untracked = Counter::default();
        registry.register(
            "replica_claims_untracked",
            "Peers' claims on workers outside this replica's pool not tracked: as many such workers were already",
            replica_claims_untracked.clone(),
        );
        let admin_unauthenticated = Family::<Labels, Counter>::default();
        registry.register(
            "admin_unauthenticated",
            "Admin API requests refused for a missing, malformed or wrong bearer token, by reason",
            admin_unauthenticated.clone(),
        );
        let metrics_unauthenticated = Family::<Labels, Counter>::default();
        registry.register(
            "metrics_unauthenticated",
            "Metrics scrapes refused (no, malformed or invalid bearer token; forbidden; token review unavailable), by reason",
            metrics_unauthenticated.clone(),
        );
        let tls_reloads = Family::<Labels, Counter>::default();
        registry.register(
            "tls_reloads",
            "TLS certificates, keys and CAs re-read after they changed on disk, by listener and outcome",
            tls_reloads.clone(),
        );
        let tls_handshake_failures = Family::<Labels, Counter>::default();
        registry.register(
            "tls_handshake_failures",
            "TLS handshakes refused or timed out, by listener",
            tls_handshake_failures.clone(),
        );
        let unrenderable = Family::<Labels, Counter>::default();
        registry.register(
            "unrenderable",
            "Requests kv-epp could not render exactly as the engine would, by model and reason",
            unrenderable.clone(),
        );
        let unisolated_salted_requests = Family::<Labels, Counter>::default();
        registry.register(
            "unisolated_salted_requests",
            "Salted requests routed to workers whose KV events carry no salt (no tenant isolation in routing), by model",
            unisolated_salted_requests.clone(),
        );
        let flow = std::sync::Arc::new(crate::flow::FlowMetrics::register(&mut registry));
        let replica_lease =
            std::sync::Arc::new(crate::replica::lease::LeaseMetrics::register(&mut registry));
        Metrics {
            flow,
            replica_lease,
            registry,
            unrenderable,
            unrenderable_logged: Default::default(),
            unisolated_salted_requests,
            admin_unauthenticated,
            metrics_unauthenticated,
            tls_reloads,
            tls_handshake_failures,
            replica_ready,
            replica_peers,
            replica_relay_batches,
            replica_snapshots_served,
            replica_blocks_restored,
            replica_snapshot_bytes,
            replica_unauthenticated,
            replica_refused_by_peers,
            replica_epochs_refused,
            replica_claims_untracked,
            requests,
            decision_seconds,
            prompt_blocks,
            cached_blocks,
            inflight,
            stream_errors,
            buffered_body_bytes,
            index_retired_tables,
            io_threads,
            tokens,
            served_mismatch,
            discovery_skipped_pods,
        }
    }

    /// A registry that also exports every event feed's counters (per worker) on each scrape.
    pub fn with_event_feeds(feeds: std::sync::Arc<crate::events::Feeds>) -> Self {
        let mut m = Self::new();
        m.registry
            .register_collector(Box::new(FeedCollector(feeds)));
        m
    }

    /// Label set helper.
    pub fn labels(pairs: &[(&str, &str)]) -> Labels {
        pairs
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect()
    }

    /// Counts one request outcome.
    pub fn request(&self, model: &str, outcome: &str) {
        self.requests
            .get_or_create(&Self::labels(&[("model", model), ("outcome", outcome)]))
            .inc();
    }

    /// Counts a request kv-epp could not render exactly (`reason`) and says whether this is
    /// the first for its (model, reason), which the caller logs. The set is bounded: models are
    /// configured names (or `unknown`) and reasons a closed list.
    pub fn unrenderable(&self, model: &str, reason: &'static str) -> bool {
        self.unrenderable
            .get_or_create(&Self::labels(&[("model", model), ("reason", reason)]))
            .inc();
        self.unrenderable_logged
            .lock()
            .insert((model.to_owned(), reason))
    }

    /// The text exposition.
    pub fn encode(&self) -> String {
        let mut out = String::new();
        // Writing into a String cannot fail.
        let _ = encode(&mut out, &self.registry);
        out
    }
}

/// Exports each event feed's counters at scrape time, so a feed that stops takes its series
/// with it.
struct FeedCollector(std::sync::Arc<crate::events::Feeds>);

impl std::fmt::Debug for FeedCollector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("FeedCollector")
    }
}

impl prometheus_client::collector::Collector for FeedCollector {
    fn encode(
        &self,
        mut encoder: prometheus_client::encoding::DescriptorEncoder,
    ) -> Result<(), std::fmt::Error> {
        use prometheus_client::encoding::EncodeMetric;
        use std::sync::atomic::Ordering::Relaxed;
        let counters: [(&str, &str); 5] = [
            ("batches", "KV event batches applied, by worker"),
            (
                "events",
                "KV events of applied batches, by worker and outcome (applied; foreign_namespace: stored, never credited)",
            ),
            (
                "dropped",
                "KV event messages and events dropped, by worker and reason",
            ),
            (
                "sequence",
                "KV event sequence incidents, by worker and kind (gap, replayed, unfillable, restart)",
            ),
            (
                "connection_errors",
                "KV event connections that failed or ended, by worker, socket (events, replay) and reason (oversize: a message over events.max_message_bytes was refused)",
            ),
        ];
        let families: Vec<Family<Labels, Counter>> =
            counters.iter().map(|_| Family::default()).collect();
        let connected = Family::<Labels, Gauge>::default();
        let cold = Family::<Labels, Gauge>::default();
        for (worker, _, st) in self.0.statuses() {
            let worker = worker.to_string();
            for (family, labels, n) in st.counts() {
                let Some(i) = counters.iter().position(|(name, _)| *name == family) else {
                    continue;
                };
                let mut set = Metrics::labels(&labels);
                set.insert(0, ("worker".into(), worker.clone()));
                families[i].get_or_create(&set).inc_by(n);
            }
            let set = Metrics::labels(&[("worker", &worker)]);
            connected
                .get_or_create(&set)
                .set(i64::from(st.connected.load(Relaxed)));
            cold.get_or_create(&set)
                .set(i64::from(st.cold.load(Relaxed)));
        }
        for ((name, help), family) in counters.iter().zip(&families) {
            let name = format!("event_{name}");
            family.encode(encoder.encode_descriptor(&name, help, None, family.metric_type())?)?;
        }
        connected.encode(encoder.encode_descriptor(
            "event_feed_connected",
            "1 while the worker's KV event publisher is connected",
            None,
            connected.metric_type(),
        )?)?;
        cold.encode(encoder.encode_descriptor(
            "event_feed_cold",
            "1 while the worker's KV state was dropped and no fresh event has arrived",
            None,
            cold.metric_type(),
        )?)?;
        Ok(())
    }
}
