//! The simulated engine's KV event publisher over real ZeroMQ (ZMTP 3, interoperable with libzmq
//! and pyzmq): a PUB socket sending `[topic, seq, payload]` per batch, and an optional ROUTER
//! replay socket answering `[b"", start_seq]` exactly as vLLM 0.33 does: `[b"", topic, seq,
//! payload]` for every buffered batch from `start_seq` on, then the end marker
//! `[b"", b"", u64::MAX, b""]`.
//!
//! Fault knobs: `drop_fraction` skips the PUB send of that share of batches (chosen by a seeded
//! RNG); a dropped batch still takes its sequence number and stays in the replay buffer, so a
//! subscriber sees a gap it can fill by replay. A restart ([`PublishMsg::Restart`]) starts the
//! sequence again at 0 and empties the replay buffer.
//!
//! Invariant: sequence numbers are assigned in the order the engine produced the batches, each
//! exactly once, starting at 0.

use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use parking_lot::Mutex;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use tokio::sync::mpsc;
use zeromq::{PubSocket, RouterSocket, Socket, SocketRecv, SocketSend, ZmqMessage};

use crate::engine::PublishMsg;
use crate::events::{BatchEncoder, ReplayBuffer, frames, parse_replay_request};

/// Publisher settings.
#[derive(Clone, Debug)]
pub struct PublisherConfig {
    /// Where the PUB socket binds (`tcp://*:5557`, `tcp://127.0.0.1:5557`).
    pub events_endpoint: String,
    /// Where the ROUTER replay socket binds; `None` disables replay.
    pub replay_endpoint: Option<String>,
    /// First frame of every message.
    pub topic: String,
    /// Batches kept for replay.
    pub buffer_steps: usize,
    /// Share of batches not sent on the PUB socket (0..=1).
    pub drop_fraction: f64,
    /// Seed of the drop decisions.
    pub fault_seed: u64,
    /// Payload encoder.
    pub encoder: BatchEncoder,
}

/// The bound sockets' endpoints, as resolved by the bind.
#[derive(Clone, Debug)]
pub struct BoundPublisher {
    /// The PUB endpoint.
    pub events_endpoint: String,
    /// The replay endpoint, when enabled.
    pub replay_endpoint: Option<String>,
}

/// Binds the sockets and spawns the publishing and replay tasks; they run until `batches` closes
/// (publishing) or the runtime stops (replay).
pub async fn start(
    config: PublisherConfig,
    mut batches: mpsc::UnboundedReceiver<PublishMsg>,
) -> Result<BoundPublisher, String> {
    if !(0.0..=1.0).contains(&config.drop_fraction) {
        return Err(format!(
            "--drop-fraction must be within 0..=1, got {}",
            config.drop_fraction
        ));
    }
    let mut publisher = PubSocket::new();
    let events_endpoint = publisher
        .bind(&bindable(&config.events_endpoint)?)
        .await
        .map_err(|e| format!("binding --events-endpoint {}: {e}", config.events_endpoint))?
        .to_string();
    let buffer = Arc::new(Mutex::new(ReplayBuffer::new(config.buffer_steps)));
    let replay_endpoint = match &config.replay_endpoint {
        None => None,
        Some(ep) => {
            let mut router = RouterSocket::new();
            let bound = router
                .bind(&bindable(ep)?)
                .await
                .map_err(|e| format!("binding --replay-endpoint {ep}: {e}"))?
                .to_string();
            tokio::spawn(serve_replay(router, buffer.clone(), config.topic.clone()));
            Some(bound)
        }
    };
    tokio::spawn(async move {
        let mut rng = SmallRng::seed_from_u64(config.fault_seed);
        let mut next_seq: u64 = 0;
        while let Some(msg) = batches.recv().await {
            let events = match msg {
                PublishMsg::Restart => {
                    next_seq = 0;
                    buffer.lock().clear();
                    continue;
                }
                PublishMsg::Batch(events) => events,
            };
            let payload = Bytes::from(config.encoder.encode_batch(now_ts(), &events));
            let seq = next_seq;
            next_seq += 1;
            buffer.lock().push(seq, payload.clone());
            if config.drop_fraction > 0.0 && rng.random::<f64>() < config.drop_fraction {
                tracing::debug!(seq, "dropping batch (--drop-fraction)");
                continue;
            }
            let Ok(msg) = ZmqMessage::try_from(frames(&config.topic, seq, payload)) else {
                continue; // three frames are never an empty message
            };
            if let Err(e) = publisher.send(msg).await {
                tracing::warn!(seq, "publishing KV events: {e}");
            }
        }
    });
    Ok(BoundPublisher {
        events_endpoint,
        replay_endpoint,
    })
}

/// The endpoint in the form the ZeroMQ library binds: libzmq's wildcard host `*`
/// (`tcp://*:5557`, vLLM's default) becomes `0.0.0.0`. Only `tcp://` endpoints are supported.
pub fn bindable(endpoint: &str) -> Result<String, String> {
    let Some(rest) = endpoint.strip_prefix("tcp://") else {
        return Err(format!(
            "endpoint `{endpoint}` is not supported: use tcp://*:PORT or tcp://HOST:PORT"
        ));
    };
    match rest.strip_prefix("*:") {
        Some(port) => Ok(format!("tcp://0.0.0.0:{port}")),
        None => Ok(endpoint.to_owned()),
    }
}

/// Seconds since the Unix epoch, like Python's `time.time()`.
fn now_ts() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or(0.0)
}

async fn serve_replay(mut router: RouterSocket, buffer: Arc<Mutex<ReplayBuffer>>, topic: String) {
    loop {
        let msg = match router.recv().await {
            Ok(m) => m,
            Err(e) => {
                tracing::debug!("replay socket: {e}");
                tokio::time::sleep(std::time::Duration::from_millis(10)).await;
                continue;
            }
        };
        let parts = msg.into_vec();
        let Some((envelope, start)) = parse_replay_request(&parts) else {
            tracing::warn!(
                frames = parts.len(),
                "ignoring malformed replay request (want [b\"\", start_seq as 8-byte big-endian])"
            );
            continue;
        };
        let answer = buffer.lock().answer(start, &topic);
        for frames in answer {
            let mut reply = envelope.to_vec();
            reply.extend(frames);
            let Ok(reply) = ZmqMessage::try_from(reply) else {
                continue;
            };
            if let Err(e) = router.send(reply).await {
                tracing::debug!("replay answer: {e}");
                break;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wildcard_endpoints_bind_every_interface() {
        assert_eq!(bindable("tcp://*:5557").unwrap(), "tcp://0.0.0.0:5557");
        assert_eq!(
            bindable("tcp://127.0.0.1:5557").unwrap(),
            "tcp://127.0.0.1:5557"
        );
        assert!(bindable("ipc:///tmp/x").is_err());
    }
}
