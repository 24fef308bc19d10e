//! What an operator meets first, as real OS processes: invalid demo
//! combinations refused before anything starts, signals that leave no rank
//! process and no temporary file behind, an unreachable bootstrap server
//! that fails a decode rank within the stated time, logging controlled by
//! `KVBRIDGE_LOG` / `RUST_LOG` without colour codes in files, and the wire
//! bridge's round trip.
// Test code: a failed unwrap is a failed test.
#![allow(clippy::unwrap_used)]

use std::io::{BufRead, BufReader, Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

const BIN: &str = env!("CARGO_BIN_EXE_kvbridge");

/// A fresh, empty directory for one test's `TMPDIR`.
fn fresh_tmp(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("kvbridge-op-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn entries(dir: &Path) -> Vec<String> {
    std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect()
}

fn output(args: &[&str], env: &[(&str, &str)]) -> Output {
    let mut cmd = Command::new(BIN);
    cmd.args(args).stdin(Stdio::null());
    for (k, v) in env {
        cmd.env(k, v);
    }
    cmd.output().unwrap()
}

/// The direct children of `pid` (Linux `/proc`).
fn children_of(pid: u32) -> Vec<u32> {
    let path = format!("/proc/{pid}/task/{pid}/children");
    std::fs::read_to_string(path)
        .unwrap_or_default()
        .split_whitespace()
        .filter_map(|p| p.parse().ok())
        .collect()
}

/// Whether `pid` still runs (a zombie counts as gone).
fn alive(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .map(|s| {
            let state = s.rsplit(')').next().unwrap_or("").split_whitespace().next();
            state != Some("Z")
        })
        .unwrap_or(false)
}

fn wait_until(timeout: Duration, mut f: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + timeout;
    while Instant::now() < deadline {
        if f() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    f()
}

#[test]
fn invalid_demo_combinations_are_refused_before_anything_starts() {
    let tmp = fresh_tmp("combos");
    let tmp_s = tmp.to_str().unwrap();
    for (args, says) in [
        (
            &["--prefill-tp", "3", "--decode-tp", "4"][..],
            "8 KV heads cannot be split over TP 3",
        ),
        (
            &[
                "--model",
                "deepseek-v3",
                "--prefill-tp",
                "3",
                "--decode-tp",
                "4",
            ][..],
            "decode TP 4 is not a multiple of prefill TP 3",
        ),
        (
            &[
                "--model",
                "deepseek-v3",
                "--prefill-tp",
                "4",
                "--decode-tp",
                "6",
            ][..],
            "decode TP 6 is not a multiple of prefill TP 4",
        ),
        (
            &[
                "--model",
                "deepseek-v3",
                "--prefill-cp",
                "2",
                "--decode-tp",
                "2",
                "--decode-cp",
                "2",
            ][..],
            "needs a prefill without context parallelism",
        ),
    ] {
        let start = Instant::now();
        let out = output(&[&["demo"][..], args].concat(), &[("TMPDIR", tmp_s)]);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{args:?}: {stderr}");
        assert!(stderr.contains(says), "{args:?}: {stderr}");
        assert!(out.stdout.is_empty(), "{args:?}");
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "{args:?} took long"
        );
        assert!(
            entries(&tmp).is_empty(),
            "{args:?} started something: {:?}",
            entries(&tmp)
        );
    }
    let _ = std::fs::remove_dir_all(&tmp);
}

/// Starts a long demo with its own `TMPDIR`; returns it once a rank runs.
fn long_demo(tmp: &Path) -> (Child, Vec<u32>) {
    let child = Command::new(BIN)
        .args(["demo", "--requests", "20000", "--concurrency", "2"])
        .env("TMPDIR", tmp)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let pid = child.id();
    let mut ranks = Vec::new();
    assert!(
        wait_until(Duration::from_secs(60), || {
            ranks = children_of(pid);
            ranks.len() >= 2
        }),
        "the demo started no rank processes"
    );
    (child, ranks)
}

#[test]
fn sigterm_stops_the_demo_its_ranks_and_removes_its_files() {
    let tmp = fresh_tmp("term");
    let (mut demo, ranks) = long_demo(&tmp);
    assert!(
        !entries(&tmp).is_empty(),
        "the demo keeps its files in TMPDIR"
    );
    // SAFETY: plain kill(2) on a child process id this test owns.
    assert_eq!(unsafe { libc::kill(demo.id() as i32, libc::SIGTERM) }, 0);
    let exited = wait_until(Duration::from_secs(20), || {
        demo.try_wait().unwrap().is_some()
    });
    assert!(exited, "the demo ignored SIGTERM");
    let status = demo.wait().unwrap();
    let mut stderr = String::new();
    demo.stderr
        .take()
        .unwrap()
        .read_to_string(&mut stderr)
        .unwrap();
    assert_eq!(status.code(), Some(143), "{stderr}");
    assert!(stderr.contains("stopped by SIGTERM"), "{stderr}");
    for pid in ranks {
        assert!(
            wait_until(Duration::from_secs(5), || !alive(pid)),
            "rank process {pid} outlived the demo"
        );
    }
    assert!(entries(&tmp).is_empty(), "left behind: {:?}", entries(&tmp));
    let _ = std::fs::remove_dir_all(&tmp);
}

#[test]
fn ranks_of_a_killed_demo_exit_on_their_own() {
    let tmp = fresh_tmp("kill");
    let (mut demo, ranks) = long_demo(&tmp);
    demo.kill().unwrap();
    demo.wait().unwrap();
    for pid in ranks {
        assert!(
            wait_until(Duration::from_secs(10), || !alive(pid)),
            "rank process {pid} outlived its SIGKILLed demo"
        );
    }
    let _ = std::fs::remove_dir_all(&tmp);
}

#[test]
fn a_decode_rank_with_a_bad_bootstrap_address_fails_with_the_reason() {
    let base = [
        "decode",
        "--model",
        "llama3-8b",
        "--tp",
        "1",
        "0",
        "--pages",
        "16",
    ];
    // Malformed: at once.
    let start = Instant::now();
    let out = output(&[&base[..], &["--bootstrap-addr", "no-port"]].concat(), &[]);
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("has no port"));
    assert!(!String::from_utf8_lossy(&out.stdout).contains("\"ready\""));
    assert!(start.elapsed() < Duration::from_secs(10));
    // Unreachable: within the stated 30 s, never "ready".
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let addr = format!("127.0.0.1:{port}");
    let start = Instant::now();
    let out = output(&[&base[..], &["--bootstrap-addr", &addr]].concat(), &[]);
    let took = start.elapsed();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("not reachable within 30 s"), "{stderr}");
    assert!(!String::from_utf8_lossy(&out.stdout).contains("\"ready\""));
    assert!(took < Duration::from_secs(45), "{took:?}");
}

/// Runs `kvbridge bootstrap --port 0` with `env` until it is listening,
/// stops it, and returns its stderr.
fn bootstrap_stderr(env: &[(&str, &str)]) -> String {
    let mut cmd = Command::new(BIN);
    cmd.args(["bootstrap", "--host", "localhost", "--port", "0"])
        .env_remove("KVBRIDGE_LOG")
        .env_remove("RUST_LOG")
        .stdin(Stdio::null())
        .stderr(Stdio::piped());
    for (k, v) in env {
        cmd.env(k, v);
    }
    let mut child = cmd.spawn().unwrap();
    let mut lines = BufReader::new(child.stderr.take().unwrap()).lines();
    let mut before = Vec::new();
    loop {
        let line = lines.next().unwrap().unwrap();
        if line.starts_with("listening on 127.0.0.1:") {
            break;
        }
        before.push(line);
    }
    // SAFETY: plain kill(2) on a child process id this test owns.
    assert_eq!(unsafe { libc::kill(child.id() as i32, libc::SIGTERM) }, 0);
    before.extend(lines.map_while(Result::ok));
    assert_eq!(child.wait().unwrap().code(), Some(0));
    before.join("\n")
}

#[test]
fn rust_log_and_kvbridge_log_filter_the_log_without_colour_codes() {
    let quiet = bootstrap_stderr(&[]);
    assert!(!quiet.contains("INFO"), "warn is the default: {quiet}");
    let info = bootstrap_stderr(&[("RUST_LOG", "info")]);
    assert!(
        info.contains("INFO") && info.contains("stopping bootstrap server"),
        "{info}"
    );
    assert!(!info.contains('\x1b'), "colour codes in a pipe: {info:?}");
    // KVBRIDGE_LOG wins over RUST_LOG.
    let ours = bootstrap_stderr(&[("RUST_LOG", "info"), ("KVBRIDGE_LOG", "error")]);
    assert!(!ours.contains("INFO"), "{ours}");
    let bad = bootstrap_stderr(&[("KVBRIDGE_LOG", "=!=")]);
    assert!(bad.contains("KVBRIDGE_LOG is not a log filter"), "{bad}");
}

#[test]
fn wire_encode_pipes_into_wire_decode() {
    let message = r#"{"kind":"abort","room":5,"decode_ip":"10.0.0.2","decode_port":7001}"#;
    let encode = Command::new(BIN)
        .args(["wire", "encode"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    encode
        .stdin
        .as_ref()
        .unwrap()
        .write_all(message.as_bytes())
        .unwrap();
    let frames = encode.wait_with_output().unwrap();
    assert!(frames.status.success());
    let decode = Command::new(BIN)
        .args(["wire", "decode", "--to", "prefill"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    decode
        .stdin
        .as_ref()
        .unwrap()
        .write_all(&frames.stdout)
        .unwrap();
    let back = decode.wait_with_output().unwrap();
    assert!(back.status.success());
    let got: serde_json::Value = serde_json::from_slice(&back.stdout).unwrap();
    let want: serde_json::Value = serde_json::from_str(message).unwrap();
    assert_eq!(got, want);
    // Without --to the input is not the contract's JSON: exit 2.
    let bare = Command::new(BIN)
        .args(["wire", "decode"])
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    bare.stdin
        .as_ref()
        .unwrap()
        .write_all(&frames.stdout)
        .unwrap();
    assert_eq!(bare.wait_with_output().unwrap().status.code(), Some(2));
}

#[test]
fn the_readme_shows_the_help_the_binary_prints() {
    let readme =
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../../README.md")).unwrap();
    let start = readme.find("```text\n").unwrap() + "```text\n".len();
    let end = start + readme[start..].find("```").unwrap();
    let out = output(&["--help"], &[]);
    assert!(out.status.success());
    assert_eq!(
        &readme[start..end],
        String::from_utf8_lossy(&out.stdout),
        "README.md's help block is stale: paste `kvbridge --help` into it"
    );
}
