//! The decode thread: status, aux, state, staging notices and abort ACKs
//! arrive from prefill ranks on one PULL socket. A message is applied only
//! if the room expects it: status and ABORT_ACK from the room's own prefill
//! ranks (each counted once, ACKs with the generation of our ABORT),
//! STATE_DATA and AUX_DATA (or kvbridge's AUX_BATCH, every aux slot of a room
//! in one message) only into the room's own slots while it takes
//! writes, and every address also checked against our registered regions.
//! In secret mode each must also carry the MAC of a room rank's pair key.
//! Anything else is dropped, logged and counted.

use std::sync::atomic::Ordering;
use std::time::Duration;

use kvbridge_wire::{
    AUX_BATCH_TAG, AbortAck, AuxBatch, AuxData, Limits, PairKey, StateData, Status, ToDecode,
};

use super::bound::{self, Bound};
use super::room::{Input, Output, StatusEffect};
use super::{Shared, staging};
use crate::control::PullSocket;
use crate::role;
use crate::stage::{self, Stage};

/// Most `STATE_DATA` bytes held before they are written.
const STATE_BATCH_BYTES: usize = 16 << 20;

/// `STATE_DATA` blocks received back to back, written together (one wait
/// for device memory instead of one per block). Flushed before any other
/// message is handled, so a room's status never overtakes its blocks.
#[derive(Default)]
pub(crate) struct StateBatch {
    items: Vec<(u64, u64, Vec<u8>)>,
    bytes: usize,
}

impl StateBatch {
    pub(crate) fn flush(&mut self, shared: &Shared) {
        if self.items.is_empty() {
            return;
        }
        let writes: Vec<(u64, &[u8])> = self
            .items
            .iter()
            .map(|(_, dst, data)| (*dst, data.as_slice()))
            .collect();
        // Our own registry of every buffer (host ones too, which the
        // intra-node transport leaves unregistered with the engine):
        // bounds-checked, and written with host-to-device copies where the
        // buffer is device memory.
        let results = shared.local.registry.write_batch(&writes);
        for ((room, dst, data), r) in self.items.iter().zip(results) {
            if let Err(e) = r {
                shared.metrics.dropped("state_data");
                tracing::error!(
                    room,
                    addr = format_args!("{dst:#x}"),
                    len = data.len(),
                    error = %e,
                    "STATE_DATA targets an unknown region; dropping"
                );
            }
        }
        self.items.clear();
        self.bytes = 0;
    }
}

/// Receives until the manager stops.
pub(crate) fn run(shared: &Shared, socket: PullSocket) {
    let mut batch = StateBatch::default();
    while !shared.stopped.load(Ordering::SeqCst) {
        // Held STATE_DATA is written as soon as the socket goes quiet.
        let wait = if batch.items.is_empty() { 20 } else { 0 };
        match role::next_message(&socket, Duration::from_millis(wait), "decode") {
            Some(frames) => handle(shared, &frames, &mut batch),
            None => batch.flush(shared),
        }
    }
}

/// Applies one message; `STATE_DATA` accumulates in `batch`, which is
/// flushed before any other message is applied.
pub(crate) fn handle(shared: &Shared, frames: &[Vec<u8>], batch: &mut StateBatch) {
    // Every message of a prefill rank ends with its pair MAC (secret mode).
    let (frames, mac) = kvbridge_wire::split_mac(frames);
    let bound = Bound::new(shared, frames, mac);
    if frames
        .first()
        .is_some_and(|f| f.as_slice() == AUX_BATCH_TAG)
    {
        batch.flush(shared);
        match AuxBatch::decode(frames, &Limits::DEFAULT) {
            Ok(a) => on_aux_batch(shared, &a, &bound),
            Err(e) => role::drop_malformed(&shared.metrics, &e, frames.len()),
        }
        return;
    }
    let message = ToDecode::decode(frames, &Limits::DEFAULT);
    if let Ok(ToDecode::StateData(s)) = &message {
        on_state(shared, s, &bound, batch);
        if batch.bytes >= STATE_BATCH_BYTES {
            batch.flush(shared);
        }
        return;
    }
    batch.flush(shared);
    match message {
        Ok(ToDecode::Status(s)) => on_status(shared, &s, &bound),
        Ok(ToDecode::AuxData(a)) => on_aux(shared, &a, &bound),
        Ok(ToDecode::StateData(s)) => on_state(shared, &s, &bound, batch),
        Ok(ToDecode::ChunkReady(c)) => staging::on_chunk_ready(shared, &c, &bound),
        Ok(ToDecode::StagingReq(r)) => staging::on_staging_req(shared, &r, &bound),
        Ok(ToDecode::AbortAck(a)) => on_abort_ack(shared, &a, &bound),
        Err(e) => role::drop_malformed(&shared.metrics, &e, frames.len()),
    }
}

/// sglang `apply_prefill_status`: Success counts once per prefill rank until
/// every expected rank reported; Failed records the reason. Only the room's
/// own prefill ranks are heard, each only under its own pair key (secret
/// mode).
fn on_status(shared: &Shared, s: &Status<'_>, bound: &Bound) {
    let key = match shared.step(Input::StatusSender {
        room: s.room,
        rank: s.prefill_rank,
    }) {
        Output::Sender(Ok(key)) => key,
        Output::Sender(Err(StatusEffect::Foreign)) => {
            shared.metrics.dropped("status_foreign");
            tracing::warn!(
                room = s.room,
                rank = s.prefill_rank,
                "dropping a status from a rank that does not serve this room"
            );
            return;
        }
        _ => {
            tracing::debug!(room = s.room, "dropping late status for a cleared room");
            return;
        }
    };
    stage::mark(s.room, Stage::StatusIn);
    if !bound::from_ranks(shared, key.as_ref(), bound, ("status", s.room)) {
        return;
    }
    let effect = shared.step(Input::Status {
        room: s.room,
        rank: s.prefill_rank,
        status: s.status,
        reason: s.failure_reason.as_deref(),
        layout: &shared.kv_args.layout,
    });
    match effect {
        Output::Status(StatusEffect::Succeeded(delivered)) => {
            shared.metrics.room_concluded(true);
            if let Some((bytes, latency)) = delivered {
                shared.metrics.bytes.inc_by(bytes);
                shared
                    .metrics
                    .transfer_latency
                    .observe(latency.as_secs_f64());
            }
        }
        Output::Status(StatusEffect::Failed) => shared.metrics.room_concluded(false),
        Output::Status(StatusEffect::NoCount) => {
            tracing::warn!(room = s.room, "no expected prefill response count");
        }
        Output::Status(StatusEffect::Ignored) => {
            tracing::warn!(room = s.room, status = %s.status, "ignoring non-terminal status");
        }
        _ => {}
    }
}

/// Whether `[dst, dst + len)` may be written for `room` now: the room
/// waits for its KV (told its ranks where, not concluded) and the range
/// lies in its own slots.
fn room_takes(shared: &Shared, room: u64, dst: u64, len: u64) -> bool {
    shared.step(Input::Takes {
        room,
        layout: &shared.kv_args.layout,
        dst,
        len,
    }) == Output::Flag(true)
}

/// The pair keys a message about `room` may be bound by (`rank`'s, or
/// every rank's of the room for `None`).
fn room_keys(shared: &Shared, room: u64, rank: Option<u64>) -> Vec<PairKey> {
    match shared.step(Input::Keys { room, rank }) {
        Output::Keys(keys) => keys,
        _ => Vec::new(),
    }
}

/// Whether a message that writes `room`'s slots comes from one of the
/// room's prefill ranks (secret mode; always in open mode).
fn from_room(shared: &Shared, room: u64, bound: &Bound, kind: &'static str) -> bool {
    if shared.pair_keys.is_none() {
        return true;
    }
    bound::from_ranks(shared, &room_keys(shared, room, None), bound, (kind, room))
}

fn on_aux(shared: &Shared, a: &AuxData<'_>, bound: &Bound) {
    if !from_room(shared, a.room, bound, "AUX_DATA") {
        return;
    }
    write_aux_slot(shared, a.room, a.buffer_index, a.aux_index, &a.data);
}

/// A room's aux slots in one message (kvbridge's extension): each slot as
/// an `AUX_DATA` of its own would be.
fn on_aux_batch(shared: &Shared, a: &AuxBatch<'_>, bound: &Bound) {
    if !from_room(shared, a.room, bound, "AUX_BATCH") {
        return;
    }
    for (buffer, data) in a.slots() {
        write_aux_slot(shared, a.room, u64::from(buffer), a.aux_index, data);
    }
}

/// Writes one aux slot's bytes if it is one of `room`'s own slots and the
/// room takes writes; else drops them, counted and logged.
fn write_aux_slot(shared: &Shared, room: u64, buffer_index: u64, aux_index: u64, data: &[u8]) {
    let layout = &shared.kv_args.layout;
    let slot = usize::try_from(buffer_index)
        .ok()
        .and_then(|i| layout.aux_slot(i, aux_index).ok());
    let Some((addr, item)) = slot else {
        shared.metrics.dropped("aux_data");
        tracing::error!(
            room,
            buffer = buffer_index,
            "AUX_DATA for an unknown aux buffer; dropping"
        );
        return;
    };
    if data.len() as u64 > item || !room_takes(shared, room, addr, data.len() as u64) {
        shared.metrics.dropped("aux_data");
        tracing::warn!(
            room,
            aux_index,
            len = data.len(),
            item,
            "dropping AUX_DATA: not this room's aux slot, or the room takes no writes"
        );
        return;
    }
    if let Err(e) = shared.local.registry.write_bytes(addr, data) {
        shared.metrics.dropped("aux_data");
        tracing::error!(room, error = %e, "AUX_DATA outside our regions; dropping");
    }
}

fn on_state(shared: &Shared, s: &StateData<'_>, bound: &Bound, batch: &mut StateBatch) {
    if !from_room(shared, s.room, bound, "STATE_DATA") {
        return;
    }
    if !room_takes(shared, s.room, s.dst_addr, s.data.len() as u64) {
        shared.metrics.dropped("state_data");
        tracing::warn!(
            room = s.room,
            addr = format_args!("{:#x}", s.dst_addr),
            len = s.data.len(),
            "dropping STATE_DATA: outside this room's slots, or the room takes no writes"
        );
        return;
    }
    batch.bytes += s.data.len();
    batch.items.push((s.room, s.dst_addr, s.data.to_vec()));
}

/// An ABORT_ACK from one of the room's ranks (or a fenced rank that owes
/// it); the rooms decide whether it counts (see `room.rs`).
fn on_abort_ack(shared: &Shared, a: &AbortAck, bound: &Bound) {
    if shared.pair_keys.is_some()
        && !bound::from_ranks(
            shared,
            &room_keys(shared, a.room, a.prefill_rank),
            bound,
            ("ABORT_ACK", a.room),
        )
    {
        return;
    }
    let verdict = shared.step(Input::AbortAck {
        room: a.room,
        rank: a.prefill_rank,
        generation: a.generation,
    });
    // An ACK for a room that awaits none (cleared, never aborted, or a
    // resent ABORT answered twice) is dropped quietly.
    if matches!(verdict, Output::Ack { refused: true, .. }) {
        shared.metrics.dropped("abort_ack_foreign");
        tracing::warn!(
            room = a.room,
            rank = ?a.prefill_rank,
            generation = ?a.generation,
            "dropping an ABORT_ACK that is not from this room's ranks or not for our ABORT"
        );
    }
}
