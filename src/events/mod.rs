//! Engine KV events → the index. Engines report every block they store and evict; kv-epp keeps
//! one feed per worker (endpoint and data-parallel rank), started and stopped as workers come and
//! go.
//!
//! - `vllm.rs`: decoding vLLM's msgpack batches (both layouts, both hash forms).
//! - `apply.rs`: the namespace rule and the index updates.
//! - `subscriber.rs`: the ZeroMQ SUB/DEALER feed with sequence tracking and replay.
//! - `trtllm.rs`: TensorRT-LLM's destructive HTTP drain, polled.

pub mod apply;
pub mod subscriber;
pub mod trtllm;
pub mod vllm;

use std::collections::HashMap;
use std::sync::Arc;

use parking_lot::Mutex;
use tokio::task::JoinHandle;

use crate::index::KvIndex;
use crate::worker::WorkerId;
use apply::ApplyCounters;
use subscriber::{Feed, FeedEndpoints, FeedStatus};

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

/// The running feeds.
#[derive(Default)]
pub struct Feeds {
    running: Mutex<HashMap<WorkerId, Running>>,
    pollers: Mutex<HashMap<WorkerId, Poller>>,
    counters: Arc<ApplyCounters>,
}

impl Feeds {
    /// Event counters shared by every feed.
    pub fn counters(&self) -> &Arc<ApplyCounters> {
        &self.counters
    }

    /// Starts a feed for `worker` (replacing one with other endpoints). Needs a Tokio runtime.
    pub fn start(&self, worker: WorkerId, index: Arc<KvIndex>, endpoints: FeedEndpoints) {
        let mut running = self.running.lock();
        if let Some(r) = running.get(&worker)
            && r.feed.endpoints == endpoints
        {
            return;
        }
        let feed = Arc::new(Feed {
            worker,
            index,
            endpoints,
            counters: self.counters.clone(),
            status: Arc::new(FeedStatus::default()),
        });
        let task = tokio::spawn(subscriber::run(feed.clone()));
        if let Some(old) = running.insert(worker, Running { feed, task }) {
            old.task.abort();
        }
    }

    /// Starts polling a TensorRT-LLM worker's event drain. Needs a Tokio runtime.
    pub fn start_trtllm(
        &self,
        worker: WorkerId,
        index: Arc<KvIndex>,
        interval: std::time::Duration,
    ) {
        let mut pollers = self.pollers.lock();
        if pollers.contains_key(&worker) {
            return;
        }
        let status = Arc::new(trtllm::PollStatus::default());
        let task = tokio::spawn(trtllm::poll(
            worker,
            index,
            interval,
            self.counters.clone(),
            status.clone(),
        ));
        pollers.insert(worker, Poller { status, task });
    }

    /// The status of every TensorRT-LLM poller.
    pub fn poll_statuses(&self) -> Vec<(WorkerId, Arc<trtllm::PollStatus>)> {
        self.pollers
            .lock()
            .iter()
            .map(|(w, p)| (*w, p.status.clone()))
            .collect()
    }

    /// Stops a worker's feed or poller.
    pub fn stop(&self, worker: &WorkerId) {
        if let Some(r) = self.running.lock().remove(worker) {
            r.task.abort();
        }
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
