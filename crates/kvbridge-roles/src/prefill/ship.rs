//! What a prefill worker sends over the decode's ordered zmq socket instead
//! of the engine: with the intra-node transport active, blocks whose source
//! is host memory (`STATE_DATA`, the reference's `_send_host_blocks_tcp`),
//! and aux slots (`AUX_DATA`) when aux goes over zmq.
//!
//! **Owns:** splitting a batch into engine and zmq parts, reading our own
//! buffers for them, and encoding those frames.
//! **Never:** computes an address (aux slots come from the planner's
//! `aux_slot`), or sends a status: the worker sends it after these frames
//! on the same ordered socket.

use std::borrow::Cow;

use kvbridge_engine::Batch;
use kvbridge_plan::{Block, Run};
use kvbridge_wire::{AuxBatch, AuxData, StateData};

use super::Shared;
use super::pipeline::Part;
use super::state::TransferInfo;

/// What of a batch the engine moves.
#[derive(Debug)]
pub(crate) enum ForEngine<'a> {
    /// The batch as planned.
    Planned(Batch<'a>),
    /// The blocks left once host-sourced ones were taken out.
    Rest(Vec<Block>),
}

impl ForEngine<'_> {
    /// The batch to submit (possibly empty).
    pub fn batch(&self) -> Batch<'_> {
        match self {
            ForEngine::Planned(b) => *b,
            ForEngine::Rest(blocks) => Batch::Blocks(blocks),
        }
    }
}

/// Takes the host-sourced blocks out of `batch` (intra-node transport
/// only): KV ones are sent as `STATE_DATA` now, state ones are appended to
/// `later` (sent once the room's KV is written); returns what the engine
/// moves. `Err` with the room's failure reason when a frame cannot be sent.
pub(crate) fn for_engine<'a>(
    shared: &Shared,
    room: u64,
    info: &TransferInfo,
    part: Part,
    batch: Batch<'a>,
    later: &mut Vec<Block>,
) -> Result<ForEngine<'a>, String> {
    let local = &shared.local;
    let blocks: Cow<'_, [Block]> = match batch {
        _ if !local.intra => return Ok(ForEngine::Planned(batch)),
        Batch::Blocks(b) if b.iter().any(|b| local.ships_over_zmq(b.src, b.len)) => {
            Cow::Borrowed(b)
        }
        // Host-resident KV runs go as blocks.
        Batch::Runs(r) if runs_ship_over_zmq(shared, r) => {
            Cow::Owned(kvbridge_plan::expand_runs(r))
        }
        _ => return Ok(ForEngine::Planned(batch)),
    };
    let mut host = Vec::new();
    let mut rest = Vec::with_capacity(blocks.len());
    for b in blocks.iter().filter(|b| b.len > 0) {
        if local.ships_over_zmq(b.src, b.len) {
            host.push(*b);
        } else {
            rest.push(*b);
        }
    }
    match part {
        Part::State => later.extend(host),
        Part::Kv | Part::Aux => ship_blocks(shared, room, info, &host)?,
    }
    Ok(ForEngine::Rest(rest))
}

/// Whether any copy of `runs` reads host memory that travels over zmq.
fn runs_ship_over_zmq(shared: &Shared, runs: &[Run]) -> bool {
    let local = &shared.local;
    local.intra
        && runs.iter().any(|r| {
            // A span that overflows is malformed: the engine refuses it.
            r.spans()
                .is_some_and(|(span, _)| span > 0 && local.ships_over_zmq(r.src, span))
        })
}

/// Sends `blocks` (host-sourced) as `STATE_DATA` frames on the decode's
/// ordered zmq socket, read from our own buffers.
pub(crate) fn ship_blocks(
    shared: &Shared,
    room: u64,
    info: &TransferInfo,
    blocks: &[Block],
) -> Result<(), String> {
    let endpoint = info.zmq_endpoint();
    let key = shared.pair_key_of(&info.session);
    for b in blocks.iter().filter(|b| b.len > 0) {
        let len = usize::try_from(b.len).map_err(|_| format!("block of {} bytes", b.len))?;
        let data = shared
            .local
            .registry
            .read_vec(b.src, len)
            .map_err(|e| format!("cannot read host block of room {room}: {e}"))?;
        let message = StateData {
            room,
            dst_addr: b.dst,
            data: data.into(),
        };
        let frames = crate::seal::seal(key.as_ref(), message.encode());
        shared
            .push
            .send(&endpoint, frames.iter().map(|f| f.as_ref()))
            .map_err(|e| format!("cannot send STATE_DATA of room {room} to {endpoint}: {e}"))?;
        shared.metrics.bytes.inc_by(b.len);
        shared.metrics.blocks.inc();
        shared.step(super::room::Input::Payload { room, bytes: b.len });
    }
    Ok(())
}

/// The aux slots over zmq, ahead of the status message on the same ordered
/// socket: one `AuxBatch` to a decode rank that announced it takes them (a
/// kvbridge decode), else one `AUX_DATA` per aux buffer as the reference
/// sends. Every prefill aux buffer is sent, as the reference does; the
/// decode drops indices it does not have.
pub(crate) fn send_aux(
    shared: &Shared,
    room: u64,
    src_index: Option<u64>,
    info: &TransferInfo,
    dst_aux_index: u64,
) -> bool {
    let layout = &shared.kv_args.layout;
    let Some(src_index) = src_index else {
        tracing::error!(room, "last chunk without a prefill aux index");
        return false;
    };
    let mut slots = Vec::with_capacity(layout.aux_data_ptrs.len());
    for i in 0..layout.aux_data_ptrs.len() {
        let (src, len) = match layout.aux_slot(i, src_index) {
            Ok(slot) => slot,
            Err(e) => {
                tracing::error!(room, buffer = i, error = %e, "no aux slot to send");
                return false;
            }
        };
        let (Ok(buffer), Ok(len)) = (u32::try_from(i), usize::try_from(len)) else {
            return false;
        };
        let mut data = vec![0u8; len];
        if let Err(e) = shared.local.registry.read_bytes(src, &mut data) {
            tracing::error!(room, error = %e, "cannot read aux slot");
            return false;
        }
        slots.push((buffer, data));
    }
    let endpoint = info.zmq_endpoint();
    let key = shared.pair_key_of(&info.session);
    let send = |frames: kvbridge_wire::Frames<'_>, kind: &str| {
        let frames = crate::seal::seal(key.as_ref(), frames);
        match shared
            .push
            .send(&endpoint, frames.iter().map(|f| f.as_ref()))
        {
            Ok(()) => true,
            Err(e) => {
                tracing::warn!(room, error = %e, "cannot send {kind}");
                false
            }
        }
    };
    let batch = shared
        .peers
        .read()
        .get(&info.session)
        .is_some_and(|e| e.aux_batch);
    if batch && !slots.is_empty() {
        let refs: Vec<(u32, &[u8])> = slots.iter().map(|(b, d)| (*b, d.as_slice())).collect();
        let Some(message) = AuxBatch::from_slots(room, dst_aux_index, &refs) else {
            tracing::error!(room, "aux slots too large for one AUX_BATCH");
            return false;
        };
        return send(message.encode(), "AUX_BATCH");
    }
    slots.into_iter().all(|(buffer, data)| {
        let message = AuxData {
            room,
            buffer_index: u64::from(buffer),
            aux_index: dst_aux_index,
            data: data.into(),
        };
        send(message.encode(), "AUX_DATA")
    })
}
