//! The process-wide budget of request body bytes buffered before a decision.
//!
//! Every stream buffers its whole request body before routing (routing needs the prompt), so
//! `max_body_bytes` alone bounds one stream, not the process: many concurrent large bodies could
//! still exhaust memory. Each stream holds a [`Held`] guard for the bytes it buffers; growing it
//! past the budget fails (the edge answers 503), and dropping it returns its bytes, so every exit
//! path (decision, local reply, reset, error, panic) gives them back exactly once.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use prometheus_client::metrics::gauge::Gauge;

/// The shared budget: a limit and the bytes currently held, mirrored in a gauge.
#[derive(Clone)]
pub struct BodyBudget(Arc<Inner>);

struct Inner {
    limit: usize,
    used: AtomicUsize,
    gauge: Gauge,
}

impl std::fmt::Debug for BodyBudget {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BodyBudget")
            .field("limit", &self.0.limit)
            .field("used", &self.used())
            .finish()
    }
}

impl BodyBudget {
    /// A budget of `limit` bytes whose current use is exported through `gauge`.
    pub fn new(limit: usize, gauge: Gauge) -> Self {
        BodyBudget(Arc::new(Inner {
            limit,
            used: AtomicUsize::new(0),
            gauge,
        }))
    }

    /// The limit in bytes.
    pub fn limit(&self) -> usize {
        self.0.limit
    }

    /// Bytes held by all guards right now.
    pub fn used(&self) -> usize {
        self.0.used.load(Ordering::Acquire)
    }

    /// An empty guard drawing on this budget.
    pub fn hold(&self) -> Held {
        Held {
            budget: self.clone(),
            bytes: 0,
        }
    }
}

/// Bytes one stream holds from a [`BodyBudget`]; dropping it returns them.
#[derive(Debug)]
pub struct Held {
    budget: BodyBudget,
    bytes: usize,
}

/// Growing a [`Held`] would exceed the budget.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OverBudget;

impl Held {
    /// Takes `n` more bytes from the budget, or none if that would exceed it. Lock-free: one
    /// compare-and-swap loop on the shared counter.
    pub fn grow(&mut self, n: usize) -> Result<(), OverBudget> {
        let inner = &self.budget.0;
        inner
            .used
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |used| {
                used.checked_add(n).filter(|total| *total <= inner.limit)
            })
            .map_err(|_| OverBudget)?;
        self.bytes += n;
        inner.gauge.inc_by(n as i64);
        Ok(())
    }

    /// Bytes this guard holds.
    pub fn bytes(&self) -> usize {
        self.bytes
    }
}

impl Drop for Held {
    fn drop(&mut self) {
        if self.bytes > 0 {
            let inner = &self.budget.0;
            inner.used.fetch_sub(self.bytes, Ordering::AcqRel);
            inner.gauge.dec_by(self.bytes as i64);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn guards_share_the_limit_and_return_their_bytes_on_drop() {
        let gauge = Gauge::default();
        let budget = BodyBudget::new(10, gauge.clone());
        let mut a = budget.hold();
        let mut b = budget.hold();
        a.grow(6).unwrap();
        assert_eq!(b.grow(5), Err(OverBudget));
        b.grow(4).unwrap();
        assert_eq!((budget.used(), gauge.get()), (10, 10));
        assert_eq!(a.grow(1), Err(OverBudget));
        drop(a);
        assert_eq!((budget.used(), gauge.get()), (4, 4));
        b.grow(usize::MAX).unwrap_err();
        drop(b);
        assert_eq!((budget.used(), gauge.get()), (0, 0));
    }
}
