//! Issuing batches on the progress thread: endpoints per peer incarnation
//! (with UCX's peer-error mode where the transports support it), remote
//! keys, one put per merged run and the closing flush, completion callbacks
//! and the mapping of UCX statuses to [`ErrorKind`]s.

use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::ffi::c_void;
use std::rc::Rc;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use super::super::api::{Callback, Endpoint, MemHandle, Op, Request, Rkey, UcxError};
use super::super::side::PeerInfo;
use super::super::sys;
use super::{BatchCmd, Progress, Put, mem_of};
use crate::batch::Completer;
use crate::{ErrorKind, TransferError};

/// Marks the flush request in a request's user area (puts store their index).
const FLUSH_MARK: u64 = u64::MAX;

/// Completion state of one batch; UCX callbacks reach it through a raw
/// pointer (`Rc::as_ptr`) that stays valid while the thread holds the `Rc`.
pub(super) struct BatchState {
    pub(super) id: u64,
    pub(super) session: String,
    pub(super) bytes: u64,
    /// Completions of the batch's peer (shared per peer), for timeouts.
    pub(super) clock: Rc<Clock>,
    pub(super) timeout: Duration,
    pub(super) outstanding: Cell<usize>,
    /// First block of each put, and which puts completed.
    pub(super) put_blocks: Vec<usize>,
    pub(super) put_done: RefCell<Vec<bool>>,
    /// First failure: the block (if known) and the UCX status.
    pub(super) error: Cell<Option<(Option<usize>, i32)>>,
    pub(super) timed_out: Cell<bool>,
    /// Why the peer's endpoint was closed while this batch was in flight.
    pub(super) peer_status: Cell<i32>,
    /// Its endpoint was abandoned (no peer-error mode): UCX may never
    /// complete its requests, so deregistrations do not wait for it.
    pub(super) abandoned: Cell<bool>,
    pub(super) completer: RefCell<Option<Completer>>,
    /// `ucp_request_free`, for the callbacks.
    pub(super) free: unsafe extern "C" fn(*mut c_void),
}

/// How much a peer has completed, and when that last changed.
#[derive(Debug)]
pub(super) struct Clock {
    /// Completed operations (bumped by the completion callbacks).
    pub(super) completions: Cell<u64>,
    seen: Cell<u64>,
    at: Cell<Instant>,
}

impl Clock {
    fn new() -> Self {
        Self {
            completions: Cell::new(0),
            seen: Cell::new(0),
            at: Cell::new(Instant::now()),
        }
    }

    /// Restart the clock (the peer had nothing in flight).
    fn restart(&self) {
        self.seen.set(self.completions.get());
        self.at.set(Instant::now());
    }

    /// How long since the peer last completed anything, as of `now`.
    pub(super) fn idle(&self, now: Instant) -> Duration {
        if self.completions.get() != self.seen.get() {
            self.seen.set(self.completions.get());
            self.at.set(now);
        }
        now.saturating_duration_since(self.at.get())
    }
}

impl BatchState {
    /// The first block of the first put that has not completed.
    fn first_pending(&self) -> Option<usize> {
        let done = self.put_done.borrow();
        self.put_blocks
            .iter()
            .zip(done.iter())
            .find(|(_, d)| !**d)
            .map(|(b, _)| *b)
    }

    /// Whether the caller still waits for this batch.
    pub(super) fn is_live(&self) -> bool {
        self.completer.borrow().is_some()
    }

    fn fail(&self, block: Option<usize>, status: i32) {
        if self.error.get().is_none() {
            self.error.set(Some((block, status)));
        }
    }
}

/// Send completion of a put or flush.
unsafe extern "C" fn on_done(request: *mut c_void, status: i32, user_data: *mut c_void) {
    // SAFETY: `user_data` is `Rc::as_ptr` of a BatchState the progress
    // thread keeps alive until its outstanding count is zero, and callbacks
    // run on that thread inside `ucp_worker_progress` (no other borrow of
    // the state is live then). `request` is the request's user area, where
    // we stored the put's index before the first progress call.
    unsafe {
        let b = &*(user_data as *const BatchState);
        b.clock.completions.set(b.clock.completions.get() + 1);
        let mark = *(request as *const u64);
        let put = (mark != FLUSH_MARK).then_some(mark as usize);
        if let Some(i) = put
            && let Some(d) = b.put_done.borrow_mut().get_mut(i)
        {
            *d = true;
        }
        if status != sys::UCS_OK {
            b.fail(put.and_then(|i| b.put_blocks.get(i).copied()), status);
        }
        b.outstanding.set(b.outstanding.get().saturating_sub(1));
        // Freed here, inside its callback (UCX recycles it on return);
        // freeing it earlier would have suppressed this callback.
        (b.free)(request);
    }
}

/// Peer failure reported by UCX for an endpoint in peer-error mode.
unsafe extern "C" fn on_ep_error(arg: *mut c_void, _ep: sys::ucp_ep_h, status: i32) {
    // SAFETY: `arg` is `Rc::as_ptr` of the peer's failure cell, which the
    // thread keeps alive until the endpoint's close completed.
    let cell = unsafe { &*(arg as *const Cell<i32>) };
    if cell.get() == 0 {
        cell.set(if status == 0 {
            sys::UCS_ERR_CANCELED
        } else {
            status
        });
    }
}

/// An endpoint to one incarnation of a peer, with the keys unpacked on it.
pub(super) struct Peer {
    pub(super) info: Arc<PeerInfo>,
    pub(super) ep: Endpoint,
    pub(super) rkeys: HashMap<u64, (Arc<[u8]>, Rkey)>,
    pub(super) old_rkeys: Vec<Rkey>,
    /// Non-zero once UCX reported the peer failed (or we timed it out).
    pub(super) failed: Rc<Cell<i32>>,
    pub(super) timed_out: bool,
    /// Completions of operations to this peer.
    pub(super) clock: Rc<Clock>,
    /// Whether the endpoint runs in UCX's peer-error mode.
    pub(super) peer_errors: bool,
}

/// An endpoint being closed, or abandoned; its keys and failure cell live
/// until it is closed (abandoned ones until the worker goes).
pub(super) struct Closing {
    pub(super) req: Option<Request>,
    pub(super) since: Instant,
    pub(super) _rkeys: Vec<Rkey>,
    pub(super) _failed: Rc<Cell<i32>>,
}

impl Progress {
    /// Make sure there is an endpoint to `info`'s incarnation: created on
    /// first use, replaced when another incarnation (or worker) answers.
    pub(super) fn ensure_peer(&mut self, info: &Arc<PeerInfo>) -> Result<(), i32> {
        let stale = self.peers.get(&info.session).is_some_and(|p| {
            p.info.incarnation != info.incarnation || p.info.worker != info.worker
        });
        if stale && let Some(old) = self.peers.remove(&info.session) {
            tracing::info!(session = %info.session, "ucx: peer restarted; old endpoint and keys dropped");
            self.retire(old);
        }
        if let Some(p) = self.peers.get_mut(&info.session) {
            if !Arc::ptr_eq(&p.info, info) {
                p.info = info.clone();
            }
            return Ok(());
        }
        let failed = Rc::new(Cell::new(0));
        let arg = Rc::as_ptr(&failed) as *mut c_void;
        let status = |e: UcxError| match e {
            UcxError::Call { status, .. } => status,
            _ => sys::UCS_ERR_INVALID_PARAM,
        };
        // SAFETY: the failure cell is kept alive (in Peer, then Closing)
        // until the endpoint is closed (or, abandoned, until the worker goes).
        let mut ep = unsafe {
            self.worker
                .connect(&info.worker, self.peer_errors, Some(on_ep_error), arg)
        };
        if ep.is_err() && self.peer_errors {
            // SAFETY: as above.
            let plain = unsafe {
                self.worker
                    .connect(&info.worker, false, Some(on_ep_error), arg)
            };
            if plain.is_ok() {
                tracing::warn!(
                    session = %info.session,
                    "ucx: the transports cannot detect peer failure (shared memory); \
                     a dead peer is detected by the I/O timeout"
                );
                self.peer_errors = false;
                ep = plain;
            }
        }
        let ep = ep.map_err(status)?;
        self.peers.insert(
            info.session.clone(),
            Peer {
                info: info.clone(),
                ep,
                rkeys: HashMap::new(),
                old_rkeys: Vec::new(),
                failed,
                timed_out: false,
                clock: Rc::new(Clock::new()),
                peer_errors: self.peer_errors,
            },
        );
        Ok(())
    }

    /// Close a failed (or replaced) peer's endpoint forcibly, which fails
    /// its outstanding requests; its keys go when the close completed. An
    /// endpoint without peer-error mode cannot be closed that way: it is
    /// abandoned to the worker.
    pub(super) fn retire(&mut self, p: Peer) {
        let mut rkeys: Vec<Rkey> = p.rkeys.into_values().map(|(_, k)| k).collect();
        rkeys.extend(p.old_rkeys);
        self.shared.forget(&p.info);
        let closing = |req| Closing {
            req,
            since: Instant::now(),
            _rkeys: rkeys,
            _failed: p.failed,
        };
        if !p.peer_errors {
            for b in self.batches.iter().filter(|b| b.session == p.info.session) {
                b.abandoned.set(true);
            }
            self.abandoned.push(closing(None));
            return;
        }
        let req = match p.ep.close(true) {
            Op::Done(_) => None,
            Op::Pending(r) => Some(r),
        };
        self.closing.push(closing(req));
    }

    pub(super) fn issue(&mut self, cmd: BatchCmd) {
        let BatchCmd {
            peer: info,
            puts,
            bytes,
            completer,
            timeout,
        } = cmd;
        let id = self.next_batch;
        self.next_batch += 1;
        let first = puts.first().map(|p| p.block);
        let ensured = self.ensure_peer(&info);
        let clock = match self.peers.get(&info.session) {
            Some(p) => {
                // An idle peer's clock starts with this batch.
                if self.batches.iter().all(|b| b.session != p.info.session) {
                    p.clock.restart();
                }
                p.clock.clone()
            }
            None => Rc::new(Clock::new()),
        };
        let state = Rc::new(BatchState {
            id,
            session: info.session.clone(),
            bytes,
            clock,
            timeout,
            outstanding: Cell::new(0),
            put_blocks: puts.iter().map(|p| p.block).collect(),
            put_done: RefCell::new(vec![false; puts.len()]),
            error: Cell::new(None),
            timed_out: Cell::new(false),
            peer_status: Cell::new(0),
            abandoned: Cell::new(false),
            completer: RefCell::new(Some(completer)),
            free: self.worker.request_free_fn(),
        });
        let cb = Callback {
            cb: Some(on_done),
            user_data: Rc::as_ptr(&state) as *mut c_void,
        };
        let issued = ensured
            .map_err(|st| (first, st))
            .and_then(|()| self.issue_on_peer(&info, &puts, &state, cb));
        if let Err((block, status)) = issued {
            state.fail(block, status);
        }

        self.shared
            .stats
            .puts
            .fetch_add(puts.len() as u64, Ordering::Relaxed);
        self.batches.push(state);
    }

    /// Issue the puts and the flush of one batch on its peer's endpoint.
    fn issue_on_peer(
        &mut self,
        info: &PeerInfo,
        puts: &[Put],
        state: &BatchState,
        cb: Callback,
    ) -> Result<(), (Option<usize>, i32)> {
        let first = puts.first().map(|p| p.block);
        let Self { peers, mems, .. } = self;
        let peer = peers
            .get_mut(&info.session)
            .ok_or((first, sys::UCS_ERR_LAST))?;
        if peer.failed.get() != 0 {
            return Err((first, peer.failed.get()));
        }
        let Peer {
            ep,
            rkeys,
            old_rkeys,
            ..
        } = peer;
        // Unpack the keys first (puts of a batch mostly share a region),
        // then issue with the last key and memory handle at hand.
        let mut prev = None;
        for put in puts {
            if prev != Some(put.region) {
                rkey_for(rkeys, old_rkeys, ep, info, put.region)
                    .map_err(|st| (Some(put.block), st))?;
                prev = Some(put.region);
            }
        }
        let rkeys = &*rkeys;
        let mut key: Option<(u64, &Rkey)> = None;
        let mut mem: Option<(u64, u64, Option<&MemHandle>)> = None;
        for (index, put) in puts.iter().enumerate() {
            let rkey = match key {
                Some((region, k)) if region == put.region => k,
                _ => {
                    let k = rkeys
                        .get(&put.region)
                        .map(|(_, k)| k)
                        .ok_or((Some(put.block), sys::UCS_ERR_INVALID_PARAM))?;
                    key = Some((put.region, k));
                    k
                }
            };
            let memh = match mem {
                Some((start, end, m)) if put.src >= start && put.src + put.len <= end => m,
                _ => {
                    let found = mem_of(mems, put.src, put.len);
                    mem = found.map(|(start, end, m)| (start, end, Some(m)));
                    found.map(|(_, _, m)| m)
                }
            };
            // SAFETY: the source run lies in a region registered (and
            // mem-mapped) locally, which stays mapped until every batch
            // queued before its deregistration completed; the destination
            // run lies inside the peer region whose key this is (checked by
            // submit); the callback state outlives the request.
            match unsafe { ep.put(put.src, put.len, put.dst, rkey, memh, cb) } {
                Op::Done(sys::UCS_OK) => state.put_done.borrow_mut()[index] = true,
                Op::Done(st) => return Err((Some(put.block), st)),
                Op::Pending(req) => {
                    // SAFETY: the user area holds REQUEST_AREA (16) bytes,
                    // written before any progress call can complete it.
                    unsafe { *req.area() = index as u64 };
                    state.outstanding.set(state.outstanding.get() + 1);
                    // The callback frees the request.
                }
            }
        }
        // SAFETY: the callback state outlives the request.
        match unsafe { ep.flush(cb) } {
            Op::Done(sys::UCS_OK) => Ok(()),
            Op::Done(st) => Err((None, st)),
            Op::Pending(req) => {
                // SAFETY: as for the puts above.
                unsafe { *req.area() = FLUSH_MARK };
                state.outstanding.set(state.outstanding.get() + 1);
                Ok(())
            }
        }
    }

    /// Publish a finished (or timed-out) batch's result, once.
    pub(super) fn complete(&mut self, b: &BatchState) {
        if !b.is_live() {
            return;
        }
        let result = match (b.error.get(), b.timed_out.get()) {
            (None, false) => {
                let s = &self.shared.stats;
                s.bytes_sent.fetch_add(b.bytes, Ordering::Relaxed);
                s.batches_ok.fetch_add(1, Ordering::Relaxed);
                Ok(())
            }
            (err, timed_out) => {
                self.shared
                    .stats
                    .batches_failed
                    .fetch_add(1, Ordering::Relaxed);
                let block = err.and_then(|(blk, _)| blk).or_else(|| b.first_pending());
                let st = err.map_or(sys::UCS_ERR_TIMED_OUT, |(_, st)| st);
                let peer_st = b.peer_status.get();
                let (kind, detail) = if self.stopping {
                    (ErrorKind::Shutdown, "engine shut down".to_owned())
                } else if timed_out || peer_st == sys::UCS_ERR_TIMED_OUT {
                    (
                        ErrorKind::Timeout,
                        "the peer completed nothing within the I/O timeout; endpoint closed"
                            .to_owned(),
                    )
                } else {
                    let cause = if peer_st != 0 { peer_st } else { st };
                    (
                        kind_of(cause, peer_st != 0),
                        format!("{} (ucs status {cause})", self.worker.status_text(cause)),
                    )
                };
                Err(TransferError::new(&b.session, block, kind, detail))
            }
        };
        if let Some(c) = b.completer.borrow_mut().take() {
            c.complete(result);
        }
    }
}

/// The unpacked key of `region` of `info`, unpacking (or replacing a key
/// packed for an earlier registration) on first use.
fn rkey_for<'a>(
    rkeys: &'a mut HashMap<u64, (Arc<[u8]>, Rkey)>,
    old: &mut Vec<Rkey>,
    ep: &Endpoint,
    info: &PeerInfo,
    region: u64,
) -> Result<&'a Rkey, i32> {
    let packed = &info
        .regions
        .get(&region)
        .ok_or(sys::UCS_ERR_INVALID_PARAM)?
        .rkey;
    let fresh = match rkeys.get(&region) {
        Some((bytes, _)) => !Arc::ptr_eq(bytes, packed) && bytes[..] != packed[..],
        None => true,
    };
    if fresh {
        let k = ep.unpack_rkey(packed).map_err(|e| match e {
            UcxError::Call { status, .. } => status,
            _ => sys::UCS_ERR_INVALID_PARAM,
        })?;
        if let Some((_, o)) = rkeys.insert(region, (packed.clone(), k)) {
            old.push(o);
        }
    }
    rkeys
        .get(&region)
        .map(|(_, k)| k)
        .ok_or(sys::UCS_ERR_INVALID_PARAM)
}

/// The error kind of a UCX status (`peer_failed`: UCX reported the peer
/// failed, so an unspecific status means the peer went away).
pub(crate) fn kind_of(status: i32, peer_failed: bool) -> ErrorKind {
    match status {
        sys::UCS_ERR_TIMED_OUT => ErrorKind::Timeout,
        // What UCX reports when a peer's connection breaks (killed process).
        sys::UCS_ERR_ENDPOINT_TIMEOUT => ErrorKind::PeerClosed,
        sys::UCS_ERR_UNREACHABLE
        | sys::UCS_ERR_INVALID_ADDR
        | sys::UCS_ERR_NOT_CONNECTED
        | sys::UCS_ERR_REJECTED => ErrorKind::Unreachable,
        sys::UCS_ERR_CONNECTION_RESET => ErrorKind::PeerClosed,
        s if (-89..=-40).contains(&s) => ErrorKind::PeerClosed,
        _ if peer_failed => ErrorKind::PeerClosed,
        _ => ErrorKind::Io,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn statuses_map_to_kinds() {
        assert_eq!(kind_of(-20, false), ErrorKind::Timeout);
        assert_eq!(kind_of(-80, true), ErrorKind::PeerClosed);
        assert_eq!(kind_of(-25, false), ErrorKind::PeerClosed);
        assert_eq!(kind_of(-6, false), ErrorKind::Unreachable);
        assert_eq!(kind_of(-3, true), ErrorKind::PeerClosed);
        assert_eq!(kind_of(-3, false), ErrorKind::Io);
    }
}
