//! The bootstrap server's HTTP JSON bodies, field for field as sglang 0.5.23's
//! `CommonKVBootstrapServer` and its clients write them.
//!
//! Routes: `PUT /route` ([`RouteRegistration`]), `GET /route` with
//! [`RouteQuery`] answered by [`PrefillServerInfo`] (all ranks `-1`) or
//! [`PrefillRankInfo`], `POST /register_dp_rank` ([`RegisterDpRank`]),
//! `POST /query_dp_ranks` ([`QueryDpRanks`] → a `{"<room>": dp_rank}` map),
//! `GET /health` (`OK`).

use serde::{Deserialize, Serialize};
use serde_json::Value;
use thiserror::Error;

/// Largest parallel size (TP, CP, DP or PP) a peer may report.
pub const MAX_PARALLEL_SIZE: u64 = 4096;
/// Largest number of ranks (DP × CP × TP × PP) one prefill server may have.
pub const MAX_TOTAL_RANKS: u64 = 65536;
/// Largest page size, in tokens, a peer may report.
pub const MAX_PAGE_SIZE: u64 = 1 << 20;
/// Longest name (dtype, layout, policy, host) a peer may send, in bytes.
pub const MAX_NAME_LEN: usize = 253;

/// Why a bootstrap body's values are out of range (its JSON parsed).
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[non_exhaustive]
pub enum FieldError {
    /// A size is 0.
    #[error("{field} must be at least 1")]
    Zero {
        /// The field.
        field: &'static str,
    },
    /// A value is above its cap.
    #[error("{field}={value} is above the limit {max}")]
    TooLarge {
        /// The field.
        field: &'static str,
        /// The value sent.
        value: u64,
        /// The cap.
        max: u64,
    },
    /// A rank is not below its size.
    #[error("{field}={rank} is not below its size {size}")]
    RankOutOfRange {
        /// The rank field.
        field: &'static str,
        /// The rank sent.
        rank: u64,
        /// The size it must be below.
        size: u64,
    },
    /// A port is 0.
    #[error("{field} must not be 0")]
    ZeroPort {
        /// The field.
        field: &'static str,
    },
    /// A name is empty where one is required, too long, or not a host.
    #[error("{field} is not acceptable: {reason}")]
    BadName {
        /// The field.
        field: &'static str,
        /// What is wrong with it.
        reason: &'static str,
    },
}

/// Checks `1 <= value <= max`.
fn size(field: &'static str, value: u64, max: u64) -> Result<u64, FieldError> {
    if value == 0 {
        return Err(FieldError::Zero { field });
    }
    if value > max {
        return Err(FieldError::TooLarge { field, value, max });
    }
    Ok(value)
}

/// Checks `rank < size`.
fn rank(field: &'static str, rank: u64, size: u64) -> Result<(), FieldError> {
    if rank >= size {
        return Err(FieldError::RankOutOfRange { field, rank, size });
    }
    Ok(())
}

/// Checks an optional name's length.
fn name(field: &'static str, value: Option<&str>) -> Result<(), FieldError> {
    match value {
        Some(v) if v.len() > MAX_NAME_LEN => Err(FieldError::BadName {
            field,
            reason: "longer than 253 bytes",
        }),
        _ => Ok(()),
    }
}

/// Whether `host` is an IP address (IPv6 with or without brackets, with or
/// without a zone id such as `fe80::1%eth0`, as sglang keeps it verbatim)
/// or a DNS name of letters, digits, `-`, `_` and `.`, at most
/// [`MAX_NAME_LEN`] bytes.
pub fn is_valid_host(host: &str) -> bool {
    if host.is_empty() || host.len() > MAX_NAME_LEN {
        return false;
    }
    let bare = host
        .strip_prefix('[')
        .and_then(|h| h.strip_suffix(']'))
        .unwrap_or(host);
    bare.parse::<std::net::IpAddr>().is_ok()
        || is_zoned_ipv6(bare)
        || host
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'))
}

/// An IPv6 address with a zone id (`addr%zone`: an interface name or
/// index of letters, digits, `-`, `_` and `.`).
fn is_zoned_ipv6(host: &str) -> bool {
    host.split_once('%').is_some_and(|(addr, zone)| {
        addr.parse::<std::net::Ipv6Addr>().is_ok()
            && !zone.is_empty()
            && zone
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'))
    })
}

/// Whether `session` is a transfer-engine session id, `host:port`.
pub fn is_session_id(session: &str) -> bool {
    session.rsplit_once(':').is_some_and(|(host, port)| {
        is_valid_host(host) && port.parse::<u16>().is_ok_and(|p| p != 0)
    })
}

/// The product of the sizes, when it is at most [`MAX_TOTAL_RANKS`].
fn total_ranks(sizes: [u64; 4]) -> Result<u64, FieldError> {
    let total = sizes.iter().try_fold(1u64, |acc, s| acc.checked_mul(*s));
    match total {
        Some(t) if t <= MAX_TOTAL_RANKS => Ok(t),
        _ => Err(FieldError::TooLarge {
            field: "dp_size * attn_cp_size * attn_tp_size * pp_size",
            value: total.unwrap_or(u64::MAX),
            max: MAX_TOTAL_RANKS,
        }),
    }
}

/// Integers that sglang's server passes through Python's `int()`, which
/// also takes decimal strings.
mod lenient {
    use serde::{Deserialize, Deserializer, de::Error};

    #[derive(Deserialize)]
    #[serde(untagged)]
    enum NumOrText {
        Num(i64),
        Text(String),
    }

    fn parse<'de, D: Deserializer<'de>>(d: D) -> Result<i64, D::Error> {
        match NumOrText::deserialize(d)? {
            NumOrText::Num(n) => Ok(n),
            NumOrText::Text(t) => t.trim().parse().map_err(D::Error::custom),
        }
    }

    pub fn u64<'de, D: Deserializer<'de>>(d: D) -> Result<u64, D::Error> {
        u64::try_from(parse(d)?).map_err(D::Error::custom)
    }

    pub fn u16<'de, D: Deserializer<'de>>(d: D) -> Result<u16, D::Error> {
        u16::try_from(parse(d)?).map_err(D::Error::custom)
    }

    pub fn rooms<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<u64>, D::Error> {
        Vec::<NumOrText>::deserialize(d)?
            .into_iter()
            .map(|v| match v {
                NumOrText::Num(n) => u64::try_from(n).map_err(D::Error::custom),
                NumOrText::Text(t) => t.trim().parse().map_err(D::Error::custom),
            })
            .collect()
    }
}

/// `PUT /route`: a prefill rank registers its zmq endpoint and topology.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RouteRegistration {
    /// Attention TP size.
    pub attn_tp_size: u64,
    /// This rank's attention TP rank.
    pub attn_tp_rank: u64,
    /// Attention context-parallel size.
    pub attn_cp_size: u64,
    /// This rank's attention CP rank.
    pub attn_cp_rank: u64,
    /// Attention data-parallel size.
    pub attn_dp_size: u64,
    /// This rank's attention DP rank.
    pub attn_dp_rank: u64,
    /// Pipeline-parallel size.
    pub pp_size: u64,
    /// This rank's PP rank.
    pub pp_rank: u64,
    /// System DP size.
    pub system_dp_size: u64,
    /// This rank's system DP rank.
    pub system_dp_rank: u64,
    /// The rank's IP for its zmq bootstrap socket.
    pub rank_ip: String,
    /// The rank's zmq bootstrap port.
    #[serde(deserialize_with = "lenient::u16")]
    pub rank_port: u16,
    /// Tokens per KV page.
    #[serde(deserialize_with = "lenient::u64")]
    pub page_size: u64,
    /// KV cache dtype name.
    pub kv_cache_dtype: Option<String>,
    /// KV layout name, when the backend has one.
    #[serde(default)]
    pub kv_layout: Option<String>,
    /// DeepSeek-V4.1 speculative layout descriptor.
    #[serde(default)]
    pub dsv41_spec_layout: Option<Value>,
    /// DP load-balancing method (`follow_bootstrap_room` by default).
    #[serde(default)]
    pub load_balance_method: Option<String>,
    /// Whether DSA cache layers are split across CP ranks.
    #[serde(default)]
    pub enable_dsa_cache_layer_split: Option<bool>,
    /// Whether KV pages are sharded across ranks.
    #[serde(default)]
    pub enable_kv_cache_sharding: Option<bool>,
    /// The prefill server's HTTP API port.
    #[serde(default)]
    pub prefill_http_port: Option<u64>,
    /// `early` or `prefill_complete`.
    #[serde(default)]
    pub decode_allocation_policy: Option<String>,
    /// kvbridge extension: the rank's transfer-engine session (`host:port`),
    /// so a decode can fence that peer's writes. Absent from sglang's bodies
    /// and from ours when unknown.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub engine_session: Option<String>,
    /// kvbridge extension: under context parallelism, whether every CP
    /// rank transfers a share (`SGLANG_DISAGGREGATION_ALL_CP_RANKS_TRANSFER`
    /// on the prefill), so a decode configured otherwise can say so instead
    /// of taking a partial room. Absent from sglang's bodies.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub all_cp_ranks_transfer: Option<bool>,
}

impl RouteRegistration {
    /// The rank's DP group and the server's DP size as sglang's server
    /// derives them (system DP when it is not 1, attention DP otherwise).
    pub fn dp_group(&self) -> (u64, u64) {
        if self.system_dp_size == 1 {
            (self.attn_dp_rank, self.attn_dp_size)
        } else {
            (self.system_dp_rank, self.system_dp_size)
        }
    }

    /// The slot entry this registration records (and `GET /route` answers).
    pub fn rank_info(&self) -> PrefillRankInfo {
        PrefillRankInfo {
            rank_ip: self.rank_ip.clone(),
            rank_port: self.rank_port,
            engine_session: self.engine_session.clone(),
            all_cp_ranks_transfer: self.all_cp_ranks_transfer,
        }
    }

    /// Checks every size against [`MAX_PARALLEL_SIZE`] (and their product
    /// against [`MAX_TOTAL_RANKS`]), every rank against its size, the port,
    /// the page size, the host and the names.
    pub fn validate(&self) -> Result<(), FieldError> {
        let m = MAX_PARALLEL_SIZE;
        let tp = size("attn_tp_size", self.attn_tp_size, m)?;
        let cp = size("attn_cp_size", self.attn_cp_size, m)?;
        let dp = size("attn_dp_size", self.attn_dp_size, m)?;
        let pp = size("pp_size", self.pp_size, m)?;
        let sys = size("system_dp_size", self.system_dp_size, m)?;
        rank("attn_tp_rank", self.attn_tp_rank, tp)?;
        rank("attn_cp_rank", self.attn_cp_rank, cp)?;
        rank("attn_dp_rank", self.attn_dp_rank, dp)?;
        rank("pp_rank", self.pp_rank, pp)?;
        // With system DP 1, sglang's server ignores the system DP rank (the
        // DP group is the attention DP rank), and sglang 0.5.23's DP
        // controller sends the attention DP rank there: bound it by that.
        rank(
            "system_dp_rank",
            self.system_dp_rank,
            if sys == 1 { dp } else { sys },
        )?;
        total_ranks([self.dp_group().1, cp, tp, pp])?;
        size("page_size", self.page_size, MAX_PAGE_SIZE)?;
        if self.rank_port == 0 {
            return Err(FieldError::ZeroPort { field: "rank_port" });
        }
        if let Some(port) = self.prefill_http_port {
            size("prefill_http_port", port, u64::from(u16::MAX))?;
        }
        if !is_valid_host(&self.rank_ip) {
            return Err(FieldError::BadName {
                field: "rank_ip",
                reason: "not an IP address or host name",
            });
        }
        name("kv_cache_dtype", self.kv_cache_dtype.as_deref())?;
        name("kv_layout", self.kv_layout.as_deref())?;
        name("load_balance_method", self.load_balance_method.as_deref())?;
        name(
            "decode_allocation_policy",
            self.decode_allocation_policy.as_deref(),
        )?;
        if let Some(session) = &self.engine_session
            && !is_session_id(session)
        {
            return Err(FieldError::BadName {
                field: "engine_session",
                reason: "not host:port",
            });
        }
        Ok(())
    }
}

/// `GET /route` query: the rank to look up, or all `-1` for the server info.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct RouteQuery {
    /// Prefill DP rank.
    pub prefill_dp_rank: i64,
    /// Prefill CP rank.
    pub prefill_cp_rank: i64,
    /// Prefill TP rank.
    pub target_tp_rank: i64,
    /// Prefill PP rank.
    pub target_pp_rank: i64,
}

impl RouteQuery {
    /// The query that asks for the server's topology (`PrefillServerInfo`).
    pub const SERVER_INFO: RouteQuery = RouteQuery {
        prefill_dp_rank: -1,
        prefill_cp_rank: -1,
        target_tp_rank: -1,
        target_pp_rank: -1,
    };

    /// Whether this asks for the topology rather than one rank.
    pub fn is_server_info(&self) -> bool {
        *self == Self::SERVER_INFO
    }
}

/// `GET /route` answer for the all-`-1` query: the prefill topology, with
/// the decode-side fields sglang sends as `null`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PrefillServerInfo {
    /// Attention TP size.
    pub attn_tp_size: u64,
    /// Attention CP size.
    pub attn_cp_size: u64,
    /// DP size.
    pub dp_size: u64,
    /// PP size.
    pub pp_size: u64,
    /// Tokens per page.
    pub page_size: Option<u64>,
    /// KV cache dtype name.
    pub kv_cache_dtype: Option<String>,
    /// Whether DP routing follows the bootstrap room.
    pub follow_bootstrap_room: bool,
    /// Whether DSA cache layers are split across CP ranks.
    #[serde(default)]
    pub enable_dsa_cache_layer_split: bool,
    /// DeepSeek-V4.1 layout (omitted when absent).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dsv41_spec_layout: Option<Value>,
    /// KV layout name (omitted when absent).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kv_layout: Option<String>,
    /// `early` or `prefill_complete`.
    #[serde(default = "early")]
    pub decode_allocation_policy: String,
    /// Whether KV pages are sharded across ranks.
    #[serde(default)]
    pub enable_kv_cache_sharding: bool,
    /// The prefill server's HTTP API port.
    #[serde(default)]
    pub prefill_http_port: Option<u64>,
    /// Decode-side rank mapping (always `null` from the server).
    #[serde(default)]
    pub target_tp_rank: Option<u64>,
    /// Decode-side rank mapping (always `null` from the server).
    #[serde(default)]
    pub target_tp_ranks: Option<Vec<u64>>,
    /// Decode-side rank mapping (always `null` from the server).
    #[serde(default)]
    pub target_cp_ranks: Option<Vec<u64>>,
    /// Decode-side rank mapping (always `null` from the server).
    #[serde(default)]
    pub target_pp_ranks: Option<Vec<u64>>,
    /// Decode-side count (always `null` from the server).
    #[serde(default)]
    pub required_dst_info_num: Option<u64>,
    /// Decode-side count (always `null` from the server).
    #[serde(default)]
    pub required_prefill_response_num: Option<u64>,
}

impl PrefillServerInfo {
    /// Checks the four sizes against [`MAX_PARALLEL_SIZE`] and their
    /// product against [`MAX_TOTAL_RANKS`], and the page size, before a
    /// decode rank computes anything from them.
    pub fn validate_sizes(&self) -> Result<(), FieldError> {
        let m = MAX_PARALLEL_SIZE;
        let tp = size("attn_tp_size", self.attn_tp_size, m)?;
        let cp = size("attn_cp_size", self.attn_cp_size, m)?;
        let dp = size("dp_size", self.dp_size, m)?;
        let pp = size("pp_size", self.pp_size, m)?;
        total_ranks([dp, cp, tp, pp])?;
        if let Some(page) = self.page_size {
            size("page_size", page, MAX_PAGE_SIZE)?;
        }
        Ok(())
    }
}

fn early() -> String {
    "early".to_owned()
}

/// `GET /route` answer for one rank.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PrefillRankInfo {
    /// The rank's IP.
    pub rank_ip: String,
    /// The rank's zmq bootstrap port.
    #[serde(deserialize_with = "lenient::u16")]
    pub rank_port: u16,
    /// kvbridge extension: the rank's transfer-engine session, when it
    /// published one (see [`RouteRegistration::engine_session`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub engine_session: Option<String>,
    /// kvbridge extension: the rank's CP transfer mode, when it published
    /// one (see [`RouteRegistration::all_cp_ranks_transfer`]). Kept out of
    /// the server-wide answer, which sglang's decode parses strictly.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub all_cp_ranks_transfer: Option<bool>,
}

/// `POST /register_dp_rank`: which prefill DP rank serves a room.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct RegisterDpRank {
    /// The room.
    #[serde(deserialize_with = "lenient::u64")]
    pub bootstrap_room: u64,
    /// The DP rank serving it.
    #[serde(deserialize_with = "lenient::u64")]
    pub dp_rank: u64,
}

impl RegisterDpRank {
    /// Checks the DP rank against [`MAX_PARALLEL_SIZE`] (and against the
    /// server's DP size when one is known).
    pub fn validate(&self, dp_size: Option<u64>) -> Result<(), FieldError> {
        rank(
            "dp_rank",
            self.dp_rank,
            dp_size.unwrap_or(MAX_PARALLEL_SIZE).min(MAX_PARALLEL_SIZE),
        )
    }
}

/// `POST /query_dp_ranks`: the rooms to look up; the answer maps each known
/// room (as a decimal string) to its DP rank.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct QueryDpRanks {
    /// The rooms.
    #[serde(deserialize_with = "lenient::rooms")]
    pub bootstrap_rooms: Vec<u64>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn registration_accepts_sglang_payload() {
        let body = r#"{"attn_tp_size": 2, "attn_tp_rank": 1, "attn_cp_size": 1, "attn_cp_rank": 0,
            "attn_dp_size": 1, "attn_dp_rank": 0, "pp_size": 1, "pp_rank": 0, "system_dp_size": 1,
            "system_dp_rank": 0, "rank_ip": "10.0.0.2", "rank_port": 17000, "page_size": 64,
            "kv_cache_dtype": "auto", "kv_layout": null, "dsv41_spec_layout": null,
            "load_balance_method": "round_robin", "enable_dsa_cache_layer_split": false,
            "enable_kv_cache_sharding": false, "prefill_http_port": 30000,
            "decode_allocation_policy": "early", "some_future_key": 1}"#;
        let reg: RouteRegistration = serde_json::from_str(body).unwrap();
        assert_eq!(
            (reg.attn_tp_rank, reg.rank_port, reg.page_size),
            (1, 17000, 64)
        );
        assert_eq!(reg.load_balance_method.as_deref(), Some("round_robin"));
        // Python's int() takes strings too.
        let body = body.replace("17000", "\"17000\"");
        assert_eq!(
            serde_json::from_str::<RouteRegistration>(&body)
                .unwrap()
                .rank_port,
            17000
        );
        let missing = r#"{"attn_tp_size": 2}"#;
        assert!(serde_json::from_str::<RouteRegistration>(missing).is_err());
    }

    #[test]
    fn server_info_serializes_like_sglang() {
        let info = PrefillServerInfo {
            attn_tp_size: 2,
            attn_cp_size: 1,
            dp_size: 1,
            pp_size: 1,
            page_size: Some(64),
            kv_cache_dtype: Some("auto".into()),
            follow_bootstrap_room: true,
            enable_dsa_cache_layer_split: false,
            dsv41_spec_layout: None,
            kv_layout: None,
            decode_allocation_policy: "early".into(),
            enable_kv_cache_sharding: false,
            prefill_http_port: None,
            target_tp_rank: None,
            target_tp_ranks: None,
            target_cp_ranks: None,
            target_pp_ranks: None,
            required_dst_info_num: None,
            required_prefill_response_num: None,
        };
        let json = serde_json::to_string(&info).unwrap();
        assert_eq!(
            json,
            r#"{"attn_tp_size":2,"attn_cp_size":1,"dp_size":1,"pp_size":1,"page_size":64,"kv_cache_dtype":"auto","follow_bootstrap_room":true,"enable_dsa_cache_layer_split":false,"decode_allocation_policy":"early","enable_kv_cache_sharding":false,"prefill_http_port":null,"target_tp_rank":null,"target_tp_ranks":null,"target_cp_ranks":null,"target_pp_ranks":null,"required_dst_info_num":null,"required_prefill_response_num":null}"#
        );
        let back: PrefillServerInfo = serde_json::from_str(&json).unwrap();
        assert_eq!(back, info);
    }

    fn good() -> RouteRegistration {
        serde_json::from_value(serde_json::json!({
            "attn_tp_size": 2, "attn_tp_rank": 1, "attn_cp_size": 1, "attn_cp_rank": 0,
            "attn_dp_size": 1, "attn_dp_rank": 0, "pp_size": 1, "pp_rank": 0,
            "system_dp_size": 1, "system_dp_rank": 0, "rank_ip": "10.0.0.2",
            "rank_port": 17000, "page_size": 64, "kv_cache_dtype": "auto"
        }))
        .unwrap()
    }

    #[test]
    fn registration_ranges_are_checked() {
        assert_eq!(good().validate(), Ok(()));
        type Spoil = fn(&mut RouteRegistration);
        let bad: [(Spoil, &str); 10] = [
            (|r| r.attn_tp_size = 0, "attn_tp_size must be at least 1"),
            (|r| r.pp_size = MAX_PARALLEL_SIZE + 1, "pp_size=4097"),
            (
                |r| r.attn_tp_rank = 2,
                "attn_tp_rank=2 is not below its size 2",
            ),
            (
                |r| {
                    r.system_dp_size = 2;
                    r.system_dp_rank = 2;
                },
                "system_dp_rank=2",
            ),
            (|r| r.rank_port = 0, "rank_port must not be 0"),
            (|r| r.page_size = 0, "page_size"),
            (|r| r.rank_ip = "evil host/x".into(), "rank_ip"),
            (|r| r.rank_ip = String::new(), "rank_ip"),
            (
                |r| r.kv_cache_dtype = Some("x".repeat(300)),
                "kv_cache_dtype",
            ),
            (
                |r| {
                    r.attn_tp_size = 4096;
                    r.pp_size = 4096;
                },
                "is above the limit 65536",
            ),
        ];
        for (spoil, what) in bad {
            let mut r = good();
            spoil(&mut r);
            let e = r.validate().unwrap_err().to_string();
            assert!(e.contains(what), "{e} lacks {what}");
        }
        // Attention DP as sglang 0.5.23's DP controller registers it:
        // system DP size 1, the attention DP rank as the system DP rank.
        let mut r = good();
        (r.attn_dp_size, r.attn_dp_rank, r.system_dp_rank) = (2, 1, 1);
        assert_eq!(r.validate(), Ok(()));
        assert_eq!(r.dp_group(), (1, 2));
        r.system_dp_rank = 2;
        assert!(r.validate().is_err());
        let mut r = good();
        r.rank_ip = "[::1]".into();
        assert_eq!(r.validate(), Ok(()));
        r.rank_ip = "prefill-0.cluster.local".into();
        assert_eq!(r.validate(), Ok(()));
        // sglang keeps a link-local address's zone id verbatim.
        for zoned in ["fe80::1%eth0", "[fe80::1%eth0]", "fe80::1%2"] {
            r.rank_ip = zoned.into();
            assert_eq!(r.validate(), Ok(()), "{zoned}");
        }
        for bad in ["fe80::1%", "fe80::1%eth0/x", "10.0.0.1%eth0", "%eth0"] {
            r.rank_ip = bad.into();
            assert!(r.validate().is_err(), "{bad}");
        }
        assert!(is_session_id("fe80::1%eth0:17000"));
        let d = RegisterDpRank {
            bootstrap_room: 1,
            dp_rank: 3,
        };
        assert!(d.validate(Some(4)).is_ok());
        assert!(d.validate(Some(3)).is_err());
        assert!(d.validate(None).is_ok());
        assert!(
            RegisterDpRank {
                bootstrap_room: 1,
                dp_rank: MAX_PARALLEL_SIZE
            }
            .validate(None)
            .is_err()
        );
    }

    #[test]
    fn dp_rank_bodies() {
        let r: RegisterDpRank =
            serde_json::from_str(r#"{"bootstrap_room": "7", "dp_rank": 1}"#).unwrap();
        assert_eq!((r.bootstrap_room, r.dp_rank), (7, 1));
        let q: QueryDpRanks = serde_json::from_str(r#"{"bootstrap_rooms": [1, "2", 3]}"#).unwrap();
        assert_eq!(q.bootstrap_rooms, vec![1, 2, 3]);
        assert!(serde_json::from_str::<QueryDpRanks>(r#"{"bootstrap_rooms": [-1]}"#).is_err());
    }
}
