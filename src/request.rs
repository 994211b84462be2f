//! Request understanding: what the router needs from an OpenAI-style request body.
//!
//! Extracts the `model`, the prompt (token IDs when the client sent them) and the salt-bearing
//! fields. `/v1/completions` with a token-ID prompt routes on those tokens; a batch of prompts
//! routes on the first. Text and chat prompts are recognised; until they are tokenized in-process
//! they route on load alone.

use serde_json::Value;

use kv_epp_core::salt::SaltField;

/// The prompt as the client sent it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Prompt {
    /// No prompt field (e.g. a GET, or an API without prompts).
    None,
    /// Token IDs (`"prompt": [1, 2, 3]`, or the first of a batch of token-ID prompts).
    TokenIds(Vec<u32>),
    /// A text prompt (or the first of a batch of text prompts).
    Text(String),
    /// Chat messages.
    Chat,
}

/// A parsed request body.
#[derive(Clone, Debug)]
pub struct ParsedBody {
    /// The whole JSON document.
    pub json: Value,
    /// The `model` field.
    pub model: Option<String>,
    /// The prompt.
    pub prompt: Prompt,
    /// The most tokens the client asks to generate (`max_completion_tokens`, else
    /// `max_tokens`), when it says.
    pub max_tokens: Option<u64>,
}

impl ParsedBody {
    /// The body's `nvext.cache_salt` field.
    pub(crate) fn nvext_salt(&self) -> SaltField<'_> {
        field(self.json.get("nvext").and_then(|n| n.get("cache_salt")))
    }

    /// The body's top-level `cache_salt` field.
    pub(crate) fn body_salt(&self) -> SaltField<'_> {
        field(self.json.get("cache_salt"))
    }
}

fn field(v: Option<&Value>) -> SaltField<'_> {
    match v {
        None | Some(Value::Null) => SaltField::Absent,
        Some(Value::String(s)) => SaltField::Str(s),
        Some(_) => SaltField::NotString,
    }
}

/// Why a body was refused (400 at the edge).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RequestError {
    /// Not JSON, or not a JSON object.
    #[error("request body is not a JSON object: {0}")]
    NotJson(String),
    /// `model` missing or not a string.
    #[error("request body has no `model` string")]
    MissingModel,
    /// A token-ID prompt with a value that is not a u32.
    #[error("prompt token IDs must be integers in 0..=4294967295")]
    BadTokenIds,
}

/// Parses a request body.
pub fn parse(body: &[u8]) -> Result<ParsedBody, RequestError> {
    let json: Value =
        serde_json::from_slice(body).map_err(|e| RequestError::NotJson(e.to_string()))?;
    if !json.is_object() {
        return Err(RequestError::NotJson("top level is not an object".into()));
    }
    let model = match json.get("model") {
        Some(Value::String(m)) if !m.is_empty() => Some(m.clone()),
        _ => return Err(RequestError::MissingModel),
    };
    let prompt = match (json.get("prompt"), json.get("messages")) {
        (Some(p), _) => prompt_of(p)?,
        (None, Some(_)) => Prompt::Chat,
        (None, None) => Prompt::None,
    };
    let max_tokens = ["max_completion_tokens", "max_tokens"]
        .iter()
        .find_map(|k| json.get(*k).and_then(Value::as_u64));
    Ok(ParsedBody {
        json,
        model,
        prompt,
        max_tokens,
    })
}

fn prompt_of(p: &Value) -> Result<Prompt, RequestError> {
    Ok(match p {
        Value::String(s) => Prompt::Text(s.clone()),
        Value::Array(items) => match items.first() {
            None => Prompt::TokenIds(Vec::new()),
            Some(Value::Number(_)) => Prompt::TokenIds(token_ids(items)?),
            // A batch: route on the first prompt.
            Some(first @ (Value::String(_) | Value::Array(_))) => prompt_of(first)?,
            Some(_) => return Err(RequestError::BadTokenIds),
        },
        _ => Prompt::None,
    })
}

fn token_ids(items: &[Value]) -> Result<Vec<u32>, RequestError> {
    items
        .iter()
        .map(|v| {
            v.as_u64()
                .and_then(|n| u32::try_from(n).ok())
                .ok_or(RequestError::BadTokenIds)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn token_id_prompts_and_batches() {
        let b = parse(br#"{"model":"m","prompt":[1,2,3]}"#).unwrap();
        assert_eq!(b.prompt, Prompt::TokenIds(vec![1, 2, 3]));
        let b = parse(br#"{"model":"m","prompt":[[4,5],[6]]}"#).unwrap();
        assert_eq!(b.prompt, Prompt::TokenIds(vec![4, 5]));
        let b = parse(br#"{"model":"m","prompt":["a","b"]}"#).unwrap();
        assert_eq!(b.prompt, Prompt::Text("a".into()));
        let b = parse(br#"{"model":"m","messages":[]}"#).unwrap();
        assert_eq!(b.prompt, Prompt::Chat);
    }

    #[test]
    fn errors() {
        assert!(matches!(parse(b"{"), Err(RequestError::NotJson(_))));
        assert!(matches!(parse(b"[1]"), Err(RequestError::NotJson(_))));
        assert_eq!(
            parse(br#"{"prompt":[1]}"#).unwrap_err(),
            RequestError::MissingModel
        );
        assert_eq!(
            parse(br#"{"model":"m","prompt":[1,-2]}"#).unwrap_err(),
            RequestError::BadTokenIds
        );
        assert_eq!(
            parse(br#"{"model":"m","prompt":[4294967296]}"#).unwrap_err(),
            RequestError::BadTokenIds
        );
    }

    #[test]
    fn salt_fields() {
        let b = parse(br#"{"model":"m","cache_salt":"s","nvext":{"cache_salt":5}}"#).unwrap();
        assert_eq!(b.body_salt(), SaltField::Str("s"));
        assert_eq!(b.nvext_salt(), SaltField::NotString);
        let b = parse(br#"{"model":"m","cache_salt":null}"#).unwrap();
        assert_eq!(b.body_salt(), SaltField::Absent);
    }
}
