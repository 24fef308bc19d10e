//! Builders shared by the rule and property tests.
#![allow(dead_code)]

use kvbridge_plan::{
    Block, PeerRegistration, PlanError, PrefillLayout, StateComponent, StateType, TransferChunk,
    TransferRequest, canonicalize, plan_once,
};

/// Prefill buffer bases: 1 GiB apart.
pub const S: u64 = 0x7f00_0000_0000;
/// Decode buffer bases.
pub const D: u64 = 0x3e00_0000_0000;
/// Spacing of buffers.
pub const GIB: u64 = 1 << 30;

pub fn ptrs(base: u64, n: usize) -> Vec<u64> {
    (0..n as u64).map(|k| base + k * GIB).collect()
}

/// MHA: `layers` K buffers then `layers` V buffers, `item` bytes per page.
pub fn mha(layers: usize, page_size: u64, item: u64) -> PrefillLayout {
    PrefillLayout {
        page_size,
        kv_data_ptrs: ptrs(S, 2 * layers),
        kv_item_lens: vec![item; 2 * layers],
        ..PrefillLayout::default()
    }
}

/// MLA: one buffer per layer.
pub fn mla(layers: usize, page_size: u64, item: u64) -> PrefillLayout {
    PrefillLayout {
        page_size,
        is_mla_backend: true,
        kv_data_ptrs: ptrs(S, layers),
        kv_item_lens: vec![item; layers],
        ..PrefillLayout::default()
    }
}

pub fn peer(n: usize, item: u64) -> PeerRegistration {
    PeerRegistration {
        dst_kv_ptrs: ptrs(D, n),
        dst_kv_item_len: item,
        ..PeerRegistration::default()
    }
}

pub fn request(pages: &[i32]) -> TransferRequest {
    TransferRequest {
        dst_kv_indices: pages.to_vec(),
        ..TransferRequest::default()
    }
}

pub fn chunk(pages: &[i32]) -> TransferChunk {
    TransferChunk {
        prefill_kv_indices: pages.to_vec(),
        ..TransferChunk::default()
    }
}

/// Plans and returns the canonical blocks.
pub fn plan(
    layout: &PrefillLayout,
    reg: &PeerRegistration,
    req: &TransferRequest,
    ch: &TransferChunk,
) -> Result<Vec<Block>, PlanError> {
    plan_once(layout, reg.clone(), req, ch).map(|p| p.canonical())
}

pub fn b(src: u64, dst: u64, len: u64) -> Block {
    Block::new(src, dst, len)
}

pub fn canon(v: Vec<Block>) -> Vec<Block> {
    canonicalize(&v)
}

/// Adds a state component to `layout` / `reg` / `req` / `ch`.
#[allow(clippy::too_many_arguments)]
pub fn add_state(
    layout: &mut PrefillLayout,
    reg: &mut PeerRegistration,
    req: &mut TransferRequest,
    ch: &mut TransferChunk,
    comp: StateComponent,
    dst_ptrs: Vec<u64>,
    dst_lens: Vec<u64>,
    src_idx: Option<Vec<i64>>,
    dst_idx: Vec<i64>,
) {
    let i = layout.states.len();
    layout.states.push(comp);
    for v in [&mut reg.dst_state_data_ptrs, &mut reg.dst_state_item_lens] {
        v.resize(i, Vec::new());
    }
    reg.dst_state_data_ptrs.push(dst_ptrs);
    reg.dst_state_item_lens.push(dst_lens);
    req.dst_state_indices.resize(i, Vec::new());
    req.dst_state_indices.push(dst_idx);
    let si = ch.state_indices.get_or_insert_with(Vec::new);
    si.resize(i, None);
    si.push(src_idx);
}

pub fn state(t: StateType, n: usize, item: u64) -> StateComponent {
    StateComponent::new(t, ptrs(S + (1 << 42), n), vec![item; n])
}

pub const SD: u64 = D + (1 << 42);
pub const SS: u64 = S + (1 << 42);
