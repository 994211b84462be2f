//! Scrapers' bearer tokens checked by the Kubernetes API ([`TokenReviewer`]), with a short
//! cache of the answers so a scrape every few seconds does not cost two API calls.
//!
//! Allowed tokens are cached for [`ALLOWED_TTL`], refused ones for [`REFUSED_TTL`], each keyed
//! by the token's SHA-256 (the cache never holds a token), in two maps of at most
//! [`MAX_ENTRIES`] so a flood of refused tokens cannot push allowed ones out; the one expiring
//! first makes room. Whoever reaches the port can send tokens, so the reviews they cause are
//! bounded: at most [`MAX_IN_FLIGHT`] at once and [`REVIEWS_PER_SECOND`] (with a burst of as
//! many); beyond, the request is answered 503 without asking. A review that fails or times out
//! is an answer of its own (503), never an allowance, and is not cached.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use sha2::{Digest, Sha256};

use super::{Denied, Refusal, Verdict};
use crate::discovery::{Review, TokenReviewer};

/// How long an allowed token is trusted without asking again.
const ALLOWED_TTL: Duration = Duration::from_secs(60);
/// Most tokens remembered at once.
const MAX_ENTRIES: usize = 1024;
/// Longest wait for the API's answer.
const REVIEW_TIMEOUT: Duration = Duration::from_secs(5);
/// How long a refused token is refused without asking again (a token just granted the right
/// waits at most this long).
const REFUSED_TTL: Duration = Duration::from_secs(30);
/// Most reviews waiting for the API at once.
const MAX_IN_FLIGHT: usize = 4;
/// Reviews asked per second, on average (and in a burst).
const REVIEWS_PER_SECOND: u64 = 20;
/// How long a token allowed before is re-checked outside those bounds once its allowance ended:
/// a scraper keeps being served while made-up tokens hold every review slot.
const KNOWN_TTL: Duration = Duration::from_secs(600);

type Key = [u8; 32];

/// Tokens (by hash), an answer for each and when it ends; at most [`MAX_ENTRIES`], the one
/// ending first making room. Pure: the caller passes the time.
#[derive(Debug)]
struct Answers<V> {
    until: HashMap<Key, (Instant, V)>,
}

impl<V> Default for Answers<V> {
    fn default() -> Self {
        Answers {
            until: HashMap::new(),
        }
    }
}

impl<V: Copy> Answers<V> {
    fn get(&self, key: &Key, now: Instant) -> Option<V> {
        self.until
            .get(key)
            .filter(|(u, _)| now < *u)
            .map(|(_, v)| *v)
    }

    fn insert_for(&mut self, key: Key, now: Instant, ttl: Duration, answer: V) {
        if self.until.len() >= MAX_ENTRIES && !self.until.contains_key(&key) {
            self.until.retain(|_, (u, _)| now < *u);
            if self.until.len() >= MAX_ENTRIES
                && let Some(first) = self
                    .until
                    .iter()
                    .min_by_key(|(_, (u, _))| *u)
                    .map(|(k, _)| *k)
            {
                self.until.remove(&first);
            }
        }
        self.until.insert(key, (now + ttl, answer));
    }
}

/// Allowed tokens.
type AllowedCache = Answers<()>;

impl AllowedCache {
    fn allows(&self, key: &Key, now: Instant) -> bool {
        self.get(key, now).is_some()
    }

    fn insert(&mut self, key: Key, now: Instant) {
        self.insert_for(key, now, ALLOWED_TTL, ());
    }
}

/// TokenReview (and SubjectAccessReview) behind a cache of answers and a bound on the reviews
/// asked.
pub(crate) struct Reviews {
    reviewer: TokenReviewer,
    cache: Mutex<AllowedCache>,
    /// Tokens allowed within [`KNOWN_TTL`]: their re-check skips the bounds on reviews.
    known: Mutex<AllowedCache>,
    /// Refused tokens and why (the same answer again until it ends).
    refused: Mutex<Answers<Refusal>>,
    in_flight: tokio::sync::Semaphore,
    rate: Mutex<(crate::flow::quota::TokenBucket, Instant)>,
}

impl Reviews {
    pub(crate) fn new(reviewer: TokenReviewer) -> Reviews {
        let n = REVIEWS_PER_SECOND;
        Reviews {
            reviewer,
            cache: Mutex::new(AllowedCache::default()),
            known: Mutex::new(AllowedCache::default()),
            refused: Mutex::new(Answers::default()),
            in_flight: tokio::sync::Semaphore::new(MAX_IN_FLIGHT),
            rate: Mutex::new((
                crate::flow::quota::TokenBucket::new(n, n, 0),
                Instant::now(),
            )),
        }
    }

    fn remember_refused(&self, key: Key, why: Refusal) {
        let now = Instant::now();
        self.refused.lock().insert_for(key, now, REFUSED_TTL, why);
    }

    /// Whether a review may be asked now (the rate's bucket holds one).
    fn may_ask(&self, now: Instant) -> bool {
        let mut rate = self.rate.lock();
        let ms = now.saturating_duration_since(rate.1).as_millis() as u64;
        rate.0.take(1, ms)
    }

    /// Whether `token` may read what the reviewer guards: from the cache, else from the API
    /// (at most [`REVIEW_TIMEOUT`]).
    pub(crate) async fn verify(&self, token: &str) -> Verdict {
        let key: Key = Sha256::digest(token.as_bytes()).into();
        let now = Instant::now();
        if self.cache.lock().allows(&key, now) {
            return Ok(());
        }
        if let Some(why) = self.refused.lock().get(&key, now) {
            return Err(Denied::Refused(why));
        }
        let busy = || Denied::Unavailable("too many token reviews asked; try again".into());
        // Made-up tokens cannot crowd out a scraper allowed before: its re-check is not bounded
        // (it comes once a minute per such token, and only tokens the API allowed get there).
        let known = self.known.lock().allows(&key, now);
        let _permit = match self.in_flight.try_acquire() {
            Ok(p) => Some(p),
            Err(_) if known => None,
            Err(_) => return Err(busy()),
        };
        if !known && !self.may_ask(now) {
            return Err(busy());
        }
        let review = tokio::time::timeout(REVIEW_TIMEOUT, self.reviewer.review(token)).await;
        match review {
            Ok(Ok(Review::Allowed { .. })) => {
                let now = Instant::now();
                self.cache.lock().insert(key, now);
                self.known.lock().insert_for(key, now, KNOWN_TTL, ());
                Ok(())
            }
            Ok(Ok(Review::Unauthenticated)) => {
                self.remember_refused(key, Refusal::InvalidToken);
                Err(Denied::Refused(Refusal::InvalidToken))
            }
            Ok(Ok(Review::Forbidden { user, reason })) => {
                tracing::warn!(%user, %reason, path = self.reviewer.path(), "token review: this user may not read it");
                self.remember_refused(key, Refusal::Forbidden);
                Err(Denied::Refused(Refusal::Forbidden))
            }
            Ok(Err(e)) => Err(Denied::Unavailable(e.to_string())),
            Err(_) => Err(Denied::Unavailable(format!(
                "no answer from the Kubernetes API within {REVIEW_TIMEOUT:?}"
            ))),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(i: usize) -> Key {
        Sha256::digest(i.to_le_bytes()).into()
    }

    #[test]
    fn allowances_expire() {
        let (mut c, t0) = (AllowedCache::default(), Instant::now());
        assert!(!c.allows(&key(1), t0));
        c.insert(key(1), t0);
        assert!(c.allows(&key(1), t0 + ALLOWED_TTL - Duration::from_millis(1)));
        assert!(!c.allows(&key(1), t0 + ALLOWED_TTL));
        assert!(!c.allows(&key(2), t0));
    }

    #[test]
    fn the_cache_is_bounded_and_evicts_the_oldest_first() {
        let (mut c, t0) = (AllowedCache::default(), Instant::now());
        for i in 0..MAX_ENTRIES {
            c.insert(key(i), t0 + Duration::from_millis(i as u64));
        }
        let later = t0 + Duration::from_secs(1);
        c.insert(key(MAX_ENTRIES), later);
        assert_eq!(c.until.len(), MAX_ENTRIES);
        assert!(
            !c.allows(&key(0), later),
            "the allowance ending first made room"
        );
        assert!(c.allows(&key(1), later) && c.allows(&key(MAX_ENTRIES), later));
        // Expired entries go before any live one.
        let much_later = later + ALLOWED_TTL + Duration::from_secs(1);
        c.insert(key(MAX_ENTRIES + 1), much_later);
        assert_eq!(c.until.len(), 1);
        assert!(c.allows(&key(MAX_ENTRIES + 1), much_later));
    }
}
