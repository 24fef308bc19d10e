//! A transfer worker's staged chunks (`docs/roles.md`, "Staging"): trying
//! a chunk against the decode's ring, gathering it piece by piece into the
//! worker's gather slots and submitting each piece as one bulk write
//! through the worker's pipeline, retrying the chunks that wait, and
//! announcing a chunk (`CHUNK_READY`) once every write of it succeeded.
//!
//! **Owns:** the worker's side of the staged path; the bookkeeping is
//! [`Stager`](super::ledger::Stager)'s, the arithmetic the planner's.
//! **Never:** writes a chunk the ring has not released, or announces one
//! before its bytes are written.

use std::sync::Arc;

use kvbridge_engine::Batch;
use kvbridge_plan::Block;

use super::ledger::Completion;
use super::{self as staged, Readiness, StagedTask};
use crate::prefill::pipeline::{Part, Ticket};
use crate::prefill::state::TransferInfo;
use crate::prefill::worker::{Worker, fail, room_failed};

impl Worker<'_> {
    /// Tries a staged chunk now: written (its bulk writes submitted under
    /// its ticket), dropped (room stopped), or kept until its ring space is
    /// there (its ticket stays open, so the room's status waits for it).
    /// Returns whether it was handled (not kept).
    pub(in crate::prefill) fn stage(&mut self, task: StagedTask) -> bool {
        match staged::check(self.shared, &task) {
            Readiness::Dropped => true,
            Readiness::NotReady => {
                self.stager.defer(task);
                false
            }
            Readiness::Ready { offset, end } => {
                self.write_staged(task, offset, end);
                true
            }
        }
    }

    /// Gathers `task` piece by piece into free gather slots and submits
    /// each piece as one bulk write into the allocation `[offset, end)`.
    fn write_staged(&mut self, task: StagedTask, offset: u64, end: u64) {
        let shared = self.shared;
        let (room, ticket) = (task.room, task.ticket);
        let pieces = match staged::pieces(&task, offset, end, self.stager.slot_len()) {
            Ok(p) => p,
            Err(reason) => return fail(shared, room, reason),
        };
        let (info, incarnation) = (task.info.clone(), task.entry.incarnation);
        let id = self.stager.begin(task.clone());
        let mut ok = true;
        for piece in pieces {
            if self.flight.failed(ticket) || room_failed(shared, room) {
                ok = false;
                break;
            }
            let slot = loop {
                if let Some(slot) = self.stager.take_slot() {
                    break Some(slot);
                }
                if !self.stager.slots_busy() {
                    break None;
                }
                self.flight.wait();
                self.handle_events();
            };
            let Some(slot) = slot else {
                fail(shared, room, "no staging gather slot".into());
                ok = false;
                break;
            };
            if let Err(reason) =
                staged::gather(shared, self.index, &task, piece.slots.clone(), slot.0)
            {
                self.stager.put_slot(slot);
                fail(shared, room, reason);
                ok = false;
                break;
            }
            let tag = self.stager.write(id, slot);
            let block = Block {
                src: slot.0,
                dst: piece.dst,
                len: piece.len,
            };
            self.submit_tagged(ticket, incarnation, &info, block, Some(tag));
        }
        let done = self.stager.submitted(id, ok);
        self.staged_done(done);
    }

    /// Sends `CHUNK_READY` for a chunk whose writes all succeeded.
    pub(in crate::prefill) fn staged_done(&mut self, done: Completion) {
        if let Completion::Ready(task) = done
            && let Err(reason) = staged::chunk_ready(self.shared, &task)
        {
            fail(self.shared, task.room, reason);
        }
    }

    /// Retries every waiting staged chunk once, in order.
    pub(in crate::prefill) fn retry_deferred(&mut self) {
        for _ in 0..self.stager.deferred.len() {
            let Some(task) = self.stager.deferred.pop_front() else {
                break;
            };
            let ticket = task.ticket;
            let handled = match staged::check(self.shared, &task) {
                Readiness::NotReady => {
                    self.stager.deferred.push_back(task);
                    false
                }
                Readiness::Dropped => true,
                Readiness::Ready { offset, end } => {
                    self.write_staged(task, offset, end);
                    true
                }
            };
            if handled && self.stager.undefer(ticket) {
                self.flight.close(ticket);
            }
        }
    }

    /// Submits one staged bulk write (`tag`: reported back on completion).
    fn submit_tagged(
        &mut self,
        ticket: Ticket,
        incarnation: u64,
        info: &Arc<TransferInfo>,
        block: Block,
        tag: Option<u64>,
    ) {
        let batch = Batch::Blocks(std::slice::from_ref(&block));
        self.submit_as(ticket, incarnation, Part::Kv, info, batch, tag);
    }
}
