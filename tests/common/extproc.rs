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

/// The two messages of a `/v1/completions` request for `tokens` from `tenant`: headers, body.
pub fn completion(tokens: &[u32], tenant: &str) -> [ProcessingRequest; 2] {
    let header = |k: &str, v: &str| HeaderValue {
        key: k.into(),
        value: String::new(),
        raw_value: v.as_bytes().to_vec(),
    };
    let body = json!({"model": "m", "prompt": tokens, "max_tokens": 1}).to_string();
    [
        ProcessingRequest {
            protocol_config: Some(ProtocolConfiguration {
                request_body_mode: 2,
                response_body_mode: 0,
                ..Default::default()
            }),
            request: Some(Request::RequestHeaders(HttpHeaders {
                headers: Some(HeaderMap {
                    headers: vec![
                        header(":method", "POST"),
                        header(":path", "/v1/completions"),
                        header("content-type", "application/json"),
                        header("x-tenant-id", tenant),
                    ],
                }),
                end_of_stream: false,
                ..Default::default()
            })),
            ..Default::default()
        },
        ProcessingRequest {
            request: Some(Request::RequestBody(HttpBody {
                body: body.into_bytes(),
                end_of_stream: true,
                ..Default::default()
            })),
            ..Default::default()
        },
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
