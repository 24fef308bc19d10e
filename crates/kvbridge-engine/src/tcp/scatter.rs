//! Receiving a `Write` request's payload into registered memory.
//!
//! Every destination is checked under the registry's read lock before the
//! first payload byte is read. The payload is then received in steps, each
//! under a fresh read guard: the guard is *not* held while waiting for the
//! peer, so a peer that trickles its payload cannot hold up a
//! deregistration (or shutdown) for longer than one non-blocking receive.
//! Each step first checks the stop condition (shutdown, fence abort) and
//! the registry's generation: if a region was deregistered since the
//! check, the destinations are checked again, and the request is abandoned
//! (connection dropped) when one is gone.

use std::io;

use kvbridge_mem::{MemoryKind, RegionRegistry, access_for};
use parking_lot::RwLockReadGuard;

use super::server::{BOUNCE_CAP, ServerConn};
use crate::session::io::{Budget, READABLE};
use crate::session::wire::{self, Header, Status};

/// Bytes of a request waiting in the bounce buffer: `(dst, kind, offset, len)`.
type Pending = Vec<(u64, MemoryKind, usize, usize)>;

impl ServerConn<'_> {
    /// Receive one `Write` request; `None` if the descriptors contradict the header.
    pub(super) fn write(
        &mut self,
        h: &Header,
        b: &mut Budget<'_>,
    ) -> io::Result<Option<(Status, u32)>> {
        let n = h.count as usize;
        self.descs.resize(n * wire::DESC_LEN, 0);
        crate::session::io::read_exact_by(self.fd, &mut self.descs, b)?;
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
                    self.refused(
                        "write outside our registered regions refused; request discarded",
                        i,
                    );
                    crate::session::io::discard_by(self.fd, h.payload, &mut self.bounce, b)?;
                    return Ok(Some((Status::OutOfRegion, i as u32)));
                }
            }
        }
        let generation = regions.generation();
        drop(regions);
        self.receive(h, generation, &kinds, b).map(Some)
    }

    /// Receive a checked request's payload into `self.descs` (of `kinds`,
    /// checked at registry `generation`) and count its bytes.
    pub(super) fn receive(
        &mut self,
        h: &Header,
        generation: u64,
        kinds: &[MemoryKind],
        b: &mut Budget<'_>,
    ) -> io::Result<(Status, u32)> {
        let status = self.scatter(generation, kinds, b)?;
        let stats = &self.inner.stats;
        let total = stats
            .bytes_received
            .fetch_add(h.payload, std::sync::atomic::Ordering::Relaxed)
            + h.payload;
        if total
            >= self
                .inner
                .freeze_after
                .load(std::sync::atomic::Ordering::Acquire)
        {
            self.inner
                .frozen
                .store(true, std::sync::atomic::Ordering::Release);
        }
        Ok(status)
    }

    /// The registry's read guard for one step of a request whose
    /// destinations (`self.descs`, of `kinds`) were checked at registry
    /// generation `*generation`: `ConnectionAborted` when the request must
    /// stop (shutdown, fence) or a destination was deregistered meanwhile.
    fn step_guard(
        &self,
        generation: &mut u64,
        kinds: &[MemoryKind],
        b: &Budget<'_>,
    ) -> io::Result<RwLockReadGuard<'_, RegionRegistry>> {
        let g = self.inner.regions.read_recursive();
        if b.stopped() {
            return Err(crate::session::io::aborted());
        }
        if g.generation() != *generation {
            for (i, &kind) in kinds.iter().enumerate() {
                let (dst, len) = wire::desc_at(&self.descs, i);
                if !g.find(dst, len).is_some_and(|r| r.kind == kind) {
                    return Err(io::Error::new(
                        io::ErrorKind::ConnectionAborted,
                        "a destination was deregistered while its request was received",
                    ));
                }
            }
            *generation = g.generation();
        }
        Ok(g)
    }

    /// Read the payload into the validated destinations: long host blocks
    /// directly, short or staged ones through the bounce buffer.
    fn scatter(
        &mut self,
        mut generation: u64,
        kinds: &[MemoryKind],
        b: &mut Budget<'_>,
    ) -> io::Result<(Status, u32)> {
        let threshold = self.inner.cfg.tcp.coalesce_threshold as u64;
        let force_copy = self.inner.cfg.tcp.force_staging;
        let bounce = self.bounce.as_mut_ptr();
        let mut iovs: Vec<libc::iovec> = Vec::with_capacity(64);
        let mut pending: Pending = Vec::new();
        let mut used = 0usize;
        let mut mem_error: Option<u32> = None;
        let mut st = Step {
            generation: &mut generation,
            kinds,
            mem_error: &mut mem_error,
        };
        for (i, kind) in kinds.iter().copied().enumerate() {
            let (dst, len64) = wire::desc_at(&self.descs, i);
            let len = len64 as usize;
            if len == 0 {
                continue;
            }
            if kind.is_host_accessible() && !force_copy && len64 >= threshold {
                let p = std::ptr::with_exposed_provenance_mut::<u8>(dst as usize);
                iovs.push(crate::session::io::iov(p, len));
                if iovs.len() >= crate::session::io::MAX_IOV {
                    self.flush(&mut st, b, &mut iovs, &mut pending, i as u32)?;
                    used = 0;
                }
                continue;
            }
            let mut off = 0usize;
            while off < len {
                if used == BOUNCE_CAP {
                    self.flush(&mut st, b, &mut iovs, &mut pending, i as u32)?;
                    used = 0;
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
                    _ => iovs.push(crate::session::io::iov(start, k)),
                }
                pending.push((dst + off as u64, kind, used, k));
                used += k;
                off += k;
                if iovs.len() >= crate::session::io::MAX_IOV {
                    self.flush(&mut st, b, &mut iovs, &mut pending, i as u32)?;
                    used = 0;
                }
            }
        }
        if !iovs.is_empty() {
            self.flush(&mut st, b, &mut iovs, &mut pending, kinds.len() as u32)?;
        }
        Ok(match mem_error {
            Some(i) => (Status::Memory, i),
            None => (Status::Ok, 0),
        })
    }

    /// Receive into `iovs` step by step (a guard per step, none while
    /// waiting), then copy the bounced bytes out; clears both lists.
    fn flush(
        &self,
        st: &mut Step<'_>,
        b: &mut Budget<'_>,
        iovs: &mut Vec<libc::iovec>,
        pending: &mut Pending,
        index: u32,
    ) -> io::Result<()> {
        let fd = self.fd;
        let mut rest: &mut [libc::iovec] = iovs;
        while rest.first().is_some_and(|v| v.iov_len == 0) {
            rest = &mut rest[1..];
        }
        while !rest.is_empty() {
            let got = {
                let _g = self.step_guard(st.generation, st.kinds, b)?;
                // SAFETY: every iovec points either into `self.bounce`
                // (alive, not resized during the request) or into a
                // destination range that `write` checked to lie inside a
                // registered host-accessible region; `step_guard` re-checked
                // them if a region went away since, and the guard held
                // across this call keeps them registered. The registration
                // contract makes them valid, writable and untouched by
                // others meanwhile.
                unsafe { crate::session::io::recv_some(fd, rest) }?
            };
            match got {
                Some(n) => {
                    b.progressed();
                    rest = crate::session::io::advance(rest, n);
                    while rest.first().is_some_and(|v| v.iov_len == 0) {
                        rest = &mut rest[1..];
                    }
                }
                None => b.wait(fd, READABLE)?,
            }
        }
        if !pending.is_empty() {
            let _g = self.step_guard(st.generation, st.kinds, b)?;
            let bounce = self.bounce.as_ptr();
            for &(dst, kind, off, len) in pending.iter() {
                // SAFETY: `off + len <= BOUNCE_CAP <= bounce.len()`.
                let src = unsafe { std::slice::from_raw_parts(bounce.add(off), len) };
                // SAFETY: `[dst, dst + len)` was checked inside a registered
                // region of `kind` (re-checked by `step_guard` if a region
                // went away since), kept registered by the guard.
                let written = unsafe { access_for(kind).write(dst, src) };
                if let Err(e) = written
                    && st.mem_error.is_none()
                {
                    tracing::warn!(error = %e, "writing a received block into memory failed");
                    *st.mem_error = Some(index);
                }
            }
        }
        iovs.clear();
        pending.clear();
        Ok(())
    }
}

/// What the steps of one request share.
struct Step<'a> {
    generation: &'a mut u64,
    kinds: &'a [MemoryKind],
    mem_error: &'a mut Option<u32>,
}
