//! The loopback engine: the trait's contract, in-process.
#![allow(clippy::unwrap_used)]

mod common;

use std::sync::Arc;

use common::*;
use kvbridge_engine::{Batch, Block, ErrorKind, LoopbackEngine, Side, Target, TransferEngine};
use rand::{SeedableRng, rngs::StdRng};

#[test]
fn random_blocks_arrive_and_bad_ones_are_refused() {
    let a: Arc<dyn TransferEngine> = Arc::new(LoopbackEngine::new());
    let b: Arc<dyn TransferEngine> = Arc::new(LoopbackEngine::new());
    let src = patterned(8 << 20, 1);
    let dst = kvbridge_mem::HostBuffer::new(8 << 20).unwrap();
    register(&*a, &src);
    register(&*b, &dst);
    let mut rng = StdRng::seed_from_u64(7);
    let blocks = random_blocks(&mut rng, &src, &dst, 1 << 20, 6 << 20);
    a.batch_transfer_sync(b.session_id(), &blocks).unwrap();
    assert_arrived(&blocks, &src, &dst);

    let bad = [
        blocks[0],
        Block {
            src: src.addr(),
            dst: dst.addr() + (8 << 20) - 1,
            len: 2,
        },
    ];
    let e = a.batch_transfer_sync(b.session_id(), &bad).unwrap_err();
    assert_eq!(
        (e.kind, e.block),
        (ErrorKind::OutOfRegion(Side::Remote), Some(1))
    );
    let e = a
        .batch_transfer_sync(
            b.session_id(),
            &[Block {
                src: 8,
                dst: dst.addr(),
                len: 1,
            }],
        )
        .unwrap_err();
    assert_eq!(e.kind, ErrorKind::OutOfRegion(Side::Local));

    assert!(a.probe(b.session_id()).is_ok());
    let gone = b.session_id().to_owned();
    b.batch_deregister(&[dst.addr()]).unwrap();
    drop(b);
    assert_eq!(a.probe(&gone).unwrap_err().kind, ErrorKind::Unreachable);
    let e = a
        .submit(Target::any(&gone), Batch::Blocks(&blocks[..1]))
        .wait()
        .unwrap_err();
    assert_eq!(e.kind, ErrorKind::Unreachable);
    assert_eq!(a.registered_regions().len(), 1);
}

#[test]
fn local_byte_io_is_bounds_checked() {
    let e = LoopbackEngine::new();
    let buf = kvbridge_mem::HostBuffer::new(4096).unwrap();
    register(&e, &buf);
    e.write_local(buf.addr() + 4000, &[7; 96]).unwrap();
    assert!(e.write_local(buf.addr() + 4000, &[7; 97]).is_err());
    let mut out = [0u8; 96];
    e.read_local(buf.addr() + 4000, &mut out).unwrap();
    assert_eq!(out, [7; 96]);
    assert!(e.read_local(buf.addr() - 8, &mut out).is_err());
    e.batch_deregister(&[buf.addr()]).unwrap();
}

/// Engines without a native run path move a run's copies as blocks; a
/// malformed run fails the batch before anything is written.
#[test]
fn runs_are_expanded_and_malformed_runs_refused() {
    use kvbridge_engine::Run;
    let a = LoopbackEngine::new();
    let b = LoopbackEngine::new();
    let src = patterned(1 << 20, 3);
    let dst = kvbridge_mem::HostBuffer::new(1 << 20).unwrap();
    register(&a, &src);
    register(&b, &dst);
    assert!(!a.copies_runs());
    // Two head-slice-like runs: 256 B of each 1 KiB token into 512 B slots.
    let runs = [
        Run {
            src: src.addr() + 256,
            dst: dst.addr(),
            len: 256,
            count: 64,
            src_stride: 1024,
            dst_stride: 512,
        },
        Run {
            src: src.addr() + 100,
            dst: dst.addr() + (512 << 10) + 3,
            len: 77,
            count: 10,
            src_stride: 0,
            dst_stride: 77,
        },
    ];
    a.submit(Target::exact(b.session_id(), 0), Batch::Runs(&runs))
        .wait()
        .unwrap();
    let blocks = Batch::Runs(&runs).to_blocks().unwrap().into_owned();
    assert_eq!(blocks.len(), 74);
    assert_eq!(blocks[1].src, src.addr() + 256 + 1024);
    assert_arrived(&blocks, &src, &dst);

    let overlapping = Run {
        dst_stride: 255,
        ..runs[0]
    };
    let before = dst.as_slice().to_vec();
    let e = a
        .submit(
            Target::exact(b.session_id(), 0),
            Batch::Runs(&[runs[1], overlapping]),
        )
        .wait()
        .unwrap_err();
    assert_eq!((e.kind, e.block), (ErrorKind::InvalidArgument, Some(1)));
    let wraps = Run {
        dst: u64::MAX - 1000,
        ..runs[0]
    };
    assert_eq!(Batch::Runs(&[runs[0], wraps]).first_malformed(), Some(1));
    assert_eq!(dst.as_slice(), &before[..]);
}
