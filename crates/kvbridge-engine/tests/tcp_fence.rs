//! Fencing a peer (`TransferEngine::fence_peer`): its batches fail with a
//! typed error and write nothing, until it is unfenced; a fence waits for
//! the write in progress; the same for the loopback engine.
#![allow(clippy::unwrap_used)]

mod common;
mod raw;

use std::io::Write;
use std::sync::Arc;
use std::time::Duration;

use common::*;
use kvbridge_engine::{Block, EngineConfig, ErrorKind, LoopbackEngine, TransferEngine};
use kvbridge_mem::HostBuffer;
use raw::*;

const LEN: usize = 1 << 20;

/// Blocks moving all of `src` into `dst`, in 64 KiB pieces.
fn all(src: &HostBuffer, dst: &HostBuffer) -> Vec<Block> {
    (0..(LEN as u64 >> 16))
        .map(|i| Block {
            src: src.addr() + (i << 16),
            dst: dst.addr() + (i << 16),
            len: 1 << 16,
        })
        .collect()
}

fn fenced_peer_writes_nothing_until_unfenced(c: EngineConfig) {
    let (a, b, other) = (tcp(c.clone()), tcp(c.clone()), tcp(c));
    let src = patterned(LEN, 21);
    let src2 = patterned(LEN, 22);
    let dst = HostBuffer::new(LEN).unwrap();
    register(&a, &src);
    register(&a, &src2);
    register(&other, &src2);
    register(&b, &dst);
    // Connections from `a` are open and pooled when the fence comes.
    a.batch_transfer_sync(b.session_id(), &all(&src, &dst))
        .unwrap();
    assert_eq!(b.fence_peer(a.session_id()), Ok(true));
    // Its batches fail, typed, and write nothing. (The first may meet a
    // pooled connection the fence closed under it.)
    let first = a
        .batch_transfer_sync(b.session_id(), &all(&src2, &dst))
        .unwrap_err();
    assert!(
        matches!(first.kind, ErrorKind::Refused | ErrorKind::PeerClosed),
        "{first}"
    );
    let e = a
        .batch_transfer_sync(b.session_id(), &all(&src2, &dst))
        .unwrap_err();
    assert_eq!(e.kind, ErrorKind::Refused, "{e}");
    assert!(e.detail.contains("fenced"), "{e}");
    assert_eq!(dst.as_slice(), src.as_slice(), "a fenced peer wrote");
    assert!(b.stats().fenced_refusals >= 1);
    // Other peers are not affected.
    other
        .batch_transfer_sync(b.session_id(), &all(&src2, &dst))
        .unwrap();
    assert_eq!(dst.as_slice(), src2.as_slice());
    // Unfenced, it works again.
    b.unfence_peer(a.session_id());
    a.batch_transfer_sync(b.session_id(), &all(&src, &dst))
        .unwrap();
    assert_eq!(dst.as_slice(), src.as_slice());
}

#[test]
fn fenced_peer_writes_nothing_until_unfenced_open() {
    fenced_peer_writes_nothing_until_unfenced(cfg());
}

#[test]
fn fenced_peer_writes_nothing_until_unfenced_with_secret() {
    // In secret mode the session a peer announces is covered by its proof.
    fenced_peer_writes_nothing_until_unfenced(EngineConfig {
        secret: Some("s3cret-s3cret-s3cret".into()),
        ..cfg()
    });
}

#[test]
fn a_fence_waits_for_the_write_in_progress() {
    let b = Arc::new(tcp(cfg()));
    let dst = HostBuffer::new(4096).unwrap();
    register(&*b, &dst);
    // A peer announcing itself as "x:1" is in the middle of a write.
    let mut s = client(b.session_id(), "x:1");
    let mut m = header(OP_WRITE, 1, 1, 4096);
    desc(&mut m, dst.addr(), 4096);
    m.extend_from_slice(&[0x5a; 2048]);
    s.write_all(&m).unwrap();
    wait_until("half the payload landed", || peek(&dst, 2047) == 0x5a);
    let b2 = b.clone();
    let fence = std::thread::spawn(move || b2.fence_peer("x:1"));
    std::thread::sleep(Duration::from_millis(300));
    assert!(
        !fence.is_finished(),
        "the fence returned while a write of the peer was in progress"
    );
    // Another peer is not held up meanwhile.
    let mut other = client(b.session_id(), "y:1");
    other.write_all(&header(OP_PING, 0, 1, 0)).unwrap();
    assert_eq!(ack(&mut other), (1, STATUS_OK, 0));
    // The write finishes, is acknowledged, then the fence returns.
    s.write_all(&[0x5a; 2048]).unwrap();
    assert_eq!(ack(&mut s), (1, STATUS_OK, 0));
    assert_eq!(fence.join().unwrap(), Ok(true));
    assert!(dst.as_slice().iter().all(|&x| x == 0x5a));
    // Its connection is closed; a new one is refused at the handshake.
    assert!(closed_by_peer(&mut s));
    let mut again = connect(b.session_id());
    assert_eq!(handshake(&mut again, "x:1"), VERDICT_FENCED);
    assert!(b.stats().fenced_refusals >= 1);
    // Unfenced, it may connect and write again.
    b.unfence_peer("x:1");
    let mut s = client(b.session_id(), "x:1");
    let mut m = header(OP_WRITE, 1, 2, 16);
    desc(&mut m, dst.addr(), 16);
    m.extend_from_slice(&[1; 16]);
    s.write_all(&m).unwrap();
    assert_eq!(ack(&mut s), (2, STATUS_OK, 0));
    assert_eq!(&dst.as_slice()[..16], &[1; 16]);
}

#[test]
fn loopback_fence_refuses_writes_until_unfenced() {
    let (a, b) = (LoopbackEngine::new(), LoopbackEngine::new());
    let src = patterned(4096, 23);
    let dst = HostBuffer::new(4096).unwrap();
    register(&a, &src);
    register(&b, &dst);
    let blocks = [Block {
        src: src.addr(),
        dst: dst.addr(),
        len: 4096,
    }];
    assert_eq!(b.fence_peer(a.session_id()), Ok(true));
    let e = a.batch_transfer_sync(b.session_id(), &blocks).unwrap_err();
    assert_eq!(e.kind, ErrorKind::Refused, "{e}");
    assert!(
        dst.as_slice().iter().all(|&x| x == 0),
        "a fenced peer wrote"
    );
    b.unfence_peer(a.session_id());
    a.batch_transfer_sync(b.session_id(), &blocks).unwrap();
    assert_eq!(dst.as_slice(), src.as_slice());
}
