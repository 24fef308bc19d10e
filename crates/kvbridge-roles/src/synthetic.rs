//! Synthetic KV pools shaped like real models, filled with a pattern that
//! every byte's position determines, so a receiver can verify every byte it
//! got. The demo, the benches and the tests use these (feature
//! `synthetic`); production callers register their own pools.
//!
//! A byte's value derives from `(room, layer, K/V, token, global head,
//! byte)`, so a decode rank holding a different head slice (TP M→N), a
//! different PP split or different page numbers checks exactly the bytes it
//! should have received.

use kvbridge_mem::{HostBuffer, MemError};
use kvbridge_plan::PrefillLayout;
use kvbridge_plan::rng::{GOLDEN as STEP, mix};
use serde::{Deserialize, Serialize};

use crate::kv_args::KvArgs;

/// The shape of a model's KV cache.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ModelSpec {
    /// Preset name.
    pub name: String,
    /// Transformer layers.
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
}

impl ModelSpec {
    /// A Llama-3-8B-like MHA/GQA model: 32 layers, 8 KV heads of 128 bf16.
    pub fn llama3_8b() -> Self {
        Self {
            name: "llama3-8b".into(),
            layers: 32,
            kv_heads: 8,
            head_bytes: 128 * 2,
            mla: false,
            page_size: 16,
            aux_item_lens: vec![64, 1024],
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
        }
    }

    /// A preset by name (`llama3-8b`, `deepseek-v3`).
    pub fn preset(name: &str) -> Option<Self> {
        match name {
            "llama3-8b" | "llama" => Some(Self::llama3_8b()),
            "deepseek-v3" | "deepseek" | "mla" => Some(Self::deepseek_v3()),
            _ => None,
        }
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
        let tp = tp.max(1);
        if self.kv_heads >= tp {
            rank * (self.kv_heads / tp) + h
        } else {
            rank / (tp / self.kv_heads.max(1))
        }
    }

    /// Bytes of one page of one buffer on a rank at TP `tp`.
    pub fn item_len(&self, tp: u64) -> u64 {
        self.page_size * self.local_heads(tp) * self.head_bytes
    }

    /// KV bytes of one token across all layers, K and V, whole model.
    pub fn token_bytes(&self) -> u64 {
        let kv = if self.mla { 1 } else { 2 };
        self.layers * kv * self.kv_heads.max(1) * self.head_bytes
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
}

impl RankSpec {
    /// This stage's layers `[start, end)` of `layers`.
    pub fn layer_range(&self, layers: u64) -> (u64, u64) {
        let pp = self.pp_size.max(1);
        let per = layers / pp;
        let extra = layers % pp;
        let start = self.pp_rank * per + self.pp_rank.min(extra);
        let len = per + u64::from(self.pp_rank < extra);
        (start, start + len)
    }
}

/// Where a rank's pools live.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Placement {
    /// GPU for the KV buffers (`None`: host memory). Needs the `cuda` feature.
    pub device: Option<i32>,
    /// With a GPU: how many KV buffers (the first ones) stay in host memory
    /// anyway, so their blocks take the intra-node host path (`STATE_DATA`).
    pub host_kv_buffers: u64,
}

/// One pool buffer: host memory, or device memory filled and checked
/// through host staging copies.
#[derive(Debug)]
enum PoolBuf {
    Host(HostBuffer),
    #[cfg(feature = "cuda")]
    Device(kvbridge_mem::cuda::DeviceBuffer),
}

impl PoolBuf {
    fn new(len: u64, device: Option<i32>) -> Result<Self, MemError> {
        let len = usize::try_from(len).unwrap_or(usize::MAX);
        match device {
            None => Ok(PoolBuf::Host(HostBuffer::new_resident(len)?)),
            #[cfg(feature = "cuda")]
            Some(ordinal) => Ok(PoolBuf::Device(kvbridge_mem::cuda::DeviceBuffer::new(
                ordinal, len,
            )?)),
            #[cfg(not(feature = "cuda"))]
            Some(ordinal) => Err(MemError::Unsupported {
                kind: kvbridge_mem::MemoryKind::Device { ordinal },
            }),
        }
    }

    fn addr(&self) -> u64 {
        match self {
            PoolBuf::Host(b) => b.addr(),
            #[cfg(feature = "cuda")]
            PoolBuf::Device(b) => b.addr(),
        }
    }

    fn len(&self) -> usize {
        match self {
            PoolBuf::Host(b) => b.len(),
            #[cfg(feature = "cuda")]
            PoolBuf::Device(b) => b.len(),
        }
    }

    /// Copies `out.len()` bytes at `off` out; false when out of bounds or failed.
    fn read(&self, off: usize, out: &mut [u8]) -> bool {
        match self {
            PoolBuf::Host(b) => match b.as_slice().get(off..off + out.len()) {
                Some(src) => {
                    out.copy_from_slice(src);
                    true
                }
                None => false,
            },
            #[cfg(feature = "cuda")]
            PoolBuf::Device(b) => b.read(off, out).is_ok(),
        }
    }

    /// Copies `data` to `off`; false when out of bounds or failed.
    fn write(&mut self, off: usize, data: &[u8]) -> bool {
        match self {
            PoolBuf::Host(b) => match b.as_mut_slice().get_mut(off..off + data.len()) {
                Some(dst) => {
                    dst.copy_from_slice(data);
                    true
                }
                None => false,
            },
            #[cfg(feature = "cuda")]
            PoolBuf::Device(b) => b.write(off, data).is_ok(),
        }
    }
}

/// One rank's KV and aux pools (host memory, or KV in device memory).
#[derive(Debug)]
pub struct RankPools {
    model: ModelSpec,
    rank: RankSpec,
    pages: u64,
    aux_slots: u64,
    /// K buffers of this stage's layers, then V buffers (MLA: one per layer).
    kv: Vec<PoolBuf>,
    aux: Vec<PoolBuf>,
}

/// Bytes checked and bytes wrong in a verification.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Verified {
    /// Bytes compared.
    pub bytes: u64,
    /// Bytes that differed from the expected pattern.
    pub mismatched: u64,
}

impl std::ops::AddAssign for Verified {
    fn add_assign(&mut self, rhs: Self) {
        self.bytes += rhs.bytes;
        self.mismatched += rhs.mismatched;
    }
}

/// The first word of one head slice's pattern, from `(room, layer, kv, token, head)`.
fn slice_seed(room: u64, layer: u64, kv: u64, token: u64, head: u64) -> u64 {
    mix(room ^ mix((layer << 1 | kv) ^ mix(token.wrapping_mul(0x1_0000_0001) ^ (head << 40))))
}

/// The pattern of one head slice: words `seed + j * STEP`, little-endian.
fn slice_pattern(seed: u64, out: &mut [u8]) {
    for (j, chunk) in out.chunks_mut(8).enumerate() {
        let word = seed
            .wrapping_add((j as u64).wrapping_mul(STEP))
            .to_le_bytes();
        chunk.copy_from_slice(&word[..chunk.len()]);
    }
}

/// Bytes of `got` that differ from the pattern with `seed`.
fn slice_mismatches(seed: u64, got: &[u8]) -> u64 {
    let mut words = got.chunks_exact(8);
    let mut bad = 0u64;
    let mut j = 0u64;
    for w in &mut words {
        let want = seed.wrapping_add(j.wrapping_mul(STEP));
        let have = u64::from_le_bytes(w.try_into().unwrap_or([0; 8]));
        if have != want {
            bad += (have ^ want)
                .to_le_bytes()
                .iter()
                .filter(|b| **b != 0)
                .count() as u64;
        }
        j += 1;
    }
    let tail = words.remainder();
    if !tail.is_empty() {
        let want = seed.wrapping_add(j.wrapping_mul(STEP)).to_le_bytes();
        bad += tail.iter().zip(want).filter(|(a, b)| **a != *b).count() as u64;
    }
    bad
}

fn aux_pattern(room: u64, buffer: u64, out: &mut [u8]) {
    let base = mix(room.wrapping_mul(31) ^ buffer ^ 0xa0a0);
    for (j, chunk) in out.chunks_mut(8).enumerate() {
        let word = mix(base.wrapping_add(j as u64)).to_le_bytes();
        chunk.copy_from_slice(&word[..chunk.len()]);
    }
}

fn page_offset(page: i32, item: u64) -> Option<usize> {
    usize::try_from(u64::try_from(page).ok()?.checked_mul(item)?).ok()
}

impl RankPools {
    /// Allocates `pages` pages per KV buffer and `aux_slots` slots per aux
    /// buffer, in host memory.
    pub fn new(
        model: ModelSpec,
        rank: RankSpec,
        pages: u64,
        aux_slots: u64,
    ) -> Result<Self, MemError> {
        Self::with_placement(model, rank, pages, aux_slots, Placement::default())
    }

    /// Like [`RankPools::new`], with the KV buffers placed as `placement`
    /// says (aux buffers stay in host memory, as sglang's metadata buffers).
    pub fn with_placement(
        model: ModelSpec,
        rank: RankSpec,
        pages: u64,
        aux_slots: u64,
        placement: Placement,
    ) -> Result<Self, MemError> {
        let (start, end) = rank.layer_range(model.layers);
        let halves = if model.mla { 1 } else { 2 };
        let item = model.item_len(rank.tp_size);
        let kv = (0..halves * (end - start))
            .map(|b| {
                let device = placement.device.filter(|_| b >= placement.host_kv_buffers);
                PoolBuf::new(item * pages, device)
            })
            .collect::<Result<Vec<_>, _>>()?;
        let aux = model
            .aux_item_lens
            .iter()
            .map(|len| PoolBuf::new(len * aux_slots, None))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Self {
            model,
            rank,
            pages,
            aux_slots,
            kv,
            aux,
        })
    }

    /// Pages per KV buffer.
    pub fn pages(&self) -> u64 {
        self.pages
    }

    /// Aux slots per aux buffer.
    pub fn aux_slots(&self) -> u64 {
        self.aux_slots
    }

    /// The model.
    pub fn model(&self) -> &ModelSpec {
        &self.model
    }

    /// `(layer, kv)` of buffer `b`.
    fn buffer_layer(&self, b: usize) -> (u64, u64) {
        let (start, end) = self.rank.layer_range(self.model.layers);
        let n = end - start;
        let b = b as u64;
        if self.model.mla {
            (start + b, 0)
        } else {
            (start + b % n, b / n)
        }
    }

    /// The registration for these pools as sglang publishes a plain MHA/MLA
    /// pool: no layer ids, so PP stages pair by position (K/V halves or flat
    /// slicing from the stage's start layer).
    pub fn kv_args(&self) -> KvArgs {
        self.registration(false)
    }

    /// The registration with `kv_layer_ids` published (as sglang's hybrid
    /// pools do), so peers pair buffers by layer id; both sides must publish.
    pub fn kv_args_with_layer_ids(&self) -> KvArgs {
        self.registration(true)
    }

    fn registration(&self, publish_layer_ids: bool) -> KvArgs {
        let (start, end) = self.rank.layer_range(self.model.layers);
        let item = self.model.item_len(self.rank.tp_size);
        let mut layer_ids: Vec<i64> = Vec::new();
        if publish_layer_ids {
            layer_ids.extend((start..end).map(|l| l as i64));
            if !self.model.mla {
                layer_ids.extend((start..end).map(|l| l as i64));
            }
        }
        KvArgs {
            layout: PrefillLayout {
                engine_rank: self.rank.tp_rank,
                attn_tp_size: self.rank.tp_size,
                pp_size: self.rank.pp_size,
                page_size: self.model.page_size,
                is_mla_backend: self.model.mla,
                kv_data_ptrs: self.kv.iter().map(PoolBuf::addr).collect(),
                kv_item_lens: vec![item; self.kv.len()],
                kv_layer_ids: layer_ids,
                kv_head_num: self.model.local_heads(self.rank.tp_size),
                total_kv_head_num: if self.model.mla {
                    0
                } else {
                    self.model.kv_heads
                },
                prefill_start_layer: start,
                prefill_end_layer: Some(end),
                aux_data_ptrs: self.aux.iter().map(PoolBuf::addr).collect(),
                aux_item_lens: self.model.aux_item_lens.clone(),
                ..PrefillLayout::default()
            },
            kv_data_lens: self.kv.iter().map(|b| b.len() as u64).collect(),
            aux_data_lens: self.aux.iter().map(|b| b.len() as u64).collect(),
            state_data_lens: Vec::new(),
        }
    }

    /// Visits every page of the request in every buffer: `(buffer, byte
    /// offset of the page, index of the page in the request, layer, kv)`.
    fn for_each_page(&self, pages: &[i32], mut f: impl FnMut(usize, usize, u64, u64, u64)) {
        let item = self.model.item_len(self.rank.tp_size);
        for b in 0..self.kv.len() {
            let (layer, kv) = self.buffer_layer(b);
            for (k, &page) in pages.iter().enumerate() {
                if let Some(base) = page_offset(page, item) {
                    f(b, base, k as u64, layer, kv);
                }
            }
        }
    }

    /// Visits every head slice of page `k` of a request: `(offset in the
    /// page, token, global head)`.
    fn for_each_slice(&self, k: u64, mut f: impl FnMut(usize, u64, u64)) {
        let tp = self.rank.tp_size;
        let heads = self.model.local_heads(tp);
        let hb = self.model.head_bytes;
        for slot in 0..self.model.page_size {
            let token = k * self.model.page_size + slot;
            for h in 0..heads {
                let off = ((slot * heads + h) * hb) as usize;
                f(off, token, self.model.global_head(tp, self.rank.tp_rank, h));
            }
        }
    }

    /// Writes the request's pattern into its pages and aux slot.
    pub fn fill(&mut self, room: u64, pages: &[i32], aux_slot: u64) {
        let hb = self.model.head_bytes as usize;
        let item = self.model.item_len(self.rank.tp_size) as usize;
        let mut stage = vec![0u8; item];
        let mut writes = Vec::new();
        self.for_each_page(pages, |b, base, k, layer, kv| {
            writes.push((b, base, k, layer, kv))
        });
        for (b, base, k, layer, kv) in writes {
            self.for_each_slice(k, |off, token, head| {
                if let Some(dst) = stage.get_mut(off..off + hb) {
                    slice_pattern(slice_seed(room, layer, kv, token, head), dst);
                }
            });
            self.kv[b].write(base, &stage);
        }
        for (i, len) in self.model.aux_item_lens.clone().into_iter().enumerate() {
            let mut slot = vec![0u8; len as usize];
            aux_pattern(room, i as u64, &mut slot);
            self.aux[i].write((aux_slot * len) as usize, &slot);
        }
    }

    /// Checks every byte of the request's pages and aux slot.
    pub fn verify(&self, room: u64, pages: &[i32], aux_slot: u64) -> Verified {
        let mut v = self.verify_kv(room, pages);
        v += self.verify_aux(room, aux_slot);
        v
    }

    /// Checks every byte of the request's pages.
    pub fn verify_kv(&self, room: u64, pages: &[i32]) -> Verified {
        let hb = self.model.head_bytes as usize;
        let item = self.model.item_len(self.rank.tp_size) as usize;
        let mut stage = vec![0u8; item];
        let mut v = Verified::default();
        self.for_each_page(pages, |b, base, k, layer, kv| {
            if !self.kv[b].read(base, &mut stage) {
                v.mismatched += item as u64;
                return;
            }
            self.for_each_slice(k, |off, token, head| match stage.get(off..off + hb) {
                Some(got) => {
                    v.bytes += hb as u64;
                    v.mismatched += slice_mismatches(slice_seed(room, layer, kv, token, head), got);
                }
                None => v.mismatched += hb as u64,
            });
        });
        v
    }

    /// Checks every byte of the request's aux slot.
    pub fn verify_aux(&self, room: u64, aux_slot: u64) -> Verified {
        let mut v = Verified::default();
        for (i, len) in self.model.aux_item_lens.iter().enumerate() {
            let mut want = vec![0u8; *len as usize];
            aux_pattern(room, i as u64, &mut want);
            let mut got = vec![0u8; *len as usize];
            if self.aux[i].read((aux_slot * len) as usize, &mut got) {
                v.bytes += *len;
                v.mismatched += got.iter().zip(&want).filter(|(a, b)| a != b).count() as u64;
            } else {
                v.mismatched += *len;
            }
        }
        v
    }

    /// Overwrites the request's pages with `byte` (e.g. after an abort, to
    /// detect any late write).
    pub fn poison(&mut self, pages: &[i32], byte: u8) {
        let item = self.model.item_len(self.rank.tp_size);
        let fill = vec![byte; item as usize];
        for buf in &mut self.kv {
            for &page in pages {
                if let Some(off) = page_offset(page, item) {
                    buf.write(off, &fill);
                }
            }
        }
    }

    /// Whether the request's pages still hold only `byte`.
    pub fn still_poisoned(&self, pages: &[i32], byte: u8) -> bool {
        let item = self.model.item_len(self.rank.tp_size);
        let mut stage = vec![0u8; item as usize];
        self.kv.iter().all(|buf| {
            pages.iter().all(|&page| {
                page_offset(page, item).is_some_and(|off| buf.read(off, &mut stage))
                    && stage.iter().all(|b| *b == byte)
            })
        })
    }

    /// Bytes of every KV buffer (for sizing checks).
    pub fn kv_bytes(&self) -> u64 {
        self.kv.iter().map(|b| b.len() as u64).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rank(tp_size: u64, tp_rank: u64) -> RankSpec {
        RankSpec {
            tp_size,
            tp_rank,
            pp_size: 1,
            pp_rank: 0,
        }
    }

    #[test]
    fn pp_stages_cover_every_layer_once() {
        let ranges: Vec<_> = (0..3)
            .map(|r| {
                RankSpec {
                    pp_size: 3,
                    pp_rank: r,
                    ..rank(1, 0)
                }
                .layer_range(61)
            })
            .collect();
        assert_eq!(ranges, vec![(0, 21), (21, 41), (41, 61)]);
    }

    #[test]
    fn gqa_heads_replicate() {
        let m = ModelSpec::llama3_8b();
        assert_eq!(m.local_heads(16), 1);
        assert_eq!(m.global_head(16, 5, 0), 2);
        assert_eq!(m.global_head(2, 1, 3), 7);
    }

    #[test]
    fn fill_then_verify_and_detect_corruption() {
        let mut m = ModelSpec::llama3_8b();
        m.layers = 2;
        let mut p = RankPools::new(m, rank(2, 1), 8, 2).unwrap();
        p.fill(42, &[3, 5], 1);
        let v = p.verify(42, &[3, 5], 1);
        assert_eq!(v.mismatched, 0);
        assert_eq!(v.bytes, 2 * 2 * 2 * 16 * 4 * 256 + 64 + 1024);
        assert!(p.verify(43, &[3, 5], 1).mismatched > 0);
        p.poison(&[5], 0xee);
        assert!(p.still_poisoned(&[5], 0xee));
        assert!(p.verify(42, &[3, 5], 1).mismatched > 0);
    }
}
