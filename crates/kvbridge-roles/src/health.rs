//! Decode sessions a prefill rank has stopped sending to, and when to probe
//! them again.
//!
//! sglang blacklists a session on its first failed transfer and probes it at
//! a fixed interval. Here a failure blacklists the session (so queued rooms
//! fail fast instead of each waiting for a timeout), and recovery is quick
//! and cheap: the first probe comes after `base` (seconds, not sglang's
//! 30 s), each failed probe doubles the wait up to `max`, a successful probe
//! or a re-registration (a restarted decode) lifts the blacklist at once,
//! and a session no room has asked for within `idle` is forgotten.

use std::collections::HashMap;
use std::time::{Duration, Instant};

#[derive(Debug, Clone)]
struct Entry {
    failures: u32,
    next_probe: Instant,
    interval: Duration,
    last_requested: Instant,
}

/// The blacklist with per-session exponential probe backoff.
#[derive(Debug)]
pub struct SessionHealth {
    base: Duration,
    max: Duration,
    idle: Duration,
    blacklisted: HashMap<String, Entry>,
    failures_total: HashMap<String, u64>,
}

/// What [`SessionHealth::record_failure`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FailureOutcome {
    /// Consecutive failures since the session last worked.
    pub consecutive: u32,
    /// Whether the session was newly blacklisted by this failure.
    pub newly_blacklisted: bool,
}

impl SessionHealth {
    /// First probe after `base`, backing off to `max`; forget after `idle`.
    pub fn new(base: Duration, max: Duration, idle: Duration) -> Self {
        Self {
            base,
            max: max.max(base),
            idle,
            blacklisted: HashMap::new(),
            failures_total: HashMap::new(),
        }
    }

    /// Whether transfers to `session` should fail fast.
    pub fn is_blacklisted(&self, session: &str) -> bool {
        self.blacklisted.contains_key(session)
    }

    /// Notes that a room wanted `session` (keeps it from going idle).
    pub fn note_requested(&mut self, session: &str, now: Instant) {
        if let Some(e) = self.blacklisted.get_mut(session) {
            e.last_requested = now;
        }
    }

    /// A transfer to `session` failed: blacklist it and schedule a probe.
    pub fn record_failure(&mut self, session: &str, now: Instant) -> FailureOutcome {
        *self.failures_total.entry(session.to_owned()).or_default() += 1;
        match self.blacklisted.get_mut(session) {
            Some(e) => {
                e.failures = e.failures.saturating_add(1);
                e.last_requested = now;
                FailureOutcome {
                    consecutive: e.failures,
                    newly_blacklisted: false,
                }
            }
            None => {
                self.blacklisted.insert(
                    session.to_owned(),
                    Entry {
                        failures: 1,
                        next_probe: now + self.base,
                        interval: self.base,
                        last_requested: now,
                    },
                );
                FailureOutcome {
                    consecutive: 1,
                    newly_blacklisted: true,
                }
            }
        }
    }

    /// Sessions whose probe is due; drops sessions idle past the timeout.
    pub fn due_for_probe(&mut self, now: Instant) -> Vec<String> {
        let idle = self.idle;
        self.blacklisted.retain(|session, e| {
            let keep = now.saturating_duration_since(e.last_requested) < idle;
            if !keep {
                tracing::info!(%session, "forgetting blacklisted session: no request within the idle timeout");
            }
            keep
        });
        self.blacklisted
            .iter()
            .filter(|(_, e)| now >= e.next_probe)
            .map(|(s, _)| s.clone())
            .collect()
    }

    /// A probe of `session` failed: double its interval (up to the maximum).
    pub fn probe_failed(&mut self, session: &str, now: Instant) {
        if let Some(e) = self.blacklisted.get_mut(session) {
            e.interval = (e.interval * 2).min(self.max);
            e.next_probe = now + e.interval;
        }
    }

    /// The session answers again (probe or re-registration): lift the
    /// blacklist. Returns whether it was blacklisted.
    pub fn recovered(&mut self, session: &str) -> bool {
        self.blacklisted.remove(session).is_some()
    }

    /// Failures ever recorded for `session`.
    pub fn failures_total(&self, session: &str) -> u64 {
        self.failures_total.get(session).copied().unwrap_or(0)
    }

    /// The earliest moment any probe is due.
    pub fn next_due(&self) -> Option<Instant> {
        self.blacklisted.values().map(|e| e.next_probe).min()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn health() -> SessionHealth {
        SessionHealth::new(
            Duration::from_secs(1),
            Duration::from_secs(8),
            Duration::from_secs(60),
        )
    }

    #[test]
    fn failure_blacklists_and_probe_backs_off() {
        let mut h = health();
        let t0 = Instant::now();
        let out = h.record_failure("a:1", t0);
        assert!(out.newly_blacklisted);
        assert!(h.is_blacklisted("a:1"));
        assert!(h.due_for_probe(t0).is_empty());
        assert_eq!(
            h.due_for_probe(t0 + Duration::from_secs(1)),
            vec!["a:1".to_owned()]
        );
        let mut t = t0 + Duration::from_secs(1);
        let mut waits = Vec::new();
        for _ in 0..5 {
            h.probe_failed("a:1", t);
            let next = h.next_due().unwrap();
            waits.push((next - t).as_secs());
            t = next;
        }
        assert_eq!(waits, vec![2, 4, 8, 8, 8]);
        assert_eq!(h.record_failure("a:1", t).consecutive, 2);
        assert!(h.recovered("a:1"));
        assert!(!h.is_blacklisted("a:1"));
        assert!(!h.recovered("a:1"));
        assert_eq!(h.failures_total("a:1"), 2);
    }

    #[test]
    fn idle_sessions_are_forgotten() {
        let mut h = health();
        let t0 = Instant::now();
        h.record_failure("a:1", t0);
        h.note_requested("a:1", t0 + Duration::from_secs(30));
        assert!(!h.due_for_probe(t0 + Duration::from_secs(70)).is_empty());
        assert!(h.due_for_probe(t0 + Duration::from_secs(91)).is_empty());
        assert!(!h.is_blacklisted("a:1"));
    }
}
