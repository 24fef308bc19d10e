//! Transitions of the decode rooms, every abort and failure path, and a
//! property: no event order drains a room while a rank told about it could
//! still write.

use std::collections::{HashMap, HashSet};
use std::time::{Duration, Instant};

use std::sync::Arc;

use kvbridge_plan::{PrefillLayout, StagingTarget};
use kvbridge_wire::{KvPoll, PairKey};
use proptest::prelude::*;

use super::*;

const ADDR: &str = "10.0.0.1:8998";
const TIMEOUT: Duration = Duration::from_secs(5);

fn key(rank: u64) -> PairKey {
    PairKey([rank as u8 + 1; 32])
}

/// Ranks `0..n`, each sending status, with a session and a key.
fn expected(n: u64) -> ExpectedRanks {
    ExpectedRanks {
        status: (0..n).collect(),
        all: (0..n).collect(),
        sessions: (0..n)
            .map(|r| (r, format!("10.0.0.1:{}", 7000 + r)))
            .collect(),
        keys: (0..n).map(|r| (r, key(r))).collect(),
    }
}

fn layout() -> PrefillLayout {
    PrefillLayout {
        page_size: 1,
        kv_data_ptrs: vec![0x10_0000],
        kv_item_lens: vec![64],
        aux_data_ptrs: vec![0x20_0000],
        aux_item_lens: vec![8],
        ..PrefillLayout::default()
    }
}

/// A room resolved to `n` ranks and asked into pages 0..4 and aux slot 0.
fn resolved(rooms: &mut DecodeRooms, room: u64, n: u64) {
    rooms.handle(Input::Open {
        room,
        addr: ADDR.into(),
    });
    assert_eq!(
        rooms.handle(Input::Resolved {
            room,
            required: n,
            expected: expected(n),
        }),
        Output::State(Some(KvPoll::WaitingForInput))
    );
    rooms.handle(Input::Asked {
        room,
        slots: RoomSlots::new(&[0, 1, 2, 3], 0, &[]),
    });
}

fn status(rooms: &mut DecodeRooms, room: u64, rank: u64, status: KvPoll) -> StatusEffect {
    let layout = layout();
    match rooms.handle(Input::Status {
        room,
        rank,
        status,
        reason: None,
        layout: &layout,
    }) {
        Output::Status(effect) => effect,
        other => panic!("a status answers a status effect, not {other:?}"),
    }
}

fn poll(rooms: &mut DecodeRooms, room: u64) -> Option<KvPoll> {
    match rooms.handle(Input::Poll { room }) {
        Output::State(s) => s,
        other => panic!("{other:?}"),
    }
}

fn stop(rooms: &mut DecodeRooms, room: u64, now: Instant) -> Output {
    rooms.handle(Input::StopWriters {
        room,
        with_generation: true,
        now,
    })
}

fn drain(rooms: &mut DecodeRooms, room: u64, needed: usize, now: Instant) -> Drain {
    match rooms.handle(Input::Drain {
        room,
        needed,
        ack_timeout: TIMEOUT,
        now,
    }) {
        Output::Drain(d) => d,
        other => panic!("{other:?}"),
    }
}

fn ack(rooms: &mut DecodeRooms, room: u64, rank: Option<u64>, generation: Option<u64>) -> Output {
    rooms.handle(Input::AbortAck {
        room,
        rank,
        generation,
    })
}

#[test]
fn a_room_succeeds_once_every_rank_reported_and_counts_its_bytes() {
    let mut rooms = DecodeRooms::default();
    rooms.handle(Input::Open {
        room: 7,
        addr: ADDR.into(),
    });
    assert_eq!(poll(&mut rooms, 7), Some(KvPoll::Bootstrapping));
    assert_eq!(
        status(&mut rooms, 7, 0, KvPoll::Success),
        StatusEffect::Foreign,
        "no rank is known before the room resolved"
    );
    resolved(&mut rooms, 7, 2);
    assert_eq!(
        status(&mut rooms, 7, 0, KvPoll::Success),
        StatusEffect::Counted
    );
    assert_eq!(
        status(&mut rooms, 7, 0, KvPoll::Success),
        StatusEffect::Counted,
        "a rank counts once"
    );
    let StatusEffect::Succeeded(Some((bytes, _))) = status(&mut rooms, 7, 1, KvPoll::Success)
    else {
        panic!("the second rank completes the room");
    };
    assert_eq!(bytes, 4 * 64 + 8, "four pages and the aux slot");
    assert_eq!(poll(&mut rooms, 7), Some(KvPoll::Success));
    rooms.handle(Input::Clear { room: 7 });
    assert_eq!(poll(&mut rooms, 7), None);
    assert_eq!(
        status(&mut rooms, 7, 1, KvPoll::Success),
        StatusEffect::Late
    );
    assert_eq!(
        rooms.handle(Input::StatusSender { room: 7, rank: 1 }),
        Output::Sender(Err(StatusEffect::Late))
    );
}

/// A decode layout of TP 1 that a prefill of TP 2 stages into: K and V,
/// four heads of two bytes per token.
fn staged_layout() -> PrefillLayout {
    PrefillLayout {
        page_size: 1,
        attn_tp_size: 1,
        kv_head_num: 4,
        total_kv_head_num: 4,
        kv_data_ptrs: vec![0x10_0000, 0x11_0000],
        kv_item_lens: vec![8, 8],
        ..PrefillLayout::default()
    }
}

#[test]
fn success_with_a_staging_chunk_never_scattered_fails_the_room() {
    let target = Arc::new(StagingTarget::new(&staged_layout(), 2).unwrap());
    for scattered in [false, true] {
        let mut rooms = DecodeRooms::default();
        resolved(&mut rooms, 9, 2);
        rooms.staging.insert(
            9,
            StagingRoom::with_one_chunk(target.clone(), vec![0, 1, 2, 3], scattered),
        );
        assert_eq!(
            status(&mut rooms, 9, 0, KvPoll::Success),
            StatusEffect::Counted
        );
        let last = status(&mut rooms, 9, 1, KvPoll::Success);
        if scattered {
            // Every chunk is in the pages: the room is complete.
            assert!(matches!(last, StatusEffect::Succeeded(_)), "{last:?}");
            assert_eq!(poll(&mut rooms, 9), Some(KvPoll::Success));
        } else {
            // Every writer's CHUNK_READY precedes its status: a chunk still
            // held was never written, so the pages are not the room's KV.
            assert_eq!(last, StatusEffect::Failed);
            assert_eq!(poll(&mut rooms, 9), Some(KvPoll::Failed));
            let reason = rooms.table.failure(9).unwrap_or_default().to_owned();
            assert!(reason.contains("never written"), "{reason}");
        }
    }
}

#[test]
fn status_senders_are_the_rooms_ranks_under_their_own_keys() {
    let mut rooms = DecodeRooms::default();
    resolved(&mut rooms, 1, 2);
    assert_eq!(
        rooms.handle(Input::StatusSender { room: 1, rank: 1 }),
        Output::Sender(Ok(Some(key(1))))
    );
    assert_eq!(
        rooms.handle(Input::StatusSender { room: 1, rank: 5 }),
        Output::Sender(Err(StatusEffect::Foreign))
    );
    assert_eq!(
        status(&mut rooms, 1, 5, KvPoll::Success),
        StatusEffect::Foreign
    );
    let Output::Keys(mut all) = rooms.handle(Input::Keys {
        room: 1,
        rank: None,
    }) else {
        panic!("keys answer keys");
    };
    all.sort_by_key(|k| k.0);
    assert_eq!(all, vec![key(0), key(1)]);
    assert_eq!(
        status(&mut rooms, 1, 0, KvPoll::Bootstrapping),
        StatusEffect::Ignored
    );
}

#[test]
fn a_prefill_failure_fails_the_room_and_an_echo_keeps_the_first_reason() {
    let mut rooms = DecodeRooms::default();
    resolved(&mut rooms, 2, 2);
    let layout = layout();
    let failed = rooms.handle(Input::Status {
        room: 2,
        rank: 0,
        status: KvPoll::Failed,
        reason: Some("prefill ran out of memory"),
        layout: &layout,
    });
    assert_eq!(failed, Output::Status(StatusEffect::Failed));
    assert_eq!(poll(&mut rooms, 2), Some(KvPoll::Failed));
    status(&mut rooms, 2, 1, KvPoll::Success);
    assert_eq!(
        poll(&mut rooms, 2),
        Some(KvPoll::Failed),
        "a late success cannot revive a failed room"
    );

    resolved(&mut rooms, 3, 1);
    rooms.handle(Input::Fail {
        room: 3,
        reason: "Aborted by AbortReq.".into(),
    });
    assert_eq!(status(&mut rooms, 3, 0, KvPoll::Failed), StatusEffect::Echo);
    assert_eq!(
        rooms.handle(Input::TakeFailure { room: 3 }),
        Output::Reason(Some("Aborted by AbortReq.".into()))
    );
}

#[test]
fn writes_land_only_in_the_rooms_slots_while_it_waits() {
    let mut rooms = DecodeRooms::default();
    let layout = layout();
    let takes = |rooms: &mut DecodeRooms, dst: u64, len: u64| {
        rooms.handle(Input::Takes {
            room: 4,
            layout: &layout,
            dst,
            len,
        }) == Output::Flag(true)
    };
    rooms.handle(Input::Open {
        room: 4,
        addr: ADDR.into(),
    });
    assert!(!takes(&mut rooms, 0x10_0000, 64), "not asked yet");
    resolved(&mut rooms, 4, 1);
    assert!(takes(&mut rooms, 0x10_0000, 64));
    assert!(takes(&mut rooms, 0x10_0000 + 3 * 64, 64));
    assert!(
        !takes(&mut rooms, 0x10_0000 + 4 * 64, 64),
        "page 4 is not the room's"
    );
    assert!(takes(&mut rooms, 0x20_0000, 8), "its aux slot");
    rooms.handle(Input::Fail {
        room: 4,
        reason: "timed out".into(),
    });
    assert!(
        !takes(&mut rooms, 0x10_0000, 64),
        "a failed room takes no writes"
    );
}

#[test]
fn an_abort_goes_out_once_and_drains_only_on_acks_of_its_generation() {
    let mut rooms = DecodeRooms::default();
    let t0 = Instant::now();
    assert_eq!(stop(&mut rooms, 5, t0), Output::Abort(None), "unknown room");
    resolved(&mut rooms, 5, 2);
    assert_eq!(
        rooms.handle(Input::AbortSent { room: 5 }),
        Output::Flag(false)
    );
    assert_eq!(drain(&mut rooms, 5, 2, t0), Drain::Waiting, "no ABORT yet");
    assert_eq!(
        ack(&mut rooms, 5, Some(0), Some(1)),
        Output::Ack {
            accepted: false,
            refused: false,
            unfence: None
        },
        "no ABORT went out: nothing awaited, dropped quietly"
    );
    let Output::Abort(Some(Some(generation))) = stop(&mut rooms, 5, t0) else {
        panic!("the first stop sends an ABORT with a generation");
    };
    assert_eq!(
        stop(&mut rooms, 5, t0),
        Output::Abort(None),
        "once per room"
    );
    assert_eq!(
        rooms.handle(Input::AbortSent { room: 5 }),
        Output::Flag(true)
    );
    // Stale, forged and foreign ACKs do not count.
    for (rank, g) in [
        (Some(0), Some(generation + 1)),
        (Some(0), None),
        (Some(9), Some(generation)),
        (None, None),
    ] {
        assert_eq!(
            ack(&mut rooms, 5, rank, g),
            Output::Ack {
                accepted: false,
                refused: true,
                unfence: None
            }
        );
    }
    assert_eq!(drain(&mut rooms, 5, 2, t0), Drain::Waiting);
    for rank in [0, 0, 1] {
        assert!(matches!(
            ack(&mut rooms, 5, Some(rank), Some(generation)),
            Output::Ack { accepted: true, .. }
        ));
    }
    assert_eq!(drain(&mut rooms, 5, 2, t0), Drain::Drained);
}

#[test]
fn unranked_acks_count_only_without_a_generation_and_at_most_once_per_rank() {
    let mut rooms = DecodeRooms::default();
    resolved(&mut rooms, 6, 2);
    let now = Instant::now();
    assert_eq!(
        rooms.handle(Input::StopWriters {
            room: 6,
            with_generation: false,
            now
        }),
        Output::Abort(Some(None))
    );
    for _ in 0..2 {
        assert!(matches!(
            ack(&mut rooms, 6, None, None),
            Output::Ack { accepted: true, .. }
        ));
    }
    assert!(matches!(
        ack(&mut rooms, 6, None, None),
        Output::Ack {
            accepted: false,
            refused: true,
            ..
        }
    ));
    assert_eq!(drain(&mut rooms, 6, 2, now), Drain::Drained);
}

#[test]
fn silent_ranks_are_reported_once_fenced_and_their_late_ack_lifts_the_fence() {
    let mut rooms = DecodeRooms::default();
    let t0 = Instant::now();
    resolved(&mut rooms, 8, 3);
    resolved(&mut rooms, 9, 3);
    let Output::Abort(Some(g8)) = stop(&mut rooms, 8, t0) else {
        panic!()
    };
    let Output::Abort(Some(g9)) = stop(&mut rooms, 9, t0) else {
        panic!()
    };
    ack(&mut rooms, 8, Some(0), g8);
    assert_eq!(drain(&mut rooms, 8, 3, t0 + TIMEOUT / 2), Drain::Waiting);
    let Drain::Overdue(silent) = drain(&mut rooms, 8, 3, t0 + TIMEOUT) else {
        panic!("past the deadline the silent ranks are named");
    };
    assert_eq!(
        silent,
        vec![
            (1, Some("10.0.0.1:7001".into())),
            (2, Some("10.0.0.1:7002".into()))
        ]
    );
    assert_eq!(
        drain(&mut rooms, 8, 3, t0 + TIMEOUT * 2),
        Drain::Waiting,
        "reported once"
    );
    // Rank 1 fenced; rank 2 cannot be: the room stays pinned.
    let fence = |rank: u64| {
        (
            rank,
            format!("10.0.0.1:{}", 7000 + rank),
            Some(format!("tcp://10.0.0.1:{}", 9000 + rank)),
        )
    };
    assert_eq!(
        rooms.handle(Input::Fenced {
            room: 8,
            needed: 3,
            fenced: vec![fence(1)]
        }),
        Output::Flag(false)
    );
    // Room 9's rank 1 is silent too, under the same session.
    drain(&mut rooms, 9, 3, t0 + TIMEOUT);
    rooms.handle(Input::Fenced {
        room: 9,
        needed: 3,
        fenced: vec![fence(1)],
    });
    let Output::Owed(mut owed) = rooms.handle(Input::OwedAborts { max: 10 }) else {
        panic!()
    };
    owed.sort();
    assert_eq!(
        owed,
        vec![
            (8, "tcp://10.0.0.1:9001".into(), g8),
            (9, "tcp://10.0.0.1:9001".into(), g9)
        ]
    );
    assert_eq!(rooms.handle(Input::OwedAborts { max: 1 }).owed_len(), 1);
    // Rank 2 answers late: room 8 drains.
    ack(&mut rooms, 8, Some(2), g8);
    assert_eq!(drain(&mut rooms, 8, 3, t0 + TIMEOUT * 2), Drain::Drained);
    // Room 8 is cleared; rank 1's ACK still settles what it owed, under
    // its own key, and the fence stays for room 9.
    rooms.handle(Input::Clear { room: 8 });
    assert_eq!(
        rooms.handle(Input::Keys {
            room: 8,
            rank: Some(1)
        }),
        Output::Keys(vec![key(1)])
    );
    assert_eq!(
        ack(&mut rooms, 8, Some(1), g8),
        Output::Ack {
            accepted: true,
            refused: false,
            unfence: None
        }
    );
    assert_eq!(
        ack(&mut rooms, 8, Some(1), g8),
        Output::Ack {
            accepted: false,
            refused: false,
            unfence: None
        },
        "answered twice for a cleared room: dropped quietly"
    );
    assert_eq!(
        ack(&mut rooms, 9, Some(1), g9),
        Output::Ack {
            accepted: true,
            refused: false,
            unfence: Some("10.0.0.1:7001".into())
        },
        "the last owed ACK lifts the fence"
    );
    assert_eq!(rooms.handle(Input::OwedAborts { max: 10 }).owed_len(), 0);
}

impl Output {
    fn owed_len(&self) -> usize {
        match self {
            Output::Owed(o) => o.len(),
            _ => usize::MAX,
        }
    }
}

#[test]
fn a_lost_server_fails_its_live_rooms_only() {
    let mut rooms = DecodeRooms::default();
    resolved(&mut rooms, 10, 1);
    resolved(&mut rooms, 11, 1);
    status(&mut rooms, 11, 0, KvPoll::Success);
    rooms.handle(Input::Open {
        room: 12,
        addr: "10.0.0.2:8998".into(),
    });
    // Room 13 moved to another server when re-created.
    resolved(&mut rooms, 13, 1);
    rooms.handle(Input::Open {
        room: 13,
        addr: "10.0.0.2:8998".into(),
    });
    assert_eq!(
        rooms.handle(Input::ServerLost {
            addr: ADDR,
            reason: "Lost connection".into()
        }),
        Output::Failed(1)
    );
    assert_eq!(poll(&mut rooms, 10), Some(KvPoll::Failed));
    assert_eq!(poll(&mut rooms, 11), Some(KvPoll::Success));
    assert_eq!(poll(&mut rooms, 12), Some(KvPoll::Bootstrapping));
    assert_eq!(poll(&mut rooms, 13), Some(KvPoll::WaitingForInput));
    assert_eq!(
        rooms.handle(Input::ServerLost {
            addr: ADDR,
            reason: "again".into()
        }),
        Output::Failed(0),
        "a server's rooms fail once"
    );
}

/// One step of a random history of one room with three ranks.
#[derive(Debug, Clone)]
enum Step {
    Fail,
    Stop,
    Ack(Option<u64>, Option<u64>),
    Status(u64, bool),
    Drain(u64),
    Fence(u64),
    Reopen,
}

fn step() -> impl Strategy<Value = Step> {
    prop_oneof![
        Just(Step::Fail),
        Just(Step::Stop),
        (proptest::option::of(0u64..4), proptest::option::of(0u64..3))
            .prop_map(|(r, g)| Step::Ack(r, g)),
        (0u64..4, any::<bool>()).prop_map(|(r, ok)| Step::Status(r, ok)),
        (0u64..8).prop_map(Step::Drain),
        (0u64..3).prop_map(Step::Fence),
        Just(Step::Reopen),
    ]
}

proptest! {
    /// Whatever arrives in whatever order, a room counts as drained only
    /// once every rank told about it acknowledged its ABORT (under the
    /// ABORT's own generation) or was fenced: no rank that could still
    /// write is left when its pages are released.
    #[test]
    fn no_event_order_drains_a_room_with_a_writer_left(
        steps in proptest::collection::vec(step(), 1..60),
        with_generation in any::<bool>(),
    ) {
        let mut rooms = DecodeRooms::default();
        let t0 = Instant::now();
        let room = 42;
        let ranks: HashSet<u64> = (0..3).collect();
        resolved(&mut rooms, room, 3);
        // The model: the ABORT's generation, ranks that acknowledged it,
        // unranked ACKs, fenced ranks.
        let mut sent: Option<Option<u64>> = None;
        let mut acked: HashSet<u64> = HashSet::new();
        let mut unranked = 0usize;
        let mut fenced: HashSet<u64> = HashSet::new();
        // Fences owed per rank, with the generation of the ABORT they owe
        // (they outlive the room's incarnation).
        let mut owed: HashMap<u64, Option<u64>> = HashMap::new();
        let mut clock = t0;
        for s in steps {
            match s {
                Step::Fail => {
                    rooms.handle(Input::Fail { room, reason: "x".into() });
                }
                Step::Stop => {
                    let out = rooms.handle(Input::StopWriters { room, with_generation, now: clock });
                    match (out, sent) {
                        (Output::Abort(Some(g)), None) => sent = Some(g),
                        (Output::Abort(None), Some(_)) => {}
                        (out, before) => prop_assert!(false, "stop answered {out:?} with {before:?} sent"),
                    }
                }
                Step::Ack(rank, g) => {
                    let out = ack(&mut rooms, room, rank, g);
                    let accepted = matches!(out, Output::Ack { accepted: true, .. });
                    let counts = match (rank, sent) {
                        (Some(r), Some(sent_g)) => ranks.contains(&r) && g == sent_g,
                        (None, Some(None)) => unranked < ranks.len(),
                        _ => false,
                    };
                    let settles = rank.is_some_and(|r| owed.get(&r) == Some(&g));
                    prop_assert_eq!(accepted, counts || settles, "{:?} {:?} {:?}", rank, g, sent);
                    if settles {
                        owed.remove(&rank.unwrap_or_default());
                    }
                    if counts {
                        match rank {
                            Some(r) => { acked.insert(r); }
                            None => unranked += 1,
                        }
                    }
                }
                Step::Status(rank, ok) => {
                    status(&mut rooms, room, rank, if ok { KvPoll::Success } else { KvPoll::Failed });
                }
                Step::Drain(secs) => {
                    clock += Duration::from_secs(secs);
                    let d = drain(&mut rooms, room, ranks.len(), clock);
                    if d == Drain::Drained {
                        prop_assert!(sent.is_some(), "drained before any ABORT");
                        prop_assert!(acked.len() + unranked + fenced.len() >= ranks.len());
                        if sent.flatten().is_some() {
                            prop_assert!(ranks.iter().all(|r| acked.contains(r) || fenced.contains(r)),
                                "a rank neither acknowledged nor fenced: {acked:?} {fenced:?}");
                        }
                    }
                    if let Drain::Overdue(silent) = d {
                        for (r, _) in silent {
                            prop_assert!(!acked.contains(&r) && !fenced.contains(&r));
                        }
                    }
                }
                Step::Fence(rank) => {
                    let out = rooms.handle(Input::Fenced {
                        room,
                        needed: ranks.len(),
                        fenced: vec![(rank, format!("s{rank}"), None)],
                    });
                    if let Some(generation) = sent {
                        fenced.insert(rank);
                        owed.insert(rank, generation);
                    }
                    if out == Output::Flag(true) {
                        prop_assert!(ranks.iter().all(|r| acked.contains(r) || fenced.contains(r))
                            || sent == Some(None));
                    }
                }
                Step::Reopen => {
                    // A new incarnation of the room: nothing carries over.
                    rooms.handle(Input::Clear { room });
                    resolved(&mut rooms, room, 3);
                    sent = None;
                    acked.clear();
                    unranked = 0;
                    fenced.clear();
                }
            }
        }
    }
}
