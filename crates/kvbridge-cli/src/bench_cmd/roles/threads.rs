//! Where the roles' time goes: each thread's CPU time over the timed room
//! streams (Linux `/proc/self/task/*/schedstat`), summed by thread name.
//! A thread whose CPU time per room nears the wall time per room is the
//! one that limits the rate.

use std::collections::{BTreeMap, HashMap};
use std::path::Path;

/// Nanoseconds a thread has run, from its `schedstat` file (`None` when it
/// cannot be read: no `/proc`, or the thread ended).
fn on_cpu_ns(schedstat: &Path) -> Option<u64> {
    std::fs::read_to_string(schedstat)
        .ok()?
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

/// CPU nanoseconds per thread id, with the thread's name.
#[derive(Debug, Default)]
pub(super) struct CpuTimes(HashMap<u64, (String, u64)>);

impl CpuTimes {
    /// Every thread of this process now (empty where `/proc` is missing).
    pub fn now() -> Self {
        let pid = std::process::id() as u64;
        let mut out = HashMap::new();
        let Ok(dir) = std::fs::read_dir("/proc/self/task") else {
            return Self(out);
        };
        for entry in dir.flatten() {
            let Some(tid) = entry
                .file_name()
                .to_str()
                .and_then(|s| s.parse::<u64>().ok())
            else {
                continue;
            };
            let path = entry.path();
            // Threads may end between the listing and the reads: skip them.
            let Some(ns) = on_cpu_ns(&path.join("schedstat")) else {
                continue;
            };
            let name = if tid == pid {
                "main".to_owned()
            } else {
                std::fs::read_to_string(path.join("comm"))
                    .map(|s| s.trim().to_owned())
                    .unwrap_or_default()
            };
            out.insert(tid, (name, ns));
        }
        Self(out)
    }

    /// CPU nanoseconds spent since `earlier`, summed by thread name.
    pub fn since(&self, earlier: &Self) -> BTreeMap<String, u64> {
        let mut by_name = BTreeMap::new();
        for (tid, (name, ns)) in &self.0 {
            let before = earlier.0.get(tid).map_or(0, |(_, b)| *b);
            *by_name.entry(name.clone()).or_insert(0) += ns.saturating_sub(before);
        }
        by_name
    }
}

/// Adds `more` into `total`.
pub(super) fn accumulate(total: &mut BTreeMap<String, u64>, more: BTreeMap<String, u64>) {
    for (name, ns) in more {
        *total.entry(name).or_insert(0) += ns;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// This thread's CPU nanoseconds.
    fn own_ns() -> u64 {
        on_cpu_ns(Path::new("/proc/thread-self/schedstat")).unwrap_or(0)
    }

    #[test]
    fn a_busy_thread_shows_its_time_under_its_name() {
        let before = CpuTimes::now();
        let spin = std::thread::Builder::new()
            .name("kvb-test-spin".into())
            .spawn(|| {
                // Spin until this thread has had 20 ms of CPU (or 10 s passed).
                let start = std::time::Instant::now();
                let mut x = 0u64;
                while own_ns() < 20_000_000 && start.elapsed().as_secs() < 10 {
                    for _ in 0..10_000 {
                        x = std::hint::black_box(x.wrapping_add(1));
                    }
                }
                // Read while the thread still exists.
                CpuTimes::now()
            })
            .expect("spawn");
        let after = spin.join().expect("join");
        let spent = after.since(&before);
        let ns = spent.get("kvb-test-spin").copied().unwrap_or(0);
        assert!(ns >= 20_000_000, "{spent:?}");
        // A thread that did not exist before counts from zero; one that did
        // counts only what it spent since.
        let mut total = BTreeMap::new();
        accumulate(&mut total, spent.clone());
        accumulate(&mut total, spent);
        assert_eq!(total.get("kvb-test-spin").copied(), Some(2 * ns));
    }
}
