//! Where decisions run: off the runtime's I/O threads, in two bounded lanes by cost.
//!
//! A decision parses JSON, renders a chat template and tokenizes the prompt: milliseconds for a
//! chat turn, far more for a multi-MiB body. Run inline, that work would stall every gRPC stream,
//! health check and event feed sharing the I/O thread. So the message that makes a decision that
//! may tokenize, or that covers a body of [`INLINE_BODY_BYTES`] or more, runs
//! on tokio's blocking pool, gated by one of two semaphores chosen by the body's size: a small
//! lane (bodies under [`SMALL_BODY_BYTES`]) with one permit per core, and a large lane with half
//! as many (both configurable), so a few huge prompts can occupy at most half the cores and a short chat request
//! never waits in line behind them. A caller waiting for a permit waits asynchronously (no thread
//! is held), and the permits bound the threads decisions use.
//!
//! Large decisions run on the lane's own threads, started once at the lowest CPU priority (nice
//! 19 on Linux): on a machine with few cores a multi-MiB tokenization otherwise takes whole
//! scheduler slices from the threads that answer short requests, which shows as their p99
//! (`benches/decide_lanes.rs`: loaded p99 5.6–7.7 ms at the same priority, 3.1–3.3 ms at nice 10,
//! 1.5–1.8 ms at 19, with 0.2 ms alone). The cost: while the cores are saturated with other work,
//! a large decision gets a small share of them and takes longer. The priority is never raised
//! again (that needs a privilege a pod does not have), so these threads do nothing else.
//!
//! The rest (a token-ID prompt, or no body, under [`INLINE_BODY_BYTES`]: parsing, hashing and
//! scoring, ~0.1 ms for 32k tokens) is decided on the I/O thread
//! ([`StreamHandler::decides_inline`]): handing it to a lane thread and back cost more CPU than
//! the decision (`benches/e2e.rs`).
//!
//! [`INLINE_BODY_BYTES`]: super::stream::INLINE_BODY_BYTES
//! [`StreamHandler::decides_inline`]: super::stream::StreamHandler::decides_inline

use std::panic::AssertUnwindSafe;
use std::sync::{Arc, Mutex, mpsc};

use tokio::sync::{Semaphore, oneshot};

/// Bodies under this many bytes take the small lane.
pub(crate) const SMALL_BODY_BYTES: usize = 64 << 10;

/// The two lanes.
#[derive(Debug, Clone)]
pub(crate) struct DecisionLanes {
    small: Arc<Semaphore>,
    large: Arc<Semaphore>,
    /// Jobs for the large lane's threads (as many as its permits, so a job never waits here).
    large_jobs: mpsc::Sender<Job>,
}

type Job = Box<dyn FnOnce() + Send>;

/// How much lower than the process the large lane's threads run (a nice increment).
const LARGE_LANE_NICE: i32 = 19;

/// Starts `n` threads that run large-lane jobs at a lower priority.
fn large_lane_threads(n: usize) -> mpsc::Sender<Job> {
    let (tx, rx) = mpsc::channel::<Job>();
    let rx = Arc::new(Mutex::new(rx));
    for i in 0..n {
        let rx = rx.clone();
        let started = std::thread::Builder::new()
            .name(format!("kv-epp-large-{i}"))
            .spawn(move || {
                lower_priority();
                loop {
                    // One receiver at a time; a poisoned lock cannot happen (jobs run unlocked).
                    let job = match rx.lock() {
                        Ok(rx) => rx.recv(),
                        Err(e) => e.into_inner().recv(),
                    };
                    match job {
                        Ok(job) => job(),
                        Err(_) => return, // every sender dropped: the lanes are gone
                    }
                }
            });
        if let Err(e) = started {
            tracing::warn!(error = %e, "could not start a large-lane decision thread");
        }
    }
    tx
}

/// Lowers the calling thread's priority (Linux: nice is per thread); elsewhere a no-op.
fn lower_priority() {
    #[cfg(target_os = "linux")]
    // SAFETY: gettid has no preconditions; setpriority on our own thread id changes only its
    // scheduling priority, and its failure (reported through the return value) is harmless.
    unsafe {
        let tid = libc::gettid();
        let now = libc::getpriority(libc::PRIO_PROCESS, tid as libc::id_t);
        libc::setpriority(
            libc::PRIO_PROCESS,
            tid as libc::id_t,
            (now + LARGE_LANE_NICE).min(19),
        );
    }
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
            large_jobs: large_lane_threads(large),
        }
    }

    /// Runs `work` (a decision over `body_bytes` bytes) on a blocking thread once its lane has
    /// a permit, and returns its result.
    pub(crate) async fn run<T: Send + 'static>(
        &self,
        body_bytes: usize,
        work: impl FnOnce() -> T + Send + 'static,
    ) -> Result<T, LaneError> {
        if body_bytes < SMALL_BODY_BYTES {
            let permit = self
                .small
                .clone()
                .acquire_owned()
                .await
                .map_err(|e| LaneError(e.to_string()))?;
            return tokio::task::spawn_blocking(move || {
                let _permit = permit;
                work()
            })
            .await
            .map_err(|e| LaneError(e.to_string()));
        }
        let permit = self
            .large
            .clone()
            .acquire_owned()
            .await
            .map_err(|e| LaneError(e.to_string()))?;
        let (done, result) = oneshot::channel();
        let job: Job = Box::new(move || {
            let out = std::panic::catch_unwind(AssertUnwindSafe(work));
            drop(permit); // before the answer, so the lane is free when the caller resumes
            let _ = done.send(out.map_err(|p| panic_text(p.as_ref())));
        });
        self.large_jobs
            .send(job)
            .map_err(|_| LaneError("the large lane's threads are gone".into()))?;
        match result.await {
            Ok(Ok(out)) => Ok(out),
            Ok(Err(panic)) => Err(LaneError(panic)),
            Err(_) => Err(LaneError("the large-lane job was dropped".into())),
        }
    }
}

impl DecisionLanes {
    /// Permits of the large lane free right now.
    #[cfg(test)]
    pub(crate) fn large_free(&self) -> usize {
        self.large.available_permits()
    }
}

fn panic_text(p: &(dyn std::any::Any + Send)) -> String {
    p.downcast_ref::<&str>()
        .map(|s| (*s).to_owned())
        .or_else(|| p.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "panic".into())
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

    #[tokio::test]
    async fn a_panic_in_either_lane_is_an_error_and_the_lane_keeps_working() {
        let lanes = DecisionLanes::new(1, 1);
        for bytes in [10, SMALL_BODY_BYTES] {
            let failed = lanes.run(bytes, || -> u32 { panic!("bug") }).await;
            assert!(failed.is_err(), "{bytes}-byte lane");
            assert_eq!(
                lanes.run(bytes, || 5).await.unwrap(),
                5,
                "{bytes}-byte lane"
            );
        }
        assert_eq!(lanes.large.available_permits(), 1);
    }

    #[cfg(target_os = "linux")]
    #[tokio::test]
    async fn large_decisions_run_at_a_lower_priority_than_small_ones() {
        let lanes = DecisionLanes::new(1, 1);
        // SAFETY: reading the calling thread's own priority has no preconditions.
        let nice =
            || unsafe { libc::getpriority(libc::PRIO_PROCESS, libc::gettid() as libc::id_t) };
        let small = lanes.run(10, nice).await.unwrap();
        let large = lanes.run(SMALL_BODY_BYTES, nice).await.unwrap();
        assert!(
            large > small || large == 19,
            "large lane nice {large}, small lane {small}"
        );
    }
}
