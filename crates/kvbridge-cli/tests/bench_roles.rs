//! `kvbridge bench roles`: rooms through a real prefill and decode role
//! pair against the raw engine, per layout: one JSON line per room size with
//! both figures, and every verified room byte exact.
// Test code: a failed unwrap is a failed test.
#![allow(clippy::unwrap_used)]

use std::process::Command;

const BIN: &str = env!("CARGO_BIN_EXE_kvbridge");

fn bench_roles(args: &[&str]) -> Vec<serde_json::Value> {
    let out = Command::new(BIN)
        .args(["bench", "roles", "--json"])
        .args(args)
        .args(if args.contains(&"--rooms") {
            &[][..]
        } else {
            &["--rooms", "2"][..]
        })
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{args:?}: {stderr}");
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

#[test]
fn rooms_and_raw_batches_for_every_layout() {
    for (layout, sizes, expected) in [
        ("mha", "1M,3M", [1u64 << 20, 3 << 20]),
        ("mla", "1M,3M", [1 << 20, 3 << 20]),
        ("hetero", "1M,3M", [1 << 20, 3 << 20]),
    ] {
        let lines = bench_roles(&["--layout", layout, "--sizes", sizes]);
        assert_eq!(lines.len(), 2, "{layout}: one line per size");
        for (v, want) in lines.iter().zip(expected) {
            assert_eq!(v["layout"], layout, "{v}");
            assert_eq!(v["engine"], "tcp", "{v}");
            let room = v["room_bytes"].as_u64().unwrap();
            // Whole pages (of one token at these sizes): at least the size
            // asked for, less than a token of every layer more.
            assert!(room >= want && room < want + (256 << 10), "{layout}: {v}");
            // Every slot's room (eight slots for four rooms in flight) is
            // verified before and after the timed streams: KV and aux.
            assert!(v["verified_bytes"].as_u64().unwrap() >= 16 * room, "{v}");
            // One room a stream, four in flight: no steady rate.
            assert!(v.get("steady_ratio").is_none(), "{v}");
            for key in ["roles_gbps", "engine_gbps", "ratio", "p50_ms", "p99_ms"] {
                assert!(v[key].as_f64().unwrap() > 0.0, "{key}: {v}");
            }
            assert!(v["p99_ms"].as_f64() >= v["p50_ms"].as_f64(), "{v}");
        }
    }
}

#[test]
fn rooms_in_flight_each_land_on_their_own_pages() {
    // Three rooms at once over six page slots, seven rooms streamed; before
    // and after, one room per slot with its own pattern is verified byte
    // for byte, so a room written over another's pages fails the run.
    let lines = bench_roles(&["--sizes", "1M", "--rooms", "7", "--in-flight", "3"]);
    assert_eq!(lines.len(), 1);
    let v = &lines[0];
    assert_eq!(v["in_flight"], 3, "{v}");
    assert_eq!(v["rooms"], 7, "{v}");
    let room = v["room_bytes"].as_u64().unwrap();
    // Two checks of six slots: KV and aux of twelve rooms.
    let verified = v["verified_bytes"].as_u64().unwrap();
    assert!(verified >= 12 * room && verified < 13 * room, "{v}");
    // Streams of four and three rooms, three in flight: one room concluded
    // once the pipeline was full.
    for key in ["roles_steady_gbps", "engine_steady_gbps", "steady_ratio"] {
        assert!(v[key].as_f64().unwrap() > 0.0, "{key}: {v}");
    }
}

#[test]
fn staging_on_moves_heterogeneous_rooms_too() {
    let lines = bench_roles(&["--layout", "hetero", "--sizes", "2M", "--staging", "on"]);
    assert_eq!(lines.len(), 1);
    assert!(
        lines[0]["verified_bytes"].as_u64().unwrap() > 0,
        "{}",
        lines[0]
    );
}

#[test]
fn refusals_say_why() {
    let out = Command::new(BIN)
        .args(["bench", "roles", "--rooms", "0"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("--rooms"));
}
