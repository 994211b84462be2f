//! An ext_proc client that sends a completion request the way Envoy does (headers, then the
//! whole body: BUFFERED) and reads kv-epp's pick back, over any gRPC channel (plain or TLS).

use envoy_types::pb::envoy::config::core::v3::{HeaderMap, HeaderValue};
use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_client::ExternalProcessorClient;
use envoy_types::pb::envoy::service::ext_proc::v3::{
    HttpBody, HttpHeaders, ProcessingRequest, ProcessingResponse, ProtocolConfiguration,
    processing_request::Request, processing_response::Response,
};
use serde_json::json;
use tonic::transport::Channel;

/// A plaintext channel to an ext_proc port.
pub async fn plain_channel(addr: std::net::SocketAddr) -> Channel {
    Channel::from_shared(format!("http://{addr}"))
        .unwrap()
        .connect()
        .await
        .unwrap()
}

/// Request headers of a POST to `path` as Envoy sends them, announcing its body modes
/// (`ProcessingMode.BodySendMode`: 2 = BUFFERED, 4 = FULL_DUPLEX_STREAMED), with `extra` headers.
pub fn request_headers(
    path: &str,
    request_body_mode: i32,
    response_body_mode: i32,
    extra: &[(&str, &str)],
) -> ProcessingRequest {
    let header = |k: &str, v: &str| HeaderValue {
        key: k.into(),
        value: String::new(),
        raw_value: v.as_bytes().to_vec(),
    };
    let mut headers = vec![
        header(":method", "POST"),
        header(":path", path),
        header("content-type", "application/json"),
    ];
    headers.extend(extra.iter().map(|(k, v)| header(k, v)));
    ProcessingRequest {
        protocol_config: Some(ProtocolConfiguration {
            request_body_mode,
            response_body_mode,
            ..Default::default()
        }),
        request: Some(Request::RequestHeaders(HttpHeaders {
            headers: Some(HeaderMap { headers }),
            end_of_stream: false,
            ..Default::default()
        })),
        ..Default::default()
    }
}

/// One request body chunk.
pub fn request_body(body: Vec<u8>, end_of_stream: bool) -> ProcessingRequest {
    ProcessingRequest {
        request: Some(Request::RequestBody(HttpBody {
            body,
            end_of_stream,
            ..Default::default()
        })),
        ..Default::default()
    }
}

/// The two messages of a `/v1/completions` request for `tokens` from `tenant`: headers, body.
pub fn completion(tokens: &[u32], tenant: &str) -> [ProcessingRequest; 2] {
    let body = json!({"model": "m", "prompt": tokens, "max_tokens": 1}).to_string();
    [
        request_headers("/v1/completions", 2, 0, &[("x-tenant-id", tenant)]),
        request_body(body.into_bytes(), true),
    ]
}

/// Reads responses until one sets `x-gateway-destination-endpoint`; `None` when the stream
/// ends first.
pub async fn pick(responses: &mut tonic::Streaming<ProcessingResponse>) -> Option<String> {
    while let Some(resp) = responses.message().await.unwrap() {
        let common = match &resp.response {
            Some(Response::RequestHeaders(h)) => h.response.clone(),
            Some(Response::RequestBody(b)) => b.response.clone(),
            Some(other) => panic!("unexpected response {other:?}"),
            None => None,
        };
        if let Some(hm) = common.and_then(|c| c.header_mutation) {
            for h in hm.set_headers {
                let hv = h.header.unwrap();
                if hv.key == "x-gateway-destination-endpoint" {
                    return Some(String::from_utf8(hv.raw_value).unwrap());
                }
            }
        }
    }
    None
}

/// The destination kv-epp picks for `tokens` from `tenant`, asked over `channel`.
pub async fn destination(channel: Channel, tokens: &[u32], tenant: &str) -> Option<String> {
    let mut client = ExternalProcessorClient::new(channel);
    let msgs = completion(tokens, tenant);
    let mut responses = client
        .process(tokio_stream::iter(msgs))
        .await
        .unwrap()
        .into_inner();
    pick(&mut responses).await
}
