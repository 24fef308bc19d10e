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
mod supervise;
mod switch;
mod tally;

use std::collections::{HashMap, HashSet};
use std::process::ExitCode;
use std::time::Instant;

use anyhow::{Context, Result, bail};

pub use args::DemoArgs;
use faults::Fault;
use plan::{Plan, plan};
use procs::{ChildId, Children};
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
        supervise::orchestrate(args, &mut plan, children, &mut site)
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
