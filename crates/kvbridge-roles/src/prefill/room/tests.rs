//! Transitions of the prefill rooms, the abort and failure paths, and a
//! property: no event order acknowledges an ABORT, or tells a decode its
//! room failed, while a chunk of the room is in flight.

use std::sync::Arc;
use std::time::{Duration, Instant};

use kvbridge_plan::TransferRequest;
use kvbridge_wire::KvPoll;
use proptest::prelude::*;

use super::*;
use crate::prefill::state::{AckTarget, TransferInfo};

fn caps() -> Caps {
    Caps {
        max_rooms: 8,
        max_pending_bytes: 1 << 20,
        max_rooms_per_session: 4,
        max_abort_endpoints: 2,
        unclaimed_ttl: Duration::from_secs(300),
    }
}

/// Decode rank `k`'s destination; `n` ranks report for the room.
fn info(k: u16, n: u64, registration: u64) -> Arc<TransferInfo> {
    Arc::new(TransferInfo {
        endpoint: format!("10.0.0.{}", k + 1),
        dst_port: 5000,
        session: format!("10.0.0.{}:{}", k + 1, 6000 + k),
        request: Some(TransferRequest::default()),
        required_dst_info_num: n,
        decode_prefix_len: Some(16),
        registration,
    })
}

fn target(k: u16) -> AckTarget {
    AckTarget {
        ip: format!("10.0.0.{}", k + 1),
        port: 5000,
        generation: Some(1),
    }
}

fn transfer(rooms: &mut PrefillRooms, room: u64, info: Arc<TransferInfo>) -> Admission {
    match rooms.handle(Input::Transfer {
        room,
        info,
        caps: caps(),
        now: Instant::now(),
    }) {
        Output::Transfer(admission, _) => admission,
        other => panic!("{other:?}"),
    }
}

fn state(rooms: &mut PrefillRooms, room: u64) -> Option<KvPoll> {
    match rooms.handle(Input::State { room }) {
        Output::State(s) => s,
        other => panic!("{other:?}"),
    }
}

fn abort(rooms: &mut PrefillRooms, room: u64, k: u16) -> AbortEffect {
    match rooms.handle(Input::Abort {
        room,
        target: target(k),
        caps: caps(),
        now: Instant::now(),
    }) {
        Output::Aborted(effect) => effect,
        other => panic!("{other:?}"),
    }
}

fn finish(rooms: &mut PrefillRooms, room: u64, is_last: bool) -> (Vec<AckTarget>, usize) {
    match rooms.handle(Input::Finish { room, is_last }) {
        Output::Finished(acks, (told, _)) => (acks, told.len()),
        other => panic!("{other:?}"),
    }
}

#[test]
fn a_room_waits_for_every_decode_rank_then_transfers_and_succeeds() {
    let mut rooms = PrefillRooms::default();
    rooms.handle(Input::Open {
        room: 1,
        dummy: false,
    });
    assert_eq!(state(&mut rooms, 1), Some(KvPoll::Bootstrapping));
    assert!(matches!(
        rooms.handle(Input::Queue {
            room: 1,
            now: Instant::now()
        }),
        Output::Shard(None)
    ));
    assert!(matches!(
        transfer(&mut rooms, 1, info(0, 2, 0)),
        Admission::Added(None)
    ));
    let Admission::Added(Some(infos)) = transfer(&mut rooms, 1, info(1, 2, 0)) else {
        panic!("the second rank completes the destinations");
    };
    assert_eq!(infos.len(), 2);
    assert_eq!(state(&mut rooms, 1), Some(KvPoll::WaitingForInput));
    assert!(matches!(
        rooms.handle(Input::TakePrefixLen { room: 1 }),
        Output::Count(16)
    ));
    let Output::Shard(Some(ports)) = rooms.handle(Input::Queue {
        room: 1,
        now: Instant::now(),
    }) else {
        panic!("a room with destinations is queued");
    };
    assert_eq!(
        ports,
        6000 + 6001,
        "the workers' shard follows the sessions' ports"
    );
    assert_eq!(state(&mut rooms, 1), Some(KvPoll::Transferring));
    let Output::Concluded(Some(c)) = rooms.handle(Input::Conclude {
        room: 1,
        status: KvPoll::Success,
        targets: None,
        reason: None,
    }) else {
        panic!();
    };
    assert_eq!(c.status, KvPoll::Success);
    assert_eq!(c.targets.len(), 2);
    assert!(c.started.is_some());
    // Cleared: a late request for it is answered at once.
    assert!(matches!(
        rooms.handle(Input::Clear { room: 1 }),
        Output::Cleared(Some(KvPoll::Success), _)
    ));
    assert!(matches!(
        transfer(&mut rooms, 1, info(0, 2, 0)),
        Admission::Finished(Some(_))
    ));
}

#[test]
fn requests_are_admitted_within_the_caps() {
    let mut rooms = PrefillRooms::default();
    for room in 0..4 {
        assert!(matches!(
            transfer(&mut rooms, room, info(0, 2, 0)),
            Admission::Added(None)
        ));
    }
    assert!(
        matches!(
            transfer(&mut rooms, 4, info(0, 2, 0)),
            Admission::OverSession
        ),
        "a session holds at most four rooms"
    );
    for room in 4..8 {
        transfer(&mut rooms, room, info(1, 2, 0));
    }
    assert!(matches!(
        transfer(&mut rooms, 8, info(2, 2, 0)),
        Admission::OverRooms
    ));
    let huge = Arc::new(TransferInfo {
        request: Some(TransferRequest {
            dst_kv_indices: vec![0; 1 << 20],
            ..TransferRequest::default()
        }),
        ..(*info(3, 2, 0)).clone()
    });
    assert!(matches!(
        transfer(&mut rooms, 3, huge),
        Admission::OverBytes(_)
    ));
}

#[test]
fn a_decode_restarted_after_the_room_began_is_refused() {
    let mut rooms = PrefillRooms::default();
    rooms.handle(Input::Open {
        room: 2,
        dummy: false,
    });
    transfer(&mut rooms, 2, info(0, 1, 0));
    // Re-registered before any chunk: the new destination replaces it.
    assert!(matches!(
        transfer(&mut rooms, 2, info(0, 1, 1)),
        Admission::Added(Some(_))
    ));
    rooms.handle(Input::Queue {
        room: 2,
        now: Instant::now(),
    });
    assert!(matches!(
        transfer(&mut rooms, 2, info(0, 1, 2)),
        Admission::Restarted
    ));
}

#[test]
fn an_abort_is_acknowledged_only_once_the_room_drained() {
    let mut rooms = PrefillRooms::default();
    rooms.handle(Input::Open {
        room: 3,
        dummy: false,
    });
    transfer(&mut rooms, 3, info(0, 2, 0));
    transfer(&mut rooms, 3, info(1, 2, 0));
    rooms.handle(Input::Queue {
        room: 3,
        now: Instant::now(),
    });
    assert!(matches!(
        rooms.handle(Input::Dequeue { room: 3 }),
        Output::Infos(Some(_))
    ));
    let effect = abort(&mut rooms, 3, 0);
    // Two endpoints wait for the drain; a third is over the room's limit.
    abort(&mut rooms, 3, 1);
    assert!(abort(&mut rooms, 3, 2).over_limit);
    assert!(effect.failed && effect.active);
    assert!(effect.acks.is_empty(), "a chunk is in flight");
    assert!(
        matches!(
            rooms.handle(Input::Dequeue { room: 3 }),
            Output::Infos(None)
        ),
        "no chunk of an aborted room goes out"
    );
    assert_eq!(finish(&mut rooms, 3, false).0, vec![]);
    let (acks, _) = finish(&mut rooms, 3, false);
    assert_eq!(acks, vec![target(0), target(1)], "drained: the ACKs go out");
}

#[test]
fn an_abort_before_the_sender_enters_the_room_failed_and_tells_the_other_decodes() {
    let mut rooms = PrefillRooms::default();
    // One of its two decode ranks asked; the other aborts.
    transfer(&mut rooms, 4, info(0, 2, 0));
    let effect = abort(&mut rooms, 4, 1);
    assert!(effect.failed && !effect.active);
    assert_eq!(effect.others, vec![("10.0.0.1".to_owned(), 5000)]);
    assert_eq!(effect.acks, vec![target(1)], "nothing in flight");
    // The sender created later finds it failed and cannot revive it.
    rooms.handle(Input::Open {
        room: 4,
        dummy: false,
    });
    assert_eq!(state(&mut rooms, 4), Some(KvPoll::Failed));
    assert!(matches!(
        rooms.handle(Input::Queue {
            room: 4,
            now: Instant::now()
        }),
        Output::Shard(None)
    ));
}

#[test]
fn a_failure_here_is_told_once_after_the_drain_and_never_after_success() {
    let mut rooms = PrefillRooms::default();
    rooms.handle(Input::Open {
        room: 5,
        dummy: false,
    });
    transfer(&mut rooms, 5, info(0, 1, 0));
    rooms.handle(Input::Dequeue { room: 5 });
    let Output::Notice((told, _)) = rooms.handle(Input::FailAndTell {
        room: 5,
        reason: "Aborted by AbortReq.".into(),
    }) else {
        panic!()
    };
    assert!(told.is_empty(), "deferred while a chunk is in flight");
    assert_eq!(finish(&mut rooms, 5, false).1, 1, "told once drained");
    let Output::Concluded(Some(c)) = rooms.handle(Input::Conclude {
        room: 5,
        status: KvPoll::Success,
        targets: None,
        reason: None,
    }) else {
        panic!()
    };
    assert_eq!(
        c.status,
        KvPoll::Failed,
        "a failed room cannot conclude Success"
    );
    assert_eq!(c.reason.as_deref(), Some("Aborted by AbortReq."));
    assert!(c.targets.is_empty(), "each decode hears a failure once");

    // Bootstrapping past its timeout: the decodes that asked are told.
    rooms.handle(Input::Open {
        room: 6,
        dummy: false,
    });
    transfer(&mut rooms, 6, info(0, 2, 0));
    let Output::Polled(KvPoll::Failed, Some((told, reason))) = rooms.handle(Input::Poll {
        room: 6,
        give_up: Some("timed out".into()),
    }) else {
        panic!()
    };
    assert_eq!(told.len(), 1);
    assert_eq!(reason.as_deref(), Some("timed out"));

    // A room that succeeded is not reported failed.
    rooms.handle(Input::Open {
        room: 7,
        dummy: true,
    });
    rooms.handle(Input::Succeed { room: 7 });
    let Output::Notice((told, _)) = rooms.handle(Input::FailAndTell {
        room: 7,
        reason: "late".into(),
    }) else {
        panic!()
    };
    assert!(told.is_empty());
}

/// One step of a random history of one room with two decode ranks.
#[derive(Debug, Clone)]
enum Step {
    Transfer(u16),
    Queue,
    Dequeue,
    Finish(bool),
    Abort(u16),
    Fail,
    Conclude(bool),
    Clear,
    Open,
}

fn step() -> impl Strategy<Value = Step> {
    prop_oneof![
        (0u16..2).prop_map(Step::Transfer),
        Just(Step::Queue),
        Just(Step::Dequeue),
        any::<bool>().prop_map(Step::Finish),
        (0u16..3).prop_map(Step::Abort),
        Just(Step::Fail),
        any::<bool>().prop_map(Step::Conclude),
        Just(Step::Clear),
        Just(Step::Open),
    ]
}

proptest! {
    /// Whatever arrives in whatever order, an ABORT ACK or a `Failed`
    /// status decided here goes out only while no chunk of the room is
    /// dequeued and unfinished, and an aborted room hands no worker a
    /// destination: no write lands after the decode was told.
    #[test]
    fn no_event_order_acknowledges_with_a_chunk_in_flight(
        steps in proptest::collection::vec(step(), 1..60),
    ) {
        let mut rooms = PrefillRooms::default();
        let room = 9;
        let mut in_flight = 0usize;
        let mut aborted = false;
        for s in steps {
            let (acks, told) = match s {
                Step::Transfer(k) => {
                    transfer(&mut rooms, room, info(k, 2, 0));
                    (Vec::new(), 0)
                }
                Step::Queue => {
                    rooms.handle(Input::Queue { room, now: Instant::now() });
                    (Vec::new(), 0)
                }
                Step::Dequeue => {
                    in_flight += 1;
                    let Output::Infos(infos) = rooms.handle(Input::Dequeue { room }) else {
                        panic!()
                    };
                    if aborted {
                        prop_assert!(infos.is_none(), "an aborted room's chunk was handed out");
                    }
                    (Vec::new(), 0)
                }
                Step::Finish(is_last) => {
                    if in_flight == 0 {
                        continue;
                    }
                    in_flight -= 1;
                    finish(&mut rooms, room, is_last)
                }
                Step::Abort(k) => {
                    let effect = abort(&mut rooms, room, k);
                    aborted |= effect.failed || state(&mut rooms, room) == Some(KvPoll::Failed);
                    (effect.acks, 0)
                }
                Step::Fail => {
                    let Output::Notice((told, _)) = rooms.handle(Input::FailAndTell {
                        room,
                        reason: "x".into(),
                    }) else {
                        panic!()
                    };
                    (Vec::new(), told.len())
                }
                Step::Conclude(ok) => {
                    rooms.handle(Input::Conclude {
                        room,
                        status: if ok { KvPoll::Success } else { KvPoll::Failed },
                        targets: None,
                        reason: None,
                    });
                    (Vec::new(), 0)
                }
                Step::Clear => {
                    let Output::Cleared(_, acks) = rooms.handle(Input::Clear { room }) else {
                        panic!()
                    };
                    (acks, 0)
                }
                Step::Open => {
                    rooms.handle(Input::Open { room, dummy: false });
                    // A reopened room id is a new request only once its
                    // old one is gone; an aborted one stays failed.
                    aborted &= state(&mut rooms, room) == Some(KvPoll::Failed);
                    (Vec::new(), 0)
                }
            };
            prop_assert!(
                acks.is_empty() || in_flight == 0,
                "ABORT ACK with {in_flight} chunk(s) in flight"
            );
            prop_assert!(
                told == 0 || in_flight == 0,
                "Failed told with {in_flight} chunk(s) in flight"
            );
        }
    }
}
