//! kv-epp: an Envoy ext_proc endpoint picker that routes LLM requests to the worker whose KV
//! cache already holds the longest prefix of the prompt, weighed against load, with tenants
//! isolated by their cache salt. See `ARCHITECTURE.md` for the code map.

pub mod fingerprint;
pub mod hashing;
pub mod index;
pub mod salt;
pub mod scoring;
pub mod sim;
pub mod tokenize;
pub mod worker;
pub mod workload;
