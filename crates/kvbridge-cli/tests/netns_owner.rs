//! `kvbridge demo --netns` removes only what runs that are really gone left
//! behind: a run started in another PID namespace (where our run's process
//! id means nothing) must not delete a live run's namespaces.
//!
//! Needs root, `ip` and `unshare`; skipped (with a line saying so) without
//! them unless `KVBRIDGE_REQUIRE_NETNS=1`, which CI sets.

#![allow(clippy::unwrap_used)] // tests unwrap what they construct

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

const BIN: &str = env!("CARGO_BIN_EXE_kvbridge");

fn can_run() -> bool {
    let root = Command::new("id")
        .arg("-u")
        .output()
        .is_ok_and(|o| String::from_utf8_lossy(&o.stdout).trim() == "0");
    let tools = ["ip", "unshare"].iter().all(|t| {
        Command::new(t)
            .arg("-V")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok()
    });
    if !(root && tools) {
        assert!(
            std::env::var("KVBRIDGE_REQUIRE_NETNS").as_deref() != Ok("1"),
            "KVBRIDGE_REQUIRE_NETNS=1 but this is not root with ip and unshare"
        );
        eprintln!("skipping: needs root, ip and unshare");
        return false;
    }
    true
}

/// Kills the run if the test fails before waiting for it.
struct Running(Option<Child>);

impl Drop for Running {
    fn drop(&mut self) {
        if let Some(c) = self.0.as_mut() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

fn namespaces_of(pid: u32) -> usize {
    let out = Command::new("ip").args(["netns", "list"]).output().unwrap();
    let tag = format!("kvbns{pid}h");
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter(|l| l.starts_with(&tag))
        .count()
}

#[test]
fn a_run_in_another_pid_namespace_leaves_a_live_run_alone() {
    if !can_run() {
        return;
    }
    let long = Command::new(BIN)
        .args(["demo", "--netns", "--json", "--layers", "2"])
        .args(["--requests", "1500", "--prompt-tokens", "64"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let pid = long.id();
    let mut long = Running(Some(long));
    let deadline = Instant::now() + Duration::from_secs(30);
    // Bootstrap, prefill and decode: one host each.
    let hosts = 3;
    while namespaces_of(pid) < hosts {
        assert!(Instant::now() < deadline, "the long run made no namespaces");
        std::thread::sleep(Duration::from_millis(50));
    }
    // A second run in a fresh PID namespace: our pid is not alive there.
    let other = Command::new("unshare")
        .args(["--pid", "--fork", "--mount-proc", BIN])
        .args([
            "demo",
            "--netns",
            "--json",
            "--layers",
            "2",
            "--requests",
            "2",
        ])
        .output()
        .unwrap();
    assert!(
        other.status.success(),
        "{}",
        String::from_utf8_lossy(&other.stderr)
    );
    assert_eq!(
        namespaces_of(pid),
        hosts,
        "the other run deleted a live run's hosts"
    );
    let out = long.0.take().unwrap().wait_with_output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{text}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_str(text.trim()).unwrap();
    assert_eq!(v["succeeded"], v["requests"], "{v}");
    assert_eq!(
        namespaces_of(pid),
        0,
        "the long run cleaned up after itself"
    );
}
