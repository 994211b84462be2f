//! Process plumbing the binaries share (`kv-epp` and the simulator's `kv-epp-sim`): the log
//! subscriber, the allocator's thresholds and the shutdown signal. Nothing here knows about
//! requests or engines.

/// Below this size glibc's malloc serves a block from its heap rather than a fresh `mmap`.
const MMAP_THRESHOLD: usize = 4 << 20;
/// Free memory at the top of a heap that glibc keeps rather than returning to the kernel.
const TRIM_THRESHOLD: usize = 16 << 20;

/// Keeps request-sized buffers (a 32k-token body, its token IDs and hashes: a few hundred KiB)
/// in glibc's heap between requests: by default blocks over 128 KiB are `mmap`ed and unmapped
/// again on free, so every large request paid page faults and zeroing for fresh pages. Freed
/// memory beyond [`TRIM_THRESHOLD`] still goes back to the kernel. Left alone when the operator
/// tunes the allocator (any `MALLOC_*` variable or `GLIBC_TUNABLES`); a no-op off glibc.
pub fn tune_allocator() {
    let tuned = std::env::vars_os().any(|(k, _)| {
        let k = k.to_string_lossy();
        k.starts_with("MALLOC_") || k == "GLIBC_TUNABLES"
    });
    if tuned {
        return;
    }
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: mallopt only changes glibc's thresholds; called before the runtime starts threads.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, MMAP_THRESHOLD as libc::c_int);
        libc::mallopt(libc::M_TRIM_THRESHOLD, TRIM_THRESHOLD as libc::c_int);
    }
}

/// Installs the log subscriber (`KV_EPP_LOG` filter, `text` or `json`).
pub fn init_logs(format: &str) -> Result<(), String> {
    // kube-rs logs every failed API request at ERROR (every 2 s while a drain Lease cannot be
    // renewed); kv-epp logs its own failures once per outage, so the default leaves those out.
    let filter = tracing_subscriber::EnvFilter::try_from_env("KV_EPP_LOG").unwrap_or_else(|_| {
        tracing_subscriber::EnvFilter::new("info,kube_client::client::builder=off")
    });
    let builder = tracing_subscriber::fmt().with_env_filter(filter);
    match format {
        "json" => builder.json().init(),
        "text" => builder.init(),
        other => return Err(format!("--log-format must be text or json, got `{other}`")),
    }
    Ok(())
}

/// Resolves on SIGTERM or Ctrl-C.
pub async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        _ = ctrl_c => {},
        _ = term => {},
    }
}
