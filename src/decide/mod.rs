//! The request pipeline: from a request's parts to a decision or a refusal, the same way for
//! every caller.
//!
//! ```text
//! RequestParts ─▶ body ─▶ salt ─▶ model ─▶ tokens ─▶ prompt limit ─▶ block hashes ─▶ forwarded body
//!   (understand: what `kv-epp tokenize` prints)                                        │
//!                                                                                        ▼
//!                 candidates (ready ▸ model ▸ subset hint ▸ conformance order) ─▶ scores ─▶ pick ─▶ booking
//! ```
//!
//! [`decide`] books the picked worker (the ext_proc edge); [`explain`] runs the same code without
//! booking and without advancing the decision count, so asking never changes what the next request
//! gets (admin `POST /explain`); [`understand`] stops before the workers (`kv-epp tokenize`).
//! Admin `/query` takes token IDs directly and uses [`resolve_salt`] and [`hash_prompt`]. No
//! edge resolves salts, tokenizes or hashes on its own, so the paths cannot drift apart.
//!
//! Every refusal is a [`Reject`]; the edges map it to their protocol with its methods.
//! Pure and synchronous: the only state touched is the booking's in-flight count.

mod picker;
mod reject;

use std::fmt;
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;

use rand::SeedableRng;
use rand::rngs::SmallRng;

pub use picker::{Picker, Policy, UnknownModel, UnrenderableRequests};
pub use reject::{ROUTED, Reject, TOKENIZE_FAILED};

use crate::forward::rewrite_salt;
use crate::request::{self, ParsedBody, Prompt, RequestError};
use crate::workers::{Booking, WorkerRuntime};
use kv_epp_core::fingerprint::Fingerprint;
use kv_epp_core::hashing::{LocalBlockHash, SequenceHash, prompt_hashes};
use kv_epp_core::namespace::{Namespace, seed_for};
use kv_epp_core::salt::{CacheSalt, SaltInputs, SaltSource, resolve};
use kv_epp_core::scoring::{
    Candidate, EngineLoad, PickError, Scored, ScoringConfig, affinity_gap, pick, score,
};
use kv_epp_core::worker::WorkerId;
use kv_epp_tokenize::TokenizeError;

/// One request as an edge found it: the typed input of the pipeline.
#[derive(Clone, Copy, Default)]
pub struct RequestParts<'a> {
    /// The request path (`:path`), which decides how the body is tokenized.
    pub path: &'a str,
    /// Every value of the `x-tenant-id` header, in order (normally zero or one).
    pub tenant: &'a [&'a [u8]],
    /// The whole request body (`None` for a request without one).
    pub body: Option<&'a [u8]>,
    /// The gateway's subset hint: only these endpoints are eligible.
    pub subset: Option<&'a [SocketAddr]>,
    /// Conformance order (`test-epp-endpoint-selection`): only workers on these IPs, the first
    /// IP that has an eligible worker preferred.
    pub conformance: Option<&'a [IpAddr]>,
}

impl fmt::Debug for RequestParts<'_> {
    // The tenant header is a salt: show how many values there were, never their bytes.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RequestParts")
            .field("path", &self.path)
            .field("tenant_values", &self.tenant.len())
            .field("body_bytes", &self.body.map(<[u8]>::len))
            .field("subset", &self.subset)
            .field("conformance", &self.conformance)
            .finish()
    }
}

/// The model a request names, and what it resolves to.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ModelRef {
    /// The body's `model` field, as sent.
    pub named: Option<String>,
    /// The served base model (`None`: not served here).
    pub base: Option<String>,
    /// The LoRA adapter, when `model` names one.
    pub lora: Option<String>,
}

/// A request's resolved salt with its keyed fingerprint. `Debug` shows the source and the
/// fingerprint only.
#[derive(Clone)]
pub struct Salt {
    value: CacheSalt,
    source: SaltSource,
    fingerprint: Fingerprint,
}

impl Salt {
    /// The salt itself, for hashing and forwarding. Never log it.
    pub fn cache_salt(&self) -> &CacheSalt {
        &self.value
    }

    /// Where it came from.
    pub fn source(&self) -> SaltSource {
        self.source
    }

    /// Its fingerprint under the server's key: how logs, metrics and answers name it.
    pub fn fingerprint(&self) -> Fingerprint {
        self.fingerprint
    }
}

impl fmt::Debug for Salt {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "Salt {{ source: {}, fingerprint: {} }}",
            self.source.as_str(),
            self.fingerprint
        )
    }
}

/// The block hashes of a prompt under its model's block size, salt and adapter.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PromptHashes {
    /// Tokens per block (0 when the model is not served).
    pub block_size: usize,
    /// Per-block hashes (what engines report); partial blocks are never hashed.
    pub local: Vec<LocalBlockHash>,
    /// Chained prefix hashes (what the index is queried with).
    pub sequence: Vec<SequenceHash>,
}

/// Everything kv-epp derives from a request before looking at workers.
pub struct Understood {
    /// The request path.
    pub path: String,
    /// The model.
    pub model: ModelRef,
    /// The resolved salt (`None`: unsalted).
    pub salt: Option<Salt>,
    /// The prompt's token IDs, when the request has them or kv-epp tokenized it.
    pub tokens: Option<Vec<u32>>,
    /// The prompt's block hashes (empty without tokens or without a served model).
    pub hashes: PromptHashes,
    /// The body the engine must receive when it differs from the received one (forwarded salt
    /// in `cache_salt`, client salt fields removed); `None`: forward the received body as is.
    pub rewritten_body: Option<Vec<u8>>,
    /// Tokenization failed on kv-epp's side (not the client's): the request routes on load
    /// alone.
    pub tokenize_failure: Option<TokenizeError>,
    /// The most tokens the client asks to generate, when the body says (flow control's
    /// expected decode work).
    pub max_output_tokens: Option<u64>,
    /// kv-epp cannot render the request exactly as the engine would (its
    /// `TokenizeError::unrenderable` reason) and the policy is `load_only`: the request routes
    /// on load alone and the engine decides whether it is valid.
    pub unrenderable: Option<TokenizeError>,
}

impl Understood {
    /// The `reason` label of [`Understood::unrenderable`].
    pub fn unrenderable_reason(&self) -> Option<&'static str> {
        self.unrenderable
            .as_ref()
            .and_then(TokenizeError::unrenderable)
            .map(|r| r.label())
    }
}

impl Understood {
    /// The body to forward, given the body that was received.
    pub fn forwarded_body<'a>(&'a self, received: &'a [u8]) -> &'a [u8] {
        self.rewritten_body.as_deref().unwrap_or(received)
    }

    /// Prompt blocks (complete blocks of the prompt).
    pub fn prompt_blocks(&self) -> u32 {
        u32::try_from(self.hashes.sequence.len()).unwrap_or(u32::MAX)
    }
}

impl fmt::Debug for Understood {
    // The rewritten body carries the forwarded salt: its length only.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Understood")
            .field("path", &self.path)
            .field("model", &self.model)
            .field("salt", &self.salt)
            .field("tokens", &self.tokens.as_ref().map(Vec::len))
            .field("prompt_blocks", &self.hashes.sequence.len())
            .field(
                "rewritten_body_bytes",
                &self.rewritten_body.as_ref().map(Vec::len),
            )
            .field("tokenize_failure", &self.tokenize_failure)
            .field("unrenderable", &self.unrenderable)
            .finish()
    }
}

/// Why a worker was not a candidate at all.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Exclusion {
    /// The worker is not ready.
    NotReady,
    /// It serves another model.
    OtherModel,
    /// It is outside the gateway's subset hint.
    OutsideSubset,
    /// Its IP is not in the conformance list.
    NotInConformanceList,
    /// The conformance order prefers workers on this IP.
    ConformanceOrder(IpAddr),
}

impl fmt::Display for Exclusion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Exclusion::NotReady => f.write_str("not ready"),
            Exclusion::OtherModel => f.write_str("serves another model"),
            Exclusion::OutsideSubset => f.write_str("outside the subset hint"),
            Exclusion::NotInConformanceList => f.write_str("not in the conformance selection"),
            Exclusion::ConformanceOrder(ip) => {
                write!(f, "the conformance selection prefers {ip}")
            }
        }
    }
}

/// Why a scored candidate was not picked.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Loss {
    /// Its cost was higher than the pick's by this much.
    HigherCost(f64),
    /// Same cost; more requests in flight.
    MoreInFlight,
    /// Same cost and in-flight count; the rendezvous tie-break (stable per prompt) chose the
    /// other.
    TieBreak,
    /// Sampling at a temperature > 0 chose another candidate.
    NotSampled {
        /// The scoring temperature.
        temperature: f64,
    },
}

impl fmt::Display for Loss {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Loss::HigherCost(by) => write!(f, "higher cost by {by:.4}"),
            Loss::MoreInFlight => f.write_str("equal cost, more requests in flight"),
            Loss::TieBreak => f.write_str("equal cost and load, lost the rendezvous tie-break"),
            Loss::NotSampled { temperature } => {
                write!(f, "not sampled (temperature {temperature})")
            }
        }
    }
}

/// Where a worker stands in one decision.
#[derive(Clone, Debug, PartialEq)]
pub enum Standing {
    /// The pick.
    Picked(Scored),
    /// Scored and not picked.
    Lost(Scored, Loss),
    /// At its in-flight limit: scored for the record, never picked.
    Saturated(Scored),
    /// Not a candidate.
    Excluded(Exclusion),
}

/// One worker as the decision saw it: its overlap, its load inputs and its standing.
#[derive(Clone, Debug)]
pub struct CandidateReport {
    /// The worker.
    pub worker: WorkerId,
    /// The model it serves.
    pub model: String,
    /// Leading prompt blocks it holds in device memory.
    pub device_blocks: u32,
    /// Leading prompt blocks it holds in any tier.
    pub total_blocks: u32,
    /// Requests kv-epp has in flight on it.
    pub inflight: u32,
    /// Its in-flight limit, if any.
    pub max_inflight: Option<u32>,
    /// Engine-reported load, when fresh.
    pub engine: Option<EngineLoad>,
    /// Picked, lost (and why), saturated or excluded (and why).
    pub standing: Standing,
}

/// A decision: what was understood, how every worker stood, the pick and (when booking) the
/// booking that holds its in-flight slot.
#[derive(Debug)]
pub struct Decision {
    /// What kv-epp derived from the request.
    pub request: Understood,
    /// Every worker, in the list's order, when explaining; only the pick when booking.
    pub candidates: Vec<CandidateReport>,
    /// The picked worker.
    pub pick: WorkerId,
    /// Ordered fallbacks.
    pub fallbacks: Vec<WorkerId>,
    /// Prompt blocks credited as cached on the pick (device + credited offload).
    pub cached_blocks: f64,
    /// The in-flight slot on the pick (`None` from [`explain`]).
    pub booking: Option<Booking>,
}

impl Decision {
    /// The value for `x-gateway-destination-endpoint` and the `envoy.lb` metadata: the pick,
    /// then the fallbacks.
    pub fn destination(&self) -> String {
        std::iter::once(&self.pick)
            .chain(&self.fallbacks)
            .map(|w| w.endpoint.to_string())
            .collect::<Vec<_>>()
            .join(",")
    }

    /// The `model` label of metrics: the base model, or `unknown`.
    pub(crate) fn model_label(&self) -> &str {
        self.request.model.base.as_deref().unwrap_or("unknown")
    }
}

/// What the ext_proc edge keeps of a decision once it has answered: the booking and a
/// fixed-size summary, published to Envoy as the `kv-epp` dynamic metadata (for access logs) —
/// never the tokens, hashes or per-worker reports, which a long-lived stream must not hold.
#[derive(Debug)]
pub struct Routed {
    /// The in-flight slot on the pick (released when the stream ends).
    pub booking: Option<Booking>,
    /// The picked worker.
    pub pick: WorkerId,
    /// The `model` label of metrics: the base model, or `unknown`.
    pub model_label: String,
    /// The salt's fingerprint, when the request carried a salt.
    pub salt: Option<Fingerprint>,
    /// Prompt tokens, when the request had or was given token IDs.
    pub prompt_tokens: Option<usize>,
    /// Complete prompt blocks.
    pub prompt_blocks: u32,
    /// Blocks credited as cached on the pick.
    pub cached_blocks: f64,
    /// [`tokens_digest`] of the prompt's token IDs.
    pub tokens_digest: Option<u64>,
    /// The last block's sequence hash: it chains every block before it, so two paths that agree
    /// on it agree on every block hash.
    pub prefix_hash: Option<SequenceHash>,
}

/// A digest of a prompt's token IDs (XXH3-64 over their little-endian bytes): equal digests mean
/// equal token IDs, partial last block included, without keeping the tokens.
pub fn tokens_digest(tokens: &[u32]) -> u64 {
    kv_epp_core::hashing::xxh3_64_tokens(tokens, 0)
}

impl Decision {
    /// The summary the ext_proc edge keeps; the rest of the decision is dropped.
    pub fn into_routed(self) -> Routed {
        let r = &self.request;
        Routed {
            model_label: self.model_label().to_owned(),
            salt: r.salt.as_ref().map(Salt::fingerprint),
            prompt_tokens: r.tokens.as_ref().map(Vec::len),
            prompt_blocks: r.prompt_blocks(),
            tokens_digest: r.tokens.as_deref().map(tokens_digest),
            prefix_hash: r.hashes.sequence.last().copied(),
            cached_blocks: self.cached_blocks,
            pick: self.pick,
            booking: self.booking,
        }
    }
}

/// Resolves a salt from its inputs under the picker's policy, with its fingerprint.
pub(crate) fn resolve_salt(
    picker: &Picker,
    inputs: &SaltInputs<'_>,
) -> Result<Option<Salt>, Reject> {
    Ok(resolve(inputs, &picker.policy.salt)?.map(|r| Salt {
        fingerprint: r.salt.fingerprint(&picker.policy.fingerprints),
        value: r.salt,
        source: r.source,
    }))
}

/// The block hashes of `tokens` for a served base model under a salt and adapter (`None` when
/// `base` is not served).
pub(crate) fn hash_prompt(
    picker: &Picker,
    base: &str,
    lora: Option<&str>,
    salt: Option<&Salt>,
    tokens: &[u32],
) -> Option<PromptHashes> {
    let block_size = picker.models.get(base)?.block_size();
    let seed = seed_for(salt.map(Salt::cache_salt), lora);
    let (local, sequence) = prompt_hashes(tokens, block_size, seed);
    Some(PromptHashes {
        block_size,
        local,
        sequence,
    })
}

/// The worker-independent part: body → salt → model → tokens → prompt limit → hashes →
/// forwarded body.
///
/// Errors: [`Reject::BadRequest`], [`Reject::BadSalt`], [`Reject::UnknownModel`] /
/// [`Reject::BadPrompt`] (tokenizer refusals), [`Reject::PromptTooLong`]. A tokenizer failure on
/// kv-epp's side is not a refusal: it is reported in [`Understood::tokenize_failure`].
pub fn understand(picker: &Picker, parts: &RequestParts<'_>) -> Result<Understood, Reject> {
    understand_parsed(picker, parts, None)
}

/// [`understand`] for a body the edge already parsed: `ahead` is what [`request::parse`] gave
/// for `parts.body` (`None`: parse it here). Same errors.
pub(crate) fn understand_parsed(
    picker: &Picker,
    parts: &RequestParts<'_>,
    ahead: Option<Result<ParsedBody, RequestError>>,
) -> Result<Understood, Reject> {
    let mut parsed = match parts.body {
        None | Some([]) => None,
        Some(bytes) => Some(match ahead {
            Some(parsed) => parsed?,
            None => request::parse(bytes)?,
        }),
    };
    let salt = resolve_salt(
        picker,
        &SaltInputs {
            header: parts.tenant,
            nvext: parsed.as_ref().map(|p| p.nvext_salt()).unwrap_or_default(),
            body: parsed.as_ref().map(|p| p.body_salt()).unwrap_or_default(),
        },
    )?;
    let named = parsed.as_ref().and_then(|p| p.model.clone());
    let resolved = named.as_deref().and_then(|m| picker.models.resolve(m));
    let model = ModelRef {
        named: named.clone(),
        base: resolved.map(|r| r.model.name().to_owned()),
        lora: resolved.and_then(|r| r.lora.map(str::to_owned)),
    };
    let mut tokenize_failure = None;
    let mut unrenderable = None;
    let tokens = match (parsed.as_mut().map(ParsedBody::take_prompt), parts.body) {
        (Some(Prompt::TokenIds(t)), _) => Some(t),
        (Some(_), Some(bytes)) => {
            match resolved.and_then(|r| r.model.tokenize(parts.path, bytes)) {
                None => None,
                Some(Ok(t)) => Some(t),
                Some(Err(TokenizeError::UnknownModel(m))) => return Err(Reject::UnknownModel(m)),
                Some(Err(TokenizeError::PromptTooLong { at_least, max })) => {
                    return Err(Reject::PromptTooLong {
                        model: model.base.clone().unwrap_or_default(),
                        tokens: at_least,
                        max,
                    });
                }
                Some(Err(error))
                    if error.unrenderable().is_some()
                        && picker.policy.unrenderable == UnrenderableRequests::LoadOnly =>
                {
                    // The engine may accept what kv-epp cannot render exactly: let it decide,
                    // routing on load alone (no prefix credit from a prompt we would get wrong).
                    unrenderable = Some(error);
                    None
                }
                Some(Err(error)) if error.is_client_error() => {
                    return Err(Reject::BadPrompt {
                        model: model.base.clone().unwrap_or_default(),
                        error,
                    });
                }
                Some(Err(e)) => {
                    // Our failure, not the client's: route on load alone rather than refuse.
                    tokenize_failure = Some(e);
                    None
                }
            }
        }
        _ => None,
    };
    if let (Some(t), Some(base)) = (&tokens, &model.base)
        && let Some(max) = picker.models.get(base).and_then(|m| m.max_prompt_tokens())
        && t.len() > max
    {
        return Err(Reject::PromptTooLong {
            model: base.clone(),
            tokens: t.len(),
            max,
        });
    }
    let hashes = match (&model.base, &tokens) {
        (Some(base), Some(t)) => {
            hash_prompt(picker, base, model.lora.as_deref(), salt.as_ref(), t).unwrap_or_default()
        }
        _ => PromptHashes::default(),
    };
    // The engine must cache under the namespace we hashed with: the forwarded salt goes in its
    // field and client salt fields go; otherwise the body goes through untouched.
    let rewritten_body = match (&parsed, parts.body) {
        (Some(p), Some(bytes)) => {
            let forwarded = salt.as_ref().map(|s| Namespace::of(&s.value).forwarded());
            // Nothing to set and no salt member to remove: the body goes as it came, unscanned.
            if forwarded.is_none() && !p.has_salt_member() {
                None
            } else {
                rewrite_salt(bytes, forwarded.as_deref())
            }
        }
        _ => None,
    };
    Ok(Understood {
        path: parts.path.to_owned(),
        model,
        salt,
        tokens,
        hashes,
        rewritten_body,
        tokenize_failure,
        unrenderable,
        max_output_tokens: parsed.as_ref().and_then(|p| p.max_tokens),
    })
}

/// Decides and books a worker: the request path of the ext_proc edge.
///
/// Errors: every [`Reject`] except [`Reject::BodyTooLarge`] (the edge's own).
pub fn decide(picker: &Picker, parts: &RequestParts<'_>) -> Result<Decision, Reject> {
    let request = understand(picker, parts)?;
    choose(picker, request, parts, true)
}

/// The decision [`decide`] would take now, without booking and without advancing the decision
/// count: in-flight counts are unchanged. Same errors as [`decide`].
pub fn explain(picker: &Picker, parts: &RequestParts<'_>) -> Result<Decision, Reject> {
    let request = understand(picker, parts)?;
    choose(picker, request, parts, false)
}

/// [`decide`] for a request already [`understand`]ood, so the edge can account for what
/// understanding found (a tokenizer failure on kv-epp's side) even when the decision is refused.
pub fn decide_understood(
    picker: &Picker,
    request: Understood,
    parts: &RequestParts<'_>,
) -> Result<Decision, Reject> {
    choose(picker, request, parts, true)
}

fn choose(
    picker: &Picker,
    request: Understood,
    parts: &RequestParts<'_>,
    book: bool,
) -> Result<Decision, Reject> {
    let booked = choose_ref(picker, &request, parts, book, None)?;
    Ok(booked.into_decision(request))
}

/// A booking made for a request that is still borrowed (flow control offers capacity to a
/// queued request without taking it out of its queue until the booking succeeds).
#[derive(Debug)]
pub struct Booked {
    candidates: Vec<CandidateReport>,
    decision: kv_epp_core::scoring::Decision,
    booking: Option<Booking>,
}

impl Booked {
    /// The whole decision, once the request can be given up.
    pub fn into_decision(self, request: Understood) -> Decision {
        Decision {
            request,
            candidates: self.candidates,
            pick: self.decision.primary.candidate.worker,
            fallbacks: self.decision.fallbacks,
            cached_blocks: self.decision.primary.cached_blocks,
            booking: self.booking,
        }
    }
}

/// Tries to decide and book for `request` without consuming it: the queued request's path.
/// `hold` sees the affinity gap (how many more prompt blocks a saturated candidate holds than
/// the pick, see [`kv_epp_core::scoring::affinity_gap`]) and answers whether to
/// wait for that worker instead; waiting is answered [`Reject::Saturated`] and books nothing.
pub fn try_book(
    picker: &Picker,
    request: &Understood,
    parts: &RequestParts<'_>,
    hold: &dyn Fn(f64) -> bool,
) -> Result<Booked, Reject> {
    choose_ref(picker, request, parts, true, Some(hold))
}

thread_local! {
    /// `choose_ref`'s overlap rows, kept between requests.
    static OVERLAPS: std::cell::RefCell<Vec<kv_epp_core::index::Overlap>> =
        const { std::cell::RefCell::new(Vec::new()) };
}

fn choose_ref(
    picker: &Picker,
    request: &Understood,
    parts: &RequestParts<'_>,
    book: bool,
    hold: Option<&dyn Fn(f64) -> bool>,
) -> Result<Booked, Reject> {
    let base = request.model.base.as_deref();
    if base.is_none() && picker.policy.unknown_model == UnknownModel::Reject {
        return Err(Reject::UnknownModel(
            request.model.named.clone().unwrap_or_default(),
        ));
    }
    let seqs = &request.hashes.sequence;
    // The overlaps go into this thread's buffer (no allocation per request once warm), sorted
    // by worker so each candidate finds its row by binary search, not by a scan of every row
    // (with every worker holding a shared system prompt, a scan per worker is workers²).
    let mut overlaps = OVERLAPS.with(|b| std::mem::take(&mut *b.borrow_mut()));
    match base.and_then(|b| picker.models.index(b)) {
        Some(index) if !seqs.is_empty() => index.query_into(seqs, &mut overlaps),
        _ => overlaps.clear(),
    }
    overlaps.sort_unstable_by_key(|o| o.worker);
    // Refusals are labelled with the served base model only: a client-chosen `model` string
    // must not mint metric series.
    let named = request.model.base.clone();
    let scope = if parts.subset.is_some() || parts.conformance.is_some() {
        " in the requested subset"
    } else {
        ""
    };
    let picked = picker.workers.with(|workers| {
        let mut rows: Vec<(&Arc<WorkerRuntime>, Candidate, Option<Exclusion>)> = workers
            .iter()
            .map(|w| {
                let o = overlaps
                    .binary_search_by_key(&w.id, |o| o.worker)
                    .ok()
                    .map(|i| &overlaps[i]);
                let candidate = Candidate {
                    worker: w.id,
                    device_blocks: o.map_or(0, |o| o.device_blocks),
                    total_blocks: o.map_or(0, |o| o.total_blocks),
                    inflight: w.inflight(),
                    max_inflight: picker.policy.max_inflight,
                    engine: w.engine_load(),
                };
                (w, candidate, exclusion(w, base, parts))
            })
            .collect();
        prefer_conformance_order(&mut rows, parts.conformance);
        let eligible: Vec<Candidate> = rows
            .iter()
            .filter(|(_, _, ex)| ex.is_none())
            .map(|(_, c, _)| *c)
            .collect();
        if eligible.is_empty() {
            return Err(Reject::NoEndpoints {
                model: named.clone(),
                scope,
            });
        }
        let n = picker.decision_number(book);
        // With no prompt blocks, spread by decision count; otherwise keep identical prefixes
        // together.
        let key = seqs
            .first()
            .map_or(n.wrapping_mul(0x9e37_79b9_7f4a_7c15), |s| s.0);
        let mut rng = SmallRng::seed_from_u64(key ^ n);
        let blocks = request.prompt_blocks();
        let cfg = &picker.policy.scoring;
        let d = pick(&eligible, blocks, key, cfg, &mut rng).map_err(|e| match e {
            PickError::NoCandidates => Reject::NoEndpoints {
                model: named.clone(),
                scope: "",
            },
            PickError::AllSaturated => Reject::Saturated {
                model: named.clone(),
            },
        })?;
        if let Some(hold) = hold {
            let gap = affinity_gap(&eligible, &d.primary, blocks, cfg);
            if gap > 0.0 && hold(gap) {
                return Err(Reject::Saturated {
                    model: named.clone(),
                });
            }
        }
        let pick_id = d.primary.candidate.worker;
        let booking = match rows
            .iter()
            .find(|(w, _, ex)| ex.is_none() && w.id == pick_id)
        {
            Some((w, _, _)) => book.then(|| picker.workers.book(w)),
            None => {
                return Err(Reject::NoEndpoints {
                    model: named.clone(),
                    scope: "",
                });
            }
        };
        // A booked decision reports only its pick: the per-worker reports (an allocation and a
        // score per worker) are for explaining, not for every request.
        let reports = rows
            .iter()
            .filter(|(w, _, _)| !book || w.id == pick_id)
            .map(|(w, c, ex)| CandidateReport {
                worker: w.id,
                model: w.model.clone(),
                device_blocks: c.device_blocks,
                total_blocks: c.total_blocks,
                inflight: c.inflight,
                max_inflight: c.max_inflight,
                engine: c.engine,
                standing: standing(c, *ex, &d.primary, blocks, cfg),
            })
            .collect();
        Ok((reports, d, booking))
    });
    OVERLAPS.with(|b| *b.borrow_mut() = overlaps);
    let (candidates, decision, booking) = picked?;
    Ok(Booked {
        candidates,
        decision,
        booking,
    })
}

/// The constraints a worker must meet to be a candidate, in order.
fn exclusion(w: &WorkerRuntime, base: Option<&str>, parts: &RequestParts<'_>) -> Option<Exclusion> {
    if !w.is_ready() {
        Some(Exclusion::NotReady)
    } else if base.is_some_and(|b| w.model != b) {
        Some(Exclusion::OtherModel)
    } else if parts.subset.is_some_and(|s| !s.contains(&w.id.endpoint)) {
        Some(Exclusion::OutsideSubset)
    } else if parts
        .conformance
        .is_some_and(|ips| !ips.contains(&w.id.endpoint.ip()))
    {
        Some(Exclusion::NotInConformanceList)
    } else {
        None
    }
}

/// The conformance suite's order is authoritative: of the remaining candidates, only those on
/// the first listed IP that has any stay candidates.
fn prefer_conformance_order(
    rows: &mut [(&Arc<WorkerRuntime>, Candidate, Option<Exclusion>)],
    order: Option<&[IpAddr]>,
) {
    let Some(order) = order else { return };
    let first = order.iter().find(|ip| {
        rows.iter()
            .any(|(w, _, ex)| ex.is_none() && w.id.endpoint.ip() == **ip)
    });
    if let Some(&ip) = first {
        for (w, _, ex) in rows.iter_mut() {
            if ex.is_none() && w.id.endpoint.ip() != ip {
                *ex = Some(Exclusion::ConformanceOrder(ip));
            }
        }
    }
}

fn standing(
    c: &Candidate,
    excluded: Option<Exclusion>,
    primary: &Scored,
    blocks: u32,
    cfg: &ScoringConfig,
) -> Standing {
    if let Some(ex) = excluded {
        return Standing::Excluded(ex);
    }
    // The same formula the pick used (scoring owns it), evaluated for the record.
    let s = score(c, blocks, cfg);
    if c.saturated() {
        Standing::Saturated(s)
    } else if c.worker == primary.candidate.worker {
        Standing::Picked(*primary)
    } else if cfg.temperature > 0.0 {
        Standing::Lost(
            s,
            Loss::NotSampled {
                temperature: cfg.temperature,
            },
        )
    } else if s.cost > primary.cost {
        Standing::Lost(s, Loss::HigherCost(s.cost - primary.cost))
    } else if c.inflight > primary.candidate.inflight {
        Standing::Lost(s, Loss::MoreInFlight)
    } else {
        Standing::Lost(s, Loss::TieBreak)
    }
}

#[cfg(test)]
mod tests;
