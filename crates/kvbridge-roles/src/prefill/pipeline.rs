//! A worker's batches in flight, as a sans-IO state machine (in the shape of
//! quinn-proto's `Connection`): the worker tells it what it submitted
//! ([`Pipeline::open`], [`Pipeline::submitted`], [`Pipeline::close`]) and
//! what completed ([`Pipeline::handle_completion`]); it answers with
//! [`Event`]s from [`Pipeline::poll`], which the worker acts on.
//!
//! **Owns:** the accounting of batches, chunks (tickets) and rooms in flight,
//! and the order of the events it returns: a room's [`Event::RoomReady`]
//! comes only once every batch of its last chunk (and of any earlier chunk
//! still in flight) completed without error, and before the
//! [`Event::ChunkDone`] of that last chunk, which is held until then.
//!
//! **Never:** touches an engine, a socket, a lock or a clock; calls back
//! into the worker. Batches are accounted for in the order they finish,
//! not the order they were submitted: a batch to a slow or dead destination
//! holds one slot, never the rooms queued behind it.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;

use kvbridge_engine::TransferError;

use super::state::TransferInfo;

/// One chunk being sent, as the pipeline names it.
pub(crate) type Ticket = u64;

/// One submitted batch, as the pipeline names it.
pub(crate) type BatchId = u64;

/// What a batch carries (for the failure reason).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Part {
    /// KV pages (blocks or runs).
    Kv,
    /// State components (last chunk).
    State,
    /// Aux slots (last chunk).
    Aux,
}

/// A submitted batch: what it moves and where.
#[derive(Debug, Clone)]
pub(crate) struct Submitted {
    /// What the batch carries.
    pub part: Part,
    /// Bytes it moves.
    pub bytes: u64,
    /// Copies it makes (blocks, or every copy of its runs).
    pub copies: u64,
    /// The destination it goes to.
    pub dest: Arc<TransferInfo>,
    /// The worker's own name for the batch, reported back when it
    /// completes ([`Event::Tagged`]): a staged write, whose buffer is
    /// reused and whose `CHUNK_READY` follows it.
    pub tag: Option<u64>,
}

/// The first failed batch of a chunk.
#[derive(Debug, Clone)]
pub(crate) struct Failure {
    /// What the batch carried.
    pub part: Part,
    /// Where it went.
    pub dest: Arc<TransferInfo>,
    /// Why it failed.
    pub error: TransferError,
}

/// What the pipeline reports, in order.
#[derive(Debug, Clone)]
pub(crate) enum Event {
    /// A batch completed: its bytes are in the peer's memory.
    Written {
        /// The room the bytes belong to.
        room: u64,
        /// What the batch carried.
        part: Part,
        /// Bytes moved.
        bytes: u64,
        /// Copies made.
        copies: u64,
    },
    /// A tagged batch completed (before its `Written` or `Failed`, and
    /// before the room's `RoomReady`).
    Tagged {
        /// The batch's tag.
        tag: u64,
        /// Whether it was written.
        ok: bool,
    },
    /// The chunk's first failed batch: the room fails now.
    Failed {
        /// The room.
        room: u64,
        /// The chunk.
        ticket: Ticket,
        /// The failed batch.
        failure: Failure,
    },
    /// Every batch of the room's last chunk, and of any earlier chunk of the
    /// room still in flight, completed without error: what must follow the
    /// bytes (control-plane data, then the status) may go now.
    RoomReady {
        /// The room.
        room: u64,
    },
    /// Every batch of the chunk completed (for a last chunk: every batch of
    /// the room); `ok` is false when one of the chunk's batches failed.
    ChunkDone {
        /// The room.
        room: u64,
        /// The chunk.
        ticket: Ticket,
        /// Whether it was the room's last chunk.
        is_last: bool,
        /// Whether all of its batches succeeded.
        ok: bool,
    },
}

#[derive(Debug)]
struct TicketState {
    room: u64,
    is_last: bool,
    remaining: usize,
    open: bool,
    failed: bool,
}

#[derive(Debug, Default)]
struct RoomState {
    /// Batches of the room in flight.
    in_flight: usize,
    /// Tickets of the room not yet done.
    tickets: usize,
    /// The room's last chunk, once closed.
    last: Option<Ticket>,
    /// Tickets of the room still open (a chunk whose staged writes wait
    /// for the decode's ring stays open): the room is not ready before.
    open: usize,
    /// Whether a batch of the room failed while it was tracked.
    failed: bool,
}

/// The in-flight batches of one worker.
#[derive(Debug)]
pub(crate) struct Pipeline {
    depth: usize,
    batches: HashMap<BatchId, (Ticket, Submitted)>,
    tickets: HashMap<Ticket, TicketState>,
    rooms: HashMap<u64, RoomState>,
    events: VecDeque<Event>,
    next_ticket: Ticket,
    next_batch: BatchId,
}

impl Pipeline {
    /// At most `depth` batches in flight.
    pub fn new(depth: usize) -> Self {
        Self {
            depth: depth.max(1),
            batches: HashMap::new(),
            tickets: HashMap::new(),
            rooms: HashMap::new(),
            events: VecDeque::new(),
            next_ticket: 0,
            next_batch: 0,
        }
    }

    /// Whether `depth` batches are in flight (wait for one before submitting).
    pub fn is_full(&self) -> bool {
        self.batches.len() >= self.depth
    }

    /// Whether nothing is in flight and no event is waiting.
    pub fn is_idle(&self) -> bool {
        self.batches.is_empty() && self.events.is_empty()
    }

    /// Starts a chunk of `room`.
    pub fn open(&mut self, room: u64, is_last: bool) -> Ticket {
        self.next_ticket += 1;
        self.tickets.insert(
            self.next_ticket,
            TicketState {
                room,
                is_last,
                remaining: 0,
                open: true,
                failed: false,
            },
        );
        let r = self.rooms.entry(room).or_default();
        r.tickets += 1;
        r.open += 1;
        self.next_ticket
    }

    /// Whether a batch of the chunk failed.
    pub fn failed(&self, ticket: Ticket) -> bool {
        self.tickets.get(&ticket).is_some_and(|t| t.failed)
    }

    /// Records a batch of an open chunk handed to the engine; returns its id
    /// for [`Pipeline::handle_completion`]. `None` for an unknown or closed
    /// ticket (nothing is recorded).
    pub fn submitted(&mut self, ticket: Ticket, batch: Submitted) -> Option<BatchId> {
        let t = self.tickets.get_mut(&ticket).filter(|t| t.open)?;
        t.remaining += 1;
        self.rooms.entry(t.room).or_default().in_flight += 1;
        self.next_batch += 1;
        self.batches.insert(self.next_batch, (ticket, batch));
        Some(self.next_batch)
    }

    /// Ends the chunk's submissions; it is done once its batches completed.
    pub fn close(&mut self, ticket: Ticket) {
        let Some(t) = self.tickets.get_mut(&ticket) else {
            return;
        };
        let was_open = std::mem::replace(&mut t.open, false);
        let room = t.room;
        if let Some(r) = self.rooms.get_mut(&room) {
            if was_open {
                r.open = r.open.saturating_sub(1);
            }
            if t.is_last {
                r.last = Some(ticket);
            }
        }
        self.settle(ticket);
    }

    /// Accounts for a completed batch (unknown ids are ignored).
    pub fn handle_completion(&mut self, id: BatchId, result: Result<(), TransferError>) {
        let Some((ticket, batch)) = self.batches.remove(&id) else {
            return;
        };
        let Some(t) = self.tickets.get_mut(&ticket) else {
            return;
        };
        t.remaining = t.remaining.saturating_sub(1);
        let room = t.room;
        let first_failure = result.is_err() && !t.failed;
        t.failed |= result.is_err();
        if let Some(r) = self.rooms.get_mut(&room) {
            r.in_flight = r.in_flight.saturating_sub(1);
            r.failed |= result.is_err();
        }
        if let Some(tag) = batch.tag {
            self.events.push_back(Event::Tagged {
                tag,
                ok: result.is_ok(),
            });
        }
        match result {
            Ok(()) => self.events.push_back(Event::Written {
                room,
                part: batch.part,
                bytes: batch.bytes,
                copies: batch.copies,
            }),
            Err(error) if first_failure => self.events.push_back(Event::Failed {
                room,
                ticket,
                failure: Failure {
                    part: batch.part,
                    dest: batch.dest,
                    error,
                },
            }),
            Err(_) => {}
        }
        self.settle(ticket);
    }

    /// The next event, if any.
    pub fn poll(&mut self) -> Option<Event> {
        self.events.pop_front()
    }

    /// Ends `ticket` if it is done, and the room's last chunk if the room
    /// drained: `RoomReady` (without a failure) before that `ChunkDone`.
    fn settle(&mut self, ticket: Ticket) {
        let Some(t) = self.tickets.get(&ticket) else {
            return;
        };
        let room = t.room;
        let chunk_done = !t.is_last && !t.open && t.remaining == 0;
        let drained = self
            .rooms
            .get(&room)
            .filter(|r| r.in_flight == 0 && r.open == 0)
            .and_then(|r| r.last.map(|last| (last, r.failed)));
        if let Some((_, false)) = drained {
            self.events.push_back(Event::RoomReady { room });
        }
        if chunk_done {
            self.done(ticket);
        }
        if let Some((last, _)) = drained {
            self.done(last);
        }
    }

    fn done(&mut self, ticket: Ticket) {
        let Some(t) = self.tickets.remove(&ticket) else {
            return;
        };
        self.events.push_back(Event::ChunkDone {
            room: t.room,
            ticket,
            is_last: t.is_last,
            ok: !t.failed,
        });
        if let Some(r) = self.rooms.get_mut(&t.room) {
            r.tickets = r.tickets.saturating_sub(1);
            if r.last == Some(ticket) {
                r.last = None;
            }
            if r.tickets == 0 {
                self.rooms.remove(&t.room);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvbridge_engine::ErrorKind;

    fn dest() -> Arc<TransferInfo> {
        Arc::new(TransferInfo {
            endpoint: "127.0.0.1".into(),
            dst_port: 1,
            session: "127.0.0.1:2".into(),
            request: None,
            required_dst_info_num: 1,
            decode_prefix_len: None,
            registration: 0,
        })
    }

    fn batch(part: Part) -> Submitted {
        Submitted {
            part,
            bytes: 10,
            copies: 1,
            dest: dest(),
            tag: None,
        }
    }

    fn error() -> TransferError {
        TransferError::new("127.0.0.1:2", None, ErrorKind::Timeout, "stuck")
    }

    /// Every event, written ones left out.
    fn events(p: &mut Pipeline) -> Vec<String> {
        std::iter::from_fn(|| p.poll())
            .filter(|e| !matches!(e, Event::Written { .. }))
            .map(|e| match e {
                Event::Failed { room, .. } => format!("failed {room}"),
                Event::RoomReady { room } => format!("ready {room}"),
                Event::Tagged { tag, ok } => format!("tagged {tag} ok={ok}"),
                Event::ChunkDone {
                    room, is_last, ok, ..
                } => format!("done {room} last={is_last} ok={ok}"),
                Event::Written { .. } => String::new(),
            })
            .collect()
    }

    #[test]
    fn room_ready_only_after_every_batch_of_the_room() {
        let mut p = Pipeline::new(8);
        let first = p.open(1, false);
        let a = p.submitted(first, batch(Part::Kv)).unwrap();
        p.close(first);
        let last = p.open(1, true);
        let b = p.submitted(last, batch(Part::Kv)).unwrap();
        let c = p.submitted(last, batch(Part::Aux)).unwrap();
        p.close(last);
        assert!(events(&mut p).is_empty());
        // The last chunk finishes first: nothing is ready while chunk 1 flies.
        p.handle_completion(c, Ok(()));
        p.handle_completion(b, Ok(()));
        assert!(events(&mut p).is_empty(), "last chunk held");
        p.handle_completion(a, Ok(()));
        assert_eq!(
            events(&mut p),
            [
                "ready 1",
                "done 1 last=false ok=true",
                "done 1 last=true ok=true"
            ]
        );
        assert!(p.is_idle());
    }

    #[test]
    fn a_tagged_batch_is_reported_before_the_room_is_ready() {
        let mut p = Pipeline::new(4);
        let t = p.open(1, true);
        let id = p
            .submitted(
                t,
                Submitted {
                    tag: Some(7),
                    ..batch(Part::Kv)
                },
            )
            .unwrap();
        let failed = p
            .submitted(
                t,
                Submitted {
                    tag: Some(8),
                    ..batch(Part::Kv)
                },
            )
            .unwrap();
        p.close(t);
        p.handle_completion(failed, Err(error()));
        p.handle_completion(id, Ok(()));
        assert_eq!(
            events(&mut p),
            [
                "tagged 8 ok=false",
                "failed 1",
                "tagged 7 ok=true",
                "done 1 last=true ok=false"
            ]
        );
    }

    #[test]
    fn an_earlier_chunk_still_open_holds_the_room() {
        let mut p = Pipeline::new(4);
        let first = p.open(1, false);
        let last = p.open(1, true);
        p.close(last);
        assert!(
            events(&mut p).is_empty(),
            "room ready with a chunk still open"
        );
        p.close(first);
        let ev = events(&mut p);
        assert!(ev.iter().any(|e| e.starts_with("ready")), "{ev:?}");
    }

    #[test]
    fn a_slow_room_never_holds_another_rooms_events() {
        let mut p = Pipeline::new(8);
        let slow = p.open(1, true);
        let stuck = p.submitted(slow, batch(Part::Kv)).unwrap();
        p.close(slow);
        let fast = p.open(2, true);
        let f = p.submitted(fast, batch(Part::Kv)).unwrap();
        p.close(fast);
        p.handle_completion(f, Ok(()));
        assert_eq!(events(&mut p), ["ready 2", "done 2 last=true ok=true"]);
        assert!(!p.is_idle());
        p.handle_completion(stuck, Ok(()));
        assert_eq!(events(&mut p), ["ready 1", "done 1 last=true ok=true"]);
    }

    #[test]
    fn a_failure_is_reported_once_per_chunk_and_the_room_is_never_ready() {
        let mut p = Pipeline::new(8);
        let t = p.open(5, true);
        let ids: Vec<_> = (0..3)
            .map(|_| p.submitted(t, batch(Part::State)).unwrap())
            .collect();
        p.close(t);
        p.handle_completion(ids[0], Err(error()));
        p.handle_completion(ids[1], Err(error()));
        assert!(p.failed(t));
        assert_eq!(events(&mut p), ["failed 5"]);
        p.handle_completion(ids[2], Ok(()));
        assert_eq!(events(&mut p), ["done 5 last=true ok=false"]);
    }

    #[test]
    fn an_empty_last_chunk_is_ready_when_closed() {
        let mut p = Pipeline::new(1);
        let t = p.open(3, true);
        p.close(t);
        assert_eq!(events(&mut p), ["ready 3", "done 3 last=true ok=true"]);
        let skipped = p.open(4, false);
        p.close(skipped);
        assert_eq!(events(&mut p), ["done 4 last=false ok=true"]);
    }

    #[test]
    fn depth_and_stale_ids() {
        let mut p = Pipeline::new(2);
        let t = p.open(1, false);
        let a = p.submitted(t, batch(Part::Kv)).unwrap();
        assert!(!p.is_full());
        p.submitted(t, batch(Part::Kv)).unwrap();
        assert!(p.is_full());
        p.handle_completion(a, Ok(()));
        p.handle_completion(a, Err(error()));
        assert!(!p.is_full() && !p.failed(t));
        p.close(t);
        assert!(p.submitted(t, batch(Part::Kv)).is_none(), "closed ticket");
        assert_eq!(
            p.poll()
                .map(|e| matches!(e, Event::Written { bytes: 10, .. })),
            Some(true)
        );
    }
}
