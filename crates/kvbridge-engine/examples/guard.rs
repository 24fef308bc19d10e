//! The TCP engine's figures for the benchmark regression guard
//! (`cargo xtask bench-guard`): 16 MiB moved between two engines over
//! 127.0.0.1 as 4 KiB and as 1 MiB blocks, each divided by this machine's
//! plain `memcpy` rate for the same 16 MiB, measured alternately, best of
//! `ROUNDS`. The ratio travels between machines far better than a rate does.
//!
//! Prints one JSON object per line: `{"name", "value", "better": "higher"}`.
//!
//! `cargo run --release -p kvbridge-engine --example guard`

use std::hint::black_box;
use std::process::ExitCode;
use std::time::Instant;

use kvbridge_engine::{Block, EngineConfig, TcpEngine, TransferEngine};
use kvbridge_mem::HostBuffer;

/// Bytes per transfer.
const TOTAL: usize = 16 << 20;
/// Alternated measurements per size; the best of each side is kept.
const ROUNDS: usize = 12;

fn main() -> ExitCode {
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("guard: {e}");
            ExitCode::FAILURE
        }
    }
}

fn run() -> Result<(), Box<dyn std::error::Error>> {
    let cfg = EngineConfig {
        listen_host: "127.0.0.1".into(),
        ..EngineConfig::default()
    };
    let (a, b) = (TcpEngine::new(cfg.clone())?, TcpEngine::new(cfg)?);
    let mut src = HostBuffer::new(TOTAL)?;
    let mut dst = HostBuffer::new(TOTAL)?;
    src.as_mut_slice().fill(7);
    dst.as_mut_slice().fill(1);
    // SAFETY: both buffers outlive their registrations (deregistered
    // below, before they drop), and nothing else touches them while the
    // engines copy.
    unsafe {
        a.batch_register(&[src.region()])?;
        b.batch_register(&[dst.region()])?;
    }
    let (mut copy_from, mut copy_to) = (vec![3u8; TOTAL], vec![0u8; TOTAL]);
    for size in [4096usize, 1 << 20] {
        let blocks: Vec<Block> = (0..TOTAL / size)
            .map(|i| Block {
                src: src.addr() + (i * size) as u64,
                dst: dst.addr() + (i * size) as u64,
                len: size as u64,
            })
            .collect();
        // Warm: connections up, pages touched.
        a.batch_transfer_sync(b.session_id(), &blocks)?;
        let (mut engine_best, mut copy_best) = (f64::MAX, f64::MAX);
        for round in 0..ROUNDS {
            let start = Instant::now();
            a.batch_transfer_sync(b.session_id(), &blocks)?;
            engine_best = engine_best.min(start.elapsed().as_secs_f64());
            copy_from[0] = round as u8;
            let start = Instant::now();
            copy_to.copy_from_slice(black_box(&copy_from));
            black_box(&copy_to);
            copy_best = copy_best.min(start.elapsed().as_secs_f64());
        }
        if dst.as_slice() != src.as_slice() {
            return Err("the engine did not deliver the bytes".into());
        }
        let gbps = |s: f64| TOTAL as f64 / s / 1e9;
        println!(
            "{{\"name\": \"tcp/16MiB_as_{}\", \"value\": {:.4}, \"better\": \"higher\", \"engine_gbps\": {:.3}, \"memcpy_gbps\": {:.3}}}",
            if size == 4096 { "4KiB" } else { "1MiB" },
            gbps(engine_best) / gbps(copy_best),
            gbps(engine_best),
            gbps(copy_best)
        );
    }
    a.batch_deregister(&[src.addr()])?;
    b.batch_deregister(&[dst.addr()])?;
    Ok(())
}
