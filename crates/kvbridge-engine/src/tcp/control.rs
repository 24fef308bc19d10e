//! The client side of the control requests that the CUDA IPC engine sends
//! over an authenticated TCP-engine connection: fetch a peer's export
//! table, hold regions (`Lease`) while copies into them may be in flight,
//! notice the peer's `Revoke` of the hold and `Release` it.

use std::net::SocketAddr;

use super::conn::{self, Conn};
use super::wire::{self, Ack, Header, Op, Status};
use super::{TcpEngine, io};
use crate::{ErrorKind, Side, TransferError};

/// One control connection to a peer (one incarnation of it).
#[derive(Debug)]
pub(crate) struct Control {
    conn: Conn,
    session: String,
    seq: u64,
    /// The peer sent a `Revoke` that was not acted on yet.
    revoked: bool,
}

impl TcpEngine {
    /// Open an authenticated control connection to `session`.
    pub(crate) fn control(&self, session: &str) -> Result<Control, TransferError> {
        if self.inner.is_shutdown() {
            return Err(super::shutdown_error(session));
        }
        let addr: SocketAddr = super::resolve(session)?;
        let conn = conn::connect(&self.inner, session, addr)?;
        Ok(Control {
            conn,
            session: session.to_owned(),
            seq: 0,
            revoked: false,
        })
    }

    /// Set what `Exports` requests answer.
    pub(crate) fn set_exports(&self, table: Vec<u8>) {
        *self.inner.exports.write() = table;
    }

    /// The engine's registry, for the IPC engine (hold the read side while
    /// touching registered memory).
    pub(crate) fn registry(&self) -> &parking_lot::RwLock<kvbridge_mem::RegionRegistry> {
        &self.inner.regions
    }
}

impl Control {
    /// The peer's incarnation.
    pub(crate) fn incarnation(&self) -> u64 {
        self.conn.incarnation()
    }

    /// Whether the connection is unusable: the peer closed or reset it,
    /// or sent something other than a `Revoke` unprompted.
    pub(crate) fn is_stale(&mut self) -> bool {
        self.poll_revoke().is_err()
    }

    /// Read what the peer sent unprompted (only `Revoke` frames are
    /// allowed) without blocking; `Ok(true)` when a revoke is pending.
    pub(crate) fn poll_revoke(&mut self) -> Result<bool, TransferError> {
        while io::wait_readable(self.conn.fd(), 0).map_err(|e| self.err(&e))? {
            let mut b = [0u8; wire::ACK_LEN];
            io::read_exact(self.conn.fd(), &mut b).map_err(|e| self.err(&e))?;
            match Ack::decode(&b) {
                Some(a) if a.seq == 0 && a.status == Status::Revoked => self.revoked = true,
                _ => return Err(self.malformed()),
            }
        }
        Ok(self.revoked)
    }

    fn err(&self, e: &std::io::Error) -> TransferError {
        TransferError::from_io(&self.session, None, e)
    }

    fn malformed(&self) -> TransferError {
        TransferError::new(
            &self.session,
            None,
            ErrorKind::Refused,
            "peer sent a malformed or out-of-order control ack",
        )
    }

    /// The ack of request `seq`; `Revoke` frames before it are noted.
    fn read_ack(&mut self, seq: u64) -> Result<Ack, TransferError> {
        loop {
            let mut b = [0u8; wire::ACK_LEN];
            io::read_exact(self.conn.fd(), &mut b).map_err(|e| self.err(&e))?;
            match Ack::decode(&b) {
                Some(a) if a.seq == 0 && a.status == Status::Revoked => self.revoked = true,
                Some(a) if a.seq == seq => return Ok(a),
                _ => return Err(self.malformed()),
            }
        }
    }

    fn send(&mut self, op: Op, descs: &[(u64, u64)]) -> Result<u64, TransferError> {
        self.seq += 1;
        let count = u32::try_from(descs.len()).map_err(|_| {
            TransferError::new(
                &self.session,
                None,
                ErrorKind::InvalidArgument,
                "too many regions",
            )
        })?;
        let mut msg = Header {
            op,
            count,
            seq: self.seq,
            payload: 0,
        }
        .encode()
        .to_vec();
        for (start, len) in descs {
            wire::push_desc(&mut msg, *start, *len);
        }
        io::write_all(self.conn.fd(), &msg).map_err(|e| self.err(&e))?;
        Ok(self.seq)
    }

    fn request(&mut self, op: Op, descs: &[(u64, u64)]) -> Result<Ack, TransferError> {
        let seq = self.send(op, descs)?;
        self.read_ack(seq)
    }

    /// The peer's export table (raw bytes, decoded by the caller).
    pub(crate) fn exports(&mut self) -> Result<Vec<u8>, TransferError> {
        let ack = self.request(Op::Exports, &[])?;
        if ack.status != Status::Ok {
            return Err(TransferError::new(
                &self.session,
                None,
                ErrorKind::Refused,
                "peer refused to send its export table",
            ));
        }
        let mut lb = [0u8; 8];
        io::read_exact(self.conn.fd(), &mut lb).map_err(|e| self.err(&e))?;
        let len = u64::from_le_bytes(lb);
        if len > wire::MAX_EXPORTS_BYTES {
            return Err(TransferError::new(
                &self.session,
                None,
                ErrorKind::Refused,
                format!("peer announced a {len}-byte export table"),
            ));
        }
        let mut table = vec![0u8; len as usize];
        io::read_exact(self.conn.fd(), &mut table).map_err(|e| self.err(&e))?;
        Ok(table)
    }

    /// Ask the peer to hold `regions` (added to what this connection
    /// holds); `Err` with the index of a region it no longer has
    /// (`OutOfRegion(Remote)`).
    pub(crate) fn lease(&mut self, regions: &[(u64, u64)]) -> Result<(), TransferError> {
        let ack = self.request(Op::Lease, regions)?;
        match ack.status {
            Status::Ok => Ok(()),
            Status::OutOfRegion => Err(TransferError::new(
                &self.session,
                Some(ack.index as usize),
                ErrorKind::OutOfRegion(Side::Remote),
                "peer no longer has the region registered",
            )),
            _ => Err(TransferError::new(
                &self.session,
                None,
                ErrorKind::Refused,
                "peer refused the lease",
            )),
        }
    }

    /// Drop every hold of this connection (the caller's copies into the
    /// held regions have all finished); clears a pending revoke.
    pub(crate) fn release(&mut self) -> Result<(), TransferError> {
        let ack = self.request(Op::Release, &[])?;
        if ack.status != Status::Ok {
            return Err(TransferError::new(
                &self.session,
                None,
                ErrorKind::Refused,
                "peer refused the release",
            ));
        }
        self.revoked = false;
        Ok(())
    }
}
