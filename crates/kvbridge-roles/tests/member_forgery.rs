//! Secret mode against a rogue cluster member speaking for a prefill rank:
//! it knows a live room's id and the rank numbers that serve it, and sends
//! the decode a status (Success, to conclude the room before its KV came;
//! Failed, to kill it), `AUX_DATA` (or `AUX_BATCH`) and `STATE_DATA` into the room's own
//! slots, and `ABORT_ACK`s that would hand aborted pages back while the
//! real rank may still write them. None carries the MAC of the room's
//! ranks' pair keys: each is dropped and counted as `unbound`, no byte
//! lands, and the room then succeeds with every byte right.
// Test code: a failed unwrap is a failed test.
#![allow(clippy::unwrap_used)]

mod common;

use std::time::Duration;

use common::member::*;
use common::staged::*;
use common::*;
use kvbridge_engine::ClusterSecret;
use kvbridge_roles::KvPoll;
use kvbridge_roles::metrics::Metrics;
use kvbridge_wire::{AbortAck, AuxBatch, AuxData, StateData, Status};

const POISON: u8 = 0xe7;

fn secret() -> ClusterSecret {
    ClusterSecret::from_text("member-forgery-cluster-secret", "test").unwrap()
}

fn decode_metrics(c: &Cluster) -> Vec<&Metrics> {
    c.decode.iter().map(|(m, _)| m.metrics().as_ref()).collect()
}

/// Forged status, aux and state for a live room: before the fix the room
/// concluded Success with none of its KV written, and junk landed in its
/// aux slot and first page.
#[test]
fn a_member_cannot_conclude_or_write_a_decode_room() {
    let s = secret();
    let mut c = Cluster::secret(tiny_model(false, 2), 1, 1, 64, &s);
    let rogue = Rogue::new(&s);
    let (room, aux, dst) = (31, 2, vec![10, 11]);
    {
        let (_, pools) = &mut c.decode[0];
        pools.poison(&dst, POISON);
        pools.poison_aux(aux, POISON);
    }
    let mut a = open(&mut c, room, vec![1, 2], dst.clone(), aux);
    let (decode, pools) = &c.decode[0];
    let layout = pools.kv_args().layout;
    let page_addr = layout.kv_data_ptrs[0] + 10 * layout.kv_item_lens[0];
    let port = decode.rank_port();
    for status in [KvPoll::Success, KvPoll::Failed] {
        let forged = Status {
            room,
            status,
            prefill_rank: 0,
            failure_reason: Some("forged".into()),
        };
        rogue.send(port, owned(forged.encode()));
    }
    let aux_len = layout.aux_item_lens[0] as usize;
    let forged = AuxData {
        room,
        buffer_index: 0,
        aux_index: aux,
        data: vec![0x11; aux_len].into(),
    };
    rogue.send(port, owned(forged.encode()));
    let slot = vec![0x11; aux_len];
    let forged = AuxBatch::from_slots(room, aux, &[(0, &slot[..])]).unwrap();
    rogue.send(port, owned(forged.encode()));
    let forged = StateData {
        room,
        dst_addr: page_addr,
        data: vec![0x22; 64].into(),
    };
    rogue.send(port, owned(forged.encode()));
    wait_dropped_as(|| decode_metrics(&c), "unbound", 10);
    // Let a build that took them apply them.
    std::thread::sleep(Duration::from_millis(100));
    for rx in &mut a.rx {
        let state = rx.poll();
        assert!(
            state == KvPoll::WaitingForInput || state == KvPoll::Transferring,
            "the room concluded {state:?} on forged messages"
        );
    }
    let (_, pools) = &c.decode[0];
    assert!(
        pools.still_poisoned(&dst, POISON),
        "a forged STATE_DATA wrote the room's page"
    );
    assert!(
        pools.aux_still_poisoned(aux, POISON),
        "a forged AUX_DATA or AUX_BATCH wrote the room's aux slot"
    );
    assert_eq!(decode_metrics(&c)[0].dropped_for("unbound"), 10);
    // The room's own rank is heard as before.
    a.send_all(2);
    a.finish_ok(&c);
    c.shutdown();
}

/// Forged `ABORT_ACK`s (every generation the decode may have used, ranked
/// and unranked) for a room whose prefill rank went silent: before the fix
/// the decode took them and reported the abort acknowledged, handing the
/// pages back while that rank could still write them.
#[test]
fn a_member_cannot_acknowledge_an_abort_for_a_prefill_rank() {
    let s = secret();
    let mut c = Cluster::secret(tiny_model(false, 2), 1, 1, 64, &s);
    let rogue = Rogue::new(&s);
    let room = 41;
    let addr = c.bootstrap.local_addr().to_string();
    let mut rx = c.decode[0].0.receiver(&addr, room);
    assert_eq!(rx.init(0), KvPoll::WaitingForInput);
    rx.send_metadata(&[10, 11], 2, &[], None);
    // The prefill rank goes silent (it never acknowledges).
    let (prefill, pools) = c.prefill.remove(0);
    prefill.teardown();
    drop(pools);
    rx.abort();
    let port = c.decode[0].0.rank_port();
    let mut sent = 0;
    for generation in (0..=4).map(Some).chain([None]) {
        for prefill_rank in [Some(0), None] {
            let forged = AbortAck {
                room,
                prefill_rank,
                generation,
            };
            rogue.send(port, owned(forged.encode()));
            sent += 2;
        }
    }
    wait_dropped_as(|| decode_metrics(&c), "unbound", sent);
    std::thread::sleep(Duration::from_millis(100));
    assert!(
        !rx.abort_acknowledged(),
        "a forged ABORT_ACK released the aborted room's pages"
    );
    assert_eq!(decode_metrics(&c)[0].dropped_for("unbound"), sent);
    rx.clear();
    c.shutdown();
}
