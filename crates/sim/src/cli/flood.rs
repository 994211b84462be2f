//! `kv-epp-sim flood`: one tenant at 10× the others' rate against the in-process fleet, with
//! kv-epp's flow control on and off, with and without the flood; prints the table README's
//! "Flow control and tenant fairness" reports.

use kv_epp_sim::flood::{FloodSpec, compare};

/// Flags of `kv-epp-sim flood`; defaults are the README's run.
#[derive(clap::Args, Debug)]
pub(crate) struct FloodArgs {
    /// Engines.
    #[arg(long, default_value_t = FloodSpec::default().fleet.workers)]
    workers: usize,
    /// Well-behaved tenants.
    #[arg(long, default_value_t = FloodSpec::default().calm_tenants)]
    calm_tenants: usize,
    /// Requests per second of each well-behaved tenant.
    #[arg(long, default_value_t = FloodSpec::default().calm_rate)]
    calm_rate: f64,
    /// The flooding tenant's rate, as a multiple of the others'.
    #[arg(long, default_value_t = FloodSpec::default().flood_factor)]
    flood_factor: f64,
    /// Seconds of arrivals.
    #[arg(long, default_value_t = FloodSpec::default().seconds)]
    seconds: f64,
    /// Prompt tokens per request.
    #[arg(long, default_value_t = FloodSpec::default().prompt_tokens)]
    prompt_tokens: usize,
    /// Output tokens per request.
    #[arg(long, default_value_t = FloodSpec::default().output_tokens)]
    output_tokens: u32,
    /// kv-epp's in-flight limit per engine when flow control is on.
    #[arg(long, default_value_t = FloodSpec::default().max_inflight)]
    max_inflight: u32,
}

pub(crate) fn run(args: &FloodArgs) -> Result<String, String> {
    let d = FloodSpec::default();
    let spec = FloodSpec {
        fleet: kv_epp_sim::fleet::FleetSpec {
            workers: args.workers,
            ..d.fleet.clone()
        },
        calm_tenants: args.calm_tenants,
        calm_rate: args.calm_rate,
        flood_factor: args.flood_factor,
        seconds: args.seconds,
        prompt_tokens: args.prompt_tokens,
        output_tokens: args.output_tokens,
        max_inflight: args.max_inflight,
        ..d
    };
    if spec.fleet.workers == 0 || spec.calm_rate <= 0.0 || spec.seconds <= 0.0 {
        return Err("--workers, --calm-rate and --seconds must be > 0".into());
    }
    Ok(compare(&spec).table(&spec))
}
