//! One `coordination.k8s.io/v1` Lease: read, create, and update it under optimistic concurrency
//! (the API edge of `replica::lease`, which decides what to write).
//!
//! Requests go through the kube-rs client (its authentication and TLS) as raw requests, so each
//! response body is read under a cap ([`MAX_BODY`]) and the whole call under a deadline. A Lease
//! is parsed field by field into a [`LeaseRecord`]: a malformed one is an error, never a panic.
//! Response bodies and the client's credentials are never logged.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use http_body_util::BodyExt;
use kube::api::{GetParams, PostParams};
use serde_json::{Value, json};

/// Largest Lease response read (a Lease is well under 1 KiB; Status bodies too).
const MAX_BODY: usize = 64 << 10;
/// Longest holder identity accepted from the API.
const MAX_IDENTITY: usize = 256;

/// What kv-epp reads of a Lease.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct LeaseRecord {
    /// `spec.holderIdentity` (`None`: empty or absent, nobody holds it).
    pub holder: Option<String>,
    /// `spec.leaseDurationSeconds`, when present and in 1..=3600.
    pub duration_seconds: Option<u32>,
    /// `spec.leaseTransitions` (absent: 0).
    pub transitions: u64,
    /// `spec.renewTime`, kept as written: only compared, never trusted as a clock.
    pub renew_time: Option<String>,
    /// `spec.acquireTime`, kept as written.
    pub acquire_time: Option<String>,
    /// `metadata.resourceVersion`: an update must name it (optimistic concurrency).
    pub resource_version: String,
}

/// Why a Lease call failed.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum LeaseError {
    /// 404: the Lease does not exist (or was deleted).
    #[error("the lease does not exist")]
    NotFound,
    /// 409: another writer changed it first (stale resourceVersion), or it already exists.
    #[error("the lease was changed by another writer")]
    Conflict,
    /// No answer within the deadline, or no connection.
    #[error("the Kubernetes API is unreachable: {0}")]
    Unreachable(String),
    /// Any other HTTP status (401, 403, 5xx, ...).
    #[error("the Kubernetes API answered HTTP {0}")]
    Status(u16),
    /// An answer that is not a Lease kv-epp can read.
    #[error("malformed lease: {0}")]
    Malformed(&'static str),
}

impl LeaseError {
    /// A short label for counters and logs.
    pub fn reason(&self) -> &'static str {
        match self {
            LeaseError::NotFound => "not_found",
            LeaseError::Conflict => "conflict",
            LeaseError::Unreachable(_) => "unreachable",
            LeaseError::Status(_) => "status",
            LeaseError::Malformed(_) => "malformed",
        }
    }
}

/// One Lease in one namespace.
pub struct LeaseApi {
    client: kube::Client,
    request: kube::core::Request,
    name: String,
    namespace: String,
    timeout: Duration,
}

impl LeaseApi {
    /// The Lease `name` in `namespace`; every call gives up after `timeout`.
    pub fn new(client: kube::Client, namespace: &str, name: &str, timeout: Duration) -> LeaseApi {
        LeaseApi {
            client,
            request: kube::core::Request::new(format!(
                "/apis/coordination.k8s.io/v1/namespaces/{namespace}/leases"
            )),
            name: name.to_owned(),
            namespace: namespace.to_owned(),
            timeout,
        }
    }

    /// The Lease's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Reads the Lease.
    pub async fn get(&self) -> Result<LeaseRecord, LeaseError> {
        let req = self
            .request
            .get(&self.name, &GetParams::default())
            .map_err(|_| LeaseError::Malformed("request"))?;
        self.call(req).await
    }

    /// Creates the Lease with `spec` (fails with `Conflict` when it exists).
    pub async fn create(&self, spec: &LeaseSpec) -> Result<LeaseRecord, LeaseError> {
        let body = self.body(spec, None);
        let req = self
            .request
            .create(&PostParams::default(), body)
            .map_err(|_| LeaseError::Malformed("request"))?;
        self.call(req).await
    }

    /// Replaces the Lease's spec, only if it is still at `resource_version` (else `Conflict`).
    pub async fn update(
        &self,
        spec: &LeaseSpec,
        resource_version: &str,
    ) -> Result<LeaseRecord, LeaseError> {
        let body = self.body(spec, Some(resource_version));
        let req = self
            .request
            .replace(&self.name, &PostParams::default(), body)
            .map_err(|_| LeaseError::Malformed("request"))?;
        self.call(req).await
    }

    fn body(&self, spec: &LeaseSpec, resource_version: Option<&str>) -> Vec<u8> {
        let mut meta = json!({"name": self.name, "namespace": self.namespace});
        if let Some(rv) = resource_version {
            meta["resourceVersion"] = json!(rv);
        }
        let mut s = json!({
            "leaseDurationSeconds": spec.duration_seconds,
            "leaseTransitions": spec.transitions,
            "renewTime": spec.renew_time,
        });
        if let Some(h) = &spec.holder {
            s["holderIdentity"] = json!(h);
        }
        if let Some(t) = &spec.acquire_time {
            s["acquireTime"] = json!(t);
        }
        json!({"apiVersion": "coordination.k8s.io/v1", "kind": "Lease", "metadata": meta, "spec": s})
            .to_string()
            .into_bytes()
    }

    async fn call(&self, req: axum::http::Request<Vec<u8>>) -> Result<LeaseRecord, LeaseError> {
        let work = async {
            let res = self
                .client
                .send(req.map(kube::client::Body::from))
                .await
                .map_err(|e| LeaseError::Unreachable(short(&e.to_string())))?;
            let code = res.status().as_u16();
            match code {
                200 | 201 => {}
                404 => return Err(LeaseError::NotFound),
                409 => return Err(LeaseError::Conflict),
                _ => return Err(LeaseError::Status(code)),
            }
            let body = http_body_util::Limited::new(res.into_body(), MAX_BODY)
                .collect()
                .await
                .map_err(|_| LeaseError::Malformed("body too large or cut short"))?
                .to_bytes();
            parse(&body)
        };
        match tokio::time::timeout(self.timeout, work).await {
            Ok(r) => r,
            Err(_) => Err(LeaseError::Unreachable("no answer in time".into())),
        }
    }
}

/// What kv-epp writes into a Lease's spec.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LeaseSpec {
    /// The holder (`None` leaves it empty).
    pub holder: Option<String>,
    /// `leaseDurationSeconds`.
    pub duration_seconds: u32,
    /// `leaseTransitions`.
    pub transitions: u64,
    /// `acquireTime` (MicroTime).
    pub acquire_time: Option<String>,
    /// `renewTime` (MicroTime).
    pub renew_time: String,
}

/// A Lease from its JSON. Pure.
pub(crate) fn parse(body: &[u8]) -> Result<LeaseRecord, LeaseError> {
    let v: Value = serde_json::from_slice(body).map_err(|_| LeaseError::Malformed("not JSON"))?;
    if v.get("kind").and_then(Value::as_str) != Some("Lease") {
        return Err(LeaseError::Malformed("not a Lease"));
    }
    let resource_version = v
        .pointer("/metadata/resourceVersion")
        .and_then(Value::as_str)
        .filter(|s| !s.is_empty() && s.len() <= 64)
        .ok_or(LeaseError::Malformed("metadata.resourceVersion"))?
        .to_owned();
    let spec = v.get("spec").unwrap_or(&Value::Null);
    let text = |key: &str, max: usize| -> Result<Option<String>, LeaseError> {
        match spec.get(key) {
            None | Some(Value::Null) => Ok(None),
            Some(Value::String(s)) if s.is_empty() => Ok(None),
            Some(Value::String(s)) if s.len() <= max => Ok(Some(s.clone())),
            Some(_) => Err(LeaseError::Malformed("a spec field is not a short string")),
        }
    };
    let holder = text("holderIdentity", MAX_IDENTITY)?;
    let renew_time = text("renewTime", 64)?;
    let acquire_time = text("acquireTime", 64)?;
    let duration_seconds = spec
        .get("leaseDurationSeconds")
        .and_then(Value::as_u64)
        .filter(|d| (1..=3600).contains(d))
        .map(|d| d as u32);
    let transitions = match spec.get("leaseTransitions") {
        None | Some(Value::Null) => 0,
        Some(t) => t
            .as_u64()
            .ok_or(LeaseError::Malformed("spec.leaseTransitions"))?,
    };
    Ok(LeaseRecord {
        holder,
        duration_seconds,
        transitions,
        renew_time,
        acquire_time,
        resource_version,
    })
}

/// At most 200 bytes of an error message (on a character boundary).
fn short(s: &str) -> String {
    let mut end = s.len().min(200);
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    s[..end].to_owned()
}

/// The wall clock as a Kubernetes MicroTime (`2006-01-02T15:04:05.000000Z`), for display in
/// `renewTime`/`acquireTime` only: kv-epp never decides anything from another pod's clock.
pub fn micro_time_now() -> String {
    micro_time(SystemTime::now())
}

fn micro_time(t: SystemTime) -> String {
    let d = t.duration_since(UNIX_EPOCH).unwrap_or_default();
    let secs = d.as_secs();
    let (days, rem) = (secs / 86_400, secs % 86_400);
    // Civil date from days since 1970-01-01 (Howard Hinnant's algorithm).
    let z = days as i64 + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}.{:06}Z",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60,
        d.subsec_micros()
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn micro_time_is_rfc3339_with_microseconds() {
        assert_eq!(micro_time(UNIX_EPOCH), "1970-01-01T00:00:00.000000Z");
        let t = UNIX_EPOCH + Duration::from_micros(1_709_251_199_123_456);
        assert_eq!(micro_time(t), "2024-02-29T23:59:59.123456Z");
        let t = UNIX_EPOCH + Duration::from_secs(951_782_400);
        assert_eq!(micro_time(t), "2000-02-29T00:00:00.000000Z");
    }

    #[test]
    fn leases_parse_and_hostile_ones_are_errors() {
        let ok = br#"{"kind":"Lease","apiVersion":"coordination.k8s.io/v1",
            "metadata":{"name":"x","resourceVersion":"42"},
            "spec":{"holderIdentity":"kv-epp-00000000000000ab","leaseDurationSeconds":10,
                    "leaseTransitions":3,"renewTime":"2024-01-01T00:00:00.000000Z"}}"#;
        let r = parse(ok).unwrap();
        assert_eq!(r.holder.as_deref(), Some("kv-epp-00000000000000ab"));
        assert_eq!(
            (
                r.duration_seconds,
                r.transitions,
                r.resource_version.as_str()
            ),
            (Some(10), 3, "42")
        );
        // An empty spec: nobody holds it.
        let empty =
            br#"{"kind":"Lease","metadata":{"resourceVersion":"1"},"spec":{"holderIdentity":""}}"#;
        assert_eq!(parse(empty).unwrap().holder, None);
        // Out-of-range durations are ignored (the reader's own applies), not trusted.
        let odd = br#"{"kind":"Lease","metadata":{"resourceVersion":"1"},"spec":{"leaseDurationSeconds":-5}}"#;
        assert_eq!(parse(odd).unwrap().duration_seconds, None);
        for bad in [
            &b"not json"[..],
            br#"{"kind":"Status","code":500}"#,
            br#"{"kind":"Lease","metadata":{}}"#,
            br#"{"kind":"Lease","metadata":{"resourceVersion":"1"},"spec":{"holderIdentity":7}}"#,
            br#"{"kind":"Lease","metadata":{"resourceVersion":"1"},"spec":{"leaseTransitions":-1}}"#,
        ] {
            assert!(parse(bad).is_err(), "{}", String::from_utf8_lossy(bad));
        }
        let long = format!(
            r#"{{"kind":"Lease","metadata":{{"resourceVersion":"1"}},"spec":{{"holderIdentity":"{}"}}}}"#,
            "x".repeat(300)
        );
        assert!(parse(long.as_bytes()).is_err());
    }
}
