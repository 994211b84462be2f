//! `kv-epp-sim workload`: the built-in multi-tenant workload generator, printed as JSON lines a
//! load tool can replay (one request per line: arrival time, tenant for `x-tenant-id`, and a
//! `/v1/completions` body with a token-ID prompt).

use kv_epp_sim::workload::{GeneratorSpec, generate};
use serde_json::json;

/// Flags of `kv-epp-sim workload`; defaults are the demo's workload.
#[derive(clap::Args, Debug)]
pub(crate) struct WorkloadArgs {
    /// The `model` field of every body.
    #[arg(long, default_value = "llama")]
    model: String,
    /// Tenants.
    #[arg(long, default_value_t = GeneratorSpec::default().tenants)]
    tenants: usize,
    /// Tenants 0..N share one system prompt (same text, different salts).
    #[arg(long, default_value_t = GeneratorSpec::default().shared_prompt_tenants)]
    shared_prompt_tenants: usize,
    /// Sessions per tenant.
    #[arg(long, default_value_t = GeneratorSpec::default().sessions_per_tenant)]
    sessions: usize,
    /// Turns per session (each turn's prompt extends the previous one).
    #[arg(long, default_value_t = GeneratorSpec::default().turns)]
    turns: usize,
    /// System prompt tokens.
    #[arg(long, default_value_t = GeneratorSpec::default().system_prompt_tokens)]
    system_prompt_tokens: usize,
    /// Mean new user tokens per turn.
    #[arg(long, default_value_t = GeneratorSpec::default().user_tokens)]
    user_tokens: usize,
    /// Mean output tokens per turn (`max_tokens`).
    #[arg(long, default_value_t = GeneratorSpec::default().output_tokens)]
    output_tokens: usize,
    /// Mean arrivals per second (Poisson).
    #[arg(long, default_value_t = GeneratorSpec::default().rate_per_s)]
    rate: f64,
    /// Token IDs are drawn from 0..vocab.
    #[arg(long, default_value_t = GeneratorSpec::default().vocab)]
    vocab: u32,
    /// Seed: the same flags and seed print the same workload.
    #[arg(long, default_value_t = GeneratorSpec::default().seed)]
    seed: u64,
}

/// The workload as JSON lines.
pub(crate) fn run(args: &WorkloadArgs) -> Result<String, String> {
    if args.vocab == 0 || !(args.rate.is_finite() && args.rate > 0.0) {
        return Err("--vocab and --rate must be positive".into());
    }
    let spec = GeneratorSpec {
        tenants: args.tenants,
        shared_prompt_tenants: args.shared_prompt_tenants,
        sessions_per_tenant: args.sessions,
        turns: args.turns,
        system_prompt_tokens: args.system_prompt_tokens,
        user_tokens: args.user_tokens,
        output_tokens: args.output_tokens,
        rate_per_s: args.rate,
        vocab: args.vocab,
        seed: args.seed,
    };
    let mut out = String::new();
    for r in generate(&spec) {
        let line = json!({
            "at_ms": r.at_ms,
            "tenant": r.tenant,
            "body": {"model": args.model, "prompt": r.tokens, "max_tokens": r.output_tokens},
        });
        out.push_str(&line.to_string());
        out.push('\n');
    }
    Ok(out)
}
