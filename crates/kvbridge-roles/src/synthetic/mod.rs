//! Synthetic pools shaped like real models (KV, draft layers, decode
//! context parallelism, mamba / SWA / DSA states), filled with a pattern
//! that every byte's position determines, so a receiver can verify every
//! byte it got. The demo, the benches and the tests use these (feature
//! `synthetic`); production callers register their own pools.
//!
//! A KV byte's value derives from `(room, layer, K/V, token, global head,
//! byte)` and a state byte's from `(room, component, buffer, layer,
//! position, global unit, byte)`, so a decode rank holding a different head
//! or state slice (TP M→N), a different PP split, different page numbers or
//! a DCP share checks exactly the bytes it should have received.

mod buf;
mod model;
mod pattern;
mod pools;
mod state_spec;
mod states;

use kvbridge_mem::MemError;

pub use model::{CompressedSpec, ModelSpec, Placement, RankSpec};
pub use pattern::Verified;
pub use pools::RankPools;
pub use state_spec::{StateBuffer, StateLayers, StateSpec};

/// Where one request lives on one rank.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct RequestSlots {
    /// Prompt tokens.
    pub tokens: u64,
    /// KV pages (a DCP rank's: virtual pages), in request order.
    pub pages: Vec<i32>,
    /// The request's slot: aux slot, mamba slot and tail-ring row.
    pub slot: u64,
}

/// Why synthetic pools could not be built.
#[derive(Debug, thiserror::Error)]
pub enum PoolError {
    /// Allocating a buffer failed.
    #[error(transparent)]
    Mem(#[from] MemError),
    /// The model cannot be laid out on this rank.
    #[error("model: {0}")]
    Model(String),
}
