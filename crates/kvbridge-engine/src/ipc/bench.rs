//! In-process measurement of the IPC engine's copy paths on one GPU (for
//! `kvbridge bench ipc` and the GPU tests): the batched kernel alone, the
//! run kernel alone, and whole copies under a chosen tuning, between two
//! device buffers. Every copy is checked to read inside the source buffer
//! and write inside the destination buffer, destinations pairwise
//! disjoint, before anything is launched; so this API is safe to call.
//!
//! **Never:** touches memory outside the buffers it is given, or changes
//! how the engine itself copies.

use std::marker::PhantomData;

use kvbridge_mem::cuda::{CudaError, DeviceBuffer};

use super::copier::{Copier, CopyStats};
use super::schedule::{self, CopyMode, CopyTuning};
use crate::{Block, Run};

/// Why a measurement could not run.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum BenchError {
    /// A CUDA call failed.
    #[error(transparent)]
    Cuda(#[from] CudaError),
    /// Copy `index` reads outside the source or writes outside the
    /// destination buffer, or its destination overlaps another copy's.
    #[error("copy {index} is outside the buffers or overlaps another copy's destination")]
    BadCopy {
        /// Index of the copy (of the block; of the run for a malformed run,
        /// else of the run's expanded copy).
        index: usize,
    },
}

/// The copy machinery of one GPU (streams, kernels, descriptor buffers),
/// for measurement.
#[derive(Debug)]
pub struct CopyBench {
    copier: Copier,
}

/// Blocks from one device buffer into another, checked (see the module
/// docs); valid while the buffers live.
#[derive(Debug)]
pub struct Copies<'a> {
    blocks: Vec<Block>,
    buffers: PhantomData<&'a DeviceBuffer>,
}

impl<'a> Copies<'a> {
    /// `blocks` from `src` into `dst`, once checked.
    pub fn new(
        src: &'a DeviceBuffer,
        dst: &'a DeviceBuffer,
        blocks: &[Block],
    ) -> Result<Self, BenchError> {
        check(src, dst, blocks)?;
        Ok(Self {
            blocks: blocks.to_vec(),
            buffers: PhantomData,
        })
    }
}

/// Checked copies cut into the batched kernel's pieces (as
/// [`CopyMode::Kernel`] cuts them); valid while the buffers live.
#[derive(Debug)]
pub struct KernelPieces<'a> {
    pieces: Vec<Block>,
    buffers: PhantomData<&'a DeviceBuffer>,
}

impl KernelPieces<'_> {
    /// Number of kernel descriptors.
    pub fn len(&self) -> usize {
        self.pieces.len()
    }

    /// Whether there is nothing to copy.
    pub fn is_empty(&self) -> bool {
        self.pieces.is_empty()
    }

    /// The threads-per-descriptor shift (`1 << shift` threads) the engine
    /// would launch these pieces with.
    pub fn group_shift(&self) -> u32 {
        schedule::group_shift(&self.pieces)
    }
}

/// Check that every copy reads inside `src` and writes inside `dst`, and
/// that no two destinations overlap; the index of the first bad one.
fn check(src: &DeviceBuffer, dst: &DeviceBuffer, blocks: &[Block]) -> Result<(), BenchError> {
    let inside = |buf: &DeviceBuffer, at: u64, len: u64| {
        let (start, end) = (buf.addr(), buf.addr().saturating_add(buf.len() as u64));
        at >= start && at.checked_add(len).is_some_and(|e| e <= end)
    };
    if let Some(index) = blocks
        .iter()
        .position(|b| !inside(src, b.src, b.len) || !inside(dst, b.dst, b.len))
    {
        return Err(BenchError::BadCopy { index });
    }
    let mut order: Vec<usize> = (0..blocks.len()).filter(|&i| blocks[i].len > 0).collect();
    order.sort_unstable_by_key(|&i| blocks[i].dst);
    for w in order.windows(2) {
        let (a, b) = (blocks[w[0]], blocks[w[1]]);
        if a.dst + a.len > b.dst {
            return Err(BenchError::BadCopy { index: w[1] });
        }
    }
    Ok(())
}

impl CopyBench {
    /// The copy machinery of GPU `ordinal`, copying as `tuning` says.
    pub fn new(ordinal: i32, tuning: CopyTuning) -> Result<Self, BenchError> {
        Ok(Self {
            copier: Copier::new(ordinal, tuning)?,
        })
    }

    /// The GPU's multiprocessors.
    pub fn multiprocessors(&self) -> u32 {
        self.copier.multiprocessors()
    }

    /// Change the copy tuning (e.g. force a mode).
    pub fn set_tuning(&mut self, tuning: CopyTuning) {
        self.copier.set_tuning(tuning);
    }

    /// Carry out `copies` as the engine copies one batch (with the
    /// current tuning) and wait for them.
    pub fn copy(&mut self, copies: &Copies<'_>) -> Result<CopyStats, BenchError> {
        // SAFETY: every copy reads inside the source and writes inside the
        // destination buffer (checked by `Copies::new`), both alive for the
        // lifetime of `copies`, which outlasts this call (the copy finished
        // when it returns); destinations are pairwise disjoint.
        Ok(unsafe { self.copier.copy(&copies.blocks) }?)
    }

    /// `copies` cut into the batched kernel's pieces.
    pub fn kernel_pieces<'a>(&self, copies: &Copies<'a>) -> KernelPieces<'a> {
        let pieces = CopyTuning {
            mode: CopyMode::Kernel,
            ..self.copier.tuning()
        }
        .split(&copies.blocks)
        .kernel;
        KernelPieces {
            pieces,
            buffers: PhantomData,
        }
    }

    /// Device time of one batched-kernel launch over `pieces` with the
    /// descriptors already on the GPU, averaged over `reps`, in milliseconds.
    pub fn time_kernel(&mut self, pieces: &KernelPieces<'_>, reps: u32) -> Result<f64, BenchError> {
        // SAFETY: the pieces were checked against buffers that outlive
        // `pieces` (its lifetime); pieces of disjoint blocks are disjoint.
        Ok(unsafe { self.copier.time_kernel(&pieces.pieces, reps) }?)
    }

    /// [`CopyBench::time_kernel`] with `1 << shift` threads per descriptor
    /// and `grid` CTAs (to tune the launch shape).
    pub fn time_kernel_with(
        &mut self,
        pieces: &KernelPieces<'_>,
        reps: u32,
        shift: u32,
        grid: u32,
    ) -> Result<f64, BenchError> {
        // SAFETY: as in `time_kernel`.
        Ok(unsafe {
            self.copier
                .time_kernel_with(&pieces.pieces, reps, shift, grid)
        }?)
    }

    /// Device time of one run-kernel launch over `runs` (from `src` into
    /// `dst`, every run taken by the run kernel as it is) with the
    /// descriptors already on the GPU, averaged over `reps`, in milliseconds.
    pub fn time_runs(
        &mut self,
        src: &DeviceBuffer,
        dst: &DeviceBuffer,
        runs: &[Run],
        reps: u32,
    ) -> Result<f64, BenchError> {
        let blocks = crate::Batch::Runs(runs)
            .to_blocks()
            .map_err(|i| BenchError::BadCopy { index: i })?;
        check(src, dst, &blocks)?;
        // SAFETY: every copy of every run was checked above against `src`
        // and `dst`, borrowed until we return (after the launches).
        Ok(unsafe { self.copier.time_runs(runs, reps) }?)
    }
}
