//! Runs of concurrently contiguous index pairs (`group_concurrent_contiguous`)
//! and the small arithmetic helpers every rule uses.

use std::ops::Range;

use crate::error::PlanError;

/// A maximal run of pairs `(a + k, b + k)` for `k < n`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct IndexRun {
    /// First source index.
    pub a: u64,
    /// First destination index.
    pub b: u64,
    /// Pairs in the run.
    pub n: u64,
}

/// A list of runs plus the maxima that bound every block derived from them,
/// so that emitters can check 64-bit overflow once per buffer pair instead
/// of once per block.
#[derive(Debug, Default, Clone)]
pub(crate) struct IndexRuns {
    pub runs: Vec<IndexRun>,
    pub max_a: u64,
    pub max_b: u64,
    pub max_n: u64,
}

/// A page/slot index as it arrives (`i32` from the wire, `i64` for state
/// indices) converted to a checked non-negative `u64`.
pub(crate) trait PageIndex: Copy {
    /// The index as `u64`, or `None` when negative or outside `i32` (numpy int32).
    fn to_page(self) -> Option<u64>;
    /// The raw value for error messages.
    fn raw(self) -> i64;
}

impl PageIndex for i32 {
    #[inline]
    fn to_page(self) -> Option<u64> {
        u64::try_from(self).ok()
    }
    #[inline]
    fn raw(self) -> i64 {
        i64::from(self)
    }
}

impl PageIndex for i64 {
    #[inline]
    fn to_page(self) -> Option<u64> {
        if (0..=i64::from(i32::MAX)).contains(&self) {
            u64::try_from(self).ok()
        } else {
            None
        }
    }
    #[inline]
    fn raw(self) -> i64 {
        self
    }
}

/// Checked conversion of one index.
#[inline]
pub(crate) fn page<I: PageIndex>(i: I, what: &'static str) -> Result<u64, PlanError> {
    i.to_page().ok_or(PlanError::InvalidIndex {
        what,
        value: i.raw(),
    })
}

impl IndexRuns {
    /// Empties the set, keeping its allocation.
    pub fn clear(&mut self) {
        self.runs.clear();
        self.max_a = 0;
        self.max_b = 0;
        self.max_n = 0;
    }

    /// Number of runs.
    pub fn len(&self) -> usize {
        self.runs.len()
    }

    /// Appends one pair, extending the last run when both sides continue it.
    #[inline]
    pub fn push_pair(&mut self, a: u64, b: u64) {
        if let Some(last) = self.runs.last_mut()
            && last.a.wrapping_add(last.n) == a
            && last.b.wrapping_add(last.n) == b
        {
            last.n += 1;
            return;
        }
        self.runs.push(IndexRun { a, b, n: 1 });
    }

    /// Recomputes the maxima after a sequence of `push_pair`.
    pub fn finish(&mut self) {
        let (mut ma, mut mb, mut mn) = (0, 0, 0);
        for r in &self.runs {
            ma = ma.max(r.a);
            mb = mb.max(r.b);
            mn = mn.max(r.n);
        }
        self.max_a = ma;
        self.max_b = mb;
        self.max_n = mn;
    }

    /// Replaces the set with the runs of two index lists
    /// (`group_concurrent_contiguous`): either list empty gives no runs;
    /// both non-empty with different lengths is an error.
    pub fn build<S: PageIndex, D: PageIndex>(
        &mut self,
        src: &[S],
        dst: &[D],
        src_what: &'static str,
        dst_what: &'static str,
    ) -> Result<(), PlanError> {
        self.clear();
        if src.is_empty() || dst.is_empty() {
            return Ok(());
        }
        if src.len() != dst.len() {
            return Err(PlanError::IndexLengthMismatch {
                src: src.len(),
                dst: dst.len(),
            });
        }
        for (&s, &d) in src.iter().zip(dst) {
            let a = page(s, src_what)?;
            let b = page(d, dst_what)?;
            self.push_pair(a, b);
        }
        self.finish();
        Ok(())
    }
}

/// Python slice `[start:end]` of a list of `len` elements (negative bounds
/// count from the end, everything clipped), as a range of positions.
pub(crate) fn py_slice(len: usize, start: i128, end: i128) -> Range<usize> {
    let n = len as i128;
    let norm = |x: i128| -> i128 {
        let x = if x < 0 { x + n } else { x };
        x.clamp(0, n)
    };
    let s = norm(start);
    let e = norm(end);
    // Both are within 0..=len, so the conversions cannot fail.
    let s = usize::try_from(s).unwrap_or(len);
    let e = usize::try_from(e).unwrap_or(len);
    if e < s { s..s } else { s..e }
}

/// `a * b` or [`PlanError::AddressOverflow`].
#[inline]
pub(crate) fn mul(a: u64, b: u64) -> Result<u64, PlanError> {
    a.checked_mul(b).ok_or(PlanError::AddressOverflow)
}

/// `a + b` or [`PlanError::AddressOverflow`].
#[inline]
pub(crate) fn add(a: u64, b: u64) -> Result<u64, PlanError> {
    a.checked_add(b).ok_or(PlanError::AddressOverflow)
}

/// `base + index * size` or [`PlanError::AddressOverflow`].
#[inline]
pub(crate) fn addr(base: u64, index: u64, size: u64) -> Result<u64, PlanError> {
    add(base, mul(index, size)?)
}

/// `v` if it fits in `i64` (numpy int64 arithmetic of the reference), else
/// [`PlanError::SignedOverflow`].
#[inline]
pub(crate) fn signed(v: u64, what: &'static str) -> Result<u64, PlanError> {
    if i64::try_from(v).is_ok() {
        Ok(v)
    } else {
        Err(PlanError::SignedOverflow { what })
    }
}

/// `usize` to `u64` (lossless on every supported target).
#[inline]
pub(crate) fn u64_of(x: usize) -> u64 {
    u64::try_from(x).unwrap_or(u64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn runs(src: &[i32], dst: &[i32]) -> Result<Vec<(u64, u64, u64)>, PlanError> {
        let mut set = IndexRuns::default();
        set.build(src, dst, "src", "dst")?;
        Ok(set.runs.iter().map(|r| (r.a, r.b, r.n)).collect())
    }

    #[test]
    fn runs_split_where_either_side_breaks() {
        assert_eq!(
            runs(&[5, 6, 7, 20, 21], &[43, 44, 45, 7, 8]).unwrap(),
            vec![(5, 43, 3), (20, 7, 2)]
        );
        assert_eq!(
            runs(&[1, 2, 3], &[1, 2, 4]).unwrap(),
            vec![(1, 1, 2), (3, 4, 1)]
        );
        // A repeated index is a break (diff 0), a descending one too.
        assert_eq!(
            runs(&[3, 3, 2], &[0, 1, 2]).unwrap(),
            vec![(3, 0, 1), (3, 1, 1), (2, 2, 1)]
        );
    }

    #[test]
    fn runs_empty_side_gives_nothing() {
        assert_eq!(runs(&[], &[1, 2]).unwrap(), vec![]);
        assert_eq!(runs(&[1, 2], &[]).unwrap(), vec![]);
    }

    #[test]
    fn runs_length_mismatch_is_an_error() {
        assert_eq!(
            runs(&[1, 2], &[1]),
            Err(PlanError::IndexLengthMismatch { src: 2, dst: 1 })
        );
    }

    #[test]
    fn runs_reject_negative_indices() {
        assert!(matches!(
            runs(&[-1], &[1]),
            Err(PlanError::InvalidIndex { value: -1, .. })
        ));
    }

    #[test]
    fn runs_track_maxima() {
        let mut set = IndexRuns::default();
        set.build(&[9i32, 10, 2], &[0i32, 1, 7], "s", "d").unwrap();
        assert_eq!((set.max_a, set.max_b, set.max_n), (9, 7, 2));
    }

    #[test]
    fn py_slice_matches_python() {
        assert_eq!(py_slice(5, 1, 3), 1..3);
        assert_eq!(py_slice(5, 3, 10), 3..5);
        assert_eq!(py_slice(5, 7, 10), 5..5);
        assert_eq!(py_slice(5, 3, 1), 3..3);
        assert_eq!(py_slice(5, 1, -1), 1..4);
        assert_eq!(py_slice(5, -2, 5), 3..5);
        assert_eq!(py_slice(5, -9, 5), 0..5);
        assert_eq!(py_slice(5, 0, -9), 0..0);
    }
}
