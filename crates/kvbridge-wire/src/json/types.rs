//! The JSON shape of each message kind (docs/cli.md).

use serde::{Deserialize, Serialize};

use super::hex_bytes;

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
