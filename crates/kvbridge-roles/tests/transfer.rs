//! End-to-end rooms through real prefill and decode managers over the TCP
//! engine, in one process: bytes, aux and statuses arrive.
// Test code: a failed unwrap is a failed test.
#![allow(clippy::unwrap_used)]

mod common;

use std::time::Duration;

use common::*;
use kvbridge_roles::KvPoll;

const T: Duration = Duration::from_secs(20);

#[test]
fn one_room_in_chunks_arrives_byte_exact() {
    room_in_chunks(None);
}

/// `SGLANG_MOONCAKE_MAX_TRANSFER_BATCH_INDICES`: the planner's batches of
/// one page each do not merge neighbouring pages, so the engine gets more
/// blocks; the bytes are the same.
#[test]
fn batches_of_one_page_index_still_arrive_byte_exact() {
    let merged = room_in_chunks(None);
    let single = room_in_chunks(Some(1));
    assert!(
        single > merged,
        "{single} blocks with 1-page batches, {merged} merged"
    );
}

/// Sends one room in chunks of 3 pages; returns the blocks the prefill handed its engine.
fn room_in_chunks(max_transfer_batch_indices: Option<u64>) -> u64 {
    let bs = bootstrap();
    let mut p_pools = Pools::new(2, 32, 1024, 4, 64);
    let d_pools = Pools::new(2, 64, 1024, 8, 64);
    let src_pages: Vec<i32> = vec![3, 4, 5, 9, 10, 20, 21, 22];
    let dst_pages: Vec<i32> = vec![40, 41, 42, 43, 7, 8, 60, 61];
    for &p in &src_pages {
        p_pools.fill_page(p as u64, p as usize);
    }
    p_pools.fill_aux(7, 2);
    let prefill = start_prefill(
        kvbridge_roles::PrefillConfig {
            max_transfer_batch_indices,
            ..prefill_config(bs.local_addr(), 1, 0)
        },
        p_pools.kv_args(16, 1, 0, 8),
        tcp_engine(),
    );
    let decode = start_decode(decode_config(1), d_pools.kv_args(16, 1, 0, 8), tcp_engine());

    let room = 0xdead_beef;
    let mut rx = decode.receiver(&bs.local_addr().to_string(), room);
    assert_eq!(rx.init(0), KvPoll::WaitingForInput);
    rx.send_metadata(&dst_pages, 5, &[], None);
    let mut tx = prefill.sender(room);
    tx.init(src_pages.len() as u64, Some(2));
    assert_eq!(
        wait_for(T, KvPoll::WaitingForInput, || tx.poll()),
        KvPoll::WaitingForInput
    );
    for chunk in src_pages.chunks(3) {
        tx.send(chunk, None, None).unwrap();
    }
    assert_eq!(wait_terminal(T, || tx.poll()), KvPoll::Success);
    assert_eq!(wait_terminal(T, || rx.poll()), KvPoll::Success);
    for (s, d) in src_pages.iter().zip(&dst_pages) {
        // The page landed where the decode asked, with the prefill's bytes.
        let item = 1024usize;
        for b in 0..4 {
            assert_eq!(
                &d_pools.kv[b].as_slice()[*d as usize * item..(*d as usize + 1) * item],
                &p_pools.kv[b].as_slice()[*s as usize * item..(*s as usize + 1) * item]
            );
        }
    }
    assert_eq!(
        &d_pools.aux.as_slice()[5 * 64..6 * 64],
        &p_pools.aux.as_slice()[2 * 64..3 * 64]
    );
    rx.clear();
    tx.clear();
    let blocks = prefill.metrics().blocks.get();
    prefill.teardown();
    decode.teardown();
    blocks
}

#[test]
fn a_long_prompt_in_many_single_page_chunks() {
    let bs = bootstrap();
    let mut p_pools = Pools::new(2, 256, 512, 2, 64);
    let d_pools = Pools::new(2, 256, 512, 2, 64);
    let src: Vec<i32> = (0..240).collect();
    let dst: Vec<i32> = (0..240).rev().map(|p| p + 8).collect();
    for &p in &src {
        p_pools.fill_page(p as u64 ^ 0x55, p as usize);
    }
    let prefill = start_prefill(
        prefill_config(bs.local_addr(), 1, 0),
        p_pools.kv_args(16, 1, 0, 8),
        tcp_engine(),
    );
    let decode = start_decode(decode_config(1), d_pools.kv_args(16, 1, 0, 8), tcp_engine());
    let mut rx = decode.receiver(&bs.local_addr().to_string(), 7);
    assert_eq!(rx.init(0), KvPoll::WaitingForInput);
    rx.send_metadata(&dst, 1, &[], None);
    let mut tx = prefill.sender(7);
    tx.init(src.len() as u64, Some(0));
    wait_for(T, KvPoll::WaitingForInput, || tx.poll());
    // 240 chunks of one page each, as a chunked prefill with a tiny chunk size.
    for page in src.chunks(1) {
        tx.send(page, None, Some(16)).unwrap();
        assert_ne!(tx.poll(), KvPoll::Failed);
    }
    assert_eq!(wait_terminal(T, || tx.poll()), KvPoll::Success);
    assert_eq!(wait_terminal(T, || rx.poll()), KvPoll::Success);
    for (s, d) in src.iter().zip(&dst) {
        assert!(
            d_pools.page_matches(*s as u64 ^ 0x55, *d as usize),
            "page {s} -> {d}"
        );
    }
    assert_eq!(prefill.metrics().chunks.get(), 240);
    prefill.teardown();
    decode.teardown();
}

/// The intra-node transport mode (`MC_INTRANODE_NVLINK`) with host pools:
/// nothing is registered with the engine, every block travels as
/// `STATE_DATA` and the aux as `AUX_DATA` over the ordered zmq channel,
/// ahead of the status, and still lands byte-exact.
#[test]
fn intra_node_mode_ships_host_blocks_over_zmq() {
    let bs = bootstrap();
    let mut p_pools = Pools::new(2, 32, 1024, 4, 64);
    let d_pools = Pools::new(2, 64, 1024, 8, 64);
    let src_pages: Vec<i32> = vec![1, 2, 3, 7, 8];
    let dst_pages: Vec<i32> = vec![30, 31, 5, 6, 50];
    for &p in &src_pages {
        p_pools.fill_page(p as u64 + 100, p as usize);
    }
    p_pools.fill_aux(9, 1);
    let p_engine = tcp_engine();
    let d_engine = tcp_engine();
    let prefill = start_prefill(
        kvbridge_roles::PrefillConfig {
            nvlink_intra: true,
            ..prefill_config(bs.local_addr(), 1, 0)
        },
        p_pools.kv_args(16, 1, 0, 8),
        p_engine.clone(),
    );
    let decode = start_decode(
        kvbridge_roles::DecodeConfig {
            nvlink_intra: true,
            ..decode_config(1)
        },
        d_pools.kv_args(16, 1, 0, 8),
        d_engine.clone(),
    );
    assert!(
        p_engine.registered_regions().is_empty(),
        "host memory stays off the engine"
    );
    assert!(
        d_engine.registered_regions().is_empty(),
        "host memory stays off the engine"
    );
    let room = 0x1a7a;
    let mut rx = decode.receiver(&bs.local_addr().to_string(), room);
    assert_eq!(rx.init(0), KvPoll::WaitingForInput);
    rx.send_metadata(&dst_pages, 3, &[], None);
    let mut tx = prefill.sender(room);
    tx.init(src_pages.len() as u64, Some(1));
    assert_eq!(
        wait_for(T, KvPoll::WaitingForInput, || tx.poll()),
        KvPoll::WaitingForInput
    );
    for chunk in src_pages.chunks(2) {
        tx.send(chunk, None, None).unwrap();
    }
    assert_eq!(wait_terminal(T, || tx.poll()), KvPoll::Success);
    assert_eq!(wait_terminal(T, || rx.poll()), KvPoll::Success);
    let item = 1024usize;
    for (s, d) in src_pages.iter().zip(&dst_pages) {
        for b in 0..4 {
            assert_eq!(
                &d_pools.kv[b].as_slice()[*d as usize * item..(*d as usize + 1) * item],
                &p_pools.kv[b].as_slice()[*s as usize * item..(*s as usize + 1) * item]
            );
        }
    }
    assert_eq!(
        &d_pools.aux.as_slice()[3 * 64..4 * 64],
        &p_pools.aux.as_slice()[64..2 * 64]
    );
    rx.clear();
    tx.clear();
    prefill.teardown();
    decode.teardown();
}

/// A room with a state component (one mamba slot) sent in three chunks,
/// through the engine or, with the intra-node transport and host pools,
/// as `STATE_DATA` after the KV: KV pages, the state slot and the aux slot
/// all land byte-exact by the time either side reports `Success`.
fn state_slot_lands(intra: bool) {
    use kvbridge_mem::HostBuffer;
    use kvbridge_plan::{StateComponent, StateType};
    const SLOT: usize = 192;
    let bs = bootstrap();
    let mut p_pools = Pools::new(2, 32, 1024, 4, 64);
    let d_pools = Pools::new(2, 64, 1024, 8, 64);
    let mut p_state = HostBuffer::new(8 * SLOT).unwrap();
    let d_state = HostBuffer::new(16 * SLOT).unwrap();
    for (i, byte) in p_state.as_mut_slice()[3 * SLOT..4 * SLOT]
        .iter_mut()
        .enumerate()
    {
        *byte = pattern(77, 5, i as u64);
    }
    let with_state = |mut args: kvbridge_roles::KvArgs, buf: &HostBuffer| {
        args.layout.states.push(StateComponent::new(
            StateType::Mamba,
            vec![buf.addr()],
            vec![SLOT as u64],
        ));
        args.state_data_lens.push(vec![buf.len() as u64]);
        args
    };
    let src_pages: Vec<i32> = vec![1, 2, 3, 7, 8];
    let dst_pages: Vec<i32> = vec![30, 31, 5, 6, 50];
    for &p in &src_pages {
        p_pools.fill_page(p as u64 + 100, p as usize);
    }
    p_pools.fill_aux(9, 1);
    let prefill = start_prefill(
        kvbridge_roles::PrefillConfig {
            nvlink_intra: intra,
            ..prefill_config(bs.local_addr(), 1, 0)
        },
        with_state(p_pools.kv_args(16, 1, 0, 8), &p_state),
        tcp_engine(),
    );
    let decode = start_decode(
        kvbridge_roles::DecodeConfig {
            nvlink_intra: intra,
            ..decode_config(1)
        },
        with_state(d_pools.kv_args(16, 1, 0, 8), &d_state),
        tcp_engine(),
    );
    let room = 0x57a7e;
    let mut rx = decode.receiver(&bs.local_addr().to_string(), room);
    assert_eq!(rx.init(0), KvPoll::WaitingForInput);
    rx.send_metadata(&dst_pages, 3, &[vec![11]], None);
    let mut tx = prefill.sender(room);
    tx.init(src_pages.len() as u64, Some(1));
    assert_eq!(
        wait_for(T, KvPoll::WaitingForInput, || tx.poll()),
        KvPoll::WaitingForInput
    );
    let chunks: Vec<&[i32]> = src_pages.chunks(2).collect();
    for (i, chunk) in chunks.iter().enumerate() {
        let states = (i + 1 == chunks.len()).then(|| vec![Some(vec![3i64])]);
        tx.send(chunk, states, None).unwrap();
    }
    assert_eq!(wait_terminal(T, || rx.poll()), KvPoll::Success);
    // Checked the moment the decode sees Success.
    assert_eq!(
        &d_state.as_slice()[11 * SLOT..12 * SLOT],
        &p_state.as_slice()[3 * SLOT..4 * SLOT],
        "state slot"
    );
    let item = 1024usize;
    for (s, d) in src_pages.iter().zip(&dst_pages) {
        for b in 0..4 {
            assert_eq!(
                &d_pools.kv[b].as_slice()[*d as usize * item..(*d as usize + 1) * item],
                &p_pools.kv[b].as_slice()[*s as usize * item..(*s as usize + 1) * item]
            );
        }
    }
    assert_eq!(
        &d_pools.aux.as_slice()[3 * 64..4 * 64],
        &p_pools.aux.as_slice()[64..2 * 64]
    );
    assert_eq!(wait_terminal(T, || tx.poll()), KvPoll::Success);
    rx.clear();
    tx.clear();
    prefill.teardown();
    decode.teardown();
}

#[test]
fn a_state_slot_lands_through_the_engine() {
    state_slot_lands(false);
}

#[test]
fn a_state_slot_lands_over_zmq_after_the_kv_in_intra_node_mode() {
    state_slot_lands(true);
}

/// A decode naming HiSparse device destinations (`dst_device_kv_indices`)
/// gets its room refused with a reason, never KV written to other pages.
#[test]
fn hisparse_device_destinations_are_refused_not_ignored() {
    use kvbridge_wire::{PackedArray, PackedLists, Transfer, TransferPages};
    let bs = bootstrap();
    let pools = Pools::new(1, 8, 1024, 2, 64);
    let prefill = start_prefill(
        prefill_config(bs.local_addr(), 1, 0),
        pools.kv_args(16, 1, 0, 8),
        tcp_engine(),
    );
    let room = 0x4151;
    let mut tx = prefill.sender(room);
    tx.init(2, Some(0));
    let pages = [3i32, 4];
    let message = Transfer {
        room,
        endpoint: "127.0.0.1".into(),
        dst_port: 9,
        mooncake_session_id: "127.0.0.1:9".into(),
        pages: Some(TransferPages {
            dst_kv_indices: PackedArray::from(&pages[..]),
            dst_aux_index: 1,
            dst_state_indices: PackedLists::from_lists::<Vec<i32>>(&[]),
            dst_device_kv_indices: Some(PackedArray::from(&[7i32, 8][..])),
        }),
        required_dst_info_num: 1,
        decode_prefix_len: Some(0),
    };
    let frames: Vec<Vec<u8>> = message
        .encode()
        .into_iter()
        .map(|f| f.into_owned())
        .collect();
    prefill.handle_frames(&frames);
    assert_eq!(
        wait_terminal(Duration::from_secs(5), || tx.poll()),
        KvPoll::Failed
    );
    let e = tx.failure_exception();
    assert!(e.reason.contains("dst_device_kv_indices"), "{e}");
    prefill.teardown();
    bs.shutdown();
}

/// A decode whose pool has no compression ratios, handed HiSparse device
/// pages (`send_metadata_hisparse`), fails the room naming why before it
/// tells any prefill rank, instead of sending pages nobody can place.
#[test]
fn a_decode_without_compression_refuses_hisparse_device_pages() {
    let bs = bootstrap();
    let p_pools = Pools::new(1, 8, 1024, 2, 64);
    let d_pools = Pools::new(1, 8, 1024, 2, 64);
    let prefill = start_prefill(
        prefill_config(bs.local_addr(), 1, 0),
        p_pools.kv_args(16, 1, 0, 8),
        tcp_engine(),
    );
    let decode = start_decode(decode_config(1), d_pools.kv_args(16, 1, 0, 8), tcp_engine());
    let room = 0x4152;
    let mut rx = decode.receiver(&bs.local_addr().to_string(), room);
    assert_eq!(rx.init(0), KvPoll::WaitingForInput);
    assert_eq!(
        rx.send_metadata_hisparse(&[3, 4], &[7, 8], 1, &[], None),
        KvPoll::Failed
    );
    let e = rx.failure_exception();
    assert!(e.reason.contains("dst_device_kv_indices"), "{e}");
    assert!(e.reason.contains("mla_compression_ratios"), "{e}");
    assert_eq!(decode.metrics().failures_for("unsupported_destination"), 1);
    rx.clear();
    prefill.teardown();
    decode.teardown();
    bs.shutdown();
}
