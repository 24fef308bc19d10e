//! `kvbridge bench`: throughput measurements of the transfer engines.

use std::process::ExitCode;

use clap::Subcommand;

#[cfg(feature = "cuda")]
mod ipc;
#[cfg(feature = "cuda")]
mod ipc_layout;
mod tcp;
#[cfg(feature = "ucx")]
mod ucx;

/// Benchmarks of the transfer engines.
#[derive(Debug, Subcommand)]
pub enum BenchCommand {
    /// TCP engine between two processes on loopback: a target that registers
    /// a host buffer and an initiator that writes into it, per block size.
    Tcp(tcp::TcpArgs),
    /// CUDA IPC engine between two processes on one GPU, against a plain
    /// device-to-device memcpy, the batched kernel alone and one
    /// `cuMemcpyAsync` per block.
    #[cfg(feature = "cuda")]
    Ipc(ipc::IpcArgs),
    /// UCX engine between two processes on loopback, laid out as `bench
    /// tcp` (same sizes, totals and JSON); `--tls` picks UCX's transports.
    #[cfg(feature = "ucx")]
    Ucx(ucx::UcxArgs),
}

/// Run a bench subcommand.
pub fn run(cmd: BenchCommand) -> ExitCode {
    let r = match cmd {
        BenchCommand::Tcp(args) => tcp::run(args),
        #[cfg(feature = "cuda")]
        BenchCommand::Ipc(args) => ipc::run(args),
        #[cfg(feature = "ucx")]
        BenchCommand::Ucx(args) => ucx::run(args),
    };
    match r {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("kvbridge bench: {e:#}");
            ExitCode::FAILURE
        }
    }
}
