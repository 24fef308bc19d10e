//! docs/plan-scenario.md §3.1 and §3.6: DCP registration and relayout —
//! hand-derived blocks and exact errors.

#![allow(clippy::unwrap_used)] // tests unwrap what they construct

mod common;

use common::*;
use kvbridge_plan::{
    KvPath, PeerRegistration, PlanError, PrefillLayout, PreparedPeer, TransferChunk,
    TransferRequest,
};

const IL: u64 = 4096;

// ---------------------------------------------------------------- DCP (§3.1, §3.6)

fn dcp_layout(nd: u64) -> PrefillLayout {
    let mut l = mla(2 + nd as usize, 4, 256);
    l.num_draft_entries = nd;
    l
}

fn dcp_peer(n: usize, dcp: u64, rank: u64) -> PeerRegistration {
    PeerRegistration {
        dst_dcp_size: dcp,
        dst_dcp_rank: rank,
        ..peer(n, 256)
    }
}

fn dcp_chunk(pages: &[i32], tokens: u64) -> TransferChunk {
    TransferChunk {
        num_kv_tokens: Some(tokens),
        ..chunk(pages)
    }
}

#[test]
fn dcp_target_tokens_interleave_by_rank() {
    let l = dcp_layout(0);
    let r = dcp_peer(2, 2, 0);
    let p = PreparedPeer::new(&l, r.clone()).unwrap();
    assert_eq!(p.kv_path(), KvPath::DcpRelayout);
    assert_eq!(p.dcp_token_item_lens(), Some(&[64, 64][..]));
    let got = plan(&l, &r, &request(&[40, 41]), &dcp_chunk(&[2, 3], 8)).unwrap();
    // tokens 0,2,4,6 -> prefill rows 8,10,12,14 -> decode rows 160..164.
    let mut want = Vec::new();
    for e in 0..2 {
        for (k, srow) in [8u64, 10, 12, 14].into_iter().enumerate() {
            want.push(b(
                S + e * GIB + srow * 64,
                D + e * GIB + (160 + k as u64) * 64,
                64,
            ));
        }
    }
    assert_eq!(got, canon(want));
}

#[test]
fn dcp_draft_gets_every_token_in_virtual_pages() {
    let l = dcp_layout(1);
    let mut r = dcp_peer(3, 2, 1);
    r.dst_kv_item_lens = vec![256, 256, 512];
    let req = TransferRequest {
        decode_prefix_len: Some(8),
        ..request(&[40, 41, 42])
    };
    let ch = TransferChunk {
        index_slice_start: 1,
        ..dcp_chunk(&[2], 4)
    };
    let got = plan(&l, &r, &req, &ch).unwrap();
    // Draft: chunk tokens 0..4 are request tokens 4..8 -> virtual rows 320+4..320+8.
    assert!(got.contains(&b(S + 2 * GIB + 8 * 64, D + 2 * GIB + 324 * 64, 4 * 64)));
    // Target: global positions 12..16, rank 1 takes 13, 15 -> local 2, 3 -> rows 162, 163.
    assert!(got.contains(&b(S + 9 * 64, D + 162 * 64, 64)));
    assert!(got.contains(&b(S + 11 * 64, D + 163 * 64, 64)));
    assert_eq!(got.len(), 5);
}

#[test]
fn dcp_registration_errors() {
    let mut l = mla(2, 4, 256);
    l.dcp_size = 2;
    l.dcp_rank = 1;
    assert_eq!(
        PreparedPeer::new(&l, dcp_peer(2, 2, 0)).unwrap_err(),
        PlanError::DcpRankMismatch {
            prefill: 1,
            decode: 0
        }
    );
    assert_eq!(
        PreparedPeer::new(&l, dcp_peer(2, 4, 0)).unwrap_err(),
        PlanError::UnsupportedDcpTopology {
            prefill: 2,
            decode: 4
        }
    );
    assert_eq!(
        PreparedPeer::new(&mha(1, 4, 256), dcp_peer(2, 2, 0)).unwrap_err(),
        PlanError::UnsupportedDcpTopology {
            prefill: 1,
            decode: 2
        }
    );
    let mut r = dcp_peer(2, 2, 0);
    r.dst_kv_item_len = 128;
    assert_eq!(
        PreparedPeer::new(&mla(2, 4, 256), r).unwrap_err(),
        PlanError::DcpTokenWidthMismatch {
            entry: 0,
            src: 64,
            dst: 32
        }
    );
    let mut l = mla(2, 4, 256);
    l.num_draft_entries = 3;
    assert!(matches!(
        PreparedPeer::new(&l, dcp_peer(2, 2, 0)).unwrap_err(),
        PlanError::DcpDraftEntries {
            entries: 2,
            draft: 3
        }
    ));
}

#[test]
fn dcp_chunk_errors() {
    let l = dcp_layout(0);
    let r = dcp_peer(2, 2, 0);
    let req = request(&[40, 41]);
    assert_eq!(
        plan(&l, &r, &req, &chunk(&[2, 3])),
        Err(PlanError::MissingNumKvTokens)
    );
    let misaligned = TransferRequest {
        decode_prefix_len: Some(4),
        ..req.clone()
    };
    assert_eq!(
        plan(&l, &r, &misaligned, &dcp_chunk(&[2, 3], 8)),
        Err(PlanError::MisalignedDecodePrefix {
            prefix: 4,
            virtual_page: 8
        })
    );
    let mut short = r.clone();
    short.dst_kv_item_lens = vec![256];
    assert_eq!(
        plan(&l, &short, &req, &dcp_chunk(&[2, 3], 8)),
        Err(PlanError::DstKvItemLensLength { lens: 1, ptrs: 2 })
    );
    assert!(matches!(
        plan(&l, &r, &req, &dcp_chunk(&[2, 3], 9)),
        Err(PlanError::DcpIndexOutOfRange {
            what: "prefill",
            ..
        })
    ));
    assert!(matches!(
        plan(&l, &r, &request(&[40]), &dcp_chunk(&[2, 3, 4], 9)),
        Err(PlanError::DcpIndexOutOfRange {
            what: "decode",
            index: 1,
            len: 1
        })
    ));
    // Zero tokens: nothing, but the prefix is still checked first.
    assert_eq!(plan(&l, &r, &req, &dcp_chunk(&[2, 3], 0)), Ok(vec![]));
    assert_eq!(
        plan(
            &mla(3, 4, 256),
            &dcp_peer(2, 2, 0),
            &req,
            &dcp_chunk(&[2], 2)
        ),
        Err(PlanError::DcpEntryOutOfRange {
            entry: 2,
            dst_entries: 2
        })
    );
}

#[test]
fn dcp_draft_errors() {
    let req = request(&[40, 41]);
    let ch = dcp_chunk(&[2, 3], 8);
    let l = dcp_layout(1);
    let mut r = dcp_peer(3, 2, 0);
    r.dst_attn_tp_size = 2;
    assert_eq!(
        plan(&l, &r, &req, &ch),
        Err(PlanError::DraftTpWithoutItemLens)
    );

    let mut r = dcp_peer(3, 2, 0);
    r.dst_kv_item_lens = vec![256, 256, 500];
    assert_eq!(
        plan(&l, &r, &req, &ch),
        Err(PlanError::DraftWidthInvalid { entry: 2 })
    );

    r.dst_kv_item_lens = vec![256, 256, 8 * 32];
    assert_eq!(
        plan(&l, &r, &req, &ch),
        Err(PlanError::DraftHeadSlicingOnMla)
    );

    let mut hybrid = dcp_layout(1);
    hybrid.is_mla_backend = false;
    hybrid.is_hybrid_mla_backend = true;
    hybrid.kv_item_lens = vec![256, 256, 4 * 48];
    r.dst_kv_item_lens = vec![256, 256, 8 * 64];
    assert_eq!(
        plan(&hybrid, &r, &req, &ch),
        Err(PlanError::DraftShardsNotDivisible { src: 48, dst: 64 })
    );
}

#[test]
fn dcp_hybrid_draft_is_head_sliced_per_token() {
    // Prefill TP 1 draft token of 64 bytes; decode TP 2 rank 1 holds 32 of them.
    let mut l = dcp_layout(1);
    l.is_mla_backend = false;
    l.is_hybrid_mla_backend = true;
    let mut r = dcp_peer(3, 2, 0);
    r.dst_attn_tp_size = 2;
    r.dst_tp_rank = 1;
    r.dst_kv_item_len = 256;
    r.dst_kv_item_lens = vec![256, 256, 8 * 32];
    let got = plan(&l, &r, &request(&[40]), &dcp_chunk(&[2], 2)).unwrap();
    // Token t: prefill row 8 + t (64 B, slice at 32), decode row 320 + t (32 B).
    assert!(got.contains(&b(S + 2 * GIB + 32 + 8 * 64, D + 2 * GIB + 320 * 32, 32)));
    assert!(got.contains(&b(S + 2 * GIB + 32 + 9 * 64, D + 2 * GIB + 321 * 32, 32)));
}

#[test]
fn hybrid_mla_non_writer_skips_kv_but_not_aux() {
    let mut l = mla(2, 16, IL);
    l.is_mla_backend = false;
    l.is_hybrid_mla_backend = true;
    l.attn_tp_size = 4;
    l.engine_rank = 1;
    l.aux_data_ptrs = vec![0x5000];
    l.aux_item_lens = vec![32];
    let mut r = peer(2, IL);
    r.dst_attn_tp_size = 2;
    r.dst_aux_ptrs = vec![0x9000];
    let ch = TransferChunk {
        prefill_aux_index: Some(1),
        ..chunk(&[1])
    };
    assert!(PreparedPeer::new(&l, r.clone()).unwrap().skips_kv());
    assert_eq!(
        plan(&l, &r, &request(&[2]), &ch),
        Ok(vec![b(0x5020, 0x9000, 32)])
    );
}
