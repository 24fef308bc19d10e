//! The four large benchmark scenarios (`synthetic::LargeCase`) plan to the
//! results sglang's code path produces for them: block count, bytes and a
//! digest of the canonical block list, recorded from the reference (sglang's
//! Mooncake connector) and sglang 0.5.23's helpers when the cases were
//! written (their full results are megabytes).

#![allow(clippy::unwrap_used)] // tests unwrap what they construct

use kvbridge_plan::synthetic::LargeCase;
use kvbridge_plan::{canonicalize, plan_scenario};

fn digest(blocks: &[kvbridge_plan::Block]) -> (usize, u64, u64) {
    let mut h: u64 = 0;
    let mut bytes = 0;
    for b in blocks {
        for x in [b.src, b.dst, b.len] {
            h = h.wrapping_mul(1_099_511_628_211) ^ x;
        }
        bytes += b.len;
    }
    (blocks.len(), bytes, h)
}

fn check(case: LargeCase, expected: (usize, u64, u64)) {
    let blocks = plan_scenario(&case.scenario()).unwrap();
    assert_eq!(digest(&canonicalize(&blocks)), expected, "{}", case.name());
}

#[test]
fn mha_equal_tp_128k() {
    check(
        LargeCase::MhaEqualTp128k,
        (1_757_921, 5_368_713_216, 0xf162_d1f2_4719_7000),
    );
}

#[test]
fn head_slice_tp8_to_2() {
    check(
        LargeCase::HeadSliceTp8To2,
        (3_145_729, 805_310_464, 0x4d33_6e82_3a01_1000),
    );
}

#[test]
fn mla_dcp4_draft() {
    check(
        LargeCase::MlaDcp4Draft,
        (499_762, 613_421_056, 0xb7d0_a9b4_bdc7_a900),
    );
}

#[test]
fn mla_dsa_128k() {
    check(
        LargeCase::MlaDsa128k,
        (32_819, 6_300_372_992, 0xc11c_8094_ca85_ec00),
    );
}

/// The head-slicing plan (3.1 M per-token blocks) is written on several
/// threads; its blocks and engine batches are the same for every count.
#[test]
fn head_slice_tp8_to_2_same_plan_on_any_thread_count() {
    use kvbridge_plan::{Planner, PreparedPeer};
    let inputs = LargeCase::HeadSliceTp8To2.scenario().inputs();
    let peer = PreparedPeer::new(&inputs.layout, inputs.registration.clone()).unwrap();
    let plan_with = |threads: usize| {
        let mut planner = Planner::new();
        planner.set_threads(threads);
        let plan = planner
            .plan_chunk(&inputs.layout, &peer, &inputs.request, &inputs.chunk)
            .unwrap();
        let batches: Vec<usize> = plan.kv_batches().map(<[_]>::len).collect();
        (plan.to_vec(), batches)
    };
    let (serial, serial_batches) = plan_with(1);
    assert_eq!(digest(&canonicalize(&serial)).0, 3_145_729);
    assert!(serial_batches.len() > 1, "one batch per buffer pair");
    for threads in [2, 3, 8] {
        let (blocks, batches) = plan_with(threads);
        assert!(blocks == serial, "{threads} threads: blocks differ");
        assert_eq!(batches, serial_batches, "{threads} threads: batches differ");
    }
}
