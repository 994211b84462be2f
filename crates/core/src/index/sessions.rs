//! Which sequence each engine session last stored on one worker (vLLM's and SGLang's
//! `session_id` on stored blocks): the session's newest block, kept with the worker's state so
//! session affinity can ask whether a worker still holds a session's prefix.
//!
//! Bounded: at most [`MAX_SESSIONS_PER_WORKER`] sessions per worker, the least recently noted
//! forgotten first; a session id is at most the decoder's cap (256 bytes), so one worker's map
//! costs at most a few MiB whatever an engine sends.

use std::collections::{HashMap, VecDeque};

use super::EngineBlockHash;

/// Most sessions remembered per worker.
pub const MAX_SESSIONS_PER_WORKER: usize = 4_096;

/// One worker's sessions: id → the newest block a store of that session named.
#[derive(Default)]
pub(crate) struct SessionTails {
    tails: HashMap<String, (EngineBlockHash, u64)>,
    /// Insertion order with the stamp each entry had then; stale entries are skipped on eviction.
    order: VecDeque<(String, u64)>,
    stamp: u64,
}

impl SessionTails {
    /// Records that `session` last stored `tail`.
    pub(crate) fn note(&mut self, session: &str, tail: EngineBlockHash) {
        self.stamp += 1;
        let stamp = self.stamp;
        self.tails.insert(session.to_owned(), (tail, stamp));
        self.order.push_back((session.to_owned(), stamp));
        while self.tails.len() > MAX_SESSIONS_PER_WORKER
            || self.order.len() > 2 * MAX_SESSIONS_PER_WORKER
        {
            let Some((old, at)) = self.order.pop_front() else {
                break;
            };
            if self.tails.get(&old).is_some_and(|(_, s)| *s == at) {
                self.tails.remove(&old);
            }
        }
    }

    /// The newest block `session` stored, if remembered.
    pub(crate) fn tail(&self, session: &str) -> Option<EngineBlockHash> {
        self.tails.get(session).map(|(t, _)| *t)
    }

    /// Forgets everything (the worker's blocks were dropped).
    pub(crate) fn clear(&mut self) {
        self.tails.clear();
        self.order.clear();
    }

    /// Sessions remembered.
    #[cfg(test)]
    fn len(&self) -> usize {
        self.tails.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn newest_tail_wins_and_the_map_stays_bounded() {
        let mut s = SessionTails::default();
        s.note("a", EngineBlockHash(1));
        s.note("a", EngineBlockHash(2));
        assert_eq!(s.tail("a"), Some(EngineBlockHash(2)));
        for i in 0..(3 * MAX_SESSIONS_PER_WORKER as u64) {
            s.note(&format!("s{i}"), EngineBlockHash(i));
            s.note("a", EngineBlockHash(7)); // a busy session stays
        }
        assert!(s.len() <= MAX_SESSIONS_PER_WORKER);
        assert!(s.order.len() <= 2 * MAX_SESSIONS_PER_WORKER);
        assert_eq!(s.tail("a"), Some(EngineBlockHash(7)));
        assert_eq!(s.tail("s0"), None);
        s.clear();
        assert_eq!(s.tail("a"), None);
    }
}
