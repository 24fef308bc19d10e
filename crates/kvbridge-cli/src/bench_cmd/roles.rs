//! `kvbridge bench roles`: what a room costs through the prefill and decode
//! roles against the same bytes through the raw engine, in one run.
//!
//! One process holds a bootstrap server, one prefill rank and one or two
//! decode ranks (real managers: planner, pipeline, control plane), each on
//! its own engine of the chosen transport. Per room size, waves of
//! `--in-flight` rooms (each on its own pages, as a scheduler keeps several
//! requests transferring) alternate with waves of as many raw-engine
//! batches of the same byte count (whole-buffer blocks, the engine's best
//! case). A room is timed from the prefill's `send` of its pages (the
//! decode's destinations already known, as when the forward pass ends) to
//! every decode rank's Success, a wave from its first send to its last
//! Success; the rooms of the first and last waves of each size are verified
//! byte for byte (untimed).

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use clap::Args;
use kvbridge_engine::{Batch, Block, ClusterSecret, EngineConfig, Target, TransferEngine, factory};
use kvbridge_roles::bootstrap::{BootstrapConfig, BootstrapServer};
use kvbridge_roles::synthetic::{ModelSpec, Placement, RankPools, RankSpec};
use kvbridge_roles::{
    DecodeConfig, DecodeManager, KvPoll, KvReceiver, ParallelRank, PrefillConfig, PrefillManager,
    StagingConfig, StagingMode,
};

use super::size::{human, parse_size};
use crate::demo::summary::percentile;
use crate::rank::EngineKind;

/// The model layouts a room can have.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Layout {
    /// Llama-3-8B-shaped MHA/GQA, TP 1 → 1.
    Mha,
    /// DeepSeek-V3-shaped MLA, TP 1 → 1.
    Mla,
    /// Llama-3-8B-shaped MHA, TP 1 → 2 (head slices to two decode ranks).
    Hetero,
}

/// Arguments of `kvbridge bench roles`.
#[derive(Debug, Args)]
pub struct RolesArgs {
    /// The transfer engine every rank uses.
    #[arg(long, value_enum, default_value = "tcp")]
    engine: EngineKind,
    /// Put the KV on this GPU (default: host memory). Needs the `cuda` feature.
    #[arg(long)]
    device: Option<i32>,
    /// Room sizes: KV bytes a room delivers to its decode ranks (K, M, G suffixes).
    #[arg(long, value_delimiter = ',', default_value = "1M,16M,64M,256M", value_parser = parse_size)]
    sizes: Vec<u64>,
    /// The model layout and TP pairing.
    #[arg(long, value_enum, default_value = "mha")]
    layout: Layout,
    /// Rooms per size, in waves alternated with raw-engine waves.
    #[arg(long, default_value_t = 8)]
    rooms: u32,
    /// Rooms transferring at once (and raw batches in flight at once).
    #[arg(long, default_value_t = 4)]
    in_flight: u32,
    /// The roles' staging mode (`on`, `off` or `auto`).
    #[arg(long, value_name = "on|off|auto", default_value = "auto")]
    staging: StagingMode,
    /// One JSON object per room size instead of a table.
    #[arg(long)]
    json: bool,
}

/// Longest pause between two polls of a wave's decode ranks.
const POLL_MAX: Duration = Duration::from_micros(50);

/// Longest one room or raw batch may take.
const DEADLINE: Duration = Duration::from_secs(120);

/// What one room size measured.
#[derive(Debug, serde::Serialize)]
struct SizeReport {
    engine: &'static str,
    layout: &'static str,
    device: Option<i32>,
    room_bytes: u64,
    rooms: u32,
    in_flight: u32,
    roles_gbps: f64,
    engine_gbps: f64,
    ratio: f64,
    p50_ms: f64,
    p99_ms: f64,
    engine_p50_ms: f64,
    verified_bytes: u64,
}

/// Runs `kvbridge bench roles`.
pub fn run(args: RolesArgs) -> Result<()> {
    if args.rooms == 0 || args.in_flight == 0 {
        bail!("--rooms and --in-flight must be at least 1");
    }
    if args.device.is_some() || args.engine == EngineKind::Ipc {
        crate::gpu::require_cuda("--device and --engine ipc")?;
    }
    if !args.json {
        println!(
            "{:>10}  {:>10}  {:>10}  {:>6}  {:>9}  {:>9}",
            "room", "roles GB/s", "engine GB/s", "ratio", "p50 ms", "p99 ms"
        );
    }
    for &size in &args.sizes {
        let report = measure_size(&args, size)?;
        if args.json {
            println!("{}", serde_json::to_string(&report)?);
        } else {
            println!(
                "{:>10}  {:>10.2}  {:>10.2}  {:>6.2}  {:>9.2}  {:>9.2}",
                human(report.room_bytes),
                report.roles_gbps,
                report.engine_gbps,
                report.ratio,
                report.p50_ms,
                report.p99_ms
            );
        }
    }
    Ok(())
}

/// The model of `layout` and the decode TP size.
fn model(layout: Layout) -> (ModelSpec, u64) {
    match layout {
        Layout::Mha => (ModelSpec::llama3_8b(), 1),
        Layout::Mla => (ModelSpec::deepseek_v3(), 1),
        Layout::Hetero => (ModelSpec::llama3_8b(), 2),
    }
}

/// One prefill rank and its decode ranks, up and connected.
struct Pair {
    // Field order is drop order: managers before the pools they registered.
    prefill: PrefillManager,
    decode: Vec<DecodeManager>,
    prefill_engine: Arc<dyn TransferEngine>,
    prefill_pools: RankPools,
    decode_pools: Vec<RankPools>,
    bootstrap: BootstrapServer,
    /// Pages one room uses (slot `i`: `i * pages + 1..=(i + 1) * pages`).
    pages: u64,
    /// Per room slot, each decode rank's raw-engine batch: the slot's pages,
    /// as many bytes as a room.
    raw_blocks: Vec<Vec<Vec<Block>>>,
}

impl Pair {
    fn start(args: &RolesArgs, size: u64) -> Result<Self> {
        let (mut model, decode_tp) = model(args.layout);
        let placement = Placement {
            device: args.device,
            ..Placement::default()
        };
        // Secret mode, as a deployment runs by default.
        let secret = ClusterSecret::generate();
        let bootstrap = BootstrapServer::start_with(
            "127.0.0.1:0".parse()?,
            BootstrapConfig::with_secret(secret.clone()),
        )?;
        // Pages so that the decode ranks together receive `size` bytes.
        let mut probe: u64 = (0..decode_tp)
            .map(|d| {
                RankPools::new(model.clone(), RankSpec::tp(decode_tp, d), 1, 1)
                    .map(|p| page_bytes(&p))
            })
            .sum::<Result<u64, _>>()?;
        // Rooms of a few pages come out at the size asked for with
        // one-token pages (a Llama page of 16 tokens is 2 MiB).
        if size < 4 * probe {
            probe /= model.page_size.max(1);
            model.page_size = 1;
        }
        let pages = size.div_ceil(probe.max(1)).max(1);
        let staging = StagingConfig {
            mode: args.staging,
            pool_bytes: (size * 2).max(64 << 20),
            chunk_tokens: pages * model.page_size,
            ..StagingConfig::default()
        };
        let engine = |kind: EngineKind| -> Result<Arc<dyn TransferEngine>> {
            let transport = match kind {
                EngineKind::Tcp => factory::Transport::Tcp,
                EngineKind::Ipc => factory::Transport::Ipc,
                EngineKind::Ucx => factory::Transport::Ucx,
            };
            let config = EngineConfig {
                listen_host: "127.0.0.1".into(),
                secret: Some(secret.to_env_value()),
                ..EngineConfig::default()
            };
            Ok(factory::build(transport, &config)?)
        };
        let slots = u64::from(args.in_flight);
        let (pool_pages, aux_slots) = (pages * slots + 1, slots + 1);
        let prefill_pools = RankPools::with_placement(
            model.clone(),
            RankSpec::tp(1, 0),
            pool_pages,
            aux_slots,
            placement,
        )?;
        let prefill_engine = engine(args.engine)?;
        let prefill_config = PrefillConfig {
            bootstrap_addr: bootstrap.local_addr().to_string(),
            rank: ParallelRank::default(),
            staging: staging.clone(),
            secret: Some(secret.clone()),
            ..PrefillConfig::default()
        };
        // SAFETY: the pools are fields of `Pair`, dropped after the managers
        // (field order), which deregister them in their teardown.
        let prefill = unsafe {
            PrefillManager::start(
                prefill_config,
                prefill_pools.kv_args(),
                prefill_engine.clone(),
            )
        }
        .context("starting the prefill rank")?;
        let mut decode = Vec::new();
        let mut decode_pools = Vec::new();
        for d in 0..decode_tp {
            let pools = RankPools::with_placement(
                model.clone(),
                RankSpec::tp(decode_tp, d),
                pool_pages,
                aux_slots,
                placement,
            )?;
            let config = DecodeConfig {
                attn_tp_size: decode_tp,
                staging: staging.clone(),
                secret: Some(secret.clone()),
                ..DecodeConfig::default()
            };
            // SAFETY: as for the prefill rank.
            let manager =
                unsafe { DecodeManager::start(config, pools.kv_args(), engine(args.engine)?) }
                    .context("starting a decode rank")?;
            decode.push(manager);
            decode_pools.push(pools);
        }
        // The raw batches, per slot one per decode rank: the slot's pages
        // of each buffer pair, the decode's bytes read from the start of
        // the prefill's first page of the slot.
        let src = prefill_pools.kv_args().layout;
        let raw_blocks = (0..slots)
            .map(|slot| {
                let first = slot * pages + 1;
                decode_pools
                    .iter()
                    .map(|pools| {
                        let dst = pools.kv_args().layout;
                        src.kv_data_ptrs
                            .iter()
                            .zip(&src.kv_item_lens)
                            .zip(dst.kv_data_ptrs.iter().zip(&dst.kv_item_lens))
                            .map(|((&s, &src_item), (&t, &item))| Block {
                                src: s + src_item * first,
                                dst: t + item * first,
                                len: item * pages,
                            })
                            .collect()
                    })
                    .collect()
            })
            .collect();
        Ok(Pair {
            prefill,
            decode,
            prefill_engine,
            prefill_pools,
            decode_pools,
            bootstrap,
            pages,
            raw_blocks,
        })
    }

    /// KV bytes one room delivers to all decode ranks.
    fn room_bytes(&self) -> u64 {
        self.decode_pools
            .iter()
            .map(|p| page_bytes(p) * self.pages)
            .sum()
    }

    /// The pages of room slot `slot`.
    fn slot_pages(&self, slot: u64) -> Vec<i32> {
        let first = slot * self.pages + 1;
        (first..first + self.pages).map(|p| p as i32).collect()
    }

    /// Runs rooms `first..first + count` at once, room `first + i` on slot
    /// `i`; the wave's time (first send to last Success) and each room's.
    fn wave(&mut self, first: u64, count: u64, verify: bool) -> Result<Wave> {
        let addr = self.bootstrap.local_addr().to_string();
        let tokens = self.pages * self.prefill_pools.model().page_size;
        let mut rooms = Vec::new();
        for slot in 0..count {
            let (room, pages) = (first + slot, self.slot_pages(slot));
            self.prefill_pools.fill(room, &pages, slot + 1);
            let mut receivers: Vec<KvReceiver> = self
                .decode
                .iter()
                .map(|d| d.receiver(&addr, room))
                .collect();
            for rx in &mut receivers {
                rx.init(0);
                rx.send_metadata(&pages, slot + 1, &[], None);
            }
            let mut sender = self.prefill.sender(room);
            sender.init(pages.len() as u64, Some(slot + 1));
            rooms.push(Flying {
                room,
                pages,
                receivers,
                sender,
                done: Vec::new(),
                sent: None,
                took: None,
            });
        }
        let deadline = Instant::now() + DEADLINE;
        // The decode's destinations have arrived when a sender waits for input.
        for r in &mut rooms {
            loop {
                match r.sender.poll() {
                    KvPoll::WaitingForInput => break,
                    KvPoll::Failed => bail!("room {} failed before its send", r.room),
                    _ if Instant::now() > deadline => {
                        bail!("room {}: no destination from the decode", r.room)
                    }
                    _ => std::thread::sleep(Duration::from_micros(20)),
                }
            }
        }
        let start = Instant::now();
        for r in &mut rooms {
            r.sender
                .send(&r.pages, None, Some(tokens))
                .context("queueing the room")?;
            r.sent = Some(Instant::now());
            r.done = vec![false; r.receivers.len()];
        }
        // Polls back off to POLL_MAX, as a scheduler between its iterations,
        // so that polling does not take the cores the transfer needs.
        let mut nap = Duration::from_micros(20);
        while rooms.iter().any(|r| r.took.is_none()) {
            for r in rooms.iter_mut().filter(|r| r.took.is_none()) {
                for (rx, d) in r.receivers.iter_mut().zip(r.done.iter_mut()) {
                    if !*d {
                        match rx.poll() {
                            KvPoll::Success => *d = true,
                            KvPoll::Failed => bail!("room {} failed on a decode rank", r.room),
                            _ => {}
                        }
                    }
                }
                if r.done.iter().all(|d| *d) {
                    r.took = r.sent.map(|t| t.elapsed());
                }
            }
            if Instant::now() > deadline {
                bail!("rooms {first}.. did not conclude within {DEADLINE:?}");
            }
            std::thread::sleep(nap);
            nap = (nap * 2).min(POLL_MAX);
        }
        let wall = start.elapsed();
        let mut wave = Wave {
            wall,
            rooms: rooms.iter().filter_map(|r| r.took).collect(),
            verified: 0,
        };
        for r in &mut rooms {
            while r.sender.poll() != KvPoll::Success {
                if Instant::now() > deadline {
                    bail!("room {}: the prefill never saw its Success", r.room);
                }
                std::thread::sleep(Duration::from_micros(20));
            }
            r.sender.clear();
        }
        for (slot, r) in rooms.iter_mut().enumerate() {
            for (rx, pools) in r.receivers.iter_mut().zip(&self.decode_pools) {
                rx.clear();
                if verify {
                    let v = pools.verify(r.room, &r.pages, slot as u64 + 1);
                    if v.mismatched > 0 {
                        bail!(
                            "room {}: {} of {} bytes differ",
                            r.room,
                            v.mismatched,
                            v.bytes
                        );
                    }
                    wave.verified += v.bytes;
                }
            }
        }
        Ok(wave)
    }

    /// The same bytes as a wave of `count` rooms, as whole-buffer blocks
    /// through the raw prefill engine into each decode rank, every batch
    /// in flight at once; per slot, the time to its last batch.
    fn raw(&self, count: u64) -> Result<Wave> {
        let start = Instant::now();
        let mut handles = Vec::new();
        for (slot, blocks) in self.raw_blocks.iter().take(count as usize).enumerate() {
            for (d, b) in self.decode.iter().zip(blocks) {
                let h = self
                    .prefill_engine
                    .submit(Target::any(d.session_id()), Batch::Blocks(b));
                handles.push((slot, h));
            }
        }
        let mut rooms = vec![Duration::ZERO; count as usize];
        for (slot, h) in handles {
            match h.wait_timeout(DEADLINE) {
                Some(r) => r.context("the raw engine batch failed")?,
                None => bail!("the raw engine batch did not finish within {DEADLINE:?}"),
            }
            rooms[slot] = start.elapsed();
        }
        Ok(Wave {
            wall: start.elapsed(),
            rooms,
            verified: 0,
        })
    }
}

/// A room of a wave.
struct Flying {
    room: u64,
    pages: Vec<i32>,
    receivers: Vec<KvReceiver>,
    sender: kvbridge_roles::KvSender,
    done: Vec<bool>,
    sent: Option<Instant>,
    took: Option<Duration>,
}

/// What one wave measured.
struct Wave {
    wall: Duration,
    /// Each room's (or raw slot's) time.
    rooms: Vec<Duration>,
    verified: u64,
}

/// KV bytes per page of one rank's pools.
fn page_bytes(pools: &RankPools) -> u64 {
    pools.kv_args().layout.kv_item_lens.iter().sum()
}

fn measure_size(args: &RolesArgs, size: u64) -> Result<SizeReport> {
    let mut pair = Pair::start(args, size)?;
    let bytes = pair.room_bytes();
    let in_flight = u64::from(args.in_flight);
    // One untimed wave of each: connections, handshakes, first touches.
    pair.wave(1, in_flight, false)?;
    pair.raw(in_flight)?;
    let (mut roles, mut raw) = (Vec::new(), Vec::new());
    let (mut roles_wall, mut raw_wall, mut moved) = (0.0, 0.0, 0u64);
    let mut verified = 0;
    let mut next = 0u64;
    let total = u64::from(args.rooms);
    while next < total {
        let count = in_flight.min(total - next);
        let verify = next == 0 || next + count == total;
        let w = pair.wave(100 + next, count, verify)?;
        verified += w.verified;
        roles_wall += w.wall.as_secs_f64();
        roles.extend(w.rooms.iter().map(Duration::as_secs_f64));
        let r = pair.raw(count)?;
        raw_wall += r.wall.as_secs_f64();
        raw.extend(r.rooms.iter().map(Duration::as_secs_f64));
        moved += count * bytes;
        next += count;
    }
    let roles_gbps = moved as f64 / roles_wall / 1e9;
    let engine_gbps = moved as f64 / raw_wall / 1e9;
    Ok(SizeReport {
        engine: match args.engine {
            EngineKind::Tcp => "tcp",
            EngineKind::Ipc => "ipc",
            EngineKind::Ucx => "ucx",
        },
        layout: match args.layout {
            Layout::Mha => "mha",
            Layout::Mla => "mla",
            Layout::Hetero => "hetero",
        },
        device: args.device,
        room_bytes: bytes,
        rooms: args.rooms,
        in_flight: args.in_flight,
        roles_gbps,
        engine_gbps,
        ratio: roles_gbps / engine_gbps,
        p50_ms: percentile(&roles, 0.5) * 1e3,
        p99_ms: percentile(&roles, 0.99) * 1e3,
        engine_p50_ms: percentile(&raw, 0.5) * 1e3,
        verified_bytes: verified,
    })
}
