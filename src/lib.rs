//! kv-epp: an Envoy ext_proc endpoint picker that routes LLM requests to the worker whose KV
//! cache already holds the longest prefix of the prompt, weighed against load, with tenants
//! isolated by their cache salt. See `ARCHITECTURE.md` for the code map.

pub mod admin;
pub mod auth;
pub mod config;
pub mod decide;
pub mod discovery;
pub(crate) mod engine_metrics;
pub mod events;
pub mod extproc;
pub mod flow;
pub(crate) mod forward;
#[doc(hidden)]
pub mod fuzzing;
pub mod httpc;
pub(crate) mod json;
pub(crate) mod membership;
pub mod metrics;
pub mod models;
pub mod process;
pub mod readiness;
pub mod replica;
pub mod request;
pub mod server;
pub(crate) mod tls;
pub mod upkeep;
pub mod workers;
