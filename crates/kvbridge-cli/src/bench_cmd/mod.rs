//! `kvbridge bench`: throughput measurements of the transfer engines.

use std::process::ExitCode;

use clap::Subcommand;

mod child;
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

/// The secret both bench processes use with `--auth`: the environment's
/// (KVBRIDGE_SECRET_FILE / KVBRIDGE_SECRET), else one generated for this
/// run; the same value for every call in the process.
fn bench_secret(auth: bool) -> Option<String> {
    static SECRET: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    auth.then(|| {
        SECRET
            .get_or_init(|| match kvbridge_engine::ClusterSecret::from_env() {
                Ok(Some(s)) => s.to_env_value(),
                Ok(None) => kvbridge_engine::ClusterSecret::generate().to_env_value(),
                Err(e) => {
                    eprintln!("kvbridge bench: {e}; using a generated secret instead");
                    kvbridge_engine::ClusterSecret::generate().to_env_value()
                }
            })
            .clone()
    })
}
