//! kv-epp's core: what a routing decision and an index update are made of, as synchronous code
//! with no I/O.
//!
//! - [`hashing`]: the block-hash contract (XXH3-64, Dynamo parity).
//! - [`salt`]: which tenant salt a request carries (sources, precedence, policy).
//! - [`namespace`]: the namespace a salt hashes under, its hash seed, how it travels to the
//!   engine and how it is read back from engine events.
//! - [`engine_event`]: engine events in one engine-neutral form, and the one writer of them into
//!   the index.
//! - [`fingerprint`]: how a secret appears in logs and metrics.
//! - [`index`]: which workers hold which prefixes.
//! - [`scoring`]: from overlap and load to a pick.
//! - [`worker`]: worker identity.
//!
//! Deliberately absent: async runtimes, JSON and configuration (this crate's dependencies keep
//! them out), and files, sockets and the environment (`clippy.toml` beside this crate disallows
//! the standard library's I/O here). Costs are per call and documented where they matter.

pub mod engine_event;
pub mod fingerprint;
pub mod hashing;
pub mod index;
pub mod namespace;
pub mod salt;
pub mod scoring;
pub mod worker;
