//! Reading token usage from responses as they stream past: a JSON body, or SSE events whose
//! `data:` lines carry a `usage` object (OpenAI streams send it in the last event).
//!
//! Streaming, bounded and cheap: the body is never kept. A small state machine follows the
//! JSON's structure byte by byte (strings, escapes, nesting) and keeps only the value of the
//! top-level `usage` key, at most [`MAX_USAGE`] bytes, which is then parsed. A multi-MiB
//! response (`logprobs`, long completions) costs one pass over its bytes as its chunks pass,
//! never a parse of the whole body nor a copy of it, so it can run on an I/O thread.

use serde_json::Value;

/// Longest `usage` value kept (a real one is under 300 bytes).
const MAX_USAGE: usize = 4 << 10;

/// Token counts from a response's `usage`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Usage {
    /// Prompt tokens.
    pub prompt_tokens: u64,
    /// Completion tokens.
    pub completion_tokens: u64,
    /// Prompt tokens served from the engine's prefix cache.
    pub cached_tokens: u64,
}

/// The counts of a `usage` object (`None` for `null`, or without `prompt_tokens`).
fn usage_of(u: &Value) -> Option<Usage> {
    Some(Usage {
        prompt_tokens: u.get("prompt_tokens")?.as_u64()?,
        completion_tokens: u
            .get("completion_tokens")
            .and_then(Value::as_u64)
            .unwrap_or(0),
        cached_tokens: u
            .pointer("/prompt_tokens_details/cached_tokens")
            .and_then(Value::as_u64)
            .unwrap_or(0),
    })
}

/// Where the finder is in the top-level object, between its members.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Member {
    /// Before a key (after `{` or `,`).
    Key,
    /// Inside a key; how many bytes of `usage` it has matched (`None`: not `usage`).
    InKey(Option<u8>),
    /// After a key, before `:`; whether the key was `usage`.
    Colon(bool),
    /// After `:`, before the value; whether it is `usage`'s.
    Value(bool),
    /// Inside a value (or after it, before `,` or `}`).
    Rest,
}

/// Follows one JSON document and keeps the value of its top-level `usage` key.
#[derive(Debug)]
struct Finder {
    /// Nesting depth: 0 outside the document, 1 inside the top-level object.
    depth: u32,
    in_string: bool,
    escaped: bool,
    member: Member,
    /// The `usage` value's bytes while it is read (`None` otherwise).
    capture: Option<Vec<u8>>,
    /// The counts of the last `usage` object read.
    found: Option<Usage>,
    /// The document is not an object, or a value outgrew [`MAX_USAGE`]: nothing more to find.
    done: bool,
}

impl Finder {
    fn new() -> Self {
        Finder {
            depth: 0,
            in_string: false,
            escaped: false,
            member: Member::Rest,
            capture: None,
            found: None,
            done: false,
        }
    }

    fn feed(&mut self, bytes: &[u8]) {
        for &b in bytes {
            if self.done {
                return;
            }
            self.step(b);
        }
    }

    fn step(&mut self, b: u8) {
        if let Some(c) = &mut self.capture {
            if c.len() >= MAX_USAGE {
                self.capture = None;
                self.done = true;
                return;
            }
            c.push(b);
        }
        if self.in_string {
            if self.escaped {
                self.escaped = false;
                if let Member::InKey(m) = &mut self.member {
                    *m = None; // an escaped key is not matched
                }
            } else if b == b'\\' {
                self.escaped = true;
            } else if b == b'"' {
                self.in_string = false;
                if let Member::InKey(m) = self.member {
                    self.member = Member::Colon(m == Some(5));
                }
            } else if let Member::InKey(m) = &mut self.member {
                *m = m
                    .filter(|&i| b"usage".get(i as usize) == Some(&b))
                    .map(|i| i + 1);
            }
            return;
        }
        if b.is_ascii_whitespace() {
            return;
        }
        match (self.depth, self.member) {
            (0, _) => {
                if b == b'{' {
                    self.depth = 1;
                    self.member = Member::Key;
                } else {
                    self.done = true; // not an object
                }
                return;
            }
            (1, Member::Key) if b == b'"' => {
                self.in_string = true;
                self.member = Member::InKey(Some(0));
                return;
            }
            (1, Member::Colon(usage)) if b == b':' => {
                self.member = Member::Value(usage);
                return;
            }
            (1, Member::Value(true)) => {
                self.member = Member::Rest;
                // `null`, or not an object: no counts (the value is still followed).
                if b == b'{' {
                    self.capture = Some(vec![b]);
                }
            }
            (1, Member::Value(false)) => self.member = Member::Rest,
            _ => {}
        }
        match b {
            b'"' => self.in_string = true,
            b'{' | b'[' => self.depth += 1,
            b'}' | b']' => {
                self.depth = self.depth.saturating_sub(1);
                if self.depth == 1
                    && let Some(c) = self.capture.take()
                    && let Some(u) = serde_json::from_slice::<Value>(&c)
                        .ok()
                        .as_ref()
                        .and_then(usage_of)
                {
                    self.found = Some(u);
                }
                if self.depth == 0 {
                    self.done = true;
                }
            }
            b',' if self.depth == 1 => self.member = Member::Key,
            _ => {}
        }
    }
}

/// Scans a response body chunk by chunk.
#[derive(Debug)]
pub struct UsageScanner {
    sse: bool,
    /// The document being followed: the JSON body, or the current SSE line's data.
    finder: Finder,
    /// SSE: the start of the current line, until it is known whether it is `data:`.
    prefix: Vec<u8>,
    /// SSE: the current line is a `data:` line (its payload goes to the finder).
    data: bool,
    found: Option<Usage>,
}

impl UsageScanner {
    /// A scanner for a response with this `content-type`.
    pub fn new(content_type: &str) -> Self {
        UsageScanner {
            sse: content_type.starts_with("text/event-stream"),
            finder: Finder::new(),
            prefix: Vec::new(),
            data: false,
            found: None,
        }
    }

    /// Feeds the next chunk.
    pub fn feed(&mut self, chunk: &[u8]) {
        if !self.sse {
            self.finder.feed(chunk);
            return;
        }
        let mut rest = chunk;
        while !rest.is_empty() {
            let end = rest.iter().position(|&b| b == b'\n');
            let (line, more) = match end {
                Some(i) => (&rest[..i], Some(&rest[i + 1..])),
                None => (rest, None),
            };
            self.sse_bytes(line);
            match more {
                Some(m) => {
                    self.end_line();
                    rest = m;
                }
                None => break,
            }
        }
    }

    /// Bytes of the current SSE line (no newline among them).
    fn sse_bytes(&mut self, mut bytes: &[u8]) {
        if !self.data {
            // Still reading the field name: at most `data:` is kept.
            let need = 5 - self.prefix.len().min(5);
            let take = need.min(bytes.len());
            self.prefix.extend_from_slice(&bytes[..take]);
            bytes = &bytes[take..];
            if self.prefix.len() < 5 {
                return;
            }
            if self.prefix != b"data:" {
                self.prefix.truncate(5); // another field: skipped to the end of the line
                return;
            }
            self.data = true;
            self.finder = Finder::new();
        }
        self.finder.feed(bytes);
    }

    fn end_line(&mut self) {
        // As for a JSON body: only a whole object counts.
        if self.data
            && self.finder.done
            && self.finder.depth == 0
            && let Some(u) = self.finder.found.take()
        {
            self.found = Some(u);
        }
        self.data = false;
        self.prefix.clear();
    }

    /// The usage, once the body has ended.
    pub fn finish(mut self) -> Option<Usage> {
        if self.sse {
            self.end_line();
            return self.found;
        }
        // A complete object only: a body cut short (or not JSON) counts nothing.
        (self.finder.done && self.finder.depth == 0)
            .then_some(self.finder.found)
            .flatten()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn json_usage_across_chunks() {
        let body = br#"{"id":"x","usage":{"prompt_tokens":12,"completion_tokens":3,"prompt_tokens_details":{"cached_tokens":8}}}"#;
        let mut s = UsageScanner::new("application/json");
        for c in body.chunks(7) {
            s.feed(c);
        }
        assert_eq!(
            s.finish(),
            Some(Usage {
                prompt_tokens: 12,
                completion_tokens: 3,
                cached_tokens: 8
            })
        );
    }

    #[test]
    fn sse_usage_in_last_event() {
        let body = "data: {\"choices\":[{\"text\":\"a\"}],\"usage\":null}\n\ndata: {\"choices\":[],\"usage\":{\"prompt_tokens\":5,\"completion_tokens\":2}}\n\ndata: [DONE]\n\n";
        let mut s = UsageScanner::new("text/event-stream; charset=utf-8");
        for c in body.as_bytes().chunks(5) {
            s.feed(c);
        }
        assert_eq!(
            s.finish(),
            Some(Usage {
                prompt_tokens: 5,
                completion_tokens: 2,
                cached_tokens: 0
            })
        );
        let mut s = UsageScanner::new("application/json");
        s.feed(b"not json");
        assert_eq!(s.finish(), None);
    }

    fn scan(content_type: &str, body: &[u8], chunk: usize) -> Option<Usage> {
        let mut s = UsageScanner::new(content_type);
        for c in body.chunks(chunk.max(1)) {
            s.feed(c);
        }
        s.finish()
    }

    fn counts(p: u64, c: u64) -> Option<Usage> {
        Some(Usage {
            prompt_tokens: p,
            completion_tokens: c,
            cached_tokens: 0,
        })
    }

    /// Only the top-level `usage` counts: not one nested in a choice, not the word in a string
    /// (braces and escaped quotes in strings do not confuse the nesting), not an escaped key;
    /// the last of two wins, as a parser's would; a body cut short, a `usage` over the limit
    /// or one that is not an object counts nothing.
    #[test]
    fn only_the_top_level_usage_of_a_whole_object_counts() {
        let cases: &[(&str, Option<Usage>)] = &[
            (
                r#"{"usage":{"prompt_tokens":4,"completion_tokens":1},"id":"x"}"#,
                counts(4, 1),
            ),
            (
                r#"{"choices":[{"usage":{"prompt_tokens":9}}],"text":"{\"usage\":{\"prompt_tokens\":8}} \\","usage":{"prompt_tokens":3}}"#,
                counts(3, 0),
            ),
            (r#"{"us\u0061ge":{"prompt_tokens":3}}"#, None),
            (r#"{"usage":null}"#, None),
            (
                r#"{"usage":"none","x":{"usage":{"prompt_tokens":1}}}"#,
                None,
            ),
            (
                r#"{"usage":{"prompt_tokens":1},"usage":{"prompt_tokens":2,"completion_tokens":7}}"#,
                counts(2, 7),
            ),
            (
                r#"{"usage":{"prompt_tokens":4,"completion_tokens":1}"#,
                None,
            ),
            (r#"[{"usage":{"prompt_tokens":4}}]"#, None),
            (r#"{"usage":{"completion_tokens":1}}"#, None),
        ];
        for (body, want) in cases {
            for chunk in [1, 3, 1000] {
                assert_eq!(
                    scan("application/json", body.as_bytes(), chunk),
                    *want,
                    "{body}"
                );
            }
        }
        let big = format!(
            r#"{{"usage":{{"prompt_tokens":1,"pad":"{}"}}}}"#,
            "x".repeat(MAX_USAGE)
        );
        assert_eq!(scan("application/json", big.as_bytes(), 4096), None);
    }

    /// A multi-MiB response (logprobs) is read as it passes: its usage at the end is found, and
    /// nothing of the body is kept (the scanner stays the same size while fed).
    #[test]
    fn a_large_response_is_scanned_without_keeping_it() {
        let mut body = String::from(r#"{"choices":[{"logprobs":{"content":["#);
        let mut i = 0;
        while body.len() < 6 << 20 {
            if i > 0 {
                body.push(',');
            }
            body.push_str(&format!(
                r#"{{"token":"t{i}","logprob":-0.{i},"top_logprobs":[{{"token":"}}\"a","logprob":-1.0}}]}}"#
            ));
            i += 1;
        }
        body.push_str(r#"]}}],"usage":{"prompt_tokens":4,"completion_tokens":77}}"#);
        let mut s = UsageScanner::new("application/json");
        for c in body.as_bytes().chunks(64 << 10) {
            s.feed(c);
            assert!(
                s.finder
                    .capture
                    .as_ref()
                    .is_none_or(|c| c.len() <= MAX_USAGE)
            );
        }
        assert_eq!(s.finish(), counts(4, 77));
    }

    /// SSE lines split anywhere across chunks, other fields, comments and CRLF line ends.
    #[test]
    fn sse_lines_split_across_chunks() {
        let body = ": keepalive\r\nevent: message\r\ndata: {\"usage\":{\"prompt_tokens\":6,\"completion_tokens\":1}}\r\n\r\nid: 1\ndata:{\"usage\":null}\n\ndata: {\"usage\":{\"prompt_tokens\":9}\n\ndata: [DONE]\n";
        for chunk in 1..8 {
            assert_eq!(
                scan("text/event-stream", body.as_bytes(), chunk),
                counts(6, 1)
            );
        }
    }

    use proptest::prelude::*;

    /// JSON documents with `usage` objects at any depth, strings with quotes, braces and
    /// escapes, and a top-level `usage` sometimes.
    fn document() -> impl Strategy<Value = serde_json::Value> {
        use serde_json::json;
        let usage = (0u64..1000, proptest::option::of(0u64..1000)).prop_map(|(p, c)| match c {
            Some(c) => json!({"prompt_tokens": p, "completion_tokens": c}),
            None => json!({"prompt_tokens": p}),
        });
        let leaf = prop_oneof![
            any::<i64>().prop_map(|n| json!(n)),
            "[a-z{}\\[\\]\":\\\\ ]{0,12}".prop_map(|s| json!(s)),
            Just(json!(null)),
            usage.clone(),
        ];
        let value = leaf.prop_recursive(3, 24, 4, |inner| {
            prop_oneof![
                proptest::collection::vec(inner.clone(), 0..4).prop_map(serde_json::Value::Array),
                proptest::collection::vec(
                    (
                        prop_oneof![Just("usage".to_owned()), "[a-z\"{]{1,6}"],
                        inner
                    ),
                    0..4
                )
                .prop_map(|kv| serde_json::Value::Object(kv.into_iter().collect())),
            ]
        });
        proptest::collection::vec(
            (prop_oneof![Just("usage".to_owned()), "[a-z]{1,6}"], value),
            0..5,
        )
        .prop_map(|kv| serde_json::Value::Object(kv.into_iter().collect()))
    }

    proptest! {
        /// The scanner agrees with a parser of the whole body, in any chunking.
        #[test]
        fn agrees_with_parsing_the_whole_body(doc in document(), chunk in 1usize..64) {
            let text = serde_json::to_string(&doc).unwrap();
            let want = doc.get("usage").and_then(usage_of);
            prop_assert_eq!(scan("application/json", text.as_bytes(), chunk), want);
            let sse = format!("data: {text}\n\ndata: [DONE]\n\n");
            prop_assert_eq!(scan("text/event-stream", sse.as_bytes(), chunk), want);
        }
    }
}
