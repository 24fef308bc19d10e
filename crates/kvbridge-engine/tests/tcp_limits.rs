//! The TCP engine against hostile or failing peers (raw sockets playing the
//! peer): the connection cap, the handshake deadline, the idle timeout,
//! large leases, trickled payloads versus deregistration and shutdown,
//! refused batches not leaking, and nothing served before authentication.
#![allow(clippy::unwrap_used)]

mod common;
mod raw;

use std::io::{Read, Write};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use common::*;
use kvbridge_engine::{Block, EngineConfig, ErrorKind, Side, TcpConfig, TcpEngine, TransferEngine};
use kvbridge_mem::HostBuffer;
use raw::*;

#[test]
fn connections_beyond_the_cap_are_closed_at_once() {
    let e = tcp(EngineConfig {
        connect_timeout_ms: 30_000,
        tcp: TcpConfig {
            max_connections: 2,
            ..TcpConfig::default()
        },
        ..cfg()
    });
    // Two connections that say nothing yet: both count as open.
    let first = connect(e.session_id());
    let _second = connect(e.session_id());
    wait_until("two connections open", || e.stats().connections_open == 2);
    // The third is closed at once, without a byte.
    let mut third = connect(e.session_id());
    assert!(
        closed_by_peer(&mut third),
        "the third connection was served"
    );
    let s = e.stats();
    assert_eq!((s.connections_rejected, s.connections_open), (1, 2));
    // A freed slot is usable again.
    drop(first);
    wait_until("a slot freed", || e.stats().connections_open == 1);
    let mut fourth = client(e.session_id(), "me:1");
    fourth.write_all(&header(OP_PING, 0, 1, 0)).unwrap();
    assert_eq!(ack(&mut fourth), (1, STATUS_OK, 0));
    assert_eq!(e.stats().connections_rejected, 1);
}

/// Strangers (no secret) that open connections and never finish a
/// handshake hold at most `max_pending_handshakes` of them: each new one
/// closes the oldest, so descriptors stay bounded long before the connect
/// timeout, and a member still connects and transfers meanwhile.
#[test]
fn strangers_in_their_handshake_hold_a_bounded_share() {
    const PENDING: usize = 4;
    let secret = Some("pending-handshakes-cluster-secret".to_owned());
    let c = EngineConfig {
        connect_timeout_ms: 30_000,
        secret: secret.clone(),
        tcp: TcpConfig {
            max_pending_handshakes: PENDING,
            ..TcpConfig::default()
        },
        ..cfg()
    };
    let e = tcp(c.clone());
    let mut strangers: Vec<_> = (0..40).map(|_| connect(e.session_id())).collect();
    wait_until("all but the newest closed", || {
        e.stats().handshakes_evicted == 40 - PENDING as u64
    });
    let s = e.stats();
    assert_eq!(
        (s.connections_open, s.handshakes_pending),
        (PENDING as u64, PENDING as u64)
    );
    // The evicted ones were closed, not left to the 30 s deadline.
    let closed = strangers
        .iter_mut()
        .take(40 - PENDING)
        .map(closed_by_peer)
        .filter(|c| *c)
        .count();
    assert_eq!(closed, 40 - PENDING);
    // A member connects, authenticates and transfers during the flood.
    let member = tcp(c);
    let src = patterned(1 << 20, 7);
    let dst = HostBuffer::new(1 << 20).unwrap();
    register(&member, &src);
    register(&e, &dst);
    let blocks = [Block {
        src: src.addr(),
        dst: dst.addr(),
        len: 1 << 20,
    }];
    member.batch_transfer_sync(e.session_id(), &blocks).unwrap();
    assert_eq!(dst.as_slice(), src.as_slice());
    assert_eq!(e.stats().handshake_timeouts, 0);
}

#[test]
fn a_trickled_hello_is_dropped_at_the_handshake_deadline() {
    let e = tcp(EngineConfig {
        connect_timeout_ms: 1_000,
        ..cfg()
    });
    let mut s = connect(e.session_id());
    let mut w = s.try_clone().unwrap();
    // One byte every 100 ms: each read makes progress well within the
    // connect timeout, but the whole hello would take over 5 s.
    let writer = std::thread::spawn(move || {
        for byte in hello("me:1", 0) {
            if w.write_all(&[byte]).is_err() {
                return;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    });
    assert!(
        closed_by_peer(&mut s),
        "the server answered a hello that took longer than the connect timeout"
    );
    wait_until("handshake timeout counted", || {
        e.stats().handshake_timeouts == 1
    });
    writer.join().unwrap();
}

#[test]
fn an_idle_connection_is_closed_and_senders_reconnect() {
    let c = EngineConfig {
        tcp: TcpConfig {
            idle_timeout_ms: 300,
            ..TcpConfig::default()
        },
        ..cfg()
    };
    let e = tcp(c.clone());
    let mut s = client(e.session_id(), "me:1");
    s.write_all(&header(OP_PING, 0, 1, 0)).unwrap();
    assert_eq!(ack(&mut s), (1, STATUS_OK, 0));
    // No more requests: closed after the idle timeout.
    assert!(closed_by_peer(&mut s), "an idle connection stayed open");
    wait_until("idle close counted", || e.stats().idle_closed == 1);
    // An engine's pooled connections idle out too; its next batch reconnects.
    let a = tcp(c);
    let src = patterned(1 << 20, 3);
    let dst = HostBuffer::new(1 << 20).unwrap();
    register(&a, &src);
    register(&e, &dst);
    let blocks = [Block {
        src: src.addr(),
        dst: dst.addr(),
        len: 1 << 20,
    }];
    a.batch_transfer_sync(e.session_id(), &blocks).unwrap();
    let before = e.stats().idle_closed;
    wait_until("pooled connection idled out", || {
        e.stats().idle_closed > before
    });
    a.batch_transfer_sync(e.session_id(), &blocks).unwrap();
    assert_eq!(dst.as_slice(), src.as_slice());
}

#[test]
fn a_lease_of_many_regions_is_served_and_held() {
    // `Lease` handling is linear in the number of regions (it was quadratic:
    // a duplicate check against everything held); this checks a lease of
    // the most regions a request may name, twice, is answered and held.
    const N: u32 = 1 << 16;
    let e = tcp(cfg());
    let buf = HostBuffer::new(1 << 20).unwrap();
    register(&e, &buf);
    let mut s = client(e.session_id(), "me:1");
    let lease = |seq: u64, ranges: &[(u64, u64)]| {
        let mut m = header(OP_LEASE, ranges.len() as u32, seq, 0);
        for &(a, l) in ranges {
            desc(&mut m, a, l);
        }
        m
    };
    let ranges: Vec<(u64, u64)> = (0..u64::from(N))
        .map(|i| (buf.addr() + i * 16, 16))
        .collect();
    s.write_all(&lease(1, &ranges)).unwrap();
    assert_eq!(ack(&mut s), (1, STATUS_OK, 0));
    s.write_all(&lease(2, &ranges)).unwrap();
    assert_eq!(ack(&mut s), (2, STATUS_OK, 0));
    // A lease naming a range outside the regions is refused, with its index.
    let bad = [
        (buf.addr(), 16),
        (buf.addr() + (1 << 20) - 8, 16),
        (buf.addr(), 1),
    ];
    s.write_all(&lease(3, &bad)).unwrap();
    assert_eq!(ack(&mut s), (3, STATUS_OUT_OF_REGION, 1));
    assert_eq!(e.stats().requests_refused, 1);
    // The hold is real: deregistering the buffer revokes it and waits for
    // our release.
    let e = Arc::new(e);
    let (e2, addr) = (e.clone(), buf.addr());
    let dereg = std::thread::spawn(move || e2.batch_deregister(&[addr]));
    assert_eq!(ack(&mut s), (0, STATUS_REVOKED, 0));
    assert!(
        !dereg.is_finished(),
        "deregistration did not wait for the release"
    );
    s.write_all(&header(OP_RELEASE, 0, 4, 0)).unwrap();
    assert_eq!(ack(&mut s), (4, STATUS_OK, 0));
    dereg.join().unwrap().unwrap();
}

/// A raw client that started a `Write` of all of `dst` and trickles its
/// payload (one byte per 20 ms) until `stop` or the connection fails.
fn trickling_writer(
    e: &TcpEngine,
    dst: &HostBuffer,
    stop: Arc<AtomicBool>,
) -> std::thread::JoinHandle<()> {
    let mut s = client(e.session_id(), "me:1");
    let mut m = header(OP_WRITE, 1, 1, dst.len() as u64);
    desc(&mut m, dst.addr(), dst.len() as u64);
    m.extend_from_slice(&[0xab; 1000]);
    s.write_all(&m).unwrap();
    wait_until("the first payload bytes landed", || peek(dst, 999) == 0xab);
    std::thread::spawn(move || {
        while !stop.load(Ordering::Acquire) {
            if s.write_all(&[0xcd]).is_err() {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    })
}

/// Run `f` on a thread; its result, or a panic if it takes over 10 s (a
/// liveness bound: before, it waited for the trickling peer unboundedly).
fn within_10s<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> T {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || drop(tx.send(f())));
    rx.recv_timeout(Duration::from_secs(10))
        .expect("blocked behind a peer trickling its payload")
}

#[test]
fn a_trickled_payload_does_not_hold_up_deregistration() {
    let e = Arc::new(tcp(cfg()));
    let dst = HostBuffer::new(1 << 20).unwrap();
    register(&*e, &dst);
    let stop = Arc::new(AtomicBool::new(false));
    let writer = trickling_writer(&e, &dst, stop.clone());
    let (e2, addr) = (e.clone(), dst.addr());
    within_10s(move || e2.batch_deregister(&[addr])).unwrap();
    // Deregistered: nothing more lands, the request is abandoned.
    let after = snapshot(&dst, 1000..1200);
    wait_until("request abandoned", || e.stats().requests_aborted == 1);
    std::thread::sleep(Duration::from_millis(200));
    assert_eq!(
        snapshot(&dst, 1000..1200),
        after,
        "bytes landed after deregistration"
    );
    stop.store(true, Ordering::Release);
    writer.join().unwrap();
}

#[test]
fn a_trickled_payload_does_not_hold_up_shutdown() {
    let e = Arc::new(tcp(cfg()));
    let dst = HostBuffer::new(1 << 20).unwrap();
    register(&*e, &dst);
    let stop = Arc::new(AtomicBool::new(false));
    let writer = trickling_writer(&e, &dst, stop.clone());
    let e2 = e.clone();
    within_10s(move || e2.shutdown());
    let after = snapshot(&dst, 1000..1200);
    std::thread::sleep(Duration::from_millis(200));
    assert_eq!(
        snapshot(&dst, 1000..1200),
        after,
        "bytes landed after shutdown"
    );
    stop.store(true, Ordering::Release);
    writer.join().unwrap();
}

#[test]
fn refused_batches_of_many_requests_do_not_leak() {
    let a = tcp(EngineConfig {
        tcp: TcpConfig {
            request_bytes: 4096,
            ..TcpConfig::default()
        },
        ..cfg()
    });
    let b = tcp(cfg());
    let src = patterned(64 << 10, 5);
    let dst = HostBuffer::new(64 << 10).unwrap();
    register(&a, &src);
    register(&b, &dst);
    // 16 requests (so a `Check` first); the last block lies outside `dst`.
    let mut blocks: Vec<Block> = (0..16)
        .map(|i| Block {
            src: src.addr() + i * 4096,
            dst: dst.addr() + i * 4096,
            len: 4096,
        })
        .collect();
    for _ in 0..20 {
        blocks[15].dst = dst.addr() + (64 << 10) - 100;
        let e = a.batch_transfer_sync(b.session_id(), &blocks).unwrap_err();
        assert_eq!(e.kind, ErrorKind::OutOfRegion(Side::Remote), "{e}");
        assert_eq!(e.block, Some(15));
        blocks[15].dst = dst.addr() + 15 * 4096;
        a.batch_transfer_sync(b.session_id(), &blocks).unwrap();
    }
    assert_eq!(dst.as_slice(), src.as_slice());
    // Every batch state is gone once its handle and requests are.
    wait_until("batch states freed", || a.stats().live_batches == 0);
    assert_eq!(b.stats().requests_refused, 20);
}

#[test]
fn nothing_is_served_before_authentication() {
    let secret = "s3cret-s3cret-s3cret";
    let e = tcp(EngineConfig {
        secret: Some(secret.into()),
        ..cfg()
    });
    let dst = HostBuffer::new(4096).unwrap();
    register(&e, &dst);
    let refusal = {
        let mut v = VERDICT_AUTH.to_le_bytes().to_vec();
        v.extend_from_slice(&[0; 4]);
        v
    };
    // Requests pipelined behind a bogus proof, or sent instead of one:
    // neither a `Check` answer, an `Exports` table nor a ping ack comes back.
    let requests = {
        let mut m = header(OP_CHECK, 1, 1, 0);
        desc(&mut m, dst.addr(), 16);
        m.extend_from_slice(&header(OP_EXPORTS, 0, 2, 0));
        m.extend_from_slice(&header(OP_PING, 0, 3, 0));
        m.extend_from_slice(&header(OP_WRITE, 1, 4, 4));
        desc(&mut m, dst.addr(), 4);
        m.extend_from_slice(b"evil");
        m
    };
    for (i, proof) in [Some([9u8; 32]), None].into_iter().enumerate() {
        for flags in [FLAG_SECRET, 0] {
            let mut s = connect(e.session_id());
            s.write_all(&hello("me:1", flags)).unwrap();
            let mut ch = [0u8; CHALLENGE_LEN];
            s.read_exact(&mut ch).unwrap();
            let mut m = proof.map(|p| p.to_vec()).unwrap_or_default();
            m.extend_from_slice(&requests);
            s.write_all(&m).unwrap();
            let mut rest = Vec::new();
            let _ = s.read_to_end(&mut rest);
            assert_eq!(rest, refusal, "case {i}, flags {flags}");
        }
    }
    let s = e.stats();
    assert_eq!((s.auth_failures, s.bytes_received), (4, 0));
    assert!(dst.as_slice().iter().all(|&b| b == 0));
}
