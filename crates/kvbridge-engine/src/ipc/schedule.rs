//! Pure planning of the IPC engine's copies (no CUDA here, tested on CI):
//! address translation through range maps, the per-batch choice between
//! one batched copy kernel and one `cuMemcpyAsync` per block, and the
//! kernel's packed descriptors (strided runs' in [`runs`]).

mod runs;

pub use runs::{RunSplit, prepare_runs, run_shifts};

pub use crate::Batch;
use crate::Block;

/// Addresses at or above this do not fit a packed descriptor.
pub const ADDR_LIMIT: u64 = 1 << 48;

/// How blocks of one batch are copied.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum CopyMode {
    /// Per block: at least `memcpy_min_block` bytes by `cuMemcpyAsync`, the
    /// rest by the batched kernel.
    #[default]
    Auto,
    /// Everything by the batched kernel (long blocks cut into pieces).
    Kernel,
    /// One `cuMemcpyAsync` per block.
    PerBlock,
}

/// Tuning of the copy path.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct CopyTuning {
    /// Blocks of at least this many bytes take `cuMemcpyAsync` in `Auto` mode.
    pub memcpy_min_block: u64,
    /// Longest piece one kernel descriptor covers; longer blocks are cut.
    pub piece: u64,
    /// The choice of copy path.
    pub mode: CopyMode,
    /// Kernel streams a session alternates its batches over (1 or 2): with
    /// two, one batch's kernel tail overlaps the next one's start (batches
    /// of short copies stay on the first, see `ALTERNATE_MIN_COPY`).
    pub kernel_streams: u32,
}

impl Default for CopyTuning {
    fn default() -> Self {
        Self {
            // Measured on an H200 (`kvbridge bench ipc`): the kernel beats one
            // cuMemcpyAsync per block up to 16 MiB blocks (1940 vs 1505 GB/s);
            // only blocks far past that amortize the per-call gaps.
            memcpy_min_block: 64 << 20,
            piece: 64 << 10,
            mode: CopyMode::Auto,
            // Two: from 4 KiB copies up, 2-3 points of memcpy more on the
            // H200 (64 KiB blocks 90 -> 92-93%, see docs/engines.md).
            kernel_streams: 2,
        }
    }
}

/// One batch split between the two copy paths.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Split {
    /// Blocks for the kernel, none longer than the piece size.
    pub kernel: Vec<Block>,
    /// Blocks for one `cuMemcpyAsync` each.
    pub memcpy: Vec<Block>,
}

impl CopyTuning {
    /// Whether `b` goes to `cuMemcpyAsync` under this tuning.
    pub fn wants_memcpy(&self, b: &Block) -> bool {
        match self.mode {
            CopyMode::PerBlock => true,
            CopyMode::Kernel => !fits_descriptor(b),
            CopyMode::Auto => b.len >= self.memcpy_min_block || !fits_descriptor(b),
        }
    }

    /// Whether every block can go to the kernel as it is (no cutting, no memcpy).
    #[cfg(test)]
    pub(crate) fn all_kernel_as_is(&self, blocks: &[Block]) -> bool {
        let piece = self.piece.max(16);
        blocks
            .iter()
            .all(|b| b.len <= piece && !self.wants_memcpy(b))
    }

    /// Split a batch: memcpy blocks, and kernel blocks cut into pieces.
    pub(crate) fn split(&self, blocks: &[Block]) -> Split {
        let piece = self.piece.max(16);
        let mut s = Split::default();
        for b in blocks.iter().filter(|b| b.len > 0) {
            if self.wants_memcpy(b) {
                s.memcpy.push(*b);
                continue;
            }
            let mut off = 0;
            while off < b.len {
                let n = (b.len - off).min(piece);
                s.kernel.push(Block {
                    src: b.src + off,
                    dst: b.dst + off,
                    len: n,
                });
                off += n;
            }
        }
        s
    }
}

/// Whether a block fits one packed descriptor (48-bit addresses, 32-bit length).
pub fn fits_descriptor(b: &Block) -> bool {
    b.src < ADDR_LIMIT && b.dst < ADDR_LIMIT && b.len <= u64::from(u32::MAX)
}

/// The kernel's descriptor: `[src | len low 16 bits << 48, dst | len high 16 bits << 48]`.
pub fn pack(b: &Block) -> [u64; 2] {
    [
        b.src | ((b.len & 0xffff) << 48),
        b.dst | (((b.len >> 16) & 0xffff) << 48),
    ]
}

/// The inverse of [`pack`].
#[cfg(test)]
pub fn unpack(d: [u64; 2]) -> Block {
    let mask = ADDR_LIMIT - 1;
    Block {
        src: d[0] & mask,
        dst: d[1] & mask,
        len: (d[0] >> 48) | ((d[1] >> 48) << 16),
    }
}

/// log2 of the threads that copy one descriptor together: about one
/// 16-byte word per thread for the batch's mean length, 4 to 256 threads.
pub fn group_shift(blocks: &[Block]) -> u32 {
    if blocks.is_empty() {
        return 5;
    }
    let total: u64 = blocks.iter().map(|b| b.len).sum();
    group_for_words((total / blocks.len() as u64).div_ceil(16))
}

/// `log2` of the threads per descriptor for descriptors of `words` 16-byte
/// words: one word per thread up to 1 KiB; from 4 KiB each thread moves
/// four words or more, up to 512 threads for a 64 KiB piece (the launch
/// shapes `bench ipc --kernel-sweep` measured fastest on the H200: 64
/// threads for 4 KiB, 512 for 64 KiB, 5–12% over one word per thread).
fn group_for_words(words: u64) -> u32 {
    let words = words.max(1).next_power_of_two();
    let threads = if words >= 256 { words / 4 } else { words };
    threads.clamp(4, 512).trailing_zeros()
}

/// Threads per CTA of the copy kernel.
pub const BLOCK_THREADS: u32 = 256;

/// Grid size for `n` descriptors with groups of `1 << shift` threads on
/// `sms` multiprocessors (grid-stride beyond 32 CTAs per multiprocessor).
pub fn grid_size(n: usize, shift: u32, sms: u32) -> u32 {
    let threads = (n as u64) << shift;
    let ctas = threads.div_ceil(u64::from(BLOCK_THREADS)).max(1);
    ctas.min(u64::from(sms.max(1)) * 32) as u32
}

/// Why a block cannot be mapped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Miss {
    /// The source is outside the local device regions.
    Source,
    /// The destination is outside the peer's exported regions.
    Destination,
    /// A run is not well formed (see [`Run::is_well_formed`]).
    Shape,
}

/// Sorted, disjoint ranges `[start, end)` with an address delta each;
/// lookups remember the last hit (batches walk memory in runs).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RangeMap {
    ranges: Vec<(u64, u64, i64)>,
}

impl RangeMap {
    /// A map of `(start, len, delta)` ranges (sorted here).
    pub fn new(mut ranges: Vec<(u64, u64, i64)>) -> Self {
        ranges.sort_unstable_by_key(|r| r.0);
        Self {
            ranges: ranges
                .into_iter()
                .map(|(s, l, d)| (s, s.saturating_add(l), d))
                .collect(),
        }
    }

    /// Index of the range holding `[addr, addr + len)`, trying `hint` first.
    pub fn find(&self, addr: u64, len: u64, hint: &mut usize) -> Option<usize> {
        let end = addr.checked_add(len)?;
        let inside = |r: &(u64, u64, i64)| addr >= r.0 && end <= r.1;
        if let Some(r) = self.ranges.get(*hint)
            && inside(r)
        {
            return Some(*hint);
        }
        let i = self
            .ranges
            .partition_point(|r| r.0 <= addr)
            .checked_sub(1)?;
        inside(&self.ranges[i]).then(|| {
            *hint = i;
            i
        })
    }
}

/// A lookup cursor over a [`RangeMap`]: the last range hit, in registers.
#[derive(Debug, Clone, Copy)]
struct Cursor<'a> {
    map: &'a RangeMap,
    lo: u64,
    hi: u64,
    delta: i64,
    idx: usize,
}

impl<'a> Cursor<'a> {
    fn new(map: &'a RangeMap) -> Self {
        Self {
            map,
            lo: 1,
            hi: 0,
            delta: 0,
            idx: usize::MAX,
        }
    }

    /// The range holding `[addr, addr + len)` (`len > 0`) and its delta.
    #[inline(always)]
    fn find(&mut self, addr: u64, len: u64) -> Option<(usize, i64)> {
        let end = addr.wrapping_add(len);
        if addr >= self.lo && end <= self.hi && end > addr {
            return Some((self.idx, self.delta));
        }
        self.miss(addr, len)
    }

    #[cold]
    fn miss(&mut self, addr: u64, len: u64) -> Option<(usize, i64)> {
        let mut hint = 0;
        let i = self.map.find(addr, len, &mut hint)?;
        let r = self.map.ranges[i];
        (self.lo, self.hi, self.delta, self.idx) = (r.0, r.1, r.2, i);
        Some((i, r.2))
    }
}

/// Batches of at least this many blocks are prepared on several threads.
pub const PAR_MIN_BLOCKS: usize = 16 << 10;
/// Fewest blocks one thread prepares at a time.
const PAR_CHUNK_MIN: usize = 8 << 10;

/// What preparing a batch (or several slices of it) found; accumulates.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Prepared {
    /// Kernel descriptors beyond the one per block: the pieces of blocks
    /// longer than the piece size (their own slot holds a placeholder).
    pub pieces: Vec<[u64; 2]>,
    /// Blocks for one `cuMemcpyAsync` each, translated.
    pub memcpy: Vec<Block>,
    /// Bytes the kernel copies.
    pub kernel_bytes: u64,
    /// Indices of the remote ranges touched, sorted, without duplicates.
    pub used: Vec<usize>,
    /// Run descriptors at the front of the slot (two entries each); the
    /// block descriptors follow them.
    pub runs: usize,
    /// Bytes the run descriptors copy (part of `kernel_bytes`).
    pub run_bytes: u64,
    /// Copies the run descriptors cover.
    pub run_copies: u64,
    /// Most copies one run descriptor covers.
    pub run_max_count: u64,
}

impl Prepared {
    /// Forget everything (keeps the allocations).
    pub fn clear(&mut self) {
        self.pieces.clear();
        self.memcpy.clear();
        self.kernel_bytes = 0;
        self.used.clear();
        self.runs = 0;
        self.run_bytes = 0;
        self.run_copies = 0;
        self.run_max_count = 0;
    }

    /// Sort `used` and drop its duplicates after entries were appended past
    /// `first`.
    fn settle_used(&mut self, first: usize) {
        if self.used.len() > first {
            self.used.sort_unstable();
            self.used.dedup();
        }
    }

    /// Append what a later slice of the same batch found (`used` is left
    /// unsorted: see [`Prepared::settle_used`]).
    fn merge(&mut self, o: Prepared) {
        self.pieces.extend_from_slice(&o.pieces);
        self.memcpy.extend_from_slice(&o.memcpy);
        self.kernel_bytes += o.kernel_bytes;
        self.used.extend_from_slice(&o.used);
        self.runs += o.runs;
        self.run_bytes += o.run_bytes;
        self.run_copies += o.run_copies;
        self.run_max_count = self.run_max_count.max(o.run_max_count);
    }

    /// Add a translated block that has no descriptor of its own: to the
    /// memcpy list, or cut into kernel pieces of at most `piece` bytes.
    fn push_irregular(&mut self, b: Block, tuning: &CopyTuning, piece: u64) {
        if tuning.wants_memcpy(&b) {
            self.memcpy.push(b);
            return;
        }
        self.kernel_bytes += b.len;
        let mut off = 0;
        while off < b.len {
            let n = (b.len - off).min(piece);
            self.pieces.push(pack(&Block {
                src: b.src + off,
                dst: b.dst + off,
                len: n,
            }));
            off += n;
        }
    }
}

/// Mean kernel copy (bytes) from which a batch may take a session's second
/// kernel stream. A kernel's tail (its last thread groups finishing while
/// others idle) is long only when each copy is; batches of shorter copies
/// gain nothing from overlapping it and stay on the first stream (256 B
/// runs measured no better, and noisier, alternating).
pub const ALTERNATE_MIN_COPY: u64 = 4096;

impl Prepared {
    /// Whether this batch (`block_descs` block descriptors after its run
    /// descriptors) may take the second kernel stream: its mean kernel copy
    /// is at least [`ALTERNATE_MIN_COPY`], or it has no kernel copy at all.
    pub fn alternates(&self, block_descs: usize) -> bool {
        let copies = block_descs as u64 + self.run_copies;
        copies == 0 || self.kernel_bytes / copies >= ALTERNATE_MIN_COPY
    }
}

/// The placeholder descriptor: copies nothing.
pub const EMPTY: [u64; 2] = [0, 0];

/// Store one descriptor. On x86-64 with non-temporal stores: the
/// descriptors are not read back by the CPU (the GPU uploads them), and
/// streaming them saves reading the destination's cache lines first.
#[inline(always)]
fn put<const NT: bool>(o: &mut [u64; 2], v: [u64; 2]) {
    #[cfg(target_arch = "x86_64")]
    if NT {
        use std::arch::x86_64::_mm_stream_si64;
        let p = o.as_mut_ptr().cast::<i64>();
        // SAFETY: `p` points at two writable, 8-byte aligned u64 (the
        // array `o` borrows mutably); `fence` orders the stores before the
        // chunk is handed back.
        unsafe {
            _mm_stream_si64(p, v[0] as i64);
            _mm_stream_si64(p.add(1), v[1] as i64);
        }
        return;
    }
    *o = v;
}

/// Make [`put`]'s stores visible before anything that follows.
#[inline(always)]
fn fence() {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: a store fence has no preconditions.
    unsafe {
        std::arch::x86_64::_mm_sfence();
    }
}

/// What one thread's share of a batch found.
#[derive(Debug, Default)]
struct Chunk {
    err: Option<(usize, Miss)>,
    irregular: Vec<Block>,
    bytes: u64,
    used: Vec<usize>,
}

/// One pass over `blocks`: check the source, find and translate the
/// destination, write the block's descriptor (or a placeholder, noting the
/// block as irregular when it is long, memcpy-bound or does not fit).
fn prepare_chunk<const NT: bool>(
    blocks: &[Block],
    local: &RangeMap,
    remote: &RangeMap,
    piece: u64,
    memcpy_from: u64,
    out: &mut [[u64; 2]],
) -> Chunk {
    let mut c = Chunk::default();
    let (mut src, mut dst) = (Cursor::new(local), Cursor::new(remote));
    let mut last = usize::MAX;
    for (i, (b, o)) in blocks.iter().zip(out.iter_mut()).enumerate() {
        if b.len == 0 {
            put::<NT>(o, EMPTY);
            continue;
        }
        if src.find(b.src, b.len).is_none() {
            c.err = Some((i, Miss::Source));
            break;
        }
        let Some((r, delta)) = dst.find(b.dst, b.len) else {
            c.err = Some((i, Miss::Destination));
            break;
        };
        if r != last {
            c.used.push(r);
            last = r;
        }
        let t = Block {
            src: b.src,
            dst: b.dst.wrapping_add_signed(delta),
            len: b.len,
        };
        if b.len <= piece && b.len < memcpy_from && fits_descriptor(&t) {
            put::<NT>(o, pack(&t));
            c.bytes += b.len;
        } else {
            put::<NT>(o, EMPTY);
            c.irregular.push(t);
        }
    }
    fence();
    c
}

/// What a batch is prepared against: the address maps of both sides (see
/// [`RangeMap`]), the tuning, and the threads for large batches.
#[derive(Debug, Clone, Copy)]
pub struct Context<'a> {
    /// Our registered memory, as this process sees it.
    pub local: &'a RangeMap,
    /// The peer's memory, translated into this process's view.
    pub remote: &'a RangeMap,
    /// How to copy.
    pub tuning: &'a CopyTuning,
    /// Threads to prepare large batches on (`None`: this thread).
    pub pool: Option<&'a rayon::ThreadPool>,
}

/// Check every source against `local`, translate every destination
/// through `remote` and write one kernel descriptor per block into
/// `out[..blocks.len()]`, in one pass (on `pool`'s threads for large
/// batches). Long blocks are cut into pieces (`acc.pieces`), blocks for
/// `cuMemcpyAsync` go to `acc.memcpy`; both leave a placeholder.
/// `written(at, n)` is called (on the thread that wrote them) as soon as
/// the descriptors of blocks `[at, at + n)` are in `out`, e.g. to upload
/// them while the rest is prepared. Returns the first failing block.
/// `NT`: write the descriptors with non-temporal (streaming) stores, what
/// the engine does; `false` only to compare in tests.
pub fn prepare<const NT: bool>(
    blocks: &[Block],
    cx: Context<'_>,
    out: &mut [[u64; 2]],
    acc: &mut Prepared,
    written: &(dyn Fn(usize, usize) + Sync),
) -> Result<(), (usize, Miss)> {
    use rayon::prelude::*;
    let (local, remote, tuning, pool) = (cx.local, cx.remote, cx.tuning, cx.pool);
    let out = &mut out[..blocks.len()];
    let piece = tuning.piece.max(16);
    let memcpy_from = memcpy_from(tuning);
    let chunks: Vec<(usize, Chunk)> = match pool {
        Some(pool) if blocks.len() >= PAR_MIN_BLOCKS => {
            let per = blocks
                .len()
                .div_ceil(pool.current_num_threads().max(1) * 4)
                .max(PAR_CHUNK_MIN);
            pool.install(|| {
                blocks
                    .par_chunks(per)
                    .zip(out.par_chunks_mut(per))
                    .enumerate()
                    .map(|(k, (b, o))| {
                        let c = prepare_chunk::<NT>(b, local, remote, piece, memcpy_from, o);
                        if c.err.is_none() {
                            written(k * per, b.len());
                        }
                        (k * per, c)
                    })
                    .collect()
            })
        }
        _ => {
            let c = prepare_chunk::<NT>(blocks, local, remote, piece, memcpy_from, out);
            if c.err.is_none() {
                written(0, blocks.len());
            }
            vec![(0, c)]
        }
    };
    let first = acc.used.len();
    for (at, c) in chunks {
        if let Some((i, m)) = c.err {
            return Err((at + i, m));
        }
        acc.kernel_bytes += c.bytes;
        acc.used.extend_from_slice(&c.used);
        for t in c.irregular {
            acc.push_irregular(t, tuning, piece);
        }
    }
    acc.settle_used(first);
    Ok(())
}

/// Blocks of at least this many bytes take `cuMemcpyAsync` (per the mode).
fn memcpy_from(tuning: &CopyTuning) -> u64 {
    match tuning.mode {
        CopyMode::Auto => tuning.memcpy_min_block,
        CopyMode::Kernel => u64::MAX,
        CopyMode::PerBlock => 0,
    }
}

/// [`group_shift`] from a total and a count of descriptors.
pub fn shift_for(bytes: u64, descs: usize) -> u32 {
    if descs == 0 {
        return 5;
    }
    group_for_words((bytes / descs as u64).div_ceil(16))
}

/// Pack `blocks` (all [`fits_descriptor`]) into `out` on up to `threads` threads.
pub fn pack_par(blocks: &[Block], out: &mut [[u64; 2]], threads: usize) {
    let threads = threads.clamp(1, 16);
    let per = blocks.len().div_ceil(threads).max(1 << 15);
    if blocks.len() <= per {
        for (x, y) in blocks.iter().zip(out.iter_mut()) {
            *y = pack(x);
        }
        return;
    }
    std::thread::scope(|s| {
        for (b, o) in blocks.chunks(per).zip(out.chunks_mut(per)) {
            s.spawn(move || {
                for (x, y) in b.iter().zip(o.iter_mut()) {
                    *y = pack(x);
                }
            });
        }
    });
}

#[cfg(test)]
mod tests;
