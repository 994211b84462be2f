//! kv-epp's core: what a routing decision and an index update are made of, as synchronous code
//! with no I/O.
//!
//! - [`hashing`]: the block-hash contract (XXH3-64, Dynamo parity).
//! - [`salt`] and [`engine_salt`]: which tenant namespace a request belongs to, and how that
//!   namespace travels to the engine and back.
//! - [`fingerprint`]: how a secret appears in logs and metrics.
//! - [`index`]: which workers hold which prefixes.
//! - [`scoring`]: from overlap and load to a pick.
//! - [`worker`]: worker identity.
//!
//! Deliberately absent, and kept out by this crate's dependencies: async runtimes, sockets, JSON,
//! configuration files, the environment. Costs are per call and documented where they matter.

pub mod engine_salt;
pub mod fingerprint;
pub mod hashing;
pub mod index;
pub mod salt;
pub mod scoring;
pub mod worker;
