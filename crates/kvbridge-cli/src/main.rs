//! `kvbridge`: the command-line tool over the kvbridge crates.
//!
//! Each subcommand lives in its own module; `main` only parses arguments,
//! sets up logging (to stderr; stdout is reserved for machine-readable
//! output) and dispatches.

use std::process::ExitCode;

use clap::{Parser, Subcommand};

mod bench_cmd;
mod bootstrap_cmd;
mod demo;
mod plan_cmd;
mod rank;
mod signals;
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
    /// Decode or encode wire messages as JSON (docs/cli.md).
    #[command(subcommand)]
    Wire(wire_cmd::WireCommand),
    /// Measure transfer engines.
    #[command(subcommand)]
    Bench(bench_cmd::BenchCommand),
    /// Plan one chunk of a scenario and print its blocks (docs/plan-scenario.md).
    Plan(plan_cmd::PlanArgs),
    /// Serve the bootstrap HTTP API until SIGTERM/SIGINT (docs/cli.md).
    Bootstrap(bootstrap_cmd::BootstrapArgs),
    /// The main job: stream a synthetic workload through prefill and decode
    /// rank processes on loopback and verify every byte.
    Demo(demo::DemoArgs),
    /// Run one prefill rank from a JSON configuration file.
    Prefill(rank::RankArgs),
    /// Run one decode rank from a JSON configuration file.
    Decode(rank::RankArgs),
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
        Command::Bootstrap(args) => bootstrap_cmd::run(args),
        Command::Demo(args) => demo::run(args),
        Command::Prefill(args) => rank::run(rank::Role::Prefill, args),
        Command::Decode(args) => rank::run(rank::Role::Decode, args),
        Command::Bench(cmd) => bench_cmd::run(cmd),
        Command::Plan(args) => plan_cmd::run(args),
    }
}
