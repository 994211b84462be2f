//! Pre-tokenization by hand: the split regexes of the byte-level BPE families kv-epp knows
//! (GPT-2's, Llama 3's, Qwen 2's and DeepSeek V3's), each recognised by its exact pattern string
//! and scanned by a function written for it, so the words come out without building a regex
//! match, a string or an offset per word.
//!
//! Each scanner returns what the regex engine the `tokenizers` crate uses (fancy-regex,
//! backtracking, leftmost-first alternation) would match at a position, and words come out as
//! the crate's `Split` with `Isolated` behaviour cuts them: every match, and every gap between
//! matches, one word each. The character classes (`\p{L}`, `\p{N}`, `\s`, ...) are read from
//! `regex-syntax`, the same tables that regex engine uses; the `Digits` step uses
//! `char::is_numeric` as the crate does. Any other pattern is not recognised and the caller falls
//! back to the `tokenizers` crate. `bpe.rs` property tests compare the words' ids with the
//! crate's on random text for every family.

use std::sync::OnceLock;

use regex_syntax::hir::{Class, HirKind};

/// Character class bits.
const L: u8 = 1;
const N: u8 = 2;
const M: u8 = 4;
const P: u8 = 8;
const S: u8 = 16;
const WS: u8 = 32;
/// DeepSeek's `[一-龥぀-ゟ゠-ヿ]`.
const CJK: u8 = 64;

/// GPT-2's split regex (what `ByteLevel { use_regex: true }` applies).
pub(crate) const GPT2: &str =
    r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+";
/// Llama 3's `Split` regex.
pub(crate) const LLAMA3: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// Qwen 2's (and 2.5's, 3's) `Split` regex: Llama 3's with one digit per word.
pub(crate) const QWEN2: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// DeepSeek V3's three `Split` regexes, in order.
pub(crate) const DEEPSEEK_DIGITS: &str = r"\p{N}{1,3}";
pub(crate) const DEEPSEEK_CJK: &str = r"[一-龥぀-ゟ゠-ヿ]+";
pub(crate) const DEEPSEEK_MAIN: &str = "[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+|[^\r\n\\p{L}\\p{P}\\p{S}]?[\\p{L}\\p{M}]+| ?[\\p{P}\\p{S}]+[\r\n]*|\\s*[\r\n]+|\\s+(?!\\S)|\\s+";

/// The Unicode classes the patterns use, as the regex engine's tables define them.
struct Classes {
    /// Class bits of every BMP character.
    bmp: Box<[u8]>,
    /// Sorted ranges above the BMP, per class bit.
    astral: Vec<(u32, u32, u8)>,
    /// Characters `(?i)` lets stand for `s`, `t`, `r`, `e`, `v`, `m`, `l`, `d` (Llama 3's
    /// contractions are case-insensitive: `'S`, `'ſ`).
    fold: [(char, Vec<char>); 8],
}

fn class_ranges(pattern: &str) -> Option<Vec<(u32, u32)>> {
    let hir = regex_syntax::parse(pattern).ok()?;
    match hir.kind() {
        HirKind::Class(Class::Unicode(class)) => Some(
            class
                .iter()
                .map(|r| (r.start() as u32, r.end() as u32))
                .collect(),
        ),
        HirKind::Literal(lit) => {
            let c = std::str::from_utf8(&lit.0).ok()?.chars().next()? as u32;
            Some(vec![(c, c)])
        }
        _ => None,
    }
}

fn classes() -> Option<&'static Classes> {
    static CLASSES: OnceLock<Option<Classes>> = OnceLock::new();
    CLASSES
        .get_or_init(|| {
            let mut bmp = vec![0u8; 0x10000].into_boxed_slice();
            let mut astral = Vec::new();
            for (pattern, bit) in [
                (r"\p{L}", L),
                (r"\p{N}", N),
                (r"\p{M}", M),
                (r"\p{P}", P),
                (r"\p{S}", S),
                (r"\s", WS),
                ("[一-龥぀-ゟ゠-ヿ]", CJK),
            ] {
                for (start, end) in class_ranges(pattern)? {
                    for c in start..=end.min(0xFFFF) {
                        bmp[c as usize] |= bit;
                    }
                    if end > 0xFFFF {
                        astral.push((start.max(0x10000), end, bit));
                    }
                }
            }
            astral.sort_unstable();
            let fold_of = |c: char| -> Option<(char, Vec<char>)> {
                let mut all = Vec::new();
                for (start, end) in class_ranges(&format!("(?i){c}"))? {
                    all.extend((start..=end).filter_map(char::from_u32));
                }
                Some((c, all))
            };
            let fold = [
                fold_of('s')?,
                fold_of('t')?,
                fold_of('r')?,
                fold_of('e')?,
                fold_of('v')?,
                fold_of('m')?,
                fold_of('l')?,
                fold_of('d')?,
            ];
            Some(Classes { bmp, astral, fold })
        })
        .as_ref()
}

impl Classes {
    #[inline]
    fn of(&self, c: char) -> u8 {
        let c = c as u32;
        if c < 0x10000 {
            return self.bmp[c as usize];
        }
        // Few ranges per class lie above the BMP; scan those that can hold `c`.
        let end = self.astral.partition_point(|r| r.0 <= c);
        self.astral[..end]
            .iter()
            .filter(|r| r.1 >= c)
            .fold(0, |bits, r| bits | r.2)
    }

    fn folds(&self, c: char, to: char) -> bool {
        self.fold
            .iter()
            .find(|(base, _)| *base == to)
            .is_some_and(|(_, all)| all.contains(&c))
    }
}

/// The character at byte `i` of `s` (which must be a char boundary) and its class bits.
#[inline]
fn at(classes: &Classes, s: &str, i: usize) -> Option<(char, u8)> {
    let c = s.get(i..)?.chars().next()?;
    Some((c, classes.of(c)))
}

/// End of the run of characters whose class bits meet `mask`, from `i`.
#[inline]
fn run(classes: &Classes, s: &str, i: usize, mask: u8) -> usize {
    let mut end = i;
    for c in s[i..].chars() {
        if classes.of(c) & mask == 0 {
            break;
        }
        end += c.len_utf8();
    }
    end
}

/// End of the run of characters in none of the classes of `mask`, from `i`.
#[inline]
fn run_not(classes: &Classes, s: &str, i: usize, mask: u8) -> usize {
    let mut end = i;
    for c in s[i..].chars() {
        if classes.of(c) & mask != 0 {
            break;
        }
        end += c.len_utf8();
    }
    end
}

/// End of `[\r\n]*` from `i`.
#[inline]
fn newlines(s: &str, i: usize) -> usize {
    i + s.as_bytes()[i..]
        .iter()
        .take_while(|&&b| b == b'\r' || b == b'\n')
        .count()
}

/// `\s*[\r\n]+|\s+(?!\S)|\s+` at `i`, where a whitespace character starts (`crlf`: with the
/// first alternative).
fn whitespace(classes: &Classes, s: &str, i: usize, crlf: bool) -> usize {
    let end = run(classes, s, i, WS);
    if crlf {
        // `\s*` backs off to the last line break of the run, `[\r\n]+` takes it.
        if let Some(last) = s.as_bytes()[i..end]
            .iter()
            .rposition(|&b| b == b'\r' || b == b'\n')
        {
            return i + last + 1;
        }
    }
    if end == s.len() {
        return end;
    }
    // `\s+(?!\S)` backs off one character before the non-space; `\s+` when that leaves none.
    let last = s[i..end].chars().next_back().map_or(0, char::len_utf8);
    if end - last > i { end - last } else { end }
}

/// One known split regex.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Pattern {
    Gpt2,
    /// Llama 3 (`digits` = 3) and Qwen 2 (`digits` = 1).
    Llama {
        digits: usize,
    },
    DeepSeekDigits,
    DeepSeekCjk,
    DeepSeekMain,
}

impl Pattern {
    /// The scanner of `regex`, when it is one of the known patterns.
    pub(crate) fn of(regex: &str) -> Option<Pattern> {
        classes()?;
        Some(match regex {
            GPT2 => Pattern::Gpt2,
            LLAMA3 => Pattern::Llama { digits: 3 },
            QWEN2 => Pattern::Llama { digits: 1 },
            DEEPSEEK_DIGITS => Pattern::DeepSeekDigits,
            DEEPSEEK_CJK => Pattern::DeepSeekCjk,
            DEEPSEEK_MAIN => Pattern::DeepSeekMain,
            _ => return None,
        })
    }

    /// The end of the regex's match starting at byte `i` of `s`, if one starts there.
    fn match_at(self, classes: &Classes, s: &str, i: usize) -> Option<usize> {
        let (c0, f0) = at(classes, s, i)?;
        let j = i + c0.len_utf8();
        let next = at(classes, s, j);
        let f1 = next.map_or(0, |n| n.1);
        match self {
            Pattern::Gpt2 => {
                if c0 == '\'' {
                    let rest = &s.as_bytes()[j..];
                    for suffix in [&b"s"[..], b"t", b"re", b"ve", b"m", b"ll", b"d"] {
                        if rest.starts_with(suffix) {
                            return Some(j + suffix.len());
                        }
                    }
                }
                for class in [L, N] {
                    if f0 & class != 0 {
                        return Some(run(classes, s, i, class));
                    }
                    if c0 == ' ' && f1 & class != 0 {
                        return Some(run(classes, s, j, class));
                    }
                }
                let word = WS | L | N;
                if f0 & word == 0 {
                    return Some(run_not(classes, s, i, word));
                }
                if c0 == ' ' && next.is_some() && f1 & word == 0 {
                    return Some(run_not(classes, s, j, word));
                }
                Some(whitespace(classes, s, i, false))
            }
            Pattern::Llama { digits } => {
                if c0 == '\''
                    && let Some((c1, _)) = next
                {
                    let k = j + c1.len_utf8();
                    for single in ['s', 't', 'm', 'd'] {
                        if classes.folds(c1, single) {
                            return Some(k);
                        }
                    }
                    if let Some((c2, _)) = at(classes, s, k) {
                        for (a, b) in [('r', 'e'), ('v', 'e'), ('l', 'l')] {
                            if classes.folds(c1, a) && classes.folds(c2, b) {
                                return Some(k + c2.len_utf8());
                            }
                        }
                    }
                }
                if f0 & L != 0 {
                    return Some(run(classes, s, i, L));
                }
                if c0 != '\r' && c0 != '\n' && f0 & N == 0 && f1 & L != 0 {
                    return Some(run(classes, s, j, L));
                }
                if f0 & N != 0 {
                    let mut end = i;
                    for c in s[i..].chars().take(digits) {
                        if classes.of(c) & N == 0 {
                            break;
                        }
                        end += c.len_utf8();
                    }
                    return Some(end);
                }
                let word = WS | L | N;
                if f0 & word == 0 {
                    return Some(newlines(s, run_not(classes, s, i, word)));
                }
                if c0 == ' ' && next.is_some() && f1 & word == 0 {
                    return Some(newlines(s, run_not(classes, s, j, word)));
                }
                Some(whitespace(classes, s, i, true))
            }
            Pattern::DeepSeekDigits => (f0 & N != 0).then(|| {
                let mut end = i;
                for c in s[i..].chars().take(3) {
                    if classes.of(c) & N == 0 {
                        break;
                    }
                    end += c.len_utf8();
                }
                end
            }),
            Pattern::DeepSeekCjk => (f0 & CJK != 0).then(|| run(classes, s, i, CJK)),
            Pattern::DeepSeekMain => {
                if c0.is_ascii_punctuation() && next.is_some_and(|n| n.0.is_ascii_alphabetic()) {
                    let letters = s.as_bytes()[j..]
                        .iter()
                        .take_while(|b| b.is_ascii_alphabetic())
                        .count();
                    return Some(j + letters);
                }
                if f0 & (L | M) != 0 {
                    return Some(run(classes, s, i, L | M));
                }
                if c0 != '\r' && c0 != '\n' && f0 & (L | P | S) == 0 && f1 & (L | M) != 0 {
                    return Some(run(classes, s, j, L | M));
                }
                if f0 & (P | S) != 0 {
                    return Some(newlines(s, run(classes, s, i, P | S)));
                }
                if c0 == ' ' && f1 & (P | S) != 0 {
                    return Some(newlines(s, run(classes, s, j, P | S)));
                }
                (f0 & WS != 0).then(|| whitespace(classes, s, i, true))
            }
        }
    }

    /// Calls `word` with every piece `Split { behavior: Isolated }` cuts `s` into: each match
    /// and each gap between matches. Stops early when `word` returns `false`.
    fn split(self, s: &str, word: &mut dyn FnMut(&str) -> bool) -> bool {
        let Some(classes) = classes() else {
            return word(s);
        };
        let mut pos = 0;
        let mut gap = 0;
        while pos < s.len() {
            match self.match_at(classes, s, pos) {
                Some(end) if end > pos => {
                    if gap < pos && !word(&s[gap..pos]) {
                        return false;
                    }
                    if !word(&s[pos..end]) {
                        return false;
                    }
                    pos = end;
                    gap = end;
                }
                _ => pos += s[pos..].chars().next().map_or(1, char::len_utf8),
            }
        }
        gap >= s.len() || word(&s[gap..])
    }
}

/// One pre-tokenizer step before the byte-level mapping.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Step {
    /// `Split` with a known regex, `Isolated`, not inverted (or `ByteLevel`'s own regex).
    Split(Pattern),
    /// `Digits`: numeric characters (`char::is_numeric`) apart, one each when `individual`.
    Digits { individual: bool },
}

/// Calls `word` with each word `steps` cut `s` into, in order; `false` from `word` stops.
pub(crate) fn words(steps: &[Step], s: &str, word: &mut dyn FnMut(&str) -> bool) -> bool {
    let Some((step, rest)) = steps.split_first() else {
        return s.is_empty() || word(s);
    };
    match *step {
        Step::Split(pattern) => pattern.split(s, &mut |piece| words(rest, piece, word)),
        Step::Digits { individual } => {
            let mut start = 0;
            let mut in_digits = false;
            for (i, c) in s.char_indices() {
                let numeric = c.is_numeric();
                let boundary = if numeric {
                    individual || !in_digits
                } else {
                    in_digits
                };
                if boundary && i > start {
                    if !words(rest, &s[start..i], word) {
                        return false;
                    }
                    start = i;
                }
                in_digits = numeric;
            }
            start >= s.len() || words(rest, &s[start..], word)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cut(steps: &[Step], s: &str) -> Vec<String> {
        let mut out = Vec::new();
        words(steps, s, &mut |w| {
            out.push(w.to_owned());
            true
        });
        out
    }

    /// The scanners against the regex engine the `tokenizers` crate uses, on tricky strings.
    #[test]
    fn scanners_match_the_regex_engine() {
        let texts = [
            "Hello world's end  \n\n  x\t\ty 123456 7\r\n\r\n",
            "I'LL 'S 'ſ 'Re we've  .Hello ..\n\n:: a\u{a0}b 一二三 ひらがなカタカナ 😀😀 e\u{301}",
            "   trailing   ",
            "x  \n",
            "\u{301}a $$a #x %% \u{200d}q 1\u{2028}2",
        ];
        for (regex, pattern) in [
            (GPT2, Pattern::Gpt2),
            (LLAMA3, Pattern::Llama { digits: 3 }),
            (QWEN2, Pattern::Llama { digits: 1 }),
            (DEEPSEEK_DIGITS, Pattern::DeepSeekDigits),
            (DEEPSEEK_CJK, Pattern::DeepSeekCjk),
            (DEEPSEEK_MAIN, Pattern::DeepSeekMain),
        ] {
            assert_eq!(Pattern::of(regex), Some(pattern));
            let re = fancy_regex::Regex::new(regex).unwrap();
            for text in texts {
                let mut expected = Vec::new();
                let mut prev = 0;
                for m in re.find_iter(text) {
                    let m = m.unwrap();
                    if m.start() > prev {
                        expected.push(text[prev..m.start()].to_owned());
                    }
                    expected.push(m.as_str().to_owned());
                    prev = m.end();
                }
                if prev < text.len() {
                    expected.push(text[prev..].to_owned());
                }
                assert_eq!(cut(&[Step::Split(pattern)], text), expected, "{regex}");
            }
        }
        assert_eq!(Pattern::of(r"\p{N}+"), None);
    }

    #[test]
    fn digits_step() {
        let individual = [Step::Digits { individual: true }];
        assert_eq!(cut(&individual, "ab12c3"), ["ab", "1", "2", "c", "3"]);
        let contiguous = [Step::Digits { individual: false }];
        assert_eq!(cut(&contiguous, "ab12c3"), ["ab", "12", "c", "3"]);
    }
}
