//! A harness for fuzzing the prefill and decode inboxes (not a supported
//! API): a bootstrap server, two prefill ranks (TP 2) and one decode rank
//! (TP 1) on loopback engines, with live rooms that receive through the
//! decode's staging ring, so that random frame sequences (staging requests
//! and chunk notices included) meet real room state.
//! [`InboxHarness::check`] states the invariant: no byte outside the live
//! rooms' own pages changed. [`InboxHarness::secret`] runs the ranks in
//! secret mode, as a cluster member (who holds the secret) would meet them:
//! there no staging chunk may be scattered at all, since no prefill rank of
//! the rooms sends one.

#![doc(hidden)]

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use kvbridge_engine::{ClusterSecret, LoopbackEngine, TransferEngine};
use kvbridge_wire::{KvPoll, Limits, ToPrefill};

use crate::bootstrap::{BootstrapConfig, BootstrapServer};
use crate::config::{DecodeConfig, ParallelRank, PrefillConfig, StagingConfig, StagingMode};
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
    prefill: Vec<PrefillManager>,
    decode_pools: RankPools,
    _prefill_pools: Vec<RankPools>,
    _bootstrap: BootstrapServer,
    secret_mode: bool,
    /// Whether any room polled Success.
    concluded: bool,
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
        ..Default::default()
    }
}

/// Staging on both sides, with a ring small enough to wrap.
fn staging() -> StagingConfig {
    StagingConfig {
        mode: StagingMode::On,
        pool_bytes: 16 << 10,
        chunk_tokens: 2,
        buffer_bytes: 0,
        wait_timeout: Duration::from_secs(5),
    }
}

impl InboxHarness {
    /// Starts the ranks and opens rooms `1..=3` (pages `2r-1, 2r`, aux slot `r`).
    pub fn new() -> Result<Self, String> {
        Self::start(None)
    }

    /// [`InboxHarness::new`] in secret mode (every rank and the bootstrap
    /// server guarded by one secret).
    pub fn secret() -> Result<Self, String> {
        let secret = ClusterSecret::from_text("kvbridge-inbox-harness-secret", "fuzz harness")
            .map_err(|e| e.to_string())?;
        Self::start(Some(secret))
    }

    fn start(secret: Option<ClusterSecret>) -> Result<Self, String> {
        let config = BootstrapConfig {
            secret: secret.clone(),
            ..BootstrapConfig::open(Duration::from_secs(120))
        };
        let bootstrap = BootstrapServer::start_with(SocketAddr::from(([127, 0, 0, 1], 0)), config)
            .map_err(|e| e.to_string())?;
        let mut decode_pools = RankPools::new(model(), RankSpec::tp(1, 0), PAGES, ROOMS + 1)
            .map_err(|e| e.to_string())?;
        // Secret mode: no message of the harness is sent by a rank of the
        // rooms, so not even the rooms' own pages and aux slots may change.
        let canaries: Vec<i32> = (0..PAGES as i32)
            .filter(|p| secret.is_some() || !owned(*p))
            .collect();
        decode_pools.poison(&canaries, CANARY);
        if secret.is_some() {
            for slot in 1..=ROOMS {
                decode_pools.poison_aux(slot, CANARY);
            }
        }
        let mut prefill = Vec::new();
        let mut prefill_pools = Vec::new();
        for tp in 0..2 {
            let pools = RankPools::new(model(), RankSpec::tp(2, tp), PAGES, ROOMS + 1)
                .map_err(|e| e.to_string())?;
            let config = PrefillConfig {
                bootstrap_addr: bootstrap.local_addr().to_string(),
                queue_size: 1,
                thread_pool_size: Some(1),
                rank: ParallelRank {
                    attn_tp_size: 2,
                    attn_tp_rank: tp,
                    ..ParallelRank::default()
                },
                staging: staging(),
                secret: secret.clone(),
                ..PrefillConfig::default()
            };
            let engine: Arc<dyn TransferEngine> = Arc::new(LoopbackEngine::new());
            // SAFETY: the pools live in the harness and outlive the managers
            // (field order above drops the managers first).
            let manager = unsafe { PrefillManager::start(config, pools.kv_args(), engine) }
                .map_err(|e| e.to_string())?;
            prefill.push(manager);
            prefill_pools.push(pools);
        }
        let engine: Arc<dyn TransferEngine> = Arc::new(LoopbackEngine::new());
        let decode_config = DecodeConfig {
            staging: staging(),
            secret: secret.clone(),
            ..DecodeConfig::default()
        };
        // SAFETY: as above.
        let decode = unsafe { DecodeManager::start(decode_config, decode_pools.kv_args(), engine) }
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
            secret_mode: secret.is_some(),
            concluded: false,
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
        if allowed && let Some(prefill) = self.prefill.first() {
            prefill.handle_frames(frames);
        }
    }

    /// Polls every room (as a scheduler would between messages).
    pub fn poll(&mut self) {
        for rx in &mut self.receivers {
            if rx.poll() == KvPoll::Success {
                self.concluded = true;
            }
        }
    }

    /// Staging ring allocations the decode holds.
    pub fn staging_allocations(&self) -> usize {
        self.decode.staging_allocations().unwrap_or(0)
    }

    /// The decode rank's engine session (what staging messages name).
    pub fn decode_session(&self) -> &str {
        self.decode.session_id()
    }

    /// Messages of `kind` dropped so far by the decode and prefill ranks.
    pub fn dropped(&self, kind: &str) -> u64 {
        self.prefill
            .iter()
            .map(|p| p.metrics().dropped_for(kind))
            .sum::<u64>()
            + self.decode.metrics().dropped_for(kind)
    }

    /// The invariant: every page no live room owns is untouched; in secret
    /// mode (where no rank of the rooms sends anything), also the rooms' own
    /// pages and aux slots, no staging chunk was scattered and no room
    /// concluded Success.
    pub fn check(&self) -> Result<(), String> {
        let canaries: Vec<i32> = (0..PAGES as i32).filter(|p| !owned(*p)).collect();
        if !self.decode_pools.still_poisoned(&canaries, CANARY) {
            return Err("a message wrote a page that no live room owns".into());
        }
        if self.secret_mode {
            let rooms: Vec<i32> = (0..PAGES as i32).filter(|p| owned(*p)).collect();
            if !self.decode_pools.still_poisoned(&rooms, CANARY)
                || !(1..=ROOMS).all(|slot| self.decode_pools.aux_still_poisoned(slot, CANARY))
            {
                return Err(
                    "a message no rank of the rooms sent wrote a room's page or aux".into(),
                );
            }
            if self.concluded {
                return Err("a room concluded Success though no rank of it sent a status".into());
            }
        }
        let scattered = self.decode.metrics().staged_bytes.get();
        if self.secret_mode && scattered > 0 {
            return Err(format!(
                "{scattered} bytes scattered from the staging ring, though no prefill rank of the \
                 rooms sent a chunk"
            ));
        }
        Ok(())
    }
}

/// Whether a live room owns `page`.
fn owned(page: i32) -> bool {
    (1..=2 * ROOMS as i32).contains(&page)
}
