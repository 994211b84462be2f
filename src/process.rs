//! Process plumbing the binaries share (`kv-epp` and the simulator's `kv-epp-sim`): the log
//! subscriber and the shutdown signal. Nothing here knows about requests or engines.

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
