//! Compressed MLA (DeepSeek-V4 pools): PP stages sliced out of a
//! whole-model decode list per ratio group, and HiSparse's second page
//! space (C4 KV in the decode's host pages, the rest in its device pages),
//! with hand-derived blocks and the refusals.

#![allow(clippy::unwrap_used)] // tests unwrap what they construct

mod common;

use common::*;
use kvbridge_plan::{
    CompressedMlaError, PeerRegistration, PlanError, PrefillLayout, TransferChunk, TransferRequest,
};

/// Bytes per page of a C4 KV, C4 indexer and C128 KV buffer.
const C4: u64 = 37440;
const IDX: u64 = 8448;
const C128: u64 = 1728;

/// A compressed-MLA stage: layers `start..end` of `ratios`, buffers C4 KV,
/// C4 indexer, C128 KV of those layers.
fn v4(ratios: &[u64], start: u64, end: u64) -> PrefillLayout {
    let layers = &ratios[start as usize..end as usize];
    let c4 = layers.iter().filter(|&&r| r == 4).count();
    let c128 = layers.iter().filter(|&&r| r == 128).count();
    let mut lens = vec![C4; c4];
    lens.extend(vec![IDX; c4]);
    lens.extend(vec![C128; c128]);
    PrefillLayout {
        page_size: 256,
        is_mla_backend: true,
        kv_data_ptrs: ptrs(S, lens.len()),
        kv_item_lens: lens,
        prefill_start_layer: start,
        prefill_end_layer: Some(end),
        pp_size: if end - start == ratios.len() as u64 {
            1
        } else {
            2
        },
        mla_compression_ratios: Some(ratios.to_vec()),
        ..PrefillLayout::default()
    }
}

fn decode(buffers: usize) -> PeerRegistration {
    PeerRegistration {
        dst_kv_ptrs: ptrs(D, buffers),
        dst_kv_item_len: C4,
        ..PeerRegistration::default()
    }
}

#[test]
fn a_stage_pairs_with_its_layers_in_each_ratio_group() {
    // Model [4,128,4,128,4,128]; decode (PP 1): [C4 l0 l2 l4 | IDX l0 l2 l4 |
    // C128 l1 l3 l5]. Stage 3..6 holds C4 l4, IDX l4, C128 l3, C128 l5.
    let ratios = [4, 128, 4, 128, 4, 128];
    let got = plan(
        &v4(&ratios, 3, 6),
        &decode(9),
        &request(&[40]),
        &chunk(&[10]),
    )
    .unwrap();
    let want = canon(vec![
        b(S + 10 * C4, D + 2 * GIB + 40 * C4, C4),
        b(S + GIB + 10 * IDX, D + 5 * GIB + 40 * IDX, IDX),
        b(S + 2 * GIB + 10 * C128, D + 7 * GIB + 40 * C128, C128),
        b(S + 3 * GIB + 10 * C128, D + 8 * GIB + 40 * C128, C128),
    ]);
    assert_eq!(got, want);
}

#[test]
fn a_decode_list_that_cannot_be_sliced_is_refused_at_registration() {
    let ratios = [4, 128, 4, 128, 4, 128];
    // One draft entry appended to the decode's list.
    let err = kvbridge_plan::PreparedPeer::new(&v4(&ratios, 3, 6), decode(10))
        .map(|p| p.config_error(&v4(&ratios, 3, 6)))
        .unwrap();
    assert!(
        matches!(
            err,
            Some(PlanError::CompressedMla(
                CompressedMlaError::UnsliceableKv { dst: 10, kv_len: 9 }
            ))
        ),
        "{err:?}"
    );
}

#[test]
fn hisparse_puts_c4_kv_in_host_pages_and_the_rest_in_device_pages() {
    // Model [4,128,4,128], one stage: [C4 l0, C4 l2, IDX l0, IDX l2, C128 l1,
    // C128 l3]; prefill pages [20,21,30]; decode host pages [100,101,102]
    // for C4 KV, logical (device) pages [7,8,9] for the others.
    let ratios = [4, 128, 4, 128];
    let layout = v4(&ratios, 0, 4);
    let req = TransferRequest {
        dst_device_kv_indices: Some(vec![7, 8, 9]),
        ..request(&[100, 101, 102])
    };
    let got = plan(&layout, &decode(6), &req, &chunk(&[20, 21, 30])).unwrap();
    let mut want = Vec::new();
    for (k, (item, host)) in [
        (C4, true),
        (C4, true),
        (IDX, false),
        (IDX, false),
        (C128, false),
        (C128, false),
    ]
    .into_iter()
    .enumerate()
    {
        let (s, d) = (S + k as u64 * GIB, D + k as u64 * GIB);
        let (first, last) = if host { (100, 102) } else { (7, 9) };
        want.push(b(s + 20 * item, d + first * item, 2 * item));
        want.push(b(s + 30 * item, d + last * item, item));
    }
    assert_eq!(got, canon(want));
}

#[test]
fn hisparse_device_pages_follow_the_chunk_and_must_cover_it() {
    let layout = v4(&[4, 128], 0, 2);
    // Second chunk (positions 2..4) of a 4-page request.
    let req = TransferRequest {
        dst_device_kv_indices: Some(vec![1, 2, 3, 4]),
        ..request(&[50, 51, 52, 53])
    };
    let ch = TransferChunk {
        index_slice_start: 2,
        index_slice_end: Some(4),
        ..chunk(&[8, 9])
    };
    let got = plan(&layout, &decode(3), &req, &ch).unwrap();
    assert_eq!(
        got,
        canon(vec![
            b(S + 8 * C4, D + 52 * C4, 2 * C4),
            b(S + GIB + 8 * IDX, D + GIB + 3 * IDX, 2 * IDX),
            b(S + 2 * GIB + 8 * C128, D + 2 * GIB + 3 * C128, 2 * C128),
        ])
    );
    let short = TransferRequest {
        dst_device_kv_indices: Some(vec![1, 2, 3]),
        ..req.clone()
    };
    assert_eq!(
        plan(&layout, &decode(3), &short, &ch),
        Err(PlanError::CompressedMla(
            CompressedMlaError::DeviceIndicesShort {
                device: 1,
                pages: 2
            }
        ))
    );
    // Device pages for a pool that is not compressed: refused, never ignored.
    let plain = PrefillLayout {
        mla_compression_ratios: None,
        ..layout
    };
    assert_eq!(
        plan(&plain, &decode(3), &req, &ch),
        Err(PlanError::CompressedMla(
            CompressedMlaError::DeviceWithoutCompression
        ))
    );
}
