//! `cargo xtask`: the project's own automation.
//!
//! - `cargo xtask ci`: installs the system packages the build needs (when
//!   missing and running as root), then runs what CI runs: formatting check,
//!   clippy with warnings denied, the API docs, the whole test suite, the
//!   network-namespace cluster's short list (as root; see `cluster.rs`),
//!   the Python package's pytest suite (see `python.rs`), then every fuzz
//!   target for 5 seconds.
//! - `cargo xtask wheel`: builds the Python package's wheel (`import
//!   kvbridge`) with maturin into `target/wheels`; `cargo xtask py-test`
//!   runs only CI's Python step (see `python.rs`).
//! - `cargo xtask gpu-test [--run] [--bench]`: bundles the GPU-gated tests
//!   and runs them where a GPU is (see `gpu.rs`).
//! - `cargo xtask fuzz [--seconds N] [--target NAME]`: runs the fuzz targets
//!   in `fuzz/` for N seconds each (see `fuzz.rs`).
//! - `cargo xtask cluster [--full] [--release] [--soak-minutes N]`: a cluster
//!   of network namespaces on this machine, a workload and every scripted
//!   fault, each checked against its expected outcome (see `cluster.rs`).
//! - `cargo xtask bench-guard [--update]`: fails when a planner or engine
//!   benchmark regressed past its margin against `benches/guard.json`
//!   (see `guard.rs`); CI runs it after the tests.

mod cluster;
mod fuzz;
mod gpu;
mod guard;
mod python;

use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode};

use anyhow::{Context, Result, bail};

/// Debian packages the workspace needs to build and test.
/// `libucx0`: the UCX engine's tests (loaded at run time, not linked).
/// `python3-dev`: libpython and headers, which `kvbridge-py` links in
/// `cargo test`; `python3-venv`: `python3 -m venv` for its pytest suite.
/// `iproute2`: `ip netns` for the cluster scenarios.
const SYSTEM_PACKAGES: &[&str] = &[
    "build-essential",
    "pkg-config",
    "libucx0",
    "python3-dev",
    "python3-venv",
    "iproute2",
    "util-linux",
];

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let result = match args.first().map(String::as_str) {
        Some("ci") => ci(),
        Some("install-deps") => install_system_packages(),
        Some("wheel") => python::wheel(&workspace_root()),
        Some("py-test") => python::pytest(&workspace_root(), false),
        Some("gpu-test") => gpu::gpu_test(&args[1..]),
        Some("fuzz") => fuzz::fuzz(&args[1..]),
        Some("cluster") => cluster::cluster(&workspace_root(), &args[1..]),
        Some("bench-guard") => guard::bench_guard(&workspace_root(), &args[1..]),
        _ => {
            eprintln!(
                "usage: cargo xtask <ci|install-deps|bench-guard [--update]|wheel|py-test|gpu-test [--run] [--bench]|fuzz [--seconds N] [--target NAME]|cluster [--full] [--release] [--soak-minutes N [--soak-only]] [--kvbridge PATH] [--save DIR]>"
            );
            return ExitCode::from(2);
        }
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("xtask: {e:#}");
            ExitCode::FAILURE
        }
    }
}

/// The repository root (the parent of `xtask/`).
fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .map_or_else(|| PathBuf::from("."), Path::to_path_buf)
}

fn run(program: &str, args: &[&str]) -> Result<()> {
    eprintln!("xtask: running {program} {}", args.join(" "));
    let status = Command::new(program)
        .args(args)
        .status()
        .with_context(|| format!("cannot start {program}"))?;
    if !status.success() {
        bail!("{program} {} failed with {status}", args.join(" "));
    }
    Ok(())
}

fn package_installed(name: &str) -> bool {
    Command::new("dpkg-query")
        .args(["-W", "-f=${Status}", name])
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).contains("install ok installed"))
        .unwrap_or(false)
}

/// Whether this process runs as root.
fn is_root() -> bool {
    Command::new("id")
        .arg("-u")
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim() == "0")
        .unwrap_or(false)
}

fn install_system_packages() -> Result<()> {
    let missing: Vec<&str> = SYSTEM_PACKAGES
        .iter()
        .copied()
        .filter(|p| !package_installed(p))
        .collect();
    if missing.is_empty() {
        return Ok(());
    }
    if !is_root() {
        bail!(
            "missing system packages {missing:?}: run `sudo apt-get install -y {}`",
            missing.join(" ")
        );
    }
    run("apt-get", &["update", "-qq"])?;
    let mut args = vec!["install", "-y", "-qq"];
    args.extend(&missing);
    run("apt-get", &args)
}

fn ci() -> Result<()> {
    install_system_packages()?;
    run("cargo", &["fmt", "--all", "--", "--check"])?;
    run(
        "cargo",
        &[
            "clippy",
            "--workspace",
            "--all-targets",
            "--",
            "-D",
            "warnings",
        ],
    )?;
    // The API docs build without broken links or name collisions.
    eprintln!("xtask: running cargo doc --workspace --no-deps (warnings are errors)");
    let status = Command::new("cargo")
        .args(["doc", "--workspace", "--no-deps"])
        .env("RUSTDOCFLAGS", "-D warnings")
        .status()
        .context("cannot start cargo")?;
    if !status.success() {
        bail!("cargo doc --workspace failed with {status}");
    }
    // libucx0 is installed above, so the UCX tests must run, not skip.
    eprintln!("xtask: running cargo test --workspace (KVBRIDGE_REQUIRE_UCX=1)");
    let mut test = Command::new("cargo");
    test.args(["test", "--workspace"])
        .env("KVBRIDGE_REQUIRE_UCX", "1");
    if is_root() {
        // Root can make network and PID namespaces: those tests must run.
        test.env("KVBRIDGE_REQUIRE_NETNS", "1");
    }
    let status = test.status().context("cannot start cargo")?;
    if !status.success() {
        bail!("cargo test --workspace failed with {status}");
    }
    // The planner and the TCP engine against their committed baseline.
    guard::bench_guard(&workspace_root(), &[])?;
    // A cluster of network namespaces: the workload and every scripted
    // fault (root only: a user without it cannot make namespaces).
    if is_root() {
        cluster::cluster(&workspace_root(), &[])?;
    } else {
        eprintln!("xtask: not root; skipping the network-namespace cluster (cargo xtask cluster)");
    }
    // The Python package, built into a venv, against its pytest suite.
    python::pytest(&workspace_root(), true)?;
    // sglang 0.5.23's released Mooncake connector against kvbridge's engine
    // and Rust roles (python/interop/README.md).
    python::interop(&workspace_root())?;
    // Every fuzz target briefly: a decoder that panics on some peer bytes
    // fails CI (`cargo xtask fuzz` runs them longer).
    fuzz::fuzz(&["--seconds".to_owned(), "5".to_owned()])
}
