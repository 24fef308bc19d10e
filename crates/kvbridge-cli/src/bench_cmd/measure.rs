//! How `bench tcp` and `bench ucx` time one block size: runs of batches
//! with a window in flight, every run's GB/s and every batch's latency,
//! and the rows they print (a table for people, JSON lines for programs).

use std::collections::VecDeque;
use std::io::Write;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use indicatif::{ProgressBar, ProgressStyle};
use kvbridge_engine::{Batch, BatchHandle, Block, Run, TransferEngine};

use super::child::Target;
use super::size::human;

/// Percentiles of the batches' latencies (submit to completion seen), µs.
#[derive(Debug, Clone, Copy, Default, serde::Serialize)]
pub(super) struct Latency {
    pub p50: f64,
    pub p90: f64,
    pub p99: f64,
    pub max: f64,
}

impl Latency {
    /// The percentiles of `samples` (nearest rank); zeros when empty.
    pub fn of(samples: &mut [Duration]) -> Self {
        if samples.is_empty() {
            return Self::default();
        }
        samples.sort_unstable();
        let at = |q: f64| {
            let rank = ((q * samples.len() as f64).ceil() as usize).clamp(1, samples.len());
            samples[rank - 1].as_secs_f64() * 1e6
        };
        Self {
            p50: at(0.50),
            p90: at(0.90),
            p99: at(0.99),
            max: at(1.0),
        }
    }
}

/// One block size's figures.
#[derive(Debug, Clone, serde::Serialize)]
pub(super) struct Row {
    /// The engine measured (`tcp`, `ucx`).
    pub engine: String,
    pub block_size: u64,
    pub bytes: u64,
    /// The best run's wall time.
    pub seconds: f64,
    /// The best run's GB/s (10^9 bytes per second).
    pub gbps: f64,
    pub blocks_per_s: f64,
    pub runs_gbps: Vec<f64>,
    /// The median run's GB/s, and the slowest and fastest run's.
    pub gbps_median: f64,
    pub gbps_min: f64,
    pub gbps_max: f64,
    /// Batches submitted over all runs.
    pub batches: u64,
    pub batch_latency_us: Latency,
    pub verified: bool,
}

/// The median of `v` (the mean of the middle two for an even count).
pub(super) fn median(v: &[f64]) -> f64 {
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    match s.len() {
        0 => 0.0,
        n if n % 2 == 1 => s[n / 2],
        n => (s[n / 2 - 1] + s[n / 2]) / 2.0,
    }
}

/// A progress bar on stderr over `steps` runs (drawn only on a terminal).
pub(super) fn progress(steps: u64) -> ProgressBar {
    let bar = ProgressBar::new(steps);
    bar.set_style(
        ProgressStyle::with_template("{spinner} {bar:30} {pos}/{len} runs {msg}")
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    bar
}

/// How one block size is timed.
#[derive(Debug, Clone, Copy)]
pub(super) struct Timing {
    /// The engine's name in the rows.
    engine: &'static str,
    /// Timed runs.
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
    pub fn new(
        engine: &'static str,
        runs: u32,
        batch_blocks: usize,
        inflight: usize,
        verify: bool,
    ) -> Result<Self> {
        if runs == 0 || batch_blocks == 0 || inflight == 0 {
            bail!("--runs, --batch-blocks and --inflight must be positive");
        }
        Ok(Self {
            engine,
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

    /// Timed runs per block size.
    pub fn runs(&self) -> u32 {
        self.runs
    }

    /// Moves `blocks` (each `size` bytes, together the target's first
    /// `blocks.len() * size` bytes) `runs` times, has the target verify the
    /// first run, and advances `bar` once per run.
    pub fn measure(
        &self,
        engine: &impl TransferEngine,
        target: &mut Target,
        blocks: &[Block],
        size: u64,
        bar: &ProgressBar,
    ) -> Result<Row> {
        let n = blocks.len() as u64;
        let bytes = n * size;
        let mut times = Vec::new();
        let mut latencies = Vec::new();
        for run in 0..self.runs {
            let t = Instant::now();
            let mut pending: VecDeque<(Instant, BatchHandle)> = VecDeque::new();
            for chunk in blocks.chunks(self.batch_blocks) {
                if pending.len() >= self.inflight {
                    let (at, h) = pending.pop_front().context("window")?;
                    h.wait().context("transfer failed")?;
                    latencies.push(at.elapsed());
                }
                let to = kvbridge_engine::Target::any(&target.session);
                let at = Instant::now();
                pending.push_back((
                    at,
                    match self.runs_of {
                        None => engine.submit(to, Batch::Blocks(chunk)),
                        Some(k) => engine.submit(to, Batch::Runs(&as_runs(chunk, k))),
                    },
                ));
            }
            for (at, h) in pending {
                h.wait().context("transfer failed")?;
                latencies.push(at.elapsed());
            }
            let secs = t.elapsed().as_secs_f64();
            times.push(secs);
            bar.set_message(format!(
                "{} blocks: {:.2} GB/s",
                human(size),
                bytes as f64 / secs / 1e9
            ));
            bar.inc(1);
            if run == 0 && self.verify {
                target
                    .ask(&format!("VERIFY {size} {bytes}"))
                    .context("target found wrong bytes")?;
            }
        }
        let best = times.iter().copied().fold(f64::INFINITY, f64::min);
        let runs_gbps: Vec<f64> = times.iter().map(|s| bytes as f64 / s / 1e9).collect();
        Ok(Row {
            engine: self.engine.to_owned(),
            block_size: size,
            bytes,
            seconds: best,
            gbps: bytes as f64 / best / 1e9,
            blocks_per_s: n as f64 / best,
            gbps_median: median(&runs_gbps),
            gbps_min: runs_gbps.iter().copied().fold(f64::INFINITY, f64::min),
            gbps_max: runs_gbps.iter().copied().fold(0.0, f64::max),
            runs_gbps,
            batches: latencies.len() as u64,
            batch_latency_us: Latency::of(&mut latencies),
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

/// The human table of `rows`.
pub(super) fn table(rows: &[Row]) -> String {
    let mut t = format!(
        "{:>8} {:>10} {:>13} {:>15} {:>8} {:>12} {:>21}\n",
        "engine", "block", "bytes/run", "GB/s median", "best", "blocks/s", "batch µs p50/p99"
    );
    for r in rows {
        let spread = format!("{:.2} ({:.2}-{:.2})", r.gbps_median, r.gbps_min, r.gbps_max);
        t.push_str(&format!(
            "{:>8} {:>10} {:>13} {:>15} {:>8.2} {:>12.0} {:>21}\n",
            r.engine,
            human(r.block_size),
            human(r.bytes),
            spread,
            r.gbps,
            r.blocks_per_s,
            format!(
                "{:.0}/{:.0}",
                r.batch_latency_us.p50, r.batch_latency_us.p99
            ),
        ));
    }
    if let Some(r) = rows.first() {
        t.push_str(&format!(
            "GB/s = 10^9 bytes/s: median (slowest-fastest) of {} run(s); batch latency: \
             submit to completion seen, every batch of every run\n",
            r.runs_gbps.len(),
        ));
    }
    t
}

/// The table on stdout; with `json`, one object per row on stdout instead
/// (and the table on stderr, so stdout stays JSON lines).
pub(super) fn print_rows(json: bool, rows: &[Row]) -> Result<()> {
    let table = table(rows);
    if json {
        eprint!("{table}");
        let mut out = std::io::stdout().lock();
        for r in rows {
            writeln!(out, "{}", serde_json::to_string(r)?)?;
        }
    } else {
        print!("{table}");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_and_median_use_every_sample() {
        let mut v: Vec<Duration> = (1..=100).map(Duration::from_micros).collect();
        let l = Latency::of(&mut v);
        assert_eq!((l.p50, l.p90, l.p99, l.max), (50.0, 90.0, 99.0, 100.0));
        let one = Latency::of(&mut [Duration::from_micros(7)]);
        assert_eq!((one.p50, one.p99), (7.0, 7.0));
        assert_eq!(Latency::of(&mut []).max, 0.0);
        assert_eq!(median(&[3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(&[4.0, 1.0, 2.0, 3.0]), 2.5);
    }
}
