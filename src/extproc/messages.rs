//! Building the ext_proc messages Envoy expects, with the Envoy 1.40 facts baked in: header
//! values in `raw_value` only, routing headers overwritten (never appended), dynamic metadata
//! under `envoy.lb` (and kv-epp's own summary under `kv-epp`), streamed body chunks of at most
//! 62,000 bytes.

use envoy_types::pb::envoy::config::core::v3::{
    HeaderValue, HeaderValueOption, header_value_option::HeaderAppendAction,
};
use envoy_types::pb::envoy::service::ext_proc::v3::{
    BodyMutation, BodyResponse, CommonResponse, HeaderMutation, HeadersResponse, ImmediateResponse,
    ProcessingResponse, StreamedBodyResponse, TrailersResponse, body_mutation,
    processing_response::Response,
};
use envoy_types::pb::envoy::r#type::v3::HttpStatus;
use envoy_types::pb::google::protobuf::{Struct, Value, value::Kind};

use crate::decide::{Reject, Routed};

/// The routing header and metadata key of the endpoint-picker protocol.
pub(crate) const DESTINATION: &str = "x-gateway-destination-endpoint";
/// Dynamic metadata namespace Envoy's load balancer reads.
pub(crate) const LB_NAMESPACE: &str = "envoy.lb";
/// Largest streamed body chunk we send back.
pub(crate) const MAX_CHUNK: usize = 62_000;

/// A header set with `raw_value` and overwrite semantics.
pub(crate) fn set_header(key: &str, value: &[u8]) -> HeaderValueOption {
    HeaderValueOption {
        header: Some(HeaderValue {
            key: key.to_owned(),
            value: String::new(),
            raw_value: value.to_vec(),
        }),
        // The deprecated `append` stays unset: on Envoy 1.40 `append=true` would keep a
        // client-sent copy first.
        append_action: HeaderAppendAction::OverwriteIfExistsOrAdd as i32,
        ..HeaderValueOption::default()
    }
}

/// The namespace of kv-epp's own dynamic metadata (for access logs:
/// `%DYNAMIC_METADATA(kv-epp:salt_fingerprint)%`, ...).
pub(crate) const DECISION_NAMESPACE: &str = "kv-epp";

fn string(s: impl Into<String>) -> Value {
    Value {
        kind: Some(Kind::StringValue(s.into())),
    }
}

fn number(n: f64) -> Value {
    Value {
        kind: Some(Kind::NumberValue(n)),
    }
}

fn namespace(fields: Vec<(&str, Value)>) -> Value {
    Value {
        kind: Some(Kind::StructValue(Struct {
            fields: fields.into_iter().map(|(k, v)| (k.to_owned(), v)).collect(),
        })),
    }
}

/// The dynamic metadata of a decision: `envoy.lb` with the destination (what the gateway routes
/// on), and `kv-epp` with what an operator chasing a cache miss reads in the access log: the
/// worker, the model, the salt's fingerprint (never the salt), prompt size, cached blocks, a
/// digest of the token IDs and the prompt's last block hash (compare with `kv-epp tokenize` and
/// `/explain`). Hashes and digests are 16 hex digits.
pub(crate) fn decision_metadata(destination: &str, d: &Routed) -> Struct {
    let hex = |v: u64| string(format!("{v:016x}"));
    let mut kv = vec![
        ("worker", string(d.pick.to_string())),
        ("model", string(d.model_label.clone())),
        ("prompt_blocks", number(f64::from(d.prompt_blocks))),
        ("cached_blocks", number(d.cached_blocks)),
    ];
    if let Some(fp) = d.salt {
        kv.push(("salt_fingerprint", string(fp.to_string())));
    }
    if let Some(n) = d.prompt_tokens {
        kv.push(("prompt_tokens", number(n as f64)));
    }
    if let Some(t) = d.tokens_digest {
        kv.push(("tokens_digest", hex(t)));
    }
    if let Some(p) = d.prefix_hash {
        kv.push(("prefix_hash", hex(p.0)));
    }
    Struct {
        fields: [
            (
                LB_NAMESPACE.to_owned(),
                namespace(vec![(DESTINATION, string(destination))]),
            ),
            (DECISION_NAMESPACE.to_owned(), namespace(kv)),
        ]
        .into_iter()
        .collect(),
    }
}

/// Which request phase a common response answers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Phase {
    /// Request headers.
    RequestHeaders,
    /// Request body.
    RequestBody,
    /// Response headers.
    ResponseHeaders,
    /// Response body.
    ResponseBody,
}

/// A message that only restarts Envoy's message timer (BUFFERED mode) with `timeout`: sent once
/// when a request starts waiting in flow control's queue. Envoy accepts it once per message and
/// only up to the filter's `max_message_timeout` (0 by default: refused), so the shipped configs
/// set that above `flow_control.queue_timeout_ms` + 1 s.
pub fn override_message_timeout(timeout: std::time::Duration) -> ProcessingResponse {
    ProcessingResponse {
        override_message_timeout: Some(envoy_types::pb::google::protobuf::Duration {
            seconds: i64::try_from(timeout.as_secs()).unwrap_or(i64::MAX),
            nanos: timeout.subsec_nanos() as i32,
        }),
        ..ProcessingResponse::default()
    }
}

/// Wraps a common response for a phase, with optional dynamic metadata.
pub fn common(
    phase: Phase,
    response: CommonResponse,
    metadata: Option<Struct>,
) -> ProcessingResponse {
    let response = match phase {
        Phase::RequestHeaders => Response::RequestHeaders(HeadersResponse {
            response: Some(response),
        }),
        Phase::ResponseHeaders => Response::ResponseHeaders(HeadersResponse {
            response: Some(response),
        }),
        Phase::RequestBody => Response::RequestBody(BodyResponse {
            response: Some(response),
        }),
        Phase::ResponseBody => Response::ResponseBody(BodyResponse {
            response: Some(response),
        }),
    };
    ProcessingResponse {
        response: Some(response),
        dynamic_metadata: metadata,
        ..ProcessingResponse::default()
    }
}

/// A header mutation from sets and removals.
pub fn mutation(set: Vec<HeaderValueOption>, remove: Vec<String>) -> Option<HeaderMutation> {
    (!set.is_empty() || !remove.is_empty()).then_some(HeaderMutation {
        set_headers: set,
        remove_headers: remove,
    })
}

/// Streams `body` back as body responses of at most [`MAX_CHUNK`] bytes; the last carries
/// `end_of_stream` when `end` is set. An empty body still yields one (possibly final) message, and
/// a body that fits one chunk is sent as it is, without a copy.
pub(crate) fn stream_body(phase: Phase, body: Vec<u8>, end: bool) -> Vec<ProcessingResponse> {
    if body.len() <= MAX_CHUNK {
        return vec![streamed_chunk(phase, body, end)];
    }
    let last = body.len().div_ceil(MAX_CHUNK) - 1;
    body.chunks(MAX_CHUNK)
        .enumerate()
        .map(|(i, chunk)| streamed_chunk(phase, chunk.to_vec(), end && i == last))
        .collect()
}

fn streamed_chunk(phase: Phase, chunk: Vec<u8>, end_of_stream: bool) -> ProcessingResponse {
    common(
        phase,
        CommonResponse {
            body_mutation: Some(BodyMutation {
                mutation: Some(body_mutation::Mutation::StreamedResponse(
                    StreamedBodyResponse {
                        body: chunk,
                        end_of_stream,
                        ..StreamedBodyResponse::default()
                    },
                )),
            }),
            ..CommonResponse::default()
        },
        None,
    )
}

/// An empty answer to a trailers message.
pub(crate) fn trailers(request: bool) -> ProcessingResponse {
    let t = TrailersResponse::default();
    ProcessingResponse {
        response: Some(if request {
            Response::RequestTrailers(t)
        } else {
            Response::ResponseTrailers(t)
        }),
        ..ProcessingResponse::default()
    }
}

/// A local reply refusing the request: the status, reason header and OpenAI-style JSON body all
/// come from the [`Reject`], plus `extra` headers (e.g. `Retry-After`).
pub(crate) fn immediate(reject: &Reject, retry_after_seconds: u32) -> ProcessingResponse {
    let reason = reject.reason();
    let mut headers = vec![set_header("content-type", b"application/json")];
    headers.extend(
        reject
            .headers(retry_after_seconds)
            .iter()
            .map(|(k, v)| set_header(k, v.as_bytes())),
    );
    ProcessingResponse {
        response: Some(Response::ImmediateResponse(ImmediateResponse {
            status: Some(HttpStatus {
                code: i32::from(reject.status()),
            }),
            headers: mutation(headers, Vec::new()),
            body: reject.body().to_string().into_bytes(),
            grpc_status: None,
            details: format!("kv-epp: {reason}"),
        })),
        ..ProcessingResponse::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn headers_use_raw_value_and_overwrite() {
        let h = set_header(DESTINATION, b"10.0.0.1:8000");
        let hv = h.header.as_ref().unwrap();
        assert!(hv.value.is_empty());
        assert_eq!(hv.raw_value, b"10.0.0.1:8000");
        assert_eq!(
            h.append_action,
            HeaderAppendAction::OverwriteIfExistsOrAdd as i32
        );
    }

    #[test]
    fn bodies_are_chunked_and_end_once() {
        let body = vec![7u8; MAX_CHUNK * 2 + 5];
        let msgs = stream_body(Phase::RequestBody, body.clone(), true);
        assert_eq!(msgs.len(), 3);
        let mut joined = Vec::new();
        let mut ends = 0;
        for m in msgs {
            let Some(Response::RequestBody(b)) = m.response else {
                panic!()
            };
            let Some(body_mutation::Mutation::StreamedResponse(s)) =
                b.response.unwrap().body_mutation.unwrap().mutation
            else {
                panic!()
            };
            assert!(s.body.len() <= MAX_CHUNK);
            joined.extend(s.body);
            ends += usize::from(s.end_of_stream);
        }
        assert_eq!(joined, body);
        assert_eq!(ends, 1);
        assert_eq!(stream_body(Phase::ResponseBody, Vec::new(), true).len(), 1);
    }
}
