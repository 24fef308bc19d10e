//! A rogue peer sends malformed frames, out-of-region writes and hostile
//! registrations: everything is dropped and counted, nothing is written,
//! nothing crashes, and real rooms still succeed afterwards.
// Test code: a failed unwrap is a failed test.
#![allow(clippy::unwrap_used)]

mod common;

use std::time::{Duration, Instant};

use common::*;
use kvbridge_roles::KvPoll;
use kvbridge_wire::{
    AUX_BATCH_TAG, AuxBatch, AuxData, PackedArray, PackedLists, Register, StateData, Transfer,
    TransferPages,
};

fn send(sock: &zmq::Socket, frames: &[&[u8]]) {
    sock.send_multipart(frames.iter().copied(), 0).unwrap();
}

fn wait_until(mut f: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while !f() {
        assert!(Instant::now() < deadline, "condition not reached");
        std::thread::sleep(Duration::from_millis(5));
    }
}

#[test]
fn decode_drops_hostile_messages() {
    let mut cluster = Cluster::new(tiny_model(false, 2), 1, 1, 1, 16);
    let addr = cluster.bootstrap.local_addr().to_string();
    // A live room, so room-scoped writes are not refused for being unknown.
    let (decode, pools) = &mut cluster.decode[0];
    let mut rx = decode.receiver(&addr, 77);
    assert_eq!(rx.init(0), KvPoll::WaitingForInput);
    let snapshot = pools.verify(0, &(0..16).collect::<Vec<_>>(), 0);
    let (_ctx, sock) = rogue_socket(decode.rank_port());
    // Garbage of every shape.
    send(&sock, &[b"\xff\xfe"]);
    send(&sock, &[b"AUX_DATA", b"77", b"0"]);
    send(
        &sock,
        &[b"STATE_DATA", b"77", b"1", b"\0\0\0\x09", b"short"],
    );
    send(&sock, &[b"77", b"9", b"0"]);
    send(&sock, &[b"ABORT", b"1", b"x", b"1"]);
    // Out-of-region writes: below, past and straddling every region.
    let kv0 = pools.kv_args().layout.kv_data_ptrs[0];
    let kv0_len = pools.kv_args().kv_data_lens[0];
    for dst in [0x10u64, kv0 - 1, kv0 + kv0_len - 2, u64::MAX - 2] {
        let m = StateData {
            room: 77,
            dst_addr: dst,
            data: vec![0xab; 4].into(),
        };
        let frames = m.encode();
        sock.send_multipart(frames.iter().map(|f| f.as_ref()), 0)
            .unwrap();
    }
    // An aux write to a buffer we do not have, and one longer than a slot.
    for (buffer, len) in [(9u64, 4usize), (0, 17)] {
        let m = AuxData {
            room: 77,
            buffer_index: buffer,
            aux_index: 0,
            data: vec![0xcd; len].into(),
        };
        let frames = m.encode();
        sock.send_multipart(frames.iter().map(|f| f.as_ref()), 0)
            .unwrap();
    }
    // The same two as kvbridge's AUX_BATCH, and a batch cut short.
    let m = AuxBatch::from_slots(77, 0, &[(9, &[0xcd; 4][..]), (0, &[0xcd; 17][..])]).unwrap();
    sock.send_multipart(m.encode().iter().map(|f| f.as_ref()), 0)
        .unwrap();
    send(&sock, &[AUX_BATCH_TAG, b"77", b"0"]);
    // An in-region write for a room that does not exist.
    let m = StateData {
        room: 4242,
        dst_addr: kv0,
        data: vec![0xab; 4].into(),
    };
    sock.send_multipart(m.encode().iter().map(|f| f.as_ref()), 0)
        .unwrap();
    let metrics = decode.metrics().clone();
    wait_until(|| {
        metrics.dropped_for("malformed") >= 4
            && metrics.dropped_for("state_data") >= 5
            && metrics.dropped_for("aux_data") >= 4
    });
    assert_eq!(
        pools.verify(0, &(0..16).collect::<Vec<_>>(), 0),
        snapshot,
        "a rogue write landed"
    );
    rx.clear();
    // The cluster still works.
    let out = cluster.run(78, &[1, 2, 3], &[4, 5, 6], 2);
    assert_eq!(out[0].0, KvPoll::Success);
    assert_eq!(out[0].1.mismatched, 0);
    cluster.shutdown();
}

#[test]
fn prefill_rejects_incompatible_registrations_loudly() {
    let mut cluster = Cluster::new(tiny_model(false, 2), 1, 1, 1, 16);
    let (prefill, pools) = &mut cluster.prefill[0];
    let (_ctx, sock) = rogue_socket(prefill.rank_port());
    send(&sock, &[b"None", b"127.0.0.1"]);
    send(&sock, &[b"12", b"x"]);
    // A decode with decode-context parallelism against a non-MLA pool: the
    // registration is refused, and rooms to that session fail with the reason.
    let reg = Register {
        endpoint: "127.0.0.1".into(),
        dst_port: 1,
        mooncake_session_id: "127.0.0.1:1".into(),
        dst_kv_ptrs: PackedArray::from(vec![0x1000u64; 4]),
        dst_attn_tp_size: 1,
        dst_kv_item_len: 8192,
        dst_dcp_size: 2,
        dst_dcp_rank: 1,
        dst_state_data_ptrs: PackedLists::empty(),
        ..Register::default()
    };
    sock.send_multipart(reg.encode().iter().map(|f| f.as_ref()), 0)
        .unwrap();
    let t = Transfer {
        room: 55,
        endpoint: "127.0.0.1".into(),
        dst_port: 1,
        mooncake_session_id: "127.0.0.1:1".into(),
        pages: Some(TransferPages {
            dst_kv_indices: PackedArray::from(vec![1i32]),
            dst_aux_index: 0,
            ..TransferPages::default()
        }),
        required_dst_info_num: 1,
        decode_prefix_len: Some(0),
    };
    sock.send_multipart(t.encode().iter().map(|f| f.as_ref()), 0)
        .unwrap();
    let metrics = prefill.metrics().clone();
    wait_until(|| {
        metrics.dropped_for("malformed") >= 2 && metrics.failures_for("registration") >= 1
    });
    pools.fill(55, &[1], 0);
    let mut tx = prefill.sender(55);
    tx.init(1, Some(0));
    // The room fails as soon as the transfer request names the rejected
    // session, before any chunk is sent.
    assert_eq!(
        wait_terminal(Duration::from_secs(5), || tx.poll()),
        KvPoll::Failed
    );
    let err = tx.failure_exception();
    assert!(
        err.reason
            .contains("registration from 127.0.0.1:1 rejected"),
        "{err}"
    );
    let out = cluster.run(56, &[2], &[3], 1);
    assert_eq!(out[0].0, KvPoll::Success);
    cluster.shutdown();
}

#[test]
fn a_dummy_cp_rank_asked_for_a_share_fails_the_room_with_the_reason() {
    // CP 2 without all-ranks transfer: a decode configured to pull from
    // every CP rank (an sglang decode with the variable set) asks CP rank
    // 1, which would never send: the room fails at once, naming the setting.
    let shape = Shape {
        prefill_cp: 2,
        ..Shape::new(1, 1, 1)
    };
    let cluster = Cluster::shaped(tiny_model(false, 2), shape, 16);
    let (dummy, _) = &cluster.prefill[1];
    let (_ctx, sock) = rogue_socket(dummy.rank_port());
    let t = Transfer {
        room: 91,
        endpoint: "127.0.0.1".into(),
        dst_port: 1,
        mooncake_session_id: "127.0.0.1:1".into(),
        pages: Some(TransferPages {
            dst_kv_indices: PackedArray::from(vec![1i32]),
            dst_aux_index: 0,
            ..TransferPages::default()
        }),
        required_dst_info_num: 1,
        decode_prefix_len: Some(0),
    };
    sock.send_multipart(t.encode().iter().map(|f| f.as_ref()), 0)
        .unwrap();
    let metrics = dummy.metrics().clone();
    wait_until(|| metrics.failures_for("cp_mismatch") >= 1);
    let mut tx = dummy.sender(91);
    tx.init(1, Some(0));
    assert_eq!(
        wait_terminal(Duration::from_secs(5), || tx.poll()),
        KvPoll::Failed
    );
    let why = tx.failure_exception().reason;
    assert!(
        why.contains("SGLANG_DISAGGREGATION_ALL_CP_RANKS_TRANSFER"),
        "{why}"
    );
    cluster.shutdown();
}
