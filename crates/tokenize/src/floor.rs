//! A lower bound on a text's token count from its length alone, for refusing prompts over
//! `max_prompt_tokens` before encoding them.
//!
//! Sound only where each step provably cannot make text vanish or one token cover more than a
//! known number of bytes, so it exists only for BPE models (a BPE token covers the bytes of its
//! vocabulary string at most: byte-level tokens map one byte to a one- or two-byte character, and
//! the unknown token, when not fused, covers one character), normalizers made of Unicode forms
//! and lowercasing (each shrinks UTF-8 at most 4×: no character is longer than 4 bytes and none
//! maps to less than one), and pre-tokenizers that split without removing anything. Added tokens
//! with `lstrip`/`rstrip` can swallow any run of whitespace, so the bound then counts only
//! non-whitespace bytes. Anything else gets no bound (0), never a wrong one.

use serde_json::Value;
use tokenizers::Tokenizer;

/// `tokens ≥ ceil(counted_bytes / bytes_per_token)`.
#[derive(Clone, Copy, Debug)]
pub(crate) struct TokenFloor {
    /// The most text bytes one token can stand for; 0 = no bound.
    bytes_per_token: usize,
    /// Count only non-whitespace bytes.
    skip_whitespace: bool,
}

impl TokenFloor {
    /// The bound for `tokenizer` (`bytes_per_token == 0` when none is sound).
    /// `json` is the tokenizer's serialization.
    pub(crate) fn of(tokenizer: &Tokenizer, json: &Value) -> TokenFloor {
        let none = TokenFloor {
            bytes_per_token: 0,
            skip_whitespace: false,
        };
        let model = &json["model"];
        if model["type"] != "BPE" || model["fuse_unk"] == true {
            return none;
        }
        let Some(shrink) = shrink(&json["normalizer"]) else {
            return none;
        };
        if !keeps_text(&json["pre_tokenizer"]) {
            return none;
        }
        let vocab_max = tokenizer
            .get_vocab(true)
            .keys()
            .map(String::len)
            .max()
            .unwrap_or(0)
            .max(4);
        let added = tokenizer.get_added_vocabulary().get_added_tokens_decoder();
        TokenFloor {
            bytes_per_token: vocab_max * shrink,
            skip_whitespace: added.values().any(|t| t.lstrip || t.rstrip),
        }
    }

    /// At least this many tokens encode `text` (0 when no bound is known). One pass over the
    /// bytes.
    pub(crate) fn min_tokens(&self, text: &str) -> usize {
        if self.bytes_per_token == 0 {
            return 0;
        }
        let counted = if self.skip_whitespace {
            text.chars()
                .filter(|c| !c.is_whitespace())
                .map(char::len_utf8)
                .sum()
        } else {
            text.len()
        };
        counted.div_ceil(self.bytes_per_token)
    }
}

/// How many times the normalizer can shrink UTF-8 text, or `None` when unknown.
fn shrink(n: &Value) -> Option<usize> {
    match n {
        Value::Null => Some(1),
        _ => match n.get("type")?.as_str()? {
            "NFC" | "NFD" | "NFKC" | "NFKD" | "Lowercase" => Some(4),
            "Sequence" => n
                .get("normalizers")?
                .as_array()?
                .iter()
                .try_fold(1usize, |acc, inner| {
                    Some(acc.saturating_mul(shrink(inner)?))
                }),
            _ => None,
        },
    }
}

/// Whether the pre-tokenizer only splits (and maps bytes), never dropping text.
fn keeps_text(p: &Value) -> bool {
    match p {
        Value::Null => true,
        _ => match p.get("type").and_then(Value::as_str) {
            Some("ByteLevel" | "Digits" | "Metaspace" | "Punctuation" | "UnicodeScripts") => true,
            Some("Split") => p["behavior"] != "Removed",
            Some("Sequence") => p["pretokenizers"]
                .as_array()
                .is_some_and(|steps| steps.iter().all(keeps_text)),
            _ => false,
        },
    }
}
