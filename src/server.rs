//! `kv-epp serve` as a library: binds the listeners (ext_proc gRPC, gRPC health, Prometheus
//! metrics, admin, peers), wires them to one [`Picker`], and runs until shut down. Tests start it
//! in-process on ephemeral ports and reach the picker directly.

use std::future::Future;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_server::ExternalProcessorServer;
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tonic::transport::Server as GrpcServer;
use tonic::transport::server::TcpIncoming;
use tonic_health::ServingStatus;

use crate::auth::{Guard, Listener, Reviews, TokenFile, Verifier};
use crate::config::Config;
use crate::decide::Picker;
use crate::events::Feeds;
use crate::extproc::budget::BodyBudget;
use crate::extproc::stream::StreamOptions;
use crate::extproc::{ExtProcService, StreamLimits};
use crate::membership::Membership;
use crate::metrics::Metrics;
use crate::readiness::Readiness;
use crate::replica::{PeerTls, ReplicaState};
use crate::tls::self_signed;
use crate::tls::{Reloading, TlsError, TlsFiles};

/// The gRPC health service names a gateway or the kubelet may ask for.
pub(crate) const HEALTH_SERVICES: [&str; 4] = [
    "liveness",
    "readiness",
    "inference-extension",
    "envoy.service.ext_proc.v3.ExternalProcessor",
];

/// Why the server could not start.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    /// A listener could not bind.
    #[error("cannot listen on {addr} ({what}): {source}")]
    Bind {
        /// Which listener.
        what: &'static str,
        /// The address.
        addr: SocketAddr,
        /// The cause.
        source: std::io::Error,
    },
    /// A tokenizer could not be loaded.
    #[error("{0}")]
    Tokenizer(String),
    /// TLS material could not be loaded or generated.
    #[error("TLS: {0}")]
    Tls(String),
    /// Replication could not be set up.
    #[error("peers: {0}")]
    Peers(String),
    /// A control port's authentication could not be set up (the message names the field).
    #[error("{0}")]
    Auth(String),
    /// A setting is invalid (the message names the field).
    #[error("{0}")]
    Config(String),
}

/// A running server.
pub struct Server {
    /// The request pipeline's state every listener shares (models, workers, policy).
    pub picker: Arc<Picker>,
    /// Bound ext_proc address.
    pub grpc_addr: SocketAddr,
    /// Bound health address.
    pub health_addr: SocketAddr,
    /// Bound metrics address.
    pub metrics_addr: SocketAddr,
    /// Bound admin address.
    pub admin_addr: SocketAddr,
    /// The engine event feeds.
    pub feeds: Arc<Feeds>,
    /// What gates this replica's readiness.
    pub readiness: Readiness,
    /// Replication with peer replicas, when configured.
    pub replica: Option<Arc<ReplicaState>>,
    /// Bound peer API address, when replication is configured.
    pub peer_addr: Option<SocketAddr>,
    /// The running workers (static or discovered) and their feeds and scrapers.
    pub membership: Arc<Membership>,
    /// Flow control: quotas and the queue at saturation (`flow_control`).
    pub flow: Arc<crate::flow::FlowControl>,
    shutdown: watch::Sender<bool>,
    tasks: Vec<JoinHandle<()>>,
}

/// The accepted connections of a gRPC listener, each with TCP_NODELAY set. Without it the small
/// messages that follow a streamed body chunk wait on Nagle's algorithm and the peer's delayed
/// ACK: tens of milliseconds per request. (tonic's builder option does not reach connections
/// served from our own listener, so it is set here.)
pub(crate) fn incoming(listener: TcpListener) -> TcpIncoming {
    TcpIncoming::from(listener).with_nodelay(Some(true))
}

/// Accepts a connection on an HTTP listener (metrics, admin) with TCP_NODELAY set, for the same
/// reason as [`incoming`]: a response written in pieces must not wait on Nagle.
pub(crate) async fn accept_http(
    listener: &TcpListener,
) -> std::io::Result<(tokio::net::TcpStream, SocketAddr)> {
    let (tcp, peer) = listener.accept().await?;
    if let Err(e) = tcp.set_nodelay(true) {
        tracing::debug!(error = %e, "could not set TCP_NODELAY on an HTTP connection");
    }
    Ok((tcp, peer))
}

/// Most connections one HTTP port (metrics, admin) serves at once; more are closed as they are
/// accepted. A scraper or an operator needs a handful.
const MAX_HTTP_CONNECTIONS: usize = 256;
/// Most connections one client address may hold on one of these ports, so one client cannot
/// take every slot.
const MAX_HTTP_CONNECTIONS_PER_CLIENT: usize = 16;
/// Longest a connection is kept, requests or not (a client that never reads its answer
/// included): clients reconnect, and a slot is never held for good.
const HTTP_CONNECTION_LIFETIME: Duration = Duration::from_secs(120);
/// Longest wait for a request's headers, also between requests on a kept-alive connection.
const HTTP_HEADER_TIMEOUT: Duration = Duration::from_secs(10);
/// Longest a request may take, its body read included (408 after it).
const HTTP_REQUEST_TIMEOUT: Duration = Duration::from_secs(60);

/// Runs `f` when dropped.
fn scopeguard(f: impl FnOnce()) -> impl Drop {
    struct Guard<F: FnOnce()>(Option<F>);
    impl<F: FnOnce()> Drop for Guard<F> {
        fn drop(&mut self) {
            if let Some(f) = self.0.take() {
                f();
            }
        }
    }
    Guard(Some(f))
}

/// Serves `app` (HTTP/1.1) on `listener` until `stop` fires. Whoever reaches these ports is
/// untrusted until its token is checked, which needs its headers: connections are capped
/// ([`MAX_HTTP_CONNECTIONS`], [`MAX_HTTP_CONNECTIONS_PER_CLIENT`]), headers must arrive within
/// [`HTTP_HEADER_TIMEOUT`], a request must be done within [`HTTP_REQUEST_TIMEOUT`] and a
/// connection closes after [`HTTP_CONNECTION_LIFETIME`], so a client that sends half a request,
/// trickles a body or never reads its answers holds no slot for long. At `stop` each connection
/// finishes its request and closes. Every connection has TCP_NODELAY; handlers see the peer as
/// `ConnectInfo<SocketAddr>`.
async fn serve_http(
    what: &'static str,
    listener: TcpListener,
    app: axum::Router,
    mut stop: tokio::sync::watch::Receiver<bool>,
) {
    let slots = Arc::new(tokio::sync::Semaphore::new(MAX_HTTP_CONNECTIONS));
    let per_client: Arc<parking_lot::Mutex<std::collections::HashMap<std::net::IpAddr, usize>>> =
        Arc::default();
    let mut conns = tokio::task::JoinSet::new();
    loop {
        while conns.try_join_next().is_some() {}
        let accepted = tokio::select! {
            r = accept_http(&listener) => Some(r),
            _ = stop.wait_for(|s| *s) => None,
        };
        let Some(accepted) = accepted else {
            // Stopping: each connection finishes its request and closes (see below); wait for
            // them, a little.
            let all_closed = async { while conns.join_next().await.is_some() {} };
            let _ = tokio::time::timeout(Duration::from_secs(10), all_closed).await;
            return;
        };
        let (tcp, peer) = match accepted {
            Ok(c) => c,
            Err(e) => {
                // Out of descriptors, or a connection reset before it was accepted: go on.
                tracing::debug!(listener = what, error = %e, "accept failed");
                tokio::time::sleep(Duration::from_millis(20)).await;
                continue;
            }
        };
        let Ok(slot) = slots.clone().try_acquire_owned() else {
            tracing::debug!(listener = what, %peer, "too many connections: closing a new one");
            continue;
        };
        let ip = peer.ip();
        {
            let mut held = per_client.lock();
            let n = held.entry(ip).or_default();
            if *n >= MAX_HTTP_CONNECTIONS_PER_CLIENT {
                tracing::debug!(listener = what, %peer, "too many connections from this client");
                continue;
            }
            *n += 1;
        }
        let app = app.clone();
        let per_client = per_client.clone();
        let mut stop = stop.clone();
        conns.spawn(async move {
            let _slot = slot;
            // Gives this client's count back however the connection ends.
            let _counted = scopeguard(move || {
                let mut held = per_client.lock();
                if let Some(n) = held.get_mut(&ip) {
                    *n -= 1;
                    if *n == 0 {
                        held.remove(&ip);
                    }
                }
            });
            let service = hyper::service::service_fn(
                move |mut req: hyper::Request<hyper::body::Incoming>| {
                    req.extensions_mut()
                        .insert(axum::extract::ConnectInfo(peer));
                    let app = app.clone();
                    async move {
                        let call = tower::ServiceExt::oneshot(app, req);
                        match tokio::time::timeout(HTTP_REQUEST_TIMEOUT, call).await {
                            Ok(answer) => answer,
                            Err(_) => Ok(axum::response::IntoResponse::into_response((
                                axum::http::StatusCode::REQUEST_TIMEOUT,
                                "request not completed in time\n",
                            ))),
                        }
                    }
                },
            );
            let conn = hyper::server::conn::http1::Builder::new()
                .timer(hyper_util::rt::TokioTimer::new())
                .header_read_timeout(HTTP_HEADER_TIMEOUT)
                .serve_connection(hyper_util::rt::TokioIo::new(tcp), service);
            tokio::pin!(conn);
            let ended = tokio::select! {
                r = conn.as_mut() => Some(r),
                _ = tokio::time::sleep(HTTP_CONNECTION_LIFETIME) => None,
                _ = stop.wait_for(|s| *s) => None,
            };
            let ended = match ended {
                Some(r) => r,
                None => {
                    // Lifetime over, or stopping: the request in progress (if any) is
                    // finished, then the connection closes; a client that does not read its
                    // answer gets a few seconds more.
                    conn.as_mut().graceful_shutdown();
                    tokio::time::timeout(Duration::from_secs(5), conn)
                        .await
                        .unwrap_or(Ok(()))
                }
            };
            if let Err(e) = ended {
                tracing::debug!(listener = what, %peer, error = %e, "HTTP connection ended");
            }
        });
    }
}

async fn bind(what: &'static str, addr: SocketAddr) -> Result<TcpListener, ServeError> {
    TcpListener::bind(addr)
        .await
        .map_err(|source| ServeError::Bind { what, addr, source })
}

/// The ext_proc port's TLS material: the mounted `cert_path`, else the self-signed pair kept in
/// `self_signed_cert_dir`, else one generated in memory; plus the client CA when set.
fn ext_proc_tls(config: &Config, metrics: &Metrics) -> Result<Arc<Reloading>, ServeError> {
    let s = &config.server;
    let tls = |e: TlsError| ServeError::Tls(e.to_string());
    let mut files = match (&s.cert_path, &s.self_signed_cert_dir) {
        (Some(dir), _) => TlsFiles::in_dir(dir, None),
        (None, Some(dir)) => self_signed::persisted(dir).map_err(tls)?,
        (None, None) => {
            tracing::info!("serving ext_proc over TLS with a generated self-signed certificate");
            self_signed::in_memory().map_err(tls)?
        }
    };
    files.ca = s.client_ca_path.clone();
    if files.ca.is_some() {
        tracing::info!("ext_proc requires client certificates (server.client_ca_path)");
    }
    Reloading::load("ext_proc", files, metrics).map_err(tls)
}

/// The peer API's mutual TLS (`peers.cert_path`), when configured.
fn peer_tls(config: &Config, metrics: &Metrics) -> Result<Option<PeerTls>, ServeError> {
    let Some(dir) = &config.peers.cert_path else {
        return Ok(None);
    };
    let peers = |m: String| ServeError::Peers(m);
    let name = config
        .peer_server_name()
        .ok_or_else(|| peers("peers.server_name is required with peers.cert_path".into()))?;
    let name =
        crate::tls::server_name(&name).map_err(|e| peers(format!("peers.server_name: {e}")))?;
    let files = TlsFiles::in_dir(dir, Some(dir.join("ca.crt")));
    let configs = Reloading::load("peer", files, metrics)
        .map_err(|e| peers(format!("peers.cert_path: {e}")))?;
    Ok(Some(PeerTls { configs, name }))
}

/// Runs a gRPC server until it stops, logging why if it failed.
async fn log_stopped(
    what: &'static str,
    served: impl Future<Output = Result<(), tonic::transport::Error>>,
) {
    if let Err(e) = served.await {
        tracing::error!(error = %e, "{what} server stopped");
    }
}

impl Server {
    /// Binds every listener and starts serving. Ports of 0 bind ephemeral ports.
    pub async fn start(config: &Config) -> Result<Server, ServeError> {
        let readiness = Readiness::default();
        let feeds = Arc::new(Feeds::new(config.events.limits()));
        let metrics = Arc::new(Metrics::with_event_feeds(feeds.clone()));
        let picker = Arc::new(
            config
                .picker(metrics.clone())
                .map_err(|e| ServeError::Tokenizer(e.to_string()))?,
        );
        // TLS material first: a certificate that cannot be used stops start-up before any
        // listener or task exists.
        let grpc_tls = match config.server.secure_serving {
            true => Some(ext_proc_tls(config, &metrics)?),
            false => None,
        };
        let peer_tls = match config.peers.enabled() {
            true => peer_tls(config, &metrics)?,
            false => None,
        };
        let ip = config.server.bind_address;
        let (admin_guard, metrics_guard) = guards(config, &metrics).await?;
        let grpc = bind("ext_proc", SocketAddr::new(ip, config.server.grpc_port)).await?;
        let health = bind(
            "health",
            SocketAddr::new(ip, config.server.grpc_health_port),
        )
        .await?;
        let metrics_l = bind("metrics", SocketAddr::new(ip, config.server.metrics_port)).await?;
        let admin_ip = admin_bind_address(ip, admin_guard.is_some());
        let admin_l = bind("admin", SocketAddr::new(admin_ip, config.server.admin_port)).await?;
        let admin_addr = local(&admin_l);
        if admin_guard.is_none() {
            tracing::warn!(%admin_addr, "server.admin_token_file is not set: the admin API needs no token, so it listens on loopback only (set a token file to serve it on server.bind_address)");
        }
        let replica = match &config.peers.enabled() {
            true => {
                let token = match config.peers.token_file.clone() {
                    Some(p) => Some(crate::replica::PeerToken::File(Arc::new(
                        peer_token_file(p).await?,
                    ))),
                    None => None,
                };
                let mut peers = config.peers.clone();
                // kv-epp's own Service: its EndpointSlices through the Kubernetes API, or else
                // its DNS name (the chart's peer Service is headless and publishes not-ready
                // replicas, so the name resolves to every replica).
                let mut slices = None;
                if let (Some(svc), None) = (&peers.service, &peers.dns) {
                    let ns = config.peers_namespace();
                    match crate::discovery::client_for(config.pool.kubeconfig.as_deref()).await {
                        Ok(client) => {
                            slices = Some(
                                crate::discovery::watch_service_endpoints(
                                    client, ns, svc, peers.port,
                                )
                                .await,
                            );
                        }
                        Err(e) => {
                            tracing::warn!(error = %e, "no Kubernetes API for peer discovery; resolving the peer Service through DNS");
                            peers.dns = Some(format!("{svc}.{ns}.svc:{}", peers.port));
                        }
                    }
                }
                let state = ReplicaState::new(
                    picker.workers.clone(),
                    metrics.clone(),
                    feeds.clone(),
                    peers,
                    token,
                    peer_tls,
                    readiness.clone(),
                )
                .map_err(ServeError::Peers)?;
                if let Some(rx) = slices {
                    state.members.set_discovered(rx);
                }
                if config.drain_lease() {
                    drain_lease(config, &state, &metrics).await?;
                }
                let l = bind("peer", SocketAddr::new(ip, config.peers.port)).await?;
                Some((state, l))
            }
            false => None,
        };
        if config.discovers_workers() {
            readiness.set(
                crate::discovery::READINESS_CONDITION,
                false,
                "the InferencePool and its pods are not listed yet",
            );
        }
        // Static workers and discovered ones go through the same reconciler.
        let membership = Arc::new(Membership::new(
            config.membership_settings(),
            picker.models.clone(),
            picker.workers.clone(),
            feeds.clone(),
        ));
        membership.reconcile(config.static_workers());
        let (grpc_addr, health_addr, metrics_addr) =
            (local(&grpc), local(&health), local(&metrics_l));
        let (shutdown, rx) = watch::channel(false);
        let mut tasks = Vec::new();

        let flow = crate::flow::FlowControl::new(
            config.flow_control.settings().map_err(ServeError::Config)?,
            picker.clone(),
            metrics.flow.clone(),
            picker.workers.released(),
        );
        {
            // Dispatches on every booking released; the tick covers engine load falling and
            // workers becoming ready.
            let (flow, mut stop) = (flow.clone(), rx.clone());
            tasks.push(tokio::spawn(async move {
                tokio::select! {
                    _ = flow.run(Duration::from_millis(50)) => {}
                    _ = stop.wait_for(|s| *s) => {}
                }
            }));
        }
        metrics
            .io_threads
            .set(tokio::runtime::Handle::current().metrics().num_workers() as i64);
        tasks.push(tokio::spawn(crate::upkeep::reclaim(
            crate::upkeep::RECLAIM_PERIOD,
            metrics.index_retired_tables.clone(),
            rx.clone(),
        )));
        let opts = StreamOptions {
            flow: Some(flow.clone()),
            max_body_bytes: config.routing.max_body_bytes,
            retry_after_seconds: config.routing.retry_after_seconds,
            conformance_hooks: config.routing.conformance_hooks,
            body_budget: BodyBudget::new(
                config.routing.max_buffered_body_bytes,
                metrics.buffered_body_bytes.clone(),
            ),
        };
        let limits = StreamLimits {
            idle_before_decision: Duration::from_millis(config.routing.stream_idle_timeout_ms),
            decision_threads: config.routing.decision_threads,
            large_body_decision_threads: config.routing.large_body_decision_threads,
        };
        let service = ExternalProcessorServer::new(ExtProcService::new(
            picker.clone(),
            metrics.clone(),
            opts,
            limits,
        ))
        .max_decoding_message_size(config.routing.max_body_bytes.max(4 << 20) + (1 << 20));
        let keepalive = (config.server.keepalive_interval_ms > 0)
            .then(|| Duration::from_millis(config.server.keepalive_interval_ms));
        let router_svc = GrpcServer::builder()
            .max_concurrent_streams(config.server.max_concurrent_streams)
            .http2_keepalive_interval(keepalive)
            .http2_keepalive_timeout(Some(Duration::from_millis(
                config.server.keepalive_timeout_ms,
            )))
            .add_service(service);
        let mut stop = rx.clone();
        let done = async move {
            let _ = stop.wait_for(|s| *s).await;
        };
        let ext_proc = match grpc_tls {
            Some(tls) => {
                tasks.push(tokio::spawn(crate::tls::watch(tls.clone(), rx.clone())));
                let conns = crate::tls::accept::incoming(grpc, tls);
                tokio::spawn(log_stopped(
                    "ext_proc",
                    router_svc.serve_with_incoming_shutdown(conns, done),
                ))
            }
            None => tokio::spawn(log_stopped(
                "ext_proc",
                router_svc.serve_with_incoming_shutdown(incoming(grpc), done),
            )),
        };
        tasks.push(ext_proc);

        let (reporter, health_svc) = tonic_health::server::health_reporter();
        for name in HEALTH_SERVICES {
            reporter
                .set_service_status(name, ServingStatus::Serving)
                .await;
        }
        // Liveness is always serving; the rest follow the readiness conditions.
        let mut ready_rx = readiness.subscribe();
        let mut stop = rx.clone();
        tasks.push(tokio::spawn(async move {
            loop {
                let status = if *ready_rx.borrow_and_update() {
                    ServingStatus::Serving
                } else {
                    ServingStatus::NotServing
                };
                for name in HEALTH_SERVICES.iter().filter(|n| **n != "liveness") {
                    reporter.set_service_status(*name, status).await;
                }
                tokio::select! {
                    r = ready_rx.changed() => if r.is_err() { return },
                    _ = stop.wait_for(|s| *s) => return,
                }
            }
        }));
        let mut stop = rx.clone();
        tasks.push(tokio::spawn(async move {
            let done = async move {
                let _ = stop.wait_for(|s| *s).await;
            };
            if let Err(e) = GrpcServer::builder()
                .add_service(health_svc)
                .serve_with_incoming_shutdown(incoming(health), done)
                .await
            {
                tracing::error!(error = %e, "health server stopped");
            }
        }));

        let exported = metrics.clone();
        let mut app = axum::Router::new().route(
            "/metrics",
            axum::routing::get(move || {
                let m = exported.clone();
                async move {
                    (
                        [(
                            axum::http::header::CONTENT_TYPE,
                            "application/openmetrics-text; version=1.0.0; charset=utf-8",
                        )],
                        m.encode(),
                    )
                }
            }),
        );
        if let Some(guard) = metrics_guard {
            app = guard.protect(app);
        }
        tasks.push(tokio::spawn(serve_http(
            "metrics",
            metrics_l,
            app,
            rx.clone(),
        )));
        if config.discovers_workers() {
            let (run, mut stop) = (
                crate::discovery::run(
                    config.discovery_settings(),
                    membership.clone(),
                    readiness.clone(),
                    metrics.clone(),
                ),
                rx.clone(),
            );
            tasks.push(tokio::spawn(async move {
                tokio::select! {
                    _ = run => {}
                    _ = stop.wait_for(|s| *s) => {}
                }
            }));
        }
        let mut peer_addr = None;
        let replica = replica.map(|(state, listener)| {
            peer_addr = Some(local(&listener));
            tasks.extend(crate::replica::start(state.clone(), listener, rx.clone()));
            state
        });
        let mut admin = crate::admin::routes(crate::admin::AdminState {
            picker: picker.clone(),
            feeds: feeds.clone(),
            replica: replica.clone(),
            max_body_bytes: config.routing.max_body_bytes,
            retry_after_seconds: config.routing.retry_after_seconds,
            flow: Some(flow.clone()),
        });
        if let Some(guard) = admin_guard {
            admin = guard.protect(admin);
        }
        tasks.push(tokio::spawn(serve_http(
            "admin",
            admin_l,
            admin,
            rx.clone(),
        )));
        tracing::info!(%grpc_addr, %health_addr, %metrics_addr, %admin_addr, "kv-epp serving");
        Ok(Server {
            picker,
            grpc_addr,
            health_addr,
            metrics_addr,
            admin_addr,
            feeds,
            readiness,
            replica,
            peer_addr,
            membership,
            flow,
            shutdown,
            tasks,
        })
    }

    /// Stops every listener and waits for them.
    pub async fn stop(self) {
        let _ = self.shutdown.send(true);
        for t in self.tasks {
            let _ = t.await;
        }
        self.membership.shutdown();
    }
}

/// Where the admin API listens: `bind` when it is authenticated (or already loopback), else the
/// loopback address of the same family, so an unauthenticated admin API is never reachable
/// from another host.
fn admin_bind_address(bind: IpAddr, authenticated: bool) -> IpAddr {
    match bind {
        _ if authenticated || bind.is_loopback() => bind,
        IpAddr::V4(_) => IpAddr::V4(Ipv4Addr::LOCALHOST),
        IpAddr::V6(_) => IpAddr::V6(Ipv6Addr::LOCALHOST),
    }
}

/// The admin and metrics guards the configuration asks for. Token files are read now (an empty
/// or unreadable one stops start-up, naming its field); metrics auth without a token file needs
/// a Kubernetes client for TokenReview.
async fn guards(
    config: &Config,
    metrics: &crate::metrics::Metrics,
) -> Result<(Option<Arc<Guard>>, Option<Arc<Guard>>), ServeError> {
    let s = &config.server;
    let token_file = |field, path: &std::path::Path| {
        TokenFile::open(field, path)
            .map(Verifier::TokenFile)
            .map_err(|e| ServeError::Auth(e.to_string()))
    };
    let admin = match &s.admin_token_file {
        Some(path) => {
            let verifier = token_file("server.admin_token_file", path)?;
            let open = &[crate::admin::LIVENESS_PATH][..];
            Some(Guard::new(Listener::Admin, verifier, open, metrics))
        }
        None => None,
    };
    let scrapes = match (&s.metrics_token_file, s.metrics_auth) {
        (_, false) => None,
        (Some(path), true) => Some(token_file("server.metrics_token_file", path)?),
        (None, true) => {
            let client = crate::discovery::client_for(config.pool.kubeconfig.as_deref())
                .await
                .map_err(|e| {
                    ServeError::Auth(format!(
                        "server.metrics_auth is true and server.metrics_token_file is not set, so scrapes are checked with the Kubernetes TokenReview API, but there is no Kubernetes client: {e}"
                    ))
                })?;
            let reviewer = crate::discovery::TokenReviewer::new(client, "/metrics");
            Some(Verifier::Kubernetes(Box::new(Reviews::new(reviewer))))
        }
    };
    let scrapes = scrapes.map(|v| Guard::new(Listener::Metrics, v, &[], metrics));
    Ok((admin.map(Arc::new), scrapes.map(Arc::new)))
}

fn local(l: &TcpListener) -> SocketAddr {
    l.local_addr()
        .expect("a bound listener has a local address")
}

/// Makes a Kubernetes Lease decide drain ownership (`peers.coordination`). Without a usable
/// Kubernetes configuration, `lease` stops start-up and `auto` falls back to the probes, loudly.
async fn drain_lease(
    config: &Config,
    state: &ReplicaState,
    metrics: &Arc<Metrics>,
) -> Result<(), ServeError> {
    let settings = config.drain_lease_settings();
    let client = match crate::discovery::client_for(config.pool.kubeconfig.as_deref()).await {
        Ok(c) => c,
        Err(e) if config.peers.coordination == crate::replica::Coordination::Lease => {
            return Err(ServeError::Peers(format!(
                "peers.coordination: lease needs the Kubernetes API: {e}"
            )));
        }
        Err(e) => {
            tracing::warn!(error = %e, "no Kubernetes API for the drain lease: drain ownership falls back to the peer probes (a symmetric partition can split a drain)");
            return Ok(());
        }
    };
    let api = crate::discovery::LeaseApi::new(
        client,
        &settings.namespace,
        &settings.name,
        settings.renew,
    );
    tracing::info!(lease = %settings.name, namespace = %settings.namespace, duration_s = settings.duration_seconds, "a Kubernetes Lease decides which replica drains TensorRT-LLM workers");
    state.use_lease(Arc::new(crate::replica::lease::DrainLease::new(
        api,
        settings,
        state.instance,
        metrics.replica_lease.clone(),
    )));
    Ok(())
}

/// Opens `peers.token_file`, waiting up to 10 s for a file that is missing, empty or being
/// rewritten (not every tool replaces a Secret atomically).
async fn peer_token_file(path: std::path::PathBuf) -> Result<TokenFile, ServeError> {
    tokio::task::spawn_blocking(move || {
        TokenFile::open_patiently(
            "peers.token_file",
            &path,
            std::time::Duration::from_secs(10),
        )
    })
    .await
    .map_err(|e| ServeError::Peers(e.to_string()))?
    .map_err(|e| ServeError::Peers(e.to_string()))
}

#[cfg(test)]
mod tests {
    use futures_util::StreamExt;

    use super::*;

    #[test]
    fn an_unauthenticated_admin_api_listens_on_loopback_only() {
        let ip = |s: &str| s.parse::<IpAddr>().unwrap();
        assert_eq!(admin_bind_address(ip("0.0.0.0"), false), ip("127.0.0.1"));
        assert_eq!(admin_bind_address(ip("10.1.2.3"), false), ip("127.0.0.1"));
        assert_eq!(admin_bind_address(ip("::"), false), ip("::1"));
        assert_eq!(admin_bind_address(ip("127.0.0.7"), false), ip("127.0.0.7"));
        assert_eq!(admin_bind_address(ip("0.0.0.0"), true), ip("0.0.0.0"));
        assert_eq!(admin_bind_address(ip("::"), true), ip("::"));
    }

    /// Every connection a gRPC listener accepts has Nagle off.
    #[tokio::test]
    async fn accepted_connections_have_tcp_nodelay() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let mut accepted = incoming(listener);
        let _client = tokio::net::TcpStream::connect(addr).await.unwrap();
        let conn = accepted.next().await.unwrap().unwrap();
        assert!(
            conn.nodelay().unwrap(),
            "TCP_NODELAY on the accepted socket"
        );
    }

    /// So has every connection the metrics and admin listeners accept.
    #[tokio::test]
    async fn accepted_http_connections_have_tcp_nodelay() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let _client = tokio::net::TcpStream::connect(addr).await.unwrap();
        let (conn, _) = accept_http(&listener).await.unwrap();
        assert!(
            conn.nodelay().unwrap(),
            "TCP_NODELAY on the accepted socket"
        );
    }
}
