//! Readiness: the replica reports ready on its gRPC health port only when every condition that
//! gates it holds (the index bootstrapped from a peer, worker discovery in step with the API).
//! Liveness never depends on these: a replica that is alive but not ready keeps running and
//! keeps retrying; the kubelet and peers just do not send it work yet.

use std::collections::BTreeMap;
use std::sync::Arc;

use parking_lot::Mutex;
use tokio::sync::watch;

/// The named conditions and a watch of the overall state.
#[derive(Clone)]
pub struct Readiness {
    inner: Arc<Inner>,
}

struct Inner {
    conditions: Mutex<BTreeMap<&'static str, (bool, String)>>,
    tx: watch::Sender<bool>,
}

impl Default for Readiness {
    fn default() -> Self {
        let (tx, _) = watch::channel(true);
        Readiness {
            inner: Arc::new(Inner {
                conditions: Mutex::new(BTreeMap::new()),
                tx,
            }),
        }
    }
}

impl Readiness {
    /// Sets a condition (created on first use) and recomputes the overall state. `why` says what
    /// is missing when the condition does not hold.
    pub fn set(&self, name: &'static str, ok: bool, why: impl Into<String>) {
        let mut c = self.inner.conditions.lock();
        c.insert(name, (ok, if ok { String::new() } else { why.into() }));
        let all = c.values().all(|(ok, _)| *ok);
        self.inner.tx.send_if_modified(|v| {
            let changed = *v != all;
            *v = all;
            changed
        });
    }

    /// Whether every condition holds.
    pub fn is_ready(&self) -> bool {
        *self.inner.tx.borrow()
    }

    /// The conditions that do not hold, with their reasons.
    pub fn unmet(&self) -> Vec<(&'static str, String)> {
        self.inner
            .conditions
            .lock()
            .iter()
            .filter(|(_, (ok, _))| !ok)
            .map(|(n, (_, why))| (*n, why.clone()))
            .collect()
    }

    /// A watch of the overall state.
    pub fn subscribe(&self) -> watch::Receiver<bool> {
        self.inner.tx.subscribe()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ready_only_when_every_condition_holds() {
        let r = Readiness::default();
        assert!(r.is_ready(), "no conditions: ready");
        r.set("bootstrap", false, "waiting for a peer");
        r.set("discovery", true, "");
        assert!(!r.is_ready());
        assert_eq!(
            r.unmet(),
            vec![("bootstrap", "waiting for a peer".to_owned())]
        );
        let mut rx = r.subscribe();
        r.set("bootstrap", true, "");
        assert!(r.is_ready());
        assert!(rx.has_changed().unwrap());
        assert!(*rx.borrow_and_update());
        r.set("discovery", false, "API unreachable for 30s");
        assert!(!r.is_ready());
    }
}
