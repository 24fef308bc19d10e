//! kvbridge-plan: pure transfer planning.
//!
//! **Owns**: deciding which `(src, dst, len)` byte ranges one chunk of one
//! request moves from this prefill rank to one decode rank — for every layout
//! sglang's Mooncake connector (the reference) handles
//! (`docs/plan-scenario.md` §3):
//! page runs, MHA K/V halves and flat (MLA) layouts with PP-stage slicing,
//! layer-id pairing with draft entries, head slicing for any M→N TP with GQA
//! replication, DCP relayout, mamba / DSA-tail / page-indexed state
//! components, aux slots, the unified-memory envelope check and index
//! batching — or the rejection the reference would produce ([`PlanError`]).
//!
//! **Must never**: do I/O, keep threads or global state, depend on other
//! kvbridge crates, panic on any input, or return a partial plan. Addresses
//! are `u64`; a result that would not fit is an error, never a wrap.
//!
//! # Use
//!
//! ```
//! use kvbridge_plan::{PeerRegistration, Planner, PreparedPeer, PrefillLayout,
//!     TransferChunk, TransferRequest};
//!
//! // Our (prefill) layout: MHA, 1 layer (K and V buffers), 16-token pages.
//! let layout = PrefillLayout {
//!     page_size: 16,
//!     kv_data_ptrs: vec![0x1000_0000, 0x2000_0000],
//!     kv_item_lens: vec![4096, 4096],
//!     ..PrefillLayout::default()
//! };
//! // Once per decode peer, when its registration arrives.
//! let peer = PreparedPeer::new(&layout, PeerRegistration {
//!     dst_kv_ptrs: vec![0x9000_0000, 0xa000_0000],
//!     dst_kv_item_len: 4096,
//!     ..PeerRegistration::default()
//! })?;
//! // Once per worker; reused for every chunk.
//! let mut planner = Planner::new();
//! let request = TransferRequest { dst_kv_indices: vec![7, 8, 9], ..Default::default() };
//! let chunk = TransferChunk { prefill_kv_indices: vec![3, 4, 5], ..Default::default() };
//! let plan = planner.plan_chunk(&layout, &peer, &request, &chunk)?;
//! // One run of 3 pages per buffer.
//! assert_eq!(plan.kv_blocks().len(), 2);
//! assert_eq!(plan.kv_blocks()[0].len, 3 * 4096);
//! for batch in plan.kv_batches() {
//!     // hand `batch` (a &[Block]) to the engine
//!     assert!(!batch.is_empty());
//! }
//! # Ok::<(), kvbridge_plan::PlanError>(())
//! ```
//!
//! See `docs/planner.md` for the rules with a worked example per layout.

#![deny(missing_docs)]

mod aux;
mod block;
mod compressed;
mod cp;
mod dcp;
mod error;
mod fill;
mod head_slice;
mod index_runs;
mod kv;
mod layout;
mod pairing;
mod peer;
mod plan;
pub mod rng;
mod slots;
mod staging;
mod state;

#[cfg(feature = "scenario")]
pub mod scenario;
#[cfg(feature = "scenario")]
pub mod synthetic;

pub use aux::aux_slot;
pub use block::{Block, Run, canonicalize, expand_runs, total_bytes};
pub use cp::{cp_filter_chunk, cp_page_share};
pub use error::{CompressedMlaError, DsaTailError, PlanError};
pub use layout::{
    PeerRegistration, PrefillLayout, StateComponent, StateType, TransferChunk, TransferRequest,
    UnknownStateType,
};
pub use peer::{KvPath, PreparedPeer};
pub use plan::{KvBatches, KvRunBatches, Planner, TransferPlan, plan_once};
pub use slots::{SlotFamily, SlotSpan};
pub use staging::{
    HeadSliceParams, StagingSource, StagingTarget, grid_segments, head_slice_params,
    staging_layout, staging_writers, watermark_ready,
};

#[cfg(feature = "scenario")]
pub use scenario::{Scenario, ScenarioError, ScenarioResult, plan_scenario};
