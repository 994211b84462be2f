//! `kv-epp tokenize`: for an operator chasing a cache miss, everything kv-epp derives from one
//! request body: the model, the token IDs, the salt's fingerprint (never the salt), the local and
//! sequence block hashes, and the body that would be forwarded to the engine.

use std::io::Read;
use std::path::PathBuf;

use kv_epp::config::Config;
use kv_epp::forward::rewrite_salt;
use kv_epp::request::{self, Prompt};
use kv_epp_core::fingerprint::FingerprintKey;
use kv_epp_core::hashing::prompt_hashes;
use kv_epp_core::namespace::{Namespace, seed_for};
use kv_epp_core::salt::{SaltInputs, resolve};
use kv_epp_tokenize::{Endpoint, TokenizeError};

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
    let config = Config::from_file(&args.config_file).map_err(|e| e.to_string())?;
    config.validate().map_err(|e| e.to_string())?;
    let catalog = config.load_tokenizers().map_err(|e| e.to_string())?;
    let mut body = Vec::new();
    input
        .read_to_end(&mut body)
        .map_err(|e| format!("reading stdin: {e}"))?;
    let parsed = request::parse(&body).map_err(|e| e.to_string())?;
    let model = parsed.model.clone().unwrap_or_default();
    let base = config
        .models
        .iter()
        .find(|m| m.name == model || m.lora_adapters.contains(&model))
        .ok_or_else(|| format!("model `{model}` is not configured"))?;
    let lora = (base.name != model).then_some(model.as_str());
    let path = args.path.clone().unwrap_or_else(|| {
        if parsed.prompt == Prompt::Chat {
            "/v1/chat/completions".into()
        } else {
            "/v1/completions".into()
        }
    });
    let tokens = match &parsed.prompt {
        Prompt::TokenIds(t) => t.clone(),
        _ => {
            let endpoint = Endpoint::from_path(&path)
                .ok_or_else(|| format!("kv-epp does not tokenize {path}"))?;
            catalog
                .tokenize(endpoint, &body)
                .map_err(|e: TokenizeError| e.to_string())?
                .token_ids
        }
    };
    let header: Vec<&[u8]> = args.tenant_id.iter().map(|t| t.as_bytes()).collect();
    let inputs = SaltInputs {
        header: &header,
        nvext: parsed.nvext_salt(),
        body: parsed.body_salt(),
    };
    let salt = resolve(&inputs, &config.salt.policy()).map_err(|e| e.to_string())?;
    let key = match &config.salt.fingerprint_key {
        Some(k) => FingerprintKey::from_passphrase(k),
        None => FingerprintKey::random(),
    };
    let (local, sequence) = prompt_hashes(
        &tokens,
        base.block_size,
        seed_for(salt.as_ref().map(|s| &s.salt), lora),
    );
    let forwarded_salt = salt.as_ref().map(|s| Namespace::of(&s.salt).forwarded());
    let forwarded = rewrite_salt(&body, forwarded_salt.as_deref()).unwrap_or_else(|| body.clone());
    let out = serde_json::json!({
        "model": model,
        "base_model": base.name,
        "lora_name": lora,
        "path": path,
        "token_ids": tokens,
        "salt": salt.as_ref().map(|s| serde_json::json!({
            "source": s.source.as_str(),
            "fingerprint": s.salt.fingerprint(&key).to_string(),
        })),
        "block_size": base.block_size,
        "local": local.iter().map(|h| h.0).collect::<Vec<_>>(),
        "sequence": sequence.iter().map(|h| h.0).collect::<Vec<_>>(),
        "forwarded_body": serde_json::from_slice::<serde_json::Value>(&forwarded).unwrap_or(serde_json::Value::Null),
    });
    Ok(out.to_string())
}
