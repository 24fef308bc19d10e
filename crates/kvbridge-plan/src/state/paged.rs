//! Page/row-indexed state components (`swa`, `dsa`, `qsa_*`, `swa_ring`,
//! `c128_state`, `block_scale*`) and MiniMax's sparse index K: the generic
//! page copy over the component's own buffers and index lists, after the
//! type's TP and index-length rules; SWA between different TP sizes is
//! head-sliced token by token, as the main MHA pool is.

use crate::block::Block;
use crate::error::PlanError;
use crate::index_runs::{add, mul, page, signed};
use crate::kv::emit_generic;
use crate::layout::StateType;
use crate::pairing::{GenericPairing, generic_entries, halves_pairs, pair_by_layer_ids};
use crate::staging::{head_slice_params, total_heads};
use crate::state::{StateCtx, StateScratch, should_send_replicated};

/// Truncates the longer of two index lists to the shorter one's length.
fn truncate<'a>(a: &'a [i64], b: &'a [i64]) -> (&'a [i64], &'a [i64]) {
    let n = a.len().min(b.len());
    (&a[..n], &b[..n])
}

/// Plans one page-indexed component.
pub(crate) fn plan(
    ctx: &StateCtx<'_>,
    scratch: &mut StateScratch,
    out: &mut Vec<Block>,
) -> Result<(), PlanError> {
    let layout = ctx.layout;
    let comp = ctx.comp;
    let st = comp.state_type;
    let hetero = layout.attn_tp_size != ctx.dst_tp;
    // sglang 0.5.23 head-slices SWA between TP sizes when the pool says how
    // its pages are laid out; everything else non-MLA is refused.
    let slice_heads = hetero && !layout.is_any_mla() && !st.is_qsa();
    if slice_heads && (st != StateType::Swa || layout.swa_kv_cache_layout.is_none()) {
        return Err(PlanError::PagedStateTpMismatch { state_type: st });
    }
    if hetero && st.is_qsa() {
        if ctx.dst_lens.len() != ctx.dst_ptrs.len() {
            return Err(PlanError::QsaMetadataMismatch {
                state_type: st,
                ptrs: ctx.dst_ptrs.len(),
                lens: ctx.dst_lens.len(),
            });
        }
        pair_by_layer_ids(
            &comp.layer_ids,
            ctx.dst_ids,
            comp.data_ptrs.len(),
            ctx.dst_ptrs.len(),
            layout.pp_size == 1,
            &mut scratch.pairs,
        )?;
        for &(i, j) in &scratch.pairs {
            let src = *comp
                .item_lens
                .get(i)
                .ok_or(PlanError::MissingStateMetadata {
                    component: ctx.component,
                    what: "item_lens",
                    entry: i,
                })?;
            let dst = ctx.dst_lens[j];
            if src != dst {
                return Err(PlanError::QsaLayoutMismatch {
                    state_type: st,
                    src_entry: i,
                    dst_entry: j,
                    src,
                    dst,
                });
            }
        }
        if !should_send_replicated(layout.attn_tp_size, ctx.dst_tp, layout.attn_tp_rank())? {
            return Ok(());
        }
    }
    if st == StateType::C128State && ctx.src_idx.is_empty() && ctx.dst_idx.is_empty() {
        return Ok(());
    }
    let (src_idx, dst_idx) = if ctx.src_idx.len() != ctx.dst_idx.len() {
        if st.requires_exact_index_match() {
            return Err(PlanError::StateIndexLengthMismatch {
                state_type: st,
                src: ctx.src_idx.len(),
                dst: ctx.dst_idx.len(),
            });
        }
        truncate(ctx.src_idx, ctx.dst_idx)
    } else {
        (ctx.src_idx, ctx.dst_idx)
    };
    if slice_heads {
        return head_slice(ctx, scratch, out, src_idx, dst_idx);
    }
    copy(
        ctx,
        scratch,
        out,
        GenericPairing {
            src_ptrs: &comp.data_ptrs,
            dst_ptrs: ctx.dst_ptrs,
            item_lens: &comp.item_lens,
            state_type: Some(st),
            force_flat: st.is_qsa() || layout.enable_unified_memory,
            src_ids: &comp.layer_ids,
            dst_ids: ctx.dst_ids,
            what: "state item_lens",
        },
        src_idx,
        dst_idx,
    )
}

/// SWA state between different attention TP sizes (sglang 0.5.23
/// `_send_swa_state_slice`): per K/V buffer pair and page pair, every token's
/// slice of heads, from NHD pages `[page_size, heads, head_dim]`.
fn head_slice(
    ctx: &StateCtx<'_>,
    scratch: &mut StateScratch,
    out: &mut Vec<Block>,
    src_idx: &[i64],
    dst_idx: &[i64],
) -> Result<(), PlanError> {
    let layout = ctx.layout;
    let comp = ctx.comp;
    if layout.pp_size > 1 {
        return Err(PlanError::SwaHeadSlicePipeline {
            pp_size: layout.pp_size,
        });
    }
    match layout.swa_kv_cache_layout.as_deref() {
        Some("nhd") => {}
        other => {
            return Err(PlanError::SwaHeadSliceLayout {
                layout: other.unwrap_or("None").to_owned(),
            });
        }
    }
    let (n_src, n_dst) = (comp.data_ptrs.len(), ctx.dst_ptrs.len());
    let entries_err = PlanError::SwaHeadSliceEntries {
        src: n_src,
        dst: n_dst,
    };
    // One K and one V buffer per layer on both sides (a unified envelope
    // region has no per-layer split to slice heads from).
    if n_src == 0 || n_src % 2 != 0 {
        return Err(entries_err);
    }
    halves_pairs(n_src, n_dst, layout.prefill_start_layer, &mut scratch.pairs)
        .map_err(|_| entries_err.clone())?;
    if scratch.pairs.len() != n_src {
        return Err(entries_err);
    }
    let (p, d) = (layout.attn_tp_size, ctx.dst_tp);
    let total = total_heads(layout, p)?;
    let hs = head_slice_params(p, d, layout.engine_rank, ctx.dst_rank, total);
    let src_heads = (total / p.max(1)).max(1);
    let dst_heads = (total / d.max(1)).max(1);
    let ps = layout.page_size.max(1);
    let start = out.len();
    for &(i, j) in &scratch.pairs {
        let missing = |what, entry| PlanError::MissingStateMetadata {
            component: ctx.component,
            what,
            entry,
        };
        let src_item = *comp.item_lens.get(i).ok_or(missing("item_lens", i))?;
        let dst_item = *ctx
            .dst_lens
            .get(j)
            .ok_or(missing("dst_state_item_lens", j))?;
        let head_len = src_item / (ps * src_heads);
        if mul(mul(head_len, ps)?, src_heads)? != src_item
            || mul(mul(head_len, ps)?, dst_heads)? != dst_item
            || head_len == 0
        {
            return Err(PlanError::SwaHeadSliceItemLens {
                src_item,
                dst_item,
                src_heads,
                dst_heads,
                total_heads: total,
                page_size: ps,
            });
        }
        let (src_token, dst_token) = (src_item / ps, dst_item / ps);
        let src_base = add(comp.data_ptrs[i], mul(hs.src_head_start, head_len)?)?;
        let dst_base = add(ctx.dst_ptrs[j], mul(hs.dst_head_start, head_len)?)?;
        let len = mul(hs.num_heads, head_len)?;
        for (&a, &b) in src_idx.iter().zip(dst_idx) {
            let s0 = add(src_base, mul(page(a, "prefill SWA page")?, src_item)?)?;
            let d0 = add(dst_base, mul(page(b, "decode SWA page")?, dst_item)?)?;
            for t in 0..ps {
                let blk = Block {
                    src: add(s0, mul(t, src_token)?)?,
                    dst: add(d0, mul(t, dst_token)?)?,
                    len,
                };
                // numpy uint64 in the reference; the engines take i64.
                signed(add(blk.src, len)?, "prefill SWA address")?;
                signed(add(blk.dst, len)?, "decode SWA address")?;
                let can_merge = out.len() > start;
                match out.last_mut() {
                    Some(last) if can_merge && last.is_continued_by(&blk) => {
                        last.len = last.len.saturating_add(blk.len);
                    }
                    _ => out.push(blk),
                }
            }
        }
    }
    Ok(())
}

/// Plans MiniMax's sparse index K (equal TP, PP 1, flat, no layer ids).
pub(crate) fn plan_minimax(
    ctx: &StateCtx<'_>,
    scratch: &mut StateScratch,
    out: &mut Vec<Block>,
) -> Result<(), PlanError> {
    let layout = ctx.layout;
    if layout.pp_size > 1 {
        return Err(PlanError::MinimaxPipeline);
    }
    if layout.attn_tp_size != ctx.dst_tp {
        return Err(PlanError::MinimaxTpMismatch {
            prefill: layout.attn_tp_size,
            decode: ctx.dst_tp,
        });
    }
    let (src_idx, dst_idx) = truncate(ctx.src_idx, ctx.dst_idx);
    copy(
        ctx,
        scratch,
        out,
        GenericPairing {
            src_ptrs: &ctx.comp.data_ptrs,
            dst_ptrs: ctx.dst_ptrs,
            item_lens: &ctx.comp.item_lens,
            state_type: None,
            force_flat: true,
            src_ids: &[],
            dst_ids: &[],
            what: "state item_lens",
        },
        src_idx,
        dst_idx,
    )
}

fn copy(
    ctx: &StateCtx<'_>,
    scratch: &mut StateScratch,
    out: &mut Vec<Block>,
    pairing: GenericPairing<'_>,
    src_idx: &[i64],
    dst_idx: &[i64],
) -> Result<(), PlanError> {
    generic_entries(
        ctx.layout,
        &pairing,
        &mut scratch.pairs,
        &mut scratch.entries,
    )?;
    scratch.batch_ends.clear();
    emit_generic(
        &scratch.entries,
        src_idx,
        dst_idx,
        ctx.layout.max_transfer_batch_indices,
        &mut scratch.runs,
        out,
        &mut scratch.batch_ends,
        ("state", "decode state"),
    )
}
