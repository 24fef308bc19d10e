//! A worker's staged chunks in progress (sans-IO bookkeeping): the chunks
//! waiting for the decode's ring, the gather slots, and the bulk writes in
//! flight per chunk, so that a chunk's `CHUNK_READY` goes exactly once,
//! after every one of its writes succeeded.
//!
//! **Owns:** which gather slot is free, which chunk a write belongs to,
//! and how many chunks of an open pipeline chunk (ticket) still wait.
//! **Never:** touches the engine, memory or sockets; the worker does, and
//! tells it what happened.

use std::collections::{HashMap, VecDeque};

use super::StagedTask;
use crate::prefill::pipeline::Ticket;

/// A staged chunk whose writes are being submitted or are in flight.
#[derive(Debug)]
struct Writing {
    task: StagedTask,
    /// Writes submitted and not yet completed.
    outstanding: usize,
    /// Whether every write is submitted.
    submitted: bool,
    /// Whether a write failed (no `CHUNK_READY` then).
    failed: bool,
}

/// What the worker must do once a write of a staged chunk completed.
#[derive(Debug)]
pub(crate) enum Completion {
    /// Nothing yet (more writes in flight, or the chunk failed).
    Pending,
    /// Every write succeeded: send the chunk's `CHUNK_READY`.
    Ready(StagedTask),
}

/// One worker's staged chunks.
#[derive(Debug, Default)]
pub(crate) struct Stager {
    free: Vec<(u64, u64)>,
    /// Chunks waiting for their allocation or ring space, oldest first.
    pub deferred: VecDeque<StagedTask>,
    /// Deferred chunks per open ticket: the ticket closes at zero.
    waiting: HashMap<Ticket, usize>,
    writing: HashMap<u64, Writing>,
    /// Write tag -> (chunk id, gather slot).
    tags: HashMap<u64, (u64, (u64, u64))>,
    next: u64,
}

impl Stager {
    /// Bookkeeping over the gather `slots` (`(address, length)` each).
    pub fn new(slots: Vec<(u64, u64)>) -> Self {
        Self {
            free: slots,
            ..Self::default()
        }
    }

    /// The length of a gather slot (0 without slots).
    pub fn slot_len(&self) -> u64 {
        self.free
            .iter()
            .chain(self.tags.values().map(|(_, s)| s))
            .map(|s| s.1)
            .min()
            .unwrap_or(0)
    }

    /// Keeps `task` until its ring space is there; its ticket stays open.
    pub fn defer(&mut self, task: StagedTask) {
        *self.waiting.entry(task.ticket).or_default() += 1;
        self.deferred.push_back(task);
    }

    /// A deferred chunk of `ticket` was handled (submitted or dropped);
    /// true when the ticket has none left waiting and may close.
    pub fn undefer(&mut self, ticket: Ticket) -> bool {
        match self.waiting.get_mut(&ticket) {
            Some(n) if *n > 1 => {
                *n -= 1;
                false
            }
            Some(_) => {
                self.waiting.remove(&ticket);
                true
            }
            None => false,
        }
    }

    /// Whether chunks of `ticket` wait for ring space.
    pub fn holds(&self, ticket: Ticket) -> bool {
        self.waiting.contains_key(&ticket)
    }

    /// Starts submitting `task`'s writes; returns its id.
    pub fn begin(&mut self, task: StagedTask) -> u64 {
        self.next += 1;
        self.writing.insert(
            self.next,
            Writing {
                task,
                outstanding: 0,
                submitted: false,
                failed: false,
            },
        );
        self.next
    }

    /// A free gather slot, if any.
    pub fn take_slot(&mut self) -> Option<(u64, u64)> {
        self.free.pop()
    }

    /// Returns a slot that was taken but not used.
    pub fn put_slot(&mut self, slot: (u64, u64)) {
        self.free.push(slot);
    }

    /// Whether every slot is taken by a write in flight.
    pub fn slots_busy(&self) -> bool {
        self.free.is_empty() && !self.tags.is_empty()
    }

    /// Records a write of chunk `id` from `slot`; returns its tag.
    pub fn write(&mut self, id: u64, slot: (u64, u64)) -> u64 {
        self.next += 1;
        let tag = self.next;
        self.tags.insert(tag, (id, slot));
        if let Some(w) = self.writing.get_mut(&id) {
            w.outstanding += 1;
        }
        tag
    }

    /// Every write of chunk `id` is submitted (`ok`), or submitting stopped
    /// (`!ok`: the room failed); what follows.
    pub fn submitted(&mut self, id: u64, ok: bool) -> Completion {
        if let Some(w) = self.writing.get_mut(&id) {
            w.submitted = true;
            w.failed |= !ok;
        }
        self.settle(id)
    }

    /// Write `tag` completed; frees its slot; what follows.
    pub fn completed(&mut self, tag: u64, ok: bool) -> Completion {
        let Some((id, slot)) = self.tags.remove(&tag) else {
            return Completion::Pending;
        };
        self.free.push(slot);
        if let Some(w) = self.writing.get_mut(&id) {
            w.outstanding = w.outstanding.saturating_sub(1);
            w.failed |= !ok;
        }
        self.settle(id)
    }

    fn settle(&mut self, id: u64) -> Completion {
        let done = self
            .writing
            .get(&id)
            .is_some_and(|w| w.submitted && w.outstanding == 0);
        if !done {
            return Completion::Pending;
        }
        match self.writing.remove(&id) {
            Some(w) if !w.failed => Completion::Ready(w.task),
            _ => Completion::Pending,
        }
    }

    /// Drops every deferred chunk (the worker stops); the tickets to close.
    pub fn abandon(&mut self) -> Vec<Ticket> {
        self.deferred.clear();
        self.waiting.drain().map(|(t, _)| t).collect()
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::time::Instant;

    use super::*;
    use crate::prefill::state::{Peer, PeerEntry, TransferInfo};

    fn task(ticket: Ticket) -> StagedTask {
        StagedTask {
            ticket,
            room: 1,
            info: Arc::new(TransferInfo {
                endpoint: "127.0.0.1".into(),
                dst_port: 1,
                session: "127.0.0.1:2".into(),
                request: None,
                required_dst_info_num: 1,
                decode_prefix_len: None,
                registration: 0,
            }),
            entry: Arc::new(PeerEntry {
                generation: 0,
                incarnation: 0,
                peer: Peer::Rejected("test".into()),
                staging: None,
                pair_key: None,
                aux_batch: false,
                digest: [0; 32],
                control: (String::new(), 0),
            }),
            chunk_idx: 0,
            page_start: 0,
            pages: Arc::new(vec![1]),
            deadline: Instant::now(),
        }
    }

    #[test]
    fn chunk_ready_only_once_every_write_succeeded() {
        let mut s = Stager::new(vec![(0x1000, 64), (0x2000, 64)]);
        let id = s.begin(task(1));
        let a = s.take_slot().unwrap();
        let ta = s.write(id, a);
        let b = s.take_slot().unwrap();
        let tb = s.write(id, b);
        assert!(s.take_slot().is_none() && s.slots_busy());
        assert!(matches!(s.completed(ta, true), Completion::Pending));
        assert!(matches!(s.submitted(id, true), Completion::Pending));
        assert!(matches!(s.completed(tb, true), Completion::Ready(_)));
        assert_eq!(s.free.len(), 2, "slots back");

        let id = s.begin(task(2));
        let t = s.write(id, s.free[0]);
        s.free.remove(0);
        assert!(matches!(s.completed(t, false), Completion::Pending));
        assert!(
            matches!(s.submitted(id, true), Completion::Pending),
            "a failed write: no CHUNK_READY"
        );
        assert!(s.writing.is_empty());
    }

    #[test]
    fn a_ticket_closes_when_its_last_deferred_chunk_is_handled() {
        let mut s = Stager::new(Vec::new());
        s.defer(task(3));
        s.defer(task(3));
        assert!(s.holds(3));
        assert!(!s.undefer(3));
        assert!(s.undefer(3));
        assert!(!s.holds(3));
        s.defer(task(4));
        assert_eq!(s.abandon(), vec![4]);
    }
}
