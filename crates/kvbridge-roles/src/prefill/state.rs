//! What the prefill side knows about rooms and decode peers, behind one lock.

use std::collections::HashMap;
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

/// One staging allocation: `(chunk, offset, round, end)`.
pub(crate) type StagingAllocation = (u64, i64, i64, i64);

/// Staging-path control messages, recorded until the staging data path uses them.
#[derive(Debug, Default)]
pub(crate) struct StagingRecords {
    /// Latest watermark per session: `(round, tail)`.
    pub watermarks: HashMap<String, (u64, u64)>,
    /// Allocations per `(room, session)`: `(chunk, offset, round, end)`.
    pub allocations: HashMap<(u64, String), Vec<StagingAllocation>>,
}

/// Room-level state of the prefill side.
#[derive(Debug, Default)]
pub(crate) struct RoomsState {
    pub table: RoomTable,
    /// Each room's decode destinations, in arrival order.
    pub infos: HashMap<u64, Vec<Arc<TransferInfo>>>,
    /// Chunks dequeued and not yet finished, per room.
    pub outstanding: HashMap<u64, usize>,
    /// Abort ACKs waiting for the room to drain.
    pub ack_targets: HashMap<u64, Vec<AckTarget>>,
    /// Decode prefix lengths of rooms whose destinations are complete.
    pub prefix_len: HashMap<u64, u64>,
    /// When each room's first chunk was queued (latency metric).
    pub started: HashMap<u64, Instant>,
    /// Staging control messages.
    pub staging: StagingRecords,
}

impl RoomsState {
    /// Every non-dummy decode endpoint of a room, each once.
    pub fn notify_targets(&self, room: u64) -> Vec<(String, u16)> {
        let mut targets: Vec<(String, u16)> = Vec::new();
        for info in self.infos.get(&room).into_iter().flatten() {
            if info.request.is_none() {
                continue;
            }
            let t = (info.endpoint.clone(), info.dst_port);
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

    /// Drops everything kept for a finished room except its status.
    pub fn forget_transfer(&mut self, room: u64) {
        self.infos.remove(&room);
        self.prefix_len.remove(&room);
        self.outstanding.remove(&room);
        self.staging.allocations.retain(|(r, _), _| *r != room);
    }
}
