//! Connections to a peer: set-up with the handshake, the ping that reads a
//! peer's incarnation, and the unchecked test write (the lane threads that
//! push requests through connections are `lane.rs`).

use std::net::{SocketAddr, TcpStream};
use std::os::fd::{AsRawFd, RawFd};
use std::time::Instant;

use super::{Inner, handshake};
use crate::session::io;
use crate::session::wire::{self, Ack, Header, Op, Status};
use crate::{ErrorKind, Side, TransferError};

/// An established, authenticated connection to one incarnation of a peer.
#[derive(Debug)]
pub(crate) struct Conn {
    pub(super) stream: TcpStream,
    /// The peer process's incarnation it reached.
    pub(super) incarnation: u64,
    pub(super) seq: u64,
    /// Number of this connection (for logs).
    pub(super) id: u64,
    /// When the connection last carried a request (or was opened).
    pub(super) last_used: Instant,
}

impl Conn {
    pub(crate) fn fd(&self) -> RawFd {
        self.stream.as_raw_fd()
    }

    /// The socket and the incarnation of the peer process it reached.
    #[cfg(feature = "cuda")]
    pub(crate) fn into_parts(self) -> (TcpStream, u64) {
        (self.stream, self.incarnation)
    }
}

/// Connect to `addr` and run the client side of the handshake (all of it
/// within the connect timeout, see [`handshake::client`]).
pub(crate) fn connect(
    inner: &Inner,
    session: &str,
    addr: SocketAddr,
) -> Result<Conn, TransferError> {
    let cfg = &inner.cfg;
    let stream = TcpStream::connect_timeout(&addr, cfg.connect_timeout()).map_err(|e| {
        TransferError::new(
            session,
            None,
            ErrorKind::Unreachable,
            format!("connect to {addr}: {e}"),
        )
    })?;
    let setup = || -> std::io::Result<()> {
        stream.set_nodelay(true)?;
        stream.set_read_timeout(Some(cfg.io_timeout()))?;
        stream.set_write_timeout(Some(cfg.io_timeout()))
    };
    setup().map_err(|e| TransferError::from_io(session, None, &e))?;
    let incarnation = handshake::client(inner, session, stream.as_raw_fd())?;
    Ok(Conn {
        stream,
        incarnation,
        seq: 0,
        id: inner.next_id(),
        last_used: Instant::now(),
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

pub(super) fn read_ack(fd: RawFd) -> std::io::Result<Option<Ack>> {
    let mut b = [0u8; wire::ACK_LEN];
    io::read_exact(fd, &mut b)?;
    Ok(Ack::decode(&b))
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
