//! What `plan --svg` draws, worked out from a plan: which prefill item
//! (page, state slot, aux slot) and which heads of it land in which decode
//! item and heads, per buffer pair, with the bytes and blocks of each link.

use std::collections::BTreeMap;

use kvbridge_plan::Block;
use kvbridge_plan::scenario::ScenarioInputs;

/// A family of buffers, as the picture groups them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Space {
    /// KV buffer `i`.
    Kv(usize),
    /// Buffer `b` of state component `c`.
    State(usize, usize),
    /// Aux buffer `i`.
    Aux(usize),
}

impl std::fmt::Display for Space {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Space::Kv(i) => write!(f, "KV buffer {i}"),
            Space::State(c, b) => write!(f, "state {c} buffer {b}"),
            Space::Aux(i) => write!(f, "aux buffer {i}"),
        }
    }
}

/// One side's buffers: base address, bytes per item, family; by base.
#[derive(Debug, Default)]
struct Buffers(Vec<(u64, u64, Space)>);

impl Buffers {
    fn push(&mut self, base: u64, item: u64, space: Space) {
        if item > 0 {
            self.0.push((base, item, space));
        }
    }

    fn sorted(mut self) -> Self {
        self.0.sort_by_key(|e| e.0);
        self
    }

    /// Bytes per item of the buffer of `space`.
    fn item_len(&self, space: Space) -> Option<u64> {
        self.0.iter().find(|e| e.2 == space).map(|e| e.1)
    }

    /// The buffer `addr` falls in (the highest base at or below it), the
    /// item index and the offset inside the item.
    fn locate(&self, addr: u64) -> Option<(Space, u64, u64)> {
        let i = self.0.partition_point(|e| e.0 <= addr).checked_sub(1)?;
        let (base, item, space) = self.0[i];
        let off = addr - base;
        Some((space, off / item, off % item))
    }
}

/// One end of a link: an item of a buffer and, for KV, the heads touched.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Place {
    pub space: Space,
    pub item: u64,
    /// First and last head (inclusive) of the item's tokens, when the
    /// block covers only some heads of a token.
    pub heads: Option<(u64, u64)>,
}

/// Bytes and blocks moved from one place to another.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Flow {
    pub bytes: u64,
    pub blocks: u64,
}

/// One link: where from, where to, how much.
pub type Link = (Place, Place, Flow);

/// The links of one buffer pair.
pub type Column = ((Space, Space), Vec<Link>);

/// The plan as links between places.
#[derive(Debug, Default)]
pub struct Picture {
    /// Every link, ordered by source then destination.
    pub links: BTreeMap<(Place, Place), Flow>,
    /// KV heads a prefill page holds, and bytes per head per token.
    pub src_heads: u64,
    pub head_bytes: u64,
    /// KV heads a decode page holds.
    pub dst_heads: u64,
    /// Blocks whose source or destination lies in no buffer.
    pub unplaced: u64,
}

impl Picture {
    /// Works out the links of `blocks`, planned for `inputs`.
    pub fn new(inputs: &ScenarioInputs, blocks: &[Block]) -> Self {
        let l = &inputs.layout;
        let r = &inputs.registration;
        let mut src = Buffers::default();
        let mut dst = Buffers::default();
        for (i, (&base, &item)) in l.kv_data_ptrs.iter().zip(&l.kv_item_lens).enumerate() {
            src.push(base, item, Space::Kv(i));
        }
        for (i, &base) in r.dst_kv_ptrs.iter().enumerate() {
            let item = r
                .dst_kv_item_lens
                .get(i)
                .copied()
                .unwrap_or(r.dst_kv_item_len);
            dst.push(base, item, Space::Kv(i));
        }
        for (i, (&base, &item)) in l.aux_data_ptrs.iter().zip(&l.aux_item_lens).enumerate() {
            src.push(base, item, Space::Aux(i));
            if let Some(&d) = r.dst_aux_ptrs.get(i) {
                dst.push(d, item, Space::Aux(i));
            }
        }
        for (c, comp) in l.states.iter().enumerate() {
            for (b, (&base, &item)) in comp.data_ptrs.iter().zip(&comp.item_lens).enumerate() {
                src.push(base, item, Space::State(c, b));
            }
            let dptrs = r.dst_state_data_ptrs.get(c).cloned().unwrap_or_default();
            let dlens = r.dst_state_item_lens.get(c).cloned().unwrap_or_default();
            for (b, (&base, &item)) in dptrs.iter().zip(&dlens).enumerate() {
                dst.push(base, item, Space::State(c, b));
            }
        }
        let (src, dst) = (src.sorted(), dst.sorted());
        let page = l.page_size.max(1);
        let src_heads = l.kv_head_num.max(1);
        let src_token = l.kv_item_lens.first().copied().unwrap_or(0) / page;
        let head_bytes = (src_token / src_heads).max(1);
        let dst_token = r.dst_kv_item_len / page;
        let dst_heads = (dst_token / head_bytes).max(1);
        let mut picture = Picture {
            src_heads,
            head_bytes,
            dst_heads,
            ..Picture::default()
        };
        let heads = |space: Space, off: u64, len: u64, token: u64, count: u64| match space {
            Space::Kv(_) if token > 0 && len < token && count > 1 => {
                let first = (off % token) / head_bytes;
                let last = first + len.div_ceil(head_bytes).max(1) - 1;
                Some((first, last.min(count - 1)))
            }
            _ => None,
        };
        for b in blocks {
            picture.add(&src, &dst, b, (src_token, dst_token), heads);
        }
        picture
    }

    /// Adds block `b`, cut where it crosses an item boundary on either side
    /// (a merged run of pages is one link per page); `tokens` are bytes per
    /// token on each side, `heads` finds a slice's heads.
    fn add(
        &mut self,
        src: &Buffers,
        dst: &Buffers,
        b: &Block,
        tokens: (u64, u64),
        heads: impl Fn(Space, u64, u64, u64, u64) -> Option<(u64, u64)>,
    ) {
        /// Pieces of one block followed at most (the rest count whole).
        const MAX_PIECES: u32 = 4096;
        let mut done = 0;
        let mut pieces = 0;
        while done < b.len {
            let (Some((ss, si, so)), Some((ds, di, d_off))) =
                (src.locate(b.src + done), dst.locate(b.dst + done))
            else {
                self.unplaced += 1;
                return;
            };
            let left = b.len - done;
            let len = if pieces + 1 >= MAX_PIECES {
                left
            } else {
                let to_end = |space, off| src.item_len(space).map_or(left, |i| i - off);
                left.min(to_end(ss, so))
                    .min(dst.item_len(ds).map_or(left, |i| i - d_off))
            };
            let from = Place {
                space: ss,
                item: si,
                heads: heads(ss, so, len, tokens.0, self.src_heads),
            };
            let to = Place {
                space: ds,
                item: di,
                heads: heads(ds, d_off, len, tokens.1, self.dst_heads),
            };
            let flow = self.links.entry((from, to)).or_default();
            flow.bytes += len;
            if pieces == 0 {
                flow.blocks += 1;
            }
            done += len.max(1);
            pieces += 1;
        }
    }

    /// The buffer pairs of the links, in order, each with its links.
    pub fn pairs(&self) -> Vec<Column> {
        let mut out: BTreeMap<(Space, Space), Vec<Link>> = BTreeMap::new();
        for (&(a, b), &f) in &self.links {
            out.entry((a.space, b.space)).or_default().push((a, b, f));
        }
        out.into_iter().collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn inputs(json: &str) -> ScenarioInputs {
        kvbridge_plan::scenario::Scenario::from_json(json)
            .unwrap()
            .inputs()
    }

    #[test]
    fn head_slices_land_on_the_decode_heads_they_belong_to() {
        // Prefill TP 1 with 4 heads -> decode TP 2: rank 1 takes heads 2-3.
        let json = r#"{"engine_rank": 0, "attn_tp_size": 1, "page_size": 2, "kv_head_num": 4,
            "kv_data_ptrs": [1000000, 2000000], "kv_item_lens": [64, 64],
            "dst_kv_ptrs": [5000000, 6000000], "dst_tp_rank": 1, "dst_attn_tp_size": 2,
            "dst_kv_item_len": 32, "dst_kv_indices": [7], "prefill_kv_indices": [3],
            "is_last_chunk": false}"#;
        let i = inputs(json);
        let s = kvbridge_plan::scenario::Scenario::from_json(json).unwrap();
        let blocks = kvbridge_plan::plan_scenario(&s).unwrap();
        let p = Picture::new(&i, &blocks);
        assert_eq!(
            (p.src_heads, p.dst_heads, p.head_bytes, p.unplaced),
            (4, 2, 8, 0)
        );
        let pairs = p.pairs();
        assert_eq!(pairs.len(), 2, "K and V");
        for ((a, b), links) in &pairs {
            assert_eq!(a, b);
            assert_eq!(links.len(), 1, "{links:?}");
            let (from, to, flow) = links[0];
            assert_eq!((from.item, from.heads), (3, Some((2, 3))));
            // The decode page holds exactly those two heads: whole tokens there.
            assert_eq!((to.item, to.heads), (7, None));
            assert_eq!((flow.bytes, flow.blocks), (32, 2), "2 tokens of 16 bytes");
        }
    }
}
