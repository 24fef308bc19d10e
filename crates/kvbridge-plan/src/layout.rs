//! The planner's inputs as plain Rust data: our registered layout (prefill
//! side), the decode peer's registration, the request and the chunk.
//!
//! Field names follow sglang's `KVArgs`, `KVArgsRegisterInfo`, `TransferInfo`
//! and `TransferKVChunk` so that a reader of the reference finds them.

use std::fmt;
use std::str::FromStr;

/// Kind of a state component (sglang's `StateType`), with its wire name.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum StateType {
    /// Mamba / linear-attention slot state (`mamba`).
    Mamba,
    /// Sliding-window KV pages (`swa`).
    Swa,
    /// DSA indexer-K pages (`dsa`).
    Dsa,
    /// DSA kpool-compress tail ring row (`dsa_tail`).
    DsaTail,
    /// QSA pending pages (`qsa_pending`).
    QsaPending,
    /// QSA compressed pages (`qsa_compressed`).
    QsaCompressed,
    /// DeepSeek-V4 SWA ring rows (`swa_ring`).
    SwaRing,
    /// DeepSeek-V4 request-scoped compression state (`c128_state`).
    C128State,
    /// Per-block scales of a block-scaled KV dtype, full attention (`block_scale`).
    BlockScale,
    /// Per-block scales of a block-scaled KV dtype, SWA (`block_scale_swa`).
    BlockScaleSwa,
    /// MiniMax sparse index K pages (`minimax_index_k`).
    MinimaxIndexK,
    /// MiniMax dense KV (accepted, never transferred: `minimax_dense_kv`).
    MinimaxDenseKv,
    /// One item per request row (accepted, never transferred: `request_row`).
    RequestRow,
}

impl StateType {
    /// Every state type, in declaration order.
    pub const ALL: [StateType; 13] = [
        StateType::Mamba,
        StateType::Swa,
        StateType::Dsa,
        StateType::DsaTail,
        StateType::QsaPending,
        StateType::QsaCompressed,
        StateType::SwaRing,
        StateType::C128State,
        StateType::BlockScale,
        StateType::BlockScaleSwa,
        StateType::MinimaxIndexK,
        StateType::MinimaxDenseKv,
        StateType::RequestRow,
    ];

    /// The wire / scenario name (`"mamba"`, `"c128_state"`, ...).
    pub fn as_str(self) -> &'static str {
        match self {
            StateType::Mamba => "mamba",
            StateType::Swa => "swa",
            StateType::Dsa => "dsa",
            StateType::DsaTail => "dsa_tail",
            StateType::QsaPending => "qsa_pending",
            StateType::QsaCompressed => "qsa_compressed",
            StateType::SwaRing => "swa_ring",
            StateType::C128State => "c128_state",
            StateType::BlockScale => "block_scale",
            StateType::BlockScaleSwa => "block_scale_swa",
            StateType::MinimaxIndexK => "minimax_index_k",
            StateType::MinimaxDenseKv => "minimax_dense_kv",
            StateType::RequestRow => "request_row",
        }
    }

    /// Page/row-indexed types sent through the generic page copy.
    pub fn is_paged(self) -> bool {
        matches!(
            self,
            StateType::Swa
                | StateType::Dsa
                | StateType::QsaPending
                | StateType::QsaCompressed
                | StateType::SwaRing
                | StateType::C128State
                | StateType::BlockScale
                | StateType::BlockScaleSwa
        )
    }

    /// QSA types (replicated across TP; flat layout).
    pub fn is_qsa(self) -> bool {
        matches!(self, StateType::QsaPending | StateType::QsaCompressed)
    }

    /// Position-indexed types whose index lists must match exactly (no truncation).
    pub fn requires_exact_index_match(self) -> bool {
        matches!(
            self,
            StateType::QsaPending
                | StateType::QsaCompressed
                | StateType::SwaRing
                | StateType::C128State
        )
    }
}

impl fmt::Display for StateType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Error of [`StateType::from_str`]: the name is not a known state type.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown state type {0:?}")]
pub struct UnknownStateType(pub String);

impl FromStr for StateType {
    type Err = UnknownStateType;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        StateType::ALL
            .iter()
            .copied()
            .find(|t| t.as_str() == s)
            .ok_or_else(|| UnknownStateType(s.to_owned()))
    }
}

/// One state component registered by the prefill (one entry of `state_types`
/// with its parallel per-buffer lists).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StateComponent {
    /// The component's type.
    pub state_type: StateType,
    /// Base address of each buffer.
    pub data_ptrs: Vec<u64>,
    /// Bytes per item (page, slot or row) of each buffer.
    pub item_lens: Vec<u64>,
    /// Global layer id per buffer (empty = none published).
    pub layer_ids: Vec<i64>,
    /// Mamba only: this rank's size of the TP-sliced axis per buffer (0 = replicated).
    pub dim_per_tensor: Vec<u64>,
    /// Mamba only: full sub-block sizes of a concatenated conv state per buffer.
    pub conv_shard_groups: Vec<Option<Vec<u64>>>,
    /// Mamba only: rows before the sliced axis per buffer (missing = 1).
    pub slice_outer_counts: Vec<u64>,
}

impl StateComponent {
    /// A component with buffers and item sizes and no further metadata.
    pub fn new(state_type: StateType, data_ptrs: Vec<u64>, item_lens: Vec<u64>) -> Self {
        StateComponent {
            state_type,
            data_ptrs,
            item_lens,
            layer_ids: Vec::new(),
            dim_per_tensor: Vec::new(),
            conv_shard_groups: Vec::new(),
            slice_outer_counts: Vec::new(),
        }
    }
}

/// This prefill rank's registered layout (`KVArgs` plus manager settings).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PrefillLayout {
    /// Prefill engine rank; its attention-TP rank is `engine_rank % attn_tp_size`.
    pub engine_rank: u64,
    /// Prefill attention TP size (`P`).
    pub attn_tp_size: u64,
    /// Prefill pipeline-parallel size.
    pub pp_size: u64,
    /// Prefill decode-context-parallel size.
    pub dcp_size: u64,
    /// Prefill decode-context-parallel rank.
    pub dcp_rank: u64,
    /// Tokens per KV page.
    pub page_size: u64,
    /// MLA KV pool (one buffer per layer).
    pub is_mla_backend: bool,
    /// Hybrid linear-attention pool whose full-attention part is MLA.
    pub is_hybrid_mla_backend: bool,
    /// KV buffer base addresses (MHA: K of every layer, then V; draft entries last).
    pub kv_data_ptrs: Vec<u64>,
    /// Bytes per page of each KV buffer.
    pub kv_item_lens: Vec<u64>,
    /// Global layer id of each KV buffer (empty = none published).
    pub kv_layer_ids: Vec<i64>,
    /// KV heads held by this rank.
    pub kv_head_num: u64,
    /// Model's total KV heads (0 = unknown: `kv_head_num * attn_tp_size`).
    pub total_kv_head_num: u64,
    /// Trailing KV buffers that belong to the draft model.
    pub num_draft_entries: u64,
    /// First layer of this PP stage.
    pub prefill_start_layer: u64,
    /// End (exclusive) of this PP stage's layers.
    pub prefill_end_layer: Option<u64>,
    /// Aux (metadata) buffer base addresses.
    pub aux_data_ptrs: Vec<u64>,
    /// Bytes per aux slot of each aux buffer.
    pub aux_item_lens: Vec<u64>,
    /// State components, in `state_types` order.
    pub states: Vec<StateComponent>,
    /// > 0: the page copy hands indices to the engine in batches of at most this many.
    pub max_transfer_batch_indices: u64,
    /// Whole-envelope ("unified memory") KV layout.
    pub enable_unified_memory: bool,
    /// Compressed MLA (DeepSeek-V4): the compression ratio of every layer of
    /// the whole model (0, 4 or 128); KV buffers are the C4 KV, C4 indexer
    /// and C128 KV groups of this stage's layers. `None`: not compressed.
    pub mla_compression_ratios: Option<Vec<u64>>,
    /// Page layout of the SWA sub-pool (`nhd`, `hnd`, `vectorized_5d`; sglang's
    /// `swa_kv_cache_layout`). Set: SWA state is head-sliced between different
    /// TP sizes (NHD only); `None`: such a pairing is refused.
    pub swa_kv_cache_layout: Option<String>,
}

impl Default for PrefillLayout {
    fn default() -> Self {
        PrefillLayout {
            engine_rank: 0,
            attn_tp_size: 1,
            pp_size: 1,
            dcp_size: 1,
            dcp_rank: 0,
            page_size: 1,
            is_mla_backend: false,
            is_hybrid_mla_backend: false,
            kv_data_ptrs: Vec::new(),
            kv_item_lens: Vec::new(),
            kv_layer_ids: Vec::new(),
            kv_head_num: 1,
            total_kv_head_num: 0,
            num_draft_entries: 0,
            prefill_start_layer: 0,
            prefill_end_layer: None,
            aux_data_ptrs: Vec::new(),
            aux_item_lens: Vec::new(),
            states: Vec::new(),
            max_transfer_batch_indices: 0,
            enable_unified_memory: false,
            mla_compression_ratios: None,
            swa_kv_cache_layout: None,
        }
    }
}

impl PrefillLayout {
    /// This rank's index inside its attention-TP group (`r`).
    pub fn attn_tp_rank(&self) -> u64 {
        self.engine_rank.checked_rem(self.attn_tp_size).unwrap_or(0)
    }

    /// Whether the KV pool is MLA or hybrid MLA (flat, one buffer per layer).
    pub fn is_any_mla(&self) -> bool {
        self.is_mla_backend || self.is_hybrid_mla_backend
    }
}

/// A decode peer's registration (`KVArgsRegisterInfo`), as received.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PeerRegistration {
    /// Decode KV buffers (same conventions as `kv_data_ptrs`).
    pub dst_kv_ptrs: Vec<u64>,
    /// Decode aux buffers.
    pub dst_aux_ptrs: Vec<u64>,
    /// Decode buffers per state component.
    pub dst_state_data_ptrs: Vec<Vec<u64>>,
    /// Decode engine rank (`d = dst_tp_rank % dst_attn_tp_size`).
    pub dst_tp_rank: u64,
    /// Decode attention TP size (`D`).
    pub dst_attn_tp_size: u64,
    /// Decode bytes per page of its (first) KV buffer.
    pub dst_kv_item_len: u64,
    /// Decode item sizes per state component.
    pub dst_state_item_lens: Vec<Vec<u64>>,
    /// Decode sliced-axis sizes per state component (mamba).
    pub dst_state_dim_per_tensor: Vec<Vec<u64>>,
    /// Decode global layer id per KV buffer.
    pub dst_kv_layer_ids: Vec<i64>,
    /// Decode layer ids per state component.
    pub dst_state_layer_ids: Vec<Vec<i64>>,
    /// Decode DCP size.
    pub dst_dcp_size: u64,
    /// Decode DCP rank.
    pub dst_dcp_rank: u64,
    /// Decode bytes per page of every KV buffer (DCP only; may be empty).
    pub dst_kv_item_lens: Vec<u64>,
}

impl Default for PeerRegistration {
    fn default() -> Self {
        PeerRegistration {
            dst_kv_ptrs: Vec::new(),
            dst_aux_ptrs: Vec::new(),
            dst_state_data_ptrs: Vec::new(),
            dst_tp_rank: 0,
            dst_attn_tp_size: 1,
            dst_kv_item_len: 0,
            dst_state_item_lens: Vec::new(),
            dst_state_dim_per_tensor: Vec::new(),
            dst_kv_layer_ids: Vec::new(),
            dst_state_layer_ids: Vec::new(),
            dst_dcp_size: 1,
            dst_dcp_rank: 0,
            dst_kv_item_lens: Vec::new(),
        }
    }
}

/// One request's destination (`TransferInfo` of a non-dummy decode rank).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct TransferRequest {
    /// Decode pages of the whole request (DCP: virtual pages of `page_size * dst_dcp_size` tokens).
    pub dst_kv_indices: Vec<i32>,
    /// Decode aux slot.
    pub dst_aux_index: u64,
    /// Decode indices per state component (missing = empty).
    pub dst_state_indices: Vec<Vec<i64>>,
    /// Tokens the decode already holds (DCP only; `None` = 0).
    pub decode_prefix_len: Option<u64>,
    /// HiSparse: the request's pages in the decode's device page space,
    /// for the decode buffers after its C4 KV ones (which take
    /// `dst_kv_indices`, host pages). `None`: one page space.
    pub dst_device_kv_indices: Option<Vec<i32>>,
}

/// One chunk of prefill output to send (`TransferKVChunk`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TransferChunk {
    /// Prefill pages of this chunk.
    pub prefill_kv_indices: Vec<i32>,
    /// Position of this chunk's first page in the request's page list.
    pub index_slice_start: u64,
    /// End of that slice (`None` = start + number of pages).
    pub index_slice_end: Option<u64>,
    /// Last chunk: states and aux are sent too.
    pub is_last_chunk: bool,
    /// Prefill aux slot (needed on the last chunk when the decode has aux buffers).
    pub prefill_aux_index: Option<u64>,
    /// Prefill indices per state component (`None` entry = skip that component).
    pub state_indices: Option<Vec<Option<Vec<i64>>>>,
    /// Tokens in this chunk (DCP relayout needs it).
    pub num_kv_tokens: Option<u64>,
}

impl Default for TransferChunk {
    fn default() -> Self {
        TransferChunk {
            prefill_kv_indices: Vec::new(),
            index_slice_start: 0,
            index_slice_end: None,
            is_last_chunk: true,
            prefill_aux_index: None,
            state_indices: None,
            num_kv_tokens: None,
        }
    }
}
