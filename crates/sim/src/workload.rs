//! Workloads for the demo, the benchmarks and the routing simulations: a built-in generator of
//! multi-tenant chat traffic, and a reader for Mooncake-format traces.
//!
//! Generator shape (Mooncake-like): long prompts dominated by reusable prefixes. Each tenant has a
//! system prompt; some tenants deliberately share the *same* system prompt text (so isolation can
//! be seen: identical tokens, different salts, no shared cache). Each tenant runs sessions; each
//! turn of a session resends the whole conversation so far plus a new user message, so turn `k`
//! extends turn `k-1`'s prompt. Arrivals are Poisson; session turns are spread out in time.
//!
//! Everything is a pure function of the spec (including its seed).

use std::path::Path;

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use serde::Deserialize;

/// One request of a workload.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WorkloadRequest {
    /// Arrival time in milliseconds from the start.
    pub at_ms: u64,
    /// The tenant (used as the cache salt); `None` for unsalted traffic.
    pub tenant: Option<String>,
    /// Prompt token IDs.
    pub tokens: Vec<u32>,
    /// Tokens to generate.
    pub output_tokens: u32,
}

/// Parameters of the built-in generator.
#[derive(Clone, Debug)]
pub struct GeneratorSpec {
    /// Number of tenants.
    pub tenants: usize,
    /// Tenants `0..shared_prompt_tenants` use one identical system prompt.
    pub shared_prompt_tenants: usize,
    /// Sessions per tenant.
    pub sessions_per_tenant: usize,
    /// Turns per session.
    pub turns: usize,
    /// System prompt length in tokens.
    pub system_prompt_tokens: usize,
    /// Mean new user tokens per turn.
    pub user_tokens: usize,
    /// Mean output tokens per turn.
    pub output_tokens: usize,
    /// Mean arrival rate, requests per second.
    pub rate_per_s: f64,
    /// Vocabulary size to draw token IDs from.
    pub vocab: u32,
    /// Seed.
    pub seed: u64,
}

impl Default for GeneratorSpec {
    fn default() -> Self {
        GeneratorSpec {
            tenants: 4,
            shared_prompt_tenants: 2,
            sessions_per_tenant: 6,
            turns: 4,
            system_prompt_tokens: 1024,
            user_tokens: 200,
            output_tokens: 64,
            rate_per_s: 20.0,
            vocab: 32_000,
            seed: 42,
        }
    }
}

fn tokens(rng: &mut SmallRng, n: usize, vocab: u32) -> Vec<u32> {
    (0..n).map(|_| rng.random_range(0..vocab)).collect()
}

fn around(rng: &mut SmallRng, mean: usize) -> usize {
    // Uniform in [mean/2, 3*mean/2]: variable but bounded.
    let lo = mean / 2;
    lo + rng.random_range(0..=mean)
}

/// The tenant name of tenant `i`.
pub fn tenant_name(i: usize) -> String {
    format!("tenant-{i}")
}

/// Generates a workload, sorted by arrival time.
pub fn generate(spec: &GeneratorSpec) -> Vec<WorkloadRequest> {
    let mut rng = SmallRng::seed_from_u64(spec.seed);
    let shared = tokens(&mut rng, spec.system_prompt_tokens, spec.vocab);
    let mut sessions: Vec<(usize, Vec<u32>)> = Vec::new();
    for t in 0..spec.tenants {
        let system = if t < spec.shared_prompt_tenants {
            shared.clone()
        } else {
            tokens(&mut rng, spec.system_prompt_tokens, spec.vocab)
        };
        for _ in 0..spec.sessions_per_tenant {
            sessions.push((t, system.clone()));
        }
    }
    // Each session's turns are spaced out; sessions start at Poisson times, and the turns of all
    // sessions interleave.
    let mut out = Vec::new();
    let mean_gap_ms = 1000.0 / spec.rate_per_s.max(1e-6);
    let mut start = 0.0f64;
    for (tenant, mut history) in sessions {
        start += -mean_gap_ms * (1.0 - rng.random::<f64>()).ln();
        let mut at = start;
        for _ in 0..spec.turns {
            let user = around(&mut rng, spec.user_tokens);
            history.extend(tokens(&mut rng, user, spec.vocab));
            let output = around(&mut rng, spec.output_tokens) as u32;
            out.push(WorkloadRequest {
                at_ms: at as u64,
                tenant: Some(tenant_name(tenant)),
                tokens: history.clone(),
                output_tokens: output,
            });
            // The assistant's answer becomes part of the next turn's prompt.
            history.extend(tokens(&mut rng, output as usize, spec.vocab));
            at += mean_gap_ms * spec.turns as f64 * (0.5 + rng.random::<f64>());
        }
    }
    out.sort_by_key(|r| r.at_ms);
    out
}

/// Tokens each Mooncake hash id stands for.
pub const MOONCAKE_BLOCK_TOKENS: usize = 512;

#[derive(Deserialize)]
struct MooncakeLine {
    timestamp: u64,
    input_length: usize,
    output_length: u32,
    hash_ids: Vec<u64>,
}

/// Why a trace could not be read.
#[derive(Debug, thiserror::Error)]
pub enum TraceError {
    /// The file could not be read.
    #[error("reading {path}: {source}")]
    Io {
        /// The path.
        path: String,
        /// The cause.
        source: std::io::Error,
    },
    /// A line is not a Mooncake record.
    #[error("{path}:{line}: not a Mooncake record ({reason})")]
    Line {
        /// The path.
        path: String,
        /// 1-based line number.
        line: usize,
        /// What was wrong.
        reason: String,
    },
}

/// Reads a Mooncake-format trace (`{"timestamp","input_length","output_length","hash_ids"}` per
/// line). Each hash id expands into a deterministic 512-token block seeded by the id, so equal ids
/// share content; the prompt is cut to `input_length`. `tenants > 0` assigns each request to a
/// tenant by its first hash id (a stand-in for the session), `0` leaves traffic unsalted.
/// `limit` caps the number of requests read.
pub fn read_mooncake(
    path: &Path,
    vocab: u32,
    tenants: usize,
    limit: Option<usize>,
) -> Result<Vec<WorkloadRequest>, TraceError> {
    let text = std::fs::read_to_string(path).map_err(|source| TraceError::Io {
        path: path.display().to_string(),
        source,
    })?;
    let mut out = Vec::new();
    for (i, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        if limit.is_some_and(|l| out.len() >= l) {
            break;
        }
        let rec: MooncakeLine = serde_json::from_str(line).map_err(|e| TraceError::Line {
            path: path.display().to_string(),
            line: i + 1,
            reason: e.to_string(),
        })?;
        let mut toks = Vec::with_capacity(rec.hash_ids.len() * MOONCAKE_BLOCK_TOKENS);
        for id in &rec.hash_ids {
            let mut rng = SmallRng::seed_from_u64(id.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ 0x6d6f);
            toks.extend((0..MOONCAKE_BLOCK_TOKENS).map(|_| rng.random_range(0..vocab)));
        }
        toks.truncate(rec.input_length.min(toks.len()));
        let tenant = (tenants > 0).then(|| {
            tenant_name((rec.hash_ids.first().copied().unwrap_or(0) % tenants as u64) as usize)
        });
        out.push(WorkloadRequest {
            at_ms: rec.timestamp,
            tenant,
            tokens: toks,
            output_tokens: rec.output_length,
        });
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn generator_is_deterministic_and_shares_prefixes() {
        let spec = GeneratorSpec::default();
        let a = generate(&spec);
        assert_eq!(a, generate(&spec));
        assert_eq!(
            a.len(),
            spec.tenants * spec.sessions_per_tenant * spec.turns
        );
        let sys = spec.system_prompt_tokens;
        let t0: Vec<_> = a
            .iter()
            .filter(|r| r.tenant.as_deref() == Some("tenant-0"))
            .collect();
        let t1: Vec<_> = a
            .iter()
            .filter(|r| r.tenant.as_deref() == Some("tenant-1"))
            .collect();
        let t3: Vec<_> = a
            .iter()
            .filter(|r| r.tenant.as_deref() == Some("tenant-3"))
            .collect();
        assert_eq!(
            t0[0].tokens[..sys],
            t1[0].tokens[..sys],
            "shared system prompt"
        );
        assert_ne!(t0[0].tokens[..sys], t3[0].tokens[..sys]);
        assert!(a.windows(2).all(|w| w[0].at_ms <= w[1].at_ms));
    }

    #[test]
    fn mooncake_ids_expand_to_shared_blocks() {
        let dir = std::env::temp_dir().join(format!("kv-epp-trace-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join("t.jsonl");
        std::fs::write(
            &p,
            "{\"timestamp\": 0, \"input_length\": 1000, \"output_length\": 5, \"hash_ids\": [7, 8]}\n\
             {\"timestamp\": 3, \"input_length\": 600, \"output_length\": 2, \"hash_ids\": [7, 9]}\n",
        )
        .unwrap();
        let r = read_mooncake(&p, 1000, 0, None).unwrap();
        assert_eq!(r.len(), 2);
        assert_eq!(r[0].tokens.len(), 1000);
        assert_eq!(r[1].tokens.len(), 600);
        assert_eq!(r[0].tokens[..512], r[1].tokens[..512]);
        assert_ne!(r[0].tokens[512..600], r[1].tokens[512..600]);
        std::fs::write(&p, "{\"timestamp\": 0}\n").unwrap();
        let err = read_mooncake(&p, 1000, 0, None).unwrap_err();
        assert!(err.to_string().contains(":1: not a Mooncake record"));
    }
}
