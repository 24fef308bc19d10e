//! [`PeerState`]: one peer session's state between batches — its control
//! connection, the peer's export table and our mappings of it, the holds,
//! the copier — and the preparation and launch of a batch under it.

use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::time::Instant;

use kvbridge_mem::MemoryKind;
use kvbridge_mem::cuda::{CudaError, IpcHandle, IpcMapping};

use super::copier::{self, Copier, Slot};
use super::pipe::{IDLE_RELEASE, MAX_ATTEMPTS, Pipe, Shared};
use super::schedule::{self, Batch, Context, CopyTuning, Miss, Prepared, RangeMap, RunSplit};
use super::table::{self, Export};
use crate::session::control::{Control, ControlHost};
use crate::{ErrorKind, Side, TransferError};

/// An opened peer allocation and the handle it was opened from.
#[derive(Debug)]
struct Opened {
    handle: [u8; 64],
    mapping: IpcMapping,
}

/// Everything a session keeps between batches.
#[derive(Debug)]
pub(super) struct PeerState {
    session: String,
    control: Option<Control>,
    incarnation: u64,
    table: Vec<Export>,
    opened: HashMap<u64, Opened>,
    /// The table as a range map with the delta into our mappings.
    remote: RangeMap,
    /// Regions of the peer this session holds (`(start, len)`).
    held: Vec<(u64, u64)>,
    /// Our device regions as a range map, and the registry generation.
    local: Option<(u64, RangeMap)>,
    copier: Option<Copier>,
    /// Reused per batch.
    acc: Prepared,
    /// The chunks of the batch of runs being prepared.
    split: RunSplit,
    last_use: Instant,
}

impl PeerState {
    pub(super) fn new(session: &str) -> Self {
        Self {
            session: session.to_owned(),
            control: None,
            incarnation: 0,
            table: Vec::new(),
            opened: HashMap::new(),
            remote: RangeMap::default(),
            held: Vec::new(),
            local: None,
            copier: None,
            acc: Prepared::default(),
            split: RunSplit::default(),
            last_use: Instant::now(),
        }
    }

    pub(super) fn err(
        &self,
        block: Option<usize>,
        kind: ErrorKind,
        detail: impl Into<String>,
    ) -> TransferError {
        TransferError::new(&self.session, block, kind, detail)
    }

    pub(super) fn io(&self, e: &CudaError) -> TransferError {
        self.err(None, ErrorKind::Io, e.to_string())
    }

    /// Wait for every copy this session launched.
    pub(super) fn sync(&self) {
        if let Some(c) = &self.copier
            && let Err(e) = c.synchronize()
        {
            tracing::warn!(session = %self.session, error = %e, "waiting for ipc copies failed");
        }
    }

    /// Drop the control connection (and with it the peer's holds), after
    /// our copies finished.
    pub(super) fn drop_control(&mut self) {
        self.sync();
        self.control = None;
        self.held.clear();
    }

    /// Forget the peer: close mappings, drop the connection and the table.
    pub(super) fn reset(&mut self, shared: &Shared) {
        self.drop_control();
        self.table.clear();
        let closed = self.opened.len() as u64;
        self.opened.clear();
        shared
            .counters
            .mappings_closed
            .fetch_add(closed, Ordering::Relaxed);
        self.remote = RangeMap::default();
    }

    /// A usable control connection; a new incarnation drops the old state.
    pub(super) fn connect(&mut self, shared: &Shared) -> Result<(), TransferError> {
        if self.control.as_mut().is_some_and(Control::is_stale) {
            self.drop_control();
        }
        if self.control.is_none() {
            let c = shared.host.control(&self.session)?;
            if self.incarnation != 0 && c.incarnation() != self.incarnation {
                tracing::info!(session = %self.session, "ipc peer restarted; reopening its memory");
                self.reset(shared);
            }
            self.incarnation = c.incarnation();
            self.control = Some(c);
        }
        Ok(())
    }

    /// Rebuild the range map of the peer's regions (delta 0 where unopened).
    pub(super) fn remap(&mut self) {
        self.remote = RangeMap::new(
            self.table
                .iter()
                .map(|e| {
                    let delta = self
                        .opened
                        .get(&e.base)
                        .map_or(0, |o| o.mapping.addr() as i64 - e.base as i64);
                    (e.start, e.len, delta)
                })
                .collect(),
        );
    }

    /// Fetch the peer's export table; close mappings of allocations it no longer exports.
    pub(super) fn refresh(&mut self, shared: &Shared) -> Result<(), TransferError> {
        let Some(c) = self.control.as_mut() else {
            return Err(self.err(None, ErrorKind::Io, "no control connection"));
        };
        let raw = match c.exports() {
            Ok(raw) => raw,
            Err(e) => {
                self.drop_control();
                return Err(e);
            }
        };
        let Some(t) = table::decode(&raw) else {
            self.drop_control();
            return Err(self.err(
                None,
                ErrorKind::Refused,
                "peer sent a malformed export table",
            ));
        };
        let gone =
            |base: &u64, o: &Opened| !t.iter().any(|e| e.base == *base && e.handle == o.handle);
        if self.opened.iter().any(|(b, o)| gone(b, o)) {
            // Nothing may still be copying through a mapping we close.
            self.sync();
            let before = self.opened.len();
            self.opened.retain(|b, o| !gone(b, o));
            shared
                .counters
                .mappings_closed
                .fetch_add((before - self.opened.len()) as u64, Ordering::Relaxed);
        }
        self.table = t;
        self.remap();
        Ok(())
    }

    /// Open (once) the allocations of the table entries `used`; whether
    /// any was opened (translations change then).
    pub(super) fn open(
        &mut self,
        shared: &Shared,
        ordinal: i32,
        used: &[usize],
    ) -> Result<bool, TransferError> {
        let mut opened_any = false;
        for &i in used {
            let Some(e) = self.table.get(i) else {
                continue;
            };
            if self
                .opened
                .get(&e.base)
                .is_some_and(|o| o.handle == e.handle)
            {
                continue;
            }
            let h = IpcHandle {
                bytes: e.handle,
                base: e.base,
                size: e.size,
            };
            let mapping = IpcMapping::open(ordinal, &h).map_err(|x| self.io(&x))?;
            shared
                .counters
                .mappings_opened
                .fetch_add(1, Ordering::Relaxed);
            self.opened.insert(
                e.base,
                Opened {
                    handle: e.handle,
                    mapping,
                },
            );
            opened_any = true;
        }
        if opened_any {
            self.remap();
        }
        Ok(opened_any)
    }

    /// Hold the table entries `used` that are not held yet.
    pub(super) fn hold(&mut self, used: &[usize], pipe: &Pipe) -> Result<(), TransferError> {
        let missing: Vec<(u64, u64)> = used
            .iter()
            .filter_map(|&i| self.table.get(i))
            .map(|e| (e.start, e.len))
            .filter(|r| !self.held.contains(r))
            .collect();
        if missing.is_empty() {
            return Ok(());
        }
        let Some(c) = self.control.as_mut() else {
            return Err(self.err(None, ErrorKind::Io, "no control connection"));
        };
        match c.lease(&missing) {
            Ok(()) => {
                self.held.extend_from_slice(&missing);
                pipe.holding.store(true, Ordering::Release);
                Ok(())
            }
            Err(e) if e.kind == ErrorKind::OutOfRegion(Side::Remote) => Err(e),
            Err(e) => {
                self.drop_control();
                Err(e)
            }
        }
    }

    /// Act on a revoke the peer sent (seen while reading acks or by
    /// polling now): wait for our copies, release every hold, re-fetch the
    /// table. Returns whether there was one.
    pub(super) fn answer_revoke(
        &mut self,
        shared: &Shared,
        pipe: &Pipe,
    ) -> Result<bool, TransferError> {
        let Some(c) = self.control.as_mut() else {
            return Ok(false);
        };
        match c.poll_revoke() {
            Ok(false) => return Ok(false),
            Ok(true) => {}
            Err(e) => {
                self.drop_control();
                pipe.holding.store(false, Ordering::Release);
                return Err(e);
            }
        }
        self.sync();
        let released = self.control.as_mut().map(Control::release);
        self.held.clear();
        pipe.holding.store(false, Ordering::Release);
        if !matches!(released, Some(Ok(()))) {
            self.drop_control();
            return match released {
                Some(Err(e)) => Err(e),
                _ => Ok(true),
            };
        }
        self.refresh(shared)?;
        Ok(true)
    }

    /// Called by the completion thread while the session is idle: answer
    /// revokes; release every hold once idle for long.
    pub(super) fn service_idle(&mut self, shared: &Shared, pipe: &Pipe) {
        match self.answer_revoke(shared, pipe) {
            Ok(true) => return,
            Ok(false) => {}
            Err(e) => {
                tracing::debug!(session = %self.session, error = %e, "ipc control connection lost");
                return;
            }
        }
        if self.last_use.elapsed() >= IDLE_RELEASE && !self.held.is_empty() {
            self.sync();
            let released = self.control.as_mut().map(Control::release);
            self.held.clear();
            if !matches!(released, Some(Ok(()))) {
                self.drop_control();
            }
        }
        if self.held.is_empty() {
            pipe.holding.store(false, Ordering::Release);
        }
    }

    /// Our device regions as a range map (cached per registry generation),
    /// and the GPU of the batch's first source.
    pub(super) fn local_map(
        &mut self,
        registry: &kvbridge_mem::RegionRegistry,
        batch: Batch<'_>,
    ) -> i32 {
        let generation = registry.generation();
        if self.local.as_ref().is_none_or(|(g, _)| *g != generation) {
            let map = RangeMap::new(
                registry
                    .regions()
                    .filter(|r| matches!(r.kind, MemoryKind::Device { .. }))
                    .map(|r| (r.addr, r.len, 0))
                    .collect(),
            );
            self.local = Some((generation, map));
        }
        batch
            .first_source()
            .and_then(|(src, len)| registry.find(src, len))
            .and_then(|r| match r.kind {
                MemoryKind::Device { ordinal } => Some(ordinal),
                _ => None,
            })
            .unwrap_or(0)
    }

    /// A copier for `ordinal` (waiting for the old one's copies if it changes).
    pub(super) fn copier(&mut self, shared: &Shared, ordinal: i32) -> Result<(), TransferError> {
        if self.copier.as_ref().is_some_and(|c| c.ordinal() == ordinal) {
            return Ok(());
        }
        self.sync();
        self.copier = Some(Copier::new(ordinal, shared.tuning).map_err(|e| self.io(&e))?);
        Ok(())
    }

    /// An idle slot for `n` descriptors.
    pub(super) fn slot(&self, pipe: &Pipe, ordinal: i32, n: usize) -> Result<Slot, TransferError> {
        let taken = pipe.free.lock().take(ordinal, n);
        let mut slot = match taken {
            Some(s) => s,
            None => {
                pipe.slots_made.fetch_add(1, Ordering::Relaxed);
                Slot::new(ordinal, n).map_err(|e| self.io(&e))?
            }
        };
        slot.reserve(n, 0).map_err(|e| self.io(&e))?;
        Ok(slot)
    }

    /// Prepare the whole batch into `slot`, each part uploaded as soon as
    /// it is written.
    pub(super) fn prepare(
        &mut self,
        batch: Batch<'_>,
        slot: &mut Slot,
        tuning: &CopyTuning,
    ) -> Result<(), (usize, Miss)> {
        self.acc.clear();
        let (Some((_, local)), Some(copier)) = (self.local.as_ref(), self.copier.as_ref()) else {
            return Err((0, Miss::Source));
        };
        let blocks = match batch {
            Batch::Blocks(blocks) => blocks,
            Batch::Runs(runs) => {
                // Few descriptors (two per up to 64 copies): prepared (on
                // the preparation threads for large batches), uploaded at launch.
                let (split, remote, acc) = (&self.split, &self.remote, &mut self.acc);
                let (pool, out) = (copier::prep_pool(), slot.descs_mut());
                return schedule::prepare_runs(
                    runs,
                    split,
                    Context {
                        local,
                        remote,
                        tuning,
                        pool,
                    },
                    out,
                    acc,
                );
            }
        };
        let uploader = copier.uploader(slot);
        let failed = std::sync::atomic::AtomicBool::new(false);
        let written = |at: usize, n: usize| {
            // SAFETY: the slot is idle and outlives the upload (the batch
            // waits for it); these descriptors stay as written until its
            // batch completes (a later attempt rewrites them with newer
            // contents and uploads them again, after).
            if let Err(e) = unsafe { uploader.upload(at, n) } {
                tracing::warn!(error = %e, "descriptor upload failed");
                failed.store(true, Ordering::Relaxed);
            }
        };
        schedule::prepare::<true>(
            blocks,
            Context {
                local,
                remote: &self.remote,
                tuning,
                pool: copier::prep_pool(),
            },
            slot.descs_mut(),
            &mut self.acc,
            &written,
        )?;
        if failed.load(Ordering::Relaxed) {
            return Err((0, Miss::Source));
        }
        Ok(())
    }

    /// Check, translate, hold and launch one batch; returns its slot (in
    /// flight) and byte count.
    pub(super) fn submit(
        &mut self,
        shared: &Shared,
        pipe: &Pipe,
        batch: Batch<'_>,
        expected: u64,
    ) -> Result<(Slot, u64), TransferError> {
        let t0 = Instant::now();
        self.last_use = t0;
        self.connect(shared)?;
        if expected != 0 && expected != self.incarnation {
            return Err(self.err(
                None,
                ErrorKind::PeerRestarted,
                format!(
                    "planned for incarnation {expected:#x}, connected to {:#x}",
                    self.incarnation
                ),
            ));
        }
        // Our sources stay registered until the batch is launched; a
        // deregistration then waits for the copies (`IpcEngine::drain`).
        let registry = shared.host.registry().read_recursive();
        let ordinal = self.local_map(&registry, batch);
        self.copier(shared, ordinal)?;
        if let Some(c) = &self.copier {
            c.make_current().map_err(|e| self.io(&e))?;
        }
        if self.table.is_empty() {
            self.refresh(shared)?;
        }
        let entries = match batch {
            Batch::Blocks(b) => b.len(),
            Batch::Runs(r) => {
                self.split = RunSplit::new(r, &shared.tuning, copier::prep_pool());
                self.split.entries()
            }
        };
        let mut slot = self.slot(pipe, ordinal, entries)?;
        let r = self.prepare_held(shared, pipe, batch, &mut slot, ordinal);
        let t_prep = Instant::now();
        let launched = r.and_then(|()| self.launch(batch, &mut slot));
        drop(registry);
        if let Err(e) = launched {
            // Uploads (or copies) of this slot may still read its buffers.
            self.sync_uploads();
            self.sync();
            pipe.free.lock().give_back(slot);
            return Err(e);
        }
        let bytes = self.acc.kernel_bytes + self.acc.memcpy.iter().map(|b| b.len).sum::<u64>();
        tracing::trace!(
            items = batch.len(),
            runs = self.acc.runs,
            prepare_us = (t_prep - t0).as_micros() as u64,
            launch_us = t_prep.elapsed().as_micros() as u64,
            "ipc batch launched"
        );
        Ok((slot, bytes))
    }

    /// Wait for the descriptor uploads enqueued so far.
    pub(super) fn sync_uploads(&self) {
        if let Some(c) = &self.copier
            && let Err(e) = c.sync_uploads()
        {
            tracing::warn!(session = %self.session, error = %e, "waiting for descriptor uploads failed");
        }
    }

    /// Prepare the batch until every touched allocation is opened and every
    /// touched region held, and no revoke is pending.
    pub(super) fn prepare_held(
        &mut self,
        shared: &Shared,
        pipe: &Pipe,
        batch: Batch<'_>,
        slot: &mut Slot,
        ordinal: i32,
    ) -> Result<(), TransferError> {
        let tuning = shared.tuning;
        let mut refreshed = false;
        for _ in 0..MAX_ATTEMPTS {
            match self.prepare(batch, slot, &tuning) {
                Ok(()) => {}
                Err((i, Miss::Shape)) => return Err(crate::malformed_run(&self.session, i)),
                Err((i, Miss::Source)) => {
                    return Err(self.err(
                        Some(i),
                        ErrorKind::OutOfRegion(Side::Local),
                        "source outside this engine's registered device memory",
                    ));
                }
                Err((i, Miss::Destination)) => {
                    if !refreshed {
                        self.refresh(shared)?;
                        refreshed = true;
                        continue;
                    }
                    return Err(self.err(
                        Some(i),
                        ErrorKind::OutOfRegion(Side::Remote),
                        "destination outside the peer's registered device memory",
                    ));
                }
            }
            let used = std::mem::take(&mut self.acc.used);
            let step = match self.open(shared, ordinal, &used) {
                Ok(true) => Ok(true),
                Ok(false) => self.hold(&used, pipe).map(|()| false),
                Err(e) => Err(e),
            };
            self.acc.used = used;
            match step {
                Ok(true) => continue, // translations changed
                Ok(false) => {}
                Err(e) if e.kind == ErrorKind::OutOfRegion(Side::Remote) && !refreshed => {
                    self.refresh(shared)?;
                    refreshed = true;
                    continue;
                }
                Err(e) => return Err(e),
            }
            if self.answer_revoke(shared, pipe)? {
                continue; // holds dropped, table re-fetched
            }
            return Ok(());
        }
        Err(self.err(
            None,
            ErrorKind::Io,
            "the peer's regions kept changing while preparing the batch",
        ))
    }

    /// Append the pieces, upload them and launch the prepared batch.
    pub(super) fn launch(
        &mut self,
        batch: Batch<'_>,
        slot: &mut Slot,
    ) -> Result<(), TransferError> {
        // Entries written while preparing: one per block, or two per run descriptor.
        let n = match batch {
            Batch::Blocks(b) => b.len(),
            Batch::Runs(_) => 2 * self.acc.runs,
        };
        let Some(copier) = self.copier.as_ref() else {
            return Err(self.err(None, ErrorKind::Io, "no copier"));
        };
        let io =
            |e: CudaError| TransferError::new(&self.session, None, ErrorKind::Io, e.to_string());
        let total = n + self.acc.pieces.len();
        let grows = total > slot.capacity();
        if grows {
            // The slot's buffers are replaced: let the uploads from them finish.
            copier.sync_uploads().map_err(io)?;
        }
        let descs = copier.finish_descs(slot, n, &self.acc).map_err(io)?;
        // Block descriptors were uploaded while prepared; runs are not.
        let from = match batch {
            Batch::Blocks(_) if !grows => n,
            _ => 0,
        };
        // SAFETY: the slot is idle; its descriptors were all written (the
        // per-block ones kept across a growth) and stay until the batch
        // completes.
        unsafe { copier.upload(slot, from, descs - from) }.map_err(io)?;
        // SAFETY: sources lie in our registered device regions (checked;
        // a deregistration waits for launched copies); destinations lie in
        // regions the peer exported and we hold (its deregistration revokes
        // the hold and waits for our release, sent only after our copies
        // finished), reached through mappings we keep open while copies
        // run; planners never give overlapping destinations within a batch.
        unsafe { copier.launch(slot, descs, &self.acc) }.map_err(io)?;
        Ok(())
    }
}
