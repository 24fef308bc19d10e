//! Many rooms at once, timeouts, dead prefills, dead and restarted decodes,
//! and role switches without leaks.
// Test code: a failed unwrap is a failed test.
#![allow(clippy::unwrap_used)]

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use common::*;
use kvbridge_engine::{ClusterSecret, TransferEngine};
use kvbridge_roles::bootstrap::{BootstrapConfig, BootstrapServer};
use kvbridge_roles::synthetic::{ModelSpec, RankPools, RankSpec};
use kvbridge_roles::{DecodeManager, KvPoll, KvReceiver, KvSender, PrefillManager, StartError};

const T: Duration = Duration::from_secs(30);

#[test]
fn five_hundred_concurrent_rooms() {
    let mut cluster = Cluster::new(tiny_model(false, 2), 1, 1, 1, 1100);
    let addr = cluster.bootstrap.local_addr().to_string();
    let rooms: Vec<u64> = (0..500).map(|i| 1_000_000 + i * 7).collect();
    let pages = |i: usize, base: i32| vec![base + 2 * i as i32, base + 2 * i as i32 + 1];
    let mut receivers: Vec<_> = rooms
        .iter()
        .enumerate()
        .map(|(i, &room)| {
            let mut rx = cluster.decode[0].0.receiver(&addr, room);
            assert_eq!(rx.init(0), KvPoll::WaitingForInput);
            rx.send_metadata(&pages(i, 50), (i % 8) as u64, &[], None);
            rx
        })
        .collect();
    let (prefill, ppools) = &mut cluster.prefill[0];
    let mut senders: Vec<_> = rooms
        .iter()
        .enumerate()
        .map(|(i, &room)| {
            ppools.fill(room, &pages(i, 0), (i % 8) as u64);
            let mut tx = prefill.sender(room);
            tx.init(2, Some((i % 8) as u64));
            tx
        })
        .collect();
    // Every room is live at once before any chunk is sent.
    for tx in &mut senders {
        assert_eq!(
            wait_for(T, KvPoll::WaitingForInput, || tx.poll()),
            KvPoll::WaitingForInput
        );
    }
    for (i, tx) in senders.iter_mut().enumerate() {
        tx.send(&pages(i, 0), None, None).unwrap();
    }
    for tx in &mut senders {
        assert_eq!(wait_terminal(T, || tx.poll()), KvPoll::Success);
    }
    let dpools = &cluster.decode[0].1;
    for (i, rx) in receivers.iter_mut().enumerate() {
        assert_eq!(wait_terminal(T, || rx.poll()), KvPoll::Success);
        // Aux slots are shared by rooms with the same `i % 8`: check KV only.
        let v = dpools.verify_kv(rooms[i], &pages(i, 50));
        assert!(v.bytes > 0);
        assert_eq!(v.mismatched, 0, "room {}", rooms[i]);
    }
    cluster.shutdown();
}

#[test]
fn bootstrap_timeout_fails_the_sender() {
    let bs = bootstrap();
    let pools = RankPools::new(
        tiny_model(false, 1),
        RankSpec {
            tp_size: 1,
            tp_rank: 0,
            pp_size: 1,
            pp_rank: 0,
            ..Default::default()
        },
        4,
        2,
    )
    .unwrap();
    let mut config = prefill_config(bs.local_addr(), 1, 0);
    config.bootstrap_timeout = Duration::from_millis(200);
    let prefill = start_prefill(config, pools.kv_args(), tcp_engine());
    let mut tx = prefill.sender(9);
    tx.init(1, Some(0));
    assert_eq!(wait_terminal(T, || tx.poll()), KvPoll::Failed);
    let err = tx.failure_exception();
    assert!(
        err.reason.contains("timed out") && err.reason.contains("Bootstrapping"),
        "{err}"
    );
    prefill.teardown();
}

#[test]
fn waiting_timeout_fails_the_receiver() {
    let cluster = Cluster::new(tiny_model(false, 1), 1, 1, 1, 8);
    let addr = cluster.bootstrap.local_addr().to_string();
    let mut config = decode_config(1);
    config.waiting_timeout = Duration::from_millis(200);
    let pools = RankPools::new(
        cluster.model.clone(),
        RankSpec {
            tp_size: 1,
            tp_rank: 0,
            pp_size: 1,
            pp_rank: 0,
            ..Default::default()
        },
        8,
        2,
    )
    .unwrap();
    let decode = start_decode(config, pools.kv_args(), tcp_engine());
    let mut rx = decode.receiver(&addr, 31);
    assert_eq!(rx.init(0), KvPoll::WaitingForInput);
    rx.send_metadata(&[1], 0, &[], None);
    // The prefill never sends: the room fails after the waiting timeout.
    assert_eq!(wait_terminal(T, || rx.poll()), KvPoll::Failed);
    assert!(rx.failure_exception().reason.contains("WaitingForInput"));
    decode.teardown();
    cluster.shutdown();
}

#[test]
fn dead_prefill_fails_its_rooms_within_the_heartbeat_window() {
    let cluster = Cluster::new(tiny_model(false, 1), 1, 1, 1, 8);
    let addr = cluster.bootstrap.local_addr().to_string();
    let mut rx = cluster.decode[0].0.receiver(&addr, 41);
    assert_eq!(rx.init(0), KvPoll::WaitingForInput);
    rx.send_metadata(&[1], 0, &[], None);
    let started = Instant::now();
    // The prefill server (its bootstrap server) dies.
    let Cluster {
        bootstrap,
        prefill,
        decode,
        ..
    } = cluster;
    bootstrap.shutdown();
    assert_eq!(wait_terminal(T, || rx.poll()), KvPoll::Failed);
    // Two missed 300 ms heartbeats, plus slack for the HTTP timeouts.
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "took {:?}",
        started.elapsed()
    );
    let err = rx.failure_exception();
    assert!(
        err.reason.contains("Lost connection with prefill instance"),
        "{err}"
    );
    for (m, _) in prefill {
        m.teardown();
    }
    for (m, _) in decode {
        m.teardown();
    }
}

#[test]
fn dead_decode_fails_in_flight_rooms_and_its_session_recovers() {
    let model = tiny_model(false, 4);
    let rank = SINGLE_RANK;
    let bs = bootstrap();
    let addr = bs.local_addr().to_string();
    let mut ppools = RankPools::new(model.clone(), rank, 256, 4).unwrap();
    let mut pconfig = prefill_config(bs.local_addr(), 1, 0);
    pconfig.probe.interval = Duration::from_millis(100);
    let prefill = start_prefill(pconfig, ppools.kv_args(), tcp_engine());

    let decode_tcp = tcp_engine_on(0);
    // The decode stops reading after the room's first request, so that it
    // dies with the room in flight however fast the transfer runs.
    decode_tcp.debug_freeze_after(1);
    let decode_engine: Arc<dyn TransferEngine> = decode_tcp.clone();
    let port: u16 = decode_engine
        .session_id()
        .rsplit(':')
        .next()
        .unwrap()
        .parse()
        .unwrap();
    let dpools = RankPools::new(model.clone(), rank, 256, 4).unwrap();
    let decode = start_decode(decode_config(1), dpools.kv_args(), decode_engine);
    let src: Vec<i32> = (0..200).collect();
    let mut rx = decode.receiver(&addr, 1);
    rx.init(0);
    rx.send_metadata(&src, 0, &[], None);
    ppools.fill(1, &src, 0);
    let mut tx = prefill.sender(1);
    tx.init(src.len() as u64, Some(0));
    wait_for(T, KvPoll::WaitingForInput, || tx.poll());
    // The decode dies while the room is being sent.
    for pages in src.chunks(4) {
        tx.send(pages, None, None).unwrap();
    }
    decode.teardown();
    drop(decode_tcp);
    drop(dpools);
    drop(rx);
    assert_eq!(wait_terminal(T, || tx.poll()), KvPoll::Failed);
    let err = tx.failure_exception();
    assert!(err.reason.contains("Failed to send kv chunk"), "{err}");
    // A new incarnation on the same address registers and is served again.
    let dpools = RankPools::new(model, rank, 256, 4).unwrap();
    let decode = start_decode(decode_config(1), dpools.kv_args(), engine_on(port));
    // It retries room 1, which already failed here: the prefill answers
    // Failed with the root cause at once, not after the 20 s waiting timeout.
    // The prefill's reason (a waiting timeout would give its own).
    let reason = refused(&decode, &addr, 1, &[5, 6], 0);
    assert!(reason.contains("Failed to send kv chunk"), "{reason}");
    let mut rx = decode.receiver(&addr, 2);
    assert_eq!(rx.init(0), KvPoll::WaitingForInput);
    rx.send_metadata(&[9, 10], 1, &[], None);
    ppools.fill(2, &[3, 4], 1);
    let mut tx = prefill.sender(2);
    tx.init(2, Some(1));
    wait_for(T, KvPoll::WaitingForInput, || tx.poll());
    tx.send(&[3, 4], None, None).unwrap();
    assert_eq!(wait_terminal(T, || tx.poll()), KvPoll::Success);
    assert_eq!(wait_terminal(T, || rx.poll()), KvPoll::Success);
    assert_eq!(dpools.verify(2, &[9, 10], 1).mismatched, 0);
    assert!(!prefill.is_blacklisted(decode.session_id()));
    // Room 2 is finished and cleared: asking for it again is answered
    // Failed at once, never left waiting and never sent twice.
    tx.clear();
    rx.clear();
    let reason = refused(&decode, &addr, 2, &[11, 12], 1);
    assert!(reason.contains("already sent in full"), "{reason}");
    decode.teardown();
    prefill.teardown();
}

/// Asks `decode` for `room` into `pages` / `aux`, expects the prefill to
/// answer Failed, and returns the reason it gave.
fn refused(decode: &DecodeManager, addr: &str, room: u64, pages: &[i32], aux: u64) -> String {
    let mut rx = decode.receiver(addr, room);
    assert_eq!(rx.init(0), KvPoll::WaitingForInput);
    rx.send_metadata(pages, aux, &[], None);
    assert_eq!(wait_terminal(T, || rx.poll()), KvPoll::Failed);
    rx.failure_exception().reason
}

fn count(dir: &str) -> usize {
    std::fs::read_dir(dir).map(|d| d.count()).unwrap_or(0)
}

/// In secret mode (its CURVE contexts, ZAP and monitor threads are what
/// could leak), so that each new prefill's signed registration replaces the
/// last one's slot: in open mode the bootstrap server refuses it while
/// anything accepts connections at the old address, which a port freed by
/// the last prefill and reused by any listener here (the next engine's)
/// sometimes does.
#[test]
fn two_hundred_role_switches_leak_nothing() {
    let secret = ClusterSecret::from_text("role-switch-cluster-secret", "test").unwrap();
    let bs = BootstrapServer::start_with(
        "127.0.0.1:0".parse().unwrap(),
        BootstrapConfig::with_secret(secret.clone()),
    )
    .unwrap();
    let model = tiny_model(false, 1);
    let rank = SINGLE_RANK;
    let pools = RankPools::new(model, rank, 8, 2).unwrap();
    let cycle = |i: u32| {
        let engine = tcp_engine();
        let mut pconfig = prefill_config(bs.local_addr(), 1, 0);
        pconfig.secret = Some(secret.clone());
        let prefill = start_prefill(pconfig, pools.kv_args(), engine.clone());
        prefill.teardown();
        let mut dconfig = decode_config(1);
        dconfig.secret = Some(secret.clone());
        let decode = start_decode(dconfig, pools.kv_args(), engine);
        if i.is_multiple_of(50) {
            // Now and then the switched role also serves a room.
            let mut rx = decode.receiver(&bs.local_addr().to_string(), u64::from(i));
            assert_eq!(rx.init(0), KvPoll::WaitingForInput);
            rx.clear();
        }
        decode.teardown();
    };
    // Warm up lazily created process-wide resources first.
    cycle(1);
    let (threads, fds) = (count("/proc/self/task"), count("/proc/self/fd"));
    for i in 0..200 {
        cycle(i);
    }
    let (threads_after, fds_after) = (count("/proc/self/task"), count("/proc/self/fd"));
    // Other tests of this binary run in parallel threads; allow their noise.
    assert!(
        threads_after <= threads + 8,
        "threads {threads} -> {threads_after}"
    );
    assert!(fds_after <= fds + 16, "fds {fds} -> {fds_after}");
}

#[test]
fn a_start_the_bootstrap_server_refuses_releases_everything() {
    let secret = ClusterSecret::from_text("a-cluster-secret-of-some-length", "test").unwrap();
    let config = BootstrapConfig {
        secret: Some(secret),
        ..BootstrapConfig::default()
    };
    let bs = BootstrapServer::start_with("127.0.0.1:0".parse().unwrap(), config).unwrap();
    let pools = RankPools::new(tiny_model(false, 1), SINGLE_RANK, 8, 2).unwrap();
    let engine = tcp_engine();
    // Our registration is unsigned: refused at once, after every thread started.
    // SAFETY: the pools outlive the manager.
    let started = unsafe {
        PrefillManager::start(
            prefill_config(bs.local_addr(), 1, 0),
            pools.kv_args(),
            engine.clone(),
        )
    };
    assert!(
        matches!(started, Err(StartError::Bootstrap { .. })),
        "{started:?}"
    );
    assert!(
        engine.registered_regions().is_empty(),
        "a failed start deregisters its memory"
    );
}

/// A TP1 prefill on a tiny 2-layer model and decode incarnation A on a
/// fresh engine port (which incarnation B will reuse): A has asked for room 1
/// (pages 2 and 3, aux slot 0) and the prefill's sender for it (2 pages, aux
/// slot 0) waits for input.
struct Restart {
    model: ModelSpec,
    rank: RankSpec,
    _bs: BootstrapServer,
    addr: String,
    ppools: RankPools,
    prefill: PrefillManager,
    port: u16,
    a: Option<(RankPools, DecodeManager, KvReceiver)>,
    tx: KvSender,
}

impl Restart {
    /// Tears incarnation A down and starts B on its port, with pages 2 and
    /// 3 poisoned so a write into them shows.
    fn replace_a_with_b(&mut self) -> (RankPools, DecodeManager) {
        if let Some((pools, a, rx)) = self.a.take() {
            drop(rx);
            a.teardown();
            drop(pools);
        }
        let mut b_pools = RankPools::new(self.model.clone(), self.rank, 16, 4).unwrap();
        b_pools.poison(&[2, 3], 0x5a);
        let b = start_decode(decode_config(1), b_pools.kv_args(), engine_on(self.port));
        (b_pools, b)
    }
}

fn restart_setup() -> Restart {
    let model = tiny_model(false, 2);
    let rank = SINGLE_RANK;
    let bs = bootstrap();
    let addr = bs.local_addr().to_string();
    let ppools = RankPools::new(model.clone(), rank, 16, 4).unwrap();
    let prefill = start_prefill(
        prefill_config(bs.local_addr(), 1, 0),
        ppools.kv_args(),
        tcp_engine(),
    );
    let engine = engine_on(0);
    let port: u16 = engine
        .session_id()
        .rsplit(':')
        .next()
        .unwrap()
        .parse()
        .unwrap();
    let a_pools = RankPools::new(model.clone(), rank, 16, 4).unwrap();
    let a = start_decode(decode_config(1), a_pools.kv_args(), engine);
    let mut rx = a.receiver(&addr, 1);
    assert_eq!(rx.init(0), KvPoll::WaitingForInput);
    rx.send_metadata(&[2, 3], 0, &[], None);
    let mut tx = prefill.sender(1);
    tx.init(2, Some(0));
    wait_for(T, KvPoll::WaitingForInput, || tx.poll());
    Restart {
        model,
        rank,
        _bs: bs,
        addr,
        ppools,
        prefill,
        port,
        a: Some((a_pools, a, rx)),
        tx,
    }
}

#[test]
fn a_restarted_decode_never_receives_its_old_incarnations_rooms() {
    let mut r = restart_setup();
    // Incarnation A dies before the prefill sends room 1; B starts on its
    // address (its pools may reuse A's memory).
    let (b_pools, b) = r.replace_a_with_b();
    let mut rx2 = b.receiver(&r.addr, 2);
    assert_eq!(rx2.init(0), KvPoll::WaitingForInput);
    // The prefill now sends room 1, planned for A: it must fail, not write.
    r.ppools.fill(1, &[5, 6], 0);
    r.tx.send(&[5, 6], None, None).unwrap();
    assert_eq!(wait_terminal(T, || r.tx.poll()), KvPoll::Failed);
    let err = r.tx.failure_exception();
    // Refused either by the registration generation (B's registration
    // arrived first) or by the engine's incarnation pin (it had not yet).
    assert!(
        err.reason.contains("registered again") || err.reason.contains("peer restarted"),
        "{err}"
    );
    assert!(
        b_pools.still_poisoned(&[2, 3], 0x5a),
        "room 1 was written into the new incarnation"
    );
    // B's own room works.
    rx2.send_metadata(&[7], 1, &[], None);
    r.ppools.fill(2, &[8], 1);
    let mut tx2 = r.prefill.sender(2);
    tx2.init(1, Some(1));
    wait_for(T, KvPoll::WaitingForInput, || tx2.poll());
    tx2.send(&[8], None, None).unwrap();
    assert_eq!(wait_terminal(T, || rx2.poll()), KvPoll::Success);
    assert_eq!(b_pools.verify(2, &[7], 1).mismatched, 0);
    b.teardown();
    r.prefill.teardown();
}

#[test]
fn a_restarted_decode_cannot_resume_a_room_half_sent_to_its_old_incarnation() {
    let mut r = restart_setup();
    // Incarnation A receives the first of two chunks of room 1, then dies.
    r.ppools.fill(1, &[5, 6], 0);
    r.tx.send(&[5], None, None).unwrap();
    let deadline = std::time::Instant::now() + T;
    while r.a.as_ref().unwrap().0.verify_kv(1, &[2]).mismatched != 0 {
        assert!(
            std::time::Instant::now() < deadline,
            "first chunk never arrived"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    // Incarnation B asks for the same room: it must fail at once, since
    // chunk 1 went to A; resuming would report success with a hole.
    let (b_pools, b) = r.replace_a_with_b();
    let reason = refused(&b, &r.addr, 1, &[2, 3], 0);
    assert!(reason.contains("restarted while room 1"), "{reason}");
    r.tx.send(&[6], None, None).unwrap();
    assert_eq!(wait_terminal(T, || r.tx.poll()), KvPoll::Failed);
    assert!(
        b_pools.still_poisoned(&[2, 3], 0x5a),
        "the rest of room 1 was written into the new incarnation"
    );
    b.teardown();
    r.prefill.teardown();
}
