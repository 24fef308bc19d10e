//! The Python package (`crates/kvbridge-py`, `import kvbridge`):
//!
//! - `cargo xtask wheel`: builds its wheel with maturin (release) into
//!   `<target>/wheels`; maturin comes from `PATH`, else it is installed
//!   with pip into the checkout's venv `target/py-venv`.
//! - part of `cargo xtask ci` ([`pytest`]): installs maturin, pytest and
//!   numpy into `target/py-venv`, builds and installs the package there
//!   (`maturin develop`) and runs its pytest suite; a failure fails CI.
//!
//! The venv lives in the checkout's own `target/` (not `CARGO_TARGET_DIR`)
//! because it holds an editable install of this checkout. `KVBRIDGE_PYTHON`
//! names the interpreter that creates it (default `python3`). maturin runs
//! cargo from the checkout, so the pinned toolchain builds the extension.

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result, bail};

/// The crate maturin builds.
const MANIFEST: &str = "crates/kvbridge-py/Cargo.toml";
/// The pytest suite.
const TESTS: &str = "crates/kvbridge-py/tests";
/// What the venv needs for the suite.
const TOOLS: &[&str] = &["maturin>=1.9,<2", "pytest", "numpy"];

/// cargo's target directory (`CARGO_TARGET_DIR`, else `<root>/target`).
fn target_dir(root: &Path) -> PathBuf {
    std::env::var_os("CARGO_TARGET_DIR").map_or_else(|| root.join("target"), PathBuf::from)
}

/// The checkout's venv, `target/py-venv`.
struct Venv {
    dir: PathBuf,
}

impl Venv {
    /// The venv, created with `KVBRIDGE_PYTHON` (or `python3`) if missing.
    fn ensure(root: &Path) -> Result<Venv> {
        let venv = Venv {
            dir: root.join("target").join("py-venv"),
        };
        if !venv.bin("python").exists() {
            let python = std::env::var("KVBRIDGE_PYTHON").unwrap_or_else(|_| "python3".into());
            let dir = venv.dir.to_string_lossy().into_owned();
            super::run(&python, &["-m", "venv", &dir]).context(
                "cannot create the Python venv (on Debian/Ubuntu: apt-get install python3-venv)",
            )?;
        }
        Ok(venv)
    }

    fn bin(&self, name: &str) -> PathBuf {
        self.dir.join("bin").join(name)
    }

    /// A command running `program` from the venv, with the venv active.
    fn command(&self, program: &str) -> Command {
        let mut cmd = Command::new(self.bin(program));
        let mut path = OsString::from(self.dir.join("bin"));
        if let Some(old) = std::env::var_os("PATH") {
            path.push(":");
            path.push(old);
        }
        cmd.env("VIRTUAL_ENV", &self.dir).env("PATH", path);
        cmd
    }

    /// Whether the venv's Python imports every one of `modules`.
    fn imports(&self, modules: &[&str]) -> bool {
        self.command("python")
            .args(["-c", &format!("import {}", modules.join(", "))])
            .output()
            .is_ok_and(|o| o.status.success())
    }

    /// `pip install` of `packages` into the venv.
    fn pip_install(&self, packages: &[&str]) -> Result<()> {
        let mut args = vec!["-m", "pip", "install", "-q", "--disable-pip-version-check"];
        args.extend(packages);
        status(self.command("python").args(&args), "pip install")
    }
}

/// Runs `cmd`, failing with `what` unless it succeeds.
fn status(cmd: &mut Command, what: &str) -> Result<()> {
    eprintln!("xtask: running {what}");
    let s = cmd
        .status()
        .with_context(|| format!("cannot start {what}"))?;
    if !s.success() {
        bail!("{what} failed with {s}");
    }
    Ok(())
}

/// `cargo xtask wheel`: a release wheel in `<target>/wheels`.
pub fn wheel(root: &Path) -> Result<()> {
    let out = target_dir(root).join("wheels");
    let out = out.to_string_lossy().into_owned();
    let manifest = root.join(MANIFEST).to_string_lossy().into_owned();
    let args = ["build", "--release", "-m", &manifest, "-o", &out];
    let on_path = Command::new("maturin")
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success());
    if on_path {
        return super::run("maturin", &args);
    }
    let venv = Venv::ensure(root)?;
    if !venv.bin("maturin").exists() {
        venv.pip_install(&[TOOLS[0]])?;
    }
    status(
        venv.command("maturin").args(args).current_dir(root),
        "maturin build",
    )?;
    eprintln!("xtask: wheel written to {out}");
    Ok(())
}

/// Packs the sglang interop suite for the GPU machine into `out`
/// (`python/interop/gpu_pack.py`: the suite, wheels for that machine's
/// Python, sglang's sources, a fresh release wheel of kvbridge).
pub fn pack_interop(root: &Path, out: &Path) -> Result<()> {
    let wheels = target_dir(root).join("wheels");
    // Only this build's wheel may travel.
    if let Ok(dir) = std::fs::read_dir(&wheels) {
        for e in dir.flatten() {
            if e.file_name().to_string_lossy().starts_with("kvbridge-") {
                std::fs::remove_file(e.path()).context("clearing old kvbridge wheels")?;
            }
        }
    }
    wheel(root)?;
    let wheel = std::fs::read_dir(&wheels)
        .context("reading the wheel folder")?
        .flatten()
        .map(|e| e.path())
        .find(|p| p.extension().is_some_and(|x| x == "whl"))
        .context("maturin wrote no wheel")?;
    let venv = Venv::ensure(root)?;
    status(
        venv.command("python")
            .arg(root.join("python/interop/gpu_pack.py"))
            .arg("--out")
            .arg(out)
            .arg("--kvbridge-wheel")
            .arg(&wheel)
            .arg("--cache")
            .arg(target_dir(root).join("gpu-wheelhouse")),
        "gpu_pack.py (the interop suite for the GPU machine)",
    )
}

/// The pytest suite of the Python package, against a fresh debug build of
/// it in `target/py-venv`; with `require_ucx` (CI, where libucx0 is
/// installed) its UCX test fails instead of skipping when UCX is missing.
pub fn pytest(root: &Path, require_ucx: bool) -> Result<()> {
    let venv = Venv::ensure(root)?;
    if !venv.imports(&["maturin", "pytest", "numpy"]) {
        venv.pip_install(TOOLS)?;
    }
    let manifest = root.join(MANIFEST);
    status(
        venv.command("maturin")
            .args(["develop", "-q", "-m"])
            .arg(&manifest)
            .current_dir(root),
        "maturin develop (kvbridge-py)",
    )?;
    let mut pytest = venv.command("python");
    pytest
        .args(["-m", "pytest", "-q", "-p", "no:cacheprovider"])
        .arg(root.join(TESTS))
        .current_dir(root);
    // `cargo test --workspace` built the CLI: plan() is also compared with it.
    let cli = target_dir(root).join("debug").join("kvbridge");
    if cli.exists() {
        pytest.env("KVBRIDGE_CLI", cli);
    }
    if require_ucx {
        pytest.env("KVBRIDGE_REQUIRE_UCX", "1");
    }
    status(&mut pytest, "pytest (kvbridge-py)")
}

/// The sglang interop suites: `python/interop/ci.sh` (its own venv with
/// sglang 0.5.23 and the kvbridge package, against `target/debug/kvbridge`,
/// built by `cargo test --workspace` before this step), then
/// `python/interop/sched_ci.sh` (sglang's scheduler classes on real torch).
pub fn interop(root: &Path) -> Result<()> {
    let bin = target_dir(root).join("debug").join("kvbridge");
    eprintln!("xtask: running the sglang interop suite (python/interop)");
    let status = Command::new("bash")
        .current_dir(root)
        .arg("python/interop/ci.sh")
        .env("KVBRIDGE_BIN", &bin)
        .status()
        .context("cannot start bash")?;
    if !status.success() {
        bail!("the sglang interop suite failed with {status}");
    }
    // The same connector code driven by sglang's own scheduler classes on
    // real torch (python/interop/README.md, "The real scheduler").
    eprintln!("xtask: running the real-scheduler suite (python/interop/sched_ci.sh)");
    let status = Command::new("bash")
        .current_dir(root)
        .arg("python/interop/sched_ci.sh")
        .status()
        .context("cannot start bash")?;
    if !status.success() {
        bail!("the real-scheduler suite failed with {status}");
    }
    Ok(())
}
