//! State-machine tests without gRPC: messages in, messages out.

use std::sync::Arc;

use envoy_types::pb::envoy::config::core::v3::{HeaderMap, HeaderValue, Metadata};
use envoy_types::pb::envoy::service::ext_proc::v3::{
    HttpBody, HttpHeaders, HttpTrailers, ProcessingRequest, ProcessingResponse,
    ProtocolConfiguration, body_mutation::Mutation, processing_request::Request,
    processing_response::Response,
};
use envoy_types::pb::google::protobuf::{ListValue, Struct, Value, value::Kind};

use super::*;
use crate::config::Config;
use crate::metrics::Metrics;

mod untrusted;

/// Two workers of model `m`, and the metrics handlers count into.
struct Rig {
    picker: Arc<Picker>,
    metrics: Arc<Metrics>,
}

impl Rig {
    fn handler(&self) -> StreamHandler {
        self.handler_with(opts())
    }

    fn handler_with(&self, opts: StreamOptions) -> StreamHandler {
        StreamHandler::new(self.picker.clone(), self.metrics.clone(), opts)
    }

    fn total_inflight(&self) -> u64 {
        self.picker.workers.total_inflight()
    }
}

fn router(extra: &str) -> Rig {
    let yaml = format!(
        "models: [{{name: m, block_size: 4}}]\nworkers: [{{endpoint: '10.0.0.1:8000', model: m}}, {{endpoint: '10.0.0.2:8000', model: m}}]\n{extra}"
    );
    let c = Config::from_yaml(&yaml).unwrap();
    c.validate().unwrap();
    let metrics = Arc::new(Metrics::new());
    Rig {
        picker: Arc::new(c.picker(metrics.clone()).unwrap()),
        metrics,
    }
}

fn opts() -> StreamOptions {
    StreamOptions {
        max_body_bytes: 1 << 20,
        retry_after_seconds: 2,
        conformance_hooks: true,
        body_budget: BodyBudget::new(1 << 30, Default::default()),
        flow: None,
    }
}

fn headers(pairs: &[(&str, &str)], eos: bool, mode: i32) -> ProcessingRequest {
    ProcessingRequest {
        protocol_config: Some(ProtocolConfiguration {
            request_body_mode: mode,
            response_body_mode: mode,
            ..Default::default()
        }),
        request: Some(Request::RequestHeaders(HttpHeaders {
            headers: Some(HeaderMap {
                headers: pairs
                    .iter()
                    .map(|(k, v)| HeaderValue {
                        key: (*k).into(),
                        value: String::new(),
                        raw_value: v.as_bytes().to_vec(),
                    })
                    .collect(),
            }),
            end_of_stream: eos,
            ..Default::default()
        })),
        ..Default::default()
    }
}

fn message(request: Request) -> ProcessingRequest {
    ProcessingRequest {
        request: Some(request),
        ..Default::default()
    }
}

fn http_body(bytes: &[u8], eos: bool) -> HttpBody {
    HttpBody {
        body: bytes.to_vec(),
        end_of_stream: eos,
        ..Default::default()
    }
}

fn body(bytes: &[u8], eos: bool) -> ProcessingRequest {
    message(Request::RequestBody(http_body(bytes, eos)))
}

fn response_body(bytes: &[u8], eos: bool) -> ProcessingRequest {
    message(Request::ResponseBody(http_body(bytes, eos)))
}

/// Request or response trailers.
fn trailers(request: bool) -> ProcessingRequest {
    let t = HttpTrailers::default();
    message(if request {
        Request::RequestTrailers(t)
    } else {
        Request::ResponseTrailers(t)
    })
}

/// Response headers with a content type, and the endpoint the gateway reports as having served
/// the request (`envoy.lb` metadata).
fn response_headers(
    content_type: Option<&str>,
    eos: bool,
    served: Option<&str>,
) -> ProcessingRequest {
    let headers = content_type.map(|ct| HeaderMap {
        headers: vec![HeaderValue {
            key: "content-type".into(),
            value: String::new(),
            raw_value: ct.as_bytes().to_vec(),
        }],
    });
    let served = served.map(|s| {
        let value = Value {
            kind: Some(Kind::StringValue(s.into())),
        };
        metadata("envoy.lb", "x-gateway-destination-endpoint-served", value)
    });
    ProcessingRequest {
        metadata_context: served,
        ..message(Request::ResponseHeaders(HttpHeaders {
            headers,
            end_of_stream: eos,
            ..Default::default()
        }))
    }
}

const FULL_DUPLEX: i32 = 4;
const BUFFERED: i32 = 2;

/// (destination header, metadata destination, streamed body bytes, ends)
fn routing_of(out: &[ProcessingResponse]) -> (String, String, Vec<u8>, usize, Vec<String>) {
    let mut dest = String::new();
    let mut meta = String::new();
    let mut bytes = Vec::new();
    let mut ends = 0;
    let mut removed = Vec::new();
    for r in out {
        if let Some(m) = &r.dynamic_metadata
            && let Some(Kind::StructValue(s)) = &m.fields["envoy.lb"].kind
            && let Some(Kind::StringValue(v)) = &s.fields["x-gateway-destination-endpoint"].kind
        {
            meta = v.clone();
        }
        let common = match &r.response {
            Some(Response::RequestHeaders(h)) => h.response.clone(),
            Some(Response::RequestBody(b)) => b.response.clone(),
            _ => None,
        };
        if let Some(c) = common {
            if let Some(hm) = &c.header_mutation {
                for h in &hm.set_headers {
                    let hv = h.header.as_ref().unwrap();
                    if hv.key == "x-gateway-destination-endpoint" {
                        dest = String::from_utf8(hv.raw_value.clone()).unwrap();
                        assert!(c.clear_route_cache);
                    }
                }
                removed.extend(hm.remove_headers.clone());
            }
            if let Some(Mutation::StreamedResponse(s)) =
                c.body_mutation.as_ref().and_then(|b| b.mutation.clone())
            {
                bytes.extend(s.body);
                ends += usize::from(s.end_of_stream);
            }
        }
    }
    (dest, meta, bytes, ends, removed)
}

/// (status, body, headers) of a local reply.
type Immediate = (i32, String, Vec<(String, String)>);

fn immediate_status(out: &[ProcessingResponse]) -> Option<Immediate> {
    out.iter().find_map(|r| match &r.response {
        Some(Response::ImmediateResponse(i)) => Some((
            i.status.as_ref().unwrap().code,
            String::from_utf8(i.body.clone()).unwrap(),
            i.headers
                .as_ref()
                .map(|h| {
                    h.set_headers
                        .iter()
                        .map(|o| {
                            let hv = o.header.as_ref().unwrap();
                            (
                                hv.key.clone(),
                                String::from_utf8(hv.raw_value.clone()).unwrap(),
                            )
                        })
                        .collect()
                })
                .unwrap_or_default(),
        )),
        _ => None,
    })
}

#[test]
fn full_duplex_waits_for_the_body_then_routes_and_echoes_it() {
    let r = router("");
    let mut h = r.handler();
    let out = h
        .on_message(headers(
            &[
                (":path", "/v1/completions"),
                ("x-gateway-destination-endpoint", "6.6.6.6:1"),
                ("x-gateway-destination-endpoint-served", "x"),
            ],
            false,
            FULL_DUPLEX,
        ))
        .unwrap();
    assert!(out.is_empty(), "header response waits for the body");
    let payload = br#"{"model":"m","prompt":[1,2,3,4,5,6,7,8]}"#;
    assert!(
        h.on_message(body(&payload[..10], false))
            .unwrap()
            .is_empty()
    );
    let out = h.on_message(body(&payload[10..], false)).unwrap();
    assert!(out.is_empty());
    // The end of the body arrives as an empty chunk.
    let out = h.on_message(body(b"", true)).unwrap();
    let (dest, meta, bytes, ends, removed) = routing_of(&out);
    assert!(dest == "10.0.0.1:8000" || dest == "10.0.0.2:8000", "{dest}");
    assert_eq!(dest, meta, "header and metadata carry the same value");
    assert_eq!(bytes, payload, "every body byte streamed back");
    assert_eq!(ends, 1);
    assert_eq!(
        removed,
        vec!["x-gateway-destination-endpoint-served".to_string()]
    );
    assert_eq!(r.total_inflight(), 1);
    drop(h);
    assert_eq!(
        r.total_inflight(),
        0,
        "dropping the stream releases the booking"
    );
}

#[test]
fn body_modes_are_taken_from_the_first_message_only() {
    let r = router("");
    let payload = br#"{"model":"m","prompt":[1,2,3,4,5,6,7,8]}"#;
    let answer = |later_mode: Option<i32>| {
        let mut h = r.handler();
        let first = headers(&[(":path", "/v1/completions")], false, FULL_DUPLEX);
        assert!(h.on_message(first).unwrap().is_empty());
        let mut last = body(payload, true);
        last.protocol_config = later_mode.map(|mode| ProtocolConfiguration {
            request_body_mode: mode,
            response_body_mode: mode,
            ..Default::default()
        });
        h.on_message(last).unwrap()
    };
    let plain = answer(None);
    let (dest, _, bytes, ends, _) = routing_of(&plain);
    assert!(!dest.is_empty() && bytes == payload && ends == 1);
    for mode in [BUFFERED, 0, 1, 99] {
        let out = answer(Some(mode));
        assert_eq!(out.len(), plain.len(), "mode {mode} announced late");
        let (_, _, late_bytes, late_ends, _) = routing_of(&out);
        assert!(
            matches!(out[0].response, Some(Response::RequestHeaders(_))),
            "still answered in the header phase, as FULL_DUPLEX wants (mode {mode})"
        );
        assert_eq!((late_bytes.as_slice(), late_ends), (&payload[..], 1));
    }
}

#[test]
fn buffered_answers_headers_at_once_and_routes_on_the_body() {
    let r = router("");
    let mut h = r.handler();
    let out = h
        .on_message(headers(&[(":path", "/v1/completions")], false, BUFFERED))
        .unwrap();
    assert_eq!(out.len(), 1);
    let (dest, _, _, _, removed) = routing_of(&out);
    assert!(dest.is_empty());
    assert!(removed.contains(&"x-gateway-destination-endpoint".to_string()));
    let out = h
        .on_message(body(br#"{"model":"m","prompt":[1,2]}"#, true))
        .unwrap();
    assert_eq!(out.len(), 1);
    assert!(matches!(out[0].response, Some(Response::RequestBody(_))));
    let (dest, meta, bytes, _, _) = routing_of(&out);
    assert!(!dest.is_empty());
    assert_eq!(dest, meta);
    assert!(bytes.is_empty(), "no body mutation in BUFFERED mode");
}

#[test]
fn bodyless_requests_route_on_load_alone() {
    let r = router("");
    let mut h = r.handler();
    let out = h
        .on_message(headers(&[(":path", "/v1/models")], true, FULL_DUPLEX))
        .unwrap();
    let (dest, meta, _, _, _) = routing_of(&out);
    assert!(!dest.is_empty() && dest == meta);
    assert_eq!(r.total_inflight(), 1);
}

#[test]
fn rejections_carry_status_and_reason() {
    let cases: Vec<(&str, &[u8], i32, &str)> = vec![
        ("", b"not json", 400, "not a JSON object"),
        ("", br#"{"prompt":[1]}"#, 400, "no `model`"),
        (
            "",
            br#"{"model":"m","cache_salt":"#,
            400,
            "not a JSON object",
        ),
        (
            "routing: {unknown_model: reject}",
            br#"{"model":"zz","prompt":[1]}"#,
            404,
            "not served",
        ),
    ];
    for (extra, payload, status, needle) in cases {
        let r = router(extra);
        let mut h = r.handler();
        h.on_message(headers(&[], false, FULL_DUPLEX)).unwrap();
        let out = h.on_message(body(payload, true)).unwrap();
        let (code, text, _) = immediate_status(&out).expect("immediate response");
        assert_eq!(code, status, "{text}");
        assert!(text.contains(needle), "{text}");
        assert!(serde_json::from_str::<serde_json::Value>(&text).is_ok());
        assert!(h.is_finished());
        assert_eq!(r.total_inflight(), 0);
    }
    // Over-long salt in the header.
    let r = router("");
    let mut h = r.handler();
    let long = "t".repeat(2000);
    h.on_message(headers(&[("x-tenant-id", &long)], false, FULL_DUPLEX))
        .unwrap();
    let out = h.on_message(body(br#"{"model":"m"}"#, true)).unwrap();
    assert_eq!(immediate_status(&out).unwrap().0, 400);
}

#[test]
fn body_limit_gives_413() {
    let r = router("");
    let mut h = r.handler_with(StreamOptions {
        max_body_bytes: 10,
        ..opts()
    });
    h.on_message(headers(&[], false, FULL_DUPLEX)).unwrap();
    assert!(h.on_message(body(b"0123456", false)).unwrap().is_empty());
    let out = h.on_message(body(b"789ab", false)).unwrap();
    let (code, text, _) = immediate_status(&out).unwrap();
    assert_eq!(code, 413);
    assert!(text.contains("limit of 10 bytes"));
}

#[test]
fn saturation_gives_429_with_retry_after() {
    let r = router("routing: {max_inflight_per_worker: 1}");
    let mut a = r.handler();
    let mut b = r.handler();
    let mut c = r.handler();
    for h in [&mut a, &mut b] {
        let out = h.on_message(headers(&[], true, FULL_DUPLEX)).unwrap();
        assert!(!routing_of(&out).0.is_empty());
    }
    let out = c.on_message(headers(&[], true, FULL_DUPLEX)).unwrap();
    let (code, _, hdrs) = immediate_status(&out).unwrap();
    assert_eq!(code, 429);
    assert!(hdrs.contains(&("retry-after".into(), "2".into())));
    assert!(hdrs.contains(&(
        "x-llm-d-request-dropped-reason".into(),
        "rejected-saturated".into()
    )));
    drop(a);
    let mut d = r.handler();
    assert!(
        !routing_of(&d.on_message(headers(&[], true, FULL_DUPLEX)).unwrap())
            .0
            .is_empty()
    );
}

/// Metadata with one field in one namespace.
fn metadata(namespace: &str, key: &str, value: Value) -> Metadata {
    let mut md = Metadata::default();
    md.filter_metadata.insert(
        namespace.into(),
        Struct {
            fields: [(key.to_string(), value)].into_iter().collect(),
        },
    );
    md
}

fn with_subset(mut msg: ProcessingRequest, v: Value) -> ProcessingRequest {
    msg.metadata_context = Some(metadata(
        "envoy.lb.subset_hint",
        "x-gateway-destination-endpoint-subset",
        v,
    ));
    msg
}

#[test]
fn subset_hint_restricts_and_empty_subset_is_503() {
    let r = router("");
    let string = Value {
        kind: Some(Kind::StringValue("10.0.0.2:8000, 9.9.9.9:1".into())),
    };
    let list = Value {
        kind: Some(Kind::ListValue(ListValue {
            values: vec![Value {
                kind: Some(Kind::StringValue("10.0.0.2:8000".into())),
            }],
        })),
    };
    for v in [string, list] {
        for _ in 0..4 {
            let mut h = r.handler();
            let out = h
                .on_message(with_subset(headers(&[], true, FULL_DUPLEX), v.clone()))
                .unwrap();
            assert_eq!(routing_of(&out).0, "10.0.0.2:8000");
        }
    }
    let mut h = r.handler();
    let empty = Value {
        kind: Some(Kind::ListValue(ListValue { values: vec![] })),
    };
    let out = h
        .on_message(with_subset(headers(&[], true, FULL_DUPLEX), empty))
        .unwrap();
    assert_eq!(immediate_status(&out).unwrap().0, 503);
}

#[test]
fn conformance_selection_and_served_echo() {
    let r = router("");
    let mut h = r.handler();
    let out = h
        .on_message(headers(
            &[("test-epp-endpoint-selection", "10.0.0.2,10.0.0.1")],
            true,
            FULL_DUPLEX,
        ))
        .unwrap();
    let (dest, _, _, _, removed) = routing_of(&out);
    assert_eq!(dest, "10.0.0.2:8000");
    assert!(removed.contains(&"test-epp-endpoint-selection".to_string()));
    let out = h
        .on_message(response_headers(None, false, Some("10.0.0.2:8000")))
        .unwrap();
    let Some(Response::ResponseHeaders(hr)) = &out[0].response else {
        panic!()
    };
    let set = &hr
        .response
        .as_ref()
        .unwrap()
        .header_mutation
        .as_ref()
        .unwrap()
        .set_headers;
    assert_eq!(
        set[0].header.as_ref().unwrap().key,
        "x-conformance-test-served-endpoint"
    );
    assert_eq!(set[0].header.as_ref().unwrap().raw_value, b"10.0.0.2:8000");
}

#[test]
fn response_body_is_echoed_and_usage_counted() {
    let r = router("");
    let mut h = r.handler();
    h.on_message(headers(&[], false, FULL_DUPLEX)).unwrap();
    h.on_message(body(br#"{"model":"m","prompt":[1,2,3,4]}"#, true))
        .unwrap();
    h.on_message(response_headers(Some("text/event-stream"), false, None))
        .unwrap();
    let sse = b"data: {\"choices\":[],\"usage\":{\"prompt_tokens\":4,\"completion_tokens\":9}}\n\ndata: [DONE]\n\n";
    let mut echoed = Vec::new();
    for (i, chunk) in sse.chunks(11).enumerate() {
        let last = (i + 1) * 11 >= sse.len();
        let out = h.on_message(response_body(chunk, last)).unwrap();
        for m in out {
            let Some(Response::ResponseBody(b)) = m.response else {
                panic!()
            };
            let Some(Mutation::StreamedResponse(s)) =
                b.response.unwrap().body_mutation.unwrap().mutation
            else {
                panic!()
            };
            echoed.extend(s.body);
        }
    }
    assert_eq!(echoed, sse);
    let text = r.metrics.encode();
    assert!(
        text.contains("kv_epp_usage_tokens_total{model=\"m\",kind=\"completion\"} 9"),
        "{text}"
    );
    let out = h.on_message(trailers(false)).unwrap();
    assert!(matches!(
        out[0].response,
        Some(Response::ResponseTrailers(_))
    ));
}

#[test]
fn out_of_order_messages_are_protocol_errors() {
    let r = router("");
    let mut h = r.handler();
    let err = h.on_message(body(b"{}", true)).unwrap_err();
    assert!(
        err.to_string()
            .contains("request body before request headers")
    );
}

#[test]
fn a_body_over_the_shared_budget_gets_503_and_every_exit_returns_its_bytes() {
    let r = router("");
    let budget = BodyBudget::new(40, Default::default());
    let opts = StreamOptions {
        body_budget: budget.clone(),
        flow: None,
        ..opts()
    };
    let mut a = r.handler_with(opts.clone());
    let mut b = r.handler_with(opts.clone());
    a.on_message(headers(&[], false, FULL_DUPLEX)).unwrap();
    b.on_message(headers(&[], false, FULL_DUPLEX)).unwrap();
    assert!(a.on_message(body(&[b' '; 30], false)).unwrap().is_empty());
    assert_eq!(budget.used(), 30);
    let out = b.on_message(body(&[b' '; 11], false)).unwrap();
    let (code, text, _) = immediate_status(&out).unwrap();
    assert_eq!(code, 503);
    assert!(text.contains("rejected-buffer-full"), "{text}");
    assert!(b.is_finished());
    assert_eq!(budget.used(), 30, "the refused chunk took nothing");
    drop(a); // a reset mid-body
    assert_eq!(budget.used(), 0);

    // A decision returns the bytes too, and books exactly once.
    let mut c = r.handler_with(opts);
    c.on_message(headers(&[], false, FULL_DUPLEX)).unwrap();
    let out = c
        .on_message(body(br#"{"model":"m","prompt":[1,2,3,4,5]}"#, true))
        .unwrap();
    assert!(immediate_status(&out).is_none());
    assert_eq!((budget.used(), r.total_inflight()), (0, 1));
    drop(c);
    assert_eq!(r.total_inflight(), 0);
}

#[test]
fn abandoning_refuses_before_the_decision_and_only_ends_the_stream_after_it() {
    let r = router("");
    let mut h = r.handler();
    h.on_message(headers(&[], false, FULL_DUPLEX)).unwrap();
    h.on_message(body(b"{", false)).unwrap();
    let reply = h.abandon(&Reject::StreamIdle { after_ms: 5 }).unwrap();
    let (code, text, _) = immediate_status(&[reply]).unwrap();
    assert_eq!(code, 408);
    assert!(text.contains("stream-idle-timeout"), "{text}");
    assert!(h.is_finished());

    let mut h = r.handler();
    h.on_message(headers(&[], false, FULL_DUPLEX)).unwrap();
    h.on_message(body(br#"{"model":"m","prompt":[1,2,3,4,5]}"#, true))
        .unwrap();
    assert_eq!(r.total_inflight(), 1);
    assert!(h.abandon(&Reject::StreamIdle { after_ms: 5 }).is_none());
    assert!(h.decision().is_some(), "a routed request keeps its booking");
    drop(h);
    assert_eq!(r.total_inflight(), 0);
}

#[test]
fn the_decisive_message_is_known_before_it_is_handled() {
    let r = router("");
    let mut h = r.handler();
    assert_eq!(h.decides_on(&headers(&[], true, FULL_DUPLEX)), Some(0));
    assert_eq!(h.decides_on(&headers(&[], false, FULL_DUPLEX)), None);
    h.on_message(headers(&[], false, FULL_DUPLEX)).unwrap();
    assert_eq!(h.decides_on(&body(b"abc", false)), None);
    h.on_message(body(b"abc", false)).unwrap();
    assert_eq!(h.decides_on(&body(b"de", true)), Some(5));
}

#[test]
fn the_response_is_done_at_its_end_of_stream() {
    let r = router("");
    let mut h = r.handler();
    h.on_message(headers(&[], false, FULL_DUPLEX)).unwrap();
    h.on_message(body(br#"{"model":"m","prompt":[1,2,3,4,5]}"#, true))
        .unwrap();
    assert!(!h.response_done());
    h.on_message(response_headers(None, false, None)).unwrap();
    assert!(!h.response_done(), "a body follows");
    h.on_message(response_body(b"{}", true)).unwrap();
    assert!(h.response_done());
}

#[test]
fn an_unrenderable_chat_is_routed_on_load_and_counted_by_reason() {
    let fixtures = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/tokenizer");
    let yaml = format!(
        "models: [{{name: m, block_size: 4, tokenizer: {{path: '{fixtures}/small-bpe', chat_template: '{fixtures}/templates/llama3.jinja'}}}}]
workers: [{{endpoint: '10.0.0.1:8000', model: m}}]"
    );
    let c = Config::from_yaml(&yaml).unwrap();
    c.validate().unwrap();
    let metrics = Arc::new(Metrics::new());
    let r = Rig {
        picker: Arc::new(c.picker(metrics.clone()).unwrap()),
        metrics,
    };
    // llama3 raises on a conversation that starts with the assistant; vLLM would answer 400
    // itself, kv-epp lets it decide.
    let raises = br#"{"model":"m","messages":[{"role":"assistant","content":"a"},{"role":"user","content":"b"}]}"#;
    for _ in 0..2 {
        let mut h = r.handler();
        h.on_message(headers(
            &[(":path", "/v1/chat/completions")],
            false,
            FULL_DUPLEX,
        ))
        .unwrap();
        let out = h.on_message(body(raises, true)).unwrap();
        let (dest, _, bytes, _, _) = routing_of(&out);
        assert_eq!(dest, "10.0.0.1:8000");
        assert_eq!(bytes, raises);
    }
    let text = r.metrics.encode();
    assert!(
        text.contains(r#"kv_epp_unrenderable_total{model="m",reason="template_rejected"} 2"#),
        "{text}"
    );
    assert!(
        !r.metrics.unrenderable("m", "template_rejected"),
        "logged once per model and reason"
    );
    let mut h = r.handler();
    h.on_message(headers(
        &[(":path", "/v1/chat/completions")],
        false,
        FULL_DUPLEX,
    ))
    .unwrap();
    let out = h
        .on_message(body(br#"{"model":"m","messages":[]}"#, true))
        .unwrap();
    assert_eq!(
        immediate_status(&out).map(|i| i.0),
        Some(400),
        "malformed stays 400"
    );
}

/// A chat with a word longer than kv-epp tokenizes in one piece (256 KiB of letters, no split
/// point) is routed on load and counted under `long_word` by default, refused with a 400 that
/// says why under `routing.unrenderable: reject`; a word at the limit is tokenized.
#[test]
fn a_chat_with_an_over_long_word_is_routed_on_load_or_refused() {
    use kv_epp_tokenize::model::MAX_WORD_BYTES;
    let fixtures = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/tokenizer");
    let rig = |policy: &str| {
        let yaml = format!(
            "routing: {{unrenderable: {policy}}}
models: [{{name: m, block_size: 4, tokenizer: {{path: '{fixtures}/small-bpe', chat_template: '{fixtures}/templates/llama3.jinja'}}}}]
workers: [{{endpoint: '10.0.0.1:8000', model: m}}]"
        );
        let c = Config::from_yaml(&yaml).unwrap();
        c.validate().unwrap();
        let metrics = Arc::new(Metrics::new());
        Rig {
            picker: Arc::new(c.picker(metrics.clone()).unwrap()),
            metrics,
        }
    };
    let chat = |word: usize| {
        serde_json::to_vec(&serde_json::json!({
            "model": "m",
            "messages": [{"role": "user", "content": format!("see:\n{}\nok?", "a".repeat(word))}],
        }))
        .unwrap()
    };
    let send = |r: &Rig, bytes: &[u8]| {
        let mut h = r.handler();
        h.on_message(headers(
            &[(":path", "/v1/chat/completions")],
            false,
            FULL_DUPLEX,
        ))
        .unwrap();
        h.on_message(body(bytes, true)).unwrap()
    };
    let long = chat(4 * MAX_WORD_BYTES);
    let counted = |r: &Rig| {
        r.metrics
            .encode()
            .lines()
            .find(|l| l.starts_with("kv_epp_unrenderable_total{") && l.contains("long_word"))
            .map(str::to_owned)
    };

    let load_only = rig("load_only");
    let out = send(&load_only, &long);
    let (dest, _, bytes, _, _) = routing_of(&out);
    assert_eq!(dest, "10.0.0.1:8000");
    assert_eq!(bytes, long, "the body goes through untouched");
    assert_eq!(
        counted(&load_only).as_deref(),
        Some(r#"kv_epp_unrenderable_total{model="m",reason="long_word"} 1"#)
    );
    let at_limit = chat(MAX_WORD_BYTES);
    let (dest, _, _, _, _) = routing_of(&send(&load_only, &at_limit));
    assert_eq!(dest, "10.0.0.1:8000");
    assert_eq!(
        counted(&load_only).as_deref(),
        Some(r#"kv_epp_unrenderable_total{model="m",reason="long_word"} 1"#),
        "a word at the limit is tokenized"
    );

    let reject = rig("reject");
    let out = send(&reject, &long);
    let (status, text, ..) = immediate_status(&out).expect("an immediate response");
    assert_eq!(status, 400);
    assert!(
        text.contains("without a split point") && text.contains(&MAX_WORD_BYTES.to_string()),
        "{text}"
    );
}

#[test]
fn salted_requests_to_engines_without_salted_events_are_counted() {
    let count = |r: &Rig| {
        r.metrics
            .encode()
            .lines()
            .find(|l| l.starts_with("kv_epp_unisolated_salted_requests_total{"))
            .and_then(|l| l.rsplit(' ').next()?.parse::<u64>().ok())
            .unwrap_or(0)
    };
    let send = |r: &Rig, tenant: Option<&str>| {
        let mut h = r.handler();
        let hs: Vec<(&str, &str)> = tenant.map(|t| ("x-tenant-id", t)).into_iter().collect();
        h.on_message(headers(&hs, false, FULL_DUPLEX)).unwrap();
        let out = h
            .on_message(body(br#"{"model":"m","prompt":[1,2,3,4]}"#, true))
            .unwrap();
        assert!(immediate_status(&out).is_none(), "routed");
    };
    // Engines whose events carry no salt: each salted request is counted, unsalted ones are not.
    let r = router("events: {engine: sglang, salted_events: false}\n");
    send(&r, Some("tenant-a"));
    send(&r, None);
    send(&r, Some("tenant-b"));
    assert_eq!(count(&r), 2);
    // The default: salts are in the events, nothing to count.
    let r = router("events: {engine: sglang}\n");
    send(&r, Some("tenant-a"));
    assert_eq!(count(&r), 0);
}

#[test]
fn token_id_decisions_run_inline_with_the_same_answer_and_chats_do_not() {
    let r = router("");
    let payload = br#"{"model":"m","prompt":[1,2,3,4,5,6,7,8]}"#;
    // Inline: the decisive chunk joins the body first; the answer is the lane's answer.
    let mut h = r.handler();
    h.on_message(headers(&[(":path", "/v1/completions")], false, FULL_DUPLEX))
        .unwrap();
    h.on_message(body(&payload[..10], false)).unwrap();
    let mut last = body(&payload[10..], true);
    assert!(h.decides_inline(&mut last));
    assert_eq!(h.decides_on(&last), Some(payload.len()));
    let (dest, _, bytes, ends, _) = routing_of(&h.on_message(last).unwrap());
    assert!(!dest.is_empty());
    assert_eq!((bytes.as_slice(), ends), (&payload[..], 1));
    drop(h);
    // A body-less request, and a refused body, need no tokenizer either.
    let mut h = r.handler();
    assert!(h.decides_inline(&mut headers(&[], true, FULL_DUPLEX)));
    let mut h2 = r.handler();
    h2.on_message(headers(&[], false, BUFFERED)).unwrap();
    let mut bad = body(b"{", true);
    assert!(h2.decides_inline(&mut bad));
    assert_eq!(
        immediate_status(&h2.on_message(bad).unwrap()).unwrap().0,
        400
    );
    drop(h);
    // A text prompt may tokenize: parsed here, decided on a lane, the body forwarded whole.
    let text = br#"{"model":"m","prompt":"hi"}"#;
    let mut h = r.handler();
    h.on_message(headers(&[(":path", "/v1/completions")], false, FULL_DUPLEX))
        .unwrap();
    let mut last = body(text, true);
    assert!(!h.decides_inline(&mut last));
    let (_, _, bytes, _, _) = routing_of(&h.on_message(last).unwrap());
    assert_eq!(bytes, text);
    // A chat may tokenize: it goes to a lane, and the chunk still arrives whole.
    let chat = br#"{"model":"m","messages":[{"role":"user","content":"hi"}]}"#;
    let mut h = r.handler();
    h.on_message(headers(
        &[(":path", "/v1/chat/completions")],
        false,
        FULL_DUPLEX,
    ))
    .unwrap();
    let mut last = body(chat, true);
    assert!(!h.decides_inline(&mut last));
    let (_, _, bytes, _, _) = routing_of(&h.on_message(last).unwrap());
    assert_eq!(bytes, chat);
}

#[test]
fn a_decisive_chunk_over_the_budget_stays_for_the_503() {
    let r = router("");
    let budget = BodyBudget::new(40, Default::default());
    let mut h = r.handler_with(StreamOptions {
        body_budget: budget.clone(),
        flow: None,
        ..opts()
    });
    h.on_message(headers(&[], false, FULL_DUPLEX)).unwrap();
    h.on_message(body(&[b' '; 30], false)).unwrap();
    let mut last = body(&[b' '; 11], true);
    assert!(!h.decides_inline(&mut last));
    assert_eq!(budget.used(), 30, "nothing taken for the refused chunk");
    let (code, _, _) = immediate_status(&h.on_message(last).unwrap()).unwrap();
    assert_eq!(code, 503);
    drop(h);
    assert_eq!(budget.used(), 0);
}

/// With flow control off, a request refused because every worker is full costs its tenant no
/// token-rate quota: once capacity is back, its next request is served, not refused for a rate
/// it never used.
#[test]
fn a_request_refused_for_saturation_costs_no_rate_quota() {
    const YAML: &str = "routing: {max_inflight_per_worker: 1}
flow_control: {enabled: false, tenants: [{id: metered, tokens_per_second: 1, burst_tokens: 100}]}";
    let settings = Config::from_yaml(YAML)
        .unwrap()
        .flow_control
        .settings()
        .unwrap();
    let rig = router(YAML);
    let flow = crate::flow::FlowControl::new(
        settings,
        rig.picker.clone(),
        rig.metrics.flow.clone(),
        rig.picker.workers.released(),
    );
    let opts = StreamOptions {
        flow: Some(flow),
        ..opts()
    };
    // About 94 units a request: a second one from the 100-unit bucket would be refused.
    let req = br#"{"model":"m","prompt":[1,2,3,4],"max_tokens":90}"#;
    let send = |tenant: Option<&str>| {
        let mut h = rig.handler_with(opts.clone());
        let mut hs = vec![(":path", "/v1/completions")];
        if let Some(t) = tenant {
            hs.push(("x-tenant-id", t));
        }
        h.on_message(headers(&hs, false, FULL_DUPLEX)).unwrap();
        let out = h.on_message(body(req, true)).unwrap();
        (h, immediate_status(&out).map(|i| (i.0, i.1)))
    };
    // Another tenant fills both workers; the metered tenant is refused for saturation.
    let (busy1, s1) = send(None);
    let (busy2, s2) = send(None);
    assert!(s1.is_none() && s2.is_none());
    let (_, s) = send(Some("metered"));
    assert!(s.unwrap().1.contains("in-flight limit"), "saturated");
    drop((busy1, busy2));
    assert_eq!(rig.total_inflight(), 0);
    let (_served, s) = send(Some("metered"));
    assert!(s.is_none(), "refused for a rate it never used: {s:?}");
}

/// BUFFERED sends the whole body in one message; with trailers it comes without end-of-stream
/// and Envoy waits for the answer (then sends the trailers when their mode is SEND). It is
/// answered at once, and the trailers after it.
#[test]
fn a_buffered_body_followed_by_trailers_is_answered() {
    let r = router("");
    let mut h = r.handler();
    let out = h
        .on_message(headers(&[(":path", "/v1/completions")], false, BUFFERED))
        .unwrap();
    assert_eq!(out.len(), 1, "headers answered at once");
    let msg = body(br#"{"model":"m","prompt":[1,2,3,4,5,6,7,8]}"#, false);
    assert!(
        h.decides_on(&msg).is_some(),
        "a decision (on a lane if large)"
    );
    let out = h.on_message(msg).unwrap();
    let (dest, ..) = routing_of(&out);
    assert!(dest.starts_with("10.0.0."), "routed: {out:?}");
    let out = h
        .on_message(message(Request::RequestTrailers(Default::default())))
        .unwrap();
    assert_eq!(out.len(), 1, "trailers answered");
    assert_eq!(r.total_inflight(), 1);
}

/// Modes that cannot carry a routing decision are refused with a reason instead of leaving
/// Envoy waiting: STREAMED and NONE at the request headers (500 `unsupported-body-mode`), and a
/// BUFFERED_PARTIAL body cut at Envoy's buffer limit (413). A whole BUFFERED_PARTIAL body, and
/// a body-less request in any mode, are routed. Nothing stays booked or buffered.
#[test]
fn body_modes_that_cannot_carry_a_decision_are_refused_with_a_reason() {
    const STREAMED: i32 = 1;
    const PARTIAL: i32 = 3;
    let r = router("");
    let req = br#"{"model":"m","prompt":[1,2,3,4,5,6,7,8]}"#;
    for (mode, name) in [(STREAMED, "STREAMED"), (0, "NONE")] {
        let mut h = r.handler();
        let out = h
            .on_message(headers(&[(":path", "/v1/completions")], false, mode))
            .unwrap();
        let (code, text, _) = immediate_status(&out).expect("refused");
        assert_eq!(code, 500, "{name}");
        assert!(
            text.contains(name) && text.contains("FULL_DUPLEX_STREAMED"),
            "{text}"
        );
        assert!(h.is_finished());
        // Body-less: routed on load, whatever the mode.
        let mut h = r.handler();
        let out = h
            .on_message(headers(&[(":path", "/v1/models")], true, mode))
            .unwrap();
        assert!(immediate_status(&out).is_none(), "{name}: {out:?}");
    }
    let mut h = r.handler();
    h.on_message(headers(&[(":path", "/v1/completions")], false, PARTIAL))
        .unwrap();
    let out = h.on_message(body(&req[..10], false)).unwrap();
    let (code, text, _) = immediate_status(&out).expect("refused");
    assert_eq!(code, 413);
    assert!(text.contains("BUFFERED_PARTIAL"), "{text}");
    let mut h = r.handler();
    h.on_message(headers(&[(":path", "/v1/completions")], false, PARTIAL))
        .unwrap();
    let out = h.on_message(body(req, true)).unwrap();
    assert!(routing_of(&out).0.starts_with("10.0.0."), "{out:?}");
    drop(h);
    // Within the buffer limit and followed by trailers, a body comes without end-of-stream
    // too: of its announced length, it is whole.
    let mut h = r.handler();
    let length = req.len().to_string();
    h.on_message(headers(
        &[(":path", "/v1/completions"), ("content-length", &length)],
        false,
        PARTIAL,
    ))
    .unwrap();
    let msg = body(req, false);
    assert!(h.decides_on(&msg).is_some());
    let out = h.on_message(msg).unwrap();
    assert!(routing_of(&out).0.starts_with("10.0.0."), "{out:?}");
    drop(h);
    assert_eq!(r.total_inflight(), 0);
    let text = r.metrics.encode();
    assert!(text.contains("outcome=\"rejected_body_mode\""), "{text}");
}
