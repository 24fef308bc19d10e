//! `kvbridge bench`: throughput measurements of the transfer engines.

use std::process::ExitCode;

use clap::Subcommand;

mod tcp;

/// Benchmarks of the transfer engines.
#[derive(Debug, Subcommand)]
pub enum BenchCommand {
    /// TCP engine between two processes on loopback: a target that registers
    /// a host buffer and an initiator that writes into it, per block size.
    Tcp(tcp::TcpArgs),
}

/// Run a bench subcommand.
pub fn run(cmd: BenchCommand) -> ExitCode {
    let r = match cmd {
        BenchCommand::Tcp(args) => tcp::run(args),
    };
    match r {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("kvbridge bench: {e:#}");
            ExitCode::FAILURE
        }
    }
}
