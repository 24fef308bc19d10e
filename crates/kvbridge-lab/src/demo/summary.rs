//! What a demo run measured, as a readable table or one JSON object.

use serde::Serialize;

/// A failed request and why.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Failure {
    /// The room.
    pub room: u64,
    /// The reason (the first one recorded on any rank).
    pub reason: String,
}

/// The demo's result (`--json` prints exactly this).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Summary {
    /// Model preset.
    pub model: String,
    /// `prefill TP x PP -> decode TP`.
    pub topology: String,
    /// Requests run.
    pub requests: u64,
    /// Requests never started: the run drained before them
    /// (`--drain-after-s`); not among `requests`.
    pub drained: u64,
    /// Requests every decode rank received and verified.
    pub succeeded: u64,
    /// Requests that failed on some rank (fault injection included).
    pub failed: u64,
    /// Requests the decode aborted on purpose (`--abort-fraction`).
    pub aborted: u64,
    /// KV and aux bytes that arrived in verified rooms.
    pub bytes: u64,
    /// Wall time from the first room's start to the last conclusion, on the ranks' clock.
    pub seconds: f64,
    /// `bytes / seconds` in 10^9 bytes per second: the harness figure,
    /// whose window also holds the ranks' pattern fill and verification.
    pub gbps: f64,
    /// Seconds during which at least one verified room was in transfer (a
    /// prefill rank's first chunk to its Success).
    pub transfer_seconds: f64,
    /// `bytes / transfer_seconds` in 10^9 bytes per second: the transfer-only
    /// figure, without the fill and verification around the rooms.
    pub transfer_gbps: f64,
    /// Median per-request transfer latency (prefill: first chunk → Success).
    pub p50_ms: f64,
    /// 99th-percentile per-request transfer latency.
    pub p99_ms: f64,
    /// Bytes compared against the expected pattern.
    pub verified_bytes: u64,
    /// Bytes that differed (any is a bug).
    pub mismatched_bytes: u64,
    /// Each failed request's room and reason.
    pub failures: Vec<Failure>,
    /// What `--rogue` did during the run.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub rogue: Option<super::rogue::RogueReport>,
    /// With `--netns`: each host's interface counters at the end.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub hosts: Vec<super::netns::Traffic>,
    /// Each rank process's fds, threads and resident memory over the run.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub resources: Vec<super::resources::ProcessUsage>,
    /// The scripted `--fault` and what the rooms did around it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub fault: Option<super::faults::FaultReport>,
}

/// The `q`-quantile (nearest rank) of `values`.
pub fn percentile(values: &[f64], q: f64) -> f64 {
    if values.is_empty() {
        return 0.0;
    }
    let mut v = values.to_vec();
    v.sort_by(f64::total_cmp);
    let rank = ((q * v.len() as f64).ceil() as usize).clamp(1, v.len());
    v[rank - 1]
}

impl Summary {
    /// The human-readable report.
    pub fn render(&self) -> String {
        let mut out = String::new();
        out.push_str(&format!(
            "kvbridge demo: {} ({})\n",
            self.model, self.topology
        ));
        out.push_str(&format!(
            "  requests   {:>8}   succeeded {}   failed {}{}\n",
            self.requests,
            self.succeeded,
            self.failed,
            if self.aborted > 0 {
                format!(" ({} aborted on purpose)", self.aborted)
            } else {
                String::new()
            }
        ));
        if self.drained > 0 {
            out.push_str(&format!(
                "  drained    {:>8}   requests never started: the run drained at its deadline\n",
                self.drained
            ));
        }
        out.push_str(&format!(
            "  moved      {:>8.1} MiB in {:.2} s = {:.2} GB/s (harness: wall time with the \
             pattern fill and verification)\n",
            self.bytes as f64 / (1 << 20) as f64,
            self.seconds,
            self.gbps
        ));
        out.push_str(&format!(
            "  transfer   {:>8.2} GB/s over the {:.2} s rooms were in transfer (transfer only)\n",
            self.transfer_gbps, self.transfer_seconds
        ));
        out.push_str(&format!(
            "  latency    p50 {:.1} ms   p99 {:.1} ms\n",
            self.p50_ms, self.p99_ms
        ));
        out.push_str(&format!(
            "  verified   {} bytes, {} mismatched\n",
            self.verified_bytes, self.mismatched_bytes
        ));
        if let Some(r) = &self.rogue {
            out.push_str(&format!(
                "  rogue      {} forged control messages, {} idle engine connections, \
                 {} unsigned bootstrap writes ({} accepted), {} bodiless bootstrap writes, \
                 {} large frames parked in zmq handshakes\n\
                 \x20 ranks      at most {} fds, {} threads, {} MiB resident under attack\n",
                r.forged_messages,
                r.idle_connections,
                r.bootstrap_writes,
                r.bootstrap_accepted,
                r.slow_bodies,
                r.parked_frames,
                r.max_rank_fds,
                r.max_rank_threads,
                r.max_rank_rss_mib
            ));
        }
        let width = self.hosts.iter().map(|h| h.host.len()).max().unwrap_or(0);
        for h in &self.hosts {
            out.push_str(&format!(
                "  host       {:<width$} {:<15} received {:>12} bytes, sent {:>12} bytes\n",
                h.host, h.ip, h.rx_bytes, h.tx_bytes
            ));
        }
        if let Some(f) = &self.fault {
            out.push_str(&format!(
                "  fault      {:?} after {} rooms of decode rank 0, for {:.1} s; room outcomes \
                 (one per decode rank): {} failed from then on, {} succeeded during it \
                 and {} after{}\n",
                f.kind,
                f.after_rooms,
                f.seconds,
                f.failed_from_start,
                f.succeeded_during,
                f.succeeded_after,
                if f.injected {
                    ""
                } else {
                    " (never started: too few rooms)"
                }
            ));
        }
        if self.seconds >= 60.0 {
            for p in &self.resources {
                out.push_str(&format!(
                    "  process    {:<16} fds {} -> {} (max {}), threads {} -> {} (max {}), \
                     RSS {} -> {} MiB (max {})\n",
                    p.name,
                    p.settled.fds,
                    p.last.fds,
                    p.max.fds,
                    p.settled.threads,
                    p.last.threads,
                    p.max.threads,
                    p.settled.rss_mib,
                    p.last.rss_mib,
                    p.max.rss_mib
                ));
            }
        }
        for f in self.failures.iter().take(20) {
            out.push_str(&format!("  failed     room {:#x}: {}\n", f.room, f.reason));
        }
        if self.failures.len() > 20 {
            out.push_str(&format!(
                "  ... and {} more failures\n",
                self.failures.len() - 20
            ));
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_use_nearest_rank() {
        let v: Vec<f64> = (1..=100).map(f64::from).collect();
        assert_eq!(percentile(&v, 0.5), 50.0);
        assert_eq!(percentile(&v, 0.99), 99.0);
        assert_eq!(percentile(&[3.0], 0.99), 3.0);
        assert_eq!(percentile(&[], 0.5), 0.0);
    }
}
