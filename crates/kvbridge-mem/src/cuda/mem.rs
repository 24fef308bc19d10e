//! RAII over driver objects: device and pinned allocations, streams,
//! events, IPC handles and opened IPC mappings, and NVRTC-compiled kernels.

use std::ffi::c_void;
use std::fmt;

use cudarc::driver::sys;

use super::{Context, CudaError, check, context};

/// Device memory from `cuMemAlloc_v2` (exportable through CUDA IPC, unlike
/// stream-ordered pool memory). Freed on drop; deregister it first.
pub struct DeviceBuffer {
    ptr: u64,
    len: usize,
    ctx: &'static Context,
}

impl DeviceBuffer {
    /// Allocate `len` bytes (zeroed) on GPU `ordinal`.
    pub fn new(ordinal: i32, len: usize) -> Result<Self, CudaError> {
        let ctx = context(ordinal)?;
        ctx.make_current()?;
        let mut ptr = 0;
        // SAFETY: writes one device pointer; `len` bytes are allocated.
        check("cuMemAlloc", unsafe {
            sys::cuMemAlloc_v2(&mut ptr, len.max(1))
        })?;
        let buf = Self { ptr, len, ctx };
        buf.fill(0)?;
        Ok(buf)
    }

    /// Allocate `len` bytes on GPU `ordinal` without clearing them (no
    /// synchronization: safe while other work of the context runs).
    pub fn new_uninit(ordinal: i32, len: usize) -> Result<Self, CudaError> {
        let ctx = context(ordinal)?;
        ctx.make_current()?;
        let mut ptr = 0;
        // SAFETY: writes one device pointer; `len` bytes are allocated.
        check("cuMemAlloc", unsafe {
            sys::cuMemAlloc_v2(&mut ptr, len.max(1))
        })?;
        Ok(Self { ptr, len, ctx })
    }

    /// Device address of the first byte.
    pub fn addr(&self) -> u64 {
        self.ptr
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the buffer has no bytes.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// `(addr, len)`, the form registration takes.
    pub fn region(&self) -> (u64, u64) {
        (self.ptr, self.len as u64)
    }

    /// The GPU this buffer lives on.
    pub fn ordinal(&self) -> i32 {
        self.ctx.ordinal()
    }

    fn bounds(&self, off: usize, n: usize) -> Result<(), CudaError> {
        match off.checked_add(n) {
            Some(end) if end <= self.len => Ok(()),
            _ => Err(CudaError {
                call: "DeviceBuffer",
                code: -1,
                name: format!("range {off}+{n} outside a {}-byte buffer", self.len),
            }),
        }
    }

    /// Copy `out.len()` bytes at offset `off` to the host (synchronous).
    pub fn read(&self, off: usize, out: &mut [u8]) -> Result<(), CudaError> {
        self.bounds(off, out.len())?;
        self.ctx.make_current()?;
        // SAFETY: the range is inside this allocation (checked) and `out` is
        // writable for its length; the copy completes before returning.
        check("cuMemcpyDtoH", unsafe {
            sys::cuMemcpyDtoH_v2(out.as_mut_ptr().cast(), self.ptr + off as u64, out.len())
        })
    }

    /// Copy `data` to offset `off` (synchronous: the bytes are in device
    /// memory when this returns, also for work on non-blocking streams).
    pub fn write(&self, off: usize, data: &[u8]) -> Result<(), CudaError> {
        self.bounds(off, data.len())?;
        self.ctx.make_current()?;
        // SAFETY: the range is inside this allocation (checked); `data` is
        // readable for the call (the driver stages pageable memory).
        check("cuMemcpyHtoD", unsafe {
            sys::cuMemcpyHtoD_v2(self.ptr + off as u64, data.as_ptr().cast(), data.len())
        })?;
        // A copy from pageable memory may return before its DMA finished.
        // SAFETY: no arguments; waits for the context's work.
        check("cuCtxSynchronize", unsafe { sys::cuCtxSynchronize() })
    }

    /// Set every byte to `byte` (synchronous).
    pub fn fill(&self, byte: u8) -> Result<(), CudaError> {
        self.ctx.make_current()?;
        // SAFETY: the whole allocation.
        check("cuMemsetD8", unsafe {
            sys::cuMemsetD8_v2(self.ptr, byte, self.len)
        })?;
        // SAFETY: no arguments; waits for the memset.
        check("cuCtxSynchronize", unsafe { sys::cuCtxSynchronize() })
    }
}

impl Drop for DeviceBuffer {
    fn drop(&mut self) {
        let _ = self.ctx.make_current();
        // SAFETY: frees the allocation made in `new`, once.
        let r = unsafe { sys::cuMemFree_v2(self.ptr) };
        if let Err(e) = check("cuMemFree", r) {
            tracing::warn!(error = %e, "freeing device memory failed");
        }
    }
}

impl fmt::Debug for DeviceBuffer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DeviceBuffer")
            .field("addr", &format_args!("{:#x}", self.ptr))
            .field("len", &self.len)
            .field("ordinal", &self.ctx.ordinal())
            .finish()
    }
}

/// Managed (unified) memory from `cuMemAllocManaged`, for probing tests.
/// Keep it small: managed memory beyond the card's free memory can hang it.
#[derive(Debug)]
pub struct ManagedBuffer {
    ptr: u64,
    len: usize,
}

impl ManagedBuffer {
    /// Allocate `len` bytes of managed memory, attached globally.
    pub fn new(len: usize) -> Result<Self, CudaError> {
        context(0)?.make_current()?;
        let mut ptr = 0;
        // SAFETY: writes one pointer to `len` managed bytes.
        check("cuMemAllocManaged", unsafe {
            sys::cuMemAllocManaged(
                &mut ptr,
                len.max(1),
                sys::CUmemAttach_flags::CU_MEM_ATTACH_GLOBAL as u32,
            )
        })?;
        Ok(Self { ptr, len })
    }

    /// Address of the first byte.
    pub fn addr(&self) -> u64 {
        self.ptr
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the buffer has no bytes.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

impl Drop for ManagedBuffer {
    fn drop(&mut self) {
        // SAFETY: frees the allocation made in `new`, once.
        let _ = unsafe { sys::cuMemFree_v2(self.ptr) };
    }
}

/// Page-locked host memory from `cuMemAllocHost` (portable to every context).
pub struct PinnedBuffer {
    ptr: *mut u8,
    len: usize,
}

// SAFETY: owns its allocation exclusively, like a Box<[u8]>.
unsafe impl Send for PinnedBuffer {}
// SAFETY: shared access only hands out `&[u8]`.
unsafe impl Sync for PinnedBuffer {}

impl PinnedBuffer {
    /// Allocate `len` zeroed bytes of pinned host memory.
    pub fn new(len: usize) -> Result<Self, CudaError> {
        let ctx = context(0)?;
        ctx.make_current()?;
        let mut p: *mut c_void = std::ptr::null_mut();
        // SAFETY: writes one host pointer to `len` pinned bytes.
        check("cuMemHostAlloc", unsafe {
            sys::cuMemHostAlloc(&mut p, len.max(1), sys::CU_MEMHOSTALLOC_PORTABLE)
        })?;
        let ptr = p.cast::<u8>();
        // SAFETY: `len` writable bytes were just allocated.
        unsafe { std::ptr::write_bytes(ptr, 0, len) };
        Ok(Self { ptr, len })
    }

    /// Host address of the first byte.
    pub fn addr(&self) -> u64 {
        self.ptr.expose_provenance() as u64
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the buffer has no bytes.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Raw pointer (for async copies).
    pub fn as_ptr(&self) -> *const u8 {
        self.ptr
    }

    /// Raw mutable pointer (for async copies).
    pub fn as_mut_ptr(&mut self) -> *mut u8 {
        self.ptr
    }

    /// The bytes.
    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: `len` bytes owned by `self`, alive while it is.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }

    /// The bytes, writable.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as above, and `&mut self` makes this the only reference.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }
}

impl Drop for PinnedBuffer {
    fn drop(&mut self) {
        // SAFETY: frees the allocation made in `new`, once.
        let _ = unsafe { sys::cuMemFreeHost(self.ptr.cast()) };
    }
}

impl fmt::Debug for PinnedBuffer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PinnedBuffer")
            .field("addr", &format_args!("{:#x}", self.addr()))
            .field("len", &self.len)
            .finish()
    }
}

/// A non-blocking stream of one context.
pub struct Stream {
    raw: sys::CUstream,
    ctx: &'static Context,
}

// SAFETY: stream handles may be used from any thread with the context current.
unsafe impl Send for Stream {}
// SAFETY: as above; the handle is never mutated.
unsafe impl Sync for Stream {}

impl Stream {
    /// A new non-blocking stream on GPU `ordinal`.
    pub fn new(ordinal: i32) -> Result<Self, CudaError> {
        let ctx = context(ordinal)?;
        ctx.make_current()?;
        let mut raw = std::ptr::null_mut();
        // SAFETY: writes one stream handle.
        check("cuStreamCreate", unsafe {
            sys::cuStreamCreate(&mut raw, sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32)
        })?;
        Ok(Self { raw, ctx })
    }

    /// The raw handle, for driver calls.
    pub fn raw(&self) -> sys::CUstream {
        self.raw
    }

    /// The stream's context (make it current before enqueuing work).
    pub fn context(&self) -> &'static Context {
        self.ctx
    }

    /// Wait until all work queued on the stream has finished.
    pub fn synchronize(&self) -> Result<(), CudaError> {
        self.ctx.make_current()?;
        // SAFETY: a live stream handle.
        check("cuStreamSynchronize", unsafe {
            sys::cuStreamSynchronize(self.raw)
        })
    }

    /// Make later work on this stream wait for `event` (recorded on any stream).
    pub fn wait(&self, event: &Event) -> Result<(), CudaError> {
        // SAFETY: live stream and event handles of one context.
        check("cuStreamWaitEvent", unsafe {
            sys::cuStreamWaitEvent(self.raw, event.raw, 0)
        })
    }

    /// Enqueue a copy of `len` bytes between any two addresses (UVA).
    ///
    /// # Safety
    /// Both ranges must be valid for the copy until the stream has passed it,
    /// and nothing else may write the destination meanwhile.
    pub unsafe fn memcpy(&self, dst: u64, src: u64, len: usize) -> Result<(), CudaError> {
        // SAFETY: forwarded caller contract.
        check("cuMemcpyAsync", unsafe {
            sys::cuMemcpyAsync(dst, src, len, self.raw)
        })
    }

    /// Enqueue a host-to-device copy.
    ///
    /// # Safety
    /// As for [`Stream::memcpy`]; `src` should be pinned for the copy to be asynchronous.
    pub unsafe fn upload(&self, dst: u64, src: *const u8, len: usize) -> Result<(), CudaError> {
        // SAFETY: forwarded caller contract.
        check("cuMemcpyHtoDAsync", unsafe {
            sys::cuMemcpyHtoDAsync_v2(dst, src.cast(), len, self.raw)
        })
    }
}

impl Drop for Stream {
    fn drop(&mut self) {
        let _ = self.ctx.make_current();
        // SAFETY: destroys the stream created in `new`, once.
        let _ = unsafe { sys::cuStreamDestroy_v2(self.raw) };
    }
}

impl fmt::Debug for Stream {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Stream")
            .field("ordinal", &self.ctx.ordinal())
            .finish()
    }
}

/// A CUDA event (timing enabled).
pub struct Event {
    raw: sys::CUevent,
    ctx: &'static Context,
}

// SAFETY: event handles may be used from any thread with the context current.
unsafe impl Send for Event {}
// SAFETY: as above.
unsafe impl Sync for Event {}

impl Event {
    /// A new event on GPU `ordinal`.
    pub fn new(ordinal: i32) -> Result<Self, CudaError> {
        let ctx = context(ordinal)?;
        ctx.make_current()?;
        let mut raw = std::ptr::null_mut();
        // SAFETY: writes one event handle.
        check("cuEventCreate", unsafe { sys::cuEventCreate(&mut raw, 0) })?;
        Ok(Self { raw, ctx })
    }

    /// A new event on GPU `ordinal` without timing (cheaper to record and
    /// wait for; [`Event::elapsed_ms`] fails on it).
    pub fn new_untimed(ordinal: i32) -> Result<Self, CudaError> {
        let ctx = context(ordinal)?;
        ctx.make_current()?;
        let mut raw = std::ptr::null_mut();
        let flags = sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32;
        // SAFETY: writes one event handle.
        check("cuEventCreate", unsafe {
            sys::cuEventCreate(&mut raw, flags)
        })?;
        Ok(Self { raw, ctx })
    }

    /// Whether the work recorded before the event has finished (never blocks).
    pub fn query(&self) -> Result<bool, CudaError> {
        // SAFETY: a live event handle.
        let r = unsafe { sys::cuEventQuery(self.raw) };
        if r == sys::CUresult::CUDA_ERROR_NOT_READY {
            return Ok(false);
        }
        check("cuEventQuery", r).map(|()| true)
    }

    /// Record the event on `stream`.
    pub fn record(&self, stream: &Stream) -> Result<(), CudaError> {
        // SAFETY: live event and stream handles of one context.
        check("cuEventRecord", unsafe {
            sys::cuEventRecord(self.raw, stream.raw)
        })
    }

    /// Wait for the recorded work.
    pub fn synchronize(&self) -> Result<(), CudaError> {
        self.ctx.make_current()?;
        // SAFETY: a live event handle.
        check("cuEventSynchronize", unsafe {
            sys::cuEventSynchronize(self.raw)
        })
    }

    /// Milliseconds from `start` to this event (both recorded and complete).
    pub fn elapsed_ms(&self, start: &Event) -> Result<f32, CudaError> {
        let mut ms = 0f32;
        // SAFETY: writes one float; both handles are live.
        check("cuEventElapsedTime", unsafe {
            sys::cuEventElapsedTime_v2(&mut ms, start.raw, self.raw)
        })?;
        Ok(ms)
    }
}

impl Drop for Event {
    fn drop(&mut self) {
        // SAFETY: destroys the event created in `new`, once.
        let _ = unsafe { sys::cuEventDestroy_v2(self.raw) };
    }
}

impl fmt::Debug for Event {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Event")
    }
}
