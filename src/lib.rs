//! kvbridge: moves the KV cache of LLM requests from prefill GPUs to decode GPUs.
//!
//! This facade re-exports the layered crates so that applications can depend
//! on one crate; each layer is also usable on its own, and each crate's
//! page has a runnable example (the roles' moves a request end to end).
//!
//! ```
//! // Decode a status frame a prefill rank sent (kvbridge-wire) ...
//! use kvbridge::wire::{KvPoll, Limits, ToDecode};
//! let frames: [&[u8]; 3] = [b"7", b"4", b"0"];
//! let Ok(ToDecode::Status(status)) = ToDecode::decode(&frames, &Limits::DEFAULT) else {
//!     panic!("not a status")
//! };
//! assert_eq!((status.room, status.status), (7, KvPoll::Success));
//! // ... and plan a chunk of one page per buffer (kvbridge-plan).
//! use kvbridge::plan::{PeerRegistration, PreparedPeer, Planner, PrefillLayout,
//!     TransferChunk, TransferRequest};
//! let layout = PrefillLayout {
//!     page_size: 16,
//!     kv_data_ptrs: vec![0x10_0000],
//!     kv_item_lens: vec![4096],
//!     is_mla_backend: true,
//!     ..PrefillLayout::default()
//! };
//! let peer = PreparedPeer::new(&layout, PeerRegistration {
//!     dst_kv_ptrs: vec![0x90_0000],
//!     dst_kv_item_len: 4096,
//!     ..PeerRegistration::default()
//! })?;
//! let request = TransferRequest { dst_kv_indices: vec![5], ..Default::default() };
//! let chunk = TransferChunk { prefill_kv_indices: vec![2], ..Default::default() };
//! let plan = Planner::new().plan_chunk(&layout, &peer, &request, &chunk)?.to_vec();
//! assert_eq!((plan[0].src, plan[0].dst, plan[0].len), (0x10_0000 + 2 * 4096, 0x90_0000 + 5 * 4096, 4096));
//! # Ok::<(), kvbridge::plan::PlanError>(())
//! ```

pub use kvbridge_engine as engine;
pub use kvbridge_mem as mem;
pub use kvbridge_plan as plan;
pub use kvbridge_roles as roles;
pub use kvbridge_wire as wire;
