//! What one room may receive outside the engine: the decode-side pages,
//! state slots and aux slot it told its prefill ranks about, and the
//! prefill ranks it expects to hear from. Messages naming anything else are
//! another room's (or nobody's) and are refused.

use std::collections::{HashMap, HashSet};
use std::time::Instant;

use kvbridge_plan::{PrefillLayout, SlotFamily};

/// The prefill ranks of a room, by their unique rank number (what they put
/// in status and ABORT_ACK frames).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct ExpectedRanks {
    /// Ranks that send the room's status (every non-dummy rank).
    pub status: HashSet<u64>,
    /// Ranks that were told about the room and acknowledge its abort.
    pub all: HashSet<u64>,
    /// Each rank's engine session, where known (to fence it).
    pub sessions: HashMap<u64, String>,
    /// Each rank's pair key (secret mode): what its messages are bound by.
    pub keys: HashMap<u64, kvbridge_wire::PairKey>,
}

/// The room's destinations: KV pages, state slots per component, aux slot.
#[derive(Debug, Clone)]
pub(crate) struct RoomSlots {
    pages: HashSet<u64>,
    states: Vec<HashSet<u64>>,
    aux: u64,
    /// When the transfer request went out (the room's latency counts from here).
    pub asked_at: Instant,
}

impl RoomSlots {
    /// The slots named by a transfer request we sent.
    pub fn new(kv_indices: &[i32], aux_index: u64, state_indices: &[Vec<i32>]) -> Self {
        let index = |i: &i32| u64::try_from(*i).ok();
        Self {
            pages: kv_indices.iter().filter_map(index).collect(),
            states: state_indices
                .iter()
                .map(|l| l.iter().filter_map(index).collect())
                .collect(),
            aux: aux_index,
            asked_at: Instant::now(),
        }
    }

    /// Bytes a complete delivery writes into this room's slots of `layout`:
    /// every KV buffer's pages, the aux slot and the state slots. A page in
    /// two page spaces (HiSparse) counts once per space it was asked into.
    pub fn capacity_bytes(&self, layout: &PrefillLayout) -> u64 {
        let per_page: u64 = layout.kv_item_lens.iter().sum();
        let aux: u64 = layout.aux_item_lens.iter().sum();
        let states: u64 = layout
            .states
            .iter()
            .zip(&self.states)
            .map(|(c, slots)| (slots.len() as u64).saturating_mul(c.item_lens.iter().sum()))
            .fold(0, u64::saturating_add);
        (self.pages.len() as u64)
            .saturating_mul(per_page)
            .saturating_add(aux)
            .saturating_add(states)
    }

    fn indices(&self, family: SlotFamily) -> Option<SlotSet<'_>> {
        match family {
            SlotFamily::Kv => Some(SlotSet::Many(&self.pages)),
            SlotFamily::State(c) => self.states.get(c).map(SlotSet::Many),
            SlotFamily::Aux => Some(SlotSet::One(self.aux)),
        }
    }

    /// Whether `[dst, dst + len)` lies wholly inside slots of this room in
    /// one buffer of `layout` (pages, state slots or the aux slot); which
    /// slots a range covers is the planner's rule (`slots_at`).
    pub fn allows(&self, layout: &PrefillLayout, dst: u64, len: u64) -> bool {
        let Some(span) = layout.slots_at(dst, len) else {
            return false;
        };
        let Some(set) = self.indices(span.family) else {
            return false;
        };
        // A block can span consecutive slots (a merged run); each must be
        // the room's. Bounded: no legitimate block spans more slots than
        // the room has.
        if span.last - span.first >= set.len() as u64 {
            return false;
        }
        (span.first..=span.last).all(|i| set.contains(i))
    }
}

enum SlotSet<'a> {
    Many(&'a HashSet<u64>),
    One(u64),
}

impl SlotSet<'_> {
    fn len(&self) -> usize {
        match self {
            SlotSet::Many(s) => s.len(),
            SlotSet::One(_) => 1,
        }
    }

    fn contains(&self, i: u64) -> bool {
        match self {
            SlotSet::Many(s) => s.contains(&i),
            SlotSet::One(one) => *one == i,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn layout() -> PrefillLayout {
        PrefillLayout {
            kv_data_ptrs: vec![0x10000, 0x20000],
            kv_item_lens: vec![0x100, 0x100],
            aux_data_ptrs: vec![0x30000],
            aux_item_lens: vec![0x40],
            ..PrefillLayout::default()
        }
    }

    #[test]
    fn only_the_rooms_own_slots_are_allowed() {
        let l = layout();
        let room = RoomSlots::new(&[2, 3, 7], 5, &[]);
        assert!(room.allows(&l, 0x10200, 0x100), "page 2 of layer 0");
        assert!(room.allows(&l, 0x20200, 0x200), "pages 2-3, one merged run");
        assert!(!room.allows(&l, 0x10200, 0x300), "runs into page 4");
        assert!(!room.allows(&l, 0x10400, 0x10), "page 4 is another room's");
        assert!(room.allows(&l, 0x30000 + 5 * 0x40, 0x40), "own aux slot");
        assert!(
            !room.allows(&l, 0x30000 + 4 * 0x40, 0x40),
            "another aux slot"
        );
        assert!(!room.allows(&l, 0x100, 0x10), "below every buffer");
        assert!(!room.allows(&l, u64::MAX - 4, 0x10), "wraps around");
        assert!(!RoomSlots::new(&[-1], 0, &[]).allows(&l, 0x10000, 1));
    }
}
