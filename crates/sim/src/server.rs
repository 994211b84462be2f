//! `sim-worker`'s HTTP edge: an OpenAI-compatible server in front of one simulated [`Engine`],
//! plus the vLLM-named metrics and the admin endpoints. Thin: parsing and validation live in
//! [`crate::api`], scheduling and the cache in [`crate::engine`], the wire in
//! [`crate::publisher`].
//!
//! Endpoints: `POST /v1/completions`, `POST /v1/chat/completions` (JSON, or SSE with
//! `"stream": true`; the final usage chunk is sent when `stream_options.include_usage` is true, as
//! vLLM does), `GET /v1/models`, `GET /health`, `GET /metrics`, `POST /reset_prefix_cache`
//! (publishes `AllBlocksCleared`), `POST /admin/restart` (sequence back to 0, cache emptied, no
//! event). `usage.prompt_tokens_details.cached_tokens` is always filled (vLLM fills it only with
//! `--enable-prompt-tokens-details`).

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use serde_json::{Value, json};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;

use crate::api::{ApiError, Endpoint, Served, SimRequest, TokenizeHook, parse_request};
use crate::engine::{Engine, EngineConfig, EngineError, Running};
use crate::latency::LatencyModel;
use crate::prefix_cache::CacheRequest;
use crate::publisher::{self, BoundPublisher, PublisherConfig};

/// Everything a simulated worker needs to start.
#[derive(Clone, Debug)]
pub struct SimWorkerConfig {
    /// HTTP listen address.
    pub http_addr: SocketAddr,
    /// Served model and LoRA adapters.
    pub served: Served,
    /// Engine shape and timing.
    pub engine: EngineConfig,
    /// KV event publisher.
    pub publisher: PublisherConfig,
}

impl SimWorkerConfig {
    /// A worker of model `m` on loopback (ephemeral HTTP and event ports, no replay socket) with
    /// no simulated latency, publishing the current event layout with integer hashes: the
    /// starting point tests and benchmarks adjust field by field.
    pub fn loopback(block_size: usize, num_blocks: usize) -> SimWorkerConfig {
        SimWorkerConfig {
            http_addr: SocketAddr::from(([127, 0, 0, 1], 0)),
            served: Served {
                model: "m".into(),
                lora_modules: vec![],
                engine: crate::events::SimEngine::Vllm,
            },
            engine: EngineConfig {
                num_blocks,
                block_size,
                max_num_seqs: 64,
                latency: LatencyModel {
                    base_us: 0,
                    prefill_us_per_token: 0.0,
                    decode_us_per_token: 0,
                },
            },
            publisher: PublisherConfig {
                events_endpoint: "tcp://127.0.0.1:0".into(),
                replay_endpoint: None,
                topic: String::new(),
                buffer_steps: 10_000,
                drop_fraction: 0.0,
                fault_seed: 0,
                encoder: crate::events::BatchEncoder {
                    engine: crate::events::SimEngine::Vllm,
                    layout: crate::events::EventLayout::Map,
                    hash_form: crate::events::HashForm::Int,
                    block_size,
                    lora_modules: vec![],
                    data_parallel_rank: None,
                },
            },
        }
    }
}

/// A running simulated worker.
pub struct SimWorker {
    /// The bound HTTP address.
    pub http_addr: SocketAddr,
    /// The bound ZeroMQ endpoints.
    pub events: BoundPublisher,
    /// The engine (for in-process checks of what it holds).
    pub engine: Arc<Engine>,
}

struct App {
    /// SGLang's `/server_info` `kv_events` block (SGLang workers only).
    kv_events: Option<Value>,
    engine: Arc<Engine>,
    served: Served,
    tokenize: Option<TokenizeHook>,
    next_id: AtomicU64,
}

/// Binds the HTTP listener and the ZeroMQ sockets and serves until the runtime stops.
/// `tokenize` serves text and chat prompts; without it they are refused with a 400.
pub async fn start(
    config: SimWorkerConfig,
    tokenize: Option<TokenizeHook>,
) -> Result<SimWorker, String> {
    let (tx, rx) = mpsc::unbounded_channel();
    let (engine_kind, topic, block_size, rank) = (
        config.served.engine,
        config.publisher.topic.clone(),
        config.engine.block_size,
        config.publisher.encoder.data_parallel_rank.unwrap_or(0),
    );
    let events = publisher::start(config.publisher, rx).await?;
    // What SGLang advertises: its publisher's base port (rank 0's) behind a wildcard host.
    let kv_events = (engine_kind == crate::events::SimEngine::Sglang).then(|| {
        let port = events
            .events_endpoint
            .rsplit_once(':')
            .and_then(|(_, p)| p.parse::<u32>().ok())
            .and_then(|p| p.checked_sub(rank));
        json!({"publisher": "zmq", "endpoint_host": "*", "endpoint_port_base": port,
            "topic": topic, "block_size": block_size, "dp_size": rank + 1})
    });
    let app = Arc::new(App {
        kv_events,
        engine: Engine::new(config.engine, tx),
        served: config.served,
        tokenize,
        next_id: AtomicU64::new(0),
    });
    let engine = app.engine.clone();
    let router = Router::new()
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/models", get(models))
        .route("/server_info", get(server_info))
        .route("/health", get(|| async { StatusCode::OK }))
        .route("/metrics", get(metrics))
        .route("/reset_prefix_cache", post(reset_prefix_cache))
        .route("/admin/restart", post(restart))
        .with_state(app);
    let listener = tokio::net::TcpListener::bind(config.http_addr)
        .await
        .map_err(|e| format!("binding HTTP {}: {e}", config.http_addr))?;
    let http_addr = listener
        .local_addr()
        .map_err(|e| format!("HTTP listener address: {e}"))?;
    tokio::spawn(async move {
        if let Err(e) = axum::serve(listener, router).await {
            tracing::error!("HTTP server stopped: {e}");
        }
    });
    Ok(SimWorker {
        http_addr,
        events,
        engine,
    })
}

fn error_response(e: &ApiError) -> Response {
    let status = StatusCode::from_u16(e.status()).unwrap_or(StatusCode::BAD_REQUEST);
    let body = json!({"error": {
        "message": e.to_string(), "type": e.kind(), "param": null, "code": e.status()}});
    (status, axum::Json(body)).into_response()
}

async fn completions(State(app): State<Arc<App>>, body: Bytes) -> Response {
    generate(app, body, Endpoint::Completions).await
}

async fn chat_completions(State(app): State<Arc<App>>, body: Bytes) -> Response {
    generate(app, body, Endpoint::Chat).await
}

/// One generated token's text (the simulator produces no real text).
fn piece(i: u32) -> &'static str {
    if i == 0 { "sim" } else { " sim" }
}

fn unix_secs() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// The fields every response and chunk share.
struct Meta {
    id: String,
    object: &'static str,
    created: u64,
    model: String,
    endpoint: Endpoint,
}

impl Meta {
    fn with(&self, choices: Value, usage: Option<Value>) -> Value {
        let mut v = json!({"id": self.id, "object": self.object, "created": self.created,
                           "model": self.model, "choices": choices});
        if let Some(u) = usage {
            v["usage"] = u;
        }
        v
    }

    /// A streaming chunk carrying token `i` (or the role opener for chat when `i` is None).
    fn chunk(&self, i: Option<u32>, finish: Option<&str>) -> Value {
        let choice = match (self.endpoint, i) {
            (Endpoint::Completions, i) => json!({"index": 0, "text": i.map_or("", piece),
                "logprobs": null, "finish_reason": finish, "stop_reason": null}),
            (Endpoint::Chat, None) => json!({"index": 0,
                "delta": {"role": "assistant", "content": ""}, "logprobs": null,
                "finish_reason": null}),
            (Endpoint::Chat, Some(i)) => json!({"index": 0, "delta": {"content": piece(i)},
                "logprobs": null, "finish_reason": finish, "stop_reason": null}),
        };
        self.with(json!([choice]), None)
    }
}

fn usage(prompt: usize, completion: u32, cached: usize) -> Value {
    json!({"prompt_tokens": prompt, "total_tokens": prompt + completion as usize,
           "completion_tokens": completion,
           "prompt_tokens_details": {"cached_tokens": cached}})
}

async fn generate(app: Arc<App>, body: Bytes, endpoint: Endpoint) -> Response {
    let req: SimRequest = match parse_request(&body, endpoint, &app.served, app.tokenize.as_ref()) {
        Ok(r) => r,
        Err(e) => return error_response(&e),
    };
    let creq = CacheRequest {
        tokens: &req.tokens,
        salt: req.cache_salt.as_deref(),
        lora_name: req.lora_name.as_deref(),
    };
    let running = match app.engine.start(&creq).await {
        Ok(r) => r,
        Err(e @ EngineError::PromptTooLong { .. }) => {
            return error_response(&ApiError::BadRequest(e.to_string()));
        }
    };
    let n = app.next_id.fetch_add(1, Ordering::Relaxed);
    let meta = Meta {
        id: match endpoint {
            Endpoint::Completions => format!("cmpl-sim-{n}"),
            Endpoint::Chat => format!("chatcmpl-sim-{n}"),
        },
        object: match (endpoint, req.stream) {
            (Endpoint::Completions, _) => "text_completion",
            (Endpoint::Chat, false) => "chat.completion",
            (Endpoint::Chat, true) => "chat.completion.chunk",
        },
        created: unix_secs(),
        model: req.model.clone(),
        endpoint,
    };
    if req.stream {
        return stream(app, req, running, meta);
    }
    let step = app.engine.decode_step();
    for _ in 1..req.max_tokens {
        tokio::time::sleep(step).await;
    }
    let text: String = (0..req.max_tokens).map(piece).collect();
    let choice = match endpoint {
        Endpoint::Completions => json!({"index": 0, "text": text, "logprobs": null,
            "finish_reason": "length", "stop_reason": null, "prompt_logprobs": null}),
        Endpoint::Chat => json!({"index": 0,
            "message": {"role": "assistant", "content": text, "tool_calls": []},
            "logprobs": null, "finish_reason": "length", "stop_reason": null}),
    };
    let u = usage(req.tokens.len(), req.max_tokens, running.cached_tokens);
    drop(running);
    axum::Json(meta.with(json!([choice]), Some(u))).into_response()
}

/// Streams SSE chunks from a task that owns the request's blocks: a client that goes away stops
/// the task at its next send, which drops the blocks.
fn stream(app: Arc<App>, req: SimRequest, running: Running, meta: Meta) -> Response {
    let (tx, rx) = mpsc::channel::<Result<Bytes, Infallible>>(4);
    tokio::spawn(async move {
        let send = |v: &Value| Ok(Bytes::from(format!("data: {v}\n\n")));
        let step = app.engine.decode_step();
        if meta.endpoint == Endpoint::Chat && tx.send(send(&meta.chunk(None, None))).await.is_err()
        {
            return;
        }
        for i in 0..req.max_tokens {
            if i > 0 {
                tokio::time::sleep(step).await;
            }
            let finish = (i + 1 == req.max_tokens).then_some("length");
            if tx.send(send(&meta.chunk(Some(i), finish))).await.is_err() {
                return;
            }
        }
        let u = usage(req.tokens.len(), req.max_tokens, running.cached_tokens);
        drop(running);
        if req.include_usage && tx.send(send(&meta.with(json!([]), Some(u)))).await.is_err() {
            return;
        }
        let _ = tx.send(Ok(Bytes::from_static(b"data: [DONE]\n\n"))).await;
    });
    Response::builder()
        .header(header::CONTENT_TYPE, "text/event-stream")
        .header(header::CACHE_CONTROL, "no-cache")
        .body(Body::from_stream(ReceiverStream::new(rx)))
        .unwrap_or_else(|_| StatusCode::INTERNAL_SERVER_ERROR.into_response())
}

/// SGLang's `/server_info`, reduced to what a router reads: the served model and the
/// `kv_events` block (404 on other engines, which have no such route).
async fn server_info(State(app): State<Arc<App>>) -> Response {
    match &app.kv_events {
        Some(kv) => axum::Json(json!({"served_model_name": app.served.model, "kv_events": kv}))
            .into_response(),
        None => StatusCode::NOT_FOUND.into_response(),
    }
}

async fn models(State(app): State<Arc<App>>) -> Response {
    let created = unix_secs();
    let base = &app.served.model;
    let mut data = vec![json!({"id": base, "object": "model", "created": created,
        "owned_by": "vllm", "root": base, "parent": null})];
    for l in &app.served.lora_modules {
        data.push(json!({"id": l, "object": "model", "created": created,
            "owned_by": "vllm", "root": l, "parent": base}));
    }
    axum::Json(json!({"object": "list", "data": data})).into_response()
}

async fn metrics(State(app): State<Arc<App>>) -> Response {
    let text = render_metrics(&app.served.model, app.engine.config(), &app.engine.stats());
    (
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        text,
    )
        .into_response()
}

/// Prometheus text with vLLM's names. Counters are exposed as prometheus_client does for a
/// counter named `vllm:prefix_cache_queries`: `# TYPE vllm:prefix_cache_queries_total counter`
/// and the sample `vllm:prefix_cache_queries_total{...}` (no `_created` series; vLLM disables
/// them). Labels `model_name`, `engine` (engine index `0`), in vLLM's order.
pub fn render_metrics(
    model: &str,
    config: &EngineConfig,
    s: &crate::engine::EngineStats,
) -> String {
    let labels = format!("{{model_name=\"{}\",engine=\"0\"}}", escape_label(model));
    let mut out = String::new();
    let mut family = |name: &str, kind: &str, help: &str, sample: String| {
        out.push_str(&format!(
            "# HELP {name} {help}\n# TYPE {name} {kind}\n{name}{sample}\n"
        ));
    };
    family(
        "vllm:num_requests_running",
        "gauge",
        "Number of requests in model execution batches.",
        format!("{labels} {:?}", f64::from(s.running)),
    );
    family(
        "vllm:num_requests_waiting",
        "gauge",
        "Number of requests waiting to be processed.",
        format!("{labels} {:?}", f64::from(s.waiting)),
    );
    family(
        "vllm:kv_cache_usage_perc",
        "gauge",
        "KV-cache usage. 1 means 100 percent usage.",
        format!("{labels} {:?}", s.kv_cache_usage),
    );
    family(
        "vllm:prefix_cache_queries_total",
        "counter",
        "Prefix cache queries, in terms of number of queried tokens.",
        format!("{labels} {:?}", s.prefix_queries as f64),
    );
    family(
        "vllm:prefix_cache_hits_total",
        "counter",
        "Prefix cache hits, in terms of number of cached tokens.",
        format!("{labels} {:?}", s.prefix_hits as f64),
    );
    family(
        "vllm:cache_config_info",
        "gauge",
        "Information of the LLMEngine CacheConfig",
        format!(
            "{{block_size=\"{}\",enable_prefix_caching=\"True\",engine=\"0\",num_gpu_blocks=\"{}\"}} 1.0",
            config.block_size, config.num_blocks
        ),
    );
    out
}

fn escape_label(v: &str) -> String {
    v.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

async fn reset_prefix_cache(State(app): State<Arc<App>>) -> StatusCode {
    app.engine.reset_prefix_cache();
    StatusCode::OK
}

async fn restart(State(app): State<Arc<App>>) -> Response {
    app.engine.restart();
    axum::Json(json!({"restarted": true})).into_response()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::EngineStats;
    use crate::latency::LatencyModel;

    /// POSTs `body` and returns the status and the body text.
    async fn http(addr: SocketAddr, path: &str, body: &str) -> (u16, String) {
        let limits = kv_epp::httpc::Limits {
            deadline: std::time::Duration::from_secs(30),
            max_body: 1 << 20,
        };
        let r = kv_epp::httpc::post_json(addr, path, body.to_owned(), limits)
            .await
            .unwrap();
        let text = String::from_utf8_lossy(r.body()).into_owned();
        (r.status().as_u16(), text)
    }

    /// The tokenizer hook serves chat (and text) prompts end to end, streaming included.
    #[tokio::test]
    async fn tokenize_hook_serves_chat() {
        let hook: TokenizeHook = Arc::new(|_body: &[u8], endpoint: Endpoint| match endpoint {
            Endpoint::Chat => Ok(vec![1, 2, 3, 4, 5]),
            _ => Err("only chat here".into()),
        });
        let mut config = SimWorkerConfig::loopback(4, 8);
        config.engine.max_num_seqs = 2;
        config.publisher.buffer_steps = 4;
        let worker = start(config, Some(hook)).await.unwrap();
        let chat = r#"{"model":"m","messages":[{"role":"user","content":"hi"}],"max_tokens":2}"#;
        let (status, plain) = http(worker.http_addr, "/v1/chat/completions", chat).await;
        assert_eq!(status, 200, "{plain}");
        assert!(plain.contains(r#""object":"chat.completion""#), "{plain}");
        assert!(plain.contains(r#""content":"sim sim""#), "{plain}");
        assert!(plain.contains(r#""prompt_tokens":5"#), "{plain}");
        let streamed = chat.replace(
            "}],",
            r#"}],"stream":true,"stream_options":{"include_usage":true},"#,
        );
        let (status, sse) = http(worker.http_addr, "/v1/chat/completions", &streamed).await;
        assert_eq!(status, 200, "{sse}");
        assert!(
            sse.contains(r#""delta":{"content":"","role":"assistant"}"#),
            "{sse}"
        );
        assert!(sse.contains(r#""object":"chat.completion.chunk""#), "{sse}");
        assert!(sse.contains(r#""cached_tokens":4"#), "{sse}");
        assert!(sse.contains("data: [DONE]\n\n"), "{sse}");
        let (status, text) = http(
            worker.http_addr,
            "/v1/completions",
            r#"{"model":"m","prompt":"hi"}"#,
        )
        .await;
        assert!(status == 400 && text.contains("only chat here"), "{text}");
    }

    #[test]
    fn metrics_use_vllm_names_and_labels() {
        let cfg = EngineConfig {
            num_blocks: 64,
            block_size: 16,
            max_num_seqs: 4,
            latency: LatencyModel::default(),
        };
        let text = render_metrics(
            "m\"x",
            &cfg,
            &EngineStats {
                running: 2,
                waiting: 1,
                kv_cache_usage: 0.25,
                prefix_queries: 48,
                prefix_hits: 16,
            },
        );
        for line in [
            "vllm:num_requests_running{model_name=\"m\\\"x\",engine=\"0\"} 2.0",
            "vllm:num_requests_waiting{model_name=\"m\\\"x\",engine=\"0\"} 1.0",
            "vllm:kv_cache_usage_perc{model_name=\"m\\\"x\",engine=\"0\"} 0.25",
            "# TYPE vllm:prefix_cache_queries_total counter",
            "vllm:prefix_cache_queries_total{model_name=\"m\\\"x\",engine=\"0\"} 48.0",
            "vllm:prefix_cache_hits_total{model_name=\"m\\\"x\",engine=\"0\"} 16.0",
            "vllm:cache_config_info{block_size=\"16\",enable_prefix_caching=\"True\",engine=\"0\",num_gpu_blocks=\"64\"} 1.0",
        ] {
            assert!(text.lines().any(|l| l == line), "{line}\n{text}");
        }
    }
}
