//! Registry behaviour: dedup, overlap refusal, lookups, checked byte I/O.

use kvbridge_mem::{HostBuffer, MemError, MemoryKind, Region, RegionRegistry};
use proptest::prelude::*;

/// Registers ranges that never get dereferenced by these tests unless noted.
fn reg(r: &mut RegionRegistry, regions: &[(u64, u64)]) -> Result<usize, MemError> {
    // SAFETY: these registries are only used for lookups over fake addresses;
    // no byte I/O is done on them.
    unsafe { r.register(regions) }
}

#[test]
fn exact_duplicates_register_once() {
    let mut r = RegionRegistry::new();
    assert_eq!(
        reg(&mut r, &[(0x1000, 0x100), (0x1000, 0x100), (0x3000, 8)]).unwrap(),
        2
    );
    assert_eq!(reg(&mut r, &[(0x1000, 0x100)]).unwrap(), 0);
    assert_eq!(r.len(), 2);
    r.deregister(&[0x1000, 0x1000, 0x3000]).unwrap();
    assert!(r.is_empty());
}

#[test]
fn overlaps_are_refused_and_batch_is_atomic() {
    let mut r = RegionRegistry::new();
    reg(&mut r, &[(0x1000, 0x100)]).unwrap();
    for bad in [
        (0x1000, 0x80),
        (0x10ff, 2),
        (0x0f00, 0x101),
        (0x0f00, 0x1000),
    ] {
        let e = reg(&mut r, &[(0x9000, 1), bad]).unwrap_err();
        assert!(matches!(e, MemError::Overlap { .. }), "{bad:?}: {e}");
    }
    // Overlap inside one batch.
    assert!(reg(&mut r, &[(0x5000, 0x10), (0x5008, 0x10)]).is_err());
    assert_eq!(r.len(), 1, "failed batches registered nothing");
    // Adjacent is fine.
    reg(&mut r, &[(0x1100, 0x10), (0x0f00, 0x100)]).unwrap();
    assert_eq!(r.len(), 3);
}

#[test]
fn bad_shapes() {
    let mut r = RegionRegistry::new();
    assert_eq!(reg(&mut r, &[(0, 1)]), Err(MemError::Null));
    assert_eq!(
        reg(&mut r, &[(8, 0)]),
        Err(MemError::ZeroLength { addr: 8 })
    );
    assert!(matches!(
        reg(&mut r, &[(u64::MAX, 2)]),
        Err(MemError::Overflow { .. })
    ));
    assert_eq!(
        r.deregister(&[0x77]),
        Err(MemError::NotRegistered { addr: 0x77 })
    );
}

#[test]
fn lookups() {
    let mut r = RegionRegistry::new();
    reg(&mut r, &[(0x1000, 0x100), (0x2000, 0x100)]).unwrap();
    assert!(r.find(0x1000, 0x100).is_some());
    assert!(r.find(0x10ff, 1).is_some());
    assert!(r.find(0x10ff, 2).is_none());
    assert!(r.find(0x0fff, 1).is_none());
    assert!(r.find(0x1100, 0x100).is_none(), "spans the gap");
    assert!(r.find(0x1000, 0x1100).is_none(), "spans two regions");
    assert!(r.find(0x2050, u64::MAX).is_none());
    // Adjacent regions: a byte at the seam is in the second one.
    reg(&mut r, &[(0x2100, 0x10)]).unwrap();
    assert_eq!(r.find(0x2100, 1).map(|g| g.addr), Some(0x2100));
    assert_eq!(r.find(0x20ff, 1).map(|g| g.addr), Some(0x2000));
    assert!(r.find(0x20ff, 2).is_none(), "spans the seam");
    assert_eq!(r.check(0x2000, 1).unwrap().kind, MemoryKind::Host);
    assert_eq!(
        r.check(0x3000, 1),
        Err(MemError::OutOfRegion {
            addr: 0x3000,
            len: 1
        })
    );
}

#[test]
fn checked_byte_io_on_a_host_buffer() {
    let buf = HostBuffer::new(4096).unwrap();
    let mut r = RegionRegistry::new();
    // SAFETY: `buf` outlives the registry and is not borrowed while written.
    unsafe { r.register(&[buf.region()]) }.unwrap();
    r.write_bytes(buf.addr() + 4090, b"abcdef").unwrap();
    assert_eq!(r.read_vec(buf.addr() + 4090, 6).unwrap(), b"abcdef");
    assert!(r.write_bytes(buf.addr() + 4091, b"abcdef").is_err());
    assert!(r.write_bytes(buf.addr() - 1, b"a").is_err());
    assert_eq!(&buf.as_slice()[4090..], b"abcdef");
    assert_eq!(buf.as_slice()[4089], 0);
    r.deregister(&[buf.addr()]).unwrap();
    assert!(r.write_bytes(buf.addr(), b"x").is_err());
}

#[test]
fn device_kind_is_refused_for_byte_io() {
    let mut r = RegionRegistry::new();
    let region = Region {
        addr: 0x1_0000,
        len: 64,
        kind: MemoryKind::Device { ordinal: 0 },
    };
    // SAFETY: the device access of this build never dereferences (with the
    // `cuda` feature it goes through the driver, which checks the pointer).
    unsafe { r.register_regions(&[region]) }.unwrap();
    let written = r.write_bytes(0x1_0000, b"x");
    #[cfg(not(feature = "cuda"))]
    assert!(matches!(written, Err(MemError::Unsupported { .. })));
    // With CUDA support the device path answers: no driver, or no such allocation.
    #[cfg(feature = "cuda")]
    assert!(matches!(
        written,
        Err(MemError::Unsupported { .. } | MemError::Device { .. })
    ));
}

proptest! {
    #[test]
    fn matches_a_naive_model(
        ops in prop::collection::vec((0u64..64, 1u64..8, any::<bool>()), 1..60),
        probes in prop::collection::vec((0u64..80, 0u64..10), 1..40),
    ) {
        let mut r = RegionRegistry::new();
        let mut model: Vec<(u64, u64)> = Vec::new();
        for (slot, len, add) in ops {
            let addr = 0x1000 + slot * 4;
            if add {
                let overlaps = model.iter().any(|&(a, l)| a < addr + len && addr < a + l);
                let dup = model.contains(&(addr, len));
                let res = reg(&mut r, &[(addr, len)]);
                if dup {
                    prop_assert_eq!(res, Ok(0));
                } else if overlaps {
                    prop_assert!(res.is_err());
                } else {
                    prop_assert_eq!(res, Ok(1));
                    model.push((addr, len));
                }
            } else {
                let known = model.iter().position(|&(a, _)| a == addr);
                let res = r.deregister(&[addr]);
                prop_assert_eq!(res.is_ok(), known.is_some());
                if let Some(i) = known { model.remove(i); }
            }
            // Lookups agree with the model after every change, not only
            // at the end (the index they search is rebuilt on each).
            for &(off, len) in &probes {
                let addr = 0x1000 + off * 4;
                let holds = |a: u64, l: u64| addr >= a && addr + len <= a + l;
                let want = model.iter().any(|&(a, l)| holds(a, l));
                let got = r.find(addr, len);
                prop_assert_eq!(got.is_some(), want);
                // What it finds is registered and holds the probe (a
                // zero-length probe at a boundary lies in two regions).
                if let Some(g) = got {
                    prop_assert!(model.contains(&(g.addr, g.len)) && holds(g.addr, g.len));
                }
            }
        }
    }
}

#[test]
fn strided_copy_gathers_and_refuses_what_is_not_registered() {
    use kvbridge_block::Run;
    let mut src = HostBuffer::new(64).unwrap();
    for (i, b) in src.as_mut_slice().iter_mut().enumerate() {
        *b = i as u8;
    }
    let dst = HostBuffer::new(64).unwrap();
    let other = HostBuffer::new(64).unwrap();
    let mut r = RegionRegistry::new();
    // SAFETY: both buffers outlive the registry's use below.
    unsafe { r.register(&[src.region(), dst.region()]) }.unwrap();
    // Bytes 2..4 of every 8-byte "token", packed.
    let gather = Run {
        src: src.addr() + 2,
        dst: dst.addr(),
        len: 2,
        count: 8,
        src_stride: 8,
        dst_stride: 2,
    };
    r.copy_strided(&gather).unwrap();
    let want: Vec<u8> = (0..8u8).flat_map(|t| [t * 8 + 2, t * 8 + 3]).collect();
    assert_eq!(&dst.as_slice()[..16], &want[..]);
    // A span past its region, an unregistered destination, overlapping
    // destination pieces and a copy onto itself are refused.
    let past = Run { count: 9, ..gather };
    assert!(r.copy_strided(&past).is_err());
    let unregistered = Run {
        dst: other.addr(),
        ..gather
    };
    assert!(r.copy_strided(&unregistered).is_err());
    let overlapping = Run {
        dst_stride: 1,
        ..gather
    };
    assert!(r.copy_strided(&overlapping).is_err());
    let onto_itself = Run {
        dst: src.addr() + 3,
        ..gather
    };
    assert!(r.copy_strided(&onto_itself).is_err());
    assert!(r.copy_strided(&Run { count: 0, ..past }).is_ok());
}
