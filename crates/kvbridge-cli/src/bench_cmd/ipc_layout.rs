//! The workloads of `kvbridge bench ipc`: the source pattern, where each
//! source block goes (affine scatter or head-slice pages) and the strided
//! runs that move it there.

use kvbridge_engine::Run;
use kvbridge_plan::rng::splitmix;

/// Threads for pattern generation and verification.
pub(super) fn threads() -> usize {
    std::thread::available_parallelism()
        .map_or(1, usize::from)
        .min(16)
}

/// The source pattern: a SplitMix64 word per 8 bytes.
pub(super) fn pattern(seed: u64, len: usize) -> Vec<u8> {
    let mut v = vec![0u8; len];
    let per = len.div_ceil(threads()).next_multiple_of(8).max(8);
    std::thread::scope(|s| {
        for (k, part) in v.chunks_mut(per).enumerate() {
            s.spawn(move || {
                let first = (k * per / 8) as u64;
                for (w, c) in part.chunks_mut(8).enumerate() {
                    let x = splitmix(seed ^ (first + w as u64)).to_le_bytes();
                    c.copy_from_slice(&x[..c.len()]);
                }
            });
        }
    });
    v
}

/// Destination slot of source block `i` of `n` (`n` a power of two: a bijection).
pub(super) fn slot(i: u64, n: u64, mult: u64, add: u64) -> u64 {
    if n.is_power_of_two() {
        (i.wrapping_mul(mult).wrapping_add(add)) & (n - 1)
    } else {
        i
    }
}

/// Destination block of source block `i` of `n`: the affine scatter
/// ([`slot`], `copies == 0`), or the head-slice layout of runs of `copies`
/// (TP 2 -> 1 aggregation): the source halves are two prefill ranks'
/// tokens, a decode page holds `copies` tokens of two slices each (first
/// half's, then second half's), and page `p` lands at page `slot(p)`.
pub(super) fn dest(i: u64, n: u64, mult: u64, add: u64, copies: u64) -> u64 {
    if copies == 0 {
        return slot(i, n, mult, add);
    }
    let half = n / 2;
    let (rank, token) = (i / half, i % half);
    let (page, j) = (token / copies, token % copies);
    slot(page, half / copies, mult, add) * 2 * copies + 2 * j + rank
}

/// The runs that move source block `i` to [`dest`]`(i, .., copies)`: one
/// per page and half, `copies` slices of `size` bytes at the token strides.
pub(super) fn head_slice_runs(
    src: u64,
    dst: u64,
    n: u64,
    size: u64,
    copies: u64,
    mult: u64,
    add: u64,
) -> Vec<Run> {
    let half = n / 2;
    let pages = half / copies;
    (0..2)
        .flat_map(|rank| {
            (0..pages).map(move |p| Run {
                src: src + (rank * half + p * copies) * size,
                dst: dst + (slot(p, pages, mult, add) * 2 * copies + rank) * size,
                len: size,
                count: copies,
                src_stride: size,
                dst_stride: 2 * size,
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The runs move every source block exactly to its `dest`, and `dest`
    /// is a bijection (so the target's check covers every byte).
    #[test]
    fn head_slice_runs_land_blocks_at_dest() {
        let (n, size, copies) = (1u64 << 12, 256u64, 16u64);
        let (mult, add) = (0x9E37_79B9_7F4A_7C15 | 1, n / 3);
        let (src, dst) = (1u64 << 40, 1u64 << 41);
        let runs = head_slice_runs(src, dst, n, size, copies, mult, add);
        assert_eq!(runs.len() as u64, n / copies);
        let mut seen = vec![false; n as usize];
        for r in &runs {
            for k in 0..r.count {
                let b = r.block(k);
                let i = (b.src - src) / size;
                let d = (b.dst - dst) / size;
                assert_eq!(d, dest(i, n, mult, add, copies));
                assert!(!std::mem::replace(&mut seen[d as usize], true));
            }
        }
        assert!(seen.iter().all(|&x| x));
        assert_eq!(dest(5, n, mult, add, 0), slot(5, n, mult, add));
    }
}
