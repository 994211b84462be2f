//! Decoding vLLM's KV event batches (msgpack), both layouts, both hash forms, defensively.
//!
//! A batch is `[ts, [event...], data_parallel_rank?]`. An event is a tag-first array (legacy,
//! fields in declaration order, possibly shorter or longer than we know) or a map with `"type"`
//! (current, defaults omitted). Unknown fields and unknown event types are ignored; anything
//! malformed in an event drops that event (counted by the caller), never the subscriber.
//!
//! Memory is bounded by one event, never by the frame: [`decode_batch`] first walks the whole
//! frame without allocating (every claimed length checked against the bytes left, nesting
//! limited to `MAX_DEPTH`) to validate it and read `ts` and the rank, which comes after the
//! events; then [`Events`] decodes one event at a time, so the caller applies and drops each
//! before the next is built. Counts are capped before anything is allocated from them
//! (`MAX_EVENTS_PER_BATCH`, `MAX_BLOCKS_PER_EVENT`, `MAX_TOKENS_PER_EVENT`,
//! `MAX_EXTRA_KEYS`): over a cap, the batch or the event is rejected with
//! [`DecodeError::TooMany`]. One decoded event thus holds at most 4.6 MiB of ids (hashes,
//! tokens, keys) plus its strings, whatever the frame's size.
//!
//! [`Event::into_neutral`] turns a decoded event into kv-epp's engine-neutral
//! [`EngineEvent`]: only KV-cache group 0 (full attention) is indexed, other groups are
//! reported for counting; a sequence start's namespace is decided here, from its first block's
//! extra keys, by [`namespace::root_seed`]; a continuation inherits its parent's inside the
//! index.

use kv_epp_core::engine_event::{EngineEvent, StoredRun};
use kv_epp_core::index::{EngineBlockHash, Medium};
use kv_epp_core::namespace::{self, ExtraKey};

use super::msgpack::{Head, Malformed, Reader};

/// Deepest container nesting accepted in a frame. Real batches nest at most 6 deep (batch,
/// events, event, `extra_keys`, one block's keys, a multimodal `[id, offset]` pair); the limit
/// bounds the decoder's recursion, whatever a peer sends.
pub(crate) const MAX_DEPTH: usize = 16;

/// Most events in one batch; a larger batch is rejected whole. A batch is one engine step's
/// events (a store and a few removals per scheduled request; vLLM schedules at most
/// `max_num_seqs`, typically 256 to 1,024), so this leaves a wide margin. Events are decoded one
/// at a time, so this bounds the work one frame does under the feed's apply lock, not memory.
pub(crate) const MAX_EVENTS_PER_BATCH: usize = 65_536;

/// Most block hashes in one event (stored or removed); a larger event is rejected. 65,536
/// blocks are 1M tokens at vLLM's default block size of 16 (see `MAX_TOKENS_PER_EVENT`), and
/// 512 KiB decoded.
pub(crate) const MAX_BLOCKS_PER_EVENT: usize = 65_536;

/// Most token ids in one `BlockStored`; a larger event is rejected. An event carries the tokens
/// of the blocks one request filled in one engine step, bounded by the step's token budget
/// (`max_num_batched_tokens`, typically 2k to 16k) and in any case by the model's context
/// window; 2^20 covers the longest context windows served today (1M tokens), also for
/// sliding-window groups that carry more tokens than their blocks, and is 4 MiB decoded.
pub(crate) const MAX_TOKENS_PER_EVENT: usize = 1_048_576;

/// Most extra keys on the first block of a `BlockStored` (the only block whose keys are read);
/// a larger event is rejected. A block's keys are a LoRA name, a cache salt, prompt-embedding
/// digests and one entry per multimodal item overlapping the block (at most one per token), so
/// real blocks carry a handful; each decoded key costs 24 bytes however few bytes it took on the
/// wire, which is why this is capped at all.
pub(crate) const MAX_EXTRA_KEYS: usize = 4_096;

/// A decoded `BlockStored`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Stored {
    /// The engine's hashes of the new blocks.
    pub block_hashes: Vec<EngineBlockHash>,
    /// The block before the first new one.
    pub parent: Option<EngineBlockHash>,
    /// The tokens of exactly these blocks.
    pub token_ids: Vec<u32>,
    /// Tokens per block.
    pub block_size: usize,
    /// The LoRA adapter, when set.
    pub lora_name: Option<String>,
    /// The storage medium (`GPU`, `CPU`, ...), when set.
    pub medium: Option<String>,
    /// The first block's extra keys (where the salt of a sequence start lives).
    pub first_extra_keys: Vec<ExtraKey>,
    /// The KV-cache group (hybrid models); 0 when absent.
    pub group_idx: u32,
}

/// A decoded event.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Event {
    /// Blocks stored.
    Stored(Stored),
    /// Blocks removed from a medium.
    Removed {
        /// The engine's hashes.
        block_hashes: Vec<EngineBlockHash>,
        /// The medium, when set.
        medium: Option<String>,
        /// The KV-cache group; 0 when absent.
        group_idx: u32,
    },
    /// The engine's whole prefix cache was reset.
    AllCleared,
    /// An event type we do not know (ignored).
    Unknown,
}

/// What a decoded vLLM event becomes for the index.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Neutral {
    /// An event to apply.
    Event(EngineEvent),
    /// An event of a KV-cache group other than 0 (hybrid models): not indexed, counted.
    OtherGroup,
    /// An event type kv-epp does not know: ignored, counted.
    Unknown,
}

impl Event {
    /// The engine-neutral form of this event, with the namespace rule run on a sequence start.
    pub(crate) fn into_neutral(self) -> Neutral {
        match self {
            Event::Stored(st) => {
                if st.group_idx != 0 {
                    return Neutral::OtherGroup;
                }
                let root_seed = if st.parent.is_none() {
                    namespace::root_seed(st.lora_name.as_deref(), &st.first_extra_keys)
                } else {
                    None // inherited from the parent inside the index
                };
                Neutral::Event(EngineEvent::Stored(StoredRun {
                    parent: st.parent,
                    root_seed,
                    engine_hashes: st.block_hashes,
                    tokens: st.token_ids,
                    medium: Medium::from_engine(st.medium.as_deref()),
                    block_size: Some(st.block_size),
                }))
            }
            Event::Removed {
                block_hashes,
                medium,
                group_idx,
            } => {
                if group_idx != 0 {
                    return Neutral::OtherGroup;
                }
                Neutral::Event(EngineEvent::Removed {
                    engine_hashes: block_hashes,
                    tiers: kv_epp_core::engine_event::tier_bit(Medium::from_engine(
                        medium.as_deref(),
                    )),
                })
            }
            Event::AllCleared => Neutral::Event(EngineEvent::Cleared),
            Event::Unknown => Neutral::Unknown,
        }
    }
}

/// A batch whose frame has been validated; its events are decoded one at a time.
#[derive(Clone, Debug)]
pub struct Batch<'a> {
    /// The engine's timestamp.
    pub ts: f64,
    /// The data-parallel rank, when published.
    pub dp_rank: Option<u32>,
    /// The events, in order, decoded as they are taken.
    pub events: Events<'a>,
}

/// The events of a [`Batch`]: each item is one event, decoded when taken, or the reason it was
/// rejected (the next event is unaffected). Holds no decoded event between items.
#[derive(Clone, Debug)]
pub struct Events<'a> {
    rd: Reader<'a>,
    left: u32,
}

impl Iterator for Events<'_> {
    type Item = Result<Event, DecodeError>;

    fn next(&mut self) -> Option<Self::Item> {
        self.left = self.left.checked_sub(1)?;
        Some(match split_event(&mut self.rd) {
            Ok((tag, fields)) => decode_event(tag, &fields),
            Err(e) => {
                // Unreachable after `decode_batch` validated the frame; stop rather than guess.
                self.left = 0;
                Err(e.into())
            }
        })
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        (self.left as usize, Some(self.left as usize))
    }
}

impl ExactSizeIterator for Events<'_> {}

/// Why a payload or an event could not be decoded.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum DecodeError {
    /// Not msgpack: truncated, a length claim past the end, a reserved byte, or nested deeper
    /// than `MAX_DEPTH`.
    #[error("payload is not msgpack: {0}")]
    NotMsgpack(String),
    /// The payload is not `[ts, events, rank?]`.
    #[error("payload is not a [ts, events, rank] batch")]
    NotBatch,
    /// An event of a known type had a field of the wrong shape.
    #[error("{event}: field `{field}` is malformed")]
    Field {
        /// Event type.
        event: &'static str,
        /// Field name.
        field: &'static str,
    },
    /// Neither an array nor a map with a string tag.
    #[error("event has no type tag")]
    NoTag,
    /// A count over its cap: the batch is rejected (`events`), or the event (`block_hashes`,
    /// `token_ids`, `extra_keys`).
    #[error("more {what} than the cap of {limit}")]
    TooMany {
        /// What was counted.
        what: &'static str,
        /// The cap.
        limit: usize,
    },
}

impl From<Malformed> for DecodeError {
    fn from(e: Malformed) -> Self {
        DecodeError::NotMsgpack(e.to_string())
    }
}

/// Decodes the header of one payload frame and returns its events, to be decoded one at a time.
///
/// Cost: one pass over the frame that allocates nothing: it validates the frame whole (so a
/// truncated or hostile frame is one `Err` before any event is applied) and reaches the rank,
/// which follows the events. Each event is then decoded when taken, allocating only its own
/// fields.
///
/// Errors: [`DecodeError::NotMsgpack`] if the frame is not well-formed msgpack nested at most
/// `MAX_DEPTH` deep; [`DecodeError::NotBatch`] if it is not `[ts, [event...], rank?]`;
/// [`DecodeError::TooMany`] if it has more than `MAX_EVENTS_PER_BATCH` events.
pub fn decode_batch(payload: &[u8]) -> Result<Batch<'_>, DecodeError> {
    let mut rd = Reader::new(payload);
    // The batch is depth 1, so its items may nest MAX_DEPTH - 1 deep, and each event
    // MAX_DEPTH - 2.
    let items = match rd.head()? {
        Head::Array(n) if n >= 2 => n,
        _ => return Err(DecodeError::NotBatch),
    };
    let ts = match rd.head()? {
        Head::Float(f) => f,
        Head::Uint(u) => u as f64,
        Head::Neg(i) => i as f64,
        _ => return Err(DecodeError::NotBatch),
    };
    let Head::Array(count) = rd.head()? else {
        return Err(DecodeError::NotBatch);
    };
    capped(count, MAX_EVENTS_PER_BATCH, "events")?;
    let events = Events {
        rd: rd.clone(),
        left: count,
    };
    for _ in 0..count {
        rd.skip(MAX_DEPTH - 2)?;
    }
    let mut dp_rank = None;
    for i in 2..items {
        let item = rd.value(MAX_DEPTH - 1)?;
        if i == 2
            && let Ok((Head::Uint(r), _)) = head_of(item)
        {
            dp_rank = u32::try_from(r).ok();
        }
    }
    Ok(Batch {
        ts,
        dp_rank,
        events,
    })
}

/// `n` as a length, if it is within `limit`.
fn capped(n: u32, limit: usize, what: &'static str) -> Result<usize, DecodeError> {
    usize::try_from(n)
        .ok()
        .filter(|&n| n <= limit)
        .ok_or(DecodeError::TooMany { what, limit })
}

/// Legacy positions read (after the tag): `BlockStored` has nine known fields.
const POSITIONS: usize = 9;

/// Map keys read (besides `"type"`).
const KEYS: [&str; 8] = [
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "medium",
    "lora_name",
    "extra_keys",
    "group_idx",
];

/// The encoded values of one event's fields, over either layout, found in one pass.
enum Fields<'a> {
    /// Legacy: by position after the tag.
    Array([Option<&'a [u8]>; POSITIONS]),
    /// Current: by name (one of [`KEYS`]); the first occurrence of a key wins.
    Map([Option<&'a [u8]>; KEYS.len()]),
}

impl<'a> Fields<'a> {
    /// The encoded field at `pos` (legacy array, after the tag) or named `name` (map); `None`
    /// when absent or nil.
    fn get(&self, pos: usize, name: &str) -> Option<&'a [u8]> {
        let v = match self {
            Fields::Array(a) => a.get(pos).copied().flatten(),
            Fields::Map(m) => {
                debug_assert!(KEYS.contains(&name), "{name} is not read from maps");
                KEYS.iter().position(|k| *k == name).and_then(|i| m[i])
            }
        };
        v.filter(|v| v.first() != Some(&NIL))
    }
}

/// msgpack's `nil`.
const NIL: u8 = 0xc0;

/// Reads one event (the reader ends after it, whatever it holds): its encoded tag, if it is a
/// container that can have one, and the encoded values of the fields we read.
fn split_event<'a>(rd: &mut Reader<'a>) -> Result<(Option<&'a [u8]>, Fields<'a>), Malformed> {
    match rd.head()? {
        Head::Array(n) if n > 0 => {
            let tag = rd.value(MAX_DEPTH)?;
            let mut by_pos = [None; POSITIONS];
            for i in 1..n as usize {
                let v = rd.value(MAX_DEPTH)?;
                if let Some(slot) = by_pos.get_mut(i - 1) {
                    *slot = Some(v);
                }
            }
            Ok((Some(tag), Fields::Array(by_pos)))
        }
        Head::Map(n) => {
            let mut tag = None;
            let mut by_name = [None; KEYS.len()];
            for _ in 0..n {
                let key = rd.value(MAX_DEPTH)?;
                let value = rd.value(MAX_DEPTH)?;
                let Some(key) = str_of(key) else { continue };
                if key == "type" {
                    tag.get_or_insert(value);
                } else if let Some(i) = KEYS.iter().position(|k| *k == key) {
                    by_name[i].get_or_insert(value);
                }
            }
            Ok((tag, Fields::Map(by_name)))
        }
        head => {
            rd.skip_elements(head, MAX_DEPTH)?;
            Ok((None, Fields::Array([None; POSITIONS])))
        }
    }
}

/// The encoded value as a UTF-8 string, if it is one.
fn str_of(v: &[u8]) -> Option<&str> {
    match Reader::new(v).head() {
        Ok(Head::Str(s)) => std::str::from_utf8(s).ok(),
        _ => None,
    }
}

/// The head of an encoded value.
fn head_of(v: &[u8]) -> Result<(Head<'_>, Reader<'_>), DecodeError> {
    let mut rd = Reader::new(v);
    Ok((rd.head()?, rd))
}

/// Decodes one event from its parts (see [`split_event`]).
fn decode_event(tag: Option<&[u8]>, fields: &Fields<'_>) -> Result<Event, DecodeError> {
    match tag.and_then(str_of).ok_or(DecodeError::NoTag)? {
        "BlockStored" => stored(fields).map(Event::Stored),
        "BlockRemoved" => {
            let e = "BlockRemoved";
            Ok(Event::Removed {
                block_hashes: hashes(fields.get(0, "block_hashes"), e, "block_hashes")?,
                medium: opt_str(fields.get(1, "medium"), e, "medium")?,
                group_idx: opt_u32(fields.get(2, "group_idx"), e, "group_idx")?.unwrap_or(0),
            })
        }
        "AllBlocksCleared" => Ok(Event::AllCleared),
        _ => Ok(Event::Unknown),
    }
}

fn stored(f: &Fields<'_>) -> Result<Stored, DecodeError> {
    let e = "BlockStored";
    let bad = |field| DecodeError::Field { event: e, field };
    let block_hashes = hashes(f.get(0, "block_hashes"), e, "block_hashes")?;
    let parent = f
        .get(1, "parent_block_hash")
        .map(|v| hash(head_of(v)?.0).ok_or(bad("parent_block_hash")))
        .transpose()?;
    let token_ids = {
        let (head, mut rd) = head_of(f.get(2, "token_ids").ok_or(bad("token_ids"))?)?;
        let Head::Array(n) = head else {
            return Err(bad("token_ids"));
        };
        let n = capped(n, MAX_TOKENS_PER_EVENT, "token_ids")?;
        let mut out = Vec::with_capacity(n);
        for _ in 0..n {
            match rd.head()? {
                Head::Uint(t) => out.push(u32::try_from(t).map_err(|_| bad("token_ids"))?),
                _ => return Err(bad("token_ids")),
            }
        }
        out
    };
    let block_size = match f.get(3, "block_size").map(head_of).transpose()? {
        Some((Head::Uint(b), _)) => usize::try_from(b)
            .ok()
            .filter(|&b| b > 0 && b <= 1 << 20)
            .ok_or(bad("block_size"))?,
        _ => return Err(bad("block_size")),
    };
    // Position 4 is the deprecated integer `lora_id`.
    let medium = opt_str(f.get(5, "medium"), e, "medium")?;
    let lora_name = opt_str(f.get(6, "lora_name"), e, "lora_name")?.filter(|l| !l.is_empty());
    let first_extra_keys = match f.get(7, "extra_keys").map(head_of).transpose()? {
        None | Some((Head::Array(0), _)) => Vec::new(),
        Some((Head::Array(_), mut per_block)) => match per_block.head()? {
            Head::Nil => Vec::new(),
            Head::Array(n) => {
                let n = capped(n, MAX_EXTRA_KEYS, "extra_keys")?;
                let mut keys = Vec::with_capacity(n);
                for _ in 0..n {
                    let key = per_block.value(MAX_DEPTH)?;
                    keys.push(match Reader::new(key).head()? {
                        Head::Str(s) => std::str::from_utf8(s)
                            .map(|s| ExtraKey::Str(s.to_owned()))
                            .unwrap_or(ExtraKey::Other),
                        _ => ExtraKey::Other,
                    });
                }
                keys
            }
            _ => return Err(bad("extra_keys")),
        },
        Some(_) => return Err(bad("extra_keys")),
    };
    let group_idx = opt_u32(f.get(8, "group_idx"), e, "group_idx")?.unwrap_or(0);
    Ok(Stored {
        block_hashes,
        parent,
        token_ids,
        block_size,
        lora_name,
        medium,
        first_extra_keys,
        group_idx,
    })
}

/// An engine block hash: a u64 (never read as signed), or digest bytes folded to 64 bits.
fn hash(v: Head<'_>) -> Option<EngineBlockHash> {
    match v {
        Head::Uint(u) => Some(EngineBlockHash(u)),
        Head::Bin(b) if !b.is_empty() => Some(EngineBlockHash(fold(b))),
        _ => None,
    }
}

/// Folds a digest of any length to 64 bits (the engine's hashes are opaque identifiers; a
/// collision needs 2^32 blocks on one worker to become likely).
pub(crate) fn fold(bytes: &[u8]) -> u64 {
    xxhash_rust::xxh3::xxh3_64(bytes)
}

fn hashes(
    v: Option<&[u8]>,
    event: &'static str,
    field: &'static str,
) -> Result<Vec<EngineBlockHash>, DecodeError> {
    let bad = || DecodeError::Field { event, field };
    let (head, mut rd) = head_of(v.ok_or_else(bad)?)?;
    let Head::Array(n) = head else {
        return Err(bad());
    };
    let n = capped(n, MAX_BLOCKS_PER_EVENT, "block_hashes")?;
    let mut out = Vec::with_capacity(n);
    for _ in 0..n {
        out.push(hash(rd.head()?).ok_or_else(bad)?);
    }
    Ok(out)
}

fn opt_str(
    v: Option<&[u8]>,
    event: &'static str,
    field: &'static str,
) -> Result<Option<String>, DecodeError> {
    match v.map(head_of).transpose()? {
        None => Ok(None),
        // Not UTF-8: as if unset, like an absent value.
        Some((Head::Str(s), _)) => Ok(std::str::from_utf8(s).ok().map(str::to_owned)),
        Some(_) => Err(DecodeError::Field { event, field }),
    }
}

fn opt_u32(
    v: Option<&[u8]>,
    event: &'static str,
    field: &'static str,
) -> Result<Option<u32>, DecodeError> {
    match v.map(head_of).transpose()? {
        None => Ok(None),
        Some((Head::Uint(n), _)) => u32::try_from(n)
            .map(Some)
            .map_err(|_| DecodeError::Field { event, field }),
        Some(_) => Err(DecodeError::Field { event, field }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use rmpv::Value;
    use std::alloc::{GlobalAlloc, Layout, System};
    use std::cell::Cell;

    /// A batch decoded whole (tests only: the decoder itself never holds more than one event).
    #[derive(Debug)]
    struct All {
        ts: f64,
        dp_rank: Option<u32>,
        events: Vec<Result<Event, DecodeError>>,
    }

    fn decode_all(payload: &[u8]) -> Result<All, DecodeError> {
        let b = decode_batch(payload)?;
        Ok(All {
            ts: b.ts,
            dp_rank: b.dp_rank,
            events: b.events.collect(),
        })
    }

    fn enc(v: &Value) -> Vec<u8> {
        let mut out = Vec::new();
        rmpv::encode::write_value(&mut out, v).unwrap();
        out
    }

    fn s(x: &str) -> Value {
        Value::from(x)
    }

    fn legacy_stored(hashes: Vec<Value>, parent: Value, tokens: Vec<u32>) -> Value {
        Value::Array(vec![
            s("BlockStored"),
            Value::Array(hashes),
            parent,
            Value::Array(tokens.into_iter().map(Value::from).collect()),
            Value::from(4),
            Value::Nil,
            s("GPU"),
            Value::Nil,
            Value::Array(vec![Value::Array(vec![s("kvepp:t")]), Value::Nil]),
            Value::from(0),
            s("future-field"),
        ])
    }

    #[test]
    fn legacy_layout_with_u64_hashes_above_i64() {
        let big = u64::MAX - 3;
        let batch = Value::Array(vec![
            Value::F64(1.5),
            Value::Array(vec![
                legacy_stored(
                    vec![Value::from(big), Value::from(7u64)],
                    Value::Nil,
                    (0..8).collect(),
                ),
                Value::Array(vec![
                    s("BlockRemoved"),
                    Value::Array(vec![Value::from(7u64)]),
                    s("CPU"),
                ]),
                Value::Array(vec![s("AllBlocksCleared")]),
                Value::Array(vec![s("SomethingNew"), Value::from(1)]),
            ]),
            Value::from(2),
        ]);
        let b = decode_all(&enc(&batch)).unwrap();
        assert_eq!(b.dp_rank, Some(2));
        let Ok(Event::Stored(st)) = &b.events[0] else {
            panic!("{:?}", b.events[0])
        };
        assert_eq!(
            st.block_hashes,
            vec![EngineBlockHash(big), EngineBlockHash(7)]
        );
        assert_eq!(st.parent, None);
        assert_eq!(st.token_ids.len(), 8);
        assert_eq!(st.medium.as_deref(), Some("GPU"));
        assert_eq!(st.first_extra_keys, vec![ExtraKey::Str("kvepp:t".into())]);
        assert_eq!(
            b.events[1],
            Ok(Event::Removed {
                block_hashes: vec![EngineBlockHash(7)],
                medium: Some("CPU".into()),
                group_idx: 0
            })
        );
        assert_eq!(b.events[2], Ok(Event::AllCleared));
        assert_eq!(b.events[3], Ok(Event::Unknown));
    }

    #[test]
    fn map_layout_with_byte_hashes_and_omitted_defaults() {
        let digest = Value::Binary(vec![9u8; 32]);
        let ev = Value::Map(vec![
            (s("type"), s("BlockStored")),
            (s("block_hashes"), Value::Array(vec![digest.clone()])),
            (s("parent_block_hash"), Value::Binary(vec![1u8; 32])),
            (
                s("token_ids"),
                Value::Array((0..4).map(Value::from).collect()),
            ),
            (s("block_size"), Value::from(4)),
            (s("lora_name"), s("ad")),
            (
                s("extra_keys"),
                Value::Array(vec![Value::Array(vec![
                    s("ad"),
                    Value::Array(vec![s("mm"), Value::from(0)]),
                ])]),
            ),
            (s("unknown_key"), Value::from(true)),
        ]);
        let batch = Value::Array(vec![Value::F64(0.0), Value::Array(vec![ev]), Value::Nil]);
        let b = decode_all(&enc(&batch)).unwrap();
        assert_eq!(b.dp_rank, None);
        let Ok(Event::Stored(st)) = &b.events[0] else {
            panic!()
        };
        assert_eq!(st.block_hashes, vec![EngineBlockHash(fold(&[9u8; 32]))]);
        assert_eq!(st.parent, Some(EngineBlockHash(fold(&[1u8; 32]))));
        assert_eq!(st.lora_name.as_deref(), Some("ad"));
        assert_eq!(st.medium, None);
        assert_eq!(
            st.first_extra_keys,
            vec![ExtraKey::Str("ad".into()), ExtraKey::Other]
        );
    }

    #[test]
    fn malformed_events_are_rejected_one_by_one() {
        let bad_tokens = legacy_stored(vec![Value::from(1u64)], Value::Nil, vec![]);
        let Value::Array(mut a) = bad_tokens else {
            unreachable!()
        };
        a[3] = Value::Array(vec![Value::from(1u64 << 40)]);
        let negative = Value::Array(vec![s("BlockRemoved"), Value::Array(vec![Value::from(-5)])]);
        let batch = Value::Array(vec![
            Value::F64(0.0),
            Value::Array(vec![
                Value::Array(a),
                negative,
                Value::from(3),
                Value::Array(vec![s("AllBlocksCleared")]),
            ]),
        ]);
        let b = decode_all(&enc(&batch)).unwrap();
        assert!(matches!(
            b.events[0],
            Err(DecodeError::Field {
                field: "token_ids",
                ..
            })
        ));
        assert!(matches!(
            b.events[1],
            Err(DecodeError::Field {
                field: "block_hashes",
                ..
            })
        ));
        assert_eq!(b.events[2], Err(DecodeError::NoTag));
        assert_eq!(b.events[3], Ok(Event::AllCleared));
        assert!(decode_all(b"\xc1garbage").is_err());
        assert!(decode_all(&enc(&Value::from(3))).is_err());
        // Deep nesting is refused, not recursed into.
        let mut deep = Value::Nil;
        for _ in 0..100 {
            deep = Value::Array(vec![deep]);
        }
        assert!(decode_all(&enc(&deep)).is_err());
    }

    #[test]
    fn neutral_form_runs_the_namespace_rule_and_skips_other_groups() {
        use kv_epp_core::hashing::HashSeed;
        let st = |parent: Option<u64>, keys: Vec<ExtraKey>, group_idx| {
            Event::Stored(Stored {
                block_hashes: vec![EngineBlockHash(2)],
                parent: parent.map(EngineBlockHash),
                token_ids: vec![1, 2, 3, 4],
                block_size: 4,
                lora_name: None,
                medium: Some("CPU".into()),
                first_extra_keys: keys,
                group_idx,
            })
        };
        let seed_of = |ev: Event| match ev.into_neutral() {
            Neutral::Event(EngineEvent::Stored(run)) => {
                assert_eq!((run.medium, run.block_size), (Medium::Offload, Some(4)));
                run.root_seed
            }
            other => panic!("{other:?}"),
        };
        let tagged = ExtraKey::Str("kvepp:t".into());
        assert_eq!(
            seed_of(st(None, vec![tagged.clone()], 0)),
            Some(HashSeed::new(None, Some("t")))
        );
        assert_eq!(seed_of(st(None, vec![ExtraKey::Str("t".into())], 0)), None);
        // A continuation carries no namespace of its own, whatever its keys say.
        assert_eq!(seed_of(st(Some(1), vec![tagged.clone()], 0)), None);
        assert_eq!(
            st(None, vec![tagged], 1).into_neutral(),
            Neutral::OtherGroup
        );
        let rm = |medium: Option<&str>, group_idx| Event::Removed {
            block_hashes: vec![EngineBlockHash(2)],
            medium: medium.map(str::to_owned),
            group_idx,
        };
        assert_eq!(
            rm(Some("GPU"), 0).into_neutral(),
            Neutral::Event(EngineEvent::Removed {
                engine_hashes: vec![EngineBlockHash(2)],
                tiers: kv_epp_core::engine_event::TIER_DEVICE
            })
        );
        assert_eq!(
            rm(Some("CPU"), 0).into_neutral(),
            Neutral::Event(EngineEvent::Removed {
                engine_hashes: vec![EngineBlockHash(2)],
                tiers: kv_epp_core::engine_event::TIER_OFFLOAD
            })
        );
        assert_eq!(rm(None, 2).into_neutral(), Neutral::OtherGroup);
        assert_eq!(Event::Unknown.into_neutral(), Neutral::Unknown);
        assert_eq!(
            Event::AllCleared.into_neutral(),
            Neutral::Event(EngineEvent::Cleared)
        );
    }

    /// Counts the bytes each thread allocates, so a test can show that a rejected length claim
    /// allocated nothing in proportion to it. (This test binary's allocator: it only counts.)
    struct ThreadCounting;

    thread_local! {
        static ALLOCATED: Cell<usize> = const { Cell::new(0) };
    }

    fn count(bytes: usize) {
        let _ = ALLOCATED.try_with(|a| a.set(a.get() + bytes));
    }

    // SAFETY: forwards every call to the system allocator unchanged; counting allocates nothing.
    unsafe impl GlobalAlloc for ThreadCounting {
        unsafe fn alloc(&self, l: Layout) -> *mut u8 {
            count(l.size());
            // SAFETY: forwarded unchanged.
            unsafe { System.alloc(l) }
        }
        unsafe fn alloc_zeroed(&self, l: Layout) -> *mut u8 {
            count(l.size());
            // SAFETY: forwarded unchanged.
            unsafe { System.alloc_zeroed(l) }
        }
        unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
            // SAFETY: forwarded unchanged.
            unsafe { System.dealloc(p, l) }
        }
        unsafe fn realloc(&self, p: *mut u8, l: Layout, new: usize) -> *mut u8 {
            count(new);
            // SAFETY: forwarded unchanged.
            unsafe { System.realloc(p, l, new) }
        }
    }

    #[global_allocator]
    static ALLOC: ThreadCounting = ThreadCounting;

    /// `f`'s result and the bytes it allocated on this thread.
    fn allocated_by<R>(f: impl FnOnce() -> R) -> (R, usize) {
        let before = ALLOCATED.with(Cell::get);
        let r = f();
        (r, ALLOCATED.with(Cell::get) - before)
    }

    /// Raw msgpack, written piece by piece (for frames too big or too wrong for `Value`).
    #[derive(Default)]
    struct Raw(Vec<u8>);

    impl Raw {
        fn array(mut self, n: u32) -> Self {
            rmp::encode::write_array_len(&mut self.0, n).unwrap();
            self
        }
        fn map(mut self, n: u32) -> Self {
            rmp::encode::write_map_len(&mut self.0, n).unwrap();
            self
        }
        fn str(mut self, s: &str) -> Self {
            rmp::encode::write_str(&mut self.0, s).unwrap();
            self
        }
        fn uint(mut self, v: u64) -> Self {
            rmp::encode::write_uint(&mut self.0, v).unwrap();
            self
        }
        fn bytes(mut self, b: &[u8]) -> Self {
            self.0.extend_from_slice(b);
            self
        }
        /// `n` copies of one encoded byte (a fixint or nil).
        fn repeat(mut self, byte: u8, n: usize) -> Self {
            self.0.resize(self.0.len() + n, byte);
            self
        }
    }

    /// `[0.0, [events...], 0]`, from encoded events.
    fn raw_batch(events: &[Vec<u8>]) -> Vec<u8> {
        let mut b = Raw::default().array(3).bytes(&[0xcb; 1]).repeat(0, 8);
        b = b.array(events.len() as u32);
        for e in events {
            b = b.bytes(e);
        }
        b.uint(0).0
    }

    /// A map-layout `BlockStored` with `blocks` hashes, `tokens` token ids and `keys` extra keys
    /// on its first block.
    fn raw_stored(blocks: usize, tokens: usize, keys: usize) -> Vec<u8> {
        Raw::default()
            .map(5)
            .str("type")
            .str("BlockStored")
            .str("block_hashes")
            .array(blocks as u32)
            .repeat(0x05, blocks)
            .str("token_ids")
            .array(tokens as u32)
            .repeat(0x07, tokens)
            .str("block_size")
            .uint(16)
            .str("extra_keys")
            .array(1)
            .array(keys as u32)
            .repeat(0xc0, keys)
            .0
    }

    #[test]
    fn length_claims_past_the_end_are_rejected_without_allocating() {
        let claims: [&[u8]; 6] = [
            // array32 of 2^32-1 elements, in 10 bytes.
            b"\xdd\xff\xff\xff\xff\xc0\xc0\xc0\xc0\xc0",
            // map32 of 2^32-1 pairs.
            b"\xdf\xff\xff\xff\xff\xc0\xc0\xc0\xc0\xc0",
            // array16 of 65,535 elements in 3 bytes.
            b"\xdc\xff\xff",
            // A good header whose events array claims 2^32-1 events.
            b"\x93\xcb\0\0\0\0\0\0\0\0\xdd\xff\xff\xff\xff\xc0",
            // One event whose block_hashes claim 2^32-1 hashes.
            b"\x92\x00\x91\x92\xabBlockStored\xdd\xff\xff\xff\xff\x01",
            // str32 and bin32 of 4 GiB.
            b"\x92\x00\x92\xdb\xff\xff\xff\xff\xc6\xff\xff\xff\xff",
        ];
        for claim in claims {
            let (r, bytes) = allocated_by(|| decode_all(claim).map(|b| b.events.len()));
            assert!(
                matches!(r, Err(DecodeError::NotMsgpack(_))),
                "{claim:x?}: {r:?}"
            );
            // Only the error message: nothing in proportion to the claim.
            assert!(bytes < 256, "{claim:x?} allocated {bytes} bytes");
        }
    }

    #[test]
    fn junk_events_are_decoded_without_allocating() {
        let payload = Raw::default()
            .array(2)
            .uint(1)
            .array(MAX_EVENTS_PER_BATCH as u32)
            .repeat(0xc0, MAX_EVENTS_PER_BATCH)
            .0;
        let ((ts, rejected), bytes) = allocated_by(|| {
            let b = decode_batch(&payload).unwrap();
            (
                b.ts,
                b.events.filter(|e| *e == Err(DecodeError::NoTag)).count(),
            )
        });
        assert_eq!((ts, rejected, bytes), (1.0, MAX_EVENTS_PER_BATCH, 0));
    }

    #[test]
    fn nesting_deeper_than_max_depth_is_refused() {
        // batch, events, event: 3 containers; then arrays down to `depth` in an unknown field.
        let nested = |depth: usize| {
            let mut ev = Raw::default().array(2).str("SomethingNew");
            for _ in 3..depth {
                ev = ev.array(1);
            }
            raw_batch(&[ev.bytes(b"\xc0").0])
        };
        let ok = decode_all(&nested(MAX_DEPTH)).unwrap();
        assert_eq!(ok.events, vec![Ok(Event::Unknown)]);
        assert_eq!(
            decode_all(&nested(MAX_DEPTH + 1)).unwrap_err(),
            DecodeError::from(Malformed::TooDeep)
        );
        // Maps count as containers too.
        let mut deep = Raw::default();
        for _ in 0..=MAX_DEPTH {
            deep = deep.map(1).uint(0);
        }
        assert!(decode_all(&deep.bytes(b"\xc0").0).is_err());
    }

    #[test]
    fn caps_reject_the_batch_or_only_the_event() {
        let nils = |n: usize| vec![vec![0xc0]; n];
        assert_eq!(
            decode_all(&raw_batch(&nils(MAX_EVENTS_PER_BATCH)))
                .unwrap()
                .events
                .len(),
            MAX_EVENTS_PER_BATCH
        );
        assert_eq!(
            decode_all(&raw_batch(&nils(MAX_EVENTS_PER_BATCH + 1))).unwrap_err(),
            DecodeError::TooMany {
                what: "events",
                limit: MAX_EVENTS_PER_BATCH
            }
        );
        // A `BlockStored` with `n` of `what` (otherwise 1 block, 16 tokens, no keys).
        let with = |what: &str, n: usize| match what {
            "block_hashes" => raw_stored(n, 16, 0),
            "token_ids" => raw_stored(1, n, 0),
            _ => raw_stored(1, 16, n),
        };
        for (what, limit) in [
            ("block_hashes", MAX_BLOCKS_PER_EVENT),
            ("token_ids", MAX_TOKENS_PER_EVENT),
            ("extra_keys", MAX_EXTRA_KEYS),
        ] {
            let event = |n| with(what, n);
            let b = decode_all(&raw_batch(&[event(limit), event(limit + 1), event(1)])).unwrap();
            assert!(
                matches!(b.events[0], Ok(Event::Stored(_))),
                "{what} at the cap"
            );
            assert_eq!(b.events[1], Err(DecodeError::TooMany { what, limit }));
            assert!(matches!(b.events[2], Ok(Event::Stored(_))), "{what} after");
        }
        // The removal side shares the block cap.
        let removed = |n: usize| {
            Raw::default()
                .array(2)
                .str("BlockRemoved")
                .array(n as u32)
                .repeat(0x01, n)
                .0
        };
        let b = decode_all(&raw_batch(&[removed(MAX_BLOCKS_PER_EVENT + 1)])).unwrap();
        assert_eq!(
            b.events,
            vec![Err(DecodeError::TooMany {
                what: "block_hashes",
                limit: MAX_BLOCKS_PER_EVENT
            })]
        );
    }

    /// Both layouts, both hash forms, extra keys, an unknown type and a bad event.
    fn rich_batch() -> Vec<u8> {
        let map_event = Value::Map(vec![
            (s("type"), s("BlockStored")),
            (
                s("block_hashes"),
                Value::Array(vec![Value::Binary(vec![3; 32])]),
            ),
            (s("parent_block_hash"), Value::from(u64::MAX)),
            (
                s("token_ids"),
                Value::Array((0..4).map(Value::from).collect()),
            ),
            (s("block_size"), Value::from(4)),
            (s("medium"), s("CPU")),
            (s("group_idx"), Value::from(1)),
        ]);
        enc(&Value::Array(vec![
            Value::F64(2.5),
            Value::Array(vec![
                legacy_stored(vec![Value::from(1u64 << 63)], Value::Nil, (0..4).collect()),
                map_event,
                Value::Array(vec![s("BlockRemoved"), Value::Array(vec![Value::from(5)])]),
                Value::Map(vec![(s("type"), s("Other")), (Value::from(1), Value::Nil)]),
                Value::Array(vec![s("BlockStored"), s("not hashes")]),
                Value::Array(vec![s("AllBlocksCleared")]),
            ]),
            Value::from(1),
        ]))
    }

    #[test]
    fn every_truncation_of_a_good_batch_is_one_error() {
        let payload = rich_batch();
        let whole = decode_all(&payload).unwrap();
        assert_eq!(
            (whole.ts, whole.dp_rank, whole.events.len()),
            (2.5, Some(1), 6)
        );
        assert_eq!(
            whole.events.iter().filter(|e| e.is_err()).count(),
            1,
            "{:?}",
            whole.events
        );
        for cut in 0..payload.len() {
            assert!(
                matches!(decode_all(&payload[..cut]), Err(DecodeError::NotMsgpack(_))),
                "cut at {cut}"
            );
        }
    }

    #[test]
    fn a_malformed_event_between_good_ones_drops_only_itself() {
        let good = || Value::Array(vec![s("AllBlocksCleared")]);
        let bad = Value::Map(vec![
            (s("type"), s("BlockRemoved")),
            (s("block_hashes"), Value::Array(vec![Value::F64(1.0)])),
        ]);
        let batch = Value::Array(vec![
            Value::from(7),
            Value::Array(vec![good(), bad, good()]),
        ]);
        let b = decode_all(&enc(&batch)).unwrap();
        assert_eq!((b.ts, b.dp_rank), (7.0, None));
        assert_eq!(
            b.events,
            vec![
                Ok(Event::AllCleared),
                Err(DecodeError::Field {
                    event: "BlockRemoved",
                    field: "block_hashes"
                }),
                Ok(Event::AllCleared),
            ]
        );
    }

    /// Any msgpack value, with strings biased towards the names the decoder looks for.
    fn any_value() -> impl Strategy<Value = Value> {
        let names: Vec<&str> = [
            "type",
            "BlockStored",
            "BlockRemoved",
            "AllBlocksCleared",
            "kvepp:t",
        ]
        .into_iter()
        .chain(KEYS)
        .collect();
        let name = prop::sample::select(names);
        let leaf = prop_oneof![
            Just(Value::Nil),
            any::<bool>().prop_map(Value::from),
            (0u64..200).prop_map(Value::from),
            any::<u64>().prop_map(Value::from),
            any::<i64>().prop_map(Value::from),
            any::<f64>().prop_map(Value::F64),
            name.prop_map(Value::from),
            prop::collection::vec(any::<u8>(), 0..40).prop_map(Value::Binary),
        ];
        leaf.prop_recursive(5, 96, 10, |inner| {
            prop_oneof![
                prop::collection::vec(inner.clone(), 0..10).prop_map(Value::Array),
                prop::collection::vec((inner.clone(), inner), 0..10).prop_map(Value::Map),
            ]
        })
    }

    /// A frame: a batch of arbitrary and well-formed events, or any value at all.
    fn any_frame() -> impl Strategy<Value = Vec<u8>> {
        let event = prop_oneof![
            any_value(),
            (any::<u64>(), prop::collection::vec(0u32..200_000, 0..40))
                .prop_map(|(h, t)| { legacy_stored(vec![Value::from(h)], Value::Nil, t) }),
        ];
        prop_oneof![
            (prop::collection::vec(event, 0..12), any_value()).prop_map(|(events, rank)| {
                enc(&Value::Array(vec![
                    Value::F64(1.0),
                    Value::Array(events),
                    rank,
                ]))
            }),
            any_value().prop_map(|v| enc(&v)),
        ]
    }

    proptest! {
        /// Whatever the bytes, decoding returns (never panics), and a cut frame is one error.
        #[test]
        fn any_frame_cut_or_corrupted_decodes_without_panicking(
            frame in any_frame(),
            cut in any::<prop::sample::Index>(),
            flip in any::<(prop::sample::Index, u8)>(),
        ) {
            if let Ok(b) = decode_batch(&frame) {
                let n = b.events.len();
                prop_assert_eq!(b.events.count(), n);
            }
            let cut = cut.index(frame.len());
            prop_assert!(decode_batch(&frame[..cut]).is_err());
            let mut corrupted = frame.clone();
            let at = flip.0.index(corrupted.len());
            corrupted[at] = flip.1;
            if let Ok(b) = decode_batch(&corrupted) {
                for ev in b.events {
                    drop(ev);
                }
            }
        }
    }
}
