//! The decode role: registers its KV memory, finds prefill ranks through
//! their bootstrap servers, tells them where each room's KV goes, and
//! applies the status, aux and state messages they send back (sglang
//! `MooncakeKVManager` in DECODE mode).

mod heartbeat;
mod inbox;
mod receiver;
mod slots;
pub(crate) mod state;
pub mod topology;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::JoinHandle;
use std::time::Duration;

use kvbridge_engine::TransferEngine;
use kvbridge_wire::KvPoll;
use parking_lot::Mutex;

use crate::config::DecodeConfig;
use crate::control::{ControlContext, ControlSecurity, PullSocket, PushPool};
use crate::error::StartError;
use crate::kv_args::KvArgs;
use crate::metrics::{Metrics, MetricsServer};
use crate::stop::{StopSignal, StopTrigger, stop_pair};

pub use receiver::KvReceiver;
pub use state::BootstrapInfo;
use state::{DecodeRooms, Prefills};

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
            prefills.heartbeat_failures.remove(addr);
            let prefix = format!("{addr}_");
            prefills.pool.retain(|k, _| !k.starts_with(&prefix));
        }
        let reason = format!("Lost connection with prefill instance (bootstrap_addr: {addr})");
        let mut affected = 0usize;
        {
            let mut rooms = self.rooms.lock();
            let candidates = rooms.addr_rooms.remove(addr).unwrap_or_default();
            for room in candidates {
                if rooms.table.get(room).is_some_and(|s| s != KvPoll::Success) {
                    rooms.table.record_failure(room, reason.clone());
                    rooms.table.update(room, KvPoll::Failed);
                    affected += 1;
                }
            }
        }
        self.metrics.failure("prefill_lost");
        tracing::error!(%addr, affected, "lost connection with prefill instance");
    }
}

/// A running decode role.
pub struct DecodeManager {
    shared: Arc<Shared>,
    threads: Vec<JoinHandle<()>>,
    metrics_server: Option<MetricsServer>,
    stop: StopTrigger,
    context: Option<ControlContext>,
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
    /// starts the receive and heartbeat threads.
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
        kv_args.validate()?;
        let intra = config.nvlink_intra || !engine.moves_host_memory();
        // SAFETY: the caller promises the buffers outlive the manager.
        let local = unsafe { crate::local::LocalMemory::new(&kv_args, intra)? };
        let regions = local.engine_regions.clone();
        // SAFETY: as above; the manager deregisters them in `teardown`.
        unsafe { engine.batch_register(&regions)? };
        let deregister = |engine: &Arc<dyn TransferEngine>| {
            let addrs: Vec<u64> = regions.iter().map(|r| r.0).collect();
            let _ = engine.batch_deregister(&addrs);
        };
        let security = ControlSecurity::from_secret(config.secret.as_ref());
        if !security.is_secret() {
            kvbridge_engine::secret::warn_open_mode("decode");
        }
        let context = match ControlContext::new(security) {
            Ok(c) => c,
            Err(e) => {
                deregister(&engine);
                return Err(e.into());
            }
        };
        let pull =
            match PullSocket::bind(&context, &config.local_ip, 0, config.zmq_max_message_bytes) {
                Ok(p) => p,
                Err(e) => {
                    deregister(&engine);
                    return Err(e.into());
                }
            };
        let metrics = Arc::new(Metrics::new());
        let metrics_server = match config.metrics_addr {
            Some(addr) => match MetricsServer::start(addr, metrics.clone()) {
                Ok(s) => Some(s),
                Err(e) => {
                    deregister(&engine);
                    return Err(e.into());
                }
            },
            None => None,
        };
        let (mut stop, stop_signal) = stop_pair();
        let shared = Arc::new(Shared {
            push: PushPool::new(&context, config.zmq_send_timeout),
            rank_port: pull.port(),
            http: crate::http::agent(Duration::from_secs(5)),
            config,
            kv_args,
            engine: engine.clone(),
            rooms: Mutex::new(DecodeRooms::default()),
            prefills: Mutex::new(Prefills::default()),
            metrics,
            stopped: AtomicBool::new(false),
            stop_signal,
            local,
        });
        let mut threads = Vec::new();
        let s = shared.clone();
        let inbox = std::thread::Builder::new()
            .name("kvb-decode-inbox".into())
            .spawn(move || inbox::run(&s, pull));
        let s = shared.clone();
        let heartbeat = std::thread::Builder::new()
            .name("kvb-decode-heartbeat".into())
            .spawn(move || heartbeat::run(&s));
        for t in [inbox, heartbeat] {
            match t {
                Ok(t) => threads.push(t),
                Err(e) => {
                    shared.stopped.store(true, Ordering::SeqCst);
                    stop.trigger();
                    for t in threads {
                        let _ = t.join();
                    }
                    deregister(&engine);
                    return Err(e.into());
                }
            }
        }
        Ok(Self {
            shared,
            threads,
            metrics_server,
            stop,
            context: Some(context),
        })
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

    /// Applies one control message as if it had arrived on this rank's
    /// socket (for fuzzing the inbox; not part of the supported API).
    #[doc(hidden)]
    pub fn handle_frames(&self, frames: &[Vec<u8>]) {
        let mut batch = inbox::StateBatch::default();
        inbox::handle(&self.shared, frames, &mut batch);
        batch.flush(&self.shared);
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
        self.metrics_server.as_ref().map(MetricsServer::local_addr)
    }

    /// Stops every thread, closes every socket and deregisters memory.
    pub fn teardown(mut self) {
        self.stop();
    }

    fn stop(&mut self) {
        if self.shared.stopped.swap(true, Ordering::SeqCst) {
            return;
        }
        self.stop.trigger();
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
        self.shared.push.close_all();
        self.metrics_server = None;
        let addrs = self.shared.local.engine_addrs();
        if let Err(e) = self.shared.engine.batch_deregister(&addrs) {
            tracing::warn!(error = %e, "deregistering memory at teardown");
        }
        drop(self.context.take());
        tracing::info!("decode manager torn down");
    }
}

impl Drop for DecodeManager {
    fn drop(&mut self) {
        self.stop();
    }
}
