//! The lane threads of the sending side: each keeps one connection to a
//! peer (re-connecting when it is absent, stale or closed), pushes the
//! peer's requests through it with up to `pipeline_depth` in flight, and
//! turns the acks into the items' results.

use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::atomic::Ordering;

use crossbeam_channel::Receiver;

use super::conn::{Conn, connect, read_ack};
use super::request::{Item, Piece, Work};
use super::send::{LaneBufs, SendError, send_item};
use super::{Inner, PeerInfo};
use crate::session::io;
use crate::session::wire::{Ack, Status};
use crate::{ErrorKind, Side, TransferError};

/// Turn an ack into the item's result.
fn ack_result(item: &Item, ack: &Ack) -> Result<(), TransferError> {
    let block = || item.pieces().get(ack.index as usize).map(|p| p.block);
    let session = &item.batch.session;
    match ack.status {
        Status::Ok => Ok(()),
        Status::OutOfRegion => Err(TransferError::new(
            session,
            block(),
            ErrorKind::OutOfRegion(Side::Remote),
            "peer refused a destination outside its registered regions; nothing of the request was written",
        )),
        Status::BadRequest => {
            Err(item.error(ErrorKind::Refused, "peer refused a malformed request"))
        }
        Status::Memory => Err(TransferError::new(
            session,
            block(),
            ErrorKind::Io,
            "peer failed to write into its memory",
        )),
        Status::ShuttingDown => Err(item.error(ErrorKind::Refused, "peer is shutting down")),
        Status::Revoked => Err(item.error(
            ErrorKind::Refused,
            "peer sent a revoke on a data connection",
        )),
    }
}

/// Fail every in-flight item with `e` (first block of each).
fn fail_all(inflight: &mut VecDeque<(u64, Item)>, e: &TransferError) {
    for (_, it) in inflight.drain(..) {
        let mut e = e.clone();
        e.block = it.first_block();
        it.finish(Err(e));
    }
}

/// Drop a connection, forgetting its shutdown clone.
/// The error of an item that finds its lane without a connection.
fn no_connection(info: &PeerInfo) -> TransferError {
    TransferError::new(&info.session, None, ErrorKind::Io, "no connection")
}

fn close(info: &PeerInfo, conn: &mut Option<Conn>) {
    if let Some(c) = conn.take() {
        info.live.lock().remove(&c.id);
    }
}

/// Drop a connection whose requests failed: reset, not closed, so that
/// nothing still queued in the kernel reaches the peer after the failure
/// was reported (once a partition heals, say, into pages the decode has
/// since given to another request). The peer drops what it had received
/// but not yet read (`io::reset_by_peer`).
fn abandon(info: &PeerInfo, conn: &mut Option<Conn>) {
    if let Some(c) = conn.as_ref() {
        io::reset_on_close(c.fd());
    }
    close(info, conn);
}

/// Make sure `conn` is usable: reconnect if absent, stale (peer restarted) or closed by the peer.
fn ensure_conn(
    inner: &Inner,
    info: &PeerInfo,
    conn: &mut Option<Conn>,
) -> Result<(), TransferError> {
    if let Some(c) = conn {
        let known = info.incarnation.load(Ordering::Acquire);
        // Idle for half the idle timeout: the peer may be about to close
        // it, so open a fresh one rather than race with its close.
        let stale = c.last_used.elapsed() >= inner.cfg.idle_timeout() / 2;
        if (known != 0 && known != c.incarnation) || stale || io::idle_peer_gone(c.fd()) {
            tracing::debug!(session = %info.session, "pooled connection is stale; reconnecting");
            close(info, conn);
        }
    }
    if conn.is_none() {
        let c = connect(inner, &info.session, info.addr)?;
        let old = info.incarnation.swap(c.incarnation, Ordering::AcqRel);
        if old != 0 && old != c.incarnation {
            tracing::info!(session = %info.session, "peer restarted (new incarnation); old state dropped");
        }
        if let Ok(clone) = c.stream.try_clone() {
            info.live.lock().insert(c.id, clone);
        }
        *conn = Some(c);
    }
    Ok(())
}

/// After a successful check: queue the batch's writes to the peer's lanes.
fn release_deferred(inner: &Inner, item: &Item) {
    let deferred = std::mem::take(&mut *item.batch.deferred.lock());
    item.batch
        .remaining
        .fetch_add(deferred.len(), Ordering::AcqRel);
    let tx = inner
        .peers
        .lock()
        .get(&item.batch.session)
        .map(|p| p.tx.clone());
    match tx {
        // An item that cannot be queued is dropped, which fails the batch.
        Some(tx) => deferred.into_iter().for_each(|it| drop(tx.send(it))),
        None => drop(deferred),
    }
}

/// A lane: one connection's worth of sending for one peer.
pub(crate) fn lane(inner: Arc<Inner>, info: Arc<PeerInfo>, rx: Receiver<Item>) {
    let depth = inner.cfg.tcp.pipeline_depth.max(1);
    let mut conn: Option<Conn> = None;
    let mut inflight: VecDeque<(u64, Item)> = VecDeque::new();
    let mut bufs = LaneBufs {
        head: Vec::new(),
        frame: Vec::new(),
        iovs: Vec::new(),
    };
    loop {
        let next = if inflight.is_empty() {
            match rx.recv() {
                Ok(it) => Some(it),
                Err(_) => break,
            }
        } else if inflight.len() < depth {
            rx.try_recv().ok()
        } else {
            None
        };
        if let Some(item) = next {
            if item.batch.is_failed() || inner.is_shutdown() {
                let r = if inner.is_shutdown() {
                    Err(item.error(ErrorKind::Shutdown, "engine shut down"))
                } else {
                    Ok(())
                };
                item.finish(r);
                continue;
            }
            if inflight.is_empty()
                && let Err(mut e) = ensure_conn(&inner, &info, &mut conn)
            {
                e.block = item.first_block();
                item.finish(Err(e));
                continue;
            }
            let Some(c) = conn.as_mut() else {
                item.finish(Err(no_connection(&info)));
                continue;
            };
            if item.batch.expected != 0 && c.incarnation != item.batch.expected {
                // Addresses planned for the incarnation that registered them
                // must never reach a restarted process: refuse before sending.
                let detail = format!(
                    "planned for incarnation {:#x}, connected to {:#x}",
                    item.batch.expected, c.incarnation
                );
                let mut e = item.error(ErrorKind::PeerRestarted, detail);
                e.block = item.first_block();
                item.finish(Err(e));
                continue;
            }
            match send_item(&inner, c, &item, &mut bufs) {
                Ok(seq) => inflight.push_back((seq, item)),
                Err(SendError::Local(e)) => item.finish(Err(e)),
                Err(SendError::Conn(e)) => {
                    tracing::debug!(error = %e, "send failed; dropping connection");
                    fail_all(&mut inflight, &e);
                    item.finish(Err(e));
                    abandon(&info, &mut conn);
                }
            }
            continue;
        }
        let Some((seq, item)) = inflight.pop_front() else {
            continue;
        };
        let Some(c) = conn.as_ref() else {
            item.finish(Err(no_connection(&info)));
            continue;
        };
        match read_ack(c.fd()) {
            Ok(Some(ack)) if ack.seq == seq => {
                let r = ack_result(&item, &ack);
                if r.is_ok() {
                    match &item.work {
                        Work::Check(_) => release_deferred(&inner, &item),
                        Work::Write(p) => {
                            let n: u64 = p.iter().map(Piece::bytes).sum();
                            inner.stats.bytes_sent.fetch_add(n, Ordering::Relaxed);
                        }
                    }
                }
                item.finish(r);
            }
            Ok(_) => {
                let e = item.error(
                    ErrorKind::Refused,
                    "peer sent a malformed or out-of-order ack",
                );
                tracing::warn!(error = %e, "dropping connection");
                fail_all(&mut inflight, &e);
                item.finish(Err(e));
                abandon(&info, &mut conn);
            }
            Err(io_e) => {
                let e = item.io_error(&io_e);
                tracing::debug!(error = %e, "ack read failed; dropping connection");
                fail_all(&mut inflight, &e);
                item.finish(Err(e));
                abandon(&info, &mut conn);
            }
        }
    }
    close(&info, &mut conn);
}
