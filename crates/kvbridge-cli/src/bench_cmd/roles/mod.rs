//! `kvbridge bench roles`: what a room costs through the prefill and decode
//! roles against the same bytes through the raw engine, in one run.
//!
//! One process holds a bootstrap server, one prefill rank and one or two
//! decode ranks (real managers: planner, pipeline, control plane), each on
//! its own engine of the chosen transport ([`pair`]). Per room size, rooms
//! stream through the roles with `--in-flight` of them transferring at
//! once, each on its own pages, a new one starting as soon as one concludes
//! (its destinations sent ahead, as a decode preallocates), alternated with
//! streams of raw-engine batches of the same bytes (whole-buffer blocks, the
//! engine's best case) ([`flow`]). A room is timed from the prefill's `send`
//! of its pages to every decode rank's Success. Before and after the timed
//! streams, one room per page slot, each with its own pattern, is moved and
//! verified byte for byte (untimed).

mod flow;
mod pair;
pub(crate) mod stages;
mod threads;

use std::collections::BTreeMap;
use std::time::Duration;

use anyhow::{Result, bail};
use clap::Args;
use kvbridge_roles::StagingMode;
use kvbridge_roles::synthetic::ModelSpec;

use super::size::{human, parse_size};
use kvbridge_lab::demo::summary::percentile;
use kvbridge_lab::rank::EngineKind;

/// The model layouts a room can have.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Layout {
    /// Llama-3-8B-shaped MHA/GQA, TP 1 → 1.
    Mha,
    /// DeepSeek-V3-shaped MLA, TP 1 → 1.
    Mla,
    /// Llama-3-8B-shaped MHA, TP 1 → 2 (head slices to two decode ranks).
    Hetero,
}

/// Arguments of `kvbridge bench roles`.
#[derive(Debug, Args)]
pub struct RolesArgs {
    /// The transfer engine every rank uses.
    #[arg(long, value_enum, default_value = "tcp")]
    engine: EngineKind,
    /// Put the KV on this GPU (default: host memory). Needs the `cuda` feature.
    #[arg(long)]
    device: Option<i32>,
    /// Room sizes: KV bytes a room delivers to its decode ranks (K, M, G suffixes).
    #[arg(long, value_delimiter = ',', default_value = "1M,16M,64M,256M", value_parser = parse_size)]
    sizes: Vec<u64>,
    /// The model layout and TP pairing.
    #[arg(long, value_enum, default_value = "mha")]
    layout: Layout,
    /// Rooms timed per size, in two streams alternated with raw-engine streams.
    #[arg(long, default_value_t = 16)]
    rooms: u32,
    /// Rooms transferring at once (and raw batches in flight at once).
    #[arg(long, default_value_t = 4)]
    in_flight: u32,
    /// The roles' staging mode (`on`, `off` or `auto`).
    #[arg(long, value_name = "on|off|auto", default_value = "auto")]
    staging: StagingMode,
    /// One JSON object per room size instead of a table.
    #[arg(long)]
    json: bool,
    /// Also report each thread's CPU time per room over the timed room
    /// streams, by thread name (`main` is the thread driving the rooms,
    /// as a scheduler would); Linux only.
    #[arg(long)]
    threads: bool,
    /// Also report where a room's latency goes: the median and p90 time
    /// between consecutive stages of the timed rooms (destinations to the
    /// prefill, queued, taken by a worker, submitted, written, concluded,
    /// status at the decode, seen by its poll, noticed by the driving
    /// thread).
    #[arg(long)]
    pub stages: bool,
}

/// Longest one room or raw batch may take.
pub(super) const DEADLINE: Duration = Duration::from_secs(120);

/// What one room size measured.
#[derive(Debug, serde::Serialize)]
struct SizeReport {
    engine: &'static str,
    layout: &'static str,
    device: Option<i32>,
    room_bytes: u64,
    rooms: u32,
    in_flight: u32,
    roles_gbps: f64,
    engine_gbps: f64,
    ratio: f64,
    /// The roles' rate once the pipeline is full: the rooms that concluded
    /// after each stream's first `in_flight`, over the time from that
    /// conclusion to the stream's last (no fill).
    #[serde(skip_serializing_if = "Option::is_none")]
    roles_steady_gbps: Option<f64>,
    /// The raw engine's rate measured the same way.
    #[serde(skip_serializing_if = "Option::is_none")]
    engine_steady_gbps: Option<f64>,
    /// `roles_steady_gbps / engine_steady_gbps`.
    #[serde(skip_serializing_if = "Option::is_none")]
    steady_ratio: Option<f64>,
    p50_ms: f64,
    p99_ms: f64,
    engine_p50_ms: f64,
    verified_bytes: u64,
    /// With `--threads`: CPU microseconds per room, by thread name.
    #[serde(skip_serializing_if = "Option::is_none")]
    thread_cpu_us_per_room: Option<BTreeMap<String, f64>>,
    /// With `--stages`: the time between consecutive stages of a room.
    #[serde(skip_serializing_if = "Option::is_none")]
    stages: Option<Vec<stages::StageGap>>,
}

/// Runs `kvbridge bench roles`.
pub fn run(args: RolesArgs) -> Result<()> {
    if args.rooms == 0 || args.in_flight == 0 {
        bail!("--rooms and --in-flight must be at least 1");
    }
    if args.device.is_some() || args.engine == EngineKind::Ipc {
        kvbridge_lab::gpu::require_cuda("--device and --engine ipc")?;
    }
    if !args.json {
        println!(
            "{:>10}  {:>10}  {:>10}  {:>6}  {:>6}  {:>9}  {:>9}",
            "room", "roles GB/s", "engine GB/s", "ratio", "steady", "p50 ms", "p99 ms"
        );
    }
    for &size in &args.sizes {
        let report = measure_size(&args, size)?;
        if args.json {
            println!("{}", serde_json::to_string(&report)?);
            continue;
        }
        let steady = report
            .steady_ratio
            .map_or_else(|| "-".to_owned(), |r| format!("{r:.2}"));
        println!(
            "{:>10}  {:>10.2}  {:>10.2}  {:>6.2}  {:>6}  {:>9.2}  {:>9.2}",
            human(report.room_bytes),
            report.roles_gbps,
            report.engine_gbps,
            report.ratio,
            steady,
            report.p50_ms,
            report.p99_ms
        );
        if let Some(threads) = &report.thread_cpu_us_per_room {
            // The wall time per room of the timed streams, to set beside.
            let wall_us = report.room_bytes as f64 / (report.roles_gbps * 1e3);
            let spent: Vec<String> = threads
                .iter()
                .filter(|(_, us)| **us >= 1.0)
                .map(|(name, us)| format!("{name} {us:.0}"))
                .collect();
            println!(
                "{:>10}  CPU µs per room by thread (wall {wall_us:.0} µs per room): {}",
                "",
                spent.join(" · ")
            );
        }
        for g in report.stages.iter().flatten() {
            println!("{:>10}  {g}", "");
        }
    }
    Ok(())
}

/// The model of `layout` and the decode TP size.
pub(super) fn model(layout: Layout) -> (ModelSpec, u64) {
    match layout {
        Layout::Mha => (ModelSpec::llama3_8b(), 1),
        Layout::Mla => (ModelSpec::deepseek_v3(), 1),
        Layout::Hetero => (ModelSpec::llama3_8b(), 2),
    }
}

/// Bytes the streams concluded once full, and the time they took.
#[derive(Debug, Default)]
struct Span {
    bytes: u64,
    secs: f64,
}

impl Span {
    fn add(&mut self, flow: &flow::Flow, in_flight: usize, room_bytes: u64) {
        if let Some((rooms, time)) = flow.steady(in_flight) {
            self.bytes += rooms * room_bytes;
            self.secs += time.as_secs_f64();
        }
    }

    /// GB/s over the spans (none when no stream held more rooms than in flight).
    fn gbps(&self) -> Option<f64> {
        (self.bytes > 0 && self.secs > 0.0).then(|| self.bytes as f64 / self.secs / 1e9)
    }
}

fn measure_size(args: &RolesArgs, size: u64) -> Result<SizeReport> {
    let mut pair = pair::Pair::start(args, size)?;
    let bytes = pair.room_bytes();
    let in_flight = args.in_flight as usize;
    // Untimed: every slot's room verified (connections, handshakes, first
    // touches), and one raw stream.
    let mut verified = pair.check(1)?;
    stages::clear();
    pair.raw_stream(pair.slots(), in_flight)?;
    let (mut roles, mut raw) = (Vec::new(), Vec::new());
    let (mut roles_wall, mut raw_wall, mut moved) = (0.0, 0.0, 0u64);
    let (mut roles_span, mut raw_span) = (Span::default(), Span::default());
    // Two rounds, alternated: a stream of rooms, then one of raw batches.
    let total = u64::from(args.rooms);
    let mut first = 1_000;
    let mut cpu = BTreeMap::new();
    for count in [total.div_ceil(2), total / 2] {
        if count == 0 {
            continue;
        }
        // Read only when asked: /proc is listed and read for every thread.
        let before = args.threads.then(threads::CpuTimes::now);
        let f = pair.stream(first, count, in_flight)?;
        if let Some(before) = &before {
            threads::accumulate(&mut cpu, threads::CpuTimes::now().since(before));
        }
        roles_wall += f.wall.as_secs_f64();
        roles_span.add(&f, in_flight, bytes);
        roles.extend(f.rooms.iter().map(Duration::as_secs_f64));
        let r = pair.raw_stream(count, in_flight)?;
        raw_wall += r.wall.as_secs_f64();
        raw_span.add(&r, in_flight, bytes);
        raw.extend(r.rooms.iter().map(Duration::as_secs_f64));
        moved += count * bytes;
        first += count;
    }
    let timed = 1_000..first;
    verified += pair.check(first)?;
    let roles_gbps = moved as f64 / roles_wall / 1e9;
    let engine_gbps = moved as f64 / raw_wall / 1e9;
    let (roles_steady, engine_steady) = (roles_span.gbps(), raw_span.gbps());
    Ok(SizeReport {
        engine: match args.engine {
            EngineKind::Tcp => "tcp",
            EngineKind::Ipc => "ipc",
            EngineKind::Ucx => "ucx",
        },
        layout: match args.layout {
            Layout::Mha => "mha",
            Layout::Mla => "mla",
            Layout::Hetero => "hetero",
        },
        device: args.device,
        room_bytes: bytes,
        rooms: args.rooms,
        in_flight: args.in_flight,
        roles_gbps,
        engine_gbps,
        ratio: roles_gbps / engine_gbps,
        roles_steady_gbps: roles_steady,
        engine_steady_gbps: engine_steady,
        steady_ratio: roles_steady.zip(engine_steady).map(|(r, e)| r / e),
        p50_ms: percentile(&roles, 0.5) * 1e3,
        p99_ms: percentile(&roles, 0.99) * 1e3,
        engine_p50_ms: percentile(&raw, 0.5) * 1e3,
        verified_bytes: verified,
        thread_cpu_us_per_room: args.threads.then(|| {
            cpu.into_iter()
                .map(|(name, ns)| (name, ns as f64 / 1e3 / total as f64))
                .collect()
        }),
        stages: args.stages.then(|| stages::gaps(timed)),
    })
}
