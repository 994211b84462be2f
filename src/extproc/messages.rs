//! Building the ext_proc messages Envoy expects, with the Envoy 1.40 facts baked in: header
//! values in `raw_value` only, routing headers overwritten (never appended), dynamic metadata
//! under `envoy.lb`, streamed body chunks of at most 62,000 bytes.

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

use crate::decide::Reject;

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

/// `{"envoy.lb": {"x-gateway-destination-endpoint": destination}}`.
pub(crate) fn destination_metadata(destination: &str) -> Struct {
    let inner = Struct {
        fields: [(
            DESTINATION.to_owned(),
            Value {
                kind: Some(Kind::StringValue(destination.to_owned())),
            },
        )]
        .into_iter()
        .collect(),
    };
    Struct {
        fields: [(
            LB_NAMESPACE.to_owned(),
            Value {
                kind: Some(Kind::StructValue(inner)),
            },
        )]
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
/// `end_of_stream` when `end` is set. An empty body still yields one (possibly final) message.
pub(crate) fn stream_body(phase: Phase, body: &[u8], end: bool) -> Vec<ProcessingResponse> {
    let chunks: Vec<&[u8]> = if body.is_empty() {
        vec![&[][..]]
    } else {
        body.chunks(MAX_CHUNK).collect()
    };
    let last = chunks.len() - 1;
    chunks
        .into_iter()
        .enumerate()
        .map(|(i, chunk)| {
            common(
                phase,
                CommonResponse {
                    body_mutation: Some(BodyMutation {
                        mutation: Some(body_mutation::Mutation::StreamedResponse(
                            StreamedBodyResponse {
                                body: chunk.to_vec(),
                                end_of_stream: end && i == last,
                                ..StreamedBodyResponse::default()
                            },
                        )),
                    }),
                    ..CommonResponse::default()
                },
                None,
            )
        })
        .collect()
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
pub(crate) fn immediate(reject: &Reject, extra: Vec<HeaderValueOption>) -> ProcessingResponse {
    let reason = reject.reason();
    let mut headers = vec![
        set_header("content-type", b"application/json"),
        set_header("x-llm-d-request-dropped-reason", reason.as_bytes()),
    ];
    headers.extend(extra);
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
        let msgs = stream_body(Phase::RequestBody, &body, true);
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
        assert_eq!(stream_body(Phase::ResponseBody, &[], true).len(), 1);
    }
}
