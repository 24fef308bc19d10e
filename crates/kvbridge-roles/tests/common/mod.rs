//! A small in-process cluster for role tests: a bootstrap server, prefill
//! and decode managers over TCP engines, host-memory KV pools filled with a
//! recognisable pattern.
#![allow(dead_code)]

pub mod member;
pub mod staged;

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use kvbridge_engine::{
    Batch, BatchHandle, ClusterSecret, EngineConfig, MemError, Region, Target, TcpEngine,
    TransferEngine, TransferError,
};
use kvbridge_mem::HostBuffer;
use kvbridge_plan::PrefillLayout;
use kvbridge_roles::bootstrap::{BootstrapConfig, BootstrapServer};
use kvbridge_roles::{
    DecodeConfig, DecodeManager, KvArgs, KvPoll, ParallelRank, PrefillConfig, PrefillManager,
    StagingConfig,
};

/// KV pools of one rank: `layers` K buffers then `layers` V buffers of
/// `pages` pages of `item` bytes, plus one aux buffer of `aux_slots` slots.
pub struct Pools {
    pub kv: Vec<HostBuffer>,
    pub aux: HostBuffer,
    pub item: u64,
    pub aux_item: u64,
}

impl Pools {
    pub fn new(layers: usize, pages: usize, item: u64, aux_slots: usize, aux_item: u64) -> Self {
        let kv = (0..2 * layers)
            .map(|_| HostBuffer::new(pages * item as usize).expect("alloc"))
            .collect();
        let aux = HostBuffer::new(aux_slots * aux_item as usize).expect("alloc");
        Self {
            kv,
            aux,
            item,
            aux_item,
        }
    }

    pub fn kv_args(&self, page_size: u64, tp_size: u64, tp_rank: u64, heads: u64) -> KvArgs {
        KvArgs {
            layout: PrefillLayout {
                engine_rank: tp_rank,
                attn_tp_size: tp_size,
                page_size,
                kv_head_num: heads,
                kv_data_ptrs: self.kv.iter().map(HostBuffer::addr).collect(),
                kv_item_lens: vec![self.item; self.kv.len()],
                aux_data_ptrs: vec![self.aux.addr()],
                aux_item_lens: vec![self.aux_item],
                ..PrefillLayout::default()
            },
            kv_data_lens: self.kv.iter().map(|b| b.len() as u64).collect(),
            aux_data_lens: vec![self.aux.len() as u64],
            state_data_lens: Vec::new(),
        }
    }

    /// Fills page `page` of every buffer with bytes derived from `(seed, buffer, page)`.
    pub fn fill_page(&mut self, seed: u64, page: usize) {
        let item = self.item as usize;
        for (b, buf) in self.kv.iter_mut().enumerate() {
            for (i, byte) in buf.as_mut_slice()[page * item..(page + 1) * item]
                .iter_mut()
                .enumerate()
            {
                *byte = pattern(seed, b as u64, i as u64);
            }
        }
    }

    pub fn fill_aux(&mut self, seed: u64, slot: usize) {
        let item = self.aux_item as usize;
        for (i, byte) in self.aux.as_mut_slice()[slot * item..(slot + 1) * item]
            .iter_mut()
            .enumerate()
        {
            *byte = pattern(seed, 99, i as u64);
        }
    }

    pub fn page_matches(&self, seed: u64, page: usize) -> bool {
        let item = self.item as usize;
        self.kv.iter().enumerate().all(|(b, buf)| {
            buf.as_slice()[page * item..(page + 1) * item]
                .iter()
                .enumerate()
                .all(|(i, byte)| *byte == pattern(seed, b as u64, i as u64))
        })
    }

    pub fn aux_matches(&self, seed: u64, slot: usize) -> bool {
        let item = self.aux_item as usize;
        self.aux.as_slice()[slot * item..(slot + 1) * item]
            .iter()
            .enumerate()
            .all(|(i, byte)| *byte == pattern(seed, 99, i as u64))
    }
}

pub fn pattern(seed: u64, buffer: u64, i: u64) -> u8 {
    let x = seed
        .wrapping_mul(0x9e37_79b9_7f4a_7c15)
        .wrapping_add(buffer.wrapping_mul(0xbf58_476d_1ce4_e5b9))
        .wrapping_add(i.wrapping_mul(0x94d0_49bb_1331_11eb));
    (x ^ (x >> 29)) as u8
}

/// A TCP engine on `port` (0: any), with short I/O timeouts.
pub fn engine_on(port: u16) -> Arc<dyn TransferEngine> {
    tcp_engine_on(port)
}

/// [`engine_on`], as the TCP engine itself (for its test hooks).
pub fn tcp_engine_on(port: u16) -> Arc<TcpEngine> {
    Arc::new(
        TcpEngine::new(EngineConfig {
            port,
            io_timeout_ms: 2000,
            connect_timeout_ms: 1000,
            ..EngineConfig::default()
        })
        .expect("engine"),
    )
}

/// The port of a TCP engine's session id (`ip:port`).
pub fn session_port(session: &str) -> u16 {
    session
        .rsplit(':')
        .next()
        .and_then(|p| p.parse().ok())
        .expect("session id ends with a port")
}

pub fn tcp_engine() -> Arc<dyn TransferEngine> {
    Arc::new(TcpEngine::new(EngineConfig::default()).expect("tcp engine"))
}

/// A TCP engine whose connections must prove `secret`.
pub fn secret_engine(secret: &ClusterSecret) -> Arc<dyn TransferEngine> {
    Arc::new(
        TcpEngine::new(EngineConfig {
            secret: Some(secret.to_env_value()),
            ..EngineConfig::default()
        })
        .expect("tcp engine"),
    )
}

/// A TCP engine that claims to copy strided runs natively (so prefill
/// workers hand it runs) and counts the runs and copies it was given; it
/// moves them as blocks.
#[derive(Debug)]
pub struct RunsEngine {
    inner: TcpEngine,
    /// Runs and copies handed over as runs.
    pub runs: AtomicU64,
    pub copies: AtomicU64,
}

impl RunsEngine {
    pub fn new() -> Arc<Self> {
        Arc::new(Self {
            inner: TcpEngine::new(EngineConfig::default()).expect("tcp engine"),
            runs: AtomicU64::new(0),
            copies: AtomicU64::new(0),
        })
    }
}

impl TransferEngine for RunsEngine {
    fn session_id(&self) -> &str {
        self.inner.session_id()
    }
    unsafe fn batch_register(&self, regions: &[(u64, u64)]) -> Result<(), MemError> {
        // SAFETY: forwarded caller contract.
        unsafe { self.inner.batch_register(regions) }
    }
    fn batch_deregister(&self, addrs: &[u64]) -> Result<(), MemError> {
        self.inner.batch_deregister(addrs)
    }
    fn submit(&self, target: Target<'_>, batch: Batch<'_>) -> BatchHandle {
        if let Batch::Runs(runs) = batch {
            self.runs.fetch_add(runs.len() as u64, Ordering::Relaxed);
            let copies: u64 = runs.iter().map(|r| r.count).sum();
            self.copies.fetch_add(copies, Ordering::Relaxed);
        }
        // The loopback engine moves the runs' expanded blocks.
        self.inner.submit(target, batch)
    }
    fn incarnation(&self) -> u64 {
        self.inner.incarnation()
    }
    fn copies_runs(&self) -> bool {
        true
    }
    fn probe(&self, session: &str) -> Result<(), TransferError> {
        self.inner.probe(session)
    }
    fn registered_regions(&self) -> Vec<Region> {
        self.inner.registered_regions()
    }
    fn read_local(&self, addr: u64, out: &mut [u8]) -> Result<(), MemError> {
        self.inner.read_local(addr, out)
    }
    fn write_local(&self, addr: u64, data: &[u8]) -> Result<(), MemError> {
        self.inner.write_local(addr, data)
    }
}

pub fn bootstrap() -> BootstrapServer {
    BootstrapServer::start(
        "127.0.0.1:0".parse::<SocketAddr>().unwrap(),
        Duration::from_secs(120),
    )
    .expect("bootstrap server")
}

pub fn prefill_config(addr: SocketAddr, tp_size: u64, tp_rank: u64) -> PrefillConfig {
    PrefillConfig {
        bootstrap_addr: addr.to_string(),
        rank: ParallelRank {
            attn_tp_size: tp_size,
            attn_tp_rank: tp_rank,
            ..ParallelRank::default()
        },
        queue_size: 2,
        thread_pool_size: Some(4),
        ..PrefillConfig::default()
    }
}

pub fn decode_config(tp_size: u64) -> DecodeConfig {
    DecodeConfig {
        attn_tp_size: tp_size,
        heartbeat_interval: Duration::from_millis(300),
        bootstrap_timeout: Duration::from_secs(10),
        waiting_timeout: Duration::from_secs(20),
        ..DecodeConfig::default()
    }
}

pub fn start_prefill(
    config: PrefillConfig,
    args: KvArgs,
    engine: Arc<dyn TransferEngine>,
) -> PrefillManager {
    // SAFETY: the tests keep every pool alive until the manager is torn down.
    unsafe { PrefillManager::start(config, args, engine) }.expect("prefill starts")
}

pub fn start_decode(
    config: DecodeConfig,
    args: KvArgs,
    engine: Arc<dyn TransferEngine>,
) -> DecodeManager {
    // SAFETY: as above.
    unsafe { DecodeManager::start(config, args, engine) }.expect("decode starts")
}

/// Polls `f` until it returns a terminal state or `timeout` passes.
pub fn wait_terminal(timeout: Duration, mut f: impl FnMut() -> KvPoll) -> KvPoll {
    let deadline = Instant::now() + timeout;
    loop {
        let s = f();
        if s.is_terminal() || Instant::now() >= deadline {
            return s;
        }
        std::thread::sleep(Duration::from_millis(2));
    }
}

/// Polls `f` until it returns `want` (or a terminal state) or `timeout` passes.
pub fn wait_for(timeout: Duration, want: KvPoll, mut f: impl FnMut() -> KvPoll) -> KvPoll {
    let deadline = Instant::now() + timeout;
    loop {
        let s = f();
        if s == want || s.is_terminal() || Instant::now() >= deadline {
            return s;
        }
        std::thread::sleep(Duration::from_millis(2));
    }
}

use kvbridge_roles::synthetic::{
    ModelSpec, Placement, RankPools, RankSpec, RequestSlots, Verified,
};

/// A small model for tests: `layers` layers, 8 KV heads (or MLA), tiny heads.
pub fn tiny_model(mla: bool, layers: u64) -> ModelSpec {
    ModelSpec {
        name: "tiny".into(),
        layers,
        kv_heads: 8,
        head_bytes: 64,
        mla,
        page_size: 4,
        aux_item_lens: vec![16, 40],
        ..Default::default()
    }
}

/// The ranks of a test cluster.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Shape {
    pub prefill_tp: u64,
    pub prefill_pp: u64,
    /// Prefill context-parallel ranks (each holds the whole KV).
    pub prefill_cp: u64,
    pub decode_tp: u64,
    /// Decode DCP group size (decode rank `r` holds share `r % decode_cp`).
    pub decode_cp: u64,
    /// Every prefill CP rank sends a share.
    pub all_cp_ranks: bool,
    /// Decode ranks pull from every prefill CP rank (must match the above).
    pub decode_all_cp_ranks: bool,
    /// Prefill DP groups (each TP × CP × PP ranks, one bootstrap server).
    pub prefill_dp: u64,
    /// Rooms go to DP groups by a rule other than the bootstrap room: the
    /// prefill registers each room's DP rank, the decode asks for it.
    pub dp_query: bool,
    /// HiSparse decode ranks (compressed-MLA models): C4 KV in host pages.
    pub hisparse: bool,
}

impl Shape {
    /// TP × PP prefill ranks, TP decode ranks, no context parallelism.
    pub fn new(prefill_tp: u64, prefill_pp: u64, decode_tp: u64) -> Self {
        Self {
            prefill_tp,
            prefill_pp,
            prefill_cp: 1,
            decode_tp,
            decode_cp: 1,
            all_cp_ranks: false,
            decode_all_cp_ranks: false,
            prefill_dp: 1,
            dp_query: false,
            hisparse: false,
        }
    }
}

/// Prefill ranks (DP × PP × CP × TP) and decode ranks (TP) on one bootstrap server.
pub struct Cluster {
    pub bootstrap: BootstrapServer,
    pub prefill: Vec<(PrefillManager, RankPools)>,
    /// The DP group of each prefill rank.
    pub prefill_dp_ranks: Vec<u64>,
    pub decode: Vec<(DecodeManager, RankPools)>,
    pub model: ModelSpec,
    pub shape: Shape,
}

/// Staging per side, and the decode ranks' engine.
pub struct Staged {
    prefill: StagingConfig,
    decode: StagingConfig,
    decode_engine: fn() -> Arc<dyn TransferEngine>,
}

impl Staged {
    /// `prefill` and `decode` staging, the decode ranks on [`tcp_engine`].
    fn sides(prefill: StagingConfig, decode: StagingConfig) -> Self {
        Staged {
            prefill,
            decode,
            decode_engine: tcp_engine,
        }
    }
}

impl Cluster {
    pub fn new(
        model: ModelSpec,
        prefill_tp: u64,
        prefill_pp: u64,
        decode_tp: u64,
        pages: u64,
    ) -> Self {
        Self::with_prefill_engines(model, prefill_tp, prefill_pp, decode_tp, pages, tcp_engine)
    }

    /// [`Cluster::new`] with each prefill rank's engine from `engine`.
    pub fn with_prefill_engines(
        model: ModelSpec,
        prefill_tp: u64,
        prefill_pp: u64,
        decode_tp: u64,
        pages: u64,
        engine: impl Fn() -> Arc<dyn TransferEngine>,
    ) -> Self {
        Self::build(
            model,
            Shape::new(prefill_tp, prefill_pp, decode_tp),
            pages,
            engine,
            None,
            &|a| a,
            None,
        )
    }

    /// A cluster of any [`Shape`].
    pub fn shaped(model: ModelSpec, shape: Shape, pages: u64) -> Self {
        Self::build(model, shape, pages, tcp_engine, None, &|a| a, None)
    }

    /// [`Cluster::new`] with `staging` on every rank.
    pub fn staged(
        model: ModelSpec,
        prefill_tp: u64,
        decode_tp: u64,
        pages: u64,
        staging: StagingConfig,
    ) -> Self {
        Self::staged_with(model, prefill_tp, decode_tp, pages, staging, &|a| a)
    }

    /// [`Cluster::staged`] with each decode rank's `KvArgs` passed through
    /// `decode_args` before its manager starts.
    pub fn staged_with(
        model: ModelSpec,
        prefill_tp: u64,
        decode_tp: u64,
        pages: u64,
        staging: StagingConfig,
        decode_args: &dyn Fn(KvArgs) -> KvArgs,
    ) -> Self {
        let both = Some(Staged::sides(staging.clone(), staging));
        Self::build(
            model,
            Shape::new(prefill_tp, 1, decode_tp),
            pages,
            tcp_engine,
            both,
            decode_args,
            None,
        )
    }

    /// [`Cluster::staged`] with every rank on an engine made by `engine`.
    pub fn staged_on(
        model: ModelSpec,
        prefill_tp: u64,
        decode_tp: u64,
        pages: u64,
        staging: StagingConfig,
        engine: fn() -> Arc<dyn TransferEngine>,
    ) -> Self {
        let staged = Staged {
            decode_engine: engine,
            ..Staged::sides(staging.clone(), staging)
        };
        Self::build(
            model,
            Shape::new(prefill_tp, 1, decode_tp),
            pages,
            engine,
            Some(staged),
            &|a| a,
            None,
        )
    }

    /// [`Cluster::new`] with `prefill` staging on the prefill ranks and
    /// `decode` on the decode ranks.
    pub fn staged_per_side(
        model: ModelSpec,
        prefill_tp: u64,
        decode_tp: u64,
        pages: u64,
        prefill: StagingConfig,
        decode: StagingConfig,
    ) -> Self {
        let sides = Some(Staged::sides(prefill, decode));
        Self::build(
            model,
            Shape::new(prefill_tp, 1, decode_tp),
            pages,
            tcp_engine,
            sides,
            &|a| a,
            None,
        )
    }

    /// [`Cluster::new`] (one stage) in secret mode: engines, control plane
    /// and bootstrap all guarded by `secret`.
    pub fn secret(
        model: ModelSpec,
        prefill_tp: u64,
        decode_tp: u64,
        pages: u64,
        secret: &ClusterSecret,
    ) -> Self {
        Self::build(
            model,
            Shape::new(prefill_tp, 1, decode_tp),
            pages,
            tcp_engine,
            None,
            &|a| a,
            Some(secret),
        )
    }

    /// [`Cluster::staged`] in secret mode: engines, control plane and
    /// bootstrap all guarded by `secret`.
    pub fn staged_secret(
        model: ModelSpec,
        prefill_tp: u64,
        decode_tp: u64,
        pages: u64,
        staging: StagingConfig,
        secret: &ClusterSecret,
    ) -> Self {
        Self::build(
            model,
            Shape::new(prefill_tp, 1, decode_tp),
            pages,
            tcp_engine,
            Some(Staged::sides(staging.clone(), staging)),
            &|a| a,
            Some(secret),
        )
    }

    fn build(
        model: ModelSpec,
        shape: Shape,
        pages: u64,
        engine: impl Fn() -> Arc<dyn TransferEngine>,
        staging: Option<Staged>,
        decode_args: &dyn Fn(KvArgs) -> KvArgs,
        secret: Option<&ClusterSecret>,
    ) -> Self {
        let Shape {
            prefill_tp,
            prefill_pp,
            prefill_cp,
            decode_tp,
            decode_cp,
            all_cp_ranks,
            decode_all_cp_ranks,
            prefill_dp,
            dp_query,
            hisparse,
        } = shape;
        let bootstrap = match secret {
            None => bootstrap(),
            Some(s) => BootstrapServer::start_with(
                "127.0.0.1:0".parse::<SocketAddr>().unwrap(),
                BootstrapConfig::with_secret(s.clone()),
            )
            .expect("bootstrap server"),
        };
        // Secret mode: every engine proves the secret, every rank signs
        // and encrypts with it.
        let engine = || secret.map_or_else(&engine, secret_engine);
        // Positional PP pairing (no layer ids, as sglang's plain pools)
        // needs equal stages of plain layers; an uneven split, a hybrid
        // model or a staged draft pairs by layer id on both sides.
        let by_ids = !model.layers.is_multiple_of(prefill_pp)
            || model.full_attention_interval > 1
            || (model.draft_layers > 0 && prefill_pp > 1);
        let kv_args = |pools: &RankPools| {
            if by_ids {
                pools.kv_args_with_layer_ids()
            } else {
                pools.kv_args()
            }
        };
        let mut prefill = Vec::new();
        let mut prefill_dp_ranks = Vec::new();
        for (dp, pp) in (0..prefill_dp).flat_map(|d| (0..prefill_pp).map(move |p| (d, p))) {
            // Every CP rank holds the whole KV of its TP slice.
            for (cp, tp) in (0..prefill_cp).flat_map(|c| (0..prefill_tp).map(move |t| (c, t))) {
                let rank = RankSpec {
                    tp_size: prefill_tp,
                    tp_rank: tp,
                    pp_size: prefill_pp,
                    pp_rank: pp,
                    ..Default::default()
                };
                let pools = RankPools::new(model.clone(), rank, pages, 8).expect("pools");
                let mut config = prefill_config(bootstrap.local_addr(), prefill_tp, tp);
                config.rank.pp_size = prefill_pp;
                config.rank.pp_rank = pp;
                config.rank.attn_cp_size = prefill_cp;
                config.rank.attn_cp_rank = cp;
                config.all_cp_ranks = all_cp_ranks;
                config.rank.attn_dp_size = prefill_dp;
                config.rank.attn_dp_rank = dp;
                if dp_query {
                    config.load_balance_method = "round_robin".into();
                }
                prefill_dp_ranks.push(dp);
                if let Some(st) = &staging {
                    config.staging = st.prefill.clone();
                }
                config.secret = secret.cloned();
                let manager = start_prefill(config, kv_args(&pools), engine());
                prefill.push((manager, pools));
            }
        }
        let mut decode = Vec::new();
        for tp in 0..decode_tp {
            let rank = RankSpec {
                tp_size: decode_tp,
                tp_rank: tp,
                dcp_size: decode_cp,
                dcp_rank: tp % decode_cp,
                ..Default::default()
            };
            let placement = Placement {
                hisparse,
                ..Placement::default()
            };
            let pools =
                RankPools::with_placement(model.clone(), rank, pages, 8, placement).expect("pools");
            let mut config = decode_config(decode_tp);
            config.all_cp_ranks = decode_all_cp_ranks;
            if let Some(st) = &staging {
                config.staging = st.decode.clone();
            }
            config.secret = secret.cloned();
            let decode_engine = staging
                .as_ref()
                .map_or(tcp_engine as fn() -> _, |st| st.decode_engine);
            let engine = secret.map_or_else(decode_engine, secret_engine);
            let manager = start_decode(config, decode_args(kv_args(&pools)), engine);
            decode.push((manager, pools));
        }
        Self {
            bootstrap,
            prefill,
            prefill_dp_ranks,
            decode,
            model,
            shape,
        }
    }

    /// Runs one request end to end: `src` source pages on every prefill
    /// rank, `dst` destination pages on every decode rank (whole pages of
    /// tokens), sent in chunks of `chunk` pages. Returns each decode rank's
    /// verification.
    pub fn run(
        &mut self,
        room: u64,
        src: &[i32],
        dst: &[i32],
        chunk: usize,
    ) -> Vec<(KvPoll, Verified)> {
        let tokens = src.len() as u64 * self.model.page_size;
        self.run_tokens(room, tokens, src, dst, chunk)
    }

    /// [`Cluster::run`] for a request of `tokens` tokens: states travel on
    /// the last chunk, each chunk says how many tokens it holds, and each
    /// decode rank takes as many of `dst` as it needs (a DCP rank fewer).
    pub fn run_tokens(
        &mut self,
        room: u64,
        tokens: u64,
        src: &[i32],
        dst: &[i32],
        chunk: usize,
    ) -> Vec<(KvPoll, Verified)> {
        let addr = self.bootstrap.local_addr().to_string();
        // The DP group the room is dispatched to: by the bootstrap room, or
        // (routing that does not follow it) by a rule the decode cannot
        // know, so it must ask the bootstrap server.
        let dp_size = self.shape.prefill_dp;
        let dp = if self.shape.dp_query {
            (room / 7) % dp_size
        } else {
            room % dp_size
        };
        let src_req = RequestSlots {
            tokens,
            pages: src.to_vec(),
            slot: 1,
        };
        // Prefill senders first: with DP they register the room's DP rank.
        let mut senders = Vec::new();
        for ((manager, pools), group) in self.prefill.iter_mut().zip(&self.prefill_dp_ranks) {
            if *group != dp {
                continue;
            }
            pools.fill_request(room, &src_req);
            let states = pools.state_indices(&src_req);
            let mut tx = manager.sender(room);
            tx.init(src.len() as u64, Some(1));
            senders.push((tx, states));
        }
        let mut receivers = Vec::new();
        for (manager, pools) in &self.decode {
            let n = pools.pages_for(tokens) as usize;
            let req = RequestSlots {
                tokens,
                pages: dst[..n].to_vec(),
                slot: 3,
            };
            let states = pools.dst_state_indices(&req);
            let mut rx = manager.receiver(&addr, room);
            let deadline = std::time::Instant::now() + Duration::from_secs(10);
            let routed = loop {
                if let Some(d) = rx.prefill_dp_rank(None) {
                    break d;
                }
                assert!(
                    std::time::Instant::now() < deadline,
                    "room {room}: no DP rank"
                );
                std::thread::sleep(Duration::from_millis(5));
            };
            assert_eq!(
                routed, dp,
                "room {room}: decode routed to the wrong DP rank"
            );
            assert_eq!(
                rx.init(routed),
                KvPoll::WaitingForInput,
                "room {room}: decode init"
            );
            match pools.hisparse_host_pages(&req.pages) {
                Some(host) => rx.send_metadata_hisparse(&host, &req.pages, req.slot, &states, None),
                None => rx.send_metadata(&req.pages, req.slot, &states, None),
            };
            receivers.push((rx, req));
        }
        for (tx, _) in &mut senders {
            let s = wait_for(Duration::from_secs(20), KvPoll::WaitingForInput, || {
                tx.poll()
            });
            assert!(
                s >= KvPoll::WaitingForInput,
                "room {room}: prefill stuck in {s:?}"
            );
        }
        let ps = self.model.page_size;
        let mut sent = 0;
        for pages in src.chunks(chunk) {
            let n = (pages.len() as u64 * ps).min(tokens - sent);
            sent += n;
            for (tx, states) in &mut senders {
                let states = Some(states.iter().cloned().map(Some).collect());
                tx.send(pages, states, Some(n)).expect("send");
            }
        }
        for (tx, _) in &mut senders {
            let s = wait_terminal(Duration::from_secs(20), || tx.poll());
            assert_eq!(s, KvPoll::Success, "room {room}: prefill ended {s:?}");
            tx.clear();
        }
        let mut out = Vec::new();
        for ((rx, req), (_, pools)) in receivers.iter_mut().zip(&self.decode) {
            let s = wait_terminal(Duration::from_secs(20), || rx.poll());
            out.push((s, pools.verify_request(room, req)));
            rx.clear();
        }
        out
    }

    pub fn shutdown(self) {
        for (m, _) in self.prefill {
            m.teardown();
        }
        for (m, _) in self.decode {
            m.teardown();
        }
        self.bootstrap.shutdown();
    }
}

/// A plain zmq PUSH socket (no secret) to a rank's control port, as a
/// rogue host would open one.
pub fn rogue_socket(port: u16) -> (zmq::Context, zmq::Socket) {
    let ctx = zmq::Context::new();
    let sock = ctx.socket(zmq::PUSH).expect("zmq socket");
    sock.set_linger(1000).expect("linger");
    sock.connect(&format!("tcp://127.0.0.1:{port}"))
        .expect("connect");
    (ctx, sock)
}

/// The one rank of a TP 1, PP 1 server.
pub const SINGLE_RANK: RankSpec = RankSpec::SINGLE;
