//! The two directions of the protocol as enums, with first-frame dispatch.

use crate::codec::Frames;
use crate::error::DecodeError;
use crate::limits::Limits;
use crate::to_decode::{
    ABORT_ACK_TAG, AUX_DATA_TAG, AbortAck, AuxData, CHUNK_READY_TAG, ChunkReady, STAGING_REQ_TAG,
    STATE_DATA_TAG, StagingReq, StateData, Status,
};
use crate::to_prefill::{
    ABORT_TAG, Abort, REGISTER_ROOM, Register, STAGING_RSP_TAG, StagingRsp, Transfer,
    WATERMARK_TAG, Watermark,
};

/// The side of a connection that receives a message.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Side {
    /// A prefill rank's bootstrap (PULL) socket.
    Prefill,
    /// A decode rank's (PULL) socket.
    Decode,
}

impl Side {
    /// `"prefill"` or `"decode"`.
    pub fn as_str(self) -> &'static str {
        match self {
            Side::Prefill => "prefill",
            Side::Decode => "decode",
        }
    }
}

/// What a first frame says about the message, before its body is read.
fn kind_of_tag(first: &[u8]) -> Option<(&'static str, Side)> {
    Some(match first {
        REGISTER_ROOM => ("register", Side::Prefill),
        ABORT_TAG => ("abort", Side::Prefill),
        WATERMARK_TAG => ("watermark", Side::Prefill),
        STAGING_RSP_TAG => ("staging_rsp", Side::Prefill),
        AUX_DATA_TAG => ("aux_data", Side::Decode),
        STATE_DATA_TAG => ("state_data", Side::Decode),
        CHUNK_READY_TAG => ("chunk_ready", Side::Decode),
        STAGING_REQ_TAG => ("staging_req", Side::Decode),
        ABORT_ACK_TAG => ("abort_ack", Side::Decode),
        _ => return None,
    })
}

fn first<F: AsRef<[u8]>>(frames: &[F]) -> Result<&[u8], DecodeError> {
    frames.first().map(AsRef::as_ref).ok_or(DecodeError::Empty)
}

fn wrong_direction(kind: &'static str, travels_to: Side, received_by: Side) -> DecodeError {
    DecodeError::WrongDirection {
        kind,
        travels_to: travels_to.as_str(),
        received_by: received_by.as_str(),
    }
}

/// A message received by a prefill rank.
// A decoded message lives on the stack for one dispatch; boxing the
// registration would allocate for every one to save 200 bytes of stack.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ToPrefill<'a> {
    /// A decode rank's buffer registration.
    Register(Register<'a>),
    /// A room's destination pages (or the dummy form).
    Transfer(Transfer<'a>),
    /// A decode rank aborting a room.
    Abort(Abort<'a>),
    /// The decode staging watermark.
    Watermark(Watermark<'a>),
    /// A staging allocation reply.
    StagingRsp(StagingRsp<'a>),
}

impl<'a> ToPrefill<'a> {
    /// Decodes the frames a prefill rank's socket received.
    pub fn decode<F: AsRef<[u8]>>(frames: &'a [F], limits: &Limits) -> Result<Self, DecodeError> {
        let head = first(frames)?;
        match kind_of_tag(head) {
            Some(("register", _)) => Register::decode(frames, limits).map(Self::Register),
            Some(("abort", _)) => Abort::decode(frames, limits).map(Self::Abort),
            Some(("watermark", _)) => Watermark::decode(frames, limits).map(Self::Watermark),
            Some(("staging_rsp", _)) => StagingRsp::decode(frames, limits).map(Self::StagingRsp),
            Some((kind, side)) => Err(wrong_direction(kind, side, Side::Prefill)),
            None => Transfer::decode(frames, limits).map(Self::Transfer),
        }
    }

    /// The frames the reference sends for this message.
    pub fn encode(&self) -> Frames<'_> {
        match self {
            Self::Register(m) => m.encode(),
            Self::Transfer(m) => m.encode(),
            Self::Abort(m) => m.encode(),
            Self::Watermark(m) => m.encode(),
            Self::StagingRsp(m) => m.encode(),
        }
    }

    /// The kind's name as `kvbridge wire` spells it (docs/cli.md).
    pub fn kind(&self) -> &'static str {
        match self {
            Self::Register(_) => "register",
            Self::Transfer(_) => "transfer",
            Self::Abort(_) => "abort",
            Self::Watermark(_) => "watermark",
            Self::StagingRsp(_) => "staging_rsp",
        }
    }

    /// Detaches the message from the frames it borrows.
    pub fn into_owned(self) -> ToPrefill<'static> {
        match self {
            Self::Register(m) => ToPrefill::Register(m.into_owned()),
            Self::Transfer(m) => ToPrefill::Transfer(m.into_owned()),
            Self::Abort(m) => ToPrefill::Abort(m.into_owned()),
            Self::Watermark(m) => ToPrefill::Watermark(m.into_owned()),
            Self::StagingRsp(m) => ToPrefill::StagingRsp(m.into_owned()),
        }
    }
}

/// A message received by a decode rank.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ToDecode<'a> {
    /// A room's status from one prefill rank.
    Status(Status<'a>),
    /// An aux slot's bytes.
    AuxData(AuxData<'a>),
    /// A host-memory block.
    StateData(StateData<'a>),
    /// A staging chunk was written.
    ChunkReady(ChunkReady<'a>),
    /// A staging allocation request.
    StagingReq(StagingReq<'a>),
    /// An abort acknowledgement.
    AbortAck(AbortAck),
}

impl<'a> ToDecode<'a> {
    /// Decodes the frames a decode rank's socket received.
    pub fn decode<F: AsRef<[u8]>>(frames: &'a [F], limits: &Limits) -> Result<Self, DecodeError> {
        let head = first(frames)?;
        match kind_of_tag(head) {
            Some(("aux_data", _)) => AuxData::decode(frames, limits).map(Self::AuxData),
            Some(("state_data", _)) => StateData::decode(frames, limits).map(Self::StateData),
            Some(("chunk_ready", _)) => ChunkReady::decode(frames, limits).map(Self::ChunkReady),
            Some(("staging_req", _)) => StagingReq::decode(frames, limits).map(Self::StagingReq),
            Some(("abort_ack", _)) => AbortAck::decode(frames, limits).map(Self::AbortAck),
            Some((kind, side)) => Err(wrong_direction(kind, side, Side::Decode)),
            None => Status::decode(frames, limits).map(Self::Status),
        }
    }

    /// The frames the reference sends for this message.
    pub fn encode(&self) -> Frames<'_> {
        match self {
            Self::Status(m) => m.encode(),
            Self::AuxData(m) => m.encode(),
            Self::StateData(m) => m.encode(),
            Self::ChunkReady(m) => m.encode(),
            Self::StagingReq(m) => m.encode(),
            Self::AbortAck(m) => m.encode(),
        }
    }

    /// The kind's name as `kvbridge wire` spells it (docs/cli.md).
    pub fn kind(&self) -> &'static str {
        match self {
            Self::Status(_) => "status",
            Self::AuxData(_) => "aux_data",
            Self::StateData(_) => "state_data",
            Self::ChunkReady(_) => "chunk_ready",
            Self::StagingReq(_) => "staging_req",
            Self::AbortAck(_) => "abort_ack",
        }
    }

    /// Detaches the message from the frames it borrows.
    pub fn into_owned(self) -> ToDecode<'static> {
        match self {
            Self::Status(m) => ToDecode::Status(m.into_owned()),
            Self::AuxData(m) => ToDecode::AuxData(m.into_owned()),
            Self::StateData(m) => ToDecode::StateData(m.into_owned()),
            Self::ChunkReady(m) => ToDecode::ChunkReady(m.into_owned()),
            Self::StagingReq(m) => ToDecode::StagingReq(m.into_owned()),
            Self::AbortAck(m) => ToDecode::AbortAck(m),
        }
    }
}
