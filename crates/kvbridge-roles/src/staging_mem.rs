//! Staging memory and the local copies into and out of it (a prefill's
//! gather, a decode's scatter): host memory copied by the CPU, or, for a KV
//! pool in device memory, memory of the same GPU copied by the IPC
//! engine's batched kernel.
//!
//! **Owns:** allocating staging memory of the KV pool's kind, and running a
//! gather's or scatter's copies once every one of them is checked against
//! the rank's own registry.
//! **Never:** copies from or into memory the registry does not hold, or
//! lets two copies of one call write the same bytes on the GPU.

use kvbridge_mem::{HostBuffer, MemoryKind, RegionRegistry, probe_kind};
use kvbridge_plan::Run;

use kvbridge_engine::TransferEngine;

use crate::config::{StagingConfig, StagingMode};
use crate::error::ConfigError;
use crate::kv_args::KvArgs;

/// Staging memory of one kind.
#[derive(Debug)]
enum Memory {
    Host(HostBuffer),
    #[cfg(feature = "cuda")]
    Device(Box<DeviceMemory>),
}

/// Staging memory on a GPU and its copier.
#[cfg(feature = "cuda")]
#[derive(Debug)]
struct DeviceMemory {
    buffer: kvbridge_mem::cuda::DeviceBuffer,
    copier: kvbridge_engine::ipc::DeviceCopier,
}

/// A staging buffer (a decode's ring, a prefill worker's gather slots).
#[derive(Debug)]
pub(crate) struct StagingMemory {
    memory: Memory,
}

/// Whether a rank with `config` stages through `engine`: `on` and `off` as
/// said; `auto` where the engine moves head slices faster staged for this
/// KV pool's memory. `side` names the role in the one log line that says
/// which path was taken and why.
pub(crate) fn staging_wanted(
    config: &StagingConfig,
    engine: &dyn TransferEngine,
    kv_args: &KvArgs,
    side: &str,
) -> bool {
    match config.mode {
        StagingMode::On => {
            tracing::info!(side, "staging on (configured)");
            true
        }
        StagingMode::Off => {
            tracing::info!(side, "staging off (configured): head slices go per slice");
            false
        }
        StagingMode::Auto => {
            let device_kv = matches!(kv_kind(kv_args), Ok(MemoryKind::Device { .. }));
            let stage = engine.prefers_staging(device_kv);
            tracing::info!(
                side,
                engine = engine.session_id(),
                device_kv,
                runs = engine.copies_runs(),
                "staging auto: {}",
                if stage {
                    "on (this engine moves heterogeneous-TP head slices faster staged)"
                } else {
                    "off (this engine moves head slices as fast per slice)"
                }
            );
            stage
        }
    }
}

/// The one memory kind of every KV buffer of `kv_args`.
fn kv_kind(kv_args: &KvArgs) -> Result<MemoryKind, ConfigError> {
    let mut kinds = kv_args.layout.kv_data_ptrs.iter().map(|p| probe_kind(*p));
    let first = kinds.next().unwrap_or(MemoryKind::Host);
    let same = |k: MemoryKind| match (first, k) {
        (MemoryKind::Device { ordinal: a }, MemoryKind::Device { ordinal: b }) => a == b,
        (MemoryKind::Device { .. }, _) | (_, MemoryKind::Device { .. }) => false,
        _ => true,
    };
    if kinds.all(same) {
        Ok(first)
    } else {
        Err(ConfigError::Setting(
            "SGLANG_DISAGG_STAGING_BUFFER: the KV buffers are not all in host memory or all on \
             one GPU; staging needs one kind"
                .into(),
        ))
    }
}

impl StagingMemory {
    /// `len` bytes (faulted in now) where `kv_args`' KV buffers live: host
    /// memory, or the same GPU's memory.
    pub fn new(kv_args: &KvArgs, len: usize) -> Result<Self, ConfigError> {
        let memory = match kv_kind(kv_args)? {
            MemoryKind::Device { ordinal } => device(ordinal, len)?,
            _ => Memory::Host(HostBuffer::new_resident(len).map_err(|e| {
                ConfigError::Setting(format!(
                    "cannot allocate {len} bytes of staging memory: {e}"
                ))
            })?),
        };
        Ok(Self { memory })
    }

    /// `(address, length)`, for registration.
    pub fn region(&self) -> (u64, u64) {
        match &self.memory {
            Memory::Host(b) => b.region(),
            #[cfg(feature = "cuda")]
            Memory::Device(d) => d.buffer.region(),
        }
    }

    /// Whether the memory is on a GPU.
    pub fn is_device(&self) -> bool {
        !matches!(self.memory, Memory::Host(_))
    }

    /// Runs the local copies `runs` (a gather or a scatter, whose
    /// destinations are pairwise disjoint by construction), each first
    /// checked against `registry`: both spans inside registered regions,
    /// not overlapping each other, copies of a run not overlapping at the
    /// destination. Returns the bytes copied.
    pub fn copy_runs(&self, registry: &RegionRegistry, runs: &[Run]) -> Result<u64, String> {
        let mut bytes = 0u64;
        match &self.memory {
            Memory::Host(_) => {
                for r in runs {
                    registry.copy_strided(r).map_err(|e| e.to_string())?;
                    bytes = bytes.saturating_add(r.bytes());
                }
            }
            #[cfg(feature = "cuda")]
            Memory::Device(d) => {
                let mut blocks = Vec::new();
                for r in runs {
                    check_device_run(registry, r)?;
                    blocks.extend(r.blocks());
                    bytes = bytes.saturating_add(r.bytes());
                }
                // SAFETY: every copy reads and writes inside registered
                // device regions of this GPU (checked above), which the
                // registration contract keeps valid while the role runs;
                // a run's copies do not overlap at the destination (checked)
                // and the runs of one gather or scatter write disjoint
                // ranges by construction (`StagingSource::gather`: slots
                // laid out one after the other; `StagingTarget::scatter`:
                // distinct buffers, distinct pages, writers' distinct head
                // ranges).
                unsafe { d.copier.copy(&blocks) }.map_err(|e| e.to_string())?;
            }
        }
        Ok(bytes)
    }
}

#[cfg(feature = "cuda")]
fn device(ordinal: i32, len: usize) -> Result<Memory, ConfigError> {
    let err = |e: kvbridge_mem::CudaError| {
        ConfigError::Setting(format!("staging memory on GPU {ordinal}: {e}"))
    };
    Ok(Memory::Device(Box::new(DeviceMemory {
        buffer: kvbridge_mem::cuda::DeviceBuffer::new(ordinal, len).map_err(err)?,
        copier: kvbridge_engine::ipc::DeviceCopier::new(ordinal).map_err(err)?,
    })))
}

#[cfg(not(feature = "cuda"))]
fn device(ordinal: i32, _len: usize) -> Result<Memory, ConfigError> {
    Err(ConfigError::Setting(format!(
        "SGLANG_DISAGG_STAGING_BUFFER: the KV pool is on GPU {ordinal} and this build has no \
         `cuda` feature"
    )))
}

/// A run of a device gather or scatter: both spans inside registered
/// device regions, apart, its copies apart at the destination.
#[cfg(feature = "cuda")]
fn check_device_run(registry: &RegionRegistry, r: &Run) -> Result<(), String> {
    let (src_span, dst_span) = r
        .spans()
        .ok_or_else(|| format!("a staging copy at {:#x} overflows", r.src))?;
    if src_span == 0 {
        return Ok(());
    }
    for (addr, span) in [(r.src, src_span), (r.dst, dst_span)] {
        let region = registry.check(addr, span).map_err(|e| e.to_string())?;
        if region.kind.is_host_accessible() {
            return Err(format!(
                "staging copy at {addr:#x} mixes host and device memory"
            ));
        }
    }
    let apart = r.src + src_span <= r.dst || r.dst + dst_span <= r.src;
    if !apart || (r.count > 1 && r.dst_stride < r.len) {
        return Err(format!("staging copy at {:#x} overlaps itself", r.dst));
    }
    Ok(())
}
