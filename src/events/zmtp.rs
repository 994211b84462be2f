//! The ZeroMQ client side kv-epp needs, written for peers it does not trust: a SUB socket on an
//! engine's event publisher and a DEALER on its replay socket, over TCP, ZMTP 3.0 with the NULL
//! mechanism (what vLLM's and SGLang's pyzmq/libzmq sockets speak by default).
//!
//! Why our own: every byte here comes from a pod the pool's selector matched. The general-purpose
//! codec we used before reserved whatever a frame header claimed, so nine bytes claiming 2^40
//! aborted the process. Here every length is checked against [`Limits`] *before* anything is
//! allocated, a frame body grows only as its bytes arrive (past a first 64 KiB reserved at
//! once, so a typical batch is read without reallocating), the frames of one message are
//! counted, a started message must finish within [`Limits::message_timeout`], and the greeting
//! and handshake within [`Limits::handshake_timeout`]. A violation ends the connection with a
//! [`ZmtpError`] whose [`ZmtpError::reason`] is the counter label; the caller reconnects with
//! backoff. Idle connections are watched by TCP keepalive (an idle engine publishes nothing).
//!
//! Wire form (ZMTP 3.0, rfc.zeromq.org/spec/23): a 64-byte greeting each way, then each side
//! sends a `READY` command with its `Socket-Type`, then frames `flags, size (1 or 8 bytes BE),
//! body`, where flags bit 0 = more frames follow, bit 1 = 8-byte size, bit 2 = command. A SUB
//! subscribes with a message `0x01 ++ topic` (the 3.0 form, which libzmq and other ZMTP
//! implementations accept from a peer that greets as 3.0). A `PING` command (ZMTP 3.1 heartbeat)
//! is answered with `PONG`; other commands after the handshake are ignored.

use std::io;
use std::time::Duration;

use bytes::Bytes;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, BufReader};
use tokio::net::TcpStream;

/// Flag: more frames of this message follow.
const MORE: u8 = 0x01;
/// Flag: the size is 8 bytes.
const LONG: u8 = 0x02;
/// Flag: a command frame.
const COMMAND: u8 = 0x04;
/// Most bytes of a frame body reserved before they arrive (the rest grows as they do).
const BODY_RESERVE: u64 = 64 << 10;
/// Largest command kv-epp reads (READY metadata, PING, ERROR); real ones are tens of bytes.
const MAX_COMMAND_BYTES: u64 = 4096;

/// What one connection may cost.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Limits {
    /// Largest message (all frames together) accepted; a longer claim ends the connection
    /// before anything is allocated for it.
    pub max_message_bytes: usize,
    /// Most frames in one message.
    pub max_frames: usize,
    /// Time for the connect, greeting and handshake.
    pub handshake_timeout: Duration,
    /// Time for a message to arrive whole once its first byte has.
    pub message_timeout: Duration,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_message_bytes: 8 << 20,
            max_frames: 16,
            handshake_timeout: Duration::from_secs(5),
            message_timeout: Duration::from_secs(30),
        }
    }
}

/// The socket types kv-epp opens.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SocketType {
    /// Subscribes to a publisher.
    Sub,
    /// Asks a ROUTER (the engine's replay socket).
    Dealer,
}

impl SocketType {
    fn name(self) -> &'static [u8] {
        match self {
            SocketType::Sub => b"SUB",
            SocketType::Dealer => b"DEALER",
        }
    }

    /// The peer socket types this one may talk to (ZMTP 3.0's compatibility table).
    fn accepts(self, peer: &[u8]) -> bool {
        match self {
            SocketType::Sub => peer == b"PUB" || peer == b"XPUB",
            SocketType::Dealer => peer == b"ROUTER" || peer == b"DEALER" || peer == b"REP",
        }
    }
}

/// Why a connection ended (or never started).
#[derive(Debug, thiserror::Error)]
pub enum ZmtpError {
    /// Not a `tcp://host:port` endpoint.
    #[error("unsupported endpoint {0:?} (want tcp://host:port)")]
    Endpoint(String),
    /// The TCP connect failed.
    #[error("connect: {0}")]
    Connect(io::Error),
    /// The connect, greeting or handshake took too long.
    #[error("handshake timed out")]
    HandshakeTimeout,
    /// The peer's greeting is not a ZMTP 3 NULL greeting.
    #[error("bad greeting: {0}")]
    Greeting(&'static str),
    /// The peer's handshake is not a compatible READY (or it sent ERROR).
    #[error("handshake: {0}")]
    Handshake(String),
    /// A frame or message longer than the limit was announced.
    #[error("message of at least {claimed} bytes exceeds the limit of {limit}")]
    Oversize {
        /// Bytes claimed so far (this frame's size plus the message's earlier frames).
        claimed: u64,
        /// [`Limits::max_message_bytes`] (or the command limit).
        limit: u64,
    },
    /// A message with more frames than the limit.
    #[error("message of more than {0} frames")]
    TooManyFrames(usize),
    /// A frame with reserved flag bits set.
    #[error("bad frame flags {0:#04x}")]
    BadFlags(u8),
    /// A started message did not finish in time.
    #[error("message not completed within {0:?}")]
    MessageTimeout(Duration),
    /// The peer closed the connection.
    #[error("connection closed by peer")]
    Closed,
    /// Reading or writing failed.
    #[error("{0}")]
    Io(io::Error),
}

impl ZmtpError {
    /// The counter label of this error.
    pub fn reason(&self) -> &'static str {
        match self {
            ZmtpError::Endpoint(_) => "endpoint",
            ZmtpError::Connect(_) => "connect",
            ZmtpError::HandshakeTimeout => "handshake_timeout",
            ZmtpError::Greeting(_) => "greeting",
            ZmtpError::Handshake(_) => "handshake",
            ZmtpError::Oversize { .. } => "oversize",
            ZmtpError::TooManyFrames(_) => "too_many_frames",
            ZmtpError::BadFlags(_) => "bad_frame",
            ZmtpError::MessageTimeout(_) => "message_timeout",
            ZmtpError::Closed => "closed",
            ZmtpError::Io(_) => "io",
        }
    }

    /// Every label [`ZmtpError::reason`] can return.
    pub const REASONS: [&'static str; 11] = [
        "endpoint",
        "connect",
        "handshake_timeout",
        "greeting",
        "handshake",
        "oversize",
        "too_many_frames",
        "bad_frame",
        "message_timeout",
        "closed",
        "io",
    ];
}

fn io_err(e: io::Error) -> ZmtpError {
    if e.kind() == io::ErrorKind::UnexpectedEof {
        ZmtpError::Closed
    } else {
        ZmtpError::Io(e)
    }
}

/// An established connection.
pub struct Connection<S = TcpStream> {
    stream: BufReader<S>,
    limits: Limits,
}

/// `tcp://host:port` → `host:port` (an IPv6 host in brackets).
fn tcp_address(endpoint: &str) -> Result<&str, ZmtpError> {
    match endpoint.strip_prefix("tcp://") {
        Some(addr)
            if addr
                .rsplit_once(':')
                .is_some_and(|(h, p)| !h.is_empty() && p.parse::<u16>().is_ok()) =>
        {
            Ok(addr)
        }
        _ => Err(ZmtpError::Endpoint(endpoint.to_owned())),
    }
}

/// Connects to `endpoint` and completes the handshake as `socket`, all within the handshake
/// timeout.
pub async fn connect(
    endpoint: &str,
    socket: SocketType,
    limits: Limits,
) -> Result<Connection, ZmtpError> {
    let addr = tcp_address(endpoint)?;
    tokio::time::timeout(limits.handshake_timeout, async {
        let stream = TcpStream::connect(addr).await.map_err(ZmtpError::Connect)?;
        let _ = stream.set_nodelay(true);
        // An idle publisher is normal; a vanished one is found by keepalive probes.
        let keepalive = socket2::TcpKeepalive::new()
            .with_time(Duration::from_secs(30))
            .with_interval(Duration::from_secs(10));
        let _ = socket2::SockRef::from(&stream).set_tcp_keepalive(&keepalive);
        Connection::handshake(stream, socket, limits).await
    })
    .await
    .map_err(|_| ZmtpError::HandshakeTimeout)?
}

/// Our greeting: signature, version 3.0, mechanism NULL, not a server.
pub(crate) fn greeting() -> [u8; 64] {
    let mut g = [0u8; 64];
    g[0] = 0xFF;
    g[8] = 0x01;
    g[9] = 0x7F;
    g[10] = 3;
    g[11] = 0;
    g[12..16].copy_from_slice(b"NULL");
    g
}

/// Checks a peer's greeting.
fn check_greeting(g: &[u8; 64]) -> Result<(), ZmtpError> {
    if g[0] != 0xFF || g[9] & 0x01 != 0x01 {
        return Err(ZmtpError::Greeting("not a ZMTP signature"));
    }
    if g[10] < 3 {
        return Err(ZmtpError::Greeting("ZMTP version below 3.0"));
    }
    let mechanism = &g[12..32];
    if !(mechanism.starts_with(b"NULL") && mechanism[4..].iter().all(|&b| b == 0)) {
        return Err(ZmtpError::Greeting("security mechanism is not NULL"));
    }
    Ok(())
}

/// A READY command body with the socket type.
fn ready(socket: SocketType) -> Vec<u8> {
    ready_body(socket.name())
}

/// A READY command body naming socket type `name`.
pub(crate) fn ready_body(name: &[u8]) -> Vec<u8> {
    let mut body = Vec::with_capacity(32);
    body.push(5);
    body.extend_from_slice(b"READY");
    body.push(11);
    body.extend_from_slice(b"Socket-Type");
    body.extend_from_slice(&(name.len() as u32).to_be_bytes());
    body.extend_from_slice(name);
    body
}

/// Splits a command body into its name and data.
fn command(body: &[u8]) -> Result<(&[u8], &[u8]), ZmtpError> {
    let (&len, rest) = body
        .split_first()
        .ok_or_else(|| ZmtpError::Handshake("empty command".into()))?;
    let len = usize::from(len);
    if rest.len() < len {
        return Err(ZmtpError::Handshake("truncated command name".into()));
    }
    Ok(rest.split_at(len))
}

/// The `Socket-Type` property of READY metadata.
fn socket_type(mut props: &[u8]) -> Result<Option<&[u8]>, ZmtpError> {
    let bad = || ZmtpError::Handshake("malformed READY metadata".into());
    let mut found = None;
    while let Some((&nlen, rest)) = props.split_first() {
        let nlen = usize::from(nlen);
        let (name, rest) = (rest.get(..nlen).ok_or_else(bad)?, &rest[nlen..]);
        let vlen = rest
            .get(..4)
            .map(|b| u32::from_be_bytes([b[0], b[1], b[2], b[3]]) as usize)
            .ok_or_else(bad)?;
        let rest = &rest[4..];
        let value = rest.get(..vlen).ok_or_else(bad)?;
        if name.eq_ignore_ascii_case(b"Socket-Type") {
            found = Some(value);
        }
        props = &rest[vlen..];
    }
    Ok(found)
}

impl<S: AsyncRead + AsyncWrite + Unpin> Connection<S> {
    /// Exchanges greetings and READY commands on an open stream (no timeout of its own).
    pub async fn handshake(
        stream: S,
        socket: SocketType,
        limits: Limits,
    ) -> Result<Self, ZmtpError> {
        let mut conn = Connection {
            stream: BufReader::new(stream),
            limits,
        };
        conn.stream.write_all(&greeting()).await.map_err(io_err)?;
        conn.write_frame(COMMAND, &ready(socket)).await?;
        conn.stream.flush().await.map_err(io_err)?;
        let mut peer = [0u8; 64];
        conn.stream.read_exact(&mut peer).await.map_err(io_err)?;
        check_greeting(&peer)?;
        let (flags, size) = conn.frame_header().await?;
        if flags & COMMAND == 0 {
            return Err(ZmtpError::Handshake("expected READY, got a message".into()));
        }
        let body = conn.read_body(size, MAX_COMMAND_BYTES).await?;
        let (name, data) = command(&body)?;
        match name {
            b"READY" => {
                let peer_type = socket_type(data)?
                    .ok_or_else(|| ZmtpError::Handshake("READY without Socket-Type".into()))?;
                if !socket.accepts(peer_type) {
                    return Err(ZmtpError::Handshake(format!(
                        "peer is a {} socket, not one a {} can talk to",
                        String::from_utf8_lossy(peer_type),
                        String::from_utf8_lossy(socket.name())
                    )));
                }
                Ok(conn)
            }
            b"ERROR" => {
                let reason = data
                    .split_first()
                    .map(|(&n, r)| {
                        String::from_utf8_lossy(&r[..r.len().min(usize::from(n))]).into_owned()
                    })
                    .unwrap_or_default();
                Err(ZmtpError::Handshake(format!("peer refused: {reason}")))
            }
            other => Err(ZmtpError::Handshake(format!(
                "expected READY, got {:?}",
                String::from_utf8_lossy(other)
            ))),
        }
    }

    /// Subscribes a SUB to messages whose first frame starts with `topic` ("" = all).
    pub async fn subscribe(&mut self, topic: &[u8]) -> Result<(), ZmtpError> {
        let mut body = Vec::with_capacity(1 + topic.len());
        body.push(0x01);
        body.extend_from_slice(topic);
        self.send(&[&body]).await
    }

    /// Sends one message.
    pub async fn send(&mut self, frames: &[&[u8]]) -> Result<(), ZmtpError> {
        for (i, f) in frames.iter().enumerate() {
            let more = if i + 1 < frames.len() { MORE } else { 0 };
            self.write_frame(more, f).await?;
        }
        self.stream.flush().await.map_err(io_err)
    }

    async fn write_frame(&mut self, flags: u8, body: &[u8]) -> Result<(), ZmtpError> {
        let s = &mut self.stream;
        if let Ok(short) = u8::try_from(body.len()) {
            s.write_all(&[flags, short]).await.map_err(io_err)?;
        } else {
            s.write_all(&[flags | LONG]).await.map_err(io_err)?;
            s.write_all(&(body.len() as u64).to_be_bytes())
                .await
                .map_err(io_err)?;
        }
        s.write_all(body).await.map_err(io_err)
    }

    /// Reads a frame's flags and size.
    async fn frame_header(&mut self) -> Result<(u8, u64), ZmtpError> {
        let flags = self.stream.read_u8().await.map_err(io_err)?;
        self.frame_size(flags).await.map(|size| (flags, size))
    }

    /// Reads the size that follows `flags`.
    async fn frame_size(&mut self, flags: u8) -> Result<u64, ZmtpError> {
        if flags & !(MORE | LONG | COMMAND) != 0 {
            return Err(ZmtpError::BadFlags(flags));
        }
        if flags & LONG != 0 {
            self.stream.read_u64().await.map_err(io_err)
        } else {
            self.stream.read_u8().await.map(u64::from).map_err(io_err)
        }
    }

    /// Reads a body of `size` bytes after checking it against `limit`; past the first
    /// [`BODY_RESERVE`] bytes the buffer grows with what actually arrives, never with what was
    /// claimed.
    async fn read_body(&mut self, size: u64, limit: u64) -> Result<Vec<u8>, ZmtpError> {
        if size > limit {
            return Err(ZmtpError::Oversize {
                claimed: size,
                limit,
            });
        }
        // Up to BODY_RESERVE at once: a typical batch then arrives without the reallocations
        // (and copies) of growing from empty, which cost ~20% of the feed's instructions.
        let mut body = Vec::with_capacity(size.min(BODY_RESERVE) as usize);
        let got = (&mut self.stream)
            .take(size)
            .read_to_end(&mut body)
            .await
            .map_err(io_err)?;
        if got as u64 != size {
            return Err(ZmtpError::Closed);
        }
        Ok(body)
    }

    /// Receives the next message. Waits as long as the peer is idle; once a message has begun
    /// it must arrive whole within [`Limits::message_timeout`].
    pub async fn recv(&mut self) -> Result<Vec<Bytes>, ZmtpError> {
        loop {
            let first = self.next_flags().await?;
            if let Some(frames) = self.finish(first).await? {
                return Ok(frames);
            }
        }
    }

    /// The first byte of the next message or command; waits as long as the peer is idle.
    /// Cancel safe (a caller may race it against a timer): a one-byte read consumes nothing
    /// unless it completes. Pass the byte to [`Connection::finish`].
    pub async fn next_flags(&mut self) -> Result<u8, ZmtpError> {
        self.stream.read_u8().await.map_err(io_err)
    }

    /// The rest of the message or command whose first byte [`Connection::next_flags`] returned,
    /// whole within [`Limits::message_timeout`]; `None` for a command (answered). Not cancel
    /// safe: once begun, await it to the end.
    pub async fn finish(&mut self, first: u8) -> Result<Option<Vec<Bytes>>, ZmtpError> {
        let timeout = self.limits.message_timeout;
        tokio::time::timeout(timeout, self.rest_of_message(first))
            .await
            .map_err(|_| ZmtpError::MessageTimeout(timeout))?
    }

    /// Reads the message whose first flags byte was `flags`; `None` for a command (handled).
    async fn rest_of_message(&mut self, mut flags: u8) -> Result<Option<Vec<Bytes>>, ZmtpError> {
        if flags & COMMAND != 0 {
            let size = self.frame_size(flags).await?;
            let body = self.read_body(size, MAX_COMMAND_BYTES).await?;
            self.on_command(&body).await?;
            return Ok(None);
        }
        let limit = self.limits.max_message_bytes as u64;
        let mut frames = Vec::new();
        let mut total = 0u64;
        loop {
            if frames.len() == self.limits.max_frames {
                return Err(ZmtpError::TooManyFrames(self.limits.max_frames));
            }
            if flags & COMMAND != 0 {
                return Err(ZmtpError::Handshake("command inside a message".into()));
            }
            let size = self.frame_size(flags).await?;
            let claimed = total.saturating_add(size);
            if claimed > limit {
                return Err(ZmtpError::Oversize { claimed, limit });
            }
            frames.push(Bytes::from(self.read_body(size, limit).await?));
            total = claimed;
            if flags & MORE == 0 {
                return Ok(Some(frames));
            }
            flags = self.stream.read_u8().await.map_err(io_err)?;
        }
    }

    /// Answers a PING; ignores other commands.
    async fn on_command(&mut self, body: &[u8]) -> Result<(), ZmtpError> {
        let (name, data) = command(body)?;
        if name == b"PING" {
            // PING = ttl (2 bytes) + context (up to 16 bytes), echoed in PONG.
            let context = data.get(2..).unwrap_or_default();
            let context = &context[..context.len().min(16)];
            let mut pong = Vec::with_capacity(5 + context.len());
            pong.push(4);
            pong.extend_from_slice(b"PONG");
            pong.extend_from_slice(context);
            self.write_frame(COMMAND, &pong).await?;
            self.stream.flush().await.map_err(io_err)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{DuplexStream, duplex};

    /// A peer's side of the handshake: greeting plus READY as `peer_type`.
    fn peer_hello(peer_type: &[u8]) -> Vec<u8> {
        let mut out = greeting().to_vec();
        let mut body = vec![5];
        body.extend_from_slice(b"READY");
        body.push(11);
        body.extend_from_slice(b"Socket-Type");
        body.extend_from_slice(&(peer_type.len() as u32).to_be_bytes());
        body.extend_from_slice(peer_type);
        out.extend_from_slice(&[COMMAND, body.len() as u8]);
        out.extend_from_slice(&body);
        out
    }

    async fn pair(
        peer_type: &[u8],
        limits: Limits,
    ) -> (Result<Connection<DuplexStream>, ZmtpError>, DuplexStream) {
        let (ours, mut theirs) = duplex(1 << 16);
        theirs.write_all(&peer_hello(peer_type)).await.unwrap();
        (
            Connection::handshake(ours, SocketType::Sub, limits).await,
            theirs,
        )
    }

    fn limits() -> Limits {
        Limits {
            max_message_bytes: 1024,
            max_frames: 4,
            handshake_timeout: Duration::from_secs(30),
            message_timeout: Duration::from_secs(30),
        }
    }

    #[tokio::test]
    async fn a_sub_reads_multipart_messages_and_answers_ping() {
        let (conn, mut peer) = pair(b"PUB", limits()).await;
        let mut conn = conn.unwrap();
        conn.subscribe(b"kv").await.unwrap();
        // Ours: greeting, READY, then the subscription.
        let mut hello = vec![0u8; 64 + 2 + ready(SocketType::Sub).len()];
        peer.read_exact(&mut hello).await.unwrap();
        assert_eq!(&hello[64 + 2..], &ready(SocketType::Sub)[..]);
        let mut sub = [0u8; 5];
        peer.read_exact(&mut sub).await.unwrap();
        assert_eq!(sub, [0, 3, 1, b'k', b'v']);
        // A PING, then a three-frame message with one long frame.
        peer.write_all(&[COMMAND, 8, 4, b'P', b'I', b'N', b'G', 0, 10, b'c'])
            .await
            .unwrap();
        let mut msg = vec![MORE, 2, b'k', b'v', MORE | LONG];
        msg.extend_from_slice(&8u64.to_be_bytes());
        msg.extend_from_slice(&7u64.to_be_bytes());
        msg.extend_from_slice(&[0, 3, b'a', b'b', b'c']);
        peer.write_all(&msg).await.unwrap();
        let frames = conn.recv().await.unwrap();
        assert_eq!(
            frames,
            vec![
                Bytes::from_static(b"kv"),
                Bytes::copy_from_slice(&7u64.to_be_bytes()),
                Bytes::from_static(b"abc")
            ]
        );
        let mut pong = [0u8; 8];
        peer.read_exact(&mut pong).await.unwrap();
        assert_eq!(pong, [COMMAND, 6, 4, b'P', b'O', b'N', b'G', b'c']);
    }

    #[tokio::test]
    async fn huge_length_claims_are_refused_before_allocation() {
        for claim in [1u64 << 40, 1 << 62, u64::MAX, 1025] {
            let (conn, mut peer) = pair(b"PUB", limits()).await;
            let mut conn = conn.unwrap();
            let mut frame = vec![LONG];
            frame.extend_from_slice(&claim.to_be_bytes());
            peer.write_all(&frame).await.unwrap();
            let err = conn.recv().await.unwrap_err();
            assert_eq!(err.reason(), "oversize", "claim {claim}: {err}");
        }
    }

    #[tokio::test]
    async fn the_limit_counts_all_frames_of_a_message() {
        let (conn, mut peer) = pair(b"PUB", limits()).await;
        let mut conn = conn.unwrap();
        let mut msg = vec![MORE | LONG];
        msg.extend_from_slice(&600u64.to_be_bytes());
        msg.extend(std::iter::repeat_n(0u8, 600));
        msg.push(LONG);
        msg.extend_from_slice(&600u64.to_be_bytes());
        peer.write_all(&msg).await.unwrap();
        assert!(matches!(
            conn.recv().await,
            Err(ZmtpError::Oversize {
                claimed: 1200,
                limit: 1024
            })
        ));
    }

    #[tokio::test]
    async fn endless_multipart_messages_end_at_the_frame_limit() {
        let (conn, mut peer) = pair(b"PUB", limits()).await;
        let mut conn = conn.unwrap();
        peer.write_all(&[MORE, 0].repeat(100)).await.unwrap();
        assert_eq!(conn.recv().await.unwrap_err().reason(), "too_many_frames");
    }

    #[tokio::test]
    async fn a_claim_larger_than_what_is_sent_times_out_or_closes() {
        let mut l = limits();
        l.message_timeout = Duration::from_millis(50);
        let (conn, mut peer) = pair(b"PUB", l).await;
        let mut conn = conn.unwrap();
        peer.write_all(&[0, 200, 1, 2, 3]).await.unwrap();
        assert_eq!(conn.recv().await.unwrap_err().reason(), "message_timeout");
        let (conn, mut peer) = pair(b"PUB", limits()).await;
        let mut conn = conn.unwrap();
        peer.write_all(&[0, 200, 1, 2, 3]).await.unwrap();
        drop(peer);
        assert_eq!(conn.recv().await.unwrap_err().reason(), "closed");
    }

    #[tokio::test]
    async fn bad_greetings_and_handshakes_are_refused() {
        // Garbage instead of a greeting.
        let (ours, mut theirs) = duplex(1 << 16);
        theirs.write_all(&[b'G'; 64]).await.unwrap();
        let err = Connection::handshake(ours, SocketType::Sub, limits())
            .await
            .err()
            .unwrap();
        assert_eq!(err.reason(), "greeting");
        // ZMTP 2 and a CURVE mechanism.
        for (at, byte) in [(10, 1u8), (12, b'C')] {
            let (ours, mut theirs) = duplex(1 << 16);
            let mut g = greeting();
            g[at] = byte;
            theirs.write_all(&g).await.unwrap();
            let err = Connection::handshake(ours, SocketType::Sub, limits())
                .await
                .err()
                .unwrap();
            assert_eq!(err.reason(), "greeting", "{err}");
        }
        // A ROUTER where a PUB was expected.
        let (conn, _peer) = pair(b"ROUTER", limits()).await;
        assert_eq!(conn.err().unwrap().reason(), "handshake");
        // A READY claiming a huge body.
        let (ours, mut theirs) = duplex(1 << 16);
        let mut hello = greeting().to_vec();
        hello.push(COMMAND | LONG);
        hello.extend_from_slice(&(1u64 << 40).to_be_bytes());
        theirs.write_all(&hello).await.unwrap();
        let err = Connection::handshake(ours, SocketType::Sub, limits())
            .await
            .err()
            .unwrap();
        assert_eq!(err.reason(), "oversize");
        // Reserved flag bits.
        let (conn, mut peer) = pair(b"PUB", limits()).await;
        let mut conn = conn.unwrap();
        peer.write_all(&[0x80, 0]).await.unwrap();
        assert_eq!(conn.recv().await.unwrap_err().reason(), "bad_frame");
    }

    #[test]
    fn endpoints_must_be_tcp_host_port() {
        assert_eq!(tcp_address("tcp://10.0.0.1:5557").unwrap(), "10.0.0.1:5557");
        assert_eq!(tcp_address("tcp://[::1]:5557").unwrap(), "[::1]:5557");
        assert_eq!(
            tcp_address("tcp://engine.ns.svc:5557").unwrap(),
            "engine.ns.svc:5557"
        );
        for bad in [
            "ipc:///tmp/x",
            "tcp://:5557",
            "tcp://host",
            "tcp://host:99999",
            "10.0.0.1:1",
        ] {
            assert_eq!(tcp_address(bad).unwrap_err().reason(), "endpoint", "{bad}");
        }
        let all: std::collections::HashSet<_> = ZmtpError::REASONS.into_iter().collect();
        assert_eq!(all.len(), ZmtpError::REASONS.len());
    }
}
