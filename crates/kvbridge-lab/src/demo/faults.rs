//! Scripted faults of a demo run (`--fault KIND --fault-after N
//! --fault-secs S`): once decode rank 0 has concluded N rooms, the fault
//! starts; S seconds later it is undone. With `--fault-every T` another
//! one follows T seconds (half to one and a half times T) after each is
//! undone, until the run ends (`--fault random` picks each one's kind).
//! What the rooms did meanwhile goes into the summary, for a test to hold
//! against the expected outcome.

use std::collections::BTreeMap;
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use serde::Serialize;

use super::procs::{ChildId, Children};
use super::site::Site;

/// The faults a run can script.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, clap::ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub enum FaultKind {
    /// Cut the link between prefill rank 0's host and decode rank 0's host
    /// (`--netns`); every other pair still talks.
    Partition,
    /// Stop decode rank 0 (SIGSTOP), then let it go on (SIGCONT).
    StopDecode,
    /// Take the bootstrap host down (SIGKILL), then start it again on the
    /// same address (`--netns`).
    BootstrapDown,
    /// Each time one of the above, at random (those that need `--netns`
    /// only with it).
    Random,
    /// Under load, swap the roles of the hosts (`--netns`, as many prefill
    /// as decode ranks): the rooms in flight finish, every prefill host
    /// starts a decode rank and every decode host a prefill rank, each on
    /// the address and engine port the other role had, and the rest of the
    /// workload runs the other way.
    RoleSwitch,
}

/// What happened around one fault.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct FaultReport {
    /// The fault.
    pub kind: FaultKind,
    /// Whether it was started (the run had enough rooms).
    pub injected: bool,
    /// How many times it was started, by kind.
    pub by_kind: BTreeMap<String, u64>,
    /// Decode rank 0's rooms concluded before it started.
    pub after_rooms: u64,
    /// How long it lasted, seconds (all its times together).
    pub seconds: f64,
    /// Room outcomes (one per room and decode rank) that failed from its
    /// start on.
    pub failed_from_start: u64,
    /// Room outcomes that succeeded while it lasted.
    pub succeeded_during: u64,
    /// Room outcomes that succeeded after it was undone.
    pub succeeded_after: u64,
    /// The distinct failure reasons seen from its start on (at most 5).
    pub reasons: Vec<String>,
}

#[derive(Debug, Clone, Copy)]
enum Phase {
    /// Until decode rank 0's `after`-th room.
    Waiting,
    /// Started then, as this kind.
    Active(Instant, FaultKind),
    /// Undone; the next one (`--fault-every`) starts at the instant given.
    Undone(Option<Instant>),
}

/// One scripted fault and what the rooms did around it.
#[derive(Debug)]
pub(super) struct Fault {
    after: u64,
    secs: f64,
    every: Option<f64>,
    netns: bool,
    rng: u64,
    phase: Phase,
    /// A role switch was handed to the run (`switch_due` said so).
    switch_begun: bool,
    report: FaultReport,
}

/// Sends `signal` (`STOP`, `CONT`) to process `pid`.
fn signal(pid: u32, signal: &str) -> Result<()> {
    let status = Command::new("kill")
        .arg(format!("-{signal}"))
        .arg(pid.to_string())
        .status()
        .context("running kill")?;
    if !status.success() {
        bail!("kill -{signal} {pid} failed");
    }
    Ok(())
}

impl Fault {
    /// A fault of `kind` after decode rank 0's `after`-th room, for
    /// `secs`, again `every` seconds after each time it is undone; `netns`
    /// says whether the run has hosts (what `Random` may pick).
    pub(super) fn new(
        kind: FaultKind,
        after: u64,
        secs: f64,
        every: Option<f64>,
        netns: bool,
        seed: u64,
    ) -> Self {
        Self {
            after,
            secs,
            every,
            netns,
            rng: seed | 1,
            phase: Phase::Waiting,
            switch_begun: false,
            report: FaultReport {
                kind,
                injected: false,
                by_kind: BTreeMap::new(),
                after_rooms: after,
                seconds: 0.0,
                failed_from_start: 0,
                succeeded_during: 0,
                succeeded_after: 0,
                reasons: Vec::new(),
            },
        }
    }

    /// The next pseudo-random number (xorshift).
    fn next_random(&mut self) -> u64 {
        self.rng ^= self.rng << 13;
        self.rng ^= self.rng >> 7;
        self.rng ^= self.rng << 17;
        self.rng
    }

    /// The kind to start now.
    fn pick(&mut self) -> FaultKind {
        if self.report.kind != FaultKind::Random {
            return self.report.kind;
        }
        let kinds: &[FaultKind] = if self.netns {
            &[
                FaultKind::Partition,
                FaultKind::StopDecode,
                FaultKind::BootstrapDown,
            ]
        } else {
            &[FaultKind::StopDecode]
        };
        kinds[(self.next_random() % kinds.len() as u64) as usize]
    }

    /// Checks that a run with `prefills` and `decodes` rank processes can
    /// host the fault.
    pub(super) fn check(
        kind: FaultKind,
        netns: bool,
        prefills: usize,
        decodes: usize,
    ) -> Result<()> {
        let needs_hosts = matches!(
            kind,
            FaultKind::Partition | FaultKind::BootstrapDown | FaultKind::RoleSwitch
        );
        if needs_hosts && !netns {
            bail!("--fault {kind:?} needs --netns (hosts with their own links)");
        }
        if kind == FaultKind::RoleSwitch && prefills != decodes {
            bail!(
                "--fault role-switch swaps prefill and decode hosts one for one: it needs as \
                 many prefill rank processes as decode ranks ({prefills} and {decodes})"
            );
        }
        Ok(())
    }

    /// Whether a role switch is due and not yet handed to the run (true once).
    pub(super) fn switch_due(&mut self) -> bool {
        let due = matches!(self.phase, Phase::Active(_, FaultKind::RoleSwitch));
        let first = due && !self.switch_begun;
        self.switch_begun |= due;
        first
    }

    /// The role switch is done: the new ranks are ready.
    pub(super) fn switched(&mut self) {
        if let Phase::Active(since, FaultKind::RoleSwitch) = self.phase {
            self.report.seconds += since.elapsed().as_secs_f64();
            self.phase = Phase::Undone(None);
            tracing::info!("role switch done");
        }
    }

    /// Starts no further fault (the run is draining); one under way is
    /// still undone in its time.
    pub(super) fn no_more(&mut self) {
        self.every = None;
        if let Phase::Waiting | Phase::Undone(Some(_)) = self.phase {
            self.phase = Phase::Undone(None);
        }
    }

    /// Decode rank 0 has concluded `done` rooms: starts the fault when due.
    pub(super) fn progress(
        &mut self,
        done: u64,
        site: &mut Site,
        children: &Children,
        decode0: ChildId,
    ) -> Result<()> {
        if matches!(self.phase, Phase::Waiting) && done >= self.after {
            self.start(site, children, decode0)?;
        }
        Ok(())
    }

    fn start(&mut self, site: &mut Site, children: &Children, decode0: ChildId) -> Result<()> {
        let kind = self.pick();
        match kind {
            FaultKind::Partition => site.partition(true)?,
            FaultKind::StopDecode => {
                // Decode rank 0 may have finished its rooms and exited:
                // nothing left to stop, and no reason to end the run.
                let stopped = children
                    .pid(decode0)
                    .is_some_and(|pid| signal(pid, "STOP").is_ok());
                if !stopped {
                    tracing::info!("decode rank 0 has exited; no fault to start");
                    self.phase = Phase::Undone(None);
                    return Ok(());
                }
            }
            FaultKind::BootstrapDown => site.stop_bootstrap(),
            // The run drains and swaps the ranks (`switch_due`).
            FaultKind::RoleSwitch => {}
            FaultKind::Random => bail!("no fault kind picked"),
        }
        tracing::info!(?kind, "fault started");
        self.report.injected = true;
        *self.report.by_kind.entry(format!("{kind:?}")).or_default() += 1;
        self.phase = Phase::Active(Instant::now(), kind);
        Ok(())
    }

    /// Undoes the fault once it has lasted its time, and starts the next
    /// one (`--fault-every`) when that is due.
    pub(super) fn tick(
        &mut self,
        site: &mut Site,
        children: &Children,
        decode0: ChildId,
    ) -> Result<()> {
        match self.phase {
            Phase::Active(since, kind)
                if kind != FaultKind::RoleSwitch && since.elapsed().as_secs_f64() >= self.secs =>
            {
                self.undo(site, children, decode0)
            }
            Phase::Undone(Some(at)) if Instant::now() >= at => self.start(site, children, decode0),
            _ => Ok(()),
        }
    }

    fn undo(&mut self, site: &mut Site, children: &Children, decode0: ChildId) -> Result<()> {
        let Phase::Active(since, kind) = self.phase else {
            return Ok(());
        };
        let next = self.every.map(|every| {
            let spread = (self.next_random() % 1000) as f64 / 1000.0 + 0.5;
            Instant::now() + Duration::from_secs_f64(every * spread)
        });
        self.phase = Phase::Undone(next);
        self.report.seconds += since.elapsed().as_secs_f64();
        match kind {
            FaultKind::Partition => site.partition(false)?,
            FaultKind::StopDecode => {
                // Gone meanwhile (killed at the end of the run): nothing to resume.
                if let Some(pid) = children.pid(decode0)
                    && let Err(e) = signal(pid, "CONT")
                {
                    tracing::info!("resuming decode rank 0: {e:#}");
                }
            }
            FaultKind::BootstrapDown => site.start_bootstrap()?,
            FaultKind::RoleSwitch | FaultKind::Random => {}
        }
        tracing::info!(?kind, "fault undone");
        Ok(())
    }

    /// A decode room concluded.
    pub(super) fn observe(&mut self, success: bool, reason: Option<&str>) {
        let r = &mut self.report;
        match (self.phase, success) {
            (Phase::Waiting, _) => {}
            (Phase::Active(..), true) => r.succeeded_during += 1,
            (Phase::Undone(_), true) => r.succeeded_after += 1,
            (_, false) => {
                r.failed_from_start += 1;
                let reason = reason.unwrap_or("(no reason)").to_owned();
                if r.reasons.len() < 5 && !r.reasons.contains(&reason) {
                    r.reasons.push(reason);
                }
            }
        }
    }

    /// The report; a fault still active when the run ends is undone first.
    pub(super) fn finish(
        mut self,
        site: &mut Site,
        children: &Children,
        decode0: ChildId,
    ) -> FaultReport {
        if let Err(e) = self.undo(site, children, decode0) {
            tracing::warn!("undoing the fault at the end: {e:#}");
        }
        self.report
    }
}
