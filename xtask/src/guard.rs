//! `cargo xtask bench-guard [--update]`: fails when a planner or engine
//! benchmark regressed past its margin against the committed baseline
//! (`benches/guard.json`).
//!
//! Each figure is machine-relative, so a baseline recorded on one machine
//! holds on another: the planner's time over this machine's time to write as
//! many blocks in a plain loop (lower is better), the TCP engine's rate over
//! this machine's `memcpy` rate (higher is better); both sides measured
//! alternately, best of several rounds (`examples/guard.rs` of
//! `kvbridge-plan` and `kvbridge-engine`). Noise: a figure past its margin is
//! measured again, up to [`ATTEMPTS`] times, and fails only if every attempt
//! is past it. `--update` writes the figures measured now as the baseline.

use std::collections::BTreeMap;
use std::path::Path;
use std::process::Command;

use anyhow::{Context, Result, bail};
use serde_json::{Value, json};

/// Measurements of a figure before it counts as regressed.
const ATTEMPTS: usize = 3;

/// How much worse than the baseline a figure may be when the baseline file
/// gives no margin of its own.
const DEFAULT_MARGIN: f64 = 1.75;

/// The guard programs: `(package, features)`.
const PROGRAMS: &[(&str, &str)] = &[("kvbridge-plan", "scenario"), ("kvbridge-engine", "")];

/// One measured figure.
#[derive(Debug, Clone)]
struct Figure {
    value: f64,
    lower_is_better: bool,
    line: Value,
}

/// Runs the guard programs once; every figure by name.
fn measure(root: &Path) -> Result<BTreeMap<String, Figure>> {
    let mut out = BTreeMap::new();
    for (package, features) in PROGRAMS {
        let mut cmd = Command::new("cargo");
        cmd.current_dir(root).args([
            "run",
            "--release",
            "-q",
            "-p",
            package,
            "--example",
            "guard",
        ]);
        if !features.is_empty() {
            cmd.args(["--features", features]);
        }
        let output = cmd
            .output()
            .with_context(|| format!("cannot run the {package} guard"))?;
        if !output.status.success() {
            bail!(
                "the {package} guard failed ({}): {}",
                output.status,
                String::from_utf8_lossy(&output.stderr)
            );
        }
        for line in String::from_utf8_lossy(&output.stdout).lines() {
            let v: Value = serde_json::from_str(line)
                .with_context(|| format!("{package} guard printed {line:?}"))?;
            let (Some(name), Some(value), Some(better)) = (
                v["name"].as_str(),
                v["value"].as_f64(),
                v["better"].as_str(),
            ) else {
                bail!("{package} guard line without name, value or better: {line}");
            };
            out.insert(
                name.to_owned(),
                Figure {
                    value,
                    lower_is_better: better == "lower",
                    line: v.clone(),
                },
            );
        }
    }
    Ok(out)
}

/// Whether `value` is past `baseline` by more than `margin` (a factor).
fn regressed(value: f64, baseline: f64, margin: f64, lower_is_better: bool) -> bool {
    if lower_is_better {
        value > baseline * margin
    } else {
        value < baseline / margin
    }
}

/// `cargo xtask bench-guard [--update]`.
pub fn bench_guard(root: &Path, args: &[String]) -> Result<()> {
    let path = root.join("benches/guard.json");
    let update = args.iter().any(|a| a == "--update");
    let mut figures = measure(root)?;
    if update {
        let baseline: BTreeMap<&String, Value> = figures
            .iter()
            .map(|(name, f)| {
                (
                    name,
                    json!({"value": f.value, "margin": DEFAULT_MARGIN, "measured": f.line}),
                )
            })
            .collect();
        let text = serde_json::to_string_pretty(&baseline)? + "\n";
        std::fs::write(&path, text).with_context(|| format!("cannot write {}", path.display()))?;
        eprintln!("bench-guard: baseline written to {}", path.display());
        return Ok(());
    }
    let text = std::fs::read_to_string(&path)
        .with_context(|| format!("cannot read the baseline {}", path.display()))?;
    let baseline: BTreeMap<String, Value> =
        serde_json::from_str(&text).with_context(|| format!("{} is not valid", path.display()))?;
    let mut failed = Vec::new();
    for (name, base) in &baseline {
        let Some(base_value) = base["value"].as_f64() else {
            bail!("{}: {name} has no value", path.display());
        };
        let margin = base["margin"].as_f64().unwrap_or(DEFAULT_MARGIN);
        let mut attempt = 1;
        loop {
            let Some(f) = figures.get(name) else {
                bail!("the guard programs no longer measure {name} (in the baseline)");
            };
            let bad = regressed(f.value, base_value, margin, f.lower_is_better);
            eprintln!(
                "bench-guard: {name}: {:.3} (baseline {base_value:.3}, {} is better, margin {margin}×){}",
                f.value,
                if f.lower_is_better { "lower" } else { "higher" },
                if bad { " past the margin" } else { "" }
            );
            if !bad {
                break;
            }
            if attempt == ATTEMPTS {
                failed.push(format!(
                    "{name}: {:.3} against the baseline {base_value:.3} (margin {margin}×) in {ATTEMPTS} attempts",
                    f.value
                ));
                break;
            }
            attempt += 1;
            figures = measure(root)?;
        }
    }
    if !failed.is_empty() {
        bail!(
            "benchmark regression past its margin:\n  {}\n(if intended, record a new baseline with `cargo xtask bench-guard --update`)",
            failed.join("\n  ")
        );
    }
    eprintln!("bench-guard: every figure within its margin");
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::regressed;

    #[test]
    fn margins_go_the_right_way() {
        // Lower is better (planner time ratios).
        assert!(!regressed(1.7, 1.0, 1.75, true));
        assert!(regressed(1.8, 1.0, 1.75, true));
        assert!(!regressed(0.2, 1.0, 1.75, true));
        // Higher is better (engine rate ratios).
        assert!(!regressed(0.6, 1.0, 1.75, false));
        assert!(regressed(0.5, 1.0, 1.75, false));
        assert!(!regressed(3.0, 1.0, 1.75, false));
    }
}
