//! One rank's pools: KV buffers (target and draft layers of its PP stage,
//! DCP-compacted on a decode DCP rank), aux slots and state components,
//! filled with the verifiable pattern and checked byte by byte.

use kvbridge_plan::PrefillLayout;

use super::buf::PoolBuf;
use super::model::{ModelSpec, Placement, RankSpec};
use super::pattern::{Verified, aux_pattern, item_offset, slice_pattern, slice_seed};
use super::states::StatePool;
use super::{PoolError, RequestSlots};
use crate::kv_args::KvArgs;

/// One KV buffer: the layer it holds, K (0) or V (1), and its page bytes.
#[derive(Debug)]
struct KvBuf {
    layer: u64,
    kv: u64,
    draft: bool,
    item: u64,
    /// Compressed-MLA group (0 C4 KV, 1 C4 indexer, 2 C128 KV): the page
    /// is one pattern of `item` bytes.
    group: Option<u64>,
    /// Addressed by HiSparse host page numbers.
    host_pages: bool,
    mem: PoolBuf,
}

impl KvBuf {
    /// The page of this buffer that holds a request's page `page`, in a
    /// pool of `pool_pages` pages.
    fn page_of(&self, pool_pages: u64, page: i32) -> i32 {
        if self.host_pages {
            host_page(pool_pages, page)
        } else {
            page
        }
    }
}

/// A HiSparse host page number: the pool's pages mirrored, so that they
/// differ from the device page numbers.
fn host_page(pool_pages: u64, page: i32) -> i32 {
    i32::try_from(pool_pages).unwrap_or(i32::MAX) - 1 - page
}

/// One rank's KV, aux and state pools (host memory, or on a GPU).
#[derive(Debug)]
pub struct RankPools {
    model: ModelSpec,
    rank: RankSpec,
    pages: u64,
    aux_slots: u64,
    /// Target K buffers of this stage's attention layers, then V (MLA: one
    /// per layer); then the draft layers' on the last stage.
    kv: Vec<KvBuf>,
    aux: Vec<PoolBuf>,
    states: Vec<StatePool>,
    hisparse: bool,
}

impl RankPools {
    /// Allocates `pages` pages per KV and page-state buffer and `aux_slots`
    /// slots per aux, slot-state and ring buffer, in host memory.
    pub fn new(
        model: ModelSpec,
        rank: RankSpec,
        pages: u64,
        aux_slots: u64,
    ) -> Result<Self, PoolError> {
        Self::with_placement(model, rank, pages, aux_slots, Placement::default())
    }

    /// Like [`RankPools::new`], with the KV and state buffers placed as
    /// `placement` says (aux buffers stay in host memory, as sglang's
    /// metadata buffers).
    pub fn with_placement(
        model: ModelSpec,
        rank: RankSpec,
        pages: u64,
        aux_slots: u64,
        placement: Placement,
    ) -> Result<Self, PoolError> {
        model.validate(rank.tp_size).map_err(PoolError::Model)?;
        let dcp = rank.dcp_size.max(1);
        if dcp > 1 && !model.mla {
            return Err(PoolError::Model(
                "decode context parallelism needs an MLA model".into(),
            ));
        }
        if dcp > 1 && model.compressed.is_some() {
            return Err(PoolError::Model(
                "decode context parallelism with a compressed-MLA pool is not modelled".into(),
            ));
        }
        if dcp > 1 && !model.states.is_empty() {
            return Err(PoolError::Model(
                "decode context parallelism with state components is not modelled".into(),
            ));
        }
        let (start, end) = rank.layer_range(model.layers);
        let target: Vec<u64> = (start..end).filter(|&l| model.is_kv_layer(l)).collect();
        let draft: Vec<u64> = if rank.is_last_stage() {
            (model.layers..model.layers + model.draft_layers).collect()
        } else {
            Vec::new()
        };
        let item = model.item_len(rank.tp_size);
        let halves = if model.mla { 1 } else { 2 };
        let mut plan = Vec::new();
        if let Some(c) = &model.compressed {
            for (layer, group, item) in c.buffers(start, end) {
                plan.push((layer, 0, false, item, Some(group)));
            }
        } else {
            for (layers, is_draft) in [(&target, false), (&draft, true)] {
                for kv in 0..halves {
                    for &layer in layers {
                        // A DCP rank's draft pages are virtual: every token of
                        // `page_size * dcp_size`.
                        let item = if is_draft { item * dcp } else { item };
                        plan.push((layer, kv, is_draft, item, None));
                    }
                }
            }
        }
        if placement.hisparse && model.compressed.is_none() {
            return Err(PoolError::Model(
                "HiSparse destinations need a compressed-MLA model".into(),
            ));
        }
        let kv = plan
            .into_iter()
            .enumerate()
            .map(|(b, (layer, kv, draft, item, group))| {
                // HiSparse keeps the C4 KV in host memory, its own pages.
                let host_pages = placement.hisparse && group == Some(0);
                let device = placement
                    .device
                    .filter(|_| b as u64 >= placement.host_kv_buffers && !host_pages);
                Ok(KvBuf {
                    layer,
                    kv,
                    draft,
                    item,
                    group,
                    host_pages,
                    mem: PoolBuf::new(item * pages, device)?,
                })
            })
            .collect::<Result<Vec<_>, PoolError>>()?;
        let aux = model
            .aux_item_lens
            .iter()
            .map(|len| PoolBuf::new(len * aux_slots, None))
            .collect::<Result<Vec<_>, _>>()?;
        let states = model
            .states
            .iter()
            .enumerate()
            .map(|(c, spec)| {
                StatePool::new(
                    c as u64,
                    spec,
                    &model,
                    rank,
                    pages,
                    aux_slots,
                    placement.device,
                )
            })
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Self {
            model,
            rank,
            pages,
            aux_slots,
            kv,
            aux,
            states,
            hisparse: placement.hisparse,
        })
    }

    /// A HiSparse decode's pages of its C4 KV buffers for a request on
    /// `pages` (its own numbering, mirrored so that they differ); `None`
    /// when these pools are not HiSparse.
    pub fn hisparse_host_pages(&self, pages: &[i32]) -> Option<Vec<i32>> {
        self.hisparse
            .then(|| pages.iter().map(|&p| host_page(self.pages, p)).collect())
    }

    /// Pages per KV buffer.
    pub fn pages(&self) -> u64 {
        self.pages
    }

    /// Aux slots per aux buffer (also the rows of slot and ring states).
    pub fn aux_slots(&self) -> u64 {
        self.aux_slots
    }

    /// The model.
    pub fn model(&self) -> &ModelSpec {
        &self.model
    }

    /// Pages a request of `tokens` tokens takes here (a DCP rank's pages
    /// are virtual: `page_size * dcp_size` tokens each).
    pub fn pages_for(&self, tokens: u64) -> u64 {
        tokens.div_ceil((self.model.page_size * self.rank.dcp_size.max(1)).max(1))
    }

    /// The registration for these pools as sglang publishes a plain MHA/MLA
    /// pool: no KV layer ids, so PP stages pair by position (K/V halves or
    /// flat slicing from the stage's start layer). State components always
    /// carry their layer ids, as sglang's hybrid pools publish them.
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
        // Compressed pools publish no layer ids (sglang's DeepSeek-V4 pool).
        let layer_ids = if publish_layer_ids && self.model.compressed.is_none() {
            self.kv.iter().map(|b| b.layer as i64).collect()
        } else {
            Vec::new()
        };
        KvArgs {
            layout: PrefillLayout {
                engine_rank: self.rank.tp_rank,
                attn_tp_size: self.rank.tp_size,
                pp_size: self.rank.pp_size,
                dcp_size: self.rank.dcp_size.max(1),
                dcp_rank: self.rank.dcp_rank,
                page_size: self.model.page_size,
                is_mla_backend: self.model.mla,
                kv_data_ptrs: self.kv.iter().map(|b| b.mem.addr()).collect(),
                kv_item_lens: self.kv.iter().map(|b| b.item).collect(),
                kv_layer_ids: layer_ids,
                kv_head_num: self.model.local_heads(self.rank.tp_size),
                total_kv_head_num: if self.model.mla {
                    0
                } else {
                    self.model.kv_heads
                },
                num_draft_entries: self.kv.iter().filter(|b| b.draft).count() as u64,
                prefill_start_layer: start,
                prefill_end_layer: Some(end),
                aux_data_ptrs: self.aux.iter().map(PoolBuf::addr).collect(),
                aux_item_lens: self.model.aux_item_lens.clone(),
                states: self.states.iter().map(StatePool::component).collect(),
                mla_compression_ratios: self.model.compressed.as_ref().map(|c| c.ratios.clone()),
                // sglang's SWA sub-pool layout: NHD pages, as the pattern writes them.
                swa_kv_cache_layout: self
                    .states
                    .iter()
                    .any(StatePool::is_swa)
                    .then(|| "nhd".to_owned()),
                ..PrefillLayout::default()
            },
            kv_data_lens: self.kv.iter().map(|b| b.mem.len() as u64).collect(),
            aux_data_lens: self.aux.iter().map(|b| b.len() as u64).collect(),
            state_data_lens: self.states.iter().map(StatePool::data_lens).collect(),
        }
    }

    /// The request's index list per state component, as sglang's
    /// `state_indices` / `dst_state_indices`.
    pub fn state_indices(&self, req: &RequestSlots) -> Vec<Vec<i64>> {
        self.states.iter().map(|s| s.indices(req)).collect()
    }

    /// [`RankPools::state_indices`] as a decode sends them (`int32`).
    pub fn dst_state_indices(&self, req: &RequestSlots) -> Vec<Vec<i32>> {
        self.state_indices(req)
            .iter()
            .map(|v| {
                v.iter()
                    .map(|&i| i32::try_from(i).unwrap_or(i32::MAX))
                    .collect()
            })
            .collect()
    }

    /// A request that fills `pages` whole pages and uses slot `aux_slot`.
    fn whole_pages(&self, pages: &[i32], aux_slot: u64) -> RequestSlots {
        RequestSlots {
            tokens: pages.len() as u64 * self.model.page_size,
            pages: pages.to_vec(),
            slot: aux_slot,
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

    /// Writes the request's pattern into its pages and aux slot (whole
    /// pages of `page_size` tokens).
    pub fn fill(&mut self, room: u64, pages: &[i32], aux_slot: u64) {
        let req = self.whole_pages(pages, aux_slot);
        self.fill_request(room, &req);
    }

    /// Writes the request's pattern into its pages, aux slot and states.
    pub fn fill_request(&mut self, room: u64, req: &RequestSlots) {
        let hb = self.model.head_bytes as usize;
        let mut writes = Vec::new();
        for (b, buf) in self.kv.iter().enumerate() {
            let mut stage = vec![0u8; buf.item as usize];
            for (k, &page) in req.pages.iter().enumerate() {
                match buf.group {
                    Some(g) => {
                        let seed = slice_seed(room, buf.layer, 2 + g, k as u64, 0);
                        slice_pattern(seed, &mut stage);
                    }
                    None => self.for_each_slice(k as u64, |off, token, head| {
                        if let Some(dst) = stage.get_mut(off..off + hb) {
                            slice_pattern(slice_seed(room, buf.layer, buf.kv, token, head), dst);
                        }
                    }),
                }
                writes.push((b, buf.page_of(self.pages, page), stage.clone()));
            }
        }
        for (b, page, data) in writes {
            let buf = &mut self.kv[b];
            if let Some(off) = item_offset(i64::from(page), buf.item) {
                buf.mem.write(off, &data);
            }
        }
        for (i, len) in self.model.aux_item_lens.clone().into_iter().enumerate() {
            let mut slot = vec![0u8; len as usize];
            aux_pattern(room, i as u64, &mut slot);
            self.aux[i].write((req.slot * len) as usize, &slot);
        }
        for s in &mut self.states {
            s.fill(room, req);
        }
    }

    /// Checks every byte of the request's pages and aux slot (whole pages).
    pub fn verify(&self, room: u64, pages: &[i32], aux_slot: u64) -> Verified {
        self.verify_request(room, &self.whole_pages(pages, aux_slot))
    }

    /// Checks every byte the request should have received: KV, aux, states.
    pub fn verify_request(&self, room: u64, req: &RequestSlots) -> Verified {
        let mut v = if self.rank.dcp_size > 1 {
            self.verify_dcp(room, req)
        } else {
            self.verify_kv(room, &req.pages)
        };
        v += self.verify_aux(room, req.slot);
        for s in &self.states {
            v += s.verify(room, req);
        }
        v
    }

    /// Checks every byte of the request's pages.
    pub fn verify_kv(&self, room: u64, pages: &[i32]) -> Verified {
        let hb = self.model.head_bytes as usize;
        let mut v = Verified::default();
        for buf in &self.kv {
            let mut stage = vec![0u8; buf.item as usize];
            for (k, &page) in pages.iter().enumerate() {
                let page = buf.page_of(self.pages, page);
                let read = item_offset(i64::from(page), buf.item)
                    .is_some_and(|off| buf.mem.read(off, &mut stage));
                if let Some(g) = buf.group {
                    let seed = slice_seed(room, buf.layer, 2 + g, k as u64, 0);
                    v.check(seed, read.then_some(stage.as_slice()), stage.len());
                    continue;
                }
                self.for_each_slice(k as u64, |off, token, head| {
                    let got = if read { stage.get(off..off + hb) } else { None };
                    v.check(slice_seed(room, buf.layer, buf.kv, token, head), got, hb);
                });
            }
        }
        v
    }

    /// A DCP rank's check: target layers hold the tokens `t` with
    /// `t % dcp_size == dcp_rank`, compacted into pages of `page_size`
    /// tokens; draft layers hold every token in virtual pages.
    fn verify_dcp(&self, room: u64, req: &RequestSlots) -> Verified {
        let (dcp, rank) = (self.rank.dcp_size, self.rank.dcp_rank);
        let width = self.model.local_heads(self.rank.tp_size) * self.model.head_bytes;
        let w = width as usize;
        let mut v = Verified::default();
        for buf in &self.kv {
            let per_page = buf.item / width.max(1);
            let tokens: Vec<(u64, u64)> = (0..req.tokens)
                .filter(|t| buf.draft || t % dcp == rank)
                .map(|t| (t, if buf.draft { t } else { t / dcp }))
                .collect();
            let mut stage = vec![0u8; buf.item as usize];
            let mut loaded: Option<(usize, bool)> = None;
            for (t, local) in tokens {
                let k = (local / per_page.max(1)) as usize;
                if loaded.map(|l| l.0) != Some(k) {
                    let read = req.pages.get(k).is_some_and(|&p| {
                        item_offset(i64::from(p), buf.item)
                            .is_some_and(|off| buf.mem.read(off, &mut stage))
                    });
                    loaded = Some((k, read));
                }
                let off = ((local % per_page.max(1)) * width) as usize;
                let got = if loaded.is_some_and(|l| l.1) {
                    stage.get(off..off + w)
                } else {
                    None
                };
                v.check(slice_seed(room, buf.layer, 0, t, 0), got, w);
            }
        }
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
        let pool_pages = self.pages;
        for buf in &mut self.kv {
            let fill = vec![byte; buf.item as usize];
            for &page in pages {
                let page = buf.page_of(pool_pages, page);
                if let Some(off) = item_offset(i64::from(page), buf.item) {
                    buf.mem.write(off, &fill);
                }
            }
        }
    }

    /// Whether the request's pages still hold only `byte`.
    pub fn still_poisoned(&self, pages: &[i32], byte: u8) -> bool {
        self.kv.iter().all(|buf| {
            let mut stage = vec![0u8; buf.item as usize];
            pages.iter().all(|&page| {
                let page = buf.page_of(self.pages, page);
                item_offset(i64::from(page), buf.item)
                    .is_some_and(|off| buf.mem.read(off, &mut stage))
                    && stage.iter().all(|b| *b == byte)
            })
        })
    }

    /// Overwrites aux slot `slot` of every aux buffer with `byte`.
    pub fn poison_aux(&mut self, slot: u64, byte: u8) {
        for (buf, len) in self.aux.iter_mut().zip(&self.model.aux_item_lens) {
            buf.write((slot * len) as usize, &vec![byte; *len as usize]);
        }
    }

    /// Whether aux slot `slot` of every aux buffer still holds only `byte`.
    pub fn aux_still_poisoned(&self, slot: u64, byte: u8) -> bool {
        self.aux
            .iter()
            .zip(&self.model.aux_item_lens)
            .all(|(buf, len)| {
                let mut got = vec![0u8; *len as usize];
                buf.read((slot * len) as usize, &mut got) && got.iter().all(|b| *b == byte)
            })
    }

    /// Bytes of every KV buffer (for sizing checks).
    pub fn kv_bytes(&self) -> u64 {
        self.kv.iter().map(|b| b.mem.len() as u64).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rank(tp_size: u64, tp_rank: u64) -> RankSpec {
        RankSpec {
            tp_size,
            tp_rank,
            ..RankSpec::default()
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
