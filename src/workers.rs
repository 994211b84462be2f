//! The workers' runtime: which workers are live, whether each may take traffic, the requests
//! kv-epp has in flight on it, and the load its engine reports.
//!
//! Load accounting cannot leak: a decision holds a [`Booking`] that takes one in-flight slot on
//! the chosen worker and gives it back when dropped, exactly once, whatever ends the request.
//! A worker joins and leaves its model's index together with this list, so the index never
//! credits a worker routing does not know.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};

use parking_lot::RwLock;
use tokio::sync::Notify;

use prometheus_client::metrics::gauge::Gauge;

use crate::metrics::Metrics;
use kv_epp_core::index::KvIndex;
use kv_epp_core::scoring::EngineLoad;
use kv_epp_core::worker::WorkerId;

/// Live state of one worker.
pub struct WorkerRuntime {
    /// The worker.
    pub id: WorkerId,
    /// The model it serves.
    pub model: String,
    /// Its model's index (`None`: a model kv-epp does not serve).
    index: Option<Arc<KvIndex>>,
    inflight: AtomicU32,
    /// Its `kv_epp_inflight_requests{worker}` series, moved by bookings with no lookup (only
    /// increments and decrements: concurrent bookings cannot leave a stale value); detached from
    /// the export when the worker leaves, so departed pods leave no series behind.
    gauge: Gauge,
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
    pub(crate) fn set_ready(&self, ready: bool) {
        self.ready.store(ready, Ordering::Relaxed);
    }
    /// The engine-reported load in use (`None` when stale or unknown).
    pub fn engine_load(&self) -> Option<EngineLoad> {
        *self.engine.read()
    }
    /// Records fresh engine-reported load (`None` when stale or unknown).
    pub(crate) fn set_engine_load(&self, load: Option<EngineLoad>) {
        *self.engine.write() = load;
    }
    /// Its model's index, when the model is served.
    pub fn index(&self) -> Option<&Arc<KvIndex>> {
        self.index.as_ref()
    }
}

/// One in-flight slot on a worker, released on drop.
pub struct Booking {
    worker: Arc<WorkerRuntime>,
    released: Arc<Notify>,
}

impl Booking {
    fn new(worker: Arc<WorkerRuntime>, released: Arc<Notify>) -> Booking {
        worker.inflight.fetch_add(1, Ordering::Relaxed);
        worker.gauge.inc();
        Booking { worker, released }
    }

    /// The booked worker.
    pub fn worker(&self) -> &WorkerId {
        &self.worker.id
    }
}

impl Drop for Booking {
    fn drop(&mut self) {
        self.worker.inflight.fetch_sub(1, Ordering::Relaxed);
        self.worker.gauge.dec();
        // Capacity freed: flow control dispatches from its queue.
        self.released.notify_one();
    }
}

impl std::fmt::Debug for Booking {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Booking({})", self.worker.id)
    }
}

/// The live workers.
pub struct Workers {
    list: RwLock<Vec<Arc<WorkerRuntime>>>,
    metrics: Arc<Metrics>,
    released: Arc<Notify>,
}

impl Workers {
    /// No workers yet; bookings are counted in `metrics`.
    pub fn new(metrics: Arc<Metrics>) -> Workers {
        Workers {
            list: RwLock::new(Vec::new()),
            metrics,
            released: Arc::new(Notify::new()),
        }
    }

    /// Notified (one permit kept) whenever a booking is released: flow control's wake-up.
    pub fn released(&self) -> Arc<Notify> {
        self.released.clone()
    }

    /// Adds a worker of `model` (registering it in `index`, its model's index), ready at once;
    /// a worker already present is only marked ready again.
    pub fn add(&self, id: WorkerId, model: &str, index: Option<Arc<KvIndex>>) {
        let mut list = self.list.write();
        if let Some(w) = list.iter().find(|w| w.id == id) {
            w.set_ready(true);
            return;
        }
        if let Some(index) = &index {
            index.add_worker(id);
        }
        let gauge = self
            .metrics
            .inflight
            .get_or_create(&gauge_labels(&id))
            .clone();
        list.push(Arc::new(WorkerRuntime {
            id,
            model: model.to_owned(),
            index,
            inflight: AtomicU32::new(0),
            gauge,
            ready: AtomicBool::new(true),
            engine: RwLock::new(None),
        }));
    }

    /// Removes a worker from routing, drops its index state and its in-flight series.
    /// In-flight bookings on it finish normally (their counts move a series no longer exported).
    pub fn remove(&self, id: &WorkerId) {
        let mut list = self.list.write();
        if let Some(pos) = list.iter().position(|w| w.id == *id) {
            let w = list.remove(pos);
            if let Some(index) = &w.index {
                index.remove_worker(id);
            }
            // Under the list's lock: a worker re-added with the same id gets a fresh series.
            self.metrics.inflight.remove(&gauge_labels(id));
        }
    }

    /// One worker's state.
    pub fn get(&self, id: &WorkerId) -> Option<Arc<WorkerRuntime>> {
        self.list.read().iter().find(|w| w.id == *id).cloned()
    }

    /// The model a worker serves, if it is live.
    pub fn model_of(&self, id: &WorkerId) -> Option<String> {
        self.get(id).map(|w| w.model.clone())
    }

    /// A live worker's model and that model's index.
    pub(crate) fn worker_index(&self, id: &WorkerId) -> Option<(String, Arc<KvIndex>)> {
        let w = self.get(id)?;
        Some((w.model.clone(), w.index.clone()?))
    }

    /// The live workers.
    pub fn all(&self) -> Vec<Arc<WorkerRuntime>> {
        self.list.read().clone()
    }

    /// Runs `f` over the live workers under the read lock (no copy of the list per request).
    pub fn with<R>(&self, f: impl FnOnce(&[Arc<WorkerRuntime>]) -> R) -> R {
        f(&self.list.read())
    }

    /// Total in-flight bookings (0 when every stream has ended).
    pub fn total_inflight(&self) -> u64 {
        self.list
            .read()
            .iter()
            .map(|w| u64::from(w.inflight()))
            .sum()
    }

    /// Books one in-flight slot on `worker`, released when the booking drops.
    pub(crate) fn book(&self, worker: &Arc<WorkerRuntime>) -> Booking {
        Booking::new(worker.clone(), self.released.clone())
    }
}

/// The label set of a worker's in-flight series.
fn gauge_labels(id: &WorkerId) -> crate::metrics::Labels {
    Metrics::labels(&[("worker", &id.to_string())])
}

#[cfg(test)]
mod tests {
    use super::*;
    use kv_epp_core::index::IndexLimits;

    #[test]
    fn bookings_release_exactly_once_and_workers_leave_their_index() {
        let index = Arc::new(KvIndex::new(4, IndexLimits::default()));
        let workers = Workers::new(Arc::new(Metrics::new()));
        let id: WorkerId = "10.0.0.1:8000".parse().unwrap();
        workers.add(id, "m", Some(index.clone()));
        assert_eq!(index.workers(), vec![id]);
        let w = workers.get(&id).unwrap();
        let (a, b) = (workers.book(&w), workers.book(&w));
        assert_eq!(workers.total_inflight(), 2);
        drop(a);
        assert_eq!(w.inflight(), 1);
        workers.remove(&id);
        assert!(index.workers().is_empty() && workers.get(&id).is_none());
        drop(b);
        assert_eq!(
            w.inflight(),
            0,
            "a booking on a removed worker still releases"
        );
    }

    /// The in-flight value exported for `id`, if a series for it is exported.
    fn exported(metrics: &Metrics, id: &str) -> Option<String> {
        let line = format!("kv_epp_inflight_requests{{worker=\"{id}\"}} ");
        (metrics.encode().lines())
            .find_map(|l| l.strip_prefix(line.as_str()))
            .map(str::to_owned)
    }

    #[test]
    fn departed_workers_leave_no_in_flight_series_and_old_bookings_do_not_touch_a_new_one() {
        let metrics = Arc::new(Metrics::new());
        let workers = Workers::new(metrics.clone());
        let id: WorkerId = "10.0.0.1:8000".parse().unwrap();
        let name = "10.0.0.1:8000";
        workers.add(id, "m", None);
        assert_eq!(exported(&metrics, name).as_deref(), Some("0"));
        let old = workers.get(&id).unwrap();
        let held = workers.book(&old);
        let done = workers.book(&old);
        drop(done);
        assert_eq!(exported(&metrics, name).as_deref(), Some("1"));
        workers.remove(&id);
        assert_eq!(
            exported(&metrics, name),
            None,
            "the series leaves with the pod"
        );
        // The same address comes back (a new pod): its series starts at 0, and the booking
        // still held on the departed one releases without touching it.
        workers.add(id, "m", None);
        let new = workers.get(&id).unwrap();
        let _busy = workers.book(&new);
        drop(held);
        assert_eq!(exported(&metrics, name).as_deref(), Some("1"));
        // Pod churn: many addresses come and go, and none stays exported.
        for i in 0..1000u32 {
            let churn: WorkerId = format!("10.1.{}.{}:8000", i / 256, i % 256)
                .parse()
                .unwrap();
            workers.add(churn, "m", None);
            let w = workers.get(&churn).unwrap();
            drop(workers.book(&w));
            workers.remove(&churn);
        }
        let series = (metrics.encode().lines())
            .filter(|l| l.starts_with("kv_epp_inflight_requests{"))
            .count();
        assert_eq!(series, 1, "only the live worker's series is exported");
    }
}
