//! One model's tokenizer: `tokenizer.json` + `tokenizer_config.json` (+ an optional chat template
//! override), loaded once at start, then used read-only by every request.
//!
//! Encoding is the `tokenizers` crate's pipeline, the same code transformers' fast tokenizers
//! run: added tokens split out first, then normalizer, pre-tokenizer, BPE, and the
//! post-processor only when `add_special_tokens` is set. Truncation and padding configured in
//! `tokenizer.json` are switched off: the engine sees the whole prompt, so must we.
//! A `tokenizer_config.json` flag such as `add_bos_token` is NOT applied on top of the
//! post-processor (transformers 5 builds the post-processor into `tokenizer.json`).

use std::fs;
use std::path::{Path, PathBuf};

use indexmap::IndexMap;
use minijinja::Value;
use serde_json::Value as JsonValue;
use tokenizers::Tokenizer;

use super::bpe::{FastBpe, NotHandled};
use super::error::{LoadError, TokenizeError, Unrenderable};
use super::floor::TokenFloor;
use super::json::Json;
use super::request::{ChatPrompt, Prompt};
use super::segments::{Encoded, SegmentCache};
use super::template::{CONTINUE_TAG, ChatTemplate, RenderError, cut_at_continue_tag};
use super::vllm::{developer_as_system, filter_template_kwargs};

/// Default budget of the segment cache, in tokens (about 16 MiB of ids).
pub const DEFAULT_SEGMENT_CACHE_TOKENS: usize = 4 << 20;

/// The longest pre-tokenizer word (a piece of text with no split point) kv-epp encodes, in
/// bytes, by default ([`ModelTokenizer::set_max_word_bytes`]; the `max_word_bytes` setting of a
/// model's tokenizer). BPE merges a word as a whole, with working memory proportional to its length (~20
/// bytes per byte of the word in our encoder, more in the `tokenizers` crate) and no exact way to
/// cut it, so a longer word makes the request unrenderable ([`TokenizeError::WordTooLong`], reason
/// `long_word`: routed on load alone, or refused under `routing.unrenderable: reject`), found
/// before that memory is allocated. Natural text stays far below: prose and code words are
/// tens of bytes; base64, hex and URLs are cut at every digit or punctuation run by the
/// GPT-2-style regexes; a CJK paragraph without punctuation is a few KiB; a whitespace run of
/// indentation or padding a few hundred bytes; the longest protein sequence (titin, ~34,000
/// residues) pasted on one line is 34 KB. At the limit a word's working memory is ~1.2-2 MiB.
pub const MAX_WORD_BYTES: usize = 64 << 10;

/// The longest run of whitespace or of non-whitespace characters in `text`, in bytes: an upper
/// bound on the words of a pre-tokenizer that splits at least where whitespace starts or ends
/// (what the `tokenizers` crate's `Whitespace`, `WhitespaceSplit`, `Metaspace`, `ByteLevel`
/// and GPT-2-style `Split` regexes all do).
fn longest_run(text: &str) -> usize {
    let mut longest = 0;
    let mut start = 0;
    let mut space = None;
    for (i, c) in text.char_indices() {
        let is_space = c.is_whitespace();
        if space != Some(is_space) {
            longest = longest.max(i - start);
            start = i;
            space = Some(is_space);
        }
    }
    longest.max(text.len() - start)
}

/// The special-token attributes transformers 5 passes to every template render, in order.
const SPECIAL_TOKEN_ATTRIBUTES: [&str; 7] = [
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
];

/// Where a model's tokenizer files are.
#[derive(Clone, Debug, PartialEq, Eq, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TokenizerFiles {
    /// `tokenizer.json` (Hugging Face fast-tokenizer format).
    pub tokenizer_json: PathBuf,
    /// `tokenizer_config.json`: special tokens and, usually, the chat template.
    #[serde(default)]
    pub tokenizer_config: Option<PathBuf>,
    /// A chat template file that replaces the config's (like vLLM's `--chat-template`).
    #[serde(default)]
    pub chat_template: Option<PathBuf>,
}

impl TokenizerFiles {
    /// The files of a Hugging Face model directory: `tokenizer.json`, `tokenizer_config.json`
    /// when present, and `chat_template.jinja` when present (transformers prefers it to the
    /// config's `chat_template`).
    pub fn in_dir(dir: impl AsRef<Path>) -> TokenizerFiles {
        let dir = dir.as_ref();
        let config = dir.join("tokenizer_config.json");
        let template = dir.join("chat_template.jinja");
        TokenizerFiles {
            tokenizer_json: dir.join("tokenizer.json"),
            tokenizer_config: config.is_file().then_some(config),
            chat_template: template.is_file().then_some(template),
        }
    }
}

/// A loaded tokenizer and chat template. Immutable after [`ModelTokenizer::load`] (plus
/// [`ModelTokenizer::set_template_var`] at start); share it behind an `Arc`.
pub struct ModelTokenizer {
    tokenizer: Tokenizer,
    template: Option<ChatTemplate>,
    /// The config's `tool_use` named template, for requests with tools.
    tool_use_template: Option<ChatTemplate>,
    /// Special tokens, then server-side variables: every render sees these.
    globals: Vec<(String, String)>,
    vocab_size: usize,
    segments: SegmentCache,
    floor: TokenFloor,
    /// What the post-processor puts around a single sequence, when it only adds fixed tokens
    /// (then the segment cache serves `add_special_tokens` too).
    specials: Option<(Vec<u32>, Vec<u32>)>,
    /// Our own encoder (`bpe.rs`), for the byte-level BPE configurations it reproduces exactly;
    /// `None`: the `tokenizers` crate encodes everything.
    fast: Option<FastBpe>,
    /// The longest word encoded ([`MAX_WORD_BYTES`] by default).
    max_word_bytes: usize,
}

impl std::fmt::Debug for ModelTokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ModelTokenizer")
            .field("vocab_size", &self.vocab_size)
            .field("has_chat_template", &self.template.is_some())
            .field("has_tool_use_template", &self.tool_use_template.is_some())
            .field("own_encoder", &self.fast.is_some())
            .finish_non_exhaustive()
    }
}

fn read(path: &Path) -> Result<String, LoadError> {
    fs::read_to_string(path).map_err(|source| LoadError::Read {
        path: path.to_owned(),
        source,
    })
}

/// A special token in `tokenizer_config.json`: a string or an `AddedToken` object.
fn token_text(value: &JsonValue) -> Option<&str> {
    match value {
        JsonValue::String(s) => Some(s),
        JsonValue::Object(o) => o.get("content").and_then(JsonValue::as_str),
        _ => None,
    }
}

/// The config's `chat_template`: a string, or a list of `{name, template}` from which
/// transformers uses `tool_use` for requests with tools and `default` otherwise.
/// Returns (default, tool_use).
fn config_templates(
    config: &JsonValue,
    path: &Path,
) -> Result<(Option<String>, Option<String>), LoadError> {
    let field_err = |reason: &str| LoadError::Field {
        path: path.to_owned(),
        field: "chat_template",
        reason: reason.to_owned(),
    };
    match config.get("chat_template") {
        None | Some(JsonValue::Null) => Ok((None, None)),
        Some(JsonValue::String(s)) => Ok((Some(s.clone()), None)),
        Some(JsonValue::Array(named)) => {
            let mut found = (None, None);
            for entry in named {
                let name = entry.get("name").and_then(JsonValue::as_str);
                let template = entry.get("template").and_then(JsonValue::as_str);
                match (name, template) {
                    (Some("default"), Some(t)) => found.0 = Some(t.to_owned()),
                    (Some("tool_use"), Some(t)) => found.1 = Some(t.to_owned()),
                    (Some(_), Some(_)) => {}
                    _ => return Err(field_err("each named template needs `name` and `template`")),
                }
            }
            if found.0.is_none() && found.1.is_none() {
                return Err(field_err("no `default` or `tool_use` template"));
            }
            Ok(found)
        }
        Some(_) => Err(field_err("expected a string or a list of named templates")),
    }
}

impl ModelTokenizer {
    /// Loads and checks the files; compiles the chat template. Run once at start.
    ///
    /// Errors name the file (and field) at fault: unreadable file, invalid JSON, a
    /// `tokenizer.json` the `tokenizers` crate rejects, a special token of the wrong type, a chat
    /// template that does not compile.
    pub fn load(files: &TokenizerFiles) -> Result<ModelTokenizer, LoadError> {
        let path = &files.tokenizer_json;
        let mut tokenizer: Tokenizer =
            read(path)?
                .parse()
                .map_err(
                    |e: Box<dyn std::error::Error + Send + Sync>| LoadError::Tokenizer {
                        path: path.clone(),
                        reason: e.to_string(),
                    },
                )?;
        tokenizer
            .with_truncation(None)
            .map_err(|e| LoadError::Tokenizer {
                path: path.clone(),
                reason: e.to_string(),
            })?;
        tokenizer.with_padding(None);
        let vocab_size = tokenizer.get_vocab_size(true);

        let mut globals = Vec::new();
        let mut sources = (None, None);
        let mut template_path = PathBuf::new();
        if let Some(config_path) = &files.tokenizer_config {
            let config: JsonValue =
                serde_json::from_str(&read(config_path)?).map_err(|source| LoadError::Json {
                    path: config_path.clone(),
                    source,
                })?;
            for attr in SPECIAL_TOKEN_ATTRIBUTES {
                match config.get(attr) {
                    None | Some(JsonValue::Null) => {}
                    Some(v) => {
                        let text = token_text(v).ok_or_else(|| LoadError::Field {
                            path: config_path.clone(),
                            field: attr,
                            reason: "expected a string or an AddedToken object".to_owned(),
                        })?;
                        globals.push((attr.to_owned(), text.to_owned()));
                    }
                }
            }
            sources = config_templates(&config, config_path)?;
            template_path = config_path.clone();
        }
        if let Some(override_path) = &files.chat_template {
            // Like vLLM's --chat-template: one template for every request.
            sources = (Some(read(override_path)?), None);
            template_path = override_path.clone();
        }
        let compile = |source: Option<String>| {
            source
                .map(|s| {
                    ChatTemplate::compile(s).map_err(|e| LoadError::Template {
                        path: template_path.clone(),
                        reason: e.to_string(),
                    })
                })
                .transpose()
        };
        let template = compile(sources.0)?;
        let tool_use_template = compile(sources.1)?;
        let segments = SegmentCache::new(&tokenizer, DEFAULT_SEGMENT_CACHE_TOKENS);
        let json = serde_json::to_value(&tokenizer).unwrap_or(JsonValue::Null);
        let floor = TokenFloor::of(&tokenizer, &json);
        let specials = fixed_specials(&tokenizer);
        let fast = FastBpe::new(&tokenizer, &json);
        drop(json);
        Ok(ModelTokenizer {
            tokenizer,
            template,
            tool_use_template,
            globals,
            vocab_size,
            segments,
            floor,
            specials,
            fast,
            max_word_bytes: MAX_WORD_BYTES,
        })
    }

    /// Sets the longest pre-tokenizer word encoded, in bytes (at least 1); a text with a longer
    /// one is [`TokenizeError::WordTooLong`]. Call at start, before sharing.
    pub fn set_max_word_bytes(&mut self, bytes: usize) {
        let bytes = bytes.max(1);
        self.max_word_bytes = bytes;
        if let Some(fast) = &mut self.fast {
            fast.set_max_word(bytes);
        }
    }

    /// Sets the segment cache budget in tokens (0 turns the cache off). Call at start, before
    /// sharing; drops what was cached.
    pub fn set_segment_cache_capacity(&mut self, tokens: usize) {
        self.segments = SegmentCache::new(&self.tokenizer, tokens);
    }

    /// Forgets every cached segment (benchmarks and tests use it to measure cold requests).
    pub fn clear_segment_cache(&self) {
        self.segments.clear();
    }

    /// Defines a server-side template variable (e.g. `date_string`) for every render; a
    /// request's `chat_template_kwargs` still override it. Call at start, before sharing.
    pub fn set_template_var(&mut self, name: impl Into<String>, value: impl Into<String>) {
        let name = name.into();
        let value = value.into();
        match self.globals.iter_mut().find(|(k, _)| *k == name) {
            Some(slot) => slot.1 = value,
            None => self.globals.push((name, value)),
        }
    }

    /// The variables every render sees besides the request's: the special tokens of the config
    /// (`bos_token`, `eos_token`, ... as strings), then those set by
    /// [`ModelTokenizer::set_template_var`].
    pub fn template_globals(&self) -> &[(String, String)] {
        &self.globals
    }

    /// Vocabulary size including added tokens.
    pub fn vocab_size(&self) -> usize {
        self.vocab_size
    }

    /// Whether chat requests (without tools) can be rendered.
    pub fn has_chat_template(&self) -> bool {
        self.template.is_some()
    }

    /// Token ids of a prompt, exactly as the engine computes them.
    pub fn tokenize(&self, prompt: &Prompt) -> Result<Vec<u32>, TokenizeError> {
        self.tokenize_within(prompt, None)
    }

    /// [`ModelTokenizer::tokenize`], refusing a prompt of more than `max_tokens` tokens with
    /// [`TokenizeError::PromptTooLong`] before it is encoded whole: first from the text's
    /// length when that alone proves it too long, then by stopping the segment-by-segment
    /// encoding once the count passes the limit.
    pub fn tokenize_within(
        &self,
        prompt: &Prompt,
        max_tokens: Option<usize>,
    ) -> Result<Vec<u32>, TokenizeError> {
        let ids = match prompt {
            Prompt::Chat(chat) => {
                let text = self.render_chat(chat)?;
                self.encode_within(&text, chat.add_special_tokens, max_tokens)?
            }
            Prompt::Text {
                text,
                add_special_tokens,
            } => self.encode_within(text, *add_special_tokens, max_tokens)?,
            Prompt::TokenIds(ids) => self.check_ids(ids)?.to_vec(),
        };
        within(ids, max_tokens)
    }

    /// [`ModelTokenizer::tokenize_within`] taking the prompt: a chat's messages are dropped
    /// once rendered, before encoding, so they and the ids are never held at once.
    pub fn tokenize_owned(
        &self,
        prompt: Prompt,
        max_tokens: Option<usize>,
    ) -> Result<Vec<u32>, TokenizeError> {
        let ids = match prompt {
            Prompt::Chat(chat) => {
                let text = self.render_chat(&chat)?;
                let add_special_tokens = chat.add_special_tokens;
                drop(chat);
                self.encode_within(&text, add_special_tokens, max_tokens)?
            }
            Prompt::Text {
                text,
                add_special_tokens,
            } => self.encode_within(&text, add_special_tokens, max_tokens)?,
            Prompt::TokenIds(ids) => {
                self.check_ids(&ids)?;
                ids
            }
        };
        within(ids, max_tokens)
    }

    fn check_ids<'a>(&self, ids: &'a [u32]) -> Result<&'a [u32], TokenizeError> {
        match ids.iter().find(|&&id| id as usize >= self.vocab_size) {
            Some(&id) => Err(TokenizeError::TokenOutOfVocabulary {
                id,
                vocab_size: self.vocab_size,
            }),
            None => Ok(ids),
        }
    }

    /// A lower bound on the tokens of `text` from its length alone (0 when no sound bound is
    /// known for this tokenizer). One pass over the bytes.
    pub fn min_tokens(&self, text: &str) -> usize {
        self.floor.min_tokens(text)
    }

    /// Whether prompts are also cut in plain text (between words), so a next chat turn reuses
    /// the history's ids whatever the template's markers are; otherwise only at added tokens.
    pub fn cuts_plain_text(&self) -> bool {
        self.segments.cuts_plain_text()
    }

    /// Encodes text. Special tokens written in the text (e.g. `<|im_start|>` typed by a user)
    /// become their ids, as in transformers; `add_special_tokens` runs the post-processor.
    ///
    /// Segments of the text seen before (see `segments.rs`) are taken from the cache, so a
    /// conversation's next turn only encodes what is new.
    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>, TokenizeError> {
        self.encode_within(text, add_special_tokens, None)
    }

    fn encode_within(
        &self,
        text: &str,
        add_special_tokens: bool,
        max_tokens: Option<usize>,
    ) -> Result<Vec<u32>, TokenizeError> {
        let limit = max_tokens.unwrap_or(usize::MAX);
        let too_long = |at_least: usize| TokenizeError::PromptTooLong {
            at_least,
            max: limit,
        };
        // The post-processor only adds tokens: the bound and the early stop hold without it.
        let floor = self.floor.min_tokens(text);
        if floor > limit {
            return Err(too_long(floor));
        }
        let (prefix, suffix): (&[u32], &[u32]) = match (&self.specials, add_special_tokens) {
            (_, false) => (&[], &[]),
            (Some((p, s)), true) => (p, s),
            (None, true) => return self.encode_uncached(text, true, usize::MAX),
        };
        let inner = limit.saturating_sub(prefix.len() + suffix.len());
        match self.segments.encode(text, inner, |segment, budget, out| {
            self.encode_into(segment, false, budget, out)
        })? {
            Encoded::OverLimit(n) => Err(too_long(n + prefix.len() + suffix.len())),
            Encoded::Ids(ids) if prefix.is_empty() && suffix.is_empty() => Ok(ids),
            Encoded::Ids(ids) => {
                let mut out = Vec::with_capacity(prefix.len() + ids.len() + suffix.len());
                out.extend_from_slice(prefix);
                out.extend_from_slice(&ids);
                out.extend_from_slice(suffix);
                Ok(out)
            }
        }
    }

    /// Encodes `text` without the post-processor in pieces cut at every point `cuts.rs` allows,
    /// bypassing the cache. Conformance tests compare it with transformers' ids: a cut rule that
    /// were not exact would show there.
    pub fn encode_at_every_cut(&self, text: &str) -> Result<Vec<u32>, TokenizeError> {
        self.segments
            .encode_every_cut(text, |piece| self.encode_uncached(piece, false, usize::MAX))
    }

    /// Encodes `text` in one call of the tokenizer, no cut, no cache: the reference the other
    /// paths must equal (tests and benchmarks).
    pub fn encode_whole(
        &self,
        text: &str,
        add_special_tokens: bool,
    ) -> Result<Vec<u32>, TokenizeError> {
        self.encode_uncached(text, add_special_tokens, usize::MAX)
    }

    /// Whether texts are encoded by kv-epp's own byte-level BPE encoder (`bpe.rs`) rather than
    /// the `tokenizers` crate (which then encodes only texts the former leaves to it).
    pub fn uses_own_encoder(&self) -> bool {
        self.fast.is_some()
    }

    /// Encodes `text` in one call of the `tokenizers` crate, whatever the tokenizer: what tests
    /// compare kv-epp's own encoder with.
    pub fn encode_with_tokenizers_crate(
        &self,
        text: &str,
        add_special_tokens: bool,
    ) -> Result<Vec<u32>, TokenizeError> {
        let encoding = self
            .tokenizer
            .encode_fast(text, add_special_tokens)
            .map_err(|e| TokenizeError::Encode(e.to_string()))?;
        Ok(encoding.get_ids().to_vec())
    }

    /// Ids of `text`; our own encoder stops once more than `limit` ids are known (the result
    /// then holds more than `limit`, not all of them).
    fn encode_uncached(
        &self,
        text: &str,
        add_special_tokens: bool,
        limit: usize,
    ) -> Result<Vec<u32>, TokenizeError> {
        let mut ids = Vec::new();
        self.encode_into(text, add_special_tokens, limit, &mut ids)?;
        Ok(ids)
    }

    /// [`ModelTokenizer::encode_uncached`], appending to `out`.
    fn encode_into(
        &self,
        text: &str,
        add_special_tokens: bool,
        limit: usize,
        out: &mut Vec<u32>,
    ) -> Result<(), TokenizeError> {
        let too_long = |bytes: usize| TokenizeError::WordTooLong {
            bytes,
            max: self.max_word_bytes,
        };
        if let (Some(fast), false) = (&self.fast, add_special_tokens) {
            // About a token per 4 bytes of prose: one allocation for most texts.
            out.reserve(text.len() / 4 + 1);
            let start = out.len();
            match fast.encode(text, out, limit.saturating_add(start)) {
                Ok(()) => return Ok(()),
                Err(NotHandled::LongWord(bytes)) => {
                    out.truncate(start);
                    return Err(too_long(bytes));
                }
                Err(NotHandled::Normalizer) => {}
            }
        }
        // The crate merges each word whole too: no word over the limit goes to it. Its words
        // are ours when our encoder recognises the configuration (measured before NFC, which
        // changes a length by a few bytes at most); otherwise bounded by the whitespace runs,
        // unless the tokenizer has no pre-tokenizer at all (then its "word" is the whole text,
        // and nothing can be said of its working memory from the text).
        let longest = match &self.fast {
            Some(fast) => fast.longest_word(text),
            None if self.tokenizer.get_pre_tokenizer().is_some() => longest_run(text),
            None => 0,
        };
        if longest > self.max_word_bytes {
            return Err(too_long(longest));
        }
        let encoding = self
            .tokenizer
            .encode_fast(text, add_special_tokens)
            .map_err(|e| TokenizeError::Encode(e.to_string()))?;
        out.extend_from_slice(encoding.get_ids());
        Ok(())
    }

    /// Renders a conversation with the chat template, as vLLM's `safe_apply_chat_template`
    /// (`vllm/renderers/hf.py`) renders it through transformers' `apply_chat_template` (with
    /// `tokenize=False`). A config with named templates uses `tool_use` for requests with
    /// tools, `default` otherwise.
    ///
    /// Before rendering, as vLLM: `developer` messages become `system` for a template that does
    /// not name the role (`vllm::developer_as_system`), and the request's template kwargs are
    /// filtered to the variables the template reads (`resolve_chat_template_kwargs`).
    /// Template variables, later ones overriding earlier ones: `messages`, `tools` (always
    /// defined, `none` when absent), `documents` (likewise), `add_generation_prompt`, the special
    /// tokens and server-side variables ([`ModelTokenizer::template_globals`]), then the
    /// filtered kwargs.
    ///
    /// Errors: a template that iterates over message content is
    /// [`Unrenderable::ContentFormat`] (vLLM would pass content as a list of parts).
    pub fn render_chat(&self, chat: &ChatPrompt) -> Result<String, TokenizeError> {
        let args = &chat.args;
        let named_tool_use = self
            .tool_use_template
            .as_ref()
            .filter(|_| args.tools.is_some());
        let template = named_tool_use
            .or(self.template.as_ref())
            .ok_or(TokenizeError::NoChatTemplate)?;
        if template.reads_content_parts() {
            return Err(TokenizeError::Inexact {
                reason: Unrenderable::ContentFormat,
                detail: "the chat template iterates over message content parts",
            });
        }
        let converted;
        let messages = if template.supports_developer()
            || !chat.messages.iter().any(|m| m.role == "developer")
        {
            &chat.messages
        } else {
            let mut copy = chat.messages.clone();
            developer_as_system(&mut copy, false);
            converted = copy;
            &converted
        };
        let Some(last) = messages.last() else {
            return Err(TokenizeError::EmptyMessages);
        };
        let suffix = if args.continue_final_message {
            if args.add_generation_prompt {
                return Err(TokenizeError::IncompatibleOptions(
                    "continue_final_message and add_generation_prompt cannot both be set",
                ));
            }
            if !template.mentions_content() {
                return Err(TokenizeError::ContinueFinalMessage(
                    "the chat template never reads `content`",
                ));
            }
            CONTINUE_TAG
        } else {
            ""
        };
        let count = messages.len();
        let messages: Vec<Value> = messages
            .iter()
            .enumerate()
            .map(|(i, m)| m.to_value(if i + 1 == count { suffix } else { "" }))
            .collect();

        let mut vars: IndexMap<Value, Value> =
            IndexMap::with_capacity(4 + self.globals.len() + args.kwargs.len());
        vars.insert(Value::from("messages"), Value::from(messages));
        vars.insert(
            Value::from("tools"),
            args.tools.clone().map_or(Value::from(()), Json::into_value),
        );
        vars.insert(
            Value::from("documents"),
            args.documents
                .clone()
                .map_or(Value::from(()), Json::into_value),
        );
        vars.insert(
            Value::from("add_generation_prompt"),
            Value::from(args.add_generation_prompt),
        );
        for (name, value) in &self.globals {
            vars.insert(Value::from(name.as_str()), Value::from(value.as_str()));
        }
        for (name, value) in filter_template_kwargs(&args.kwargs, template.variables()) {
            vars.insert(Value::from(name.as_str()), value.clone().into_value());
        }

        let mut rendered = template.render(Value::from(vars)).map_err(|e| match e {
            RenderError::Raised(m) => TokenizeError::TemplateRejected(m),
            RenderError::Failed(m) => TokenizeError::TemplateFailed(m),
        })?;
        // The renderer's buffer grew by doubling; the text lives through the whole encode.
        rendered.shrink_to_fit();
        if args.continue_final_message {
            cut_at_continue_tag(&rendered, &last.content).ok_or(
                TokenizeError::ContinueFinalMessage(
                    "the final message does not appear in the rendered prompt",
                ),
            )
        } else {
            Ok(rendered)
        }
    }
}

/// `ids`, or [`TokenizeError::PromptTooLong`] when there are more than `max_tokens`.
fn within(ids: Vec<u32>, max_tokens: Option<usize>) -> Result<Vec<u32>, TokenizeError> {
    match max_tokens {
        Some(max) if ids.len() > max => Err(TokenizeError::PromptTooLong {
            at_least: ids.len(),
            max,
        }),
        _ => Ok(ids),
    }
}

/// The ids a post-processor puts before and after a single sequence, when it is made only of
/// processors that add fixed special tokens whatever the ids are (`TemplateProcessing`,
/// `BertProcessing`, `RobertaProcessing`, `ByteLevel`, sequences of them); found by processing a
/// one-token sequence. `None` otherwise (the caller then encodes such texts whole).
fn fixed_specials(tokenizer: &Tokenizer) -> Option<(Vec<u32>, Vec<u32>)> {
    fn fixed(p: &JsonValue) -> bool {
        match p.get("type").and_then(JsonValue::as_str) {
            Some("TemplateProcessing" | "BertProcessing" | "RobertaProcessing" | "ByteLevel") => {
                true
            }
            Some("Sequence") => p["processors"]
                .as_array()
                .is_some_and(|all| all.iter().all(fixed)),
            _ => false,
        }
    }
    let Some(processor) = tokenizer.get_post_processor() else {
        return Some((Vec::new(), Vec::new()));
    };
    if !fixed(&serde_json::to_value(processor).ok()?) {
        return None;
    }
    const PROBE: u32 = u32::MAX;
    let one = tokenizers::Encoding::new(
        vec![PROBE],
        vec![0],
        vec![String::new()],
        vec![None],
        vec![(0, 0)],
        vec![0],
        vec![1],
        Vec::new(),
        Default::default(),
    );
    let ids = tokenizer
        .post_process(one, None, true)
        .ok()?
        .get_ids()
        .to_vec();
    let at = ids.iter().position(|&id| id == PROBE)?;
    (ids.iter().filter(|&&id| id == PROBE).count() == 1)
        .then(|| (ids[..at].to_vec(), ids[at + 1..].to_vec()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::request::{Endpoint, parse_request};

    fn chat(model: &ModelTokenizer, body: &str) -> Result<String, TokenizeError> {
        match parse_request(Endpoint::ChatCompletions, body.as_bytes())?.prompt {
            Prompt::Chat(chat) => model.render_chat(&chat),
            _ => unreachable!(),
        }
    }

    /// A word over [`MAX_WORD_BYTES`] is refused on both paths, ours and the crate's, and one
    /// at the limit is encoded, the same by both.
    #[test]
    fn a_word_over_the_limit_is_not_tokenized() {
        let fixtures = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../../tests/fixtures/tokenizer/small-bpe"
        );
        let ours = ModelTokenizer::load(&TokenizerFiles::in_dir(fixtures)).unwrap();
        assert!(ours.uses_own_encoder());
        let crate_only = ModelTokenizer {
            fast: None,
            ..ModelTokenizer::load(&TokenizerFiles::in_dir(fixtures)).unwrap()
        };
        let over = format!("hello\n{}\nbye", "a".repeat(MAX_WORD_BYTES + 1));
        let spaces = format!("hello{}", " ".repeat(MAX_WORD_BYTES + 2));
        let at = format!("hello\n{}", "b".repeat(MAX_WORD_BYTES));
        for model in [&ours, &crate_only] {
            for text in [&over, &spaces] {
                for special in [false, true] {
                    match model.encode(text, special) {
                        Err(e @ TokenizeError::WordTooLong { bytes, max }) => {
                            assert!(bytes > MAX_WORD_BYTES && max == MAX_WORD_BYTES);
                            assert_eq!(e.unrenderable(), Some(Unrenderable::LongWord));
                            assert!(e.is_client_error());
                        }
                        other => panic!("{:?}", other.map(|ids| ids.len())),
                    }
                }
            }
        }
        let ids = ours.encode(&at, false).unwrap();
        assert_eq!(ids, crate_only.encode(&at, false).unwrap());
        assert_eq!(ids, ours.encode_with_tokenizers_crate(&at, false).unwrap());
        for mut model in [ours, crate_only] {
            // " three" is a word of 6 bytes for our encoder, a run of 5 for the crate's scan.
            model.set_max_word_bytes(6);
            assert!(model.encode("one two three", false).is_ok());
            match model.encode("one two three\nfourteen", false) {
                Err(TokenizeError::WordTooLong { bytes: 8, max: 6 }) => {}
                other => panic!("{other:?}"),
            }
        }
        assert_eq!(longest_run("ab  c\n\n\nd"), 3);
        assert_eq!(longest_run(""), 0);
        assert_eq!(longest_run("東京"), 6);
    }

    #[test]
    fn named_templates_and_load_errors() {
        let fixtures = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../../tests/fixtures/tokenizer/small-bpe"
        );
        let dir = std::env::temp_dir().join(format!("kv-epp-model-test-{}", std::process::id()));
        fs::create_dir_all(&dir).unwrap();
        let config = dir.join("tokenizer_config.json");
        fs::write(
            &config,
            r#"{"bos_token": {"__type": "AddedToken", "content": "<s>"}, "unk_token": null,
                "chat_template": [{"name": "default", "template": "D{{ bos_token }}"},
                                  {"name": "tool_use", "template": "T{{ tools | length }}"}]}"#,
        )
        .unwrap();
        let files = TokenizerFiles {
            tokenizer_json: PathBuf::from(fixtures).join("tokenizer.json"),
            tokenizer_config: Some(config.clone()),
            chat_template: None,
        };
        let model = ModelTokenizer::load(&files).unwrap();
        assert_eq!(
            model.template_globals(),
            [("bos_token".to_owned(), "<s>".to_owned())]
        );
        let plain = r#"{"model":"m","messages":[{"role":"user","content":"x"}]}"#;
        let tools = r#"{"model":"m","messages":[{"role":"user","content":"x"}],"tools":[{"function":{"name":"a"}},{"function":{"name":"b"}}]}"#;
        assert_eq!(chat(&model, plain).unwrap(), "D<s>");
        assert_eq!(chat(&model, tools).unwrap(), "T2");
        let docs = ModelTokenizer {
            template: Some(
                ChatTemplate::compile("{{ documents[0].title }}|{{ tools }}".into()).unwrap(),
            ),
            ..ModelTokenizer::load(&files).unwrap()
        };
        let with_docs = r#"{"model":"m","messages":[{"role":"user"}],"documents":[{"title":"t"}]}"#;
        assert_eq!(chat(&docs, with_docs).unwrap(), "t|None");

        fs::write(&config, r#"{"chat_template": "{% if %}"}"#).unwrap();
        let err = ModelTokenizer::load(&files).unwrap_err().to_string();
        assert!(
            err.contains("tokenizer_config.json") && err.contains("compile"),
            "{err}"
        );
        fs::write(&config, r#"{"eos_token": 3}"#).unwrap();
        let err = ModelTokenizer::load(&files).unwrap_err().to_string();
        assert!(err.contains("`eos_token`"), "{err}");
        fs::write(&config, r#"{"#).unwrap();
        let err = ModelTokenizer::load(&files).unwrap_err().to_string();
        assert!(err.contains("invalid JSON"), "{err}");
        let no_template = ModelTokenizer::load(&TokenizerFiles {
            tokenizer_config: None,
            ..files.clone()
        })
        .unwrap();
        assert!(matches!(
            chat(&no_template, plain),
            Err(TokenizeError::NoChatTemplate)
        ));
        fs::remove_dir_all(&dir).unwrap();
    }
}
