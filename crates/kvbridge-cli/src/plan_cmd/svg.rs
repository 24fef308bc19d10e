//! `plan --svg FILE`: the [`Picture`] of a plan drawn with `plotters`'
//! SVG backend. Per buffer pair (a column), prefill items on the left and
//! decode items on the right, split into heads where a plan slices heads,
//! joined by a line per link. A small plan is drawn whole; a large one
//! shows its first columns and rows and says how much more there is.

use std::path::Path;

use anyhow::{Result, anyhow};
use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};

use super::picture::{Link, Picture, Place, Space};
use kvbridge_plan::scenario::ScenarioInputs;

/// Buffer pairs drawn as columns at most.
const MAX_COLUMNS: usize = 4;
/// Items drawn per side of a column at most.
const MAX_ROWS: usize = 16;
const BOX_W: i32 = 96;
const BOX_H: i32 = 20;
const ROW_H: i32 = 28;
const COLUMN_W: i32 = 340;
const TOP: i32 = 96;

/// Colours of the links, cycling over the destination heads.
const COLOURS: [RGBColor; 6] = [
    RGBColor(31, 119, 180),
    RGBColor(255, 127, 14),
    RGBColor(44, 160, 44),
    RGBColor(214, 39, 40),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
];

/// Draws `picture` of a plan for `inputs` into the SVG file `path`.
pub fn draw(path: &Path, inputs: &ScenarioInputs, picture: &Picture) -> Result<()> {
    let err = |e: &dyn std::fmt::Display| anyhow!("drawing {}: {e}", path.display());
    let pairs = picture.pairs();
    let rows_needed = pairs
        .iter()
        .take(MAX_COLUMNS)
        .map(|(_, links)| {
            side_items(links, true)
                .len()
                .max(side_items(links, false).len())
        })
        .max()
        .unwrap_or(0)
        .min(MAX_ROWS) as i32;
    let columns = pairs.len().clamp(1, MAX_COLUMNS) as i32;
    let width = (40 + columns * COLUMN_W).max(700) as u32;
    let height = (TOP + rows_needed * ROW_H + 90) as u32;
    let root = SVGBackend::new(path, (width, height)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| err(&e))?;
    let text = |s: String, x: i32, y: i32, size: i32, colour: RGBColor| {
        Text::new(s, (x, y), ("sans-serif", size).into_font().color(&colour))
    };

    let l = &inputs.layout;
    let r = &inputs.registration;
    let (bytes, blocks) = picture
        .links
        .values()
        .fold((0, 0), |(b, n), f| (b + f.bytes, n + f.blocks));
    root.draw(&text(
        format!(
            "prefill rank {} of TP {} -> decode rank {} of TP {}: {} blocks, {} bytes",
            l.engine_rank, l.attn_tp_size, r.dst_tp_rank, r.dst_attn_tp_size, blocks, bytes
        ),
        20,
        14,
        18,
        BLACK,
    ))
    .map_err(|e| err(&e))?;
    root.draw(&text(
        format!(
            "{} buffer pairs; a prefill page holds {} KV head(s) of {} bytes a token, a \
             decode page {}; a line: tokens of a page (and heads) landing in a decode page",
            pairs.len(),
            picture.src_heads,
            picture.head_bytes,
            picture.dst_heads
        ),
        20,
        40,
        13,
        RGBColor(80, 80, 80),
    ))
    .map_err(|e| err(&e))?;

    for (c, ((src_space, dst_space), links)) in pairs.iter().take(MAX_COLUMNS).enumerate() {
        let x0 = 20 + c as i32 * COLUMN_W;
        let (left_x, right_x) = (x0, x0 + COLUMN_W - BOX_W - 40);
        root.draw(&text(format!("prefill {src_space}"), left_x, 64, 13, BLACK))
            .map_err(|e| err(&e))?;
        root.draw(&text(format!("decode {dst_space}"), right_x, 64, 13, BLACK))
            .map_err(|e| err(&e))?;
        let mut mappings: Vec<String> = links
            .iter()
            .filter(|(a, b, _)| a.heads.is_some() || b.heads.is_some())
            .map(|(a, b, _)| {
                let show =
                    |h: Option<(u64, u64)>| h.map_or("all".into(), |(x, y)| format!("{x}-{y}"));
                format!("heads {} -> {}", show(a.heads), show(b.heads))
            })
            .collect();
        mappings.sort();
        mappings.dedup();
        if !mappings.is_empty() {
            root.draw(&text(
                mappings.join(", "),
                left_x,
                80,
                11,
                RGBColor(80, 80, 80),
            ))
            .map_err(|e| err(&e))?;
        }
        let lefts = side_items(links, true);
        let rights = side_items(links, false);
        let src_heads = heads_of(*src_space, picture.src_heads);
        let dst_heads = heads_of(*dst_space, picture.dst_heads);
        for (k, item) in lefts.iter().take(MAX_ROWS).enumerate() {
            draw_item(&root, left_x, row_y(k), *item, src_heads).map_err(|e| err(&e))?;
        }
        for (k, item) in rights.iter().take(MAX_ROWS).enumerate() {
            draw_item(&root, right_x, row_y(k), *item, dst_heads).map_err(|e| err(&e))?;
        }
        for (from, to, flow) in links {
            let (Some(a), Some(b)) = (
                lefts
                    .iter()
                    .position(|i| *i == from.item)
                    .filter(|k| *k < MAX_ROWS),
                rights
                    .iter()
                    .position(|i| *i == to.item)
                    .filter(|k| *k < MAX_ROWS),
            ) else {
                continue;
            };
            let colour = COLOURS[to.heads.map_or(0, |h| h.0 as usize) % COLOURS.len()];
            for (place, x, k, heads) in [(from, left_x, a, src_heads), (to, right_x, b, dst_heads)]
            {
                if let Some((lo, hi)) = place.heads.filter(|_| heads > 1) {
                    let h = BOX_H as f64 / heads as f64;
                    let top = row_y(k) + (h * lo.min(heads - 1) as f64) as i32;
                    let bottom = row_y(k) + (h * (hi.min(heads - 1) + 1) as f64) as i32;
                    root.draw(&Rectangle::new(
                        [(x + 40, top), (x + BOX_W, bottom)],
                        colour.mix(0.45).filled(),
                    ))
                    .map_err(|e| err(&e))?;
                }
            }
            let start = (left_x + BOX_W, row_y(a) + head_mid(from, src_heads));
            let end = (right_x, row_y(b) + head_mid(to, dst_heads));
            let width = 1 + (flow.blocks.min(64) as f64).log2() as u32;
            root.draw(&PathElement::new(
                vec![start, end],
                colour.stroke_width(width),
            ))
            .map_err(|e| err(&e))?;
        }
        let hidden = lefts.len().max(rights.len()).saturating_sub(MAX_ROWS);
        if hidden > 0 {
            root.draw(&text(
                format!("... {hidden} more items not drawn"),
                left_x,
                row_y(MAX_ROWS) + 4,
                12,
                RGBColor(120, 120, 120),
            ))
            .map_err(|e| err(&e))?;
        }
    }
    if pairs.len() > MAX_COLUMNS {
        let first = pairs.first().map(|(_, l)| shape(l)).unwrap_or_default();
        let hidden = &pairs[MAX_COLUMNS..];
        let kv = |(a, _): &(Space, Space)| matches!(a, Space::Kv(_));
        let hidden_kv: Vec<_> = hidden.iter().filter(|(p, _)| kv(p)).collect();
        let same = hidden_kv.iter().filter(|(_, l)| shape(l) == first).count();
        root.draw(&text(
            format!(
                "... not drawn: {} more KV buffer pairs ({same} with the first one's page and head \
                 mapping), {} state/aux buffer pairs",
                hidden_kv.len(),
                hidden.len() - hidden_kv.len(),
            ),
            20,
            height as i32 - 44,
            13,
            RGBColor(120, 120, 120),
        ))
        .map_err(|e| err(&e))?;
    }
    if picture.unplaced > 0 {
        root.draw(&text(
            format!(
                "{} blocks outside every registered buffer",
                picture.unplaced
            ),
            20,
            height as i32 - 24,
            13,
            RGBColor(214, 39, 40),
        ))
        .map_err(|e| err(&e))?;
    }
    root.present().map_err(|e| err(&e))?;
    Ok(())
}

fn row_y(k: usize) -> i32 {
    TOP + k as i32 * ROW_H
}

/// Heads drawn inside an item of `space` (only KV items have heads).
fn heads_of(space: Space, heads: u64) -> u64 {
    match space {
        Space::Kv(_) => heads.clamp(1, 16),
        _ => 1,
    }
}

/// The vertical middle of `place`'s heads inside its box.
fn head_mid(place: &Place, heads: u64) -> i32 {
    let h = BOX_H as f64 / heads.max(1) as f64;
    match place.heads {
        Some((a, b)) if heads > 1 => {
            (h * (a.min(heads - 1) as f64 + (b.min(heads - 1) - a.min(heads - 1) + 1) as f64 / 2.0))
                as i32
        }
        _ => BOX_H / 2,
    }
}

/// The distinct items of one side of `links`, in order.
fn side_items(links: &[Link], source: bool) -> Vec<u64> {
    let mut items: Vec<u64> = links
        .iter()
        .map(|(a, b, _)| if source { a.item } else { b.item })
        .collect();
    items.sort_unstable();
    items.dedup();
    items
}

/// A column's mapping without its buffers: compares columns.
fn shape(links: &[Link]) -> Vec<(Place, Place)> {
    let unbuffered = |p: &Place| Place {
        space: Space::Aux(0),
        ..*p
    };
    links
        .iter()
        .map(|(a, b, _)| (unbuffered(a), unbuffered(b)))
        .collect()
}

/// One item's box, its head stripes and its index.
fn draw_item<DB: DrawingBackend>(
    root: &DrawingArea<DB, plotters::coord::Shift>,
    x: i32,
    y: i32,
    item: u64,
    heads: u64,
) -> Result<(), DrawingAreaErrorKind<DB::ErrorType>> {
    root.draw(&Rectangle::new(
        [(x, y), (x + BOX_W, y + BOX_H)],
        RGBColor(235, 240, 248).filled(),
    ))?;
    let h = BOX_H as f64 / heads as f64;
    for k in 1..heads {
        let yy = y + (h * k as f64) as i32;
        root.draw(&PathElement::new(
            vec![(x + 40, yy), (x + BOX_W, yy)],
            RGBColor(190, 200, 215),
        ))?;
    }
    root.draw(&Rectangle::new(
        [(x, y), (x + BOX_W, y + BOX_H)],
        RGBColor(90, 110, 140),
    ))?;
    let style = ("sans-serif", 12)
        .into_font()
        .color(&BLACK)
        .pos(Pos::new(HPos::Left, VPos::Center));
    root.draw(&Text::new(format!("{item}"), (x + 6, y + BOX_H / 2), style))?;
    Ok(())
}
