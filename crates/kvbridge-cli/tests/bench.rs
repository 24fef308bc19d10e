//! `kvbridge bench tcp` with its two ends started apart, as on two
//! machines (`--listen` / `--connect`): rows with the median, spread and
//! batch latency percentiles, byte counts with units, an SVG plot, and
//! clear refusals.
// Test code: a failed unwrap is a failed test.
#![allow(clippy::unwrap_used)]

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};

const BIN: &str = env!("CARGO_BIN_EXE_kvbridge");

/// A target listening on a free loopback port; its control address.
fn listening_target(extra: &[&str], env: &[(&str, &str)]) -> (Child, String) {
    let mut cmd = Command::new(BIN);
    cmd.args(["bench", "tcp", "--listen", "127.0.0.1:0", "--bytes", "4M"])
        .args(extra)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
    for (k, v) in env {
        cmd.env(k, v);
    }
    let mut child = cmd.spawn().unwrap();
    let mut lines = BufReader::new(child.stderr.take().unwrap()).lines();
    let addr = loop {
        let line = lines.next().unwrap().unwrap();
        if let Some(rest) = line.strip_prefix("bench target listening on ") {
            break rest.split_whitespace().next().unwrap().to_owned();
        }
    };
    // Keep draining its stderr so it never blocks on a full pipe.
    std::thread::spawn(move || for _ in lines {});
    (child, addr)
}

fn initiator(args: &[&str], env: &[(&str, &str)]) -> (i32, String, String) {
    let mut cmd = Command::new(BIN);
    cmd.args(["bench", "tcp"]).args(args).stdin(Stdio::null());
    for (k, v) in env {
        cmd.env(k, v);
    }
    let out = cmd.output().unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn an_initiator_connects_to_a_target_started_apart() {
    let (mut target, addr) = listening_target(&[], &[]);
    let plot = std::env::temp_dir().join(format!("kvbridge-bench-{}.svg", std::process::id()));
    let plot_s = plot.to_str().unwrap();
    // Two initiators one after the other: the target serves both.
    for _ in 0..2 {
        let (code, out, err) = initiator(
            &[
                "--connect",
                &addr,
                "--bytes",
                "4M",
                "--sizes",
                "4K,64K",
                "--runs",
                "3",
                "--json",
                "--plot",
                plot_s,
            ],
            &[],
        );
        assert_eq!(code, 0, "{err}");
        let rows: Vec<serde_json::Value> = out
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
        assert_eq!(rows.len(), 2, "{out}");
        for (row, size) in rows.iter().zip([4096u64, 65536]) {
            assert_eq!(row["engine"], "tcp");
            assert_eq!(row["block_size"], size);
            assert_eq!(row["bytes"], 4 << 20);
            assert_eq!(row["verified"], true, "the target checked the bytes: {row}");
            assert_eq!(row["runs_gbps"].as_array().unwrap().len(), 3);
            let (lo, mid, hi) = (
                row["gbps_min"].as_f64().unwrap(),
                row["gbps_median"].as_f64().unwrap(),
                row["gbps_max"].as_f64().unwrap(),
            );
            assert!(0.0 < lo && lo <= mid && mid <= hi, "{row}");
            assert_eq!(row["gbps"].as_f64().unwrap(), hi, "gbps is the best run");
            let lat = &row["batch_latency_us"];
            let p50 = lat["p50"].as_f64().unwrap();
            assert!(p50 > 0.0 && p50 <= lat["p99"].as_f64().unwrap(), "{row}");
            // 4 MiB in batches of 1024 blocks, 3 runs.
            let per_run = (4u64 << 20) / size / 1024;
            assert_eq!(row["batches"], 3 * per_run.max(1), "{row}");
        }
        // The human table goes to stderr with --json.
        assert!(err.contains("GB/s median"), "{err}");
        let svg = std::fs::read_to_string(&plot).unwrap();
        assert!(svg.starts_with("<svg") && svg.contains("throughput by block size"));
        assert!(svg.contains("64 KiB"), "block sizes label the x axis");
    }
    // A run that needs more than the target registered is refused by name.
    let (code, _, err) = initiator(&["--connect", &addr, "--bytes", "8M", "--sizes", "4K"], &[]);
    assert_eq!(code, 1);
    assert!(err.contains("--bytes 8388608"), "{err}");
    target.kill().unwrap();
    target.wait().unwrap();
    let _ = std::fs::remove_file(&plot);
}

#[test]
fn both_ends_started_apart_authenticate_with_the_shared_secret() {
    let secret = [(
        "KVBRIDGE_SECRET",
        "kvbridge-bench-test-secret-0123456789abcdef",
    )];
    let (mut target, addr) = listening_target(&["--auth"], &secret);
    let one_run = ["--bytes", "4M", "--sizes", "64K", "--runs", "1"];
    let (code, out, err) = initiator(
        &[&["--connect", &addr, "--auth"][..], &one_run].concat(),
        &secret,
    );
    assert_eq!(code, 0, "{err}");
    assert!(
        out.contains("GB/s median") && out.contains("64 KiB"),
        "{out}"
    );
    // Without the secret the target's engine refuses the writes.
    let (code, _, err) = initiator(&[&["--connect", &addr][..], &one_run].concat(), &[]);
    assert_ne!(code, 0, "an unauthenticated initiator was served: {err}");
    target.kill().unwrap();
    target.wait().unwrap();
}

#[test]
fn bad_bench_arguments_are_refused_with_the_reason() {
    for (args, says) in [
        (&["--bytes", "64X"][..], "unknown unit"),
        (&["--sizes", "4K,lots"][..], "not a byte count"),
        (
            &["--bytes", "1M", "--sizes", "2M"][..],
            "must be in 1..=--bytes",
        ),
        (&["--listen", "0.0.0.0:0"][..], "not a wildcard"),
        (
            &["--connect", "127.0.0.1:1", "--bytes", "1M", "--sizes", "4K"][..],
            "connecting to the bench target",
        ),
    ] {
        let (code, _, err) = initiator(args, &[]);
        assert_ne!(code, 0, "{args:?}");
        assert!(err.contains(says), "{args:?}: {err}");
    }
}
