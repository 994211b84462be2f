//! The ext_proc gRPC edge: a thin tonic adapter that runs one [`stream::StreamHandler`] per
//! Envoy stream. Decisions are `crate::decide`'s, stream state the handler's; this file only moves messages.

pub mod messages;
pub mod stream;
pub mod usage;

use std::pin::Pin;
use std::sync::Arc;

use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_server::ExternalProcessor;
use envoy_types::pb::envoy::service::ext_proc::v3::{ProcessingRequest, ProcessingResponse};
use futures_util::Stream;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status, Streaming};

use crate::decide::Picker;
use crate::metrics::Metrics;
use stream::{StreamHandler, StreamOptions};

/// The ext_proc service.
pub(crate) struct ExtProcService {
    picker: Arc<Picker>,
    metrics: Arc<Metrics>,
    opts: StreamOptions,
}

impl ExtProcService {
    /// A service deciding with `picker`, counting in `metrics`.
    pub(crate) fn new(picker: Arc<Picker>, metrics: Arc<Metrics>, opts: StreamOptions) -> Self {
        ExtProcService {
            picker,
            metrics,
            opts,
        }
    }
}

type ResponseStream = Pin<Box<dyn Stream<Item = Result<ProcessingResponse, Status>> + Send>>;

#[tonic::async_trait]
impl ExternalProcessor for ExtProcService {
    type ProcessStream = ResponseStream;

    async fn process(
        &self,
        request: Request<Streaming<ProcessingRequest>>,
    ) -> Result<Response<Self::ProcessStream>, Status> {
        let mut inbound = request.into_inner();
        let (tx, rx) = mpsc::channel(32);
        let mut handler =
            StreamHandler::new(self.picker.clone(), self.metrics.clone(), self.opts.clone());
        let metrics = self.metrics.clone();
        tokio::spawn(async move {
            loop {
                let msg = match inbound.message().await {
                    Ok(Some(msg)) => msg,
                    // Half-close, or Envoy's reset after our last message: a normal end.
                    Ok(None) => break,
                    Err(status) => {
                        if handler.decision().is_none() && !handler.is_finished() {
                            count_error(&metrics, "reset_before_decision");
                            tracing::debug!(%status, "ext_proc stream reset before a decision");
                        }
                        break;
                    }
                };
                match handler.on_message(msg) {
                    Ok(out) => {
                        for r in out {
                            if tx.send(Ok(r)).await.is_err() {
                                return; // Envoy went away; dropping the handler releases the booking.
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
        });
        Ok(Response::new(Box::pin(ReceiverStream::new(rx))))
    }
}

fn count_error(metrics: &Metrics, kind: &str) {
    metrics
        .stream_errors
        .get_or_create(&Metrics::labels(&[("kind", kind)]))
        .inc();
}
