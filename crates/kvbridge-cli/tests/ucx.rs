//! The `kvbridge` binary with the UCX engine: the demo verifies every byte
//! over UCX's TCP and shared-memory transports, `bench ucx` prints the rows
//! `bench tcp` prints, and a machine without libucx gets a clear message.
#![allow(clippy::unwrap_used)]

use std::process::{Command, Stdio};

const BIN: &str = env!("CARGO_BIN_EXE_kvbridge");

/// Whether UCX is usable here (the tests skip with a message when not,
/// and fail instead where `KVBRIDGE_REQUIRE_UCX=1`, as in CI).
fn ucx_or_skip() -> bool {
    let ok = [
        "/usr/lib/x86_64-linux-gnu",
        "/usr/lib/aarch64-linux-gnu",
        "/usr/lib",
        "/usr/lib64",
    ]
    .iter()
    .any(|d| std::path::Path::new(d).join("libucp.so.0").exists());
    if !ok {
        assert!(
            std::env::var("KVBRIDGE_REQUIRE_UCX").map_or(true, |v| v != "1"),
            "KVBRIDGE_REQUIRE_UCX=1 but libucp.so.0 is not installed"
        );
        eprintln!("skipping: libucp.so.0 is not installed (apt-get install libucx0)");
    }
    ok
}

fn run(args: &[&str], env: &[(&str, &str)]) -> (i32, String, String) {
    let out = Command::new(BIN)
        .args(args)
        .envs(env.iter().copied())
        .stdin(Stdio::null())
        .output()
        .unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn demo_over_ucx_verifies_every_byte() {
    if !ucx_or_skip() {
        return;
    }
    let small = [
        "--layers",
        "2",
        "--requests",
        "12",
        "--prompt-tokens",
        "48",
        "--chunk-tokens",
        "16",
    ];
    for (tls, topology) in [
        ("tcp", &["--prefill-tp", "1", "--decode-tp", "1"][..]),
        ("posix,cma,self", &["--prefill-tp", "2", "--decode-tp", "1"]),
        ("tcp", &["--prefill-tp", "1", "--decode-tp", "2", "--open"]),
    ] {
        let mut args = vec!["demo", "--json", "--engine", "ucx"];
        args.extend_from_slice(&small);
        args.extend_from_slice(topology);
        let (code, out, err) = run(&args, &[("UCX_TLS", tls)]);
        let v: serde_json::Value =
            serde_json::from_str(out.trim()).unwrap_or_else(|e| panic!("{e}: {out}\n{err}"));
        assert_eq!(code, 0, "over {tls}: {v}\n{err}");
        assert_eq!(v["succeeded"], v["requests"], "over {tls}: {v}");
        assert_eq!(v["mismatched_bytes"], 0, "over {tls}: {v}");
        assert!(v["verified_bytes"].as_u64().unwrap() > 0);
        assert!(
            v["topology"].as_str().unwrap().contains("ucx engine"),
            "{v}"
        );
    }
}

#[test]
fn bench_ucx_prints_the_rows_of_bench_tcp() {
    if !ucx_or_skip() {
        return;
    }
    let common = [
        "--json",
        "--bytes",
        "4194304",
        "--runs",
        "1",
        "--sizes",
        "4096,65536",
    ];
    let (code, tcp, err) = run(&[&["bench", "tcp"][..], &common].concat(), &[]);
    assert_eq!(code, 0, "{err}");
    for extra in [
        &["--tls", "tcp"][..],
        &["--tls", "posix,cma,self", "--scatter"],
    ] {
        let args = [&["bench", "ucx"][..], &common, extra].concat();
        let (code, ucx, err) = run(&args, &[]);
        assert_eq!(code, 0, "{extra:?}: {err}");
        let rows = |s: &str| -> Vec<serde_json::Value> {
            s.lines()
                .map(|l| serde_json::from_str(l).unwrap())
                .collect()
        };
        let (t, u) = (rows(&tcp), rows(&ucx));
        assert_eq!(u.len(), 2, "{ucx}");
        for (a, b) in t.iter().zip(&u) {
            let keys = |v: &serde_json::Value| {
                let mut k: Vec<String> = v.as_object().unwrap().keys().cloned().collect();
                k.sort();
                k
            };
            assert_eq!(keys(a), keys(b));
            assert_eq!(a["block_size"], b["block_size"]);
            assert_eq!(b["verified"], true, "{b}");
        }
    }
}

#[test]
fn without_libucx_the_binary_runs_and_says_so() {
    let env = [("KVBRIDGE_UCX_LIB", "/nonexistent/libucp.so.0")];
    let (code, _, err) = run(
        &["bench", "ucx", "--bytes", "65536", "--sizes", "4096"],
        &env,
    );
    assert_ne!(code, 0);
    assert!(
        err.contains("UCX is not available on this machine"),
        "{err}"
    );
    // The TCP engine is unaffected.
    let (code, _, err) = run(
        &["bench", "tcp", "--bytes", "65536", "--sizes", "4096"],
        &env,
    );
    assert_eq!(code, 0, "{err}");
}
