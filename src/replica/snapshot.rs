//! Index snapshots: a ready replica streams its index to a joining one.
//!
//! Per worker, the blocks are copied at one instant together with what they reflect: for a
//! ZeroMQ feed, the next sequence number (taken under the feed's apply lock); for relayed
//! single-reader sources, the relay positions (taken under the relay hub's lock). The copy is
//! then streamed in chunks of `peers.snapshot_chunk_blocks` entries through a channel of four
//! messages, so the sender holds one ZeroMQ worker's copy (24 bytes a block), or the relayed
//! workers' copies all at once (they must be taken at one instant with the relay positions),
//! plus four chunks; at most two snapshots are served at once. The receiver applies each chunk
//! as it arrives, within its own index limits.
//!
//! What a block carries: its engine hash, prefix hash, namespace (an index into the worker's
//! seed list, 0 = unknown) and tiers, so continuation events that arrive after the snapshot
//! inherit the right namespace, and unknown-namespace blocks stay uncredited.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;

use tokio::sync::mpsc;
use tonic::Status;

use super::ReplicaState;
use super::members::authed;
use super::pb;
use kv_epp_core::hashing::{HashSeed, SequenceHash};
use kv_epp_core::index::{EngineBlockHash, ExportedBlock, KvIndex, WorkerExport};
use kv_epp_core::worker::WorkerId;

/// What a bootstrap restored.
#[derive(Debug, Default)]
pub(crate) struct Restored {
    /// Workers restored.
    pub workers: usize,
    /// Block entries restored.
    pub blocks: usize,
    /// Per ZeroMQ worker, the sequence its feed resumes at.
    pub next_seqs: HashMap<WorkerId, u64>,
    /// Relay origin → next relay sequence the restored state expects.
    pub relay_positions: Vec<(u64, u64)>,
}

/// Streams this replica's index. Runs as its own task; stops when the receiver goes away.
pub fn serve(
    state: Arc<ReplicaState>,
    chunk: usize,
    slot: tokio::sync::OwnedSemaphorePermit,
) -> mpsc::Receiver<Result<pb::SnapshotChunk, Status>> {
    let (tx, rx) = mpsc::channel(4);
    tokio::spawn(async move {
        // Held until this snapshot is served or its reader is gone.
        let _slot = slot;
        state.counters.snapshots_served.inc();
        // Relayed workers and the relay positions, copied together.
        let single = state.feeds.single_reader_ids();
        let (relayed, positions) = state.hub.consistent(|| {
            let copies: Vec<_> = single
                .iter()
                .filter_map(|w| {
                    let (model, index) = state.workers.worker_index(w)?;
                    Some((*w, model, index.export_worker(w).ok()?))
                })
                .collect();
            copies
        });
        for (w, model, export) in relayed {
            let header = header(&w, &model, pb::Source::Relayed, None, &export);
            if send_worker(&tx, header, &export, chunk).await.is_err() {
                return;
            }
        }
        for rt in state.workers.all() {
            let w = rt.id;
            if single.contains(&w) {
                continue;
            }
            let Some((model, index)) = state.workers.worker_index(&w) else {
                continue;
            };
            let copied = match state.feeds.feed(&w) {
                Some(feed) => feed.consistent(|next| index.export_worker(&w).map(|e| (next, e))),
                None => index.export_worker(&w).map(|e| (None, e)),
            };
            let Ok((next, export)) = copied else { continue };
            let header = header(&w, &model, pb::Source::Zmq, next, &export);
            if send_worker(&tx, header, &export, chunk).await.is_err() {
                return;
            }
        }
        let end = pb::SnapshotEnd {
            relay: positions
                .into_iter()
                .map(|(origin, next_seq)| pb::RelayPosition { origin, next_seq })
                .collect(),
        };
        let _ = tx
            .send(Ok(pb::SnapshotChunk {
                item: Some(pb::snapshot_chunk::Item::End(end)),
            }))
            .await;
    });
    rx
}

fn header(
    w: &WorkerId,
    model: &str,
    source: pb::Source,
    next_seq: Option<u64>,
    export: &WorkerExport,
) -> pb::WorkerHeader {
    pb::WorkerHeader {
        model: model.to_owned(),
        endpoint: w.endpoint.to_string(),
        dp_rank: w.dp_rank,
        source: source as i32,
        next_seq,
        seeds: export.seeds.iter().map(|s| s.0).collect(),
        blocks: export.blocks.len() as u64,
    }
}

/// Longest a snapshot waits for its reader to take the next chunk.
const SEND_DEADLINE: std::time::Duration = std::time::Duration::from_secs(30);

async fn send_worker(
    tx: &mpsc::Sender<Result<pb::SnapshotChunk, Status>>,
    header: pb::WorkerHeader,
    export: &WorkerExport,
    chunk: usize,
) -> Result<(), ()> {
    use pb::snapshot_chunk::Item;
    // A reader that stops reading gives its slot (one of two) back after SEND_DEADLINE.
    let send = |item| async {
        let sent = tx.send(Ok(pb::SnapshotChunk { item: Some(item) }));
        match tokio::time::timeout(SEND_DEADLINE, sent).await {
            Ok(Ok(())) => Ok(()),
            _ => Err(()),
        }
    };
    send(Item::Worker(header)).await?;
    for run in export.blocks.chunks(chunk.max(1)) {
        send(Item::Blocks(pb::BlockRun {
            engine_hashes: run.iter().map(|b| b.engine.0).collect(),
            prefix_hashes: run.iter().map(|b| b.seq.0).collect(),
            namespaces: run.iter().map(|b| b.ns).collect(),
            tiers: run.iter().map(|b| b.tiers).collect(),
        }))
        .await?;
    }
    send(Item::WorkerEnd(pb::WorkerEnd {})).await
}

/// The worker a snapshot is currently restoring.
struct Current {
    id: WorkerId,
    /// `None`: a model this replica does not serve; its blocks are read and skipped.
    index: Option<Arc<KvIndex>>,
    seeds: Vec<HashSeed>,
    expected: u64,
    got: u64,
}

/// Fetches a peer's snapshot and restores it into this replica's index. On failure, whatever
/// was restored is dropped again (the replica stays empty and not ready).
pub(crate) async fn fetch(state: &Arc<ReplicaState>, peer: SocketAddr) -> Result<Restored, String> {
    let mut touched = Vec::new();
    let r = fetch_into(state, peer, &mut touched).await;
    if r.is_err() {
        for (w, index) in touched {
            let _ = index.clear_worker(&w);
        }
    }
    r
}

async fn fetch_into(
    state: &Arc<ReplicaState>,
    peer: SocketAddr,
    touched: &mut Vec<(WorkerId, Arc<KvIndex>)>,
) -> Result<Restored, String> {
    use pb::snapshot_chunk::Item;
    let mut client = state.members.client(peer);
    let req = authed(
        state,
        pb::SnapshotRequest {
            max_blocks_per_chunk: state.config.snapshot_chunk_blocks,
        },
    );
    let mut stream = client
        .snapshot(req)
        .await
        .map_err(|s| format!("snapshot call: {}", s.message()))?
        .into_inner();
    let mut out = Restored::default();
    let mut current: Option<Current> = None;
    loop {
        let msg = tokio::time::timeout(std::time::Duration::from_secs(30), stream.message())
            .await
            .map_err(|_| "snapshot stream stalled".to_string())?
            .map_err(|s| format!("snapshot stream: {}", s.message()))?
            .ok_or("snapshot stream ended early")?;
        state
            .counters
            .snapshot_bytes
            .inc_by(prost::Message::encoded_len(&msg) as u64);
        match msg.item.ok_or("empty snapshot chunk")? {
            Item::Worker(h) => {
                if current.is_some() {
                    return Err("worker header inside a worker".into());
                }
                let id = WorkerId::with_rank(
                    h.endpoint
                        .parse()
                        .map_err(|_| format!("bad worker endpoint `{}`", h.endpoint))?,
                    h.dp_rank,
                );
                let index = state
                    .workers
                    .worker_index(&id)
                    .filter(|(model, _)| *model == h.model)
                    .map(|(_, index)| index);
                let Some(index) = index else {
                    tracing::warn!(worker = %id, model = %h.model, "snapshot names a worker this replica does not run; skipped");
                    current = Some(Current {
                        id,
                        index: None,
                        seeds: Vec::new(),
                        expected: h.blocks,
                        got: 0,
                    });
                    continue;
                };
                index.add_worker(id);
                index.clear_worker(&id).map_err(|e| e.to_string())?;
                touched.push((id, index.clone()));
                if h.source == pb::Source::Zmq as i32
                    && let Some(s) = h.next_seq
                {
                    out.next_seqs.insert(id, s);
                }
                current = Some(Current {
                    id,
                    index: Some(index),
                    seeds: h.seeds.into_iter().map(HashSeed).collect(),
                    expected: h.blocks,
                    got: 0,
                });
            }
            Item::Blocks(run) => {
                let cur = current.as_mut().ok_or("blocks outside a worker")?;
                let n = run.engine_hashes.len();
                if run.prefix_hashes.len() != n || run.namespaces.len() != n || run.tiers.len() != n
                {
                    return Err("block run columns differ in length".into());
                }
                cur.got += n as u64;
                if cur.got > cur.expected {
                    return Err("more blocks than the worker header announced".into());
                }
                let blocks: Vec<ExportedBlock> = (0..n)
                    .map(|i| ExportedBlock {
                        engine: EngineBlockHash(run.engine_hashes[i]),
                        seq: SequenceHash(run.prefix_hashes[i]),
                        ns: run.namespaces[i],
                        tiers: run.tiers[i],
                    })
                    .collect();
                if let Some(index) = &cur.index {
                    let restored = index
                        .restore_blocks(&cur.id, &cur.seeds, &blocks)
                        .map_err(|e| e.to_string())?;
                    out.blocks += restored;
                    state.counters.blocks_restored.inc_by(restored as u64);
                }
            }
            Item::WorkerEnd(_) => {
                let cur = current.take().ok_or("worker end outside a worker")?;
                if cur.got != cur.expected {
                    return Err(format!(
                        "worker {} announced {} blocks, sent {}",
                        cur.id, cur.expected, cur.got
                    ));
                }
                out.workers += 1;
            }
            Item::End(end) => {
                if current.is_some() {
                    return Err("snapshot ended inside a worker".into());
                }
                out.relay_positions = end.relay.iter().map(|p| (p.origin, p.next_seq)).collect();
                return Ok(out);
            }
        }
    }
}
