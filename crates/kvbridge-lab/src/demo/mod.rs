//! `kvbridge demo`, the main job: a bootstrap server, prefill rank processes
//! and decode rank processes on loopback stream a synthetic workload; every
//! decode rank verifies every byte; the run ends with a summary.
//!
//! Fault flags show the failure paths live: `--kill-decode-after N` kills
//! decode rank 0 with SIGKILL after N of its rooms and starts a new
//! incarnation on the same engine address, which the prefill serves again.
//! The new incarnation runs the rooms the old one had not started and asks
//! again for those it left in flight whose prefill outcome is still open:
//! the prefill finishes one whose request was lost with the old process,
//! and answers Failed at once for one it had already begun sending or had
//! given up. `--abort-fraction F` aborts that fraction of requests mid-transfer.

mod args;
mod drain;
pub mod faults;
mod netns;
mod plan;
mod procs;
mod resources;
mod rogue;
mod site;
pub mod summary;
mod switch;
mod tally;

use std::collections::{HashMap, HashSet};
use std::process::ExitCode;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use indicatif::{ProgressBar, ProgressStyle};

use crate::rank::events::Event;
pub use args::DemoArgs;
use drain::{Drain, Purpose};
use faults::Fault;
use plan::{Plan, plan};
use procs::{ChildId, Children, Ranks};
use resources::Sampler;
use site::Site;
use summary::Summary;
use tally::Outcome;

/// Runs the demo; exits non-zero on any mismatched byte, and on failures
/// when no fault was injected.
pub fn run(args: DemoArgs) -> ExitCode {
    match run_inner(&args) {
        Ok(summary) => {
            if args.json {
                match serde_json::to_string(&summary) {
                    Ok(line) => println!("{line}"),
                    Err(e) => eprintln!("kvbridge demo: {e}"),
                }
            } else {
                // The result on stdout (`kvbridge demo > out.txt`), logs on stderr.
                print!("{}", summary.render());
            }
            let faults = args.kill_decode_after.is_some()
                || args.abort_fraction > 0.0
                || args.fault.is_some();
            if summary.mismatched_bytes > 0
                || (!faults && summary.failed > 0)
                || summary.succeeded == 0
            {
                ExitCode::FAILURE
            } else {
                ExitCode::SUCCESS
            }
        }
        Err(e) => {
            if let Some(stopped) = e.downcast_ref::<crate::signals::Stopped>() {
                eprintln!(
                    "kvbridge demo: {stopped}; its rank processes were stopped and its \
                     temporary files removed"
                );
                return ExitCode::from(stopped.exit_code());
            }
            eprintln!("kvbridge demo: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn run_inner(args: &DemoArgs) -> Result<Summary> {
    // From here a signal stops the run cleanly: the ranks are killed and
    // reaped, the temporary directory removed.
    crate::signals::watch_termination().context("installing signal handlers")?;
    let secret = if args.open {
        eprintln!(
            "kvbridge demo: OPEN MODE (--open): no cluster secret; every channel is unauthenticated"
        );
        None
    } else {
        Some(match kvbridge_engine::ClusterSecret::from_env()? {
            Some(s) => s,
            None => kvbridge_engine::ClusterSecret::generate(),
        })
    };
    if let Some(kind) = args.fault {
        let (prefills, decodes) = site::rank_counts(args);
        Fault::check(kind, args.netns, prefills, decodes)?;
        if kind == faults::FaultKind::RoleSwitch && args.kill_decode_after.is_some() {
            bail!("--fault role-switch and --kill-decode-after do not run together");
        }
    }
    if args.netns && args.rogue {
        bail!("--rogue attacks loopback ranks; it does not run with --netns");
    }
    let dir = private_dir()?;
    let mut site = Site::start(args, secret.clone())?;
    let result = plan(args, site.bootstrap_addr()).and_then(|plan| {
        let mut children = Children::new(dir.path().to_path_buf(), secret);
        let mut plan = plan;
        site.place(&mut plan, &mut children)?;
        orchestrate(args, &mut plan, children, &mut site)
    });
    drop(dir);
    site.shutdown();
    result
}

/// A fresh folder for the rank configs (they carry the cluster secret): an
/// unpredictable name, created new (never an existing path or a planted
/// link), mode 0700, removed when dropped.
fn private_dir() -> Result<tempfile::TempDir> {
    use std::os::unix::fs::PermissionsExt;
    tempfile::Builder::new()
        .prefix("kvbridge-demo-")
        .permissions(std::fs::Permissions::from_mode(0o700))
        .tempdir()
        .with_context(|| {
            format!(
                "creating a private folder for the rank configs in {}",
                std::env::temp_dir().display()
            )
        })
}

fn orchestrate(
    args: &DemoArgs,
    plan: &mut Plan,
    mut children: Children,
    site: &mut Site,
) -> Result<Summary> {
    let deadline = Instant::now() + Duration::from_secs(args.timeout_s);
    let bootstrap = site.bootstrap_addr();
    let mut fault = args.fault.map(|kind| {
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
    let mut sampler = Sampler::new(Duration::from_secs(5), Duration::from_secs(30));
    let mut ranks = Ranks::start(plan, &mut children, deadline)?;
    let requests = plan.workload.requests();
    let decodes = plan.decode_files.len() as u64;
    // `--drain-after-s` or a role switch under way, and the bound it set
    // for the end of the run (requests past it are drained).
    let mut drain: Option<Drain> = None;
    let mut drained_below: Option<u64> = None;
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
    let mut decode: HashMap<(u64, u64), Outcome> = HashMap::new();
    let mut prefill: HashMap<(u64, u64), Outcome> = HashMap::new();
    let mut started: HashMap<u64, HashSet<u64>> = HashMap::new();
    let mut killed = false;
    // The killed decode rank 0, restarted once its last event is read.
    let mut restart_after: Option<ChildId> = None;
    let mut first_start: Option<Instant> = None;
    // Decode rank 0's rooms concluded (what faults count from).
    let mut rank0_done: u64 = 0;
    let mut last_done = Instant::now();
    // The same window on the ranks' shared clock (Unix ms): events reach
    // this loop late when the host is busy, the ranks' stamps do not.
    let (mut first_start_ms, mut last_done_ms) = (f64::INFINITY, 0.0f64);
    let mut finished: HashSet<ChildId> = HashSet::new();
    loop {
        let all_done = ranks
            .decode
            .iter()
            .chain(&ranks.prefill)
            .all(|id| finished.contains(id));
        if let Some(f) = fault.as_mut()
            && drain.is_none()
            && drained_below.is_none()
            && restart_after.is_none()
            && f.switch_due()
        {
            drain = Some(Drain::begin(
                Purpose::RoleSwitch,
                &mut children,
                &ranks.decode,
                &finished,
            ));
        }
        let drain_due = args
            .drain_after_s
            .zip(first_start)
            .is_some_and(|(s, t)| t.elapsed().as_secs_f64() >= s);
        if drain_due && drain.is_none() && drained_below.is_none() && restart_after.is_none() {
            drain = Some(Drain::begin(
                Purpose::End,
                &mut children,
                &ranks.decode,
                &finished,
            ));
            if let Some(f) = fault.as_mut() {
                f.no_more();
            }
        }
        if let Some(d) = drain.as_mut()
            && let Some(below) = d.settle(
                &mut children,
                &ranks.decode,
                &ranks.prefill,
                &finished,
                requests.len() as u64,
            )
            && d.purpose == Purpose::End
        {
            drained_below = Some(below);
            drain = None;
            bar.set_length(below.min(requests.len() as u64) * decodes);
        }
        if all_done {
            let Some(below) = drain
                .as_ref()
                .filter(|d| d.purpose == Purpose::RoleSwitch)
                .and_then(|d| d.below)
            else {
                break;
            };
            // Drained for a role switch: every rank finished; swap them.
            bar.set_message("role switch: prefill hosts become decode hosts and back");
            ranks = switch::swap_roles(&ranks, plan, site, &mut children, below, deadline)?;
            drain = None;
            if let Some(f) = fault.as_mut() {
                f.switched();
            }
            bar.set_message("");
            continue;
        }
        if Instant::now() > deadline {
            children.kill_all();
            bail!("the demo did not finish within {} s", args.timeout_s);
        }
        if let Err(stopped) = crate::signals::check_termination() {
            children.kill_all();
            return Err(stopped.into());
        }
        if let Some(f) = fault.as_mut() {
            f.tick(site, &children, ranks.decode[0])?;
        }
        sampler.tick(children.running());
        let Some((id, event)) = children.next_event(Duration::from_millis(200)) else {
            continue;
        };
        let rank = children.rank(id);
        match event {
            None if restart_after == Some(id) => {
                // Every event the killed incarnation wrote has been read:
                // only now is the set of rooms it started complete.
                restart_after = None;
                let (skip, in_flight) = split_rooms_of_decode0(&decode, &prefill, &started);
                restart_decode0(
                    &mut children,
                    &mut ranks.decode,
                    plan,
                    &ranks.decode_sessions,
                    &skip,
                    deadline,
                )?;
                for room in in_flight {
                    decode.insert(
                        (0, room),
                        Outcome {
                            reason: Some(
                                "decode rank 0 was killed (SIGKILL) while the room was in flight"
                                    .into(),
                            ),
                            ..Outcome::default()
                        },
                    );
                    bar.inc(1);
                }
            }
            None => {
                if !finished.contains(&id) && !children.was_killed(id) {
                    let status = children.exit_status(id);
                    children.kill_all();
                    bail!(
                        "{} exited before finishing its workload ({status})",
                        children.name(id)
                    );
                }
            }
            Some(Event::Started { room, unix_ms }) => {
                first_start.get_or_insert_with(Instant::now);
                if unix_ms > 0.0 {
                    first_start_ms = first_start_ms.min(unix_ms);
                }
                started.entry(rank).or_default().insert(room);
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
                last_done_ms = last_done_ms.max(outcome.end_unix_ms);
                if role == "decode" {
                    last_done = Instant::now();
                    // Counted, not scanned for: a soak has millions of outcomes.
                    if rank == 0 && !decode.contains_key(&(0, room)) {
                        rank0_done += 1;
                    }
                    if let Some(f) = fault.as_mut() {
                        f.observe(outcome.success, outcome.reason.as_deref());
                        f.progress(rank0_done, site, &children, ranks.decode[0])?;
                    }
                    decode.insert((rank, room), outcome);
                    bar.inc(1);
                    if let Some(n) = args
                        .kill_decode_after
                        .filter(|n| !killed && rank0_done >= *n)
                    {
                        killed = true;
                        bar.set_message(format!(
                            "killed decode rank 0 after {n} rooms; restarting it"
                        ));
                        children.kill(ranks.decode[0]);
                        restart_after = Some(ranks.decode[0]);
                    }
                } else {
                    prefill.insert((rank, room), outcome);
                }
            }
            Some(Event::Finished { .. }) => {
                finished.insert(id);
            }
            Some(Event::Paused { below, .. }) => {
                if let Some(d) = drain.as_mut() {
                    d.paused(id, below);
                }
            }
            Some(Event::Ready { .. }) => {}
            Some(Event::Error { message }) => {
                children.kill_all();
                bail!("{} failed: {message}", children.name(id));
            }
        }
    }
    bar.finish_and_clear();
    children.wait_all(Duration::from_secs(10));
    let seconds = if first_start_ms.is_finite() && last_done_ms > first_start_ms {
        (last_done_ms - first_start_ms) / 1e3
    } else {
        first_start.map_or(0.0, |t| {
            last_done.saturating_duration_since(t).as_secs_f64()
        })
    };
    let fault_report = fault.map(|f| f.finish(site, &children, ranks.decode[0]));
    let rogue_report = rogue.map(rogue::Rogue::stop);
    let mut summary = tally::summarize(args, plan, &decode, &prefill, seconds, drained_below);
    summary.rogue = rogue_report;
    summary.fault = fault_report;
    summary.hosts = site.traffic();
    summary.resources = sampler.report();
    if let Some(hosts) = site.hosts() {
        summary.topology.push_str(&format!(
            ", {} hosts (network namespaces)",
            hosts.hosts.len()
        ));
    }
    Ok(summary)
}

/// Splits the rooms the killed decode rank 0 started: returns the rooms its
/// new incarnation must not run (done, or left in flight with a prefill
/// outcome already known) and, of those, the ones left in flight. A room in
/// flight whose prefill outcome is still open is retried: the prefill
/// completes it (its request was lost with the old process) or answers
/// Failed at once (it had begun sending it, or given it up).
fn split_rooms_of_decode0(
    decode: &HashMap<(u64, u64), Outcome>,
    prefill: &HashMap<(u64, u64), Outcome>,
    started: &HashMap<u64, HashSet<u64>>,
) -> (HashSet<u64>, Vec<u64>) {
    let concluded_at_prefill: HashSet<u64> = prefill.keys().map(|(_, room)| *room).collect();
    let mut skip = HashSet::new();
    let mut in_flight = Vec::new();
    for &room in started.get(&0).into_iter().flatten() {
        if decode.contains_key(&(0, room)) {
            skip.insert(room);
        } else if concluded_at_prefill.contains(&room) {
            skip.insert(room);
            in_flight.push(room);
        }
    }
    (skip, in_flight)
}

/// Starts a new incarnation of the killed decode rank 0 on the same engine
/// port for every room of the workload except `skip`.
fn restart_decode0(
    children: &mut Children,
    decode_ids: &mut [ChildId],
    plan: &Plan,
    sessions: &[String],
    skip: &HashSet<u64>,
    deadline: Instant,
) -> Result<()> {
    let remaining: Vec<u64> = plan
        .workload
        .requests()
        .iter()
        .filter(|r| !skip.contains(&r.room))
        .map(|r| r.index)
        .collect();
    let mut file = plan.decode_files[0].clone();
    file.engine.port = switch::port(&sessions[0])?;
    if let Some(w) = file.workload.as_mut() {
        w.only = Some(remaining);
    }
    // The old incarnation's port may linger briefly; retry the start.
    let id = children.spawn("decode", 0, &file)?;
    children.wait_ready(&[id], deadline)?;
    decode_ids[0] = id;
    Ok(())
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // tests unwrap what they construct
mod tests {
    use std::os::unix::fs::PermissionsExt;

    #[test]
    fn rank_config_folder_is_fresh_private_and_removed() {
        let a = super::private_dir().unwrap();
        let b = super::private_dir().unwrap();
        assert_ne!(a.path(), b.path());
        let name = a.path().file_name().unwrap().to_string_lossy().into_owned();
        assert_ne!(name, format!("kvbridge-demo-{}", std::process::id()));
        let mode = std::fs::metadata(a.path()).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o700);
        let path = a.path().to_path_buf();
        drop(a);
        assert!(!path.exists());
    }
}
