//! The `kv-epp-sim` binary: simulated engines, the demo and the workload generator. Not shipped in kv-epp's image; the
//! product binary `kv-epp` contains no fake engine.

mod cli;

use std::process::ExitCode;

use clap::{Parser, Subcommand};

/// Simulated vLLM workers and the kv-epp demo.
#[derive(Parser, Debug)]
#[command(name = "kv-epp-sim", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Run a simulated vLLM worker: OpenAI HTTP API, prefix cache, KV events over ZeroMQ.
    SimWorker(cli::sim_worker::SimWorkerArgs),
    /// Route a multi-tenant workload with kv-epp and with round-robin and compare.
    Demo(cli::demo::DemoArgs),
    /// Print the built-in multi-tenant workload as JSON lines (arrival, tenant, request body).
    Workload(cli::workload::WorkloadArgs),
    /// One tenant floods the fleet at 10x the others: flow control on and off, compared.
    Flood(cli::flood::FloodArgs),
}

fn main() -> ExitCode {
    let result = match Cli::parse().command {
        Command::SimWorker(args) => cli::sim_worker::run(&args),
        Command::Demo(args) => cli::demo::run(&args).map(|out| print!("{out}")),
        Command::Workload(args) => cli::workload::run(&args).map(|out| print!("{out}")),
        Command::Flood(args) => cli::flood::run(&args).map(|out| print!("{out}")),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("kv-epp-sim: {e}");
            ExitCode::FAILURE
        }
    }
}
