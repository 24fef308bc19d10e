//! Every scenario under `tests/fixtures/plan-examples` (the examples of
//! docs/plan-scenario.md §5) and `tests/fixtures/plan-scenarios` (ours,
//! checked against sglang 0.5.23's helpers and the reference, sglang's
//! Mooncake connector) gives its expected result under the
//! canonical comparison of docs/plan-scenario.md §2.

#![allow(clippy::unwrap_used)] // tests unwrap what they construct

use std::fs;
use std::path::{Path, PathBuf};

use kvbridge_plan::{Scenario, ScenarioResult, canonicalize, plan_scenario};

fn fixture_dir(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures")
        .join(name)
}

/// Runs every `<dir>/*.json` against `<dir>/expected/<name>.json`; returns
/// how many were checked.
fn check_dir(name: &str) -> usize {
    let dir = fixture_dir(name);
    let mut paths: Vec<PathBuf> = fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "json"))
        .collect();
    paths.sort();
    let mut failures = Vec::new();
    for path in &paths {
        let stem = path.file_stem().unwrap().to_string_lossy().into_owned();
        let scenario = Scenario::from_json(&fs::read_to_string(path).unwrap())
            .unwrap_or_else(|e| panic!("{stem}: unreadable scenario: {e}"));
        let expected_path = dir.join("expected").join(format!("{stem}.json"));
        let expected = ScenarioResult::from_json(
            &fs::read_to_string(&expected_path)
                .unwrap_or_else(|e| panic!("{}: {e}", expected_path.display())),
        )
        .unwrap();
        let got: ScenarioResult = plan_scenario(&scenario).into();
        if !got.matches(&expected) {
            let show = |r: &ScenarioResult| match r {
                ScenarioResult::Blocks(b) => format!("{:?}", canonicalize(b)),
                ScenarioResult::Error(e) => format!("error: {e}"),
            };
            failures.push(format!(
                "{stem}:\n  expected {}\n  got      {}",
                show(&expected),
                show(&got)
            ));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
    paths.len()
}

#[test]
fn contract_examples() {
    assert_eq!(check_dir("plan-examples"), 10);
}

#[test]
fn own_scenarios() {
    assert!(check_dir("plan-scenarios") >= 100);
}
