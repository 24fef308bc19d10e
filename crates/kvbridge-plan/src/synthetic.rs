//! Deterministic synthetic scenarios: the four large cases the planner's
//! speed is measured on (criterion bench `plan`, `kvbridge plan --bench`).
//!
//! Page lists are pseudo-random but fixed (a seeded xorshift64*,
//! [`crate::rng::Rng`]), shaped like a
//! real allocator's output: the prefill side holds long runs of pages, the
//! decode side short segments, so page runs have realistic lengths.

use crate::rng::Rng;
use crate::scenario::Scenario;

/// One of the large benchmark cases.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LargeCase {
    /// MHA, 80 layers, TP 8 → 8, page 1, 128k tokens (≈1.75 M blocks).
    MhaEqualTp128k,
    /// MHA head slicing, TP 8 → 2, 48 layers, page 64, 32k tokens (3.1 M blocks).
    HeadSliceTp8To2,
    /// MLA, 61 layers + 1 draft entry, DCP 1 → 4, page 64, 32k tokens.
    MlaDcp4Draft,
    /// MLA, 61 layers, page 64, 128k tokens, with a DSA indexer state (≈30 k blocks).
    MlaDsa128k,
}

impl LargeCase {
    /// All cases.
    pub const ALL: [LargeCase; 4] = [
        LargeCase::MhaEqualTp128k,
        LargeCase::HeadSliceTp8To2,
        LargeCase::MlaDcp4Draft,
        LargeCase::MlaDsa128k,
    ];

    /// A short file-friendly name.
    pub fn name(self) -> &'static str {
        match self {
            LargeCase::MhaEqualTp128k => "large_mha_equal_tp_128k",
            LargeCase::HeadSliceTp8To2 => "large_head_slice_tp8_to_2",
            LargeCase::MlaDcp4Draft => "large_mla_dcp4_draft",
            LargeCase::MlaDsa128k => "large_mla_dsa_128k",
        }
    }

    /// The scenario.
    pub fn scenario(self) -> Scenario {
        match self {
            LargeCase::MhaEqualTp128k => mha_equal_tp_128k(),
            LargeCase::HeadSliceTp8To2 => head_slice_tp8_to_2(),
            LargeCase::MlaDcp4Draft => mla_dcp4_draft(),
            LargeCase::MlaDsa128k => mla_dsa_128k(),
        }
    }
}

/// `n` page indices in segments of `seg_lo..=seg_hi` pages, each segment at a
/// fresh random place of a pool of `pool` pages.
fn segmented_pages(rng: &mut Rng, n: usize, seg_lo: u64, seg_hi: u64, pool: u64) -> Vec<i32> {
    let mut out = Vec::with_capacity(n);
    while out.len() < n {
        let len = rng.range(seg_lo, seg_hi);
        let start = rng.range(0, pool - len);
        for p in start..start + len {
            if out.len() == n {
                break;
            }
            out.push(i32::try_from(p).unwrap_or(i32::MAX));
        }
    }
    out
}

/// Buffer base addresses, 1 GiB apart.
fn ptrs(base: u64, n: usize) -> Vec<u64> {
    (0..n as u64).map(|k| base + (k << 30)).collect()
}

const SRC_BASE: u64 = 0x7f00_0000_0000;
const DST_BASE: u64 = 0x3e00_0000_0000;

fn base(name: &str, description: &str) -> Scenario {
    Scenario {
        name: Some(name.to_owned()),
        description: Some(description.to_owned()),
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
        aux_data_ptrs: vec![0x5500_0000_0000],
        aux_item_lens: vec![4096],
        state_types: Vec::new(),
        state_data_ptrs: Vec::new(),
        state_item_lens: Vec::new(),
        state_layer_ids: Vec::new(),
        state_dim_per_tensor: Vec::new(),
        state_conv_shard_groups: Vec::new(),
        state_slice_outer_counts: Vec::new(),
        max_transfer_batch_indices: 0,
        enable_unified_memory: false,
        dst_kv_ptrs: Vec::new(),
        dst_aux_ptrs: vec![0x2200_0000_0000],
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
        dst_kv_indices: Vec::new(),
        dst_aux_index: 3,
        dst_state_indices: Vec::new(),
        decode_prefix_len: None,
        prefill_kv_indices: Vec::new(),
        index_slice_start: 0,
        index_slice_end: None,
        is_last_chunk: true,
        prefill_aux_index: Some(1),
        state_indices: None,
        num_kv_tokens: None,
    }
}

fn mha_equal_tp_128k() -> Scenario {
    let mut rng = Rng::new(0x5eed_0001);
    let pages = 131_072;
    let layers = 80;
    // Llama-70B-like: 8 KV heads / TP 8 = 1 head of 128 bf16 per token.
    let item = 256;
    let mut s = base(
        LargeCase::MhaEqualTp128k.name(),
        "MHA, 80 layers, attention TP 8 -> 8 (rank 3), page 1, one 128k-token chunk; decode pages in segments of 1..23.",
    );
    s.engine_rank = 3;
    s.attn_tp_size = 8;
    s.kv_head_num = 1;
    s.total_kv_head_num = 8;
    s.kv_data_ptrs = ptrs(SRC_BASE, 2 * layers);
    s.kv_item_lens = vec![item; 2 * layers];
    s.dst_kv_ptrs = ptrs(DST_BASE, 2 * layers);
    s.dst_tp_rank = 3;
    s.dst_attn_tp_size = 8;
    s.dst_kv_item_len = item;
    s.prefill_kv_indices = segmented_pages(&mut rng, pages, 512, 4096, 1 << 20);
    s.dst_kv_indices = segmented_pages(&mut rng, pages, 1, 23, 1 << 20);
    s
}

fn head_slice_tp8_to_2() -> Scenario {
    let mut rng = Rng::new(0x5eed_0002);
    let page_size = 64;
    let pages = 32_768 / page_size as usize;
    let layers = 48;
    let head = 256; // 128 bf16
    let mut s = base(
        LargeCase::HeadSliceTp8To2.name(),
        "MHA head slicing, attention TP 8 -> 2, 8 KV heads, prefill rank 5 -> decode rank 1, 48 layers, page 64, one 32k-token chunk.",
    );
    s.engine_rank = 5;
    s.attn_tp_size = 8;
    s.page_size = page_size;
    s.kv_head_num = 1;
    s.total_kv_head_num = 8;
    s.kv_data_ptrs = ptrs(SRC_BASE, 2 * layers);
    s.kv_item_lens = vec![page_size * head; 2 * layers];
    s.dst_kv_ptrs = ptrs(DST_BASE, 2 * layers);
    s.dst_tp_rank = 1;
    s.dst_attn_tp_size = 2;
    s.dst_kv_item_len = page_size * 4 * head;
    s.prefill_kv_indices = segmented_pages(&mut rng, pages, 16, 64, 1 << 16);
    s.dst_kv_indices = segmented_pages(&mut rng, pages, 1, 8, 1 << 16);
    s
}

fn mla_dcp4_draft() -> Scenario {
    let mut rng = Rng::new(0x5eed_0003);
    let page_size: u64 = 64;
    let tokens: u64 = 32_768;
    let dcp: u64 = 4;
    let width: u64 = 1152; // 576 bf16 per token
    let layers = 61;
    let vpages = (tokens / (page_size * dcp)) as usize;
    let mut s = base(
        LargeCase::MlaDcp4Draft.name(),
        "MLA (DeepSeek-like), 61 layers + 1 MTP draft entry, prefill DCP 1 -> decode DCP 4 (rank 1), page 64, one 32k-token chunk.",
    );
    s.is_mla_backend = true;
    s.page_size = page_size;
    s.num_draft_entries = 1;
    s.kv_data_ptrs = ptrs(SRC_BASE, layers + 1);
    s.kv_item_lens = vec![page_size * width; layers + 1];
    s.dst_kv_ptrs = ptrs(DST_BASE, layers + 1);
    let mut dst_lens = vec![page_size * width; layers];
    dst_lens.push(page_size * dcp * width);
    s.dst_kv_item_lens = dst_lens;
    s.dst_kv_item_len = page_size * width;
    s.dst_dcp_size = dcp;
    s.dst_dcp_rank = 1;
    s.prefill_kv_indices = segmented_pages(&mut rng, (tokens / page_size) as usize, 4, 32, 1 << 16);
    s.dst_kv_indices = segmented_pages(&mut rng, vpages, 1, 8, 1 << 14);
    s.num_kv_tokens = Some(tokens);
    s.decode_prefix_len = Some(0);
    s
}

fn mla_dsa_128k() -> Scenario {
    let mut rng = Rng::new(0x5eed_0004);
    let page_size: u64 = 64;
    let pages = (131_072 / page_size) as usize;
    let layers = 61;
    let mut s = base(
        LargeCase::MlaDsa128k.name(),
        "MLA, 61 layers, page 64, one 128k-token chunk, with a DSA indexer-K state (one page-indexed buffer per layer) indexed like the KV pages.",
    );
    s.is_mla_backend = true;
    s.page_size = page_size;
    s.kv_data_ptrs = ptrs(SRC_BASE, layers);
    s.kv_item_lens = vec![page_size * 656; layers];
    s.dst_kv_ptrs = ptrs(DST_BASE, layers);
    s.dst_kv_item_len = page_size * 656;
    s.prefill_kv_indices = segmented_pages(&mut rng, pages, 256, 1024, 1 << 16);
    s.dst_kv_indices = segmented_pages(&mut rng, pages, 1, 15, 1 << 16);
    s.state_types = vec!["dsa".to_owned()];
    s.state_data_ptrs = vec![ptrs(SRC_BASE + (1 << 40), layers)];
    s.state_item_lens = vec![vec![page_size * 132; layers]];
    s.dst_state_data_ptrs = vec![ptrs(DST_BASE + (1 << 40), layers)];
    s.dst_state_item_lens = vec![vec![page_size * 132; layers]];
    s.state_indices = Some(vec![Some(
        s.prefill_kv_indices.iter().map(|&p| i64::from(p)).collect(),
    )]);
    s.dst_state_indices = vec![s.dst_kv_indices.iter().map(|&p| i64::from(p)).collect()];
    s
}
