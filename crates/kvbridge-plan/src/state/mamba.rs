//! Mamba / linear-attention slot state (`_send_mamba_state`,
//! `_send_mamba_state_slice`, `compute_mamba_state_slice_byte_blocks`).
//!
//! One slot per request. With equal TP (or without dim metadata) every
//! buffer's slot is copied whole. With different TP each buffer's slot holds
//! `outer_count` rows of this rank's share of a TP-sliced axis; the planner
//! copies the part of the axis the decode rank needs (scatter) or places this
//! rank's part among the decode rank's (aggregation). A concatenated conv
//! state (`conv_shard_groups`, e.g. `[q | k | v]`) is sliced per sub-block.
//! Items with dim 0 are replicated: one elected prefill rank copies them whole.

use crate::block::Block;
use crate::error::PlanError;
use crate::index_runs::{add, mul};
use crate::pairing::pair_by_layer_ids;
use crate::state::{StateCtx, StateScratch, should_send_replicated};

/// Byte triple `(src_offset, dst_offset, len)` within one slot.
type Triple = (u64, u64, u64);

fn slot(v: i64, what: &'static str) -> Result<u64, PlanError> {
    u64::try_from(v).map_err(|_| PlanError::InvalidIndex { what, value: v })
}

/// Plans one mamba component.
pub(crate) fn plan(
    ctx: &StateCtx<'_>,
    scratch: &mut StateScratch,
    out: &mut Vec<Block>,
) -> Result<(), PlanError> {
    let c = ctx.component;
    let comp = ctx.comp;
    let src_dims = &comp.dim_per_tensor;
    let no_dims = src_dims.is_empty() || ctx.dst_dims.is_empty();
    if no_dims && comp.item_lens.as_slice() != ctx.dst_lens {
        return Err(PlanError::MambaLayoutMismatch { component: c });
    }
    if ctx.src_idx.len() != 1 {
        return Err(PlanError::MambaSlotCount {
            component: c,
            count: ctx.src_idx.len(),
        });
    }
    let src_slot = slot(ctx.src_idx[0], "mamba slot")?;
    let dst_slot = || -> Result<u64, PlanError> {
        let v = *ctx
            .dst_idx
            .first()
            .ok_or(PlanError::MissingDstStateIndex { component: c })?;
        slot(v, "decode mamba slot")
    };
    let layout = ctx.layout;
    pair_by_layer_ids(
        &comp.layer_ids,
        ctx.dst_ids,
        comp.data_ptrs.len(),
        ctx.dst_ptrs.len(),
        layout.pp_size == 1,
        &mut scratch.pairs,
    )?;
    let missing = |what: &'static str, entry: usize| PlanError::MissingStateMetadata {
        component: c,
        what,
        entry,
    };

    if layout.attn_tp_size == ctx.dst_tp || no_dims {
        for &(i, j) in &scratch.pairs {
            let len = *comp.item_lens.get(i).ok_or(missing("item_lens", i))?;
            if !ctx.dst_lens.is_empty() {
                let dl = *ctx.dst_lens.get(j).ok_or(missing("dst_item_lens", j))?;
                if dl != len {
                    return Err(PlanError::MambaSlotSizeMismatch {
                        component: c,
                        src: len,
                        dst: dl,
                    });
                }
            }
            let src = add(comp.data_ptrs[i], mul(len, src_slot)?)?;
            let dst = add(ctx.dst_ptrs[j], mul(len, dst_slot()?)?)?;
            if len > 0 {
                out.push(Block { src, dst, len });
            }
        }
        return Ok(());
    }

    let mut triples: Vec<Triple> = Vec::new();
    for &(i, j) in &scratch.pairs {
        let ds = *ctx.dst_lens.get(j).ok_or(missing("dst_item_lens", j))?;
        let ss = *comp.item_lens.get(i).ok_or(missing("item_lens", i))?;
        let sd = *src_dims.get(i).ok_or(missing("dim_per_tensor", i))?;
        let dd = *ctx
            .dst_dims
            .get(j)
            .ok_or(missing("dst_dim_per_tensor", j))?;
        let groups = comp.conv_shard_groups.get(i).and_then(Option::as_deref);
        let outer = comp.slice_outer_counts.get(i).copied().unwrap_or(1);
        triples.clear();
        slice_byte_blocks(
            &SliceParams {
                src_item: ss,
                dst_item: ds,
                src_dim: sd,
                dst_dim: dd,
                outer,
                p: layout.attn_tp_size,
                d: ctx.dst_tp,
                dst_rank: ctx.dst_rank % ctx.dst_tp,
                src_rank: layout.attn_tp_rank(),
                groups,
                component: c,
            },
            &mut triples,
        )?;
        for &(so, doff, n) in &triples {
            let src = add(add(comp.data_ptrs[i], mul(ss, src_slot)?)?, so)?;
            let dst = add(add(ctx.dst_ptrs[j], mul(ds, dst_slot()?)?)?, doff)?;
            if n > 0 {
                out.push(Block { src, dst, len: n });
            }
        }
    }
    Ok(())
}

/// Inputs of [`slice_byte_blocks`] for one buffer pair.
#[derive(Debug, Clone, Copy)]
pub(crate) struct SliceParams<'a> {
    /// Prefill slot bytes.
    pub src_item: u64,
    /// Decode slot bytes.
    pub dst_item: u64,
    /// Prefill size of the sliced axis (0 = replicated).
    pub src_dim: u64,
    /// Decode size of the sliced axis (0 = replicated).
    pub dst_dim: u64,
    /// Rows before the sliced axis.
    pub outer: u64,
    /// Prefill attention TP size.
    pub p: u64,
    /// Decode attention TP size.
    pub d: u64,
    /// Decode rank inside its TP group.
    pub dst_rank: u64,
    /// Prefill rank inside its TP group.
    pub src_rank: u64,
    /// Full sub-block sizes of a concatenated conv state.
    pub groups: Option<&'a [u64]>,
    /// Component index (errors).
    pub component: usize,
}

/// `compute_mamba_state_slice_byte_blocks`: byte triples of one slot.
pub(crate) fn slice_byte_blocks(
    s: &SliceParams<'_>,
    out: &mut Vec<Triple>,
) -> Result<(), PlanError> {
    let c = s.component;
    if (s.src_dim == 0) != (s.dst_dim == 0) {
        return Err(PlanError::MambaReplicationMismatch { component: c });
    }
    if s.src_dim == 0 {
        if s.src_item != s.dst_item {
            return Err(PlanError::MambaReplicatedSizeMismatch {
                component: c,
                src: s.src_item,
                dst: s.dst_item,
            });
        }
        if should_send_replicated(s.p, s.d, s.src_rank)? {
            out.push((0, 0, s.src_item));
        }
        return Ok(());
    }
    let zero = |what| PlanError::ZeroStateDivisor { component: c, what };
    let src_unit = mul(s.src_dim, s.outer)?;
    let dst_unit = mul(s.dst_dim, s.outer)?;
    if src_unit == 0 || dst_unit == 0 {
        return Err(zero("slice outer count"));
    }
    let sb = s.src_item / src_unit;
    let db = s.dst_item / dst_unit;
    let mut logical: Vec<Triple> = Vec::new();
    logical_blocks(s, &mut logical)?;
    for o in 0..s.outer {
        let src_row = mul(mul(o, s.src_dim)?, sb)?;
        let dst_row = mul(mul(o, s.dst_dim)?, db)?;
        for &(a, b, k) in &logical {
            out.push((
                add(src_row, mul(a, sb)?)?,
                add(dst_row, mul(b, db)?)?,
                mul(k, sb)?,
            ));
        }
    }
    Ok(())
}

/// `compute_mamba_state_slice_blocks`: `(src_start, dst_start, count)` in
/// units of the sliced axis.
fn logical_blocks(s: &SliceParams<'_>, out: &mut Vec<Triple>) -> Result<(), PlanError> {
    let (p, d) = (s.p, s.d);
    let groups = s.groups.filter(|g| {
        g.iter().map(|&x| u128::from(x)).sum::<u128>() == u128::from(s.src_dim) * u128::from(p)
    });
    if p > d {
        let writer = s.src_rank % (p / d);
        match groups {
            None => out.push((0, mul(writer, s.src_dim)?, s.src_dim)),
            Some(g) => {
                let (mut so, mut dof) = (0u64, 0u64);
                for &full in g {
                    let src_sub = full / p;
                    let dst_sub = full / d;
                    out.push((so, add(dof, mul(writer, src_sub)?)?, src_sub));
                    so = add(so, src_sub)?;
                    dof = add(dof, dst_sub)?;
                }
            }
        }
        return Ok(());
    }
    match groups {
        None => out.push((mul(s.dst_rank, s.dst_dim)? % s.src_dim, 0, s.dst_dim)),
        Some(g) => {
            let (mut so, mut dof) = (0u64, 0u64);
            for &full in g {
                let src_sub = full / p;
                let dst_sub = full / d;
                if src_sub == 0 {
                    return Err(PlanError::ZeroStateDivisor {
                        component: s.component,
                        what: "conv shard sub-block",
                    });
                }
                let start = add(so, mul(s.dst_rank, dst_sub)? % src_sub)?;
                out.push((start, dof, dst_sub));
                so = add(so, src_sub)?;
                dof = add(dof, dst_sub)?;
            }
        }
    }
    Ok(())
}
