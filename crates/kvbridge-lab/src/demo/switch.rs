//! A role switch (`--fault role-switch`, `--netns`): once the run has
//! drained (the rooms in flight finished), every rank process is released,
//! and each host starts the other role on the address and engine port the
//! other role had: prefill rank `k` where decode rank `k` was, and back.
//! The new processes are new incarnations (new engine sessions, a new
//! bootstrap registration) and run the rest of the workload.

use std::time::{Duration, Instant};

use anyhow::{Context, Result};

use super::plan::Plan;
use super::procs::{ChildId, Children, Ranks};
use super::site::Site;

/// How long a released rank may take to exit before it is killed.
const RELEASE: Duration = Duration::from_secs(10);

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
    Ranks::start(plan, children, deadline)
}
