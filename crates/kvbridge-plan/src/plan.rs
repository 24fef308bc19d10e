//! The chunk planner: [`Planner::plan_chunk`] turns (layout, peer, request,
//! chunk) into a [`TransferPlan`], reusing its buffers across chunks.

use std::ops::Range;

use crate::aux::plan_aux;
use crate::block::{Block, Run, canonicalize};
use crate::dcp::DcpChunk;
use crate::error::CompressedMlaError;
use crate::error::PlanError;
use crate::head_slice::RunOut;
use crate::index_runs::{IndexRuns, py_slice};
use crate::kv::{emit_generic, emit_two_spaces};
use crate::layout::{PeerRegistration, PrefillLayout, TransferChunk, TransferRequest};
use crate::peer::{KvMode, PreparedPeer};
use crate::state::{StateScratch, plan_states};

/// Every block one chunk needs, as flat arrays: KV, state components (last
/// chunk only) and aux (last chunk only), each its own slice; with
/// [`Planner::set_strided_kv`], head-sliced KV as strided [`Run`]s instead.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TransferPlan {
    kv: Vec<Block>,
    kv_batch_ends: Vec<usize>,
    kv_runs: RunOut,
    state: Vec<Block>,
    state_ranges: Vec<(usize, Range<usize>)>,
    aux: Vec<Block>,
}

impl TransferPlan {
    fn clear(&mut self) {
        self.kv.clear();
        self.kv_batch_ends.clear();
        self.kv_runs.clear();
        self.state.clear();
        self.state_ranges.clear();
        self.aux.clear();
    }

    /// KV blocks.
    pub fn kv_blocks(&self) -> &[Block] {
        &self.kv
    }

    /// KV as strided runs (head slicing with [`Planner::set_strided_kv`];
    /// empty otherwise). Together with [`TransferPlan::kv_blocks`] they are
    /// the chunk's KV.
    pub fn kv_runs(&self) -> &[Run] {
        &self.kv_runs.runs
    }

    /// The KV runs in engine batches (one per buffer pair, as
    /// [`TransferPlan::kv_batches`] for blocks). Empty batches are skipped.
    pub fn kv_run_batches(&self) -> KvRunBatches<'_> {
        KvRunBatches {
            runs: &self.kv_runs.runs,
            ends: &self.kv_runs.ends,
            start: 0,
        }
    }

    /// State-component blocks (all components, in `state_types` order).
    pub fn state_blocks(&self) -> &[Block] {
        &self.state
    }

    /// Aux blocks.
    pub fn aux_blocks(&self) -> &[Block] {
        &self.aux
    }

    /// The KV blocks in the batches the reference hands to its engine, one
    /// engine call per slice: index batches of `max_transfer_batch_indices`
    /// pages for the page copy, one batch per buffer pair for head slicing, and
    /// for the DCP relayout one batch of row runs followed by token batches of
    /// the sliced draft. Empty batches are skipped.
    pub fn kv_batches(&self) -> KvBatches<'_> {
        KvBatches {
            blocks: &self.kv,
            ends: &self.kv_batch_ends,
            start: 0,
        }
    }

    /// The KV blocks in batches of at most `max_blocks` blocks (each of the
    /// reference's batches split further where it is longer). `max_blocks == 0`
    /// is taken as 1.
    pub fn kv_batches_capped(&self, max_blocks: usize) -> impl Iterator<Item = &[Block]> {
        let cap = max_blocks.max(1);
        self.kv_batches().flat_map(move |b| b.chunks(cap))
    }

    /// State blocks per component: `(component index, blocks)`, only for
    /// components that produced blocks.
    pub fn state_components(&self) -> impl Iterator<Item = (usize, &[Block])> {
        self.state_ranges
            .iter()
            .map(|(c, r)| (*c, &self.state[r.clone()]))
    }

    /// KV (runs expanded), then state, then aux blocks.
    pub fn blocks(&self) -> impl Iterator<Item = Block> + '_ {
        self.kv
            .iter()
            .copied()
            .chain(self.kv_runs.runs.iter().flat_map(Run::blocks))
            .chain(self.state.iter().copied())
            .chain(self.aux.iter().copied())
    }

    /// Number of blocks of all three kinds (each copy of a run counted).
    pub fn block_count(&self) -> usize {
        let in_runs: u64 = self.kv_runs.runs.iter().map(|r| r.count).sum();
        self.kv.len()
            + usize::try_from(in_runs).unwrap_or(usize::MAX)
            + self.state.len()
            + self.aux.len()
    }

    /// Whether the plan moves nothing.
    pub fn is_empty(&self) -> bool {
        self.block_count() == 0
    }

    /// Bytes moved by all blocks.
    pub fn total_bytes(&self) -> u128 {
        self.blocks().map(|b| u128::from(b.len)).sum()
    }

    /// All blocks in one vector (KV, state, aux).
    pub fn to_vec(&self) -> Vec<Block> {
        let mut v = Vec::with_capacity(self.block_count());
        v.extend(self.blocks());
        v
    }

    /// The canonical form of all blocks (docs/plan-scenario.md §2).
    pub fn canonical(&self) -> Vec<Block> {
        canonicalize(&self.to_vec())
    }
}

/// Iterator over the KV batches of a [`TransferPlan`].
#[derive(Debug, Clone)]
pub struct KvBatches<'a> {
    blocks: &'a [Block],
    ends: &'a [usize],
    start: usize,
}

impl<'a> Iterator for KvBatches<'a> {
    type Item = &'a [Block];

    fn next(&mut self) -> Option<&'a [Block]> {
        while let Some((&end, rest)) = self.ends.split_first() {
            self.ends = rest;
            let start = self.start;
            self.start = end;
            if end > start {
                return self.blocks.get(start..end);
            }
        }
        // Anything not covered by a recorded batch (never, by construction).
        if self.start < self.blocks.len() {
            let start = self.start;
            self.start = self.blocks.len();
            return self.blocks.get(start..);
        }
        None
    }
}

/// Iterator over the KV run batches of a [`TransferPlan`].
#[derive(Debug, Clone)]
pub struct KvRunBatches<'a> {
    runs: &'a [Run],
    ends: &'a [usize],
    start: usize,
}

impl<'a> Iterator for KvRunBatches<'a> {
    type Item = &'a [Run];

    fn next(&mut self) -> Option<&'a [Run]> {
        while let Some((&end, rest)) = self.ends.split_first() {
            self.ends = rest;
            let start = self.start;
            self.start = end;
            if end > start {
                return self.runs.get(start..end);
            }
        }
        None
    }
}

/// Plans chunks, reusing its block and scratch buffers from one chunk to the
/// next. One per worker thread; allocation free once the buffers have grown to
/// the largest chunk. Planning runs on the calling thread, except that a plan
/// of a million blocks or more (per-token head slices) is written on up to
/// [`Planner::set_threads`] scoped threads, with the same result.
#[derive(Debug)]
pub struct Planner {
    plan: TransferPlan,
    runs: IndexRuns,
    /// Runs into HiSparse's device page space.
    device_runs: IndexRuns,
    state: StateScratch,
    strided: bool,
    /// Threads one multi-million-block plan may be written with.
    threads: usize,
}

impl Planner {
    /// An empty planner that may write a large plan on as many threads as
    /// this process has cores (at most 8).
    pub fn new() -> Self {
        Planner {
            plan: TransferPlan::default(),
            runs: IndexRuns::default(),
            device_runs: IndexRuns::default(),
            state: StateScratch::default(),
            strided: false,
            threads: crate::fill::default_threads(),
        }
    }

    /// Caps the threads one large plan is written with (1: the calling
    /// thread only). The plan is the same for every setting.
    pub fn set_threads(&mut self, threads: usize) {
        self.threads = threads.max(1);
    }

    /// Plans one chunk of one request for one decode peer: every block the
    /// reference's `transfer_worker` would hand to its engine, or its
    /// rejection. On error the planner holds no plan (never a partial one).
    ///
    /// `peer` must have been prepared with this `layout`.
    pub fn plan_chunk(
        &mut self,
        layout: &PrefillLayout,
        peer: &PreparedPeer,
        request: &TransferRequest,
        chunk: &TransferChunk,
    ) -> Result<&TransferPlan, PlanError> {
        self.plan.clear();
        match self.fill(layout, peer, request, chunk) {
            Ok(()) => Ok(&self.plan),
            Err(e) => {
                self.plan.clear();
                Err(e)
            }
        }
    }

    /// Plan head-sliced KV as strided runs (one per page run: a token
    /// slice at the token strides) instead of one block per token, for
    /// engines that copy runs natively. Off by default (the scenario
    /// format's block lists); the expanded runs equal the blocks either way.
    pub fn set_strided_kv(&mut self, on: bool) {
        self.strided = on;
    }

    /// Releases buffer memory beyond `max_blocks` blocks (the planner keeps
    /// the capacity of its largest plan otherwise). Also clears the plan.
    pub fn shrink_to(&mut self, max_blocks: usize) {
        self.plan.clear();
        self.plan.kv.shrink_to(max_blocks);
        self.plan.state.shrink_to(max_blocks);
        self.plan.aux.shrink_to(max_blocks);
        self.plan.kv_batch_ends.shrink_to(max_blocks);
        self.plan.kv_runs.runs.shrink_to(max_blocks);
        self.plan.kv_runs.ends.shrink_to(max_blocks);
        self.runs.clear();
        self.runs.runs.shrink_to(max_blocks);
        self.state.runs.clear();
        self.state.runs.runs.shrink_to(max_blocks);
    }

    /// The plan of the last successful [`Planner::plan_chunk`] (empty after an error).
    pub fn plan(&self) -> &TransferPlan {
        &self.plan
    }

    fn fill(
        &mut self,
        layout: &PrefillLayout,
        peer: &PreparedPeer,
        request: &TransferRequest,
        chunk: &TransferChunk,
    ) -> Result<(), PlanError> {
        // The peer was prepared (and these checked) with this layout; a
        // different one must still not divide by zero.
        for (v, field) in [
            (layout.attn_tp_size, "attn_tp_size"),
            (layout.pp_size, "pp_size"),
            (layout.page_size, "page_size"),
        ] {
            if v == 0 {
                return Err(PlanError::ZeroSize { field });
            }
        }
        let reg: &PeerRegistration = peer.registration();
        let all_src = chunk.prefill_kv_indices.as_slice();
        let (src_pages, dst_pages): (&[i32], &[i32]) = if peer.requires_dcp_relayout() {
            (all_src, &request.dst_kv_indices)
        } else {
            let start = i128::from(chunk.index_slice_start);
            let end = chunk
                .index_slice_end
                .map_or(start + all_src.len() as i128, i128::from);
            let dst_chunk =
                &request.dst_kv_indices[py_slice(request.dst_kv_indices.len(), start, end)];
            (&all_src[..all_src.len().min(dst_chunk.len())], dst_chunk)
        };

        // HiSparse: the chunk's pages in the decode's device page space, cut
        // like dst_kv_indices and then to the prefill pages.
        let device_pages = match request.dst_device_kv_indices.as_deref() {
            None | Some([]) => None,
            Some(_) if layout.mla_compression_ratios.is_none() => {
                return Err(CompressedMlaError::DeviceWithoutCompression.into());
            }
            Some(_) if peer.requires_dcp_relayout() => {
                return Err(CompressedMlaError::DeviceWithDcp.into());
            }
            Some(all) => {
                let start = i128::from(chunk.index_slice_start);
                let end = chunk
                    .index_slice_end
                    .map_or(start + all_src.len() as i128, i128::from);
                let dev = &all[py_slice(all.len(), start, end)];
                if dev.len() < src_pages.len() {
                    return Err(CompressedMlaError::DeviceIndicesShort {
                        device: dev.len(),
                        pages: src_pages.len(),
                    }
                    .into());
                }
                Some(&dev[..src_pages.len()])
            }
        };
        let plan = &mut self.plan;
        if !src_pages.is_empty() && !layout.kv_data_ptrs.is_empty() && !peer.skips_kv() {
            match peer.kv_mode()? {
                KvMode::PageCopy(pc) if device_pages.is_some() => emit_two_spaces(
                    &pc.entries,
                    &pc.device,
                    src_pages,
                    dst_pages,
                    device_pages.unwrap_or(&[]),
                    layout.max_transfer_batch_indices,
                    (&mut self.runs, &mut self.device_runs),
                    &mut plan.kv,
                    &mut plan.kv_batch_ends,
                )?,
                KvMode::PageCopy(pc) => emit_generic(
                    &pc.entries,
                    src_pages,
                    dst_pages,
                    layout.max_transfer_batch_indices,
                    &mut self.runs,
                    &mut plan.kv,
                    &mut plan.kv_batch_ends,
                    ("prefill_kv_indices", "dst_kv_indices"),
                )?,
                KvMode::HeadSlice(hs) => {
                    let runs = self.strided.then_some(&mut plan.kv_runs);
                    hs.emit(
                        src_pages,
                        dst_pages,
                        &mut plan.kv,
                        &mut plan.kv_batch_ends,
                        runs,
                        self.threads,
                    )?;
                }
                KvMode::Dcp(dcp) => dcp.emit(
                    &DcpChunk {
                        pages: src_pages,
                        vpages: dst_pages,
                        page_offset: chunk.index_slice_start,
                        prefix: request.decode_prefix_len.unwrap_or(0),
                        num_kv_tokens: chunk.num_kv_tokens,
                        page_size: layout.page_size,
                        max_batch: layout.max_transfer_batch_indices,
                    },
                    &mut self.runs,
                    &mut plan.kv,
                    &mut plan.kv_batch_ends,
                    self.strided.then_some(&mut plan.kv_runs),
                )?,
            }
        }

        if chunk.is_last_chunk {
            if let Some(state_indices) = &chunk.state_indices
                && !state_indices.is_empty()
            {
                plan_states(
                    layout,
                    reg,
                    request,
                    state_indices,
                    &mut self.state,
                    &mut plan.state,
                    &mut plan.state_ranges,
                )?;
            }
            plan_aux(
                layout,
                reg,
                chunk.prefill_aux_index,
                request.dst_aux_index,
                &mut plan.aux,
            )?;
        }
        Ok(())
    }
}

/// Prepares `registration` and plans one chunk with a fresh planner: the
/// one-shot form of [`PreparedPeer::new`] + [`Planner::plan_chunk`].
pub fn plan_once(
    layout: &PrefillLayout,
    registration: PeerRegistration,
    request: &TransferRequest,
    chunk: &TransferChunk,
) -> Result<TransferPlan, PlanError> {
    let peer = PreparedPeer::new(layout, registration)?;
    let mut planner = Planner::new();
    planner.plan_chunk(layout, &peer, request, chunk)?;
    Ok(std::mem::take(&mut planner.plan))
}

impl Default for Planner {
    fn default() -> Self {
        Planner::new()
    }
}
