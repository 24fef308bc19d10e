//! Which slots of our own buffers a byte range covers: the inverse of the
//! planner's address rules, for a decode rank that checks where a peer's
//! control-plane write (`STATE_DATA`, `AUX_DATA`) lands.
//!
//! **Owns:** the mapping from an address range to a buffer family and slot
//! indices. **Never:** decides whether those slots may be written (the
//! caller knows its rooms), or wraps an address.

use crate::layout::PrefillLayout;

/// The buffer family a slot belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SlotFamily {
    /// A KV buffer (slots are pages).
    Kv,
    /// A buffer of state component `c` (slots are state indices).
    State(usize),
    /// An aux buffer (slots are aux indices).
    Aux,
}

/// The slots a byte range covers, all in one buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SlotSpan {
    /// The buffer's family.
    pub family: SlotFamily,
    /// The first slot the range touches.
    pub first: u64,
    /// The last slot the range touches (`>= first`).
    pub last: u64,
}

impl PrefillLayout {
    /// The slots `[addr, addr + len)` covers in the buffer of this layout
    /// with the highest start at or below `addr` (a zero `len` counts as one
    /// byte). `None` when `addr` lies below every buffer, that buffer's slot
    /// size is 0, or the range wraps around the address space. A KV buffer
    /// without its own item length uses the first one. Buffer ends are not
    /// known here: callers check that the slots are theirs.
    ///
    /// ```
    /// use kvbridge_plan::{PrefillLayout, SlotFamily, SlotSpan};
    /// let layout = PrefillLayout {
    ///     kv_data_ptrs: vec![0x10000],
    ///     kv_item_lens: vec![0x100],
    ///     aux_data_ptrs: vec![0x30000],
    ///     aux_item_lens: vec![0x40],
    ///     ..PrefillLayout::default()
    /// };
    /// let span = layout.slots_at(0x10200, 0x180);
    /// assert_eq!(span, Some(SlotSpan { family: SlotFamily::Kv, first: 2, last: 3 }));
    /// assert_eq!(layout.slots_at(0x30000 + 5 * 0x40, 0x40).map(|s| s.first), Some(5));
    /// assert_eq!(layout.slots_at(0x100, 1), None);
    /// ```
    pub fn slots_at(&self, addr: u64, len: u64) -> Option<SlotSpan> {
        let end = addr.checked_add(len.max(1) - 1)?;
        let (base, item, family) = self.buffer_at(addr)?;
        if item == 0 {
            return None;
        }
        Some(SlotSpan {
            family,
            first: (addr - base) / item,
            last: (end - base) / item,
        })
    }

    /// The buffer with the highest start at or below `addr`:
    /// `(start, slot size, family)`.
    fn buffer_at(&self, addr: u64) -> Option<(u64, u64, SlotFamily)> {
        let kv = self.kv_data_ptrs.iter().enumerate().map(|(i, &p)| {
            let item = self
                .kv_item_lens
                .get(i)
                .or(self.kv_item_lens.first())
                .copied()
                .unwrap_or(0);
            (p, item, SlotFamily::Kv)
        });
        let states = self.states.iter().enumerate().flat_map(|(c, comp)| {
            comp.data_ptrs
                .iter()
                .zip(&comp.item_lens)
                .map(move |(&p, &item)| (p, item, SlotFamily::State(c)))
        });
        let aux = self
            .aux_data_ptrs
            .iter()
            .zip(&self.aux_item_lens)
            .map(|(&p, &item)| (p, item, SlotFamily::Aux));
        kv.chain(states)
            .chain(aux)
            .filter(|(p, _, _)| *p <= addr)
            .max_by_key(|(p, _, _)| *p)
    }
}
