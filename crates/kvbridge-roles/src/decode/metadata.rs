//! Telling the room's prefill ranks where its KV goes (sglang's
//! `send_metadata`): pages, aux slot, state slots, and for a HiSparse decode
//! a second (device) page space.

use std::time::Instant;

use kvbridge_wire::{KvPoll, PackedArray, PackedLists, Transfer, TransferPages};

use super::receiver::KvReceiver;
use super::slots::RoomSlots;
use crate::stage::{self, Stage};

impl KvReceiver {
    /// Tells every prefill rank where the room's KV goes.
    pub fn send_metadata(
        &mut self,
        kv_indices: &[i32],
        aux_index: u64,
        state_indices: &[Vec<i32>],
        decode_prefix_len: Option<u64>,
    ) -> KvPoll {
        self.send_destinations(
            kv_indices,
            None,
            aux_index,
            state_indices,
            decode_prefix_len,
        )
    }

    /// [`KvReceiver::send_metadata`] for a HiSparse decode of a
    /// compressed-MLA pool: `host_kv_indices` are the pages of its C4 KV
    /// buffers (host memory), `device_kv_indices` the request's pages in
    /// every other KV buffer. On a pool without compression ratios the room
    /// fails, naming the reason: no prefill could place those pages.
    pub fn send_metadata_hisparse(
        &mut self,
        host_kv_indices: &[i32],
        device_kv_indices: &[i32],
        aux_index: u64,
        state_indices: &[Vec<i32>],
        decode_prefix_len: Option<u64>,
    ) -> KvPoll {
        self.send_destinations(
            host_kv_indices,
            Some(device_kv_indices),
            aux_index,
            state_indices,
            decode_prefix_len,
        )
    }

    fn send_destinations(
        &mut self,
        kv_indices: &[i32],
        device_kv_indices: Option<&[i32]>,
        aux_index: u64,
        state_indices: &[Vec<i32>],
        decode_prefix_len: Option<u64>,
    ) -> KvPoll {
        let _span = tracing::debug_span!("room", room = self.room, side = "decode").entered();
        if device_kv_indices.is_some()
            && self.shared.kv_args.layout.mla_compression_ratios.is_none()
        {
            self.shared.metrics.failure("unsupported_destination");
            return self.fail(format!(
                "room {}: HiSparse device destinations (dst_device_kv_indices) need a \
                 compressed-MLA (DeepSeek-V4) KV pool, but this decode's pool has no \
                 mla_compression_ratios",
                self.room
            ));
        }
        let Some(infos) = self.infos.clone() else {
            return self.fail(format!(
                "Could not fetch prefill parallel info from bootstrap_addr: {}",
                self.bootstrap_addr
            ));
        };
        // The room may receive into either page space (HiSparse).
        let mut pages = kv_indices.to_vec();
        pages.extend_from_slice(device_kv_indices.unwrap_or(&[]));
        self.shared.step(super::room::Input::Asked {
            room: self.room,
            slots: RoomSlots::new(&pages, aux_index, state_indices),
        });
        if let Some(m) = &self.mapping {
            let prefills = infos
                .iter()
                .filter(|i| !i.is_dummy)
                .map(|i| (i.pp_rank, i.endpoint()))
                .collect();
            super::staging::register_room(
                &self.shared,
                self.room,
                kv_indices,
                (m.prefill_attn_tp_size, m.target_pp_ranks.len() as u64),
                prefills,
            );
        }
        let required = self.mapping.as_ref().map_or(1, |m| m.required_dst_info_num);
        let session = self.shared.engine.session_id().to_owned();
        for info in &infos {
            let message = Transfer {
                room: self.room,
                endpoint: self.shared.config.local_ip.as_str().into(),
                dst_port: self.shared.rank_port,
                mooncake_session_id: session.as_str().into(),
                pages: (!info.is_dummy).then(|| TransferPages {
                    dst_kv_indices: PackedArray::from(kv_indices),
                    dst_aux_index: aux_index,
                    dst_state_indices: PackedLists::from_lists(state_indices),
                    dst_device_kv_indices: device_kv_indices.map(PackedArray::from),
                }),
                required_dst_info_num: required,
                decode_prefix_len: Some(decode_prefix_len.unwrap_or(0)),
            };
            if let Err(e) = self.shared.send_sealed(&info.endpoint(), message.encode()) {
                self.invalidate_cache();
                return self.fail(format!(
                    "send_metadata to prefill {}:{} failed: {e}",
                    info.rank_ip, info.rank_port
                ));
            }
        }
        self.init_time = Some(Instant::now());
        stage::mark(self.room, Stage::DestSent);
        self.poll()
    }
}
