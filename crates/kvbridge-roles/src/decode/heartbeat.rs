//! Health checks against every prefill bootstrap server this decode rank
//! uses; a server that misses `heartbeat_max_failures` checks in a row is
//! dead and every live room it serves fails.

use std::time::{Duration, Instant};

use super::Shared;

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
