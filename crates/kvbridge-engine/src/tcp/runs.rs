//! Cutting a batch of strided runs into `WriteRuns` requests: one
//! descriptor per run piece (a copy count and strides) instead of one per
//! copy, so heterogeneous-TP head slices cost the sender and the receiver
//! per run, not per slice. The receiver scatters the copies.
//!
//! **Never:** sends a run it has not checked whole: every run must be well
//! formed and its whole source span must lie in one registered region.

use kvbridge_block::{Run, expand_runs};

use super::request::Piece;
use super::{MAX_PIECES, MIN_REQUEST_BYTES, TcpEngine};
use crate::session::shutdown_error;
use crate::{BatchHandle, ErrorKind, Side, TransferError};

impl TcpEngine {
    /// Check the runs' sources, cut them into requests of about
    /// `request_bytes` (at most [`MAX_PIECES`] copies each) and queue them;
    /// `None` if there is nothing to move.
    pub(super) fn plan_runs(
        &self,
        session: &str,
        expected: u64,
        runs: &[Run],
    ) -> Result<Option<BatchHandle>, TransferError> {
        if self.inner().is_shutdown() {
            return Err(shutdown_error(session));
        }
        let cap = self.inner().cfg.tcp.request_bytes.max(1) as u64;
        let mut total = 0u64;
        {
            let regions = self.inner().regions.read_recursive();
            for (i, r) in runs.iter().enumerate() {
                let Some((src_span, _)) = r.spans().filter(|_| r.is_well_formed()) else {
                    return Err(crate::malformed_run(session, i));
                };
                if r.bytes() == 0 {
                    continue;
                }
                regions.check(r.src, src_span).map_err(|e| {
                    TransferError::new(
                        session,
                        Some(i),
                        ErrorKind::OutOfRegion(Side::Local),
                        e.to_string(),
                    )
                })?;
                total = total.saturating_add(r.bytes());
            }
        }
        if runs.iter().any(|r| r.count > 0 && r.len > cap) {
            // Copies longer than a request are cut into pieces as blocks.
            return self.plan(session, expected, &expand_runs(runs));
        }
        let lanes = self.inner().cfg.tcp.connections_per_peer.max(1) as u64;
        let step = total.div_ceil(lanes).clamp(cap.min(MIN_REQUEST_BYTES), cap);
        let requests = cut(runs, step);
        if requests.is_empty() {
            return Ok(None);
        }
        let whole = || {
            runs.iter()
                .enumerate()
                .filter(|(_, r)| r.bytes() > 0)
                .map(|(i, r)| piece(r, 0, r.count, i))
                .collect()
        };
        self.queue(session, expected, requests, whole)
    }
}

/// Copies `[from, from + copies)` of run `r` (batch index `index`) as a piece.
fn piece(r: &Run, from: u64, copies: u64, index: usize) -> Piece {
    let first = r.block(from);
    Piece {
        src: first.src,
        dst: first.dst,
        len: r.len,
        copies,
        src_stride: r.src_stride,
        dst_stride: r.dst_stride,
        block: index,
    }
}

/// The requests of well-formed `runs`: about `step` bytes and at most
/// [`MAX_PIECES`] copies each (a request holds at least one copy), runs
/// split between requests by copies, in order.
fn cut(runs: &[Run], step: u64) -> Vec<Vec<Piece>> {
    let mut requests = Vec::new();
    let mut cur: Vec<Piece> = Vec::new();
    let (mut cur_bytes, mut cur_copies) = (0u64, 0u64);
    for (i, r) in runs.iter().enumerate() {
        if r.bytes() == 0 {
            continue;
        }
        let mut done = 0u64;
        while done < r.count {
            let by_bytes = (step.saturating_sub(cur_bytes) / r.len).max(1);
            let by_copies = (MAX_PIECES as u64).saturating_sub(cur_copies).max(1);
            let k = (r.count - done).min(by_bytes).min(by_copies);
            cur.push(piece(r, done, k, i));
            cur_bytes += k * r.len;
            cur_copies += k;
            done += k;
            if cur_bytes >= step || cur_copies >= MAX_PIECES as u64 {
                requests.push(std::mem::take(&mut cur));
                (cur_bytes, cur_copies) = (0, 0);
            }
        }
    }
    if !cur.is_empty() {
        requests.push(cur);
    }
    requests
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn run(src: u64, dst: u64, len: u64, count: u64, ss: u64, ds: u64) -> Run {
        Run {
            src,
            dst,
            len,
            count,
            src_stride: ss,
            dst_stride: ds,
        }
    }

    proptest! {
        /// Cutting keeps every copy once, in order, within the limits.
        #[test]
        fn cut_keeps_every_copy_in_order(
            shapes in prop::collection::vec((1u64..600, 0u64..300, 0u64..64), 1..12),
            step in 1u64..100_000,
        ) {
            let runs: Vec<Run> = shapes
                .iter()
                .enumerate()
                .map(|(i, &(len, count, gap))| {
                    let base = (i as u64) << 32;
                    run(base, base + (1 << 31), len, count, len + gap, len + 2 * gap)
                })
                .collect();
            let requests = cut(&runs, step);
            let mut copies = Vec::new();
            for req in &requests {
                prop_assert!(!req.is_empty());
                let n: u64 = req.iter().map(|p| p.copies).sum();
                prop_assert!(n <= MAX_PIECES as u64);
                let bytes: u64 = req.iter().map(Piece::bytes).sum();
                let last_len = req.last().map_or(0, |p| p.len);
                // Over `step` by less than one copy at most.
                prop_assert!(bytes < step + last_len || n == 1);
                for p in req {
                    prop_assert!(p.copies > 0);
                    for c in 0..p.copies {
                        let (s, d) = p.copy_at(c);
                        copies.push((p.block, s, d, p.len));
                    }
                }
            }
            let want: Vec<_> = runs
                .iter()
                .enumerate()
                .flat_map(|(i, r)| r.blocks().map(move |b| (i, b.src, b.dst, b.len)))
                .collect();
            prop_assert_eq!(copies, want);
        }
    }
}
