//! A decode accepts only what a room expects: status and ABORT_ACK from the
//! room's own prefill ranks (ACKs with our generation), STATE_DATA into the
//! room's own slots; and a room's pages are released only after its ranks
//! acknowledged the abort, even when the prefill's bootstrap server is lost.
// Test code: a failed unwrap is a failed test.
#![allow(clippy::unwrap_used)]

mod common;

use std::time::{Duration, Instant};

use common::*;
use kvbridge_roles::KvPoll;
use kvbridge_wire::{AbortAck, StateData, Status};

fn send_frames(sock: &zmq::Socket, frames: &[impl AsRef<[u8]>]) {
    sock.send_multipart(frames.iter().map(|f| f.as_ref()), 0)
        .unwrap();
}

fn wait_until(what: &str, mut f: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while !f() {
        assert!(Instant::now() < deadline, "{what}: not reached");
        std::thread::sleep(Duration::from_millis(5));
    }
}

#[test]
fn status_from_a_rank_that_does_not_serve_the_room_is_dropped() {
    let mut cluster = Cluster::new(tiny_model(false, 2), 1, 1, 1, 16);
    let addr = cluster.bootstrap.local_addr().to_string();
    let (decode, _) = &mut cluster.decode[0];
    let mut rx = decode.receiver(&addr, 300);
    assert_eq!(rx.init(0), KvPoll::WaitingForInput);
    rx.send_metadata(&[1, 2], 0, &[], None);
    let (_ctx, sock) = rogue_socket(decode.rank_port());
    // The room's only prefill rank is unique rank 0: rank 7 is nobody's.
    let forged = Status {
        room: 300,
        status: KvPoll::Success,
        prefill_rank: 7,
        failure_reason: None,
    };
    send_frames(&sock, &forged.encode());
    let metrics = decode.metrics().clone();
    wait_until("foreign status dropped", || {
        metrics.dropped_for("status_foreign") >= 1
    });
    assert_eq!(
        rx.poll(),
        KvPoll::WaitingForInput,
        "a forged Success landed"
    );
    rx.clear();
    let out = cluster.run(301, &[1, 2], &[3, 4], 1);
    assert_eq!(out[0].0, KvPoll::Success);
    assert_eq!(out[0].1.mismatched, 0);
    cluster.shutdown();
}

#[test]
fn state_data_lands_only_in_the_rooms_own_slots() {
    let mut cluster = Cluster::new(tiny_model(false, 2), 1, 1, 1, 16);
    let addr = cluster.bootstrap.local_addr().to_string();
    let (decode, pools) = &mut cluster.decode[0];
    let mut a = decode.receiver(&addr, 400);
    let mut b = decode.receiver(&addr, 401);
    assert_eq!(a.init(0), KvPoll::WaitingForInput);
    assert_eq!(b.init(0), KvPoll::WaitingForInput);
    a.send_metadata(&[1, 2], 0, &[], None);
    b.send_metadata(&[5, 6], 1, &[], None);
    let layout = pools.kv_args().layout;
    let (base, item) = (layout.kv_data_ptrs[0], layout.kv_item_lens[0]);
    pools.poison(&[1, 2, 3, 5, 6], 0x11);
    let (_ctx, sock) = rogue_socket(decode.rank_port());
    // Room 400 naming room 401's page 5, and a run from its own page 2
    // into page 3 (nobody's).
    for (dst, len) in [(base + 5 * item, 8), (base + 3 * item - 4, 8)] {
        let m = StateData {
            room: 400,
            dst_addr: dst,
            data: vec![0xee; len].into(),
        };
        send_frames(&sock, &m.encode());
    }
    // Its own page 1: written.
    let own = StateData {
        room: 400,
        dst_addr: base + item,
        data: vec![0x5a; 8].into(),
    };
    send_frames(&sock, &own.encode());
    let metrics = decode.metrics().clone();
    wait_until("foreign state dropped", || {
        metrics.dropped_for("state_data") >= 2
    });
    wait_until("own state written", || !pools.still_poisoned(&[1], 0x11));
    assert!(
        pools.still_poisoned(&[5, 6], 0x11),
        "room 401's pages were written"
    );
    assert!(
        pools.still_poisoned(&[2, 3], 0x11),
        "a write straddling into another page landed"
    );
    a.clear();
    b.clear();
    cluster.shutdown();
}

#[test]
fn forged_abort_acks_do_not_release_pages() {
    let mut cluster = Cluster::new(tiny_model(false, 2), 1, 1, 1, 16);
    let addr = cluster.bootstrap.local_addr().to_string();
    // The prefill rank goes away (as if partitioned): it will never ACK.
    let (prefill, _pools) = cluster.prefill.pop().unwrap();
    let (decode, _) = &cluster.decode[0];
    let mut rx = decode.receiver(&addr, 500);
    assert_eq!(rx.init(0), KvPoll::WaitingForInput);
    rx.send_metadata(&[1, 2], 0, &[], None);
    prefill.teardown();
    rx.abort();
    let (_ctx, sock) = rogue_socket(decode.rank_port());
    // Our ABORT carried generation 1. Right rank without a generation, the
    // right generation from a rank that does not serve the room, an older
    // generation, and the unranked form: none counts.
    let forged = [
        AbortAck {
            room: 500,
            prefill_rank: Some(0),
            generation: None,
        },
        AbortAck {
            room: 500,
            prefill_rank: Some(9),
            generation: Some(1),
        },
        AbortAck {
            room: 500,
            prefill_rank: Some(0),
            generation: Some(0),
        },
        AbortAck {
            room: 500,
            prefill_rank: None,
            generation: None,
        },
    ];
    for ack in &forged {
        send_frames(&sock, &ack.encode());
    }
    let metrics = decode.metrics().clone();
    wait_until("forged ACKs dropped", || {
        metrics.dropped_for("abort_ack_foreign") >= 4
    });
    assert!(!rx.abort_acknowledged(), "a forged ACK released the pages");
    // The real rank's ACK (rank 0, our generation) does.
    let real = AbortAck {
        room: 500,
        prefill_rank: Some(0),
        generation: Some(1),
    };
    send_frames(&sock, &real.encode());
    wait_until("real ACK counted", || rx.abort_acknowledged());
    rx.clear();
    cluster.shutdown();
}

#[test]
fn a_lost_bootstrap_server_does_not_release_pages() {
    let mut cluster = Cluster::new(tiny_model(false, 2), 1, 1, 1, 16);
    let addr = cluster.bootstrap.local_addr().to_string();
    let (prefill, _pools) = cluster.prefill.pop().unwrap();
    let (decode, _) = &cluster.decode[0];
    let mut rx = decode.receiver(&addr, 600);
    assert_eq!(rx.init(0), KvPoll::WaitingForInput);
    rx.send_metadata(&[1, 2], 0, &[], None);
    // The bootstrap server stops and the prefill is unreachable (not known
    // dead): the room fails, but its pages must stay pinned.
    prefill.teardown();
    let Cluster {
        bootstrap,
        decode: decodes,
        ..
    } = cluster;
    bootstrap.shutdown();
    let (decode, _pools) = &decodes[0];
    assert_eq!(
        wait_terminal(Duration::from_secs(10), || rx.poll()),
        KvPoll::Failed
    );
    assert!(
        !rx.abort_acknowledged(),
        "losing the bootstrap server released pages a live prefill could still write"
    );
    std::thread::sleep(Duration::from_millis(500));
    assert!(!rx.abort_acknowledged());
    let reason = rx.failure_exception().reason;
    assert!(reason.contains("Lost connection with prefill"), "{reason}");
    let _ = decode;
    for (m, _) in decodes {
        m.teardown();
    }
}

#[test]
fn a_lost_bootstrap_server_with_a_live_prefill_drains_through_its_ack() {
    let cluster = Cluster::new(tiny_model(false, 2), 1, 1, 1, 16);
    let addr = cluster.bootstrap.local_addr().to_string();
    let mut rx = cluster.decode[0].0.receiver(&addr, 700);
    assert_eq!(rx.init(0), KvPoll::WaitingForInput);
    rx.send_metadata(&[1, 2], 0, &[], None);
    let Cluster {
        bootstrap,
        decode: decodes,
        prefill: prefills,
        ..
    } = cluster;
    bootstrap.shutdown();
    assert_eq!(
        wait_terminal(Duration::from_secs(10), || rx.poll()),
        KvPoll::Failed
    );
    // The prefill lives: it receives the ABORT and acknowledges it.
    wait_until("the live prefill's ACK", || rx.abort_acknowledged());
    rx.clear();
    for (m, _) in prefills {
        m.teardown();
    }
    for (m, _) in decodes {
        m.teardown();
    }
}

#[test]
fn a_silent_prefill_rank_is_fenced_before_its_pages_are_released() {
    let bs = bootstrap();
    let model = tiny_model(false, 2);
    let rank = SINGLE_RANK;
    let prefill_pools =
        kvbridge_roles::synthetic::RankPools::new(model.clone(), rank, 16, 8).unwrap();
    let decode_pools = kvbridge_roles::synthetic::RankPools::new(model, rank, 16, 8).unwrap();
    let prefill = start_prefill(
        prefill_config(bs.local_addr(), 1, 0),
        prefill_pools.kv_args(),
        tcp_engine(),
    );
    let decode = start_decode(
        kvbridge_roles::DecodeConfig {
            abort_ack_timeout: Duration::from_millis(300),
            ..decode_config(1)
        },
        decode_pools.kv_args(),
        tcp_engine(),
    );
    let mut rx = decode.receiver(&bs.local_addr().to_string(), 800);
    assert_eq!(rx.init(0), KvPoll::WaitingForInput);
    rx.send_metadata(&[1, 2], 0, &[], None);
    // The prefill rank falls silent: it will never acknowledge.
    prefill.teardown();
    rx.abort();
    assert!(!rx.abort_acknowledged(), "released before any ACK or fence");
    // Past the ACK deadline the decode's engine fences the rank's engine
    // session (published through the bootstrap server): then, and only
    // then, the pages may be reused.
    wait_until("fenced", || rx.abort_acknowledged());
    assert_eq!(decode.metrics().failures_for("abort_fenced"), 1);
    rx.clear();
    decode.teardown();
    drop((prefill_pools, decode_pools));
    bs.shutdown();
}

#[test]
fn aborts_naming_a_peer_that_never_reads_do_not_stall_the_prefill_inbox() {
    let mut cluster = Cluster::new(tiny_model(false, 2), 1, 1, 1, 16);
    // A "decode" that accepts connections and never reads a byte.
    let sink = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let sink_port = sink.local_addr().unwrap().port();
    let (prefill, _) = &cluster.prefill[0];
    let (_ctx, sock) = rogue_socket(prefill.rank_port());
    // Thousands of ABORTs for unknown rooms: each is answered at once with
    // an ACK to the sink, whose queue fills; the inbox must drop, not wait.
    for room in 0..3000u64 {
        let abort = kvbridge_wire::Abort {
            room: 1_000_000 + room,
            decode_ip: "127.0.0.1".into(),
            decode_port: sink_port,
            generation: Some(room),
        };
        send_frames(&sock, &abort.encode());
    }
    let metrics = prefill.metrics().clone();
    wait_until("ACKs to the stuck peer dropped", || {
        metrics.dropped_for("abort_ack_send") > 0
    });
    // Honest rooms still go through promptly.
    let started = Instant::now();
    let out = cluster.run(900, &[1, 2, 3], &[4, 5, 6], 1);
    assert_eq!(out[0].0, KvPoll::Success);
    assert_eq!(out[0].1.mismatched, 0);
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "an honest room waited behind a stuck peer: {:?}",
        started.elapsed()
    );
    drop(sink);
    cluster.shutdown();
}

/// A transfer request for one page of `room` from decode `session`, which
/// names `required` destinations for the room.
fn transfer_request(room: u64, session: String, required: u64) -> kvbridge_wire::Transfer<'static> {
    kvbridge_wire::Transfer {
        room,
        endpoint: "127.0.0.1".into(),
        dst_port: 9,
        mooncake_session_id: session.into(),
        pages: Some(kvbridge_wire::TransferPages {
            dst_kv_indices: kvbridge_wire::PackedArray::from(vec![1i32]),
            dst_aux_index: 0,
            ..kvbridge_wire::TransferPages::default()
        }),
        required_dst_info_num: required,
        decode_prefix_len: Some(0),
    }
}

#[test]
fn one_decode_session_cannot_fill_the_prefills_room_table() {
    let bs = bootstrap();
    let model = tiny_model(false, 2);
    let rank = SINGLE_RANK;
    let pools = kvbridge_roles::synthetic::RankPools::new(model, rank, 16, 8).unwrap();
    let mut config = prefill_config(bs.local_addr(), 1, 0);
    config.max_rooms_per_session = 3;
    let prefill = start_prefill(config, pools.kv_args(), tcp_engine());
    let (_ctx, sock) = rogue_socket(prefill.rank_port());
    let request = |room: u64, session: &str| transfer_request(room, session.into(), 1);
    // Five rooms from one session (the cap is 3), a repeat of one of its
    // rooms (no new room), and one room from another session.
    for room in 1..=5 {
        send_frames(&sock, &request(room, "127.0.0.1:9").encode());
    }
    send_frames(&sock, &request(2, "127.0.0.1:9").encode());
    send_frames(&sock, &request(6, "127.0.0.1:10").encode());
    let metrics = prefill.metrics().clone();
    wait_until("over-limit requests refused", || {
        metrics.dropped_for("transfer_over_session_limit") >= 2
    });
    std::thread::sleep(Duration::from_millis(200));
    assert_eq!(metrics.dropped_for("transfer_over_session_limit"), 2);
    prefill.teardown();
    drop(pools);
    bs.shutdown();
}

/// A flood of transfer requests for rooms no sender ever claims (open mode:
/// anyone can send them) fills the pending-room cap only until the
/// bootstrap timeout: past it the cap is freed for honest rooms, while a
/// room whose sender exists keeps its destination.
#[test]
fn unclaimed_rooms_expire_from_the_pending_cap() {
    let bs = bootstrap();
    let model = tiny_model(false, 2);
    let pools = kvbridge_roles::synthetic::RankPools::new(model, SINGLE_RANK, 16, 8).unwrap();
    let mut config = prefill_config(bs.local_addr(), 1, 0);
    config.max_rooms = 4;
    config.bootstrap_timeout = Duration::from_millis(1500);
    let prefill = start_prefill(config, pools.kv_args(), tcp_engine());
    let (_ctx, sock) = rogue_socket(prefill.rank_port());
    // Two destinations required, one ever sent: room 1's sender keeps waiting.
    let request = |room: u64, session: String| transfer_request(room, session, 2);
    // Room 1 has a sender (the scheduler reached it); rooms 2-4 are junk,
    // each from its own session; room 5 finds the cap full.
    let mut sender = prefill.sender(1);
    sender.init(16, Some(1));
    for room in 1..=5 {
        send_frames(
            &sock,
            &request(room, format!("127.0.0.1:{}", 100 + room)).encode(),
        );
    }
    let metrics = prefill.metrics().clone();
    wait_until("the fifth room refused", || {
        metrics.dropped_for("transfer_over_limit") == 1
    });
    assert_eq!(metrics.dropped_for("transfer_expired"), 0);
    // Past the timeout the junk expires; the claimed room stays.
    std::thread::sleep(Duration::from_millis(1700));
    send_frames(&sock, &request(6, "127.0.0.1:106".into()).encode());
    wait_until("the unclaimed rooms expired", || {
        metrics.dropped_for("transfer_expired") == 3
    });
    // Room 6 got in (the cap had room), and room 1 still holds its slot:
    // 2 rooms pending, so 2 more fit and a third is refused.
    for room in 7..=9 {
        send_frames(
            &sock,
            &request(room, format!("127.0.0.1:{}", 100 + room)).encode(),
        );
    }
    wait_until("the cap full again", || {
        metrics.dropped_for("transfer_over_limit") == 2
    });
    std::thread::sleep(Duration::from_millis(200));
    assert_eq!(metrics.dropped_for("transfer_expired"), 3);
    assert_eq!(metrics.dropped_for("transfer_over_limit"), 2);
    drop(sender);
    prefill.teardown();
    drop(pools);
    bs.shutdown();
}

/// Transfer requests with long page lists (4 MiB a room was accepted) hold
/// at most `max_pending_request_bytes` in all: past it they are refused,
/// counted, until unclaimed rooms expire, after which requests fit again.
#[test]
fn pending_rooms_hold_a_bounded_number_of_bytes() {
    let bs = bootstrap();
    let model = tiny_model(false, 2);
    let pools = kvbridge_roles::synthetic::RankPools::new(model, SINGLE_RANK, 16, 8).unwrap();
    let mut config = prefill_config(bs.local_addr(), 1, 0);
    config.max_pending_request_bytes = 1 << 20;
    config.bootstrap_timeout = Duration::from_millis(1500);
    let prefill = start_prefill(config, pools.kv_args(), tcp_engine());
    let (_ctx, sock) = rogue_socket(prefill.rank_port());
    // 64 K pages (256 KiB) a room, each from its own session: three fit.
    let big = |room: u64| {
        let mut t = transfer_request(room, format!("127.0.0.1:{}", 200 + room), 2);
        if let Some(p) = &mut t.pages {
            p.dst_kv_indices = kvbridge_wire::PackedArray::from(vec![1i32; 1 << 16]);
        }
        t
    };
    for room in 1..=6 {
        send_frames(&sock, &big(room).encode());
    }
    let metrics = prefill.metrics().clone();
    wait_until("the rooms past the budget refused", || {
        metrics.dropped_for("transfer_over_bytes") == 3
    });
    // Past the bootstrap timeout the unclaimed rooms expire and a new one fits.
    std::thread::sleep(Duration::from_millis(1700));
    send_frames(&sock, &big(7).encode());
    wait_until("the unclaimed rooms expired", || {
        metrics.dropped_for("transfer_expired") == 3
    });
    std::thread::sleep(Duration::from_millis(200));
    assert_eq!(metrics.dropped_for("transfer_over_bytes"), 3);
    prefill.teardown();
    drop(pools);
    bs.shutdown();
}
