//! Flow control: what happens to a request when no candidate can take it, and who goes first
//! when capacity frees up.
//!
//! ```text
//! understood request ─▶ quotas (tenant in-flight, token rate) ─▶ queue empty? try to book ─▶ routed
//!                                 │ 429                                 │ saturated
//!                                 ▼                                     ▼
//!                              refused                push into the tenant's queue (limits: 429)
//!                                                                        │ booking released,
//!                                                                        │ engine load falling (tick)
//!                                                     dispatch in fair order ─▶ routed
//!                                                     timeout / client gone ─▶ 429 / removed
//! ```
//!
//! A tenant is the request's salt namespace (the unsalted requests are one more tenant). Queues
//! are kept per tenant inside priority bands and served in weighted fair order measured in work
//! (`scheduler.rs`). A queued request is dispatched by booking it exactly as a fresh request
//! is booked (`decide::try_book`), with one difference: it may wait for the saturated worker that
//! holds more of its prefix, while its wait stays under the recompute it would save
//! (`affinity_wait_ms_per_block` × the blocks saved, capped by `max_affinity_wait_ms`,
//! see `kv_epp_core::scoring::affinity_gap`); meanwhile the free capacity goes to other queued
//! requests.
//!
//! Nothing leaks: a queued request is a [`Ticket`] whose drop removes it from the queue (client
//! gone, stream reset, timeout); a decision dispatched to a ticket that is gone is dropped with
//! its booking. A [`TenantSlot`] counts the tenant's in-flight request until the stream ends.
//! Raw tenant ids never appear in logs, metrics or `/debug/queues`: fingerprints only, and in
//! metrics only for the busiest `metrics_top_tenants` (`top.rs`; the rest are `other`).

pub mod quota;
pub mod scheduler;
pub mod settings;
pub mod top;

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;
use tokio::sync::{Notify, oneshot};

use crate::decide::{self, Decision, Picker, Reject, RequestParts, Understood};
use kv_epp_core::fingerprint::Fingerprint;
use kv_epp_core::namespace::Namespace;
use quota::TokenBucket;
use scheduler::{Full, Offer, Scheduler};
pub use settings::{FlowControlConfig, FlowSettings, TenantConfig, TenantPolicy};
use top::TopTenants;

type Labels = Vec<(String, String)>;
type TenantKey = Option<Namespace>;

/// What a queued or refused request's dispatch answers.
pub type Outcome = Result<(Decision, TenantSlot), Reject>;

/// Flow control's metrics (registered with the rest in `Metrics`).
pub struct FlowMetrics {
    /// Requests queued now, by tenant label.
    pub queued: Family<Labels, Gauge>,
    /// Request bytes queued now.
    pub queued_bytes: Gauge,
    /// Requests in flight, by tenant label.
    pub inflight: Family<Labels, Gauge>,
    /// Requests admitted, by tenant label and path (`direct`, `queued`).
    pub admitted: Family<Labels, Counter>,
    /// Requests refused by flow control or quotas, by tenant label and reason (the `outcome`).
    pub rejected: Family<Labels, Counter>,
    /// Time spent queued by requests that left the queue (dispatched or not), by tenant label.
    pub wait_seconds: Family<Labels, Histogram, fn() -> Histogram>,
}

fn wait_histogram() -> Histogram {
    Histogram::new(exponential_buckets(0.001, 2.5, 14))
}

impl FlowMetrics {
    /// Registers every family in `registry`.
    pub(crate) fn register(registry: &mut Registry) -> Self {
        let m = FlowMetrics {
            queued: Family::default(),
            queued_bytes: Gauge::default(),
            inflight: Family::default(),
            admitted: Family::default(),
            rejected: Family::default(),
            wait_seconds: Family::new_with_constructor(wait_histogram),
        };
        registry.register(
            "flow_queued_requests",
            "Requests waiting in flow control's queue, by tenant (fingerprint for the busiest, else other)",
            m.queued.clone(),
        );
        registry.register(
            "flow_queued_bytes",
            "Request body bytes waiting in flow control's queue",
            m.queued_bytes.clone(),
        );
        registry.register(
            "flow_inflight_requests",
            "Requests in flight, by tenant",
            m.inflight.clone(),
        );
        registry.register(
            "flow_admitted",
            "Requests admitted by flow control, by tenant and path (direct, queued)",
            m.admitted.clone(),
        );
        registry.register(
            "flow_rejected",
            "Requests refused by flow control or quotas, by tenant and reason",
            m.rejected.clone(),
        );
        registry.register(
            "flow_wait_seconds",
            "Time requests spent in flow control's queue, by tenant",
            m.wait_seconds.clone(),
        );
        m
    }
}

impl Default for FlowMetrics {
    fn default() -> Self {
        FlowMetrics::register(&mut Registry::default())
    }
}

/// A queued request: what dispatch needs to book it, and where to send the outcome.
struct Waiter {
    request: Option<Understood>,
    path: String,
    subset: Option<Vec<SocketAddr>>,
    conformance: Option<Vec<IpAddr>>,
    tenant: TenantKey,
    fingerprint: Option<Fingerprint>,
    label: String,
    enqueued: Instant,
    tx: Option<oneshot::Sender<Outcome>>,
    outcome: Option<Outcome>,
    /// Units taken from the tenant's token bucket, refunded if the request is not served.
    charged: u64,
}

#[derive(Default)]
struct Usage {
    inflight: u32,
    bucket: Option<TokenBucket>,
}

struct State {
    queue: Scheduler<TenantKey, Waiter>,
    usage: HashMap<TenantKey, Usage>,
    top: TopTenants,
}

/// The shared flow-control state of one process.
pub struct FlowControl {
    settings: FlowSettings,
    picker: Arc<Picker>,
    metrics: Arc<FlowMetrics>,
    state: Mutex<State>,
    wake: Arc<Notify>,
    epoch: Instant,
    clock: Option<Clock>,
}

/// Milliseconds on a caller's clock (the fleet simulation runs flow control in simulated time).
pub type Clock = Arc<dyn Fn() -> u64 + Send + Sync>;

/// What [`FlowControl::admit`] decided.
pub enum Admission {
    /// Booked at once.
    Now(Box<Decision>, TenantSlot),
    /// Refused (quota, queue full, or the decision's own refusal).
    Refused(Reject),
    /// Queued: wait on the ticket.
    Queued(Ticket),
}

/// A request's place in the queue. Dropping it leaves the queue at once.
pub struct Ticket {
    id: u64,
    rx: oneshot::Receiver<Outcome>,
    flow: Arc<FlowControl>,
    model: Option<String>,
    label: String,
    enqueued: Instant,
}

impl Ticket {
    /// Waits for dispatch until `queue_timeout` after enqueueing: the decision, or a refusal
    /// (`Reject::QueueTimeout` when nothing freed up).
    pub async fn wait(&mut self) -> Outcome {
        let deadline = self.enqueued + self.flow.settings.queue_timeout;
        match tokio::time::timeout_at(deadline.into(), &mut self.rx).await {
            Ok(Ok(outcome)) => outcome,
            Ok(Err(_)) | Err(_) => {
                if self.flow.cancel(self.id, &self.label, self.enqueued) {
                    let why = Reject::QueueTimeout {
                        model: self.model.clone(),
                        waited_ms: self.enqueued.elapsed().as_millis() as u64,
                    };
                    self.flow.count_reject(&self.label, &why);
                    Err(why)
                } else {
                    // Dispatched meanwhile: the outcome is in the channel (or it was refused).
                    self.rx.try_recv().unwrap_or_else(|_| {
                        Err(Reject::QueueTimeout {
                            model: self.model.clone(),
                            waited_ms: self.enqueued.elapsed().as_millis() as u64,
                        })
                    })
                }
            }
        }
    }

    /// The outcome, when the request has been dispatched (or refused) already; `None` while it
    /// still waits. For callers that drive time themselves.
    pub fn try_take(&mut self) -> Option<Outcome> {
        self.rx.try_recv().ok()
    }

    /// How long an override of Envoy's message timeout must be to cover the wait: the queue
    /// timeout plus one second for the answer.
    pub fn message_timeout(&self) -> Duration {
        self.flow.settings.queue_timeout + Duration::from_secs(1)
    }
}

impl std::fmt::Debug for Ticket {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Ticket({}, {})", self.id, self.label)
    }
}

impl std::fmt::Debug for FlowControl {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FlowControl")
            .field("enabled", &self.settings.enabled)
            .finish_non_exhaustive()
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        self.flow.cancel(self.id, &self.label, self.enqueued);
    }
}

/// One in-flight request of a tenant, counted until dropped.
pub struct TenantSlot {
    flow: Arc<FlowControl>,
    tenant: TenantKey,
    label: String,
}

impl Drop for TenantSlot {
    fn drop(&mut self) {
        let mut st = self.flow.state.lock();
        if let Some(u) = st.usage.get_mut(&self.tenant) {
            u.inflight = u.inflight.saturating_sub(1);
        }
        let now = self.flow.now_ms();
        prune(&mut st.usage, &self.tenant, now);
        drop(st);
        self.flow
            .metrics
            .inflight
            .get_or_create(&label(&self.label))
            .dec();
        // A tenant at its in-flight limit may have a queued request waiting for this.
        self.flow.wake.notify_one();
    }
}

impl std::fmt::Debug for TenantSlot {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "TenantSlot({})", self.label)
    }
}

/// Puts a refused request's `charged` units back into its tenant's bucket: a request that is
/// not served costs no quota, so retries through saturation or an outage do not use it up.
fn refund(usage: &mut HashMap<TenantKey, Usage>, tenant: &TenantKey, charged: u64) {
    if charged > 0
        && let Some(b) = usage.get_mut(tenant).and_then(|u| u.bucket.as_mut())
    {
        b.refund(charged);
    }
}

fn prune(usage: &mut HashMap<TenantKey, Usage>, tenant: &TenantKey, now_ms: u64) {
    let idle = usage
        .get_mut(tenant)
        .is_some_and(|u| u.inflight == 0 && u.bucket.as_mut().is_none_or(|b| b.is_full(now_ms)));
    if idle {
        // A full bucket and no requests are what a new tenant starts with: nothing to keep.
        usage.remove(tenant);
    }
}

fn label(tenant: &str) -> Labels {
    vec![("tenant".to_owned(), tenant.to_owned())]
}

impl FlowControl {
    /// Flow control over `picker`'s workers under `settings`; woken by `wake` (bookings
    /// released). Spawn [`FlowControl::run`] to dispatch.
    pub fn new(
        settings: FlowSettings,
        picker: Arc<Picker>,
        metrics: Arc<FlowMetrics>,
        wake: Arc<Notify>,
    ) -> Arc<Self> {
        Self::with_clock(settings, picker, metrics, wake, None)
    }

    /// As [`FlowControl::new`], reading milliseconds from `clock` instead of the wall clock
    /// (affinity waits and token buckets; queue timeouts are then the caller's, see
    /// [`Ticket::try_take`]).
    pub fn with_clock(
        settings: FlowSettings,
        picker: Arc<Picker>,
        metrics: Arc<FlowMetrics>,
        wake: Arc<Notify>,
        clock: Option<Clock>,
    ) -> Arc<Self> {
        Arc::new(FlowControl {
            state: Mutex::new(State {
                queue: Scheduler::new(settings.limits),
                usage: HashMap::new(),
                top: TopTenants::new(settings.top_tenants),
            }),
            settings,
            picker,
            metrics,
            wake,
            epoch: Instant::now(),
            clock,
        })
    }

    /// The settings.
    pub fn settings(&self) -> &FlowSettings {
        &self.settings
    }

    fn now_ms(&self) -> u64 {
        match &self.clock {
            Some(clock) => clock(),
            None => self.epoch.elapsed().as_millis() as u64,
        }
    }

    /// The work a request stands for: prompt tokens (or body bytes / 4 when it has none) plus its
    /// expected decode (`max_tokens` capped, or the configured default).
    pub fn cost(&self, request: &Understood, body_bytes: usize) -> u64 {
        let prompt = request
            .tokens
            .as_ref()
            .map_or(body_bytes as u64 / 4, |t| t.len() as u64);
        let decode = request
            .max_output_tokens
            .map_or(self.settings.expected_decode_tokens, |m| {
                m.min(self.settings.max_expected_decode_tokens)
            });
        prompt.saturating_add(decode).max(1)
    }

    /// Admits an understood request: quotas, then a booking now, or a place in the queue when
    /// every candidate is saturated (and flow control is on). Runs on a decision lane.
    pub fn admit(
        self: &Arc<Self>,
        request: Understood,
        parts: &RequestParts<'_>,
        body_bytes: usize,
    ) -> Admission {
        let salt = request.salt.as_ref();
        let tenant: TenantKey = salt.map(|s| Namespace::of(s.cache_salt()));
        let fp: Option<Fingerprint> = salt.map(|s| s.fingerprint());
        let rule = self.settings.rule(tenant.as_ref());
        let cost = self.cost(&request, body_bytes);
        let model = request.model.base.clone();
        let now = self.now_ms();
        let mut st = self.state.lock();
        let lbl = st.top.observe(fp);
        // Quotas first: a tenant over its quota neither books nor queues.
        let usage = st.usage.entry(tenant.clone()).or_default();
        if let Some(limit) = rule.max_inflight
            && usage.inflight >= limit
        {
            let why = Reject::TenantInflight { model, limit };
            prune(&mut st.usage, &tenant, now);
            drop(st);
            self.count_reject(&lbl, &why);
            return Admission::Refused(why);
        }
        let mut charged = 0;
        if let Some((rate, burst)) = rule.rate {
            let bucket = usage
                .bucket
                .get_or_insert_with(|| TokenBucket::new(rate, burst, now));
            if bucket.take(cost, now) {
                charged = cost;
            } else {
                let why = Reject::TenantRate {
                    model,
                    tokens_per_second: rate,
                    retry_after: bucket.seconds_until(cost),
                };
                drop(st);
                self.count_reject(&lbl, &why);
                return Admission::Refused(why);
            }
        }
        if st.queue.is_empty() {
            match decide::try_book(&self.picker, &request, parts, &|_| false) {
                Ok(booked) => {
                    st.usage.entry(tenant.clone()).or_default().inflight += 1;
                    drop(st);
                    let slot = self.slot(tenant, lbl.clone(), "direct");
                    return Admission::Now(Box::new(booked.into_decision(request)), slot);
                }
                Err(Reject::Saturated { .. }) if self.settings.enabled => {}
                Err(why) => {
                    refund(&mut st.usage, &tenant, charged);
                    prune(&mut st.usage, &tenant, now);
                    drop(st);
                    if matches!(why, Reject::Saturated { .. }) {
                        self.count_reject(&lbl, &why);
                    }
                    return Admission::Refused(why);
                }
            }
        } else if !self.settings.enabled {
            // Off: nothing is ever queued, so this is unreachable; keep the old answer anyway.
            refund(&mut st.usage, &tenant, charged);
            drop(st);
            return Admission::Refused(Reject::Saturated { model });
        }
        let (tx, rx) = oneshot::channel();
        let enqueued = Instant::now();
        let waiter = Waiter {
            request: Some(request),
            path: parts.path.to_owned(),
            subset: parts.subset.map(<[SocketAddr]>::to_vec),
            conformance: parts.conformance.map(<[IpAddr]>::to_vec),
            tenant: tenant.clone(),
            fingerprint: fp,
            label: lbl.clone(),
            enqueued,
            tx: Some(tx),
            outcome: None,
            charged,
        };
        let id = match st
            .queue
            .push(tenant.clone(), rule.share, cost, body_bytes, now, waiter)
        {
            Ok(id) => id,
            Err(full) => {
                refund(&mut st.usage, &tenant, charged);
                prune(&mut st.usage, &tenant, now);
                drop(st);
                let why = Reject::QueueFull {
                    model,
                    limit: Full::field(full),
                };
                self.count_reject(&lbl, &why);
                return Admission::Refused(why);
            }
        };
        self.metrics.queued.get_or_create(&label(&lbl)).inc();
        self.metrics.queued_bytes.inc_by(body_bytes as i64);
        // Capacity may be free for someone queued (or for this one): offer it in fair order.
        let out = self.dispatch_locked(&mut st);
        drop(st);
        self.deliver(out);
        let mut ticket = Ticket {
            id,
            rx,
            flow: self.clone(),
            model,
            label: lbl,
            enqueued,
        };
        match ticket.rx.try_recv() {
            Ok(Ok((d, slot))) => Admission::Now(Box::new(d), slot),
            Ok(Err(why)) => Admission::Refused(why),
            Err(_) => Admission::Queued(ticket),
        }
    }

    fn slot(self: &Arc<Self>, tenant: TenantKey, lbl: String, path: &str) -> TenantSlot {
        self.metrics.inflight.get_or_create(&label(&lbl)).inc();
        self.metrics
            .admitted
            .get_or_create(&vec![
                ("tenant".to_owned(), lbl.clone()),
                ("path".to_owned(), path.to_owned()),
            ])
            .inc();
        TenantSlot {
            flow: self.clone(),
            tenant,
            label: lbl,
        }
    }

    fn count_reject(&self, lbl: &str, why: &Reject) {
        self.metrics
            .rejected
            .get_or_create(&vec![
                ("tenant".to_owned(), lbl.to_owned()),
                ("reason".to_owned(), why.outcome().to_owned()),
            ])
            .inc();
    }

    /// Removes a queued request; whether it was still queued.
    fn cancel(&self, id: u64, lbl: &str, enqueued: Instant) -> bool {
        let mut st = self.state.lock();
        let Some(w) = st.queue.cancel(id) else {
            return false;
        };
        let now = self.now_ms();
        refund(&mut st.usage, &w.tenant, w.charged);
        prune(&mut st.usage, &w.tenant, now);
        let queued_bytes = st.queue.bytes();
        drop(st);
        self.metrics.queued_bytes.set(queued_bytes as i64);
        self.metrics.queued.get_or_create(&label(lbl)).dec();
        self.metrics
            .wait_seconds
            .get_or_create(&label(lbl))
            .observe(enqueued.elapsed().as_secs_f64());
        true
    }

    /// Offers free capacity to queued requests in fair order (call when capacity may have
    /// freed up; [`FlowControl::run`] does on every booking released and on a tick).
    pub fn dispatch(self: &Arc<Self>) {
        let mut st = self.state.lock();
        if st.queue.is_empty() {
            return;
        }
        let out = self.dispatch_locked(&mut st);
        drop(st);
        self.deliver(out);
    }

    fn dispatch_locked(self: &Arc<Self>, st: &mut State) -> Vec<Waiter> {
        let now_ms = self.now_ms();
        let settings = &self.settings;
        let picker = &self.picker;
        let State { queue, usage, .. } = st;
        let out = queue.dispatch(|w, at_ms| {
            let rule = settings.rule(w.tenant.as_ref());
            if let Some(limit) = rule.max_inflight
                && usage.get(&w.tenant).is_some_and(|u| u.inflight >= limit)
            {
                return Offer::Wait;
            }
            let Some(request) = w.request.as_ref() else {
                return Offer::Taken;
            };
            let waited = now_ms.saturating_sub(at_ms) as f64;
            let hold = |gap: f64| {
                let budget = (gap * settings.affinity_wait_ms_per_block)
                    .min(settings.max_affinity_wait_ms as f64);
                waited < budget
            };
            let parts = RequestParts {
                path: &w.path,
                tenant: &[],
                body: None,
                subset: w.subset.as_deref(),
                conformance: w.conformance.as_deref(),
            };
            match decide::try_book(picker, request, &parts, &hold) {
                Err(Reject::Saturated { .. }) => Offer::Wait,
                Ok(booked) => {
                    let request = w.request.take().expect("checked above");
                    usage.entry(w.tenant.clone()).or_default().inflight += 1;
                    w.outcome = Some(Ok((
                        booked.into_decision(request),
                        // The slot is completed (counted) in `deliver`, outside the lock.
                        TenantSlot {
                            flow: self.clone(),
                            tenant: w.tenant.clone(),
                            label: String::new(),
                        },
                    )));
                    Offer::Taken
                }
                Err(why) => {
                    refund(usage, &w.tenant, w.charged);
                    w.outcome = Some(Err(why));
                    Offer::Taken
                }
            }
        });
        self.metrics.queued_bytes.set(st.queue.bytes() as i64);
        out
    }

    /// Sends dispatched outcomes to their waiters (outside the lock: a waiter that is gone
    /// drops its decision, and the booking with it).
    fn deliver(self: &Arc<Self>, out: Vec<Waiter>) {
        for mut w in out {
            let lbl = w.label.clone();
            self.metrics.queued.get_or_create(&label(&lbl)).dec();
            self.metrics
                .wait_seconds
                .get_or_create(&label(&lbl))
                .observe(w.enqueued.elapsed().as_secs_f64());
            let outcome = match w.outcome.take() {
                Some(Ok((d, mut slot))) => {
                    slot.label = lbl.clone();
                    self.metrics.inflight.get_or_create(&label(&lbl)).inc();
                    self.metrics
                        .admitted
                        .get_or_create(&vec![
                            ("tenant".to_owned(), lbl.clone()),
                            ("path".to_owned(), "queued".to_owned()),
                        ])
                        .inc();
                    Ok((d, slot))
                }
                Some(Err(why)) => Err(why),
                None => continue,
            };
            if let Some(tx) = w.tx.take()
                && let Err(Ok(_unserved)) = tx.send(outcome)
            {
                // Booked, but its stream left (or timed out) meanwhile: the booking is dropped
                // here, and the request was not served.
                refund(&mut self.state.lock().usage, &w.tenant, w.charged);
            }
        }
    }

    /// Dispatches whenever a booking is released, and every `tick` (engine-reported load
    /// falling, workers becoming ready), until the process stops.
    pub async fn run(self: Arc<Self>, tick: Duration) {
        loop {
            tokio::select! {
                _ = self.wake.notified() => {}
                _ = tokio::time::sleep(tick) => {}
            }
            self.dispatch();
        }
    }

    /// What `/debug/queues` shows: totals and each queued tenant by fingerprint label (never the
    /// id), band, weight, depth, bytes, virtual counter and oldest wait.
    pub fn debug(&self) -> serde_json::Value {
        let st = self.state.lock();
        let now = self.now_ms();
        let mut tenants: Vec<serde_json::Value> = st
            .queue
            .view()
            .into_iter()
            .map(|v| {
                let fp = match st.queue.head(&v.tenant).and_then(|w| w.fingerprint) {
                    Some(fp) => fp.to_string(),
                    None => top::UNSALTED.into(),
                };
                serde_json::json!({
                    "tenant": fp,
                    "band": self.settings.band_names.get(v.share.band as usize),
                    "weight": v.share.weight,
                    "queued": v.requests,
                    "queued_bytes": v.bytes,
                    "virtual_work": v.vtime,
                    "oldest_wait_ms": now.saturating_sub(v.oldest_ms),
                    "inflight": st.usage.get(&v.tenant).map_or(0, |u| u.inflight),
                })
            })
            .collect();
        // The deepest queues first; the answer stays bounded whatever the number of tenants.
        tenants.sort_by(|a, b| b["queued"].as_u64().cmp(&a["queued"].as_u64()));
        tenants.truncate(1000);
        let inflight: u64 = st.usage.values().map(|u| u64::from(u.inflight)).sum();
        serde_json::json!({
            "enabled": self.settings.enabled,
            "queued": st.queue.len(),
            "queued_bytes": st.queue.bytes(),
            "inflight": inflight,
            "queue_timeout_ms": self.settings.queue_timeout.as_millis() as u64,
            "bands": self.settings.band_names.iter().rev().collect::<Vec<_>>(),
            "tenants": tenants,
        })
    }

    /// Requests queued now.
    pub fn queued(&self) -> usize {
        self.state.lock().queue.len()
    }
}
