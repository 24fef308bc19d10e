//! The one check every GPU option makes before it starts anything.

use anyhow::{Result, bail};

/// Refuses `options` (the GPU options asked for, as the user wrote them) on a
/// machine or build without CUDA, with one clear "no CUDA" line.
pub fn require_cuda(options: &str) -> Result<()> {
    #[cfg(feature = "cuda")]
    if let Some(why) = kvbridge_mem::cuda::unavailable_reason() {
        bail!("no CUDA ({why}): {options} need a GPU");
    }
    #[cfg(not(feature = "cuda"))]
    bail!("no CUDA: this build has no `cuda` feature; {options} need it");
    #[cfg(feature = "cuda")]
    Ok(())
}
