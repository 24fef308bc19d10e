//! What the decode rooms take in and answer: one [`Input`] per thing a
//! driver saw or asks, one [`Output`] per input.

use std::time::{Duration, Instant};

use kvbridge_plan::PrefillLayout;
use kvbridge_wire::{KvPoll, PairKey};

use crate::decode::slots::{ExpectedRanks, RoomSlots};

/// A silent rank of an aborted room: its number and engine session.
pub(crate) type Silent = (u64, Option<String>);

/// A rank fenced for a room: number, engine session, zmq endpoint.
pub(crate) type Fence = (u64, String, Option<String>);

/// What a driver tells the rooms.
#[derive(Debug)]
pub(crate) enum Input<'a> {
    /// A receiver was created for `room` (re-created: starts afresh).
    Open { room: u64, addr: String },
    /// The room's prefill ranks are known: it waits for its KV.
    Resolved {
        room: u64,
        required: u64,
        expected: ExpectedRanks,
    },
    /// The room told its ranks where its KV goes.
    Asked { room: u64, slots: RoomSlots },
    /// The room failed here (a timeout, an abort, a refusal).
    Fail { room: u64, reason: String },
    /// The room's ABORT is about to go out (once per room).
    StopWriters {
        room: u64,
        with_generation: bool,
        now: Instant,
    },
    /// Whether the room's writers drained, `needed` ranks being told.
    Drain {
        room: u64,
        needed: usize,
        ack_timeout: Duration,
        now: Instant,
    },
    /// Our engine fenced these silent ranks of the room.
    Fenced {
        room: u64,
        needed: usize,
        fenced: Vec<Fence>,
    },
    /// The room's state, as its receiver polls it.
    Poll { room: u64 },
    /// Whether the room's ABORT went out.
    AbortSent { room: u64 },
    /// The room's failure reason, taken.
    TakeFailure { room: u64 },
    /// The room is forgotten.
    Clear { room: u64 },
    /// A bootstrap server stopped answering: its live rooms fail.
    ServerLost { addr: &'a str, reason: String },
    /// The pair keys an ACK or a write for the room may be bound by:
    /// `rank`'s (from the room, or from a fence it owes an ACK under),
    /// every rank's for `None`.
    Keys { room: u64, rank: Option<u64> },
    /// The pair key a status from `rank` must be bound by, if the rank
    /// sends the room's status.
    StatusSender { room: u64, rank: u64 },
    /// A status from rank `rank` (its binding already checked).
    Status {
        room: u64,
        rank: u64,
        status: KvPoll,
        reason: Option<&'a str>,
        layout: &'a PrefillLayout,
    },
    /// An ABORT_ACK (its binding already checked).
    AbortAck {
        room: u64,
        rank: Option<u64>,
        generation: Option<u64>,
    },
    /// Whether `[dst, dst + len)` may be written for the room now.
    Takes {
        room: u64,
        layout: &'a PrefillLayout,
        dst: u64,
        len: u64,
    },
    /// The ABORTs fenced ranks still owe an ACK for, at most `max`.
    OwedAborts { max: usize },
}

/// What the rooms answer; each input has one kind of answer.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Output {
    /// Done; nothing to act on.
    Done,
    /// The room's state (`None`: unknown).
    State(Option<KvPoll>),
    /// A yes or no.
    Flag(bool),
    /// A failure reason.
    Reason(Option<String>),
    /// `StopWriters`: the generation to put in the ABORT, or `None` when
    /// it already went out.
    Abort(Option<Option<u64>>),
    /// `Drain`: drained, still waiting, or past the ACK deadline with
    /// these ranks silent (reported once).
    Drain(Drain),
    /// `ServerLost`: rooms failed.
    Failed(usize),
    /// `Keys`: the keys.
    Keys(Vec<PairKey>),
    /// `StatusSender`: the rank's key (`None` in open mode), or why its
    /// status is not the room's (`Late`, `Foreign`).
    Sender(Result<Option<PairKey>, StatusEffect>),
    /// `Status`: what it did to the room.
    Status(StatusEffect),
    /// `AbortAck`: whether it was accepted; whether it was refused by a
    /// room waiting for ACKs (stale, forged or foreign: worth reporting,
    /// unlike one for a room that awaits none); and the engine session
    /// whose fence it lifts (to unfence before the lock is released).
    Ack {
        accepted: bool,
        refused: bool,
        unfence: Option<String>,
    },
    /// `OwedAborts`: `(room, endpoint, generation)` to send again.
    Owed(Vec<(u64, String, Option<u64>)>),
}

/// Whether an aborted room's writers drained.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Drain {
    /// Every rank acknowledged or was fenced (or none was told).
    Drained,
    /// Some have not; the deadline has not passed, or was reported.
    Waiting,
    /// Past the deadline: these ranks are silent (reported once).
    Overdue(Vec<Silent>),
}

/// What a status did to its room.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum StatusEffect {
    /// The room is unknown here (cleared): a late status.
    Late,
    /// The rank does not serve the room.
    Foreign,
    /// Counted; more are needed.
    Counted,
    /// No required count is known for the room.
    NoCount,
    /// The room succeeded: its slots' bytes and time since it asked.
    Succeeded(Option<(u64, Duration)>),
    /// The room failed now (this status, or a staging chunk never written).
    Failed,
    /// The room had failed here already: the first reason is kept.
    Echo,
    /// Not a terminal status: ignored.
    Ignored,
}
