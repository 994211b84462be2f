//! What vLLM 0.33's server does to a chat request before the template renders it, beyond
//! transformers: template arguments, tools, reasoning effort and the `developer` role.
//!
//! Each rule names the vLLM 0.33.0 source it follows. `scripts/gen_vllm_preproc_cases.py` runs
//! those very functions (taken from the wheel) to produce `tests/fixtures/tokenizer/
//! vllm_cases.json`, which `tests/vllm_preprocess.rs` checks this crate against.
//!
//! Not reproduced (documented, not silently wrong): server flags kv-epp does not know
//! (`--default-chat-template-kwargs`, a reasoning-effort map, `--exclude-tools-when-tool-choice-
//! none`, `--trust-request-chat-template`: requests relying on them are rendered as with vLLM's
//! defaults, or refused as [`Unrenderable::RequestChatTemplate`]); Mistral and GPT-OSS (Harmony)
//! renderers; the "openai" content format (see [`reads_content_parts`]).

use indexmap::IndexMap;

use super::error::{TokenizeError, Unrenderable};
use super::json::Json;
use super::messages::Message;

/// `merge_kwargs`' unset values (`vllm/renderers/params.py`): an override of `None` or
/// `"auto"` leaves the default in place.
fn is_unset(v: &Json) -> bool {
    matches!(v, Json::Null) || v.as_str() == Some("auto")
}

/// Python truthiness of a JSON value.
fn truthy(v: &Json) -> bool {
    match v {
        Json::Null => false,
        Json::Bool(b) => *b,
        Json::Int(i) => *i != 0,
        Json::UInt(u) => *u != 0,
        Json::Float(f) => *f != 0.0,
        Json::Str(s) => !s.is_empty(),
        Json::Array(a) => !a.is_empty(),
        Json::Object(o) => !o.is_empty(),
    }
}

/// `merge_kwargs(defaults, overrides)` (`vllm/renderers/params.py`): `defaults | {k: v for k, v
/// in overrides if v not in (None, "auto")}`, with Python's dict order (a replaced key keeps
/// its place, a new key goes last).
fn merge_kwargs(defaults: &mut IndexMap<String, Json>, overrides: IndexMap<String, Json>) {
    for (k, v) in overrides {
        if !is_unset(&v) {
            defaults.insert(k, v);
        }
    }
}

/// `ReasoningEffort` (`vllm/renderers/params.py`): the values a request may carry.
const REASONING_EFFORTS: [&str; 7] = ["none", "minimal", "low", "medium", "high", "xhigh", "max"];

/// A request's `reasoning_effort` (chat) or `reasoning.effort` (responses), validated as
/// pydantic validates vLLM's `ReasoningEffort` literal: a 400 for any other value.
pub(crate) fn reasoning_effort(value: Json) -> Result<Option<String>, TokenizeError> {
    match value {
        Json::Null => Ok(None),
        Json::Str(s) if REASONING_EFFORTS.contains(&s.as_str()) => Ok(Some(s)),
        _ => Err(TokenizeError::InvalidPrompt(
            "reasoning_effort must be one of none, minimal, low, medium, high, xhigh, max",
        )),
    }
}

/// The request fields that become template arguments.
#[derive(Debug, Default)]
pub(crate) struct RequestArgs {
    /// `add_generation_prompt` (chat: the field, default true; responses: not continuing).
    pub add_generation_prompt: bool,
    /// `continue_final_message`.
    pub continue_final_message: bool,
    /// `documents` (chat only).
    pub documents: Json,
    /// The validated reasoning effort.
    pub reasoning_effort: Option<String>,
    /// The request's tools as vLLM dumps them ([`dump_tools`]), `None` without tools.
    pub tools: Option<Json>,
    /// `chat_template_kwargs` as sent.
    pub user_kwargs: Option<IndexMap<String, Json>>,
    /// The request carries a `chat_template` of its own.
    pub request_chat_template: bool,
}

/// What `tokenizer.apply_chat_template` receives, split as transformers splits it.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct TemplateArgs {
    /// `tools` (`None`: the template variable is `none`).
    pub tools: Option<Json>,
    /// `documents` (likewise).
    pub documents: Option<Json>,
    /// `add_generation_prompt`.
    pub add_generation_prompt: bool,
    /// `continue_final_message`.
    pub continue_final_message: bool,
    /// Every other keyword: template variables, before the filter to the variables the
    /// template uses ([`filter_template_kwargs`]).
    pub kwargs: IndexMap<String, Json>,
}

/// The keyword parameters of transformers' `apply_chat_template` that it consumes itself (with
/// `tokenize=False` they change nothing, or are refused below); they never reach the template.
const CONSUMED_BY_TRANSFORMERS: [&str; 6] = [
    "padding",
    "truncation",
    "max_length",
    "return_tensors",
    "return_dict",
    "tokenizer_kwargs",
];

/// The template arguments vLLM passes for a request:
/// - `ChatCompletionRequest.build_chat_params` (`vllm/entrypoints/openai/chat_completion/
///   protocol.py`; `ResponsesRequest.build_chat_params` likewise): `chat_template_kwargs`
///   overridden by the request's `add_generation_prompt`, `continue_final_message`,
///   `documents` and `reasoning_effort` (each unless `None`), plus `enable_thinking =
///   reasoning_effort != "none"` when an effort is set and the client's kwargs do not name
///   `enable_thinking`; merged with `merge_kwargs`.
/// - `OnlineRenderer.preprocess_chat` + `ChatParams.with_defaults` (`vllm/renderers/
///   online_renderer.py`, `params.py`): those override the defaults `{tools, tokenize:
///   False}`, dropping `None`/`"auto"` values; so `chat_template_kwargs.tools` replaces the
///   request's tools, and any `"auto"` kwarg vanishes.
/// - `OnlineRenderer.validate_chat_template`: a request template (field or kwarg) is refused
///   unless the server trusts it, which kv-epp cannot know.
/// - transformers' `apply_chat_template` then takes `tools`, `documents`,
///   `add_generation_prompt`, `continue_final_message` and `tokenize` as parameters, consumes
///   [`CONSUMED_BY_TRANSFORMERS`], and passes the rest to the template.
///
/// Errors: [`Unrenderable::RequestChatTemplate`]; [`Unrenderable::UnsupportedOption`] for a
/// truthy `tokenize`, `sanitize_control_tokens` or `return_assistant_tokens_mask`, or a
/// `conversation` kwarg.
pub(crate) fn template_args(req: RequestArgs) -> Result<TemplateArgs, TokenizeError> {
    let user = req.user_kwargs.unwrap_or_default();
    if req.request_chat_template || user.get("chat_template").is_some_and(|t| !t.is_null()) {
        return Err(TokenizeError::inexact(
            Unrenderable::RequestChatTemplate,
            "the request carries its own chat template",
        ));
    }
    let names_enable_thinking = user.contains_key("enable_thinking");
    let mut extra: IndexMap<String, Json> = IndexMap::with_capacity(5);
    extra.insert(
        "add_generation_prompt".into(),
        Json::Bool(req.add_generation_prompt),
    );
    extra.insert(
        "continue_final_message".into(),
        Json::Bool(req.continue_final_message),
    );
    extra.insert("documents".into(), req.documents);
    let effort = req.reasoning_effort;
    extra.insert(
        "reasoning_effort".into(),
        effort.clone().map_or(Json::Null, Json::Str),
    );
    if let Some(effort) = &effort
        && !names_enable_thinking
    {
        extra.insert("enable_thinking".into(), Json::Bool(effort != "none"));
    }
    // build_chat_params: the user's kwargs are the defaults here.
    let mut chat_kwargs = user;
    merge_kwargs(&mut chat_kwargs, extra);
    // with_defaults: now they override {tools, tokenize}.
    let mut all: IndexMap<String, Json> = IndexMap::with_capacity(chat_kwargs.len() + 2);
    if let Some(tools) = req.tools {
        all.insert("tools".into(), tools);
    }
    all.insert("tokenize".into(), Json::Bool(false));
    merge_kwargs(&mut all, chat_kwargs);

    let unsupported = |detail| {
        Err(TokenizeError::inexact(
            Unrenderable::UnsupportedOption,
            detail,
        ))
    };
    if all.shift_remove("tokenize").is_some_and(|t| truthy(&t)) {
        return unsupported("chat_template_kwargs.tokenize");
    }
    if all
        .shift_remove("sanitize_control_tokens")
        .is_some_and(|t| truthy(&t))
    {
        return unsupported("chat_template_kwargs.sanitize_control_tokens");
    }
    if all
        .shift_remove("return_assistant_tokens_mask")
        .is_some_and(|t| truthy(&t))
    {
        return unsupported("chat_template_kwargs.return_assistant_tokens_mask");
    }
    if all.contains_key("conversation") {
        return unsupported("chat_template_kwargs.conversation");
    }
    for name in CONSUMED_BY_TRANSFORMERS {
        all.shift_remove(name);
    }
    let flag = |v: Option<Json>| v.is_some_and(|v| truthy(&v));
    Ok(TemplateArgs {
        tools: all.shift_remove("tools"),
        documents: all.shift_remove("documents"),
        add_generation_prompt: flag(all.shift_remove("add_generation_prompt")),
        continue_final_message: flag(all.shift_remove("continue_final_message")),
        kwargs: all,
    })
}

/// `resolve_chat_template_kwargs` (`vllm/renderers/hf.py`): keeps the kwargs the template reads
/// (its undeclared variables); transformers' own parameters were split off before
/// ([`template_args`]).
pub(crate) fn filter_template_kwargs<'a>(
    kwargs: &'a IndexMap<String, Json>,
    template_vars: &'a std::collections::HashSet<String>,
) -> impl Iterator<Item = (&'a String, &'a Json)> {
    kwargs
        .iter()
        .filter(|(k, _)| k.as_str() != "messages" && template_vars.contains(k.as_str()))
}

fn bad_tool(reason: &'static str) -> TokenizeError {
    TokenizeError::InvalidPrompt(reason)
}

/// A pydantic `bool | None` field: JSON booleans and null are exact; values pydantic's lax mode
/// would coerce (`"true"`, `1`) are not reproduced.
fn optional_bool(v: Option<Json>) -> Result<Option<Json>, TokenizeError> {
    match v {
        None | Some(Json::Null) => Ok(None),
        Some(b @ Json::Bool(_)) => Ok(Some(b)),
        Some(_) => Err(TokenizeError::inexact(
            Unrenderable::UnsupportedOption,
            "a tool's `strict`/`defer_loading` is not a boolean",
        )),
    }
}

/// `FunctionDefinition.model_dump()` (`vllm/entrypoints/generate/base/protocol.py`): `name`,
/// `description` (null when absent), `parameters` (null when absent), then `strict` and
/// `defer_loading` only when set; other members dropped. `tool_defer` is the tool's own
/// `defer_loading`, which `ChatCompletionToolsParam` copies in when the function has none.
fn dump_function(
    mut f: IndexMap<String, Json>,
    tool_defer: Option<Json>,
) -> Result<Json, TokenizeError> {
    let name = match f.swap_remove("name") {
        Some(n @ Json::Str(_)) => n,
        _ => return Err(bad_tool("a tool function needs a string `name`")),
    };
    let description = match f.swap_remove("description") {
        None | Some(Json::Null) => Json::Null,
        Some(d @ Json::Str(_)) => d,
        Some(_) => return Err(bad_tool("a tool's `description` must be a string")),
    };
    let parameters = match f.swap_remove("parameters") {
        None | Some(Json::Null) => Json::Null,
        Some(p @ Json::Object(_)) => p,
        Some(_) => return Err(bad_tool("a tool's `parameters` must be an object")),
    };
    let strict = optional_bool(f.swap_remove("strict"))?;
    let defer = optional_bool(f.swap_remove("defer_loading"))?.or(tool_defer);
    let mut out = IndexMap::with_capacity(5);
    out.insert("name".to_owned(), name);
    out.insert("description".to_owned(), description);
    out.insert("parameters".to_owned(), parameters);
    if let Some(s) = strict {
        out.insert("strict".to_owned(), s);
    }
    if let Some(d) = defer {
        out.insert("defer_loading".to_owned(), d);
    }
    Ok(Json::Object(out))
}

/// One `{"type": "function", "function": {...}}` tool as `ChatCompletionToolsParam.
/// model_dump()` writes it (`vllm/entrypoints/openai/chat_completion/protocol.py`): `type`,
/// `function` ([`dump_function`]), `defer_loading` only when set.
fn dump_function_tool(
    function: IndexMap<String, Json>,
    tool_defer: Option<Json>,
) -> Result<Json, TokenizeError> {
    let mut out = IndexMap::with_capacity(3);
    out.insert("type".to_owned(), Json::Str("function".to_owned()));
    out.insert(
        "function".to_owned(),
        dump_function(function, tool_defer.clone())?,
    );
    if let Some(d) = tool_defer {
        out.insert("defer_loading".to_owned(), d);
    }
    Ok(Json::Object(out))
}

/// A chat request's `tools` as vLLM re-serialises them (`OnlineRenderer.render_chat`:
/// `[tool.model_dump() for tool in request.tools]`). `None` when absent or null. Errors (400,
/// as pydantic's validation): not a list, an entry not an object, a `type` other than
/// `function`, a function without a string `name`.
pub(crate) fn dump_tools(tools: Json) -> Result<Option<Json>, TokenizeError> {
    let tools = match tools {
        Json::Null => return Ok(None),
        Json::Array(t) => t,
        _ => return Err(bad_tool("`tools` must be a list")),
    };
    let mut out = Vec::with_capacity(tools.len());
    for tool in tools {
        let Json::Object(mut tool) = tool else {
            return Err(bad_tool("each tool must be an object"));
        };
        match tool.swap_remove("type") {
            None => {}
            Some(Json::Str(t)) if t == "function" => {}
            Some(_) => return Err(bad_tool("a tool's `type` must be \"function\"")),
        }
        let Some(Json::Object(function)) = tool.swap_remove("function") else {
            return Err(bad_tool("a tool needs a `function` object"));
        };
        let defer = optional_bool(tool.swap_remove("defer_loading"))?;
        out.push(dump_function_tool(function, defer)?);
    }
    Ok(Some(Json::Array(out)))
}

/// A `/v1/responses` request's `tools` as vLLM renders them (`construct_tool_dicts` and
/// `convert_tool_responses_to_completions_format`, `vllm/entrypoints/openai/responses/
/// utils.py`): each flat function tool `{type, name, description, parameters, strict}` becomes
/// a chat tool dump; an empty list is `None`. Other tool types (namespaces, custom and built-in
/// tools) are [`Unrenderable::ResponsesTool`].
pub(crate) fn dump_responses_tools(tools: Json) -> Result<Option<Json>, TokenizeError> {
    let tools = match tools {
        Json::Null => return Ok(None),
        Json::Array(t) if t.is_empty() => return Ok(None),
        Json::Array(t) => t,
        _ => return Err(bad_tool("`tools` must be a list")),
    };
    let mut out = Vec::with_capacity(tools.len());
    for tool in tools {
        let Json::Object(mut tool) = tool else {
            return Err(bad_tool("each tool must be an object"));
        };
        if tool.swap_remove("type").as_ref().and_then(Json::as_str) != Some("function") {
            return Err(TokenizeError::inexact(
                Unrenderable::ResponsesTool,
                "a /v1/responses tool that is not a function tool",
            ));
        }
        out.push(dump_function_tool(tool, None)?);
    }
    Ok(Some(Json::Array(out)))
}

/// `_detect_developer_role_support` (`vllm/renderers/hf.py`): the template names the role as a
/// quoted string literal.
pub(crate) fn supports_developer_role(source: &str) -> bool {
    source.contains("\"developer\"") || source.contains("'developer'")
}

/// `safe_apply_chat_template` (`vllm/renderers/hf.py`): when a conversation has a `developer`
/// message and the template does not support the role, every `developer` message becomes a
/// `system` message without its `tools` (`_convert_developer_to_system`), then the system
/// messages are merged into one at the front when one is not first or there are several
/// (`_consolidate_system_messages`: non-empty contents joined with a blank line, the merged
/// message has only `role` and `content`).
pub(crate) fn developer_as_system(messages: &mut Vec<Message>, template_supports_it: bool) {
    if template_supports_it || !messages.iter().any(|m| m.role == "developer") {
        return;
    }
    for m in messages.iter_mut().filter(|m| m.role == "developer") {
        m.role = "system".to_owned();
        m.tools = None;
    }
    let mut needs = false;
    let mut seen_content = false;
    for (i, m) in messages.iter().enumerate() {
        if m.role == "system" {
            if i > 0 || seen_content {
                needs = true;
            }
            seen_content |= !m.content.is_empty();
        }
    }
    if !needs {
        return;
    }
    let contents: Vec<&str> = messages
        .iter()
        .filter(|m| m.role == "system" && !m.content.is_empty())
        .map(|m| m.content.as_str())
        .collect();
    let merged = Message::text("system", contents.join("\n\n"));
    messages.retain(|m| m.role != "system");
    messages.insert(0, merged);
}

/// Whether the template iterates over a message's content (vLLM's `_detect_content_format`
/// in `vllm/renderers/hf.py` then renders content as a list of parts, the "openai" format).
/// vLLM walks the template's AST; this is a conservative textual check (any `for ... in`
/// whose iterable mentions `content`), so a template it flags is routed on load rather than
/// rendered differently from the engine.
pub fn reads_content_parts(source: &str) -> bool {
    let mut rest = source;
    while let Some(at) = rest.find("for ") {
        let after = &rest[at + 4..];
        let end = after
            .find("%}")
            .unwrap_or(after.len())
            .min(after.find('\n').unwrap_or(after.len()));
        let clause = &after[..end];
        if let Some((_, iterable)) = clause.split_once(" in ")
            && iterable.contains("content")
        {
            return true;
        }
        rest = after;
    }
    false
}

#[cfg(test)]
mod tests {
    use super::*;

    fn json(s: &str) -> Json {
        serde_json::from_str(s).unwrap()
    }

    #[test]
    fn tools_are_dumped_in_vllm_order() {
        let tools = json(
            r#"[{"function":{"parameters":{"b":1,"a":2},"name":"f","extra":1},"type":"function","x":2},
                {"type":"function","defer_loading":true,"function":{"name":"g","strict":false,"description":"d"}}]"#,
        );
        let out = serde_json::to_string(&dump_tools(tools).unwrap().unwrap()).unwrap();
        assert_eq!(
            out,
            r#"[{"type":"function","function":{"name":"f","description":null,"parameters":{"b":1,"a":2}}},{"type":"function","function":{"name":"g","description":"d","parameters":null,"strict":false,"defer_loading":true},"defer_loading":true}]"#
        );
        for bad in [
            r#"{}"#,
            r#"[1]"#,
            r#"[{"type":"x","function":{"name":"f"}}]"#,
            r#"[{"function":{}}]"#,
        ] {
            assert!(dump_tools(json(bad)).is_err(), "{bad}");
        }
        assert!(matches!(
            dump_tools(json(r#"[{"function":{"name":"f","strict":"true"}}]"#)),
            Err(TokenizeError::Inexact { .. })
        ));
    }

    #[test]
    fn request_fields_override_kwargs() {
        let args = template_args(RequestArgs {
            add_generation_prompt: true,
            reasoning_effort: Some("low".into()),
            user_kwargs: Some(
                serde_json::from_str(
                    r#"{"add_generation_prompt":false,"x":"auto","y":null,"padding":true,"z":1}"#,
                )
                .unwrap(),
            ),
            ..RequestArgs::default()
        })
        .unwrap();
        assert!(args.add_generation_prompt);
        let keys: Vec<&str> = args.kwargs.keys().map(String::as_str).collect();
        assert_eq!(keys, ["z", "reasoning_effort", "enable_thinking"]);
        assert_eq!(args.kwargs["enable_thinking"], Json::Bool(true));
        let kept = template_args(RequestArgs {
            reasoning_effort: Some("none".into()),
            user_kwargs: Some(serde_json::from_str(r#"{"enable_thinking":null}"#).unwrap()),
            ..RequestArgs::default()
        })
        .unwrap();
        assert!(!kept.kwargs.contains_key("enable_thinking"));
        assert!(
            template_args(RequestArgs {
                user_kwargs: Some(serde_json::from_str(r#"{"chat_template":"x"}"#).unwrap()),
                ..RequestArgs::default()
            })
            .is_err()
        );
    }

    #[test]
    fn content_part_loops_are_detected() {
        assert!(reads_content_parts(
            "{% for m in messages %}{% for c in m['content'] %}{% endfor %}{% endfor %}"
        ));
        assert!(!reads_content_parts(
            "{% for m in messages %}{{ m.content }}{% endfor %}"
        ));
    }
}
