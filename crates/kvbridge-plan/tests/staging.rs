//! Staging (gather, one bulk write per writer, scatter) delivers exactly
//! the bytes the per-slice plan delivers, for every TP pairing, GQA
//! replication, page size and slot split.

use kvbridge_plan::{
    PeerRegistration, Planner, PrefillLayout, PreparedPeer, Run, StagingSource, StagingTarget,
    TransferChunk, TransferRequest, expand_runs,
};
use proptest::prelude::*;

/// A sparse address space: buffers at fixed bases.
#[derive(Default)]
struct Mem {
    regions: Vec<(u64, Vec<u8>)>,
}

impl Mem {
    fn add(&mut self, base: u64, len: usize) -> u64 {
        self.regions.push((base, vec![0; len]));
        base
    }

    fn locate(&mut self, addr: u64, len: u64) -> &mut [u8] {
        for (base, data) in &mut self.regions {
            if addr >= *base && addr + len <= *base + data.len() as u64 {
                let off = (addr - *base) as usize;
                return &mut data[off..off + len as usize];
            }
        }
        panic!("address {addr:#x}+{len} outside every region");
    }

    fn read(&mut self, addr: u64, len: u64) -> Vec<u8> {
        self.locate(addr, len).to_vec()
    }

    fn copy_runs(&mut self, runs: &[Run]) {
        for b in expand_runs(runs) {
            let data = self.read(b.src, b.len);
            self.locate(b.dst, b.len).copy_from_slice(&data);
        }
    }
}

#[derive(Debug, Clone)]
struct Case {
    p: u64,
    d: u64,
    total_heads: u64,
    head_bytes: u64,
    page_size: u64,
    layers: u64,
    pages: u64,
    split: usize,
}

fn cases() -> impl Strategy<Value = Case> {
    (
        prop_oneof![
            Just((1u64, 2u64)),
            Just((2, 1)),
            Just((2, 4)),
            Just((4, 2)),
            Just((8, 2)),
            Just((1, 8)),
            Just((4, 1))
        ],
        prop_oneof![Just(1u64), Just(2), Just(4), Just(8)],
        prop_oneof![Just(2u64), Just(4), Just(6)],
        prop_oneof![Just(1u64), Just(2), Just(4)],
        1u64..=3,
        1u64..=4,
        0usize..6,
    )
        .prop_map(
            |((p, d), total_heads, head_bytes, page_size, layers, pages, split)| Case {
                p,
                d,
                total_heads,
                head_bytes,
                page_size,
                layers,
                pages,
                split,
            },
        )
}

/// The byte of global head `h` of token `tok` in slot `s`.
fn content(s: u64, tok: u64, h: u64, b: u64) -> u8 {
    ((s * 131 + tok * 31 + h * 7 + b * 3) % 255 + 1) as u8
}

const POOL_PAGES: u64 = 16;

/// A rank's layout with buffers in `mem`, filled with its heads.
fn rank_layout(
    mem: &mut Mem,
    c: &Case,
    tp: u64,
    rank: u64,
    base: u64,
    pages: &[i32],
) -> PrefillLayout {
    let heads = (c.total_heads / tp).max(1);
    let replication = (tp / c.total_heads).max(1);
    let first_head = (rank / replication) * heads;
    let item = c.page_size * heads * c.head_bytes;
    let mut ptrs = Vec::new();
    for s in 0..2 * c.layers {
        let addr = mem.add(base + s * 0x10_0000, (item * POOL_PAGES) as usize);
        for (i, p) in pages.iter().enumerate() {
            for t in 0..c.page_size {
                for h in 0..heads {
                    for b in 0..c.head_bytes {
                        let at = addr
                            + *p as u64 * item
                            + t * heads * c.head_bytes
                            + h * c.head_bytes
                            + b;
                        let tok = i as u64 * c.page_size + t;
                        mem.locate(at, 1)[0] = content(s, tok, first_head + h, b);
                    }
                }
            }
        }
        ptrs.push(addr);
    }
    PrefillLayout {
        engine_rank: rank,
        attn_tp_size: tp,
        page_size: c.page_size,
        kv_data_ptrs: ptrs,
        kv_item_lens: vec![item; 2 * c.layers as usize],
        total_kv_head_num: c.total_heads,
        ..PrefillLayout::default()
    }
}

/// Prefill ranks that hold the decode rank `dr`'s KV (sglang's mapping).
fn writers_of(p: u64, d: u64, dr: u64) -> Vec<u64> {
    if p > d {
        let ratio = p / d;
        (dr * ratio..(dr + 1) * ratio).collect()
    } else {
        vec![dr / (d / p)]
    }
}

fn registration(layout: &PrefillLayout, rank: u64) -> PeerRegistration {
    PeerRegistration {
        dst_kv_ptrs: layout.kv_data_ptrs.clone(),
        dst_tp_rank: rank,
        dst_attn_tp_size: layout.attn_tp_size,
        dst_kv_item_len: layout.kv_item_lens[0],
        ..PeerRegistration::default()
    }
}

fn decode_bytes(mem: &mut Mem, layout: &PrefillLayout, pages: &[i32]) -> Vec<u8> {
    let item = layout.kv_item_lens[0];
    let mut out = Vec::new();
    for buf in layout.kv_data_ptrs.clone() {
        for p in pages {
            out.extend(mem.read(buf + *p as u64 * item, item));
        }
    }
    out
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn staging_delivers_what_head_slicing_delivers(c in cases()) {
        let src_pages: Vec<i32> = (0..c.pages as i32).map(|i| (i * 3 + 1) % POOL_PAGES as i32).collect();
        let dst_pages: Vec<i32> = (0..c.pages as i32).map(|i| POOL_PAGES as i32 - 1 - 2 * i).collect();
        for dr in 0..c.d {
            let mut sliced = Mem::default();
            let mut staged = Mem::default();
            let mut writers = Vec::new();
            for (k, r) in writers_of(c.p, c.d, dr).into_iter().enumerate() {
                let base = 0x1000_0000 * (k as u64 + 1);
                let l1 = rank_layout(&mut sliced, &c, c.p, r, base, &src_pages);
                let l2 = rank_layout(&mut staged, &c, c.p, r, base, &src_pages);
                prop_assert_eq!(&l1, &l2);
                writers.push(l1);
            }
            let dec = rank_layout(&mut sliced, &c, c.d, dr, 0x9000_0000, &[]);
            rank_layout(&mut staged, &c, c.d, dr, 0x9000_0000, &[]);
            let reg = registration(&dec, dr);

            // Per-slice path, through the planner.
            let request = TransferRequest { dst_kv_indices: dst_pages.clone(), ..Default::default() };
            let chunk = TransferChunk { prefill_kv_indices: src_pages.clone(), ..Default::default() };
            for w in &writers {
                let peer = PreparedPeer::new(w, reg.clone()).unwrap();
                let mut planner = Planner::new();
                let plan = planner.plan_chunk(w, &peer, &request, &chunk).unwrap();
                let mut blocks = plan.kv_blocks().to_vec();
                blocks.extend(expand_runs(plan.kv_runs()));
                for b in blocks {
                    let data = sliced.read(b.src, b.len);
                    sliced.locate(b.dst, b.len).copy_from_slice(&data);
                }
            }

            // Staged path: gather (in two slot ranges), bulk write, scatter.
            let target = StagingTarget::new(&dec, c.p).unwrap();
            prop_assert_eq!(target.writers(), writers.len() as u64);
            let required = target.required(c.pages).unwrap();
            let region = staged.add(0xa000_0000, required as usize);
            for (k, w) in writers.iter().enumerate() {
                let source = StagingSource::new(w, &reg).unwrap();
                let (offset, total) = source.placement(c.pages).unwrap();
                prop_assert_eq!(total, required);
                let slot_bytes = source.slot_bytes(c.pages).unwrap();
                let n = source.slot_count();
                let cut = c.split % (n + 1);
                for range in [0..cut, cut..n] {
                    if range.is_empty() {
                        continue;
                    }
                    let staging = staged.add(0xb000_0000 + 0x100_0000 * k as u64 + 0x10_0000 * range.start as u64, slot_bytes as usize * range.len());
                    let mut runs = Vec::new();
                    source.gather(&src_pages, range.clone(), staging, &mut runs).unwrap();
                    staged.copy_runs(&runs);
                    let len = slot_bytes * range.len() as u64;
                    let data = staged.read(staging, len);
                    let at = region + offset + slot_bytes * range.start as u64;
                    staged.locate(at, len).copy_from_slice(&data);
                }
            }
            let mut runs = Vec::new();
            target.scatter(region, &dst_pages, &mut runs).unwrap();
            staged.copy_runs(&runs);

            let want = decode_bytes(&mut sliced, &dec, &dst_pages);
            prop_assert!(want.iter().all(|b| *b != 0), "per-slice plan left a byte unwritten");
            prop_assert_eq!(decode_bytes(&mut staged, &dec, &dst_pages), want);
        }
    }
}

#[test]
fn pairs_that_take_another_path_are_refused() {
    let mut mem = Mem::default();
    let c = Case {
        p: 2,
        d: 2,
        total_heads: 4,
        head_bytes: 2,
        page_size: 1,
        layers: 1,
        pages: 1,
        split: 0,
    };
    let l = rank_layout(&mut mem, &c, 2, 0, 0x1000_0000, &[]);
    let reg = registration(&l, 0);
    assert!(StagingSource::new(&l, &reg).is_err(), "equal TP");
    assert!(StagingTarget::new(&l, 2).is_err(), "equal TP");
    let mla = PrefillLayout {
        is_mla_backend: true,
        ..l.clone()
    };
    assert!(StagingTarget::new(&mla, 1).is_err(), "MLA");
    let pp = PrefillLayout {
        pp_size: 2,
        ..l.clone()
    };
    assert!(
        StagingSource::new(
            &pp,
            &PeerRegistration {
                dst_attn_tp_size: 1,
                ..reg.clone()
            }
        )
        .is_err(),
        "PP"
    );
    let odd = PrefillLayout {
        kv_data_ptrs: vec![1, 2, 3],
        kv_item_lens: vec![4; 3],
        ..l
    };
    assert!(StagingTarget::new(&odd, 1).is_err(), "odd buffer count");
}
