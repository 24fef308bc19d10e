//! Encode/decode cost of the two large wire messages: a registration with
//! 160 KV pointers (an 80-layer MHA model's K and V buffers) and a transfer
//! request with 32k page indices.

use std::borrow::Cow;

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use kvbridge::wire::{
    Limits, PackedArray, PackedLists, Register, ToPrefill, Transfer, TransferPages,
};

fn registration() -> Register<'static> {
    let kv: Vec<u64> = (0..160).map(|i| 0x7f00_0000_0000 + i * (1 << 30)).collect();
    Register {
        endpoint: "10.0.0.7".into(),
        dst_port: 17001,
        mooncake_session_id: "10.0.0.7:15001".into(),
        dst_kv_ptrs: kv.into(),
        dst_aux_ptrs: PackedArray::from(vec![0x7f10_0000_0000u64, 0x7f10_1000_0000]),
        dst_state_data_ptrs: PackedLists::from_lists::<Vec<u64>>(&[]),
        dst_tp_rank: 3,
        dst_attn_tp_size: 8,
        dst_kv_item_len: 16384,
        dst_state_item_lens: PackedLists::empty(),
        dst_state_dim_per_tensor: PackedLists::empty(),
        dst_kv_layer_ids: PackedArray::from((0..80u32).chain(0..80).collect::<Vec<_>>()),
        dst_state_layer_ids: PackedLists::empty(),
        staging_base_ptr: 0,
        staging_total_size: 0,
        dst_dcp_size: 1,
        dst_dcp_rank: 0,
        staging_slot_layer_ids: PackedArray::empty(),
        dst_kv_item_lens: PackedArray::from(vec![16384u64; 160]),
        incarnation: None,
        pair_key: None,
        aux_batch: false,
    }
}

fn transfer() -> Transfer<'static> {
    let pages: Vec<i32> = (0..32768).map(|i| (i * 7919) % 1_000_000).collect();
    Transfer {
        room: 0x1234_5678_9abc,
        endpoint: "10.0.0.7".into(),
        dst_port: 17001,
        mooncake_session_id: "10.0.0.7:15001".into(),
        pages: Some(TransferPages {
            dst_kv_indices: pages.into(),
            dst_aux_index: 12,
            dst_state_indices: PackedLists::from_lists(&[vec![5i32]]),
            dst_device_kv_indices: None,
        }),
        required_dst_info_num: 1,
        decode_prefix_len: Some(0),
    }
}

fn bench(c: &mut Criterion) {
    let mut group = c.benchmark_group("wire");
    for (name, message) in [
        ("register_160_kv_ptrs", ToPrefill::Register(registration())),
        ("transfer_32k_pages", ToPrefill::Transfer(transfer())),
    ] {
        let frames: Vec<Vec<u8>> = message.encode().into_iter().map(Cow::into_owned).collect();
        let bytes: usize = frames.iter().map(Vec::len).sum();
        group.throughput(Throughput::Bytes(bytes as u64));
        group.bench_with_input(BenchmarkId::new("encode", name), &message, |b, m| {
            b.iter(|| std::hint::black_box(m.encode()))
        });
        group.bench_with_input(BenchmarkId::new("decode", name), &frames, |b, f| {
            b.iter(|| std::hint::black_box(ToPrefill::decode(f, &Limits::DEFAULT)))
        });
        // Decoding plus reading every index out of the zero-copy view.
        group.bench_with_input(
            BenchmarkId::new("decode_and_read", name),
            &frames,
            |b, f| {
                b.iter(|| match ToPrefill::decode(f, &Limits::DEFAULT) {
                    Ok(ToPrefill::Transfer(t)) => t
                        .pages
                        .map_or(0, |p| p.dst_kv_indices.iter().map(i64::from).sum::<i64>()),
                    Ok(ToPrefill::Register(r)) => r.dst_kv_ptrs.iter().map(|p| p as i64).sum(),
                    _ => 0,
                })
            },
        );
    }
    group.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
