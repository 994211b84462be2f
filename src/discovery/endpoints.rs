//! From the pool's pods to the workers that should exist. Pure.
//!
//! A pod is an endpoint when it is Ready (condition `Ready=True`), not terminating (no
//! `deletionTimestamp`) and has a `podIP`. Each target port is one worker: the port at index r of
//! `targetPorts` is data-parallel rank r, `WorkerId::with_rank(podIP:port, r)`, and publishes its
//! KV events on `events.zmq.port + r` of the pod (see `DiscoverySettings::worker`).
//!
//! The model: with one configured model, every pod serves it; with several, the pod's
//! `pool.model_label` label names it. Pods without the label, naming an unknown model or with an
//! unparsable IP are skipped and counted by reason.

use std::collections::BTreeMap;
use std::net::{IpAddr, SocketAddr};

use kube::api::DynamicObject;
use serde_json::Value;

use super::DiscoverySettings;
use super::pool::PoolSpec;
use crate::membership::DesiredWorker;
use kv_epp_core::worker::WorkerId;

/// Why a pod that would be an endpoint was skipped.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum SkipReason {
    /// `status.podIP` is not an IP address.
    BadIp,
    /// Several models are configured and the pod has no model label.
    NoModelLabel,
    /// The pod's model label names a model that is not configured.
    UnknownModel,
}

impl SkipReason {
    /// The metrics label value.
    pub fn as_str(self) -> &'static str {
        match self {
            SkipReason::BadIp => "bad_ip",
            SkipReason::NoModelLabel => "no_model_label",
            SkipReason::UnknownModel => "unknown_model",
        }
    }
}

/// The desired workers and the pods skipped, by reason.
#[derive(Debug, Default)]
pub(super) struct Endpoints {
    /// Workers to run, ordered by id.
    pub workers: Vec<DesiredWorker>,
    /// Skipped pods (name, reason).
    pub skipped: Vec<(String, SkipReason)>,
}

/// The workers of `pool` among `pods`.
pub(super) fn desired<'a>(
    settings: &DiscoverySettings,
    pool: &PoolSpec,
    pods: impl IntoIterator<Item = &'a DynamicObject>,
) -> Endpoints {
    let mut out = Endpoints::default();
    let mut workers = BTreeMap::new();
    for pod in pods {
        let name = pod.metadata.name.clone().unwrap_or_default();
        match pod_endpoint(settings, pod) {
            Ok(Some((ip, model))) => {
                for (rank, port) in (0u32..).zip(&pool.target_ports) {
                    let id = WorkerId::with_rank(SocketAddr::new(ip, *port), rank);
                    workers
                        .entry(id)
                        .or_insert_with(|| (settings.worker)(id, model));
                }
            }
            Ok(None) => {}
            Err(reason) => out.skipped.push((name, reason)),
        }
    }
    out.workers = workers.into_values().collect();
    out
}

/// The pod's IP and model when it is an endpoint; `Ok(None)` when it is not (yet) serving.
fn pod_endpoint<'c>(
    settings: &'c DiscoverySettings,
    pod: &DynamicObject,
) -> Result<Option<(IpAddr, &'c str)>, SkipReason> {
    if pod.metadata.deletion_timestamp.is_some() || !is_ready(&pod.data) {
        return Ok(None);
    }
    let Some(ip) = pod.data.pointer("/status/podIP").and_then(Value::as_str) else {
        return Ok(None);
    };
    let ip: IpAddr = ip.parse().map_err(|_| SkipReason::BadIp)?;
    Ok(Some((ip, model_of(settings, pod)?)))
}

fn is_ready(pod: &Value) -> bool {
    pod.pointer("/status/conditions")
        .and_then(Value::as_array)
        .is_some_and(|cs| {
            cs.iter().any(|c| {
                c.get("type").and_then(Value::as_str) == Some("Ready")
                    && c.get("status").and_then(Value::as_str) == Some("True")
            })
        })
}

fn model_of<'c>(
    settings: &'c DiscoverySettings,
    pod: &DynamicObject,
) -> Result<&'c str, SkipReason> {
    if let [only] = settings.models.as_slice() {
        return Ok(only);
    }
    let label = pod
        .metadata
        .labels
        .as_ref()
        .and_then(|l| l.get(&settings.pool.model_label))
        .ok_or(SkipReason::NoModelLabel)?;
    settings
        .models
        .iter()
        .find(|m| *m == label)
        .map(String::as_str)
        .ok_or(SkipReason::UnknownModel)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Config;
    use serde_json::json;

    fn pod(name: &str, ip: &str, ready: bool, labels: Value, extra_meta: Value) -> DynamicObject {
        let mut meta = json!({"name": name, "namespace": "ns", "labels": labels});
        if let (Some(m), Some(e)) = (meta.as_object_mut(), extra_meta.as_object()) {
            m.extend(e.clone());
        }
        serde_json::from_value(json!({
            "apiVersion": "v1", "kind": "Pod", "metadata": meta,
            "status": {"podIP": ip, "conditions": [
                {"type": "Ready", "status": if ready { "True" } else { "False" }}]},
        }))
        .unwrap()
    }

    fn pool(ports: &[u16]) -> PoolSpec {
        PoolSpec {
            selector: [("app".to_owned(), "v".to_owned())].into(),
            target_ports: ports.to_vec(),
        }
    }

    #[test]
    fn ready_pods_times_target_ports_are_ranked_workers() {
        let c = Config::from_yaml("models: [{name: m, block_size: 4}]").unwrap();
        let pods = [
            pod("a", "10.0.0.1", true, json!({}), json!({})),
            pod("b", "10.0.0.2", false, json!({}), json!({})),
            pod(
                "c",
                "10.0.0.3",
                true,
                json!({}),
                json!({"deletionTimestamp": "2026-01-01T00:00:00Z"}),
            ),
            pod("d", "fe80::1", true, json!({}), json!({})),
        ];
        let e = desired(&c.discovery_settings(), &pool(&[8000, 8001]), &pods);
        let got: Vec<(String, Option<String>)> = e
            .workers
            .iter()
            .map(|w| (w.id.to_string(), w.feed.as_ref().map(|f| f.events.clone())))
            .collect();
        assert_eq!(
            got,
            vec![
                ("10.0.0.1:8000".into(), Some("tcp://10.0.0.1:5557".into())),
                ("10.0.0.1:8001#1".into(), Some("tcp://10.0.0.1:5558".into())),
                ("[fe80::1]:8000".into(), Some("tcp://[fe80::1]:5557".into())),
                (
                    "[fe80::1]:8001#1".into(),
                    Some("tcp://[fe80::1]:5558".into())
                ),
            ]
        );
        assert!(e.skipped.is_empty());
    }

    #[test]
    fn several_models_need_a_known_model_label() {
        let c = Config::from_yaml(
            "models: [{name: a, block_size: 4}, {name: b, block_size: 4}]\nevents: {engine: none}",
        )
        .unwrap();
        let pods = [
            pod(
                "a",
                "10.0.0.1",
                true,
                json!({"kv-epp.io/model": "b"}),
                json!({}),
            ),
            pod("b", "10.0.0.2", true, json!({}), json!({})),
            pod(
                "c",
                "10.0.0.3",
                true,
                json!({"kv-epp.io/model": "zz"}),
                json!({}),
            ),
            pod(
                "d",
                "not-an-ip",
                true,
                json!({"kv-epp.io/model": "a"}),
                json!({}),
            ),
        ];
        let e = desired(&c.discovery_settings(), &pool(&[8000]), &pods);
        assert_eq!(e.workers.len(), 1);
        assert_eq!(
            (e.workers[0].model.as_str(), &e.workers[0].feed),
            ("b", &None)
        );
        assert_eq!(
            e.skipped,
            vec![
                ("b".into(), SkipReason::NoModelLabel),
                ("c".into(), SkipReason::UnknownModel),
                ("d".into(), SkipReason::BadIp),
            ]
        );
    }
}
