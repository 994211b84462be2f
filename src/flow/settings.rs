//! Flow control's configuration (`flow_control` in the config file) and the typed settings it
//! builds, validated once with messages naming the field.
//!
//! Tenant ids in the file are matched the way requests are: each id is read as a salt and
//! turned into its namespace (`Namespace::of`), so a configured tenant is exactly the requests
//! that resolve to that salt, whatever source carried it. Ids are never echoed in errors, logs or
//! metrics (fingerprints only).

use std::collections::HashMap;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::scheduler::{QueueLimits, Share};
use kv_epp_core::namespace::Namespace;
use kv_epp_core::salt::{CacheSalt, SaltSource};

/// `flow_control`: queuing at saturation, fairness between tenants, quotas.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct FlowControlConfig {
    /// Queue requests when every candidate is at its in-flight limit (false: 429 at once).
    /// Quotas apply either way.
    pub enabled: bool,
    /// Longest wait in the queue, ms (429 `rejected-queue-timeout` after). In BUFFERED mode
    /// Envoy's `max_message_timeout` must be at least this + 1000.
    pub queue_timeout_ms: u64,
    /// Requests queued across all tenants.
    pub max_queued_requests: u64,
    /// Request body bytes queued across all tenants.
    pub max_queued_bytes: u64,
    /// Requests queued per tenant.
    pub max_queued_requests_per_tenant: u64,
    /// Request body bytes queued per tenant.
    pub max_queued_bytes_per_tenant: u64,
    /// Expected decode tokens of a request whose body sets no `max_tokens`.
    pub expected_decode_tokens: u64,
    /// Cap on a body's `max_tokens` when counting its expected decode.
    pub max_expected_decode_tokens: u64,
    /// A queued request waits for its cached worker (rather than recompute elsewhere) up to this
    /// many ms per prompt block that worker would save (0: never waits for affinity).
    pub affinity_wait_ms_per_block: f64,
    /// Cap on that wait, ms.
    pub max_affinity_wait_ms: u64,
    /// Priority bands, highest first; a higher band's queued requests always go first.
    pub bands: Vec<String>,
    /// Every tenant not listed in `tenants`, unsalted requests included.
    pub default_tenant: TenantPolicy,
    /// Tenants with their own weight, band or quotas (unset fields: `default_tenant`'s).
    pub tenants: Vec<TenantConfig>,
    /// Tenants labelled by fingerprint in metrics (the busiest); the rest are `other`.
    pub metrics_top_tenants: usize,
}

impl Default for FlowControlConfig {
    fn default() -> Self {
        FlowControlConfig {
            enabled: true,
            queue_timeout_ms: 30_000,
            max_queued_requests: 10_000,
            max_queued_bytes: 128 << 20,
            max_queued_requests_per_tenant: 2_000,
            max_queued_bytes_per_tenant: 32 << 20,
            expected_decode_tokens: 256,
            max_expected_decode_tokens: 4096,
            affinity_wait_ms_per_block: 2.0,
            max_affinity_wait_ms: 1000,
            bands: vec!["interactive".into(), "standard".into(), "batch".into()],
            default_tenant: TenantPolicy::default(),
            tenants: Vec::new(),
            metrics_top_tenants: 10,
        }
    }
}

/// How a tenant is served and limited.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TenantPolicy {
    /// Share of its band, relative to other tenants' weights (> 0).
    pub weight: f64,
    /// Its band (one of `bands`).
    pub band: String,
    /// Requests in flight at once (0 = no limit; 429 `rejected-tenant-inflight-limit` above).
    pub max_inflight: u32,
    /// Work admitted per second, in prompt + expected decode tokens (0 = no limit; 429
    /// `rejected-tenant-rate-limit` above).
    pub tokens_per_second: u64,
    /// Burst of that rate, in tokens (0 = one second's worth).
    pub burst_tokens: u64,
}

impl Default for TenantPolicy {
    fn default() -> Self {
        TenantPolicy {
            weight: 1.0,
            band: "standard".into(),
            max_inflight: 0,
            tokens_per_second: 0,
            burst_tokens: 0,
        }
    }
}

/// One tenant's overrides of `default_tenant`.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TenantConfig {
    /// The tenant id: the salt its requests carry (`x-tenant-id` or `cache_salt`).
    pub id: String,
    /// See [`TenantPolicy::weight`].
    #[serde(default)]
    pub weight: Option<f64>,
    /// See [`TenantPolicy::band`].
    #[serde(default)]
    pub band: Option<String>,
    /// See [`TenantPolicy::max_inflight`].
    #[serde(default)]
    pub max_inflight: Option<u32>,
    /// See [`TenantPolicy::tokens_per_second`].
    #[serde(default)]
    pub tokens_per_second: Option<u64>,
    /// See [`TenantPolicy::burst_tokens`].
    #[serde(default)]
    pub burst_tokens: Option<u64>,
}

/// One tenant's resolved rule.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct TenantRule {
    /// Band and weight.
    pub share: Share,
    /// In-flight limit.
    pub max_inflight: Option<u32>,
    /// Token rate and burst.
    pub rate: Option<(u64, u64)>,
}

/// The typed settings flow control runs with.
#[derive(Clone, Debug)]
pub struct FlowSettings {
    /// Queue at saturation.
    pub enabled: bool,
    /// Longest wait in the queue.
    pub queue_timeout: Duration,
    /// Queue limits.
    pub limits: QueueLimits,
    /// Expected decode of a request without `max_tokens`.
    pub expected_decode_tokens: u64,
    /// Cap on `max_tokens` as expected decode.
    pub max_expected_decode_tokens: u64,
    /// Affinity wait per block saved, ms.
    pub affinity_wait_ms_per_block: f64,
    /// Cap on the affinity wait, ms.
    pub max_affinity_wait_ms: u64,
    /// Band names, index = priority (0 lowest).
    pub band_names: Vec<String>,
    /// Everyone not listed.
    pub default: TenantRule,
    /// Listed tenants by namespace.
    pub tenants: HashMap<Namespace, TenantRule>,
    /// Tenants labelled in metrics.
    pub top_tenants: usize,
}

impl FlowSettings {
    /// The rule of a tenant (`None`: unsalted).
    pub fn rule(&self, tenant: Option<&Namespace>) -> TenantRule {
        tenant
            .and_then(|t| self.tenants.get(t))
            .copied()
            .unwrap_or(self.default)
    }

    /// Whether any quota is configured at all.
    pub fn has_quotas(&self) -> bool {
        let q = |r: &TenantRule| r.max_inflight.is_some() || r.rate.is_some();
        q(&self.default) || self.tenants.values().any(q)
    }
}

impl FlowControlConfig {
    /// Validates and builds the settings; the error names the field.
    pub fn settings(&self) -> Result<FlowSettings, String> {
        let f = "flow_control";
        if self.queue_timeout_ms == 0 {
            return Err(format!("{f}.queue_timeout_ms must be > 0"));
        }
        if self.bands.is_empty() || self.bands.len() > 16 {
            return Err(format!("{f}.bands must list 1 to 16 band names"));
        }
        for (i, b) in self.bands.iter().enumerate() {
            if b.is_empty() || self.bands[..i].contains(b) {
                return Err(format!("{f}.bands[{i}] is empty or listed twice"));
            }
        }
        if self.max_expected_decode_tokens == 0 {
            return Err(format!("{f}.max_expected_decode_tokens must be > 0"));
        }
        if !(self.affinity_wait_ms_per_block.is_finite() && self.affinity_wait_ms_per_block >= 0.0)
        {
            return Err(format!(
                "{f}.affinity_wait_ms_per_block must be a finite number ≥ 0, got {}",
                self.affinity_wait_ms_per_block
            ));
        }
        if self.metrics_top_tenants > 100 {
            return Err(format!("{f}.metrics_top_tenants must be at most 100"));
        }
        let band = |field: &str, name: &str| -> Result<u8, String> {
            let i = self.bands.iter().position(|b| b == name).ok_or_else(|| {
                format!(
                    "{field}: no band `{name}` (flow_control.bands lists {:?})",
                    self.bands
                )
            })?;
            Ok((self.bands.len() - 1 - i) as u8)
        };
        let weight = |field: &str, w: f64| -> Result<f64, String> {
            if w.is_finite() && w > 0.0 {
                Ok(w)
            } else {
                Err(format!("{field} must be a finite number > 0, got {w}"))
            }
        };
        let d = &self.default_tenant;
        let rule = |field: &str, p: &TenantPolicy| -> Result<TenantRule, String> {
            Ok(TenantRule {
                share: Share {
                    band: band(&format!("{field}.band"), &p.band)?,
                    weight: weight(&format!("{field}.weight"), p.weight)?,
                },
                max_inflight: (p.max_inflight > 0).then_some(p.max_inflight),
                rate: (p.tokens_per_second > 0).then(|| {
                    let burst = if p.burst_tokens > 0 {
                        p.burst_tokens
                    } else {
                        p.tokens_per_second
                    };
                    (p.tokens_per_second, burst)
                }),
            })
        };
        let default = rule(&format!("{f}.default_tenant"), d)?;
        let mut tenants = HashMap::new();
        for (i, t) in self.tenants.iter().enumerate() {
            let field = format!("{f}.tenants[{i}]");
            // The id is a secret of sorts: errors name the entry, never the value.
            let salt = match CacheSalt::new(&t.id, SaltSource::Header) {
                Ok(Some(s)) => s,
                Ok(None) => return Err(format!("{field}.id must not be empty")),
                Err(e) => return Err(format!("{field}.id: {e}")),
            };
            let p = TenantPolicy {
                weight: t.weight.unwrap_or(d.weight),
                band: t.band.clone().unwrap_or_else(|| d.band.clone()),
                max_inflight: t.max_inflight.unwrap_or(d.max_inflight),
                tokens_per_second: t.tokens_per_second.unwrap_or(d.tokens_per_second),
                burst_tokens: t.burst_tokens.unwrap_or(d.burst_tokens),
            };
            let r = rule(&field, &p)?;
            if tenants.insert(Namespace::of(&salt), r).is_some() {
                return Err(format!("{field}.id is listed twice"));
            }
        }
        let sz = |v: u64| usize::try_from(v).unwrap_or(usize::MAX);
        Ok(FlowSettings {
            enabled: self.enabled,
            queue_timeout: Duration::from_millis(self.queue_timeout_ms),
            limits: QueueLimits {
                max_requests: sz(self.max_queued_requests),
                max_bytes: sz(self.max_queued_bytes),
                max_requests_per_tenant: sz(self.max_queued_requests_per_tenant),
                max_bytes_per_tenant: sz(self.max_queued_bytes_per_tenant),
            },
            expected_decode_tokens: self.expected_decode_tokens,
            max_expected_decode_tokens: self.max_expected_decode_tokens,
            affinity_wait_ms_per_block: self.affinity_wait_ms_per_block,
            max_affinity_wait_ms: self.max_affinity_wait_ms,
            band_names: self.bands.iter().rev().cloned().collect(),
            default,
            tenants,
            top_tenants: self.metrics_top_tenants,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn err(yaml: &str) -> String {
        let c: FlowControlConfig = serde_yaml::from_str(yaml).unwrap();
        c.settings().unwrap_err()
    }

    #[test]
    fn bad_values_are_refused_naming_the_field() {
        assert!(
            err("{default_tenant: {weight: 0}}").contains("flow_control.default_tenant.weight")
        );
        let e = err("{tenants: [{id: acme, band: gold}]}");
        assert!(
            e.contains("flow_control.tenants[0].band") && e.contains("gold"),
            "{e}"
        );
        assert!(!e.contains("acme"), "the id is never echoed: {e}");
        assert!(err("{tenants: [{id: a, weight: -1}]}").contains("flow_control.tenants[0].weight"));
        assert!(err("{tenants: [{id: a}, {id: a}]}").contains("flow_control.tenants[1].id"));
        assert!(err("{queue_timeout_ms: 0}").contains("flow_control.queue_timeout_ms"));
        assert!(err("{bands: []}").contains("flow_control.bands"));
        let e = serde_yaml::from_str::<FlowControlConfig>("{max_queued_requests: -1}")
            .unwrap_err()
            .to_string();
        assert!(e.contains("max_queued_requests"), "{e}");
    }

    #[test]
    fn tenants_inherit_the_default_and_bands_rank_highest_first() {
        let c: FlowControlConfig = serde_yaml::from_str(
            "{default_tenant: {max_inflight: 4}, tenants: [{id: acme, band: interactive, weight: 3, tokens_per_second: 100}]}",
        )
        .unwrap();
        let s = c.settings().unwrap();
        let acme = Namespace::of(&CacheSalt::new("acme", SaltSource::Header).unwrap().unwrap());
        let r = s.rule(Some(&acme));
        assert_eq!(
            r.share,
            Share {
                band: 2,
                weight: 3.0
            }
        );
        assert_eq!((r.max_inflight, r.rate), (Some(4), Some((100, 100))));
        assert_eq!(
            s.rule(None).share.band,
            1,
            "standard sits between the others"
        );
        assert_eq!(s.band_names[2], "interactive");
    }
}
