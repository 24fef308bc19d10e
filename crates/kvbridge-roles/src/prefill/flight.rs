//! The one place a prefill worker touches batch handles: it hands batches
//! to the engine, records them in the [`Pipeline`], and feeds the pipeline
//! their completions.
//!
//! **Owns:** the `BatchHandle`s in flight and how long a worker waits on
//! them (a moment at a time, on any of them).
//! **Never:** decides what a completion means (the pipeline's events say,
//! the worker acts), or waits on one batch while another has finished.

use std::time::Duration;

use kvbridge_engine::{Batch, BatchHandle, TransferEngine};

use super::pipeline::{BatchId, Event, Pipeline, Submitted, Ticket};

/// How long a wait on the oldest batch lasts before the others are looked
/// at again.
const NEXT_POLL: Duration = Duration::from_millis(1);

/// A worker's batches in flight: the pipeline and the handles it stands for.
#[derive(Debug)]
pub(crate) struct Flight {
    pipe: Pipeline,
    handles: Vec<(BatchId, BatchHandle)>,
}

impl Flight {
    /// At most `depth` batches in flight.
    pub fn new(depth: usize) -> Self {
        Self {
            pipe: Pipeline::new(depth),
            handles: Vec::new(),
        }
    }

    /// Starts a chunk of `room`.
    pub fn open(&mut self, room: u64, is_last: bool) -> Ticket {
        self.pipe.open(room, is_last)
    }

    /// Ends the chunk's submissions.
    pub fn close(&mut self, ticket: Ticket) {
        self.pipe.close(ticket);
    }

    /// Whether a batch of the chunk failed.
    pub fn failed(&self, ticket: Ticket) -> bool {
        self.pipe.failed(ticket)
    }

    /// Whether a batch must complete before the next is submitted.
    pub fn is_full(&self) -> bool {
        self.pipe.is_full()
    }

    /// Whether nothing is in flight and no event is waiting.
    pub fn is_idle(&self) -> bool {
        self.pipe.is_idle()
    }

    /// The next event of the pipeline.
    pub fn poll(&mut self) -> Option<Event> {
        self.pipe.poll()
    }

    /// Hands `batch` of the open chunk `ticket` to the engine (to the exact
    /// incarnation that registered the destination) without waiting.
    pub fn submit(
        &mut self,
        engine: &dyn TransferEngine,
        ticket: Ticket,
        incarnation: u64,
        batch: Batch<'_>,
        submitted: Submitted,
    ) {
        let dest = submitted.dest.clone();
        // Recorded first: a batch the pipeline would not track (a closed
        // chunk) never reaches the engine, so no write goes unaccounted.
        let Some(id) = self.pipe.submitted(ticket, submitted) else {
            tracing::error!(ticket, "batch for a chunk that is not open; not submitted");
            return;
        };
        let to = kvbridge_engine::Target::exact(&dest.session, incarnation);
        self.handles.push((id, engine.submit(to, batch)));
    }

    /// Feeds every finished batch to the pipeline; whether there was one.
    pub fn reap(&mut self) -> bool {
        let mut any = false;
        let mut i = 0;
        while i < self.handles.len() {
            match self.handles[i].1.poll() {
                Some(result) => {
                    let (id, _) = self.handles.remove(i);
                    self.pipe.handle_completion(id, result);
                    any = true;
                }
                None => i += 1,
            }
        }
        any
    }

    /// Feeds finished batches to the pipeline; when none has finished,
    /// waits a moment on the oldest (woken at once when it finishes).
    pub fn wait(&mut self) {
        if self.reap() {
            return;
        }
        if let Some((_, oldest)) = self.handles.first() {
            let _ = oldest.wait_timeout(NEXT_POLL);
            self.reap();
        }
    }
}
