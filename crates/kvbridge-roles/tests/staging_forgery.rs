//! Secret mode against a rogue cluster member: a process that holds the
//! secret (so its messages pass zmq CURVE) but serves none of the rooms
//! forges `CHUNK_READY`, `STAGING_REQ`, `WATERMARK` and `STAGING_RSP`,
//! transfer requests and ABORTs in a decode's name, and registers as the
//! decode rank with a pair key of its own. Each forgery is dropped and
//! counted; the rooms succeed with every byte right.
// Test code: a failed unwrap is a failed test.
#![allow(clippy::unwrap_used)]

mod common;

use std::time::{Duration, Instant};

use common::member::*;
use common::staged::*;
use common::*;
use kvbridge_engine::ClusterSecret;
use kvbridge_roles::KvPoll;
use kvbridge_roles::metrics::Metrics;
use kvbridge_roles::seal::seal;
use kvbridge_wire::{ChunkReady, PairKey, StagingReq, StagingRsp, Watermark};

fn secret() -> ClusterSecret {
    ClusterSecret::from_text("staging-forgery-cluster-secret", "test").unwrap()
}

/// Waits until `metrics` counted `n` unbound staging messages (or 3 s: a
/// build that takes forgeries counts none, and must fail on the bytes).
fn wait_dropped<'a>(metrics: impl Fn() -> Vec<&'a Metrics>, n: u64) {
    wait_dropped_as(metrics, "staging_unbound", n);
}

/// TP 2 → 1 in secret mode: a ring of `ring` bytes, chunks of 2 pages.
fn cluster(secret: &ClusterSecret, ring: u64) -> Cluster {
    Cluster::staged_secret(tiny_model(false, 2), 2, 1, 64, staging(8, ring, T), secret)
}

fn decode_metrics(c: &Cluster) -> Vec<&Metrics> {
    c.decode.iter().map(|(m, _)| m.metrics().as_ref()).collect()
}

fn prefill_metrics(c: &Cluster) -> Vec<&Metrics> {
    c.prefill
        .iter()
        .map(|(m, _)| m.metrics().as_ref())
        .collect()
}

/// Forged `CHUNK_READY`s from every rank number for an allocated chunk
/// would have the decode scatter the ring before a byte was written, and
/// drop the real ones as late.
#[test]
fn forged_chunk_ready_does_not_scatter_a_chunk_early() {
    let s = secret();
    let mut c = cluster(&s, 64 << 10);
    let rogue = Rogue::new(&s);
    let mut a = open(&mut c, 21, vec![1, 2], vec![10, 11], 0);
    wait_allocations(&c, 1);
    let (decode, _) = &c.decode[0];
    for rank in 0..4 {
        let forged = ChunkReady {
            room: 21,
            chunk_idx: 0,
            page_start: 0,
            num_pages: 2,
            session_id: decode.session_id().into(),
            prefill_unique_rank: Some(rank),
        };
        rogue.send(decode.rank_port(), owned(forged.encode()));
    }
    wait_dropped(|| decode_metrics(&c), 8);
    assert_eq!(
        allocations(&c),
        1,
        "the chunk was scattered and freed unwritten"
    );
    a.send_all(2);
    a.finish_ok(&c);
    assert!(decode_metrics(&c)[0].dropped_for("staging_unbound") >= 8);
    c.shutdown();
}

/// A forged `STAGING_REQ` that cuts the room on another grid would fail it.
#[test]
fn forged_staging_req_does_not_fail_a_room() {
    let s = secret();
    let mut c = cluster(&s, 64 << 10);
    let rogue = Rogue::new(&s);
    let mut a = open(&mut c, 22, vec![1, 2, 3, 4], vec![10, 11, 12, 13], 0);
    wait_allocations(&c, 2);
    let (decode, _) = &c.decode[0];
    let forged = StagingReq {
        room: 22,
        chunk_idx: 0,
        chunk_num_pages: 1,
        session_id: decode.session_id().into(),
        requester_pp_rank: Some(0),
    };
    rogue.send(decode.rank_port(), owned(forged.encode()));
    wait_dropped(|| decode_metrics(&c), 2);
    a.send_all(2);
    a.finish_ok(&c);
    c.shutdown();
}

/// A one-chunk ring: room B's chunk wraps onto room A's, which is not
/// written until A is sent; B must wait for the decode's watermark.
fn wrapped(c: &mut Cluster) -> (Room, Room) {
    let a = open(c, 1, vec![1, 2], vec![10, 11], 0);
    wait_allocations(c, 1);
    let b = open(c, 2, vec![3, 4], vec![12, 13], 1);
    wait_allocations(c, 2);
    (a, b)
}

/// B goes ahead only if the prefill took a forgery; then both finish.
fn b_waits_for_a(c: &Cluster, mut a: Room, mut b: Room) {
    b.send_all(2);
    std::thread::sleep(Duration::from_millis(300));
    for t in &mut b.tx {
        assert!(t.poll() < KvPoll::Success, "B went ahead over A's chunk");
    }
    a.send_all(2);
    a.finish_ok(c);
    b.finish_ok(c);
    assert_eq!(allocations(c), 0);
}

/// The wrapped rooms of [`wrapped`], with the message `forge` makes (for
/// the decode session it is given) sent by the rogue to every prefill rank:
/// it must be dropped, and B must wait for A.
fn forged_to_the_prefills(forge: impl Fn(&str) -> Vec<Vec<u8>>) {
    let s = secret();
    let mut c = cluster(&s, 16 << 10);
    let rogue = Rogue::new(&s);
    let (a, b) = wrapped(&mut c);
    let forged = forge(c.decode[0].0.session_id());
    for (p, _) in &c.prefill {
        rogue.send(p.rank_port(), forged.clone());
    }
    wait_dropped(|| prefill_metrics(&c), 4);
    b_waits_for_a(&c, a, b);
    c.shutdown();
}

/// A forged `WATERMARK` would tell the prefill that A's ring space is free.
#[test]
fn forged_watermark_does_not_release_ring_space() {
    forged_to_the_prefills(|session| {
        let forged = Watermark {
            wm_round: 1000,
            wm_tail: 0,
            session_id: session.into(),
        };
        owned(forged.encode())
    });
}

/// A forged `STAGING_RSP` would move B's allocation onto A's, in a round
/// the watermark has already passed.
#[test]
fn forged_staging_rsp_does_not_move_an_allocation() {
    forged_to_the_prefills(|session| {
        let forged = StagingRsp {
            room: 2,
            chunk_idx: 0,
            offset: 0,
            round: 0,
            end: 16 << 10,
            session_id: session.into(),
        };
        owned(forged.encode())
    });
}

/// The rogue registers as the decode rank (same session, same incarnation,
/// its own pair key) and then seals its forged `WATERMARK`s with that key;
/// a registration with no pair key is refused too.
#[test]
fn a_member_cannot_register_its_own_pair_key_for_a_decode() {
    let s = secret();
    let mut c = cluster(&s, 16 << 10);
    let rogue = Rogue::new(&s);
    let (a, b) = wrapped(&mut c);
    let (decode, pools) = &c.decode[0];
    let session = decode.session_id().to_owned();
    let own = PairKey([0x42; 32]);
    let mut registration = pools.kv_args().registration(
        "127.0.0.1",
        decode.rank_port(),
        &session,
        decode.engine_incarnation(),
    );
    for (p, _) in &c.prefill {
        for key in [Some(own), None] {
            registration.pair_key = key;
            let frames = owned(registration.encode());
            let to = format!("tcp://127.0.0.1:{}", p.rank_port());
            rogue
                .push
                .send(&to, frames.iter().map(Vec::as_slice))
                .unwrap();
        }
        let forged = Watermark {
            wm_round: 1000,
            wm_tail: 0,
            session_id: session.as_str().into(),
        };
        let frames = owned(seal(Some(&own), forged.encode()));
        let to = format!("tcp://127.0.0.1:{}", p.rank_port());
        rogue
            .push
            .send(&to, frames.iter().map(Vec::as_slice))
            .unwrap();
    }
    let refused = |c: &Cluster| {
        prefill_metrics(c)
            .iter()
            .map(|m| m.dropped_for("registration_unbound"))
            .sum::<u64>()
    };
    let deadline = Instant::now() + Duration::from_secs(3);
    while refused(&c) < 4 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(5));
    }
    wait_dropped(|| prefill_metrics(&c), 2);
    assert_eq!(
        refused(&c),
        4,
        "both forged registrations refused on both ranks"
    );
    b_waits_for_a(&c, a, b);
    // The real decode is still registered with its own key: rooms go on.
    let mut d = open(&mut c, 3, vec![5, 6], vec![14, 15], 2);
    d.send_all(2);
    d.finish_ok(&c);
    c.shutdown();
}

/// A member forges a transfer request for a room of its own naming a live
/// decode rank's session and the pages of that rank's finished room: the
/// prefill would write the member's room into them. And it forges an ABORT
/// of a live room in the decode's name: the prefill would fail it.
#[test]
fn a_member_cannot_send_transfer_requests_or_aborts_as_a_decode() {
    let s = secret();
    let mut c = Cluster::staged_secret(tiny_model(false, 2), 1, 1, 64, staging(8, 64 << 10, T), &s);
    let rogue = Rogue::new(&s);
    let mut a = open(&mut c, 31, vec![1, 2], vec![10, 11], 0);
    a.send_all(2);
    a.finish_ok(&c);
    let (decode, _) = &c.decode[0];
    let (session, decode_port) = (decode.session_id().to_owned(), decode.rank_port());
    let prefill_port = c.prefill[0].0.rank_port();
    let forged = kvbridge_wire::Transfer {
        room: 32,
        endpoint: "127.0.0.1".into(),
        dst_port: decode_port,
        mooncake_session_id: session.as_str().into(),
        pages: Some(kvbridge_wire::TransferPages {
            dst_kv_indices: kvbridge_wire::PackedArray::from(vec![10i32, 11]),
            dst_aux_index: 0,
            ..kvbridge_wire::TransferPages::default()
        }),
        required_dst_info_num: 1,
        decode_prefix_len: Some(0),
    };
    rogue.send(prefill_port, owned(forged.encode()));
    // A live room the member would abort in the decode's name.
    let mut b = open(&mut c, 33, vec![5, 6], vec![20, 21], 1);
    let abort = kvbridge_wire::Abort {
        room: 33,
        decode_ip: "127.0.0.1".into(),
        decode_port,
        generation: None,
    };
    rogue.send(prefill_port, owned(abort.encode()));
    wait_dropped_as(|| prefill_metrics(&c), "unbound", 4);
    // The member's room: its sender has KV ready and no destination.
    let (prefill, ppools) = &mut c.prefill[0];
    ppools.fill(32, &[3, 4], 0);
    let mut x = prefill.sender(32);
    x.init(2, Some(0));
    x.send(&[3, 4], None, None).unwrap();
    std::thread::sleep(Duration::from_millis(300));
    assert!(
        x.poll() < KvPoll::Transferring,
        "the forged request was taken"
    );
    let (_, dpools) = &c.decode[0];
    assert_eq!(
        dpools.verify(31, &[10, 11], 0).mismatched,
        0,
        "room 31's pages written over"
    );
    b.send_all(2);
    b.finish_ok(&c);
    drop(x);
    c.shutdown();
}
