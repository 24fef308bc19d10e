//! Writes the four large benchmark scenarios (`kvbridge_plan::synthetic`) as
//! JSON files, for `kvbridge plan --bench N <file>`:
//!
//! `cargo run -p kvbridge-plan --features scenario --example gen_large_scenarios -- <dir>`
//!
//! (default dir: `target/plan-large`). They are generated, not committed:
//! the largest is a few MB.

use std::path::PathBuf;

use kvbridge_plan::synthetic::LargeCase;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let dir = std::env::args()
        .nth(1)
        .map_or_else(|| PathBuf::from("target/plan-large"), PathBuf::from);
    std::fs::create_dir_all(&dir)?;
    for case in LargeCase::ALL {
        let path = dir.join(format!("{}.json", case.name()));
        std::fs::write(&path, serde_json::to_string(&case.scenario())?)?;
        println!("{}", path.display());
    }
    Ok(())
}
