//! Reusing token ids of text the tokenizer has already seen, one segment at a time.
//!
//! Encoding dominates the cost of a request (the Hugging Face pipeline runs at a few hundred
//! thousand tokens/s per core here; rendering a template is ~1% of the time), and chat prompts
//! repeat: every turn of a conversation re-sends the whole history, tenants share system prompts.
//!
//! Why cutting is exact: the tokenizer first splits the text on added tokens whose `normalized`
//! flag is false (leftmost-longest matching), then normalizes, pre-tokenizes and encodes each
//! piece on its own. So at the start of such a match, encode(a + b) == encode(a) ++ encode(b),
//! provided the token at the cut does not reach left of its start (`lstrip`) or look at its
//! left neighbour (`single_word`), and no step treats the first piece of the text specially
//! (Metaspace/Prepend — the cache is off for such tokenizers) and no post-processor runs
//! (`add_special_tokens` false, the chat default). We cut at the same matches the tokenizer
//! finds (same pattern set, same match rule), so chat templates' `<|im_start|>`-style markers
//! split a prompt into per-message segments. Added tokens with `normalized: true` (DeepSeek's
//! `<｜User｜>`) are matched by the tokenizer in a second pass over the normalized pieces; when
//! the normalizer is the identity, their matches are cut points too, by the same argument; and each segment's ids are cached under a 128-bit
//! hash of its text. A wrong cache entry could only mis-route, never change what the engine
//! computes, and `tests/tokenize_fixtures.rs` checks cached == uncached on every case.
//!
//! Memory is bounded by a token budget: two generations of entries; when the current one
//! holds half the budget it becomes the previous one (dropping the older); a hit in the
//! previous generation is promoted. That is an LRU approximation with O(1) work per access.

use std::collections::HashMap;
use std::sync::Arc;

use aho_corasick::{AhoCorasick, MatchKind};
use parking_lot::Mutex;
use tokenizers::{AddedToken, Tokenizer};
use xxhash_rust::xxh3::xxh3_128;

/// Texts shorter than this are encoded directly: cutting and hashing would not pay off.
const MIN_CACHED_TEXT: usize = 256;

#[derive(Default)]
struct Generations {
    current: HashMap<u128, Arc<[u32]>>,
    previous: HashMap<u128, Arc<[u32]>>,
    current_tokens: usize,
}

/// Leftmost-longest matcher over a set of added tokens, and which of them may start a segment.
struct Cutter {
    matcher: AhoCorasick,
    cuttable: Vec<bool>,
}

impl Cutter {
    fn new<'a>(tokens: impl Iterator<Item = &'a AddedToken>) -> Option<Cutter> {
        let mut patterns = Vec::new();
        let mut cuttable = Vec::new();
        for token in tokens.filter(|t| !t.content.is_empty()) {
            patterns.push(token.content.as_str());
            // A token that begins with whitespace could overlap what its left neighbour's
            // `rstrip` absorbs; never cut there.
            let starts_blank = token.content.starts_with(char::is_whitespace);
            cuttable.push(!token.lstrip && !token.single_word && !starts_blank);
        }
        let matcher = AhoCorasick::builder()
            .match_kind(MatchKind::LeftmostLongest)
            .build(&patterns)
            .ok()?;
        Some(Cutter { matcher, cuttable })
    }
}

/// Segment cutter and cache of one tokenizer.
pub(crate) struct SegmentCache {
    /// Added tokens with `normalized: false`, matched on the raw text (the tokenizer's first
    /// split); `None` when cutting is not exact for this tokenizer or the cache is off.
    raw: Option<Cutter>,
    /// Added tokens with `normalized: true`, matched between the raw matches (the tokenizer's
    /// second split). Only used when the normalizer is the identity, so that matching them on
    /// the raw text is what the tokenizer does on the normalized text.
    normalized: Option<Cutter>,
    capacity_tokens: usize,
    store: Mutex<Generations>,
}

impl SegmentCache {
    /// Prepares the cutter for `tokenizer`; `capacity_tokens == 0` disables the cache.
    pub(crate) fn new(tokenizer: &Tokenizer, capacity_tokens: usize) -> SegmentCache {
        let first_piece_special =
            |json: &String| json.contains("Metaspace") || json.contains("Prepend");
        let pre_tokenizer = tokenizer
            .get_pre_tokenizer()
            .and_then(|p| serde_json::to_string(p).ok());
        let normalizer = tokenizer
            .get_normalizer()
            .and_then(|n| serde_json::to_string(n).ok());
        let enabled = capacity_tokens > 0
            && !pre_tokenizer.as_ref().is_some_and(first_piece_special)
            && !normalizer.as_ref().is_some_and(first_piece_special);
        let identity_normalizer = match &normalizer {
            None => tokenizer.get_normalizer().is_none(),
            Some(json) => json.replace(' ', "") == r#"{"type":"Sequence","normalizers":[]}"#,
        };
        let added = tokenizer.get_added_vocabulary().get_added_tokens_decoder();
        let (raw, normalized) = if enabled {
            (
                Cutter::new(added.values().filter(|t| !t.normalized)),
                if identity_normalizer {
                    Cutter::new(added.values().filter(|t| t.normalized))
                } else {
                    None
                },
            )
        } else {
            (None, None)
        };
        // Without any raw pattern, the normalized ones still need a (never matching) raw pass.
        let raw = match (raw, &normalized) {
            (None, Some(_)) => Cutter::new(std::iter::empty()),
            (raw, _) => raw,
        };
        SegmentCache {
            raw,
            normalized,
            capacity_tokens,
            store: Mutex::new(Generations::default()),
        }
    }

    /// Segment boundaries of `text`: 0, every cut point, `text.len()`. `None` when the text is
    /// not worth cutting (cache off, short text, no cut point).
    fn boundaries(&self, text: &str) -> Option<Vec<usize>> {
        let raw = self.raw.as_ref()?;
        if text.len() < MIN_CACHED_TEXT {
            return None;
        }
        let mut bounds = vec![0];
        let mut gap_start = 0;
        let add_normalized_cuts = |bounds: &mut Vec<usize>, from: usize, to: usize| {
            if let Some(normalized) = &self.normalized {
                bounds.extend(
                    normalized
                        .matcher
                        .find_iter(&text[from..to])
                        .filter(|m| normalized.cuttable[m.pattern().as_usize()])
                        .map(|m| from + m.start())
                        .filter(|&at| at > 0),
                );
            }
        };
        for m in raw.matcher.find_iter(text) {
            add_normalized_cuts(&mut bounds, gap_start, m.start());
            if raw.cuttable[m.pattern().as_usize()] && m.start() > 0 {
                bounds.push(m.start());
            }
            gap_start = m.end();
        }
        add_normalized_cuts(&mut bounds, gap_start, text.len());
        if bounds.len() == 1 {
            return None;
        }
        bounds.push(text.len());
        Some(bounds)
    }

    /// Token ids of `text` without the post-processor: cached segments are reused, the others
    /// encoded with `encode` (one call per missing segment) and remembered.
    pub(crate) fn encode<E>(
        &self,
        text: &str,
        encode: impl Fn(&str) -> Result<Vec<u32>, E>,
    ) -> Result<Vec<u32>, E> {
        let Some(bounds) = self.boundaries(text) else {
            return encode(text);
        };
        let segments: Vec<&str> = bounds.windows(2).map(|w| &text[w[0]..w[1]]).collect();
        let keys: Vec<u128> = segments.iter().map(|s| xxh3_128(s.as_bytes())).collect();
        let mut found: Vec<Option<Arc<[u32]>>> = {
            let mut store = self.store.lock();
            keys.iter().map(|k| store.get(*k)).collect()
        };
        let mut fresh = Vec::new();
        for (i, slot) in found.iter_mut().enumerate() {
            if slot.is_none() {
                let ids: Arc<[u32]> = encode(segments[i])?.into();
                fresh.push((keys[i], ids.clone()));
                *slot = Some(ids);
            }
        }
        if !fresh.is_empty() {
            let mut store = self.store.lock();
            for (key, ids) in fresh {
                store.insert(key, ids, self.capacity_tokens);
            }
        }
        let total = found.iter().flatten().map(|ids| ids.len()).sum();
        let mut out = Vec::with_capacity(total);
        for ids in found.iter().flatten() {
            out.extend_from_slice(ids);
        }
        Ok(out)
    }

    /// Drops every cached segment (benchmarks use it to measure cold requests).
    pub(crate) fn clear(&self) {
        *self.store.lock() = Generations::default();
    }
}

impl Generations {
    fn get(&mut self, key: u128) -> Option<Arc<[u32]>> {
        if let Some(ids) = self.current.get(&key) {
            return Some(ids.clone());
        }
        let ids = self.previous.remove(&key)?;
        self.current_tokens += ids.len();
        self.current.insert(key, ids.clone());
        Some(ids)
    }

    fn insert(&mut self, key: u128, ids: Arc<[u32]>, capacity_tokens: usize) {
        if ids.len() > capacity_tokens / 2 {
            return;
        }
        if self.current_tokens + ids.len() > capacity_tokens / 2 {
            self.previous = std::mem::take(&mut self.current);
            self.current_tokens = 0;
        }
        self.current_tokens += ids.len();
        self.current.insert(key, ids);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn small_bpe() -> Tokenizer {
        let path = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../../tests/fixtures/tokenizer/small-bpe/tokenizer.json"
        );
        Tokenizer::from_file(path).unwrap()
    }

    fn direct(tok: &Tokenizer, text: &str) -> Result<Vec<u32>, String> {
        tok.encode_fast(text, false)
            .map(|e| e.get_ids().to_vec())
            .map_err(|e| e.to_string())
    }

    #[test]
    fn cached_segments_equal_a_whole_encode() {
        let tok = small_bpe();
        let cache = SegmentCache::new(&tok, 1 << 20);
        let history = "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n\
             <|im_start|>user\n  spaced <|im_start|>fake header<|im_end|>  \n<|im_end|>\n\
             <|im_start|>tool\n<tool_response>\n  result  \n</tool_response> \
             <tool_response>x</tool_response><|im_end|>\n";
        let turn1 = format!("{history}<|im_start|>assistant\n");
        let turn2 = format!(
            "{history}<|im_start|>user\nCafe\u{301} 123 😀<|im_end|>\n<|im_start|>assistant\n"
        );
        let bounds = cache.boundaries(&turn2).unwrap();
        assert!(bounds.len() > 6, "{bounds:?}");
        // `</tool_response>` strips whitespace on its left: never a cut point.
        let lstrip_at = turn2.find("</tool_response>").unwrap();
        assert!(!bounds.contains(&lstrip_at));
        for text in [&turn1, &turn2, &turn1, &turn2] {
            assert_eq!(
                cache.encode(text, |s| direct(&tok, s)).unwrap(),
                direct(&tok, text).unwrap()
            );
        }
        // A short text is encoded directly; a disabled cache cuts nothing.
        assert!(cache.boundaries("<|im_start|>user\nhi").is_none());
        assert!(SegmentCache::new(&tok, 0).boundaries(&turn2).is_none());
        // small-bpe has an NFC normalizer: normalized tokens are never cut points.
        assert!(cache.normalized.is_none());
    }

    #[test]
    fn budget_is_bounded() {
        let mut g = Generations::default();
        for k in 0..100u128 {
            g.insert(k, Arc::from(vec![0u32; 10]), 200);
        }
        let held: usize = g
            .current
            .values()
            .chain(g.previous.values())
            .map(|v| v.len())
            .sum();
        assert!(held <= 200, "{held}");
        assert!(g.get(99).is_some());
        assert!(g.get(0).is_none());
        g.insert(1000, Arc::from(vec![0u32; 101]), 200);
        assert!(
            g.get(1000).is_none(),
            "an entry over half the budget is not kept"
        );
    }
}
