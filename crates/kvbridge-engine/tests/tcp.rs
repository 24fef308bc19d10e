//! TCP engine: byte-exact delivery, region enforcement, authentication.
#![allow(clippy::unwrap_used)]

mod common;

use std::io::{Read, Write};
use std::sync::Arc;

use common::*;
use kvbridge_engine::{
    Batch, Block, EngineConfig, ErrorKind, Side, Target, TcpConfig, TransferEngine,
};
use kvbridge_mem::HostBuffer;
use rand::{SeedableRng, rngs::StdRng};

/// Random block sets (1 B ... 16 MiB, unaligned) to several sessions at once.
fn random_sets_to_many_sessions(c: EngineConfig, seed: u64) {
    let initiator = tcp(c.clone());
    let targets: Vec<_> = (0..3).map(|_| tcp(c.clone())).collect();
    let src = patterned(40 << 20, seed);
    register(&initiator, &src);
    let dsts: Vec<HostBuffer> = (0..3).map(|_| HostBuffer::new(24 << 20).unwrap()).collect();
    for (t, d) in targets.iter().zip(&dsts) {
        register(t, d);
    }
    let mut rng = StdRng::seed_from_u64(seed);
    let mut jobs = Vec::new();
    for (i, (t, d)) in targets.iter().zip(&dsts).enumerate() {
        // Give each target its own slice of the source.
        let max = if i == 0 { 16 << 20 } else { 256 << 10 };
        let mut blocks = random_blocks(&mut rng, &src, d, max, 20 << 20);
        let base = (i as u64) * (12 << 20);
        for b in &mut blocks {
            b.src = src.addr() + ((b.src - src.addr() + base) % ((40 << 20) - (16 << 20)));
        }
        blocks.retain(|b| b.src + b.len <= src.addr() + src.len() as u64);
        jobs.push((
            initiator.submit(Target::any(t.session_id()), Batch::Blocks(&blocks)),
            blocks,
        ));
    }
    for ((h, blocks), d) in jobs.iter().zip(&dsts) {
        h.wait().unwrap();
        assert_arrived(blocks, &src, d);
    }
    let received: u64 = targets.iter().map(|t| t.stats().bytes_received).sum();
    assert_eq!(received, initiator.stats().bytes_sent);
}

#[test]
fn random_block_sets_arrive_byte_exact() {
    random_sets_to_many_sessions(cfg(), 11);
}

#[test]
fn random_block_sets_arrive_byte_exact_staged_and_split() {
    // Every byte through the frame / bounce buffers (the device-staging
    // path), small requests (multi-request batches, batch check), one lane.
    let c = EngineConfig {
        tcp: TcpConfig {
            force_staging: true,
            request_bytes: 300_000,
            connections_per_peer: 1,
            pipeline_depth: 3,
            ..TcpConfig::default()
        },
        ..cfg()
    };
    random_sets_to_many_sessions(c, 12);
}

#[test]
fn tiny_blocks_coalesce() {
    let c = EngineConfig {
        tcp: TcpConfig {
            coalesce_threshold: 4096,
            ..TcpConfig::default()
        },
        ..cfg()
    };
    let (a, b) = (tcp(c.clone()), tcp(c));
    let src = patterned(1 << 20, 3);
    let dst = HostBuffer::new(1 << 20).unwrap();
    register(&a, &src);
    register(&b, &dst);
    let blocks: Vec<Block> = (0..20_000u64)
        .map(|i| Block {
            src: src.addr() + i * 7,
            dst: dst.addr() + i * 9,
            len: 1 + i % 7,
        })
        .collect();
    a.batch_transfer_sync(b.session_id(), &blocks).unwrap();
    assert_arrived(&blocks, &src, &dst);
}

#[test]
fn writes_outside_regions_are_refused_single_request() {
    let c = cfg();
    let (a, b) = (tcp(c.clone()), tcp(c));
    let src = patterned(1 << 20, 6);
    let dst = HostBuffer::new(1 << 20).unwrap();
    register(&a, &src);
    register(&b, &dst);
    let blocks = [
        Block {
            src: src.addr(),
            dst: dst.addr(),
            len: 100_000,
        },
        Block {
            src: src.addr(),
            dst: dst.addr() + (1 << 20) - 10,
            len: 11,
        },
    ];
    let e = a.batch_transfer_sync(b.session_id(), &blocks).unwrap_err();
    assert_eq!(
        (e.kind, e.block),
        (ErrorKind::OutOfRegion(Side::Remote), Some(1))
    );
    assert!(dst.as_slice().iter().all(|&x| x == 0));
    // Local sources are checked too, before anything is sent.
    let e = a
        .batch_transfer_sync(
            b.session_id(),
            &[Block {
                src: 64,
                dst: dst.addr(),
                len: 1,
            }],
        )
        .unwrap_err();
    assert_eq!(
        (e.kind, e.block),
        (ErrorKind::OutOfRegion(Side::Local), Some(0))
    );
}

#[test]
fn writes_outside_regions_are_refused_whole_batch() {
    // 512 x 4 KiB = 2 MiB over 64 KiB requests: the batch check refuses it whole.
    let c = EngineConfig {
        tcp: TcpConfig {
            request_bytes: 64 << 10,
            ..TcpConfig::default()
        },
        ..cfg()
    };
    let (a, b) = (tcp(c.clone()), tcp(c));
    let src = patterned(4 << 20, 5);
    let d1 = HostBuffer::new(2 << 20).unwrap();
    let d2 = HostBuffer::new(1 << 20).unwrap();
    register(&a, &src);
    register(&b, &d1);
    register(&b, &d2);
    let mut blocks: Vec<Block> = (0..512u64)
        .map(|i| Block {
            src: src.addr() + i * 4096,
            dst: d1.addr() + i * 4096,
            len: 4096,
        })
        .collect();
    blocks[511].dst = d1.addr() + (2 << 20) - 100;
    let e = a.batch_transfer_sync(b.session_id(), &blocks).unwrap_err();
    assert_eq!(
        (e.kind, e.block),
        (ErrorKind::OutOfRegion(Side::Remote), Some(511))
    );
    assert!(
        d1.as_slice().iter().all(|&x| x == 0),
        "nothing may be written"
    );
    blocks[511].dst = d2.addr();
    a.batch_transfer_sync(b.session_id(), &blocks).unwrap();
    assert_arrived(&blocks[..511], &src, &d1);
    assert_arrived(&blocks[511..], &src, &d2);
}

#[test]
fn receiver_refuses_unchecked_writes_whole() {
    // A request that skips the sender-side batch check (a buggy or hostile
    // peer): the receiver validates every descriptor before writing any byte.
    let (a, b) = (tcp(cfg()), tcp(cfg()));
    let dst = HostBuffer::new(64 << 10).unwrap();
    let other = HostBuffer::new(4096).unwrap();
    register(&b, &dst);
    let ok = vec![0xAB; 1000];
    let e = a
        .debug_raw_write(
            b.session_id(),
            &[
                (dst.addr(), &ok),
                (dst.addr() + 70_000, &ok),
                (other.addr(), &ok),
            ],
        )
        .unwrap_err();
    assert_eq!(
        (e.kind, e.block),
        (ErrorKind::OutOfRegion(Side::Remote), Some(1))
    );
    assert!(dst.as_slice().iter().all(|&x| x == 0));
    assert!(other.as_slice().iter().all(|&x| x == 0));
    a.debug_raw_write(b.session_id(), &[(dst.addr() + 5, &ok)])
        .unwrap();
    assert_eq!(dst.as_slice()[5..1005], ok[..]);
    assert_eq!(b.stats().requests_refused, 1);
}

#[test]
fn cluster_secret_is_checked_both_ways() {
    let with = |s: &str| EngineConfig {
        secret: Some(s.into()),
        ..cfg()
    };
    let target = tcp(with("right"));
    let dst = HostBuffer::new(4096).unwrap();
    register(&target, &dst);
    let mut ok_src = patterned(4096, 1);
    ok_src.as_mut_slice()[0] = 1;
    for (who, kind) in [(Some("wrong"), ErrorKind::Auth), (None, ErrorKind::Auth)] {
        let c = EngineConfig {
            secret: who.map(Into::into),
            ..cfg()
        };
        let a = tcp(c);
        register(&a, &ok_src);
        let e = a
            .batch_transfer_sync(
                target.session_id(),
                &[Block {
                    src: ok_src.addr(),
                    dst: dst.addr(),
                    len: 4096,
                }],
            )
            .unwrap_err();
        assert_eq!(e.kind, kind, "{who:?}: {e}");
        assert_eq!(
            a.probe(target.session_id()).unwrap_err().kind,
            ErrorKind::Auth
        );
    }
    assert!(dst.as_slice().iter().all(|&x| x == 0));
    assert!(target.stats().auth_failures >= 1);
    // A client with a secret does not talk to a receiver without one.
    let open = tcp(cfg());
    let a = tcp(with("right"));
    assert_eq!(
        a.probe(open.session_id()).unwrap_err().kind,
        ErrorKind::Auth
    );
    // Same secret: works.
    register(&a, &ok_src);
    a.batch_transfer_sync(
        target.session_id(),
        &[Block {
            src: ok_src.addr(),
            dst: dst.addr(),
            len: 4096,
        }],
    )
    .unwrap();
    assert_eq!(dst.as_slice(), ok_src.as_slice());
}

#[test]
fn strangers_and_garbage_are_dropped_and_serving_goes_on() {
    let target = tcp(cfg());
    let dst = HostBuffer::new(4096).unwrap();
    register(&target, &dst);
    let mut s = std::net::TcpStream::connect(target.session_id()).unwrap();
    s.write_all(&[0x55; 64]).unwrap();
    let mut buf = Vec::new();
    let _ = s.read_to_end(&mut buf);
    assert!(buf.is_empty(), "no challenge for a non-kvbridge hello");
    assert!(target.stats().bad_frames >= 1);
    let a = tcp(cfg());
    let src = patterned(4096, 2);
    register(&a, &src);
    a.batch_transfer_sync(
        target.session_id(),
        &[Block {
            src: src.addr(),
            dst: dst.addr(),
            len: 4096,
        }],
    )
    .unwrap();
    assert_eq!(dst.as_slice(), src.as_slice());
}

#[test]
fn bad_sessions_and_empty_batches() {
    let a: Arc<dyn TransferEngine> = Arc::new(tcp(cfg()));
    assert!(a.batch_transfer_sync("127.0.0.1:1", &[]).is_ok());
    let src = patterned(4096, 1);
    register(&*a, &src);
    let b = [Block {
        src: src.addr(),
        dst: 0x1000,
        len: 8,
    }];
    assert_eq!(
        a.batch_transfer_sync("nonsense", &b).unwrap_err().kind,
        ErrorKind::InvalidArgument
    );
    // Port 1 on loopback: nothing listens there.
    assert_eq!(
        a.batch_transfer_sync("127.0.0.1:1", &b).unwrap_err().kind,
        ErrorKind::Unreachable
    );
    assert_eq!(
        a.probe("127.0.0.1:1").unwrap_err().kind,
        ErrorKind::Unreachable
    );
    assert!(a.session_id().starts_with("127.0.0.1:"));
    a.batch_deregister(&[src.addr()]).unwrap();
    assert!(a.batch_deregister(&[src.addr()]).is_err());
}

#[test]
fn overlapping_submits_complete() {
    let (a, b) = (tcp(cfg()), tcp(cfg()));
    let src = patterned(8 << 20, 9);
    let dst = HostBuffer::new(8 << 20).unwrap();
    register(&a, &src);
    register(&b, &dst);
    let batches: Vec<Vec<Block>> = (0..8u64)
        .map(|k| {
            (0..16u64)
                .map(|i| {
                    let off = k * (1 << 20) + i * 65536;
                    Block {
                        src: src.addr() + off,
                        dst: dst.addr() + off,
                        len: 65536,
                    }
                })
                .collect()
        })
        .collect();
    let handles: Vec<_> = batches
        .iter()
        .map(|bl| a.submit(Target::any(b.session_id()), Batch::Blocks(bl)))
        .collect();
    for h in &handles {
        while h.poll().is_none() {
            std::thread::yield_now();
        }
        h.wait().unwrap();
    }
    assert_eq!(dst.as_slice(), src.as_slice());
}
