//! Which tokenizer serves which `model` name, and which names are LoRA adapters.
//!
//! vLLM serves an adapter under its own model name and tokenizes its prompts with the base
//! model's tokenizer; the adapter's KV blocks are keyed by the adapter, so routing must hash with
//! the adapter's name as `lora_name`. The catalog resolves a request's `model` to
//! (tokenizer, optional lora name) and is the one entry point the ext_proc path calls.

use std::collections::HashMap;
use std::sync::Arc;

use serde::Deserialize;

use super::error::{LoadError, TokenizeError};
use super::model::{ModelTokenizer, TokenizerFiles};
use super::request::{Endpoint, parse_request};

/// One served base model.
#[derive(Clone, Debug, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelSpec {
    /// The `model` name clients send.
    pub name: String,
    /// Its tokenizer files.
    pub files: TokenizerFiles,
}

/// A LoRA adapter served on top of a base model.
#[derive(Clone, Debug, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LoraAdapter {
    /// The adapter's name: the `model` clients send, and the `lora_name` of its block hashes.
    pub name: String,
    /// The base model whose tokenizer it uses (a [`ModelSpec::name`]).
    pub base_model: String,
}

/// The tokenizer part of the configuration: models and adapters.
#[derive(Clone, Debug, Default, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct CatalogConfig {
    /// Base models.
    pub models: Vec<ModelSpec>,
    /// LoRA adapters.
    pub lora_adapters: Vec<LoraAdapter>,
}

/// A request's prompt as token ids, with the identity routing hashes it under.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TokenizedRequest {
    /// The `model` field as sent.
    pub model: String,
    /// The base model whose tokenizer produced the ids.
    pub base_model: Arc<str>,
    /// The adapter name to hash with, when `model` is a LoRA adapter.
    pub lora_name: Option<Arc<str>>,
    /// The prompt token ids, as the engine will compute them.
    pub token_ids: Vec<u32>,
}

#[derive(Debug)]
struct Target {
    base_model: Arc<str>,
    lora_name: Option<Arc<str>>,
    tokenizer: Arc<ModelTokenizer>,
}

/// Model and adapter names → tokenizers. Built once at start; lookups are one hash probe.
#[derive(Debug, Default)]
pub struct ModelCatalog {
    targets: HashMap<String, Target>,
}

impl ModelCatalog {
    /// An empty catalog.
    pub fn new() -> ModelCatalog {
        ModelCatalog::default()
    }

    /// Loads every model's files (see [`ModelTokenizer::load`]) and registers the adapters.
    pub fn load(config: &CatalogConfig) -> Result<ModelCatalog, LoadError> {
        let mut catalog = ModelCatalog::new();
        for spec in &config.models {
            let tokenizer = ModelTokenizer::load(&spec.files)?;
            catalog.insert_model(&spec.name, Arc::new(tokenizer))?;
        }
        for adapter in &config.lora_adapters {
            catalog.insert_adapter(adapter)?;
        }
        Ok(catalog)
    }

    /// Registers a base model. Errors when the name is already taken.
    pub fn insert_model(
        &mut self,
        name: &str,
        tokenizer: Arc<ModelTokenizer>,
    ) -> Result<(), LoadError> {
        self.insert(
            name,
            Target {
                base_model: Arc::from(name),
                lora_name: None,
                tokenizer,
            },
        )
    }

    /// Registers an adapter of an already registered base model.
    pub fn insert_adapter(&mut self, adapter: &LoraAdapter) -> Result<(), LoadError> {
        let base = self
            .targets
            .get(&adapter.base_model)
            .filter(|t| t.lora_name.is_none())
            .ok_or_else(|| {
                LoadError::Catalog(format!(
                    "adapter `{}`: base model `{}` is not configured",
                    adapter.name, adapter.base_model
                ))
            })?;
        let target = Target {
            base_model: base.base_model.clone(),
            lora_name: Some(Arc::from(adapter.name.as_str())),
            tokenizer: base.tokenizer.clone(),
        };
        self.insert(&adapter.name, target)
    }

    fn insert(&mut self, name: &str, target: Target) -> Result<(), LoadError> {
        if self.targets.contains_key(name) {
            return Err(LoadError::Catalog(format!(
                "model name `{name}` is configured twice"
            )));
        }
        self.targets.insert(name.to_owned(), target);
        Ok(())
    }

    /// The tokenizer and adapter name for a `model` name, if configured.
    pub fn resolve(&self, model: &str) -> Option<(&Arc<ModelTokenizer>, Option<&Arc<str>>)> {
        self.targets
            .get(model)
            .map(|t| (&t.tokenizer, t.lora_name.as_ref()))
    }

    /// Parses a request body of `endpoint`, resolves its model and computes its prompt's token
    /// ids. Cost: one JSON pass, one template render (chat), one tokenizer pass.
    ///
    /// Errors: [`TokenizeError::is_client_error`] tells the request's faults (malformed body,
    /// missing or unknown model, empty messages, template `raise_exception`, ...) from ours.
    pub fn tokenize(
        &self,
        endpoint: Endpoint,
        body: &[u8],
    ) -> Result<TokenizedRequest, TokenizeError> {
        let parsed = parse_request(endpoint, body)?;
        let target = self
            .targets
            .get(&parsed.model)
            .ok_or_else(|| TokenizeError::UnknownModel(parsed.model.clone()))?;
        let token_ids = target.tokenizer.tokenize(&parsed.prompt)?;
        Ok(TokenizedRequest {
            model: parsed.model,
            base_model: target.base_model.clone(),
            lora_name: target.lora_name.clone(),
            token_ids,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shareable_across_threads() {
        fn assert_send_sync<T: Send + Sync>() {}
        assert_send_sync::<ModelCatalog>();
        assert_send_sync::<ModelTokenizer>();
        assert_send_sync::<TokenizedRequest>();
        assert_send_sync::<TokenizeError>();
    }

    #[test]
    fn config_shape() {
        let config: CatalogConfig = serde_yaml::from_str(
            "models:\n  - name: base\n    files:\n      tokenizer_json: /m/tokenizer.json\n\
             lora_adapters:\n  - name: sql\n    base_model: base\n",
        )
        .unwrap();
        assert_eq!(config.models[0].files.tokenizer_config, None);
        assert_eq!(config.lora_adapters[0].base_model, "base");
        let missing = ModelCatalog::load(&config).unwrap_err();
        assert!(
            missing.to_string().contains("/m/tokenizer.json"),
            "{missing}"
        );
    }
}
