//! The idle descriptor slots a session keeps between batches.
//!
//! **Owns:** which finished slots are kept for later batches and which are
//! freed. **Never:** touches CUDA itself (a slot frees its own buffers when
//! dropped), so the policy is tested without a GPU.

/// Descriptors of idle slots a session keeps for its next batches (16
/// bytes each in device memory and as much pinned host memory: 4 MiB of
/// each at most). A slot beyond it is freed, which waits for the whole GPU
/// (`cuMemFree`), and a later batch allocates one again (`cuMemHostAlloc`
/// pins pages): with more batches in flight than slots kept, that stalled
/// every copy in flight.
pub(crate) const IDLE_SLOT_DESCS: usize = 1 << 18;

/// What the idle list needs of a slot.
pub(crate) trait Reusable {
    /// The GPU its buffers are on.
    fn ordinal(&self) -> i32;
    /// Descriptors it holds.
    fn capacity(&self) -> usize;
}

/// Idle slots and their descriptors in all.
#[derive(Debug)]
pub(crate) struct IdleSlots<S> {
    slots: Vec<S>,
    descs: usize,
}

impl<S> Default for IdleSlots<S> {
    fn default() -> Self {
        Self {
            slots: Vec::new(),
            descs: 0,
        }
    }
}

impl<S: Reusable> IdleSlots<S> {
    /// An idle slot of GPU `ordinal` for `n` descriptors: one that fits,
    /// else any (the caller grows it); slots of other GPUs are freed.
    pub(crate) fn take(&mut self, ordinal: i32, n: usize) -> Option<S> {
        if self.slots.iter().any(|s| s.ordinal() != ordinal) {
            self.slots.retain(|s| s.ordinal() == ordinal);
            self.descs = self.slots.iter().map(S::capacity).sum();
        }
        let i = match self.slots.iter().position(|s| s.capacity() >= n) {
            Some(i) => i,
            None => self.slots.len().checked_sub(1)?,
        };
        let slot = self.slots.swap_remove(i);
        self.descs -= slot.capacity();
        Some(slot)
    }

    /// Keeps `slot` for a later batch while the idle slots then hold at
    /// most [`IDLE_SLOT_DESCS`] descriptors; frees it otherwise.
    pub(crate) fn give_back(&mut self, slot: S) {
        if self.descs + slot.capacity() <= IDLE_SLOT_DESCS {
            self.descs += slot.capacity();
            self.slots.push(slot);
        }
    }

    /// Idle slots kept now.
    #[cfg(test)]
    fn len(&self) -> usize {
        self.slots.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, PartialEq)]
    struct Fake(i32, usize);

    impl Reusable for Fake {
        fn ordinal(&self) -> i32 {
            self.0
        }
        fn capacity(&self) -> usize {
            self.1
        }
    }

    #[test]
    fn a_burst_of_small_slots_is_kept_whole() {
        // 64 batches in flight at once (the old list kept 8 and freed the rest).
        let mut idle = IdleSlots::default();
        for _ in 0..64 {
            idle.give_back(Fake(0, 1024));
        }
        assert_eq!(idle.len(), 64);
        for _ in 0..64 {
            assert_eq!(idle.take(0, 64), Some(Fake(0, 1024)));
        }
        assert_eq!(idle.take(0, 64), None);
    }

    #[test]
    fn kept_descriptors_stay_within_the_budget() {
        let mut idle = IdleSlots::default();
        let big = IDLE_SLOT_DESCS / 4;
        for _ in 0..10 {
            idle.give_back(Fake(0, big));
        }
        assert_eq!(idle.len(), 4, "four fill the budget, the rest are freed");
        assert!(idle.take(0, 1).is_some());
        idle.give_back(Fake(0, big));
        assert_eq!(idle.len(), 4);
        // Taken and given back alike, the count stays exact.
        for _ in 0..1000 {
            let s = idle.take(0, 1).unwrap();
            idle.give_back(s);
        }
        assert_eq!(idle.descs, 4 * big);
    }

    #[test]
    fn take_prefers_a_slot_that_fits_and_drops_other_gpus() {
        let mut idle = IdleSlots::default();
        idle.give_back(Fake(0, 1024));
        idle.give_back(Fake(1, 1 << 16));
        idle.give_back(Fake(0, 1 << 14));
        assert_eq!(idle.take(0, 4096), Some(Fake(0, 1 << 14)));
        // GPU 1's slot was freed on the way; the small one is grown by the caller.
        assert_eq!(idle.len(), 1);
        assert_eq!(idle.take(0, 1 << 20), Some(Fake(0, 1024)));
        assert_eq!(idle.take(0, 1), None);
        assert_eq!(idle.descs, 0);
    }
}
