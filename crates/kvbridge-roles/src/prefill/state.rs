//! What the prefill side knows about rooms and decode peers, behind one lock.

use std::collections::{HashMap, VecDeque};

use kvbridge_plan::{PreparedPeer, StagingSource, TransferRequest};

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
    /// The decode rank takes a room's aux slots in one `AuxBatch` (it said
    /// so in its registration); else one `AUX_DATA` per aux buffer.
    pub aux_batch: bool,
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

/// Decode endpoints to send a room's `Failed` status, and the reason.
pub(crate) type FailedNotice = (Vec<(String, u16)>, Option<String>);

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
