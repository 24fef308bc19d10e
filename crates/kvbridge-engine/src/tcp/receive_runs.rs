//! Receiving `CheckRuns` and `WriteRuns` requests: each run descriptor is
//! checked whole (well formed, its whole destination span inside one
//! registered region), then a write's copies are received like a `Write`
//! request's blocks (`scatter`).
//!
//! **Never:** expands a run before checking it, or accepts more copies per
//! request than [`wire::MAX_WRITE_BLOCKS`] (a peer cannot make the receiver
//! allocate more than that many copy descriptors).

use std::io;

use kvbridge_mem::MemoryKind;

use super::server::{BOUNCE_CAP, ServerConn};
use crate::session::io::{Budget, read_exact_by};
use crate::session::wire::{self, Header, RunDesc, Status};

/// Run descriptors a check reads at a time.
const CHECK_CHUNK: usize = 2048;

impl ServerConn<'_> {
    /// Receive one `WriteRuns` request; `None` if the descriptors are
    /// malformed or contradict the header.
    pub(super) fn write_runs(
        &mut self,
        h: &Header,
        b: &mut Budget<'_>,
    ) -> io::Result<Option<(Status, u32)>> {
        let n = h.count as usize;
        let mut raw = vec![0u8; n * wire::RUN_DESC_LEN];
        read_exact_by(self.fd, &mut raw, b)?;
        let mut runs = Vec::with_capacity(n);
        let (mut sum, mut copies) = (0u64, 0u64);
        for i in 0..n {
            let r = RunDesc::at(&raw, i);
            let (Some(span), Some(bytes)) = (r.span(), r.bytes()) else {
                return Ok(None);
            };
            match (sum.checked_add(bytes), copies.checked_add(r.copies)) {
                (Some(s), Some(c)) if c <= u64::from(wire::MAX_WRITE_BLOCKS) => {
                    (sum, copies) = (s, c);
                }
                _ => return Ok(None),
            }
            runs.push((r, span));
        }
        if sum != h.payload {
            return Ok(None);
        }
        if self.bounce.len() < BOUNCE_CAP {
            self.bounce.resize(BOUNCE_CAP, 0);
        }
        let regions = self.inner.regions.read_recursive();
        let mut run_kinds = Vec::with_capacity(n);
        for (i, (r, span)) in runs.iter().enumerate() {
            match regions.find(r.dst, *span) {
                Some(region) => run_kinds.push(region.kind),
                None => {
                    drop(regions);
                    self.refused(
                        "run write outside our registered regions refused; request discarded",
                        i,
                    );
                    crate::session::io::discard_by(self.fd, h.payload, &mut self.bounce, b)?;
                    return Ok(Some((Status::OutOfRegion, i as u32)));
                }
            }
        }
        let generation = regions.generation();
        drop(regions);
        // Every copy as a `(dst, len)` descriptor, as a `Write` carries them.
        self.descs.clear();
        let mut kinds: Vec<MemoryKind> = Vec::with_capacity(copies as usize);
        let mut starts = Vec::with_capacity(n);
        for ((r, span), kind) in runs.iter().zip(run_kinds) {
            starts.push(kinds.len());
            if r.copies == 1 || r.stride == r.len {
                // Back to back: one range (received in place when long).
                wire::push_desc(&mut self.descs, r.dst, *span);
                kinds.push(kind);
                continue;
            }
            for c in 0..r.copies {
                wire::push_desc(&mut self.descs, r.dst + c * r.stride, r.len);
                kinds.push(kind);
            }
        }
        let (status, index) = self.receive(h, generation, &kinds, b)?;
        // Acks name the run, not the copy.
        let run = starts
            .partition_point(|&s| s <= index as usize)
            .saturating_sub(1);
        Ok(Some((status, run as u32)))
    }

    /// Validate every run destination of a batch, streaming the descriptors.
    pub(super) fn check_runs(
        &mut self,
        count: u32,
        b: &mut Budget<'_>,
    ) -> io::Result<(Status, u32)> {
        let mut first_bad: Option<(Status, u32)> = None;
        let mut done: usize = 0;
        let total = count as usize;
        let mut raw = Vec::new();
        while done < total {
            let n = (total - done).min(CHECK_CHUNK);
            raw.resize(n * wire::RUN_DESC_LEN, 0);
            read_exact_by(self.fd, &mut raw, b)?;
            if first_bad.is_none() {
                let regions = self.inner.regions.read_recursive();
                for i in 0..n {
                    let r = RunDesc::at(&raw, i);
                    let index = (done + i) as u32;
                    let bad = match r.span() {
                        None => Some(Status::BadRequest),
                        Some(span) => regions
                            .find(r.dst, span)
                            .is_none()
                            .then_some(Status::OutOfRegion),
                    };
                    if let Some(status) = bad {
                        first_bad = Some((status, index));
                        break;
                    }
                }
            }
            done += n;
        }
        Ok(match first_bad {
            Some((status, i)) => {
                self.refused("batch check refused a run destination", i as usize);
                (status, i)
            }
            None => (Status::Ok, 0),
        })
    }
}
