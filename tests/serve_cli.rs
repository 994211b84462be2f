//! Black-box tests of `kv-epp serve`: configuration errors, health, metrics, the admin token
//! flag, clean shutdown.

mod common;

use std::process::{Command, Stdio};
use std::time::Duration;

use common::{ChildGuard, free_port, http};
use tonic_health::pb::HealthCheckRequest;
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;

fn kv_epp() -> Command {
    Command::new(env!("CARGO_BIN_EXE_kv-epp"))
}

fn write_config(text: &str) -> std::path::PathBuf {
    let p = std::env::temp_dir().join(format!(
        "kv-epp-cfg-{}-{}.yaml",
        std::process::id(),
        free_port()
    ));
    std::fs::write(&p, text).unwrap();
    p
}

#[test]
fn invalid_configuration_stops_start_up_naming_the_field() {
    let cases = [
        (
            "models: [{name: m, block_size: 16}]\nworkers: [{endpoint: '10.0.0.1:80', model: nope}]",
            "workers[0].model",
        ),
        ("routing: {max_body_bytez: 1}", "max_body_bytez"),
        ("scoring: {temperature: -1}", "scoring.temperature"),
        ("models: [{name: m, block_size: 0}]", "models[0].block_size"),
        (
            "server: {metrics_token_file: /etc/kv-epp/metrics-token}",
            "server.metrics_token_file",
        ),
        (
            "server: {admin_token_file: /nonexistent/admin-token}",
            "server.admin_token_file",
        ),
        (
            "flow_control: {default_tenant: {weight: 0}}",
            "flow_control.default_tenant.weight",
        ),
        (
            "flow_control: {tenants: [{id: acme, band: platinum}]}",
            "flow_control.tenants[0].band",
        ),
        (
            "flow_control: {max_queued_requests: -5}",
            "flow_control.max_queued_requests",
        ),
    ];
    for (yaml, field) in cases {
        let path = write_config(yaml);
        let out = kv_epp()
            .args(["serve", "--config-file", path.to_str().unwrap()])
            .output()
            .unwrap();
        assert!(!out.status.success());
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(field), "expected `{field}` in: {err}");
    }
    let out = kv_epp()
        .args(["serve", "--config-file", "/nonexistent/kv-epp.yaml"])
        .output()
        .unwrap();
    assert!(String::from_utf8_lossy(&out.stderr).contains("/nonexistent/kv-epp.yaml"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serves_health_and_metrics_and_stops_on_sigterm() {
    let (grpc, health, metrics, admin) = (free_port(), free_port(), free_port(), free_port());
    let path = write_config(
        "server: {bind_address: 127.0.0.1, io_threads: 3}\nevents: {engine: none}\nmodels: [{name: m, block_size: 16}]\nworkers: [{endpoint: '127.0.0.1:1', model: m}]",
    );
    let child = kv_epp()
        .args([
            "serve",
            "--config-file",
            path.to_str().unwrap(),
            "--grpc-port",
            &grpc.to_string(),
            "--grpc-health-port",
            &health.to_string(),
            "--metrics-port",
            &metrics.to_string(),
            "--admin-port",
            &admin.to_string(),
            "--secure-serving",
        ])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut guard = ChildGuard(child);
    let url = format!("http://127.0.0.1:{health}");
    let mut client = None;
    for _ in 0..100 {
        let ep = tonic::transport::Endpoint::from_shared(url.clone()).unwrap();
        if let Ok(ch) = ep.connect().await {
            client = Some(HealthClient::new(ch));
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let mut client = client.expect("health port up");
    for service in [
        "liveness",
        "readiness",
        "inference-extension",
        "envoy.service.ext_proc.v3.ExternalProcessor",
    ] {
        let r = client
            .check(HealthCheckRequest {
                service: service.into(),
            })
            .await
            .unwrap()
            .into_inner();
        assert_eq!(r.status, ServingStatus::Serving as i32, "{service}");
    }
    let m = http(("127.0.0.1", metrics), "GET", "/metrics", &[], b"")
        .await
        .unwrap();
    assert_eq!(m.status, 200);
    assert!(
        m.text().contains("kv_epp_decision_seconds_count 0"),
        "{}",
        m.text()
    );
    // `server.io_threads` sizes the runtime (not the machine's core count).
    assert!(m.text().contains("\nkv_epp_io_threads 3\n"), "{}", m.text());
    let w = http(("127.0.0.1", admin), "GET", "/workers", &[], b"")
        .await
        .unwrap();
    assert_eq!(w.status, 200);
    assert!(
        w.text().contains("\"worker\":\"127.0.0.1:1\""),
        "{}",
        w.text()
    );
    // TLS is on: a plaintext HTTP/2 client cannot talk to the ext_proc port.
    let plain = tonic::transport::Endpoint::from_shared(format!("http://127.0.0.1:{grpc}"))
        .unwrap()
        .connect()
        .await;
    if let Ok(ch) = plain {
        let mut hc = HealthClient::new(ch);
        assert!(
            hc.check(HealthCheckRequest {
                service: String::new()
            })
            .await
            .is_err()
        );
    }
    // SIGTERM: a clean exit.
    let pid = guard.0.id() as i32;
    unsafe { libc::kill(pid, libc::SIGTERM) };
    let mut status = None;
    for _ in 0..100 {
        if let Some(s) = guard.0.try_wait().unwrap() {
            status = Some(s);
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(status.expect("exited after SIGTERM").success());
}

/// `--admin-token-file` puts the admin API behind the token (liveness stays open) and serves it
/// on `bind_address`; `--validate-only` reads the file too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn admin_token_file_flag_protects_the_admin_api() {
    let token = write_config("flag-admin-token\n");
    let config = write_config(
        "server: {bind_address: 127.0.0.1}\nevents: {engine: none}\nmodels: [{name: m, block_size: 16}]\nworkers: [{endpoint: '127.0.0.1:1', model: m}]",
    );
    let ports: Vec<String> = (0..4).map(|_| free_port().to_string()).collect();
    let args = |extra: &[&str]| {
        let mut a = vec!["serve", "--config-file", config.to_str().unwrap()];
        a.extend_from_slice(extra);
        a.iter().map(|s| s.to_string()).collect::<Vec<_>>()
    };
    let empty = write_config("");
    let out = kv_epp()
        .args(args(&[
            "--admin-token-file",
            empty.to_str().unwrap(),
            "--validate-only",
        ]))
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("server.admin_token_file") && err.contains("empty"),
        "{err}"
    );
    let child = kv_epp()
        .args(args(&[
            "--admin-token-file",
            token.to_str().unwrap(),
            "--grpc-port",
            &ports[0],
            "--grpc-health-port",
            &ports[1],
            "--metrics-port",
            &ports[2],
            "--admin-port",
            &ports[3],
        ]))
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let _guard = ChildGuard(child);
    let admin = ("127.0.0.1", ports[3].parse::<u16>().unwrap());
    let mut live = None;
    for _ in 0..200 {
        if let Ok(r) = http(admin, "GET", "/healthz", &[], b"").await {
            live = Some(r.status);
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(live, Some(200), "liveness needs no token");
    let w = http(admin, "GET", "/workers", &[], b"").await.unwrap();
    assert_eq!(w.status, 401);
    let bearer = [("authorization", "Bearer flag-admin-token")];
    let w = http(admin, "GET", "/workers", &bearer, b"").await.unwrap();
    assert_eq!(w.status, 200, "{}", w.text());
}
