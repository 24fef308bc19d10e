//! A harness for fuzzing the prefill and decode inboxes (not a supported
//! API): a bootstrap server, one prefill rank and one decode rank on
//! loopback engines, with live rooms, so that random frame sequences meet
//! real room state. [`InboxHarness::check`] states the invariant: no byte
//! outside the live rooms' own pages changed.

#![doc(hidden)]

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use kvbridge_engine::{LoopbackEngine, TransferEngine};
use kvbridge_wire::{KvPoll, Limits, ToPrefill};

use crate::bootstrap::BootstrapServer;
use crate::config::{DecodeConfig, PrefillConfig};
use crate::decode::{DecodeManager, KvReceiver};
use crate::prefill::PrefillManager;
use crate::synthetic::{ModelSpec, RankPools, RankSpec};

/// Pages per pool; rooms own pages `1..=2 * ROOMS`, the rest are canaries.
const PAGES: u64 = 16;
/// Live rooms, ids `1..=ROOMS`.
const ROOMS: u64 = 3;
/// The canary byte of pages no room owns.
const CANARY: u8 = 0x5c;

/// One prefill and one decode rank with live rooms.
pub struct InboxHarness {
    // Field order is drop order: receivers, then the managers (which
    // deregister), then the pools they registered, then the bootstrap.
    receivers: Vec<KvReceiver>,
    decode: DecodeManager,
    prefill: PrefillManager,
    decode_pools: RankPools,
    _prefill_pools: RankPools,
    _bootstrap: BootstrapServer,
}

impl std::fmt::Debug for InboxHarness {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("InboxHarness").finish_non_exhaustive()
    }
}

fn model() -> ModelSpec {
    ModelSpec {
        name: "fuzz".into(),
        layers: 2,
        kv_heads: 2,
        head_bytes: 16,
        mla: false,
        page_size: 2,
        aux_item_lens: vec![16],
    }
}

fn rank() -> RankSpec {
    RankSpec {
        tp_size: 1,
        tp_rank: 0,
        pp_size: 1,
        pp_rank: 0,
    }
}

impl InboxHarness {
    /// Starts the ranks and opens rooms `1..=3` (pages `2r-1, 2r`, aux slot `r`).
    pub fn new() -> Result<Self, String> {
        let bootstrap = BootstrapServer::start(
            SocketAddr::from(([127, 0, 0, 1], 0)),
            Duration::from_secs(120),
        )
        .map_err(|e| e.to_string())?;
        let prefill_pools =
            RankPools::new(model(), rank(), PAGES, ROOMS + 1).map_err(|e| e.to_string())?;
        let mut decode_pools =
            RankPools::new(model(), rank(), PAGES, ROOMS + 1).map_err(|e| e.to_string())?;
        let canaries: Vec<i32> = (0..PAGES as i32).filter(|p| !owned(*p)).collect();
        decode_pools.poison(&canaries, CANARY);
        let prefill_config = PrefillConfig {
            bootstrap_addr: bootstrap.local_addr().to_string(),
            queue_size: 1,
            thread_pool_size: Some(1),
            ..PrefillConfig::default()
        };
        let engine: Arc<dyn TransferEngine> = Arc::new(LoopbackEngine::new());
        // SAFETY: the pools live in the harness and outlive the managers
        // (field order above drops the managers first).
        let prefill =
            unsafe { PrefillManager::start(prefill_config, prefill_pools.kv_args(), engine) }
                .map_err(|e| e.to_string())?;
        let engine: Arc<dyn TransferEngine> = Arc::new(LoopbackEngine::new());
        // SAFETY: as above.
        let decode = unsafe {
            DecodeManager::start(DecodeConfig::default(), decode_pools.kv_args(), engine)
        }
        .map_err(|e| e.to_string())?;
        let addr = bootstrap.local_addr().to_string();
        let mut receivers = Vec::new();
        for room in 1..=ROOMS {
            let mut rx = decode.receiver(&addr, room);
            let state = rx.init(0);
            if state != KvPoll::WaitingForInput {
                return Err(format!("room {room} did not open: {state}"));
            }
            let p = room as i32 * 2;
            rx.send_metadata(&[p - 1, p], room, &[], None);
            receivers.push(rx);
        }
        Ok(Self {
            receivers,
            decode,
            prefill,
            decode_pools,
            _prefill_pools: prefill_pools,
            _bootstrap: bootstrap,
        })
    }

    /// Applies one message to the decode inbox.
    pub fn feed_decode(&self, frames: &[Vec<u8>]) {
        self.decode.handle_frames(frames);
    }

    /// Applies one message to the prefill inbox, unless it names a peer
    /// that is not on loopback (the harness never sends off this machine).
    pub fn feed_prefill(&self, frames: &[Vec<u8>]) {
        let local = |host: &str| {
            host.parse::<IpAddr>()
                .is_ok_and(|ip| ip.is_loopback() && ip.is_ipv4())
        };
        let allowed = match ToPrefill::decode(frames, &Limits::DEFAULT) {
            Ok(ToPrefill::Register(r)) => {
                local(&r.endpoint) && r.mooncake_session_id.split(':').next().is_some_and(local)
            }
            Ok(ToPrefill::Transfer(t)) => {
                local(&t.endpoint) && t.mooncake_session_id.split(':').next().is_some_and(local)
            }
            Ok(ToPrefill::Abort(a)) => local(&a.decode_ip),
            Ok(_) | Err(_) => true,
        };
        if allowed {
            self.prefill.handle_frames(frames);
        }
    }

    /// Polls every room (as a scheduler would between messages).
    pub fn poll(&mut self) {
        for rx in &mut self.receivers {
            let _ = rx.poll();
        }
    }

    /// The invariant: every page no live room owns is untouched.
    pub fn check(&self) -> Result<(), String> {
        let canaries: Vec<i32> = (0..PAGES as i32).filter(|p| !owned(*p)).collect();
        if self.decode_pools.still_poisoned(&canaries, CANARY) {
            Ok(())
        } else {
            Err("a message wrote a page that no live room owns".into())
        }
    }
}

/// Whether a live room owns `page`.
fn owned(page: i32) -> bool {
    (1..=2 * ROOMS as i32).contains(&page)
}
