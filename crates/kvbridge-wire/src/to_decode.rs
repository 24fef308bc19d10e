//! Messages a prefill rank sends to a decode rank's zmq socket.

use std::borrow::Cow;

use crate::codec::{FrameCursor, Frames, ascii, int_frame, parse_u64, text_frame};
use crate::error::DecodeError;
use crate::kvpoll::KvPoll;
use crate::limits::Limits;

/// First frame of an aux payload sent over zmq.
pub const AUX_DATA_TAG: &[u8] = b"AUX_DATA";
/// First frame of a host-memory block sent over zmq.
pub const STATE_DATA_TAG: &[u8] = b"STATE_DATA";
/// First frame of a staging chunk-written notice.
pub const CHUNK_READY_TAG: &[u8] = b"CHUNK_READY";
/// First frame of a staging allocation request.
pub const STAGING_REQ_TAG: &[u8] = b"STAGING_REQ";
/// First frame of an abort acknowledgement.
pub const ABORT_ACK_TAG: &[u8] = b"ABORT_ACK";

/// A room's terminal (or readiness) status from one prefill rank:
/// `[room, status, prefill_rank]` plus an optional UTF-8 failure reason.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Status<'a> {
    /// The room.
    pub room: u64,
    /// The room's state on that prefill rank.
    pub status: KvPoll,
    /// The sender's unique rank (`_prefill_unique_rank`).
    pub prefill_rank: u64,
    /// Why the room failed, when it did and a reason was given.
    pub failure_reason: Option<Cow<'a, str>>,
}

impl<'a> Status<'a> {
    /// `[room, status, prefill_rank]`.
    pub const MIN_FRAMES: usize = 3;

    /// Decodes a status message whose first frame is a decimal room.
    pub fn decode<F: AsRef<[u8]>>(frames: &'a [F], limits: &Limits) -> Result<Self, DecodeError> {
        let c = FrameCursor::new("status", frames, Self::MIN_FRAMES)?;
        let room = parse_u64("room", c.req(0)).map_err(|_| DecodeError::BadRoom)?;
        let failure_reason = match c.opt(3) {
            None => None,
            Some(raw) if raw.len() > limits.max_reason_len => {
                return Err(DecodeError::Oversized {
                    field: "failure_reason",
                    len: raw.len() as u64,
                    limit: limits.max_reason_len as u64,
                });
            }
            Some(raw) => Some(String::from_utf8_lossy(raw)),
        };
        Ok(Self {
            room,
            status: KvPoll::from_u64(parse_u64("status", c.req(1))?)?,
            prefill_rank: parse_u64("prefill_rank", c.req(2))?,
            failure_reason,
        })
    }

    /// `[room, status, prefill_rank]`, plus the reason when it is non-empty.
    pub fn encode(&self) -> Frames<'_> {
        let mut frames = vec![
            int_frame(self.room),
            int_frame(self.status.as_u8()),
            int_frame(self.prefill_rank),
        ];
        if let Some(reason) = self.failure_reason.as_deref().filter(|r| !r.is_empty()) {
            frames.push(text_frame(reason));
        }
        frames
    }

    /// Detaches the message from the frames it borrows.
    pub fn into_owned(self) -> Status<'static> {
        Status {
            room: self.room,
            status: self.status,
            prefill_rank: self.prefill_rank,
            failure_reason: self.failure_reason.map(|r| Cow::Owned(r.into_owned())),
        }
    }
}

/// Checks a big-endian `u32` length frame against its payload.
fn payload<'a>(
    field: &'static str,
    len_frame: &[u8],
    data: &'a [u8],
    limits: &Limits,
) -> Result<&'a [u8], DecodeError> {
    let raw: [u8; 4] = len_frame.try_into().map_err(|_| DecodeError::BadWidth {
        field,
        expected: "4",
        got: len_frame.len(),
    })?;
    let declared = u32::from_be_bytes(raw);
    if data.len() > limits.max_payload_len {
        return Err(DecodeError::Oversized {
            field,
            len: data.len() as u64,
            limit: limits.max_payload_len as u64,
        });
    }
    if u64::from(declared) != data.len() as u64 {
        return Err(DecodeError::PayloadLength {
            field,
            declared: u64::from(declared),
            actual: data.len() as u64,
        });
    }
    Ok(data)
}

/// The big-endian `u32` length frame (`struct.pack(">I", len)`); payloads
/// beyond `u32::MAX` cannot travel and saturate, so the receiver rejects them.
fn length_frame<'a>(data: &[u8]) -> Cow<'a, [u8]> {
    let len = u32::try_from(data.len()).unwrap_or(u32::MAX);
    Cow::Owned(len.to_be_bytes().to_vec())
}

/// One aux slot's bytes sent over zmq instead of the transfer engine.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct AuxData<'a> {
    /// The room.
    pub room: u64,
    /// Which aux buffer.
    pub buffer_index: u64,
    /// The decode aux slot to write.
    pub aux_index: u64,
    /// The slot's bytes.
    pub data: Cow<'a, [u8]>,
}

impl<'a> AuxData<'a> {
    /// All six frames are required.
    pub const MIN_FRAMES: usize = 6;

    /// Decodes an aux payload; the declared length must match the payload.
    pub fn decode<F: AsRef<[u8]>>(frames: &'a [F], limits: &Limits) -> Result<Self, DecodeError> {
        let c = FrameCursor::new("aux_data", frames, Self::MIN_FRAMES)?;
        Ok(Self {
            room: parse_u64("room", c.req(1))?,
            buffer_index: parse_u64("buffer_index", c.req(2))?,
            aux_index: parse_u64("aux_index", c.req(3))?,
            data: Cow::Borrowed(payload("data", c.req(4), c.req(5), limits)?),
        })
    }

    /// The 6 frames of `send_aux_data_to_endpoint`.
    pub fn encode(&self) -> Frames<'_> {
        vec![
            Cow::Borrowed(AUX_DATA_TAG),
            int_frame(self.room),
            int_frame(self.buffer_index),
            int_frame(self.aux_index),
            length_frame(&self.data),
            Cow::Borrowed(&self.data[..]),
        ]
    }

    /// Detaches the message from the frames it borrows.
    pub fn into_owned(self) -> AuxData<'static> {
        AuxData {
            room: self.room,
            buffer_index: self.buffer_index,
            aux_index: self.aux_index,
            data: Cow::Owned(self.data.into_owned()),
        }
    }
}

/// One host-memory transfer block sent over zmq (intra-node NVLink path).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct StateData<'a> {
    /// The room.
    pub room: u64,
    /// The decode address to write (checked against registered regions by
    /// the receiver, never trusted).
    pub dst_addr: u64,
    /// The block's bytes.
    pub data: Cow<'a, [u8]>,
}

impl<'a> StateData<'a> {
    /// All five frames are required.
    pub const MIN_FRAMES: usize = 5;

    /// Decodes a state block; the declared length must match the payload.
    pub fn decode<F: AsRef<[u8]>>(frames: &'a [F], limits: &Limits) -> Result<Self, DecodeError> {
        let c = FrameCursor::new("state_data", frames, Self::MIN_FRAMES)?;
        Ok(Self {
            room: parse_u64("room", c.req(1))?,
            dst_addr: parse_u64("dst_addr", c.req(2))?,
            data: Cow::Borrowed(payload("data", c.req(3), c.req(4), limits)?),
        })
    }

    /// The 5 frames of `_send_host_blocks_tcp`.
    pub fn encode(&self) -> Frames<'_> {
        vec![
            Cow::Borrowed(STATE_DATA_TAG),
            int_frame(self.room),
            int_frame(self.dst_addr),
            length_frame(&self.data),
            Cow::Borrowed(&self.data[..]),
        ]
    }

    /// Detaches the message from the frames it borrows.
    pub fn into_owned(self) -> StateData<'static> {
        StateData {
            room: self.room,
            dst_addr: self.dst_addr,
            data: Cow::Owned(self.data.into_owned()),
        }
    }
}

/// A staging chunk has been written into the decode's staging ring.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct ChunkReady<'a> {
    /// The room.
    pub room: u64,
    /// The chunk's index.
    pub chunk_idx: u64,
    /// First page of the chunk in the request's page list.
    pub page_start: u64,
    /// Pages in the chunk.
    pub num_pages: u64,
    /// The writer's session.
    pub session_id: Cow<'a, str>,
    /// The writer's unique rank (frame 6; absent in older peers).
    pub prefill_unique_rank: Option<u64>,
}

impl<'a> ChunkReady<'a> {
    /// Frames the reference's decode thread reads.
    pub const MIN_FRAMES: usize = 6;

    /// Decodes a chunk-ready notice.
    pub fn decode<F: AsRef<[u8]>>(frames: &'a [F], limits: &Limits) -> Result<Self, DecodeError> {
        let c = FrameCursor::new("chunk_ready", frames, Self::MIN_FRAMES)?;
        Ok(Self {
            room: parse_u64("room", c.req(1))?,
            chunk_idx: parse_u64("chunk_idx", c.req(2))?,
            page_start: parse_u64("page_start", c.req(3))?,
            num_pages: parse_u64("num_pages", c.req(4))?,
            session_id: Cow::Borrowed(ascii("session_id", c.req(5), limits.max_text_len)?),
            prefill_unique_rank: c
                .opt(6)
                .map(|f| parse_u64("prefill_unique_rank", f))
                .transpose()?,
        })
    }

    /// The 7 frames of `_send_chunk_ready` (6 when the rank is unknown).
    pub fn encode(&self) -> Frames<'_> {
        let mut frames = vec![
            Cow::Borrowed(CHUNK_READY_TAG),
            int_frame(self.room),
            int_frame(self.chunk_idx),
            int_frame(self.page_start),
            int_frame(self.num_pages),
            text_frame(&self.session_id),
        ];
        if let Some(rank) = self.prefill_unique_rank {
            frames.push(int_frame(rank));
        }
        frames
    }

    /// Detaches the message from the frames it borrows.
    pub fn into_owned(self) -> ChunkReady<'static> {
        ChunkReady {
            room: self.room,
            chunk_idx: self.chunk_idx,
            page_start: self.page_start,
            num_pages: self.num_pages,
            session_id: Cow::Owned(self.session_id.into_owned()),
            prefill_unique_rank: self.prefill_unique_rank,
        }
    }
}

/// A prefill rank asking the decode for a staging allocation.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct StagingReq<'a> {
    /// The room.
    pub room: u64,
    /// The chunk the allocation is for.
    pub chunk_idx: u64,
    /// Pages in that chunk.
    pub chunk_num_pages: u64,
    /// The requesting prefill session.
    pub session_id: Cow<'a, str>,
    /// The requester's PP rank (frame 5; absent in older peers).
    pub requester_pp_rank: Option<u64>,
}

impl<'a> StagingReq<'a> {
    /// Frames up to the session id.
    pub const MIN_FRAMES: usize = 5;

    /// Decodes a staging request.
    pub fn decode<F: AsRef<[u8]>>(frames: &'a [F], limits: &Limits) -> Result<Self, DecodeError> {
        let c = FrameCursor::new("staging_req", frames, Self::MIN_FRAMES)?;
        Ok(Self {
            room: parse_u64("room", c.req(1))?,
            chunk_idx: parse_u64("chunk_idx", c.req(2))?,
            chunk_num_pages: parse_u64("chunk_num_pages", c.req(3))?,
            session_id: Cow::Borrowed(ascii("session_id", c.req(4), limits.max_text_len)?),
            requester_pp_rank: c
                .opt(5)
                .map(|f| parse_u64("requester_pp_rank", f))
                .transpose()?,
        })
    }

    /// The frames of `prefetch_staging_reqs`.
    pub fn encode(&self) -> Frames<'_> {
        let mut frames = vec![
            Cow::Borrowed(STAGING_REQ_TAG),
            int_frame(self.room),
            int_frame(self.chunk_idx),
            int_frame(self.chunk_num_pages),
            text_frame(&self.session_id),
        ];
        if let Some(rank) = self.requester_pp_rank {
            frames.push(int_frame(rank));
        }
        frames
    }

    /// Detaches the message from the frames it borrows.
    pub fn into_owned(self) -> StagingReq<'static> {
        StagingReq {
            room: self.room,
            chunk_idx: self.chunk_idx,
            chunk_num_pages: self.chunk_num_pages,
            session_id: Cow::Owned(self.session_id.into_owned()),
            requester_pp_rank: self.requester_pp_rank,
        }
    }
}

/// A prefill rank acknowledging an ABORT: `[ABORT_ACK, room]` (immediate
/// form) or `[ABORT_ACK, room, prefill_rank]` (sent once the room's
/// in-flight writes drained).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct AbortAck {
    /// The aborted room.
    pub room: u64,
    /// The acknowledging rank; `None` in the 2-frame form.
    pub prefill_rank: Option<u64>,
    /// sglang ≥ 0.5.23's generation (trailing frame 3), when valid.
    pub generation: Option<u64>,
}

impl AbortAck {
    /// `[ABORT_ACK, room]`.
    pub const MIN_FRAMES: usize = 2;

    /// Decodes an abort acknowledgement.
    pub fn decode<F: AsRef<[u8]>>(frames: &[F], _limits: &Limits) -> Result<Self, DecodeError> {
        let c = FrameCursor::new("abort_ack", frames, Self::MIN_FRAMES)?;
        let prefill_rank = c.opt(2).map(|f| parse_u64("prefill_rank", f)).transpose()?;
        Ok(Self {
            room: parse_u64("room", c.req(1))?,
            prefill_rank,
            generation: prefill_rank
                .and(c.opt(3))
                .and_then(|f| parse_u64("generation", f).ok()),
        })
    }

    /// The 2- or 3-frame form (plus the generation when set).
    pub fn encode(&self) -> Frames<'static> {
        let mut frames = vec![Cow::Borrowed(ABORT_ACK_TAG), int_frame(self.room)];
        if let Some(rank) = self.prefill_rank {
            frames.push(int_frame(rank));
            if let Some(generation) = self.generation {
                frames.push(int_frame(generation));
            }
        }
        frames
    }
}
