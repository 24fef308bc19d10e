//! docs/plan-scenario.md §3.7: state components (mamba, page-indexed, MiniMax,
//! DSA tail) — hand-derived blocks and exact errors.

#![allow(clippy::unwrap_used)] // tests unwrap what they construct

mod common;

use common::*;
use kvbridge_plan::{
    DsaTailError, PeerRegistration, PlanError, PrefillLayout, StateComponent, StateType,
    TransferChunk, TransferRequest,
};

const IL: u64 = 4096;

// ---------------------------------------------------------------- mamba (§3.7)

fn mamba_setup(
    p: u64,
    d: u64,
    rank: u64,
    drank: u64,
    comp: StateComponent,
    dst_lens: Vec<u64>,
    dst_dims: Vec<u64>,
) -> (
    PrefillLayout,
    PeerRegistration,
    TransferRequest,
    TransferChunk,
) {
    let mut l = PrefillLayout {
        attn_tp_size: p,
        engine_rank: rank,
        ..PrefillLayout::default()
    };
    let mut r = PeerRegistration {
        dst_attn_tp_size: d,
        dst_tp_rank: drank,
        ..PeerRegistration::default()
    };
    let (mut req, mut ch) = (TransferRequest::default(), TransferChunk::default());
    let n = comp.data_ptrs.len();
    add_state(
        &mut l,
        &mut r,
        &mut req,
        &mut ch,
        comp,
        ptrs(SD, n),
        dst_lens,
        Some(vec![3]),
        vec![11],
    );
    r.dst_state_dim_per_tensor = vec![dst_dims];
    (l, r, req, ch)
}

fn run(
    (l, r, req, ch): &(
        PrefillLayout,
        PeerRegistration,
        TransferRequest,
        TransferChunk,
    ),
) -> Result<Vec<kvbridge_plan::Block>, PlanError> {
    plan(l, r, req, ch)
}

#[test]
fn mamba_equal_tp_copies_whole_slots() {
    let comp = state(StateType::Mamba, 2, 192);
    let s = mamba_setup(2, 2, 1, 1, comp, vec![192, 192], vec![]);
    assert_eq!(
        run(&s).unwrap(),
        canon(vec![
            b(SS + 3 * 192, SD + 11 * 192, 192),
            b(SS + GIB + 3 * 192, SD + GIB + 11 * 192, 192)
        ])
    );
}

#[test]
fn mamba_aggregation_places_each_conv_sub_block() {
    // Conv state of 384 channels = q|k|v = 96|96|192, 2 bytes each; TP 4 -> 2, rank 3 (writer 1).
    let mut comp = state(StateType::Mamba, 1, 192);
    comp.dim_per_tensor = vec![96];
    comp.conv_shard_groups = vec![Some(vec![96, 96, 192])];
    let s = mamba_setup(4, 2, 3, 1, comp, vec![384], vec![192]);
    let (sb, db) = (SS + 192 * 3, SD + 384 * 11);
    assert_eq!(
        run(&s).unwrap(),
        canon(vec![
            b(sb, db + 48, 48),
            b(sb + 48, db + 144, 48),
            b(sb + 96, db + 288, 96)
        ])
    );
}

#[test]
fn mamba_scatter_with_outer_rows() {
    // [3 rows, 8 channels] of 2 bytes; TP 1 -> 2, decode rank 1 takes channels 4..8 of each row.
    let mut comp = state(StateType::Mamba, 1, 48);
    comp.dim_per_tensor = vec![8];
    comp.slice_outer_counts = vec![3];
    let s = mamba_setup(1, 2, 0, 1, comp, vec![24], vec![4]);
    let (sb, db) = (SS + 48 * 3, SD + 24 * 11);
    assert_eq!(
        run(&s).unwrap(),
        canon(vec![
            b(sb + 8, db, 8),
            b(sb + 24, db + 8, 8),
            b(sb + 40, db + 16, 8)
        ])
    );
}

#[test]
fn mamba_replicated_item_has_one_writer_per_group() {
    let mut comp = state(StateType::Mamba, 1, 512);
    comp.dim_per_tensor = vec![0];
    let s = mamba_setup(4, 2, 1, 0, comp.clone(), vec![512], vec![0]);
    assert_eq!(run(&s), Ok(vec![]));
    let s = mamba_setup(4, 2, 2, 0, comp, vec![512], vec![0]);
    assert_eq!(run(&s), Ok(vec![b(SS + 3 * 512, SD + 11 * 512, 512)]));
}

#[test]
fn mamba_errors() {
    let comp = state(StateType::Mamba, 1, 192);
    // Sizes differ, no dims.
    let s = mamba_setup(2, 4, 0, 0, comp.clone(), vec![96], vec![]);
    assert_eq!(
        run(&s),
        Err(PlanError::MambaLayoutMismatch { component: 0 })
    );
    // Two slots.
    let mut s = mamba_setup(2, 2, 0, 0, comp.clone(), vec![192], vec![]);
    s.3.state_indices = Some(vec![Some(vec![1, 2])]);
    assert_eq!(
        run(&s),
        Err(PlanError::MambaSlotCount {
            component: 0,
            count: 2
        })
    );
    // Missing decode slot.
    let mut s = mamba_setup(2, 2, 0, 0, comp.clone(), vec![192], vec![]);
    s.2.dst_state_indices = vec![vec![]];
    assert_eq!(
        run(&s),
        Err(PlanError::MissingDstStateIndex { component: 0 })
    );
    // Slot size mismatch (dims present, equal TP).
    let mut c = comp.clone();
    c.dim_per_tensor = vec![96];
    let s = mamba_setup(2, 2, 0, 0, c.clone(), vec![384], vec![192]);
    assert_eq!(
        run(&s),
        Err(PlanError::MambaSlotSizeMismatch {
            component: 0,
            src: 192,
            dst: 384
        })
    );
    // Missing decode dim.
    let s = mamba_setup(2, 4, 0, 0, c.clone(), vec![96], vec![]);
    assert!(matches!(
        run(&s),
        Err(PlanError::MambaLayoutMismatch { .. })
    ));
    let mut two = state(StateType::Mamba, 2, 192);
    two.dim_per_tensor = vec![96, 96];
    let s = mamba_setup(2, 4, 0, 0, two, vec![96, 96], vec![48]);
    assert!(matches!(
        run(&s),
        Err(PlanError::MissingStateMetadata {
            what: "dst_dim_per_tensor",
            entry: 1,
            ..
        })
    ));
    // Replication mismatch.
    let s = mamba_setup(2, 4, 0, 0, c.clone(), vec![96], vec![0]);
    assert_eq!(
        run(&s),
        Err(PlanError::MambaReplicationMismatch { component: 0 })
    );
    // Replicated sizes differ.
    let mut rep = comp.clone();
    rep.dim_per_tensor = vec![0];
    let s = mamba_setup(2, 4, 0, 0, rep.clone(), vec![96], vec![0]);
    assert!(matches!(
        run(&s),
        Err(PlanError::MambaReplicatedSizeMismatch { .. })
    ));
    // TP sizes that do not divide.
    let s = mamba_setup(3, 2, 0, 0, rep, vec![192], vec![0]);
    assert_eq!(
        run(&s),
        Err(PlanError::TpNotDivisible {
            prefill: 3,
            decode: 2
        })
    );
    // Outer count 0.
    let mut z = c;
    z.slice_outer_counts = vec![0];
    let s = mamba_setup(2, 4, 0, 0, z, vec![96], vec![48]);
    assert!(matches!(run(&s), Err(PlanError::ZeroStateDivisor { .. })));
}

// ---------------------------------------------------------------- paged states (§3.7)

fn paged(
    layout: PrefillLayout,
    reg: PeerRegistration,
    comp: StateComponent,
    nd: usize,
    si: &[i64],
    di: &[i64],
) -> Result<Vec<kvbridge_plan::Block>, PlanError> {
    let (mut l, mut r) = (layout, reg);
    let (mut req, mut ch) = (request(&[]), chunk(&[]));
    let item = comp.item_lens[0];
    add_state(
        &mut l,
        &mut r,
        &mut req,
        &mut ch,
        comp,
        ptrs(SD, nd),
        vec![item; nd],
        Some(si.to_vec()),
        di.to_vec(),
    );
    plan(&l, &r, &req, &ch)
}

#[test]
fn swa_halves_and_single_region() {
    let got = paged(
        mha(1, 1, IL),
        peer(2, IL),
        state(StateType::Swa, 2, 512),
        2,
        &[5, 6],
        &[9, 10],
    )
    .unwrap();
    assert_eq!(
        got,
        canon(vec![
            b(SS + 5 * 512, SD + 9 * 512, 1024),
            b(SS + GIB + 5 * 512, SD + GIB + 9 * 512, 1024)
        ])
    );
    // Longer decode list: truncated.
    let got = paged(
        mha(1, 1, IL),
        peer(2, IL),
        state(StateType::Swa, 1, 512),
        1,
        &[5],
        &[9, 10],
    )
    .unwrap();
    assert_eq!(got, vec![b(SS + 5 * 512, SD + 9 * 512, 512)]);
}

#[test]
fn paged_state_tp_rules() {
    let mut l = mha(1, 1, IL);
    l.attn_tp_size = 2;
    assert_eq!(
        paged(
            l.clone(),
            peer(2, IL),
            state(StateType::Swa, 2, 512),
            2,
            &[1],
            &[1]
        ),
        Err(PlanError::PagedStateTpMismatch {
            state_type: StateType::Swa
        })
    );
    // MLA may differ in TP.
    let mut m = mla(1, 1, IL);
    m.attn_tp_size = 2;
    assert!(
        paged(
            m.clone(),
            peer(1, IL),
            state(StateType::Dsa, 1, 512),
            1,
            &[1],
            &[1]
        )
        .is_ok()
    );
    // QSA aggregation: rank 1 of 2 is not the writer.
    m.engine_rank = 1;
    assert_eq!(
        paged(
            m.clone(),
            peer(1, IL),
            state(StateType::QsaPending, 1, 512),
            1,
            &[1],
            &[1]
        ),
        Ok(vec![])
    );
    // QSA layout checks.
    let mut reg = peer(1, IL);
    reg.dst_attn_tp_size = 1;
    let (mut l2, mut r2) = (m.clone(), reg);
    let (mut req, mut ch) = (request(&[]), chunk(&[]));
    add_state(
        &mut l2,
        &mut r2,
        &mut req,
        &mut ch,
        state(StateType::QsaCompressed, 2, 512),
        ptrs(SD, 2),
        vec![512],
        Some(vec![1]),
        vec![1],
    );
    assert!(matches!(
        plan(&l2, &r2, &req, &ch),
        Err(PlanError::QsaMetadataMismatch {
            ptrs: 2,
            lens: 1,
            ..
        })
    ));
    r2.dst_state_item_lens = vec![vec![512, 256]];
    assert!(matches!(
        plan(&l2, &r2, &req, &ch),
        Err(PlanError::QsaLayoutMismatch { dst: 256, .. })
    ));
}

#[test]
fn exact_index_types_and_c128_skip() {
    let m = mla(1, 1, IL);
    assert_eq!(
        paged(
            m.clone(),
            peer(1, IL),
            state(StateType::SwaRing, 1, 64),
            1,
            &[1, 2],
            &[3]
        ),
        Err(PlanError::StateIndexLengthMismatch {
            state_type: StateType::SwaRing,
            src: 2,
            dst: 1
        })
    );
    assert!(
        paged(
            m.clone(),
            peer(1, IL),
            state(StateType::C128State, 1, 64),
            1,
            &[1],
            &[]
        )
        .is_err()
    );
    // Both empty: skipped before any pairing (a pairing that would fail).
    let mut c = state(StateType::C128State, 2, 64);
    c.layer_ids = vec![0, 1];
    assert_eq!(paged(m.clone(), peer(1, IL), c, 3, &[], &[]), Ok(vec![]));
    // Block scale truncates.
    assert_eq!(
        paged(
            m,
            peer(1, IL),
            state(StateType::BlockScale, 1, 64),
            1,
            &[1, 2, 3],
            &[7]
        ),
        Ok(vec![b(SS + 64, SD + 7 * 64, 64)])
    );
}

#[test]
fn minimax_rules() {
    let m = mha(1, 1, IL);
    assert_eq!(
        paged(
            m.clone(),
            peer(2, IL),
            state(StateType::MinimaxIndexK, 2, 64),
            2,
            &[1, 2],
            &[5]
        ),
        Ok(canon(vec![
            b(SS + 64, SD + 5 * 64, 64),
            b(SS + GIB + 64, SD + GIB + 5 * 64, 64)
        ]))
    );
    let mut pp = m.clone();
    pp.pp_size = 2;
    assert_eq!(
        paged(
            pp,
            peer(2, IL),
            state(StateType::MinimaxIndexK, 2, 64),
            2,
            &[1],
            &[5]
        ),
        Err(PlanError::MinimaxPipeline)
    );
    let mut tp = mla(1, 1, IL);
    tp.attn_tp_size = 2;
    assert!(matches!(
        paged(
            tp,
            peer(1, IL),
            state(StateType::MinimaxIndexK, 1, 64),
            1,
            &[1],
            &[5]
        ),
        Err(PlanError::MinimaxTpMismatch { .. })
    ));
    assert_eq!(
        paged(
            m,
            peer(2, IL),
            state(StateType::RequestRow, 1, 64),
            5,
            &[1, 2],
            &[]
        ),
        Ok(vec![])
    );
}

// ---------------------------------------------------------------- DSA tail (§3.7)

fn tail(
    si: &[i64],
    di: &[i64],
    ns: usize,
    nd: usize,
    sring: u64,
    dring: u64,
    start: u64,
) -> Result<Vec<kvbridge_plan::Block>, PlanError> {
    let mut l = mla(1, 1, IL);
    l.prefill_start_layer = start;
    l.pp_size = if start > 0 { 2 } else { 1 };
    let mut r = peer(1, IL);
    if start > 0 {
        r = peer(1 + start as usize, IL);
    }
    let (mut req, mut ch) = (request(&[]), chunk(&[]));
    add_state(
        &mut l,
        &mut r,
        &mut req,
        &mut ch,
        state(StateType::DsaTail, ns, 132 * sring),
        ptrs(SD, nd),
        vec![132 * dring; nd],
        Some(si.to_vec()),
        di.to_vec(),
    );
    plan(&l, &r, &req, &ch)
}

#[test]
fn dsa_tail_remaps_live_slots_across_rings() {
    let got = tail(&[3, 0, 5, 0, 0, 8], &[9, 8, 2, 0, 3, 10], 2, 2, 8, 10, 0).unwrap();
    let mut want = Vec::new();
    for k in 0..2 {
        let (sb, db) = (SS + k * GIB + 1056 * 3, SD + k * GIB + 1320 * 9);
        want.push(b(sb, db + 8 * 132, 264));
        want.push(b(sb + 2 * 132, db, 396));
    }
    assert_eq!(got, canon(want));
}

#[test]
fn dsa_tail_pp_stage_takes_both_halves() {
    // Stage layer 1 of 3: decode keys [0..3), scores [3..6): takes 1 and 4.
    let got = tail(&[0, 0, 1, 0, 0, 8], &[0, 0, 1, 0, 0, 8], 2, 6, 8, 8, 1).unwrap();
    assert_eq!(
        got,
        canon(vec![b(SS, SD + GIB, 132), b(SS + GIB, SD + 4 * GIB, 132)])
    );
}

#[test]
fn dsa_tail_errors() {
    let t = |si: &[i64], di: &[i64]| tail(si, di, 2, 2, 8, 10, 0);
    let reason = |r: Result<Vec<kvbridge_plan::Block>, PlanError>| match r {
        Err(PlanError::DsaTail { reason, .. }) => reason,
        other => panic!("{other:?}"),
    };
    assert_eq!(t(&[], &[]), Ok(vec![]));
    assert_eq!(reason(t(&[1, 0, 3, 0, 0, 8], &[])), DsaTailError::OneSided);
    assert!(matches!(
        reason(t(&[1, 0, 3, 0, 0], &[1, 0, 3, 0, 0, 10])),
        DsaTailError::NotSixTuple { .. }
    ));
    assert!(matches!(
        reason(t(&[1, 0, 0, 0, 0, 0], &[1, 0, 0, 0, 0, 10])),
        DsaTailError::RingSize { .. }
    ));
    assert_eq!(
        reason(t(&[1, -1, 3, 0, 0, 8], &[1, 0, 3, 0, 0, 10])),
        DsaTailError::NegativeSegment
    );
    assert!(matches!(
        reason(t(&[1, 6, 3, 0, 0, 8], &[1, 0, 3, 0, 0, 10])),
        DsaTailError::SegmentBeyondRing { .. }
    ));
    assert!(matches!(
        reason(t(&[1, 0, 3, 0, 0, 8], &[1, 0, 4, 0, 0, 10])),
        DsaTailError::LiveCountMismatch { .. }
    ));
    assert_eq!(
        reason(t(&[-1, 0, 3, 0, 0, 8], &[1, 0, 3, 0, 0, 10])),
        DsaTailError::NegativeRow
    );
    assert!(matches!(
        reason(tail(
            &[1, 0, 3, 0, 0, 8],
            &[1, 0, 3, 0, 0, 10],
            2,
            3,
            8,
            10,
            0
        )),
        DsaTailError::OddHalves { .. }
    ));
    assert!(matches!(
        reason(tail(
            &[1, 0, 3, 0, 0, 8],
            &[1, 0, 3, 0, 0, 10],
            2,
            2,
            8,
            11,
            0
        )),
        DsaTailError::SlotSizeMismatch { .. } | DsaTailError::RowNotDivisible { .. }
    ));
    assert!(matches!(
        reason(tail(
            &[1, 0, 3, 0, 0, 8],
            &[1, 0, 3, 0, 0, 10],
            2,
            4,
            8,
            10,
            2
        )),
        DsaTailError::StageBeyondDecode { .. }
    ));
    let mut l = mla(1, 1, IL);
    let mut r = peer(1, IL);
    let (mut req, mut ch) = (request(&[]), chunk(&[]));
    add_state(
        &mut l,
        &mut r,
        &mut req,
        &mut ch,
        state(StateType::DsaTail, 2, 1056),
        ptrs(SD, 2),
        vec![1001, 1001],
        Some(vec![1, 0, 3, 0, 0, 8]),
        vec![1, 0, 3, 0, 0, 10],
    );
    assert!(matches!(
        reason(plan(&l, &r, &req, &ch)),
        DsaTailError::RowNotDivisible {
            row_bytes: 1001,
            ..
        }
    ));
}

#[test]
fn single_region_non_swa_state_on_mha_moves_nothing() {
    // K/V halves of one buffer are zero layers (the reference ships nothing).
    assert_eq!(
        paged(
            mha(1, 1, IL),
            peer(2, IL),
            state(StateType::BlockScale, 1, 64),
            1,
            &[1],
            &[2]
        ),
        Ok(vec![])
    );
    // Against several decode buffers the halves do not line up: rejected.
    assert!(matches!(
        paged(
            mha(1, 1, IL),
            peer(2, IL),
            state(StateType::BlockScale, 1, 64),
            2,
            &[1],
            &[2]
        ),
        Err(PlanError::EmptyKvHalves { .. })
    ));
}
