//! `kvbridge bootstrap`: serves the bootstrap HTTP API until SIGTERM/SIGINT
//! (contracts/cli.md).

use std::net::{IpAddr, SocketAddr};
use std::process::ExitCode;

use clap::Args;
use kvbridge_roles::bootstrap::{BootstrapServer, DEFAULT_ENTRY_CLEANUP_INTERVAL};

/// Where the bootstrap server listens.
#[derive(Debug, Args)]
pub struct BootstrapArgs {
    /// IP address to listen on.
    #[arg(long, default_value = "127.0.0.1")]
    host: IpAddr,
    /// Port to listen on; 0 picks a free one.
    #[arg(long, default_value_t = 8998)]
    port: u16,
}

/// Runs the server until a termination signal, then exits 0.
pub fn run(args: BootstrapArgs) -> ExitCode {
    let cleanup = std::env::var("SGLANG_DISAGGREGATION_BOOTSTRAP_ENTRY_CLEANUP_INTERVAL")
        .ok()
        .and_then(|v| v.trim().parse::<u64>().ok())
        .map_or(
            DEFAULT_ENTRY_CLEANUP_INTERVAL,
            std::time::Duration::from_secs,
        );
    let server = match BootstrapServer::start(SocketAddr::new(args.host, args.port), cleanup) {
        Ok(s) => s,
        Err(e) => {
            eprintln!(
                "kvbridge bootstrap: cannot listen on {}:{}: {e}",
                args.host, args.port
            );
            return ExitCode::FAILURE;
        }
    };
    eprintln!("listening on {}", server.local_addr());
    match crate::signals::wait_for_termination() {
        Ok(signal) => tracing::info!(signal, "stopping bootstrap server"),
        Err(e) => {
            eprintln!("kvbridge bootstrap: cannot wait for signals: {e}");
            return ExitCode::FAILURE;
        }
    }
    server.shutdown();
    ExitCode::SUCCESS
}
