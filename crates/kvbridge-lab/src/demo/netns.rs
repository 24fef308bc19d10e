//! Hosts on one machine for `kvbridge demo --netns`: one Linux network
//! namespace per host, each with its own address on a veth pair joined to a
//! bridge, reachable only from the others (the bridge itself has no
//! address). Links between two hosts can be cut and restored. Everything is
//! removed on drop, and namespaces left by a run that was killed are
//! removed by the next one.
//!
//! Who owns what: each run holds an exclusive lock on an owner file
//! (`/run/kvbridge-netns/<tag>`) for as long as it lives. The kernel drops
//! the lock when the process dies, however it dies, and the lock means the
//! same in every PID namespace, so a run judges another run's leftovers by
//! that lock, never by a process id (which names another process, or none,
//! in another PID namespace). Names without an owner file are left alone.
//!
//! Needs root and `ip` (iproute2).

use std::fs::{File, OpenOptions, TryLockError};
use std::path::PathBuf;
use std::process::Command;

use anyhow::{Context, Result, bail};

/// The prefix of every name this module creates.
const PREFIX: &str = "kvbns";

/// Where the owner files live (shared by every PID namespace that shares
/// `/run`, as `ip netns` itself needs).
const OWNERS: &str = "/run/kvbridge-netns";

/// A run's claim on its tag: the locked owner file, unlocked and removed
/// on drop (or unlocked by the kernel if the run is killed).
#[derive(Debug)]
struct Owner {
    path: PathBuf,
    _file: File,
}

impl Owner {
    /// Claims `tag`; fails if a live run (in any PID namespace) holds it.
    fn claim(tag: &str) -> Result<Self> {
        std::fs::create_dir_all(OWNERS).with_context(|| format!("creating {OWNERS}"))?;
        let path = PathBuf::from(OWNERS).join(tag);
        let file = OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&path)
            .with_context(|| format!("opening {}", path.display()))?;
        match file.try_lock() {
            Ok(()) => Ok(Self { path, _file: file }),
            Err(TryLockError::WouldBlock) => bail!(
                "network namespace names {tag}* belong to a live run in another PID namespace \
                 (its owner file {} is locked); run again",
                path.display()
            ),
            Err(TryLockError::Error(e)) => {
                Err(e).with_context(|| format!("locking {}", path.display()))
            }
        }
    }
}

impl Drop for Owner {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

/// What is known of the run that made names tagged `tag`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Owned {
    /// Its owner file is locked: the run is alive.
    Live,
    /// Its owner file is unlocked: the run is gone.
    Gone,
    /// No owner file: not ours to judge (another tool, an older kvbridge).
    Unknown,
}

fn owned(tag: &str) -> Owned {
    let path = PathBuf::from(OWNERS).join(tag);
    let Ok(file) = File::open(&path) else {
        return Owned::Unknown;
    };
    match file.try_lock() {
        Ok(()) => Owned::Gone,
        Err(_) => Owned::Live,
    }
}

/// One host: a namespace, its address, its interface inside.
#[derive(Debug, Clone)]
pub struct Host {
    /// The namespace's name (`ip netns exec <ns> ...`).
    pub ns: String,
    /// The host's IPv4 address.
    pub ip: String,
}

/// The interface every host has inside its namespace (`UCX_NET_DEVICES`).
pub const HOST_DEVICE: &str = "eth0";

/// The hosts of one run and their bridge.
#[derive(Debug)]
pub struct Hosts {
    bridge: String,
    /// The hosts, in creation order.
    pub hosts: Vec<Host>,
    /// The claim on this run's names (released after the drop below).
    _owner: Owner,
}

/// Runs `ip args...`; the error names the command and what `ip` said.
fn ip(args: &[&str]) -> Result<()> {
    let out = Command::new("ip")
        .args(args)
        .output()
        .context("running `ip` (iproute2 is needed for --netns)")?;
    if !out.status.success() {
        bail!(
            "`ip {}` failed: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(())
}

/// Removes namespaces, bridges and veths of earlier runs that are gone (a
/// run killed with SIGKILL cannot clean up after itself). Names whose run
/// is alive, or whose owner is unknown, are left, the latter with one line.
fn remove_stale() {
    let listed = Command::new("ip").args(["-o", "link", "show"]).output();
    let netns = Command::new("ip").args(["netns", "list"]).output();
    let tag_of = |name: &str| -> Option<String> {
        let rest = name.strip_prefix(PREFIX)?;
        let digits: String = rest.chars().take_while(char::is_ascii_digit).collect();
        (!digits.is_empty()).then(|| format!("{PREFIX}{digits}"))
    };
    let mut names = Vec::new();
    if let Ok(out) = netns {
        for line in String::from_utf8_lossy(&out.stdout).lines() {
            let name = line.split_whitespace().next().unwrap_or("");
            names.push((true, name.to_owned()));
        }
    }
    if let Ok(out) = listed {
        for line in String::from_utf8_lossy(&out.stdout).lines() {
            // "7: kvbns123b: <...>" or "8: kvbns123v0@if2: <...>"
            let name = line.split(':').nth(1).unwrap_or("").trim();
            let name = name.split('@').next().unwrap_or("");
            names.push((false, name.to_owned()));
        }
    }
    let mut gone = Vec::new();
    let mut unknown = Vec::new();
    for (is_ns, name) in names {
        let Some(tag) = tag_of(&name) else { continue };
        match owned(&tag) {
            Owned::Live => {}
            Owned::Gone => {
                let _ = if is_ns {
                    ip(&["netns", "del", &name])
                } else {
                    ip(&["link", "del", &name])
                };
                gone.push(tag);
            }
            Owned::Unknown => unknown.push(name),
        }
    }
    gone.sort();
    gone.dedup();
    for tag in gone {
        let _ = std::fs::remove_file(PathBuf::from(OWNERS).join(tag));
    }
    if !unknown.is_empty() {
        tracing::warn!(
            names = ?unknown,
            "leaving network namespaces/links with no owner file in {OWNERS} (not known to be \
             stale); remove them with `ip netns del` / `ip link del` if no run uses them"
        );
    }
}

impl Hosts {
    /// Creates `n` hosts on a fresh bridge, on a /24 of 10.0.0.0/8 chosen
    /// from this process id.
    pub fn create(n: usize) -> Result<Self> {
        if n == 0 || n > 200 {
            bail!("--netns needs 1 to 200 hosts, not {n}");
        }
        let pid = std::process::id();
        let tag = format!("{PREFIX}{pid}");
        let owner = Owner::claim(&tag)?;
        remove_stale();
        let bridge = format!("{tag}b");
        if bridge.len() > 15 {
            bail!("interface name {bridge} too long");
        }
        let subnet = format!("10.{}.{}", 100 + (pid >> 8) % 100, pid & 0xff);
        let mut hosts = Hosts {
            bridge: bridge.clone(),
            hosts: Vec::new(),
            _owner: owner,
        };
        ip(&["link", "add", &bridge, "type", "bridge"])?;
        ip(&["link", "set", &bridge, "up"])?;
        for i in 0..n {
            let ns = format!("{tag}h{i}");
            let outside = format!("{tag}v{i}");
            let inside = format!("{tag}p{i}");
            let addr = format!("{subnet}.{}", i + 10);
            ip(&["netns", "add", &ns])?;
            hosts.hosts.push(Host {
                ns: ns.clone(),
                ip: addr.clone(),
            });
            ip(&[
                "link", "add", &outside, "type", "veth", "peer", "name", &inside,
            ])?;
            ip(&["link", "set", &inside, "netns", &ns])?;
            ip(&["-n", &ns, "link", "set", &inside, "name", HOST_DEVICE])?;
            ip(&["link", "set", &outside, "master", &bridge])?;
            ip(&["link", "set", &outside, "up"])?;
            ip(&[
                "-n",
                &ns,
                "addr",
                "add",
                &format!("{addr}/24"),
                "dev",
                HOST_DEVICE,
            ])?;
            ip(&["-n", &ns, "link", "set", HOST_DEVICE, "up"])?;
            ip(&["-n", &ns, "link", "set", "lo", "up"])?;
        }
        Ok(hosts)
    }

    /// Host `i`.
    pub fn host(&self, i: usize) -> Result<&Host> {
        self.hosts.get(i).with_context(|| format!("no host {i}"))
    }

    /// Cuts (`cut`) or restores the link between hosts `a` and `b` in both
    /// directions: packets between their addresses are dropped by a
    /// blackhole route on each side; every other pair still talks.
    pub fn partition(&self, a: usize, b: usize, cut: bool) -> Result<()> {
        let (ha, hb) = (self.host(a)?, self.host(b)?);
        let verb = if cut { "add" } else { "del" };
        ip(&[
            "-n",
            &ha.ns,
            "route",
            verb,
            "blackhole",
            &format!("{}/32", hb.ip),
        ])?;
        ip(&[
            "-n",
            &hb.ns,
            "route",
            verb,
            "blackhole",
            &format!("{}/32", ha.ip),
        ])?;
        Ok(())
    }
}

/// Bytes a host's interface received and sent.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct Traffic {
    /// What runs there (`bootstrap`, `prefill 0`, `decode 1`).
    pub host: String,
    /// Its address.
    pub ip: String,
    /// Bytes in and out of its interface.
    pub rx_bytes: u64,
    pub tx_bytes: u64,
}

impl Hosts {
    /// The bytes host `i`'s interface received and sent so far (the proof
    /// that a transfer crossed between hosts).
    pub fn traffic(&self, i: usize, label: String) -> Result<Traffic> {
        let host = self.host(i)?;
        let out = Command::new("ip")
            .args([
                "-j",
                "-s",
                "-n",
                &host.ns,
                "link",
                "show",
                "dev",
                HOST_DEVICE,
            ])
            .output()
            .context("running `ip -s link`")?;
        let v: serde_json::Value =
            serde_json::from_slice(&out.stdout).context("reading `ip -j -s link` output")?;
        let stats = &v[0]["stats64"];
        Ok(Traffic {
            host: label,
            ip: host.ip.clone(),
            rx_bytes: stats["rx"]["bytes"].as_u64().unwrap_or(0),
            tx_bytes: stats["tx"]["bytes"].as_u64().unwrap_or(0),
        })
    }
}

impl Drop for Hosts {
    fn drop(&mut self) {
        for h in &self.hosts {
            let _ = ip(&["netns", "del", &h.ns]);
        }
        // Deleting a namespace deletes its veth ends, and with them the
        // outside ends; the bridge goes last.
        let _ = ip(&["link", "del", &self.bridge]);
    }
}
