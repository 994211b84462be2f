//! Kubernetes discovery: the InferencePool's pods become workers, and a Service's EndpointSlices
//! become peer addresses. This is the only module that talks to the Kubernetes API.
//!
//! - `pool.rs`: the InferencePool's selector and target ports (v1, or v1alpha2 as a fallback).
//! - `endpoints.rs`: pods → desired workers (Ready, not terminating, with an IP; one worker per
//!   target port, rank = port index; model from the single model or a pod label). Pure.
//! - `watch.rs`: the watch loop that feeds [`crate::membership::Membership`] and the readiness
//!   condition `discovery`.
//! - `peers.rs`: [`watch_service_endpoints`], the ready and not-ready addresses of a Service.
//!
//! Watches use kube-rs's `runtime::watcher` (list, then watch from the list's resourceVersion;
//! a 410 Gone relists). The client comes from `pool.kubeconfig` when set, otherwise from
//! [`kube::Config::infer`]: `$KUBECONFIG` or `~/.kube/config`, then the in-cluster service
//! account.

mod endpoints;
mod peers;
mod pool;
mod store;
mod watch;

pub use endpoints::SkipReason;
pub use peers::{PortRef, ServiceEndpoints, watch_service_endpoints};
pub use pool::{PoolApi, PoolSpec};

use std::path::Path;
use std::sync::Arc;

use crate::config::Config;
use crate::membership::Membership;
use crate::metrics::Metrics;
use crate::readiness::Readiness;

/// The readiness condition discovery drives.
pub const READINESS_CONDITION: &str = "discovery";

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
    config: Config,
    membership: Arc<Membership>,
    readiness: Readiness,
    metrics: Arc<Metrics>,
) {
    watch::Discovery::new(config, membership, readiness, metrics)
        .run()
        .await;
}
