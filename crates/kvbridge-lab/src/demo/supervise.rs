//! The run itself: the supervisor starts the ranks, steers drains, role
//! switches, faults and the decode kill, reads every rank's events until
//! each finished, and tallies the summary.

use std::collections::{HashMap, HashSet};
use std::time::{Duration, Instant};

use anyhow::{Result, bail};
use indicatif::{ProgressBar, ProgressStyle};

use super::args::DemoArgs;
use super::drain::{Drain, Purpose};
use super::faults::Fault;
use super::plan::Plan;
use super::procs::{ChildId, Children, Ranks};
use super::resources::Sampler;
use super::site::Site;
use super::summary::Summary;
use super::tally::{self, Outcome};
use super::{restart_decode0, rogue, split_rooms_of_decode0, switch};
use crate::rank::events::Event;

/// What the supervisor heard: every room's outcome per rank, the rooms
/// each decode rank started, and the run's window.
#[derive(Debug)]
struct Ledger {
    decode: HashMap<(u64, u64), Outcome>,
    prefill: HashMap<(u64, u64), Outcome>,
    started: HashMap<u64, HashSet<u64>>,
    /// When the first room started, as this loop saw it.
    first_start: Option<Instant>,
    last_done: Instant,
    /// The same window on the ranks' shared clock (Unix ms): events reach
    /// this loop late when the host is busy, the ranks' stamps do not.
    first_start_ms: f64,
    last_done_ms: f64,
    /// Decode rank 0's rooms concluded (what faults count from).
    rank0_done: u64,
}

impl Ledger {
    fn new() -> Self {
        Self {
            decode: HashMap::new(),
            prefill: HashMap::new(),
            started: HashMap::new(),
            first_start: None,
            last_done: Instant::now(),
            first_start_ms: f64::INFINITY,
            last_done_ms: 0.0,
            rank0_done: 0,
        }
    }

    /// Seconds from the first room's start to the last conclusion.
    fn seconds(&self) -> f64 {
        if self.first_start_ms.is_finite() && self.last_done_ms > self.first_start_ms {
            (self.last_done_ms - self.first_start_ms) / 1e3
        } else {
            self.first_start.map_or(0.0, |t| {
                self.last_done.saturating_duration_since(t).as_secs_f64()
            })
        }
    }
}

/// Whether the loop goes on.
enum Next {
    Read,
    Again,
    Stop,
}

/// One demo run in progress.
struct Supervisor<'a> {
    args: &'a DemoArgs,
    plan: &'a mut Plan,
    site: &'a mut Site,
    children: Children,
    ranks: Ranks,
    deadline: Instant,
    /// Requests in the workload (computed once: deriving them is costly).
    requests: u64,
    fault: Option<Fault>,
    sampler: Sampler,
    bar: ProgressBar,
    /// `--drain-after-s` or a role switch under way, and the bound it set
    /// for the end of the run (requests past it are drained).
    drain: Option<Drain>,
    drained_below: Option<u64>,
    /// Whether `--kill-decode-after` fired.
    killed: bool,
    /// The killed decode rank 0, restarted once its last event is read.
    restart_after: Option<ChildId>,
    finished: HashSet<ChildId>,
    ledger: Ledger,
}

/// Runs the demo on its planned ranks until every rank finished.
pub(super) fn orchestrate(
    args: &DemoArgs,
    plan: &mut Plan,
    mut children: Children,
    site: &mut Site,
) -> Result<Summary> {
    let deadline = Instant::now() + Duration::from_secs(args.timeout_s);
    let bootstrap = site.bootstrap_addr();
    let fault = args.fault.map(|kind| {
        Fault::new(
            kind,
            args.fault_after,
            args.fault_secs,
            args.fault_every,
            args.netns,
            args.seed,
        )
    });
    // Every rank's fds, threads and memory, every 5 s after a warm-up.
    let sampler = Sampler::new(Duration::from_secs(5), Duration::from_secs(30));
    let ranks = Ranks::start(plan, &mut children, deadline)?;
    let requests = plan.workload.requests();
    let rogue = args.rogue.then(|| {
        rogue::Rogue::start(
            bootstrap,
            children.ready_ranks(),
            requests.iter().map(|r| r.room).collect(),
            children.pids(),
        )
    });
    let total = requests.len() as u64 * plan.decode_files.len() as u64;
    let bar = if args.json {
        ProgressBar::hidden()
    } else {
        ProgressBar::new(total)
    };
    bar.set_style(
        ProgressStyle::with_template("{spinner} {bar:40} {pos}/{len} rooms {msg}")
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    let mut run = Supervisor {
        args,
        plan,
        site,
        children,
        ranks,
        deadline,
        requests: requests.len() as u64,
        fault,
        sampler,
        bar,
        drain: None,
        drained_below: None,
        killed: false,
        restart_after: None,
        finished: HashSet::new(),
        ledger: Ledger::new(),
    };
    loop {
        match run.steer()? {
            Next::Stop => break,
            Next::Again => continue,
            Next::Read => {}
        }
        if let Some((id, event)) = run.children.next_event(Duration::from_millis(200)) {
            run.on_event(id, event)?;
        }
    }
    run.bar.finish_and_clear();
    run.children.wait_all(Duration::from_secs(10));
    Ok(run.summarize(rogue))
}

impl Supervisor<'_> {
    /// Between two events: starts a drain or a role switch when due,
    /// settles the one under way, swaps roles once every rank finished,
    /// and enforces the deadline, signals and faults.
    fn steer(&mut self) -> Result<Next> {
        let all_done = self
            .ranks
            .decode
            .iter()
            .chain(&self.ranks.prefill)
            .all(|id| self.finished.contains(id));
        let idle =
            self.drain.is_none() && self.drained_below.is_none() && self.restart_after.is_none();
        if idle && self.fault.as_mut().is_some_and(Fault::switch_due) {
            self.drain = Some(Drain::begin(
                Purpose::RoleSwitch,
                &mut self.children,
                &self.ranks.decode,
                &self.finished,
            ));
        }
        let drain_due = self
            .args
            .drain_after_s
            .zip(self.ledger.first_start)
            .is_some_and(|(s, t)| t.elapsed().as_secs_f64() >= s);
        let idle =
            self.drain.is_none() && self.drained_below.is_none() && self.restart_after.is_none();
        if drain_due && idle {
            self.drain = Some(Drain::begin(
                Purpose::End,
                &mut self.children,
                &self.ranks.decode,
                &self.finished,
            ));
            if let Some(f) = self.fault.as_mut() {
                f.no_more();
            }
        }
        let requests = self.requests;
        if let Some(d) = self.drain.as_mut()
            && let Some(below) = d.settle(
                &mut self.children,
                &self.ranks.decode,
                &self.ranks.prefill,
                &self.finished,
                requests,
            )
            && d.purpose == Purpose::End
        {
            self.drained_below = Some(below);
            self.drain = None;
            let decodes = self.plan.decode_files.len() as u64;
            self.bar.set_length(below.min(requests) * decodes);
        }
        if all_done {
            let Some(below) = self
                .drain
                .as_ref()
                .filter(|d| d.purpose == Purpose::RoleSwitch)
                .and_then(|d| d.below)
            else {
                return Ok(Next::Stop);
            };
            // Drained for a role switch: every rank finished; swap them.
            self.bar
                .set_message("role switch: prefill hosts become decode hosts and back");
            self.ranks = switch::swap_roles(
                &self.ranks,
                self.plan,
                self.site,
                &mut self.children,
                below,
                self.deadline,
            )?;
            self.drain = None;
            if let Some(f) = self.fault.as_mut() {
                f.switched();
            }
            self.bar.set_message("");
            return Ok(Next::Again);
        }
        if Instant::now() > self.deadline {
            self.children.kill_all();
            bail!("the demo did not finish within {} s", self.args.timeout_s);
        }
        if let Err(stopped) = crate::signals::check_termination() {
            self.children.kill_all();
            return Err(stopped.into());
        }
        if let Some(f) = self.fault.as_mut() {
            f.tick(self.site, &self.children, self.ranks.decode[0])?;
        }
        self.sampler.tick(self.children.running());
        Ok(Next::Read)
    }

    /// One event of child `id` (`None`: its event stream ended).
    fn on_event(&mut self, id: ChildId, event: Option<Event>) -> Result<()> {
        let rank = self.children.rank(id);
        match event {
            None if self.restart_after == Some(id) => self.restart_killed()?,
            None => {
                if !self.finished.contains(&id) && !self.children.was_killed(id) {
                    let status = self.children.exit_status(id);
                    self.children.kill_all();
                    bail!(
                        "{} exited before finishing its workload ({status})",
                        self.children.name(id)
                    );
                }
            }
            Some(Event::Started { room, unix_ms }) => {
                let ledger = &mut self.ledger;
                ledger.first_start.get_or_insert_with(Instant::now);
                if unix_ms > 0.0 {
                    ledger.first_start_ms = ledger.first_start_ms.min(unix_ms);
                }
                ledger.started.entry(rank).or_default().insert(room);
            }
            Some(Event::Done {
                role,
                room,
                success,
                reason,
                latency_ms,
                verified,
                mismatched,
                aborted,
                timed_out,
                end_unix_ms,
                ..
            }) => {
                let outcome = Outcome {
                    success,
                    reason,
                    latency_ms,
                    verified,
                    mismatched,
                    aborted,
                    timed_out,
                    end_unix_ms,
                };
                // Both roles: a prefill may see its room's end after the decode.
                self.ledger.last_done_ms = self.ledger.last_done_ms.max(outcome.end_unix_ms);
                if role == "decode" {
                    self.decode_done(rank, room, outcome)?;
                } else {
                    self.ledger.prefill.insert((rank, room), outcome);
                }
            }
            Some(Event::Finished { .. }) => {
                self.finished.insert(id);
            }
            Some(Event::Paused { below, .. }) => {
                if let Some(d) = self.drain.as_mut() {
                    d.paused(id, below);
                }
            }
            Some(Event::Ready { .. }) => {}
            Some(Event::Error { message }) => {
                self.children.kill_all();
                bail!("{} failed: {message}", self.children.name(id));
            }
        }
        Ok(())
    }

    /// A decode rank concluded a room: counted, shown, handed to the
    /// fault schedule, and `--kill-decode-after` fired when due.
    fn decode_done(&mut self, rank: u64, room: u64, outcome: Outcome) -> Result<()> {
        let ledger = &mut self.ledger;
        ledger.last_done = Instant::now();
        // Counted, not scanned for: a soak has millions of outcomes.
        if rank == 0 && !ledger.decode.contains_key(&(0, room)) {
            ledger.rank0_done += 1;
        }
        let done = ledger.rank0_done;
        if let Some(f) = self.fault.as_mut() {
            f.observe(outcome.success, outcome.reason.as_deref());
            f.progress(done, self.site, &self.children, self.ranks.decode[0])?;
        }
        self.ledger.decode.insert((rank, room), outcome);
        self.bar.inc(1);
        if let Some(n) = self
            .args
            .kill_decode_after
            .filter(|n| !self.killed && done >= *n)
        {
            self.killed = true;
            self.bar.set_message(format!(
                "killed decode rank 0 after {n} rooms; restarting it"
            ));
            self.children.kill(self.ranks.decode[0]);
            self.restart_after = Some(self.ranks.decode[0]);
        }
        Ok(())
    }

    /// Every event the killed decode rank 0 wrote has been read: only now
    /// is the set of rooms it started complete. Starts its new
    /// incarnation; its rooms left in flight count as failed.
    fn restart_killed(&mut self) -> Result<()> {
        self.restart_after = None;
        let ledger = &self.ledger;
        let (skip, in_flight) =
            split_rooms_of_decode0(&ledger.decode, &ledger.prefill, &ledger.started);
        restart_decode0(
            &mut self.children,
            &mut self.ranks.decode,
            self.plan,
            &self.ranks.decode_sessions,
            &skip,
            self.deadline,
        )?;
        for room in in_flight {
            self.ledger.decode.insert(
                (0, room),
                Outcome {
                    reason: Some(
                        "decode rank 0 was killed (SIGKILL) while the room was in flight".into(),
                    ),
                    ..Outcome::default()
                },
            );
            self.bar.inc(1);
        }
        Ok(())
    }

    /// The summary of the run, with the fault and rogue reports, each
    /// host's traffic and each rank's resources.
    fn summarize(self, rogue: Option<rogue::Rogue>) -> Summary {
        let Supervisor {
            args,
            plan,
            site,
            children,
            ranks,
            fault,
            sampler,
            drained_below,
            ledger,
            ..
        } = self;
        let fault_report = fault.map(|f| f.finish(site, &children, ranks.decode[0]));
        let rogue_report = rogue.map(rogue::Rogue::stop);
        let mut summary = tally::summarize(
            args,
            plan,
            &ledger.decode,
            &ledger.prefill,
            ledger.seconds(),
            drained_below,
        );
        summary.fault = fault_report;
        summary.rogue = rogue_report;
        summary.hosts = site.traffic();
        summary.resources = sampler.report();
        if let Some(hosts) = site.hosts() {
            summary.topology.push_str(&format!(
                ", {} hosts (network namespaces)",
                hosts.hosts.len()
            ));
        }
        summary
    }
}
