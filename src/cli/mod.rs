//! Subcommands of the `kv-epp` binary. Each file is one subcommand: flags in, exit status out.

pub mod demo;
pub mod demo_net;
pub mod hash;
pub mod serve;
pub mod sim_worker;
pub mod tokenize;
