//! The ext_proc gRPC edge: a thin tonic adapter that runs one [`stream::StreamHandler`] per
//! Envoy stream. Decisions are `crate::decide`'s, stream state the handler's; this file only moves messages.

pub mod budget;
mod lanes;
pub mod messages;
pub mod stream;
pub mod usage;

use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_server::ExternalProcessor;
use envoy_types::pb::envoy::service::ext_proc::v3::{ProcessingRequest, ProcessingResponse};
use futures_util::Stream;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Code, Request, Response, Status, Streaming};

use crate::decide::{Picker, Reject};
use crate::metrics::Metrics;
use lanes::DecisionLanes;
use stream::{StreamHandler, StreamOptions};

/// Limits the edge enforces on every stream, besides the handler's own.
#[derive(Clone, Copy, Debug)]
pub struct StreamLimits {
    /// Longest wait for Envoy's next message before the decision (408 after it).
    pub idle_before_decision: Duration,
    /// Decisions of small bodies running at once (0 = one per core).
    pub decision_threads: usize,
    /// Decisions of large bodies running at once (0 = half of the small lane's, at least 1).
    pub large_body_decision_threads: usize,
}

/// The ext_proc service.
pub(crate) struct ExtProcService {
    picker: Arc<Picker>,
    metrics: Arc<Metrics>,
    opts: StreamOptions,
    limits: StreamLimits,
    lanes: DecisionLanes,
}

impl ExtProcService {
    /// A service deciding with `picker`, counting in `metrics`.
    pub(crate) fn new(
        picker: Arc<Picker>,
        metrics: Arc<Metrics>,
        opts: StreamOptions,
        limits: StreamLimits,
    ) -> Self {
        ExtProcService {
            picker,
            metrics,
            opts,
            limits,
            lanes: DecisionLanes::new(limits.decision_threads, limits.large_body_decision_threads),
        }
    }
}

type ResponseStream = Pin<Box<dyn Stream<Item = Result<ProcessingResponse, Status>> + Send>>;
type Outbound = mpsc::Sender<Result<ProcessingResponse, Status>>;

#[tonic::async_trait]
impl ExternalProcessor for ExtProcService {
    type ProcessStream = ResponseStream;

    async fn process(
        &self,
        request: Request<Streaming<ProcessingRequest>>,
    ) -> Result<Response<Self::ProcessStream>, Status> {
        let inbound = request.into_inner();
        let (tx, rx) = mpsc::channel(32);
        let handler =
            StreamHandler::new(self.picker.clone(), self.metrics.clone(), self.opts.clone());
        tokio::spawn(run_stream(
            inbound,
            tx,
            handler,
            self.metrics.clone(),
            self.limits,
            self.opts.max_body_bytes,
            self.lanes.clone(),
        ));
        Ok(Response::new(Box::pin(ReceiverStream::new(rx))))
    }
}

/// Feeds one stream's messages to its handler until either side ends it. Every way out drops
/// the handler, which releases its booking and its buffered bytes exactly once.
async fn run_stream(
    mut inbound: Streaming<ProcessingRequest>,
    tx: Outbound,
    mut handler: StreamHandler,
    metrics: Arc<Metrics>,
    limits: StreamLimits,
    max_body_bytes: usize,
    lanes: DecisionLanes,
) {
    // A message that arrived while a decision ran on a lane: handled next.
    let mut pending: Option<ProcessingRequest> = None;
    // Whether the client may still send (false after its half-close).
    let mut open = true;
    loop {
        if let Some(ticket) = handler.ticket() {
            // Queued by flow control: wait for capacity (or the queue timeout) while watching the
            // stream, so a client that goes away leaves the queue at once (dropping the handler
            // drops its ticket). A half-close is not going away: the answer is still read.
            let waited = tokio::select! {
                outcome = ticket.wait() => Ok(outcome),
                next = inbound.message(), if open => Err(next),
                _ = tx.closed() => Err(Err(Status::cancelled("the answers' reader is gone"))),
            };
            match waited {
                Ok(outcome) => {
                    for r in handler.on_dispatched(outcome) {
                        if tx.send(Ok(r)).await.is_err() {
                            if let Some(kind) = reset_kind(&handler) {
                                count_error(&metrics, kind);
                            }
                            return;
                        }
                    }
                    if handler.is_finished() {
                        break;
                    }
                    continue;
                }
                Err(Ok(Some(msg))) => {
                    // Envoy has nothing to send while a request waits for its decision.
                    let e = match handler.on_message(msg) {
                        Err(e) => e.to_string(),
                        Ok(_) => "message while queued".to_owned(),
                    };
                    count_error(&metrics, "protocol");
                    tracing::warn!(error = %e, "ext_proc protocol error");
                    let _ = tx.send(Err(Status::invalid_argument(e))).await;
                    return;
                }
                Err(Ok(None)) => {
                    open = false;
                    continue;
                }
                Err(_) => {
                    count_error(&metrics, "reset_while_queued");
                    return;
                }
            }
        }
        let next = if let Some(msg) = pending.take() {
            Ok(Some(msg))
        } else if handler.decision().is_none() {
            match tokio::time::timeout(limits.idle_before_decision, inbound.message()).await {
                Ok(next) => next,
                Err(_) => {
                    let why = Reject::StreamIdle {
                        after_ms: limits.idle_before_decision.as_millis() as u64,
                    };
                    return end_early(&mut handler, &metrics, "idle_timeout", &why, &tx).await;
                }
            }
        } else {
            inbound.message().await
        };
        let msg = match next {
            Ok(Some(msg)) => msg,
            // Half-close, or Envoy's reset after our last message: a normal end.
            Ok(None) => break,
            Err(status) if over_message_limit(&status) => {
                let why = Reject::BodyTooLarge {
                    limit: max_body_bytes,
                };
                tracing::debug!(%status, "ext_proc message over the size limit");
                return end_early(&mut handler, &metrics, "message_too_large", &why, &tx).await;
            }
            Err(status) => {
                if let Some(kind) = reset_kind(&handler) {
                    count_error(&metrics, kind);
                    tracing::debug!(%status, kind, "ext_proc stream reset");
                }
                break;
            }
        };
        let mut msg = msg;
        // No tokenizer and a bounded body: cheaper here than on a lane thread.
        let inline = handler.decides_inline(&mut msg);
        let result = match handler.decides_on(&msg) {
            Some(_) if inline => handler.on_message(msg),
            // The decisive message that may tokenize, or a large body, runs off the I/O threads.
            Some(body_bytes) => {
                let work = move || {
                    let out = handler.on_message(msg);
                    (handler, out)
                };
                // While it waits for a lane (behind other large bodies) or runs, the stream is
                // watched: a client that goes away drops the work, and with it the handler, its
                // buffered body and its share of the budget, instead of being decided in turn.
                // A half-close is no reason to stop: a client may end its side once it has sent
                // everything and still read the answers; a reset, or the answers' receiver
                // gone, is.
                let decided = lanes.run(body_bytes, work);
                tokio::pin!(decided);
                let ran = loop {
                    tokio::select! {
                        ran = &mut decided => break ran,
                        next = inbound.message(), if open && pending.is_none() => match next {
                            Ok(Some(msg)) => pending = Some(msg),
                            Ok(None) => open = false,
                            Err(_) => {
                                count_error(&metrics, "reset_while_deciding");
                                return;
                            }
                        },
                        _ = tx.closed() => {
                            count_error(&metrics, "reset_while_deciding");
                            return;
                        }
                    }
                };
                match ran {
                    Ok((back, out)) => {
                        handler = back;
                        out
                    }
                    Err(e) => {
                        count_error(&metrics, "protocol");
                        tracing::error!(error = %e, "ext_proc decision failed");
                        let _ = tx.send(Err(Status::internal(e.to_string()))).await;
                        return;
                    }
                }
            }
            None => handler.on_message(msg),
        };
        match result {
            Ok(out) => {
                for r in out {
                    if tx.send(Ok(r)).await.is_err() {
                        // Envoy went away; dropping the handler releases the booking.
                        if let Some(kind) = reset_kind(&handler) {
                            count_error(&metrics, kind);
                        }
                        return;
                    }
                }
            }
            Err(e) => {
                count_error(&metrics, "protocol");
                tracing::warn!(error = %e, "ext_proc protocol error");
                let _ = tx.send(Err(Status::invalid_argument(e.to_string()))).await;
                return;
            }
        }
        if handler.is_finished() {
            break;
        }
    }
}

/// Ends a stream from our side for `why`, counted as `kind`: the local reply when the request is
/// not routed yet, otherwise just the end of the stream.
async fn end_early(
    handler: &mut StreamHandler,
    metrics: &Metrics,
    kind: &str,
    why: &Reject,
    tx: &Outbound,
) {
    count_error(metrics, kind);
    if let Some(reply) = handler.abandon(why) {
        let _ = tx.send(Ok(reply)).await;
    }
}

/// tonic's error for a gRPC message over `max_decoding_message_size`.
fn over_message_limit(status: &Status) -> bool {
    matches!(status.code(), Code::OutOfRange | Code::ResourceExhausted)
        && status.message().contains("too large")
}

/// How a receive error or a closed response stream counts: `None` when the stream was over
/// anyway (a local reply sent, or the response ended: Envoy 1.40 ends finished streams with a
/// reset), else whether the client or Envoy left before or after the decision.
fn reset_kind(handler: &StreamHandler) -> Option<&'static str> {
    if handler.is_finished() || handler.response_done() {
        None
    } else if handler.decision().is_none() {
        Some("reset_before_decision")
    } else {
        Some("reset_after_decision")
    }
}

fn count_error(metrics: &Metrics, kind: &str) {
    metrics
        .stream_errors
        .get_or_create(&Metrics::labels(&[("kind", kind)]))
        .inc();
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Config;
    use crate::extproc::budget::BodyBudget;
    use envoy_types::pb::envoy::config::core::v3::{HeaderMap, HeaderValue};
    use envoy_types::pb::envoy::service::ext_proc::v3::ProtocolConfiguration;
    use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_client::ExternalProcessorClient;
    use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_server::ExternalProcessorServer;
    use envoy_types::pb::envoy::service::ext_proc::v3::processing_request::Request as Req;
    use envoy_types::pb::envoy::service::ext_proc::v3::{HttpBody, HttpHeaders};

    async fn eventually(mut f: impl FnMut() -> bool) -> bool {
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        while std::time::Instant::now() < deadline {
            if f() {
                return true;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        f()
    }

    /// A client that goes away while its decision waits for the large lane (busy with another
    /// body) is dropped at once: its buffered body leaves the budget and the stream is counted
    /// as `reset_while_deciding`, while the lane is still busy. Before, the work (and the body)
    /// waited for the lane and was then decided for nobody.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_client_gone_while_its_decision_waits_for_a_lane_is_dropped_at_once() {
        let c = Config::from_yaml(
            "models: [{name: m, block_size: 4}]\nworkers: [{endpoint: '10.0.0.1:8000', model: m}]",
        )
        .unwrap();
        let metrics = Arc::new(Metrics::new());
        let picker = Arc::new(c.picker(metrics.clone()).unwrap());
        let budget = BodyBudget::new(1 << 30, metrics.buffered_body_bytes.clone());
        let opts = StreamOptions {
            max_body_bytes: 4 << 20,
            retry_after_seconds: 2,
            conformance_hooks: false,
            body_budget: budget.clone(),
            flow: None,
        };
        let limits = StreamLimits {
            idle_before_decision: Duration::from_secs(60),
            decision_threads: 1,
            large_body_decision_threads: 1,
        };
        let service = ExtProcService::new(picker, metrics.clone(), opts, limits);
        // Another body holds the large lane until released.
        let lanes = service.lanes.clone();
        let (release, wait) = std::sync::mpsc::channel::<()>();
        let busy = tokio::spawn({
            let lanes = lanes.clone();
            async move { lanes.run(1 << 20, move || wait.recv().ok()).await }
        });
        assert!(eventually(|| lanes.large_free() == 0).await);
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(
            tonic::transport::Server::builder()
                .add_service(ExternalProcessorServer::new(service))
                .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener)),
        );
        let mut client = ExternalProcessorClient::connect(format!("http://{addr}"))
            .await
            .unwrap();
        // A token-ID prompt over 256 KiB: decided on the large lane, not inline.
        let prompt: Vec<String> = (0..60_000).map(|i| (i % 30_000).to_string()).collect();
        let body = format!(r#"{{"model":"m","prompt":[{}]}}"#, prompt.join(","));
        let (first, last) = body.as_bytes().split_at(body.len() / 2);
        // Headers, then the body in two chunks: the first is held (in the budget) while the
        // last waits for the lane.
        let open = |client: &mut ExternalProcessorClient<tonic::transport::Channel>| {
            let mut client = client.clone();
            let (first, last) = (first.to_vec(), last.to_vec());
            async move {
                let (tx, rx) = mpsc::channel(4);
                let head = ProcessingRequest {
                    protocol_config: Some(ProtocolConfiguration {
                        request_body_mode: 4,
                        response_body_mode: 4,
                        ..Default::default()
                    }),
                    request: Some(Req::RequestHeaders(HttpHeaders {
                        headers: Some(HeaderMap {
                            headers: vec![HeaderValue {
                                key: ":path".into(),
                                value: String::new(),
                                raw_value: b"/v1/completions".to_vec(),
                            }],
                        }),
                        end_of_stream: false,
                        ..Default::default()
                    })),
                    ..Default::default()
                };
                tx.send(head).await.unwrap();
                for (chunk, end) in [(first, false), (last, true)] {
                    let msg = ProcessingRequest {
                        request: Some(Req::RequestBody(HttpBody {
                            body: chunk,
                            end_of_stream: end,
                            ..Default::default()
                        })),
                        ..Default::default()
                    };
                    tx.send(msg).await.unwrap();
                }
                let stream = client
                    .process(ReceiverStream::new(rx))
                    .await
                    .unwrap()
                    .into_inner();
                (tx, stream)
            }
        };
        let (tx, stream) = open(&mut client).await;
        assert!(
            eventually(|| budget.used() >= first.len()).await,
            "the body is held while its decision waits"
        );
        // The client goes away (Envoy resets the stream).
        drop(stream);
        drop(tx);
        let gone = |m: &Metrics| {
            let text = m.encode();
            text.contains("kv_epp_stream_errors_total{kind=\"reset_while_deciding\"} 1")
        };
        assert!(
            eventually(|| budget.used() == 0 && gone(&metrics)).await,
            "dropped while the lane is still busy: {} bytes held",
            budget.used()
        );
        assert_eq!(lanes.large_free(), 0, "the other body still holds the lane");
        // A client that ends its side once it has sent everything (a half-close) still gets
        // its answer when the lane frees.
        let (tx, mut stream) = open(&mut client).await;
        drop(tx);
        assert!(eventually(|| budget.used() >= first.len()).await);
        release.send(()).unwrap();
        busy.await.unwrap().unwrap();
        let answer = tokio::time::timeout(Duration::from_secs(30), stream.message())
            .await
            .expect("an answer")
            .unwrap()
            .expect("the decision");
        assert!(
            matches!(
                answer.response,
                Some(envoy_types::pb::envoy::service::ext_proc::v3::processing_response::Response::RequestHeaders(_))
            ),
            "{answer:?}"
        );
        assert!(gone(&metrics), "counted once");
    }
}
