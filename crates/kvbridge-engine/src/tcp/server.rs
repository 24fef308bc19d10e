//! The receiving side: one thread per connection (accepted by the session
//! layer's loop, `session::server`, which this engine plugs into) that
//! authenticates the peer, validates every request against our registered
//! regions, and scatters payloads straight into them ([`super::scatter`]).
//!
//! Limits against hostile or failing peers: at most `max_connections`
//! accepted connections (more are closed at once), of them at most
//! `max_pending_handshakes` in their handshake (a new one closes the
//! oldest); `accept` running out of
//! descriptors or memory backs off instead of spinning; the handshake has a
//! total deadline (`connect_timeout_ms`), each request one too
//! (`request_timeout_ms`, besides the `io_timeout_ms` no-progress limit),
//! and a connection idle for `idle_timeout_ms` is closed. Every wait is cut
//! into ticks that check for shutdown and for the connection's abort flag
//! (set when its peer is fenced).

use std::net::TcpStream;
use std::os::fd::{AsRawFd, RawFd};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use super::Inner;
use super::handshake::{self, PeerId, Refusal};
use super::stats::bump;
use crate::session::control::Holder;
use crate::session::io::{self, Budget};
use crate::session::wire::{self, Ack, Header, Op, Status};

/// Size of a connection's bounce buffer for short (or staged) blocks.
pub(super) const BOUNCE_CAP: usize = 1 << 20;
/// Descriptors validated per chunk of a `Check` request.
const CHECK_CHUNK: usize = 4096;
/// Poll tick while waiting for the next request (shutdown / freeze / idle checks).
const IDLE_TICK_MS: i32 = 200;
impl crate::session::server::Service for Inner {
    const WHAT: &'static str = "tcp engine";
    const THREAD: &'static str = "kvb-tcp-serve";

    fn is_shutdown(&self) -> bool {
        Inner::is_shutdown(self)
    }

    fn max_connections(&self) -> usize {
        self.cfg.tcp.max_connections
    }

    fn gate(&self) -> &crate::session::server::Gate {
        &self.stats.gate
    }

    /// Keeps a handle to shut it (fences, evictions, engine shutdown) and
    /// counts it in its handshake.
    fn admit(&self, stream: &TcpStream) -> u64 {
        let id = self.next_id();
        if let Ok(c) = stream.try_clone() {
            self.accepted.lock().insert(id, c);
        }
        admit_pending(self, id);
        id
    }

    fn serve(self: Arc<Self>, stream: TcpStream, id: u64, accepted_at: Instant) {
        serve(self, stream, id, accepted_at);
    }

    fn abandon(&self, id: u64) {
        self.accepted.lock().remove(&id);
        handshake_over(self, id);
    }
}

/// Counts connection `id` as in its handshake; when `max_pending_handshakes`
/// already are, closes the oldest of them (a member's handshake takes
/// milliseconds, so the oldest is a stranger's that never finishes).
fn admit_pending(inner: &Inner, id: u64) {
    let cap = inner.cfg.tcp.max_pending_handshakes.max(1);
    let evicted = {
        let mut pending = inner.pending.lock();
        let oldest = (pending.len() >= cap)
            .then(|| pending.pop_front())
            .flatten();
        pending.push_back(id);
        oldest
    };
    let stats = &inner.stats;
    stats
        .handshakes_pending
        .store(inner.pending.lock().len() as u64, Ordering::Relaxed);
    let Some(old) = evicted else {
        return;
    };
    // Its thread sees the socket shut and ends; the count follows.
    if let Some(s) = inner.accepted.lock().get(&old) {
        let _ = s.shutdown(std::net::Shutdown::Both);
    }
    bump(&stats.handshakes_evicted);
    if let Some(suppressed) = stats.log_evicted.hit() {
        tracing::warn!(
            max = cap,
            suppressed,
            "too many connections in their handshake; closing the oldest"
        );
    }
}

/// Connection `id` is out of its handshake (done, failed or closed).
fn handshake_over(inner: &Inner, id: u64) {
    let mut pending = inner.pending.lock();
    if let Some(i) = pending.iter().position(|p| *p == id) {
        pending.remove(i);
    }
    inner
        .stats
        .handshakes_pending
        .store(pending.len() as u64, Ordering::Relaxed);
}

/// Undoes a connection's registrations when its thread ends.
struct Registered<'a> {
    inner: &'a Inner,
    id: u64,
}

impl Drop for Registered<'_> {
    fn drop(&mut self) {
        handshake_over(self.inner, self.id);
        self.inner.fences.leave(self.id);
        self.inner.holds.release(self.id);
        self.inner.accepted.lock().remove(&self.id);
    }
}

/// Serve connection `id`, accepted at `accepted_at` (its slot is the accept loop's).
fn serve(inner: Arc<Inner>, stream: TcpStream, id: u64, accepted_at: Instant) {
    let _reg = Registered { inner: &inner, id };
    if inner.is_shutdown() {
        return;
    }
    let from = stream
        .peer_addr()
        .map(|a| a.to_string())
        .unwrap_or_default();
    let cfg = &inner.cfg;
    // Reads and most writes go through deadline-bound non-blocking calls;
    // the socket timeout bounds the few blocking writes left.
    let setup = stream
        .set_nodelay(true)
        .and_then(|()| stream.set_write_timeout(Some(cfg.io_timeout())));
    if setup.is_err() {
        return;
    }
    let fd = stream.as_raw_fd();
    let deadline = accepted_at + cfg.connect_timeout();
    let handshake_failed = |e: std::io::Error| {
        if e.kind() == std::io::ErrorKind::TimedOut {
            bump(&inner.stats.handshake_timeouts);
            if let Some(suppressed) = inner.stats.log_handshake.hit() {
                tracing::warn!(
                    %from,
                    suppressed,
                    "handshake not done within the connect timeout; connection dropped"
                );
            }
        } else {
            tracing::debug!(%from, error = %e, "handshake failed");
        }
    };
    let peer = match handshake::server(&inner, fd, deadline) {
        Ok(p) => p,
        Err(Refusal::Refused) => return,
        Err(Refusal::Io(e)) => return handshake_failed(e),
    };
    handshake_over(&inner, id);
    let Some(abort) = inner.fences.admit(id, &peer.session) else {
        bump(&inner.stats.fenced_refusals);
        if let Some(suppressed) = inner.stats.log_fenced.hit() {
            tracing::warn!(peer = %peer.session, suppressed, "connection from a fenced peer refused");
        }
        let _ = handshake::verdict(&inner, fd, deadline, wire::VERDICT_FENCED);
        return;
    };
    if let Err(e) = handshake::verdict(&inner, fd, deadline, wire::VERDICT_OK) {
        return handshake_failed(e);
    }
    let mut conn = ServerConn {
        inner: &inner,
        fd,
        id,
        peer,
        abort,
        idle_since: Instant::now(),
        descs: Vec::new(),
        bounce: Vec::new(),
        holder: Holder::default(),
    };
    match conn.run() {
        Ok(()) => tracing::debug!(%from, "data connection closed"),
        Err(e) => conn.dropped(&e),
    }
}

pub(super) struct ServerConn<'a> {
    pub(super) inner: &'a Inner,
    pub(super) fd: RawFd,
    /// The connection's id (its holds and fence entry are keyed by it).
    id: u64,
    /// The peer, as it announced itself.
    peer: PeerId,
    /// Set when the peer is fenced: stop at the next tick.
    abort: Arc<AtomicBool>,
    /// When the last request finished (or the connection was set up).
    idle_since: Instant,
    pub(super) descs: Vec<u8>,
    pub(super) bounce: Vec<u8>,
    /// The connection's leases (CUDA IPC control requests).
    holder: Holder,
}

impl ServerConn<'_> {
    /// Serve requests until the peer closes, a frame is malformed, the
    /// connection idles out, its peer is fenced or we shut down.
    fn run(&mut self) -> std::io::Result<()> {
        loop {
            if !self.wait_request()? {
                return Ok(());
            }
            if !self.inner.fences.begin(self.id) {
                bump(&self.inner.stats.fenced_refusals);
                if let Some(suppressed) = self.inner.stats.log_fenced.hit() {
                    tracing::warn!(
                        peer = %self.peer.session,
                        suppressed,
                        "request from a fenced peer refused; connection closed"
                    );
                }
                return Ok(());
            }
            let r = self.request();
            self.inner.fences.end(self.id);
            self.idle_since = Instant::now();
            if !r? {
                return Ok(());
            }
        }
    }

    /// Count and log why the connection was dropped.
    fn dropped(&self, e: &std::io::Error) {
        let stats = &self.inner.stats;
        let peer = &self.peer.session;
        match e.kind() {
            std::io::ErrorKind::TimedOut => {
                bump(&stats.request_timeouts);
                if let Some(suppressed) = stats.log_request.hit() {
                    tracing::warn!(%peer, error = %e, suppressed, "request not received in time; connection dropped");
                }
            }
            std::io::ErrorKind::ConnectionAborted => {
                bump(&stats.requests_aborted);
                tracing::debug!(%peer, error = %e, "request abandoned; connection dropped");
            }
            _ => tracing::debug!(%peer, error = %e, "data connection dropped"),
        }
    }

    /// Receive, carry out and acknowledge one request, within
    /// `request_timeout_ms`; `false` when the connection is to be closed.
    fn request(&mut self) -> std::io::Result<bool> {
        let inner = self.inner;
        let abort = self.abort.clone();
        let stop = move || inner.is_shutdown() || abort.load(Ordering::Acquire);
        let cfg = &inner.cfg;
        let hard = Instant::now() + cfg.request_timeout();
        let mut b = Budget::new(hard, cfg.io_timeout(), &stop);
        let mut hb = [0u8; wire::HEADER_LEN];
        match io::read_exact_by(self.fd, &mut hb, &mut b) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(false),
            Err(e) => return Err(e),
        }
        let Some(h) = Header::decode(&hb) else {
            return self.bad_frame("malformed request header", None, &mut b);
        };
        if !self.inner.data_plane
            && matches!(h.op, Op::Check | Op::CheckRuns | Op::Write | Op::WriteRuns)
        {
            return self.bad_frame("data request to a control-only host", Some(h.seq), &mut b);
        }
        let (status, index) = match h.op {
            Op::Ping => (Status::Ok, 0),
            Op::Exports => {
                if h.count != 0 || h.payload != 0 {
                    return self.bad_frame("exports request with a body", Some(h.seq), &mut b);
                }
                let table = self.inner.exports.read().clone();
                Holder::exports(self.fd, h.seq, &table, &mut b)?;
                return Ok(true);
            }
            Op::Lease => {
                if h.payload != 0 || h.count > wire::MAX_LEASE_REGIONS {
                    return self.bad_frame("malformed lease request", Some(h.seq), &mut b);
                }
                self.lease(h.count, &mut b)?
            }
            Op::Release => {
                if h.count != 0 || h.payload != 0 {
                    return self.bad_frame("release request with a body", Some(h.seq), &mut b);
                }
                self.holder.release(&self.inner.holds, self.id);
                (Status::Ok, 0)
            }
            Op::Check => {
                if h.payload != 0 {
                    return self.bad_frame("check request with payload", Some(h.seq), &mut b);
                }
                self.check(h.count, &mut b)?
            }
            Op::CheckRuns => {
                if h.payload != 0 {
                    return self.bad_frame("check request with payload", Some(h.seq), &mut b);
                }
                self.check_runs(h.count, &mut b)?
            }
            Op::WriteRuns => {
                if h.count > wire::MAX_WRITE_BLOCKS || h.payload > wire::MAX_WRITE_BYTES {
                    return self.bad_frame("write request over limits", Some(h.seq), &mut b);
                }
                match self.write_runs(&h, &mut b)? {
                    Some(r) => r,
                    None => {
                        return self.bad_frame("malformed run write", Some(h.seq), &mut b);
                    }
                }
            }
            Op::Write => {
                if h.count > wire::MAX_WRITE_BLOCKS || h.payload > wire::MAX_WRITE_BYTES {
                    return self.bad_frame("write request over limits", Some(h.seq), &mut b);
                }
                match self.write(&h, &mut b)? {
                    Some(r) => r,
                    None => {
                        return self.bad_frame("write lengths do not add up", Some(h.seq), &mut b);
                    }
                }
            }
        };
        let ack = Ack {
            seq: h.seq,
            status,
            index,
        };
        io::write_all_by(self.fd, &ack.encode(), &mut b)?;
        Ok(true)
    }

    /// Wait for the next request; `false` on shutdown, peer close, fence
    /// or idle timeout. Sends the `Revoke` of a revoked hold meanwhile.
    fn wait_request(&mut self) -> std::io::Result<bool> {
        let idle = self.inner.cfg.idle_timeout();
        loop {
            if self.inner.is_shutdown() || self.abort.load(Ordering::Acquire) {
                return Ok(false);
            }
            if self.inner.frozen.load(Ordering::Acquire) {
                std::thread::sleep(Duration::from_millis(10));
                continue;
            }
            if self.idle_since.elapsed() >= idle && !self.inner.holds.holding(self.id) {
                let stats = &self.inner.stats;
                bump(&stats.idle_closed);
                if let Some(suppressed) = stats.log_idle.hit() {
                    tracing::info!(
                        peer = %self.peer.session,
                        suppressed,
                        "closing a connection idle for longer than the idle timeout"
                    );
                }
                return Ok(false);
            }
            let Some(wake) = self.holder.wake() else {
                if io::wait_readable(self.fd, IDLE_TICK_MS)? {
                    return Ok(!self.abandoned());
                }
                continue;
            };
            self.holder
                .revoke_if_due(self.fd, &self.inner.holds, self.id)?;
            let (request, woken) = io::wait_readable2(self.fd, wake.as_raw_fd(), IDLE_TICK_MS)?;
            if woken {
                Holder::drained(&wake);
            }
            if request {
                return Ok(!self.abandoned());
            }
        }
    }

    /// Whether the sender reset the connection: it gave up on what it had
    /// sent (its batch failed), so requests still queued here are dropped
    /// unread, never written after that failure.
    fn abandoned(&self) -> bool {
        if !io::reset_by_peer(self.fd) {
            return false;
        }
        bump(&self.inner.stats.resets_by_sender);
        tracing::debug!(
            peer = %self.peer.session,
            "sender reset the connection; its queued requests are dropped unread"
        );
        true
    }

    /// Count a malformed frame, answer `BadRequest` when possible; the
    /// connection is then closed (`Ok(false)`).
    fn bad_frame(&self, what: &str, seq: Option<u64>, b: &mut Budget<'_>) -> std::io::Result<bool> {
        bump(&self.inner.stats.bad_frames);
        if let Some(suppressed) = self.inner.stats.log_bad_frame.hit() {
            tracing::warn!(
                what,
                peer = %self.peer.session,
                suppressed,
                "malformed request; dropping data connection"
            );
        }
        if let Some(seq) = seq {
            let ack = Ack {
                seq,
                status: Status::BadRequest,
                index: 0,
            };
            let _ = io::write_all_by(self.fd, &ack.encode(), b);
        }
        Ok(false)
    }

    /// A lease (see [`Holder::lease`]); a region not registered is
    /// counted and logged as a refusal.
    fn lease(&mut self, count: u32, b: &mut Budget<'_>) -> std::io::Result<(Status, u32)> {
        let inner = self.inner;
        let leased = self.holder.lease(
            self.fd,
            count,
            &mut self.descs,
            &inner.regions,
            &inner.holds,
            self.id,
            b,
        )?;
        Ok(match leased {
            Ok(()) => (Status::Ok, 0),
            Err(bad) => {
                self.refused("lease of a range outside our regions refused", bad);
                (Status::OutOfRegion, bad as u32)
            }
        })
    }

    /// Count and log (rate-limited) a request refused for a destination
    /// outside our regions.
    pub(super) fn refused(&self, what: &'static str, index: usize) {
        let stats = &self.inner.stats;
        bump(&stats.requests_refused);
        if let Some(suppressed) = stats.log_refused.hit() {
            tracing::warn!(peer = %self.peer.session, index, suppressed, "{what}");
        }
    }

    /// Validate every destination of a batch, streaming the descriptors.
    fn check(&mut self, count: u32, b: &mut Budget<'_>) -> std::io::Result<(Status, u32)> {
        let mut first_bad: Option<u32> = None;
        let mut done: usize = 0;
        let total = count as usize;
        while done < total {
            let n = (total - done).min(CHECK_CHUNK);
            self.descs.resize(n * wire::DESC_LEN, 0);
            io::read_exact_by(self.fd, &mut self.descs, b)?;
            if first_bad.is_none() {
                let regions = self.inner.regions.read_recursive();
                for i in 0..n {
                    let (dst, len) = wire::desc_at(&self.descs, i);
                    if regions.find(dst, len).is_none() {
                        first_bad = Some((done + i) as u32);
                        break;
                    }
                }
            }
            done += n;
        }
        Ok(match first_bad {
            Some(i) => {
                self.refused(
                    "batch check refused a destination outside our regions",
                    i as usize,
                );
                (Status::OutOfRegion, i)
            }
            None => (Status::Ok, 0),
        })
    }
}
