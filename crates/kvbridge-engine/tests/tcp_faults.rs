//! TCP engine under failure: hung and killed peers, probes, restarts, load.
#![allow(clippy::unwrap_used)]

mod common;

use std::time::{Duration, Instant};

use common::*;
use kvbridge_engine::{
    Batch, Block, EngineConfig, ErrorKind, Target, TcpConfig, TcpEngine, TransferEngine,
};
use kvbridge_mem::HostBuffer;
use rand::{Rng, SeedableRng, rngs::StdRng};

fn whole(src: &HostBuffer, dst: &HostBuffer, len: u64) -> Vec<Block> {
    (0..len / (1 << 20))
        .map(|i| Block {
            src: src.addr() + i * (1 << 20),
            dst: dst.addr() + i * (1 << 20),
            len: 1 << 20,
        })
        .collect()
}

#[test]
fn hung_peer_times_out_and_others_keep_working() {
    let c = EngineConfig {
        io_timeout_ms: 400,
        ..cfg()
    };
    let a = tcp(c.clone());
    let (hung, fine) = (tcp(cfg()), tcp(cfg()));
    let src = patterned(64 << 20, 1);
    let d1 = HostBuffer::new(64 << 20).unwrap();
    let d2 = HostBuffer::new(64 << 20).unwrap();
    register(&a, &src);
    register(&hung, &d1);
    register(&fine, &d2);
    hung.debug_freeze(true);
    let t = Instant::now();
    let e = a
        .batch_transfer_sync(hung.session_id(), &whole(&src, &d1, 64 << 20))
        .unwrap_err();
    assert_eq!(e.kind, ErrorKind::Timeout, "{e}");
    assert_eq!(e.session, hung.session_id());
    assert!(
        t.elapsed() < Duration::from_secs(4),
        "took {:?}",
        t.elapsed()
    );
    a.batch_transfer_sync(fine.session_id(), &whole(&src, &d2, 64 << 20))
        .unwrap();
    assert_eq!(d2.as_slice(), src.as_slice());
    // Once it answers again, the same session works (fresh connections).
    hung.debug_freeze(false);
    a.batch_transfer_sync(hung.session_id(), &whole(&src, &d1, 8 << 20))
        .unwrap();
    assert_eq!(d1.as_slice()[..8 << 20], src.as_slice()[..8 << 20]);
}

#[test]
fn peer_killed_mid_batch_fails_fast_and_others_keep_working() {
    let a = tcp(cfg());
    let (victim, fine) = (tcp(cfg()), tcp(cfg()));
    let src = patterned(64 << 20, 2);
    let d1 = HostBuffer::new(64 << 20).unwrap();
    let d2 = HostBuffer::new(64 << 20).unwrap();
    register(&a, &src);
    register(&victim, &d1);
    register(&fine, &d2);
    // The victim stops answering after 16 MiB of a 64 MiB batch.
    victim.debug_freeze_after(16 << 20);
    let h = a.submit(
        Target::any(victim.session_id()),
        Batch::Blocks(&whole(&src, &d1, 64 << 20)),
    );
    let t = Instant::now();
    while victim.stats().bytes_received < 16 << 20 {
        assert!(
            t.elapsed() < Duration::from_secs(20),
            "the batch never started"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    std::thread::sleep(Duration::from_millis(100));
    assert!(h.poll().is_none(), "the batch is stuck in the frozen peer");
    let t = Instant::now();
    victim.shutdown();
    let r = h
        .wait_timeout(Duration::from_secs(4))
        .expect("error well within the io timeout");
    let e = r.unwrap_err();
    assert!(
        matches!(e.kind, ErrorKind::PeerClosed | ErrorKind::Unreachable),
        "{e}"
    );
    assert!(t.elapsed() < Duration::from_secs(4));
    a.batch_transfer_sync(fine.session_id(), &whole(&src, &d2, 64 << 20))
        .unwrap();
    assert_eq!(d2.as_slice(), src.as_slice());
    assert!(a.probe(victim.session_id()).is_err());
}

#[test]
fn probe_sees_death_and_restart_as_a_new_incarnation() {
    let a = tcp(cfg());
    let src = patterned(1 << 20, 3);
    register(&a, &src);
    let first = tcp(cfg());
    let session = first.session_id().to_owned();
    let d1 = HostBuffer::new(1 << 20).unwrap();
    register(&first, &d1);
    let blocks = whole(&src, &d1, 1 << 20);
    a.batch_transfer_sync(&session, &blocks).unwrap();
    a.probe(&session).unwrap();
    let port: u16 = session.rsplit(':').next().unwrap().parse().unwrap();
    drop(first);
    let e = a.probe(&session).unwrap_err();
    assert_eq!(e.kind, ErrorKind::Unreachable, "{e}");
    assert!(a.batch_transfer_sync(&session, &blocks).is_err());

    // Restart on the same port with a different buffer: a new incarnation.
    let second = TcpEngine::new(EngineConfig { port, ..cfg() }).unwrap();
    assert_eq!(second.session_id(), session);
    let d2 = HostBuffer::new(1 << 20).unwrap();
    register(&second, &d2);
    a.probe(&session).unwrap();
    let blocks = whole(&src, &d2, 1 << 20);
    a.batch_transfer_sync(&session, &blocks).unwrap();
    assert_eq!(d2.as_slice(), src.as_slice());

    // And again without a probe in between: pooled connections to the dead
    // incarnation are noticed and replaced, not reused.
    drop(second);
    let third = TcpEngine::new(EngineConfig { port, ..cfg() }).unwrap();
    let d3 = HostBuffer::new(1 << 20).unwrap();
    register(&third, &d3);
    let blocks = whole(&src, &d3, 1 << 20);
    a.batch_transfer_sync(&session, &blocks).unwrap();
    assert_eq!(d3.as_slice(), src.as_slice());
}

#[test]
fn a_thousand_batches_across_eight_peers_in_parallel() {
    let a = tcp(EngineConfig {
        tcp: TcpConfig {
            connections_per_peer: 2,
            ..TcpConfig::default()
        },
        ..cfg()
    });
    let peers: Vec<TcpEngine> = (0..8)
        .map(|_| {
            tcp(EngineConfig {
                tcp: TcpConfig {
                    connections_per_peer: 2,
                    ..TcpConfig::default()
                },
                ..cfg()
            })
        })
        .collect();
    let src = patterned(2 << 20, 4);
    register(&a, &src);
    let dsts: Vec<HostBuffer> = (0..8).map(|_| HostBuffer::new(2 << 20).unwrap()).collect();
    for (p, d) in peers.iter().zip(&dsts) {
        register(p, d);
    }
    std::thread::scope(|s| {
        for (k, (p, d)) in peers.iter().zip(&dsts).enumerate() {
            let (a, src) = (&a, &src);
            s.spawn(move || {
                let mut rng = StdRng::seed_from_u64(k as u64);
                for _ in 0..125 {
                    // Random blocks, each moving source bytes to the same offset.
                    let blocks: Vec<Block> = (0..rng.gen_range(1..24))
                        .map(|_| {
                            let len = rng.gen_range(1..40_000u64);
                            let off = rng.gen_range(0..(2u64 << 20) - len);
                            Block {
                                src: src.addr() + off,
                                dst: d.addr() + off,
                                len,
                            }
                        })
                        .collect();
                    a.batch_transfer_sync(p.session_id(), &blocks).unwrap();
                    for b in &blocks {
                        let o = (b.dst - d.addr()) as usize;
                        let n = b.len as usize;
                        assert!(d.as_slice()[o..o + n] == src.as_slice()[o..o + n]);
                    }
                }
            });
        }
    });
}

#[test]
fn batches_pinned_to_an_incarnation_never_reach_its_successor() {
    let a = tcp(cfg());
    let src = patterned(1 << 20, 9);
    register(&a, &src);
    let first = tcp(cfg());
    let session = first.session_id().to_owned();
    let old = first.incarnation();
    assert_ne!(old, 0);
    let d1 = HostBuffer::new(1 << 20).unwrap();
    register(&first, &d1);
    let blocks = whole(&src, &d1, 1 << 20);
    a.submit(Target::exact(&session, old), Batch::Blocks(&blocks))
        .wait()
        .unwrap();
    assert_eq!(d1.as_slice(), src.as_slice());
    let port: u16 = session.rsplit(':').next().unwrap().parse().unwrap();
    // The peer restarts on the same port and registers memory at addresses
    // the old plan names (here: the very same buffer, the worst case).
    drop(first);
    let second = TcpEngine::new(EngineConfig { port, ..cfg() }).unwrap();
    assert_ne!(second.incarnation(), old);
    let d2 = HostBuffer::new(1 << 20).unwrap();
    register(&second, &d2);
    let stale = whole(&src, &d2, 1 << 20);
    for _ in 0..3 {
        let e = a
            .submit(Target::exact(&session, old), Batch::Blocks(&stale))
            .wait()
            .unwrap_err();
        assert_eq!(e.kind, ErrorKind::PeerRestarted, "{e}");
    }
    assert!(
        d2.as_slice().iter().all(|b| *b == 0),
        "a stale batch was written"
    );
    // Pinned to the new incarnation it goes through.
    a.submit(
        Target::exact(&session, second.incarnation()),
        Batch::Blocks(&stale),
    )
    .wait()
    .unwrap();
    assert_eq!(d2.as_slice(), src.as_slice());
}

/// Bytes of `dst` that hold `src`'s byte at the same offset (a zeroed
/// destination against a random source: about the bytes written).
fn written(src: &HostBuffer, dst: &HostBuffer) -> usize {
    src.as_slice()
        .iter()
        .zip(dst.as_slice())
        .filter(|(s, d)| **s != 0 && s == d)
        .count()
}

/// A batch that failed because its peer stopped reading leaves nothing
/// behind: the requests the sender had queued in the kernel are reset, not
/// delivered once the peer reads again, so no byte of the failed batch is
/// written after its failure was reported (into pages a decode may have
/// handed to another request by then).
#[test]
fn a_failed_batch_writes_nothing_once_its_failure_is_reported() {
    let request = 256usize << 10;
    let c = EngineConfig {
        io_timeout_ms: 400,
        tcp: TcpConfig {
            request_bytes: request,
            ..TcpConfig::default()
        },
        ..cfg()
    };
    let a = tcp(c);
    let hung = tcp(cfg());
    let len = 64u64 << 20;
    let src = patterned(len as usize, 7);
    let dst = HostBuffer::new(len as usize).unwrap();
    register(&a, &src);
    register(&hung, &dst);
    // The peer stops reading after the first MiB: the rest of the batch
    // waits in both kernels' socket buffers.
    hung.debug_freeze_after(1 << 20);
    let e = a
        .batch_transfer_sync(hung.session_id(), &whole(&src, &dst, len))
        .unwrap_err();
    assert_eq!(e.kind, ErrorKind::Timeout, "{e}");
    let at_failure = written(&src, &dst);
    // The peer reads again: whatever was still queued must not land.
    hung.debug_freeze_after(u64::MAX);
    hung.debug_freeze(false);
    let deadline = Instant::now() + Duration::from_secs(5);
    while hung.stats().resets_by_sender == 0 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    std::thread::sleep(Duration::from_millis(300));
    let late = written(&src, &dst) - at_failure;
    assert_eq!(
        late, 0,
        "{late} bytes of the failed batch landed after its failure"
    );
    assert!(hung.stats().resets_by_sender >= 1, "{:?}", hung.stats());
    // The peer is usable again, over a fresh connection.
    let fresh = HostBuffer::new(8 << 20).unwrap();
    register(&hung, &fresh);
    a.batch_transfer_sync(hung.session_id(), &whole(&src, &fresh, 8 << 20))
        .unwrap();
    assert_eq!(fresh.as_slice(), &src.as_slice()[..8 << 20]);
}
