//! sglang's `KVArgs` (plus the parallel layout sglang keeps in its runtime
//! context) turned into kvbridge's [`KvArgs`], checked before anything is
//! registered. Pure functions of JSON the Python shell builds once per
//! manager (`kvbridge.sglang_backend`), so every rule here is tested without
//! Python.
//!
//! **Never:** guesses a field sglang did not set, drops a buffer silently,
//! or accepts a feature the Rust roles do not move (decode host
//! destinations): those are refused with the reason, at start.

use kvbridge_plan::{PrefillLayout, StateComponent, StateType};
use kvbridge_roles::{ConfigError, KvArgs};
use serde::Deserialize;

/// The fields of sglang 0.5.23's `KVArgs`, by their sglang names, as the
/// Python shell reads them (an attribute sglang never set arrives as `null`
/// or is left out).
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct SglangKvArgs {
    /// Engine rank (the TP rank; its attention-TP rank is `% attn_tp_size`).
    pub engine_rank: u64,
    /// KV buffer addresses.
    pub kv_data_ptrs: Vec<u64>,
    /// KV buffer byte lengths.
    pub kv_data_lens: Vec<u64>,
    /// Bytes per page of each KV buffer.
    pub kv_item_lens: Vec<u64>,
    /// Global layer id per KV buffer (empty: none published).
    pub kv_layer_ids: Vec<i64>,
    /// KV cache dtype name (checked against the peer's).
    pub kv_cache_dtype_str: Option<String>,
    /// KV byte-layout tag (a DeepSeek-V4 pool's `pd_kv_layout()`, such as
    /// `v4,c4:v4,c128:v4`; absent for other pools): the role reports it to
    /// the bootstrap server (prefill) or requires the prefill's to be
    /// equal (decode), see [`RoleSpec::kv_layout_with`].
    pub kv_layout: Option<String>,
    /// Decode host-receive buffers (HiCache host receive); refused.
    pub host_kv_data_ptrs: Option<Vec<u64>>,
    /// Aux (metadata) buffer addresses.
    pub aux_data_ptrs: Vec<u64>,
    /// Aux buffer byte lengths.
    pub aux_data_lens: Vec<u64>,
    /// Bytes per aux row of each aux buffer.
    pub aux_item_lens: Vec<u64>,
    /// State component types (`"mamba"`, `"swa"`, ...).
    pub state_types: Vec<String>,
    /// Buffer addresses per state component.
    pub state_data_ptrs: Vec<Vec<u64>>,
    /// Buffer byte lengths per state component.
    pub state_data_lens: Vec<Vec<u64>>,
    /// Bytes per item per state component.
    pub state_item_lens: Vec<Vec<u64>>,
    /// Layer ids per state component.
    pub state_layer_ids: Vec<Vec<i64>>,
    /// Size of the TP-sliced axis per mamba buffer.
    pub state_dim_per_tensor: Vec<Vec<u64>>,
    /// Rows before the sliced axis per mamba buffer.
    pub state_slice_outer_counts: Vec<Vec<u64>>,
    /// Conv sub-block sizes per mamba buffer.
    pub state_conv_shard_groups: Vec<Vec<Option<Vec<u64>>>>,
    /// Hybrid linear-attention pool with an MLA full-attention part.
    pub is_hybrid_mla_backend: bool,
    /// SWA sub-pool layout (`nhd`, `hnd`, `vectorized_5d`).
    pub swa_kv_cache_layout: Option<String>,
    /// KV heads on this rank (MHA; sglang leaves it unset for MLA).
    pub kv_head_num: Option<u64>,
    /// KV heads of the whole model (MHA).
    pub total_kv_head_num: Option<u64>,
    /// Tokens per page.
    pub page_size: u64,
    /// System DP rank.
    pub system_dp_rank: Option<u64>,
    /// PP rank of this prefill stage.
    pub pp_rank: Option<u64>,
    /// First layer of this PP stage.
    pub prefill_start_layer: Option<u64>,
    /// End (exclusive) of this PP stage's layers.
    pub prefill_end_layer: Option<u64>,
    /// Compressed-MLA ratio of every layer of the model (DeepSeek V4: 0
    /// uncompressed, 4 or 128; 1 and 2 for V4.1's low ratios): the KV
    /// buffers are grouped by ratio instead of by layer.
    pub mla_compression_ratios: Option<Vec<u64>>,
    /// Trailing KV buffers of the draft model.
    pub num_draft_entries: u64,
}

/// The parallel layout sglang keeps in its runtime context (`get_parallel()`),
/// as the Python shell reads it.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct SglangParallel {
    /// Attention TP size.
    pub attn_tp_size: u64,
    /// Attention TP rank.
    pub attn_tp_rank: u64,
    /// Attention CP size.
    pub attn_cp_size: u64,
    /// Attention CP rank.
    pub attn_cp_rank: u64,
    /// Decode-context-parallel size.
    pub attn_dcp_size: u64,
    /// Decode-context-parallel rank.
    pub attn_dcp_rank: u64,
    /// Attention DP size.
    pub attn_dp_size: u64,
    /// Attention DP rank.
    pub attn_dp_rank: u64,
    /// System DP size (`dp_size`).
    pub dp_size: u64,
    /// Pipeline size.
    pub pp_size: u64,
    /// Pipeline rank.
    pub pp_rank: u64,
}

impl Default for SglangParallel {
    fn default() -> Self {
        Self {
            attn_tp_size: 1,
            attn_tp_rank: 0,
            attn_cp_size: 1,
            attn_cp_rank: 0,
            attn_dcp_size: 1,
            attn_dcp_rank: 0,
            attn_dp_size: 1,
            attn_dp_rank: 0,
            dp_size: 1,
            pp_size: 1,
            pp_rank: 0,
        }
    }
}

/// Everything a role is built from: sglang's `KVArgs`, its parallel layout
/// and the manager settings the reference derives from them.
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RoleSpec {
    /// sglang's `KVArgs`.
    pub kv_args: SglangKvArgs,
    /// sglang's parallel layout.
    pub parallel: SglangParallel,
    /// The `is_mla_backend` argument of the manager.
    pub is_mla_backend: bool,
    /// `SGLANG_MOONCAKE_MAX_TRANSFER_BATCH_INDICES` (0: one batch per chunk).
    pub max_transfer_batch_indices: u64,
    /// `--enable-unified-memory`: whole-envelope KV layout.
    pub enable_unified_memory: bool,
}

impl RoleSpec {
    /// Parses the shell's JSON (unknown fields refused, so a renamed sglang
    /// field cannot be dropped silently).
    pub fn from_json(text: &str) -> Result<Self, ConfigError> {
        serde_json::from_str(text)
            .map_err(|e| ConfigError::Setting(format!("role description: {e}")))
    }
}

/// The compression ratios sglang's compressed-MLA pools use (0: none).
const COMPRESSION_RATIOS: [u64; 5] = [0, 1, 2, 4, 128];

fn layout_err(msg: impl Into<String>) -> ConfigError {
    ConfigError::Layout(msg.into())
}

fn check_len(what: &str, want: usize, got: usize) -> Result<(), ConfigError> {
    if want == got {
        Ok(())
    } else {
        Err(layout_err(format!(
            "{what} has {got} entries but state_types has {want}"
        )))
    }
}

/// A per-component list that sglang may leave empty (no component has the
/// metadata) or give one entry per component.
fn per_component<T: Clone + Default>(
    what: &str,
    list: &[T],
    components: usize,
) -> Result<Vec<T>, ConfigError> {
    if list.is_empty() {
        return Ok(vec![T::default(); components]);
    }
    check_len(what, components, list.len())?;
    Ok(list.to_vec())
}

/// Which role a [`RoleSpec`] starts: what sglang sets before creating the
/// manager differs between them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Side {
    /// A prefill rank: sglang sets the KV head counts of an MHA pool first.
    Prefill,
    /// A decode rank: sglang sets the KV head counts only after creating
    /// the manager (and only for staging), so they may be missing.
    Decode,
}

impl RoleSpec {
    /// The roles' [`KvArgs`] for `side`: refuses what kvbridge cannot move
    /// and every inconsistency between the lists, sizes and ranks, with the
    /// reason. A decode's MHA pool without `kv_head_num` gets head count 0
    /// ("unknown", handed over later with the decode manager's
    /// `set_kv_heads`).
    pub fn to_kv_args(&self, side: Side) -> Result<KvArgs, ConfigError> {
        let a = &self.kv_args;
        let p = &self.parallel;
        self.refuse_unsupported()?;
        if a.page_size == 0 {
            return Err(layout_err("page_size must be at least 1"));
        }
        for (name, size, rank) in [
            ("attn_tp", p.attn_tp_size, p.attn_tp_rank),
            ("attn_cp", p.attn_cp_size, p.attn_cp_rank),
            ("attn_dcp", p.attn_dcp_size, p.attn_dcp_rank),
            ("attn_dp", p.attn_dp_size, p.attn_dp_rank),
            ("pp", p.pp_size, p.pp_rank),
        ] {
            if size == 0 || rank >= size {
                return Err(ConfigError::Setting(format!(
                    "{name} rank {rank} is outside {name} size {size}"
                )));
            }
        }
        if let Some(pp_rank) = a.pp_rank
            && pp_rank != p.pp_rank
        {
            return Err(ConfigError::Setting(format!(
                "KVArgs.pp_rank is {pp_rank} but the parallel layout says PP rank {}",
                p.pp_rank
            )));
        }
        if a.engine_rank % p.attn_tp_size != p.attn_tp_rank {
            return Err(ConfigError::Setting(format!(
                "KVArgs.engine_rank {} is attention-TP rank {} of {}, but the parallel \
                 layout says attention-TP rank {}",
                a.engine_rank,
                a.engine_rank % p.attn_tp_size,
                p.attn_tp_size,
                p.attn_tp_rank
            )));
        }
        let is_mla = self.is_mla_backend;
        let kv_head_num = match (is_mla, a.kv_head_num, side) {
            (true, _, _) => 1,
            (false, Some(n), _) if n > 0 => n,
            // sglang's decode sets the heads after creating the manager.
            (false, None, Side::Decode) => 0,
            (false, _, _) => {
                return Err(layout_err(
                    "an MHA pool needs KVArgs.kv_head_num (KV heads on this rank)",
                ));
            }
        };
        let total_kv_head_num = if is_mla || kv_head_num == 0 {
            0
        } else {
            a.total_kv_head_num.unwrap_or(0)
        };
        if total_kv_head_num != 0 && total_kv_head_num < kv_head_num {
            return Err(layout_err(format!(
                "total_kv_head_num {total_kv_head_num} is below kv_head_num {kv_head_num}"
            )));
        }
        let start = a.prefill_start_layer.unwrap_or(0);
        if let Some(end) = a.prefill_end_layer
            && end < start
        {
            return Err(layout_err(format!(
                "prefill_end_layer {end} is before prefill_start_layer {start}"
            )));
        }
        if a.num_draft_entries > a.kv_data_ptrs.len() as u64 {
            return Err(layout_err(format!(
                "num_draft_entries {} exceeds the {} KV buffers",
                a.num_draft_entries,
                a.kv_data_ptrs.len()
            )));
        }
        let states = self.states()?;
        let kv_args = KvArgs {
            layout: PrefillLayout {
                engine_rank: a.engine_rank,
                attn_tp_size: p.attn_tp_size,
                pp_size: p.pp_size,
                dcp_size: p.attn_dcp_size,
                dcp_rank: p.attn_dcp_rank,
                page_size: a.page_size,
                is_mla_backend: is_mla,
                is_hybrid_mla_backend: a.is_hybrid_mla_backend,
                kv_data_ptrs: a.kv_data_ptrs.clone(),
                kv_item_lens: a.kv_item_lens.clone(),
                kv_layer_ids: a.kv_layer_ids.clone(),
                kv_head_num,
                total_kv_head_num,
                num_draft_entries: a.num_draft_entries,
                prefill_start_layer: start,
                prefill_end_layer: a.prefill_end_layer,
                aux_data_ptrs: a.aux_data_ptrs.clone(),
                aux_item_lens: a.aux_item_lens.clone(),
                states,
                max_transfer_batch_indices: self.max_transfer_batch_indices,
                enable_unified_memory: self.enable_unified_memory,
                mla_compression_ratios: self.compression_ratios()?,
                swa_kv_cache_layout: a.swa_kv_cache_layout.clone(),
            },
            kv_data_lens: a.kv_data_lens.clone(),
            aux_data_lens: a.aux_data_lens.clone(),
            state_data_lens: per_component(
                "state_data_lens",
                &a.state_data_lens,
                a.state_types.len(),
            )?,
        };
        kv_args.validate()?;
        if kv_args.layout.kv_item_lens.contains(&0) {
            return Err(layout_err("a KV buffer has kv_item_lens 0"));
        }
        Ok(kv_args)
    }

    /// What the Rust roles do not move, refused by name.
    fn refuse_unsupported(&self) -> Result<(), ConfigError> {
        if self
            .kv_args
            .host_kv_data_ptrs
            .as_ref()
            .is_some_and(|v| !v.is_empty())
        {
            // sglang 0.5.23's own connectors cannot either: it refuses the
            // setting when the manager says supports_host_destination=False.
            return Err(ConfigError::Setting(
                "decode host KV destinations (KVArgs.host_kv_data_ptrs, \
                 --disaggregation-decode-host-receive-threshold < 1) are not supported by the \
                 kvbridge roles"
                    .into(),
            ));
        }
        Ok(())
    }

    /// `mla_compression_ratios` for the planner layout, checked: an MLA
    /// pool, one ratio per model layer, each one sglang's pools use.
    fn compression_ratios(&self) -> Result<Option<Vec<u64>>, ConfigError> {
        let Some(ratios) = &self.kv_args.mla_compression_ratios else {
            return Ok(None);
        };
        if !self.is_mla_backend {
            return Err(layout_err(
                "mla_compression_ratios (a compressed-MLA pool) needs an MLA backend \
                 (is_mla_backend)",
            ));
        }
        if ratios.is_empty() {
            return Err(layout_err(
                "mla_compression_ratios is empty (one ratio per model layer expected)",
            ));
        }
        if let Some((layer, ratio)) = ratios
            .iter()
            .enumerate()
            .find(|(_, r)| !COMPRESSION_RATIOS.contains(r))
        {
            return Err(layout_err(format!(
                "mla_compression_ratios: layer {layer} has ratio {ratio}; sglang's compressed \
                 pools use {COMPRESSION_RATIOS:?}"
            )));
        }
        if let Some(end) = self.kv_args.prefill_end_layer
            && end > ratios.len() as u64
        {
            return Err(layout_err(format!(
                "prefill_end_layer {end} is past the {} layers of mla_compression_ratios",
                ratios.len()
            )));
        }
        Ok(Some(ratios.clone()))
    }

    /// The KV layout tag the role runs with: `KVArgs.kv_layout`, or the
    /// one the role configuration names; both set and different is refused.
    pub fn kv_layout_with(
        &self,
        configured: Option<String>,
    ) -> Result<Option<String>, ConfigError> {
        match (configured, &self.kv_args.kv_layout) {
            (Some(c), Some(k)) if c != *k => Err(ConfigError::Setting(format!(
                "KVArgs.kv_layout is {k:?} but the role configuration says kv_layout={c:?}"
            ))),
            (configured, from_kv_args) => Ok(configured.or_else(|| from_kv_args.clone())),
        }
    }

    /// The state components, every per-component list checked.
    fn states(&self) -> Result<Vec<StateComponent>, ConfigError> {
        let a = &self.kv_args;
        let n = a.state_types.len();
        let ptrs = per_component("state_data_ptrs", &a.state_data_ptrs, n)?;
        let items = per_component("state_item_lens", &a.state_item_lens, n)?;
        let layers = per_component("state_layer_ids", &a.state_layer_ids, n)?;
        let dims = per_component("state_dim_per_tensor", &a.state_dim_per_tensor, n)?;
        let outer = per_component("state_slice_outer_counts", &a.state_slice_outer_counts, n)?;
        let conv = per_component("state_conv_shard_groups", &a.state_conv_shard_groups, n)?;
        let mut out = Vec::with_capacity(n);
        for (i, name) in a.state_types.iter().enumerate() {
            let state_type: StateType = name
                .parse()
                .map_err(|e| layout_err(format!("state component {i}: {e}")))?;
            if !layers[i].is_empty() && layers[i].len() != ptrs[i].len() {
                return Err(layout_err(format!(
                    "state component {i} ({name}): {} layer ids for {} buffers",
                    layers[i].len(),
                    ptrs[i].len()
                )));
            }
            out.push(StateComponent {
                state_type,
                data_ptrs: ptrs[i].clone(),
                item_lens: items[i].clone(),
                layer_ids: layers[i].clone(),
                dim_per_tensor: dims[i].clone(),
                conv_shard_groups: conv[i].clone(),
                slice_outer_counts: outer[i].clone(),
            });
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A TP2 MHA rank (1 local head of 2), 2 layers, one aux buffer.
    fn mha() -> RoleSpec {
        RoleSpec::from_json(
            r#"{
                "kv_args": {
                    "engine_rank": 1, "kv_data_ptrs": [4096, 8192, 12288, 16384],
                    "kv_data_lens": [4096, 4096, 4096, 4096], "kv_item_lens": [1024, 1024, 1024, 1024],
                    "kv_layer_ids": [], "kv_cache_dtype_str": "auto", "kv_layout": null,
                    "aux_data_ptrs": [65536], "aux_data_lens": [256], "aux_item_lens": [64],
                    "state_types": [], "state_data_ptrs": [], "state_data_lens": [],
                    "state_item_lens": [], "kv_head_num": 1, "total_kv_head_num": 2,
                    "page_size": 16, "pp_rank": 0, "prefill_start_layer": 0,
                    "prefill_end_layer": 2, "num_draft_entries": 0
                },
                "parallel": {"attn_tp_size": 2, "attn_tp_rank": 1},
                "is_mla_backend": false
            }"#,
        )
        .unwrap()
    }

    #[test]
    fn mha_kv_args_carry_every_field() {
        let kv = mha().to_kv_args(Side::Prefill).unwrap();
        let l = &kv.layout;
        assert_eq!(l.engine_rank, 1);
        assert_eq!(l.attn_tp_size, 2);
        assert_eq!(l.kv_head_num, 1);
        assert_eq!(l.total_kv_head_num, 2);
        assert_eq!(l.page_size, 16);
        assert_eq!(l.kv_data_ptrs, vec![4096, 8192, 12288, 16384]);
        assert_eq!(l.prefill_end_layer, Some(2));
        assert_eq!(kv.aux_data_lens, vec![256]);
        assert_eq!(kv.registerable_regions().len(), 5);
    }

    #[test]
    fn mla_needs_no_head_counts() {
        let mut s = mha();
        s.is_mla_backend = true;
        s.kv_args.kv_head_num = None;
        s.kv_args.total_kv_head_num = None;
        let kv = s.to_kv_args(Side::Prefill).unwrap();
        assert!(kv.layout.is_mla_backend);
        assert_eq!(kv.layout.kv_head_num, 1);
        assert_eq!(kv.layout.total_kv_head_num, 0);
    }

    #[test]
    fn a_decode_needs_no_head_counts_but_a_prefill_does() {
        let mut s = mha();
        s.kv_args.kv_head_num = None;
        s.kv_args.total_kv_head_num = Some(2);
        let kv = s.to_kv_args(Side::Decode).unwrap();
        assert_eq!(kv.layout.kv_head_num, 0, "unknown until handed over");
        assert_eq!(kv.layout.total_kv_head_num, 0);
        let e = s.to_kv_args(Side::Prefill).unwrap_err().to_string();
        assert!(e.contains("kv_head_num"), "{e}");
        // Heads given at start are kept on both sides.
        let kv = mha().to_kv_args(Side::Decode).unwrap();
        assert_eq!((kv.layout.kv_head_num, kv.layout.total_kv_head_num), (1, 2));
    }

    #[test]
    fn state_components_are_built_in_order() {
        let mut s = mha();
        s.kv_args.state_types = vec!["mamba".into(), "swa".into()];
        s.kv_args.state_data_ptrs = vec![vec![0x10_0000], vec![0x20_0000, 0x30_0000]];
        s.kv_args.state_data_lens = vec![vec![4096], vec![4096, 4096]];
        s.kv_args.state_item_lens = vec![vec![512], vec![256, 256]];
        s.kv_args.state_dim_per_tensor = vec![vec![8], vec![]];
        let kv = s.to_kv_args(Side::Prefill).unwrap();
        assert_eq!(kv.layout.states.len(), 2);
        assert_eq!(kv.layout.states[0].state_type, StateType::Mamba);
        assert_eq!(kv.layout.states[0].dim_per_tensor, vec![8]);
        assert_eq!(kv.layout.states[1].state_type, StateType::Swa);
        assert_eq!(kv.layout.states[1].data_ptrs, vec![0x20_0000, 0x30_0000]);
        assert_eq!(kv.state_data_lens, vec![vec![4096], vec![4096, 4096]]);
    }

    fn refused(s: &RoleSpec) -> String {
        s.to_kv_args(Side::Prefill).unwrap_err().to_string()
    }

    #[test]
    fn mismatched_lists_are_refused() {
        let mut s = mha();
        s.kv_args.kv_data_lens.pop();
        assert!(refused(&s).contains("kv_data_lens"), "{}", refused(&s));
        let mut s = mha();
        s.kv_args.kv_item_lens[0] = 8192;
        assert!(refused(&s).contains("does not fit"), "{}", refused(&s));
        let mut s = mha();
        s.kv_args.state_types = vec!["swa".into()];
        s.kv_args.state_data_ptrs = vec![vec![1], vec![2]];
        assert!(refused(&s).contains("state_data_ptrs"), "{}", refused(&s));
        let mut s = mha();
        s.kv_args.state_types = vec!["no_such_state".into()];
        s.kv_args.state_data_ptrs = vec![vec![1]];
        s.kv_args.state_data_lens = vec![vec![4096]];
        s.kv_args.state_item_lens = vec![vec![16]];
        assert!(
            refused(&s).contains("unknown state type"),
            "{}",
            refused(&s)
        );
    }

    #[test]
    fn inconsistent_ranks_and_sizes_are_refused() {
        let mut s = mha();
        s.parallel.attn_tp_rank = 0;
        assert!(refused(&s).contains("engine_rank"), "{}", refused(&s));
        let mut s = mha();
        s.parallel.pp_size = 2;
        s.parallel.pp_rank = 1;
        assert!(refused(&s).contains("pp_rank"), "{}", refused(&s));
        let mut s = mha();
        s.parallel.attn_tp_size = 0;
        assert!(refused(&s).contains("outside"), "{}", refused(&s));
        let mut s = mha();
        s.kv_args.page_size = 0;
        assert!(refused(&s).contains("page_size"), "{}", refused(&s));
        let mut s = mha();
        s.kv_args.kv_head_num = None;
        assert!(refused(&s).contains("kv_head_num"), "{}", refused(&s));
        let mut s = mha();
        s.kv_args.total_kv_head_num = Some(0);
        s.kv_args.kv_head_num = Some(4);
        assert!(s.to_kv_args(Side::Prefill).is_ok());
        s.kv_args.total_kv_head_num = Some(2);
        assert!(refused(&s).contains("below"), "{}", refused(&s));
        let mut s = mha();
        s.kv_args.prefill_start_layer = Some(3);
        assert!(refused(&s).contains("before"), "{}", refused(&s));
    }

    #[test]
    fn unsupported_features_are_refused_by_name() {
        let mut s = mha();
        s.kv_args.host_kv_data_ptrs = Some(vec![1]);
        assert!(refused(&s).contains("host_kv_data_ptrs"), "{}", refused(&s));
        // An empty list names no host buffer.
        s.kv_args.host_kv_data_ptrs = Some(vec![]);
        assert!(s.to_kv_args(Side::Decode).is_ok());
        // Prefill context parallelism is supported: a CP rank is accepted.
        let mut s = mha();
        s.parallel.attn_cp_size = 2;
        s.parallel.attn_cp_rank = 1;
        assert!(s.to_kv_args(Side::Prefill).is_ok());
    }

    /// A DeepSeek-V4 rank as sglang describes it: MLA, no layer ids, one
    /// compression ratio per model layer, its layout tag.
    fn v4() -> RoleSpec {
        let mut s = mha();
        s.is_mla_backend = true;
        s.kv_args.kv_head_num = None;
        s.kv_args.total_kv_head_num = None;
        s.kv_args.mla_compression_ratios = Some(vec![0, 4, 128, 4]);
        s.kv_args.prefill_end_layer = Some(4);
        s.kv_args.kv_layout = Some("v4,c4:v4,c128:v4".into());
        s
    }

    #[test]
    fn compressed_mla_ratios_reach_the_planner_layout() {
        let kv = v4().to_kv_args(Side::Prefill).unwrap();
        assert_eq!(kv.layout.mla_compression_ratios, Some(vec![0, 4, 128, 4]));
        let kv = v4().to_kv_args(Side::Decode).unwrap();
        assert_eq!(kv.layout.mla_compression_ratios, Some(vec![0, 4, 128, 4]));
        assert_eq!(
            mha()
                .to_kv_args(Side::Prefill)
                .unwrap()
                .layout
                .mla_compression_ratios,
            None
        );
    }

    #[test]
    fn compression_ratios_sglang_cannot_have_are_refused() {
        let mut s = v4();
        s.is_mla_backend = false;
        s.kv_args.kv_head_num = Some(1);
        assert!(refused(&s).contains("is_mla_backend"), "{}", refused(&s));
        let mut s = v4();
        s.kv_args.mla_compression_ratios = Some(vec![]);
        assert!(refused(&s).contains("empty"), "{}", refused(&s));
        let mut s = v4();
        s.kv_args.mla_compression_ratios = Some(vec![0, 4, 8, 4]);
        assert!(
            refused(&s).contains("layer 2 has ratio 8"),
            "{}",
            refused(&s)
        );
        let mut s = v4();
        s.kv_args.prefill_end_layer = Some(6);
        assert!(
            refused(&s).contains("prefill_end_layer 6"),
            "{}",
            refused(&s)
        );
    }

    #[test]
    fn the_kv_layout_tag_comes_from_kv_args_and_must_agree_with_the_configuration() {
        let s = v4();
        let tag = Some("v4,c4:v4,c128:v4".to_owned());
        assert_eq!(s.kv_layout_with(None).unwrap(), tag);
        assert_eq!(s.kv_layout_with(tag.clone()).unwrap(), tag);
        let e = s
            .kv_layout_with(Some("v41,c4:v41,c128:v41".into()))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("v4,c4:v4,c128:v4") && e.contains("v41,c4:v41,c128:v41"),
            "{e}"
        );
        assert_eq!(mha().kv_layout_with(None).unwrap(), None);
        assert_eq!(mha().kv_layout_with(tag.clone()).unwrap(), tag);
    }

    #[test]
    fn unknown_fields_are_refused() {
        let err = RoleSpec::from_json(r#"{"kv_args": {"kv_data_ptr": []}}"#).unwrap_err();
        assert!(err.to_string().contains("kv_data_ptr"), "{err}");
        let err = RoleSpec::from_json(r#"{"parallel": {"tp": 2}}"#).unwrap_err();
        assert!(err.to_string().contains("tp"), "{err}");
    }
}
