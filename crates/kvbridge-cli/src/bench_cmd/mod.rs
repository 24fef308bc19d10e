//! `kvbridge bench`: throughput measurements of the transfer engines.

use std::process::ExitCode;

use clap::{Args, Subcommand};

mod child;
mod control_auth;
#[cfg(feature = "cuda")]
mod ipc;
#[cfg(feature = "cuda")]
mod ipc_layout;
mod measure;
mod plot;
pub(crate) mod roles;
mod size;
mod tcp;
#[cfg(feature = "ucx")]
mod ucx;

/// Benchmarks of the transfer engines.
#[derive(Debug, Subcommand)]
pub enum BenchCommand {
    /// TCP engine between two processes: a target that registers a host
    /// buffer and an initiator that writes into it, per block size. On
    /// loopback by default; `--listen` / `--connect` put the two on two
    /// machines.
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
    /// Rooms through a real prefill and decode role pair (planner, pipeline,
    /// control plane) against the same bytes through the raw engine, in one
    /// run, alternated, per room size.
    Roles(roles::RolesArgs),
}

/// Run a bench subcommand.
pub fn run(cmd: BenchCommand) -> ExitCode {
    let r = match cmd {
        BenchCommand::Tcp(args) => tcp::run(args),
        #[cfg(feature = "cuda")]
        BenchCommand::Ipc(args) => ipc::run(args),
        #[cfg(feature = "ucx")]
        BenchCommand::Ucx(args) => ucx::run(args),
        BenchCommand::Roles(args) => roles::run(args),
    };
    match r {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("kvbridge bench: {e:#}");
            ExitCode::FAILURE
        }
    }
}

/// Where the two ends of a bench run.
#[derive(Debug, Clone, Default, Args)]
pub struct PeerArgs {
    /// Be the target on this machine: register the buffer and serve
    /// initiators connecting to ADDR (`host:port`, a specific IP or name)
    /// one after another, until stopped. The engine listens on the same host.
    #[arg(long, value_name = "ADDR", conflicts_with = "connect")]
    pub listen: Option<String>,
    /// Be the initiator against a target started elsewhere with `--listen
    /// ADDR`, instead of spawning one on loopback. Both ends need the same
    /// engine options (and `--auth` with the same secret).
    #[arg(long, value_name = "ADDR")]
    pub connect: Option<String>,
}

impl PeerArgs {
    /// The host this end's engine listens on (and advertises): the
    /// `--listen` host, the local address that routes to the `--connect`
    /// target, or loopback.
    pub fn engine_host(&self) -> anyhow::Result<String> {
        use anyhow::{Context, bail};
        if let Some(addr) = &self.listen {
            let ip = child::resolve(addr)?.ip();
            if ip.is_unspecified() {
                bail!(
                    "--listen {addr}: give this machine's address that initiators reach, \
                     not a wildcard (the engine advertises it)"
                );
            }
            return Ok(ip.to_string());
        }
        if let Some(addr) = &self.connect {
            let to = child::resolve(addr)?;
            let any: std::net::SocketAddr = if to.is_ipv4() {
                "0.0.0.0:0".parse()?
            } else {
                "[::]:0".parse()?
            };
            // No packet is sent: connecting a UDP socket only picks the route.
            let probe = std::net::UdpSocket::bind(any)?;
            probe
                .connect(to)
                .with_context(|| format!("no route to {addr}"))?;
            return Ok(probe.local_addr()?.ip().to_string());
        }
        Ok("127.0.0.1".into())
    }

    /// Whether this process is a target (spawned with `--serve`, or `--listen`).
    pub fn is_target(&self, serve: bool) -> bool {
        serve || self.listen.is_some()
    }

    /// Where the target takes commands from; over `--listen`, initiators
    /// must prove `secret` (the bench's `--auth` secret).
    fn control(&self, secret: Option<&str>) -> anyhow::Result<child::Control> {
        child::Control::new(self.listen.as_deref(), secret)
    }

    /// The initiator's target: the `--connect` one (proving `secret`), else
    /// `spawn()`ed.
    fn target(
        &self,
        bytes: u64,
        secret: Option<&str>,
        spawn: impl FnOnce() -> anyhow::Result<child::Target>,
    ) -> anyhow::Result<child::Target> {
        match &self.connect {
            Some(addr) => child::Target::connect(addr, bytes, secret),
            None => spawn(),
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
