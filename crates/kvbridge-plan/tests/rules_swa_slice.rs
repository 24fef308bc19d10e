//! SWA state between different attention TP sizes (sglang 0.5.23
//! `_send_swa_state_slice`): every byte a plan moves is traced back to its
//! (buffer, page, token, global head, byte) on both sides, and every byte of
//! the decode rank's pages must be written from the same position.

#![allow(clippy::unwrap_used)] // tests unwrap what they construct

mod common;

use std::collections::HashMap;

use common::*;
use kvbridge_plan::{
    Block, PeerRegistration, PlanError, PrefillLayout, StateType, TransferChunk, TransferRequest,
};

/// Bytes of one head of one token.
const HB: u64 = 8;

/// One rank's SWA geometry.
#[derive(Clone, Copy)]
struct Side {
    tp: u64,
    total: u64,
    page_size: u64,
}

impl Side {
    fn heads(self) -> u64 {
        (self.total / self.tp).max(1)
    }
    fn item(self) -> u64 {
        self.page_size * self.heads() * HB
    }
    /// Global KV head of local head `h` on rank `r` (GQA replication when
    /// the TP size exceeds the heads).
    fn global(self, r: u64, h: u64) -> u64 {
        if self.tp <= self.total {
            r * self.heads() + h
        } else {
            r / (self.tp / self.total)
        }
    }
    /// `(buffer, page, token, global head, byte)` of an address.
    fn locate(self, base: u64, rank: u64, addr: u64) -> (u64, u64, u64, u64, u64) {
        let off = addr - base;
        let (buf, off) = (off / GIB, off % GIB);
        let (page, off) = (off / self.item(), off % self.item());
        let token_bytes = self.heads() * HB;
        let (token, off) = (off / token_bytes, off % token_bytes);
        (buf, page, token, self.global(rank, off / HB), off % HB)
    }
}

struct Case {
    p: u64,
    d: u64,
    total: u64,
    page_size: u64,
    layers: usize,
}

type Inputs = (
    PrefillLayout,
    PeerRegistration,
    TransferRequest,
    TransferChunk,
);

fn setup(c: &Case, r: u64, dr: u64, si: &[i64], di: &[i64]) -> Inputs {
    let (src, dst) = sides(c);
    let mut l = mha(1, c.page_size, src.item());
    l.attn_tp_size = c.p;
    l.engine_rank = r;
    l.kv_head_num = src.heads();
    l.total_kv_head_num = c.total;
    l.swa_kv_cache_layout = Some("nhd".into());
    let mut reg = peer(2, dst.item());
    reg.dst_attn_tp_size = c.d;
    reg.dst_tp_rank = dr;
    let (mut req, mut ch) = (request(&[]), chunk(&[]));
    add_state(
        &mut l,
        &mut reg,
        &mut req,
        &mut ch,
        state(StateType::Swa, 2 * c.layers, src.item()),
        ptrs(SD, 2 * c.layers),
        vec![dst.item(); 2 * c.layers],
        Some(si.to_vec()),
        di.to_vec(),
    );
    (l, reg, req, ch)
}

fn sides(c: &Case) -> (Side, Side) {
    let side = |tp| Side {
        tp,
        total: c.total,
        page_size: c.page_size,
    };
    (side(c.p), side(c.d))
}

fn plan_pair(c: &Case, r: u64, dr: u64, si: &[i64], di: &[i64]) -> Result<Vec<Block>, PlanError> {
    let (l, reg, req, ch) = setup(c, r, dr, si, di);
    plan(&l, &reg, &req, &ch)
}

/// The prefill ranks whose heads decode rank `dr` holds.
fn writers(c: &Case, dr: u64) -> Vec<u64> {
    if c.p <= c.d {
        vec![dr / (c.d / c.p)]
    } else {
        let k = c.p / c.d;
        (dr * k..(dr + 1) * k).collect()
    }
}

/// Plans every writer of every decode rank and checks each byte's origin and
/// that each decode byte of the pages is written.
fn check(c: &Case, si: &[i64], di: &[i64]) {
    let (src, dst) = sides(c);
    let n = si.len().min(di.len());
    let page_of: HashMap<u64, u64> = di[..n]
        .iter()
        .zip(&si[..n])
        .map(|(&d, &s)| (d as u64, s as u64))
        .collect();
    for dr in 0..c.d {
        let mut written: HashMap<u64, u64> = HashMap::new();
        for r in writers(c, dr) {
            let blocks = plan_pair(c, r, dr, si, di).unwrap();
            for blk in blocks {
                for x in 0..blk.len {
                    let s = src.locate(SS, r, blk.src + x);
                    let d = dst.locate(SD, dr, blk.dst + x);
                    assert_eq!(s.0, d.0, "buffer, case p={} d={}", c.p, c.d);
                    assert_eq!(page_of.get(&d.1), Some(&s.1), "page pairing");
                    assert_eq!((s.2, s.3, s.4), (d.2, d.3, d.4), "token/head/byte");
                    *written.entry(blk.dst + x).or_default() += 1;
                }
            }
        }
        let pages = page_of.len() as u64;
        let expect = 2 * c.layers as u64 * pages * dst.item();
        assert_eq!(
            written.len() as u64,
            expect,
            "coverage p={} d={} dr={dr}",
            c.p,
            c.d
        );
    }
}

#[test]
fn scatter_and_aggregation_move_every_head_to_its_place() {
    for (p, d, total) in [
        (1, 2, 4),
        (1, 4, 4),
        (2, 4, 8),
        (2, 1, 4),
        (4, 1, 4),
        (4, 2, 8),
        (1, 2, 1), // GQA: one head replicated on both decode ranks
        (1, 4, 2),
        (4, 2, 2), // replicated on the prefill side
    ] {
        let c = Case {
            p,
            d,
            total,
            page_size: 4,
            layers: 2,
        };
        check(&c, &[3, 4, 9], &[7, 8, 2]);
    }
}

#[test]
fn index_lists_of_different_lengths_are_truncated_first() {
    let c = Case {
        p: 1,
        d: 2,
        total: 4,
        page_size: 2,
        layers: 1,
    };
    check(&c, &[1, 2, 3], &[5, 6]);
}

#[test]
fn whole_token_slices_merge_into_pages() {
    // One head on every rank: each token is whole on both sides.
    let c = Case {
        p: 1,
        d: 2,
        total: 1,
        page_size: 4,
        layers: 1,
    };
    let got = plan_pair(&c, 0, 1, &[3, 4], &[7, 8]).unwrap();
    let item = 4 * HB;
    assert_eq!(
        got,
        canon(vec![
            b(SS + 3 * item, SD + 7 * item, 2 * item),
            b(SS + GIB + 3 * item, SD + GIB + 7 * item, 2 * item),
        ])
    );
}

#[test]
fn refusals_name_what_cannot_be_sliced() {
    let c = Case {
        p: 1,
        d: 2,
        total: 4,
        page_size: 4,
        layers: 1,
    };
    let run = |f: &dyn Fn(&mut PrefillLayout, &mut PeerRegistration)| {
        let (mut l, mut reg, req, ch) = setup(&c, 0, 0, &[1], &[1]);
        f(&mut l, &mut reg);
        plan(&l, &reg, &req, &ch)
    };
    // Without the pool's page layout: refused as the reference seed does.
    assert_eq!(
        run(&|l, _| l.swa_kv_cache_layout = None),
        Err(PlanError::PagedStateTpMismatch {
            state_type: StateType::Swa
        })
    );
    assert_eq!(
        run(&|l, _| l.swa_kv_cache_layout = Some("hnd".into())),
        Err(PlanError::SwaHeadSliceLayout {
            layout: "hnd".into()
        })
    );
    assert_eq!(
        run(&|l, _| {
            l.pp_size = 2;
            l.prefill_end_layer = Some(1);
        }),
        Err(PlanError::SwaHeadSlicePipeline { pp_size: 2 })
    );
    // A single envelope region has no per-layer K/V split.
    assert_eq!(
        run(&|l, r| {
            l.states[0].data_ptrs.truncate(1);
            l.states[0].item_lens.truncate(1);
            r.dst_state_data_ptrs[0].truncate(1);
            r.dst_state_item_lens[0].truncate(1);
        }),
        Err(PlanError::SwaHeadSliceEntries { src: 1, dst: 1 })
    );
    // The decode's page holds 3 heads' worth where 2 were expected.
    let bad = 4 * 3 * HB;
    assert_eq!(
        run(&|_, r| r.dst_state_item_lens[0] = vec![bad; 2]),
        Err(PlanError::SwaHeadSliceItemLens {
            src_item: 4 * 4 * HB,
            dst_item: bad,
            src_heads: 4,
            dst_heads: 2,
            total_heads: 4,
            page_size: 4,
        })
    );
    // Other page-indexed states stay refused between TP sizes.
    assert_eq!(
        run(&|l, _| l.states[0].state_type = StateType::Dsa),
        Err(PlanError::PagedStateTpMismatch {
            state_type: StateType::Dsa
        })
    );
}
