//! Errors of the tokenize layer: loading a model's files (at start) and turning a request into
//! token ids (per request). The edge maps [`TokenizeError`] to a status once, using
//! [`TokenizeError::is_client_error`].

use std::path::PathBuf;

/// A model's tokenizer files could not be loaded. Always names the file, and the field when one
/// field is at fault.
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    /// The file could not be read.
    #[error("cannot read {path}: {source}")]
    Read {
        /// The file.
        path: PathBuf,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
    /// The file is not the JSON we expect.
    #[error("{path}: invalid JSON: {source}")]
    Json {
        /// The file.
        path: PathBuf,
        /// The parse error.
        #[source]
        source: serde_json::Error,
    },
    /// One field of the file has an unusable value.
    #[error("{path}: field `{field}`: {reason}")]
    Field {
        /// The file.
        path: PathBuf,
        /// The field.
        field: &'static str,
        /// What is wrong with it.
        reason: String,
    },
    /// The `tokenizers` crate rejected `tokenizer.json`.
    #[error("{path}: not a usable tokenizer.json: {reason}")]
    Tokenizer {
        /// The file.
        path: PathBuf,
        /// The crate's message.
        reason: String,
    },
    /// The chat template does not compile.
    #[error("{path}: chat template does not compile: {reason}")]
    Template {
        /// The file the template came from (`tokenizer_config.json` or the override file).
        path: PathBuf,
        /// minijinja's message.
        reason: String,
    },
    /// The model catalog is inconsistent (duplicate name, adapter of an unknown base model).
    #[error("model catalog: {0}")]
    Catalog(String),
}

/// A request could not be turned into token ids.
#[derive(Debug, thiserror::Error)]
pub enum TokenizeError {
    /// The body is not JSON of the endpoint's shape.
    #[error("malformed request body: {0}")]
    MalformedBody(#[from] serde_json::Error),
    /// The body has no `model` (or it is null).
    #[error("the request has no `model`")]
    MissingModel,
    /// No tokenizer is configured for this model or adapter name.
    #[error("unknown model `{0}`")]
    UnknownModel(String),
    /// A chat request without `messages`, or with an empty list.
    #[error("`messages` must be a non-empty list")]
    EmptyMessages,
    /// A message of an unusable shape.
    #[error("invalid message: {0}")]
    InvalidMessage(&'static str),
    /// A completions request without a usable `prompt`.
    #[error("invalid prompt: {0}")]
    InvalidPrompt(&'static str),
    /// A token id in a pre-tokenized prompt is not in the vocabulary.
    #[error("token id {id} is out of vocabulary (size {vocab_size})")]
    TokenOutOfVocabulary {
        /// The offending id.
        id: u32,
        /// The model's vocabulary size (added tokens included).
        vocab_size: usize,
    },
    /// A chat request for a model that has no chat template.
    #[error("model has no chat template")]
    NoChatTemplate,
    /// Options that cannot be combined (e.g. `continue_final_message` with
    /// `add_generation_prompt`).
    #[error("{0}")]
    IncompatibleOptions(&'static str),
    /// The template called `raise_exception(message)`: the conversation is invalid for the model.
    #[error("chat template rejected the request: {0}")]
    TemplateRejected(String),
    /// The template failed for another reason while rendering this request.
    #[error("chat template failed: {0}")]
    TemplateFailed(String),
    /// `continue_final_message` could not find the final message in the rendered text.
    #[error("continue_final_message: {0}")]
    ContinueFinalMessage(&'static str),
    /// The prompt has more tokens than the caller's limit (found before it was encoded whole:
    /// `at_least` is what was counted when encoding stopped).
    #[error("prompt is at least {at_least} tokens, over the limit of {max}")]
    PromptTooLong {
        /// Tokens counted (or bounded from the text's length) before stopping.
        at_least: usize,
        /// The limit.
        max: usize,
    },
    /// The text has a pre-tokenizer word (a piece with no split point) longer than the model's
    /// limit ([`crate::model::MAX_WORD_BYTES`] by default): BPE merges a word as a whole, with working memory
    /// proportional to its length, so kv-epp does not encode it (found before any of that memory
    /// is allocated).
    #[error(
        "a word of {bytes} bytes without a split point is over the {max} bytes kv-epp tokenizes \
         in one piece"
    )]
    WordTooLong {
        /// The word's length (bytes of the text, before normalization).
        bytes: usize,
        /// The limit.
        max: usize,
    },
    /// The tokenizer failed on the text (not expected for valid UTF-8; a server-side fault).
    #[error("tokenizer failed: {0}")]
    Encode(String),
    /// The request is well formed, but kv-epp cannot reproduce exactly what the engine will
    /// render for it (a feature or option kv-epp does not implement). The engine may well
    /// accept it: the edge routes it on load alone unless configured to refuse.
    #[error("cannot tokenize this request exactly as vLLM does ({}): {detail}", reason.label())]
    Inexact {
        /// Why, as a bounded metric label.
        reason: Unrenderable,
        /// What exactly (for the log line and the 400 body; never carries request text).
        detail: &'static str,
    },
}

/// Why kv-epp could not render a request that the engine might accept: the `reason` label of
/// `kv_epp_unrenderable_total`. A closed set, so the label's cardinality is bounded.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Unrenderable {
    /// The chat template called `raise_exception` (the engine raises too: a 400 from vLLM).
    TemplateRejected,
    /// The chat template failed otherwise while rendering.
    TemplateFailed,
    /// The model has no chat template configured in kv-epp.
    NoChatTemplate,
    /// `continue_final_message` could not find the final message in the render.
    ContinueFinalMessage,
    /// The request carries its own chat template (vLLM refuses it unless
    /// `--trust-request-chat-template`).
    RequestChatTemplate,
    /// A rendering option kv-epp does not implement (e.g. `chat_template_kwargs.tokenize`,
    /// `sanitize_control_tokens`, a non-boolean `strict` that pydantic would coerce).
    UnsupportedOption,
    /// The template reads message content as a list of parts (vLLM's "openai" content format),
    /// which kv-epp does not reproduce.
    ContentFormat,
    /// A `/v1/responses` input kv-epp does not map yet (function calls and their outputs,
    /// reasoning items, `previous_response_id`, stored prompts, roles other than
    /// user/system/developer/assistant).
    ResponsesInput,
    /// A `/v1/responses` tool other than a function tool.
    ResponsesTool,
    /// A pre-tokenizer word longer than the model's limit
    /// ([`TokenizeError::WordTooLong`]): its BPE working memory would exceed the tokenization
    /// memory bound.
    LongWord,
}

impl Unrenderable {
    /// Every reason, for documentation and tests.
    pub const ALL: [Unrenderable; 10] = [
        Unrenderable::TemplateRejected,
        Unrenderable::TemplateFailed,
        Unrenderable::NoChatTemplate,
        Unrenderable::ContinueFinalMessage,
        Unrenderable::RequestChatTemplate,
        Unrenderable::UnsupportedOption,
        Unrenderable::ContentFormat,
        Unrenderable::ResponsesInput,
        Unrenderable::ResponsesTool,
        Unrenderable::LongWord,
    ];

    /// The metric label.
    pub fn label(self) -> &'static str {
        match self {
            Unrenderable::TemplateRejected => "template_rejected",
            Unrenderable::TemplateFailed => "template_failed",
            Unrenderable::NoChatTemplate => "no_chat_template",
            Unrenderable::ContinueFinalMessage => "continue_final_message",
            Unrenderable::RequestChatTemplate => "request_chat_template",
            Unrenderable::UnsupportedOption => "unsupported_option",
            Unrenderable::ContentFormat => "content_format",
            Unrenderable::ResponsesInput => "responses_input",
            Unrenderable::ResponsesTool => "responses_tool",
            Unrenderable::LongWord => "long_word",
        }
    }
}

impl TokenizeError {
    /// `true` when the request is at fault (HTTP 400, or 404 for [`Self::UnknownModel`]);
    /// `false` for a fault of ours ([`Self::Encode`]).
    pub fn is_client_error(&self) -> bool {
        !matches!(self, TokenizeError::Encode(_))
    }

    /// Why kv-epp cannot render a request the engine might accept, or `None` when the request
    /// is malformed (the engine refuses it too) or the fault is ours ([`Self::Encode`]).
    /// Template failures count here: whether the engine also refuses depends on the template,
    /// which kv-epp renders faithfully but cannot prove identical.
    pub fn unrenderable(&self) -> Option<Unrenderable> {
        match self {
            TokenizeError::TemplateRejected(_) => Some(Unrenderable::TemplateRejected),
            TokenizeError::TemplateFailed(_) => Some(Unrenderable::TemplateFailed),
            TokenizeError::NoChatTemplate => Some(Unrenderable::NoChatTemplate),
            TokenizeError::ContinueFinalMessage(_) => Some(Unrenderable::ContinueFinalMessage),
            TokenizeError::Inexact { reason, .. } => Some(*reason),
            TokenizeError::WordTooLong { .. } => Some(Unrenderable::LongWord),
            _ => None,
        }
    }

    pub(crate) fn inexact(reason: Unrenderable, detail: &'static str) -> TokenizeError {
        TokenizeError::Inexact { reason, detail }
    }
}
