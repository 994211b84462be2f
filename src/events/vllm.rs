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

/// Which engine's dialect of the vLLM-shaped ZeroMQ events a feed speaks. The framing and the
/// batch are the same; events differ in where the tenant salt is and how hashes are written.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Dialect {
    /// vLLM: the salt (tagged by kv-epp) in the first block's extra keys.
    #[default]
    Vllm,
    /// SGLang: the salt in the event itself, a trailing positional `metadata` map
    /// `{cache_salt, session_id}` (SGLang since #30827) or the `cache_salt` / `session_id` fields
    /// of a tagged map (since #37482); LoRA by `lora_id` only; signed 64-bit hashes.
    Sglang,
    /// TensorRT-LLM's ZeroMQ publisher: vLLM-shaped tagged maps with signed 64-bit hashes; a salt,
    /// when one is published, in the blocks' extra keys, under the drain's rule (one event, one
    /// salt).
    Trtllm,
}

/// Longest `session_id` kept; a longer one is decoded as absent (it is metadata, never a reason
/// to drop a store).
pub(crate) const MAX_SESSION_ID_BYTES: usize = 256;

/// A decoded `BlockStored`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Stored {
    /// The engine's hashes of the new blocks.
    pub block_hashes: Vec<EngineBlockHash>,
    /// The block before the first new one.
    pub parent: Option<EngineBlockHash>,
    /// The tokens of exactly these blocks.
    pub token_ids: Vec<u32>,
    /// Tokens per block, when the engine said (offload connectors may not, vLLM #36644).
    pub block_size: Option<usize>,
    /// The LoRA adapter, when set.
    pub lora_name: Option<String>,
    /// Whether the event names an adapter by id only (SGLang, TensorRT-LLM): its name, which the
    /// namespace needs, is then unknown.
    pub lora_id: bool,
    /// The storage medium (`GPU`, `CPU`, ...), when set.
    pub medium: Option<String>,
    /// `LOCAL` or `REMOTE` relative to the publisher, when set (vLLM).
    pub locality: Option<String>,
    /// The first block's extra keys (where vLLM's salt of a sequence start lives).
    pub first_extra_keys: Vec<ExtraKey>,
    /// The salt the event itself carries (SGLang); `Some("")` is unsalted, as SGLang reads it.
    pub cache_salt: Option<String>,
    /// The session that triggered the store, when the engine says (vLLM, SGLang).
    pub session_id: Option<String>,
    /// The KV-cache group (hybrid models); 0 when absent.
    pub group_idx: u32,
    /// Whether the group is a sliding window (`kv_cache_spec_sliding_window` set): its blocks do
    /// not hold whole prefixes.
    pub sliding_window: bool,
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
        /// `LOCAL` or `REMOTE`, when set.
        locality: Option<String>,
    },
    /// The engine's whole prefix cache was reset.
    AllCleared,
    /// An event type we do not know (ignored).
    Unknown,
}

/// What a decoded event becomes for the index.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Neutral {
    /// An event to apply.
    Event(EngineEvent),
    /// An event of a KV-cache group other than 0 (hybrid models): not indexed, counted.
    OtherGroup,
    /// An event type kv-epp does not know: ignored, counted.
    Unknown,
}

/// The tier a medium and a locality name: a block the publisher calls `REMOTE` is never device
/// cache of this worker, whatever its medium.
fn tier(medium: Option<&str>, locality: Option<&str>) -> Medium {
    if locality.is_some_and(|l| l.eq_ignore_ascii_case("remote")) {
        return Medium::Offload;
    }
    Medium::from_engine(medium)
}

impl Event {
    /// The engine-neutral form of this event, with `dialect`'s namespace rule run on a sequence
    /// start.
    pub(crate) fn into_neutral(self, dialect: Dialect) -> Neutral {
        match self {
            Event::Stored(st) => {
                if st.group_idx != 0 || st.sliding_window {
                    return Neutral::OtherGroup;
                }
                let root_seed = if st.parent.is_some() {
                    None // inherited from the parent inside the index
                } else {
                    match dialect {
                        Dialect::Vllm | Dialect::Trtllm if st.lora_id && st.lora_name.is_none() => {
                            None
                        }
                        Dialect::Vllm | Dialect::Trtllm => {
                            namespace::root_seed(st.lora_name.as_deref(), &st.first_extra_keys)
                        }
                        // The adapter's name is not in SGLang's event: its namespace is unknown.
                        Dialect::Sglang if st.lora_id => None,
                        Dialect::Sglang => match st.cache_salt {
                            Some(s) if !s.is_empty() => {
                                namespace::root_seed(None, &[ExtraKey::Str(s)])
                            }
                            _ => namespace::root_seed(None, &[]),
                        },
                    }
                };
                Neutral::Event(EngineEvent::Stored(StoredRun {
                    parent: st.parent,
                    root_seed,
                    engine_hashes: st.block_hashes,
                    tokens: st.token_ids,
                    medium: tier(st.medium.as_deref(), st.locality.as_deref()),
                    block_size: st.block_size,
                    session_id: st.session_id,
                }))
            }
            Event::Removed {
                block_hashes,
                medium,
                group_idx,
                locality,
            } => {
                if group_idx != 0 {
                    return Neutral::OtherGroup;
                }
                Neutral::Event(EngineEvent::Removed {
                    engine_hashes: block_hashes,
                    tiers: kv_epp_core::engine_event::tier_bit(tier(
                        medium.as_deref(),
                        locality.as_deref(),
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
    dialect: Dialect,
}

impl Iterator for Events<'_> {
    type Item = Result<Event, DecodeError>;

    fn next(&mut self) -> Option<Self::Item> {
        self.left = self.left.checked_sub(1)?;
        let mut tokens = Vec::new();
        Some(match split_event(&mut self.rd, &mut tokens) {
            Ok((tag, fields)) => decode_event(self.dialect, tag, &fields, tokens),
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
    decode_batch_as(payload, Dialect::Vllm)
}

/// [`decode_batch`] for an engine's [`Dialect`]: the same frame checks and caps; the events are
/// read as that engine writes them.
pub fn decode_batch_as(payload: &[u8], dialect: Dialect) -> Result<Batch<'_>, DecodeError> {
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
        dialect,
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

/// Positional fields read (after the tag): vLLM's `BlockStored` has fourteen known ones.
const POSITIONS: usize = 14;

/// vLLM's positional `BlockStored` fields, in order after the tag (`lookahead_token_ids`, the
/// 15th, is not read). TensorRT-LLM writes maps, but its field order is the same.
const VLLM_STORED: [&str; POSITIONS] = [
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
    "medium",
    "lora_name",
    "extra_keys",
    "group_idx",
    "kv_cache_spec_kind",
    "kv_cache_spec_sliding_window",
    "locality",
    "ownership",
    "session_id",
];
/// vLLM's positional `BlockRemoved` fields.
const VLLM_REMOVED: [&str; 5] = [
    "block_hashes",
    "medium",
    "group_idx",
    "locality",
    "ownership",
];
/// SGLang's positional `BlockStored` fields; `metadata` is present only on salted (or
/// session-attributed) stores (`BlockStoredWithMetadata`).
const SGLANG_STORED: [&str; 7] = [
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
    "medium",
    "metadata",
];
/// SGLang's positional `BlockRemoved` fields.
const SGLANG_REMOVED: [&str; 2] = ["block_hashes", "medium"];

/// Map keys read (besides `"type"`): every dialect's, by name.
const KEYS: [&str; 14] = [
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
    "medium",
    "lora_name",
    "extra_keys",
    "group_idx",
    "kv_cache_spec_sliding_window",
    "locality",
    "session_id",
    "cache_salt",
    "metadata",
];

/// The encoded values of one event's fields, over either layout, found in one pass.
enum Fields<'a> {
    /// Positional: by position after the tag.
    Array([Option<&'a [u8]>; POSITIONS]),
    /// Map: by name (one of [`KEYS`]); the first occurrence of a key wins.
    Map([Option<&'a [u8]>; KEYS.len()]),
}

impl<'a> Fields<'a> {
    /// The encoded field `name`: at its position in `order` (positional layout) or under its
    /// name (map); `None` when absent or nil.
    fn get(&self, order: &[&str], name: &str) -> Option<&'a [u8]> {
        let v = match self {
            Fields::Array(a) => order
                .iter()
                .position(|k| *k == name)
                .and_then(|i| a.get(i).copied().flatten()),
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

/// Position of `token_ids` after the tag in every dialect's positional `BlockStored`.
const TOKENS_POSITION: usize = 2;

/// Reads one event (the reader ends after it, whatever it holds): its encoded tag, if it is a
/// container that can have one, and the encoded values of the fields we read. The value where a
/// `BlockStored` keeps its token ids, when it is an array of them within the cap, is read into
/// `tokens` on the way (see [`Reader::value_u32s`]); empty otherwise.
fn split_event<'a>(
    rd: &mut Reader<'a>,
    tokens: &mut Vec<u32>,
) -> Result<(Option<&'a [u8]>, Fields<'a>), Malformed> {
    match rd.head()? {
        Head::Array(n) if n > 0 => {
            let tag = rd.value(MAX_DEPTH)?;
            let mut by_pos = [None; POSITIONS];
            for i in 1..n as usize {
                let v = if i - 1 == TOKENS_POSITION {
                    rd.value_u32s(MAX_DEPTH, MAX_TOKENS_PER_EVENT, tokens)?.0
                } else {
                    rd.value(MAX_DEPTH)?
                };
                if let Some(slot) = by_pos.get_mut(i - 1) {
                    *slot = Some(v);
                }
            }
            Ok((Some(tag), Fields::Array(by_pos)))
        }
        Head::Map(n) => {
            let mut tag = None;
            let mut by_name = [None; KEYS.len()];
            let mut tokens_seen = false;
            for _ in 0..n {
                let key = str_of(rd.value(MAX_DEPTH)?);
                let value = if key == Some("token_ids") && !tokens_seen {
                    tokens_seen = true;
                    rd.value_u32s(MAX_DEPTH, MAX_TOKENS_PER_EVENT, tokens)?.0
                } else {
                    rd.value(MAX_DEPTH)?
                };
                let Some(key) = key else { continue };
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

/// Decodes one event from its parts (see [`split_event`]) as `dialect` writes it.
fn decode_event(
    dialect: Dialect,
    tag: Option<&[u8]>,
    fields: &Fields<'_>,
    tokens: Vec<u32>,
) -> Result<Event, DecodeError> {
    match tag.and_then(str_of).ok_or(DecodeError::NoTag)? {
        "BlockStored" => stored(dialect, fields, tokens).map(Event::Stored),
        "BlockRemoved" => {
            let e = "BlockRemoved";
            let order: &[&str] = match dialect {
                Dialect::Sglang => &SGLANG_REMOVED,
                Dialect::Vllm | Dialect::Trtllm => &VLLM_REMOVED,
            };
            let f = |name| fields.get(order, name);
            Ok(Event::Removed {
                block_hashes: hashes(dialect, f("block_hashes"), e, "block_hashes")?,
                medium: opt_str(f("medium"), e, "medium")?,
                group_idx: opt_u32(f("group_idx"), e, "group_idx")?.unwrap_or(0),
                locality: lenient_str(f("locality")),
            })
        }
        "AllBlocksCleared" => Ok(Event::AllCleared),
        _ => Ok(Event::Unknown),
    }
}

/// A `BlockStored` from its fields; `tokens`: its token ids if [`split_event`] read them already
/// (empty: read them here).
fn stored(dialect: Dialect, fields: &Fields<'_>, tokens: Vec<u32>) -> Result<Stored, DecodeError> {
    let e = "BlockStored";
    let bad = |field| DecodeError::Field { event: e, field };
    let order: &[&str] = match dialect {
        Dialect::Sglang => &SGLANG_STORED,
        Dialect::Vllm | Dialect::Trtllm => &VLLM_STORED,
    };
    let f = |name| fields.get(order, name);
    let block_hashes = hashes(dialect, f("block_hashes"), e, "block_hashes")?;
    let parent = f("parent_block_hash")
        .map(|v| hash(dialect, head_of(v)?.0).ok_or(bad("parent_block_hash")))
        .transpose()?;
    let token_ids = if !tokens.is_empty() {
        tokens
    } else {
        let (head, mut rd) = head_of(f("token_ids").ok_or(bad("token_ids"))?)?;
        let Head::Array(n) = head else {
            return Err(bad("token_ids"));
        };
        let n = capped(n, MAX_TOKENS_PER_EVENT, "token_ids")?;
        let mut out = Vec::with_capacity(n);
        if !rd.u32s(n, &mut out)? {
            return Err(bad("token_ids"));
        }
        out
    };
    // Absent: an offload connector that did not say (vLLM #36644); the writer then takes the
    // model's block size only if the tokens prove it.
    let block_size = match f("block_size").map(head_of).transpose()? {
        None => None,
        Some((Head::Uint(b), _)) => Some(
            usize::try_from(b)
                .ok()
                .filter(|&b| b > 0 && b <= 1 << 20)
                .ok_or(bad("block_size"))?,
        ),
        Some(_) => return Err(bad("block_size")),
    };
    let lora_id = match f("lora_id").map(head_of).transpose()? {
        None => false,
        Some((Head::Uint(id), _)) => id != 0,
        Some(_) => return Err(bad("lora_id")),
    };
    let medium = opt_str(f("medium"), e, "medium")?;
    let lora_name = opt_str(f("lora_name"), e, "lora_name")?.filter(|l| !l.is_empty());
    let first_extra_keys = match dialect {
        Dialect::Vllm => first_block_keys(f("extra_keys"))?,
        Dialect::Trtllm => one_salt_keys(f("extra_keys"), lora_name.as_deref())?,
        Dialect::Sglang => Vec::new(),
    };
    let mut session_id = lenient_str(f("session_id"));
    let mut cache_salt = None;
    if dialect == Dialect::Sglang {
        let salt = opt_str(f("cache_salt"), e, "cache_salt")?;
        let (meta_salt, meta_session) = metadata(f("metadata"))?;
        // Both spellings in one event must agree: a salt is never guessed.
        cache_salt = match (salt, meta_salt) {
            (Some(a), Some(b)) if a != b => return Err(bad("cache_salt")),
            (a, b) => a.or(b),
        };
        session_id = session_id.or(meta_session);
    }
    let session_id = session_id.filter(|s| !s.is_empty() && s.len() <= MAX_SESSION_ID_BYTES);
    let group_idx = opt_u32(f("group_idx"), e, "group_idx")?.unwrap_or(0);
    Ok(Stored {
        block_hashes,
        parent,
        token_ids,
        block_size,
        lora_name,
        lora_id,
        medium,
        locality: lenient_str(f("locality")),
        first_extra_keys,
        cache_salt,
        session_id,
        group_idx,
        sliding_window: f("kv_cache_spec_sliding_window").is_some(),
    })
}

/// vLLM: the first block's extra keys (the only block whose keys carry a sequence's salt).
fn first_block_keys(v: Option<&[u8]>) -> Result<Vec<ExtraKey>, DecodeError> {
    let bad = || DecodeError::Field {
        event: "BlockStored",
        field: "extra_keys",
    };
    match v.map(head_of).transpose()? {
        None | Some((Head::Array(0), _)) => Ok(Vec::new()),
        Some((Head::Array(_), mut per_block)) => match per_block.head()? {
            Head::Nil => Ok(Vec::new()),
            Head::Array(n) => block_keys(&mut per_block, n),
            _ => Err(bad()),
        },
        Some(_) => Err(bad()),
    }
}

/// One block's `n` extra keys, from `rd` (positioned after the block's array head).
fn block_keys(rd: &mut Reader<'_>, n: u32) -> Result<Vec<ExtraKey>, DecodeError> {
    let n = capped(n, MAX_EXTRA_KEYS, "extra_keys")?;
    let mut keys = Vec::with_capacity(n);
    for _ in 0..n {
        let key = rd.value(MAX_DEPTH)?;
        keys.push(match Reader::new(key).head()? {
            Head::Str(s) => std::str::from_utf8(s)
                .map(|s| ExtraKey::Str(s.to_owned()))
                .unwrap_or(ExtraKey::Other),
            _ => ExtraKey::Other,
        });
    }
    Ok(keys)
}

/// The strings of one block's keys that could be a salt: all but a leading adapter name.
fn salt_strings<'k>(keys: &'k [ExtraKey], lora: Option<&str>) -> Vec<&'k str> {
    let mut strings: Vec<&str> = keys
        .iter()
        .filter_map(|k| match k {
            ExtraKey::Str(s) => Some(s.as_str()),
            ExtraKey::Other => None,
        })
        .collect();
    if lora.is_some() && strings.first().copied() == lora {
        strings.remove(0);
    }
    strings
}

/// TensorRT-LLM: the keys of every block, under the drain's rule: blocks of one event that carry
/// different salts drop the event (`Field`); otherwise the keys of the first block that carries
/// a salt stand for the event. Keys over all blocks are capped at `MAX_EXTRA_KEYS`.
fn one_salt_keys(v: Option<&[u8]>, lora: Option<&str>) -> Result<Vec<ExtraKey>, DecodeError> {
    let bad = || DecodeError::Field {
        event: "BlockStored",
        field: "extra_keys",
    };
    let Some((head, mut per_block)) = v.map(head_of).transpose()? else {
        return Ok(Vec::new());
    };
    let Head::Array(blocks) = head else {
        return Err(bad());
    };
    let mut chosen: Option<Vec<ExtraKey>> = None;
    let mut total = 0u32;
    for _ in 0..blocks {
        let keys = match per_block.head()? {
            Head::Nil => continue,
            Head::Array(n) => {
                total = total.saturating_add(n);
                capped(total, MAX_EXTRA_KEYS, "extra_keys")?;
                block_keys(&mut per_block, n)?
            }
            _ => return Err(bad()),
        };
        if salt_strings(&keys, lora).is_empty() {
            continue;
        }
        match &chosen {
            None => chosen = Some(keys),
            Some(first) if salt_strings(first, lora) == salt_strings(&keys, lora) => {}
            Some(_) => return Err(bad()),
        }
    }
    Ok(chosen.unwrap_or_default())
}

/// SGLang's `metadata` map: its `cache_salt` and `session_id` (other keys ignored).
fn metadata(v: Option<&[u8]>) -> Result<(Option<String>, Option<String>), DecodeError> {
    let e = "BlockStored";
    let Some(v) = v else {
        return Ok((None, None));
    };
    let (head, mut rd) = head_of(v)?;
    let Head::Map(n) = head else {
        return Err(DecodeError::Field {
            event: e,
            field: "metadata",
        });
    };
    let (mut salt, mut session) = (None, None);
    for _ in 0..n {
        let key = rd.value(MAX_DEPTH)?;
        let value = Some(rd.value(MAX_DEPTH)?).filter(|v| v.first() != Some(&NIL));
        match str_of(key) {
            Some("cache_salt") if salt.is_none() => salt = opt_str(value, e, "cache_salt")?,
            Some("session_id") if session.is_none() => session = lenient_str(value),
            _ => {}
        }
    }
    Ok((salt, session))
}

/// An optional string field that is never a reason to drop an event: anything but a UTF-8
/// string is absent.
fn lenient_str(v: Option<&[u8]>) -> Option<String> {
    v.and_then(str_of).map(str::to_owned)
}

/// An engine block hash: a u64 (never read as signed), or digest bytes folded to 64 bits.
/// SGLang and TensorRT-LLM write signed 64-bit integers: there a negative value is the same 64
/// bits (vLLM never writes one, so there it stays malformed).
fn hash(dialect: Dialect, v: Head<'_>) -> Option<EngineBlockHash> {
    match v {
        Head::Uint(u) => Some(EngineBlockHash(u)),
        Head::Neg(i) if dialect != Dialect::Vllm => Some(EngineBlockHash(i as u64)),
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
    dialect: Dialect,
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
        out.push(hash(dialect, rd.head()?).ok_or_else(bad)?);
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
                group_idx: 0,
                locality: None,
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
                block_size: Some(4),
                lora_name: None,
                lora_id: false,
                medium: Some("CPU".into()),
                locality: None,
                first_extra_keys: keys,
                cache_salt: None,
                session_id: None,
                group_idx,
                sliding_window: false,
            })
        };
        let seed_of = |ev: Event| match ev.into_neutral(Dialect::Vllm) {
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
            st(None, vec![tagged], 1).into_neutral(Dialect::Vllm),
            Neutral::OtherGroup
        );
        let rm = |medium: Option<&str>, group_idx| Event::Removed {
            block_hashes: vec![EngineBlockHash(2)],
            medium: medium.map(str::to_owned),
            group_idx,
            locality: None,
        };
        assert_eq!(
            rm(Some("GPU"), 0).into_neutral(Dialect::Vllm),
            Neutral::Event(EngineEvent::Removed {
                engine_hashes: vec![EngineBlockHash(2)],
                tiers: kv_epp_core::engine_event::TIER_DEVICE
            })
        );
        assert_eq!(
            rm(Some("CPU"), 0).into_neutral(Dialect::Vllm),
            Neutral::Event(EngineEvent::Removed {
                engine_hashes: vec![EngineBlockHash(2)],
                tiers: kv_epp_core::engine_event::TIER_OFFLOAD
            })
        );
        assert_eq!(rm(None, 2).into_neutral(Dialect::Vllm), Neutral::OtherGroup);
        assert_eq!(Event::Unknown.into_neutral(Dialect::Vllm), Neutral::Unknown);
        assert_eq!(
            Event::AllCleared.into_neutral(Dialect::Vllm),
            Neutral::Event(EngineEvent::Cleared)
        );
    }

    fn decode_as(payload: &[u8], dialect: Dialect) -> Vec<Result<Event, DecodeError>> {
        decode_batch_as(payload, dialect).unwrap().events.collect()
    }

    fn batch_of(events: Vec<Value>) -> Vec<u8> {
        enc(&Value::Array(vec![
            Value::F64(1.0),
            Value::Array(events),
            Value::Nil,
        ]))
    }

    fn map(pairs: Vec<(&str, Value)>) -> Value {
        Value::Map(pairs.into_iter().map(|(k, v)| (s(k), v)).collect())
    }

    fn run_of(ev: Result<Event, DecodeError>, dialect: Dialect) -> StoredRun {
        match ev.unwrap().into_neutral(dialect) {
            Neutral::Event(EngineEvent::Stored(run)) => run,
            other => panic!("{other:?}"),
        }
    }

    fn tokens4() -> Value {
        Value::Array((0..4).map(Value::from).collect())
    }

    #[test]
    fn newer_vllm_fields_are_accepted_and_used() {
        use kv_epp_core::hashing::HashSeed;
        let stored = |extra: Vec<(&str, Value)>| {
            let mut f = vec![
                ("type", s("BlockStored")),
                ("block_hashes", Value::Array(vec![Value::from(1)])),
                ("parent_block_hash", Value::Nil),
                ("token_ids", tokens4()),
                ("block_size", Value::from(4)),
                ("lora_id", Value::Nil),
                ("medium", s("GPU")),
                ("lora_name", Value::Nil),
            ];
            f.extend(extra);
            map(f)
        };
        let events = vec![
            // Every newer field, ownership of a shape nobody promised.
            stored(vec![
                ("kv_cache_spec_kind", s("full_attention")),
                ("locality", s("LOCAL")),
                ("ownership", Value::Array(vec![Value::from(1)])),
                ("session_id", s("sess-1")),
                ("lookahead_token_ids", Value::Nil),
            ]),
            // A block the publisher calls REMOTE is not this worker's device cache.
            stored(vec![("locality", s("REMOTE"))]),
            // A sliding-window group's blocks are not whole prefixes.
            stored(vec![("kv_cache_spec_sliding_window", Value::from(128))]),
            // An offload connector without block_size (vLLM #36644).
            map(vec![
                ("type", s("BlockStored")),
                ("block_hashes", Value::Array(vec![Value::from(2)])),
                ("parent_block_hash", Value::Nil),
                ("token_ids", tokens4()),
                ("lora_id", Value::Nil),
                ("medium", s("CPU")),
                ("lora_name", Value::Nil),
            ]),
            map(vec![
                ("type", s("BlockRemoved")),
                ("block_hashes", Value::Array(vec![Value::from(1)])),
                ("medium", s("GPU")),
                ("locality", s("REMOTE")),
                ("ownership", s("connector-x")),
            ]),
        ];
        let evs = decode_as(&batch_of(events), Dialect::Vllm);
        let mut evs = evs.into_iter();
        let first = run_of(evs.next().unwrap(), Dialect::Vllm);
        assert_eq!(
            (first.medium, first.session_id.as_deref(), first.root_seed),
            (Medium::Device, Some("sess-1"), Some(HashSeed::UNSALTED))
        );
        assert_eq!(
            run_of(evs.next().unwrap(), Dialect::Vllm).medium,
            Medium::Offload
        );
        assert_eq!(
            evs.next().unwrap().unwrap().into_neutral(Dialect::Vllm),
            Neutral::OtherGroup
        );
        let offload = run_of(evs.next().unwrap(), Dialect::Vllm);
        assert_eq!(
            (offload.medium, offload.block_size),
            (Medium::Offload, None)
        );
        assert_eq!(
            evs.next().unwrap().unwrap().into_neutral(Dialect::Vllm),
            Neutral::Event(EngineEvent::Removed {
                engine_hashes: vec![EngineBlockHash(1)],
                tiers: kv_epp_core::engine_event::TIER_OFFLOAD
            })
        );
        // The legacy array layout carries the same fields by position.
        let mut legacy = vec![
            s("BlockStored"),
            Value::Array(vec![Value::from(3)]),
            Value::Nil,
            tokens4(),
            Value::from(4),
            Value::Nil,
            s("GPU"),
            Value::Nil,
            Value::Nil,
            Value::from(0),
            s("full_attention"),
            Value::Nil,
            s("REMOTE"),
            Value::from(5),
            s("sess-2"),
        ];
        let run = run_of(
            decode_as(&batch_of(vec![Value::Array(legacy.clone())]), Dialect::Vllm).remove(0),
            Dialect::Vllm,
        );
        assert_eq!(
            (run.medium, run.session_id.as_deref()),
            (Medium::Offload, Some("sess-2"))
        );
        // An over-long session id is metadata dropped, never a dropped store.
        legacy[14] = s(&"x".repeat(MAX_SESSION_ID_BYTES + 1));
        let run = run_of(
            decode_as(&batch_of(vec![Value::Array(legacy)]), Dialect::Vllm).remove(0),
            Dialect::Vllm,
        );
        assert_eq!(run.session_id, None);
    }

    /// SGLang's salted store in both encodings, and its unsalted store, with `salt` forwarded by
    /// kv-epp (`kvepp:t`).
    fn sglang_events(salt: &str) -> Vec<Value> {
        let positional = |hash: u64, meta: Option<Value>| {
            let mut a = vec![
                s("BlockStored"),
                Value::Array(vec![Value::from(hash)]),
                Value::Nil,
                tokens4(),
                Value::from(4),
                Value::Nil,
                s("GPU"),
            ];
            a.extend(meta);
            Value::Array(a)
        };
        vec![
            positional(1, Some(map(vec![("cache_salt", s(salt))]))),
            positional(2, None),
            map(vec![
                ("type", s("BlockStored")),
                ("block_hashes", Value::Array(vec![Value::from(3)])),
                ("parent_block_hash", Value::Nil),
                ("token_ids", tokens4()),
                ("block_size", Value::from(4)),
                ("lora_id", Value::Nil),
                ("medium", s("CPU_PINNED")),
                ("cache_salt", s(salt)),
                ("session_id", s("agent-7")),
            ]),
            map(vec![
                ("type", s("BlockStored")),
                ("block_hashes", Value::Array(vec![Value::from(4)])),
                ("parent_block_hash", Value::Nil),
                ("token_ids", tokens4()),
                ("block_size", Value::from(4)),
                ("lora_id", Value::Nil),
                ("medium", s("GPU")),
                (
                    "metadata",
                    map(vec![("cache_salt", s(salt)), ("session_id", s("a"))]),
                ),
            ]),
            Value::Array(vec![
                s("BlockRemoved"),
                Value::Array(vec![Value::from(3)]),
                s("DISK"),
            ]),
        ]
    }

    #[test]
    fn sglang_salts_in_both_encodings_mixed_in_one_batch() {
        use kv_epp_core::hashing::HashSeed;
        let t = HashSeed::new(None, Some("t"));
        let evs = decode_as(&batch_of(sglang_events("kvepp:t")), Dialect::Sglang);
        let seeds: Vec<_> = evs[..4]
            .iter()
            .map(|e| run_of(e.clone(), Dialect::Sglang).root_seed)
            .collect();
        assert_eq!(
            seeds,
            vec![Some(t), Some(HashSeed::UNSALTED), Some(t), Some(t)]
        );
        let third = run_of(evs[2].clone(), Dialect::Sglang);
        assert_eq!(
            (third.medium, third.session_id.as_deref()),
            (Medium::Offload, Some("agent-7"))
        );
        assert_eq!(
            evs[4].clone().unwrap().into_neutral(Dialect::Sglang),
            Neutral::Event(EngineEvent::Removed {
                engine_hashes: vec![EngineBlockHash(3)],
                tiers: kv_epp_core::engine_event::TIER_OFFLOAD
            })
        );
        // A salt kv-epp did not forward, or an adapter known by id only: never trusted.
        let raw = decode_as(&batch_of(sglang_events("tenant-a")), Dialect::Sglang);
        assert_eq!(run_of(raw[0].clone(), Dialect::Sglang).root_seed, None);
        assert_eq!(run_of(raw[2].clone(), Dialect::Sglang).root_seed, None);
        // An empty salt is no salt, as SGLang reads it.
        let empty = decode_as(&batch_of(sglang_events("")), Dialect::Sglang);
        assert_eq!(
            run_of(empty[0].clone(), Dialect::Sglang).root_seed,
            Some(HashSeed::UNSALTED)
        );
        let Value::Array(mut with_lora) = sglang_events("kvepp:t").remove(0) else {
            unreachable!()
        };
        with_lora[5] = Value::from(3);
        let ev = decode_as(&batch_of(vec![Value::Array(with_lora)]), Dialect::Sglang).remove(0);
        assert_eq!(run_of(ev, Dialect::Sglang).root_seed, None);
        // Read as vLLM, SGLang's trailing metadata map is a malformed `lora_name`: dropped.
        let as_vllm = decode_as(&batch_of(sglang_events("kvepp:t")), Dialect::Vllm);
        assert!(matches!(
            as_vllm[0],
            Err(DecodeError::Field {
                field: "lora_name",
                ..
            })
        ));
    }

    #[test]
    fn sglang_hostile_salts_are_dropped_not_guessed() {
        let both = map(vec![
            ("type", s("BlockStored")),
            ("block_hashes", Value::Array(vec![Value::from(1)])),
            ("token_ids", tokens4()),
            ("block_size", Value::from(4)),
            ("cache_salt", s("kvepp:a")),
            ("metadata", map(vec![("cache_salt", s("kvepp:b"))])),
        ]);
        let not_a_string = map(vec![
            ("type", s("BlockStored")),
            ("block_hashes", Value::Array(vec![Value::from(1)])),
            ("token_ids", tokens4()),
            ("block_size", Value::from(4)),
            ("cache_salt", Value::from(7)),
        ]);
        let meta_not_a_map = Value::Array(vec![
            s("BlockStored"),
            Value::Array(vec![Value::from(1)]),
            Value::Nil,
            tokens4(),
            Value::from(4),
            Value::Nil,
            s("GPU"),
            s("kvepp:a"),
        ]);
        let evs = decode_as(
            &batch_of(vec![
                both,
                not_a_string,
                meta_not_a_map,
                Value::Array(vec![s("AllBlocksCleared")]),
            ]),
            Dialect::Sglang,
        );
        assert!(matches!(
            evs[0],
            Err(DecodeError::Field {
                field: "cache_salt",
                ..
            })
        ));
        assert!(matches!(
            evs[1],
            Err(DecodeError::Field {
                field: "cache_salt",
                ..
            })
        ));
        assert!(matches!(
            evs[2],
            Err(DecodeError::Field {
                field: "metadata",
                ..
            })
        ));
        assert_eq!(evs[3], Ok(Event::AllCleared));
    }

    #[test]
    fn trtllm_signed_hashes_and_one_salt_per_event() {
        use kv_epp_core::hashing::HashSeed;
        let stored = |keys: Value| {
            map(vec![
                ("type", s("BlockStored")),
                (
                    "block_hashes",
                    Value::Array(vec![Value::from(-5), Value::from(6)]),
                ),
                ("parent_block_hash", Value::from(i64::MIN)),
                ("token_ids", Value::Array((0..8).map(Value::from).collect())),
                ("block_size", Value::from(4)),
                ("lora_id", Value::Nil),
                ("medium", s("GPU")),
                ("lora_name", Value::Nil),
                ("extra_keys", keys),
            ])
        };
        let salted = |salt: &str| Value::Array(vec![s(salt)]);
        let evs = decode_as(
            &batch_of(vec![
                stored(Value::Nil),
                stored(Value::Array(vec![Value::Nil, salted("kvepp:t")])),
                stored(Value::Array(vec![salted("kvepp:t"), salted("kvepp:t")])),
                stored(Value::Array(vec![salted("kvepp:t"), salted("kvepp:u")])),
            ]),
            Dialect::Trtllm,
        );
        let run = run_of(evs[0].clone(), Dialect::Trtllm);
        assert_eq!(
            (run.engine_hashes.clone(), run.parent),
            (
                vec![EngineBlockHash(-5i64 as u64), EngineBlockHash(6)],
                Some(EngineBlockHash(i64::MIN as u64))
            )
        );
        // A continuation (it has a parent) inherits; as a start each would take the one salt.
        let mut first = evs[1].clone().unwrap();
        if let Event::Stored(st) = &mut first {
            st.parent = None;
        }
        assert_eq!(
            run_of(Ok(first), Dialect::Trtllm).root_seed,
            Some(HashSeed::new(None, Some("t")))
        );
        assert!(evs[2].is_ok());
        assert!(matches!(
            evs[3],
            Err(DecodeError::Field {
                field: "extra_keys",
                ..
            })
        ));
        // vLLM never writes negative hashes: read as vLLM they stay malformed.
        assert!(decode_as(&batch_of(vec![stored(Value::Nil)]), Dialect::Vllm)[0].is_err());
    }

    #[test]
    fn trtllm_extra_keys_are_capped_over_all_blocks() {
        // Two blocks of 3,000 nil keys each: under the cap per block, over it together.
        let keys = |n: usize| Value::Array(vec![Value::Nil; n]);
        let ev = |per_block: usize| {
            map(vec![
                ("type", s("BlockStored")),
                (
                    "block_hashes",
                    Value::Array(vec![Value::from(1), Value::from(2)]),
                ),
                ("token_ids", Value::Array((0..8).map(Value::from).collect())),
                ("block_size", Value::from(4)),
                (
                    "extra_keys",
                    Value::Array(vec![keys(per_block), keys(per_block)]),
                ),
            ])
        };
        let evs = decode_as(&batch_of(vec![ev(3_000), ev(2_000)]), Dialect::Trtllm);
        assert_eq!(
            evs[0],
            Err(DecodeError::TooMany {
                what: "extra_keys",
                limit: MAX_EXTRA_KEYS
            })
        );
        assert!(evs[1].is_ok());
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
            "cache_salt",
            "metadata",
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
            // Every engine's dialect reads the same bytes under the same caps.
            for dialect in [Dialect::Vllm, Dialect::Sglang, Dialect::Trtllm] {
                if let Ok(b) = decode_batch_as(&frame, dialect) {
                    let n = b.events.len();
                    let mut taken = 0;
                    for ev in b.events {
                        taken += 1;
                        if let Ok(ev) = ev {
                            let _ = ev.into_neutral(dialect);
                        }
                    }
                    prop_assert_eq!(taken, n);
                }
                let cut = cut.index(frame.len());
                prop_assert!(decode_batch_as(&frame[..cut], dialect).is_err());
                let mut corrupted = frame.clone();
                let at = flip.0.index(corrupted.len());
                corrupted[at] = flip.1;
                if let Ok(b) = decode_batch_as(&corrupted, dialect) {
                    for ev in b.events {
                        drop(ev);
                    }
                }
            }
        }
    }
}
