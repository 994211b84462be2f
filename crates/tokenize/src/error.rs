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
    /// The tokenizer failed on the text (not expected for valid UTF-8; a server-side fault).
    #[error("tokenizer failed: {0}")]
    Encode(String),
}

impl TokenizeError {
    /// `true` when the request is at fault (HTTP 400, or 404 for [`Self::UnknownModel`]);
    /// `false` for a fault of ours ([`Self::Encode`]).
    pub fn is_client_error(&self) -> bool {
        !matches!(self, TokenizeError::Encode(_))
    }
}
