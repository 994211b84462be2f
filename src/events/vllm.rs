//! Decoding vLLM's KV event batches (msgpack), both layouts, both hash forms, defensively.
//!
//! A batch is `[ts, [event...], data_parallel_rank?]`. An event is a tag-first array (legacy,
//! fields in declaration order, possibly shorter or longer than we know) or a map with `"type"`
//! (current, defaults omitted). Unknown fields and unknown event types are ignored; anything
//! malformed in an event drops that event (counted by the caller), never the subscriber.
//!
//! [`Event::into_neutral`] turns a decoded event into kv-epp's engine-neutral
//! [`EngineEvent`]: only KV-cache group 0 (full attention) is indexed, other groups are
//! reported for counting; a sequence start's namespace is decided here, from its first block's
//! extra keys, by [`namespace::root_seed`]; a continuation inherits its parent's inside the
//! index.

use rmpv::Value;

use kv_epp_core::engine_event::{EngineEvent, StoredRun};
use kv_epp_core::index::{EngineBlockHash, Medium};
use kv_epp_core::namespace::{self, ExtraKey};

/// Deepest msgpack nesting accepted (real batches nest 4 levels).
const MAX_DEPTH: usize = 16;

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

/// A decoded batch: every event, each decoded or rejected on its own.
#[derive(Clone, Debug, PartialEq)]
pub struct Batch {
    /// The engine's timestamp.
    pub ts: f64,
    /// Events in order; `Err` for an event that could not be decoded.
    pub events: Vec<Result<Event, DecodeError>>,
    /// The data-parallel rank, when published.
    pub dp_rank: Option<u32>,
}

/// Why a payload or an event could not be decoded.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum DecodeError {
    /// Not msgpack, or nested too deep.
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
}

/// Decodes one payload frame.
pub(crate) fn decode_batch(payload: &[u8]) -> Result<Batch, DecodeError> {
    let mut rd = payload;
    let v = rmpv::decode::read_value_with_max_depth(&mut rd, MAX_DEPTH)
        .map_err(|e| DecodeError::NotMsgpack(e.to_string()))?;
    let Value::Array(items) = v else {
        return Err(DecodeError::NotBatch);
    };
    let ts = match items.first() {
        Some(Value::F64(f)) => *f,
        Some(Value::F32(f)) => f64::from(*f),
        Some(v) if v.is_i64() || v.is_u64() => v.as_f64().unwrap_or(0.0),
        _ => return Err(DecodeError::NotBatch),
    };
    let Some(Value::Array(events)) = items.get(1) else {
        return Err(DecodeError::NotBatch);
    };
    let dp_rank = items
        .get(2)
        .and_then(Value::as_u64)
        .and_then(|r| u32::try_from(r).ok());
    Ok(Batch {
        ts,
        events: events.iter().map(decode_event).collect(),
        dp_rank,
    })
}

/// Field access over either layout.
enum Fields<'a> {
    Array(&'a [Value]),
    Map(&'a [(Value, Value)]),
}

impl<'a> Fields<'a> {
    /// The field at `pos` (legacy array, after the tag) or named `name` (map).
    fn get(&self, pos: usize, name: &str) -> Option<&'a Value> {
        let v = match self {
            Fields::Array(a) => a.get(pos + 1),
            Fields::Map(m) => m
                .iter()
                .find(|(k, _)| k.as_str() == Some(name))
                .map(|(_, v)| v),
        };
        v.filter(|v| !v.is_nil())
    }
}

fn decode_event(v: &Value) -> Result<Event, DecodeError> {
    let (tag, fields) = match v {
        Value::Array(a) => (a.first().and_then(Value::as_str), Fields::Array(a)),
        Value::Map(m) => (
            m.iter()
                .find(|(k, _)| k.as_str() == Some("type"))
                .and_then(|(_, v)| v.as_str()),
            Fields::Map(m),
        ),
        _ => (None, Fields::Array(&[])),
    };
    match tag.ok_or(DecodeError::NoTag)? {
        "BlockStored" => stored(&fields).map(Event::Stored),
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
    let block_hashes = hashes(f.get(0, "block_hashes"), e, "block_hashes")?;
    let parent = f
        .get(1, "parent_block_hash")
        .map(|v| {
            hash(v).ok_or(DecodeError::Field {
                event: e,
                field: "parent_block_hash",
            })
        })
        .transpose()?;
    let token_ids = match f.get(2, "token_ids") {
        Some(Value::Array(a)) => a
            .iter()
            .map(|t| t.as_u64().and_then(|t| u32::try_from(t).ok()))
            .collect::<Option<Vec<u32>>>()
            .ok_or(DecodeError::Field {
                event: e,
                field: "token_ids",
            })?,
        _ => {
            return Err(DecodeError::Field {
                event: e,
                field: "token_ids",
            });
        }
    };
    let block_size = f
        .get(3, "block_size")
        .and_then(Value::as_u64)
        .and_then(|b| usize::try_from(b).ok())
        .filter(|&b| b > 0 && b <= 1 << 20)
        .ok_or(DecodeError::Field {
            event: e,
            field: "block_size",
        })?;
    // Position 4 is the deprecated integer `lora_id`.
    let medium = opt_str(f.get(5, "medium"), e, "medium")?;
    let lora_name = opt_str(f.get(6, "lora_name"), e, "lora_name")?.filter(|l| !l.is_empty());
    let first_extra_keys = match f.get(7, "extra_keys") {
        None => Vec::new(),
        Some(Value::Array(per_block)) => match per_block.first() {
            None | Some(Value::Nil) => Vec::new(),
            Some(Value::Array(keys)) => keys
                .iter()
                .map(|k| match k {
                    Value::String(s) => s
                        .as_str()
                        .map(|s| ExtraKey::Str(s.to_owned()))
                        .unwrap_or(ExtraKey::Other),
                    _ => ExtraKey::Other,
                })
                .collect(),
            Some(_) => {
                return Err(DecodeError::Field {
                    event: e,
                    field: "extra_keys",
                });
            }
        },
        Some(_) => {
            return Err(DecodeError::Field {
                event: e,
                field: "extra_keys",
            });
        }
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
fn hash(v: &Value) -> Option<EngineBlockHash> {
    match v {
        Value::Integer(i) => i.as_u64().map(EngineBlockHash),
        Value::Binary(b) if !b.is_empty() => Some(EngineBlockHash(fold(b))),
        _ => None,
    }
}

/// Folds a digest of any length to 64 bits (the engine's hashes are opaque identifiers; a
/// collision needs 2^32 blocks on one worker to become likely).
pub(crate) fn fold(bytes: &[u8]) -> u64 {
    xxhash_rust::xxh3::xxh3_64(bytes)
}

fn hashes(
    v: Option<&Value>,
    event: &'static str,
    field: &'static str,
) -> Result<Vec<EngineBlockHash>, DecodeError> {
    match v {
        Some(Value::Array(a)) => a
            .iter()
            .map(hash)
            .collect::<Option<Vec<_>>>()
            .ok_or(DecodeError::Field { event, field }),
        _ => Err(DecodeError::Field { event, field }),
    }
}

fn opt_str(
    v: Option<&Value>,
    event: &'static str,
    field: &'static str,
) -> Result<Option<String>, DecodeError> {
    match v {
        None => Ok(None),
        Some(Value::String(s)) => Ok(s.as_str().map(str::to_owned)),
        Some(_) => Err(DecodeError::Field { event, field }),
    }
}

fn opt_u32(
    v: Option<&Value>,
    event: &'static str,
    field: &'static str,
) -> Result<Option<u32>, DecodeError> {
    match v {
        None => Ok(None),
        Some(v) => v
            .as_u64()
            .and_then(|n| u32::try_from(n).ok())
            .map(Some)
            .ok_or(DecodeError::Field { event, field }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
        let b = decode_batch(&enc(&batch)).unwrap();
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
        let b = decode_batch(&enc(&batch)).unwrap();
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
        let b = decode_batch(&enc(&batch)).unwrap();
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
        assert!(decode_batch(b"\xc1garbage").is_err());
        assert!(decode_batch(&enc(&Value::from(3))).is_err());
        // Deep nesting is refused, not recursed into.
        let mut deep = Value::Nil;
        for _ in 0..100 {
            deep = Value::Array(vec![deep]);
        }
        assert!(decode_batch(&enc(&deep)).is_err());
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
}
