//! DSA kpool-compress tail (`slice_dsa_tail_dst_ptrs_for_pp`,
//! `build_dsa_tail_transfer_blocks`).
//!
//! Each buffer row is one request's ring of `ring_size` slots; an index tuple
//! `[row, off1, n1, off2, n2, ring_size]` names the live slots as up to two
//! segments (the ring wraps). Both sides list the same number of live slots,
//! possibly split differently (ring sizes differ); the planner walks both
//! segment lists in step and emits one block per piece that stays inside a
//! segment on both sides. Buffers are key halves then score halves; a
//! prefill PP stage takes its layers out of both halves of a whole-model
//! decode list.

use crate::block::Block;
use crate::error::{DsaTailError, PlanError};
use crate::index_runs::{add, mul};
use crate::state::StateCtx;

/// Plans one `dsa_tail` component.
pub(crate) fn plan(ctx: &StateCtx<'_>, out: &mut Vec<Block>) -> Result<(), PlanError> {
    let err = |reason| PlanError::DsaTail {
        component: ctx.component,
        reason,
    };
    let src_ptrs = &ctx.comp.data_ptrs;
    let start = ctx.layout.prefill_start_layer;
    let dst_ptrs = slice_for_pp(src_ptrs.len(), ctx.dst_ptrs, start).map_err(err)?;
    let dst_lens = slice_for_pp(src_ptrs.len(), ctx.dst_lens, start).map_err(err)?;
    build(
        src_ptrs,
        &ctx.comp.item_lens,
        &dst_ptrs,
        &dst_lens,
        ctx.src_idx,
        ctx.dst_idx,
        out,
    )
    .map_err(|e| match e {
        TailFail::Tail(reason) => err(reason),
        TailFail::Plan(e) => e,
    })
}

/// The request-independent part of [`plan`]: the decode's buffers slice to
/// this stage and pair one to one.
pub(crate) fn check(ctx: &StateCtx<'_>) -> Result<(), PlanError> {
    let err = |reason| PlanError::DsaTail {
        component: ctx.component,
        reason,
    };
    let n = ctx.comp.data_ptrs.len();
    let start = ctx.layout.prefill_start_layer;
    let dst_ptrs = slice_for_pp(n, ctx.dst_ptrs, start).map_err(err)?;
    let dst_lens = slice_for_pp(n, ctx.dst_lens, start).map_err(err)?;
    let src_lens = ctx.comp.item_lens.len();
    if !(n == dst_ptrs.len() && n == src_lens && n == dst_lens.len()) {
        return Err(err(DsaTailError::MetadataMismatch {
            src_ptrs: n,
            dst_ptrs: dst_ptrs.len(),
            src_lens,
            dst_lens: dst_lens.len(),
        }));
    }
    Ok(())
}

/// `slice_dsa_tail_dst_ptrs_for_pp` (applied to pointers and to sizes, with
/// the prefill pointer count as reference).
fn slice_for_pp(n_src: usize, dst: &[u64], start: u64) -> Result<Vec<u64>, DsaTailError> {
    if n_src == dst.len() {
        return Ok(dst.to_vec());
    }
    if !n_src.is_multiple_of(2) || !dst.len().is_multiple_of(2) {
        return Err(DsaTailError::OddHalves {
            src: n_src,
            dst: dst.len(),
        });
    }
    let sl = n_src / 2;
    let dl = dst.len() / 2;
    let end = u128::from(start) + sl as u128;
    if end > dl as u128 {
        return Err(DsaTailError::StageBeyondDecode {
            src: n_src,
            dst: dst.len(),
            end: u64::try_from(end).unwrap_or(u64::MAX),
        });
    }
    // end <= dl, so start <= dl and both fit usize.
    let s = usize::try_from(start).unwrap_or(dl);
    let e = s + sl;
    let mut v = dst[s..e].to_vec();
    v.extend_from_slice(&dst[dl + s..dl + e]);
    Ok(v)
}

enum TailFail {
    Tail(DsaTailError),
    Plan(PlanError),
}

impl From<DsaTailError> for TailFail {
    fn from(e: DsaTailError) -> Self {
        TailFail::Tail(e)
    }
}

impl From<PlanError> for TailFail {
    fn from(e: PlanError) -> Self {
        TailFail::Plan(e)
    }
}

fn segments(idx: &[i64], ring: i64) -> Result<Vec<(i64, i64)>, DsaTailError> {
    let mut segs = Vec::with_capacity(2);
    for k in [1usize, 3] {
        let (off, n) = (idx[k], idx[k + 1]);
        if off.min(n) < 0 {
            return Err(DsaTailError::NegativeSegment);
        }
        if i128::from(off) + i128::from(n) > i128::from(ring) {
            return Err(DsaTailError::SegmentBeyondRing { off, len: n, ring });
        }
        if n != 0 {
            segs.push((off, n));
        }
    }
    Ok(segs)
}

fn nonneg(v: i64) -> u64 {
    u64::try_from(v).unwrap_or(0)
}

/// `build_dsa_tail_transfer_blocks`.
fn build(
    src_ptrs: &[u64],
    src_lens: &[u64],
    dst_ptrs: &[u64],
    dst_lens: &[u64],
    src_idx: &[i64],
    dst_idx: &[i64],
    out: &mut Vec<Block>,
) -> Result<(), TailFail> {
    if src_idx.is_empty() && dst_idx.is_empty() {
        return Ok(());
    }
    if src_idx.is_empty() || dst_idx.is_empty() {
        return Err(DsaTailError::OneSided.into());
    }
    if src_idx.len() != 6 || dst_idx.len() != 6 {
        return Err(DsaTailError::NotSixTuple {
            src: src_idx.len(),
            dst: dst_idx.len(),
        }
        .into());
    }
    if !(src_ptrs.len() == dst_ptrs.len()
        && dst_ptrs.len() == src_lens.len()
        && src_lens.len() == dst_lens.len())
    {
        return Err(DsaTailError::MetadataMismatch {
            src_ptrs: src_ptrs.len(),
            dst_ptrs: dst_ptrs.len(),
            src_lens: src_lens.len(),
            dst_lens: dst_lens.len(),
        }
        .into());
    }
    let (src_ring, dst_ring) = (src_idx[5], dst_idx[5]);
    if src_ring <= 0 || dst_ring <= 0 {
        return Err(DsaTailError::RingSize {
            src: src_ring,
            dst: dst_ring,
        }
        .into());
    }
    let src_segs = segments(src_idx, src_ring)?;
    let dst_segs = segments(dst_idx, dst_ring)?;
    let src_count: i128 = src_segs.iter().map(|s| i128::from(s.1)).sum();
    let dst_count: i128 = dst_segs.iter().map(|s| i128::from(s.1)).sum();
    if src_count != dst_count {
        let clamp = |x: i128| i64::try_from(x).unwrap_or(i64::MAX);
        return Err(DsaTailError::LiveCountMismatch {
            src: clamp(src_count),
            dst: clamp(dst_count),
        }
        .into());
    }
    let (src_row, dst_row) = (src_idx[0], dst_idx[0]);
    if src_row < 0 || dst_row < 0 {
        return Err(DsaTailError::NegativeRow.into());
    }
    let (src_row, dst_row) = (nonneg(src_row), nonneg(dst_row));
    let (src_ring_u, dst_ring_u) = (nonneg(src_ring), nonneg(dst_ring));

    for k in 0..src_ptrs.len() {
        let (sb, db) = (src_lens[k], dst_lens[k]);
        if sb == 0 && db == 0 {
            continue;
        }
        if sb == 0 || sb % src_ring_u != 0 {
            return Err(DsaTailError::RowNotDivisible {
                row_bytes: sb,
                ring: src_ring,
            }
            .into());
        }
        if db == 0 || db % dst_ring_u != 0 {
            return Err(DsaTailError::RowNotDivisible {
                row_bytes: db,
                ring: dst_ring,
            }
            .into());
        }
        let (ss, ds) = (sb / src_ring_u, db / dst_ring_u);
        if ss != ds {
            return Err(DsaTailError::SlotSizeMismatch { src: ss, dst: ds }.into());
        }
        let slot = ss;
        let src_base = add(src_ptrs[k], mul(sb, src_row)?)?;
        let dst_base = add(dst_ptrs[k], mul(db, dst_row)?)?;
        let (mut si, mut di) = (0usize, 0usize);
        let (mut sc, mut dc) = (0i64, 0i64);
        while si < src_segs.len() && di < dst_segs.len() {
            let (so, sn) = src_segs[si];
            let (dof, dn) = dst_segs[di];
            let n = (sn - sc).min(dn - dc);
            out.push(Block {
                src: add(src_base, mul(nonneg(so + sc), slot)?)?,
                dst: add(dst_base, mul(nonneg(dof + dc), slot)?)?,
                len: mul(nonneg(n), slot)?,
            });
            sc += n;
            dc += n;
            if sc == sn {
                si += 1;
                sc = 0;
            }
            if dc == dn {
                di += 1;
                dc = 0;
            }
        }
    }
    Ok(())
}
