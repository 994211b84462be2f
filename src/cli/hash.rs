//! `kv-epp hash`: an operator's check of the hashing contract against another implementation.
//!
//! Reads a JSON array of token IDs on stdin and prints `{"local":[...],"sequence":[...]}` (u64).
//! The salt enters through its namespace, exactly as routing hashes it (`namespace::seed_for`),
//! so `local` can be pasted into `/query_by_hash` as is, for long salts too.

use std::io::Read;

use kv_epp_core::hashing::prompt_hashes;
use kv_epp_core::namespace::seed_for;
use kv_epp_core::salt::{CacheSalt, SaltSource};

/// Flags of `kv-epp hash`.
#[derive(clap::Args, Debug)]
pub(crate) struct HashArgs {
    /// Tokens per block.
    #[arg(long)]
    pub block_size: usize,
    /// Cache salt (tenant namespace); empty means unsalted.
    #[arg(long)]
    pub salt: Option<String>,
    /// LoRA adapter name; empty means none.
    #[arg(long)]
    pub lora: Option<String>,
}

/// Runs the subcommand on `input`, returning the JSON line to print.
pub(crate) fn run(args: &HashArgs, mut input: impl Read) -> Result<String, String> {
    let mut text = String::new();
    input
        .read_to_string(&mut text)
        .map_err(|e| format!("reading stdin: {e}"))?;
    let tokens: Vec<u32> = serde_json::from_str(&text)
        .map_err(|e| format!("stdin must be a JSON array of token IDs (0..=4294967295): {e}"))?;
    let salt = match args.salt.as_deref() {
        Some(s) => CacheSalt::new(s, SaltSource::Header).map_err(|e| e.to_string())?,
        None => None,
    };
    let seed = seed_for(salt.as_ref(), args.lora.as_deref());
    let (local, sequence) = prompt_hashes(&tokens, args.block_size, seed);
    let out = serde_json::json!({
        "local": local.iter().map(|h| h.0).collect::<Vec<_>>(),
        "sequence": sequence.iter().map(|h| h.0).collect::<Vec<_>>(),
    });
    Ok(out.to_string())
}
