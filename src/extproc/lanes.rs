//! Where decisions run: off the runtime's I/O threads, in two bounded lanes by cost.
//!
//! A decision parses JSON, renders a chat template and tokenizes the prompt: milliseconds for a
//! chat turn, far more for a multi-MiB body. Run inline, that work would stall every gRPC stream,
//! health check and event feed sharing the I/O thread. So the message that makes the decision runs
//! on tokio's blocking pool, gated by one of two semaphores chosen by the body's size: a small
//! lane (bodies under [`SMALL_BODY_BYTES`]) with one permit per core, and a large lane with half
//! as many (both configurable), so a few huge prompts can occupy at most half the cores and a short chat request
//! never waits in line behind them. A caller waiting for a permit waits asynchronously (no thread
//! is held), and the permits bound the threads decisions use.

use std::sync::Arc;

use tokio::sync::Semaphore;

/// Bodies under this many bytes take the small lane.
pub(crate) const SMALL_BODY_BYTES: usize = 64 << 10;

/// The two lanes.
#[derive(Debug, Clone)]
pub(crate) struct DecisionLanes {
    small: Arc<Semaphore>,
    large: Arc<Semaphore>,
}

/// The decision's thread panicked (a bug): the stream ends as after a protocol error.
#[derive(Debug, thiserror::Error)]
#[error("the decision task failed: {0}")]
pub(crate) struct LaneError(String);

impl DecisionLanes {
    /// Lanes of `small` and `large` permits (`routing.decision_threads` and
    /// `routing.large_body_decision_threads`); 0 sizes them to the machine: one small-lane
    /// permit per available core, half as many (at least one) for large bodies.
    pub(crate) fn new(small: usize, large: usize) -> Self {
        let small = match small {
            0 => std::thread::available_parallelism().map_or(1, |n| n.get()),
            n => n,
        };
        let large = match large {
            0 => (small / 2).max(1),
            n => n,
        };
        DecisionLanes {
            small: Arc::new(Semaphore::new(small)),
            large: Arc::new(Semaphore::new(large)),
        }
    }

    /// Runs `work` (a decision over `body_bytes` bytes) on a blocking thread once its lane has
    /// a permit, and returns its result.
    pub(crate) async fn run<T: Send + 'static>(
        &self,
        body_bytes: usize,
        work: impl FnOnce() -> T + Send + 'static,
    ) -> Result<T, LaneError> {
        let lane = if body_bytes < SMALL_BODY_BYTES {
            &self.small
        } else {
            &self.large
        };
        let permit = lane
            .clone()
            .acquire_owned()
            .await
            .map_err(|e| LaneError(e.to_string()))?;
        tokio::task::spawn_blocking(move || {
            let _permit = permit;
            work()
        })
        .await
        .map_err(|e| LaneError(e.to_string()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_small_request_runs_while_the_large_lane_is_full() {
        let lanes = DecisionLanes::new(1, 1);
        assert_eq!(DecisionLanes::new(6, 0).large.available_permits(), 3);
        let (release, wait) = std::sync::mpsc::channel::<()>();
        let (started, started_rx) = tokio::sync::oneshot::channel();
        let big = {
            let lanes = lanes.clone();
            tokio::spawn(async move {
                lanes
                    .run(SMALL_BODY_BYTES, move || {
                        let _ = started.send(());
                        wait.recv().ok()
                    })
                    .await
            })
        };
        started_rx.await.unwrap();
        // The large lane's only permit is taken; the small lane still answers.
        assert_eq!(lanes.run(10, || 7).await.unwrap(), 7);
        assert_eq!(lanes.large.available_permits(), 0);
        release.send(()).unwrap();
        assert_eq!(big.await.unwrap().unwrap(), Some(()));
    }
}
