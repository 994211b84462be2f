//! `kv-epp-sim demo`: the multi-tenant shared-prefix workload routed by kv-epp and by round-robin,
//! side by side, with per-tenant hit rates, simulated TTFT and an isolation check.
//!
//! By default everything runs over real sockets (see `demo_net.rs`): simulated vLLM workers,
//! kv-epp and a real Envoy on loopback. `--in-process` runs simulated engines in simulated time
//! inside this process instead (no sockets; the KV index is still fed only from the engines' own
//! KV events).

use std::path::PathBuf;

use kv_epp_core::scoring::ScoringConfig;
use kv_epp_sim::fleet::{FleetReport, FleetSpec, Policy, simulate};
use kv_epp_sim::workload::{GeneratorSpec, generate, read_mooncake};

/// Flags of `kv-epp-sim demo`.
#[derive(clap::Args, Debug)]
pub(crate) struct DemoArgs {
    /// A small, fast run (for tests).
    #[arg(long)]
    pub quick: bool,
    /// Replay this Mooncake-format trace instead of the built-in generator.
    #[arg(long)]
    pub trace: Option<PathBuf>,
    /// With --trace: requests to replay.
    #[arg(long, default_value_t = 400)]
    pub trace_requests: usize,
    /// With --trace: tenants to spread the trace over (0 = unsalted).
    #[arg(long, default_value_t = 4)]
    pub trace_tenants: usize,
    /// Simulated engines.
    #[arg(long, default_value_t = 4)]
    pub workers: usize,
    /// KV blocks per engine.
    #[arg(long, default_value_t = 4096)]
    pub num_blocks: usize,
    /// Tokens per block.
    #[arg(long, default_value_t = 16)]
    pub block_size: usize,
    /// Simulate in process (no sockets, simulated time) instead of the network demo.
    #[arg(long)]
    pub in_process: bool,
    /// The Envoy binary (default: .venv/bin/envoy, installed by `make demo`).
    #[arg(long)]
    pub envoy: Option<PathBuf>,
}

/// Runs the demo and returns the report text, or an error when a check failed.
pub(crate) fn run(args: &DemoArgs) -> Result<String, String> {
    let work = match &args.trace {
        Some(path) => read_mooncake(path, 32_000, args.trace_tenants, Some(args.trace_requests))
            .map_err(|e| e.to_string())?,
        None => generate(&if args.quick {
            GeneratorSpec {
                sessions_per_tenant: 3,
                turns: 3,
                system_prompt_tokens: 512,
                ..GeneratorSpec::default()
            }
        } else {
            GeneratorSpec::default()
        }),
    };
    if !args.in_process {
        let envoy = args
            .envoy
            .clone()
            .unwrap_or_else(|| PathBuf::from(".venv/bin/envoy"));
        if !envoy.exists() {
            return Err(format!(
                "Envoy not found at {} (run `make demo`, which installs it, or pass --envoy)",
                envoy.display()
            ));
        }
        let rt = tokio::runtime::Builder::new_multi_thread()
            .enable_all()
            .build()
            .map_err(|e| e.to_string())?;
        return rt.block_on(async {
            tokio::select! {
                r = super::demo_net::run(&envoy, work, args.workers, args.block_size, args.num_blocks) => r,
                _ = tokio::signal::ctrl_c() => Err("interrupted; everything the demo started was stopped".into()),
            }
        });
    }
    let spec = FleetSpec::new(args.workers, args.num_blocks, args.block_size);
    let kv = simulate(&spec, &Policy::KvAware(ScoringConfig::default()), &work);
    let rr = simulate(&spec, &Policy::RoundRobin, &work);
    let text = render(&work.len(), &spec, &kv, &rr);
    if kv.cross_tenant_hit_blocks != 0 || kv.overcredited_decisions != 0 {
        return Err(format!("{text}\nisolation check FAILED"));
    }
    Ok(text)
}

fn render(n: &usize, spec: &FleetSpec, kv: &FleetReport, rr: &FleetReport) -> String {
    let mut out = String::new();
    out.push_str(&format!(
        "kv-epp demo (in-process): {n} requests, {} simulated engines x {} blocks of {} tokens\n\
         TTFT is simulated by the engines' latency model; hit rate = prompt tokens served from cache.\n\n",
        spec.workers, spec.num_blocks, spec.block_size
    ));
    out.push_str(&format!(
        "{:<10} {:>5} | {:>8} {:>8} | {:>9} {:>9} | {:>9} {:>9}\n",
        "tenant", "reqs", "hit kv", "hit rr", "mean kv", "mean rr", "p90 kv", "p90 rr"
    ));
    out.push_str(&format!("{}\n", "-".repeat(84)));
    let mut rows: Vec<(String, _, _)> = kv
        .tenants
        .iter()
        .map(|(t, s)| {
            (
                t.clone(),
                s.clone(),
                rr.tenants.get(t).cloned().unwrap_or_default(),
            )
        })
        .collect();
    rows.push(("all".into(), kv.total(), rr.total()));
    for (t, k, r) in rows {
        let name = if t.is_empty() { "(none)".into() } else { t };
        out.push_str(&format!(
            "{:<10} {:>5} | {:>7.1}% {:>7.1}% | {:>7.1}ms {:>7.1}ms | {:>7.1}ms {:>7.1}ms\n",
            name,
            k.requests,
            100.0 * k.hit_rate(),
            100.0 * r.hit_rate(),
            k.mean_ttft_ms(),
            r.mean_ttft_ms(),
            k.p90_ttft_ms(),
            r.p90_ttft_ms(),
        ));
    }
    out.push_str(&format!(
        "\nisolation: {} of {} cache-hit blocks came from another tenant's requests; \
         {} decisions credited blocks the engine did not have\n",
        kv.cross_tenant_hit_blocks, kv.hit_blocks, kv.overcredited_decisions
    ));
    if kv.rejected + rr.rejected > 0 {
        out.push_str(&format!(
            "engines rejected {} (kv-epp) / {} (round-robin) requests for lack of free blocks\n",
            kv.rejected, rr.rejected
        ));
    }
    out
}
