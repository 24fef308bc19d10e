//! # kvbridge-block
//!
//! The unit of work between kvbridge's planner and its transfer engines:
//! a [`Block`] (one contiguous copy), a [`Run`] (equal copies at fixed
//! strides) and a [`Batch`] of either, defined once here so that
//! `kvbridge-plan` produces exactly what `kvbridge-engine` consumes.
//!
//! **Owns:** the three types and the arithmetic on them (a run's copies,
//! spans, well-formedness, byte counts).
//!
//! **Never:** knows about layouts, sessions or memory; allocates except
//! where a run is expanded into blocks; panics on any field values (all
//! arithmetic is checked or wrapping by contract).
//!
//! ```
//! use kvbridge_block::{Batch, Block, Run};
//! let run = Run { src: 0, dst: 1000, len: 8, count: 3, src_stride: 16, dst_stride: 8 };
//! assert_eq!(run.block(2), Block::new(32, 1016, 8));
//! let runs = [run];
//! let batch = Batch::Runs(&runs);
//! assert_eq!(batch.bytes(), 24);
//! assert_eq!(batch.to_blocks().unwrap().len(), 3);
//! ```

use std::borrow::Cow;

/// One contiguous copy: `len` bytes from local address `src` to the peer's
/// address `dst`.
///
/// `#[repr(C)]` and `Pod`: a `&[Block]` is a `&[u64]` of `(src, dst, len)`
/// triples (what GPU copy kernels read).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, bytemuck::Pod, bytemuck::Zeroable)]
pub struct Block {
    /// Source address (local, e.g. the prefill rank's memory).
    pub src: u64,
    /// Destination address (in the peer's memory, e.g. the decode rank's).
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
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, bytemuck::Pod, bytemuck::Zeroable)]
pub struct Run {
    /// Source address of the first copy.
    pub src: u64,
    /// Destination address of the first copy.
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

    /// Bytes from the first copy's start to the last copy's end on each
    /// side, `(source span, destination span)`; `None` when that overflows,
    /// `Some((0, 0))` for an empty run.
    pub fn spans(&self) -> Option<(u64, u64)> {
        if self.count == 0 || self.len == 0 {
            return Some((0, 0));
        }
        let last = self.count - 1;
        let span = |stride: u64, base: u64| {
            let s = last.checked_mul(stride)?.checked_add(self.len)?;
            base.checked_add(s)?;
            Some(s)
        };
        Some((
            span(self.src_stride, self.src)?,
            span(self.dst_stride, self.dst)?,
        ))
    }

    /// Whether the run's destinations are pairwise disjoint and its spans
    /// fit the address space: what every engine requires of a run.
    pub fn is_well_formed(&self) -> bool {
        self.spans().is_some() && (self.count <= 1 || self.dst_stride >= self.len)
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

/// Every copy of `runs`, as blocks in order (no well-formedness check; see
/// [`Batch::to_blocks`] for the checked form).
pub fn expand_runs(runs: &[Run]) -> Vec<Block> {
    runs.iter().flat_map(Run::blocks).collect()
}

/// One batch handed to an engine: blocks, or strided runs.
#[derive(Debug, Clone, Copy)]
pub enum Batch<'a> {
    /// One copy per block.
    Blocks(&'a [Block]),
    /// Strided runs of copies.
    Runs(&'a [Run]),
}

impl<'a> From<&'a [Block]> for Batch<'a> {
    fn from(b: &'a [Block]) -> Self {
        Batch::Blocks(b)
    }
}

impl<'a> From<&'a [Run]> for Batch<'a> {
    fn from(r: &'a [Run]) -> Self {
        Batch::Runs(r)
    }
}

impl<'a> Batch<'a> {
    /// Blocks or runs in the batch (descriptors, not copies).
    pub fn len(&self) -> usize {
        match self {
            Batch::Blocks(b) => b.len(),
            Batch::Runs(r) => r.len(),
        }
    }

    /// Whether the batch holds no blocks or runs.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Bytes the batch moves (saturating).
    pub fn bytes(&self) -> u64 {
        match self {
            Batch::Blocks(b) => b.iter().fold(0u64, |a, b| a.saturating_add(b.len)),
            Batch::Runs(r) => r.iter().fold(0u64, |a, r| a.saturating_add(r.bytes())),
        }
    }

    /// Whether the batch moves no byte.
    pub fn moves_nothing(&self) -> bool {
        match self {
            Batch::Blocks(b) => b.iter().all(|b| b.len == 0),
            Batch::Runs(r) => r.iter().all(|r| r.bytes() == 0),
        }
    }

    /// The first non-empty source range, `(address, len)`.
    pub fn first_source(&self) -> Option<(u64, u64)> {
        match self {
            Batch::Blocks(b) => b.iter().find(|b| b.len > 0).map(|b| (b.src, b.len)),
            Batch::Runs(r) => r.iter().find(|r| r.bytes() > 0).map(|r| (r.src, r.len)),
        }
    }

    /// The index of the first run that is not [`Run::is_well_formed`]
    /// (`None` for blocks and for well-formed runs).
    pub fn first_malformed(&self) -> Option<usize> {
        match self {
            Batch::Blocks(_) => None,
            Batch::Runs(r) => r.iter().position(|r| !r.is_well_formed()),
        }
    }

    /// The batch as blocks: borrowed for blocks, expanded for runs; `Err`
    /// with the index of the first run that is not well formed.
    pub fn to_blocks(&self) -> Result<Cow<'a, [Block]>, usize> {
        match *self {
            Batch::Blocks(b) => Ok(Cow::Borrowed(b)),
            Batch::Runs(r) => {
                if let Some(i) = self.first_malformed() {
                    return Err(i);
                }
                let copies = r.iter().filter(|r| r.len > 0).map(|r| r.count);
                let n = copies.fold(0u64, u64::saturating_add);
                let mut out = Vec::with_capacity(usize::try_from(n).unwrap_or(0).min(1 << 20));
                for run in r.iter().filter(|r| r.len > 0) {
                    out.extend(run.blocks());
                }
                Ok(Cow::Owned(out))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn block_is_three_words() {
        let blocks = [Block::new(1, 2, 3)];
        let words: &[u64] = bytemuck::cast_slice(&blocks);
        assert_eq!(words, &[1, 2, 3]);
        assert_eq!(std::mem::size_of::<Block>(), 24);
        assert_eq!(std::mem::size_of::<Run>(), 48);
    }

    #[test]
    fn malformed_runs_are_found() {
        let ok = Run {
            src: 0,
            dst: 0,
            len: 4,
            count: 2,
            src_stride: 4,
            dst_stride: 4,
        };
        let overlap = Run {
            dst_stride: 2,
            ..ok
        };
        let wraps = Run {
            dst: u64::MAX - 3,
            ..ok
        };
        let runs = [ok, overlap, wraps];
        assert_eq!(Batch::Runs(&runs).first_malformed(), Some(1));
        assert_eq!(Batch::Runs(&runs[2..]).to_blocks(), Err(0));
        assert_eq!(Batch::Runs(&runs[..1]).to_blocks().unwrap().len(), 2);
        // One copy never overlaps itself.
        let single = Run {
            count: 1,
            dst_stride: 0,
            ..ok
        };
        assert!(single.is_well_formed());
    }

    #[test]
    fn empty_runs_expand_to_nothing() {
        let empty = [
            Run {
                len: 0,
                count: 5,
                ..Run::default()
            },
            Run {
                len: 4,
                ..Run::default()
            },
        ];
        let batch = Batch::Runs(&empty);
        assert!(batch.moves_nothing());
        assert!(batch.to_blocks().unwrap().is_empty());
        assert_eq!(batch.first_source(), None);
    }

    proptest! {
        #[test]
        fn run_blocks_match_the_definition(
            src in 0u64..1 << 40, dst in 0u64..1 << 40, len in 0u64..4096,
            count in 0u64..64, ss in 0u64..8192, ds in 0u64..8192,
        ) {
            let run = Run { src, dst, len, count, src_stride: ss, dst_stride: ds };
            let blocks: Vec<Block> = run.blocks().collect();
            prop_assert_eq!(blocks.len() as u64, count);
            for (i, b) in blocks.iter().enumerate() {
                let i = i as u64;
                prop_assert_eq!(*b, Block::new(src + i * ss, dst + i * ds, len));
            }
            prop_assert_eq!(run.bytes(), len * count);
            let batch_runs = [run];
            let batch = Batch::Runs(&batch_runs);
            prop_assert_eq!(batch.bytes(), len * count);
            if run.is_well_formed() {
                let expanded = batch.to_blocks().unwrap();
                let want = if len == 0 { 0 } else { count as usize };
                prop_assert_eq!(expanded.len(), want);
                // Destinations pairwise disjoint.
                let mut d: Vec<(u64, u64)> = expanded.iter().map(|b| (b.dst, b.len)).collect();
                d.sort_unstable();
                for w in d.windows(2) {
                    prop_assert!(w[0].0 + w[0].1 <= w[1].0);
                }
            } else {
                prop_assert!(count > 1 && ds < len);
            }
            // A run split in two is continued by its second half.
            if count >= 2 {
                let k = count / 2;
                let a = Run { count: k, ..run };
                let b = Run { src: run.block(k).src, dst: run.block(k).dst, count: count - k, ..run };
                prop_assert!(a.is_continued_by(&b));
            }
        }
    }
}
