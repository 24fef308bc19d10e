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

/// A prefill rank with one shard (every room on the same worker), a decode
/// `hung` whose engine the test freezes and thaws, and a healthy decode.
struct TwoDecodes {
    bs: kvbridge_roles::bootstrap::BootstrapServer,
    addr: String,
    prefill_pools: RankPools,
    prefill: kvbridge_roles::PrefillManager,
    hung: Arc<TcpEngine>,
    decode_a: kvbridge_roles::DecodeManager,
    pools_a: RankPools,
    decode_b: kvbridge_roles::DecodeManager,
    pools_b: RankPools,
}

impl TwoDecodes {
    fn start() -> Self {
        let bs = bootstrap();
        let addr = bs.local_addr().to_string();
        let model = tiny_model(false, 2);
        let rank = SINGLE_RANK;
        let prefill_pools = RankPools::new(model.clone(), rank, 32, 8).unwrap();
        let pools_a = RankPools::new(model.clone(), rank, 32, 8).unwrap();
        let pools_b = RankPools::new(model, rank, 32, 8).unwrap();
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
        Self {
            bs,
            addr,
            prefill_pools,
            prefill,
            hung,
            decode_a,
            pools_a,
            decode_b,
            pools_b,
        }
    }

    /// Opens `room` into `pages` (aux slot `room`) at decode A or B and
    /// waits until the prefill knows its destination.
    fn open(
        &mut self,
        to_a: bool,
        room: u64,
        pages: &[i32],
    ) -> (kvbridge_roles::KvReceiver, kvbridge_roles::KvSender) {
        let decode = if to_a { &self.decode_a } else { &self.decode_b };
        let mut rx = decode.receiver(&self.addr, room);
        assert_eq!(rx.init(0), KvPoll::WaitingForInput);
        rx.send_metadata(pages, room, &[], None);
        self.prefill_pools.fill(room, pages, room);
        let mut tx = self.prefill.sender(room);
        tx.init(pages.len() as u64, Some(room));
        wait_for(Duration::from_secs(10), KvPoll::WaitingForInput, || {
            tx.poll()
        });
        (rx, tx)
    }

    /// Sends rooms `rooms` to the healthy decode, each in one (last) chunk,
    /// through the same worker as the hung room; each must reach `Success`
    /// with every byte (KV and aux) in place when it does.
    fn fast_rooms_succeed(&mut self, rooms: std::ops::RangeInclusive<u64>) {
        let mut open = Vec::new();
        for room in rooms {
            // Clear of the hung room's pages, which the prefill still reads.
            let pages = [room as i32 * 2 + 10, room as i32 * 2 + 11];
            let (rx, mut tx) = self.open(false, room, &pages);
            tx.send(&pages, None, None).unwrap();
            open.push((room, pages, rx, tx));
        }
        for (room, pages, mut rx, mut tx) in open {
            assert_eq!(
                wait_terminal(Duration::from_secs(20), || rx.poll()),
                KvPoll::Success,
                "room {room} waited behind the hung decode's last chunk"
            );
            let v = self.pools_b.verify(room, &pages, room);
            assert!(v.bytes > 0 && v.mismatched == 0, "room {room}: {v:?}");
            assert_eq!(tx.poll(), KvPoll::Success);
            rx.clear();
            tx.clear();
        }
    }

    fn shutdown(self) {
        self.prefill.teardown();
        self.decode_a.teardown();
        self.decode_b.teardown();
        self.bs.shutdown();
    }
}

/// Issue 14: the hung decode's room is on its last chunk (KV and aux
/// submitted, none written): the worker does not wait for it, so rooms
/// queued behind it on the same worker reach `Success`; thawed, the hung
/// room succeeds too with every byte in place.
#[test]
fn a_hung_last_chunk_delays_only_its_own_room() {
    let mut t = TwoDecodes::start();
    let (mut rx1, mut tx1) = t.open(true, 1, &[1, 2]);
    t.hung.debug_freeze(true);
    // The room's only chunk, so its last: KV and aux batches, all stuck.
    tx1.send(&[1, 2], None, None).unwrap();

    t.fast_rooms_succeed(2..=6);
    assert!(
        !tx1.poll().is_terminal(),
        "the hung room ended before its bytes were written"
    );
    assert!(!rx1.poll().is_terminal());
    assert!(
        t.pools_a.verify(1, &[1, 2], 1).mismatched > 0,
        "the frozen decode received the room"
    );

    t.hung.debug_freeze(false);
    assert_eq!(
        wait_terminal(Duration::from_secs(60), || rx1.poll()),
        KvPoll::Success
    );
    // Checked the moment the decode sees Success: every byte is there.
    let v = t.pools_a.verify(1, &[1, 2], 1);
    assert!(v.bytes > 0 && v.mismatched == 0, "{v:?}");
    assert_eq!(tx1.poll(), KvPoll::Success);
    rx1.clear();
    tx1.clear();
    t.shutdown();
}

/// A room's status never precedes its bytes: the decode freezes right
/// after the room's first chunk is written, so the last chunk (its second
/// page and the aux slot) is held. Once a later room on the same worker has
/// succeeded (so the worker is past the held last chunk), the room is still
/// not concluded on either side and its last bytes are missing; thawed, it
/// succeeds with every byte in place.
#[test]
fn a_rooms_status_never_precedes_its_bytes() {
    let mut t = TwoDecodes::start();
    let (mut rx1, mut tx1) = t.open(true, 1, &[3, 4]);
    // Frozen by the engine itself once the first request is written (a
    // freeze set from here could miss a connection already waiting).
    t.hung.debug_freeze_after(1);
    tx1.send(&[3], None, None).unwrap();
    let written = |t: &TwoDecodes| t.pools_a.verify_kv(1, &[3]).mismatched == 0;
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    while !written(&t) && std::time::Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(2));
    }
    assert!(written(&t), "the first chunk never arrived");
    tx1.send(&[4], None, None).unwrap();

    t.fast_rooms_succeed(2..=3);
    assert!(!tx1.poll().is_terminal(), "concluded before its bytes");
    assert!(!rx1.poll().is_terminal(), "status before the bytes");
    assert!(t.pools_a.verify(1, &[3, 4], 1).mismatched > 0);

    t.hung.debug_freeze_after(u64::MAX);
    t.hung.debug_freeze(false);
    assert_eq!(
        wait_terminal(Duration::from_secs(60), || rx1.poll()),
        KvPoll::Success
    );
    let v = t.pools_a.verify(1, &[3, 4], 1);
    assert!(v.bytes > 0 && v.mismatched == 0, "{v:?}");
    assert_eq!(tx1.poll(), KvPoll::Success);
    rx1.clear();
    tx1.clear();
    t.shutdown();
}

/// The decode aborts the hung room while its last chunk is in flight: the
/// prefill marks it `Failed` at once, keeps serving the other rooms of the
/// worker, and acknowledges the abort only once the room's writes drained
/// (after the thaw); the room never reports `Success`.
#[test]
fn an_abort_of_a_hung_last_chunk_is_acknowledged_after_the_drain() {
    let mut t = TwoDecodes::start();
    let (mut rx1, mut tx1) = t.open(true, 1, &[1, 2]);
    t.hung.debug_freeze(true);
    tx1.send(&[1, 2], None, None).unwrap();
    // A later room's success means the worker is past the hung room's
    // chunk: its batches are in flight (an abort before that would skip
    // the chunk and be acknowledged at once, rightly).
    t.fast_rooms_succeed(2..=2);
    rx1.abort();
    let prefill_status = |t: &TwoDecodes| t.prefill.room_status(1).unwrap_or(KvPoll::Success);
    assert_eq!(
        wait_for(Duration::from_secs(10), KvPoll::Failed, || prefill_status(
            &t
        )),
        KvPoll::Failed
    );

    t.fast_rooms_succeed(3..=4);
    assert!(
        !rx1.abort_acknowledged(),
        "ABORT_ACK before the room's writes drained"
    );

    t.hung.debug_freeze(false);
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while !rx1.abort_acknowledged() {
        assert!(std::time::Instant::now() < deadline, "no ABORT_ACK");
        std::thread::sleep(Duration::from_millis(2));
    }
    assert_eq!(tx1.poll(), KvPoll::Failed);
    assert_eq!(rx1.poll(), KvPoll::Failed);
    rx1.clear();
    tx1.clear();
    t.shutdown();
}
