//! The admin HTTP API (default port 9091): the standalone query API and worker status.
//!
//! - `POST /query` `{"model", "token_ids", "lora_name"?, "cache_salt"?}`: kv-epp hashes the tokens
//!   itself under the salt (resolved by the same rules as ext_proc, including `x-tenant-id`) and
//!   answers each worker's overlap in tokens, per data-parallel rank and per tier.
//! - `POST /query_by_hash` `{"model", "block_hashes": [i64 or u64...], "lora_name"?}`: local block hashes
//!   the caller already computed with the intended salt (i64 on the wire, read as u64). Any
//!   non-null `cache_salt` field, even `""`, is a 400: the hashes already carry the salt.
//! - `POST /explain` `{"path", "headers"?: {"x-tenant-id": "..." | [...]}, "body"?, "subset"?}`:
//!   the decision ext_proc would take for that request now (the same pipeline,
//!   [`crate::decide::explain`]), without booking: model, salt fingerprint, tokens and hashes,
//!   and per worker its overlap, load inputs, score terms and why it was not picked. Refusals get
//!   the status, reason header and body ext_proc would send.
//! - `GET /workers`: per worker, readiness, in-flight requests, event feed state and blocks held.
//! - `GET /debug/digest`: per model, an order-independent digest of the index (no salts), so
//!   replicas can be checked for convergence from outside.
//! - `GET /debug/replica`: this instance, its peers, owners and relay positions.
//! - `GET /debug/queues`: flow control's queue: totals, and each queued tenant by fingerprint
//!   (band, weight, depth, bytes, virtual work counter, oldest wait, in flight).
//! - `GET /healthz` ([`LIVENESS_PATH`]): `ok` while the process serves; the one route open
//!   without the admin token (`server.rs` puts the others behind `crate::auth`).
//!
//! Bodies are limited to [`MAX_BODY`] bytes; every error is a 4xx with a JSON reason. Salts never
//! appear in responses.

use std::sync::Arc;

use axum::extract::{DefaultBodyLimit, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router as HttpRouter};
use serde::Deserialize;
use serde_json::{Value, json};

use crate::decide::{self, Decision, Picker, Reject, RequestParts, Standing};
use crate::events::Feeds;
use crate::events::subscriber::{FeedEndpoints, FeedStatus};
use crate::events::trtllm::PollStatus;
use kv_epp_core::hashing::{LocalBlockHash, SequenceHash, sequence_hashes};
use kv_epp_core::index::Overlap;
use kv_epp_core::salt::{SaltField, SaltInputs, TENANT_HEADER};
use kv_epp_core::worker::WorkerId;

/// Largest request body accepted.
pub const MAX_BODY: usize = 8 << 20;

/// The liveness route, answered without a token.
pub const LIVENESS_PATH: &str = "/healthz";

/// Shared state of the admin API.
#[derive(Clone)]
pub struct AdminState {
    /// The request pipeline's state (models, indexes, workers, policy).
    pub picker: Arc<Picker>,
    /// The event feeds.
    pub feeds: Arc<Feeds>,
    /// Replication, when configured.
    pub replica: Option<Arc<crate::replica::ReplicaState>>,
    /// ext_proc's `routing.max_body_bytes`: `/explain` refuses larger bodies as ext_proc would.
    pub max_body_bytes: usize,
    /// ext_proc's `routing.retry_after_seconds`, sent with refusals the client may retry.
    pub retry_after_seconds: u32,
    /// Flow control, for `/debug/queues`.
    pub flow: Option<Arc<crate::flow::FlowControl>>,
}

/// The admin HTTP routes.
pub fn routes(state: AdminState) -> HttpRouter {
    HttpRouter::new()
        .route("/query", post(query))
        .route("/query_by_hash", post(query_by_hash))
        .route("/explain", post(explain))
        .route("/workers", get(workers))
        .route("/debug/digest", get(digest))
        .route("/debug/replica", get(replica))
        .route("/debug/queues", get(queues))
        .route(LIVENESS_PATH, get(|| async { "ok" }))
        .layer(DefaultBodyLimit::max(MAX_BODY))
        .layer(axum::Extension(Arc::new(Heavy::default())))
        .with_state(state)
}

async fn queues(State(st): State<AdminState>) -> Response {
    match &st.flow {
        Some(flow) => Json(flow.debug()).into_response(),
        None => Json(json!({"enabled": false, "queued": 0, "tenants": []})).into_response(),
    }
}

/// A 4xx answer with a JSON reason.
struct ApiError(StatusCode, String);

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        (
            self.0,
            Json(json!({"error": {"message": self.1, "code": self.0.as_u16()}})),
        )
            .into_response()
    }
}

fn error(status: StatusCode, message: impl Into<String>) -> ApiError {
    ApiError(status, message.into())
}

/// A refusal of the request pipeline, answered exactly as the ext_proc edge answers it: same
/// status, same headers (`x-llm-d-request-dropped-reason`, `Retry-After`), same JSON body.
fn refusal(reject: &Reject, retry_after_seconds: u32) -> Response {
    let status = StatusCode::from_u16(reject.status()).unwrap_or(StatusCode::BAD_REQUEST);
    let mut response = (status, Json(reject.body())).into_response();
    for (name, value) in reject.headers(retry_after_seconds) {
        if let Ok(v) = axum::http::HeaderValue::from_str(&value) {
            response.headers_mut().insert(name, v);
        }
    }
    response
}

fn parse<T: for<'de> Deserialize<'de>>(body: &[u8]) -> Result<T, ApiError> {
    serde_json::from_slice(body)
        .map_err(|e| error(StatusCode::BAD_REQUEST, format!("invalid JSON body: {e}")))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct QueryRequest {
    #[serde(alias = "model_name")]
    model: String,
    token_ids: Vec<u32>,
    #[serde(default)]
    lora_name: Option<String>,
    #[serde(default)]
    cache_salt: Option<Value>,
}

/// A block hash on the wire: i64 as Dynamo's API sends it, or u64 as `/explain` and `kv-epp
/// tokenize` print it; both are the same 64 bits.
#[derive(Deserialize)]
#[serde(untagged)]
enum WireHash {
    Unsigned(u64),
    Signed(i64),
}

impl WireHash {
    fn bits(&self) -> u64 {
        match *self {
            WireHash::Unsigned(u) => u,
            WireHash::Signed(i) => i as u64,
        }
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct QueryByHashRequest {
    #[serde(alias = "model_name")]
    model: String,
    block_hashes: Vec<WireHash>,
    #[serde(default)]
    lora_name: Option<String>,
    #[serde(default)]
    cache_salt: Option<Value>,
}

/// Resolves the model name (or adapter) to its base model and adapter.
fn model_of<'a>(
    picker: &'a Picker,
    model: &'a str,
    lora: Option<&'a str>,
) -> Result<(&'a str, Option<&'a str>), ApiError> {
    let r = picker.models.resolve(model).ok_or_else(|| {
        error(
            StatusCode::NOT_FOUND,
            format!("model `{model}` is not served here"),
        )
    })?;
    Ok((r.model.name(), r.lora.or(lora.filter(|l| !l.is_empty()))))
}

fn answer(picker: &Picker, base: &str, blocks: usize, overlaps: Vec<Overlap>) -> Response {
    let block_size = picker.models.get(base).map_or(0, |m| m.block_size()) as u64;
    let mut scores = serde_json::Map::new();
    let mut instances = Vec::new();
    for o in &overlaps {
        let endpoint = o.worker.endpoint.to_string();
        let entry = scores
            .entry(endpoint.clone())
            .or_insert_with(|| Value::Object(Default::default()));
        if let Value::Object(m) = entry {
            m.insert(
                o.worker.dp_rank.to_string(),
                json!(u64::from(o.total_blocks) * block_size),
            );
        }
        instances.push(json!({
            "worker": endpoint,
            "dp_rank": o.worker.dp_rank,
            "overlap_tokens": u64::from(o.total_blocks) * block_size,
            "tiers": {
                "device_tokens": u64::from(o.device_blocks) * block_size,
                "total_tokens": u64::from(o.total_blocks) * block_size,
            },
        }));
    }
    Json(json!({
        "model": base,
        "block_size": block_size,
        "prompt_blocks": blocks,
        "scores": scores,
        "instances": instances,
    }))
    .into_response()
}

/// Admin requests doing a request's work (parsing a large body, tokenizing, hashing, querying):
/// one runs at a time, a few more may wait for their turn, and the rest are answered 503.
struct Heavy {
    run: Arc<tokio::sync::Semaphore>,
    waiting: tokio::sync::Semaphore,
}

impl Default for Heavy {
    fn default() -> Self {
        Heavy {
            run: Arc::new(tokio::sync::Semaphore::new(1)),
            // Each waiting request holds its body (at most `MAX_BODY`).
            waiting: tokio::sync::Semaphore::new(8),
        }
    }
}

/// Runs an admin request's work off the I/O threads, one at a time: an operator's `/explain`
/// of a multi-MiB chat must not stall ext_proc streams or health probes, which share those
/// threads. The turn goes with the work, which runs to its end even when the client has left,
/// so at most one runs whatever clients do.
async fn off_io(heavy: &Heavy, work: impl FnOnce() -> Response + Send + 'static) -> Response {
    let busy = || {
        error(
            StatusCode::SERVICE_UNAVAILABLE,
            "too many /query, /query_by_hash or /explain calls at once; try again",
        )
        .into_response()
    };
    let Ok(_waiting) = heavy.waiting.try_acquire() else {
        return busy();
    };
    let Ok(turn) = heavy.run.clone().acquire_owned().await else {
        return busy();
    };
    let work = move || {
        let _turn = turn;
        work()
    };
    match tokio::task::spawn_blocking(work).await {
        Ok(response) => response,
        Err(_) => error(StatusCode::INTERNAL_SERVER_ERROR, "the request failed").into_response(),
    }
}

async fn query(
    State(s): State<AdminState>,
    axum::Extension(heavy): axum::Extension<Arc<Heavy>>,
    headers: HeaderMap,
    body: axum::body::Bytes,
) -> Response {
    off_io(&heavy, move || query_now(&s, &headers, &body)).await
}

fn query_now(s: &AdminState, headers: &HeaderMap, body: &[u8]) -> Response {
    let req: QueryRequest = match parse(body) {
        Ok(r) => r,
        Err(e) => return e.into_response(),
    };
    let (base, lora) = match model_of(&s.picker, &req.model, req.lora_name.as_deref()) {
        Ok(m) => m,
        Err(e) => return e.into_response(),
    };
    // As ext_proc: a prompt over the model's limit is refused before it is hashed.
    if let Some(max) = s
        .picker
        .models
        .get(base)
        .and_then(|m| m.max_prompt_tokens())
        && req.token_ids.len() > max
    {
        let too_long = Reject::PromptTooLong {
            model: base.to_owned(),
            tokens: req.token_ids.len(),
            max,
        };
        return refusal(&too_long, s.retry_after_seconds);
    }
    let tenant: Vec<&[u8]> = headers
        .get_all(TENANT_HEADER)
        .iter()
        .map(|v| v.as_bytes())
        .collect();
    let body_salt = match &req.cache_salt {
        None | Some(Value::Null) => SaltField::Absent,
        Some(Value::String(st)) => SaltField::Str(st),
        Some(_) => SaltField::NotString,
    };
    let inputs = SaltInputs {
        header: &tenant,
        nvext: SaltField::Absent,
        body: body_salt,
    };
    let salt = match decide::resolve_salt(&s.picker, &inputs) {
        Ok(salt) => salt,
        Err(e) => return refusal(&e, s.retry_after_seconds),
    };
    let Some(index) = s.picker.models.index(base) else {
        return error(StatusCode::NOT_FOUND, "model has no index").into_response();
    };
    let seqs = decide::hash_prompt(&s.picker, base, lora, salt.as_ref(), &req.token_ids)
        .map(|h| h.sequence)
        .unwrap_or_default();
    let overlaps = index.query(&seqs);
    answer(&s.picker, base, seqs.len(), overlaps)
}

/// A header value in `/explain`: one string or several.
#[derive(Deserialize)]
#[serde(untagged)]
enum HeaderValues {
    One(String),
    Many(Vec<String>),
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ExplainRequest {
    path: String,
    #[serde(default)]
    headers: std::collections::BTreeMap<String, HeaderValues>,
    /// Kept as sent: key order reaches the chat template (`tojson`), so the body must not be
    /// re-serialized.
    #[serde(default)]
    body: Option<Box<serde_json::value::RawValue>>,
    /// The gateway's subset hint, `ip:port` each.
    #[serde(default)]
    subset: Option<Vec<std::net::SocketAddr>>,
}

/// `POST /explain`: the decision ext_proc would take for this request now, without booking.
async fn explain(
    State(s): State<AdminState>,
    axum::Extension(heavy): axum::Extension<Arc<Heavy>>,
    body: axum::body::Bytes,
) -> Response {
    off_io(&heavy, move || explain_now(&s, &body)).await
}

fn explain_now(s: &AdminState, body: &[u8]) -> Response {
    let req: ExplainRequest = match parse(body) {
        Ok(r) => r,
        Err(e) => return e.into_response(),
    };
    let tenant: Vec<&[u8]> = req
        .headers
        .iter()
        .filter(|(name, _)| name.eq_ignore_ascii_case(TENANT_HEADER))
        .flat_map(|(_, v)| match v {
            HeaderValues::One(one) => std::slice::from_ref(one),
            HeaderValues::Many(many) => many.as_slice(),
        })
        .map(|v| v.as_bytes())
        .collect();
    let body = req.body.as_ref().map(|b| b.get().as_bytes());
    if body.is_some_and(|b| b.len() > s.max_body_bytes) {
        let too_large = Reject::BodyTooLarge {
            limit: s.max_body_bytes,
        };
        return refusal(&too_large, s.retry_after_seconds);
    }
    let parts = RequestParts {
        path: &req.path,
        tenant: &tenant,
        body,
        subset: req.subset.as_deref(),
        conformance: None,
    };
    match decide::explain(&s.picker, &parts) {
        Ok(d) => Json(explanation(&d, &FeedStates::of(&s.feeds))).into_response(),
        Err(reject) => refusal(&reject, s.retry_after_seconds),
    }
}

/// The JSON of an explained decision, with each candidate's event feed. Token counts are blocks ×
/// block size; the salt appears as its source and fingerprint only.
fn explanation(d: &Decision, feeds: &FeedStates) -> Value {
    let r = &d.request;
    let bs = r.hashes.block_size as u64;
    let candidates: Vec<Value> = d
        .candidates
        .iter()
        .map(|c| {
            let (status, scored, why) = match &c.standing {
                Standing::Picked(s) => ("picked", Some(s), None),
                Standing::Lost(s, loss) => ("lost", Some(s), Some(loss.to_string())),
                Standing::Saturated(s) => (
                    "saturated",
                    Some(s),
                    Some(format!(
                        "at its in-flight limit ({} of {})",
                        c.inflight,
                        c.max_inflight.unwrap_or_default()
                    )),
                ),
                Standing::Excluded(ex) => ("excluded", None, Some(ex.to_string())),
            };
            json!({
                "worker": c.worker.endpoint.to_string(),
                "dp_rank": c.worker.dp_rank,
                "model": c.model,
                "overlap": {
                    "device_tokens": u64::from(c.device_blocks) * bs,
                    "total_tokens": u64::from(c.total_blocks) * bs,
                    "device_blocks": c.device_blocks,
                    "total_blocks": c.total_blocks,
                },
                "load": {
                    "inflight": c.inflight,
                    "max_inflight": c.max_inflight,
                    "engine": c.engine.map(|e| json!({
                        "running": e.running,
                        "waiting": e.waiting,
                        "kv_usage": e.kv_usage,
                    })),
                },
                "score": scored.map(|s| json!({
                    "prefix": s.terms.prefix,
                    "queue": s.terms.queue,
                    "kv_usage": s.terms.kv_usage,
                    "total": s.cost,
                    "queue_length": s.terms.queue_length,
                    "cached_blocks": s.cached_blocks,
                })),
                "status": status,
                "why": why,
                "events": feeds.json(&c.worker),
            })
        })
        .collect();
    json!({
        "path": r.path,
        "model": r.model.named,
        "base_model": r.model.base,
        "lora_name": r.model.lora,
        "salt": r.salt.as_ref().map(|s| json!({
            "source": s.source().as_str(),
            "fingerprint": s.fingerprint().to_string(),
        })),
        "block_size": r.hashes.block_size,
        "prompt_tokens": r.tokens.as_ref().map(Vec::len),
        "prompt_blocks": r.prompt_blocks(),
        "token_ids": r.tokens,
        "local": r.hashes.local.iter().map(|h| h.0).collect::<Vec<_>>(),
        "sequence": r.hashes.sequence.iter().map(|h| h.0).collect::<Vec<_>>(),
        "tokenize_failure": r.tokenize_failure.as_ref().map(ToString::to_string),
        "unrenderable": r.unrenderable_reason(),
        "pick": d.pick.endpoint.to_string(),
        "pick_dp_rank": d.pick.dp_rank,
        "fallbacks": d.fallbacks.iter().map(|w| w.endpoint.to_string()).collect::<Vec<_>>(),
        "cached_blocks": d.cached_blocks,
        "candidates": candidates,
    })
}

async fn query_by_hash(
    State(s): State<AdminState>,
    axum::Extension(heavy): axum::Extension<Arc<Heavy>>,
    body: axum::body::Bytes,
) -> Response {
    off_io(&heavy, move || query_by_hash_now(&s, &body)).await
}

fn query_by_hash_now(s: &AdminState, body: &[u8]) -> Response {
    let req: QueryByHashRequest = match parse(body) {
        Ok(r) => r,
        Err(e) => return e.into_response(),
    };
    if !matches!(req.cache_salt, None | Some(Value::Null)) {
        return error(
            StatusCode::BAD_REQUEST,
            "cache_salt is not accepted by /query_by_hash: the block hashes must already be salted",
        )
        .into_response();
    }
    let (base, _) = match model_of(&s.picker, &req.model, req.lora_name.as_deref()) {
        Ok(m) => m,
        Err(e) => return e.into_response(),
    };
    let Some(index) = s.picker.models.index(base) else {
        return error(StatusCode::NOT_FOUND, "model has no index").into_response();
    };
    let locals: Vec<LocalBlockHash> = req
        .block_hashes
        .iter()
        .map(|h| LocalBlockHash(h.bits()))
        .collect();
    let seqs: Vec<SequenceHash> = sequence_hashes(&locals);
    let overlaps = index.query(&seqs);
    answer(&s.picker, base, seqs.len(), overlaps)
}

async fn digest(State(s): State<AdminState>) -> Response {
    let mut models = serde_json::Map::new();
    for name in s.picker.models.names() {
        if let Some(index) = s.picker.models.index(&name) {
            let (digest, blocks) = index.digest();
            models.insert(
                name,
                json!({"digest": format!("{digest:016x}"), "blocks": blocks, "pairs": index.pairs()}),
            );
        }
    }
    Json(json!({ "models": models })).into_response()
}

/// Replication status: this instance, its peers, what it owns and the relay positions. Instance
/// ids are random per process and reveal nothing about tenants.
async fn replica(State(s): State<AdminState>) -> Response {
    let Some(r) = &s.replica else {
        return Json(json!({"enabled": false})).into_response();
    };
    let hex = |i: u64| format!("{i:016x}");
    let peers: Vec<Value> = r
        .members
        .view()
        .iter()
        .map(|m| json!({"addr": m.addr.to_string(), "instance": hex(m.instance), "ready": m.ready}))
        .collect();
    let refused: Vec<String> = r
        .members
        .refused()
        .iter()
        .map(ToString::to_string)
        .collect();
    let claims = r.hub.fencing.claims();
    let sources: Vec<Value> = s
        .feeds
        .single_readers()
        .iter()
        .map(|(w, _)| {
            let claim = claims.iter().find(|(c, _)| c == w).map(|(_, c)| c);
            json!({
                "worker": w.to_string(),
                "owner": r.owner_of(w).map(hex),
                // Under the Lease: whether its holder, lacking the worker, delegated it (to `owner`).
                "delegated": r.lease().is_some() && r.lease_for(w).is_none() && r.owner_of(w).is_some(),
                "polling": s.feeds.is_owned_here(w),
                "epoch": claim.map(|c| c.epoch),
                "claim_active": claim.is_some_and(|c| c.active),
            })
        })
        .collect();
    let relay: serde_json::Map<String, Value> = r
        .hub
        .positions()
        .into_iter()
        .map(|(o, n)| (hex(o), json!(n)))
        .collect();
    let c = &r.counters;
    let h = &r.hub.counters;
    Json(json!({
        "enabled": true,
        "instance": hex(r.instance),
        "ready": r.is_ready(),
        "token_refused": r.is_token_refused(),
        "peers": peers,
        "refused_by": refused,
        "single_reader_sources": sources,
        "coordination": if r.lease().is_some() { "lease" } else { "probes" },
        "lease": r.lease().map(|l| l.status()),
        // As the Lease's holder: the sources its pool lacks, and the peer each is delegated to.
        "delegations": r
            .delegations()
            .into_iter()
            .map(|(w, d)| json!({"worker": w, "owner": hex(d)}))
            .collect::<Vec<_>>(),
        "relay_positions": relay,
        "counters": {
            "snapshots_served": c.snapshots_served.get(),
            "blocks_restored": c.blocks_restored.get(),
            "unauthenticated": c.unauthenticated.get(),
            "relay_originated": h.originated.get(),
            "relay_applied": h.applied.get(),
            "relay_duplicates": h.duplicates.get(),
            "relay_resets": h.resets.get(),
            "relay_unplaced": h.unplaced.get(),
            "relay_caught_up": h.caught_up.get(),
            "relay_fenced": h.fenced.get(),
            "relay_foreign": h.foreign.get(),
            "refused_by_peers": r.metrics.replica_refused_by_peers.get(),
            "epochs_refused": r.metrics.replica_epochs_refused.get(),
        },
    }))
    .into_response()
}

/// Every worker's event feed as the admin API shows it (`/workers`, each `/explain` candidate): a
/// cold or disconnected feed explains a miss before any hash does.
struct FeedStates {
    zmq: Vec<(WorkerId, FeedEndpoints, Arc<FeedStatus>)>,
    polls: Vec<(WorkerId, Arc<PollStatus>)>,
}

impl FeedStates {
    fn of(feeds: &Feeds) -> FeedStates {
        FeedStates {
            zmq: feeds.statuses(),
            polls: feeds.poll_statuses(),
        }
    }

    fn json(&self, worker: &WorkerId) -> Option<Value> {
        use std::sync::atomic::Ordering::Relaxed;
        let zmq = self.zmq.iter().find(|(id, _, _)| id == worker);
        let feed = zmq.map(|(_, ep, st)| {
            json!({
                "events_endpoint": ep.events,
                "replay_endpoint": ep.replay,
                "connected": st.connected.load(Relaxed),
                "last_sequence": st.next_seq.load(Relaxed).checked_sub(1),
                "batches": st.batches.load(Relaxed),
                "cold": st.cold.load(Relaxed),
                "gaps": st.gaps.load(Relaxed),
                "replayed": st.replayed.load(Relaxed),
                "unfillable_gaps": st.unfillable.load(Relaxed),
                "restarts": st.restarts.load(Relaxed),
                "last_event_ms": st.last_event_ms.load(Relaxed),
                "failing": {
                    "connection": st.connection.reason(),
                    "replay": st.replay.reason(),
                    "decoding": st.decoding.reason(),
                },
                "counts": feed_counts(st),
            })
        });
        feed.or_else(|| {
            let (_, st) = self.polls.iter().find(|(id, _)| id == worker)?;
            Some(json!({
                "engine": "trtllm",
                "connected": st.connected.load(Relaxed),
                "polls": st.polls.load(Relaxed),
                "failures": st.failures.load(Relaxed),
                "applied": st.applied.load(Relaxed),
            }))
        })
    }
}

/// A feed's counters as nested objects: `{family: value}` or `{family: {label: ... value}}`.
fn feed_counts(st: &FeedStatus) -> Value {
    let mut out = serde_json::Map::new();
    for (family, labels, n) in st.counts() {
        let mut slot = out.entry(family).or_insert(Value::Null);
        for (_, label) in &labels {
            if !slot.is_object() {
                *slot = json!({});
            }
            slot = slot
                .as_object_mut()
                .expect("made an object above")
                .entry(*label)
                .or_insert(Value::Null);
        }
        *slot = json!(n);
    }
    Value::Object(out)
}

async fn workers(State(s): State<AdminState>) -> Response {
    let feeds = FeedStates::of(&s.feeds);
    let list: Vec<Value> = s
        .picker
        .workers
        .all()
        .iter()
        .map(|w| {
            let blocks = w.index().and_then(|i| i.worker_blocks(&w.id).ok());
            json!({
                "worker": w.id.endpoint.to_string(),
                "dp_rank": w.id.dp_rank,
                "model": w.model,
                "ready": w.is_ready(),
                "inflight": w.inflight(),
                "blocks": blocks,
                "events": feeds.json(&w.id),
            })
        })
        .collect();
    Json(json!({ "workers": list })).into_response()
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::{Arc, Mutex, mpsc};
    use std::time::Duration;

    use axum::http::StatusCode;
    use axum::response::{IntoResponse, Response};

    use super::{Heavy, off_io};

    /// Starts a call whose work runs until the returned sender sends (or is dropped), then
    /// answers 200; returns once the work runs.
    async fn start_held(
        heavy: &Arc<Heavy>,
    ) -> (tokio::task::JoinHandle<Response>, mpsc::Sender<()>) {
        let (started_tx, started) = mpsc::channel();
        let (release, release_rx) = mpsc::channel::<()>();
        let heavy = heavy.clone();
        let call = tokio::spawn(async move {
            off_io(&heavy, move || {
                let _ = started_tx.send(());
                let _ = release_rx.recv();
                StatusCode::OK.into_response()
            })
            .await
        });
        started
            .recv_timeout(Duration::from_secs(30))
            .expect("the work started");
        (call, release)
    }

    /// Waits (with a generous deadline, never a fixed sleep) until `ready` holds.
    async fn until(mut ready: impl FnMut() -> bool) {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
        while !ready() {
            assert!(
                tokio::time::Instant::now() < deadline,
                "condition not met in 30 s"
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_admin_turn_stays_with_its_work_when_the_client_leaves() {
        let heavy = Arc::new(Heavy::default());
        let (first, release) = start_held(&heavy).await;
        // The client of the first call leaves: its future is dropped, its work keeps running.
        first.abort();
        let _ = first.await;
        let second_started = Arc::new(AtomicBool::new(false));
        let second = {
            let heavy = heavy.clone();
            let started = second_started.clone();
            tokio::spawn(async move {
                off_io(&heavy, move || {
                    started.store(true, Ordering::SeqCst);
                    StatusCode::OK.into_response()
                })
                .await
            })
        };
        // The second call waits for the turn, holding a waiting place meanwhile. Were the turn
        // freed with the first call's future, its work would start at once: give it a moment
        // to show (correct code never starts it, so a slow machine cannot fail this).
        until(|| heavy.waiting.available_permits() == 7 || second_started.load(Ordering::SeqCst))
            .await;
        let grace = tokio::time::Instant::now() + Duration::from_millis(200);
        while tokio::time::Instant::now() < grace && !second_started.load(Ordering::SeqCst) {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        assert!(
            !second_started.load(Ordering::SeqCst),
            "a second work ran while the first, whose client left, still held the turn"
        );
        assert_eq!(
            heavy.run.available_permits(),
            0,
            "the first work holds the turn"
        );
        // It runs once the first work ends.
        release.send(()).expect("the first work is still running");
        let answer = second.await.expect("the second call");
        assert_eq!(answer.status(), StatusCode::OK);
        assert!(second_started.load(Ordering::SeqCst), "the second work ran");
        assert_eq!(heavy.run.available_permits(), 1, "the turn is back");
        assert_eq!(
            heavy.waiting.available_permits(),
            8,
            "no waiting place is kept"
        );
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn admin_calls_beyond_the_waiting_places_are_refused_at_once() {
        let heavy = Arc::new(Heavy::default());
        let (running, release) = start_held(&heavy).await;
        // The running call keeps one waiting place; seven more calls queue behind it.
        let ran = Arc::new(Mutex::new(0usize));
        let queued: Vec<_> = (0..7)
            .map(|_| {
                let heavy = heavy.clone();
                let ran = ran.clone();
                tokio::spawn(async move {
                    off_io(&heavy, move || {
                        *ran.lock().expect("count") += 1;
                        StatusCode::OK.into_response()
                    })
                    .await
                })
            })
            .collect();
        until(|| heavy.waiting.available_permits() == 0).await;
        let refused = off_io(&heavy, || StatusCode::OK.into_response()).await;
        assert_eq!(refused.status(), StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(
            *ran.lock().expect("count"),
            0,
            "nothing ran beside the first work"
        );
        release.send(()).expect("the first work is still running");
        assert_eq!(running.await.expect("first").status(), StatusCode::OK);
        for q in queued {
            assert_eq!(q.await.expect("queued").status(), StatusCode::OK);
        }
        assert_eq!(*ran.lock().expect("count"), 7, "every queued call ran once");
        assert_eq!(heavy.waiting.available_permits(), 8);
    }
}
