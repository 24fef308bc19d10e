//! # kvbridge-wire
//!
//! The zmq control protocol between prefill and decode ranks, byte-compatible
//! with sglang's Mooncake connector (the reference): every multipart message as
//! a Rust type with `encode` (exactly the frames sglang sends) and a strict
//! `decode`, plus the bootstrap server's HTTP JSON bodies ([`bootstrap`]).
//!
//! **Owns:** framing, field parsing, limits, typed decode errors.
//! **Never:** opens sockets, spawns threads, keeps global state, or panics on
//! peer input. A remote peer is untrusted: every frame is length-checked,
//! integers are strict decimal, packed arrays must be whole, and sizes are
//! bounded by [`Limits`].
//!
//! Decoding is zero-copy: packed index arrays, strings and payloads borrow
//! from the received frames ([`PackedArray`], [`PackedLists`]); call
//! `into_owned` to keep a message past its frames.
//!
//! ```
//! use kvbridge_wire::{Limits, ToDecode, KvPoll};
//! let frames: [&[u8]; 3] = [b"42", b"4", b"0"];
//! let ToDecode::Status(status) = ToDecode::decode(&frames, &Limits::DEFAULT).unwrap() else {
//!     panic!("not a status")
//! };
//! assert_eq!((status.room, status.status), (42, KvPoll::Success));
//! ```

mod codec;
mod error;
mod extension;
mod kvpoll;
mod limits;
mod message;
mod packed;
mod seal;
mod to_decode;
mod to_prefill;

pub mod bootstrap;
pub mod json;

pub use codec::Frames;
pub use error::{DecodeError, IntegerError};
pub use extension::{AUX_BATCH_CAPABILITY, AUX_BATCH_TAG, AuxBatch};
pub use kvpoll::KvPoll;
pub use limits::Limits;
pub use message::{Side, ToDecode, ToPrefill};
pub use packed::{Element, PackedArray, PackedLists};
pub use seal::{MAC_LEN, MAC_PREFIX, PAIR_KEY_PREFIX, PairKey, mac_frame, split_mac};
pub use to_decode::{
    ABORT_ACK_TAG, AUX_DATA_TAG, AbortAck, AuxData, CHUNK_READY_TAG, ChunkReady, STAGING_REQ_TAG,
    STATE_DATA_TAG, StagingReq, StateData, Status,
};
pub use to_prefill::{
    ABORT_TAG, Abort, INCARNATION_PREFIX, REGISTER_ROOM, Register, STAGING_RSP_TAG, StagingRsp,
    Transfer, TransferPages, WATERMARK_TAG, Watermark,
};
