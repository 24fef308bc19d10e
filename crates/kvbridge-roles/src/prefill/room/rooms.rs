//! What the prefill side keeps of each room, as one [`PrefillRoom`], and the
//! few records that span rooms (states, caps, staging watermarks, rooms
//! already concluded).

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvbridge_wire::KvPoll;

use crate::prefill::state::{
    AckTarget, ConcludedRooms, FailedNotice, StagingAllocation, TransferInfo,
};
use crate::rooms::RoomTable;

/// Everything one room holds here beyond its state. An entry is dropped
/// once it holds nothing (see [`PrefillRoom::is_empty`]).
#[derive(Debug, Default)]
pub(crate) struct PrefillRoom {
    /// Its decode destinations, in arrival order (changed only through
    /// [`PrefillRooms::add_info`] / [`PrefillRooms::remove_infos`], which
    /// keep the caps' counters in step).
    pub infos: Vec<Arc<TransferInfo>>,
    /// When it got its first destination (to expire rooms no sender
    /// ever claims).
    pub pending_since: Option<Instant>,
    /// When an ABORT failed it before any sender claimed it: dropped from
    /// the table after the bootstrap timeout unless a sender claims it.
    pub aborted_early: Option<Instant>,
    /// Chunks dequeued and not yet finished.
    pub outstanding: usize,
    /// Abort ACKs waiting for it to drain.
    pub ack_targets: Vec<AckTarget>,
    /// Tokens the decode already holds, once its destinations are complete.
    pub prefix_len: Option<u64>,
    /// When its first chunk was queued (latency metric).
    pub started: Option<Instant>,
    /// KV and state bytes confirmed written (aux not counted), kept until
    /// its sender is cleared or the id reused.
    pub payload_bytes: u64,
    /// Decode endpoints already sent its `Failed` status (each is told once).
    pub failed_told: Vec<(String, u16)>,
    /// Failed here while chunks were in flight: its decodes are told
    /// once nothing is.
    pub fail_on_drain: bool,
    /// Staging allocations the decodes answered, per session and chunk.
    pub allocations: HashMap<String, HashMap<u64, StagingAllocation>>,
}

impl PrefillRoom {
    /// Whether the entry holds nothing.
    fn is_empty(&self) -> bool {
        self.infos.is_empty()
            && self.pending_since.is_none()
            && self.aborted_early.is_none()
            && self.outstanding == 0
            && self.ack_targets.is_empty()
            && self.prefix_len.is_none()
            && self.started.is_none()
            && self.payload_bytes == 0
            && self.failed_told.is_empty()
            && !self.fail_on_drain
            && self.allocations.is_empty()
    }
}

/// Room-level state of the prefill side.
#[derive(Debug, Default)]
pub(crate) struct PrefillRooms {
    /// Every room's state and failure reason.
    pub table: RoomTable,
    rooms: HashMap<u64, PrefillRoom>,
    /// Rooms with destinations.
    pending: usize,
    /// Rooms with a destination at each decode session.
    rooms_per_session: HashMap<String, usize>,
    /// [`TransferInfo::held_bytes`] of every destination held.
    pub info_bytes: usize,
    /// When [`PrefillRooms::expire_unclaimed`] last swept.
    last_expiry: Option<Instant>,
    /// Latest staging watermark per decode session: `(round, tail)`.
    pub watermarks: HashMap<String, (u64, u64)>,
    /// Recently cleared rooms, to answer late requests for them.
    pub concluded: ConcludedRooms,
}

impl PrefillRooms {
    /// The room's record, if it holds anything.
    pub fn get(&self, room: u64) -> Option<&PrefillRoom> {
        self.rooms.get(&room)
    }

    /// Changes the room's record (created empty), dropping it if it ends
    /// up holding nothing.
    pub fn with<R>(&mut self, room: u64, f: impl FnOnce(&mut PrefillRoom) -> R) -> R {
        let Some(entry) = self.rooms.get_mut(&room) else {
            // Kept only if `f` gave it something to hold.
            let mut fresh = PrefillRoom::default();
            let out = f(&mut fresh);
            if !fresh.is_empty() {
                self.rooms.insert(room, fresh);
            }
            return out;
        };
        let out = f(entry);
        if entry.is_empty() {
            self.rooms.remove(&room);
        }
        out
    }

    /// The room's destinations (none if it has none).
    pub fn infos(&self, room: u64) -> &[Arc<TransferInfo>] {
        self.rooms.get(&room).map_or(&[], |r| &r.infos)
    }

    /// Rooms with destinations.
    pub fn pending_rooms(&self) -> usize {
        self.pending
    }

    /// Chunks of the room dequeued and not finished.
    pub fn outstanding(&self, room: u64) -> usize {
        self.rooms.get(&room).map_or(0, |r| r.outstanding)
    }

    /// Whether the room is gone or failed here (nothing more of it is sent).
    pub(crate) fn is_stopped(&self, room: u64) -> bool {
        matches!(self.table.get(room), None | Some(KvPoll::Failed))
    }

    /// Every non-dummy decode endpoint of a room, each once.
    pub fn notify_targets(&self, room: u64) -> Vec<(String, u16)> {
        let mut targets: Vec<(String, u16)> = Vec::new();
        for t in self.infos(room).iter().filter_map(|i| i.status_target()) {
            if !targets.contains(&t) {
                targets.push(t);
            }
        }
        targets
    }

    /// Of `targets`, those not yet sent `room`'s `Failed` status, marked
    /// as sent now.
    pub fn untold(&mut self, room: u64, targets: Vec<(String, u16)>) -> Vec<(String, u16)> {
        self.with(room, |r| {
            let mut out = Vec::new();
            for t in targets {
                if !r.failed_told.contains(&t) {
                    r.failed_told.push(t.clone());
                    out.push(t);
                }
            }
            out
        })
    }

    /// Fails `room` here with `reason` (sglang `record_failure` +
    /// `update_status`) and returns whom to tell now: every known decode
    /// endpoint of the room not told yet, or nobody while chunks of it are
    /// in flight (a decode freeing its pages on `Failed` must not see a
    /// later write; [`PrefillRooms::take_drained_failure`] tells them once
    /// they drained). A room that already succeeded is not reported
    /// failed to its decodes, which hold every byte.
    pub fn fail_and_tell(&mut self, room: u64, reason: impl Into<String>) -> FailedNotice {
        let succeeded = self.table.get(room) == Some(KvPoll::Success);
        self.table.fail(room, reason);
        if succeeded {
            return (Vec::new(), None);
        }
        if self.outstanding(room) > 0 {
            self.with(room, |r| r.fail_on_drain = true);
            return (Vec::new(), None);
        }
        let targets = self.notify_targets(room);
        (
            self.untold(room, targets),
            self.table.failure(room).map(str::to_owned),
        )
    }

    /// Once `room` drained: the decode endpoints still owed the `Failed`
    /// status of a failure [`PrefillRooms::fail_and_tell`] deferred.
    pub fn take_drained_failure(&mut self, room: u64) -> FailedNotice {
        let owed = self.outstanding(room) == 0
            && self.with(room, |r| std::mem::take(&mut r.fail_on_drain));
        if !owed {
            return (Vec::new(), None);
        }
        let targets = self.notify_targets(room);
        (
            self.untold(room, targets),
            self.table.failure(room).map(str::to_owned),
        )
    }

    /// Takes the room's ACK targets if nothing of it is in flight.
    pub fn take_drained_acks(&mut self, room: u64) -> Vec<AckTarget> {
        if self.outstanding(room) > 0 {
            return Vec::new();
        }
        self.with(room, |r| std::mem::take(&mut r.ack_targets))
    }

    /// Counts `bytes` of KV or state confirmed written for `room`.
    pub fn count_payload(&mut self, room: u64, bytes: u64) {
        self.with(room, |r| {
            r.payload_bytes = r.payload_bytes.saturating_add(bytes)
        });
    }

    /// Drops everything kept for a finished room except its status, its
    /// payload count, its ACK targets and whom its failure was told.
    pub fn forget_transfer(&mut self, room: u64) {
        self.remove_infos(room);
        self.with(room, |r| {
            r.prefix_len = None;
            r.outstanding = 0;
            r.allocations.clear();
        });
    }

    /// Records `info` as the room's destination at its session (replacing
    /// that session's earlier one); returns the room's destinations.
    pub fn add_info(&mut self, room: u64, info: Arc<TransferInfo>) -> Vec<Arc<TransferInfo>> {
        let entry = self.rooms.entry(room).or_default();
        entry.pending_since.get_or_insert_with(Instant::now);
        if entry.infos.is_empty() {
            self.pending += 1;
        }
        let before = entry.infos.len();
        let mut freed = 0;
        entry.infos.retain(|i| {
            let keep = i.session != info.session;
            if !keep {
                freed += i.held_bytes();
            }
            keep
        });
        self.info_bytes = (self.info_bytes + info.held_bytes()).saturating_sub(freed);
        if entry.infos.len() == before {
            *self
                .rooms_per_session
                .entry(info.session.clone())
                .or_default() += 1;
        }
        entry.infos.push(info);
        entry.infos.clone()
    }

    /// Whether `session` may be given a destination in `room`: it already
    /// has one there, or it has fewer than `cap` rooms.
    pub fn session_has_room(&self, room: u64, session: &str, cap: usize) -> bool {
        let here = self.infos(room).iter().any(|i| i.session == session);
        here || self.rooms_per_session.get(session).copied().unwrap_or(0) < cap
    }

    /// Drops the room's destinations (and whom its failure was told).
    pub fn remove_infos(&mut self, room: u64) {
        let infos = self.with(room, |r| {
            r.failed_told.clear();
            r.pending_since = None;
            std::mem::take(&mut r.infos)
        });
        if !infos.is_empty() {
            self.pending = self.pending.saturating_sub(1);
        }
        for info in infos {
            self.info_bytes = self.info_bytes.saturating_sub(info.held_bytes());
            if let Some(n) = self.rooms_per_session.get_mut(&info.session) {
                *n = n.saturating_sub(1);
                if *n == 0 {
                    self.rooms_per_session.remove(&info.session);
                }
            }
        }
    }

    /// Drops the destinations of rooms that no sender claimed within `ttl`
    /// of their first request (junk, or abandoned: their decode gave up by
    /// then, as a sender gives up on its decode), and forgets rooms an
    /// ABORT entered failed that no sender claimed; sweeps at most once a
    /// second. Returns the rooms whose destinations were dropped.
    pub fn expire_unclaimed(&mut self, ttl: Duration, now: Instant) -> Vec<u64> {
        if self
            .last_expiry
            .is_some_and(|t| now.duration_since(t) < EXPIRY_SWEEP)
        {
            return Vec::new();
        }
        self.last_expiry = Some(now);
        let overdue = |since: Option<Instant>| since.is_some_and(|s| now.duration_since(s) >= ttl);
        let stale: Vec<u64> = self
            .rooms
            .iter()
            .filter(|(room, r)| overdue(r.pending_since) && !self.table.contains(**room))
            .map(|(room, _)| *room)
            .collect();
        for room in &stale {
            self.remove_infos(*room);
        }
        let forgotten: Vec<u64> = self
            .rooms
            .iter()
            .filter(|(_, r)| overdue(r.aborted_early))
            .map(|(room, _)| *room)
            .collect();
        for room in forgotten {
            self.with(room, |r| r.aborted_early = None);
            if self.table.get(room) == Some(KvPoll::Failed) {
                self.table.remove(room);
            }
        }
        stale
    }
}

/// How often [`PrefillRooms::expire_unclaimed`] may sweep.
const EXPIRY_SWEEP: Duration = Duration::from_secs(1);

#[cfg(test)]
mod tests {
    use kvbridge_plan::TransferRequest;

    use super::*;

    fn info(endpoint: &str, port: u16) -> Arc<TransferInfo> {
        Arc::new(TransferInfo {
            endpoint: endpoint.into(),
            dst_port: port,
            session: format!("{endpoint}:{}", port + 1000),
            request: Some(TransferRequest::default()),
            required_dst_info_num: 2,
            decode_prefix_len: None,
            registration: 0,
        })
    }

    #[test]
    fn rooms_aborted_before_any_sender_are_forgotten_after_the_timeout() {
        let ttl = Duration::from_secs(300);
        let t0 = Instant::now();
        let mut r = PrefillRooms::default();
        for room in [1, 2, 3] {
            r.table.update(room, KvPoll::Bootstrapping);
            r.table.fail(room, "Aborted by the decode side");
        }
        r.with(1, |x| x.aborted_early = Some(t0));
        r.with(2, |x| x.aborted_early = Some(t0 + Duration::from_secs(200)));
        // Room 3 was claimed by a sender (not aborted early).
        r.expire_unclaimed(ttl, t0 + Duration::from_secs(301));
        assert!(!r.table.contains(1), "expired");
        assert!(r.table.contains(2), "not yet");
        assert!(r.table.contains(3), "its sender clears it");
        // The next sweep (a second later at least) takes room 2 in turn.
        r.expire_unclaimed(ttl, t0 + Duration::from_secs(501));
        assert!(!r.table.contains(2));
        assert!(
            r.get(1).is_none() && r.get(2).is_none(),
            "nothing left of them"
        );
    }

    #[test]
    fn unclaimed_destinations_expire_and_free_the_caps() {
        let ttl = Duration::from_secs(300);
        let t0 = Instant::now();
        let mut r = PrefillRooms::default();
        r.add_info(1, info("10.0.0.1", 5000));
        r.add_info(1, info("10.0.0.2", 5000));
        r.add_info(2, info("10.0.0.1", 5000));
        assert_eq!(r.pending_rooms(), 2);
        assert!(
            !r.session_has_room(3, "10.0.0.1:6000", 2),
            "two rooms at that session"
        );
        // Room 2 has a sender (it is in the table): it never expires here.
        r.table.update(2, KvPoll::Bootstrapping);
        let expired = r.expire_unclaimed(ttl, t0 + ttl + Duration::from_secs(1));
        assert_eq!(expired, vec![1]);
        assert_eq!(r.pending_rooms(), 1);
        assert!(r.session_has_room(3, "10.0.0.1:6000", 2));
        r.remove_infos(2);
        assert_eq!((r.pending_rooms(), r.info_bytes), (0, 0));
        assert!(r.get(1).is_none() && r.get(2).is_none());
    }

    #[test]
    fn a_failure_is_told_to_each_decode_once_and_after_the_drain() {
        let mut r = PrefillRooms::default();
        r.table.update(7, KvPoll::Bootstrapping);
        r.add_info(7, info("10.0.0.1", 5000));
        r.add_info(7, info("10.0.0.2", 5000));
        // A chunk in flight: nobody is told yet.
        r.with(7, |x| x.outstanding = 1);
        assert_eq!(r.fail_and_tell(7, "Aborted by AbortReq.").0, vec![]);
        assert_eq!(r.take_drained_failure(7).0, vec![]);
        r.with(7, |x| x.outstanding = 0);
        let (told, reason) = r.take_drained_failure(7);
        assert_eq!(
            told,
            vec![("10.0.0.1".into(), 5000), ("10.0.0.2".into(), 5000)]
        );
        assert_eq!(reason.as_deref(), Some("Aborted by AbortReq."));
        // Once: a later failure of the room tells nobody again.
        assert_eq!(r.take_drained_failure(7).0, vec![]);
        assert_eq!(r.fail_and_tell(7, "again").0, vec![]);
        let more = vec![("10.0.0.2".into(), 5000), ("10.0.0.3".into(), 5000)];
        assert_eq!(r.untold(7, more), vec![("10.0.0.3".into(), 5000)]);
        // A room that already succeeded is not reported failed.
        r.table.update(8, KvPoll::Bootstrapping);
        r.add_info(8, info("10.0.0.1", 5000));
        r.table.update(8, KvPoll::Success);
        assert_eq!(r.fail_and_tell(8, "late abort").0, vec![]);
    }
}
