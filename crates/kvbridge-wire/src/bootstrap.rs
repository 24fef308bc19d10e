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
