//! What a model's state components look like (mamba slots, page-indexed
//! states, tail rings): the serializable specification `ModelSpec` carries,
//! and the arithmetic of an item's size on a rank.

use kvbridge_plan::StateType;
use serde::{Deserialize, Serialize};

/// Which layers carry a state component.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum StateLayers {
    /// Every layer.
    All,
    /// The full-attention layers (those with a KV buffer).
    Attention,
    /// The other layers (linear attention, sliding window).
    Linear,
}

/// The shape of one buffer of a component, repeated for each of its layers.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum StateBuffer {
    /// One slot per request (mamba): `outer` rows of a `dim`-unit axis that
    /// TP slices (`dim` is the whole model's; 0: replicated, one unit per
    /// row), `unit_bytes` per unit; `groups`: full sizes of concatenated
    /// sub-blocks, each sliced on its own (conv `[q | k | v]`).
    Slot {
        /// Rows before the sliced axis.
        outer: u64,
        /// Units of the sliced axis, whole model (0: replicated).
        dim: u64,
        /// Bytes per unit.
        unit_bytes: u64,
        /// Full sub-block sizes (empty: one block).
        #[serde(default)]
        groups: Vec<u64>,
    },
    /// Pages of `page_size` tokens × heads (SWA K or V, DSA indexer K).
    Page {
        /// Heads of the whole model.
        heads: u64,
        /// Bytes per head per token.
        head_bytes: u64,
        /// Heads split over TP like the KV's (false: replicated).
        sliced: bool,
    },
    /// One ring row per request of `ring` token slots (DSA compress tail).
    Ring {
        /// Slots per ring.
        ring: u64,
        /// Bytes per slot.
        slot_bytes: u64,
    },
}

/// How a component's items are indexed per request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Kind {
    Slot,
    Page,
    Ring,
}

impl StateBuffer {
    pub(super) fn kind(&self) -> Kind {
        match self {
            StateBuffer::Slot { .. } => Kind::Slot,
            StateBuffer::Page { .. } => Kind::Page,
            StateBuffer::Ring { .. } => Kind::Ring,
        }
    }

    /// This rank's size of the sliced axis (0: replicated).
    pub(super) fn local_dim(&self, tp: u64) -> u64 {
        match self {
            StateBuffer::Slot { dim, .. } => dim / tp.max(1),
            _ => 0,
        }
    }

    pub(super) fn local_heads(&self, tp: u64) -> u64 {
        match self {
            StateBuffer::Page {
                heads,
                sliced: true,
                ..
            } => (heads / tp.max(1)).max(1),
            StateBuffer::Page { heads, .. } => *heads,
            _ => 0,
        }
    }

    /// Bytes of one item on a rank at TP `tp`.
    pub(super) fn item_len(&self, page_size: u64, tp: u64) -> u64 {
        match self {
            StateBuffer::Slot {
                outer,
                dim,
                unit_bytes,
                ..
            } => {
                let units = if *dim == 0 { 1 } else { self.local_dim(tp) };
                outer * units * unit_bytes
            }
            StateBuffer::Page { head_bytes, .. } => page_size * self.local_heads(tp) * head_bytes,
            StateBuffer::Ring { ring, slot_bytes } => ring * slot_bytes,
        }
    }
}

/// One state component of a model.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StateSpec {
    /// sglang's state type name (`mamba`, `swa`, `dsa`, `dsa_tail`, ...).
    pub state_type: String,
    /// The layers that carry it.
    pub layers: StateLayers,
    /// Page states: only the pages of the last this-many tokens move (SWA).
    #[serde(default)]
    pub window_tokens: Option<u64>,
    /// Buffers per layer (all of one kind); registered shape by shape, each
    /// over every layer, as sglang's pools list them.
    pub buffers: Vec<StateBuffer>,
}

impl StateSpec {
    pub(super) fn kind(&self) -> Kind {
        self.buffers.first().map_or(Kind::Slot, StateBuffer::kind)
    }

    /// Checks the spec against attention TP `tp`.
    pub(super) fn validate(&self, tp: u64) -> Result<(), String> {
        let name = &self.state_type;
        name.parse::<StateType>().map_err(|e| e.to_string())?;
        let Some(first) = self.buffers.first() else {
            return Err(format!("state {name}: no buffers"));
        };
        if self.buffers.iter().any(|b| b.kind() != first.kind()) {
            return Err(format!("state {name}: buffers of different kinds"));
        }
        if self.window_tokens.is_some() && first.kind() != Kind::Page {
            return Err(format!("state {name}: a window needs page buffers"));
        }
        for b in &self.buffers {
            if let StateBuffer::Slot { dim, groups, .. } = b {
                let tp = tp.max(1);
                if *dim > 0 && !dim.is_multiple_of(tp) {
                    return Err(format!(
                        "state {name}: axis of {dim} does not split over TP {tp}"
                    ));
                }
                if !groups.is_empty()
                    && (groups.iter().sum::<u64>() != *dim
                        || groups.iter().any(|g| !g.is_multiple_of(tp)))
                {
                    return Err(format!(
                        "state {name}: sub-blocks {groups:?} must sum to {dim} and split over TP {tp}"
                    ));
                }
            }
        }
        Ok(())
    }

    /// Global layers of `[start, end)` that carry the component.
    pub(super) fn layers_in(
        &self,
        is_kv_layer: impl Fn(u64) -> bool,
        start: u64,
        end: u64,
    ) -> Vec<u64> {
        (start..end)
            .filter(|&l| match self.layers {
                StateLayers::All => true,
                StateLayers::Attention => is_kv_layer(l),
                StateLayers::Linear => !is_kv_layer(l),
            })
            .collect()
    }
}
