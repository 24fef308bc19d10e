//! Page copy (`send_kvcache` / `_send_kvcache_generic`, docs/plan-scenario.md
//! §3.3 b and §3.4): every buffer pair copies whole items for every run of
//! concurrently contiguous pages.

use crate::block::Block;
use crate::error::PlanError;
use crate::index_runs::{IndexRuns, PageIndex, addr, mul};
use crate::layout::{PeerRegistration, PrefillLayout};
use crate::pairing::{Entry, GenericPairing, generic_entries};

/// Prepared KV page copy: the buffer pairs, fixed per peer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct PageCopy {
    /// Buffer pairs with their item sizes.
    pub entries: Vec<Entry>,
    /// Per entry: its decode buffer takes HiSparse's device page space.
    pub device: Vec<bool>,
}

/// Checks the unified-memory envelope (`_validate_envelope_kv_layout`) and
/// pairs the KV buffers.
pub(crate) fn prepare_page_copy(
    layout: &PrefillLayout,
    reg: &PeerRegistration,
) -> Result<PageCopy, PlanError> {
    if layout.enable_unified_memory {
        if layout.attn_tp_size != reg.dst_attn_tp_size {
            return Err(PlanError::UnifiedMemoryTpMismatch {
                prefill: layout.attn_tp_size,
                decode: reg.dst_attn_tp_size,
            });
        }
        if layout.kv_item_lens.len() != 1
            || reg.dst_kv_ptrs.len() != 1
            || layout.kv_item_lens[0] != reg.dst_kv_item_len
        {
            return Err(PlanError::UnifiedMemoryLayoutMismatch {
                src_regions: layout.kv_item_lens.len(),
                dst_regions: reg.dst_kv_ptrs.len(),
                dst_item_len: reg.dst_kv_item_len,
            });
        }
    }
    let mut pairs = Vec::new();
    let mut entries = Vec::new();
    generic_entries(
        layout,
        &GenericPairing {
            src_ptrs: &layout.kv_data_ptrs,
            dst_ptrs: &reg.dst_kv_ptrs,
            item_lens: &layout.kv_item_lens,
            state_type: None,
            force_flat: layout.enable_unified_memory,
            src_ids: &layout.kv_layer_ids,
            dst_ids: &reg.dst_kv_layer_ids,
            what: "kv_item_lens",
        },
        &mut pairs,
        &mut entries,
    )?;
    let dsts: Vec<u64> = entries.iter().map(|e| e.dst).collect();
    let device = crate::compressed::device_entries(layout, reg, &dsts);
    Ok(PageCopy { entries, device })
}

/// Appends one block per (entry, run) to `out`.
///
/// Overflow is checked once per entry against the run maxima: the largest
/// source index, destination index and run length each belong to an emitted
/// block, so if they fit, every block fits, and the loop can use wrapping
/// arithmetic that never actually wraps.
pub(crate) fn emit_entries_runs(
    entries: &[Entry],
    runs: &IndexRuns,
    out: &mut Vec<Block>,
) -> Result<(), PlanError> {
    if runs.runs.is_empty() {
        return Ok(());
    }
    out.reserve(entries.len().saturating_mul(runs.len()));
    for e in entries {
        let il = e.item_len;
        if il == 0 {
            continue; // zero-length blocks move nothing
        }
        addr(e.src, runs.max_a, il)?;
        addr(e.dst, runs.max_b, il)?;
        mul(runs.max_n, il)?;
        let (s, d) = (e.src, e.dst);
        out.extend(runs.runs.iter().map(|r| Block {
            src: s.wrapping_add(r.a.wrapping_mul(il)),
            dst: d.wrapping_add(r.b.wrapping_mul(il)),
            len: r.n.wrapping_mul(il),
        }));
    }
    Ok(())
}

/// The generic page copy's block emission for given entries and index lists,
/// honouring `max_transfer_batch_indices`: with batching, runs are formed per
/// batch of indices and each batch covers every entry (the reference's order),
/// so each batch is one contiguous slice of `out`. Pushes each batch's end to
/// `batch_ends`.
#[allow(clippy::too_many_arguments)]
pub(crate) fn emit_generic<S: PageIndex, D: PageIndex>(
    entries: &[Entry],
    src_idx: &[S],
    dst_idx: &[D],
    max_batch: u64,
    runs: &mut IndexRuns,
    out: &mut Vec<Block>,
    batch_ends: &mut Vec<usize>,
    what: (&'static str, &'static str),
) -> Result<(), PlanError> {
    // The whole lists first: this is where a length mismatch is rejected.
    runs.build(src_idx, dst_idx, what.0, what.1)?;
    let batch = usize::try_from(max_batch).unwrap_or(usize::MAX);
    if batch == 0 || src_idx.len() <= batch || runs.runs.is_empty() {
        emit_entries_runs(entries, runs, out)?;
        batch_ends.push(out.len());
        return Ok(());
    }
    let mut start = 0;
    while start < src_idx.len() {
        let end = start.saturating_add(batch).min(src_idx.len());
        let d_end = end.min(dst_idx.len());
        let d_start = start.min(d_end);
        runs.build(
            &src_idx[start..end],
            &dst_idx[d_start..d_end],
            what.0,
            what.1,
        )?;
        emit_entries_runs(entries, runs, out)?;
        batch_ends.push(out.len());
        start = end;
    }
    Ok(())
}

/// `idx[start..end]`, clipped to `idx`.
fn window(idx: &[i32], start: usize, end: usize) -> &[i32] {
    let e = end.min(idx.len());
    &idx[start.min(e)..e]
}

/// [`emit_generic`] with a second destination page space (HiSparse): the
/// entries flagged in `device` take `dev_idx`, the others `dst_idx`, each
/// batch (and each entry within it) in the reference's order.
#[allow(clippy::too_many_arguments)]
pub(crate) fn emit_two_spaces(
    entries: &[Entry],
    device: &[bool],
    src_idx: &[i32],
    dst_idx: &[i32],
    dev_idx: &[i32],
    max_batch: u64,
    runs: (&mut IndexRuns, &mut IndexRuns),
    out: &mut Vec<Block>,
    batch_ends: &mut Vec<usize>,
) -> Result<(), PlanError> {
    let (host, dev) = runs;
    let batch = usize::try_from(max_batch).unwrap_or(usize::MAX);
    let batch = if batch == 0 {
        src_idx.len().max(1)
    } else {
        batch
    };
    let mut start = 0;
    while start < src_idx.len() {
        let end = start.saturating_add(batch).min(src_idx.len());
        host.build(
            &src_idx[start..end],
            window(dst_idx, start, end),
            "prefill_kv_indices",
            "dst_kv_indices",
        )?;
        dev.build(
            &src_idx[start..end],
            window(dev_idx, start, end),
            "prefill_kv_indices",
            "dst_device_kv_indices",
        )?;
        for (i, e) in entries.iter().enumerate() {
            let runs = if device.get(i).copied().unwrap_or(false) {
                &*dev
            } else {
                &*host
            };
            emit_entries_runs(std::slice::from_ref(e), runs, out)?;
        }
        batch_ends.push(out.len());
        start = end;
    }
    Ok(())
}
