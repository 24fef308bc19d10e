//! The prefill bootstrap thread: decode registrations, transfer requests,
//! aborts and staging control messages arrive on one PULL socket.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use kvbridge_plan::{PreparedPeer, StagingSource, TransferRequest};
use kvbridge_wire::{Abort, KvPoll, Limits, Register, StagingRsp, ToPrefill, Transfer, Watermark};

use super::Shared;
use super::room::{Admission, Input, Output};
use super::staging::{self as staged, StagingDest};
use super::state::{AckTarget, Peer, PeerEntry, TransferInfo};
use crate::control::PullSocket;
use crate::kv_args::peer_registration;
use crate::role;
use crate::stage::{self, Stage};

/// Receives until the manager stops.
pub(crate) fn run(shared: &Shared, socket: PullSocket) {
    while !shared.stopped.load(Ordering::SeqCst) {
        if let Some(frames) = role::next_message(&socket, Duration::from_millis(20), "prefill") {
            handle(shared, &frames);
        }
    }
}

/// Applies one message.
pub(crate) fn handle(shared: &Shared, frames: &[Vec<u8>]) {
    // A staging message may end with its pair MAC (secret mode).
    let (frames, mac) = kvbridge_wire::split_mac(frames);
    let bound = |session: Option<&str>, kind: &'static str| {
        let metric = if kind == "TRANSFER" || kind == "ABORT" {
            "unbound"
        } else {
            "staging_unbound"
        };
        bound_to(shared, session, frames, mac, (kind, metric))
    };
    match ToPrefill::decode(frames, &Limits::DEFAULT) {
        Ok(ToPrefill::Register(r)) => on_register(shared, &r),
        Ok(ToPrefill::Transfer(t)) if bound(Some(&t.mooncake_session_id), "TRANSFER") => {
            on_transfer(shared, &t);
        }
        Ok(ToPrefill::Abort(a)) if bound(session_at(shared, &a).as_deref(), "ABORT") => {
            on_abort(shared, &a);
        }
        Ok(ToPrefill::Watermark(w)) if bound(Some(&w.session_id), "WATERMARK") => {
            on_watermark(shared, &w);
        }
        Ok(ToPrefill::StagingRsp(s)) if bound(Some(&s.session_id), "STAGING_RSP") => {
            on_staging_rsp(shared, &s);
        }
        Ok(
            ToPrefill::Transfer(_)
            | ToPrefill::Abort(_)
            | ToPrefill::Watermark(_)
            | ToPrefill::StagingRsp(_),
        ) => {}
        Err(e) => role::drop_malformed(&shared.metrics, &e, frames.len()),
    }
}

/// The decode session whose registration names the control endpoint an
/// ABORT asks to be acknowledged at.
fn session_at(shared: &Shared, a: &Abort<'_>) -> Option<String> {
    shared
        .peers
        .read()
        .iter()
        .find(|(_, e)| e.control.0 == a.decode_ip && e.control.1 == a.decode_port)
        .map(|(session, _)| session.clone())
}

/// Whether a message from decode `session` (a transfer request, an ABORT
/// or a staging message) came from that decode rank: in secret mode its
/// MAC must verify under the pair key the session registered with; open
/// mode takes it as sglang sends it. An unbound one is counted under
/// `metric` and logged; the caller drops it.
fn bound_to(
    shared: &Shared,
    session: Option<&str>,
    frames: &[Vec<u8>],
    mac: Option<[u8; kvbridge_wire::MAC_LEN]>,
    (kind, metric): (&'static str, &'static str),
) -> bool {
    if shared.config.secret.is_none() {
        return true;
    }
    let key = session.and_then(|s| shared.peers.read().get(s).and_then(|e| e.pair_key));
    let ok =
        matches!((key, mac), (Some(key), Some(mac)) if crate::seal::verify(&key, frames, &mac));
    if !ok {
        shared.metrics.dropped(metric);
        tracing::warn!(
            session = session.unwrap_or("-"),
            kind,
            registered = key.is_some(),
            mac = mac.is_some(),
            "dropping a message no registered decode rank sent (no MAC under its pair key)"
        );
    }
    ok
}

/// Why a secret-mode registration must be refused: no pair key, or another
/// key than the one the same incarnation of the session registered with
/// (a member impersonating that decode rank).
fn unbound_registration(shared: &Shared, r: &Register<'_>, session: &str) -> Option<String> {
    shared.config.secret.as_ref()?;
    let Some(key) = r.pair_key else {
        return Some(format!(
            "a registration for decode session {session} carries no pair key (secret mode)"
        ));
    };
    let peers = shared.peers.read();
    let known = peers.get(session)?;
    let incarnation = r.incarnation.unwrap_or(0);
    (known.incarnation == incarnation && known.pair_key != Some(key)).then(|| {
        format!(
            "a registration for decode session {session} (incarnation {incarnation}) carries              another pair key than the one it registered with; a member may be impersonating it"
        )
    })
}

/// A decode rank (re-)registers: prepare it for planning now, so a layout
/// that cannot work is rejected here, loudly, not at the first transfer. A
/// re-registration is a new incarnation: its old state is replaced and any
/// blacklisting lifted.
fn on_register(shared: &Shared, r: &Register<'_>) {
    let session = r.mooncake_session_id.to_string();
    {
        let peers = shared.peers.read();
        if !peers.contains_key(&session) && peers.len() >= shared.config.max_sessions {
            drop(peers);
            shared.metrics.dropped("registration_over_limit");
            tracing::warn!(
                %session,
                max = shared.config.max_sessions,
                "refusing a registration: too many decode sessions registered"
            );
            return;
        }
    }
    if let Some(reason) = unbound_registration(shared, r, &session) {
        shared.metrics.dropped("registration_unbound");
        tracing::error!(%session, %reason, "refusing a decode registration");
        return;
    }
    // The same incarnation registering the same buffers again (its cache
    // of our address was flushed, e.g. while our bootstrap server was
    // away) is no restart: its rooms in flight stay valid.
    let digest = registration_digest(r);
    let unchanged = shared.peers.read().get(&session).is_some_and(|known| {
        r.incarnation
            .is_some_and(|n| n != 0 && n == known.incarnation)
            && known.digest == digest
    });
    if unchanged {
        shared.health.lock().recovered(&session);
        tracing::debug!(%session, "decode registered again, unchanged");
        return;
    }
    let layout = &shared.kv_args.layout;
    let prepared = PreparedPeer::new(layout, peer_registration(r))
        .and_then(|p| p.config_error(layout).map_or(Ok(p), Err));
    let peer = match prepared {
        Ok(p) => {
            if r.dst_aux_ptrs.len() != shared.kv_args.layout.aux_data_ptrs.len() {
                tracing::error!(
                    %session,
                    decode = r.dst_aux_ptrs.len(),
                    prefill = shared.kv_args.layout.aux_data_ptrs.len(),
                    "decode registered a different number of aux buffers"
                );
            }
            tracing::info!(%session, endpoint = %r.endpoint, port = r.dst_port, "decode registered");
            Peer::Ready(p)
        }
        Err(e) => {
            shared.metrics.failure("registration");
            tracing::error!(%session, error = %e, "rejecting decode registration");
            Peer::Rejected(format!("decode registration from {session} rejected: {e}"))
        }
    };
    let staging = staging_dest(shared, r, &peer);
    let generation = shared.next_generation.fetch_add(1, Ordering::SeqCst);
    // A registration is a new ring (or none): the old one's watermark
    // says nothing about it.
    shared.step(Input::Registered { session: &session });
    shared.peers.write().insert(
        session.clone(),
        Arc::new(PeerEntry {
            generation,
            incarnation: r.incarnation.unwrap_or(0),
            peer,
            staging,
            pair_key: r.pair_key,
            aux_batch: r.aux_batch,
            digest,
            control: (r.endpoint.to_string(), r.dst_port),
        }),
    );
    shared.health.lock().recovered(&session);
}

/// SHA-256 of a registration's frames (its whole content, pair key and
/// incarnation included).
fn registration_digest(r: &Register<'_>) -> [u8; 32] {
    use sha2::{Digest, Sha256};
    let mut h = Sha256::new();
    for f in r.encode() {
        h.update((f.len() as u64).to_le_bytes());
        h.update(&f);
    }
    h.finalize().into()
}

/// How we stage towards a registered decode rank: both sides stage, and
/// the pair's layouts stage (another TP size, a plain MHA/GQA pool).
fn staging_dest(shared: &Shared, r: &Register<'_>, peer: &Peer) -> Option<StagingDest> {
    shared.staging.as_ref()?;
    let Peer::Ready(prepared) = peer else {
        return None;
    };
    if r.staging_base_ptr == 0 || r.staging_total_size == 0 {
        return None;
    }
    match StagingSource::new(&shared.kv_args.layout, prepared.registration()) {
        Ok(source) => {
            tracing::info!(
                session = %r.mooncake_session_id,
                ring = r.staging_total_size,
                "staging towards this decode rank"
            );
            Some(StagingDest {
                source,
                ring_base: r.staging_base_ptr,
                ring_size: r.staging_total_size,
            })
        }
        Err(e) => {
            tracing::debug!(session = %r.mooncake_session_id, error = %e, "no staging towards this decode rank");
            None
        }
    }
}

fn on_transfer(shared: &Shared, t: &Transfer<'_>) {
    let request = t.pages.as_ref().map(|p| TransferRequest {
        dst_kv_indices: p.dst_kv_indices.to_vec(),
        dst_aux_index: p.dst_aux_index,
        dst_state_indices: p
            .dst_state_indices
            .iter()
            .map(|l| l.iter().map(i64::from).collect())
            .collect(),
        decode_prefix_len: t.decode_prefix_len,
        dst_device_kv_indices: p
            .dst_device_kv_indices
            .as_ref()
            .filter(|d| !d.is_empty())
            .map(|d| d.to_vec()),
    });
    let session = t.mooncake_session_id.to_string();
    let registration = shared
        .peers
        .read()
        .get(&session)
        .map_or(0, |p| p.generation);
    let info = Arc::new(TransferInfo {
        endpoint: t.endpoint.to_string(),
        dst_port: t.dst_port,
        session,
        request,
        required_dst_info_num: t.required_dst_info_num,
        decode_prefix_len: t.decode_prefix_len,
        registration,
    });
    let room = t.room;
    let device_pages = t
        .pages
        .as_ref()
        .and_then(|p| p.dst_device_kv_indices.as_ref())
        .is_some_and(|d| !d.is_empty());
    if device_pages && shared.kv_args.layout.mla_compression_ratios.is_none() {
        // HiSparse device destinations exist only for compressed-MLA pools;
        // writing dst_kv_indices instead would put the KV in the wrong pages.
        shared.metrics.failure("unsupported_destination");
        let reason = format!(
            "room {room}: the decode names HiSparse device destinations (dst_device_kv_indices), \
             but this prefill's pool is not compressed MLA (no mla_compression_ratios); \
             refusing the room instead of writing other pages"
        );
        refuse(shared, room, &info, reason);
        return;
    }
    if shared.cp.is_dummy() {
        // Only CP rank 0 sends unless every CP rank shares the transfer: a
        // decode asking this rank expects a share it will never get.
        shared.metrics.failure("cp_mismatch");
        let reason = format!(
            "room {room}: decode session {} asked prefill CP rank {} of {}, which sends nothing \
             unless SGLANG_DISAGGREGATION_ALL_CP_RANKS_TRANSFER is on for the prefill too",
            info.session, shared.config.rank.attn_cp_rank, shared.config.rank.attn_cp_size
        );
        refuse(shared, room, &info, reason);
        return;
    }
    // A session whose registration was rejected: say why now, not when the
    // prefill reaches the room.
    let rejected = shared
        .peers
        .read()
        .get(&info.session)
        .and_then(|p| match &p.peer {
            Peer::Rejected(reason) => Some(reason.clone()),
            Peer::Ready(_) => None,
        });
    if let Some(reason) = rejected {
        refuse(shared, room, &info, format!("room {room}: {reason}"));
        return;
    }
    let Output::Transfer(admission, expired) = shared.step(Input::Transfer {
        room,
        info: info.clone(),
        caps: shared.caps(),
        now: Instant::now(),
    }) else {
        return;
    };
    report_expired(shared, expired);
    match admission {
        Admission::Added(Some(infos)) => {
            tracing::debug!(room, "all decode destinations known");
            stage::mark(room, Stage::DestKnown);
            staged::prefetch(shared, room, &infos);
        }
        Admission::Added(None) => {}
        Admission::OverBytes(pending) => {
            shared.metrics.dropped("transfer_over_bytes");
            tracing::warn!(
                room,
                bytes = info.held_bytes(),
                pending,
                max = shared.config.max_pending_request_bytes,
                "refusing a transfer request: pending rooms hold too many destination bytes"
            );
        }
        Admission::OverRooms => {
            shared.metrics.dropped("transfer_over_limit");
            tracing::warn!(
                room,
                max = shared.config.max_rooms,
                "refusing a transfer request: too many rooms pending"
            );
        }
        Admission::OverSession => {
            shared.metrics.dropped("transfer_over_session_limit");
            tracing::warn!(
                room,
                session = %info.session,
                max = shared.config.max_rooms_per_session,
                "refusing a transfer request: this decode session has too many rooms pending"
            );
        }
        Admission::Finished(reason) => {
            // A late request (a restarted decode retrying) for a room
            // already finished here: answer now, or that decode waits out
            // its timeout, pages pinned, for a status nobody will send.
            if let Some(target) = info.status_target() {
                tracing::debug!(room, session = %info.session, "transfer request for a finished room; answering Failed");
                shared.send_status(&[target], room, KvPoll::Failed, reason.as_deref());
            }
        }
        Admission::Restarted => {
            // Earlier chunks went to the dead incarnation, so the new one
            // could never hold every byte. Fail, never resume.
            shared.metrics.failure("restarted_mid_transfer");
            let reason = format!(
                "decode session {} restarted while room {room} was being sent; a room cannot \
                 resume on a new incarnation",
                info.session
            );
            let targets = info.status_target().into_iter().collect();
            shared.conclude(room, KvPoll::Failed, Some(targets), Some(reason));
        }
    }
}

/// Counts and logs the requests of rooms no sender claimed within the
/// bootstrap timeout, dropped to make space.
fn report_expired(shared: &Shared, expired: usize) {
    if expired > 0 {
        shared.metrics.dropped_n("transfer_expired", expired as u64);
        tracing::warn!(
            rooms = expired,
            timeout = ?shared.config.bootstrap_timeout,
            "dropping transfer requests for rooms no sender claimed within the bootstrap timeout"
        );
    }
}

/// Fails `room` at once with `reason` and tells the decode that asked. A
/// room this rank has no sender for yet is entered as failed (up to
/// `max_rooms` rooms), so the sender, once created, polls `Failed` with the
/// reason instead of waiting out its bootstrap timeout.
fn refuse(shared: &Shared, room: u64, info: &TransferInfo, reason: String) {
    let targets: Vec<(String, u16)> = info.status_target().into_iter().collect();
    shared.step(Input::Refuse {
        room,
        max_rooms: shared.config.max_rooms,
    });
    if shared
        .conclude(
            room,
            KvPoll::Failed,
            Some(targets.clone()),
            Some(reason.clone()),
        )
        .is_none()
    {
        shared.send_status(&targets, room, KvPoll::Failed, Some(&reason));
    }
}

/// Mark the room Failed first (no new chunk is accepted after this), then
/// acknowledge once nothing of the room is in flight, so no write lands
/// after the ACK.
fn on_abort(shared: &Shared, a: &Abort<'_>) {
    let room = a.room;
    let target = AckTarget {
        ip: a.decode_ip.to_string(),
        port: a.decode_port,
        generation: a.generation,
    };
    let Output::Aborted(effect) = shared.step(Input::Abort {
        room,
        target,
        caps: shared.caps(),
        now: Instant::now(),
    }) else {
        return;
    };
    report_expired(shared, effect.expired);
    if effect.failed {
        shared.metrics.failure("aborted");
    }
    if effect.over_limit {
        shared.metrics.dropped("abort_over_limit");
        tracing::warn!(
            room,
            "too many abort endpoints for one room; ignoring another"
        );
    }
    tracing::debug!(
        room,
        active = effect.active,
        "abort received; ACK once drained"
    );
    if !effect.others.is_empty() {
        shared.send_status(
            &effect.others,
            room,
            KvPoll::Failed,
            Some("Aborted by the decode side (another decode rank of the room)"),
        );
    }
    for target in effect.acks {
        shared.send_abort_ack(room, &target);
    }
}

fn on_watermark(shared: &Shared, w: &Watermark<'_>) {
    shared.step(Input::Watermark {
        session: &w.session_id,
        round: w.wm_round,
        tail: w.wm_tail,
    });
}

fn on_staging_rsp(shared: &Shared, s: &StagingRsp<'_>) {
    let known = shared.step(Input::StagingRsp {
        room: s.room,
        session: &s.session_id,
        chunk: s.chunk_idx,
        allocation: (s.offset, s.round, s.end),
    });
    if !matches!(known, Output::Flag(true)) {
        tracing::warn!(room = s.room, session = %s.session_id, "STAGING_RSP for an unknown destination");
    }
}
