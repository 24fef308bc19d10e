//! The staging path under pressure and faults: a ring that wraps under
//! many concurrent rooms, a full ring as back-pressure (and its deadline),
//! aborts before, during and while waiting for ring space, a decode
//! restarted mid-stream, and staging enabled on one side only.
// Test code: a failed unwrap is a failed test.
#![allow(clippy::unwrap_used)]

mod common;

use std::time::{Duration, Instant};

use common::staged::*;
use common::*;
use kvbridge_roles::synthetic::{RankPools, RankSpec};
use kvbridge_roles::{KvPoll, StagingConfig, StagingMode};

fn decode_staged(c: &Cluster) -> u64 {
    c.decode
        .iter()
        .map(|(m, _)| m.metrics().staged_bytes.get())
        .sum()
}

fn concurrent(prefill_tp: u64, decode_tp: u64) {
    // 2 KiB..16 KiB per chunk of 2 pages; a 20 KiB ring wraps every few chunks.
    let config = staging(8, 20 << 10, T);
    let mut c = Cluster::staged(tiny_model(false, 2), prefill_tp, decode_tp, 64, config);
    let mut rooms: Vec<Room> = (0..6u64)
        .map(|k| {
            let src = (0..9).map(|i| (k * 10 + i) as i32).collect();
            let dst = (0..9).map(|i| (63 - k * 10 - i) as i32).collect();
            open(&mut c, 100 + k, src, dst, k)
        })
        .collect();
    for r in &mut rooms {
        r.send_all(3);
    }
    for r in rooms {
        r.finish_ok(&c);
    }
    assert!(
        decode_staged(&c) > 3 * (20 << 10),
        "the ring wrapped several times"
    );
    assert_eq!(allocations(&c), 0, "ring space left held");
    c.shutdown();
}

#[test]
fn many_concurrent_rooms_wrap_the_ring_tp_2_to_4() {
    concurrent(2, 4);
}

#[test]
fn many_concurrent_rooms_wrap_the_ring_tp_4_to_2() {
    concurrent(4, 2);
}

/// TP 2 -> 1: a chunk of 2 pages is 16 KiB, the ring exactly one chunk.
fn one_chunk_ring(wait: Duration) -> Cluster {
    Cluster::staged(tiny_model(false, 2), 2, 1, 64, staging(8, 16 << 10, wait))
}

#[test]
fn a_full_ring_is_back_pressure_not_failure() {
    let mut c = one_chunk_ring(T);
    let mut a = open(&mut c, 1, vec![1, 2], vec![10, 11], 0);
    wait_allocations(&c, 1);
    // B's chunk wraps onto A's, which is never written until A is sent.
    let mut b = open(&mut c, 2, vec![3, 4], vec![12, 13], 1);
    wait_allocations(&c, 2);
    b.send_all(2);
    std::thread::sleep(Duration::from_millis(300));
    for t in &mut b.tx {
        assert!(t.poll() < KvPoll::Success, "B went ahead over A's chunk");
    }
    a.send_all(2);
    a.finish_ok(&c);
    b.finish_ok(&c);
    assert_eq!(allocations(&c), 0);
    c.shutdown();
}

#[test]
fn a_ring_full_past_the_deadline_fails_the_room_with_a_reason() {
    let mut c = one_chunk_ring(Duration::from_millis(500));
    let a = open(&mut c, 1, vec![1, 2], vec![10, 11], 0);
    wait_allocations(&c, 1);
    let mut b = open(&mut c, 2, vec![3, 4], vec![12, 13], 1);
    wait_allocations(&c, 2);
    b.send_all(2);
    for t in &mut b.tx {
        assert_eq!(wait_terminal(T, || t.poll()), KvPoll::Failed);
        let e = t.failure_exception();
        assert!(e.reason.contains("staging ring stayed full"), "{e}");
    }
    for r in &mut b.rx {
        assert_eq!(wait_terminal(T, || r.poll()), KvPoll::Failed);
        r.clear();
    }
    a.abort_from_decode();
    assert_eq!(allocations(&c), 0, "aborted rooms' ring space reclaimed");
    c.shutdown();
}

#[test]
fn aborts_in_every_staging_state_reclaim_the_ring() {
    let mut c = one_chunk_ring(T);
    // Allocated, nothing sent.
    let a = open(&mut c, 1, vec![1, 2, 3, 4], vec![10, 11, 12, 13], 0);
    wait_allocations(&c, 2);
    a.abort_from_decode();
    assert_eq!(allocations(&c), 0);

    // Waiting for ring space behind another room's allocation.
    let mut hold = open(&mut c, 2, vec![1, 2], vec![10, 11], 0);
    wait_allocations(&c, 1);
    let mut w = open(&mut c, 3, vec![3, 4], vec![12, 13], 1);
    wait_allocations(&c, 2);
    w.send_all(2);
    std::thread::sleep(Duration::from_millis(200));
    w.abort_from_decode();
    hold.send_all(2);
    hold.finish_ok(&c);
    assert_eq!(allocations(&c), 0);

    // Mid-stream: the first chunk scattered, then the abort; nothing is
    // scattered after it, whatever the prefill still sends.
    let mut m = open(&mut c, 4, vec![5, 6, 7, 8], vec![20, 21, 22, 23], 2);
    m.send(0, 2, 2);
    let deadline = Instant::now() + T;
    while c.decode[0].1.verify_kv(4, &[20, 21]).mismatched != 0 {
        assert!(Instant::now() < deadline, "first chunk never scattered");
        std::thread::sleep(Duration::from_millis(5));
    }
    let scattered = decode_staged(&c);
    for r in &mut m.rx {
        r.abort();
    }
    m.send(2, 4, 2);
    std::thread::sleep(Duration::from_millis(200));
    assert_eq!(
        decode_staged(&c),
        scattered,
        "a chunk was scattered after the abort"
    );
    m.rx.iter_mut()
        .for_each(|r| assert_eq!(r.poll(), KvPoll::Failed));
    // The rest may have been written before the abort reached the prefill.
    m.abort_racing(true);
    assert_eq!(allocations(&c), 0);
    c.shutdown();
}

#[test]
fn a_restarted_decode_gets_a_fresh_ring() {
    let mut c = Cluster::staged(tiny_model(false, 2), 2, 1, 64, staging(8, 64 << 10, T));
    let port = session_port(c.decode[0].0.session_id());
    let mut r1 = open(&mut c, 1, vec![1, 2, 3, 4], vec![10, 11, 12, 13], 0);
    r1.send(0, 2, 2);
    let deadline = Instant::now() + T;
    while c.decode[0].1.verify_kv(1, &[10, 11]).mismatched != 0 {
        assert!(Instant::now() < deadline, "first chunk never scattered");
        std::thread::sleep(Duration::from_millis(5));
    }
    // The decode dies and comes back on its address with new pools and a new ring.
    r1.rx.clear();
    let (old, _) = c.decode.pop().unwrap();
    old.teardown();
    let rank = RankSpec {
        tp_size: 1,
        tp_rank: 0,
        pp_size: 1,
        pp_rank: 0,
        ..Default::default()
    };
    let mut pools = RankPools::new(tiny_model(false, 2), rank, 64, 8).unwrap();
    pools.poison(&[12, 13], 0x5a);
    let mut config = decode_config(1);
    config.staging = staging(8, 64 << 10, T);
    let fresh = start_decode(config, pools.kv_args(), engine_on(port));
    c.decode.push((fresh, pools));
    // The rest of room 1 was planned for the dead incarnation: refused.
    r1.send(2, 4, 2);
    for t in &mut r1.tx {
        assert_eq!(wait_terminal(T, || t.poll()), KvPoll::Failed);
        t.clear();
    }
    assert!(
        c.decode[0].1.still_poisoned(&[12, 13], 0x5a),
        "old room written into the new incarnation"
    );
    // A new room through the new ring.
    let mut r2 = open(&mut c, 2, vec![5, 6, 7], vec![30, 31, 32], 1);
    r2.send_all(2);
    r2.finish_ok(&c);
    assert!(decode_staged(&c) > 0, "room 2 was staged");
    assert_eq!(allocations(&c), 0);
    c.shutdown();
}

#[test]
fn staging_on_one_side_only_takes_the_per_slice_path() {
    for (prefill_on, decode_on) in [(true, false), (false, true)] {
        let on = staging(8, 64 << 10, T);
        let off = StagingConfig {
            mode: StagingMode::Off,
            ..StagingConfig::default()
        };
        let mut c = Cluster::staged_per_side(
            tiny_model(false, 2),
            2,
            4,
            64,
            if prefill_on { on.clone() } else { off.clone() },
            if decode_on { on } else { off },
        );
        let mut r = open(&mut c, 7, vec![1, 2, 3, 4, 5], vec![40, 41, 42, 43, 44], 0);
        r.send_all(2);
        r.finish_ok(&c);
        assert_eq!(decode_staged(&c), 0);
        let gathered: u64 = c
            .prefill
            .iter()
            .map(|(m, _)| m.metrics().staged_bytes.get())
            .sum();
        assert_eq!(gathered, 0);
        c.shutdown();
    }
}

/// Holds decode rank 0's scatters: each reports its room on the first
/// channel as it starts, then waits (at most 3 s) for a release on the
/// second.
fn hold_scatters(c: &Cluster) -> (std::sync::mpsc::Receiver<u64>, std::sync::mpsc::Sender<()>) {
    let (started, rooms) = std::sync::mpsc::channel();
    let (release, released) = std::sync::mpsc::channel::<()>();
    let hook = std::sync::Mutex::new((started, released));
    c.decode[0]
        .0
        .set_scatter_hook(Some(std::sync::Arc::new(move |room| {
            let hook = hook.lock().unwrap();
            let _ = hook.0.send(room);
            let _ = hook.1.recv_timeout(Duration::from_secs(3));
        })));
    (rooms, release)
}

/// A scatter copies without the rooms lock: while one is in progress, the
/// room's `poll()` answers at once; the scatter's result is recorded after.
#[test]
fn poll_does_not_wait_for_a_scatter_in_progress() {
    let mut c = Cluster::staged(tiny_model(false, 2), 2, 1, 64, staging(8, 64 << 10, T));
    let (started, release) = hold_scatters(&c);
    let mut r = open(&mut c, 11, (0..6).collect(), (30..36).collect(), 1);
    r.send_all(2);
    assert_eq!(started.recv_timeout(T), Ok(11), "a scatter started");
    let t = Instant::now();
    let state = r.rx[0].poll();
    let took = t.elapsed();
    assert!(
        took < Duration::from_millis(500),
        "poll() took {took:?} while a scatter was in progress"
    );
    assert!(!state.is_terminal(), "{state:?} before the scatter ended");
    c.decode[0].0.set_scatter_hook(None);
    // Release this scatter and any that started meanwhile.
    for _ in 0..8 {
        let _ = release.send(());
    }
    r.finish_ok(&c);
    assert_eq!(allocations(&c), 0);
    c.shutdown();
}

/// A room aborted and cleared while its scatter copies: its abort is not
/// acknowledged and `clear()` does not return before the copy ended, and
/// nothing lands in its pages afterwards (they may be reused).
#[test]
fn clear_waits_for_a_scatter_in_progress() {
    let mut c = Cluster::staged(tiny_model(false, 2), 2, 1, 64, staging(8, 64 << 10, T));
    let (started, release) = hold_scatters(&c);
    let dst: Vec<i32> = (30..36).collect();
    let mut r = open(&mut c, 12, (0..6).collect(), dst.clone(), 1);
    r.send_all(2);
    assert_eq!(started.recv_timeout(T), Ok(12), "a scatter started");
    c.decode[0].0.set_scatter_hook(None);
    r.rx[0].abort();
    assert!(
        !r.rx[0].abort_acknowledged(),
        "acknowledged while a scatter into the pages was copying"
    );
    let releaser = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(300));
        let _ = release.send(());
    });
    let t = Instant::now();
    r.rx[0].clear();
    assert!(
        t.elapsed() >= Duration::from_millis(250),
        "clear() returned after {:?}, before the scatter ended",
        t.elapsed()
    );
    releaser.join().unwrap();
    c.decode[0].1.poison(&dst, 0xee);
    std::thread::sleep(Duration::from_millis(100));
    assert!(
        c.decode[0].1.still_poisoned(&dst, 0xee),
        "a scatter wrote into the pages after clear()"
    );
    // The prefill ranks may have finished before the abort reached them.
    for t in &mut r.tx {
        assert!(wait_terminal(T, || t.poll()).is_terminal());
        t.clear();
    }
    let deadline = Instant::now() + T;
    while allocations(&c) != 0 {
        assert!(Instant::now() < deadline, "ring allocations left behind");
        std::thread::sleep(Duration::from_millis(5));
    }
    c.shutdown();
}

/// The decode honours its own staging grid (`chunk_tokens`, from sglang's
/// `--chunked-prefill-size`): a prefill that cuts chunks on another grid
/// fails the room at once, naming the setting, on both sides. A room that
/// fits one chunk on either grid is cut the same way and succeeds.
#[test]
fn a_staging_chunk_size_mismatch_fails_the_room_by_name() {
    // Prefill chunks of 8 tokens (2 pages of 4); the decode's are 16 tokens.
    let mut c = Cluster::staged_per_side(
        tiny_model(false, 2),
        2,
        1,
        64,
        staging(8, 64 << 10, T),
        staging(16, 64 << 10, T),
    );
    let mut small = open(&mut c, 14, vec![1, 2], vec![50, 51], 2);
    small.send_all(2);
    small.finish_ok(&c);
    // The prefill asks for chunk 0's ring space as soon as the decode is
    // known, so the decode may refuse the room before the first send.
    let mut r = open_expecting(
        &mut c,
        13,
        (0..9).collect(),
        (30..39).collect(),
        1,
        KvPoll::Failed,
    );
    r.send_all(3);
    for rx in &mut r.rx {
        assert_eq!(wait_terminal(T, || rx.poll()), KvPoll::Failed);
        let e = rx.failure_exception();
        assert!(e.reason.contains("--chunked-prefill-size"), "{e}");
    }
    for t in &mut r.tx {
        assert_eq!(wait_terminal(T, || t.poll()), KvPoll::Failed);
        t.clear();
    }
    let deadline = Instant::now() + T;
    while allocations(&c) != 0 {
        assert!(Instant::now() < deadline, "ring allocations left behind");
        std::thread::sleep(Duration::from_millis(5));
    }
    c.shutdown();
}
