//! The rank pair of `bench roles`: one prefill rank and its decode ranks
//! with their pools, and the opening, closing and checking of rooms on its
//! page slots.

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use kvbridge_engine::{Block, ClusterSecret, EngineConfig, TransferEngine, factory};
use kvbridge_roles::bootstrap::{BootstrapConfig, BootstrapServer};
use kvbridge_roles::synthetic::{Placement, RankPools, RankSpec};
use kvbridge_roles::{
    DecodeConfig, DecodeManager, KvPoll, KvReceiver, KvSender, ParallelRank, PrefillConfig,
    PrefillManager, StagingConfig,
};

use super::{DEADLINE, RolesArgs, model};
use kvbridge_lab::rank::EngineKind;

/// One prefill rank and its decode ranks, up and connected.
pub(super) struct Pair {
    // Field order is drop order: managers before the pools they registered.
    prefill: PrefillManager,
    pub(super) decode: Vec<DecodeManager>,
    pub(super) prefill_engine: Arc<dyn TransferEngine>,
    prefill_pools: RankPools,
    decode_pools: Vec<RankPools>,
    bootstrap: BootstrapServer,
    /// Pages one room uses (slot `i`: `i * pages + 1..=(i + 1) * pages`).
    pages: u64,
    /// Per room slot, each decode rank's raw-engine batch: the slot's pages,
    /// as many bytes as a room.
    pub(super) raw_blocks: Vec<Vec<Vec<Block>>>,
}

impl Pair {
    pub(super) fn start(args: &RolesArgs, size: u64) -> Result<Self> {
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
        // Twice the rooms in flight: the next rooms' destinations are sent
        // while the current ones transfer, as a decode preallocates ahead.
        let slots = 2 * u64::from(args.in_flight);
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
            // sglang's variables (worker queues and threads, batch sizes),
            // as a deployment reads them.
            ..PrefillConfig::default().with_env()
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
                ..DecodeConfig::default().with_env()
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
    pub(super) fn room_bytes(&self) -> u64 {
        self.decode_pools
            .iter()
            .map(|p| page_bytes(p) * self.pages)
            .sum()
    }

    /// Room slots (each `pages` pages and an aux slot on every rank).
    pub(super) fn slots(&self) -> u64 {
        self.raw_blocks.len() as u64
    }

    /// Opens room `room` on `slot`: the decode ranks send its destinations
    /// (the prefill's pages are filled with the room's pattern first when
    /// `fill`, else they keep what they hold).
    pub(super) fn open_room(&mut self, room: u64, slot: u64, fill: bool) -> Flying {
        let first = slot * self.pages + 1;
        let pages: Vec<i32> = (first..first + self.pages).map(|p| p as i32).collect();
        let aux = slot + 1;
        if fill {
            self.prefill_pools.fill(room, &pages, aux);
        }
        let addr = self.bootstrap.local_addr().to_string();
        let mut receivers: Vec<KvReceiver> = self
            .decode
            .iter()
            .map(|d| d.receiver(&addr, room))
            .collect();
        for rx in &mut receivers {
            rx.init(0);
            rx.send_metadata(&pages, aux, &[], None);
        }
        let mut sender = self.prefill.sender(room);
        sender.init(pages.len() as u64, Some(aux));
        let done = vec![false; receivers.len()];
        Flying {
            room,
            slot,
            pages,
            receivers,
            sender,
            done,
            sent: None,
        }
    }

    /// Tokens of one room.
    pub(super) fn room_tokens(&self) -> u64 {
        self.pages * self.prefill_pools.model().page_size
    }

    /// Waits for the prefill's Success of a concluded room and clears it on
    /// every rank.
    pub(super) fn close_room(&self, r: &mut Flying, deadline: Instant) -> Result<()> {
        while r.sender.poll() != KvPoll::Success {
            if Instant::now() > deadline {
                bail!("room {}: the prefill never saw its Success", r.room);
            }
            std::thread::sleep(Duration::from_micros(20));
        }
        r.sender.clear();
        for rx in &mut r.receivers {
            rx.clear();
        }
        Ok(())
    }

    /// Moves rooms `first..first + slots()` at once, one per slot, each
    /// filled with its own pattern, and verifies every byte each decode
    /// rank received (untimed); the bytes checked.
    pub(super) fn check(&mut self, first: u64) -> Result<u64> {
        let tokens = self.room_tokens();
        let mut rooms: Vec<Flying> = (0..self.slots())
            .map(|slot| self.open_room(first + slot, slot, true))
            .collect();
        let deadline = Instant::now() + DEADLINE;
        for r in &mut rooms {
            r.wait_destinations(deadline)?;
            r.sender
                .send(&r.pages, None, Some(tokens))
                .context("queueing the room")?;
        }
        for r in &mut rooms {
            while !r.concluded()? {
                if Instant::now() > deadline {
                    bail!("room {} did not conclude within {DEADLINE:?}", r.room);
                }
                std::thread::sleep(Duration::from_micros(50));
            }
        }
        let mut verified = 0;
        for r in &mut rooms {
            self.close_room(r, deadline)?;
            for pools in &self.decode_pools {
                let v = pools.verify(r.room, &r.pages, r.slot + 1);
                if v.mismatched > 0 {
                    bail!(
                        "room {}: {} of {} bytes differ",
                        r.room,
                        v.mismatched,
                        v.bytes
                    );
                }
                verified += v.bytes;
            }
        }
        Ok(verified)
    }
}

/// A room between its opening and its clearing.
pub(super) struct Flying {
    pub(super) room: u64,
    pub(super) slot: u64,
    pub(super) pages: Vec<i32>,
    receivers: Vec<KvReceiver>,
    pub(super) sender: KvSender,
    done: Vec<bool>,
    /// When its pages were handed to the prefill.
    pub(super) sent: Option<Instant>,
}

impl Flying {
    /// Waits until the prefill holds the room's destinations (its sender
    /// waits for input).
    pub(super) fn wait_destinations(&mut self, deadline: Instant) -> Result<()> {
        loop {
            match self.sender.poll() {
                KvPoll::WaitingForInput => return Ok(()),
                KvPoll::Failed => bail!("room {} failed before its send", self.room),
                _ if Instant::now() > deadline => {
                    bail!("room {}: no destination from the decode", self.room)
                }
                _ => std::thread::sleep(Duration::from_micros(20)),
            }
        }
    }

    /// Whether the prefill holds the room's destinations (an error when
    /// the room failed first).
    pub(super) fn destinations_known(&mut self) -> Result<bool> {
        match self.sender.poll() {
            KvPoll::WaitingForInput => Ok(true),
            KvPoll::Failed => bail!("room {} failed before its send", self.room),
            _ => Ok(false),
        }
    }

    /// Polls the decode ranks not yet done; whether all concluded with
    /// Success (an error when one failed).
    pub(super) fn concluded(&mut self) -> Result<bool> {
        for (rx, d) in self.receivers.iter_mut().zip(self.done.iter_mut()) {
            if !*d {
                match rx.poll() {
                    KvPoll::Success => *d = true,
                    KvPoll::Failed => bail!("room {} failed on a decode rank", self.room),
                    _ => {}
                }
            }
        }
        Ok(self.done.iter().all(|d| *d))
    }
}

/// KV bytes per page of one rank's pools.
fn page_bytes(pools: &RankPools) -> u64 {
    pools.kv_args().layout.kv_item_lens.iter().sum()
}
