//! Per-tenant quotas: a token-rate bucket (work per second, with a burst) and an in-flight
//! count. Pure: callers pass milliseconds.

/// A token bucket of `rate` work units per second holding at most `burst`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct TokenBucket {
    rate: f64,
    burst: f64,
    level: f64,
    at_ms: u64,
}

impl TokenBucket {
    /// A full bucket at `now_ms`.
    pub fn new(rate_per_s: u64, burst: u64, now_ms: u64) -> Self {
        TokenBucket {
            rate: rate_per_s as f64,
            burst: burst as f64,
            level: burst as f64,
            at_ms: now_ms,
        }
    }

    fn refill(&mut self, now_ms: u64) {
        let dt = now_ms.saturating_sub(self.at_ms) as f64 / 1000.0;
        self.level = (self.level + dt * self.rate).min(self.burst);
        self.at_ms = self.at_ms.max(now_ms);
    }

    /// Takes `n` units when the bucket holds them (a request larger than the burst is allowed
    /// from a full bucket, so it is not refused forever); `false` leaves the bucket as it was.
    pub fn take(&mut self, n: u64, now_ms: u64) -> bool {
        self.refill(now_ms);
        let n = n as f64;
        if self.level >= n || self.level >= self.burst {
            self.level -= n;
            true
        } else {
            false
        }
    }

    /// Puts back `n` units taken for a request that was then refused (never above the burst).
    pub fn refund(&mut self, n: u64) {
        self.level = (self.level + n as f64).min(self.burst);
    }

    /// Whether the bucket is full at `now_ms` (it can then be forgotten: a new one is the same).
    pub fn is_full(&mut self, now_ms: u64) -> bool {
        self.refill(now_ms);
        self.level >= self.burst
    }

    /// Seconds until `n` units are available (at least 1).
    pub fn seconds_until(&self, n: u64) -> u32 {
        let need = (n as f64).min(self.burst) - self.level;
        if need <= 0.0 || self.rate <= 0.0 {
            return 1;
        }
        (need / self.rate).ceil().clamp(1.0, 3600.0) as u32
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_bucket_refills_at_its_rate_up_to_its_burst() {
        let mut b = TokenBucket::new(1000, 2000, 0);
        assert!(b.take(1500, 0));
        assert!(!b.take(1000, 0), "500 left");
        assert_eq!(b.seconds_until(1000), 1);
        assert!(b.take(1000, 500), "refilled 500 in 0.5 s");
        assert!(!b.is_full(500));
        assert!(b.is_full(10_000), "capped at the burst");
        assert!(b.take(2000, 10_000) && !b.take(1, 10_000));
        // Larger than the burst: allowed from a full bucket only.
        assert!(!b.take(5000, 11_000));
        assert!(b.take(5000, 12_000));
        assert_eq!(b.seconds_until(2000), 5);
        // A refused request's units come back, up to the burst.
        let mut b = TokenBucket::new(1000, 2000, 0);
        assert!(b.take(1500, 0) && !b.take(1000, 0));
        b.refund(1500);
        assert!(b.is_full(0));
        b.refund(1500);
        assert!(b.take(2000, 0) && !b.take(1, 0), "not above the burst");
    }
}
