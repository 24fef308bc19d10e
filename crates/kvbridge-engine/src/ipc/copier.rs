//! The copy path of one session: a kernel stream and an upload stream, the
//! batched kernel for small blocks and `cuMemcpyAsync` for very large ones,
//! and [`Slot`]s: the descriptor buffers of one batch (pinned host and
//! device, grown on demand and reused) with its events.
//!
//! A batch's descriptors are prepared ([`schedule::prepare`]: checked,
//! translated and packed in one pass, on the [`prep_pool`]'s threads for
//! large batches) straight into its slot's pinned buffer; each thread's
//! share is uploaded on the upload stream as soon as it is written
//! ([`Uploader`]), and the kernel is launched on the kernel stream (after
//! the uploads, through an event) once the whole batch checked out.
//! Completion is the slot's `done` event: several batches can be in
//! flight, each in its own slot.

use std::ffi::c_void;
use std::sync::{Arc, Mutex, OnceLock};

use kvbridge_mem::cuda::{self, CudaError, DeviceBuffer, Event, Kernel, PinnedBuffer, Stream};

use super::kernel;
use super::schedule::{self, Context, CopyTuning, Prepared, RangeMap};
use crate::{Block, Run};

/// The compiled block-copy kernel of GPU `ordinal` (compiled once per process).
pub fn copy_kernel(ordinal: i32) -> Result<Arc<Kernel>, CudaError> {
    compiled(ordinal, kernel::ENTRY)
}

/// Kernel `entry` of [`kernel::SOURCE`] for GPU `ordinal` (compiled once per process).
fn compiled(ordinal: i32, entry: &'static str) -> Result<Arc<Kernel>, CudaError> {
    type Cache = Mutex<Vec<(i32, &'static str, Arc<Kernel>)>>;
    static KERNELS: OnceLock<Cache> = OnceLock::new();
    let cache = KERNELS.get_or_init(|| Mutex::new(Vec::new()));
    let mut guard = cache.lock().unwrap_or_else(|p| p.into_inner());
    if let Some((_, _, k)) = guard.iter().find(|(o, e, _)| *o == ordinal && *e == entry) {
        return Ok(k.clone());
    }
    let k = Arc::new(Kernel::compile(ordinal, kernel::SOURCE, entry)?);
    guard.push((ordinal, entry, k.clone()));
    Ok(k)
}

/// The threads that prepare large batches (one pool per process: a thread
/// per core but one, which the completion threads' waits keep, up to 16);
/// `None` when no thread could be started.
pub fn prep_pool() -> Option<&'static rayon::ThreadPool> {
    static POOL: OnceLock<Option<rayon::ThreadPool>> = OnceLock::new();
    POOL.get_or_init(|| {
        let n = std::thread::available_parallelism()
            .map_or(1, usize::from)
            .saturating_sub(1)
            .clamp(1, 16);
        rayon::ThreadPoolBuilder::new()
            .num_threads(n)
            .thread_name(|i| format!("kvb-ipc-prep{i}"))
            .build()
            .map_err(|e| tracing::warn!(error = %e, "no ipc preparation threads"))
            .ok()
    })
    .as_ref()
}

fn cuda_err(call: &'static str, name: impl Into<String>) -> CudaError {
    CudaError {
        call,
        code: -1,
        name: name.into(),
    }
}

/// What one copy did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CopyStats {
    /// Descriptors the kernel ran over (placeholders included).
    pub kernel_blocks: u64,
    /// Blocks copied by `cuMemcpyAsync`.
    pub memcpy_blocks: u64,
    /// Kernel launches.
    pub launches: u64,
}

/// The descriptor buffers and events of one batch in flight.
#[derive(Debug)]
pub struct Slot {
    ordinal: i32,
    // Dropped first: its drop makes the context current for the others.
    dev: DeviceBuffer,
    host: PinnedBuffer,
    /// Capacity in descriptors.
    cap: usize,
    /// Recorded on the upload stream after the batch's uploads.
    uploaded: Event,
    /// Recorded on the kernel stream after the batch's copies.
    done: Event,
}

impl super::idle::Reusable for Slot {
    fn ordinal(&self) -> i32 {
        self.ordinal
    }
    fn capacity(&self) -> usize {
        self.cap
    }
}

impl Slot {
    /// A slot for at least `descs` descriptors on GPU `ordinal`.
    pub fn new(ordinal: i32, descs: usize) -> Result<Self, CudaError> {
        let cap = descs.max(1 << 10).next_power_of_two();
        Ok(Self {
            ordinal,
            dev: DeviceBuffer::new_uninit(ordinal, cap * 16)?,
            host: PinnedBuffer::new(cap * 16)?,
            cap,
            uploaded: Event::new_untimed(ordinal)?,
            done: Event::new_untimed(ordinal)?,
        })
    }

    /// Capacity in descriptors.
    pub fn capacity(&self) -> usize {
        self.cap
    }

    /// The pinned descriptor array.
    pub fn descs_mut(&mut self) -> &mut [[u64; 2]] {
        bytemuck::cast_slice_mut(&mut self.host.as_mut_slice()[..self.cap * 16])
    }

    /// Make room for `descs` descriptors, keeping the first `keep`. The
    /// slot must be idle (nothing of it in flight).
    pub fn reserve(&mut self, descs: usize, keep: usize) -> Result<(), CudaError> {
        if descs <= self.cap {
            return Ok(());
        }
        let cap = descs.next_power_of_two();
        let mut host = PinnedBuffer::new(cap * 16)?;
        let keep = keep.min(self.cap) * 16;
        host.as_mut_slice()[..keep].copy_from_slice(&self.host.as_slice()[..keep]);
        self.dev = DeviceBuffer::new_uninit(self.ordinal, cap * 16)?;
        self.host = host;
        self.cap = cap;
        Ok(())
    }

    /// Wait until the slot's last batch finished.
    pub fn wait(&self) -> Result<(), CudaError> {
        self.done.synchronize()
    }
}

/// Uploads descriptors of one slot on the upload stream; usable from any
/// thread (see [`Copier::uploader`]).
#[derive(Debug, Clone, Copy)]
pub struct Uploader<'a> {
    stream: &'a Stream,
    host: usize,
    dev: u64,
    cap: usize,
}

impl Uploader<'_> {
    /// Enqueue the upload of descriptors `[from, from + count)`.
    ///
    /// # Safety
    /// As for [`Copier::upload`]; the slot must outlive the upload.
    pub unsafe fn upload(&self, from: usize, count: usize) -> Result<(), CudaError> {
        if count == 0 {
            return Ok(());
        }
        if from + count > self.cap {
            return Err(cuda_err("upload", "descriptors beyond the slot"));
        }
        self.stream.context().make_current()?;
        let src = std::ptr::with_exposed_provenance::<u8>(self.host + from * 16);
        // SAFETY: the range lies in both of the slot's buffers (checked
        // against its capacity); the caller keeps the pinned bytes as
        // written until the slot's batch completes.
        unsafe {
            self.stream
                .upload(self.dev + from as u64 * 16, src, count * 16)
        }
    }
}

/// Streams and the kernel of one GPU, reused across batches.
#[derive(Debug)]
pub struct Copier {
    ordinal: i32,
    sms: u32,
    kernel: Arc<Kernel>,
    stream: Stream,
    /// The second kernel stream (`kernel_streams: 2`), and which one is next.
    second: Option<Stream>,
    flip: std::sync::atomic::AtomicBool,
    upload: Stream,
    threads: usize,
    tuning: CopyTuning,
    /// The slot of [`Copier::copy`].
    own: Option<Slot>,
}

impl Copier {
    /// A copier on GPU `ordinal`.
    pub fn new(ordinal: i32, tuning: CopyTuning) -> Result<Self, CudaError> {
        let ctx = cuda::context(ordinal)?;
        ctx.make_current()?;
        Ok(Self {
            ordinal,
            sms: ctx.multiprocessors()?.max(1) as u32,
            kernel: copy_kernel(ordinal)?,
            stream: Stream::new(ordinal)?,
            second: if tuning.kernel_streams >= 2 {
                Some(Stream::new(ordinal)?)
            } else {
                None
            },
            flip: std::sync::atomic::AtomicBool::new(false),
            upload: Stream::new(ordinal)?,
            threads: std::thread::available_parallelism()
                .map_or(1, usize::from)
                .min(8),
            tuning,
            own: None,
        })
    }

    /// The GPU.
    pub fn ordinal(&self) -> i32 {
        self.ordinal
    }

    /// The GPU's multiprocessors.
    pub fn multiprocessors(&self) -> u32 {
        self.sms
    }

    /// The copy tuning.
    pub fn tuning(&self) -> CopyTuning {
        self.tuning
    }

    /// Change the copy tuning (e.g. a forced mode for a benchmark).
    pub fn set_tuning(&mut self, tuning: CopyTuning) {
        self.tuning = tuning;
    }

    /// Make the copier's context current on this thread.
    pub fn make_current(&self) -> Result<(), CudaError> {
        self.stream.context().make_current()
    }

    /// Wait until every copy enqueued so far has finished.
    pub fn synchronize(&self) -> Result<(), CudaError> {
        if let Some(s) = &self.second {
            s.synchronize()?;
        }
        self.stream.synchronize()
    }

    /// The kernel stream of the next batch: alternating when there are two
    /// and the batch `alternates`, else the first.
    fn next_stream(&self, alternates: bool) -> &Stream {
        match &self.second {
            Some(s)
                if alternates
                    && self
                        .flip
                        .fetch_xor(true, std::sync::atomic::Ordering::Relaxed) =>
            {
                s
            }
            _ => &self.stream,
        }
    }

    /// Wait until every descriptor upload enqueued so far has finished.
    pub fn sync_uploads(&self) -> Result<(), CudaError> {
        self.upload.synchronize()
    }

    /// Benchmark aid: device time of one kernel launch over `blocks` (all
    /// kernel-sized) with the descriptors already on the GPU, averaged over
    /// `reps` launches, in milliseconds.
    ///
    /// # Safety
    /// As for [`Copier::copy`].
    pub unsafe fn time_kernel(&mut self, blocks: &[Block], reps: u32) -> Result<f64, CudaError> {
        let shift = schedule::group_shift(blocks);
        let grid = schedule::grid_size(blocks.len(), shift, self.sms);
        // SAFETY: forwarded caller contract.
        unsafe { self.time_kernel_with(blocks, reps, shift, grid) }
    }

    /// [`Copier::time_kernel`] with `1 << shift` threads per descriptor
    /// and `grid` CTAs (for tuning the launch shape).
    ///
    /// # Safety
    /// As for [`Copier::copy`].
    pub unsafe fn time_kernel_with(
        &mut self,
        blocks: &[Block],
        reps: u32,
        shift: u32,
        grid: u32,
    ) -> Result<f64, CudaError> {
        self.stream.context().make_current()?;
        let mut words = vec![[0u64; 2]; blocks.len()];
        schedule::pack_par(blocks, &mut words, self.threads);
        let bytes: &[u8] = bytemuck::cast_slice(&words);
        let dev = DeviceBuffer::new(self.ordinal, bytes.len().max(16))?;
        dev.write(0, bytes)?;
        let n = blocks.len() as u64;
        self.time_launches(reps, || {
            // SAFETY: the descriptors are on the GPU (`dev`, alive until we
            // return, after the launches finished); ranges guaranteed by the caller.
            unsafe { self.launch_blocks(&self.stream, dev.addr(), n, shift, grid) }
        })
    }

    /// Benchmark aid: device time of one run-kernel launch over `runs` (all
    /// taken by the run kernel as they are) with the descriptors already on
    /// the GPU, averaged over `reps` launches, in milliseconds.
    ///
    /// # Safety
    /// As for [`Copier::copy`], for every copy of every run.
    pub unsafe fn time_runs(&mut self, runs: &[Run], reps: u32) -> Result<f64, CudaError> {
        self.stream.context().make_current()?;
        let all = RangeMap::new(vec![(0, u64::MAX, 0)]);
        let pool = prep_pool();
        let split = schedule::RunSplit::new(runs, &self.tuning, pool);
        let mut words = vec![[0u64; 2]; split.entries()];
        let mut acc = Prepared::default();
        let tuning = self.tuning;
        schedule::prepare_runs(
            runs,
            &split,
            Context {
                local: &all,
                remote: &all,
                tuning: &tuning,
                pool,
            },
            &mut words,
            &mut acc,
        )
        .map_err(|(i, m)| cuda_err("time_runs", format!("run {i}: {m:?}")))?;
        if !acc.pieces.is_empty() || !acc.memcpy.is_empty() {
            return Err(cuda_err("time_runs", "runs the run kernel cannot take"));
        }
        let bytes: &[u8] = bytemuck::cast_slice(&words);
        let dev = DeviceBuffer::new(self.ordinal, bytes.len().max(16))?;
        dev.write(0, bytes)?;
        let k = compiled(self.ordinal, kernel::RUN_ENTRY)?;
        let shifts = schedule::run_shifts(&acc);
        self.time_launches(reps, || {
            // SAFETY: as in `time_kernel_with`, for the run descriptors.
            unsafe { self.launch_runs(&k, &self.stream, dev.addr(), acc.runs as u64, shifts) }
        })
    }

    /// Device time of one `launch` (after a warm-up one), averaged over
    /// `reps` launches on the kernel stream, in milliseconds.
    fn time_launches(
        &self,
        reps: u32,
        launch: impl Fn() -> Result<(), CudaError>,
    ) -> Result<f64, CudaError> {
        let (start, end) = (Event::new(self.ordinal)?, Event::new(self.ordinal)?);
        launch()?;
        start.record(&self.stream)?;
        for _ in 0..reps.max(1) {
            launch()?;
        }
        end.record(&self.stream)?;
        end.synchronize()?;
        Ok(f64::from(end.elapsed_ms(&start)?) / f64::from(reps.max(1)))
    }

    /// Launch the block kernel on `stream` over the `n` descriptors at
    /// device address `descs`, `1 << shift` threads each, `grid` CTAs.
    ///
    /// # Safety
    /// The descriptors must be on the GPU when the launch runs (ordered on
    /// `stream`) and name ranges valid as for [`Copier::copy`] until it finished.
    unsafe fn launch_blocks(
        &self,
        stream: &Stream,
        descs: u64,
        n: u64,
        shift: u32,
        grid: u32,
    ) -> Result<(), CudaError> {
        let (mut p_descs, mut p_n, mut p_shift) = (descs, n, shift);
        let mut params: [*mut c_void; 3] = [
            (&raw mut p_descs).cast(),
            (&raw mut p_n).cast(),
            (&raw mut p_shift).cast(),
        ];
        // SAFETY: the parameters are (const ulonglong2*, u64, u32) as the
        // kernel declares; the descriptors' ranges are the caller's contract.
        unsafe {
            self.kernel
                .launch(stream, grid, schedule::BLOCK_THREADS, &mut params)
        }
    }

    /// Launch the run kernel `k` on `stream` over the `n` run descriptors
    /// at device address `descs`, shaped by `(kshift, shift)`
    /// ([`schedule::run_shifts`]).
    ///
    /// # Safety
    /// As for [`Copier::launch_blocks`], for every copy of every run.
    unsafe fn launch_runs(
        &self,
        k: &Kernel,
        stream: &Stream,
        descs: u64,
        n: u64,
        (kshift, shift): (u32, u32),
    ) -> Result<(), CudaError> {
        let grid = schedule::grid_size((n as usize) << kshift, shift, self.sms);
        let (mut p_descs, mut p_n, mut p_kshift, mut p_shift) = (descs, n, kshift, shift);
        let mut params: [*mut c_void; 4] = [
            (&raw mut p_descs).cast(),
            (&raw mut p_n).cast(),
            (&raw mut p_kshift).cast(),
            (&raw mut p_shift).cast(),
        ];
        // SAFETY: the parameters are (const ulonglong2*, u64, u32, u32) as
        // the run kernel declares; the ranges are the caller's contract.
        unsafe { k.launch(stream, grid, schedule::BLOCK_THREADS, &mut params) }
    }

    /// Copy every block (addresses valid in this process) and wait for it.
    ///
    /// # Safety
    /// Every source range must be readable and every destination range
    /// writable device memory (or memory the GPU may access) until this
    /// returns; destinations must not overlap each other, and nothing else
    /// may write them meanwhile.
    pub unsafe fn copy(&mut self, blocks: &[Block]) -> Result<CopyStats, CudaError> {
        self.make_current()?;
        let mut slot = match self.own.take() {
            Some(s) => s,
            None => Slot::new(self.ordinal, blocks.len())?,
        };
        slot.reserve(blocks.len(), 0)?;
        let all = RangeMap::new(vec![(0, u64::MAX, 0)]);
        let mut acc = Prepared::default();
        let tuning = self.tuning;
        schedule::prepare::<true>(
            blocks,
            Context {
                local: &all,
                remote: &all,
                tuning: &tuning,
                pool: prep_pool(),
            },
            slot.descs_mut(),
            &mut acc,
            &|_, _| {},
        )
        .map_err(|(i, _)| cuda_err("copy", format!("block {i} wraps around the address space")))?;
        let descs = self.finish_descs(&mut slot, blocks.len(), &acc)?;
        // SAFETY: the slot holds `descs` descriptors and is idle.
        unsafe { self.upload(&slot, 0, descs) }?;
        // SAFETY: forwarded caller contract; the descriptors are uploaded
        // (ordered by the slot's `uploaded` event).
        let stats = unsafe { self.launch(&slot, descs, &acc) };
        let waited = slot.wait();
        self.own = Some(slot);
        let stats = stats?;
        waited?;
        Ok(stats)
    }

    /// Append the pieces of `acc` after the `n` entries (per-block or run
    /// descriptors) of `slot` (growing it); returns the entry count.
    pub fn finish_descs(
        &self,
        slot: &mut Slot,
        n: usize,
        acc: &Prepared,
    ) -> Result<usize, CudaError> {
        let total = n + acc.pieces.len();
        if !acc.pieces.is_empty() {
            slot.reserve(total, n)?;
            slot.descs_mut()[n..total].copy_from_slice(&acc.pieces);
        }
        Ok(total)
    }

    /// What uploads descriptors of `slot` while they are being written
    /// (the slot's buffers borrowed by address only).
    pub fn uploader(&self, slot: &Slot) -> Uploader<'_> {
        Uploader {
            stream: &self.upload,
            host: slot.host.as_ptr().expose_provenance(),
            dev: slot.dev.addr(),
            cap: slot.cap,
        }
    }

    /// Enqueue the upload of descriptors `[from, from + count)` of `slot`.
    ///
    /// # Safety
    /// The slot must be idle (no batch of it in flight) and those
    /// descriptors written and left alone until the batch completes.
    pub unsafe fn upload(&self, slot: &Slot, from: usize, count: usize) -> Result<(), CudaError> {
        if count == 0 {
            return Ok(());
        }
        if from + count > slot.cap {
            return Err(cuda_err("upload", "descriptors beyond the slot"));
        }
        self.make_current()?;
        // SAFETY: the range lies in both buffers (checked); the pinned
        // bytes stay untouched until the slot's `done` event (caller).
        unsafe {
            self.upload.upload(
                slot.dev.addr() + from as u64 * 16,
                slot.host.as_ptr().add(from * 16),
                count * 16,
            )
        }
    }

    /// Enqueue the batch of `slot` (its `descs` entries uploaded by
    /// [`Copier::upload`]: `acc.runs` run descriptors, then block
    /// descriptors): a launch of the run kernel and one of the block kernel
    /// (each if it has work), a `cuMemcpyAsync` per memcpy block of `acc`,
    /// then the slot's `done` event. Returns at once.
    ///
    /// # Safety
    /// Every descriptor's and memcpy block's ranges must stay valid (as for
    /// [`Copier::copy`]) until the slot's `done` event has passed.
    pub unsafe fn launch(
        &self,
        slot: &Slot,
        descs: usize,
        acc: &Prepared,
    ) -> Result<CopyStats, CudaError> {
        self.make_current()?;
        let run_entries = (2 * acc.runs).min(descs);
        let stream = self.next_stream(acc.alternates(descs - run_entries));
        let mut stats = CopyStats::default();
        if descs > 0 {
            slot.uploaded.record(&self.upload)?;
            stream.wait(&slot.uploaded)?;
        }
        if acc.runs > 0 {
            let k = compiled(self.ordinal, kernel::RUN_ENTRY)?;
            let n = (run_entries / 2) as u64;
            // SAFETY: the run descriptors were uploaded before (ordered by
            // the event) and name ranges the caller guarantees valid.
            unsafe { self.launch_runs(&k, stream, slot.dev.addr(), n, schedule::run_shifts(acc)) }?;
            stats.launches += 1;
        }
        if descs > run_entries {
            let n = descs - run_entries;
            let shift = schedule::shift_for(acc.kernel_bytes - acc.run_bytes, n);
            let grid = schedule::grid_size(n, shift, self.sms);
            let at = slot.dev.addr() + run_entries as u64 * 16;
            // SAFETY: as for the runs above, for the block descriptors.
            unsafe { self.launch_blocks(stream, at, n as u64, shift, grid) }?;
            stats.launches += 1;
        }
        stats.kernel_blocks = (descs - run_entries) as u64 + acc.run_copies;
        for b in &acc.memcpy {
            let len = usize::try_from(b.len).unwrap_or(usize::MAX);
            // SAFETY: the caller guarantees both ranges.
            unsafe { stream.memcpy(b.dst, b.src, len) }?;
            stats.memcpy_blocks += 1;
        }
        slot.done.record(stream)?;
        Ok(stats)
    }
}
