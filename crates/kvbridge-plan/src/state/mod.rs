//! State components (docs/plan-scenario.md §3.7), sent on the last chunk only,
//! in `state_types` order. Each type has its own rule:
//!
//! * [`mamba`]: one slot per request, copied whole (equal TP) or TP-resliced;
//! * [`dsa_tail`]: one ring row per request, live slots remapped between
//!   rings of different sizes;
//! * [`paged`]: page/row-indexed components through the generic page copy.

pub(crate) mod dsa_tail;
pub(crate) mod mamba;
pub(crate) mod paged;

use std::ops::Range;

use crate::block::Block;
use crate::error::PlanError;
use crate::index_runs::IndexRuns;
use crate::layout::{PeerRegistration, PrefillLayout, StateComponent, StateType, TransferRequest};
use crate::pairing::Entry;

/// Reusable buffers of the state rules.
#[derive(Debug, Default)]
pub(crate) struct StateScratch {
    pub pairs: Vec<(usize, usize)>,
    pub entries: Vec<Entry>,
    pub runs: IndexRuns,
    pub batch_ends: Vec<usize>,
}

/// One component's inputs from both peers.
#[derive(Debug, Clone, Copy)]
pub(crate) struct StateCtx<'a> {
    /// Our layout.
    pub layout: &'a PrefillLayout,
    /// Component index.
    pub component: usize,
    /// Our side of the component.
    pub comp: &'a StateComponent,
    /// Prefill indices of this chunk.
    pub src_idx: &'a [i64],
    /// Decode indices of the request.
    pub dst_idx: &'a [i64],
    /// Decode buffers.
    pub dst_ptrs: &'a [u64],
    /// Decode item sizes.
    pub dst_lens: &'a [u64],
    /// Decode sliced-axis sizes.
    pub dst_dims: &'a [u64],
    /// Decode layer ids.
    pub dst_ids: &'a [i64],
    /// Decode attention TP size.
    pub dst_tp: u64,
    /// Decode engine rank.
    pub dst_rank: u64,
}

fn inner<T>(lists: &[Vec<T>], i: usize) -> &[T] {
    lists.get(i).map_or(&[], Vec::as_slice)
}

impl<'a> StateCtx<'a> {
    /// Component `i` of `layout` against `reg`, with `(prefill, decode)` indices.
    fn new(
        layout: &'a PrefillLayout,
        reg: &'a PeerRegistration,
        i: usize,
        comp: &'a StateComponent,
        (src_idx, dst_idx): (&'a [i64], &'a [i64]),
    ) -> Self {
        StateCtx {
            layout,
            component: i,
            comp,
            src_idx,
            dst_idx,
            dst_ptrs: inner(&reg.dst_state_data_ptrs, i),
            dst_lens: inner(&reg.dst_state_item_lens, i),
            dst_dims: inner(&reg.dst_state_dim_per_tensor, i),
            dst_ids: inner(&reg.dst_state_layer_ids, i),
            dst_tp: reg.dst_attn_tp_size,
            dst_rank: reg.dst_tp_rank,
        }
    }
}

/// Plans every state component of a last chunk, appending blocks to `out`
/// and one `(component, range)` per component that produced blocks.
pub(crate) fn plan_states(
    layout: &PrefillLayout,
    reg: &PeerRegistration,
    request: &TransferRequest,
    state_indices: &[Option<Vec<i64>>],
    scratch: &mut StateScratch,
    out: &mut Vec<Block>,
    ranges: &mut Vec<(usize, Range<usize>)>,
) -> Result<(), PlanError> {
    for (i, comp) in layout.states.iter().enumerate() {
        let Some(Some(src_idx)) = state_indices.get(i) else {
            continue;
        };
        let dst_idx = inner(&request.dst_state_indices, i);
        let ctx = StateCtx::new(layout, reg, i, comp, (src_idx, dst_idx));
        let start = out.len();
        match comp.state_type {
            StateType::Mamba => mamba::plan(&ctx, scratch, out)?,
            StateType::DsaTail => dsa_tail::plan(&ctx, out)?,
            StateType::MinimaxIndexK => paged::plan_minimax(&ctx, scratch, out)?,
            StateType::MinimaxDenseKv | StateType::RequestRow => {}
            t if t.is_paged() => paged::plan(&ctx, scratch, out)?,
            _ => {}
        }
        if out.len() > start {
            ranges.push((i, start..out.len()));
        }
    }
    Ok(())
}

/// Checks every state component against a decode registration without a
/// request: each component is planned once with item 0 on both sides (a
/// tail ring's pairing only), so a layout that no request could move fails
/// at registration instead of at the first last chunk.
pub(crate) fn check_states(
    layout: &PrefillLayout,
    reg: &PeerRegistration,
) -> Result<(), PlanError> {
    let mut scratch = StateScratch::default();
    let mut out = Vec::new();
    for (i, comp) in layout.states.iter().enumerate() {
        let ctx = StateCtx::new(layout, reg, i, comp, (&[0], &[0]));
        out.clear();
        match comp.state_type {
            StateType::Mamba => mamba::plan(&ctx, &mut scratch, &mut out)?,
            StateType::DsaTail => dsa_tail::check(&ctx)?,
            StateType::MinimaxIndexK => paged::plan_minimax(&ctx, &mut scratch, &mut out)?,
            StateType::MinimaxDenseKv | StateType::RequestRow => {}
            t if t.is_paged() => paged::plan(&ctx, &mut scratch, &mut out)?,
            _ => {}
        }
    }
    Ok(())
}

/// `should_send_replicated_state`: which prefill ranks write state that is
/// replicated within an attention-TP group (scatter: all; aggregation: the
/// first rank of each group).
pub(crate) fn should_send_replicated(p: u64, d: u64, r: u64) -> Result<bool, PlanError> {
    let (big, small) = (p.max(d), p.min(d));
    if small == 0 || big % small != 0 {
        return Err(PlanError::TpNotDivisible {
            prefill: p,
            decode: d,
        });
    }
    if p <= d {
        return Ok(true);
    }
    Ok(r.is_multiple_of(p / d))
}
