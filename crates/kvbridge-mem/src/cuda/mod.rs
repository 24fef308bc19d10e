//! CUDA through cudarc's driver API, loaded at run time (feature `cuda`).
//!
//! The one place of kvbridge that talks to the CUDA driver: whether a
//! driver and a GPU are there ([`available`]), pointer probing
//! ([`CudaProber`]), device byte I/O staged through pinned host memory, and
//! a small safe layer ([`DeviceBuffer`], [`PinnedBuffer`], [`Stream`],
//! [`Event`], [`IpcHandle`] / [`IpcMapping`], [`Kernel`]) that the CUDA IPC
//! engine and the synthetic device pools build on.
//!
//! cudarc's loader panics when `libcuda` is missing, so every entry point
//! goes through [`available`] first, which asks
//! `cudarc::driver::sys::is_culib_present()` once; without a driver or a
//! GPU it says so once in the log and everything takes the host path.
//! Driver-API errors (unlike the runtime's) are not sticky: a failed call
//! leaves nothing to clear and never poisons the context.

mod ipc;
mod kernel;
mod mem;

use std::ffi::CStr;
use std::sync::OnceLock;

use cudarc::driver::sys;

pub use crate::CudaError;
use crate::MemError;
use crate::kind::{KindProber, MemoryAccess, MemoryKind};

pub use ipc::{IpcHandle, IpcMapping};
pub use kernel::Kernel;
pub use mem::{DeviceBuffer, Event, ManagedBuffer, PinnedBuffer, Stream};

/// Turns a `CUresult` into a `Result`.
pub(crate) fn check(call: &'static str, r: sys::CUresult) -> Result<(), CudaError> {
    if r == sys::CUresult::CUDA_SUCCESS {
        return Ok(());
    }
    let mut p: *const std::ffi::c_char = std::ptr::null();
    // SAFETY: cuGetErrorName only writes a pointer to a static string (or
    // leaves it null) for any error value; the driver is loaded (we got `r`).
    let named = unsafe { sys::cuGetErrorName(r, &mut p) };
    let name = if named == sys::CUresult::CUDA_SUCCESS && !p.is_null() {
        // SAFETY: non-null pointers from cuGetErrorName are static NUL-terminated strings.
        unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
    } else {
        format!("{r:?}")
    };
    Err(CudaError {
        call,
        code: r as i32,
        name,
    })
}

/// What start-up found: the device count, or why CUDA is not usable.
fn driver() -> &'static Result<i32, String> {
    static DRIVER: OnceLock<Result<i32, String>> = OnceLock::new();
    DRIVER.get_or_init(|| {
        let found = init();
        match &found {
            Ok(n) => tracing::info!(devices = n, "CUDA driver loaded"),
            Err(why) => tracing::info!("no CUDA ({why}): all memory is host memory"),
        }
        found
    })
}

fn init() -> Result<i32, String> {
    if std::env::var_os("KVBRIDGE_NO_CUDA").is_some_and(|v| !v.is_empty()) {
        return Err("disabled by KVBRIDGE_NO_CUDA".into());
    }
    // SAFETY: only tries to dlopen the driver library; loads nothing else.
    if !unsafe { sys::is_culib_present() } {
        return Err("no CUDA driver library (libcuda.so) found".into());
    }
    // SAFETY: the library is present (checked above), so the loader resolves cuInit.
    check("cuInit", unsafe { sys::cuInit(0) }).map_err(|e| e.to_string())?;
    let mut n = 0;
    // SAFETY: writes one int.
    check("cuDeviceGetCount", unsafe { sys::cuDeviceGetCount(&mut n) })
        .map_err(|e| e.to_string())?;
    if n < 1 {
        return Err("the CUDA driver reports no GPU".into());
    }
    Ok(n)
}

/// Whether a CUDA driver and at least one GPU are usable; the first call
/// logs the answer. Never panics, also without any CUDA installed.
pub fn available() -> bool {
    driver().is_ok()
}

/// Why CUDA is not usable (`None` when it is), e.g. for a skip line.
pub fn unavailable_reason() -> Option<&'static str> {
    driver().as_ref().err().map(String::as_str)
}

/// Number of GPUs (0 without CUDA).
pub fn device_count() -> i32 {
    *driver().as_ref().unwrap_or(&0)
}

fn require() -> Result<(), CudaError> {
    match driver() {
        Ok(_) => Ok(()),
        Err(why) => Err(CudaError {
            call: "cuInit",
            code: -1,
            name: why.clone(),
        }),
    }
}

/// A retained primary context of one GPU, kept for the process's life.
#[derive(Debug)]
pub struct Context {
    raw: sys::CUcontext,
    ordinal: i32,
}

// SAFETY: a CUcontext handle may be used from any thread (it is made
// current per thread with cuCtxSetCurrent); the primary context is
// retained for the whole process and never destroyed.
unsafe impl Send for Context {}
// SAFETY: as above; the handle is never mutated.
unsafe impl Sync for Context {}

/// The primary context of GPU `ordinal` (retained once, cached).
pub fn context(ordinal: i32) -> Result<&'static Context, CudaError> {
    const MAX: usize = 64;
    static CTX: [OnceLock<Result<Context, CudaError>>; MAX] = [const { OnceLock::new() }; MAX];
    require()?;
    let slot = usize::try_from(ordinal)
        .ok()
        .filter(|i| *i < MAX && ordinal < device_count())
        .ok_or_else(|| CudaError {
            call: "context",
            code: -1,
            name: format!("no GPU with ordinal {ordinal}"),
        })?;
    CTX[slot]
        .get_or_init(|| {
            let mut dev = 0;
            // SAFETY: writes one CUdevice; the ordinal is below the device count.
            check("cuDeviceGet", unsafe {
                sys::cuDeviceGet(&mut dev, ordinal)
            })?;
            let mut raw = std::ptr::null_mut();
            // SAFETY: writes one context handle, retained until process exit.
            check("cuDevicePrimaryCtxRetain", unsafe {
                sys::cuDevicePrimaryCtxRetain(&mut raw, dev)
            })?;
            Ok(Context { raw, ordinal })
        })
        .as_ref()
        .map_err(Clone::clone)
}

impl Context {
    /// Make this context current on the calling thread (cheap; idempotent).
    pub fn make_current(&self) -> Result<(), CudaError> {
        // SAFETY: the handle is a live, retained primary context.
        check("cuCtxSetCurrent", unsafe { sys::cuCtxSetCurrent(self.raw) })
    }

    /// The GPU's ordinal.
    pub fn ordinal(&self) -> i32 {
        self.ordinal
    }

    /// The GPU's number of multiprocessors.
    pub fn multiprocessors(&self) -> Result<i32, CudaError> {
        let mut dev = 0;
        // SAFETY: writes one CUdevice for a valid ordinal.
        check("cuDeviceGet", unsafe {
            sys::cuDeviceGet(&mut dev, self.ordinal)
        })?;
        let mut v = 0;
        // SAFETY: writes one int.
        check("cuDeviceGetAttribute", unsafe {
            sys::cuDeviceGetAttribute(
                &mut v,
                sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT,
                dev,
            )
        })?;
        Ok(v)
    }

    /// The GPU's compute capability `(major, minor)`.
    pub fn compute_capability(&self) -> Result<(i32, i32), CudaError> {
        let mut dev = 0;
        // SAFETY: writes one CUdevice for a valid ordinal.
        check("cuDeviceGet", unsafe {
            sys::cuDeviceGet(&mut dev, self.ordinal)
        })?;
        let (mut major, mut minor) = (0, 0);
        use sys::CUdevice_attribute as A;
        // SAFETY: each call writes one int.
        unsafe {
            check(
                "cuDeviceGetAttribute",
                sys::cuDeviceGetAttribute(
                    &mut major,
                    A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR,
                    dev,
                ),
            )?;
            check(
                "cuDeviceGetAttribute",
                sys::cuDeviceGetAttribute(
                    &mut minor,
                    A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR,
                    dev,
                ),
            )?;
        }
        Ok((major, minor))
    }
}

/// Probe one local pointer with `cuPointerGetAttributes` (as sglang's
/// Mooncake connector's `_is_device_pointer`): any error means host memory.
pub fn probe(addr: u64) -> MemoryKind {
    if !available() {
        return MemoryKind::Host;
    }
    if let Ok(c) = context(0) {
        let _ = c.make_current();
    }
    let mut attrs = [
        sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_MEMORY_TYPE,
        sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_IS_MANAGED,
        sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,
    ];
    // Wider than any of the three values (uint, bool, int), zeroed: a value
    // the driver writes in fewer bytes reads back right (little-endian).
    let mut vals = [0u64; 3];
    let mut data: [*mut std::ffi::c_void; 3] = [
        (&raw mut vals[0]).cast(),
        (&raw mut vals[1]).cast(),
        (&raw mut vals[2]).cast(),
    ];
    // SAFETY: three attributes and three pointers to 8 writable bytes each;
    // probing never dereferences `addr`. An error is a plain return value
    // in the driver API (not sticky): nothing to clear.
    let r = unsafe {
        sys::cuPointerGetAttributes(
            3,
            attrs.as_mut_ptr(),
            data.as_mut_ptr(),
            addr as sys::CUdeviceptr,
        )
    };
    if r != sys::CUresult::CUDA_SUCCESS {
        return MemoryKind::Host;
    }
    let memory_type = vals[0] as u32;
    let managed = (vals[1] & 0xff) != 0;
    let ordinal = vals[2] as u32 as i32;
    if managed {
        MemoryKind::Managed
    } else if memory_type == sys::CUmemorytype::CU_MEMORYTYPE_DEVICE as u32 {
        MemoryKind::Device { ordinal }
    } else if memory_type == sys::CUmemorytype::CU_MEMORYTYPE_HOST as u32 {
        MemoryKind::PinnedHost
    } else {
        MemoryKind::Host
    }
}

/// The cudarc-backed prober (host for everything when CUDA is unusable).
#[derive(Debug, Clone, Copy, Default)]
pub struct CudaProber;

impl KindProber for CudaProber {
    fn probe(&self, addr: u64) -> MemoryKind {
        probe(addr)
    }
}

/// Bytes staged per device copy (one pinned buffer per thread).
const STAGING: usize = 4 << 20;

thread_local! {
    static STAGE: std::cell::RefCell<Option<PinnedBuffer>> = const { std::cell::RefCell::new(None) };
}

/// Runs `f` with this thread's pinned staging buffer.
fn with_staging<R>(
    f: impl FnOnce(&mut PinnedBuffer) -> Result<R, MemError>,
) -> Result<R, MemError> {
    STAGE.with(|cell| {
        let mut slot = cell.borrow_mut();
        if slot.is_none() {
            *slot = Some(PinnedBuffer::new(STAGING)?);
        }
        match slot.as_mut() {
            Some(buf) => f(buf),
            None => Err(MemError::Unsupported {
                kind: MemoryKind::PinnedHost,
            }),
        }
    })
}

/// Device memory through synchronous copies staged in pinned host memory.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct DeviceAccess;

impl MemoryAccess for DeviceAccess {
    unsafe fn read(&self, addr: u64, out: &mut [u8]) -> Result<(), MemError> {
        let ctx = context(ordinal_of(addr))?;
        ctx.make_current()?;
        with_staging(|stage| {
            for (i, chunk) in out.chunks_mut(STAGING).enumerate() {
                let src = addr + (i * STAGING) as u64;
                // SAFETY: the caller guarantees the device range is valid;
                // the staging buffer holds at least `chunk.len()` bytes.
                check("cuMemcpyDtoH", unsafe {
                    sys::cuMemcpyDtoH_v2(stage.as_mut_ptr().cast(), src, chunk.len())
                })?;
                chunk.copy_from_slice(&stage.as_slice()[..chunk.len()]);
            }
            Ok(())
        })
    }

    unsafe fn write(&self, addr: u64, data: &[u8]) -> Result<(), MemError> {
        let ctx = context(ordinal_of(addr))?;
        ctx.make_current()?;
        with_staging(|stage| {
            for (i, chunk) in data.chunks(STAGING).enumerate() {
                let dst = addr + (i * STAGING) as u64;
                stage.as_mut_slice()[..chunk.len()].copy_from_slice(chunk);
                // SAFETY: the caller guarantees the device range is valid
                // and unshared; the staging buffer holds the chunk.
                check("cuMemcpyHtoD", unsafe {
                    sys::cuMemcpyHtoD_v2(dst, stage.as_ptr().cast(), chunk.len())
                })?;
            }
            Ok(())
        })
    }

    unsafe fn write_many(&self, writes: &[(u64, &[u8])]) -> Result<(), MemError> {
        self.write_staged(writes)
    }
}

impl DeviceAccess {
    /// Stage `items` into pinned memory and copy them with async copies on
    /// the null stream, waiting once per staging buffer's worth.
    fn write_staged(&self, items: &[(u64, &[u8])]) -> Result<(), MemError> {
        let Some((first, _)) = items.first() else {
            return Ok(());
        };
        context(ordinal_of(*first))?.make_current()?;
        with_staging(|stage| {
            let mut used = 0usize;
            let flush = |used: &mut usize| -> Result<(), MemError> {
                if *used > 0 {
                    // SAFETY: waits for the copies enqueued on the null stream.
                    check("cuStreamSynchronize", unsafe {
                        sys::cuStreamSynchronize(std::ptr::null_mut())
                    })?;
                    *used = 0;
                }
                Ok(())
            };
            for (addr, data) in items {
                for (k, chunk) in data.chunks(STAGING).enumerate() {
                    if used + chunk.len() > STAGING {
                        flush(&mut used)?;
                    }
                    stage.as_mut_slice()[used..used + chunk.len()].copy_from_slice(chunk);
                    // SAFETY: the destination is valid device memory (caller
                    // contract); the pinned source stays untouched until the
                    // flush waited for this copy.
                    check("cuMemcpyHtoDAsync", unsafe {
                        sys::cuMemcpyHtoDAsync_v2(
                            addr + (k * STAGING) as u64,
                            stage.as_ptr().add(used).cast(),
                            chunk.len(),
                            std::ptr::null_mut(),
                        )
                    })?;
                    used += chunk.len();
                }
            }
            flush(&mut used)
        })
    }
}

/// The GPU a device pointer belongs to (0 when the probe cannot tell).
fn ordinal_of(addr: u64) -> i32 {
    match probe(addr) {
        MemoryKind::Device { ordinal } => ordinal,
        _ => 0,
    }
}

pub(crate) static DEVICE_ACCESS: DeviceAccess = DeviceAccess;
