//! Page/row-indexed state components (`swa`, `dsa`, `qsa_*`, `swa_ring`,
//! `c128_state`, `block_scale*`) and MiniMax's sparse index K: the generic
//! page copy over the component's own buffers and index lists, after the
//! type's TP and index-length rules.

use crate::block::Block;
use crate::error::PlanError;
use crate::kv::emit_generic;
use crate::layout::StateType;
use crate::pairing::{GenericPairing, generic_entries, pair_by_layer_ids};
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
    if hetero && !layout.is_any_mla() && !st.is_qsa() {
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
