//! `kvbridge`: the command-line tool over the kvbridge crates.
//!
//! Each subcommand lives in its own module; `main` only parses arguments,
//! sets up logging (to stderr; stdout is reserved for machine-readable
//! output) and dispatches.

use std::process::ExitCode;

use clap::{Parser, Subcommand};

mod bench_cmd;
mod plan_cmd;
mod wire_cmd;

/// Moves the KV cache of LLM requests from prefill GPUs to decode GPUs.
#[derive(Debug, Parser)]
#[command(name = "kvbridge", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Decode or encode wire messages as JSON (contracts/wire-cli.md).
    #[command(subcommand)]
    Wire(wire_cmd::WireCommand),
    /// Measure transfer engines.
    #[command(subcommand)]
    Bench(bench_cmd::BenchCommand),
    /// Plan one chunk of a scenario and print its blocks (contracts/plan-scenario.md).
    Plan(plan_cmd::PlanArgs),
    // Further subcommands are added here, one line each.
}

fn init_logging() {
    let filter = tracing_subscriber::EnvFilter::try_from_env("KVBRIDGE_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .try_init();
}

fn main() -> ExitCode {
    init_logging();
    let cli = Cli::parse();
    match cli.command {
        Command::Wire(cmd) => wire_cmd::run(cmd),
        Command::Bench(cmd) => bench_cmd::run(cmd),
        Command::Plan(args) => plan_cmd::run(args),
    }
}
