//! The decode's staging ring (sglang `StagingAllocator`): one buffer handed
//! out front to back, wrapping to the start in a new round. Assigning
//! never waits (it overcommits); safety is the prefill's job: before it
//! writes an allocation of round `r`, it waits until the watermark shows
//! that everything of round `r - 1` the allocation overlaps was freed.
//!
//! **Owns:** allocation ids, offsets, rounds and the watermark `(round,
//! tail)`: the oldest allocation still held, or the start of a fresh
//! round once nothing is held.
//! **Never:** touches memory or sends anything.

use std::collections::{BTreeMap, HashMap};

/// One allocation: where it starts and in which round.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Allocation {
    /// The id [`Ring::free`] takes.
    pub id: u64,
    /// Byte offset in the ring.
    pub offset: u64,
    /// Bytes.
    pub len: u64,
    /// The ring round it belongs to.
    pub round: u64,
}

/// The ring's bookkeeping.
#[derive(Debug)]
pub(crate) struct Ring {
    size: u64,
    head: u64,
    round: u64,
    next_id: u64,
    /// Held allocations by id; `order` keeps them oldest first.
    held: HashMap<u64, Allocation>,
    order: BTreeMap<u64, ()>,
    watermark: (u64, u64),
}

impl Ring {
    /// An empty ring of `size` bytes.
    pub fn new(size: u64) -> Self {
        Self {
            size,
            head: 0,
            round: 0,
            next_id: 0,
            held: HashMap::new(),
            order: BTreeMap::new(),
            watermark: (0, 0),
        }
    }

    /// The ring's size in bytes.
    pub fn size(&self) -> u64 {
        self.size
    }

    /// Allocates `len` bytes at the head, wrapping into a new round when
    /// the rest of this round is too short; `None` when `len` exceeds the
    /// ring (the reference's `ALLOC_OVERSIZED`).
    pub fn assign(&mut self, len: u64) -> Option<Allocation> {
        if len > self.size {
            return None;
        }
        let offset = if len <= self.size - self.head {
            self.head
        } else {
            self.round += 1;
            0
        };
        self.head = offset + len;
        let a = Allocation {
            id: self.next_id,
            offset,
            len,
            round: self.round,
        };
        self.next_id += 1;
        self.held.insert(a.id, a);
        self.order.insert(a.id, ());
        Some(a)
    }

    /// Frees allocation `id` (unknown ids are ignored) and advances the
    /// watermark past the oldest allocations no longer held; returns
    /// whether the watermark moved.
    pub fn free(&mut self, id: u64) -> bool {
        if self.held.remove(&id).is_none() {
            return false;
        }
        self.order.remove(&id);
        let before = self.watermark;
        match self.order.keys().next() {
            None => {
                // Nothing held: the whole ring is reusable. Start a fresh
                // round at offset 0 so the watermark never goes stale.
                self.round += 1;
                self.head = 0;
                self.watermark = (self.round, 0);
            }
            Some(oldest) => {
                if let Some(a) = self.held.get(oldest) {
                    self.watermark = (a.round, a.offset);
                }
            }
        }
        self.watermark != before
    }

    /// `(round, tail)`: everything before it is free to write.
    pub fn watermark(&self) -> (u64, u64) {
        self.watermark
    }

    /// Allocations held.
    pub fn held(&self) -> usize {
        self.held.len()
    }
}

#[cfg(test)]
mod tests {
    use kvbridge_plan::watermark_ready;
    use proptest::prelude::*;

    use super::*;

    #[test]
    fn wraps_into_a_new_round_and_the_watermark_follows_the_oldest() {
        let mut r = Ring::new(100);
        let a = r.assign(60).unwrap();
        let b = r.assign(30).unwrap();
        assert_eq!((a.offset, a.round, b.offset, b.round), (0, 0, 60, 0));
        // 20 bytes do not fit after 90: round 1 from 0, overlapping `a`.
        let c = r.assign(20).unwrap();
        assert_eq!((c.offset, c.round), (0, 1));
        assert!(!watermark_ready(r.watermark(), 1, 20));
        assert!(r.free(a.id));
        assert_eq!(r.watermark(), (0, 60));
        assert!(watermark_ready(r.watermark(), 1, 20));
        assert!(r.assign(101).is_none());
        r.free(b.id);
        assert_eq!(r.watermark(), (1, 0));
        r.free(c.id);
        // Empty: a fresh round from 0.
        assert_eq!(r.watermark(), (2, 0));
        assert_eq!(r.assign(10).unwrap().offset, 0);
        assert!(!r.free(999));
    }

    /// sglang 0.5.23's `StagingAllocator` on random assign/free sequences
    /// (the golden file `python/interop/staging_fixture.py` writes): the
    /// same ids, offsets, rounds and watermarks after every step.
    #[test]
    fn replays_sglangs_allocator() {
        let f: serde_json::Value = serde_json::from_str(include_str!(
            "../../../kvbridge-plan/tests/fixtures/staging_sglang.json"
        ))
        .unwrap();
        let u = |v: &serde_json::Value| v.as_u64().unwrap();
        for case in f["allocator"].as_array().unwrap() {
            let mut r = Ring::new(u(&case["size"]));
            for op in case["ops"].as_array().unwrap() {
                let wm = match op[0].as_str().unwrap() {
                    "assign" => {
                        let got = r.assign(u(&op[1])).map(|a| vec![a.id, a.offset, a.round]);
                        let want = op[2]
                            .as_array()
                            .map(|v| v.iter().map(u).collect::<Vec<_>>());
                        assert_eq!(got, want, "{op}");
                        &op[3]
                    }
                    _ => {
                        r.free(u(&op[1]));
                        &op[2]
                    }
                };
                assert_eq!(r.watermark(), (u(&wm[0]), u(&wm[1])), "{op}");
            }
        }
    }

    proptest! {
        /// Whatever the order of assigns and frees, an allocation the
        /// watermark declares writable never overlaps a held one of an
        /// earlier round.
        #[test]
        fn writable_allocations_never_overlap_held_ones(
            ops in proptest::collection::vec((1u64..40, any::<bool>(), 0usize..8), 1..120)
        ) {
            let mut r = Ring::new(100);
            let mut held: Vec<Allocation> = Vec::new();
            for (len, free, pick) in ops {
                if free && !held.is_empty() {
                    let a = held.remove(pick % held.len());
                    r.free(a.id);
                } else if let Some(a) = r.assign(len) {
                    held.push(a);
                }
                for a in &held {
                    let end = (a.offset + a.len) as i64;
                    if !watermark_ready(r.watermark(), a.round as i64, end) {
                        continue;
                    }
                    for o in held.iter().filter(|o| o.round < a.round) {
                        let overlap = a.offset < o.offset + o.len && o.offset < a.offset + a.len;
                        prop_assert!(!overlap, "{a:?} writable over held {o:?}");
                    }
                }
            }
        }
    }
}
