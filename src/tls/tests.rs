//! Building and reloading TLS material from files (no sockets; the black-box tests in
//! `tests/tls.rs` and `tests/replicas.rs` handshake for real).

use std::path::{Path, PathBuf};

use rcgen::{
    BasicConstraints, CertificateParams, CertifiedIssuer, ExtendedKeyUsagePurpose, IsCa, KeyPair,
};

use super::*;

fn tmp(name: &str) -> PathBuf {
    static NEXT: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
    let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let d = std::env::temp_dir().join(format!("kv-epp-tls-unit-{}-{name}-{n}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn ca() -> CertifiedIssuer<'static, KeyPair> {
    let mut p = CertificateParams::new(Vec::<String>::new()).unwrap();
    p.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    CertifiedIssuer::self_signed(p, KeyPair::generate().unwrap()).unwrap()
}

/// A leaf for `name`, good for both ends of a connection: (certificate PEM, key PEM).
fn leaf(ca: &CertifiedIssuer<'static, KeyPair>, name: &str) -> (String, String) {
    let mut p = CertificateParams::new(vec![name.to_owned()]).unwrap();
    p.extended_key_usages = vec![
        ExtendedKeyUsagePurpose::ServerAuth,
        ExtendedKeyUsagePurpose::ClientAuth,
    ];
    let key = KeyPair::generate().unwrap();
    (p.signed_by(&key, ca).unwrap().pem(), key.serialize_pem())
}

fn write(dir: &Path, (cert, key): &(String, String), ca: Option<&str>) {
    std::fs::write(dir.join("tls.crt"), cert).unwrap();
    std::fs::write(dir.join("tls.key"), key).unwrap();
    if let Some(ca) = ca {
        std::fs::write(dir.join("ca.crt"), ca).unwrap();
    }
}

fn served_cert(tls: &Reloading) -> Vec<u8> {
    // The certificate a handshake would present, from the resolver rustls holds.
    let configs = tls.current();
    let resolver = configs.server.cert_resolver.clone();
    format!("{resolver:?}").into_bytes()
}

fn count(m: &Metrics, outcome: &str) -> u64 {
    m.tls_reloads
        .get_or_create(&Metrics::labels(&[
            ("listener", "test"),
            ("outcome", outcome),
        ]))
        .get()
}

/// A handshake between two in-memory connections; the first error either side raises.
fn handshake(
    server: Arc<ServerConfig>,
    client: Arc<ClientConfig>,
    name: &str,
) -> Result<(), rustls::Error> {
    let mut c = rustls::ClientConnection::new(client, server_name(name).unwrap())?;
    let mut s = rustls::ServerConnection::new(server)?;
    for _ in 0..10 {
        let mut wire = Vec::new();
        c.write_tls(&mut wire).unwrap();
        s.read_tls(&mut wire.as_slice()).unwrap();
        s.process_new_packets()?;
        let mut wire = Vec::new();
        s.write_tls(&mut wire).unwrap();
        c.read_tls(&mut wire.as_slice()).unwrap();
        c.process_new_packets()?;
        if !c.is_handshaking() && !s.is_handshaking() {
            return Ok(());
        }
    }
    Err(rustls::Error::General("handshake did not finish".into()))
}

/// A client trusting `ca` without a certificate of its own.
fn anonymous_client(ca: &CertifiedIssuer<'static, KeyPair>) -> Arc<ClientConfig> {
    let mut roots = RootCertStore::empty();
    roots.add(ca.der().clone()).unwrap();
    Arc::new(
        ClientConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .unwrap()
            .with_root_certificates(roots)
            .with_no_client_auth(),
    )
}

#[test]
fn with_a_ca_peers_authenticate_each_other_and_strangers_are_refused() {
    let (d, other) = (tmp("mutual"), tmp("stranger"));
    let ca = ca();
    write(&d, &leaf(&ca, "kv-epp-peers"), Some(&ca.pem()));
    let foreign = self::ca();
    write(&other, &leaf(&foreign, "kv-epp-peers"), Some(&ca.pem()));
    let m = Metrics::new();
    let load = |dir: &Path| {
        Reloading::load("test", TlsFiles::in_dir(dir, Some(dir.join("ca.crt"))), &m)
            .unwrap()
            .current()
    };
    let (peer, stranger) = (load(&d), load(&other));
    assert_eq!(peer.server.alpn_protocols, vec![b"h2".to_vec()]);
    let client = peer.client.clone().unwrap();
    handshake(peer.server.clone(), client.clone(), "kv-epp-peers").unwrap();
    // The client checks the name it was given...
    assert!(handshake(peer.server.clone(), client, "someone-else").is_err());
    // ...the server wants a certificate, from its CA.
    let e = handshake(peer.server.clone(), anonymous_client(&ca), "kv-epp-peers").unwrap_err();
    assert!(matches!(e, rustls::Error::NoCertificatesPresented), "{e}");
    let e = handshake(
        peer.server.clone(),
        stranger.client.clone().unwrap(),
        "kv-epp-peers",
    )
    .unwrap_err();
    assert!(matches!(e, rustls::Error::InvalidCertificate(_)), "{e}");

    // Without a CA: server authentication only, and nothing to dial peers with.
    let plain = Reloading::load("test", TlsFiles::in_dir(&d, None), &m)
        .unwrap()
        .current();
    assert!(plain.client.is_none());
    handshake(plain.server.clone(), anonymous_client(&ca), "kv-epp-peers").unwrap();
}

#[test]
fn unusable_material_is_refused_with_the_file_named() {
    let d = tmp("bad");
    let ca_a = ca();
    let (cert, _) = leaf(&ca_a, "a");
    let (_, other_key) = leaf(&ca_a, "b");
    let m = Metrics::new();
    write(&d, &(cert.clone(), other_key), None);
    let e = Reloading::load("test", TlsFiles::in_dir(&d, None), &m).unwrap_err();
    assert!(e.to_string().contains("tls.key"), "{e}");
    write(&d, &("not a pem".into(), "nor this".into()), None);
    let e = Reloading::load("test", TlsFiles::in_dir(&d, None), &m).unwrap_err();
    assert!(
        e.to_string().contains("tls.crt") && e.to_string().contains("no CERTIFICATE"),
        "{e}"
    );
    let e = Reloading::load("test", TlsFiles::in_dir(&d.join("missing"), None), &m).unwrap_err();
    assert!(matches!(e, TlsError::Read { .. }), "{e}");
    write(&d, &leaf(&ca_a, "a"), Some("garbage"));
    let e = Reloading::load("test", TlsFiles::in_dir(&d, Some(d.join("ca.crt"))), &m).unwrap_err();
    assert!(e.to_string().contains("ca.crt"), "{e}");
}

#[test]
fn changed_files_are_swapped_in_and_bad_ones_keep_the_previous_material() {
    let d = tmp("reload");
    let ca = ca();
    write(&d, &leaf(&ca, "one"), Some(&ca.pem()));
    let m = Metrics::new();
    let tls = Reloading::load("test", TlsFiles::in_dir(&d, Some(d.join("ca.crt"))), &m).unwrap();
    assert!(tls.check().is_none(), "nothing changed");
    let first = served_cert(&tls);

    write(&d, &leaf(&ca, "two"), None);
    assert!(matches!(tls.check(), Some(Ok(()))));
    let second = served_cert(&tls);
    assert_ne!(first, second, "the new certificate is served");
    assert_eq!(count(&m, "reloaded"), 1);

    // A certificate without its key (a rotation half done, or a broken file): refused once,
    // counted once, the last good material stays.
    let (cert, _) = leaf(&ca, "three");
    std::fs::write(d.join("tls.crt"), &cert).unwrap();
    assert!(matches!(tls.check(), Some(Err(_))));
    assert!(
        tls.check().is_none(),
        "the same bad files are not retried at every poll"
    );
    assert_eq!(served_cert(&tls), second);
    assert_eq!(count(&m, "failed"), 1);
    std::fs::remove_file(d.join("ca.crt")).unwrap();
    assert!(matches!(tls.check(), Some(Err(TlsError::Read { .. }))));
    assert_eq!(served_cert(&tls), second);

    // Repaired: used at the next poll.
    write(&d, &leaf(&ca, "four"), Some(&ca.pem()));
    assert!(matches!(tls.check(), Some(Ok(()))));
    assert_ne!(served_cert(&tls), second);
    assert_eq!((count(&m, "reloaded"), count(&m, "failed")), (2, 2));
}

#[test]
fn a_kept_self_signed_pair_is_written_once_and_reused() {
    let d = tmp("self-signed").join("certs");
    let files = self_signed::persisted(&d).unwrap();
    let cert = std::fs::read(d.join("tls.crt")).unwrap();
    let key = std::fs::read(d.join("tls.key")).unwrap();
    use std::os::unix::fs::PermissionsExt;
    let mode = std::fs::metadata(d.join("tls.key"))
        .unwrap()
        .permissions()
        .mode();
    assert_eq!(mode & 0o077, 0, "the key is private to its owner: {mode:o}");
    Reloading::load("test", files, &Metrics::new()).unwrap();
    // A later start finds and keeps them.
    self_signed::persisted(&d).unwrap();
    assert_eq!(std::fs::read(d.join("tls.crt")).unwrap(), cert);
    assert_eq!(std::fs::read(d.join("tls.key")).unwrap(), key);
    // Half a pair is not silently replaced.
    std::fs::remove_file(d.join("tls.key")).unwrap();
    let e = self_signed::persisted(&d).unwrap_err().to_string();
    assert!(
        e.contains("tls.crt exists but") && e.contains("tls.key"),
        "{e}"
    );
    assert_eq!(std::fs::read(d.join("tls.crt")).unwrap(), cert);
}
