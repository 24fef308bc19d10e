//! Socket syscalls on raw file descriptors: vectored send / receive with
//! partial-progress handling, and readiness polls.
//!
//! The vectored calls take raw `iovec`s so that payload bytes move straight
//! between registered memory and the kernel, without forming Rust references
//! to memory a peer may be writing. Timeouts come from the socket's
//! `SO_SNDTIMEO` / `SO_RCVTIMEO`, which surface here as `TimedOut`.

use std::io;
use std::os::fd::RawFd;

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
fn advance(iovs: &mut [libc::iovec], mut n: usize) -> &mut [libc::iovec] {
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

/// Read and discard `n` bytes into `scratch`.
pub(crate) fn discard(fd: RawFd, mut n: u64, scratch: &mut [u8]) -> io::Result<()> {
    while n > 0 {
        let k = scratch.len().min(usize::try_from(n).unwrap_or(usize::MAX));
        read_exact(fd, &mut scratch[..k])?;
        n -= k as u64;
    }
    Ok(())
}

/// Wait up to `timeout_ms` for `fd` to become readable (or hung up).
pub(crate) fn wait_readable(fd: RawFd, timeout_ms: i32) -> io::Result<bool> {
    let mut p = libc::pollfd {
        fd,
        events: libc::POLLIN | libc::POLLRDHUP,
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

/// On a connection where the peer never speaks unprompted: has it closed or reset?
pub(crate) fn idle_peer_gone(fd: RawFd) -> bool {
    wait_readable(fd, 0).unwrap_or(true)
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
