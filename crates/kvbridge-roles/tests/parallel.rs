//! Every TP pairing the planner supports, PP stages and MLA, through real
//! managers: each decode rank verifies every byte of its head slice.
// Test code: a failed unwrap is a failed test.
#![allow(clippy::unwrap_used)]

mod common;

use common::*;
use std::sync::atomic::Ordering;

use kvbridge_roles::KvPoll;

fn check(model_mla: bool, layers: u64, prefill_tp: u64, prefill_pp: u64, decode_tp: u64) {
    let model = tiny_model(model_mla, layers);
    let cluster = Cluster::new(model, prefill_tp, prefill_pp, decode_tp, 64);
    check_cluster(cluster);
}

/// Head slicing with engines that take strided runs: every byte still
/// arrives, and the workers handed the engines runs (one per page run),
/// not one block per token.
fn check_runs(prefill_tp: u64, decode_tp: u64) {
    let model = tiny_model(false, 2);
    let engines = std::sync::Mutex::new(Vec::new());
    let cluster = Cluster::with_prefill_engines(model, prefill_tp, 1, decode_tp, 64, || {
        let e = RunsEngine::new();
        engines.lock().unwrap().push(e.clone());
        e
    });
    check_cluster(cluster);
    let engines = engines.into_inner().unwrap();
    let runs: u64 = engines.iter().map(|e| e.runs.load(Ordering::Relaxed)).sum();
    let copies: u64 = engines
        .iter()
        .map(|e| e.copies.load(Ordering::Relaxed))
        .sum();
    assert!(runs > 0, "the workers handed over runs");
    assert!(
        copies >= 2 * runs,
        "runs of several tokens ({copies} copies in {runs} runs)"
    );
}

fn check_cluster(mut cluster: Cluster) {
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

#[test]
fn mha_tp_2_to_1_as_strided_runs() {
    check_runs(2, 1);
}

#[test]
fn mha_tp_1_to_4_as_strided_runs() {
    check_runs(1, 4);
}
