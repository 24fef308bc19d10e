//! `kvbridge`: the command-line tool over the kvbridge crates.
//!
//! Each subcommand lives in its own module; `main` only parses arguments,
//! sets up logging (to stderr; stdout is reserved for machine-readable
//! output) and dispatches.

use std::process::ExitCode;

use clap::{Parser, Subcommand};

mod bench_cmd;
mod bootstrap_cmd;
mod plan_cmd;
mod wire_cmd;

use kvbridge_lab::{demo, rank};

/// What `kvbridge --help` prints under the commands.
const AFTER_HELP: &str = "\
Results go to stdout, logs and progress to stderr. Logs are filtered by
KVBRIDGE_LOG (else RUST_LOG; default warn), e.g. KVBRIDGE_LOG=info.
Throughput is in GB/s: 10^9 bytes per second.
Start with `kvbridge demo`; every command has --help. The repository's docs/
folder has the details (cli.md, roles.md, observability.md, deploying.md).";

/// Moves the KV cache of LLM requests from prefill GPUs to decode GPUs.
#[derive(Debug, Parser)]
#[command(
    name = "kvbridge",
    version,
    about = "Moves the KV cache of LLM requests from prefill GPUs to decode GPUs",
    after_help = AFTER_HELP
)]
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

/// Environment variable with kvbridge's log filter (`tracing` syntax);
/// `RUST_LOG` is read when it is unset.
const LOG_ENV: &str = "KVBRIDGE_LOG";

/// Logs to stderr, filtered by `KVBRIDGE_LOG`, else `RUST_LOG`, else
/// `warn`; colour only when stderr is a terminal and `NO_COLOR` is unset.
/// `stages` also records the roles' room stages (`bench roles --stages`).
fn init_logging(stages: bool) {
    use tracing_subscriber::layer::SubscriberExt;
    use tracing_subscriber::util::SubscriberInitExt;
    use tracing_subscriber::{EnvFilter, Layer};
    let mut complaint = None;
    let mut filter = None;
    for var in [LOG_ENV, "RUST_LOG"] {
        let Some(value) = std::env::var_os(var) else {
            continue;
        };
        match EnvFilter::try_new(value.to_string_lossy()) {
            Ok(f) => filter = Some(f),
            Err(e) => complaint = Some(format!("{var} is not a log filter ({e}); using warn")),
        }
        break;
    }
    let stderr = std::io::stderr();
    let ansi = std::io::IsTerminal::is_terminal(&stderr) && std::env::var_os("NO_COLOR").is_none();
    let fmt = tracing_subscriber::fmt::layer()
        .with_writer(std::io::stderr)
        .with_ansi(ansi)
        .with_filter(filter.unwrap_or_else(|| EnvFilter::new("warn")));
    let stages = stages.then(bench_cmd::roles::stages::layer);
    let _ = tracing_subscriber::registry()
        .with(fmt)
        .with(stages)
        .try_init();
    if let Some(complaint) = complaint {
        tracing::warn!("{complaint}");
    }
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let stages = matches!(
        &cli.command,
        Command::Bench(bench_cmd::BenchCommand::Roles(args)) if args.stages
    );
    init_logging(stages);
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
