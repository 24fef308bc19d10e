//! Where a demo runs: on loopback with the bootstrap server in the demo's
//! own process (the default), or with `--netns` as a small cluster on this
//! machine: a bootstrap host running `kvbridge bootstrap`, one host per
//! prefill rank and one per decode rank, each a network namespace with its
//! own address ([`super::netns`]).

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use kvbridge_roles::bootstrap::{BootstrapConfig, BootstrapServer, DEFAULT_ENTRY_CLEANUP_INTERVAL};

use super::DemoArgs;
use super::netns::{HOST_DEVICE, Hosts};
use super::plan::Plan;
use super::procs::Children;

/// The bootstrap server's port on its own host.
const BOOTSTRAP_PORT: u16 = 8998;
/// How long a bootstrap process may take to listen.
const BOOTSTRAP_START: Duration = Duration::from_secs(20);

/// The bootstrap server of a run.
enum Bootstrap {
    /// In the demo's process, on loopback.
    InProcess(BootstrapServer),
    /// `kvbridge bootstrap` on host 0 (`None` while stopped by a fault).
    Process(Option<Child>),
}

/// The hosts and bootstrap server of one demo run.
pub(super) struct Site {
    bootstrap: Bootstrap,
    addr: SocketAddr,
    secret: Option<kvbridge_engine::ClusterSecret>,
    hosts: Option<Hosts>,
    prefills: usize,
    /// After a role switch: prefill ranks on the decode hosts and back.
    swapped: bool,
}

/// Prefill and decode rank processes of a run of `args`.
pub(super) fn rank_counts(args: &DemoArgs) -> (usize, usize) {
    let prefills = args.dp * args.prefill_pp * args.prefill_cp * args.prefill_tp;
    (prefills as usize, args.decode_tp as usize)
}

impl Site {
    /// Starts the bootstrap server, on loopback or (`--netns`) on a host of
    /// its own among freshly made hosts for every rank.
    pub fn start(args: &DemoArgs, secret: Option<kvbridge_engine::ClusterSecret>) -> Result<Self> {
        if !args.netns {
            let server = BootstrapServer::start_with(
                "127.0.0.1:0".parse()?,
                BootstrapConfig {
                    secret: secret.clone(),
                    cleanup_interval: DEFAULT_ENTRY_CLEANUP_INTERVAL,
                    ..BootstrapConfig::default()
                },
            )
            .context("starting the bootstrap server")?;
            return Ok(Self {
                addr: server.local_addr(),
                bootstrap: Bootstrap::InProcess(server),
                secret,
                hosts: None,
                prefills: 0,
                swapped: false,
            });
        }
        let (prefills, decodes) = rank_counts(args);
        let hosts = Hosts::create(1 + prefills + decodes)
            .context("--netns: creating a host (network namespace) per rank; it needs root")?;
        let ip = hosts.host(0)?.ip.clone();
        let mut site = Self {
            addr: format!("{ip}:{BOOTSTRAP_PORT}").parse()?,
            bootstrap: Bootstrap::Process(None),
            secret,
            hosts: Some(hosts),
            prefills,
            swapped: false,
        };
        site.start_bootstrap()?;
        Ok(site)
    }

    /// Where the bootstrap server listens.
    pub fn bootstrap_addr(&self) -> SocketAddr {
        self.addr
    }

    /// The hosts, with `--netns`.
    pub fn hosts(&self) -> Option<&Hosts> {
        self.hosts.as_ref()
    }

    /// The host index of prefill rank `k` / decode rank `k`.
    pub fn host_of(&self, role: &str, k: usize) -> usize {
        match (role == "prefill") != self.swapped {
            true => 1 + k,
            false => 1 + self.prefills + k,
        }
    }

    /// Swaps the roles of the hosts (a role switch): from now on prefill
    /// rank `k` goes to the host decode rank `k` had, and back. Only with
    /// as many prefill as decode hosts.
    pub fn swap_roles(&mut self) -> Result<()> {
        let hosts = self.hosts.as_ref().context("a role switch needs --netns")?;
        if hosts.hosts.len() != 1 + 2 * self.prefills {
            bail!("a role switch needs as many prefill hosts as decode hosts");
        }
        self.swapped = !self.swapped;
        Ok(())
    }

    /// Puts every rank of `plan` on its host: its addresses, and the
    /// namespace `children` start it in. On loopback: nothing to do.
    pub fn place(&self, plan: &mut Plan, children: &mut Children) -> Result<()> {
        let Some(hosts) = &self.hosts else {
            return Ok(());
        };
        for (role, files) in [
            ("prefill", &mut plan.prefill_files),
            ("decode", &mut plan.decode_files),
        ] {
            for (k, file) in files.iter_mut().enumerate() {
                let host = hosts.host(self.host_of(role, k))?;
                file.engine.listen_host = host.ip.clone();
                file.prefill.local_ip = host.ip.clone();
                file.decode.local_ip = host.ip.clone();
                children.place(role, k as u64, &host.ns);
            }
        }
        // UCX over the hosts' own interface (and TCP: no shared memory
        // between hosts that only share a kernel).
        children.set_env("UCX_NET_DEVICES", HOST_DEVICE);
        children.set_env("UCX_TLS", "tcp");
        Ok(())
    }

    /// Starts (or restarts, after [`Site::stop_bootstrap`]) the bootstrap
    /// process on host 0 and waits until it listens.
    pub fn start_bootstrap(&mut self) -> Result<()> {
        let Some(hosts) = &self.hosts else {
            bail!("only a --netns bootstrap server runs as a process");
        };
        let host = hosts.host(0)?;
        let exe = std::env::current_exe().context("locating the kvbridge binary")?;
        let mut cmd = Command::new("ip");
        cmd.args(["netns", "exec", &host.ns])
            .arg(exe)
            .args(["bootstrap", "--host", &host.ip, "--port"])
            .arg(BOOTSTRAP_PORT.to_string())
            .env_remove(kvbridge_engine::secret::SECRET_FILE_ENV)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped());
        match &self.secret {
            Some(s) => cmd.env(kvbridge_engine::secret::SECRET_ENV, s.to_env_value()),
            None => cmd.env_remove(kvbridge_engine::secret::SECRET_ENV),
        };
        let deadline = Instant::now() + BOOTSTRAP_START;
        loop {
            let mut child = cmd.spawn().context("starting the bootstrap process")?;
            let stderr = child.stderr.take().context("bootstrap stderr")?;
            let mut lines = BufReader::new(stderr).lines();
            let listening = lines
                .by_ref()
                .map_while(Result::ok)
                .any(|l| l.starts_with("listening on"));
            if listening {
                // Drain the rest so the process never blocks on a full pipe.
                std::thread::spawn(move || for _ in lines {});
                self.bootstrap = Bootstrap::Process(Some(child));
                return Ok(());
            }
            let _ = child.wait();
            // A restart can find the old socket's port still in TIME_WAIT.
            if Instant::now() >= deadline {
                bail!("the bootstrap process on {} did not start", host.ns);
            }
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    /// Stops the bootstrap process (SIGKILL), as a host that goes down.
    pub fn stop_bootstrap(&mut self) {
        if let Bootstrap::Process(Some(mut child)) =
            std::mem::replace(&mut self.bootstrap, Bootstrap::Process(None))
        {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Every host's interface counters, with `--netns` (else none).
    pub fn traffic(&self) -> Vec<super::netns::Traffic> {
        let Some(hosts) = &self.hosts else {
            return Vec::new();
        };
        let decodes = hosts.hosts.len().saturating_sub(1 + self.prefills);
        // A host that switched roles is labelled with both, in order.
        let label = |role: &str, other: &str, k: usize| match self.swapped {
            true => format!("{role} {k}, then {other} {k}"),
            false => format!("{role} {k}"),
        };
        let labels = std::iter::once("bootstrap".to_owned())
            .chain((0..self.prefills).map(|k| label("prefill", "decode", k)))
            .chain((0..decodes).map(|k| label("decode", "prefill", k)));
        labels
            .enumerate()
            .filter_map(|(i, label)| hosts.traffic(i, label).ok())
            .collect()
    }

    /// Cuts or restores the link between prefill rank 0's host and decode
    /// rank 0's host.
    pub fn partition(&self, cut: bool) -> Result<()> {
        let hosts = self.hosts.as_ref().context("a partition needs --netns")?;
        hosts.partition(self.host_of("prefill", 0), self.host_of("decode", 0), cut)
    }

    /// Stops the bootstrap server; the hosts go when the site is dropped.
    pub fn shutdown(mut self) {
        if matches!(self.bootstrap, Bootstrap::InProcess(_))
            && let Bootstrap::InProcess(server) =
                std::mem::replace(&mut self.bootstrap, Bootstrap::Process(None))
        {
            server.shutdown();
        }
        // A bootstrap process is stopped by `Drop`.
    }
}

impl Drop for Site {
    fn drop(&mut self) {
        self.stop_bootstrap();
    }
}
