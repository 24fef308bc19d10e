//! What a synthetic rank holds: the model's KV and state shapes, where the
//! rank sits in the parallel layout, and where its pools live.

use serde::{Deserialize, Serialize};

use super::state_spec::{StateBuffer, StateLayers, StateSpec};

/// The shape of a model's KV cache and per-request state.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ModelSpec {
    /// Preset name.
    pub name: String,
    /// Transformer layers (all of them, attention or not).
    pub layers: u64,
    /// KV heads of the whole model (MHA/GQA); ignored for MLA.
    pub kv_heads: u64,
    /// Bytes of one head of one token (head_dim × dtype size), or of one
    /// token's latent for MLA.
    pub head_bytes: u64,
    /// MLA pool (one latent per token and layer, replicated across TP).
    pub mla: bool,
    /// Tokens per page.
    pub page_size: u64,
    /// Bytes of each aux (metadata) slot, one entry per aux buffer.
    pub aux_item_lens: Vec<u64>,
    /// Every this-many layers one has full attention (a KV buffer): layer
    /// `l` does when `(l + 1) % interval == 0`. 1: every layer.
    #[serde(default = "one")]
    pub full_attention_interval: u64,
    /// Speculative draft layers (MTP/EAGLE), after the model's layers, with
    /// the same KV shape; held by the last PP stage.
    #[serde(default)]
    pub draft_layers: u64,
    /// Per-request state components (mamba slots, SWA or DSA pages, ...).
    #[serde(default)]
    pub states: Vec<StateSpec>,
    /// A compressed-MLA pool (DeepSeek-V4) instead of one latent per layer.
    #[serde(default)]
    pub compressed: Option<CompressedSpec>,
}

/// DeepSeek-V4's compressed-MLA pool: per layer a compression ratio; the
/// KV buffers are the C4 KV, C4 indexer and C128 KV groups, each addressed
/// by the full page id with its own bytes per page.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CompressedSpec {
    /// Compression ratio of every layer (0: no compressed KV, 4, 128).
    pub ratios: Vec<u64>,
    /// Bytes per page of a C4 KV buffer.
    pub c4_bytes: u64,
    /// Bytes per page of a C4 indexer buffer.
    pub indexer_bytes: u64,
    /// Bytes per page of a C128 KV buffer.
    pub c128_bytes: u64,
}

impl CompressedSpec {
    /// `(global layer, group, bytes per page)` of each KV buffer of layers
    /// `[start, end)`: C4 KV (group 0), C4 indexer (1), C128 KV (2).
    pub fn buffers(&self, start: u64, end: u64) -> Vec<(u64, u64, u64)> {
        let layers =
            |ratio: u64| (start..end).filter(move |&l| self.ratios.get(l as usize) == Some(&ratio));
        layers(4)
            .map(|l| (l, 0, self.c4_bytes))
            .chain(layers(4).map(|l| (l, 1, self.indexer_bytes)))
            .chain(layers(128).map(|l| (l, 2, self.c128_bytes)))
            .collect()
    }
}

fn one() -> u64 {
    1
}

impl Default for ModelSpec {
    /// One layer of one 64-byte head, pages of 4 tokens, no aux: a base for
    /// test models (`ModelSpec { layers: 3, ..Default::default() }`).
    fn default() -> Self {
        Self {
            name: "custom".into(),
            layers: 1,
            kv_heads: 1,
            head_bytes: 64,
            mla: false,
            page_size: 4,
            aux_item_lens: Vec::new(),
            full_attention_interval: 1,
            draft_layers: 0,
            states: Vec::new(),
            compressed: None,
        }
    }
}

impl ModelSpec {
    /// A Llama-3-8B-like MHA/GQA model: 32 layers, 8 KV heads of 128 bf16.
    pub fn llama3_8b() -> Self {
        Self {
            name: "llama3-8b".into(),
            layers: 32,
            kv_heads: 8,
            head_bytes: 128 * 2,
            page_size: 16,
            aux_item_lens: vec![64, 1024],
            ..Self::default()
        }
    }

    /// A DeepSeek-V3-like MLA model: 61 layers, 576-dim bf16 latent.
    pub fn deepseek_v3() -> Self {
        Self {
            name: "deepseek-v3".into(),
            layers: 61,
            kv_heads: 1,
            head_bytes: 576 * 2,
            mla: true,
            page_size: 64,
            aux_item_lens: vec![64, 1024],
            ..Self::default()
        }
    }

    /// A DeepSeek-V3.2-like DSA model: the V3 MLA pool plus the sparse
    /// indexer's K pages (128 fp8 + a 4-byte scale per token, every layer).
    pub fn deepseek_v32() -> Self {
        Self {
            name: "deepseek-v32".into(),
            states: vec![StateSpec {
                state_type: "dsa".into(),
                layers: StateLayers::All,
                window_tokens: None,
                buffers: vec![StateBuffer::Page {
                    heads: 1,
                    head_bytes: 132,
                    sliced: false,
                }],
            }],
            ..Self::deepseek_v3()
        }
    }

    /// A Qwen3-Next-like hybrid: 48 layers, every 4th full attention (2 KV
    /// heads of 256 bf16), the others gated-delta-net layers with a mamba
    /// slot per request: a conv state (`[q | k | v]` channels × 3 taps,
    /// TP-sliced per sub-block) and a recurrent state (32 heads, TP-sliced).
    /// The state's inner sizes are scaled down 8× (same structure, smaller
    /// slots) so a demo's pools fit in host memory.
    pub fn qwen3_next() -> Self {
        Self {
            name: "qwen3-next".into(),
            layers: 48,
            kv_heads: 2,
            head_bytes: 256 * 2,
            page_size: 16,
            aux_item_lens: vec![64, 1024],
            full_attention_interval: 4,
            states: vec![StateSpec {
                state_type: "mamba".into(),
                layers: StateLayers::Linear,
                window_tokens: None,
                buffers: vec![
                    StateBuffer::Slot {
                        outer: 1,
                        dim: 1024,
                        unit_bytes: 3 * 2,
                        groups: vec![256, 256, 512],
                    },
                    StateBuffer::Slot {
                        outer: 1,
                        dim: 32,
                        unit_bytes: 16 * 16 * 4,
                        groups: Vec::new(),
                    },
                ],
            }],
            ..Self::default()
        }
    }

    /// A gpt-oss-like model: 36 layers alternating sliding-window (128
    /// tokens) and full attention, 8 KV heads of 64 bf16; the sliding
    /// layers' K and V pages are the `swa` state (only the window moves).
    pub fn gpt_oss() -> Self {
        Self {
            name: "gpt-oss".into(),
            layers: 36,
            kv_heads: 8,
            head_bytes: 64 * 2,
            page_size: 16,
            aux_item_lens: vec![64, 1024],
            full_attention_interval: 2,
            states: vec![StateSpec {
                state_type: "swa".into(),
                layers: StateLayers::Linear,
                window_tokens: Some(128),
                buffers: vec![
                    StateBuffer::Page {
                        heads: 8,
                        head_bytes: 64 * 2,
                        sliced: true,
                    };
                    2
                ],
            }],
            ..Self::default()
        }
    }

    /// A DeepSeek-V4-like compressed-MLA model: 61 layers, the first two
    /// without compressed KV, then alternating ratio 4 and 128; pages of 256
    /// tokens: a C4 page holds 64 compressed rows (37440 bytes padded), its
    /// indexer page 64 rows of 132 bytes, a C128 page 2 rows (1728 bytes).
    pub fn deepseek_v4() -> Self {
        let ratios = (0..61u64)
            .map(|l| match l {
                0 | 1 => 0,
                l if l % 2 == 0 => 4,
                _ => 128,
            })
            .collect();
        Self {
            name: "deepseek-v4".into(),
            layers: 61,
            kv_heads: 1,
            head_bytes: 584,
            mla: true,
            page_size: 256,
            aux_item_lens: vec![64, 1024],
            compressed: Some(CompressedSpec {
                ratios,
                c4_bytes: 37440,
                indexer_bytes: 64 * 132,
                c128_bytes: 1728,
            }),
            ..Self::default()
        }
    }

    /// Every preset name.
    pub const PRESETS: [&'static str; 6] = [
        "llama3-8b",
        "deepseek-v3",
        "deepseek-v32",
        "deepseek-v4",
        "qwen3-next",
        "gpt-oss",
    ];

    /// A preset by name (see [`ModelSpec::PRESETS`]).
    pub fn preset(name: &str) -> Option<Self> {
        match name {
            "llama3-8b" | "llama" => Some(Self::llama3_8b()),
            "deepseek-v3" | "deepseek" | "mla" => Some(Self::deepseek_v3()),
            "deepseek-v32" | "dsa" => Some(Self::deepseek_v32()),
            "deepseek-v4" | "compressed-mla" => Some(Self::deepseek_v4()),
            "qwen3-next" | "mamba" => Some(Self::qwen3_next()),
            "gpt-oss" | "swa" => Some(Self::gpt_oss()),
            _ => None,
        }
    }

    /// Whether layer `l` has full attention (a KV buffer).
    pub fn is_kv_layer(&self, l: u64) -> bool {
        (l + 1).is_multiple_of(self.full_attention_interval.max(1))
    }

    /// KV heads one rank holds at attention TP `tp` (GQA replication when
    /// the model has fewer heads than ranks).
    pub fn local_heads(&self, tp: u64) -> u64 {
        if self.mla {
            1
        } else {
            (self.kv_heads / tp.max(1)).max(1)
        }
    }

    /// The global head index of a rank's local head `h`.
    pub fn global_head(&self, tp: u64, rank: u64, h: u64) -> u64 {
        if self.mla {
            return 0;
        }
        global_head(self.kv_heads, tp, rank, h)
    }

    /// Bytes of one page of one buffer on a rank at TP `tp`.
    pub fn item_len(&self, tp: u64) -> u64 {
        self.page_size * self.local_heads(tp) * self.head_bytes
    }

    /// KV bytes of one token across all KV and draft layers, K and V, whole model.
    pub fn token_bytes(&self) -> u64 {
        let kv = if self.mla { 1 } else { 2 };
        let layers = (0..self.layers).filter(|&l| self.is_kv_layer(l)).count() as u64;
        (layers + self.draft_layers) * kv * self.kv_heads.max(1) * self.head_bytes
    }

    /// Checks what the pools rely on: sizes at least 1, TP-sliced state axes
    /// that divide by `tp`, and one index kind per state component.
    pub fn validate(&self, tp: u64) -> Result<(), String> {
        if self.layers == 0 || self.page_size == 0 || self.head_bytes == 0 {
            return Err("layers, page size and head bytes must be at least 1".into());
        }
        if !self.mla {
            let heads = self.kv_heads;
            let even = if heads >= tp {
                heads.is_multiple_of(tp.max(1))
            } else {
                heads > 0 && tp.is_multiple_of(heads)
            };
            if !even {
                return Err(format!(
                    "{heads} KV heads cannot be split over TP {tp} (one must be a multiple of the other)"
                ));
            }
        }
        for s in &self.states {
            s.validate(tp)?;
        }
        if let Some(c) = &self.compressed {
            if !self.mla || self.draft_layers > 0 {
                return Err("a compressed-MLA pool is MLA and has no draft layers here".into());
            }
            if c.ratios.len() as u64 != self.layers {
                return Err(format!(
                    "{} compression ratios for {} layers",
                    c.ratios.len(),
                    self.layers
                ));
            }
        }
        Ok(())
    }
}

/// The global head of local head `h` of `rank` when `heads` heads are split
/// over `tp` ranks (replicated when there are fewer heads than ranks).
pub(super) fn global_head(heads: u64, tp: u64, rank: u64, h: u64) -> u64 {
    let tp = tp.max(1);
    if heads >= tp {
        rank * (heads / tp) + h
    } else {
        rank / (tp / heads.max(1))
    }
}

/// Where one rank sits in the parallel layout.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct RankSpec {
    /// Attention TP size.
    pub tp_size: u64,
    /// Attention TP rank.
    pub tp_rank: u64,
    /// PP size.
    pub pp_size: u64,
    /// PP rank.
    pub pp_rank: u64,
    /// Decode context-parallel size: each rank of a DCP group holds every
    /// `dcp_size`-th token (MLA only).
    #[serde(default = "one")]
    pub dcp_size: u64,
    /// This rank's place in its DCP group.
    #[serde(default)]
    pub dcp_rank: u64,
}

impl Default for RankSpec {
    /// [`RankSpec::SINGLE`].
    fn default() -> Self {
        Self::SINGLE
    }
}

impl RankSpec {
    /// The one rank of TP 1, PP 1, no DCP.
    pub const SINGLE: Self = Self {
        tp_size: 1,
        tp_rank: 0,
        pp_size: 1,
        pp_rank: 0,
        dcp_size: 1,
        dcp_rank: 0,
    };

    /// Rank `tp_rank` of TP `tp_size`, PP 1, no DCP.
    pub fn tp(tp_size: u64, tp_rank: u64) -> Self {
        Self {
            tp_size,
            tp_rank,
            ..Self::SINGLE
        }
    }

    /// This stage's layers `[start, end)` of `layers`.
    pub fn layer_range(&self, layers: u64) -> (u64, u64) {
        let pp = self.pp_size.max(1);
        let per = layers / pp;
        let extra = layers % pp;
        let start = self.pp_rank * per + self.pp_rank.min(extra);
        let len = per + u64::from(self.pp_rank < extra);
        (start, start + len)
    }

    /// Whether this is the last PP stage (the one holding draft layers).
    pub fn is_last_stage(&self) -> bool {
        self.pp_rank + 1 >= self.pp_size.max(1)
    }
}

/// Where a rank's pools live.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Placement {
    /// GPU for the KV and state buffers (`None`: host memory). Needs the `cuda` feature.
    pub device: Option<i32>,
    /// With a GPU: how many KV buffers (the first ones) stay in host memory
    /// anyway, so their blocks take the intra-node host path (`STATE_DATA`).
    pub host_kv_buffers: u64,
    /// A HiSparse decode (compressed-MLA pools): its C4 KV buffers live in
    /// host memory with their own page numbers.
    pub hisparse: bool,
}
