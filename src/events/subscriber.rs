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

use super::vllm::{DecodeError, Dialect, Neutral, decode_batch_as};
use super::zmtp::{self, Limits, SocketType, ZmtpError};
use kv_epp_core::engine_event::{self, ApplyError, EventCounters};
use kv_epp_core::index::KvIndex;
use kv_epp_core::worker::WorkerId;

/// End-of-replay marker sequence.
const REPLAY_END: u64 = u64::MAX;
/// How long to wait for one replay message before giving up on the replay.
const REPLAY_TIMEOUT: Duration = Duration::from_secs(5);
/// How long to wait for the replay socket to accept a connection and handshake (the worker's
/// other events wait meanwhile, so keep it short).
const REPLAY_CONNECT_TIMEOUT: Duration = Duration::from_secs(2);
/// First and longest wait before reconnecting a feed.
/// After a join, while no live message has arrived: when to check the engine's replay again for
/// batches its PUB may have dropped before our subscription took effect (after the previous check).
const JOIN_RECHECKS: [Duration; 2] = [Duration::from_secs(1), Duration::from_secs(4)];
const BACKOFF: (Duration, Duration) = (Duration::from_millis(100), Duration::from_secs(5));

/// Where a worker publishes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FeedEndpoints {
    /// The PUB endpoint, e.g. `tcp://10.0.0.1:5557`.
    pub events: String,
    /// The replay ROUTER endpoint, if the engine has one.
    pub replay: Option<String>,
    /// The topic to subscribe to ("" = all).
    pub topic: String,
    /// How the engine writes its events.
    pub dialect: Dialect,
}

/// The two sockets of a feed, as counter labels.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FeedSocket {
    /// The engine's publisher (SUB).
    Events = 0,
    /// The engine's replay ROUTER (DEALER).
    Replay = 1,
}

impl FeedSocket {
    /// Both, in label order.
    pub const ALL: [FeedSocket; 2] = [FeedSocket::Events, FeedSocket::Replay];

    /// The label.
    pub fn label(self) -> &'static str {
        match self {
            FeedSocket::Events => "events",
            FeedSocket::Replay => "replay",
        }
    }
}

/// Why a message or an event was dropped without reaching the index, as counter labels.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Dropped {
    /// A message that is not `[topic, seq (8 bytes), payload]` or whose payload is not a batch.
    MalformedFrame = 0,
    /// A batch published for another data-parallel rank.
    WrongRank = 1,
    /// A batch over the events-per-batch cap.
    OversizeBatch = 2,
    /// An event that could not be decoded (a field of the wrong shape, more block hashes, token
    /// ids or extra keys than the decoder's caps) or written.
    MalformedEvent = 3,
    /// An event whose block size is not the model's.
    BlockSizeMismatch = 4,
    /// An event of a KV-cache group other than 0 (hybrid models: not indexed).
    OtherGroup = 5,
    /// An event type kv-epp does not know.
    UnknownType = 6,
}

impl Dropped {
    /// Every reason, in label order.
    pub const ALL: [Dropped; 7] = [
        Dropped::MalformedFrame,
        Dropped::WrongRank,
        Dropped::OversizeBatch,
        Dropped::MalformedEvent,
        Dropped::BlockSizeMismatch,
        Dropped::OtherGroup,
        Dropped::UnknownType,
    ];

    /// The label.
    pub fn label(self) -> &'static str {
        match self {
            Dropped::MalformedFrame => "malformed_frame",
            Dropped::WrongRank => "wrong_rank",
            Dropped::OversizeBatch => "oversize_batch",
            Dropped::MalformedEvent => "malformed_event",
            Dropped::BlockSizeMismatch => "block_size_mismatch",
            Dropped::OtherGroup => "other_group",
            Dropped::UnknownType => "unknown_type",
        }
    }
}

/// A failure that is logged when it starts, changes or ends, never once per occurrence (a
/// broken engine would otherwise flood the log).
#[derive(Debug, Default)]
pub struct Failing(parking_lot::Mutex<Option<&'static str>>);

impl Failing {
    /// Records a failure with `reason`; `true` when that is a change worth a log line.
    fn fail(&self, reason: &'static str) -> bool {
        self.0.lock().replace(reason) != Some(reason)
    }

    /// Records a success; the reason that was failing until now, if any.
    fn ok(&self) -> Option<&'static str> {
        self.0.lock().take()
    }

    /// The reason failing now.
    pub fn reason(&self) -> Option<&'static str> {
        *self.0.lock()
    }
}

/// One counter of a feed: its family, its labels and its value.
pub type FeedCount = (&'static str, Vec<(&'static str, &'static str)>, u64);

/// Live status and counters of one feed, for `/workers` and `/metrics`.
#[derive(Debug, Default)]
pub struct FeedStatus {
    /// Whether the SUB socket is connected.
    pub connected: AtomicBool,
    /// Last applied sequence + 1 (0 = none yet).
    pub next_seq: AtomicU64,
    /// Batches applied.
    pub batches: AtomicU64,
    /// What happened to the events of applied batches (applied, malformed, namespaces, ...).
    pub events: EventCounters,
    /// Messages and events dropped, by [`Dropped`] reason.
    pub dropped: [AtomicU64; Dropped::ALL.len()],
    /// Connections that failed or ended, by [`FeedSocket`] and [`ZmtpError::reason`].
    pub connection_errors: [[AtomicU64; ZmtpError::REASONS.len()]; 2],
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
    /// The event socket's failure, logged once per change.
    pub connection: Failing,
    /// The replay socket's failure, logged once per change.
    pub replay: Failing,
    /// Decoding failures, logged once per change.
    pub decoding: Failing,
}

impl FeedStatus {
    /// Messages or events dropped for `why`.
    pub fn drop_count(&self, why: Dropped) -> u64 {
        self.dropped[why as usize].load(Ordering::Relaxed)
    }

    /// Every counter of the feed as `(family, labels, value)`: the one list both `/workers` and
    /// `/metrics` show (families: `batches`, `events` by outcome, `dropped` by reason,
    /// `sequence` by kind, `connection_errors` by socket and reason; zero connection errors are
    /// left out).
    pub fn counts(&self) -> Vec<FeedCount> {
        let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
        let mut out = vec![("batches", vec![], get(&self.batches))];
        for (outcome, n) in [
            ("applied", &self.events.applied),
            ("foreign_namespace", &self.events.foreign_namespace),
        ] {
            out.push(("events", vec![("outcome", outcome)], get(n)));
        }
        for why in Dropped::ALL {
            out.push((
                "dropped",
                vec![("reason", why.label())],
                self.drop_count(why),
            ));
        }
        for (kind, n) in [
            ("gap", &self.gaps),
            ("replayed", &self.replayed),
            ("unfillable", &self.unfillable),
            ("restart", &self.restarts),
        ] {
            out.push(("sequence", vec![("kind", kind)], get(n)));
        }
        for socket in FeedSocket::ALL {
            for (reason, n) in ZmtpError::REASONS
                .iter()
                .zip(&self.connection_errors[socket as usize])
            {
                let n = get(n);
                if n > 0 {
                    out.push((
                        "connection_errors",
                        vec![("socket", socket.label()), ("reason", reason)],
                        n,
                    ));
                }
            }
        }
        out
    }

    fn count_connection_error(&self, socket: FeedSocket, e: &ZmtpError) {
        if let Some(i) = ZmtpError::REASONS.iter().position(|r| *r == e.reason()) {
            self.connection_errors[socket as usize][i].fetch_add(1, Ordering::Relaxed);
        }
    }
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
    /// The replay socket could not be reached, or its connection broke.
    #[error("replay socket: {0}")]
    Socket(#[from] ZmtpError),
    /// The engine stopped answering mid-replay.
    #[error("replay timed out")]
    Timeout,
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

impl ReplayError {
    /// The log label of this error.
    fn reason(&self) -> &'static str {
        match self {
            ReplayError::NoEndpoint => "no_endpoint",
            ReplayError::Socket(e) => e.reason(),
            ReplayError::Timeout => "timeout",
            ReplayError::Malformed(_) => "malformed",
            ReplayError::Short { .. } => "short",
            ReplayError::Evicted { .. } => "evicted",
        }
    }
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
    /// What one connection to the engine may cost.
    pub limits: Limits,
    /// This feed's status and counters.
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
        let st = &self.status;
        let dialect = self.endpoints.dialect;
        let batch = match decode_batch_as(payload, dialect) {
            Ok(b) => b,
            Err(e @ DecodeError::TooMany { .. }) => {
                self.dropped(Dropped::OversizeBatch, &e);
                return;
            }
            Err(e) => {
                self.dropped(Dropped::MalformedFrame, &e);
                return;
            }
        };
        if batch.dp_rank.is_some_and(|r| r != self.worker.dp_rank) {
            self.dropped(
                Dropped::WrongRank,
                &"batch published for another data-parallel rank",
            );
            return;
        }
        let mut clean = true;
        for ev in batch.events {
            let ev = match ev.map(|ev| ev.into_neutral(dialect)) {
                Ok(Neutral::Event(ev)) => ev,
                Ok(Neutral::OtherGroup) => {
                    st.dropped[Dropped::OtherGroup as usize].fetch_add(1, Ordering::Relaxed);
                    continue;
                }
                Ok(Neutral::Unknown) => {
                    st.dropped[Dropped::UnknownType as usize].fetch_add(1, Ordering::Relaxed);
                    continue;
                }
                Err(e) => {
                    clean = false;
                    self.dropped(Dropped::MalformedEvent, &e);
                    continue;
                }
            };
            match engine_event::apply(&self.index, &self.worker, &ev, &st.events) {
                Ok(()) => {}
                Err(e @ ApplyError::BlockSize { .. }) => {
                    // The engine and the configuration disagree: none of this worker's blocks
                    // can ever be credited.
                    clean = false;
                    self.dropped(Dropped::BlockSizeMismatch, &e);
                }
                Err(e @ ApplyError::Index(_)) => {
                    clean = false;
                    self.dropped(Dropped::MalformedEvent, &e);
                }
            }
        }
        if clean && let Some(was) = st.decoding.ok() {
            tracing::info!(worker = %self.worker, was, "KV event batches decode again");
        }
        st.batches.fetch_add(1, Ordering::Relaxed);
        st.cold.store(false, Ordering::Relaxed);
        if batch.ts.is_finite() && batch.ts > 0.0 {
            st.last_event_ms
                .store((batch.ts * 1000.0) as u64, Ordering::Relaxed);
        }
    }

    /// Counts a dropped message or event, and logs it when the decoding failure changes.
    fn dropped(&self, why: Dropped, error: &dyn std::fmt::Display) {
        let st = &self.status;
        st.dropped[why as usize].fetch_add(1, Ordering::Relaxed);
        if st.decoding.fail(why.label()) {
            tracing::warn!(worker = %self.worker, reason = why.label(), %error, "dropping KV events (logged again when the reason changes)");
        } else {
            tracing::debug!(worker = %self.worker, reason = why.label(), %error, "dropping KV events");
        }
    }

    /// Counts a failed or ended connection, and logs it when the failure changes.
    fn connection_failed(&self, socket: FeedSocket, e: &ZmtpError) {
        self.status.count_connection_error(socket, e);
        let state = match socket {
            FeedSocket::Events => &self.status.connection,
            FeedSocket::Replay => &self.status.replay,
        };
        let endpoint = match socket {
            FeedSocket::Events => Some(self.endpoints.events.as_str()),
            FeedSocket::Replay => self.endpoints.replay.as_deref(),
        };
        if state.fail(e.reason()) {
            tracing::warn!(worker = %self.worker, socket = socket.label(), endpoint, reason = e.reason(), error = %e, "KV event connection failed; retrying with backoff (logged again when the reason changes)");
        } else {
            tracing::debug!(worker = %self.worker, socket = socket.label(), reason = e.reason(), error = %e, "KV event connection failed");
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
            self.dropped(
                Dropped::MalformedFrame,
                &format_args!("{} frame(s), want [topic, seq, payload]", frames.len()),
            );
            return;
        };
        let Ok(seq) = <[u8; 8]>::try_from(seq.as_ref()).map(u64::from_be_bytes) else {
            self.dropped(
                Dropped::MalformedFrame,
                &format_args!("sequence frame of {} bytes, want 8", seq.len()),
            );
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
    /// Once a sequence is known (a reconnect, or a start from a peer's snapshot), catches up
    /// instead (see [`Feed::catch_up`]). Does nothing when the worker has no replay socket.
    async fn join(&self, cursor: &mut Cursor) {
        if self.endpoints.replay.is_none() {
            return;
        }
        if let Some(expected) = cursor.expected {
            return self.catch_up(expected, cursor).await;
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
                // Not fatal: the first live message tries again (seq_action's join rule). The
                // failure itself was logged by `replay` when it changed.
                tracing::debug!(worker = %self.worker, error = %why, "join replay failed");
            }
        }
    }

    /// After a reconnect: replays whatever the engine published from `expected` on while the SUB
    /// was away. A PUB drops messages for a subscriber that is not connected, and the live
    /// stream only shows the gap with the engine's next publish, which an idle engine never
    /// makes: without this the feed would stay connected and silently short of those batches.
    /// A batch caught up counts as a gap filled by replay; one the engine no longer buffers
    /// drops the worker's state (as for a live gap) and rejoins from what it still has.
    async fn catch_up(&self, expected: u64, cursor: &mut Cursor) {
        let result = self.replay(expected, None, true).await;
        match result {
            Ok(()) => {}
            Err(ReplayError::Evicted { .. }) => {
                self.status.gaps.fetch_add(1, Ordering::Relaxed);
                self.status.unfillable.fetch_add(1, Ordering::Relaxed);
                self.drop_state(&"batches published while disconnected are no longer buffered");
                // From the oldest batch the engine still has.
                let _ = self.replay(expected, None, false).await;
            }
            Err(why) => {
                // Not fatal: the next live message shows the gap and replays it then.
                tracing::debug!(worker = %self.worker, error = %why, "catch-up replay failed");
                return;
            }
        }
        let next = self.status.next_seq.load(Ordering::Relaxed);
        if next > expected {
            if result.is_ok() {
                self.status.gaps.fetch_add(1, Ordering::Relaxed);
                self.status.replayed.fetch_add(1, Ordering::Relaxed);
            }
            tracing::info!(worker = %self.worker, from = expected, next_sequence = next, "caught up on KV events published while disconnected");
            *cursor = Cursor {
                expected: Some(next),
                joined_below: Some(next),
            };
        }
    }

    /// Replays `from..until` (`until: None`: everything the engine buffers) through the engine's
    /// replay socket, applying batches in order. `strict`: fail (applying nothing) when the
    /// engine no longer has `from`; otherwise (joining a running engine) start from the oldest
    /// batch it still has. Failures are counted and logged once per change.
    async fn replay(&self, from: u64, until: Option<u64>, strict: bool) -> Result<(), ReplayError> {
        let result = self.replay_once(from, until, strict).await;
        match &result {
            Ok(()) => {
                if let Some(was) = self.status.replay.ok() {
                    tracing::info!(worker = %self.worker, was, "KV event replay works again");
                }
            }
            Err(ReplayError::Socket(e)) => self.connection_failed(FeedSocket::Replay, e),
            Err(ReplayError::NoEndpoint) => {}
            Err(e) => {
                if self.status.replay.fail(e.reason()) {
                    tracing::warn!(worker = %self.worker, reason = e.reason(), error = %e, "KV event replay failed (logged again when the reason changes)");
                }
            }
        }
        result
    }

    async fn replay_once(
        &self,
        from: u64,
        until: Option<u64>,
        strict: bool,
    ) -> Result<(), ReplayError> {
        let Some(endpoint) = &self.endpoints.replay else {
            return Err(ReplayError::NoEndpoint);
        };
        let limits = Limits {
            handshake_timeout: REPLAY_CONNECT_TIMEOUT,
            message_timeout: REPLAY_TIMEOUT,
            ..self.limits
        };
        let mut dealer = zmtp::connect(endpoint, SocketType::Dealer, limits).await?;
        dealer.send(&[b"", &from.to_be_bytes()]).await?;
        let mut next = from;
        loop {
            let frames = tokio::time::timeout(REPLAY_TIMEOUT, dealer.recv())
                .await
                .map_err(|_| ReplayError::Timeout)??;
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

/// Runs a feed until the task is aborted: connect, subscribe, apply, reconnect with backoff on
/// failure. `expected`: the first sequence the current index state expects (from a peer's
/// snapshot), or `None` to join like a new subscriber.
pub async fn run(feed: Arc<Feed>, expected: Option<u64>) {
    let mut cursor = Cursor {
        expected,
        joined_below: None,
    };
    let mut backoff = BACKOFF.0;
    loop {
        let error = match subscribe(&feed).await {
            Err(e) => e,
            Ok(mut sub) => {
                feed.status.connected.store(true, Ordering::Relaxed);
                match feed.status.connection.ok() {
                    Some(was) => {
                        tracing::info!(worker = %feed.worker, endpoint = %feed.endpoints.events, was, "subscribed to KV events again")
                    }
                    None => {
                        tracing::info!(worker = %feed.worker, endpoint = %feed.endpoints.events, "subscribed to KV events")
                    }
                }
                feed.join(&mut cursor).await;
                // Until the first live message shows the subscription has taken effect at the
                // engine, a batch published meanwhile may have been dropped by its PUB after
                // the join's replay was served; an idle engine would never reveal that gap, so
                // the join is checked again while the connection stays silent.
                let mut rechecks = JOIN_RECHECKS.iter();
                let mut recheck = rechecks.next().map(|d| tokio::time::Instant::now() + *d);
                let error = loop {
                    let first = match recheck {
                        Some(at) => tokio::select! {
                            flags = sub.next_flags() => flags,
                            () = tokio::time::sleep_until(at) => {
                                feed.join(&mut cursor).await;
                                recheck = rechecks.next().map(|d| tokio::time::Instant::now() + *d);
                                continue;
                            }
                        },
                        None => sub.next_flags().await,
                    };
                    let first = match first {
                        Ok(flags) => flags,
                        Err(e) => break e,
                    };
                    match sub.finish(first).await {
                        Ok(None) => {}
                        Ok(Some(frames)) => {
                            // A connection that delivers is healthy: the next failure retries soon.
                            backoff = BACKOFF.0;
                            recheck = None;
                            feed.on_message(&frames, &mut cursor).await;
                        }
                        Err(e) => break e,
                    }
                };
                feed.status.connected.store(false, Ordering::Relaxed);
                error
            }
        };
        feed.connection_failed(FeedSocket::Events, &error);
        // Also after a connection that broke without delivering anything: a peer that accepts
        // and then sends garbage must not make the feed spin.
        tokio::time::sleep(backoff).await;
        backoff = (backoff * 2).min(BACKOFF.1);
    }
}

/// Connects the feed's SUB and subscribes it.
async fn subscribe(feed: &Feed) -> Result<zmtp::Connection, ZmtpError> {
    let mut sub = zmtp::connect(&feed.endpoints.events, SocketType::Sub, feed.limits).await?;
    sub.subscribe(feed.endpoints.topic.as_bytes()).await?;
    Ok(sub)
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
                dialect: Dialect::Vllm,
            },
            limits: Limits::default(),
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
