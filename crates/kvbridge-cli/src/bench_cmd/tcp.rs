//! `kvbridge bench tcp`: two processes on 127.0.0.1.
//!
//! The initiator (this process) spawns the target (`current_exe() bench tcp
//! --serve`), which registers one host buffer, prints `READY <session>
//! <addr>` and then answers `VERIFY <seed> <bytes>` lines on stdin with `OK`
//! or `BAD <offset>` (the protocol of `child.rs`). Per block size the initiator fills its source with a
//! pattern, moves about `--bytes` bytes `--runs` times (batches of
//! `--batch-blocks` blocks, `--inflight` batches in flight), has the target
//! verify the first run, and reports the best run.

use std::io::Write;
use std::time::Instant;

use anyhow::{Context, Result, bail};
use clap::Args;
use kvbridge_engine::{Batch, Block, EngineConfig, Run, TcpConfig, TcpEngine, TransferEngine};
use kvbridge_mem::HostBuffer;
use kvbridge_plan::rng::{GOLDEN, splitmix};

use super::child::{self, Target};

/// Options of `kvbridge bench tcp`.
#[derive(Debug, Clone, Args)]
pub struct TcpArgs {
    /// Print one JSON object per block size on stdout.
    #[arg(long)]
    json: bool,
    /// Timed runs per block size (the best is reported).
    #[arg(long, default_value_t = 3)]
    runs: u32,
    /// Bytes moved per run (and size of both buffers).
    #[arg(long, default_value_t = 1 << 30)]
    bytes: u64,
    /// Block sizes in bytes, comma-separated.
    #[arg(long, value_delimiter = ',', default_values_t = [4096u64, 65536, 1 << 20, 16 << 20])]
    sizes: Vec<u64>,
    /// Blocks per submitted batch.
    #[arg(long, default_value_t = 1024)]
    batch_blocks: usize,
    /// Batches in flight at once.
    #[arg(long, default_value_t = 4)]
    inflight: usize,
    /// Connections per peer (default: the engine's).
    #[arg(long)]
    connections: Option<usize>,
    /// Coalescing threshold in bytes (default: the engine's).
    #[arg(long)]
    coalesce_threshold: Option<usize>,
    /// Target payload bytes per request (default: the engine's).
    #[arg(long)]
    request_bytes: Option<usize>,
    /// Requests in flight per connection (default: the engine's).
    #[arg(long)]
    pipeline_depth: Option<usize>,
    /// Authenticate both processes with the cluster secret (from
    /// KVBRIDGE_SECRET_FILE / KVBRIDGE_SECRET, else a generated one handed
    /// to the target process through its environment).
    #[arg(long)]
    auth: bool,
    /// Skip the byte verification.
    #[arg(long)]
    no_verify: bool,
    /// Submit the blocks as strided runs of this many copies each (what a
    /// heterogeneous-TP plan hands the engine) instead of one block each.
    #[arg(long)]
    runs_of: Option<u64>,
    /// With `--runs-of`: have the engine expand runs into blocks before
    /// sending (one descriptor per copy) instead of carrying them natively.
    #[arg(long)]
    expand_runs: bool,
    /// Run as the target process (spawned by the initiator).
    #[arg(long, hide = true)]
    serve: bool,
}

impl TcpArgs {
    fn engine_config(&self) -> EngineConfig {
        let d = EngineConfig::default();
        EngineConfig {
            listen_host: "127.0.0.1".into(),
            tcp: TcpConfig {
                connections_per_peer: self.connections.unwrap_or(d.tcp.connections_per_peer),
                coalesce_threshold: self.coalesce_threshold.unwrap_or(d.tcp.coalesce_threshold),
                request_bytes: self.request_bytes.unwrap_or(d.tcp.request_bytes),
                pipeline_depth: self.pipeline_depth.unwrap_or(d.tcp.pipeline_depth),
                native_runs: !self.expand_runs,
                ..d.tcp.clone()
            },
            secret: super::bench_secret(self.auth),
            ..d
        }
    }
}

/// Fill `buf` with the pattern of `seed` (a SplitMix64 stream per 8-byte word).
pub(super) fn fill(buf: &mut [u8], seed: u64) {
    fill_from(buf, seed, 0);
}

/// Fill `buf` with the pattern of `seed` as it reads from 8-byte word
/// `first_word` on ([`fill`] is `first_word` 0).
pub(super) fn fill_from(buf: &mut [u8], seed: u64, first_word: u64) {
    for (w, chunk) in buf.chunks_mut(8).enumerate() {
        chunk.copy_from_slice(&word(seed, first_word + w as u64)[..chunk.len()]);
    }
}

/// First offset in `buf` that differs from the pattern of `seed`.
pub(super) fn first_mismatch(buf: &[u8], seed: u64) -> Option<usize> {
    for (w, chunk) in buf.chunks(8).enumerate() {
        let v = word(seed, w as u64);
        if chunk != &v[..chunk.len()] {
            let i = chunk.iter().zip(v).position(|(a, b)| *a != b).unwrap_or(0);
            return Some(w * 8 + i);
        }
    }
    None
}

/// Word `w` of the pattern of `seed`, little-endian.
fn word(seed: u64, w: u64) -> [u8; 8] {
    splitmix(seed ^ w.wrapping_mul(GOLDEN)).to_le_bytes()
}

/// Entry point: initiator, or target with `--serve`.
pub fn run(args: TcpArgs) -> Result<()> {
    if args.serve {
        return serve(&args);
    }
    initiate(&args)
}

/// A zeroed host buffer of `bytes`, its pages faulted in.
pub(super) fn buffer(bytes: u64) -> Result<HostBuffer> {
    let len = usize::try_from(bytes).context("--bytes too large")?;
    let mut b = HostBuffer::new(len).context("allocating the buffer")?;
    // Fault the pages in now, not during the first timed run.
    b.as_mut_slice().fill(0);
    Ok(b)
}

fn serve(args: &TcpArgs) -> Result<()> {
    let engine = TcpEngine::new(args.engine_config()).context("starting the tcp engine")?;
    serve_buffer(&engine, args.bytes)?;
    let s = engine.stats();
    tracing::info!(bytes_received = s.bytes_received, "bench target done");
    Ok(())
}

/// The target of `bench tcp` and `bench ucx`: registers a host buffer of
/// `bytes` with `engine` and answers `VERIFY <seed> <bytes>` (the first
/// `bytes` hold the pattern of `seed`) with `OK` or `BAD <offset>`.
pub(super) fn serve_buffer(engine: &impl TransferEngine, bytes: u64) -> Result<()> {
    let buf = buffer(bytes)?;
    // SAFETY: `buf` lives until the end of this function and is deregistered
    // before it is dropped; it is only read (VERIFY) between transfers, when
    // the initiator has waited for every batch.
    unsafe { engine.batch_register(&[buf.region()]) }.context("registering the buffer")?;
    child::serve(engine.session_id(), buf.addr(), |words| match words {
        ["VERIFY", seed, bytes] => {
            let seed: u64 = seed.parse()?;
            let n = usize::try_from(bytes.parse::<u64>()?)?.min(buf.len());
            Ok(child::verdict(first_mismatch(&buf.as_slice()[..n], seed)))
        }
        _ => bail!("unknown command"),
    })?;
    engine.batch_deregister(&[buf.addr()])?;
    Ok(())
}

/// Spawns the target of `args` (`bench tcp --serve`).
fn spawn_target(args: &TcpArgs) -> Result<Target> {
    let threshold = args.engine_config().tcp.coalesce_threshold.to_string();
    let extra = ["--coalesce-threshold".to_owned(), threshold];
    Target::spawn("tcp", args.bytes, &extra, super::bench_secret(args.auth))
}

/// Has the target check that its first `bytes` hold the pattern of `seed`.
fn verify(target: &mut Target, seed: u64, bytes: u64) -> Result<()> {
    target
        .ask(&format!("VERIFY {seed} {bytes}"))
        .context("target found wrong bytes")
}

/// One block size's best run.
#[derive(Debug, serde::Serialize)]
pub(super) struct Row {
    pub block_size: u64,
    pub bytes: u64,
    pub seconds: f64,
    pub gbps: f64,
    pub blocks_per_s: f64,
    pub runs_gbps: Vec<f64>,
    pub verified: bool,
}

/// How `bench tcp` and `bench ucx` time one block size.
#[derive(Debug, Clone, Copy)]
pub(super) struct Timing {
    /// Timed runs (the best is reported).
    runs: u32,
    /// Blocks per submitted batch.
    batch_blocks: usize,
    /// Batches in flight at once.
    inflight: usize,
    /// Whether the target verifies the first run.
    verify: bool,
    /// Copies per strided run, when blocks are submitted as runs.
    runs_of: Option<u64>,
}

impl Timing {
    /// From the options; all counts must be positive.
    pub fn new(runs: u32, batch_blocks: usize, inflight: usize, verify: bool) -> Result<Self> {
        if runs == 0 || batch_blocks == 0 || inflight == 0 {
            bail!("--runs, --batch-blocks and --inflight must be positive");
        }
        Ok(Self {
            runs,
            batch_blocks,
            inflight,
            verify,
            runs_of: None,
        })
    }

    /// Submit the blocks as strided runs of `copies` copies each.
    pub fn with_runs_of(self, copies: Option<u64>) -> Result<Self> {
        if copies == Some(0) {
            bail!("--runs-of must be positive");
        }
        Ok(Self {
            runs_of: copies,
            ..self
        })
    }

    /// Moves `blocks` (each `size` bytes, together the target's first
    /// `blocks.len() * size` bytes) `runs` times and has the target verify
    /// the first run; the best run's row.
    pub fn measure(
        &self,
        engine: &impl TransferEngine,
        target: &mut Target,
        blocks: &[Block],
        size: u64,
    ) -> Result<Row> {
        let n = blocks.len() as u64;
        let mut times = Vec::new();
        for run in 0..self.runs {
            let t = Instant::now();
            let mut pending = std::collections::VecDeque::new();
            for chunk in blocks.chunks(self.batch_blocks) {
                if pending.len() >= self.inflight {
                    let h: kvbridge_engine::BatchHandle = pending.pop_front().context("window")?;
                    h.wait().context("transfer failed")?;
                }
                let to = kvbridge_engine::Target::any(&target.session);
                pending.push_back(match self.runs_of {
                    None => engine.submit(to, Batch::Blocks(chunk)),
                    Some(k) => engine.submit(to, Batch::Runs(&as_runs(chunk, k))),
                });
            }
            for h in pending {
                h.wait().context("transfer failed")?;
            }
            let secs = t.elapsed().as_secs_f64();
            times.push(secs);
            if run == 0 && self.verify {
                verify(target, size, n * size)?;
            }
        }
        let best = times.iter().copied().fold(f64::INFINITY, f64::min);
        let bytes = n * size;
        Ok(Row {
            block_size: size,
            bytes,
            seconds: best,
            gbps: bytes as f64 / best / 1e9,
            blocks_per_s: n as f64 / best,
            runs_gbps: times.iter().map(|s| bytes as f64 / s / 1e9).collect(),
            verified: self.verify,
        })
    }
}

/// Consecutive, equally long and equally spaced `blocks` as runs of at
/// most `copies` copies.
fn as_runs(blocks: &[Block], copies: u64) -> Vec<Run> {
    blocks
        .chunks(copies as usize)
        .map(|c| {
            let (first, len) = (c[0], c[0].len);
            let stride = |f: fn(&Block) -> u64| c.get(1).map_or(len, |b| f(b) - f(&first));
            Run {
                src: first.src,
                dst: first.dst,
                len,
                count: c.len() as u64,
                src_stride: stride(|b| b.src),
                dst_stride: stride(|b| b.dst),
            }
        })
        .collect()
}

fn initiate(args: &TcpArgs) -> Result<()> {
    let timing = Timing::new(args.runs, args.batch_blocks, args.inflight, !args.no_verify)?
        .with_runs_of(args.runs_of)?;
    let mut target = spawn_target(args)?;
    let engine = TcpEngine::new(args.engine_config()).context("starting the tcp engine")?;
    let mut src = buffer(args.bytes)?;
    let base = src.addr();
    // SAFETY: `src` outlives the engine's use of it: it is deregistered below
    // before being dropped, and only written between runs.
    unsafe { engine.batch_register(&[src.region()]) }.context("registering the source")?;
    let dst_base = target.addr;
    let mut rows = Vec::new();
    for &size in &args.sizes {
        if size == 0 || size > args.bytes {
            bail!("block size {size} must be in 1..=--bytes");
        }
        let n = args.bytes / size;
        let blocks: Vec<Block> = (0..n)
            .map(|i| Block {
                src: base + i * size,
                dst: dst_base + i * size,
                len: size,
            })
            .collect();
        fill(src.as_mut_slice(), size);
        rows.push(timing.measure(&engine, &mut target, &blocks, size)?);
    }
    engine.batch_deregister(&[base])?;
    drop(target);
    print_rows(args.json, &rows)?;
    Ok(())
}

/// The table on stdout; with `json`, one object per row on stdout instead
/// (and the table on stderr, so stdout stays JSON lines).
pub(super) fn print_rows(json: bool, rows: &[Row]) -> Result<()> {
    let mut table = String::new();
    table.push_str(&format!(
        "{:>10} {:>12} {:>9} {:>8} {:>12}  runs (GB/s)\n",
        "block", "bytes", "best s", "GB/s", "blocks/s"
    ));
    for r in rows {
        let runs: Vec<String> = r.runs_gbps.iter().map(|g| format!("{g:.2}")).collect();
        table.push_str(&format!(
            "{:>10} {:>12} {:>9.4} {:>8.3} {:>12.0}  {}\n",
            human(r.block_size),
            r.bytes,
            r.seconds,
            r.gbps,
            r.blocks_per_s,
            runs.join(" ")
        ));
    }
    if json {
        eprint!("{table}");
    } else {
        print!("{table}");
    }
    if json {
        let mut out = std::io::stdout().lock();
        for r in rows {
            writeln!(out, "{}", serde_json::to_string(r)?)?;
        }
    }
    Ok(())
}

fn human(n: u64) -> String {
    match n {
        n if n >= 1 << 20 && n % (1 << 20) == 0 => format!("{} MiB", n >> 20),
        n if n >= 1 << 10 && n % (1 << 10) == 0 => format!("{} KiB", n >> 10),
        n => format!("{n} B"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pattern_detects_misplaced_bytes() {
        let mut a = vec![0u8; 1003];
        fill(&mut a, 4096);
        assert_eq!(first_mismatch(&a, 4096), None);
        assert_eq!(first_mismatch(&a, 65536), Some(0));
        a[1001] ^= 1;
        assert_eq!(first_mismatch(&a, 4096), Some(1001));
        assert_eq!(human(4096), "4 KiB");
        assert_eq!(human(16 << 20), "16 MiB");
    }
}
