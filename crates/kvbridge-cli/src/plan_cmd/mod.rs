//! `kvbridge plan <scenario.json>`: plan one chunk described by a scenario
//! (docs/plan-scenario.md) and print the result JSON.
//!
//! * stdout: exactly one JSON object, `{"blocks": [[src, dst, len], ...]}`
//!   (canonical form) or `{"error": "<message>"}`; exit 0 for both.
//! * exit 2 when the scenario cannot be read (missing file, bad JSON, unknown
//!   key, out-of-format value); the reason goes to stderr.
//! * `--bench N`: time the planning call only (scenario parsing and peer
//!   registration excluded) N times with one reused planner, and print
//!   `{"blocks": <count>, "median_us": <µs>, "min_us": <µs>, "repeat": N}`.
//! * `--svg FILE`: also draw which prefill pages and heads land in which
//!   decode pages, per buffer pair (`picture`, `svg`).

mod picture;
mod svg;

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::{Duration, Instant};

use kvbridge_plan::scenario::{Scenario, result_to_json};
use kvbridge_plan::{Planner, PreparedPeer, plan_scenario};

/// Arguments of `kvbridge plan`.
#[derive(Debug, clap::Args)]
pub struct PlanArgs {
    /// Time the planning call N times instead of printing the plan.
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u32).range(1..))]
    bench: Option<u32>,
    /// Also draw the plan into this SVG file: which prefill pages and heads
    /// land in which decode pages and heads, per buffer pair (large plans
    /// are summarized).
    #[arg(long, value_name = "FILE", conflicts_with = "bench")]
    svg: Option<PathBuf>,
    /// The scenario JSON file.
    scenario: PathBuf,
}

/// Exit status for an unreadable scenario.
const EXIT_UNREADABLE: u8 = 2;

/// Runs `kvbridge plan`.
pub fn run(args: PlanArgs) -> ExitCode {
    let stdout = std::io::stdout();
    let stderr = std::io::stderr();
    let code = execute(&args, &mut stdout.lock(), &mut stderr.lock());
    ExitCode::from(code)
}

fn read_scenario(path: &Path, err: &mut dyn Write) -> Option<Scenario> {
    let text = match std::fs::read_to_string(path) {
        Ok(t) => t,
        Err(e) => {
            let _ = writeln!(err, "kvbridge plan: cannot read {}: {e}", path.display());
            return None;
        }
    };
    match Scenario::from_json(&text) {
        Ok(s) => Some(s),
        Err(e) => {
            let _ = writeln!(err, "kvbridge plan: {}: {e}", path.display());
            None
        }
    }
}

fn execute(args: &PlanArgs, out: &mut dyn Write, err: &mut dyn Write) -> u8 {
    let Some(scenario) = read_scenario(&args.scenario, err) else {
        return EXIT_UNREADABLE;
    };
    let line = match args.bench {
        None => {
            let result = plan_scenario(&scenario);
            if let Err(e) = &result {
                tracing::info!("scenario rejected: {e}");
            }
            if let Some(path) = &args.svg {
                match &result {
                    Ok(blocks) => {
                        let inputs = scenario.inputs();
                        let picture = picture::Picture::new(&inputs, blocks);
                        if let Err(e) = svg::draw(path, &inputs, &picture) {
                            let _ = writeln!(err, "kvbridge plan: {e:#}");
                            return 1;
                        }
                    }
                    Err(e) => {
                        let _ = writeln!(
                            err,
                            "kvbridge plan: no picture: the scenario is rejected: {e}"
                        );
                    }
                }
            }
            result_to_json(&result)
        }
        Some(repeat) => match bench(&scenario, repeat) {
            Ok(line) => line,
            Err(e) => {
                let _ = writeln!(err, "kvbridge plan --bench: the scenario is rejected: {e}");
                let msg = serde_json::Value::String(e.to_string());
                if writeln!(out, "{{\"error\": {msg}}}").is_err() {
                    return 1;
                }
                return 1;
            }
        },
    };
    match writeln!(out, "{line}").and_then(|()| out.flush()) {
        Ok(()) => 0,
        Err(e) => {
            let _ = writeln!(err, "kvbridge plan: cannot write the result: {e}");
            1
        }
    }
}

/// Times `Planner::plan_chunk` `repeat` times after one warm-up call.
fn bench(scenario: &Scenario, repeat: u32) -> Result<String, kvbridge_plan::PlanError> {
    let inputs = scenario.inputs();
    let peer = PreparedPeer::new(&inputs.layout, inputs.registration)?;
    let mut planner = Planner::new();
    let blocks = planner
        .plan_chunk(&inputs.layout, &peer, &inputs.request, &inputs.chunk)?
        .block_count();
    let mut times: Vec<Duration> = Vec::with_capacity(repeat as usize);
    for _ in 0..repeat {
        let t0 = Instant::now();
        let plan = planner.plan_chunk(&inputs.layout, &peer, &inputs.request, &inputs.chunk)?;
        std::hint::black_box(plan.block_count());
        times.push(t0.elapsed());
    }
    times.sort_unstable();
    let us = |d: Duration| d.as_secs_f64() * 1e6;
    let median = match times.len() {
        0 => 0.0,
        n if n % 2 == 1 => us(times[n / 2]),
        n => (us(times[n / 2 - 1]) + us(times[n / 2])) / 2.0,
    };
    let min = times.first().map_or(0.0, |&d| us(d));
    Ok(format!(
        "{{\"blocks\": {blocks}, \"median_us\": {median:.3}, \"min_us\": {min:.3}, \"repeat\": {repeat}}}"
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fixture(rel: &str) -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../../tests/fixtures")
            .join(rel)
    }

    fn exec(bench: Option<u32>, path: PathBuf) -> (u8, String, String) {
        exec_svg(bench, None, path)
    }

    fn exec_svg(bench: Option<u32>, svg: Option<PathBuf>, path: PathBuf) -> (u8, String, String) {
        let (mut out, mut err) = (Vec::new(), Vec::new());
        let code = execute(
            &PlanArgs {
                bench,
                svg,
                scenario: path,
            },
            &mut out,
            &mut err,
        );
        (
            code,
            String::from_utf8(out).unwrap(),
            String::from_utf8(err).unwrap(),
        )
    }

    #[test]
    fn prints_the_canonical_plan() {
        let (code, out, _) = exec(None, fixture("plan-examples/mha_equal_tp.json"));
        assert_eq!(code, 0);
        let got: serde_json::Value = serde_json::from_str(&out).unwrap();
        let want: serde_json::Value = serde_json::from_str(
            &std::fs::read_to_string(fixture("plan-examples/expected/mha_equal_tp.json")).unwrap(),
        )
        .unwrap();
        assert_eq!(got, want);
        assert_eq!(out.lines().count(), 1);
    }

    #[test]
    fn rejection_is_a_result_with_exit_0() {
        let (code, out, _) = exec(None, fixture("plan-examples/error_missing_layer.json"));
        assert_eq!(code, 0);
        let v: serde_json::Value = serde_json::from_str(&out).unwrap();
        assert!(v["error"].as_str().is_some_and(|m| !m.is_empty()));
        assert_eq!(v.as_object().unwrap().len(), 1);
    }

    #[test]
    fn unreadable_scenarios_exit_2() {
        let (code, out, err) = exec(None, fixture("plan-examples/does-not-exist.json"));
        assert_eq!((code, out.as_str()), (2, ""));
        assert!(err.contains("cannot read"));

        let dir = std::env::temp_dir().join(format!("kvbridge-plan-cmd-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let bad = dir.join("unknown-key.json");
        let mut v: serde_json::Value = serde_json::from_str(
            &std::fs::read_to_string(fixture("plan-examples/mha_equal_tp.json")).unwrap(),
        )
        .unwrap();
        v["surprise"] = serde_json::json!(1);
        std::fs::write(&bad, v.to_string()).unwrap();
        let (code, out, err) = exec(None, bad);
        assert_eq!((code, out.as_str()), (2, ""));
        assert!(err.contains("surprise"), "{err}");

        let not_json = dir.join("not-json.json");
        std::fs::write(&not_json, "{").unwrap();
        assert_eq!(exec(None, not_json).0, 2);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn bench_prints_one_timing_line() {
        let (code, out, _) = exec(Some(3), fixture("plan-examples/mha_equal_tp.json"));
        assert_eq!(code, 0);
        let v: serde_json::Value = serde_json::from_str(&out).unwrap();
        // 6 KV buffers x 2 runs + 2 aux blocks.
        assert_eq!(v["blocks"], 14);
        assert_eq!(v["repeat"], 3);
        assert!(v["median_us"].as_f64().unwrap() >= v["min_us"].as_f64().unwrap());
    }

    #[test]
    fn svg_draws_small_plans_whole_and_summarizes_large_ones() {
        let dir = std::env::temp_dir().join(format!("kvbridge-plan-svg-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let svg = dir.join("small.svg");
        let (code, out, _) = exec_svg(
            None,
            Some(svg.clone()),
            fixture("plan-examples/mha_equal_tp.json"),
        );
        assert_eq!(code, 0);
        assert!(
            out.starts_with("{\"blocks\""),
            "the JSON result is still printed"
        );
        let text = std::fs::read_to_string(&svg).unwrap();
        assert!(text.starts_with("<svg"));
        for needle in [
            "prefill KV buffer 0",
            "decode KV buffer 0",
            ">\n5\n<",
            ">\n43\n<",
        ] {
            assert!(text.contains(needle), "{needle:?} missing");
        }
        assert!(!text.contains("not drawn") || text.contains("more KV buffer pairs"));

        // 64 pages over 40 buffers: the picture says what it leaves out.
        let mut big: serde_json::Value = serde_json::from_str(
            &std::fs::read_to_string(fixture("plan-examples/mha_equal_tp.json")).unwrap(),
        )
        .unwrap();
        let buffers = 40u64;
        big["kv_data_ptrs"] = (0..buffers).map(|i| (i + 1) << 32).collect();
        big["kv_item_lens"] = vec![1024u64; buffers as usize].into();
        big["dst_kv_ptrs"] = (0..buffers).map(|i| (i + 100) << 32).collect();
        big["dst_kv_item_len"] = 1024.into();
        big["kv_layer_ids"] = serde_json::Value::Null;
        big["prefill_kv_indices"] = (0..64).collect();
        big["dst_kv_indices"] = (0..64).map(|i| 200 - i).collect();
        big["index_slice_start"] = 0.into();
        big["index_slice_end"] = 64.into();
        big["is_last_chunk"] = false.into();
        if let Some(o) = big.as_object_mut() {
            o.retain(|k, v| !v.is_null() && !k.starts_with("aux") && !k.starts_with("dst_aux"));
            o.remove("prefill_aux_index");
        }
        let scenario = dir.join("big.json");
        std::fs::write(&scenario, big.to_string()).unwrap();
        let svg = dir.join("big.svg");
        let (code, out, err) = exec_svg(None, Some(svg.clone()), scenario);
        assert_eq!(code, 0, "{err}");
        assert!(out.starts_with("{\"blocks\""), "{out}");
        let text = std::fs::read_to_string(&svg).unwrap();
        assert!(
            text.contains("48 more items not drawn"),
            "64 pages, 16 drawn"
        );
        assert!(
            text.contains("36 more KV buffer pairs (36 with the first"),
            "40 buffers, 4 drawn"
        );

        // A rejected scenario: the error result, exit 0, and no picture.
        let svg = dir.join("rejected.svg");
        let (code, out, err) = exec_svg(
            None,
            Some(svg.clone()),
            fixture("plan-examples/error_missing_layer.json"),
        );
        assert_eq!(code, 0);
        assert!(out.contains("\"error\""));
        assert!(err.contains("no picture"), "{err}");
        assert!(!svg.exists());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
