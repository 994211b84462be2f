//! The HTTP/1.1 client for talking to engines on the cluster network (metrics scrapes,
//! TensorRT-LLM event drains): hyper's connection-level client, one request per connection, under
//! a whole-request deadline and a cap on the response body, so a slow or hostile engine can cost
//! neither time nor memory without bound.
//!
//! Why not pooled: engines are scraped every few hundred milliseconds at most, so a connection per
//! request costs nothing that matters and leaves no idle sockets or background tasks behind; the
//! connection is driven inside the caller's future, so hitting the deadline drops everything.

use std::net::SocketAddr;
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use http_body_util::{BodyExt, Full, LengthLimitError, Limited};
use hyper::Method;
use hyper::header::{CONTENT_LENGTH, CONTENT_TYPE, HOST, HeaderValue};
use hyper_util::rt::TokioIo;
use tokio::net::TcpStream;

// The types this API takes and returns, so callers need no HTTP crate of their own.
pub use hyper::{Request, Response, StatusCode, header};

/// What one request may cost: wall-clock time from connect to the last body byte, and response
/// body bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Limits {
    /// Deadline for the whole exchange (connect, send, response head and body).
    pub deadline: Duration,
    /// Largest response body accepted, in bytes (after de-chunking).
    pub max_body: usize,
}

/// Why a request failed.
#[derive(Debug, thiserror::Error)]
pub enum HttpError {
    /// The TCP connection could not be opened.
    #[error("connect: {0}")]
    Connect(#[source] std::io::Error),
    /// The deadline passed before the whole response was read.
    #[error("timed out")]
    Timeout,
    /// The response body is (or declared itself) larger than the cap.
    #[error("response larger than {0} bytes")]
    TooLarge(usize),
    /// The peer did not speak HTTP/1.x, or the connection broke mid-exchange.
    #[error("protocol: {0}")]
    Protocol(#[source] Box<dyn std::error::Error + Send + Sync>),
    /// The request itself could not be built (e.g. a path that is not a valid URI).
    #[error("invalid request: {0}")]
    InvalidRequest(#[source] hyper::http::Error),
    /// The caller's gate refused, once connected, to send the request (see [`post_json_gated`]):
    /// nothing was written.
    #[error("not sent: the caller withdrew the request")]
    NotSent,
}

/// `GET path` on `addr`; see [`send`] for costs and errors.
pub async fn get(
    addr: SocketAddr,
    path: &str,
    limits: Limits,
) -> Result<Response<Bytes>, HttpError> {
    let req = Request::get(path)
        .body(Bytes::new())
        .map_err(HttpError::InvalidRequest)?;
    send(addr, req, limits).await
}

/// `POST path` on `addr` with a JSON body; see [`send`] for costs and errors.
pub async fn post_json(
    addr: SocketAddr,
    path: &str,
    body: impl Into<Bytes>,
    limits: Limits,
) -> Result<Response<Bytes>, HttpError> {
    let req = Request::post(path)
        .header(CONTENT_TYPE, "application/json")
        .body(body.into())
        .map_err(HttpError::InvalidRequest)?;
    send(addr, req, limits).await
}

/// [`post_json`], written only if `gate()` still holds once the connection is up: for a request
/// with effects (a destructive drain) that may only be made while a condition holds, checked
/// in the same poll that hands the request to the connection, so no connect or handshake delay
/// (and no scheduling) separates the check from the write. `HttpError::NotSent` when it refuses.
pub async fn post_json_gated(
    addr: SocketAddr,
    path: &str,
    body: impl Into<Bytes>,
    limits: Limits,
    gate: impl FnOnce() -> bool,
) -> Result<Response<Bytes>, HttpError> {
    let req = Request::post(path)
        .header(CONTENT_TYPE, "application/json")
        .body(body.into())
        .map_err(HttpError::InvalidRequest)?;
    send_inner(addr, req, limits, |_| {}, gate).await
}

/// Sends `req` (origin-form URI, e.g. `/metrics`) to `addr` on a fresh connection and reads the
/// whole response. A `host` header naming `addr` is added when the request has none, and
/// `content-length: 0` to an empty POST, PUT or PATCH.
///
/// Costs at most `limits.deadline` of time and `limits.max_body` bytes of body; a response that
/// declares a larger `content-length` is refused before its body is read.
pub async fn send(
    addr: SocketAddr,
    req: Request<Bytes>,
    limits: Limits,
) -> Result<Response<Bytes>, HttpError> {
    send_observed(addr, req, limits, |_| {}).await
}

/// [`send`], calling `on_data` with each piece of the body as it arrives (e.g. to time the first
/// streamed token); the pieces handed over never add up to more than `limits.max_body`.
pub async fn send_observed(
    addr: SocketAddr,
    req: Request<Bytes>,
    limits: Limits,
    on_data: impl FnMut(&[u8]),
) -> Result<Response<Bytes>, HttpError> {
    send_inner(addr, req, limits, on_data, || true).await
}

async fn send_inner(
    addr: SocketAddr,
    mut req: Request<Bytes>,
    limits: Limits,
    on_data: impl FnMut(&[u8]),
    gate: impl FnOnce() -> bool,
) -> Result<Response<Bytes>, HttpError> {
    if !req.headers().contains_key(HOST) {
        // A socket address always renders as a valid header value; the fallback is unreachable.
        let host = HeaderValue::from_str(&addr.to_string())
            .unwrap_or_else(|_| HeaderValue::from_static("localhost"));
        req.headers_mut().insert(HOST, host);
    }
    // hyper sends no length for an empty body; servers may insist on one for methods that carry
    // content (RFC 9110 §8.6: a user agent SHOULD send it), so say 0 explicitly.
    let carries_content = matches!(*req.method(), Method::POST | Method::PUT | Method::PATCH);
    if carries_content && req.body().is_empty() && !req.headers().contains_key(CONTENT_LENGTH) {
        req.headers_mut()
            .insert(CONTENT_LENGTH, HeaderValue::from_static("0"));
    }
    tokio::time::timeout(
        limits.deadline,
        exchange(addr, req, limits.max_body, on_data, gate),
    )
    .await
    .map_err(|_| HttpError::Timeout)?
}

async fn exchange(
    addr: SocketAddr,
    req: Request<Bytes>,
    max_body: usize,
    on_data: impl FnMut(&[u8]),
    gate: impl FnOnce() -> bool,
) -> Result<Response<Bytes>, HttpError> {
    let stream = TcpStream::connect(addr).await.map_err(HttpError::Connect)?;
    exchange_over(stream, req, max_body, on_data, gate).await
}

/// The exchange of [`exchange`] over an open connection (the fuzz target drives it over bytes
/// in memory).
pub(crate) async fn exchange_over<S>(
    stream: S,
    req: Request<Bytes>,
    max_body: usize,
    mut on_data: impl FnMut(&[u8]),
    gate: impl FnOnce() -> bool,
) -> Result<Response<Bytes>, HttpError>
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Send + Unpin + 'static,
{
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .map_err(|e| HttpError::Protocol(e.into()))?;
    let read = async move {
        // Checked in the poll that queues the request; `conn`, polled right after in the same
        // pass, writes it.
        if !gate() {
            return Err(HttpError::NotSent);
        }
        let resp = sender
            .send_request(req.map(Full::new))
            .await
            .map_err(|e| HttpError::Protocol(e.into()))?;
        let (parts, body) = resp.into_parts();
        let declared = parts
            .headers
            .get(CONTENT_LENGTH)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse::<u64>().ok());
        if declared.is_some_and(|n| n > max_body as u64) {
            return Err(HttpError::TooLarge(max_body));
        }
        // `Limited` refuses a frame that would take the total past the cap before it is handed
        // over, so at most `max_body` bytes are ever kept.
        let mut body = Limited::new(body, max_body);
        let mut out = BytesMut::new();
        while let Some(frame) = body.frame().await {
            let frame = frame.map_err(|e| {
                if e.is::<LengthLimitError>() {
                    HttpError::TooLarge(max_body)
                } else {
                    HttpError::Protocol(e)
                }
            })?;
            if let Ok(data) = frame.into_data() {
                on_data(&data);
                out.extend_from_slice(&data);
            }
        }
        Ok(Response::from_parts(parts, out.freeze()))
    };
    // The connection is driven here rather than spawned, so a deadline or a dropped caller
    // closes the socket with nothing left running.
    tokio::pin!(read);
    tokio::select! {
        r = &mut read => r,
        // The connection ended first (peer closed or broke the protocol): the read side now
        // holds the response or the error that ended it.
        _ = conn => read.await,
    }
}

#[cfg(test)]
mod tests {
    use std::future::Future;
    use std::time::Instant;

    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::TcpListener;
    use tokio::sync::oneshot;

    use super::*;

    /// Generous enough never to fire on a loaded machine when the client behaves.
    const SLOW: Duration = Duration::from_secs(30);

    fn limits(deadline: Duration, max_body: usize) -> Limits {
        Limits { deadline, max_body }
    }

    /// A server for one connection: reads the request (head and `content-length` body), hands
    /// it to the test, then lets `answer` do whatever it likes with the socket.
    async fn one_shot<F, Fut>(answer: F) -> (SocketAddr, oneshot::Receiver<Vec<u8>>)
    where
        F: FnOnce(TcpStream) -> Fut + Send + 'static,
        Fut: Future<Output = ()> + Send,
    {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (tx, rx) = oneshot::channel();
        tokio::spawn(async move {
            let (mut s, _) = listener.accept().await.unwrap();
            let mut req = Vec::new();
            let mut buf = [0u8; 4096];
            let head_end = loop {
                if let Some(i) = req.windows(4).position(|w| w == b"\r\n\r\n") {
                    break i + 4;
                }
                let n = s.read(&mut buf).await.unwrap();
                assert!(n > 0, "client closed before the end of its request head");
                req.extend_from_slice(&buf[..n]);
            };
            let head = String::from_utf8_lossy(&req[..head_end]).to_ascii_lowercase();
            let len = head
                .lines()
                .find_map(|l| l.strip_prefix("content-length:"))
                .map_or(0, |v| v.trim().parse::<usize>().unwrap());
            while req.len() < head_end + len {
                let n = s.read(&mut buf).await.unwrap();
                req.extend_from_slice(&buf[..n]);
            }
            let _ = tx.send(req);
            answer(s).await;
        });
        (addr, rx)
    }

    /// A server that writes `raw` and closes.
    async fn replies(raw: &'static [u8]) -> SocketAddr {
        one_shot(move |mut s| async move {
            let _ = s.write_all(raw).await;
        })
        .await
        .0
    }

    #[tokio::test]
    async fn a_gated_request_is_written_only_while_its_gate_holds() {
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        let server = tokio::spawn(async move {
            let (mut s, _) = l.accept().await.unwrap();
            let mut got = Vec::new();
            let _ = tokio::time::timeout(SLOW, s.read_to_end(&mut got)).await;
            got
        });
        let r = post_json_gated(addr, "/kv_cache_events", "{}", limits(SLOW, 1024), || false).await;
        assert!(matches!(r, Err(HttpError::NotSent)), "{r:?}");
        assert!(
            server.await.unwrap().is_empty(),
            "nothing reached the server"
        );
    }

    #[tokio::test]
    async fn reads_plain_and_chunked_bodies() {
        let r = get(
            replies(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok").await,
            "/",
            limits(SLOW, 1024),
        )
        .await
        .unwrap();
        assert_eq!((r.status().as_u16(), &r.body()[..]), (200, &b"ok"[..]));
        let r = get(
            replies(
                b"HTTP/1.1 201 X\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n",
            )
            .await,
            "/",
            limits(SLOW, 1024),
        )
        .await
        .unwrap();
        assert_eq!((r.status().as_u16(), &r.body()[..]), (201, &b"abcde"[..]));
        // A body delimited by the end of the connection (no length, no chunking) is read whole.
        let r = get(
            replies(b"HTTP/1.1 200 OK\r\n\r\nuntil close").await,
            "/",
            limits(SLOW, 1024),
        )
        .await
        .unwrap();
        assert_eq!(&r.body()[..], b"until close");
    }

    #[tokio::test]
    async fn chunked_body_split_across_writes_with_extensions_and_trailers() {
        let (addr, _) = one_shot(|mut s| async move {
            let parts: [&[u8]; 5] = [
                b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n4;ext=1\r\nvl",
                b"lm\r\n",
                b"1",
                b"\r\n:\r\n0\r\nx-trailer: t\r\n",
                b"\r\n",
            ];
            for p in parts {
                if s.write_all(p).await.is_err() {
                    return;
                }
                let _ = s.flush().await;
                tokio::task::yield_now().await;
            }
        })
        .await;
        let mut seen = Vec::new();
        let req = Request::get("/").body(Bytes::new()).unwrap();
        let r = send_observed(addr, req, limits(SLOW, 1024), |d| seen.extend_from_slice(d))
            .await
            .unwrap();
        assert_eq!(&r.body()[..], b"vllm:");
        assert_eq!(seen, b"vllm:");
    }

    #[tokio::test]
    async fn malformed_responses_are_protocol_errors() {
        for raw in [
            &b"garbage"[..],
            b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\nzz\r\n",
            // Cut short: fewer body bytes than declared before the close.
            b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\nshort",
        ] {
            let got = get(
                one_shot(move |mut s| async move {
                    let _ = s.write_all(raw).await;
                })
                .await
                .0,
                "/",
                limits(SLOW, 1024),
            )
            .await;
            assert!(
                matches!(got, Err(HttpError::Protocol(_))),
                "{:?}: {got:?}",
                String::from_utf8_lossy(raw)
            );
        }
    }

    /// Something that is not HTTP answers and keeps the connection open: refused at once, not at
    /// the deadline.
    #[tokio::test]
    async fn a_non_http_answer_is_refused_without_waiting() {
        let (addr, _) = one_shot(|mut s| async move {
            let _ = s.write_all(b"SSH-2.0-OpenSSH_9.6\r\n").await;
            // Hold the socket until the client gives up on it.
            let _ = s.read(&mut [0u8; 1]).await;
        })
        .await;
        let got = get(addr, "/metrics", limits(SLOW, 1024)).await;
        assert!(matches!(got, Err(HttpError::Protocol(_))), "{got:?}");
    }

    /// A server that sends a byte at a time forever: the deadline ends the request, it does not
    /// hang, and the server sees the connection closed.
    #[tokio::test]
    async fn a_trickling_server_hits_the_deadline() {
        let (closed_tx, closed_rx) = oneshot::channel();
        let (addr, _) = one_shot(|mut s| async move {
            let _ = s
                .write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 1000000\r\n\r\n")
                .await;
            while s.write_all(b"x").await.is_ok() {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            let _ = closed_tx.send(());
        })
        .await;
        let started = Instant::now();
        let got = get(
            addr,
            "/metrics",
            limits(Duration::from_millis(300), 4 << 20),
        )
        .await;
        assert!(matches!(got, Err(HttpError::Timeout)), "{got:?}");
        assert!(started.elapsed() < SLOW, "took {:?}", started.elapsed());
        // Nothing kept the connection alive after the deadline.
        tokio::time::timeout(SLOW, closed_rx)
            .await
            .unwrap()
            .unwrap();
    }

    /// A response that declares a body over the cap is refused before any body byte is read,
    /// even if the server then sends nothing.
    #[tokio::test]
    async fn a_declared_length_over_the_cap_is_refused_up_front() {
        let (addr, _) = one_shot(|mut s| async move {
            let _ = s
                .write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 10485760\r\n\r\n")
                .await;
            let _ = s.read(&mut [0u8; 1]).await;
        })
        .await;
        let got = get(addr, "/metrics", limits(SLOW, 64 << 10)).await;
        assert!(matches!(got, Err(HttpError::TooLarge(65536))), "{got:?}");
    }

    /// An endless chunked body: refused at the cap, and no more than the cap was ever kept.
    #[tokio::test]
    async fn an_endless_chunked_body_is_cut_at_the_cap() {
        let (addr, _) = one_shot(|mut s| async move {
            if s.write_all(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
                .await
                .is_err()
            {
                return;
            }
            let chunk = format!("1000\r\n{}\r\n", "y".repeat(0x1000));
            while s.write_all(chunk.as_bytes()).await.is_ok() {}
        })
        .await;
        let cap = 100_000;
        let mut kept = 0usize;
        let req = Request::get("/").body(Bytes::new()).unwrap();
        let got = send_observed(addr, req, limits(SLOW, cap), |d| kept += d.len()).await;
        assert!(
            matches!(got, Err(HttpError::TooLarge(c)) if c == cap),
            "{got:?}"
        );
        assert!(
            kept <= cap,
            "{kept} bytes handed over past a {cap}-byte cap"
        );
        // The cap refuses on the frame that crosses it, not long after.
        assert!(kept > cap / 2, "only {kept} bytes read before refusing");
    }

    #[tokio::test]
    async fn sends_method_path_host_and_json_body() {
        let (addr, req) = one_shot(|mut s| async move {
            let _ = s
                .write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n[]")
                .await;
        })
        .await;
        let r = post_json(addr, "/kv_cache_events", &b"{}"[..], limits(SLOW, 1024))
            .await
            .unwrap();
        assert_eq!(&r.body()[..], b"[]");
        let req = String::from_utf8(req.await.unwrap()).unwrap();
        let lower = req.to_ascii_lowercase();
        assert!(
            req.starts_with("POST /kv_cache_events HTTP/1.1\r\n"),
            "{req}"
        );
        assert!(lower.contains(&format!("host: {addr}\r\n")), "{req}");
        assert!(
            lower.contains("content-type: application/json\r\n"),
            "{req}"
        );
        assert!(lower.contains("content-length: 2\r\n"), "{req}");
        assert!(req.ends_with("\r\n\r\n{}"), "{req}");
    }

    /// Servers may answer 411 to a POST without a length, so an empty one says 0.
    #[tokio::test]
    async fn an_empty_post_declares_length_zero() {
        let (addr, req) = one_shot(|mut s| async move {
            let _ = s.write_all(b"HTTP/1.1 204 No Content\r\n\r\n").await;
        })
        .await;
        let req_out = Request::post("/admin/restart").body(Bytes::new()).unwrap();
        let r = send(addr, req_out, limits(SLOW, 1024)).await.unwrap();
        assert_eq!(r.status().as_u16(), 204);
        let req = String::from_utf8(req.await.unwrap()).unwrap();
        assert!(
            req.to_ascii_lowercase().contains("content-length: 0\r\n"),
            "{req}"
        );
    }

    #[tokio::test]
    async fn a_closed_port_is_a_connect_error() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        drop(listener);
        let got = get(addr, "/", limits(SLOW, 1024)).await;
        assert!(matches!(got, Err(HttpError::Connect(_))), "{got:?}");
    }
}
