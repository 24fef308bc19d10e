//! Tallies a demo run: each request's outcome on every rank, into the
//! summary.

use std::collections::HashMap;

use kvbridge_roles::StagingMode;

use super::DemoArgs;
use super::plan::Plan;
use super::summary::{Failure, Summary, percentile};
use crate::rank::EngineKind;
use crate::rank::workload::Request;

/// One room's outcome on one rank.
#[derive(Debug, Clone, Default)]
pub(super) struct Outcome {
    pub success: bool,
    pub reason: Option<String>,
    pub latency_ms: f64,
    pub verified: u64,
    pub mismatched: u64,
    pub aborted: bool,
    pub timed_out: bool,
    /// When the room concluded (ms since the Unix epoch; 0: not known).
    pub end_unix_ms: f64,
}

/// Seconds covered by the union of `intervals` (`(start, end)` in ms):
/// how long at least one of them was open.
fn covered_seconds(mut intervals: Vec<(f64, f64)>) -> f64 {
    intervals.retain(|(s, e)| e > s);
    intervals.sort_by(|a, b| a.0.total_cmp(&b.0));
    let mut total = 0.0;
    let mut open: Option<(f64, f64)> = None;
    for (s, e) in intervals {
        open = match open {
            Some((os, oe)) if s <= oe => Some((os, oe.max(e))),
            Some((os, oe)) => {
                total += oe - os;
                Some((s, e))
            }
            None => Some((s, e)),
        };
    }
    if let Some((os, oe)) = open {
        total += oe - os;
    }
    total / 1e3
}

/// The summary of a run's outcomes; requests from `drained_below` on that
/// no decode rank started are counted as drained, not run.
pub(super) fn summarize(
    args: &DemoArgs,
    plan: &Plan,
    decode: &HashMap<(u64, u64), Outcome>,
    prefill: &HashMap<(u64, u64), Outcome>,
    seconds: f64,
    drained_below: Option<u64>,
) -> Summary {
    let all = plan.workload.requests();
    let decodes = plan.decode_files.len() as u64;
    // A drained request was never started: no decode rank has its outcome.
    let (requests, drained): (Vec<&Request>, Vec<&Request>) = all.iter().partition(|r| {
        drained_below.is_none_or(|b| r.index < b)
            || (0..decodes).any(|k| decode.contains_key(&(k, r.room)))
    });
    let (mut succeeded, mut failed, mut aborted, mut bytes) = (0, 0, 0, 0);
    let (mut verified, mut mismatched) = (0, 0);
    let mut latencies = Vec::new();
    // Prefill ranks' transfer intervals (first chunk → Success) of the
    // rooms that succeeded.
    let mut in_transfer = Vec::new();
    let mut failures = Vec::new();
    for r in &requests {
        let d: Vec<&Outcome> = (0..plan.decode_files.len() as u64)
            .filter_map(|k| decode.get(&(k, r.room)))
            .collect();
        let p: Vec<&Outcome> = (0..plan.prefill_files.len() as u64)
            .filter_map(|k| prefill.get(&(k, r.room)))
            .collect();
        verified += d.iter().map(|o| o.verified).sum::<u64>();
        mismatched += d.iter().map(|o| o.mismatched).sum::<u64>();
        let ok =
            d.len() == plan.decode_files.len() && d.iter().all(|o| o.success && o.mismatched == 0);
        if d.iter().any(|o| o.aborted) {
            aborted += 1;
        }
        if ok {
            succeeded += 1;
            bytes += d.iter().map(|o| o.verified).sum::<u64>();
            in_transfer.extend(
                p.iter()
                    .filter(|o| o.success && o.end_unix_ms > 0.0 && o.latency_ms > 0.0)
                    .map(|o| (o.end_unix_ms - o.latency_ms, o.end_unix_ms)),
            );
            let lat = p
                .iter()
                .filter(|o| o.success)
                .map(|o| o.latency_ms)
                .fold(0.0, f64::max);
            latencies.push(if lat > 0.0 {
                lat
            } else {
                d.iter().map(|o| o.latency_ms).fold(0.0, f64::max)
            });
        } else {
            failed += 1;
            let reason = d
                .iter()
                .find(|o| o.aborted || o.timed_out)
                .and_then(|o| o.reason.clone())
                .or_else(|| p.iter().find_map(|o| o.reason.clone()))
                .or_else(|| d.iter().find_map(|o| o.reason.clone()))
                .or_else(|| {
                    d.iter()
                        .find(|o| o.mismatched > 0)
                        .map(|o| format!("{} bytes mismatched", o.mismatched))
                })
                .unwrap_or_else(|| "no result from some decode rank".into());
            failures.push(Failure {
                room: r.room,
                reason,
            });
        }
    }
    let transfer_seconds = covered_seconds(in_transfer);
    Summary {
        model: plan.model.name.clone(),
        topology: format!(
            "prefill {}TP{} PP{}{} -> decode TP{}{}, {} engine{}{}",
            match (args.dp, args.dp_round_robin) {
                (1, _) => String::new(),
                (dp, true) => format!("DP{dp} (round robin) "),
                (dp, false) => format!("DP{dp} "),
            },
            args.prefill_tp,
            args.prefill_pp,
            match (args.prefill_cp, args.all_cp_ranks) {
                (1, _) => String::new(),
                (cp, true) => format!(" CP{cp} (all ranks send)"),
                (cp, false) => format!(" CP{cp}"),
            },
            args.decode_tp,
            match (args.decode_cp, args.hisparse) {
                (1, false) => String::new(),
                (1, true) => " HiSparse".into(),
                (cp, _) => format!(" DCP{cp}"),
            },
            match args.engine {
                EngineKind::Tcp => "tcp",
                EngineKind::Ipc => "ipc",
                EngineKind::Ucx => "ucx",
            },
            match (args.device, args.host_kv_buffers) {
                (None, _) => String::new(),
                (Some(d), 0) => format!(", KV on GPU {d}"),
                (Some(d), n) => format!(", KV on GPU {d} ({n} prefill buffers in host memory)"),
            },
            match args.staging {
                StagingMode::On => ", staging on",
                StagingMode::Off => ", staging off",
                StagingMode::Auto => "",
            }
        ),
        requests: requests.len() as u64,
        drained: drained.len() as u64,
        succeeded,
        failed,
        aborted,
        bytes,
        seconds,
        gbps: if seconds > 0.0 {
            bytes as f64 / seconds / 1e9
        } else {
            0.0
        },
        transfer_seconds,
        transfer_gbps: if transfer_seconds > 0.0 {
            bytes as f64 / transfer_seconds / 1e9
        } else {
            0.0
        },
        p50_ms: percentile(&latencies, 0.5),
        p99_ms: percentile(&latencies, 0.99),
        verified_bytes: verified,
        mismatched_bytes: mismatched,
        failures,
        rogue: None,
        fault: None,
        hosts: Vec::new(),
        resources: Vec::new(),
    }
}

#[cfg(test)]
mod tests {
    use super::covered_seconds;

    #[test]
    fn covered_time_is_the_union_of_the_intervals() {
        assert_eq!(covered_seconds(vec![]), 0.0);
        // Overlapping, nested, touching and apart; given out of order.
        let spans = vec![
            (5_000.0, 6_000.0),
            (1_000.0, 2_000.0),
            (1_500.0, 3_000.0),
            (1_200.0, 1_300.0),
            (3_000.0, 3_500.0),
            (7_000.0, 7_000.0),
        ];
        assert!((covered_seconds(spans) - 3.5).abs() < 1e-9);
    }
}
