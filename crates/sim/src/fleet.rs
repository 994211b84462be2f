//! An in-process fleet simulation: simulated engines (vLLM-like prefix caches with the latency
//! model) fed by a routing policy, in simulated time. Used by `kv-epp-sim demo --in-process` and by
//! the routing benchmarks; the network demo drives real `sim-worker` processes instead.
//!
//! kv-epp's side is the product's own code: each replica is a `decide::Picker` whose index is
//! fed only from the engines' own events (through the one writer, `engine_event::apply`), and
//! every request goes through `decide::decide` as ext_proc's do, booking its pick until the
//! request finishes.
//!
//! Each engine runs one prefill at a time (FIFO) and decodes in parallel; a request's blocks stay
//! referenced until its last token.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};
use std::sync::Arc;

use kv_epp::decide::{self, Picker, RequestParts, UnknownModel, decide};
use kv_epp::metrics::Metrics;
use kv_epp::models::{ModelSettings, ServedModels};
use kv_epp::workers::{Booking, Workers};

use crate::latency::LatencyModel;
use crate::prefix_cache::{CacheEvent, CacheRequest, EngineDigest, ExtraKey, PrefixCache};
use crate::workload::WorkloadRequest;
use kv_epp_core::engine_event::{
    self as writer, EngineEvent, EventCounters, StoredRun, TIER_DEVICE,
};
use kv_epp_core::fingerprint::FingerprintKey;
use kv_epp_core::index::{EngineBlockHash, IndexLimits, KvIndex, Medium};
use kv_epp_core::namespace::{self, Namespace};
use kv_epp_core::salt::{CacheSalt, SaltPolicy, SaltSource};
use kv_epp_core::scoring::ScoringConfig;
use kv_epp_core::worker::WorkerId;

/// How requests are assigned to engines.
#[derive(Clone, Debug)]
pub enum Policy {
    /// kv-epp: index query + scorer.
    KvAware(ScoringConfig),
    /// Round-robin, the baseline.
    RoundRobin,
}

/// Fleet shape.
#[derive(Clone, Debug)]
pub struct FleetSpec {
    /// Engines.
    pub workers: usize,
    /// Blocks per engine.
    pub num_blocks: usize,
    /// Tokens per block.
    pub block_size: usize,
    /// Latency model.
    pub latency: LatencyModel,
    /// kv-epp replicas in front of the fleet (requests alternate between them, as a load
    /// balancer spreads them). Each has its own index fed by every engine's events, and knows
    /// only the in-flight requests it routed itself.
    pub replicas: usize,
}

impl FleetSpec {
    /// `workers` engines of `num_blocks` blocks of `block_size` tokens, with the default latency
    /// model, behind one kv-epp.
    pub fn new(workers: usize, num_blocks: usize, block_size: usize) -> FleetSpec {
        FleetSpec {
            workers,
            num_blocks,
            block_size,
            latency: LatencyModel::default(),
            replicas: 1,
        }
    }
}

/// Per-tenant results.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct TenantStats {
    /// Requests served.
    pub requests: usize,
    /// Prompt tokens.
    pub prompt_tokens: u64,
    /// Prompt tokens served from an engine's cache.
    pub cached_tokens: u64,
    /// Time to first token of each request, microseconds.
    pub ttft_us: Vec<u64>,
}

impl TenantStats {
    /// Cached share of prompt tokens.
    pub fn hit_rate(&self) -> f64 {
        if self.prompt_tokens == 0 {
            0.0
        } else {
            self.cached_tokens as f64 / self.prompt_tokens as f64
        }
    }

    /// Mean TTFT in milliseconds.
    pub fn mean_ttft_ms(&self) -> f64 {
        if self.ttft_us.is_empty() {
            return 0.0;
        }
        self.ttft_us.iter().sum::<u64>() as f64 / self.ttft_us.len() as f64 / 1000.0
    }

    /// 90th percentile TTFT in milliseconds (nearest rank).
    pub fn p90_ttft_ms(&self) -> f64 {
        percentile(&self.ttft_us, 0.90) as f64 / 1000.0
    }
}

/// Nearest-rank percentile of unsorted samples.
pub fn percentile(samples: &[u64], q: f64) -> u64 {
    if samples.is_empty() {
        return 0;
    }
    let mut v = samples.to_vec();
    v.sort_unstable();
    let rank = ((q * v.len() as f64).ceil() as usize).clamp(1, v.len());
    v[rank - 1]
}

/// Results of one simulated run.
#[derive(Clone, Debug, Default)]
pub struct FleetReport {
    /// By tenant name ("" for unsalted).
    pub tenants: std::collections::BTreeMap<String, TenantStats>,
    /// Cache-hit blocks whose block had been stored by another tenant's request (must be 0).
    pub cross_tenant_hit_blocks: u64,
    /// All cache-hit blocks.
    pub hit_blocks: u64,
    /// Decisions where the index credited more device blocks than the chosen engine then had.
    pub overcredited_decisions: u64,
    /// Requests the engines could not admit (out of blocks).
    pub rejected: usize,
    /// Decisions made by a replica whose in-flight counts differed from the fleet's (it knows
    /// only the requests it routed itself); always 0 with one replica.
    pub partial_load_views: usize,
}

impl FleetReport {
    /// All tenants together.
    pub fn total(&self) -> TenantStats {
        let mut t = TenantStats::default();
        for s in self.tenants.values() {
            t.requests += s.requests;
            t.prompt_tokens += s.prompt_tokens;
            t.cached_tokens += s.cached_tokens;
            t.ttft_us.extend_from_slice(&s.ttft_us);
        }
        t
    }
}

pub(crate) struct Engine {
    cache: PrefixCache,
    /// Simulated time at which the prefill queue drains.
    prefill_free_at: u64,
    pub(crate) inflight: u32,
    /// Which tenant stored each block (to check isolation from the outside).
    stored_by: HashMap<EngineDigest, Option<String>>,
}

/// What an engine did with one request.
pub(crate) struct Served {
    /// Simulated time of the first token, µs.
    pub(crate) first_token: u64,
    /// Simulated time of the last token, µs.
    pub(crate) done: u64,
    /// The blocks it holds until done.
    pub(crate) blocks: Vec<u32>,
    /// Prompt tokens served from the cache.
    pub(crate) cached_tokens: usize,
    /// Cache-hit blocks whose block another tenant's request had stored (must be 0).
    pub(crate) cross_tenant_hit_blocks: u64,
}

impl Engine {
    pub(crate) fn new(spec: &FleetSpec) -> Engine {
        Engine {
            cache: PrefixCache::new(spec.num_blocks, spec.block_size),
            prefill_free_at: 0,
            inflight: 0,
            stored_by: HashMap::new(),
        }
    }

    /// Runs `req` from `now` (µs): prefill after the ones before it (FIFO), decode in parallel.
    /// Its cache events reach `indexes` as the engine publishes them, through the one writer as
    /// `worker`. `None`: the engine could not admit it (out of blocks).
    pub(crate) fn serve(
        &mut self,
        worker: &WorkerId,
        req: &WorkloadRequest,
        now: u64,
        spec: &FleetSpec,
        indexes: &[Arc<KvIndex>],
        counters: &EventCounters,
    ) -> Option<Served> {
        let salt = req.tenant.as_deref();
        let cache_salt = salt.and_then(|s| CacheSalt::new(s, SaltSource::Header).ok().flatten());
        // The engine receives the salt in kv-epp's forwarded form, as in production.
        let forwarded = cache_salt.as_ref().map(|s| Namespace::of(s).forwarded());
        let creq = CacheRequest {
            tokens: &req.tokens,
            salt: forwarded.as_deref(),
            lora_name: None,
        };
        let hit_digests = self.cache.digests_of(&creq);
        let adm = self.cache.admit(&creq).ok()?;
        let hit_blocks = adm.cached_tokens / spec.block_size;
        let cross_tenant_hit_blocks = hit_digests[..hit_blocks]
            .iter()
            .filter(|d| self.stored_by.get(d).is_some_and(|t| t.as_deref() != salt))
            .count() as u64;
        for ev in self.cache.take_events() {
            if let CacheEvent::Stored { hashes, .. } = &ev {
                for h in hashes {
                    self.stored_by.insert(*h, req.tenant.clone());
                }
            }
            let ev = engine_event(&ev, spec.block_size);
            for index in indexes {
                // Ignoring the result: a worker that was removed meanwhile has nothing to update.
                let _ = writer::apply(index, worker, &ev, counters);
            }
        }
        let start = now.max(self.prefill_free_at);
        let first_token = start
            + spec
                .latency
                .prefill_us(req.tokens.len() - adm.cached_tokens);
        self.prefill_free_at = first_token;
        self.inflight += 1;
        Some(Served {
            first_token,
            done: first_token + spec.latency.decode_us(req.output_tokens),
            blocks: adm.blocks,
            cached_tokens: adm.cached_tokens,
            cross_tenant_hit_blocks,
        })
    }

    /// The request holding `blocks` finished.
    pub(crate) fn finish(&mut self, blocks: &[u32]) {
        self.cache.release(blocks);
        self.inflight -= 1;
    }
}

/// A running request: (finish time, engine, request number, its blocks).
pub(crate) type Running = (u64, usize, usize, Vec<u32>);

/// The one model the fleet serves.
const MODEL: &str = "m";

/// A kv-epp replica's picker over the fleet: its own index of the one model, every engine as a
/// ready worker, scoring as `cfg` says, at most `max_inflight` requests per worker.
pub(crate) fn picker(
    spec: &FleetSpec,
    ids: &[WorkerId],
    cfg: &ScoringConfig,
    max_inflight: Option<u32>,
) -> Picker {
    let models = ServedModels::new(
        vec![ModelSettings {
            name: MODEL.into(),
            block_size: spec.block_size,
            lora_adapters: Vec::new(),
            max_prompt_tokens: None,
            tokenizer: None,
        }],
        IndexLimits::default(),
    )
    .expect("one model");
    let workers = Workers::new(Arc::new(Metrics::new()));
    for id in ids {
        workers.add(*id, MODEL, models.index(MODEL).cloned());
    }
    let policy = decide::Policy {
        scoring: cfg.clone(),
        max_inflight,
        unknown_model: UnknownModel::LoadOnly,
        unrenderable: decide::UnrenderableRequests::LoadOnly,
        salt: SaltPolicy::default(),
        fingerprints: FingerprintKey::from_passphrase("kv-epp-sim"),
        salted_events: true,
    };
    Picker::new(Arc::new(models), Arc::new(workers), policy)
}

/// Runs `requests` through a simulated fleet under `policy`.
pub fn simulate(spec: &FleetSpec, policy: &Policy, requests: &[WorkloadRequest]) -> FleetReport {
    let ids = worker_ids(spec);
    let mut engines: Vec<Engine> = (0..spec.workers).map(|_| Engine::new(spec)).collect();
    let replicas = spec.replicas.max(1);
    // One kv-epp replica = one picker of its own: the product's served models (one model, fed
    // only from the engines' events), its own worker list and bookings (it knows only the
    // requests it routed), and the request pipeline that ext_proc runs.
    let pickers: Vec<Picker> = match policy {
        Policy::KvAware(cfg) => (0..replicas)
            .map(|_| picker(spec, &ids, cfg, None))
            .collect(),
        Policy::RoundRobin => Vec::new(),
    };
    // The indexes the engines' events are applied to (none under round-robin).
    let indexes: Vec<Arc<KvIndex>> = pickers
        .iter()
        .filter_map(|p| p.models.index(MODEL).cloned())
        .collect();
    // The writer counts into these; the report reads the engines and the index instead.
    let counters = EventCounters::default();
    let mut bookings: HashMap<usize, Booking> = HashMap::new();
    let mut report = FleetReport::default();
    let mut running: BinaryHeap<Reverse<Running>> = BinaryHeap::new();
    let mut rr = 0usize;
    for (n, req) in requests.iter().enumerate() {
        let now = req.at_ms * 1000;
        let replica = n % replicas;
        while let Some(Reverse((t, _, _, _))) = running.peek() {
            if *t > now {
                break;
            }
            let Reverse((_, e, id, blocks)) = running.pop().expect("peeked");
            engines[e].finish(&blocks);
            bookings.remove(&id);
        }
        let salt = req.tenant.as_deref();
        let (chosen, credited) = match pickers.get(replica) {
            None => {
                rr = (rr + 1) % spec.workers;
                (rr, 0)
            }
            Some(picker) => {
                let partial = picker.workers.with(|ws| {
                    ws.iter()
                        .zip(&engines)
                        .any(|(w, e)| w.inflight() != e.inflight)
                });
                if partial {
                    report.partial_load_views += 1;
                }
                let body = serde_json::json!({"model": MODEL, "prompt": req.tokens}).to_string();
                let tenant: Vec<&[u8]> = salt.iter().map(|s| s.as_bytes()).collect();
                let parts = RequestParts {
                    path: "/v1/completions",
                    tenant: &tenant,
                    body: Some(body.as_bytes()),
                    ..RequestParts::default()
                };
                match decide(picker, &parts) {
                    Ok(mut d) => {
                        let i = ids
                            .iter()
                            .position(|w| *w == d.pick)
                            .expect("a fleet worker");
                        let credited = d
                            .candidates
                            .iter()
                            .find(|c| c.worker == d.pick)
                            .map_or(0, |c| c.device_blocks);
                        if let Some(b) = d.booking.take() {
                            bookings.insert(n, b);
                        }
                        (i, credited)
                    }
                    Err(_) => (0, 0),
                }
            }
        };
        let Some(served) = engines[chosen].serve(&ids[chosen], req, now, spec, &indexes, &counters)
        else {
            report.rejected += 1;
            continue;
        };
        let hit_blocks = served.cached_tokens / spec.block_size;
        if credited as usize > hit_blocks {
            report.overcredited_decisions += 1;
        }
        report.hit_blocks += hit_blocks as u64;
        report.cross_tenant_hit_blocks += served.cross_tenant_hit_blocks;
        running.push(Reverse((served.done, chosen, n, served.blocks)));
        let stats = report
            .tenants
            .entry(req.tenant.clone().unwrap_or_default())
            .or_default();
        stats.requests += 1;
        stats.prompt_tokens += req.tokens.len() as u64;
        stats.cached_tokens += served.cached_tokens as u64;
        stats.ttft_us.push(served.first_token - now);
    }
    report
}

/// The fleet's worker ids: one per engine, in engine order.
pub(crate) fn worker_ids(spec: &FleetSpec) -> Vec<WorkerId> {
    (0..spec.workers)
        .map(|i| WorkerId::new(format!("127.0.0.1:{}", 20000 + i).parse().expect("addr")))
        .collect()
}

/// The same `requests` routed by one kv-epp and by `replicas` active-active replicas in front of
/// the same fleet (the rest of `spec` as given): the comparison a replicated deployment must pass,
/// since each replica sees every engine event but only the in-flight requests it routed.
pub fn one_and_replicas(
    spec: &FleetSpec,
    replicas: usize,
    policy: &Policy,
    requests: &[WorkloadRequest],
) -> (FleetReport, FleetReport) {
    let with = |replicas| FleetSpec {
        replicas,
        ..spec.clone()
    };
    (
        simulate(&with(1), policy, requests),
        simulate(&with(replicas), policy, requests),
    )
}

/// The engine-neutral form of one simulated engine event, as kv-epp's vLLM decoder would make it
/// from the published event (same namespace rule, `namespace::root_seed`, on sequence starts).
pub fn engine_event(ev: &CacheEvent, block_size: usize) -> EngineEvent {
    let hashes = |h: &[EngineDigest]| h.iter().map(|h| EngineBlockHash(h.as_u64())).collect();
    match ev {
        CacheEvent::Stored {
            parent,
            hashes: stored,
            tokens,
            extra_keys,
            lora_name,
            ..
        } => {
            let root_seed = if parent.is_none() {
                let first: Vec<namespace::ExtraKey> = extra_keys
                    .first()
                    .into_iter()
                    .flatten()
                    .map(|k| match k {
                        ExtraKey::Str(s) => namespace::ExtraKey::Str(s.clone()),
                    })
                    .collect();
                namespace::root_seed(lora_name.as_deref(), &first)
            } else {
                None // inherited from the parent inside the index
            };
            EngineEvent::Stored(StoredRun {
                parent: parent.map(|p| EngineBlockHash(p.as_u64())),
                root_seed,
                engine_hashes: hashes(stored),
                tokens: tokens.clone(),
                medium: Medium::Device,
                block_size: Some(block_size),
                session_id: None,
            })
        }
        CacheEvent::Removed { hashes: removed } => EngineEvent::Removed {
            engine_hashes: hashes(removed),
            tiers: TIER_DEVICE,
        },
        CacheEvent::Cleared => EngineEvent::Cleared,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::workload::{GeneratorSpec, generate};

    #[test]
    fn three_replicas_route_about_as_well_as_one() {
        let work = generate(&GeneratorSpec {
            sessions_per_tenant: 4,
            ..GeneratorSpec::default()
        });
        let policy = Policy::KvAware(ScoringConfig::default());
        let (one, three) = one_and_replicas(&FleetSpec::new(4, 2048, 16), 3, &policy, &work);
        let (h1, h3) = (one.total().hit_rate(), three.total().hit_rate());
        assert!(h1 > 0.3, "the workload has reuse: {h1}");
        assert_eq!(one.partial_load_views, 0);
        assert!(
            three.partial_load_views > 0,
            "each replica sees only its own requests"
        );
        // Each replica sees every event but only its own in-flight requests: affinity holds.
        assert!(
            (h1 - h3).abs() < 0.05,
            "1 replica {h1:.3}, 3 replicas {h3:.3}"
        );
        assert_eq!(three.cross_tenant_hit_blocks, 0);
        assert_eq!(three.overcredited_decisions, 0);
    }

    #[test]
    fn kv_aware_beats_round_robin_and_keeps_tenants_apart() {
        let spec = FleetSpec::new(4, 2048, 16);
        let work = generate(&GeneratorSpec {
            sessions_per_tenant: 4,
            ..GeneratorSpec::default()
        });
        let kv = simulate(&spec, &Policy::KvAware(ScoringConfig::default()), &work);
        let rr = simulate(&spec, &Policy::RoundRobin, &work);
        assert_eq!(kv.total().requests, work.len());
        assert!(
            kv.total().hit_rate() > rr.total().hit_rate() + 0.1,
            "kv {} rr {}",
            kv.total().hit_rate(),
            rr.total().hit_rate()
        );
        assert_eq!(kv.cross_tenant_hit_blocks, 0);
        assert_eq!(kv.overcredited_decisions, 0);
        assert!(kv.hit_blocks > 0);
    }
}
