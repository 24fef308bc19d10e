//! The planner's output unit and the canonical form of a block list
//! (docs/plan-scenario.md §2).

/// One byte range to copy: `len` bytes from prefill address `src` to decode
/// address `dst`.
///
/// `#[repr(C)]` and `Pod` so that a `&[Block]` can be reinterpreted by the
/// engine crate (which has an identical struct) with `bytemuck::cast_slice`,
/// without copying.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, bytemuck::Pod, bytemuck::Zeroable)]
pub struct Block {
    /// Source (prefill) address.
    pub src: u64,
    /// Destination (decode) address.
    pub dst: u64,
    /// Bytes to copy.
    pub len: u64,
}

impl Block {
    /// A block from its three fields.
    #[inline]
    pub const fn new(src: u64, dst: u64, len: u64) -> Self {
        Block { src, dst, len }
    }

    /// Whether `next` continues this block in both address spaces.
    #[inline]
    pub fn is_continued_by(&self, next: &Block) -> bool {
        self.src.checked_add(self.len) == Some(next.src)
            && self.dst.checked_add(self.len) == Some(next.dst)
    }
}

/// `count` equal copies at fixed strides: copy `i` moves `len` bytes from
/// `src + i * src_stride` to `dst + i * dst_stride` (e.g. one head slice of
/// every token of a page). One run stands for `count` blocks, so an engine
/// that copies runs natively is handed 1/`count` of the descriptors.
///
/// `#[repr(C)]` and `Pod`, identical to the engine crate's run.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, bytemuck::Pod, bytemuck::Zeroable)]
pub struct Run {
    /// Source (prefill) address of the first copy.
    pub src: u64,
    /// Destination (decode) address of the first copy.
    pub dst: u64,
    /// Bytes per copy.
    pub len: u64,
    /// Number of copies.
    pub count: u64,
    /// Source bytes from one copy to the next.
    pub src_stride: u64,
    /// Destination bytes from one copy to the next.
    pub dst_stride: u64,
}

impl Run {
    /// Copy `i` as a block (`i < count`; wrapping arithmetic).
    #[inline]
    pub fn block(&self, i: u64) -> Block {
        Block {
            src: self.src.wrapping_add(i.wrapping_mul(self.src_stride)),
            dst: self.dst.wrapping_add(i.wrapping_mul(self.dst_stride)),
            len: self.len,
        }
    }

    /// The run's copies as blocks, in order.
    pub fn blocks(&self) -> impl Iterator<Item = Block> + '_ {
        (0..self.count).map(|i| self.block(i))
    }

    /// Bytes the run moves (saturating).
    pub fn bytes(&self) -> u64 {
        self.len.saturating_mul(self.count)
    }

    /// Whether the last copy of this run is followed by copy 0 of `next`
    /// at the same strides (so the two are one run).
    #[inline]
    pub fn is_continued_by(&self, next: &Run) -> bool {
        self.len == next.len
            && self.src_stride == next.src_stride
            && self.dst_stride == next.dst_stride
            && self.block(self.count) == next.block(0)
    }
}

/// Every copy of `runs`, as blocks in order.
pub fn expand_runs(runs: &[Run]) -> Vec<Block> {
    runs.iter().flat_map(Run::blocks).collect()
}

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

    #[test]
    fn pod_cast_is_24_bytes() {
        let blocks = [Block::new(1, 2, 3)];
        let words: &[u64] = bytemuck::cast_slice(&blocks);
        assert_eq!(words, &[1, 2, 3]);
        assert_eq!(std::mem::size_of::<Block>(), 24);
    }
}
