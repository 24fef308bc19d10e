//! Scripted faults of a demo run (`--fault KIND --fault-after N
//! --fault-secs S`): once decode rank 0 has concluded N rooms, the fault
//! starts; S seconds later it is undone. What the rooms did meanwhile goes
//! into the summary, for a test to hold against the expected outcome.

use std::process::Command;
use std::time::Instant;

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
}

/// What happened around one fault.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct FaultReport {
    /// The fault.
    pub kind: FaultKind,
    /// Whether it was started (the run had enough rooms).
    pub injected: bool,
    /// Decode rank 0's rooms concluded before it started.
    pub after_rooms: u64,
    /// How long it lasted, seconds.
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
    Waiting,
    Active(Instant),
    Undone,
}

/// One scripted fault and what the rooms did around it.
#[derive(Debug)]
pub(super) struct Fault {
    after: u64,
    secs: f64,
    phase: Phase,
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
    /// A fault of `kind` after decode rank 0's `after`-th room, for `secs`.
    pub(super) fn new(kind: FaultKind, after: u64, secs: f64) -> Self {
        Self {
            after,
            secs,
            phase: Phase::Waiting,
            report: FaultReport {
                kind,
                injected: false,
                after_rooms: after,
                seconds: 0.0,
                failed_from_start: 0,
                succeeded_during: 0,
                succeeded_after: 0,
                reasons: Vec::new(),
            },
        }
    }

    /// Checks that the run can host the fault.
    pub(super) fn check(kind: FaultKind, netns: bool) -> Result<()> {
        if matches!(kind, FaultKind::Partition | FaultKind::BootstrapDown) && !netns {
            bail!("--fault {kind:?} needs --netns (hosts with their own links)");
        }
        Ok(())
    }

    /// Decode rank 0 has concluded `done` rooms: starts the fault when due.
    pub(super) fn progress(
        &mut self,
        done: u64,
        site: &mut Site,
        children: &Children,
        decode0: ChildId,
    ) -> Result<()> {
        if !matches!(self.phase, Phase::Waiting) || done < self.after {
            return Ok(());
        }
        match self.report.kind {
            FaultKind::Partition => site.partition(true)?,
            FaultKind::StopDecode => {
                signal(children.pid(decode0).context("decode rank 0")?, "STOP")?;
            }
            FaultKind::BootstrapDown => site.stop_bootstrap(),
        }
        tracing::info!(kind = ?self.report.kind, "fault started");
        self.report.injected = true;
        self.phase = Phase::Active(Instant::now());
        Ok(())
    }

    /// Undoes the fault once it has lasted its time.
    pub(super) fn tick(
        &mut self,
        site: &mut Site,
        children: &Children,
        decode0: ChildId,
    ) -> Result<()> {
        let Phase::Active(since) = self.phase else {
            return Ok(());
        };
        if since.elapsed().as_secs_f64() < self.secs {
            return Ok(());
        }
        self.undo(site, children, decode0)?;
        self.report.seconds = since.elapsed().as_secs_f64();
        Ok(())
    }

    fn undo(&mut self, site: &mut Site, children: &Children, decode0: ChildId) -> Result<()> {
        self.phase = Phase::Undone;
        match self.report.kind {
            FaultKind::Partition => site.partition(false)?,
            FaultKind::StopDecode => {
                signal(children.pid(decode0).context("decode rank 0")?, "CONT")?;
            }
            FaultKind::BootstrapDown => site.start_bootstrap()?,
        }
        tracing::info!(kind = ?self.report.kind, "fault undone");
        Ok(())
    }

    /// A decode room concluded.
    pub(super) fn observe(&mut self, success: bool, reason: Option<&str>) {
        let r = &mut self.report;
        match (self.phase, success) {
            (Phase::Waiting, _) => {}
            (Phase::Active(_), true) => r.succeeded_during += 1,
            (Phase::Undone, true) => r.succeeded_after += 1,
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
        if let Phase::Active(since) = self.phase {
            if let Err(e) = self.undo(site, children, decode0) {
                tracing::warn!("undoing the fault at the end: {e:#}");
            }
            self.report.seconds = since.elapsed().as_secs_f64();
        }
        self.report
    }
}
