//! Aborts racing in-flight transfers: once every prefill rank has
//! acknowledged an abort, no byte of the room lands any more.
// Test code: a failed unwrap is a failed test.
#![allow(clippy::unwrap_used)]

mod common;

use std::time::{Duration, Instant};

use common::*;
use kvbridge_roles::KvPoll;
use rand::{Rng, SeedableRng};

#[test]
fn no_write_lands_after_abort_ack() {
    let mut model = tiny_model(false, 8);
    model.head_bytes = 512;
    let mut cluster = Cluster::new(model, 1, 1, 1, 512);
    let addr = cluster.bootstrap.local_addr().to_string();
    let mut rng = rand::rngs::StdRng::seed_from_u64(7);
    let mut aborted_mid_flight = 0;
    for iteration in 0..20u64 {
        let room = 1000 + iteration;
        let n = 64;
        let base = ((iteration % 4) * 120) as i32;
        let src: Vec<i32> = (0..n).map(|i| base + i).collect();
        let dst: Vec<i32> = (0..n).map(|i| 500 - base - i).collect();
        let (decode, dpools) = &mut cluster.decode[0];
        let mut rx = decode.receiver(&addr, room);
        assert_eq!(rx.init(0), KvPoll::WaitingForInput);
        rx.send_metadata(&dst, 1, &[], None);
        let (prefill, ppools) = &mut cluster.prefill[0];
        ppools.fill(room, &src, 1);
        let mut tx = prefill.sender(room);
        tx.init(n as u64, Some(1));
        wait_for(Duration::from_secs(10), KvPoll::WaitingForInput, || {
            tx.poll()
        });
        for pages in src.chunks(8) {
            tx.send(pages, None, None).unwrap();
        }
        std::thread::sleep(Duration::from_micros(rng.gen_range(0..4000)));
        rx.abort();
        let deadline = Instant::now() + Duration::from_secs(10);
        while !rx.abort_acknowledged() {
            assert!(Instant::now() < deadline, "room {room}: no ABORT_ACK");
            std::thread::sleep(Duration::from_millis(1));
        }
        // The pages may be reused now: poison them and make sure they stay so.
        dpools.poison(&dst, 0xee);
        let prefill_state = wait_terminal(Duration::from_secs(10), || tx.poll());
        std::thread::sleep(Duration::from_millis(20));
        assert!(
            dpools.still_poisoned(&dst, 0xee),
            "room {room}: a write landed after the ABORT_ACK"
        );
        if prefill_state == KvPoll::Failed {
            aborted_mid_flight += 1;
        }
        assert_eq!(rx.poll(), KvPoll::Failed);
        let err = rx.failure_exception();
        assert_eq!(err.reason, "Aborted by AbortReq.");
        tx.clear();
    }
    // The random delays must actually have hit transfers in flight.
    assert!(
        aborted_mid_flight > 3,
        "only {aborted_mid_flight} aborts hit a live transfer"
    );
    cluster.shutdown();
}

#[test]
fn abort_before_any_chunk_fails_the_prefill_room() {
    let mut cluster = Cluster::new(tiny_model(true, 2), 1, 1, 1, 32);
    let addr = cluster.bootstrap.local_addr().to_string();
    let (decode, _) = &mut cluster.decode[0];
    let mut rx = decode.receiver(&addr, 5);
    rx.init(0);
    rx.send_metadata(&[1, 2], 0, &[], None);
    let (prefill, _) = &mut cluster.prefill[0];
    let mut tx = prefill.sender(5);
    tx.init(2, Some(0));
    wait_for(Duration::from_secs(10), KvPoll::WaitingForInput, || {
        tx.poll()
    });
    rx.abort();
    let deadline = Instant::now() + Duration::from_secs(10);
    while !rx.abort_acknowledged() {
        assert!(Instant::now() < deadline);
        std::thread::sleep(Duration::from_millis(1));
    }
    assert_eq!(tx.poll(), KvPoll::Failed);
    // Chunks after the abort are not sent; the failure carries the reason.
    tx.send(&[1, 2], None, None).unwrap();
    let err = tx.failure_exception();
    assert!(err.reason.contains("Aborted"), "{err}");
    assert!(!err.is_from_another_rank);
    cluster.shutdown();
}

/// One prefill rank fails the room (a chunk it cannot plan): the decode
/// tells every prefill rank to stop, and once they all acknowledged, the
/// other rank writes nothing more into the pages (which may be reused).
#[test]
fn a_failed_rank_stops_the_other_ranks_before_pages_are_reused() {
    let mut cluster = Cluster::new(tiny_model(false, 2), 2, 1, 1, 64);
    let addr = cluster.bootstrap.local_addr().to_string();
    let (room, src, dst) = (77u64, [3, 4, 5, 6], [20, 21, 22, 23]);
    let mut rx = cluster.decode[0].0.receiver(&addr, room);
    assert_eq!(rx.init(0), KvPoll::WaitingForInput);
    rx.send_metadata(&dst, 1, &[], None);
    let mut senders = Vec::new();
    for (prefill, pools) in &mut cluster.prefill {
        pools.fill(room, &src, 1);
        let mut tx = prefill.sender(room);
        tx.init(src.len() as u64, Some(1));
        wait_for(Duration::from_secs(10), KvPoll::WaitingForInput, || {
            tx.poll()
        });
        senders.push(tx);
    }
    // Rank 0 fails: a negative page index cannot be planned.
    senders[0].send(&[-1, 4, 5, 6], None, None).unwrap();
    assert_eq!(
        wait_terminal(Duration::from_secs(10), || rx.poll()),
        KvPoll::Failed
    );
    let deadline = Instant::now() + Duration::from_secs(10);
    while !rx.abort_acknowledged() {
        assert!(Instant::now() < deadline, "no ABORT_ACK from every rank");
        std::thread::sleep(Duration::from_millis(1));
    }
    // Rank 1 was told: its room failed, and its chunk writes nothing.
    assert_eq!(senders[1].poll(), KvPoll::Failed);
    let dpools = &mut cluster.decode[0].1;
    dpools.poison(&dst, 0xee);
    senders[1].send(&src, None, None).unwrap();
    std::thread::sleep(Duration::from_millis(50));
    assert!(
        dpools.still_poisoned(&dst, 0xee),
        "the other rank wrote after its ABORT_ACK"
    );
    let err = rx.failure_exception();
    assert!(err.reason.contains("cannot plan"), "{err}");
    assert!(senders[1].failure_exception().reason.contains("Aborted"));
    cluster.shutdown();
}

/// The prefill aborts a room (`KVSender.abort()`) after its decode sent
/// the destinations: the decode is told Failed (sglang's status message)
/// and concludes at once, not at its waiting timeout; its ABORT is then
/// acknowledged, so the pages may be reused.
#[test]
fn a_prefill_abort_fails_the_decode_room_at_once() {
    let mut model = tiny_model(false, 4);
    model.head_bytes = 512;
    let mut cluster = Cluster::new(model, 1, 1, 1, 256);
    let addr = cluster.bootstrap.local_addr().to_string();
    // Twice: before any chunk, and with chunks in flight.
    for (room, chunks) in [(91u64, 0usize), (92, 6)] {
        let src: Vec<i32> = (0..64).collect();
        let dst: Vec<i32> = (100..164).collect();
        let mut rx = cluster.decode[0].0.receiver(&addr, room);
        assert_eq!(rx.init(0), KvPoll::WaitingForInput);
        rx.send_metadata(&dst, 1, &[], None);
        let (prefill, pools) = &mut cluster.prefill[0];
        pools.fill(room, &src, 1);
        let mut tx = prefill.sender(room);
        tx.init(src.len() as u64, Some(1));
        assert_eq!(
            wait_for(Duration::from_secs(10), KvPoll::WaitingForInput, || tx
                .poll()),
            KvPoll::WaitingForInput
        );
        for pages in src.chunks(8).take(chunks) {
            tx.send(pages, None, None).unwrap();
        }
        tx.abort();
        let started = Instant::now();
        let status = wait_terminal(Duration::from_secs(10), || rx.poll());
        assert_eq!(status, KvPoll::Failed, "room {room}");
        assert!(
            started.elapsed() < Duration::from_secs(2),
            "room {room}: the decode concluded after {:?} (its waiting timeout is 20 s)",
            started.elapsed()
        );
        let deadline = Instant::now() + Duration::from_secs(10);
        while !rx.abort_acknowledged() {
            assert!(Instant::now() < deadline, "room {room}: no ABORT_ACK");
            std::thread::sleep(Duration::from_millis(1));
        }
        let err = rx.failure_exception();
        assert!(err.reason.contains("Aborted"), "room {room}: {err}");
        assert_eq!(tx.poll(), KvPoll::Failed);
        tx.clear();
    }
    cluster.shutdown();
}

/// One decode rank aborts a room before the prefill has heard from every
/// decode rank of it (so before the prefill rank has the room at all): the
/// ACK is sent at once, and the room must stay failed there. The other
/// rank's request for it is answered Failed at once (it used to wait out
/// its room timeout for KV that never came), the prefill's sender polls
/// Failed, and nothing is written into the aborted rank's pages after its
/// ACK (the room used to complete with the stale destination).
#[test]
fn a_room_aborted_before_the_prefill_knew_it_stays_failed() {
    let mut cluster = Cluster::new(tiny_model(false, 2), 1, 1, 2, 32);
    let addr = cluster.bootstrap.local_addr().to_string();
    let dst = [3, 4];
    let snapshot = cluster.decode[0].1.verify(77, &dst, 0);
    let mut r0 = cluster.decode[0].0.receiver(&addr, 77);
    assert_eq!(r0.init(0), KvPoll::WaitingForInput);
    r0.send_metadata(&dst, 0, &[], None);
    r0.abort();
    let deadline = Instant::now() + Duration::from_secs(10);
    while !r0.abort_acknowledged() {
        assert!(Instant::now() < deadline, "abort never acknowledged");
        std::thread::sleep(Duration::from_millis(1));
    }
    r0.clear();
    let mut r1 = cluster.decode[1].0.receiver(&addr, 77);
    assert_eq!(r1.init(0), KvPoll::WaitingForInput);
    r1.send_metadata(&dst, 0, &[], None);
    let (prefill, ppools) = &mut cluster.prefill[0];
    ppools.fill(77, &[1, 2], 0);
    let mut tx = prefill.sender(77);
    tx.init(2, Some(0));
    let _ = tx.send(&[1, 2], None, None);
    assert_eq!(
        wait_terminal(Duration::from_secs(10), || tx.poll()),
        KvPoll::Failed
    );
    assert_eq!(
        wait_terminal(Duration::from_secs(10), || r1.poll()),
        KvPoll::Failed
    );
    assert!(
        r1.failure_exception().reason.contains("Aborted"),
        "{}",
        r1.failure_exception()
    );
    std::thread::sleep(Duration::from_millis(200));
    let after = cluster.decode[0].1.verify(77, &dst, 0);
    assert_eq!(
        after.mismatched, snapshot.mismatched,
        "written after the ACK"
    );
    r1.clear();
    tx.clear();
    cluster.shutdown();
}

/// Four decode ranks: rank 1 and rank 0 asked for the room, rank 0
/// aborted it before ranks 2 and 3 asked (so before the prefill rank
/// entered it): rank 1 is told Failed at once instead of waiting out its
/// room timeout.
#[test]
fn an_early_abort_tells_the_ranks_already_waiting() {
    let cluster = Cluster::new(tiny_model(false, 2), 1, 1, 4, 32);
    let addr = cluster.bootstrap.local_addr().to_string();
    let mut r1 = cluster.decode[1].0.receiver(&addr, 78);
    assert_eq!(r1.init(0), KvPoll::WaitingForInput);
    r1.send_metadata(&[5, 6], 0, &[], None);
    let mut r0 = cluster.decode[0].0.receiver(&addr, 78);
    assert_eq!(r0.init(0), KvPoll::WaitingForInput);
    r0.send_metadata(&[5, 6], 0, &[], None);
    r0.abort();
    let started = Instant::now();
    assert_eq!(
        wait_terminal(Duration::from_secs(10), || r1.poll()),
        KvPoll::Failed
    );
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "{:?}",
        started.elapsed()
    );
    let reason = r1.failure_exception().reason;
    assert!(reason.contains("another decode rank"), "{reason}");
    r1.clear();
    r0.clear();
    cluster.shutdown();
}
