//! `/v1/responses` bodies (OpenAI Responses API) → the chat prompt vLLM 0.33 renders for them.
//!
//! Follows `OnlineRenderer.render_responses` (`vllm/renderers/online_renderer.py`) for
//! non-Harmony models:
//! - messages (`construct_input_messages`, `vllm/entrypoints/openai/responses/utils.py`): a
//!   `system` message with `instructions` when non-empty; then a string `input` as one `user`
//!   message, or each input item as a chat message: an assistant item becomes `{role:
//!   assistant, content}` with its string content or its first part's `text`
//!   (`_construct_message_from_response_item`); a `user`/`system`/`developer` item is passed on
//!   as a chat message (its `input_text` parts are text, its images ignored as in chat).
//! - tools: function tools re-serialised as chat tools (`construct_tool_dicts`).
//! - `ResponsesRequest.build_chat_params`: `continue_final_message` when the last item is a
//!   message or reasoning item with status `in_progress`/`incomplete`
//!   (`should_continue_final_message`), `add_generation_prompt` otherwise;
//!   `reasoning.effort` as `reasoning_effort`/`enable_thinking`; `chat_template_kwargs` merged
//!   as for chat.
//! - `ResponsesRequest.build_tok_params` leaves `add_special_tokens` at its default, `true`.
//!
//! Not mapped yet, so routed on load ([`Unrenderable::ResponsesInput`]): function calls and
//! their outputs, reasoning items and other item types, other roles, `previous_response_id`
//! (history kept by the server), stored `prompt`s.

use indexmap::IndexMap;
use serde::Deserialize;

use super::error::{TokenizeError, Unrenderable};
use super::json::Json;
use super::messages::{Message, WireMessage};
use super::request::{ChatPrompt, ParsedRequest, Prompt};
use super::vllm::{RequestArgs, dump_responses_tools, reasoning_effort, template_args};

#[derive(Deserialize)]
struct WireResponses {
    #[serde(default)]
    model: Option<String>,
    #[serde(default)]
    input: Json,
    #[serde(default)]
    instructions: Json,
    #[serde(default)]
    tools: Json,
    #[serde(default)]
    reasoning: Json,
    #[serde(default)]
    chat_template_kwargs: Option<IndexMap<String, Json>>,
    #[serde(default)]
    previous_response_id: Json,
    #[serde(default)]
    prompt: Json,
}

fn not_mapped(detail: &'static str) -> TokenizeError {
    TokenizeError::inexact(Unrenderable::ResponsesInput, detail)
}

/// The chat message of one input item (see the module doc).
fn item_message(item: Json) -> Result<WireMessage, TokenizeError> {
    let Json::Object(fields) = item else {
        return Err(TokenizeError::InvalidMessage("input items must be objects"));
    };
    let kind = fields
        .get("type")
        .and_then(Json::as_str)
        .unwrap_or("message");
    if kind != "message" {
        return Err(not_mapped("an input item other than a message"));
    }
    let role = fields.get("role").and_then(Json::as_str).unwrap_or("");
    match role {
        "assistant" => {
            let text = match fields.get("content") {
                Some(Json::Str(s)) => Some(s.clone()),
                Some(Json::Array(parts)) => parts
                    .first()
                    .and_then(|p| p.get("text"))
                    .and_then(Json::as_str)
                    .map(str::to_owned),
                _ => None,
            };
            text.map(|t| WireMessage::text("assistant", t))
                .ok_or_else(|| not_mapped("an assistant item without text"))
        }
        "user" | "system" | "developer" => {
            // Re-read the item as a chat message (members keep their order).
            let text = serde_json::to_string(&Json::Object(fields))?;
            Ok(serde_json::from_str(&text)?)
        }
        _ => Err(not_mapped("an input message with another role")),
    }
}

/// `should_continue_final_message`: the last item is a partial message or reasoning item.
fn continues_final(input: &Json) -> bool {
    let Json::Array(items) = input else {
        return false;
    };
    let Some(last) = items.last() else {
        return false;
    };
    let kind = last.get("type").and_then(Json::as_str).unwrap_or("message");
    matches!(kind, "message" | "reasoning")
        && matches!(
            last.get("status").and_then(Json::as_str),
            Some("in_progress" | "incomplete")
        )
}

/// Parses a `/v1/responses` body into the chat prompt vLLM renders for it.
pub(crate) fn parse_responses(body: &[u8]) -> Result<ParsedRequest, TokenizeError> {
    let wire: WireResponses = serde_json::from_slice(body)?;
    let model = wire.model.ok_or(TokenizeError::MissingModel)?;
    if !wire.previous_response_id.is_null() || !wire.prompt.is_null() {
        return Err(not_mapped("previous_response_id or a stored prompt"));
    }
    let effort = match wire.reasoning {
        Json::Null => None,
        Json::Object(mut r) => reasoning_effort(r.swap_remove("effort").unwrap_or_default())?,
        _ => {
            return Err(TokenizeError::InvalidPrompt(
                "`reasoning` must be an object",
            ));
        }
    };
    let continue_final_message = continues_final(&wire.input);
    let mut wire_messages = Vec::new();
    match wire.instructions {
        Json::Null => {}
        Json::Str(s) if s.is_empty() => {}
        Json::Str(s) => wire_messages.push(WireMessage::text("system", s)),
        _ => {
            return Err(TokenizeError::InvalidPrompt(
                "`instructions` must be a string",
            ));
        }
    }
    match wire.input {
        Json::Str(s) => wire_messages.push(WireMessage::text("user", s)),
        Json::Array(items) => {
            for item in items {
                wire_messages.push(item_message(item)?);
            }
        }
        _ => {
            return Err(TokenizeError::InvalidPrompt(
                "`input` must be a string or a list of items",
            ));
        }
    }
    if wire_messages.is_empty() {
        return Err(TokenizeError::EmptyMessages);
    }
    let messages = wire_messages
        .into_iter()
        .map(Message::from_wire)
        .collect::<Result<Vec<_>, _>>()?;
    let args = template_args(RequestArgs {
        add_generation_prompt: !continue_final_message,
        continue_final_message,
        documents: Json::Null,
        reasoning_effort: effort,
        tools: dump_responses_tools(wire.tools)?,
        user_kwargs: wire.chat_template_kwargs,
        request_chat_template: false,
    })?;
    Ok(ParsedRequest {
        model,
        prompt: Prompt::Chat(Box::new(ChatPrompt {
            messages,
            args,
            add_special_tokens: true,
        })),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chat(body: &str) -> Result<ChatPrompt, TokenizeError> {
        match parse_responses(body.as_bytes())?.prompt {
            Prompt::Chat(c) => Ok(*c),
            _ => unreachable!(),
        }
    }

    #[test]
    fn string_and_message_inputs() {
        let c = chat(r#"{"model":"m","input":"hi","instructions":"be brief"}"#).unwrap();
        let roles: Vec<&str> = c.messages.iter().map(|m| m.role.as_str()).collect();
        assert_eq!(roles, ["system", "user"]);
        assert!(c.add_special_tokens && c.args.add_generation_prompt);
        let c = chat(
            r#"{"model":"m","input":[{"role":"user","content":[{"type":"input_text","text":"a"}]},
                {"type":"message","role":"assistant","content":[{"type":"output_text","text":"b"},{"type":"output_text","text":"c"}],"status":"incomplete"}],
                "tools":[{"type":"function","name":"f","parameters":{"type":"object"}}],
                "reasoning":{"effort":"high"}}"#,
        )
        .unwrap();
        assert_eq!(c.messages[0].content, "a");
        assert_eq!(c.messages[1].content, "b");
        assert!(c.args.continue_final_message && !c.args.add_generation_prompt);
        assert_eq!(c.args.kwargs["enable_thinking"], Json::Bool(true));
        let tools = serde_json::to_string(&c.args.tools.unwrap()).unwrap();
        assert_eq!(
            tools,
            r#"[{"type":"function","function":{"name":"f","description":null,"parameters":{"type":"object"}}}]"#
        );
    }

    #[test]
    fn unmapped_inputs_are_counted_not_refused() {
        for body in [
            r#"{"model":"m","input":[{"type":"function_call_output","call_id":"c","output":"x"}]}"#,
            r#"{"model":"m","input":"x","previous_response_id":"resp_1"}"#,
            r#"{"model":"m","input":"x","tools":[{"type":"web_search"}]}"#,
        ] {
            let e = chat(body).unwrap_err();
            assert!(e.unrenderable().is_some(), "{body}: {e}");
        }
        for body in [
            r#"{"model":"m","input":3}"#,
            r#"{"model":"m","input":[]}"#,
            r#"{"input":"x"}"#,
            r#"{"model":"m","input":"x","reasoning":{"effort":"huge"}}"#,
        ] {
            let e = chat(body).unwrap_err();
            assert!(
                e.unrenderable().is_none() && e.is_client_error(),
                "{body}: {e}"
            );
        }
    }
}
