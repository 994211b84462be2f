//! `kv-epp serve`: load the configuration, apply flags, validate, and run until SIGTERM/Ctrl-C.

use std::path::PathBuf;

use kv_epp::config::Config;
use kv_epp::process::{init_logs, shutdown_signal, tune_allocator};
use kv_epp::server::Server;

/// Flags of `kv-epp serve`; names match the reference endpoint picker where they overlap.
#[derive(clap::Args, Debug)]
pub(crate) struct ServeArgs {
    /// The YAML configuration file.
    #[arg(long)]
    pub config_file: Option<PathBuf>,
    /// ext_proc gRPC port (overrides server.grpc_port).
    #[arg(long)]
    pub grpc_port: Option<u16>,
    /// gRPC health port (overrides server.grpc_health_port).
    #[arg(long)]
    pub grpc_health_port: Option<u16>,
    /// Prometheus metrics port (overrides server.metrics_port).
    #[arg(long)]
    pub metrics_port: Option<u16>,
    /// InferencePool name (overrides pool.name).
    #[arg(long)]
    pub pool_name: Option<String>,
    /// InferencePool namespace (overrides pool.namespace; falls back to $NAMESPACE).
    #[arg(long, env = "NAMESPACE")]
    pub pool_namespace: Option<String>,
    /// Serve TLS on the ext_proc port (self-signed unless --cert-path is given).
    #[arg(long, num_args = 0..=1, default_missing_value = "true")]
    pub secure_serving: Option<bool>,
    /// Directory holding tls.crt and tls.key.
    #[arg(long)]
    pub cert_path: Option<PathBuf>,
    /// PEM file of the CAs whose client certificates the ext_proc port accepts: mutual TLS
    /// (overrides server.client_ca_path).
    #[arg(long)]
    pub client_ca_path: Option<PathBuf>,
    /// Keep the self-signed certificate in this directory and reuse it across restarts
    /// (overrides server.self_signed_cert_dir).
    #[arg(long)]
    pub self_signed_cert_dir: Option<PathBuf>,
    /// Admin HTTP port: query API and worker status (overrides server.admin_port).
    #[arg(long)]
    pub admin_port: Option<u16>,
    /// File with the bearer token the admin API requires (overrides server.admin_token_file);
    /// without one the admin API listens on loopback only.
    #[arg(long)]
    pub admin_token_file: Option<PathBuf>,
    /// Peer API port for replica bootstrap and relays (overrides peers.port).
    #[arg(long)]
    pub peer_port: Option<u16>,
    /// File with the shared token replicas present to each other (overrides peers.token_file).
    #[arg(long)]
    pub peer_token_file: Option<PathBuf>,
    /// Directory with tls.crt, tls.key and ca.crt: mutual TLS on the peer API (overrides
    /// peers.cert_path).
    #[arg(long)]
    pub peer_cert_path: Option<PathBuf>,
    /// Check the configuration (file, flags, tokenizer files) and exit without serving.
    #[arg(long)]
    pub validate_only: bool,
    /// Log format: text or json.
    #[arg(long, default_value = "text")]
    pub log_format: String,
}

/// Builds the effective configuration: file, then flags, then validation.
pub(crate) fn effective_config(args: &ServeArgs) -> Result<Config, String> {
    let mut c = match &args.config_file {
        Some(p) => Config::from_file(p).map_err(|e| e.to_string())?,
        None => Config::default(),
    };
    let s = &mut c.server;
    if let Some(p) = args.grpc_port {
        s.grpc_port = p;
    }
    if let Some(p) = args.grpc_health_port {
        s.grpc_health_port = p;
    }
    if let Some(p) = args.metrics_port {
        s.metrics_port = p;
    }
    if let Some(p) = args.admin_port {
        s.admin_port = p;
    }
    if let Some(p) = &args.admin_token_file {
        s.admin_token_file = Some(p.clone());
    }
    if let Some(v) = args.secure_serving {
        s.secure_serving = v;
    }
    if let Some(p) = &args.cert_path {
        s.cert_path = Some(p.clone());
    }
    if let Some(p) = &args.client_ca_path {
        s.client_ca_path = Some(p.clone());
    }
    if let Some(p) = &args.self_signed_cert_dir {
        s.self_signed_cert_dir = Some(p.clone());
    }
    if let Some(n) = &args.pool_name {
        c.pool.name = n.clone();
    }
    if let Some(n) = &args.pool_namespace {
        c.pool.namespace = n.clone();
    }
    if let Some(p) = args.peer_port {
        c.peers.port = p;
    }
    if let Some(p) = &args.peer_token_file {
        c.peers.token_file = Some(p.clone());
    }
    if let Some(p) = &args.peer_cert_path {
        c.peers.cert_path = Some(p.clone());
    }
    c.validate().map_err(|e| e.to_string())?;
    if let Some(path) = &c.peers.token_file {
        // Waits a moment for a file being rewritten; `serve` re-reads it as it changes.
        kv_epp::auth::TokenFile::open_patiently(
            "peers.token_file",
            path,
            std::time::Duration::from_secs(10),
        )
        .map_err(|e| e.to_string())?;
    }
    // Token files are read here too, so --validate-only refuses an empty or unreadable one.
    let tokens = [
        ("server.admin_token_file", &c.server.admin_token_file),
        ("server.metrics_token_file", &c.server.metrics_token_file),
    ];
    for (field, path) in tokens {
        if let Some(path) = path {
            kv_epp::auth::TokenFile::open(field, path).map_err(|e| e.to_string())?;
        }
    }
    c.read_secret_files().map_err(|e| e.to_string())?;
    Ok(c)
}

/// Runs the server until a shutdown signal.
pub(crate) fn run(args: &ServeArgs) -> Result<(), String> {
    init_logs(&args.log_format)?;
    let config = effective_config(args)?;
    if args.validate_only {
        config.served_models().map_err(|e| e.to_string())?;
        println!("configuration OK");
        return Ok(());
    }
    tune_allocator();
    let mut rt = tokio::runtime::Builder::new_multi_thread();
    if config.server.io_threads > 0 {
        rt.worker_threads(config.server.io_threads);
    }
    let rt = rt
        .enable_all()
        .build()
        .map_err(|e| format!("starting the runtime: {e}"))?;
    rt.block_on(async move {
        let server = Server::start(&config).await.map_err(|e| e.to_string())?;
        println!(
            "kv-epp serving ext_proc on {} (health {}, metrics {}, admin {})",
            server.grpc_addr, server.health_addr, server.metrics_addr, server.admin_addr
        );
        shutdown_signal().await;
        tracing::info!("shutting down");
        server.stop().await;
        Ok(())
    })
}
