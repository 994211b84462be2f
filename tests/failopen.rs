//! What clients see when kv-epp fails, through a real Envoy 1.40 and `kv-epp serve` as a child
//! process: the shipped fail-open examples carry on with round robin over the workers, the
//! fail-closed ones answer a 5xx that says why and never hang, in both body modes. kv-epp is
//! killed mid-load, frozen mid-load, replaced by a server that answers a gRPC error, and brought
//! back (routing by kv-epp resumes). Each test backs rows of the README's "Failing open" table.

mod common;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::pin::Pin;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::*;
use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_server::{
    ExternalProcessor, ExternalProcessorServer,
};
use envoy_types::pb::envoy::service::ext_proc::v3::{ProcessingRequest, ProcessingResponse};

/// How long a client waits for an answer: far beyond anything a healthy path takes, so a
/// request that reaches it is a hang.
const CLIENT_DEADLINE: Duration = Duration::from_secs(30);

/// The body mode under test: which shipped fail-open and fail-closed examples to run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Mode {
    FullDuplex,
    Buffered,
}

impl Mode {
    fn shapes(self) -> (EnvoyShape, EnvoyShape) {
        match self {
            Mode::FullDuplex => (EnvoyShape::FullDuplexFailOpen, EnvoyShape::FullDuplex),
            Mode::Buffered => (EnvoyShape::BufferedFailOpen, EnvoyShape::Buffered),
        }
    }
}

/// `kv-epp serve` as a child process on ports fixed at creation, so that a restarted kv-epp is
/// found where the killed one was.
struct KvEpp {
    config: PathBuf,
    grpc: u16,
    health: u16,
    child: Option<ChildGuard>,
}

impl KvEpp {
    fn start(workers: &[SocketAddr]) -> KvEpp {
        let list: Vec<String> = workers
            .iter()
            .map(|w| format!("{{endpoint: '{w}', model: m}}"))
            .collect();
        let config = std::env::temp_dir().join(format!(
            "kv-epp-failopen-{}-{}.yaml",
            std::process::id(),
            free_port()
        ));
        std::fs::write(
            &config,
            format!(
                "server: {{bind_address: 127.0.0.1}}\nevents: {{engine: none}}\nengine_metrics: {{interval_ms: 0}}\nmodels: [{{name: m, block_size: 4}}]\nworkers: [{}]\n",
                list.join(", ")
            ),
        )
        .unwrap();
        let mut kv = KvEpp {
            config,
            grpc: free_port(),
            health: free_port(),
            child: None,
        };
        kv.restart();
        kv
    }

    fn restart(&mut self) {
        assert!(self.child.is_none(), "kv-epp is still running");
        let log = std::fs::File::create(self.config.with_extension("log")).unwrap();
        let child = Command::new(env!("CARGO_BIN_EXE_kv-epp"))
            .args(["serve", "--config-file", self.config.to_str().unwrap()])
            .args(["--grpc-port", &self.grpc.to_string()])
            .args(["--grpc-health-port", &self.health.to_string()])
            .args(["--metrics-port", &free_port().to_string()])
            .args(["--admin-port", &free_port().to_string()])
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("start kv-epp serve");
        self.child = Some(ChildGuard(child));
    }

    /// SIGKILL, and returns once the process is gone (its sockets closed by the kernel).
    fn kill(&mut self) {
        drop(self.child.take().expect("kv-epp is running"));
    }

    /// SIGSTOP (`true`) or SIGCONT (`false`): a kv-epp that holds its connections open and
    /// answers nothing, like one stuck or on a host that vanished without a reset.
    fn freeze(&self, frozen: bool) {
        let pid = self.child.as_ref().expect("kv-epp is running").0.id();
        let sig = if frozen { libc::SIGSTOP } else { libc::SIGCONT };
        // SAFETY: signals our own child, which ChildGuard has not reaped.
        assert_eq!(unsafe { libc::kill(pid as libc::pid_t, sig) }, 0);
    }

    /// Waits until the ext_proc service answers SERVING on the health port.
    async fn wait_serving(&self) {
        use tonic_health::pb::HealthCheckRequest;
        use tonic_health::pb::health_check_response::ServingStatus;
        use tonic_health::pb::health_client::HealthClient;
        let url = format!("http://127.0.0.1:{}", self.health);
        let serving = eventually_async(60, || {
            let url = url.clone();
            async move {
                let Ok(ch) = tonic::transport::Endpoint::from_shared(url)
                    .unwrap()
                    .connect()
                    .await
                else {
                    return false;
                };
                let req = HealthCheckRequest {
                    service: "envoy.service.ext_proc.v3.ExternalProcessor".into(),
                };
                HealthClient::new(ch)
                    .check(req)
                    .await
                    .is_ok_and(|r| r.into_inner().status == ServingStatus::Serving as i32)
            }
        })
        .await;
        assert!(
            serving,
            "kv-epp did not serve; log: {}",
            self.config.with_extension("log").display()
        );
    }
}

/// Two workers, one picker, and two Envoys in front of it: the fail-open example of a mode and
/// its fail-closed twin.
struct Rig {
    ups: Vec<Upstream>,
    open: Envoy,
    closed: Envoy,
}

impl Rig {
    /// Starts the workers and both Envoys for a picker whose ext_proc and health ports are
    /// `extproc` and `health`; the picker must be serving.
    async fn start(mode: Mode, ups: Vec<Upstream>, extproc: u16, health: u16) -> Option<Rig> {
        let bin = envoy_binary()?;
        let (open_shape, closed_shape) = mode.shapes();
        let workers: Vec<SocketAddr> = ups.iter().map(|u| u.addr).collect();
        let (port, admin) = (free_port(), free_port());
        let cfg = envoy_fail_open_config(open_shape, port, extproc, health, admin, &workers);
        let open = Envoy::run(&bin, port, admin, &cfg).await;
        let closed = Envoy::start(&bin, closed_shape, extproc).await;
        Some(Rig { ups, open, closed })
    }

    fn load(&self, envoy: &Envoy) -> Load {
        Load::start(SocketAddr::from(([127, 0, 0, 1], envoy.port)), &self.ups)
    }
}

async fn workers(n: usize) -> Vec<Upstream> {
    let mut ups = Vec::new();
    for _ in 0..n {
        ups.push(Upstream::start().await);
    }
    ups
}

/// Whether the fail-open Envoy's health checks count kv-epp healthy.
async fn kv_epp_healthy(envoy: &Envoy) -> bool {
    let r = http(
        ("127.0.0.1", envoy.admin),
        "GET",
        "/stats?filter=^cluster.kv-epp.membership_healthy$",
        &[],
        b"",
    )
    .await
    .unwrap();
    r.text().trim() == "cluster.kv-epp.membership_healthy: 1"
}

/// How one client request ended.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Outcome {
    /// 200 from `worker`; `picked` when kv-epp chose it (the worker got kv-epp's
    /// `x-gateway-destination-endpoint`, naming itself; clients never send one here).
    Served { worker: SocketAddr, picked: bool },
    /// A reply Envoy made itself: its status and `x-local-reply-details`.
    Local { status: u16, details: String },
    /// The connection failed or broke off mid-response.
    Broken(String),
    /// No answer within [`CLIENT_DEADLINE`].
    Hung,
}

impl Outcome {
    fn served(&self) -> bool {
        matches!(self, Outcome::Served { .. })
    }
    fn picked(&self) -> bool {
        matches!(self, Outcome::Served { picked: true, .. })
    }
    /// Envoy's 5xx because of the ext_proc stream, saying so.
    fn ext_proc_error(&self, statuses: &[u16]) -> bool {
        matches!(self, Outcome::Local { status, details }
            if statuses.contains(status) && details.starts_with("ext_proc_error"))
    }
}

#[derive(Clone, Debug)]
struct Sent {
    started: Instant,
    ended: Instant,
    outcome: Outcome,
}

/// A few client loops sending completions through one Envoy, one request at a time each, until
/// stopped; every request's outcome is logged.
struct Load {
    stop: Arc<AtomicBool>,
    log: Arc<Mutex<Vec<Sent>>>,
    loops: Vec<tokio::task::JoinHandle<()>>,
}

const LOOPS: usize = 3;

impl Load {
    fn start(envoy: SocketAddr, ups: &[Upstream]) -> Load {
        static IDS: AtomicU64 = AtomicU64::new(0);
        let stop = Arc::new(AtomicBool::new(false));
        let log = Arc::new(Mutex::new(Vec::new()));
        let loops = (0..LOOPS)
            .map(|_| {
                let (stop, log, ups) = (stop.clone(), log.clone(), ups.to_vec());
                tokio::spawn(async move {
                    while !stop.load(Ordering::Relaxed) {
                        let id = IDS.fetch_add(1, Ordering::Relaxed).to_string();
                        let started = Instant::now();
                        let outcome = send(envoy, &ups, &id).await;
                        let ended = Instant::now();
                        log.lock().unwrap().push(Sent {
                            started,
                            ended,
                            outcome,
                        });
                        // Pacing, so that a stream of instant refusals does not spin.
                        tokio::time::sleep(Duration::from_millis(20)).await;
                    }
                })
            })
            .collect();
        Load { stop, log, loops }
    }

    /// Waits (`secs` at most) until at least `n` logged requests satisfy `f`.
    async fn wait_for(&self, secs: u64, n: usize, f: impl Fn(&Sent) -> bool) -> bool {
        eventually(secs, || {
            self.log.lock().unwrap().iter().filter(|s| f(s)).count() >= n
        })
        .await
    }

    async fn stop(self) -> Vec<Sent> {
        self.stop.store(true, Ordering::Relaxed);
        for l in self.loops {
            l.await.unwrap();
        }
        Arc::try_unwrap(self.log).unwrap().into_inner().unwrap()
    }
}

async fn send(envoy: SocketAddr, ups: &[Upstream], id: &str) -> Outcome {
    // The worker holds each answer a little, so that some requests are mid-response when kv-epp
    // fails (in FULL_DUPLEX the response streams through kv-epp too).
    let body = br#"{"model":"m","prompt":[1,2,3,4,5,6,7,8],"delay_ms":50}"#;
    let headers = [("x-test-id", id)];
    let sent = post_json(envoy, "/v1/completions", &headers, body);
    let r = match tokio::time::timeout(CLIENT_DEADLINE, sent).await {
        Err(_) => return Outcome::Hung,
        Ok(Err(e)) => return Outcome::Broken(e.to_string()),
        Ok(Ok(r)) => r,
    };
    if r.status != 200 {
        return Outcome::Local {
            status: r.status,
            details: r.header("x-local-reply-details").unwrap_or("").to_owned(),
        };
    }
    let worker: SocketAddr = r.header("x-served-by").unwrap().parse().unwrap();
    let up = ups.iter().find(|u| u.addr == worker).unwrap();
    let got = up
        .received
        .lock()
        .unwrap()
        .iter()
        .rev()
        .find(|g| g.headers.get("x-test-id").is_some_and(|v| v == id))
        .cloned()
        .expect("the worker that answered got the request");
    let dest = got.headers.get("x-gateway-destination-endpoint");
    if let Some(d) = dest {
        assert_eq!(
            d.to_str().unwrap(),
            worker.to_string(),
            "kv-epp's pick served"
        );
    }
    Outcome::Served {
        worker,
        picked: dest.is_some(),
    }
}

/// Requests that started at or after `t` and ended before `until`.
fn within(sent: &[Sent], t: Instant, until: Instant) -> impl Iterator<Item = &Sent> {
    sent.iter()
        .filter(move |s| s.started >= t && s.ended < until)
}

/// Rows "kv-epp down at start" and "dies mid-body": kv-epp is killed while three clients per
/// Envoy keep sending, then restarted.
async fn killed_mid_load(mode: Mode) {
    let ups = workers(2).await;
    let mut kv = KvEpp::start(&ups.iter().map(|u| u.addr).collect::<Vec<_>>());
    kv.wait_serving().await;
    let Some(rig) = Rig::start(mode, ups, kv.grpc, kv.health).await else {
        return;
    };
    // kv-epp's own refusals are answers, not failures: both configurations pass them on.
    for envoy in [&rig.open, &rig.closed] {
        let r = post_json(("127.0.0.1", envoy.port), "/v1/completions", &[], b"{no")
            .await
            .unwrap();
        assert_eq!(r.status, 400, "{}", r.text());
        assert_eq!(
            r.header("x-llm-d-request-dropped-reason"),
            Some("bad-request")
        );
    }
    let (open, closed) = (rig.load(&rig.open), rig.load(&rig.closed));
    let start = Instant::now();
    assert!(open.wait_for(60, 10, |s| s.outcome.picked()).await);
    assert!(closed.wait_for(60, 10, |s| s.outcome.picked()).await);

    // Requests that ended before `kill` never met a dead kv-epp; requests that started after
    // `killed` never met a live one.
    let kill = Instant::now();
    kv.kill();
    let killed = Instant::now();
    assert!(
        eventually_async(30, || async { !kv_epp_healthy(&rig.open).await }).await,
        "Envoy's health checks never noticed kv-epp had gone"
    );
    let down = Instant::now();
    assert!(
        open.wait_for(60, 10, |s| s.started >= down && s.ended > down)
            .await
    );
    assert!(
        closed
            .wait_for(60, 10, |s| s.started >= killed && s.ended > killed)
            .await
    );

    kv.restart();
    let back = Instant::now();
    kv.wait_serving().await;
    assert!(
        open.wait_for(60, 5, |s| s.started >= back && s.outcome.picked())
            .await,
        "routing by kv-epp did not resume behind the fail-open Envoy"
    );
    assert!(
        closed
            .wait_for(60, 5, |s| s.started >= back && s.outcome.picked())
            .await,
        "routing by kv-epp did not resume behind the fail-closed Envoy"
    );
    let (open, closed) = (open.stop().await, closed.stop().await);
    let end = Instant::now();

    for s in open.iter().chain(&closed) {
        assert_ne!(s.outcome, Outcome::Hung, "no request hangs");
    }
    for (envoy, log) in [("fail-open", &open), ("fail-closed", &closed)] {
        for s in within(log, start, kill) {
            assert!(s.outcome.served(), "{envoy}, before the kill: {s:?}");
        }
    }
    // Fail open: once Envoy knows kv-epp is down, every request is answered by a worker,
    // round robin (no pick).
    let fell_back: Vec<&Sent> = within(&open, down, back).collect();
    assert!(fell_back.len() >= 10);
    for s in &fell_back {
        assert!(
            matches!(s.outcome, Outcome::Served { picked: false, .. }),
            "{mode:?} fail-open after kv-epp went down: {s:?}"
        );
    }
    let served_by: std::collections::HashSet<_> = fell_back
        .iter()
        .filter_map(|s| match s.outcome {
            Outcome::Served { worker, .. } => Some(worker),
            _ => None,
        })
        .collect();
    assert_eq!(served_by.len(), 2, "round robin over both workers");
    match mode {
        // Envoy holds the whole body: even requests in flight at the kill go on.
        Mode::Buffered => {
            for s in within(&open, start, back) {
                assert!(s.outcome.served(), "buffered fail-open: {s:?}");
            }
        }
        // The body already streamed to kv-epp is lost with it: requests in flight at the kill,
        // or started before the health checks noticed, may end in 500 saying why (or break off
        // mid-response).
        Mode::FullDuplex => {
            for s in within(&open, start, back) {
                assert!(
                    s.outcome.served()
                        || s.outcome.ext_proc_error(&[500])
                        || matches!(s.outcome, Outcome::Broken(_)),
                    "full-duplex fail-open: {s:?}"
                );
            }
        }
    }
    // Fail closed: every request after the kill is Envoy's 500, saying the ext_proc stream
    // failed (gRPC UNAVAILABLE), until kv-epp is back.
    let refused: Vec<&Sent> = within(&closed, killed, back).collect();
    assert!(refused.len() >= 3, "{refused:?}");
    for s in refused {
        assert!(
            matches!(&s.outcome, Outcome::Local { status: 500, details }
                if details.starts_with("ext_proc_error_gRPC_error_14")),
            "{mode:?} fail-closed after the kill: {s:?}"
        );
    }
    for s in within(&closed, start, end) {
        assert!(
            s.outcome.served()
                || s.outcome.ext_proc_error(&[500])
                || matches!(s.outcome, Outcome::Broken(_)),
            "{s:?}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn full_duplex_kv_epp_killed_mid_load() {
    killed_mid_load(Mode::FullDuplex).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn buffered_kv_epp_killed_mid_load() {
    killed_mid_load(Mode::Buffered).await;
}

/// Row "times out": kv-epp is frozen (SIGSTOP) mid-load, so its connections stay open and
/// nothing answers, then thawed.
async fn frozen_mid_load(mode: Mode) {
    let ups = workers(2).await;
    let kv = KvEpp::start(&ups.iter().map(|u| u.addr).collect::<Vec<_>>());
    kv.wait_serving().await;
    let Some(rig) = Rig::start(mode, ups, kv.grpc, kv.health).await else {
        return;
    };
    let (open, closed) = (rig.load(&rig.open), rig.load(&rig.closed));
    assert!(open.wait_for(60, 10, |s| s.outcome.picked()).await);
    assert!(closed.wait_for(60, 10, |s| s.outcome.picked()).await);

    kv.freeze(true);
    let frozen = Instant::now();
    assert!(
        eventually_async(30, || async { !kv_epp_healthy(&rig.open).await }).await,
        "Envoy's health checks never noticed kv-epp had stopped answering"
    );
    let down = Instant::now();
    assert!(
        open.wait_for(60, 10, |s| s.started >= down && s.ended > down)
            .await
    );
    // A request to a frozen kv-epp takes up to the keepalive's interval + timeout (FULL_DUPLEX)
    // or the message timeout (BUFFERED) to be refused.
    assert!(
        closed
            .wait_for(90, LOOPS, |s| s.started >= frozen && s.ended > frozen)
            .await
    );

    kv.freeze(false);
    let thawed = Instant::now();
    assert!(
        open.wait_for(60, 5, |s| s.started >= thawed && s.outcome.picked())
            .await,
        "routing by kv-epp did not resume behind the fail-open Envoy"
    );
    assert!(
        closed
            .wait_for(90, 5, |s| s.started >= thawed && s.outcome.picked())
            .await,
        "routing by kv-epp did not resume behind the fail-closed Envoy"
    );
    let (open, closed) = (open.stop().await, closed.stop().await);

    for s in open.iter().chain(&closed) {
        assert_ne!(s.outcome, Outcome::Hung, "no request hangs");
    }
    for s in within(&open, down, thawed) {
        assert!(
            matches!(s.outcome, Outcome::Served { picked: false, .. }),
            "{mode:?} fail-open while kv-epp is known down: {s:?}"
        );
    }
    let (fail_open_ok, closed_status): (fn(&Outcome) -> bool, &[u16]) = match mode {
        // The message timeout fires and the request goes on without a pick.
        Mode::Buffered => (Outcome::served, &[504, 500]),
        // No message timeout: the keepalive closes the connection, and the requests it carried
        // end in 500 (or break off mid-response).
        Mode::FullDuplex => (
            |o| o.served() || o.ext_proc_error(&[500]) || matches!(o, Outcome::Broken(_)),
            &[500],
        ),
    };
    for s in within(&open, frozen, thawed) {
        assert!(
            fail_open_ok(&s.outcome),
            "{mode:?} fail-open, frozen: {s:?}"
        );
    }
    let refused: Vec<&Sent> = within(&closed, frozen, thawed).collect();
    assert!(refused.len() >= LOOPS, "{refused:?}");
    for s in refused {
        assert!(
            s.outcome.ext_proc_error(closed_status),
            "{mode:?} fail-closed, frozen: {s:?}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn full_duplex_kv_epp_frozen_mid_load() {
    frozen_mid_load(Mode::FullDuplex).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn buffered_kv_epp_frozen_mid_load() {
    frozen_mid_load(Mode::Buffered).await;
}

/// A picker that refuses every stream with gRPC UNAVAILABLE while its health port says SERVING.
struct Refusing;

#[tonic::async_trait]
impl ExternalProcessor for Refusing {
    type ProcessStream =
        Pin<Box<dyn futures_util::Stream<Item = Result<ProcessingResponse, tonic::Status>> + Send>>;

    async fn process(
        &self,
        _: tonic::Request<tonic::Streaming<ProcessingRequest>>,
    ) -> Result<tonic::Response<Self::ProcessStream>, tonic::Status> {
        Err(tonic::Status::unavailable("refused by the test"))
    }
}

/// Starts [`Refusing`] and a health service reporting it SERVING; returns (ext_proc, health).
async fn start_refusing() -> (u16, u16) {
    use tonic_health::ServingStatus;
    let ext_proc = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let health = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let ports = (
        ext_proc.local_addr().unwrap().port(),
        health.local_addr().unwrap().port(),
    );
    let (reporter, health_svc) = tonic_health::server::health_reporter();
    reporter
        .set_service_status(
            "envoy.service.ext_proc.v3.ExternalProcessor",
            ServingStatus::Serving,
        )
        .await;
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(ExternalProcessorServer::new(Refusing))
            .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(ext_proc)),
    );
    tokio::spawn(async move {
        let _keep = reporter;
        tonic::transport::Server::builder()
            .add_service(health_svc)
            .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(health))
            .await
    });
    ports
}

/// Row "answers a gRPC error": a reachable, healthy picker that fails every stream.
async fn picker_answers_an_error(mode: Mode) {
    let (extproc, health) = start_refusing().await;
    let Some(rig) = Rig::start(mode, workers(2).await, extproc, health).await else {
        return;
    };
    assert!(kv_epp_healthy(&rig.open).await);
    for _ in 0..4 {
        let open = send(
            SocketAddr::from(([127, 0, 0, 1], rig.open.port)),
            &rig.ups,
            "x",
        )
        .await;
        let closed = send(
            SocketAddr::from(([127, 0, 0, 1], rig.closed.port)),
            &rig.ups,
            "x",
        )
        .await;
        match mode {
            Mode::Buffered => assert!(
                matches!(open, Outcome::Served { picked: false, .. }),
                "{open:?}"
            ),
            // The error arrives after Envoy has streamed the body to the picker.
            Mode::FullDuplex => assert!(open.ext_proc_error(&[500]), "{open:?}"),
        }
        assert!(closed.ext_proc_error(&[500]), "{closed:?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn full_duplex_picker_answering_an_error() {
    picker_answers_an_error(Mode::FullDuplex).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn buffered_picker_answering_an_error() {
    picker_answers_an_error(Mode::Buffered).await;
}
