//! Probes blacklisted decode sessions with backoff and lifts the blacklist
//! when one answers again (sglang `_failed_session_probe_loop`).

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use super::Shared;

/// Ticks until the manager stops.
pub(crate) fn run(shared: &Shared) {
    let tick = Duration::from_millis(100);
    while !shared.stop_signal.wait(tick) {
        let due = shared.health.lock().due_for_probe(Instant::now());
        for session in due {
            if shared.stopped.load(Ordering::SeqCst) {
                return;
            }
            match shared.engine.probe(&session) {
                Ok(()) => {
                    if shared.health.lock().recovered(&session) {
                        shared.metrics.session_recoveries.inc();
                        tracing::info!(%session, "session recovered via probe; un-blacklisted");
                    }
                }
                Err(e) => {
                    shared.health.lock().probe_failed(&session, Instant::now());
                    tracing::debug!(%session, error = %e, "probe still failing");
                }
            }
        }
    }
}
