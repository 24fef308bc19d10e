//! Strided runs in the IPC engine's plan: the run kernel's 32-byte
//! descriptors, checking and translating a run's whole spans, and the
//! launch shape of the run kernel.

use super::{Cursor, Miss, Prepared, RangeMap, group_for_words, memcpy_from};
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

/// [`prepare`] for strided runs: check each run's whole source span against
/// `local` and destination span against `remote` (one range each), translate
/// the destination and write run descriptors of at most [`RUN_MAX_COUNT`]
/// copies into `out` (at least [`run_entries`] long). Runs the run kernel
/// cannot take (long copies, wide strides) are expanded into block pieces
/// or memcpy blocks in `acc`. Returns the first failing run.
pub fn prepare_runs(
    runs: &[Run],
    local: &RangeMap,
    remote: &RangeMap,
    tuning: &CopyTuning,
    out: &mut [[u64; 2]],
    acc: &mut Prepared,
) -> Result<(), (usize, Miss)> {
    let (piece, memcpy_from) = (tuning.piece.max(16), memcpy_from(tuning));
    let (mut src, mut dst) = (Cursor::new(local), Cursor::new(remote));
    let first = acc.used.len();
    let mut at = 2 * acc.runs;
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
    if acc.used.len() > first {
        acc.used.sort_unstable();
        acc.used.dedup();
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
    use crate::ipc::plan::unpack;

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
        prepare_runs(runs, local, remote, t, &mut out, &mut acc)?;
        assert_eq!(2 * acc.runs, out.len(), "run_entries is exact");
        let descs = out
            .chunks_exact(2)
            .map(|d| unpack_run([d[0], d[1]]))
            .collect();
        Ok((descs, acc))
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
