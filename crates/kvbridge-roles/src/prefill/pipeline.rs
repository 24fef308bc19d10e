//! A worker's batches in flight across chunks and rooms.
//!
//! A chunk's KV batches are submitted without waiting, so the engine always
//! has work while the worker plans the next chunk; a chunk is finished (its
//! room's `outstanding` count drops, a drained abort is acknowledged) only
//! when the last of its batches completed. Before a room's last chunk sends
//! states, aux and the status, every earlier batch of that room is waited
//! for: a room never reports `Success` before all its bytes are written.
//!
//! Batches are accounted for in the order they finish, not the order they
//! were submitted: a batch to a slow or dead destination holds one slot
//! (until its engine's timeout), never the rooms queued behind it.

use std::collections::{HashMap, VecDeque};

use kvbridge_engine::{Batch, BatchHandle};
use kvbridge_wire::KvPoll;

use super::Shared;

/// How long a wait on the oldest batch lasts before the pipeline looks
/// again for any other finished batch.
const NEXT_POLL: std::time::Duration = std::time::Duration::from_millis(1);

/// One chunk being sent: how many of its batches are still in flight.
#[derive(Debug)]
struct Ticket {
    room: u64,
    is_last: bool,
    remaining: usize,
    open: bool,
    failed: bool,
}

#[derive(Debug)]
struct Pending {
    ticket: u64,
    handle: BatchHandle,
    bytes: u64,
    blocks: u64,
    session: String,
    host_port: String,
}

/// Where a batch goes: the session and the incarnation that registered the
/// destination addresses (0: not announced).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Target<'a> {
    pub session: &'a str,
    pub incarnation: u64,
    pub host_port: &'a str,
}

/// The in-flight batches of one worker.
#[derive(Debug)]
pub(crate) struct Pipeline {
    depth: usize,
    pending: VecDeque<Pending>,
    tickets: HashMap<u64, Ticket>,
    next: u64,
}

impl Pipeline {
    /// At most `depth` batches in flight.
    pub fn new(depth: usize) -> Self {
        Self {
            depth: depth.max(1),
            pending: VecDeque::new(),
            tickets: HashMap::new(),
            next: 0,
        }
    }

    /// Whether nothing is in flight.
    pub fn is_empty(&self) -> bool {
        self.pending.is_empty()
    }

    /// Starts a chunk of `room`.
    pub fn open(&mut self, room: u64, is_last: bool) -> u64 {
        self.next += 1;
        self.tickets.insert(
            self.next,
            Ticket {
                room,
                is_last,
                remaining: 0,
                open: true,
                failed: false,
            },
        );
        self.next
    }

    /// Whether a batch of the chunk failed.
    pub fn failed(&self, ticket: u64) -> bool {
        self.tickets.get(&ticket).is_some_and(|t| t.failed)
    }

    /// Submits one batch of the chunk, first waiting for a batch to finish
    /// while `depth` are in flight.
    pub fn submit(&mut self, shared: &Shared, ticket: u64, target: Target<'_>, batch: Batch<'_>) {
        self.make_room(shared);
        let copies = match batch {
            Batch::Blocks(b) => b.len() as u64,
            Batch::Runs(r) => r.iter().map(|r| r.count).fold(0, u64::saturating_add),
        };
        let to = kvbridge_engine::Target::exact(target.session, target.incarnation);
        let handle = shared.engine.submit(to, batch);
        self.push(ticket, target, handle, batch.bytes(), copies);
    }

    /// Waits for batches to finish while `depth` are in flight.
    fn make_room(&mut self, shared: &Shared) {
        while self.pending.len() >= self.depth {
            self.complete_next(shared, None);
        }
    }

    fn push(
        &mut self,
        ticket: u64,
        target: Target<'_>,
        handle: BatchHandle,
        bytes: u64,
        blocks: u64,
    ) {
        if let Some(t) = self.tickets.get_mut(&ticket) {
            t.remaining += 1;
        }
        self.pending.push_back(Pending {
            ticket,
            handle,
            bytes,
            blocks,
            session: target.session.to_owned(),
            host_port: target.host_port.to_owned(),
        });
    }

    /// Ends the chunk's submissions; it finishes once its batches completed.
    pub fn close(&mut self, shared: &Shared, ticket: u64) {
        if let Some(t) = self.tickets.get_mut(&ticket) {
            t.open = false;
        }
        self.maybe_finish(shared, ticket);
    }

    /// Waits for the next batch to finish (of `room` only, when given) and
    /// accounts for it: the first one found finished, else the oldest is
    /// waited on for a moment and the search repeats.
    fn complete_next(&mut self, shared: &Shared, room: Option<u64>) {
        let tickets = &self.tickets;
        let of_room =
            |p: &Pending| room.is_none_or(|r| tickets.get(&p.ticket).is_some_and(|t| t.room == r));
        loop {
            if let Some(i) = self
                .pending
                .iter()
                .position(|p| of_room(p) && p.handle.is_done())
            {
                if let Some(p) = self.pending.remove(i) {
                    self.account(shared, p);
                }
                return;
            }
            let Some(oldest) = self.pending.iter().find(|p| of_room(p)) else {
                return;
            };
            // Woken at once when it finishes; otherwise look again soon for
            // any other batch that finished meanwhile.
            let _ = oldest.handle.wait_timeout(NEXT_POLL);
        }
    }

    /// Accounts for one finished batch if there is one, else waits a
    /// moment for the oldest: for a worker that also watches its queue.
    pub fn settle(&mut self, shared: &Shared) {
        if let Some(i) = self.pending.iter().position(|p| p.handle.is_done()) {
            if let Some(p) = self.pending.remove(i) {
                self.account(shared, p);
            }
        } else if let Some(oldest) = self.pending.front()
            && oldest.handle.wait_timeout(NEXT_POLL).is_some()
            && let Some(p) = self.pending.pop_front()
        {
            self.account(shared, p);
        }
    }

    /// Accounts for a finished batch.
    fn account(&mut self, shared: &Shared, p: Pending) {
        let result = p.handle.wait();
        let Some(t) = self.tickets.get_mut(&p.ticket) else {
            return;
        };
        t.remaining = t.remaining.saturating_sub(1);
        match result {
            Ok(()) => {
                shared.metrics.bytes.inc_by(p.bytes);
                shared.metrics.blocks.inc_by(p.blocks);
            }
            Err(e) => {
                let first = !t.failed;
                t.failed = true;
                let room = t.room;
                if first {
                    super::worker::engine_failure(shared, &p.session, &e);
                    shared.conclude(
                        room,
                        KvPoll::Failed,
                        None,
                        Some(format!(
                            "Failed to send kv chunk of {room} to {}: {e}",
                            p.host_port
                        )),
                    );
                }
            }
        }
        self.maybe_finish(shared, p.ticket);
    }

    /// Waits until no batch of `room` is in flight (other rooms' batches
    /// are accounted for as they finish, never waited on).
    pub fn wait_room(&mut self, shared: &Shared, room: u64) {
        while self
            .pending
            .iter()
            .any(|p| self.tickets.get(&p.ticket).is_some_and(|t| t.room == room))
        {
            self.complete_next(shared, Some(room));
        }
    }

    /// Waits for every batch in flight.
    pub fn drain(&mut self, shared: &Shared) {
        while !self.pending.is_empty() {
            self.complete_next(shared, None);
        }
    }

    fn maybe_finish(&mut self, shared: &Shared, ticket: u64) {
        let done = self
            .tickets
            .get(&ticket)
            .is_some_and(|t| !t.open && t.remaining == 0);
        if done && let Some(t) = self.tickets.remove(&ticket) {
            super::worker::finish(shared, t.room, t.is_last);
        }
    }
}
