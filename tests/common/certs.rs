//! Certificates made in the test (rcgen): CAs, leaves they sign, the files kv-epp and Envoy
//! read, and raw TLS handshakes (tokio-rustls) that report which certificate a server presented
//! or why it refused us.

use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use rcgen::{
    BasicConstraints, CertificateParams, CertifiedIssuer, DnType, ExtendedKeyUsagePurpose, IsCa,
    KeyPair,
};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio_rustls::rustls;
use tokio_rustls::rustls::pki_types::pem::PemObject;
use tokio_rustls::rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};

/// A certificate authority.
pub struct TestCa {
    issuer: CertifiedIssuer<'static, KeyPair>,
}

/// A certificate and its key, as PEM.
#[derive(Clone)]
pub struct Leaf {
    pub cert: String,
    pub key: String,
}

impl TestCa {
    /// A new CA with its own key.
    pub fn new(name: &str) -> TestCa {
        let mut p = CertificateParams::new(Vec::<String>::new()).unwrap();
        p.distinguished_name.push(DnType::CommonName, name);
        p.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        TestCa {
            issuer: CertifiedIssuer::self_signed(p, KeyPair::generate().unwrap()).unwrap(),
        }
    }

    /// The CA certificate (what a verifier trusts).
    pub fn pem(&self) -> String {
        self.issuer.pem()
    }

    /// A leaf for `names` (DNS names), usable as server and as client.
    pub fn leaf(&self, names: &[&str]) -> Leaf {
        let mut p =
            CertificateParams::new(names.iter().map(|n| (*n).to_owned()).collect::<Vec<_>>())
                .unwrap();
        p.extended_key_usages = vec![
            ExtendedKeyUsagePurpose::ServerAuth,
            ExtendedKeyUsagePurpose::ClientAuth,
        ];
        let key = KeyPair::generate().unwrap();
        Leaf {
            cert: p.signed_by(&key, &self.issuer).unwrap().pem(),
            key: key.serialize_pem(),
        }
    }
}

impl Leaf {
    /// Writes `tls.crt` and `tls.key` into `dir`, each through a rename, so kv-epp never reads a
    /// half-written file (as a Kubernetes Secret volume swaps its files).
    pub fn write_to(&self, dir: &Path) {
        std::fs::create_dir_all(dir).unwrap();
        replace_file(&dir.join("tls.crt"), self.cert.as_bytes());
        replace_file(&dir.join("tls.key"), self.key.as_bytes());
    }

    /// The certificate in DER, as a handshake shows it.
    pub fn der(&self) -> Vec<u8> {
        der_of(&self.cert)
    }
}

/// The first certificate of a PEM text, in DER.
pub fn der_of(pem: &str) -> Vec<u8> {
    CertificateDer::from_pem_slice(pem.as_bytes())
        .unwrap()
        .to_vec()
}

/// Replaces `path` atomically with `bytes`.
pub fn replace_file(path: &Path, bytes: &[u8]) {
    super::write_file(path, bytes);
}

/// A client configuration trusting `roots` (PEM) and presenting `identity` when given; ALPN h2.
pub fn client_config(roots: &[&str], identity: Option<&Leaf>) -> rustls::ClientConfig {
    let mut store = rustls::RootCertStore::empty();
    for pem in roots {
        for c in CertificateDer::pem_slice_iter(pem.as_bytes()) {
            store.add(c.unwrap()).unwrap();
        }
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let builder = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(store);
    let mut c = match identity {
        Some(leaf) => builder
            .with_client_auth_cert(
                CertificateDer::pem_slice_iter(leaf.cert.as_bytes())
                    .collect::<Result<_, _>>()
                    .unwrap(),
                PrivateKeyDer::from_pem_slice(leaf.key.as_bytes()).unwrap(),
            )
            .unwrap(),
        None => builder.with_no_client_auth(),
    };
    c.alpn_protocols = vec![b"h2".to_vec()];
    c
}

/// Connects to `addr` as `name`, completes the handshake and exchanges the HTTP/2 preface and
/// SETTINGS, which is where a TLS 1.3 server reports a refused client certificate. Ok: the
/// certificate the server presented (DER). Err: why the connection failed.
pub async fn handshake(
    addr: SocketAddr,
    name: &str,
    config: rustls::ClientConfig,
) -> Result<Vec<u8>, String> {
    let tcp = TcpStream::connect(addr).await.map_err(|e| e.to_string())?;
    let name = ServerName::try_from(name.to_owned()).unwrap();
    let connect = tokio_rustls::TlsConnector::from(Arc::new(config)).connect(name, tcp);
    let mut tls = tokio::time::timeout(Duration::from_secs(10), connect)
        .await
        .map_err(|_| "handshake timed out".to_string())?
        .map_err(|e| e.to_string())?;
    let presented = tls.get_ref().1.peer_certificates().unwrap()[0].to_vec();
    // The client preface plus an empty SETTINGS frame; the server answers with its SETTINGS.
    let mut preface = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n".to_vec();
    preface.extend_from_slice(&[0, 0, 0, 4, 0, 0, 0, 0, 0]);
    tls.write_all(&preface).await.map_err(|e| e.to_string())?;
    let mut buf = [0u8; 9];
    match tokio::time::timeout(Duration::from_secs(10), tls.read_exact(&mut buf)).await {
        Err(_) => Err("no answer to the HTTP/2 preface".into()),
        Ok(Err(e)) => Err(e.to_string()),
        Ok(Ok(_)) if buf[3] == 4 => Ok(presented),
        Ok(Ok(_)) => Err(format!("unexpected first frame {buf:?}")),
    }
}
