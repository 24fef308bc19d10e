//! Prefill context parallelism (`filter_kv_indices_for_cp_rank`): when every
//! CP rank of a prefill transfers (each holds the whole KV after prefill),
//! rank `r` of `n` sends one contiguous share of the request's page
//! positions, and each chunk carries the part of its pages in that share.

use std::ops::Range;

/// Page positions `[start, end)` of a `total`-page request that CP rank
/// `rank` of `size` sends: `total / size` each, the first `total % size`
/// ranks one more.
pub fn cp_page_share(total: u64, rank: u64, size: u64) -> Range<u64> {
    if size <= 1 {
        return 0..total;
    }
    let (base, rem) = (total / size, total % size);
    let start = rank * base + rank.min(rem);
    let len = base + u64::from(rank < rem);
    start..start + len
}

/// The part of a chunk (`pages` at request positions `positions`) that CP
/// rank `rank` of `size` sends: the pages in its share and their positions
/// (empty, at the chunk's start, when none fall in it).
pub fn cp_filter_chunk(
    pages: &[i32],
    positions: Range<u64>,
    total: u64,
    rank: u64,
    size: u64,
) -> (&[i32], Range<u64>) {
    if size <= 1 {
        return (pages, positions);
    }
    let share = cp_page_share(total, rank, size);
    let (cs, ce) = (positions.start, positions.end);
    let first = share.start.max(cs) - cs;
    let last = share.end.min(ce).saturating_sub(cs);
    if last <= first {
        return (&pages[..0], cs..cs);
    }
    let (a, b) = (first as usize, (last as usize).min(pages.len()));
    if a >= b {
        return (&pages[..0], cs..cs);
    }
    (&pages[a..b], cs + first..cs + b as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ten_pages_over_four_ranks() {
        let shares: Vec<_> = (0..4).map(|r| cp_page_share(10, r, 4)).collect();
        assert_eq!(shares, vec![0..3, 3..6, 6..8, 8..10]);
    }

    #[test]
    fn a_chunk_keeps_the_pages_in_the_share() {
        let pages = [40, 41, 42, 43];
        // Chunk at positions 2..6 of 10 pages; rank 1 of 4 owns 3..6.
        assert_eq!(
            cp_filter_chunk(&pages, 2..6, 10, 1, 4),
            (&pages[1..4], 3..6)
        );
        assert_eq!(cp_filter_chunk(&pages, 2..6, 10, 3, 4), (&pages[..0], 2..2));
        assert_eq!(cp_filter_chunk(&pages, 2..6, 10, 0, 1), (&pages[..], 2..6));
    }
}
