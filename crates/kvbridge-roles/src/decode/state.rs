//! What the decode side knows about rooms and prefill servers.

use std::collections::{HashMap, HashSet};

use kvbridge_wire::KvPoll;

use crate::rooms::RoomTable;

use super::slots::{ExpectedRanks, SlotsByRoom};
use super::topology::RankMapping;

/// One prefill rank a room's KV comes from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BootstrapInfo {
    /// The rank's IP.
    pub rank_ip: String,
    /// The rank's zmq bootstrap port.
    pub rank_port: u16,
    /// The rank's PP stage.
    pub pp_rank: u64,
    /// Whether the rank holds none of our KV (MLA: one real rank).
    pub is_dummy: bool,
    /// The rank's unique number, as it signs status and ABORT_ACK frames
    /// (`tp * pp_size * cp_size + pp * cp_size + cp`).
    pub unique_rank: u64,
    /// The rank's transfer-engine session, when its bootstrap entry
    /// published one (needed to fence its writes).
    pub engine_session: Option<String>,
}

impl BootstrapInfo {
    /// `tcp://ip:port` of the rank's socket.
    pub fn endpoint(&self) -> String {
        crate::control::tcp_endpoint(&self.rank_ip, self.rank_port)
    }
}

/// ACKs collected for an aborted room.
#[derive(Debug, Default, Clone)]
pub(crate) struct AbortAcks {
    /// The generation our ABORT carried.
    pub generation: Option<u64>,
    /// Prefill ranks that acknowledged (ranked form).
    pub ranks: HashSet<u64>,
    /// ACKs in the reference's 2-frame form (no rank), accepted only when
    /// our ABORT carried no generation (a stock sglang prefill without
    /// deferred release answers so).
    pub unranked: usize,
    /// When the ABORT went out (the ACK deadline counts from here).
    pub sent_at: Option<std::time::Instant>,
    /// Whether the missed-deadline warning was logged.
    pub overdue_logged: bool,
    /// Ranks that never acknowledged but whose engine session our engine
    /// fenced (no write of theirs can land any more).
    pub fenced: HashSet<u64>,
}

/// Room-level state of the decode side.
#[derive(Debug, Default)]
pub(crate) struct DecodeRooms {
    pub table: RoomTable,
    /// Success messages expected per room.
    pub required_responses: HashMap<u64, u64>,
    /// Prefill ranks that reported Success per room.
    pub responded: HashMap<u64, HashSet<u64>>,
    /// Rooms per prefill bootstrap server (failed together when it dies).
    pub addr_rooms: HashMap<String, HashSet<u64>>,
    /// Abort ACK tracking per room.
    pub abort_acks: HashMap<u64, AbortAcks>,
    /// Last abort generation handed out.
    pub generation: u64,
    /// Rooms that receive through the staging ring.
    pub staging: HashMap<u64, super::staging::StagingRoom>,
    /// The prefill ranks each room expects to hear from.
    pub expected: HashMap<u64, ExpectedRanks>,
    /// The slots each room's prefill ranks may write outside the engine.
    pub slots: SlotsByRoom,
    /// Engine sessions fenced for silent ranks, with the `(room, rank)`
    /// ACKs still owed; the fence is lifted when the last one arrives.
    pub fences: HashMap<String, HashMap<(u64, u64), OwedAck>>,
}

/// An ABORT_ACK a fenced prefill rank still owes, and where to ask again:
/// the ABORT may have been lost (a partition), and the fence stays until
/// the rank answers, so the ABORT is sent again on every heartbeat.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct OwedAck {
    /// The rank's zmq endpoint, when known.
    pub endpoint: Option<String>,
    /// The generation the room's ABORT carried.
    pub generation: Option<u64>,
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
}

/// What a decode rank knows of a resolved prefill server (sglang's
/// `prefill_info_table` entry, the part its scheduler reads).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PrefillSummary {
    /// The prefill server's DP size.
    pub dp_size: u64,
    /// Whether its DP routing follows the bootstrap room.
    pub follow_bootstrap_room: bool,
}

/// Prefill servers this decode rank has resolved.
#[derive(Debug, Default)]
pub(crate) struct Prefills {
    /// Rank mapping per bootstrap address.
    pub mapping: HashMap<String, RankMapping>,
    /// The prefill server's `(pp_size, attn_cp_size)` per bootstrap
    /// address (to number its ranks).
    pub sizes: HashMap<String, (u64, u64)>,
    /// Resolved prefill ranks per `addr_dp_cp_tp` key (registered with).
    pub pool: HashMap<String, Vec<BootstrapInfo>>,
    /// Summary per resolved bootstrap address.
    pub servers: HashMap<String, PrefillSummary>,
    /// Consecutive missed heartbeats per bootstrap address.
    pub heartbeat_failures: HashMap<String, u32>,
}

#[cfg(test)]
mod tests {
    use kvbridge_wire::bootstrap::PrefillRankInfo;

    use super::*;

    #[test]
    fn a_zoned_ipv6_rank_ip_is_kept_verbatim() {
        // As the bootstrap server answers it for a prefill rank.
        let rank: PrefillRankInfo =
            serde_json::from_str(r#"{"rank_ip": "fe80::1%eth0", "rank_port": "7000"}"#)
                .expect("a rank entry");
        let info = BootstrapInfo {
            rank_ip: rank.rank_ip,
            rank_port: rank.rank_port,
            pp_rank: 0,
            is_dummy: false,
            unique_rank: 0,
            engine_session: None,
        };
        assert_eq!(info.rank_ip, "fe80::1%eth0");
        assert_eq!(info.endpoint(), "tcp://[fe80::1%eth0]:7000");
        let bracketed = BootstrapInfo {
            rank_ip: "[fe80::1%eth0]".into(),
            ..info
        };
        assert_eq!(bracketed.endpoint(), "tcp://[fe80::1%eth0]:7000");
    }
}
