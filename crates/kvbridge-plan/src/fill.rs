//! Appending a plan's blocks from several threads at once.
//!
//! A multi-million-block plan (per-token head slices) is bound by writing its
//! 24-byte blocks; one core's stores leave most of the memory bandwidth
//! unused. [`append_parts`] splits such a plan into equal parts (one per
//! buffer pair and page), writes contiguous ranges of parts on scoped threads
//! straight into the plan's spare capacity, and leaves the output identical to
//! writing it on one thread.

use std::mem::MaybeUninit;
use std::num::NonZeroUsize;

use crate::block::Block;
use crate::error::PlanError;

/// Plans with fewer blocks are written on the calling thread.
pub(crate) const PARALLEL_MIN_BLOCKS: usize = 1 << 20;

/// Most threads one plan is written with.
const MAX_THREADS: usize = 8;

/// Threads a planner may write one large plan with: the cores this process
/// may use, at most [`MAX_THREADS`].
pub(crate) fn default_threads() -> usize {
    std::thread::available_parallelism()
        .map_or(1, NonZeroUsize::get)
        .min(MAX_THREADS)
}

/// Appends `parts × part_len` blocks to `out`: part `p` is the `part_len`
/// blocks `make(p)` yields, in order. Uses up to `threads` threads when the
/// plan has at least [`PARALLEL_MIN_BLOCKS`] blocks. A part that yields fewer
/// than `part_len` blocks is an internal error and appends nothing.
pub(crate) fn append_parts<I, F>(
    out: &mut Vec<Block>,
    parts: usize,
    part_len: usize,
    threads: usize,
    make: F,
) -> Result<(), PlanError>
where
    F: Fn(usize) -> I + Sync,
    I: Iterator<Item = Block>,
{
    let total = parts
        .checked_mul(part_len)
        .ok_or(PlanError::Internal("plan size overflows usize"))?;
    if total == 0 {
        return Ok(());
    }
    out.reserve(total);
    let start = out.len();
    let spare = &mut out.spare_capacity_mut()[..total];
    let threads = if total >= PARALLEL_MIN_BLOCKS {
        threads.clamp(1, parts)
    } else {
        1
    };
    let complete = if threads == 1 {
        write_parts(spare, 0, part_len, &make)
    } else {
        let per_thread = parts.div_ceil(threads);
        std::thread::scope(|scope| {
            let mut handles = Vec::with_capacity(threads);
            let mut segments = spare.chunks_mut(per_thread * part_len).enumerate();
            // The calling thread writes the first segment itself.
            let first = segments.next();
            for (i, segment) in segments {
                let make = &make;
                handles.push(
                    scope.spawn(move || write_parts(segment, i * per_thread, part_len, make)),
                );
            }
            let mut complete =
                first.is_none_or(|(_, segment)| write_parts(segment, 0, part_len, &make));
            for handle in handles {
                complete &= handle.join().unwrap_or(false);
            }
            complete
        })
    };
    if !complete {
        return Err(PlanError::Internal("a plan part yielded too few blocks"));
    }
    // SAFETY: `spare` is `out`'s capacity from `start` to `start + total`
    // (reserved above), and `complete` says that every `write_parts` call
    // wrote every slot of its segment; the segments tile `spare` exactly
    // (`chunks_mut`), so all `total` blocks past `start` are initialized.
    unsafe { out.set_len(start + total) };
    Ok(())
}

/// Writes parts `first..` into `segment`, `part_len` blocks each; true when
/// every slot of `segment` was written.
fn write_parts<I, F>(
    segment: &mut [MaybeUninit<Block>],
    first: usize,
    part_len: usize,
    make: &F,
) -> bool
where
    F: Fn(usize) -> I,
    I: Iterator<Item = Block>,
{
    let mut complete = true;
    for (k, slots) in segment.chunks_exact_mut(part_len).enumerate() {
        let mut written = 0;
        for (slot, block) in slots.iter_mut().zip(make(first + k)) {
            slot.write(block);
            written += 1;
        }
        complete &= written == part_len;
    }
    complete && segment.len().is_multiple_of(part_len)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn block(p: usize, t: usize) -> Block {
        Block {
            src: (p * 1000 + t) as u64,
            dst: (p * 7 + t) as u64,
            len: 3,
        }
    }

    #[test]
    fn parallel_output_equals_serial_output() {
        let parts = (PARALLEL_MIN_BLOCKS / 64) + 5;
        let mut serial = vec![Block {
            src: 1,
            dst: 2,
            len: 3,
        }];
        let mut parallel = serial.clone();
        append_parts(&mut serial, parts, 64, 1, |p| {
            (0..64).map(move |t| block(p, t))
        })
        .expect("serial");
        for threads in [2, 3, 8] {
            parallel.truncate(1);
            append_parts(&mut parallel, parts, 64, threads, |p| {
                (0..64).map(move |t| block(p, t))
            })
            .expect("parallel");
            assert_eq!(parallel, serial, "{threads} threads");
        }
        assert_eq!(serial.len(), 1 + parts * 64);
    }

    #[test]
    fn a_short_part_is_an_error_and_appends_nothing() {
        let parts = PARALLEL_MIN_BLOCKS / 16;
        for threads in [1, 2] {
            let mut out = vec![Block {
                src: 1,
                dst: 2,
                len: 3,
            }];
            let err = append_parts(&mut out, parts, 16, threads, |p| {
                let n = if p == parts - 1 { 15 } else { 16 };
                (0..n).map(move |t| block(p, t))
            });
            assert!(matches!(err, Err(PlanError::Internal(_))), "{err:?}");
            assert_eq!(out.len(), 1);
        }
    }

    #[test]
    fn small_plans_and_empty_plans() {
        let mut out = Vec::new();
        append_parts(&mut out, 0, 64, 4, |p| (0..64).map(move |t| block(p, t))).expect("empty");
        assert!(out.is_empty());
        append_parts(&mut out, 3, 2, 4, |p| (0..2).map(move |t| block(p, t))).expect("small");
        assert_eq!(
            out,
            vec![
                block(0, 0),
                block(0, 1),
                block(1, 0),
                block(1, 1),
                block(2, 0),
                block(2, 1)
            ]
        );
    }
}
