//! Which prefill ranks a decode rank pulls a room from (sglang
//! `try_ensure_parallel_info` checks and `_resolve_rank_mapping`).

use kvbridge_wire::bootstrap::PrefillServerInfo;

/// This decode rank's place, as the mapping needs it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LocalTopology {
    /// Decode attention TP size.
    pub attn_tp_size: u64,
    /// Decode engine rank.
    pub engine_rank: u64,
    /// Decode PP size.
    pub pp_size: u64,
    /// Decode PP rank.
    pub pp_rank: u64,
    /// Decode page size.
    pub page_size: u64,
    /// MLA KV pool.
    pub is_mla: bool,
    /// Hybrid-MLA KV pool.
    pub is_hybrid_mla: bool,
    /// Pull from every prefill CP rank (`SGLANG_DISAGGREGATION_ALL_CP_RANKS_TRANSFER`).
    pub all_cp_ranks: bool,
    /// Decode context-parallel size.
    pub dcp_size: u64,
}

/// The prefill ranks of one prefill server that hold this decode rank's KV.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RankMapping {
    /// The "real" prefill TP rank (`None`: all are real, KV sharding).
    pub target_tp_rank: Option<u64>,
    /// Every prefill TP rank to contact.
    pub target_tp_ranks: Vec<u64>,
    /// Prefill CP ranks to contact.
    pub target_cp_ranks: Vec<u64>,
    /// Prefill PP ranks to contact.
    pub target_pp_ranks: Vec<u64>,
    /// Decode ranks each prefill rank waits for (sent in transfer requests).
    pub required_dst_info_num: u64,
    /// Success messages this decode rank waits for per room.
    pub required_prefill_response_num: u64,
    /// The prefill server's attention TP size.
    pub prefill_attn_tp_size: u64,
}

/// Checks the prefill's topology, KV cache dtype and KV layout tag
/// (`kv_layout`: both sides' must be equal, absent on both or the same
/// string) against ours and maps ranks. Every size the peer reports is
/// checked against [`kvbridge_wire::bootstrap::MAX_PARALLEL_SIZE`] and
/// [`kvbridge_wire::bootstrap::MAX_TOTAL_RANKS`] before anything is computed
/// from it, so no list here is longer than `MAX_PARALLEL_SIZE`.
pub fn resolve(
    info: &PrefillServerInfo,
    local: &LocalTopology,
    kv_cache_dtype: &str,
    kv_layout: Option<&str>,
) -> Result<RankMapping, String> {
    info.validate_sizes()
        .map_err(|e| format!("prefill server reported an unusable topology: {e}"))?;
    if let Some(page) = info.page_size.filter(|p| *p != local.page_size) {
        return Err(format!(
            "Page size mismatch: prefill server has page_size={page}, but decode server has \
             page_size={}. Both servers must use the same --page-size value.",
            local.page_size
        ));
    }
    if let Some(dtype) = info
        .kv_cache_dtype
        .as_deref()
        .filter(|d| *d != kv_cache_dtype)
    {
        return Err(format!(
            "KV cache dtype mismatch: prefill server has kv_cache_dtype={dtype}, but decode server \
             has kv_cache_dtype={kv_cache_dtype}."
        ));
    }
    if info.kv_layout.as_deref() != kv_layout {
        // Stricter than sglang, which skips the check when either side has
        // no tag: a compressed pool facing a plain one is a mismatch too.
        return Err(format!(
            "KV layout mismatch: prefill server has kv_layout={}, but decode server has \
             kv_layout={}. Both servers must use the same --dsv4-attn-backend and \
             SGLANG_DSV4_KV_LAYOUT.",
            info.kv_layout.as_deref().unwrap_or("None"),
            kv_layout.unwrap_or("None")
        ));
    }
    let (p, d) = (info.attn_tp_size, local.attn_tp_size);
    if d == 0 || local.pp_size == 0 {
        return Err("this decode rank has a zero parallel size".into());
    }
    if local.dcp_size > 1 {
        // The DCP relayout feeds every decode DCP rank from one whole copy
        // of the KV: an MLA pool, prefill without context parallelism.
        if !(local.is_mla || local.is_hybrid_mla) {
            return Err(format!(
                "decode context parallelism (dcp size {}) needs an MLA KV pool",
                local.dcp_size
            ));
        }
        if info.attn_cp_size != 1 {
            return Err(format!(
                "decode context parallelism needs a prefill without context parallelism, got \
                 prefill attn_cp_size={}",
                info.attn_cp_size
            ));
        }
        if info.enable_kv_cache_sharding {
            return Err("decode context parallelism cannot pull from a KV-sharded prefill".into());
        }
    }
    let r = local.engine_rank % d;
    let mut mapping = if local.is_mla && info.enable_kv_cache_sharding && info.attn_cp_size == 1 {
        if p != d {
            return Err(format!(
                "MLA KV cache sharding requires equal prefill/decode attn TP sizes, got prefill={p} decode={d}"
            ));
        }
        RankMapping {
            target_tp_rank: None,
            target_tp_ranks: (0..p).collect(),
            required_dst_info_num: d,
            required_prefill_response_num: p,
            target_cp_ranks: Vec::new(),
            target_pp_ranks: Vec::new(),
            prefill_attn_tp_size: p,
        }
    } else if d == p {
        RankMapping {
            target_tp_rank: Some(r),
            target_tp_ranks: vec![r],
            required_dst_info_num: 1,
            required_prefill_response_num: 1,
            target_cp_ranks: Vec::new(),
            target_pp_ranks: Vec::new(),
            prefill_attn_tp_size: p,
        }
    } else if d > p {
        if d % p != 0 {
            return Err(format!("decode TP {d} is not a multiple of prefill TP {p}"));
        }
        let t = r / (d / p);
        RankMapping {
            target_tp_rank: Some(t),
            target_tp_ranks: vec![t],
            required_dst_info_num: d / p,
            required_prefill_response_num: 1,
            target_cp_ranks: Vec::new(),
            target_pp_ranks: Vec::new(),
            prefill_attn_tp_size: p,
        }
    } else {
        if p % d != 0 {
            return Err(format!("prefill TP {p} is not a multiple of decode TP {d}"));
        }
        let ratio = p / d;
        let ranks: Vec<u64> = (r * ratio..(r + 1) * ratio).collect();
        RankMapping {
            target_tp_rank: ranks.first().copied(),
            target_tp_ranks: ranks,
            required_dst_info_num: 1,
            required_prefill_response_num: if local.is_mla { 1 } else { ratio },
            target_cp_ranks: Vec::new(),
            target_pp_ranks: Vec::new(),
            prefill_attn_tp_size: p,
        }
    };
    if info.attn_cp_size == 1 {
        mapping.target_cp_ranks = vec![0];
    } else if local.all_cp_ranks
        || local.is_hybrid_mla
        || info.enable_dsa_cache_layer_split
        || info.enable_kv_cache_sharding
    {
        mapping.target_cp_ranks = (0..info.attn_cp_size).collect();
        mapping.required_prefill_response_num *= info.attn_cp_size;
    } else {
        mapping.target_cp_ranks = vec![0];
    }
    if local.pp_size != info.pp_size && local.pp_size != 1 {
        return Err(format!(
            "Decode pp size ({}) should be equal to prefill pp size ({}) or 1",
            local.pp_size, info.pp_size
        ));
    }
    if info.pp_size == local.pp_size {
        mapping.target_pp_ranks = vec![local.pp_rank];
    } else {
        mapping.target_pp_ranks = (0..info.pp_size).collect();
        mapping.required_prefill_response_num *= info.pp_size / local.pp_size;
    }
    Ok(mapping)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn info(tp: u64, pp: u64) -> PrefillServerInfo {
        serde_json::from_value(serde_json::json!({
            "attn_tp_size": tp, "attn_cp_size": 1, "dp_size": 1, "pp_size": pp,
            "page_size": 16, "kv_cache_dtype": "auto", "follow_bootstrap_room": true
        }))
        .unwrap()
    }

    fn local(tp: u64, rank: u64, mla: bool) -> LocalTopology {
        LocalTopology {
            attn_tp_size: tp,
            engine_rank: rank,
            pp_size: 1,
            pp_rank: 0,
            page_size: 16,
            is_mla: mla,
            is_hybrid_mla: false,
            all_cp_ranks: false,
            dcp_size: 1,
        }
    }

    #[test]
    fn equal_tp() {
        let m = resolve(&info(2, 1), &local(2, 1, false), "auto", None).unwrap();
        assert_eq!(
            (
                m.target_tp_ranks,
                m.required_dst_info_num,
                m.required_prefill_response_num
            ),
            (vec![1], 1, 1)
        );
    }

    #[test]
    fn decode_wider_than_prefill() {
        let m = resolve(&info(2, 1), &local(4, 3, false), "auto", None).unwrap();
        assert_eq!((m.target_tp_ranks, m.required_dst_info_num), (vec![1], 2));
    }

    #[test]
    fn prefill_wider_than_decode() {
        let m = resolve(&info(4, 1), &local(2, 1, false), "auto", None).unwrap();
        assert_eq!(
            (m.target_tp_ranks.clone(), m.required_prefill_response_num),
            (vec![2, 3], 2)
        );
        let m = resolve(&info(4, 1), &local(2, 1, true), "auto", None).unwrap();
        assert_eq!(
            (m.target_tp_rank, m.required_prefill_response_num),
            (Some(2), 1)
        );
    }

    #[test]
    fn prefill_pp_stages() {
        let m = resolve(&info(1, 2), &local(1, 0, false), "auto", None).unwrap();
        assert_eq!(
            (m.target_pp_ranks, m.required_prefill_response_num),
            (vec![0, 1], 2)
        );
    }

    #[test]
    fn mismatches_fail() {
        let mut l = local(1, 0, false);
        l.page_size = 32;
        assert!(
            resolve(&info(1, 1), &l, "auto", None)
                .unwrap_err()
                .contains("Page size mismatch")
        );
        assert!(
            resolve(&info(1, 1), &local(1, 0, false), "fp8", None)
                .unwrap_err()
                .contains("dtype")
        );
        assert!(resolve(&info(3, 1), &local(2, 0, false), "auto", None).is_err());
    }

    #[test]
    fn kv_layouts_must_be_equal_and_a_mismatch_names_both() {
        let v4 = "v4,c4:v4,c128:v4";
        let mut i = info(1, 1);
        i.kv_layout = Some(v4.into());
        let l = local(1, 0, true);
        assert!(resolve(&i, &l, "auto", Some(v4)).is_ok());
        let e = resolve(&i, &l, "auto", Some("v41,c4:v41,c128:v41")).unwrap_err();
        assert!(e.contains("kv_layout=v4,c4:v4,c128:v4"), "{e}");
        assert!(e.contains("kv_layout=v41,c4:v41,c128:v41"), "{e}");
        // A tag on one side only is a mismatch too.
        let e = resolve(&i, &l, "auto", None).unwrap_err();
        assert!(e.contains("decode server has kv_layout=None"), "{e}");
        let e = resolve(&info(1, 1), &l, "auto", Some(v4)).unwrap_err();
        assert!(e.contains("prefill server has kv_layout=None"), "{e}");
    }

    #[test]
    fn prefill_cp_targets_follow_our_setting() {
        let mut i = info(1, 1);
        i.attn_cp_size = 4;
        let all = LocalTopology {
            all_cp_ranks: true,
            ..local(1, 0, false)
        };
        let m = resolve(&i, &all, "auto", None).unwrap();
        assert_eq!(
            (m.target_cp_ranks, m.required_prefill_response_num),
            (vec![0, 1, 2, 3], 4)
        );
        let m = resolve(&i, &local(1, 0, false), "auto", None).unwrap();
        assert_eq!(
            (m.target_cp_ranks, m.required_prefill_response_num),
            (vec![0], 1)
        );
    }

    #[test]
    fn decode_context_parallelism_needs_mla_and_a_prefill_without_cp() {
        let dcp = |mla| LocalTopology {
            dcp_size: 2,
            ..local(2, 0, mla)
        };
        assert!(
            resolve(&info(1, 1), &dcp(false), "auto", None)
                .unwrap_err()
                .contains("MLA")
        );
        let mut i = info(1, 1);
        i.attn_cp_size = 2;
        assert!(
            resolve(&i, &dcp(true), "auto", None)
                .unwrap_err()
                .contains("attn_cp_size=2")
        );
        assert!(resolve(&info(1, 1), &dcp(true), "auto", None).is_ok());
    }
}
