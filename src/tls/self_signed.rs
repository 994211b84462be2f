//! The self-signed certificate `--secure-serving` uses when no certificate is mounted: made in
//! memory at each start, or kept in a directory (`server.self_signed_cert_dir`) so the same
//! certificate survives restarts and a gateway can pin it.

use std::io::Write;
use std::path::Path;
use std::sync::Arc;

use super::{Pem, TlsError, TlsFiles};

/// The names the certificate is issued for.
const NAMES: [&str; 2] = ["localhost", "kv-epp"];

/// A fresh pair as PEM: (certificate, key).
fn generate() -> Result<(String, String), TlsError> {
    let names: Vec<String> = NAMES.iter().map(|n| (*n).to_owned()).collect();
    let ck = rcgen::generate_simple_self_signed(names).map_err(|e| TlsError::Material {
        what: "generated certificate".into(),
        reason: e.to_string(),
    })?;
    Ok((ck.cert.pem(), ck.signing_key.serialize_pem()))
}

/// A pair generated now and held in memory only.
pub(crate) fn in_memory() -> Result<TlsFiles, TlsError> {
    let (cert, key) = generate()?;
    Ok(TlsFiles {
        cert: Pem::Inline(Arc::from(cert.into_bytes())),
        key: Pem::Inline(Arc::from(key.into_bytes())),
        ca: None,
    })
}

/// The pair kept in `dir` (`tls.crt`, `tls.key`): generated and written when neither file
/// exists, used as found otherwise. One file without the other is an error rather than a
/// reason to overwrite a certificate a gateway may have pinned.
pub(crate) fn persisted(dir: &Path) -> Result<TlsFiles, TlsError> {
    let files = TlsFiles::in_dir(dir, None);
    let (crt, key) = (dir.join("tls.crt"), dir.join("tls.key"));
    match (crt.exists(), key.exists()) {
        (true, true) => return Ok(files),
        (false, false) => {}
        (has_crt, _) => {
            let (found, missing) = if has_crt { (&crt, &key) } else { (&key, &crt) };
            return Err(TlsError::Material {
                what: dir.display().to_string(),
                reason: format!(
                    "{} exists but {} does not; remove it to generate a new pair, or restore the other file",
                    found.display(),
                    missing.display()
                ),
            });
        }
    }
    let io = |path: &Path| {
        let path = path.display().to_string();
        move |source| TlsError::Read { path, source }
    };
    std::fs::create_dir_all(dir).map_err(io(dir))?;
    let (cert_pem, key_pem) = generate()?;
    // The key first (private to this user), the certificate last: a crash in between leaves a
    // key alone, which the next start refuses instead of silently pairing it with nothing.
    write_new(&key, key_pem.as_bytes(), 0o600).map_err(io(&key))?;
    write_new(&crt, cert_pem.as_bytes(), 0o644).map_err(io(&crt))?;
    tracing::info!(dir = %dir.display(), "generated a self-signed certificate for ext_proc and kept it for later starts");
    Ok(files)
}

/// Writes a file that must not exist yet, with `mode`, through a temporary name so a reader
/// never sees it half-written.
fn write_new(path: &Path, bytes: &[u8], mode: u32) -> std::io::Result<()> {
    use std::os::unix::fs::OpenOptionsExt;
    let name = path.file_name().unwrap_or_default().to_string_lossy();
    let tmp = path.with_file_name(format!(".{name}.tmp"));
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(mode)
        .open(&tmp)?;
    f.write_all(bytes)?;
    f.sync_all()?;
    std::fs::rename(&tmp, path)
}
