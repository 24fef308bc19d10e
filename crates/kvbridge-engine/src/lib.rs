//! # kvbridge-engine
//!
//! The one door through which kvbridge moves bytes between processes: the
//! [`TransferEngine`] trait, modelled on what sglang's Mooncake connector asks
//! of the Mooncake transfer engine (`get_session_id`, `batch_register`,
//! `batch_deregister`, `batch_transfer_sync`, `send_probe`), and its backends:
//! [`LoopbackEngine`] (in-process, for tests), [`TcpEngine`] (the default
//! on every machine and the cross-node fallback; see `docs/engines.md`) and,
//! with the `ucx` feature (on by default; libucp is loaded at run time),
//! `UcxEngine` (RDMA, shared memory or TCP through UCX).
//!
//! Every transport builds on one session layer (handshake, cluster-secret
//! authentication, the engine wire, holds and leases, session ids); none
//! imports another. [`factory::build`] starts one by [`Transport`] name
//! from an [`EngineConfig`].
//!
//! **Owns:** sessions (`host:port`), memory registration with the engine,
//! batches of [`Block`]s, the data-plane sockets, the TCP framing,
//! coalescing, authentication and timeouts, and typed [`TransferError`]s.
//!
//! **Never:** knows about rooms, requests, layouts or the zmq control plane
//! (that is `kvbridge-roles`), panics on peer input, writes a byte outside a
//! region registered with it (every destination of a request is checked
//! before any byte is written), or blocks forever on a dead peer (every
//! connect and read has a timeout). Memory is read and written only through
//! `kvbridge-mem` regions; device memory is staged through host memory by
//! the per-kind [`kvbridge_mem::MemoryAccess`].
//!
//! ```
//! use kvbridge_engine::{Block, LoopbackEngine, TransferEngine};
//! use kvbridge_mem::HostBuffer;
//! let (a, b) = (LoopbackEngine::new(), LoopbackEngine::new());
//! let mut src = HostBuffer::new(4096).unwrap();
//! let dst = HostBuffer::new(4096).unwrap();
//! src.as_mut_slice()[..5].copy_from_slice(b"hello");
//! // SAFETY: both buffers stay alive until they are deregistered below and
//! // are not borrowed while the transfer runs.
//! unsafe {
//!     a.batch_register(&[src.region()]).unwrap();
//!     b.batch_register(&[dst.region()]).unwrap();
//! }
//! let blocks = [Block { src: src.addr(), dst: dst.addr() + 100, len: 5 }];
//! a.batch_transfer_sync(b.session_id(), &blocks).unwrap();
//! assert_eq!(&dst.as_slice()[100..105], b"hello");
//! a.batch_deregister(&[src.addr()]).unwrap();
//! b.batch_deregister(&[dst.addr()]).unwrap();
//! ```

mod batch;
mod config;
mod error;
pub mod factory;
#[doc(hidden)]
pub mod fuzzing;
pub mod ipc;
mod loopback;
pub mod secret;
mod session;
pub mod tcp;
#[cfg(feature = "ucx")]
pub mod ucx;

pub use batch::BatchHandle;
pub use config::{EngineConfig, UcxConfig};
pub use error::{ErrorKind, Side, TransferError};
pub use factory::{FactoryError, Transport};
#[cfg(feature = "cuda")]
pub use ipc::IpcEngine;
pub use kvbridge_mem::{MemError, MemoryKind, Region};
pub use loopback::LoopbackEngine;
pub use secret::{ClusterSecret, SecretError};
pub use tcp::{EngineStats, TcpEngine};
#[cfg(feature = "ucx")]
pub use ucx::{UcxEngine, UcxError, UcxStats};

/// One contiguous copy: `len` bytes from local `src` to the peer's `dst`.
///
/// Layout-identical to the planner's block, so `bytemuck::cast_slice` turns
/// a planned `&[plan::Block]` into `&[Block]` without copying.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default, bytemuck::Pod, bytemuck::Zeroable)]
pub struct Block {
    /// Source address in local registered memory.
    pub src: u64,
    /// Destination address in the peer's registered memory.
    pub dst: u64,
    /// Number of bytes.
    pub len: u64,
}

/// `count` equal copies at fixed strides: copy `i` moves `len` bytes from
/// local `src + i * src_stride` to the peer's `dst + i * dst_stride` (e.g.
/// one head slice of every token of a page).
///
/// Layout-identical to the planner's run (`bytemuck::cast_slice`).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default, bytemuck::Pod, bytemuck::Zeroable)]
pub struct Run {
    /// Source address of the first copy, in local registered memory.
    pub src: u64,
    /// Destination address of the first copy, in the peer's registered memory.
    pub dst: u64,
    /// Bytes per copy.
    pub len: u64,
    /// Number of copies.
    pub count: u64,
    /// Source bytes from one copy to the next.
    pub src_stride: u64,
    /// Destination bytes from one copy to the next.
    pub dst_stride: u64,
}

impl Run {
    /// Bytes from the first copy's start to the last copy's end on each
    /// side, `(source span, destination span)`; `None` when that overflows,
    /// `Some((0, 0))` for an empty run.
    pub fn spans(&self) -> Option<(u64, u64)> {
        if self.count == 0 || self.len == 0 {
            return Some((0, 0));
        }
        let last = self.count - 1;
        let span = |stride: u64, base: u64| {
            let s = last.checked_mul(stride)?.checked_add(self.len)?;
            base.checked_add(s)?;
            Some(s)
        };
        Some((
            span(self.src_stride, self.src)?,
            span(self.dst_stride, self.dst)?,
        ))
    }

    /// Whether the run's destinations are pairwise disjoint and its spans
    /// fit the address space: what every engine requires of a run.
    pub fn is_well_formed(&self) -> bool {
        self.spans().is_some() && (self.count <= 1 || self.dst_stride >= self.len)
    }

    /// Bytes the run moves (saturating).
    pub fn bytes(&self) -> u64 {
        self.len.saturating_mul(self.count)
    }

    /// Copy `i` as a block.
    pub fn block(&self, i: u64) -> Block {
        Block {
            src: self.src.wrapping_add(i.wrapping_mul(self.src_stride)),
            dst: self.dst.wrapping_add(i.wrapping_mul(self.dst_stride)),
            len: self.len,
        }
    }
}

/// The blocks of `runs` in order, or the index of the first run that is not
/// [`Run::is_well_formed`].
pub fn expand_runs(runs: &[Run]) -> Result<Vec<Block>, usize> {
    let mut out = Vec::new();
    for (i, r) in runs.iter().enumerate() {
        if !r.is_well_formed() {
            return Err(i);
        }
        if r.len > 0 {
            out.extend((0..r.count).map(|k| r.block(k)));
        }
    }
    Ok(out)
}

/// A transfer engine: moves batches of blocks from local registered memory
/// into a peer's registered memory.
///
/// Object-safe; roles hold an `Arc<dyn TransferEngine>`.
pub trait TransferEngine: Send + Sync + std::fmt::Debug {
    /// This engine's session id, `"host:port"`, which peers pass to reach it.
    fn session_id(&self) -> &str;

    /// Register `(ptr, len)` regions so peers may write into them and local
    /// batches may read from them. Exact duplicates are registered once;
    /// overlapping different regions are refused; all-or-nothing.
    ///
    /// # Safety
    /// Each range must stay valid, readable and writable memory (of the kind
    /// `kvbridge_mem::probe_kind` reports) until it is deregistered or the
    /// engine is dropped, and nothing else may write the bytes a transfer is
    /// reading or writing while it runs, nor hold Rust references to bytes a
    /// peer may be writing.
    unsafe fn batch_register(&self, regions: &[(u64, u64)]) -> Result<(), MemError>;

    /// Deregister the regions starting at `addrs`. Returns once no transfer
    /// touches them any more; see [`kvbridge_mem::RegionRegistry::deregister`].
    fn batch_deregister(&self, addrs: &[u64]) -> Result<(), MemError>;

    /// Start moving `blocks` to `session` and return at once; the handle
    /// reports completion (all bytes in the peer's memory) or the first error.
    fn submit(&self, session: &str, blocks: &[Block]) -> BatchHandle;

    /// This engine's incarnation: a random id fixed for its lifetime, so
    /// peers tell a restarted process from the one they knew (0 = none).
    fn incarnation(&self) -> u64 {
        0
    }

    /// Like [`TransferEngine::submit`], but only into incarnation `expected`
    /// of the peer (as it announced itself when it registered its memory):
    /// if another incarnation answers at `session` — the peer restarted, and
    /// addresses planned for the old one may now be the new one's live
    /// memory — the batch fails with `PeerRestarted` and nothing is written.
    /// Engines that cannot mix up incarnations ignore `expected`.
    fn submit_to(&self, session: &str, expected: u64, blocks: &[Block]) -> BatchHandle {
        let _ = expected;
        self.submit(session, blocks)
    }

    /// Whether [`TransferEngine::submit_runs_to`] copies runs natively
    /// (planners then hand over runs instead of one block per copy).
    fn copies_runs(&self) -> bool {
        false
    }

    /// Like [`TransferEngine::submit_to`] for strided runs. Every run must be
    /// [`Run::is_well_formed`] (else the batch fails with `InvalidArgument`
    /// and nothing is written). Engines without a native run path move the
    /// expanded blocks.
    fn submit_runs_to(&self, session: &str, expected: u64, runs: &[Run]) -> BatchHandle {
        match expand_runs(runs) {
            Ok(blocks) => self.submit_to(session, expected, &blocks),
            Err(i) => BatchHandle::ready(Err(malformed_run(session, i))),
        }
    }

    /// Move `blocks` to `session`; returns when every byte is in the peer's
    /// memory, or with the first error.
    fn batch_transfer_sync(&self, session: &str, blocks: &[Block]) -> Result<(), TransferError> {
        self.submit(session, blocks).wait()
    }

    /// Fence the peer whose engine session id is `session` (exactly what
    /// that peer's [`TransferEngine::session_id`] returns): on `Ok(true)`, no
    /// write from it can land in our memory any more — its writes in
    /// progress have finished (the call waits for them), its connections
    /// are closed, and new connections and requests from it are refused
    /// (its batches fail with a typed error, `Refused`) until
    /// [`TransferEngine::unfence_peer`].
    ///
    /// `Ok(false)` (the default) means this engine cannot fence (UCX: the
    /// peer puts one-sidedly; CUDA IPC: the peer copies into mapped memory):
    /// the caller must instead wait for the peer's acknowledgement that it
    /// stopped writing before reusing the memory.
    fn fence_peer(&self, session: &str) -> Result<bool, TransferError> {
        let _ = session;
        Ok(false)
    }

    /// Lift the fence of `session` set by [`TransferEngine::fence_peer`]
    /// (no-op for engines that cannot fence, or a session not fenced).
    fn unfence_peer(&self, session: &str) {
        let _ = session;
    }

    /// Check that `session` is reachable and answering now (fresh connection
    /// and handshake); used to un-blacklist failed sessions.
    fn probe(&self, session: &str) -> Result<(), TransferError>;

    /// The regions registered with this engine.
    fn registered_regions(&self) -> Vec<Region>;

    /// Whether the engine moves host memory. The intra-node CUDA IPC
    /// engine does not (as Mooncake's `nvlink_intra` transport): its users
    /// register only device regions and ship host-resident blocks over the
    /// control plane instead (`STATE_DATA`).
    fn moves_host_memory(&self) -> bool {
        true
    }

    /// Copy `out.len()` bytes of local registered memory at `addr` into `out`
    /// (e.g. aux data to ship over the control plane); bounds-checked.
    fn read_local(&self, addr: u64, out: &mut [u8]) -> Result<(), MemError>;

    /// Write `data` into local registered memory at `addr` (e.g. host blocks
    /// that arrived over the control plane); refused unless the whole range
    /// lies inside one registered region.
    fn write_local(&self, addr: u64, data: &[u8]) -> Result<(), MemError>;
}

/// The error for run `i` of a batch that is not [`Run::is_well_formed`].
pub(crate) fn malformed_run(session: &str, i: usize) -> TransferError {
    TransferError::new(
        session,
        Some(i),
        ErrorKind::InvalidArgument,
        "run overflows the address space or its copies overlap at the destination",
    )
}
