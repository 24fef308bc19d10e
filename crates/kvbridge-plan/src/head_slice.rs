//! Head slicing (`send_kvcache_slice`, docs/plan-scenario.md §3.5): MHA with
//! different attention TP sizes. Each token slot of a page holds `heads ×
//! head_bytes`; a prefill rank copies, for every token, the heads the decode
//! rank needs (scatter, `P < D`) or all of its heads into their place among the
//! decode rank's heads (aggregation, `P > D`). GQA replication maps several
//! ranks onto one KV head by integer division.

use crate::block::{Block, Run};
use crate::error::PlanError;
use crate::fill::append_parts;
use crate::index_runs::{add, mul, page, signed};
use crate::layout::{PeerRegistration, PrefillLayout};
use crate::pairing::{halves_pairs, pair_by_layer_ids};

/// Strided runs of a plan and the ends of its engine batches.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct RunOut {
    /// The runs.
    pub runs: Vec<Run>,
    /// End index of each batch in `runs`.
    pub ends: Vec<usize>,
}

impl RunOut {
    pub(crate) fn clear(&mut self) {
        self.runs.clear();
        self.ends.clear();
    }
}

/// Prepared head-slicing parameters, fixed per peer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct HeadSlice {
    /// `(prefill buffer, decode buffer)` pairs.
    pub pairs: Vec<(u64, u64)>,
    /// Prefill bytes per page (`kv_item_lens[0]`).
    pub src_item: u64,
    /// Decode bytes per page (`dst_kv_item_len`).
    pub dst_item: u64,
    /// Prefill bytes per token.
    pub src_token: u64,
    /// Decode bytes per token.
    pub dst_token: u64,
    /// Byte offset of the slice in a prefill token.
    pub src_off: u64,
    /// Byte offset of the slice in a decode token.
    pub dst_off: u64,
    /// Bytes per token to send.
    pub len: u64,
    /// Tokens per page.
    pub page_size: u64,
}

/// Computes the slice geometry and the buffer pairs.
pub(crate) fn prepare_head_slice(
    layout: &PrefillLayout,
    reg: &PeerRegistration,
) -> Result<HeadSlice, PlanError> {
    let p = layout.attn_tp_size;
    let d_size = reg.dst_attn_tp_size;
    let ps = layout.page_size;
    let src_item = *layout
        .kv_item_lens
        .first()
        .ok_or(PlanError::MissingItemLen {
            what: "kv_item_lens",
            entry: 0,
        })?;
    let dst_item = reg.dst_kv_item_len;
    let r = layout.attn_tp_rank();
    let d = reg.dst_tp_rank % d_size;

    // `total >= 1` unless kv_head_num is 0; a zero divisor is treated as 1
    // heads, where Python would raise, so it is rejected explicitly.
    let total = crate::staging::total_heads(layout, p)?;
    let src_heads = (total / p).max(1);
    let dst_heads = (total / d_size).max(1);
    let head_bytes = dst_item / ps / dst_heads;

    let (src_head_off, num_heads, dst_head_off) = if p > d_size {
        let replication = (p / total).max(1);
        let unique = r / replication;
        (0, src_heads, mul(unique, src_heads)? % dst_heads)
    } else {
        let replication = (d_size / total).max(1);
        let unique = d / replication;
        (mul(unique, dst_heads)? % src_heads, dst_heads, 0)
    };

    let mut idx_pairs = Vec::new();
    let src_ptrs = &layout.kv_data_ptrs;
    let dst_ptrs = &reg.dst_kv_ptrs;
    if !layout.kv_layer_ids.is_empty() || !reg.dst_kv_layer_ids.is_empty() {
        if layout.kv_item_lens.iter().any(|&l| l != src_item) {
            return Err(PlanError::MixedKvItemLens);
        }
        pair_by_layer_ids(
            &layout.kv_layer_ids,
            &reg.dst_kv_layer_ids,
            src_ptrs.len(),
            dst_ptrs.len(),
            layout.pp_size == 1,
            &mut idx_pairs,
        )?;
    } else {
        halves_pairs(
            src_ptrs.len(),
            dst_ptrs.len(),
            layout.prefill_start_layer,
            &mut idx_pairs,
        )?;
    }
    let pairs = idx_pairs
        .iter()
        .map(|&(i, j)| (src_ptrs[i], dst_ptrs[j]))
        .collect();

    let len = mul(num_heads, head_bytes)?;
    let dst_token = dst_item / ps;
    if len > dst_token {
        return Err(PlanError::SliceTooWide {
            slice: len,
            slot: dst_token,
        });
    }
    // The reference converts these to numpy int64 for every chunk.
    signed(src_item, "prefill KV item size")?;
    signed(dst_item, "decode KV item size")?;
    Ok(HeadSlice {
        pairs,
        src_item,
        dst_item,
        src_token: src_item / ps,
        dst_token,
        src_off: mul(src_head_off, head_bytes)?,
        dst_off: mul(dst_head_off, head_bytes)?,
        len,
        page_size: ps,
    })
}

impl HeadSlice {
    /// Appends the blocks for the page pairs `zip(src_pages, dst_pages)`, one
    /// batch per buffer pair (the reference submits one engine call per layer).
    pub(crate) fn emit(
        &self,
        src_pages: &[i32],
        dst_pages: &[i32],
        out: &mut Vec<Block>,
        batch_ends: &mut Vec<usize>,
        mut strided: Option<&mut RunOut>,
        threads: usize,
    ) -> Result<(), PlanError> {
        let n = src_pages.len().min(dst_pages.len());
        let (src_pages, dst_pages) = (&src_pages[..n], &dst_pages[..n]);
        if n == 0 || self.len == 0 {
            return Ok(());
        }
        let mut max_a = 0;
        let mut max_b = 0;
        for (&a, &b) in src_pages.iter().zip(dst_pages) {
            max_a = max_a.max(page(a, "prefill_kv_indices")?);
            max_b = max_b.max(page(b, "dst_kv_indices")?);
        }
        let ps = self.page_size;
        // Largest in-page offsets; everything below them fits too.
        let last_t = ps - 1;
        let src_in_page = add(mul(last_t, self.src_token)?, self.src_off)?;
        let dst_in_page = add(mul(last_t, self.dst_token)?, self.dst_off)?;
        let max_src_page = mul(max_a, self.src_item)?;
        let max_dst_page = mul(max_b, self.dst_item)?;
        // Consecutive tokens continue each other in both spaces exactly when
        // the slice is the whole token on both sides: then a page is one block.
        let whole_tokens = self.len == self.src_token && self.len == self.dst_token;
        let page_len = if whole_tokens {
            mul(self.len, ps)?
        } else {
            self.len
        };
        let per_pair = if whole_tokens {
            n
        } else {
            n.saturating_mul(usize::try_from(ps).unwrap_or(usize::MAX))
        };
        if !whole_tokens && let Some(ro) = strided.as_deref_mut() {
            ro.runs.reserve(n.saturating_mul(self.pairs.len()));
        } else {
            out.reserve(per_pair.saturating_mul(self.pairs.len()));
        }
        // Per-token slices are written after every pair's addresses were
        // checked, all pairs at once.
        let per_token = !whole_tokens && strided.is_none();
        for &(sp, dp) in &self.pairs {
            // numpy int64 in the reference: bases and results must fit i64.
            signed(sp, "prefill KV buffer address")?;
            signed(dp, "decode KV buffer address")?;
            signed(add(add(sp, max_src_page)?, src_in_page)?, "prefill address")?;
            signed(add(add(dp, max_dst_page)?, dst_in_page)?, "decode address")?;
            // From here on nothing can overflow (checked just above).
            let src_base = sp.wrapping_add(self.src_off);
            let dst_base = dp.wrapping_add(self.dst_off);
            if whole_tokens {
                let start = out.len();
                for (&a, &b) in src_pages.iter().zip(dst_pages) {
                    let blk = Block {
                        src: src_base.wrapping_add((a as u64).wrapping_mul(self.src_item)),
                        dst: dst_base.wrapping_add((b as u64).wrapping_mul(self.dst_item)),
                        len: page_len,
                    };
                    let can_merge = out.len() > start;
                    match out.last_mut() {
                        Some(last) if can_merge && last.is_continued_by(&blk) => {
                            last.len = last.len.saturating_add(blk.len);
                        }
                        _ => out.push(blk),
                    }
                }
                batch_ends.push(out.len());
            } else if let Some(ro) = strided.as_deref_mut() {
                // One run per page (its tokens at the token strides);
                // consecutive pages on both sides continue it.
                let start = ro.runs.len();
                for (&a, &b) in src_pages.iter().zip(dst_pages) {
                    let run = Run {
                        src: src_base.wrapping_add((a as u64).wrapping_mul(self.src_item)),
                        dst: dst_base.wrapping_add((b as u64).wrapping_mul(self.dst_item)),
                        len: page_len,
                        count: ps,
                        src_stride: self.src_token,
                        dst_stride: self.dst_token,
                    };
                    let can_merge = ro.runs.len() > start;
                    match ro.runs.last_mut() {
                        Some(last) if can_merge && last.is_continued_by(&run) => {
                            last.count = last.count.saturating_add(run.count);
                        }
                        _ => ro.runs.push(run),
                    }
                }
                ro.ends.push(ro.runs.len());
            }
        }
        if per_token {
            self.emit_token_slices(src_pages, dst_pages, threads, out, batch_ends)?;
        }
        Ok(())
    }

    /// Appends one block per (buffer pair, page, token): the per-token
    /// slices without strided runs, one batch per buffer pair. The largest
    /// plans there are, so written on up to `threads` threads.
    fn emit_token_slices(
        &self,
        src_pages: &[i32],
        dst_pages: &[i32],
        threads: usize,
        out: &mut Vec<Block>,
        batch_ends: &mut Vec<usize>,
    ) -> Result<(), PlanError> {
        let n = src_pages.len();
        let ps = usize::try_from(self.page_size)
            .map_err(|_| PlanError::Internal("page size beyond usize"))?;
        let (st, dt, len) = (self.src_token, self.dst_token, self.len);
        let (src_item, dst_item) = (self.src_item, self.dst_item);
        let start = out.len();
        let pairs = &self.pairs;
        // Part `p` is page `p % n` of buffer pair `p / n`; the addresses were
        // checked to fit by `emit`.
        append_parts(out, pairs.len().saturating_mul(n), ps, threads, |p| {
            let (sp, dp) = pairs[p / n];
            let src_base = sp.wrapping_add(self.src_off);
            let dst_base = dp.wrapping_add(self.dst_off);
            let (a, b) = (src_pages[p % n], dst_pages[p % n]);
            let s0 = src_base.wrapping_add((a as u64).wrapping_mul(src_item));
            let d0 = dst_base.wrapping_add((b as u64).wrapping_mul(dst_item));
            (0..self.page_size).map(move |t| Block {
                src: s0.wrapping_add(t.wrapping_mul(st)),
                dst: d0.wrapping_add(t.wrapping_mul(dt)),
                len,
            })
        })?;
        let per_pair = n.saturating_mul(ps);
        batch_ends.extend((1..=pairs.len()).map(|k| start + k * per_pair));
        Ok(())
    }
}
