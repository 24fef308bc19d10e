//! Ending a run, or stopping it for a role switch, without failing the
//! rooms in flight. The decode ranks are paused first: they start no new
//! room and each reports the bound below which every room it started lies.
//! Every rank is then told the highest bound: requests below it still run
//! to their end (a paused rank may still have to start some that another
//! rank already did); the ones past it are drained, never started and not
//! counted.

use std::collections::{HashMap, HashSet};
use std::time::{Duration, Instant};

use super::procs::{ChildId, Children};

/// Why a run drains.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Purpose {
    /// `--drain-after-s`: the run ends once the drained rooms conclude.
    End,
    /// A role switch: the ranks are replaced once they have finished.
    RoleSwitch,
}

/// A drain under way.
#[derive(Debug)]
pub(super) struct Drain {
    /// Why.
    pub purpose: Purpose,
    /// Each paused decode rank's bound.
    replies: HashMap<ChildId, u64>,
    /// The bound every rank was told, once all decode ranks paused.
    pub below: Option<u64>,
    /// When the ranks were asked to pause.
    asked: Instant,
    /// Whether the slow-pause warning was given.
    warned: bool,
}

/// How long decode ranks may take to pause before the demo says so (a
/// stopped rank answers only once resumed).
const PAUSE_WARNING: Duration = Duration::from_secs(30);

impl Drain {
    /// Asks every decode rank of `decodes` still running to pause.
    pub fn begin(
        purpose: Purpose,
        children: &mut Children,
        decodes: &[ChildId],
        finished: &HashSet<ChildId>,
    ) -> Self {
        for &id in decodes.iter().filter(|id| !finished.contains(id)) {
            children.tell(id, "pause");
        }
        tracing::info!(?purpose, "draining: decode ranks asked to pause");
        Self {
            purpose,
            replies: HashMap::new(),
            below: None,
            asked: Instant::now(),
            warned: false,
        }
    }

    /// Decode rank `id` paused with every room it started below `below`.
    pub fn paused(&mut self, id: ChildId, below: u64) {
        self.replies.insert(id, below);
    }

    /// Once every decode rank of `decodes` paused (or had finished, its
    /// bound then `total`), tells every rank the bound and returns it.
    pub fn settle(
        &mut self,
        children: &mut Children,
        decodes: &[ChildId],
        prefills: &[ChildId],
        finished: &HashSet<ChildId>,
        total: u64,
    ) -> Option<u64> {
        if self.below.is_some() {
            return None;
        }
        let mut below = 0;
        for id in decodes {
            match (self.replies.get(id), finished.contains(id)) {
                (Some(b), _) => below = below.max(*b),
                (None, true) => below = below.max(total),
                (None, false) => {
                    if !self.warned && self.asked.elapsed() > PAUSE_WARNING {
                        self.warned = true;
                        tracing::warn!(
                            rank = children.name(*id),
                            "a decode rank has not paused after {} s (stopped?)",
                            PAUSE_WARNING.as_secs()
                        );
                    }
                    return None;
                }
            }
        }
        let line = format!("drain {below}");
        for &id in decodes.iter().chain(prefills) {
            if !finished.contains(&id) {
                children.tell(id, &line);
            }
        }
        tracing::info!(below, "draining: requests from here on are not started");
        self.below = Some(below);
        Some(below)
    }
}
