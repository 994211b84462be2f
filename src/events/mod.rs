//! Engine KV events → the index. Engines report every block they store and evict; kv-epp keeps
//! one feed per worker (endpoint and data-parallel rank), started and stopped as workers come and
//! go.
//!
//! - `vllm.rs`: decoding vLLM's msgpack batches (both layouts, both hash forms).
//! - `apply.rs`: the namespace rule and the index updates.
//! - `subscriber.rs`: the ZeroMQ SUB/DEALER feed with sequence tracking and replay.

pub mod apply;
pub mod subscriber;
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

/// The running feeds.
#[derive(Default)]
pub struct Feeds {
    running: Mutex<HashMap<WorkerId, Running>>,
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

    /// Stops a worker's feed.
    pub fn stop(&self, worker: &WorkerId) {
        if let Some(r) = self.running.lock().remove(worker) {
            r.task.abort();
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
    }
}
