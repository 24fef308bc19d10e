//! The decode side's rooms, each one object, driven as a sans-IO state
//! machine (in the shape of `prefill/pipeline.rs`): the drivers — the
//! receiver a scheduler holds, the inbox thread, the heartbeat — hand it an
//! [`Input`] under the rooms lock and act on the [`Output`] it returns.
//!
//! **Owns:** every live room's state (with sglang's update rules, through
//! [`RoomTable`]), the bootstrap server it came from, the prefill ranks it
//! expects, the successes they reported, the slots it may receive into, its
//! ABORT and the ACKs that drain it; and what follows from them across
//! rooms: the rooms of each bootstrap server, abort generations, and the
//! fences silent ranks hold until they acknowledge.
//!
//! **Never:** touches a socket, an engine, a lock, the metrics or a clock
//! (time comes in with the input); logs. A room's pages count as drained
//! only when every rank told about it acknowledged its ABORT under the
//! room's generation, or was fenced.
//!
//! ```text
//!   Open ─▶ Bootstrapping ─Resolved─▶ WaitingForInput ─Status(Success) × n─▶ Success
//!                │                          │                                   │
//!                └──── Fail / Abort / ServerLost / Status(Failed) ─▶ Failed ◀───┘ (never)
//!   Failed ─StopWriters─▶ ABORT sent ─AbortAck × ranks / Fenced─▶ drained ─Clear─▶ gone
//! ```

use std::collections::{HashMap, HashSet};
use std::time::{Duration, Instant};

use kvbridge_plan::PrefillLayout;
use kvbridge_wire::{KvPoll, PairKey};

use super::slots::{ExpectedRanks, RoomSlots};
use super::staging::StagingRoom;
use crate::rooms::RoomTable;

mod io;

pub(crate) use io::{Drain, Fence, Input, Output, Silent, StatusEffect};

/// The ACKs an aborted room collected.
#[derive(Debug, Default, Clone)]
struct AbortAcks {
    /// The generation our ABORT carried.
    generation: Option<u64>,
    /// Prefill ranks that acknowledged (ranked form).
    ranks: HashSet<u64>,
    /// ACKs in the reference's 2-frame form (no rank), accepted only when
    /// our ABORT carried no generation (a stock sglang prefill without
    /// deferred release answers so).
    unranked: usize,
    /// When the ABORT went out (the ACK deadline counts from here).
    sent_at: Option<Instant>,
    /// Whether the missed deadline was already reported.
    overdue_reported: bool,
    /// Ranks that never acknowledged but whose engine session our engine
    /// fenced (no write of theirs can land any more).
    fenced: HashSet<u64>,
}

impl AbortAcks {
    /// Writers known to be done: each rank once, whether it acknowledged,
    /// was fenced, or both (a fenced rank's late ACK), plus unranked ACKs.
    fn settled(&self) -> usize {
        self.ranks.union(&self.fenced).count() + self.unranked
    }
}

/// An ABORT_ACK a fenced prefill rank still owes, and where to ask again:
/// the ABORT may have been lost (a partition), and the fence stays until
/// the rank answers, so the ABORT is sent again on every heartbeat.
#[derive(Debug, Clone, PartialEq, Eq)]
struct OwedAck {
    /// The rank's zmq endpoint, when known.
    endpoint: Option<String>,
    /// The generation the room's ABORT carried.
    generation: Option<u64>,
    /// The rank's pair key (secret mode): what its late ACK is bound by,
    /// the room perhaps cleared by then.
    key: Option<PairKey>,
}

/// One room: where its KV comes from and goes, and how far it got.
#[derive(Debug, Default)]
struct DecodeRoom {
    /// The prefill server's bootstrap address.
    addr: String,
    /// Success messages needed (known once resolved).
    required: Option<u64>,
    /// Ranks that reported Success.
    responded: HashSet<u64>,
    /// The ranks it expects to hear from (known once resolved).
    expected: Option<ExpectedRanks>,
    /// The slots its ranks may write outside the engine (once asked).
    slots: Option<RoomSlots>,
    /// Its ABORT, once sent.
    abort: Option<AbortAcks>,
}

/// Room-level state of the decode side.
#[derive(Debug, Default)]
pub(crate) struct DecodeRooms {
    /// Every room's state and failure reason.
    pub table: RoomTable,
    /// Rooms that receive through the staging ring.
    pub staging: HashMap<u64, StagingRoom>,
    rooms: HashMap<u64, DecodeRoom>,
    /// Rooms per prefill bootstrap server (failed together when it dies).
    by_server: HashMap<String, HashSet<u64>>,
    /// Last abort generation handed out.
    generation: u64,
    /// Engine sessions fenced for silent ranks, with the `(room, rank)`
    /// ACKs still owed; the fence is lifted when the last one arrives.
    fences: HashMap<String, HashMap<(u64, u64), OwedAck>>,
}

impl DecodeRooms {
    /// Whether `room` takes writes now: told its ranks where its KV goes
    /// and not concluded (not aborted, failed, succeeded or cleared).
    pub fn takes_writes(&self, room: u64) -> bool {
        matches!(
            self.table.get(room),
            Some(KvPoll::WaitingForInput | KvPoll::Transferring)
        )
    }

    /// Applies one input; see [`Input`] for what each answers.
    pub fn handle(&mut self, input: Input<'_>) -> Output {
        match input {
            Input::Open { room, addr } => {
                self.open(room, addr);
                Output::Done
            }
            Input::Resolved {
                room,
                required,
                expected,
            } => {
                if let Some(r) = self.rooms.get_mut(&room) {
                    r.required = Some(required);
                    r.expected = Some(expected);
                }
                Output::State(self.table.update(room, KvPoll::WaitingForInput))
            }
            Input::Asked { room, slots } => {
                if let Some(r) = self.rooms.get_mut(&room) {
                    r.slots = Some(slots);
                }
                Output::Done
            }
            Input::Fail { room, reason } => {
                self.table.fail(room, reason);
                Output::Done
            }
            Input::StopWriters {
                room,
                with_generation,
                now,
            } => Output::Abort(self.stop_writers(room, with_generation, now)),
            Input::Drain {
                room,
                needed,
                ack_timeout,
                now,
            } => Output::Drain(self.drain(room, needed, ack_timeout, now)),
            Input::Fenced {
                room,
                needed,
                fenced,
            } => Output::Flag(self.fenced(room, needed, fenced)),
            Input::Poll { room } => Output::State(self.table.get(room)),
            Input::AbortSent { room } => {
                Output::Flag(self.rooms.get(&room).is_some_and(|r| r.abort.is_some()))
            }
            Input::TakeFailure { room } => Output::Reason(self.table.take_failure(room)),
            Input::Clear { room } => {
                self.clear(room);
                Output::Done
            }
            Input::ServerLost { addr, reason } => Output::Failed(self.server_lost(addr, &reason)),
            Input::Keys { room, rank } => Output::Keys(self.keys(room, rank)),
            Input::StatusSender { room, rank } => Output::Sender(self.status_sender(room, rank)),
            Input::Status {
                room,
                rank,
                status,
                reason,
                layout,
            } => Output::Status(self.status(room, rank, status, reason, layout)),
            Input::AbortAck {
                room,
                rank,
                generation,
            } => {
                let (accepted, awaited, unfence) = self.abort_ack(room, rank, generation);
                Output::Ack {
                    accepted,
                    refused: awaited && !accepted,
                    unfence,
                }
            }
            Input::Takes {
                room,
                layout,
                dst,
                len,
            } => Output::Flag(
                self.takes_writes(room)
                    && self
                        .rooms
                        .get(&room)
                        .and_then(|r| r.slots.as_ref())
                        .is_some_and(|s| s.allows(layout, dst, len)),
            ),
            Input::OwedAborts { max } => Output::Owed(
                self.fences
                    .values()
                    .flat_map(|owed| owed.iter())
                    .filter_map(|(&(room, _), ack)| {
                        Some((room, ack.endpoint.clone()?, ack.generation))
                    })
                    .take(max)
                    .collect(),
            ),
        }
    }

    fn open(&mut self, room: u64, addr: String) {
        if let Some(old) = self.rooms.get(&room)
            && old.addr != addr
            && let Some(set) = self.by_server.get_mut(&old.addr)
        {
            set.remove(&room);
        }
        self.by_server.entry(addr.clone()).or_default().insert(room);
        self.rooms.insert(
            room,
            DecodeRoom {
                addr,
                ..DecodeRoom::default()
            },
        );
        self.table.update(room, KvPoll::Bootstrapping);
    }

    fn stop_writers(
        &mut self,
        room: u64,
        with_generation: bool,
        now: Instant,
    ) -> Option<Option<u64>> {
        let r = self.rooms.get_mut(&room)?;
        if r.abort.is_some() {
            return None;
        }
        let generation = with_generation.then(|| {
            self.generation += 1;
            self.generation
        });
        r.abort = Some(AbortAcks {
            generation,
            sent_at: Some(now),
            ..AbortAcks::default()
        });
        Some(generation)
    }

    fn drain(&mut self, room: u64, needed: usize, ack_timeout: Duration, now: Instant) -> Drain {
        let Some(r) = self.rooms.get_mut(&room) else {
            return Drain::Waiting;
        };
        let Some(acks) = r.abort.as_mut() else {
            return Drain::Waiting;
        };
        if acks.settled() >= needed {
            return Drain::Drained;
        }
        let overdue = acks
            .sent_at
            .is_some_and(|t| now.saturating_duration_since(t) >= ack_timeout);
        if !overdue || acks.overdue_reported {
            return Drain::Waiting;
        }
        acks.overdue_reported = true;
        let Some(expected) = r.expected.as_ref() else {
            return Drain::Overdue(Vec::new());
        };
        let mut silent: Vec<Silent> = expected
            .all
            .iter()
            .filter(|rank| !acks.ranks.contains(rank) && !acks.fenced.contains(rank))
            .map(|rank| (*rank, expected.sessions.get(rank).cloned()))
            .collect();
        silent.sort_unstable();
        Drain::Overdue(silent)
    }

    fn fenced(&mut self, room: u64, needed: usize, fenced: Vec<Fence>) -> bool {
        let Some(r) = self.rooms.get_mut(&room) else {
            return false;
        };
        let Some(acks) = r.abort.as_mut() else {
            return false;
        };
        for (rank, session, endpoint) in fenced {
            let key = r.expected.as_ref().and_then(|e| e.keys.get(&rank).copied());
            self.fences.entry(session).or_default().insert(
                (room, rank),
                OwedAck {
                    endpoint,
                    generation: acks.generation,
                    key,
                },
            );
            acks.fenced.insert(rank);
        }
        acks.settled() >= needed
    }

    fn clear(&mut self, room: u64) {
        self.table.remove(room);
        if let Some(r) = self.rooms.remove(&room)
            && let Some(set) = self.by_server.get_mut(&r.addr)
        {
            set.remove(&room);
            if set.is_empty() {
                self.by_server.remove(&r.addr);
            }
        }
    }

    fn server_lost(&mut self, addr: &str, reason: &str) -> usize {
        let mut failed = 0;
        for room in self.by_server.remove(addr).unwrap_or_default() {
            if self.table.get(room).is_some_and(|s| s != KvPoll::Success) {
                self.table.fail(room, reason);
                failed += 1;
            }
        }
        failed
    }

    fn keys(&self, room: u64, rank: Option<u64>) -> Vec<PairKey> {
        let expected = self.rooms.get(&room).and_then(|r| r.expected.as_ref());
        let Some(rank) = rank else {
            return expected
                .map(|e| e.keys.values().copied().collect())
                .unwrap_or_default();
        };
        let owed = self
            .fences
            .values()
            .filter_map(|owed| owed.get(&(room, rank))?.key);
        expected
            .and_then(|e| e.keys.get(&rank).copied())
            .into_iter()
            .chain(owed)
            .collect()
    }

    fn status_sender(&self, room: u64, rank: u64) -> Result<Option<PairKey>, StatusEffect> {
        if !self.table.contains(room) {
            return Err(StatusEffect::Late);
        }
        let expected = self.rooms.get(&room).and_then(|r| r.expected.as_ref());
        match expected {
            Some(e) if e.status.contains(&rank) => Ok(e.keys.get(&rank).copied()),
            _ => Err(StatusEffect::Foreign),
        }
    }

    fn status(
        &mut self,
        room: u64,
        rank: u64,
        status: KvPoll,
        reason: Option<&str>,
        layout: &PrefillLayout,
    ) -> StatusEffect {
        if !self.table.contains(room) {
            return StatusEffect::Late;
        }
        let Some(r) = self.rooms.get_mut(&room) else {
            return StatusEffect::Late;
        };
        if !r
            .expected
            .as_ref()
            .is_some_and(|e| e.status.contains(&rank))
        {
            return StatusEffect::Foreign;
        }
        match status {
            KvPoll::Success => {
                r.responded.insert(rank);
                let count = r.responded.len() as u64;
                match r.required {
                    Some(n) if count >= n => {
                        // Every writer's CHUNK_READY precedes its status on
                        // the same socket: a chunk still unscattered now was
                        // never written, and the room is not complete.
                        let pending = self.staging.get(&room).map_or(0, StagingRoom::pending);
                        if pending > 0 {
                            let reason = format!(
                                "{pending} staging chunk(s) of room {room} were allocated but \
                                 never written before every prefill rank reported success"
                            );
                            self.table.fail(room, reason);
                            return StatusEffect::Failed;
                        }
                        self.table.update(room, KvPoll::Success);
                        StatusEffect::Succeeded(
                            r.slots
                                .as_ref()
                                .map(|s| (s.capacity_bytes(layout), s.asked_at.elapsed())),
                        )
                    }
                    Some(_) => StatusEffect::Counted,
                    None => StatusEffect::NoCount,
                }
            }
            KvPoll::Failed => {
                let reason = reason.unwrap_or(DEFAULT_PREFILL_FAILURE_REASON);
                if self.table.get(room) == Some(KvPoll::Failed) {
                    // Already failed here (an abort, a timeout): keep that
                    // root cause; the prefill's message is its echo.
                    self.table.first_failure(room, reason);
                    return StatusEffect::Echo;
                }
                self.table.fail(room, reason);
                StatusEffect::Failed
            }
            _ => StatusEffect::Ignored,
        }
    }

    /// An ACK counts once per rank of the room, and only with the
    /// generation our ABORT carried: a missing or older generation is
    /// stale or forged. The reference's unranked 2-frame form counts only
    /// when our ABORT carried no generation (deferred release off), as
    /// sglang answers then. A fenced rank's late ACK settles what it owed
    /// (the room may be cleared by now) and lifts its fence once it owes
    /// nothing else. Returns whether it was accepted, whether the room was
    /// waiting for ACKs, and the session whose fence it lifts.
    fn abort_ack(
        &mut self,
        room: u64,
        rank: Option<u64>,
        generation: Option<u64>,
    ) -> (bool, bool, Option<String>) {
        let (settled, unfence) = match rank {
            Some(rank) => self.settle_fence(room, rank, generation),
            None => (false, None),
        };
        let Some(r) = self.rooms.get_mut(&room) else {
            return (settled, false, unfence);
        };
        let (Some(acks), Some(expected)) = (r.abort.as_mut(), r.expected.as_ref()) else {
            return (settled, false, unfence);
        };
        let accepted = match rank {
            Some(rank) if expected.all.contains(&rank) && generation == acks.generation => {
                acks.ranks.insert(rank);
                true
            }
            None if acks.generation.is_none() && acks.unranked < expected.all.len() => {
                acks.unranked += 1;
                true
            }
            _ => settled,
        };
        (accepted, true, unfence)
    }

    fn settle_fence(
        &mut self,
        room: u64,
        rank: u64,
        generation: Option<u64>,
    ) -> (bool, Option<String>) {
        let session = self.fences.iter().find_map(|(session, owed)| {
            owed.get(&(room, rank))
                .filter(|o| o.generation == generation)
                .map(|_| session.clone())
        });
        let Some(session) = session else {
            return (false, None);
        };
        let Some(owed) = self.fences.get_mut(&session) else {
            return (true, None);
        };
        owed.remove(&(room, rank));
        if !owed.is_empty() {
            return (true, None);
        }
        self.fences.remove(&session);
        (true, Some(session))
    }
}

/// The reason a prefill's Failed status carries when it names none.
pub(crate) const DEFAULT_PREFILL_FAILURE_REASON: &str =
    "Failed to get kvcache from prefill instance, it might be dead";

#[cfg(test)]
mod tests;
