//! Scoring and picking: turn each candidate's cache overlap and load into a cost, then choose.
//!
//! Cost of a candidate (lower is better), each term in [0, 1] before weighting:
//! - `prefix`: the share of the prompt's blocks the worker would still have to prefill. Blocks in
//!   device memory count fully as cached; blocks in an offload tier count `offload_credit`.
//! - `queue`: requests ahead of this one, `q / (q + queue_scale)`, where `q` is the larger of
//!   kv-epp's own in-flight count and the engine's reported running + waiting (when fresh). The
//!   engine's figure sees other replicas' traffic too; ours sees requests the engine has not yet
//!   reported.
//! - `kv`: the engine's reported KV-cache usage (0 when unknown).
//!
//! Temperature 0 picks the lowest cost; ties go to fewer in-flight requests, then to the highest
//! rendezvous weight of (affinity key, worker), so identical prompts land on the same worker
//! without any shared state and every replica breaks ties the same way. Temperature > 0 samples
//! from a softmax over `-cost / temperature` with the caller's RNG. Candidates at their in-flight
//! limit (kv-epp's count or the engine's running + waiting) are never picked; if all are, the
//! request waits in flow control's queue or is shed.
//!
//! Pure and synchronous: no I/O, no clock, no global state.

use rand::Rng;
use serde::{Deserialize, Serialize};
use xxhash_rust::xxh3::xxh3_64_with_seed;

use crate::worker::WorkerId;

/// Weights and shape of the cost function.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ScoringConfig {
    /// Weight of the uncached share of the prompt.
    pub prefix_weight: f64,
    /// Weight of the queue term.
    pub queue_weight: f64,
    /// Weight of the engine's KV-cache usage.
    pub kv_usage_weight: f64,
    /// How much a block held only in an offload tier counts as cached (0..=1).
    pub offload_credit: f64,
    /// Queue length at which the queue term reaches 0.5.
    pub queue_scale: f64,
    /// 0 = always the lowest cost; > 0 = softmax sampling at this temperature.
    pub temperature: f64,
    /// How many fallback endpoints to list after the primary (0 = none).
    pub max_fallbacks: usize,
}

impl Default for ScoringConfig {
    fn default() -> Self {
        ScoringConfig {
            prefix_weight: 3.0,
            queue_weight: 2.0,
            kv_usage_weight: 2.0,
            offload_credit: 0.5,
            queue_scale: 4.0,
            temperature: 0.0,
            max_fallbacks: 0,
        }
    }
}

impl ScoringConfig {
    /// Checks value ranges; the error names the field.
    pub fn validate(&self) -> Result<(), String> {
        let nonneg = [
            ("prefix_weight", self.prefix_weight),
            ("queue_weight", self.queue_weight),
            ("kv_usage_weight", self.kv_usage_weight),
            ("temperature", self.temperature),
        ];
        for (name, v) in nonneg {
            if !(v.is_finite() && v >= 0.0) {
                return Err(format!(
                    "scoring.{name} must be a finite number ≥ 0, got {v}"
                ));
            }
        }
        if !(0.0..=1.0).contains(&self.offload_credit) {
            return Err(format!(
                "scoring.offload_credit must be in [0, 1], got {}",
                self.offload_credit
            ));
        }
        if !(self.queue_scale.is_finite() && self.queue_scale > 0.0) {
            return Err(format!(
                "scoring.queue_scale must be > 0, got {}",
                self.queue_scale
            ));
        }
        Ok(())
    }
}

/// Load an engine reported about itself (already checked for staleness by the caller).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct EngineLoad {
    /// Requests waiting in the engine's queue.
    pub waiting: f64,
    /// Requests running.
    pub running: f64,
    /// KV-cache usage, 0..=1.
    pub kv_usage: f64,
}

/// One worker the request may go to.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Candidate {
    /// The worker.
    pub worker: WorkerId,
    /// Leading prompt blocks held in device memory.
    pub device_blocks: u32,
    /// Leading prompt blocks held in any tier.
    pub total_blocks: u32,
    /// Requests kv-epp has in flight on this worker.
    pub inflight: u32,
    /// The worker's in-flight limit, if any.
    pub max_inflight: Option<u32>,
    /// Engine-reported load, when fresh.
    pub engine: Option<EngineLoad>,
}

impl Candidate {
    /// A candidate with no overlap and no load.
    pub fn idle(worker: WorkerId) -> Self {
        Candidate {
            worker,
            device_blocks: 0,
            total_blocks: 0,
            inflight: 0,
            max_inflight: None,
            engine: None,
        }
    }

    /// Whether the worker is at its in-flight limit (never picked): kv-epp's own in-flight count
    /// or, when fresh, the engine's reported running + waiting requests (which also sees other
    /// replicas' traffic), whichever is larger, the same queue length the queue term uses.
    pub fn saturated(&self) -> bool {
        self.max_inflight.is_some_and(|m| {
            let engine = self.engine.map_or(0.0, |e| e.running + e.waiting);
            f64::from(self.inflight).max(engine) >= f64::from(m)
        })
    }
}

/// A candidate with its cost.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Scored {
    /// The candidate.
    pub candidate: Candidate,
    /// Its cost (lower is better).
    pub cost: f64,
    /// Prompt blocks counted as cached (device + credited offload).
    pub cached_blocks: f64,
    /// The terms `cost` is the sum of, for explaining a decision.
    pub terms: CostTerms,
}

/// The weighted terms of a cost, exactly as [`score`] adds them up (so an explanation can never
/// disagree with the pick).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct CostTerms {
    /// `prefix_weight` × the uncached share of the prompt.
    pub prefix: f64,
    /// `queue_weight` × `q / (q + queue_scale)`.
    pub queue: f64,
    /// `kv_usage_weight` × the engine's KV-cache usage.
    pub kv_usage: f64,
    /// The queue length `q` the queue term was computed from (the larger of kv-epp's in-flight
    /// count and the engine's running + waiting).
    pub queue_length: f64,
}

/// The outcome of a pick.
#[derive(Clone, Debug, PartialEq)]
pub struct Decision {
    /// Where the request goes.
    pub primary: Scored,
    /// Ordered fallbacks (may be empty).
    pub fallbacks: Vec<WorkerId>,
}

/// Why no worker was picked.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum PickError {
    /// No candidate at all (none ready, or none in the allowed subset).
    #[error("no ready endpoint")]
    NoCandidates,
    /// Every candidate is at its in-flight limit.
    #[error("every candidate endpoint is at its in-flight limit")]
    AllSaturated,
}

/// Computes a candidate's cost for a prompt of `prompt_blocks` blocks.
pub fn score(c: &Candidate, prompt_blocks: u32, cfg: &ScoringConfig) -> Scored {
    let device = f64::from(c.device_blocks.min(prompt_blocks));
    let total = f64::from(c.total_blocks.min(prompt_blocks)).max(device);
    let cached = device + cfg.offload_credit * (total - device);
    let uncached = if prompt_blocks == 0 {
        0.0
    } else {
        1.0 - cached / f64::from(prompt_blocks)
    };
    let own = f64::from(c.inflight);
    let (queue, kv) = match c.engine {
        Some(e) => (own.max(e.running + e.waiting), e.kv_usage.clamp(0.0, 1.0)),
        None => (own, 0.0),
    };
    let queue_norm = queue / (queue + cfg.queue_scale);
    let terms = CostTerms {
        prefix: cfg.prefix_weight * uncached,
        queue: cfg.queue_weight * queue_norm,
        kv_usage: cfg.kv_usage_weight * kv,
        queue_length: queue,
    };
    Scored {
        candidate: *c,
        cost: terms.prefix + terms.queue + terms.kv_usage,
        cached_blocks: cached,
        terms,
    }
}

/// Rendezvous weight of a worker for an affinity key; stable across processes.
fn rendezvous(key: u64, w: &WorkerId) -> u64 {
    let mut buf = [0u8; 32];
    buf[..22].copy_from_slice(&w.key_bytes());
    buf[24..32].copy_from_slice(&key.to_le_bytes());
    xxh3_64_with_seed(&buf, 0x6b76)
}

/// Orders two scored candidates: lower cost, then fewer in flight, then higher rendezvous weight.
fn better(a: &Scored, b: &Scored, key: u64) -> std::cmp::Ordering {
    a.cost
        .total_cmp(&b.cost)
        .then(a.candidate.inflight.cmp(&b.candidate.inflight))
        .then_with(|| {
            rendezvous(key, &b.candidate.worker).cmp(&rendezvous(key, &a.candidate.worker))
        })
        .then(a.candidate.worker.cmp(&b.candidate.worker))
}

/// Picks a worker for a prompt of `prompt_blocks` blocks among `candidates`.
///
/// `affinity_key` should identify the prompt's prefix (e.g. its first block hash) so ties keep
/// identical prompts together. `rng` is used only when `cfg.temperature > 0`.
pub fn pick(
    candidates: &[Candidate],
    prompt_blocks: u32,
    affinity_key: u64,
    cfg: &ScoringConfig,
    rng: &mut impl Rng,
) -> Result<Decision, PickError> {
    if candidates.is_empty() {
        return Err(PickError::NoCandidates);
    }
    let mut scored: Vec<Scored> = candidates
        .iter()
        .filter(|c| !c.saturated())
        .map(|c| score(c, prompt_blocks, cfg))
        .collect();
    if scored.is_empty() {
        return Err(PickError::AllSaturated);
    }
    let chosen = if cfg.temperature > 0.0 && scored.len() > 1 {
        let min = scored.iter().map(|s| s.cost).fold(f64::INFINITY, f64::min);
        let weights: Vec<f64> = scored
            .iter()
            .map(|s| (-(s.cost - min) / cfg.temperature).exp())
            .collect();
        let total: f64 = weights.iter().sum();
        let mut x = rng.random::<f64>() * total;
        let mut idx = scored.len() - 1;
        for (i, w) in weights.iter().enumerate() {
            if x < *w {
                idx = i;
                break;
            }
            x -= w;
        }
        idx
    } else {
        let mut best = 0;
        for i in 1..scored.len() {
            if better(&scored[i], &scored[best], affinity_key).is_lt() {
                best = i;
            }
        }
        best
    };
    let primary = scored.swap_remove(chosen);
    let mut fallbacks = Vec::new();
    if cfg.max_fallbacks > 0 {
        scored.sort_by(|a, b| better(a, b, affinity_key));
        fallbacks = scored
            .iter()
            .take(cfg.max_fallbacks)
            .map(|s| s.candidate.worker)
            .collect();
    }
    Ok(Decision { primary, fallbacks })
}

/// How many more prompt blocks (device + credited offload, as [`score`] counts them) the best
/// *saturated* candidate holds than `picked`: what a request would recompute by going to
/// `picked` now instead of waiting for its cached worker to free up. 0 when no saturated
/// candidate holds more.
///
/// Flow control uses it for a queued request: it waits for the cached worker while its wait is
/// under `gap × affinity_wait_ms_per_block` (capped), trading waiting against recomputing; the
/// capacity it leaves meanwhile goes to other queued requests.
pub fn affinity_gap(
    candidates: &[Candidate],
    picked: &Scored,
    prompt_blocks: u32,
    cfg: &ScoringConfig,
) -> f64 {
    candidates
        .iter()
        .filter(|c| c.saturated())
        .map(|c| score(c, prompt_blocks, cfg).cached_blocks - picked.cached_blocks)
        .fold(0.0, f64::max)
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::SeedableRng;
    use rand::rngs::SmallRng;

    fn w(i: u8) -> WorkerId {
        WorkerId::new(format!("10.0.0.{i}:8000").parse().unwrap())
    }

    fn cand(i: u8, device: u32, inflight: u32) -> Candidate {
        Candidate {
            device_blocks: device,
            total_blocks: device,
            inflight,
            ..Candidate::idle(w(i))
        }
    }

    fn rng() -> SmallRng {
        SmallRng::seed_from_u64(7)
    }

    #[test]
    fn prefers_overlap_when_load_is_equal() {
        let cfg = ScoringConfig::default();
        let d = pick(
            &[cand(1, 2, 0), cand(2, 8, 0), cand(3, 0, 0)],
            10,
            0,
            &cfg,
            &mut rng(),
        )
        .unwrap();
        assert_eq!(d.primary.candidate.worker, w(2));
        assert_eq!(d.primary.cached_blocks, 8.0);
    }

    #[test]
    fn load_outweighs_a_small_overlap() {
        let cfg = ScoringConfig::default();
        // One cached block of 10 is not worth joining a queue of 20.
        let d = pick(&[cand(1, 1, 20), cand(2, 0, 0)], 10, 0, &cfg, &mut rng()).unwrap();
        assert_eq!(d.primary.candidate.worker, w(2));
    }

    #[test]
    fn offload_blocks_get_partial_credit() {
        let cfg = ScoringConfig::default();
        let offloaded = Candidate {
            total_blocks: 10,
            ..cand(1, 0, 0)
        };
        let s = score(&offloaded, 10, &cfg);
        assert_eq!(s.cached_blocks, 5.0);
        let d = pick(&[offloaded, cand(2, 6, 0)], 10, 0, &cfg, &mut rng()).unwrap();
        assert_eq!(d.primary.candidate.worker, w(2));
    }

    #[test]
    fn engine_load_counts_when_known() {
        let cfg = ScoringConfig::default();
        let busy = Candidate {
            engine: Some(EngineLoad {
                waiting: 30.0,
                running: 10.0,
                kv_usage: 0.95,
            }),
            ..cand(1, 0, 0)
        };
        let d = pick(&[busy, cand(2, 0, 0)], 4, 0, &cfg, &mut rng()).unwrap();
        assert_eq!(d.primary.candidate.worker, w(2));
    }

    #[test]
    fn ties_break_on_inflight_then_rendezvous_stably() {
        let cfg = ScoringConfig {
            queue_weight: 0.0,
            ..ScoringConfig::default()
        };
        let d = pick(&[cand(1, 0, 3), cand(2, 0, 1)], 4, 0, &cfg, &mut rng()).unwrap();
        assert_eq!(d.primary.candidate.worker, w(2));
        // Equal in everything: the same key always picks the same worker, whatever the order,
        // and different keys spread over workers.
        let cs: Vec<Candidate> = (1..=8).map(|i| cand(i, 0, 0)).collect();
        let mut rev = cs.clone();
        rev.reverse();
        let mut seen = std::collections::HashSet::new();
        for key in 0..64u64 {
            let a = pick(&cs, 4, key, &cfg, &mut rng()).unwrap();
            let b = pick(&rev, 4, key, &cfg, &mut rng()).unwrap();
            assert_eq!(a.primary.candidate.worker, b.primary.candidate.worker);
            seen.insert(a.primary.candidate.worker);
        }
        assert!(seen.len() >= 6, "keys spread over workers: {}", seen.len());
    }

    #[test]
    fn saturated_candidates_are_skipped_and_all_saturated_is_an_error() {
        let cfg = ScoringConfig::default();
        let full = Candidate {
            max_inflight: Some(2),
            ..cand(1, 9, 2)
        };
        let d = pick(&[full, cand(2, 0, 0)], 10, 0, &cfg, &mut rng()).unwrap();
        assert_eq!(d.primary.candidate.worker, w(2));
        assert_eq!(
            pick(&[full], 10, 0, &cfg, &mut rng()),
            Err(PickError::AllSaturated)
        );
        assert_eq!(
            pick(&[], 10, 0, &cfg, &mut rng()),
            Err(PickError::NoCandidates)
        );
    }

    #[test]
    fn fallbacks_follow_cost_order() {
        let cfg = ScoringConfig {
            max_fallbacks: 2,
            ..ScoringConfig::default()
        };
        let d = pick(
            &[cand(1, 1, 0), cand(2, 9, 0), cand(3, 5, 0), cand(4, 0, 0)],
            10,
            0,
            &cfg,
            &mut rng(),
        )
        .unwrap();
        assert_eq!(d.primary.candidate.worker, w(2));
        assert_eq!(d.fallbacks, vec![w(3), w(1)]);
    }

    #[test]
    fn softmax_is_seeded_and_favours_low_cost() {
        let cfg = ScoringConfig {
            temperature: 0.5,
            ..ScoringConfig::default()
        };
        let cs = [cand(1, 10, 0), cand(2, 0, 0)];
        let mut r = SmallRng::seed_from_u64(42);
        let picks: Vec<WorkerId> = (0..400)
            .map(|_| {
                pick(&cs, 10, 0, &cfg, &mut r)
                    .unwrap()
                    .primary
                    .candidate
                    .worker
            })
            .collect();
        let mut r2 = SmallRng::seed_from_u64(42);
        let again: Vec<WorkerId> = (0..400)
            .map(|_| {
                pick(&cs, 10, 0, &cfg, &mut r2)
                    .unwrap()
                    .primary
                    .candidate
                    .worker
            })
            .collect();
        assert_eq!(picks, again, "same seed, same picks");
        let hits = picks.iter().filter(|p| **p == w(1)).count();
        // cost gap 3.0 at T=0.5: p(w1) = 1/(1+e^-6) ≈ 0.9975
        assert!(hits > 380, "hits {hits}");
        // A hot temperature spreads load almost evenly.
        let hot = ScoringConfig {
            temperature: 100.0,
            ..cfg
        };
        let hot_hits = (0..400)
            .filter(|_| {
                pick(&cs, 10, 0, &hot, &mut r)
                    .unwrap()
                    .primary
                    .candidate
                    .worker
                    == w(1)
            })
            .count();
        assert!((150..250).contains(&hot_hits), "hot hits {hot_hits}");
    }

    #[test]
    fn config_validation_names_the_field() {
        let bad = ScoringConfig {
            offload_credit: 2.0,
            ..ScoringConfig::default()
        };
        assert!(bad.validate().unwrap_err().contains("offload_credit"));
        let bad = ScoringConfig {
            queue_weight: -1.0,
            ..ScoringConfig::default()
        };
        assert!(bad.validate().unwrap_err().contains("queue_weight"));
    }

    #[test]
    fn an_engine_reporting_a_full_queue_is_saturated_too() {
        let mut c = Candidate {
            max_inflight: Some(4),
            ..cand(1, 0, 1)
        };
        assert!(!c.saturated());
        c.engine = Some(EngineLoad {
            running: 3.0,
            waiting: 1.0,
            kv_usage: 0.5,
        });
        assert!(
            c.saturated(),
            "other replicas' requests count through the engine"
        );
        c.max_inflight = None;
        assert!(!c.saturated());
    }

    #[test]
    fn the_affinity_gap_counts_what_a_saturated_cached_worker_would_save() {
        let cfg = ScoringConfig::default();
        let cached = Candidate {
            max_inflight: Some(1),
            ..cand(1, 8, 1)
        };
        let free = Candidate {
            max_inflight: Some(1),
            ..cand(2, 2, 0)
        };
        let d = pick(&[cached, free], 10, 0, &cfg, &mut rng()).unwrap();
        assert_eq!(d.primary.candidate.worker, w(2));
        assert_eq!(affinity_gap(&[cached, free], &d.primary, 10, &cfg), 6.0);
        let idle = Candidate {
            max_inflight: Some(1),
            ..cand(1, 8, 0)
        };
        let d = pick(&[idle, free], 10, 0, &cfg, &mut rng()).unwrap();
        assert_eq!(affinity_gap(&[idle, free], &d.primary, 10, &cfg), 0.0);
    }
}
