//! The receiving side: the accept loop and one thread per connection that
//! authenticates the peer, validates every request against our registered
//! regions, and scatters payloads straight into them.

use std::net::{TcpListener, TcpStream};
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use kvbridge_mem::{MemoryKind, RegionRegistry, access_for};

use super::wire::{self, Ack, Challenge, Header, Hello, Op, Status};
use super::{Inner, auth, holds, io};

/// Size of a connection's bounce buffer for short (or staged) blocks.
const BOUNCE_CAP: usize = 1 << 20;
/// Descriptors validated per chunk of a `Check` request.
const CHECK_CHUNK: usize = 4096;
/// Poll tick while waiting for the next request (shutdown / freeze checks).
const IDLE_TICK_MS: i32 = 200;

/// Accept connections until the engine shuts down.
pub(super) fn accept_loop(inner: Arc<Inner>, listener: TcpListener) {
    let fd = listener.as_raw_fd();
    while !inner.is_shutdown() {
        match io::wait_readable(fd, IDLE_TICK_MS) {
            Ok(false) => continue,
            Ok(true) => {}
            Err(e) => {
                tracing::warn!(error = %e, "poll on listener failed");
                std::thread::sleep(Duration::from_millis(50));
                continue;
            }
        }
        if inner.is_shutdown() {
            break;
        }
        match listener.accept() {
            Ok((stream, from)) => {
                inner
                    .stats
                    .connections_accepted
                    .fetch_add(1, Ordering::Relaxed);
                tracing::debug!(%from, "accepted data connection");
                let i2 = inner.clone();
                let spawned = std::thread::Builder::new()
                    .name("kvb-tcp-serve".into())
                    .spawn(move || serve(i2, stream));
                if let Err(e) = spawned {
                    tracing::warn!(error = %e, "cannot spawn a connection thread; dropping connection");
                }
            }
            Err(e) => {
                if !inner.is_shutdown() {
                    tracing::debug!(error = %e, "accept failed");
                }
            }
        }
    }
}

/// Removes a connection's shutdown clone when its thread ends.
struct Registered<'a> {
    inner: &'a Inner,
    id: u64,
}

impl Drop for Registered<'_> {
    fn drop(&mut self) {
        self.inner.holds.release(self.id);
        self.inner.accepted.lock().remove(&self.id);
    }
}

fn serve(inner: Arc<Inner>, stream: TcpStream) {
    let id = inner.next_id();
    if let Ok(c) = stream.try_clone() {
        inner.accepted.lock().insert(id, c);
    }
    let _reg = Registered { inner: &inner, id };
    if inner.is_shutdown() {
        return;
    }
    let peer = stream
        .peer_addr()
        .map(|a| a.to_string())
        .unwrap_or_default();
    let cfg = &inner.cfg;
    let setup = stream
        .set_nodelay(true)
        .and_then(|()| stream.set_read_timeout(Some(cfg.connect_timeout())))
        .and_then(|()| stream.set_write_timeout(Some(cfg.connect_timeout())));
    if setup.is_err() {
        return;
    }
    let fd = stream.as_raw_fd();
    match handshake(&inner, fd) {
        Ok(true) => {}
        Ok(false) => return,
        Err(e) => {
            tracing::debug!(%peer, error = %e, "handshake failed");
            return;
        }
    }
    let run = stream
        .set_read_timeout(Some(cfg.io_timeout()))
        .and_then(|()| stream.set_write_timeout(Some(cfg.io_timeout())));
    if run.is_err() {
        return;
    }
    let mut conn = ServerConn {
        inner: &inner,
        fd,
        id,
        descs: Vec::new(),
        bounce: Vec::new(),
        wake: None,
        revoke_sent: false,
    };
    match conn.run() {
        Ok(()) => tracing::debug!(%peer, "data connection closed"),
        Err(e) => tracing::debug!(%peer, error = %e, "data connection dropped"),
    }
}

/// Server side of the handshake; `Ok(false)` when the peer was refused.
fn handshake(inner: &Inner, fd: RawFd) -> std::io::Result<bool> {
    let mut hb = [0u8; wire::HELLO_LEN];
    io::read_exact(fd, &mut hb)?;
    let Some(hello) = Hello::decode(&hb) else {
        inner.stats.bad_frames.fetch_add(1, Ordering::Relaxed);
        tracing::warn!("connection without kvbridge hello dropped");
        return Ok(false);
    };
    let secret = inner.secret.as_deref();
    let nonce = auth::nonce();
    let proof = match secret {
        Some(s) if hello.flags & wire::FLAG_SECRET != 0 => {
            auth::server_proof(s, &hello.nonce, &nonce, inner.incarnation)
        }
        _ => [0u8; wire::NONCE_LEN],
    };
    let ch = Challenge {
        version: wire::VERSION,
        flags: if secret.is_some() {
            wire::FLAG_SECRET
        } else {
            0
        },
        incarnation: inner.incarnation,
        nonce,
        proof,
    };
    io::write_all(fd, &ch.encode())?;
    let mut rb = [0u8; wire::RESPONSE_LEN];
    io::read_exact(fd, &mut rb)?;
    if hello.version != wire::VERSION {
        io::write_all(fd, &wire::encode_verdict(wire::VERDICT_VERSION))?;
        return Ok(false);
    }
    if let Some(s) = secret
        && !auth::verify_client(s, &nonce, &hello.nonce, inner.incarnation, &rb)
    {
        inner.stats.auth_failures.fetch_add(1, Ordering::Relaxed);
        tracing::warn!("data connection failed cluster-secret authentication; dropped");
        io::write_all(fd, &wire::encode_verdict(wire::VERDICT_AUTH))?;
        return Ok(false);
    }
    io::write_all(fd, &wire::encode_verdict(wire::VERDICT_OK))?;
    Ok(true)
}

struct ServerConn<'a> {
    inner: &'a Inner,
    fd: RawFd,
    /// The connection's id (its holds are keyed by it).
    id: u64,
    descs: Vec<u8>,
    bounce: Vec<u8>,
    /// Wakes this thread when a hold of the connection is revoked (made at
    /// the first lease).
    wake: Option<Arc<OwnedFd>>,
    /// A `Revoke` was sent and its `Release` is still to come.
    revoke_sent: bool,
}

impl ServerConn<'_> {
    /// Serve requests until the peer closes, a frame is malformed, or we shut down.
    fn run(&mut self) -> std::io::Result<()> {
        loop {
            if !self.wait_request()? {
                return Ok(());
            }
            let mut hb = [0u8; wire::HEADER_LEN];
            match io::read_exact(self.fd, &mut hb) {
                Ok(()) => {}
                Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(()),
                Err(e) => return Err(e),
            }
            let Some(h) = Header::decode(&hb) else {
                return self.bad_frame("malformed request header", None);
            };
            let (status, index) = match h.op {
                Op::Ping => (Status::Ok, 0),
                Op::Exports => {
                    if h.count != 0 || h.payload != 0 {
                        return self.bad_frame("exports request with a body", Some(h.seq));
                    }
                    let table = self.inner.exports.read().clone();
                    let ack = Ack {
                        seq: h.seq,
                        status: Status::Ok,
                        index: 0,
                    };
                    let mut out = ack.encode().to_vec();
                    out.extend_from_slice(&(table.len() as u64).to_le_bytes());
                    out.extend_from_slice(&table);
                    io::write_all(self.fd, &out)?;
                    continue;
                }
                Op::Lease => {
                    if h.payload != 0 || h.count > wire::MAX_LEASE_REGIONS {
                        return self.bad_frame("malformed lease request", Some(h.seq));
                    }
                    self.lease(h.count)?
                }
                Op::Release => {
                    if h.count != 0 || h.payload != 0 {
                        return self.bad_frame("release request with a body", Some(h.seq));
                    }
                    self.inner.holds.release(self.id);
                    self.revoke_sent = false;
                    (Status::Ok, 0)
                }
                Op::Check => {
                    if h.payload != 0 {
                        return self.bad_frame("check request with payload", Some(h.seq));
                    }
                    self.check(h.count)?
                }
                Op::Write => {
                    if h.count > wire::MAX_WRITE_BLOCKS || h.payload > wire::MAX_WRITE_BYTES {
                        return self.bad_frame("write request over limits", Some(h.seq));
                    }
                    match self.write(&h)? {
                        Some(r) => r,
                        None => return self.bad_frame("write lengths do not add up", Some(h.seq)),
                    }
                }
            };
            let ack = Ack {
                seq: h.seq,
                status,
                index,
            };
            io::write_all(self.fd, &ack.encode())?;
        }
    }

    /// Wait for the next request header; `false` on shutdown or peer
    /// close. Sends the `Revoke` of a revoked hold meanwhile.
    fn wait_request(&mut self) -> std::io::Result<bool> {
        loop {
            if self.inner.is_shutdown() {
                return Ok(false);
            }
            if self.inner.frozen.load(Ordering::Acquire) {
                std::thread::sleep(Duration::from_millis(10));
                continue;
            }
            let Some(wake) = self.wake.clone() else {
                if io::wait_readable(self.fd, IDLE_TICK_MS)? {
                    return Ok(true);
                }
                continue;
            };
            if !self.revoke_sent && self.inner.holds.revoking(self.id) {
                let revoke = Ack {
                    seq: 0,
                    status: Status::Revoked,
                    index: 0,
                };
                io::write_all(self.fd, &revoke.encode())?;
                self.revoke_sent = true;
            }
            let (request, woken) = io::wait_readable2(self.fd, wake.as_raw_fd(), IDLE_TICK_MS)?;
            if woken {
                holds::drain(wake.as_raw_fd());
            }
            if request {
                return Ok(true);
            }
        }
    }

    /// Count a malformed frame, answer `BadRequest` when possible, and end the connection.
    fn bad_frame(&self, what: &str, seq: Option<u64>) -> std::io::Result<()> {
        self.inner.stats.bad_frames.fetch_add(1, Ordering::Relaxed);
        tracing::warn!(what, "malformed request; dropping data connection");
        if let Some(seq) = seq {
            let ack = Ack {
                seq,
                status: Status::BadRequest,
                index: 0,
            };
            let _ = io::write_all(self.fd, &ack.encode());
        }
        Ok(())
    }

    /// A lease: check that every named region is registered and add them
    /// to the connection's hold (see [`holds`]) before the read guard is
    /// dropped, so a deregistration racing with it sees the hold.
    fn lease(&mut self, count: u32) -> std::io::Result<(Status, u32)> {
        let n = count as usize;
        self.descs.resize(n * wire::DESC_LEN, 0);
        io::read_exact(self.fd, &mut self.descs)?;
        let wake = match &self.wake {
            Some(w) => w.clone(),
            None => {
                let w = holds::eventfd()?;
                self.wake = Some(w.clone());
                w
            }
        };
        let regions = self.inner.regions.read_recursive();
        let leased: Vec<(u64, u64)> = (0..n).map(|i| wire::desc_at(&self.descs, i)).collect();
        if let Some(bad) = leased
            .iter()
            .position(|&(start, len)| regions.find(start, len).is_none())
        {
            return Ok((Status::OutOfRegion, bad as u32));
        }
        self.inner.holds.add(self.id, &wake, &leased);
        drop(regions);
        Ok((Status::Ok, 0))
    }

    /// Validate every destination of a batch, streaming the descriptors.
    fn check(&mut self, count: u32) -> std::io::Result<(Status, u32)> {
        let mut first_bad: Option<u32> = None;
        let mut done: usize = 0;
        let total = count as usize;
        while done < total {
            let n = (total - done).min(CHECK_CHUNK);
            self.descs.resize(n * wire::DESC_LEN, 0);
            io::read_exact(self.fd, &mut self.descs)?;
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
                self.inner
                    .stats
                    .requests_refused
                    .fetch_add(1, Ordering::Relaxed);
                tracing::warn!(
                    index = i,
                    "batch check refused a destination outside our regions"
                );
                (Status::OutOfRegion, i)
            }
            None => (Status::Ok, 0),
        })
    }

    /// Receive one `Write` request; `None` if the descriptors contradict the header.
    fn write(&mut self, h: &Header) -> std::io::Result<Option<(Status, u32)>> {
        let n = h.count as usize;
        self.descs.resize(n * wire::DESC_LEN, 0);
        io::read_exact(self.fd, &mut self.descs)?;
        let mut sum: u64 = 0;
        for i in 0..n {
            let (_, len) = wire::desc_at(&self.descs, i);
            sum = match sum.checked_add(len) {
                Some(s) => s,
                None => return Ok(None),
            };
        }
        if sum != h.payload {
            return Ok(None);
        }
        if self.bounce.len() < BOUNCE_CAP {
            self.bounce.resize(BOUNCE_CAP, 0);
        }
        let regions = self.inner.regions.read_recursive();
        let mut kinds = Vec::with_capacity(n);
        for i in 0..n {
            let (dst, len) = wire::desc_at(&self.descs, i);
            match regions.find(dst, len) {
                Some(r) => kinds.push(r.kind),
                None => {
                    drop(regions);
                    self.inner
                        .stats
                        .requests_refused
                        .fetch_add(1, Ordering::Relaxed);
                    tracing::warn!(
                        dst = format_args!("{dst:#x}"),
                        len,
                        index = i,
                        "write outside our registered regions refused; request discarded"
                    );
                    io::discard(self.fd, h.payload, &mut self.bounce)?;
                    return Ok(Some((Status::OutOfRegion, i as u32)));
                }
            }
        }
        let status = self.scatter(&regions, &kinds)?;
        drop(regions);
        let stats = &self.inner.stats;
        let total = stats.bytes_received.fetch_add(h.payload, Ordering::Relaxed) + h.payload;
        if total >= self.inner.freeze_after.load(Ordering::Acquire) {
            self.inner.frozen.store(true, Ordering::Release);
        }
        Ok(Some(status))
    }

    /// Read the payload into the validated destinations: long host blocks
    /// directly, short or staged ones through the bounce buffer.
    fn scatter(
        &mut self,
        _guard: &RegionRegistry,
        kinds: &[MemoryKind],
    ) -> std::io::Result<(Status, u32)> {
        let threshold = self.inner.cfg.coalesce_threshold as u64;
        let force_copy = self.inner.cfg.force_staging;
        let bounce = self.bounce.as_mut_ptr();
        let mut iovs: Vec<libc::iovec> = Vec::with_capacity(64);
        // (dst, kind, bounce offset, len) of bounced bytes waiting to be copied out.
        let mut pending: Vec<(u64, MemoryKind, usize, usize)> = Vec::new();
        let mut used = 0usize;
        let mut mem_error: Option<u32> = None;
        let fd = self.fd;
        // Receives into `iovs`, then copies bounced bytes out.
        let flush = |iovs: &mut Vec<libc::iovec>,
                     pending: &mut Vec<(u64, MemoryKind, usize, usize)>,
                     used: &mut usize,
                     mem_error: &mut Option<u32>,
                     index: u32|
         -> std::io::Result<()> {
            // SAFETY: every iovec points either into `self.bounce` (alive,
            // not resized during this call) or into a destination range that
            // `write` checked to lie inside a registered host-accessible
            // region; the registry read guard held by our caller keeps those
            // regions registered, and the registration contract makes them
            // valid, writable and untouched by others meanwhile.
            unsafe { io::recv_all(fd, iovs) }?;
            for &(dst, kind, off, len) in pending.iter() {
                // SAFETY: `off + len <= BOUNCE_CAP`, inside the bounce buffer.
                let src = unsafe { std::slice::from_raw_parts(bounce.add(off), len) };
                // SAFETY: `[dst, dst + len)` was checked inside a registered
                // region of `kind`, kept registered by the guard.
                let written = unsafe { access_for(kind).write(dst, src) };
                if let Err(e) = written
                    && mem_error.is_none()
                {
                    tracing::warn!(error = %e, "writing a received block into memory failed");
                    *mem_error = Some(index);
                }
            }
            iovs.clear();
            pending.clear();
            *used = 0;
            Ok(())
        };
        for (i, kind) in kinds.iter().copied().enumerate() {
            let (dst, len64) = wire::desc_at(&self.descs, i);
            let len = len64 as usize;
            if len == 0 {
                continue;
            }
            if kind.is_host_accessible() && !force_copy && len64 >= threshold {
                let p = std::ptr::with_exposed_provenance_mut::<u8>(dst as usize);
                iovs.push(io::iov(p, len));
                if iovs.len() >= io::MAX_IOV {
                    flush(&mut iovs, &mut pending, &mut used, &mut mem_error, i as u32)?;
                }
                continue;
            }
            let mut off = 0usize;
            while off < len {
                if used == BOUNCE_CAP {
                    flush(&mut iovs, &mut pending, &mut used, &mut mem_error, i as u32)?;
                }
                let k = (len - off).min(BOUNCE_CAP - used);
                // SAFETY: `used + k <= BOUNCE_CAP`, in bounds of the bounce buffer.
                let start = unsafe { bounce.add(used) };
                match iovs.last_mut() {
                    Some(last)
                        if last.iov_base.cast::<u8>().wrapping_add(last.iov_len) == start =>
                    {
                        last.iov_len += k;
                    }
                    _ => iovs.push(io::iov(start, k)),
                }
                pending.push((dst + off as u64, kind, used, k));
                used += k;
                off += k;
                if iovs.len() >= io::MAX_IOV {
                    flush(&mut iovs, &mut pending, &mut used, &mut mem_error, i as u32)?;
                }
            }
        }
        if !iovs.is_empty() {
            flush(
                &mut iovs,
                &mut pending,
                &mut used,
                &mut mem_error,
                kinds.len() as u32,
            )?;
        }
        Ok(match mem_error {
            Some(i) => (Status::Memory, i),
            None => (Status::Ok, 0),
        })
    }
}
