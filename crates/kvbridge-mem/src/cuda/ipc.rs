//! CUDA IPC: the handle a process exports for one of its device
//! allocations ([`IpcHandle`]) and a peer's allocation opened here
//! ([`IpcMapping`]), or reached at its own address when the peer is this
//! very process.

use std::fmt;

use cudarc::driver::sys;

use super::{Context, CudaError, check, context, require};

/// The IPC handle of a device allocation, plus where a pointer sits in it.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct IpcHandle {
    /// The opaque handle bytes (`CUipcMemHandle`).
    pub bytes: [u8; 64],
    /// Base address of the allocation in the exporting process.
    pub base: u64,
    /// Size of the allocation.
    pub size: u64,
}

impl IpcHandle {
    /// Export the allocation containing device pointer `ptr`
    /// (`cuMemGetAddressRange` + `cuIpcGetMemHandle` on its base).
    pub fn export(ptr: u64) -> Result<Self, CudaError> {
        require()?;
        let ordinal = match super::probe(ptr) {
            crate::MemoryKind::Device { ordinal } => ordinal,
            other => {
                return Err(CudaError {
                    call: "cuIpcGetMemHandle",
                    code: -1,
                    name: format!("{ptr:#x} is {other} memory, not device memory"),
                });
            }
        };
        context(ordinal)?.make_current()?;
        let (mut base, mut size) = (0u64, 0usize);
        // SAFETY: writes the base and size of the allocation holding `ptr`.
        check("cuMemGetAddressRange", unsafe {
            sys::cuMemGetAddressRange_v2(&mut base, &mut size, ptr)
        })?;
        Ok(Self {
            bytes: handle_of(base)?,
            base,
            size: size as u64,
        })
    }

    /// Whether this handle names an allocation of this very process (the
    /// same base and size here, and the handle the driver gives for it now).
    fn is_own(&self) -> bool {
        let (mut base, mut size) = (0u64, 0usize);
        // SAFETY: writes the base and size of the allocation holding the
        // address, or fails (not an allocation of this process).
        let found = check("cuMemGetAddressRange", unsafe {
            sys::cuMemGetAddressRange_v2(&mut base, &mut size, self.base)
        });
        found.is_ok()
            && base == self.base
            && size as u64 == self.size
            && handle_of(base).is_ok_and(|b| b == self.bytes)
    }
}

/// The IPC handle bytes of the allocation at `base` (a context current).
fn handle_of(base: u64) -> Result<[u8; 64], CudaError> {
    // SAFETY: CUipcMemHandle is plain bytes; zeroed is valid.
    let mut h: sys::CUipcMemHandle = unsafe { std::mem::zeroed() };
    // SAFETY: writes one handle for the allocation's base.
    check("cuIpcGetMemHandle", unsafe {
        sys::cuIpcGetMemHandle(&mut h, base)
    })?;
    let mut bytes = [0u8; 64];
    for (b, c) in bytes.iter_mut().zip(h.reserved.iter()) {
        *b = *c as u8;
    }
    Ok(bytes)
}

impl fmt::Debug for IpcHandle {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("IpcHandle")
            .field("base", &format_args!("{:#x}", self.base))
            .field("size", &self.size)
            .finish_non_exhaustive()
    }
}

/// A peer's allocation opened in this process; closed on drop.
///
/// CUDA refuses to open a handle in the process that exported it, so a
/// peer in this very process (several ranks in one process, `kvbridge bench
/// roles`) is reached at the allocation's own address, with nothing to
/// close: the handle is taken as ours only when the driver gives the same
/// handle for an allocation of the same base and size here.
pub struct IpcMapping {
    ptr: u64,
    size: u64,
    ctx: &'static Context,
    own: bool,
}

// SAFETY: a mapped device address is usable from any thread of the process.
unsafe impl Send for IpcMapping {}
// SAFETY: as above; the mapping is never mutated.
unsafe impl Sync for IpcMapping {}

impl IpcMapping {
    /// Open `handle` in GPU `ordinal`'s context (lazy peer access).
    pub fn open(ordinal: i32, handle: &IpcHandle) -> Result<Self, CudaError> {
        let ctx = context(ordinal)?;
        ctx.make_current()?;
        if handle.is_own() {
            if let crate::MemoryKind::Device { ordinal: theirs } = super::probe(handle.base) {
                enable_peer_access(ctx, theirs)?;
            }
            return Ok(Self {
                ptr: handle.base,
                size: handle.size,
                ctx,
                own: true,
            });
        }
        // SAFETY: CUipcMemHandle is plain bytes.
        let mut h: sys::CUipcMemHandle = unsafe { std::mem::zeroed() };
        for (c, b) in h.reserved.iter_mut().zip(handle.bytes.iter()) {
            *c = *b as std::ffi::c_char;
        }
        let mut ptr = 0;
        // SAFETY: writes one device pointer; the driver validates the handle.
        check("cuIpcOpenMemHandle", unsafe {
            sys::cuIpcOpenMemHandle_v2(
                &mut ptr,
                h,
                sys::CUipcMem_flags::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS as u32,
            )
        })?;
        Ok(Self {
            ptr,
            size: handle.size,
            ctx,
            own: false,
        })
    }

    /// Whether the allocation is this process's own (not an IPC mapping).
    pub fn is_own(&self) -> bool {
        self.own
    }

    /// Where the peer's allocation base is mapped here.
    pub fn addr(&self) -> u64 {
        self.ptr
    }

    /// Size of the mapped allocation.
    pub fn size(&self) -> u64 {
        self.size
    }
}

impl Drop for IpcMapping {
    fn drop(&mut self) {
        if self.own {
            return;
        }
        let _ = self.ctx.make_current();
        // SAFETY: closes the mapping opened in `open`, once.
        let r = unsafe { sys::cuIpcCloseMemHandle(self.ptr) };
        if let Err(e) = check("cuIpcCloseMemHandle", r) {
            tracing::debug!(error = %e, "closing an IPC mapping failed");
        }
    }
}

impl fmt::Debug for IpcMapping {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("IpcMapping")
            .field("addr", &format_args!("{:#x}", self.ptr))
            .field("size", &self.size)
            .field("own", &self.own)
            .finish()
    }
}

/// Let kernels in `ctx` reach GPU `theirs`'s memory (no-op on the same GPU).
fn enable_peer_access(ctx: &Context, theirs: i32) -> Result<(), CudaError> {
    if ctx.ordinal() == theirs {
        return Ok(());
    }
    let peer = context(theirs)?;
    // SAFETY: both are live, retained primary contexts; `ctx` is current.
    let r = unsafe { sys::cuCtxEnablePeerAccess(peer.raw, 0) };
    if r == sys::CUresult::CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED {
        return Ok(());
    }
    check("cuCtxEnablePeerAccess", r)
}
