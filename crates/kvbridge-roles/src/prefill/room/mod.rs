//! The prefill side's rooms driven as a sans-IO state machine (in the
//! shape of `prefill/pipeline.rs`): the drivers — the sender a scheduler
//! holds, the bootstrap inbox, the workers — hand [`PrefillRooms`] an
//! [`Input`] under the rooms lock and act on the [`Output`] it returns.
//!
//! **Owns:** the rules of a room's life on this side: which requests are
//! admitted (caps, finished rooms, restarted decodes), when a room is in
//! transfer, how an ABORT fails it and when it is acknowledged (only once
//! nothing of the room is in flight), whom a failure is told and when, and
//! what a cleared room leaves behind.
//!
//! **Never:** touches a socket, an engine, a lock, the metrics or a clock
//! (time comes in with the input); logs.
//!
//! ```text
//!   Open ─▶ Bootstrapping ─Transfer × n (complete)─▶ WaitingForInput ─Queue─▶ Transferring
//!      Transferring ─Conclude(Success)─▶ Success        any ─Abort / Fail / Conclude(Failed)─▶ Failed
//!   Failed: the decodes are told once nothing is in flight (Finish); ACKs go out then too
//!   Clear ─▶ gone (remembered as Sent / Failed for late requests)
//! ```

mod io;
mod rooms;
#[cfg(test)]
mod tests;

use std::sync::Arc;
use std::time::Instant;

use kvbridge_wire::KvPoll;

pub(crate) use io::{AbortEffect, Admission, Caps, Conclusion, Input, Output};

pub(crate) use rooms::PrefillRooms;

use super::state::{AckTarget, Concluded, FailedNotice, TransferInfo};

impl PrefillRooms {
    /// Applies one input; see [`Input`] for what each answers.
    pub fn handle(&mut self, input: Input<'_>) -> Output {
        match input {
            Input::Open { room, dummy } => {
                self.open(room, dummy);
                Output::Done
            }
            Input::Fail { room, reason } => {
                self.table.fail(room, reason);
                Output::Done
            }
            Input::FailAndTell { room, reason } => Output::Notice(self.fail_and_tell(room, reason)),
            Input::Succeed { room } => {
                if self.table.get(room) != Some(KvPoll::Failed) {
                    self.table.update(room, KvPoll::Success);
                }
                Output::Done
            }
            Input::Queue { room, now } => Output::Shard(self.queue(room, now)),
            Input::Poll { room, give_up } => {
                let status = self.table.get(room).unwrap_or(KvPoll::Failed);
                match give_up {
                    Some(reason) if status == KvPoll::Bootstrapping => {
                        // The decode ranks that did send their destinations are told.
                        let notice = self.fail_and_tell(room, reason);
                        Output::Polled(KvPoll::Failed, Some(notice))
                    }
                    _ => Output::Polled(status, None),
                }
            }
            Input::State { room } => Output::State(self.table.get(room)),
            Input::TakePrefixLen { room } => {
                Output::Count(self.with(room, |r| r.prefix_len.take()).unwrap_or(0))
            }
            Input::PayloadBytes { room } => {
                Output::Count(self.get(room).map_or(0, |r| r.payload_bytes))
            }
            Input::Payload { room, bytes } => {
                self.count_payload(room, bytes);
                Output::Done
            }
            Input::TakeFailure { room } => Output::Reason(self.table.take_failure(room)),
            Input::Clear { room } => {
                let (state, acks) = self.clear(room);
                Output::Cleared(state, acks)
            }
            Input::Registered { session } => {
                self.watermarks.remove(session);
                Output::Done
            }
            Input::Transfer {
                room,
                info,
                caps,
                now,
            } => {
                let (admission, expired) = self.admit(room, info, &caps, now);
                Output::Transfer(admission, expired)
            }
            Input::Refuse { room, max_rooms } => {
                if !self.table.contains(room) && self.table.len() < max_rooms {
                    self.table.update(room, KvPoll::Bootstrapping);
                }
                Output::Done
            }
            Input::Abort {
                room,
                target,
                caps,
                now,
            } => Output::Aborted(self.abort(room, target, &caps, now)),
            Input::Watermark {
                session,
                round,
                tail,
            } => {
                let entry = self.watermarks.entry(session.to_owned()).or_insert((0, 0));
                if (round, tail) > *entry {
                    *entry = (round, tail);
                }
                Output::Done
            }
            Input::StagingRsp {
                room,
                session,
                chunk,
                allocation,
            } => Output::Flag(self.staging_rsp(room, session, chunk, allocation)),
            Input::StagingCheck {
                room,
                session,
                chunk,
            } => Output::Staging((!self.is_stopped(room)).then(|| {
                let allocation = self
                    .get(room)
                    .and_then(|r| r.allocations.get(session)?.get(&chunk))
                    .copied();
                let watermark = self.watermarks.get(session).copied().unwrap_or((0, 0));
                (allocation, watermark)
            })),
            Input::Dequeue { room } => {
                // Counted at dequeue, before the status check: nothing
                // outstanding then means nothing of the room is dequeued
                // or in flight, which the abort ACK relies on.
                self.with(room, |r| r.outstanding += 1);
                Output::Infos((!self.is_stopped(room)).then(|| self.infos(room).to_vec()))
            }
            Input::Finish { room, is_last } => {
                let (acks, failed) = self.finish(room, is_last);
                Output::Finished(acks, failed)
            }
            Input::Stopped { room } => Output::Flag(self.is_stopped(room)),
            Input::Conclude {
                room,
                status,
                targets,
                reason,
            } => Output::Concluded(self.conclude(room, status, targets, reason)),
            Input::Watch => {
                self.table.watch();
                Output::Done
            }
            Input::TakeChanges => Output::Changes(self.table.take_changes()),
        }
    }

    fn open(&mut self, room: u64, dummy: bool) {
        // A room an ABORT entered failed is now this sender's to clear.
        let fresh = !self.table.contains(room);
        if fresh {
            self.concluded.remove(room);
        }
        self.with(room, |r| {
            r.aborted_early = None;
            if fresh {
                // A new lifecycle of this room id drops what an earlier
                // request that used it left behind, except its chunks still
                // in flight: an ABORT of the new one must wait for them too.
                r.ack_targets.clear();
                r.payload_bytes = 0;
                r.failed_told.clear();
                r.fail_on_drain = false;
            }
        });
        let first = if dummy {
            KvPoll::WaitingForInput
        } else {
            KvPoll::Bootstrapping
        };
        self.table.update(room, first);
    }

    fn queue(&mut self, room: u64, now: Instant) -> Option<u64> {
        if self.is_stopped(room) {
            return None;
        }
        // No destination: this rank is a dummy for the room.
        let infos = self.get(room).map(|r| &r.infos).filter(|i| !i.is_empty())?;
        // Same destinations → same shard, so a failed session fails its
        // rooms in order (sglang's port-sum sharding).
        let port_sum = infos
            .iter()
            .map(|i| {
                i.session
                    .rsplit(':')
                    .next()
                    .and_then(|p| p.parse::<u64>().ok())
                    .unwrap_or(0)
            })
            .fold(0u64, u64::wrapping_add);
        self.with(room, |r| {
            r.started.get_or_insert(now);
        });
        self.table.update(room, KvPoll::Transferring);
        Some(port_sum)
    }

    fn clear(&mut self, room: u64) -> (Option<KvPoll>, Vec<AckTarget>) {
        let state = self.table.remove(room);
        let outcome = match state {
            Some(KvPoll::Failed) => Some(Concluded::Failed(
                self.table.failure(room).map(str::to_owned),
            )),
            Some(KvPoll::Success) => Some(Concluded::Sent),
            _ => None,
        };
        if let Some(outcome) = outcome {
            self.concluded.insert(room, outcome);
        }
        self.with(room, |r| {
            r.prefix_len = None;
            r.payload_bytes = 0;
        });
        if self.outstanding(room) == 0 {
            self.remove_infos(room);
        }
        (state, self.take_drained_acks(room))
    }

    /// A decode rank's destination: admitted within the caps, answered
    /// at once for a finished room, refused for a restarted decode.
    fn admit(
        &mut self,
        room: u64,
        info: Arc<TransferInfo>,
        caps: &Caps,
        now: Instant,
    ) -> (Admission, usize) {
        let held = info.held_bytes();
        let over_bytes =
            |r: &PrefillRooms| r.info_bytes.saturating_add(held) > caps.max_pending_bytes;
        let over_rooms =
            |r: &PrefillRooms| r.infos(room).is_empty() && r.pending_rooms() >= caps.max_rooms;
        let mut expired = 0;
        if over_rooms(self) || over_bytes(self) {
            // Full: first drop rooms no sender claimed within the bootstrap
            // timeout (a flood of requests for rooms that never come must
            // not hold the cap for good).
            expired = self.expire_unclaimed(caps.unclaimed_ttl, now).len();
        }
        if over_bytes(self) {
            return (Admission::OverBytes(self.info_bytes), expired);
        }
        if over_rooms(self) {
            return (Admission::OverRooms, expired);
        }
        let already_sent = || {
            Some(format!(
                "room {room} was already sent in full to an earlier request; it cannot be sent again"
            ))
        };
        let finished = match self.table.get(room) {
            Some(KvPoll::Failed) => Some(self.table.failure(room).map(str::to_owned)),
            Some(KvPoll::Success) => Some(already_sent()),
            Some(_) => None,
            None => match self.concluded.get(room) {
                Some(Concluded::Failed(reason)) => Some(reason.clone()),
                Some(Concluded::Sent) => Some(already_sent()),
                None => None,
            },
        };
        if let Some(reason) = finished {
            return (Admission::Finished(reason), expired);
        }
        // The same decode session asking again from a new incarnation
        // after this room began sending: earlier chunks went to the dead
        // incarnation, so the new one could never hold every byte.
        let restarted = self
            .infos(room)
            .iter()
            .any(|i| i.session == info.session && i.registration != info.registration);
        if restarted && self.get(room).is_some_and(|r| r.started.is_some()) {
            return (Admission::Restarted, expired);
        }
        if !self.session_has_room(room, &info.session, caps.max_rooms_per_session) {
            return (Admission::OverSession, expired);
        }
        let required = info.required_dst_info_num;
        let infos = self.add_info(room, info);
        if infos.len() as u64 != required {
            return (Admission::Added(None), expired);
        }
        let prefix = infos.iter().find_map(|i| i.decode_prefix_len).unwrap_or(0);
        self.with(room, |r| r.prefix_len = Some(prefix));
        self.table.update(room, KvPoll::WaitingForInput);
        (Admission::Added(Some(infos)), expired)
    }

    /// Marks the room Failed first (no new chunk is accepted after this);
    /// its ACK goes out once nothing of the room is in flight, so no write
    /// lands after it.
    fn abort(&mut self, room: u64, target: AckTarget, caps: &Caps, now: Instant) -> AbortEffect {
        let mut effect = AbortEffect {
            active: self.table.get(room).is_some_and(|s| s != KvPoll::Success),
            // Also drops entries of earlier such rooms no sender claimed.
            expired: self.expire_unclaimed(caps.unclaimed_ttl, now).len(),
            ..AbortEffect::default()
        };
        // A room not entered yet (its sender not created, or not every
        // decode rank's request in) is entered failed (up to `max_rooms`):
        // a later request or sender for it must not revive it and write
        // into pages whose ABORT was acknowledged.
        let unknown = !self.table.contains(room) && self.table.len() < caps.max_rooms;
        if unknown {
            self.table.update(room, KvPoll::Bootstrapping);
            self.with(room, |r| r.aborted_early = Some(now));
            // The other decode ranks whose requests for it wait here are
            // told at once, not left to their room timeout.
            effect.others = self
                .infos(room)
                .iter()
                .filter_map(|i| i.status_target())
                .filter(|(ip, port)| (ip.as_str(), *port) != (target.ip.as_str(), target.port))
                .collect();
            self.remove_infos(room);
        }
        if effect.active || unknown {
            self.table.fail(room, "Aborted by the decode side");
            effect.failed = true;
        }
        effect.over_limit = self.with(room, |r| {
            let targets = &mut r.ack_targets;
            targets.retain(|t| (t.ip.as_str(), t.port) != (target.ip.as_str(), target.port));
            let over = targets.len() >= caps.max_abort_endpoints;
            if !over {
                targets.push(target);
            }
            over
        });
        effect.acks = self.take_drained_acks(room);
        effect
    }

    fn staging_rsp(
        &mut self,
        room: u64,
        session: &str,
        chunk: u64,
        allocation: (i64, i64, i64),
    ) -> bool {
        let known = self.infos(room).iter().any(|i| i.session == session);
        if !known {
            return false;
        }
        self.with(room, |r| {
            let chunks = r.allocations.entry(session.to_owned()).or_default();
            if chunks.len() < MAX_STAGED_CHUNKS_PER_ROOM || chunks.contains_key(&chunk) {
                chunks.insert(chunk, allocation);
            }
        });
        true
    }

    fn finish(&mut self, room: u64, is_last: bool) -> (Vec<AckTarget>, FailedNotice) {
        self.with(room, |r| r.outstanding = r.outstanding.saturating_sub(1));
        let drained = self.outstanding(room) == 0;
        let acks = self.take_drained_acks(room);
        // A failure decided here while chunks were in flight (an abort)
        // reaches the decodes now that none is.
        let failed = self.take_drained_failure(room);
        let concluded = match self.table.get(room) {
            None | Some(KvPoll::Success) => true,
            Some(KvPoll::Failed) => is_last,
            Some(_) => false,
        };
        if drained && concluded {
            self.forget_transfer(room);
        }
        (acks, failed)
    }

    /// sglang `conclude_transfer`: a recorded failure or an earlier
    /// `Failed` turns `Success` into `Failed`; the first failure reason is
    /// kept; the status goes to `targets` (default: every non-dummy decode
    /// endpoint of the room, each told a failure once).
    fn conclude(
        &mut self,
        room: u64,
        status: KvPoll,
        targets: Option<Vec<(String, u16)>>,
        reason: Option<String>,
    ) -> Option<Conclusion> {
        if !self.table.contains(room) {
            return None;
        }
        let (mut status, mut reason) = (status, reason);
        if status == KvPoll::Success {
            if let Some(recorded) = self.table.failure(room) {
                reason = Some(recorded.to_owned());
                status = KvPoll::Failed;
            } else if self.table.get(room) == Some(KvPoll::Failed) {
                status = KvPoll::Failed;
                reason = Some(
                    reason.unwrap_or_else(|| "Room marked Failed before the transfer ended".into()),
                );
            }
        }
        if status == KvPoll::Failed {
            let why = reason.unwrap_or_else(|| "KV transfer failed".into());
            reason = Some(self.table.first_failure(room, why));
        }
        let mut targets = targets.unwrap_or_else(|| self.notify_targets(room));
        if status == KvPoll::Failed {
            targets = self.untold(room, targets);
        }
        self.table.update(room, status);
        Some(Conclusion {
            status,
            reason,
            targets,
            started: self.with(room, |r| r.started.take()),
        })
    }
}

/// Most staging allocations kept per room and decode rank.
const MAX_STAGED_CHUNKS_PER_ROOM: usize = 1 << 16;
