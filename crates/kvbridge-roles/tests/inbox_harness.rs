//! The inbox fuzzing harness holds its invariant under hand-made hostile
//! sequences (the fuzz target `inbox_sequence` drives it with random ones).
// Test code: a failed unwrap is a failed test.
#![allow(clippy::unwrap_used)]

use kvbridge_roles::KvPoll;
use kvbridge_roles::fuzzing::InboxHarness;
use kvbridge_wire::{
    Abort, AbortAck, AuxData, ChunkReady, StagingReq, StagingRsp, StateData, Status, Watermark,
};

fn frames(parts: Vec<std::borrow::Cow<'_, [u8]>>) -> Vec<Vec<u8>> {
    parts.into_iter().map(|p| p.into_owned()).collect()
}

#[test]
fn hostile_sequences_leave_other_pages_untouched() {
    let mut h = InboxHarness::new().unwrap();
    h.check().unwrap();
    // Writes naming every room, aimed across the whole address space of
    // the pools: canary pages must stay as they are.
    for room in 0..5u64 {
        for dst in (0..64u64).map(|i| i * 0x40) {
            let m = StateData {
                room,
                dst_addr: dst,
                data: vec![0xee; 64].into(),
            };
            h.feed_decode(&frames(m.encode()));
            let a = AuxData {
                room,
                buffer_index: 0,
                aux_index: dst % 8,
                data: vec![0xee; 16].into(),
            };
            h.feed_decode(&frames(a.encode()));
        }
        let s = Status {
            room,
            status: KvPoll::Success,
            prefill_rank: room,
            failure_reason: None,
        };
        h.feed_decode(&frames(s.encode()));
        let ack = AbortAck {
            room,
            prefill_rank: Some(0),
            generation: None,
        };
        h.feed_decode(&frames(ack.encode()));
        let abort = Abort {
            room,
            decode_ip: "127.0.0.1".into(),
            decode_port: 1,
            generation: Some(1),
        };
        h.feed_prefill(&frames(abort.encode()));
        h.poll();
    }
    h.check().unwrap();
    h.feed_decode(&[b"garbage".to_vec()]);
    h.feed_prefill(&[b"garbage".to_vec(), vec![0xff; 3]]);
    h.check().unwrap();
}

#[test]
fn hostile_staging_messages_scatter_only_into_live_rooms_pages() {
    let mut h = InboxHarness::new().unwrap();
    // Allocations for every room (live or not), any chunk size, then chunk
    // notices naming every page range, from every rank number.
    for room in 0..6u64 {
        for (chunk, pages) in [(0u64, 1u64), (1, 2), (2, 64), (u64::MAX, u64::MAX), (0, 0)] {
            let r = StagingReq {
                room,
                chunk_idx: chunk,
                chunk_num_pages: pages,
                session_id: "127.0.0.1:1".into(),
                requester_pp_rank: Some(0),
            };
            h.feed_decode(&frames(r.encode()));
        }
    }
    assert!(h.staging_allocations() > 0, "live rooms got allocations");
    for room in 0..6u64 {
        for chunk in [0u64, 1, 2, 7] {
            for (start, pages) in [(0u64, 1u64), (0, 2), (1, 2), (2, 1), (u64::MAX, 2), (0, 64)] {
                for rank in [0u64, 1, 2] {
                    let c = ChunkReady {
                        room,
                        chunk_idx: chunk,
                        page_start: start,
                        num_pages: pages,
                        session_id: "127.0.0.1:1".into(),
                        prefill_unique_rank: Some(rank),
                    };
                    h.feed_decode(&frames(c.encode()));
                }
            }
        }
        let rsp = StagingRsp {
            room,
            chunk_idx: 0,
            offset: -2,
            round: i64::MAX,
            end: i64::MIN,
            session_id: "127.0.0.1:1".into(),
        };
        h.feed_prefill(&frames(rsp.encode()));
        let wm = Watermark {
            wm_round: u64::MAX,
            wm_tail: u64::MAX,
            session_id: "127.0.0.1:1".into(),
        };
        h.feed_prefill(&frames(wm.encode()));
        h.poll();
    }
    h.check().unwrap();
}
