//! What one room may receive outside the engine: the decode-side pages,
//! state slots and aux slot it told its prefill ranks about, and the
//! prefill ranks it expects to hear from. Messages naming anything else are
//! another room's (or nobody's) and are refused.

use std::collections::{HashMap, HashSet};

use kvbridge_plan::PrefillLayout;

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
}

/// The room's destinations: KV pages, state slots per component, aux slot.
#[derive(Debug, Clone, Default)]
pub(crate) struct RoomSlots {
    pages: HashSet<u64>,
    states: Vec<HashSet<u64>>,
    aux: u64,
}

/// A buffer family of our layout and which of a room's indices it takes.
#[derive(Clone, Copy)]
enum Family {
    Kv,
    State(usize),
    Aux,
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
        }
    }

    fn indices(&self, family: Family) -> Option<SlotSet<'_>> {
        match family {
            Family::Kv => Some(SlotSet::Many(&self.pages)),
            Family::State(c) => self.states.get(c).map(SlotSet::Many),
            Family::Aux => Some(SlotSet::One(self.aux)),
        }
    }

    /// Whether `[dst, dst + len)` lies wholly inside slots of this room in
    /// one buffer of `layout` (pages, state slots or the aux slot).
    pub fn allows(&self, layout: &PrefillLayout, dst: u64, len: u64) -> bool {
        let Some(last) = dst.checked_add(len.max(1) - 1) else {
            return false;
        };
        let Some((base, item, family)) = buffer_at(layout, dst) else {
            return false;
        };
        let (Some(set), true) = (self.indices(family), item > 0) else {
            return false;
        };
        let (first, end) = ((dst - base) / item, (last - base) / item);
        // A block can span consecutive slots (a merged run); each must be
        // the room's. Bounded: no legitimate block spans more slots than
        // the room has.
        if end - first >= set.len() as u64 {
            return false;
        }
        (first..=end).all(|i| set.contains(i))
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

/// The buffer of `layout` with the highest start at or below `addr`:
/// `(start, item length, family)`.
fn buffer_at(layout: &PrefillLayout, addr: u64) -> Option<(u64, u64, Family)> {
    let kv = layout.kv_data_ptrs.iter().enumerate().map(|(i, &p)| {
        let item = layout
            .kv_item_lens
            .get(i)
            .or(layout.kv_item_lens.first())
            .copied()
            .unwrap_or(0);
        (p, item, Family::Kv)
    });
    let states = layout.states.iter().enumerate().flat_map(|(c, comp)| {
        comp.data_ptrs
            .iter()
            .zip(&comp.item_lens)
            .map(move |(&p, &item)| (p, item, Family::State(c)))
    });
    let aux = layout
        .aux_data_ptrs
        .iter()
        .zip(&layout.aux_item_lens)
        .map(|(&p, &item)| (p, item, Family::Aux));
    kv.chain(states)
        .chain(aux)
        .filter(|(p, _, _)| *p <= addr)
        .max_by_key(|(p, _, _)| *p)
}

/// Slots of every live room, for messages that name only a room.
pub(crate) type SlotsByRoom = HashMap<u64, RoomSlots>;

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
