//! Between wire messages and their JSON shape.

use std::borrow::Cow;

use super::types::*;
use crate::{
    Abort, AbortAck, AuxData, ChunkReady, KvPoll, PackedArray, PackedLists, Register, StagingReq,
    StagingRsp, StateData, Status, ToDecode, ToPrefill, Transfer, TransferPages, Watermark,
};

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

    /// The frames the reference would send for this object.
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
                        pair_key: None,
                        aux_batch: false,
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
