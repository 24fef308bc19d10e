//! `kvbridge bootstrap`: serves the bootstrap HTTP API until SIGTERM/SIGINT
//! (docs/cli.md).

use std::path::PathBuf;
use std::process::ExitCode;

use clap::Args;
use kvbridge_engine::ClusterSecret;
use kvbridge_roles::bootstrap::{
    BootstrapConfig, BootstrapLimits, BootstrapServer, DEFAULT_MAX_CONNECTIONS,
};

/// Where the bootstrap server listens.
#[derive(Debug, Args)]
pub struct BootstrapArgs {
    /// Address to listen on: an IP, or a host name (`localhost`) that
    /// resolves to one (the first address it resolves to is used).
    #[arg(long, default_value = "127.0.0.1")]
    host: String,
    /// Port to listen on; 0 picks a free one.
    #[arg(long, default_value_t = 8998)]
    port: u16,
    /// File with the cluster secret: writes must then be signed (else
    /// `KVBRIDGE_SECRET_FILE` / `KVBRIDGE_SECRET`; none: open mode).
    #[arg(long)]
    secret_file: Option<PathBuf>,
    /// Most connections served at once (idle ones are closed beyond).
    #[arg(long, default_value_t = DEFAULT_MAX_CONNECTIONS)]
    max_connections: usize,
}

/// Runs the server until a termination signal, then exits 0.
pub fn run(args: BootstrapArgs) -> ExitCode {
    let cleanup =
        kvbridge_roles::bootstrap::entry_cleanup_interval(&|name| std::env::var(name).ok());
    let secret = match ClusterSecret::load(args.secret_file.as_deref()) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("kvbridge bootstrap: {e}");
            return ExitCode::FAILURE;
        }
    };
    let config = BootstrapConfig {
        secret,
        cleanup_interval: cleanup,
        limits: BootstrapLimits {
            max_connections: args.max_connections,
            ..BootstrapLimits::default()
        },
    };
    let open = config.secret.is_none();
    // Before `listening on`: a supervisor may signal as soon as it reads it.
    let signals = match kvbridge_lab::signals::StopSignals::install() {
        Ok(s) => s,
        Err(e) => {
            eprintln!("kvbridge bootstrap: cannot handle signals: {e}");
            return ExitCode::FAILURE;
        }
    };
    let addr = match kvbridge_lab::net::first_addr((args.host.as_str(), args.port)) {
        Ok(a) => a,
        Err(e) => {
            eprintln!("kvbridge bootstrap: --host {}: {e}", args.host);
            return ExitCode::FAILURE;
        }
    };
    let server = match BootstrapServer::start_with(addr, config) {
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
    if open {
        // After the `listening on` line, which tools read as the first one.
        kvbridge_engine::secret::warn_open_mode("bootstrap (unsigned registrations accepted)");
    }
    let signal = signals.wait();
    tracing::info!(signal, "stopping bootstrap server");
    server.shutdown();
    ExitCode::SUCCESS
}
