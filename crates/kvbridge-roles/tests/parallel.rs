//! Every TP pairing the planner supports, PP stages and MLA, through real
//! managers: each decode rank verifies every byte of its head slice.
// Test code: a failed unwrap is a failed test.
#![allow(clippy::unwrap_used)]

mod common;

use common::*;
use kvbridge_roles::KvPoll;

fn check(model_mla: bool, layers: u64, prefill_tp: u64, prefill_pp: u64, decode_tp: u64) {
    let model = tiny_model(model_mla, layers);
    let mut cluster = Cluster::new(model, prefill_tp, prefill_pp, decode_tp, 64);
    for (k, room) in [11u64, 12, 13].into_iter().enumerate() {
        let n = 5 + k * 3;
        let src: Vec<i32> = (0..n as i32).map(|i| 2 * i + k as i32).collect();
        let dst: Vec<i32> = (0..n as i32).map(|i| 63 - i - 10 * k as i32).collect();
        for (rank, (status, verified)) in cluster.run(room, &src, &dst, 2).into_iter().enumerate() {
            assert_eq!(status, KvPoll::Success, "decode rank {rank}");
            assert!(verified.bytes > 0);
            assert_eq!(verified.mismatched, 0, "decode rank {rank}: {verified:?}");
        }
    }
    cluster.shutdown();
}

#[test]
fn mha_tp_1_to_1() {
    check(false, 3, 1, 1, 1);
}

#[test]
fn mha_tp_2_to_1() {
    check(false, 3, 2, 1, 1);
}

#[test]
fn mha_tp_1_to_2() {
    check(false, 3, 1, 1, 2);
}

#[test]
fn mha_tp_4_to_2() {
    check(false, 2, 4, 1, 2);
}

#[test]
fn mha_tp_2_to_4() {
    check(false, 2, 2, 1, 4);
}

#[test]
fn mha_gqa_tp_2_to_16_replicates_heads() {
    check(false, 1, 2, 1, 16);
}

#[test]
fn mha_pp_2_to_pp_1() {
    check(false, 5, 1, 2, 1);
}

#[test]
fn mha_pp_2_tp_2_to_tp_1() {
    check(false, 4, 2, 2, 1);
}

#[test]
fn mla_tp_1_to_1() {
    check(true, 3, 1, 1, 1);
}

#[test]
fn mla_tp_2_to_1() {
    check(true, 3, 2, 1, 1);
}

#[test]
fn mla_tp_1_to_4() {
    check(true, 3, 1, 1, 4);
}

#[test]
fn mla_pp_3_to_pp_1() {
    check(true, 7, 1, 3, 1);
}
