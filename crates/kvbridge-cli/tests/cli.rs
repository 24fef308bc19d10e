//! The `kvbridge` binary as other programs use it (docs/cli.md): the wire
//! JSON format, the bootstrap server, and the demo with its fault flags, all
//! as real OS processes.
// Test code: a failed unwrap is a failed test.
#![allow(clippy::unwrap_used)]

use std::io::{BufRead, BufReader, Read, Write};
use std::process::{Command, Stdio};
use std::time::Duration;

const BIN: &str = env!("CARGO_BIN_EXE_kvbridge");

fn run_stdin(args: &[&str], input: &str) -> (i32, String) {
    let mut child = Command::new(BIN)
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("spawn kvbridge");
    child
        .stdin
        .take()
        .unwrap()
        .write_all(input.as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).trim().to_owned(),
    )
}

#[test]
fn wire_decode_and_encode_follow_the_contract() {
    // A status message as sglang's Mooncake connector sends it: [room, status, rank].
    let (code, out) = run_stdin(
        &["wire", "decode"],
        r#"{"to": "decode", "frames": ["3939", "34", "35"]}"#,
    );
    assert_eq!(code, 0);
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(
        v,
        serde_json::json!({"kind": "status", "room": 99, "status": 4, "prefill_rank": 5, "failure_reason": null})
    );
    let (code, out) = run_stdin(&["wire", "encode"], &out);
    assert_eq!(code, 0);
    assert_eq!(
        serde_json::from_str::<serde_json::Value>(&out).unwrap(),
        serde_json::json!({"frames": ["3939", "34", "35"]})
    );
    // Malformed frames: an error object, exit 0.
    let (code, out) = run_stdin(
        &["wire", "decode"],
        r#"{"to": "prefill", "frames": ["41424f5254", "3939"]}"#,
    );
    assert_eq!(code, 0);
    assert!(out.starts_with(r#"{"error":"#), "{out}");
    // Not the expected JSON, an unknown side, odd hex: exit 2.
    for bad in [
        "[]",
        r#"{"to": "middle", "frames": []}"#,
        r#"{"to": "decode", "frames": ["abc"]}"#,
        "nope",
    ] {
        assert_eq!(run_stdin(&["wire", "decode"], bad).0, 2, "{bad}");
    }
    // Direction is enforced.
    let (_, out) = run_stdin(
        &["wire", "decode"],
        r#"{"to": "decode", "frames": ["41424f5254", "3939", "6970", "31"]}"#,
    );
    assert!(out.contains("error"), "{out}");
}

fn http(addr: &str, request: &str) -> String {
    let mut s = std::net::TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    s.write_all(request.as_bytes()).unwrap();
    let mut out = String::new();
    let _ = s.read_to_string(&mut out);
    out
}

#[test]
fn bootstrap_serves_sglang_routes_and_exits_cleanly_on_sigterm() {
    let mut child = Command::new(BIN)
        .args(["bootstrap", "--host", "127.0.0.1", "--port", "0"])
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut stderr = BufReader::new(child.stderr.take().unwrap());
    let mut line = String::new();
    stderr.read_line(&mut line).unwrap();
    let addr = line
        .trim()
        .strip_prefix("listening on ")
        .expect("listening line")
        .to_owned();
    let body = r#"{"attn_tp_size": 1, "attn_tp_rank": 0, "attn_cp_size": 1, "attn_cp_rank": 0, "attn_dp_size": 1, "attn_dp_rank": 0, "pp_size": 1, "pp_rank": 0, "system_dp_size": 1, "system_dp_rank": 0, "rank_ip": "127.0.0.1", "rank_port": 17000, "page_size": 16, "kv_cache_dtype": "auto"}"#;
    // No Content-Type at all: accepted anyway, as sglang's server does.
    let put = http(
        &addr,
        &format!(
            "PUT /route HTTP/1.1\r\nHost: x\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
            body.len()
        ),
    );
    assert!(put.starts_with("HTTP/1.1 200"), "{put}");
    let info = http(
        &addr,
        "GET /route?prefill_dp_rank=-1&prefill_cp_rank=-1&target_tp_rank=-1&target_pp_rank=-1 HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
    );
    assert!(
        info.contains(r#""attn_tp_size":1"#) && info.contains(r#""target_tp_rank":null"#),
        "{info}"
    );
    let rank = http(
        &addr,
        "GET /route?prefill_dp_rank=0&prefill_cp_rank=0&target_tp_rank=0&target_pp_rank=0 HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
    );
    assert!(rank.contains(r#""rank_port":17000"#), "{rank}");
    let bad = http(
        &addr,
        "PUT /route HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\nConnection: close\r\n\r\n{x}",
    );
    assert!(bad.starts_with("HTTP/1.1 400"), "{bad}");
    let health = http(
        &addr,
        "GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
    );
    assert!(
        health.starts_with("HTTP/1.1 200") && health.ends_with("OK"),
        "{health}"
    );
    // SIGTERM: exit status 0.
    let pid = child.id().to_string();
    assert!(
        Command::new("kill")
            .args(["-TERM", &pid])
            .status()
            .unwrap()
            .success()
    );
    assert_eq!(child.wait().unwrap().code(), Some(0));
}

fn demo(extra: &[&str]) -> (i32, serde_json::Value) {
    let mut args = vec!["demo", "--json"];
    args.extend_from_slice(extra);
    for (flag, default) in [
        ("--layers", "2"),
        ("--requests", "12"),
        ("--prompt-tokens", "48"),
        ("--chunk-tokens", "16"),
    ] {
        if !extra.contains(&flag) {
            args.extend_from_slice(&[flag, default]);
        }
    }
    let out = Command::new(BIN)
        .args(&args)
        .stderr(Stdio::inherit())
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    let json = serde_json::from_str(text.trim()).unwrap_or_else(|e| panic!("{e}: {text}"));
    (out.status.code().unwrap_or(-1), json)
}

fn assert_clean(code: i32, v: &serde_json::Value) {
    assert_eq!(code, 0, "{v}");
    assert_eq!(v["succeeded"], v["requests"], "{v}");
    assert_eq!(v["mismatched_bytes"], 0, "{v}");
    assert!(v["verified_bytes"].as_u64().unwrap() > 0);
    for key in [
        "requests",
        "succeeded",
        "failed",
        "bytes",
        "seconds",
        "gbps",
        "p50_ms",
        "p99_ms",
        "verified_bytes",
        "mismatched_bytes",
        "failures",
        "transfer_seconds",
        "transfer_gbps",
    ] {
        assert!(v.get(key).is_some(), "missing {key}");
    }
    // The transfer-only window lies inside the harness window.
    let (transfer, wall) = (
        v["transfer_seconds"].as_f64().unwrap(),
        v["seconds"].as_f64().unwrap(),
    );
    assert!(transfer > 0.0 && transfer <= wall * 1.05 + 0.01, "{v}");
    assert!(
        v["transfer_gbps"].as_f64().unwrap() >= v["gbps"].as_f64().unwrap() * 0.95,
        "{v}"
    );
}

#[test]
fn demo_verifies_every_byte_across_process_topologies() {
    for topology in [
        &["--prefill-tp", "1", "--decode-tp", "1"][..],
        &["--prefill-tp", "2", "--decode-tp", "1"],
        &["--prefill-tp", "1", "--decode-tp", "2"],
        &["--prefill-pp", "2", "--layers", "3"],
        &[
            "--model",
            "deepseek-v3",
            "--prefill-tp",
            "2",
            "--decode-tp",
            "1",
            "--page-size",
            "16",
        ],
    ] {
        let (code, v) = demo(topology);
        assert_clean(code, &v);
    }
}

#[test]
fn demo_stages_heterogeneous_tp_with_aborts_and_a_small_ring() {
    // About 3 MiB of KV per decode rank through a 1 MiB ring: it wraps
    // several times; aborted rooms give their ring space back (the run
    // would stall otherwise).
    let staged = [
        "--staging",
        "--staging-pool-mb",
        "1",
        "--prefill-tp",
        "2",
        "--decode-tp",
        "4",
        "--prompt-tokens",
        "256",
    ];
    let (code, v) = demo(&staged);
    assert_clean(code, &v);
    assert!(
        v["topology"].as_str().unwrap().contains("staging on"),
        "{v}"
    );
    let mut aborting = staged.to_vec();
    aborting.extend_from_slice(&["--abort-fraction", "0.3", "--requests", "16"]);
    let (code, v) = demo(&aborting);
    assert_eq!(code, 0, "{v}");
    assert_eq!(v["mismatched_bytes"], 0, "{v}");
    assert!(v["succeeded"].as_u64().unwrap() > 0, "{v}");
}

#[test]
fn demo_fault_flags_fail_some_rooms_with_reasons_while_others_succeed() {
    let (code, v) = demo(&["--kill-decode-after", "4", "--concurrency", "4"]);
    assert_eq!(code, 0, "{v}");
    assert_eq!(v["mismatched_bytes"], 0, "{v}");
    assert!(v["succeeded"].as_u64().unwrap() > 4, "{v}");
    let (code, v) = demo(&["--abort-fraction", "0.4", "--requests", "20"]);
    assert_eq!(code, 0, "{v}");
    assert_eq!(v["mismatched_bytes"], 0, "{v}");
    assert!(v["aborted"].as_u64().unwrap() > 0, "{v}");
    assert!(v["succeeded"].as_u64().unwrap() > 0, "{v}");
    for f in v["failures"].as_array().unwrap() {
        assert!(f["reason"].as_str().unwrap().len() > 5, "{f}");
        assert!(f["room"].as_u64().is_some());
    }
}

#[test]
fn demo_under_attack_from_a_host_without_the_secret_loses_nothing() {
    // Forged control messages for the run's own rooms to every rank, idle
    // and half-open engine connections, bodiless bootstrap writes, large
    // frames parked in zmq handshakes, unsigned bootstrap writes: in
    // secret mode (the demo's default) every room completes, byte-exact.
    let (code, v) = demo(&[
        "--rogue",
        "--prefill-tp",
        "2",
        "--decode-tp",
        "1",
        "--requests",
        "24",
        "--prompt-tokens",
        "256",
    ]);
    assert_clean(code, &v);
    let r = &v["rogue"];
    assert!(r["forged_messages"].as_u64().unwrap() > 0, "{v}");
    assert!(r["idle_connections"].as_u64().unwrap() > 0, "{v}");
    assert!(r["slow_bodies"].as_u64().unwrap() > 0, "{v}");
    assert!(r["parked_frames"].as_u64().unwrap() > 0, "{v}");
    assert!(r["bootstrap_writes"].as_u64().unwrap() > 0, "{v}");
    assert_eq!(r["bootstrap_accepted"], 0, "{v}");
    // The ranks' resources stayed bounded (the engines cap connections at
    // 1024; the attack holds 64 per engine).
    for key in ["max_rank_fds", "max_rank_threads"] {
        let n = r[key].as_u64().unwrap();
        assert!(n > 0 && n < 1200, "{key} = {n}: {v}");
    }
    assert!(r["max_rank_rss_mib"].as_u64().unwrap() < 4096, "{v}");
}

/// Without CUDA (forced here with `KVBRIDGE_NO_CUDA`, as on a GPU-less
/// machine) the GPU options stop with one clear "no CUDA" line.
#[test]
fn gpu_options_say_no_cuda_without_a_gpu() {
    for args in [
        &["demo", "--engine", "ipc", "--requests", "1"][..],
        &["demo", "--device", "--requests", "1"][..],
        &["bench", "ipc"][..],
        &["bench", "roles", "--engine", "ipc", "--device", "0"][..],
    ] {
        let out = Command::new(BIN)
            .args(args)
            .env("KVBRIDGE_NO_CUDA", "1")
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{args:?} must fail without CUDA");
        assert!(stderr.contains("no CUDA"), "{args:?}: {stderr}");
        assert!(!stderr.contains("panicked"), "{args:?}: {stderr}");
    }
}

#[test]
fn demo_model_presets_move_states_draft_layers_and_dcp_shares_byte_exact() {
    let runs: [&[&str]; 11] = [
        // Mamba slots TP-sliced 2 -> 1 out of two PP stages, with aborts.
        &[
            "--model",
            "qwen3-next",
            "--layers",
            "8",
            "--prefill-tp",
            "2",
            "--prefill-pp",
            "2",
        ],
        &[
            "--model",
            "qwen3-next",
            "--layers",
            "8",
            "--decode-tp",
            "2",
            "--abort-fraction",
            "0.3",
        ],
        // SWA: prompts longer than the 128-token window.
        &[
            "--model",
            "gpt-oss",
            "--layers",
            "4",
            "--prefill-tp",
            "2",
            "--decode-tp",
            "2",
            "--prompt-tokens",
            "300",
        ],
        // DSA indexer pages plus a draft layer, MLA TP 1 -> 2.
        &[
            "--model",
            "deepseek-v32",
            "--layers",
            "3",
            "--decode-tp",
            "2",
            "--draft-layers",
            "1",
        ],
        // Decode context parallelism: 2 groups of 2, a draft layer.
        &[
            "--model",
            "deepseek-v3",
            "--layers",
            "3",
            "--decode-tp",
            "4",
            "--decode-cp",
            "2",
            "--draft-layers",
            "1",
        ],
        // MHA draft layers over PP.
        &[
            "--model",
            "llama3-8b",
            "--prefill-pp",
            "2",
            "--draft-layers",
            "1",
        ],
        // Prefill context parallelism: rank 0 sends, or every CP rank a share.
        &["--prefill-cp", "2"],
        &[
            "--model",
            "qwen3-next",
            "--layers",
            "8",
            "--prefill-cp",
            "2",
            "--all-cp-ranks",
            "--prefill-tp",
            "2",
            "--decode-tp",
            "4",
        ],
        // Compressed MLA over PP stages into a HiSparse decode.
        &[
            "--model",
            "deepseek-v4",
            "--layers",
            "8",
            "--prefill-pp",
            "2",
            "--hisparse",
        ],
        // Prefill DP groups: routed by the bootstrap room, or registered and queried.
        &["--dp", "2"],
        &["--dp", "3", "--dp-round-robin", "--prefill-tp", "2"],
    ];
    for args in runs {
        let (code, v) = demo(args);
        if args.contains(&"--abort-fraction") {
            assert_eq!(code, 0, "{args:?}: {v}");
            assert_eq!(v["mismatched_bytes"], 0, "{args:?}: {v}");
            assert!(v["succeeded"].as_u64().unwrap() > 0, "{args:?}: {v}");
        } else {
            assert_clean(code, &v);
        }
    }
}

#[test]
fn demo_moves_swa_between_tp_sizes_and_refuses_what_cannot_work() {
    // SWA pages of an MHA model are head-sliced between different TP sizes
    // (NHD pages, as sglang 0.5.23 does): every room's bytes verify.
    for tp in [["--decode-tp", "2"], ["--prefill-tp", "2"]] {
        let (code, v) = demo(&[
            "--model",
            "gpt-oss",
            "--layers",
            "4",
            tp[0],
            tp[1],
            "--requests",
            "3",
        ]);
        assert_eq!(code, 0, "{tp:?}: {v}");
        assert_eq!(v["succeeded"], 3, "{tp:?}: {v}");
    }
    let out = Command::new(BIN)
        .args(["demo", "--decode-cp", "2", "--decode-tp", "2"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("--decode-cp needs an MLA model"));
}

#[test]
fn demo_refuses_sizes_that_cannot_make_a_run_naming_the_flag() {
    for (args, want) in [
        (&["--requests", "0"][..], "--requests must be at least 1"),
        (
            &["--chunk-tokens", "0"],
            "--chunk-tokens must be at least 1",
        ),
        (&["--concurrency", "0"], "--concurrency must be at least 1"),
        (&["--layers", "0"], "--layers must be at least 1"),
        (&["--page-size", "0"], "--page-size must be at least 1"),
        (
            &["--abort-fraction", "1.5"],
            "--abort-fraction must be between 0 and 1",
        ),
        (
            &["--abort-fraction", "nan"],
            "--abort-fraction must be between 0 and 1",
        ),
        (&["--requests", "1000000000"], "more than a demo run takes"),
    ] {
        let out = Command::new(BIN).arg("demo").args(args).output().unwrap();
        assert!(!out.status.success(), "{args:?}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(want), "{args:?}: {err}");
    }
}

#[test]
fn human_results_go_to_stdout() {
    // `kvbridge demo > out.txt` and `bench tcp > out.txt` keep the result.
    let out = Command::new(BIN)
        .args([
            "demo",
            "--requests",
            "4",
            "--layers",
            "2",
            "--prompt-tokens",
            "32",
        ])
        .stderr(Stdio::null())
        .output()
        .unwrap();
    assert!(out.status.success());
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("0 mismatched"), "{text}");
    let out = Command::new(BIN)
        .args([
            "bench", "tcp", "--sizes", "65536", "--bytes", "1048576", "--runs", "1",
        ])
        .stderr(Stdio::null())
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("GB/s") && text.contains("64 KiB"), "{text}");
}
