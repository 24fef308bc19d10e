//! Strided runs in the IPC engine's plan: the run kernel's 32-byte
//! descriptors, checking and translating a run's whole spans, and the
//! launch shape of the run kernel.

use super::{Context, Cursor, Miss, Prepared, RangeMap, group_for_words, memcpy_from};
use crate::Run;
use crate::ipc::CopyTuning;

/// Most copies one run descriptor covers: longer runs take several.
pub const RUN_MAX_COUNT: u64 = 64;

/// The run kernel's descriptor (two slot entries): `[src, dst]`,
/// `[len | count << 32, src_stride | dst_stride << 32]`.
pub fn pack_run(r: &Run) -> [[u64; 2]; 2] {
    [
        [r.src, r.dst],
        [r.len | (r.count << 32), r.src_stride | (r.dst_stride << 32)],
    ]
}

/// The inverse of [`pack_run`].
#[cfg(test)]
pub fn unpack_run(d: [[u64; 2]; 2]) -> Run {
    let lo = |x: u64| x & 0xffff_ffff;
    Run {
        src: d[0][0],
        dst: d[0][1],
        len: lo(d[1][0]),
        count: d[1][0] >> 32,
        src_stride: lo(d[1][1]),
        dst_stride: d[1][1] >> 32,
    }
}

/// Whether run `r`'s copies go to the run kernel as they are: lengths and
/// strides fit 32 bits, and each copy is kernel-sized.
fn run_fits_kernel(r: &Run, piece: u64, memcpy_from: u64) -> bool {
    let w = u64::from(u32::MAX);
    r.len <= piece && r.len < memcpy_from && r.src_stride <= w && r.dst_stride <= w
}

/// Slot entries that preparing `runs` with `tuning` takes at most (before
/// pieces): two per run descriptor.
pub fn run_entries(runs: &[Run], tuning: &CopyTuning) -> usize {
    let (piece, memcpy_from) = (tuning.piece.max(16), memcpy_from(tuning));
    runs.iter()
        .filter(|r| r.len > 0 && run_fits_kernel(r, piece, memcpy_from))
        .map(|r| 2 * usize::try_from(r.count.div_ceil(RUN_MAX_COUNT)).unwrap_or(usize::MAX))
        .fold(0usize, usize::saturating_add)
}

/// Batches of at least this many runs are prepared on several threads.
pub const PAR_MIN_RUNS: usize = 4 << 10;
/// Fewest runs one thread prepares at a time.
const PAR_RUNS_CHUNK_MIN: usize = 1 << 10;

/// How a batch of runs is cut into chunks for the preparation threads, and
/// the slot entries each chunk writes (counted once, on those threads).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RunSplit {
    chunk: usize,
    entries: Vec<usize>,
    total: usize,
}

impl RunSplit {
    /// The split of `runs` for `pool`: one chunk without a pool or for
    /// fewer than [`PAR_MIN_RUNS`] runs.
    pub fn new(runs: &[Run], tuning: &CopyTuning, pool: Option<&rayon::ThreadPool>) -> Self {
        let chunk = match pool {
            Some(pool) if runs.len() >= PAR_MIN_RUNS => runs
                .len()
                .div_ceil(pool.current_num_threads().max(1) * 4)
                .max(PAR_RUNS_CHUNK_MIN),
            _ => runs.len().max(1),
        };
        Self::with_chunk(runs, tuning, pool, chunk)
    }

    /// The split of `runs` into chunks of `chunk` runs.
    fn with_chunk(
        runs: &[Run],
        tuning: &CopyTuning,
        pool: Option<&rayon::ThreadPool>,
        chunk: usize,
    ) -> Self {
        use rayon::prelude::*;
        let chunk = chunk.max(1);
        let count = |c: &[Run]| run_entries(c, tuning);
        let entries: Vec<usize> = match pool {
            Some(pool) if runs.len() > chunk => {
                pool.install(|| runs.par_chunks(chunk).map(count).collect())
            }
            _ => runs.chunks(chunk).map(count).collect(),
        };
        let total = entries.iter().fold(0usize, |a, &n| a.saturating_add(n));
        Self {
            chunk,
            entries,
            total,
        }
    }

    /// Slot entries preparing the runs writes (before pieces).
    pub fn entries(&self) -> usize {
        self.total
    }
}

/// [`prepare`] for strided runs: check each run's whole source span against
/// `local` and destination span against `remote` (one range each), translate
/// the destination and write run descriptors of at most [`RUN_MAX_COUNT`]
/// copies into `out` from entry `2 * acc.runs` on (at least
/// `split.entries()` more), a chunk of `split` per task on `pool`. Runs
/// the run kernel cannot take (long copies, wide strides) are expanded into
/// block pieces or memcpy blocks in `acc`. Returns the first failing run
/// (run 0 with [`Miss::Shape`] when `split` is not the split of `runs`).
///
/// [`prepare`]: super::prepare
pub fn prepare_runs(
    runs: &[Run],
    split: &RunSplit,
    cx: Context<'_>,
    out: &mut [[u64; 2]],
    acc: &mut Prepared,
) -> Result<(), (usize, Miss)> {
    use rayon::prelude::*;
    let (local, remote, tuning, pool) = (cx.local, cx.remote, cx.tuning, cx.pool);
    if split.chunk == 0 || split.entries.len() != runs.len().div_ceil(split.chunk) {
        return Err((0, Miss::Shape));
    }
    let base = (2 * acc.runs).min(out.len());
    let out = &mut out[base..];
    let first = acc.used.len();
    let parts = match pool {
        Some(pool) if split.entries.len() > 1 => {
            // Each chunk writes its own slice of `out`, sized by its runs.
            let mut slices = Vec::with_capacity(split.entries.len());
            let mut rest = &mut *out;
            let chunks = runs.chunks(split.chunk).zip(&split.entries);
            for (k, (c, &n)) in chunks.enumerate() {
                let (mine, tail) = rest.split_at_mut(n.min(rest.len()));
                slices.push((k * split.chunk, c, mine, n));
                rest = tail;
            }
            pool.install(|| {
                slices
                    .into_par_iter()
                    .map(|(at, c, o, n)| {
                        let mut part = Prepared::default();
                        let r = prepare_runs_chunk(c, local, remote, tuning, o, &mut part);
                        (at, r, part, n)
                    })
                    .collect::<Vec<_>>()
            })
        }
        _ => {
            let mut part = Prepared::default();
            let r = prepare_runs_chunk(runs, local, remote, tuning, out, &mut part);
            vec![(0, r, part, split.total)]
        }
    };
    for (at, r, part, n) in parts {
        if let Err((i, m)) = r {
            return Err((at + i, m));
        }
        if 2 * part.runs != n {
            // Not the split of these runs: the descriptors would have gaps.
            return Err((at, Miss::Shape));
        }
        acc.merge(part);
    }
    acc.settle_used(first);
    Ok(())
}

/// One thread's share of [`prepare_runs`]: descriptors from `out[0]` on,
/// everything else into `acc` (fresh).
fn prepare_runs_chunk(
    runs: &[Run],
    local: &RangeMap,
    remote: &RangeMap,
    tuning: &CopyTuning,
    out: &mut [[u64; 2]],
    acc: &mut Prepared,
) -> Result<(), (usize, Miss)> {
    let (piece, memcpy_from) = (tuning.piece.max(16), memcpy_from(tuning));
    let (mut src, mut dst) = (Cursor::new(local), Cursor::new(remote));
    let mut at = 0;
    for (i, r) in runs.iter().enumerate() {
        if !r.is_well_formed() {
            return Err((i, Miss::Shape));
        }
        let Some((s_span, d_span)) = r.spans().filter(|s| s.0 > 0) else {
            continue; // moves nothing
        };
        if src.find(r.src, s_span).is_none() {
            return Err((i, Miss::Source));
        }
        let Some((ri, delta)) = dst.find(r.dst, d_span) else {
            return Err((i, Miss::Destination));
        };
        if acc.used.last() != Some(&ri) {
            acc.used.push(ri);
        }
        let t = Run {
            dst: r.dst.wrapping_add_signed(delta),
            ..*r
        };
        if !run_fits_kernel(&t, piece, memcpy_from) {
            for k in 0..t.count {
                acc.push_irregular(t.block(k), tuning, piece);
            }
            continue;
        }
        let mut k = 0;
        while k < t.count {
            let n = (t.count - k).min(RUN_MAX_COUNT);
            let part = Run {
                src: t.src + k * t.src_stride,
                dst: t.dst + k * t.dst_stride,
                count: n,
                ..t
            };
            let Some(o) = out.get_mut(at..at + 2) else {
                return Err((i, Miss::Shape));
            };
            let [a, b] = pack_run(&part);
            o[0] = a;
            o[1] = b;
            at += 2;
            acc.runs += 1;
            acc.run_max_count = acc.run_max_count.max(n);
            k += n;
        }
        acc.run_bytes += t.bytes();
        acc.run_copies += t.count;
        acc.kernel_bytes += t.bytes();
    }
    Ok(())
}

/// Launch shape of the run kernel: `(log2 of the work items per run
/// descriptor, log2 of the threads per copy)`.
pub fn run_shifts(acc: &Prepared) -> (u32, u32) {
    let kshift = acc
        .run_max_count
        .max(1)
        .next_power_of_two()
        .trailing_zeros();
    let words = (acc.run_bytes / acc.run_copies.max(1)).div_ceil(16);
    (kshift, group_for_words(words))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Block;
    use crate::ipc::schedule::unpack;

    fn b(src: u64, dst: u64, len: u64) -> Block {
        Block { src, dst, len }
    }

    fn r(src: u64, dst: u64, len: u64, count: u64, ss: u64, ds: u64) -> Run {
        Run {
            src,
            dst,
            len,
            count,
            src_stride: ss,
            dst_stride: ds,
        }
    }

    /// `prepare_runs` into a fresh buffer sized by `run_entries`.
    fn prep_runs(
        runs: &[Run],
        local: &RangeMap,
        remote: &RangeMap,
        t: &CopyTuning,
    ) -> Result<(Vec<Run>, Prepared), (usize, Miss)> {
        let mut out = vec![[0u64; 2]; run_entries(runs, t)];
        let mut acc = Prepared::default();
        let split = RunSplit::new(runs, t, None);
        assert_eq!(split.entries(), out.len());
        prepare_runs(
            runs,
            &split,
            Context {
                local,
                remote,
                tuning: t,
                pool: None,
            },
            &mut out,
            &mut acc,
        )?;
        assert_eq!(2 * acc.runs, out.len(), "run_entries is exact");
        let descs = out
            .chunks_exact(2)
            .map(|d| unpack_run([d[0], d[1]]))
            .collect();
        Ok((descs, acc))
    }

    /// Timing aid (`cargo test --release -- --ignored --nocapture`):
    /// preparing head-slice runs as `bench ipc --run-copies 64` submits them.
    #[test]
    #[ignore]
    fn prepare_runs_speed() {
        let (n, copies) = (16u64 << 10, 64u64);
        let local = RangeMap::new(vec![(1 << 30, 1 << 30, 0)]);
        let remote = RangeMap::new(vec![(8 << 30, 1 << 30, 1 << 12)]);
        let runs: Vec<Run> = (0..n)
            .map(|i| {
                let p = (i * 0x9E37_79B9) % n;
                r(
                    (1 << 30) + i * copies * 256,
                    (8 << 30) + p * copies * 512,
                    256,
                    copies,
                    256,
                    512,
                )
            })
            .collect();
        let t = CopyTuning::default();
        let mut out = vec![[0u64; 2]; run_entries(&runs, &t)];
        let mut acc = Prepared::default();
        let threads = rayon::ThreadPoolBuilder::new().build().unwrap();
        for _ in 0..3 {
            let t0 = std::time::Instant::now();
            let e = run_entries(std::hint::black_box(&runs), &t);
            println!(
                "run_entries {e}: {:.1} us",
                t0.elapsed().as_secs_f64() * 1e6
            );
        }
        for pool in [None, None, Some(&threads), Some(&threads), Some(&threads)] {
            acc.clear();
            let t0 = std::time::Instant::now();
            let split = RunSplit::new(&runs, &t, pool);
            prepare_runs(
                &runs,
                &split,
                Context {
                    local: &local,
                    remote: &remote,
                    tuning: &t,
                    pool,
                },
                &mut out,
                &mut acc,
            )
            .unwrap();
            let dt = t0.elapsed();
            println!(
                "prepare {n} runs, pool {}: {:.1} us, {:.2} ns/run",
                pool.is_some(),
                dt.as_secs_f64() * 1e6,
                dt.as_secs_f64() * 1e9 / n as f64
            );
        }
    }

    /// Preparing in chunks on a pool gives the very descriptors, pieces,
    /// memcpy blocks, counters and first failure of one sequential pass.
    #[test]
    fn parallel_prepare_runs_matches_sequential() {
        use rand::{Rng, SeedableRng, rngs::StdRng};
        let local = RangeMap::new(vec![(0x10_0000, 1 << 30, 0)]);
        let remote = RangeMap::new(vec![
            (8 << 30, 1 << 30, 1 << 12),
            (12 << 30, 1 << 30, -(1 << 20)),
        ]);
        let t = CopyTuning {
            memcpy_min_block: 1 << 20,
            ..CopyTuning::default()
        };
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(3)
            .build()
            .unwrap();
        let mut rng = StdRng::seed_from_u64(7);
        for round in 0..40 {
            let runs: Vec<Run> = (0..rng.gen_range(1..300))
                .map(|i| {
                    let len = match rng.gen_range(0..10) {
                        0 => 0,
                        1 => 100 << 10, // past a piece: pieces
                        2 => 2 << 20,   // memcpy blocks
                        _ => rng.gen_range(1..4096),
                    };
                    let count = rng.gen_range(1..200);
                    let ds = len.max(1) + rng.gen_range(0..64);
                    let base = if i % 2 == 0 { 8u64 << 30 } else { 12 << 30 };
                    r(
                        0x10_0000 + rng.gen_range(0..1u64 << 16),
                        base + rng.gen_range(0..1u64 << 20),
                        len,
                        count,
                        len,
                        ds,
                    )
                })
                .collect();
            let mut runs = runs;
            if round % 4 == 3 {
                // A failure in a later chunk.
                let k = runs.len() * 2 / 3;
                runs[k].dst = 1 << 45;
            }
            let n = run_entries(&runs, &t);
            let mut one = (vec![[0u64; 2]; n], Prepared::default());
            let split = RunSplit::new(&runs, &t, None);
            assert_eq!(split.entries(), n);
            let seq = prepare_runs(
                &runs,
                &split,
                Context {
                    local: &local,
                    remote: &remote,
                    tuning: &t,
                    pool: None,
                },
                &mut one.0,
                &mut one.1,
            );
            for chunk in [1, 7, 64] {
                let mut par = (vec![[0u64; 2]; n], Prepared::default());
                let split = RunSplit::with_chunk(&runs, &t, Some(&pool), chunk);
                assert_eq!(split.entries(), n);
                let got = prepare_runs(
                    &runs,
                    &split,
                    Context {
                        local: &local,
                        remote: &remote,
                        tuning: &t,
                        pool: Some(&pool),
                    },
                    &mut par.0,
                    &mut par.1,
                );
                assert_eq!(got, seq, "round {round} chunk {chunk}");
                if runs.len() > chunk {
                    // A split of other runs is refused before anything is written.
                    let mut acc = Prepared::default();
                    let other = &runs[..runs.len() - 1];
                    let wrong = RunSplit::with_chunk(other, &t, None, chunk);
                    let got = prepare_runs(
                        &runs,
                        &wrong,
                        Context {
                            local: &local,
                            remote: &remote,
                            tuning: &t,
                            pool: None,
                        },
                        &mut par.0,
                        &mut acc,
                    );
                    let same = RunSplit::with_chunk(&runs, &t, None, chunk);
                    if seq.is_ok() && wrong.entries != same.entries {
                        assert!(matches!(got, Err((_, Miss::Shape))), "{got:?}");
                    }
                }
                if seq.is_ok() {
                    assert_eq!(par, one, "round {round} chunk {chunk}");
                }
            }
        }
    }

    #[test]
    fn run_descriptors_round_trip() {
        for x in [
            r(
                0x7f00_0000_1234,
                0xffff_ffff_ffff_fff0,
                256,
                64,
                4096,
                1 << 31,
            ),
            r(1, 2, u64::from(u32::MAX), 1, u64::from(u32::MAX), 0),
        ] {
            assert_eq!(unpack_run(pack_run(&x)), x);
        }
    }

    #[test]
    fn prepare_runs_checks_spans_translates_and_splits() {
        let local = RangeMap::new(vec![(0x10_0000, 0x10_0000, 0)]);
        let remote = RangeMap::new(vec![
            (0x100_0000, 0x10_0000, 0x1000),
            (0x200_0000, 0x10_0000, -0x1000),
        ]);
        let t = CopyTuning::default();
        // 150 copies: descriptors of 64, 64 and 22 copies at the strides.
        let runs = [
            r(0x10_0000, 0x200_0000 + 0x1000, 256, 150, 1024, 512),
            r(0x10_0000, 0x100_0000, 0, 5, 0, 0),
            r(0x18_0000, 0x100_0000, 16, 1, 0, 0),
        ];
        let (descs, acc) = prep_runs(&runs, &local, &remote, &t).unwrap();
        assert_eq!(
            descs,
            vec![
                r(0x10_0000, 0x200_0000, 256, 64, 1024, 512),
                r(
                    0x10_0000 + 64 * 1024,
                    0x200_0000 + 64 * 512,
                    256,
                    64,
                    1024,
                    512
                ),
                r(
                    0x10_0000 + 128 * 1024,
                    0x200_0000 + 128 * 512,
                    256,
                    22,
                    1024,
                    512
                ),
                r(0x18_0000, 0x100_1000, 16, 1, 0, 0),
            ]
        );
        assert_eq!(acc.used, vec![0, 1]);
        assert_eq!((acc.run_copies, acc.run_bytes), (151, 150 * 256 + 16));
        assert_eq!(acc.kernel_bytes, acc.run_bytes);
        assert_eq!(acc.run_max_count, 64);
        assert_eq!(run_shifts(&acc), (6, 4));
        assert!(acc.pieces.is_empty() && acc.memcpy.is_empty());
        // The last copy decides: one byte past a region refuses the run.
        let end = 0x100_0000 + 0x10_0000;
        let bad = [runs[0], r(0x10_0000, end - 3 * 512 - 255, 256, 4, 0, 512)];
        assert_eq!(
            prep_runs(&bad, &local, &remote, &t).unwrap_err(),
            (1, Miss::Destination)
        );
        let bad = [r(0x10_0000, end - 4 * 512, 256, 4, 0, 512)];
        assert!(prep_runs(&bad, &local, &remote, &t).is_ok());
        let bad = [r(0x1f_ff00, 0x100_0000, 256, 2, 0x80, 256)];
        assert_eq!(
            prep_runs(&bad, &local, &remote, &t).unwrap_err(),
            (0, Miss::Source)
        );
        // Overlapping destination copies and overflowing spans are malformed.
        let bad = [r(0x10_0000, 0x100_0000, 256, 2, 256, 255)];
        assert_eq!(
            prep_runs(&bad, &local, &remote, &t).unwrap_err(),
            (0, Miss::Shape)
        );
        let bad = [r(0x10_0000, u64::MAX - 600, 256, 3, 0, 256)];
        assert_eq!(
            prep_runs(&bad, &local, &remote, &t).unwrap_err(),
            (0, Miss::Shape)
        );
    }

    #[test]
    fn runs_the_kernel_cannot_take_become_pieces_and_memcpy() {
        let remote = RangeMap::new(vec![(8 << 30, 1 << 30, 0x10)]);
        let t = CopyTuning {
            piece: 4096,
            memcpy_min_block: 1 << 20,
            ..CopyTuning::default()
        };
        let runs = [
            // copies longer than a piece: two pieces per copy
            r(1 << 30, 8 << 30, 6000, 3, 8192, 8192),
            // memcpy-sized copies
            r(
                1 << 30,
                (8 << 30) + (64 << 20),
                1 << 20,
                2,
                1 << 20,
                1 << 21,
            ),
            // a stride past 32 bits
            r(1 << 30, (8 << 30) + (512 << 20), 64, 2, 1 << 32, 64),
            // an ordinary run after them
            r(1 << 30, (8 << 30) + (900 << 20), 64, 5, 64, 128),
        ];
        let local = RangeMap::new(vec![(1 << 30, 6 << 30, 0)]);
        let (descs, acc) = prep_runs(&runs, &local, &remote, &t).unwrap();
        assert_eq!(
            descs,
            vec![r(1 << 30, (8 << 30) + (900 << 20) + 0x10, 64, 5, 64, 128)]
        );
        assert_eq!(acc.pieces.len(), 3 * 2 + 2);
        assert_eq!(
            unpack(acc.pieces[1]),
            b((1 << 30) + 4096, (8 << 30) + 0x10 + 4096, 6000 - 4096)
        );
        assert_eq!(
            unpack(acc.pieces[7]),
            b(
                (1 << 30) + (1 << 32),
                (8 << 30) + (512 << 20) + 0x10 + 64,
                64
            )
        );
        assert_eq!(acc.memcpy.len(), 2);
        assert_eq!(acc.memcpy[1].dst, (8 << 30) + (66 << 20) + 0x10);
        assert_eq!(acc.kernel_bytes, 3 * 6000 + 2 * 64 + 5 * 64);
        assert_eq!(acc.run_bytes, 5 * 64);
    }
}
