//! Simulated engines: a vLLM-like prefix cache with KV events, a latency model, an in-process
//! fleet simulation, and the network-facing `sim-worker` (OpenAI HTTP API + KV events over
//! ZeroMQ) that wraps the same cache.

pub mod api;
pub mod engine;
pub mod events;
pub mod fleet;
pub mod flood;
pub mod latency;
pub mod prefix_cache;
pub mod publisher;
pub mod server;
pub mod workload;
