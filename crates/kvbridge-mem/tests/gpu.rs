//! GPU-gated tests of probing and device byte I/O (feature `cuda`): run
//! by `cargo xtask gpu-test --run` on a machine with a GPU; elsewhere each
//! test prints one skip line and returns.
#![cfg(feature = "cuda")]
#![allow(clippy::unwrap_used)]

use std::io::Write;

use kvbridge_mem::cuda::{self, DeviceBuffer, ManagedBuffer, PinnedBuffer};
use kvbridge_mem::{HostBuffer, MemoryKind, RegionRegistry, probe_kind};

/// Returns false (after one clear line on stderr, past the test harness's
/// capture) when there is no usable GPU.
fn gpu(test: &str) -> bool {
    match cuda::unavailable_reason() {
        None => true,
        Some(why) => {
            let _ = writeln!(std::io::stderr(), "SKIP {test}: no GPU ({why})");
            false
        }
    }
}

#[test]
fn probes_every_memory_kind() {
    if !gpu("probes_every_memory_kind") {
        return;
    }
    let pageable = HostBuffer::new(1 << 20).unwrap();
    let heap = vec![1u8; 4096];
    let pinned = PinnedBuffer::new(1 << 20).unwrap();
    let device = DeviceBuffer::new(0, 1 << 20).unwrap();
    let managed = ManagedBuffer::new(1 << 20).unwrap();
    assert_eq!(probe_kind(pageable.addr()), MemoryKind::Host);
    assert_eq!(probe_kind(heap.as_ptr() as u64), MemoryKind::Host);
    assert_eq!(probe_kind(pinned.addr()), MemoryKind::PinnedHost);
    assert_eq!(probe_kind(pinned.addr() + 4097), MemoryKind::PinnedHost);
    assert_eq!(probe_kind(device.addr()), MemoryKind::Device { ordinal: 0 });
    assert_eq!(
        probe_kind(device.addr() + 12345),
        MemoryKind::Device { ordinal: 0 }
    );
    assert_eq!(probe_kind(managed.addr()), MemoryKind::Managed);
    // Nonsense pointers are host memory (errors are answers, not poison)...
    assert_eq!(probe_kind(0x10), MemoryKind::Host);
    assert_eq!(probe_kind(u64::MAX - 7), MemoryKind::Host);
    // ...and the context still works afterwards.
    device.write(0, b"still fine").unwrap();
    let mut out = [0u8; 10];
    device.read(0, &mut out).unwrap();
    assert_eq!(&out, b"still fine");
    let _ = writeln!(
        std::io::stderr(),
        "probe: pageable=host heap=host pinned=pinned host device=device 0 managed=managed invalid=host"
    );
}

#[test]
fn registry_reads_and_writes_device_memory_through_staging() {
    if !gpu("registry_reads_and_writes_device_memory_through_staging") {
        return;
    }
    let len = 9 << 20; // more than two staging buffers
    let device = DeviceBuffer::new(0, len).unwrap();
    let mut reg = RegionRegistry::new();
    // SAFETY: `device` outlives the registry's use and is deregistered first.
    unsafe { reg.register(&[device.region()]) }.unwrap();
    assert_eq!(
        reg.regions().next().unwrap().kind,
        MemoryKind::Device { ordinal: 0 }
    );
    let data: Vec<u8> = (0..len - 3).map(|i| (i * 31 % 251) as u8).collect();
    reg.write_bytes(device.addr() + 3, &data).unwrap();
    let back = reg.read_vec(device.addr() + 3, data.len()).unwrap();
    assert!(
        back == data,
        "device round trip through the registry differs"
    );
    assert!(
        reg.write_bytes(device.addr() + len as u64 - 2, b"abc")
            .is_err()
    );
    reg.deregister(&[device.addr()]).unwrap();
}
