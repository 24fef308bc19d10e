//! Compressed MLA (DeepSeek-V4 pools, `mla_compression_ratios`): which
//! decode buffer each prefill buffer of a PP stage pairs with
//! (`_mla_slice_ptrs_for_pp`), and which decode buffers take HiSparse's
//! device page space.
//!
//! The KV buffers are grouped by ratio, then by layer: C4 KV, C4 indexer,
//! C128 KV (each group holding the stage's layers of that ratio). Every
//! buffer is addressed by the full page id with its own item size, so the
//! copy itself is the generic page copy; only the pairing differs when the
//! decode holds more layers than the stage.

use std::collections::HashSet;

use crate::error::CompressedMlaError;
use crate::layout::{PeerRegistration, PrefillLayout, StateType};

fn count(ratios: &[u64], ratio: u64) -> usize {
    ratios.iter().filter(|&&r| r == ratio).count()
}

/// `_mla_slice_ptrs_for_pp`: the decode positions of a stage's `n_src`
/// buffers (of `state_type`, `None` for KV) in a decode list of `n_dst`.
pub(crate) fn stage_positions(
    ratios: &[u64],
    start: u64,
    end: Option<u64>,
    state_type: Option<StateType>,
    n_src: usize,
    n_dst: usize,
) -> Result<Vec<usize>, CompressedMlaError> {
    let layers = ratios.len();
    let end = end.ok_or(CompressedMlaError::MissingEndLayer)?;
    let (s, e) = (usize::try_from(start), usize::try_from(end));
    let (s, e) = match (s, e) {
        (Ok(s), Ok(e)) if s <= e && e <= layers => (s, e),
        _ => {
            return Err(CompressedMlaError::StageOutsideModel { start, end, layers });
        }
    };
    let (c4, c128) = (count(ratios, 4), count(ratios, 128));
    let (c4s, c4e) = (count(&ratios[..s], 4), count(&ratios[..e], 4));
    let (c128s, c128e) = (count(&ratios[..s], 128), count(&ratios[..e], 128));
    let kv_len = 2 * c4 + c128;
    let guard = match state_type {
        None => Some((kv_len, 3 * c4 + 2 * c128)),
        Some(StateType::SwaRing) => Some((layers, 2 * layers)),
        _ => None,
    };
    if let Some((single, two)) = guard
        && single != two
        && ((n_src == single && n_dst == two) || (n_src == two && n_dst == single))
    {
        return Err(CompressedMlaError::LayoutDisagreement {
            src: n_src,
            dst: n_dst,
            single,
            two,
        });
    }
    let positions: Vec<usize> = match state_type {
        Some(StateType::C128State) => (c128s..c128e).collect(),
        Some(StateType::SwaRing) => (s.min(n_dst)..e.min(n_dst)).collect(),
        None => {
            if n_dst != kv_len {
                return Err(CompressedMlaError::UnsliceableKv { dst: n_dst, kv_len });
            }
            (c4s..c4e)
                .chain(c4 + c4s..c4 + c4e)
                .chain(2 * c4 + c128s..2 * c4 + c128e)
                .collect()
        }
        Some(_) => {
            // The SWA state: SWA layers, then the C4 compressor and C4
            // indexer groups.
            let swa = n_dst
                .checked_sub(2 * c4)
                .filter(|&w| w <= layers)
                .ok_or(CompressedMlaError::SwaStateLayout { dst: n_dst, c4 })?;
            (s.min(swa)..e.min(swa))
                .chain(swa + c4s..swa + c4e)
                .chain(swa + c4 + c4s..swa + c4 + c4e)
                .collect()
        }
    };
    if positions.len() < n_src {
        return Err(CompressedMlaError::SliceShort {
            entry: positions.len(),
            dst_entries: positions.len(),
        });
    }
    Ok(positions)
}

/// Which paired KV entries (given by their decode buffers) take HiSparse's device page space: the decode
/// buffers after its C4 KV group (C4 layers of the stage when both sides
/// list the same buffers, of the model otherwise), matched by address.
pub(crate) fn device_entries(
    layout: &PrefillLayout,
    reg: &PeerRegistration,
    entry_dsts: &[u64],
) -> Vec<bool> {
    let Some(ratios) = &layout.mla_compression_ratios else {
        return vec![false; entry_dsts.len()];
    };
    let stage = if reg.dst_kv_ptrs.len() == layout.kv_data_ptrs.len() {
        let s = usize::try_from(layout.prefill_start_layer).unwrap_or(usize::MAX);
        let e = layout
            .prefill_end_layer
            .and_then(|e| usize::try_from(e).ok())
            .unwrap_or(ratios.len());
        ratios.get(s.min(e)..e.min(ratios.len())).unwrap_or(&[])
    } else {
        ratios.as_slice()
    };
    let c4 = count(stage, 4);
    let device: HashSet<u64> = reg.dst_kv_ptrs.iter().skip(c4).copied().collect();
    entry_dsts.iter().map(|d| device.contains(d)).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    const RATIOS: [u64; 6] = [4, 128, 4, 128, 4, 128];

    #[test]
    fn a_stage_slices_each_ratio_group() {
        // Decode (PP 1): [C4 l0 l2 l4 | IDX l0 l2 l4 | C128 l1 l3 l5] = 0..9.
        // Stage 3..6: C4 l4, IDX l4, C128 l3, C128 l5.
        let p = stage_positions(&RATIOS, 3, Some(6), None, 4, 9).unwrap();
        assert_eq!(p, vec![2, 5, 7, 8]);
        // Stage 0..3: C4 l0 l2, IDX l0 l2, C128 l1.
        let p = stage_positions(&RATIOS, 0, Some(3), None, 5, 9).unwrap();
        assert_eq!(p, vec![0, 1, 3, 4, 6]);
    }

    #[test]
    fn state_layouts_slice_their_own_way() {
        // SWA state: 6 SWA layers, then C4 compressor and indexer groups.
        let p = stage_positions(&RATIOS, 3, Some(6), Some(StateType::Swa), 5, 12).unwrap();
        assert_eq!(p, vec![3, 4, 5, 8, 11]);
        let p = stage_positions(&RATIOS, 3, Some(6), Some(StateType::C128State), 2, 3).unwrap();
        assert_eq!(p, vec![1, 2]);
        let p = stage_positions(&RATIOS, 3, Some(6), Some(StateType::SwaRing), 3, 6).unwrap();
        assert_eq!(p, vec![3, 4, 5]);
    }

    #[test]
    fn unsliceable_layouts_are_refused() {
        // Single pool (9) against two-pool (3*3 + 2*3 = 15).
        assert!(matches!(
            stage_positions(&RATIOS, 0, Some(6), None, 9, 15),
            Err(CompressedMlaError::LayoutDisagreement { .. })
        ));
        // A decode list with draft entries appended.
        assert!(matches!(
            stage_positions(&RATIOS, 3, Some(6), None, 4, 10),
            Err(CompressedMlaError::UnsliceableKv { .. })
        ));
        assert_eq!(
            stage_positions(&RATIOS, 3, None, None, 4, 9),
            Err(CompressedMlaError::MissingEndLayer)
        );
        assert!(matches!(
            stage_positions(&RATIOS, 3, Some(7), None, 4, 9),
            Err(CompressedMlaError::StageOutsideModel { .. })
        ));
    }
}
