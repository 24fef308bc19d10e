//! One pool buffer: host memory, or device memory filled and checked
//! through host staging copies.

use kvbridge_mem::{HostBuffer, MemError};

#[derive(Debug)]
pub(super) enum PoolBuf {
    Host(HostBuffer),
    #[cfg(feature = "cuda")]
    Device(kvbridge_mem::cuda::DeviceBuffer),
}

impl PoolBuf {
    /// `len` bytes in host memory, or on GPU `device`.
    pub(super) fn new(len: u64, device: Option<i32>) -> Result<Self, MemError> {
        let len = usize::try_from(len).unwrap_or(usize::MAX);
        match device {
            None => Ok(PoolBuf::Host(HostBuffer::new_resident(len)?)),
            #[cfg(feature = "cuda")]
            Some(ordinal) => Ok(PoolBuf::Device(kvbridge_mem::cuda::DeviceBuffer::new(
                ordinal, len,
            )?)),
            #[cfg(not(feature = "cuda"))]
            Some(ordinal) => Err(MemError::Unsupported {
                kind: kvbridge_mem::MemoryKind::Device { ordinal },
            }),
        }
    }

    pub(super) fn addr(&self) -> u64 {
        match self {
            PoolBuf::Host(b) => b.addr(),
            #[cfg(feature = "cuda")]
            PoolBuf::Device(b) => b.addr(),
        }
    }

    pub(super) fn len(&self) -> usize {
        match self {
            PoolBuf::Host(b) => b.len(),
            #[cfg(feature = "cuda")]
            PoolBuf::Device(b) => b.len(),
        }
    }

    /// Copies `out.len()` bytes at `off` out; false when out of bounds or failed.
    pub(super) fn read(&self, off: usize, out: &mut [u8]) -> bool {
        match self {
            PoolBuf::Host(b) => match b.as_slice().get(off..off + out.len()) {
                Some(src) => {
                    out.copy_from_slice(src);
                    true
                }
                None => false,
            },
            #[cfg(feature = "cuda")]
            PoolBuf::Device(b) => b.read(off, out).is_ok(),
        }
    }

    /// Copies `data` to `off`; false when out of bounds or failed.
    pub(super) fn write(&mut self, off: usize, data: &[u8]) -> bool {
        match self {
            PoolBuf::Host(b) => match b.as_mut_slice().get_mut(off..off + data.len()) {
                Some(dst) => {
                    dst.copy_from_slice(data);
                    true
                }
                None => false,
            },
            #[cfg(feature = "cuda")]
            PoolBuf::Device(b) => b.write(off, data).is_ok(),
        }
    }
}
