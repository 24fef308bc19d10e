//! The prefill role: registers its KV memory, accepts decode registrations
//! and transfer requests on its zmq socket, and streams chunks through the
//! transfer engine (sglang `MooncakeKVManager` in PREFILL mode).
//!
//! Threads: one inbox thread (the bootstrap socket), one worker per shard
//! queue (chunks of one room stay in order on one shard; one decode's rooms
//! spread over every shard), one probe thread
//! for blacklisted sessions, and optionally a metrics endpoint.

pub(crate) mod cp;
mod flight;
mod inbox;
mod pipeline;
mod probe;
mod refresh;
pub(crate) mod room;
mod sender;
mod ship;
mod staging;
pub(crate) mod state;
mod worker;

use std::sync::Arc;
use std::sync::atomic::AtomicBool;

use crossbeam_channel::{Receiver, Sender, unbounded};
use kvbridge_engine::TransferEngine;
use kvbridge_plan::TransferChunk;
use kvbridge_wire::{AbortAck, KvPoll, Status};
use parking_lot::{Mutex, RwLock};

use crate::config::PrefillConfig;
use crate::control::{PullSocket, PushPool, tcp_endpoint};
use crate::error::{ConfigError, StartError};
use crate::health::SessionHealth;
use crate::kv_args::KvArgs;
use crate::metrics::Metrics;
use crate::role::{self, Lifecycle};
use crate::seal::seal;
use crate::stop::StopSignal;

use room::PrefillRooms;
pub use sender::KvSender;
use state::{AckTarget, PeerEntry};

/// A chunk waiting in a shard queue (sglang `TransferKVChunk`).
#[derive(Debug)]
pub(crate) struct QueuedChunk {
    pub room: u64,
    pub chunk: TransferChunk,
}

/// State shared by the prefill manager's threads and its senders.
#[derive(Debug)]
pub(crate) struct Shared {
    pub config: PrefillConfig,
    pub kv_args: KvArgs,
    pub engine: Arc<dyn TransferEngine>,
    pub rooms: Mutex<PrefillRooms>,
    pub peers: RwLock<std::collections::HashMap<String, Arc<PeerEntry>>>,
    pub next_generation: std::sync::atomic::AtomicU64,
    pub health: Mutex<SessionHealth>,
    pub push: PushPool,
    pub metrics: Arc<Metrics>,
    pub stopped: AtomicBool,
    pub stop_signal: StopSignal,
    pub queues: Vec<Sender<Option<QueuedChunk>>>,
    pub unique_rank: u64,
    /// What this rank sends under context parallelism.
    pub cp: cp::CpRole,
    pub in_flight: usize,
    /// Our buffers for local reads, and what the engine has registered.
    pub local: crate::local::LocalMemory,
    /// The staging gather buffers, when staging is on.
    pub staging: Option<staging::PrefillStaging>,
}

impl Shared {
    /// The pair key of the decode rank whose control endpoint is
    /// `(ip, port)`, as its latest registration carried it (secret mode).
    pub fn pair_key_at(&self, ip: &str, port: u16) -> Option<kvbridge_wire::PairKey> {
        self.config.secret.as_ref()?;
        self.peers
            .read()
            .values()
            .filter(|e| e.control.0 == ip && e.control.1 == port)
            .max_by_key(|e| e.generation)
            .and_then(|e| e.pair_key)
    }

    /// The pair key decode session `session` registered with (secret mode).
    pub fn pair_key_of(&self, session: &str) -> Option<kvbridge_wire::PairKey> {
        self.config.secret.as_ref()?;
        self.peers.read().get(session).and_then(|e| e.pair_key)
    }

    /// Sends `[room, status, rank, reason?]` to each target without ever
    /// blocking (a slow or dead decode must not stall this thread): a full
    /// queue drops the message, counted; that decode's room then times out.
    pub fn send_status(
        &self,
        targets: &[(String, u16)],
        room: u64,
        status: KvPoll,
        reason: Option<&str>,
    ) {
        let message = Status {
            room,
            status,
            prefill_rank: self.unique_rank,
            failure_reason: reason.map(std::borrow::Cow::Borrowed),
        };
        for (ip, port) in targets {
            let endpoint = tcp_endpoint(ip, *port);
            let frames = seal(self.pair_key_at(ip, *port).as_ref(), message.encode());
            if !self
                .push
                .try_send(&endpoint, frames.iter().map(|f| f.as_ref()))
            {
                self.metrics.dropped("status_send");
                tracing::warn!(room, %endpoint, ?status, "cannot send room status");
            }
        }
    }

    /// Applies `input` to the rooms under their lock: the one place the
    /// prefill side reads or changes a room.
    pub fn step(&self, input: room::Input<'_>) -> room::Output {
        self.rooms.lock().handle(input)
    }

    /// The caps transfer requests and ABORTs are admitted under.
    pub fn caps(&self) -> room::Caps {
        room::Caps {
            max_rooms: self.config.max_rooms,
            max_pending_bytes: self.config.max_pending_request_bytes,
            max_rooms_per_session: self.config.max_rooms_per_session,
            max_abort_endpoints: self.config.max_abort_endpoints,
            unclaimed_ttl: self.config.bootstrap_timeout,
        }
    }

    /// Concludes a room (sglang `conclude_transfer`): a recorded failure or
    /// an earlier `Failed` turns `Success` into `Failed`; the first failure
    /// reason is kept; the status goes to `targets` (default: every
    /// non-dummy decode endpoint of the room). Returns the emitted state, or
    /// `None` for a room that was already cleared.
    pub fn conclude(
        &self,
        room: u64,
        status: KvPoll,
        targets: Option<Vec<(String, u16)>>,
        reason: Option<String>,
    ) -> Option<KvPoll> {
        let room::Output::Concluded(Some(room::Conclusion {
            status,
            reason,
            targets,
            started,
        })) = self.step(room::Input::Conclude {
            room,
            status,
            targets,
            reason,
        })
        else {
            return None;
        };
        self.metrics.room_concluded(status == KvPoll::Success);
        if let Some(t) = started {
            self.metrics
                .transfer_latency
                .observe(t.elapsed().as_secs_f64());
        }
        if status == KvPoll::Failed {
            tracing::warn!(
                room,
                reason = reason.as_deref().unwrap_or(""),
                "room failed"
            );
        }
        self.send_status(&targets, room, status, reason.as_deref());
        Some(status)
    }

    /// Sends `room`'s `Failed` status (`notice` from
    /// [`PrefillRooms::fail_and_tell`]) to the decode endpoints in it.
    pub fn tell_failed(&self, room: u64, notice: state::FailedNotice) {
        let (targets, reason) = notice;
        if targets.is_empty() {
            return;
        }
        tracing::debug!(
            room,
            decodes = targets.len(),
            "telling the room's decodes it failed here"
        );
        self.send_status(&targets, room, KvPoll::Failed, reason.as_deref());
    }

    /// One ABORT_ACK: the ranked form (with the generation when the abort
    /// carried one) under deferred release, the reference's 2-frame form otherwise.
    pub fn send_abort_ack(&self, room: u64, target: &AckTarget) {
        let ack = if self.config.deferred_release || target.generation.is_some() {
            AbortAck {
                room,
                prefill_rank: Some(self.unique_rank),
                generation: target.generation,
            }
        } else {
            AbortAck {
                room,
                prefill_rank: None,
                generation: None,
            }
        };
        let endpoint = tcp_endpoint(&target.ip, target.port);
        let frames = seal(
            self.pair_key_at(&target.ip, target.port).as_ref(),
            ack.encode(),
        );
        // Never blocks: ABORTs naming a dead endpoint must not stall the
        // inbox thread that handles everyone's messages.
        if self
            .push
            .try_send(&endpoint, frames.iter().map(|f| f.as_ref()))
        {
            tracing::debug!(room, %endpoint, "sent ABORT_ACK");
        } else {
            self.metrics.dropped("abort_ack_send");
        }
    }
}

/// A running prefill role.
pub struct PrefillManager {
    shared: Arc<Shared>,
    rank_port: u16,
    /// The threads and what they run on; `None` once torn down.
    lifecycle: Option<Lifecycle>,
}

impl std::fmt::Debug for PrefillManager {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PrefillManager")
            .field("session", &self.shared.engine.session_id())
            .field("rank_port", &self.rank_port)
            .finish_non_exhaustive()
    }
}

impl PrefillManager {
    /// Registers `kv_args`' buffers with `engine`, binds the zmq socket,
    /// registers with the bootstrap server and starts the threads.
    ///
    /// # Safety
    /// Every buffer `kv_args` names must stay valid, readable and writable
    /// until [`PrefillManager::teardown`] returns (or the manager is dropped),
    /// as for [`TransferEngine::batch_register`].
    pub unsafe fn start(
        mut config: PrefillConfig,
        mut kv_args: KvArgs,
        engine: Arc<dyn TransferEngine>,
    ) -> Result<Self, StartError> {
        // A hybrid-MLA prefill under CP always splits the transfer across
        // its CP ranks (sglang's `cp_sharded_prefill`).
        config.all_cp_ranks |= kv_args.layout.is_hybrid_mla_backend;
        if let Some(n) = config.max_transfer_batch_indices {
            kv_args.layout.max_transfer_batch_indices = n;
        }
        let (queue_count, in_flight) = config.worker_layout().map_err(ConfigError::Setting)?;
        // SAFETY: the caller promises (this function's contract) that every
        // buffer in `kv_args` outlives the manager; the manager deregisters
        // them in `teardown` before returning (a failed start at once).
        let intra = config.nvlink_intra || !engine.moves_host_memory();
        let staging = staging::PrefillStaging::new(
            &config.staging,
            &kv_args,
            queue_count.max(1),
            intra,
            engine.as_ref(),
        )?;
        let extra = staging
            .as_ref()
            .map_or_else(Vec::new, staging::PrefillStaging::regions);
        // SAFETY: as above; the gather buffers live in `Shared`, which
        // outlives the registration (released by the lifecycle first).
        let (local, registration) =
            unsafe { role::register_memory(&kv_args, &engine, config.nvlink_intra, &extra)? };
        let (mut lifecycle, stop_signal) =
            Lifecycle::new("prefill", registration, config.secret.as_ref())?;
        let pull = lifecycle.bind_inbox(
            &config.local_ip,
            config.control_port,
            config.zmq_max_message_bytes,
        )?;
        let rank_port = pull.port();
        let (senders, receivers): (Vec<_>, Vec<Receiver<Option<QueuedChunk>>>) =
            (0..queue_count).map(|_| unbounded()).unzip();
        let metrics = lifecycle.serve_metrics(config.metrics_addr)?;
        let probe = config.probe;
        let shared = Arc::new(Shared {
            unique_rank: config.rank.unique_rank(),
            cp: cp::CpRole::new(&config.rank, config.all_cp_ranks),
            push: PushPool::capped(
                lifecycle.context(),
                config.zmq_send_timeout,
                config.zmq_max_sockets,
            ),
            health: Mutex::new(SessionHealth::new(
                probe.interval,
                probe.max_interval,
                probe.idle_timeout,
            )),
            config,
            kv_args,
            engine,
            rooms: Mutex::new(PrefillRooms::default()),
            peers: RwLock::new(Default::default()),
            next_generation: std::sync::atomic::AtomicU64::new(1),
            metrics,
            stopped: AtomicBool::new(false),
            stop_signal,
            queues: senders,
            in_flight,
            local,
            staging,
        });
        let started = Self::spawn_threads(&shared, &mut lifecycle, pull, receivers);
        let mut manager = Self {
            shared,
            rank_port,
            lifecycle: Some(lifecycle),
        };
        // From here a failure drops the manager, which tears down what started.
        started?;
        let shared = manager.shared.clone();
        crate::bootstrap::client::register_with_bootstrap(
            &shared.config,
            shared.kv_args.layout.page_size,
            rank_port,
            shared.engine.session_id(),
            &shared.stopped,
        )?;
        if !shared.config.bootstrap_refresh.is_zero()
            && let Some(lifecycle) = manager.lifecycle.as_mut()
        {
            lifecycle
                .spawn("kvb-prefill-refresh".into(), move || {
                    refresh::run(&shared, rank_port);
                })
                .map_err(StartError::Thread)?;
        }
        Ok(manager)
    }

    /// Starts the inbox thread, one worker per shard queue and the probe.
    fn spawn_threads(
        shared: &Arc<Shared>,
        lifecycle: &mut Lifecycle,
        pull: PullSocket,
        receivers: Vec<Receiver<Option<QueuedChunk>>>,
    ) -> std::io::Result<()> {
        let s = shared.clone();
        lifecycle.spawn("kvb-prefill-inbox".into(), move || inbox::run(&s, pull))?;
        for (i, rx) in receivers.into_iter().enumerate() {
            let s = shared.clone();
            lifecycle.spawn(format!("kvb-prefill-w{i}"), move || worker::run(&s, &rx, i))?;
        }
        if shared.config.probe.enabled {
            let s = shared.clone();
            lifecycle.spawn("kvb-prefill-probe".into(), move || probe::run(&s))?;
        }
        Ok(())
    }

    /// A sender for one request's room (sglang `MooncakeKVSender`).
    pub fn sender(&self, room: u64) -> KvSender {
        KvSender::new(self.shared.clone(), room, false)
    }

    /// [`PrefillManager::sender`] for a room whose DP rank the router named
    /// to both sides (sglang's `disagg_prefill_dp_rank`): no DP
    /// registration, no bootstrap-room check.
    pub fn sender_dp_hinted(&self, room: u64) -> KvSender {
        KvSender::new(self.shared.clone(), room, true)
    }

    /// Under context parallelism: whether this rank never transfers (a CP
    /// rank other than 0 without all-ranks transfer; sglang's
    /// `is_dummy_cp_rank`), and whether every CP rank sends a share
    /// (`enable_all_cp_ranks_for_transfer`).
    pub fn cp_transfer(&self) -> (bool, bool) {
        let cp = self.shared.cp;
        (cp.is_dummy(), matches!(cp, cp::CpRole::Share { .. }))
    }

    /// The port of this rank's zmq bootstrap socket.
    pub fn rank_port(&self) -> u16 {
        self.rank_port
    }

    /// Applies one control message as if it had arrived on this rank's
    /// socket (for fuzzing the inbox; not part of the supported API).
    #[doc(hidden)]
    pub fn handle_frames(&self, frames: &[Vec<u8>]) {
        inbox::handle(&self.shared, frames);
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

    /// Whether transfers to `session` currently fail fast.
    pub fn is_blacklisted(&self, session: &str) -> bool {
        self.shared.health.lock().is_blacklisted(session)
    }

    /// The room's state, if it exists.
    pub fn room_status(&self, room: u64) -> Option<KvPoll> {
        match self.shared.step(room::Input::State { room }) {
            room::Output::State(state) => state,
            _ => None,
        }
    }

    /// Starts journaling room state changes for [`PrefillManager::take_status_changes`]
    /// (a pipeline stage mirroring its states to stage 0).
    pub fn watch_statuses(&self) {
        self.shared.step(room::Input::Watch);
    }

    /// The rooms whose state changed since the last call, each with its
    /// latest state (`None`: cleared); empty unless watched.
    pub fn take_status_changes(&self) -> Vec<(u64, Option<KvPoll>)> {
        match self.shared.step(room::Input::TakeChanges) {
            room::Output::Changes(changes) => changes,
            _ => Vec::new(),
        }
    }

    /// Stops every thread (parked workers wake), closes every socket and
    /// deregisters memory; the process can then start the other role.
    pub fn teardown(mut self) {
        self.stop();
    }

    fn stop(&mut self) {
        let Some(lifecycle) = self.lifecycle.take() else {
            return;
        };
        let shared = &self.shared;
        // Workers parked on their queues wake on `None`.
        lifecycle.shut_down(&shared.stopped, &shared.push, || {
            for q in &shared.queues {
                let _ = q.send(None);
            }
        });
        tracing::info!("prefill manager torn down");
    }
}

impl Drop for PrefillManager {
    fn drop(&mut self) {
        self.stop();
    }
}
