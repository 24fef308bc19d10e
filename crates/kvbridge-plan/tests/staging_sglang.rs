//! The staging arithmetic against sglang 0.5.23's own, on a golden file of
//! its results (`fixtures/staging_sglang.json`, written by
//! `python/interop/staging_fixture.py` from the sglang wheel): head-slice
//! parameters for every TP pairing, rank and head count, region layouts,
//! chunk grids and watermark tests. A kvbridge decode or prefill must agree
//! with an sglang peer on every one of these, byte for byte.
// Test code: a failed unwrap is a failed test.
#![allow(clippy::unwrap_used)]

use kvbridge_plan::{grid_segments, head_slice_params, staging_layout, watermark_ready};
use serde_json::Value;

fn fixture() -> Value {
    serde_json::from_str(include_str!("fixtures/staging_sglang.json")).unwrap()
}

fn u(v: &Value) -> u64 {
    v.as_u64().unwrap()
}

#[test]
fn head_slice_params_match_sglang() {
    let f = fixture();
    let cases = f["head_slice_params"].as_array().unwrap();
    assert!(cases.len() > 1000);
    for c in cases {
        let c = c.as_array().unwrap();
        let got = head_slice_params(u(&c[0]), u(&c[1]), u(&c[2]), u(&c[3]), u(&c[4]));
        let want: Vec<u64> = c[5].as_array().unwrap().iter().map(u).collect();
        assert_eq!(
            [
                got.src_head_start,
                got.num_heads,
                got.dst_head_start,
                got.num_heads
            ],
            want[..],
            "case {c:?}"
        );
    }
}

#[test]
fn staging_layouts_match_sglang() {
    let f = fixture();
    for c in f["staging_layout"].as_array().unwrap() {
        let c = c.as_array().unwrap();
        let args: Vec<u64> = c[..7].iter().map(u).collect();
        let parts = staging_layout(
            args[0], args[1], args[2], args[3], args[4], args[5], args[6],
        )
        .unwrap();
        let want: Vec<u64> = c[7].as_array().unwrap().iter().map(u).collect();
        assert_eq!(parts, want, "case {c:?}");
        assert_eq!(parts.iter().sum::<u64>(), u(&c[8]));
    }
}

#[test]
fn grid_segments_match_sglang() {
    let f = fixture();
    for c in f["grid_segments"].as_array().unwrap() {
        let c = c.as_array().unwrap();
        let got = grid_segments(u(&c[0]), u(&c[1]), u(&c[2]), u(&c[3]));
        let want: Vec<(u64, u64)> = c[4]
            .as_array()
            .unwrap()
            .iter()
            .map(|s| (u(&s[0]), u(&s[1])))
            .collect();
        assert_eq!(got, want, "case {c:?}");
    }
}

#[test]
fn watermark_tests_match_sglang() {
    let f = fixture();
    for c in f["watermark_ready"].as_array().unwrap() {
        let c = c.as_array().unwrap();
        let wm = (u(&c[0][0]), u(&c[0][1]));
        let got = watermark_ready(wm, c[1].as_i64().unwrap(), c[2].as_i64().unwrap());
        assert_eq!(got, c[3].as_bool().unwrap(), "case {c:?}");
    }
}
