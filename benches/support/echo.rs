//! The echo ext_proc server: the message sequence kv-epp answers Envoy with, without deciding
//! anything, so a bench that runs it beside kv-epp shows the floor of gRPC and HTTP/2 stream
//! handling. A bench binary becomes this server when started with [`ECHO_FLAG`] and the
//! `ip:port` to name as every request's destination (see `child::start_echo`).
//!
//! Per stream, by the request body mode on its first message:
//! - FULL_DUPLEX_STREAMED: the header response waits for the whole body (routing would need it),
//!   then the body goes back as streamed chunks; response bodies are echoed chunk by chunk.
//! - BUFFERED (any other mode): headers are answered at once, the decision rides on the body response.
//! - Trailers and response headers are answered with an empty response.
#![allow(dead_code)] // each bench uses the part it reports

use std::pin::Pin;

use envoy_types::pb::envoy::config::core::v3::{HeaderValue, HeaderValueOption};
use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_server::{
    ExternalProcessor, ExternalProcessorServer,
};
use envoy_types::pb::envoy::service::ext_proc::v3::{
    BodyMutation, BodyResponse, CommonResponse, HeaderMutation, HeadersResponse, ProcessingRequest,
    ProcessingResponse, StreamedBodyResponse, TrailersResponse, body_mutation,
    processing_request::Request, processing_response::Response,
};
use envoy_types::pb::google::protobuf::{Struct, Value, value::Kind};
use futures_util::Stream;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;

/// The argument that turns a bench binary into the echo server; the next one is the pick.
pub(crate) const ECHO_FLAG: &str = "--echo-server";
/// What the echo server's stdout line starts with, then its address.
pub(crate) const ECHO_BANNER: &str = "echo serving ext_proc on ";
/// The destination header of the endpoint-picker protocol.
pub(crate) const DESTINATION: &str = "x-gateway-destination-endpoint";
/// Largest streamed chunk sent back (the convention kv-epp follows too).
const ECHO_CHUNK: usize = 62_000;
/// envoy.extensions.filters.http.ext_proc.v3.ProcessingMode.BodySendMode.FULL_DUPLEX_STREAMED
const FULL_DUPLEX: i32 = 4;

/// If this process was started as the echo server (`ECHO_FLAG pick`), serves until killed and
/// returns true.
pub(crate) fn run_if_asked() -> bool {
    let args: Vec<String> = std::env::args().collect();
    let Some(i) = args.iter().position(|a| a == ECHO_FLAG) else {
        return false;
    };
    let pick = args
        .get(i + 1)
        .cloned()
        .expect("the pick after --echo-server");
    serve(pick);
    true
}

/// Serves ext_proc on an ephemeral loopback port with the runtime `kv-epp serve` uses, printing
/// [`ECHO_BANNER`] and the address, until killed.
fn serve(pick: String) {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("runtime");
    rt.block_on(async {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        println!("{ECHO_BANNER}{}", listener.local_addr().expect("address"));
        let incoming =
            tonic::transport::server::TcpIncoming::from(listener).with_nodelay(Some(true));
        tonic::transport::Server::builder()
            .add_service(ExternalProcessorServer::new(Echo { pick }))
            .serve_with_incoming(incoming)
            .await
            .expect("serve");
    });
}

struct Echo {
    pick: String,
}

type ResponseStream = Pin<Box<dyn Stream<Item = Result<ProcessingResponse, tonic::Status>> + Send>>;

#[tonic::async_trait]
impl ExternalProcessor for Echo {
    type ProcessStream = ResponseStream;

    /// Like kv-epp's adapter: one task per stream feeding a channel of 32 responses.
    async fn process(
        &self,
        request: tonic::Request<tonic::Streaming<ProcessingRequest>>,
    ) -> Result<tonic::Response<ResponseStream>, tonic::Status> {
        let mut inbound = request.into_inner();
        let (tx, rx) = mpsc::channel(32);
        let pick = self.pick.clone();
        tokio::spawn(async move {
            let (mut body, mut buffered) = (Vec::new(), false);
            while let Ok(Some(msg)) = inbound.message().await {
                if let Some(p) = &msg.protocol_config {
                    // Like kv-epp: every mode but FULL_DUPLEX is answered with plain responses.
                    buffered = p.request_body_mode != FULL_DUPLEX;
                }
                let out = match msg.request {
                    Some(Request::RequestHeaders(h)) if h.end_of_stream => {
                        vec![decision(&pick, false)]
                    }
                    Some(Request::RequestHeaders(_)) if buffered => vec![ProcessingResponse {
                        response: Some(Response::RequestHeaders(HeadersResponse::default())),
                        ..ProcessingResponse::default()
                    }],
                    // FULL_DUPLEX: the header response waits for the body.
                    Some(Request::RequestHeaders(_)) => Vec::new(),
                    Some(Request::RequestBody(b)) if buffered => {
                        if b.end_of_stream {
                            vec![decision(&pick, true)]
                        } else {
                            Vec::new()
                        }
                    }
                    Some(Request::RequestBody(b)) => {
                        body.extend_from_slice(&b.body);
                        if b.end_of_stream {
                            let mut out = vec![decision(&pick, false)];
                            out.extend(echo_body(&std::mem::take(&mut body)));
                            out
                        } else {
                            Vec::new()
                        }
                    }
                    Some(Request::RequestTrailers(_)) => vec![ProcessingResponse {
                        response: Some(Response::RequestTrailers(TrailersResponse::default())),
                        ..ProcessingResponse::default()
                    }],
                    Some(Request::ResponseHeaders(_)) => vec![ProcessingResponse {
                        response: Some(Response::ResponseHeaders(HeadersResponse::default())),
                        ..ProcessingResponse::default()
                    }],
                    Some(Request::ResponseBody(b)) => vec![ProcessingResponse {
                        response: Some(Response::ResponseBody(streamed(b.body, b.end_of_stream))),
                        ..ProcessingResponse::default()
                    }],
                    Some(Request::ResponseTrailers(_)) => vec![ProcessingResponse {
                        response: Some(Response::ResponseTrailers(TrailersResponse::default())),
                        ..ProcessingResponse::default()
                    }],
                    None => Vec::new(),
                };
                for r in out {
                    if tx.send(Ok(r)).await.is_err() {
                        return;
                    }
                }
            }
        });
        Ok(tonic::Response::new(Box::pin(ReceiverStream::new(rx))))
    }
}

/// A decision naming `pick`: the destination header (overwrite, `raw_value`), route cache
/// cleared, and the same destination under `envoy.lb` in the dynamic metadata; on the header
/// response (FULL_DUPLEX, body-less requests) or on the body response (BUFFERED).
fn decision(pick: &str, on_body: bool) -> ProcessingResponse {
    let header = HeaderValueOption {
        header: Some(HeaderValue {
            key: DESTINATION.into(),
            value: String::new(),
            raw_value: pick.as_bytes().to_vec(),
        }),
        // OVERWRITE_IF_EXISTS_OR_ADD
        append_action: 2,
        ..HeaderValueOption::default()
    };
    let common = CommonResponse {
        header_mutation: Some(HeaderMutation {
            set_headers: vec![header],
            remove_headers: Vec::new(),
        }),
        clear_route_cache: true,
        ..CommonResponse::default()
    };
    let text = |s: &str| Value {
        kind: Some(Kind::StringValue(s.into())),
    };
    let lb = Struct {
        fields: [(DESTINATION.to_owned(), text(pick))].into(),
    };
    ProcessingResponse {
        response: Some(if on_body {
            Response::RequestBody(BodyResponse {
                response: Some(common),
            })
        } else {
            Response::RequestHeaders(HeadersResponse {
                response: Some(common),
            })
        }),
        dynamic_metadata: Some(Struct {
            fields: [(
                "envoy.lb".to_owned(),
                Value {
                    kind: Some(Kind::StructValue(lb)),
                },
            )]
            .into(),
        }),
        ..ProcessingResponse::default()
    }
}

/// One streamed body chunk sent back.
fn streamed(chunk: Vec<u8>, end_of_stream: bool) -> BodyResponse {
    BodyResponse {
        response: Some(CommonResponse {
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
        }),
    }
}

/// A request body sent back as streamed chunks, the last one ending the stream.
fn echo_body(body: &[u8]) -> Vec<ProcessingResponse> {
    let chunks: Vec<&[u8]> = body.chunks(ECHO_CHUNK).collect();
    let last = chunks.len().saturating_sub(1);
    chunks
        .into_iter()
        .enumerate()
        .map(|(i, chunk)| ProcessingResponse {
            response: Some(Response::RequestBody(streamed(chunk.to_vec(), i == last))),
            ..ProcessingResponse::default()
        })
        .collect()
}
