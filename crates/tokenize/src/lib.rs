//! Request understanding, part two: an OpenAI request body → the prompt token ids the engine
//! will compute.
//!
//! The router can only match what the engine cached if it computes the same token ids as vLLM,
//! which renders chat templates and encodes with Hugging Face transformers. This module
//! reproduces that pipeline, checked case by case against transformers in
//! `tests/tokenize_fixtures.rs`:
//!
//! ```text
//! body ─▶ request (parse, defaults) ─▶ messages (normalise) ─▶ template (render) ─▶ model (encode)
//!                                      catalog: model name ─▶ tokenizer + LoRA adapter name
//! ```
//!
//! - [`catalog`]: the entry point, [`ModelCatalog::tokenize`].
//! - [`request`]: OpenAI bodies and their defaults (`responses`: `/v1/responses` bodies);
//!   [`messages`]: what the template sees; [`vllm`]: what vLLM's server changes before rendering.
//! - [`model`]: loading `tokenizer.json` / `tokenizer_config.json` once; encoding; rendering.
//! - `bpe`, `pretok`: our own byte-level BPE encoder (ids only, bounded memory) for the
//!   configurations it reproduces exactly (GPT-2, Llama 3, Qwen 2, DeepSeek V3 split regexes);
//!   the `tokenizers` crate encodes the rest.
//! - `template`, `pystr`, `pyjson`, `strftime`: Jinja2-under-Python semantics on minijinja.
//! - [`json`]: an order-preserving JSON tree for tools and tool calls.
//! - `cuts`: where a prompt can be cut with encode(a + b) == encode(a) ++ encode(b), proved
//!   from the tokenizer's configuration; `segments`: exact reuse of the ids of segments seen
//!   before, and early stops; `floor`: a token lower bound from the text's length.
//!
//! Invariant: nothing here depends on a clock except `strftime_now`, and nothing does I/O after
//! [`ModelTokenizer::load`].

mod bpe;
pub mod catalog;
mod cuts;
pub mod error;
mod floor;
pub mod json;
pub mod messages;
pub mod model;
mod pretok;
pub mod pyjson;
pub mod pystr;
pub mod request;
mod responses;
mod segments;
mod strftime;
mod template;
pub mod vllm;

pub use catalog::{CatalogConfig, LoraAdapter, ModelCatalog, ModelSpec, TokenizedRequest};
pub use error::{LoadError, TokenizeError, Unrenderable};
pub use model::{ModelTokenizer, TokenizerFiles};
pub use request::{ChatPrompt, Endpoint, ParsedRequest, Prompt, parse_request};
