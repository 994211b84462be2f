//! The peer API server: `Hello`, `Snapshot`, `Relay`, behind the shared token and message size
//! limits, and behind mutual TLS when `peers.cert_path` is set (a client without a certificate
//! from the peers' CA never gets past the handshake).

use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{mpsc, watch};
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status};

use super::ReplicaState;
use super::pb;
use super::pb::replica_server::{Replica, ReplicaServer};

/// Relayed batches sent per read of the log.
const RELAY_READ: usize = 64;
/// A relay stream with nothing new sends a keepalive this often.
const KEEPALIVE: Duration = Duration::from_secs(1);

struct Service {
    state: Arc<ReplicaState>,
    /// Fires at shutdown: open relay streams end so the server can stop gracefully.
    stop: watch::Receiver<bool>,
    /// Snapshots being served: each copies the relayed workers' blocks at once, so their
    /// number is bounded ([`MAX_SNAPSHOTS`]); a joiner asks another peer, or again.
    snapshots: Arc<tokio::sync::Semaphore>,
}

/// Snapshots served at once.
const MAX_SNAPSHOTS: usize = 2;
/// Streams one peer connection may have open at once: a peer needs a handful (probes, its
/// relay subscription, a catch-up, a snapshot).
const MAX_PEER_STREAMS: u32 = 64;

type Stream<T> = Pin<Box<dyn tokio_stream::Stream<Item = Result<T, Status>> + Send>>;

impl Service {
    fn authorize<T>(&self, req: &Request<T>) -> Result<(), Status> {
        let Some(want) = self.state.token() else {
            return Ok(());
        };
        let ok = req
            .metadata()
            .get("authorization")
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "))
            .is_some_and(|got| want.accepts(got));
        if ok {
            Ok(())
        } else {
            self.state.counters.unauthenticated.inc();
            Err(Status::unauthenticated("missing or wrong peer token"))
        }
    }
}

#[tonic::async_trait]
impl Replica for Service {
    async fn hello(
        &self,
        req: Request<pb::HelloRequest>,
    ) -> Result<Response<pb::HelloReply>, Status> {
        self.authorize(&req)?;
        let now = std::time::Instant::now();
        let holding_ms = match self.state.lease() {
            Some(l) if self.state.is_ready() => l
                .held_until(now)
                .map_or(0, |t| t.duration_since(now).as_millis() as u64),
            _ => 0,
        };
        let delegations = if holding_ms > 0 {
            self.state
                .delegations()
                .into_iter()
                .map(|(worker, owner)| pb::Delegation { worker, owner })
                .collect()
        } else {
            Vec::new()
        };
        Ok(Response::new(pb::HelloReply {
            instance: self.state.instance,
            ready: self.state.is_ready(),
            version: env!("CARGO_PKG_VERSION").to_owned(),
            polling: self
                .state
                .feeds
                .poll_statuses()
                .iter()
                .map(|(w, _)| w.to_string())
                .collect(),
            relay_next: self.state.hub.next_seq(),
            claims: self
                .state
                .hub
                .fencing
                .claims()
                .into_iter()
                .map(|(w, c)| pb::Claim {
                    worker: w.to_string(),
                    epoch: c.epoch,
                    active: c.active,
                    prev_origin: c.prev.map_or(0, |p| p.0),
                    prev_seq: c.prev.map_or(0, |p| p.1),
                    owner: 0,
                })
                .collect(),
            fences: self
                .state
                .hub
                .fencing
                .fences()
                .into_iter()
                .map(|(w, f)| pb::Claim {
                    worker: w.to_string(),
                    epoch: f.epoch,
                    active: true,
                    prev_origin: f.prev.map_or(0, |p| p.0),
                    prev_seq: f.prev.map_or(0, |p| p.1),
                    owner: f.owner,
                })
                .collect(),
            diverged: self
                .state
                .hub
                .fencing
                .diverged()
                .iter()
                .map(ToString::to_string)
                .collect(),
            sources: self
                .state
                .feeds
                .single_reader_ids()
                .iter()
                .map(ToString::to_string)
                .collect(),
            sources_known: true,
            holding_ms,
            delegations,
        }))
    }

    type SnapshotStream = Stream<pb::SnapshotChunk>;

    async fn snapshot(
        &self,
        req: Request<pb::SnapshotRequest>,
    ) -> Result<Response<Self::SnapshotStream>, Status> {
        self.authorize(&req)?;
        if !self.state.is_ready() {
            return Err(Status::unavailable(
                "this replica is bootstrapping itself; ask a ready peer",
            ));
        }
        let ours = self.state.config.snapshot_chunk_blocks as usize;
        let asked = req.into_inner().max_blocks_per_chunk as usize;
        let chunk = if asked == 0 { ours } else { asked.min(ours) };
        let Ok(permit) = self.snapshots.clone().try_acquire_owned() else {
            return Err(Status::resource_exhausted(
                "serving as many snapshots as it may; ask another peer, or again shortly",
            ));
        };
        let rx = super::snapshot::serve(self.state.clone(), chunk, permit);
        Ok(Response::new(Box::pin(ReceiverStream::new(rx))))
    }

    type RelayStream = Stream<pb::RelayBatch>;

    async fn relay(
        &self,
        req: Request<pb::RelayRequest>,
    ) -> Result<Response<Self::RelayStream>, Status> {
        self.authorize(&req)?;
        let r = req.into_inner();
        let hub = self.state.hub.clone();
        let instance = self.state.instance;
        if r.of_origin != 0 {
            // A catch-up: what this replica holds of that origin (itself included, when it is
            // back after peers gave it up), bounded, then the end; never a live stream.
            let batches =
                hub.read_for_catch_up(r.of_origin, r.from_seq, super::relay::CATCH_UP_MAX);
            let stream = tokio_stream::iter(batches.into_iter().map(|b| Ok((*b).clone())));
            return Ok(Response::new(Box::pin(stream)));
        }
        // Another instance's position means nothing here: start at the oldest batch kept.
        let mut next = if r.origin == instance { r.from_seq } else { 0 };
        let (tx, rx) = mpsc::channel(RELAY_READ);
        let mut tail: watch::Receiver<u64> = hub.watch_tail();
        let mut stop = self.stop.clone();
        tokio::spawn(async move {
            let mut reset = false;
            loop {
                tail.borrow_and_update();
                let (batches, oldest) = hub.read_from(next, RELAY_READ);
                // The log no longer has what the caller wants (or the caller claims a position
                // this instance never reached): its state of what came before is unknown.
                if next < oldest || next > hub.next_seq() {
                    next = oldest;
                    reset = true;
                    continue;
                }
                for b in &batches {
                    let mut b = (**b).clone();
                    b.reset = std::mem::take(&mut reset);
                    next = b.seq.saturating_add(1);
                    if tx.send(Ok(b)).await.is_err() {
                        return;
                    }
                }
                if !batches.is_empty() {
                    continue;
                }
                tokio::select! {
                    r = tail.changed() => if r.is_err() { return },
                    _ = async { let _ = stop.wait_for(|s| *s).await; } => return,
                    _ = tokio::time::sleep(KEEPALIVE) => {
                        let k = pb::RelayBatch { keepalive: true, origin: instance, ..Default::default() };
                        if tx.send(Ok(k)).await.is_err() { return; }
                    }
                }
            }
        });
        Ok(Response::new(Box::pin(ReceiverStream::new(rx))))
    }
}

/// Serves the peer API until `stop` fires.
pub async fn serve(
    state: Arc<ReplicaState>,
    listener: tokio::net::TcpListener,
    mut stop: watch::Receiver<bool>,
) {
    let max = state.config.max_message_bytes;
    let svc = ReplicaServer::new(Service {
        state: state.clone(),
        stop: stop.clone(),
        snapshots: Arc::new(tokio::sync::Semaphore::new(MAX_SNAPSHOTS)),
    })
    .max_decoding_message_size(max)
    .max_encoding_message_size(max);
    let done = async move {
        let _ = stop.wait_for(|s| *s).await;
    };
    let router = tonic::transport::Server::builder()
        .max_concurrent_streams(MAX_PEER_STREAMS)
        .add_service(svc);
    let served = match &state.tls {
        Some(tls) => {
            let conns = crate::tls::accept::incoming(listener, tls.configs.clone());
            router.serve_with_incoming_shutdown(conns, done).await
        }
        None => {
            router
                .serve_with_incoming_shutdown(crate::server::incoming(listener), done)
                .await
        }
    };
    if let Err(e) = served {
        tracing::error!(error = %e, "peer API server stopped");
    }
}
