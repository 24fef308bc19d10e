//! The memory a role reads and writes itself, and what it registers with
//! its engine.
//!
//! Every buffer of a rank's `KvArgs` is in the local registry, so aux slots
//! (`AUX_DATA`) and host-resident blocks (`STATE_DATA`) are read and written
//! through it — with the right copy for each memory kind (device memory
//! through `kvbridge-mem`'s staged copies) and only inside our buffers.
//! With the intra-node transport active (sglang's `MC_INTRANODE_NVLINK`,
//! `MC_INTRA_NVLINK`, `MOONCAKE_PROTOCOL=nvlink_intra`, our
//! `nvlink_intra` setting, or an engine that moves device memory only)
//! only device regions are registered with the engine, as the reference's
//! `_registerable_regions` does; host regions stay local.

use kvbridge_mem::{MemError, RegionRegistry, probe_kind};

use crate::kv_args::KvArgs;

/// A rank's own view of its buffers.
#[derive(Debug)]
pub(crate) struct LocalMemory {
    /// Every buffer of the rank (for local reads and writes).
    pub registry: RegionRegistry,
    /// Whether the intra-node transport is active (host blocks go over zmq).
    pub intra: bool,
    /// The regions registered with the engine.
    pub engine_regions: Vec<(u64, u64)>,
}

impl LocalMemory {
    /// Builds the local registry and decides what the engine gets.
    ///
    /// # Safety
    /// As for `TransferEngine::batch_register`: every buffer of `kv_args`
    /// and every `extra` region (the role's own staging memory) stays valid
    /// until the role is torn down.
    pub unsafe fn new(
        kv_args: &KvArgs,
        intra: bool,
        extra: &[(u64, u64)],
    ) -> Result<Self, MemError> {
        let mut all = kv_args.registerable_regions();
        all.extend_from_slice(extra);
        let mut registry = RegionRegistry::new();
        // SAFETY: forwarded caller contract.
        unsafe { registry.register(&all) }?;
        let engine_regions = if intra {
            let (device, host): (Vec<_>, Vec<_>) = all
                .iter()
                .partition(|(p, _)| !probe_kind(*p).is_host_accessible());
            if !host.is_empty() {
                tracing::info!(
                    skipped = host.len(),
                    first = ?host.iter().take(8).map(|(p, l)| (format!("{p:#x}"), *l)).collect::<Vec<_>>(),
                    "intra-node transport: host-memory regions are not registered with the engine; \
                     their blocks travel over the zmq channel"
                );
            }
            device
        } else {
            all
        };
        Ok(Self {
            registry,
            intra,
            engine_regions,
        })
    }

    /// Whether the block starting at `src` must travel over zmq (intra-node
    /// transport active and its source in host memory).
    pub fn ships_over_zmq(&self, src: u64, len: u64) -> bool {
        self.intra
            && self
                .registry
                .find(src, len)
                .is_none_or(|r| r.kind.is_host_accessible())
    }
}

#[cfg(test)]
mod tests {
    use kvbridge_mem::HostBuffer;
    use kvbridge_plan::PrefillLayout;

    use super::*;

    #[test]
    fn intra_mode_keeps_host_regions_local() {
        let kv = HostBuffer::new(4096).unwrap();
        let aux = HostBuffer::new(4096).unwrap();
        let args = KvArgs {
            layout: PrefillLayout {
                page_size: 1,
                kv_data_ptrs: vec![kv.addr()],
                kv_item_lens: vec![64],
                aux_data_ptrs: vec![aux.addr()],
                aux_item_lens: vec![8],
                ..PrefillLayout::default()
            },
            kv_data_lens: vec![4096],
            aux_data_lens: vec![4096],
            state_data_lens: vec![],
        };
        // SAFETY: the buffers outlive both registries.
        let off = unsafe { LocalMemory::new(&args, false, &[]) }.unwrap();
        assert_eq!(off.engine_regions.len(), 2);
        assert!(!off.ships_over_zmq(kv.addr(), 8));
        // SAFETY: as above.
        let on = unsafe { LocalMemory::new(&args, true, &[]) }.unwrap();
        assert!(
            on.engine_regions.is_empty(),
            "host memory is never registered in intra mode"
        );
        assert!(on.ships_over_zmq(kv.addr(), 8));
        on.registry.write_bytes(aux.addr() + 8, b"abc").unwrap();
        assert_eq!(&aux.as_slice()[8..11], b"abc");
    }
}
