//! `kvbridge bench ucx`: the UCX engine between two processes on loopback,
//! laid out as `bench tcp` (same sizes, totals, protocol between the
//! processes and JSON rows), with `--tls` picking UCX's transports for both
//! processes (`UCX_TLS`; unset: UCX's environment and defaults).
//!
//! By default the blocks of a batch are contiguous, as in `bench tcp`, and
//! the engine merges each batch into one put. `--scatter` sends the blocks
//! to destinations in a scattered order (as KV pages are), so every block is
//! its own put: that is the layout to set beside `ucx_perftest -t
//! ucp_put_bw -s SIZE`.

use anyhow::{Context, Result, bail};
use clap::Args;
use kvbridge_engine::{Block, EngineConfig, TransferEngine, UcxEngine};

use super::PeerArgs;
use super::child::Target;
use super::measure::{Timing, print_rows, progress};
use super::size::parse_size;
use super::tcp::{buffer, fill_from, serve_buffer};

/// Options of `kvbridge bench ucx`.
#[derive(Debug, Clone, Args)]
pub struct UcxArgs {
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
    /// Blocks per submitted batch. The default is the batch the roles
    /// submit for a head-sliced layer (they go up to 65,536): each batch ends
    /// with a remote completion round trip, so small batches measure that
    /// round trip rather than the puts.
    #[arg(long, default_value_t = 16_384)]
    batch_blocks: usize,
    /// Batches in flight at once.
    #[arg(long, default_value_t = 4)]
    inflight: usize,
    /// UCX transports of both processes, as `UCX_TLS` (`tcp`,
    /// `posix,cma,self`, `rc,sm`, ...); default: UCX's environment.
    #[arg(long)]
    tls: Option<String>,
    /// Scatter the destinations so that every block is its own put.
    #[arg(long)]
    scatter: bool,
    /// Authenticate both processes with the cluster secret (from
    /// KVBRIDGE_SECRET_FILE / KVBRIDGE_SECRET, else a generated one handed
    /// to the target process through its environment).
    #[arg(long)]
    auth: bool,
    /// Skip the byte verification.
    #[arg(long)]
    no_verify: bool,
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

impl UcxArgs {
    fn engine(&self) -> Result<UcxEngine> {
        let cfg = EngineConfig {
            listen_host: self.peer.engine_host()?,
            secret: super::bench_secret(self.auth),
            io_timeout_ms: 60_000,
            ..EngineConfig::default()
        };
        let ucx: Vec<(&str, &str)> = self.tls.iter().map(|t| ("TLS", t.as_str())).collect();
        UcxEngine::with_ucx_config(cfg, &ucx).context("starting the UCX engine")
    }
}

/// Entry point: initiator, or target with `--serve`.
pub fn run(args: UcxArgs) -> Result<()> {
    if args.peer.is_target(args.serve) {
        return serve(&args);
    }
    initiate(&args)
}

fn serve(args: &UcxArgs) -> Result<()> {
    serve_buffer(
        &args.engine()?,
        args.bytes,
        args.peer
            .control(super::bench_secret(args.auth).as_deref())?,
    )
}

/// Spawns the target of `args` (`bench ucx --serve`).
fn spawn_target(args: &UcxArgs) -> Result<Target> {
    let extra: Vec<String> = args
        .tls
        .iter()
        .flat_map(|t| ["--tls".to_owned(), t.clone()])
        .collect();
    Target::spawn("ucx", args.bytes, &extra, super::bench_secret(args.auth))
}

/// A multiplier coprime with `n` and not 1 (mod n): `i -> i * m % n` is a
/// permutation that never puts block `i` right after block `i - 1`, so no
/// two blocks of a batch merge into one put.
fn scatter_multiplier(n: u64) -> u64 {
    if n < 3 {
        return 1;
    }
    let gcd = |mut a: u64, mut b: u64| {
        while b != 0 {
            (a, b) = (b, a % b);
        }
        a
    };
    // Coprime and not 1 (mod n); one exists for every n >= 3 (n - 1).
    let mut m = n / 2 + 1;
    while gcd(m, n) != 1 || m % n == 1 {
        m += 1;
    }
    m
}

/// Destination slot of source block `i`.
fn slot(i: u64, m: u64, n: u64) -> u64 {
    (u128::from(i) * u128::from(m) % u128::from(n)) as u64
}

fn initiate(args: &UcxArgs) -> Result<()> {
    let timing = Timing::new(
        "ucx",
        args.runs,
        args.batch_blocks,
        args.inflight,
        !args.no_verify,
    )?;
    for &size in &args.sizes {
        if size == 0 || size > args.bytes {
            bail!("block size {size} must be in 1..=--bytes ({})", args.bytes);
        }
        if args.scatter && size % 8 != 0 {
            bail!("--scatter needs block sizes that are multiples of 8");
        }
    }
    let secret = super::bench_secret(args.auth);
    let mut target = args
        .peer
        .target(args.bytes, secret.as_deref(), || spawn_target(args))?;
    let engine = args.engine()?;
    let mut src = buffer(args.bytes)?;
    let base = src.addr();
    // SAFETY: `src` outlives the engine's use of it: it is deregistered below
    // before being dropped, and only written between runs.
    unsafe { engine.batch_register(&[src.region()]) }.context("registering the source")?;
    eprintln!(
        "ucx {} over UCX_TLS={}{}",
        engine.ucx_version(),
        args.tls.as_deref().unwrap_or("(environment)"),
        if args.scatter { ", scattered" } else { "" }
    );
    let bar = progress(args.sizes.len() as u64 * u64::from(timing.runs()));
    let mut rows = Vec::new();
    for &size in &args.sizes {
        let n = args.bytes / size;
        let m = if args.scatter {
            scatter_multiplier(n)
        } else {
            1
        };
        // Source block i goes to destination slot i * m % n and carries the
        // pattern of that slot, so the target checks its buffer as a whole.
        let blocks: Vec<Block> = (0..n)
            .map(|i| Block {
                src: base + i * size,
                dst: target.addr + slot(i, m, n) * size,
                len: size,
            })
            .collect();
        for (i, chunk) in src.as_mut_slice()[..(n * size) as usize]
            .chunks_mut(size as usize)
            .enumerate()
        {
            fill_from(chunk, size, slot(i as u64, m, n) * size / 8);
        }
        let puts_before = engine.stats().puts;
        rows.push(timing.measure(&engine, &mut target, &blocks, size, &bar)?);
        let puts = (engine.stats().puts - puts_before) / u64::from(args.runs);
        tracing::info!(size, puts, "puts per run");
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
    fn scatter_is_a_permutation_without_neighbours() {
        for n in [2u64, 3, 4, 10, 64, 1000, 262_144] {
            let m = scatter_multiplier(n);
            let mut seen = vec![false; n as usize];
            for i in 0..n {
                let s = slot(i, m, n);
                assert!(!seen[s as usize], "n {n}: slot {s} twice");
                seen[s as usize] = true;
                if n > 2 && i > 0 {
                    assert_ne!(slot(i - 1, m, n) + 1, s, "n {n}: blocks {i} merge");
                }
            }
        }
        let mut a = vec![0u8; 64];
        super::super::tcp::fill(&mut a, 7);
        let mut b = vec![0u8; 32];
        fill_from(&mut b, 7, 4);
        assert_eq!(&a[32..], &b[..]);
    }
}
