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
pub mod faults;
mod netns;
mod plan;
mod procs;
mod resources;
mod rogue;
mod site;
pub mod summary;

use std::collections::{HashMap, HashSet};
use std::process::ExitCode;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use indicatif::{ProgressBar, ProgressStyle};

use crate::rank::EngineKind;
use crate::rank::events::Event;
pub use args::DemoArgs;
use faults::Fault;
use plan::{Plan, plan};
use procs::{ChildId, Children};
use resources::Sampler;
use site::Site;
use summary::{Failure, Summary, percentile};

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

#[derive(Debug, Clone, Default)]
struct Outcome {
    success: bool,
    reason: Option<String>,
    latency_ms: f64,
    verified: u64,
    mismatched: u64,
    aborted: bool,
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
        Fault::check(kind, args.netns)?;
    }
    if args.netns && args.rogue {
        bail!("--rogue attacks loopback ranks; it does not run with --netns");
    }
    let dir = std::env::temp_dir().join(format!("kvbridge-demo-{}", std::process::id()));
    let mut site = Site::start(args, secret.clone())?;
    let result = plan(args, site.bootstrap_addr()).and_then(|plan| {
        std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
        let mut children = Children::new(dir.clone(), secret);
        let mut plan = plan;
        site.place(&mut plan, &mut children)?;
        orchestrate(args, &plan, children, &mut site)
    });
    let _ = std::fs::remove_dir_all(&dir);
    site.shutdown();
    result
}

fn orchestrate(
    args: &DemoArgs,
    plan: &Plan,
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
    let prefill_ids: Vec<ChildId> = plan
        .prefill_files
        .iter()
        .enumerate()
        .map(|(i, f)| children.spawn("prefill", i as u64, f))
        .collect::<Result<_>>()?;
    children.wait_ready(&prefill_ids, deadline)?;
    let mut decode_ids: Vec<ChildId> = plan
        .decode_files
        .iter()
        .enumerate()
        .map(|(i, f)| children.spawn("decode", i as u64, f))
        .collect::<Result<_>>()?;
    let sessions = children.wait_ready(&decode_ids, deadline)?;
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
    let mut decode: HashMap<(u64, u64), Outcome> = HashMap::new();
    let mut prefill: HashMap<(u64, u64), Outcome> = HashMap::new();
    let mut started: HashMap<u64, HashSet<u64>> = HashMap::new();
    let mut killed = false;
    // The killed decode rank 0, restarted once its last event is read.
    let mut restart_after: Option<ChildId> = None;
    let mut first_start: Option<Instant> = None;
    let mut last_done = Instant::now();
    let mut finished: HashSet<ChildId> = HashSet::new();
    loop {
        let all_done = decode_ids
            .iter()
            .chain(&prefill_ids)
            .all(|id| finished.contains(id));
        if all_done {
            break;
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
            f.tick(site, &children, decode_ids[0])?;
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
                    &mut decode_ids,
                    plan,
                    &sessions,
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
            Some(Event::Started { room }) => {
                first_start.get_or_insert_with(Instant::now);
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
                ..
            }) => {
                let outcome = Outcome {
                    success,
                    reason,
                    latency_ms,
                    verified,
                    mismatched,
                    aborted,
                };
                if role == "decode" {
                    last_done = Instant::now();
                    let rank0_done = decode.keys().filter(|(r, _)| *r == 0).count() as u64
                        + u64::from(rank == 0);
                    if let Some(f) = fault.as_mut() {
                        f.observe(outcome.success, outcome.reason.as_deref());
                        f.progress(rank0_done, site, &children, decode_ids[0])?;
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
                        children.kill(decode_ids[0]);
                        restart_after = Some(decode_ids[0]);
                    }
                } else {
                    prefill.insert((rank, room), outcome);
                }
            }
            Some(Event::Finished { .. }) => {
                finished.insert(id);
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
    let seconds = first_start.map_or(0.0, |t| {
        last_done.saturating_duration_since(t).as_secs_f64()
    });
    let fault_report = fault.map(|f| f.finish(site, &children, decode_ids[0]));
    let rogue_report = rogue.map(rogue::Rogue::stop);
    let mut summary = summarize(args, plan, &decode, &prefill, seconds);
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
    let port = sessions[0]
        .rsplit(':')
        .next()
        .and_then(|p| p.parse().ok())
        .context("decode session without a port")?;
    file.engine.port = port;
    if let Some(w) = file.workload.as_mut() {
        w.only = Some(remaining);
    }
    // The old incarnation's port may linger briefly; retry the start.
    let id = children.spawn("decode", 0, &file)?;
    children.wait_ready(&[id], deadline)?;
    decode_ids[0] = id;
    Ok(())
}

fn summarize(
    args: &DemoArgs,
    plan: &Plan,
    decode: &HashMap<(u64, u64), Outcome>,
    prefill: &HashMap<(u64, u64), Outcome>,
    seconds: f64,
) -> Summary {
    let requests = plan.workload.requests();
    let (mut succeeded, mut failed, mut aborted, mut bytes) = (0, 0, 0, 0);
    let (mut verified, mut mismatched) = (0, 0);
    let mut latencies = Vec::new();
    let mut failures = Vec::new();
    for r in &requests {
        let d: Vec<&Outcome> = (0..plan.decode_files.len() as u64)
            .filter_map(|k| decode.get(&(k, r.room)))
            .collect();
        let p: Vec<&Outcome> = (0..plan.prefill_files.len() as u64)
            .filter_map(|k| prefill.get(&(k, r.room)))
            .collect();
        verified += d.iter().map(|o| o.verified).sum::<u64>();
        mismatched += d.iter().map(|o| o.mismatched).sum::<u64>();
        let ok =
            d.len() == plan.decode_files.len() && d.iter().all(|o| o.success && o.mismatched == 0);
        if d.iter().any(|o| o.aborted) {
            aborted += 1;
        }
        if ok {
            succeeded += 1;
            bytes += d.iter().map(|o| o.verified).sum::<u64>();
            let lat = p
                .iter()
                .filter(|o| o.success)
                .map(|o| o.latency_ms)
                .fold(0.0, f64::max);
            latencies.push(if lat > 0.0 {
                lat
            } else {
                d.iter().map(|o| o.latency_ms).fold(0.0, f64::max)
            });
        } else {
            failed += 1;
            let reason = d
                .iter()
                .find(|o| o.aborted)
                .and_then(|o| o.reason.clone())
                .or_else(|| p.iter().find_map(|o| o.reason.clone()))
                .or_else(|| d.iter().find_map(|o| o.reason.clone()))
                .or_else(|| {
                    d.iter()
                        .find(|o| o.mismatched > 0)
                        .map(|o| format!("{} bytes mismatched", o.mismatched))
                })
                .unwrap_or_else(|| "no result from some decode rank".into());
            failures.push(Failure {
                room: r.room,
                reason,
            });
        }
    }
    Summary {
        model: plan.model.name.clone(),
        topology: format!(
            "prefill {}TP{} PP{}{} -> decode TP{}{}, {} engine{}{}",
            match (args.dp, args.dp_round_robin) {
                (1, _) => String::new(),
                (dp, true) => format!("DP{dp} (round robin) "),
                (dp, false) => format!("DP{dp} "),
            },
            args.prefill_tp,
            args.prefill_pp,
            match (args.prefill_cp, args.all_cp_ranks) {
                (1, _) => String::new(),
                (cp, true) => format!(" CP{cp} (all ranks send)"),
                (cp, false) => format!(" CP{cp}"),
            },
            args.decode_tp,
            match (args.decode_cp, args.hisparse) {
                (1, false) => String::new(),
                (1, true) => " HiSparse".into(),
                (cp, _) => format!(" DCP{cp}"),
            },
            match args.engine {
                EngineKind::Tcp => "tcp",
                EngineKind::Ipc => "ipc",
                EngineKind::Ucx => "ucx",
            },
            match (args.device, args.host_kv_buffers) {
                (None, _) => String::new(),
                (Some(d), 0) => format!(", KV on GPU {d}"),
                (Some(d), n) => format!(", KV on GPU {d} ({n} prefill buffers in host memory)"),
            },
            if args.staging { ", staging on" } else { "" }
        ),
        requests: requests.len() as u64,
        succeeded,
        failed,
        aborted,
        bytes,
        seconds,
        gbps: if seconds > 0.0 {
            bytes as f64 / seconds / 1e9
        } else {
            0.0
        },
        p50_ms: percentile(&latencies, 0.5),
        p99_ms: percentile(&latencies, 0.99),
        verified_bytes: verified,
        mismatched_bytes: mismatched,
        failures,
        rogue: None,
        fault: None,
        hosts: Vec::new(),
        resources: Vec::new(),
    }
}
