//! Buffer pairing: which decode buffer each prefill buffer is copied into.
//!
//! Three rules, as in the reference (docs/plan-scenario.md §3.4):
//! * **by layer id** (`build_transfer_entry_pairs`): the k-th prefill
//!   occurrence of a layer id pairs with the k-th decode occurrence;
//! * **flat PP slicing** (`get_mla_kv_ptrs_with_pp`): one buffer per layer,
//!   a prefill PP stage maps onto `[start, start + n)` of a decode that holds
//!   the whole model, draft entries onto the decode's last ones;
//! * **K/V halves** (`get_mha_kv_ptrs_with_pp`): K buffers of every layer,
//!   then V buffers, each half sliced to the stage.

use std::collections::{HashMap, VecDeque};
use std::ops::Range;

use crate::error::PlanError;
use crate::index_runs::py_slice;
use crate::layout::{PrefillLayout, StateType};

/// One buffer pair with the (prefill) item size used on both sides.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Entry {
    /// Prefill buffer base.
    pub src: u64,
    /// Decode buffer base.
    pub dst: u64,
    /// Bytes per item.
    pub item_len: u64,
}

/// Pairs prefill entries with decode entries by layer id, or positionally
/// (`build_transfer_entry_pairs`). Appends `(src_index, dst_index)` to `out`.
pub(crate) fn pair_by_layer_ids(
    src_ids: &[i64],
    dst_ids: &[i64],
    n_src: usize,
    n_dst: usize,
    allow_positional_fallback: bool,
    out: &mut Vec<(usize, usize)>,
) -> Result<(), PlanError> {
    out.clear();
    if n_src == 0 {
        return Ok(());
    }
    let (mut src_ids, mut dst_ids) = (src_ids, dst_ids);
    if src_ids.is_empty() != dst_ids.is_empty() {
        if !allow_positional_fallback {
            return Err(PlanError::LayerIdsOneSided);
        }
        src_ids = &[];
        dst_ids = &[];
    }
    if !src_ids.is_empty() {
        if src_ids.len() != n_src || dst_ids.len() != n_dst {
            return Err(PlanError::LayerIdCountMismatch {
                src_ids: src_ids.len(),
                n_src,
                dst_ids: dst_ids.len(),
                n_dst,
            });
        }
        let mut positions: HashMap<i64, VecDeque<usize>> = HashMap::new();
        for (j, &id) in dst_ids.iter().enumerate() {
            positions.entry(id).or_default().push_back(j);
        }
        for (i, &id) in src_ids.iter().enumerate() {
            let j = positions
                .get_mut(&id)
                .and_then(VecDeque::pop_front)
                .ok_or(PlanError::MissingDecodeLayer { layer: id })?;
            out.push((i, j));
        }
        return Ok(());
    }
    if n_dst < n_src || (n_src != n_dst && !allow_positional_fallback) {
        return Err(PlanError::PositionalPairing { n_src, n_dst });
    }
    out.extend((0..n_src).map(|i| (i, i)));
    Ok(())
}

/// Decode positions that flat PP slicing assigns to prefill entries
/// (`get_mla_kv_ptrs_with_pp`): entry `k` pairs with `positions[k]`
/// (an entry past the end has no partner).
pub(crate) fn flat_pp_positions(
    n_src: usize,
    n_dst: usize,
    start_layer: u64,
    num_draft: u64,
) -> Vec<usize> {
    if n_src == n_dst {
        return (0..n_src).collect();
    }
    let start = i128::from(start_layer);
    let end = start + n_src as i128 - i128::from(num_draft);
    let mut positions: Vec<usize> = py_slice(n_dst, start, end).collect();
    if num_draft > 0 {
        positions.extend(py_slice(n_dst, -i128::from(num_draft), n_dst as i128));
    }
    positions
}

/// Decode K and V position ranges of the K/V-halves layout
/// (`get_mha_kv_ptrs_with_pp`), and the stage's layer count `h`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Halves {
    /// Layers of this stage (`n_src / 2`).
    pub layers: usize,
    /// Decode K positions.
    pub dst_k: Range<usize>,
    /// Decode V positions.
    pub dst_v: Range<usize>,
}

/// Computes [`Halves`]; a prefill without layers facing a decode with some is an error.
pub(crate) fn kv_halves(n_src: usize, n_dst: usize, start_layer: u64) -> Result<Halves, PlanError> {
    let h = n_src / 2;
    let big_h = n_dst / 2;
    let start = i128::from(start_layer);
    let hh = h as i128;
    let (dst_k, dst_v) = if h == big_h {
        (0..big_h, big_h..n_dst)
    } else if h < big_h {
        if h == 0 {
            // Python: `H % 0` raises ZeroDivisionError.
            return Err(PlanError::EmptyKvHalves { dst_layers: big_h });
        }
        if !big_h.is_multiple_of(h) {
            let o = (h * (big_h / h)) as i128;
            (
                py_slice(n_dst, start, start + hh),
                py_slice(n_dst, o + start, o + start + hh),
            )
        } else {
            let o = big_h as i128;
            (
                py_slice(n_dst, start, start + hh),
                py_slice(n_dst, o + start, o + start + hh),
            )
        }
    } else {
        let o = big_h as i128;
        (
            py_slice(n_dst, start, start + hh),
            py_slice(n_dst, o + start, o + start + hh),
        )
    };
    Ok(Halves {
        layers: h,
        dst_k,
        dst_v,
    })
}

/// `(src_index, dst_index)` pairs of the K/V-halves layout: K pairs of every
/// stage layer, then V pairs. A stage layer without a decode K or V buffer is
/// an error.
pub(crate) fn halves_pairs(
    n_src: usize,
    n_dst: usize,
    start_layer: u64,
    out: &mut Vec<(usize, usize)>,
) -> Result<(), PlanError> {
    out.clear();
    let hv = kv_halves(n_src, n_dst, start_layer)?;
    let h = hv.layers;
    if h > hv.dst_k.len() {
        return Err(PlanError::StageLayersBeyondDecode {
            layers: h,
            dst_layers: hv.dst_k.len(),
        });
    }
    if h > hv.dst_v.len() {
        return Err(PlanError::MissingDecodeV {
            layer: hv.dst_v.len(),
        });
    }
    out.extend((0..h).map(|l| (l, hv.dst_k.start + l)));
    out.extend((0..h).map(|l| (h + l, hv.dst_v.start + l)));
    Ok(())
}

/// Everything the generic page copy needs to pair buffers.
#[derive(Debug, Clone, Copy)]
pub(crate) struct GenericPairing<'a> {
    /// Prefill buffers.
    pub src_ptrs: &'a [u64],
    /// Decode buffers.
    pub dst_ptrs: &'a [u64],
    /// Prefill item sizes (parallel to `src_ptrs`).
    pub item_lens: &'a [u64],
    /// State type (`None` for KV and MiniMax index-K).
    pub state_type: Option<StateType>,
    /// Force the flat layout.
    pub force_flat: bool,
    /// Prefill layer ids.
    pub src_ids: &'a [i64],
    /// Decode layer ids.
    pub dst_ids: &'a [i64],
    /// Label for errors.
    pub what: &'static str,
}

/// Buffer pairing of the generic page copy (`_send_kvcache_generic`),
/// appended to `out` as entries.
pub(crate) fn generic_entries(
    layout: &PrefillLayout,
    g: &GenericPairing<'_>,
    pairs: &mut Vec<(usize, usize)>,
    out: &mut Vec<Entry>,
) -> Result<(), PlanError> {
    out.clear();
    let n_src = g.src_ptrs.len();
    let n_dst = g.dst_ptrs.len();
    let has_ids = !g.src_ids.is_empty() || !g.dst_ids.is_empty();
    let single_region_swa = g.state_type == Some(StateType::Swa) && n_src == 1 && n_dst == 1;
    let item = |i: usize| -> Result<u64, PlanError> {
        g.item_lens
            .get(i)
            .copied()
            .ok_or(PlanError::MissingItemLen {
                what: g.what,
                entry: i,
            })
    };
    if layout.is_any_mla() || g.force_flat || has_ids || single_region_swa {
        if has_ids {
            pair_by_layer_ids(
                g.src_ids,
                g.dst_ids,
                n_src,
                n_dst,
                layout.pp_size == 1,
                pairs,
            )?;
            for &(i, j) in pairs.iter() {
                out.push(Entry {
                    src: g.src_ptrs[i],
                    dst: g.dst_ptrs[j],
                    item_len: item(i)?,
                });
            }
        } else {
            let num_draft = if g.state_type.is_none() {
                layout.num_draft_entries
            } else {
                0
            };
            let positions = match &layout.mla_compression_ratios {
                Some(ratios) if n_src != n_dst => crate::compressed::stage_positions(
                    ratios,
                    layout.prefill_start_layer,
                    layout.prefill_end_layer,
                    g.state_type,
                    n_src,
                    n_dst,
                )?,
                _ => flat_pp_positions(n_src, n_dst, layout.prefill_start_layer, num_draft),
            };
            for (k, &src) in g.src_ptrs.iter().enumerate() {
                let j = *positions.get(k).ok_or(PlanError::FlatPairingOutOfRange {
                    entry: k,
                    dst_entries: positions.len(),
                })?;
                out.push(Entry {
                    src,
                    dst: g.dst_ptrs[j],
                    item_len: item(k)?,
                });
            }
        }
    } else {
        halves_pairs(n_src, n_dst, layout.prefill_start_layer, pairs)?;
        for &(i, j) in pairs.iter() {
            out.push(Entry {
                src: g.src_ptrs[i],
                dst: g.dst_ptrs[j],
                item_len: item(i)?,
            });
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn by_ids(
        s: &[i64],
        d: &[i64],
        ns: usize,
        nd: usize,
        fallback: bool,
    ) -> Result<Vec<(usize, usize)>, PlanError> {
        let mut out = Vec::new();
        pair_by_layer_ids(s, d, ns, nd, fallback, &mut out)?;
        Ok(out)
    }

    #[test]
    fn ids_pair_by_occurrence() {
        assert_eq!(
            by_ids(&[2, 3, 2, 3], &[0, 1, 2, 3, 0, 1, 2, 3], 4, 8, false).unwrap(),
            vec![(0, 2), (1, 3), (2, 6), (3, 7)]
        );
    }

    #[test]
    fn ids_missing_layer() {
        assert_eq!(
            by_ids(&[0, 1, 2, 0, 1, 2], &[0, 1, 0, 1], 6, 4, true),
            Err(PlanError::MissingDecodeLayer { layer: 2 })
        );
    }

    #[test]
    fn ids_one_sided() {
        assert_eq!(
            by_ids(&[0], &[], 1, 1, false),
            Err(PlanError::LayerIdsOneSided)
        );
        assert_eq!(by_ids(&[0], &[], 1, 2, true).unwrap(), vec![(0, 0)]);
        // No source entries: nothing to pair, nothing to check.
        assert_eq!(by_ids(&[0], &[], 0, 2, false).unwrap(), vec![]);
    }

    #[test]
    fn ids_length_must_match() {
        assert!(matches!(
            by_ids(&[0, 1], &[0], 2, 2, true),
            Err(PlanError::LayerIdCountMismatch { .. })
        ));
    }

    #[test]
    fn positional_rules() {
        assert_eq!(by_ids(&[], &[], 2, 3, true).unwrap(), vec![(0, 0), (1, 1)]);
        assert!(by_ids(&[], &[], 2, 3, false).is_err());
        assert!(by_ids(&[], &[], 3, 2, true).is_err());
    }

    #[test]
    fn flat_pp_with_draft() {
        // Stage 3..6 of 6 layers + 1 draft: decode 7 entries.
        assert_eq!(flat_pp_positions(4, 7, 3, 1), vec![3, 4, 5, 6]);
        // Too few decode entries: the slice is clipped.
        assert_eq!(flat_pp_positions(3, 4, 2, 0), vec![2, 3]);
        // More draft entries than source entries: negative end.
        assert_eq!(flat_pp_positions(1, 4, 0, 2), vec![0, 1, 2, 2, 3]);
    }

    #[test]
    fn halves_cases() {
        // Equal.
        assert_eq!(
            kv_halves(4, 4, 0).unwrap(),
            Halves {
                layers: 2,
                dst_k: 0..2,
                dst_v: 2..4
            }
        );
        // Stage 1 (layers 2..4) of a 4-layer decode.
        assert_eq!(
            kv_halves(4, 8, 2).unwrap(),
            Halves {
                layers: 2,
                dst_k: 2..4,
                dst_v: 6..8
            }
        );
        // Decode with extra draft layers (H % h != 0): V after h * (H / h).
        assert_eq!(
            kv_halves(4, 6, 0).unwrap(),
            Halves {
                layers: 2,
                dst_k: 0..2,
                dst_v: 2..4
            }
        );
        assert!(matches!(
            kv_halves(0, 4, 0),
            Err(PlanError::EmptyKvHalves { .. })
        ));
        let mut out = Vec::new();
        assert!(matches!(
            halves_pairs(8, 4, 2, &mut out),
            Err(PlanError::StageLayersBeyondDecode { .. })
        ));
    }
}
