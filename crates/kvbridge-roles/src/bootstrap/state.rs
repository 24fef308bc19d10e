//! The bootstrap server's state machine, free of HTTP: what sglang 0.5.23's
//! `CommonKVBootstrapServer` keeps and how it answers each route.

use std::collections::{BTreeMap, HashMap};
use std::time::{Duration, Instant};

use kvbridge_wire::bootstrap::{
    PrefillRankInfo, PrefillServerInfo, RegisterDpRank, RouteRegistration,
};
use serde_json::Value;

/// An HTTP answer: status code plus body (JSON or plain text).
#[derive(Debug, Clone, PartialEq)]
pub enum Answer {
    /// `200` with a JSON body.
    Json(Value),
    /// A status code with a plain-text body.
    Text(u16, String),
}

impl Answer {
    fn ok() -> Self {
        Answer::Text(200, "OK".to_owned())
    }

    /// The status code.
    pub fn status(&self) -> u16 {
        match self {
            Answer::Json(_) => 200,
            Answer::Text(code, _) => *code,
        }
    }
}

/// What a registration may do to an occupied slot whose address differs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Replace {
    /// Refuse it (409): the slot's prefill is alive.
    Refuse,
    /// Replace the slot's address if it is still `old` (a restart: the
    /// old address is dead, or the write is authenticated).
    From(PrefillRankInfo),
}

/// Prefill ranks by dp group → cp rank → tp rank → pp rank.
type PortTable = HashMap<u64, HashMap<u64, HashMap<u64, HashMap<u64, PrefillRankInfo>>>>;

/// Registered prefill ranks and the topology they reported.
#[derive(Debug, Default)]
pub struct BootstrapState {
    attn_tp_size: Option<u64>,
    attn_cp_size: Option<u64>,
    dp_size: Option<u64>,
    pp_size: Option<u64>,
    page_size: Option<u64>,
    kv_cache_dtype: Option<String>,
    kv_layout: Option<String>,
    dsv41_spec_layout: Option<Value>,
    follow_bootstrap_room: Option<bool>,
    enable_dsa_cache_layer_split: Option<bool>,
    enable_kv_cache_sharding: Option<bool>,
    prefill_http_port: Option<u64>,
    decode_allocation_policy: Option<String>,
    /// dp group → cp rank → tp rank → pp rank → endpoint.
    ports: PortTable,
    room_to_dp_rank: HashMap<u64, (u64, Instant)>,
    max_dp_rank_entries: usize,
    registered: u64,
    /// Distinct `(dp, cp, tp, pp)` slots holding a rank: what readiness
    /// counts (a rank re-registering, e.g. a refresh, fills no new slot).
    slots: u64,
    replaced: u64,
}

impl BootstrapState {
    /// An empty server: nothing registered, not ready.
    pub fn new() -> Self {
        Self::with_dp_rank_capacity(super::DEFAULT_MAX_DP_RANK_ENTRIES)
    }

    /// An empty server keeping at most `max` `register_dp_rank` entries.
    pub fn with_dp_rank_capacity(max: usize) -> Self {
        Self {
            max_dp_rank_entries: max,
            ..Self::default()
        }
    }

    /// How many registrations replaced a different address in their slot.
    pub fn replaced_count(&self) -> u64 {
        self.replaced
    }

    /// The address registered in `reg`'s slot, when it differs from `reg`'s.
    pub fn occupant(&self, reg: &RouteRegistration) -> Option<PrefillRankInfo> {
        let (dp_group, _) = reg.dp_group();
        let current = self
            .ports
            .get(&dp_group)?
            .get(&reg.attn_cp_rank)?
            .get(&reg.attn_tp_rank)?
            .get(&reg.pp_rank)?;
        (current.rank_ip != reg.rank_ip || current.rank_port != reg.rank_port)
            .then(|| current.clone())
    }

    /// Why `reg`'s topology differs from the first registration's, if it does.
    fn topology_conflict(&self, reg: &RouteRegistration) -> Option<String> {
        let (_, dp_size) = reg.dp_group();
        let pairs = [
            ("attn_tp_size", self.attn_tp_size, reg.attn_tp_size),
            ("attn_cp_size", self.attn_cp_size, reg.attn_cp_size),
            ("pp_size", self.pp_size, reg.pp_size),
            ("dp_size", self.dp_size, dp_size),
            ("page_size", self.page_size, reg.page_size),
        ];
        pairs.iter().find_map(|(name, known, sent)| {
            known.filter(|k| k != sent).map(|k| {
                format!(
                    "{name}={sent} differs from the registered prefill server's {name}={k}; \
                     restart the bootstrap server to change the topology"
                )
            })
        })
    }

    /// How many successful `PUT /route` calls were counted (duplicates too,
    /// as sglang counts them).
    pub fn registered_count(&self) -> u64 {
        self.registered
    }

    /// How many distinct rank slots hold a registration.
    pub fn slot_count(&self) -> u64 {
        self.slots
    }

    /// Whether every expected prefill rank has registered: every distinct
    /// `(dp, cp, tp, pp)` slot, however often one rank re-registered.
    pub fn is_ready(&self) -> bool {
        match (
            self.attn_tp_size,
            self.attn_cp_size,
            self.pp_size,
            self.dp_size,
        ) {
            (Some(tp), Some(cp), Some(pp), Some(dp)) => {
                self.slots >= dp.saturating_mul(cp).saturating_mul(tp).saturating_mul(pp)
            }
            _ => false,
        }
    }

    /// `PUT /route`: a prefill rank registers. Values out of range are a
    /// 422, a KV layout, DSpark layout or allocation policy other than the
    /// registered ranks' a 400 and a topology other than the first
    /// registration's a 409; an
    /// occupied slot with another address is replaced only as `replace`
    /// allows (409 otherwise). Nothing changes unless the answer is 200.
    pub fn put_route(&mut self, reg: RouteRegistration, replace: Replace) -> Answer {
        if let Err(e) = reg.validate() {
            return Answer::Text(422, format!("invalid /route registration: {e}"));
        }
        let policy = reg
            .decode_allocation_policy
            .clone()
            .unwrap_or_else(|| "early".to_owned());
        if self.registered > 0 && self.dsv41_spec_layout != reg.dsv41_spec_layout {
            return Answer::Text(
                400,
                "DeepSeek-V4.1 DSpark PD layout differs across prefill ranks".to_owned(),
            );
        }
        if self.registered > 0 && self.kv_layout != reg.kv_layout {
            return Answer::Text(
                400,
                format!(
                    "KV layout differs across prefill ranks: the server has kv_layout={}, this \
                     rank has kv_layout={}",
                    self.kv_layout.as_deref().unwrap_or("None"),
                    reg.kv_layout.as_deref().unwrap_or("None")
                ),
            );
        }
        if self.registered > 0
            && self.decode_allocation_policy.as_deref().unwrap_or("early") != policy
        {
            return Answer::Text(400, "Inconsistent prefill allocation policies".to_owned());
        }
        if let Some(conflict) = self.topology_conflict(&reg) {
            return Answer::Text(409, conflict);
        }
        let new = reg.rank_info();
        if let Some(old) = self.occupant(&reg) {
            let allowed = matches!(&replace, Replace::From(expected) if *expected == old);
            if !allowed {
                return Answer::Text(
                    409,
                    format!(
                        "slot dp={} cp={} tp={} pp={} is held by a live prefill at {}:{}; \
                         refusing to replace it with {}:{}",
                        reg.dp_group().0,
                        reg.attn_cp_rank,
                        reg.attn_tp_rank,
                        reg.pp_rank,
                        old.rank_ip,
                        old.rank_port,
                        new.rank_ip,
                        new.rank_port
                    ),
                );
            }
            self.replaced += 1;
            tracing::warn!(
                dp = reg.dp_group().0,
                cp = reg.attn_cp_rank,
                tp = reg.attn_tp_rank,
                pp = reg.pp_rank,
                old = %format_args!("{}:{}", old.rank_ip, old.rank_port),
                new = %format_args!("{}:{}", new.rank_ip, new.rank_port),
                "prefill rank re-registered at a new address; replacing the old one"
            );
        }
        self.dsv41_spec_layout = reg.dsv41_spec_layout.clone();
        self.decode_allocation_policy = Some(policy);
        self.attn_tp_size.get_or_insert(reg.attn_tp_size);
        self.attn_cp_size.get_or_insert(reg.attn_cp_size);
        self.dp_size.get_or_insert(reg.dp_group().1);
        self.pp_size.get_or_insert(reg.pp_size);
        self.page_size.get_or_insert(reg.page_size);
        if self.kv_cache_dtype.is_none() {
            self.kv_cache_dtype = reg.kv_cache_dtype.clone();
        }
        if self.kv_layout.is_none() {
            self.kv_layout = reg.kv_layout.clone();
        }
        if self.prefill_http_port.is_none() {
            self.prefill_http_port = reg.prefill_http_port;
        }
        if self.follow_bootstrap_room.is_none() {
            let method = reg
                .load_balance_method
                .as_deref()
                .unwrap_or("follow_bootstrap_room");
            self.follow_bootstrap_room = Some(method == "follow_bootstrap_room");
        }
        self.enable_dsa_cache_layer_split
            .get_or_insert(reg.enable_dsa_cache_layer_split.unwrap_or(false));
        self.enable_kv_cache_sharding
            .get_or_insert(reg.enable_kv_cache_sharding.unwrap_or(false));
        let (dp_group, _) = reg.dp_group();
        let previous = self
            .ports
            .entry(dp_group)
            .or_default()
            .entry(reg.attn_cp_rank)
            .or_default()
            .entry(reg.attn_tp_rank)
            .or_default()
            .insert(reg.pp_rank, new);
        self.registered += 1;
        if previous.is_none() {
            self.slots += 1;
        }
        tracing::debug!(
            dp = dp_group,
            cp = reg.attn_cp_rank,
            tp = reg.attn_tp_rank,
            pp = reg.pp_rank,
            ip = %reg.rank_ip,
            port = reg.rank_port,
            registered = self.registered,
            slots = self.slots,
            "prefill rank registered"
        );
        Answer::ok()
    }

    fn not_ready(&self) -> Answer {
        Answer::Text(
            503,
            format!(
                "Prefill server not fully registered yet ({} workers registered).",
                self.slots
            ),
        )
    }

    /// `GET /route`: the query parameters as given (missing or empty ones
    /// are a 400, as in sglang).
    pub fn get_route(&self, params: &HashMap<String, String>) -> Answer {
        let names = [
            "prefill_dp_rank",
            "prefill_cp_rank",
            "target_tp_rank",
            "target_pp_rank",
        ];
        let mut raw = Vec::with_capacity(4);
        for name in names {
            match params.get(name).filter(|v| !v.is_empty()) {
                Some(v) => raw.push(v.as_str()),
                None => {
                    return Answer::Text(400, "Missing inputs for bootstrap server.".to_owned());
                }
            }
        }
        let mut ranks = [0i64; 4];
        for (slot, (name, text)) in ranks.iter_mut().zip(names.iter().zip(&raw)) {
            match text.trim().parse::<i64>() {
                Ok(v) => *slot = v,
                Err(_) => {
                    return Answer::Text(400, format!("Invalid integer for {name}: {text:?}"));
                }
            }
        }
        if ranks == [-1; 4] {
            if !self.is_ready() {
                return self.not_ready();
            }
            return Answer::Json(self.server_info_json());
        }
        if !self.is_ready() {
            return self.not_ready();
        }
        let found = (|| {
            let [dp, cp, tp, pp] = ranks.map(|r| u64::try_from(r).ok());
            self.ports.get(&dp?)?.get(&cp?)?.get(&tp?)?.get(&pp?)
        })();
        match found {
            Some(info) => Answer::Json(serde_json::to_value(info).unwrap_or(Value::Null)),
            None => Answer::Text(
                404,
                format!(
                    "Bootstrap info not found for dp_rank={} cp_rank={} tp_rank={} pp_rank={}",
                    raw[0], raw[1], raw[2], raw[3]
                ),
            ),
        }
    }

    fn server_info_json(&self) -> Value {
        let info = PrefillServerInfo {
            attn_tp_size: self.attn_tp_size.unwrap_or(0),
            attn_cp_size: self.attn_cp_size.unwrap_or(0),
            dp_size: self.dp_size.unwrap_or(0),
            pp_size: self.pp_size.unwrap_or(0),
            page_size: self.page_size,
            kv_cache_dtype: self.kv_cache_dtype.clone(),
            follow_bootstrap_room: self.follow_bootstrap_room.unwrap_or(true),
            enable_dsa_cache_layer_split: self.enable_dsa_cache_layer_split.unwrap_or(false),
            dsv41_spec_layout: self.dsv41_spec_layout.clone(),
            kv_layout: self.kv_layout.clone(),
            decode_allocation_policy: self
                .decode_allocation_policy
                .clone()
                .unwrap_or_else(|| "early".to_owned()),
            enable_kv_cache_sharding: self.enable_kv_cache_sharding.unwrap_or(false),
            prefill_http_port: self.prefill_http_port,
            target_tp_rank: None,
            target_tp_ranks: None,
            target_cp_ranks: None,
            target_pp_ranks: None,
            required_dst_info_num: None,
            required_prefill_response_num: None,
        };
        serde_json::to_value(info).unwrap_or(Value::Null)
    }

    /// `POST /register_dp_rank`: a DP rank at or above the server's DP size
    /// (or [`kvbridge_wire::bootstrap::MAX_PARALLEL_SIZE`]) is a 422; a new
    /// room beyond the table's capacity a 503.
    pub fn register_dp_rank(&mut self, room: u64, dp_rank: u64, now: Instant) -> Answer {
        let body = RegisterDpRank {
            bootstrap_room: room,
            dp_rank,
        };
        if let Err(e) = body.validate(self.dp_size) {
            return Answer::Text(422, format!("invalid /register_dp_rank body: {e}"));
        }
        if self.room_to_dp_rank.len() >= self.max_dp_rank_entries
            && !self.room_to_dp_rank.contains_key(&room)
        {
            return Answer::Text(
                503,
                format!(
                    "{} rooms registered; refusing more until expired ones are cleaned up",
                    self.room_to_dp_rank.len()
                ),
            );
        }
        self.room_to_dp_rank.insert(room, (dp_rank, now));
        Answer::ok()
    }

    /// `POST /query_dp_ranks`: the known rooms' DP ranks.
    pub fn query_dp_ranks(&self, rooms: &[u64]) -> Answer {
        let map: BTreeMap<String, Value> = rooms
            .iter()
            .filter_map(|r| {
                self.room_to_dp_rank
                    .get(r)
                    .map(|(dp, _)| (r.to_string(), Value::from(*dp)))
            })
            .collect();
        Answer::Json(Value::Object(map.into_iter().collect()))
    }

    /// Drops DP-rank entries older than `max_age`; returns how many.
    pub fn cleanup(&mut self, now: Instant, max_age: Duration) -> usize {
        let before = self.room_to_dp_rank.len();
        self.room_to_dp_rank
            .retain(|_, (_, at)| now.saturating_duration_since(*at) <= max_age);
        before - self.room_to_dp_rank.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reg(tp_rank: u64, port: u16) -> RouteRegistration {
        serde_json::from_value(serde_json::json!({
            "attn_tp_size": 2, "attn_tp_rank": tp_rank, "attn_cp_size": 1, "attn_cp_rank": 0,
            "attn_dp_size": 1, "attn_dp_rank": 0, "pp_size": 1, "pp_rank": 0,
            "system_dp_size": 1, "system_dp_rank": 0, "rank_ip": "127.0.0.1",
            "rank_port": port, "page_size": 16, "kv_cache_dtype": "auto",
            "load_balance_method": "round_robin"
        }))
        .expect("valid registration")
    }

    fn query(dp: &str, cp: &str, tp: &str, pp: &str) -> HashMap<String, String> {
        [
            ("prefill_dp_rank", dp),
            ("prefill_cp_rank", cp),
            ("target_tp_rank", tp),
            ("target_pp_rank", pp),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .collect()
    }

    #[test]
    fn readiness_counts_registrations() {
        let mut s = BootstrapState::new();
        assert_eq!(s.get_route(&query("-1", "-1", "-1", "-1")).status(), 503);
        assert_eq!(s.put_route(reg(0, 7000), Replace::Refuse), Answer::ok());
        assert!(!s.is_ready());
        assert_eq!(s.get_route(&query("0", "0", "0", "0")).status(), 503);
        s.put_route(reg(1, 7001), Replace::Refuse);
        assert!(s.is_ready());
        let Answer::Json(info) = s.get_route(&query("-1", "-1", "-1", "-1")) else {
            panic!("expected server info")
        };
        assert_eq!(info["attn_tp_size"], 2);
        assert_eq!(info["follow_bootstrap_room"], false);
        assert_eq!(info["target_tp_rank"], Value::Null);
        assert!(info.get("kv_layout").is_none());
        let Answer::Json(rank) = s.get_route(&query("0", "0", "1", "0")) else {
            panic!("expected rank info")
        };
        assert_eq!(
            rank,
            serde_json::json!({"rank_ip": "127.0.0.1", "rank_port": 7001})
        );
        assert_eq!(s.get_route(&query("0", "0", "5", "0")).status(), 404);
        assert_eq!(s.get_route(&query("0", "", "1", "0")).status(), 400);
        assert_eq!(s.get_route(&query("0", "x", "1", "0")).status(), 400);
    }

    #[test]
    fn readiness_counts_distinct_slots_not_registrations() {
        let four = |tp: u64, port: u16| {
            let mut r = reg(tp, port);
            r.attn_tp_size = 4;
            r
        };
        let mut s = BootstrapState::new();
        // Rank 0 refreshes its registration while the server answers 503.
        for _ in 0..4 {
            assert_eq!(s.put_route(four(0, 7000), Replace::Refuse), Answer::ok());
        }
        assert!(
            !s.is_ready(),
            "one rank registered four times is not four ranks"
        );
        assert_eq!(s.get_route(&query("-1", "-1", "-1", "-1")).status(), 503);
        s.put_route(four(1, 7001), Replace::Refuse);
        s.put_route(four(2, 7002), Replace::Refuse);
        s.put_route(four(1, 7001), Replace::Refuse);
        assert!(!s.is_ready(), "three of four ranks");
        assert_eq!(s.slot_count(), 3);
        assert_eq!(
            s.registered_count(),
            7,
            "every PUT counted, as sglang counts them"
        );
        s.put_route(four(3, 7003), Replace::Refuse);
        assert!(s.is_ready());
        assert_eq!(s.get_route(&query("-1", "-1", "-1", "-1")).status(), 200);
    }

    #[test]
    fn a_zoned_ipv6_rank_ip_is_answered_verbatim() {
        let mut s = BootstrapState::new();
        for (tp, ip) in [(0, "fe80::1%eth0"), (1, "[fe80::2%eth1]")] {
            let mut r = reg(tp, 7000 + tp as u16);
            r.rank_ip = ip.into();
            assert_eq!(s.put_route(r, Replace::Refuse), Answer::ok(), "{ip}");
        }
        for (tp, ip) in [("0", "fe80::1%eth0"), ("1", "[fe80::2%eth1]")] {
            let Answer::Json(rank) = s.get_route(&query("0", "0", tp, "0")) else {
                panic!("expected rank info")
            };
            assert_eq!(rank["rank_ip"], ip);
        }
    }

    #[test]
    fn inconsistent_ranks_are_rejected() {
        let mut s = BootstrapState::new();
        s.put_route(reg(0, 7000), Replace::Refuse);
        let mut other = reg(1, 7001);
        other.decode_allocation_policy = Some("prefill_complete".into());
        assert_eq!(s.put_route(other, Replace::Refuse).status(), 400);
        let mut other = reg(1, 7001);
        other.dsv41_spec_layout = Some(serde_json::json!({"block": 4}));
        assert_eq!(s.put_route(other, Replace::Refuse).status(), 400);
        assert_eq!(s.registered_count(), 1);
    }

    #[test]
    fn a_kv_layout_other_than_the_registered_ranks_is_rejected_naming_both() {
        let mut s = BootstrapState::new();
        let mut first = reg(0, 7000);
        first.kv_layout = Some("v4,c4:v4,c128:v4".into());
        assert_eq!(s.put_route(first, Replace::Refuse), Answer::ok());
        for other_layout in [Some("v41,c4:v41,c128:v41"), None] {
            let mut other = reg(1, 7001);
            other.kv_layout = other_layout.map(str::to_owned);
            let Answer::Text(400, why) = s.put_route(other, Replace::Refuse) else {
                panic!("a second layout must be refused")
            };
            assert!(why.contains("kv_layout=v4,c4:v4,c128:v4"), "{why}");
            assert!(
                why.contains(&format!("kv_layout={}", other_layout.unwrap_or("None"))),
                "{why}"
            );
        }
        let mut same = reg(1, 7001);
        same.kv_layout = Some("v4,c4:v4,c128:v4".into());
        assert_eq!(s.put_route(same, Replace::Refuse), Answer::ok());
        let Answer::Json(info) = s.get_route(&query("-1", "-1", "-1", "-1")) else {
            panic!("expected server info")
        };
        assert_eq!(info["kv_layout"], "v4,c4:v4,c128:v4");
    }

    #[test]
    fn dp_ranks_expire() {
        let mut s = BootstrapState::new();
        let t0 = Instant::now();
        s.register_dp_rank(11, 3, t0);
        let Answer::Json(map) = s.query_dp_ranks(&[11, 12]) else {
            panic!()
        };
        assert_eq!(map, serde_json::json!({"11": 3}));
        assert_eq!(
            s.cleanup(t0 + Duration::from_secs(200), Duration::from_secs(120)),
            1
        );
        let Answer::Json(map) = s.query_dp_ranks(&[11]) else {
            panic!()
        };
        assert_eq!(map, serde_json::json!({}));
    }
}
