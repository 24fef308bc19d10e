//! What the prefill side knows about rooms and decode peers, behind one lock.

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvbridge_plan::{PreparedPeer, StagingSource, TransferRequest};

use crate::rooms::RoomTable;

/// A decode rank's staging ring, and how we stage towards it.
#[derive(Debug)]
pub(crate) struct StagingDest {
    /// Our gather geometry towards that rank.
    pub source: StagingSource,
    /// The ring's address in the decode's memory.
    pub ring_base: u64,
    /// The ring's size.
    pub ring_size: u64,
}

/// One decode rank's destination for one room (sglang `TransferInfo`).
#[derive(Debug, Clone)]
pub(crate) struct TransferInfo {
    /// The decode rank's IP for status messages.
    pub endpoint: String,
    /// The decode rank's zmq port.
    pub dst_port: u16,
    /// The decode rank's engine session.
    pub session: String,
    /// Where the KV goes; `None` for a dummy rank.
    pub request: Option<TransferRequest>,
    /// How many decode ranks report for this room.
    pub required_dst_info_num: u64,
    /// Tokens the decode already holds.
    pub decode_prefix_len: Option<u64>,
    /// Generation of the session's registration when this arrived; a later
    /// registration (a restarted decode) makes this destination stale.
    pub registration: u64,
}

impl TransferInfo {
    /// Bytes this destination holds while its room is pending: its page
    /// lists and names, and the record itself.
    pub fn held_bytes(&self) -> usize {
        let pages = self.request.as_ref().map_or(0, |r| {
            let state: usize = r.dst_state_indices.iter().map(Vec::len).sum();
            let device = r.dst_device_kv_indices.as_ref().map_or(0, Vec::len);
            4 * (r.dst_kv_indices.len() + device) + 8 * state
        });
        pages + self.endpoint.len() + self.session.len() + std::mem::size_of::<Self>()
    }

    /// `tcp://endpoint:port` of the decode rank's socket.
    pub fn zmq_endpoint(&self) -> String {
        crate::control::tcp_endpoint(&self.endpoint, self.dst_port)
    }

    /// Where this rank's room status goes: `(ip, port)`, none for a dummy
    /// rank (it holds no KV from us and gets no status).
    pub fn status_target(&self) -> Option<(String, u16)> {
        self.request
            .as_ref()
            .map(|_| (self.endpoint.clone(), self.dst_port))
    }

    /// `host:port` for messages.
    pub fn host_port(&self) -> String {
        format!("{}:{}", self.endpoint, self.dst_port)
    }
}

/// A decode session's latest registration and its generation.
#[derive(Debug)]
pub(crate) struct PeerEntry {
    /// Increases with every registration received by this manager.
    pub generation: u64,
    /// The decode engine's incarnation it announced (0: not announced).
    pub incarnation: u64,
    /// The registration, prepared or rejected.
    pub peer: Peer,
    /// The decode rank's staging ring, when we stage towards it.
    pub staging: Option<StagingDest>,
    /// The key binding our staging messages with this decode rank (secret
    /// mode: from its registration).
    pub pair_key: Option<kvbridge_wire::PairKey>,
    /// SHA-256 of the registration's frames: an identical one from the
    /// same incarnation is no restart.
    pub digest: [u8; 32],
    /// The decode rank's control endpoint (IP, zmq port) it registered.
    pub control: (String, u16),
}

/// A decode session's registration, prepared for planning or rejected.
#[derive(Debug)]
pub(crate) enum Peer {
    /// Registration accepted; plans can be made against it.
    Ready(PreparedPeer),
    /// Registration refused (incompatible layout); rooms to it fail with this reason.
    Rejected(String),
}

/// Who to acknowledge an abort to once the room drains.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct AckTarget {
    pub ip: String,
    pub port: u16,
    pub generation: Option<u64>,
}

/// One staging allocation the decode answered: `(offset, round, end)`.
pub(crate) type StagingAllocation = (i64, i64, i64);

/// What decode ranks told us about their staging rings.
#[derive(Debug, Default)]
pub(crate) struct StagingRecords {
    /// Latest watermark per decode session: `(round, tail)`.
    pub watermarks: HashMap<String, (u64, u64)>,
    /// Allocations per `(room, session)`, by chunk.
    pub allocations: HashMap<(u64, String), HashMap<u64, StagingAllocation>>,
}

/// Room-level state of the prefill side.
#[derive(Debug, Default)]
pub(crate) struct RoomsState {
    pub table: RoomTable,
    /// Each room's decode destinations, in arrival order (change them
    /// through [`RoomsState::add_info`] / [`RoomsState::remove_infos`], which
    /// keep `rooms_per_session` in step).
    pub infos: HashMap<u64, Vec<Arc<TransferInfo>>>,
    /// Rooms with a destination at each decode session.
    pub rooms_per_session: HashMap<String, usize>,
    /// [`TransferInfo::held_bytes`] of every destination in `infos`.
    pub info_bytes: usize,
    /// When each room in `infos` got its first destination (to expire
    /// rooms no sender ever claims).
    pub pending_since: HashMap<u64, Instant>,
    /// Rooms an ABORT failed before any sender claimed them, and since
    /// when: dropped from the table after the bootstrap timeout unless a
    /// sender claims (and later clears) them.
    pub aborted_early: HashMap<u64, Instant>,
    /// When [`RoomsState::expire_unclaimed`] last swept.
    pub last_expiry: Option<Instant>,
    /// Chunks dequeued and not yet finished, per room.
    pub outstanding: HashMap<u64, usize>,
    /// Abort ACKs waiting for the room to drain.
    pub ack_targets: HashMap<u64, Vec<AckTarget>>,
    /// Decode prefix lengths of rooms whose destinations are complete.
    pub prefix_len: HashMap<u64, u64>,
    /// When each room's first chunk was queued (latency metric).
    pub started: HashMap<u64, Instant>,
    /// KV and state bytes confirmed written per room (aux not counted),
    /// kept until the room's sender is cleared or the room id reused.
    pub payload_bytes: HashMap<u64, u64>,
    /// Staging control messages.
    pub staging: StagingRecords,
    /// Recently cleared rooms, to answer late requests for them.
    pub concluded: ConcludedRooms,
    /// Decode endpoints already sent a room's `Failed` status (each is
    /// told once).
    pub failed_told: HashMap<u64, Vec<(String, u16)>>,
    /// Rooms failed here (abort, give-up) whose decode endpoints are told
    /// once nothing of the room is in flight any more.
    pub fail_on_drain: HashSet<u64>,
}

/// Decode endpoints to send a room's `Failed` status, and the reason.
pub(crate) type FailedNotice = (Vec<(String, u16)>, Option<String>);

impl RoomsState {
    /// Whether the room is gone or failed here (nothing more of it is sent).
    pub(crate) fn is_stopped(&self, room: u64) -> bool {
        matches!(
            self.table.get(room),
            None | Some(kvbridge_wire::KvPoll::Failed)
        )
    }

    /// Every non-dummy decode endpoint of a room, each once.
    pub fn notify_targets(&self, room: u64) -> Vec<(String, u16)> {
        let mut targets: Vec<(String, u16)> = Vec::new();
        for info in self.infos.get(&room).into_iter().flatten() {
            let Some(t) = info.status_target() else {
                continue;
            };
            if !targets.contains(&t) {
                targets.push(t);
            }
        }
        targets
    }

    /// Of `targets`, those not yet sent `room`'s `Failed` status, marked
    /// as sent now.
    pub fn untold(&mut self, room: u64, targets: Vec<(String, u16)>) -> Vec<(String, u16)> {
        let told = self.failed_told.entry(room).or_default();
        let mut out = Vec::new();
        for t in targets {
            if !told.contains(&t) {
                told.push(t.clone());
                out.push(t);
            }
        }
        out
    }

    /// Fails `room` here with `reason` (sglang `record_failure` +
    /// `update_status`) and returns whom to tell now: every known decode
    /// endpoint of the room not told yet, or nobody while chunks of it are
    /// in flight (a decode freeing its pages on `Failed` must not see a
    /// later write; [`RoomsState::take_drained_failure`] tells them once
    /// they drained). A room that already succeeded is not reported
    /// failed to its decodes, which hold every byte.
    pub fn fail_and_tell(&mut self, room: u64, reason: impl Into<String>) -> FailedNotice {
        let succeeded = self.table.get(room) == Some(kvbridge_wire::KvPoll::Success);
        self.table.fail(room, reason);
        if succeeded {
            return (Vec::new(), None);
        }
        if self.outstanding.get(&room).copied().unwrap_or(0) > 0 {
            self.fail_on_drain.insert(room);
            return (Vec::new(), None);
        }
        let targets = self.notify_targets(room);
        (
            self.untold(room, targets),
            self.table.failure(room).map(str::to_owned),
        )
    }

    /// Once `room` drained: the decode endpoints still owed the `Failed`
    /// status of a failure [`RoomsState::fail_and_tell`] deferred.
    pub fn take_drained_failure(&mut self, room: u64) -> FailedNotice {
        if self.outstanding.get(&room).copied().unwrap_or(0) > 0
            || !self.fail_on_drain.remove(&room)
        {
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
        if self.outstanding.get(&room).copied().unwrap_or(0) > 0 {
            return Vec::new();
        }
        self.ack_targets.remove(&room).unwrap_or_default()
    }

    /// Counts `bytes` of KV or state confirmed written for `room`.
    pub fn count_payload(&mut self, room: u64, bytes: u64) {
        let n = self.payload_bytes.entry(room).or_default();
        *n = n.saturating_add(bytes);
    }

    /// Drops everything kept for a finished room except its status.
    pub fn forget_transfer(&mut self, room: u64) {
        self.remove_infos(room);
        self.prefix_len.remove(&room);
        self.outstanding.remove(&room);
        self.staging.allocations.retain(|(r, _), _| *r != room);
    }
}

impl RoomsState {
    /// Records `info` as the room's destination at its session (replacing
    /// that session's earlier one); returns the room's destinations.
    pub fn add_info(&mut self, room: u64, info: Arc<TransferInfo>) -> &[Arc<TransferInfo>] {
        self.pending_since.entry(room).or_insert_with(Instant::now);
        let infos = self.infos.entry(room).or_default();
        let before = infos.len();
        let mut freed = 0;
        infos.retain(|i| {
            let keep = i.session != info.session;
            if !keep {
                freed += i.held_bytes();
            }
            keep
        });
        self.info_bytes = (self.info_bytes + info.held_bytes()).saturating_sub(freed);
        if infos.len() == before {
            *self
                .rooms_per_session
                .entry(info.session.clone())
                .or_default() += 1;
        }
        infos.push(info);
        infos
    }

    /// Whether `session` may be given a destination in `room`: it already
    /// has one there, or it has fewer than `cap` rooms.
    pub fn session_has_room(&self, room: u64, session: &str, cap: usize) -> bool {
        let here = self
            .infos
            .get(&room)
            .is_some_and(|v| v.iter().any(|i| i.session == session));
        here || self.rooms_per_session.get(session).copied().unwrap_or(0) < cap
    }

    /// Drops the room's destinations (and whom its failure was told).
    pub fn remove_infos(&mut self, room: u64) {
        self.failed_told.remove(&room);
        self.pending_since.remove(&room);
        for info in self.infos.remove(&room).into_iter().flatten() {
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
    /// then, as a sender gives up on its decode); sweeps at most once a
    /// second. Returns the rooms dropped.
    pub fn expire_unclaimed(&mut self, ttl: Duration, now: Instant) -> Vec<u64> {
        if self
            .last_expiry
            .is_some_and(|t| now.duration_since(t) < EXPIRY_SWEEP)
        {
            return Vec::new();
        }
        self.last_expiry = Some(now);
        let stale: Vec<u64> = self
            .pending_since
            .iter()
            .filter(|(room, since)| {
                now.duration_since(**since) >= ttl && !self.table.contains(**room)
            })
            .map(|(room, _)| *room)
            .collect();
        for room in &stale {
            self.remove_infos(*room);
        }
        let forgotten: Vec<u64> = self
            .aborted_early
            .iter()
            .filter(|(_, since)| now.duration_since(**since) >= ttl)
            .map(|(room, _)| *room)
            .collect();
        for room in forgotten {
            self.aborted_early.remove(&room);
            if self.table.get(room) == Some(kvbridge_wire::KvPoll::Failed) {
                self.table.remove(room);
            }
        }
        stale
    }
}

/// How often [`RoomsState::expire_unclaimed`] may sweep.
const EXPIRY_SWEEP: Duration = Duration::from_secs(1);

/// How many cleared rooms are remembered (oldest forgotten first).
pub(crate) const CONCLUDED_ROOMS_KEPT: usize = 4096;

/// How a cleared room ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Concluded {
    /// Every byte went to the decode that asked first.
    Sent,
    /// It failed, with the reason if one was recorded.
    Failed(Option<String>),
}

/// Cleared rooms and how they ended, a bounded FIFO. A transfer request
/// that arrives after its room was finished (a restarted decode retrying
/// it) is answered Failed at once instead of waiting out the decode's
/// timeout with its pages pinned. Room ids are random per request, so a
/// remembered id is never a new request.
#[derive(Debug, Default)]
pub(crate) struct ConcludedRooms {
    order: VecDeque<u64>,
    outcomes: HashMap<u64, Concluded>,
}

impl ConcludedRooms {
    /// Remembers how `room` ended.
    pub fn insert(&mut self, room: u64, outcome: Concluded) {
        if self.outcomes.insert(room, outcome).is_none() {
            self.order.push_back(room);
        }
        while self.order.len() > CONCLUDED_ROOMS_KEPT {
            if let Some(old) = self.order.pop_front() {
                self.outcomes.remove(&old);
            }
        }
    }

    /// How `room` ended, if it is remembered.
    pub fn get(&self, room: u64) -> Option<&Concluded> {
        self.outcomes.get(&room)
    }

    /// Forgets `room` (a new sender reuses its id).
    pub fn remove(&mut self, room: u64) {
        if self.outcomes.remove(&room).is_some() {
            self.order.retain(|r| *r != room);
        }
    }

    /// Number of remembered rooms.
    #[cfg(test)]
    pub fn len(&self) -> usize {
        self.order.len()
    }
}

#[cfg(test)]
mod tests {
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
        use kvbridge_wire::KvPoll;
        let ttl = Duration::from_secs(300);
        let t0 = Instant::now();
        let mut r = RoomsState::default();
        for room in [1, 2, 3] {
            r.table.update(room, KvPoll::Bootstrapping);
            r.table.fail(room, "Aborted by the decode side");
        }
        r.aborted_early.insert(1, t0);
        r.aborted_early.insert(2, t0 + Duration::from_secs(200));
        // Room 3 was claimed by a sender (not in aborted_early).
        r.expire_unclaimed(ttl, t0 + Duration::from_secs(301));
        assert!(!r.table.contains(1), "expired");
        assert!(r.table.contains(2), "not yet");
        assert!(r.table.contains(3), "its sender clears it");
        // The next sweep (a second later at least) takes room 2 in turn.
        r.expire_unclaimed(ttl, t0 + Duration::from_secs(501));
        assert!(!r.table.contains(2));
        assert!(r.aborted_early.is_empty());
    }

    #[test]
    fn a_failure_is_told_to_each_decode_once_and_after_the_drain() {
        use kvbridge_wire::KvPoll;
        let mut r = RoomsState::default();
        r.table.update(7, KvPoll::Bootstrapping);
        r.add_info(7, info("10.0.0.1", 5000));
        r.add_info(7, info("10.0.0.2", 5000));
        // A chunk in flight: nobody is told yet.
        r.outstanding.insert(7, 1);
        assert_eq!(r.fail_and_tell(7, "Aborted by AbortReq.").0, vec![]);
        assert_eq!(r.take_drained_failure(7).0, vec![]);
        r.outstanding.insert(7, 0);
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

    #[test]
    fn concluded_rooms_are_bounded_and_forget_the_oldest_first() {
        let mut f = ConcludedRooms::default();
        for room in 0..(CONCLUDED_ROOMS_KEPT as u64 + 10) {
            f.insert(room, Concluded::Failed(Some(format!("r{room}"))));
        }
        assert_eq!(f.len(), CONCLUDED_ROOMS_KEPT);
        assert_eq!(f.get(9), None);
        assert_eq!(f.get(10), Some(&Concluded::Failed(Some("r10".into()))));
        f.insert(10, Concluded::Sent);
        assert_eq!(f.len(), CONCLUDED_ROOMS_KEPT);
        assert_eq!(f.get(10), Some(&Concluded::Sent));
        f.remove(10);
        assert_eq!(f.get(10), None);
        assert_eq!(f.len(), CONCLUDED_ROOMS_KEPT - 1);
    }
}
