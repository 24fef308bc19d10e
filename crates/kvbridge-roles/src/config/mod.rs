//! One configuration struct per role, readable from a file (serde) and from
//! sglang's environment variable names where sglang has one.

use std::net::SocketAddr;
use std::time::Duration;

use serde::{Deserialize, Serialize};

pub use crate::env::Vars;
use crate::env::{env, env_bool, nvlink_intra_vars, process_env};

mod staging;
pub use staging::{STAGING_SLOTS, StagingConfig, StagingMode};

fn secs(s: f64) -> Duration {
    Duration::try_from_secs_f64(s).unwrap_or(Duration::ZERO)
}

/// The variables both roles read the same way.
struct SharedVars {
    max_sockets: Option<usize>,
    all_cp_ranks: Option<bool>,
    force_query_dp_rank: Option<bool>,
}

impl SharedVars {
    fn read(get: Vars<'_>) -> Self {
        Self {
            max_sockets: env::<usize>(get, "SGLANG_DISAGGREGATION_ZMQ_MAX_SOCKETS"),
            all_cp_ranks: env_bool(get, "SGLANG_DISAGGREGATION_ALL_CP_RANKS_TRANSFER"),
            force_query_dp_rank: env_bool(get, "SGLANG_DISAGGREGATION_FORCE_QUERY_PREFILL_DP_RANK"),
        }
    }

    fn apply(&self, max_sockets: &mut usize, all_cp_ranks: &mut bool, force_query: &mut bool) {
        if let Some(v) = self.max_sockets {
            *max_sockets = v.max(1);
        }
        if let Some(v) = self.all_cp_ranks {
            *all_cp_ranks = v;
        }
        if let Some(v) = self.force_query_dp_rank {
            *force_query = v;
        }
    }
}

/// A rank's place in the parallel layout, as the bootstrap server records it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct ParallelRank {
    /// Attention TP size.
    pub attn_tp_size: u64,
    /// Attention TP rank.
    pub attn_tp_rank: u64,
    /// Attention CP size.
    pub attn_cp_size: u64,
    /// Attention CP rank.
    pub attn_cp_rank: u64,
    /// Attention DP size.
    pub attn_dp_size: u64,
    /// Attention DP rank.
    pub attn_dp_rank: u64,
    /// Pipeline-parallel size.
    pub pp_size: u64,
    /// Pipeline-parallel rank.
    pub pp_rank: u64,
    /// System DP size.
    pub system_dp_size: u64,
    /// System DP rank.
    pub system_dp_rank: u64,
}

impl Default for ParallelRank {
    fn default() -> Self {
        Self {
            attn_tp_size: 1,
            attn_tp_rank: 0,
            attn_cp_size: 1,
            attn_cp_rank: 0,
            attn_dp_size: 1,
            attn_dp_rank: 0,
            pp_size: 1,
            pp_rank: 0,
            system_dp_size: 1,
            system_dp_rank: 0,
        }
    }
}

impl ParallelRank {
    /// `(dp rank, dp size)` as the bootstrap server keys ranks: attention DP,
    /// or system DP when there is one.
    pub fn dp_group(&self) -> (u64, u64) {
        if self.system_dp_size <= 1 {
            (self.attn_dp_rank, self.attn_dp_size.max(1))
        } else {
            (self.system_dp_rank, self.system_dp_size)
        }
    }

    /// sglang's `_prefill_unique_rank`: a stable id per sender.
    pub fn unique_rank(&self) -> u64 {
        self.attn_tp_rank * (self.pp_size * self.attn_cp_size)
            + self.pp_rank * self.attn_cp_size
            + self.attn_cp_rank
    }
}

/// Failed-session probing (`SGLANG_ENABLE_FAILED_SESSION_PROBE`, …).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct ProbeConfig {
    /// Whether blacklisted sessions are probed and lifted when they answer.
    pub enabled: bool,
    /// Wait before the first probe of a newly blacklisted session.
    #[serde(with = "duration_secs")]
    pub interval: Duration,
    /// Longest wait between probes (each failed probe doubles the wait).
    #[serde(with = "duration_secs")]
    pub max_interval: Duration,
    /// Forget a blacklisted session no room asked for within this long.
    #[serde(with = "duration_secs")]
    pub idle_timeout: Duration,
}

impl Default for ProbeConfig {
    fn default() -> Self {
        Self {
            enabled: true,
            // sglang's SGLANG_FAILED_SESSION_PROBE_INTERVAL_S default.
            interval: Duration::from_secs(30),
            max_interval: Duration::from_secs(300),
            idle_timeout: Duration::from_secs(600),
        }
    }
}

/// A prefill role's settings.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct PrefillConfig {
    /// The IP peers reach this rank at (zmq socket and bootstrap registration).
    pub local_ip: String,
    /// The bootstrap server, `host:port`.
    pub bootstrap_addr: String,
    /// This rank's parallel position.
    pub rank: ParallelRank,
    /// KV cache dtype name reported to the bootstrap server.
    pub kv_cache_dtype: String,
    /// KV byte-layout tag reported to the bootstrap server (sglang's
    /// `KVArgs.kv_layout`: a DeepSeek-V4 pool's `pd_kv_layout()`, such as
    /// `v4,c4:v4,c128:v4`); decodes require their own to be equal.
    pub kv_layout: Option<String>,
    /// Transfer queues (shards) (`SGLANG_DISAGGREGATION_QUEUE_SIZE`).
    pub queue_size: usize,
    /// Transfer threads in total (`SGLANG_DISAGGREGATION_THREAD_POOL_SIZE`);
    /// each shard's worker keeps `thread_pool_size / queue_size` engine
    /// batches in flight (at least 16). `None`: sglang's default from the CPU count.
    pub thread_pool_size: Option<usize>,
    /// Fail a room still bootstrapping after this long
    /// (`SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT`).
    #[serde(with = "duration_secs")]
    pub bootstrap_timeout: Duration,
    /// Send aux slots over zmq (`AUX_DATA`) instead of the engine
    /// (`SGLANG_MOONCAKE_SEND_AUX_TCP`).
    pub send_aux_tcp: bool,
    /// Hold an abort's ACK until the room's in-flight writes drain and send
    /// the ranked form (`SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE`).
    /// Either way an ACK is only sent once nothing is in flight.
    pub deferred_release: bool,
    /// Failed-session probing.
    pub probe: ProbeConfig,
    /// How long a zmq send may block before it fails.
    #[serde(with = "duration_secs")]
    pub zmq_send_timeout: Duration,
    /// Largest control message accepted from a peer, in bytes (zmq
    /// `MAXMSGSIZE`); a peer sending a larger one is disconnected.
    pub zmq_max_message_bytes: usize,
    /// Most control sockets open to peers at once, one per peer endpoint
    /// (`SGLANG_DISAGGREGATION_ZMQ_MAX_SOCKETS`; fewer where the descriptor
    /// limit could not hold them); the least recently used is closed for a
    /// new endpoint.
    pub zmq_max_sockets: usize,
    /// With prefill context parallelism, every CP rank transfers a share
    /// of each request instead of CP rank 0 alone; both roles must agree
    /// (`SGLANG_DISAGGREGATION_ALL_CP_RANKS_TRANSFER`).
    pub all_cp_ranks: bool,
    /// Register (prefill) or query (decode) every room's DP rank through
    /// the bootstrap server even when routing follows the bootstrap room
    /// (`SGLANG_DISAGGREGATION_FORCE_QUERY_PREFILL_DP_RANK`).
    pub force_query_dp_rank: bool,
    /// How requests reach this prefill's DP ranks (sglang's
    /// `--load-balance-method`): with `follow_bootstrap_room` a room goes to
    /// DP rank `room % dp_size`, which decodes compute themselves; with any
    /// other method each room's DP rank is registered with the bootstrap
    /// server (`/register_dp_rank`) for decodes to query.
    pub load_balance_method: String,
    /// Most blocks handed to the engine in one batch (0 = no cap beyond
    /// `max_transfer_batch_indices`).
    pub max_batch_blocks: usize,
    /// Pages per planner batch (`SGLANG_MOONCAKE_MAX_TRANSFER_BATCH_INDICES`,
    /// 0 = one batch per chunk); when set, it replaces the layout's
    /// `max_transfer_batch_indices` at start.
    pub max_transfer_batch_indices: Option<u64>,
    /// Most decode sessions registered at once; registrations of further
    /// sessions are refused (counted) until others are replaced.
    pub max_sessions: usize,
    /// Most rooms with pending transfer requests at once; requests for
    /// further new rooms are refused (counted).
    pub max_rooms: usize,
    /// Most pending rooms per decode session, so that one peer cannot fill
    /// `max_rooms` alone.
    pub max_rooms_per_session: usize,
    /// Most bytes of destination page lists held for pending rooms in
    /// all; requests past it are refused (counted) once unclaimed rooms
    /// older than the bootstrap timeout are dropped.
    pub max_pending_request_bytes: usize,
    /// Most abort ACK endpoints remembered per room.
    pub max_abort_endpoints: usize,
    /// Serve Prometheus metrics here when set.
    pub metrics_addr: Option<SocketAddr>,
    /// The zmq control port peers send this rank's messages to (0: any
    /// free port, as sglang; set it where a firewall must open it).
    pub control_port: u16,
    /// How often the rank checks that the bootstrap server still holds its
    /// registration and registers again when it does not (a restarted
    /// server); zero: never (sglang registers once).
    #[serde(with = "duration_secs")]
    pub bootstrap_refresh: Duration,
    /// Intra-node transport (`MC_INTRANODE_NVLINK`, `MC_INTRA_NVLINK`,
    /// `MOONCAKE_PROTOCOL=nvlink_intra`): only device regions go to the
    /// engine; host-sourced blocks and aux travel over zmq. Also on when
    /// the engine moves device memory only.
    pub nvlink_intra: bool,
    /// The cluster secret guarding the zmq control plane and bootstrap
    /// writes; `None` runs in sglang-compatible open mode. Never read from
    /// or written to a config file.
    #[serde(skip)]
    pub secret: Option<kvbridge_engine::ClusterSecret>,
    /// The staging path for heterogeneous TP.
    pub staging: StagingConfig,
}

impl Default for PrefillConfig {
    fn default() -> Self {
        Self {
            local_ip: "127.0.0.1".to_owned(),
            bootstrap_addr: "127.0.0.1:8998".to_owned(),
            rank: ParallelRank::default(),
            kv_cache_dtype: "auto".to_owned(),
            kv_layout: None,
            queue_size: 4,
            thread_pool_size: None,
            bootstrap_timeout: Duration::from_secs(300),
            send_aux_tcp: false,
            deferred_release: true,
            probe: ProbeConfig::default(),
            zmq_send_timeout: Duration::from_secs(30),
            zmq_max_message_bytes: crate::control::DEFAULT_MAX_MESSAGE_BYTES,
            zmq_max_sockets: crate::control::DEFAULT_MAX_SOCKETS,
            all_cp_ranks: false,
            load_balance_method: "follow_bootstrap_room".into(),
            force_query_dp_rank: false,
            max_batch_blocks: 1 << 16,
            max_transfer_batch_indices: None,
            max_sessions: 4096,
            max_rooms: 1 << 16,
            max_rooms_per_session: 1 << 14,
            max_pending_request_bytes: 128 << 20,
            max_abort_endpoints: 64,
            metrics_addr: None,
            control_port: 0,
            bootstrap_refresh: Duration::from_secs(10),
            nvlink_intra: false,
            secret: None,
            staging: StagingConfig::default(),
        }
    }
}

impl PrefillConfig {
    /// Applies sglang's environment variables over `self`.
    pub fn with_env(self) -> Self {
        self.with_vars(&process_env)
    }

    /// [`PrefillConfig::with_env`] reading variables from `get`.
    pub fn with_vars(mut self, get: Vars<'_>) -> Self {
        if let Some(v) = env::<usize>(get, "SGLANG_DISAGGREGATION_QUEUE_SIZE") {
            self.queue_size = v;
        }
        if let Some(v) = env::<usize>(get, "SGLANG_DISAGGREGATION_THREAD_POOL_SIZE") {
            self.thread_pool_size = Some(v);
        }
        if let Some(v) = env::<f64>(get, "SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT") {
            self.bootstrap_timeout = secs(v);
        }
        if let Some(v) = env::<u64>(get, "SGLANG_MOONCAKE_MAX_TRANSFER_BATCH_INDICES") {
            self.max_transfer_batch_indices = Some(v);
        }
        if let Some(v) = env_bool(get, "SGLANG_MOONCAKE_SEND_AUX_TCP") {
            self.send_aux_tcp = v;
        }
        let shared = SharedVars::read(get);
        shared.apply(
            &mut self.zmq_max_sockets,
            &mut self.all_cp_ranks,
            &mut self.force_query_dp_rank,
        );
        if let Some(v) = env_bool(get, "SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE") {
            self.deferred_release = v;
        }
        if let Some(v) = env_bool(get, "SGLANG_ENABLE_FAILED_SESSION_PROBE") {
            self.probe.enabled = v;
        }
        if let Some(v) = env::<f64>(get, "SGLANG_FAILED_SESSION_PROBE_INTERVAL_S") {
            self.probe.interval = secs(v);
        }
        if let Some(v) = env::<f64>(get, "SGLANG_FAILED_SESSION_PROBE_MAX_INTERVAL_S") {
            self.probe.max_interval = secs(v);
        }
        if let Some(v) = env::<f64>(get, "SGLANG_FAILED_SESSION_IDLE_TIMEOUT_S") {
            self.probe.idle_timeout = secs(v);
        }
        self.nvlink_intra |= nvlink_intra_vars(get);
        self.staging = self.staging.with_vars(get);
        self
    }

    /// Queues and in-flight batches per queue, checked as sglang checks them.
    pub fn worker_layout(&self) -> Result<(usize, usize), String> {
        let queues = self.queue_size.max(1);
        let pool = self.thread_pool_size.unwrap_or_else(|| {
            let cpus = std::thread::available_parallelism().map_or(1, usize::from);
            (((cpus as f64 * 0.5) as usize) / 8).clamp(4, 12)
        });
        if pool < queues {
            return Err(format!(
                "SGLANG_DISAGGREGATION_THREAD_POOL_SIZE={pool} must be greater than or equal to \
                 SGLANG_DISAGGREGATION_QUEUE_SIZE={queues}"
            ));
        }
        Ok((queues, (pool / queues).max(1)))
    }
}

/// A decode role's settings.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct DecodeConfig {
    /// The IP prefill ranks reach this rank at (zmq socket).
    pub local_ip: String,
    /// This rank's attention TP size.
    pub attn_tp_size: u64,
    /// This rank's pipeline-parallel size and rank.
    pub pp_size: u64,
    /// This rank's pipeline-parallel rank.
    pub pp_rank: u64,
    /// KV cache dtype name, checked against the prefill's.
    pub kv_cache_dtype: String,
    /// KV byte-layout tag (sglang's `KVArgs.kv_layout`), checked equal to
    /// the one the prefill server registered.
    pub kv_layout: Option<String>,
    /// Health-check interval against each prefill bootstrap server
    /// (`SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL`).
    #[serde(with = "duration_secs")]
    pub heartbeat_interval: Duration,
    /// Missed health checks before a prefill counts as dead
    /// (`SGLANG_DISAGGREGATION_HEARTBEAT_MAX_FAILURE`).
    pub heartbeat_max_failures: u32,
    /// Fail a room still waiting for its KV after this long
    /// (`SGLANG_DISAGGREGATION_WAITING_TIMEOUT`).
    #[serde(with = "duration_secs")]
    pub waiting_timeout: Duration,
    /// Give up resolving the prefill ranks of a room after this long
    /// (`SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT`).
    #[serde(with = "duration_secs")]
    pub bootstrap_timeout: Duration,
    /// Track abort ACKs per generation (deferred KV release).
    pub deferred_release: bool,
    /// How long an aborted or failed room waits for its prefill ranks'
    /// ABORT_ACKs before silent ranks are fenced by our engine (when it can
    /// fence and the rank published its engine session); ranks that cannot
    /// be fenced keep the room's pages pinned, reported once.
    #[serde(with = "duration_secs")]
    pub abort_ack_timeout: Duration,
    /// How long a zmq send may block (`SGLANG_DISAGGREGATION_ZMQ_SEND_TIMEOUT`).
    #[serde(with = "duration_secs")]
    pub zmq_send_timeout: Duration,
    /// Largest control message accepted from a peer, in bytes (zmq
    /// `MAXMSGSIZE`); a peer sending a larger one is disconnected.
    pub zmq_max_message_bytes: usize,
    /// Most control sockets open to peers at once, one per peer endpoint
    /// (`SGLANG_DISAGGREGATION_ZMQ_MAX_SOCKETS`; fewer where the descriptor
    /// limit could not hold them); the least recently used is closed for a
    /// new endpoint.
    pub zmq_max_sockets: usize,
    /// With prefill context parallelism, every CP rank transfers a share
    /// of each request instead of CP rank 0 alone; both roles must agree
    /// (`SGLANG_DISAGGREGATION_ALL_CP_RANKS_TRANSFER`).
    pub all_cp_ranks: bool,
    /// Register (prefill) or query (decode) every room's DP rank through
    /// the bootstrap server even when routing follows the bootstrap room
    /// (`SGLANG_DISAGGREGATION_FORCE_QUERY_PREFILL_DP_RANK`).
    pub force_query_dp_rank: bool,
    /// Serve Prometheus metrics here when set.
    pub metrics_addr: Option<SocketAddr>,
    /// The zmq control port peers send this rank's messages to (0: any
    /// free port, as sglang; set it where a firewall must open it).
    pub control_port: u16,
    /// Intra-node transport: only device regions are registered with the
    /// engine; host regions receive `STATE_DATA` / `AUX_DATA` over zmq.
    /// Also on when the engine moves device memory only.
    pub nvlink_intra: bool,
    /// The cluster secret guarding the zmq control plane; `None` runs in
    /// sglang-compatible open mode. Never read from or written to a config file.
    #[serde(skip)]
    pub secret: Option<kvbridge_engine::ClusterSecret>,
    /// The staging path for heterogeneous TP.
    pub staging: StagingConfig,
}

impl Default for DecodeConfig {
    fn default() -> Self {
        Self {
            local_ip: "127.0.0.1".to_owned(),
            attn_tp_size: 1,
            pp_size: 1,
            pp_rank: 0,
            kv_cache_dtype: "auto".to_owned(),
            kv_layout: None,
            heartbeat_interval: Duration::from_secs(5),
            heartbeat_max_failures: 2,
            waiting_timeout: Duration::from_secs(300),
            bootstrap_timeout: Duration::from_secs(300),
            deferred_release: true,
            // sglang's SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE_TIMEOUT.
            abort_ack_timeout: Duration::from_secs(30),
            zmq_send_timeout: Duration::from_secs(1),
            zmq_max_message_bytes: crate::control::DEFAULT_MAX_MESSAGE_BYTES,
            zmq_max_sockets: crate::control::DEFAULT_MAX_SOCKETS,
            all_cp_ranks: false,
            force_query_dp_rank: false,
            metrics_addr: None,
            control_port: 0,
            nvlink_intra: false,
            secret: None,
            staging: StagingConfig::default(),
        }
    }
}

impl DecodeConfig {
    /// Applies sglang's environment variables over `self`, with sglang's
    /// floors (heartbeat ≥ 2 s, ≥ 1 failure).
    pub fn with_env(self) -> Self {
        self.with_vars(&process_env)
    }

    /// [`DecodeConfig::with_env`] reading variables from `get`.
    pub fn with_vars(mut self, get: Vars<'_>) -> Self {
        if let Some(v) = env::<f64>(get, "SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL") {
            self.heartbeat_interval = secs(v.max(2.0));
        }
        if let Some(v) = env::<u32>(get, "SGLANG_DISAGGREGATION_HEARTBEAT_MAX_FAILURE") {
            self.heartbeat_max_failures = v.max(1);
        }
        if let Some(v) = env::<f64>(get, "SGLANG_DISAGGREGATION_WAITING_TIMEOUT") {
            self.waiting_timeout = secs(v);
        }
        if let Some(v) = env::<f64>(get, "SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT") {
            self.bootstrap_timeout = secs(v);
        }
        if let Some(v) = env_bool(get, "SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE") {
            self.deferred_release = v;
        }
        if let Some(v) = env::<f64>(
            get,
            "SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE_TIMEOUT",
        ) {
            self.abort_ack_timeout = secs(v);
        }
        if let Some(v) = env::<f64>(get, "SGLANG_DISAGGREGATION_ZMQ_SEND_TIMEOUT") {
            self.zmq_send_timeout = secs(v);
        }
        let shared = SharedVars::read(get);
        shared.apply(
            &mut self.zmq_max_sockets,
            &mut self.all_cp_ranks,
            &mut self.force_query_dp_rank,
        );
        self.nvlink_intra |= nvlink_intra_vars(get);
        self.staging = self.staging.with_vars(get);
        self
    }
}

/// Durations as (fractional) seconds in config files.
pub mod duration_secs {
    use std::time::Duration;

    use serde::{Deserialize, Deserializer, Serializer, de::Error};

    /// Writes seconds as a float.
    pub fn serialize<S: Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_f64(d.as_secs_f64())
    }

    /// Reads non-negative (fractional) seconds.
    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Duration, D::Error> {
        let secs = f64::deserialize(d)?;
        Duration::try_from_secs_f64(secs).map_err(D::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn worker_layout_follows_sglang_rules() {
        let mut c = PrefillConfig {
            thread_pool_size: Some(8),
            ..PrefillConfig::default()
        };
        assert_eq!(c.worker_layout(), Ok((4, 2)));
        c.thread_pool_size = Some(2);
        assert!(c.worker_layout().is_err());
    }

    #[test]
    fn unique_rank_matches_sglang() {
        let r = ParallelRank {
            attn_tp_rank: 2,
            pp_size: 2,
            pp_rank: 1,
            attn_cp_size: 1,
            ..ParallelRank::default()
        };
        assert_eq!(r.unique_rank(), 2 * 2 + 1);
    }

    /// Every sglang variable the roles read, set at once: each lands in
    /// its field (sglang's floors applied), and a malformed one is ignored.
    #[test]
    fn sglang_variables_land_in_their_fields() {
        let vars: std::collections::HashMap<&str, &str> = [
            ("SGLANG_DISAGGREGATION_QUEUE_SIZE", "3"),
            ("SGLANG_DISAGGREGATION_THREAD_POOL_SIZE", "9"),
            ("SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT", "12.5"),
            ("SGLANG_MOONCAKE_SEND_AUX_TCP", "true"),
            ("SGLANG_MOONCAKE_MAX_TRANSFER_BATCH_INDICES", "5"),
            ("SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE", "0"),
            ("SGLANG_ENABLE_FAILED_SESSION_PROBE", "off"),
            ("SGLANG_FAILED_SESSION_PROBE_INTERVAL_S", "7"),
            ("SGLANG_FAILED_SESSION_PROBE_MAX_INTERVAL_S", "70"),
            ("SGLANG_FAILED_SESSION_IDLE_TIMEOUT_S", "700"),
            ("SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL", "1"),
            ("SGLANG_DISAGGREGATION_HEARTBEAT_MAX_FAILURE", "0"),
            ("SGLANG_DISAGGREGATION_WAITING_TIMEOUT", "40"),
            ("SGLANG_DISAGGREGATION_ZMQ_SEND_TIMEOUT", "3"),
            (
                "SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE_TIMEOUT",
                "45",
            ),
            ("SGLANG_DISAGG_STAGING_BUFFER", "1"),
            ("SGLANG_DISAGG_STAGING_POOL_SIZE_MB", "2"),
            ("SGLANG_DISAGGREGATION_ZMQ_MAX_SOCKETS", "20000"),
            ("SGLANG_DISAGGREGATION_ALL_CP_RANKS_TRANSFER", "1"),
            ("SGLANG_DISAGGREGATION_FORCE_QUERY_PREFILL_DP_RANK", "true"),
            ("MC_INTRANODE_NVLINK", "1"),
            (
                "SGLANG_DISAGGREGATION_BOOTSTRAP_ENTRY_CLEANUP_INTERVAL",
                "30",
            ),
        ]
        .into_iter()
        .collect();
        let get = |n: &str| vars.get(n).map(|v| (*v).to_owned());
        let p = PrefillConfig::default().with_vars(&get);
        assert_eq!((p.queue_size, p.thread_pool_size), (3, Some(9)));
        assert_eq!(p.bootstrap_timeout, Duration::from_millis(12_500));
        assert!(p.send_aux_tcp && !p.deferred_release && !p.probe.enabled);
        assert_eq!(p.max_transfer_batch_indices, Some(5));
        assert_eq!(
            (p.probe.interval, p.probe.max_interval, p.probe.idle_timeout),
            (
                Duration::from_secs(7),
                Duration::from_secs(70),
                Duration::from_secs(700)
            )
        );
        assert!(p.staging.mode == StagingMode::On && p.staging.pool_bytes == 2 << 20);
        assert_eq!(p.zmq_max_sockets, 20000);
        assert!(p.all_cp_ranks && p.force_query_dp_rank && p.nvlink_intra);
        assert_eq!(
            crate::bootstrap::entry_cleanup_interval(&get),
            Duration::from_secs(30)
        );
        let d = DecodeConfig::default().with_vars(&get);
        assert_eq!(d.zmq_max_sockets, 20000);
        assert!(d.all_cp_ranks && d.force_query_dp_rank && d.nvlink_intra);
        // sglang's floors: heartbeats at least 2 s apart, at least one failure.
        assert_eq!(d.heartbeat_interval, Duration::from_secs(2));
        assert_eq!(d.heartbeat_max_failures, 1);
        assert_eq!(d.waiting_timeout, Duration::from_secs(40));
        assert_eq!(d.bootstrap_timeout, Duration::from_millis(12_500));
        assert_eq!(d.zmq_send_timeout, Duration::from_secs(3));
        assert_eq!(d.abort_ack_timeout, Duration::from_secs(45));
        assert!(!d.deferred_release && d.staging.mode == StagingMode::On);
        // Defaults are sglang's where sglang has one.
        let none = |_: &str| None;
        let p = PrefillConfig::default().with_vars(&none);
        assert_eq!(p.probe.interval, Duration::from_secs(30));
        assert_eq!(p.zmq_max_sockets, 16384);
        assert_eq!(
            DecodeConfig::default().with_vars(&none).abort_ack_timeout,
            Duration::from_secs(30)
        );
        assert!(!p.nvlink_intra);
        assert_eq!(
            crate::bootstrap::entry_cleanup_interval(&none),
            Duration::from_secs(120)
        );
        // The intra-node transport also follows the protocol name.
        let proto = |n: &str| (n == "MOONCAKE_PROTOCOL").then(|| "nvlink_intra".to_owned());
        assert!(PrefillConfig::default().with_vars(&proto).nvlink_intra);
        let bad = |n: &str| (n == "SGLANG_DISAGGREGATION_QUEUE_SIZE").then(|| "many".to_owned());
        assert_eq!(PrefillConfig::default().with_vars(&bad).queue_size, 4);
    }

    #[test]
    fn config_files_use_seconds() {
        let c: PrefillConfig =
            serde_json::from_str(r#"{"bootstrap_timeout": 1.5, "queue_size": 2}"#).unwrap();
        assert_eq!(c.bootstrap_timeout, Duration::from_millis(1500));
        assert_eq!(c.queue_size, 2);
        assert!(c.deferred_release);
    }

    #[test]
    fn staging_mode_reads_names_and_the_old_flag() {
        let read = |json: &str| serde_json::from_str::<StagingConfig>(json).map(|c| c.mode);
        assert_eq!(read("{}").ok(), Some(StagingMode::Auto));
        assert_eq!(read(r#"{"mode": "on"}"#).ok(), Some(StagingMode::On));
        assert_eq!(read(r#"{"mode": "off"}"#).ok(), Some(StagingMode::Off));
        assert_eq!(read(r#"{"mode": "auto"}"#).ok(), Some(StagingMode::Auto));
        assert_eq!(read(r#"{"enabled": true}"#).ok(), Some(StagingMode::On));
        assert_eq!(read(r#"{"enabled": false}"#).ok(), Some(StagingMode::Off));
        let bad = read(r#"{"mode": "sometimes"}"#)
            .err()
            .map(|e| e.to_string());
        assert!(bad.is_some_and(|e| e.contains("sometimes")));
        // Written back as a name, read back the same.
        let on = StagingConfig {
            mode: StagingMode::On,
            ..StagingConfig::default()
        };
        let text = serde_json::to_string(&on).unwrap_or_default();
        assert!(text.contains(r#""mode":"on""#), "{text}");
        assert_eq!(read(&text).ok(), Some(StagingMode::On));
        // sglang's variable decides when it is set, and only then.
        let none = |_: &str| None;
        assert_eq!(
            StagingConfig::default().with_vars(&none).mode,
            StagingMode::Auto
        );
        let off = |n: &str| (n == "SGLANG_DISAGG_STAGING_BUFFER").then(|| "0".to_owned());
        assert_eq!(
            StagingConfig::default().with_vars(&off).mode,
            StagingMode::Off
        );
    }
}
