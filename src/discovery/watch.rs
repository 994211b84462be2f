//! The discovery loop: watches the InferencePool and the pods its selector matches, and keeps the
//! membership equal to their endpoints.
//!
//! A *session* runs both watches until the first error; then the loop waits (doubling backoff)
//! and starts a new session, which lists everything again. While sessions fail, the last known
//! workers stay (routing goes on); once failures have lasted `pool.api_unreachable_timeout_ms`,
//! readiness condition `discovery` turns false, and it turns true again when a new session has
//! listed the pool and its pods. A change of the pool's selector restarts the pod watch; the old
//! pods stay until the new selector's list is complete. With `pool.api_version: auto`, a 404 for
//! the v1 pool API switches to v1alpha2 (and back, so an upgraded cluster is followed).

use std::sync::Arc;
use std::time::Duration;

use kube::api::{Api, ApiResource, DynamicObject};
use kube::runtime::watcher::{self, Event};
use tokio::time::Instant;

use super::DiscoverySettings;
use super::READINESS_CONDITION;
use super::endpoints;
use super::pool::{self, PoolApi, PoolSpec};
use super::store::{Backoff, Store, Watch, proves_contact, watch};
use crate::membership::Membership;
use crate::metrics::Metrics;
use crate::readiness::Readiness;

/// The discovery state that outlives sessions.
pub(super) struct Discovery {
    settings: DiscoverySettings,
    membership: Arc<Membership>,
    readiness: Readiness,
    metrics: Arc<Metrics>,
    api: PoolApi,
    /// The last valid pool seen (`None`: not found, or never valid).
    pool: Option<PoolSpec>,
    /// Whether the pool and its pods have been listed completely at least once.
    synced: bool,
    /// When the current run of failures began (`None`: the API answers).
    failing_since: Option<Instant>,
    /// Whether readiness already says the API is unreachable.
    reported_unreachable: bool,
    last_error: String,
    /// The pods skipped at the last reconcile (each is logged once when it starts).
    skipped: Vec<(String, endpoints::SkipReason)>,
}

/// The watches of one session.
struct Session {
    pool: Watch,
    pools: Store,
    /// The pod watch and the selector it was started with.
    pods: Option<(String, Watch)>,
    pod_store: Store,
    /// Whether this session reached the API (resets the backoff).
    progressed: bool,
}

impl Discovery {
    /// Discovery for `settings.pool`, feeding `membership` and `readiness`.
    pub(super) fn new(
        settings: DiscoverySettings,
        membership: Arc<Membership>,
        readiness: Readiness,
        metrics: Arc<Metrics>,
    ) -> Self {
        let api = PoolApi::first(settings.pool.api_version);
        Discovery {
            settings,
            membership,
            readiness,
            metrics,
            api,
            pool: None,
            synced: false,
            failing_since: None,
            reported_unreachable: false,
            last_error: String::new(),
            skipped: Vec::new(),
        }
    }

    /// Runs until dropped.
    pub(super) async fn run(mut self) {
        self.report();
        let mut backoff = Backoff::new();
        let client = loop {
            match super::client_for(self.settings.pool.kubeconfig.as_deref()).await {
                Ok(c) => break c,
                Err(e) => {
                    self.failed(e);
                    self.pause(backoff.next()).await;
                }
            }
        };
        loop {
            let (error, progressed) = self.session(&client).await;
            if progressed {
                backoff.reset();
            }
            self.failed(error);
            self.pause(backoff.next()).await;
        }
    }

    /// One session: both watches until the first error, which it returns (with whether the
    /// session reached the API).
    async fn session(&mut self, client: &kube::Client) -> (String, bool) {
        let ns = self.settings.pool.namespace.clone();
        let pools = Api::namespaced_with(client.clone(), &ns, &self.api.resource());
        let by_name = format!("metadata.name={}", self.settings.pool.name);
        let mut s = Session {
            pool: watch(pools, watcher::Config::default().fields(&by_name)),
            pools: Store::default(),
            pods: None,
            pod_store: Store::default(),
            progressed: false,
        };
        loop {
            tokio::select! {
                ev = futures_util::StreamExt::next(&mut s.pool) => match ev {
                    Some(Ok(ev)) => self.on_pool_event(client, &mut s, ev),
                    Some(Err(e)) => return (self.on_pool_error(e), s.progressed),
                    None => return ("the pool watch ended".into(), s.progressed),
                },
                ev = next_pod(&mut s.pods) => match ev {
                    Some(Ok(ev)) => self.on_pod_event(&mut s, ev),
                    Some(Err(e)) => return (format!("pods: {e}"), s.progressed),
                    None => return ("the pod watch ended".into(), s.progressed),
                },
                _ = until(self.deadline()) => self.report(),
            }
        }
    }

    fn on_pool_event(&mut self, client: &kube::Client, s: &mut Session, ev: Event<DynamicObject>) {
        self.contact(s, &ev);
        if !s.pools.apply(ev) {
            return;
        }
        self.pool = self.current_pool(&s.pools);
        self.follow_selector(client, s);
        self.reconcile(s);
    }

    /// The pool as listed and watched; an invalid object keeps the last valid pool.
    fn current_pool(&self, pools: &Store) -> Option<PoolSpec> {
        let object = pools.objects().get(&self.settings.pool.name)?;
        let spec = object.data.get("spec").unwrap_or(&serde_json::Value::Null);
        match pool::parse(self.api, spec) {
            Ok(p) => Some(p),
            Err(error) => {
                let pool = &self.settings.pool.name;
                tracing::warn!(%pool, %error, "ignoring an invalid InferencePool; keeping the last valid one");
                self.pool.clone()
            }
        }
    }

    /// (Re)starts the pod watch when the pool's selector changed; the old pods stay in effect
    /// until the new selector's list is complete.
    fn follow_selector(&self, client: &kube::Client, s: &mut Session) {
        let selector = self.pool.as_ref().map(PoolSpec::label_selector);
        if s.pods.as_ref().map(|(sel, _)| sel) == selector.as_ref() {
            return;
        }
        s.pods = selector.map(|sel| {
            let pods = ApiResource::erase::<k8s_openapi::api::core::v1::Pod>(&());
            let api = Api::namespaced_with(client.clone(), &self.settings.pool.namespace, &pods);
            let w = watch(api, watcher::Config::default().labels(&sel));
            (sel, w)
        });
        s.pod_store = Store::default();
    }

    fn on_pool_error(&mut self, e: watcher::Error) -> String {
        let message = format!("InferencePool ({:?}): {e}", self.api);
        if let watcher::Error::InitialListFailed(kube::Error::Api(status)) = &e
            && status.code == 404
        {
            let next = self.api.fallback(self.settings.pool.api_version);
            if next != self.api {
                tracing::info!(from = ?self.api, to = ?next, "InferencePool API not served; trying the other version");
                self.api = next;
            }
        }
        message
    }

    fn on_pod_event(&mut self, s: &mut Session, ev: Event<DynamicObject>) {
        self.contact(s, &ev);
        if s.pod_store.apply(ev) {
            self.reconcile(s);
        }
    }

    /// Applies the pool's endpoints once the pool and (if it exists) its pods are listed.
    fn reconcile(&mut self, s: &Session) {
        if !s.pools.listed() || (self.pool.is_some() && !s.pod_store.listed()) {
            return;
        }
        let found = match &self.pool {
            Some(pool) => endpoints::desired(&self.settings, pool, s.pod_store.objects().values()),
            None => endpoints::Endpoints::default(),
        };
        self.count_skipped(found.skipped);
        self.membership.reconcile(found.workers);
        self.synced = true;
        self.report();
    }

    /// Sets the skipped-pods gauge, and logs each pod when it starts being skipped (not on
    /// every reconcile).
    fn count_skipped(&mut self, skipped: Vec<(String, endpoints::SkipReason)>) {
        use endpoints::SkipReason::*;
        let gauge = &self.metrics.discovery_skipped_pods;
        for reason in [BadIp, NoModelLabel, UnknownModel] {
            let n = skipped.iter().filter(|(_, r)| *r == reason).count();
            gauge
                .get_or_create(&Metrics::labels(&[("reason", reason.as_str())]))
                .set(i64::try_from(n).unwrap_or(i64::MAX));
        }
        for (pod, reason) in skipped.iter().filter(|p| !self.skipped.contains(p)) {
            let (label, reason) = (&self.settings.pool.model_label, reason.as_str());
            tracing::warn!(%pod, reason, model_label = %label, "skipping a pod of the pool");
        }
        self.skipped = skipped;
    }

    fn contact(&mut self, s: &mut Session, ev: &Event<DynamicObject>) {
        if proves_contact(ev) {
            s.progressed = true;
            if self.failing_since.take().is_some() {
                tracing::info!("Kubernetes API reachable again");
            }
        }
    }

    fn failed(&mut self, error: String) {
        tracing::warn!(%error, "watching the Kubernetes API failed; retrying");
        self.last_error = error;
        self.failing_since.get_or_insert_with(Instant::now);
        self.report();
    }

    /// When readiness must flip to "unreachable", if it has not yet.
    fn deadline(&self) -> Option<Instant> {
        let timeout = Duration::from_millis(self.settings.pool.api_unreachable_timeout_ms);
        self.failing_since
            .filter(|_| !self.reported_unreachable)
            .map(|t| t + timeout)
    }

    /// Sleeps, updating readiness at the deadline meanwhile.
    async fn pause(&mut self, delay: Duration) {
        let end = Instant::now() + delay;
        loop {
            tokio::select! {
                _ = tokio::time::sleep_until(end) => return,
                _ = until(self.deadline()) => self.report(),
            }
        }
    }

    fn report(&mut self) {
        let timeout = Duration::from_millis(self.settings.pool.api_unreachable_timeout_ms);
        let p = &self.settings.pool;
        let unreachable = self.failing_since.is_some_and(|t| t.elapsed() >= timeout);
        self.reported_unreachable = unreachable;
        let (ok, why) = if unreachable {
            let error = &self.last_error;
            (
                false,
                format!("Kubernetes API unreachable for over {timeout:?}: {error}"),
            )
        } else if !self.synced {
            let why = format!(
                "InferencePool {}/{} and its pods not listed yet",
                p.namespace, p.name
            );
            (false, why)
        } else if self.pool.is_none() {
            (
                false,
                format!(
                    "InferencePool {}/{} not found or invalid",
                    p.namespace, p.name
                ),
            )
        } else {
            (true, String::new())
        };
        self.readiness.set(READINESS_CONDITION, ok, why);
    }
}

async fn next_pod(
    pods: &mut Option<(String, Watch)>,
) -> Option<Result<Event<DynamicObject>, watcher::Error>> {
    match pods {
        Some((_, w)) => futures_util::StreamExt::next(w).await,
        None => std::future::pending().await,
    }
}

async fn until(deadline: Option<Instant>) {
    match deadline {
        Some(d) => tokio::time::sleep_until(d).await,
        None => std::future::pending().await,
    }
}
