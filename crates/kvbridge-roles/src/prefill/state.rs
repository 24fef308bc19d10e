//! What the prefill side knows about rooms and decode peers, behind one lock.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::time::Instant;

use kvbridge_plan::{PreparedPeer, TransferRequest};

use crate::rooms::RoomTable;

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
    pub staging: Option<super::staged::StagingDest>,
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
}

impl RoomsState {
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
        let infos = self.infos.entry(room).or_default();
        let before = infos.len();
        infos.retain(|i| i.session != info.session);
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

    /// Drops the room's destinations.
    pub fn remove_infos(&mut self, room: u64) {
        for info in self.infos.remove(&room).into_iter().flatten() {
            if let Some(n) = self.rooms_per_session.get_mut(&info.session) {
                *n = n.saturating_sub(1);
                if *n == 0 {
                    self.rooms_per_session.remove(&info.session);
                }
            }
        }
    }
}

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
