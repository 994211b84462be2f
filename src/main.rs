//! The `kv-epp` binary: one command-line entry point with subcommands.

mod cli;

use std::process::ExitCode;

use clap::{Parser, Subcommand};

/// Envoy ext_proc endpoint picker with tenant-isolated KV-cache-aware routing.
#[derive(Parser, Debug)]
#[command(name = "kv-epp", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Run the ext_proc endpoint picker.
    Serve(cli::serve::ServeArgs),
    /// Print the local and sequence block hashes of a JSON token array read on stdin.
    Hash(cli::hash::HashArgs),
    /// Show the model, token IDs, salt fingerprint, block hashes and forwarded body of a request.
    Tokenize(cli::tokenize::TokenizeArgs),
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Serve(args) => cli::serve::run(&args),
        Command::Hash(args) => cli::hash::run(&args, std::io::stdin().lock()).map(|out| {
            println!("{out}");
        }),
        Command::Tokenize(args) => cli::tokenize::run(&args, std::io::stdin().lock()).map(|out| {
            println!("{out}");
        }),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("kv-epp: {e}");
            ExitCode::FAILURE
        }
    }
}
