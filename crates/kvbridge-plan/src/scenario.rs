//! The `plan` scenario format (docs/plan-scenario.md §1–§2) as serde
//! types, its conversion into the domain types, and the result JSON.
//!
//! A scenario is one JSON object holding our layout, the peer registration,
//! the request and the chunk, flat, with sglang's field names. `name` and
//! `description` are accepted and ignored; any other unknown key makes the
//! scenario unreadable.

use std::fmt::Write as _;

use serde::{Deserialize, Serialize};

use crate::block::{Block, canonicalize};
use crate::error::PlanError;
use crate::layout::{
    PeerRegistration, PrefillLayout, StateComponent, StateType, TransferChunk, TransferRequest,
};
use crate::plan::plan_once;

fn one() -> u64 {
    1
}

fn is_false(b: &bool) -> bool {
    !*b
}

/// One planning scenario (docs/plan-scenario.md §1).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Scenario {
    /// Ignored label.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// Ignored description.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub description: Option<String>,

    // ---- prefill side (§1.1) ----
    /// Prefill engine rank.
    pub engine_rank: u64,
    /// Prefill attention TP size.
    #[serde(default = "one")]
    pub attn_tp_size: u64,
    /// Prefill PP size.
    #[serde(default = "one")]
    pub pp_size: u64,
    /// Prefill DCP size.
    #[serde(default = "one")]
    pub dcp_size: u64,
    /// Prefill DCP rank.
    #[serde(default)]
    pub dcp_rank: u64,
    /// Tokens per KV page.
    pub page_size: u64,
    /// MLA KV pool.
    #[serde(default, skip_serializing_if = "is_false")]
    pub is_mla_backend: bool,
    /// Hybrid linear-attention pool with MLA full attention.
    #[serde(default, skip_serializing_if = "is_false")]
    pub is_hybrid_mla_backend: bool,
    /// KV buffer base addresses.
    pub kv_data_ptrs: Vec<u64>,
    /// Bytes per page of each KV buffer.
    pub kv_item_lens: Vec<u64>,
    /// Global layer id per KV buffer.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub kv_layer_ids: Vec<i64>,
    /// KV heads held by this rank.
    #[serde(default = "one")]
    pub kv_head_num: u64,
    /// Model's total KV heads (0 = unknown).
    #[serde(default)]
    pub total_kv_head_num: u64,
    /// Trailing draft KV entries.
    #[serde(default)]
    pub num_draft_entries: u64,
    /// First layer of this PP stage.
    #[serde(default)]
    pub prefill_start_layer: u64,
    /// End of this PP stage's layers.
    #[serde(default)]
    pub prefill_end_layer: Option<u64>,
    /// Aux buffers.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub aux_data_ptrs: Vec<u64>,
    /// Aux slot sizes.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub aux_item_lens: Vec<u64>,
    /// State component types.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub state_types: Vec<String>,
    /// Buffers per state component.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub state_data_ptrs: Vec<Vec<u64>>,
    /// Item sizes per state component.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub state_item_lens: Vec<Vec<u64>>,
    /// Layer ids per state component.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub state_layer_ids: Vec<Vec<i64>>,
    /// Mamba: sliced-axis sizes per buffer.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub state_dim_per_tensor: Vec<Vec<u64>>,
    /// Mamba: conv sub-block sizes per buffer.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub state_conv_shard_groups: Vec<Vec<Option<Vec<u64>>>>,
    /// Mamba: rows before the sliced axis per buffer.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub state_slice_outer_counts: Vec<Vec<u64>>,
    /// Index batch size of the page copy (0 = no batching).
    #[serde(default)]
    pub max_transfer_batch_indices: u64,
    /// Whole-envelope KV layout.
    #[serde(default, skip_serializing_if = "is_false")]
    pub enable_unified_memory: bool,

    // ---- decode registration (§1.2) ----
    /// Decode KV buffers.
    pub dst_kv_ptrs: Vec<u64>,
    /// Decode aux buffers.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub dst_aux_ptrs: Vec<u64>,
    /// Decode buffers per state component.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub dst_state_data_ptrs: Vec<Vec<u64>>,
    /// Decode engine rank.
    pub dst_tp_rank: u64,
    /// Decode attention TP size.
    pub dst_attn_tp_size: u64,
    /// Decode bytes per page of its first KV buffer.
    pub dst_kv_item_len: u64,
    /// Decode item sizes per state component.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub dst_state_item_lens: Vec<Vec<u64>>,
    /// Decode sliced-axis sizes per state component.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub dst_state_dim_per_tensor: Vec<Vec<u64>>,
    /// Decode layer id per KV buffer.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub dst_kv_layer_ids: Vec<i64>,
    /// Decode layer ids per state component.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub dst_state_layer_ids: Vec<Vec<i64>>,
    /// Decode DCP size.
    #[serde(default = "one")]
    pub dst_dcp_size: u64,
    /// Decode DCP rank.
    #[serde(default)]
    pub dst_dcp_rank: u64,
    /// Decode bytes per page of every KV buffer.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub dst_kv_item_lens: Vec<u64>,

    // ---- request (§1.3) ----
    /// Decode pages of the whole request.
    pub dst_kv_indices: Vec<i32>,
    /// Decode aux slot.
    #[serde(default)]
    pub dst_aux_index: u64,
    /// Decode indices per state component.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub dst_state_indices: Vec<Vec<i64>>,
    /// Tokens the decode already holds.
    #[serde(default)]
    pub decode_prefix_len: Option<u64>,

    // ---- chunk (§1.4) ----
    /// Prefill pages of this chunk.
    pub prefill_kv_indices: Vec<i32>,
    /// Position of the chunk's first page in the request.
    #[serde(default)]
    pub index_slice_start: u64,
    /// End of that slice.
    #[serde(default)]
    pub index_slice_end: Option<u64>,
    /// Last chunk.
    #[serde(default = "default_true")]
    pub is_last_chunk: bool,
    /// Prefill aux slot.
    #[serde(default)]
    pub prefill_aux_index: Option<u64>,
    /// Prefill indices per state component.
    #[serde(default)]
    pub state_indices: Option<Vec<Option<Vec<i64>>>>,
    /// Tokens in this chunk.
    #[serde(default)]
    pub num_kv_tokens: Option<u64>,
}

fn default_true() -> bool {
    true
}

/// Why a scenario cannot be read (the CLI's exit 2).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ScenarioError {
    /// Not JSON, or not the scenario object (missing/unknown/ill-typed field).
    #[error("invalid scenario JSON: {0}")]
    Json(#[from] serde_json::Error),
    /// A field violates the format's constraints.
    #[error("invalid scenario: {0}")]
    Invalid(String),
}

/// The domain inputs of a scenario.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ScenarioInputs {
    /// Prefill side.
    pub layout: PrefillLayout,
    /// Decode registration.
    pub registration: PeerRegistration,
    /// Request.
    pub request: TransferRequest,
    /// Chunk.
    pub chunk: TransferChunk,
}

impl Scenario {
    /// Parses and validates a scenario.
    pub fn from_json(text: &str) -> Result<Scenario, ScenarioError> {
        let s: Scenario = serde_json::from_str(text)?;
        s.validate()?;
        Ok(s)
    }

    /// Checks the constraints the format states (sizes at least 1, known
    /// state types).
    pub fn validate(&self) -> Result<(), ScenarioError> {
        let bad = |m: String| Err(ScenarioError::Invalid(m));
        for (field, v) in [
            ("attn_tp_size", self.attn_tp_size),
            ("pp_size", self.pp_size),
            ("page_size", self.page_size),
            ("kv_head_num", self.kv_head_num),
            ("dst_attn_tp_size", self.dst_attn_tp_size),
        ] {
            if v == 0 {
                return bad(format!("{field} must be at least 1"));
            }
        }
        for t in &self.state_types {
            if t.parse::<StateType>().is_err() {
                return bad(format!("unknown state type {t:?}"));
            }
        }
        Ok(())
    }

    /// The first state component that lacks its buffer or size list and
    /// that this chunk would send.
    fn unregistered_state_sent(&self, chunk: &TransferChunk) -> Option<PlanError> {
        if !chunk.is_last_chunk {
            return None;
        }
        let indices = chunk.state_indices.as_ref()?;
        (0..self.state_types.len()).find_map(|i| {
            indices.get(i)?.as_ref()?;
            let what = if i >= self.state_data_ptrs.len() {
                "state_data_ptrs"
            } else if i >= self.state_item_lens.len() {
                "state_item_lens"
            } else {
                return None;
            };
            Some(PlanError::MissingStateBuffers { component: i, what })
        })
    }

    /// The domain inputs. Unknown state type names (only possible when the
    /// scenario was built without [`Scenario::validate`]) are skipped.
    pub fn inputs(&self) -> ScenarioInputs {
        fn inner<T: Clone>(v: &[Vec<T>], i: usize) -> Vec<T> {
            v.get(i).cloned().unwrap_or_default()
        }
        let states = self
            .state_types
            .iter()
            .enumerate()
            .filter_map(|(i, t)| {
                let state_type = t.parse::<StateType>().ok()?;
                Some(StateComponent {
                    state_type,
                    data_ptrs: inner(&self.state_data_ptrs, i),
                    item_lens: inner(&self.state_item_lens, i),
                    layer_ids: inner(&self.state_layer_ids, i),
                    dim_per_tensor: inner(&self.state_dim_per_tensor, i),
                    conv_shard_groups: inner(&self.state_conv_shard_groups, i),
                    slice_outer_counts: inner(&self.state_slice_outer_counts, i),
                })
            })
            .collect();
        ScenarioInputs {
            layout: PrefillLayout {
                engine_rank: self.engine_rank,
                attn_tp_size: self.attn_tp_size,
                pp_size: self.pp_size,
                dcp_size: self.dcp_size,
                dcp_rank: self.dcp_rank,
                page_size: self.page_size,
                is_mla_backend: self.is_mla_backend,
                is_hybrid_mla_backend: self.is_hybrid_mla_backend,
                kv_data_ptrs: self.kv_data_ptrs.clone(),
                kv_item_lens: self.kv_item_lens.clone(),
                kv_layer_ids: self.kv_layer_ids.clone(),
                kv_head_num: self.kv_head_num,
                total_kv_head_num: self.total_kv_head_num,
                num_draft_entries: self.num_draft_entries,
                prefill_start_layer: self.prefill_start_layer,
                prefill_end_layer: self.prefill_end_layer,
                aux_data_ptrs: self.aux_data_ptrs.clone(),
                aux_item_lens: self.aux_item_lens.clone(),
                states,
                max_transfer_batch_indices: self.max_transfer_batch_indices,
                enable_unified_memory: self.enable_unified_memory,
                // Not representable in a scenario (the contract's scope).
                mla_compression_ratios: None,
                // Not in the contract: SWA across TP sizes stays refused there.
                swa_kv_cache_layout: None,
            },
            registration: PeerRegistration {
                dst_kv_ptrs: self.dst_kv_ptrs.clone(),
                dst_aux_ptrs: self.dst_aux_ptrs.clone(),
                dst_state_data_ptrs: self.dst_state_data_ptrs.clone(),
                dst_tp_rank: self.dst_tp_rank,
                dst_attn_tp_size: self.dst_attn_tp_size,
                dst_kv_item_len: self.dst_kv_item_len,
                dst_state_item_lens: self.dst_state_item_lens.clone(),
                dst_state_dim_per_tensor: self.dst_state_dim_per_tensor.clone(),
                dst_kv_layer_ids: self.dst_kv_layer_ids.clone(),
                dst_state_layer_ids: self.dst_state_layer_ids.clone(),
                dst_dcp_size: self.dst_dcp_size,
                dst_dcp_rank: self.dst_dcp_rank,
                dst_kv_item_lens: self.dst_kv_item_lens.clone(),
            },
            request: TransferRequest {
                dst_kv_indices: self.dst_kv_indices.clone(),
                dst_aux_index: self.dst_aux_index,
                dst_state_indices: self.dst_state_indices.clone(),
                decode_prefix_len: self.decode_prefix_len,
                dst_device_kv_indices: None,
            },
            chunk: TransferChunk {
                prefill_kv_indices: self.prefill_kv_indices.clone(),
                index_slice_start: self.index_slice_start,
                index_slice_end: self.index_slice_end,
                is_last_chunk: self.is_last_chunk,
                prefill_aux_index: self.prefill_aux_index,
                state_indices: self.state_indices.clone(),
                num_kv_tokens: self.num_kv_tokens,
            },
        }
    }
}

/// Plans a scenario: registration, then the chunk. The blocks are KV, state,
/// aux, in emission order (compare them through [`canonicalize`]).
///
/// A state component without a `state_data_ptrs` or `state_item_lens` list
/// cannot be expressed in the domain types; like the reference (which indexes
/// those lists when it sends the component), the scenario is rejected when
/// such a component would be sent, and planned normally otherwise.
pub fn plan_scenario(scenario: &Scenario) -> Result<Vec<Block>, PlanError> {
    let i = scenario.inputs();
    if let Some(err) = scenario.unregistered_state_sent(&i.chunk) {
        return Err(err);
    }
    plan_once(&i.layout, i.registration, &i.request, &i.chunk).map(|p| p.to_vec())
}

/// A parsed result (docs/plan-scenario.md §2).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ScenarioResult {
    /// A plan.
    Blocks(Vec<Block>),
    /// A rejection, with its free-text message.
    Error(String),
}

impl ScenarioResult {
    /// Parses `{"blocks": [[src, dst, len], ...]}` or `{"error": "..."}`.
    pub fn from_json(text: &str) -> Result<ScenarioResult, ScenarioError> {
        #[derive(Deserialize)]
        #[serde(deny_unknown_fields)]
        struct Raw {
            blocks: Option<Vec<[u64; 3]>>,
            error: Option<String>,
        }
        let raw: Raw = serde_json::from_str(text)?;
        match (raw.blocks, raw.error) {
            (Some(b), None) => Ok(ScenarioResult::Blocks(
                b.into_iter().map(|[s, d, l]| Block::new(s, d, l)).collect(),
            )),
            (None, Some(e)) => Ok(ScenarioResult::Error(e)),
            _ => Err(ScenarioError::Invalid(
                "a result holds exactly one of \"blocks\" and \"error\"".into(),
            )),
        }
    }

    /// Whether two results are equal under docs/plan-scenario.md §2 (canonical
    /// blocks; any two rejections are equal).
    pub fn matches(&self, other: &ScenarioResult) -> bool {
        match (self, other) {
            (ScenarioResult::Blocks(a), ScenarioResult::Blocks(b)) => {
                canonicalize(a) == canonicalize(b)
            }
            (ScenarioResult::Error(_), ScenarioResult::Error(_)) => true,
            _ => false,
        }
    }
}

impl From<Result<Vec<Block>, PlanError>> for ScenarioResult {
    fn from(r: Result<Vec<Block>, PlanError>) -> Self {
        match r {
            Ok(b) => ScenarioResult::Blocks(b),
            Err(e) => ScenarioResult::Error(e.to_string()),
        }
    }
}

/// The result JSON of docs/plan-scenario.md §2 for a plan (written in canonical
/// form) or a rejection, on one line.
pub fn result_to_json(result: &Result<Vec<Block>, PlanError>) -> String {
    match result {
        Ok(blocks) => blocks_to_json(&canonicalize(blocks)),
        Err(e) => {
            let msg = serde_json::Value::String(e.to_string());
            format!("{{\"error\": {msg}}}")
        }
    }
}

/// `{"blocks": [[src, dst, len], ...]}` for the blocks as given.
pub fn blocks_to_json(blocks: &[Block]) -> String {
    let mut s = String::with_capacity(16 + blocks.len() * 40);
    s.push_str("{\"blocks\": [");
    for (k, b) in blocks.iter().enumerate() {
        if k > 0 {
            s.push_str(", ");
        }
        // Writing to a String cannot fail.
        let _ = write!(s, "[{}, {}, {}]", b.src, b.dst, b.len);
    }
    s.push_str("]}");
    s
}
