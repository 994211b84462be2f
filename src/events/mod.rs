//! Engine KV events → the index. Engines report every block they store and evict; kv-epp keeps
//! one feed per worker (endpoint and data-parallel rank), started and stopped as workers come and
//! go.
//!
//! - `vllm.rs`: decoding vLLM's msgpack batches (both layouts, both hash forms), one event at a
//!   time with capped counts, into the engine-neutral
//!   [`EngineEvent`](kv_epp_core::engine_event::EngineEvent).
//! - `msgpack.rs`: the allocation-free msgpack reader under it (lengths checked against the
//!   bytes left, nesting limited).
//! - `subscriber.rs`: the ZeroMQ SUB/DEALER feed with sequence tracking and replay.
//! - `trtllm.rs`: TensorRT-LLM's destructive HTTP drain, polled, into the same form.
//! - `server_info.rs`: an SGLang worker's own `/server_info`, for its publisher's port.
//!
//! Every event reaches the index through the core's one writer, `engine_event::apply`.

pub(crate) mod msgpack;
pub(crate) mod server_info;
pub mod subscriber;
pub mod trtllm;
pub mod vllm;
pub mod zmtp;

use std::collections::HashMap;
use std::sync::Arc;

use parking_lot::Mutex;
use serde::{Deserialize, Serialize};
use tokio::task::JoinHandle;

use kv_epp_core::engine_event::EventCounters;
use kv_epp_core::index::KvIndex;
use kv_epp_core::worker::WorkerId;
use subscriber::{Feed, FeedEndpoints, FeedStatus};

/// Which event protocol the workers speak.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum EventEngine {
    /// vLLM over ZeroMQ.
    #[default]
    Vllm,
    /// SGLang: vLLM-shaped ZeroMQ events, its salt in the event itself (both encodings).
    Sglang,
    /// TensorRT-LLM: the `POST /kv_cache_events` drain, polled, or its ZeroMQ publisher
    /// (`events.trtllm.transport`).
    Trtllm,
    /// No events: route on load alone.
    None,
}

/// One running feed and its task.
struct Running {
    feed: Arc<Feed>,
    task: JoinHandle<()>,
}

/// One running TensorRT-LLM poller.
struct Poller {
    status: Arc<trtllm::PollStatus>,
    task: JoinHandle<()>,
}

/// A single-reader source (TensorRT-LLM's destructive drain): its model's index and poll
/// interval. With peers, only the replica that owns it polls it.
#[derive(Clone)]
pub(crate) struct SingleReader {
    /// The worker's model index.
    pub index: Arc<KvIndex>,
    /// Poll interval.
    pub interval: std::time::Duration,
}

/// A feed waiting for the bootstrap: its model index and endpoints.
type HeldFeed = (Arc<KvIndex>, FeedEndpoints);

/// The running feeds.
#[derive(Default)]
pub struct Feeds {
    running: Mutex<HashMap<WorkerId, Running>>,
    pollers: Mutex<HashMap<WorkerId, Poller>>,
    single_readers: Mutex<HashMap<WorkerId, SingleReader>>,
    /// Set while a replica bootstraps: feeds asked for meanwhile wait here, to start from the
    /// sequence the snapshot reflects.
    held: Mutex<Option<HashMap<WorkerId, HeldFeed>>>,
    /// Snapshot sequences of workers whose feeds were not asked for yet when the bootstrap
    /// ended (e.g. discovery lagging behind): used when they start.
    resume: Mutex<HashMap<WorkerId, u64>>,
    /// Single-reader sources are polled by their owner replica, which starts them itself.
    owned_elsewhere: std::sync::atomic::AtomicBool,
    counters: Arc<EventCounters>,
    /// What one connection to an engine's event sockets may cost.
    limits: zmtp::Limits,
}

impl Feeds {
    /// No feeds yet; each connection to an engine will be held to `limits`.
    pub fn new(limits: zmtp::Limits) -> Self {
        let mut feeds = Feeds::default();
        feeds.limits = limits;
        feeds
    }

    /// Event counters of the TensorRT-LLM sources (each ZeroMQ feed counts in its own
    /// [`FeedStatus`]).
    pub fn counters(&self) -> &Arc<EventCounters> {
        &self.counters
    }

    /// Starts a feed for `worker` (replacing one with other endpoints). Needs a Tokio runtime.
    /// While held (see [`Feeds::hold`]), the feed waits for [`Feeds::release`].
    pub fn start(&self, worker: WorkerId, index: Arc<KvIndex>, endpoints: FeedEndpoints) {
        let resume = {
            let mut held = self.held.lock();
            if let Some(pending) = held.as_mut() {
                pending.insert(worker, (index, endpoints));
                return;
            }
            self.resume.lock().remove(&worker)
        };
        self.start_at(worker, index, endpoints, resume);
    }

    /// Starts a feed that expects `next_seq` as its first sequence (`None`: join like a new
    /// subscriber).
    pub(crate) fn start_at(
        &self,
        worker: WorkerId,
        index: Arc<KvIndex>,
        endpoints: FeedEndpoints,
        next_seq: Option<u64>,
    ) {
        let mut running = self.running.lock();
        if let Some(r) = running.get(&worker)
            && r.feed.endpoints == endpoints
        {
            return;
        }
        let status = Arc::new(FeedStatus::default());
        if let Some(s) = next_seq {
            status
                .next_seq
                .store(s, std::sync::atomic::Ordering::Relaxed);
        }
        let feed = Arc::new(Feed {
            worker,
            index,
            endpoints,
            limits: self.limits,
            status,
            apply_lock: Mutex::new(()),
        });
        let task = tokio::spawn(subscriber::run(feed.clone(), next_seq));
        if let Some(old) = running.insert(worker, Running { feed, task }) {
            old.task.abort();
        }
    }

    /// Holds new feeds back until [`Feeds::release`] (a replica bootstrapping from a peer).
    pub fn hold(&self) {
        self.held.lock().get_or_insert_with(HashMap::new);
    }

    /// Starts the held feeds: each from the sequence in `next_seqs`, or as a new subscriber.
    pub fn release(&self, next_seqs: &HashMap<WorkerId, u64>) {
        let pending = {
            // Under the hold lock, so a feed asked for meanwhile finds either the hold or its
            // resume sequence.
            let mut held = self.held.lock();
            let pending = held.take().unwrap_or_default();
            *self.resume.lock() = next_seqs
                .iter()
                .filter(|(w, _)| !pending.contains_key(w))
                .map(|(w, s)| (*w, *s))
                .collect();
            pending
        };
        for (worker, (index, endpoints)) in pending {
            let seq = next_seqs.get(&worker).copied();
            self.start_at(worker, index, endpoints, seq);
        }
    }

    /// The running feed of a worker.
    pub fn feed(&self, worker: &WorkerId) -> Option<Arc<Feed>> {
        self.running.lock().get(worker).map(|r| r.feed.clone())
    }

    /// Registers a TensorRT-LLM worker's event drain and, unless replicas share it (see
    /// [`Feeds::set_owned_elsewhere`]), starts polling it. Needs a Tokio runtime.
    pub(crate) fn start_trtllm(
        &self,
        worker: WorkerId,
        index: Arc<KvIndex>,
        interval: std::time::Duration,
    ) {
        self.single_readers.lock().insert(
            worker,
            SingleReader {
                index: index.clone(),
                interval,
            },
        );
        if !self
            .owned_elsewhere
            .load(std::sync::atomic::Ordering::Relaxed)
        {
            let block_size = index.block_size();
            self.poll(
                worker,
                block_size,
                interval,
                Arc::new(trtllm::LocalSink {
                    index,
                    counters: self.counters.clone(),
                }),
            );
        }
    }

    /// From now on single-reader sources are polled only through [`Feeds::poll`], by the
    /// replica that owns them.
    pub(crate) fn set_owned_elsewhere(&self) {
        self.owned_elsewhere
            .store(true, std::sync::atomic::Ordering::Relaxed);
    }

    /// The registered single-reader sources.
    pub(crate) fn single_readers(&self) -> Vec<(WorkerId, SingleReader)> {
        self.single_readers
            .lock()
            .iter()
            .map(|(w, s)| (*w, s.clone()))
            .collect()
    }

    /// The workers of the registered single-reader sources.
    pub(crate) fn single_reader_ids(&self) -> Vec<WorkerId> {
        self.single_readers.lock().keys().copied().collect()
    }

    /// Starts polling a single-reader source into `sink` (no-op if already polling).
    pub(crate) fn poll(
        &self,
        worker: WorkerId,
        block_size: usize,
        interval: std::time::Duration,
        sink: Arc<dyn trtllm::EventSink>,
    ) {
        let mut pollers = self.pollers.lock();
        if pollers.get(&worker).is_some_and(|p| !p.task.is_finished()) {
            return; // polling, or finishing its last drain
        }
        let status = Arc::new(trtllm::PollStatus::default());
        let task = tokio::spawn(trtllm::poll(
            worker,
            block_size,
            sink,
            interval,
            self.counters.clone(),
            status.clone(),
        ));
        pollers.insert(worker, Poller { status, task });
    }

    /// Stops polling a single-reader source (it stays registered). A drain in flight is
    /// finished and delivered first: aborting it would lose events the engine already forgot.
    pub(crate) fn stop_polling(&self, worker: &WorkerId) {
        if let Some(p) = self.pollers.lock().get(worker) {
            p.status
                .stop
                .store(true, std::sync::atomic::Ordering::Release);
        }
    }

    /// Whether this replica polls `worker` (or is finishing its last drain).
    pub(crate) fn is_polling(&self, worker: &WorkerId) -> bool {
        let mut pollers = self.pollers.lock();
        match pollers.get(worker) {
            Some(p) if p.task.is_finished() => {
                pollers.remove(worker);
                false
            }
            Some(_) => true,
            None => false,
        }
    }

    /// Whether this replica is asked to poll `worker` (not stopping).
    pub(crate) fn is_owned_here(&self, worker: &WorkerId) -> bool {
        self.pollers.lock().get(worker).is_some_and(|p| {
            !p.task.is_finished() && !p.status.stop.load(std::sync::atomic::Ordering::Acquire)
        })
    }

    /// The status of every TensorRT-LLM poller (including ones finishing their last drain).
    pub(crate) fn poll_statuses(&self) -> Vec<(WorkerId, Arc<trtllm::PollStatus>)> {
        let mut pollers = self.pollers.lock();
        pollers.retain(|_, p| !p.task.is_finished());
        pollers
            .iter()
            .map(|(w, p)| (*w, p.status.clone()))
            .collect()
    }

    /// Stops a worker's feed or poller and forgets it.
    pub fn stop(&self, worker: &WorkerId) {
        if let Some(r) = self.running.lock().remove(worker) {
            r.task.abort();
        }
        if let Some(pending) = self.held.lock().as_mut() {
            pending.remove(worker);
        }
        self.single_readers.lock().remove(worker);
        // The worker is gone: nothing of its drain matters any more.
        if let Some(p) = self.pollers.lock().remove(worker) {
            p.task.abort();
        }
    }

    /// The status of every feed.
    pub fn statuses(&self) -> Vec<(WorkerId, FeedEndpoints, Arc<FeedStatus>)> {
        self.running
            .lock()
            .iter()
            .map(|(w, r)| (*w, r.feed.endpoints.clone(), r.feed.status.clone()))
            .collect()
    }
}

impl Drop for Feeds {
    fn drop(&mut self) {
        for (_, r) in self.running.lock().drain() {
            r.task.abort();
        }
        for (_, p) in self.pollers.lock().drain() {
            p.task.abort();
        }
    }
}
