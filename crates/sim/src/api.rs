//! What the simulated engine accepts from an OpenAI-style request body, with vLLM 0.33's rules:
//! the served model or one of its LoRA adapters, token-ID prompts (text and chat only through a
//! [`TokenizeHook`]), `max_tokens`, `stream`, and the `cache_salt` validation rule
//! ([`validate_cache_salt`], the only place it is written). Unknown fields (`nvext`, ...) are
//! ignored, as vLLM ignores them.
//!
//! Pure code: every error is an [`ApiError`] that the HTTP edge maps to a status and JSON body.

use std::sync::Arc;

use serde_json::Value;

/// Tokenizes a text or chat request: called with the whole request body (so a chat template can
/// see `messages`, `add_generation_prompt`, ...) and returns the prompt's token IDs, or a message
/// that becomes a 400. Without a hook, text and chat prompts are refused with
/// [`TEXT_NEEDS_TOKENIZER`].
pub type TokenizeHook = Arc<dyn Fn(&[u8], Endpoint) -> Result<Vec<u32>, String> + Send + Sync>;

/// The 400 message for a text or chat prompt when no tokenizer is wired in.
pub const TEXT_NEEDS_TOKENIZER: &str = "text prompts need a tokenizer; send token IDs";

/// vLLM 0.33's longest accepted `cache_salt`, in characters.
pub const MAX_CACHE_SALT_CHARS: usize = 128;

/// Characters vLLM 0.33 refuses in a `cache_salt`.
pub const FORBIDDEN_SALT_CHARS: [char; 4] = ['@', '/', '\\', '\0'];

/// Output tokens when the request names none (vLLM's completions default).
pub const DEFAULT_MAX_TOKENS: u32 = 16;

/// Which endpoint a body was sent to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Endpoint {
    /// `/v1/completions`.
    Completions,
    /// `/v1/chat/completions`.
    Chat,
}

/// A request the engine can run.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SimRequest {
    /// The `model` field as sent (echoed in responses).
    pub model: String,
    /// The LoRA adapter, when `model` names one.
    pub lora_name: Option<String>,
    /// Prompt token IDs.
    pub tokens: Vec<u32>,
    /// The validated cache salt.
    pub cache_salt: Option<String>,
    /// Tokens to generate.
    pub max_tokens: u32,
    /// Stream SSE chunks.
    pub stream: bool,
    /// Send a final usage chunk when streaming (`stream_options.include_usage`).
    pub include_usage: bool,
}

/// Why a request was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ApiError {
    /// 400: malformed or unsupported request.
    #[error("{0}")]
    BadRequest(String),
    /// 404: the model is not served here.
    #[error("The model `{0}` does not exist.")]
    ModelNotFound(String),
}

impl ApiError {
    /// HTTP status code.
    pub fn status(&self) -> u16 {
        match self {
            ApiError::BadRequest(_) => 400,
            ApiError::ModelNotFound(_) => 404,
        }
    }

    /// vLLM's error type name.
    pub fn kind(&self) -> &'static str {
        match self {
            ApiError::BadRequest(_) => "BadRequestError",
            ApiError::ModelNotFound(_) => "NotFoundError",
        }
    }
}

fn bad(msg: impl Into<String>) -> ApiError {
    ApiError::BadRequest(msg.into())
}

/// vLLM 0.33's `cache_salt` rule: absent (missing or null) is fine; otherwise a non-empty string
/// of at most 128 characters containing none of `@`, `/`, `\`, NUL.
pub fn validate_cache_salt(v: Option<&Value>) -> Result<Option<String>, ApiError> {
    let s = match v {
        None | Some(Value::Null) => return Ok(None),
        Some(Value::String(s)) => s,
        Some(_) => return Err(bad("cache_salt must be a string")),
    };
    if s.is_empty() {
        return Err(bad("cache_salt must be a non-empty string"));
    }
    if s.chars().count() > MAX_CACHE_SALT_CHARS {
        return Err(bad(format!(
            "cache_salt must be at most {MAX_CACHE_SALT_CHARS} characters"
        )));
    }
    if s.contains(FORBIDDEN_SALT_CHARS) {
        return Err(bad(
            "cache_salt must not contain '@', '/', '\\' or NUL characters",
        ));
    }
    Ok(Some(s.clone()))
}

/// SGLang's `cache_salt` rule (since #30827): any string; the empty string is no salt; anything
/// else but null is refused (SGLang's pydantic model answers 400). A list, one salt per prompt of
/// a batch, is not simulated.
pub fn sglang_cache_salt(v: Option<&Value>) -> Result<Option<String>, ApiError> {
    match v {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(s.clone()).filter(|s| !s.is_empty())),
        Some(_) => Err(bad("cache_salt must be a string")),
    }
}

/// What the engine serves: its model name and LoRA adapters.
#[derive(Clone, Debug, Default)]
pub struct Served {
    /// The base model's served name.
    pub model: String,
    /// LoRA adapter names (clients put them in `model`).
    pub lora_modules: Vec<String>,
    /// Whose `cache_salt` rule the API applies (vLLM's, or SGLang's).
    pub engine: crate::events::SimEngine,
}

/// Parses and validates a request body for `endpoint`.
pub fn parse_request(
    body: &[u8],
    endpoint: Endpoint,
    served: &Served,
    tokenize: Option<&TokenizeHook>,
) -> Result<SimRequest, ApiError> {
    let json: Value = serde_json::from_slice(body)
        .map_err(|e| bad(format!("request body is not valid JSON: {e}")))?;
    if !json.is_object() {
        return Err(bad("request body must be a JSON object"));
    }
    let model = match json.get("model") {
        Some(Value::String(m)) => m.clone(),
        None | Some(Value::Null) => served.model.clone(),
        Some(_) => return Err(bad("model must be a string")),
    };
    let lora_name = if model == served.model {
        None
    } else if served.lora_modules.contains(&model) {
        Some(model.clone())
    } else {
        return Err(ApiError::ModelNotFound(model));
    };
    let cache_salt = match served.engine {
        crate::events::SimEngine::Sglang => sglang_cache_salt(json.get("cache_salt"))?,
        _ => validate_cache_salt(json.get("cache_salt"))?,
    };
    let tokens = match endpoint {
        Endpoint::Completions => match json.get("prompt") {
            None => return Err(bad("prompt is required")),
            Some(p) => match token_prompt(p)? {
                Some(t) => t,
                None => with_tokenizer(body, endpoint, tokenize)?,
            },
        },
        Endpoint::Chat => match json.get("messages") {
            Some(Value::Array(_)) => with_tokenizer(body, endpoint, tokenize)?,
            _ => return Err(bad("messages must be an array")),
        },
    };
    if tokens.is_empty() {
        return Err(bad("prompt must not be empty"));
    }
    let max_tokens = match endpoint {
        Endpoint::Chat => json
            .get("max_completion_tokens")
            .filter(|v| !v.is_null())
            .or_else(|| json.get("max_tokens")),
        Endpoint::Completions => json.get("max_tokens"),
    };
    let max_tokens = match max_tokens {
        None | Some(Value::Null) => DEFAULT_MAX_TOKENS,
        Some(v) => v
            .as_u64()
            .and_then(|n| u32::try_from(n).ok())
            .filter(|n| *n >= 1)
            .ok_or_else(|| bad("max_tokens must be an integer >= 1"))?,
    };
    let stream = match json.get("stream") {
        None | Some(Value::Null) => false,
        Some(Value::Bool(b)) => *b,
        Some(_) => return Err(bad("stream must be a boolean")),
    };
    let include_usage = json
        .get("stream_options")
        .and_then(|o| o.get("include_usage"))
        .and_then(Value::as_bool)
        .unwrap_or(false);
    Ok(SimRequest {
        model,
        lora_name,
        tokens,
        cache_salt,
        max_tokens,
        stream,
        include_usage,
    })
}

fn with_tokenizer(
    body: &[u8],
    endpoint: Endpoint,
    tokenize: Option<&TokenizeHook>,
) -> Result<Vec<u32>, ApiError> {
    match tokenize {
        Some(t) => t(body, endpoint).map_err(ApiError::BadRequest),
        None => Err(bad(TEXT_NEEDS_TOKENIZER)),
    }
}

/// Token IDs of a prompt (`[1,2,3]`, or the first of a batch `[[1,2],[3]]`); `None` for text.
fn token_prompt(p: &Value) -> Result<Option<Vec<u32>>, ApiError> {
    let ids = |items: &[Value]| -> Result<Vec<u32>, ApiError> {
        items
            .iter()
            .map(|v| {
                v.as_u64()
                    .and_then(|n| u32::try_from(n).ok())
                    .ok_or_else(|| bad("prompt token IDs must be integers in 0..=4294967295"))
            })
            .collect()
    };
    match p {
        Value::String(_) => Ok(None),
        Value::Array(items) => match items.first() {
            None => Err(bad("prompt must not be empty")),
            Some(Value::Number(_)) => ids(items).map(Some),
            Some(Value::Array(first)) => ids(first).map(Some),
            Some(Value::String(_)) => Ok(None),
            Some(_) => Err(bad(
                "prompt must be a string, token IDs, or a batch of them",
            )),
        },
        _ => Err(bad(
            "prompt must be a string, token IDs, or a batch of them",
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn served() -> Served {
        Served {
            model: "m".into(),
            lora_modules: vec!["ad".into()],
            engine: crate::events::SimEngine::Vllm,
        }
    }

    fn parse(body: Value, ep: Endpoint) -> Result<SimRequest, ApiError> {
        parse_request(body.to_string().as_bytes(), ep, &served(), None)
    }

    #[test]
    fn salt_rule_is_vllm_033() {
        let ok = |v: Value| validate_cache_salt(Some(&v));
        assert_eq!(validate_cache_salt(None), Ok(None));
        assert_eq!(ok(Value::Null), Ok(None));
        assert_eq!(ok(json!("tenant-a")), Ok(Some("tenant-a".into())));
        let max = "é".repeat(128); // characters, not bytes
        assert_eq!(ok(json!(max)), Ok(Some(max.clone())));
        for refused in [
            json!(""),
            json!("x".repeat(129)),
            json!("org/team"),
            json!("a@b"),
            json!("a\\b"),
            json!("a\u{0}b"),
            json!(5),
            json!(["a"]),
        ] {
            assert!(
                matches!(ok(refused.clone()), Err(ApiError::BadRequest(_))),
                "{refused}"
            );
        }
    }

    #[test]
    fn prompts_models_and_options() {
        let r = parse(
            json!({"model":"ad","prompt":[[1,2],[3]],"cache_salt":"t","nvext":{"x":1}}),
            Endpoint::Completions,
        )
        .unwrap();
        assert_eq!(r.tokens, vec![1, 2]);
        assert_eq!(r.lora_name.as_deref(), Some("ad"));
        assert_eq!(r.cache_salt.as_deref(), Some("t"));
        assert_eq!((r.max_tokens, r.stream), (DEFAULT_MAX_TOKENS, false));
        let r = parse(
            json!({"model":"m","prompt":[5],"max_tokens":3,"stream":true,
                   "stream_options":{"include_usage":true}}),
            Endpoint::Completions,
        )
        .unwrap();
        assert_eq!((r.max_tokens, r.stream, r.include_usage), (3, true, true));
        assert_eq!(r.lora_name, None);
        assert_eq!(
            parse(json!({"model":"x","prompt":[1]}), Endpoint::Completions),
            Err(ApiError::ModelNotFound("x".into()))
        );
        for text in [
            json!({"model":"m","prompt":"hi"}),
            json!({"model":"m","prompt":["hi"]}),
        ] {
            assert_eq!(
                parse(text, Endpoint::Completions),
                Err(bad(TEXT_NEEDS_TOKENIZER))
            );
        }
        assert_eq!(
            parse(json!({"model":"m","messages":[]}), Endpoint::Chat),
            Err(bad(TEXT_NEEDS_TOKENIZER))
        );
        for refused in [
            json!({"model":"m","prompt":[1,-1]}),
            json!({"model":"m","prompt":[]}),
            json!({"model":"m","prompt":[1],"max_tokens":0}),
            json!({"model":"m","prompt":[1],"stream":"yes"}),
            json!({"model":"m","prompt":[1],"cache_salt":""}),
        ] {
            assert!(parse(refused, Endpoint::Completions).is_err());
        }
        assert!(parse_request(b"{", Endpoint::Completions, &served(), None).is_err());
    }

    #[test]
    fn tokenize_hook_serves_text_and_chat() {
        let hook: TokenizeHook = Arc::new(|_body: &[u8], endpoint: Endpoint| {
            if endpoint == Endpoint::Chat {
                Ok(vec![9, 9])
            } else {
                Err("no".into())
            }
        });
        let chat = parse_request(
            br#"{"model":"m","messages":[{"role":"user","content":"hi"}],"max_completion_tokens":2}"#,
            Endpoint::Chat,
            &served(),
            Some(&hook),
        )
        .unwrap();
        assert_eq!((chat.tokens, chat.max_tokens), (vec![9, 9], 2));
        assert_eq!(
            parse_request(
                br#"{"model":"m","prompt":"hi"}"#,
                Endpoint::Completions,
                &served(),
                Some(&hook)
            ),
            Err(bad("no"))
        );
    }
}
