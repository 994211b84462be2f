//! Drain ownership through a Kubernetes Lease (`peers.coordination: lease`).
//!
//! With probes alone, a symmetric partition (each side reaches its own half) lets each side own
//! the single-reader sources it sees as orphaned. On Kubernetes the API server is the arbiter:
//! one `coordination.k8s.io/v1` Lease per replica set, and only its holder drains TensorRT-LLM
//! workers (all of them in its pool; it relays to the others as before). A worker its pool lacks
//! (a rollout part way through changing a static `workers` list) it delegates to one peer that
//! has it, named in its `Hello` with the time its holding still runs: that peer drains it only
//! while the holder's answer to its last completed probe round names it, never past that time
//! (`ReplicaState::owner_of`, `delegated_until`), so every worker still has one drainer at
//! most. One Lease rather than one per worker: the API load is one write per renew period
//! whatever the number of workers (hundreds of per-worker Leases renewed every 2 s would be a
//! steady stream of etcd writes), and a takeover moves every drain at once, within the same
//! bound a per-worker Lease would give.
//!
//! The rules (`Elector`, pure, and [`run`], the loop):
//! - **Acquire** only when ready: create the Lease when it does not exist, or update it naming
//!   the resourceVersion read (optimistic concurrency: a 409 means someone else wrote first),
//!   with `leaseTransitions` + 1, when it has no holder or when it *expired here*: no change of
//!   its holder, renewTime or resourceVersion was seen for `leaseDurationSeconds` on this
//!   process's monotonic clock since the change was first seen. The other pod's clock
//!   (`renewTime`) is never read as a time.
//! - **Renew** every `peers.lease_renew_ms` with an update naming the last resourceVersion. A
//!   renewal (or acquisition) sent at `t` confirms the holding until `t + duration − renew`:
//!   another replica can only take over `duration` after it saw that write, so it cannot start
//!   before this one stopped. A 409 or 404 on renewal means the Lease was taken: drains stop at
//!   once.
//! - **Fencing.** The holding's deadline is the lease of every claim ([`super::fence`]): a drain
//!   is admitted only before it, so a process paused past it (SIGSTOP, a GC pause, a throttled
//!   pod) drains nothing when it resumes until a renewal sent after the pause succeeds, which it
//!   cannot once another replica took over (the resourceVersion changed). Claims made under a
//!   holding start at an epoch above `leaseTransitions << 32`, so a new holder's batches outrank
//!   every batch of the previous holder even when neither saw the other's claims.
//! - **API unreachable**: nothing is renewed, so the holder stops draining at its deadline and
//!   nobody else can acquire: no drainer rather than two. Counted
//!   (`kv_epp_replica_lease_events_total{event="api_error"}` per failed call, `"lapsed"` when a
//!   holding ran out unconfirmed) and logged once per outage.
//!
//! No Lease API call is made while this replica runs no single-reader source. On shutdown the
//! holder stops its drains and then releases the Lease ([`run_until_stopped`]), so a rolling
//! update hands the drains over at the others' next read.

use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

use super::ReplicaState;
use crate::discovery::{LeaseApi, LeaseError, LeaseRecord, LeaseSpec, micro_time_now};
use crate::metrics::Metrics;

type Labels = Vec<(String, String)>;

/// How the drain Lease is named and timed (`peers.lease_*`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LeaseSettings {
    /// The Lease's name.
    pub name: String,
    /// Its namespace (the pod's own).
    pub namespace: String,
    /// `leaseDurationSeconds` this replica writes.
    pub duration_seconds: u32,
    /// How often the holder renews and the others read.
    pub renew: Duration,
}

/// The Lease's metrics: `kv_epp_replica_lease_held` and `kv_epp_replica_lease_events_total`.
#[derive(Debug, Default)]
pub struct LeaseMetrics {
    /// 1 while this replica holds a confirmed, unexpired drain Lease.
    pub held: Gauge,
    /// Lease events by `event`: `acquired`, `lost` (taken over), `lapsed` (ran out unconfirmed),
    /// `api_error` (a failed call).
    pub events: Family<Labels, Counter>,
}

impl LeaseMetrics {
    pub(crate) fn register(registry: &mut Registry) -> Self {
        let m = LeaseMetrics::default();
        registry.register(
            "replica_lease_held",
            "1 while this replica holds the confirmed drain Lease (peers.coordination: lease)",
            m.held.clone(),
        );
        registry.register(
            "replica_lease_events",
            "Drain Lease events: acquired, lost (taken over), lapsed (ran out without a confirmed renewal), api_error",
            m.events.clone(),
        );
        m
    }

    fn count(&self, event: &str) {
        self.events
            .get_or_create(&Metrics::labels(&[("event", event)]))
            .inc();
    }

    fn get(&self, event: &str) -> u64 {
        self.events
            .get_or_create(&Metrics::labels(&[("event", event)]))
            .get()
    }
}

/// What to do next, when not holding the Lease.
#[derive(Debug, PartialEq, Eq)]
enum Step {
    Create,
    /// Take it over: update naming this resourceVersion, with these transitions.
    Acquire {
        resource_version: String,
        transitions: u64,
    },
    Wait,
}

/// This replica's view of the Lease. Pure: the caller passes the time and does the I/O.
#[derive(Debug)]
struct Elector {
    identity: String,
    duration: Duration,
    renew: Duration,
    /// The last Lease read or written (`None`: not read yet, or absent).
    record: Option<LeaseRecord>,
    /// The last read said 404.
    absent: bool,
    /// When this process first saw the record's current version.
    observed_at: Option<Instant>,
    /// Drains are admitted until then (we hold the Lease, confirmed).
    held_until: Option<Instant>,
    /// Claims under the current holding start above this epoch.
    epoch_floor: u64,
}

impl Elector {
    fn new(identity: String, duration_seconds: u32, renew: Duration) -> Elector {
        Elector {
            identity,
            duration: Duration::from_secs(u64::from(duration_seconds)),
            renew,
            record: None,
            absent: false,
            observed_at: None,
            held_until: None,
            epoch_floor: 0,
        }
    }

    /// Whether the last record names this replica as holder.
    fn holds(&self) -> bool {
        self.record
            .as_ref()
            .is_some_and(|r| r.holder.as_deref() == Some(self.identity.as_str()))
    }

    /// Notes a read: `None` = the Lease does not exist.
    fn observe(&mut self, rec: Option<LeaseRecord>, now: Instant) {
        let changed = match (&self.record, &rec) {
            (Some(a), Some(b)) => {
                (&a.holder, &a.renew_time, &a.resource_version)
                    != (&b.holder, &b.renew_time, &b.resource_version)
            }
            _ => true,
        };
        if changed {
            self.observed_at = Some(now);
        }
        self.absent = rec.is_none();
        self.record = rec;
        if !self.holds() {
            self.held_until = None;
        }
    }

    /// Notes our successful write (created, acquired or renewed) sent at `sent`.
    fn confirmed(&mut self, rec: LeaseRecord, sent: Instant, acquired: bool) {
        if acquired {
            let t = rec.transitions.min(1 << 31);
            self.epoch_floor = (t + 1) << 32;
        }
        self.record = Some(rec);
        self.absent = false;
        self.observed_at = Some(sent);
        self.held_until = Some(sent + self.duration.saturating_sub(self.renew));
    }

    /// Forgets the Lease (taken over, deleted, or no longer needed): nothing is held.
    fn forget(&mut self) {
        self.record = None;
        self.absent = false;
        self.observed_at = None;
        self.held_until = None;
    }

    /// Drops a holding whose deadline passed; true if one did.
    fn lapse(&mut self, now: Instant) -> bool {
        if self.held_until.is_some_and(|t| now >= t) {
            self.held_until = None;
            return true;
        }
        false
    }

    /// What a replica that does not hold the Lease should do now.
    fn step(&self, now: Instant) -> Step {
        if self.absent {
            return Step::Create;
        }
        let Some(r) = &self.record else {
            return Step::Wait;
        };
        let duration = r
            .duration_seconds
            .map_or(self.duration, |d| Duration::from_secs(u64::from(d)));
        let expired = self
            .observed_at
            .is_some_and(|t| now.duration_since(t) >= duration);
        if r.holder.is_none() || expired {
            Step::Acquire {
                resource_version: r.resource_version.clone(),
                transitions: r.transitions.saturating_add(1),
            }
        } else {
            Step::Wait
        }
    }

    fn spec(&self, transitions: u64, acquire_time: Option<String>) -> LeaseSpec {
        LeaseSpec {
            holder: Some(self.identity.clone()),
            duration_seconds: self.duration.as_secs() as u32,
            transitions,
            acquire_time,
            renew_time: micro_time_now(),
        }
    }
}

/// The holder identity of a replica instance.
pub(crate) fn identity(instance: u64) -> String {
    format!("kv-epp-{instance:016x}")
}

fn instance_of(holder: &str) -> Option<u64> {
    let hex = holder.strip_prefix("kv-epp-")?;
    (hex.len() == 16)
        .then(|| u64::from_str_radix(hex, 16).ok())
        .flatten()
}

/// The drain Lease of this replica set, as this replica sees it.
pub struct DrainLease {
    api: LeaseApi,
    settings: LeaseSettings,
    elector: Mutex<Elector>,
    metrics: Arc<LeaseMetrics>,
}

impl DrainLease {
    /// The Lease `settings` name, through `api`, for replica `instance`.
    pub fn new(
        api: LeaseApi,
        settings: LeaseSettings,
        instance: u64,
        metrics: Arc<LeaseMetrics>,
    ) -> DrainLease {
        DrainLease {
            elector: Mutex::new(Elector::new(
                identity(instance),
                settings.duration_seconds,
                settings.renew,
            )),
            api,
            settings,
            metrics,
        }
    }

    /// Until when this replica's holding is confirmed, if it holds the Lease now.
    pub(crate) fn held_until(&self, now: Instant) -> Option<Instant> {
        self.elector.lock().held_until.filter(|&t| now < t)
    }

    /// The instance named as holder by the last record (whether or not it is still valid).
    pub(crate) fn holder(&self) -> Option<u64> {
        let e = self.elector.lock();
        e.record.as_ref()?.holder.as_deref().and_then(instance_of)
    }

    /// Claims under the current holding start above this epoch.
    pub(crate) fn epoch_floor(&self) -> u64 {
        self.elector.lock().epoch_floor
    }

    /// What `/debug/replica` shows.
    pub(crate) fn status(&self) -> serde_json::Value {
        let now = Instant::now();
        let e = self.elector.lock();
        let r = e.record.as_ref();
        serde_json::json!({
            "name": self.api.name(),
            "namespace": self.settings.namespace,
            "duration_seconds": self.settings.duration_seconds,
            "renew_ms": self.settings.renew.as_millis() as u64,
            "holder": r.and_then(|r| r.holder.clone()),
            "transitions": r.map(|r| r.transitions),
            "held": e.held_until.is_some_and(|t| now < t),
            "held_for_ms": e.held_until.map(|t| t.saturating_duration_since(now).as_millis() as u64),
            "acquired": self.metrics.get("acquired"),
            "lost": self.metrics.get("lost"),
            "lapsed": self.metrics.get("lapsed"),
            "api_errors": self.metrics.get("api_error"),
        })
    }
}

/// Keeps the drain Lease: acquires it when this replica is ready and it is free or expired,
/// renews it while held, and extends the claims' leases from each confirmation. Runs until
/// dropped.
pub(crate) async fn run(state: Arc<ReplicaState>, lease: Arc<DrainLease>) {
    let renew = lease.settings.renew;
    let mut tick = tokio::time::interval(renew);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut failing = false;
    let m = lease.metrics.clone();
    loop {
        tick.tick().await;
        if state.feeds.single_readers().is_empty() {
            // Nothing to drain: no API calls, and a holding is let go silently.
            lease.elector.lock().forget();
            m.held.set(0);
            continue;
        }
        let ready = state.is_ready();
        if !ready && lease.elector.lock().holds() {
            // Not ready (e.g. peers refuse its token): it owns nothing, so the holding is let
            // run out without renewal; another replica takes over once it expires.
            lease.elector.lock().forget();
            m.held.set(0);
            continue;
        }
        let now = Instant::now();
        if lease.elector.lock().lapse(now) {
            m.count("lapsed");
            tracing::error!(
                lease = lease.api.name(),
                "the drain lease ran out without a confirmed renewal (Kubernetes API unreachable, or this process was paused): draining stopped until a renewal succeeds"
            );
        }
        let holds = lease.elector.lock().holds();
        let result = if holds {
            renew_once(&lease).await
        } else {
            acquire_once(&lease, ready).await
        };
        match result {
            Err(e) => {
                m.count("api_error");
                if !failing {
                    failing = true;
                    tracing::warn!(lease = lease.api.name(), error = %e, "the drain lease cannot be read or written; a holder stops draining when its lease could have expired, nobody takes over meanwhile");
                }
            }
            Ok(()) => {
                if failing {
                    failing = false;
                    tracing::info!(
                        lease = lease.api.name(),
                        "the drain lease is reachable again"
                    );
                }
            }
        }
        let until = lease.held_until(Instant::now());
        m.held.set(i64::from(until.is_some()));
        if let Some(until) = until {
            for (w, c) in state.hub.fencing.claims() {
                if c.active {
                    state.hub.fencing.renew(&w, until);
                }
            }
        }
    }
}

/// [`run`] until `stop` fires; then, if this replica holds the Lease, it stops draining (its
/// claims given up, its pollers finished) and releases the Lease (holder emptied, naming the
/// resourceVersion it holds), so another replica takes over at its next read instead of after
/// the lease duration: a rolling update does not pause the drains for a whole takeover.
pub(crate) async fn run_until_stopped(
    state: Arc<ReplicaState>,
    lease: Arc<DrainLease>,
    mut stop: tokio::sync::watch::Receiver<bool>,
) {
    tokio::select! {
        _ = run(state.clone(), lease.clone()) => {}
        _ = stop.wait_for(|s| *s) => {}
    }
    if let Err(e) = release(&state, &lease).await {
        tracing::warn!(lease = lease.api.name(), error = %e, "the drain lease could not be released; another replica takes over once it expires");
    }
}

/// Stops every drain of this replica, then empties the Lease's holder if it is still ours.
async fn release(state: &ReplicaState, lease: &DrainLease) -> Result<(), LeaseError> {
    let held = lease.held_until(Instant::now()).is_some();
    lease.elector.lock().held_until = None;
    lease.metrics.held.set(0);
    // No drain is admitted from here on (the claims are gone; a poller's gate re-checks).
    for (w, _) in state.hub.fencing.claims() {
        state.hub.fencing.release(&w);
    }
    let polled: Vec<_> = state
        .feeds
        .poll_statuses()
        .into_iter()
        .map(|(w, _)| w)
        .collect();
    for w in &polled {
        state.feeds.stop_polling(w);
    }
    if !held {
        return Ok(());
    }
    // A drain in flight ends within its HTTP deadline; release only once none runs.
    let deadline = Instant::now() + Duration::from_secs(6);
    while polled.iter().any(|w| state.feeds.is_polling(w)) {
        if Instant::now() >= deadline {
            return Err(LeaseError::Unreachable(
                "a drain did not finish in time".into(),
            ));
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let (mut spec, rv) = {
        let e = lease.elector.lock();
        let Some(r) = e.record.as_ref().filter(|_| e.holds()) else {
            return Ok(());
        };
        (
            e.spec(r.transitions, r.acquire_time.clone()),
            r.resource_version.clone(),
        )
    };
    spec.holder = None;
    let mut rv = rv;
    let mut attempts = 0;
    // A renewal cut short by the stop may have been written without our seeing its new
    // resourceVersion: on a conflict, read again and release only if it still names us.
    loop {
        attempts += 1;
        match lease.api.update(&spec, &rv).await {
            Ok(_) => break,
            Err(LeaseError::Conflict) if attempts >= 3 => return Err(LeaseError::Conflict),
            Err(LeaseError::Conflict) => {
                let now = lease.api.get().await?;
                let identity = lease.elector.lock().identity.clone();
                if now.holder.as_deref() != Some(identity.as_str()) {
                    return Ok(());
                }
                rv = now.resource_version;
            }
            Err(e) => return Err(e),
        }
    }
    lease.elector.lock().forget();
    tracing::info!(
        lease = lease.api.name(),
        "released the drain lease: another replica takes the drains over at its next read"
    );
    Ok(())
}

/// Renews our holding. A conflict or a missing Lease means it was taken: lost at once.
async fn renew_once(lease: &DrainLease) -> Result<(), LeaseError> {
    let (spec, rv) = {
        let e = lease.elector.lock();
        let Some(r) = &e.record else { return Ok(()) };
        (
            e.spec(r.transitions, r.acquire_time.clone()),
            r.resource_version.clone(),
        )
    };
    let sent = Instant::now();
    match lease.api.update(&spec, &rv).await {
        Ok(rec) => {
            lease.elector.lock().confirmed(rec, sent, false);
            Ok(())
        }
        Err(LeaseError::Conflict | LeaseError::NotFound) => {
            lease.elector.lock().forget();
            lease.metrics.count("lost");
            tracing::warn!(
                lease = lease.api.name(),
                "the drain lease was taken by another replica: draining stopped"
            );
            Ok(())
        }
        Err(e) => Err(e),
    }
}

/// Reads the Lease and, when ready and it is absent, free or expired here, takes it.
async fn acquire_once(lease: &DrainLease, ready: bool) -> Result<(), LeaseError> {
    let read = match lease.api.get().await {
        Ok(r) => Some(r),
        Err(LeaseError::NotFound) => None,
        Err(e) => return Err(e),
    };
    let now = Instant::now();
    let step = {
        let mut e = lease.elector.lock();
        e.observe(read, now);
        e.step(now)
    };
    if !ready {
        return Ok(());
    }
    let sent = Instant::now();
    let written = match step {
        Step::Wait => return Ok(()),
        Step::Create => {
            let spec = lease.elector.lock().spec(0, Some(micro_time_now()));
            lease.api.create(&spec).await
        }
        Step::Acquire {
            resource_version,
            transitions,
        } => {
            let spec = lease
                .elector
                .lock()
                .spec(transitions, Some(micro_time_now()));
            lease.api.update(&spec, &resource_version).await
        }
    };
    match written {
        Ok(rec) => {
            let transitions = rec.transitions;
            lease.elector.lock().confirmed(rec, sent, true);
            lease.metrics.count("acquired");
            tracing::info!(
                lease = lease.api.name(),
                transitions,
                "this replica holds the drain lease: it owns every TensorRT-LLM drain in its pool and delegates the others"
            );
            Ok(())
        }
        // Someone else wrote first; read again next time.
        Err(LeaseError::Conflict | LeaseError::NotFound) => Ok(()),
        Err(e) => Err(e),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(holder: Option<&str>, rv: &str, transitions: u64) -> LeaseRecord {
        LeaseRecord {
            holder: holder.map(str::to_owned),
            duration_seconds: Some(10),
            transitions,
            renew_time: Some("2024-01-01T00:00:00.000000Z".into()),
            acquire_time: None,
            resource_version: rv.into(),
        }
    }

    #[test]
    fn takeover_waits_a_full_duration_on_the_local_clock_from_the_last_change_seen() {
        let me = identity(2);
        let mut e = Elector::new(me.clone(), 10, Duration::from_secs(2));
        let t0 = Instant::now();
        e.observe(None, t0);
        assert_eq!(e.step(t0), Step::Create);
        let other = identity(1);
        e.observe(Some(rec(Some(other.as_str()), "5", 0)), t0);
        assert_eq!(e.step(t0 + Duration::from_secs(9)), Step::Wait);
        // The holder renews: a new resourceVersion restarts the wait, whatever renewTime says.
        let t1 = t0 + Duration::from_secs(8);
        e.observe(Some(rec(Some(other.as_str()), "6", 0)), t1);
        assert_eq!(e.step(t0 + Duration::from_secs(12)), Step::Wait);
        // The same record read again does not.
        e.observe(
            Some(rec(Some(other.as_str()), "6", 0)),
            t0 + Duration::from_secs(15),
        );
        assert_eq!(
            e.step(t1 + Duration::from_secs(10)),
            Step::Acquire {
                resource_version: "6".into(),
                transitions: 1
            }
        );
        // Released (no holder): taken at once.
        e.observe(Some(rec(None, "7", 1)), t1);
        assert!(matches!(e.step(t1), Step::Acquire { transitions: 2, .. }));
    }

    #[test]
    fn a_holding_is_confirmed_until_send_time_plus_duration_minus_renew_then_lapses() {
        let me = identity(2);
        let mut e = Elector::new(me.clone(), 10, Duration::from_secs(2));
        let sent = Instant::now();
        e.confirmed(rec(Some(me.as_str()), "9", 4), sent, true);
        assert!(e.holds());
        assert_eq!(e.held_until, Some(sent + Duration::from_secs(8)));
        assert_eq!(
            e.epoch_floor,
            5 << 32,
            "above every epoch of earlier holders"
        );
        assert!(!e.lapse(sent + Duration::from_secs(7)));
        assert!(e.lapse(sent + Duration::from_secs(8)));
        assert!(e.held_until.is_none());
        // A read naming someone else ends the holding.
        e.confirmed(rec(Some(me.as_str()), "10", 4), sent, false);
        e.observe(Some(rec(Some(identity(1).as_str()), "11", 5)), sent);
        assert!(!e.holds() && e.held_until.is_none());
    }

    #[test]
    fn holder_identities_name_instances() {
        assert_eq!(instance_of(&identity(0xabc)), Some(0xabc));
        for bad in [
            "",
            "kv-epp-",
            "kv-epp-xyz",
            "someone-else",
            "kv-epp-00000000000000000",
        ] {
            assert_eq!(instance_of(bad), None, "{bad}");
        }
    }
}
