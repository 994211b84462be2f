//! The stream handler against an untrusted peer: for any messages Envoy (or anything that speaks
//! ext_proc to us) sends on a few concurrent streams, in any order and chunking, in any body mode,
//! with the edge's `decides_inline`, early ends, queue dispatches and resets in between, the
//! handler never panics, its answers are ones a client may rely on, and nothing outlives the
//! streams: no booking, no buffered body byte, no tenant slot or queue entry.
//!
//! Accounting is checked after every step, not only at the end, so a leak fails at the step that
//! causes it: the budget holds exactly the bytes of the bodies being buffered or queued, and the
//! bookings (and tenant slots) number at least the routed streams and at most those plus the
//! queued ones (a queued stream's dispatch may wait undelivered in its ticket).
//!
//! A case is a script of messages per stream (an exchange as Envoy sends it, disturbed: messages
//! dropped, strays inserted; or strays only) interleaved by a schedule that also ends streams,
//! dispatches the queue and delivers its outcomes. Envoy sends nothing while a request waits in
//! the queue (it waits for our answer), so most messages for a queued stream are held back until
//! it is answered; the others arrive anyway, as a hostile peer's would.

use std::collections::VecDeque;

use envoy_types::pb::envoy::config::core::v3::header_value_option::HeaderAppendAction;
use proptest::collection::vec;
use proptest::prelude::*;
use proptest::sample::{Index, select};

use super::*;
use crate::flow::{FlowControl, Ticket};

/// Concurrent streams per case; under flow control more, so that enough of them are routed at
/// once for the next to queue.
const STREAMS: usize = 4;
const FLOW_STREAMS: usize = 8;
/// The workers `router` configures.
const ENDPOINTS: [&str; 2] = ["10.0.0.1:8000", "10.0.0.2:8000"];
/// Small limits, so that 413 and the shared budget's 503 happen often.
const MAX_BODY: usize = 1024;
const BUDGET: usize = 1280;
/// Saturation after two routed requests, so that the third queues; `capped` may have one
/// request in flight, `metered` few tokens per second; one request per tenant may queue.
const FLOW: &str = "routing: {max_inflight_per_worker: 1}
flow_control: {max_queued_requests_per_tenant: 1, metrics_top_tenants: 0, tenants: [{id: capped, max_inflight: 1}, {id: metered, tokens_per_second: 10, burst_tokens: 400}]}";

/// A rig and the options its streams share (budget, flow control).
struct World {
    rig: Rig,
    opts: StreamOptions,
}

impl World {
    /// `router("")` without flow control: saturation is never reached.
    fn plain() -> World {
        World::with(router(""), |_| None)
    }

    /// `router(FLOW)` with its flow control.
    fn flow_control() -> World {
        let settings = Config::from_yaml(FLOW)
            .unwrap()
            .flow_control
            .settings()
            .unwrap();
        World::with(router(FLOW), |rig| {
            Some(FlowControl::new(
                settings,
                rig.picker.clone(),
                rig.metrics.flow.clone(),
                rig.picker.workers.released(),
            ))
        })
    }

    fn with(rig: Rig, flow: impl FnOnce(&Rig) -> Option<Arc<FlowControl>>) -> World {
        let opts = StreamOptions {
            max_body_bytes: MAX_BODY,
            body_budget: BodyBudget::new(BUDGET, Default::default()),
            flow: flow(&rig),
            ..opts()
        };
        World { rig, opts }
    }
}

/// What one step of a case does.
#[derive(Clone, Debug)]
enum Step {
    /// Envoy's next message; `inline`: the edge asks `decides_inline` first; `patient`: held
    /// back while the stream is queued.
    Send {
        stream: usize,
        inline: bool,
        patient: bool,
        msg: Box<ProcessingRequest>,
    },
    /// The edge ends the stream early (idle before the decision, or a gRPC message over the
    /// limit), then drops it.
    Abandon { stream: usize, idle: bool },
    /// Capacity may have freed up: flow control dispatches (outcomes wait in the tickets).
    Dispatch,
    /// One of the queued streams takes its ticket's outcome, if it has one yet (the edge task
    /// waiting on that ticket wakes up).
    Deliver { to: Index },
    /// The queue timeout, delivered whatever the stream's state.
    TimeOut { stream: usize },
    /// The stream ends (Envoy closes it after its last message, or resets it): the edge drops
    /// the handler.
    End { stream: usize },
}

/// The schedule's entries: which stream acts next, and how.
#[derive(Clone, Copy, Debug)]
enum Turn {
    /// Its script's next message.
    Next {
        inline: bool,
        patient: bool,
    },
    Abandon {
        idle: bool,
    },
    Dispatch,
    Deliver {
        to: Index,
    },
    TimeOut,
    /// An early end; the script's end ends the stream too.
    End,
}

/// How a chunked body ends.
#[derive(Clone, Copy, Debug)]
enum End {
    /// The last chunk carries `end_of_stream`.
    Flag,
    /// An empty chunk with `end_of_stream` follows.
    EmptyFlag,
    /// Trailers follow.
    Trailers,
    /// Nothing: the body never ends.
    Open,
}

fn end() -> impl Strategy<Value = End> {
    prop_oneof![
        6 => Just(End::Flag),
        1 => Just(End::EmptyFlag),
        1 => Just(End::Trailers),
        1 => Just(End::Open),
    ]
}

/// `bytes` cut at `cuts` into messages made by `chunk`, ended as `end` says.
fn chunked(
    bytes: &[u8],
    cuts: &[Index],
    end: End,
    chunk: fn(&[u8], bool) -> ProcessingRequest,
    request: bool,
) -> Vec<ProcessingRequest> {
    let mut at: Vec<usize> = cuts.iter().map(|i| i.index(bytes.len() + 1)).collect();
    at.extend([0, bytes.len()]);
    at.sort_unstable();
    at.dedup();
    let mut pieces: Vec<&[u8]> = at.windows(2).map(|w| &bytes[w[0]..w[1]]).collect();
    if pieces.is_empty() {
        pieces.push(&[]);
    }
    let last = pieces.len() - 1;
    let mut msgs: Vec<ProcessingRequest> = pieces
        .iter()
        .enumerate()
        .map(|(i, p)| chunk(p, matches!(end, End::Flag) && i == last))
        .collect();
    match end {
        End::EmptyFlag => msgs.push(chunk(&[], true)),
        End::Trailers => msgs.push(trailers(request)),
        End::Flag | End::Open => {}
    }
    msgs
}

/// Request bodies: routable ones (token IDs, text, chat, salts in the body), refused ones
/// (truncated, random, no model, over `MAX_BODY`) and empty.
fn request_body() -> impl Strategy<Value = Vec<u8>> {
    let token_ids = |n: usize| {
        let ids: Vec<String> = (1..=n).map(|i| (i * 37 % 1000).to_string()).collect();
        format!(r#"{{"model":"m","prompt":[{}]}}"#, ids.join(",")).into_bytes()
    };
    let fixed: Vec<&'static [u8]> = vec![
        br#"{"model":"m","prompt":"a text prompt"}"#,
        br#"{"model":"m","messages":[{"role":"user","content":"hi"}]}"#,
        br#"{"model":"m","prompt":[1,2,3,4,5],"cache_salt":"capped"}"#,
        br#"{"model":"m","prompt":[1,2,3,4,5],"nvext":{"cache_salt":"metered"}}"#,
        br#"{"model":"m","prompt":[1,2,3],"cache_salt":"t1","nvext":{"cache_salt":"t2"}}"#,
        br#"{"model":"m","prompt":[1,2,3,4,5,6,7,8,9],"max_tokens":5}"#,
        br#"{"model":"zz","prompt":[1,2,3,4]}"#,
        br#"{"prompt":[1,2]}"#,
        b"",
    ];
    let valid = (1usize..40).prop_map(token_ids);
    prop_oneof![
        4 => valid.clone(),
        // Up to MAX_BODY (about 250 IDs), then over it.
        2 => (40usize..250).prop_map(token_ids),
        1 => (260usize..400).prop_map(token_ids),
        4 => select(fixed).prop_map(<[u8]>::to_vec),
        1 => (valid, any::<Index>()).prop_map(|(b, i)| b[..i.index(b.len())].to_vec()),
        1 => vec(any::<u8>(), 0..48),
    ]
}

fn response_bytes() -> impl Strategy<Value = Vec<u8>> {
    let fixed: Vec<&'static [u8]> = vec![
        b"data: {\"choices\":[],\"usage\":{\"prompt_tokens\":4,\"completion_tokens\":9}}\n\ndata: [DONE]\n\n",
        b"data: {\"usage\":{\"prompt_tokens\":18446744073709551615}}\r\ndata: {\"usage\":",
        br#"{"usage":{"prompt_tokens":4,"completion_tokens":2,"prompt_tokens_details":{"cached_tokens":1}}}"#,
        br#"{"usage":null}"#,
    ];
    prop_oneof![
        3 => select(fixed).prop_map(<[u8]>::to_vec),
        1 => vec(any::<u8>(), 0..32),
    ]
}

/// A client's routing control headers (the destination, its variants, the conformance ones).
const CONTROL: [(&str, &str); 7] = [
    ("x-gateway-destination-endpoint", "6.6.6.6:1"),
    ("x-gateway-destination-endpoint", "10.0.0.2:8000"),
    ("X-Gateway-Destination-Endpoint-Served", "x"),
    ("x-gateway-destination-endpoint-subset", "10.0.0.1:8000"),
    ("test-epp-endpoint-selection", "10.0.0.2,10.0.0.1"),
    ("test-epp-endpoint-selection", "9.9.9.9"),
    ("x-conformance-test-served-endpoint", "y"),
];

fn tenant() -> impl Strategy<Value = Vec<u8>> {
    let named = vec![&b"capped"[..], &b"metered"[..], &b"t1"[..]];
    prop_oneof![
        6 => select(named).prop_map(<[u8]>::to_vec),
        1 => Just(Vec::new()),
        1 => vec(any::<u8>(), 1..12),
        1 => Just(vec![b't'; 2000]),
    ]
}

/// NONE, STREAMED, BUFFERED, BUFFERED_PARTIAL, FULL_DUPLEX_STREAMED, or out of range.
fn body_mode() -> impl Strategy<Value = i32> {
    prop_oneof![4 => 0i32..=4, 1 => select(vec![-1, 5, i32::MAX])]
}

fn any_subset_hint() -> impl Strategy<Value = Value> {
    let string = |s: &str| Value {
        kind: Some(Kind::StringValue(s.into())),
    };
    let list = |items: &[&str]| Value {
        kind: Some(Kind::ListValue(ListValue {
            values: items
                .iter()
                .map(|s| Value {
                    kind: Some(Kind::StringValue((*s).into())),
                })
                .collect(),
        })),
    };
    select(vec![
        string("10.0.0.2:8000"),
        string("10.0.0.1:8000, 9.9.9.9:1"),
        string("garbage"),
        list(&["10.0.0.1:8000"]),
        list(&[]),
        Value {
            kind: Some(Kind::NumberValue(1.0)),
        },
    ])
}

fn request_headers() -> impl Strategy<Value = ProcessingRequest> {
    let paths = vec![
        "/v1/completions",
        "/v1/chat/completions",
        "/v1/responses",
        "/\u{0}garbage",
    ];
    (
        prop::option::of(select(paths)),
        prop_oneof![12 => Just(Vec::new()), 4 => vec(tenant(), 1..=1), 1 => vec(tenant(), 2..=2)],
        prop::sample::subsequence(CONTROL.to_vec(), 0..=2),
        any::<bool>(),
        prop::bool::weighted(0.25),
        prop::option::of((body_mode(), body_mode())),
        prop::option::weighted(0.15, any_subset_hint()),
    )
        .prop_map(|(path, tenants, control, json, eos, modes, subset)| {
            let mut pairs: Vec<(&str, &str)> = path.map(|p| (":path", p)).into_iter().collect();
            pairs.extend(control);
            if json {
                pairs.push(("content-type", "application/json"));
            }
            let mut msg = headers(&pairs, eos, FULL_DUPLEX);
            msg.protocol_config = modes.map(|(request, response)| ProtocolConfiguration {
                request_body_mode: request,
                response_body_mode: response,
                ..Default::default()
            });
            if let Some(Request::RequestHeaders(h)) = &mut msg.request
                && let Some(map) = &mut h.headers
            {
                map.headers
                    .extend(tenants.into_iter().map(|raw_value| HeaderValue {
                        key: TENANT_HEADER.into(),
                        value: String::new(),
                        raw_value,
                    }));
            }
            match subset {
                Some(v) => with_subset(msg, v),
                None => msg,
            }
        })
}

fn any_response_headers() -> impl Strategy<Value = ProcessingRequest> {
    let types = vec!["application/json", "text/event-stream", "text/plain"];
    let served = vec!["10.0.0.1:8000", "10.0.0.2:8000", "elsewhere"];
    (
        prop::option::of(select(types)),
        prop::bool::weighted(0.2),
        prop::option::of(select(served)),
    )
        .prop_map(|(ct, eos, served)| response_headers(ct, eos, served))
}

/// Any single message, the request-less one included.
fn stray() -> impl Strategy<Value = ProcessingRequest> {
    prop_oneof![
        request_headers(),
        (vec(any::<u8>(), 0..16), any::<bool>()).prop_map(|(b, eos)| body(&b, eos)),
        Just(trailers(true)),
        any_response_headers(),
        (response_bytes(), any::<bool>()).prop_map(|(b, eos)| response_body(&b, eos)),
        Just(trailers(false)),
        Just(ProcessingRequest::default()),
    ]
}

/// A request and its response as Envoy sends them, chunked anyhow.
fn exchange() -> impl Strategy<Value = Vec<ProcessingRequest>> {
    (
        request_headers(),
        (request_body(), vec(any::<Index>(), 0..4), end()),
        any_response_headers(),
        (response_bytes(), vec(any::<Index>(), 0..3), end()),
    )
        .prop_map(
            |(head, (req, req_cuts, req_end), resp_head, (resp, resp_cuts, resp_end))| {
                let bodyless =
                    matches!(&head.request, Some(Request::RequestHeaders(h)) if h.end_of_stream);
                let mut msgs = vec![head];
                if !bodyless {
                    msgs.extend(chunked(&req, &req_cuts, req_end, body, true));
                }
                msgs.push(resp_head);
                msgs.extend(chunked(&resp, &resp_cuts, resp_end, response_body, false));
                msgs
            },
        )
}

/// One stream's messages: an exchange with messages dropped and strays inserted, or strays only.
fn script() -> impl Strategy<Value = Vec<ProcessingRequest>> {
    let disturbed = (
        exchange(),
        rarely(vec(any::<Index>(), 1..3)),
        rarely(vec((any::<Index>(), stray()), 1..3)),
    )
        .prop_map(|(mut msgs, drops, strays)| {
            for i in drops {
                if !msgs.is_empty() {
                    msgs.remove(i.index(msgs.len()));
                }
            }
            for (i, msg) in strays {
                msgs.insert(i.index(msgs.len() + 1), msg);
            }
            msgs
        });
    prop_oneof![6 => disturbed, 1 => vec(stray(), 0..8)]
}

/// `disturbances` in a third of the cases, none in the others.
fn rarely<T: std::fmt::Debug + Clone>(
    disturbances: impl Strategy<Value = Vec<T>>,
) -> impl Strategy<Value = Vec<T>> {
    prop_oneof![2 => Just(Vec::new()), 1 => disturbances]
}

fn turn(streams: usize) -> impl Strategy<Value = (usize, Turn)> {
    let turn = prop_oneof![
        60 => (any::<bool>(), prop::bool::weighted(0.9))
            .prop_map(|(inline, patient)| Turn::Next { inline, patient }),
        1 => any::<bool>().prop_map(|idle| Turn::Abandon { idle }),
        8 => Just(Turn::Dispatch),
        12 => any::<Index>().prop_map(|to| Turn::Deliver { to }),
        2 => Just(Turn::TimeOut),
        1 => Just(Turn::End),
    ];
    (0..streams, turn)
}

/// The streams' scripts interleaved by a schedule: a stream's turn after its script is over ends
/// it; what is left unsent when the schedule ends is never sent.
fn steps(streams: usize) -> impl Strategy<Value = Vec<Step>> {
    let turns = vec(turn(streams), 8 * streams..24 * streams);
    (vec(script(), streams), turns).prop_map(move |(scripts, turns)| {
        let mut scripts: Vec<_> = scripts.into_iter().map(|s| s.into_iter().fuse()).collect();
        let mut ended = vec![false; streams];
        turns
            .into_iter()
            .filter_map(|(stream, turn)| {
                Some(match turn {
                    Turn::Next { inline, patient } => match scripts[stream].next() {
                        Some(msg) => Step::Send {
                            stream,
                            inline,
                            patient,
                            msg: Box::new(msg),
                        },
                        None if !ended[stream] => {
                            ended[stream] = true;
                            Step::End { stream }
                        }
                        None => return None,
                    },
                    Turn::Abandon { idle } => Step::Abandon { stream, idle },
                    Turn::Dispatch => Step::Dispatch,
                    Turn::Deliver { to } => Step::Deliver { to },
                    Turn::TimeOut => Step::TimeOut { stream },
                    Turn::End => Step::End { stream },
                })
            })
            .collect()
    })
}

/// One stream as the test sees it: its handler while it lasts, and what crossed it.
struct Stream {
    handler: Option<StreamHandler>,
    /// Lowercased names of the routing control headers the client sent.
    control: Vec<String>,
    /// The gateway's subset hint, and the IPs conformance headers selected: the pick must be in
    /// both.
    subset: Option<Vec<SocketAddr>>,
    selected: Vec<IpAddr>,
    /// Headers our answers removed so far.
    removed: Vec<String>,
    routed: bool,
    /// Request body bytes the handler took, and those it streamed back.
    accepted: Vec<u8>,
    echoed: Vec<u8>,
    /// FULL_DUPLEX requests throughout and no salt header: unless the body has a salt field, the
    /// forwarded body must be the received one, byte for byte.
    verbatim: bool,
    /// Messages Envoy holds back while the request is queued.
    held_back: VecDeque<ProcessingRequest>,
}

impl Stream {
    fn new(handler: StreamHandler) -> Stream {
        Stream {
            handler: Some(handler),
            control: Vec::new(),
            subset: None,
            selected: Vec::new(),
            removed: Vec::new(),
            routed: false,
            accepted: Vec::new(),
            echoed: Vec::new(),
            verbatim: true,
            held_back: VecDeque::new(),
        }
    }

    fn queued(&self) -> bool {
        self.handler
            .as_ref()
            .is_some_and(|h| matches!(h.state, State::Queued { .. }))
    }

    /// Envoy sends `msg` (after what it held back): each goes to the handler as the edge would
    /// hand it over, until one fails the stream (the edge then drops the handler).
    fn send(
        &mut self,
        msg: ProcessingRequest,
        inline: bool,
        patient: bool,
    ) -> Result<(), TestCaseError> {
        self.held_back.push_back(msg);
        if patient && self.queued() {
            return Ok(());
        }
        while let Some(mut msg) = self.held_back.pop_front() {
            let Some(h) = self.handler.as_ref() else {
                return Ok(());
            };
            let finished = h.is_finished();
            self.observe(&msg, matches!(h.state, State::AwaitHeaders));
            let chunk = match &msg.request {
                Some(Request::RequestBody(b)) => b.body.clone(),
                _ => Vec::new(),
            };
            let h = self.handler.as_mut().expect("checked above");
            if inline {
                h.decides_inline(&mut msg);
            }
            match h.on_message(msg) {
                Err(_) => self.handler = None,
                Ok(out) => {
                    prop_assert!(!finished, "a finished stream took another message");
                    if immediate_status(&out).is_none() {
                        self.accepted.extend(chunk);
                    }
                    self.check_answer(&out)?;
                }
            }
        }
        Ok(())
    }

    /// Notes what `msg` tells about the request before the handler sees it.
    fn observe(&mut self, msg: &ProcessingRequest, awaits_headers: bool) {
        if msg
            .protocol_config
            .as_ref()
            .is_some_and(|pc| pc.request_body_mode != FULL_DUPLEX)
        {
            self.verbatim = false;
        }
        if let Some(Request::RequestHeaders(h)) = &msg.request
            && awaits_headers
        {
            self.subset = subset_hint(msg.metadata_context.as_ref());
            for hv in h.headers.iter().flat_map(|m| &m.headers) {
                let key = hv.key.to_ascii_lowercase();
                if key == TENANT_HEADER {
                    self.verbatim = false;
                } else if CONTROL.iter().any(|(k, _)| k.eq_ignore_ascii_case(&key)) {
                    if key == CONFORMANCE_SELECT {
                        let ips = String::from_utf8_lossy(&hv.raw_value).into_owned();
                        self.selected
                            .extend(ips.split(',').filter_map(|ip| ip.parse::<IpAddr>().ok()));
                    }
                    self.control.push(key);
                }
            }
        }
    }

    /// Checks what the handler answered on this stream, which was not finished before.
    fn check_answer(&mut self, out: &[ProcessingResponse]) -> Result<(), TestCaseError> {
        let h = self.handler.as_ref().expect("a live stream");
        let immediate = immediate_status(out);
        if let Some((code, ..)) = &immediate {
            prop_assert!((400..600).contains(code), "a local reply's status: {code}");
            prop_assert!(
                matches!(
                    out.last().and_then(|r| r.response.as_ref()),
                    Some(Response::ImmediateResponse(_))
                ),
                "a local reply is the stream's last word"
            );
        }
        prop_assert_eq!(
            h.is_finished(),
            immediate.is_some(),
            "the stream finishes exactly when it sends a local reply"
        );
        let (dest, meta, bytes, _, removed) = routing_of(out);
        self.removed.extend(removed);
        self.echoed.extend(bytes);
        if !dest.is_empty() || !meta.is_empty() {
            prop_assert!(!self.routed, "routed twice");
            self.routed = true;
            prop_assert_eq!(&dest, &meta, "header and metadata name one destination");
            prop_assert!(
                overwrites_destination(out),
                "a client-sent destination would stay"
            );
            let pick = h.decision().map(|d| d.pick.endpoint);
            let named = pick.map(|p| p.to_string());
            prop_assert_eq!(
                dest.split(',').next(),
                named.as_deref(),
                "the picker's choice"
            );
            for part in dest.split(',') {
                prop_assert!(ENDPOINTS.contains(&part), "{part} is not a worker");
            }
            if let (Some(pick), Some(subset)) = (pick, &self.subset) {
                prop_assert!(subset.contains(&pick), "{pick} is outside the subset hint");
            }
            if let Some(pick) = pick
                && !self.selected.is_empty()
            {
                prop_assert!(
                    self.selected.contains(&pick.ip()),
                    "{pick} was not selected"
                );
            }
            for name in &self.control {
                // The destination itself is overwritten by the routing header; its variants and
                // the conformance headers must go.
                prop_assert!(
                    name == DESTINATION || self.removed.contains(name),
                    "client-sent {name} is forwarded"
                );
            }
        }
        prop_assert_eq!(
            self.routed,
            h.decision().is_some(),
            "a decision is made exactly when its routing is sent"
        );
        if self.routed && self.verbatim && !contains(&self.accepted, b"cache_salt") {
            prop_assert_eq!(&self.echoed, &self.accepted, "the body goes as it came");
        }
        Ok(())
    }
}

/// Whether every destination header `out` sets replaces a client-sent one rather than adding a
/// value after it.
fn overwrites_destination(out: &[ProcessingResponse]) -> bool {
    out.iter()
        .filter_map(|r| match &r.response {
            Some(Response::RequestHeaders(h)) => h.response.as_ref(),
            Some(Response::RequestBody(b)) => b.response.as_ref(),
            _ => None,
        })
        .filter_map(|c| c.header_mutation.as_ref())
        .flat_map(|m| &m.set_headers)
        .filter(|o| o.header.as_ref().is_some_and(|h| h.key == DESTINATION))
        .all(|o| o.append_action == HeaderAppendAction::OverwriteIfExistsOrAdd as i32)
}

fn contains(haystack: &[u8], needle: &[u8]) -> bool {
    haystack.windows(needle.len()).any(|w| w == needle)
}

/// Runs one case: every step, the accounts checked after each, then every stream dropped.
fn run(world: &World, streams: usize, steps: Vec<Step>) -> Result<(), TestCaseError> {
    let mut streams: Vec<Stream> = (0..streams)
        .map(|_| Stream::new(world.rig.handler_with(world.opts.clone())))
        .collect();
    for step in steps {
        match step {
            Step::Send {
                stream,
                inline,
                patient,
                msg,
            } => streams[stream].send(*msg, inline, patient)?,
            Step::Abandon { stream, idle } => {
                let s = &mut streams[stream];
                let Some(h) = s.handler.as_mut() else {
                    continue;
                };
                let undecided = !matches!(h.state, State::Routed { .. } | State::Finished);
                let why = if idle {
                    Reject::StreamIdle { after_ms: 5 }
                } else {
                    Reject::BodyTooLarge { limit: MAX_BODY }
                };
                let reply = h.abandon(&why);
                prop_assert_eq!(
                    reply.is_some(),
                    undecided,
                    "a reply exactly before the decision"
                );
                if let Some(reply) = reply {
                    let code = immediate_status(&[reply]).map(|i| i.0);
                    prop_assert_eq!(code, Some(i32::from(why.status())));
                    prop_assert!(h.is_finished());
                }
                s.handler = None;
            }
            Step::Dispatch => {
                if let Some(flow) = &world.opts.flow {
                    flow.dispatch();
                }
            }
            Step::Deliver { to } => {
                let mut queued: Vec<&mut Stream> =
                    streams.iter_mut().filter(|s| s.queued()).collect();
                if queued.is_empty() {
                    continue;
                }
                let i = to.index(queued.len());
                let s = &mut *queued[i];
                let h = s.handler.as_mut().expect("a queued stream");
                if let Some(outcome) = h.ticket().and_then(Ticket::try_take) {
                    let out = h.on_dispatched(outcome);
                    s.check_answer(&out)?;
                }
            }
            Step::TimeOut { stream } => {
                let s = &mut streams[stream];
                let Some(h) = s.handler.as_mut() else {
                    continue;
                };
                let queued = h.ticket().is_some();
                let before = (h.is_finished(), h.decision().is_some());
                let out = h.on_dispatched(Err(Reject::QueueTimeout {
                    model: None,
                    waited_ms: 1,
                }));
                if queued {
                    prop_assert_eq!(immediate_status(&out).map(|i| i.0), Some(429));
                    s.check_answer(&out)?;
                } else {
                    prop_assert!(out.is_empty(), "only a queued stream takes an outcome");
                    prop_assert_eq!((h.is_finished(), h.decision().is_some()), before);
                }
            }
            Step::End { stream } => streams[stream].handler = None,
        }
        check_accounts(world, &streams)?;
    }
    drop(streams);
    check_released(world)
}

/// The shared accounts against what the live streams hold.
fn check_accounts(world: &World, streams: &[Stream]) -> Result<(), TestCaseError> {
    let (mut buffered, mut routed, mut queued, mut slots) = (0, 0, 0, 0);
    for h in streams.iter().filter_map(|s| s.handler.as_ref()) {
        match &h.state {
            State::CollectBody { body, held, .. } => {
                prop_assert_eq!(held.bytes(), body.len(), "the body's share is its size");
                buffered += body.len();
            }
            State::Queued { body, held, .. } => {
                let bytes = body.as_ref().map_or(0, Vec::len);
                let share = held.as_ref().map_or(0, Held::bytes);
                prop_assert_eq!(share, bytes, "the queued body's share is its size");
                buffered += bytes;
                queued += 1;
            }
            State::Routed { decision, .. } => routed += u64::from(decision.booking.is_some()),
            State::AwaitHeaders | State::Finished => {}
        }
        slots += u64::from(h.slot.is_some());
    }
    prop_assert_eq!(
        world.opts.body_budget.used(),
        buffered,
        "the budget holds the buffered bodies, nothing else"
    );
    let inflight = world.rig.total_inflight();
    prop_assert!(
        routed <= inflight && inflight <= routed + queued,
        "{inflight} bookings for {routed} routed and {queued} queued streams"
    );
    if let Some(flow) = &world.opts.flow {
        let tenants = flow.debug()["inflight"].as_u64().unwrap_or(u64::MAX);
        prop_assert!(
            slots <= tenants && tenants <= slots + queued,
            "{tenants} tenant slots for {slots} held and {queued} queued streams"
        );
        prop_assert!(
            flow.queued() as u64 <= queued,
            "a queue entry without a stream"
        );
    }
    Ok(())
}

/// Nothing is held once every stream is gone.
fn check_released(world: &World) -> Result<(), TestCaseError> {
    prop_assert_eq!(world.rig.total_inflight(), 0, "a booking leaked");
    prop_assert_eq!(world.opts.body_budget.used(), 0, "budget bytes leaked");
    if let Some(flow) = &world.opts.flow {
        prop_assert_eq!(flow.queued(), 0, "a queue entry leaked");
        prop_assert_eq!(
            flow.debug()["inflight"].as_u64(),
            Some(0),
            "a tenant slot leaked"
        );
        let m = &world.rig.metrics.flow;
        prop_assert_eq!(m.queued_bytes.get(), 0);
        for tenant in ["unsalted", "other"] {
            let label = vec![("tenant".to_owned(), tenant.to_owned())];
            prop_assert_eq!(m.inflight.get_or_create(&label).get(), 0, "{}", tenant);
            prop_assert_eq!(m.queued.get_or_create(&label).get(), 0, "{}", tenant);
        }
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    /// Without flow control: the budget and the body limit are reached, saturation never is.
    #[test]
    fn any_message_sequence_is_answered_soundly_and_leaks_nothing(steps in steps(STREAMS)) {
        run(&World::plain(), STREAMS, steps)?;
    }

    /// With flow control: requests queue, tenants hit their quotas, queued streams are
    /// dispatched, timed out, abandoned or reset.
    #[test]
    fn under_flow_control_queued_streams_leak_nothing_either(steps in steps(FLOW_STREAMS)) {
        run(&World::flow_control(), FLOW_STREAMS, steps)?;
    }
}
