//! One subscriber per worker (endpoint and data-parallel rank): a ZeroMQ SUB socket on the
//! engine's publisher, sequence tracking, replay through the engine's ROUTER socket on a gap, and
//! the index updates. Each runs as its own task, so a slow or broken worker never blocks another.
//!
//! Sequence rules: the next expected sequence is applied; a jump up is a gap, filled by a replay
//! (in order) before the message that revealed it; if the engine no longer has the missed batches
//! (or has no replay socket), the worker's state is dropped and it is marked cold until fresh
//! events arrive; a sequence that goes down means the engine restarted, so its state is dropped
//! too. Memory stays bounded: nothing is queued here beyond one message; ZeroMQ's high-water mark
//! bounds the socket, and what it drops shows up as a gap.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use bytes::Bytes;
use zeromq::{DealerSocket, Socket, SocketRecv, SocketSend, SubSocket, ZmqMessage};

use super::vllm::{Neutral, decode_batch};
use kv_epp_core::engine_event::{self, ApplyError, EventCounters};
use kv_epp_core::index::KvIndex;
use kv_epp_core::worker::WorkerId;

/// End-of-replay marker sequence.
const REPLAY_END: u64 = u64::MAX;
/// How long to wait for one replay message before giving up on the replay.
const REPLAY_TIMEOUT: Duration = Duration::from_secs(5);
/// How long to wait for the replay socket to accept a connection (the worker's other events
/// wait meanwhile, so keep it short).
const REPLAY_CONNECT_TIMEOUT: Duration = Duration::from_secs(2);

/// Where a worker publishes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FeedEndpoints {
    /// The PUB endpoint, e.g. `tcp://10.0.0.1:5557`.
    pub events: String,
    /// The replay ROUTER endpoint, if the engine has one.
    pub replay: Option<String>,
    /// The topic to subscribe to ("" = all).
    pub topic: String,
}

/// Live status of one feed, for `/workers` and metrics.
#[derive(Debug, Default)]
pub struct FeedStatus {
    /// Whether the SUB socket is connected.
    pub connected: AtomicBool,
    /// Last applied sequence + 1 (0 = none yet).
    pub next_seq: AtomicU64,
    /// Batches applied.
    pub batches: AtomicU64,
    /// Payloads that were not valid batches.
    pub bad_payloads: AtomicU64,
    /// Gaps detected.
    pub gaps: AtomicU64,
    /// Gaps filled by replay.
    pub replayed: AtomicU64,
    /// Gaps that could not be filled (state dropped).
    pub unfillable: AtomicU64,
    /// Engine restarts detected.
    pub restarts: AtomicU64,
    /// State was dropped and no fresh event has arrived since.
    pub cold: AtomicBool,
    /// Engine timestamp (ms) of the last applied batch.
    pub last_event_ms: AtomicU64,
}

/// What to do with a message of sequence `seq`, given the next expected one.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum SeqAction {
    /// In order: apply it.
    Apply,
    /// Messages `from..seq` were lost: replay them first.
    Replay {
        /// First missing sequence.
        from: u64,
    },
    /// The sequence went down: the engine restarted.
    Restart,
}

/// The sequence rule. `expected` is `None` before the first message.
pub(crate) fn seq_action(expected: Option<u64>, seq: u64) -> SeqAction {
    match expected {
        // Joining a running engine: catch up on what it still buffers.
        None if seq > 0 => SeqAction::Replay { from: 0 },
        None => SeqAction::Apply,
        Some(e) if seq == e => SeqAction::Apply,
        Some(e) if seq > e => SeqAction::Replay { from: e },
        Some(_) => SeqAction::Restart,
    }
}

/// Everything a feed needs.
pub struct Feed {
    /// The worker.
    pub worker: WorkerId,
    /// Its model's index.
    pub index: Arc<KvIndex>,
    /// Where it publishes.
    pub endpoints: FeedEndpoints,
    /// Shared counters of the model's events.
    pub counters: Arc<EventCounters>,
    /// This feed's status.
    pub status: Arc<FeedStatus>,
    /// Held while a batch is applied with its sequence, or while the index state is dropped,
    /// so a snapshot sees the worker's blocks and the sequence they reflect together.
    pub apply_lock: parking_lot::Mutex<()>,
}

impl Feed {
    /// Runs `f` with the next sequence the worker's current index state expects (`None`: no
    /// event seen yet), with no batch being applied meanwhile.
    pub(crate) fn consistent<R>(&self, f: impl FnOnce(Option<u64>) -> R) -> R {
        let _g = self.apply_lock.lock();
        let next = self.status.next_seq.load(Ordering::Relaxed);
        f((next > 0).then_some(next))
    }

    /// Applies the batch of sequence `seq` and records it as applied.
    fn apply_at(&self, seq: u64, payload: &[u8]) {
        let _g = self.apply_lock.lock();
        self.apply_payload(payload);
        self.status
            .next_seq
            .store(seq.saturating_add(1), Ordering::Relaxed);
    }

    /// Applies one payload (already sequence-checked).
    pub(crate) fn apply_payload(&self, payload: &[u8]) {
        let batch = match decode_batch(payload) {
            Ok(b) => b,
            Err(e) => {
                self.status.bad_payloads.fetch_add(1, Ordering::Relaxed);
                tracing::debug!(worker = %self.worker, error = %e, "dropping malformed KV event batch");
                return;
            }
        };
        if batch.dp_rank.is_some_and(|r| r != self.worker.dp_rank) {
            self.status.bad_payloads.fetch_add(1, Ordering::Relaxed);
            return;
        }
        for ev in batch.events {
            let ev = match ev.map(super::vllm::Event::into_neutral) {
                Ok(Neutral::Event(ev)) => ev,
                Ok(Neutral::OtherGroup) => {
                    self.counters.skipped_groups.fetch_add(1, Ordering::Relaxed);
                    continue;
                }
                Ok(Neutral::Unknown) => {
                    self.counters.unknown_types.fetch_add(1, Ordering::Relaxed);
                    continue;
                }
                Err(_) => {
                    self.counters.malformed.fetch_add(1, Ordering::Relaxed);
                    continue;
                }
            };
            match engine_event::apply(&self.index, &self.worker, &ev, &self.counters) {
                Ok(()) => {}
                Err(ApplyError::BlockSize { event, model }) => {
                    // Counted by the writer; worth a warning: the engine and the configuration
                    // disagree, so none of this worker's blocks can ever be credited.
                    tracing::warn!(
                        worker = %self.worker,
                        event_block_size = event,
                        model_block_size = model,
                        "dropping KV event with a different block size"
                    );
                }
                Err(ApplyError::Index(e)) => {
                    tracing::debug!(worker = %self.worker, error = %e, "KV event not applied");
                    self.counters.malformed.fetch_add(1, Ordering::Relaxed);
                }
            }
        }
        self.status.batches.fetch_add(1, Ordering::Relaxed);
        self.status.cold.store(false, Ordering::Relaxed);
        if batch.ts.is_finite() && batch.ts > 0.0 {
            self.status
                .last_event_ms
                .store((batch.ts * 1000.0) as u64, Ordering::Relaxed);
        }
    }

    /// Drops the worker's state (lost events) and marks it cold.
    fn drop_state(&self, why: &str) {
        let _g = self.apply_lock.lock();
        let dropped = self.index.clear_worker(&self.worker).unwrap_or(0);
        self.status.cold.store(true, Ordering::Relaxed);
        tracing::warn!(worker = %self.worker, dropped, "dropping worker KV state: {why}");
    }

    /// Handles one published message `[topic, seq, payload]`.
    pub async fn on_message(&self, frames: &[Bytes], expected: &mut Option<u64>) {
        let (Some(seq), Some(payload)) = (frames.get(1), frames.get(2)) else {
            self.status.bad_payloads.fetch_add(1, Ordering::Relaxed);
            return;
        };
        let Ok(seq) = <[u8; 8]>::try_from(seq.as_ref()).map(u64::from_be_bytes) else {
            self.status.bad_payloads.fetch_add(1, Ordering::Relaxed);
            return;
        };
        match seq_action(*expected, seq) {
            SeqAction::Apply => {}
            SeqAction::Replay { from } => {
                if expected.is_some() {
                    self.status.gaps.fetch_add(1, Ordering::Relaxed);
                }
                match self.replay(from, seq, expected.is_some()).await {
                    Ok(()) => {
                        if expected.is_some() {
                            self.status.replayed.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                    Err(why) => {
                        if expected.is_some() {
                            self.status.unfillable.fetch_add(1, Ordering::Relaxed);
                            self.drop_state(&why);
                        }
                    }
                }
            }
            SeqAction::Restart => {
                self.status.restarts.fetch_add(1, Ordering::Relaxed);
                self.drop_state("engine restarted (sequence went down)");
                if seq > 0 {
                    let _ = self.replay(0, seq, false).await;
                }
            }
        }
        self.apply_at(seq, payload);
        *expected = Some(seq.saturating_add(1));
    }

    /// Replays `from..until` through the engine's replay socket, applying batches in order.
    /// `strict`: fail (applying nothing) when the engine no longer has `from`; otherwise (joining
    /// a running engine) start from the oldest batch it still has.
    async fn replay(&self, from: u64, until: u64, strict: bool) -> Result<(), String> {
        let Some(endpoint) = &self.endpoints.replay else {
            return Err("no replay endpoint".into());
        };
        let mut dealer = DealerSocket::new();
        tokio::time::timeout(REPLAY_CONNECT_TIMEOUT, dealer.connect(endpoint))
            .await
            .map_err(|_| "replay connect timed out".to_string())?
            .map_err(|e| format!("replay connect: {e}"))?;
        let mut req = ZmqMessage::from(Bytes::new());
        req.push_back(Bytes::copy_from_slice(&from.to_be_bytes()));
        dealer
            .send(req)
            .await
            .map_err(|e| format!("replay request: {e}"))?;
        let mut next = from;
        loop {
            let msg = tokio::time::timeout(REPLAY_TIMEOUT, dealer.recv())
                .await
                .map_err(|_| "replay timed out".to_string())?
                .map_err(|e| format!("replay receive: {e}"))?;
            let frames = msg.into_vec();
            // [b"", seq, payload] (a leading empty delimiter frame)
            let (seq, payload) = match frames.as_slice() {
                [_, seq, payload, ..] => (seq, payload),
                [seq, payload] => (seq, payload),
                _ => return Err("malformed replay message".into()),
            };
            let seq = <[u8; 8]>::try_from(seq.as_ref())
                .map(u64::from_be_bytes)
                .map_err(|_| "malformed replay sequence".to_string())?;
            if seq == REPLAY_END {
                return if next >= until {
                    Ok(())
                } else {
                    Err(format!("replay ended at {next}, needed up to {until}"))
                };
            }
            if seq >= until {
                continue; // the live stream delivers these
            }
            if seq != next && !(next == from && !strict && seq > from) {
                return Err(format!(
                    "engine no longer buffers sequence {next} (replay starts at {seq})"
                ));
            }
            self.apply_at(seq, payload);
            next = seq.saturating_add(1);
        }
    }
}

/// Runs a feed until the task is aborted: connect, subscribe, apply, reconnect on failure.
/// `expected`: the first sequence the current index state expects (from a peer's snapshot), or
/// `None` to join like a new subscriber.
pub async fn run(feed: Arc<Feed>, mut expected: Option<u64>) {
    let mut backoff = Duration::from_millis(100);
    loop {
        let mut sub = SubSocket::new();
        let connected =
            tokio::time::timeout(Duration::from_secs(5), sub.connect(&feed.endpoints.events)).await;
        if !matches!(connected, Ok(Ok(_))) || sub.subscribe(&feed.endpoints.topic).await.is_err() {
            feed.status.connected.store(false, Ordering::Relaxed);
            tokio::time::sleep(backoff).await;
            backoff = (backoff * 2).min(Duration::from_secs(5));
            continue;
        }
        backoff = Duration::from_millis(100);
        feed.status.connected.store(true, Ordering::Relaxed);
        tracing::info!(worker = %feed.worker, endpoint = %feed.endpoints.events, "subscribed to KV events");
        loop {
            match sub.recv().await {
                Ok(msg) => {
                    let frames = msg.into_vec();
                    feed.on_message(&frames, &mut expected).await;
                }
                Err(e) => {
                    tracing::warn!(worker = %feed.worker, error = %e, "KV event stream broke; reconnecting");
                    break;
                }
            }
        }
        feed.status.connected.store(false, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sequence_rule() {
        assert_eq!(seq_action(None, 0), SeqAction::Apply);
        assert_eq!(seq_action(None, 7), SeqAction::Replay { from: 0 });
        assert_eq!(seq_action(Some(5), 5), SeqAction::Apply);
        assert_eq!(seq_action(Some(5), 9), SeqAction::Replay { from: 5 });
        assert_eq!(seq_action(Some(5), 0), SeqAction::Restart);
        assert_eq!(seq_action(Some(5), 3), SeqAction::Restart);
    }
}
