//! The planner's output unit and the canonical form of a block list
//! (docs/plan-scenario.md §2).

pub use kvbridge_block::{Block, Run, expand_runs};

/// Canonical form of a block list (docs/plan-scenario.md §2): zero-length
/// blocks dropped, blocks that continue each other in both address spaces
/// merged into maximal runs, the result sorted by `(src, dst, len)`.
///
/// Two plans are equal when their canonical forms are equal; the order of
/// blocks and the way a range is split into blocks do not matter.
pub fn canonicalize(blocks: &[Block]) -> Vec<Block> {
    let mut v: Vec<Block> = blocks.iter().copied().filter(|b| b.len != 0).collect();
    // Blocks that can merge share `dst - src`; within one such diagonal,
    // sorting by `src` makes every continuation a neighbour.
    v.sort_unstable_by_key(|b| (b.dst.wrapping_sub(b.src), b.src, b.len));
    let mut out: Vec<Block> = Vec::with_capacity(v.len());
    for b in v {
        match out.last_mut() {
            Some(last) if last.is_continued_by(&b) => {
                // A merged length past u64 cannot describe real memory; such a
                // block simply stays apart.
                match last.len.checked_add(b.len) {
                    Some(len) => last.len = len,
                    None => out.push(b),
                }
            }
            _ => out.push(b),
        }
    }
    out.sort_unstable_by_key(|b| (b.src, b.dst, b.len));
    out
}

/// Total bytes of a block list.
pub fn total_bytes(blocks: &[Block]) -> u128 {
    blocks.iter().map(|b| u128::from(b.len)).sum()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn canonical_merges_both_spaces_only() {
        let blocks = [
            Block::new(10, 110, 5),
            Block::new(0, 100, 10),
            Block::new(15, 200, 5), // continues src but not dst
            Block::new(20, 300, 0), // dropped
        ];
        assert_eq!(
            canonicalize(&blocks),
            vec![Block::new(0, 100, 15), Block::new(15, 200, 5)]
        );
    }

    #[test]
    fn canonical_keeps_duplicates() {
        let blocks = [Block::new(0, 0, 4), Block::new(0, 0, 4)];
        assert_eq!(canonicalize(&blocks), blocks.to_vec());
    }

    #[test]
    fn canonical_is_order_and_split_invariant() {
        let a = [
            Block::new(0, 64, 32),
            Block::new(32, 96, 32),
            Block::new(1000, 0, 8),
        ];
        let b = [Block::new(1000, 0, 8), Block::new(0, 64, 64)];
        assert_eq!(canonicalize(&a), canonicalize(&b));
    }
}
