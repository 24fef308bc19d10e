//! `--plot FILE`: the bench rows as an SVG picture, GB/s (median, with the
//! slowest and fastest run as a bar) and batch latency (p50 and p99)
//! against block size, one series per engine. Drawn with `plotters`.

use std::path::Path;

use anyhow::{Result, anyhow};
use plotters::prelude::*;

use super::measure::Row;
use super::size::human;

/// Colours of the series, in order.
const COLOURS: [RGBColor; 4] = [
    RGBColor(31, 119, 180),
    RGBColor(214, 39, 40),
    RGBColor(44, 160, 44),
    RGBColor(148, 103, 189),
];

/// Draws `rows` into `path` when one is given (`--plot`), and says so.
pub fn write(path: Option<&Path>, rows: &[Row]) -> Result<()> {
    if let Some(path) = path {
        draw(path, rows)?;
        eprintln!("plot written to {}", path.display());
    }
    Ok(())
}

/// Draws `rows` into the SVG file `path`.
pub fn draw(path: &Path, rows: &[Row]) -> Result<()> {
    if rows.is_empty() {
        return Err(anyhow!("nothing to plot"));
    }
    let err = |e: &dyn std::fmt::Display| anyhow!("drawing {}: {e}", path.display());
    let root = SVGBackend::new(path, (1100, 440)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| err(&e))?;
    let (left, right) = root.split_horizontally(550);
    let sizes = rows.iter().map(|r| r.block_size as f64);
    let x_min = sizes.clone().fold(f64::INFINITY, f64::min);
    let x_max = sizes.fold(0.0, f64::max);
    // A log axis needs a range: widen a single size by a factor of 2 each way.
    let x_range = (x_min / 2.0)..(x_max * 2.0);
    let mut ticks: Vec<f64> = rows.iter().map(|r| r.block_size as f64).collect();
    ticks.sort_by(f64::total_cmp);
    ticks.dedup();
    let engines = engines(rows);

    let top = rows.iter().map(|r| r.gbps_max).fold(0.0, f64::max) * 1.15;
    let mut gbps = ChartBuilder::on(&left)
        .caption("throughput by block size", ("sans-serif", 20))
        .margin(12)
        .x_label_area_size(45)
        .y_label_area_size(55)
        .build_cartesian_2d(
            x_range.clone().log_scale().with_key_points(ticks.clone()),
            0.0..top.max(0.001),
        )
        .map_err(|e| err(&e))?;
    gbps.configure_mesh()
        .x_desc("block size")
        .y_desc("GB/s (10^9 bytes/s), median of runs")
        .x_label_formatter(&|v| human(*v as u64))
        .draw()
        .map_err(|e| err(&e))?;
    for (k, engine) in engines.iter().enumerate() {
        let colour = COLOURS[k % COLOURS.len()];
        let mine: Vec<&Row> = rows.iter().filter(|r| &r.engine == engine).collect();
        gbps.draw_series(LineSeries::new(
            mine.iter().map(|r| (r.block_size as f64, r.gbps_median)),
            colour.stroke_width(2),
        ))
        .map_err(|e| err(&e))?
        .label(engine.as_str())
        .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 18, y)], colour));
        gbps.draw_series(mine.iter().map(|r| {
            ErrorBar::new_vertical(
                r.block_size as f64,
                r.gbps_min,
                r.gbps_median,
                r.gbps_max,
                colour.filled(),
                8,
            )
        }))
        .map_err(|e| err(&e))?;
    }
    gbps.configure_series_labels()
        .position(SeriesLabelPosition::UpperLeft)
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .draw()
        .map_err(|e| err(&e))?;

    let lat = |r: &Row| r.batch_latency_us.p99.max(r.batch_latency_us.p50);
    let y_max = rows.iter().map(lat).fold(0.0, f64::max).max(1.0) * 2.0;
    let y_min = rows
        .iter()
        .map(|r| r.batch_latency_us.p50)
        .fold(f64::INFINITY, f64::min)
        .clamp(0.1, y_max / 4.0)
        / 2.0;
    let mut latency = ChartBuilder::on(&right)
        .caption("batch latency by block size", ("sans-serif", 20))
        .margin(12)
        .x_label_area_size(45)
        .y_label_area_size(65)
        .build_cartesian_2d(
            x_range.log_scale().with_key_points(ticks),
            (y_min..y_max).log_scale(),
        )
        .map_err(|e| err(&e))?;
    latency
        .configure_mesh()
        .x_desc("block size")
        .y_desc("µs from submit to completion")
        .x_label_formatter(&|v| human(*v as u64))
        .y_label_formatter(&|v| format!("{v:.0}"))
        .draw()
        .map_err(|e| err(&e))?;
    for (k, engine) in engines.iter().enumerate() {
        let colour = COLOURS[k % COLOURS.len()];
        let mine: Vec<&Row> = rows.iter().filter(|r| &r.engine == engine).collect();
        for (name, pick, dashed) in [
            (
                "p50",
                (|r: &Row| r.batch_latency_us.p50) as fn(&Row) -> f64,
                false,
            ),
            ("p99", |r: &Row| r.batch_latency_us.p99, true),
        ] {
            let points: Vec<(f64, f64)> = mine
                .iter()
                .map(|r| (r.block_size as f64, pick(r).max(y_min)))
                .collect();
            let style = if dashed {
                colour.mix(0.5).stroke_width(2)
            } else {
                colour.stroke_width(2)
            };
            latency
                .draw_series(LineSeries::new(points.clone(), style))
                .map_err(|e| err(&e))?
                .label(format!("{engine} {name}"))
                .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 18, y)], style));
            latency
                .draw_series(points.iter().map(|p| Circle::new(*p, 3, style.filled())))
                .map_err(|e| err(&e))?;
        }
    }
    latency
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperLeft)
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .draw()
        .map_err(|e| err(&e))?;
    root.present().map_err(|e| err(&e))?;
    Ok(())
}

/// The engines of `rows`, in first-seen order.
fn engines(rows: &[Row]) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    for r in rows {
        if !out.contains(&r.engine) {
            out.push(r.engine.clone());
        }
    }
    out
}
