//! A small Kubernetes API server for discovery tests: it speaks the real list/watch protocol over
//! real sockets (JSON lists carrying `metadata.resourceVersion`; `?watch=true&resourceVersion=N`
//! answered with a chunked stream of `{"type":"ADDED|MODIFIED|DELETED|BOOKMARK|ERROR",
//! "object":...}` lines, replaying every change after N), honours `labelSelector` (`k=v,...`)
//! and `fieldSelector` (`metadata.name=...`), answers 404 for API versions it does not serve,
//! can end every watch with a 410 Gone (`Expired`) ERROR event, and can be stopped and restarted
//! on the same port to simulate an outage. It also answers `POST` TokenReviews
//! (`authentication.k8s.io/v1`: the tokens given to [`FakeKube::allow_token`] authenticate) and
//! SubjectAccessReviews (`authorization.k8s.io/v1`: `get` on the non-resource paths given to
//! [`FakeKube::grant`]), or fails both with a 500 on demand. Leases
//! (`coordination.k8s.io/v1`) are served as the real API server serves them: `GET` of one
//! (404 `NotFound` Status when absent), `POST` to create (201, or 409 `AlreadyExists`), `PUT` to
//! update (404 when absent; 409 `Conflict` Status when the body names a resourceVersion other
//! than the stored one; none = unconditional), each write a new resourceVersion.
//!
//! Every response carries `connection: close`, so a stopped server is really unreachable: no
//! client keeps a pooled connection to it.
#![allow(dead_code, unreachable_pub)]

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::convert::Infallible;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{Request, StatusCode};
use axum::response::Response;
use serde_json::{Value, json};
use tokio::net::TcpListener;
use tokio::sync::mpsc;
use tokio::task::JoinHandle;

/// A resource type the fake serves.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Res {
    /// core/v1 pods.
    Pods,
    /// inference.networking.k8s.io/v1 inferencepools.
    PoolV1,
    /// inference.networking.x-k8s.io/v1alpha2 inferencepools.
    PoolV1alpha2,
    /// discovery.k8s.io/v1 endpointslices.
    EndpointSlices,
    /// coordination.k8s.io/v1 leases.
    Leases,
}

impl Res {
    const ALL: [Res; 5] = [
        Res::Pods,
        Res::PoolV1,
        Res::PoolV1alpha2,
        Res::EndpointSlices,
        Res::Leases,
    ];

    fn prefix(self) -> &'static str {
        match self {
            Res::Pods => "/api/v1",
            Res::PoolV1 => "/apis/inference.networking.k8s.io/v1",
            Res::PoolV1alpha2 => "/apis/inference.networking.x-k8s.io/v1alpha2",
            Res::EndpointSlices => "/apis/discovery.k8s.io/v1",
            Res::Leases => "/apis/coordination.k8s.io/v1",
        }
    }

    fn plural(self) -> &'static str {
        match self {
            Res::Pods => "pods",
            Res::PoolV1 | Res::PoolV1alpha2 => "inferencepools",
            Res::EndpointSlices => "endpointslices",
            Res::Leases => "leases",
        }
    }

    fn kind(self) -> &'static str {
        match self {
            Res::Pods => "Pod",
            Res::PoolV1 | Res::PoolV1alpha2 => "InferencePool",
            Res::EndpointSlices => "EndpointSlice",
            Res::Leases => "Lease",
        }
    }

    fn api_version(self) -> &'static str {
        self.prefix()
            .trim_start_matches("/apis/")
            .trim_start_matches("/api/")
    }

    /// `/.../namespaces/{ns}/{plural}` → (resource, namespace).
    fn parse(path: &str) -> Option<(Res, String)> {
        Res::ALL.into_iter().find_map(|r| {
            let rest = path
                .strip_prefix(r.prefix())?
                .strip_prefix("/namespaces/")?;
            let (ns, plural) = rest.split_once('/')?;
            (plural == r.plural()).then(|| (r, ns.to_owned()))
        })
    }

    /// `/.../namespaces/{ns}/{plural}/{name}` → (resource, namespace, name).
    fn parse_item(path: &str) -> Option<(Res, String, String)> {
        Res::ALL.into_iter().find_map(|r| {
            let rest = path
                .strip_prefix(r.prefix())?
                .strip_prefix("/namespaces/")?;
            let mut parts = rest.split('/');
            let (ns, plural, name) = (parts.next()?, parts.next()?, parts.next()?);
            (plural == r.plural() && !name.is_empty() && parts.next().is_none())
                .then(|| (r, ns.to_owned(), name.to_owned()))
        })
    }
}

/// One stored change: what a watch from an older resourceVersion must replay.
struct Change {
    rv: u64,
    res: Res,
    ns: String,
    old: Option<Value>,
    new: Option<Value>,
}

/// An open watch.
struct Watcher {
    res: Res,
    ns: String,
    filter: Filter,
    tx: mpsc::UnboundedSender<Bytes>,
}

#[derive(Clone, Default)]
struct Filter {
    labels: Vec<(String, String)>,
    name: Option<String>,
}

impl Filter {
    fn from_query(q: &HashMap<String, String>) -> Filter {
        let labels = q
            .get("labelSelector")
            .map(|s| {
                s.split(',')
                    .filter(|t| !t.is_empty())
                    .filter_map(|t| t.split_once('='))
                    .map(|(k, v)| (k.to_owned(), v.trim_start_matches('=').to_owned()))
                    .collect()
            })
            .unwrap_or_default();
        let name = q
            .get("fieldSelector")
            .and_then(|s| s.strip_prefix("metadata.name="))
            .map(str::to_owned);
        Filter { labels, name }
    }

    fn matches(&self, o: &Value) -> bool {
        let meta = &o["metadata"];
        self.name
            .as_ref()
            .is_none_or(|n| meta["name"].as_str() == Some(n))
            && self
                .labels
                .iter()
                .all(|(k, v)| meta["labels"][k].as_str() == Some(v))
    }
}

#[derive(Default)]
struct ApiState {
    rv: u64,
    /// Watches from a resourceVersion below this get 410 Gone.
    compacted: u64,
    objects: BTreeMap<(Res, String, String), Value>,
    history: Vec<Change>,
    watchers: Vec<Watcher>,
    not_served: BTreeSet<Res>,
    lists: HashMap<Res, usize>,
    watches: HashMap<Res, usize>,
    /// TokenReview: token → user name.
    tokens: HashMap<String, String>,
    /// SubjectAccessReview: (user, non-resource path) pairs allowed `get`.
    grants: BTreeSet<(String, String)>,
    /// Reviews answer 500.
    reviews_fail: bool,
    token_reviews: usize,
    /// Lease writes answered 200/201, and 409s.
    lease_writes: usize,
    lease_conflicts: usize,
}

impl ApiState {
    /// Stores a change and delivers it to the open watches (unless `silent`: events lost).
    fn change(&mut self, res: Res, ns: &str, name: &str, new: Option<Value>, silent: bool) {
        self.rv += 1;
        let rv = self.rv;
        let key = (res, ns.to_owned(), name.to_owned());
        let new = new.map(|mut o| {
            o["metadata"]["resourceVersion"] = json!(rv.to_string());
            o["metadata"]["namespace"] = json!(ns);
            o["metadata"]["name"] = json!(name);
            o["metadata"]["uid"] = json!(format!("uid-{name}"));
            o["apiVersion"] = json!(res.api_version());
            o["kind"] = json!(res.kind());
            o
        });
        let old = match &new {
            Some(o) => self.objects.insert(key, o.clone()),
            None => self.objects.remove(&key),
        };
        let old = old.map(|mut o| {
            if new.is_none() {
                o["metadata"]["resourceVersion"] = json!(rv.to_string());
            }
            o
        });
        let change = Change {
            rv,
            res,
            ns: ns.to_owned(),
            old,
            new,
        };
        if silent {
            self.compacted = rv;
        } else {
            self.watchers.retain(|w| match event_for(w, &change) {
                Some(line) => w.tx.send(line).is_ok(),
                None => !w.tx.is_closed(),
            });
        }
        self.history.push(change);
    }
}

/// The watch event line a change means for one watch, if any (an object moving into or out of
/// the selection is ADDED or DELETED, as the real API server does).
fn event_for(w: &Watcher, c: &Change) -> Option<Bytes> {
    if w.res != c.res || w.ns != c.ns {
        return None;
    }
    let was = c.old.as_ref().is_some_and(|o| w.filter.matches(o));
    let is = c.new.as_ref().is_some_and(|o| w.filter.matches(o));
    let (kind, obj) = match (was, is) {
        (false, true) => ("ADDED", c.new.as_ref()?),
        (true, true) => ("MODIFIED", c.new.as_ref()?),
        (true, false) => ("DELETED", c.new.as_ref().or(c.old.as_ref())?),
        (false, false) => return None,
    };
    Some(line(json!({"type": kind, "object": obj})))
}

fn line(v: Value) -> Bytes {
    let mut s = v.to_string();
    s.push('\n');
    Bytes::from(s)
}

fn gone() -> Value {
    json!({"type": "ERROR", "object": {"kind": "Status", "apiVersion": "v1", "metadata": {},
        "status": "Failure", "message": "too old resource version", "reason": "Expired", "code": 410}})
}

/// The fake API server.
pub struct FakeKube {
    /// Where it listens (kept across restarts).
    pub addr: SocketAddr,
    state: Arc<Mutex<ApiState>>,
    server: Mutex<Option<JoinHandle<()>>>,
    /// With HTTPS: the server's TLS settings and its self-signed certificate (PEM).
    tls: Option<(Arc<tokio_rustls::rustls::ServerConfig>, String)>,
}

impl FakeKube {
    /// Starts plain HTTP on an ephemeral loopback port.
    pub async fn start() -> FakeKube {
        Self::start_with(None).await
    }

    /// Starts HTTPS (a self-signed certificate for 127.0.0.1, as the in-cluster API serves TLS
    /// under the service account's CA).
    pub async fn start_tls() -> FakeKube {
        let ck = rcgen::generate_simple_self_signed(vec!["127.0.0.1".to_owned()]).unwrap();
        let key = tokio_rustls::rustls::pki_types::PrivatePkcs8KeyDer::from(
            ck.signing_key.serialize_der(),
        );
        let config = tokio_rustls::rustls::ServerConfig::builder()
            .with_no_client_auth()
            .with_single_cert(vec![ck.cert.der().clone()], key.into())
            .unwrap();
        Self::start_with(Some((Arc::new(config), ck.cert.pem()))).await
    }

    async fn start_with(tls: Option<(Arc<tokio_rustls::rustls::ServerConfig>, String)>) -> Self {
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let fake = FakeKube {
            addr: l.local_addr().unwrap(),
            state: Arc::new(Mutex::new(ApiState::default())),
            server: Mutex::new(None),
            tls,
        };
        fake.serve(l);
        fake
    }

    fn serve(&self, l: TcpListener) {
        let app = axum::Router::new()
            .fallback(handle)
            .with_state(self.state.clone());
        let tls = self.tls.as_ref().map(|(c, _)| c.clone());
        let task = tokio::spawn(async move {
            let _ = match tls {
                Some(config) => {
                    let acceptor = tokio_rustls::TlsAcceptor::from(config);
                    axum::serve(TlsListener { tcp: l, acceptor }, app).await
                }
                None => axum::serve(l, app).await,
            };
        });
        *self.server.lock().unwrap() = Some(task);
    }

    /// Writes a kubeconfig pointing at this server into `dir` and returns its path.
    pub fn kubeconfig(&self, dir: &Path) -> PathBuf {
        let path = dir.join(format!("kubeconfig-{}", self.addr.port()));
        let (scheme, ca) = match &self.tls {
            Some((_, pem)) => {
                let ca = dir.join(format!("ca-{}.crt", self.addr.port()));
                std::fs::write(&ca, pem).unwrap();
                (
                    "https",
                    format!("\n    certificate-authority: {}", ca.display()),
                )
            }
            None => ("http", String::new()),
        };
        let text = format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: fake\n  cluster:\n    server: {scheme}://{}{ca}\nusers:\n- name: test\n  user: {{token: test-token}}\ncontexts:\n- name: fake\n  context:\n    cluster: fake\n    user: test\n    namespace: default\ncurrent-context: fake\n",
            self.addr
        );
        std::fs::write(&path, text).unwrap();
        path
    }

    /// Creates or replaces an object (named by its `metadata.name`).
    pub fn put(&self, res: Res, ns: &str, obj: Value) {
        let name = obj["metadata"]["name"].as_str().unwrap().to_owned();
        self.state
            .lock()
            .unwrap()
            .change(res, ns, &name, Some(obj), false);
    }

    /// Deletes an object.
    pub fn delete(&self, res: Res, ns: &str, name: &str) {
        self.state
            .lock()
            .unwrap()
            .change(res, ns, name, None, false);
    }

    /// Changes objects without telling the open watches (their events are lost), then ends
    /// every watch with 410 Gone: only a relist can show the changes.
    pub fn lose_events_then_expire(&self, changes: impl FnOnce(&mut LostChanges<'_>)) {
        let mut s = self.state.lock().unwrap();
        changes(&mut LostChanges(&mut s));
        s.compacted = s.rv;
        for w in std::mem::take(&mut s.watchers) {
            let _ = w.tx.send(line(gone()));
        }
    }

    /// Makes an API version answer 404 (or serve again).
    pub fn set_served(&self, res: Res, served: bool) {
        let mut s = self.state.lock().unwrap();
        if served {
            s.not_served.remove(&res);
        } else {
            s.not_served.insert(res);
        }
    }

    /// List requests answered for `res`.
    pub fn lists(&self, res: Res) -> usize {
        self.state
            .lock()
            .unwrap()
            .lists
            .get(&res)
            .copied()
            .unwrap_or(0)
    }

    /// Watch requests answered for `res`.
    pub fn watches(&self, res: Res) -> usize {
        self.state
            .lock()
            .unwrap()
            .watches
            .get(&res)
            .copied()
            .unwrap_or(0)
    }

    /// Makes TokenReview authenticate `token` as `user`.
    pub fn allow_token(&self, token: &str, user: &str) {
        let mut s = self.state.lock().unwrap();
        s.tokens.insert(token.to_owned(), user.to_owned());
    }

    /// Makes SubjectAccessReview allow `user` to `get` the non-resource `path`.
    pub fn grant(&self, user: &str, path: &str) {
        let mut s = self.state.lock().unwrap();
        s.grants.insert((user.to_owned(), path.to_owned()));
    }

    /// Makes every review answer 500 (or answer again).
    pub fn fail_reviews(&self, fail: bool) {
        self.state.lock().unwrap().reviews_fail = fail;
    }

    /// TokenReviews received (failed ones included).
    pub fn token_reviews(&self) -> usize {
        self.state.lock().unwrap().token_reviews
    }

    /// The stored object, if any.
    pub fn get(&self, res: Res, ns: &str, name: &str) -> Option<Value> {
        let s = self.state.lock().unwrap();
        s.objects
            .get(&(res, ns.to_owned(), name.to_owned()))
            .cloned()
    }

    /// Every version the object went through, oldest first (`None`: deleted).
    pub fn history(&self, res: Res, ns: &str, name: &str) -> Vec<Option<Value>> {
        let s = self.state.lock().unwrap();
        s.history
            .iter()
            .filter(|c| c.res == res && c.ns == ns)
            .filter(|c| {
                c.new
                    .as_ref()
                    .or(c.old.as_ref())
                    .is_some_and(|o| o["metadata"]["name"] == name)
            })
            .map(|c| c.new.clone())
            .collect()
    }

    /// Lease writes that succeeded, and those refused with 409.
    pub fn lease_writes(&self) -> (usize, usize) {
        let s = self.state.lock().unwrap();
        (s.lease_writes, s.lease_conflicts)
    }

    /// Stops listening and ends every open watch: the API is unreachable until `restart`.
    pub async fn stop(&self) {
        let task = self.server.lock().unwrap().take();
        if let Some(t) = task {
            t.abort();
            let _ = t.await;
        }
        self.state.lock().unwrap().watchers.clear();
    }

    /// Listens again on the same port.
    pub async fn restart(&self) {
        let l = TcpListener::bind(self.addr).await.unwrap();
        self.serve(l);
    }
}

/// Accepts TCP connections and completes their TLS handshakes (a failed or stalled handshake is
/// dropped, never fatal).
struct TlsListener {
    tcp: TcpListener,
    acceptor: tokio_rustls::TlsAcceptor,
}

impl axum::serve::Listener for TlsListener {
    type Io = tokio_rustls::server::TlsStream<tokio::net::TcpStream>;
    type Addr = SocketAddr;

    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        loop {
            let Ok((tcp, addr)) = self.tcp.accept().await else {
                continue;
            };
            let handshake = self.acceptor.accept(tcp);
            if let Ok(Ok(tls)) =
                tokio::time::timeout(std::time::Duration::from_secs(5), handshake).await
            {
                return (tls, addr);
            }
        }
    }

    fn local_addr(&self) -> std::io::Result<SocketAddr> {
        self.tcp.local_addr()
    }
}

/// Changes applied while watches are not told.
pub struct LostChanges<'a>(&'a mut ApiState);

impl LostChanges<'_> {
    /// Creates or replaces an object silently.
    pub fn put(&mut self, res: Res, ns: &str, obj: Value) {
        let name = obj["metadata"]["name"].as_str().unwrap().to_owned();
        self.0.change(res, ns, &name, Some(obj), true);
    }

    /// Deletes an object silently.
    pub fn delete(&mut self, res: Res, ns: &str, name: &str) {
        self.0.change(res, ns, name, None, true);
    }
}

fn query(req: &Request<Body>) -> HashMap<String, String> {
    req.uri()
        .query()
        .unwrap_or("")
        .split('&')
        .filter_map(|kv| kv.split_once('='))
        .map(|(k, v)| (decode(k), decode(v)))
        .collect()
}

fn decode(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        match b[i] {
            b'%' if i + 2 < b.len() => {
                let hex = std::str::from_utf8(&b[i + 1..i + 3]).unwrap_or("");
                match u8::from_str_radix(hex, 16) {
                    Ok(v) => {
                        out.push(v);
                        i += 3;
                        continue;
                    }
                    Err(_) => out.push(b'%'),
                }
            }
            b'+' => out.push(b' '),
            c => out.push(c),
        }
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

fn respond(status: StatusCode, body: Body) -> Response {
    Response::builder()
        .status(status)
        .header("content-type", "application/json")
        .header("connection", "close")
        .body(body)
        .unwrap()
}

fn status(code: u16, reason: &str) -> Response {
    let body = json!({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
        "message": reason, "reason": reason, "code": code});
    respond(
        StatusCode::from_u16(code).unwrap(),
        Body::from(body.to_string()),
    )
}

/// A TokenReview or SubjectAccessReview: the object sent back with its `status` filled in, as
/// the API server answers a `create` of a review.
fn review(state: &Mutex<ApiState>, path: &str, body: &[u8]) -> Response {
    let Ok(mut review) = serde_json::from_slice::<Value>(body) else {
        return status(400, "BadRequest");
    };
    let mut s = state.lock().unwrap();
    let answer = match path {
        "/apis/authentication.k8s.io/v1/tokenreviews" => {
            s.token_reviews += 1;
            let token = review["spec"]["token"].as_str().unwrap_or_default();
            match s.tokens.get(token) {
                Some(user) => json!({"authenticated": true, "user": {"username": user,
                    "uid": format!("uid-{user}"), "groups": ["system:serviceaccounts", "system:authenticated"]}}),
                None => json!({"authenticated": false, "error": "invalid bearer token"}),
            }
        }
        "/apis/authorization.k8s.io/v1/subjectaccessreviews" => {
            let spec = &review["spec"];
            let user = spec["user"].as_str().unwrap_or_default().to_owned();
            let attrs = &spec["nonResourceAttributes"];
            let path = attrs["path"].as_str().unwrap_or_default().to_owned();
            let allowed = attrs["verb"] == "get" && s.grants.contains(&(user, path));
            json!({"allowed": allowed, "reason": if allowed { "granted" } else { "no rule allows it" }})
        }
        _ => return status(404, "NotFound"),
    };
    if s.reviews_fail {
        return status(500, "InternalError");
    }
    review["status"] = answer;
    respond(StatusCode::CREATED, Body::from(review.to_string()))
}

/// A Status as the API server words it for one object.
fn object_status(code: u16, reason: &str, res: Res, name: &str) -> Response {
    let what = format!(
        "{}.{}",
        res.plural(),
        res.api_version().split('/').next().unwrap_or("")
    );
    let message = match reason {
        "NotFound" => format!("{what} \"{name}\" not found"),
        "AlreadyExists" => format!("{what} \"{name}\" already exists"),
        _ => format!(
            "Operation cannot be fulfilled on {what} \"{name}\": the object has been modified; please apply your changes to the latest version and try again"
        ),
    };
    let body = json!({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
        "message": message, "reason": reason,
        "details": {"name": name, "group": res.api_version().split('/').next(), "kind": res.plural()},
        "code": code});
    respond(
        StatusCode::from_u16(code).unwrap(),
        Body::from(body.to_string()),
    )
}

/// Lease reads and writes with the API server's optimistic concurrency.
async fn lease(state: &Mutex<ApiState>, req: Request<Body>) -> Response {
    let method = req.method().clone();
    let path = req.uri().path().to_owned();
    let body = axum::body::to_bytes(req.into_body(), 1 << 20)
        .await
        .unwrap_or_default();
    let mut s = state.lock().unwrap();
    let (ns, name) = match (Res::parse_item(&path), Res::parse(&path)) {
        (Some((Res::Leases, ns, name)), _) => (ns, Some(name)),
        (_, Some((Res::Leases, ns))) => (ns, None),
        _ => return status(404, "NotFound"),
    };
    let obj = || serde_json::from_slice::<Value>(&body).ok();
    match (method.as_str(), name) {
        ("GET", Some(name)) => match s.objects.get(&(Res::Leases, ns, name.clone())) {
            Some(o) => respond(StatusCode::OK, Body::from(o.to_string())),
            None => object_status(404, "NotFound", Res::Leases, &name),
        },
        ("POST", None) => {
            let Some(o) = obj() else {
                return status(400, "BadRequest");
            };
            let Some(name) = o["metadata"]["name"].as_str().map(str::to_owned) else {
                return status(422, "Invalid");
            };
            if s.objects
                .contains_key(&(Res::Leases, ns.clone(), name.clone()))
            {
                s.lease_conflicts += 1;
                return object_status(409, "AlreadyExists", Res::Leases, &name);
            }
            s.change(Res::Leases, &ns, &name, Some(o), false);
            s.lease_writes += 1;
            let stored = s.objects[&(Res::Leases, ns, name)].clone();
            respond(StatusCode::CREATED, Body::from(stored.to_string()))
        }
        ("PUT", Some(name)) => {
            let Some(o) = obj() else {
                return status(400, "BadRequest");
            };
            let key = (Res::Leases, ns.clone(), name.clone());
            let Some(current) = s.objects.get(&key) else {
                return object_status(404, "NotFound", Res::Leases, &name);
            };
            let stored_rv = current["metadata"]["resourceVersion"].clone();
            match o["metadata"]["resourceVersion"].as_str() {
                Some(rv) if !rv.is_empty() && Some(rv) != stored_rv.as_str() => {
                    s.lease_conflicts += 1;
                    return object_status(409, "Conflict", Res::Leases, &name);
                }
                _ => {}
            }
            s.change(Res::Leases, &ns, &name, Some(o), false);
            s.lease_writes += 1;
            let stored = s.objects[&key].clone();
            respond(StatusCode::OK, Body::from(stored.to_string()))
        }
        _ => status(405, "MethodNotAllowed"),
    }
}

async fn handle(State(state): State<Arc<Mutex<ApiState>>>, req: Request<Body>) -> Response {
    let path = req.uri().path();
    if path.starts_with(Res::Leases.prefix()) {
        return lease(&state, req).await;
    }
    if req.method() == axum::http::Method::POST {
        let path = req.uri().path().to_owned();
        let body = axum::body::to_bytes(req.into_body(), 1 << 20)
            .await
            .unwrap_or_default();
        return review(&state, &path, &body);
    }
    let Some((res, ns)) = Res::parse(req.uri().path()) else {
        return status(404, "NotFound");
    };
    let q = query(&req);
    let filter = Filter::from_query(&q);
    let mut s = state.lock().unwrap();
    if s.not_served.contains(&res) {
        return status(404, "NotFound");
    }
    let watching = q.get("watch").is_some_and(|v| v == "true" || v == "1");
    if !watching {
        *s.lists.entry(res).or_default() += 1;
        let items: Vec<&Value> = s
            .objects
            .iter()
            .filter(|((r, n, _), o)| *r == res && *n == ns && filter.matches(o))
            .map(|(_, o)| o)
            .collect();
        let list = json!({"kind": format!("{}List", res.kind()), "apiVersion": res.api_version(),
            "metadata": {"resourceVersion": s.rv.to_string()}, "items": items});
        return respond(StatusCode::OK, Body::from(list.to_string()));
    }
    *s.watches.entry(res).or_default() += 1;
    let from: u64 = q
        .get("resourceVersion")
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    let (tx, rx) = mpsc::unbounded_channel();
    if from < s.compacted {
        let _ = tx.send(line(gone()));
    } else {
        let w = Watcher {
            res,
            ns,
            filter,
            tx,
        };
        for c in s.history.iter().filter(|c| c.rv > from) {
            if let Some(l) = event_for(&w, c) {
                let _ = w.tx.send(l);
            }
        }
        if q.get("allowWatchBookmarks").is_some_and(|v| v == "true") {
            let bm = json!({"type": "BOOKMARK", "object": {"kind": res.kind(),
                "apiVersion": res.api_version(), "metadata": {"resourceVersion": s.rv.to_string()}}});
            let _ = w.tx.send(line(bm));
        }
        s.watchers.push(w);
    }
    let stream = futures_util::stream::unfold(rx, |mut rx| async move {
        rx.recv().await.map(|b| (Ok::<_, Infallible>(b), rx))
    });
    respond(StatusCode::OK, Body::from_stream(stream))
}

/// A pod of the pool.
pub fn pod(name: &str, ip: &str, ready: bool, labels: Value) -> Value {
    json!({
        "metadata": {"name": name, "labels": labels},
        "spec": {"containers": [{"name": "vllm", "image": "vllm"}]},
        "status": {"phase": "Running", "podIP": ip, "conditions": [
            {"type": "PodScheduled", "status": "True"},
            {"type": "Ready", "status": if ready { "True" } else { "False" }},
        ]},
    })
}

/// An `inference.networking.k8s.io/v1` InferencePool.
pub fn pool_v1(name: &str, match_labels: Value, ports: &[u16]) -> Value {
    let ports: Vec<Value> = ports.iter().map(|p| json!({"number": p})).collect();
    json!({
        "metadata": {"name": name},
        "spec": {"selector": {"matchLabels": match_labels}, "targetPorts": ports,
            "endpointPickerRef": {"name": "kv-epp", "port": {"number": 9002}}},
    })
}

/// An `inference.networking.x-k8s.io/v1alpha2` InferencePool.
pub fn pool_v1alpha2(name: &str, selector: Value, port: u16) -> Value {
    json!({
        "metadata": {"name": name},
        "spec": {"selector": selector, "targetPortNumber": port,
            "extensionRef": {"name": "kv-epp"}},
    })
}

/// An EndpointSlice of Service `service` with one named port; endpoints are (ip, ready).
pub fn endpoint_slice(
    name: &str,
    service: &str,
    port: (&str, u16),
    endpoints: &[(&str, bool)],
) -> Value {
    let eps: Vec<Value> = endpoints
        .iter()
        .map(|(ip, ready)| json!({"addresses": [ip], "conditions": {"ready": ready, "serving": ready, "terminating": false}}))
        .collect();
    json!({
        "metadata": {"name": name, "labels": {"kubernetes.io/service-name": service}},
        "addressType": "IPv4",
        "ports": [{"name": port.0, "port": port.1, "protocol": "TCP"}],
        "endpoints": eps,
    })
}
