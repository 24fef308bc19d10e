//! `kvbridge bench tcp`: an initiator and a target, two processes on
//! 127.0.0.1 (the initiator spawns `current_exe() bench tcp --serve`) or
//! on two machines (`--listen ADDR` there, `--connect ADDR` here).
//!
//! The target registers one host buffer and answers `VERIFY <seed>
//! <bytes>` with `OK` or `BAD <offset>` (the protocol of `child.rs`). Per
//! block size the initiator fills its source with a pattern, moves about
//! `--bytes` bytes `--runs` times (batches of `--batch-blocks` blocks,
//! `--inflight` batches in flight), has the target verify the first run,
//! and reports the median run with its spread, the best run, and the
//! batches' latency percentiles.

use anyhow::{Context, Result, bail};
use clap::Args;
use kvbridge_engine::{Block, EngineConfig, TcpConfig, TcpEngine, TransferEngine};
use kvbridge_mem::HostBuffer;
use kvbridge_plan::rng::{GOLDEN, splitmix};

use super::PeerArgs;
use super::child::{self, Control, Target};
use super::measure::{Timing, print_rows, progress};
use super::size::parse_size;

/// Options of `kvbridge bench tcp`.
#[derive(Debug, Clone, Args)]
pub struct TcpArgs {
    /// Print one JSON object per block size on stdout.
    #[arg(long)]
    json: bool,
    /// Timed runs per block size (the median, spread and best are reported).
    #[arg(long, default_value_t = 3)]
    runs: u32,
    /// Bytes moved per run (and size of both buffers): 1073741824, 64M, 1G.
    #[arg(long, default_value = "1G", value_parser = parse_size)]
    bytes: u64,
    /// Block sizes, comma-separated: 4096,65536 or 4K,64K,1M,16M.
    #[arg(long, value_delimiter = ',', default_value = "4K,64K,1M,16M", value_parser = parse_size)]
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
    /// Also draw GB/s and batch latency against block size into this SVG file.
    #[arg(long, value_name = "FILE")]
    plot: Option<std::path::PathBuf>,
    /// Two machines.
    #[command(flatten)]
    peer: PeerArgs,
    /// Run as the target process (spawned by the initiator).
    #[arg(long, hide = true)]
    serve: bool,
}

impl TcpArgs {
    fn engine_config(&self) -> Result<EngineConfig> {
        let d = EngineConfig::default();
        Ok(EngineConfig {
            listen_host: self.peer.engine_host()?,
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
        })
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
    if args.peer.is_target(args.serve) {
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
    let engine = TcpEngine::new(args.engine_config()?).context("starting the tcp engine")?;
    serve_buffer(
        &engine,
        args.bytes,
        args.peer
            .control(super::bench_secret(args.auth).as_deref())?,
    )?;
    let s = engine.stats();
    tracing::info!(bytes_received = s.bytes_received, "bench target done");
    Ok(())
}

/// The target of `bench tcp` and `bench ucx`: registers a host buffer of
/// `bytes` with `engine` and answers `VERIFY <seed> <bytes>` (the first
/// `bytes` hold the pattern of `seed`) with `OK` or `BAD <offset>`, to the
/// initiators `control` brings.
pub(super) fn serve_buffer(
    engine: &impl TransferEngine,
    bytes: u64,
    control: Control,
) -> Result<()> {
    let buf = buffer(bytes)?;
    // SAFETY: `buf` lives until the end of this function and is deregistered
    // before it is dropped; it is only read (VERIFY) between transfers, when
    // the initiator has waited for every batch.
    unsafe { engine.batch_register(&[buf.region()]) }.context("registering the buffer")?;
    child::serve(
        control,
        engine.session_id(),
        buf.addr(),
        bytes,
        |words| match words {
            ["VERIFY", seed, bytes] => {
                let seed: u64 = seed.parse()?;
                let n = usize::try_from(bytes.parse::<u64>()?)?.min(buf.len());
                Ok(child::verdict(first_mismatch(&buf.as_slice()[..n], seed)))
            }
            _ => bail!("unknown command"),
        },
    )?;
    engine.batch_deregister(&[buf.addr()])?;
    Ok(())
}

/// Spawns the target of `args` (`bench tcp --serve`).
fn spawn_target(args: &TcpArgs) -> Result<Target> {
    let threshold = args.engine_config()?.tcp.coalesce_threshold.to_string();
    let extra = ["--coalesce-threshold".to_owned(), threshold];
    Target::spawn("tcp", args.bytes, &extra, super::bench_secret(args.auth))
}

fn initiate(args: &TcpArgs) -> Result<()> {
    let timing = Timing::new(
        "tcp",
        args.runs,
        args.batch_blocks,
        args.inflight,
        !args.no_verify,
    )?
    .with_runs_of(args.runs_of)?;
    for &size in &args.sizes {
        if size == 0 || size > args.bytes {
            bail!("block size {size} must be in 1..=--bytes ({})", args.bytes);
        }
    }
    let secret = super::bench_secret(args.auth);
    let mut target = args
        .peer
        .target(args.bytes, secret.as_deref(), || spawn_target(args))?;
    let engine = TcpEngine::new(args.engine_config()?).context("starting the tcp engine")?;
    let mut src = buffer(args.bytes)?;
    let base = src.addr();
    // SAFETY: `src` outlives the engine's use of it: it is deregistered below
    // before being dropped, and only written between runs.
    unsafe { engine.batch_register(&[src.region()]) }.context("registering the source")?;
    let dst_base = target.addr;
    let bar = progress(args.sizes.len() as u64 * u64::from(timing.runs()));
    let mut rows = Vec::new();
    for &size in &args.sizes {
        let n = args.bytes / size;
        let blocks: Vec<Block> = (0..n)
            .map(|i| Block {
                src: base + i * size,
                dst: dst_base + i * size,
                len: size,
            })
            .collect();
        fill(src.as_mut_slice(), size);
        rows.push(timing.measure(&engine, &mut target, &blocks, size, &bar)?);
    }
    bar.finish_and_clear();
    engine.batch_deregister(&[base])?;
    drop(target);
    print_rows(args.json, &rows)?;
    super::plot::write(args.plot.as_deref(), &rows)
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
    }
}
