//! Peer registration (docs/plan-scenario.md §3.1): what can be decided once per
//! decode peer, before its first chunk.
//!
//! [`PreparedPeer::new`] does exactly what the reference's bootstrap thread
//! does when a `KVArgsRegisterInfo` arrives (DCP topology and token widths; a
//! failure there rejects the peer), and additionally precomputes the KV path
//! and its buffer pairing. Problems of the KV configuration that the reference
//! only reports when a chunk actually carries KV pages (layer pairing,
//! unified-memory envelope, head-slice width, DCP entry mapping) are kept and
//! returned by every such chunk; [`PreparedPeer::kv_config_error`] exposes them
//! up front so that a worker can fail loudly at registration.

use crate::dcp::{DcpRelayout, prepare_dcp};
use crate::error::PlanError;
use crate::head_slice::{HeadSlice, prepare_head_slice};
use crate::kv::{PageCopy, prepare_page_copy};
use crate::layout::{PeerRegistration, PrefillLayout};

/// How KV pages travel to this peer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum KvPath {
    /// Whole items per page run (MLA, hybrid MLA, or equal TP).
    PageCopy,
    /// Per-token head slices (MHA with different TP).
    HeadSlice,
    /// Token relayout into a DCP decode.
    DcpRelayout,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum KvMode {
    PageCopy(PageCopy),
    HeadSlice(HeadSlice),
    Dcp(DcpRelayout),
}

/// A decode peer's registration, validated and prepared against our layout.
///
/// Must be used with the [`PrefillLayout`] it was prepared with.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PreparedPeer {
    // Boxed: a prepared peer is stored per session, often inside enums.
    inner: Box<Prepared>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
struct Prepared {
    registration: PeerRegistration,
    dcp_token_item_lens: Option<Vec<u64>>,
    skip_kv: bool,
    has_kv: bool,
    path: KvPath,
    kv: Result<KvMode, PlanError>,
}

fn at_least_one(v: u64, field: &'static str) -> Result<(), PlanError> {
    if v == 0 {
        Err(PlanError::ZeroSize { field })
    } else {
        Ok(())
    }
}

impl PreparedPeer {
    /// Validates a registration against our layout (seed: bootstrap thread,
    /// `requires_dcp_relayout`, `prepare_dcp_token_item_lens`) and prepares
    /// the KV path. Errors here reject the peer.
    pub fn new(layout: &PrefillLayout, registration: PeerRegistration) -> Result<Self, PlanError> {
        at_least_one(layout.attn_tp_size, "attn_tp_size")?;
        at_least_one(layout.pp_size, "pp_size")?;
        at_least_one(layout.page_size, "page_size")?;
        at_least_one(registration.dst_attn_tp_size, "dst_attn_tp_size")?;
        let reg = registration;

        let relayout = if layout.dcp_size == reg.dst_dcp_size {
            if layout.dcp_rank != reg.dst_dcp_rank {
                return Err(PlanError::DcpRankMismatch {
                    prefill: layout.dcp_rank,
                    decode: reg.dst_dcp_rank,
                });
            }
            false
        } else if layout.dcp_size == 1 && reg.dst_dcp_size > 1 && layout.is_any_mla() {
            true
        } else {
            return Err(PlanError::UnsupportedDcpTopology {
                prefill: layout.dcp_size,
                decode: reg.dst_dcp_size,
            });
        };
        let dcp_token_item_lens = if relayout {
            Some(dcp_token_widths(layout, &reg)?)
        } else {
            None
        };

        let p = layout.attn_tp_size;
        let d = reg.dst_attn_tp_size;
        let skip_kv =
            layout.is_hybrid_mla_backend && p > d && !layout.attn_tp_rank().is_multiple_of(p / d);

        let (path, kv) = match &dcp_token_item_lens {
            Some(widths) => (
                KvPath::DcpRelayout,
                prepare_dcp(layout, &reg, widths).map(KvMode::Dcp),
            ),
            None if layout.is_any_mla() || p == d => (
                KvPath::PageCopy,
                prepare_page_copy(layout, &reg).map(KvMode::PageCopy),
            ),
            None => (
                KvPath::HeadSlice,
                prepare_head_slice(layout, &reg).map(KvMode::HeadSlice),
            ),
        };
        Ok(PreparedPeer {
            inner: Box::new(Prepared {
                registration: reg,
                dcp_token_item_lens,
                skip_kv,
                has_kv: !layout.kv_data_ptrs.is_empty(),
                path,
                kv,
            }),
        })
    }

    /// The registration as received.
    pub fn registration(&self) -> &PeerRegistration {
        &self.inner.registration
    }

    /// Whether KV goes through the DCP relayout.
    pub fn requires_dcp_relayout(&self) -> bool {
        self.inner.dcp_token_item_lens.is_some()
    }

    /// DCP relayout: bytes per token of every prefill KV entry.
    pub fn dcp_token_item_lens(&self) -> Option<&[u64]> {
        self.inner.dcp_token_item_lens.as_deref()
    }

    /// Whether this rank sends no KV to the peer (replicated hybrid-MLA KV:
    /// one writer per aggregation group); states and aux still go.
    pub fn skips_kv(&self) -> bool {
        self.inner.skip_kv
    }

    /// The prepared KV path (or the error a chunk with KV pages gets).
    pub(crate) fn kv_mode(&self) -> Result<&KvMode, PlanError> {
        self.inner.kv.as_ref().map_err(Clone::clone)
    }

    /// The KV path chosen for this peer.
    pub fn kv_path(&self) -> KvPath {
        self.inner.path
    }

    /// The first error any request to this peer would meet, found without a
    /// request: the KV configuration's, then each state component's.
    pub fn config_error(&self, layout: &PrefillLayout) -> Option<PlanError> {
        if let Some(e) = self.kv_config_error() {
            return Some(e.clone());
        }
        crate::state::check_states(layout, &self.inner.registration).err()
    }

    /// The error every chunk carrying KV pages will be rejected with, if the
    /// KV configuration is unusable (`None` when KV is fine, or never sent).
    pub fn kv_config_error(&self) -> Option<&PlanError> {
        if self.inner.skip_kv || !self.inner.has_kv {
            return None;
        }
        self.inner.kv.as_ref().err()
    }
}

/// `prepare_dcp_token_item_lens`: token widths of every entry; a target
/// entry whose width differs from the decode's is rejected.
fn dcp_token_widths(layout: &PrefillLayout, reg: &PeerRegistration) -> Result<Vec<u64>, PlanError> {
    let n = layout.kv_item_lens.len();
    let nd = layout.num_draft_entries;
    let nt = usize::try_from(nd)
        .ok()
        .and_then(|nd| n.checked_sub(nd))
        .ok_or(PlanError::DcpDraftEntries {
            entries: n,
            draft: nd,
        })?;
    let ps = layout.page_size;
    let widths: Vec<u64> = layout.kv_item_lens.iter().map(|l| l / ps).collect();
    let dst_width = reg.dst_kv_item_len / ps;
    for (entry, &w) in widths.iter().enumerate().take(nt) {
        if w != dst_width {
            return Err(PlanError::DcpTokenWidthMismatch {
                entry,
                src: w,
                dst: dst_width,
            });
        }
    }
    Ok(widths)
}
