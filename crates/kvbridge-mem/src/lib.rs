//! # kvbridge-mem
//!
//! The memory that kvbridge may touch: a registry of registered regions,
//! memory-kind probing, and bounds-checked byte I/O.
//!
//! **Owns:** [`RegionRegistry`] (register / deregister batches of `(ptr, len)`,
//! exact duplicates kept once, overlaps refused, `O(log n)` containment
//! lookups), [`MemoryKind`] and the one probing entry point [`probe_kind`],
//! the per-kind [`MemoryAccess`] used to read and write registered memory
//! (host copies, and device copies staged through pinned host memory with
//! the `cuda` feature, whose [`cuda`] module is the crate's driver layer), and
//! [`HostBuffer`], an owned page-aligned host allocation for tests, benches
//! and demos.
//!
//! **Never:** depends on another kvbridge crate, opens sockets, spawns
//! threads, asks CUDA directly outside [`kind`], or reads / writes a byte
//! that is not inside a registered region (every write goes through
//! [`RegionRegistry::check`]).
//!
//! Registration is `unsafe`: the caller promises that a registered range is
//! valid, readable and writable memory of the probed kind until it is
//! deregistered, and that nothing else writes (or holds Rust references to)
//! the bytes a transfer is reading or writing while that transfer runs. All
//! the safe byte I/O in this crate and in the engines rests on that promise.
//!
//! ```
//! use kvbridge_mem::{HostBuffer, RegionRegistry};
//! let buf = HostBuffer::new(8192).unwrap();
//! let mut reg = RegionRegistry::new();
//! // SAFETY: `buf` outlives its registration (deregistered below) and is not
//! // accessed through references while the registry writes into it.
//! unsafe { reg.register(&[buf.region()]) }.unwrap();
//! reg.write_bytes(buf.addr() + 10, b"hello").unwrap();
//! let mut out = [0u8; 5];
//! reg.read_bytes(buf.addr() + 10, &mut out).unwrap();
//! assert_eq!(&out, b"hello");
//! assert!(reg.write_bytes(buf.addr() + 8190, b"too long").is_err());
//! reg.deregister(&[buf.addr()]).unwrap();
//! ```

#[cfg(feature = "cuda")]
pub mod cuda;
pub mod host;
pub mod kind;
pub mod registry;
mod select;

pub use host::HostBuffer;
pub use kind::{HostOnlyProber, KindProber, MemoryAccess, MemoryKind};
pub use registry::{Region, RegionRegistry};
pub use select::{access_for, default_prober, probe_kind};

/// Errors of region registration, lookup and byte I/O.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum MemError {
    /// A region of zero bytes was given.
    #[error("region at {addr:#x} has zero length")]
    ZeroLength {
        /// Start address of the region.
        addr: u64,
    },
    /// A region starts at address 0.
    #[error("null region pointer")]
    Null,
    /// `addr + len` does not fit in 64 bits.
    #[error("range {addr:#x}+{len} overflows the address space")]
    Overflow {
        /// Start address.
        addr: u64,
        /// Length in bytes.
        len: u64,
    },
    /// A new region overlaps a registered (or earlier in the batch) region without being identical.
    #[error("region {addr:#x}+{len} overlaps registered region {existing_addr:#x}+{existing_len}")]
    Overlap {
        /// Start of the refused region.
        addr: u64,
        /// Length of the refused region.
        len: u64,
        /// Start of the region it overlaps.
        existing_addr: u64,
        /// Length of the region it overlaps.
        existing_len: u64,
    },
    /// Deregistration of an address that starts no registered region.
    #[error("no registered region starts at {addr:#x}")]
    NotRegistered {
        /// The unknown start address.
        addr: u64,
    },
    /// A byte range does not lie entirely inside one registered region.
    #[error("range {addr:#x}+{len} is not inside one registered region")]
    OutOfRegion {
        /// Start of the range.
        addr: u64,
        /// Length of the range.
        len: u64,
    },
    /// The memory kind cannot be accessed by this build (e.g. device memory without `cuda`).
    #[error("memory of kind {kind} cannot be accessed by this build")]
    Unsupported {
        /// The kind that was asked for.
        kind: MemoryKind,
    },
    /// A CUDA driver call failed (copy, allocation, ...).
    #[error("device memory access failed: {source}")]
    Device {
        /// The failed driver call and its `CUresult`.
        #[from]
        source: CudaError,
    },
    /// A transport refused to register the region (e.g. `ucp_mem_map` failed).
    #[error("registering {addr:#x}+{len} with the transport failed: {reason}")]
    Registration {
        /// Start of the region.
        addr: u64,
        /// Length of the region.
        len: u64,
        /// The transport's error text.
        reason: String,
    },
    /// A host allocation failed.
    #[error("allocation of {len} bytes failed: {reason}")]
    Alloc {
        /// Requested size.
        len: usize,
        /// OS error text.
        reason: String,
    },
}

/// A failed CUDA driver call (built by the `cuda` feature's driver layer;
/// defined in every build so that [`MemError::Device`] keeps it).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{call} failed: {name} ({code})")]
pub struct CudaError {
    /// The driver function.
    pub call: &'static str,
    /// The `CUresult` value.
    pub code: i32,
    /// The driver's name for it.
    pub name: String,
}

#[cfg(test)]
mod tests {
    use std::error::Error as _;

    use super::*;

    #[test]
    fn device_error_keeps_the_driver_error() {
        let cuda = CudaError {
            call: "cuMemAlloc",
            code: 2,
            name: "CUDA_ERROR_OUT_OF_MEMORY".into(),
        };
        let e = MemError::from(cuda.clone());
        assert_eq!(
            e.to_string(),
            "device memory access failed: cuMemAlloc failed: CUDA_ERROR_OUT_OF_MEMORY (2)"
        );
        let source = e.source().and_then(|s| s.downcast_ref::<CudaError>());
        assert_eq!(source, Some(&cuda));
        assert!(matches!(e, MemError::Device { source } if source.code == 2));
    }
}
