//! The inbox fuzzing harness holds its invariant under hand-made hostile
//! sequences (the fuzz target `inbox_sequence` drives it with random ones).
// Test code: a failed unwrap is a failed test.
#![allow(clippy::unwrap_used)]

use kvbridge_roles::KvPoll;
use kvbridge_roles::fuzzing::InboxHarness;
use kvbridge_wire::{Abort, AbortAck, AuxData, StateData, Status};

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
    h.feed_decode(&[b"garbage".to_vec()]);
    h.feed_prefill(&[b"garbage".to_vec(), vec![0xff; 3]]);
    h.check().unwrap();
}
