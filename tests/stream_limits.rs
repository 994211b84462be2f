//! Per-stream limits and stream ends, seen by a real gRPC client on one HTTP/2 connection to an
//! in-process kv-epp: a gRPC message over the limit (413), a stalled stream (408), the shared
//! body budget (503, back to 0 after), and resets before and after the decision counted by kind,
//! each releasing its booking and buffered bytes.

mod common;

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};

use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_client::ExternalProcessorClient;
use envoy_types::pb::envoy::service::ext_proc::v3::processing_request::Request;
use envoy_types::pb::envoy::service::ext_proc::v3::processing_response::Response;
use envoy_types::pb::envoy::service::ext_proc::v3::{
    HttpBody, HttpHeaders, ProcessingRequest, ProcessingResponse,
};
use hyper_util::rt::TokioIo;
use kv_epp::server::Server;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::Streaming;
use tonic::codegen::http::Uri;
use tonic::transport::{Channel, Endpoint};

use common::{eventually, eventually_async, kv_epp_config, metric};

/// A connector handing tonic one socket we keep a handle to, so the test can cut the
/// connection under open streams (what a crashed or restarted Envoy does).
#[derive(Clone)]
struct OneSocket(Arc<Mutex<Option<tokio::net::TcpStream>>>);

impl tonic::codegen::Service<Uri> for OneSocket {
    type Response = TokioIo<tokio::net::TcpStream>;
    type Error = std::io::Error;
    type Future = std::future::Ready<Result<Self::Response, Self::Error>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, _: Uri) -> Self::Future {
        let socket = self.0.lock().unwrap().take();
        std::future::ready(
            socket
                .map(TokioIo::new)
                .ok_or_else(|| std::io::Error::other("the test's socket is used up")),
        )
    }
}

/// A client on one connection, and a handle that can cut that connection.
async fn connect(addr: SocketAddr) -> (ExternalProcessorClient<Channel>, std::net::TcpStream) {
    let socket = std::net::TcpStream::connect(addr).unwrap();
    let cut = socket.try_clone().unwrap();
    socket.set_nonblocking(true).unwrap();
    let socket = tokio::net::TcpStream::from_std(socket).unwrap();
    let channel = Endpoint::from_shared(format!("http://{addr}"))
        .unwrap()
        .connect_with_connector(OneSocket(Arc::new(Mutex::new(Some(socket)))))
        .await
        .unwrap();
    (ExternalProcessorClient::new(channel), cut)
}

/// One open ext_proc stream: what we send, and what kv-epp answers.
struct Exchange {
    send: mpsc::Sender<ProcessingRequest>,
    answers: Streaming<ProcessingResponse>,
}

impl Exchange {
    async fn open(client: &mut ExternalProcessorClient<Channel>) -> Exchange {
        let (send, rx) = mpsc::channel(8);
        send.send(request_headers()).await.unwrap();
        let answers = client
            .process(ReceiverStream::new(rx))
            .await
            .unwrap()
            .into_inner();
        Exchange { send, answers }
    }

    async fn send(&self, msg: ProcessingRequest) {
        self.send.send(msg).await.unwrap();
    }

    async fn answer(&mut self) -> ProcessingResponse {
        self.answers.message().await.unwrap().unwrap()
    }
}

/// FULL_DUPLEX_STREAMED request headers of a completion request with a body.
fn request_headers() -> ProcessingRequest {
    common::extproc::request_headers("/v1/completions", 4, 4, &[])
}

fn body(bytes: &[u8], end_of_stream: bool) -> ProcessingRequest {
    common::extproc::request_body(bytes.to_vec(), end_of_stream)
}

fn response_phase(r: Request) -> ProcessingRequest {
    ProcessingRequest {
        request: Some(r),
        ..Default::default()
    }
}

/// A completion body of exactly `len` bytes (padding inside the prompt), split before its last
/// two bytes so the stream can stop short of the end.
fn completion(len: usize) -> (Vec<u8>, Vec<u8>) {
    let head = br#"{"model":"m","prompt":""#;
    let mut b = head.to_vec();
    b.resize(len - 2, b'x');
    (b, br#""}"#.to_vec())
}

/// The status and `x-llm-d-request-dropped-reason` of a local reply.
fn local_reply(r: &ProcessingResponse) -> (u32, String) {
    let Some(Response::ImmediateResponse(i)) = &r.response else {
        panic!("expected a local reply, got {r:?}");
    };
    let reason = i
        .headers
        .as_ref()
        .and_then(|m| {
            m.set_headers.iter().find_map(|h| {
                let h = h.header.as_ref()?;
                (h.key == "x-llm-d-request-dropped-reason")
                    .then(|| String::from_utf8_lossy(&h.raw_value).into_owned())
            })
        })
        .unwrap_or_default();
    (i.status.as_ref().map_or(0, |s| s.code as u32), reason)
}

async fn start(extra: &str) -> Server {
    let worker: SocketAddr = "127.0.0.1:9".parse().unwrap();
    Server::start(&kv_epp_config(&[worker], extra))
        .await
        .unwrap()
}

/// Waits (30 s at most) until the `series` reads `value` on /metrics.
async fn wait_metric(server: &Server, series: &str, value: f64) {
    let ok = eventually_async(30, move || async move {
        metric(&common::metrics_text(server.metrics_addr).await, series) == value
    })
    .await;
    assert!(
        ok,
        "{series} never became {value}:\n{}",
        common::metrics_text(server.metrics_addr).await
    );
}

const BUFFERED: &str = "kv_epp_buffered_body_bytes";

fn stream_errors(kind: &str) -> String {
    format!("kv_epp_stream_errors_total{{kind=\"{kind}\"}}")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_grpc_message_over_the_limit_gets_413_with_a_reason() {
    // 1 MiB bodies: the server decodes messages up to 5 MiB (4 MiB floor + 1 MiB framing).
    let server = start("routing: {max_body_bytes: 1048576}").await;
    let (mut client, _cut) = connect(server.grpc_addr).await;
    let mut x = Exchange::open(&mut client).await;
    x.send(body(&vec![b'x'; 6 << 20], true)).await;
    let (status, reason) = local_reply(&x.answer().await);
    assert_eq!((status, reason.as_str()), (413, "body-too-large"));
    wait_metric(&server, &stream_errors("message_too_large"), 1.0).await;
    let text = common::metrics_text(server.metrics_addr).await;
    assert_eq!(
        metric(
            &text,
            "kv_epp_requests_total{model=\"\",outcome=\"rejected_too_large\"}"
        ),
        1.0
    );
    assert_eq!(server.picker.workers.total_inflight(), 0);
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_stream_gets_408_and_releases_its_bytes() {
    let server = start("routing: {stream_idle_timeout_ms: 300}").await;
    let (mut client, _cut) = connect(server.grpc_addr).await;
    let mut x = Exchange::open(&mut client).await;
    x.send(body(b"{\"model\":", false)).await;
    // Nothing more: the next answer is the idle refusal.
    let (status, reason) = local_reply(&x.answer().await);
    assert_eq!((status, reason.as_str()), (408, "stream-idle-timeout"));
    wait_metric(&server, &stream_errors("idle_timeout"), 1.0).await;
    wait_metric(&server, BUFFERED, 0.0).await;
    assert_eq!(server.picker.workers.total_inflight(), 0);
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_shared_body_budget_refuses_with_503_and_returns_to_zero() {
    let server = start("routing: {max_body_bytes: 1000, max_buffered_body_bytes: 1500}").await;
    let (mut client, cut) = connect(server.grpc_addr).await;
    let (first, last) = completion(800);
    let mut a = Exchange::open(&mut client).await;
    a.send(body(&first, false)).await;
    wait_metric(&server, BUFFERED, first.len() as f64).await;

    let mut b = Exchange::open(&mut client).await;
    b.send(body(&first, false)).await;
    let (status, reason) = local_reply(&b.answer().await);
    assert_eq!((status, reason.as_str()), (503, "rejected-buffer-full"));
    let text = common::metrics_text(server.metrics_addr).await;
    assert_eq!(metric(&text, BUFFERED), first.len() as f64);

    // The first stream still completes and is routed; its bytes go back after the decision.
    a.send(body(&last, true)).await;
    let decided = a.answer().await;
    assert!(matches!(
        decided.response,
        Some(Response::RequestHeaders(_))
    ));
    wait_metric(&server, BUFFERED, 0.0).await;
    assert_eq!(server.picker.workers.total_inflight(), 1);
    cut.shutdown(std::net::Shutdown::Both).unwrap();
    assert!(
        eventually(30, || server.picker.workers.total_inflight() == 0).await,
        "the booking was not released"
    );
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn resets_are_counted_by_kind_and_release_bookings_and_bytes() {
    let server = start("").await;
    let (mut client, cut) = connect(server.grpc_addr).await;
    let (first, last) = completion(200);

    // Mid-body: buffered, not decided.
    let mid_body = Exchange::open(&mut client).await;
    mid_body.send(body(&first, false)).await;
    wait_metric(&server, BUFFERED, first.len() as f64).await;

    // Decided, response under way.
    let mut mid_response = Exchange::open(&mut client).await;
    mid_response.send(body(&first, false)).await;
    mid_response.send(body(&last, true)).await;
    mid_response.answer().await;

    // Decided and answered to the end: the reset that follows is Envoy's normal end.
    let mut done = Exchange::open(&mut client).await;
    done.send(body(&first, false)).await;
    done.send(body(&last, true)).await;
    done.answer().await;
    done.send(response_phase(Request::ResponseHeaders(
        HttpHeaders::default(),
    )))
    .await;
    done.send(response_phase(Request::ResponseBody(HttpBody {
        body: b"{}".to_vec(),
        end_of_stream: true,
        ..Default::default()
    })))
    .await;
    // Answers so far: the decision, the echoed request body, response headers, response body.
    loop {
        let r = done.answer().await;
        if matches!(r.response, Some(Response::ResponseBody(_))) {
            break;
        }
    }
    assert_eq!(server.picker.workers.total_inflight(), 2);

    // Envoy (or its connection) goes away under all three streams.
    cut.shutdown(std::net::Shutdown::Both).unwrap();
    wait_metric(&server, &stream_errors("reset_before_decision"), 1.0).await;
    wait_metric(&server, &stream_errors("reset_after_decision"), 1.0).await;
    wait_metric(&server, BUFFERED, 0.0).await;
    assert!(
        eventually(30, || server.picker.workers.total_inflight() == 0).await,
        "bookings were not released"
    );
    // Nothing else was counted (the finished stream's reset is not an error).
    let text = common::metrics_text(server.metrics_addr).await;
    let counted: f64 = text
        .lines()
        .filter(|l| l.starts_with("kv_epp_stream_errors_total{"))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum();
    assert_eq!(counted, 2.0, "{text}");
    drop((mid_body, mid_response, done));
    server.stop().await;
}
