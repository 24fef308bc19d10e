//! Property tests: a plan stays inside the buffers it was given (for the item
//! sizes and indices given), moves exactly the bytes the layout implies,
//! splits work between ranks without gaps or overlaps, is unchanged by index
//! batching — and the planner never panics, whatever the input.

#![allow(clippy::unwrap_used)] // tests unwrap what they construct

mod common;

use std::collections::BTreeSet;

use common::*;
use kvbridge_plan::{
    Block, PeerRegistration, Planner, PrefillLayout, PreparedPeer, StateComponent, StateType,
    TransferChunk, TransferRequest, canonicalize, expand_runs, plan_once,
};
use proptest::prelude::*;

/// A region `[base, base + len)`.
type Region = (u64, u64);

fn inside(regions: &[Region], addr: u64, len: u64) -> bool {
    regions
        .iter()
        .any(|&(base, size)| addr >= base && addr + len <= base + size)
}

fn check_bounds(blocks: &[Block], src: &[Region], dst: &[Region]) -> Result<(), TestCaseError> {
    for b in blocks {
        prop_assert!(
            inside(src, b.src, b.len),
            "read outside prefill buffers: {b:?}"
        );
        prop_assert!(
            inside(dst, b.dst, b.len),
            "write outside decode buffers: {b:?}"
        );
    }
    Ok(())
}

/// Sorted byte intervals of one side; asserts they do not overlap.
fn disjoint(mut iv: Vec<(u64, u64)>) -> Result<Vec<(u64, u64)>, TestCaseError> {
    iv.sort_unstable();
    for w in iv.windows(2) {
        prop_assert!(w[0].0 + w[0].1 <= w[1].0, "overlap: {:?} {:?}", w[0], w[1]);
    }
    Ok(iv)
}

/// Merges sorted disjoint intervals into maximal ones.
fn merge(iv: &[(u64, u64)]) -> Vec<(u64, u64)> {
    let mut out: Vec<(u64, u64)> = Vec::new();
    for &(a, l) in iv {
        match out.last_mut() {
            Some(last) if last.0 + last.1 == a => last.1 += l,
            _ => out.push((a, l)),
        }
    }
    out
}

fn bytes(blocks: &[Block]) -> u64 {
    blocks.iter().map(|b| b.len).sum()
}

/// Distinct page indices (shuffled runs), `n` of them below 4096.
fn pages(n: usize) -> impl Strategy<Value = Vec<i32>> {
    prop::collection::vec((0..4000i32, 1..6i32), n).prop_map(move |runs| {
        let mut seen = BTreeSet::new();
        let mut out = Vec::new();
        for (start, len) in runs {
            for p in start..start + len {
                if seen.insert(p) {
                    out.push(p);
                }
            }
        }
        out.truncate(n);
        out
    })
}

fn page_pair(max: usize) -> impl Strategy<Value = (Vec<i32>, Vec<i32>)> {
    (0..=max)
        .prop_flat_map(|n| (pages(n), pages(n)))
        .prop_map(|(a, b)| {
            let n = a.len().min(b.len());
            (a[..n].to_vec(), b[..n].to_vec())
        })
}

fn max_page(p: &[i32]) -> u64 {
    p.iter().copied().max().map_or(0, |m| m as u64 + 1)
}

fn page_regions(ptrs: &[u64], item: u64, p: &[i32]) -> Vec<Region> {
    ptrs.iter().map(|&b| (b, item * max_page(p))).collect()
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    /// Equal-TP page copy (MHA and MLA): bounds, exact bytes, no double
    /// write, and batching never changes the canonical result.
    #[test]
    fn page_copy(
        layers in 1usize..5,
        ps in 1u64..17,
        hb in 1u64..65,
        is_mla in any::<bool>(),
        (src, dst) in page_pair(48),
        batch in 0u64..7,
    ) {
        let item = ps * hb;
        let mut layout = if is_mla { mla(layers, ps, item) } else { mha(layers, ps, item) };
        let n = layout.kv_data_ptrs.len();
        let reg = peer(n, item);
        let req = request(&dst);
        let ch = chunk(&src);
        let plain = plan(&layout, &reg, &req, &ch).unwrap();
        layout.max_transfer_batch_indices = batch;
        let batched = plan_once(&layout, reg.clone(), &req, &ch).unwrap();
        prop_assert_eq!(batched.canonical(), plain.clone());
        check_bounds(&plain, &page_regions(&layout.kv_data_ptrs, item, &src), &page_regions(&reg.dst_kv_ptrs, item, &dst))?;
        prop_assert_eq!(bytes(&plain), src.len() as u64 * item * n as u64);
        disjoint(plain.iter().map(|b| (b.dst, b.len)).collect())?;
        disjoint(plain.iter().map(|b| (b.src, b.len)).collect())?;
        // Batches are what the engine gets: every block exactly once.
        let from_batches: Vec<Block> = batched.kv_batches().flatten().copied().collect();
        prop_assert_eq!(from_batches, batched.kv_blocks().to_vec());
    }

    /// Head slicing for any M -> N TP with GQA: every block stays inside one
    /// token slot on both sides; the ranks of a group together cover the
    /// decode (aggregation) or prefill (scatter) pages exactly once.
    #[test]
    fn head_slicing_tiles_token_slots(
        p_exp in 0u32..4,
        d_exp in 0u32..4,
        t_exp in 0u32..5,
        ps in 1u64..5,
        hb in prop::sample::select(vec![8u64, 16, 48]),
        layers in 1usize..3,
        (src, dst) in page_pair(6),
        pick in any::<prop::sample::Index>(),
    ) {
        prop_assume!(p_exp != d_exp && !src.is_empty());
        let (p, d, t) = (1u64 << p_exp, 1u64 << d_exp, 1u64 << t_exp);
        let (sh, dh) = ((t / p).max(1), (t / d).max(1));
        let (sitem, ditem) = (ps * sh * hb, ps * dh * hb);
        let layout_for = |rank: u64| PrefillLayout {
            engine_rank: rank,
            attn_tp_size: p,
            kv_head_num: sh,
            total_kv_head_num: t,
            ..mha(layers, ps, sitem)
        };
        let peer_for = |rank: u64| PeerRegistration {
            dst_tp_rank: rank,
            dst_attn_tp_size: d,
            ..peer(2 * layers, ditem)
        };
        let (req, ch) = (request(&dst), chunk(&src));
        let src_regions = page_regions(&layout_for(0).kv_data_ptrs, sitem, &src);
        let dst_regions = page_regions(&peer_for(0).dst_kv_ptrs, ditem, &dst);
        // Who talks to whom: aggregation groups P/D prefill ranks per decode
        // rank, scatter D/P decode ranks per prefill rank.
        let (writers, readers): (Vec<u64>, Vec<u64>) = if p > d {
            let dr = pick.index(d as usize) as u64;
            ((dr * (p / d)..(dr + 1) * (p / d)).collect(), vec![dr])
        } else {
            let pr = pick.index(p as usize) as u64;
            (vec![pr], (pr * (d / p)..(pr + 1) * (d / p)).collect())
        };
        let mut all = Vec::new();
        for &w in &writers {
            for &r in &readers {
                let blocks = plan(&layout_for(w), &peer_for(r), &req, &ch).unwrap();
                check_bounds(&blocks, &src_regions, &dst_regions)?;
                for b in &blocks {
                    // Inside one token slot on each side.
                    // Offsets inside the buffer (buffers are 1 GiB apart), then inside a token.
                    let so = ((b.src - common::S) % GIB) % (sitem / ps);
                    let dof = ((b.dst - common::D) % GIB) % (ditem / ps);
                    if b.len <= sitem / ps {
                        prop_assert!(so + b.len <= sitem / ps);
                    }
                    if b.len <= ditem / ps {
                        prop_assert!(dof + b.len <= ditem / ps);
                    }
                }
                all.extend(blocks);
            }
        }
        let pages_bytes = |item: u64| src.len() as u64 * item * 2 * layers as u64;
        if p > d && t >= p {
            // Aggregation: the writers tile the decode pages exactly.
            let iv = disjoint(all.iter().map(|b| (b.dst, b.len)).collect())?;
            prop_assert_eq!(iv.iter().map(|x| x.1).sum::<u64>(), pages_bytes(ditem));
        } else if p < d && t >= d {
            // Scatter: the readers tile the prefill pages exactly.
            let iv = disjoint(all.iter().map(|b| (b.src, b.len)).collect())?;
            prop_assert_eq!(iv.iter().map(|x| x.1).sum::<u64>(), pages_bytes(sitem));
        }
        // A decode rank never receives more than its pages (scatter: exactly them).
        for &r in &readers {
            let got: u64 = writers.iter().map(|&w| bytes(&plan(&layout_for(w), &peer_for(r), &req, &ch).unwrap())).sum();
            if p < d {
                prop_assert_eq!(got, pages_bytes(ditem));
            } else if t >= p {
                prop_assert_eq!(got, pages_bytes(ditem));
            }
        }
    }

    /// Strided KV: for every head-slicing shape, the runs expand to the
    /// very blocks (and batches) of the block plan, with at most one run
    /// per page and buffer pair; other KV paths are unaffected.
    #[test]
    fn strided_runs_expand_to_the_block_plan(
        p_exp in 0u32..4,
        d_exp in 0u32..4,
        t_exp in 0u32..5,
        ps in 1u64..9,
        hb in prop::sample::select(vec![8u64, 16, 48, 256]),
        layers in 1usize..3,
        (src, dst) in page_pair(12),
        rank in 0u64..8,
        drank in 0u64..8,
    ) {
        let (p, d, t) = (1u64 << p_exp, 1u64 << d_exp, 1u64 << t_exp);
        let (sh, dh) = ((t / p).max(1), (t / d).max(1));
        let (sitem, ditem) = (ps * sh * hb, ps * dh * hb);
        let layout = PrefillLayout {
            engine_rank: rank % p,
            attn_tp_size: p,
            kv_head_num: sh,
            total_kv_head_num: t,
            ..mha(layers, ps, sitem)
        };
        let reg = PeerRegistration {
            dst_tp_rank: drank % d,
            dst_attn_tp_size: d,
            ..peer(2 * layers, ditem)
        };
        let Ok(peer) = PreparedPeer::new(&layout, reg) else {
            return Ok(());
        };
        let (req, ch) = (request(&dst), chunk(&src));
        let mut plain = Planner::new();
        let mut strided = Planner::new();
        strided.set_strided_kv(true);
        let a = plain.plan_chunk(&layout, &peer, &req, &ch).cloned();
        let b = strided.plan_chunk(&layout, &peer, &req, &ch).cloned();
        let (a, b) = match (a, b) {
            (Ok(a), Ok(b)) => (a, b),
            (Err(x), Err(y)) => {
                prop_assert_eq!(x, y);
                return Ok(());
            }
            (x, y) => {
                prop_assert!(false, "plain {:?} vs strided {:?}", x.err(), y.err());
                unreachable!()
            }
        };
        prop_assert!(a.kv_runs().is_empty());
        let batches_a: Vec<Vec<Block>> = a.kv_batches().map(<[Block]>::to_vec).collect();
        let mut batches_b: Vec<Vec<Block>> = b.kv_batches().map(<[Block]>::to_vec).collect();
        batches_b.extend(b.kv_run_batches().map(expand_runs));
        prop_assert_eq!(&batches_a, &batches_b);
        prop_assert_eq!(a.to_vec(), b.to_vec());
        prop_assert_eq!(a.block_count(), b.block_count());
        prop_assert_eq!(a.total_bytes(), b.total_bytes());
        if !b.kv_runs().is_empty() {
            prop_assert!(b.kv_blocks().is_empty());
            prop_assert!(b.kv_runs().len() <= src.len().min(dst.len()) * 2 * layers);
            prop_assert!(b.kv_runs().iter().all(|r| r.count >= ps && r.count % ps == 0));
        }
    }

    /// DCP relayout: the decode DCP ranks together receive every target
    /// token exactly once; draft entries get every token; bounds hold.
    #[test]
    fn dcp_ranks_partition_tokens(
        ps in 1u64..9,
        dcp_exp in 1u32..3,
        offset in 0u64..4,
        prefix_pages in 0u64..3,
        n_pages in 1usize..6,
        cut in 0u64..8,
        width in prop::sample::select(vec![16u64, 64, 576]),
        layers in 1usize..3,
        draft in any::<bool>(),
        batch in 0u64..4,
    ) {
        let dcp = 1u64 << dcp_exp;
        let vpage = ps * dcp;
        let n_tokens = (n_pages as u64 * ps).saturating_sub(cut.min(ps - 1));
        let nd = usize::from(draft);
        let mut layout = mla(layers + nd, ps, ps * width);
        layout.num_draft_entries = nd as u64;
        layout.max_transfer_batch_indices = batch;
        let src_pages: Vec<i32> = (0..n_pages as i32).map(|k| 3 * k + 1).collect();
        let total = (offset * ps + n_tokens).div_ceil(vpage) as usize;
        let vpages: Vec<i32> = (0..total as i32).map(|k| 1000 - 2 * k).collect();
        let req = TransferRequest { decode_prefix_len: Some(prefix_pages * vpage), ..request(&vpages) };
        let ch = TransferChunk { num_kv_tokens: Some(n_tokens), index_slice_start: offset, ..chunk(&src_pages) };
        let src_regions: Vec<Region> = layout.kv_data_ptrs.iter().map(|&b| (b, ps * width * max_page(&src_pages))).collect();
        let mut target_rows = Vec::new();
        for rank in 0..dcp {
            let mut reg = PeerRegistration { dst_dcp_size: dcp, dst_dcp_rank: rank, ..peer(layers + nd, ps * width) };
            if draft {
                reg.dst_kv_item_lens = vec![ps * width; layers];
                reg.dst_kv_item_lens.push(vpage * width);
            }
            let blocks = plan(&layout, &reg, &req, &ch).unwrap();
            let mut dst_regions: Vec<Region> = reg.dst_kv_ptrs[..layers].iter().map(|&b| (b, ps * width * max_page(&vpages))).collect();
            dst_regions.extend(reg.dst_kv_ptrs[layers..].iter().map(|&b| (b, vpage * width * max_page(&vpages))));
            check_bounds(&blocks, &src_regions, &dst_regions)?;
            // Layer 0's source rows (token granularity).
            for b in blocks.iter().filter(|b| b.src < common::S + GIB) {
                for k in 0..b.len / width {
                    target_rows.push((b.src - common::S) / width + k);
                }
            }
            if draft {
                let draft_base = common::S + layers as u64 * GIB;
                let draft_bytes: u64 = blocks.iter().filter(|b| b.src >= draft_base).map(|b| b.len).sum();
                prop_assert_eq!(draft_bytes, n_tokens * width);
            }
        }
        target_rows.sort_unstable();
        let want: Vec<u64> = (0..n_tokens).map(|t| src_pages[(t / ps) as usize] as u64 * ps + t % ps).collect();
        let mut want_sorted = want.clone();
        want_sorted.sort_unstable();
        prop_assert_eq!(target_rows, want_sorted);
    }

    /// Mamba TP slicing: aggregation writers tile the decode slot; scatter
    /// readers tile the prefill slot; each block stays inside its slots.
    #[test]
    fn mamba_slices_tile_slots(
        p_exp in 0u32..3,
        d_exp in 0u32..3,
        unit in 1u64..5,
        outer in 1u64..4,
        use_groups in any::<bool>(),
        slot in 0i64..8,
        dslot in 0i64..8,
        pick in any::<prop::sample::Index>(),
    ) {
        prop_assume!(p_exp != d_exp);
        let (p, d) = (1u64 << p_exp, 1u64 << d_exp);
        let big = p.max(d);
        // Conv state of 3 sub-blocks, each divisible by both TP sizes.
        let groups = vec![2 * big, 2 * big, 4 * big];
        let full: u64 = groups.iter().sum();
        let (sd, dd) = (full / p, full / d);
        let (ss, ds) = (sd * unit * outer, dd * unit * outer);
        let layout_for = |rank: u64| {
            let mut comp = StateComponent::new(StateType::Mamba, vec![SS], vec![ss]);
            comp.dim_per_tensor = vec![sd];
            comp.slice_outer_counts = vec![outer];
            if use_groups { comp.conv_shard_groups = vec![Some(groups.clone())]; }
            PrefillLayout { engine_rank: rank, attn_tp_size: p, states: vec![comp], ..PrefillLayout::default() }
        };
        let peer_for = |rank: u64| PeerRegistration {
            dst_tp_rank: rank,
            dst_attn_tp_size: d,
            dst_state_data_ptrs: vec![vec![SD]],
            dst_state_item_lens: vec![vec![ds]],
            dst_state_dim_per_tensor: vec![vec![dd]],
            ..PeerRegistration::default()
        };
        let req = TransferRequest { dst_state_indices: vec![vec![dslot]], ..TransferRequest::default() };
        let ch = TransferChunk { state_indices: Some(vec![Some(vec![slot])]), ..TransferChunk::default() };
        let src_slot = (SS + ss * slot as u64, ss);
        let dst_slot = (SD + ds * dslot as u64, ds);
        let (writers, readers): (Vec<u64>, Vec<u64>) = if p > d {
            let dr = pick.index(d as usize) as u64;
            ((dr * (p / d)..(dr + 1) * (p / d)).collect(), vec![dr])
        } else {
            let pr = pick.index(p as usize) as u64;
            (vec![pr], (pr * (d / p)..(pr + 1) * (d / p)).collect())
        };
        let mut all = Vec::new();
        for &w in &writers {
            for &r in &readers {
                let blocks = plan(&layout_for(w), &peer_for(r), &req, &ch).unwrap();
                check_bounds(&blocks, &[src_slot], &[dst_slot])?;
                let got = bytes(&blocks);
                if p > d { prop_assert_eq!(got, ss); } else { prop_assert_eq!(got, ds); }
                all.extend(blocks);
            }
        }
        let side: Vec<(u64, u64)> = if p > d {
            all.iter().map(|b| (b.dst, b.len)).collect()
        } else {
            all.iter().map(|b| (b.src, b.len)).collect()
        };
        let iv = disjoint(side)?;
        let whole = if p > d { dst_slot } else { src_slot };
        prop_assert_eq!(merge(&iv), vec![whole]);
    }

    /// Any split and order of the same (source-disjoint) ranges has the same
    /// canonical form.
    #[test]
    fn canonical_form_ignores_order_and_splits(
        raw in prop::collection::vec((0u64..3, 0u64..64, 1u64..16, 0u64..4), 0..24),
        seed in any::<u64>(),
    ) {
        // Sources laid out back to back (sometimes continuing each other), destinations anywhere.
        let mut at = 0;
        let blocks: Vec<Block> = raw.iter().map(|&(gap, d, l, _)| {
            at += gap * 16;
            let blk = b(at, d * 16 + 7, l);
            at += l;
            blk
        }).collect();
        let mut split = Vec::new();
        for (blk, &(_, _, _, cut)) in blocks.iter().zip(&raw) {
            let c = cut.min(blk.len);
            split.push(b(blk.src, blk.dst, c));
            split.push(b(blk.src + c, blk.dst + c, blk.len - c));
        }
        // Deterministic shuffle.
        let mut x = seed | 1;
        for i in (1..split.len()).rev() {
            x ^= x << 13; x ^= x >> 7; x ^= x << 17;
            split.swap(i, (x % (i as u64 + 1)) as usize);
        }
        prop_assert_eq!(canonicalize(&split), canonicalize(&blocks));
        prop_assert_eq!(canonicalize(&canonicalize(&blocks)), canonicalize(&blocks));
    }
}

// ------------------------------------------------------------------ no panics

fn small_u64() -> impl Strategy<Value = u64> {
    prop_oneof![
        0u64..5,
        Just(u64::MAX),
        Just(u64::MAX / 2),
        0u64..70_000,
        Just(1u64 << 40)
    ]
}

fn idx_list() -> impl Strategy<Value = Vec<i64>> {
    prop::collection::vec(
        prop_oneof![-2i64..12, Just(i64::MAX), Just(i64::from(i32::MAX))],
        0..8,
    )
}

/// A state component plus the decode's buffers, sizes, dims and both index lists.
type AnyState = (
    StateComponent,
    Vec<u64>,
    Vec<u64>,
    Vec<u64>,
    Option<Vec<i64>>,
    Vec<i64>,
);

fn any_state() -> impl Strategy<Value = AnyState> {
    (
        prop::sample::select(StateType::ALL.to_vec()),
        prop::collection::vec(small_u64(), 0..5),
        prop::collection::vec(small_u64(), 0..5),
        prop::collection::vec(-1i64..4, 0..5),
        prop::collection::vec(small_u64(), 0..5),
        prop::collection::vec(
            prop::option::of(prop::collection::vec(small_u64(), 0..4)),
            0..4,
        ),
        prop::collection::vec(small_u64(), 0..5),
        (
            prop::collection::vec(small_u64(), 0..5),
            prop::collection::vec(small_u64(), 0..5),
            prop::collection::vec(small_u64(), 0..5),
        ),
        (prop::option::of(idx_list()), idx_list()),
    )
        .prop_map(
            |(t, ptrs, lens, ids, dims, groups, outer, (dptrs, dlens, ddims), (si, di))| {
                let comp = StateComponent {
                    state_type: t,
                    data_ptrs: ptrs,
                    item_lens: lens,
                    layer_ids: ids,
                    dim_per_tensor: dims,
                    conv_shard_groups: groups,
                    slice_outer_counts: outer,
                };
                (comp, dptrs, dlens, ddims, si, di)
            },
        )
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 2000, ..ProptestConfig::default() })]

    /// Arbitrary (mostly nonsensical) inputs: the planner returns a plan or
    /// an error, never panics (tests run with overflow checks on).
    #[test]
    fn never_panics(
        sizes in (1u64..9, 1u64..9, 1u64..3, prop_oneof![1u64..17, Just(u64::MAX)], 0u64..20, 0u64..20),
        flags in (any::<bool>(), any::<bool>(), any::<bool>(), any::<bool>()),
        kv in (prop::collection::vec(small_u64(), 0..7), prop::collection::vec(small_u64(), 0..7), prop::collection::vec(small_u64(), 0..9), small_u64()),
        ids in (prop::collection::vec(0i64..4, 0..7), prop::collection::vec(0i64..4, 0..9)),
        heads in (0u64..9, 0u64..17, 0u64..3, 0u64..4, prop::option::of(0u64..6)),
        dcp in (1u64..3, 0u64..3, 1u64..5, 0u64..5, prop::collection::vec(small_u64(), 0..9)),
        pages in (prop::collection::vec(-1i32..40, 0..12), prop::collection::vec(-1i32..40, 0..12), 0u64..6, prop::option::of(0u64..14)),
        chunk_opts in (prop::option::of(0u64..300), prop::option::of(0u64..40), small_u64(), any::<bool>(), 0u64..4),
        aux in (prop::collection::vec(small_u64(), 0..3), prop::collection::vec(small_u64(), 0..3), prop::collection::vec(small_u64(), 0..3), small_u64()),
        states in prop::collection::vec(any_state(), 0..3),
    ) {
        let (p, d, pp, ps, rank, drank) = sizes;
        let (is_mla, hybrid, unified, last) = flags;
        let (kv_ptrs, kv_lens, dst_ptrs, dst_item) = kv;
        let (kv_ids, dst_ids) = ids;
        let (kv_heads, total, nd, start, end) = heads;
        let (dcp_size, dcp_rank, dst_dcp, dst_dcp_rank, dst_lens) = dcp;
        let (src_pages, dst_pages, slice_start, slice_end) = pages;
        let (tokens, prefix, aux_idx, has_state_indices, batch) = chunk_opts;
        let (aux_ptrs, aux_lens, dst_aux, dst_aux_idx) = aux;
        let mut layout = PrefillLayout {
            engine_rank: rank, attn_tp_size: p, pp_size: pp, dcp_size, dcp_rank, page_size: ps,
            is_mla_backend: is_mla, is_hybrid_mla_backend: hybrid,
            kv_data_ptrs: kv_ptrs, kv_item_lens: kv_lens, kv_layer_ids: kv_ids,
            kv_head_num: kv_heads, total_kv_head_num: total, num_draft_entries: nd,
            prefill_start_layer: start, prefill_end_layer: end,
            aux_data_ptrs: aux_ptrs, aux_item_lens: aux_lens, states: Vec::new(),
            max_transfer_batch_indices: batch, enable_unified_memory: unified,
            mla_compression_ratios: None,
            // Half the layouts name their SWA page layout (head slicing
            // between TP sizes), half do not (refused).
            swa_kv_cache_layout: (rank % 2 == 0).then(|| "nhd".to_owned()),
        };
        let mut reg = PeerRegistration {
            dst_kv_ptrs: dst_ptrs, dst_aux_ptrs: dst_aux, dst_tp_rank: drank, dst_attn_tp_size: d,
            dst_kv_item_len: dst_item, dst_kv_layer_ids: dst_ids, dst_dcp_size: dst_dcp,
            dst_dcp_rank, dst_kv_item_lens: dst_lens, ..PeerRegistration::default()
        };
        let mut req = TransferRequest { dst_kv_indices: dst_pages, dst_aux_index: dst_aux_idx, dst_state_indices: Vec::new(), decode_prefix_len: prefix, dst_device_kv_indices: None };
        let mut ch = TransferChunk {
            prefill_kv_indices: src_pages, index_slice_start: slice_start, index_slice_end: slice_end,
            is_last_chunk: last, prefill_aux_index: Some(aux_idx), state_indices: None, num_kv_tokens: tokens,
        };
        for (comp, dptrs, dlens, ddims, si, di) in states {
            layout.states.push(comp);
            reg.dst_state_data_ptrs.push(dptrs);
            reg.dst_state_item_lens.push(dlens);
            reg.dst_state_dim_per_tensor.push(ddims);
            req.dst_state_indices.push(di);
            ch.state_indices.get_or_insert_with(Vec::new).push(si);
        }
        if !has_state_indices { ch.state_indices = None; }
        let _ = plan_once(&layout, reg, &req, &ch);
    }
}

proptest! {
    /// `aux_slot` is `base + index * item_len` exactly when that range fits
    /// in `u64`, an error otherwise; the layout's form agrees with it, and
    /// `slots_at` maps the slot back to its index.
    #[test]
    fn aux_slot_is_checked_and_inverted_by_slots_at(
        base in prop_oneof![0u64..1 << 40, (u64::MAX - (1 << 20))..=u64::MAX],
        item in prop_oneof![Just(0u64), 1u64..4096, (u64::MAX >> 8)..=u64::MAX],
        index in prop_oneof![0u64..1024, (u64::MAX >> 12)..=u64::MAX],
    ) {
        let exact = u128::from(base) + u128::from(index) * u128::from(item);
        let fits = exact + u128::from(item) <= u128::from(u64::MAX);
        match kvbridge_plan::aux_slot(base, item, index) {
            Ok((addr, len)) => {
                prop_assert!(fits);
                prop_assert_eq!(u128::from(addr), exact);
                prop_assert_eq!(len, item);
            }
            Err(e) => {
                prop_assert!(!fits);
                prop_assert_eq!(e, kvbridge_plan::PlanError::AddressOverflow);
            }
        }
        let layout = PrefillLayout {
            aux_data_ptrs: vec![base],
            aux_item_lens: vec![item],
            ..PrefillLayout::default()
        };
        prop_assert_eq!(layout.aux_slot(0, index), kvbridge_plan::aux_slot(base, item, index));
        prop_assert!(layout.aux_slot(1, index).is_err(), "no second aux buffer");
        if let Ok((addr, len)) = layout.aux_slot(0, index)
            && item > 0
        {
            let span = layout.slots_at(addr, len);
            prop_assert_eq!(
                span,
                Some(kvbridge_plan::SlotSpan {
                    family: kvbridge_plan::SlotFamily::Aux,
                    first: index,
                    last: index,
                })
            );
        }
    }
}

proptest! {
    /// The CP shares of all ranks tile the request's pages, and filtering
    /// chunk by chunk gives each rank exactly its share, in order.
    #[test]
    fn cp_shares_tile_the_request_and_chunks_filter_to_them(
        total in 0u64..200,
        size in 1u64..9,
        chunk in 1u64..40,
    ) {
        let pages: Vec<i32> = (0..total as i32).map(|p| 1000 + p).collect();
        let mut next = 0;
        for rank in 0..size {
            let share = kvbridge_plan::cp_page_share(total, rank, size);
            prop_assert_eq!(share.start, next);
            next = share.end;
            let mut got = Vec::new();
            let mut pos = 0u64;
            for c in pages.chunks(chunk as usize) {
                let end = pos + c.len() as u64;
                let (kept, at) = kvbridge_plan::cp_filter_chunk(c, pos..end, total, rank, size);
                prop_assert_eq!(kept.len() as u64, at.end - at.start);
                for (k, p) in kept.iter().enumerate() {
                    prop_assert_eq!(i64::from(*p) - 1000, (at.start + k as u64) as i64);
                }
                got.extend_from_slice(kept);
                pos = end;
            }
            let want: Vec<i32> = share.map(|p| 1000 + p as i32).collect();
            prop_assert_eq!(got, want);
        }
        prop_assert_eq!(next, total);
    }
}

proptest! {
    /// DCP relayout with strided KV: the target tokens' runs expand to
    /// exactly the blocks of the plain plan (as a set; the draft stays in
    /// blocks), in no more descriptors than tokens, and for pages that
    /// follow on, one run per entry.
    #[test]
    fn dcp_strided_runs_expand_to_the_block_plan(
        ps in 1u64..9,
        dcp in 2u64..5,
        rank_seed in 0u64..8,
        nd in 0u64..2,
        (src, dst) in page_pair(10),
        cut in 0u64..8,
    ) {
        let layers = 2usize;
        let mut layout = mla(layers + nd as usize, ps, ps * 16);
        layout.num_draft_entries = nd;
        let n = src.len() as u64;
        let tokens = (n * ps).saturating_sub(cut.min(ps.saturating_sub(1)));
        // Virtual decode pages: ceil(tokens / (ps * dcp)) of them.
        let vpages: Vec<i32> = dst.iter().copied().take(tokens.div_ceil(ps * dcp) as usize).collect();
        let reg = PeerRegistration {
            dst_dcp_size: dcp,
            dst_dcp_rank: rank_seed % dcp,
            dst_kv_item_lens: [vec![ps * 16; layers], vec![ps * dcp * 16; nd as usize]].concat(),
            ..peer(layers + nd as usize, ps * 16)
        };
        let Ok(peer) = PreparedPeer::new(&layout, reg) else {
            return Ok(());
        };
        let req = request(&vpages);
        let ch = TransferChunk { num_kv_tokens: Some(tokens), ..chunk(&src) };
        let mut plain = Planner::new();
        let mut strided = Planner::new();
        strided.set_strided_kv(true);
        let a = plain.plan_chunk(&layout, &peer, &req, &ch).cloned();
        let b = strided.plan_chunk(&layout, &peer, &req, &ch).cloned();
        match (a, b) {
            (Ok(a), Ok(b)) => {
                prop_assert_eq!(a.canonical(), b.canonical());
                prop_assert_eq!(a.block_count(), b.block_count());
                let target_tokens = b.kv_runs().iter().map(|r| r.count).sum::<u64>();
                prop_assert!(b.kv_runs().len() as u64 <= target_tokens);
                let contiguous = src.windows(2).all(|w| w[1] == w[0] + 1)
                    && vpages.windows(2).all(|w| w[1] == w[0] + 1);
                if contiguous && target_tokens > 0 {
                    prop_assert_eq!(b.kv_runs().len(), layers);
                }
            }
            (Err(x), Err(y)) => prop_assert_eq!(x, y),
            (x, y) => prop_assert!(false, "plain {:?} vs strided {:?}", x.err(), y.err()),
        }
    }
}
