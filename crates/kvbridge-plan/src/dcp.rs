//! DCP relayout (`send_kvcache_dcp` + `build_dcp_token_transfer_plan`,
//! docs/plan-scenario.md §3.6): an MLA prefill without DCP feeds a decode whose
//! DCP ranks each hold every `dst_dcp_size`-th token. Blocks are per token row
//! (one row = one token of one buffer, `w[e]` bytes), grouped into runs.
//!
//! * **Target** entries (the model's layers) get the tokens whose global
//!   position falls on the decode's DCP rank, stored compactly in its
//!   physical pages.
//! * **Draft** entries (MTP/NextN) get every token, addressed in virtual
//!   pages of `page_size * dst_dcp_size` tokens; a draft whose decode width
//!   differs is head-sliced per token.

use crate::block::{Block, Run};
use crate::error::PlanError;
use crate::head_slice::RunOut;
use crate::index_runs::{IndexRuns, add, addr, mul, page, signed, u64_of};
use crate::layout::{PeerRegistration, PrefillLayout};
use crate::pairing::{Entry, flat_pp_positions, pair_by_layer_ids};

/// A draft entry of the relayout.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum DraftEntry {
    /// Same token width on both sides: row runs like a target entry.
    Whole(Entry),
    /// Different widths: one block of `copy` bytes per token.
    Sliced {
        /// Prefill buffer base plus the slice offset.
        src: u64,
        /// Decode buffer base plus the slice offset.
        dst: u64,
        /// Prefill bytes per token row.
        src_width: u64,
        /// Decode bytes per token row.
        dst_width: u64,
        /// Bytes copied per token.
        copy: u64,
    },
}

/// Prepared relayout, fixed per peer. Entry problems that the reference only
/// hits when a chunk actually has target (or draft) tokens are kept as deferred
/// results.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct DcpRelayout {
    /// Decode DCP size.
    pub dcp_size: u64,
    /// Decode DCP rank.
    pub dcp_rank: u64,
    /// Number of draft entries.
    pub num_draft: u64,
    /// Target entries with their token widths.
    pub target: Result<Vec<Entry>, PlanError>,
    /// Draft entries.
    pub draft: Result<Vec<DraftEntry>, PlanError>,
}

/// Maps entries and prepares the target and draft entry lists.
pub(crate) fn prepare_dcp(
    layout: &PrefillLayout,
    reg: &PeerRegistration,
    widths: &[u64],
) -> Result<DcpRelayout, PlanError> {
    let src = &layout.kv_data_ptrs;
    let dst = &reg.dst_kv_ptrs;
    let dst_lens_in = &reg.dst_kv_item_lens;
    if !dst_lens_in.is_empty() && dst_lens_in.len() != dst.len() {
        return Err(PlanError::DstKvItemLensLength {
            lens: dst_lens_in.len(),
            ptrs: dst.len(),
        });
    }
    let (dst_mapped, dst_lens): (Vec<u64>, Vec<u64>) =
        if !layout.kv_layer_ids.is_empty() || !reg.dst_kv_layer_ids.is_empty() {
            // `resolve_dcp_dst_entry_indices`: pairing without positional fallback.
            let mut pairs = Vec::new();
            pair_by_layer_ids(
                &layout.kv_layer_ids,
                &reg.dst_kv_layer_ids,
                src.len(),
                dst.len(),
                false,
                &mut pairs,
            )?;
            let mapped = pairs.iter().map(|&(_, j)| dst[j]).collect();
            let lens = if dst_lens_in.is_empty() {
                Vec::new()
            } else {
                pairs.iter().map(|&(_, j)| dst_lens_in[j]).collect()
            };
            (mapped, lens)
        } else {
            let start = layout.prefill_start_layer;
            let nd = layout.num_draft_entries;
            let mapped = flat_pp_positions(src.len(), dst.len(), start, nd)
                .into_iter()
                .map(|j| dst[j])
                .collect();
            let lens = if dst_lens_in.is_empty() {
                Vec::new()
            } else {
                // The reference slices the length list against the prefill's
                // *length* list, exactly like the pointers.
                flat_pp_positions(layout.kv_item_lens.len(), dst_lens_in.len(), start, nd)
                    .into_iter()
                    .map(|j| dst_lens_in[j])
                    .collect()
            };
            (mapped, lens)
        };

    let n = src.len();
    let nd = usize::try_from(layout.num_draft_entries).unwrap_or(usize::MAX);
    let nt = n.saturating_sub(nd);
    let width = |e: usize| -> Result<u64, PlanError> {
        widths.get(e).copied().ok_or(PlanError::MissingItemLen {
            what: "kv_item_lens",
            entry: e,
        })
    };
    let dst_of = |e: usize| -> Result<u64, PlanError> {
        dst_mapped
            .get(e)
            .copied()
            .ok_or(PlanError::DcpEntryOutOfRange {
                entry: e,
                dst_entries: dst_mapped.len(),
            })
    };

    let target = (0..nt)
        .map(|e| {
            Ok(Entry {
                src: src[e],
                dst: dst_of(e)?,
                item_len: width(e)?,
            })
        })
        .collect::<Result<Vec<_>, PlanError>>();

    let draft = (|| -> Result<Vec<DraftEntry>, PlanError> {
        if nd == 0 {
            return Ok(Vec::new());
        }
        let p = layout.attn_tp_size;
        let d_size = reg.dst_attn_tp_size;
        if dst_lens.is_empty() && d_size != p {
            return Err(PlanError::DraftTpWithoutItemLens);
        }
        let vpage = mul(layout.page_size, reg.dst_dcp_size)?;
        let mut out = Vec::with_capacity(nd);
        let end = n.min(nt.saturating_add(nd));
        for (e, &src_ptr) in src.iter().enumerate().take(end).skip(nt) {
            let sw = width(e)?;
            let dw = if dst_lens.is_empty() {
                sw
            } else {
                let l = *dst_lens.get(e).ok_or(PlanError::MissingItemLen {
                    what: "dst_kv_item_lens",
                    entry: e,
                })?;
                let (q, rem) = (l / vpage, l % vpage);
                if rem != 0 || q == 0 {
                    return Err(PlanError::DraftWidthInvalid { entry: e });
                }
                q
            };
            if sw == dw {
                out.push(DraftEntry::Whole(Entry {
                    src: src_ptr,
                    dst: dst_of(e)?,
                    item_len: sw,
                }));
                continue;
            }
            if layout.is_mla_backend {
                return Err(PlanError::DraftHeadSlicingOnMla);
            }
            let copy = sw.min(dw);
            if copy == 0 || sw.max(dw) % copy != 0 {
                return Err(PlanError::DraftShardsNotDivisible { src: sw, dst: dw });
            }
            let src_span = mul(sw, p)?;
            let dst_span = mul(dw, d_size)?;
            let src_rank = layout.attn_tp_rank() / (src_span / dst_span).max(1);
            let dst_rank = reg.dst_tp_rank / (dst_span / src_span).max(1);
            let src_off = mul(dst_rank, dw)? % sw;
            let dst_off = mul(src_rank, sw)? % dw;
            out.push(DraftEntry::Sliced {
                src: add(src_ptr, src_off)?,
                dst: add(dst_of(e)?, dst_off)?,
                src_width: sw,
                dst_width: dw,
                copy,
            });
        }
        Ok(out)
    })();

    Ok(DcpRelayout {
        dcp_size: reg.dst_dcp_size,
        dcp_rank: reg.dst_dcp_rank,
        num_draft: layout.num_draft_entries,
        target,
        draft,
    })
}

/// Per-chunk inputs of the relayout.
#[derive(Debug, Clone, Copy)]
pub(crate) struct DcpChunk<'a> {
    /// Prefill physical pages of the chunk.
    pub pages: &'a [i32],
    /// Decode virtual pages of the whole request.
    pub vpages: &'a [i32],
    /// Position of the chunk's first page in the request.
    pub page_offset: u64,
    /// Tokens the decode already holds.
    pub prefix: u64,
    /// Tokens in the chunk.
    pub num_kv_tokens: Option<u64>,
    /// Prefill tokens per page.
    pub page_size: u64,
    /// `max_transfer_batch_indices` (sliced-draft batch size; 0 = 4096).
    pub max_batch: u64,
}

impl DcpRelayout {
    /// Appends the relayout's blocks: target and whole-width draft entries in
    /// one batch, then sliced draft entries in token batches. With
    /// `strided`, the target tokens go there as strided [`Run`]s instead
    /// (every `dcp_size`-th source row into consecutive decode rows: one
    /// descriptor per page run rather than one per token, what sglang gets
    /// by packing the rows into a buffer first).
    pub(crate) fn emit(
        &self,
        c: &DcpChunk<'_>,
        runs: &mut IndexRuns,
        out: &mut Vec<Block>,
        batch_ends: &mut Vec<usize>,
        strided: Option<&mut RunOut>,
    ) -> Result<(), PlanError> {
        let n_tokens = c.num_kv_tokens.ok_or(PlanError::MissingNumKvTokens)?;
        let ps = c.page_size;
        let dcp = self.dcp_size;
        let vpage = mul(ps, dcp)?;
        if !c.prefix.is_multiple_of(vpage) {
            return Err(PlanError::MisalignedDecodePrefix {
                prefix: c.prefix,
                virtual_page: vpage,
            });
        }
        if n_tokens == 0 {
            return Ok(());
        }
        let base = mul(c.page_offset, ps)?; // request-local token of the chunk's first token
        let last = n_tokens - 1;
        // Every index the reference looks up; the target tokens use a subset
        // ((base + t) / dcp / ps == (base + t) / vpage).
        let last_src_pos = last / ps;
        if last_src_pos >= u64_of(c.pages.len()) {
            return Err(PlanError::DcpIndexOutOfRange {
                what: "prefill",
                index: last_src_pos,
                len: c.pages.len(),
            });
        }
        let first_dst_pos = base / vpage;
        let last_dst_pos = add(base, last)? / vpage;
        if last_dst_pos >= u64_of(c.vpages.len()) {
            return Err(PlanError::DcpIndexOutOfRange {
                what: "decode",
                index: last_dst_pos,
                len: c.vpages.len(),
            });
        }
        // Both ranges are in bounds (checked above), so these conversions hold.
        let src_used = &c.pages[..=usize::try_from(last_src_pos).unwrap_or(0)];
        let dst_used = &c.vpages[usize::try_from(first_dst_pos).unwrap_or(0)
            ..=usize::try_from(last_dst_pos).unwrap_or(0)];
        let mut max_src_page = 0;
        for &p in src_used {
            max_src_page = max_src_page.max(page(p, "prefill_kv_indices")?);
        }
        let mut max_dst_page = 0;
        for &p in dst_used {
            max_dst_page = max_dst_page.max(page(p, "dst_kv_indices")?);
        }
        // Row numbers stay below (max page + 1) * page size: check once
        // (the reference computes rows in numpy int64).
        signed(mul(max_src_page + 1, ps)?, "prefill token row")?;
        signed(mul(max_dst_page + 1, vpage)?, "decode token row")?;
        let (pages, vpages) = (c.pages, c.vpages);

        // ---- target tokens: t = t0, t0 + dcp, ... ----
        // Their decode-local token (base + t) / dcp grows by exactly one per step.
        runs.clear();
        let t0 = (self.dcp_rank % dcp + dcp - (c.prefix % dcp + base % dcp) % dcp) % dcp;
        if let Some(out_runs) = strided {
            if t0 < n_tokens {
                self.emit_target_strided(c, t0, n_tokens, out_runs)?;
            }
        } else if t0 < n_tokens {
            let mut src = Cursor::at(t0, ps);
            let mut dst = Cursor::at((base + t0) / dcp, ps);
            let mut t = t0;
            loop {
                runs.push_pair(src.row(pages), dst.row(vpages));
                t = match t.checked_add(dcp) {
                    Some(next) if next < n_tokens => next,
                    _ => break,
                };
                src.advance(dcp);
                dst.step();
            }
        }
        runs.finish();
        if !runs.runs.is_empty() {
            let target = self.target.as_ref().map_err(Clone::clone)?;
            crate::kv::emit_entries_runs(target, runs, out)?;
        }

        // ---- draft tokens: every t, virtual pages ----
        if self.num_draft > 0 {
            let draft = self.draft.as_ref().map_err(Clone::clone)?;
            runs.clear();
            let (mut src, mut dst) = (Cursor::at(0, ps), Cursor::at(base, vpage));
            for _ in 0..n_tokens {
                runs.push_pair(src.row(pages), dst.row(vpages));
                src.step();
                dst.step();
            }
            runs.finish();
            let mut whole = Vec::new();
            whole.extend(draft.iter().filter_map(|d| match d {
                DraftEntry::Whole(e) => Some(*e),
                DraftEntry::Sliced { .. } => None,
            }));
            crate::kv::emit_entries_runs(&whole, runs, out)?;
            batch_ends.push(out.len());

            let sliced = draft.iter().any(|d| matches!(d, DraftEntry::Sliced { .. }));
            if sliced {
                let max_srow = runs.runs.iter().map(|r| r.a + r.n - 1).max().unwrap_or(0);
                let max_drow = runs.runs.iter().map(|r| r.b + r.n - 1).max().unwrap_or(0);
                for d in draft {
                    if let DraftEntry::Sliced {
                        src,
                        dst,
                        src_width,
                        dst_width,
                        ..
                    } = *d
                    {
                        // numpy int64 in the reference.
                        signed(src, "prefill draft address")?;
                        signed(dst, "decode draft address")?;
                        signed(addr(src, max_srow, src_width)?, "prefill draft address")?;
                        signed(addr(dst, max_drow, dst_width)?, "decode draft address")?;
                    }
                }
                // One engine call per token batch, every sliced entry in it.
                let batch = if c.max_batch == 0 { 4096 } else { c.max_batch };
                let mut start = 0;
                while start < n_tokens {
                    let end = start.saturating_add(batch).min(n_tokens);
                    for d in draft {
                        if let DraftEntry::Sliced {
                            src,
                            dst,
                            src_width,
                            dst_width,
                            copy,
                        } = *d
                        {
                            let mut sc = Cursor::at(start, ps);
                            let mut dc = Cursor::at(base + start, vpage);
                            out.extend((start..end).map(|_| {
                                let blk = Block {
                                    src: src.wrapping_add(sc.row(pages).wrapping_mul(src_width)),
                                    dst: dst.wrapping_add(dc.row(vpages).wrapping_mul(dst_width)),
                                    len: copy,
                                };
                                sc.step();
                                dc.step();
                                blk
                            }));
                        }
                    }
                    batch_ends.push(out.len());
                    start = end;
                }
            }
        } else {
            batch_ends.push(out.len());
        }
        Ok(())
    }
}

impl DcpRelayout {
    /// The target tokens `t0, t0 + dcp, ...` as strided runs: maximal
    /// sequences whose source rows step by `dcp_size` and decode rows by one
    /// (across page boundaries when the page numbers follow on), one run per
    /// sequence and target entry.
    fn emit_target_strided(
        &self,
        c: &DcpChunk<'_>,
        t0: u64,
        n_tokens: u64,
        out: &mut RunOut,
    ) -> Result<(), PlanError> {
        let dcp = self.dcp_size;
        let base = mul(c.page_offset, c.page_size)?;
        let mut src = Cursor::at(t0, c.page_size);
        let mut dst = Cursor::at((base + t0) / dcp, c.page_size);
        // (first source row, first decode row, tokens)
        let mut seqs: Vec<(u64, u64, u64)> = Vec::new();
        let mut t = t0;
        loop {
            let (s, d) = (src.row(c.pages), dst.row(c.vpages));
            match seqs.last_mut() {
                Some((s0, d0, n)) if s == *s0 + *n * dcp && d == *d0 + *n => *n += 1,
                _ => seqs.push((s, d, 1)),
            }
            t = match t.checked_add(dcp) {
                Some(next) if next < n_tokens => next,
                _ => break,
            };
            src.advance(dcp);
            dst.step();
        }
        let target = self.target.as_ref().map_err(Clone::clone)?;
        for e in target {
            let w = e.item_len;
            if w == 0 {
                continue;
            }
            let src_stride = mul(dcp, w)?;
            for &(s0, d0, n) in &seqs {
                // The last copy's rows were checked to fit (emit's row checks).
                out.runs.push(Run {
                    src: addr(e.src, s0, w)?,
                    dst: addr(e.dst, d0, w)?,
                    len: w,
                    count: n,
                    src_stride,
                    dst_stride: w,
                });
            }
        }
        out.ends.push(out.runs.len());
        Ok(())
    }
}

/// A token position as (page position, offset in page), advanced without
/// division. Rows are only read for positions validated against the page
/// list, so `row` never indexes past it.
#[derive(Debug, Clone, Copy)]
struct Cursor {
    idx: usize,
    off: u64,
    size: u64,
}

impl Cursor {
    /// The cursor at token `pos` of pages of `size` tokens.
    fn at(pos: u64, size: u64) -> Self {
        Cursor {
            idx: usize::try_from(pos / size).unwrap_or(usize::MAX),
            off: pos % size,
            size,
        }
    }

    /// Next token.
    #[inline]
    fn step(&mut self) {
        self.off += 1;
        if self.off == self.size {
            self.off = 0;
            self.idx = self.idx.wrapping_add(1);
        }
    }

    /// `n` tokens further.
    #[inline]
    fn advance(&mut self, n: u64) {
        self.off += n;
        while self.off >= self.size {
            self.off -= self.size;
            self.idx = self.idx.wrapping_add(1);
        }
    }

    /// The row (page · size + offset) of the current token.
    #[inline]
    fn row(&self, pages: &[i32]) -> u64 {
        // Page values were validated non-negative and rows checked to fit.
        (pages[self.idx] as u64) * self.size + self.off
    }
}
