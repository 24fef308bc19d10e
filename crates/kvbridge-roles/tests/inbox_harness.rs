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

/// The staging forgeries of a member that serves none of the rooms (the
/// attacks of `staging_forgery.rs`), as `(target, frames)` messages of the
/// fuzz target `inbox_sequence` (bit 0: prefill inbox; bit 3: the
/// secret-mode harness), naming decode session `session`.
fn staging_forgeries(session: &str) -> Vec<(u8, Vec<Vec<u8>>)> {
    let mut out = Vec::new();
    let bogus_mac = |mut f: Vec<Vec<u8>>| {
        f.push(kvbridge_wire::mac_frame(&[0x5a; kvbridge_wire::MAC_LEN]));
        f
    };
    for room in 1..=3u64 {
        for chunk in 0..2u64 {
            for rank in 0..2u64 {
                let c = ChunkReady {
                    room,
                    chunk_idx: chunk,
                    page_start: chunk,
                    num_pages: 1,
                    session_id: session.into(),
                    prefill_unique_rank: Some(rank),
                };
                out.push((8, frames(c.encode())));
                out.push((8, bogus_mac(frames(c.encode()))));
            }
        }
        let r = StagingReq {
            room,
            chunk_idx: 0,
            chunk_num_pages: 7,
            session_id: session.into(),
            requester_pp_rank: Some(0),
        };
        out.push((8, frames(r.encode())));
        let rsp = StagingRsp {
            room,
            chunk_idx: 1,
            offset: 0,
            round: 0,
            end: 1 << 10,
            session_id: session.into(),
        };
        out.push((9, frames(rsp.encode())));
        out.push((9, bogus_mac(frames(rsp.encode()))));
    }
    let w = Watermark {
        wm_round: 1 << 20,
        wm_tail: 0,
        session_id: session.into(),
    };
    out.push((9, frames(w.encode())));
    out.push((9, bogus_mac(frames(w.encode()))));
    // Then poll the rooms (bit 1).
    out.push((10, vec![b"garbage".to_vec()]));
    out
}

/// A member's forgeries in a prefill rank's name (the attacks of
/// `member_forgery.rs`): status Success and Failed from each rank, aux and
/// state writes and ABORT_ACKs for every room, bare and with a made-up
/// MAC, each followed by a poll; as fuzz messages for the secret-mode
/// harness's decode inbox (bits 3 and 1).
fn member_forgeries() -> Vec<(u8, Vec<Vec<u8>>)> {
    let mut out = Vec::new();
    let mut push = |f: Vec<Vec<u8>>| {
        let mut with_mac = f.clone();
        with_mac.push(kvbridge_wire::mac_frame(&[0x5a; kvbridge_wire::MAC_LEN]));
        out.push((10, f));
        out.push((10, with_mac));
    };
    for room in 1..=3u64 {
        for prefill_rank in 0..2u64 {
            for status in [KvPoll::Success, KvPoll::Failed] {
                let m = Status {
                    room,
                    status,
                    prefill_rank,
                    failure_reason: None,
                };
                push(frames(m.encode()));
            }
            let m = AbortAck {
                room,
                prefill_rank: Some(prefill_rank),
                generation: Some(1),
            };
            push(frames(m.encode()));
        }
        let m = AuxData {
            room,
            buffer_index: 0,
            aux_index: room,
            data: vec![0xee; 16].into(),
        };
        push(frames(m.encode()));
        let m = StateData {
            room,
            dst_addr: 0,
            data: vec![0xee; 16].into(),
        };
        push(frames(m.encode()));
    }
    out
}

/// A member without pair keys speaks for the rooms' prefill ranks to the
/// secret-mode harness's decode: every message is dropped as unbound, no
/// room concludes and no byte of theirs changes. The same sequence is the
/// fuzz seed `fuzz/seeds/inbox_sequence/member_forgeries` (rewritten with
/// `KVBRIDGE_WRITE_SEEDS=1`).
#[test]
fn member_forgeries_bind_nothing_in_secret_mode() {
    let mut h = InboxHarness::secret().unwrap();
    let forgeries = member_forgeries();
    for (_, f) in &forgeries {
        h.feed_decode(f);
        h.poll();
        h.check().unwrap();
    }
    assert_eq!(h.dropped("unbound"), forgeries.len() as u64);
    write_or_check_seed("member_forgeries", &fuzz_input(&forgeries));
}

/// Writes `seed` as `fuzz/seeds/inbox_sequence/<name>` under
/// `KVBRIDGE_WRITE_SEEDS=1`; otherwise requires the committed one to equal it.
fn write_or_check_seed(name: &str, seed: &[u8]) {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../fuzz/seeds/inbox_sequence")
        .join(name);
    if std::env::var_os("KVBRIDGE_WRITE_SEEDS").is_some() {
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(&path, seed).unwrap();
    }
    assert_eq!(
        std::fs::read(&path).ok().as_deref(),
        Some(seed),
        "{} is out of date: rerun with KVBRIDGE_WRITE_SEEDS=1",
        path.display()
    );
}

/// `messages` in the fuzz target's input format: `[target, frame count,
/// (len u16 LE, bytes)...]` each.
fn fuzz_input(messages: &[(u8, Vec<Vec<u8>>)]) -> Vec<u8> {
    let mut out = Vec::new();
    for (target, frames) in messages {
        assert!(frames.len() < 12, "the format carries at most 11 frames");
        out.push(*target);
        out.push(frames.len() as u8);
        for f in frames {
            out.extend_from_slice(&u16::try_from(f.len()).unwrap().to_le_bytes());
            out.extend_from_slice(f);
        }
    }
    out
}

/// A member without pair keys forges every staging message against the
/// secret-mode harness: all are dropped as unbound, nothing is scattered.
/// The same sequence is the fuzz seed `fuzz/seeds/inbox_sequence/
/// staging_forgeries` (rewritten with `KVBRIDGE_WRITE_SEEDS=1`).
#[test]
fn staging_forgeries_bind_nothing_in_secret_mode() {
    let mut h = InboxHarness::secret().unwrap();
    let forgeries = staging_forgeries(h.decode_session());
    let sent = forgeries.len();
    for (target, f) in &forgeries {
        if target & 1 == 1 {
            h.feed_prefill(f);
        } else {
            h.feed_decode(f);
        }
        if target & 2 != 0 {
            h.poll();
        }
        h.check().unwrap();
    }
    // Every staging message but the final garbage frame was unbound.
    assert_eq!(h.dropped("staging_unbound"), (sent - 1) as u64);
    // The open harness takes them as sglang would, within its invariant.
    let mut open = InboxHarness::new().unwrap();
    for (target, f) in staging_forgeries(open.decode_session()) {
        if target & 1 == 1 {
            open.feed_prefill(&f);
        } else {
            open.feed_decode(&f);
        }
        open.poll();
        open.check().unwrap();
    }
    write_or_check_seed(
        "staging_forgeries",
        &fuzz_input(&staging_forgeries("loopback:2")),
    );
}
