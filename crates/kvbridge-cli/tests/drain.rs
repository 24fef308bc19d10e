//! `kvbridge demo --drain-after-s`: a run sized in time ends without
//! failing the rooms in flight, also when a decode rank is stopped as the
//! drain begins; and the role switch's refusals. (The role switch itself
//! needs hosts of their own: `cargo xtask cluster` runs it as root.)
// Test code: a failed unwrap is a failed test.
#![allow(clippy::unwrap_used)]

use std::process::{Command, Stdio};

const BIN: &str = env!("CARGO_BIN_EXE_kvbridge");

fn demo(args: &[&str]) -> (i32, serde_json::Value) {
    let out = Command::new(BIN)
        .args(["demo", "--json", "--layers", "1", "--prompt-tokens", "48"])
        .args(["--chunk-tokens", "16"])
        .args(args)
        .stderr(Stdio::inherit())
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    let json = serde_json::from_str(text.trim()).unwrap_or_else(|e| panic!("{e}: {text}"));
    (out.status.code().unwrap_or(-1), json)
}

fn n(v: &serde_json::Value, key: &str) -> u64 {
    v[key].as_u64().unwrap_or_else(|| panic!("no {key} in {v}"))
}

#[test]
fn a_drained_run_ends_at_its_deadline_and_finishes_every_room_it_started() {
    let (code, v) = demo(&[
        "--requests",
        "200000",
        "--prefill-tp",
        "2",
        "--decode-tp",
        "2",
        "--concurrency",
        "64",
        "--drain-after-s",
        "2",
    ]);
    assert_eq!(code, 0, "{v}");
    assert!(n(&v, "drained") > 0, "{v}");
    assert_eq!(n(&v, "requests") + n(&v, "drained"), 200_000, "{v}");
    assert!(n(&v, "succeeded") > 0, "{v}");
    assert_eq!(n(&v, "succeeded"), n(&v, "requests"), "{v}");
    assert_eq!(n(&v, "failed"), 0, "{v}");
    assert_eq!(n(&v, "mismatched_bytes"), 0, "{v}");
}

#[test]
fn a_drain_waits_for_a_stopped_decode_rank_and_concludes_every_room() {
    // Decode rank 0 is stopped (SIGSTOP) for 4 s from its first room on,
    // the drain begins 2 s after the first room: it answers the pause only once resumed; every room
    // the run started still concludes, succeeded or failed with a reason.
    let (code, v) = demo(&[
        "--requests",
        "200000",
        "--decode-tp",
        "2",
        "--concurrency",
        "32",
        "--room-timeout-s",
        "2",
        "--fault",
        "stop-decode",
        "--fault-after",
        "1",
        "--fault-secs",
        "4",
        "--drain-after-s",
        "2",
    ]);
    assert_eq!(code, 0, "{v}");
    assert_eq!(v["fault"]["injected"], true, "{v}");
    assert!(n(&v, "drained") > 0, "{v}");
    assert_eq!(
        n(&v, "succeeded") + n(&v, "failed"),
        n(&v, "requests"),
        "{v}"
    );
    assert_eq!(n(&v, "mismatched_bytes"), 0, "{v}");
    for f in v["failures"].as_array().unwrap() {
        assert!(f["reason"].as_str().is_some_and(|r| r.len() > 5), "{f}");
    }
}

#[test]
fn drain_and_role_switch_refuse_what_cannot_work_naming_why() {
    for (args, want) in [
        (&["--drain-after-s", "0"][..], "--drain-after-s must be"),
        (
            &["--drain-after-s", "5", "--kill-decode-after", "3"],
            "cannot be used with",
        ),
        (&["--fault", "role-switch"], "needs --netns"),
        (
            &["--netns", "--fault", "role-switch", "--decode-tp", "2"],
            "as many prefill rank processes as decode ranks (1 and 2)",
        ),
        (
            &[
                "--netns",
                "--fault",
                "role-switch",
                "--kill-decode-after",
                "2",
            ],
            "do not run together",
        ),
    ] {
        let out = Command::new(BIN).arg("demo").args(args).output().unwrap();
        assert!(!out.status.success(), "{args:?}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(want), "{args:?}: {err}");
    }
}
