//! Reading token usage from responses as they stream past: a JSON body, or SSE events whose
//! `data:` lines carry a `usage` object (OpenAI streams send it in the last event).
//!
//! Bounded: at most [`MAX_JSON`] bytes of a JSON body and one SSE line at a time are kept.

use serde_json::Value;

/// Largest JSON response body kept for usage parsing.
const MAX_JSON: usize = 4 << 20;
/// Longest SSE line kept.
const MAX_LINE: usize = 1 << 20;

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

fn usage_of(v: &Value) -> Option<Usage> {
    let u = v.get("usage")?;
    if u.is_null() {
        return None;
    }
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

/// Scans a response body chunk by chunk.
#[derive(Debug)]
pub struct UsageScanner {
    sse: bool,
    buf: Vec<u8>,
    overflow: bool,
    found: Option<Usage>,
}

impl UsageScanner {
    /// A scanner for a response with this `content-type`.
    pub fn new(content_type: &str) -> Self {
        UsageScanner {
            sse: content_type.starts_with("text/event-stream"),
            buf: Vec::new(),
            overflow: false,
            found: None,
        }
    }

    /// Feeds the next chunk.
    pub fn feed(&mut self, chunk: &[u8]) {
        if self.overflow {
            return;
        }
        if !self.sse {
            if self.buf.len() + chunk.len() > MAX_JSON {
                self.overflow = true;
                self.buf = Vec::new();
            } else {
                self.buf.extend_from_slice(chunk);
            }
            return;
        }
        for &b in chunk {
            if b == b'\n' {
                self.sse_line();
                self.buf.clear();
            } else if self.buf.len() < MAX_LINE {
                self.buf.push(b);
            }
        }
    }

    fn sse_line(&mut self) {
        let line = self.buf.strip_suffix(b"\r").unwrap_or(&self.buf);
        if let Some(data) = line.strip_prefix(b"data:") {
            let data = data.trim_ascii_start();
            if data.windows(7).any(|w| w == b"\"usage\"")
                && let Ok(v) = serde_json::from_slice::<Value>(data)
                && let Some(u) = usage_of(&v)
            {
                self.found = Some(u);
            }
        }
    }

    /// The usage, once the body has ended.
    pub fn finish(mut self) -> Option<Usage> {
        if self.sse {
            self.sse_line();
            return self.found;
        }
        if self.overflow {
            return None;
        }
        serde_json::from_slice::<Value>(&self.buf)
            .ok()
            .and_then(|v| usage_of(&v))
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
}
