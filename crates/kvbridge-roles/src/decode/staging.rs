//! The decode side of staging (sglang `DecodeStagingHandler` and
//! `handle_staging_req`): a ring registered with the engine, an allocation
//! per `(room, chunk)` on `STAGING_REQ` answered with `STAGING_RSP`, the
//! scatter into the room's pages once every writer's `CHUNK_READY` is in,
//! and a `WATERMARK` to every prefill rank that asked whenever freeing
//! moves it.
//!
//! **Owns:** the ring memory and allocator, each room's chunk
//! allocations on its grid of `chunk_tokens` (sglang's chunked-prefill
//! size; a prefill cutting other chunks fails the room, by name), and the
//! rule that a room succeeds only once every allocated chunk is scattered.
//! **Never:** scatters into a room that takes no writes (aborted, failed,
//! cleared), or anywhere but the room's own pages, from the room's own
//! allocation, at the sizes it allocated; holds the rooms lock while it
//! copies (a room's `poll()` never waits for a scatter; its `clear()` and
//! abort ACKs do, so no scatter lands in pages handed back).

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use kvbridge_engine::TransferEngine;
use kvbridge_plan::{PrefillLayout, StagingTarget};
use kvbridge_wire::{ChunkReady, StagingReq, StagingRsp, Watermark};
use parking_lot::{Condvar, Mutex, RwLock};

use super::Shared;
use super::bound::{Bound, Writer, staging_writer};
use super::ring::{Allocation, Ring};
use crate::config::StagingConfig;
use crate::error::ConfigError;
use crate::kv_args::KvArgs;
use crate::staging_mem::{StagingMemory, staging_wanted};

/// `STAGING_RSP` offset for a chunk larger than the whole ring (sglang
/// `StagingAllocator.ALLOC_OVERSIZED`).
pub(crate) const ALLOC_OVERSIZED: i64 = -2;

/// Most chunks one room may hold allocations for.
const MAX_CHUNKS_PER_ROOM: usize = 1 << 16;

/// Most prefill endpoints that get watermark updates.
const MAX_SUBSCRIBERS: usize = 4096;

/// The ring and who hears about it.
#[derive(Debug)]
pub(crate) struct DecodeStaging {
    buffer: StagingMemory,
    ring: Mutex<Ring>,
    /// Prefill rank endpoints that asked for allocations.
    subscribers: Mutex<HashSet<String>>,
    /// Our KV layout with its head counts, once known: sglang's decode sets
    /// `KVArgs.kv_head_num` only after creating the manager, and hands it
    /// over with `set_kv_buffer_tensors` ([`DecodeStaging::set_heads`]).
    /// `None` until then: no ring is offered and rooms take the per-slice path.
    layout: RwLock<Option<Arc<PrefillLayout>>>,
    /// Whether the per-slice fallback for unknown heads was logged.
    heads_unknown_logged: AtomicBool,
    /// Called with the room before each scatter copies (tests only).
    scatter_hook: Mutex<Option<ScatterHook>>,
    /// Pages per staging chunk: our grid (sglang's chunked-prefill size).
    chunk_pages: u64,
    /// Scatters copying now, per room (outside the rooms lock).
    scattering: Mutex<HashMap<u64, usize>>,
    /// Signalled whenever a scatter ends.
    scatter_ended: Condvar,
}

/// A function called before each scatter (for tests that hold a scatter
/// in progress).
#[derive(Clone)]
pub(crate) struct ScatterHook(pub Arc<dyn Fn(u64) + Send + Sync>);

impl std::fmt::Debug for ScatterHook {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ScatterHook")
    }
}

impl DecodeStaging {
    /// The ring for `config` where the KV pool lives (host memory, or the
    /// same GPU), or `None` where staging is off or cannot apply (an MLA
    /// pool, the intra-node transport).
    pub fn new(
        config: &StagingConfig,
        kv_args: &KvArgs,
        intra: bool,
        engine: &dyn TransferEngine,
    ) -> Result<Option<Self>, ConfigError> {
        if !staging_wanted(config, engine, kv_args, "decode") {
            return Ok(None);
        }
        let layout = &kv_args.layout;
        if layout.is_any_mla() {
            tracing::info!("staging enabled but the KV pool is MLA (whole pages): no staging ring");
            return Ok(None);
        }
        if intra {
            tracing::info!(
                "staging enabled but the intra-node transport copies head slices itself: no staging ring"
            );
            return Ok(None);
        }
        let bytes = usize::try_from(config.pool_bytes)
            .ok()
            .filter(|b| *b > 0)
            .ok_or_else(|| {
                ConfigError::Setting(format!(
                    "a staging ring of {} bytes (SGLANG_DISAGG_STAGING_POOL_SIZE_MB) is not usable",
                    config.pool_bytes
                ))
            })?;
        let buffer = StagingMemory::new(kv_args, bytes)?;
        let (addr, _) = buffer.region();
        tracing::info!(
            bytes,
            addr = format_args!("{addr:#x}"),
            device = buffer.is_device(),
            "staging ring allocated"
        );
        // A head count of 0 is "not known yet" (sglang's decode sets it
        // after the manager exists).
        let known = (layout.kv_head_num > 0).then(|| Arc::new(layout.clone()));
        if known.is_none() {
            tracing::info!(
                "staging ring allocated but the KV head count is not known yet; staging starts \
                 once it is handed over (set_kv_buffer_tensors)"
            );
        }
        Ok(Some(Self {
            ring: Mutex::new(Ring::new(bytes as u64)),
            buffer,
            subscribers: Mutex::new(HashSet::new()),
            layout: RwLock::new(known),
            heads_unknown_logged: AtomicBool::new(false),
            scatter_hook: Mutex::new(None),
            chunk_pages: config.chunk_pages(layout.page_size),
            scattering: Mutex::new(HashMap::new()),
            scatter_ended: Condvar::new(),
        }))
    }

    /// Takes the KV head counts (`total_kv_head_num` 0: unknown, i.e.
    /// `kv_head_num` × TP) for staging from now on: rooms registered later
    /// stage, and the ring is offered to prefill servers registered with later.
    pub fn set_heads(
        &self,
        base: &PrefillLayout,
        kv_head_num: u64,
        total_kv_head_num: u64,
    ) -> Result<(), ConfigError> {
        check_heads(kv_head_num, total_kv_head_num)?;
        let layout = PrefillLayout {
            kv_head_num,
            total_kv_head_num,
            ..base.clone()
        };
        *self.layout.write() = Some(Arc::new(layout));
        tracing::info!(
            kv_head_num,
            total_kv_head_num,
            "KV head counts handed over; staging is usable"
        );
        Ok(())
    }

    /// Our layout with its head counts, or `None` (logged once, with the
    /// reason) while they are unknown.
    pub fn layout(&self, what: &str) -> Option<Arc<PrefillLayout>> {
        let layout = self.layout.read().clone();
        if layout.is_none() && !self.heads_unknown_logged.swap(true, Ordering::Relaxed) {
            tracing::warn!(
                what,
                "staging is on but the KV head count is unknown (sglang hands KVArgs.kv_head_num \
                 over with set_kv_buffer_tensors, which has not happened): the per-slice path \
                 is used until it is"
            );
        }
        layout
    }

    /// Sets (or with `None` removes) the function called before each scatter.
    pub fn set_scatter_hook(&self, hook: Option<ScatterHook>) {
        *self.scatter_hook.lock() = hook;
    }

    /// Whether a scatter into `room`'s pages is copying now.
    pub fn scattering(&self, room: u64) -> bool {
        self.scattering.lock().get(&room).is_some_and(|n| *n > 0)
    }

    /// Waits until no scatter copies into `room`'s pages (call without the
    /// rooms lock, which an ending scatter takes).
    pub fn wait_scatters(&self, room: u64) {
        let mut scattering = self.scattering.lock();
        while scattering.get(&room).is_some_and(|n| *n > 0) {
            let timed_out = self
                .scatter_ended
                .wait_for(&mut scattering, Duration::from_secs(5))
                .timed_out();
            if timed_out {
                tracing::warn!(
                    room,
                    "still waiting for a staging scatter into the room's pages"
                );
            }
        }
    }

    fn begin_scatter(&self, room: u64) {
        *self.scattering.lock().entry(room).or_default() += 1;
    }

    fn end_scatter(&self, room: u64) {
        let mut scattering = self.scattering.lock();
        if let Some(n) = scattering.get_mut(&room) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                scattering.remove(&room);
            }
        }
        self.scatter_ended.notify_all();
    }

    /// Allocations held.
    pub fn held(&self) -> usize {
        self.ring.lock().held()
    }

    /// The ring's memory, `(address, length)`, for registration.
    pub fn region(&self) -> (u64, u64) {
        self.buffer.region()
    }

    fn base(&self) -> u64 {
        self.buffer.region().0
    }
}

/// Refuses head counts that cannot describe a pool: no head on this rank,
/// or fewer heads in the model than on this rank (`total` 0: unknown).
pub(crate) fn check_heads(kv_head_num: u64, total_kv_head_num: u64) -> Result<(), ConfigError> {
    if kv_head_num == 0 {
        return Err(ConfigError::Layout(
            "kv_head_num must be at least 1 (KV heads on this rank)".into(),
        ));
    }
    if total_kv_head_num != 0 && total_kv_head_num < kv_head_num {
        return Err(ConfigError::Layout(format!(
            "total_kv_head_num {total_kv_head_num} is below kv_head_num {kv_head_num}"
        )));
    }
    Ok(())
}

/// Where a chunk's allocation stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum SlotState {
    /// Allocated, waiting for its writers.
    Held(Allocation),
    /// Every writer is in; its scatter is copying (outside the rooms lock).
    Scattering(Allocation),
    /// Larger than the whole ring.
    Oversized,
    /// Scattered into the pages and freed.
    Scattered,
}

/// One chunk's allocation in a room.
#[derive(Debug)]
struct ChunkSlot {
    state: SlotState,
    /// The chunk's first page in the room (its index × our grid).
    page_start: u64,
    /// Pages the allocation was sized for.
    pages: u64,
    /// Writers (prefill unique ranks) whose `CHUNK_READY` arrived.
    arrived: HashSet<u64>,
}

/// A room that receives through the staging ring.
#[derive(Debug)]
pub(crate) struct StagingRoom {
    target: Arc<StagingTarget>,
    /// `CHUNK_READY`s a chunk waits for: one per prefill TP writer and
    /// pipeline stage (each stage writes its own layers' slots).
    writers: u64,
    /// The room's destination pages, as sent to the prefill.
    pages: Vec<i32>,
    /// `(pp rank, endpoint)` of the room's prefill ranks.
    prefills: Vec<(u64, String)>,
    chunks: HashMap<u64, ChunkSlot>,
}

impl StagingRoom {
    /// Chunks allocated and not yet scattered.
    pub fn pending(&self) -> usize {
        self.chunks
            .values()
            .filter(|c| matches!(c.state, SlotState::Held(_) | SlotState::Scattering(_)))
            .count()
    }

    /// A room of `target` into `pages` whose chunk 0 (every page) is
    /// allocated, still held for its writers or already `scattered`.
    #[cfg(test)]
    pub(crate) fn with_one_chunk(
        target: Arc<StagingTarget>,
        pages: Vec<i32>,
        scattered: bool,
    ) -> Self {
        let allocation = Allocation {
            id: 0,
            offset: 0,
            len: 1 << 10,
            round: 0,
        };
        let chunk = ChunkSlot {
            state: if scattered {
                SlotState::Scattered
            } else {
                SlotState::Held(allocation)
            },
            page_start: 0,
            pages: pages.len() as u64,
            arrived: HashSet::new(),
        };
        Self {
            writers: target.writers(),
            target,
            pages,
            prefills: Vec::new(),
            chunks: HashMap::from([(0, chunk)]),
        }
    }
}

/// Registers `room` for staging when this pair stages: staging on here,
/// a prefill of another TP size, a layout that stages.
pub(crate) fn register_room(
    shared: &Shared,
    room: u64,
    pages: &[i32],
    (prefill_tp, stages): (u64, u64),
    prefills: Vec<(u64, String)>,
) {
    let Some(staging) = &shared.staging else {
        return;
    };
    let Some(layout) = staging.layout("room") else {
        return;
    };
    let target = match StagingTarget::new(&layout, prefill_tp) {
        Ok(t) => Arc::new(t),
        Err(e) => {
            tracing::debug!(room, error = %e, "room takes the per-slice path");
            return;
        }
    };
    let mut unique = pages.to_vec();
    unique.sort_unstable();
    unique.dedup();
    let mut rooms = shared.rooms.lock();
    release_locked(shared, &mut rooms.staging, room);
    if unique.len() != pages.len() {
        // Two chunks scattered into one page would overwrite each other.
        rooms
            .table
            .fail(room, format!("room {room} names a destination page twice"));
        return;
    }
    rooms.staging.insert(
        room,
        StagingRoom {
            writers: target.writers().saturating_mul(stages.max(1)),
            target,
            pages: pages.to_vec(),
            prefills,
            chunks: HashMap::new(),
        },
    );
}

/// `STAGING_REQ`: allocate once per `(room, chunk)` (several prefill ranks
/// ask for the same one) and answer the asking stage's ranks.
pub(crate) fn on_staging_req(shared: &Shared, r: &StagingReq<'_>, bound: &Bound) {
    let Some(staging) = &shared.staging else {
        shared.metrics.dropped("staging_req");
        tracing::warn!(
            room = r.room,
            chunk = r.chunk_idx,
            "STAGING_REQ received but staging is not enabled here (SGLANG_DISAGG_STAGING_BUFFER)"
        );
        return;
    };
    let (answer, targets) = {
        let mut rooms = shared.rooms.lock();
        let live = rooms.takes_writes(r.room);
        let Some(room) = rooms.staging.get_mut(&r.room).filter(|_| live) else {
            drop(rooms);
            shared.metrics.dropped("staging_req");
            tracing::warn!(
                room = r.room,
                chunk = r.chunk_idx,
                "STAGING_REQ for a room not staging here"
            );
            return;
        };
        if staging_writer(
            shared,
            &room.prefills,
            bound,
            ("STAGING_REQ", r.room, r.chunk_idx),
        )
        .is_none()
        {
            return;
        }
        // Chunk `i` is pages `[i × g, i × g + n)` of the room on the
        // prefill's grid (its chunked-prefill size), which must be ours:
        // a chunk cut on another grid is refused, failing the room by name.
        let g = staging.chunk_pages;
        let total = room.pages.len() as u64;
        let page_start = r.chunk_idx.checked_mul(g).filter(|s| *s < total);
        let expected = page_start.map(|s| g.min(total - s));
        let Some(page_start) = page_start.filter(|_| expected == Some(r.chunk_num_pages)) else {
            let reason = format!(
                "the prefill asked staging for chunk {} of room {} as {} pages, but on this \
                 decode's staging grid of {g} pages ({} tokens: its --chunked-prefill-size) \
                 that chunk is {} of the room's {total} pages; staging needs the same \
                 --chunked-prefill-size on prefill and decode",
                r.chunk_idx,
                r.room,
                r.chunk_num_pages,
                g.saturating_mul(shared.kv_args.layout.page_size),
                expected.map_or_else(|| "not".to_owned(), |n| format!("{n} pages")),
            );
            rooms.table.fail(r.room, reason.clone());
            drop(rooms);
            shared.metrics.dropped("staging_req");
            shared.metrics.room_concluded(false);
            tracing::error!(room = r.room, chunk = r.chunk_idx, %reason, "staging chunk size mismatch");
            return;
        };
        if !room.chunks.contains_key(&r.chunk_idx) && room.chunks.len() >= MAX_CHUNKS_PER_ROOM {
            drop(rooms);
            shared.metrics.dropped("staging_req");
            return;
        }
        let target = room.target.clone();
        let slot = room.chunks.entry(r.chunk_idx).or_insert_with(|| {
            let required = target.required(r.chunk_num_pages).ok();
            let mut ring = staging.ring.lock();
            let alloc = required.and_then(|n| ring.assign(n));
            if alloc.is_none() {
                tracing::error!(
                    room = r.room,
                    chunk = r.chunk_idx,
                    need = ?required,
                    ring = ring.size(),
                    "a staging chunk exceeds the ring; increase SGLANG_DISAGG_STAGING_POOL_SIZE_MB"
                );
            }
            ChunkSlot {
                state: alloc.map_or(SlotState::Oversized, SlotState::Held),
                page_start,
                pages: r.chunk_num_pages,
                arrived: HashSet::new(),
            }
        });
        let answer = match slot.state {
            SlotState::Held(a) => (a.offset as i64, a.round as i64, (a.offset + a.len) as i64),
            SlotState::Oversized => (ALLOC_OVERSIZED, 0, -1),
            SlotState::Scattering(_) | SlotState::Scattered => {
                // Written and freed: its old place may hold another chunk now.
                drop(rooms);
                tracing::debug!(
                    room = r.room,
                    chunk = r.chunk_idx,
                    "STAGING_REQ for a chunk already scattered"
                );
                return;
            }
        };
        let targets: Vec<String> = room
            .prefills
            .iter()
            .filter(|(pp, _)| r.requester_pp_rank.is_none_or(|want| *pp == want))
            .map(|(_, e)| e.clone())
            .collect();
        (answer, targets)
    };
    let (offset, round, end) = answer;
    let rsp = StagingRsp {
        room: r.room,
        chunk_idx: r.chunk_idx,
        offset,
        round,
        end,
        session_id: r.session_id.clone(),
    };
    let watermark = staging.ring.lock().watermark();
    for endpoint in &targets {
        if let Err(e) = shared.send_sealed(endpoint, rsp.encode()) {
            tracing::warn!(room = r.room, %endpoint, error = %e, "cannot send STAGING_RSP");
        }
        // A new subscriber hears the current watermark at once, so its
        // first wrapped allocation never waits on an update it missed.
        let new = {
            let mut subs = staging.subscribers.lock();
            subs.len() < MAX_SUBSCRIBERS && subs.insert(endpoint.clone())
        };
        if new {
            send_watermark(shared, endpoint, watermark);
        }
    }
}

/// `CHUNK_READY`: counts the writer; once every writer of the chunk is in,
/// scatters the chunk into the room's pages and frees its allocation. The
/// copy runs without the rooms lock (a room's `poll()` must not wait for
/// it); its result is recorded only into the same allocation of a room
/// still taking writes, and a room's `clear()` and abort ACKs wait for it.
pub(crate) fn on_chunk_ready(shared: &Shared, c: &ChunkReady<'_>, bound: &Bound) {
    let Some(staging) = &shared.staging else {
        shared.metrics.dropped("chunk_ready");
        return;
    };
    let Some((target, alloc, pages)) = take_ready_chunk(shared, staging, c, bound) else {
        return;
    };
    let scattered = scatter(shared, staging, c.room, &target, alloc, &pages);
    let failure = {
        let mut rooms = shared.rooms.lock();
        let live = rooms.takes_writes(c.room);
        let slot = rooms
            .staging
            .get_mut(&c.room)
            .and_then(|r| r.chunks.get_mut(&c.chunk_idx))
            .filter(|s| s.state == SlotState::Scattering(alloc));
        match (slot, live) {
            (Some(slot), true) => {
                slot.state = SlotState::Scattered;
                match scattered {
                    Err(reason) => {
                        rooms.table.fail(c.room, reason.clone());
                        Some(reason)
                    }
                    Ok(()) => None,
                }
            }
            // Aborted, failed or cleared meanwhile: nothing to record.
            _ => {
                tracing::debug!(
                    room = c.room,
                    chunk = c.chunk_idx,
                    "room stopped during its scatter"
                );
                None
            }
        }
    };
    staging.end_scatter(c.room);
    if let Some(reason) = failure {
        shared.metrics.room_concluded(false);
        tracing::error!(room = c.room, %reason, "staging scatter failed");
    }
    free(shared, staging, alloc.id);
}

/// Counts `c`'s writer; when it was the chunk's last, marks the chunk
/// scattering and returns what its scatter needs.
fn take_ready_chunk(
    shared: &Shared,
    staging: &DecodeStaging,
    c: &ChunkReady<'_>,
    bound: &Bound,
) -> Option<(Arc<StagingTarget>, Allocation, Vec<i32>)> {
    let mut rooms = shared.rooms.lock();
    let live = rooms.takes_writes(c.room);
    let Some(room) = rooms.staging.get_mut(&c.room).filter(|_| live) else {
        drop(rooms);
        shared.metrics.dropped("chunk_ready");
        tracing::debug!(
            room = c.room,
            chunk = c.chunk_idx,
            "CHUNK_READY for a room not taking writes"
        );
        return None;
    };
    // A writer counts once per chunk: the rank whose pair key binds the
    // message (secret mode), else the rank it names (sglang's rule).
    let writer = match staging_writer(
        shared,
        &room.prefills,
        bound,
        ("CHUNK_READY", c.room, c.chunk_idx),
    )? {
        Writer::Named => c.prefill_unique_rank.unwrap_or(u64::MAX),
        Writer::Rank(i) => i as u64,
    };
    let writers = room.writers;
    let Some(slot) = room.chunks.get_mut(&c.chunk_idx) else {
        drop(rooms);
        shared.metrics.dropped("chunk_ready");
        tracing::warn!(
            room = c.room,
            chunk = c.chunk_idx,
            "CHUNK_READY for a chunk never allocated"
        );
        return None;
    };
    let SlotState::Held(alloc) = slot.state else {
        return None;
    };
    // The writer names the pages the chunk was allocated for, or none.
    let start = usize::try_from(slot.page_start).ok();
    let end = start.and_then(|s| s.checked_add(usize::try_from(slot.pages).ok()?));
    let pages = match (start, end) {
        (Some(s), Some(e))
            if c.page_start == slot.page_start
                && c.num_pages == slot.pages
                && e <= room.pages.len() =>
        {
            room.pages[s..e].to_vec()
        }
        _ => {
            drop(rooms);
            shared.metrics.dropped("chunk_ready");
            tracing::warn!(
                room = c.room,
                chunk = c.chunk_idx,
                page_start = c.page_start,
                pages = c.num_pages,
                "CHUNK_READY names pages outside the chunk's allocation"
            );
            return None;
        }
    };
    slot.arrived.insert(writer);
    if (slot.arrived.len() as u64) < writers {
        return None;
    }
    slot.state = SlotState::Scattering(alloc);
    staging.begin_scatter(c.room);
    Some((room.target.clone(), alloc, pages))
}

fn scatter(
    shared: &Shared,
    staging: &DecodeStaging,
    room: u64,
    target: &StagingTarget,
    alloc: Allocation,
    pages: &[i32],
) -> Result<(), String> {
    let hook = staging.scatter_hook.lock().clone();
    if let Some(ScatterHook(hook)) = hook {
        hook(room);
    }
    let region = staging.base() + alloc.offset;
    let mut runs = Vec::new();
    target
        .scatter(region, pages, &mut runs)
        .map_err(|e| format!("cannot plan the staging scatter: {e}"))?;
    let bytes = staging
        .buffer
        .copy_runs(&shared.local.registry, &runs)
        .map_err(|e| format!("staging scatter: {e}"))?;
    if bytes > alloc.len {
        return Err(format!(
            "staging scatter of {bytes} bytes exceeds its {}-byte allocation",
            alloc.len
        ));
    }
    shared.metrics.staged_bytes.inc_by(bytes);
    Ok(())
}

fn free(shared: &Shared, staging: &DecodeStaging, id: u64) {
    let (moved, watermark) = {
        let mut ring = staging.ring.lock();
        (ring.free(id), ring.watermark())
    };
    if moved {
        let subscribers: Vec<String> = staging.subscribers.lock().iter().cloned().collect();
        for endpoint in &subscribers {
            send_watermark(shared, endpoint, watermark);
        }
    }
}

fn send_watermark(shared: &Shared, endpoint: &str, (round, tail): (u64, u64)) {
    let message = Watermark {
        wm_round: round,
        wm_tail: tail,
        session_id: shared.engine.session_id().into(),
    };
    if let Err(e) = shared.send_sealed(endpoint, message.encode()) {
        tracing::debug!(%endpoint, error = %e, "cannot send WATERMARK");
    }
}

/// Frees every allocation `room` still holds (cleared, or re-registered).
fn release_locked(shared: &Shared, rooms: &mut HashMap<u64, StagingRoom>, room: u64) {
    let Some(staging) = &shared.staging else {
        return;
    };
    let Some(r) = rooms.remove(&room) else {
        return;
    };
    // A scattering chunk's allocation is freed by its scatter, once copied.
    for (chunk, slot) in r.chunks {
        if let SlotState::Held(a) = slot.state {
            tracing::debug!(room, chunk, "releasing an unscattered staging allocation");
            free(shared, staging, a.id);
        }
    }
}

/// Frees every allocation `room` still holds (the room is cleared), once
/// no scatter copies into its pages any more (its pages may be reused as
/// soon as this returns). Call without the rooms lock.
pub(crate) fn release_room(shared: &Shared, room: u64) {
    if let Some(staging) = &shared.staging {
        staging.wait_scatters(room);
    }
    let mut rooms = shared.rooms.lock();
    release_locked(shared, &mut rooms.staging, room);
}

/// Whether a scatter copies into `room`'s pages now.
pub(crate) fn scattering(shared: &Shared, room: u64) -> bool {
    shared.staging.as_ref().is_some_and(|s| s.scattering(room))
}
