//! The admin HTTP API (default port 9091): the standalone query API and worker status.
//!
//! - `POST /query` `{"model", "token_ids", "lora_name"?, "cache_salt"?}`: kv-epp hashes the tokens
//!   itself under the salt (resolved by the same rules as ext_proc, including `x-tenant-id`) and
//!   answers each worker's overlap in tokens, per data-parallel rank and per tier.
//! - `POST /query_by_hash` `{"model", "block_hashes": [i64...], "lora_name"?}`: local block hashes
//!   the caller already computed with the intended salt (i64 on the wire, read as u64). Any
//!   non-null `cache_salt` field, even `""`, is a 400: the hashes already carry the salt.
//! - `GET /workers`: per worker, readiness, in-flight requests, event feed state and blocks held.
//! - `GET /debug/digest`: per model, an order-independent digest of the index (no salts), so
//!   replicas can be checked for convergence from outside.
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

use crate::events::Feeds;
use crate::hashing::{LocalBlockHash, SequenceHash, sequence_hashes};
use crate::index::Overlap;
use crate::namespace::seed_for;
use crate::router::Router;
use crate::salt::{SaltField, SaltInputs, TENANT_HEADER, resolve};

/// Largest request body accepted.
pub const MAX_BODY: usize = 8 << 20;

/// Shared state of the admin API.
#[derive(Clone)]
pub struct AdminState {
    /// The router (models, indexes, workers).
    pub router: Arc<Router>,
    /// The event feeds.
    pub feeds: Arc<Feeds>,
    /// Replication, when configured.
    pub replica: Option<Arc<crate::replica::ReplicaState>>,
}

/// The admin HTTP routes.
pub fn routes(state: AdminState) -> HttpRouter {
    HttpRouter::new()
        .route("/query", post(query))
        .route("/query_by_hash", post(query_by_hash))
        .route("/workers", get(workers))
        .route("/debug/digest", get(digest))
        .route("/debug/replica", get(replica))
        .layer(DefaultBodyLimit::max(MAX_BODY))
        .with_state(state)
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

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct QueryByHashRequest {
    #[serde(alias = "model_name")]
    model: String,
    block_hashes: Vec<i64>,
    #[serde(default)]
    lora_name: Option<String>,
    #[serde(default)]
    cache_salt: Option<Value>,
}

/// Resolves the model name (or adapter) to its base model and adapter.
fn model_of<'a>(
    router: &'a Router,
    model: &'a str,
    lora: Option<&'a str>,
) -> Result<(&'a str, Option<&'a str>), ApiError> {
    let (base, adapter) = router.resolve_model(model).ok_or_else(|| {
        error(
            StatusCode::NOT_FOUND,
            format!("model `{model}` is not served here"),
        )
    })?;
    Ok((base, adapter.or(lora.filter(|l| !l.is_empty()))))
}

fn answer(router: &Router, base: &str, blocks: usize, overlaps: Vec<Overlap>) -> Response {
    let block_size = router.index(base).map_or(0, |i| i.block_size()) as u64;
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

async fn query(
    State(s): State<AdminState>,
    headers: HeaderMap,
    body: axum::body::Bytes,
) -> Response {
    let req: QueryRequest = match parse(&body) {
        Ok(r) => r,
        Err(e) => return e.into_response(),
    };
    let (base, lora) = match model_of(&s.router, &req.model, req.lora_name.as_deref()) {
        Ok(m) => m,
        Err(e) => return e.into_response(),
    };
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
    let salt = match resolve(&inputs, s.router.salt_policy()) {
        Ok(salt) => salt,
        Err(e) => return error(StatusCode::BAD_REQUEST, e.to_string()).into_response(),
    };
    let Some(index) = s.router.index(base) else {
        return error(StatusCode::NOT_FOUND, "model has no index").into_response();
    };
    let seed = seed_for(salt.as_ref().map(|r| &r.salt), lora);
    let seqs = crate::hashing::prompt_hashes(&req.token_ids, index.block_size(), seed).1;
    let overlaps = index.query(&seqs);
    answer(&s.router, base, seqs.len(), overlaps)
}

async fn query_by_hash(State(s): State<AdminState>, body: axum::body::Bytes) -> Response {
    let req: QueryByHashRequest = match parse(&body) {
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
    let (base, _) = match model_of(&s.router, &req.model, req.lora_name.as_deref()) {
        Ok(m) => m,
        Err(e) => return e.into_response(),
    };
    let Some(index) = s.router.index(base) else {
        return error(StatusCode::NOT_FOUND, "model has no index").into_response();
    };
    let locals: Vec<LocalBlockHash> = req
        .block_hashes
        .iter()
        .map(|&h| LocalBlockHash(h as u64))
        .collect();
    let seqs: Vec<SequenceHash> = sequence_hashes(&locals);
    let overlaps = index.query(&seqs);
    answer(&s.router, base, seqs.len(), overlaps)
}

async fn digest(State(s): State<AdminState>) -> Response {
    let mut models = serde_json::Map::new();
    for name in s.router.model_names() {
        if let Some(index) = s.router.index(&name) {
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
    let sources: Vec<Value> = s
        .feeds
        .single_readers()
        .iter()
        .map(|(w, _)| {
            json!({
                "worker": w.to_string(),
                "owner": r.owner_of(w).map(hex),
                "polling": s.feeds.is_owned_here(w),
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
        "peers": peers,
        "single_reader_sources": sources,
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
        },
    }))
    .into_response()
}

async fn workers(State(s): State<AdminState>) -> Response {
    let feeds = s.feeds.statuses();
    let polls = s.feeds.poll_statuses();
    let list: Vec<Value> = s
        .router
        .workers()
        .iter()
        .map(|w| {
            let blocks = s
                .router
                .index(&w.model)
                .and_then(|i| i.worker_blocks(&w.id).ok());
            let feed = feeds
                .iter()
                .find(|(id, _, _)| *id == w.id)
                .map(|(_, ep, st)| {
                    use std::sync::atomic::Ordering::Relaxed;
                    let next = st.next_seq.load(Relaxed);
                    json!({
                        "events_endpoint": ep.events,
                        "replay_endpoint": ep.replay,
                        "connected": st.connected.load(Relaxed),
                        "last_sequence": next.checked_sub(1),
                        "batches": st.batches.load(Relaxed),
                        "cold": st.cold.load(Relaxed),
                        "gaps": st.gaps.load(Relaxed),
                        "replayed": st.replayed.load(Relaxed),
                        "unfillable_gaps": st.unfillable.load(Relaxed),
                        "restarts": st.restarts.load(Relaxed),
                        "bad_payloads": st.bad_payloads.load(Relaxed),
                        "last_event_ms": st.last_event_ms.load(Relaxed),
                    })
                });
            let feed = feed.or_else(|| {
                polls.iter().find(|(id, _)| *id == w.id).map(|(_, st)| {
                    use std::sync::atomic::Ordering::Relaxed;
                    json!({
                        "engine": "trtllm",
                        "connected": st.connected.load(Relaxed),
                        "polls": st.polls.load(Relaxed),
                        "failures": st.failures.load(Relaxed),
                        "applied": st.applied.load(Relaxed),
                    })
                })
            });
            json!({
                "worker": w.id.endpoint.to_string(),
                "dp_rank": w.id.dp_rank,
                "model": w.model,
                "ready": w.is_ready(),
                "inflight": w.inflight(),
                "blocks": blocks,
                "events": feed,
            })
        })
        .collect();
    Json(json!({ "workers": list })).into_response()
}
