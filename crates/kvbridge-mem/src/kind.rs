//! Memory kinds, the probing and byte-access traits, and host memory's
//! implementations of them.
//!
//! Code above this crate never asks CUDA what a pointer is: it calls
//! [`probe_kind`](crate::probe_kind) (or a [`KindProber`] it was handed) and
//! moves bytes through [`access_for`](crate::access_for). Without the `cuda`
//! feature everything is host memory; with it,
//! [`default_prober`](crate::default_prober) asks the CUDA driver (when one is there) and
//! device memory is read and written through copies staged in pinned host
//! memory, without changing any caller.

use std::fmt;

use crate::MemError;

/// Where a pointer's memory lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
#[non_exhaustive]
pub enum MemoryKind {
    /// Ordinary pageable host memory.
    Host,
    /// Page-locked (pinned) host memory, DMA-able by a GPU.
    PinnedHost,
    /// Memory of one GPU, not addressable by the CPU.
    Device {
        /// CUDA device ordinal.
        ordinal: i32,
    },
    /// CUDA managed (unified) memory, addressable by CPU and GPU.
    Managed,
}

impl MemoryKind {
    /// Whether the CPU may read and write this memory through a plain pointer.
    pub fn is_host_accessible(self) -> bool {
        !matches!(self, MemoryKind::Device { .. })
    }
}

impl fmt::Display for MemoryKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            MemoryKind::Host => f.write_str("host"),
            MemoryKind::PinnedHost => f.write_str("pinned host"),
            MemoryKind::Device { ordinal } => write!(f, "device {ordinal}"),
            MemoryKind::Managed => f.write_str("managed"),
        }
    }
}

/// Answers "what kind of memory is at this address".
pub trait KindProber: Send + Sync + fmt::Debug {
    /// The kind of the memory at `addr` (host when unknown to any device runtime).
    fn probe(&self, addr: u64) -> MemoryKind;
}

/// The prober of builds without a device runtime: everything is host memory.
#[derive(Debug, Clone, Copy, Default)]
pub struct HostOnlyProber;

impl KindProber for HostOnlyProber {
    fn probe(&self, _addr: u64) -> MemoryKind {
        MemoryKind::Host
    }
}

/// Reads and writes bytes of one memory kind on behalf of the registry and the engines.
///
/// Host kinds copy directly; device kinds (with `cuda`) copy through the
/// device runtime. The engines use this for every block whose memory is not
/// host-accessible, staging it through a host bounce buffer.
pub trait MemoryAccess: Send + Sync + fmt::Debug {
    /// Copy `out.len()` bytes starting at `addr` into `out`.
    ///
    /// # Safety
    /// `[addr, addr + out.len())` must be valid, readable memory of this kind.
    unsafe fn read(&self, addr: u64, out: &mut [u8]) -> Result<(), MemError>;

    /// Copy `data` to `addr`.
    ///
    /// # Safety
    /// `[addr, addr + data.len())` must be valid, writable memory of this kind
    /// that nothing else accesses during the call.
    unsafe fn write(&self, addr: u64, data: &[u8]) -> Result<(), MemError>;

    /// Copy each `(addr, data)`; device kinds batch the copies (one wait).
    ///
    /// # Safety
    /// As for [`MemoryAccess::write`], for every item.
    unsafe fn write_many(&self, writes: &[(u64, &[u8])]) -> Result<(), MemError> {
        for (addr, data) in writes {
            // SAFETY: forwarded caller contract.
            unsafe { self.write(*addr, data) }?;
        }
        Ok(())
    }
}

/// Plain CPU copies, for every host-accessible kind.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct HostAccess;

impl MemoryAccess for HostAccess {
    unsafe fn read(&self, addr: u64, out: &mut [u8]) -> Result<(), MemError> {
        let src = std::ptr::with_exposed_provenance::<u8>(addr as usize);
        // SAFETY: the caller guarantees `[addr, addr + out.len())` is valid
        // readable memory; `ptr::copy` tolerates overlap with `out`.
        unsafe { std::ptr::copy(src, out.as_mut_ptr(), out.len()) };
        Ok(())
    }

    unsafe fn write(&self, addr: u64, data: &[u8]) -> Result<(), MemError> {
        let dst = std::ptr::with_exposed_provenance_mut::<u8>(addr as usize);
        // SAFETY: the caller guarantees `[addr, addr + data.len())` is valid
        // writable memory nobody else touches now; `ptr::copy` tolerates overlap.
        unsafe { std::ptr::copy(data.as_ptr(), dst, data.len()) };
        Ok(())
    }
}

/// Device memory in a build without a device runtime: every access is refused.
#[derive(Debug, Clone, Copy, Default)]
#[cfg_attr(feature = "cuda", allow(dead_code))]
pub(crate) struct NoDeviceAccess;

impl MemoryAccess for NoDeviceAccess {
    unsafe fn read(&self, _addr: u64, _out: &mut [u8]) -> Result<(), MemError> {
        Err(MemError::Unsupported {
            kind: MemoryKind::Device { ordinal: -1 },
        })
    }

    unsafe fn write(&self, _addr: u64, _data: &[u8]) -> Result<(), MemError> {
        Err(MemError::Unsupported {
            kind: MemoryKind::Device { ordinal: -1 },
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn device_access_is_refused_without_cuda() {
        let mut out = [0u8; 4];
        // SAFETY: NoDeviceAccess never dereferences the address.
        let r = unsafe { NoDeviceAccess.read(8, &mut out) };
        assert!(matches!(r, Err(MemError::Unsupported { .. })));
    }

    #[test]
    fn kind_display() {
        assert_eq!(MemoryKind::PinnedHost.to_string(), "pinned host");
        assert_eq!(MemoryKind::Device { ordinal: 3 }.to_string(), "device 3");
    }
}
