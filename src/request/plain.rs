//! The common request shape read in one pass without the general parser: an object of plain
//! members (no `\u` escapes, no exponents, bounded nesting) whose prompt is an array of plain
//! integers or a text without escapes. For anything else [`read`] answers `None` and the caller
//! uses the general path (serde_json), so what this module accepts is only ever a subset of what
//! serde_json accepts, read to the same fields (`request`'s property tests hold it to that).

use super::{Fields, Prompt, SaltValue, Scalar};

/// Nesting followed here; deeper documents go to the general path (serde_json stops at 128).
const MAX_DEPTH: usize = 64;
/// Digits of a number that can neither overflow nor lose the general path's reading.
const MAX_DIGITS: usize = 18;

/// The fields of `body` when it has the common shape, else `None`.
pub(super) fn read(body: &[u8]) -> Option<Fields> {
    let mut r = Reader { b: body, i: 0 };
    r.ws();
    r.eat(b'{')?;
    let mut f = Fields::default();
    r.ws();
    if r.peek()? == b'}' {
        r.i += 1;
    } else {
        loop {
            let key = r.key()?;
            r.ws();
            r.eat(b':')?;
            r.ws();
            match key {
                b"model" => f.model = Some(r.scalar(1)?),
                b"prompt" => f.prompt = Some(Ok(r.prompt()?)),
                b"messages" => {
                    r.skip(1)?;
                    f.messages = true;
                }
                b"max_completion_tokens" => f.max_completion_tokens = r.scalar(1)?.as_u64(),
                b"max_tokens" => f.max_tokens = r.scalar(1)?.as_u64(),
                b"cache_salt" => {
                    f.body_salt = r.scalar(1)?.salt();
                    f.salt_members = true;
                }
                b"nvext" => {
                    let (salt, member) = r.nvext()?;
                    f.nvext_salt = salt;
                    f.salt_members |= member;
                }
                _ => r.skip(1)?,
            }
            r.ws();
            match r.next()? {
                b',' => r.ws(),
                b'}' => break,
                _ => return None,
            }
        }
    }
    r.ws();
    (r.i == body.len()).then_some(f)
}

struct Reader<'a> {
    b: &'a [u8],
    i: usize,
}

impl<'a> Reader<'a> {
    fn peek(&self) -> Option<u8> {
        self.b.get(self.i).copied()
    }

    fn next(&mut self) -> Option<u8> {
        let c = self.peek()?;
        self.i += 1;
        Some(c)
    }

    fn eat(&mut self, c: u8) -> Option<()> {
        (self.next()? == c).then_some(())
    }

    fn ws(&mut self) {
        while let Some(b' ' | b'\t' | b'\n' | b'\r') = self.peek() {
            self.i += 1;
        }
    }

    /// A string at the cursor: its raw text between the quotes (checked as UTF-8 once), and
    /// whether it had escapes (only the one-character ones; `\u` is left to the general path).
    fn string(&mut self) -> Option<(&'a str, bool)> {
        self.eat(b'"')?;
        let start = self.i;
        let mut escaped = false;
        loop {
            match self.next()? {
                b'"' => break,
                b'\\' => {
                    escaped = true;
                    if !matches!(
                        self.next()?,
                        b'"' | b'\\' | b'/' | b'b' | b'f' | b'n' | b'r' | b't'
                    ) {
                        return None;
                    }
                }
                c if c < 0x20 => return None,
                _ => {}
            }
        }
        let raw = std::str::from_utf8(&self.b[start..self.i - 1]).ok()?;
        Some((raw, escaped))
    }

    /// A string whose value is its raw bytes (no escapes).
    fn plain_string(&mut self) -> Option<&'a str> {
        match self.string()? {
            (raw, false) => Some(raw),
            (_, true) => None,
        }
    }

    fn key(&mut self) -> Option<&'a [u8]> {
        self.plain_string().map(str::as_bytes)
    }

    fn literal(&mut self, word: &[u8]) -> Option<()> {
        let end = self.i + word.len();
        (self.b.get(self.i..end)? == word).then(|| self.i = end)
    }

    /// A number without exponent and of at most [`MAX_DIGITS`] digits: its value when it is a
    /// non-negative integer.
    fn number(&mut self) -> Option<Option<u64>> {
        let negative = self.peek()? == b'-';
        if negative {
            self.i += 1;
        }
        let start = self.i;
        let mut v = 0u64;
        while let Some(c @ b'0'..=b'9') = self.peek() {
            if self.i - start == MAX_DIGITS {
                return None;
            }
            v = v * 10 + u64::from(c - b'0');
            self.i += 1;
        }
        let int_digits = self.i - start;
        if int_digits == 0 || (int_digits > 1 && self.b[start] == b'0') {
            return None;
        }
        let mut integer = true;
        if self.peek() == Some(b'.') {
            integer = false;
            self.i += 1;
            let frac = self.i;
            while let Some(b'0'..=b'9') = self.peek() {
                self.i += 1;
            }
            if self.i == frac || self.i - frac + int_digits > MAX_DIGITS {
                return None;
            }
        }
        if matches!(self.peek(), Some(b'e' | b'E')) {
            return None;
        }
        Some((integer && !negative).then_some(v))
    }

    /// Any value, checked and passed over.
    fn skip(&mut self, depth: usize) -> Option<()> {
        if depth > MAX_DEPTH {
            return None;
        }
        match self.peek()? {
            b'"' => self.string().map(|_| ()),
            b'{' => {
                self.i += 1;
                self.ws();
                if self.peek()? == b'}' {
                    self.i += 1;
                    return Some(());
                }
                loop {
                    self.string()?;
                    self.ws();
                    self.eat(b':')?;
                    self.ws();
                    self.skip(depth + 1)?;
                    self.ws();
                    match self.next()? {
                        b',' => self.ws(),
                        b'}' => return Some(()),
                        _ => return None,
                    }
                }
            }
            b'[' => {
                self.i += 1;
                self.ws();
                if self.peek()? == b']' {
                    self.i += 1;
                    return Some(());
                }
                loop {
                    self.skip(depth + 1)?;
                    self.ws();
                    match self.next()? {
                        b',' => self.ws(),
                        b']' => return Some(()),
                        _ => return None,
                    }
                }
            }
            b't' => self.literal(b"true"),
            b'f' => self.literal(b"false"),
            b'n' => self.literal(b"null"),
            _ => self.number().map(|_| ()),
        }
    }

    /// A member read as a scalar (arrays and objects passed over as `Other`).
    fn scalar(&mut self, depth: usize) -> Option<Scalar> {
        Some(match self.peek()? {
            b'"' => Scalar::Str(self.plain_string()?.to_owned()),
            b'n' => {
                self.literal(b"null")?;
                Scalar::Null
            }
            b'-' | b'0'..=b'9' => match self.number()? {
                Some(n) => Scalar::U64(n),
                None => Scalar::Other,
            },
            _ => {
                self.skip(depth)?;
                Scalar::Other
            }
        })
    }

    /// `nvext`: its `cache_salt` when it is an object, and whether it had that member.
    fn nvext(&mut self) -> Option<(SaltValue, bool)> {
        if self.peek()? != b'{' {
            self.skip(1)?;
            return Some((SaltValue::Absent, false));
        }
        self.i += 1;
        let (mut salt, mut member) = (SaltValue::Absent, false);
        self.ws();
        if self.peek()? == b'}' {
            self.i += 1;
            return Some((salt, member));
        }
        loop {
            let key = self.key()?;
            self.ws();
            self.eat(b':')?;
            self.ws();
            if key == b"cache_salt" {
                salt = self.scalar(2)?.salt();
                member = true;
            } else {
                self.skip(2)?;
            }
            self.ws();
            match self.next()? {
                b',' => self.ws(),
                b'}' => return Some((salt, member)),
                _ => return None,
            }
        }
    }

    /// A text without escapes, or an array of plain integers that are all u32.
    fn prompt(&mut self) -> Option<Prompt> {
        if self.peek()? == b'"' {
            return Some(Prompt::Text(self.plain_string()?.to_owned()));
        }
        self.eat(b'[')?;
        let mut ids = Vec::with_capacity((self.b.len() - self.i) / 5 + 1);
        self.ws();
        if self.peek()? == b']' {
            self.i += 1;
            return Some(Prompt::TokenIds(ids));
        }
        // The hot loop of a token-ID request: the cursor lives in a local, and a comma right
        // after a number (the usual spacing) is taken without the general whitespace step.
        let (b, mut i) = (self.b, self.i);
        loop {
            i = dense_ids(b, i, &mut ids);
            if !matches!(b.get(i), Some(b'0'..=b'9')) {
                self.i = i;
                self.ws();
                i = self.i;
            }
            let start = i;
            let mut v = 0u64;
            if let Some(&word) = b.get(i..i + 8).and_then(|w| <&[u8; 8]>::try_from(w).ok()) {
                let (n, value) = eight_digits(u64::from_le_bytes(word));
                if n < 8 {
                    // The whole number was in the word: no per-digit branch.
                    i += n;
                    v = value;
                }
            }
            while let Some(&c) = b.get(i) {
                let d = c.wrapping_sub(b'0');
                if d > 9 {
                    break;
                }
                v = v.wrapping_mul(10).wrapping_add(u64::from(d));
                i += 1;
            }
            let digits = i - start;
            // u32::MAX has 10 digits; longer runs (and their wrapped values) go to the general path.
            if digits == 0 || digits > 10 || (digits > 1 && b[start] == b'0') {
                return None;
            }
            ids.push(u32::try_from(v).ok()?);
            match b.get(i) {
                Some(b',') => i += 1,
                _ => {
                    self.i = i;
                    self.ws();
                    match self.next()? {
                        b',' => {}
                        b']' => return Some(Prompt::TokenIds(ids)),
                        _ => return None,
                    }
                    i = self.i;
                }
            }
            if !matches!(b.get(i), Some(b'0'..=b'9')) {
                self.i = i;
                self.ws();
                i = self.i;
            }
        }
    }
}

/// Token IDs from `i` (the start of a number) while they come in the common spacing, `1,22,333`
/// or `1, 22, 333`: the commas are found 8 bytes at a time and each number between two of them
/// is read whole by [`eight_digits`], so no number waits for the one before it to be scanned.
/// Returns where it stopped (after a comma, or `i`): before the first number it cannot take (the
/// last one, before `]`; one with other spacing, over 8 digits or a leading zero), which the
/// caller's general loop reads from there.
fn dense_ids(b: &[u8], mut i: usize, ids: &mut Vec<u32>) -> usize {
    const ONES: u64 = 0x0101_0101_0101_0101;
    let mut at = i;
    while let Some(word) = b.get(at..at + 8).and_then(|w| <[u8; 8]>::try_from(w).ok()) {
        // 0x80 in exactly the bytes that are commas (no carry crosses a byte).
        let x = u64::from_le_bytes(word) ^ (u64::from(b',') * ONES);
        let mut commas = !(((x & (0x7F * ONES)) + 0x7F * ONES) | x) & (0x80 * ONES);
        while commas != 0 {
            let comma = at + (commas.trailing_zeros() / 8) as usize;
            commas &= commas - 1;
            let start = i + usize::from(b[i] == b' ');
            let len = comma.saturating_sub(start);
            let Some(number) = b.get(start..start + 8) else {
                return i;
            };
            let (n, value) = eight_digits(u64::from_le_bytes(number.try_into().unwrap_or([0; 8])));
            if n != len || n == 0 || (n > 1 && b[start] == b'0') {
                return i;
            }
            // At most 8 digits: below u32::MAX.
            ids.push(value as u32);
            i = comma + 1;
        }
        at += 8;
    }
    i
}

/// The leading ASCII digits of `word` (8 bytes, first in the lowest byte): how many (0 to 8) and
/// their value, without a branch per digit.
fn eight_digits(word: u64) -> (usize, u64) {
    const ONES: u64 = 0x0101_0101_0101_0101;
    // A byte is a digit when its high nibble is 3 before and after adding 6 ('0'..='9' only).
    // Carries run towards later bytes only, so every byte up to the first non-digit is judged
    // right, and nothing after it matters.
    let high = word & (0xF0 * ONES);
    let high6 = word.wrapping_add(6 * ONES) & (0xF0 * ONES);
    let not_digit = (high ^ (0x30 * ONES)) | (high6 ^ (0x30 * ONES));
    let n = (not_digit.trailing_zeros() / 8) as usize;
    if n == 0 {
        return (0, 0);
    }
    // The n digits as values, moved to the top bytes (leading zeros below them), then combined
    // pairwise: 8 digits in three multiplications.
    let mut v = (word.wrapping_sub(0x30 * ONES) & (0x0F * ONES)) << (8 * (8 - n));
    v = (v.wrapping_mul(10) + (v >> 8)) & 0x00FF_00FF_00FF_00FF;
    v = (v.wrapping_mul(100) + (v >> 16)) & 0x0000_FFFF_0000_FFFF;
    v = (v.wrapping_mul(10_000) + (v >> 32)) & 0xFFFF_FFFF;
    (n, v)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn eight_digits_reads_the_leading_digits(word in any::<[u8; 8]>(), n in 0usize..=8, digits in any::<u32>()) {
            let mut w = word;
            let text = format!("{:08}", digits % 100_000_000);
            w[..n].copy_from_slice(&text.as_bytes()[8 - n..]);
            let lead = w.iter().take_while(|c| c.is_ascii_digit()).count();
            let value = w[..lead].iter().fold(0u64, |v, c| v * 10 + u64::from(c - b'0'));
            let (got_n, got_v) = eight_digits(u64::from_le_bytes(w));
            prop_assert_eq!(got_n, lead);
            if lead > 0 {
                prop_assert_eq!(got_v, value);
            }
        }
    }
}
