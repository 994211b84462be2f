//! Chat messages as the template sees them: vLLM 0.33's message parsing
//! (`vllm/renderers/chat_utils/chat_message.py`), then transformers' normalisation.
//!
//! - `content` (`parse_chat_message_content`, "string" content format): a string stays;
//!   `null`/absent becomes `""`; a list of parts becomes its text parts joined with `"\n"`
//!   (`parse_chat_message_content_parts`). Text parts (`parse_chat_message_content_mm_part`,
//!   `MM_PARSER_MAP`): a bare string; `text`, `input_text`, `output_text` (their `text`),
//!   `thinking` (its `thinking`), `refusal` (its `refusal`), `tool_reference` (its `name`);
//!   `text`/`refusal` parts without a value are skipped. Media parts (`image_url`,
//!   `input_image`, `audio_url`, `input_audio`, `video_url`, `*_embeds`, `image_pil`), typed or
//!   recognised by their key, are ignored: kv-epp routes on the text (the engine would add a
//!   model-specific placeholder or reject the part). An unknown or non-string `type`, a part
//!   without `type` and without a media key, or a part with a `uuid` but no media key is a 400,
//!   as in vLLM. A text value that is not a string (vLLM fails joining it) cannot be rendered.
//! - system messages: a leading `x-anthropic-billing-header` line of a text part is removed
//!   (`_strip_claude_code_billing_header`), the whole part when nothing follows it.
//! - `name` and `task` are kept when they are strings; a `developer` message keeps `tools`.
//! - assistant (`_postprocess_messages`): `tool_calls` is kept when it is a non-empty list; each
//!   entry must be an object of type `function` (default) with a `function` object (else 400);
//!   `function.arguments` becomes an object: an object stays, a string is parsed, anything else
//!   (invalid JSON, a non-object, an empty value) becomes `{}`. `reasoning` (or the older
//!   `reasoning_content`, `_normalize_messages_before`) is exposed as `reasoning`,
//!   `reasoning_content` and, first, `thinking` (transformers' aliasing).
//! - tool: `tool_call_id` is kept.
//! - every other key is dropped, and so is every key whose value is `null` (transformers).

use indexmap::IndexMap;
use minijinja::Value;
use serde::Deserialize;

use super::error::{TokenizeError, Unrenderable};
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
    #[serde(default)]
    task: Json,
    #[serde(default)]
    tools: Json,
}

impl WireMessage {
    /// A message of `role` with plain text content (what `/v1/responses` builds).
    pub(crate) fn text(role: &str, content: String) -> WireMessage {
        WireMessage {
            role: role.to_owned(),
            content: Json::Str(content),
            name: Json::Null,
            tool_calls: Json::Null,
            reasoning: Json::Null,
            reasoning_content: Json::Null,
            tool_call_id: Json::Null,
            task: Json::Null,
            tools: Json::Null,
        }
    }
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
    /// `task`, when given as a string (vLLM passes it on).
    pub task: Option<String>,
    /// A `developer` message's `tools`, as sent (vLLM passes it on; dropped when the message
    /// becomes `system`).
    pub tools: Option<Json>,
}

fn non_null(j: Json) -> Option<Json> {
    (!j.is_null()).then_some(j)
}

/// Media part types: ignored (kv-epp routes on the text). The same names, as keys of a part,
/// make vLLM's `has_non_text_content` true (`request.rs`).
pub(crate) const MEDIA_TYPES: [&str; 10] = [
    "input_image",
    "image_url",
    "image_embeds",
    "audio_embeds",
    "video_embeds",
    "prompt_embeds",
    "image_pil",
    "audio_url",
    "input_audio",
    "video_url",
];

/// Keys that make an untyped part a media part, in vLLM's order of checking.
const MEDIA_KEYS: [&str; 9] = [
    "image_url",
    "image_pil",
    "image_embeds",
    "audio_embeds",
    "video_embeds",
    "prompt_embeds",
    "audio_url",
    "input_audio",
    "video_url",
];

/// The prefix of the attribution line Claude Code puts in system prompts (a value that changes
/// on every request; vLLM strips it so the prefix cache keeps working).
const BILLING_HEADER: &str = "x-anthropic-billing-header";

/// The text a part contributes, `None` when it contributes nothing (media, empty text).
fn part_text(part: Json) -> Result<Option<String>, TokenizeError> {
    let mut fields = match part {
        Json::Str(s) => return Ok(Some(s)),
        Json::Object(fields) => fields,
        _ => {
            return Err(TokenizeError::InvalidMessage(
                "content parts must be strings or objects",
            ));
        }
    };
    let has_uuid = fields.get("uuid").is_some_and(|u| !u.is_null());
    let typed = match fields.get("type") {
        Some(Json::Str(t)) if !has_uuid => Some(t.clone()),
        None | Some(Json::Null) => None,
        Some(Json::Str(_)) => None,
        Some(_) => {
            return Err(TokenizeError::InvalidMessage(
                "invalid `type` in a content part",
            ));
        }
    };
    let Some(kind) = typed else {
        // No type (or a uuid): vLLM recognises the part by its media key.
        let video_embeds = fields.get("type").and_then(Json::as_str) == Some("video_embeds");
        let media = MEDIA_KEYS
            .iter()
            .any(|k| fields.contains_key(*k) && !(*k == "audio_embeds" && video_embeds));
        if media {
            return Ok(None);
        }
        if fields.contains_key("tool_reference") {
            return text_value(fields.swap_remove("name"), false);
        }
        return Err(TokenizeError::InvalidMessage(
            "a content part has no `type` and no media field",
        ));
    };
    match kind.as_str() {
        "text" => text_value(fields.swap_remove("text"), true),
        "refusal" => text_value(fields.swap_remove("refusal"), true),
        "input_text" | "output_text" => text_value(fields.swap_remove("text"), false),
        "thinking" => text_value(fields.swap_remove("thinking"), false),
        "tool_reference" => text_value(fields.swap_remove("name"), false),
        t if MEDIA_TYPES.contains(&t) => Ok(None),
        _ => Err(TokenizeError::InvalidMessage(
            "unsupported content part type",
        )),
    }
}

/// A text part's value: a string is the text; a missing one is skipped for `text`/`refusal`
/// (vLLM logs and skips) and unrenderable otherwise (vLLM fails joining a non-string).
fn text_value(value: Option<Json>, skip_missing: bool) -> Result<Option<String>, TokenizeError> {
    match value {
        Some(Json::Str(s)) => Ok(Some(s)),
        None | Some(Json::Null) if skip_missing => Ok(None),
        _ => Err(TokenizeError::inexact(
            Unrenderable::UnsupportedOption,
            "a text content part whose value is not a string",
        )),
    }
}

/// Removes the billing-header line from a system text part (`None`: drop the part).
fn strip_billing_header(part: Json) -> Option<Json> {
    let text = match &part {
        Json::Str(s) => Some(s.as_str()),
        Json::Object(f) if f.get("type").and_then(Json::as_str) == Some("text") => {
            f.get("text").and_then(Json::as_str)
        }
        _ => None,
    };
    let Some(text) = text.filter(|t| t.starts_with(BILLING_HEADER)) else {
        return Some(part);
    };
    let rest = text.split_once('\n').map_or("", |(_, r)| r).to_owned();
    if rest.is_empty() {
        return None;
    }
    Some(match part {
        Json::Object(mut f) => {
            f.insert("text".to_owned(), Json::Str(rest));
            Json::Object(f)
        }
        _ => Json::Str(rest),
    })
}

/// Joins the text parts of a content list with `"\n"` (see the module doc).
fn flatten_content(content: Json, system: bool) -> Result<String, TokenizeError> {
    let parts = match content {
        Json::Null => return Ok(String::new()),
        Json::Str(s) if !system || !s.starts_with(BILLING_HEADER) => return Ok(s),
        Json::Str(s) => vec![Json::Str(s)],
        Json::Array(parts) => parts,
        _ => {
            return Err(TokenizeError::InvalidMessage(
                "content must be a string, null or a list of parts",
            ));
        }
    };
    let mut texts: Vec<String> = Vec::with_capacity(parts.len());
    for part in parts {
        let part = if system {
            match strip_billing_header(part) {
                Some(p) => p,
                None => continue,
            }
        } else {
            part
        };
        if let Some(text) = part_text(part)? {
            texts.push(text);
        }
    }
    Ok(texts.join("\n"))
}

/// vLLM's `_postprocess_messages`: entries must be function calls; each call's
/// `function.arguments` becomes an object (see the module doc). `None` drops the key.
fn normalize_tool_calls(calls: Json) -> Result<Option<Json>, TokenizeError> {
    let mut calls = match calls {
        Json::Null => return Ok(None),
        Json::Array(calls) if calls.is_empty() => return Ok(None),
        Json::Array(calls) => calls,
        _ => return Err(TokenizeError::InvalidMessage("`tool_calls` must be a list")),
    };
    for call in &mut calls {
        let Json::Object(fields) = call else {
            return Err(TokenizeError::InvalidMessage(
                "assistant tool_calls entries must be objects",
            ));
        };
        let is_function = match fields.get("type") {
            None => true,
            Some(t) => t.as_str() == Some("function"),
        };
        let Some(Json::Object(function)) = fields.get_mut("function").filter(|_| is_function)
        else {
            return Err(TokenizeError::InvalidMessage(
                "chat completions only support assistant tool_calls of type 'function'",
            ));
        };
        let parsed = match function.get("arguments") {
            Some(Json::Object(o)) => Json::Object(o.clone()),
            Some(Json::Str(text)) => match serde_json::from_str::<Json>(text) {
                Ok(object @ Json::Object(_)) => object,
                _ => empty(),
            },
            _ => empty(),
        };
        function.insert("arguments".to_owned(), parsed);
    }
    Ok(Some(Json::Array(calls)))
}

fn empty() -> Json {
    Json::Object(IndexMap::new())
}

impl Message {
    /// A message with only a role and text content.
    pub(crate) fn text(role: &str, content: String) -> Message {
        Message {
            role: role.to_owned(),
            content,
            name: None,
            tool_calls: None,
            reasoning: None,
            tool_call_id: None,
            task: None,
            tools: None,
        }
    }

    /// Normalises one wire message.
    pub(crate) fn from_wire(m: WireMessage) -> Result<Message, TokenizeError> {
        let assistant = m.role == "assistant";
        Ok(Message {
            content: flatten_content(m.content, m.role == "system")?,
            name: match m.name {
                Json::Str(s) => Some(s),
                _ => None,
            },
            tool_calls: if assistant {
                normalize_tool_calls(m.tool_calls)?
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
            task: match m.task {
                Json::Str(s) => Some(s),
                _ => None,
            },
            tools: if m.role == "developer" {
                non_null(m.tools)
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
        if let Some(task) = &self.task {
            map.insert(Value::from("task"), Value::from(task.as_str()));
        }
        if let Some(tools) = &self.tools {
            map.insert(Value::from("tools"), tools.clone().into_value());
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
