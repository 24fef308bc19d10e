//! The in-process loopback engine, for tests: engines find each other by
//! session id in a process-wide directory and copy with plain CPU copies.
//! Fencing: a copy into an engine holds that engine's registry read lock
//! and checks its fence set under it, so `fence_peer` (fence set, then the
//! write lock once) returns only after copies in progress finished.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock, Weak};

use kvbridge_mem::{MemError, Region, RegionRegistry, access_for};
use parking_lot::{Mutex, RwLock};

use crate::{Batch, BatchHandle, Block, ErrorKind, Side, Target, TransferEngine, TransferError};

struct Shared {
    session: String,
    regions: RwLock<RegionRegistry>,
    /// Sessions whose writes into this engine are refused.
    fenced: Mutex<HashSet<String>>,
}

type Directory = Mutex<HashMap<String, Weak<Shared>>>;

fn directory() -> &'static Directory {
    static DIR: OnceLock<Directory> = OnceLock::new();
    DIR.get_or_init(Default::default)
}

/// An in-process engine; its session id is `"loopback:N"`. Dropping it (or
/// [`LoopbackEngine::shutdown`]) makes it unreachable, like a dead peer.
pub struct LoopbackEngine {
    shared: Arc<Shared>,
}

impl std::fmt::Debug for LoopbackEngine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LoopbackEngine")
            .field("session", &self.shared.session)
            .finish()
    }
}

impl Default for LoopbackEngine {
    fn default() -> Self {
        Self::new()
    }
}

impl Drop for LoopbackEngine {
    fn drop(&mut self) {
        self.shutdown();
    }
}

impl LoopbackEngine {
    /// A new engine with a fresh session id, reachable by every other loopback engine.
    pub fn new() -> Self {
        static NEXT: AtomicU64 = AtomicU64::new(1);
        let session = format!("loopback:{}", NEXT.fetch_add(1, Ordering::Relaxed));
        let shared = Arc::new(Shared {
            session: session.clone(),
            regions: RwLock::new(RegionRegistry::new()),
            fenced: Mutex::new(HashSet::new()),
        });
        directory().lock().insert(session, Arc::downgrade(&shared));
        Self { shared }
    }

    /// Leave the directory: peers now see this engine as unreachable.
    pub fn shutdown(&self) {
        directory().lock().remove(&self.shared.session);
    }

    fn transfer(&self, session: &str, blocks: &[Block]) -> Result<(), TransferError> {
        let err = |block, kind, detail: String| TransferError::new(session, block, kind, detail);
        // The memory kind of each block's range on `side`, or the first
        // block outside the registry's regions.
        let kinds = |reg: &RegionRegistry, side: Side| {
            let range = |b: &Block| match side {
                Side::Local => (b.src, b.len),
                Side::Remote => (b.dst, b.len),
            };
            blocks
                .iter()
                .enumerate()
                .map(|(i, b)| {
                    let (addr, len) = range(b);
                    reg.check(addr, len)
                        .map(|r| r.kind)
                        .map_err(|e| err(Some(i), ErrorKind::OutOfRegion(side), e.to_string()))
                })
                .collect::<Result<Vec<_>, _>>()
        };
        let local = self.shared.regions.read_recursive();
        let srcs = kinds(&local, Side::Local)?;
        let peer = directory()
            .lock()
            .get(session)
            .and_then(Weak::upgrade)
            .ok_or_else(|| {
                err(
                    None,
                    ErrorKind::Unreachable,
                    "no such loopback engine".into(),
                )
            })?;
        let remote = peer.regions.read_recursive();
        if peer.fenced.lock().contains(&self.shared.session) {
            return Err(err(
                None,
                ErrorKind::Refused,
                format!(
                    "peer has fenced this engine ({}): it accepts no writes from it",
                    self.shared.session
                ),
            ));
        }
        let dsts = kinds(&remote, Side::Remote)?;
        let mut staging = Vec::new();
        for (i, b) in blocks.iter().enumerate() {
            let (sk, dk) = (srcs[i], dsts[i]);
            let len = usize::try_from(b.len)
                .map_err(|_| err(Some(i), ErrorKind::InvalidArgument, "block too long".into()))?;
            if sk.is_host_accessible() && dk.is_host_accessible() {
                let src = std::ptr::with_exposed_provenance::<u8>(b.src as usize);
                let dst = std::ptr::with_exposed_provenance_mut::<u8>(b.dst as usize);
                // SAFETY: both ranges were checked above to lie inside
                // registered host-accessible regions, whose registration
                // contract keeps them valid; the read guards held here keep
                // them registered; `ptr::copy` allows src/dst overlap.
                unsafe { std::ptr::copy(src, dst, len) };
            } else {
                staging.resize(len, 0);
                // SAFETY: the ranges are inside registered regions of kinds
                // `sk` / `dk`, kept registered by the guards held here.
                let r = unsafe {
                    access_for(sk)
                        .read(b.src, &mut staging)
                        .and_then(|()| access_for(dk).write(b.dst, &staging))
                };
                r.map_err(|e| err(Some(i), ErrorKind::Io, e.to_string()))?;
            }
        }
        Ok(())
    }
}

impl TransferEngine for LoopbackEngine {
    unsafe fn batch_register(&self, regions: &[(u64, u64)]) -> Result<(), MemError> {
        // SAFETY: forwarded caller contract.
        unsafe { self.shared.regions.write().register(regions) }.map(|_| ())
    }

    fn session_id(&self) -> &str {
        &self.shared.session
    }

    fn batch_deregister(&self, addrs: &[u64]) -> Result<(), MemError> {
        self.shared.regions.write().deregister(addrs)
    }

    fn submit(&self, target: Target<'_>, batch: Batch<'_>) -> BatchHandle {
        let r = crate::batch_blocks(target.session, batch)
            .and_then(|blocks| self.transfer(target.session, &blocks));
        BatchHandle::ready(r)
    }

    /// Refuse writes from `session`; returns once copies from it in
    /// progress finished. Always `Ok(true)`.
    fn fence_peer(&self, session: &str) -> Result<bool, TransferError> {
        self.shared.fenced.lock().insert(session.to_owned());
        // Every copy into us holds our read lock and checks the fence set
        // under it: once we had the write lock, none from `session` runs.
        drop(self.shared.regions.write());
        Ok(true)
    }

    fn unfence_peer(&self, session: &str) {
        self.shared.fenced.lock().remove(session);
    }

    fn probe(&self, session: &str) -> Result<(), TransferError> {
        match directory().lock().get(session).and_then(Weak::upgrade) {
            Some(_) => Ok(()),
            None => Err(TransferError::new(
                session,
                None,
                ErrorKind::Unreachable,
                "no such loopback engine",
            )),
        }
    }

    fn registered_regions(&self) -> Vec<Region> {
        self.shared.regions.read().regions().copied().collect()
    }

    fn write_local(&self, addr: u64, data: &[u8]) -> Result<(), MemError> {
        self.shared.regions.read_recursive().write_bytes(addr, data)
    }

    fn read_local(&self, addr: u64, out: &mut [u8]) -> Result<(), MemError> {
        self.shared.regions.read_recursive().read_bytes(addr, out)
    }
}
