//! The decode role: registers its KV memory, finds prefill ranks through
//! their bootstrap servers, tells them where each room's KV goes, and
//! applies the status, aux and state messages they send back (sglang
//! `MooncakeKVManager` in DECODE mode).

mod bound;
mod dp_route;
mod heartbeat;
mod inbox;
mod metadata;
mod receiver;
mod ring;
mod room;
mod slots;
mod staging;
pub(crate) mod state;
pub mod topology;

use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use std::time::Duration;

use kvbridge_engine::TransferEngine;
use parking_lot::Mutex;

use crate::config::DecodeConfig;
use crate::control::PushPool;
use crate::error::{ConfigError, StartError};
use crate::kv_args::KvArgs;
use crate::metrics::Metrics;
use crate::role::{self, Lifecycle};
use crate::stop::StopSignal;

pub use receiver::KvReceiver;
use room::DecodeRooms;
use state::Prefills;
pub use state::{BootstrapInfo, PrefillSummary};

/// State shared by the decode manager's threads and its receivers.
#[derive(Debug)]
pub(crate) struct Shared {
    pub config: DecodeConfig,
    pub kv_args: KvArgs,
    pub engine: Arc<dyn TransferEngine>,
    pub rooms: Mutex<DecodeRooms>,
    pub prefills: Mutex<Prefills>,
    pub push: PushPool,
    pub metrics: Arc<Metrics>,
    pub stopped: AtomicBool,
    pub stop_signal: StopSignal,
    pub rank_port: u16,
    pub http: ureq::Agent,
    /// Our buffers for local writes (`AUX_DATA`, `STATE_DATA`), and what
    /// the engine has registered.
    pub local: crate::local::LocalMemory,
    /// The staging ring, when staging is on.
    pub staging: Option<staging::DecodeStaging>,
    /// Pair keys for binding staging messages (secret mode only).
    pub pair_keys: Option<crate::seal::PairKeys>,
}

impl Shared {
    /// Applies `input` to the rooms under their lock: the one place the
    /// decode side changes a room outside the staging ring. An ACK that
    /// lifts a fence unfences its engine session before the lock is
    /// released, so a fence set meanwhile for the session is not lifted.
    pub fn step(&self, input: room::Input<'_>) -> room::Output {
        let mut rooms = self.rooms.lock();
        let output = rooms.handle(input);
        if let room::Output::Ack {
            unfence: Some(session),
            ..
        } = &output
        {
            self.engine.unfence_peer(session);
            tracing::info!(%session, "fenced prefill rank acknowledged its aborts; fence lifted");
        }
        output
    }

    /// The pair key of the prefill rank at `endpoint` (secret mode).
    pub fn pair_key(&self, endpoint: &str) -> Option<kvbridge_wire::PairKey> {
        self.pair_keys.as_ref().map(|k| k.for_prefill(endpoint))
    }

    /// Sends `frames` to the prefill rank at `endpoint`, sealed with its
    /// pair key in secret mode.
    pub fn send_sealed(
        &self,
        endpoint: &str,
        frames: kvbridge_wire::Frames<'_>,
    ) -> Result<(), crate::control::ControlError> {
        let frames = crate::seal::seal(self.pair_key(endpoint).as_ref(), frames);
        self.push.send(endpoint, frames.iter().map(|f| f.as_ref()))
    }
}

impl Shared {
    /// Fails every live room of a prefill server whose bootstrap server
    /// stopped answering. Losing the bootstrap is no evidence that the
    /// prefill ranks are dead: each failed room's receiver still sends
    /// ABORT to its ranks on its next poll and its pages stay pinned until
    /// they acknowledge (see `docs/security.md`).
    pub fn fail_prefill(&self, addr: &str) {
        {
            let mut prefills = self.prefills.lock();
            prefills.mapping.remove(addr);
            prefills.sizes.remove(addr);
            prefills.servers.remove(addr);
            prefills.heartbeat_failures.remove(addr);
            let prefix = format!("{addr}_");
            prefills.pool.retain(|k, _| !k.starts_with(&prefix));
        }
        let reason = format!("Lost connection with prefill instance (bootstrap_addr: {addr})");
        let affected = match self.step(room::Input::ServerLost { addr, reason }) {
            room::Output::Failed(n) => n,
            _ => 0,
        };
        self.metrics.failure("prefill_lost");
        tracing::error!(%addr, affected, "lost connection with prefill instance");
    }
}

/// A running decode role.
pub struct DecodeManager {
    shared: Arc<Shared>,
    /// The threads and what they run on; `None` once torn down.
    lifecycle: Option<Lifecycle>,
}

impl std::fmt::Debug for DecodeManager {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DecodeManager")
            .field("session", &self.shared.engine.session_id())
            .field("rank_port", &self.shared.rank_port)
            .finish_non_exhaustive()
    }
}

impl DecodeManager {
    /// Registers `kv_args`' buffers with `engine`, binds the zmq socket and
    /// starts the receive and heartbeat threads. A `kv_head_num` of 0 in
    /// `kv_args` means the head counts are not known yet (sglang's decode
    /// sets them later): see [`DecodeManager::set_kv_heads`].
    ///
    /// # Safety
    /// Every buffer `kv_args` names must stay valid until
    /// [`DecodeManager::teardown`] returns (or the manager is dropped), as
    /// for [`TransferEngine::batch_register`]; prefill ranks write into them.
    pub unsafe fn start(
        config: DecodeConfig,
        kv_args: KvArgs,
        engine: Arc<dyn TransferEngine>,
    ) -> Result<Self, StartError> {
        // SAFETY: the caller promises the buffers outlive the manager; the
        // manager deregisters them in `teardown` (a failed start at once).
        let intra = config.nvlink_intra || !engine.moves_host_memory();
        let staging =
            staging::DecodeStaging::new(&config.staging, &kv_args, intra, engine.as_ref())?;
        let extra: Vec<(u64, u64)> = staging.iter().map(staging::DecodeStaging::region).collect();
        // SAFETY: as above; the staging ring lives in `Shared`, which
        // outlives the registration (released by the lifecycle first).
        let (local, registration) =
            unsafe { role::register_memory(&kv_args, &engine, config.nvlink_intra, &extra)? };
        let (mut lifecycle, stop_signal) =
            Lifecycle::new("decode", registration, config.secret.as_ref())?;
        let pull = lifecycle.bind_inbox(
            &config.local_ip,
            config.control_port,
            config.zmq_max_message_bytes,
        )?;
        let metrics = lifecycle.serve_metrics(config.metrics_addr)?;
        let pair_keys = config
            .secret
            .is_some()
            .then(crate::seal::PairKeys::generate);
        let shared = Arc::new(Shared {
            push: PushPool::capped(
                lifecycle.context(),
                config.zmq_send_timeout,
                config.zmq_max_sockets,
            ),
            rank_port: pull.port(),
            http: crate::http::agent(Duration::from_secs(5)),
            config,
            kv_args,
            engine,
            rooms: Mutex::new(DecodeRooms::default()),
            prefills: Mutex::new(Prefills::default()),
            metrics,
            stopped: AtomicBool::new(false),
            stop_signal,
            local,
            staging,
            pair_keys,
        });
        let s = shared.clone();
        let started = lifecycle
            .spawn("kvb-decode-inbox".into(), move || inbox::run(&s, pull))
            .and_then(|()| {
                let s = shared.clone();
                lifecycle.spawn("kvb-decode-heartbeat".into(), move || heartbeat::run(&s))
            });
        let manager = Self {
            shared,
            lifecycle: Some(lifecycle),
        };
        // A failure drops the manager, which tears down what started.
        started?;
        Ok(manager)
    }

    /// A receiver for one room whose KV comes from the prefill server whose
    /// bootstrap server is `bootstrap_addr` (`host:port`).
    pub fn receiver(&self, bootstrap_addr: &str, room: u64) -> KvReceiver {
        KvReceiver::new(self.shared.clone(), bootstrap_addr.to_owned(), room)
    }

    /// The port of this rank's zmq socket.
    pub fn rank_port(&self) -> u16 {
        self.shared.rank_port
    }

    /// One attempt (never a retry loop) to resolve the prefill server whose
    /// bootstrap server is `bootstrap_addr` (sglang's
    /// `try_ensure_parallel_info`): `Ok(true)` once resolved (cached),
    /// `Ok(false)` while it is not yet registered or unreachable, `Err`
    /// when its topology can never pair with ours.
    pub fn try_ensure_parallel_info(&self, bootstrap_addr: &str) -> Result<bool, String> {
        match receiver::ensure_parallel_info(&self.shared, bootstrap_addr) {
            receiver::Fetch::Ready(_) => Ok(true),
            receiver::Fetch::Retry(reason) => {
                tracing::debug!(%bootstrap_addr, %reason, "prefill server not resolved yet");
                Ok(false)
            }
            receiver::Fetch::Fatal(reason) => Err(reason),
        }
    }

    /// What is known of a resolved prefill server (`None` until
    /// [`DecodeManager::try_ensure_parallel_info`] or a receiver resolved it).
    pub fn prefill_summary(&self, bootstrap_addr: &str) -> Option<PrefillSummary> {
        self.shared
            .prefills
            .lock()
            .servers
            .get(bootstrap_addr)
            .copied()
    }

    /// Applies one control message as if it had arrived on this rank's
    /// socket (for fuzzing the inbox; not part of the supported API).
    #[doc(hidden)]
    pub fn handle_frames(&self, frames: &[Vec<u8>]) {
        let mut batch = inbox::StateBatch::default();
        inbox::handle(&self.shared, frames, &mut batch);
        batch.flush(&self.shared);
    }

    /// Hands over the KV head counts after start (sglang's decode sets
    /// `KVArgs.kv_head_num` / `total_kv_head_num` only after creating the
    /// manager, for staging): `total_kv_head_num` 0 means unknown
    /// (`kv_head_num` × TP). Only staging uses them; without a staging ring
    /// (staging off, MLA, intra-node) they are accepted and unused. Prefill
    /// servers registered with before this keep the per-slice path.
    pub fn set_kv_heads(
        &self,
        kv_head_num: u64,
        total_kv_head_num: u64,
    ) -> Result<(), ConfigError> {
        match &self.shared.staging {
            Some(staging) => {
                staging.set_heads(&self.shared.kv_args.layout, kv_head_num, total_kv_head_num)
            }
            None => {
                staging::check_heads(kv_head_num, total_kv_head_num)?;
                tracing::debug!(
                    kv_head_num,
                    total_kv_head_num,
                    "KV head counts unused: no staging ring"
                );
                Ok(())
            }
        }
    }

    /// The staging ring's `(address, length)` in our memory, when staging is on.
    pub fn staging_ring(&self) -> Option<(u64, u64)> {
        self.shared
            .staging
            .as_ref()
            .map(staging::DecodeStaging::region)
    }

    /// Calls `hook` with the room before each staging scatter copies, or
    /// no longer with `None` (for tests that hold a scatter in progress;
    /// not part of the supported API). No-op without a staging ring.
    #[doc(hidden)]
    pub fn set_scatter_hook(&self, hook: Option<Arc<dyn Fn(u64) + Send + Sync>>) {
        if let Some(staging) = &self.shared.staging {
            staging.set_scatter_hook(hook.map(staging::ScatterHook));
        }
    }

    /// Staging ring allocations held (`None` without a ring): zero once
    /// every chunk was scattered or its room cleared.
    pub fn staging_allocations(&self) -> Option<usize> {
        self.shared
            .staging
            .as_ref()
            .map(staging::DecodeStaging::held)
    }

    /// The incarnation of the transfer engine this rank registered with.
    pub fn engine_incarnation(&self) -> u64 {
        self.shared.engine.incarnation()
    }

    /// The transfer engine's session id.
    pub fn session_id(&self) -> &str {
        self.shared.engine.session_id()
    }

    /// This rank's metrics.
    pub fn metrics(&self) -> &Arc<Metrics> {
        &self.shared.metrics
    }

    /// Where the metrics endpoint listens, when enabled.
    pub fn metrics_addr(&self) -> Option<std::net::SocketAddr> {
        self.lifecycle.as_ref().and_then(Lifecycle::metrics_addr)
    }

    /// Stops every thread, closes every socket and deregisters memory.
    pub fn teardown(mut self) {
        self.stop();
    }

    fn stop(&mut self) {
        let Some(lifecycle) = self.lifecycle.take() else {
            return;
        };
        lifecycle.shut_down(&self.shared.stopped, &self.shared.push, || {});
        tracing::info!("decode manager torn down");
    }
}

impl Drop for DecodeManager {
    fn drop(&mut self) {
        self.stop();
    }
}
