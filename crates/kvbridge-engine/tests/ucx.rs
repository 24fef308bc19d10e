//! The UCX engine between two processes, over TCP and over shared memory:
//! random block sets arrive byte-exact, destinations outside the peer's
//! published regions are refused with nothing written, and the cluster
//! secret guards the keys.
#![allow(clippy::unwrap_used)]

mod common;
mod ucx_util;

use common::{patterned, random_blocks, register};
use kvbridge_engine::{Batch, Block, ErrorKind, Side, TransferEngine, UcxEngine};
use kvbridge_mem::HostBuffer;
use rand::{Rng, SeedableRng, rngs::StdRng};
use ucx_util::{TRANSPORTS, Target, engine, ucx_or_skip};

const LEN: usize = 8 << 20;

/// Apply `blocks` to a copy of `before`, as the target should see it.
fn expected(before: &[u8], base: u64, src: &HostBuffer, blocks: &[Block]) -> Vec<u8> {
    let mut img = before.to_vec();
    for b in blocks {
        let s = (b.src - src.addr()) as usize;
        let d = (b.dst - base) as usize;
        img[d..d + b.len as usize].copy_from_slice(&src.as_slice()[s..s + b.len as usize]);
    }
    img
}

/// Blocks of one contiguous run cut into pieces (merged into one put).
fn contiguous_run(src: &HostBuffer, t: &Target, off: u64, pieces: u64, piece: u64) -> Vec<Block> {
    (0..pieces)
        .map(|i| Block {
            src: src.addr() + off + i * piece,
            dst: t.addr + off + i * piece,
            len: piece,
        })
        .collect()
}

fn random_blocks_arrive_byte_exact(tls: &str) {
    let a = engine(tls, None);
    let src = patterned(LEN, 11);
    register(&a, &src);
    let mut t = Target::spawn(tls, LEN, 0, None);
    let dst_view = HostBuffer::new(LEN).unwrap(); // only for its geometry
    let mut rng = StdRng::seed_from_u64(7);
    let mut image = vec![0u8; LEN];
    for round in 0..4 {
        // Random blocks (relocated onto the target's buffer), several
        // batches in flight at once.
        let mut blocks = random_blocks(&mut rng, &src, &dst_view, 1 << 16, 2 << 20);
        for b in &mut blocks {
            b.dst = b.dst - dst_view.addr() + t.addr;
        }
        let handles: Vec<_> = blocks
            .chunks(rng.gen_range(1..64))
            .map(|c| a.submit(kvbridge_engine::Target::any(&t.session), Batch::Blocks(c)))
            .collect();
        for h in handles {
            h.wait().unwrap();
        }
        image = expected(&image, t.addr, &src, &blocks);
        // A contiguous run in 4 KiB pieces, merged into one put.
        let run = contiguous_run(&src, &t, (round as u64) << 20, 64, 4096);
        a.batch_transfer_sync(&t.session, &run).unwrap();
        image = expected(&image, t.addr, &src, &run);
        assert!(t.dump() == image, "round {round} over {tls}: bytes differ");
    }
    // One put per run, not per block: the run of 64 became one.
    let s = a.stats();
    assert!(s.puts > 0 && s.batches_failed == 0, "{s:?}");
    assert_eq!(s.handshakes, 1, "one handshake per peer: {s:?}");
    // Zero-length blocks and empty batches succeed without touching anything.
    a.batch_transfer_sync(&t.session, &[]).unwrap();
    let zero = Block {
        src: src.addr(),
        dst: t.addr,
        len: 0,
    };
    a.batch_transfer_sync(&t.session, &[zero]).unwrap();
    a.batch_deregister(&[src.addr()]).unwrap();
}

#[test]
fn random_blocks_arrive_byte_exact_over_tcp() {
    if ucx_or_skip() {
        random_blocks_arrive_byte_exact(TRANSPORTS[0]);
    }
}

#[test]
fn random_blocks_arrive_byte_exact_over_shared_memory() {
    if ucx_or_skip() {
        random_blocks_arrive_byte_exact(TRANSPORTS[1]);
    }
}

fn out_of_region_is_refused_with_nothing_written(tls: &str) {
    let a = engine(tls, None);
    let src = patterned(LEN, 3);
    register(&a, &src);
    let mut t = Target::spawn(tls, LEN, 0, None);
    let base = t.addr;
    let good = |i: u64| Block {
        src: src.addr() + i * 4096,
        dst: base + i * 4096,
        len: 4096,
    };
    let end = t.addr + LEN as u64;
    let bad_dsts = [
        end - 100,     // straddles the end of the region
        end,           // just past it
        t.addr - 4096, // just before it
        0x10,          // nowhere near
    ];
    for bad in bad_dsts {
        let mut blocks: Vec<Block> = (0..40).map(good).collect();
        blocks.insert(
            17,
            Block {
                src: src.addr(),
                dst: bad,
                len: 200,
            },
        );
        let e = a.batch_transfer_sync(&t.session, &blocks).unwrap_err();
        assert_eq!(e.kind, ErrorKind::OutOfRegion(Side::Remote), "{e}");
        assert_eq!(e.block, Some(17), "{e}");
        assert_eq!(e.session, t.session);
    }
    // A source outside our own regions is refused too.
    let mut blocks: Vec<Block> = (0..8).map(good).collect();
    blocks[5].src = src.addr() + LEN as u64 - 10;
    let e = a.batch_transfer_sync(&t.session, &blocks).unwrap_err();
    assert_eq!(e.kind, ErrorKind::OutOfRegion(Side::Local), "{e}");
    assert_eq!(e.block, Some(5));
    assert!(
        t.dump().iter().all(|&b| b == 0),
        "a refused batch wrote bytes"
    );
    // The engine still works for a good batch.
    let blocks: Vec<Block> = (0..8).map(good).collect();
    a.batch_transfer_sync(&t.session, &blocks).unwrap();
    assert_eq!(t.dump()[..8 * 4096], src.as_slice()[..8 * 4096]);
}

#[test]
fn out_of_region_is_refused_with_nothing_written_over_tcp() {
    if ucx_or_skip() {
        out_of_region_is_refused_with_nothing_written(TRANSPORTS[0]);
    }
}

#[test]
fn out_of_region_is_refused_with_nothing_written_over_shared_memory() {
    if ucx_or_skip() {
        out_of_region_is_refused_with_nothing_written(TRANSPORTS[1]);
    }
}

#[test]
fn the_cluster_secret_guards_the_keys() {
    if !ucx_or_skip() {
        return;
    }
    let mut t = Target::spawn("tcp", 1 << 20, 0, Some("s3cret"));
    let src = patterned(1 << 20, 5);
    let blocks = [Block {
        src: src.addr(),
        dst: t.addr,
        len: 1 << 20,
    }];
    for secret in [None, Some("wrong")] {
        let a = engine("tcp", secret);
        register(&a, &src);
        let e = a.batch_transfer_sync(&t.session, &blocks).unwrap_err();
        assert_eq!(e.kind, ErrorKind::Auth, "{e}");
        assert_eq!(a.probe(&t.session).unwrap_err().kind, ErrorKind::Auth);
        assert_eq!(a.stats().handshakes, 0, "no keys without the secret");
        a.batch_deregister(&[src.addr()]).unwrap();
    }
    let a = engine("tcp", Some("s3cret"));
    register(&a, &src);
    a.batch_transfer_sync(&t.session, &blocks).unwrap();
    a.probe(&t.session).unwrap();
    assert!(t.dump() == src.as_slice());
    a.batch_deregister(&[src.addr()]).unwrap();
}

#[test]
fn in_process_engines_register_late_and_deregister() {
    if !ucx_or_skip() {
        return;
    }
    let (a, b) = (engine("tcp", None), engine("tcp", None));
    let src = patterned(1 << 20, 9);
    let d1 = HostBuffer::new(1 << 20).unwrap();
    let d2 = HostBuffer::new(1 << 20).unwrap();
    register(&a, &src);
    register(&b, &d1);
    let to = |d: &HostBuffer| {
        [Block {
            src: src.addr(),
            dst: d.addr(),
            len: 1 << 20,
        }]
    };
    a.batch_transfer_sync(b.session_id(), &to(&d1)).unwrap();
    assert!(d1.as_slice() == src.as_slice());
    // A region registered after the first handshake: the engine asks again.
    register(&b, &d2);
    a.batch_transfer_sync(b.session_id(), &to(&d2)).unwrap();
    assert!(d2.as_slice() == src.as_slice());
    assert_eq!(a.stats().handshakes, 2);
    // Deregistered: no longer published, so a peer that asks now is refused
    // before any put (peers holding older keys learn it at their next
    // handshake; see docs/engines.md).
    b.batch_deregister(&[d1.addr()]).unwrap();
    let c = engine("tcp", None);
    register(&c, &src);
    let e = c.batch_transfer_sync(b.session_id(), &to(&d1)).unwrap_err();
    assert_eq!(e.kind, ErrorKind::OutOfRegion(Side::Remote), "{e}");
    assert_eq!(e.block, Some(0));
    c.batch_deregister(&[src.addr()]).unwrap();
    // Bad session ids and shut-down engines.
    let e = a.batch_transfer_sync("no-port", &to(&d2)).unwrap_err();
    assert_eq!(e.kind, ErrorKind::InvalidArgument);
    a.shutdown();
    let e = a.batch_transfer_sync(b.session_id(), &to(&d2)).unwrap_err();
    assert_eq!(e.kind, ErrorKind::Shutdown);
    b.batch_deregister(&[d2.addr()]).unwrap();
}

#[test]
fn missing_library_is_reported_by_the_constructor() {
    // With UCX present, construction works and names the version; the
    // missing-library message itself is unit-tested in `ucx::sys`.
    if !ucx_or_skip() {
        return;
    }
    let e = UcxEngine::with_ucx_config(ucx_util::cfg(None), &[("TLS", "no-such-transport")]);
    assert!(
        e.is_err(),
        "an unknown transport should fail context creation"
    );
    let a = engine("tcp", None);
    assert!(a.ucx_version().starts_with("1."), "{}", a.ucx_version());
}
