//! `kvbridge bench ipc`: the CUDA IPC engine between two processes on one GPU.
//!
//! The initiator spawns the target (`current_exe() bench ipc --serve`; or
//! connects to one started apart with `--listen`, on the same machine),
//! which allocates and registers one device buffer, prints `READY <session>
//! <addr>` and answers `VERIFY <seed> <size> <mult> <add>` with `OK` or
//! `BAD <block>`. Per block size the initiator moves `--bytes` through the
//! engine (destinations scattered by an affine permutation, so no two
//! consecutive blocks are adjacent) in batches of `--batch-bytes` with up
//! to `--inflight` batches in flight (as a prefill worker submits), `--passes`
//! times per run; verifies the first run, and reports the best of `--runs`
//! against, in the same process and run: one `cuMemcpyDtoD` of `--bytes`,
//! the batched kernel alone (device time, descriptors already on the GPU)
//! and one `cuMemcpyAsync` per block.

use std::collections::VecDeque;
use std::time::Instant;

use anyhow::{Context, Result, bail};
use clap::Args;
use kvbridge_engine::ipc::{Copies, CopyBench, CopyMode, CopyTuning};
use kvbridge_engine::{Batch, BatchHandle, Block, EngineConfig, IpcEngine, Run, TransferEngine};
use kvbridge_mem::cuda::{self, DeviceBuffer, Event, Stream};

use super::PeerArgs;
use super::child::{self, Target};
use super::ipc_layout::{dest, head_slice_runs, pattern, slot, threads};
use super::size::parse_size;

/// Options of `kvbridge bench ipc`.
#[derive(Debug, Clone, Args)]
pub struct IpcArgs {
    /// Print one JSON object per block size on stdout.
    #[arg(long)]
    json: bool,
    /// Timed runs per block size (the best is reported).
    #[arg(long, default_value_t = 3)]
    runs: u32,
    /// Bytes moved per run (and size of the buffers): 1073741824, 64M, 1G.
    #[arg(long, default_value = "1G", value_parser = parse_size)]
    bytes: u64,
    /// Block sizes, comma-separated: 256,4096 or 256,4K,64K,1M,16M.
    #[arg(long, value_delimiter = ',', default_value = "256,4K,64K,1M,16M", value_parser = parse_size)]
    sizes: Vec<u64>,
    /// Bytes per submitted batch (default: all of `--bytes` in one batch).
    #[arg(long, value_parser = parse_size)]
    batch_bytes: Option<u64>,
    /// Batches in flight at once.
    #[arg(long, default_value_t = 1)]
    inflight: usize,
    /// Times each run moves `--bytes` (the same blocks again).
    #[arg(long, default_value_t = 1)]
    passes: u32,
    /// Longest piece of a block one kernel descriptor covers (default: the engine's).
    #[arg(long)]
    piece: Option<u64>,
    /// Kernel streams per session, 1 or 2 (default: the engine's).
    #[arg(long)]
    kernel_streams: Option<u32>,
    /// Only time the batched kernel alone per block size over launch
    /// shapes (threads per descriptor, CTAs per multiprocessor).
    #[arg(long)]
    kernel_sweep: bool,
    /// Most blocks timed with one `cuMemcpyAsync` each (the rest extrapolated).
    #[arg(long, default_value_t = 65536)]
    per_block_limit: u64,
    /// Also move each size as strided runs of this many copies (head
    /// slices of a page, as a prefill worker hands them to the engine;
    /// 0: blocks only).
    #[arg(long, default_value_t = 0)]
    run_copies: u64,
    /// GPU to use.
    #[arg(long, default_value_t = 0)]
    device: i32,
    /// Two processes started apart (CUDA IPC stays within one machine:
    /// give a loopback or local address).
    #[command(flatten)]
    peer: PeerArgs,
    /// Run as the target process (spawned by the initiator).
    #[arg(long, hide = true)]
    serve: bool,
}

/// Entry point: initiator, or target with `--serve`.
pub fn run(args: IpcArgs) -> Result<()> {
    if let Some(why) = cuda::unavailable_reason() {
        bail!("no CUDA ({why}): bench ipc needs a GPU");
    }
    if args.peer.is_target(args.serve) {
        return serve(&args);
    }
    if args.kernel_sweep {
        return kernel_sweep(&args);
    }
    initiate(&args)
}

fn engine_config(peer: &PeerArgs) -> Result<EngineConfig> {
    Ok(EngineConfig {
        listen_host: peer.engine_host()?,
        ..EngineConfig::default()
    })
}

impl IpcArgs {
    fn tuning(&self) -> CopyTuning {
        let d = CopyTuning::default();
        CopyTuning {
            piece: self.piece.unwrap_or(d.piece),
            kernel_streams: self.kernel_streams.unwrap_or(d.kernel_streams),
            ..d
        }
    }
}

fn serve(args: &IpcArgs) -> Result<()> {
    let engine = IpcEngine::new(engine_config(&args.peer)?, CopyTuning::default())?;
    let len = usize::try_from(args.bytes)?;
    let buf = DeviceBuffer::new(args.device, len)?;
    // SAFETY: `buf` lives until the end of this function and is deregistered
    // before it is dropped; it is only read (VERIFY) between transfers.
    unsafe { engine.batch_register(&[buf.region()]) }?;
    let mut host = vec![0u8; len];
    let control = args.peer.control(None)?;
    child::serve(
        control,
        engine.session_id(),
        buf.addr(),
        args.bytes,
        |words| match words {
            ["ZERO"] => {
                buf.fill(0)?;
                Ok("OK".to_owned())
            }
            ["VERIFY", numbers @ ..] => {
                let numbers = numbers
                    .iter()
                    .map(|x| x.parse())
                    .collect::<Result<Vec<u64>, _>>()?;
                let [seed, size, mult, add, copies] = numbers[..] else {
                    bail!("VERIFY takes 5 numbers");
                };
                let bad = first_bad_block(&buf, &mut host, seed, size, (mult, add), copies)?;
                Ok(child::verdict(bad))
            }
            _ => bail!("unknown command"),
        },
    )?;
    engine.batch_deregister(&[buf.addr()])?;
    Ok(())
}

/// The first block of `buf` (read into `host`) that does not hold the
/// pattern of `seed` its source block had, if any.
fn first_bad_block(
    buf: &DeviceBuffer,
    host: &mut [u8],
    seed: u64,
    size: u64,
    (mult, add): (u64, u64),
    copies: u64,
) -> Result<Option<u64>> {
    let len = host.len();
    buf.read(0, host)?;
    let want = pattern(seed, len);
    let size = usize::try_from(size)?;
    if size == 0 {
        bail!("block size 0");
    }
    let n = (len / size) as u64;
    let per = n.div_ceil(threads() as u64).max(1);
    let (host, want) = (&*host, &want);
    Ok(std::thread::scope(|s| {
        let parts: Vec<_> = (0..n)
            .step_by(per as usize)
            .map(|from| {
                s.spawn(move || {
                    (from..(from + per).min(n)).find(|&i| {
                        let s = dest(i, n, mult, add, copies) as usize * size;
                        let i = i as usize * size;
                        host[s..s + size] != want[i..i + size]
                    })
                })
            })
            .collect();
        parts
            .into_iter()
            .find_map(|h| h.join().unwrap_or(Some(u64::MAX)))
    }))
}

fn spawn_target(args: &IpcArgs) -> Result<Target> {
    let extra = ["--device".to_owned(), args.device.to_string()];
    Target::spawn("ipc", args.bytes, &extra, None)
}

impl Target {
    fn verify(&mut self, seed: u64, size: u64, (mult, add): (u64, u64), copies: u64) -> Result<()> {
        self.ask(&format!("VERIFY {seed} {size} {mult} {add} {copies}"))
            .context("target found wrong bytes")
    }

    /// Zero the target's buffer.
    fn zero(&mut self) -> Result<()> {
        self.ask("ZERO")
    }
}

/// One block size.
#[derive(Debug, serde::Serialize)]
struct Row {
    /// `blocks` (one per copy) or `runs` (strided, `copies_per_run` each).
    layout: &'static str,
    copies_per_run: u64,
    block_size: u64,
    blocks: u64,
    bytes: u64,
    /// Bytes per batch.
    batch_bytes: u64,
    /// Batches in flight.
    inflight: usize,
    /// IPC engine, two processes, end to end (best run).
    ipc_gbps: f64,
    /// `ipc_gbps` over the plain device-to-device memcpy of the same total.
    of_memcpy: f64,
    /// Which path the engine's per-batch choice took.
    path: &'static str,
    /// The batched kernel alone (device time, descriptors resident; blocks only).
    kernel_gbps: Option<f64>,
    /// One `cuMemcpyAsync` per block (in-process; blocks only).
    per_block_gbps: Option<f64>,
    /// The reference: one `cuMemcpyDtoD` of `bytes` (in-process).
    memcpy_gbps: f64,
    verified: bool,
}

fn gbps(bytes: u64, seconds: f64) -> f64 {
    if seconds > 0.0 {
        bytes as f64 / seconds / 1e9
    } else {
        0.0
    }
}

fn memcpy_reference(args: &IpcArgs, src: &DeviceBuffer, dst: &DeviceBuffer) -> Result<f64> {
    let stream = Stream::new(args.device)?;
    let (a, b) = (Event::new(args.device)?, Event::new(args.device)?);
    let len = usize::try_from(args.bytes)?;
    let mut best = 0f64;
    for _ in 0..args.runs.max(1) + 1 {
        a.record(&stream)?;
        // SAFETY: both buffers are ours, `len` bytes each, alive until after the sync.
        unsafe { stream.memcpy(dst.addr(), src.addr(), len) }?;
        b.record(&stream)?;
        b.synchronize()?;
        let s = f64::from(b.elapsed_ms(&a)?) / 1e3;
        best = best.max(gbps(args.bytes, s));
    }
    Ok(best)
}

/// One run: every pass over `blocks` in batches of `per` blocks, up to
/// `inflight` of them in flight.
fn run_batches<T>(
    items: &[T],
    per: usize,
    inflight: usize,
    passes: u32,
    submit: impl Fn(&[T]) -> BatchHandle,
) -> Result<()> {
    let mut pending: VecDeque<BatchHandle> = VecDeque::new();
    for _ in 0..passes.max(1) {
        for chunk in items.chunks(per.max(1)) {
            if pending.len() >= inflight.max(1)
                && let Some(h) = pending.pop_front()
            {
                h.wait()?;
            }
            pending.push_back(submit(chunk));
        }
    }
    for h in pending {
        h.wait()?;
    }
    Ok(())
}

fn initiate(args: &IpcArgs) -> Result<()> {
    if args.runs == 0 || args.inflight == 0 || args.passes == 0 {
        bail!("--runs, --inflight and --passes must be positive");
    }
    let mut target = args.peer.target(args.bytes, None, || spawn_target(args))?;
    let tuning = args.tuning();
    let engine = IpcEngine::new(engine_config(&args.peer)?, tuning)?;
    let len = usize::try_from(args.bytes)?;
    let src = DeviceBuffer::new(args.device, len)?;
    let scratch = DeviceBuffer::new(args.device, len)?;
    // SAFETY: `src` is deregistered below before it is dropped.
    unsafe { engine.batch_register(&[src.region()]) }?;
    let memcpy = memcpy_reference(args, &src, &scratch)?;
    let mut copier = CopyBench::new(args.device, tuning)?;
    let mut rows = Vec::new();
    for (k, &size) in args.sizes.iter().enumerate() {
        if size == 0 || size > args.bytes {
            bail!("block size {size} must be in 1..=--bytes");
        }
        let seed = 0x5eed + k as u64;
        src.write(0, &pattern(seed, len))?;
        let n = args.bytes / size;
        let (mult, add) = (0x9E37_79B9_7F4A_7C15 | 1, n / 3);
        let remote: Vec<Block> = (0..n)
            .map(|i| Block {
                src: src.addr() + i * size,
                dst: target.addr + slot(i, n, mult, add) * size,
                len: size,
            })
            .collect();
        let moved = n * size;
        let batch_bytes = args.batch_bytes.unwrap_or(args.bytes).max(size);
        let per = usize::try_from(batch_bytes / size)?;
        let (inflight, passes) = (args.inflight, args.passes);
        let session = target.session.clone();
        let submit =
            |c: &[Block]| engine.submit(kvbridge_engine::Target::any(&session), Batch::Blocks(c));
        run_batches(&remote, per, inflight, 1, submit)?;
        target.verify(seed, size, (mult, add), 0)?;
        let mut ipc = 0f64;
        for _ in 0..args.runs {
            let t = Instant::now();
            run_batches(&remote, per, inflight, passes, submit)?;
            let total = moved * u64::from(passes);
            ipc = ipc.max(gbps(total, t.elapsed().as_secs_f64()));
        }
        let local: Vec<Block> = remote
            .iter()
            .map(|b| Block {
                dst: b.dst - target.addr + scratch.addr(),
                ..*b
            })
            .collect();
        let path = if tuning.wants_memcpy(&local[0]) {
            "cuMemcpyAsync per block"
        } else {
            "batched kernel"
        };
        let kernel_pieces = copier.kernel_pieces(&Copies::new(&src, &scratch, &local)?);
        let ms = copier.time_kernel(&kernel_pieces, 5)?;
        let kernel = gbps(moved, ms / 1e3);
        let some = &local[..local.len().min(args.per_block_limit.max(1) as usize)];
        copier.set_tuning(CopyTuning {
            mode: CopyMode::PerBlock,
            ..tuning
        });
        let checked = Copies::new(&src, &scratch, some)?;
        copier.copy(&checked)?;
        let t = Instant::now();
        copier.copy(&checked)?;
        let per_block = gbps(some.len() as u64 * size, t.elapsed().as_secs_f64());
        copier.set_tuning(tuning);
        rows.push(Row {
            layout: "blocks",
            copies_per_run: 1,
            block_size: size,
            blocks: n,
            bytes: moved,
            batch_bytes: per as u64 * size,
            inflight,
            ipc_gbps: ipc,
            of_memcpy: ipc / memcpy,
            path,
            kernel_gbps: Some(kernel),
            per_block_gbps: Some(per_block),
            memcpy_gbps: memcpy,
            verified: true,
        });
        let copies = args.run_copies;
        if copies == 0 {
            continue;
        }
        if !n.is_multiple_of(2 * copies) {
            eprintln!(
                "bench ipc: no runs row for {size} B: {n} blocks do not fill pages of {copies} tokens x 2"
            );
            continue;
        }
        let runs = head_slice_runs(src.addr(), target.addr, n, size, copies, mult, add);
        let per = usize::try_from((batch_bytes / (size * copies)).max(1))?;
        let submit =
            |c: &[Run]| engine.submit(kvbridge_engine::Target::any(&session), Batch::Runs(c));
        target.zero()?; // so that a copy the runs miss cannot pass as stale bytes
        run_batches(&runs, per, inflight, 1, submit)?;
        target.verify(seed, size, (mult, add), copies)?;
        let mut ipc = 0f64;
        for _ in 0..args.runs {
            let t = Instant::now();
            run_batches(&runs, per, inflight, passes, submit)?;
            ipc = ipc.max(gbps(moved * u64::from(passes), t.elapsed().as_secs_f64()));
        }
        // The run kernel alone: the same runs into `scratch`, in this process
        // (copies longer than a piece are not the run kernel's).
        let kernel = if size <= tuning.piece {
            let local = head_slice_runs(src.addr(), scratch.addr(), n, size, copies, mult, add);
            let ms = copier.time_runs(&src, &scratch, &local, 5)?;
            Some(gbps(moved, ms / 1e3))
        } else {
            None
        };
        rows.push(Row {
            layout: "runs",
            copies_per_run: copies,
            block_size: size,
            blocks: n,
            bytes: moved,
            batch_bytes: per as u64 * size * copies,
            inflight,
            ipc_gbps: ipc,
            of_memcpy: ipc / memcpy,
            path: if size <= tuning.piece {
                "run kernel"
            } else if tuning.wants_memcpy(&local[0]) {
                "cuMemcpyAsync per block"
            } else {
                "batched kernel (pieces)"
            },
            kernel_gbps: kernel,
            per_block_gbps: None,
            memcpy_gbps: memcpy,
            verified: true,
        });
    }
    engine.batch_deregister(&[src.addr()])?;
    drop(target);
    if args.json {
        for r in &rows {
            println!("{}", serde_json::to_string(r)?);
        }
        return Ok(());
    }
    println!(
        "cuMemcpyDtoD of {} MiB (same process, device time): {memcpy:.1} GB/s; \
         IPC engine: batches of {} MiB, {} in flight, {} pass(es) per run, best of {}; \
         piece {} KiB, {} kernel stream(s)",
        args.bytes >> 20,
        args.batch_bytes.unwrap_or(args.bytes) >> 20,
        args.inflight,
        args.passes,
        args.runs,
        tuning.piece >> 10,
        tuning.kernel_streams
    );
    println!(
        "| block | layout | blocks | IPC engine GB/s (2 processes) | of memcpy | path | kernel alone GB/s | cuMemcpyAsync per block GB/s |"
    );
    println!("|---:|---|---:|---:|---:|---|---:|---:|");
    let opt = |x: Option<f64>, digits: usize| x.map_or("-".into(), |v| format!("{v:.digits$}"));
    for r in &rows {
        let layout = match r.layout {
            "runs" => format!("runs of {}", r.copies_per_run),
            l => l.to_owned(),
        };
        println!(
            "| {} | {layout} | {} | {:.1} | {:.0}% | {} | {} | {} |",
            human(r.block_size),
            r.blocks,
            r.ipc_gbps,
            r.of_memcpy * 100.0,
            r.path,
            opt(r.kernel_gbps, 1),
            opt(r.per_block_gbps, 3)
        );
    }
    Ok(())
}

/// `--kernel-sweep`: the kernel alone (device time, descriptors resident)
/// per block size and launch shape, in one process.
fn kernel_sweep(args: &IpcArgs) -> Result<()> {
    let tuning = args.tuning();
    let len = usize::try_from(args.bytes)?;
    let src = DeviceBuffer::new(args.device, len)?;
    let dst = DeviceBuffer::new(args.device, len)?;
    let mut copier = CopyBench::new(args.device, tuning)?;
    let sms = copier.multiprocessors();
    println!("| block | threads per block | CTAs per SM | kernel alone GB/s |");
    println!("|---:|---:|---:|---:|");
    for &size in &args.sizes {
        if size == 0 || size > args.bytes {
            bail!("block size {size} must be in 1..=--bytes");
        }
        let n = args.bytes / size;
        let (mult, add) = (0x9E37_79B9_7F4A_7C15 | 1, n / 3);
        let blocks: Vec<Block> = (0..n)
            .map(|i| Block {
                src: src.addr() + i * size,
                dst: dst.addr() + slot(i, n, mult, add) * size,
                len: size,
            })
            .collect();
        let pieces = copier.kernel_pieces(&Copies::new(&src, &dst, &blocks)?);
        let moved = n * size;
        let base = pieces.group_shift();
        for shift in base.saturating_sub(2).max(2)..=(base + 2).min(10) {
            for per_sm in [4u32, 8, 16, 32] {
                let threads = (pieces.len() as u64) << shift;
                let ctas = threads.div_ceil(256).clamp(1, u64::from(sms * per_sm)) as u32;
                let ms = copier.time_kernel_with(&pieces, 5, shift, ctas)?;
                println!(
                    "| {} | {} | {per_sm} | {:.1} |",
                    human(size),
                    1u32 << shift,
                    gbps(moved, ms / 1e3)
                );
            }
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
