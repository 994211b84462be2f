//! Which tenants get a metrics label of their own: the busiest `n` by traffic, counted with a
//! bounded "space-saving" sketch over fingerprints; everyone else is `other`. Cardinality is
//! bounded by construction: at most `4n` fingerprint labels are ever minted (a series once
//! created stays); once they are used up, a newcomer to the top is counted under `other`.

use std::collections::HashMap;

use kv_epp_core::fingerprint::Fingerprint;

/// The label of tenants outside the top `n`.
pub const OTHER: &str = "other";
/// The label of unsalted requests (always its own: one series).
pub const UNSALTED: &str = "unsalted";

/// The busiest tenants by requests seen.
pub struct TopTenants {
    n: usize,
    counts: HashMap<u64, u64>,
    top: Vec<u64>,
    since_rank: u32,
    minted: std::collections::HashSet<u64>,
}

impl TopTenants {
    /// Labels for the busiest `n` (0: every tenant is `other`).
    pub fn new(n: usize) -> Self {
        TopTenants {
            n,
            counts: HashMap::new(),
            top: Vec::new(),
            since_rank: 0,
            minted: std::collections::HashSet::new(),
        }
    }

    /// Counts one request of `tenant` and returns its label.
    pub fn observe(&mut self, tenant: Option<Fingerprint>) -> String {
        let Some(fp) = tenant else {
            return UNSALTED.into();
        };
        if self.n == 0 {
            return OTHER.into();
        }
        let key = fp.value();
        let cap = self.n * 4;
        if let Some(c) = self.counts.get_mut(&key) {
            *c += 1;
        } else if self.counts.len() < cap {
            self.counts.insert(key, 1);
        } else {
            // Space-saving: the newcomer replaces the least counted and inherits its count.
            let (&min_k, &min_c) = self
                .counts
                .iter()
                .min_by_key(|(k, c)| (**c, **k))
                .expect("cap > 0");
            self.counts.remove(&min_k);
            self.counts.insert(key, min_c + 1);
        }
        self.since_rank += 1;
        if self.since_rank >= 64 || self.top.len() < self.n.min(self.counts.len()) {
            self.rank();
        }
        if self.top.contains(&key) && (self.minted.contains(&key) || self.minted.len() < 4 * self.n)
        {
            self.minted.insert(key);
        }
        self.label(Some(fp))
    }

    /// The label of a tenant now (without counting).
    pub fn label(&self, tenant: Option<Fingerprint>) -> String {
        match tenant {
            None => UNSALTED.into(),
            Some(fp) if self.top.contains(&fp.value()) && self.minted.contains(&fp.value()) => {
                fp.to_string()
            }
            Some(_) => OTHER.into(),
        }
    }

    fn rank(&mut self) {
        self.since_rank = 0;
        let mut v: Vec<(u64, u64)> = self.counts.iter().map(|(k, c)| (*c, *k)).collect();
        v.sort_unstable_by(|a, b| b.cmp(a));
        self.top = v.into_iter().take(self.n).map(|(_, k)| k).collect();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kv_epp_core::fingerprint::FingerprintKey;

    #[test]
    fn the_busiest_get_labels_and_the_rest_share_other() {
        let key = FingerprintKey::from_passphrase("t");
        let fp = |i: u32| key.fingerprint(&i.to_le_bytes());
        let mut top = TopTenants::new(2);
        let mut labels = std::collections::HashSet::new();
        for round in 0..200u32 {
            labels.insert(top.observe(Some(fp(1))));
            labels.insert(top.observe(Some(fp(2))));
            // A stream of one-off tenants never displaces the two heavy ones.
            labels.insert(top.observe(Some(fp(1000 + round))));
        }
        assert_eq!(top.label(Some(fp(1))), fp(1).to_string());
        assert_eq!(top.label(Some(fp(2))), fp(2).to_string());
        assert_eq!(top.label(Some(fp(1100))), OTHER);
        assert_eq!(top.label(None), UNSALTED);
        assert!(labels.len() <= 2 + 1 + 8, "bounded: {labels:?}");
        // Heavy tenants that keep changing mint at most 4n labels in all.
        let mut top = TopTenants::new(2);
        let mut labels = std::collections::HashSet::new();
        for phase in 0..50u32 {
            for _ in 0..200 {
                labels.insert(top.observe(Some(fp(phase))));
            }
        }
        assert!(labels.len() <= 4 * 2 + 1, "{} labels", labels.len());
    }
}
