//! Worker membership: from the set of workers that should exist (static configuration or
//! discovery) to the running state of each one — the live worker list, the model's index,
//! the event feed or TensorRT-LLM poller, and the engine-metrics scraper.
//!
//! [`Membership::reconcile`] is the one code path for both sources: it adds what is new, removes
//! what vanished, and replaces a worker whose model or event endpoints changed. Removal is
//! complete: the worker leaves routing, its feed stops, its scraper is aborted and its blocks
//! leave the index, so no block of a vanished worker is ever credited again (a feed task still
//! finishing a batch cannot write either: the index refuses unregistered workers).

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use tokio::task::JoinHandle;

use crate::events::subscriber::FeedEndpoints;
use crate::events::{EventEngine, Feeds};
use crate::models::ServedModels;
use crate::workers::Workers;
use kv_epp_core::worker::WorkerId;

/// One worker that should exist.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DesiredWorker {
    /// The worker (endpoint and data-parallel rank).
    pub id: WorkerId,
    /// The configured model it serves.
    pub model: String,
    /// Where it publishes vLLM/SGLang KV events (`None`: no ZeroMQ feed).
    pub feed: Option<FeedEndpoints>,
    /// `feed` is the configured convention, not the worker's own word: ask the worker (SGLang's
    /// `/server_info`) and follow what it advertises.
    pub probe_server_info: bool,
}

/// What one [`Membership::reconcile`] call changed.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct Changes {
    /// Workers started (including replaced ones).
    pub added: Vec<WorkerId>,
    /// Workers stopped (including replaced ones).
    pub removed: Vec<WorkerId>,
}

impl Changes {
    /// Whether nothing changed.
    pub(crate) fn is_empty(&self) -> bool {
        self.added.is_empty() && self.removed.is_empty()
    }
}

/// How workers' companions are run.
#[derive(Clone, Debug)]
pub struct MembershipSettings {
    /// The event protocol the workers speak.
    pub engine: EventEngine,
    /// TensorRT-LLM workers publish over ZeroMQ (subscribed like vLLM) rather than being drained.
    pub trtllm_zmq: bool,
    /// Time between TensorRT-LLM drains.
    pub trtllm_interval: Duration,
    /// Scrape interval and staleness of engine metrics (`None`: no scraping).
    pub scrape: Option<(Duration, Duration)>,
}

/// The running workers and their companions (feeds, pollers, scrapers).
pub struct Membership {
    models: Arc<ServedModels>,
    workers: Arc<Workers>,
    feeds: Arc<Feeds>,
    settings: MembershipSettings,
    state: Mutex<State>,
}

#[derive(Default)]
struct State {
    current: BTreeMap<WorkerId, DesiredWorker>,
    scrapers: BTreeMap<WorkerId, JoinHandle<()>>,
    /// `/server_info` probes still running.
    probes: BTreeMap<WorkerId, JoinHandle<()>>,
}

impl Membership {
    /// An empty membership: workers of `models` join `workers` and get their `feeds`, run as
    /// `settings` says.
    pub fn new(
        settings: MembershipSettings,
        models: Arc<ServedModels>,
        workers: Arc<Workers>,
        feeds: Arc<Feeds>,
    ) -> Membership {
        Membership {
            models,
            workers,
            feeds,
            settings,
            state: Mutex::new(State::default()),
        }
    }

    /// Makes the running workers exactly `desired` (later duplicates of an id are ignored).
    /// Workers of an unknown model are skipped with a warning. Needs a Tokio runtime.
    pub(crate) fn reconcile(&self, desired: Vec<DesiredWorker>) -> Changes {
        let mut wanted = BTreeMap::new();
        for w in desired {
            if self.models.index(&w.model).is_none() {
                tracing::warn!(worker = %w.id, model = %w.model, "skipping a worker of an unconfigured model");
                continue;
            }
            wanted.entry(w.id).or_insert(w);
        }
        let mut state = self.state.lock();
        let mut changes = Changes::default();
        let stale: Vec<WorkerId> = state
            .current
            .iter()
            .filter(|(id, w)| wanted.get(*id) != Some(*w))
            .map(|(id, _)| *id)
            .collect();
        for id in stale {
            self.stop(&mut state, &id);
            changes.removed.push(id);
        }
        for (id, w) in wanted {
            if !state.current.contains_key(&id) {
                self.start(&mut state, w);
                changes.added.push(id);
            }
        }
        if !changes.is_empty() {
            tracing::info!(added = ?changes.added, removed = ?changes.removed, "workers changed");
        }
        changes
    }

    /// The workers currently running.
    pub fn workers(&self) -> Vec<DesiredWorker> {
        self.state.lock().current.values().cloned().collect()
    }

    /// Stops every worker's companions (the worker list stays). Called at shutdown.
    pub fn shutdown(&self) {
        let mut state = self.state.lock();
        for task in std::mem::take(&mut state.scrapers).into_values() {
            task.abort();
        }
        for task in std::mem::take(&mut state.probes).into_values() {
            task.abort();
        }
        for id in state.current.keys() {
            self.feeds.stop(id);
        }
    }

    fn start(&self, state: &mut State, w: DesiredWorker) {
        let index = self.models.index(&w.model).cloned();
        self.workers.add(w.id, &w.model, index.clone());
        if let Some(index) = index {
            match (&w.feed, self.settings.engine) {
                // A ZeroMQ feed (vLLM, SGLang, TensorRT-LLM's publisher; the configuration
                // derives endpoints for these only): every replica subscribes, so none of them
                // is a single-reader source.
                (Some(endpoints), _) => {
                    self.feeds.start(w.id, index.clone(), endpoints.clone());
                    if w.probe_server_info {
                        let task = tokio::spawn(follow_server_info(
                            w.id,
                            index.clone(),
                            endpoints.clone(),
                            self.feeds.clone(),
                        ));
                        if let Some(old) = state.probes.insert(w.id, task) {
                            old.abort();
                        }
                    }
                }
                (None, EventEngine::Trtllm) if !self.settings.trtllm_zmq => {
                    self.feeds
                        .start_trtllm(w.id, index.clone(), self.settings.trtllm_interval);
                }
                _ => {}
            }
        }
        if let Some((interval, stale)) = self.settings.scrape
            && let Some(rt) = self.workers.get(&w.id)
        {
            let task = tokio::spawn(crate::engine_metrics::scrape(rt, interval, stale));
            if let Some(old) = state.scrapers.insert(w.id, task) {
                old.abort();
            }
        }
        state.current.insert(w.id, w);
    }

    fn stop(&self, state: &mut State, id: &WorkerId) {
        if let Some(task) = state.probes.remove(id) {
            task.abort();
        }
        self.feeds.stop(id);
        if let Some(task) = state.scrapers.remove(id) {
            task.abort();
        }
        self.workers.remove(id);
        state.current.remove(id);
    }
}

/// Asks an SGLang worker where it publishes (`/server_info`), a few times with backoff (it may
/// still be starting), and moves its feed there when that differs from the convention it started
/// on. Gives up quietly after the last attempt: the conventional feed stays.
async fn follow_server_info(
    worker: WorkerId,
    index: Arc<kv_epp_core::index::KvIndex>,
    conventional: FeedEndpoints,
    feeds: Arc<Feeds>,
) {
    let mut wait = Duration::from_millis(200);
    for attempt in 0..6 {
        let answer = crate::events::server_info::fetch(&worker).await;
        match answer.and_then(|adv| {
            if adv.block_size.is_some_and(|b| b != index.block_size() as u64) {
                tracing::warn!(%worker, advertised = adv.block_size, model = index.block_size(), "the worker's advertised block size differs from the model's; its events will be dropped and counted");
            }
            adv.endpoints(&worker, &conventional).map_err(|e| e.to_string())
        }) {
            Ok(endpoints) => {
                if endpoints != conventional {
                    tracing::info!(%worker, events = %endpoints.events, "following the KV event endpoint the worker advertises");
                    // Whatever the conventional endpoint delivered was not this worker's word.
                    let _ = index.clear_worker(&worker);
                    feeds.start(worker, index, endpoints);
                }
                return;
            }
            Err(e) if attempt == 5 => {
                tracing::info!(%worker, error = %e, "no advertised KV event endpoint; keeping the configured one");
            }
            Err(_) => {}
        }
        tokio::time::sleep(wait).await;
        wait = (wait * 2).min(Duration::from_secs(5));
    }
}

impl Drop for Membership {
    fn drop(&mut self) {
        for (_, task) in std::mem::take(&mut self.state.get_mut().scrapers) {
            task.abort();
        }
        for (_, task) in std::mem::take(&mut self.state.get_mut().probes) {
            task.abort();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Config;
    use crate::decide::Picker;
    use crate::metrics::Metrics;

    fn setup(yaml: &str) -> (Config, Arc<Picker>, Arc<Feeds>, Membership) {
        let config = Config::from_yaml(yaml).unwrap();
        config.validate().unwrap();
        let picker = Arc::new(Picker::new(
            Arc::new(config.served_models().unwrap()),
            Arc::new(Workers::new(Arc::new(Metrics::new()))),
            config.policy(),
        ));
        let feeds = Arc::new(Feeds::default());
        let m = Membership::new(
            config.membership_settings(),
            picker.models.clone(),
            picker.workers.clone(),
            feeds.clone(),
        );
        (config, picker, feeds, m)
    }

    fn id(s: &str) -> WorkerId {
        s.parse().unwrap()
    }

    #[tokio::test]
    async fn adds_removes_and_replaces_workers_everywhere() {
        let (config, picker, feeds, m) = setup(
            "models: [{name: a, block_size: 4}, {name: b, block_size: 4}]\nengine_metrics: {interval_ms: 0}\n",
        );
        let w = |s: &str, model: &str| config.desired_worker(id(s), model, None);
        let c = m.reconcile(vec![w("127.0.0.1:8000", "a"), w("127.0.0.1:8001#1", "a")]);
        assert_eq!(c.added.len(), 2);
        assert_eq!(picker.workers.all().len(), 2);
        assert_eq!(picker.models.index("a").unwrap().workers().len(), 2);
        let eps: Vec<String> = feeds
            .statuses()
            .into_iter()
            .map(|(_, e, _)| e.events)
            .collect();
        assert!(eps.contains(&"tcp://127.0.0.1:5558".to_owned()), "{eps:?}");

        // Same set: nothing changes. Unknown model: skipped.
        let c = m.reconcile(vec![
            w("127.0.0.1:8000", "a"),
            w("127.0.0.1:8001#1", "a"),
            w("127.0.0.1:9000", "nope"),
        ]);
        assert!(c.is_empty(), "{c:?}");

        // One vanishes, one changes model: removed from the worker list, index and feeds.
        let c = m.reconcile(vec![w("127.0.0.1:8000", "b")]);
        assert_eq!(c.removed.len(), 2);
        assert_eq!(c.added, vec![id("127.0.0.1:8000")]);
        let ids: Vec<_> = picker
            .workers
            .all()
            .iter()
            .map(|w| (w.id, w.model.clone()))
            .collect();
        assert_eq!(ids, vec![(id("127.0.0.1:8000"), "b".to_owned())]);
        assert!(picker.models.index("a").unwrap().workers().is_empty());
        assert_eq!(
            picker.models.index("b").unwrap().workers(),
            vec![id("127.0.0.1:8000")]
        );
        assert_eq!(feeds.statuses().len(), 1);

        m.reconcile(Vec::new());
        assert!(picker.workers.all().is_empty() && feeds.statuses().is_empty());
        assert!(m.workers().is_empty());
    }

    #[tokio::test]
    async fn static_workers_take_the_same_path() {
        let (config, picker, feeds, m) = setup(
            "models: [{name: a, block_size: 4}]\nworkers: [{endpoint: '127.0.0.1:8000', model: a, events_endpoint: 'tcp://127.0.0.1:7000'}]\nevents: {engine: trtllm}\n",
        );
        m.reconcile(config.static_workers());
        assert_eq!(picker.workers.all().len(), 1);
        assert_eq!(feeds.poll_statuses().len(), 1, "trtllm workers are polled");
        assert!(feeds.statuses().is_empty());
        m.shutdown();
        assert!(feeds.poll_statuses().is_empty());
    }
}
