//! Where a prompt's text can be cut so that encoding the pieces gives exactly the ids of the
//! whole: `encode(a + b) == encode(a) ++ encode(b)`.
//!
//! The tokenizer's pipeline (without the post-processor) is: split on added-token matches,
//! normalize each piece, pre-tokenize each piece into words by a sequence of steps (each step
//! splits every piece it is given on its own), then the model turns each word into ids on its
//! own. So a cut is exact when every stage splits there anyway and each side comes out the same
//! as within the whole. Two kinds of cut qualify:
//!
//! - **At an added token** (`<|im_start|>`, `<｜User｜>`): the tokenizer itself splits there
//!   ([`Cutter`], the same patterns and leftmost-longest rule); never at `lstrip`/`single_word`
//!   tokens or tokens starting with whitespace, whose match depends on the left neighbour.
//! - **In plain text, between two ASCII characters `c` and `d`** ([`PlainCuts`]), when it is
//!   proved from the tokenizer's own configuration that
//!   1. no added-token match (as the tokenizer finds them, strip extents included) covers the
//!      cut, so both sides see the same added tokens;
//!   2. the normalizer is a sequence of Unicode forms / lowercasing, which map ASCII characters
//!      without looking at neighbours and never combine an ASCII starter with anything;
//!   3. the pre-tokenizer steps, up to one that *forces* a word boundary between `c` and `d`,
//!      are each *compatible* with the cut: a step splits the piece `..c|d..` exactly as it splits
//!      `..c` and `d..`. For a regex split (`Split` with `Isolated`, `ByteLevel`'s own regex)
//!      that is read off the regex's syntax tree ([`RegexFacts`]): no string the regex can
//!      match contains `cd`; no look-behind, anchor or word boundary (a match found at a position
//!      depends only on the text after it); a look-ahead only one character long and never
//!      right after a `c` (so it never looks across the cut); the regex never matches the empty
//!      string. It forces the boundary when it can match `c` or `d` alone (then a match ends or
//!      starts at the cut, since none can span it).
//!
//! Anything not understood (another pre-tokenizer or normalizer type, a regex feature outside
//! that list) simply allows no plain cuts. Each claim is checked by the property tests below
//! and by `tests/tokenize_fixtures.rs` (cached == uncached on every case).

use aho_corasick::{AhoCorasick, MatchKind};
use fancy_regex::{Expr, LookAround};
use serde_json::Value;
use tokenizers::{AddedToken, Tokenizer};

/// GPT-2's split regex, which `ByteLevel { use_regex: true }` applies (tokenizers'
/// `byte_level.rs`).
const BYTE_LEVEL_REGEX: &str =
    r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+";

/// Leftmost-longest matcher over a set of added tokens, and which of them may start a segment.
pub(crate) struct Cutter {
    pub(crate) matcher: AhoCorasick,
    pub(crate) cuttable: Vec<bool>,
    /// Per pattern: (`lstrip`, `rstrip`): the match absorbs whitespace on that side.
    pub(crate) strips: Vec<(bool, bool)>,
}

impl Cutter {
    pub(crate) fn new<'a>(tokens: impl Iterator<Item = &'a AddedToken>) -> Option<Cutter> {
        let mut patterns = Vec::new();
        let mut cuttable = Vec::new();
        let mut strips = Vec::new();
        for token in tokens.filter(|t| !t.content.is_empty()) {
            patterns.push(token.content.as_str());
            // A token that begins with whitespace could overlap what its left neighbour's
            // `rstrip` absorbs; never cut there.
            let starts_blank = token.content.starts_with(char::is_whitespace);
            cuttable.push(!token.lstrip && !token.single_word && !starts_blank);
            strips.push((token.lstrip, token.rstrip));
        }
        let matcher = AhoCorasick::builder()
            .match_kind(MatchKind::LeftmostLongest)
            .build(&patterns)
            .ok()?;
        Some(Cutter {
            matcher,
            cuttable,
            strips,
        })
    }
}

/// A set of ASCII characters, one bit each.
type Ascii = u128;

fn bit(c: u8) -> Ascii {
    if c < 128 { 1 << c } else { 0 }
}

/// The plain-text cut rule of one tokenizer: `allowed[c] & bit(d)` when a cut between ASCII
/// characters `c` and `d` is exact (see the module doc).
#[derive(Clone)]
pub(crate) struct PlainCuts {
    allowed: [Ascii; 128],
}

impl PlainCuts {
    /// Whether cutting `text` at byte `at` (between two ASCII characters) is exact as far as
    /// normalizer and pre-tokenizer go. Added-token matches are the caller's to exclude.
    #[inline]
    pub(crate) fn allows(&self, text: &[u8], at: usize) -> bool {
        at > 0
            && at < text.len()
            && text[at - 1] < 128
            && self.allowed[text[at - 1] as usize] & bit(text[at]) != 0
    }

    /// The rule for `tokenizer`, or `None` when its normalizer or pre-tokenizer is not one this
    /// module can reason about (or allows no cut at all).
    pub(crate) fn of(tokenizer: &Tokenizer) -> Option<PlainCuts> {
        let lowercase = match tokenizer.get_normalizer() {
            None => false,
            Some(n) => normalizer_lowercases(&serde_json::to_value(n).ok()?)?,
        };
        let steps = match tokenizer.get_pre_tokenizer() {
            None => Vec::new(),
            Some(p) => pre_tokenizer_steps(&serde_json::to_value(p).ok()?)?,
        };
        let fold = |c: u8| if lowercase { c.to_ascii_lowercase() } else { c };
        let mut allowed = [0; 128];
        let mut any = false;
        for c in 0..128u8 {
            for d in 0..128u8 {
                let (c2, d2) = (fold(c), fold(d));
                let mut forced = false;
                for step in &steps {
                    if !step.compatible(c2, d2) {
                        break;
                    }
                    if step.forces(c2, d2) {
                        forced = true;
                        break;
                    }
                }
                if forced {
                    allowed[c as usize] |= bit(d);
                    any = true;
                }
            }
        }
        any.then_some(PlainCuts { allowed })
    }
}

/// `Some(lowercases)` for normalizers made only of Unicode normal forms and lowercasing (ASCII in,
/// ASCII out, never combined with a neighbour); `None` for anything else.
fn normalizer_lowercases(n: &Value) -> Option<bool> {
    match n.get("type")?.as_str()? {
        "NFC" | "NFD" | "NFKC" | "NFKD" => Some(false),
        "Lowercase" => Some(true),
        "Sequence" => {
            let mut lower = false;
            for inner in n.get("normalizers")?.as_array()? {
                lower |= normalizer_lowercases(inner)?;
            }
            Some(lower)
        }
        _ => None,
    }
}

/// One pre-tokenizer step, as far as cuts are concerned.
enum Step {
    /// A regex split (`Isolated`); `None` = a step that never splits (ByteLevel without regex).
    Regex(Option<Box<RegexFacts>>),
    /// `Digits`: numeric characters apart from the rest (one each when `individual`).
    Digits { individual: bool },
    /// A step that cannot be cut through (`ByteLevel` adding a prefix space to each piece).
    Opaque,
}

impl Step {
    fn compatible(&self, c: u8, d: u8) -> bool {
        match self {
            Step::Regex(None) | Step::Digits { .. } => true,
            Step::Regex(Some(facts)) => facts.compatible(c, d),
            Step::Opaque => false,
        }
    }

    fn forces(&self, c: u8, d: u8) -> bool {
        match self {
            Step::Regex(None) | Step::Opaque => false,
            Step::Regex(Some(facts)) => facts.single & (bit(c) | bit(d)) != 0,
            Step::Digits { individual } => {
                let (cn, dn) = (c.is_ascii_digit(), d.is_ascii_digit());
                cn != dn || (*individual && cn)
            }
        }
    }
}

/// The steps of a pre-tokenizer, or `None` when one of them is not understood.
fn pre_tokenizer_steps(p: &Value) -> Option<Vec<Step>> {
    Some(match p.get("type")?.as_str()? {
        "Sequence" => {
            let mut steps = Vec::new();
            for inner in p.get("pretokenizers")?.as_array()? {
                steps.extend(pre_tokenizer_steps(inner)?);
            }
            steps
        }
        "ByteLevel" => {
            let prefix_space = p.get("add_prefix_space")?.as_bool()?;
            let regex = p.get("use_regex").and_then(Value::as_bool).unwrap_or(true);
            let mut steps = Vec::new();
            if prefix_space {
                steps.push(Step::Opaque);
            }
            steps.push(Step::Regex(if regex {
                Some(Box::new(RegexFacts::of(BYTE_LEVEL_REGEX)?))
            } else {
                None
            }));
            steps
        }
        "Digits" => vec![Step::Digits {
            individual: p.get("individual_digits")?.as_bool()?,
        }],
        "Split" => {
            if p.get("behavior")?.as_str()? != "Isolated" || p.get("invert")?.as_bool()? {
                return None;
            }
            let pattern = p.get("pattern")?;
            let regex = match (pattern.get("Regex"), pattern.get("String")) {
                (Some(r), _) => r.as_str()?.to_owned(),
                (None, Some(s)) => fancy_regex::escape(s.as_str()?).into_owned(),
                _ => return None,
            };
            vec![Step::Regex(Some(Box::new(RegexFacts::of(&regex)?)))]
        }
        _ => return None,
    })
}

/// What the module doc's regex conditions need to know about a regex, over ASCII characters.
#[derive(Clone, Copy, Debug)]
pub(crate) struct RegexFacts {
    /// Characters a match can start with / end with.
    first: Ascii,
    last: Ascii,
    /// `pairs[c]`: characters that can directly follow `c` inside one match.
    pairs: [Ascii; 128],
    /// Characters right after which a look-ahead can be evaluated.
    look_after: Ascii,
    /// A look-ahead can be evaluated before anything is consumed.
    look_start: bool,
    /// Can match the empty string (look-arounds counted as passing).
    nullable: bool,
    /// Characters the regex can match alone, without a look-around.
    single: Ascii,
    /// Can match the empty string without a look-around.
    empty_plain: bool,
}

impl RegexFacts {
    /// The facts of `pattern`, or `None` when it uses a feature outside the supported set.
    pub(crate) fn of(pattern: &str) -> Option<RegexFacts> {
        let tree = Expr::parse_tree(pattern).ok()?;
        let facts = RegexFacts::expr(&tree.expr)?;
        (!facts.nullable).then_some(facts)
    }

    fn compatible(&self, c: u8, d: u8) -> bool {
        self.pairs[c as usize] & bit(d) == 0 && self.look_after & bit(c) == 0
    }

    fn empty() -> RegexFacts {
        RegexFacts {
            first: 0,
            last: 0,
            pairs: [0; 128],
            look_after: 0,
            look_start: false,
            nullable: true,
            single: 0,
            empty_plain: true,
        }
    }

    /// One character from `class` (its ASCII part: only ASCII characters can be `c` or `d`).
    fn char_class(class: Ascii) -> RegexFacts {
        RegexFacts {
            first: class,
            last: class,
            pairs: [0; 128],
            look_after: 0,
            look_start: false,
            nullable: false,
            single: class,
            empty_plain: false,
        }
    }

    fn concat(a: RegexFacts, b: RegexFacts) -> RegexFacts {
        let mut pairs = a.pairs;
        for (c, p) in pairs.iter_mut().enumerate() {
            *p |= b.pairs[c];
            if a.last & (1 << c) != 0 {
                *p |= b.first;
            }
        }
        let single_a = if b.empty_plain { a.single } else { 0 };
        let single_b = if a.empty_plain { b.single } else { 0 };
        RegexFacts {
            first: a.first | if a.nullable { b.first } else { 0 },
            last: b.last | if b.nullable { a.last } else { 0 },
            pairs,
            look_after: a.look_after | b.look_after | if b.look_start { a.last } else { 0 },
            look_start: a.look_start || (a.nullable && b.look_start),
            nullable: a.nullable && b.nullable,
            single: single_a | single_b,
            empty_plain: a.empty_plain && b.empty_plain,
        }
    }

    fn alt(a: RegexFacts, b: RegexFacts) -> RegexFacts {
        let mut pairs = a.pairs;
        for (c, p) in pairs.iter_mut().enumerate() {
            *p |= b.pairs[c];
        }
        RegexFacts {
            first: a.first | b.first,
            last: a.last | b.last,
            pairs,
            look_after: a.look_after | b.look_after,
            look_start: a.look_start || b.look_start,
            nullable: a.nullable || b.nullable,
            single: a.single | b.single,
            empty_plain: a.empty_plain || b.empty_plain,
        }
    }

    fn repeat(child: RegexFacts, lo: usize, hi: usize) -> RegexFacts {
        if hi == 0 {
            return RegexFacts::empty();
        }
        let mut facts = child;
        if hi > 1 {
            for (c, p) in facts.pairs.iter_mut().enumerate() {
                if child.last & (1 << c) != 0 {
                    *p |= child.first;
                }
            }
            if child.look_start {
                facts.look_after |= child.last;
            }
        }
        facts.nullable = lo == 0 || child.nullable;
        facts.empty_plain = lo == 0 || child.empty_plain;
        facts.single = if lo <= 1 || child.empty_plain {
            child.single
        } else {
            0
        };
        facts
    }

    fn expr(e: &Expr) -> Option<RegexFacts> {
        Some(match e {
            Expr::Empty => RegexFacts::empty(),
            Expr::Any { newline } => {
                let all = !0u128;
                RegexFacts::char_class(if *newline { all } else { all & !bit(b'\n') })
            }
            Expr::Literal { val, casei } => {
                let mut facts = RegexFacts::empty();
                for ch in val.chars() {
                    facts = RegexFacts::concat(facts, RegexFacts::char_class(char_set(ch, *casei)));
                }
                facts
            }
            Expr::Delegate { inner, size, casei } => {
                if *size != 1 {
                    return None;
                }
                RegexFacts::char_class(class_set(inner, *casei)?)
            }
            Expr::Concat(parts) => {
                let mut facts = RegexFacts::empty();
                for part in parts {
                    facts = RegexFacts::concat(facts, RegexFacts::expr(part)?);
                }
                facts
            }
            Expr::Alt(branches) => {
                let mut iter = branches.iter();
                let mut facts = RegexFacts::expr(iter.next()?)?;
                for branch in iter {
                    facts = RegexFacts::alt(facts, RegexFacts::expr(branch)?);
                }
                facts
            }
            Expr::Group(inner) => RegexFacts::expr(inner)?,
            Expr::Repeat { child, lo, hi, .. } => {
                RegexFacts::repeat(RegexFacts::expr(child)?, *lo, *hi)
            }
            Expr::LookAround(body, LookAround::LookAhead | LookAround::LookAheadNeg) => {
                // Only a one-character look-ahead: it never reads past the character after
                // the position it is evaluated at.
                let inner = RegexFacts::expr(body)?;
                if inner.nullable || !one_char(body) {
                    return None;
                }
                RegexFacts {
                    look_start: true,
                    empty_plain: false,
                    ..RegexFacts::empty()
                }
            }
            // Look-behind, anchors, word boundaries, back-references, atomic groups,
            // conditionals, ...: a match would depend on more than the text after its start.
            _ => return None,
        })
    }
}

/// Whether `e` matches exactly one character.
fn one_char(e: &Expr) -> bool {
    match e {
        Expr::Any { .. } => true,
        Expr::Delegate { size, .. } => *size == 1,
        Expr::Literal { val, .. } => val.chars().count() == 1,
        Expr::Group(inner) => one_char(inner),
        Expr::Alt(branches) => branches.iter().all(one_char),
        _ => false,
    }
}

/// The ASCII characters matching the literal character `ch`.
fn char_set(ch: char, casei: bool) -> Ascii {
    if !ch.is_ascii() {
        // Case-insensitive non-ASCII letters can match ASCII ones (K, the Kelvin sign): be
        // conservative and let them stand for every ASCII letter.
        return if casei { ascii_letters() } else { 0 };
    }
    let b = ch as u8;
    if casei {
        bit(b.to_ascii_lowercase()) | bit(b.to_ascii_uppercase())
    } else {
        bit(b)
    }
}

fn ascii_letters() -> Ascii {
    (b'a'..=b'z')
        .chain(b'A'..=b'Z')
        .fold(0, |set, c| set | bit(c))
}

/// The ASCII characters a one-character regex (a class such as `\p{L}` or `[^\r\n]`) matches,
/// asked of the `regex` crate itself.
fn class_set(inner: &str, casei: bool) -> Option<Ascii> {
    let flags = if casei { "(?i)" } else { "" };
    let re = regex::Regex::new(&format!(r"\A{flags}(?:{inner})\z")).ok()?;
    let mut set = 0;
    let mut buf = [0u8; 4];
    for c in 0..128u8 {
        if re.is_match((c as char).encode_utf8(&mut buf)) {
            set |= bit(c);
        }
    }
    Some(set)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn allowed(facts: &RegexFacts, c: u8, d: u8) -> (bool, bool) {
        (
            facts.compatible(c, d),
            facts.single & (bit(c) | bit(d)) != 0,
        )
    }

    #[test]
    fn gpt2_regex_cuts_between_words_not_inside_them() {
        let f = RegexFacts::of(BYTE_LEVEL_REGEX).unwrap();
        // "word\nword", "word word", "word.": every one a boundary of the split.
        assert_eq!(allowed(&f, b'd', b'\n'), (true, true));
        assert_eq!(allowed(&f, b'd', b' '), (true, true));
        assert_eq!(allowed(&f, b'd', b'.'), (true, true));
        // Inside a word, or between a space and the word it leads: never.
        assert!(!f.compatible(b'a', b'b'));
        assert!(!f.compatible(b' ', b'a'));
        // Whitespace runs end with a look-ahead: never cut right after whitespace.
        assert!(!f.compatible(b' ', b'\n'));
        // `'s`: the apostrophe and the letter after it belong together.
        assert!(!f.compatible(b'\'', b's'));
    }

    #[test]
    fn unsupported_regex_features_allow_nothing() {
        for pattern in [
            r"(?<=a)b", r"\bword", r"^a", r"a$", r"(a)\1", r"(?>ab)", r"a*",
        ] {
            assert!(RegexFacts::of(pattern).is_none(), "{pattern}");
        }
        // A look-ahead longer than one character could read across the cut.
        assert!(RegexFacts::of(r"\s+(?!ab)").is_none());
    }

    #[test]
    fn punctuation_glued_to_newlines_is_not_cut() {
        // Llama 3's split: `.\n` is one word, `x\n` is two.
        let f = RegexFacts::of(
            r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
        )
        .unwrap();
        assert!(!f.compatible(b'.', b'\n'));
        assert_eq!(allowed(&f, b'x', b'\n'), (true, true));
        // Case-insensitive `'S`.
        assert!(!f.compatible(b'\'', b'S'));
    }
}
