//! Reusing token ids of text the tokenizer has already seen, one segment at a time.
//!
//! Encoding dominates the cost of a request (the Hugging Face pipeline runs at a few hundred
//! thousand tokens/s per core here; rendering a template is ~1% of the time), and chat prompts
//! repeat: every turn of a conversation re-sends the whole history, tenants share system prompts.
//!
//! A prompt is cut into segments only where `cuts.rs` proves the tokenizer splits anyway, so
//! `encode(a + b) == encode(a) ++ encode(b)` and each segment's ids can be cached under a 128-bit
//! hash of its text alone (the same text anywhere gives the same ids): at added tokens
//! (`<|im_start|>`, `<｜User｜>`: a segment per chat message when the template's markers are added
//! tokens) and, whatever the template, at plain-text points between words (`word\n`, `word `)
//! that the tokenizer's own normalizer and pre-tokenizer cannot join. Plain cuts are taken
//! greedily, the first one at least [`MIN_SEGMENT_BYTES`] after the segment's start, so the same
//! history is cut the same way in every later turn and segments stay large enough for the
//! per-call overhead not to matter. The cache is off when a step treats the first piece of the
//! text specially (Metaspace / Prepend), and the post-processor (BOS and the like) is applied
//! by the caller on the whole. A wrong cache entry could only mis-route, never change what the
//! engine computes, and `tests/tokenize_fixtures.rs` checks cached == uncached on every case.
//!
//! Encoding segment by segment also bounds cost: [`SegmentCache::encode`] stops as soon as the
//! count passes the caller's limit, and the tokenizer's own working memory (tens of bytes per
//! byte of text) is that of one segment, not of the whole prompt.
//!
//! Memory is bounded by a token budget: two generations of entries; when the current one
//! holds half the budget it becomes the previous one (dropping the older); a hit in the
//! previous generation is promoted. That is an LRU approximation with O(1) work per access.
//! A prompt's new segments are remembered only once it is accepted, so refused prompts cannot
//! flush the cache.

use std::collections::HashMap;
use std::sync::Arc;

use parking_lot::Mutex;
use tokenizers::Tokenizer;
use xxhash_rust::xxh3::xxh3_128;

use super::cuts::{Cutter, PlainCuts};

/// Texts shorter than this are encoded directly: cutting and hashing would not pay off.
const MIN_CACHED_TEXT: usize = 256;

/// Plain-text cuts are taken at least this many bytes apart (about 250 tokens of prose).
pub(crate) const MIN_SEGMENT_BYTES: usize = 1024;

#[derive(Default)]
struct Generations {
    current: HashMap<u128, Ids>,
    previous: HashMap<u128, Ids>,
    current_tokens: usize,
}

/// One segment's ids as kept while a prompt is encoded and in the cache: two bytes each when
/// every id fits (any tokenizer below 64k tokens, and many segments of larger ones), else four.
#[derive(Clone, Debug)]
pub(crate) enum Ids {
    Narrow(Arc<[u16]>),
    Wide(Arc<[u32]>),
}

impl Ids {
    fn new(ids: &[u32]) -> Ids {
        if ids.iter().all(|&id| id <= u32::from(u16::MAX)) {
            Ids::Narrow(ids.iter().map(|&id| id as u16).collect())
        } else {
            Ids::Wide(Arc::from(ids))
        }
    }

    fn len(&self) -> usize {
        match self {
            Ids::Narrow(ids) => ids.len(),
            Ids::Wide(ids) => ids.len(),
        }
    }

    fn extend_into(&self, out: &mut Vec<u32>) {
        match self {
            Ids::Narrow(ids) => out.extend(ids.iter().map(|&id| u32::from(id))),
            Ids::Wide(ids) => out.extend_from_slice(ids),
        }
    }
}

/// The outcome of [`SegmentCache::encode`].
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Encoded {
    /// Every id of the text.
    Ids(Vec<u32>),
    /// Encoding stopped early: the text has at least this many tokens, more than the limit.
    OverLimit(usize),
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
    /// Plain-text cut points; `None` when none are provably exact for this tokenizer.
    plain: Option<PlainCuts>,
    capacity_tokens: usize,
    store: Mutex<Generations>,
}

/// An added-token match as the tokenizer sees it: strip extents included.
struct Match {
    start: usize,
    end: usize,
    cuttable: bool,
}

impl SegmentCache {
    /// Prepares the cutter for `tokenizer`; `capacity_tokens == 0` disables the cache (the
    /// text is still cut, for early stops and bounded memory).
    pub(crate) fn new(tokenizer: &Tokenizer, capacity_tokens: usize) -> SegmentCache {
        let first_piece_special =
            |json: &String| json.contains("Metaspace") || json.contains("Prepend");
        let pre_tokenizer = tokenizer
            .get_pre_tokenizer()
            .and_then(|p| serde_json::to_string(p).ok());
        let normalizer = tokenizer
            .get_normalizer()
            .and_then(|n| serde_json::to_string(n).ok());
        let enabled = !pre_tokenizer.as_ref().is_some_and(first_piece_special)
            && !normalizer.as_ref().is_some_and(first_piece_special);
        let identity_normalizer = match &normalizer {
            None => tokenizer.get_normalizer().is_none(),
            Some(json) => json.replace(' ', "") == r#"{"type":"Sequence","normalizers":[]}"#,
        };
        let added = tokenizer.get_added_vocabulary().get_added_tokens_decoder();
        let has_normalized = added.values().any(|t| t.normalized);
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
        // Plain cuts need to see every added-token match: with normalized added tokens under a
        // normalizer that changes text, the raw text does not show where they match.
        let plain = (enabled && (identity_normalizer || !has_normalized))
            .then(|| PlainCuts::of(tokenizer))
            .flatten();
        // Without any raw pattern, the other cutters still need a (never matching) raw pass.
        let raw = match (raw, normalized.is_some() || plain.is_some()) {
            (None, true) if enabled => Cutter::new(std::iter::empty()),
            (raw, _) => raw,
        };
        SegmentCache {
            raw,
            normalized,
            plain,
            capacity_tokens,
            store: Mutex::new(Generations::default()),
        }
    }

    /// Whether plain-text cuts are used for this tokenizer (not only added tokens).
    pub(crate) fn cuts_plain_text(&self) -> bool {
        self.plain.is_some()
    }

    /// Added-token matches of `text` in order (raw ones, and normalized ones between them).
    fn matches(&self, text: &str) -> Vec<Match> {
        let Some(raw) = &self.raw else {
            return Vec::new();
        };
        let to_match = |cutter: &Cutter, offset: usize, m: aho_corasick::Match| {
            let (lstrip, rstrip) = cutter.strips[m.pattern().as_usize()];
            let mut start = offset + m.start();
            let mut end = offset + m.end();
            if lstrip {
                start -= text[..start].len() - text[..start].trim_end().len();
            }
            if rstrip {
                end += text[end..].len() - text[end..].trim_start().len();
            }
            Match {
                start,
                end,
                cuttable: cutter.cuttable[m.pattern().as_usize()] && m.start() + offset > 0,
            }
        };
        let mut out = Vec::new();
        let mut gap_start = 0;
        let add_normalized = |out: &mut Vec<Match>, from: usize, to: usize| {
            if let Some(normalized) = &self.normalized {
                out.extend(
                    normalized
                        .matcher
                        .find_iter(&text[from..to])
                        .map(|m| to_match(normalized, from, m)),
                );
            }
        };
        for m in raw.matcher.find_iter(text) {
            add_normalized(&mut out, gap_start, m.start());
            out.push(to_match(raw, 0, m));
            gap_start = m.end();
        }
        add_normalized(&mut out, gap_start, text.len());
        out
    }

    /// Segment boundaries of `text`: 0, every cut point taken, `text.len()`. `None` when the
    /// text is not worth cutting (short text, no cut point).
    fn boundaries(&self, text: &str) -> Option<Vec<usize>> {
        if text.len() < MIN_CACHED_TEXT {
            return None;
        }
        self.boundaries_every(text, MIN_SEGMENT_BYTES)
    }

    /// Segment boundaries with plain cuts at least `min_gap` bytes apart (1: every cut point).
    fn boundaries_every(&self, text: &str, min_gap: usize) -> Option<Vec<usize>> {
        self.raw.as_ref()?;
        let bytes = text.as_bytes();
        let mut bounds = vec![0];
        // Plain cuts in bytes[from..to], which no added-token match covers.
        let add_plain = |bounds: &mut Vec<usize>, from: usize, to: usize| {
            let Some(plain) = &self.plain else { return };
            let mut at = from + 1;
            loop {
                let last = *bounds.last().unwrap_or(&0);
                at = at.max(last + min_gap);
                if at >= to {
                    return;
                }
                match (at..to).find(|&i| plain.allows(bytes, i)) {
                    Some(i) => {
                        bounds.push(i);
                        at = i + 1;
                    }
                    None => return,
                }
            }
        };
        let mut gap_start = 0;
        for m in self.matches(text) {
            if m.start > gap_start {
                add_plain(&mut bounds, gap_start, m.start);
            }
            if m.cuttable && m.start > *bounds.last().unwrap_or(&0) {
                bounds.push(m.start);
            }
            gap_start = gap_start.max(m.end);
        }
        add_plain(&mut bounds, gap_start, text.len());
        if bounds.len() == 1 {
            return None;
        }
        bounds.push(text.len());
        Some(bounds)
    }

    /// Token ids of `text` without the post-processor: cached segments are reused, the others
    /// encoded with `encode` (one call per missing segment, appending to the vector it is given
    /// and told how many ids the segment may have within the limit: it may stop once past that)
    /// and, when the whole text is within `limit`, remembered. Stops with
    /// [`Encoded::OverLimit`] once more than `limit` ids are known.
    pub(crate) fn encode<E>(
        &self,
        text: &str,
        limit: usize,
        encode: impl Fn(&str, usize, &mut Vec<u32>) -> Result<(), E>,
    ) -> Result<Encoded, E> {
        let Some(bounds) = self.boundaries(text) else {
            let mut ids = Vec::new();
            encode(text, limit, &mut ids)?;
            return Ok(if ids.len() > limit {
                Encoded::OverLimit(ids.len())
            } else {
                Encoded::Ids(ids)
            });
        };
        // Each segment's ids are kept compactly as they come (cached ones are shared, not
        // copied) and copied once into an output of the exact size: the ids of one segment
        // (the encoder's buffer) and at most six bytes per id besides, never the three copies a
        // doubling vector holds while it grows.
        let mut chunks: Vec<(u128, Ids, bool)> = Vec::with_capacity(bounds.len() - 1);
        let mut buffer = Vec::new();
        let mut total = 0usize;
        for w in bounds.windows(2) {
            let segment = &text[w[0]..w[1]];
            let key = xxh3_128(segment.as_bytes());
            let cached = if self.capacity_tokens > 0 {
                self.store.lock().get(key)
            } else {
                None
            };
            let (ids, fresh) = match cached {
                Some(ids) => (ids, false),
                None => {
                    buffer.clear();
                    encode(segment, limit.saturating_sub(total), &mut buffer)?;
                    (Ids::new(&buffer), true)
                }
            };
            total += ids.len();
            chunks.push((key, ids, fresh));
            if total > limit {
                return Ok(Encoded::OverLimit(total));
            }
        }
        drop(buffer);
        let mut out = Vec::with_capacity(total);
        for (_, ids, _) in &chunks {
            ids.extend_into(&mut out);
        }
        if self.capacity_tokens > 0 && chunks.iter().any(|c| c.2) {
            let mut store = self.store.lock();
            for (key, ids, fresh) in chunks {
                if fresh && ids.len() <= self.capacity_tokens / 2 {
                    store.insert(key, ids, self.capacity_tokens);
                }
            }
        }
        Ok(Encoded::Ids(out))
    }

    /// Ids of `text` encoded piece by piece at every cut point, without the cache: what tests
    /// compare with a whole encode to check the cut rule.
    pub(crate) fn encode_every_cut<E>(
        &self,
        text: &str,
        encode: impl Fn(&str) -> Result<Vec<u32>, E>,
    ) -> Result<Vec<u32>, E> {
        let bounds = self
            .boundaries_every(text, 1)
            .unwrap_or_else(|| vec![0, text.len()]);
        let mut out = Vec::new();
        for w in bounds.windows(2) {
            out.extend(encode(&text[w[0]..w[1]])?);
        }
        Ok(out)
    }

    /// Drops every cached segment (benchmarks use it to measure cold requests).
    pub(crate) fn clear(&self) {
        *self.store.lock() = Generations::default();
    }
}

impl Generations {
    fn get(&mut self, key: u128) -> Option<Ids> {
        if let Some(ids) = self.current.get(&key) {
            return Some(ids.clone());
        }
        let ids = self.previous.remove(&key)?;
        self.current_tokens += ids.len();
        self.current.insert(key, ids.clone());
        Some(ids)
    }

    fn insert(&mut self, key: u128, ids: Ids, capacity_tokens: usize) {
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
                cache
                    .encode(text, usize::MAX, |s, _, out| {
                        out.extend(direct(&tok, s)?);
                        Ok::<_, String>(())
                    })
                    .unwrap(),
                Encoded::Ids(direct(&tok, text).unwrap())
            );
        }
        // A short text is encoded directly.
        assert!(cache.boundaries("<|im_start|>user\nhi").is_none());
        // small-bpe has an NFC normalizer: normalized tokens are never cut points.
        assert!(cache.normalized.is_none());
    }

    #[test]
    fn budget_is_bounded() {
        let mut g = Generations::default();
        for k in 0..100u128 {
            g.insert(k, Ids::new(&[0u32; 10]), 200);
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
        g.insert(1000, Ids::new(&[0u32; 101]), 200);
        assert!(
            g.get(1000).is_none(),
            "an entry over half the budget is not kept"
        );
    }
}
