//! A role switch (`--fault role-switch`, `--netns`): once the run has
//! drained (the rooms in flight finished), every rank process is released,
//! and each host starts the other role on the address and engine port the
//! other role had: prefill rank `k` where decode rank `k` was, and back.
//! The new processes are new incarnations (new engine sessions, a new
//! bootstrap registration) and run the rest of the workload.

use std::time::{Duration, Instant};

use anyhow::{Context, Result};

use super::plan::Plan;
use super::procs::{ChildId, Children};
use super::site::Site;

/// How long a released rank may take to exit before it is killed.
const RELEASE: Duration = Duration::from_secs(10);

/// The rank processes of one side of the run and their engine sessions.
pub(super) struct Ranks {
    /// Prefill rank processes.
    pub prefill: Vec<ChildId>,
    /// Their engine sessions (`ip:port`).
    pub prefill_sessions: Vec<String>,
    /// Decode rank processes.
    pub decode: Vec<ChildId>,
    /// Their engine sessions.
    pub decode_sessions: Vec<String>,
}

/// The port of an engine session `ip:port`.
pub(super) fn port(session: &str) -> Result<u16> {
    session
        .rsplit(':')
        .next()
        .and_then(|p| p.parse().ok())
        .with_context(|| format!("engine session {session:?} without a port"))
}

/// Releases `old`, swaps the hosts' roles and starts the new ranks for
/// the requests from `from` on; returns them once ready.
pub(super) fn swap_roles(
    old: &Ranks,
    plan: &mut Plan,
    site: &mut Site,
    children: &mut Children,
    from: u64,
    deadline: Instant,
) -> Result<Ranks> {
    let everyone: Vec<ChildId> = old.prefill.iter().chain(&old.decode).copied().collect();
    children.release(&everyone, RELEASE);
    site.swap_roles()?;
    // Each role takes the other's engine port on the host it moves to.
    for (files, sessions) in [
        (&mut plan.prefill_files, &old.decode_sessions),
        (&mut plan.decode_files, &old.prefill_sessions),
    ] {
        for (k, file) in files.iter_mut().enumerate() {
            let session = sessions.get(k).context("as many prefill as decode hosts")?;
            file.engine.port = port(session)?;
            if let Some(w) = file.workload.as_mut() {
                w.from = from;
            }
        }
    }
    site.place(plan, children)?;
    tracing::info!(from, "role switch: starting the swapped ranks");
    // Prefill first: its registration is in place before a decode asks.
    let prefill: Vec<ChildId> = plan
        .prefill_files
        .iter()
        .enumerate()
        .map(|(k, f)| children.spawn("prefill", k as u64, f))
        .collect::<Result<_>>()?;
    let prefill_sessions = children.wait_ready(&prefill, deadline)?;
    let decode: Vec<ChildId> = plan
        .decode_files
        .iter()
        .enumerate()
        .map(|(k, f)| children.spawn("decode", k as u64, f))
        .collect::<Result<_>>()?;
    let decode_sessions = children.wait_ready(&decode, deadline)?;
    Ok(Ranks {
        prefill,
        prefill_sessions,
        decode,
        decode_sessions,
    })
}
