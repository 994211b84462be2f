//! The served models: every name a request's `model` may carry — a base model or one of its LoRA
//! adapters — mapped to its base model's block size, KV index, tokenizer and prompt limit.
//!
//! One map answers every lookup (routing, tokenizing, the admin API), so an adapter cannot be
//! known to one of them and unknown to another. Built once at start from typed settings; reads
//! are one hash probe and take no lock.

use std::collections::HashMap;
use std::sync::Arc;

use kv_epp_core::index::{IndexLimits, KvIndex};
use kv_epp_tokenize::{Endpoint, ModelTokenizer, TokenizeError, parse_request};

/// What the composition root knows about one base model.
#[derive(Clone, Debug)]
pub struct ModelSettings {
    /// The name clients put in `model`.
    pub name: String,
    /// The engine's KV block size in tokens.
    pub block_size: usize,
    /// LoRA adapters served on this model (clients may name them in `model`).
    pub lora_adapters: Vec<String>,
    /// Longest prompt accepted, in tokens.
    pub max_prompt_tokens: Option<usize>,
    /// The model's tokenizer; without one only token-ID prompts are routed by prefix.
    pub tokenizer: Option<Arc<ModelTokenizer>>,
}

/// One served base model.
pub struct ServedModel {
    name: String,
    block_size: usize,
    index: Arc<KvIndex>,
    tokenizer: Option<Arc<ModelTokenizer>>,
    max_prompt_tokens: Option<usize>,
}

impl std::fmt::Debug for ServedModel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ServedModel")
            .field("name", &self.name)
            .field("block_size", &self.block_size)
            .field("tokenizer", &self.tokenizer.is_some())
            .field("max_prompt_tokens", &self.max_prompt_tokens)
            .finish_non_exhaustive()
    }
}

impl std::fmt::Debug for ServedModels {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list().entries(&self.models).finish()
    }
}

impl ServedModel {
    /// The base model's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Tokens per KV block.
    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// The model's KV index.
    pub fn index(&self) -> &Arc<KvIndex> {
        &self.index
    }

    /// Longest prompt accepted, in tokens, if limited.
    pub fn max_prompt_tokens(&self) -> Option<usize> {
        self.max_prompt_tokens
    }

    /// Token IDs of a text or chat request body sent to `path`, as the engine computes them:
    /// `None` when the model has no tokenizer or kv-epp does not tokenize `path` (route on load
    /// alone). Cost: one JSON pass, one template render (chat), one tokenizer pass, which stops
    /// as soon as the prompt is known to exceed `max_prompt_tokens`.
    ///
    /// Errors: [`TokenizeError::PromptTooLong`] over the limit (counted before the prompt was
    /// encoded whole); [`TokenizeError::is_client_error`] tells the request's faults from
    /// kv-epp's.
    pub fn tokenize(&self, path: &str, body: &[u8]) -> Option<Result<Vec<u32>, TokenizeError>> {
        let endpoint = Endpoint::from_path(path)?;
        let tokenizer = self.tokenizer.as_ref()?;
        Some(
            parse_request(endpoint, body)
                .and_then(|r| tokenizer.tokenize_owned(r.prompt, self.max_prompt_tokens)),
        )
    }
}

/// A `model` name resolved: its base model, and the adapter when the name is one.
#[derive(Clone, Copy, Debug)]
pub struct Resolved<'a> {
    /// The base model.
    pub model: &'a ServedModel,
    /// The LoRA adapter the request named (its blocks are hashed under this name).
    pub lora: Option<&'a str>,
}

/// Every served model and adapter name.
#[derive(Default)]
pub struct ServedModels {
    models: Vec<ServedModel>,
    /// Base model and adapter names → (position in `models`, adapter name).
    names: HashMap<String, (usize, Option<String>)>,
}

/// Why the served models could not be built.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("model name `{0}` is configured twice (as a model or an adapter)")]
pub struct DuplicateName(pub String);

impl ServedModels {
    /// The models, each with a fresh index under `limits`.
    ///
    /// Errors: a name used twice, by models or adapters.
    pub fn new(
        settings: Vec<ModelSettings>,
        limits: IndexLimits,
    ) -> Result<ServedModels, DuplicateName> {
        let mut served = ServedModels::default();
        for (i, s) in settings.into_iter().enumerate() {
            let names = std::iter::once((s.name.clone(), None))
                .chain(s.lora_adapters.iter().map(|a| (a.clone(), Some(a.clone()))));
            for (name, lora) in names {
                if served.names.insert(name.clone(), (i, lora)).is_some() {
                    return Err(DuplicateName(name));
                }
            }
            served.models.push(ServedModel {
                index: Arc::new(KvIndex::new(s.block_size, limits)),
                name: s.name,
                block_size: s.block_size,
                tokenizer: s.tokenizer,
                max_prompt_tokens: s.max_prompt_tokens,
            });
        }
        Ok(served)
    }

    /// Resolves a `model` field (a base model or an adapter).
    pub fn resolve(&self, name: &str) -> Option<Resolved<'_>> {
        let (i, lora) = self.names.get(name)?;
        Some(Resolved {
            model: &self.models[*i],
            lora: lora.as_deref(),
        })
    }

    /// A base model by name (adapters are not base models).
    pub fn get(&self, base: &str) -> Option<&ServedModel> {
        self.resolve(base)
            .filter(|r| r.lora.is_none())
            .map(|r| r.model)
    }

    /// A base model's index.
    pub fn index(&self, base: &str) -> Option<&Arc<KvIndex>> {
        self.get(base).map(ServedModel::index)
    }

    /// The base models, in configuration order.
    pub fn iter(&self) -> impl Iterator<Item = &ServedModel> {
        self.models.iter()
    }

    /// The base model names, sorted.
    pub fn names(&self) -> Vec<String> {
        let mut v: Vec<String> = self.models.iter().map(|m| m.name.clone()).collect();
        v.sort();
        v
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn settings(name: &str, adapters: &[&str]) -> ModelSettings {
        ModelSettings {
            name: name.into(),
            block_size: 4,
            lora_adapters: adapters.iter().map(|a| (*a).to_owned()).collect(),
            max_prompt_tokens: Some(10),
            tokenizer: None,
        }
    }

    #[test]
    fn one_map_for_models_and_adapters() {
        let m = ServedModels::new(
            vec![settings("a", &["a-sql"]), settings("b", &[])],
            IndexLimits::default(),
        )
        .unwrap();
        let r = m.resolve("a-sql").unwrap();
        assert_eq!((r.model.name(), r.lora), ("a", Some("a-sql")));
        assert_eq!(m.resolve("b").unwrap().lora, None);
        assert!(m.resolve("c").is_none());
        assert!(m.get("a-sql").is_none(), "an adapter is not a base model");
        assert!(Arc::ptr_eq(
            m.index("a").unwrap(),
            m.resolve("a-sql").unwrap().model.index()
        ));
        assert_eq!(m.names(), ["a", "b"]);
        assert_eq!(m.get("a").unwrap().max_prompt_tokens(), Some(10));
        assert!(
            m.get("a")
                .unwrap()
                .tokenize("/v1/completions", b"{}")
                .is_none(),
            "no tokenizer: route on load alone"
        );
    }

    #[test]
    fn a_name_is_configured_once() {
        let e = ServedModels::new(
            vec![settings("a", &["x"]), settings("x", &[])],
            IndexLimits::default(),
        )
        .unwrap_err();
        assert_eq!(e, DuplicateName("x".into()));
    }
}
