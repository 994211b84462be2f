//! Black-box tests through a real Envoy 1.40: clients talk HTTP to Envoy, Envoy streams each
//! request to an in-process kv-epp over ext_proc, and forwards it to the fake worker kv-epp picked.

mod common;

use std::net::SocketAddr;
use std::time::Duration;

use common::*;
use kv_epp::server::Server;
use kv_epp_core::hashing::HashSeed;
use kv_epp_core::index::{EngineBlockHash, Medium, StoreBlocks};
use kv_epp_core::worker::WorkerId;

/// Seeds `worker` as holding `tokens` (block size 4) under `salt`.
fn seed(server: &Server, worker: SocketAddr, tokens: &[u32], salt: Option<&str>) {
    let hashes: Vec<EngineBlockHash> = (0..tokens.len() / 4)
        .map(|i| EngineBlockHash(1000 + i as u64))
        .collect();
    server
        .picker
        .models
        .index("m")
        .unwrap()
        .store(
            &WorkerId::new(worker),
            &StoreBlocks {
                parent: None,
                root_seed: Some(HashSeed::new(None, salt)),
                engine_hashes: &hashes,
                tokens: &tokens[..hashes.len() * 4],
                medium: Medium::Device,
            },
        )
        .unwrap();
}

fn prompt_body(tokens: &[u32], extra: &str) -> Vec<u8> {
    format!(
        r#"{{"model":"m","prompt":{}{extra}}}"#,
        serde_json::to_string(tokens).unwrap()
    )
    .into_bytes()
}

struct Rig {
    server: Server,
    envoy: Envoy,
    ups: Vec<Upstream>,
}

impl Rig {
    async fn start(shape: EnvoyShape, workers: usize, extra: &str) -> Option<Rig> {
        Rig::start_edited(shape, workers, extra, |y| y).await
    }

    /// As `start`, with Envoy's rendered configuration passed through `edit` first.
    async fn start_edited(
        shape: EnvoyShape,
        workers: usize,
        extra: &str,
        edit: impl FnOnce(String) -> String,
    ) -> Option<Rig> {
        let bin = envoy_binary()?;
        let mut ups = Vec::new();
        for _ in 0..workers {
            ups.push(Upstream::start().await);
        }
        let addrs: Vec<SocketAddr> = ups.iter().map(|u| u.addr).collect();
        let server = Server::start(&kv_epp_config(&addrs, extra)).await.unwrap();
        let (port, admin) = (free_port(), free_port());
        let cfg = edit(envoy_config(shape, port, server.grpc_addr.port(), admin));
        let envoy = Envoy::run(&bin, port, admin, &cfg).await;
        Some(Rig { server, envoy, ups })
    }

    fn addr(&self) -> SocketAddr {
        SocketAddr::from(([127, 0, 0, 1], self.envoy.port))
    }

    async fn post(&self, headers: &[(&str, &str)], body: &[u8]) -> HttpResponse {
        post_json(self.addr(), "/v1/completions", headers, body)
            .await
            .expect("request through envoy")
    }

    async fn chat(&self, headers: &[(&str, &str)], body: &[u8]) -> HttpResponse {
        post_json(self.addr(), "/v1/chat/completions", headers, body)
            .await
            .expect("request through envoy")
    }

    async fn metrics(&self) -> String {
        http(self.server.metrics_addr, "GET", "/metrics", &[], b"")
            .await
            .unwrap()
            .text()
    }
}

#[test]
fn shipped_envoy_configs_validate() {
    let Some(bin) = envoy_binary() else { return };
    let dir = std::env::temp_dir().join(format!("kv-epp-envoy-validate-{}", std::process::id()));
    let certs = MtlsFiles::write(&dir);
    for file in [
        "envoy.yaml",
        "envoy-buffered.yaml",
        "envoy-mtls.yaml",
        "envoy-failopen.yaml",
        "envoy-buffered-failopen.yaml",
    ] {
        let shipped = format!("{}/deploy/envoy/{file}", env!("CARGO_MANIFEST_DIR"));
        // The mTLS example names certificate files Envoy reads while validating: point it at
        // the test's own.
        let text = std::fs::read_to_string(&shipped)
            .unwrap()
            .replace(ENVOY_MTLS_DIR, certs.envoy.to_str().unwrap());
        let path = dir.join(file);
        std::fs::write(&path, text).unwrap();
        let out = std::process::Command::new(&bin)
            .args(["--mode", "validate", "-c"])
            .arg(&path)
            .arg("--use-dynamic-base-id")
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{file}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

/// envoy-mtls.yaml is envoy.yaml plus the TLS block on the kv-epp cluster, nothing else, so the
/// two examples cannot drift apart.
#[test]
fn the_mtls_example_is_the_full_duplex_example_plus_tls() {
    let read = |f: &str| {
        std::fs::read_to_string(format!("{}/deploy/envoy/{f}", env!("CARGO_MANIFEST_DIR"))).unwrap()
    };
    let body = |s: String| s[s.find("static_resources:").unwrap()..].to_owned();
    let mtls = body(read("envoy-mtls.yaml"));
    let start = mtls.find("    # Mutual TLS to kv-epp").unwrap();
    let end = mtls
        .find("    load_assignment:\n      cluster_name: kv-epp")
        .unwrap();
    let tls = &mtls[start..end];
    assert!(
        tls.contains("tls_certificates") && tls.contains("trusted_ca"),
        "{tls}"
    );
    assert_eq!(mtls.replace(tls, ""), body(read("envoy.yaml")));
}

/// Each fail-open example is its fail-closed twin plus the fallback and nothing else: with
/// `failure_mode_allow` back to false and the fallback route, the `model-pool` cluster and
/// kv-epp's health checks taken out, the two parse to the same configuration.
#[test]
fn the_fail_open_examples_are_the_fail_closed_ones_plus_a_fallback() {
    use serde_yaml::Value;
    let read = |f: &str| -> Value {
        let path = format!("{}/deploy/envoy/{f}", env!("CARGO_MANIFEST_DIR"));
        serde_yaml::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
    };
    let yaml = |s: &str| -> Value { serde_yaml::from_str(s).unwrap() };
    for (open, closed) in [
        ("envoy-failopen.yaml", "envoy.yaml"),
        ("envoy-buffered-failopen.yaml", "envoy-buffered.yaml"),
    ] {
        let mut y = read(open);
        let hcm = &mut y["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"];
        let ext_proc = &mut hcm["http_filters"][0]["typed_config"];
        assert_eq!(ext_proc["failure_mode_allow"], true, "{open}");
        ext_proc["failure_mode_allow"] = false.into();
        let routes = hcm["route_config"]["virtual_hosts"][0]["routes"]
            .as_sequence_mut()
            .unwrap();
        // Last, unconditional, to the pool; kv-epp's pick only when its metadata is there.
        let fallback = routes.pop().unwrap();
        assert_eq!(fallback["match"], yaml("{prefix: /}"), "{open}");
        assert_eq!(fallback["route"]["cluster"], "model-pool", "{open}");
        let picked = routes[0]["match"]
            .as_mapping_mut()
            .unwrap()
            .remove("dynamic_metadata");
        assert_eq!(
            picked,
            Some(yaml(
                "[{filter: envoy.lb, path: [{key: x-gateway-destination-endpoint}], value: {present_match: true}}]"
            )),
            "{open}"
        );
        let clusters = y["static_resources"]["clusters"].as_sequence_mut().unwrap();
        let pool = clusters.iter().position(|c| c["name"] == "model-pool");
        let pool = clusters.remove(pool.expect("a model-pool cluster"));
        assert_eq!(pool["lb_policy"], "ROUND_ROBIN", "{open}");
        let kv_epp = clusters.iter_mut().find(|c| c["name"] == "kv-epp").unwrap();
        let endpoint = kv_epp["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]
            .as_mapping_mut()
            .unwrap();
        assert!(endpoint.remove("health_check_config").is_some(), "{open}");
        let kv_epp = kv_epp.as_mapping_mut().unwrap();
        assert_eq!(
            kv_epp.remove("common_lb_config"),
            Some(yaml("{healthy_panic_threshold: {value: 0}}")),
            "{open}: no panic routing to a kv-epp known down"
        );
        let checks = kv_epp.remove("health_checks").unwrap();
        assert_eq!(
            checks[0]["grpc_health_check"]["service_name"],
            "envoy.service.ext_proc.v3.ExternalProcessor",
            "{open}"
        );
        assert_eq!(y, read(closed), "{open} drifted from {closed}");
    }
}

/// The certificates of a mutual-TLS rig: kv-epp's (`kv-epp/`) and Envoy's (`envoy/`, with the CA
/// that signed kv-epp's as `ca.crt`), and the client CA kv-epp checks Envoy's against.
struct MtlsFiles {
    kv_epp: std::path::PathBuf,
    envoy: std::path::PathBuf,
    client_ca: std::path::PathBuf,
}

impl MtlsFiles {
    fn write(dir: &std::path::Path) -> MtlsFiles {
        use common::certs::TestCa;
        let server_ca = TestCa::new("kv-epp server CA");
        let client_ca = TestCa::new("gateway client CA");
        let f = MtlsFiles {
            kv_epp: dir.join("kv-epp"),
            envoy: dir.join("envoy"),
            client_ca: dir.join("client-ca.crt"),
        };
        server_ca.leaf(&["kv-epp"]).write_to(&f.kv_epp);
        client_ca.leaf(&["envoy"]).write_to(&f.envoy);
        std::fs::write(f.envoy.join("ca.crt"), server_ca.pem()).unwrap();
        std::fs::write(&f.client_ca, client_ca.pem()).unwrap();
        f
    }
}

async fn prefix_holder_gets_big_body_and_sse_intact(shape: EnvoyShape) {
    let Some(rig) = Rig::start(shape, 3, "").await else {
        return;
    };
    let tokens: Vec<u32> = (0..64).collect();
    let holder = rig.ups[2].addr;
    seed(&rig.server, holder, &tokens, None);
    // A 1 MiB body: the prompt plus padding the engine ignores.
    let head = prompt_body(&tokens, r#","stream":true,"pad":""#);
    let pad = 1_048_576 - (head.len() - 1) - 2;
    let mut body = head[..head.len() - 1].to_vec();
    body.extend(std::iter::repeat_n(b'x', pad));
    body.extend_from_slice(b"\"}");
    assert_eq!(body.len(), 1_048_576);
    for _ in 0..3 {
        let r = rig.post(&[], &body).await;
        assert_eq!(r.status, 200, "{}", r.text());
        assert_eq!(r.header("x-served-by"), Some(holder.to_string().as_str()));
        assert_eq!(r.body, sse_body(holder), "SSE arrives byte-identical");
        let got = rig.ups[2].last().unwrap();
        assert_eq!(
            got.body.as_ref(),
            body.as_slice(),
            "body arrives byte-identical"
        );
        assert_eq!(
            got.headers
                .get("x-gateway-destination-endpoint")
                .map(|v| v.to_str().unwrap()),
            Some(holder.to_string().as_str())
        );
    }
    assert_eq!(rig.ups[0].count() + rig.ups[1].count(), 0);
    if shape == EnvoyShape::FullDuplex {
        // The response passes through kv-epp only when the response body mode streams it.
        let m = rig.metrics().await;
        assert!(
            m.contains("kv_epp_usage_tokens_total{model=\"m\",kind=\"completion\"} 60"),
            "usage parsed from SSE: {m}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn full_duplex_routes_to_prefix_holder_with_exact_bodies() {
    prefix_holder_gets_big_body_and_sse_intact(EnvoyShape::FullDuplex).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn buffered_routes_to_prefix_holder_with_exact_bodies() {
    prefix_holder_gets_big_body_and_sse_intact(EnvoyShape::Buffered).await;
}

async fn routes_with_one_mechanism(shape: EnvoyShape) {
    let Some(rig) = Rig::start(shape, 2, "").await else {
        return;
    };
    let tokens: Vec<u32> = (100..132).collect();
    let holder = rig.ups[0].addr;
    let other = rig.ups[1].addr;
    seed(&rig.server, holder, &tokens, None);
    // The client asks for the other worker; kv-epp's choice must win.
    let r = rig
        .post(
            &[("x-gateway-destination-endpoint", &other.to_string())],
            &prompt_body(&tokens, ""),
        )
        .await;
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.header("x-served-by"), Some(holder.to_string().as_str()));
    assert_eq!(rig.ups[1].count(), 0);
    let got = rig.ups[0].last().unwrap();
    let dests: Vec<_> = got
        .headers
        .get_all("x-gateway-destination-endpoint")
        .iter()
        .collect();
    assert_eq!(
        dests.len(),
        1,
        "the client's copy is overwritten, not appended"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metadata_alone_routes_and_client_header_cannot_choose() {
    routes_with_one_mechanism(EnvoyShape::MetadataOnly).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn header_alone_routes_and_client_header_cannot_choose() {
    routes_with_one_mechanism(EnvoyShape::HeaderOnly).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tls_on_the_ext_proc_port_with_a_generated_certificate() {
    let Some(rig) = Rig::start(
        EnvoyShape::FullDuplexTls,
        2,
        "server: {bind_address: 127.0.0.1, grpc_port: 0, grpc_health_port: 0, metrics_port: 0, admin_port: 0, secure_serving: true}\nevents: {engine: none}\nengine_metrics: {interval_ms: 0}",
    )
    .await
    else {
        return;
    };
    let tokens: Vec<u32> = (40..72).collect();
    seed(&rig.server, rig.ups[1].addr, &tokens, None);
    let r = rig.post(&[], &prompt_body(&tokens, "")).await;
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(
        r.header("x-served-by"),
        Some(rig.ups[1].addr.to_string().as_str())
    );
}

/// Envoy 1.40 with the shipped envoy-mtls.yaml presents its client certificate to a kv-epp that
/// requires one (`client_ca_path`), checks kv-epp's certificate against its CA and name, and
/// requests are routed to the worker kv-epp picks.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn envoy_routes_through_kv_epp_over_mutual_tls() {
    let dir = std::env::temp_dir().join(format!("kv-epp-envoy-mtls-{}", std::process::id()));
    let certs = MtlsFiles::write(&dir);
    let server = format!(
        "server: {{bind_address: 127.0.0.1, grpc_port: 0, grpc_health_port: 0, metrics_port: 0, admin_port: 0, secure_serving: true, cert_path: '{}', client_ca_path: '{}'}}\nevents: {{engine: none}}\nengine_metrics: {{interval_ms: 0}}",
        certs.kv_epp.display(),
        certs.client_ca.display()
    );
    let envoy_dir = certs.envoy.to_str().unwrap().to_owned();
    let Some(rig) = Rig::start_edited(EnvoyShape::FullDuplexMtls, 2, &server, |y| {
        assert!(y.contains(ENVOY_MTLS_DIR));
        y.replace(ENVOY_MTLS_DIR, &envoy_dir)
    })
    .await
    else {
        return;
    };
    let tokens: Vec<u32> = (300..332).collect();
    seed(&rig.server, rig.ups[0].addr, &tokens, None);
    for _ in 0..3 {
        let r = rig.post(&[], &prompt_body(&tokens, "")).await;
        assert_eq!(r.status, 200, "{}", r.text());
        assert_eq!(
            r.header("x-served-by"),
            Some(rig.ups[0].addr.to_string().as_str())
        );
    }
    assert_eq!(rig.ups[1].count(), 0);
    let m = rig.metrics().await;
    assert_eq!(
        metric(&m, "kv_epp_requests_total{model=\"m\",outcome=\"routed\"}"),
        3.0,
        "{m}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tenant_salt_gates_cache_credit() {
    let Some(rig) = Rig::start(EnvoyShape::FullDuplex, 2, "").await else {
        return;
    };
    let tokens: Vec<u32> = (500..532).collect();
    let holder = rig.ups[1].addr;
    seed(&rig.server, holder, &tokens, Some("tenant-a"));
    let body = prompt_body(&tokens, "");
    let r = rig.post(&[("x-tenant-id", "tenant-a")], &body).await;
    assert_eq!(r.header("x-served-by"), Some(holder.to_string().as_str()));
    let m = rig.metrics().await;
    assert_eq!(
        metric(&m, "kv_epp_cached_blocks_total{model=\"m\"}"),
        8.0,
        "{m}"
    );
    // The same prompt under another tenant (header), and under the body's salt fields.
    rig.post(&[("x-tenant-id", "tenant-b")], &body).await;
    rig.post(&[], &prompt_body(&tokens, r#","cache_salt":"tenant-b""#))
        .await;
    rig.post(&[], &body).await;
    let m = rig.metrics().await;
    assert_eq!(
        metric(&m, "kv_epp_cached_blocks_total{model=\"m\"}"),
        8.0,
        "no credit for other tenants or unsalted"
    );
    assert_eq!(metric(&m, "kv_epp_prompt_blocks_total{model=\"m\"}"), 32.0);
    // A body salt equal to tenant-a gets the credit too (same namespace, any source).
    let r = rig
        .post(
            &[],
            &prompt_body(&tokens, r#","nvext":{"cache_salt":"tenant-a"}"#),
        )
        .await;
    assert_eq!(r.header("x-served-by"), Some(holder.to_string().as_str()));
    assert!(
        !m.contains("tenant-a") && !rig.metrics().await.contains("tenant-a"),
        "no raw salt in metrics"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_sees_kv_epp_rejections_with_reasons() {
    let Some(rig) = Rig::start(
        EnvoyShape::FullDuplex,
        1,
        // Flow control off: saturation is answered at once (the queue has its own tests).
        "routing: {max_body_bytes: 4096, max_inflight_per_worker: 1, unknown_model: reject, retry_after_seconds: 3}\nflow_control: {enabled: false}",
    )
    .await
    else {
        return;
    };
    let r = rig.post(&[], b"{not json").await;
    assert_eq!(r.status, 400);
    assert!(r.text().contains("not a JSON object"), "{}", r.text());
    let r = rig.post(&[], br#"{"prompt":[1,2]}"#).await;
    assert_eq!(r.status, 400);
    assert!(r.text().contains("model"));
    let r = rig.post(&[], br#"{"model":"other","prompt":[1]}"#).await;
    assert_eq!(r.status, 404);
    let big = prompt_body(&(0..2000).collect::<Vec<u32>>(), "");
    let r = rig.post(&[], &big).await;
    assert_eq!(r.status, 413);
    assert!(r.text().contains("limit of 4096 bytes"), "{}", r.text());
    // Occupy the only worker, then the next request is shed with 429 + Retry-After.
    let slow = tokio::spawn({
        let addr = rig.addr();
        async move {
            post_json(
                addr,
                "/v1/completions",
                &[],
                br#"{"model":"m","prompt":[1],"delay_ms":1500}"#,
            )
            .await
            .unwrap()
        }
    });
    assert!(eventually(5, || rig.server.picker.workers.total_inflight() == 1).await);
    let r = rig.post(&[], br#"{"model":"m","prompt":[1]}"#).await;
    assert_eq!(r.status, 429);
    assert_eq!(r.header("retry-after"), Some("3"));
    assert_eq!(
        r.header("x-llm-d-request-dropped-reason"),
        Some("rejected-saturated")
    );
    assert_eq!(slow.await.unwrap().status, 200);
    assert!(eventually(5, || rig.server.picker.workers.total_inflight() == 0).await);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_ready_endpoint_is_503() {
    let Some(bin) = envoy_binary() else { return };
    let config = kv_epp_config(&[], "");
    let server = Server::start(&config).await.unwrap();
    let envoy = Envoy::start(&bin, EnvoyShape::FullDuplex, server.grpc_addr.port()).await;
    let r = post_json(
        ("127.0.0.1", envoy.port),
        "/v1/completions",
        &[],
        br#"{"model":"m","prompt":[1]}"#,
    )
    .await
    .unwrap();
    assert_eq!(r.status, 503);
    assert!(r.text().contains("no ready endpoint"), "{}", r.text());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_requests_with_aborts_leave_no_bookings() {
    let Some(rig) = Rig::start(EnvoyShape::FullDuplex, 4, "").await else {
        return;
    };
    let addr = rig.addr();
    let mut tasks = Vec::new();
    for i in 0..200u32 {
        let tokens: Vec<u32> = (i % 7 * 100..i % 7 * 100 + 40).collect();
        let body = prompt_body(
            &tokens,
            if i % 2 == 0 {
                r#","stream":true,"delay_ms":200"#
            } else {
                r#","pad":"0123456789012345678901234567890123456789""#
            },
        );
        tasks.push(tokio::spawn(async move {
            match i % 10 {
                3 => {
                    abort_mid_body(addr, "/v1/completions", &body, body.len() / 2).await;
                    None
                }
                6 => {
                    abort_mid_response(addr, "/v1/completions", &body).await;
                    None
                }
                _ => Some(
                    post_json(addr, "/v1/completions", &[], &body)
                        .await
                        .map(|r| (r.status, r.text())),
                ),
            }
        }));
    }
    let mut ok = 0;
    for t in tasks {
        if let Some(r) = t.await.unwrap() {
            let (status, text) = r.expect("completed request");
            assert_eq!(status, 200, "{text}");
            ok += 1;
        }
    }
    assert_eq!(ok, 160);
    assert!(
        eventually(10, || rig.server.picker.workers.total_inflight() == 0).await,
        "bookings leaked: {}",
        rig.server.picker.workers.total_inflight()
    );
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(rig.server.picker.workers.total_inflight(), 0);
}

async fn header_tenant_wins_and_reaches_the_engine(shape: EnvoyShape) {
    let Some(rig) = Rig::start(shape, 2, "").await else {
        return;
    };
    let tokens: Vec<u32> = (900..932).collect();
    let holder = rig.ups[0].addr;
    seed(&rig.server, holder, &tokens, Some("tenant-a"));
    // The gateway sets x-tenant-id; the client tries to smuggle tenant-b in both body fields.
    let body = prompt_body(
        &tokens,
        r#","cache_salt":"tenant-b","nvext":{"cache_salt":"tenant-b","keep":1}"#,
    );
    let r = rig.post(&[("x-tenant-id", "tenant-a")], &body).await;
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.header("x-served-by"), Some(holder.to_string().as_str()));
    let got = rig.ups[0].last().unwrap();
    let v: serde_json::Value = serde_json::from_slice(&got.body).unwrap();
    assert_eq!(
        v["cache_salt"], "kvepp:tenant-a",
        "the engine caches under tenant-a"
    );
    assert_eq!(v["nvext"], serde_json::json!({"keep": 1}));
    assert!(!String::from_utf8_lossy(&got.body).contains("tenant-b"));
    if let Some(cl) = got.headers.get("content-length") {
        assert_eq!(cl.to_str().unwrap(), got.body.len().to_string());
    }
    // Without a salt anywhere the body arrives byte-identical.
    let plain = prompt_body(&tokens, "");
    rig.post(&[], &plain).await;
    let got = rig
        .ups
        .iter()
        .filter_map(|u| u.last())
        .find(|g| g.body.as_ref() == plain.as_slice());
    assert!(got.is_some(), "unsalted body forwarded unchanged");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn full_duplex_forwards_the_header_tenant_salt() {
    header_tenant_wins_and_reaches_the_engine(EnvoyShape::FullDuplex).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn buffered_forwards_the_header_tenant_salt_with_right_length() {
    header_tenant_wins_and_reaches_the_engine(EnvoyShape::Buffered).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chat_prompts_are_tokenized_per_tenant_and_salts_reach_the_engine() {
    let dir = format!(
        "{}/tests/fixtures/tokenizer/small-bpe",
        env!("CARGO_MANIFEST_DIR")
    );
    let Some(rig) = Rig::start(
        EnvoyShape::FullDuplex,
        2,
        &format!("models: [{{name: m, block_size: 4, tokenizer: {{path: '{dir}'}}}}]"),
    )
    .await
    else {
        return;
    };
    let body = br#"{"model":"m","messages":[{"role":"system","content":"You are a helpful assistant."},{"role":"user","content":"Hello! How are you? Tell me about KV caches."}]}"#;
    // What the engine will compute, from the same tokenizer files.
    let catalog = rig
        .server
        .picker
        .models
        .resolve("m")
        .and_then(|r| r.model.tokenize("/v1/chat/completions", body));
    let tokens = catalog.expect("model has a tokenizer").unwrap();
    assert!(tokens.len() >= 16);
    let holder = rig.ups[1].addr;
    seed(
        &rig.server,
        holder,
        &tokens[..tokens.len() / 4 * 4],
        Some("tenant-a"),
    );
    let r = rig.chat(&[("x-tenant-id", "tenant-a")], body).await;
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.header("x-served-by"), Some(holder.to_string().as_str()));
    let m = rig.metrics().await;
    let cached = metric(&m, "kv_epp_cached_blocks_total{model=\"m\"}");
    assert_eq!(
        cached,
        (tokens.len() / 4) as f64,
        "tenant-a gets full credit: {m}"
    );
    rig.chat(&[("x-tenant-id", "tenant-b")], body).await;
    let m = rig.metrics().await;
    assert_eq!(
        metric(&m, "kv_epp_cached_blocks_total{model=\"m\"}"),
        cached,
        "tenant-b's identical prompt hashes differently: no credit"
    );
    let salts: Vec<String> = rig
        .ups
        .iter()
        .flat_map(|u| u.received.lock().unwrap().clone())
        .map(|g| {
            serde_json::from_slice::<serde_json::Value>(&g.body).unwrap()["cache_salt"]
                .as_str()
                .unwrap_or_default()
                .to_owned()
        })
        .collect();
    assert!(salts.contains(&"kvepp:tenant-a".to_string()), "{salts:?}");
    assert!(salts.contains(&"kvepp:tenant-b".to_string()), "{salts:?}");
    // A malformed chat request is refused by kv-epp with a reason.
    let r = rig.chat(&[], br#"{"model":"m","messages":[]}"#).await;
    assert_eq!(r.status, 400, "{}", r.text());
    // One kv-epp cannot render exactly (it carries its own template, which vLLM accepts under
    // --trust-request-chat-template) is the engine's to judge: routed on load, counted.
    let own_template =
        br#"{"model":"m","chat_template":"{{ 'x' }}","messages":[{"role":"user","content":"hi"}]}"#;
    let r = rig.chat(&[], own_template).await;
    assert_eq!(r.status, 200, "{}", r.text());
    let m = rig.metrics().await;
    assert_eq!(
        metric(
            &m,
            "kv_epp_unrenderable_total{model=\"m\",reason=\"request_chat_template\"}"
        ),
        1.0,
        "{m}"
    );
}

/// Flow control through a real Envoy in both body modes: with the only worker busy past Envoy's
/// 2 s message timeout (BUFFERED's shipped config), a second request waits in kv-epp's queue
/// (BUFFERED: the timer restarted with `override_message_timeout`, accepted up to the shipped
/// `max_message_timeout`) and is served when the worker frees, never a 504.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_queued_request_outlives_envoys_message_timeout_in_both_body_modes() {
    for shape in [EnvoyShape::Buffered, EnvoyShape::FullDuplex] {
        let Some(rig) = Rig::start(shape, 1, "routing: {max_inflight_per_worker: 1}").await else {
            return;
        };
        let slow = tokio::spawn({
            let addr = rig.addr();
            async move {
                post_json(
                    addr,
                    "/v1/completions",
                    &[("x-tenant-id", "first")],
                    br#"{"model":"m","prompt":[1,2,3,4],"delay_ms":3000}"#,
                )
                .await
                .unwrap()
            }
        });
        assert!(eventually(10, || rig.server.picker.workers.total_inflight() == 1).await);
        let started = std::time::Instant::now();
        let r = rig
            .post(
                &[("x-tenant-id", "second")],
                br#"{"model":"m","prompt":[5,6,7,8]}"#,
            )
            .await;
        assert_eq!(r.status, 200, "{shape:?}: {} {:?}", r.text(), r.headers);
        assert_eq!(
            r.header("x-served-by"),
            Some(rig.ups[0].addr.to_string().as_str())
        );
        assert_eq!(slow.await.unwrap().status, 200);
        if shape == EnvoyShape::Buffered {
            assert!(
                started.elapsed() > Duration::from_secs(2),
                "it waited past Envoy's 2 s message timeout"
            );
        }
        let m = rig.metrics().await;
        assert!(
            m.contains("path=\"queued\""),
            "admitted from the queue: {m}"
        );
        assert!(eventually(5, || rig.server.picker.workers.total_inflight() == 0).await);
    }
}
