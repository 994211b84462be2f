//! Simulated engines: a vLLM-like prefix cache with KV events, a latency model, and an in-process
//! fleet simulation. The network-facing `sim-worker` wraps the same cache.

pub mod fleet;
pub mod latency;
pub mod prefix_cache;
