//! The registry of registered memory regions.

use std::collections::BTreeMap;
use std::sync::Arc;

use kvbridge_block::Run;

use crate::MemError;
use crate::kind::{KindProber, MemoryKind};
use crate::select::{access_for, default_prober};

/// One registered memory region: `[addr, addr + len)` of one memory kind.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub struct Region {
    /// First byte.
    pub addr: u64,
    /// Length in bytes (never 0 once registered).
    pub len: u64,
    /// Where the memory lives.
    pub kind: MemoryKind,
}

impl Region {
    /// One past the last byte.
    pub fn end(&self) -> u64 {
        self.addr + self.len
    }

    /// Whether `[addr, addr + len)` lies entirely inside this region (`len` may be 0).
    pub fn contains(&self, addr: u64, len: u64) -> bool {
        match addr.checked_add(len) {
            Some(end) => addr >= self.addr && end <= self.end(),
            None => false,
        }
    }
}

/// Registered regions, keyed by start address; no two overlap.
///
/// Not synchronized: the engines keep it behind a read-write lock and hold
/// the read side while they touch registered memory, so a deregistration
/// waits for in-flight I/O on the regions.
#[derive(Debug, Clone)]
pub struct RegionRegistry {
    by_start: BTreeMap<u64, Region>,
    /// The same regions in a vector, by start address: every transfer looks
    /// up each of its blocks, and a binary search over contiguous memory
    /// costs a fraction of a B-tree range walk. Rebuilt on every change.
    sorted: Vec<Region>,
    prober: Arc<dyn KindProber>,
    generation: u64,
}

impl Default for RegionRegistry {
    fn default() -> Self {
        Self::new()
    }
}

/// Validates the shape of one `(addr, len)` pair.
fn validate(addr: u64, len: u64) -> Result<(), MemError> {
    if addr == 0 {
        return Err(MemError::Null);
    }
    if len == 0 {
        return Err(MemError::ZeroLength { addr });
    }
    if addr.checked_add(len).is_none() {
        return Err(MemError::Overflow { addr, len });
    }
    Ok(())
}

impl RegionRegistry {
    /// An empty registry that probes kinds with [`default_prober`].
    pub fn new() -> Self {
        Self::with_prober(Arc::new(ProberRef(default_prober())))
    }

    /// An empty registry that probes kinds with `prober`.
    pub fn with_prober(prober: Arc<dyn KindProber>) -> Self {
        Self {
            by_start: BTreeMap::new(),
            sorted: Vec::new(),
            prober,
            generation: 0,
        }
    }

    /// Register a batch of `(ptr, len)` regions, probing each one's kind.
    ///
    /// Exact duplicates (in the batch or already registered) are registered
    /// once; a region that overlaps another without being identical is an
    /// error. The batch is all-or-nothing. Returns how many regions were new.
    ///
    /// # Safety
    /// Every range must be valid, readable and writable memory of its probed
    /// kind until it is deregistered, and while a transfer reads or writes
    /// part of it nothing else may write that part (or hold Rust references
    /// to bytes being written).
    pub unsafe fn register(&mut self, regions: &[(u64, u64)]) -> Result<usize, MemError> {
        let with_kinds: Vec<Region> = regions
            .iter()
            .map(|&(addr, len)| Region {
                addr,
                len,
                kind: self.prober.probe(addr),
            })
            .collect();
        // SAFETY: forwarded caller contract.
        unsafe { self.register_regions(&with_kinds) }
    }

    /// Register regions whose kinds the caller already knows; see [`Self::register`].
    ///
    /// # Safety
    /// As for [`Self::register`], with each region's memory of the stated kind.
    pub unsafe fn register_regions(&mut self, regions: &[Region]) -> Result<usize, MemError> {
        let mut fresh: BTreeMap<u64, Region> = BTreeMap::new();
        for r in regions {
            validate(r.addr, r.len)?;
            if Self::overlapping(&self.by_start, r)?.is_some()
                || Self::overlapping(&fresh, r)?.is_some()
            {
                continue; // an exact duplicate: registered once
            }
            fresh.insert(r.addr, *r);
        }
        let added = fresh.len();
        for (addr, r) in fresh {
            tracing::debug!(addr = format_args!("{addr:#x}"), len = r.len, kind = %r.kind, "region registered");
            self.by_start.insert(addr, r);
        }
        if added > 0 {
            self.reindex();
        }
        Ok(added)
    }

    /// The region of `map` that overlaps `r`: `Ok(Some(identical))`, `Ok(None)`, or an overlap error.
    fn overlapping(map: &BTreeMap<u64, Region>, r: &Region) -> Result<Option<Region>, MemError> {
        let end = r.end();
        // Candidates: the last region starting at or before r.addr, and any starting inside r.
        let before = map.range(..=r.addr).next_back().map(|(_, v)| *v);
        let inside = map.range(r.addr..end).next().map(|(_, v)| *v);
        for cand in [before, inside].into_iter().flatten() {
            if cand == *r {
                return Ok(Some(cand));
            }
            if cand.addr < end && r.addr < cand.end() {
                return Err(MemError::Overlap {
                    addr: r.addr,
                    len: r.len,
                    existing_addr: cand.addr,
                    existing_len: cand.len,
                });
            }
        }
        Ok(None)
    }

    /// Deregister the regions starting at `addrs` (duplicates ignored).
    ///
    /// Every known address is removed; if some address starts no region, the
    /// first such one is reported after the others were removed.
    pub fn deregister(&mut self, addrs: &[u64]) -> Result<(), MemError> {
        let mut seen = std::collections::HashSet::with_capacity(addrs.len());
        let mut first_unknown = None;
        let before = self.by_start.len();
        for &addr in addrs {
            if !seen.insert(addr) {
                continue; // handled at its first occurrence
            }
            if self.by_start.remove(&addr).is_some() {
                self.generation += 1;
                tracing::debug!(addr = format_args!("{addr:#x}"), "region deregistered");
            } else if first_unknown.is_none() {
                first_unknown = Some(addr);
            }
        }
        if self.by_start.len() != before {
            self.reindex();
        }
        match first_unknown {
            Some(addr) => Err(MemError::NotRegistered { addr }),
            None => Ok(()),
        }
    }

    /// The region that contains all of `[addr, addr + len)`, in `O(log n)`.
    pub fn find(&self, addr: u64, len: u64) -> Option<&Region> {
        // The last region starting at or before `addr`.
        let after = self.sorted.partition_point(|r| r.addr <= addr);
        let r = self.sorted.get(after.checked_sub(1)?)?;
        r.contains(addr, len).then_some(r)
    }

    /// Rebuilds the vector [`Self::find`] searches from the map.
    fn reindex(&mut self) {
        self.sorted.clear();
        self.sorted.extend(self.by_start.values().copied());
    }

    /// Like [`Self::find`], as a `Result` for `?`.
    pub fn check(&self, addr: u64, len: u64) -> Result<&Region, MemError> {
        self.find(addr, len)
            .ok_or(MemError::OutOfRegion { addr, len })
    }

    /// All registered regions, by start address.
    pub fn regions(&self) -> impl Iterator<Item = &Region> + '_ {
        self.by_start.values()
    }

    /// Number of registered regions.
    pub fn len(&self) -> usize {
        self.by_start.len()
    }

    /// Whether nothing is registered.
    pub fn is_empty(&self) -> bool {
        self.by_start.is_empty()
    }

    /// Counts deregistrations; changes whenever a region may have gone away.
    pub fn generation(&self) -> u64 {
        self.generation
    }

    /// Copy `out.len()` registered bytes starting at `addr` into `out`.
    pub fn read_bytes(&self, addr: u64, out: &mut [u8]) -> Result<(), MemError> {
        let region = self.check(addr, out.len() as u64)?;
        // SAFETY: the range lies inside a registered region of `region.kind`,
        // which the registration contract keeps valid and readable.
        unsafe { access_for(region.kind).read(addr, out) }
    }

    /// Copy `data` to registered memory at `addr`; refused unless it fits inside one region.
    pub fn write_bytes(&self, addr: u64, data: &[u8]) -> Result<(), MemError> {
        let region = self.check(addr, data.len() as u64)?;
        // SAFETY: the range lies inside a registered region of `region.kind`,
        // which the registration contract keeps valid, writable and unshared
        // while a transfer writes it.
        unsafe { access_for(region.kind).write(addr, data) }
    }

    /// Write many `(addr, data)` items; each must fit inside one region.
    /// Items for device memory are staged together and copied with one
    /// wait, instead of one synchronous copy each. Returns each item's result.
    pub fn write_batch(&self, writes: &[(u64, &[u8])]) -> Vec<Result<(), MemError>> {
        let mut results: Vec<Result<(), MemError>> = Vec::with_capacity(writes.len());
        let mut device: Vec<(usize, MemoryKind)> = Vec::new();
        for (i, (addr, data)) in writes.iter().enumerate() {
            match self.check(*addr, data.len() as u64) {
                Err(e) => results.push(Err(e)),
                Ok(r) if r.kind.is_host_accessible() => {
                    // SAFETY: inside a registered host-accessible region (checked).
                    results.push(unsafe { access_for(r.kind).write(*addr, data) });
                }
                Ok(r) => {
                    device.push((i, r.kind));
                    results.push(Ok(()));
                }
            }
        }
        if let Some((_, kind)) = device.first() {
            let items: Vec<(u64, &[u8])> = device.iter().map(|(i, _)| writes[*i]).collect();
            // SAFETY: every item lies inside a registered device region (checked).
            if let Err(e) = unsafe { access_for(*kind).write_many(&items) } {
                for (i, _) in &device {
                    results[*i] = Err(e.clone());
                }
            }
        }
        results
    }

    /// Copies a strided [`Run`] between registered regions of this
    /// registry (a local gather or scatter): every source and destination
    /// span must lie inside one region each, and the two spans must not
    /// overlap. Host memory is copied directly; device memory through the
    /// kind's byte access, piece by piece.
    pub fn copy_strided(&self, c: &Run) -> Result<(), MemError> {
        if c.count == 0 || c.len == 0 {
            return Ok(());
        }
        let span = |base: u64, stride: u64| {
            (c.count - 1)
                .checked_mul(stride)
                .and_then(|s| s.checked_add(c.len))
                .filter(|s| base.checked_add(*s).is_some())
                .ok_or(MemError::Overflow {
                    addr: base,
                    len: c.len,
                })
        };
        let (src_span, dst_span) = (span(c.src, c.src_stride)?, span(c.dst, c.dst_stride)?);
        let src_region = *self.check(c.src, src_span)?;
        let dst_region = *self.check(c.dst, dst_span)?;
        if c.src < c.dst + dst_span && c.dst < c.src + src_span {
            return Err(MemError::Overlap {
                addr: c.dst,
                len: dst_span,
                existing_addr: c.src,
                existing_len: src_span,
            });
        }
        if c.count > 1 && c.dst_stride < c.len {
            return Err(MemError::Overlap {
                addr: c.dst,
                len: c.len,
                existing_addr: c.dst + c.dst_stride,
                existing_len: c.len,
            });
        }
        let len = usize::try_from(c.len).map_err(|_| MemError::Overflow {
            addr: c.src,
            len: c.len,
        })?;
        if src_region.kind.is_host_accessible() && dst_region.kind.is_host_accessible() {
            for i in 0..c.count {
                let (s, d) = (c.src + i * c.src_stride, c.dst + i * c.dst_stride);
                // SAFETY: both spans lie inside registered host-accessible
                // regions (checked above), which the registration contract
                // keeps valid; the spans do not overlap each other and the
                // destination pieces do not overlap one another (checked).
                unsafe { std::ptr::copy_nonoverlapping(s as *const u8, d as *mut u8, len) };
            }
            return Ok(());
        }
        let mut piece = vec![0u8; len];
        for i in 0..c.count {
            let (s, d) = (c.src + i * c.src_stride, c.dst + i * c.dst_stride);
            // SAFETY: inside registered regions of their kinds (checked above).
            unsafe {
                access_for(src_region.kind).read(s, &mut piece)?;
                access_for(dst_region.kind).write(d, &piece)?;
            }
        }
        Ok(())
    }

    /// Read `len` registered bytes at `addr` into a new vector.
    pub fn read_vec(&self, addr: u64, len: usize) -> Result<Vec<u8>, MemError> {
        let mut out = vec![0u8; len];
        self.read_bytes(addr, &mut out)?;
        Ok(out)
    }
}

/// Adapts the `'static` default prober to an `Arc<dyn KindProber>`.
#[derive(Debug)]
struct ProberRef(&'static dyn KindProber);

impl KindProber for ProberRef {
    fn probe(&self, addr: u64) -> MemoryKind {
        self.0.probe(addr)
    }
}
