//! The accepted connections of a TLS listener, handshaken, for tonic's
//! `serve_with_incoming_shutdown`.
//!
//! Each connection gets TCP_NODELAY (see `server::incoming`) and its own handshake task with
//! the configuration current when it arrived, so a slow or hostile client never holds up the
//! accept loop and a reload never touches a session already established. A handshake that fails
//! or takes longer than [`HANDSHAKE_TIMEOUT`] is dropped and counted on the listener.

use std::sync::Arc;
use std::time::Duration;

use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;
use tokio_rustls::TlsAcceptor;
use tokio_rustls::server::TlsStream;
use tokio_stream::wrappers::ReceiverStream;

use super::Reloading;

/// Longest a client may take to finish its handshake.
pub(crate) const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// Handshaken connections waiting for tonic; beyond this the accept loop waits.
const BACKLOG: usize = 64;

/// Accepts on `listener` until the returned stream is dropped; yields each connection once its
/// TLS handshake with `tls`'s current configuration has succeeded.
pub(crate) fn incoming(
    listener: TcpListener,
    tls: Arc<Reloading>,
) -> ReceiverStream<Result<TlsStream<TcpStream>, std::io::Error>> {
    let (tx, rx) = mpsc::channel(BACKLOG);
    tokio::spawn(async move {
        loop {
            let accepted = tokio::select! {
                a = listener.accept() => a,
                _ = tx.closed() => return,
            };
            let tcp = match accepted {
                Ok((tcp, _)) => tcp,
                Err(e) => {
                    // Out of file descriptors and the like: back off instead of spinning.
                    tracing::debug!(listener = tls.listener(), error = %e, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            };
            let _ = tcp.set_nodelay(true);
            let acceptor = TlsAcceptor::from(tls.current().server.clone());
            let (tx, tls) = (tx.clone(), tls.clone());
            tokio::spawn(async move {
                let peer = tcp.peer_addr().ok();
                match tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(tcp)).await {
                    Ok(Ok(conn)) => {
                        let _ = tx.send(Ok(conn)).await;
                    }
                    Ok(Err(e)) => {
                        tls.handshake_failures.inc();
                        tracing::debug!(listener = tls.listener(), ?peer, error = %e, "TLS handshake refused");
                    }
                    Err(_) => {
                        tls.handshake_failures.inc();
                        tracing::debug!(
                            listener = tls.listener(),
                            ?peer,
                            "TLS handshake timed out"
                        );
                    }
                }
            });
        }
    });
    ReceiverStream::new(rx)
}
