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
pub use config::{EngineConfig, TcpConfig, UcxConfig};
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

pub use kvbridge_block::{Batch, Block, Run};

/// Where a batch goes: a peer's session id and, optionally, the
/// incarnation of that peer the batch was planned for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Target<'a> {
    /// The peer's engine session id, `"host:port"`.
    pub session: &'a str,
    /// The peer incarnation the batch was planned for (as the peer
    /// announced it when it registered its memory); `None` accepts any.
    pub incarnation: Option<u64>,
}

impl<'a> Target<'a> {
    /// Any incarnation of the peer at `session`.
    pub fn any(session: &'a str) -> Self {
        Target {
            session,
            incarnation: None,
        }
    }

    /// Only incarnation `incarnation` of the peer at `session`; 0 (an
    /// engine without incarnations) accepts any.
    pub fn exact(session: &'a str, incarnation: u64) -> Self {
        Target {
            session,
            incarnation: (incarnation != 0).then_some(incarnation),
        }
    }
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

    /// Start moving `batch` to `target` and return at once; the handle
    /// reports completion (all bytes in the peer's memory) or the first
    /// error. With `target.incarnation` set, only into that incarnation of
    /// the peer: if another answers at the session (the peer restarted, and
    /// addresses planned for the old one may now be the new one's live
    /// memory) the batch fails with `PeerRestarted` and nothing is written;
    /// engines that cannot mix up incarnations ignore it. Every run must be
    /// [`Run::is_well_formed`], else the batch fails with `InvalidArgument`
    /// and nothing is written; engines without a native run path
    /// ([`TransferEngine::copies_runs`] false) move the expanded blocks.
    fn submit(&self, target: Target<'_>, batch: Batch<'_>) -> BatchHandle;

    /// This engine's incarnation: a random id fixed for its lifetime, so
    /// peers tell a restarted process from the one they knew (0 = none).
    fn incarnation(&self) -> u64 {
        0
    }

    /// Whether [`TransferEngine::submit`] copies runs natively (planners
    /// then hand over runs instead of one block per copy).
    fn copies_runs(&self) -> bool {
        false
    }

    /// Whether heterogeneous-TP head slices move faster on this engine
    /// staged (gathered into one large write per chunk, scattered by the
    /// receiver) than as one copy per slice, for KV in device memory
    /// (`device_kv`) or host memory. Roles with staging on `auto` stage
    /// exactly when this says so.
    fn prefers_staging(&self, device_kv: bool) -> bool {
        let _ = device_kv;
        false
    }

    /// Move `blocks` to `session`; returns when every byte is in the peer's
    /// memory, or with the first error.
    fn batch_transfer_sync(&self, session: &str, blocks: &[Block]) -> Result<(), TransferError> {
        self.submit(Target::any(session), Batch::Blocks(blocks))
            .wait()
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

/// `batch` as blocks for engines without a native run path, or the
/// `InvalidArgument` error for its first run that is not well formed.
pub(crate) fn batch_blocks<'a>(
    session: &str,
    batch: Batch<'a>,
) -> Result<std::borrow::Cow<'a, [Block]>, TransferError> {
    batch.to_blocks().map_err(|i| malformed_run(session, i))
}

/// [`TransferEngine::submit`] for engines that move blocks: `plan` gets the
/// session, the expected incarnation (0: any) and the batch as blocks, and
/// returns the batch's handle, or `None` when there is nothing to move.
pub(crate) fn submit_as_blocks(
    target: Target<'_>,
    batch: Batch<'_>,
    plan: impl FnOnce(&str, u64, &[Block]) -> Result<Option<BatchHandle>, TransferError>,
) -> BatchHandle {
    let expected = target.incarnation.unwrap_or(0);
    let planned =
        batch_blocks(target.session, batch).and_then(|b| plan(target.session, expected, &b));
    match planned {
        Ok(Some(h)) => h,
        Ok(None) => BatchHandle::ready(Ok(())),
        Err(e) => BatchHandle::ready(Err(e)),
    }
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
