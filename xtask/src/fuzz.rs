//! `cargo xtask fuzz [--seconds N] [--target NAME]`: builds every fuzz
//! target in `fuzz/` (or the one named) and runs each for `N` seconds
//! (default 10), one after the other; fails naming the target and the
//! crash artifact if any target crashes.
//!
//! Fuzzing needs the nightly toolchain and cargo-fuzz; the workspace itself
//! stays on the pinned stable toolchain. cargo-fuzz is installed first when
//! it is missing (and nightly too, through rustup). Targets are built with
//! debug assertions and overflow checks (`-a`) under AddressSanitizer; each
//! keeps its corpus in `fuzz/corpus/<target>` (not tracked), so later runs
//! start from what earlier ones found, and also reads the committed seeds
//! in `fuzz/seeds/<target>` (known attack sequences) when there are any.

use std::path::Path;
use std::process::{Command, Output};
use std::time::Instant;

use anyhow::{Context, Result, bail};

/// Seconds per target when `--seconds` is not given.
const DEFAULT_SECONDS: u64 = 10;

/// Longest a single input may run before libFuzzer calls it a hang, seconds.
const INPUT_TIMEOUT_S: u64 = 20;

/// What one target's run came to.
struct Outcome {
    target: String,
    runs: Option<u64>,
    seconds: f64,
    /// The crash artifact, when the target crashed.
    artifact: Option<String>,
}

/// `cargo xtask fuzz [--seconds N] [--target NAME]`.
pub(crate) fn fuzz(args: &[String]) -> Result<()> {
    let (seconds, only) = parse_args(args)?;
    let root = crate::workspace_root();
    ensure_cargo_fuzz(&root)?;
    let all = list_targets(&root)?;
    let targets = match only {
        Some(name) if all.contains(&name) => vec![name],
        Some(name) => bail!(
            "no fuzz target {name:?}; the targets are: {}",
            all.join(", ")
        ),
        None => all,
    };
    // Build first (every target in one cargo invocation, unless one was
    // named), so a build failure is reported as such, not as a failed run.
    let mut build = nightly(&root);
    build.args(["fuzz", "build", "-a"]);
    if let [one] = targets.as_slice() {
        build.arg(one);
    }
    run_inherited(build, "cargo +nightly fuzz build")?;
    let mut outcomes = Vec::new();
    for t in &targets {
        eprintln!("xtask: fuzzing {t} for {seconds} s");
        outcomes.push(run_target(&root, t, seconds)?);
    }
    eprintln!("xtask: fuzz summary");
    for o in &outcomes {
        let runs = o.runs.map_or_else(|| "?".to_owned(), |r| r.to_string());
        let crashes = u32::from(o.artifact.is_some());
        eprintln!(
            "  {:<20} {runs:>10} runs  {:>5.1} s  {crashes} crashes",
            o.target, o.seconds
        );
    }
    let crashed: Vec<&Outcome> = outcomes.iter().filter(|o| o.artifact.is_some()).collect();
    if crashed.is_empty() {
        return Ok(());
    }
    for o in &crashed {
        let artifact = o.artifact.as_deref().unwrap_or("?");
        eprintln!(
            "xtask: fuzz target {} crashed; input: {artifact}\n       reproduce: cargo +nightly fuzz run -a {} {artifact}",
            o.target, o.target
        );
    }
    let names: Vec<&str> = crashed.iter().map(|o| o.target.as_str()).collect();
    bail!("fuzz targets crashed: {}", names.join(", "))
}

fn parse_args(args: &[String]) -> Result<(u64, Option<String>)> {
    let mut seconds = DEFAULT_SECONDS;
    let mut target = None;
    let mut it = args.iter();
    while let Some(a) = it.next() {
        let (flag, inline) = match a.split_once('=') {
            Some((f, v)) => (f, Some(v.to_owned())),
            None => (a.as_str(), None),
        };
        let mut value = || {
            inline
                .clone()
                .or_else(|| it.next().cloned())
                .with_context(|| format!("{flag} needs a value"))
        };
        match flag {
            "--seconds" => {
                let v = value()?;
                seconds = v
                    .parse()
                    .ok()
                    .filter(|s| *s > 0)
                    .with_context(|| format!("--seconds {v:?}: expected a positive integer"))?;
            }
            "--target" => target = Some(value()?),
            _ => bail!(
                "unknown argument {a:?}; usage: cargo xtask fuzz [--seconds N] [--target NAME]"
            ),
        }
    }
    Ok((seconds, target))
}

/// `cargo +nightly` in `root`, without the variables that would pin the
/// child to the workspace's stable toolchain.
fn nightly(root: &Path) -> Command {
    let mut c = Command::new("cargo");
    c.arg("+nightly")
        .current_dir(root)
        .env_remove("RUSTUP_TOOLCHAIN")
        .env_remove("RUSTC")
        .env_remove("RUSTDOC")
        .env_remove("CARGO");
    c
}

fn run_inherited(mut c: Command, what: &str) -> Result<()> {
    eprintln!("xtask: running {what}");
    let status = c.status().with_context(|| format!("cannot start {what}"))?;
    if !status.success() {
        bail!("{what} failed with {status}");
    }
    Ok(())
}

fn succeeds(mut c: Command) -> bool {
    c.output().is_ok_and(|o| o.status.success())
}

/// Installs what fuzzing needs when it is missing, saying so.
fn ensure_cargo_fuzz(root: &Path) -> Result<()> {
    let mut version = nightly(root);
    version.arg("--version");
    if !succeeds(version) {
        eprintln!(
            "xtask: the nightly toolchain (needed only for fuzzing) is missing; installing it"
        );
        let mut c = Command::new("rustup");
        c.args(["toolchain", "install", "nightly", "--profile", "minimal"]);
        run_inherited(c, "rustup toolchain install nightly --profile minimal")?;
    }
    let mut probe = nightly(root);
    probe.args(["fuzz", "--version"]);
    if !succeeds(probe) {
        eprintln!("xtask: cargo-fuzz is not installed; installing it");
        let mut c = nightly(root);
        c.args(["install", "cargo-fuzz", "--locked"]);
        run_inherited(c, "cargo +nightly install cargo-fuzz --locked")?;
    }
    Ok(())
}

fn list_targets(root: &Path) -> Result<Vec<String>> {
    let mut c = nightly(root);
    c.args(["fuzz", "list"]);
    let out = c
        .output()
        .context("cannot start cargo +nightly fuzz list")?;
    if !out.status.success() {
        bail!(
            "cargo +nightly fuzz list failed with {}: {}",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    let targets: Vec<String> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .map(str::to_owned)
        .collect();
    if targets.is_empty() {
        bail!("cargo +nightly fuzz list found no fuzz targets");
    }
    Ok(targets)
}

fn run_target(root: &Path, target: &str, seconds: u64) -> Result<Outcome> {
    // The target's corpus (kept between runs), then its committed seeds
    // (known attack sequences), which libFuzzer reads first.
    let corpus = root.join("fuzz").join("corpus").join(target);
    std::fs::create_dir_all(&corpus)
        .with_context(|| format!("cannot create {}", corpus.display()))?;
    let mut c = nightly(root);
    c.args(["fuzz", "run", "-a", target]).arg(&corpus);
    let seeds = root.join("fuzz").join("seeds").join(target);
    if seeds.is_dir() {
        c.arg(&seeds);
    }
    c.arg("--")
        .arg(format!("-max_total_time={seconds}"))
        .arg(format!("-timeout={INPUT_TIMEOUT_S}"))
        .arg("-print_final_stats=1");
    let start = Instant::now();
    let out: Output = c
        .output()
        .with_context(|| format!("cannot start cargo +nightly fuzz run {target}"))?;
    let elapsed = start.elapsed().as_secs_f64();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let outcome = Outcome {
        target: target.to_owned(),
        runs: runs(&text),
        seconds: elapsed,
        artifact: artifact(&text),
    };
    if !out.status.success() {
        eprintln!("xtask: {target} exited with {}:", out.status);
        for l in failure_excerpt(&text) {
            eprintln!("  | {l}");
        }
        if outcome.artifact.is_none() {
            bail!(
                "fuzz target {target} failed with {} and wrote no crash artifact",
                out.status
            );
        }
    }
    Ok(outcome)
}

/// The lines that say why a run failed: from libFuzzer's or the
/// sanitizer's first error report (or the panic message), 40 lines at
/// most; the last 40 lines when there is none.
fn failure_excerpt(text: &str) -> Vec<&str> {
    const MARKS: [&str; 4] = ["panicked at", "==ERROR:", "ERROR: libFuzzer", "error:"];
    let lines: Vec<&str> = text.lines().collect();
    let start = lines
        .iter()
        .position(|l| MARKS.iter().any(|m| l.contains(m)))
        .unwrap_or(lines.len().saturating_sub(40));
    lines[start..].iter().take(40).copied().collect()
}

/// Inputs run: libFuzzer's final stats, else its `Done N runs` line.
fn runs(text: &str) -> Option<u64> {
    let stat = text
        .lines()
        .find_map(|l| l.trim().strip_prefix("stat::number_of_executed_units:"));
    let done = || {
        text.lines()
            .find_map(|l| l.strip_prefix("Done ")?.split_whitespace().next())
    };
    stat.map(str::trim).or_else(done)?.parse().ok()
}

/// The path libFuzzer wrote the failing input to.
fn artifact(text: &str) -> Option<String> {
    text.lines().find_map(|l| {
        let (_, rest) = l.split_once("Test unit written to ")?;
        rest.split_whitespace().next().map(str::to_owned)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_libfuzzer_output() {
        let ok =
            "#2 INITED\nDone 81234 runs in 5 second(s)\nstat::number_of_executed_units: 81235\n";
        assert_eq!(runs(ok), Some(81235));
        assert_eq!(runs("Done 7 runs in 1 second(s)\n"), Some(7));
        assert_eq!(artifact(ok), None);
        let crash = "==1== ERROR: libFuzzer: deadly signal\nartifact_prefix='/r/fuzz/artifacts/t/'; \
                     Test unit written to /r/fuzz/artifacts/t/crash-abc\nBase64: AAA=\n";
        assert_eq!(
            artifact(crash).as_deref(),
            Some("/r/fuzz/artifacts/t/crash-abc")
        );
        assert_eq!(
            failure_excerpt(crash)[0],
            "==1== ERROR: libFuzzer: deadly signal"
        );
    }

    #[test]
    fn parses_arguments() {
        let a = |v: &[&str]| parse_args(&v.iter().map(|s| (*s).to_owned()).collect::<Vec<_>>());
        assert_eq!(a(&[]).unwrap(), (DEFAULT_SECONDS, None));
        assert_eq!(a(&["--seconds", "5"]).unwrap(), (5, None));
        assert_eq!(
            a(&["--seconds=3", "--target", "x"]).unwrap(),
            (3, Some("x".to_owned()))
        );
        assert!(a(&["--seconds", "0"]).is_err());
        assert!(a(&["--seconds"]).is_err());
        assert!(a(&["--bogus"]).is_err());
    }
}
