//! `kvbridge demo` writes its rank configs (which carry the cluster secret)
//! into a folder no other local user can predict or plant: a run whose
//! temp folder is full of links named after the next process ids leaves the
//! links' target untouched.

#![allow(clippy::unwrap_used)] // tests unwrap what they construct

use std::path::Path;
use std::process::Command;

const BIN: &str = env!("CARGO_BIN_EXE_kvbridge");

/// The last process id the kernel handed out in our PID namespace.
fn last_pid() -> u64 {
    std::fs::read_to_string("/proc/sys/kernel/ns_last_pid")
        .ok()
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(0)
}

fn scratch(name: &str) -> std::path::PathBuf {
    let d = std::env::temp_dir().join(format!("kvb-test-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn entries(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    v.sort();
    v
}

#[test]
fn planted_links_at_the_next_pids_never_receive_the_rank_configs() {
    // The attacker's view: a shared temp folder, and a folder of its own
    // the links point at (a root run would write wherever they lead).
    let tmp = scratch("tmp");
    let victim = scratch("victim");
    let next = last_pid() + 1;
    for pid in next..next + 256 {
        std::os::unix::fs::symlink(&victim, tmp.join(format!("kvbridge-demo-{pid}"))).unwrap();
    }
    let planted = entries(&tmp);
    let out = Command::new(BIN)
        .args(["demo", "--json", "--layers", "2", "--requests", "2"])
        .env("TMPDIR", &tmp)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        entries(&victim).is_empty(),
        "the demo wrote through a planted link: {:?}",
        entries(&victim)
    );
    // Its own folder is gone again; the planted links are left as found.
    assert_eq!(entries(&tmp), planted);
    let _ = std::fs::remove_dir_all(&tmp);
    let _ = std::fs::remove_dir_all(&victim);
}
