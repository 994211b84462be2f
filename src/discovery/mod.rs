//! Kubernetes discovery: the InferencePool's pods become workers, and a Service's EndpointSlices
//! become peer addresses. This is the only module that talks to the Kubernetes API.
//!
//! - `pool.rs`: the InferencePool's selector and target ports (v1, or v1alpha2 as a fallback).
//! - `endpoints.rs`: pods → desired workers (Ready, not terminating, with an IP; one worker per
//!   target port, rank = port index; model from the single model or a pod label). Pure.
//! - `watch.rs`: the watch loop that feeds [`crate::membership::Membership`] and the readiness
//!   condition `discovery`.
//! - `peers.rs`: [`watch_service_endpoints`], the ready and not-ready addresses of a Service.
//! - `lease.rs`: [`LeaseApi`], one `coordination.k8s.io/v1` Lease read, created and updated under
//!   optimistic concurrency, bodies bounded (for `replica::lease`).
//! - `review.rs`: [`TokenReviewer`], whether a bearer token's user may read a path (TokenReview
//!   and SubjectAccessReview), for metrics authentication.
//!
//! Watches use kube-rs's `runtime::watcher` (list, then watch from the list's resourceVersion;
//! a 410 Gone relists). The client comes from `pool.kubeconfig` when set, otherwise from
//! [`kube::Config::infer`]: `$KUBECONFIG` or `~/.kube/config`, then the in-cluster service
//! account.

mod endpoints;
mod lease;
mod peers;
mod pool;
mod review;
mod store;
mod watch;

pub use endpoints::SkipReason;
pub use lease::{LeaseApi, LeaseError, LeaseRecord, LeaseSpec, micro_time_now};
pub use peers::{PortRef, ServiceEndpoints, watch_service_endpoints};
pub use pool::{PoolApi, PoolSpec};
pub use review::{Review, ReviewError, TokenReviewer};

use std::path::{Path, PathBuf};
use std::sync::Arc;

use serde::{Deserialize, Serialize};

use crate::membership::DesiredWorker;
use crate::membership::Membership;
use crate::metrics::Metrics;
use crate::readiness::Readiness;
use kv_epp_core::worker::WorkerId;

/// The InferencePool served, and how its workers are discovered.
///
/// Discovery runs when `name` is set and `workers` is empty (see `Config::discovers_workers`):
/// the pool's pods that are Ready, not terminating and have an IP become workers, one per
/// target port (port index = data-parallel rank).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct PoolConfig {
    /// InferencePool name.
    pub name: String,
    /// InferencePool namespace.
    pub namespace: String,
    /// Which InferencePool API to watch.
    pub api_version: PoolApiVersion,
    /// The pod label naming a discovered worker's model; only read when several models are
    /// configured (with one model, every pod serves it).
    pub model_label: String,
    /// After this long without a working watch of the API, readiness condition `discovery`
    /// turns false (the last known workers are kept and routed to meanwhile).
    pub api_unreachable_timeout_ms: u64,
    /// A kubeconfig file to use instead of the usual inference (`$KUBECONFIG`,
    /// `~/.kube/config`, then the in-cluster service account).
    pub kubeconfig: Option<PathBuf>,
}

/// Default pod label naming a worker's model.
pub const DEFAULT_MODEL_LABEL: &str = "kv-epp.io/model";

impl Default for PoolConfig {
    fn default() -> Self {
        PoolConfig {
            name: String::new(),
            namespace: String::new(),
            api_version: PoolApiVersion::Auto,
            model_label: DEFAULT_MODEL_LABEL.to_owned(),
            api_unreachable_timeout_ms: 30_000,
            kubeconfig: None,
        }
    }
}

/// Which InferencePool API version discovery watches.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PoolApiVersion {
    /// `inference.networking.k8s.io/v1`, falling back to `v1alpha2` while v1 is not served.
    #[default]
    Auto,
    /// `inference.networking.k8s.io/v1` only (`spec.selector.matchLabels`, `spec.targetPorts`).
    V1,
    /// `inference.networking.x-k8s.io/v1alpha2` only (`spec.selector`, `spec.targetPortNumber`).
    V1alpha2,
}

/// How a discovered worker (endpoint and rank, model) becomes a desired worker: its event
/// endpoints follow the deployment's event settings.
pub(crate) type WorkerTemplate = Arc<dyn Fn(WorkerId, &str) -> DesiredWorker + Send + Sync>;

/// What discovery needs to know.
#[derive(Clone)]
pub struct DiscoverySettings {
    /// The pool and how to watch it.
    pub pool: PoolConfig,
    /// The served base models (a pod's model label must name one; with one model, every pod
    /// serves it).
    pub models: Vec<String>,
    /// How a discovered worker becomes a desired worker.
    pub worker: WorkerTemplate,
}

/// The readiness condition discovery drives.
pub(crate) const READINESS_CONDITION: &str = "discovery";

/// A client configured the usual way (see [`kube::Config::infer`]). Errors say what was tried.
pub async fn client() -> Result<kube::Client, String> {
    client_for(None).await
}

/// A client from an explicit kubeconfig file, or inferred when `kubeconfig` is `None`.
pub async fn client_for(kubeconfig: Option<&Path>) -> Result<kube::Client, String> {
    let config = match kubeconfig {
        Some(path) => {
            let file = kube::config::Kubeconfig::read_from(path)
                .map_err(|e| format!("kubeconfig {}: {e}", path.display()))?;
            kube::Config::from_custom_kubeconfig(file, &Default::default())
                .await
                .map_err(|e| format!("kubeconfig {}: {e}", path.display()))?
        }
        None => kube::Config::infer()
            .await
            .map_err(|e| format!("no Kubernetes configuration: {e}"))?,
    };
    kube::Client::try_from(config).map_err(|e| format!("Kubernetes client: {e}"))
}

/// Keeps `membership` equal to the pool's endpoints until the task is dropped, and readiness
/// condition [`READINESS_CONDITION`] true while the API is watched (false before the first
/// complete list, while the pool does not exist, and after `pool.api_unreachable_timeout_ms` of
/// failed watches; the last known workers are kept meanwhile).
pub async fn run(
    settings: DiscoverySettings,
    membership: Arc<Membership>,
    readiness: Readiness,
    metrics: Arc<Metrics>,
) {
    watch::Discovery::new(settings, membership, readiness, metrics)
        .run()
        .await;
}

/// Reads `body` (JSON from the API server, written by whoever may edit the objects) with each of
/// discovery's readers: a pool's `spec` under both APIs, a Lease, EndpointSlices (an array of
/// them, by port number and by name). The `kube` fuzz target's entry point; routing never calls
/// it.
#[doc(hidden)]
pub(crate) fn read_untrusted(body: &[u8]) {
    let _ = lease::parse(body);
    let Ok(json) = serde_json::from_slice::<serde_json::Value>(body) else {
        return;
    };
    for api in [PoolApi::V1, PoolApi::V1alpha2] {
        if let Ok(pool) = pool::parse(api, &json) {
            let _ = pool.label_selector();
        }
    }
    let slices = json.as_array().map(Vec::as_slice).unwrap_or_default();
    for port in [PortRef::Number(8000), PortRef::Name("http".into())] {
        let _ = peers::addresses(slices.iter(), &port);
    }
}
