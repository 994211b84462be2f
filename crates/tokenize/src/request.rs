//! OpenAI request bodies → what has to be tokenized.
//!
//! One `serde_json` pass per body; fields no template or tokenizer reads are skipped without
//! being materialised. Defaults follow vLLM: chat renders with `add_generation_prompt = true` and
//! encodes with `add_special_tokens = false` (the template writes any BOS itself); completions
//! encode with `add_special_tokens = true`.
//!
//! Completions prompts: a string is encoded; a list of token ids is used as is; a batch (list of
//! strings, or list of token-id lists) routes on its FIRST prompt, since one request goes to one
//! worker and the first prompt is the one the engine schedules first.
//!
//! Chat and responses bodies then go through vLLM's own request preprocessing (`vllm.rs`):
//! tools re-serialised, reasoning effort, request fields over `chat_template_kwargs`; a chat
//! with the prefill stage's `kv_transfer_params.prompt_token_ids` is those ids, as in vLLM.
//! `/v1/responses` (`responses.rs`): `input` as a string or a list of messages,
//! `instructions`, function tools, `reasoning.effort`; other input items route on load.

use indexmap::IndexMap;
use serde::Deserialize;

use super::error::TokenizeError;
use super::json::Json;
use super::messages::{Message, WireMessage};
use super::responses::parse_responses;
use super::vllm::{RequestArgs, TemplateArgs, dump_tools, reasoning_effort, template_args};

/// The OpenAI endpoints whose prompts kv-epp can tokenize.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Endpoint {
    /// `/v1/chat/completions`.
    ChatCompletions,
    /// `/v1/completions`.
    Completions,
    /// `/v1/responses` (OpenAI Responses API).
    Responses,
}

impl Endpoint {
    /// The endpoint of a request path (`:path` pseudo-header; a query string is ignored), or
    /// `None` when kv-epp does not tokenize that path.
    pub fn from_path(path: &str) -> Option<Endpoint> {
        let path = path.split_once('?').map_or(path, |(p, _)| p);
        match path.trim_end_matches('/') {
            "/v1/chat/completions" => Some(Endpoint::ChatCompletions),
            "/v1/completions" => Some(Endpoint::Completions),
            "/v1/responses" => Some(Endpoint::Responses),
            _ => None,
        }
    }
}

/// A parsed request: the model it names and its prompt.
#[derive(Clone, Debug, PartialEq)]
pub struct ParsedRequest {
    /// The `model` field: a base model or a LoRA adapter name.
    pub model: String,
    /// What to tokenize.
    pub prompt: Prompt,
}

/// What to tokenize.
#[derive(Clone, Debug, PartialEq)]
pub enum Prompt {
    /// A conversation to render with the chat template, then encode.
    Chat(Box<ChatPrompt>),
    /// Text to encode.
    Text {
        /// The prompt text.
        text: String,
        /// Whether the tokenizer's post-processor (e.g. a BOS) applies.
        add_special_tokens: bool,
    },
    /// Token ids given by the client, used as is.
    TokenIds(Vec<u32>),
}

/// A chat conversation and its rendering options.
#[derive(Clone, Debug, PartialEq)]
pub struct ChatPrompt {
    /// Normalised messages, never empty.
    pub messages: Vec<Message>,
    /// What `apply_chat_template` receives besides the messages, after vLLM's preprocessing.
    pub args: TemplateArgs,
    /// Whether the rendered prompt is encoded with the post-processor: `false` for chat
    /// (vLLM's default), `true` for `/v1/responses` (its tokenize parameters keep the default).
    pub add_special_tokens: bool,
}

#[derive(Deserialize)]
struct WireChat {
    #[serde(default)]
    model: Option<String>,
    #[serde(default)]
    messages: Option<Vec<WireMessage>>,
    #[serde(default)]
    tools: Json,
    #[serde(default)]
    documents: Json,
    #[serde(default)]
    add_generation_prompt: Option<bool>,
    #[serde(default)]
    continue_final_message: Option<bool>,
    #[serde(default)]
    add_special_tokens: Option<bool>,
    #[serde(default)]
    chat_template_kwargs: Option<IndexMap<String, Json>>,
    #[serde(default)]
    chat_template: Json,
    #[serde(default)]
    reasoning_effort: Json,
    #[serde(default)]
    kv_transfer_params: Json,
    #[serde(default)]
    echo: Option<bool>,
}

/// `has_non_text_content` (`vllm/renderers/chat_utils/chat_message.py`): a content part with a
/// media key, a non-string `type` or a type that is not text; or a prompt-embeds reasoning.
fn has_non_text_content(messages: &Json) -> bool {
    const TEXT_TYPES: [&str; 6] = [
        "text",
        "input_text",
        "output_text",
        "refusal",
        "thinking",
        "tool_reference",
    ];
    let Json::Array(messages) = messages else {
        return false;
    };
    messages.iter().any(|m| {
        let embeds = ["reasoning", "reasoning_content"].iter().any(|f| {
            m.get(f).and_then(|r| r.get("type")).and_then(Json::as_str) == Some("prompt_embeds")
        });
        let Some(Json::Array(parts)) = m.get("content") else {
            return embeds;
        };
        embeds
            || parts.iter().any(|p| {
                let Json::Object(fields) = p else {
                    return false;
                };
                crate::messages::MEDIA_TYPES
                    .iter()
                    .any(|k| fields.contains_key(*k))
                    || match fields.get("type") {
                        None => false,
                        Some(Json::Str(t)) => !TEXT_TYPES.contains(&t.as_str()),
                        Some(_) => true,
                    }
            })
    })
}

/// `_reused_prompt_token_ids` (`vllm/renderers/online_renderer.py`): in disaggregated serving
/// the prefill stage's ids ride in `kv_transfer_params.prompt_token_ids`, and vLLM uses them
/// instead of rendering, unless `echo` is set or a message has non-text content. Errors (400):
/// not a non-empty list of non-negative integers.
fn reused_prompt_token_ids(
    kv_transfer_params: &Json,
    echo: bool,
    raw_messages: &Json,
) -> Result<Option<Vec<u32>>, TokenizeError> {
    let Some(ids) = kv_transfer_params.get("prompt_token_ids") else {
        return Ok(None);
    };
    if ids.is_null() || echo || has_non_text_content(raw_messages) {
        return Ok(None);
    }
    match ids {
        Json::Array(items) if !items.is_empty() => token_ids(items.clone()).map(Some),
        _ => Err(TokenizeError::InvalidPrompt(
            "kv_transfer_params.prompt_token_ids must be a non-empty list of non-negative integers",
        )),
    }
}

#[derive(Deserialize)]
struct WireCompletion {
    #[serde(default)]
    model: Option<String>,
    #[serde(default)]
    prompt: Json,
    #[serde(default)]
    add_special_tokens: Option<bool>,
}

/// Parses a request body of `endpoint`. Cost: one pass over the body; message texts are copied
/// once.
pub fn parse_request(endpoint: Endpoint, body: &[u8]) -> Result<ParsedRequest, TokenizeError> {
    match endpoint {
        Endpoint::ChatCompletions => {
            let wire: WireChat = serde_json::from_slice(body)?;
            let model = wire.model.ok_or(TokenizeError::MissingModel)?;
            if wire.kv_transfer_params.get("prompt_token_ids").is_some() {
                // Only then are the raw messages needed (has_non_text_content).
                let raw: Json = serde_json::from_slice(body)?;
                let messages = raw.get("messages").cloned().unwrap_or_default();
                let echo = wire.echo.unwrap_or(false);
                if let Some(ids) =
                    reused_prompt_token_ids(&wire.kv_transfer_params, echo, &messages)?
                {
                    return Ok(ParsedRequest {
                        model,
                        prompt: Prompt::TokenIds(ids),
                    });
                }
            }
            let messages = wire
                .messages
                .filter(|m| !m.is_empty())
                .ok_or(TokenizeError::EmptyMessages)?
                .into_iter()
                .map(Message::from_wire)
                .collect::<Result<Vec<_>, _>>()?;
            let add_generation_prompt = wire.add_generation_prompt.unwrap_or(true);
            let continue_final_message = wire.continue_final_message.unwrap_or(false);
            if add_generation_prompt && continue_final_message {
                // ChatCompletionRequest.check_generation_prompt refuses it before rendering.
                return Err(TokenizeError::IncompatibleOptions(
                    "continue_final_message and add_generation_prompt cannot both be set",
                ));
            }
            let args = template_args(RequestArgs {
                add_generation_prompt,
                continue_final_message,
                documents: wire.documents,
                reasoning_effort: reasoning_effort(wire.reasoning_effort)?,
                tools: dump_tools(wire.tools)?,
                user_kwargs: wire.chat_template_kwargs,
                request_chat_template: !wire.chat_template.is_null(),
            })?;
            Ok(ParsedRequest {
                model,
                prompt: Prompt::Chat(Box::new(ChatPrompt {
                    messages,
                    args,
                    add_special_tokens: wire.add_special_tokens.unwrap_or(false),
                })),
            })
        }
        Endpoint::Completions => {
            let wire: WireCompletion = serde_json::from_slice(body)?;
            let model = wire.model.ok_or(TokenizeError::MissingModel)?;
            let add_special_tokens = wire.add_special_tokens.unwrap_or(true);
            Ok(ParsedRequest {
                model,
                prompt: completion_prompt(wire.prompt, add_special_tokens)?,
            })
        }
        Endpoint::Responses => parse_responses(body),
    }
}

fn completion_prompt(prompt: Json, add_special_tokens: bool) -> Result<Prompt, TokenizeError> {
    match prompt {
        Json::Str(text) => Ok(Prompt::Text {
            text,
            add_special_tokens,
        }),
        Json::Array(items) => {
            let Some(first) = items.first() else {
                return Err(TokenizeError::InvalidPrompt("empty prompt list"));
            };
            match first {
                Json::UInt(_) => token_ids(items).map(Prompt::TokenIds),
                Json::Str(_) | Json::Array(_) => {
                    // A batch: route on the first prompt.
                    let first = items.into_iter().next().unwrap_or_default();
                    match first {
                        Json::Str(text) => Ok(Prompt::Text {
                            text,
                            add_special_tokens,
                        }),
                        Json::Array(ids) => token_ids(ids).map(Prompt::TokenIds),
                        _ => Err(TokenizeError::InvalidPrompt("unsupported prompt list")),
                    }
                }
                _ => Err(TokenizeError::InvalidPrompt("unsupported prompt list")),
            }
        }
        Json::Null => Err(TokenizeError::InvalidPrompt("missing prompt")),
        _ => Err(TokenizeError::InvalidPrompt(
            "prompt must be a string, a list of token ids, or a batch of either",
        )),
    }
}

fn token_ids(items: Vec<Json>) -> Result<Vec<u32>, TokenizeError> {
    if items.is_empty() {
        return Err(TokenizeError::InvalidPrompt("empty token id list"));
    }
    items
        .into_iter()
        .map(|item| match item {
            Json::UInt(id) => u32::try_from(id)
                .map_err(|_| TokenizeError::InvalidPrompt("token id does not fit in 32 bits")),
            _ => Err(TokenizeError::InvalidPrompt(
                "token ids must be non-negative integers",
            )),
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(endpoint: Endpoint, body: &str) -> Result<ParsedRequest, TokenizeError> {
        parse_request(endpoint, body.as_bytes())
    }

    #[test]
    fn paths() {
        assert_eq!(
            Endpoint::from_path("/v1/chat/completions?x=1"),
            Some(Endpoint::ChatCompletions)
        );
        assert_eq!(
            Endpoint::from_path("/v1/completions"),
            Some(Endpoint::Completions)
        );
        assert_eq!(Endpoint::from_path("/v1/models"), None);
    }

    #[test]
    fn chat_defaults_and_errors() {
        let r = parse(
            Endpoint::ChatCompletions,
            r#"{"model":"m","messages":[{"role":"user","content":"hi"}],"stream":true}"#,
        )
        .unwrap();
        let Prompt::Chat(chat) = r.prompt else {
            panic!()
        };
        assert!(chat.args.add_generation_prompt && !chat.add_special_tokens);
        assert!(!chat.args.continue_final_message && chat.args.tools.is_none());
        assert!(matches!(
            parse(
                Endpoint::ChatCompletions,
                r#"{"messages":[{"role":"user"}]}"#
            ),
            Err(TokenizeError::MissingModel)
        ));
        assert!(matches!(
            parse(Endpoint::ChatCompletions, r#"{"model":"m","messages":[]}"#),
            Err(TokenizeError::EmptyMessages)
        ));
        assert!(matches!(
            parse(
                Endpoint::ChatCompletions,
                r#"{"model":"m","messages":[{"content":"x"}]}"#
            ),
            Err(TokenizeError::MalformedBody(_))
        ));
        assert!(matches!(
            parse(Endpoint::ChatCompletions, "{not json"),
            Err(TokenizeError::MalformedBody(_))
        ));
    }

    #[test]
    fn completion_prompt_forms() {
        let prompt = |p: &str| {
            parse(
                Endpoint::Completions,
                &format!(r#"{{"model":"m","prompt":{p}}}"#),
            )
            .map(|r| r.prompt)
        };
        assert_eq!(
            prompt(r#""hi""#).unwrap(),
            Prompt::Text {
                text: "hi".into(),
                add_special_tokens: true
            }
        );
        assert_eq!(prompt("[1,2,3]").unwrap(), Prompt::TokenIds(vec![1, 2, 3]));
        assert_eq!(prompt("[[4,5],[6]]").unwrap(), Prompt::TokenIds(vec![4, 5]));
        assert_eq!(
            prompt(r#"["a","b"]"#).unwrap(),
            Prompt::Text {
                text: "a".into(),
                add_special_tokens: true
            }
        );
        for bad in [
            "[]",
            "[-1]",
            "[1.5]",
            "[4294967296]",
            "null",
            "3",
            "[[]]",
            r#"[1,"a"]"#,
        ] {
            assert!(prompt(bad).is_err(), "{bad}");
        }
    }
}
