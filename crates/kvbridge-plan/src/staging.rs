//! Staging geometry for heterogeneous TP (sglang's staging path,
//! `staging_buffer.py`): instead of one small copy per (layer, token) head
//! slice, a prefill rank gathers a chunk's slices for one decode rank into
//! a contiguous region, writes it with one bulk transfer into the decode's
//! staging ring, and the decode scatters it into its KV pages.
//!
//! The byte layout is the reference's, so either side may be sglang's: a
//! decode rank's region for one chunk holds one part per writer (prefill
//! rank), in writer order; a writer's part holds every K buffer's slices,
//! then every V buffer's, each buffer `tokens × slice` bytes, token-major.
//!
//! **Owns:** the head-slice parameters (`compute_head_slice_params`), the
//! region sizes (`compute_staging_layout`), the chunk grid
//! (`compute_grid_segments`), the watermark test, and the gather and
//! scatter copies as strided runs.
//! **Never:** allocates a ring, touches memory or decides whether staging
//! is on: the roles do.

use std::ops::Range;

use crate::block::Run;
use crate::error::PlanError;
use crate::index_runs::{add, mul};
use crate::layout::{PeerRegistration, PrefillLayout};

/// The heads one prefill rank sends one decode rank (sglang
/// `compute_head_slice_params`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HeadSliceParams {
    /// First head of the slice in the prefill rank's token.
    pub src_head_start: u64,
    /// Heads in the slice.
    pub num_heads: u64,
    /// First head of the slice in the decode rank's token.
    pub dst_head_start: u64,
}

/// sglang's `compute_head_slice_params` for `total_heads ≥ 1` and TP sizes ≥ 1
/// (a zero is read as 1; the reference would divide by zero).
pub fn head_slice_params(
    src_tp: u64,
    dst_tp: u64,
    src_rank: u64,
    dst_rank: u64,
    total_heads: u64,
) -> HeadSliceParams {
    let (src_tp, dst_tp, total) = (src_tp.max(1), dst_tp.max(1), total_heads.max(1));
    let src_heads = (total / src_tp).max(1);
    let dst_heads = (total / dst_tp).max(1);
    let local = src_rank % src_tp;
    let dst_local = dst_rank % dst_tp;
    if src_tp > dst_tp {
        let replication = (src_tp / total).max(1);
        let unique = local / replication;
        HeadSliceParams {
            src_head_start: 0,
            num_heads: src_heads,
            dst_head_start: unique.saturating_mul(src_heads) % dst_heads,
        }
    } else {
        let replication = (dst_tp / total).max(1);
        let unique = dst_local / replication;
        HeadSliceParams {
            src_head_start: unique.saturating_mul(dst_heads) % src_heads,
            num_heads: dst_heads,
            dst_head_start: 0,
        }
    }
}

/// Prefill ranks that write one decode rank's staging region per chunk.
pub fn staging_writers(src_tp: u64, dst_tp: u64) -> u64 {
    if src_tp > dst_tp {
        src_tp / dst_tp.max(1)
    } else {
        1
    }
}

/// Bytes of each writer's part of a decode rank's region for `tokens`
/// tokens (sglang `compute_staging_layout`); `None` on overflow.
pub fn staging_layout(
    src_tp: u64,
    dst_tp: u64,
    dst_rank: u64,
    total_heads: u64,
    tokens: u64,
    bytes_per_head_token: u64,
    layers: u64,
) -> Option<Vec<u64>> {
    (0..staging_writers(src_tp, dst_tp))
        .map(|wr| {
            let nh = head_slice_params(src_tp, dst_tp, wr, dst_rank, total_heads).num_heads;
            tokens
                .checked_mul(nh)?
                .checked_mul(bytes_per_head_token)?
                .checked_mul(layers)?
                .checked_mul(2)
        })
        .collect()
}

/// `[start, end)` split at `base + k × grid` (sglang
/// `compute_grid_segments`); an empty range gives one empty segment.
pub fn grid_segments(start: u64, end: u64, base: u64, grid: u64) -> Vec<(u64, u64)> {
    let grid = grid.max(1);
    let mut out = Vec::new();
    let mut s = start;
    while s < end {
        let k = s.saturating_sub(base) / grid + 1;
        let boundary = base.saturating_add(k.saturating_mul(grid));
        let e = boundary.min(end);
        out.push((s, e));
        s = e;
    }
    if out.is_empty() {
        out.push((start, end));
    }
    out
}

/// Whether an allocation of ring round `round` ending at `end` may be
/// written, given the decode's watermark `(round, tail)` (sglang
/// `is_watermark_ready`): everything of the previous round it overlaps
/// must be freed.
pub fn watermark_ready(watermark: (u64, u64), round: i64, end: i64) -> bool {
    if round <= 0 {
        return true;
    }
    let prev = i128::from(round) - 1;
    let (wm_round, wm_tail) = (i128::from(watermark.0), i128::from(watermark.1));
    prev < wm_round || (prev == wm_round && i128::from(end) <= wm_tail)
}

fn unsupported(reason: &'static str) -> PlanError {
    PlanError::StagingUnsupported { reason }
}

fn page(p: i32) -> Result<u64, PlanError> {
    u64::try_from(p).map_err(|_| PlanError::SignedOverflow {
        what: "negative page index",
    })
}

/// KV buffers as staging slots: every K buffer, then every V buffer; the
/// common item length. Staging covers plain MHA/GQA pools only.
fn kv_slots(layout: &PrefillLayout) -> Result<(Vec<u64>, u64), PlanError> {
    if layout.is_any_mla() {
        return Err(unsupported("MLA pools copy whole pages; nothing to stage"));
    }
    if layout.pp_size != 1 || layout.prefill_start_layer != 0 {
        return Err(unsupported(
            "pipeline-parallel ranks take the per-slice path",
        ));
    }
    if layout.dcp_size != 1 {
        return Err(unsupported(
            "decode context parallel takes the relayout path",
        ));
    }
    if layout.num_draft_entries != 0 {
        return Err(unsupported("draft layers take the per-slice path"));
    }
    let n = layout.kv_data_ptrs.len();
    if n == 0 || !n.is_multiple_of(2) {
        return Err(unsupported(
            "a K/V pool has an even, non-zero number of buffers",
        ));
    }
    let item = *layout
        .kv_item_lens
        .first()
        .ok_or(PlanError::MissingItemLen {
            what: "kv_item_lens",
            entry: 0,
        })?;
    if layout.kv_item_lens.iter().any(|l| *l != item) || layout.kv_item_lens.len() != n {
        return Err(PlanError::MixedKvItemLens);
    }
    Ok((layout.kv_data_ptrs.clone(), item))
}

/// The model's KV heads: `total_kv_head_num`, else `kv_head_num × tp`;
/// zero is refused.
pub(crate) fn total_heads(layout: &PrefillLayout, tp: u64) -> Result<u64, PlanError> {
    let total = if layout.total_kv_head_num > 0 {
        layout.total_kv_head_num
    } else {
        mul(layout.kv_head_num, tp)?
    };
    if total == 0 {
        return Err(PlanError::ZeroSize {
            field: "kv_head_num",
        });
    }
    Ok(total)
}

/// Bytes of one head of one token, from a rank's page item length.
fn head_bytes(item: u64, page_size: u64, heads: u64) -> Result<u64, PlanError> {
    let per_token = item / page_size.max(1);
    if per_token == 0 || !per_token.is_multiple_of(heads) || !item.is_multiple_of(page_size.max(1))
    {
        return Err(unsupported(
            "a page item is not page_size tokens of whole heads",
        ));
    }
    Ok(per_token / heads)
}

/// The prefill side of staging towards one decode rank: what to gather and
/// where its part goes in the decode's region.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StagingSource {
    slots: Vec<u64>,
    page_size: u64,
    src_item: u64,
    src_token: u64,
    /// Byte offset of the slice in a prefill token.
    src_off: u64,
    /// Bytes per token per slot sent.
    slice: u64,
    /// Region bytes per token before our part (earlier writers).
    before_per_token: u64,
    /// Region bytes per token, every writer.
    total_per_token: u64,
}

impl StagingSource {
    /// Prepares staging from our `layout` towards the decode rank of `reg`;
    /// [`PlanError::StagingUnsupported`] where the pair takes another path.
    pub fn new(layout: &PrefillLayout, reg: &PeerRegistration) -> Result<Self, PlanError> {
        let (p, d) = (layout.attn_tp_size, reg.dst_attn_tp_size);
        if p == 0 || d == 0 || layout.page_size == 0 {
            return Err(PlanError::ZeroSize {
                field: "attn_tp_size/page_size",
            });
        }
        if p == d {
            return Err(unsupported("equal TP sizes copy whole pages"));
        }
        let (slots, src_item) = kv_slots(layout)?;
        if reg.dst_kv_ptrs.len() != slots.len() {
            return Err(unsupported(
                "the decode holds a different number of KV buffers",
            ));
        }
        if layout.kv_layer_ids != reg.dst_kv_layer_ids {
            return Err(unsupported("layer ids differ between the peers"));
        }
        if reg.dst_dcp_size > 1 {
            return Err(unsupported(
                "decode context parallel takes the relayout path",
            ));
        }
        let total = total_heads(layout, p)?;
        let src_heads = (total / p).max(1);
        let dst_heads = (total / d).max(1);
        let hb = head_bytes(src_item, layout.page_size, src_heads)?;
        if head_bytes(reg.dst_kv_item_len, layout.page_size, dst_heads)? != hb {
            return Err(unsupported("head sizes differ between the peers"));
        }
        let rank = layout.attn_tp_rank();
        let params = head_slice_params(p, d, rank, reg.dst_tp_rank, total);
        let src_token = src_item / layout.page_size;
        let src_off = mul(params.src_head_start, hb)?;
        let slice = mul(params.num_heads, hb)?;
        if add(src_off, slice)? > src_token {
            return Err(unsupported("the head slice leaves the prefill token"));
        }
        let layers = slots.len() as u64 / 2;
        let per_token = staging_layout(p, d, reg.dst_tp_rank, total, 1, hb, layers)
            .ok_or(PlanError::AddressOverflow)?;
        let writers = per_token.len() as u64;
        let writer = if writers > 1 { rank % writers } else { 0 };
        let before_per_token = per_token
            .iter()
            .take(writer as usize)
            .try_fold(0u64, |a, b| a.checked_add(*b))
            .ok_or(PlanError::AddressOverflow)?;
        let total_per_token = per_token
            .iter()
            .try_fold(0u64, |a, b| a.checked_add(*b))
            .ok_or(PlanError::AddressOverflow)?;
        Ok(Self {
            slots,
            page_size: layout.page_size,
            src_item,
            src_token,
            src_off,
            slice,
            before_per_token,
            total_per_token,
        })
    }

    /// Staging slots (K buffers, then V buffers).
    pub fn slot_count(&self) -> usize {
        self.slots.len()
    }

    /// Bytes of one slot's slices for `pages` pages.
    pub fn slot_bytes(&self, pages: u64) -> Result<u64, PlanError> {
        mul(mul(pages, self.page_size)?, self.slice)
    }

    /// `(our part's offset in the decode's region, the region's size)` for
    /// a chunk of `pages` pages.
    pub fn placement(&self, pages: u64) -> Result<(u64, u64), PlanError> {
        let tokens = mul(pages, self.page_size)?;
        Ok((
            mul(tokens, self.before_per_token)?,
            mul(tokens, self.total_per_token)?,
        ))
    }

    /// Appends the copies that gather `slots` of the chunk whose prefill
    /// pages are `pages` into `staging` (slot `slots.start` at `staging`).
    pub fn gather(
        &self,
        pages: &[i32],
        slots: Range<usize>,
        staging: u64,
        out: &mut Vec<Run>,
    ) -> Result<(), PlanError> {
        let slot_bytes = self.slot_bytes(pages.len() as u64)?;
        let page_bytes = mul(self.page_size, self.slice)?;
        let start = slots.start;
        for s in slots {
            let buf = *self.slots.get(s).ok_or(PlanError::AddressOverflow)?;
            let base = add(staging, mul((s - start) as u64, slot_bytes)?)?;
            for (i, p) in pages.iter().enumerate() {
                let src = add(add(buf, mul(page(*p)?, self.src_item)?)?, self.src_off)?;
                let dst = add(base, mul(i as u64, page_bytes)?)?;
                out.push(strided(
                    src,
                    dst,
                    self.slice,
                    self.page_size,
                    self.src_token,
                    self.slice,
                ));
            }
        }
        Ok(())
    }
}

/// A run of `count` slices, one contiguous copy where both sides are dense.
fn strided(src: u64, dst: u64, len: u64, count: u64, src_stride: u64, dst_stride: u64) -> Run {
    if src_stride == len && dst_stride == len {
        Run {
            src,
            dst,
            len: len.saturating_mul(count),
            count: 1,
            src_stride: 0,
            dst_stride: 0,
        }
    } else {
        Run {
            src,
            dst,
            len,
            count,
            src_stride,
            dst_stride,
        }
    }
}

/// One writer's part of a decode rank's region.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct WriterPart {
    /// Byte offset of the writer's heads in a decode token.
    dst_off: u64,
    /// Bytes per token per slot.
    slice: u64,
}

/// The decode side of staging from a prefill server of one TP size: how
/// big a chunk's region is and how to scatter it into our pages.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StagingTarget {
    slots: Vec<u64>,
    page_size: u64,
    dst_item: u64,
    dst_token: u64,
    writers: Vec<WriterPart>,
}

impl StagingTarget {
    /// Prepares scattering into our (decode) `layout` from prefill ranks
    /// of attention TP size `prefill_tp`.
    pub fn new(layout: &PrefillLayout, prefill_tp: u64) -> Result<Self, PlanError> {
        let d = layout.attn_tp_size;
        if prefill_tp == 0 || d == 0 || layout.page_size == 0 {
            return Err(PlanError::ZeroSize {
                field: "attn_tp_size/page_size",
            });
        }
        if prefill_tp == d {
            return Err(unsupported("equal TP sizes copy whole pages"));
        }
        let (slots, dst_item) = kv_slots(layout)?;
        let total = total_heads(layout, d)?;
        let dst_heads = (total / d).max(1);
        let hb = head_bytes(dst_item, layout.page_size, dst_heads)?;
        let dst_token = dst_item / layout.page_size;
        let rank = layout.attn_tp_rank();
        let writers = (0..staging_writers(prefill_tp, d))
            .map(|wr| {
                let params = head_slice_params(prefill_tp, d, wr, rank, total);
                let part = WriterPart {
                    dst_off: mul(params.dst_head_start, hb)?,
                    slice: mul(params.num_heads, hb)?,
                };
                if add(part.dst_off, part.slice)? > dst_token {
                    return Err(unsupported("a writer's heads leave the decode token"));
                }
                Ok(part)
            })
            .collect::<Result<Vec<WriterPart>, PlanError>>()?;
        // Writers holding the same heads (replicated prefill heads) write
        // identical bytes; others hold disjoint heads. Anything else would
        // scatter two writers' bytes onto each other.
        for (i, a) in writers.iter().enumerate() {
            for b in &writers[..i] {
                let overlap = a.dst_off < b.dst_off + b.slice && b.dst_off < a.dst_off + a.slice;
                if overlap && a != b {
                    return Err(unsupported("writers' heads overlap in the decode token"));
                }
            }
        }
        Ok(Self {
            slots,
            page_size: layout.page_size,
            dst_item,
            dst_token,
            writers,
        })
    }

    /// Prefill ranks that write each chunk.
    pub fn writers(&self) -> u64 {
        self.writers.len() as u64
    }

    /// Bytes of a chunk's region of `pages` pages, every writer.
    pub fn required(&self, pages: u64) -> Result<u64, PlanError> {
        let tokens = mul(pages, self.page_size)?;
        let slots = self.slots.len() as u64;
        self.writers
            .iter()
            .try_fold(0u64, |acc, w| add(acc, mul(mul(tokens, w.slice)?, slots)?))
    }

    /// Appends the copies that scatter a chunk's region at `region` into
    /// our pages `pages` (the chunk's destination pages, in order). A
    /// writer whose heads an earlier writer already holds (replicated
    /// prefill heads: the same bytes) is not scattered again, so no two
    /// copies write the same bytes.
    pub fn scatter(&self, region: u64, pages: &[i32], out: &mut Vec<Run>) -> Result<(), PlanError> {
        let tokens = mul(pages.len() as u64, self.page_size)?;
        let mut base = region;
        for (i, w) in self.writers.iter().enumerate() {
            let slot_bytes = mul(tokens, w.slice)?;
            if self.writers[..i].contains(w) {
                base = add(base, mul(slot_bytes, self.slots.len() as u64)?)?;
                continue;
            }
            let page_bytes = mul(self.page_size, w.slice)?;
            for (s, buf) in self.slots.iter().enumerate() {
                let slot_base = add(base, mul(s as u64, slot_bytes)?)?;
                for (i, p) in pages.iter().enumerate() {
                    let src = add(slot_base, mul(i as u64, page_bytes)?)?;
                    let dst = add(add(*buf, mul(page(*p)?, self.dst_item)?)?, w.dst_off)?;
                    out.push(strided(
                        src,
                        dst,
                        w.slice,
                        self.page_size,
                        w.slice,
                        self.dst_token,
                    ));
                }
            }
            base = add(base, mul(slot_bytes, self.slots.len() as u64)?)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn head_slice_params_match_the_reference() {
        // 2 -> 4, 8 heads: decode rank 3 takes heads 2..4 of prefill rank 1.
        assert_eq!(
            head_slice_params(2, 4, 1, 3, 8),
            HeadSliceParams {
                src_head_start: 2,
                num_heads: 2,
                dst_head_start: 0
            }
        );
        // 4 -> 2, 8 heads: prefill rank 3 fills heads 2..4 of its decode rank.
        assert_eq!(
            head_slice_params(4, 2, 3, 1, 8),
            HeadSliceParams {
                src_head_start: 0,
                num_heads: 2,
                dst_head_start: 2
            }
        );
        // 8 -> 2 with 4 heads (replicated): ranks 4, 5 hold head 2.
        assert_eq!(head_slice_params(8, 2, 5, 1, 4).dst_head_start, 0);
        assert_eq!(head_slice_params(8, 2, 6, 1, 4).dst_head_start, 1);
        // 1 -> 8 with 4 heads: decode ranks 6, 7 share head 3.
        assert_eq!(head_slice_params(1, 8, 0, 7, 4).src_head_start, 3);
    }

    #[test]
    fn grid_segments_split_at_the_grid() {
        assert_eq!(grid_segments(0, 10, 0, 4), vec![(0, 4), (4, 8), (8, 10)]);
        assert_eq!(grid_segments(5, 9, 0, 4), vec![(5, 8), (8, 9)]);
        assert_eq!(grid_segments(3, 3, 0, 4), vec![(3, 3)]);
        assert_eq!(grid_segments(2, 7, 2, 4), vec![(2, 6), (6, 7)]);
    }

    #[test]
    fn watermark_gates_the_next_round_only() {
        assert!(watermark_ready((0, 0), 0, 100));
        assert!(watermark_ready((0, 0), -1, -1));
        assert!(!watermark_ready((0, 0), 1, 100));
        assert!(watermark_ready((0, 100), 1, 100));
        assert!(!watermark_ready((0, 99), 1, 100));
        assert!(watermark_ready((1, 0), 1, 1 << 40));
        assert!(!watermark_ready((1, 0), 3, 10));
    }

    #[test]
    fn layout_sizes_every_writer() {
        // 4 -> 2, 8 heads, 16 tokens, 256 B per head token, 2 layers.
        let parts = staging_layout(4, 2, 1, 8, 16, 256, 2).unwrap();
        assert_eq!(parts, vec![16 * 2 * 256 * 4, 16 * 2 * 256 * 4]);
        assert_eq!(staging_layout(2, 4, 0, 8, 16, 256, 2).unwrap().len(), 1);
        assert_eq!(staging_layout(2, 4, 0, 8, u64::MAX, 256, 2), None);
    }
}
