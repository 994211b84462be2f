//! The wire form of KV events, as vLLM 0.33 publishes them: msgpack batches
//! `[ts float64, [event, ...], data_parallel_rank or nil]` in one of two event layouts, and the
//! 3-frame ZeroMQ message `[topic, seq u64 big-endian, payload]` around them; replay answers are
//! vLLM 0.33's `[b"", topic, seq, payload]` per batch and the end marker `[b"", b"", u64::MAX, b""]`.
//!
//! Layouts (see `/work/shared/spec/kv-events.md`):
//! - [`EventLayout::Array`] (legacy, tag first): every field in declaration order, nil when unset.
//!   `["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium,
//!   lora_name, extra_keys, group_idx, kv_cache_spec_kind, kv_cache_spec_sliding_window,
//!   locality, ownership, session_id, lookahead_token_ids]` (16 items),
//!   `["BlockRemoved", block_hashes, medium, group_idx, locality, ownership]` (6),
//!   `["AllBlocksCleared"]`.
//! - [`EventLayout::Map`] (current): `"type"` first, then the fields in the same order. Fields
//!   without a default (`block_hashes`, `parent_block_hash`, `token_ids`, `block_size`, `lora_id`,
//!   `medium`, `lora_name`; `block_hashes`, `medium` for removals) are always written, nil
//!   included; fields whose default is nil are omitted when nil. A plain GPU engine fills
//!   `extra_keys` (one entry per block), `group_idx` 0 and `kv_cache_spec_kind`
//!   `"full_attention"`; `kv_cache_spec_sliding_window`, `locality`, `ownership`, `session_id`
//!   and `lookahead_token_ids` stay nil (no sliding window, no KV connector, no session, no
//!   speculative lookahead), so they are omitted.
//!
//! Block hashes: [`HashForm::Int`] writes the low 64 bits of the SHA-256 digest as the smallest
//! msgpack uint (up to uint64, never a signed int); [`HashForm::Bytes`] writes the 32 digest bytes
//! as msgpack bin. Integers use the smallest msgpack form, as msgspec does.
//!
//! Pure code: no clock, no sockets. The publisher owns sequence numbers and time.

use std::collections::VecDeque;

use bytes::Bytes;

use crate::prefix_cache::{CacheEvent, EngineDigest, ExtraKey};

/// Which engine's events to write (framing, replay and batch are the same for all three).
///
/// - `vllm`: as above.
/// - `sglang`: SGLang's `BlockStored` has `block_hashes, parent_block_hash, token_ids,
///   block_size, lora_id, medium` and, on a salted store, the request's salt: in the array layout
///   a trailing 8th element `{"cache_salt": salt}` (SGLang #30827; unsalted stores keep the
///   7-element shape), in the map layout an optional `cache_salt` field (SGLang #37482). The salt
///   is on every store of a salted request, continuations included. `BlockRemoved` has
///   `block_hashes, medium`. Hashes are signed 64-bit integers (SGLang's `hash_str_to_int64`).
/// - `trtllm`: TensorRT-LLM's ZeroMQ publisher (#17023): always tagged maps, hashes as signed
///   64-bit integers, `BlockStored` with `block_hashes, parent_block_hash, token_ids, block_size,
///   lora_id, medium, lora_name` and nothing else (no extra keys: no salt is published),
///   `BlockRemoved` with `block_hashes, medium`; `--event-layout` does not apply.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum SimEngine {
    /// vLLM 0.33.
    #[default]
    Vllm,
    /// SGLang with salted events (array layout: since #30827; map layout: since #37482).
    Sglang,
    /// TensorRT-LLM's ZeroMQ publisher.
    Trtllm,
}

/// Which event layout to write.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum EventLayout {
    /// Legacy tag-first arrays, every field present (nil when unset).
    Array,
    /// Current maps with `"type"`, default-valued fields omitted.
    Map,
}

/// How block hashes appear on the wire.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum HashForm {
    /// Low 64 bits of the digest as msgpack uint.
    Int,
    /// The 32 raw digest bytes as msgpack bin.
    Bytes,
}

/// The medium every simulated block lives in.
pub const MEDIUM_GPU: &str = "GPU";
/// The KV cache spec kind of a plain full-attention model.
pub const SPEC_KIND_FULL_ATTENTION: &str = "full_attention";
/// The sequence number of the replay end marker.
pub const REPLAY_END_SEQ: u64 = u64::MAX;

/// Encodes event batches of one engine.
#[derive(Clone, Debug)]
pub struct BatchEncoder {
    /// Which engine's events.
    pub engine: SimEngine,
    /// Event layout.
    pub layout: EventLayout,
    /// Hash form.
    pub hash_form: HashForm,
    /// Tokens per block (`block_size` of every `BlockStored`).
    pub block_size: usize,
    /// Served LoRA adapters; an adapter's `lora_id` is its 1-based position here.
    pub lora_modules: Vec<String>,
    /// The batch's `data_parallel_rank` (nil when `None`).
    pub data_parallel_rank: Option<u32>,
}

/// A msgpack writer over a `Vec`, which cannot fail.
struct Out(Vec<u8>);

impl Out {
    // Writing into a Vec<u8> is infallible (the error type is `Infallible`), so results are
    // discarded.
    fn array(&mut self, n: usize) {
        let _ = rmp::encode::write_array_len(&mut self.0, n as u32);
    }
    fn map(&mut self, n: usize) {
        let _ = rmp::encode::write_map_len(&mut self.0, n as u32);
    }
    fn str(&mut self, s: &str) {
        let _ = rmp::encode::write_str(&mut self.0, s);
    }
    fn uint(&mut self, v: u64) {
        let _ = rmp::encode::write_uint(&mut self.0, v);
    }
    fn nil(&mut self) {
        let _ = rmp::encode::write_nil(&mut self.0);
    }
    fn sint(&mut self, v: i64) {
        let _ = rmp::encode::write_sint(&mut self.0, v);
    }
    fn f64(&mut self, v: f64) {
        let _ = rmp::encode::write_f64(&mut self.0, v);
    }
    fn bin(&mut self, b: &[u8]) {
        let _ = rmp::encode::write_bin(&mut self.0, b);
    }
}

/// One field of an event: its name and how to write its value (`None` = nil).
type Field<'a> = (&'static str, Option<Value<'a>>, bool);

/// A field value.
enum Value<'a> {
    Hashes(&'a [EngineDigest]),
    Hash(EngineDigest),
    Tokens(&'a [u32]),
    Uint(u64),
    Str(&'a str),
    ExtraKeys(&'a [Vec<ExtraKey>]),
    /// SGLang's `{"cache_salt": salt}`.
    Metadata(&'a str),
}

impl BatchEncoder {
    /// The msgpack payload of one batch: `[ts, [events...], data_parallel_rank]`.
    pub fn encode_batch(&self, ts: f64, events: &[CacheEvent]) -> Vec<u8> {
        let mut out = Out(Vec::with_capacity(64 + 16 * events.len()));
        out.array(3);
        out.f64(ts);
        out.array(events.len());
        for e in events {
            self.encode_event(&mut out, e);
        }
        match self.data_parallel_rank {
            Some(r) => out.uint(u64::from(r)),
            None => out.nil(),
        }
        out.0
    }

    fn lora_id(&self, name: &str) -> Option<u64> {
        self.lora_modules
            .iter()
            .position(|m| m == name)
            .map(|i| i as u64 + 1)
    }

    fn encode_event(&self, out: &mut Out, e: &CacheEvent) {
        if self.engine != SimEngine::Vllm {
            return self.encode_other_engine(out, e);
        }
        // (name, value, has_default): fields with a default are omitted in the map layout when
        // their value is nil.
        let (tag, fields): (&str, Vec<Field<'_>>) = match e {
            CacheEvent::Stored {
                parent,
                hashes,
                tokens,
                extra_keys,
                lora_name,
                ..
            } => (
                "BlockStored",
                vec![
                    ("block_hashes", Some(Value::Hashes(hashes)), false),
                    ("parent_block_hash", parent.map(Value::Hash), false),
                    ("token_ids", Some(Value::Tokens(tokens)), false),
                    (
                        "block_size",
                        Some(Value::Uint(self.block_size as u64)),
                        false,
                    ),
                    (
                        "lora_id",
                        lora_name
                            .as_deref()
                            .and_then(|l| self.lora_id(l))
                            .map(Value::Uint),
                        false,
                    ),
                    ("medium", Some(Value::Str(MEDIUM_GPU)), false),
                    ("lora_name", lora_name.as_deref().map(Value::Str), false),
                    ("extra_keys", Some(Value::ExtraKeys(extra_keys)), true),
                    ("group_idx", Some(Value::Uint(0)), true),
                    (
                        "kv_cache_spec_kind",
                        Some(Value::Str(SPEC_KIND_FULL_ATTENTION)),
                        true,
                    ),
                    ("kv_cache_spec_sliding_window", None, true),
                    ("locality", None, true),
                    ("ownership", None, true),
                    ("session_id", None, true),
                    ("lookahead_token_ids", None, true),
                ],
            ),
            CacheEvent::Removed { hashes } => (
                "BlockRemoved",
                vec![
                    ("block_hashes", Some(Value::Hashes(hashes)), false),
                    ("medium", Some(Value::Str(MEDIUM_GPU)), false),
                    ("group_idx", Some(Value::Uint(0)), true),
                    ("locality", None, true),
                    ("ownership", None, true),
                ],
            ),
            CacheEvent::Cleared => ("AllBlocksCleared", Vec::new()),
        };
        match self.layout {
            EventLayout::Array => {
                out.array(1 + fields.len());
                out.str(tag);
                for (_, v, _) in &fields {
                    self.value(out, v.as_ref());
                }
            }
            EventLayout::Map => {
                let kept: Vec<&Field<'_>> = fields
                    .iter()
                    .filter(|(_, v, has_default)| v.is_some() || !has_default)
                    .collect();
                out.map(1 + kept.len());
                out.str("type");
                out.str(tag);
                for (name, v, _) in kept {
                    out.str(name);
                    self.value(out, v.as_ref());
                }
            }
        }
    }

    /// SGLang's and TensorRT-LLM's events (see [`SimEngine`]).
    fn encode_other_engine(&self, out: &mut Out, e: &CacheEvent) {
        let maps = self.engine == SimEngine::Trtllm || self.layout == EventLayout::Map;
        let (tag, fields): (&str, Vec<(&str, Option<Value<'_>>)>) = match e {
            CacheEvent::Stored {
                parent,
                hashes,
                tokens,
                lora_name,
                salt,
                ..
            } => {
                let lora = lora_name.as_deref();
                let mut f = vec![
                    ("block_hashes", Some(Value::Hashes(hashes))),
                    ("parent_block_hash", parent.map(Value::Hash)),
                    ("token_ids", Some(Value::Tokens(tokens))),
                    ("block_size", Some(Value::Uint(self.block_size as u64))),
                    (
                        "lora_id",
                        lora.and_then(|l| self.lora_id(l)).map(Value::Uint),
                    ),
                    ("medium", Some(Value::Str(MEDIUM_GPU))),
                ];
                match self.engine {
                    SimEngine::Trtllm => f.push(("lora_name", lora.map(Value::Str))),
                    _ => {
                        if let Some(s) = salt.as_deref().filter(|s| !s.is_empty()) {
                            f.push(if maps {
                                ("cache_salt", Some(Value::Str(s)))
                            } else {
                                ("metadata", Some(Value::Metadata(s)))
                            });
                        }
                    }
                }
                ("BlockStored", f)
            }
            CacheEvent::Removed { hashes } => (
                "BlockRemoved",
                vec![
                    ("block_hashes", Some(Value::Hashes(hashes))),
                    ("medium", Some(Value::Str(MEDIUM_GPU))),
                ],
            ),
            CacheEvent::Cleared => ("AllBlocksCleared", Vec::new()),
        };
        if maps {
            out.map(1 + fields.len());
            out.str("type");
            out.str(tag);
            for (name, v) in &fields {
                out.str(name);
                self.value(out, v.as_ref());
            }
        } else {
            out.array(1 + fields.len());
            out.str(tag);
            for (_, v) in &fields {
                self.value(out, v.as_ref());
            }
        }
    }

    fn hash(&self, out: &mut Out, d: &EngineDigest) {
        if self.engine != SimEngine::Vllm {
            // SGLang and TensorRT-LLM write their 64-bit hashes as signed integers.
            return out.sint(d.as_u64() as i64);
        }
        match self.hash_form {
            HashForm::Int => out.uint(d.as_u64()),
            HashForm::Bytes => out.bin(&d.0),
        }
    }

    fn value(&self, out: &mut Out, v: Option<&Value<'_>>) {
        match v {
            None => out.nil(),
            Some(Value::Hashes(hs)) => {
                out.array(hs.len());
                for h in *hs {
                    self.hash(out, h);
                }
            }
            Some(Value::Hash(h)) => self.hash(out, h),
            Some(Value::Tokens(ts)) => {
                out.array(ts.len());
                for t in *ts {
                    out.uint(u64::from(*t));
                }
            }
            Some(Value::Uint(n)) => out.uint(*n),
            Some(Value::Str(s)) => out.str(s),
            Some(Value::Metadata(salt)) => {
                out.map(1);
                out.str("cache_salt");
                out.str(salt);
            }
            Some(Value::ExtraKeys(per_block)) => {
                out.array(per_block.len());
                for keys in *per_block {
                    if keys.is_empty() {
                        out.nil();
                        continue;
                    }
                    out.array(keys.len());
                    for k in keys {
                        match k {
                            ExtraKey::Str(s) => out.str(s),
                        }
                    }
                }
            }
        }
    }
}

/// The three frames of one published message: `[topic, seq as 8-byte big-endian, payload]`.
pub fn frames(topic: &str, seq: u64, payload: Bytes) -> Vec<Bytes> {
    vec![
        Bytes::copy_from_slice(topic.as_bytes()),
        Bytes::copy_from_slice(&seq.to_be_bytes()),
        payload,
    ]
}

/// The last `capacity` published batches, for the replay socket.
#[derive(Debug)]
pub struct ReplayBuffer {
    capacity: usize,
    batches: VecDeque<(u64, Bytes)>,
}

impl ReplayBuffer {
    /// A buffer keeping at most `capacity` batches (0 keeps none).
    pub fn new(capacity: usize) -> Self {
        ReplayBuffer {
            capacity,
            batches: VecDeque::with_capacity(capacity.min(1024)),
        }
    }

    /// Records a batch; the oldest is forgotten beyond the capacity.
    pub fn push(&mut self, seq: u64, payload: Bytes) {
        if self.capacity == 0 {
            return;
        }
        if self.batches.len() == self.capacity {
            self.batches.pop_front();
        }
        self.batches.push_back((seq, payload));
    }

    /// Forgets everything (an engine restart).
    pub fn clear(&mut self) {
        self.batches.clear();
    }

    /// Every buffered batch with `seq >= start`, oldest first.
    pub fn since(&self, start: u64) -> Vec<(u64, Bytes)> {
        self.batches
            .iter()
            .filter(|(s, _)| *s >= start)
            .cloned()
            .collect()
    }

    /// The answer to a replay request exactly as vLLM 0.33's ROUTER sends it after the
    /// requester's identity: `[b"", topic, seq, payload]` per batch, then the end marker
    /// `[b"", b"", 0xFFFFFFFFFFFFFFFF, b""]` (empty topic, as vLLM sends it). The caller puts the
    /// request's envelope in front.
    pub fn answer(&self, start: u64, topic: &str) -> Vec<[Bytes; 4]> {
        let topic = Bytes::copy_from_slice(topic.as_bytes());
        let mut out: Vec<[Bytes; 4]> = self
            .since(start)
            .into_iter()
            .map(|(s, p)| {
                [
                    Bytes::new(),
                    topic.clone(),
                    Bytes::copy_from_slice(&s.to_be_bytes()),
                    p,
                ]
            })
            .collect();
        out.push([
            Bytes::new(),
            Bytes::new(),
            Bytes::copy_from_slice(&REPLAY_END_SEQ.to_be_bytes()),
            Bytes::new(),
        ]);
        out
    }
}

/// Splits a replay request as a ROUTER receives it, `[identity..., b"", start_seq 8-byte BE]`,
/// into its envelope (the identity frames, to send back in front of the answer) and `start_seq`.
/// A DEALER that omits the empty delimiter (`[identity, start_seq]`) is answered too.
pub fn parse_replay_request(frames: &[Bytes]) -> Option<(&[Bytes], u64)> {
    let (seq, head) = frames.split_last()?;
    let envelope = match head.split_last() {
        Some((empty, envelope)) if empty.is_empty() && !envelope.is_empty() => envelope,
        _ if head.len() == 1 && !head[0].is_empty() => head,
        _ => return None,
    };
    let b: [u8; 8] = seq.as_ref().try_into().ok()?;
    Some((envelope, u64::from_be_bytes(b)))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn digest(last: u8) -> EngineDigest {
        let mut d = [0u8; 32];
        d[0] = 0xAB;
        d[31] = last;
        d[24] = 0x80; // low 64 bits >= 2^63: must stay an unsigned uint64
        EngineDigest(d)
    }

    fn encoder(layout: EventLayout, hash_form: HashForm) -> BatchEncoder {
        BatchEncoder {
            engine: SimEngine::Vllm,
            layout,
            hash_form,
            block_size: 2,
            lora_modules: vec!["ad".into()],
            data_parallel_rank: None,
        }
    }

    fn stored() -> CacheEvent {
        CacheEvent::Stored {
            parent: None,
            hashes: vec![digest(1)],
            tokens: vec![7, 300],
            extra_keys: vec![vec![ExtraKey::Str("s".into())]],
            lora_name: None,
            salt: Some("s".into()),
        }
    }

    const TS: [u8; 9] = [0xcb, 0x3f, 0xf8, 0, 0, 0, 0, 0, 0]; // 1.5 as float64
    const H1_INT: [u8; 9] = [0xcf, 0x80, 0, 0, 0, 0, 0, 0, 1];

    fn fixstr(s: &str) -> Vec<u8> {
        let mut v = vec![0xa0 | s.len() as u8];
        v.extend_from_slice(s.as_bytes());
        v
    }

    #[test]
    fn array_layout_int_hashes_exact_bytes() {
        let bytes = encoder(EventLayout::Array, HashForm::Int).encode_batch(1.5, &[stored()]);
        let mut want = vec![0x93];
        want.extend(TS);
        want.extend([0x91, 0xdc, 0x00, 0x10]); // 1 event: array16 of 16 items
        want.extend(fixstr("BlockStored"));
        want.push(0x91);
        want.extend(H1_INT);
        want.push(0xc0); // parent nil
        want.extend([0x92, 0x07, 0xcd, 0x01, 0x2c]); // [7, 300]
        want.push(0x02); // block_size
        want.push(0xc0); // lora_id nil
        want.extend(fixstr("GPU"));
        want.push(0xc0); // lora_name nil
        want.extend([0x91, 0x91]); // extra_keys [["s"]]
        want.extend(fixstr("s"));
        want.push(0x00); // group_idx
        want.extend(fixstr("full_attention"));
        want.extend([0xc0; 5]); // sliding window, locality, ownership, session, lookahead
        want.push(0xc0); // rank nil
        assert_eq!(bytes, want);
    }

    #[test]
    fn map_layout_bytes_hashes_exact_bytes() {
        let mut enc = encoder(EventLayout::Map, HashForm::Bytes);
        enc.data_parallel_rank = Some(3);
        let bytes = enc.encode_batch(
            1.5,
            &[
                CacheEvent::Removed {
                    hashes: vec![digest(2)],
                },
                CacheEvent::Cleared,
            ],
        );
        let mut want = vec![0x93];
        want.extend(TS);
        want.push(0x92);
        want.push(0x84); // type, block_hashes, medium, group_idx
        want.extend(fixstr("type"));
        want.extend(fixstr("BlockRemoved"));
        want.extend(fixstr("block_hashes"));
        want.extend([0x91, 0xc4, 0x20]);
        want.extend(digest(2).0);
        want.extend(fixstr("medium"));
        want.extend(fixstr("GPU"));
        want.extend(fixstr("group_idx"));
        want.push(0x00);
        want.push(0x81);
        want.extend(fixstr("type"));
        want.extend(fixstr("AllBlocksCleared"));
        want.push(0x03); // rank
        assert_eq!(bytes, want);
    }

    #[test]
    fn map_layout_stored_keeps_required_nils_and_omits_defaults() {
        let enc = encoder(EventLayout::Map, HashForm::Int);
        let ev = CacheEvent::Stored {
            parent: Some(digest(9)),
            hashes: vec![digest(1), digest(2)],
            tokens: vec![1, 2, 3, 4],
            extra_keys: vec![vec![ExtraKey::Str("ad".into())], vec![]],
            lora_name: Some("ad".into()),
            salt: None,
        };
        let bytes = enc.encode_batch(0.0, &[ev]);
        // Map of 11: type + 7 required + extra_keys, group_idx, kv_cache_spec_kind.
        let at = bytes.iter().position(|b| *b == 0x8b).expect("fixmap 11");
        assert_eq!(bytes[at - 1], 0x91, "one event");
        let find = |needle: &str| {
            bytes
                .windows(needle.len())
                .position(|w| w == needle.as_bytes())
        };
        for present in ["parent_block_hash", "lora_id", "lora_name", "extra_keys"] {
            assert!(find(present).is_some(), "{present}");
        }
        for absent in [
            "locality",
            "ownership",
            "session_id",
            "lookahead",
            "sliding",
        ] {
            assert!(find(absent).is_none(), "{absent}");
        }
        // lora_id 1 (first adapter), then medium.
        let lid = find("lora_id").expect("lora_id") + "lora_id".len();
        assert_eq!(bytes[lid], 0x01);
        // extra_keys: [["ad"], nil]
        let ek = find("extra_keys").expect("extra_keys") + "extra_keys".len();
        assert_eq!(&bytes[ek..ek + 6], &[0x92, 0x91, 0xa2, b'a', b'd', 0xc0]);
    }

    #[test]
    fn sglang_and_trtllm_exact_bytes() {
        let mut enc = encoder(EventLayout::Array, HashForm::Int);
        enc.engine = SimEngine::Sglang;
        let h1_signed: [u8; 9] = [0xd3, 0x80, 0, 0, 0, 0, 0, 0, 1]; // int64, negative
        let bytes = enc.encode_batch(1.5, &[stored()]);
        let mut want = vec![0x93];
        want.extend(TS);
        want.extend([0x91, 0x98]); // 1 event: 8 items (salted: trailing metadata)
        want.extend(fixstr("BlockStored"));
        want.push(0x91);
        want.extend(h1_signed);
        want.push(0xc0); // parent
        want.extend([0x92, 0x07, 0xcd, 0x01, 0x2c]);
        want.push(0x02); // block_size
        want.push(0xc0); // lora_id
        want.extend(fixstr("GPU"));
        want.push(0x81);
        want.extend(fixstr("cache_salt"));
        want.extend(fixstr("s"));
        want.push(0xc0); // rank
        assert_eq!(bytes, want);
        // Map layout: the salt is a field; an unsalted store has none.
        enc.layout = EventLayout::Map;
        let bytes = enc.encode_batch(1.5, &[stored()]);
        assert_eq!(bytes[11], 0x88, "type + 6 fields + cache_salt");
        let mut unsalted = stored();
        if let CacheEvent::Stored { salt, .. } = &mut unsalted {
            *salt = None;
        }
        assert_eq!(enc.encode_batch(1.5, &[unsalted.clone()])[11], 0x87);
        // TensorRT-LLM: maps with lora_name and no salt, whatever the layout flag says.
        enc.engine = SimEngine::Trtllm;
        enc.layout = EventLayout::Array;
        let bytes = enc.encode_batch(1.5, &[stored()]);
        assert_eq!(bytes[11], 0x88, "type + 7 fields");
        let find = |n: &str| bytes.windows(n.len()).any(|w| w == n.as_bytes());
        assert!(find("lora_name") && !find("cache_salt") && !find("extra_keys"));
    }

    #[test]
    fn frames_and_replay_buffer() {
        let f = frames("kv", 258, Bytes::from_static(b"p"));
        assert_eq!(f[0].as_ref(), b"kv");
        assert_eq!(f[1].as_ref(), &[0, 0, 0, 0, 0, 0, 1, 2]);
        let mut b = ReplayBuffer::new(3);
        for s in 0..5u64 {
            b.push(s, Bytes::from(vec![s as u8]));
        }
        assert_eq!(
            b.since(0).iter().map(|(s, _)| *s).collect::<Vec<_>>(),
            vec![2, 3, 4]
        );
        // vLLM 0.33's four frames: [b"", topic, seq, payload], then [b"", b"", MAX, b""].
        let ans = b.answer(3, "kv");
        assert_eq!(ans.len(), 3);
        assert!(ans[0][0].is_empty());
        assert_eq!(ans[0][1].as_ref(), b"kv");
        assert_eq!(ans[0][2].as_ref(), &3u64.to_be_bytes());
        assert_eq!(ans[1][3].as_ref(), &[4]);
        assert_eq!(ans[2][2].as_ref(), &[0xff; 8]);
        assert!(ans[2][0].is_empty() && ans[2][1].is_empty() && ans[2][3].is_empty());
        b.clear();
        assert_eq!(b.answer(0, "").len(), 1);
        let mut none = ReplayBuffer::new(0);
        none.push(0, Bytes::new());
        assert!(none.since(0).is_empty());
    }

    #[test]
    fn replay_requests() {
        let seq = Bytes::copy_from_slice(&7u64.to_be_bytes());
        let id = Bytes::from_static(b"peer");
        let hop = Bytes::from_static(b"hop");
        let e = Bytes::new();
        let req = [id.clone(), e.clone(), seq.clone()];
        assert_eq!(parse_replay_request(&req), Some((&req[..1], 7)));
        let via_proxy = [hop.clone(), id.clone(), e.clone(), seq.clone()];
        assert_eq!(parse_replay_request(&via_proxy), Some((&via_proxy[..2], 7)));
        let bare = [id.clone(), seq.clone()];
        assert_eq!(parse_replay_request(&bare), Some((&bare[..1], 7)));
        let short = Bytes::from_static(b"123");
        assert_eq!(parse_replay_request(&[id.clone(), e.clone(), short]), None);
        assert_eq!(parse_replay_request(&[e.clone(), seq.clone()]), None);
        assert_eq!(parse_replay_request(&[hop, id, seq.clone()]), None);
        assert_eq!(parse_replay_request(&[seq]), None);
        assert_eq!(parse_replay_request(&[]), None);
    }
}
