//! Aux (metadata) slots (`send_aux`, docs/plan-scenario.md §3.8): on the last
//! chunk, one block per decode aux buffer, from the prefill slot to the decode
//! slot; and [`aux_slot`], the one rule for where an aux slot lies, for every
//! caller that names one (the planner, the zmq aux path, the decode inbox).

use crate::block::Block;
use crate::error::PlanError;
use crate::index_runs::{add, mul};
use crate::layout::{PeerRegistration, PrefillLayout};

/// The byte range of slot `index` of an aux buffer starting at `base` with
/// slots of `item_len` bytes: `(base + index · item_len, item_len)`.
/// [`PlanError::AddressOverflow`] when the start or the end of the range
/// does not fit in `u64`.
///
/// ```
/// use kvbridge_plan::{aux_slot, PlanError};
/// assert_eq!(aux_slot(0x1000, 64, 3), Ok((0x1000 + 3 * 64, 64)));
/// assert_eq!(aux_slot(u64::MAX - 8, 16, 0), Err(PlanError::AddressOverflow));
/// ```
pub fn aux_slot(base: u64, item_len: u64, index: u64) -> Result<(u64, u64), PlanError> {
    let start = add(base, mul(index, item_len)?)?;
    add(start, item_len)?;
    Ok((start, item_len))
}

impl PrefillLayout {
    /// The byte range of slot `index` of our aux buffer `buffer` (see
    /// [`aux_slot`]); [`PlanError::MissingAuxBuffer`] for a buffer we do
    /// not have.
    pub fn aux_slot(&self, buffer: usize, index: u64) -> Result<(u64, u64), PlanError> {
        let missing = PlanError::MissingAuxBuffer { index: buffer };
        let base = *self.aux_data_ptrs.get(buffer).ok_or(missing.clone())?;
        let len = *self.aux_item_lens.get(buffer).ok_or(missing)?;
        aux_slot(base, len, index)
    }
}

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
        if layout.aux_data_ptrs.get(k).is_none() {
            return Err(PlanError::MissingAuxBuffer { index: k });
        }
        let src_slot = prefill_aux_index.ok_or(PlanError::MissingAuxIndex)?;
        let (src, _) = layout.aux_slot(k, src_slot)?;
        let (dst, _) = aux_slot(dst_ptr, len, dst_aux_index)?;
        if len > 0 {
            out.push(Block { src, dst, len });
        }
    }
    Ok(())
}
