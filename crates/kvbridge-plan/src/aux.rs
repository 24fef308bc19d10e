//! Aux (metadata) slots (`send_aux`, docs/plan-scenario.md §3.8): on the last
//! chunk, one block per decode aux buffer, from the prefill slot to the decode
//! slot.

use crate::block::Block;
use crate::error::PlanError;
use crate::index_runs::addr;
use crate::layout::{PeerRegistration, PrefillLayout};

/// Appends the aux blocks. Extra prefill aux buffers are ignored; a decode
/// aux buffer without a prefill counterpart is an error.
pub(crate) fn plan_aux(
    layout: &PrefillLayout,
    reg: &PeerRegistration,
    prefill_aux_index: Option<u64>,
    dst_aux_index: u64,
    out: &mut Vec<Block>,
) -> Result<(), PlanError> {
    for (k, &dst_ptr) in reg.dst_aux_ptrs.iter().enumerate() {
        let len = *layout
            .aux_item_lens
            .get(k)
            .ok_or(PlanError::MissingAuxBuffer { index: k })?;
        let src_ptr = *layout
            .aux_data_ptrs
            .get(k)
            .ok_or(PlanError::MissingAuxBuffer { index: k })?;
        let src_slot = prefill_aux_index.ok_or(PlanError::MissingAuxIndex)?;
        let src = addr(src_ptr, src_slot, len)?;
        let dst = addr(dst_ptr, dst_aux_index, len)?;
        if len > 0 {
            out.push(Block { src, dst, len });
        }
    }
    Ok(())
}
