//! Property tests: `decode(encode(m)) == m`, `encode(decode(f)) == f` for
//! frames the reference (sglang's Mooncake connector) produces, the JSON
//! form round-trips, and arbitrary or mutated frames never make decoding
//! panic.

use std::borrow::Cow;

use kvbridge_wire::json::{WireJson, decode_command, encode_command, hex_encode};
use kvbridge_wire::{
    Abort, AbortAck, AuxData, ChunkReady, KvPoll, Limits, MAC_LEN, PackedArray, PackedLists,
    PairKey, Register, StagingReq, StagingRsp, StateData, Status, ToDecode, ToPrefill, Transfer,
    TransferPages, Watermark, mac_frame, split_mac,
};
use proptest::prelude::*;

const L: Limits = Limits::DEFAULT;

fn text() -> impl Strategy<Value = String> {
    "[ -~]{0,24}"
}

fn lists<T: std::fmt::Debug + Clone + 'static>(
    elem: impl Strategy<Value = T> + Clone,
) -> impl Strategy<Value = Vec<Vec<T>>> {
    prop::collection::vec(prop::collection::vec(elem, 0..6), 0..4)
}

prop_compose! {
    fn register()(
        endpoint in text(), dst_port: u16, sid in text(),
        kv in prop::collection::vec(any::<u64>(), 0..8),
        aux in prop::collection::vec(any::<u64>(), 0..3),
        state in lists(any::<u64>()),
        (tp, size, item) in any::<(u64, u64, u64)>(),
        item_lens in lists(any::<u32>()), dims in lists(any::<u32>()),
        layer_ids in prop::collection::vec(any::<u32>(), 0..8), state_ids in lists(any::<u32>()),
        (base, total, dcp, dcp_rank) in any::<(u64, u64, u64, u64)>(),
        slots in prop::collection::vec(any::<u64>(), 0..8),
        kv_lens in prop::collection::vec(any::<u64>(), 0..8),
    ) -> Register<'static> {
        Register {
            endpoint: endpoint.into(), dst_port, mooncake_session_id: sid.into(),
            dst_kv_ptrs: kv.into(), dst_aux_ptrs: aux.into(),
            dst_state_data_ptrs: PackedLists::from_lists(&state),
            dst_tp_rank: tp, dst_attn_tp_size: size, dst_kv_item_len: item,
            dst_state_item_lens: PackedLists::from_lists(&item_lens),
            dst_state_dim_per_tensor: PackedLists::from_lists(&dims),
            dst_kv_layer_ids: layer_ids.into(),
            dst_state_layer_ids: PackedLists::from_lists(&state_ids),
            staging_base_ptr: base, staging_total_size: total,
            dst_dcp_size: dcp, dst_dcp_rank: dcp_rank,
            staging_slot_layer_ids: slots.into(), dst_kv_item_lens: kv_lens.into(),
            // The JSON form has no incarnation, pair key or aux-batch
            // capability (kvbridge extensions).
            incarnation: None,
            pair_key: None,
            aux_batch: false,
        }
    }
}

prop_compose! {
    fn transfer()(
        room: u64, endpoint in text(), dst_port: u16, sid in text(),
        dummy: bool,
        kv in prop::collection::vec(any::<i32>(), 0..64), aux: u64,
        state in lists(any::<i32>()),
        device in prop::option::of(prop::collection::vec(any::<i32>(), 1..8)),
        required: u64, prefix: u64,
    ) -> Transfer<'static> {
        Transfer {
            room, endpoint: endpoint.into(), dst_port, mooncake_session_id: sid.into(),
            pages: (!dummy).then(|| TransferPages {
                dst_kv_indices: kv.into(), dst_aux_index: aux,
                dst_state_indices: PackedLists::from_lists(&state),
                dst_device_kv_indices: device.map(PackedArray::from),
            }),
            required_dst_info_num: required,
            // The reference always writes the prefix ("0" for None).
            decode_prefix_len: Some(prefix),
        }
    }
}

fn to_prefill() -> impl Strategy<Value = ToPrefill<'static>> {
    prop_oneof![
        register().prop_map(ToPrefill::Register),
        transfer().prop_map(ToPrefill::Transfer),
        (any::<u64>(), text(), any::<u16>()).prop_map(|(room, ip, port)| ToPrefill::Abort(Abort {
            room,
            decode_ip: ip.into(),
            decode_port: port,
            generation: None,
        })),
        (any::<u64>(), any::<u64>(), text()).prop_map(|(r, t, s)| ToPrefill::Watermark(
            Watermark {
                wm_round: r,
                wm_tail: t,
                session_id: s.into(),
            }
        )),
        (
            any::<u64>(),
            any::<u64>(),
            any::<i64>(),
            any::<i64>(),
            any::<i64>(),
            text()
        )
            .prop_map(
                |(room, chunk_idx, offset, round, end, s)| ToPrefill::StagingRsp(StagingRsp {
                    room,
                    chunk_idx,
                    offset,
                    round,
                    end,
                    session_id: s.into(),
                })
            ),
    ]
}

fn to_decode() -> impl Strategy<Value = ToDecode<'static>> {
    let bytes = || prop::collection::vec(any::<u8>(), 0..64);
    prop_oneof![
        (
            any::<u64>(),
            0u64..5,
            any::<u64>(),
            prop::option::of("\\PC{1,20}")
        )
            .prop_map(|(room, st, rank, why)| {
                ToDecode::Status(Status {
                    room,
                    status: KvPoll::from_u64(st).expect("0..5 is a KVPoll value"),
                    prefill_rank: rank,
                    failure_reason: why.map(Cow::Owned),
                })
            }),
        (any::<u64>(), any::<u64>(), any::<u64>(), bytes()).prop_map(|(room, b, a, d)| {
            ToDecode::AuxData(AuxData {
                room,
                buffer_index: b,
                aux_index: a,
                data: d.into(),
            })
        }),
        (any::<u64>(), any::<u64>(), bytes()).prop_map(|(room, addr, d)| ToDecode::StateData(
            StateData {
                room,
                dst_addr: addr,
                data: d.into(),
            }
        )),
        (any::<[u64; 4]>(), text(), prop::option::of(any::<u64>())).prop_map(|(n, s, r)| {
            ToDecode::ChunkReady(ChunkReady {
                room: n[0],
                chunk_idx: n[1],
                page_start: n[2],
                num_pages: n[3],
                session_id: s.into(),
                prefill_unique_rank: r,
            })
        }),
        (any::<[u64; 3]>(), text(), prop::option::of(any::<u64>())).prop_map(|(n, s, r)| {
            ToDecode::StagingReq(StagingReq {
                room: n[0],
                chunk_idx: n[1],
                chunk_num_pages: n[2],
                session_id: s.into(),
                requester_pp_rank: r,
            })
        }),
        (any::<u64>(), prop::option::of(any::<u64>())).prop_map(|(room, rank)| ToDecode::AbortAck(
            AbortAck {
                room,
                prefill_rank: rank,
                generation: None,
            }
        )),
    ]
}

fn owned(frames: kvbridge_wire::Frames<'_>) -> Vec<Vec<u8>> {
    frames.into_iter().map(Cow::into_owned).collect()
}

fn hex_frames(frames: &[Vec<u8>]) -> String {
    let hex: Vec<String> = frames.iter().map(|f| hex_encode(f)).collect();
    serde_json::to_string(&hex).expect("strings serialize")
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn prefill_messages_round_trip(m in to_prefill()) {
        let frames = owned(m.encode());
        let back = ToPrefill::decode(&frames, &L).unwrap();
        prop_assert_eq!(&back, &m);
        prop_assert_eq!(owned(back.encode()), frames.clone());
        // JSON: decode → JSON → encode gives the same frames.
        let input = format!(r#"{{"to":"prefill","frames":{}}}"#, hex_frames(&frames));
        let json = decode_command(&input, &L).unwrap();
        let again: serde_json::Value = serde_json::from_str(&encode_command(&json).unwrap()).unwrap();
        prop_assert_eq!(again["frames"].to_string(), hex_frames(&frames));
        let parsed: WireJson = serde_json::from_str(&json).unwrap();
        prop_assert_eq!(parsed, WireJson::from_prefill(&m));
    }

    #[test]
    fn decode_messages_round_trip(m in to_decode()) {
        let frames = owned(m.encode());
        let back = ToDecode::decode(&frames, &L).unwrap();
        prop_assert_eq!(&back, &m);
        prop_assert_eq!(owned(back.encode()), frames.clone());
        let input = format!(r#"{{"to":"decode","frames":{}}}"#, hex_frames(&frames));
        let json = decode_command(&input, &L).unwrap();
        let again: serde_json::Value = serde_json::from_str(&encode_command(&json).unwrap()).unwrap();
        prop_assert_eq!(again["frames"].to_string(), hex_frames(&frames));
    }

    #[test]
    fn arbitrary_frames_never_panic(frames in prop::collection::vec(prop::collection::vec(any::<u8>(), 0..40), 0..24)) {
        let _ = ToPrefill::decode(&frames, &L);
        let _ = ToDecode::decode(&frames, &L);
    }

    #[test]
    fn mutated_frames_never_panic(
        m in to_prefill(), d in to_decode(),
        idx: prop::sample::Index, byte: u8, pos: prop::sample::Index, cut: prop::sample::Index,
    ) {
        for mut frames in [owned(m.encode()), owned(d.encode())] {
            let i = idx.index(frames.len());
            if frames[i].is_empty() {
                frames[i].push(byte);
            } else {
                let p = pos.index(frames[i].len());
                frames[i][p] = byte;
            }
            let keep = cut.index(frames.len() + 1);
            for f in [&frames[..], &frames[..keep]] {
                // Whatever decodes re-encodes to canonical frames: frames
                // that decode and re-encode to themselves.
                if let Ok(ok) = ToPrefill::decode(f, &L) {
                    let again = owned(ok.encode());
                    prop_assert_eq!(owned(ToPrefill::decode(&again, &L).unwrap().encode()), again);
                }
                if let Ok(ok) = ToDecode::decode(f, &L) {
                    let again = owned(ok.encode());
                    prop_assert_eq!(owned(ToDecode::decode(&again, &L).unwrap().encode()), again);
                }
            }
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    /// kvbridge's registration tail (incarnation, pair key, aux-batch
    /// capability) round-trips in either presence, and sglang's 20 frames
    /// stay the message's first.
    #[test]
    fn a_registration_tail_round_trips(
        base in register(), incarnation in prop::option::of(any::<u64>()),
        key in prop::option::of(any::<[u8; 32]>()), aux_batch in any::<bool>(),
    ) {
        let m = Register { incarnation, pair_key: key.map(PairKey), aux_batch, ..base.clone() };
        let frames = owned(m.encode());
        prop_assert_eq!(&frames[..20], &owned(base.encode())[..20]);
        let back = Register::decode(&frames, &L).unwrap();
        prop_assert_eq!(&back, &m);
        prop_assert_eq!(owned(back.encode()), frames);
    }

    /// A MAC frame appended to any message splits back off, leaving the
    /// message's frames, which decode as before.
    #[test]
    fn a_mac_frame_splits_off_any_message(
        p in to_prefill(), d in to_decode(), mac in any::<[u8; MAC_LEN]>(),
    ) {
        for (m, prefill) in [(owned(p.encode()), true), (owned(d.encode()), false)] {
            let mut sealed = m.clone();
            sealed.push(mac_frame(&mac));
            let (body, got) = split_mac(&sealed);
            prop_assert_eq!(body, &m[..]);
            prop_assert_eq!(got, Some(mac));
            if prefill {
                prop_assert_eq!(ToPrefill::decode(body, &L).unwrap(), p.clone());
            } else {
                prop_assert_eq!(ToDecode::decode(body, &L).unwrap(), d.clone());
            }
        }
    }
}
