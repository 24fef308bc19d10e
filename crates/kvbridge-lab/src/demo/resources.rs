//! The resources of the rank processes over a run: open file descriptors,
//! threads and resident memory, read from `/proc`, so a long run can show
//! that nothing grows without bound.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use serde::Serialize;

/// One process's resources at one moment.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct Usage {
    /// Open file descriptors.
    pub fds: u64,
    /// Threads.
    pub threads: u64,
    /// Resident memory, MiB.
    pub rss_mib: u64,
}

impl Usage {
    /// `pid`'s usage now; `None` when the process is gone.
    pub fn of(pid: u32) -> Option<Self> {
        let fds = std::fs::read_dir(format!("/proc/{pid}/fd")).ok()?.count() as u64;
        let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
        let field = |name: &str| {
            status
                .lines()
                .find_map(|l| l.strip_prefix(name))
                .and_then(|v| v.split_whitespace().next())
                .and_then(|v| v.parse::<u64>().ok())
                .unwrap_or(0)
        };
        Some(Self {
            fds,
            threads: field("Threads:"),
            rss_mib: field("VmRSS:") / 1024,
        })
    }

    /// The larger of each figure.
    pub fn max(self, other: Self) -> Self {
        Self {
            fds: self.fds.max(other.fds),
            threads: self.threads.max(other.threads),
            rss_mib: self.rss_mib.max(other.rss_mib),
        }
    }
}

/// One rank process's usage over the run.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ProcessUsage {
    /// `prefill rank 0`, `decode rank 1`, ...
    pub name: String,
    /// After the warm-up (the first sample past it).
    pub settled: Usage,
    /// The last sample.
    pub last: Usage,
    /// The largest of every figure.
    pub max: Usage,
    /// Samples taken.
    pub samples: u64,
}

/// Samples processes every `every`, counting from `warm_up` after start.
#[derive(Debug)]
pub struct Sampler {
    every: Duration,
    warm_up: Instant,
    next: Instant,
    by_pid: BTreeMap<u32, ProcessUsage>,
}

impl Sampler {
    /// A sampler that settles after `warm_up`.
    pub fn new(every: Duration, warm_up: Duration) -> Self {
        let now = Instant::now();
        Self {
            every,
            warm_up: now + warm_up,
            next: now,
            by_pid: BTreeMap::new(),
        }
    }

    /// Samples `processes` (pid, name) when a sample is due.
    pub fn tick(&mut self, processes: impl IntoIterator<Item = (u32, String)>) {
        let now = Instant::now();
        if now < self.next {
            return;
        }
        self.next = now + self.every;
        let settled = now >= self.warm_up;
        for (pid, name) in processes {
            let Some(u) = Usage::of(pid) else { continue };
            let entry = self.by_pid.entry(pid).or_insert(ProcessUsage {
                name,
                settled: u,
                last: u,
                max: u,
                samples: 0,
            });
            // Until the warm-up is over the settled figure follows the samples.
            if !settled || entry.samples == 0 {
                entry.settled = u;
            }
            entry.last = u;
            entry.max = entry.max.max(u);
            entry.samples += 1;
        }
    }

    /// Every process sampled, by pid.
    pub fn report(self) -> Vec<ProcessUsage> {
        self.by_pid.into_values().collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn samples_a_live_process_and_skips_a_gone_one() {
        let me = Usage::of(std::process::id()).unwrap();
        assert!(me.fds >= 3 && me.threads >= 1 && me.rss_mib >= 1, "{me:?}");
        assert_eq!(Usage::of(u32::MAX), None);
        let mut s = Sampler::new(Duration::ZERO, Duration::ZERO);
        s.tick([
            (std::process::id(), "me".to_owned()),
            (u32::MAX, "gone".into()),
        ]);
        s.tick([(std::process::id(), "me".to_owned())]);
        let report = s.report();
        assert_eq!(report.len(), 1);
        assert_eq!((report[0].name.as_str(), report[0].samples), ("me", 2));
        assert!(report[0].max.fds >= report[0].settled.fds);
    }
}
