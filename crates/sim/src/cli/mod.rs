//! Subcommands of the `kv-epp-sim` binary. Each file is one subcommand: flags in, exit status out.

pub(crate) mod demo;
mod demo_engines;
pub(crate) mod demo_net;
pub(crate) mod flood;
pub(crate) mod sim_worker;
pub(crate) mod workload;
