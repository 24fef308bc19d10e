//! `cargo xtask gpu-test [--run] [--bench]`: the GPU-gated test matrix.
//!
//! Builds (release, `cuda` feature) the `kvbridge` binary and the GPU test
//! binaries of `kvbridge-mem` and `kvbridge-engine`, strips them and bundles
//! them with `run.sh` into `target/gpu-bundle/` (small enough to carry to
//! the GPU machine, which has no Rust toolchain and no libzmq: libzmq is
//! linked statically, CUDA is loaded at run time). `--run` then executes
//! the bundle here; on the GPU machine run `bash target/gpu-bundle/run.sh`
//! (add `--bench` for `kvbridge bench ipc`). Without a GPU, `run.sh` prints
//! one SKIP line and exits 0. The bundle also carries sglang's interop
//! suite (`interop/`, packed by `python/interop/gpu_pack.py`, which needs
//! PyPI here): sglang's connector against kvbridge's engine and ranks with
//! KV in torch device tensors.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result, bail};

/// The run script that travels with the binaries.
const RUN_SH: &str = include_str!("gpu_run.sh");

/// Largest bundle we accept (what the device tool carries comfortably).
const MAX_BUNDLE: u64 = 60 << 20;

/// Test executables that `cargo test --no-run --message-format=json` built for target `name`.
fn test_executables(json: &str, name: &str) -> Vec<(String, String)> {
    let mut out = Vec::new();
    for line in json.lines() {
        let target = format!("\"name\":\"{name}\"");
        if !line.contains(&target) || !line.contains("\"test\":true") {
            continue;
        }
        let pkg = line
            .split("\"package_id\":\"")
            .nth(1)
            .and_then(|r| r.split('"').next())
            .unwrap_or("");
        let exe = line
            .split("\"executable\":\"")
            .nth(1)
            .and_then(|r| r.split('"').next());
        if let Some(exe) = exe {
            let krate = if pkg.contains("kvbridge-mem") {
                "mem"
            } else {
                "engine"
            };
            out.push((krate.to_owned(), exe.to_owned()));
        }
    }
    out
}

fn build(root: &Path) -> Result<PathBuf> {
    let bundle = root.join("target").join("gpu-bundle");
    let _ = std::fs::remove_dir_all(&bundle);
    std::fs::create_dir_all(&bundle).context("creating the bundle folder")?;
    crate::run(
        "cargo",
        &[
            "build",
            "--release",
            "-p",
            "kvbridge-cli",
            "--features",
            "cuda",
        ],
    )?;
    eprintln!("xtask: building the GPU test binaries");
    let out = Command::new("cargo")
        .current_dir(root)
        .args([
            "test",
            "--release",
            "--no-run",
            "--message-format=json",
            "-p",
            "kvbridge-mem",
            "-p",
            "kvbridge-engine",
            "--features",
            "kvbridge-mem/cuda,kvbridge-engine/cuda",
            "--test",
            "gpu",
        ])
        .output()
        .context("cannot start cargo")?;
    if !out.status.success() {
        bail!(
            "building the GPU tests failed:\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let json = String::from_utf8_lossy(&out.stdout);
    let tests = test_executables(&json, "gpu");
    if tests.len() != 2 {
        bail!("expected two GPU test binaries, found {tests:?}");
    }
    let target_dir =
        std::env::var_os("CARGO_TARGET_DIR").map_or_else(|| root.join("target"), PathBuf::from);
    let mut files = vec![(
        target_dir.join("release").join("kvbridge"),
        "kvbridge".to_owned(),
    )];
    for (krate, exe) in tests {
        files.push((PathBuf::from(exe), format!("gpu-test-{krate}")));
    }
    for (from, name) in &files {
        let to = bundle.join(name);
        std::fs::copy(from, &to).with_context(|| format!("copying {}", from.display()))?;
        crate::run("strip", &[&to.to_string_lossy()])?;
    }
    let script = bundle.join("run.sh");
    std::fs::write(&script, RUN_SH).context("writing run.sh")?;
    // Without PyPI the sglang step cannot be packed: the bundle says why
    // and run.sh reports the step as not run.
    if let Err(e) = crate::python::pack_interop(root, &bundle.join("interop")) {
        eprintln!("xtask: WARNING: the sglang interop step is not bundled: {e:#}");
        std::fs::write(bundle.join("interop-missing.txt"), format!("{e:#}\n"))
            .context("writing interop-missing.txt")?;
    }
    let size = dir_size(&bundle)?;
    eprintln!(
        "xtask: GPU bundle {} ({:.1} MiB): kvbridge, gpu-test-mem, gpu-test-engine, run.sh, interop/",
        bundle.display(),
        size as f64 / (1 << 20) as f64
    );
    if size > MAX_BUNDLE {
        bail!("the GPU bundle is {size} bytes, over {MAX_BUNDLE}");
    }
    Ok(bundle)
}

/// Bytes of every file under `dir`.
fn dir_size(dir: &Path) -> Result<u64> {
    let mut size = 0;
    for e in std::fs::read_dir(dir).with_context(|| format!("reading {}", dir.display()))? {
        let e = e?;
        let meta = e.metadata()?;
        size += if meta.is_dir() {
            dir_size(&e.path())?
        } else {
            meta.len()
        };
    }
    Ok(size)
}

/// `cargo xtask gpu-test [--run] [--bench]`.
pub fn gpu_test(args: &[String]) -> Result<()> {
    let root = crate::workspace_root();
    let bundle = build(&root)?;
    if !args.iter().any(|a| a == "--run") {
        eprintln!(
            "xtask: run it where a GPU is: bash {}/run.sh [--bench]",
            bundle.display()
        );
        return Ok(());
    }
    let mut script_args = vec![bundle.join("run.sh").to_string_lossy().into_owned()];
    if args.iter().any(|a| a == "--bench") {
        script_args.push("--bench".into());
    }
    let refs: Vec<&str> = script_args.iter().map(String::as_str).collect();
    crate::run("bash", &refs)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_test_executables_in_cargo_json() {
        let json = concat!(
            r#"{"reason":"compiler-artifact","package_id":"path+file:///w/crates/kvbridge-mem#0.1.0","target":{"kind":["test"],"name":"gpu","test":true},"executable":"/t/release/deps/gpu-aaa"}"#,
            "\n",
            r#"{"reason":"compiler-artifact","package_id":"path+file:///w/crates/kvbridge-engine#0.1.0","target":{"kind":["test"],"name":"gpu","test":true},"executable":"/t/release/deps/gpu-bbb"}"#,
            "\n",
            r#"{"reason":"compiler-artifact","package_id":"x","target":{"kind":["lib"],"name":"gpu","test":true},"executable":null}"#,
        );
        assert_eq!(
            test_executables(json, "gpu"),
            vec![
                ("mem".to_owned(), "/t/release/deps/gpu-aaa".to_owned()),
                ("engine".to_owned(), "/t/release/deps/gpu-bbb".to_owned())
            ]
        );
    }
}
