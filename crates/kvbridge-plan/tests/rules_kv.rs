//! docs/plan-scenario.md §3.2–§3.5, §3.8: chunk pages, page copy, pairing,
//! unified memory, head slicing, aux and plan plumbing — hand-derived blocks
//! and exact errors.

#![allow(clippy::unwrap_used)] // tests unwrap what they construct

mod common;

use common::*;
use kvbridge_plan::{
    KvPath, PeerRegistration, PlanError, Planner, PrefillLayout, PreparedPeer, Run, StateType,
    TransferChunk, TransferRequest,
};

const IL: u64 = 4096;

// ---------------------------------------------------------------- page copy (§3.3 b, §3.4)

#[test]
fn page_copy_one_block_per_entry_and_run() {
    let got = plan(
        &mha(1, 16, IL),
        &peer(2, IL),
        &request(&[10, 11, 12, 20]),
        &chunk(&[3, 4, 5, 9]),
    )
    .unwrap();
    let want = canon(vec![
        b(S + 3 * IL, D + 10 * IL, 3 * IL),
        b(S + 9 * IL, D + 20 * IL, IL),
        b(S + GIB + 3 * IL, D + GIB + 10 * IL, 3 * IL),
        b(S + GIB + 9 * IL, D + GIB + 20 * IL, IL),
    ]);
    assert_eq!(got, want);
}

#[test]
fn page_copy_uses_each_buffers_own_item_len() {
    let mut layout = mha(1, 16, IL);
    layout.kv_item_lens = vec![IL, 2 * IL];
    let got = plan(&layout, &peer(2, IL), &request(&[7]), &chunk(&[1])).unwrap();
    assert_eq!(
        got,
        canon(vec![
            b(S + IL, D + 7 * IL, IL),
            b(S + GIB + 2 * IL, D + GIB + 14 * IL, 2 * IL)
        ])
    );
}

#[test]
fn decode_slice_shorter_than_chunk_truncates_prefill_pages() {
    let ch = TransferChunk {
        index_slice_start: 3,
        index_slice_end: Some(7),
        ..chunk(&[3, 4, 5, 9])
    };
    let got = plan(
        &mha(1, 16, IL),
        &peer(2, IL),
        &request(&[0, 1, 2, 10, 11]),
        &ch,
    )
    .unwrap();
    assert_eq!(
        got,
        canon(vec![
            b(S + 3 * IL, D + 10 * IL, 2 * IL),
            b(S + GIB + 3 * IL, D + GIB + 10 * IL, 2 * IL)
        ])
    );
}

#[test]
fn decode_slice_longer_than_chunk_is_rejected() {
    let ch = TransferChunk {
        index_slice_end: Some(4),
        ..chunk(&[1, 2])
    };
    assert_eq!(
        plan(&mha(1, 16, IL), &peer(2, IL), &request(&[1, 2, 3, 4]), &ch),
        Err(PlanError::IndexLengthMismatch { src: 2, dst: 4 })
    );
}

#[test]
fn slice_end_defaults_to_start_plus_pages() {
    let ch = TransferChunk {
        index_slice_start: 1,
        ..chunk(&[5, 6])
    };
    let got = plan(
        &mha(1, 16, IL),
        &peer(2, IL),
        &request(&[0, 20, 21, 99]),
        &ch,
    )
    .unwrap();
    assert_eq!(got[0], b(S + 5 * IL, D + 20 * IL, 2 * IL));
}

#[test]
fn batching_splits_runs_into_engine_batches_without_changing_the_result() {
    let mut layout = mha(1, 16, IL);
    let req = request(&[11, 12, 13, 14, 15]);
    let ch = chunk(&[1, 2, 3, 4, 5]);
    let plain = plan(&layout, &peer(2, IL), &req, &ch).unwrap();
    layout.max_transfer_batch_indices = 2;
    let peer_ = PreparedPeer::new(&layout, peer(2, IL)).unwrap();
    let mut planner = Planner::new();
    let p = planner.plan_chunk(&layout, &peer_, &req, &ch).unwrap();
    let sizes: Vec<usize> = p.kv_batches().map(<[_]>::len).collect();
    assert_eq!(sizes, vec![2, 2, 2]); // 3 index batches x (K, V)
    assert_eq!(p.canonical(), plain);
    let capped: Vec<usize> = p.kv_batches_capped(1).map(<[_]>::len).collect();
    assert_eq!(capped, vec![1; 6]);
}

#[test]
fn mla_pp_stage_maps_onto_whole_model_decode_with_draft_last() {
    let mut layout = mla(4, 64, IL);
    layout.num_draft_entries = 1;
    layout.pp_size = 2;
    layout.prefill_start_layer = 3;
    let got = plan(&layout, &peer(7, IL), &request(&[2]), &chunk(&[1])).unwrap();
    let want = canon(
        (0..4)
            .map(|k| b(S + k * GIB + IL, D + (3 + k) * GIB + 2 * IL, IL))
            .collect(),
    );
    assert_eq!(got, want);
}

#[test]
fn mha_pp_stage_slices_both_halves() {
    let mut layout = mha(2, 1, IL);
    layout.pp_size = 2;
    layout.prefill_start_layer = 2;
    let got = plan(&layout, &peer(8, IL), &request(&[0]), &chunk(&[0])).unwrap();
    let want = canon(vec![
        b(S, D + 2 * GIB, IL),
        b(S + GIB, D + 3 * GIB, IL),
        b(S + 2 * GIB, D + 6 * GIB, IL),
        b(S + 3 * GIB, D + 7 * GIB, IL),
    ]);
    assert_eq!(got, want);
}

#[test]
fn mha_decode_with_extra_draft_layers_finds_v_after_whole_groups() {
    // h = 3, H = 4, H % h != 0: V starts at h * (H / h) = 3.
    let got = plan(&mha(3, 1, IL), &peer(8, IL), &request(&[0]), &chunk(&[0])).unwrap();
    assert!(got.contains(&b(S + 3 * GIB, D + 3 * GIB, IL)));
    assert!(got.contains(&b(S + 5 * GIB, D + 5 * GIB, IL)));
    assert_eq!(got.len(), 6);
}

#[test]
fn layer_ids_pair_by_occurrence() {
    let mut layout = mha(2, 1, IL);
    layout.kv_layer_ids = vec![0, 1, 0, 1];
    let mut reg = peer(4, IL);
    reg.dst_kv_ptrs.reverse(); // decode lists V1 V0 K1 K0 ...
    reg.dst_kv_layer_ids = vec![1, 0, 1, 0]; // ... with ids to match
    let got = plan(&layout, &reg, &request(&[0]), &chunk(&[0])).unwrap();
    // prefill K0 (id 0, 1st) -> decode position 1 (first id 0) = D + 2 GiB.
    assert!(got.contains(&b(S, D + 2 * GIB, IL)));
    assert!(got.contains(&b(S + 2 * GIB, D, IL)));
}

#[test]
fn layer_pairing_errors() {
    let req = request(&[0]);
    let ch = chunk(&[0]);
    let mut l = mha(2, 1, IL);
    l.pp_size = 2;
    let mut r = peer(4, IL);
    r.dst_kv_layer_ids = vec![0, 1, 0, 1];
    assert_eq!(plan(&l, &r, &req, &ch), Err(PlanError::LayerIdsOneSided));

    let mut l = mha(2, 1, IL);
    l.kv_layer_ids = vec![0, 1, 0];
    assert!(matches!(
        plan(&l, &r, &req, &ch),
        Err(PlanError::LayerIdCountMismatch {
            src_ids: 3,
            n_src: 4,
            ..
        })
    ));

    let mut l = mha(3, 1, IL);
    l.kv_layer_ids = vec![0, 1, 2, 0, 1, 2];
    assert_eq!(
        plan(&l, &r, &req, &ch),
        Err(PlanError::MissingDecodeLayer { layer: 2 })
    );

    let mut l = mha(2, 1, IL);
    l.kv_layer_ids = vec![0, 1, 0, 1];
    assert_eq!(
        plan(&l, &peer(3, IL), &req, &ch),
        Err(PlanError::PositionalPairing { n_src: 4, n_dst: 3 })
    );

    let mut l = mla(3, 1, IL);
    l.prefill_start_layer = 3;
    assert_eq!(
        plan(&l, &peer(4, IL), &req, &ch),
        Err(PlanError::FlatPairingOutOfRange {
            entry: 1,
            dst_entries: 1
        })
    );

    let mut l = mha(4, 1, IL);
    l.prefill_start_layer = 3;
    assert_eq!(
        plan(&l, &peer(6, IL), &req, &ch),
        Err(PlanError::StageLayersBeyondDecode {
            layers: 4,
            dst_layers: 3
        })
    );

    assert_eq!(
        plan(&mha(2, 1, IL), &peer(2, IL), &req, &ch),
        Err(PlanError::MissingDecodeV { layer: 1 })
    );

    let mut l = mha(1, 1, IL);
    l.kv_data_ptrs.truncate(1);
    l.kv_item_lens.truncate(1);
    assert_eq!(
        plan(&l, &peer(4, IL), &req, &ch),
        Err(PlanError::EmptyKvHalves { dst_layers: 2 })
    );
}

#[test]
fn pairing_errors_only_matter_when_kv_is_sent() {
    // Broken pairing, but the chunk has no pages: no KV, no error (aux still planned).
    let mut l = mha(3, 1, IL);
    l.kv_layer_ids = vec![0, 1, 2, 0, 1, 2];
    let mut r = peer(4, IL);
    r.dst_kv_layer_ids = vec![0, 1, 0, 1];
    let peer_ = PreparedPeer::new(&l, r.clone()).unwrap();
    assert_eq!(
        peer_.kv_config_error(),
        Some(&PlanError::MissingDecodeLayer { layer: 2 })
    );
    assert_eq!(plan(&l, &r, &request(&[]), &chunk(&[])), Ok(vec![]));
}

#[test]
fn negative_page_index_is_rejected() {
    assert!(matches!(
        plan(&mha(1, 1, IL), &peer(2, IL), &request(&[-3]), &chunk(&[1])),
        Err(PlanError::InvalidIndex { value: -3, .. })
    ));
}

// ---------------------------------------------------------------- unified memory

fn unified(item: u64) -> (PrefillLayout, PeerRegistration) {
    let mut l = mha(1, 16, item);
    l.kv_data_ptrs.truncate(1);
    l.kv_item_lens.truncate(1);
    l.enable_unified_memory = true;
    (l, peer(1, item))
}

#[test]
fn unified_memory_copies_one_envelope_flat() {
    let (l, r) = unified(65536);
    let got = plan(&l, &r, &request(&[4, 5]), &chunk(&[8, 9])).unwrap();
    assert_eq!(got, vec![b(S + 8 * 65536, D + 4 * 65536, 2 * 65536)]);
}

#[test]
fn unified_memory_rejections() {
    let (mut l, r) = unified(65536);
    l.attn_tp_size = 2;
    l.is_mla_backend = true;
    assert_eq!(
        plan(&l, &r, &request(&[4]), &chunk(&[8])),
        Err(PlanError::UnifiedMemoryTpMismatch {
            prefill: 2,
            decode: 1
        })
    );
    let (l, mut r) = unified(65536);
    r.dst_kv_item_len = 32768;
    assert!(matches!(
        plan(&l, &r, &request(&[4]), &chunk(&[8])),
        Err(PlanError::UnifiedMemoryLayoutMismatch { .. })
    ));
    let mut l = mha(1, 16, 65536);
    l.enable_unified_memory = true;
    assert!(matches!(
        plan(&l, &peer(1, 65536), &request(&[4]), &chunk(&[8])),
        Err(PlanError::UnifiedMemoryLayoutMismatch { src_regions: 2, .. })
    ));
}

// ---------------------------------------------------------------- head slicing (§3.5)

fn heads_layout(p: u64, rank: u64, heads: u64, ps: u64, hb: u64) -> PrefillLayout {
    let sh = (heads / p).max(1);
    PrefillLayout {
        engine_rank: rank,
        attn_tp_size: p,
        kv_head_num: sh,
        total_kv_head_num: heads,
        ..mha(1, ps, ps * sh * hb)
    }
}

fn heads_peer(d: u64, rank: u64, heads: u64, ps: u64, hb: u64) -> PeerRegistration {
    PeerRegistration {
        dst_attn_tp_size: d,
        dst_tp_rank: rank,
        ..peer(2, ps * (heads / d).max(1) * hb)
    }
}

#[test]
fn head_slice_scatter_takes_the_decode_ranks_heads() {
    // TP 1 -> 4, 8 heads of 16 bytes, page 2: decode rank 2 holds heads 4..6.
    let l = heads_layout(1, 0, 8, 2, 16);
    let r = heads_peer(4, 2, 8, 2, 16);
    assert_eq!(
        PreparedPeer::new(&l, r.clone()).unwrap().kv_path(),
        KvPath::HeadSlice
    );
    let got = plan(&l, &r, &request(&[5]), &chunk(&[3])).unwrap();
    let (sitem, ditem) = (256, 64);
    let mut want = Vec::new();
    for k in 0..2 {
        for t in 0..2 {
            want.push(b(
                S + k * GIB + 3 * sitem + t * 128 + 4 * 16,
                D + k * GIB + 5 * ditem + t * 32,
                32,
            ));
        }
    }
    assert_eq!(got, canon(want));
}

#[test]
fn head_slice_strided_runs_cover_page_runs() {
    // TP 1 -> 4 as above, 4-token pages: prefill pages 3, 4, 5 and 9 go to
    // decode pages 5, 6, 7 and 1. Pages 3..6 continue each other on both
    // sides (one run of 12 tokens); page 9 -> 1 is its own run.
    let (ps, hb) = (4, 16);
    let l = heads_layout(1, 0, 8, ps, hb);
    let r = heads_peer(4, 2, 8, ps, hb);
    let peer = PreparedPeer::new(&l, r).unwrap();
    let mut planner = Planner::new();
    planner.set_strided_kv(true);
    let plan = planner
        .plan_chunk(&l, &peer, &request(&[5, 6, 7, 1]), &chunk(&[3, 4, 5, 9]))
        .unwrap();
    let (sitem, ditem) = (ps * 8 * hb, ps * 2 * hb);
    let run = |k: u64, sp: u64, dp: u64, count: u64| Run {
        src: S + k * GIB + sp * sitem + 4 * hb,
        dst: D + k * GIB + dp * ditem,
        len: 2 * hb,
        count,
        src_stride: sitem / ps,
        dst_stride: ditem / ps,
    };
    let want = [run(0, 3, 5, 12), run(0, 9, 1, 4)];
    let want_v = [run(1, 3, 5, 12), run(1, 9, 1, 4)];
    assert!(plan.kv_blocks().is_empty());
    let batches: Vec<&[Run]> = plan.kv_run_batches().collect();
    assert_eq!(batches, vec![&want[..], &want_v[..]]);
    assert_eq!(plan.block_count(), 32);
    assert_eq!(plan.total_bytes(), 32 * 32);
    // Whole-token slices stay page blocks (TP 2 -> 2 is a page copy; here
    // TP 1 -> 1 with strided on changes nothing either).
    let l1 = heads_layout(1, 0, 8, ps, hb);
    let r1 = heads_peer(1, 0, 8, ps, hb);
    let p1 = PreparedPeer::new(&l1, r1).unwrap();
    let got = planner
        .plan_chunk(&l1, &p1, &request(&[5, 6]), &chunk(&[3, 4]))
        .unwrap();
    assert!(got.kv_runs().is_empty());
    assert_eq!(got.kv_blocks().len(), 2);
}

#[test]
fn head_slice_aggregation_places_heads_in_the_decode_token() {
    // TP 4 -> 1, rank 3 holds heads 6..8 of 8.
    let l = heads_layout(4, 3, 8, 2, 16);
    let r = heads_peer(1, 0, 8, 2, 16);
    let got = plan(&l, &r, &request(&[5]), &chunk(&[3])).unwrap();
    let (sitem, ditem) = (64, 256);
    let mut want = Vec::new();
    for k in 0..2 {
        for t in 0..2 {
            want.push(b(
                S + k * GIB + 3 * sitem + t * 32,
                D + k * GIB + 5 * ditem + t * 128 + 6 * 16,
                32,
            ));
        }
    }
    assert_eq!(got, canon(want));
}

#[test]
fn head_slice_gqa_replication_and_whole_token_merge() {
    // TP 8 -> 2 with 2 KV heads: every rank holds one whole head, the
    // decode rank one head: whole tokens, so pages merge into runs.
    let l = heads_layout(8, 5, 2, 2, 64);
    let r = heads_peer(2, 1, 2, 2, 64);
    let got = plan(&l, &r, &request(&[5, 6]), &chunk(&[3, 4])).unwrap();
    assert_eq!(
        got,
        canon(vec![
            b(S + 3 * 128, D + 5 * 128, 256),
            b(S + GIB + 3 * 128, D + GIB + 5 * 128, 256)
        ])
    );
}

#[test]
fn head_slice_total_heads_unknown_uses_kv_head_num_times_tp() {
    let mut l = heads_layout(2, 1, 8, 1, 16);
    l.total_kv_head_num = 0; // 4 heads x TP 2
    let r = heads_peer(4, 3, 8, 1, 16);
    let got = plan(&l, &r, &request(&[0]), &chunk(&[0])).unwrap();
    // decode rank 3 holds heads 6..8 = prefill rank 1's heads 2..4.
    assert_eq!(got[0], b(S + 2 * 16, D, 32));
}

#[test]
fn head_slice_with_layer_ids_needs_one_item_len() {
    let mut l = heads_layout(2, 0, 8, 1, 16);
    l.kv_layer_ids = vec![0, 0];
    l.kv_item_lens = vec![64, 32];
    let mut r = heads_peer(1, 0, 8, 1, 16);
    r.dst_kv_layer_ids = vec![0, 0];
    assert_eq!(
        plan(&l, &r, &request(&[0]), &chunk(&[0])),
        Err(PlanError::MixedKvItemLens)
    );
}

// ---------------------------------------------------------------- aux, last chunk, plumbing

fn with_aux(n_src: usize, n_dst: usize) -> (PrefillLayout, PeerRegistration) {
    let mut l = mha(1, 16, IL);
    l.aux_data_ptrs = ptrs(0x1000_0000, n_src);
    l.aux_item_lens = (0..n_src as u64).map(|k| 8 << k).collect();
    let mut r = peer(2, IL);
    r.dst_aux_ptrs = ptrs(0x2000_0000, n_dst);
    (l, r)
}

#[test]
fn aux_blocks_and_errors() {
    let req = TransferRequest {
        dst_aux_index: 5,
        ..request(&[])
    };
    let ch = TransferChunk {
        prefill_aux_index: Some(2),
        ..chunk(&[])
    };
    let (l, r) = with_aux(3, 2);
    assert_eq!(
        plan(&l, &r, &req, &ch),
        Ok(canon(vec![
            b(0x1000_0000 + 16, 0x2000_0000 + 40, 8),
            b(0x1000_0000 + GIB + 32, 0x2000_0000 + GIB + 80, 16)
        ]))
    );
    let (l, r) = with_aux(1, 2);
    assert_eq!(
        plan(&l, &r, &req, &ch),
        Err(PlanError::MissingAuxBuffer { index: 1 })
    );
    let (l, r) = with_aux(1, 1);
    assert_eq!(
        plan(&l, &r, &req, &chunk(&[])),
        Err(PlanError::MissingAuxIndex)
    );
}

#[test]
fn middle_chunk_sends_kv_only() {
    let (mut l, mut r) = with_aux(1, 1);
    let (mut req, mut ch) = (request(&[4]), chunk(&[1]));
    add_state(
        &mut l,
        &mut r,
        &mut req,
        &mut ch,
        state(StateType::SwaRing, 1, 64),
        ptrs(SD, 1),
        vec![64],
        Some(vec![1, 2]),
        vec![],
    );
    // On the last chunk the broken swa_ring indices and the missing aux index are errors ...
    assert!(plan(&l, &r, &req, &ch).is_err());
    // ... on a middle chunk they are not looked at.
    ch.is_last_chunk = false;
    assert_eq!(plan(&l, &r, &req, &ch).unwrap().len(), 2);
}

#[test]
fn state_components_are_reported_separately() {
    let (mut l, mut r) = (mha(1, 1, IL), peer(2, IL));
    let (mut req, mut ch) = (request(&[4]), chunk(&[1]));
    add_state(
        &mut l,
        &mut r,
        &mut req,
        &mut ch,
        state(StateType::Swa, 1, 64),
        ptrs(SD, 1),
        vec![64],
        Some(vec![1]),
        vec![2],
    );
    add_state(
        &mut l,
        &mut r,
        &mut req,
        &mut ch,
        state(StateType::RequestRow, 1, 64),
        ptrs(SD, 1),
        vec![64],
        Some(vec![1]),
        vec![2],
    );
    add_state(
        &mut l,
        &mut r,
        &mut req,
        &mut ch,
        state(StateType::BlockScale, 2, 32),
        ptrs(SD + (1 << 40), 2),
        vec![32, 32],
        Some(vec![3]),
        vec![4],
    );
    let p = PreparedPeer::new(&l, r).unwrap();
    let mut planner = Planner::new();
    let plan = planner.plan_chunk(&l, &p, &req, &ch).unwrap();
    let comps: Vec<(usize, usize)> = plan.state_components().map(|(c, b)| (c, b.len())).collect();
    // The single swa region is copied flat; block_scale has K/V halves (2 blocks).
    assert_eq!(comps, vec![(0, 1), (2, 2)]);
    assert_eq!(plan.kv_blocks().len(), 2);
    assert_eq!(plan.state_blocks().len(), 3);
    assert!(plan.aux_blocks().is_empty());
    let words: &[u64] = bytemuck::cast_slice(plan.kv_blocks());
    assert_eq!(words.len(), 6);
}

#[test]
fn address_overflow_is_an_error_not_a_wrap() {
    let mut r = peer(2, IL);
    r.dst_kv_ptrs[1] = u64::MAX - 8 * IL;
    assert_eq!(
        plan(&mha(1, 1, IL), &r, &request(&[9]), &chunk(&[1])),
        Err(PlanError::AddressOverflow)
    );
    // A page whose start still fits is planned (the end is the engine's business).
    assert!(plan(&mha(1, 1, IL), &r, &request(&[7, 8]), &chunk(&[1, 2])).is_ok());
}

#[test]
fn zero_sizes_are_rejected_at_registration() {
    let mut l = mha(1, 1, IL);
    l.page_size = 0;
    assert_eq!(
        PreparedPeer::new(&l, peer(2, IL)).unwrap_err(),
        PlanError::ZeroSize { field: "page_size" }
    );
    let mut r = peer(2, IL);
    r.dst_attn_tp_size = 0;
    assert!(PreparedPeer::new(&mha(1, 1, IL), r).is_err());
    // A layout other than the one the peer was prepared with is re-checked.
    let good = mha(1, 1, IL);
    let p = PreparedPeer::new(&good, peer(2, IL)).unwrap();
    let mut bad = good.clone();
    bad.attn_tp_size = 0;
    assert_eq!(
        Planner::new()
            .plan_chunk(&bad, &p, &request(&[1]), &chunk(&[1]))
            .unwrap_err(),
        PlanError::ZeroSize {
            field: "attn_tp_size"
        }
    );
}

#[test]
fn planner_reuse_never_leaks_a_previous_or_partial_plan() {
    let l = mha(1, 1, IL);
    let p = PreparedPeer::new(&l, peer(2, IL)).unwrap();
    let mut planner = Planner::new();
    let first = planner
        .plan_chunk(&l, &p, &request(&[1, 2, 3]), &chunk(&[4, 5, 6]))
        .unwrap()
        .canonical();
    assert_eq!(first.len(), 2);
    // An error after KV was planned: no plan at all.
    let bad = TransferChunk {
        prefill_aux_index: None,
        ..chunk(&[4])
    };
    let mut l2 = l.clone();
    l2.aux_data_ptrs = vec![0x1000];
    l2.aux_item_lens = vec![8];
    let mut r2 = peer(2, IL);
    r2.dst_aux_ptrs = vec![0x2000];
    let p2 = PreparedPeer::new(&l2, r2).unwrap();
    assert_eq!(
        planner
            .plan_chunk(&l2, &p2, &request(&[1]), &bad)
            .unwrap_err(),
        PlanError::MissingAuxIndex
    );
    assert!(planner.plan().is_empty());
    planner.shrink_to(0);
    let again = planner
        .plan_chunk(&l, &p, &request(&[9]), &chunk(&[4]))
        .unwrap();
    assert_eq!(again.block_count(), 2);
    assert_eq!(again.total_bytes(), 2 * u128::from(IL));
}

#[test]
fn head_slicing_keeps_the_seeds_int64_address_range() {
    // The reference computes head-slice addresses in numpy int64: buffers at or
    // above 2^63 are rejected there, while the page copy (Python ints) is fine.
    let l = heads_layout(1, 0, 8, 2, 16);
    let mut r = heads_peer(4, 2, 8, 2, 16);
    r.dst_kv_ptrs = vec![1 << 63, (1 << 63) + GIB];
    assert!(matches!(
        plan(&l, &r, &request(&[5]), &chunk(&[3])),
        Err(PlanError::SignedOverflow { .. })
    ));
    let mut r = peer(2, IL);
    r.dst_kv_ptrs = vec![1 << 63, (1 << 63) + GIB];
    assert!(plan(&mha(1, 1, IL), &r, &request(&[5]), &chunk(&[3])).is_ok());
}
