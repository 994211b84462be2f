//! The InferencePool as discovery reads it: which pods (label selector) and which ports (one per
//! data-parallel rank). Pure: parses the object's JSON; a malformed pool is an error the watch
//! loop logs and counts, never a panic.

use std::collections::BTreeMap;

use kube::api::ApiResource;
use serde_json::Value;

use super::PoolApiVersion;

/// Most target ports a pool may list (the v1 CRD's limit).
pub(super) const MAX_TARGET_PORTS: usize = 8;

/// One served InferencePool API.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PoolApi {
    /// `inference.networking.k8s.io/v1`: `spec.selector.matchLabels`, `spec.targetPorts[].number`.
    V1,
    /// `inference.networking.x-k8s.io/v1alpha2`: `spec.selector` (a map),
    /// `spec.targetPortNumber`.
    V1alpha2,
}

impl PoolApi {
    /// The API tried first for a configured version (`auto` starts with v1).
    pub fn first(configured: PoolApiVersion) -> PoolApi {
        match configured {
            PoolApiVersion::Auto | PoolApiVersion::V1 => PoolApi::V1,
            PoolApiVersion::V1alpha2 => PoolApi::V1alpha2,
        }
    }

    /// The API to try after this one answered 404 (only `auto` switches).
    pub fn fallback(self, configured: PoolApiVersion) -> PoolApi {
        match (configured, self) {
            (PoolApiVersion::Auto, PoolApi::V1) => PoolApi::V1alpha2,
            (PoolApiVersion::Auto, PoolApi::V1alpha2) => PoolApi::V1,
            _ => self,
        }
    }

    /// The resource for kube-rs's dynamic API.
    pub fn resource(self) -> ApiResource {
        let (group, version) = match self {
            PoolApi::V1 => ("inference.networking.k8s.io", "v1"),
            PoolApi::V1alpha2 => ("inference.networking.x-k8s.io", "v1alpha2"),
        };
        ApiResource {
            group: group.to_owned(),
            version: version.to_owned(),
            api_version: format!("{group}/{version}"),
            kind: "InferencePool".to_owned(),
            plural: "inferencepools".to_owned(),
        }
    }
}

/// What discovery needs from a pool.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PoolSpec {
    /// Pods whose labels include all of these are the pool's model servers.
    pub selector: BTreeMap<String, String>,
    /// Model-server ports; the port at index r is data-parallel rank r.
    pub target_ports: Vec<u16>,
}

impl PoolSpec {
    /// The selector as a Kubernetes label selector (`k=v,k2=v2`).
    pub(crate) fn label_selector(&self) -> String {
        self.selector
            .iter()
            .map(|(k, v)| format!("{k}={v}"))
            .collect::<Vec<_>>()
            .join(",")
    }
}

/// Reads a pool's `spec` under the given API's schema.
pub(super) fn parse(api: PoolApi, spec: &Value) -> Result<PoolSpec, String> {
    let (selector, ports) = match api {
        PoolApi::V1 => (
            spec.pointer("/selector/matchLabels"),
            target_ports_v1(spec.get("targetPorts"))?,
        ),
        PoolApi::V1alpha2 => (
            spec.get("selector"),
            vec![port(spec.get("targetPortNumber"), "spec.targetPortNumber")?],
        ),
    };
    let selector = labels(selector)?;
    if selector.is_empty() {
        return Err("the pool's selector is empty (it would select every pod)".into());
    }
    Ok(PoolSpec {
        selector,
        target_ports: ports,
    })
}

fn target_ports_v1(v: Option<&Value>) -> Result<Vec<u16>, String> {
    let list = v
        .and_then(Value::as_array)
        .ok_or("spec.targetPorts is missing or not a list")?;
    if list.is_empty() || list.len() > MAX_TARGET_PORTS {
        return Err(format!(
            "spec.targetPorts has {} entries (1..={MAX_TARGET_PORTS})",
            list.len()
        ));
    }
    let ports = list
        .iter()
        .map(|p| port(p.get("number"), "spec.targetPorts[].number"))
        .collect::<Result<Vec<u16>, String>>()?;
    let mut unique = ports.clone();
    unique.sort_unstable();
    unique.dedup();
    if unique.len() != ports.len() {
        return Err("spec.targetPorts lists a port twice".into());
    }
    Ok(ports)
}

fn port(v: Option<&Value>, field: &str) -> Result<u16, String> {
    v.and_then(Value::as_u64)
        .and_then(|n| u16::try_from(n).ok())
        .filter(|n| *n != 0)
        .ok_or_else(|| format!("{field} is missing or not a port number"))
}

/// A label map (`{"k": "v"}`); non-string values are refused.
pub(super) fn labels(v: Option<&Value>) -> Result<BTreeMap<String, String>, String> {
    let map = v
        .and_then(Value::as_object)
        .ok_or("the pool's selector is missing or not a map")?;
    map.iter()
        .map(|(k, v)| match v.as_str() {
            Some(s) if valid_label(k) && valid_label(s) => Ok((k.clone(), s.to_owned())),
            _ => Err(format!("selector label `{k}` has an invalid key or value")),
        })
        .collect()
}

/// Label keys and values never contain the selector syntax's separators.
fn valid_label(s: &str) -> bool {
    s.len() <= 317 && !s.contains([',', '=', '!', ' ', '(', ')'])
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn reads_both_api_versions() {
        let v1 = json!({"selector": {"matchLabels": {"app": "vllm", "tier": "a"}},
                        "targetPorts": [{"number": 8000}, {"number": 8001}]});
        let p = parse(PoolApi::V1, &v1).unwrap();
        assert_eq!(p.target_ports, vec![8000, 8001]);
        assert_eq!(p.label_selector(), "app=vllm,tier=a");
        let old = json!({"selector": {"app": "vllm"}, "targetPortNumber": 8000});
        let p = parse(PoolApi::V1alpha2, &old).unwrap();
        assert_eq!(
            (p.label_selector(), p.target_ports),
            ("app=vllm".into(), vec![8000])
        );
    }

    #[test]
    fn refuses_malformed_pools() {
        for (api, spec) in [
            (
                PoolApi::V1,
                json!({"selector": {"matchLabels": {"app": "x"}}}),
            ),
            (
                PoolApi::V1,
                json!({"selector": {"matchLabels": {}}, "targetPorts": [{"number": 1}]}),
            ),
            (
                PoolApi::V1,
                json!({"selector": {"matchLabels": {"a": 1}}, "targetPorts": [{"number": 1}]}),
            ),
            (
                PoolApi::V1,
                json!({"selector": {"matchLabels": {"a": "b"}}, "targetPorts": [{"number": 70000}]}),
            ),
            (
                PoolApi::V1,
                json!({"selector": {"matchLabels": {"a": "b"}}, "targetPorts": [{"number": 1}, {"number": 1}]}),
            ),
            (
                PoolApi::V1,
                json!({"selector": {"matchLabels": {"a": "b,c=d"}}, "targetPorts": [{"number": 1}]}),
            ),
            (
                PoolApi::V1alpha2,
                json!({"selector": {"app": "x"}, "targetPortNumber": "80"}),
            ),
            (PoolApi::V1alpha2, json!("nonsense")),
        ] {
            assert!(parse(api, &spec).is_err(), "{spec}");
        }
    }

    #[test]
    fn auto_switches_between_versions_and_fixed_versions_do_not() {
        assert_eq!(PoolApi::first(PoolApiVersion::Auto), PoolApi::V1);
        assert_eq!(
            PoolApi::V1.fallback(PoolApiVersion::Auto),
            PoolApi::V1alpha2
        );
        assert_eq!(
            PoolApi::V1alpha2.fallback(PoolApiVersion::Auto),
            PoolApi::V1
        );
        assert_eq!(PoolApi::V1.fallback(PoolApiVersion::V1), PoolApi::V1);
        assert_eq!(
            PoolApi::V1alpha2.resource().api_version,
            "inference.networking.x-k8s.io/v1alpha2"
        );
    }
}
