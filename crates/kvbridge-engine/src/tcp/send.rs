//! Sending one request of a batch over a lane's connection: the header and
//! descriptors, then the payload straight from registered memory (long
//! host blocks) or through the lane's frame buffer (short or staged ones).

use std::os::fd::RawFd;
use std::time::Instant;

use kvbridge_mem::{MemoryKind, RegionRegistry, access_for};
use parking_lot::RwLockReadGuard;

use super::Inner;
use super::conn::Conn;
use super::request::{Item, Piece, Work};
use crate::session::io::{self, Budget, WRITABLE};
use crate::session::wire::{self, Header, Op};
use crate::{ErrorKind, Side, TransferError};

/// Size of a lane's frame buffer, into which short blocks are coalesced.
pub(crate) const FRAME_CAP: usize = 1 << 20;

/// Buffers a lane reuses across requests.
pub(super) struct LaneBufs {
    pub(super) head: Vec<u8>,
    pub(super) frame: Vec<u8>,
    pub(super) iovs: Vec<libc::iovec>,
}

/// Why a request could not be sent.
pub(super) enum SendError {
    /// Failed before any byte went out: the connection is still in step.
    Local(TransferError),
    /// Failed on the connection: it must be dropped.
    Conn(TransferError),
}

/// Local reads of one request's sources (`pieces`, of `kinds`), checked
/// at registry generation `generation`: each step takes a fresh read guard
/// (none is held while waiting for the peer, so a receiver that reads
/// slowly cannot hold up a deregistration or shutdown).
struct Sources<'a> {
    inner: &'a Inner,
    item: &'a Item,
    kinds: Vec<MemoryKind>,
    generation: u64,
}

impl<'a> Sources<'a> {
    /// The guard for one step; fails on shutdown, or when a source was
    /// deregistered since the check (bytes may be on the wire: the
    /// connection is dropped).
    fn guard(&mut self) -> Result<RwLockReadGuard<'a, RegionRegistry>, SendError> {
        let g = self.inner.regions.read_recursive();
        if self.inner.is_shutdown() {
            return Err(SendError::Conn(
                self.item.error(ErrorKind::Shutdown, "engine shut down"),
            ));
        }
        if g.generation() != self.generation {
            for (p, &kind) in self.item.pieces().iter().zip(&self.kinds) {
                if !g.find(p.src, p.src_span()).is_some_and(|r| r.kind == kind) {
                    return Err(SendError::Conn(TransferError::new(
                        &self.item.batch.session,
                        Some(p.block),
                        ErrorKind::OutOfRegion(Side::Local),
                        "a source was deregistered while its request was sent",
                    )));
                }
            }
            self.generation = g.generation();
        }
        Ok(g)
    }

    /// Send what `iovs` describes, a guarded step at a time; clears `iovs`.
    fn send(
        &mut self,
        fd: RawFd,
        iovs: &mut Vec<libc::iovec>,
        b: &mut Budget<'_>,
    ) -> Result<(), SendError> {
        let item = self.item;
        let conn_err = |e: std::io::Error| SendError::Conn(item.io_error(&e));
        let mut rest: &mut [libc::iovec] = iovs;
        while rest.first().is_some_and(|v| v.iov_len == 0) {
            rest = &mut rest[1..];
        }
        while !rest.is_empty() {
            let sent = {
                let _g = self.guard()?;
                // SAFETY: the iovecs point into the lane's head and frame
                // buffers (alive and not resized until `send_item` returns)
                // and into source ranges checked to lie in registered
                // regions, re-checked by `guard` if a region went away, and
                // kept registered by the guard held across this call.
                unsafe { io::send_some(fd, rest) }.map_err(conn_err)?
            };
            match sent {
                Some(n) if n > 0 => {
                    b.progressed();
                    rest = io::advance(rest, n);
                    while rest.first().is_some_and(|v| v.iov_len == 0) {
                        rest = &mut rest[1..];
                    }
                }
                _ => b.wait(fd, WRITABLE).map_err(conn_err)?,
            }
        }
        iovs.clear();
        Ok(())
    }
}

/// Send one request, within `request_timeout_ms` (and no pause longer
/// than `io_timeout_ms`).
pub(super) fn send_item(
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
    let runs = pieces.iter().any(|p| p.copies != 1);
    let op = match (&item.work, runs) {
        (Work::Check(_), false) => Op::Check,
        (Work::Check(_), true) => Op::CheckRuns,
        (Work::Write(_), false) => Op::Write,
        (Work::Write(_), true) => Op::WriteRuns,
    };
    let payload = match op {
        Op::Write | Op::WriteRuns => pieces.iter().map(Piece::bytes).sum(),
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
        if runs {
            let d = wire::RunDesc {
                dst: p.dst,
                len: p.len,
                copies: p.copies,
                stride: p.dst_stride,
            };
            d.push(&mut bufs.head);
        } else {
            wire::push_desc(&mut bufs.head, p.dst, p.len);
        }
    }
    let stop = || inner.is_shutdown();
    let cfg = &inner.cfg;
    let mut b = Budget::new(
        Instant::now() + cfg.request_timeout(),
        cfg.io_timeout(),
        &stop,
    );
    if matches!(op, Op::Check | Op::CheckRuns) {
        io::write_all_by(fd, &bufs.head, &mut b).map_err(|e| SendError::Conn(item.io_error(&e)))?;
        return Ok(seq);
    }
    let mut src = {
        let regions = inner.regions.read_recursive();
        if inner.is_shutdown() {
            return Err(SendError::Local(
                item.error(ErrorKind::Shutdown, "engine shut down"),
            ));
        }
        let kinds = pieces
            .iter()
            .map(|p| check_source(&regions, item, p))
            .collect::<Result<Vec<_>, _>>()?;
        Sources {
            inner,
            item,
            kinds,
            generation: regions.generation(),
        }
    };
    let threshold = inner.cfg.tcp.coalesce_threshold as u64;
    let force_copy = inner.cfg.tcp.force_staging;
    if bufs.frame.len() < FRAME_CAP {
        bufs.frame.resize(FRAME_CAP, 0);
    }
    let iovs = &mut bufs.iovs;
    iovs.clear();
    iovs.push(io::iov(bufs.head.as_ptr(), bufs.head.len()));
    let frame_ptr = bufs.frame.as_mut_ptr();
    let mut used = 0usize;
    // The source ranges in payload order: a run whose copies lie back to
    // back is one range.
    let ranges = pieces.iter().zip(&src.kinds).flat_map(|(p, &kind)| {
        let whole = p.copies == 1 || p.src_stride == p.len;
        let (n, len) = if whole {
            (1, p.bytes())
        } else {
            (p.copies, p.len)
        };
        (0..n).map(move |c| (p, kind, p.copy_at(c).0, len))
    });
    let ranges: Vec<(&Piece, MemoryKind, u64, u64)> = ranges.collect();
    let mut held: Option<RwLockReadGuard<'_, RegionRegistry>> = None;
    for (p, kind, from, len64) in ranges {
        let len = len64 as usize;
        if len == 0 {
            continue;
        }
        if kind.is_host_accessible() && !force_copy && len64 >= threshold {
            let ptr = std::ptr::with_exposed_provenance::<u8>(from as usize);
            iovs.push(io::iov(ptr, len));
            if iovs.len() >= io::MAX_IOV {
                held = None;
                src.send(fd, iovs, &mut b)?;
                used = 0;
            }
            continue;
        }
        let mut off = 0usize;
        while off < len {
            if used == FRAME_CAP {
                held = None;
                src.send(fd, iovs, &mut b)?;
                used = 0;
            }
            let k = (len - off).min(FRAME_CAP - used);
            // SAFETY: `used + k <= FRAME_CAP == frame.len()`, so the slice is in
            // bounds; no iovec currently covers `frame[used..]`.
            let dst = unsafe { std::slice::from_raw_parts_mut(frame_ptr.add(used), k) };
            // One guard for a frame's worth of copies (released before the
            // frame is sent): a guard per short copy costs more than it.
            if held.is_none() {
                held = Some(src.guard()?);
            }
            // SAFETY: `[from + off, +k)` lies in a registered region of
            // `kind` (checked, and re-checked by `guard` if a region went
            // away), kept registered by the guard `held`.
            let r = unsafe { access_for(kind).read(from + off as u64, dst) };
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
                held = None;
                src.send(fd, iovs, &mut b)?;
                used = 0;
            }
        }
    }
    drop(held);
    if !iovs.is_empty() {
        src.send(fd, iovs, &mut b)?;
    }
    c.last_used = Instant::now();
    Ok(seq)
}

/// The kind of piece `p`'s source, which must lie in a registered region.
fn check_source(regions: &RegionRegistry, item: &Item, p: &Piece) -> Result<MemoryKind, SendError> {
    regions
        .check(p.src, p.src_span())
        .map(|r| r.kind)
        .map_err(|e| {
            SendError::Local(TransferError::new(
                &item.batch.session,
                Some(p.block),
                ErrorKind::OutOfRegion(Side::Local),
                e.to_string(),
            ))
        })
}
