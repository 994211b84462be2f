//! Peer replicas: the addresses behind a Service, from its EndpointSlices
//! (`discovery.k8s.io/v1`, label `kubernetes.io/service-name`).
//!
//! Not-ready endpoints are published too, separately: replicas that are bootstrapping are not
//! ready yet but must find each other. Terminating endpoints are left out of both lists.

use std::collections::BTreeSet;
use std::net::{IpAddr, SocketAddr};

use kube::api::{Api, ApiResource, DynamicObject};
use kube::runtime::watcher;
use serde_json::Value;
use tokio::sync::watch;

use super::store::{Backoff, Store, proves_contact, watch as start_watch};

/// Which port of the Service's endpoints to publish.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PortRef {
    /// The EndpointSlice port with this name (the Service port's name).
    Name(String),
    /// This port number (slices that list no ports also match it).
    Number(u16),
}

impl From<u16> for PortRef {
    fn from(n: u16) -> Self {
        PortRef::Number(n)
    }
}

impl From<&str> for PortRef {
    fn from(name: &str) -> Self {
        PortRef::Name(name.to_owned())
    }
}

/// The addresses behind a Service, each list sorted and without duplicates.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ServiceEndpoints {
    /// Endpoints whose `conditions.ready` is true (or unset, which Kubernetes says means ready).
    pub ready: Vec<SocketAddr>,
    /// Endpoints that exist but are not ready (e.g. replicas still bootstrapping).
    pub not_ready: Vec<SocketAddr>,
    /// Whether the slices have been listed at least once (until then both lists are empty
    /// because nothing is known yet, not because the Service has no endpoints).
    pub listed: bool,
}

/// Watches the EndpointSlices of Service `service` in `namespace` and publishes the addresses
/// of `port` (a port number, or a port name as `&str`). The task runs until every receiver is
/// dropped; API errors are retried with backoff and keep the last published value. Slices or
/// endpoints that cannot be read are skipped.
pub async fn watch_service_endpoints(
    client: kube::Client,
    namespace: &str,
    service: &str,
    port: impl Into<PortRef>,
) -> watch::Receiver<ServiceEndpoints> {
    let (tx, rx) = watch::channel(ServiceEndpoints::default());
    let api: Api<DynamicObject> = Api::namespaced_with(client, namespace, &slice_resource());
    let config =
        watcher::Config::default().labels(&format!("kubernetes.io/service-name={service}"));
    let (port, service) = (port.into(), service.to_owned());
    tokio::spawn(async move {
        tokio::select! {
            _ = follow(api, config, &port, &service, &tx) => {}
            _ = tx.closed() => {}
        }
    });
    rx
}

fn slice_resource() -> ApiResource {
    ApiResource {
        group: "discovery.k8s.io".into(),
        version: "v1".into(),
        api_version: "discovery.k8s.io/v1".into(),
        kind: "EndpointSlice".into(),
        plural: "endpointslices".into(),
    }
}

async fn follow(
    api: Api<DynamicObject>,
    config: watcher::Config,
    port: &PortRef,
    service: &str,
    tx: &watch::Sender<ServiceEndpoints>,
) {
    let mut backoff = Backoff::new();
    loop {
        let mut w = start_watch(api.clone(), config.clone());
        let mut store = Store::default();
        let error = loop {
            match futures_util::StreamExt::next(&mut w).await {
                Some(Ok(ev)) => {
                    if proves_contact(&ev) {
                        backoff.reset();
                    }
                    if store.apply(ev) && store.listed() {
                        let now = addresses(store.objects().values().map(|o| &o.data), port);
                        tx.send_if_modified(|v| std::mem::replace(v, now.clone()) != now);
                    }
                }
                Some(Err(e)) => break e.to_string(),
                None => break "the watch ended".into(),
            }
        };
        tracing::warn!(%service, %error, "watching the Service's EndpointSlices failed; retrying");
        tokio::time::sleep(backoff.next()).await;
    }
}

/// The ready and not-ready addresses of `port` over every slice. Pure.
pub(super) fn addresses<'a>(
    slices: impl Iterator<Item = &'a Value>,
    port: &PortRef,
) -> ServiceEndpoints {
    let (mut ready, mut not_ready) = (BTreeSet::new(), BTreeSet::new());
    for slice in slices {
        let Some(number) = slice_port(slice, port) else {
            continue;
        };
        let endpoints = slice.get("endpoints").and_then(Value::as_array);
        for ep in endpoints.into_iter().flatten() {
            let cond = |name: &str| ep.pointer(&format!("/conditions/{name}"))?.as_bool();
            if cond("terminating") == Some(true) {
                continue;
            }
            let set = if cond("ready") == Some(false) {
                &mut not_ready
            } else {
                &mut ready
            };
            let ips = ep.get("addresses").and_then(Value::as_array);
            for ip in ips.into_iter().flatten() {
                if let Some(ip) = ip.as_str().and_then(|s| s.parse::<IpAddr>().ok()) {
                    set.insert(SocketAddr::new(ip, number));
                }
            }
        }
    }
    ServiceEndpoints {
        ready: ready.into_iter().collect(),
        not_ready: not_ready.into_iter().collect(),
        listed: true,
    }
}

/// The port number a slice serves `port` on, if it does.
fn slice_port(slice: &Value, port: &PortRef) -> Option<u16> {
    let ports: Vec<&Value> = slice
        .get("ports")
        .and_then(Value::as_array)
        .map(|p| p.iter().collect())
        .unwrap_or_default();
    let number = |p: &Value| p.get("port")?.as_u64().and_then(|n| u16::try_from(n).ok());
    match port {
        PortRef::Number(n) if ports.is_empty() => Some(*n),
        PortRef::Number(n) => ports.iter().filter_map(|p| number(p)).find(|p| p == n),
        PortRef::Name(name) => ports
            .iter()
            .find(|p| p.get("name").and_then(Value::as_str) == Some(name))
            .and_then(|p| number(p)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn ready_and_not_ready_addresses_of_the_named_port() {
        let a = json!({
            "ports": [{"name": "peer", "port": 9004}, {"name": "grpc", "port": 9002}],
            "endpoints": [
                {"addresses": ["10.0.0.2"], "conditions": {"ready": true}},
                {"addresses": ["10.0.0.1"]},
                {"addresses": ["10.0.0.3"], "conditions": {"ready": false}},
                {"addresses": ["10.0.0.4"], "conditions": {"ready": false, "terminating": true}},
                {"addresses": ["garbage", 7]},
            ],
        });
        let b = json!({"ports": [{"name": "peer", "port": 9004}],
                       "endpoints": [{"addresses": ["10.0.0.2", "fd00::5"]}]});
        let other = json!({"ports": [{"name": "metrics", "port": 9090}],
                           "endpoints": [{"addresses": ["10.0.0.9"]}]});
        let got = addresses([&a, &b, &other].into_iter(), &"peer".into());
        let addrs = |v: &[&str]| v.iter().map(|s| s.parse().unwrap()).collect::<Vec<_>>();
        assert_eq!(
            got.ready,
            addrs(&["10.0.0.1:9004", "10.0.0.2:9004", "[fd00::5]:9004"])
        );
        assert_eq!(got.not_ready, addrs(&["10.0.0.3:9004"]));
        let by_number = addresses([&a, &other].into_iter(), &9002.into());
        assert_eq!(by_number.ready, addrs(&["10.0.0.1:9002", "10.0.0.2:9002"]));
        assert!(
            addresses([&json!("nonsense")].into_iter(), &9002.into())
                .ready
                .is_empty()
        );
    }
}
