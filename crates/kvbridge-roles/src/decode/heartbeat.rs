//! Health checks against every prefill bootstrap server this decode rank
//! uses; a server that misses `heartbeat_max_failures` checks in a row is
//! dead and every live room it serves fails.

use std::time::{Duration, Instant};

use super::Shared;

/// Most ABORTs sent again per heartbeat.
const MAX_RESENDS: usize = 4096;

/// Sends the ABORT of every room a fenced prefill rank still owes an ACK
/// for again: one lost in a partition would otherwise keep the fence (and
/// with it every transfer from that rank) for ever. A rank acknowledges an
/// ABORT for a room it no longer knows at once.
fn resend_owed_aborts(shared: &Shared) {
    let super::room::Output::Owed(owed) =
        shared.step(super::room::Input::OwedAborts { max: MAX_RESENDS })
    else {
        return;
    };
    for (room, endpoint, generation) in owed {
        let message = kvbridge_wire::Abort {
            room,
            decode_ip: shared.config.local_ip.as_str().into(),
            decode_port: shared.rank_port,
            generation,
        };
        if let Err(e) = shared.send_sealed(&endpoint, message.encode()) {
            tracing::debug!(room, error = %e, "cannot send the abort again");
        }
    }
}

/// Checks until the manager stops.
pub(crate) fn run(shared: &Shared) {
    let agent = crate::http::agent(Duration::from_secs(3));
    let mut next = Instant::now() + shared.config.heartbeat_interval;
    loop {
        let wait = next.saturating_duration_since(Instant::now());
        if shared.stop_signal.wait(wait) {
            return;
        }
        next = Instant::now() + shared.config.heartbeat_interval;
        resend_owed_aborts(shared);
        let addrs: Vec<String> = shared.prefills.lock().mapping.keys().cloned().collect();
        for addr in addrs {
            let healthy = matches!(
                agent.get(&format!("http://{addr}/health")).call(),
                Ok(resp) if resp.status() == 200
            );
            let failures = {
                let mut prefills = shared.prefills.lock();
                let n = prefills.heartbeat_failures.entry(addr.clone()).or_default();
                *n = if healthy { 0 } else { n.saturating_add(1) };
                *n
            };
            if !healthy {
                tracing::info!(%addr, failures, "prefill bootstrap server missed a heartbeat");
            }
            if failures >= shared.config.heartbeat_max_failures.max(1) {
                shared.fail_prefill(&addr);
            }
        }
    }
}
