//! A slow or hung destination delays only its own rooms: the prefill
//! worker accounts for batches in the order they finish, so rooms to a
//! healthy decode complete while a batch to a hung one is stuck.
// Test code: a failed unwrap is a failed test.
#![allow(clippy::unwrap_used)]

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::*;
use kvbridge_engine::{EngineConfig, TcpEngine, TransferEngine};
use kvbridge_roles::KvPoll;
use kvbridge_roles::synthetic::RankPools;

#[test]
fn a_hung_decode_delays_only_its_own_rooms() {
    let bs = bootstrap();
    let addr = bs.local_addr().to_string();
    let model = tiny_model(false, 2);
    let rank = SINGLE_RANK;
    let mut prefill_pools = RankPools::new(model.clone(), rank, 32, 8).unwrap();
    let pools_a = RankPools::new(model.clone(), rank, 32, 8).unwrap();
    let pools_b = RankPools::new(model, rank, 32, 8).unwrap();
    // One shard: every room goes through the same worker.
    let mut config = prefill_config(bs.local_addr(), 1, 0);
    config.queue_size = 1;
    config.thread_pool_size = Some(4);
    let prefill = start_prefill(config, prefill_pools.kv_args(), tcp_engine());
    let hung = Arc::new(TcpEngine::new(EngineConfig::default()).unwrap());
    let decode_a = start_decode(
        decode_config(1),
        pools_a.kv_args(),
        hung.clone() as Arc<dyn TransferEngine>,
    );
    let decode_b = start_decode(decode_config(1), pools_b.kv_args(), tcp_engine());

    // Room 1 to decode A, which hangs: its first chunk's batch is stuck.
    let mut rx1 = decode_a.receiver(&addr, 1);
    assert_eq!(rx1.init(0), KvPoll::WaitingForInput);
    rx1.send_metadata(&[1, 2], 1, &[], None);
    prefill_pools.fill(1, &[1, 2], 1);
    let mut tx1 = prefill.sender(1);
    tx1.init(2, Some(1));
    wait_for(Duration::from_secs(10), KvPoll::WaitingForInput, || {
        tx1.poll()
    });
    hung.debug_freeze(true);
    tx1.send(&[1], None, None).unwrap();

    // Rooms 2..=6 to decode B, through the same worker: all complete.
    let mut rooms = Vec::new();
    for room in 2..=6u64 {
        let pages = [room as i32 * 2, room as i32 * 2 + 1];
        let mut rx = decode_b.receiver(&addr, room);
        assert_eq!(rx.init(0), KvPoll::WaitingForInput);
        rx.send_metadata(&pages, room, &[], None);
        prefill_pools.fill(room, &pages, room);
        let mut tx = prefill.sender(room);
        tx.init(2, Some(room));
        wait_for(Duration::from_secs(10), KvPoll::WaitingForInput, || {
            tx.poll()
        });
        tx.send(&pages, None, None).unwrap();
        rooms.push((room, pages, rx, tx));
    }
    for (room, pages, rx, tx) in &mut rooms {
        assert_eq!(
            wait_terminal(Duration::from_secs(20), || rx.poll()),
            KvPoll::Success,
            "room {room} waited behind the hung decode"
        );
        assert_eq!(pools_b.verify(*room, pages, *room).mismatched, 0);
        assert_eq!(tx.poll(), KvPoll::Success);
    }
    assert!(
        !tx1.poll().is_terminal(),
        "the hung decode's room ended before the others"
    );

    // The hung decode recovers: its room completes too.
    hung.debug_freeze(false);
    tx1.send(&[2], None, None).unwrap();
    assert_eq!(
        wait_terminal(Duration::from_secs(60), || rx1.poll()),
        KvPoll::Success
    );
    assert_eq!(pools_a.verify(1, &[1, 2], 1).mismatched, 0);
    for (_, _, mut rx, mut tx) in rooms {
        rx.clear();
        tx.clear();
    }
    rx1.clear();
    tx1.clear();
    prefill.teardown();
    decode_a.teardown();
    decode_b.teardown();
    bs.shutdown();
}
