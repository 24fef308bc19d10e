//! Hostile and malformed input: one test per error variant, and the rule
//! that decoding never panics.

use kvbridge_wire::{DecodeError, IntegerError, Limits, ToDecode, ToPrefill};

const L: Limits = Limits::DEFAULT;

fn prefill(frames: &[&[u8]]) -> Result<ToPrefill<'static>, DecodeError> {
    ToPrefill::decode(frames, &L).map(ToPrefill::into_owned)
}

fn decode(frames: &[&[u8]]) -> Result<ToDecode<'static>, DecodeError> {
    ToDecode::decode(frames, &L).map(ToDecode::into_owned)
}

fn transfer(kv: &'static [u8], aux: &'static [u8]) -> Vec<&'static [u8]> {
    vec![
        b"7",
        b"10.0.0.1",
        b"17000",
        b"10.0.0.1:15000",
        kv,
        aux,
        b"",
        b"1",
        b"0",
        b"",
    ]
}

#[test]
fn empty_message() {
    assert_eq!(prefill(&[]), Err(DecodeError::Empty));
    assert_eq!(decode(&[]), Err(DecodeError::Empty));
}

#[test]
fn frame_counts() {
    assert!(matches!(
        prefill(&[b"ABORT", b"1", b"10.0.0.1"]),
        Err(DecodeError::FrameCount {
            kind: "abort",
            min: 4,
            got: 3
        })
    ));
    assert!(matches!(
        prefill(&[b"5", b"a"]),
        Err(DecodeError::FrameCount {
            kind: "transfer",
            ..
        })
    ));
    assert!(matches!(
        prefill(&[b"None"]),
        Err(DecodeError::FrameCount {
            kind: "register",
            min: 10,
            ..
        })
    ));
    assert!(matches!(
        decode(&[b"5", b"4"]),
        Err(DecodeError::FrameCount { kind: "status", .. })
    ));
    assert!(matches!(
        decode(&[b"ABORT_ACK"]),
        Err(DecodeError::FrameCount {
            kind: "abort_ack",
            ..
        })
    ));
    assert!(matches!(
        decode(&[b"AUX_DATA", b"1", b"0", b"0", b"\0\0\0\0"]),
        Err(DecodeError::FrameCount {
            kind: "aux_data",
            min: 6,
            got: 5
        })
    ));
    assert!(matches!(
        prefill(&[b"STAGING_RSP", b"1", b"0", b"0", b"0", b"0"]),
        Err(DecodeError::FrameCount {
            kind: "staging_rsp",
            ..
        })
    ));
}

#[test]
fn bad_rooms() {
    let mut t = transfer(b"", b"");
    t[0] = b"x7";
    assert_eq!(prefill(&t), Err(DecodeError::BadRoom));
    assert_eq!(decode(&[b"none", b"4", b"0"]), Err(DecodeError::BadRoom));
    assert_eq!(decode(&[b"-1", b"4", b"0"]), Err(DecodeError::BadRoom));
}

#[test]
fn wrong_direction() {
    assert!(matches!(
        prefill(&[b"ABORT_ACK", b"1"]),
        Err(DecodeError::WrongDirection {
            kind: "abort_ack",
            travels_to: "decode",
            received_by: "prefill"
        })
    ));
    assert!(matches!(
        decode(&[b"ABORT", b"1", b"10.0.0.1", b"1"]),
        Err(DecodeError::WrongDirection { kind: "abort", .. })
    ));
    assert!(matches!(
        decode(&[b"None"]),
        Err(DecodeError::WrongDirection {
            kind: "register",
            ..
        })
    ));
}

#[test]
fn bad_integers() {
    for (bad, reason) in [
        (&b"+5"[..], IntegerError::NotDecimal),
        (b"05", IntegerError::LeadingZero),
        (b" 5", IntegerError::NotDecimal),
        (b"1_0", IntegerError::NotDecimal),
        (b"99999999999999999999", IntegerError::OutOfRange),
    ] {
        let got = decode(&[b"ABORT_ACK", bad]);
        assert_eq!(
            got,
            Err(DecodeError::BadInteger {
                field: "room",
                reason
            }),
            "{bad:?}"
        );
    }
    assert!(matches!(
        decode(&[b"5", b"", b"0"]),
        Err(DecodeError::BadInteger {
            field: "status",
            reason: IntegerError::Empty
        })
    ));
    // Ports must fit 16 bits.
    assert!(matches!(
        prefill(&[b"ABORT", b"1", b"10.0.0.1", b"70000"]),
        Err(DecodeError::BadInteger {
            field: "decode_port",
            reason: IntegerError::OutOfRange
        })
    ));
    // Only STAGING_RSP's offset, round and end may be negative.
    assert!(matches!(
        prefill(&[b"WATERMARK", b"-1", b"0"]),
        Err(DecodeError::BadInteger {
            field: "wm_round",
            ..
        })
    ));
    assert!(prefill(&[b"STAGING_RSP", b"1", b"0", b"-1", b"-2", b"-1", b"s"]).is_ok());
}

#[test]
fn non_ascii_text() {
    assert_eq!(
        prefill(&[b"ABORT", b"1", "ä".as_bytes(), b"1"]),
        Err(DecodeError::NotAscii { field: "decode_ip" })
    );
    let mut t = transfer(b"", b"");
    t[3] = b"\xff";
    assert_eq!(
        prefill(&t),
        Err(DecodeError::NotAscii {
            field: "mooncake_session_id"
        })
    );
}

#[test]
fn misaligned_arrays() {
    assert!(matches!(
        prefill(&transfer(b"\x01\x00\x00", b"0")),
        Err(DecodeError::Misaligned {
            field: "dst_kv_indices",
            len: 3,
            width: 4
        })
    ));
    let mut reg: Vec<&[u8]> = vec![
        b"None",
        b"ip",
        b"1",
        b"s",
        b"\0\0\0\0\0\0\0",
        b"",
        b"",
        b"0",
        b"1",
        b"0",
    ];
    assert!(matches!(
        prefill(&reg),
        Err(DecodeError::Misaligned {
            field: "dst_kv_ptrs",
            width: 8,
            ..
        })
    ));
    reg[4] = b"";
    reg.extend_from_slice(&[b"", b"", b"\0\0\0"]);
    assert!(matches!(
        prefill(&reg),
        Err(DecodeError::Misaligned {
            field: "dst_kv_layer_ids",
            ..
        })
    ));
}

#[test]
fn payload_lengths() {
    assert!(matches!(
        decode(&[b"AUX_DATA", b"1", b"0", b"0", b"\0\0\0\x05", b"abcd"]),
        Err(DecodeError::PayloadLength {
            field: "data",
            declared: 5,
            actual: 4
        })
    ));
    assert!(matches!(
        decode(&[b"STATE_DATA", b"1", b"4096", b"\0\0\x05", b"abcde"]),
        Err(DecodeError::BadWidth {
            field: "data",
            got: 3,
            ..
        })
    ));
}

#[test]
fn oversized_fields() {
    let tight = Limits {
        max_text_len: 4,
        max_payload_len: 2,
        max_array_len: 1,
        max_lists: 1,
        max_reason_len: 3,
    };
    assert!(matches!(
        ToPrefill::decode(&[&b"ABORT"[..], b"1", b"10.0.0.1", b"1"], &tight),
        Err(DecodeError::Oversized {
            field: "decode_ip",
            len: 8,
            limit: 4
        })
    ));
    assert!(matches!(
        ToDecode::decode(
            &[&b"AUX_DATA"[..], b"1", b"0", b"0", b"\0\0\0\x03", b"abc"],
            &tight
        ),
        Err(DecodeError::Oversized { field: "data", .. })
    ));
    assert!(matches!(
        ToDecode::decode(&[&b"1"[..], b"0", b"0", b"long"], &tight),
        Err(DecodeError::Oversized {
            field: "failure_reason",
            ..
        })
    ));
    let kv = [0u8; 8];
    let frames: Vec<&[u8]> = vec![b"7", b"ip", b"1", b"s", &kv, b"0", b"", b"1", b"0", b""];
    assert!(matches!(
        ToPrefill::decode(&frames, &tight),
        Err(DecodeError::Oversized {
            field: "dst_kv_indices",
            len: 2,
            limit: 1
        })
    ));
}

#[test]
fn packed_list_headers() {
    // pack_int_lists([[1]], "i") with a body one byte short.
    let short = [1u8, 0, 0, 0, 4, 0, 0, 0, 1, 0, 0];
    let mut t = transfer(b"\x01\0\0\0", b"0");
    t[6] = &short;
    assert!(matches!(
        prefill(&t),
        Err(DecodeError::BadPackedLists {
            field: "dst_state_indices",
            ..
        })
    ));
}

#[test]
fn staging_base_ptr_width() {
    let reg: Vec<&[u8]> = vec![
        b"None",
        b"ip",
        b"1",
        b"s",
        b"",
        b"",
        b"",
        b"0",
        b"1",
        b"0",
        b"",
        b"",
        b"",
        b"",
        b"\x01\x02\x03",
    ];
    assert!(matches!(
        prefill(&reg),
        Err(DecodeError::BadWidth {
            field: "staging_base_ptr",
            got: 3,
            ..
        })
    ));
}

#[test]
fn unknown_status_value() {
    assert_eq!(
        decode(&[b"1", b"5", b"0"]),
        Err(DecodeError::UnknownStatus(5))
    );
}

#[test]
fn half_dummy_transfer() {
    assert_eq!(
        prefill(&transfer(b"\x01\0\0\0", b"")),
        Err(DecodeError::MissingAuxIndex)
    );
    // Aux without pages is a real (zero-page) request, not a dummy.
    let ToPrefill::Transfer(t) = prefill(&transfer(b"", b"3")).unwrap() else {
        panic!()
    };
    assert!(!t.is_dummy());
}

#[test]
fn unknown_trailing_frames_are_ignored() {
    let ok = decode(&[b"ABORT_ACK", b"1", b"2", b"3", b"future", b"frames"]).unwrap();
    assert!(matches!(ok, ToDecode::AbortAck(_)));
    let mut t = transfer(b"", b"");
    t.extend_from_slice(&[b"x", b"y"]);
    assert!(prefill(&t).is_ok());
    let status = decode(&[b"1", b"4", b"0", b"", b"tag-from-the-future"]).unwrap();
    let ToDecode::Status(s) = status else {
        panic!()
    };
    assert_eq!(s.failure_reason, None);
}
