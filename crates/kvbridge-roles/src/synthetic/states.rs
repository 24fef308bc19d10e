//! Synthetic state components: mamba slots (whole or TP-sliced, with
//! concatenated conv sub-blocks), page-indexed states (SWA windows, DSA
//! indexer K) and DSA tail rings, each filled with the verifiable pattern and
//! indexed per request the way sglang's pools index them.

use super::buf::PoolBuf;
use super::model::{ModelSpec, RankSpec, global_head};
use super::pattern::{Verified, item_offset, slice_pattern, state_seed};
use super::state_spec::{Kind, StateBuffer, StateSpec};
use super::{PoolError, RequestSlots};
use kvbridge_plan::{StateComponent, StateType};

/// Live slots of a tail ring after `tokens` tokens: the last three quarters
/// of a ring's worth (so that rings wrap), fewer for short requests.
fn ring_live(tokens: u64, ring: u64) -> u64 {
    tokens.min(ring * 3 / 4)
}

/// One buffer of a component on this rank.
#[derive(Debug)]
struct Buffer {
    shape: usize,
    layer: u64,
    item: u64,
    mem: PoolBuf,
}

/// One component's buffers on one rank.
#[derive(Debug)]
pub(super) struct StatePool {
    component: u64,
    spec: StateSpec,
    state_type: StateType,
    rank: RankSpec,
    page_size: u64,
    pages: u64,
    buffers: Vec<Buffer>,
}

/// One unit of an item: `(offset in the item, bytes, pattern seed)`.
type Unit = (usize, usize, u64);

impl StatePool {
    /// Allocates the component's buffers for this rank's layers: `pages`
    /// pages (page kind) or `slots` rows (slot and ring kinds) each.
    pub(super) fn new(
        component: u64,
        spec: &StateSpec,
        model: &ModelSpec,
        rank: RankSpec,
        pages: u64,
        slots: u64,
        device: Option<i32>,
    ) -> Result<Self, PoolError> {
        let state_type = spec
            .state_type
            .parse::<StateType>()
            .map_err(|e| PoolError::Model(e.to_string()))?;
        let (start, end) = rank.layer_range(model.layers);
        let layers = spec.layers_in(|l| model.is_kv_layer(l), start, end);
        let mut buffers = Vec::new();
        for (shape, b) in spec.buffers.iter().enumerate() {
            let item = b.item_len(model.page_size, rank.tp_size);
            let rows = if b.kind() == Kind::Page { pages } else { slots };
            for &layer in &layers {
                buffers.push(Buffer {
                    shape,
                    layer,
                    item,
                    mem: PoolBuf::new(item * rows, device)?,
                });
            }
        }
        Ok(Self {
            component,
            spec: spec.clone(),
            state_type,
            rank,
            page_size: model.page_size,
            pages,
            buffers,
        })
    }

    /// Whether this is an SWA sub-pool (its pages are NHD: tokens, heads, bytes).
    pub(super) fn is_swa(&self) -> bool {
        self.state_type == StateType::Swa
    }

    /// The component as this rank registers it.
    pub(super) fn component(&self) -> StateComponent {
        let bufs = &self.buffers;
        let shape = |b: &Buffer| &self.spec.buffers[b.shape];
        let slot = self.spec.kind() == Kind::Slot;
        let mut c = StateComponent::new(
            self.state_type,
            bufs.iter().map(|b| b.mem.addr()).collect(),
            bufs.iter().map(|b| b.item).collect(),
        );
        c.layer_ids = bufs.iter().map(|b| b.layer as i64).collect();
        if slot {
            c.dim_per_tensor = bufs
                .iter()
                .map(|b| shape(b).local_dim(self.rank.tp_size))
                .collect();
            c.conv_shard_groups = bufs
                .iter()
                .map(|b| match shape(b) {
                    StateBuffer::Slot { groups, .. } if !groups.is_empty() => Some(groups.clone()),
                    _ => None,
                })
                .collect();
            c.slice_outer_counts = bufs
                .iter()
                .map(|b| match shape(b) {
                    StateBuffer::Slot { outer, .. } => *outer,
                    _ => 1,
                })
                .collect();
        }
        c
    }

    /// Byte length of each buffer.
    pub(super) fn data_lens(&self) -> Vec<u64> {
        self.buffers.iter().map(|b| b.mem.len() as u64).collect()
    }

    /// Positions in the request's page list that this component moves.
    fn window(&self, req: &RequestSlots) -> std::ops::Range<usize> {
        let first = self
            .spec
            .window_tokens
            .map_or(0, |w| req.tokens.saturating_sub(w) / self.page_size.max(1));
        let first = usize::try_from(first).unwrap_or(usize::MAX);
        first.min(req.pages.len())..req.pages.len()
    }

    /// The request's index list for this component, as sglang passes it:
    /// `[slot]`, page numbers of its own page pool (mirrored from the KV
    /// pages, so that they differ), or `[row, off1, n1, off2, n2, ring]`.
    pub(super) fn indices(&self, req: &RequestSlots) -> Vec<i64> {
        let slot = req.slot as i64;
        match self.spec.buffers.first() {
            None | Some(StateBuffer::Slot { .. }) => vec![slot],
            Some(StateBuffer::Page { .. }) => req.pages[self.window(req)]
                .iter()
                .map(|&p| self.pages as i64 - 1 - i64::from(p))
                .collect(),
            Some(StateBuffer::Ring { ring, .. }) => {
                let ring = (*ring).max(1);
                let n = ring_live(req.tokens, ring);
                let start = (req.tokens - n) % ring;
                let n1 = n.min(ring - start);
                [req.slot, start, n1, 0, n - n1, ring]
                    .iter()
                    .map(|&v| v as i64)
                    .collect()
            }
        }
    }

    /// Every item the request owns in buffer `b`: `(item index, units)`.
    fn items(&self, room: u64, req: &RequestSlots, b: &Buffer) -> Vec<(i64, Vec<Unit>)> {
        let c = self.component;
        let (tp, rank) = (self.rank.tp_size.max(1), self.rank.tp_rank);
        let seed = |pos, elem| state_seed(room, c, b.shape as u64, b.layer, pos, elem);
        match &self.spec.buffers[b.shape] {
            StateBuffer::Slot {
                outer,
                dim,
                unit_bytes,
                groups,
            } => {
                let ub = *unit_bytes as usize;
                let local = if *dim == 0 { 1 } else { dim / tp };
                let mut units = Vec::new();
                for o in 0..*outer {
                    for j in 0..local {
                        let elem = if *dim == 0 {
                            0
                        } else {
                            global_unit(groups, *dim, tp, rank, j)
                        };
                        units.push((((o * local + j) as usize) * ub, ub, seed(o, elem)));
                    }
                }
                vec![(req.slot as i64, units)]
            }
            StateBuffer::Page {
                heads,
                head_bytes,
                sliced,
            } => {
                let hb = *head_bytes as usize;
                let shape = &self.spec.buffers[b.shape];
                let local = shape.local_heads(tp);
                let idx = self.indices(req);
                self.window(req)
                    .zip(idx)
                    .map(|(k, page)| {
                        let mut units = Vec::new();
                        for s in 0..self.page_size {
                            let token = k as u64 * self.page_size + s;
                            for h in 0..local {
                                let head = if *sliced {
                                    global_head(*heads, tp, rank, h)
                                } else {
                                    h
                                };
                                let off = ((s * local + h) as usize) * hb;
                                units.push((off, hb, seed(token, head)));
                            }
                        }
                        (page, units)
                    })
                    .collect()
            }
            StateBuffer::Ring { ring, slot_bytes } => {
                let ring = (*ring).max(1);
                let sb = *slot_bytes as usize;
                let n = ring_live(req.tokens, ring);
                let units = (req.tokens - n..req.tokens)
                    .map(|t| (((t % ring) as usize) * sb, sb, seed(t, 0)))
                    .collect();
                vec![(req.slot as i64, units)]
            }
        }
    }

    /// Writes the request's pattern into its items.
    pub(super) fn fill(&mut self, room: u64, req: &RequestSlots) {
        let mut writes = Vec::new();
        for (i, b) in self.buffers.iter().enumerate() {
            for (index, units) in self.items(room, req, b) {
                let mut item = vec![0u8; b.item as usize];
                // A ring row is only partly live: keep what else it holds.
                if let Some(off) = item_offset(index, b.item) {
                    b.mem.read(off, &mut item);
                }
                for (off, len, seed) in units {
                    if let Some(dst) = item.get_mut(off..off + len) {
                        slice_pattern(seed, dst);
                    }
                }
                writes.push((i, index, item));
            }
        }
        for (i, index, item) in writes {
            let b = &mut self.buffers[i];
            if let Some(off) = item_offset(index, b.item) {
                b.mem.write(off, &item);
            }
        }
    }

    /// Checks every byte the request should have received.
    pub(super) fn verify(&self, room: u64, req: &RequestSlots) -> Verified {
        let mut v = Verified::default();
        for b in &self.buffers {
            for (index, units) in self.items(room, req, b) {
                let mut item = vec![0u8; b.item as usize];
                let read = item_offset(index, b.item).is_some_and(|off| b.mem.read(off, &mut item));
                for (off, len, seed) in units {
                    let got = if read { item.get(off..off + len) } else { None };
                    v.check(seed, got, len);
                }
            }
        }
        v
    }
}

/// The whole-model position of local unit `j` of `rank`'s share of a
/// `dim`-unit axis split over `tp` ranks, sub-block by sub-block.
fn global_unit(groups: &[u64], dim: u64, tp: u64, rank: u64, j: u64) -> u64 {
    if groups.is_empty() {
        return rank * (dim / tp) + j;
    }
    let (mut full_before, mut local_before) = (0, 0);
    for &g in groups {
        let sub = g / tp;
        if j < local_before + sub {
            return full_before + rank * sub + (j - local_before);
        }
        full_before += g;
        local_before += sub;
    }
    dim + j
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn conv_sub_blocks_map_to_their_global_channels() {
        // [q | k | v] = [4 | 4 | 8] over TP 2: rank 1 holds q[2..4], k[2..4], v[4..8].
        let g = [4, 4, 8];
        let got: Vec<u64> = (0..8).map(|j| global_unit(&g, 16, 2, 1, j)).collect();
        assert_eq!(got, vec![2, 3, 6, 7, 12, 13, 14, 15]);
        assert_eq!(global_unit(&[], 16, 4, 3, 1), 13);
    }

    #[test]
    fn ring_segments_wrap() {
        // 21 tokens in a ring of 8: 6 live tokens 15..21 at slots 7, 0..5.
        assert_eq!(ring_live(21, 8), 6);
        let start = (21 - 6) % 8;
        assert_eq!(start, 7);
    }
}
