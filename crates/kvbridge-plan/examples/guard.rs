//! The planner's figures for the benchmark regression guard
//! (`cargo xtask bench-guard`): for each large case, the time to plan it
//! divided by the time this machine takes to write the same number of
//! 24-byte blocks in a plain loop, measured alternately, best of `ROUNDS`.
//! The ratio travels between machines far better than a time does.
//!
//! Prints one JSON object per line: `{"name", "value", "better": "lower"}`.
//!
//! `cargo run --release -p kvbridge-plan --features scenario --example guard`

use std::hint::black_box;
use std::time::Instant;

use kvbridge_plan::synthetic::LargeCase;
use kvbridge_plan::{Block, Planner, PreparedPeer};

/// Alternated measurements per case; the minimum of each side is kept.
const ROUNDS: usize = 15;

fn main() {
    for case in LargeCase::ALL {
        let inputs = case.scenario().inputs();
        let peer = match PreparedPeer::new(&inputs.layout, inputs.registration.clone()) {
            Ok(p) => p,
            Err(e) => {
                eprintln!("guard: {}: registration rejected: {e}", case.name());
                std::process::exit(1);
            }
        };
        let mut planner = Planner::new();
        let mut plan_once = || {
            let start = Instant::now();
            let blocks = planner
                .plan_chunk(&inputs.layout, &peer, &inputs.request, &inputs.chunk)
                .map(|p| p.block_count());
            (start.elapsed().as_secs_f64(), black_box(blocks))
        };
        let blocks = match plan_once().1 {
            Ok(n) => n,
            Err(e) => {
                eprintln!("guard: {}: chunk rejected: {e}", case.name());
                std::process::exit(1);
            }
        };
        let mut scratch: Vec<Block> = Vec::with_capacity(blocks);
        let (mut plan_best, mut write_best) = (f64::MAX, f64::MAX);
        for _ in 0..ROUNDS {
            plan_best = plan_best.min(plan_once().0);
            write_best = write_best.min(write_blocks(&mut scratch, blocks));
        }
        println!(
            "{{\"name\": \"plan/{}\", \"value\": {:.4}, \"better\": \"lower\", \"plan_ms\": {:.3}, \"write_ms\": {:.3}}}",
            case.name(),
            plan_best / write_best,
            plan_best * 1e3,
            write_best * 1e3
        );
    }
}

/// Seconds to write `n` blocks into `out` (reused) in one sequential loop.
fn write_blocks(out: &mut Vec<Block>, n: usize) -> f64 {
    out.clear();
    let start = Instant::now();
    out.extend((0..n as u64).map(|i| Block {
        src: i.wrapping_mul(4096),
        dst: i.wrapping_mul(1024),
        len: 256,
    }));
    black_box(&out);
    start.elapsed().as_secs_f64()
}
