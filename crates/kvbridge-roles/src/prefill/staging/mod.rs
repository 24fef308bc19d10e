//! The prefill side of staging (the reference's `_do_staging_transfer`,
//! `send_kvcache_staged`, `_prefetch_staging_reqs`): for a decode rank of
//! another TP size that registered a staging ring, a room's pages go in
//! chunks of `chunk_pages` (the reference's grid): each chunk's head
//! slices are gathered into the worker's buffer, written with one bulk
//! write per piece into the allocation the decode answered, and announced
//! with `CHUNK_READY`, after which the decode scatters it.
//!
//! **Owns:** the per-worker gather buffers, asking for allocations as soon
//! as a room's destinations are known (`STAGING_REQ`), grouping a room's
//! pages into grid chunks, waiting (bounded, never blocking other rooms)
//! for an allocation and for ring space (the watermark), and the order
//! write → `CHUNK_READY`.
//! **Never:** writes an allocation the watermark has not released, writes
//! outside the allocation the decode answered, or sends `CHUNK_READY`
//! before its bytes are written.

pub(super) mod ledger;
mod writes;

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvbridge_engine::TransferEngine;
use kvbridge_mem::RegionRegistry;
use kvbridge_plan::{Run, watermark_ready};
use kvbridge_wire::{ChunkReady, StagingReq};

use super::Shared;
pub(crate) use super::state::StagingDest;
use super::state::{PeerEntry, TransferInfo};
use crate::config::{STAGING_SLOTS, StagingConfig};
use crate::error::ConfigError;
use crate::kv_args::KvArgs;
use crate::staging_mem::{StagingMemory, staging_wanted};

/// `STAGING_RSP` offset for a chunk larger than the whole ring.
const ALLOC_OVERSIZED: i64 = -2;

/// The prefill's staging memory: one gather buffer per transfer worker,
/// where the KV pool lives (host memory, or the same GPU).
#[derive(Debug)]
pub(crate) struct PrefillStaging {
    buffers: Vec<StagingMemory>,
    /// Pages per staging chunk.
    pub chunk_pages: u64,
    /// Longest a chunk waits for its allocation or ring space.
    pub wait_timeout: Duration,
}

impl PrefillStaging {
    /// Gather buffers for `workers` workers, or `None` where staging is off
    /// or cannot apply (MLA, the intra-node transport).
    pub fn new(
        config: &StagingConfig,
        kv_args: &KvArgs,
        workers: usize,
        intra: bool,
        engine: &dyn TransferEngine,
    ) -> Result<Option<Self>, ConfigError> {
        if !staging_wanted(config, engine, kv_args, "prefill") {
            return Ok(None);
        }
        let layout = &kv_args.layout;
        if layout.is_any_mla() || intra {
            tracing::info!(
                mla = layout.is_any_mla(),
                intra,
                "staging enabled but this rank copies whole pages or runs on the GPU: no gather buffers"
            );
            return Ok(None);
        }
        let chunk_pages = config.chunk_pages(layout.page_size);
        // A slot holds at least one KV buffer's worth of a whole chunk (one
        // staging layer), so a piece never needs less than one slot.
        let layer = layout
            .kv_item_lens
            .iter()
            .max()
            .copied()
            .unwrap_or(0)
            .saturating_mul(chunk_pages);
        let slot = (config.buffer_bytes / STAGING_SLOTS).max(layer).max(4096);
        let bytes = slot.saturating_mul(STAGING_SLOTS);
        let bytes = usize::try_from(bytes)
            .map_err(|_| ConfigError::Setting(format!("a {bytes}-byte gather buffer")))?;
        let buffers = (0..workers)
            .map(|_| StagingMemory::new(kv_args, bytes))
            .collect::<Result<Vec<_>, _>>()?;
        let device = buffers.first().is_some_and(StagingMemory::is_device);
        tracing::info!(
            workers,
            bytes,
            chunk_pages,
            device,
            "staging gather buffers allocated"
        );
        Ok(Some(Self {
            buffers,
            chunk_pages,
            wait_timeout: config.wait_timeout,
        }))
    }

    /// Every buffer's `(address, length)`, for registration.
    pub fn regions(&self) -> Vec<(u64, u64)> {
        self.buffers.iter().map(StagingMemory::region).collect()
    }

    /// Runs worker `i`'s gather copies (checked against `registry`).
    pub fn copy_runs(
        &self,
        i: usize,
        registry: &RegionRegistry,
        runs: &[Run],
    ) -> Result<u64, String> {
        match self.buffers.get(i) {
            Some(m) => m.copy_runs(registry, runs),
            None => Err(format!("no gather buffer for transfer worker {i}")),
        }
    }

    /// Worker `i`'s gather slots, `(address, length)` each.
    pub fn slots(&self, i: usize) -> Vec<(u64, u64)> {
        let Some((addr, len)) = self.buffers.get(i).map(StagingMemory::region) else {
            return Vec::new();
        };
        let slot = len / STAGING_SLOTS;
        (0..STAGING_SLOTS)
            .map(|k| (addr + k * slot, slot))
            .collect()
    }
}

/// Asks every staging destination of a complete room for all its chunks'
/// allocations at once (the reference's prefetch), so the decode
/// allocates while the prefill computes.
pub(crate) fn prefetch(shared: &Shared, room: u64, infos: &[Arc<TransferInfo>]) {
    let Some(staging) = &shared.staging else {
        return;
    };
    let peers = shared.peers.read();
    for info in infos {
        let (Some(request), Some(entry)) = (&info.request, peers.get(&info.session)) else {
            continue;
        };
        if entry.staging.is_none() || entry.generation != info.registration {
            continue;
        }
        let total = request.dst_kv_indices.len() as u64;
        let g = staging.chunk_pages;
        for chunk in 0..total.div_ceil(g) {
            let message = StagingReq {
                room,
                chunk_idx: chunk,
                chunk_num_pages: g.min(total - chunk * g),
                session_id: info.session.as_str().into(),
                requester_pp_rank: Some(shared.config.rank.pp_rank),
            };
            let frames = crate::seal::seal(entry.pair_key.as_ref(), message.encode());
            if let Err(e) = shared
                .push
                .send(&info.zmq_endpoint(), frames.iter().map(|f| f.as_ref()))
            {
                tracing::warn!(room, chunk, error = %e, "cannot send STAGING_REQ");
            }
        }
    }
}

/// One grid chunk of a room to stage to one decode rank.
#[derive(Debug, Clone)]
pub(crate) struct StagedTask {
    /// The pipeline chunk (ticket) it belongs to.
    pub ticket: u64,
    pub room: u64,
    pub info: Arc<TransferInfo>,
    pub entry: Arc<PeerEntry>,
    pub chunk_idx: u64,
    /// First page of the chunk in the room's destination pages.
    pub page_start: u64,
    /// Our pages of the chunk.
    pub pages: Arc<Vec<i32>>,
    /// When waiting for the allocation or ring space gives up.
    pub deadline: Instant,
}

/// One whole grid chunk of a room: its index, first destination page and
/// our pages.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct GridChunk {
    pub index: u64,
    pub page_start: u64,
    pub pages: Arc<Vec<i32>>,
}

/// A room's pages not yet staged (an incomplete grid chunk).
#[derive(Debug, Default)]
pub(crate) struct Pending {
    /// First destination page of the held pages.
    start: u64,
    pages: Vec<i32>,
}

/// Groups each room's pages into grid chunks across `send` calls.
#[derive(Debug, Default)]
pub(crate) struct Grid {
    pending: HashMap<u64, Pending>,
}

impl Grid {
    /// Adds a chunk's pages (`start`: its first destination page); returns
    /// the grid chunks now complete, the held rest too when `last`. `Err`
    /// when the pages do not follow the ones held.
    pub fn add(
        &mut self,
        room: u64,
        start: u64,
        pages: &[i32],
        last: bool,
        g: u64,
    ) -> Result<Vec<GridChunk>, String> {
        let p = self.pending.entry(room).or_insert_with(|| Pending {
            start,
            pages: Vec::new(),
        });
        if p.start + p.pages.len() as u64 != start {
            self.pending.remove(&room);
            return Err(format!(
                "room {room}: a chunk starting at page {start} does not follow the pages sent \
                 before it (staging needs the room's pages in order)"
            ));
        }
        p.pages.extend_from_slice(pages);
        let mut out = Vec::new();
        loop {
            let boundary = (p.start / g + 1) * g;
            let end = p.start + p.pages.len() as u64;
            if end < boundary && !(last && end > p.start) {
                break;
            }
            let take = (boundary.min(end) - p.start) as usize;
            let rest = p.pages.split_off(take);
            let chunk = std::mem::replace(&mut p.pages, rest);
            out.push(GridChunk {
                index: p.start / g,
                page_start: p.start,
                pages: Arc::new(chunk),
            });
            p.start += take as u64;
        }
        if last {
            self.pending.remove(&room);
        }
        Ok(out)
    }

    /// Forgets a room.
    pub fn forget(&mut self, room: u64) {
        self.pending.remove(&room);
    }
}

/// Whether a staged chunk may be written now.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Readiness {
    /// Its allocation `[offset, end)` is there and the watermark released it.
    Ready { offset: u64, end: u64 },
    /// Allocation or ring space not there yet: try again later.
    NotReady,
    /// Nothing to write: the room stopped, or failed now (with a reason).
    Dropped,
}

/// Whether `task` may be written now; fails its room (and answers
/// `Dropped`) past its deadline or when the decode cannot hold it.
pub(crate) fn check(shared: &Shared, task: &StagedTask) -> Readiness {
    let room = task.room;
    let session = task.info.session.as_str();
    let checked = shared.step(crate::prefill::room::Input::StagingCheck {
        room,
        session,
        chunk: task.chunk_idx,
    });
    let crate::prefill::room::Output::Staging(Some((alloc, watermark))) = checked else {
        return Readiness::Dropped;
    };
    let waited = shared
        .staging
        .as_ref()
        .map_or(0.0, |s| s.wait_timeout.as_secs_f64());
    let late = Instant::now() >= task.deadline;
    let (offset, round, end) = match alloc {
        None if late => {
            return fail(
                shared,
                task,
                format!(
                    "no staging allocation for chunk {} of room {room} from decode {} within \
                     {waited:.0}s (is SGLANG_DISAGG_STAGING_BUFFER set there?)",
                    task.chunk_idx,
                    task.info.host_port()
                ),
            );
        }
        None => return Readiness::NotReady,
        Some((o, _, _)) if o == ALLOC_OVERSIZED => {
            return fail(
                shared,
                task,
                format!(
                    "a staging chunk of room {room} exceeds decode {}'s staging ring; increase \
                     SGLANG_DISAGG_STAGING_POOL_SIZE_MB there or reduce the staging chunk size",
                    task.info.host_port()
                ),
            );
        }
        Some(a) => a,
    };
    if !watermark_ready(watermark, round, end) {
        if late {
            return fail(
                shared,
                task,
                format!(
                    "decode {}'s staging ring stayed full for {waited:.0}s (chunk {} of room {room})",
                    task.info.host_port(),
                    task.chunk_idx
                ),
            );
        }
        return Readiness::NotReady;
    }
    match (u64::try_from(offset), u64::try_from(end)) {
        (Ok(offset), Ok(end)) => Readiness::Ready { offset, end },
        _ => fail(
            shared,
            task,
            format!("decode answered a negative staging allocation for room {room}"),
        ),
    }
}

fn fail(shared: &Shared, task: &StagedTask, reason: String) -> Readiness {
    shared.metrics.failure("staging");
    shared.conclude(task.room, kvbridge_wire::KvPoll::Failed, None, Some(reason));
    Readiness::Dropped
}

/// One bulk write of a staged chunk: staging slots `slots` of our part,
/// `len` bytes to `dst` in the decode's ring.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Piece {
    pub slots: std::ops::Range<usize>,
    pub dst: u64,
    pub len: u64,
}

/// The bulk writes of `task` into its allocation `[offset, end)`, each at
/// most `cap` bytes (at least one staging slot each); `Err` with the
/// room's failure reason when the allocation cannot hold the chunk.
pub(crate) fn pieces(
    task: &StagedTask,
    offset: u64,
    end: u64,
    cap: u64,
) -> Result<Vec<Piece>, String> {
    let room = task.room;
    let Some(dest) = task.entry.staging.as_ref() else {
        return Err(format!("room {room}: no staging ring at the decode"));
    };
    let source = &dest.source;
    let pages = task.pages.len() as u64;
    let plan_err = |e: kvbridge_plan::PlanError| format!("cannot plan staging of room {room}: {e}");
    let (part, total) = source.placement(pages).map_err(plan_err)?;
    let slot_bytes = source.slot_bytes(pages).map_err(plan_err)?;
    if end < offset || end - offset < total || end > dest.ring_size {
        return Err(format!(
            "decode's staging allocation [{offset}, {end}) for room {room} cannot hold the \
             chunk's {total} bytes inside its {}-byte ring",
            dest.ring_size
        ));
    }
    let per_piece = usize::try_from((cap / slot_bytes.max(1)).max(1)).unwrap_or(1);
    let slots = source.slot_count();
    let mut out = Vec::new();
    let mut first = 0usize;
    while first < slots {
        let last = (first + per_piece).min(slots);
        out.push(Piece {
            slots: first..last,
            dst: dest.ring_base + offset + part + slot_bytes * first as u64,
            len: slot_bytes * (last - first) as u64,
        });
        first = last;
    }
    Ok(out)
}

/// Gathers staging slots `slots` of `task` into worker `worker`'s buffer at `buf`.
pub(crate) fn gather(
    shared: &Shared,
    worker: usize,
    task: &StagedTask,
    slots: std::ops::Range<usize>,
    buf: u64,
) -> Result<(), String> {
    let room = task.room;
    let Some(dest) = task.entry.staging.as_ref() else {
        return Err(format!("room {room}: no staging ring at the decode"));
    };
    let mut runs: Vec<Run> = Vec::new();
    dest.source
        .gather(&task.pages, slots, buf, &mut runs)
        .map_err(|e| format!("cannot plan staging of room {room}: {e}"))?;
    let staging = shared
        .staging
        .as_ref()
        .ok_or_else(|| format!("room {room}: staging is off here"))?;
    let bytes = staging
        .copy_runs(worker, &shared.local.registry, &runs)
        .map_err(|e| format!("staging gather of room {room}: {e}"))?;
    shared.metrics.staged_bytes.inc_by(bytes);
    Ok(())
}

/// Tells the decode rank `task`'s chunk is written (`CHUNK_READY`), on the
/// socket its status follows on.
pub(crate) fn chunk_ready(shared: &Shared, task: &StagedTask) -> Result<(), String> {
    let ready = ChunkReady {
        room: task.room,
        chunk_idx: task.chunk_idx,
        page_start: task.page_start,
        num_pages: task.pages.len() as u64,
        session_id: task.info.session.as_str().into(),
        prefill_unique_rank: Some(shared.unique_rank),
    };
    let frames = crate::seal::seal(task.entry.pair_key.as_ref(), ready.encode());
    shared
        .push
        .send(&task.info.zmq_endpoint(), frames.iter().map(|f| f.as_ref()))
        .map_err(|e| format!("cannot send CHUNK_READY of room {}: {e}", task.room))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grid_groups_pages_across_sends() {
        let mut g = Grid::default();
        assert!(g.add(1, 0, &[10, 11, 12], false, 4).unwrap().is_empty());
        let out = g
            .add(1, 3, &[13, 14, 15, 16, 17, 18, 19, 20], false, 4)
            .unwrap();
        let got: Vec<_> = out
            .iter()
            .map(|c| (c.index, c.page_start, c.pages.to_vec()))
            .collect();
        assert_eq!(
            got,
            vec![(0, 0, vec![10, 11, 12, 13]), (1, 4, vec![14, 15, 16, 17])]
        );
        let out = g.add(1, 11, &[21], true, 4).unwrap();
        let got: Vec<_> = out
            .iter()
            .map(|c| (c.index, c.page_start, c.pages.to_vec()))
            .collect();
        assert_eq!(got, vec![(2, 8, vec![18, 19, 20, 21])]);
        // A gap fails the room's staging; an empty last send flushes nothing.
        assert!(g.add(2, 0, &[1], false, 4).unwrap().is_empty());
        assert!(g.add(2, 5, &[2], false, 4).is_err());
        assert!(g.add(3, 0, &[], true, 4).unwrap().is_empty());
    }
}
