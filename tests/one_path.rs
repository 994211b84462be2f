//! One decision path: the same chat body and tenant sent through the ext_proc edge, the real
//! `kv-epp tokenize` binary and admin `POST /explain` on a running server must give the same
//! salt fingerprint (the one under the configured `fingerprint_key_file`, not a random key), the
//! same token IDs, the same block hashes and the same forwarded body. If any path resolves salts,
//! tokenizes or hashes its own way, this fails.

mod common;

use std::io::Write;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::Arc;

use envoy_types::pb::envoy::config::core::v3::{HeaderMap, HeaderValue};
use envoy_types::pb::envoy::service::ext_proc::v3::{
    HttpBody, HttpHeaders, ProcessingRequest, ProtocolConfiguration, body_mutation::Mutation,
    processing_request::Request, processing_response::Response,
};
use envoy_types::pb::google::protobuf::value::Kind;
use kv_epp::config::Config;
use kv_epp::decide::tokens_digest;
use kv_epp::extproc::budget::BodyBudget;
use kv_epp::extproc::stream::{StreamHandler, StreamOptions};
use kv_epp::metrics::Metrics;
use kv_epp::server::Server;
use kv_epp_core::fingerprint::FingerprintKey;
use serde_json::Value;

use common::http;

const TENANT: &str = "tenant-a";
const KEY: &str = "the-cluster-fingerprint-key";
/// Keys deliberately out of alphabetical order: a path that re-serialized the body would still
/// have to give the same tokens.
const BODY: &str = r#"{"model":"m","messages":[{"role":"system","content":"You are terse."},{"role":"user","content":"hello there, how are you today? Tell me about caches."}],"max_tokens":8,"cache_salt":"client-smuggled"}"#;

fn write_config(dir: &std::path::Path) -> PathBuf {
    let key_file = dir.join("fingerprint.key");
    // The trailing newline is what a mounted Secret usually has; every path must trim it.
    std::fs::write(&key_file, format!("{KEY}\n")).unwrap();
    let tokenizer =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tokenizer/small-bpe");
    let cfg = dir.join("kv-epp.yaml");
    std::fs::write(
        &cfg,
        format!(
            "server: {{bind_address: 127.0.0.1, grpc_port: 0, grpc_health_port: 0, metrics_port: 0, admin_port: 0}}
events: {{engine: none}}
engine_metrics: {{interval_ms: 0}}
salt: {{fingerprint_key_file: '{}'}}
models: [{{name: m, block_size: 4, tokenizer: {{path: '{}'}}}}]
workers: [{{endpoint: '127.0.0.1:18001', model: m}}, {{endpoint: '127.0.0.1:18002', model: m}}]
",
            key_file.display(),
            tokenizer.display()
        ),
    )
    .unwrap();
    cfg
}

/// Writes the config into a fresh directory and starts a server on it, loading the config the
/// way `kv-epp serve` does (file, validation, secret files).
async fn start(name: &str) -> (PathBuf, PathBuf, Server) {
    let dir = std::env::temp_dir().join(format!("kv-epp-one-path-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let cfg = write_config(&dir);
    let mut config = Config::from_file(&cfg).unwrap();
    config.validate().unwrap();
    config.read_secret_files().unwrap();
    let server = Server::start(&config).await.unwrap();
    (dir, cfg, server)
}

/// What one path reported: (fingerprint, token IDs, local hashes, sequence hashes, forwarded body).
type Seen = (String, Vec<u32>, Vec<u64>, Vec<u64>, Value);

/// What the ext_proc edge publishes of a decision (its `kv-epp` dynamic metadata), and the same
/// figures computed from a full report: (fingerprint, prompt tokens, tokens digest, last block's
/// sequence hash, forwarded body). The digest and the chained last hash cover every token and
/// every block hash.
type Summary = (String, u64, String, String, Value);

fn summary(s: &Seen) -> Summary {
    (
        s.0.clone(),
        s.1.len() as u64,
        format!("{:016x}", tokens_digest(&s.1)),
        format!("{:016x}", s.3.last().copied().unwrap_or_default()),
        s.4.clone(),
    )
}

fn via_tokenize_binary(cfg: &std::path::Path) -> Seen {
    let mut child = Command::new(env!("CARGO_BIN_EXE_kv-epp"))
        .args(["tokenize", "--config-file"])
        .arg(cfg)
        .args(["--tenant-id", TENANT, "--path", "/v1/chat/completions"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    child
        .stdin
        .take()
        .unwrap()
        .write_all(BODY.as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["salt"]["source"], "header");
    seen(&v, v["forwarded_body"].clone())
}

fn seen(v: &Value, forwarded: Value) -> Seen {
    let ids = |k: &str| -> Vec<u64> {
        v[k].as_array()
            .unwrap_or_else(|| panic!("no {k} in {v}"))
            .iter()
            .map(|x| x.as_u64().unwrap())
            .collect()
    };
    (
        v["salt"]["fingerprint"].as_str().unwrap().to_owned(),
        ids("token_ids").into_iter().map(|t| t as u32).collect(),
        ids("local"),
        ids("sequence"),
        forwarded,
    )
}

/// The ext_proc edge, driven in-process exactly as the tonic service drives it, on the running
/// server's picker; returns the handler (it holds the booking) and what it told Envoy: the
/// `kv-epp` dynamic metadata and the body it streamed back.
fn via_ext_proc(server: &Server) -> (StreamHandler, Summary) {
    let mut h = StreamHandler::new(
        server.picker.clone(),
        Arc::new(Metrics::new()),
        StreamOptions {
            max_body_bytes: 1 << 20,
            retry_after_seconds: 1,
            conformance_hooks: false,
            body_budget: BodyBudget::new(1 << 30, Default::default()),
            flow: None,
        },
    );
    let header = |k: &str, v: &str| HeaderValue {
        key: k.into(),
        value: String::new(),
        raw_value: v.as_bytes().to_vec(),
    };
    h.on_message(ProcessingRequest {
        protocol_config: Some(ProtocolConfiguration {
            request_body_mode: 4, // FULL_DUPLEX_STREAMED
            response_body_mode: 4,
            ..Default::default()
        }),
        request: Some(Request::RequestHeaders(HttpHeaders {
            headers: Some(HeaderMap {
                headers: vec![
                    header(":path", "/v1/chat/completions"),
                    header("X-Tenant-Id", TENANT),
                ],
            }),
            ..Default::default()
        })),
        ..Default::default()
    })
    .unwrap();
    let out = h
        .on_message(ProcessingRequest {
            request: Some(Request::RequestBody(HttpBody {
                body: BODY.as_bytes().to_vec(),
                end_of_stream: true,
                ..Default::default()
            })),
            ..Default::default()
        })
        .unwrap();
    let mut streamed = Vec::new();
    let mut meta = None;
    for m in out {
        if let Some(d) = &m.dynamic_metadata {
            meta = d.fields.get("kv-epp").cloned();
        }
        if let Some(Response::RequestBody(b)) = m.response
            && let Some(Mutation::StreamedResponse(s)) = b
                .response
                .and_then(|r| r.body_mutation)
                .and_then(|m| m.mutation)
        {
            streamed.extend(s.body);
        }
    }
    let Some(Kind::StructValue(meta)) = meta.and_then(|v| v.kind) else {
        panic!("no kv-epp dynamic metadata in the answer")
    };
    let field = |k: &str| {
        meta.fields
            .get(k)
            .and_then(|v| v.kind.clone())
            .unwrap_or_else(|| panic!("no {k} in {meta:?}"))
    };
    let text = |k: &str| match field(k) {
        Kind::StringValue(s) => s,
        other => panic!("{k}: {other:?}"),
    };
    let Kind::NumberValue(tokens) = field("prompt_tokens") else {
        panic!("prompt_tokens")
    };
    let seen = (
        text("salt_fingerprint"),
        tokens as u64,
        text("tokens_digest"),
        text("prefix_hash"),
        serde_json::from_slice(&streamed).unwrap(),
    );
    (h, seen)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ext_proc_tokenize_and_explain_agree() {
    let (dir, cfg, server) = start("agree").await;

    let (handler, ext_proc) = via_ext_proc(&server);
    assert_eq!(
        server.picker.workers.total_inflight(),
        1,
        "ext_proc booked a worker"
    );

    let explain_req = format!(
        r#"{{"path":"/v1/chat/completions","headers":{{"x-TENANT-id":["{TENANT}"]}},"body":{BODY}}}"#
    );
    let r = http(
        server.admin_addr,
        "POST",
        "/explain",
        &[("content-type", "application/json")],
        explain_req.as_bytes(),
    )
    .await
    .unwrap();
    assert_eq!(r.status, 200, "{}", r.text());
    let explained: Value = serde_json::from_slice(&r.body).unwrap();
    assert_eq!(
        server.picker.workers.total_inflight(),
        1,
        "explaining books nothing"
    );
    // /explain does not return the forwarded body: compare it through the others.
    let explain = seen(&explained, ext_proc.4.clone());
    let tokenize = via_tokenize_binary(&cfg);

    let expected = FingerprintKey::from_passphrase(KEY)
        .fingerprint(TENANT.as_bytes())
        .to_string();
    assert_eq!(
        ext_proc.0, expected,
        "ext_proc fingerprints under the file's key"
    );
    assert!(
        tokenize.1.len() > 8 && tokenize.3.len() >= 2,
        "{tokenize:?}"
    );
    assert_eq!(explain, tokenize, "/explain drifted from kv-epp tokenize");
    assert_eq!(
        summary(&tokenize),
        ext_proc,
        "kv-epp tokenize drifted from ext_proc"
    );
    assert_eq!(
        summary(&explain),
        ext_proc,
        "/explain drifted from ext_proc"
    );
    assert_eq!(ext_proc.4["cache_salt"], format!("kvepp:{TENANT}"));
    // The explanation sees ext_proc's booking: that worker now queues one request, costs more,
    // and loses to the idle one, and the answer says so. It never shows the salt.
    let booked = handler.decision().unwrap().pick.endpoint.to_string();
    let candidates = explained["candidates"].as_array().unwrap();
    assert_eq!(candidates.len(), 2);
    let busy = candidates.iter().find(|c| c["worker"] == booked).unwrap();
    assert_eq!(busy["load"]["inflight"], 1);
    assert_eq!(busy["status"], "lost", "{busy}");
    assert!(
        busy["why"].as_str().unwrap().starts_with("higher cost by"),
        "{busy}"
    );
    assert_ne!(explained["pick"], booked);
    assert!(!r.text().contains(TENANT) && !r.text().contains("client-smuggled"));

    drop(handler);
    assert_eq!(server.picker.workers.total_inflight(), 0);
    server.stop().await;
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn explain_refuses_as_ext_proc_would() {
    let (dir, _, server) = start("refuse").await;
    let cases = [
        (
            r#"{"path":"/v1/chat/completions","headers":{"x-tenant-id":["a","b"]},"body":{"model":"m","prompt":[1]}}"#,
            400,
            "bad-cache-salt",
        ),
        (
            r#"{"path":"/v1/chat/completions","body":{"model":"m","messages":[]}}"#,
            400,
            "bad-request",
        ),
        (
            r#"{"path":"/v1/completions","body":{"model":"m","prompt":[1]},"subset":[]}"#,
            503,
            "rejected-no-endpoints",
        ),
    ];
    for (req, status, reason) in cases {
        let r = http(server.admin_addr, "POST", "/explain", &[], req.as_bytes())
            .await
            .unwrap();
        assert_eq!(r.status, status, "{req}: {}", r.text());
        assert_eq!(r.header("x-llm-d-request-dropped-reason"), Some(reason));
        let body: Value = serde_json::from_slice(&r.body).unwrap();
        assert_eq!(body["error"]["type"], reason);
        assert_eq!(body["error"]["code"], status);
    }
    server.stop().await;
    let _ = std::fs::remove_dir_all(&dir);
}
