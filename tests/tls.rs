//! TLS on the ext_proc port, from outside with real TLS clients: mutual TLS against a client CA
//! (no certificate, or one from another CA, is refused in the handshake; the right one gets a
//! decision), certificates and the client CA rotated on disk while a stream is open, a broken
//! file kept out, and a self-signed certificate kept across restarts for pinning.

mod common;

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use common::certs::{Leaf, TestCa, client_config, der_of, handshake, replace_file};
use common::{kv_epp_config, metric};
use envoy_types::pb::envoy::service::ext_proc::v3::ProcessingRequest;
use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_client::ExternalProcessorClient;
use kv_epp::server::Server;
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Identity};

/// The name kv-epp's certificates are issued for, and clients check.
const NAME: &str = "kv-epp";
/// The one static worker: every decision names it.
const WORKER: &str = "10.9.0.1:8000";

fn tmp_dir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("kv-epp-tls-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// An in-process kv-epp serving TLS on ext_proc with `tls` (`, key: value` pairs of `server`).
async fn start(tls: &str) -> Server {
    let config = kv_epp_config(
        &[WORKER.parse().unwrap()],
        &format!(
            "server: {{bind_address: 127.0.0.1, grpc_port: 0, grpc_health_port: 0, metrics_port: 0, admin_port: 0, secure_serving: true{tls}}}\nevents: {{engine: none}}\nengine_metrics: {{interval_ms: 0}}\n"
        ),
    );
    Server::start(&config).await.unwrap()
}

/// A gRPC channel over TLS that trusts `ca` and presents `id`.
async fn channel(addr: SocketAddr, ca: &TestCa, id: &Leaf) -> Channel {
    let tls = ClientTlsConfig::new()
        .ca_certificate(Certificate::from_pem(ca.pem()))
        .identity(Identity::from_pem(&id.cert, &id.key))
        .domain_name(NAME);
    Channel::from_shared(format!("https://{addr}"))
        .unwrap()
        .tls_config(tls)
        .unwrap()
        .connect()
        .await
        .unwrap()
}

/// Polls `f` every 200 ms for up to 20 s (several reload intervals).
async fn until<F: std::future::Future<Output = bool>>(what: &str, mut f: impl FnMut() -> F) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while !f().await {
        assert!(Instant::now() < deadline, "{what} within 20 s");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

struct Rig {
    server: Server,
    certs: PathBuf,
    client_ca: PathBuf,
}

impl Rig {
    /// kv-epp with a certificate from `server_ca` in `dir/certs` and `client_ca` as its client CA.
    async fn start(dir: &Path, server_ca: &TestCa, client_ca: &TestCa) -> Rig {
        let certs = dir.join("certs");
        server_ca.leaf(&[NAME]).write_to(&certs);
        let client_ca_path = dir.join("client-ca.crt");
        replace_file(&client_ca_path, client_ca.pem().as_bytes());
        let server = start(&format!(
            ", cert_path: '{}', client_ca_path: '{}'",
            certs.display(),
            client_ca_path.display()
        ))
        .await;
        Rig {
            server,
            certs,
            client_ca: client_ca_path,
        }
    }

    /// A fresh handshake trusting `ca`, presenting `id`.
    async fn handshake(&self, ca: &TestCa, id: Option<&Leaf>) -> Result<Vec<u8>, String> {
        handshake(self.server.grpc_addr, NAME, client_config(&[&ca.pem()], id)).await
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mutual_tls_admits_only_certificates_from_the_client_ca() {
    let dir = tmp_dir("mutual");
    let (server_ca, client_ca) = (TestCa::new("server CA"), TestCa::new("client CA"));
    let rig = Rig::start(&dir, &server_ca, &client_ca).await;

    let e = rig.handshake(&server_ca, None).await.unwrap_err();
    assert!(
        e.contains("CertificateRequired"),
        "no client certificate: {e}"
    );
    let stranger = TestCa::new("another CA").leaf(&["gateway"]);
    let e = rig
        .handshake(&server_ca, Some(&stranger))
        .await
        .unwrap_err();
    assert!(
        e.contains("UnknownCA"),
        "a certificate from another CA: {e}"
    );
    // Even a certificate from the CA that signed kv-epp's own is not a client certificate here.
    let sibling = server_ca.leaf(&["gateway"]);
    let e = rig.handshake(&server_ca, Some(&sibling)).await.unwrap_err();
    assert!(e.contains("UnknownCA"), "{e}");

    let gateway = client_ca.leaf(&["gateway"]);
    rig.handshake(&server_ca, Some(&gateway)).await.unwrap();
    let ch = channel(rig.server.grpc_addr, &server_ca, &gateway).await;
    let tokens: Vec<u32> = (0..32).collect();
    assert_eq!(
        common::extproc::destination(ch, &tokens, "tenant-a")
            .await
            .as_deref(),
        Some(WORKER)
    );
    let m = common::metrics_text(rig.server.metrics_addr).await;
    assert!(
        metric(
            &m,
            "kv_epp_tls_handshake_failures_total{listener=\"ext_proc\"}"
        ) >= 3.0,
        "{m}"
    );
    rig.server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rotated_files_reach_new_connections_while_open_streams_carry_on() {
    let dir = tmp_dir("rotate");
    let ca = TestCa::new("one CA");
    let rig = Rig::start(&dir, &ca, &ca).await;
    let gateway = ca.leaf(&["gateway"]);
    let first = rig.handshake(&ca, Some(&gateway)).await.unwrap();

    // A stream opened before the rotation: headers now, the body after.
    let (tx, rx) = tokio::sync::mpsc::channel::<ProcessingRequest>(4);
    let mut client =
        ExternalProcessorClient::new(channel(rig.server.grpc_addr, &ca, &gateway).await);
    let tokens: Vec<u32> = (100..164).collect();
    let [headers, body] = common::extproc::completion(&tokens, "tenant-r");
    tx.send(headers).await.unwrap();
    let mut responses = client
        .process(tokio_stream::wrappers::ReceiverStream::new(rx))
        .await
        .unwrap()
        .into_inner();

    // The server certificate is rotated (same CA, new key): new connections get it.
    let second = ca.leaf(&[NAME]);
    second.write_to(&rig.certs);
    until("the new certificate on a new connection", || async {
        rig.handshake(&ca, Some(&gateway)).await.ok() == Some(second.der())
    })
    .await;
    assert_ne!(first, second.der());

    // The stream opened before still works: kv-epp answers it.
    tx.send(body).await.unwrap();
    assert_eq!(
        common::extproc::pick(&mut responses).await.as_deref(),
        Some(WORKER)
    );
    drop(tx);

    // A broken certificate file is refused and the last good certificate stays in use.
    replace_file(
        &rig.certs.join("tls.crt"),
        b"-----BEGIN CERTIFICATE-----\nbroken\n",
    );
    let failed = "kv_epp_tls_reloads_total{listener=\"ext_proc\",outcome=\"failed\"}";
    until("the broken file counted", || async {
        metric(&common::metrics_text(rig.server.metrics_addr).await, failed) >= 1.0
    })
    .await;
    assert_eq!(
        rig.handshake(&ca, Some(&gateway)).await.unwrap(),
        second.der()
    );

    // The client CA rotates too: the old CA's clients are refused, the new CA's admitted.
    second.write_to(&rig.certs);
    let new_ca = TestCa::new("next client CA");
    replace_file(&rig.client_ca, new_ca.pem().as_bytes());
    until("the old client CA refused", || async {
        rig.handshake(&ca, Some(&gateway)).await.is_err()
    })
    .await;
    let next_gateway = new_ca.leaf(&["gateway"]);
    rig.handshake(&ca, Some(&next_gateway)).await.unwrap();
    let m = common::metrics_text(rig.server.metrics_addr).await;
    assert!(
        metric(
            &m,
            "kv_epp_tls_reloads_total{listener=\"ext_proc\",outcome=\"reloaded\"}"
        ) >= 2.0,
        "{m}"
    );
    rig.server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kept_self_signed_certificate_survives_restarts() {
    let dir = tmp_dir("self-signed").join("kept");
    let tls = format!(", self_signed_cert_dir: '{}'", dir.display());
    let server = start(&tls).await;
    let pem = std::fs::read_to_string(dir.join("tls.crt")).unwrap();
    let pinned = der_of(&pem);
    // A client that pins the kept certificate (trusts exactly it) gets through, and sees it.
    let seen = handshake(server.grpc_addr, NAME, client_config(&[&pem], None))
        .await
        .unwrap();
    assert_eq!(seen, pinned);
    server.stop().await;

    let again = start(&tls).await;
    let seen = handshake(again.grpc_addr, NAME, client_config(&[&pem], None))
        .await
        .unwrap();
    assert_eq!(seen, pinned, "the same certificate after a restart");
    assert_eq!(std::fs::read_to_string(dir.join("tls.crt")).unwrap(), pem);
    again.stop().await;
}
