//! Copies inside this process's own device memory on the IPC engine's copy
//! path (the batched kernel for small copies, `cuMemcpyAsync` for large
//! ones), for callers that gather or scatter locally: the roles' staging
//! path moves a chunk's head slices between the KV pool and a staging
//! buffer on the GPU.
//!
//! **Never:** checks an address: the caller proves, under an `unsafe`
//! contract, that every range is its own device memory.

use std::sync::Mutex;

use kvbridge_mem::cuda::CudaError;

use super::copier::Copier;
use super::schedule::CopyTuning;
use crate::Block;

/// Local device-to-device copies on one GPU.
#[derive(Debug)]
pub struct DeviceCopier {
    copier: Mutex<Copier>,
}

impl DeviceCopier {
    /// The copy machinery of GPU `ordinal` (its kernel compiled once per process).
    pub fn new(ordinal: i32) -> Result<Self, CudaError> {
        Ok(Self {
            copier: Mutex::new(Copier::new(ordinal, CopyTuning::default())?),
        })
    }

    /// Copies `blocks` and waits until they are done.
    ///
    /// # Safety
    /// Every source range must be readable and every destination range
    /// writable memory of this GPU until this returns; destinations must not
    /// overlap each other, and nothing else may write them meanwhile.
    pub unsafe fn copy(&self, blocks: &[Block]) -> Result<(), CudaError> {
        let mut copier = self.copier.lock().unwrap_or_else(|p| p.into_inner());
        // SAFETY: forwarded caller contract.
        unsafe { copier.copy(blocks) }.map(|_| ())
    }
}
