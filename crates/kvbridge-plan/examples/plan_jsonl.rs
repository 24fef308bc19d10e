//! Plans many scenarios in one process: reads one scenario JSON per line on
//! stdin and prints one result JSON per line (docs/plan-scenario.md §2,
//! canonical form; `{"unreadable": "<why>"}` for a scenario the CLI would exit
//! 2 on).
//!
//! Used to cross-check the planner against other implementations in bulk:
//! `cargo run --release -p kvbridge-plan --features scenario --example plan_jsonl < in.jsonl`

use std::io::{BufRead, Write};

use kvbridge_plan::plan_scenario;
use kvbridge_plan::scenario::{Scenario, result_to_json};

fn main() -> std::io::Result<()> {
    let stdin = std::io::stdin();
    let stdout = std::io::stdout();
    let mut out = std::io::BufWriter::new(stdout.lock());
    for line in stdin.lock().lines() {
        let line = line?;
        if line.trim().is_empty() {
            continue;
        }
        match Scenario::from_json(&line) {
            Ok(s) => writeln!(out, "{}", result_to_json(&plan_scenario(&s)))?,
            Err(e) => writeln!(
                out,
                "{{\"unreadable\": {}}}",
                serde_json::Value::String(e.to_string())
            )?,
        }
    }
    out.flush()
}
