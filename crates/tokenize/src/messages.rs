//! Chat messages as the template sees them (vLLM + transformers normalisation).
//!
//! - `content`: a string stays; `null`/absent becomes `""`; a list of parts becomes the `text` of
//!   every `{"type": "text"}` part (and every bare string part) joined with `"\n"`. Image, audio
//!   and other parts are ignored: kv-epp routes on the text prefix only (the engine would add a
//!   model-specific placeholder or reject the part; either way the text before it is what we can
//!   match).
//! - `name` is kept when it is a string.
//! - assistant: `tool_calls` is kept when it is a non-empty list, each call's
//!   `function.arguments` parsed from its JSON string (invalid JSON, or a non-container
//!   non-string, becomes `{}`); `reasoning` (or the older `reasoning_content`) is exposed as
//!   `reasoning`, `reasoning_content` and, first, `thinking` (transformers' aliasing).
//! - tool: `tool_call_id` is kept.
//! - every other key is dropped, and so is every key whose value is `null`.

use indexmap::IndexMap;
use minijinja::Value;
use serde::Deserialize;

use super::error::TokenizeError;
use super::json::Json;

/// One message as a client sent it (only the fields any template may see).
#[derive(Debug, Deserialize)]
pub(crate) struct WireMessage {
    role: String,
    #[serde(default)]
    content: Json,
    #[serde(default)]
    name: Json,
    #[serde(default)]
    tool_calls: Json,
    #[serde(default)]
    reasoning: Json,
    #[serde(default)]
    reasoning_content: Json,
    #[serde(default)]
    tool_call_id: Json,
}

/// One normalised message.
#[derive(Clone, Debug, PartialEq)]
pub struct Message {
    /// `system`, `user`, `assistant`, `tool`, ... as sent.
    pub role: String,
    /// The flattened text content.
    pub content: String,
    /// The participant name, when given as a string.
    pub name: Option<String>,
    /// Assistant tool calls (non-empty list) with parsed arguments.
    pub tool_calls: Option<Json>,
    /// Assistant reasoning text (any non-null JSON value as sent).
    pub reasoning: Option<Json>,
    /// Tool message: the call it answers.
    pub tool_call_id: Option<Json>,
}

fn non_null(j: Json) -> Option<Json> {
    (!j.is_null()).then_some(j)
}

/// Joins the text parts of a content list with `"\n"`; other part types are ignored.
fn flatten_content(content: Json) -> Result<String, TokenizeError> {
    match content {
        Json::Null => Ok(String::new()),
        Json::Str(s) => Ok(s),
        Json::Array(parts) => {
            let mut texts: Vec<String> = Vec::with_capacity(parts.len());
            for part in parts {
                match part {
                    Json::Str(s) => texts.push(s),
                    Json::Object(mut fields) => {
                        let is_text = fields.get("type").and_then(Json::as_str) == Some("text");
                        if is_text && let Some(Json::Str(text)) = fields.swap_remove("text") {
                            texts.push(text);
                        }
                    }
                    _ => {}
                }
            }
            Ok(texts.join("\n"))
        }
        _ => Err(TokenizeError::InvalidMessage(
            "content must be a string, null or a list of parts",
        )),
    }
}

/// Parses each call's `function.arguments` string into JSON (invalid → `{}`).
fn normalize_tool_calls(calls: Json) -> Option<Json> {
    let Json::Array(mut calls) = calls else {
        return None;
    };
    if calls.is_empty() {
        return None;
    }
    for call in &mut calls {
        let Some(function @ Json::Object(_)) = call.get_mut("function") else {
            continue;
        };
        let parsed = match function.get("arguments") {
            Some(Json::Str(text)) => serde_json::from_str::<Json>(text).unwrap_or_else(|_| empty()),
            Some(keep @ (Json::Object(_) | Json::Array(_))) => keep.clone(),
            _ => empty(),
        };
        if let Json::Object(fields) = function {
            fields.insert("arguments".to_owned(), parsed);
        }
    }
    Some(Json::Array(calls))
}

fn empty() -> Json {
    Json::Object(IndexMap::new())
}

impl Message {
    /// Normalises one wire message.
    pub(crate) fn from_wire(m: WireMessage) -> Result<Message, TokenizeError> {
        let assistant = m.role == "assistant";
        Ok(Message {
            content: flatten_content(m.content)?,
            name: match m.name {
                Json::Str(s) => Some(s),
                _ => None,
            },
            tool_calls: if assistant {
                normalize_tool_calls(m.tool_calls)
            } else {
                None
            },
            reasoning: if assistant {
                non_null(m.reasoning).or_else(|| non_null(m.reasoning_content))
            } else {
                None
            },
            tool_call_id: if m.role == "tool" {
                non_null(m.tool_call_id)
            } else {
                None
            },
            role: m.role,
        })
    }

    /// The template value: keys in the order transformers presents them.
    /// `content_suffix` is appended to the content (used for `continue_final_message`).
    pub(crate) fn to_value(&self, content_suffix: &str) -> Value {
        let mut map: IndexMap<Value, Value> = IndexMap::with_capacity(8);
        let reasoning = self.reasoning.clone().map(Json::into_value);
        if let Some(r) = &reasoning {
            map.insert(Value::from("thinking"), r.clone());
        }
        map.insert(Value::from("role"), Value::from(self.role.as_str()));
        let content = if content_suffix.is_empty() {
            Value::from(self.content.as_str())
        } else {
            Value::from(format!("{}{content_suffix}", self.content))
        };
        map.insert(Value::from("content"), content);
        if let Some(calls) = &self.tool_calls {
            map.insert(Value::from("tool_calls"), calls.clone().into_value());
        }
        if let Some(r) = reasoning {
            map.insert(Value::from("reasoning"), r.clone());
            map.insert(Value::from("reasoning_content"), r);
        }
        if let Some(id) = &self.tool_call_id {
            map.insert(Value::from("tool_call_id"), id.clone().into_value());
        }
        if let Some(name) = &self.name {
            map.insert(Value::from("name"), Value::from(name.as_str()));
        }
        Value::from(map)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn message(json: &str) -> Message {
        Message::from_wire(serde_json::from_str(json).unwrap()).unwrap()
    }

    #[test]
    fn content_forms() {
        assert_eq!(message(r#"{"role":"user","content":null}"#).content, "");
        assert_eq!(message(r#"{"role":"user"}"#).content, "");
        let parts = r#"{"role":"user","content":[{"type":"text","text":"a"},
            {"type":"image_url","image_url":{"url":"x"}},"b",{"type":"text","text":null},
            {"type":"text","text":"c"}]}"#;
        assert_eq!(message(parts).content, "a\nb\nc");
        let image_only =
            r#"{"role":"user","content":[{"type":"image_url","image_url":{"url":"x"}}]}"#;
        assert_eq!(message(image_only).content, "");
        assert!(
            Message::from_wire(serde_json::from_str(r#"{"role":"user","content":3}"#).unwrap())
                .is_err()
        );
    }

    #[test]
    fn tool_calls_and_fields() {
        let m = message(
            r#"{"role":"assistant","content":null,"name":7,"tool_call_id":"x","reasoning":"r",
               "tool_calls":[{"id":"a","function":{"name":"f","arguments":"{\"b\": 2.5, \"a\": [null]}"}},
                             {"id":"b","function":{"name":"g","arguments":"not json"}},
                             {"id":"c","function":{"name":"h"}}]}"#,
        );
        assert_eq!(m.name, None);
        assert_eq!(m.tool_call_id, None);
        let calls = m.tool_calls.clone().unwrap();
        let Json::Array(calls) = calls else { panic!() };
        let args: Vec<String> = calls
            .iter()
            .map(|c| {
                let v = c.get("function").unwrap().get("arguments").unwrap().clone();
                let mut s = String::new();
                super::super::pyjson::dump(
                    &v.into_value(),
                    &super::super::pyjson::DumpOptions::default(),
                    0,
                    &mut s,
                )
                .unwrap();
                s
            })
            .collect();
        assert_eq!(args, [r#"{"b": 2.5, "a": [null]}"#, "{}", "{}"]);
        let keys: Vec<String> = m
            .to_value("")
            .try_iter()
            .unwrap()
            .map(|k| k.to_string())
            .collect();
        assert_eq!(
            keys,
            [
                "thinking",
                "role",
                "content",
                "tool_calls",
                "reasoning",
                "reasoning_content"
            ]
        );
        let empty_calls = message(r#"{"role":"assistant","content":"x","tool_calls":[]}"#);
        assert_eq!(empty_calls.tool_calls, None);
        let tool = message(r#"{"role":"tool","content":"r","tool_call_id":"c1","name":"n"}"#);
        assert_eq!(tool.tool_call_id, Some(Json::Str("c1".into())));
        assert_eq!(tool.name.as_deref(), Some("n"));
    }
}
