//! The control ports' authentication, from outside: the admin API behind its bearer token (every
//! route but `/healthz`, the token followed as its file rotates, loopback only without one) and
//! `/metrics` behind a static token or the Kubernetes TokenReview and SubjectAccessReview APIs
//! (the fake API server of `common/kube_api.rs`).

mod common;
#[path = "common/kube_api.rs"]
mod kube_api;

use std::net::IpAddr;
use std::path::{Path, PathBuf};

use common::{HttpResponse, http, metric};
use kube_api::FakeKube;
use kv_epp::config::Config;
use kv_epp::server::Server;

/// Every admin route but liveness, with a body it accepts.
const ROUTES: [(&str, &str, &str); 6] = [
    ("GET", "/workers", ""),
    ("GET", "/debug/digest", ""),
    ("GET", "/debug/replica", ""),
    (
        "POST",
        "/query",
        r#"{"model":"m","token_ids":[1,2,3,4,5,6,7,8]}"#,
    ),
    (
        "POST",
        "/query_by_hash",
        r#"{"model":"m","block_hashes":[1,2]}"#,
    ),
    (
        "POST",
        "/explain",
        r#"{"path":"/v1/completions","body":{"model":"m","prompt":[1,2,3,4]}}"#,
    ),
];

fn temp_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("kv-epp-auth-{}-{name}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// Writes a token file the way a Secret volume updates: a new file renamed over the old one.
fn write_token(path: &Path, token: &str) {
    let next = path.with_extension("next");
    std::fs::write(&next, token).unwrap();
    std::fs::rename(&next, path).unwrap();
}

/// One static worker of model `m`, every port ephemeral; `server` adds `server` keys and `rest`
/// whole sections.
fn config(bind: &str, server: &str, rest: &str) -> Config {
    let yaml = format!(
        "server: {{bind_address: '{bind}', grpc_port: 0, grpc_health_port: 0, metrics_port: 0, admin_port: 0{server}}}\n\
         events: {{engine: none}}\nengine_metrics: {{interval_ms: 0}}\n\
         models: [{{name: m, block_size: 4}}]\nworkers: [{{endpoint: '127.0.0.1:1', model: m}}]\n{rest}"
    );
    let c = Config::from_yaml(&yaml).unwrap();
    c.validate().unwrap();
    c
}

async fn call(server: &Server, route: (&str, &str, &str), token: Option<&str>) -> HttpResponse {
    let (method, path, body) = route;
    let auth = token.map(|t| format!("Bearer {t}"));
    let mut headers = vec![("content-type", "application/json")];
    if let Some(a) = &auth {
        headers.push(("authorization", a));
    }
    let port = server.admin_addr.port();
    http(("127.0.0.1", port), method, path, &headers, body.as_bytes())
        .await
        .unwrap()
}

async fn scrape(server: &Server, authorization: Option<&str>) -> HttpResponse {
    let headers: Vec<(&str, &str)> = authorization
        .map(|a| vec![("authorization", a)])
        .unwrap_or_default();
    let port = server.metrics_addr.port();
    http(("127.0.0.1", port), "GET", "/metrics", &headers, b"")
        .await
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_admin_route_but_liveness_needs_the_token() {
    let token = temp_dir("routes").join("admin-token");
    write_token(&token, "s3cret-admin-token\n");
    let extra = format!(", admin_token_file: '{}'", token.display());
    let server = Server::start(&config("0.0.0.0", &extra, "")).await.unwrap();
    assert_eq!(
        server.admin_addr.ip(),
        "0.0.0.0".parse::<IpAddr>().unwrap(),
        "with a token the admin API listens on bind_address"
    );
    for route in ROUTES {
        let r = call(&server, route, None).await;
        assert_eq!(r.status, 401, "{route:?} without a token: {}", r.text());
        let challenge = r.header("www-authenticate").unwrap_or_default();
        assert!(challenge.starts_with("Bearer "), "{challenge}");
        assert!(r.text().contains("missing bearer token"), "{}", r.text());
        let r = call(&server, route, Some("s3cret-admin-tokem")).await;
        assert_eq!(r.status, 401, "{route:?} with a wrong token");
        let challenge = r.header("www-authenticate").unwrap_or_default();
        assert!(challenge.contains("error=\"invalid_token\""), "{challenge}");
        assert!(
            !r.text().contains("s3cret"),
            "the answer never echoes a token"
        );
        let r = call(&server, route, Some("s3cret-admin-token")).await;
        assert_eq!(r.status, 200, "{route:?} with the token: {}", r.text());
    }
    // Not a bearer credential, and a path that does not exist: refused before routing.
    let port = server.admin_addr.port();
    let basic = [("authorization", "Basic YWRtaW46YWRtaW4=")];
    let r = http(("127.0.0.1", port), "GET", "/workers", &basic, b"")
        .await
        .unwrap();
    assert_eq!(r.status, 401);
    assert_eq!(call(&server, ("GET", "/nope", ""), None).await.status, 401);
    let r = call(&server, ("GET", "/nope", ""), Some("s3cret-admin-token")).await;
    assert_eq!(r.status, 404);
    // Liveness answers anyone.
    let r = call(&server, ("GET", "/healthz", ""), None).await;
    assert_eq!((r.status, r.text().as_str()), (200, "ok"));
    // Refusals are counted by reason.
    let m = scrape(&server, None).await.text();
    let count = |reason: &str| {
        metric(
            &m,
            &format!("kv_epp_admin_unauthenticated_total{{reason=\"{reason}\"}}"),
        )
    };
    assert_eq!(count("missing"), 7.0, "{m}");
    assert_eq!(count("invalid_token"), 6.0, "{m}");
    assert_eq!(count("malformed"), 1.0, "{m}");
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_a_token_the_admin_api_listens_on_loopback_only() {
    let server = Server::start(&config("0.0.0.0", "", "")).await.unwrap();
    assert_eq!(
        server.admin_addr.ip(),
        "127.0.0.1".parse::<IpAddr>().unwrap()
    );
    assert_eq!(
        server.grpc_addr.ip(),
        "0.0.0.0".parse::<IpAddr>().unwrap(),
        "the other listeners keep bind_address"
    );
    assert_eq!(server.metrics_addr.ip(), server.grpc_addr.ip());
    for route in ROUTES {
        let r = call(&server, route, None).await;
        assert_eq!(r.status, 200, "{route:?} is open on loopback: {}", r.text());
    }
    server.stop().await;
    // The same for IPv6, where the host has it.
    if std::net::TcpListener::bind("[::1]:0").is_ok() {
        let server = Server::start(&config("::", "", "")).await.unwrap();
        assert_eq!(server.admin_addr.ip(), "::1".parse::<IpAddr>().unwrap());
        server.stop().await;
    } else {
        eprintln!("no IPv6 loopback here: the :: case is covered by the unit test only");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rotated_admin_token_is_used_without_a_restart() {
    let token = temp_dir("rotate").join("admin-token");
    write_token(&token, "first-token");
    let extra = format!(", admin_token_file: '{}'", token.display());
    let server = Server::start(&config("127.0.0.1", &extra, ""))
        .await
        .unwrap();
    let workers = ROUTES[0];
    assert_eq!(
        call(&server, workers, Some("first-token")).await.status,
        200
    );
    write_token(&token, "second-token");
    assert_eq!(
        call(&server, workers, Some("second-token")).await.status,
        200
    );
    assert_eq!(
        call(&server, workers, Some("first-token")).await.status,
        401,
        "the old token stops working"
    );
    // A Secret being rewritten: an empty file keeps the last good token.
    write_token(&token, "");
    assert_eq!(
        call(&server, workers, Some("second-token")).await.status,
        200
    );
    write_token(&token, "third-token\n");
    assert_eq!(
        call(&server, workers, Some("third-token")).await.status,
        200
    );
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_empty_or_missing_token_file_stops_start_up_naming_the_field() {
    let dir = temp_dir("empty");
    let empty = dir.join("empty-token");
    std::fs::write(&empty, "\n").unwrap();
    let missing = dir.join("no-such-token");
    for (key, path, extra) in [
        ("admin_token_file", &empty, ""),
        ("admin_token_file", &missing, ""),
        ("metrics_token_file", &empty, ", metrics_auth: true"),
    ] {
        let server = format!(", {key}: '{}'{extra}", path.display());
        let e = match Server::start(&config("127.0.0.1", &server, "")).await {
            Ok(_) => panic!("{key} {} was accepted", path.display()),
            Err(e) => e.to_string(),
        };
        assert!(e.contains(&format!("server.{key}")), "{e}");
        assert!(e.contains(&path.display().to_string()), "{e}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_need_the_static_token_when_metrics_auth_is_on() {
    let token = temp_dir("metrics").join("metrics-token");
    write_token(&token, "scrape-me");
    let extra = format!(
        ", metrics_auth: true, metrics_token_file: '{}'",
        token.display()
    );
    let server = Server::start(&config("127.0.0.1", &extra, ""))
        .await
        .unwrap();
    let r = scrape(&server, None).await;
    assert_eq!(r.status, 401);
    assert!(
        r.header("www-authenticate")
            .is_some_and(|c| c.starts_with("Bearer "))
    );
    assert_eq!(scrape(&server, Some("Bearer scrape-mf")).await.status, 401);
    let r = scrape(&server, Some("Bearer scrape-me")).await;
    assert_eq!(r.status, 200);
    let m = r.text();
    assert!(m.contains("kv_epp_decision_seconds_count 0"), "{m}");
    let refused = |reason: &str| {
        metric(
            &m,
            &format!("kv_epp_metrics_unauthenticated_total{{reason=\"{reason}\"}}"),
        )
    };
    assert_eq!((refused("missing"), refused("invalid_token")), (1.0, 1.0));
    // The admin API has no token here: open, on loopback.
    assert_eq!(call(&server, ROUTES[0], None).await.status, 200);
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_tokens_are_reviewed_by_kubernetes_and_cached() {
    let fake = FakeKube::start().await;
    let kubeconfig = fake.kubeconfig(&temp_dir("review"));
    let prometheus = "system:serviceaccount:monitoring:prometheus";
    fake.allow_token("prometheus-token", prometheus);
    fake.grant(prometheus, "/metrics");
    fake.allow_token("other-token", "system:serviceaccount:ai:other");
    let rest = format!("pool: {{kubeconfig: '{}'}}\n", kubeconfig.display());
    let server = Server::start(&config("127.0.0.1", ", metrics_auth: true", &rest))
        .await
        .unwrap();
    assert_eq!(scrape(&server, None).await.status, 401);
    assert_eq!(fake.token_reviews(), 0, "no token, nothing to review");
    let r = scrape(&server, Some("Bearer stolen-token")).await;
    assert_eq!(r.status, 401, "TokenReview: not authenticated");
    let r = scrape(&server, Some("Bearer other-token")).await;
    assert_eq!(r.status, 403, "authenticated, but may not get /metrics");
    assert_eq!(fake.token_reviews(), 2);
    let r = scrape(&server, Some("Bearer prometheus-token")).await;
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(fake.token_reviews(), 3);
    // Allowed tokens are cached: the next scrapes cost no review.
    for _ in 0..3 {
        let r = scrape(&server, Some("Bearer prometheus-token")).await;
        assert_eq!(r.status, 200);
    }
    assert_eq!(fake.token_reviews(), 3);
    // Refused tokens are cached too: the same answers again without a review.
    assert_eq!(
        scrape(&server, Some("Bearer stolen-token")).await.status,
        401
    );
    assert_eq!(
        scrape(&server, Some("Bearer other-token")).await.status,
        403
    );
    assert_eq!(fake.token_reviews(), 3);
    // The API fails: 503 for a token it has not answered for yet, the cached one still passes.
    fake.fail_reviews(true);
    let r = scrape(&server, Some("Bearer new-token")).await;
    assert_eq!(r.status, 503, "{}", r.text());
    let r = scrape(&server, Some("Bearer prometheus-token")).await;
    assert_eq!(r.status, 200);
    let m = r.text();
    let refused = |reason: &str| {
        metric(
            &m,
            &format!("kv_epp_metrics_unauthenticated_total{{reason=\"{reason}\"}}"),
        )
    };
    assert_eq!(
        [
            refused("missing"),
            refused("invalid_token"),
            refused("forbidden"),
            refused("unavailable")
        ],
        [1.0, 2.0, 2.0, 1.0],
        "{m}"
    );
    server.stop().await;
}

/// Whoever reaches the metrics port can send made-up tokens; the TokenReviews they cause are
/// bounded (a few at once, 20 a second on average), the rest answered 503 without asking, and
/// a scraper whose token is cached is served meanwhile.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn made_up_tokens_cannot_flood_the_kubernetes_api_with_reviews() {
    let fake = FakeKube::start().await;
    let kubeconfig = fake.kubeconfig(&temp_dir("flood"));
    let prometheus = "system:serviceaccount:monitoring:prometheus";
    fake.allow_token("prometheus-token", prometheus);
    fake.grant(prometheus, "/metrics");
    let rest = format!("pool: {{kubeconfig: '{}'}}\n", kubeconfig.display());
    let server = Server::start(&config("127.0.0.1", ", metrics_auth: true", &rest))
        .await
        .unwrap();
    assert_eq!(
        scrape(&server, Some("Bearer prometheus-token"))
            .await
            .status,
        200
    );
    let started = std::time::Instant::now();
    let before = fake.token_reviews();
    let s = &server;
    // 12 at once: under the 16 connections one client address may hold.
    for round in 0..15 {
        let calls = (0..12).map(|i| async move {
            let server = s;
            let auth = format!("Bearer junk-{round}-{i}");
            scrape(server, Some(&auth)).await.status
        });
        for status in futures_util::future::join_all(calls).await {
            assert!(status == 401 || status == 503, "{status}");
        }
        assert_eq!(
            scrape(s, Some("Bearer prometheus-token")).await.status,
            200,
            "the cached scraper is served during the flood"
        );
    }
    let reviews = fake.token_reviews() - before;
    let bound = 20.0 + 20.0 * started.elapsed().as_secs_f64() + 4.0;
    assert!(
        (reviews as f64) <= bound,
        "{reviews} reviews for 180 made-up tokens, over {bound:.0}"
    );
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_auth_without_a_token_file_or_kubernetes_stops_start_up() {
    let rest = "pool: {kubeconfig: /nonexistent/kubeconfig}\n";
    let e = match Server::start(&config("127.0.0.1", ", metrics_auth: true", rest)).await {
        Ok(_) => panic!("metrics auth without any way to check tokens was accepted"),
        Err(e) => e.to_string(),
    };
    assert!(e.contains("server.metrics_auth"), "{e}");
    assert!(e.contains("server.metrics_token_file"), "{e}");
}

/// The metrics and admin ports are reachable before any token is checked (that needs the
/// headers): a client that sends half a request is disconnected once the header timeout
/// (10 s) has passed, instead of holding the connection for ever, and the port keeps serving
/// meanwhile.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_half_sent_request_does_not_hold_a_connection() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let server = Server::start(&config("127.0.0.1", "", "")).await.unwrap();
    for addr in [server.metrics_addr, server.admin_addr] {
        let mut tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
        tcp.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\n")
            .await
            .unwrap();
        let r = http(addr, "GET", "/healthz", &[], b"").await.unwrap();
        assert!(r.status < 500, "still serving: {}", r.status);
        // Generous: the timeout is 10 s; a busy machine may take longer to act on it.
        let mut rest = Vec::new();
        let closed = tokio::time::timeout(
            std::time::Duration::from_secs(60),
            tcp.read_to_end(&mut rest),
        )
        .await;
        assert!(
            matches!(closed, Ok(Ok(_)) | Ok(Err(_))),
            "{addr}: the half-sent request still holds its connection after 60 s"
        );
        assert!(
            !String::from_utf8_lossy(&rest).contains("200 OK"),
            "never answered as a whole request"
        );
    }
    server.stop().await;
}

/// `/query` keeps to the model's `max_prompt_tokens` as ext_proc does (400 `prompt-too-long`),
/// so an admin call cannot make kv-epp hash any number of tokens.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn admin_queries_keep_to_the_prompt_limit() {
    let yaml = "server: {bind_address: '127.0.0.1', grpc_port: 0, grpc_health_port: 0, metrics_port: 0, admin_port: 0}\n\
         events: {engine: none}\nengine_metrics: {interval_ms: 0}\n\
         models: [{name: m, block_size: 4, max_prompt_tokens: 16}]\nworkers: [{endpoint: '127.0.0.1:1', model: m}]\n";
    let c = Config::from_yaml(yaml).unwrap();
    c.validate().unwrap();
    let server = Server::start(&c).await.unwrap();
    let query = |n: u32| {
        let body = format!(
            r#"{{"model":"m","token_ids":{:?}}}"#,
            (0..n).collect::<Vec<u32>>()
        );
        async move {
            http(server.admin_addr, "POST", "/query", &[], body.as_bytes())
                .await
                .unwrap()
        }
    };
    assert_eq!(query(16).await.status, 200);
    let r = query(17).await;
    assert_eq!(r.status, 400, "{}", r.text());
    assert!(r.text().contains("prompt-too-long"), "{}", r.text());
    server.stop().await;
}

/// One client address holds at most 16 connections on the metrics (or admin) port: a 17th is
/// closed at once, so a single client cannot take every slot, and its connections count again
/// once closed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_client_cannot_take_every_connection() {
    use tokio::io::AsyncReadExt;
    let server = Server::start(&config("127.0.0.1", "", "")).await.unwrap();
    let addr = server.metrics_addr;
    let mut held = Vec::new();
    for _ in 0..16 {
        held.push(tokio::net::TcpStream::connect(addr).await.unwrap());
    }
    let mut extra = tokio::net::TcpStream::connect(addr).await.unwrap();
    let mut buf = [0u8; 16];
    let closed = tokio::time::timeout(std::time::Duration::from_secs(30), extra.read(&mut buf))
        .await
        .expect("the 17th connection is closed, not kept");
    assert!(matches!(closed, Ok(0) | Err(_)), "{closed:?}");
    drop(held);
    let served = common::eventually_async(30, || async {
        http(addr, "GET", "/metrics", &[], b"")
            .await
            .is_ok_and(|r| r.status == 200)
    })
    .await;
    assert!(served, "served again once the client's connections closed");
    server.stop().await;
}
