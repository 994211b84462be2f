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
//!
//! Joining: a feed with no known sequence asks the engine's replay socket for everything from 0
//! as soon as its SUB is subscribed, so a kv-epp that starts against a running but idle engine
//! recovers the buffered history without waiting for a new publish. Live messages that the SUB
//! received meanwhile and that the join replay already applied are skipped by sequence.
//!
//! Replay wire form: vLLM 0.33's ROUTER answers `(client_id, b"", topic, seq, payload)`, so this
//! DEALER receives `[b"", topic, seq, payload]` and the end marker `[b"", b"", u64::MAX, b""]`.
//! Older engines (and older simulators) sent `[b"", seq, payload]`; reading seq and payload as the
//! LAST two frames accepts both.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use bytes::Bytes;
use zeromq::{DealerSocket, Socket, SocketRecv, SocketSend, SubSocket, ZmqError, ZmqMessage};

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

/// Why a replay did not bring the worker up to date.
#[derive(Debug, thiserror::Error)]
pub(crate) enum ReplayError {
    /// The worker has no replay socket configured.
    #[error("no replay endpoint")]
    NoEndpoint,
    /// The replay socket did not accept a connection in time.
    #[error("replay connect timed out")]
    ConnectTimeout,
    /// The replay socket refused the connection.
    #[error("replay connect: {0}")]
    Connect(ZmqError),
    /// The request could not be sent.
    #[error("replay request: {0}")]
    Request(ZmqError),
    /// The engine stopped answering mid-replay.
    #[error("replay timed out")]
    Timeout,
    /// The replay socket broke mid-replay.
    #[error("replay receive: {0}")]
    Receive(ZmqError),
    /// A reply that is not `[.., seq (8 bytes BE), payload]`.
    #[error("malformed replay message: {0}")]
    Malformed(#[from] ReplayFrameError),
    /// The end marker came before the batches that were needed.
    #[error("replay ended at {next}, needed up to {until}")]
    Short {
        /// The first sequence not replayed.
        next: u64,
        /// The sequence that was needed up to (exclusive).
        until: u64,
    },
    /// The engine's buffer no longer holds the first missing batch.
    #[error("engine no longer buffers sequence {next} (replay starts at {seq})")]
    Evicted {
        /// The first missing sequence.
        next: u64,
        /// The oldest sequence the engine replayed.
        seq: u64,
    },
}

/// A replay reply whose last two frames are not `[seq (8-byte big-endian), payload]`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub(crate) enum ReplayFrameError {
    /// Fewer than two frames.
    #[error("{0} frame(s), want at least [seq, payload]")]
    TooFewFrames(usize),
    /// The sequence frame is not 8 bytes.
    #[error("sequence frame of {0} bytes, want 8")]
    BadSequence(usize),
}

/// Reads one replay reply as the DEALER receives it: the sequence and payload are the LAST two
/// frames, so vLLM 0.33's `[b"", topic, seq, payload]` and the older `[b"", seq, payload]` are
/// both accepted (what precedes them is the delimiter and the topic, which a replay ignores).
/// The end marker yields [`REPLAY_END`] with an empty payload.
pub(crate) fn replay_frame(frames: &[Bytes]) -> Result<(u64, &Bytes), ReplayFrameError> {
    let [.., seq, payload] = frames else {
        return Err(ReplayFrameError::TooFewFrames(frames.len()));
    };
    let seq = <[u8; 8]>::try_from(seq.as_ref())
        .map(u64::from_be_bytes)
        .map_err(|_| ReplayFrameError::BadSequence(seq.len()))?;
    Ok((seq, payload))
}

/// Where a feed stands in its engine's sequence.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Cursor {
    /// The next sequence the worker's index state expects (`None`: nothing seen yet).
    pub expected: Option<u64>,
    /// After a join replay applied everything below this sequence: live messages below it,
    /// received by the SUB while the replay ran, are duplicates to skip. Cleared by the first
    /// live message at or past it (from then on a lower sequence means a restart again).
    pub joined_below: Option<u64>,
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
    fn drop_state(&self, why: &dyn std::fmt::Display) {
        let _g = self.apply_lock.lock();
        let dropped = self.index.clear_worker(&self.worker).unwrap_or(0);
        self.status.cold.store(true, Ordering::Relaxed);
        tracing::warn!(worker = %self.worker, dropped, "dropping worker KV state: {why}");
    }

    /// Handles one published message `[topic, seq, payload]`.
    pub async fn on_message(&self, frames: &[Bytes], cursor: &mut Cursor) {
        let (Some(seq), Some(payload)) = (frames.get(1), frames.get(2)) else {
            self.status.bad_payloads.fetch_add(1, Ordering::Relaxed);
            return;
        };
        let Ok(seq) = <[u8; 8]>::try_from(seq.as_ref()).map(u64::from_be_bytes) else {
            self.status.bad_payloads.fetch_add(1, Ordering::Relaxed);
            return;
        };
        if let Some(below) = cursor.joined_below {
            if seq < below {
                // Published while the join replay ran, and already applied by it.
                return;
            }
            cursor.joined_below = None;
        }
        let expected = &mut cursor.expected;
        match seq_action(*expected, seq) {
            SeqAction::Apply => {}
            SeqAction::Replay { from } => {
                if expected.is_some() {
                    self.status.gaps.fetch_add(1, Ordering::Relaxed);
                }
                match self.replay(from, Some(seq), expected.is_some()).await {
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
                self.drop_state(&"engine restarted (sequence went down)");
                if seq > 0 {
                    let _ = self.replay(0, Some(seq), false).await;
                }
            }
        }
        self.apply_at(seq, payload);
        *expected = Some(seq.saturating_add(1));
    }

    /// Joins a running engine as soon as the SUB is subscribed: replays everything it still
    /// buffers, so an idle engine's history is recovered without waiting for a new publish.
    /// Does nothing once a sequence is known or when the worker has no replay socket.
    async fn join(&self, cursor: &mut Cursor) {
        if cursor.expected.is_some() || self.endpoints.replay.is_none() {
            return;
        }
        let result = self.replay(0, None, false).await;
        // Whatever was applied counts, even when the replay broke off midway.
        let next = self.status.next_seq.load(Ordering::Relaxed);
        if next > 0 {
            *cursor = Cursor {
                expected: Some(next),
                joined_below: Some(next),
            };
        }
        match result {
            Ok(()) => {
                tracing::info!(worker = %self.worker, next_sequence = next, "joined the engine's event history by replay");
            }
            Err(why) => {
                // Not fatal: the first live message tries again (seq_action's join rule).
                tracing::warn!(worker = %self.worker, error = %why, "join replay failed");
            }
        }
    }

    /// Replays `from..until` (`until: None`: everything the engine buffers) through the engine's
    /// replay socket, applying batches in order. `strict`: fail (applying nothing) when the
    /// engine no longer has `from`; otherwise (joining a running engine) start from the oldest
    /// batch it still has.
    async fn replay(&self, from: u64, until: Option<u64>, strict: bool) -> Result<(), ReplayError> {
        let Some(endpoint) = &self.endpoints.replay else {
            return Err(ReplayError::NoEndpoint);
        };
        let mut dealer = DealerSocket::new();
        tokio::time::timeout(REPLAY_CONNECT_TIMEOUT, dealer.connect(endpoint))
            .await
            .map_err(|_| ReplayError::ConnectTimeout)?
            .map_err(ReplayError::Connect)?;
        let mut req = ZmqMessage::from(Bytes::new());
        req.push_back(Bytes::copy_from_slice(&from.to_be_bytes()));
        dealer.send(req).await.map_err(ReplayError::Request)?;
        let mut next = from;
        loop {
            let msg = tokio::time::timeout(REPLAY_TIMEOUT, dealer.recv())
                .await
                .map_err(|_| ReplayError::Timeout)?
                .map_err(ReplayError::Receive)?;
            let frames = msg.into_vec();
            let (seq, payload) = replay_frame(&frames)?;
            if seq == REPLAY_END {
                return match until {
                    Some(until) if next < until => Err(ReplayError::Short { next, until }),
                    _ => Ok(()),
                };
            }
            if until.is_some_and(|until| seq >= until) {
                continue; // the live stream delivers these
            }
            if seq != next && !(next == from && !strict && seq > from) {
                return Err(ReplayError::Evicted { next, seq });
            }
            self.apply_at(seq, payload);
            next = seq.saturating_add(1);
        }
    }
}

/// Runs a feed until the task is aborted: connect, subscribe, apply, reconnect on failure.
/// `expected`: the first sequence the current index state expects (from a peer's snapshot), or
/// `None` to join like a new subscriber.
pub async fn run(feed: Arc<Feed>, expected: Option<u64>) {
    let mut cursor = Cursor {
        expected,
        joined_below: None,
    };
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
        feed.join(&mut cursor).await;
        loop {
            match sub.recv().await {
                Ok(msg) => {
                    let frames = msg.into_vec();
                    feed.on_message(&frames, &mut cursor).await;
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

    fn f(parts: &[&[u8]]) -> Vec<Bytes> {
        parts.iter().map(|p| Bytes::copy_from_slice(p)).collect()
    }

    #[test]
    fn replay_replies_in_vllm_0_33_form() {
        let seq = 7u64.to_be_bytes();
        let frames = f(&[b"", b"kv-events", &seq, b"payload"]);
        let (s, p) = replay_frame(&frames).unwrap();
        assert_eq!((s, p.as_ref()), (7, &b"payload"[..]));
        let end = f(&[b"", b"", &[0xff; 8], b""]);
        let (s, p) = replay_frame(&end).unwrap();
        assert_eq!(s, REPLAY_END);
        assert!(p.is_empty());
    }

    #[test]
    fn replay_replies_in_the_older_three_frame_form() {
        let seq = 258u64.to_be_bytes();
        let frames = f(&[b"", &seq, b"p"]);
        let (s, p) = replay_frame(&frames).unwrap();
        assert_eq!((s, p.as_ref()), (258, &b"p"[..]));
        let end = f(&[b"", &[0xff; 8], b""]);
        assert_eq!(replay_frame(&end).unwrap().0, REPLAY_END);
    }

    #[test]
    fn malformed_replay_replies_are_refused() {
        assert_eq!(
            replay_frame(&f(&[b"only"])),
            Err(ReplayFrameError::TooFewFrames(1))
        );
        assert_eq!(replay_frame(&[]), Err(ReplayFrameError::TooFewFrames(0)));
        // The topic where the sequence should be (the bug vLLM 0.33's four frames exposed when
        // the sequence was read from a fixed position).
        assert_eq!(
            replay_frame(&f(&[b"", b"topic", b"payload"])),
            Err(ReplayFrameError::BadSequence(5))
        );
    }

    fn feed() -> Feed {
        Feed {
            worker: WorkerId::new("10.0.0.1:8000".parse().unwrap()),
            index: Arc::new(KvIndex::new(4, Default::default())),
            endpoints: FeedEndpoints {
                events: "tcp://127.0.0.1:1".into(),
                replay: None,
                topic: String::new(),
            },
            counters: Default::default(),
            status: Default::default(),
            apply_lock: parking_lot::Mutex::new(()),
        }
    }

    /// `[topic, seq, payload]` with an empty batch `[0.0, []]`.
    fn live(seq: u64) -> Vec<Bytes> {
        let mut payload = vec![0x92, 0xcb];
        payload.extend(0f64.to_be_bytes());
        payload.push(0x90);
        vec![
            Bytes::new(),
            Bytes::copy_from_slice(&seq.to_be_bytes()),
            Bytes::from(payload),
        ]
    }

    #[tokio::test]
    async fn live_messages_the_join_replay_applied_are_skipped_once() {
        let feed = feed();
        // The join replay applied 0..3; the SUB had meanwhile queued 1 and 2.
        let mut cursor = Cursor {
            expected: Some(3),
            joined_below: Some(3),
        };
        for seq in [1, 2] {
            feed.on_message(&live(seq), &mut cursor).await;
        }
        let st = &feed.status;
        assert_eq!(st.batches.load(Ordering::Relaxed), 0, "duplicates skipped");
        assert_eq!(
            st.restarts.load(Ordering::Relaxed),
            0,
            "not taken for a restart"
        );
        feed.on_message(&live(3), &mut cursor).await;
        assert_eq!(st.batches.load(Ordering::Relaxed), 1);
        assert_eq!(cursor.expected, Some(4));
        assert_eq!(
            cursor.joined_below, None,
            "the window closes at the first new batch"
        );
        // From then on a lower sequence is an engine restart again.
        feed.on_message(&live(0), &mut cursor).await;
        assert_eq!(st.restarts.load(Ordering::Relaxed), 1);
        assert_eq!(st.batches.load(Ordering::Relaxed), 2);
    }

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
