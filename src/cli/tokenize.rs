//! `kv-epp tokenize`: for an operator chasing a cache miss, everything kv-epp derives from one
//! request body: the model, the token IDs, the salt's fingerprint (never the salt), the local and
//! sequence block hashes, and the body that would be forwarded to the engine.
//!
//! It runs the worker-independent part of the server's own pipeline ([`decide::understand`])
//! on the same configuration, secret files included, so its fingerprint, tokens and hashes are
//! the server's.

use std::io::Read;
use std::path::PathBuf;
use std::sync::Arc;

use kv_epp::config::Config;
use kv_epp::decide::{self, RequestParts};
use kv_epp::metrics::Metrics;
use kv_epp::request::{self, Prompt};

/// Flags of `kv-epp tokenize`.
#[derive(clap::Args, Debug)]
pub(crate) struct TokenizeArgs {
    /// The configuration file (models, tokenizers, salt policy).
    #[arg(long)]
    pub config_file: PathBuf,
    /// The value of the `x-tenant-id` header, as the gateway would set it.
    #[arg(long)]
    pub tenant_id: Option<String>,
    /// The request path (default: chat completions when the body has `messages`, else completions).
    #[arg(long)]
    pub path: Option<String>,
}

/// Runs the subcommand on a body read from `input`; returns the JSON to print.
pub(crate) fn run(args: &TokenizeArgs, mut input: impl Read) -> Result<String, String> {
    let mut config = Config::from_file(&args.config_file).map_err(|e| e.to_string())?;
    config.validate().map_err(|e| e.to_string())?;
    config.read_secret_files().map_err(|e| e.to_string())?;
    // The workers are registered but never consulted: `understand` stops before them.
    let picker = config
        .picker(Arc::new(Metrics::new()))
        .map_err(|e| e.to_string())?;
    let mut body = Vec::new();
    input
        .read_to_end(&mut body)
        .map_err(|e| format!("reading stdin: {e}"))?;
    let path = match &args.path {
        Some(p) => p.clone(),
        None => match request::parse(&body) {
            Ok(p) if p.prompt == Prompt::Chat => "/v1/chat/completions".into(),
            _ => "/v1/completions".into(),
        },
    };
    let header: Vec<&[u8]> = args.tenant_id.iter().map(|t| t.as_bytes()).collect();
    let parts = RequestParts {
        path: &path,
        tenant: &header,
        body: Some(&body),
        ..RequestParts::default()
    };
    let u = decide::understand(&picker, &parts).map_err(|e| e.to_string())?;
    let named = u.model.named.clone().unwrap_or_default();
    let Some(base) = &u.model.base else {
        return Err(format!("model `{named}` is not configured"));
    };
    if let Some(e) = &u.tokenize_failure {
        return Err(e.to_string());
    }
    if let Some(e) = &u.unrenderable {
        return Err(format!(
            "{e} (ext_proc routes such a request on load alone)"
        ));
    }
    let Some(tokens) = &u.tokens else {
        return Err(format!(
            "kv-epp does not tokenize {path} for model `{named}` (no tokenizer configured, or not a tokenized endpoint)"
        ));
    };
    let forwarded = u.forwarded_body(&body);
    let out = serde_json::json!({
        "model": named,
        "base_model": base,
        "lora_name": u.model.lora,
        "path": path,
        "token_ids": tokens,
        "salt": u.salt.as_ref().map(|s| serde_json::json!({
            "source": s.source().as_str(),
            "fingerprint": s.fingerprint().to_string(),
        })),
        "block_size": u.hashes.block_size,
        "local": u.hashes.local.iter().map(|h| h.0).collect::<Vec<_>>(),
        "sequence": u.hashes.sequence.iter().map(|h| h.0).collect::<Vec<_>>(),
        "forwarded_body": serde_json::from_slice::<serde_json::Value>(forwarded).unwrap_or(serde_json::Value::Null),
    });
    Ok(out.to_string())
}
