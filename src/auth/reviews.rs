//! Scrapers' bearer tokens checked by the Kubernetes API ([`TokenReviewer`]), with a short
//! cache of the tokens it allowed so a scrape every few seconds does not cost two API calls.
//!
//! Only allowed tokens are cached, each for [`ALLOWED_TTL`], keyed by the token's SHA-256 (the
//! cache never holds a token); at most [`MAX_ENTRIES`] are kept, the one expiring first making
//! room. A review that fails or times out is an answer of its own (503), never an allowance.

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

type Key = [u8; 32];

/// Allowed tokens (by hash) and when each allowance ends. Pure: the caller passes the time.
#[derive(Debug, Default)]
struct AllowedCache {
    until: HashMap<Key, Instant>,
}

impl AllowedCache {
    fn allows(&self, key: &Key, now: Instant) -> bool {
        self.until.get(key).is_some_and(|u| now < *u)
    }

    fn insert(&mut self, key: Key, now: Instant) {
        if self.until.len() >= MAX_ENTRIES && !self.until.contains_key(&key) {
            self.until.retain(|_, u| now < *u);
            if self.until.len() >= MAX_ENTRIES
                && let Some(first) = self.until.iter().min_by_key(|(_, u)| **u).map(|(k, _)| *k)
            {
                self.until.remove(&first);
            }
        }
        self.until.insert(key, now + ALLOWED_TTL);
    }
}

/// TokenReview (and SubjectAccessReview) behind a cache of allowed tokens.
pub(crate) struct Reviews {
    reviewer: TokenReviewer,
    cache: Mutex<AllowedCache>,
}

impl Reviews {
    pub(crate) fn new(reviewer: TokenReviewer) -> Reviews {
        Reviews {
            reviewer,
            cache: Mutex::new(AllowedCache::default()),
        }
    }

    /// Whether `token` may read what the reviewer guards: from the cache, else from the API
    /// (at most [`REVIEW_TIMEOUT`]).
    pub(crate) async fn verify(&self, token: &str) -> Verdict {
        let key: Key = Sha256::digest(token.as_bytes()).into();
        if self.cache.lock().allows(&key, Instant::now()) {
            return Ok(());
        }
        let review = tokio::time::timeout(REVIEW_TIMEOUT, self.reviewer.review(token)).await;
        match review {
            Ok(Ok(Review::Allowed { .. })) => {
                self.cache.lock().insert(key, Instant::now());
                Ok(())
            }
            Ok(Ok(Review::Unauthenticated)) => Err(Denied::Refused(Refusal::InvalidToken)),
            Ok(Ok(Review::Forbidden { user, reason })) => {
                tracing::warn!(%user, %reason, path = self.reviewer.path(), "token review: this user may not read it");
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
