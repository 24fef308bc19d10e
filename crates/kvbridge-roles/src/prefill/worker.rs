//! A transfer worker: takes chunks from its shard queue in order, asks the
//! planner for their blocks, and hands them to the engine with a few batches
//! in flight. On the last chunk it sends state components and aux, then the
//! room's status to every decode rank.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Instant;

use crossbeam_channel::{Receiver, TryRecvError};
use kvbridge_engine::{Batch, BatchHandle, ErrorKind, TransferError};
use kvbridge_plan::{Block, Planner, TransferChunk};
use kvbridge_wire::{AuxData, KvPoll, StateData};

use super::pipeline::{Pipeline, Target};
use super::state::{Peer, TransferInfo};
use super::{QueuedChunk, Shared};

/// Batches a worker keeps in flight at least, whatever the thread pool size:
/// enough to overlap planning, sending and acknowledgements.
const MIN_IN_FLIGHT: usize = 4;

/// Processes chunks until a `None` sentinel (teardown) or a closed queue;
/// between chunks it completes batches in flight.
pub(crate) fn run(shared: &Shared, queue: &Receiver<Option<QueuedChunk>>) {
    let mut planner = Planner::new();
    planner.set_strided_kv(shared.engine.copies_runs());
    let mut pipe = Pipeline::new(shared.in_flight.max(MIN_IN_FLIGHT));
    loop {
        let next = if pipe.is_empty() {
            queue.recv().ok().flatten()
        } else {
            match queue.try_recv() {
                Ok(next) => next,
                Err(TryRecvError::Empty) => {
                    // Account for finished batches while watching the
                    // queue: a stuck batch never keeps new chunks waiting.
                    pipe.settle(shared);
                    continue;
                }
                Err(TryRecvError::Disconnected) => None,
            }
        };
        let Some(queued) = next else { break };
        let span = tracing::debug_span!(
            "chunk",
            room = queued.room,
            last = queued.chunk.is_last_chunk
        );
        let _enter = span.enter();
        process(shared, &mut planner, &mut pipe, &queued);
    }
    // Nothing may be left writing once the worker is gone.
    pipe.drain(shared);
}

fn process(shared: &Shared, planner: &mut Planner, pipe: &mut Pipeline, queued: &QueuedChunk) {
    let room = queued.room;
    // Counted at dequeue, before the status check: `outstanding == 0` then
    // means nothing of the room is dequeued or in flight, which the abort
    // ACK relies on.
    let infos = {
        let mut rooms = shared.rooms.lock();
        *rooms.outstanding.entry(room).or_default() += 1;
        match rooms.table.get(room) {
            None | Some(KvPoll::Failed) => None,
            Some(_) => Some(rooms.infos.get(&room).cloned().unwrap_or_default()),
        }
    };
    let ticket = pipe.open(room, queued.chunk.is_last_chunk);
    match infos {
        Some(infos) => send_chunk(shared, planner, pipe, ticket, room, &queued.chunk, &infos),
        None => tracing::debug!(room, "skipping chunk of a failed or cleared room"),
    }
    pipe.close(shared, ticket);
}

/// Ends a chunk once its batches completed: ACK a drained abort, and drop
/// the room's transfer state once it has concluded and nothing of it is
/// outstanding.
pub(crate) fn finish(shared: &Shared, room: u64, is_last: bool) {
    let acks = {
        let mut rooms = shared.rooms.lock();
        if let Some(n) = rooms.outstanding.get_mut(&room) {
            *n = n.saturating_sub(1);
        }
        let drained = rooms.outstanding.get(&room).copied().unwrap_or(0) == 0;
        let acks = rooms.take_drained_acks(room);
        let status = rooms.table.get(room);
        let concluded = match status {
            None | Some(KvPoll::Success) => true,
            Some(KvPoll::Failed) => is_last,
            Some(_) => false,
        };
        if drained && concluded {
            rooms.forget_transfer(room);
        }
        acks
    };
    for target in acks {
        shared.send_abort_ack(room, &target);
    }
}

/// Why a room's transfer stopped early.
enum Stop {
    /// The room was aborted or failed elsewhere; nothing to report.
    Aborted,
    /// The engine failed.
    Engine(TransferError),
}

fn fail(shared: &Shared, room: u64, reason: String) {
    shared.conclude(room, KvPoll::Failed, None, Some(reason));
}

fn room_failed(shared: &Shared, room: u64) -> bool {
    matches!(
        shared.rooms.lock().table.get(room),
        None | Some(KvPoll::Failed)
    )
}

fn send_chunk(
    shared: &Shared,
    planner: &mut Planner,
    pipe: &mut Pipeline,
    ticket: u64,
    room: u64,
    chunk: &TransferChunk,
    infos: &[Arc<TransferInfo>],
) {
    let mut polls: Vec<bool> = Vec::new();
    let mut targets: Vec<(String, u16)> = Vec::new();
    for info in infos {
        let Some(request) = &info.request else {
            // A dummy destination holds no KV from this rank: it succeeds on
            // the last chunk without a status message.
            if chunk.is_last_chunk {
                shared.rooms.lock().table.update(room, KvPoll::Success);
            }
            continue;
        };
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
                break;
            }
        }
        let entry = shared.peers.read().get(&info.session).cloned();
        if let Some(e) = entry
            .as_deref()
            .filter(|e| e.generation != info.registration)
        {
            // The decode registered again after this room's destination
            // arrived: it restarted, and the pages named belong to the dead
            // incarnation. Writing them would corrupt the new one.
            shared.metrics.failure("stale_registration");
            fail(
                shared,
                room,
                format!(
                    "decode session {} registered again (generation {} -> {}) after room {room}'s \
                     destination was sent; the decode restarted",
                    info.session, info.registration, e.generation
                ),
            );
            break;
        }
        let incarnation = entry.as_deref().map_or(0, |e| e.incarnation);
        let prepared = match entry.as_deref().map(|e| &e.peer) {
            Some(Peer::Ready(p)) => p,
            Some(Peer::Rejected(reason)) => {
                fail(shared, room, reason.clone());
                break;
            }
            None => {
                fail(
                    shared,
                    room,
                    format!("no registration from decode session {}", info.session),
                );
                break;
            }
        };
        let plan = match planner.plan_chunk(&shared.kv_args.layout, prepared, request, chunk) {
            Ok(plan) => plan,
            Err(e) => {
                shared.metrics.failure("plan");
                fail(
                    shared,
                    room,
                    format!("cannot plan room {room} for {}: {e}", info.host_port()),
                );
                break;
            }
        };
        let host_port = info.host_port();
        let target = Target {
            session: &info.session,
            incarnation,
            host_port: &host_port,
        };
        let cap = match shared.config.max_batch_blocks {
            0 => usize::MAX,
            n => n,
        };
        let started = Instant::now();
        let mut aborted = false;
        'kv: for batch in plan.kv_batches() {
            for piece in batch.chunks(cap).filter(|p| !p.is_empty()) {
                // An abort (or a failed earlier batch) stops the room at the
                // next batch; what is in flight still completes.
                if pipe.failed(ticket) || room_failed(shared, room) {
                    aborted = true;
                    break 'kv;
                }
                let piece = match ship_host_blocks(shared, room, info, piece) {
                    Ok(rest) => rest,
                    Err(reason) => {
                        fail(shared, room, reason);
                        aborted = true;
                        break 'kv;
                    }
                };
                if !piece.is_empty() {
                    pipe.submit(shared, ticket, target, Batch::Blocks(&piece));
                }
            }
        }
        'runs: for batch in plan.kv_run_batches() {
            if aborted {
                break;
            }
            for piece in batch.chunks(cap).filter(|p| !p.is_empty()) {
                if pipe.failed(ticket) || room_failed(shared, room) {
                    aborted = true;
                    break 'runs;
                }
                if !runs_ship_over_zmq(shared, piece) {
                    pipe.submit(shared, ticket, target, Batch::Runs(piece));
                    continue;
                }
                // Host-resident KV with an intra-node engine: as blocks.
                let blocks = kvbridge_plan::expand_runs(piece);
                match ship_host_blocks(shared, room, info, &blocks) {
                    Ok(rest) if !rest.is_empty() => {
                        pipe.submit(shared, ticket, target, Batch::Blocks(&rest))
                    }
                    Ok(_) => {}
                    Err(reason) => {
                        fail(shared, room, reason);
                        aborted = true;
                        break 'runs;
                    }
                }
            }
        }
        if aborted {
            break;
        }
        shared
            .metrics
            .chunk_latency
            .observe(started.elapsed().as_secs_f64());
        shared.metrics.chunks.inc();
        if !chunk.is_last_chunk {
            continue;
        }
        // Every byte of the room is written before states, aux and status.
        pipe.wait_room(shared, room);
        if pipe.failed(ticket) || room_failed(shared, room) {
            break;
        }
        let states = match ship_host_blocks(shared, room, info, plan.state_blocks()) {
            Ok(rest) => rest,
            Err(reason) => {
                fail(shared, room, reason);
                break;
            }
        };
        match transfer(shared, room, &target, std::iter::once(&*states)) {
            Ok(()) => {}
            Err(Stop::Aborted) => break,
            Err(Stop::Engine(e)) => {
                engine_failure(shared, &info.session, &e);
                fail(
                    shared,
                    room,
                    format!(
                        "Failed to send state components of {room} to {}: {e}",
                        info.host_port()
                    ),
                );
                break;
            }
        }
        // The intra-node transport sends aux over zmq, as the seed does.
        let aux_ok = if shared.config.send_aux_tcp || shared.local.intra {
            send_aux_tcp(shared, room, chunk, info, request.dst_aux_index)
        } else {
            match transfer(shared, room, &target, std::iter::once(plan.aux_blocks())) {
                Ok(()) => true,
                Err(Stop::Aborted) => break,
                Err(Stop::Engine(e)) => {
                    engine_failure(shared, &info.session, &e);
                    tracing::warn!(room, error = %e, "aux transfer failed");
                    false
                }
            }
        };
        polls.push(aux_ok);
        targets.push((info.endpoint.clone(), info.dst_port));
        if polls.len() as u64 == info.required_dst_info_num {
            let ok = polls.iter().all(|p| *p);
            let (status, reason) = if ok {
                (KvPoll::Success, None)
            } else {
                (
                    KvPoll::Failed,
                    Some(format!("Failed to send aux data of {room}")),
                )
            };
            shared.conclude(room, status, Some(targets.clone()), reason);
        }
    }
}

/// Counts an engine failure and blacklists the session, only on
/// session-level evidence: a restarted peer is alive, and a block outside
/// the peer's regions (one bad transfer request) or a malformed call is the
/// room's own fault, so neither blacklists the session and other rooms to
/// it go on.
pub(crate) fn engine_failure(shared: &Shared, session: &str, error: &TransferError) {
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

/// Hands `batches` to the engine, at most `in_flight` batches at a time and
/// at most `max_batch_blocks` blocks each; stops submitting when the room
/// fails (abort) and always waits for what is in flight before returning,
/// so no write outlives this call.
fn transfer<'a>(
    shared: &Shared,
    room: u64,
    target: &Target<'_>,
    batches: impl Iterator<Item = &'a [Block]>,
) -> Result<(), Stop> {
    let cap = match shared.config.max_batch_blocks {
        0 => usize::MAX,
        n => n,
    };
    let mut in_flight: VecDeque<(BatchHandle, u64, u64)> = VecDeque::new();
    let mut error: Option<TransferError> = None;
    let mut aborted = false;
    let done = |handle: BatchHandle, bytes: u64, blocks: u64, error: &mut Option<TransferError>| {
        match handle.wait() {
            Ok(()) => {
                shared.metrics.bytes.inc_by(bytes);
                shared.metrics.blocks.inc_by(blocks);
            }
            Err(e) => {
                error.get_or_insert(e);
            }
        }
    };
    'outer: for batch in batches {
        for piece in batch.chunks(cap) {
            if piece.is_empty() {
                continue;
            }
            let status = shared.rooms.lock().table.get(room);
            if matches!(status, None | Some(KvPoll::Failed)) {
                aborted = true;
                break 'outer;
            }
            while in_flight.len() >= shared.in_flight.max(1) {
                if let Some((h, bytes, blocks)) = in_flight.pop_front() {
                    done(h, bytes, blocks, &mut error);
                }
            }
            if error.is_some() {
                break 'outer;
            }
            let bytes: u64 = piece.iter().map(|b| b.len).sum();
            let to = kvbridge_engine::Target::exact(target.session, target.incarnation);
            let handle = shared.engine.submit(to, Batch::Blocks(piece));
            in_flight.push_back((handle, bytes, piece.len() as u64));
        }
    }
    while let Some((h, bytes, blocks)) = in_flight.pop_front() {
        done(h, bytes, blocks, &mut error);
    }
    match (error, aborted) {
        (Some(e), _) => Err(Stop::Engine(e)),
        (None, true) => Err(Stop::Aborted),
        (None, false) => Ok(()),
    }
}

/// The aux slots over zmq (`AUX_DATA`), ahead of the status message on the
/// same ordered socket. Every prefill aux buffer is sent, as the seed does;
/// the decode drops indices it does not have.
fn send_aux_tcp(
    shared: &Shared,
    room: u64,
    chunk: &TransferChunk,
    info: &TransferInfo,
    dst_aux_index: u64,
) -> bool {
    let layout = &shared.kv_args.layout;
    let Some(src_index) = chunk.prefill_aux_index else {
        tracing::error!(room, "last chunk without a prefill aux index");
        return false;
    };
    let endpoint = info.zmq_endpoint();
    for (i, (ptr, len)) in layout
        .aux_data_ptrs
        .iter()
        .zip(&layout.aux_item_lens)
        .enumerate()
    {
        let Some(src) = len
            .checked_mul(src_index)
            .and_then(|off| ptr.checked_add(off))
        else {
            return false;
        };
        let mut data = vec![0u8; usize::try_from(*len).unwrap_or(0)];
        if let Err(e) = shared.local.registry.read_bytes(src, &mut data) {
            tracing::error!(room, error = %e, "cannot read aux slot");
            return false;
        }
        let message = AuxData {
            room,
            buffer_index: i as u64,
            aux_index: dst_aux_index,
            data: data.into(),
        };
        if let Err(e) = shared
            .push
            .send(&endpoint, message.encode().iter().map(|f| f.as_ref()))
        {
            tracing::warn!(room, error = %e, "cannot send AUX_DATA");
            return false;
        }
    }
    true
}

/// With the intra-node transport active, sends the blocks whose source is
/// host memory as `STATE_DATA` over the decode's ordered zmq socket (the
/// seed's `_send_host_blocks_tcp`: read locally, with a device-to-host copy
/// where needed) and returns the rest for the engine. Without it, returns
/// every block.
/// Whether any copy of `runs` reads host memory that travels over zmq.
fn runs_ship_over_zmq(shared: &Shared, runs: &[kvbridge_plan::Run]) -> bool {
    let local = &shared.local;
    local.intra
        && runs.iter().any(|r| {
            // A span that overflows is malformed: the engine refuses it.
            r.spans()
                .is_some_and(|(span, _)| span > 0 && local.ships_over_zmq(r.src, span))
        })
}

fn ship_host_blocks<'a>(
    shared: &Shared,
    room: u64,
    info: &TransferInfo,
    blocks: &'a [Block],
) -> Result<std::borrow::Cow<'a, [Block]>, String> {
    let local = &shared.local;
    if !local.intra || !blocks.iter().any(|b| local.ships_over_zmq(b.src, b.len)) {
        return Ok(std::borrow::Cow::Borrowed(blocks));
    }
    let endpoint = info.zmq_endpoint();
    let mut rest = Vec::with_capacity(blocks.len());
    for b in blocks {
        if b.len == 0 {
            continue;
        }
        if !local.ships_over_zmq(b.src, b.len) {
            rest.push(*b);
            continue;
        }
        let len = usize::try_from(b.len).map_err(|_| format!("block of {} bytes", b.len))?;
        let data = local
            .registry
            .read_vec(b.src, len)
            .map_err(|e| format!("cannot read host block of room {room}: {e}"))?;
        let message = StateData {
            room,
            dst_addr: b.dst,
            data: data.into(),
        };
        shared
            .push
            .send(&endpoint, message.encode().iter().map(|f| f.as_ref()))
            .map_err(|e| format!("cannot send STATE_DATA of room {room} to {endpoint}: {e}"))?;
        shared.metrics.bytes.inc_by(b.len);
        shared.metrics.blocks.inc();
    }
    Ok(std::borrow::Cow::Owned(rest))
}
