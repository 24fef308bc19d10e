//! A transfer worker: takes chunks from its shard queue in order, asks the
//! planner for their batches (KV blocks or runs; on the last chunk also
//! states and aux) and submits every one of them through one pipeline,
//! never waiting for a room's batches before taking the next chunk. It acts
//! on what the pipeline reports: a failed batch fails its room; a room whose
//! every batch is written gets its control-plane data, then its status.
//!
//! **Owns:** the order of a room's last steps (bytes, then zmq-shipped
//! states and aux, then the status: decode never sees `Success` before
//! every byte is written) and the end of a chunk (`outstanding`, abort ACKs).
//! **Never:** computes a byte range (the planner does), blocks on one room
//! while another could proceed (a slow destination holds only its own
//! batches' slots), or trusts a batch's result it has not been told.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, RecvTimeoutError, TryRecvError};
use kvbridge_engine::{Batch, ErrorKind, TransferError};
use kvbridge_plan::{Block, Planner, TransferChunk, TransferPlan, TransferRequest};
use kvbridge_wire::KvPoll;

use super::flight::Flight;
use super::pipeline::{Event, Failure, Part, Submitted, Ticket};
use super::room::{Input, Output};
use super::ship;
use super::staging::ledger::Stager;
use super::staging::{self as staged, Grid, StagedTask};
use super::state::{Peer, PeerEntry, TransferInfo};
use super::{QueuedChunk, Shared};
use crate::stage::{self, Stage};

/// Batches a worker keeps in flight at least, whatever the thread pool size:
/// enough to overlap planning, sending and acknowledgements for the many
/// rooms of one decode (all on this worker's shard); with 4, small rooms
/// waited on completions (docs/roles.md, "workers").
const MIN_IN_FLIGHT: usize = 16;

/// How long a worker with staged chunks waiting (allocation, ring space)
/// sleeps between attempts when nothing else is to be done.
const STAGED_RETRY: Duration = Duration::from_millis(1);

/// Processes chunks until a `None` sentinel (teardown) or a closed queue;
/// between chunks it accounts for finished batches and acts on them, and
/// retries staged chunks that wait for the decode's ring.
pub(crate) fn run(shared: &Shared, queue: &Receiver<Option<QueuedChunk>>, index: usize) {
    let mut planner = Planner::new();
    planner.set_strided_kv(shared.engine.copies_runs());
    let mut worker = Worker {
        shared,
        flight: Flight::new(shared.in_flight.max(MIN_IN_FLIGHT)),
        finales: HashMap::new(),
        index,
        grid: Grid::default(),
        stager: Stager::new(
            shared
                .staging
                .as_ref()
                .map_or_else(Vec::new, |s| s.slots(index)),
        ),
    };
    loop {
        worker.handle_events();
        worker.retry_deferred();
        let next = if !worker.flight.is_idle() {
            match queue.try_recv() {
                Ok(next) => next,
                Err(TryRecvError::Empty) => {
                    // Account for finished batches while watching the
                    // queue: whichever comes first, a batch's end or a new
                    // chunk, is acted on at once.
                    match worker.flight.wait_or(queue) {
                        Some(Ok(next)) => next,
                        Some(Err(_)) => None,
                        None => continue,
                    }
                }
                Err(TryRecvError::Disconnected) => None,
            }
        } else if !worker.stager.deferred.is_empty() {
            match queue.recv_timeout(STAGED_RETRY) {
                Ok(next) => next,
                Err(RecvTimeoutError::Timeout) => continue,
                Err(RecvTimeoutError::Disconnected) => None,
            }
        } else {
            queue.recv().ok().flatten()
        };
        let Some(queued) = next else { break };
        let span = tracing::debug_span!(
            "chunk",
            room = queued.room,
            last = queued.chunk.is_last_chunk
        );
        let _enter = span.enter();
        stage::mark(queued.room, Stage::Taken);
        worker.process(&mut planner, &queued);
    }
    // Nothing may be left writing once the worker is gone.
    worker.drain();
}

/// What one decode rank of a room gets once every byte of the room is
/// written, before the status.
#[derive(Debug)]
struct Finale {
    info: Arc<TransferInfo>,
    /// Host-sourced state blocks (intra-node transport), as `STATE_DATA`.
    host_states: Vec<Block>,
    /// Aux over zmq: `(our aux index, the decode's aux index)`.
    aux: Option<(Option<u64>, u64)>,
}

pub(super) struct Worker<'s> {
    pub(super) shared: &'s Shared,
    pub(super) flight: Flight,
    /// Rooms whose last chunk is submitted for every decode rank.
    finales: HashMap<u64, Vec<Finale>>,
    /// This worker's number (its gather buffer).
    pub(super) index: usize,
    /// Rooms' pages not yet forming a whole staging chunk.
    pub(super) grid: Grid,
    /// Staged chunks waiting, and their writes in flight.
    pub(super) stager: Stager,
}

impl Worker<'_> {
    fn process(&mut self, planner: &mut Planner, queued: &QueuedChunk) {
        let shared = self.shared;
        let room = queued.room;
        // Counted at dequeue, before the status check: `outstanding == 0`
        // then means nothing of the room is dequeued or in flight, which
        // the abort ACK relies on.
        let infos = match shared.step(Input::Dequeue { room }) {
            Output::Infos(infos) => infos,
            _ => None,
        };
        let ticket = self.flight.open(room, queued.chunk.is_last_chunk);
        match infos {
            Some(infos) => self.send_chunk(planner, ticket, room, &queued.chunk, &infos),
            None => {
                self.grid.forget(room);
                tracing::debug!(room, "skipping chunk of a failed or cleared room");
            }
        }
        if !self.stager.holds(ticket) {
            self.flight.close(ticket);
        }
    }

    /// Submits the chunk's batches for every decode rank of the room; on
    /// the last chunk, records what follows the bytes.
    fn send_chunk(
        &mut self,
        planner: &mut Planner,
        ticket: Ticket,
        room: u64,
        chunk: &TransferChunk,
        infos: &[Arc<TransferInfo>],
    ) {
        let shared = self.shared;
        let mut finales = Vec::new();
        let mut recorded = false;
        // The room's whole staging chunks this chunk completes (computed
        // once per chunk, for every staging destination).
        let mut grid_chunks: Option<Vec<staged::GridChunk>> = None;
        for info in infos {
            let Some(request) = &info.request else {
                // A dummy destination holds no KV from this rank: it succeeds on
                // the last chunk without a status message.
                if chunk.is_last_chunk {
                    shared.step(Input::Succeed { room });
                }
                continue;
            };
            let Some(entry) = usable_destination(shared, room, info) else {
                break;
            };
            let plan = match plan_for(shared, planner, room, info, request, &entry, chunk) {
                Ok(plan) => plan,
                Err(reason) => {
                    fail(shared, room, reason);
                    break;
                }
            };
            let started = Instant::now();
            let staging = shared.staging.as_ref().filter(|_| entry.staging.is_some());
            if let Some(staging) = staging {
                if grid_chunks.is_none() {
                    let g = staging.chunk_pages;
                    let start = chunk.index_slice_start;
                    let pages = &chunk.prefill_kv_indices;
                    match self.grid.add(room, start, pages, chunk.is_last_chunk, g) {
                        Ok(c) => grid_chunks = Some(c),
                        Err(reason) => {
                            fail(shared, room, reason);
                            break;
                        }
                    }
                }
                let deadline = Instant::now() + staging.wait_timeout;
                for c in grid_chunks.iter().flatten() {
                    self.stage(StagedTask {
                        ticket,
                        room,
                        info: info.clone(),
                        entry: entry.clone(),
                        chunk_idx: c.index,
                        page_start: c.page_start,
                        pages: c.pages.clone(),
                        deadline,
                    });
                }
            }
            let aux = (chunk.is_last_chunk && (shared.config.send_aux_tcp || shared.local.intra))
                .then_some((chunk.prefill_aux_index, request.dst_aux_index));
            let incarnation = entry.incarnation;
            let kv = staging.is_none();
            let Some(host_states) = self.send_plan(ticket, room, info, incarnation, plan, aux, kv)
            else {
                break;
            };
            shared
                .metrics
                .chunk_latency
                .observe(started.elapsed().as_secs_f64());
            shared.metrics.chunks.inc();
            if !chunk.is_last_chunk {
                continue;
            }
            finales.push(Finale {
                info: info.clone(),
                host_states,
                aux,
            });
            if !recorded && finales.len() as u64 == info.required_dst_info_num {
                // Every decode rank's batches are submitted: the status
                // goes once the pipeline reports them all written.
                self.finales.insert(room, std::mem::take(&mut finales));
                recorded = true;
            }
        }
    }

    /// The one loop that moves a plan: every batch (KV blocks and runs
    /// unless `kv` is false (staged), and on the last chunk state and aux
    /// blocks unless aux goes over zmq) in pieces of at most
    /// `max_batch_blocks`, through the pipeline. Returns the host-sourced
    /// state blocks kept for after the KV, or `None` when the room stopped
    /// (aborted, failed).
    #[allow(clippy::too_many_arguments)]
    fn send_plan(
        &mut self,
        ticket: Ticket,
        room: u64,
        info: &Arc<TransferInfo>,
        incarnation: u64,
        plan: &TransferPlan,
        aux_over_zmq: Option<(Option<u64>, u64)>,
        kv: bool,
    ) -> Option<Vec<Block>> {
        let shared = self.shared;
        let cap = match shared.config.max_batch_blocks {
            0 => usize::MAX,
            n => n,
        };
        // The chunk's KV in batches of up to `cap` descriptors, not one per
        // buffer pair as the planner groups them (and the reference calls
        // its engine): each batch costs a request, an ack and a destination
        // check, which per layer dominated head-sliced (heterogeneous-TP)
        // chunks. State and aux blocks exist on the last chunk only.
        let (blocks, runs): (&[Block], &[kvbridge_plan::Run]) = if kv {
            (plan.kv_blocks(), plan.kv_runs())
        } else {
            (&[], &[])
        };
        let kv = std::iter::once((Part::Kv, Batch::Blocks(blocks)));
        let runs = std::iter::once((Part::Kv, Batch::Runs(runs)));
        let states = std::iter::once((Part::State, Batch::Blocks(plan.state_blocks())));
        let aux = aux_over_zmq
            .is_none()
            .then_some((Part::Aux, Batch::Blocks(plan.aux_blocks())));
        let mut host_states = Vec::new();
        for (part, batch) in kv.chain(runs).chain(states).chain(aux) {
            for piece in pieces(batch, cap) {
                // An abort (or a failed earlier batch) stops the room at the
                // next batch; what is in flight still completes.
                if self.flight.failed(ticket) || room_failed(shared, room) {
                    return None;
                }
                let out = match ship::for_engine(shared, room, info, part, piece, &mut host_states)
                {
                    Ok(out) => out,
                    Err(reason) => {
                        fail(shared, room, reason);
                        return None;
                    }
                };
                let batch = out.batch();
                if !batch.is_empty() {
                    stage::mark(room, Stage::Submitted);
                    self.submit(ticket, incarnation, part, info, batch);
                }
            }
        }
        Some(host_states)
    }

    /// Submits one batch, first accounting for finished ones (and acting on
    /// them) while the pipeline is full.
    fn submit(
        &mut self,
        ticket: Ticket,
        incarnation: u64,
        part: Part,
        info: &Arc<TransferInfo>,
        batch: Batch<'_>,
    ) {
        self.submit_as(ticket, incarnation, part, info, batch, None);
    }

    pub(super) fn submit_as(
        &mut self,
        ticket: Ticket,
        incarnation: u64,
        part: Part,
        info: &Arc<TransferInfo>,
        batch: Batch<'_>,
        tag: Option<u64>,
    ) {
        while self.flight.is_full() {
            self.flight.wait();
            self.handle_events();
        }
        let copies = match batch {
            Batch::Blocks(b) => b.len() as u64,
            Batch::Runs(r) => r.iter().map(|r| r.count).fold(0, u64::saturating_add),
        };
        let submitted = Submitted {
            part,
            bytes: batch.bytes(),
            copies,
            dest: info.clone(),
            tag,
        };
        let engine = &*self.shared.engine;
        self.flight
            .submit(engine, ticket, incarnation, batch, submitted);
    }

    /// Acts on everything the pipeline reported.
    pub(super) fn handle_events(&mut self) {
        let shared = self.shared;
        while let Some(event) = self.flight.poll() {
            match event {
                Event::Written {
                    room,
                    part,
                    bytes,
                    copies,
                } => {
                    shared.metrics.bytes.inc_by(bytes);
                    if part != Part::Aux {
                        shared.step(Input::Payload { room, bytes });
                    }
                    shared.metrics.blocks.inc_by(copies);
                }
                Event::Failed {
                    room,
                    ticket,
                    failure,
                } => {
                    tracing::debug!(room, ticket, part = ?failure.part, "batch failed");
                    engine_failure(shared, &failure.dest, &failure.error);
                    let reason = failure_reason(room, &failure);
                    shared.conclude(room, KvPoll::Failed, None, Some(reason));
                }
                Event::Tagged { tag, ok } => {
                    let done = self.stager.completed(tag, ok);
                    self.staged_done(done);
                }
                Event::RoomReady { room } => self.room_ready(room),
                Event::ChunkDone {
                    room,
                    ticket,
                    is_last,
                    ok,
                } => {
                    tracing::trace!(room, ticket, is_last, ok, "chunk done");
                    if is_last {
                        self.finales.remove(&room);
                    }
                    finish(shared, room, is_last);
                }
            }
        }
    }

    /// Every byte of the room is written: the zmq-shipped states and aux
    /// (ordered ahead of the status on each decode's socket), then the
    /// status to every decode rank.
    fn room_ready(&mut self, room: u64) {
        let shared = self.shared;
        let Some(finales) = self.finales.remove(&room) else {
            return;
        };
        stage::mark(room, Stage::Written);
        let mut aux_ok = true;
        let mut targets = Vec::with_capacity(finales.len());
        for f in &finales {
            if room_failed(shared, room) {
                // Aborted meanwhile: its ACK follows the drain, no status.
                return;
            }
            if let Err(reason) = ship::ship_blocks(shared, room, &f.info, &f.host_states) {
                fail(shared, room, reason);
                return;
            }
            if let Some((src, dst)) = f.aux {
                aux_ok &= ship::send_aux(shared, room, src, &f.info, dst);
            }
            targets.push((f.info.endpoint.clone(), f.info.dst_port));
        }
        let (status, reason) = if aux_ok {
            (KvPoll::Success, None)
        } else {
            (
                KvPoll::Failed,
                Some(format!("Failed to send aux data of {room}")),
            )
        };
        shared.conclude(room, status, Some(targets), reason);
        stage::mark(room, Stage::Concluded);
    }

    /// Waits for every batch in flight and acts on each; staged chunks
    /// still waiting are given up (the manager is stopping).
    fn drain(&mut self) {
        for ticket in self.stager.abandon() {
            self.flight.close(ticket);
        }
        loop {
            self.handle_events();
            if self.flight.is_idle() {
                break;
            }
            self.flight.wait();
        }
    }
}

/// `batch` in pieces of at most `cap` blocks or runs (none for an empty one).
fn pieces(batch: Batch<'_>, cap: usize) -> impl Iterator<Item = Batch<'_>> {
    let (blocks, runs): (&[Block], &[kvbridge_plan::Run]) = match batch {
        Batch::Blocks(b) => (b, &[]),
        Batch::Runs(r) => (&[], r),
    };
    blocks
        .chunks(cap)
        .map(Batch::Blocks)
        .chain(runs.chunks(cap).map(Batch::Runs))
}

/// The registration of `info`'s session to plan and write against, or
/// `None` after failing the room: a blacklisted session, a decode that
/// registered again since (restarted), a rejected registration or none.
fn usable_destination(shared: &Shared, room: u64, info: &TransferInfo) -> Option<Arc<PeerEntry>> {
    {
        let mut health = shared.health.lock();
        if health.is_blacklisted(&info.session) {
            health.note_requested(&info.session, Instant::now());
            drop(health);
            shared.metrics.failure("session_blacklisted");
            fail(
                shared,
                room,
                format!(
                    "Decode instance could be dead, remote mooncake session {} is not alive",
                    info.session
                ),
            );
            return None;
        }
    }
    let entry = shared.peers.read().get(&info.session).cloned();
    let reason = match entry {
        Some(e) if e.generation != info.registration => {
            // The decode registered again after this room's destination
            // arrived: it restarted, and the pages named belong to the dead
            // incarnation. Writing them would corrupt the new one.
            shared.metrics.failure("stale_registration");
            format!(
                "decode session {} registered again (generation {} -> {}) after room {room}'s \
                 destination was sent; the decode restarted",
                info.session, info.registration, e.generation
            )
        }
        Some(e) => match &e.peer {
            Peer::Ready(_) => return Some(e),
            Peer::Rejected(reason) => reason.clone(),
        },
        None => format!("no registration from decode session {}", info.session),
    };
    fail(shared, room, reason);
    None
}

/// Plans the chunk for `info` against its session's registration `entry`.
fn plan_for<'p>(
    shared: &Shared,
    planner: &'p mut Planner,
    room: u64,
    info: &TransferInfo,
    request: &TransferRequest,
    entry: &PeerEntry,
    chunk: &TransferChunk,
) -> Result<&'p TransferPlan, String> {
    let Peer::Ready(prepared) = &entry.peer else {
        return Err(format!("decode session {} was rejected", info.session));
    };
    planner
        .plan_chunk(&shared.kv_args.layout, prepared, request, chunk)
        .map_err(|e| {
            shared.metrics.failure("plan");
            format!("cannot plan room {room} for {}: {e}", info.host_port())
        })
}

/// Ends a chunk once its batches completed: ACK a drained abort, and drop
/// the room's transfer state once it has concluded and nothing of it is
/// outstanding.
fn finish(shared: &Shared, room: u64, is_last: bool) {
    let Output::Finished(acks, failed) = shared.step(Input::Finish { room, is_last }) else {
        return;
    };
    shared.tell_failed(room, failed);
    for target in acks {
        shared.send_abort_ack(room, &target);
    }
}

fn failure_reason(room: u64, f: &Failure) -> String {
    let (to, e) = (f.dest.host_port(), &f.error);
    match f.part {
        Part::Kv => format!("Failed to send kv chunk of {room} to {to}: {e}"),
        Part::State => format!("Failed to send state components of {room} to {to}: {e}"),
        Part::Aux => format!("Failed to send aux data of {room} to {to}: {e}"),
    }
}

pub(super) fn fail(shared: &Shared, room: u64, reason: String) {
    shared.conclude(room, KvPoll::Failed, None, Some(reason));
}

pub(super) fn room_failed(shared: &Shared, room: u64) -> bool {
    matches!(shared.step(Input::Stopped { room }), Output::Flag(true))
}

/// Whether `room` takes no more writes (failed, aborted or cleared).
/// Counts an engine failure and blacklists the session, only on
/// session-level evidence: a restarted peer is alive, and a block outside
/// the peer's regions (one bad transfer request) or a malformed call is the
/// room's own fault, so neither blacklists the session and other rooms to
/// it go on. A failure of a batch planned for an older registration of the
/// session (it registered again since: a restarted decode) says nothing
/// about the new one and never blacklists it.
pub(crate) fn engine_failure(shared: &Shared, dest: &TransferInfo, error: &TransferError) {
    let session = dest.session.as_str();
    let current = shared.peers.read().get(session).map(|p| p.generation);
    if current.is_some_and(|g| g != dest.registration) {
        shared.metrics.failure("stale_registration");
        tracing::debug!(%session, error = %error, "late failure of a batch for an older registration");
        return;
    }
    match error.kind {
        ErrorKind::PeerRestarted => {
            // The session is alive (a new incarnation answers); only rooms
            // planned for the old one are stale.
            shared.metrics.failure("stale_registration");
            return;
        }
        ErrorKind::OutOfRegion(_) | ErrorKind::InvalidArgument => {
            shared.metrics.failure("room_request");
            tracing::warn!(%session, error = %error, "transfer refused for this room only; session stays usable");
            return;
        }
        _ => {}
    }
    shared.metrics.failure("engine");
    let outcome = shared.health.lock().record_failure(session, Instant::now());
    if outcome.newly_blacklisted {
        tracing::error!(%session, "session failed; blacklisted until a probe or re-registration succeeds");
    }
}
