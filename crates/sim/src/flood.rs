//! One tenant floods the fleet: does kv-epp's flow control keep the others' time to first token?
//!
//! An in-process fleet in simulated time (the engines of `fleet.rs`: one prefill at a time,
//! FIFO, decode in parallel) behind the product's own request path and flow control
//! (`decide::understand`, `flow::FlowControl::admit`/`dispatch` on a simulated clock, bookings held
//! until the last token). `calm_tenants` tenants send Poisson traffic at `calm_rate` each; with
//! `flood`, one more sends `flood_factor` times that. Flow control on: at most `max_inflight`
//! requests per engine, the rest wait in kv-epp's fair queue (timing out after
//! `queue_timeout_ms` with a 429). Flow control off: today's default without a limit, every
//! request goes straight to an engine, whose FIFO prefill queue serves whoever came first.
//!
//! Every request is accounted for: served once, or refused with a reason; the report counts any
//! request served twice or neither served nor refused (both must be 0).

use std::cmp::Reverse;
use std::collections::{BTreeMap, BinaryHeap, HashMap, HashSet};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

use kv_epp::decide::{self, Decision, RequestParts};
use kv_epp::flow::{Admission, FlowControl, FlowControlConfig, FlowMetrics, TenantSlot, Ticket};
use kv_epp::workers::Booking;
use kv_epp_core::engine_event::EventCounters;
use kv_epp_core::index::KvIndex;
use kv_epp_core::scoring::ScoringConfig;
use kv_epp_core::worker::WorkerId;

use crate::fleet::{Engine, FleetSpec, Running, percentile, picker, worker_ids};
use crate::workload::WorkloadRequest;

/// The flood experiment.
#[derive(Clone, Debug)]
pub struct FloodSpec {
    /// The fleet.
    pub fleet: FleetSpec,
    /// Well-behaved tenants.
    pub calm_tenants: usize,
    /// Requests per second of each well-behaved tenant.
    pub calm_rate: f64,
    /// The flooding tenant's rate, as a multiple of `calm_rate`.
    pub flood_factor: f64,
    /// Length of the arrival window, seconds.
    pub seconds: f64,
    /// Prompt tokens per request (a 256-token prefix shared within the tenant, the rest unique).
    pub prompt_tokens: usize,
    /// Output tokens per request.
    pub output_tokens: u32,
    /// In-flight limit per engine when flow control is on.
    pub max_inflight: u32,
    /// Queue timeout when flow control is on, ms.
    pub queue_timeout_ms: u64,
    /// Arrival seed.
    pub seed: u64,
}

impl Default for FloodSpec {
    fn default() -> Self {
        FloodSpec {
            fleet: FleetSpec::new(4, 4096, 16),
            calm_tenants: 4,
            calm_rate: 14.0,
            flood_factor: 10.0,
            seconds: 60.0,
            prompt_tokens: 768,
            output_tokens: 32,
            max_inflight: 8,
            queue_timeout_ms: 30_000,
            seed: 7,
        }
    }
}

/// One tenant's outcome.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct TenantOutcome {
    /// Requests sent.
    pub sent: usize,
    /// Requests served.
    pub served: usize,
    /// Requests refused (queue timeout, queue full, or the engine out of blocks).
    pub refused: usize,
    /// Time to first token of each served request (arrival at kv-epp → first token), µs.
    pub ttft_us: Vec<u64>,
}

impl TenantOutcome {
    /// 90th percentile time to first token, ms.
    pub fn p90_ttft_ms(&self) -> f64 {
        percentile(&self.ttft_us, 0.90) as f64 / 1000.0
    }
}

/// One run's results.
#[derive(Clone, Debug, Default)]
pub struct FloodReport {
    /// By tenant (`calm-0`.., `flood`).
    pub tenants: BTreeMap<String, TenantOutcome>,
    /// Requests served more than once (must be 0).
    pub served_twice: usize,
    /// Requests neither served nor refused (must be 0).
    pub lost: usize,
    /// Simulated seconds until the last request finished.
    pub makespan_s: f64,
}

impl FloodReport {
    /// The worst p90 TTFT among the well-behaved tenants, ms.
    pub fn calm_p90_ms(&self) -> f64 {
        self.tenants
            .iter()
            .filter(|(t, _)| t.starts_with("calm"))
            .map(|(_, o)| o.p90_ttft_ms())
            .fold(0.0, f64::max)
    }

    /// The flooding tenant's outcome.
    pub fn flood(&self) -> TenantOutcome {
        self.tenants.get("flood").cloned().unwrap_or_default()
    }
}

/// The requests of one run: Poisson arrivals per tenant, merged in time order.
pub fn workload(spec: &FloodSpec, flood: bool) -> Vec<WorkloadRequest> {
    let mut rng = SmallRng::seed_from_u64(spec.seed);
    let mut tenants: Vec<(String, f64)> = (0..spec.calm_tenants)
        .map(|i| (format!("calm-{i}"), spec.calm_rate))
        .collect();
    if flood {
        tenants.push(("flood".into(), spec.calm_rate * spec.flood_factor));
    }
    let mut out = Vec::new();
    let mut unique = 1_000_000u32;
    for (t, (name, rate)) in tenants.iter().enumerate() {
        let mut at = 0.0;
        loop {
            at += -rng.random::<f64>().max(1e-12).ln() / rate;
            if at >= spec.seconds {
                break;
            }
            let shared = spec.prompt_tokens.min(256);
            let mut tokens: Vec<u32> = (0..shared as u32).map(|i| (t as u32) << 16 | i).collect();
            tokens.extend((shared..spec.prompt_tokens).map(|_| {
                unique += 1;
                unique
            }));
            out.push(WorkloadRequest {
                at_ms: (at * 1000.0) as u64,
                tenant: Some(name.clone()),
                tokens,
                output_tokens: spec.output_tokens,
            });
        }
    }
    // The calm tenants' arrivals do not depend on whether the flood runs.
    out.sort_by_key(|r| r.at_ms);
    out
}

/// The state of one run in simulated time.
struct Run<'a> {
    requests: &'a [WorkloadRequest],
    fleet: &'a FleetSpec,
    ids: Vec<WorkerId>,
    indexes: Vec<Arc<KvIndex>>,
    counters: EventCounters,
    engines: Vec<Engine>,
    report: FloodReport,
    served: HashSet<usize>,
    refused: HashSet<usize>,
    /// (done µs, engine, request, blocks)
    running: BinaryHeap<Reverse<Running>>,
    /// What each running request holds in kv-epp until its last token.
    holders: HashMap<usize, (Option<Booking>, TenantSlot)>,
}

impl Run<'_> {
    /// Starts request `n` (arrived at `arrival` µs) at `now` on kv-epp's pick.
    fn start(&mut self, n: usize, arrival: u64, now: u64, mut d: Decision, slot: TenantSlot) {
        let pick = self
            .ids
            .iter()
            .position(|w| *w == d.pick)
            .expect("a fleet worker");
        let req = &self.requests[n];
        let served = self.engines[pick].serve(
            &self.ids[pick],
            req,
            now,
            self.fleet,
            &self.indexes,
            &self.counters,
        );
        let Some(served) = served else {
            return self.refuse(n);
        };
        if !self.served.insert(n) {
            self.report.served_twice += 1;
        }
        let stats = self.stats(n);
        stats.served += 1;
        stats.ttft_us.push(served.first_token - arrival);
        self.running
            .push(Reverse((served.done, pick, n, served.blocks)));
        self.holders.insert(n, (d.booking.take(), slot));
    }

    fn refuse(&mut self, n: usize) {
        self.stats(n).refused += 1;
        self.refused.insert(n);
    }

    fn stats(&mut self, n: usize) -> &mut TenantOutcome {
        let t = self.requests[n].tenant.clone().unwrap_or_default();
        self.report.tenants.entry(t).or_default()
    }
}

/// Runs one experiment: with or without the flood, with flow control on or off.
pub fn run(spec: &FloodSpec, flood: bool, flow_control: bool) -> FloodReport {
    let requests = workload(spec, flood);
    let fleet = &spec.fleet;
    let ids = worker_ids(fleet);
    let limit = flow_control.then_some(spec.max_inflight);
    let picker = Arc::new(picker(fleet, &ids, &ScoringConfig::default(), limit));
    let now_us = Arc::new(AtomicU64::new(0));
    let clock = {
        let now_us = now_us.clone();
        Arc::new(move || now_us.load(Ordering::Relaxed) / 1000) as kv_epp::flow::Clock
    };
    let settings = FlowControlConfig {
        enabled: flow_control,
        queue_timeout_ms: spec.queue_timeout_ms,
        ..FlowControlConfig::default()
    }
    .settings()
    .expect("valid flow control settings");
    let flow = FlowControl::with_clock(
        settings,
        picker.clone(),
        Arc::new(FlowMetrics::default()),
        picker.workers.released(),
        Some(clock),
    );
    let mut run = Run {
        requests: &requests,
        fleet,
        indexes: picker.models.index("m").into_iter().cloned().collect(),
        ids,
        counters: EventCounters::default(),
        engines: (0..fleet.workers).map(|_| Engine::new(fleet)).collect(),
        report: FloodReport::default(),
        served: HashSet::new(),
        refused: HashSet::new(),
        running: BinaryHeap::new(),
        holders: HashMap::new(),
    };
    for n in 0..requests.len() {
        run.stats(n).sent += 1;
    }
    // Queued: (request, arrival µs, ticket)
    let mut queued: Vec<(usize, u64, Ticket)> = Vec::new();
    let timeout_us = spec.queue_timeout_ms * 1000;
    let mut next = 0usize;
    loop {
        let arrival = requests.get(next).map(|r| r.at_ms * 1000);
        let completion = run.running.peek().map(|Reverse((t, ..))| *t);
        let timeout = queued.iter().map(|(_, at, _)| at + timeout_us).min();
        let Some(now) = [arrival, completion, timeout].into_iter().flatten().min() else {
            break;
        };
        now_us.store(now, Ordering::Relaxed);
        if completion == Some(now) {
            let Reverse((_, e, n, blocks)) = run.running.pop().expect("peeked");
            run.engines[e].finish(&blocks);
            run.report.makespan_s = run.report.makespan_s.max(now as f64 / 1e6);
            // Releasing the booking frees the slot; flow control offers it to the queue.
            run.holders.remove(&n);
            flow.dispatch();
            let mut still = Vec::new();
            for (q, at, mut ticket) in queued.drain(..) {
                match ticket.try_take() {
                    Some(Ok((d, slot))) => run.start(q, at, now, d, slot),
                    Some(Err(_)) => run.refuse(q),
                    None => still.push((q, at, ticket)),
                }
            }
            queued = still;
        } else if timeout == Some(now) {
            let (expired, kept): (Vec<_>, Vec<_>) = queued
                .drain(..)
                .partition(|(_, at, _)| at + timeout_us <= now);
            queued = kept;
            for (q, _, ticket) in expired {
                // Dropping the ticket leaves the queue: a 429 rejected-queue-timeout.
                drop(ticket);
                run.refuse(q);
            }
        } else {
            let n = next;
            next += 1;
            let req = &requests[n];
            let body = serde_json::json!({"model": "m", "prompt": req.tokens, "max_tokens": req.output_tokens})
                .to_string();
            let tenant: Vec<&[u8]> = req.tenant.iter().map(|s| s.as_bytes()).collect();
            let parts = RequestParts {
                path: "/v1/completions",
                tenant: &tenant,
                body: Some(body.as_bytes()),
                ..RequestParts::default()
            };
            let understood = decide::understand(&picker, &parts).expect("a valid request");
            match flow.admit(understood, &parts, body.len()) {
                Admission::Now(d, slot) => run.start(n, now, now, *d, slot),
                Admission::Refused(_) => run.refuse(n),
                Admission::Queued(ticket) => queued.push((n, now, ticket)),
            }
        }
    }
    let accounted = run.served.union(&run.refused).count();
    run.report.lost = requests.len() - accounted;
    run.report
}

/// The four runs the README reports: without and with the flood, flow control on and off.
pub struct Comparison {
    /// Flow control on, no flood.
    pub on_calm: FloodReport,
    /// Flow control on, flood.
    pub on_flood: FloodReport,
    /// Flow control off, no flood.
    pub off_calm: FloodReport,
    /// Flow control off, flood.
    pub off_flood: FloodReport,
}

/// Runs the comparison.
pub fn compare(spec: &FloodSpec) -> Comparison {
    Comparison {
        on_calm: run(spec, false, true),
        on_flood: run(spec, true, true),
        off_calm: run(spec, false, false),
        off_flood: run(spec, true, false),
    }
}

impl Comparison {
    /// The table `kv-epp-sim flood` prints.
    pub fn table(&self, spec: &FloodSpec) -> String {
        let mut s = format!(
            "{} engines, {} calm tenants at {}/s each, flood at {}x; {}-token prompts, {} output tokens, {} s of arrivals\n",
            spec.fleet.workers,
            spec.calm_tenants,
            spec.calm_rate,
            spec.flood_factor,
            spec.prompt_tokens,
            spec.output_tokens,
            spec.seconds
        );
        s += "| flow control | flood | calm p90 TTFT (worst tenant) | vs no flood | flood served / sent | flood p90 TTFT | refused (calm / flood) | lost | served twice | all served by |\n|---|---|---|---|---|---|---|---|---|---|\n";
        for (name, calm, run) in [
            ("on", &self.on_calm, &self.on_calm),
            ("on", &self.on_calm, &self.on_flood),
            ("off", &self.off_calm, &self.off_calm),
            ("off", &self.off_calm, &self.off_flood),
        ] {
            let f = run.flood();
            let calm_refused: usize = run
                .tenants
                .iter()
                .filter(|(t, _)| t.starts_with("calm"))
                .map(|(_, o)| o.refused)
                .sum();
            s += &format!(
                "| {name} | {} | {:.0} ms | {:.2}x | {} / {} | {:.0} ms | {} / {} | {} | {} | {:.1} s |\n",
                if f.sent > 0 { "10x tenant" } else { "none" },
                run.calm_p90_ms(),
                run.calm_p90_ms() / calm.calm_p90_ms().max(1e-9),
                f.served,
                f.sent,
                f.p90_ttft_ms(),
                calm_refused,
                f.refused,
                run.lost,
                run.served_twice,
                run.makespan_s,
            );
        }
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flow_control_keeps_calm_tenants_ttft_under_a_10x_flood() {
        let spec = FloodSpec {
            seconds: 12.0,
            ..FloodSpec::default()
        };
        let c = compare(&spec);
        for r in [&c.on_calm, &c.on_flood, &c.off_calm, &c.off_flood] {
            assert_eq!((r.lost, r.served_twice), (0, 0));
        }
        let ratio = c.on_flood.calm_p90_ms() / c.on_calm.calm_p90_ms();
        assert!(ratio <= 1.5, "{}", c.table(&spec));
        // The flood gets what the calm tenants leave, and more than any of them.
        let flood = c.on_flood.flood();
        assert!(
            flood.served > 3 * c.on_flood.tenants["calm-0"].served,
            "{}",
            c.table(&spec)
        );
        // Without flow control the calm tenants queue behind the flood.
        let off = c.off_flood.calm_p90_ms() / c.off_calm.calm_p90_ms();
        assert!(off > 3.0, "{}", c.table(&spec));
    }
}
