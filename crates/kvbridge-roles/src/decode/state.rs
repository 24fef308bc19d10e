//! What the decode side knows about rooms and prefill servers.

use std::collections::HashMap;

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
