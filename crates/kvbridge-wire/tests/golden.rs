//! Golden byte vectors: each is what a `send_multipart([...])` call of the
//! reference (sglang's Mooncake connector) or of sglang 0.5.23 puts on the
//! wire, derived by hand from the Python (`struct.pack`,
//! `np.int32.tobytes()`, `pack_int_lists`). Every vector must decode to the
//! expected fields and re-encode to the exact bytes.

use kvbridge_wire::json::{WireJson, hex_decode};
use kvbridge_wire::{KvPoll, Limits, ToDecode, ToPrefill};

fn frames(hex: &[&str]) -> Vec<Vec<u8>> {
    hex.iter()
        .map(|h| hex_decode(h).expect("test vector is hex"))
        .collect()
}

fn to_prefill(hex: &[&str]) -> (Vec<Vec<u8>>, ToPrefill<'static>) {
    let f = frames(hex);
    let m = ToPrefill::decode(&f, &Limits::DEFAULT)
        .expect("golden vector decodes")
        .into_owned();
    let again: Vec<Vec<u8>> = m.encode().into_iter().map(|c| c.into_owned()).collect();
    assert_eq!(again, f, "re-encoding {} changed the frames", m.kind());
    (f, m)
}

fn to_decode(hex: &[&str]) -> (Vec<Vec<u8>>, ToDecode<'static>) {
    let f = frames(hex);
    let m = ToDecode::decode(&f, &Limits::DEFAULT)
        .expect("golden vector decodes")
        .into_owned();
    let again: Vec<Vec<u8>> = m.encode().into_iter().map(|c| c.into_owned()).collect();
    assert_eq!(again, f, "re-encoding {} changed the frames", m.kind());
    (f, m)
}

/// The reference's `_register_kv_args` with two KV buffers, one aux buffer, two
/// state components (mamba with two buffers, an empty one), no staging:
/// `[b"None", ip, str(port), session, b"".join(pack("Q", p) for p in kv),
///   …, pack_int_lists(state_ptrs, "Q"), b"3", b"4", b"16384",
///   pack_int_lists([[1024, 2048], []], "I"), pack_int_lists([[8, 0], []], "I"),
///   b"".join(pack("I", l) for l in [0, 1]), pack_int_lists([[0, 1], []], "I"),
///   b"", b"", b"1", b"0", b"", pack("2Q", 16384, 16384)]`
#[test]
fn register_plain() {
    let (_, m) = to_prefill(&[
        "4e6f6e65",
        "31302e302e302e37",
        "3137303031",
        "31302e302e302e373a3135303031",
        "00100000007f000000200000007f0000",
        "00000000107f0000",
        "02000000100000000000000000000000207f000000001000207f0000",
        "33",
        "34",
        "3136333834",
        "0200000008000000000000000004000000080000",
        "0200000008000000000000000800000000000000",
        "0000000001000000",
        "0200000008000000000000000000000001000000",
        "",
        "",
        "31",
        "30",
        "",
        "00400000000000000040000000000000",
    ]);
    let ToPrefill::Register(r) = m else {
        panic!("not a register")
    };
    assert_eq!(r.endpoint, "10.0.0.7");
    assert_eq!(r.dst_port, 17001);
    assert_eq!(r.mooncake_session_id, "10.0.0.7:15001");
    assert_eq!(
        r.dst_kv_ptrs.to_vec(),
        vec![0x7f00_0000_1000, 0x7f00_0000_2000]
    );
    assert_eq!(r.dst_aux_ptrs.to_vec(), vec![0x7f10_0000_0000]);
    assert_eq!(
        r.dst_state_data_ptrs.to_vecs(),
        vec![vec![0x7f20_0000_0000, 0x7f20_0010_0000], vec![]]
    );
    assert_eq!(
        (r.dst_tp_rank, r.dst_attn_tp_size, r.dst_kv_item_len),
        (3, 4, 16384)
    );
    assert_eq!(
        r.dst_state_item_lens.to_vecs(),
        vec![vec![1024, 2048], vec![]]
    );
    assert_eq!(
        r.dst_state_dim_per_tensor.to_vecs(),
        vec![vec![8, 0], vec![]]
    );
    assert_eq!(r.dst_kv_layer_ids.to_vec(), vec![0, 1]);
    assert_eq!(r.dst_state_layer_ids.to_vecs(), vec![vec![0, 1], vec![]]);
    assert_eq!((r.staging_base_ptr, r.staging_total_size), (0, 0));
    assert_eq!((r.dst_dcp_size, r.dst_dcp_rank), (1, 0));
    assert!(r.staging_slot_layer_ids.is_empty());
    assert_eq!(r.dst_kv_item_lens.to_vec(), vec![16384, 16384]);
}

/// The same call with staging on (`pack("Q", base)`, `str(total)`), DCP 2
/// rank 1, slot layer ids `pack("Q", id)` for [0, 1, 0, 1], no aux, no
/// state, an MLA-like zero item len and `pack("0Q")` for the item lens.
#[test]
fn register_with_staging_and_dcp() {
    let (_, m) = to_prefill(&[
        "4e6f6e65",
        "31302e302e302e37",
        "3137303031",
        "31302e302e302e373a3135303031",
        "00100000007f000000200000007f0000",
        "",
        "",
        "30",
        "31",
        "30",
        "",
        "",
        "",
        "",
        "00000000307f0000",
        "323638343335343536",
        "32",
        "31",
        "0000000000000000010000000000000000000000000000000100000000000000",
        "",
    ]);
    let ToPrefill::Register(r) = m else {
        panic!("not a register")
    };
    assert_eq!(r.staging_base_ptr, 0x7f30_0000_0000);
    assert_eq!(r.staging_total_size, 1 << 28);
    assert_eq!((r.dst_dcp_size, r.dst_dcp_rank), (2, 1));
    assert_eq!(r.staging_slot_layer_ids.to_vec(), vec![0, 1, 0, 1]);
    assert!(r.dst_kv_item_lens.is_empty() && r.dst_aux_ptrs.is_empty());
    assert!(r.dst_state_data_ptrs.is_empty());
}

/// An older peer's 10-frame registration: the tail takes the reference's
/// defaults.
#[test]
fn register_short_form_defaults() {
    let f = frames(&[
        "4e6f6e65",
        "31302e302e302e37",
        "3137303031",
        "31302e302e302e373a3135303031",
        "00100000007f0000",
        "",
        "",
        "30",
        "31",
        "3136333834",
    ]);
    let ToPrefill::Register(r) = ToPrefill::decode(&f, &Limits::DEFAULT).unwrap() else {
        panic!()
    };
    assert_eq!(
        (r.dst_dcp_size, r.dst_dcp_rank, r.staging_base_ptr),
        (1, 0, 0)
    );
    assert!(r.dst_kv_layer_ids.is_empty() && r.dst_state_item_lens.is_empty());
    assert!(r.dst_kv_item_lens.is_empty());
}

/// The reference's `send_metadata`, non-dummy: `[str(room), ip, str(port),
/// session, kv_indices.tobytes(), str(aux), pack_int_lists(state, "i"),
/// str(required), str(decode_prefix_len or 0), b""]` with negative and
/// maximal int32 indices.
#[test]
fn transfer_pages() {
    let (_, m) = to_prefill(&[
        "31323334353637383930313233",
        "31302e302e302e37",
        "3137303031",
        "31302e302e302e373a3135303031",
        "050000000600000007000000ffffffffffffff7f",
        "3132",
        "02000000040000000800000003000000090000000a000000",
        "32",
        "30",
        "",
    ]);
    let ToPrefill::Transfer(t) = m else {
        panic!("not a transfer")
    };
    assert_eq!(t.room, 1_234_567_890_123);
    assert!(!t.is_dummy());
    let p = t.pages.as_ref().unwrap();
    assert_eq!(p.dst_kv_indices.to_vec(), vec![5, 6, 7, -1, i32::MAX]);
    assert_eq!(p.dst_aux_index, 12);
    assert_eq!(p.dst_state_indices.to_vecs(), vec![vec![3], vec![9, 10]]);
    assert_eq!(p.dst_device_kv_indices, None);
    assert_eq!(t.required_dst_info_num, 2);
    assert_eq!(t.decode_prefix_len, Some(0));
}

/// `send_metadata` with a decode prefix and HiSparse device indices
/// (`np.asarray(device, dtype=np.int32).tobytes()`), no state.
#[test]
fn transfer_with_prefix_and_device_indices() {
    let (_, m) = to_prefill(&[
        "37",
        "31302e302e302e37",
        "3137303031",
        "31302e302e302e373a3135303031",
        "0100000002000000",
        "30",
        "",
        "31",
        "313238",
        "2800000029000000",
    ]);
    let ToPrefill::Transfer(t) = m else { panic!() };
    let p = t.pages.as_ref().unwrap();
    assert_eq!(
        p.dst_device_kv_indices.as_ref().map(|d| d.to_vec()),
        Some(vec![40, 41])
    );
    assert!(p.dst_state_indices.is_empty());
    assert_eq!(t.decode_prefix_len, Some(128));
}

/// The dummy form: kv-index, aux and state frames empty.
#[test]
fn transfer_dummy() {
    let (_, m) = to_prefill(&[
        "37",
        "31302e302e302e38",
        "3137303032",
        "31302e302e302e383a3135303032",
        "",
        "",
        "",
        "32",
        "30",
        "",
    ]);
    let ToPrefill::Transfer(t) = m else { panic!() };
    assert!(t.is_dummy());
    let json = serde_json::to_value(WireJson::from_prefill(&ToPrefill::Transfer(t))).unwrap();
    assert_eq!(json["is_dummy"], true);
    assert_eq!(json["dst_aux_index"], serde_json::Value::Null);
    assert_eq!(json["dst_kv_indices"], serde_json::json!([]));
}

#[test]
fn abort_and_trailing_generation() {
    let (_, m) = to_prefill(&["41424f5254", "3939", "31302e302e302e37", "3137303031"]);
    let ToPrefill::Abort(a) = m else { panic!() };
    assert_eq!(
        (a.room, a.decode_ip.as_ref(), a.decode_port, a.generation),
        (99, "10.0.0.7", 17001, None)
    );
    // sglang 0.5.23 appends a generation frame: accepted, kept in the type.
    let f = frames(&["41424f5254", "3939", "31302e302e302e37", "3137303031", "35"]);
    let ToPrefill::Abort(a) = ToPrefill::decode(&f, &Limits::DEFAULT).unwrap() else {
        panic!()
    };
    assert_eq!(a.generation, Some(5));
}

#[test]
fn staging_control_messages() {
    let (_, m) = to_prefill(&[
        "57415445524d41524b",
        "33",
        "3635353336",
        "31302e302e302e313a3135303030",
    ]);
    assert_eq!(
        m,
        ToPrefill::Watermark(kvbridge_wire::Watermark {
            wm_round: 3,
            wm_tail: 65536,
            session_id: "10.0.0.1:15000".into(),
        })
    );
    let (_, m) = to_prefill(&[
        "53544147494e475f525350",
        "3939",
        "30",
        "2d31",
        "2d32",
        "2d31",
        "31302e302e302e313a3135303030",
    ]);
    let ToPrefill::StagingRsp(s) = m else {
        panic!()
    };
    assert_eq!((s.offset, s.round, s.end), (-1, -2, -1));
}

#[test]
fn status_messages() {
    let (_, m) = to_decode(&["3939", "34", "35"]);
    let ToDecode::Status(s) = m else { panic!() };
    assert_eq!(
        (s.room, s.status, s.prefill_rank, s.failure_reason),
        (99, KvPoll::Success, 5, None)
    );
    let (_, m) = to_decode(&[
        "3939",
        "30",
        "35",
        "4661696c656420746f2073656e64206b76206368756e6b206f6620393920746f2031302e302e302e373a313730303120e2809420c3a9",
    ]);
    let ToDecode::Status(s) = m else { panic!() };
    assert_eq!(s.status, KvPoll::Failed);
    assert_eq!(
        s.failure_reason.as_deref(),
        Some("Failed to send kv chunk of 99 to 10.0.0.7:17001 — é")
    );
}

#[test]
fn payload_messages() {
    let (_, m) = to_decode(&[
        "4155585f44415441",
        "3939",
        "31",
        "3132",
        "00000010",
        "000102030405060708090a0b0c0d0e0f",
    ]);
    let ToDecode::AuxData(a) = m else { panic!() };
    assert_eq!((a.room, a.buffer_index, a.aux_index), (99, 1, 12));
    assert_eq!(&a.data[..], &(0u8..16).collect::<Vec<_>>()[..]);
    let (_, m) = to_decode(&[
        "53544154455f44415441",
        "3939",
        "313339373735343135363831303838",
        "00000005",
        "68656c6c6f",
    ]);
    let ToDecode::StateData(s) = m else { panic!() };
    assert_eq!((s.dst_addr, &s.data[..]), (0x7f20_0000_0040, &b"hello"[..]));
}

#[test]
fn chunk_and_staging_requests() {
    let (_, m) = to_decode(&[
        "4348554e4b5f5245414459",
        "3939",
        "32",
        "313238",
        "3634",
        "31302e302e302e313a3135303030",
        "36",
    ]);
    let ToDecode::ChunkReady(c) = m else { panic!() };
    assert_eq!(
        (
            c.chunk_idx,
            c.page_start,
            c.num_pages,
            c.prefill_unique_rank
        ),
        (2, 128, 64, Some(6))
    );
    let (_, m) = to_decode(&[
        "53544147494e475f524551",
        "3939",
        "32",
        "3634",
        "31302e302e302e313a3135303030",
        "31",
    ]);
    let ToDecode::StagingReq(s) = m else { panic!() };
    assert_eq!(s.requester_pp_rank, Some(1));
    let (_, m) = to_decode(&[
        "53544147494e475f524551",
        "3939",
        "32",
        "3634",
        "31302e302e302e313a3135303030",
    ]);
    let ToDecode::StagingReq(s) = m else { panic!() };
    assert_eq!(s.requester_pp_rank, None);
}

#[test]
fn abort_acks_both_forms() {
    let (_, m) = to_decode(&["41424f52545f41434b", "3939"]);
    assert_eq!(
        m,
        ToDecode::AbortAck(kvbridge_wire::AbortAck {
            room: 99,
            prefill_rank: None,
            generation: None
        })
    );
    let (_, m) = to_decode(&["41424f52545f41434b", "3939", "36"]);
    let ToDecode::AbortAck(a) = m else { panic!() };
    assert_eq!(a.prefill_rank, Some(6));
}

/// kvbridge's decode appends its engine incarnation as frame 20; sglang
/// ignores trailing frames, and any other frame 20 is just an unknown one.
#[test]
fn register_incarnation_extension() {
    let base = [
        "4e6f6e65",
        "31302e302e302e37",
        "3137303031",
        "31302e302e302e373a3135303031",
        "00100000007f0000",
        "",
        "",
        "30",
        "31",
        "3136333834",
        "",
        "",
        "",
        "",
        "",
        "",
        "31",
        "30",
        "",
        "",
    ];
    let mut with = base.to_vec();
    let frame = kvbridge_wire::json::hex_encode(b"kvbridge-incarnation=12345");
    with.push(&frame);
    let (_, m) = to_prefill(&with);
    let ToPrefill::Register(r) = m else { panic!() };
    assert_eq!(r.incarnation, Some(12345));
    let mut other = base.to_vec();
    let future = kvbridge_wire::json::hex_encode(b"something-newer");
    other.push(&future);
    let f = frames(&other);
    let ToPrefill::Register(r) = ToPrefill::decode(&f, &Limits::DEFAULT).unwrap() else {
        panic!()
    };
    assert_eq!(r.incarnation, None);
}
