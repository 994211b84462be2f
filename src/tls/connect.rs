//! The connector a tonic client dials a TLS peer with: TCP (TCP_NODELAY), then a rustls
//! handshake with the client configuration current at that moment, checking the peer's
//! certificate against one configured name (peers are dialled by IP, but their certificates name
//! the Service, not each pod).
//!
//! The channel's URI stays `http://ip:port`: TLS is done here, below tonic, so tonic's own TLS
//! layer (which cannot reload) stays out of the way.

use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use hyper_util::rt::TokioIo;
use tokio::net::TcpStream;
use tokio_rustls::TlsConnector;
use tokio_rustls::client::TlsStream;
use tokio_rustls::rustls::pki_types::ServerName;
use tonic::codegen::Service;
use tonic::codegen::http::Uri;

use super::Reloading;

/// Dials `ip:port` URIs over TLS (a tonic `Endpoint::connect_with_connector_lazy` connector).
#[derive(Clone, Debug)]
pub(crate) struct Connector {
    tls: Arc<Reloading>,
    name: ServerName<'static>,
}

impl Connector {
    /// A connector presenting `tls`'s certificate and expecting peers' to be valid for `name`.
    pub(crate) fn new(tls: Arc<Reloading>, name: ServerName<'static>) -> Connector {
        Connector { tls, name }
    }
}

impl Service<Uri> for Connector {
    type Response = TokioIo<TlsStream<TcpStream>>;
    type Error = std::io::Error;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, Self::Error>> + Send>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, uri: Uri) -> Self::Future {
        let client = self.tls.current().client.clone();
        let name = self.name.clone();
        Box::pin(async move {
            let invalid = |m: String| std::io::Error::new(std::io::ErrorKind::InvalidInput, m);
            let client =
                client.ok_or_else(|| invalid("TLS without a CA cannot dial peers".into()))?;
            let addr: SocketAddr = uri
                .authority()
                .map(|a| a.as_str())
                .unwrap_or_default()
                .parse()
                .map_err(|_| invalid(format!("peer URI {uri} is not ip:port")))?;
            let tcp = TcpStream::connect(addr).await?;
            tcp.set_nodelay(true)?;
            let tls = TlsConnector::from(client).connect(name, tcp).await?;
            Ok(TokioIo::new(tls))
        })
    }
}
