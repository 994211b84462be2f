//! kv-epp: an Envoy ext_proc endpoint picker that routes LLM requests to the worker whose KV
//! cache already holds the longest prefix of the prompt, weighed against load, with tenants
//! isolated by their cache salt. See `ARCHITECTURE.md` for the code map.

pub mod admin;
pub mod config;
pub mod decide;
pub mod discovery;
pub mod engine_metrics;
pub mod engine_salt;
pub mod events;
pub mod extproc;
pub mod fingerprint;
pub mod forward;
pub mod hashing;
pub mod httpc;
pub mod index;
pub mod membership;
pub mod metrics;
pub mod readiness;
pub mod replica;
pub mod request;
pub mod router;
pub mod salt;
pub mod scoring;
pub mod server;
pub mod sim;
pub mod tokenize;
pub mod worker;
pub mod workload;
