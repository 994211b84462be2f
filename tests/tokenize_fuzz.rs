//! No request body makes the tokenizer layer panic: arbitrary bytes, and arbitrary JSON built
//! from the field names chat, completions and responses bodies use (so the generator reaches
//! deep into message, part, tool and kwargs handling), through every endpoint and several chat
//! templates. Every outcome is tokens or a typed client error (a 400, or routed on load when
//! unrenderable).

use std::path::PathBuf;
use std::sync::OnceLock;

use proptest::prelude::*;
use serde_json::{Map, Value};

use kv_epp_tokenize::{Endpoint, ModelTokenizer, TokenizerFiles, parse_request};

fn tokenizers() -> &'static Vec<ModelTokenizer> {
    static TOKENIZERS: OnceLock<Vec<ModelTokenizer>> = OnceLock::new();
    TOKENIZERS.get_or_init(|| {
        let fixtures = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tokenizer");
        [
            "chatml",
            "llama3",
            "tools-thinking",
            "kwargs-probe",
            "openai-content",
        ]
        .iter()
        .map(|t| {
            let mut files = TokenizerFiles::in_dir(fixtures.join("small-bpe"));
            files.chat_template = Some(fixtures.join("templates").join(format!("{t}.jinja")));
            let mut tok = ModelTokenizer::load(&files).unwrap();
            tok.set_template_var("date_string", "2025-01-01");
            tok
        })
        .collect()
    })
}

const KEYS: &[&str] = &[
    "model",
    "messages",
    "role",
    "content",
    "type",
    "text",
    "name",
    "tools",
    "function",
    "parameters",
    "description",
    "strict",
    "defer_loading",
    "tool_calls",
    "arguments",
    "id",
    "tool_call_id",
    "reasoning",
    "reasoning_content",
    "chat_template_kwargs",
    "reasoning_effort",
    "enable_thinking",
    "add_generation_prompt",
    "continue_final_message",
    "documents",
    "chat_template",
    "tokenize",
    "input",
    "instructions",
    "effort",
    "status",
    "prompt",
    "image_url",
    "uuid",
    "refusal",
    "thinking",
    "task",
    "add_special_tokens",
    "previous_response_id",
    "max_length",
    "padding",
    "sanitize_control_tokens",
];
const STRINGS: &[&str] = &[
    "m",
    "user",
    "system",
    "developer",
    "assistant",
    "tool",
    "function",
    "text",
    "input_text",
    "output_text",
    "refusal",
    "thinking",
    "image_url",
    "tool_reference",
    "message",
    "auto",
    "none",
    "high",
    "in_progress",
    "incomplete",
    "function_call",
    "{\"a\": 1}",
    "[1]",
    "",
    "x-anthropic-billing-header: x\ny",
    "<|im_start|>",
    "{{ raise_exception('x') }}",
];

fn leaf() -> impl Strategy<Value = Value> {
    prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        any::<i64>().prop_map(Value::from),
        (0u64..4).prop_map(Value::from),
        any::<f64>()
            .prop_map(|f| serde_json::Number::from_f64(f).map_or(Value::Null, Value::Number)),
        prop::sample::select(STRINGS).prop_map(|s| Value::String(s.to_owned())),
        ".{0,12}".prop_map(Value::String),
    ]
}

fn json() -> impl Strategy<Value = Value> {
    leaf().prop_recursive(5, 64, 6, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..5).prop_map(Value::Array),
            prop::collection::vec((prop::sample::select(KEYS), inner), 0..6).prop_map(|kv| {
                Value::Object(
                    kv.into_iter()
                        .map(|(k, v)| (k.to_owned(), v))
                        .collect::<Map<String, Value>>(),
                )
            }),
        ]
    })
}

/// A message: a role, then arbitrary members (content parts, tool calls, ...).
fn message() -> impl Strategy<Value = Value> {
    (
        prop::sample::select(&["user", "system", "developer", "assistant", "tool", "x"][..]),
        prop::collection::vec((prop::sample::select(KEYS), json()), 0..4),
    )
        .prop_map(|(role, kv)| {
            let mut m: Map<String, Value> =
                kv.into_iter().map(|(k, v)| (k.to_owned(), v)).collect();
            m.insert("role".into(), Value::String(role.into()));
            Value::Object(m)
        })
}

/// A body that is mostly well formed: a model, messages and input items, then arbitrary
/// members (which may replace them).
fn body() -> impl Strategy<Value = Value> {
    (
        prop::collection::vec(message(), 1..4),
        prop::collection::vec(message(), 0..3),
        prop::collection::vec((prop::sample::select(KEYS), json()), 0..5),
    )
        .prop_map(|(messages, input, kv)| {
            let mut m = Map::new();
            m.insert("model".into(), Value::String("m".into()));
            m.insert("messages".into(), Value::Array(messages));
            m.insert("input".into(), Value::Array(input));
            for (k, v) in kv {
                m.insert(k.to_owned(), v);
            }
            Value::Object(m)
        })
}

fn exercise(bytes: &[u8]) {
    for endpoint in [
        Endpoint::ChatCompletions,
        Endpoint::Completions,
        Endpoint::Responses,
    ] {
        let Ok(parsed) = parse_request(endpoint, bytes) else {
            continue;
        };
        for tok in tokenizers() {
            if let Err(e) = tok.tokenize(&parsed.prompt) {
                assert!(e.is_client_error() || e.unrenderable().is_none(), "{e}");
                let _ = e.to_string();
            }
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn no_json_body_panics(body in body()) {
        exercise(body.to_string().as_bytes());
    }

    #[test]
    fn no_byte_string_panics(bytes in prop::collection::vec(any::<u8>(), 0..256)) {
        exercise(&bytes);
    }
}
