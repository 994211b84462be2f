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
//! - A drain is read one event at a time ([`read_drain`]), each event straight into the fields
//!   the rules read (token ids as `u32`s, hashes as `u64`s; the rest skipped unread) and
//!   normalized before the next is read, so memory follows the events kept, never a JSON tree of
//!   the response or of one event (~17× the bytes it is read from). An event carries at most
//!   vLLM's caps of hashes and token ids, and a drain's kept events about the body's size
//!   decoded ([`DRAIN_BUDGET`]); past them events are dropped and counted.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use crate::events::vllm::{MAX_BLOCKS_PER_EVENT, MAX_TOKENS_PER_EVENT};
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

/// Most bytes the events kept from one drain may hold decoded (their token ids, hashes and the
/// events themselves, see [`kept_bytes`]), and never more than the body's own size (or
/// [`MIN_DRAIN_BUDGET`] for a smaller body): a response
/// of many small numbers (a `removed` event's `[0,0,...]` decodes to 4× its bytes) or of many
/// tiny events cannot cost more memory than the body itself (plus the list's spare capacity).
/// Real events are far larger as JSON than decoded. Events past it are dropped and counted.
const DRAIN_BUDGET: usize = MAX_DRAIN;

/// The budget of a small body: whatever its size, a drain may keep this much (a body of a few
/// events is smaller than their decoded form).
const MIN_DRAIN_BUDGET: usize = 1 << 20;

/// What a kept event costs beyond its token ids and hashes: the event itself and the
/// allocator's headers of its two lists.
const EVENT_BYTES: usize = std::mem::size_of::<EngineEvent>() + 32;

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

/// Reads a drain response (a JSON array of events) one event at a time, each straight into the
/// few fields the rules need (token ids as `u32`s, hashes as `u64`s, everything else skipped
/// unread), then [`normalize`]d and kept or dropped before the next is read: no JSON tree is
/// built, of the body or of one event (a tree costs ~17× the bytes it was read from, so one
/// huge event would have cost that). An event's token ids and hashes are capped as vLLM's are
/// (`MAX_TOKENS_PER_EVENT`, `MAX_BLOCKS_PER_EVENT`) and the drain's kept ones by
/// [`DRAIN_BUDGET`]; a field of the wrong type drops its event, never the drain. `Err` when the
/// body is not one JSON array (or nests deeper than serde_json's recursion limit); the events
/// read before the error are discarded with it, as such a body was always dropped whole.
pub(crate) fn read_drain(block_size: usize, body: &[u8]) -> Result<Drain, serde_json::Error> {
    read_drain_within(
        block_size,
        body,
        body.len().clamp(MIN_DRAIN_BUDGET, DRAIN_BUDGET),
    )
}

/// [`read_drain`] with `budget` decoded bytes for the events kept.
fn read_drain_within(
    block_size: usize,
    body: &[u8],
    budget: usize,
) -> Result<Drain, serde_json::Error> {
    let mut drain = Drain::default();
    let mut kept_bytes = 0usize;
    let mut de = serde_json::Deserializer::from_slice(body);
    Any(EventsSeed {
        block_size,
        budget,
        out: &mut drain,
        kept_bytes: &mut kept_bytes,
    })
    .deserialize(&mut de)?;
    de.end()?;
    Ok(drain)
}

use serde::de::{DeserializeSeed, Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};

use crate::json::{Any, Scalar, each_entry, skip};

/// The drain's array: each element read as an event ([`EventSeed`]) and normalized at once.
struct EventsSeed<'a> {
    block_size: usize,
    budget: usize,
    out: &'a mut Drain,
    kept_bytes: &'a mut usize,
}

impl<'de> Visitor<'de> for EventsSeed<'_> {
    type Value = ();
    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("an array of TensorRT-LLM KV events")
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<(), A::Error> {
        loop {
            let left = self.budget.saturating_sub(*self.kept_bytes);
            let Some(event) = seq.next_element_seed(Any(EventSeed {
                block_size: self.block_size,
                budget: left.saturating_sub(EVENT_BYTES),
            }))?
            else {
                return Ok(());
            };
            self.out.read += 1;
            match normalize(event) {
                Ok(Some(ev)) if kept_bytes(&ev) > left => {
                    self.out.malformed += 1;
                    tracing::debug!("dropping TensorRT-LLM KV event: drain over its budget");
                }
                Ok(Some(ev)) => {
                    *self.kept_bytes += kept_bytes(&ev);
                    self.out.events.push(ev);
                }
                Ok(None) => {}
                Err(why) => {
                    self.out.malformed += 1;
                    tracing::debug!(why, "dropping TensorRT-LLM KV event");
                }
            }
        }
    }
}

/// What a kept event takes in memory: itself and its lists (by capacity).
fn kept_bytes(ev: &EngineEvent) -> usize {
    EVENT_BYTES
        + match ev {
            EngineEvent::Stored(run) => {
                run.tokens.capacity() * 4 + run.engine_hashes.capacity() * 8
            }
            EngineEvent::Removed { engine_hashes, .. } => engine_hashes.capacity() * 8,
            EngineEvent::Cleared => 0,
        }
}

/// A block hash: any 64-bit integer, signed ones as their bits (TensorRT-LLM's ZeroMQ
/// publisher writes signed hashes).
fn block_hash(v: Scalar) -> Option<EngineBlockHash> {
    match v {
        Scalar::Unsigned(v) => Some(EngineBlockHash(v)),
        Scalar::Negative(v) => Some(EngineBlockHash(v as u64)),
        _ => None,
    }
}

/// An event's `type`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
enum Kind {
    /// Absent or not a string.
    #[default]
    Missing,
    Stored,
    Removed,
    /// `created` and `updated`: nothing to index.
    Ignored,
    Unknown,
}

impl<'de> serde::Deserialize<'de> for Kind {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Kind, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Kind;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("an event type")
            }
            fn visit_str<E>(self, v: &str) -> Result<Kind, E> {
                Ok(match v {
                    "stored" => Kind::Stored,
                    "removed" => Kind::Removed,
                    "created" | "updated" => Kind::Ignored,
                    _ => Kind::Unknown,
                })
            }
            skip!(Kind::Missing; u64, i64, f64, bool, unit, seq, map);
        }
        d.deserialize_any(V)
    }
}

/// A cache salt as written: a string (decoded, so two spellings of one string are one salt) or
/// any other non-null value (never trusted), by its text.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Salt<'de> {
    Str(String),
    Other(std::borrow::Cow<'de, str>),
}

/// Non-string salts up to this size are compared in canonical form (so `1.0` and `1e0`, or
/// one object spelled two ways, are one salt, as in a JSON tree); larger ones by their text.
const CANONICAL_SALT_BYTES: usize = 4096;

/// Reads a `cache_salt` value: `None` when null. Never fails on a value that is valid JSON: a
/// string that does not decode to UTF-8 (a lone surrogate escape) is an untrusted salt.
fn read_salt<'de, A: MapAccess<'de>>(map: &mut A) -> Result<Option<Salt<'de>>, A::Error> {
    let raw: &'de serde_json::value::RawValue = map.next_value()?;
    let text = raw.get().trim_start();
    let other = || {
        Salt::Other(match serde_json::from_str::<serde_json::Value>(text) {
            Ok(v) if text.len() <= CANONICAL_SALT_BYTES => v.to_string().into(),
            _ => text.into(),
        })
    };
    Ok(match text.as_bytes().first() {
        Some(b'n') => None,
        Some(b'"') => Some(serde_json::from_str(text).map_or_else(|_| other(), Salt::Str)),
        _ => Some(other()),
    })
}

/// One event as read: its `data` (`None`: absent, or the event is not an object).
struct EventSeed {
    block_size: usize,
    /// Decoded bytes this event may keep (the drain's budget left).
    budget: usize,
}

impl<'de> Visitor<'de> for EventSeed {
    type Value = Option<DataRead<'de>>;
    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("a TensorRT-LLM KV event")
    }
    fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<Self::Value, A::Error> {
        let mut data = None;
        each_entry(map, &["data"], |_, map| {
            // A second `data` replaces the first (and its decoded blocks are freed first).
            data = None;
            data = Some(map.next_value_seed(Any(DataSeed {
                block_size: self.block_size,
                budget: self.budget,
            }))?);
            Ok(())
        })?;
        Ok(data)
    }
    skip!(None; u64, i64, f64, bool, str, unit, seq);
}

/// An event's `data`, as far as the rules read it.
#[derive(Default)]
struct DataRead<'de> {
    kind: Kind,
    /// `parent_hash` (absent: `None`).
    parent: Option<Scalar>,
    /// The event-level `cache_salt` (absent or null: `None`).
    salt: Option<Salt<'de>>,
    /// `blocks` (absent or not an array: `None`).
    blocks: Option<Blocks<'de>>,
    /// `block_hashes` (absent or not an array: `None`; `Err`: a bad hash or too many).
    removed: Option<Result<Vec<EngineBlockHash>, &'static str>>,
}

struct DataSeed {
    block_size: usize,
    budget: usize,
}

impl<'de> Visitor<'de> for DataSeed {
    type Value = DataRead<'de>;
    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("an event's data")
    }
    fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<Self::Value, A::Error> {
        const KEYS: &[&str] = &[
            "type",
            "parent_hash",
            "cache_salt",
            "blocks",
            "block_hashes",
        ];
        let mut d = DataRead::default();
        each_entry(map, KEYS, |i, map| {
            match i {
                0 => d.kind = map.next_value()?,
                1 => d.parent = Some(map.next_value()?),
                2 => d.salt = read_salt(map)?,
                3 => {
                    d.blocks = None;
                    d.blocks = map.next_value_seed(Any(BlocksSeed {
                        block_size: self.block_size,
                        budget: self.budget,
                    }))?;
                }
                _ => {
                    d.removed = None;
                    d.removed = map.next_value_seed(Any(HashesSeed {
                        budget: self.budget,
                    }))?;
                }
            }
            Ok(())
        })?;
        Ok(d)
    }
    skip!(DataRead::default(); u64, i64, f64, bool, str, unit, seq);
}

/// A `removed` event's `block_hashes`.
struct HashesSeed {
    budget: usize,
}

impl<'de> Visitor<'de> for HashesSeed {
    type Value = Option<Result<Vec<EngineBlockHash>, &'static str>>;
    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("block hashes")
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
        let mut hashes = Ok(Vec::new());
        while let Some(v) = seq.next_element::<Scalar>()? {
            let Ok(list) = &mut hashes else { continue };
            if list.len() == MAX_BLOCKS_PER_EVENT {
                hashes = Err("more block hashes than an event may carry");
            } else if (list.len() + 1) * 8 > self.budget {
                hashes = Err("drain over its decoded budget");
            } else {
                match block_hash(v) {
                    Some(h) => list.push(h),
                    None => hashes = Err("bad block hash"),
                }
            }
        }
        Ok(Some(hashes))
    }
    skip!(None; u64, i64, f64, bool, str, unit, map);
}

/// A `stored` event's blocks, read in order under the rules: the first partial block ends the
/// event (nothing after it is kept or checked), the first block against the rules makes the
/// event's error (nothing after it is kept).
#[derive(Default)]
struct Blocks<'de> {
    hashes: Vec<EngineBlockHash>,
    tokens: Vec<u32>,
    /// A partial block was met.
    ended: bool,
    error: Option<&'static str>,
    /// The first block's own salt, if it had one.
    own_salt: Option<Salt<'de>>,
    /// Some block had no salt of its own (it takes the event's).
    lacking: bool,
    lora: bool,
    level: Option<u64>,
}

impl Blocks<'_> {
    /// Whether a block read now still counts.
    fn open(&self) -> bool {
        !self.ended && self.error.is_none()
    }
}

struct BlocksSeed {
    block_size: usize,
    budget: usize,
}

impl<'de> Visitor<'de> for BlocksSeed {
    type Value = Option<Blocks<'de>>;
    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("blocks")
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
        let mut blocks = Blocks::default();
        loop {
            if !blocks.open() {
                // Ended or dropped: the rest is only skipped.
                if seq.next_element::<IgnoredAny>()?.is_none() {
                    break;
                }
                continue;
            }
            let start = blocks.tokens.len();
            let seed = BlockSeed {
                block_size: self.block_size,
                budget: self.budget,
                blocks: &mut blocks,
            };
            let Some(block) = seq.next_element_seed(Any(seed))? else {
                break;
            };
            if let Err(why) = blocks.close(block, start, self.block_size, self.budget) {
                blocks.tokens.truncate(start);
                if why.is_empty() {
                    blocks.ended = true;
                } else {
                    blocks.error = Some(why);
                }
            }
        }
        // What a dropped event decoded goes now, not when the event does.
        if blocks.error.is_some() {
            blocks.tokens = Vec::new();
            blocks.hashes = Vec::new();
        }
        Ok(Some(blocks))
    }
    skip!(None; u64, i64, f64, bool, str, unit, map);
}

/// One block as read (its token ids went straight into the event's, from `start`).
#[derive(Default)]
struct BlockRead<'de> {
    /// `tokens` (`None`: absent or not an array).
    tokens: Option<TokensRead>,
    hash: Option<Scalar>,
    salt: Option<Salt<'de>>,
    lora: Option<Scalar>,
    level: Option<Scalar>,
}

impl<'de> Blocks<'de> {
    /// Takes a block read in full. `Err("")`: a partial block (it ends the event); `Err(why)`:
    /// against the rules (the event is dropped).
    fn close(
        &mut self,
        b: BlockRead<'de>,
        start: usize,
        block_size: usize,
        budget: usize,
    ) -> Result<(), &'static str> {
        let t = b.tokens.ok_or("block without tokens")?;
        if t.count > block_size {
            return Err("block longer than the block size");
        }
        if t.count < block_size {
            return Err("");
        }
        if t.bad {
            return Err("bad token id");
        }
        if t.overflow {
            return Err("more tokens than an event (or the drain's budget) may carry");
        }
        debug_assert_eq!(self.tokens.len(), start + t.count);
        let hash = b.hash.ok_or("block without hash")?;
        let hash = block_hash(hash).ok_or("bad block hash")?;
        if self.hashes.len() == MAX_BLOCKS_PER_EVENT {
            return Err("more blocks than an event may carry");
        }
        if self.tokens.len() * 4 + (self.hashes.len() + 1) * 8 > budget {
            return Err("drain over its decoded budget");
        }
        self.hashes.push(hash);
        match b.salt {
            Some(salt) => match &self.own_salt {
                None => self.own_salt = Some(salt),
                Some(first) if *first != salt => {
                    return Err("blocks of one event carry different salts");
                }
                Some(_) => {}
            },
            None => self.lacking = true,
        }
        self.lora |= b
            .lora
            .is_some_and(|l| l != Scalar::Null && l != Scalar::Unsigned(0));
        if self.level.is_none()
            && let Some(Scalar::Unsigned(l)) = b.level
        {
            self.level = Some(l);
        }
        Ok(())
    }
}

struct BlockSeed<'a, 'de> {
    block_size: usize,
    budget: usize,
    blocks: &'a mut Blocks<'de>,
}

impl<'de> Visitor<'de> for BlockSeed<'_, 'de> {
    type Value = BlockRead<'de>;
    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("a block")
    }
    fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<Self::Value, A::Error> {
        const KEYS: &[&str] = &[
            "tokens",
            "block_hash",
            "cache_salt",
            "lora_id",
            "cache_level",
        ];
        let start = self.blocks.tokens.len();
        let mut b = BlockRead::default();
        each_entry(map, KEYS, |i, map| {
            match i {
                0 => {
                    self.blocks.tokens.truncate(start);
                    // What the event and the drain still have room for; one token more than a
                    // block holds tells a long block from a full one.
                    let spent = start * 4 + (self.blocks.hashes.len() + 1) * 8;
                    let room = (self.block_size + 1)
                        .min(MAX_TOKENS_PER_EVENT.saturating_sub(start))
                        .min(self.budget.saturating_sub(spent) / 4);
                    b.tokens = map.next_value_seed(Any(TokensSeed {
                        room,
                        tokens: &mut self.blocks.tokens,
                    }))?;
                }
                1 => b.hash = Some(map.next_value()?),
                2 => b.salt = read_salt(map)?,
                3 => b.lora = Some(map.next_value()?),
                _ => b.level = Some(map.next_value()?),
            }
            Ok(())
        })?;
        Ok(b)
    }
    skip!(BlockRead::default(); u64, i64, f64, bool, str, unit, seq);
}

/// A block's `tokens`, pushed onto the event's as read, at most `room` of them (one past a
/// block's size is enough to call it long): `None` when not an array.
struct TokensSeed<'a> {
    room: usize,
    tokens: &'a mut Vec<u32>,
}

/// A block's `tokens` as read.
#[derive(Clone, Copy, Default)]
struct TokensRead {
    count: usize,
    /// A token that was not `{"token_id": <u32>}`.
    bad: bool,
    /// More than `room`: the block could not be kept whole.
    overflow: bool,
}

impl<'de> Visitor<'de> for TokensSeed<'_> {
    type Value = Option<TokensRead>;
    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("tokens")
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
        let mut r = TokensRead::default();
        while let Some(id) = seq.next_element::<TokenId>()? {
            r.count = r.count.saturating_add(1);
            match id.0 {
                Some(_) if r.count > self.room => r.overflow = true,
                Some(id) => self.tokens.push(id),
                None => r.bad = true,
            }
        }
        Ok(Some(r))
    }
    skip!(None; u64, i64, f64, bool, str, unit, map);
}

/// One token: `{"token_id": <u32>, ...}` (`None`: anything else).
struct TokenId(Option<u32>);

impl<'de> serde::Deserialize<'de> for TokenId {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<TokenId, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = TokenId;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a token")
            }
            fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<TokenId, A::Error> {
                let mut id = None;
                each_entry(map, &["token_id"], |_, map| {
                    id = match map.next_value::<Scalar>()? {
                        Scalar::Unsigned(v) => u32::try_from(v).ok(),
                        _ => None,
                    };
                    Ok(())
                })?;
                Ok(TokenId(id))
            }
            skip!(TokenId(None); u64, i64, f64, bool, str, unit, seq);
        }
        d.deserialize_any(V)
    }
}

/// One event, as read, in kv-epp's engine-neutral form (`None`: nothing to index). `Err` =
/// dropped (malformed or against the rules).
fn normalize(data: Option<DataRead<'_>>) -> Result<Option<EngineEvent>, &'static str> {
    let data = data.ok_or("no data")?;
    match data.kind {
        Kind::Missing => Err("no type"),
        Kind::Stored => stored(data),
        Kind::Removed => {
            let hashes = data.removed.ok_or("removed without block_hashes")??;
            // TensorRT-LLM does not say which level; a removal leaves every tier.
            Ok(Some(EngineEvent::Removed {
                engine_hashes: hashes,
                tiers: TIER_DEVICE | TIER_OFFLOAD,
            }))
        }
        Kind::Ignored => Ok(None),
        Kind::Unknown => Err("unknown event type"),
    }
}

fn stored(data: DataRead<'_>) -> Result<Option<EngineEvent>, &'static str> {
    let blocks = data.blocks.ok_or("stored without blocks")?;
    let parent = match data.parent {
        None | Some(Scalar::Null) => None,
        Some(v) => Some(block_hash(v).ok_or("bad parent hash")?),
    };
    if let Some(why) = blocks.error {
        return Err(why);
    }
    // Each block's salt is its own, else the event's; one event, one salt.
    let salt = match (blocks.own_salt, blocks.lacking) {
        (Some(own), true) if data.salt.as_ref() != Some(&own) => {
            return Err("blocks of one event carry different salts");
        }
        (Some(own), _) => Some(own),
        (None, _) => data.salt,
    };
    if blocks.hashes.is_empty() {
        return Ok(None);
    }
    // The salt is the only extra key TensorRT-LLM publishes; a non-string one is untrusted.
    let root_seed = if blocks.lora {
        None
    } else {
        match salt {
            None => namespace::root_seed(None, &[]),
            Some(Salt::Str(s)) => namespace::root_seed(None, &[ExtraKey::Str(s)]),
            Some(Salt::Other(_)) => None,
        }
    };
    let medium = if blocks.level.unwrap_or(0) == 0 {
        Medium::Device
    } else {
        Medium::Offload
    };
    Ok(Some(EngineEvent::Stored(StoredRun {
        parent,
        root_seed,
        engine_hashes: blocks.hashes,
        tokens: blocks.tokens,
        medium,
        // Checked above block by block against the model's: full blocks only.
        block_size: None,
        session_id: None,
    })))
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
    use serde_json::{Value, json};

    /// Reads and applies one event the way a poller and its sink do. `Err` = dropped.
    fn apply_event(idx: &KvIndex, w: &WorkerId, event: &Value) -> Result<(), &'static str> {
        let d = read_drain(idx.block_size(), format!("[{event}]").as_bytes())
            .map_err(|_| "not JSON")?;
        if d.malformed > 0 {
            return Err("dropped");
        }
        for ev in &d.events {
            engine_event::apply(idx, w, ev, &EventCounters::default())
                .map_err(|_| "not applied")?;
        }
        Ok(())
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

    /// The rules as the poller applied them before the typed reader, over a JSON tree of the
    /// event: the reader must answer every event the same way (below).
    fn reference(bs: usize, event: &Value) -> Result<Option<EngineEvent>, ()> {
        fn hash(v: &Value) -> Option<EngineBlockHash> {
            v.as_u64()
                .or_else(|| v.as_i64().map(|i| i as u64))
                .map(EngineBlockHash)
        }
        let data = event.get("data").ok_or(())?;
        match data.get("type").and_then(Value::as_str).ok_or(())? {
            "stored" => {}
            "removed" => {
                let hashes = data
                    .get("block_hashes")
                    .and_then(Value::as_array)
                    .ok_or(())?
                    .iter()
                    .map(hash)
                    .collect::<Option<Vec<_>>>()
                    .ok_or(())?;
                return Ok(Some(EngineEvent::Removed {
                    engine_hashes: hashes,
                    tiers: TIER_DEVICE | TIER_OFFLOAD,
                }));
            }
            "created" | "updated" => return Ok(None),
            _ => return Err(()),
        }
        let blocks = data.get("blocks").and_then(Value::as_array).ok_or(())?;
        let parent = match data.get("parent_hash") {
            None | Some(Value::Null) => None,
            Some(v) => Some(hash(v).ok_or(())?),
        };
        let event_salt = data.get("cache_salt").filter(|v| !v.is_null());
        let mut salts = std::collections::BTreeSet::new();
        let (mut lora, mut level) = (false, None);
        let (mut hashes, mut tokens) = (Vec::new(), Vec::new());
        for b in blocks {
            let toks = b.get("tokens").and_then(Value::as_array).ok_or(())?;
            if toks.len() > bs {
                return Err(());
            }
            if toks.len() < bs {
                break;
            }
            for t in toks {
                let id = t.get("token_id").and_then(Value::as_u64);
                tokens.push(id.and_then(|t| u32::try_from(t).ok()).ok_or(())?);
            }
            hashes.push(hash(b.get("block_hash").ok_or(())?).ok_or(())?);
            let salt = b.get("cache_salt").filter(|v| !v.is_null()).or(event_salt);
            salts.insert(salt.map(|s| s.to_string()));
            lora |= b
                .get("lora_id")
                .is_some_and(|l| !l.is_null() && l.as_u64() != Some(0));
            level = level.or(b.get("cache_level").and_then(Value::as_u64));
        }
        if salts.len() > 1 {
            return Err(());
        }
        if hashes.is_empty() {
            return Ok(None);
        }
        let salt = salts.into_iter().next().flatten();
        let root_seed = match (lora, salt) {
            (true, _) => None,
            (false, None) => namespace::root_seed(None, &[]),
            (false, Some(json)) => serde_json::from_str::<String>(&json)
                .ok()
                .and_then(|s| namespace::root_seed(None, &[ExtraKey::Str(s)])),
        };
        Ok(Some(EngineEvent::Stored(StoredRun {
            parent,
            root_seed,
            engine_hashes: hashes,
            tokens,
            medium: if level.unwrap_or(0) == 0 {
                Medium::Device
            } else {
                Medium::Offload
            },
            block_size: None,
            session_id: None,
        })))
    }

    /// The typed reader's answer for one event's text.
    fn read_one(bs: usize, text: &str) -> Result<Option<EngineEvent>, ()> {
        let d = read_drain(bs, format!("[{text}]").as_bytes()).expect("one JSON array");
        assert_eq!(d.read, 1);
        match (d.malformed, d.events.len()) {
            (1, 0) => Err(()),
            (0, n) => Ok(d.events.into_iter().next().filter(|_| n == 1)),
            other => panic!("{other:?}"),
        }
    }

    mod same_rules {
        use super::*;
        use proptest::prelude::*;

        fn any_value() -> impl Strategy<Value = Value> {
            prop_oneof![
                Just(Value::Null),
                any::<u64>().prop_map(|v| json!(v)),
                (0u64..4).prop_map(|v| json!(v)),
                (-3i64..0).prop_map(|v| json!(v)),
                Just(json!(0.5)),
                Just(json!(true)),
                prop::sample::select(vec!["stored", "x", "kvepp:a", ""]).prop_map(|s| json!(s)),
                Just(json!([1, 2])),
                Just(json!({"token_id": 1})),
            ]
        }

        fn salt() -> impl Strategy<Value = Value> {
            let fwd =
                Namespace::of(&CacheSalt::new("t", SaltSource::Body).unwrap().unwrap()).forwarded();
            let fwd2 =
                Namespace::of(&CacheSalt::new("u", SaltSource::Body).unwrap().unwrap()).forwarded();
            prop_oneof![
                Just(Value::Null),
                Just(json!(fwd)),
                Just(json!(fwd2)),
                Just(json!("raw")),
                Just(json!(7)),
                Just(json!({"k": [1]})),
            ]
        }

        fn token() -> impl Strategy<Value = Value> {
            prop_oneof![
                8 => (0u64..5).prop_map(|t| json!({"token_id": t, "token_extra_id": 0})),
                1 => Just(json!({"token_id": 1u64 << 32})),
                1 => Just(json!({"token_id": -1})),
                1 => Just(json!({"token_id": "1"})),
                1 => Just(json!({})),
                1 => Just(json!(3)),
            ]
        }

        /// An object of the given fields, each present or not.
        fn object(fields: Vec<(&'static str, Option<Value>)>) -> Value {
            Value::Object(
                fields
                    .into_iter()
                    .filter_map(|(k, v)| Some((k.to_string(), v?)))
                    .collect(),
            )
        }

        fn block() -> impl Strategy<Value = Value> {
            let tokens = prop_oneof![
                6 => prop::collection::vec(token(), 0..4).prop_map(Value::Array),
                1 => any_value(),
            ];
            let hash = prop_oneof![4 => (0u64..6).prop_map(|h| json!(h)), 1 => any_value()];
            let level = prop_oneof![Just(json!(0)), Just(json!(1)), any_value()];
            let lora = prop_oneof![Just(json!(0)), Just(Value::Null), any_value()];
            prop_oneof![
                12 => (
                    prop::option::weighted(0.95, tokens),
                    prop::option::weighted(0.95, hash),
                    prop::option::of(salt()),
                    prop::option::weighted(0.2, lora),
                    prop::option::of(level),
                )
                    .prop_map(|(t, h, s, l, c)| object(vec![
                        ("tokens", t),
                        ("block_hash", h),
                        ("cache_salt", s),
                        ("lora_id", l),
                        ("cache_level", c),
                        ("priority", Some(json!(35))),
                    ])),
                1 => any_value(),
            ]
        }

        fn event() -> impl Strategy<Value = Value> {
            let kind = prop_oneof![
                8 => Just(json!("stored")),
                3 => Just(json!("removed")),
                1 => Just(json!("created")),
                1 => Just(json!("nope")),
                1 => any_value(),
            ];
            let blocks = prop_oneof![
                8 => prop::collection::vec(block(), 0..5).prop_map(Value::Array),
                1 => any_value(),
            ];
            let hashes = prop_oneof![
                4 => prop::collection::vec(prop_oneof![4 => (0u64..6).prop_map(|h| json!(h)), 1 => any_value()], 0..4)
                    .prop_map(Value::Array),
                1 => any_value(),
            ];
            let parent = prop_oneof![(0u64..6).prop_map(|h| json!(h)), any_value()];
            let data = (
                prop::option::weighted(0.95, kind),
                prop::option::of(parent),
                prop::option::of(salt()),
                prop::option::weighted(0.9, blocks),
                prop::option::weighted(0.3, hashes),
            )
                .prop_map(|(k, p, s, b, h)| {
                    object(vec![
                        ("type", k),
                        ("parent_hash", p),
                        ("cache_salt", s),
                        ("blocks", b),
                        ("block_hashes", h),
                    ])
                });
            prop_oneof![
                12 => data.prop_map(|d| json!({"event_id": 1, "data": d})),
                1 => any_value(),
            ]
        }

        proptest! {
            #![proptest_config(ProptestConfig::with_cases(3000))]
            /// Every event is kept, ignored or dropped as the tree-based rules did, and a kept
            /// one decodes to the same event.
            #[test]
            fn the_typed_reader_applies_the_rules_of_the_tree(ev in event()) {
                let expected = reference(2, &ev);
                prop_assert_eq!(read_one(2, &ev.to_string()), expected.clone());
                // Spelled with whitespace everywhere.
                let pretty = serde_json::to_string_pretty(&ev).unwrap();
                prop_assert_eq!(read_one(2, &pretty), expected);
            }
        }
    }

    #[test]
    fn a_key_given_twice_is_read_as_its_last_value_as_a_tree_would() {
        let fwd =
            Namespace::of(&CacheSalt::new("t", SaltSource::Body).unwrap().unwrap()).forwarded();
        for text in [
            r#"{"data": {"type": "removed", "block_hashes": [1]}, "data": {"type": "removed", "block_hashes": [2, 3]}}"#,
            r#"{"data": {"type": "removed", "block_hashes": [1], "block_hashes": "x"}}"#,
            r#"{"data": {"type": "stored", "type": "removed", "block_hashes": [4]}}"#,
            r#"{"data": {"type": "stored", "blocks": [{"tokens": [{"token_id": 1}, {"token_id": 2}], "block_hash": 1}], "blocks": [{"tokens": [{"token_id": 3}, {"token_id": 4}], "block_hash": 2}]}}"#,
            r#"{"data": {"type": "stored", "blocks": [{"tokens": [{"token_id": 1}], "tokens": [{"token_id": 3}, {"token_id": 4}], "block_hash": 1, "block_hash": 5}]}}"#,
            r#"{"data": {"type": "stored", "blocks": [{"tokens": [{"token_id": 1}, {"token_id": 2}], "tokens": [{"token_id": 3}], "block_hash": 1}]}}"#,
            r#"{"data": {"type": "stored", "blocks": [{"tokens": [{"token_id": 1, "token_id": 9}, {"token_id": -1, "token_id": 2}], "block_hash": 1}]}}"#,
            &format!(
                r#"{{"data": {{"type": "stored", "cache_salt": "raw", "cache_salt": "{fwd}", "blocks": [{{"tokens": [{{"token_id": 1}}, {{"token_id": 2}}], "block_hash": 1, "cache_salt": null}}]}}}}"#
            ),
        ] {
            let tree: Value = serde_json::from_str(text).unwrap();
            assert_eq!(read_one(2, text), reference(2, &tree), "{text}");
        }
    }

    #[test]
    fn salts_are_compared_as_values_and_never_drop_the_drain() {
        // Non-string salts: one value spelled two ways is one salt (as in a tree), so the event
        // is kept, under an untrusted namespace.
        let spelled = r#"{"data": {"type": "stored", "cache_salt": {"a": 1.0, "b": [1]}, "blocks": [{"tokens": [{"token_id": 1}, {"token_id": 2}], "block_hash": 1, "cache_salt": {"b": [ 1 ], "a": 1e0}}, {"tokens": [{"token_id": 3}, {"token_id": 4}], "block_hash": 2}]}}"#;
        let tree: Value = serde_json::from_str(spelled).unwrap();
        assert_eq!(read_one(2, spelled), reference(2, &tree));
        assert!(matches!(
            read_one(2, spelled),
            Ok(Some(EngineEvent::Stored(StoredRun {
                root_seed: None,
                ..
            })))
        ));
        // A string salt that is not UTF-8 (a lone surrogate) is valid JSON: untrusted, and the
        // events around it are still read.
        let lone = r#"{"data": {"type": "stored", "blocks": [{"tokens": [{"token_id": 1}, {"token_id": 2}], "block_hash": 1, "cache_salt": "\udc00"}]}}"#;
        let removed = r#"{"data": {"type": "removed", "block_hashes": [1]}}"#;
        let d = read_drain(2, format!("[{lone}, {removed}]").as_bytes()).unwrap();
        assert_eq!((d.read, d.malformed, d.events.len()), (2, 0, 2));
        assert!(matches!(
            &d.events[0],
            EngineEvent::Stored(StoredRun {
                root_seed: None,
                ..
            })
        ));
    }

    #[test]
    fn an_event_is_capped_and_the_drain_kept_within_its_budget() {
        // More hashes than an event may carry: dropped, and the drain goes on.
        let many = format!(
            r#"[{{"data": {{"type": "removed", "block_hashes": [{}]}}}}, {{"data": {{"type": "removed", "block_hashes": [9]}}}}]"#,
            vec!["0"; MAX_BLOCKS_PER_EVENT + 1].join(",")
        );
        let d = read_drain(2, many.as_bytes()).unwrap();
        assert_eq!((d.read, d.malformed, d.events.len()), (2, 1, 1));
        let at_cap = many.replacen("0,", "", 1);
        assert_eq!(read_drain(2, at_cap.as_bytes()).unwrap().malformed, 0);
        // Each kept event costs EVENT_BYTES and its lists by capacity (a list of 1 to 4 hashes
        // has room for 4). A budget of three such events: the first two fit, the third (8
        // hashes) does not, a later one that fits in what is left is still kept.
        let small = EVENT_BYTES + 4 * 8;
        let body = r#"[{"data": {"type": "removed", "block_hashes": [1, 2]}},
            {"data": {"type": "removed", "block_hashes": [3, 4, 5]}},
            {"data": {"type": "removed", "block_hashes": [6, 7, 8, 9, 10, 11, 12, 13]}},
            {"data": {"type": "removed", "block_hashes": [14]}},
            {"data": {"type": "removed", "block_hashes": [15]}}]"#;
        let d = read_drain_within(2, body.as_bytes(), 3 * small).unwrap();
        assert_eq!((d.read, d.malformed, d.events.len()), (5, 2, 3));
        let kept: Vec<_> = d
            .events
            .iter()
            .map(|e| match e {
                EngineEvent::Removed { engine_hashes, .. } => engine_hashes[0].0,
                _ => 0,
            })
            .collect();
        assert_eq!(kept, [1, 3, 14]);
        // Tokens count too, and the drain's budget is its body's size (when over 1 MiB).
        let stored = r#"{"data": {"type": "stored", "blocks": [{"tokens": [{"token_id": 1}, {"token_id": 2}], "block_hash": 1}]}}"#;
        let body = format!("[{stored}, {stored}]");
        let one = read_drain_within(2, format!("[{stored}]").as_bytes(), usize::MAX).unwrap();
        let cost = kept_bytes(&one.events[0]);
        let d = read_drain_within(2, body.as_bytes(), 2 * cost - 1).unwrap();
        assert_eq!((d.read, d.malformed, d.events.len()), (2, 1, 1));
        let d = read_drain_within(2, body.as_bytes(), 2 * cost).unwrap();
        assert_eq!((d.read, d.malformed, d.events.len()), (2, 0, 2));
        let n = 2 * MIN_DRAIN_BUDGET / stored.len();
        let big = format!("[{}]", vec![stored; n].join(","));
        let d = read_drain(2, big.as_bytes()).unwrap();
        assert!(big.len() > MIN_DRAIN_BUDGET && cost * n > big.len());
        assert_eq!(
            d.events.len(),
            big.len() / cost,
            "kept within the body's size"
        );
    }
}
