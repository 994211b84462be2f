//! One ext_proc stream (one HTTP request) as an explicit state machine.
//!
//! ```text
//! AwaitHeaders ──headers(eos)──────────────────────────────▶ Routed ──response…──▶ (stream ends)
//!      │ headers                                               ▲
//!      ▼                                                       │ body complete: decide
//! CollectBody ──body chunks (≤ max_body_bytes)─────────────────┘
//!      └── any rejection (400/404/408/413/429/503) ─▶ Finished (ImmediateResponse sent)
//! ```
//!
//! The buffered body draws on the process-wide [`BodyBudget`] through a guard kept in
//! `CollectBody`, so its bytes return to the budget whenever that state ends. The edge may end a
//! stream early with [`StreamHandler::abandon`] (idle, oversized gRPC message): the same local
//! reply path as any other refusal.
//!
//! FULL_DUPLEX_STREAMED: the header response waits for the whole body (routing needs it), then the
//! body is streamed back in chunks. BUFFERED: headers are answered at once, the decision rides on
//! the body response. The handler is synchronous and owns the request's [`Booking`] (inside the
//! decision), so whatever ends the stream (response end, client abort, Envoy reset, error) drops
//! the handler and releases the booking exactly once.
//!
//! [`Booking`]: crate::workers::Booking

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::Instant;

use envoy_types::pb::envoy::config::core::v3::{HeaderMap, Metadata};
use envoy_types::pb::envoy::service::ext_proc::v3::{
    BodyMutation, CommonResponse, HttpBody, HttpHeaders, ProcessingRequest, ProcessingResponse,
    body_mutation, processing_request::Request,
};
use envoy_types::pb::google::protobuf::value::Kind;

use super::budget::{BodyBudget, Held, OverBudget};
use super::messages::{self, DESTINATION, LB_NAMESPACE, Phase};
use super::usage::UsageScanner;
use crate::decide::{
    self, Decision, Picker, ROUTED, Reject, RequestParts, Routed, TOKENIZE_FAILED,
};
use crate::flow::{Admission, FlowControl, Outcome, TenantSlot, Ticket};
use crate::metrics::Metrics;
use crate::request::{self, ParsedBody, RequestError};
use kv_epp_core::salt::TENANT_HEADER;
use kv_epp_tokenize::request::Endpoint;

/// Bodies under this many bytes whose prompt needs no tokenizer are decided on the I/O thread
/// (a 32k-token token-ID prompt is about 190 KB; parsing it there takes ~0.1 ms).
pub(crate) const INLINE_BODY_BYTES: usize = 256 << 10;

/// Options of the stream handler (from the configuration).
#[derive(Clone, Debug)]
pub struct StreamOptions {
    /// 413 above this many body bytes.
    pub max_body_bytes: usize,
    /// `Retry-After` on 429.
    pub retry_after_seconds: u32,
    /// Honour the GIE conformance headers.
    pub conformance_hooks: bool,
    /// The process-wide budget buffered request bodies draw on (503 when exhausted).
    pub body_budget: BodyBudget,
    /// Flow control: quotas, and the queue a request waits in when no candidate can take it
    /// (`None`: neither; saturation is answered 429 at once).
    pub flow: Option<Arc<FlowControl>>,
}

const SUBSET_NAMESPACE: &str = "envoy.lb.subset_hint";
const SUBSET_KEY: &str = "x-gateway-destination-endpoint-subset";
const SERVED_KEY: &str = "x-gateway-destination-endpoint-served";
const CONFORMANCE_SELECT: &str = "test-epp-endpoint-selection";
const CONFORMANCE_SERVED: &str = "x-conformance-test-served-endpoint";

// envoy.extensions.filters.http.ext_proc.v3.ProcessingMode.BodySendMode values.
const SEND_NONE: i32 = 0;
const SEND_STREAMED: i32 = 1;
const SEND_BUFFERED_PARTIAL: i32 = 3;
const SEND_FULL_DUPLEX: i32 = 4;

/// Body handling Envoy announced in `protocol_config`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum BodyMode {
    /// FULL_DUPLEX_STREAMED: echo every byte back as streamed chunks.
    FullDuplex,
    /// BUFFERED (or any non-streaming mode): answer with plain body responses.
    Buffered,
}

impl BodyMode {
    fn from_proto(mode: i32) -> BodyMode {
        // envoy.extensions.filters.http.ext_proc.v3.ProcessingMode.BodySendMode
        if mode == 4 {
            BodyMode::FullDuplex
        } else {
            BodyMode::Buffered
        }
    }
}

/// What the request headers told us.
#[derive(Debug, Default)]
struct RequestHead {
    path: String,
    tenant: Vec<Vec<u8>>,
    /// Client-sent control headers to strip before forwarding.
    strip: Vec<String>,
    subset: Option<Vec<SocketAddr>>,
    conformance_ips: Option<Vec<IpAddr>>,
    /// The request's `content-length`, when it has one.
    content_length: Option<usize>,
}

#[derive(Debug)]
enum State {
    AwaitHeaders,
    CollectBody {
        head: RequestHead,
        body: Vec<u8>,
        /// The body's share of the budget; returned when this state ends, whatever ends it.
        held: Held,
    },
    /// Waiting in flow control's queue for capacity; the body (and its budget share) is kept to
    /// be forwarded once routed.
    Queued {
        head: RequestHead,
        body: Option<Vec<u8>>,
        phase: Phase,
        body_ends: bool,
        /// Trailers ended the body: answer them after the decision.
        trailers: bool,
        held: Option<Held>,
        ticket: Ticket,
        /// The decision's time before it queued (the wait itself is flow control's metric).
        decided_in: std::time::Duration,
    },
    Routed {
        /// The booking and a fixed-size summary: never the tokens, hashes or reports.
        decision: Routed,
        usage: Option<UsageScanner>,
        /// The response has ended (its last message arrived): a reset now is Envoy's normal end.
        response_done: bool,
    },
    Finished,
}

/// A protocol violation by the ext_proc client (Envoy): the stream fails with this message.
#[derive(Debug, thiserror::Error)]
#[error("unexpected ext_proc message: {0}")]
pub struct ProtocolError(pub String);

/// The handler of one stream.
pub struct StreamHandler {
    picker: Arc<Picker>,
    metrics: Arc<Metrics>,
    opts: StreamOptions,
    request_mode: BodyMode,
    /// The request body mode as Envoy announced it (`SEND_*`).
    request_send: i32,
    response_mode: BodyMode,
    /// Whether Envoy sends response bodies at all (response body mode other than NONE).
    response_body_sent: bool,
    state: State,
    /// The tenant's in-flight slot (quotas, per-tenant metrics), held until the stream ends.
    slot: Option<TenantSlot>,
    /// The body as [`StreamHandler::decides_inline`] parsed it, for the decision it precedes.
    parsed_ahead: Option<Result<ParsedBody, RequestError>>,
}

/// Appends a body chunk to the buffered `body`, its bytes drawn on the stream's budget share
/// first (nothing taken when the budget refuses). The chunk moves when the body is still empty,
/// so a body that arrives in one chunk is never copied; `chunk` is left empty.
fn absorb(body: &mut Vec<u8>, held: &mut Held, chunk: &mut Vec<u8>) -> Result<(), OverBudget> {
    held.grow(chunk.len())?;
    if body.is_empty() {
        *body = std::mem::take(chunk);
    } else {
        body.extend_from_slice(chunk);
        *chunk = Vec::new();
    }
    Ok(())
}

impl StreamHandler {
    /// A handler for a new stream deciding with `picker`, counting in `metrics`.
    pub fn new(picker: Arc<Picker>, metrics: Arc<Metrics>, opts: StreamOptions) -> Self {
        StreamHandler {
            picker,
            metrics,
            opts,
            request_mode: BodyMode::FullDuplex,
            request_send: SEND_FULL_DUPLEX,
            response_mode: BodyMode::FullDuplex,
            response_body_sent: true,
            state: State::AwaitHeaders,
            slot: None,
            parsed_ahead: None,
        }
    }

    /// Whether the stream is over from our side (a local reply was sent).
    pub fn is_finished(&self) -> bool {
        matches!(self.state, State::Finished)
    }

    /// What the stream keeps of its routing decision, once made.
    pub fn decision(&self) -> Option<&Routed> {
        match &self.state {
            State::Routed { decision, .. } => Some(decision),
            _ => None,
        }
    }

    /// Whether the routed request's response has ended, so that an Envoy reset now is the
    /// normal end of the stream rather than a client going away mid-response.
    pub fn response_done(&self) -> bool {
        matches!(
            self.state,
            State::Routed {
                response_done: true,
                ..
            }
        )
    }

    /// The body bytes the decision would cover if `msg` makes it (the end of the request body,
    /// trailers after it, or headers of a body-less request); `None` when `msg` decides nothing.
    /// Lets the edge move the expensive message (tokenization) off the I/O threads by cost.
    pub fn decides_on(&self, msg: &ProcessingRequest) -> Option<usize> {
        match (&self.state, msg.request.as_ref()?) {
            (State::AwaitHeaders, Request::RequestHeaders(h)) if h.end_of_stream => Some(0),
            (State::CollectBody { body, head, .. }, Request::RequestBody(b))
                if self.ends_body(head, body.len() + b.body.len(), b.end_of_stream) =>
            {
                Some(body.len() + b.body.len())
            }
            (State::CollectBody { body, .. }, Request::RequestTrailers(_)) => Some(body.len()),
            _ => None,
        }
    }

    /// Whether a request body message that brings the body to `len` bytes ends it: it has
    /// end-of-stream, or comes without it because trailers follow, which BUFFERED does with its
    /// one message (the whole body) and BUFFERED_PARTIAL with a body of its `content-length`
    /// (without it, the body was cut at Envoy's buffer limit).
    fn ends_body(&self, head: &RequestHead, len: usize, end_of_stream: bool) -> bool {
        end_of_stream
            || match self.request_send {
                SEND_BUFFERED_PARTIAL => head.content_length == Some(len),
                _ => self.request_mode == BodyMode::Buffered,
            }
    }

    /// Whether the decision `msg` makes may run on the calling (I/O) thread: it needs no
    /// tokenizer (no body, a token-ID prompt, or a body refused as it parses) and its body is
    /// under [`INLINE_BODY_BYTES`], so parsing, hashing and scoring cost less than handing the
    /// stream to a lane thread and back. A chat or Responses request is known to need one from its
    /// path, so its body is left for the lane to parse; any other body is parsed here to know, and
    /// the decision reuses that parse. To parse it whole, the last chunk joins the buffered body here (drawing on the budget as
    /// [`StreamHandler::on_message`] would; `msg` keeps an empty chunk), unless the budget is
    /// full, which `on_message` then refuses as before.
    pub fn decides_inline(&mut self, msg: &mut ProcessingRequest) -> bool {
        let Some(bytes) = self.decides_on(msg) else {
            return false;
        };
        if bytes == 0 {
            return true;
        }
        if bytes >= INLINE_BODY_BYTES || bytes > self.opts.max_body_bytes {
            return false;
        }
        let State::CollectBody { head, body, held } = &mut self.state else {
            return false;
        };
        if matches!(
            Endpoint::from_path(&head.path),
            Some(Endpoint::ChatCompletions | Endpoint::Responses)
        ) {
            return false;
        }
        if let Some(Request::RequestBody(b)) = &mut msg.request
            && absorb(body, held, &mut b.body).is_err()
        {
            return false;
        }
        let parsed = request::parse(body);
        let inline = parsed.as_ref().map_or(true, |p| !p.needs_tokenizer());
        self.parsed_ahead = Some(parsed);
        inline
    }

    /// Ends the stream from the edge's side for `why` (no data in time, a gRPC message over the
    /// limit): before the decision this counts the refusal and returns the local reply to send,
    /// releasing the buffered body; once routed the reply can no longer replace the response, so
    /// it returns `None` and the stream just ends (dropping the handler releases the booking).
    pub fn abandon(&mut self, why: &Reject) -> Option<ProcessingResponse> {
        match self.state {
            State::AwaitHeaders | State::CollectBody { .. } | State::Queued { .. } => {
                let (next, mut out) = self.refuse(why);
                self.state = next;
                out.pop()
            }
            State::Routed { .. } | State::Finished => None,
        }
    }

    /// Handles one message from Envoy, returning the messages to send back in order.
    pub fn on_message(
        &mut self,
        msg: ProcessingRequest,
    ) -> Result<Vec<ProcessingResponse>, ProtocolError> {
        // Envoy announces its body modes once, on a stream's first message; a later
        // announcement would make answers leave the phase Envoy expects them in.
        if let (Some(pc), State::AwaitHeaders) = (&msg.protocol_config, &self.state) {
            self.request_mode = BodyMode::from_proto(pc.request_body_mode);
            self.request_send = pc.request_body_mode;
            self.response_mode = BodyMode::from_proto(pc.response_body_mode);
            // envoy.extensions.filters.http.ext_proc.v3.ProcessingMode.BodySendMode.NONE
            self.response_body_sent = pc.response_body_mode != 0;
        }
        let metadata = msg.metadata_context;
        let Some(request) = msg.request else {
            return Err(ProtocolError("message without a request".into()));
        };
        let state = std::mem::replace(&mut self.state, State::Finished);
        let (next, out) = match (state, request) {
            (State::AwaitHeaders, Request::RequestHeaders(h)) => {
                self.on_request_headers(h, metadata.as_ref())
            }
            (
                State::CollectBody {
                    head,
                    mut body,
                    mut held,
                },
                Request::RequestBody(mut b),
            ) => {
                if body.len() + b.body.len() > self.opts.max_body_bytes {
                    self.refuse(&Reject::BodyTooLarge {
                        limit: self.opts.max_body_bytes,
                    })
                } else if absorb(&mut body, &mut held, &mut b.body).is_err() {
                    self.refuse(&Reject::BufferFull {
                        budget: self.opts.body_budget.limit(),
                    })
                } else if self.ends_body(&head, body.len(), b.end_of_stream) {
                    // The body moves into the decision; the guard returns its bytes after it
                    // (or after the queue, when the request waits there). Without end-of-stream
                    // Envoy waits for this answer before it sends the trailers (or skips them).
                    self.decide(head, body, b.end_of_stream, held, false)
                } else if self.request_send == SEND_BUFFERED_PARTIAL {
                    // Cut at Envoy's buffer limit: the rest would go upstream unseen, so neither
                    // the prompt nor the salt's rewrite can be had.
                    self.refuse(&Reject::PartialBody)
                } else {
                    (State::CollectBody { head, body, held }, Vec::new())
                }
            }
            (State::CollectBody { head, body, held }, Request::RequestTrailers(_)) => {
                // The body ended without an end-of-stream flag: trailers follow it.
                let (next, mut out) = self.decide(head, body, false, held, true);
                if matches!(next, State::Routed { .. }) {
                    out.push(messages::trailers(true));
                }
                (next, out)
            }
            (
                State::Routed {
                    decision,
                    usage,
                    response_done,
                },
                Request::RequestBody(b),
            ) => {
                // Body after a header-time decision: pass it through unchanged.
                let out = self.pass_body(Phase::RequestBody, self.request_mode, b);
                (
                    State::Routed {
                        decision,
                        usage,
                        response_done,
                    },
                    out,
                )
            }
            (state @ State::Routed { .. }, Request::RequestTrailers(_)) => {
                (state, vec![messages::trailers(true)])
            }
            (State::Routed { decision, .. }, Request::ResponseHeaders(h)) => {
                let (usage, out) = self.on_response_headers(&decision, &h, metadata.as_ref());
                let response_done = h.end_of_stream || !self.response_body_sent;
                (
                    State::Routed {
                        decision,
                        usage,
                        response_done,
                    },
                    out,
                )
            }
            (
                State::Routed {
                    decision, usage, ..
                },
                Request::ResponseBody(b),
            ) => {
                let end = b.end_of_stream;
                let usage = match usage {
                    Some(mut scanner) => {
                        scanner.feed(&b.body);
                        if end {
                            self.record_usage(&decision, scanner);
                            None
                        } else {
                            Some(scanner)
                        }
                    }
                    None => None,
                };
                let out = self.pass_body(Phase::ResponseBody, self.response_mode, b);
                (
                    State::Routed {
                        decision,
                        usage,
                        response_done: end,
                    },
                    out,
                )
            }
            (
                State::Routed {
                    decision, usage, ..
                },
                Request::ResponseTrailers(_),
            ) => (
                State::Routed {
                    decision,
                    usage,
                    response_done: true,
                },
                vec![messages::trailers(false)],
            ),
            (state, other) => {
                let what = match other {
                    Request::RequestHeaders(_) => "request headers",
                    Request::ResponseHeaders(_) => "response headers",
                    Request::RequestBody(_) => "request body",
                    Request::ResponseBody(_) => "response body",
                    Request::RequestTrailers(_) => "request trailers",
                    Request::ResponseTrailers(_) => "response trailers",
                };
                let phase = match state {
                    State::AwaitHeaders => "before request headers",
                    State::CollectBody { .. } => "while collecting the request body",
                    State::Queued { .. } => "while queued",
                    State::Routed { .. } => "after routing",
                    State::Finished => "after a local reply",
                };
                return Err(ProtocolError(format!("{what} {phase}")));
            }
        };
        self.state = next;
        Ok(out)
    }

    fn on_request_headers(
        &mut self,
        h: HttpHeaders,
        metadata: Option<&Metadata>,
    ) -> (State, Vec<ProcessingResponse>) {
        let head = self.read_head(h.headers.as_ref(), metadata);
        if h.end_of_stream {
            // No body follows: route on load alone, answer now.
            return self.route_and_answer(head, None, Phase::RequestHeaders, true, None, false);
        }
        // STREAMED lets the headers go upstream before any body response, and NONE sends no
        // body: a body-aware decision cannot be made, nor the salt forwarded in the body.
        let unsupported = match self.request_send {
            SEND_NONE => Some("NONE"),
            SEND_STREAMED => Some("STREAMED"),
            _ => None,
        };
        if let Some(mode) = unsupported {
            return self.refuse(&Reject::UnsupportedBodyMode { mode });
        }
        let held = self.opts.body_budget.hold();
        match self.request_mode {
            BodyMode::FullDuplex => (
                State::CollectBody {
                    head,
                    body: Vec::new(),
                    held,
                },
                Vec::new(),
            ),
            BodyMode::Buffered => {
                // Answer at once; strip client routing headers now, route on the body response.
                let mut strip = head.strip.clone();
                strip.push(DESTINATION.to_owned());
                let resp = messages::common(
                    Phase::RequestHeaders,
                    CommonResponse {
                        header_mutation: messages::mutation(Vec::new(), strip),
                        ..CommonResponse::default()
                    },
                    None,
                );
                (
                    State::CollectBody {
                        head,
                        body: Vec::new(),
                        held,
                    },
                    vec![resp],
                )
            }
        }
    }

    fn read_head(&self, headers: Option<&HeaderMap>, metadata: Option<&Metadata>) -> RequestHead {
        let mut head = RequestHead::default();
        for hv in headers.map(|h| h.headers.as_slice()).unwrap_or_default() {
            let key = hv.key.to_ascii_lowercase();
            let value = if hv.raw_value.is_empty() {
                hv.value.as_bytes()
            } else {
                hv.raw_value.as_slice()
            };
            if key == ":path" {
                head.path = String::from_utf8_lossy(value).into_owned();
            } else if key == "content-length" {
                head.content_length = std::str::from_utf8(value)
                    .ok()
                    .and_then(|v| v.trim().parse().ok());
            } else if key == TENANT_HEADER {
                head.tenant.push(value.to_vec());
            } else if key == CONFORMANCE_SELECT {
                if self.opts.conformance_hooks {
                    let ips = String::from_utf8_lossy(value)
                        .split(',')
                        .filter_map(|s| s.trim().parse().ok())
                        .collect();
                    head.conformance_ips = Some(ips);
                }
                head.strip.push(key);
            } else if (key.starts_with(DESTINATION) && key != DESTINATION)
                || key == CONFORMANCE_SERVED
            {
                head.strip.push(key);
            }
        }
        head.subset = subset_hint(metadata);
        head
    }

    /// Decides on the whole body, in the phase the body mode answers in.
    fn decide(
        &mut self,
        head: RequestHead,
        body: Vec<u8>,
        body_ends: bool,
        held: Held,
        trailers: bool,
    ) -> (State, Vec<ProcessingResponse>) {
        let phase = match self.request_mode {
            BodyMode::FullDuplex => Phase::RequestHeaders,
            BodyMode::Buffered => Phase::RequestBody,
        };
        self.route_and_answer(head, Some(body), phase, body_ends, Some(held), trailers)
    }

    /// The edge's whole share of a decision: typed parts in, Envoy messages out.
    fn route_and_answer(
        &mut self,
        head: RequestHead,
        body: Option<Vec<u8>>,
        phase: Phase,
        body_ends: bool,
        held: Option<Held>,
        trailers: bool,
    ) -> (State, Vec<ProcessingResponse>) {
        let started = Instant::now();
        let metrics = self.metrics.clone();
        let tenant: Vec<&[u8]> = head.tenant.iter().map(Vec::as_slice).collect();
        let parts = RequestParts {
            path: &head.path,
            tenant: &tenant,
            body: body.as_deref(),
            subset: head.subset.as_deref(),
            conformance: head.conformance_ips.as_deref(),
        };
        let request =
            match decide::understand_parsed(&self.picker, &parts, self.parsed_ahead.take()) {
                Ok(r) => r,
                Err(reject) => return self.refuse(&reject),
            };
        if let Some(e) = &request.tokenize_failure {
            // Counted whatever happens next: a refusal must not hide our own failure.
            tracing::warn!(error = %e, "tokenization failed; routing on load alone");
            let base = request.model.base.as_deref().unwrap_or("unknown");
            metrics.request(base, TOKENIZE_FAILED);
        }
        if let Some(reason) = request.unrenderable_reason() {
            // The error text may quote the request (a template's message): never logged.
            let base = request.model.base.as_deref().unwrap_or("unknown");
            if metrics.unrenderable(base, reason) {
                tracing::warn!(
                    model = base,
                    reason,
                    "kv-epp cannot render such requests exactly as the engine would; routing \
                     them on load alone (logged once per model and reason, counted in \
                     kv_epp_unrenderable_total; routing.unrenderable: reject refuses them)"
                );
            }
        }
        let decision = match self.opts.flow.clone() {
            None => match decide::decide_understood(&self.picker, request, &parts) {
                Ok(d) => d,
                Err(reject) => return self.refuse(&reject),
            },
            Some(flow) => {
                let body_bytes = body.as_ref().map_or(0, Vec::len);
                match flow.admit(request, &parts, body_bytes) {
                    Admission::Now(d, slot) => {
                        self.slot = Some(slot);
                        *d
                    }
                    Admission::Refused(reject) => return self.refuse(&reject),
                    Admission::Queued(ticket) => {
                        let mut out = Vec::new();
                        if self.request_mode == BodyMode::Buffered {
                            // Envoy's message timer (BUFFERED only) would answer 504 while the
                            // request waits: restart it long enough for the whole wait.
                            out.push(messages::override_message_timeout(ticket.message_timeout()));
                        }
                        let state = State::Queued {
                            head,
                            body,
                            phase,
                            body_ends,
                            trailers,
                            held,
                            ticket,
                            decided_in: started.elapsed(),
                        };
                        return (state, out);
                    }
                }
            }
        };
        drop(held);
        self.answer(head, body, phase, body_ends, decision, started)
    }

    /// The queued request's ticket, while it waits: the edge awaits it beside the stream.
    pub fn ticket(&mut self) -> Option<&mut Ticket> {
        match &mut self.state {
            State::Queued { ticket, .. } => Some(ticket),
            _ => None,
        }
    }

    /// Answers a queued request with what its dispatch gave: the routing messages, or the
    /// refusal (timeout, or the decision's own).
    pub fn on_dispatched(&mut self, outcome: Outcome) -> Vec<ProcessingResponse> {
        let state = std::mem::replace(&mut self.state, State::Finished);
        let State::Queued {
            head,
            body,
            phase,
            body_ends,
            trailers,
            held,
            ticket,
            decided_in,
        } = state
        else {
            self.state = state;
            return Vec::new();
        };
        drop(ticket);
        drop(held);
        let (next, out) = match outcome {
            Err(reject) => self.refuse(&reject),
            Ok((decision, slot)) => {
                self.slot = Some(slot);
                let started = Instant::now()
                    .checked_sub(decided_in)
                    .unwrap_or_else(Instant::now);
                let (next, mut out) = self.answer(head, body, phase, body_ends, decision, started);
                if trailers {
                    out.push(messages::trailers(true));
                }
                (next, out)
            }
        };
        self.state = next;
        out
    }

    /// The routing messages of a decision, and the stream's state after it.
    fn answer(
        &mut self,
        head: RequestHead,
        body: Option<Vec<u8>>,
        phase: Phase,
        body_ends: bool,
        mut decision: Decision,
        started: Instant,
    ) -> (State, Vec<ProcessingResponse>) {
        let metrics = self.metrics.clone();
        let label_model = decision.model_label().to_owned();
        metrics
            .decision_seconds
            .observe(started.elapsed().as_secs_f64());
        metrics.request(&label_model, ROUTED);
        let labels = Metrics::labels(&[("model", &label_model)]);
        if !self.picker.policy.salted_events && decision.request.salt.is_some() {
            metrics
                .unisolated_salted_requests
                .get_or_create(&labels)
                .inc();
        }
        metrics
            .prompt_blocks
            .get_or_create(&labels)
            .inc_by(u64::from(decision.request.prompt_blocks()));
        metrics
            .cached_blocks
            .get_or_create(&labels)
            .inc_by(decision.cached_blocks.floor() as u64);
        tracing::debug!(
            worker = %decision.pick,
            model = label_model,
            salt = ?decision.request.salt,
            prompt_blocks = decision.request.prompt_blocks(),
            cached_blocks = decision.cached_blocks,
            "routed"
        );
        let mut rewritten = decision.request.rewritten_body.take();
        let destination = decision.destination();
        // From here on the stream keeps only the booking and a fixed-size summary.
        let decision = decision.into_routed();
        let mut set = vec![messages::set_header(DESTINATION, destination.as_bytes())];
        let mut body_mutation = None;
        if self.request_mode == BodyMode::Buffered
            && let Some(new) = rewritten.take()
        {
            set.push(messages::set_header(
                "content-length",
                new.len().to_string().as_bytes(),
            ));
            body_mutation = Some(BodyMutation {
                mutation: Some(body_mutation::Mutation::Body(new)),
            });
        }
        let mut out = vec![messages::common(
            phase,
            CommonResponse {
                header_mutation: messages::mutation(set, head.strip),
                body_mutation,
                clear_route_cache: true,
                ..CommonResponse::default()
            },
            Some(messages::decision_metadata(&destination, &decision)),
        )];
        if let (BodyMode::FullDuplex, Some(body), Phase::RequestHeaders) =
            (self.request_mode, body, phase)
        {
            let forward = rewritten.unwrap_or(body);
            out.extend(messages::stream_body(
                Phase::RequestBody,
                forward,
                body_ends,
            ));
        }
        (
            State::Routed {
                decision,
                usage: None,
                response_done: false,
            },
            out,
        )
    }

    /// Counts a refusal and answers it with a local reply.
    fn refuse(&self, reject: &Reject) -> (State, Vec<ProcessingResponse>) {
        self.metrics.request(reject.model_label(), reject.outcome());
        let reply = messages::immediate(reject, self.opts.retry_after_seconds);
        (State::Finished, vec![reply])
    }

    fn on_response_headers(
        &self,
        decision: &Routed,
        h: &HttpHeaders,
        metadata: Option<&Metadata>,
    ) -> (Option<UsageScanner>, Vec<ProcessingResponse>) {
        let mut content_type = String::new();
        for hv in h
            .headers
            .as_ref()
            .map(|m| m.headers.as_slice())
            .unwrap_or_default()
        {
            if hv.key.eq_ignore_ascii_case("content-type") {
                let v = if hv.raw_value.is_empty() {
                    hv.value.as_bytes()
                } else {
                    &hv.raw_value
                };
                content_type = String::from_utf8_lossy(v).to_ascii_lowercase();
            }
        }
        let served = served_endpoint(metadata);
        let mut set = Vec::new();
        if let Some(served) = &served {
            let picked = decision.pick.endpoint.to_string();
            if *served != picked {
                self.metrics.served_mismatch.inc();
            }
            if self.opts.conformance_hooks {
                set.push(messages::set_header(CONFORMANCE_SERVED, served.as_bytes()));
            }
        }
        let out = vec![messages::common(
            Phase::ResponseHeaders,
            CommonResponse {
                header_mutation: messages::mutation(set, Vec::new()),
                ..CommonResponse::default()
            },
            None,
        )];
        let usage = (!h.end_of_stream).then(|| UsageScanner::new(&content_type));
        (usage, out)
    }

    fn pass_body(&self, phase: Phase, mode: BodyMode, b: HttpBody) -> Vec<ProcessingResponse> {
        match mode {
            BodyMode::FullDuplex => messages::stream_body(phase, b.body, b.end_of_stream),
            BodyMode::Buffered => vec![messages::common(phase, CommonResponse::default(), None)],
        }
    }

    fn record_usage(&self, decision: &Routed, scanner: UsageScanner) {
        let Some(u) = scanner.finish() else { return };
        let model = decision.model_label.as_str();
        let m = &self.metrics;
        for (kind, n) in [
            ("prompt", u.prompt_tokens),
            ("completion", u.completion_tokens),
            ("cached", u.cached_tokens),
        ] {
            m.tokens
                .get_or_create(&Metrics::labels(&[("model", model), ("kind", kind)]))
                .inc_by(n);
        }
    }
}

/// The gateway's subset hint: a list of `ip:port` strings or one comma-separated string.
fn subset_hint(metadata: Option<&Metadata>) -> Option<Vec<SocketAddr>> {
    let v = metadata?
        .filter_metadata
        .get(SUBSET_NAMESPACE)?
        .fields
        .get(SUBSET_KEY)?;
    let mut out = Vec::new();
    let mut push = |s: &str| {
        for part in s.split(',') {
            if let Ok(a) = part.trim().parse() {
                out.push(a);
            }
        }
    };
    match &v.kind {
        Some(Kind::StringValue(s)) => push(s),
        Some(Kind::ListValue(l)) => {
            for item in &l.values {
                if let Some(Kind::StringValue(s)) = &item.kind {
                    push(s);
                }
            }
        }
        _ => {}
    }
    Some(out)
}

/// The endpoint the gateway reports as having served the request.
fn served_endpoint(metadata: Option<&Metadata>) -> Option<String> {
    let v = metadata?
        .filter_metadata
        .get(LB_NAMESPACE)?
        .fields
        .get(SERVED_KEY)?;
    match &v.kind {
        Some(Kind::StringValue(s)) => Some(s.clone()),
        _ => None,
    }
}

#[cfg(test)]
mod tests;
