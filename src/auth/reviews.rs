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
    /// [`ALLOWED_TTL`] (tests shorten it).
    allowed_ttl: Duration,
}

impl Reviews {
    pub(crate) fn new(reviewer: TokenReviewer) -> Reviews {
        Reviews::with_allowed_ttl(reviewer, ALLOWED_TTL)
    }

    fn with_allowed_ttl(reviewer: TokenReviewer, allowed_ttl: Duration) -> Reviews {
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
            allowed_ttl,
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
                self.cache.lock().insert_for(key, now, self.allowed_ttl, ());
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
    use std::sync::Arc;

    use super::*;

    fn key(i: usize) -> Key {
        Sha256::digest(i.to_le_bytes()).into()
    }

    #[test]
    fn allowances_expire() {
        let (mut c, t0) = (AllowedCache::default(), Instant::now());
        assert!(!c.allows(&key(1), t0));
        c.insert_for(key(1), t0, ALLOWED_TTL, ());
        assert!(c.allows(&key(1), t0 + ALLOWED_TTL - Duration::from_millis(1)));
        assert!(!c.allows(&key(1), t0 + ALLOWED_TTL));
        assert!(!c.allows(&key(2), t0));
    }

    #[test]
    fn the_cache_is_bounded_and_evicts_the_oldest_first() {
        let (mut c, t0) = (AllowedCache::default(), Instant::now());
        for i in 0..MAX_ENTRIES {
            c.insert_for(
                key(i),
                t0 + Duration::from_millis(i as u64),
                ALLOWED_TTL,
                (),
            );
        }
        let later = t0 + Duration::from_secs(1);
        c.insert_for(key(MAX_ENTRIES), later, ALLOWED_TTL, ());
        assert_eq!(c.until.len(), MAX_ENTRIES);
        assert!(
            !c.allows(&key(0), later),
            "the allowance ending first made room"
        );
        assert!(c.allows(&key(1), later) && c.allows(&key(MAX_ENTRIES), later));
        // Expired entries go before any live one.
        let much_later = later + ALLOWED_TTL + Duration::from_secs(1);
        c.insert_for(key(MAX_ENTRIES + 1), much_later, ALLOWED_TTL, ());
        assert_eq!(c.until.len(), 1);
        assert!(c.allows(&key(MAX_ENTRIES + 1), much_later));
    }

    /// A Kubernetes API that answers TokenReviews and SubjectAccessReviews: `scraper` is a
    /// service account allowed to read, any other token is unknown; a review of a token named
    /// `stuck-*` is answered only once `gate` opens. Counts the TokenReviews per token.
    fn fake_api(
        gate: Arc<tokio::sync::Semaphore>,
        asked: Arc<parking_lot::Mutex<HashMap<String, usize>>>,
    ) -> kube::Client {
        use http_body_util::{BodyExt, Full};
        let service = tower::service_fn(move |req: axum::http::Request<kube::client::Body>| {
            let (gate, asked) = (gate.clone(), asked.clone());
            async move {
                let path = req.uri().path().to_owned();
                let body = req.into_body().collect().await?.to_bytes();
                let mut v: serde_json::Value = serde_json::from_slice(&body)?;
                if path.ends_with("/tokenreviews") {
                    let token = v["spec"]["token"].as_str().unwrap_or_default().to_owned();
                    *asked.lock().entry(token.clone()).or_default() += 1;
                    if token.starts_with("stuck-") {
                        let _open = gate.acquire().await?;
                    }
                    v["status"] = if token == "scraper" {
                        serde_json::json!({"authenticated": true, "user": {"username": "system:serviceaccount:mon:prom"}})
                    } else {
                        serde_json::json!({"authenticated": false})
                    };
                } else {
                    v["status"] = serde_json::json!({"allowed": true});
                }
                let out = serde_json::to_vec(&v)?;
                Ok::<_, Box<dyn std::error::Error + Send + Sync>>(axum::http::Response::new(
                    Full::new(bytes::Bytes::from(out)),
                ))
            }
        });
        kube::Client::new(service, "default")
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_scraper_allowed_before_is_served_while_made_up_tokens_hold_every_review() {
        let gate = Arc::new(tokio::sync::Semaphore::new(0));
        let asked = Arc::new(parking_lot::Mutex::new(HashMap::new()));
        let client = fake_api(gate.clone(), asked.clone());
        // Allowances end after 50 ms here (a minute in service), so the scraper's next call
        // is a re-check, as a minute later in service.
        let ttl = Duration::from_millis(50);
        let reviews = Arc::new(Reviews::with_allowed_ttl(
            TokenReviewer::new(client, "/metrics"),
            ttl,
        ));
        assert!(
            reviews.verify("scraper").await.is_ok(),
            "the scraper is allowed"
        );
        assert!(matches!(
            reviews.verify("made-up").await,
            Err(Denied::Refused(Refusal::InvalidToken))
        ));
        // Made-up tokens take every review slot and hold it.
        let stuck: Vec<_> = (0..MAX_IN_FLIGHT)
            .map(|i| {
                let reviews = reviews.clone();
                tokio::spawn(async move { reviews.verify(&format!("stuck-{i}")).await })
            })
            .collect();
        let deadline = Instant::now() + Duration::from_secs(30);
        while reviews.in_flight.available_permits() > 0 {
            assert!(Instant::now() < deadline, "the stuck reviews never started");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        // Any other token is turned away without asking ...
        assert!(matches!(
            reviews.verify("another-made-up").await,
            Err(Denied::Unavailable(_))
        ));
        assert_eq!(asked.lock().get("another-made-up"), None, "not asked");
        // ... but the scraper, once its allowance has ended, is checked again and served.
        let key: Key = Sha256::digest(b"scraper").into();
        while reviews.cache.lock().allows(&key, Instant::now()) {
            assert!(Instant::now() < deadline, "the allowance never ended");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        assert!(
            reviews.verify("scraper").await.is_ok(),
            "a scraper allowed before is served while made-up tokens hold every review"
        );
        assert_eq!(
            asked.lock().get("scraper"),
            Some(&2),
            "it was checked again"
        );
        gate.add_permits(MAX_IN_FLIGHT);
        for s in stuck {
            assert!(matches!(
                s.await.expect("review"),
                Err(Denied::Refused(Refusal::InvalidToken))
            ));
        }
        assert_eq!(reviews.in_flight.available_permits(), MAX_IN_FLIGHT);
    }
}
