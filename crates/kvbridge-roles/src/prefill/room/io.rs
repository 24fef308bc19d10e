//! What the prefill rooms take in and answer: one [`Input`] per thing a
//! driver saw or asks, one [`Output`] per input.

use std::sync::Arc;
use std::time::{Duration, Instant};

use kvbridge_wire::KvPoll;

use crate::prefill::state::{AckTarget, FailedNotice, StagingAllocation, TransferInfo};

/// The caps a transfer request is admitted under.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Caps {
    /// Most rooms with destinations pending.
    pub max_rooms: usize,
    /// Most destination bytes pending.
    pub max_pending_bytes: usize,
    /// Most rooms pending per decode session.
    pub max_rooms_per_session: usize,
    /// Most decode endpoints one room's ABORT is acknowledged to.
    pub max_abort_endpoints: usize,
    /// How long a room's destinations wait for a sender to claim them.
    pub unclaimed_ttl: Duration,
}

/// What a driver tells the rooms.
#[derive(Debug)]
pub(crate) enum Input<'a> {
    /// A sender was created for `room`; `dummy`: a CP rank that sends
    /// nothing (the room waits for no decode).
    Open { room: u64, dummy: bool },
    /// The room failed here, nobody told (a routing conflict).
    Fail { room: u64, reason: String },
    /// The room failed here (an abort, a give-up): whom to tell now.
    FailAndTell { room: u64, reason: String },
    /// Nothing of the room is this rank's to send (a dummy CP rank or a
    /// dummy destination): it succeeds unless it failed.
    Succeed { room: u64 },
    /// A chunk is about to be queued: the room is in transfer.
    Queue { room: u64, now: Instant },
    /// The sender polls; `give_up`: the reason to fail a room still
    /// bootstrapping (its bootstrap timeout passed).
    Poll { room: u64, give_up: Option<String> },
    /// The room's state.
    State { room: u64 },
    /// Tokens the decode already holds, taken.
    TakePrefixLen { room: u64 },
    /// KV and state bytes confirmed written.
    PayloadBytes { room: u64 },
    /// Bytes of the room confirmed written.
    Payload { room: u64, bytes: u64 },
    /// The room's failure reason, taken.
    TakeFailure { room: u64 },
    /// The sender is cleared.
    Clear { room: u64 },
    /// A decode session registered (again): its ring is new.
    Registered { session: &'a str },
    /// A decode rank's destination for the room.
    Transfer {
        room: u64,
        info: Arc<TransferInfo>,
        caps: Caps,
        now: Instant,
    },
    /// A refused request enters its room failed (within `max_rooms`).
    Refuse { room: u64, max_rooms: usize },
    /// An ABORT from a decode rank.
    Abort {
        room: u64,
        target: AckTarget,
        caps: Caps,
        now: Instant,
    },
    /// A decode ring's watermark.
    Watermark {
        session: &'a str,
        round: u64,
        tail: u64,
    },
    /// A staging allocation the decode answered.
    StagingRsp {
        room: u64,
        session: &'a str,
        chunk: u64,
        allocation: StagingAllocation,
    },
    /// What staging knows of a chunk of the room at `session`.
    StagingCheck {
        room: u64,
        session: &'a str,
        chunk: u64,
    },
    /// A worker dequeued a chunk of the room.
    Dequeue { room: u64 },
    /// A worker finished a chunk of the room.
    Finish { room: u64, is_last: bool },
    /// Whether the room takes no more writes (failed or gone).
    Stopped { room: u64 },
    /// The transfer ended with `status`.
    Conclude {
        room: u64,
        status: KvPoll,
        targets: Option<Vec<(String, u16)>>,
        reason: Option<String>,
    },
    /// Start journaling state changes.
    Watch,
    /// The state changes journaled since the last take.
    TakeChanges,
}

/// What the rooms answer; each input has one kind of answer.
#[derive(Debug)]
pub(crate) enum Output {
    /// Done; nothing to act on.
    Done,
    /// The room's state (`None`: unknown).
    State(Option<KvPoll>),
    /// A yes or no.
    Flag(bool),
    /// A count (bytes, tokens).
    Count(u64),
    /// A failure reason.
    Reason(Option<String>),
    /// Decode endpoints to send the room's `Failed` status.
    Notice(FailedNotice),
    /// `Poll`: the state, and whom to tell when it failed now.
    Polled(KvPoll, Option<FailedNotice>),
    /// `Queue`: the sum of the destinations' engine ports (the worker
    /// shard), or `None`: nothing to send (failed, gone, a dummy).
    Shard(Option<u64>),
    /// `Clear`: the room's state before, and ABORT ACKs now owed (the
    /// room drained).
    Cleared(Option<KvPoll>, Vec<AckTarget>),
    /// `Transfer`: what became of the request, and how many unclaimed
    /// rooms were dropped to make space.
    Transfer(Admission, usize),
    /// `Abort`: whom to tell, whom to ACK, what to count.
    Aborted(AbortEffect),
    /// `StagingCheck`: the chunk's allocation and the ring's watermark,
    /// or `None`: the room stopped.
    Staging(Option<(Option<StagingAllocation>, (u64, u64))>),
    /// `Dequeue`: the room's destinations, or `None`: failed or gone.
    Infos(Option<Vec<Arc<TransferInfo>>>),
    /// `Finish`: ABORT ACKs and a deferred failure now owed.
    Finished(Vec<AckTarget>, FailedNotice),
    /// `Conclude`: the status, reason and whom to send it, and when the
    /// room's first chunk was queued; `None`: the room was cleared.
    Concluded(Option<Conclusion>),
    /// Journaled state changes.
    Changes(Vec<(u64, Option<KvPoll>)>),
}

/// How a transfer request was admitted.
#[derive(Debug)]
pub(crate) enum Admission {
    /// Recorded; `complete`: every decode rank's destination is in, and
    /// these are they.
    Added(Option<Vec<Arc<TransferInfo>>>),
    /// Too many destination bytes pending (`pending` of them).
    OverBytes(usize),
    /// Too many rooms pending.
    OverRooms,
    /// Too many rooms pending for this decode session.
    OverSession,
    /// The room was finished here: answer `Failed` with this reason.
    Finished(Option<String>),
    /// The decode session restarted after the room began sending.
    Restarted,
}

/// What an ABORT did.
#[derive(Debug, Default)]
pub(crate) struct AbortEffect {
    /// Other decode endpoints of a room not entered yet, told at once.
    pub others: Vec<(String, u16)>,
    /// Whether the room failed now.
    pub failed: bool,
    /// Whether the ACK endpoint was refused (too many for the room).
    pub over_limit: bool,
    /// Whether the room was live (not succeeded) when it came.
    pub active: bool,
    /// ABORT ACKs owed now (nothing of the room in flight).
    pub acks: Vec<AckTarget>,
    /// Unclaimed rooms dropped on the way.
    pub expired: usize,
}

/// A concluded transfer.
#[derive(Debug)]
pub(crate) struct Conclusion {
    /// The status sent.
    pub status: KvPoll,
    /// Its reason.
    pub reason: Option<String>,
    /// Decode endpoints to send it.
    pub targets: Vec<(String, u16)>,
    /// When the room's first chunk was queued.
    pub started: Option<Instant>,
}
