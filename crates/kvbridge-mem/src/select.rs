//! Which prober and which byte access this build uses: CUDA's with the
//! `cuda` feature (host answers for everything when no driver or GPU is
//! there), host-only otherwise.

use crate::kind::{HostAccess, KindProber, MemoryAccess, MemoryKind};
#[cfg(not(feature = "cuda"))]
use crate::kind::{HostOnlyProber, NoDeviceAccess};

#[cfg(not(feature = "cuda"))]
static HOST_ONLY: HostOnlyProber = HostOnlyProber;

/// The process-wide prober of this build: CUDA's when the `cuda` feature is
/// on (it answers host for everything when no driver or GPU is there),
/// host-only otherwise.
pub fn default_prober() -> &'static dyn KindProber {
    #[cfg(feature = "cuda")]
    {
        static CUDA: crate::cuda::CudaProber = crate::cuda::CudaProber;
        &CUDA
    }
    #[cfg(not(feature = "cuda"))]
    {
        &HOST_ONLY
    }
}

/// Probe the kind of the memory at `addr` with [`default_prober`].
pub fn probe_kind(addr: u64) -> MemoryKind {
    default_prober().probe(addr)
}

static HOST_ACCESS: HostAccess = HostAccess;
#[cfg(not(feature = "cuda"))]
static NO_DEVICE_ACCESS: NoDeviceAccess = NoDeviceAccess;

/// The byte access for memory of `kind`.
pub fn access_for(kind: MemoryKind) -> &'static dyn MemoryAccess {
    if kind.is_host_accessible() {
        &HOST_ACCESS
    } else {
        #[cfg(feature = "cuda")]
        {
            &crate::cuda::DEVICE_ACCESS
        }
        #[cfg(not(feature = "cuda"))]
        {
            &NO_DEVICE_ACCESS
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn host_only_prober_says_host() {
        assert_eq!(probe_kind(0x1000), MemoryKind::Host);
        assert!(MemoryKind::Managed.is_host_accessible());
        assert!(MemoryKind::PinnedHost.is_host_accessible());
        assert!(!MemoryKind::Device { ordinal: 0 }.is_host_accessible());
    }
}
