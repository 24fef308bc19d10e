//! The control protocol a peer uses to copy into our memory without a
//! request per batch (the CUDA IPC engine): fetch the export table, hold
//! regions (`Lease`) while copies into them may be in flight, notice the
//! serving side's `Revoke` of the hold and `Release` it.
//!
//! Both ends live here: [`Holder`], what a serving connection does with
//! these requests (any transport serving the engine wire dispatches them
//! to it), and [`Control`], the client over an authenticated connection
//! that a [`ControlHost`] opens.
//!
//! **Never:** copies payload bytes, or grants a lease of a range that is
//! not inside one registered region at the moment the hold is taken.

use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::sync::Arc;

use kvbridge_mem::RegionRegistry;
use parking_lot::RwLock;

use super::holds::{self, Holds};
use super::io::{self, Budget};
use super::wire::{self, Ack, Status};

/// The serving side of one connection's control requests: its wake-up
/// eventfd (made at its first lease) and whether a `Revoke` is out.
#[derive(Debug, Default)]
pub(crate) struct Holder {
    wake: Option<Arc<OwnedFd>>,
    revoke_sent: bool,
}

impl Holder {
    /// Answer an `Exports` request `seq` with `table`.
    pub(crate) fn exports(
        fd: RawFd,
        seq: u64,
        table: &[u8],
        b: &mut Budget<'_>,
    ) -> std::io::Result<()> {
        let ack = Ack {
            seq,
            status: Status::Ok,
            index: 0,
        };
        let mut out = ack.encode().to_vec();
        out.extend_from_slice(&(table.len() as u64).to_le_bytes());
        out.extend_from_slice(table);
        io::write_all_by(fd, &out, b)
    }

    /// A lease of `count` regions read from `fd` (into `descs`): check that
    /// each is registered and add them to the hold of connection `id`
    /// before the read guard is dropped, so a deregistration racing with it
    /// sees the hold. `Ok(Err(i))` names the first region not registered.
    /// Linear in the number of regions (one `O(log r)` lookup and one hashed
    /// insert each), whatever the connection held before.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn lease(
        &mut self,
        fd: RawFd,
        count: u32,
        descs: &mut Vec<u8>,
        regions: &RwLock<RegionRegistry>,
        holds: &Holds,
        id: u64,
        b: &mut Budget<'_>,
    ) -> std::io::Result<Result<(), usize>> {
        let n = count as usize;
        descs.resize(n * wire::DESC_LEN, 0);
        io::read_exact_by(fd, descs, b)?;
        let wake = match &self.wake {
            Some(w) => w.clone(),
            None => {
                let w = holds::eventfd()?;
                self.wake = Some(w.clone());
                w
            }
        };
        let leased: Vec<(u64, u64)> = (0..n).map(|i| wire::desc_at(descs, i)).collect();
        let regions = regions.read_recursive();
        if let Some(bad) = leased
            .iter()
            .position(|&(start, len)| regions.find(start, len).is_none())
        {
            return Ok(Err(bad));
        }
        holds.add(id, &wake, &leased);
        drop(regions);
        Ok(Ok(()))
    }

    /// A `Release`: drop every hold of connection `id`.
    pub(crate) fn release(&mut self, holds: &Holds, id: u64) {
        holds.release(id);
        self.revoke_sent = false;
    }

    /// The eventfd that wakes the serving thread when a hold is revoked
    /// (none before the first lease).
    pub(crate) fn wake(&self) -> Option<Arc<OwnedFd>> {
        self.wake.clone()
    }

    /// Send the `Revoke` of connection `id`'s hold if it is being revoked
    /// and none was sent yet.
    pub(crate) fn revoke_if_due(
        &mut self,
        fd: RawFd,
        holds: &Holds,
        id: u64,
    ) -> std::io::Result<()> {
        if !self.revoke_sent && holds.revoking(id) {
            let revoke = Ack {
                seq: 0,
                status: Status::Revoked,
                index: 0,
            };
            io::write_all(fd, &revoke.encode())?;
            self.revoke_sent = true;
        }
        Ok(())
    }

    /// Consume the wake-ups of `wake` (see [`Holder::wake`]).
    pub(crate) fn drained(wake: &OwnedFd) {
        holds::drain(wake.as_raw_fd());
    }
}

#[cfg(feature = "cuda")]
pub(crate) use client::{Control, ControlHost};

#[cfg(feature = "cuda")]
mod client {
    use std::net::TcpStream;
    use std::os::fd::{AsRawFd, RawFd};

    use kvbridge_mem::RegionRegistry;
    use parking_lot::RwLock;

    use super::super::io;
    use super::super::wire::{self, Ack, Header, Op, Status};
    use crate::{ErrorKind, Side, TransferError};

    /// A transport that serves the engine wire and opens authenticated
    /// control connections to its peers (the CUDA IPC engine's control plane).
    pub(crate) trait ControlHost {
        /// Open an authenticated control connection to `session`.
        fn control(&self, session: &str) -> Result<Control, TransferError>;
        /// Set what `Exports` requests answer.
        fn set_exports(&self, table: Vec<u8>);
        /// The registry of our memory (hold the read side while touching it).
        fn registry(&self) -> &RwLock<RegionRegistry>;
    }

    /// One control connection to a peer (one incarnation of it).
    #[derive(Debug)]
    pub(crate) struct Control {
        stream: TcpStream,
        incarnation: u64,
        session: String,
        seq: u64,
        /// The peer sent a `Revoke` that was not acted on yet.
        revoked: bool,
    }

    impl Control {
        /// A control client over `stream`, authenticated with `incarnation` of `session`.
        pub(crate) fn new(session: &str, stream: TcpStream, incarnation: u64) -> Self {
            Self {
                stream,
                incarnation,
                session: session.to_owned(),
                seq: 0,
                revoked: false,
            }
        }

        fn fd(&self) -> RawFd {
            self.stream.as_raw_fd()
        }

        /// The peer's incarnation.
        pub(crate) fn incarnation(&self) -> u64 {
            self.incarnation
        }

        /// Whether the connection is unusable: the peer closed or reset it,
        /// or sent something other than a `Revoke` unprompted.
        pub(crate) fn is_stale(&mut self) -> bool {
            self.poll_revoke().is_err()
        }

        /// Read what the peer sent unprompted (only `Revoke` frames are
        /// allowed) without blocking; `Ok(true)` when a revoke is pending.
        pub(crate) fn poll_revoke(&mut self) -> Result<bool, TransferError> {
            while io::wait_readable(self.fd(), 0).map_err(|e| self.err(&e))? {
                let mut b = [0u8; wire::ACK_LEN];
                io::read_exact(self.fd(), &mut b).map_err(|e| self.err(&e))?;
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

        /// A refusal by (or of) the peer, `what` saying which.
        fn refused(&self, what: impl Into<String>) -> TransferError {
            TransferError::new(&self.session, None, ErrorKind::Refused, what)
        }

        fn malformed(&self) -> TransferError {
            self.refused("peer sent a malformed or out-of-order control ack")
        }

        /// The ack of request `seq`; `Revoke` frames before it are noted.
        fn read_ack(&mut self, seq: u64) -> Result<Ack, TransferError> {
            loop {
                let mut b = [0u8; wire::ACK_LEN];
                io::read_exact(self.fd(), &mut b).map_err(|e| self.err(&e))?;
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
            io::write_all(self.fd(), &msg).map_err(|e| self.err(&e))?;
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
                return Err(self.refused("peer refused to send its export table"));
            }
            let mut lb = [0u8; 8];
            io::read_exact(self.fd(), &mut lb).map_err(|e| self.err(&e))?;
            let len = u64::from_le_bytes(lb);
            if len > wire::MAX_EXPORTS_BYTES {
                return Err(self.refused(format!("peer announced a {len}-byte export table")));
            }
            let mut table = vec![0u8; len as usize];
            io::read_exact(self.fd(), &mut table).map_err(|e| self.err(&e))?;
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
                _ => Err(self.refused("peer refused the lease")),
            }
        }

        /// Drop every hold of this connection (the caller's copies into the
        /// held regions have all finished); clears a pending revoke.
        pub(crate) fn release(&mut self) -> Result<(), TransferError> {
            let ack = self.request(Op::Release, &[])?;
            if ack.status != Status::Ok {
                return Err(self.refused("peer refused the release"));
            }
            self.revoked = false;
            Ok(())
        }
    }
}
