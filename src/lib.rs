//! kvbridge: moves the KV cache of LLM requests from prefill GPUs to decode GPUs.
//!
//! This facade re-exports the layered crates so that applications can depend
//! on one crate; each layer is also usable on its own.

pub use kvbridge_engine as engine;
pub use kvbridge_mem as mem;
pub use kvbridge_plan as plan;
pub use kvbridge_roles as roles;
pub use kvbridge_wire as wire;
