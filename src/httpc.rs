//! A minimal HTTP/1.1 client for talking to engines on the cluster network (metrics scrapes,
//! TensorRT-LLM event drains): one request per connection, a deadline, and a cap on the response
//! size, so a slow or hostile engine can cost neither time nor memory without bound.

use std::net::SocketAddr;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// A response: status and (de-chunked) body.
#[derive(Debug)]
pub struct HttpResponse {
    /// Status code.
    pub status: u16,
    /// Body bytes.
    pub body: Vec<u8>,
}

/// Why a request failed.
#[derive(Debug, thiserror::Error)]
pub enum HttpError {
    /// Connecting, writing or reading failed.
    #[error("{0}")]
    Io(#[from] std::io::Error),
    /// The deadline passed.
    #[error("timed out")]
    Timeout,
    /// The response exceeded the size cap.
    #[error("response larger than {0} bytes")]
    TooLarge(usize),
    /// The response is not HTTP/1.x.
    #[error("malformed response")]
    Malformed,
}

/// Sends one request and reads the whole response.
pub async fn request(
    addr: SocketAddr,
    method: &str,
    path: &str,
    body: &[u8],
    timeout: Duration,
    max_bytes: usize,
) -> Result<HttpResponse, HttpError> {
    tokio::time::timeout(timeout, async {
        let mut s = TcpStream::connect(addr).await?;
        let head = format!(
            "{method} {path} HTTP/1.1\r\nhost: {addr}\r\nconnection: close\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n",
            body.len()
        );
        s.write_all(head.as_bytes()).await?;
        s.write_all(body).await?;
        let mut raw = Vec::new();
        let mut buf = [0u8; 16 * 1024];
        loop {
            let n = s.read(&mut buf).await?;
            if n == 0 {
                break;
            }
            if raw.len() + n > max_bytes {
                return Err(HttpError::TooLarge(max_bytes));
            }
            raw.extend_from_slice(&buf[..n]);
        }
        parse(&raw)
    })
    .await
    .map_err(|_| HttpError::Timeout)?
}

/// Parses a whole HTTP/1.x response (status line, headers, body; chunked bodies de-chunked).
pub fn parse(raw: &[u8]) -> Result<HttpResponse, HttpError> {
    let split = raw
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .ok_or(HttpError::Malformed)?;
    let head = std::str::from_utf8(&raw[..split]).map_err(|_| HttpError::Malformed)?;
    let mut lines = head.split("\r\n");
    let status = lines
        .next()
        .filter(|l| l.starts_with("HTTP/1."))
        .and_then(|l| l.split(' ').nth(1))
        .and_then(|s| s.parse().ok())
        .ok_or(HttpError::Malformed)?;
    let chunked = lines.any(|l| {
        l.split_once(':').is_some_and(|(k, v)| {
            k.trim().eq_ignore_ascii_case("transfer-encoding") && v.contains("chunked")
        })
    });
    let mut body = raw[split + 4..].to_vec();
    if chunked {
        body = dechunk(&body).ok_or(HttpError::Malformed)?;
    }
    Ok(HttpResponse { status, body })
}

fn dechunk(mut b: &[u8]) -> Option<Vec<u8>> {
    let mut out = Vec::new();
    loop {
        let eol = b.windows(2).position(|w| w == b"\r\n")?;
        let size_hex = std::str::from_utf8(&b[..eol]).ok()?;
        let size = usize::from_str_radix(size_hex.split(';').next()?.trim(), 16).ok()?;
        b = &b[eol + 2..];
        if size == 0 {
            return Some(out);
        }
        out.extend_from_slice(b.get(..size)?);
        b = b.get(size + 2..)?;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_plain_and_chunked() {
        let r = parse(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok").unwrap();
        assert_eq!((r.status, r.body.as_slice()), (200, &b"ok"[..]));
        let r = parse(
            b"HTTP/1.1 201 X\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n",
        )
        .unwrap();
        assert_eq!((r.status, r.body.as_slice()), (201, &b"abcde"[..]));
        assert!(parse(b"garbage").is_err());
        assert!(parse(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\nzz\r\n").is_err());
    }
}
