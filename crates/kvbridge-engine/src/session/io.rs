//! Socket syscalls on raw file descriptors: vectored send / receive with
//! partial-progress handling, and readiness polls.
//!
//! The vectored calls take raw `iovec`s so that payload bytes move straight
//! between registered memory and the kernel, without forming Rust references
//! to memory a peer may be writing. Timeouts come from the socket's
//! `SO_SNDTIMEO` / `SO_RCVTIMEO`, which surface here as `TimedOut`.

use std::io;
use std::os::fd::RawFd;
use std::time::{Duration, Instant};

/// Most iovecs handed to one syscall (Linux `UIO_MAXIOV` is 1024).
pub(crate) const MAX_IOV: usize = 1024;

/// A raw iovec over `len` bytes at `ptr`.
pub(crate) fn iov(ptr: *const u8, len: usize) -> libc::iovec {
    libc::iovec {
        iov_base: ptr.cast_mut().cast(),
        iov_len: len,
    }
}

fn map_err(e: io::Error) -> io::Error {
    if e.kind() == io::ErrorKind::WouldBlock {
        io::Error::new(io::ErrorKind::TimedOut, "socket i/o timed out")
    } else {
        e
    }
}

/// Drop `n` consumed bytes from the front of `iovs`, returning the remaining tail.
pub(crate) fn advance(iovs: &mut [libc::iovec], mut n: usize) -> &mut [libc::iovec] {
    let mut first = 0;
    while first < iovs.len() && n >= iovs[first].iov_len {
        n -= iovs[first].iov_len;
        first += 1;
    }
    let rest = &mut iovs[first..];
    if let Some(head) = rest.first_mut() {
        head.iov_base = head.iov_base.cast::<u8>().wrapping_add(n).cast();
        head.iov_len -= n;
    }
    rest
}

/// Send every byte described by `iovs` (no `SIGPIPE`).
///
/// # Safety
/// Every iovec must describe memory that is valid for reads for the whole call.
pub(crate) unsafe fn send_all(fd: RawFd, iovs: &mut [libc::iovec]) -> io::Result<()> {
    let mut rest = iovs;
    while !rest.is_empty() {
        let n = rest.len().min(MAX_IOV);
        // SAFETY: msghdr is plain data; zeroed is a valid empty header.
        let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
        msg.msg_iov = rest.as_mut_ptr();
        msg.msg_iovlen = n as _;
        // SAFETY: `msg` points at `n` iovecs that the caller guarantees are readable.
        let r = unsafe { libc::sendmsg(fd, &msg, libc::MSG_NOSIGNAL) };
        if r < 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(map_err(e));
        }
        rest = advance(rest, r as usize);
        while rest.first().is_some_and(|v| v.iov_len == 0) {
            rest = &mut rest[1..];
        }
    }
    Ok(())
}

/// Fill every byte described by `iovs` from the socket.
///
/// # Safety
/// Every iovec must describe memory that is valid for writes for the whole
/// call and that nothing else reads or writes meanwhile.
pub(crate) unsafe fn recv_all(fd: RawFd, iovs: &mut [libc::iovec]) -> io::Result<()> {
    let mut rest = iovs;
    while rest.first().is_some_and(|v| v.iov_len == 0) {
        rest = &mut rest[1..];
    }
    while !rest.is_empty() {
        let n = rest.len().min(MAX_IOV);
        // SAFETY: `rest` holds at least `n` iovecs the caller guarantees writable.
        let r = unsafe { libc::readv(fd, rest.as_ptr(), n as libc::c_int) };
        if r < 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(map_err(e));
        }
        if r == 0 {
            return Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                "peer closed the connection",
            ));
        }
        rest = advance(rest, r as usize);
        while rest.first().is_some_and(|v| v.iov_len == 0) {
            rest = &mut rest[1..];
        }
    }
    Ok(())
}

/// Send all of `buf`.
pub(crate) fn write_all(fd: RawFd, buf: &[u8]) -> io::Result<()> {
    let mut v = [iov(buf.as_ptr(), buf.len())];
    // SAFETY: the iovec covers `buf`, borrowed for the call.
    unsafe { send_all(fd, &mut v) }
}

/// Fill all of `buf`.
pub(crate) fn read_exact(fd: RawFd, buf: &mut [u8]) -> io::Result<()> {
    let mut v = [iov(buf.as_mut_ptr(), buf.len())];
    // SAFETY: the iovec covers `buf`, mutably borrowed for the call.
    unsafe { recv_all(fd, &mut v) }
}

/// Wait up to `timeout_ms` for `fd` to become readable (or hung up).
pub(crate) fn wait_readable(fd: RawFd, timeout_ms: i32) -> io::Result<bool> {
    poll_one(fd, libc::POLLIN | libc::POLLRDHUP, timeout_ms)
}

/// Wait up to `timeout_ms` for `a` or `b` to become readable (or hung up).
pub(crate) fn wait_readable2(a: RawFd, b: RawFd, timeout_ms: i32) -> io::Result<(bool, bool)> {
    let ev = libc::POLLIN | libc::POLLRDHUP;
    let mut p = [
        libc::pollfd {
            fd: a,
            events: ev,
            revents: 0,
        },
        libc::pollfd {
            fd: b,
            events: ev,
            revents: 0,
        },
    ];
    loop {
        // SAFETY: two valid pollfds, borrowed for the call.
        let r = unsafe { libc::poll(p.as_mut_ptr(), 2, timeout_ms) };
        if r < 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        return Ok((p[0].revents != 0, p[1].revents != 0));
    }
}

/// How often deadline-bound I/O wakes up to check its stop condition.
pub(crate) const TICK: Duration = Duration::from_millis(100);

/// The limits of one deadline-bound exchange (a handshake, one request):
/// a deadline for the whole, a limit on making no progress, and a stop
/// condition (shutdown, abort) checked at least every [`TICK`].
pub(crate) struct Budget<'a> {
    hard: Instant,
    stall: Duration,
    last: Instant,
    stop: &'a dyn Fn() -> bool,
}

/// The error of an exchange stopped by its stop condition.
pub(crate) fn aborted() -> io::Error {
    io::Error::new(
        io::ErrorKind::ConnectionAborted,
        "stopped (shutdown or abort)",
    )
}

impl<'a> Budget<'a> {
    /// Everything by `hard`, no pause longer than `stall`, give up when `stop()`.
    pub(crate) fn new(hard: Instant, stall: Duration, stop: &'a dyn Fn() -> bool) -> Self {
        Self {
            hard,
            stall,
            last: Instant::now(),
            stop,
        }
    }

    /// Whether the stop condition holds now.
    pub(crate) fn stopped(&self) -> bool {
        (self.stop)()
    }

    /// Note progress (restarts the no-progress limit).
    pub(crate) fn progressed(&mut self) {
        self.last = Instant::now();
    }

    /// Wait until `fd` is ready for `events` (`POLLIN`, `POLLOUT`):
    /// `TimedOut` past the deadline or the no-progress limit,
    /// `ConnectionAborted` once the stop condition holds.
    pub(crate) fn wait(&self, fd: RawFd, events: libc::c_short) -> io::Result<()> {
        loop {
            if (self.stop)() {
                return Err(aborted());
            }
            let now = Instant::now();
            if now >= self.hard {
                return Err(io::Error::new(io::ErrorKind::TimedOut, "deadline passed"));
            }
            let stall_at = self.last + self.stall;
            if now >= stall_at {
                return Err(io::Error::new(io::ErrorKind::TimedOut, "no progress"));
            }
            let left = self.hard.min(stall_at).duration_since(now).min(TICK);
            let ms = i32::try_from(left.as_millis()).unwrap_or(i32::MAX).max(1);
            if poll_one(fd, events, ms)? {
                return Ok(());
            }
        }
    }
}

fn poll_one(fd: RawFd, events: libc::c_short, timeout_ms: i32) -> io::Result<bool> {
    let mut p = libc::pollfd {
        fd,
        events,
        revents: 0,
    };
    loop {
        // SAFETY: one valid pollfd, borrowed for the call.
        let r = unsafe { libc::poll(&mut p, 1, timeout_ms) };
        if r < 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        return Ok(r > 0);
    }
}

/// Readiness for reading (or a hang-up).
pub(crate) const READABLE: libc::c_short = libc::POLLIN | libc::POLLRDHUP;
/// Readiness for writing.
pub(crate) const WRITABLE: libc::c_short = libc::POLLOUT;

/// One non-blocking receive into `iovs`: `Some(n)` bytes (n > 0), `None`
/// when nothing is there yet; end of stream is `UnexpectedEof`.
///
/// # Safety
/// Every iovec must describe memory valid for writes for the whole call,
/// which nothing else reads or writes meanwhile.
pub(crate) unsafe fn recv_some(fd: RawFd, iovs: &mut [libc::iovec]) -> io::Result<Option<usize>> {
    loop {
        // SAFETY: msghdr is plain data; zeroed is a valid empty header.
        let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
        msg.msg_iov = iovs.as_mut_ptr();
        msg.msg_iovlen = iovs.len().min(MAX_IOV) as _;
        // SAFETY: `msg` points at iovecs the caller guarantees writable.
        let r = unsafe { libc::recvmsg(fd, &mut msg, libc::MSG_DONTWAIT) };
        if r > 0 {
            return Ok(Some(r as usize));
        }
        if r == 0 {
            return Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                "peer closed the connection",
            ));
        }
        let e = io::Error::last_os_error();
        match e.kind() {
            io::ErrorKind::Interrupted => continue,
            io::ErrorKind::WouldBlock => return Ok(None),
            _ => return Err(e),
        }
    }
}

/// One non-blocking send from `iovs` (no `SIGPIPE`): `Some(n)` bytes, `None` when the socket is full.
///
/// # Safety
/// Every iovec must describe memory valid for reads for the whole call.
pub(crate) unsafe fn send_some(fd: RawFd, iovs: &mut [libc::iovec]) -> io::Result<Option<usize>> {
    loop {
        // SAFETY: msghdr is plain data; zeroed is a valid empty header.
        let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
        msg.msg_iov = iovs.as_mut_ptr();
        msg.msg_iovlen = iovs.len().min(MAX_IOV) as _;
        // SAFETY: `msg` points at iovecs the caller guarantees readable.
        let r = unsafe { libc::sendmsg(fd, &msg, libc::MSG_DONTWAIT | libc::MSG_NOSIGNAL) };
        if r >= 0 {
            return Ok(Some(r as usize));
        }
        let e = io::Error::last_os_error();
        match e.kind() {
            io::ErrorKind::Interrupted => continue,
            io::ErrorKind::WouldBlock => return Ok(None),
            _ => return Err(e),
        }
    }
}

/// Move every byte `v` covers within `budget`: `step` receives or sends
/// (`recv_some` / `send_some`), `ready` is the readiness it waits for.
///
/// # Safety
/// As `step` requires of `v` (readable for sending, writable and not
/// otherwise touched for receiving) for the whole call.
unsafe fn all_by(
    fd: RawFd,
    v: libc::iovec,
    budget: &mut Budget<'_>,
    ready: libc::c_short,
    step: unsafe fn(RawFd, &mut [libc::iovec]) -> io::Result<Option<usize>>,
) -> io::Result<()> {
    let mut v = [v];
    let mut rest: &mut [libc::iovec] = &mut v;
    while rest.first().is_some_and(|v| v.iov_len > 0) {
        // SAFETY: `rest` is the untouched tail of `v`: forwarded caller contract.
        match unsafe { step(fd, rest) }? {
            Some(n) => {
                budget.progressed();
                rest = advance(rest, n);
            }
            None => budget.wait(fd, ready)?,
        }
    }
    Ok(())
}

/// Fill all of `buf` within `budget`.
pub(crate) fn read_exact_by(fd: RawFd, buf: &mut [u8], budget: &mut Budget<'_>) -> io::Result<()> {
    if buf.is_empty() {
        return Ok(()); // nothing to wait for
    }
    let v = iov(buf.as_mut_ptr(), buf.len());
    // SAFETY: `v` covers `buf`, mutably borrowed for the call.
    unsafe { all_by(fd, v, budget, READABLE, recv_some) }
}

/// Send all of `buf` within `budget`.
pub(crate) fn write_all_by(fd: RawFd, buf: &[u8], budget: &mut Budget<'_>) -> io::Result<()> {
    let v = iov(buf.as_ptr(), buf.len());
    // SAFETY: `v` covers `buf`, borrowed (and only read) for the call.
    unsafe { all_by(fd, v, budget, WRITABLE, send_some) }
}

/// Read and discard `n` bytes into `scratch`, within `budget`.
pub(crate) fn discard_by(
    fd: RawFd,
    mut n: u64,
    scratch: &mut [u8],
    budget: &mut Budget<'_>,
) -> io::Result<()> {
    while n > 0 {
        let k = scratch.len().min(usize::try_from(n).unwrap_or(usize::MAX));
        read_exact_by(fd, &mut scratch[..k], budget)?;
        n -= k as u64;
    }
    Ok(())
}

/// On a connection where the peer never speaks unprompted: has it closed or reset?
pub(crate) fn idle_peer_gone(fd: RawFd) -> bool {
    wait_readable(fd, 0).unwrap_or(true)
}

/// Whether the peer reset the connection, even while bytes it sent before
/// the reset still wait to be read (the kernel keeps them readable): a
/// sender resets a connection when it gives up on its requests, so what is
/// still queued must not be acted on.
pub(crate) fn reset_by_peer(fd: RawFd) -> bool {
    let mut err: libc::c_int = 0;
    let mut len = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
    // SAFETY: `err` and `len` are live locals of the sizes passed; the
    // kernel writes at most `len` bytes into `err`.
    let r = unsafe {
        libc::getsockopt(
            fd,
            libc::SOL_SOCKET,
            libc::SO_ERROR,
            (&raw mut err).cast(),
            &mut len,
        )
    };
    r != 0 || err != 0
}

/// Make closing `fd` a reset: the kernel then drops what it has not yet
/// sent instead of delivering it later (an orphaned socket keeps
/// retransmitting its queue for minutes, e.g. across a healed partition).
pub(crate) fn reset_on_close(fd: RawFd) {
    let linger = libc::linger {
        l_onoff: 1,
        l_linger: 0,
    };
    // SAFETY: `linger` is a live local of the size passed; the kernel only
    // reads it.
    let r = unsafe {
        libc::setsockopt(
            fd,
            libc::SOL_SOCKET,
            libc::SO_LINGER,
            (&raw const linger).cast(),
            std::mem::size_of::<libc::linger>() as libc::socklen_t,
        )
    };
    if r != 0 {
        tracing::debug!(error = %io::Error::last_os_error(), "SO_LINGER 0 not set");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn advance_skips_and_trims() {
        let a = [0u8; 10];
        let mut v = [iov(a.as_ptr(), 3), iov(a.as_ptr(), 4), iov(a.as_ptr(), 5)];
        let rest = advance(&mut v, 5);
        assert_eq!(rest.len(), 2);
        assert_eq!(rest[0].iov_len, 2);
        let rest = advance(rest, 2);
        assert_eq!(rest.len(), 1);
        assert_eq!(rest[0].iov_len, 5);
    }
}
