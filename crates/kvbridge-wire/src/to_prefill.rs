//! Messages the decode side sends to a prefill rank's bootstrap socket.

use std::borrow::Cow;

use crate::codec::{
    FrameCursor, Frames, ascii, int_frame, parse_i64, parse_u64, parse_uint, text_frame,
};
use crate::error::DecodeError;
use crate::limits::Limits;
use crate::packed::{Element, PackedArray, PackedLists};
use crate::seal::PairKey;

/// First frame of a registration (`KVArgsRegisterInfo`): the text `None`.
pub const REGISTER_ROOM: &[u8] = b"None";
/// First frame of an abort notification.
pub const ABORT_TAG: &[u8] = b"ABORT";
/// First frame of a staging watermark report.
pub const WATERMARK_TAG: &[u8] = b"WATERMARK";
/// First frame of a staging allocation reply.
pub const STAGING_RSP_TAG: &[u8] = b"STAGING_RSP";

/// A decode rank's buffer registration (sglang `KVArgsRegisterInfo`), sent
/// once to every prefill rank it talks to.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Register<'a> {
    /// The decode rank's IP for status messages.
    pub endpoint: Cow<'a, str>,
    /// The decode rank's zmq PULL port.
    pub dst_port: u16,
    /// The decode rank's transfer-engine session (`host:port`).
    pub mooncake_session_id: Cow<'a, str>,
    /// Base address of every KV buffer.
    pub dst_kv_ptrs: PackedArray<'a, u64>,
    /// Base address of every aux buffer.
    pub dst_aux_ptrs: PackedArray<'a, u64>,
    /// Buffers of each state component.
    pub dst_state_data_ptrs: PackedLists<'a, u64>,
    /// The decode rank (`engine_rank`).
    pub dst_tp_rank: u64,
    /// The decode attention TP size.
    pub dst_attn_tp_size: u64,
    /// Bytes per page of the first KV buffer (0 when there is none).
    pub dst_kv_item_len: u64,
    /// Item sizes of each state component's buffers.
    pub dst_state_item_lens: PackedLists<'a, u32>,
    /// TP-sliced axis size of each state buffer (mamba).
    pub dst_state_dim_per_tensor: PackedLists<'a, u32>,
    /// Global layer id of every KV buffer.
    pub dst_kv_layer_ids: PackedArray<'a, u32>,
    /// Layer ids of each state component's buffers.
    pub dst_state_layer_ids: PackedLists<'a, u32>,
    /// Staging ring base address (0 = no staging).
    pub staging_base_ptr: u64,
    /// Staging ring size in bytes (0 = no staging).
    pub staging_total_size: u64,
    /// Decode context-parallel size.
    pub dst_dcp_size: u64,
    /// Decode context-parallel rank.
    pub dst_dcp_rank: u64,
    /// Layer id of each staging slot (all K, then all V).
    pub staging_slot_layer_ids: PackedArray<'a, u64>,
    /// Bytes per page of every KV buffer.
    pub dst_kv_item_lens: PackedArray<'a, u64>,
    /// kvbridge extension (trailing frame 20, `kvbridge-incarnation=<n>`,
    /// ignored by sglang): the decode's transfer-engine incarnation, so the
    /// prefill never writes this registration's addresses into a restarted
    /// process.
    pub incarnation: Option<u64>,
    /// kvbridge extension in secret mode (a trailing `kvbridge-pair-key=`
    /// frame, ignored by sglang): the key that binds this decode rank's
    /// staging messages to the prefill rank it is sent to.
    pub pair_key: Option<PairKey>,
    /// kvbridge extension (a trailing `kvbridge-aux-batch` frame, ignored
    /// by sglang): this decode rank takes a room's aux slots in one
    /// [`crate::AuxBatch`] message.
    pub aux_batch: bool,
}

/// Prefix of the kvbridge incarnation frame appended to a registration.
pub const INCARNATION_PREFIX: &[u8] = b"kvbridge-incarnation=";

impl<'a> Register<'a> {
    /// Frames before the optional tail.
    pub const MIN_FRAMES: usize = 10;

    /// Decodes a registration; `frames[0]` must be `None`.
    pub fn decode<F: AsRef<[u8]>>(frames: &'a [F], limits: &Limits) -> Result<Self, DecodeError> {
        let c = FrameCursor::new("register", frames, Self::MIN_FRAMES)?;
        let tail = frames.get(20..).unwrap_or(&[]);
        if c.req(0) != REGISTER_ROOM {
            return Err(DecodeError::BadRoom);
        }
        let lists_u32 = |i: usize, field| match c.present(i) {
            Some(f) => PackedLists::decode(field, f, limits),
            None => Ok(PackedLists::empty()),
        };
        let staging_base_ptr = match c.opt(14) {
            None => 0,
            Some(f) => match <[u8; 8]>::try_from(f) {
                Ok(raw) => u64::from_le_bytes(raw),
                Err(_) => {
                    return Err(DecodeError::BadWidth {
                        field: "staging_base_ptr",
                        expected: "0 or 8",
                        got: f.len(),
                    });
                }
            },
        };
        let opt_int =
            |i: usize, field, default| c.opt(i).map_or(Ok(default), |f| parse_u64(field, f));
        Ok(Self {
            endpoint: Cow::Borrowed(ascii("endpoint", c.req(1), limits.max_text_len)?),
            dst_port: parse_uint("dst_port", c.req(2))?,
            mooncake_session_id: Cow::Borrowed(ascii(
                "mooncake_session_id",
                c.req(3),
                limits.max_text_len,
            )?),
            dst_kv_ptrs: PackedArray::decode("dst_kv_ptrs", c.req(4), limits)?,
            dst_aux_ptrs: PackedArray::decode("dst_aux_ptrs", c.req(5), limits)?,
            dst_state_data_ptrs: PackedLists::decode("dst_state_data_ptrs", c.req(6), limits)?,
            dst_tp_rank: parse_u64("dst_tp_rank", c.req(7))?,
            dst_attn_tp_size: parse_u64("dst_attn_tp_size", c.req(8))?,
            dst_kv_item_len: parse_u64("dst_kv_item_len", c.req(9))?,
            dst_state_item_lens: lists_u32(10, "dst_state_item_lens")?,
            dst_state_dim_per_tensor: lists_u32(11, "dst_state_dim_per_tensor")?,
            dst_kv_layer_ids: opt_array(&c, 12, "dst_kv_layer_ids", limits)?,
            dst_state_layer_ids: lists_u32(13, "dst_state_layer_ids")?,
            staging_base_ptr,
            staging_total_size: opt_int(15, "staging_total_size", 0)?,
            dst_dcp_size: opt_int(16, "dst_dcp_size", 1)?,
            dst_dcp_rank: opt_int(17, "dst_dcp_rank", 0)?,
            staging_slot_layer_ids: opt_array(&c, 18, "staging_slot_layer_ids", limits)?,
            dst_kv_item_lens: opt_array(&c, 19, "dst_kv_item_lens", limits)?,
            // kvbridge's trailing frames, by prefix; anything else past
            // frame 19 is an unknown trailing frame.
            incarnation: tail
                .iter()
                .find_map(|f| f.as_ref().strip_prefix(INCARNATION_PREFIX))
                .and_then(|n| parse_u64("incarnation", n).ok()),
            pair_key: tail.iter().find_map(|f| PairKey::from_frame(f.as_ref())),
            aux_batch: tail
                .iter()
                .any(|f| f.as_ref() == crate::extension::AUX_BATCH_CAPABILITY),
        })
    }

    /// The 20 frames the reference's `_register_kv_args` sends (plus the
    /// incarnation, aux-batch and pair-key frames when set).
    pub fn encode(&self) -> Frames<'_> {
        let mut frames = vec![
            Cow::Borrowed(REGISTER_ROOM),
            text_frame(&self.endpoint),
            int_frame(self.dst_port),
            text_frame(&self.mooncake_session_id),
            Cow::Borrowed(self.dst_kv_ptrs.as_bytes()),
            Cow::Borrowed(self.dst_aux_ptrs.as_bytes()),
            Cow::Borrowed(self.dst_state_data_ptrs.as_bytes()),
            int_frame(self.dst_tp_rank),
            int_frame(self.dst_attn_tp_size),
            int_frame(self.dst_kv_item_len),
            Cow::Borrowed(self.dst_state_item_lens.as_bytes()),
            Cow::Borrowed(self.dst_state_dim_per_tensor.as_bytes()),
            Cow::Borrowed(self.dst_kv_layer_ids.as_bytes()),
            Cow::Borrowed(self.dst_state_layer_ids.as_bytes()),
            if self.staging_base_ptr == 0 {
                Cow::Borrowed(&[][..])
            } else {
                Cow::Owned(self.staging_base_ptr.to_le_bytes().to_vec())
            },
            if self.staging_total_size == 0 {
                Cow::Borrowed(&[][..])
            } else {
                int_frame(self.staging_total_size)
            },
            int_frame(self.dst_dcp_size),
            int_frame(self.dst_dcp_rank),
            Cow::Borrowed(self.staging_slot_layer_ids.as_bytes()),
            Cow::Borrowed(self.dst_kv_item_lens.as_bytes()),
        ];
        if let Some(n) = self.incarnation {
            let mut frame = INCARNATION_PREFIX.to_vec();
            frame.extend_from_slice(n.to_string().as_bytes());
            frames.push(Cow::Owned(frame));
        }
        if self.aux_batch {
            frames.push(Cow::Borrowed(crate::extension::AUX_BATCH_CAPABILITY));
        }
        if let Some(key) = &self.pair_key {
            frames.push(Cow::Owned(key.frame()));
        }
        frames
    }

    /// Detaches the message from the frames it borrows.
    pub fn into_owned(self) -> Register<'static> {
        Register {
            endpoint: Cow::Owned(self.endpoint.into_owned()),
            dst_port: self.dst_port,
            mooncake_session_id: Cow::Owned(self.mooncake_session_id.into_owned()),
            dst_kv_ptrs: self.dst_kv_ptrs.into_owned(),
            dst_aux_ptrs: self.dst_aux_ptrs.into_owned(),
            dst_state_data_ptrs: self.dst_state_data_ptrs.into_owned(),
            dst_tp_rank: self.dst_tp_rank,
            dst_attn_tp_size: self.dst_attn_tp_size,
            dst_kv_item_len: self.dst_kv_item_len,
            dst_state_item_lens: self.dst_state_item_lens.into_owned(),
            dst_state_dim_per_tensor: self.dst_state_dim_per_tensor.into_owned(),
            dst_kv_layer_ids: self.dst_kv_layer_ids.into_owned(),
            dst_state_layer_ids: self.dst_state_layer_ids.into_owned(),
            staging_base_ptr: self.staging_base_ptr,
            staging_total_size: self.staging_total_size,
            dst_dcp_size: self.dst_dcp_size,
            dst_dcp_rank: self.dst_dcp_rank,
            staging_slot_layer_ids: self.staging_slot_layer_ids.into_owned(),
            dst_kv_item_lens: self.dst_kv_item_lens.into_owned(),
            incarnation: self.incarnation,
            pair_key: self.pair_key,
            aux_batch: self.aux_batch,
        }
    }
}

/// An optional packed-array frame: absent or empty means no elements.
fn opt_array<'a, F: AsRef<[u8]>, T: Element>(
    c: &FrameCursor<'a, F>,
    i: usize,
    field: &'static str,
    limits: &Limits,
) -> Result<PackedArray<'a, T>, DecodeError> {
    match c.opt(i) {
        Some(f) => PackedArray::decode(field, f, limits),
        None => Ok(PackedArray::empty()),
    }
}

/// The destination pages of a non-dummy transfer request.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct TransferPages<'a> {
    /// Decode pages of the whole request.
    pub dst_kv_indices: PackedArray<'a, i32>,
    /// Decode aux slot.
    pub dst_aux_index: u64,
    /// Decode indices of each state component.
    pub dst_state_indices: PackedLists<'a, i32>,
    /// HiSparse device pages; an empty array travels as "absent".
    pub dst_device_kv_indices: Option<PackedArray<'a, i32>>,
}

/// A transfer request (sglang `TransferInfo`): where one room's KV goes on
/// one decode rank. A dummy request (no pages) tells a prefill rank that it
/// holds no KV this decode rank needs, but must still count it.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Transfer<'a> {
    /// The room.
    pub room: u64,
    /// The decode rank's IP for status messages.
    pub endpoint: Cow<'a, str>,
    /// The decode rank's zmq PULL port.
    pub dst_port: u16,
    /// The decode rank's transfer-engine session.
    pub mooncake_session_id: Cow<'a, str>,
    /// The destination pages; `None` for the dummy form.
    pub pages: Option<TransferPages<'a>>,
    /// How many decode ranks will report for this room.
    pub required_dst_info_num: u64,
    /// Tokens the decode already holds (`None` when the frame is absent or empty).
    pub decode_prefix_len: Option<u64>,
}

impl<'a> Transfer<'a> {
    /// Frames before the optional tail.
    pub const MIN_FRAMES: usize = 8;

    /// Whether this is the dummy form (empty kv-index and aux frames).
    pub fn is_dummy(&self) -> bool {
        self.pages.is_none()
    }

    /// Decodes a transfer request whose first frame is a decimal room.
    pub fn decode<F: AsRef<[u8]>>(frames: &'a [F], limits: &Limits) -> Result<Self, DecodeError> {
        let c = FrameCursor::new("transfer", frames, Self::MIN_FRAMES)?;
        let room = parse_u64("room", c.req(0)).map_err(|_| DecodeError::BadRoom)?;
        let pages = if c.req(4).is_empty() && c.req(5).is_empty() {
            None
        } else {
            if c.req(5).is_empty() {
                return Err(DecodeError::MissingAuxIndex);
            }
            Some(TransferPages {
                dst_kv_indices: PackedArray::decode("dst_kv_indices", c.req(4), limits)?,
                dst_aux_index: parse_u64("dst_aux_index", c.req(5))?,
                dst_state_indices: PackedLists::decode("dst_state_indices", c.req(6), limits)?,
                dst_device_kv_indices: c
                    .opt(9)
                    .map(|f| PackedArray::decode("dst_device_kv_indices", f, limits))
                    .transpose()?,
            })
        };
        Ok(Self {
            room,
            endpoint: Cow::Borrowed(ascii("endpoint", c.req(1), limits.max_text_len)?),
            dst_port: parse_uint("dst_port", c.req(2))?,
            mooncake_session_id: Cow::Borrowed(ascii(
                "mooncake_session_id",
                c.req(3),
                limits.max_text_len,
            )?),
            pages,
            required_dst_info_num: parse_u64("required_dst_info_num", c.req(7))?,
            decode_prefix_len: c
                .opt(8)
                .map(|f| parse_u64("decode_prefix_len", f))
                .transpose()?,
        })
    }

    /// The 10 frames the reference's `send_metadata` sends (`decode_prefix_len`
    /// `None` travels as `"0"`, as the reference writes it).
    pub fn encode(&self) -> Frames<'_> {
        let empty = || Cow::Borrowed(&[][..]);
        let (kv, aux, state, device) = match &self.pages {
            None => (empty(), empty(), empty(), empty()),
            Some(p) => (
                Cow::Borrowed(p.dst_kv_indices.as_bytes()),
                int_frame(p.dst_aux_index),
                Cow::Borrowed(p.dst_state_indices.as_bytes()),
                p.dst_device_kv_indices
                    .as_ref()
                    .map_or_else(empty, |d| Cow::Borrowed(d.as_bytes())),
            ),
        };
        vec![
            int_frame(self.room),
            text_frame(&self.endpoint),
            int_frame(self.dst_port),
            text_frame(&self.mooncake_session_id),
            kv,
            aux,
            state,
            int_frame(self.required_dst_info_num),
            int_frame(self.decode_prefix_len.unwrap_or(0)),
            device,
        ]
    }

    /// Detaches the message from the frames it borrows.
    pub fn into_owned(self) -> Transfer<'static> {
        Transfer {
            room: self.room,
            endpoint: Cow::Owned(self.endpoint.into_owned()),
            dst_port: self.dst_port,
            mooncake_session_id: Cow::Owned(self.mooncake_session_id.into_owned()),
            pages: self.pages.map(|p| TransferPages {
                dst_kv_indices: p.dst_kv_indices.into_owned(),
                dst_aux_index: p.dst_aux_index,
                dst_state_indices: p.dst_state_indices.into_owned(),
                dst_device_kv_indices: p.dst_device_kv_indices.map(PackedArray::into_owned),
            }),
            required_dst_info_num: self.required_dst_info_num,
            decode_prefix_len: self.decode_prefix_len,
        }
    }
}

/// A decode rank aborting a room: `[ABORT, room, decode_ip, decode_port]`.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Abort<'a> {
    /// The room to abort.
    pub room: u64,
    /// Where the prefill sends ABORT_ACK.
    pub decode_ip: Cow<'a, str>,
    /// The decode rank's zmq PULL port.
    pub decode_port: u16,
    /// sglang ≥ 0.5.23's deferred-release generation (trailing frame 4);
    /// absent or unparsable → `None`, as sglang treats it.
    pub generation: Option<u64>,
}

impl<'a> Abort<'a> {
    /// Frames of the reference's form.
    pub const MIN_FRAMES: usize = 4;

    /// Decodes an abort notification.
    pub fn decode<F: AsRef<[u8]>>(frames: &'a [F], limits: &Limits) -> Result<Self, DecodeError> {
        let c = FrameCursor::new("abort", frames, Self::MIN_FRAMES)?;
        Ok(Self {
            room: parse_u64("room", c.req(1))?,
            decode_ip: Cow::Borrowed(ascii("decode_ip", c.req(2), limits.max_text_len)?),
            decode_port: parse_uint("decode_port", c.req(3))?,
            generation: c.opt(4).and_then(|f| parse_u64("generation", f).ok()),
        })
    }

    /// `[ABORT, room, decode_ip, decode_port]`, plus the generation when set.
    pub fn encode(&self) -> Frames<'_> {
        let mut frames = vec![
            Cow::Borrowed(ABORT_TAG),
            int_frame(self.room),
            text_frame(&self.decode_ip),
            int_frame(self.decode_port),
        ];
        if let Some(generation) = self.generation {
            frames.push(int_frame(generation));
        }
        frames
    }

    /// Detaches the message from the frames it borrows.
    pub fn into_owned(self) -> Abort<'static> {
        Abort {
            room: self.room,
            decode_ip: Cow::Owned(self.decode_ip.into_owned()),
            decode_port: self.decode_port,
            generation: self.generation,
        }
    }
}

/// The decode staging allocator's consumption watermark.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Watermark<'a> {
    /// Allocation round the watermark is in.
    pub wm_round: u64,
    /// Byte offset freed up to within that round.
    pub wm_tail: u64,
    /// The prefill session the watermark is for (`""` when absent).
    pub session_id: Cow<'a, str>,
}

impl<'a> Watermark<'a> {
    /// `[WATERMARK, round, tail]`; the session frame is optional.
    pub const MIN_FRAMES: usize = 3;

    /// Decodes a watermark report.
    pub fn decode<F: AsRef<[u8]>>(frames: &'a [F], limits: &Limits) -> Result<Self, DecodeError> {
        let c = FrameCursor::new("watermark", frames, Self::MIN_FRAMES)?;
        Ok(Self {
            wm_round: parse_u64("wm_round", c.req(1))?,
            wm_tail: parse_u64("wm_tail", c.req(2))?,
            session_id: Cow::Borrowed(ascii(
                "session_id",
                c.present(3).unwrap_or(&[]),
                limits.max_text_len,
            )?),
        })
    }

    /// The 4 frames sglang's `_send_watermark` sends.
    pub fn encode(&self) -> Frames<'_> {
        vec![
            Cow::Borrowed(WATERMARK_TAG),
            int_frame(self.wm_round),
            int_frame(self.wm_tail),
            text_frame(&self.session_id),
        ]
    }

    /// Detaches the message from the frames it borrows.
    pub fn into_owned(self) -> Watermark<'static> {
        Watermark {
            wm_round: self.wm_round,
            wm_tail: self.wm_tail,
            session_id: Cow::Owned(self.session_id.into_owned()),
        }
    }
}

/// The decode staging allocator's answer to a STAGING_REQ.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct StagingRsp<'a> {
    /// The room.
    pub room: u64,
    /// The chunk the allocation is for.
    pub chunk_idx: u64,
    /// Offset into the staging ring (−1: not allocated).
    pub offset: i64,
    /// Allocation round (−2 marks an oversized chunk).
    pub round: i64,
    /// End offset of the allocation (−1: not allocated).
    pub end: i64,
    /// The prefill session that asked.
    pub session_id: Cow<'a, str>,
}

impl<'a> StagingRsp<'a> {
    /// All seven frames are required.
    pub const MIN_FRAMES: usize = 7;

    /// Decodes a staging reply.
    pub fn decode<F: AsRef<[u8]>>(frames: &'a [F], limits: &Limits) -> Result<Self, DecodeError> {
        let c = FrameCursor::new("staging_rsp", frames, Self::MIN_FRAMES)?;
        Ok(Self {
            room: parse_u64("room", c.req(1))?,
            chunk_idx: parse_u64("chunk_idx", c.req(2))?,
            offset: parse_i64("offset", c.req(3))?,
            round: parse_i64("round", c.req(4))?,
            end: parse_i64("end", c.req(5))?,
            session_id: Cow::Borrowed(ascii("session_id", c.req(6), limits.max_text_len)?),
        })
    }

    /// The 7 frames of `handle_staging_req`'s reply.
    pub fn encode(&self) -> Frames<'_> {
        vec![
            Cow::Borrowed(STAGING_RSP_TAG),
            int_frame(self.room),
            int_frame(self.chunk_idx),
            int_frame(self.offset),
            int_frame(self.round),
            int_frame(self.end),
            text_frame(&self.session_id),
        ]
    }

    /// Detaches the message from the frames it borrows.
    pub fn into_owned(self) -> StagingRsp<'static> {
        StagingRsp {
            room: self.room,
            chunk_idx: self.chunk_idx,
            offset: self.offset,
            round: self.round,
            end: self.end,
            session_id: Cow::Owned(self.session_id.into_owned()),
        }
    }
}
