//! Entry points for the fuzz targets in `fuzz/` (cargo-fuzz, `make fuzz`): each takes bytes as
//! an untrusted party sends them (engine, client, pod, API server) and drives the code that reads
//! them, so the targets reach nothing crate-private. Not an API: hidden from the docs, thin calls
//! only. Each returns on any input; a panic is a bug for the fuzzer to report, including the
//! invariants checked here (the two request-body readers agree; the salt rewrite leaves a body
//! that reads the same, with only the resolved salt).

use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::Bytes;
use tokio::io::{AsyncRead, AsyncWrite};

use crate::events::subscriber::{Feed, FeedEndpoints, FeedStatus};
use crate::events::vllm::Dialect;
use crate::events::zmtp::{Connection, Limits, SocketType};
use crate::{discovery, engine_metrics, events, forward, httpc, request};
use kv_epp_core::index::KvIndex;
use kv_epp_core::worker::WorkerId;

/// One msgpack value read as the event decoder reads values (nesting at most 16): its encoded
/// length, or `None` when the reader refuses it. Token-id runs go through the fast path too.
pub fn msgpack_value(bytes: &[u8]) -> Option<usize> {
    let mut ids = Vec::new();
    let _ = events::msgpack::Reader::new(bytes).value_u32s(16, 1 << 20, &mut ids);
    events::msgpack::Reader::new(bytes)
        .value(16)
        .ok()
        .map(<[u8]>::len)
}

/// A feed of a fresh worker (block size 4, no replay socket) in `dialect`.
fn feed(dialect: Dialect) -> Feed {
    let worker = WorkerId::new(([10, 0, 0, 1], 8000).into());
    let index = Arc::new(KvIndex::new(4, Default::default()));
    index.add_worker(worker);
    Feed {
        worker,
        index,
        endpoints: FeedEndpoints {
            events: "tcp://10.0.0.1:5557".into(),
            replay: None,
            topic: String::new(),
            dialect,
        },
        limits: Limits::default(),
        status: Arc::new(FeedStatus::default()),
        apply_lock: Default::default(),
    }
}

/// A ZeroMQ payload frame applied to a fresh worker index in each engine dialect, as a feed
/// applies it (decode, normalize, the index's one writer).
pub fn event_batch(payload: &[u8]) {
    for dialect in [Dialect::Vllm, Dialect::Sglang, Dialect::Trtllm] {
        feed(dialect).apply_payload(payload);
    }
}

/// A TensorRT-LLM drain response, read as the poller reads it (a JSON array of events, each
/// normalized for a block size of 4 as it is read).
pub fn trtllm_drain(body: &[u8]) {
    if let Ok(drain) = events::trtllm::read_drain(4, body) {
        assert!(drain.malformed <= drain.read && drain.events.len() <= drain.read);
    }
}

/// An SGLang `/server_info` body, read for rank 0 and rank 3 of a worker.
pub fn server_info(body: &[u8]) {
    if let Ok(adv) = events::server_info::parse(body) {
        let fallback = FeedEndpoints {
            events: String::new(),
            replay: None,
            topic: String::new(),
            dialect: Dialect::Sglang,
        };
        for rank in [0, 3] {
            let worker = WorkerId::with_rank(([10, 0, 0, 1], 8000).into(), rank);
            let _ = adv.endpoints(&worker, &fallback);
        }
    }
}

/// An engine's `/metrics` page, read as the scrape reads it (lossy UTF-8).
pub fn engine_metrics(page: &[u8]) {
    if let Some(load) = engine_metrics::parse(&String::from_utf8_lossy(page)) {
        assert!(
            load.running.is_finite() && load.waiting.is_finite() && load.kv_usage.is_finite(),
            "engine load must be finite: {load:?}"
        );
    }
}

/// JSON from the Kubernetes API server, read by each of discovery's readers.
pub fn kube_object(body: &[u8]) {
    discovery::read_untrusted(body);
}

/// A request body as routing reads it: the streamed reading must answer what reading it into a
/// `serde_json::Value` answers, and the salt rewrite of an accepted body (with and without a
/// resolved salt) must leave a body that reads the same but for its salt fields.
pub fn request_body(body: &[u8]) {
    let streamed = request::streamed(body);
    assert_eq!(
        streamed,
        request::reference(body),
        "the body readers disagree on {:?}",
        String::from_utf8_lossy(body)
    );
    let Ok(parsed) = request::parse(body) else {
        return;
    };
    let original: serde_json::Value =
        serde_json::from_slice(body).expect("an accepted body is JSON");
    for salt in [None, Some("kvepp:fuzz")] {
        let out = forward::rewrite_salt(body, salt);
        if salt.is_none() && !parsed.has_salt_member() {
            assert_eq!(out, None, "a body without a salt is forwarded unchanged");
            continue;
        }
        let out = out.expect("a body with a salt to set or remove is rewritten");
        let mut want = original.clone();
        let top = want.as_object_mut().expect("an accepted body is an object");
        top.remove("cache_salt");
        if let Some(serde_json::Value::Object(nvext)) = top.get_mut("nvext") {
            nvext.remove("cache_salt");
        }
        if let Some(s) = salt {
            top.insert("cache_salt".into(), s.into());
        }
        let got: serde_json::Value = serde_json::from_slice(&out).unwrap_or_else(|e| {
            panic!(
                "the rewritten body is not JSON ({e}): {:?}",
                String::from_utf8_lossy(&out)
            )
        });
        assert_eq!(got, want, "the rewrite changed more than the salt fields");
    }
}

/// An in-memory connection to a peer that answers once spoken to: reads are pending until the
/// first write, then return `input` and its end; writes are discarded. (A stream whose bytes are
/// ready before the request is written is read by hyper as an unsolicited message and dropped,
/// which no TCP peer's answer can be.)
struct Answering {
    input: std::io::Cursor<Vec<u8>>,
    spoken: bool,
    reader: Option<std::task::Waker>,
}

fn memory_stream(input: &[u8]) -> Answering {
    Answering {
        input: std::io::Cursor::new(input.to_vec()),
        spoken: false,
        reader: None,
    }
}

impl AsyncRead for Answering {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        if !self.spoken {
            self.reader = Some(cx.waker().clone());
            return Poll::Pending;
        }
        Pin::new(&mut self.input).poll_read(cx, buf)
    }
}

impl AsyncWrite for Answering {
    fn poll_write(
        mut self: Pin<&mut Self>,
        _: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        self.spoken = true;
        if let Some(w) = self.reader.take() {
            w.wake();
        }
        Poll::Ready(Ok(buf.len()))
    }

    fn poll_flush(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Poll::Ready(Ok(()))
    }

    fn poll_shutdown(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Poll::Ready(Ok(()))
    }
}

/// Runs `f` to completion on this thread's current-thread runtime (built once per thread), so
/// the targets of the async readers are as plain as the others.
fn block_on<F: std::future::Future>(f: F) -> F::Output {
    thread_local! {
        static RT: tokio::runtime::Runtime = tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .build()
            .expect("a current-thread runtime");
    }
    RT.with(|rt| rt.block_on(f))
}

/// An engine's HTTP/1.1 response to a request of the project's client, read with a 1 KiB body
/// cap (the first input byte says whether the gate holds).
pub fn http_response(input: &[u8]) {
    block_on(http_exchange(input));
}

async fn http_exchange(input: &[u8]) {
    let req = httpc::Request::post("/kv_cache_events")
        .body(Bytes::from_static(b"{}"))
        .expect("a static request is valid");
    let mut seen = 0usize;
    let r = httpc::exchange_over(
        memory_stream(input),
        req,
        1024,
        |d| seen += d.len(),
        || !input.starts_with(b"\0"),
    )
    .await;
    if let Ok(r) = r {
        assert!(r.body().len() <= 1024 && seen <= 1024, "the body cap held");
    }
}

/// What a ZeroMQ peer sends: the greeting and handshake, then messages until the input ends, as
/// a SUB (or, when the first byte is odd, a DEALER) with small limits; when the first byte's
/// second bit is set, a valid PUB/ROUTER greeting and READY are sent first, so the fuzzer starts
/// at the frames. Each message goes to a vLLM feed as published `[topic, seq, payload]` (sequence
/// rule, replay attempts without a replay socket, apply).
pub fn zmtp_peer(input: &[u8]) {
    block_on(zmtp_exchange(input));
}

async fn zmtp_exchange(input: &[u8]) {
    let Some((&mode, rest)) = input.split_first() else {
        return;
    };
    let socket = if mode & 1 == 0 {
        SocketType::Sub
    } else {
        SocketType::Dealer
    };
    let mut bytes = Vec::with_capacity(rest.len() + 96);
    if mode & 2 != 0 {
        let peer: &[u8] = if socket == SocketType::Sub {
            b"PUB"
        } else {
            b"ROUTER"
        };
        bytes.extend_from_slice(&events::zmtp::greeting());
        let ready = events::zmtp::ready_body(peer);
        bytes.extend_from_slice(&[0x04, ready.len() as u8]);
        bytes.extend_from_slice(&ready);
    }
    bytes.extend_from_slice(rest);
    let limits = Limits {
        max_message_bytes: 64 << 10,
        max_frames: 8,
        ..Limits::default()
    };
    let Ok(mut conn) = Connection::handshake(memory_stream(&bytes), socket, limits).await else {
        return;
    };
    let (feed, mut cursor) = (feed(Dialect::Vllm), Default::default());
    while let Ok(frames) = conn.recv().await {
        assert!(frames.len() <= limits.max_frames, "the frame limit held");
        let total: usize = frames.iter().map(Bytes::len).sum();
        assert!(total <= limits.max_message_bytes, "the size limit held");
        feed.on_message(&frames, &mut cursor).await;
    }
}
