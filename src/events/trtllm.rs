//! TensorRT-LLM KV events: drained by polling `POST /kv_cache_events` on the engine's HTTP server
//! (a destructive read: every call returns the events since the previous one and forgets them).
//!
//! Rules (from how TensorRT-LLM publishes):
//! - `stored` (`parent_hash`, `blocks[{block_hash, tokens[{token_id}], cache_level, lora_id,
//!   cache_salt}]`): blocks carrying more than one distinct salt drop the event whole; a block with
//!   fewer tokens than the block size ends the event (the blocks before it are kept, and a later
//!   removal of that hash is ignored); a block with more tokens than the block size drops the
//!   event. `cache_level` 0 is device memory, anything else an offload tier. The salt (per block
//!   or event-level) goes through the same sequence-start rule as vLLM's extra keys
//!   (`namespace::root_seed`); an undecodable or non-string salt, or a LoRA id (whose adapter name
//!   is not in the event), makes the namespace unknown: never credited.
//! - Events become the engine-neutral `EngineEvent` ([`normalize`]) and reach the index through
//!   the core's one writer, `engine_event::apply`, here or on the replica that owns the drain.
//! - `removed` (`block_hashes`), `created` and `updated` (ignored).
//! - Malformed events and garbage responses are dropped and counted; the poller keeps going.
//! - A drain is read one event at a time ([`read_drain`]): each event is parsed, normalized and
//!   dropped before the next is read, so memory follows the events kept (token ids as `u32`s),
//!   never a JSON tree of the whole response (up to ~17× its bytes for a hostile
//!   `[0,0,0,...]`, whose elements are now each refused as read).

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use serde_json::Value;

use crate::httpc;
use kv_epp_core::engine_event::{
    self, EngineEvent, EventCounters, StoredRun, TIER_DEVICE, TIER_OFFLOAD,
};
use kv_epp_core::index::{EngineBlockHash, KvIndex, Medium};
use kv_epp_core::namespace::{self, ExtraKey};
use kv_epp_core::worker::WorkerId;

/// Largest drain response read.
const MAX_DRAIN: usize = 64 << 20;

/// Status of one poller.
#[derive(Debug, Default)]
pub(crate) struct PollStatus {
    /// The last poll succeeded.
    pub connected: AtomicBool,
    /// Successful polls.
    pub polls: AtomicU64,
    /// Failed polls (connection, status, garbage).
    pub failures: AtomicU64,
    /// Events applied.
    pub applied: AtomicU64,
    /// Ticks skipped because this replica's ownership lease had lapsed (fencing).
    pub fenced: AtomicU64,
    /// Asked to stop: the poller finishes the drain in flight (the engine already forgot those
    /// events), delivers it, and ends.
    pub stop: AtomicBool,
}

fn hash(v: &Value) -> Option<EngineBlockHash> {
    v.as_u64()
        .or_else(|| v.as_i64().map(|i| i as u64))
        .map(EngineBlockHash)
}

/// One TensorRT-LLM event in kv-epp's engine-neutral form (`None`: nothing to index). `Err` =
/// dropped (malformed or against the rules).
pub(crate) fn normalize(
    block_size: usize,
    event: &Value,
) -> Result<Option<EngineEvent>, &'static str> {
    let data = event.get("data").ok_or("no data")?;
    match data.get("type").and_then(Value::as_str).ok_or("no type")? {
        "stored" => stored(block_size, data),
        "removed" => {
            let hashes = data
                .get("block_hashes")
                .and_then(Value::as_array)
                .ok_or("removed without block_hashes")?
                .iter()
                .map(hash)
                .collect::<Option<Vec<_>>>()
                .ok_or("bad block hash")?;
            // TensorRT-LLM does not say which level; a removal leaves every tier.
            Ok(Some(EngineEvent::Removed {
                engine_hashes: hashes,
                tiers: TIER_DEVICE | TIER_OFFLOAD,
            }))
        }
        "created" | "updated" => Ok(None),
        _ => Err("unknown event type"),
    }
}

fn stored(bs: usize, data: &Value) -> Result<Option<EngineEvent>, &'static str> {
    let blocks = data
        .get("blocks")
        .and_then(Value::as_array)
        .ok_or("stored without blocks")?;
    let parent = match data.get("parent_hash") {
        None | Some(Value::Null) => None,
        Some(v) => Some(hash(v).ok_or("bad parent hash")?),
    };
    let event_salt = data.get("cache_salt").filter(|v| !v.is_null());
    let mut salts = std::collections::BTreeSet::new();
    let mut lora = false;
    let mut level = None;
    let mut hashes = Vec::new();
    let mut tokens = Vec::new();
    for b in blocks {
        let toks = b
            .get("tokens")
            .and_then(Value::as_array)
            .ok_or("block without tokens")?;
        if toks.len() > bs {
            return Err("block longer than the block size");
        }
        if toks.len() < bs {
            break; // a partial block ends the event
        }
        for t in toks {
            let id = t
                .get("token_id")
                .and_then(Value::as_u64)
                .and_then(|t| u32::try_from(t).ok())
                .ok_or("bad token id")?;
            tokens.push(id);
        }
        hashes
            .push(hash(b.get("block_hash").ok_or("block without hash")?).ok_or("bad block hash")?);
        let salt = b.get("cache_salt").filter(|v| !v.is_null()).or(event_salt);
        salts.insert(salt.map(|s| s.to_string()));
        lora |= b
            .get("lora_id")
            .is_some_and(|l| !l.is_null() && l.as_u64() != Some(0));
        level = level.or(b.get("cache_level").and_then(Value::as_u64));
    }
    if salts.len() > 1 {
        return Err("blocks of one event carry different salts");
    }
    if hashes.is_empty() {
        return Ok(None);
    }
    let salt = salts.into_iter().next().flatten();
    // The salt is the only extra key TensorRT-LLM publishes; a non-string one is untrusted.
    let root_seed = if lora {
        None
    } else {
        match salt {
            None => namespace::root_seed(None, &[]),
            Some(json) => serde_json::from_str::<String>(&json)
                .ok()
                .and_then(|s| namespace::root_seed(None, &[ExtraKey::Str(s)])),
        }
    };
    let medium = if level.unwrap_or(0) == 0 {
        Medium::Device
    } else {
        Medium::Offload
    };
    Ok(Some(EngineEvent::Stored(StoredRun {
        parent,
        root_seed,
        engine_hashes: hashes,
        tokens,
        medium,
        // Checked above block by block against the model's: full blocks only.
        block_size: None,
        session_id: None,
    })))
}

/// One drain response read: its events in kv-epp's form, and how many were dropped.
#[derive(Debug, Default)]
pub(crate) struct Drain {
    /// Events to index, in order.
    pub events: Vec<EngineEvent>,
    /// Events read (indexed, ignored or dropped).
    pub read: usize,
    /// Events dropped as malformed or against the rules.
    pub malformed: usize,
}

/// Reads a drain response (a JSON array of events) one event at a time: each is parsed,
/// [`normalize`]d and dropped before the next, so no tree of the whole body is ever built.
/// `Err` when the body is not one JSON array; the events read before the error are discarded
/// with it, as a body that is not JSON was always dropped whole.
pub(crate) fn read_drain(block_size: usize, body: &[u8]) -> Result<Drain, serde_json::Error> {
    use serde::de::{DeserializeSeed, SeqAccess, Visitor};

    struct Events<'a> {
        block_size: usize,
        out: &'a mut Drain,
    }
    impl<'de> Visitor<'de> for Events<'_> {
        type Value = ();
        fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
            f.write_str("an array of TensorRT-LLM KV events")
        }
        fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<(), A::Error> {
            while let Some(event) = seq.next_element::<Value>()? {
                self.out.read += 1;
                match normalize(self.block_size, &event) {
                    Ok(Some(ev)) => self.out.events.push(ev),
                    Ok(None) => {}
                    Err(why) => {
                        self.out.malformed += 1;
                        tracing::debug!(why, "dropping TensorRT-LLM KV event");
                    }
                }
            }
            Ok(())
        }
    }
    impl<'de> DeserializeSeed<'de> for Events<'_> {
        type Value = ();
        fn deserialize<D: serde::Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
            d.deserialize_seq(self)
        }
    }

    let mut drain = Drain::default();
    let mut de = serde_json::Deserializer::from_slice(body);
    Events {
        block_size,
        out: &mut drain,
    }
    .deserialize(&mut de)?;
    de.end()?;
    Ok(drain)
}

/// Where a poller's decoded events go, and whether it may drain at all.
pub(crate) trait EventSink: Send + Sync {
    /// Asked right before each drain: `None` skips this tick (a replica whose ownership lease
    /// lapsed must not drain until it is confirmed again). The ticket stamps the drain.
    fn admit(&self, _worker: &WorkerId) -> Option<crate::replica::fence::Ticket> {
        Some(Default::default())
    }

    /// Takes one drain's events of `worker`, in order, drained under `ticket`.
    fn deliver(
        &self,
        worker: &WorkerId,
        ticket: crate::replica::fence::Ticket,
        events: Vec<EngineEvent>,
    );
}

/// Applies drained events to this replica's index only (no peers).
pub(crate) struct LocalSink {
    /// The worker's model index.
    pub index: Arc<KvIndex>,
    /// The replica's event counters.
    pub counters: Arc<EventCounters>,
}

impl EventSink for LocalSink {
    fn deliver(
        &self,
        worker: &WorkerId,
        _ticket: crate::replica::fence::Ticket,
        events: Vec<EngineEvent>,
    ) {
        for ev in &events {
            if let Err(e) = engine_event::apply(&self.index, worker, ev, &self.counters) {
                tracing::debug!(%worker, error = %e, "TensorRT-LLM KV event not applied");
            }
        }
    }
}

/// Polls one worker until the task is aborted; drained events go to `sink`.
pub(crate) async fn poll(
    worker: WorkerId,
    block_size: usize,
    sink: Arc<dyn EventSink>,
    interval: Duration,
    counters: Arc<EventCounters>,
    status: Arc<PollStatus>,
) {
    let mut tick = tokio::time::interval(interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        if status.stop.load(Ordering::Acquire) {
            return;
        }
        let Some(ticket) = sink.admit(&worker) else {
            status.fenced.fetch_add(1, Ordering::Relaxed);
            continue;
        };
        let limits = httpc::Limits {
            deadline: Duration::from_secs(5),
            max_body: MAX_DRAIN,
        };
        // Admitted again once connected, right before the request is written: a process frozen
        // while connecting (past its lease) must not drain when it resumes.
        let gate = || sink.admit(&worker) == Some(ticket);
        let r = httpc::post_json_gated(
            worker.endpoint,
            "/kv_cache_events",
            &b"{}"[..],
            limits,
            gate,
        )
        .await;
        let drain = match r {
            Ok(r) if r.status() == httpc::StatusCode::OK => {
                match read_drain(block_size, r.body()) {
                    Ok(drain) => drain,
                    Err(_) => {
                        status.failures.fetch_add(1, Ordering::Relaxed);
                        continue;
                    }
                }
            }
            Err(httpc::HttpError::NotSent) => {
                status.fenced.fetch_add(1, Ordering::Relaxed);
                continue;
            }
            _ => {
                status.connected.store(false, Ordering::Relaxed);
                status.failures.fetch_add(1, Ordering::Relaxed);
                continue;
            }
        };
        status.connected.store(true, Ordering::Relaxed);
        status.polls.fetch_add(1, Ordering::Relaxed);
        counters
            .malformed
            .fetch_add(drain.malformed as u64, Ordering::Relaxed);
        // The writer counts what reaches the index (`counters.applied`), wherever it runs.
        status
            .applied
            .fetch_add((drain.read - drain.malformed) as u64, Ordering::Relaxed);
        if !drain.events.is_empty() {
            sink.deliver(&worker, ticket, drain.events);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kv_epp_core::hashing::prompt_hashes;
    use kv_epp_core::index::IndexLimits;
    use kv_epp_core::namespace::{Namespace, seed_for};
    use kv_epp_core::salt::{CacheSalt, SaltSource};
    use serde_json::json;

    /// Normalizes and applies one event the way a poller and its sink do. `Err` = dropped.
    fn apply_event(idx: &KvIndex, w: &WorkerId, event: &Value) -> Result<(), &'static str> {
        match normalize(idx.block_size(), event)? {
            Some(ev) => engine_event::apply(idx, w, &ev, &EventCounters::default())
                .map_err(|_| "not applied"),
            None => Ok(()),
        }
    }

    fn setup() -> (KvIndex, WorkerId) {
        let idx = KvIndex::new(2, IndexLimits::default());
        let w = WorkerId::new("10.0.0.1:8000".parse().unwrap());
        idx.add_worker(w);
        (idx, w)
    }

    fn block(h: u64, toks: &[u32], salt: Option<&str>) -> Value {
        json!({"type": "stored_block", "block_hash": h, "tokens": toks.iter().map(|t| json!({"token_id": t, "token_extra_id": 0})).collect::<Vec<_>>(), "lora_id": null, "cache_level": 0, "priority": 35, "cache_salt": salt})
    }

    fn overlap(idx: &KvIndex, toks: &[u32], salt: Option<&str>) -> u32 {
        let s = salt.map(|s| CacheSalt::new(s, SaltSource::Body).unwrap().unwrap());
        idx.best_total_blocks(&prompt_hashes(toks, 2, seed_for(s.as_ref(), None)).1)
    }

    #[test]
    fn stored_removed_and_salts() {
        let (idx, w) = setup();
        let fwd =
            Namespace::of(&CacheSalt::new("t", SaltSource::Body).unwrap().unwrap()).forwarded();
        let ev = json!({"event_id": 1, "data": {"type": "stored", "parent_hash": null, "blocks": [block(u64::MAX, &[1, 2], Some(&fwd)), block(5, &[3, 4], Some(&fwd))]}});
        apply_event(&idx, &w, &ev).unwrap();
        assert_eq!(overlap(&idx, &[1, 2, 3, 4], Some("t")), 2);
        assert_eq!(overlap(&idx, &[1, 2, 3, 4], None), 0);
        let rm = json!({"event_id": 2, "data": {"type": "removed", "block_hashes": [5]}});
        apply_event(&idx, &w, &rm).unwrap();
        assert_eq!(overlap(&idx, &[1, 2, 3, 4], Some("t")), 1);
    }

    #[test]
    fn a_drain_is_read_event_by_event_and_garbage_elements_are_counted() {
        let stored = json!({"event_id": 1, "data": {"type": "stored", "parent_hash": null, "blocks": [block(7, &[1, 2], None)]}});
        let removed = json!({"event_id": 2, "data": {"type": "removed", "block_hashes": [7]}});
        let created = json!({"event_id": 3, "data": {"type": "created"}});
        let body = format!(r#"[0, {{}}, "x", {stored}, [1, 2], {created}, {removed}]"#);
        let d = read_drain(2, body.as_bytes()).unwrap();
        assert_eq!((d.read, d.malformed, d.events.len()), (7, 4, 2));
        assert!(matches!(d.events[0], EngineEvent::Stored(_)));
        assert!(matches!(d.events[1], EngineEvent::Removed { .. }));
        // Not one JSON array: the drain is dropped whole, even past good events.
        for bad in [
            format!("[{stored}, {removed}"),
            format!("[{stored}] trailing"),
            stored.to_string(),
            String::new(),
        ] {
            assert!(read_drain(2, bad.as_bytes()).is_err(), "{bad}");
        }
        let empty = read_drain(2, b" [ ] ").unwrap();
        assert_eq!((empty.read, empty.events.len()), (0, 0));
    }

    #[test]
    fn rule_violations_drop_or_truncate() {
        let (idx, w) = setup();
        let mixed = json!({"data": {"type": "stored", "blocks": [block(1, &[1, 2], Some("kvepp:a")), block(2, &[3, 4], Some("kvepp:b"))]}});
        assert!(apply_event(&idx, &w, &mixed).is_err());
        let long = json!({"data": {"type": "stored", "blocks": [block(1, &[1, 2, 3], None)]}});
        assert!(apply_event(&idx, &w, &long).is_err());
        let partial = json!({"data": {"type": "stored", "blocks": [block(1, &[1, 2], None), block(2, &[3], None), block(3, &[5, 6], None)]}});
        apply_event(&idx, &w, &partial).unwrap();
        assert_eq!(
            idx.worker_blocks(&w).unwrap(),
            1,
            "the partial block ends the event"
        );
        let foreign =
            json!({"data": {"type": "stored", "blocks": [block(9, &[7, 7], Some("raw-salt"))]}});
        apply_event(&idx, &w, &foreign).unwrap();
        assert_eq!(
            overlap(&idx, &[7, 7], Some("raw-salt")),
            0,
            "undecodable salt is never credited"
        );
        for bad in [
            json!(1),
            json!({"data": {}}),
            json!({"data": {"type": "stored", "blocks": "x"}}),
            json!({"data": {"type": "stored", "blocks": [{"tokens": [{"token_id": -1}, {"token_id": 2}], "block_hash": 1}]}}),
            json!({"data": {"type": "nope"}}),
        ] {
            assert!(apply_event(&idx, &w, &bad).is_err(), "{bad}");
        }
        assert!(
            apply_event(
                &idx,
                &w,
                &json!({"data": {"type": "created", "num_blocks_per_cache_level": [10]}})
            )
            .is_ok()
        );
    }

    #[test]
    fn salt_rule_matches_routing() {
        let s = CacheSalt::new("org/team", SaltSource::Header)
            .unwrap()
            .unwrap();
        let (idx, w) = setup();
        let ev = json!({"data": {"type": "stored", "cache_salt": Namespace::of(&s).forwarded(), "blocks": [block(1, &[4, 4], None)]}});
        apply_event(&idx, &w, &ev).unwrap();
        let seqs = prompt_hashes(&[4, 4], 2, seed_for(Some(&s), None)).1;
        assert_eq!(
            idx.query(&seqs).len(),
            1,
            "event-level salt applies to its blocks"
        );
    }
}
