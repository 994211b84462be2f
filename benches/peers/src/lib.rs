//! Benchmark-only package; see `benches/peers.rs`.
