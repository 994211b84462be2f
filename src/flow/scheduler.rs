//! The fair queue: per-tenant FIFO queues inside priority bands, served in weighted fair order
//! measured in work.
//!
//! - **Bands**: a higher band's tenants are always offered capacity first.
//! - **Within a band**: each tenant has a virtual counter, the work it has been served divided by
//!   its weight (work = prompt tokens + expected decode tokens, the virtual-token-counter way, so
//!   a tenant of long prompts cannot crowd out one of short ones by request count). The tenant
//!   with the lowest counter goes next. A tenant that was idle re-enters at the band's current
//!   virtual time (the counter of the last tenant served), never below it, so idling does not
//!   bank credit that would later starve the others.
//! - **Per tenant**: FIFO; only the head is offered. A head that cannot be placed yet (its model
//!   saturated, or waiting for its cached worker) does not block other tenants.
//!
//! Limits (total and per tenant, in requests and bytes) are checked on [`Scheduler::push`].
//! Pure: no clock (callers pass milliseconds), no I/O, no locks; the caller serialises access.

use std::collections::{HashMap, VecDeque};
use std::hash::Hash;

/// Queue limits; `push` refuses beyond them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct QueueLimits {
    /// Requests queued across all tenants.
    pub max_requests: usize,
    /// Body bytes queued across all tenants.
    pub max_bytes: usize,
    /// Requests queued per tenant.
    pub max_requests_per_tenant: usize,
    /// Body bytes queued per tenant.
    pub max_bytes_per_tenant: usize,
}

/// Which queue limit a refused push hit.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Full {
    /// `max_requests`.
    TotalRequests,
    /// `max_bytes`.
    TotalBytes,
    /// `max_requests_per_tenant`.
    TenantRequests,
    /// `max_bytes_per_tenant`.
    TenantBytes,
}

impl Full {
    /// The configuration field of the limit (for the refusal's message).
    pub fn field(self) -> &'static str {
        match self {
            Full::TotalRequests => "flow_control.max_queued_requests",
            Full::TotalBytes => "flow_control.max_queued_bytes",
            Full::TenantRequests => "flow_control.max_queued_requests_per_tenant",
            Full::TenantBytes => "flow_control.max_queued_bytes_per_tenant",
        }
    }
}

/// How a tenant is served: its band and its weight within the band.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Share {
    /// Priority band; higher first.
    pub band: u8,
    /// Weight within the band (> 0).
    pub weight: f64,
}

/// What an offered head answers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Offer {
    /// It was placed: leave the queue (the caller has what it needs in the item).
    Taken,
    /// Not yet: stay at the head.
    Wait,
}

struct Entry<T> {
    id: u64,
    cost: u64,
    bytes: usize,
    at_ms: u64,
    item: T,
}

struct TenantQueue<T> {
    share: Share,
    vtime: f64,
    bytes: usize,
    entries: VecDeque<Entry<T>>,
}

/// One tenant's queue as `/debug/queues` shows it.
#[derive(Clone, Debug, PartialEq)]
pub struct TenantView<K> {
    /// The tenant.
    pub tenant: K,
    /// Its band and weight.
    pub share: Share,
    /// Queued requests.
    pub requests: usize,
    /// Queued body bytes.
    pub bytes: usize,
    /// Its virtual counter (work served / weight).
    pub vtime: f64,
    /// Enqueue time of its oldest request, ms.
    pub oldest_ms: u64,
}

/// Per-tenant fair queues; `K` names a tenant, `T` is what the caller keeps per request.
pub struct Scheduler<K, T> {
    limits: QueueLimits,
    tenants: HashMap<K, TenantQueue<T>>,
    /// Where each queued id lives.
    ids: HashMap<u64, K>,
    /// Per band: the virtual time of the last tenant served (idle tenants re-enter here).
    floors: HashMap<u8, f64>,
    next_id: u64,
    requests: usize,
    bytes: usize,
}

impl<K: Clone + Eq + Hash, T> Scheduler<K, T> {
    /// An empty scheduler under `limits`.
    pub fn new(limits: QueueLimits) -> Self {
        Scheduler {
            limits,
            tenants: HashMap::new(),
            ids: HashMap::new(),
            floors: HashMap::new(),
            next_id: 0,
            requests: 0,
            bytes: 0,
        }
    }

    /// Queued requests.
    pub fn len(&self) -> usize {
        self.requests
    }

    /// Whether nothing is queued.
    pub fn is_empty(&self) -> bool {
        self.requests == 0
    }

    /// Queued body bytes.
    pub fn bytes(&self) -> usize {
        self.bytes
    }

    /// Queues `item` for `tenant` (served as `share`), costing `cost` work units and holding
    /// `bytes`, at `now_ms`; its id, or which limit refused it.
    pub fn push(
        &mut self,
        tenant: K,
        share: Share,
        cost: u64,
        bytes: usize,
        now_ms: u64,
        item: T,
    ) -> Result<u64, Full> {
        let l = &self.limits;
        if self.requests >= l.max_requests {
            return Err(Full::TotalRequests);
        }
        if self.bytes.saturating_add(bytes) > l.max_bytes {
            return Err(Full::TotalBytes);
        }
        if let Some(q) = self.tenants.get(&tenant) {
            if q.entries.len() >= l.max_requests_per_tenant {
                return Err(Full::TenantRequests);
            }
            if q.bytes.saturating_add(bytes) > l.max_bytes_per_tenant {
                return Err(Full::TenantBytes);
            }
        } else if l.max_requests_per_tenant == 0 {
            return Err(Full::TenantRequests);
        } else if bytes > l.max_bytes_per_tenant {
            return Err(Full::TenantBytes);
        }
        let floor = self.floors.get(&share.band).copied().unwrap_or(0.0);
        // A tenant that was idle enters at the band's virtual time, never below.
        let q = self
            .tenants
            .entry(tenant.clone())
            .or_insert_with(|| TenantQueue {
                share,
                vtime: floor,
                bytes: 0,
                entries: VecDeque::new(),
            });
        q.share = share;
        let id = self.next_id;
        self.next_id += 1;
        q.bytes += bytes;
        q.entries.push_back(Entry {
            id,
            cost,
            bytes,
            at_ms: now_ms,
            item,
        });
        self.ids.insert(id, tenant);
        self.requests += 1;
        self.bytes += bytes;
        Ok(id)
    }

    /// Removes a queued request (its client went away, or it timed out); `None` when it already
    /// left the queue.
    pub fn cancel(&mut self, id: u64) -> Option<T> {
        let tenant = self.ids.remove(&id)?;
        let q = self.tenants.get_mut(&tenant)?;
        let pos = q.entries.iter().position(|e| e.id == id)?;
        let e = q.entries.remove(pos)?;
        self.forget(&tenant, e.bytes);
        Some(e.item)
    }

    /// Removes every request queued at or before `now_ms - timeout_ms`, oldest first per tenant.
    pub fn expire(&mut self, now_ms: u64, timeout_ms: u64) -> Vec<T> {
        let mut out = Vec::new();
        let keys: Vec<K> = self.tenants.keys().cloned().collect();
        for k in keys {
            while let Some(q) = self.tenants.get_mut(&k) {
                match q.entries.front() {
                    Some(e) if e.at_ms.saturating_add(timeout_ms) <= now_ms => {}
                    _ => break,
                }
                let e = q.entries.pop_front().expect("front checked");
                self.ids.remove(&e.id);
                self.forget(&k, e.bytes);
                out.push(e.item);
            }
        }
        out
    }

    /// Offers capacity to the queued heads in fair order until none takes it: highest band
    /// first, then the lowest virtual counter, then the oldest head. `offer` sees the head's item
    /// and its enqueue time; a head that answers [`Offer::Taken`] leaves the queue (returned, in
    /// dispatch order) and its tenant is charged its cost / weight.
    pub fn dispatch(&mut self, mut offer: impl FnMut(&mut T, u64) -> Offer) -> Vec<T> {
        let mut out = Vec::new();
        loop {
            let mut order: Vec<(u8, f64, u64, K)> = self
                .tenants
                .iter()
                .filter_map(|(k, q)| {
                    let head = q.entries.front()?;
                    Some((q.share.band, q.vtime, head.id, k.clone()))
                })
                .collect();
            order.sort_by(|a, b| b.0.cmp(&a.0).then(a.1.total_cmp(&b.1)).then(a.2.cmp(&b.2)));
            let mut taken = false;
            for (band, _, _, k) in order {
                let q = self.tenants.get_mut(&k).expect("listed tenant");
                let head = q.entries.front_mut().expect("listed head");
                if offer(&mut head.item, head.at_ms) == Offer::Wait {
                    continue;
                }
                let e = q.entries.pop_front().expect("head");
                let floor = self.floors.entry(band).or_insert(0.0);
                *floor = floor.max(q.vtime);
                q.vtime += e.cost as f64 / q.share.weight;
                self.ids.remove(&e.id);
                self.forget(&k, e.bytes);
                out.push(e.item);
                taken = true;
                // Counters changed: recompute the order before offering again.
                break;
            }
            if !taken {
                return out;
            }
        }
    }

    /// Every tenant with something queued.
    pub fn view(&self) -> Vec<TenantView<K>> {
        self.tenants
            .iter()
            .map(|(k, q)| TenantView {
                tenant: k.clone(),
                share: q.share,
                requests: q.entries.len(),
                bytes: q.bytes,
                vtime: q.vtime,
                oldest_ms: q.entries.front().map_or(0, |e| e.at_ms),
            })
            .collect()
    }

    /// The oldest queued request of one tenant.
    pub fn head(&self, tenant: &K) -> Option<&T> {
        self.tenants.get(tenant)?.entries.front().map(|e| &e.item)
    }

    /// Queued requests of one tenant.
    pub fn tenant_len(&self, tenant: &K) -> usize {
        self.tenants.get(tenant).map_or(0, |q| q.entries.len())
    }

    fn forget(&mut self, tenant: &K, bytes: usize) {
        self.requests -= 1;
        self.bytes -= bytes;
        if let Some(q) = self.tenants.get_mut(tenant) {
            q.bytes -= bytes;
            if q.entries.is_empty() {
                // Idle tenants keep no state: memory is bounded by what is queued.
                self.tenants.remove(tenant);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const LIMITS: QueueLimits = QueueLimits {
        max_requests: 1000,
        max_bytes: 1 << 20,
        max_requests_per_tenant: 100,
        max_bytes_per_tenant: 1 << 16,
    };

    fn share(band: u8, weight: f64) -> Share {
        Share { band, weight }
    }

    /// Dispatches `n` requests, one per offer round, and returns their tenants in order.
    fn serve(s: &mut Scheduler<&'static str, &'static str>, n: usize) -> Vec<&'static str> {
        let mut out = Vec::new();
        for _ in 0..n {
            let mut budget = 1;
            let got = s.dispatch(|_, _| {
                if budget == 0 {
                    Offer::Wait
                } else {
                    budget -= 1;
                    Offer::Taken
                }
            });
            out.extend(got);
        }
        out
    }

    #[test]
    fn equal_weights_alternate_even_against_a_flood() {
        let mut s = Scheduler::new(LIMITS);
        for _ in 0..50 {
            s.push("flood", share(0, 1.0), 100, 10, 0, "flood").unwrap();
        }
        for _ in 0..5 {
            s.push("calm", share(0, 1.0), 100, 10, 1, "calm").unwrap();
        }
        let order = serve(&mut s, 10);
        assert_eq!(
            order.iter().filter(|t| **t == "calm").count(),
            5,
            "{order:?}"
        );
        // Strict alternation while both are backlogged.
        assert!(order.windows(2).all(|w| w[0] != w[1]), "{order:?}");
    }

    #[test]
    fn fair_share_is_measured_in_work_not_requests() {
        let mut s = Scheduler::new(LIMITS);
        for _ in 0..40 {
            s.push("long", share(0, 1.0), 4000, 10, 0, "long").unwrap();
            s.push("short", share(0, 1.0), 1000, 10, 0, "short")
                .unwrap();
        }
        let order = serve(&mut s, 25);
        let short = order.iter().filter(|t| **t == "short").count();
        // Equal work: four short requests per long one.
        assert!((19..=21).contains(&short), "{short} short of 25: {order:?}");
    }

    #[test]
    fn weights_divide_work_in_proportion() {
        let mut s = Scheduler::new(LIMITS);
        for _ in 0..60 {
            s.push("gold", share(0, 3.0), 100, 1, 0, "gold").unwrap();
            s.push("base", share(0, 1.0), 100, 1, 0, "base").unwrap();
        }
        let order = serve(&mut s, 40);
        let gold = order.iter().filter(|t| **t == "gold").count();
        assert!((29..=31).contains(&gold), "{gold} of 40");
    }

    #[test]
    fn a_higher_band_always_goes_first() {
        let mut s = Scheduler::new(LIMITS);
        for _ in 0..5 {
            s.push("batch", share(0, 100.0), 1, 1, 0, "batch").unwrap();
        }
        for _ in 0..3 {
            s.push("interactive", share(2, 1.0), 10_000, 1, 5, "interactive")
                .unwrap();
        }
        let order = serve(&mut s, 8);
        assert_eq!(&order[..3], &["interactive"; 3]);
        assert_eq!(&order[3..], &["batch"; 5]);
    }

    #[test]
    fn a_head_that_waits_does_not_block_other_tenants() {
        let mut s = Scheduler::new(LIMITS);
        s.push("a", share(0, 1.0), 1, 1, 0, "a-model-x").unwrap();
        s.push("b", share(0, 1.0), 1, 1, 0, "b-model-y").unwrap();
        let got = s.dispatch(|item, _| {
            if item.starts_with('a') {
                Offer::Wait
            } else {
                Offer::Taken
            }
        });
        assert_eq!(got, vec!["b-model-y"]);
        assert_eq!(s.len(), 1);
    }

    #[test]
    fn an_idle_tenant_banks_no_credit() {
        let mut s = Scheduler::new(LIMITS);
        for _ in 0..20 {
            s.push("busy", share(0, 1.0), 100, 1, 0, "busy").unwrap();
        }
        serve(&mut s, 10);
        // A newcomer enters at the band's virtual time: it alternates, it does not get 10 in a row.
        for _ in 0..10 {
            s.push("late", share(0, 1.0), 100, 1, 0, "late").unwrap();
        }
        let order = serve(&mut s, 6);
        assert!(
            order.iter().filter(|t| **t == "late").count() <= 4,
            "{order:?}"
        );
        assert!(order.contains(&"busy"), "{order:?}");
    }

    #[test]
    fn limits_refuse_and_name_their_field() {
        let mut s: Scheduler<&str, u32> = Scheduler::new(QueueLimits {
            max_requests: 3,
            max_bytes: 100,
            max_requests_per_tenant: 2,
            max_bytes_per_tenant: 60,
        });
        s.push("a", share(0, 1.0), 1, 10, 0, 1).unwrap();
        s.push("a", share(0, 1.0), 1, 10, 0, 2).unwrap();
        assert_eq!(
            s.push("a", share(0, 1.0), 1, 10, 0, 3),
            Err(Full::TenantRequests)
        );
        assert_eq!(
            s.push("b", share(0, 1.0), 1, 61, 0, 3),
            Err(Full::TenantBytes)
        );
        assert_eq!(
            s.push("b", share(0, 1.0), 1, 90, 0, 3),
            Err(Full::TotalBytes)
        );
        s.push("b", share(0, 1.0), 1, 10, 0, 3).unwrap();
        assert_eq!(
            s.push("c", share(0, 1.0), 1, 1, 0, 4),
            Err(Full::TotalRequests)
        );
        assert!(Full::TotalBytes.field().starts_with("flow_control."));
    }

    #[test]
    fn cancel_and_expiry_leave_nothing_behind() {
        let mut s: Scheduler<&str, u32> = Scheduler::new(LIMITS);
        let a = s.push("a", share(0, 1.0), 1, 7, 0, 1).unwrap();
        s.push("a", share(0, 1.0), 1, 7, 50, 2).unwrap();
        s.push("b", share(0, 1.0), 1, 7, 100, 3).unwrap();
        assert_eq!(s.cancel(a), Some(1));
        assert_eq!(s.cancel(a), None, "cancelled once");
        assert_eq!(s.expire(140, 90), vec![2]);
        assert_eq!((s.len(), s.bytes()), (1, 7));
        assert_eq!(s.expire(190, 90), vec![3]);
        assert_eq!((s.len(), s.bytes()), (0, 0));
        assert!(s.view().is_empty(), "no per-tenant state once idle");
        // A dispatched request can no longer be cancelled.
        let id = s.push("c", share(0, 1.0), 1, 1, 0, 9).unwrap();
        assert_eq!(s.dispatch(|_, _| Offer::Taken), vec![9]);
        assert_eq!(s.cancel(id), None);
    }
}
