//! The sending side: batches and their requests, connections to a peer
//! (set-up, handshake, reuse, re-connect) and the lane threads that push
//! requests through them.

use std::collections::VecDeque;
use std::net::{SocketAddr, TcpStream};
use std::os::fd::{AsRawFd, RawFd};
use std::sync::Arc;
use std::sync::atomic::Ordering;

use crossbeam_channel::Receiver;
use kvbridge_mem::{MemoryKind, access_for};

use super::request::{Item, Work};
use super::wire::{self, Ack, Challenge, Header, Hello, Op, Status};
use super::{Inner, PeerInfo, auth, io};
use crate::{ErrorKind, Side, TransferError};

/// Size of a lane's frame buffer, into which short blocks are coalesced.
pub(crate) const FRAME_CAP: usize = 1 << 20;

/// An established, authenticated connection to one incarnation of a peer.
#[derive(Debug)]
pub(crate) struct Conn {
    stream: TcpStream,
    incarnation: u64,
    seq: u64,
    id: u64,
}

impl Conn {
    pub(crate) fn fd(&self) -> RawFd {
        self.stream.as_raw_fd()
    }

    /// The incarnation of the peer process this connection reached.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(crate) fn incarnation(&self) -> u64 {
        self.incarnation
    }
}

/// Connect to `addr` and run the client side of the handshake.
pub(crate) fn connect(
    inner: &Inner,
    session: &str,
    addr: SocketAddr,
) -> Result<Conn, TransferError> {
    let cfg = &inner.cfg;
    let err = |kind, d: String| TransferError::new(session, None, kind, d);
    let stream = TcpStream::connect_timeout(&addr, cfg.connect_timeout())
        .map_err(|e| err(ErrorKind::Unreachable, format!("connect to {addr}: {e}")))?;
    let setup = || -> std::io::Result<()> {
        stream.set_nodelay(true)?;
        stream.set_read_timeout(Some(cfg.connect_timeout()))?;
        stream.set_write_timeout(Some(cfg.connect_timeout()))
    };
    setup().map_err(|e| TransferError::from_io(session, None, &e))?;
    let fd = stream.as_raw_fd();
    let io_err = |e: std::io::Error| TransferError::from_io(session, None, &e);
    let secret = inner.secret.as_deref();
    let hello = Hello {
        version: wire::VERSION,
        flags: if secret.is_some() {
            wire::FLAG_SECRET
        } else {
            0
        },
        nonce: auth::nonce(),
    };
    io::write_all(fd, &hello.encode()).map_err(io_err)?;
    let mut cb = [0u8; wire::CHALLENGE_LEN];
    io::read_exact(fd, &mut cb).map_err(io_err)?;
    let ch = Challenge::decode(&cb).ok_or_else(|| {
        err(
            ErrorKind::Refused,
            "peer is not a kvbridge tcp engine".into(),
        )
    })?;
    if ch.version != wire::VERSION {
        return Err(err(
            ErrorKind::Refused,
            format!(
                "peer speaks protocol version {}, we speak {}",
                ch.version,
                wire::VERSION
            ),
        ));
    }
    let proof = match secret {
        Some(s) => {
            if ch.flags & wire::FLAG_SECRET == 0 {
                return Err(err(ErrorKind::Auth, "peer has no cluster secret".into()));
            }
            if !auth::verify_server(s, &hello.nonce, &ch.nonce, ch.incarnation, &ch.proof) {
                return Err(err(
                    ErrorKind::Auth,
                    "peer failed to prove the cluster secret".into(),
                ));
            }
            auth::client_proof(s, &ch.nonce, &hello.nonce, ch.incarnation)
        }
        None => [0u8; wire::NONCE_LEN],
    };
    io::write_all(fd, &proof).map_err(io_err)?;
    let mut vb = [0u8; wire::VERDICT_LEN];
    io::read_exact(fd, &mut vb).map_err(|e| {
        if ch.flags & wire::FLAG_SECRET != 0 && secret.is_none() {
            err(ErrorKind::Auth, "peer requires a cluster secret".into())
        } else {
            io_err(e)
        }
    })?;
    match wire::decode_verdict(&vb) {
        wire::VERDICT_OK => {}
        wire::VERDICT_AUTH => {
            return Err(err(
                ErrorKind::Auth,
                "peer refused our cluster secret proof".into(),
            ));
        }
        v => {
            return Err(err(
                ErrorKind::Refused,
                format!("peer refused the connection ({v})"),
            ));
        }
    }
    let run = || -> std::io::Result<()> {
        stream.set_read_timeout(Some(cfg.io_timeout()))?;
        stream.set_write_timeout(Some(cfg.io_timeout()))
    };
    run().map_err(io_err)?;
    Ok(Conn {
        stream,
        incarnation: ch.incarnation,
        seq: 0,
        id: inner.next_id(),
    })
}

/// Open a fresh connection, ping, and return the peer's incarnation.
pub(crate) fn ping(inner: &Inner, session: &str, addr: SocketAddr) -> Result<u64, TransferError> {
    let c = connect(inner, session, addr)?;
    let h = Header {
        op: Op::Ping,
        count: 0,
        seq: 1,
        payload: 0,
    };
    let io_err = |e: std::io::Error| TransferError::from_io(session, None, &e);
    io::write_all(c.fd(), &h.encode()).map_err(io_err)?;
    let ack = read_ack(c.fd()).map_err(io_err)?;
    match ack {
        Some(a) if a.seq == 1 && a.status == Status::Ok => Ok(c.incarnation),
        _ => Err(TransferError::new(
            session,
            None,
            ErrorKind::Refused,
            "bad ping answer",
        )),
    }
}

fn read_ack(fd: RawFd) -> std::io::Result<Option<Ack>> {
    let mut b = [0u8; wire::ACK_LEN];
    io::read_exact(fd, &mut b)?;
    Ok(Ack::decode(&b))
}

/// Buffers a lane reuses across requests.
struct LaneBufs {
    head: Vec<u8>,
    frame: Vec<u8>,
    iovs: Vec<libc::iovec>,
}

/// Why a request could not be sent.
enum SendError {
    /// Failed before any byte went out: the connection is still in step.
    Local(TransferError),
    /// Failed on the connection: it must be dropped.
    Conn(TransferError),
}

/// Send one request. Holds the local region read guard while the payload
/// is read from registered memory.
fn send_item(
    inner: &Inner,
    c: &mut Conn,
    item: &Item,
    bufs: &mut LaneBufs,
) -> Result<u64, SendError> {
    c.seq += 1;
    let seq = c.seq;
    let fd = c.fd();
    let pieces = item.pieces();
    let count = u32::try_from(pieces.len())
        .map_err(|_| SendError::Local(item.error(ErrorKind::InvalidArgument, "too many blocks")))?;
    bufs.head.clear();
    let op = match item.work {
        Work::Check(_) => Op::Check,
        Work::Write(_) => Op::Write,
    };
    let payload = match op {
        Op::Write => pieces.iter().map(|p| p.len).sum(),
        _ => 0,
    };
    bufs.head.extend_from_slice(
        &Header {
            op,
            count,
            seq,
            payload,
        }
        .encode(),
    );
    for p in pieces {
        wire::push_desc(&mut bufs.head, p.dst, p.len);
    }
    if op == Op::Check {
        io::write_all(fd, &bufs.head).map_err(|e| SendError::Conn(item.io_error(&e)))?;
        return Ok(seq);
    }
    let regions = inner.regions.read_recursive();
    let mut kinds: Vec<MemoryKind> = Vec::with_capacity(pieces.len());
    for p in pieces {
        let r = regions.check(p.src, p.len).map_err(|e| {
            SendError::Local(TransferError::new(
                &item.batch.session,
                Some(p.block),
                ErrorKind::OutOfRegion(Side::Local),
                e.to_string(),
            ))
        })?;
        kinds.push(r.kind);
    }
    let threshold = inner.cfg.coalesce_threshold as u64;
    let force_copy = inner.cfg.force_staging;
    if bufs.frame.len() < FRAME_CAP {
        bufs.frame.resize(FRAME_CAP, 0);
    }
    let conn_err = |e: std::io::Error| SendError::Conn(item.io_error(&e));
    let iovs = &mut bufs.iovs;
    iovs.clear();
    iovs.push(io::iov(bufs.head.as_ptr(), bufs.head.len()));
    let frame_ptr = bufs.frame.as_mut_ptr();
    let mut used = 0usize;
    // Sends what `iovs` describes. SAFETY (for each call site): the iovecs
    // point into `bufs.head`, `bufs.frame` (both alive and not resized until
    // the function returns) and registered source ranges checked above,
    // kept registered by the `regions` read guard held until we return.
    let flush = |iovs: &mut Vec<libc::iovec>, used: &mut usize| -> std::io::Result<()> {
        // SAFETY: see above.
        let r = unsafe { io::send_all(fd, iovs) };
        iovs.clear();
        *used = 0;
        r
    };
    for (p, kind) in pieces.iter().zip(kinds) {
        let len = p.len as usize;
        if len == 0 {
            continue;
        }
        if kind.is_host_accessible() && !force_copy && p.len >= threshold {
            let src = std::ptr::with_exposed_provenance::<u8>(p.src as usize);
            iovs.push(io::iov(src, len));
            if iovs.len() >= io::MAX_IOV {
                flush(iovs, &mut used).map_err(conn_err)?;
            }
            continue;
        }
        let mut off = 0usize;
        while off < len {
            if used == FRAME_CAP {
                flush(iovs, &mut used).map_err(conn_err)?;
            }
            let k = (len - off).min(FRAME_CAP - used);
            // SAFETY: `used + k <= FRAME_CAP == frame.len()`, so the slice is in
            // bounds; no iovec currently covers `frame[used..]`.
            let dst = unsafe { std::slice::from_raw_parts_mut(frame_ptr.add(used), k) };
            // SAFETY: `[p.src + off, +k)` lies in a registered region of `kind`
            // (checked above), kept registered by the guard.
            let r = unsafe { access_for(kind).read(p.src + off as u64, dst) };
            if let Err(e) = r {
                // Bytes of this request may already be on the wire: drop the connection.
                let err = TransferError::new(
                    &item.batch.session,
                    Some(p.block),
                    ErrorKind::Io,
                    e.to_string(),
                );
                return Err(SendError::Conn(err));
            }
            // SAFETY: in bounds as above.
            let start = unsafe { frame_ptr.add(used) };
            match iovs.last_mut() {
                Some(last) if last.iov_base.cast::<u8>().wrapping_add(last.iov_len) == start => {
                    last.iov_len += k;
                }
                _ => iovs.push(io::iov(start, k)),
            }
            used += k;
            off += k;
            if iovs.len() >= io::MAX_IOV {
                flush(iovs, &mut used).map_err(conn_err)?;
            }
        }
    }
    if !iovs.is_empty() {
        flush(iovs, &mut used).map_err(conn_err)?;
    }
    drop(regions);
    Ok(seq)
}

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
fn close(info: &PeerInfo, conn: &mut Option<Conn>) {
    if let Some(c) = conn.take() {
        info.live.lock().remove(&c.id);
    }
}

/// Make sure `conn` is usable: reconnect if absent, stale (peer restarted) or closed by the peer.
fn ensure_conn(
    inner: &Inner,
    info: &PeerInfo,
    conn: &mut Option<Conn>,
) -> Result<(), TransferError> {
    if let Some(c) = conn {
        let known = info.incarnation.load(Ordering::Acquire);
        if (known != 0 && known != c.incarnation) || io::idle_peer_gone(c.fd()) {
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
    let depth = inner.cfg.pipeline_depth.max(1);
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
                item.finish(Err(TransferError::new(
                    &info.session,
                    None,
                    ErrorKind::Io,
                    "no connection",
                )));
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
                    close(&info, &mut conn);
                }
            }
            continue;
        }
        let Some((seq, item)) = inflight.pop_front() else {
            continue;
        };
        let Some(c) = conn.as_ref() else {
            item.finish(Err(TransferError::new(
                &info.session,
                None,
                ErrorKind::Io,
                "no connection",
            )));
            continue;
        };
        match read_ack(c.fd()) {
            Ok(Some(ack)) if ack.seq == seq => {
                let r = ack_result(&item, &ack);
                if r.is_ok() {
                    match &item.work {
                        Work::Check(_) => release_deferred(&inner, &item),
                        Work::Write(p) => {
                            let n: u64 = p.iter().map(|p| p.len).sum();
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
                close(&info, &mut conn);
            }
            Err(io_e) => {
                let e = item.io_error(&io_e);
                tracing::debug!(error = %e, "ack read failed; dropping connection");
                fail_all(&mut inflight, &e);
                item.finish(Err(e));
                close(&info, &mut conn);
            }
        }
    }
    close(&info, &mut conn);
}

/// Test hook behind `TcpEngine::debug_raw_write`: one unchecked `Write` request.
pub(crate) fn raw_write(
    inner: &Inner,
    session: &str,
    blocks: &[(u64, &[u8])],
) -> Result<(), TransferError> {
    let addr = super::resolve(session)?;
    let c = connect(inner, session, addr)?;
    let io_err = |e: std::io::Error| TransferError::from_io(session, None, &e);
    let payload: u64 = blocks.iter().map(|(_, d)| d.len() as u64).sum();
    let count = u32::try_from(blocks.len()).unwrap_or(u32::MAX);
    let mut msg = Header {
        op: Op::Write,
        count,
        seq: 1,
        payload,
    }
    .encode()
    .to_vec();
    for (dst, d) in blocks {
        wire::push_desc(&mut msg, *dst, d.len() as u64);
    }
    for (_, d) in blocks {
        msg.extend_from_slice(d);
    }
    io::write_all(c.fd(), &msg).map_err(io_err)?;
    let ack = read_ack(c.fd()).map_err(io_err)?;
    match ack {
        Some(a) if a.status == Status::Ok => Ok(()),
        Some(a) if a.status == Status::OutOfRegion => Err(TransferError::new(
            session,
            Some(a.index as usize),
            ErrorKind::OutOfRegion(Side::Remote),
            "refused by peer",
        )),
        _ => Err(TransferError::new(
            session,
            None,
            ErrorKind::Refused,
            "refused by peer",
        )),
    }
}
