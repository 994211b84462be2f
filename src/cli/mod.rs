//! Subcommands of the `kv-epp` binary. Each file is one subcommand: flags in, exit status out.

pub(crate) mod hash;
pub(crate) mod serve;
pub(crate) mod tokenize;
