//! Owned, page-aligned host memory.

use std::fmt;
use std::ptr::NonNull;

use crate::MemError;

/// An owned, zero-initialised, page-aligned host allocation (anonymous `mmap`).
///
/// Tests, benches and the demo allocate these and register them with an
/// engine (`buf.region()`); pages are materialised on first touch, so a
/// large buffer costs nothing until it is used. The buffer must be
/// deregistered before it is dropped (registration is `unsafe` for exactly
/// that reason).
pub struct HostBuffer {
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: a HostBuffer owns its mapping exclusively, like a `Box<[u8]>`;
// shared access only hands out `&[u8]`, mutation needs `&mut self`.
unsafe impl Send for HostBuffer {}
// SAFETY: as above; `&HostBuffer` allows reads only.
unsafe impl Sync for HostBuffer {}

impl HostBuffer {
    /// Map `len` zeroed bytes (rounded up to whole pages internally).
    pub fn new(len: usize) -> Result<Self, MemError> {
        Self::map(len, 0)
    }

    /// Like [`HostBuffer::new`], with every page faulted in now, as a KV pool
    /// allocated at start-up is: the first transfer into it does not pay
    /// the page faults.
    pub fn new_resident(len: usize) -> Result<Self, MemError> {
        Self::map(len, libc::MAP_POPULATE)
    }

    fn map(len: usize, extra_flags: libc::c_int) -> Result<Self, MemError> {
        if len == 0 {
            return Err(MemError::ZeroLength { addr: 0 });
        }
        // SAFETY: an anonymous private mapping with no address hint touches
        // no existing memory; the result is checked against MAP_FAILED.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | extra_flags,
                -1,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(MemError::Alloc {
                len,
                reason: std::io::Error::last_os_error().to_string(),
            });
        }
        let ptr = NonNull::new(p.cast::<u8>()).ok_or(MemError::Alloc {
            len,
            reason: "mmap returned null".into(),
        })?;
        Ok(Self { ptr, len })
    }

    /// Start address, as registered with a region registry or an engine.
    pub fn addr(&self) -> u64 {
        self.ptr.as_ptr().expose_provenance() as u64
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Always false: a buffer has at least one byte.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// `(addr, len)`, the form that registration takes.
    pub fn region(&self) -> (u64, u64) {
        (self.addr(), self.len as u64)
    }

    /// The bytes, read-only.
    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: the mapping is `len` readable bytes owned by `self`, alive while `self` is.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }

    /// The bytes, writable.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as in `as_slice`, and `&mut self` makes this the only reference.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

impl Drop for HostBuffer {
    fn drop(&mut self) {
        // SAFETY: `ptr`/`len` are exactly the mapping created in `new`, unmapped once here.
        let rc = unsafe { libc::munmap(self.ptr.as_ptr().cast(), self.len) };
        if rc != 0 {
            tracing::warn!(len = self.len, "munmap of a host buffer failed");
        }
    }
}

impl fmt::Debug for HostBuffer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HostBuffer")
            .field("addr", &format_args!("{:#x}", self.addr()))
            .field("len", &self.len)
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn page_aligned_zeroed_and_writable() {
        let mut b = HostBuffer::new(10_000).unwrap();
        assert_eq!(b.addr() % 4096, 0);
        assert!(b.as_slice().iter().all(|&x| x == 0));
        b.as_mut_slice()[9_999] = 7;
        assert_eq!(b.as_slice()[9_999], 7);
        assert_eq!(b.region(), (b.addr(), 10_000));
        assert!(HostBuffer::new(0).is_err());
    }
}
