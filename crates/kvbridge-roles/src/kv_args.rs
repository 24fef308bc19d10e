//! The memory a role registers (sglang's `KVArgs`): the planner's layout plus
//! the byte length of every buffer, validated before anything is registered.

use std::borrow::Cow;
use std::collections::HashSet;

use kvbridge_plan::PrefillLayout;
use kvbridge_wire::{PackedArray, PackedLists, Register};

use crate::error::ConfigError;

/// One rank's registered buffers and their layout.
///
/// `layout` holds what the planner reads (addresses, item sizes, layer ids,
/// state components, parallel sizes); decode ranks use the same fields to
/// describe themselves in their registration message.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct KvArgs {
    /// Addresses, item sizes, layer ids and parallel layout.
    pub layout: PrefillLayout,
    /// Byte length of each KV buffer (parallel to `layout.kv_data_ptrs`).
    pub kv_data_lens: Vec<u64>,
    /// Byte length of each aux buffer (parallel to `layout.aux_data_ptrs`).
    pub aux_data_lens: Vec<u64>,
    /// Byte length of each state buffer, per component.
    pub state_data_lens: Vec<Vec<u64>>,
}

fn same_len(what: &str, a: usize, b: usize) -> Result<(), ConfigError> {
    if a == b {
        Ok(())
    } else {
        Err(ConfigError::Layout(format!(
            "{what}: {a} pointers but {b} lengths"
        )))
    }
}

impl KvArgs {
    /// Checks that the lists agree and every item fits its buffer, so a bad
    /// layout fails at registration instead of corrupting a transfer.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let l = &self.layout;
        if l.page_size == 0 {
            return Err(ConfigError::Layout("page_size must be at least 1".into()));
        }
        if l.attn_tp_size == 0 || l.pp_size == 0 || l.dcp_size == 0 {
            return Err(ConfigError::Layout(
                "parallel sizes must be at least 1".into(),
            ));
        }
        let (kv, aux) = (l.kv_data_ptrs.len(), l.aux_data_ptrs.len());
        let mut pairs = vec![
            ("kv_item_lens", kv, l.kv_item_lens.len()),
            ("kv_data_lens", kv, self.kv_data_lens.len()),
            ("aux_item_lens", aux, l.aux_item_lens.len()),
            ("aux_data_lens", aux, self.aux_data_lens.len()),
            (
                "state_data_lens components",
                l.states.len(),
                self.state_data_lens.len(),
            ),
        ];
        if !l.kv_layer_ids.is_empty() {
            pairs.push(("kv_layer_ids", kv, l.kv_layer_ids.len()));
        }
        for (what, want, got) in pairs {
            same_len(what, want, got)?;
        }
        let items = l
            .kv_item_lens
            .iter()
            .zip(&self.kv_data_lens)
            .chain(l.aux_item_lens.iter().zip(&self.aux_data_lens));
        for (item, len) in items {
            if *item > *len {
                return Err(ConfigError::Layout(format!(
                    "an item of {item} bytes does not fit its {len}-byte buffer"
                )));
            }
        }
        for (i, (state, lens)) in l.states.iter().zip(&self.state_data_lens).enumerate() {
            same_len(
                &format!("state {i} item_lens"),
                state.data_ptrs.len(),
                state.item_lens.len(),
            )?;
            same_len(
                &format!("state {i} data_lens"),
                state.data_ptrs.len(),
                lens.len(),
            )?;
            if let Some((item, len)) = state.item_lens.iter().zip(lens).find(|(i, l)| i > l) {
                return Err(ConfigError::Layout(format!(
                    "state {i}: an item of {item} bytes does not fit its {len}-byte buffer"
                )));
            }
        }
        Ok(())
    }

    /// `(ptr, len)` of every buffer, exact duplicates once (the unified pool
    /// reports one buffer as both KV and state), in registration order.
    pub fn registerable_regions(&self) -> Vec<(u64, u64)> {
        let l = &self.layout;
        let mut seen = HashSet::new();
        let pairs = l
            .kv_data_ptrs
            .iter()
            .zip(&self.kv_data_lens)
            .chain(l.aux_data_ptrs.iter().zip(&self.aux_data_lens))
            .chain(
                l.states
                    .iter()
                    .zip(&self.state_data_lens)
                    .flat_map(|(s, lens)| s.data_ptrs.iter().zip(lens)),
            );
        pairs
            .map(|(p, n)| (*p, *n))
            .filter(|r| r.1 > 0 && seen.insert(*r))
            .collect()
    }

    /// Address ranges `[start, end)` peers may target (`STATE_DATA`, aux).
    pub fn transfer_regions(&self) -> Vec<(u64, u64)> {
        self.registerable_regions()
            .into_iter()
            .map(|(p, n)| (p, p.saturating_add(n)))
            .collect()
    }

    /// The decode side's `KVArgsRegisterInfo` message for these buffers,
    /// announcing the engine `incarnation` (0: none) that owns them.
    pub fn registration(
        &self,
        endpoint: &str,
        port: u16,
        session: &str,
        incarnation: u64,
    ) -> Register<'static> {
        let l = &self.layout;
        let u32s = |v: &[u64]| {
            v.iter()
                .map(|x| u32::try_from(*x).unwrap_or(u32::MAX))
                .collect::<Vec<u32>>()
        };
        let ids = |v: &[i64]| {
            v.iter()
                .map(|x| u32::try_from(*x).unwrap_or(u32::MAX))
                .collect::<Vec<u32>>()
        };
        Register {
            endpoint: Cow::Owned(endpoint.to_owned()),
            dst_port: port,
            mooncake_session_id: Cow::Owned(session.to_owned()),
            dst_kv_ptrs: PackedArray::from(l.kv_data_ptrs.as_slice()),
            dst_aux_ptrs: PackedArray::from(l.aux_data_ptrs.as_slice()),
            dst_state_data_ptrs: PackedLists::from_lists(
                &l.states
                    .iter()
                    .map(|s| s.data_ptrs.clone())
                    .collect::<Vec<_>>(),
            ),
            dst_tp_rank: l.engine_rank,
            dst_attn_tp_size: l.attn_tp_size,
            dst_kv_item_len: l.kv_item_lens.first().copied().unwrap_or(0),
            dst_state_item_lens: PackedLists::from_lists(
                &l.states
                    .iter()
                    .map(|s| u32s(&s.item_lens))
                    .collect::<Vec<_>>(),
            ),
            dst_state_dim_per_tensor: PackedLists::from_lists(
                &l.states
                    .iter()
                    .map(|s| u32s(&s.dim_per_tensor))
                    .collect::<Vec<_>>(),
            ),
            dst_kv_layer_ids: PackedArray::from(ids(&l.kv_layer_ids)),
            dst_state_layer_ids: PackedLists::from_lists(
                &l.states
                    .iter()
                    .map(|s| ids(&s.layer_ids))
                    .collect::<Vec<_>>(),
            ),
            staging_base_ptr: 0,
            staging_total_size: 0,
            dst_dcp_size: l.dcp_size,
            dst_dcp_rank: l.dcp_rank,
            staging_slot_layer_ids: PackedArray::empty(),
            dst_kv_item_lens: PackedArray::from(l.kv_item_lens.as_slice()),
            incarnation: (incarnation != 0).then_some(incarnation),
            pair_key: None,
            // This decode takes a room's aux slots in one message.
            aux_batch: true,
        }
    }
}

/// The planner's view of a registration message.
pub fn peer_registration(r: &Register<'_>) -> kvbridge_plan::PeerRegistration {
    let widen = |a: PackedArray<'_, u32>| a.iter().map(u64::from).collect::<Vec<u64>>();
    let ids = |a: PackedArray<'_, u32>| a.iter().map(i64::from).collect::<Vec<i64>>();
    kvbridge_plan::PeerRegistration {
        dst_kv_ptrs: r.dst_kv_ptrs.to_vec(),
        dst_aux_ptrs: r.dst_aux_ptrs.to_vec(),
        dst_state_data_ptrs: r.dst_state_data_ptrs.to_vecs(),
        dst_tp_rank: r.dst_tp_rank,
        dst_attn_tp_size: r.dst_attn_tp_size,
        dst_kv_item_len: r.dst_kv_item_len,
        dst_state_item_lens: r.dst_state_item_lens.iter().map(widen).collect(),
        dst_state_dim_per_tensor: r.dst_state_dim_per_tensor.iter().map(widen).collect(),
        dst_kv_layer_ids: ids(r.dst_kv_layer_ids.borrowed()),
        dst_state_layer_ids: r.dst_state_layer_ids.iter().map(ids).collect(),
        dst_dcp_size: r.dst_dcp_size,
        dst_dcp_rank: r.dst_dcp_rank,
        dst_kv_item_lens: r.dst_kv_item_lens.to_vec(),
    }
}

#[cfg(test)]
mod tests {
    use kvbridge_plan::{StateComponent, StateType};

    use super::*;

    fn args() -> KvArgs {
        KvArgs {
            layout: PrefillLayout {
                page_size: 16,
                kv_data_ptrs: vec![0x1000, 0x9000],
                kv_item_lens: vec![256, 256],
                aux_data_ptrs: vec![0x20000],
                aux_item_lens: vec![8],
                states: vec![StateComponent::new(
                    StateType::Mamba,
                    vec![0x1000],
                    vec![64],
                )],
                ..PrefillLayout::default()
            },
            kv_data_lens: vec![0x8000, 0x8000],
            aux_data_lens: vec![64],
            state_data_lens: vec![vec![0x8000]],
        }
    }

    #[test]
    fn duplicate_regions_register_once() {
        let a = args();
        a.validate().unwrap();
        assert_eq!(
            a.registerable_regions(),
            vec![(0x1000, 0x8000), (0x9000, 0x8000), (0x20000, 64)]
        );
    }

    #[test]
    fn mismatched_lists_fail_loudly() {
        let mut a = args();
        a.kv_data_lens.pop();
        assert!(a.validate().is_err());
        let mut a = args();
        a.aux_data_lens[0] = 4;
        assert!(a.validate().is_err());
    }

    #[test]
    fn registration_round_trips_into_the_planner_view() {
        let a = args();
        let reg = a.registration("10.0.0.1", 7000, "10.0.0.1:9000", 0);
        let peer = peer_registration(&reg);
        assert_eq!(peer.dst_kv_ptrs, vec![0x1000, 0x9000]);
        assert_eq!(peer.dst_kv_item_len, 256);
        assert_eq!(peer.dst_state_item_lens, vec![vec![64]]);
        assert_eq!(peer.dst_kv_item_lens, vec![256, 256]);
    }
}
