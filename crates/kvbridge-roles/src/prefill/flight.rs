//! The one place a prefill worker touches batch handles: it hands batches
//! to the engine, records them in the [`Pipeline`], and feeds the pipeline
//! their completions.
//!
//! **Owns:** the `BatchHandle`s in flight and how long a worker waits on
//! them (a moment at a time, on any of them).
//! **Never:** decides what a completion means (the pipeline's events say,
//! the worker acts), or waits on one batch while another has finished.

use std::time::Duration;

use crossbeam_channel::{Receiver, RecvError, Sender};
use kvbridge_engine::{Batch, BatchHandle, TransferEngine};

use super::pipeline::{BatchId, Event, Pipeline, Submitted, Ticket};

/// Longest wait for a batch to finish before the handles are looked at
/// again (every handle also signals its end; this only bounds a lost one).
const NEXT_POLL: Duration = Duration::from_millis(1);

/// A worker's batches in flight: the pipeline and the handles it stands for.
#[derive(Debug)]
pub(crate) struct Flight {
    pipe: Pipeline,
    handles: Vec<(BatchId, BatchHandle)>,
    /// One token when some batch finished since the worker last looked
    /// (each handle's `on_done` sends it), so a wait ends at the first
    /// batch to finish, not the oldest.
    finished_tx: Sender<()>,
    finished: Receiver<()>,
}

impl Flight {
    /// At most `depth` batches in flight.
    pub fn new(depth: usize) -> Self {
        let (finished_tx, finished) = crossbeam_channel::bounded(1);
        Self {
            pipe: Pipeline::new(depth),
            handles: Vec::new(),
            finished_tx,
            finished,
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
        let handle = engine.submit(to, batch);
        let tx = self.finished_tx.clone();
        // A full channel already holds the token that wakes the worker.
        handle.on_done(move || {
            let _ = tx.try_send(());
        });
        self.handles.push((id, handle));
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
    /// waits until one does (at most a moment).
    pub fn wait(&mut self) {
        let never = crossbeam_channel::never::<()>();
        let _ = self.wait_or(&never);
    }

    /// Feeds finished batches to the pipeline; when none has finished,
    /// waits until one does or `queue` delivers (at most a moment), and
    /// returns what `queue` delivered (`None`: a batch finished, or the
    /// moment passed).
    pub fn wait_or<T>(&mut self, queue: &Receiver<T>) -> Option<Result<T, RecvError>> {
        // Tokens of batches about to be reaped; any later end sends anew.
        while self.finished.try_recv().is_ok() {}
        if self.reap() || self.handles.is_empty() {
            return None;
        }
        crossbeam_channel::select! {
            recv(queue) -> next => return Some(next),
            recv(self.finished) -> _ => {}
            default(NEXT_POLL) => {}
        }
        self.reap();
        None
    }
}
