//! The JSON form of messages used by `kvbridge wire decode|encode`
//! (`contracts/wire-cli.md`): sglang's field names, byte strings as
//! lowercase hex, integer arrays as JSON arrays, absent optionals as `null`.

use std::borrow::Cow;

use serde::{Deserialize, Serialize};
use thiserror::Error;

use crate::{
    Abort, AbortAck, AuxData, ChunkReady, KvPoll, Limits, PackedArray, PackedLists, Register, Side,
    StagingReq, StagingRsp, StateData, Status, ToDecode, ToPrefill, Transfer, TransferPages,
    Watermark,
};

/// Input that is not the JSON the CLI contract describes (exit status 2).
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum InputError {
    /// Not JSON, or not the expected object.
    #[error("invalid input JSON: {0}")]
    Json(#[from] serde_json::Error),
    /// `to` is neither `prefill` nor `decode`.
    #[error("unknown `to`: {0:?} (expected \"prefill\" or \"decode\")")]
    UnknownSide(String),
    /// A frame that is not even-length hex.
    #[error("frame {index} is not even-length hex")]
    BadHex {
        /// Position of the frame.
        index: usize,
    },
}

#[derive(Deserialize)]
struct DecodeInput {
    to: String,
    frames: Vec<String>,
}

/// Runs `wire decode`: `{"to", "frames"}` in, one JSON object out (the
/// message, or `{"error": reason}` for frames that are not a valid message).
pub fn decode_command(input: &str, limits: &Limits) -> Result<String, InputError> {
    let parsed: DecodeInput = serde_json::from_str(input)?;
    let side = match parsed.to.as_str() {
        "prefill" => Side::Prefill,
        "decode" => Side::Decode,
        other => return Err(InputError::UnknownSide(other.to_owned())),
    };
    let frames = parsed
        .frames
        .iter()
        .enumerate()
        .map(|(index, f)| hex_decode(f).ok_or(InputError::BadHex { index }))
        .collect::<Result<Vec<_>, _>>()?;
    let message = match side {
        Side::Prefill => ToPrefill::decode(&frames, limits).map(|m| WireJson::from_prefill(&m)),
        Side::Decode => ToDecode::decode(&frames, limits).map(|m| WireJson::from_decode(&m)),
    };
    Ok(match message {
        Ok(json) => serde_json::to_string(&json)?,
        Err(e) => error_json(&e.to_string()),
    })
}

/// Runs `wire encode`: a message object in, `{"frames": [hex…]}` out, or
/// `{"error": reason}` when the object is not a valid message.
pub fn encode_command(input: &str) -> Result<String, InputError> {
    let value: serde_json::Value = serde_json::from_str(input)?;
    if !value.is_object() {
        return Err(InputError::Json(serde::de::Error::custom(
            "expected a JSON object",
        )));
    }
    let frames = serde_json::from_value::<WireJson>(value)
        .map_err(|e| e.to_string())
        .and_then(|m| m.to_frames());
    Ok(match frames {
        Ok(frames) => {
            let hex: Vec<String> = frames.iter().map(|f| hex_encode(f)).collect();
            serde_json::json!({ "frames": hex }).to_string()
        }
        Err(reason) => error_json(&reason),
    })
}

fn error_json(reason: &str) -> String {
    serde_json::json!({ "error": reason.replace('\n', " ") }).to_string()
}

/// Lowercase hex of `bytes`.
pub fn hex_encode(bytes: &[u8]) -> String {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    let mut out = String::with_capacity(bytes.len() * 2);
    for &b in bytes {
        out.push(char::from(DIGITS[usize::from(b >> 4)]));
        out.push(char::from(DIGITS[usize::from(b & 0xf)]));
    }
    out
}

/// Bytes of even-length hex (either case), or `None`.
pub fn hex_decode(text: &str) -> Option<Vec<u8>> {
    let digit = |c: u8| match c {
        b'0'..=b'9' => Some(c - b'0'),
        b'a'..=b'f' => Some(c - b'a' + 10),
        b'A'..=b'F' => Some(c - b'A' + 10),
        _ => None,
    };
    let raw = text.as_bytes();
    if !raw.len().is_multiple_of(2) {
        return None;
    }
    raw.chunks_exact(2)
        .map(|pair| Some(digit(pair[0])? << 4 | digit(pair[1])?))
        .collect()
}

mod hex_bytes {
    use serde::{Deserialize, Deserializer, Serializer, de::Error};

    pub fn serialize<S: Serializer>(bytes: &[u8], s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&super::hex_encode(bytes))
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<u8>, D::Error> {
        let text = String::deserialize(d)?;
        super::hex_decode(&text).ok_or_else(|| D::Error::custom("expected even-length hex"))
    }
}

fn one() -> u64 {
    1
}

/// One message in the CLI's JSON shape, tagged by `kind`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
#[allow(missing_docs)]
pub enum WireJson {
    Register(RegisterJson),
    Transfer(TransferJson),
    Abort(AbortJson),
    Watermark(WatermarkJson),
    StagingRsp(StagingRspJson),
    Status(StatusJson),
    AuxData(AuxDataJson),
    StateData(StateDataJson),
    ChunkReady(ChunkReadyJson),
    StagingReq(StagingReqJson),
    AbortAck(AbortAckJson),
}

/// `register` fields.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[allow(missing_docs)]
pub struct RegisterJson {
    pub endpoint: String,
    pub dst_port: u16,
    pub mooncake_session_id: String,
    #[serde(default)]
    pub dst_kv_ptrs: Vec<u64>,
    #[serde(default)]
    pub dst_aux_ptrs: Vec<u64>,
    #[serde(default)]
    pub dst_state_data_ptrs: Vec<Vec<u64>>,
    pub dst_tp_rank: u64,
    pub dst_attn_tp_size: u64,
    pub dst_kv_item_len: u64,
    #[serde(default)]
    pub dst_state_item_lens: Vec<Vec<u32>>,
    #[serde(default)]
    pub dst_state_dim_per_tensor: Vec<Vec<u32>>,
    #[serde(default)]
    pub dst_kv_layer_ids: Vec<u32>,
    #[serde(default)]
    pub dst_state_layer_ids: Vec<Vec<u32>>,
    #[serde(default)]
    pub staging_base_ptr: u64,
    #[serde(default)]
    pub staging_total_size: u64,
    #[serde(default = "one")]
    pub dst_dcp_size: u64,
    #[serde(default)]
    pub dst_dcp_rank: u64,
    #[serde(default)]
    pub staging_slot_layer_ids: Vec<u64>,
    #[serde(default)]
    pub dst_kv_item_lens: Vec<u64>,
}

/// `transfer` fields.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[allow(missing_docs)]
pub struct TransferJson {
    pub room: u64,
    pub endpoint: String,
    pub dst_port: u16,
    pub mooncake_session_id: String,
    #[serde(default)]
    pub dst_kv_indices: Vec<i32>,
    #[serde(default)]
    pub dst_aux_index: Option<u64>,
    #[serde(default)]
    pub dst_state_indices: Vec<Vec<i32>>,
    pub required_dst_info_num: u64,
    #[serde(default)]
    pub is_dummy: bool,
    #[serde(default)]
    pub decode_prefix_len: Option<u64>,
    #[serde(default)]
    pub dst_device_kv_indices: Option<Vec<i32>>,
}

/// `abort` fields.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[allow(missing_docs)]
pub struct AbortJson {
    pub room: u64,
    pub decode_ip: String,
    pub decode_port: u16,
}

/// `watermark` fields.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[allow(missing_docs)]
pub struct WatermarkJson {
    pub wm_round: u64,
    pub wm_tail: u64,
    #[serde(default)]
    pub session_id: String,
}

/// `staging_rsp` fields.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[allow(missing_docs)]
pub struct StagingRspJson {
    pub room: u64,
    pub chunk_idx: u64,
    pub offset: i64,
    pub round: i64,
    pub end: i64,
    pub session_id: String,
}

/// `status` fields.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[allow(missing_docs)]
pub struct StatusJson {
    pub room: u64,
    pub status: u64,
    pub prefill_rank: u64,
    #[serde(default)]
    pub failure_reason: Option<String>,
}

/// `aux_data` fields.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[allow(missing_docs)]
pub struct AuxDataJson {
    pub room: u64,
    pub buffer_index: u64,
    pub aux_index: u64,
    #[serde(with = "hex_bytes")]
    pub data: Vec<u8>,
}

/// `state_data` fields.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[allow(missing_docs)]
pub struct StateDataJson {
    pub room: u64,
    pub dst_addr: u64,
    #[serde(with = "hex_bytes")]
    pub data: Vec<u8>,
}

/// `chunk_ready` fields.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[allow(missing_docs)]
pub struct ChunkReadyJson {
    pub room: u64,
    pub chunk_idx: u64,
    pub page_start: u64,
    pub num_pages: u64,
    pub session_id: String,
    #[serde(default)]
    pub prefill_unique_rank: Option<u64>,
}

/// `staging_req` fields.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[allow(missing_docs)]
pub struct StagingReqJson {
    pub room: u64,
    pub chunk_idx: u64,
    pub chunk_num_pages: u64,
    pub session_id: String,
    #[serde(default)]
    pub requester_pp_rank: Option<u64>,
}

/// `abort_ack` fields.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[allow(missing_docs)]
pub struct AbortAckJson {
    pub room: u64,
    #[serde(default)]
    pub prefill_rank: Option<u64>,
}

fn text(field: &str, value: &str) -> Result<(), String> {
    if value.is_ascii() {
        Ok(())
    } else {
        Err(format!("field `{field}`: not ASCII"))
    }
}

fn payload_len(data: &[u8]) -> Result<(), String> {
    u32::try_from(data.len())
        .map(drop)
        .map_err(|_| "field `data`: longer than 4 GiB".to_owned())
}

impl WireJson {
    /// The JSON form of a message a prefill rank received.
    pub fn from_prefill(message: &ToPrefill<'_>) -> Self {
        match message {
            ToPrefill::Register(m) => WireJson::Register(RegisterJson {
                endpoint: m.endpoint.to_string(),
                dst_port: m.dst_port,
                mooncake_session_id: m.mooncake_session_id.to_string(),
                dst_kv_ptrs: m.dst_kv_ptrs.to_vec(),
                dst_aux_ptrs: m.dst_aux_ptrs.to_vec(),
                dst_state_data_ptrs: m.dst_state_data_ptrs.to_vecs(),
                dst_tp_rank: m.dst_tp_rank,
                dst_attn_tp_size: m.dst_attn_tp_size,
                dst_kv_item_len: m.dst_kv_item_len,
                dst_state_item_lens: m.dst_state_item_lens.to_vecs(),
                dst_state_dim_per_tensor: m.dst_state_dim_per_tensor.to_vecs(),
                dst_kv_layer_ids: m.dst_kv_layer_ids.to_vec(),
                dst_state_layer_ids: m.dst_state_layer_ids.to_vecs(),
                staging_base_ptr: m.staging_base_ptr,
                staging_total_size: m.staging_total_size,
                dst_dcp_size: m.dst_dcp_size,
                dst_dcp_rank: m.dst_dcp_rank,
                staging_slot_layer_ids: m.staging_slot_layer_ids.to_vec(),
                dst_kv_item_lens: m.dst_kv_item_lens.to_vec(),
            }),
            ToPrefill::Transfer(m) => WireJson::Transfer(TransferJson {
                room: m.room,
                endpoint: m.endpoint.to_string(),
                dst_port: m.dst_port,
                mooncake_session_id: m.mooncake_session_id.to_string(),
                dst_kv_indices: m
                    .pages
                    .as_ref()
                    .map(|p| p.dst_kv_indices.to_vec())
                    .unwrap_or_default(),
                dst_aux_index: m.pages.as_ref().map(|p| p.dst_aux_index),
                dst_state_indices: m
                    .pages
                    .as_ref()
                    .map(|p| p.dst_state_indices.to_vecs())
                    .unwrap_or_default(),
                required_dst_info_num: m.required_dst_info_num,
                is_dummy: m.is_dummy(),
                decode_prefix_len: m.decode_prefix_len,
                dst_device_kv_indices: m
                    .pages
                    .as_ref()
                    .and_then(|p| p.dst_device_kv_indices.as_ref())
                    .map(PackedArray::to_vec),
            }),
            ToPrefill::Abort(m) => WireJson::Abort(AbortJson {
                room: m.room,
                decode_ip: m.decode_ip.to_string(),
                decode_port: m.decode_port,
            }),
            ToPrefill::Watermark(m) => WireJson::Watermark(WatermarkJson {
                wm_round: m.wm_round,
                wm_tail: m.wm_tail,
                session_id: m.session_id.to_string(),
            }),
            ToPrefill::StagingRsp(m) => WireJson::StagingRsp(StagingRspJson {
                room: m.room,
                chunk_idx: m.chunk_idx,
                offset: m.offset,
                round: m.round,
                end: m.end,
                session_id: m.session_id.to_string(),
            }),
        }
    }

    /// The JSON form of a message a decode rank received.
    pub fn from_decode(message: &ToDecode<'_>) -> Self {
        match message {
            ToDecode::Status(m) => WireJson::Status(StatusJson {
                room: m.room,
                status: u64::from(m.status.as_u8()),
                prefill_rank: m.prefill_rank,
                failure_reason: m.failure_reason.as_ref().map(|r| r.to_string()),
            }),
            ToDecode::AuxData(m) => WireJson::AuxData(AuxDataJson {
                room: m.room,
                buffer_index: m.buffer_index,
                aux_index: m.aux_index,
                data: m.data.to_vec(),
            }),
            ToDecode::StateData(m) => WireJson::StateData(StateDataJson {
                room: m.room,
                dst_addr: m.dst_addr,
                data: m.data.to_vec(),
            }),
            ToDecode::ChunkReady(m) => WireJson::ChunkReady(ChunkReadyJson {
                room: m.room,
                chunk_idx: m.chunk_idx,
                page_start: m.page_start,
                num_pages: m.num_pages,
                session_id: m.session_id.to_string(),
                prefill_unique_rank: m.prefill_unique_rank,
            }),
            ToDecode::StagingReq(m) => WireJson::StagingReq(StagingReqJson {
                room: m.room,
                chunk_idx: m.chunk_idx,
                chunk_num_pages: m.chunk_num_pages,
                session_id: m.session_id.to_string(),
                requester_pp_rank: m.requester_pp_rank,
            }),
            ToDecode::AbortAck(m) => WireJson::AbortAck(AbortAckJson {
                room: m.room,
                prefill_rank: m.prefill_rank,
            }),
        }
    }

    /// The frames the seed would send for this object.
    pub fn to_frames(&self) -> Result<Vec<Vec<u8>>, String> {
        let owned = |frames: crate::Frames<'_>| frames.into_iter().map(Cow::into_owned).collect();
        Ok(match self {
            WireJson::Register(j) => {
                text("endpoint", &j.endpoint)?;
                text("mooncake_session_id", &j.mooncake_session_id)?;
                owned(
                    Register {
                        endpoint: Cow::Borrowed(&j.endpoint),
                        dst_port: j.dst_port,
                        mooncake_session_id: Cow::Borrowed(&j.mooncake_session_id),
                        dst_kv_ptrs: PackedArray::from(j.dst_kv_ptrs.as_slice()),
                        dst_aux_ptrs: PackedArray::from(j.dst_aux_ptrs.as_slice()),
                        dst_state_data_ptrs: PackedLists::from_lists(&j.dst_state_data_ptrs),
                        dst_tp_rank: j.dst_tp_rank,
                        dst_attn_tp_size: j.dst_attn_tp_size,
                        dst_kv_item_len: j.dst_kv_item_len,
                        dst_state_item_lens: PackedLists::from_lists(&j.dst_state_item_lens),
                        dst_state_dim_per_tensor: PackedLists::from_lists(
                            &j.dst_state_dim_per_tensor,
                        ),
                        dst_kv_layer_ids: PackedArray::from(j.dst_kv_layer_ids.as_slice()),
                        dst_state_layer_ids: PackedLists::from_lists(&j.dst_state_layer_ids),
                        staging_base_ptr: j.staging_base_ptr,
                        staging_total_size: j.staging_total_size,
                        dst_dcp_size: j.dst_dcp_size,
                        dst_dcp_rank: j.dst_dcp_rank,
                        staging_slot_layer_ids: PackedArray::from(
                            j.staging_slot_layer_ids.as_slice(),
                        ),
                        dst_kv_item_lens: PackedArray::from(j.dst_kv_item_lens.as_slice()),
                        incarnation: None,
                    }
                    .encode(),
                )
            }
            WireJson::Transfer(j) => {
                text("endpoint", &j.endpoint)?;
                text("mooncake_session_id", &j.mooncake_session_id)?;
                let pages = if j.is_dummy {
                    None
                } else {
                    Some(TransferPages {
                        dst_kv_indices: PackedArray::from(j.dst_kv_indices.as_slice()),
                        dst_aux_index: j
                            .dst_aux_index
                            .ok_or("field `dst_aux_index`: required unless `is_dummy`")?,
                        dst_state_indices: PackedLists::from_lists(&j.dst_state_indices),
                        dst_device_kv_indices: j
                            .dst_device_kv_indices
                            .as_deref()
                            .map(PackedArray::from),
                    })
                };
                owned(
                    Transfer {
                        room: j.room,
                        endpoint: Cow::Borrowed(&j.endpoint),
                        dst_port: j.dst_port,
                        mooncake_session_id: Cow::Borrowed(&j.mooncake_session_id),
                        pages,
                        required_dst_info_num: j.required_dst_info_num,
                        decode_prefix_len: j.decode_prefix_len,
                    }
                    .encode(),
                )
            }
            WireJson::Abort(j) => {
                text("decode_ip", &j.decode_ip)?;
                owned(
                    Abort {
                        room: j.room,
                        decode_ip: Cow::Borrowed(&j.decode_ip),
                        decode_port: j.decode_port,
                        generation: None,
                    }
                    .encode(),
                )
            }
            WireJson::Watermark(j) => {
                text("session_id", &j.session_id)?;
                owned(
                    Watermark {
                        wm_round: j.wm_round,
                        wm_tail: j.wm_tail,
                        session_id: Cow::Borrowed(&j.session_id),
                    }
                    .encode(),
                )
            }
            WireJson::StagingRsp(j) => {
                text("session_id", &j.session_id)?;
                owned(
                    StagingRsp {
                        room: j.room,
                        chunk_idx: j.chunk_idx,
                        offset: j.offset,
                        round: j.round,
                        end: j.end,
                        session_id: Cow::Borrowed(&j.session_id),
                    }
                    .encode(),
                )
            }
            WireJson::Status(j) => owned(
                Status {
                    room: j.room,
                    status: KvPoll::from_u64(j.status).map_err(|e| e.to_string())?,
                    prefill_rank: j.prefill_rank,
                    failure_reason: j.failure_reason.as_deref().map(Cow::Borrowed),
                }
                .encode(),
            ),
            WireJson::AuxData(j) => {
                payload_len(&j.data)?;
                owned(
                    AuxData {
                        room: j.room,
                        buffer_index: j.buffer_index,
                        aux_index: j.aux_index,
                        data: Cow::Borrowed(&j.data),
                    }
                    .encode(),
                )
            }
            WireJson::StateData(j) => {
                payload_len(&j.data)?;
                owned(
                    StateData {
                        room: j.room,
                        dst_addr: j.dst_addr,
                        data: Cow::Borrowed(&j.data),
                    }
                    .encode(),
                )
            }
            WireJson::ChunkReady(j) => {
                text("session_id", &j.session_id)?;
                owned(
                    ChunkReady {
                        room: j.room,
                        chunk_idx: j.chunk_idx,
                        page_start: j.page_start,
                        num_pages: j.num_pages,
                        session_id: Cow::Borrowed(&j.session_id),
                        prefill_unique_rank: j.prefill_unique_rank,
                    }
                    .encode(),
                )
            }
            WireJson::StagingReq(j) => {
                text("session_id", &j.session_id)?;
                owned(
                    StagingReq {
                        room: j.room,
                        chunk_idx: j.chunk_idx,
                        chunk_num_pages: j.chunk_num_pages,
                        session_id: Cow::Borrowed(&j.session_id),
                        requester_pp_rank: j.requester_pp_rank,
                    }
                    .encode(),
                )
            }
            WireJson::AbortAck(j) => owned(
                AbortAck {
                    room: j.room,
                    prefill_rank: j.prefill_rank,
                    generation: None,
                }
                .encode(),
            ),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hex_round_trip() {
        assert_eq!(hex_encode(&[0, 0xab, 0x10]), "00ab10");
        assert_eq!(hex_decode("00AB10"), Some(vec![0, 0xab, 0x10]));
        assert_eq!(hex_decode("abc"), None);
        assert_eq!(hex_decode("zz"), None);
        assert_eq!(hex_decode(""), Some(vec![]));
    }

    #[test]
    fn decode_command_reports_errors_as_json() {
        let out =
            decode_command(r#"{"to": "decode", "frames": ["3432"]}"#, &Limits::DEFAULT).unwrap();
        assert!(out.starts_with(r#"{"error":"#), "{out}");
        assert!(matches!(
            decode_command(r#"{"to": "sideways", "frames": []}"#, &Limits::DEFAULT),
            Err(InputError::UnknownSide(_))
        ));
        assert!(matches!(
            decode_command(r#"{"to": "decode", "frames": ["abc"]}"#, &Limits::DEFAULT),
            Err(InputError::BadHex { index: 0 })
        ));
        assert!(decode_command("not json", &Limits::DEFAULT).is_err());
    }
}
