//! Submitted batches on the sending side: their pieces, the queued items
//! (one request each) and the bookkeeping that completes a batch once its
//! last item finished, with the first error.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};

use parking_lot::Mutex;

use crate::batch::Completer;
use crate::{ErrorKind, TransferError};

/// One piece of a batch: a whole block, a slice of a long one, or some
/// consecutive copies of a strided run (copy `i` moves `len` bytes from
/// `src + i * src_stride` to `dst + i * dst_stride`).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Piece {
    pub src: u64,
    pub dst: u64,
    pub len: u64,
    /// Copies (1 for a block).
    pub copies: u64,
    pub src_stride: u64,
    pub dst_stride: u64,
    /// Index of the block (or run) in the submitted batch.
    pub block: usize,
}

impl Piece {
    /// A piece of one copy.
    pub(crate) fn single(src: u64, dst: u64, len: u64, block: usize) -> Self {
        Self {
            src,
            dst,
            len,
            copies: 1,
            src_stride: 0,
            dst_stride: 0,
            block,
        }
    }

    /// Bytes the piece moves (planning checked it does not overflow).
    pub(crate) fn bytes(&self) -> u64 {
        self.len.saturating_mul(self.copies)
    }

    /// Source bytes from the first copy's start to the last copy's end.
    pub(crate) fn src_span(&self) -> u64 {
        self.copies
            .saturating_sub(1)
            .saturating_mul(self.src_stride)
            .saturating_add(self.len)
    }

    /// Copy `i`'s `(src, dst)`.
    pub(crate) fn copy_at(&self, i: u64) -> (u64, u64) {
        (
            self.src.wrapping_add(i.wrapping_mul(self.src_stride)),
            self.dst.wrapping_add(i.wrapping_mul(self.dst_stride)),
        )
    }
}

/// What one queued item asks the peer to do.
#[derive(Debug)]
pub(crate) enum Work {
    /// Validate every destination of the batch; on success queue the deferred writes.
    Check(Vec<Piece>),
    /// Write these pieces.
    Write(Vec<Piece>),
}

/// Shared state of one submitted batch.
///
/// Its deferred write items each hold an `Arc` of it: that cycle is broken
/// when the deferred items are queued (a successful check) or dropped
/// unsent ([`BatchCtx::discard_deferred`], when the batch fails or
/// completes), so a refused batch does not leak.
#[derive(Debug)]
pub(crate) struct BatchCtx {
    pub(super) session: String,
    /// The peer incarnation the batch may be written to (0 = any).
    pub(super) expected: u64,
    pub(super) remaining: AtomicUsize,
    failed: AtomicBool,
    error: Mutex<Option<TransferError>>,
    completer: Mutex<Option<Completer>>,
    pub(super) deferred: Mutex<Vec<Item>>,
    /// The engine's gauge of live batch states (this one counts itself in and out).
    live: Arc<AtomicU64>,
}

impl BatchCtx {
    pub(crate) fn new(
        session: &str,
        expected: u64,
        completer: Completer,
        live: Arc<AtomicU64>,
    ) -> Arc<Self> {
        live.fetch_add(1, Ordering::Relaxed);
        Arc::new(Self {
            session: session.to_owned(),
            expected,
            remaining: AtomicUsize::new(1),
            failed: AtomicBool::new(false),
            error: Mutex::new(None),
            completer: Mutex::new(Some(completer)),
            deferred: Mutex::new(Vec::new()),
            live,
        })
    }

    /// Drop the deferred items without sending them (they were never
    /// counted in `remaining`), breaking their references to the batch.
    fn discard_deferred(&self) {
        let items = std::mem::take(&mut *self.deferred.lock());
        items.into_iter().for_each(Item::discard);
    }

    /// Park the write items that run once the batch's check succeeded.
    pub(crate) fn defer(&self, items: Vec<Item>) {
        *self.deferred.lock() = items;
    }

    pub(super) fn is_failed(&self) -> bool {
        self.failed.load(Ordering::Acquire)
    }

    /// Account for one finished item; the last one completes the batch.
    fn finish_one(&self, result: Result<(), TransferError>) {
        if let Err(e) = result {
            let mut slot = self.error.lock();
            if slot.is_none() {
                tracing::debug!(error = %e, "batch failed");
                *slot = Some(e);
            }
            self.failed.store(true, Ordering::Release);
            self.discard_deferred();
        }
        if self.remaining.fetch_sub(1, Ordering::AcqRel) == 1 {
            self.discard_deferred();
            let result = match self.error.lock().take() {
                Some(e) => Err(e),
                None => Ok(()),
            };
            if let Some(c) = self.completer.lock().take() {
                c.complete(result);
            }
        }
    }
}

impl Drop for BatchCtx {
    fn drop(&mut self) {
        self.live.fetch_sub(1, Ordering::Relaxed);
    }
}

/// One request's worth of a batch, queued to a peer's lanes.
#[derive(Debug)]
pub(crate) struct Item {
    pub(super) batch: Arc<BatchCtx>,
    pub(super) work: Work,
    done: bool,
}

impl Item {
    pub(crate) fn new(batch: Arc<BatchCtx>, work: Work) -> Self {
        Self {
            batch,
            work,
            done: false,
        }
    }

    /// Drop an item that never counted in its batch's `remaining`.
    fn discard(mut self) {
        self.done = true;
    }

    pub(super) fn finish(mut self, result: Result<(), TransferError>) {
        self.done = true;
        self.batch.finish_one(result);
    }

    pub(super) fn first_block(&self) -> Option<usize> {
        match &self.work {
            Work::Check(p) | Work::Write(p) => p.first().map(|p| p.block),
        }
    }

    pub(super) fn pieces(&self) -> &[Piece] {
        match &self.work {
            Work::Check(p) | Work::Write(p) => p,
        }
    }

    pub(super) fn error(&self, kind: ErrorKind, detail: impl Into<String>) -> TransferError {
        TransferError::new(&self.batch.session, self.first_block(), kind, detail)
    }

    pub(super) fn io_error(&self, e: &std::io::Error) -> TransferError {
        TransferError::from_io(&self.batch.session, self.first_block(), e)
    }
}

impl Drop for Item {
    fn drop(&mut self) {
        if !self.done {
            self.done = true;
            let e = TransferError::new(
                &self.batch.session,
                None,
                ErrorKind::Shutdown,
                "engine shut down before the request was sent",
            );
            self.batch.finish_one(Err(e));
        }
    }
}
